//! [`StepTiming`]: when a runtime's device ran one step, on the host's clock.
//!
//! Runtimes that measure themselves (the CPU runtime's compute-stream
//! thread, CUDA events converted to host instants) report this one type, so
//! benchmarks and metrics read every backend the same way. Plain data: the
//! pipeline itself never reads a clock.

use std::time::Instant;

/// When the device ran one step's forward and its sampling.
/// `forward_end..sample_start` is the device waiting for the host to enqueue
/// sampling (the masks), if anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepTiming {
    /// The runtime's step counter at launch (launch order).
    pub step: u64,
    pub prefill: bool,
    /// Sequences in the step (before any padding a runtime adds).
    pub rows: usize,
    pub forward_start: Instant,
    pub forward_end: Instant,
    pub sample_start: Instant,
    pub sample_end: Instant,
}
