//! kestrel-server: the `kestrel.v1.Kestrel` gRPC service (tonic), with the
//! standard health and reflection services, the OpenAI-compatible HTTP API
//! ([`openai`], axum), a Prometheus `/metrics` responder, and the library
//! half of the `kestrel` CLI.
//!
//! **Architecture invariant:** this is the only crate that knows protobuf
//! or OpenAI JSON. Generated types live in [`pb`]; [`convert`] turns them
//! into `kestrel-engine` requests by hand, [`openai`] does the same for
//! JSON, and the engine never sees either wire format.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use kestrel_engine::{Engine, EngineConfig};
//! let engine = Engine::start(EngineConfig::default(), |_| {})?;
//! let addr = "127.0.0.1:0".parse()?;
//! let server = kestrel_server::serve(engine, addr, std::future::pending()).await?;
//! println!("serving on {}", server.local_addr());
//! server.wait().await?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

pub mod convert;
pub mod image_url;
pub mod metrics_http;
pub mod openai;
pub mod service;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use kestrel_engine::{Engine, Health};
use tokio::sync::watch;
use tonic_health::ServingStatus;

pub use openai::{serve_http, HttpOptions};
pub use service::KestrelService;

/// Code generated from `proto/kestrel/v1/kestrel.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("kestrel.v1");

    /// The encoded `FileDescriptorSet` of `kestrel.proto` (for reflection).
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/kestrel_descriptor.bin"));
}

/// Largest request message the gRPC service decodes (larger ones are
/// OUT_OF_RANGE, as the proto documents). The engine refuses prompts over
/// `kestrel_engine::validate::MAX_PROMPT_BYTES` before tokenizing them.
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// The Kestrel gRPC service as served: message limits set and every call
/// stamped with its [`service::Arrival`].
pub type Service = tonic::service::interceptor::InterceptedService<
    pb::kestrel_server::KestrelServer<KestrelService>,
    fn(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status>,
>;

/// The tonic service for `engine`, ready for `Server::add_service`.
pub fn service(engine: Engine) -> Service {
    let server = pb::kestrel_server::KestrelServer::new(KestrelService::new(engine))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    tonic::service::interceptor::InterceptedService::new(server, service::stamp_arrival)
}

/// The full name of the Kestrel service, as health checks use it.
pub const SERVICE_NAME: &str = "kestrel.v1.Kestrel";

/// How often the health service re-reads `engine.health()`.
const HEALTH_POLL: Duration = Duration::from_millis(500);

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The listening socket could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The reflection service could not be built from the descriptors.
    #[error("cannot build the reflection service")]
    Reflection(#[source] tonic_reflection::server::Error),
    /// The HTTP/2 server failed.
    #[error("the gRPC server failed")]
    Transport(#[source] std::io::Error),
    /// The HTTP (OpenAI API) server failed.
    #[error("the HTTP server failed")]
    Http(#[source] std::io::Error),
    /// The metrics (Prometheus scrape) server failed.
    #[error("the metrics server failed")]
    Metrics(#[source] std::io::Error),
    /// The server task panicked or was cancelled.
    #[error("the server task ended abnormally")]
    Join(#[source] tokio::task::JoinError),
}

/// A server running on a background task.
#[derive(Debug)]
pub struct RunningServer {
    local_addr: SocketAddr,
    task: tokio::task::JoinHandle<Result<(), ServeError>>,
}

impl RunningServer {
    /// The bound address (the real port when serving on port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits until the server has shut down (after the shutdown signal
    /// fired and in-flight RPCs finished).
    pub async fn wait(self) -> Result<(), ServeError> {
        self.task.await.map_err(ServeError::Join)?
    }
}

/// Binds `addr` and serves Kestrel, `grpc.health.v1.Health` and server
/// reflection (v1 and v1alpha) on a background task until `shutdown`
/// completes. Returns once the socket is bound.
pub async fn serve(
    engine: Engine,
    addr: SocketAddr,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<RunningServer, ServeError> {
    let (listener, local_addr) = bind(addr).await?;

    let reflection_v1 = reflection().build_v1().map_err(ServeError::Reflection)?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(ServeError::Reflection)?;

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    tokio::spawn(watch_health(
        engine.clone(),
        health_reporter,
        stop_rx.clone(),
    ));

    // tonic's routes served by axum (HTTP/1 and h2c), not by tonic's
    // transport: that transport wraps every call in its own `grpc-timeout`
    // timer, outside any layer of ours, which answers CANCELLED when it
    // fires first. The Kestrel service enforces a unary call's deadline
    // itself, as DEADLINE_EXCEEDED (`service::Arrival`).
    let routes = tonic::service::Routes::new(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(service(engine))
        .prepare()
        .into_axum_router();
    let task = tokio::spawn(async move {
        axum::serve(listener, routes)
            .with_graceful_shutdown(stopped(stop_rx))
            .await
            .map_err(ServeError::Transport)
    });
    tracing::info!(%local_addr, "gRPC server listening");
    Ok(RunningServer { local_addr, task })
}

/// Binds `addr` for one of our axum servers (gRPC, HTTP): the listener,
/// which sets TCP_NODELAY on every connection so a streamed token leaves
/// at once rather than after Nagle's delay, and the bound address.
async fn bind(
    addr: SocketAddr,
) -> Result<(impl axum::serve::Listener<Addr = SocketAddr>, SocketAddr), ServeError> {
    use axum::serve::ListenerExt as _;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })?;
    let local_addr = listener
        .local_addr()
        .map_err(|source| ServeError::Bind { addr, source })?;
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
    });
    Ok((listener, local_addr))
}

fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}

/// Completes when `stop` turns true (or its sender is gone).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Keeps the health service in step with `engine.health()` for both the
/// overall ("") and the Kestrel service names, until `stop`: NOT_SERVING
/// from the moment a drain (`Engine::shutdown`) begins.
async fn watch_health(
    engine: Engine,
    reporter: tonic_health::server::HealthReporter,
    mut stop: watch::Receiver<bool>,
) {
    let mut last = None;
    // The drain flips health at once rather than at the next poll.
    let draining = engine.shutting_down();
    tokio::pin!(draining);
    let mut drain_seen = false;
    loop {
        let status = if *stop.borrow() {
            ServingStatus::NotServing
        } else {
            match engine.health() {
                Health::Serving => ServingStatus::Serving,
                Health::NotServing(why) => {
                    if last != Some(ServingStatus::NotServing) {
                        tracing::warn!(%why, "engine not serving");
                    }
                    ServingStatus::NotServing
                }
            }
        };
        if last != Some(status) {
            for name in ["", SERVICE_NAME] {
                reporter.set_service_status(name, status).await;
            }
            last = Some(status);
        }
        if *stop.borrow() {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(HEALTH_POLL) => {}
            _ = stop.changed() => {}
            _ = &mut draining, if !drain_seen => drain_seen = true,
        }
    }
}
