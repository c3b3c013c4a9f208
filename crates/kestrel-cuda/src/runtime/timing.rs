//! Per-step device timings from events, on the host's clock (the CUDA
//! device's [`DeviceClock`]; the host device stamps its events directly).
//!
//! Each slot owns four timing events recorded on the compute stream around
//! its step (forward start/end, sampling start/end); a [`DeviceClock`] pairs
//! one base event with a host [`Instant`], and a step's events are converted
//! into `Instant`s with `cuEventElapsedTime` against that base right after
//! the step's wait (when they have all completed). Costs four event records
//! per step and a few driver calls at its commit, only while recording.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream, DriverError};

use super::backend::Device;
use crate::CudaError;
pub use kestrel_pipeline::StepTiming;

fn timing_event(ctx: &Arc<CudaContext>) -> Result<CudaEvent, DriverError> {
    // CU_EVENT_DEFAULT: timing enabled (cudarc's default disables it).
    ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
}

/// One slot's timing events, recorded on the compute stream.
pub(crate) struct StepEvents<D: Device> {
    pub forward_start: D::Event,
    pub forward_end: D::Event,
    pub sample_start: D::Event,
    pub sample_end: D::Event,
}

impl<D: Device> StepEvents<D> {
    pub fn new(d: &D) -> Result<Self, CudaError> {
        Ok(StepEvents {
            forward_start: d.event(true)?,
            forward_end: d.event(true)?,
            sample_start: d.event(true)?,
            sample_end: d.event(true)?,
        })
    }
}

/// An anchor whose round trip took longer than this is not trusted (the
/// record may have queued behind other work); the previous anchor is kept.
const MAX_ANCHOR_WINDOW: Duration = Duration::from_micros(200);

/// Re-anchor this often: the device and host clocks drift apart (ppm), and
/// `cuEventElapsedTime` returns an f32 whose resolution shrinks with distance.
pub(crate) const ANCHOR_MAX_AGE: Duration = Duration::from_secs(1);

/// A base event paired with the host instant at which it completed.
///
/// The base is recorded on a stream of its own that carries no other work,
/// so anchoring never waits for the compute stream and can happen while
/// steps are in flight (events of one context share one device clock).
pub(crate) struct DeviceClock {
    stream: Arc<CudaStream>,
    base: CudaEvent,
    /// Where a new anchor is recorded; swapped with `base` only when the
    /// anchor is accepted, so a rejected one leaves `base` and `host` paired.
    probe: CudaEvent,
    host: Instant,
    /// Host time of the last successful anchor, `None` before the first.
    anchored: Option<Instant>,
}

impl DeviceClock {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        let mut clock = DeviceClock {
            stream: ctx.new_stream()?,
            base: timing_event(ctx)?,
            probe: timing_event(ctx)?,
            host: Instant::now(),
            anchored: None,
        };
        clock.anchor()?;
        Ok(clock)
    }

    /// Whether the anchor is older than [`ANCHOR_MAX_AGE`].
    pub fn stale(&self, now: Instant) -> bool {
        self.anchored
            .is_none_or(|t| now.saturating_duration_since(t) > ANCHOR_MAX_AGE)
    }

    /// Record the base event on the idle clock stream and take the host time
    /// as the middle of the record-to-completion window. Keeps the previous
    /// anchor when the window is too wide to trust (unless there is none).
    pub fn anchor(&mut self) -> Result<(), CudaError> {
        let t0 = Instant::now();
        self.probe.record(&self.stream)?;
        self.probe.synchronize()?;
        let t1 = Instant::now();
        let window = t1 - t0;
        if window <= MAX_ANCHOR_WINDOW || self.anchored.is_none() {
            std::mem::swap(&mut self.base, &mut self.probe);
            self.host = t0 + window / 2;
            self.anchored = Some(t1);
        }
        Ok(())
    }

    /// The host instant at which `ev` (recorded and completed) completed.
    /// Events before the base give negative elapsed times, handled as such.
    pub fn instant(&self, ev: &CudaEvent) -> Result<Instant, CudaError> {
        let ms = f64::from(self.base.elapsed_ms(ev)?);
        let d = Duration::from_secs_f64(ms.abs() / 1e3);
        Ok(if ms >= 0.0 {
            self.host + d
        } else {
            self.host.checked_sub(d).unwrap_or(self.host)
        })
    }
}
