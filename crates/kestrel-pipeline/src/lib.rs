//! kestrel-pipeline: Kestrel's pipelined decode state machine, proven without a device.
//!
//! The CPU bookkeeping of step t (wait for the device-to-host copy, commit
//! tokens, stop checks, masks, planning step t+1) runs while the device
//! computes step t+1. This crate holds that logic and nothing else: no
//! device, no I/O, no async. Runtimes plug in through [`Executor`]; skills
//! (per-request state, masks) through [`SequenceSkill`].
//!
//! - [`PipelineState`]: slots, FIFO `batch_queue`, one `launch_handle`,
//!   two-phase completion (invariants I2, I6): the one slot protocol, kept
//!   by the loop and by each runtime (to refuse a wrong call early).
//! - [`Executor`]: what a runtime provides, and [`Capabilities`], the one
//!   value that says what it can do (rows, drafts, logit bias, chunked
//!   prefill, re-admission).
//! - [`Phase`] / [`Lifecycle`]: one sequence's phase (waiting, prefilling,
//!   decoding, drafting, preempting, preempted, finalized, released) and
//!   `inflight_refs` (I4), changed only by transitions that return a
//!   [`PhaseError`] when illegal.
//! - [`EngineLoop`]: the unified loop of the design doc (section 4.6) with
//!   finalized + `inflight_refs` zombies, budgeted `can_dispatch`,
//!   prefill policies `Drain` (I5) and `RideAlong` (Photon), pause/drain and
//!   the engine-fatal fault model; `submit_samples` queues the `n` samples
//!   of one request, the others forking from the first ([`PrefillStart::Fork`]:
//!   they share its prompt pages).
//! - [`NgramSpec`]: prompt-lookup speculative decoding (drafts verified in
//!   one forward, accepted through the same commit path).
//! - [`MaskFiller`]: how a step's masks are filled (sequentially by
//!   default; in parallel with a thread-pool filler).
//! - [`testing`]: a deterministic simulated executor and skills.
//!
//! ```
//! use kestrel_pipeline::testing::{SimConfig, SimExecutor, SimSkill};
//! use kestrel_pipeline::{EngineLoop, LoopConfig, Request, SamplingParams, Tick};
//!
//! let exec = SimExecutor::new(SimConfig::default());
//! let mut engine = EngineLoop::new(exec, LoopConfig::default()).unwrap();
//! let (skill, log) = SimSkill::new(None, None);
//! engine
//!     .submit(Request { id: 1, prompt: vec![1, 2, 3], max_new_tokens: 8, params: SamplingParams { seed: 7, ..Default::default() }, speculate: None, skill: Box::new(skill), embeds: None })
//!     .unwrap();
//! assert_eq!(engine.run_until_idle(), Tick::Idle);
//! assert_eq!(log.lock().unwrap().tokens.len(), 8);
//! ```
#![forbid(unsafe_code)]

mod cause;
pub mod engine_loop;
pub mod executor;
pub mod masks;
pub mod observed;
pub mod phase;
pub mod sampling;
pub mod scheduler;
mod sequence;
pub mod skill;
pub mod speculate;
pub mod state;
pub mod testing;
pub mod timing;

/// A vocabulary index.
pub type TokenId = u32;
/// A caller-chosen request identifier, unique among live requests.
pub type RequestId = u64;

pub use cause::Cause;
pub use engine_loop::{EngineLoop, LoopConfig, PipelineMode, PrefillPolicy, SubmitError, Tick};
pub use executor::{
    Capabilities, Drafts, DraftsError, ExecError, Executor, MaskBatch, PrefillInput, PrefillStart,
    SlotId, StepOutputs, TokenValues,
};
pub use masks::{MaskFiller, MaskRow, SequentialMasks};
pub use observed::{Observed, WaitObserver};
pub use phase::{Lifecycle, Phase, PhaseError, Transition, MAX_INFLIGHT_REFS};
pub use sampling::{LogitBias, SamplingParams};
pub use scheduler::{InvariantError, PipelineStats, SchedulerFault, StepPlan};
pub use sequence::{PromptEmbeds, Request};
pub use skill::{
    CommittedToken, FailureKind, FinishReason, Outcome, SequenceSkill, TokenMask, Verdict,
};
pub use speculate::NgramSpec;
pub use state::{
    LaunchHandle, PendingCommit, PipelineState, ProtocolViolation, StateError, StepKind,
};
pub use timing::StepTiming;
