//! Shared by the engine's integration tests.

/// A two-worker tokio runtime with timers and I/O, for driving the async API.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}
