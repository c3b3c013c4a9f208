//! Runtime construction per [`crate::Backend`], and the [`Runtime`] impl of
//! the CPU runtime.
//!
//! The runtime is built by the engine thread itself (inside the closure
//! handed to `Engine::spawn`), so its compute/copy threads and buffers are
//! created by their owner. CUDA is not part of this build.

use std::time::Instant;

use kestrel_cpu::runtime::{CpuRuntime, CpuRuntimeConfig};
use kestrel_pipeline::LoopConfig;

use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::model::{KvStats, ModelContext, Runtime};
use crate::Engine;

/// Starts an engine on the CPU runtime.
pub(crate) fn start_cpu(
    model: ModelContext,
    loop_config: LoopConfig,
    config: &EngineConfig,
    weights: kestrel_model::ModelWeights,
) -> Result<Engine, EngineError> {
    let cfg = CpuRuntimeConfig {
        threads: config.threads,
        max_rows: config.max_batch_size,
        num_pages: config.kv_pages,
        page_size: config.page_size,
        max_seq_len: loop_config.max_seq_len,
        enable_prefix_cache: config.enable_prefix_cache,
        ..CpuRuntimeConfig::default()
    };
    Engine::spawn(model, loop_config, "cpu".into(), move || {
        let mut rt = CpuRuntime::new(weights, cfg).map_err(|e| {
            // EngineError's variants are fixed for API users; keep the cause chain in the text.
            let mut msg = format!("CPU runtime: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            EngineError::BackendUnavailable(msg)
        })?;
        rt.record_timings(true);
        Ok(rt)
    })
}

impl Runtime for CpuRuntime {
    fn kv_stats(&self) -> KvStats {
        CpuRuntime::kv_stats(self)
    }

    fn take_device_intervals(&mut self, out: &mut Vec<(Instant, Instant)>) {
        out.extend(
            self.take_timings()
                .into_iter()
                .map(|t| (t.forward_start, t.sample_end)),
        );
    }
}
