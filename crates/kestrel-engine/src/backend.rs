//! Runtime construction per [`crate::Backend`], and the [`Runtime`] impls
//! of the CPU and CUDA runtimes.
//!
//! The runtime is built by the engine thread itself (inside the closure
//! handed to `Engine::spawn`), so its compute/copy threads (CPU) or its
//! context, streams and buffers (CUDA) are created by their owner. Without
//! a CUDA driver or device, `start_cuda` returns `BackendUnavailable` with
//! kestrel-cuda's message. `start_cuda_host` runs the same CUDA runtime on
//! kestrel-cuda's host device (no GPU needed).

use kestrel_cpu::runtime::{CpuRuntime, CpuRuntimeConfig};
use kestrel_cuda::runtime::backend::Device;
use kestrel_cuda::{CudaError, CudaRuntime, CudaRuntimeConfig, HostRuntime};
use kestrel_pipeline::{Executor, LoopConfig, NgramSpec};

use crate::config::{Backend, EngineConfig};
use crate::error::EngineError;
use crate::model::{KvStats, ModelContext, Runtime};
use crate::Engine;

/// Starts an engine on the CPU runtime.
pub(crate) fn start_cpu(
    model: ModelContext,
    loop_config: LoopConfig,
    config: &EngineConfig,
    speculate: Option<NgramSpec>,
    weights: kestrel_model::ModelWeights,
) -> Result<Engine, EngineError> {
    let cfg = CpuRuntimeConfig {
        threads: config.threads,
        max_rows: config.max_batch_size,
        num_pages: config.kv_pages,
        page_size: config.page_size,
        max_seq_len: loop_config.max_seq_len,
        enable_prefix_cache: config.enable_prefix_cache,
        numerics: config.numerics,
        ..CpuRuntimeConfig::default()
    };
    Engine::spawn(model, loop_config, "cpu".into(), speculate, move || {
        let mut rt = CpuRuntime::new(weights, cfg).map_err(|e| unavailable("CPU", e))?;
        rt.record_timings(true).map_err(|e| unavailable("CPU", e))?;
        Ok(rt)
    })
}

/// Whether `backend`'s runtime verifies drafts ([`Runtime::DRAFTS`]), for
/// checking a configuration before the runtime exists.
pub(crate) fn verifies_drafts(backend: Backend) -> bool {
    match backend {
        Backend::Cpu => <CpuRuntime as Runtime>::DRAFTS,
        Backend::Cuda => <CudaRuntime as Runtime>::DRAFTS,
        Backend::CudaHost => <HostRuntime as Runtime>::DRAFTS,
    }
}

/// The runtime's own typed error, kept as the source.
fn unavailable(
    backend: &'static str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> EngineError {
    EngineError::BackendUnavailable {
        backend,
        source: Box::new(e),
    }
}

/// Starts an engine on the CUDA runtime (device 0). Fails with
/// `BackendUnavailable` (never a panic) when no driver, device or NVRTC is present.
pub(crate) fn start_cuda(
    model: ModelContext,
    loop_config: LoopConfig,
    config: &EngineConfig,
    speculate: Option<NgramSpec>,
    weights: kestrel_model::ModelWeights,
) -> Result<Engine, EngineError> {
    start_cuda_on(
        model,
        loop_config,
        config,
        speculate,
        weights,
        CudaRuntime::new,
    )
}

/// Starts an engine on the CUDA runtime's host device (no GPU).
pub(crate) fn start_cuda_host(
    model: ModelContext,
    loop_config: LoopConfig,
    config: &EngineConfig,
    speculate: Option<NgramSpec>,
    weights: kestrel_model::ModelWeights,
) -> Result<Engine, EngineError> {
    start_cuda_on(
        model,
        loop_config,
        config,
        speculate,
        weights,
        HostRuntime::new,
    )
}

/// The CUDA runtime on the device `new` opens, configured from `config`.
fn start_cuda_on<D: Device>(
    model: ModelContext,
    loop_config: LoopConfig,
    config: &EngineConfig,
    speculate: Option<NgramSpec>,
    weights: kestrel_model::ModelWeights,
    new: fn(
        kestrel_model::ModelWeights,
        CudaRuntimeConfig,
    ) -> Result<kestrel_cuda::Runtime<D>, CudaError>,
) -> Result<Engine, EngineError> {
    let cfg = CudaRuntimeConfig {
        max_rows: config.max_batch_size,
        num_pages: config.kv_pages,
        page_size: config.page_size,
        max_seq_len: loop_config.max_seq_len,
        enable_prefix_cache: config.enable_prefix_cache,
        ..CudaRuntimeConfig::default()
    };
    let name = config.backend.as_str().into();
    Engine::spawn(model, loop_config, name, speculate, move || {
        let mut rt = new(weights, cfg).map_err(|e| unavailable("CUDA", e))?;
        rt.record_timings(true)
            .map_err(|e| unavailable("CUDA", e))?;
        Ok(rt)
    })
}

impl<D: Device> Runtime for kestrel_cuda::Runtime<D> {
    /// The device sampler (`kernels/sample.cu`) has no per-token bias yet.
    const LOGIT_BIAS: bool = false;
    /// No multi-token verification on the device yet (`max_draft_tokens` 0).
    const DRAFTS: bool = false;

    fn kv_stats(&self) -> KvStats {
        kestrel_cuda::Runtime::kv_stats(self)
    }
}

impl Runtime for CpuRuntime {
    const PROMPT_LOGPROBS: bool = true;

    fn kv_stats(&self) -> KvStats {
        CpuRuntime::kv_stats(self)
    }

    fn score_prompt(
        &self,
        tokens: &[u32],
        top: usize,
    ) -> Result<Vec<kestrel_cpu::PositionLogprobs>, kestrel_pipeline::Cause> {
        CpuRuntime::score_prompt(self, tokens, top).map_err(kestrel_pipeline::Cause::new)
    }

    fn host_compute_threads(&self) -> usize {
        self.compute_threads()
    }
}
