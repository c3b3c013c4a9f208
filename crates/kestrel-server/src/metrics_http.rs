//! The Prometheus scrape listener (`kestrel serve --metrics-addr`): an axum
//! router with `GET /metrics` (the engine's text exposition), 405 for any
//! other method there and 404 elsewhere, served like the OpenAI API
//! (`crate::bind`, graceful shutdown). [`exposition`] is the one response
//! both listeners' `/metrics` answer with.

use std::future::Future;
use std::net::SocketAddr;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use kestrel_engine::Engine;

use crate::{RunningServer, ServeError};

/// Prometheus text exposition format.
const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// `engine`'s metrics as a Prometheus text response.
pub fn exposition(engine: &Engine) -> Response {
    (
        [(header::CONTENT_TYPE, CONTENT_TYPE)],
        engine.metrics_text(),
    )
        .into_response()
}

/// A plain-text answer for what the scrape listener does not serve.
fn refusal(status: StatusCode, body: &'static str) -> Response {
    (status, [(header::CONTENT_TYPE, CONTENT_TYPE)], body).into_response()
}

/// The scrape listener's routes over `engine`.
pub fn router(engine: Engine) -> Router {
    Router::new()
        .route("/metrics", get(move || async move { exposition(&engine) }))
        .fallback(|| async { refusal(StatusCode::NOT_FOUND, "not found; try /metrics\n") })
        .method_not_allowed_fallback(|| async {
            refusal(StatusCode::METHOD_NOT_ALLOWED, "use GET\n")
        })
}

/// Binds `addr` and serves `/metrics` on a background task until
/// `shutdown` completes. Returns once the socket is bound.
pub async fn serve_metrics(
    engine: Engine,
    addr: SocketAddr,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<RunningServer, ServeError> {
    let (listener, local_addr) = crate::bind(addr).await?;
    let app = router(engine);
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(ServeError::Metrics)
    });
    tracing::info!(%local_addr, "metrics listening");
    Ok(RunningServer { local_addr, task })
}
