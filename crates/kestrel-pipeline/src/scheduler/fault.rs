//! The scheduler's own failures: [`SchedulerFault`] (typed, with `#[source]`
//! causes) and `Fatal`, the engine-fatal fault the loop turns into failing
//! every request.

use crate::phase::PhaseError;
use crate::state::StateError;
use crate::{Cause, RequestId};

/// A failure the scheduler detects itself.
#[derive(Debug, thiserror::Error)]
pub enum SchedulerFault {
    /// A request's KV need outgrew the cache with every other sequence gone
    /// (the request fails alone; `could_ever_fit` should have refused it).
    #[error("the KV cache cannot hold request {id} at {tokens} tokens even alone")]
    CannotFitAlone { id: RequestId, tokens: usize },
    /// The executor returned outputs that do not match the step (fatal):
    /// rows other than its sampled sequences, or values neither absent nor
    /// one per token.
    #[error(
        "step {step} returned {rows} rows ({tokens} tokens, {values} values) for {expected} sampled sequences"
    )]
    MalformedOutputs {
        step: u64,
        rows: usize,
        tokens: usize,
        values: usize,
        expected: usize,
    },
    /// A sequence refused a phase transition (a scheduler bug, fatal).
    #[error("request {id}: illegal phase transition")]
    Phase {
        id: RequestId,
        #[source]
        source: PhaseError,
    },
    /// The slot state machine refused a transition (a bug, fatal).
    #[error("pipeline state machine")]
    State(#[source] StateError),
    /// A synchronous prefill found no free slot in a drained pipeline.
    #[error("no free slot for prefill")]
    NoFreeSlot,
}

/// A fault the loop must turn into engine-fatal handling.
#[derive(Debug)]
pub(crate) struct Fatal(pub Cause);

impl Fatal {
    pub fn phase(id: RequestId, source: PhaseError) -> Self {
        SchedulerFault::Phase { id, source }.into()
    }
}

impl From<SchedulerFault> for Fatal {
    fn from(f: SchedulerFault) -> Self {
        Fatal(Cause::new(f))
    }
}

impl From<StateError> for Fatal {
    fn from(e: StateError) -> Self {
        SchedulerFault::State(e).into()
    }
}
