//! Runtime construction per [`crate::Backend`].
//!
//! The CPU runtime (`kestrel_cpu::runtime::CpuRuntime`) has not landed in
//! `kestrel-cpu` yet; until it does, [`start_cpu`] returns
//! [`EngineError::BackendUnavailable`] and engines are built with
//! [`crate::Engine::start_with_runtime`].

use kestrel_pipeline::LoopConfig;

use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::model::ModelContext;
use crate::Engine;

/// Starts an engine on the CPU runtime (constructed on the engine thread).
pub(crate) fn start_cpu(
    _model: ModelContext,
    _loop_config: LoopConfig,
    _config: &EngineConfig,
    _weights: kestrel_model::ModelWeights,
) -> Result<Engine, EngineError> {
    Err(cpu_backend_unavailable())
}

/// The error returned while `kestrel_cpu::runtime` is not available.
pub fn cpu_backend_unavailable() -> EngineError {
    EngineError::BackendUnavailable(
        "the CPU runtime (kestrel_cpu::runtime::CpuRuntime) is not available in this build yet"
            .into(),
    )
}
