//! [`BenchRuntime`]: what the bench needs from a runtime beyond the
//! pipeline's `Executor` (per-step device timings, weight bytes, a name),
//! implemented for kestrel-cpu's `CpuRuntime` and kestrel-cuda's
//! `CudaRuntime`. The harness is generic over it, so every table and picture
//! means the same thing on either backend: the CPU's timings are its compute
//! thread's clock, the GPU's are CUDA events converted to host instants.

use anyhow::Context as _;
use kestrel_cpu::runtime::CpuRuntime;
use kestrel_cuda::CudaRuntime;
use kestrel_pipeline::{Executor, SamplingParams, StepTiming};

/// A runtime the bench can drive and time.
pub trait BenchRuntime: Executor<Params = SamplingParams> {
    /// Start or stop recording per-step device timings.
    fn record_timings(&mut self, on: bool) -> anyhow::Result<()>;
    /// Timings of the steps committed since the last call, in commit order.
    fn take_timings(&mut self) -> Vec<StepTiming>;
    /// Bytes of weights the forward reads per step.
    fn weight_bytes(&self) -> usize;
    /// The backend as the report names it (`cpu`, `cuda (<device>)`).
    fn describe(&self) -> String;
}

impl BenchRuntime for CpuRuntime {
    fn record_timings(&mut self, on: bool) -> anyhow::Result<()> {
        CpuRuntime::record_timings(self, on);
        Ok(())
    }

    fn take_timings(&mut self) -> Vec<StepTiming> {
        CpuRuntime::drain_timings(self).collect()
    }

    fn weight_bytes(&self) -> usize {
        CpuRuntime::weight_bytes(self)
    }

    fn describe(&self) -> String {
        "cpu".to_owned()
    }
}

impl BenchRuntime for CudaRuntime {
    fn record_timings(&mut self, on: bool) -> anyhow::Result<()> {
        CudaRuntime::record_timings(self, on).context("CUDA event timings")
    }

    fn take_timings(&mut self) -> Vec<StepTiming> {
        CudaRuntime::drain_timings(self).collect()
    }

    fn weight_bytes(&self) -> usize {
        CudaRuntime::weight_bytes(self)
    }

    fn describe(&self) -> String {
        format!("cuda ({})", self.device_name())
    }
}
