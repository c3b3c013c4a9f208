//! Runtime construction per [`crate::Backend`], and the [`Runtime`] impls
//! of the CPU and CUDA runtimes.
//!
//! [`RuntimeConfig`] is the one place a [`Backend`] is matched: it builds
//! the runtime's configuration, answers its [`Capabilities`] before the
//! runtime exists (for checking the engine's configuration), and starts it.
//! The runtime is built by the engine thread itself (inside the closure
//! handed to `Engine::spawn`), so its compute/copy threads (CPU) or its
//! context, streams and buffers (CUDA) are created by their owner. Without
//! a CUDA driver or device, starting CUDA returns `BackendUnavailable` with
//! kestrel-cuda's message. `cuda-host` runs the same CUDA runtime on
//! kestrel-cuda's host device (no GPU needed).

use kestrel_cpu::runtime::{CpuRuntime, CpuRuntimeConfig, StepConfig};
use kestrel_cuda::runtime::backend::Device;
use kestrel_cuda::{CudaRuntime, CudaRuntimeConfig, HostRuntime};
use kestrel_pipeline::{Capabilities, Executor, LoopConfig, NgramSpec};

use crate::config::{Backend, EngineConfig};
use crate::error::EngineError;
use crate::model::{KvStats, ModelContext, Runtime};
use crate::Engine;

/// The configured backend's runtime configuration.
#[derive(Debug, Clone)]
pub(crate) enum RuntimeConfig {
    Cpu(CpuRuntimeConfig),
    Cuda(CudaRuntimeConfig),
    /// The CUDA runtime on kestrel-cuda's host device (CI's stand-in).
    CudaHost(CudaRuntimeConfig),
}

impl RuntimeConfig {
    /// The runtime `config` asks for, serving sequences of `max_seq_len` tokens.
    pub fn new(config: &EngineConfig, max_seq_len: usize) -> Self {
        let step = StepConfig {
            max_rows: config.max_batch_size,
            num_pages: config.kv_pages,
            page_size: config.page_size,
            max_seq_len,
            enable_prefix_cache: config.enable_prefix_cache,
            ..StepConfig::default()
        };
        match config.backend {
            Backend::Cpu => RuntimeConfig::Cpu(CpuRuntimeConfig {
                threads: config.threads,
                step,
                numerics: config.numerics,
                weight_pages: config.weight_pages,
                image_cache: config.images.cache,
            }),
            Backend::Cuda | Backend::CudaHost => {
                let cfg = CudaRuntimeConfig {
                    step,
                    ..CudaRuntimeConfig::default()
                };
                if config.backend == Backend::Cuda {
                    RuntimeConfig::Cuda(cfg)
                } else {
                    RuntimeConfig::CudaHost(cfg)
                }
            }
        }
    }

    /// What the runtime will be able to do: the same value its
    /// [`Executor::capabilities`] answers once built.
    pub fn capabilities(&self) -> Capabilities {
        match self {
            RuntimeConfig::Cpu(cfg) => CpuRuntime::capabilities_of(cfg),
            RuntimeConfig::Cuda(cfg) | RuntimeConfig::CudaHost(cfg) => {
                CudaRuntime::capabilities_of(cfg)
            }
        }
    }

    /// Starts an engine on the runtime (built on the engine thread), with
    /// the model's vision side if it has one (image rows, and the region
    /// model's point / detect where it has one, on either runtime).
    pub fn start(
        self,
        model: ModelContext,
        loop_config: LoopConfig,
        speculate: Option<NgramSpec>,
        weights: kestrel_model::ModelWeights,
        vision: Option<kestrel_model::VisionModel>,
    ) -> Result<Engine, EngineError> {
        match self {
            RuntimeConfig::Cpu(cfg) => {
                Engine::spawn(model, loop_config, "cpu".into(), speculate, move || {
                    let mut rt =
                        CpuRuntime::new(weights, cfg).map_err(|e| unavailable("CPU", e))?;
                    if let Some(v) = vision {
                        rt = rt.with_vision(v).map_err(|e| unavailable("CPU", e))?;
                    }
                    rt.record_timings(true).map_err(|e| unavailable("CPU", e))?;
                    Ok(rt)
                })
            }
            RuntimeConfig::Cuda(cfg) => spawn_cuda(
                model,
                loop_config,
                speculate,
                weights,
                vision,
                cfg,
                "cuda",
                CudaRuntime::new,
            ),
            RuntimeConfig::CudaHost(cfg) => spawn_cuda(
                model,
                loop_config,
                speculate,
                weights,
                vision,
                cfg,
                "cuda-host",
                HostRuntime::new,
            ),
        }
    }
}

