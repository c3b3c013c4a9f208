//! [`BenchRuntime`]: what the bench needs from a runtime beyond the
//! pipeline's `Executor` (which also gives the per-step device timings and
//! the runtime's `capabilities()`, read through the bench's wrapper):
//! weight bytes (per step, and streamed per token where DRAM bounds a
//! single stream) and a name,
//! implemented for kestrel-cpu's `CpuRuntime` and kestrel-cuda's
//! `CudaRuntime`. The harness is generic over it, so every table and picture
//! means the same thing on either backend: the CPU's timings are its compute
//! thread's clock, the GPU's are CUDA events converted to host instants.

use kestrel_cpu::runtime::CpuRuntime;
use kestrel_cuda::CudaRuntime;
use kestrel_pipeline::{Executor, SamplingParams};

/// A runtime the bench can drive and time.
pub trait BenchRuntime: Executor<Params = SamplingParams> {
    /// Bytes of weights the forward reads per step.
    fn weight_bytes(&self) -> usize;
    /// Weight bytes a decode step streams from host memory, where DRAM
    /// bandwidth bounds single-stream decode (the CPU); `None` elsewhere.
    fn bytes_per_token(&self) -> Option<usize>;
    /// The backend as the report names it (`cpu (isa=.., numerics=..)`,
    /// `cuda (<device>)`).
    fn describe(&self) -> String;
}

impl BenchRuntime for CpuRuntime {
    fn weight_bytes(&self) -> usize {
        CpuRuntime::weight_bytes(self)
    }

    fn bytes_per_token(&self) -> Option<usize> {
        Some(CpuRuntime::bytes_per_token(self))
    }

    fn describe(&self) -> String {
        format!(
            "cpu (isa={:?}, numerics={:?})",
            self.isa(),
            self.config().numerics
        )
    }
}

impl BenchRuntime for CudaRuntime {
    fn weight_bytes(&self) -> usize {
        CudaRuntime::weight_bytes(self)
    }

    fn bytes_per_token(&self) -> Option<usize> {
        None
    }

    fn describe(&self) -> String {
        format!("cuda ({})", self.device_name())
    }
}
