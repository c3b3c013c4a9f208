//! The crate's one error type, [`CudaError`].
//!
//! Start-up failures (no driver, no device, no NVRTC, a kernel that does not
//! compile, an unsupported model shape) are distinct variants so the engine
//! can report them verbatim; every CUDA failure after dispatch surfaces as
//! [`CudaError::Driver`] / [`CudaError::Cublas`] and the runtime classifies it
//! as engine-fatal.

/// Errors of the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A CUDA shared library (driver, NVRTC, cuBLAS) could not be loaded.
    #[error(
        "the CUDA {what} library is not available ({searched}); install it or point {hint} at it"
    )]
    LibraryMissing {
        what: &'static str,
        searched: String,
        hint: &'static str,
    },

    /// A library named by an environment variable failed to load.
    #[error("loading {path} (from {var})")]
    LibraryLoad {
        var: &'static str,
        path: String,
        #[source]
        source: libloading::Error,
    },

    /// The driver loaded but could not be initialized or asked for its
    /// devices (`call` is the driver function that failed).
    #[error("no CUDA device: {call} failed")]
    DeviceQuery {
        call: &'static str,
        #[source]
        source: cudarc::driver::DriverError,
    },

    /// The device asked for is not among those the driver reports.
    #[error("no CUDA device {ordinal}: {present} present")]
    NoDevice { ordinal: usize, present: usize },

    /// A CUDA driver call failed.
    #[error("a CUDA driver call failed")]
    Driver(#[from] cudarc::driver::DriverError),

    /// A cuBLAS call failed.
    #[error("cuBLAS: {0:?}")]
    Cublas(cudarc::cublas::result::CublasError),

    /// NVRTC rejected a kernel source.
    #[error("NVRTC could not compile {kernel} for {arch}: {log}")]
    Compile {
        kernel: &'static str,
        arch: String,
        log: String,
    },

    /// The model's shape or dtypes are outside what the kernels implement.
    #[error("unsupported model for the CUDA kernels: {0}")]
    Unsupported(String),

    /// A weight that cannot be held on the device in its encoding.
    #[error("weight upload plan")]
    WeightPlan(#[from] crate::quant::PlanError),

    /// The runtime configuration is inconsistent.
    #[error("invalid CUDA runtime config: {0}")]
    Config(String),

    /// A step's metadata could not be packed into its slot's buffers (a
    /// planning bug: a decode step is rejected before dispatch).
    #[error("packing the step's metadata failed")]
    Pack(#[from] crate::host::PackError),

    /// KV page-table bookkeeping failed.
    #[error("KV cache")]
    Kv(#[from] kestrel_kv::KvError),

    /// The step's front end refused it before dispatch (kestrel-step: too
    /// many rows, malformed drafts, an unknown request, a chunk out of
    /// order, no room to admit).
    #[error(transparent)]
    Step(#[from] kestrel_step::StepError),

    /// Steps were launched, sampled or waited on out of pipeline order, or
    /// into a slot whose previous step was not committed (I6).
    #[error("the slot protocol refused the call")]
    Slot(#[from] kestrel_pipeline::StateError),

    /// A re-admission whose generated values are neither none nor one per
    /// generated token (`kestrel_pipeline::PrefillInput::values_fit`):
    /// refused before dispatch.
    #[error("request {id}: {values} values for {generated} generated tokens (none, or one each)")]
    GeneratedValues {
        id: kestrel_pipeline::RequestId,
        values: usize,
        generated: usize,
    },

    /// The host device (CI's stand-in for a GPU, `hostdev`) caught an access
    /// a GPU would fault on or silently corrupt: outside every live
    /// allocation, or an output overlapping an input of the same op.
    #[error("host device: {what}: {bytes} bytes at {addr:#x}")]
    HostAccess {
        what: &'static str,
        addr: u64,
        bytes: usize,
    },
}

impl From<cudarc::cublas::result::CublasError> for CudaError {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        CudaError::Cublas(e)
    }
}
