//! The OpenAI-compatible HTTP API (axum): `POST /v1/chat/completions`,
//! `POST /v1/completions` (unary and SSE streaming), `GET /v1/models`,
//! vLLM's `POST /tokenize` and `POST /detokenize`, `/health`, `/version`
//! and `/metrics`, on one engine beside gRPC; and a chat page for people at
//! `GET /` ([`page`]). Beside it, the Moondream API's skills
//! (`POST /v1/query`, `/v1/caption`, `/v1/point`, `/v1/detect`,
//! [`moondream`]) for vision models, and OpenAI chats with an `image_url`
//! part are answered as a query.
//!
//! **Invariant:** OpenAI JSON stops here, like protobuf stops at
//! [`crate::convert`]: [`request`] maps it onto the engine's one
//! `GenerateRequest`, whose rules live in `kestrel_engine::validate`;
//! errors come back in OpenAI's shape ([`ApiError`]). Bodies are capped
//! ([`HttpOptions::max_body_bytes`], 413) before they are parsed.

mod error;
mod handlers;
pub mod moondream;
mod page;
mod request;
mod schema;
mod tokenize;
mod tools;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use kestrel_engine::{Engine, Health};
use serde_json::json;

use error::json_response;
pub use error::{ApiError, FieldNames, ParamNames};
pub use request::{MAX_N, MAX_PROMPTS};

use crate::{RunningServer, ServeError};
use request::Endpoint;

/// Largest request body read (bigger ones get 413 before parsing); the
/// same cap as the gRPC service's messages.
pub const MAX_BODY_BYTES: usize = crate::MAX_MESSAGE_BYTES;

/// Settings of the HTTP API.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// The model id clients must send (and `/v1/models` lists); `None`:
    /// the loaded model's name.
    pub served_model_name: Option<String>,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
}

impl Default for HttpOptions {
    fn default() -> Self {
        Self {
            served_model_name: None,
            max_body_bytes: MAX_BODY_BYTES,
        }
    }
}

/// What every handler shares.
#[derive(Debug)]
struct App {
    engine: Engine,
    model_id: String,
    /// When the server started (the model's `created`).
    created: u64,
    max_body_bytes: usize,
    /// How the model writes tool calls (read from its chat template once).
    tool_format: tools::ToolFormat,
}

/// The API's routes over `engine`, for callers that serve them themselves.
pub fn router(engine: Engine, options: &HttpOptions) -> Router {
    let model_id = options
        .served_model_name
        .clone()
        .unwrap_or_else(|| engine.model_info().name);
    let tool_format = tools::ToolFormat::of_model(engine.model());
    let app = Arc::new(App {
        tool_format,
        engine,
        model_id,
        created: handlers::unix_now(),
        max_body_bytes: options.max_body_bytes,
    });
    Router::new()
        .route("/", get(page::chat_page))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/query", post(moondream_query))
        .route("/v1/caption", post(moondream_caption))
        .route("/v1/point", post(moondream_point))
        .route("/v1/detect", post(moondream_detect))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .fallback(|uri: Uri| async move { ApiError::no_route(uri.path()) })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(DefaultBodyLimit::max(options.max_body_bytes))
        .with_state(app)
}

/// Binds `addr` and serves the HTTP API on a background task until
/// `shutdown` completes (then in-flight requests finish). Returns once the
/// socket is bound.
pub async fn serve_http(
    engine: Engine,
    addr: SocketAddr,
    options: HttpOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<RunningServer, ServeError> {
    let (listener, local_addr) = crate::bind(addr).await?;
    let app = router(engine, &options);
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(ServeError::Http)
    });
    tracing::info!(%local_addr, "OpenAI-compatible HTTP server listening");
    Ok(RunningServer { local_addr, task })
}

/// The body, or the error for one over the cap (413) or unreadable (400).
fn body(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(limit)
        } else {
            ApiError::bad_body(r.body_text())
        }
    })
}

async fn generate(app: &App, endpoint: Endpoint, raw: Result<Bytes, BytesRejection>) -> Response {
    let bytes = match body(raw, app.max_body_bytes) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    match request::parse(endpoint, &bytes, &app.model_id, &app.tool_format) {
        Ok(plan) => handlers::run(app, plan).await,
        Err(e) => e.into_response(),
    }
}

async fn chat_completions(
    State(app): State<Arc<App>>,
    raw: Result<Bytes, BytesRejection>,
) -> Response {
    generate(&app, Endpoint::Chat, raw).await
}

async fn completions(State(app): State<Arc<App>>, raw: Result<Bytes, BytesRejection>) -> Response {
    generate(&app, Endpoint::Completions, raw).await
}

async fn moondream_skill(
    app: &App,
    skill: moondream::Skill,
    raw: Result<Bytes, BytesRejection>,
) -> Response {
    let bytes = match body(raw, app.max_body_bytes) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    match moondream::parse(skill, &bytes, &app.model_id) {
        Ok(req) => moondream::run(app, req).await,
        Err(e) => e.into_response(),
    }
}

async fn moondream_query(
    State(app): State<Arc<App>>,
    raw: Result<Bytes, BytesRejection>,
) -> Response {
    moondream_skill(&app, moondream::Skill::Query, raw).await
}

async fn moondream_caption(
    State(app): State<Arc<App>>,
    raw: Result<Bytes, BytesRejection>,
) -> Response {
    moondream_skill(&app, moondream::Skill::Caption, raw).await
}

async fn moondream_point(
    State(app): State<Arc<App>>,
    raw: Result<Bytes, BytesRejection>,
) -> Response {
    moondream_skill(&app, moondream::Skill::Point, raw).await
}

async fn moondream_detect(
    State(app): State<Arc<App>>,
    raw: Result<Bytes, BytesRejection>,
) -> Response {
    moondream_skill(&app, moondream::Skill::Detect, raw).await
}

async fn tokenize(State(app): State<Arc<App>>, raw: Result<Bytes, BytesRejection>) -> Response {
    match body(raw, app.max_body_bytes) {
        Ok(bytes) => tokenize::tokenize(&app, &bytes).await,
        Err(e) => e.into_response(),
    }
}

async fn detokenize(State(app): State<Arc<App>>, raw: Result<Bytes, BytesRejection>) -> Response {
    match body(raw, app.max_body_bytes) {
        Ok(bytes) => tokenize::detokenize(&app, &bytes).await,
        Err(e) => e.into_response(),
    }
}

fn model_object(app: &App) -> serde_json::Value {
    let info = app.engine.model_info();
    json!({
        "id": app.model_id,
        "object": "model",
        "created": app.created,
        "owned_by": "kestrel",
        "root": info.name,
        "max_model_len": info.context_length,
    })
}

async fn models(State(app): State<Arc<App>>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [model_object(&app)]}),
    )
}

async fn model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    if id == app.model_id {
        json_response(StatusCode::OK, &model_object(&app))
    } else {
        ApiError::model_not_found(&id, &app.model_id).into_response()
    }
}

/// 200 while the engine serves, 503 (with the reason) when it does not.
async fn health(State(app): State<Arc<App>>) -> Response {
    match app.engine.health() {
        Health::Serving => json_response(StatusCode::OK, &json!({"status": "serving"})),
        Health::NotServing(why) => json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "not_serving", "reason": why}),
        ),
    }
}

async fn version() -> Response {
    json_response(
        StatusCode::OK,
        &json!({"version": env!("CARGO_PKG_VERSION")}),
    )
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    crate::metrics_http::exposition(&app.engine)
}
