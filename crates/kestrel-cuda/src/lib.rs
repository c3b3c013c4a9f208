//! kestrel-cuda: the CUDA runtime of Kestrel.
//!
//! Kernels live in `kernels/*.cu` and are compiled at start by NVRTC for the
//! device's architecture ([`compile`], PTX cached by hash). Weights stay in
//! their file's encoding ([`quant`]): small batches on quantized weights run
//! int8 `mmvq_*` kernels, the rest cuBLAS with f16 inputs and f32
//! accumulation. Every CUDA library (driver,
//! NVRTC, cuBLAS) is loaded at run time ([`libs`]): the crate builds and its
//! host-side tests run on machines with no CUDA at all, and the runtime
//! returns a typed [`CudaError`] (never a panic) when no driver or device is
//! present. The runtime's bookkeeping is written once over a
//! [`runtime::backend::Device`]; CI runs it on [`hostdev::HostDevice`], a
//! host computation laid out as the GPU's ([`hostdev::HostRuntime`]).

pub mod compile;
pub mod error;
pub mod ffi;
pub mod host;
pub mod hostdev;
mod hostdev_kernels;
mod hostdev_region;
mod hostdev_sample;
pub mod kernels;
pub mod libs;
pub mod quant;
pub mod reference;
pub mod runtime;

pub use compile::Arch;
pub use error::CudaError;
pub use hostdev::HostRuntime;
pub use runtime::timing::StepTiming;
pub use runtime::{CudaRuntime, CudaRuntimeConfig, Runtime, StepConfig};