/// Starts an engine on the CUDA runtime over the device `new` opens, with
/// the vision encoder and projector (and the region model, if any) of a
/// vision model; its forward calls then hold the image's bidirectional
/// prefix whole (`forward_rows` at least the prefix's rows).
#[allow(clippy::too_many_arguments)]
fn spawn_cuda<D: Device>(
    model: ModelContext,
    loop_config: LoopConfig,
    speculate: Option<NgramSpec>,
    weights: kestrel_model::ModelWeights,
    vision: Option<kestrel_model::VisionModel>,
    mut cfg: CudaRuntimeConfig,
    name: &'static str,
    new: fn(
        kestrel_model::ModelWeights,
        CudaRuntimeConfig,
    ) -> Result<kestrel_cuda::Runtime<D>, kestrel_cuda::CudaError>,
) -> Result<Engine, EngineError> {
    Engine::spawn(model, loop_config, name.into(), speculate, move || {
        if let Some(v) = &vision {
            let prefix = v.config.text.prefix_attn;
            cfg.step.forward_rows = cfg.step.forward_rows.max(prefix);
        }
        let mut rt = new(weights, cfg).map_err(|e| unavailable("CUDA", e))?;
        if let Some(v) = &vision {
            rt = rt.with_vision(v).map_err(|e| unavailable("CUDA", e))?;
            if v.region.is_some() {
                rt = rt.with_region(v).map_err(|e| unavailable("CUDA", e))?;
            }
        }
        rt.record_timings(true)
            .map_err(|e| unavailable("CUDA", e))?;
        Ok(rt)
    })
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

impl<D: Device> Runtime for kestrel_cuda::Runtime<D> {
    fn kv_stats(&self) -> KvStats {
        kestrel_cuda::Runtime::kv_stats(self)
    }

    fn image_stats(&self) -> crate::model::ImageStats {
        crate::model::ImageStats {
            encodes: self.encoder_runs(),
            cache_hits: self.image_cache_hits(),
        }
    }
}

impl Runtime for CpuRuntime {
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

    fn image_stats(&self) -> crate::model::ImageStats {
        let v = self.vision_stats();
        crate::model::ImageStats {
            encodes: v.encoder_runs,
            cache_hits: v.cache_hits,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The capabilities the engine checks its configuration against are
    /// the ones each runtime answers (CUDA and the CPU: all of them).
    #[test]
    fn configured_capabilities_are_the_runtimes() {
        let cpu = RuntimeConfig::new(&EngineConfig::default(), 512).capabilities();
        assert!(cpu.logit_bias && cpu.drafts() && cpu.chunked_prefill && cpu.readmission);
        assert!(cpu.prompt_logprobs, "the CPU runtime scores prompts");
        let cuda_config = EngineConfig {
            backend: Backend::Cuda,
            ..EngineConfig::default()
        };
        let cuda = RuntimeConfig::new(&cuda_config, 512).capabilities();
        assert!(cuda.logit_bias && cuda.drafts() && cuda.chunked_prefill && cuda.readmission);
        assert!(
            !cuda.prompt_logprobs,
            "the CUDA runtime does not score prompts"
        );
        assert_eq!(cuda.max_rows, cuda_config.max_batch_size);
    }
}
