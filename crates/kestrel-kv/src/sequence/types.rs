//! The vocabulary of [`super::SchedulableSequence`]: its state, step outcome, events and errors.
//!
//! Names follow the schedulable-sequence design (`ScheduleError::NotIdle`,
//! `ApplyError::WrongState`, `SequenceEvent::PrefillApplied`, ...). Errors caused by the
//! page table chain the [`KvError`] as their `#[source]`. Plain data: no cost beyond copying.

use crate::{KvError, RowId};

/// Where a sequence is in the two-phase schedule/apply protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SequenceState {
    /// Nothing scheduled; any `schedule_*`, `release` or `reacquire` may come next.
    Idle,
    /// A prefill chunk of `num_tokens` tokens is scheduled.
    PrefillScheduled {
        /// Tokens in the chunk.
        num_tokens: usize,
        /// Pages the schedule allocated (released LIFO on revert).
        blocks_allocated: usize,
        /// The schedule also took the sequence's row (given back on revert).
        row_acquired: bool,
    },
    /// One decode step is scheduled (KV for the dangling token).
    DecodeScheduled {
        /// Pages the schedule allocated.
        blocks_allocated: usize,
    },
    /// A speculative verification of `num_tokens` draft tokens is scheduled.
    SpeculativeScheduled {
        /// Draft tokens scheduled (after clamping to the output budget); at most this
        /// many can be accepted.
        num_tokens: usize,
        /// Pages the schedule allocated.
        blocks_allocated: usize,
    },
}

/// What an `apply_decode` / `apply_speculative` did to the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeOutcome {
    /// Nothing notable: schedule the next step.
    Continue,
    /// At least one page became full of computed KV (and was published to the prefix cache
    /// when caching is on).
    BlockCompleted,
    /// The sequence reached `max_output_tokens`.
    MaxLength,
    /// Both of the above.
    BlockCompletedAndMaxLength,
}

impl DecodeOutcome {
    pub(crate) fn new(block_completed: bool, max_length: bool) -> Self {
        match (block_completed, max_length) {
            (false, false) => Self::Continue,
            (true, false) => Self::BlockCompleted,
            (false, true) => Self::MaxLength,
            (true, true) => Self::BlockCompletedAndMaxLength,
        }
    }
}

/// One lifecycle transition, appended to [`super::SchedulableSequence::history`].
/// Failed calls append nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SequenceEvent {
    /// The sequence was built.
    Created {
        /// Prompt length.
        num_input_tokens: usize,
        /// Output budget.
        max_output_tokens: usize,
    },
    /// `match_and_add_prefix` took a row and shared `blocks_matched` cached pages.
    PrefixMatched {
        /// Pages reused (`blocks_matched * page_size` tokens skip prefill).
        blocks_matched: usize,
    },
    /// `schedule_prefill` succeeded.
    PrefillScheduled {
        /// Tokens in the chunk.
        num_tokens: usize,
        /// Pages allocated for it.
        blocks_allocated: usize,
    },
    /// `apply_prefill` succeeded.
    PrefillApplied {
        /// Tokens whose KV is now computed.
        num_tokens: usize,
        /// Pages newly sealed (full and hashed) by this chunk.
        blocks_registered: usize,
        /// The chunk carried the first generated token.
        token_emitted: bool,
    },
    /// `schedule_decode` succeeded.
    DecodeScheduled {
        /// Pages allocated for the step.
        blocks_allocated: usize,
    },
    /// `apply_decode` succeeded.
    DecodeApplied {
        /// The token appended.
        token: u32,
        /// A page became full of computed KV.
        block_completed: bool,
    },
    /// `schedule_speculative` succeeded.
    SpeculativeScheduled {
        /// Draft tokens scheduled (after clamping).
        num_tokens: usize,
        /// Pages allocated for the verification.
        blocks_allocated: usize,
    },
    /// `apply_speculative` succeeded.
    SpeculativeApplied {
        /// Tokens accepted.
        accepted: usize,
        /// Tokens that had been scheduled.
        scheduled: usize,
        /// Excess pages released LIFO.
        blocks_released: usize,
    },
    /// `revert_schedule` succeeded.
    ScheduleReverted {
        /// Pages released LIFO.
        blocks_released: usize,
    },
    /// `append_tokens` added `count` tokens without KV.
    TokensAppended {
        /// Tokens appended.
        count: usize,
    },
    /// `drop_unassigned` released pages that held no computed KV.
    UnassignedDropped {
        /// Pages released.
        count: usize,
    },
    /// `release` gave the row and its pages back.
    Released,
    /// `reacquire` ran.
    Reacquired {
        /// Cached pages reused.
        prefix_matched: usize,
        /// A row and the pages for the computed range were obtained.
        success: bool,
    },
}

/// Why a `schedule_*` call (or building a sequence) was refused. The sequence and the
/// page table are unchanged when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// `schedule_*` while a step is already scheduled.
    #[error("expected Idle, sequence is {state:?}")]
    NotIdle {
        /// The current state.
        state: SequenceState,
    },
    /// Decode or speculative decode before the prompt has KV.
    #[error("prefill not complete: KV at {position} of {num_input_tokens} prompt tokens")]
    PrefillNotComplete {
        /// `kv_position`.
        position: usize,
        /// Prompt length.
        num_input_tokens: usize,
    },
    /// `schedule_prefill` when the prefill range (see
    /// [`super::SchedulableSequence::prefill_end`]) already has KV.
    #[error("prefill already complete: KV at {position} of {prefill_end}")]
    PrefillComplete {
        /// `kv_position`.
        position: usize,
        /// Where prefill ends.
        prefill_end: usize,
    },
    /// The chunk would go past the end of the prefill range.
    #[error("prefill overrun: {position} + {num_tokens} > {prefill_end}")]
    PrefillOverrun {
        /// `kv_position`.
        position: usize,
        /// Requested chunk.
        num_tokens: usize,
        /// Where prefill ends.
        prefill_end: usize,
    },
    /// The page table has no free row or not enough pages.
    #[error("KV allocation failed")]
    AllocationFailed {
        /// [`KvError::NoFreeRow`] or [`KvError::OutOfPages`].
        #[source]
        source: KvError,
    },
    /// The sequence already produced `max_output_tokens`.
    #[error("generation complete: {generated} of {max_output} tokens")]
    GenerationComplete {
        /// Tokens generated.
        generated: usize,
        /// The budget.
        max_output: usize,
    },
    /// Decode and speculative decode need exactly one token without KV; more means a
    /// recompute or appended tokens still need `schedule_prefill`.
    #[error("expected {expected} dangling token(s), found {actual}")]
    WrongDanglingCount {
        /// Always 1.
        expected: usize,
        /// `tail_tokens()`.
        actual: usize,
    },
    /// A sequence needs at least one input token.
    #[error("a sequence needs at least one input token")]
    EmptyInput,
    /// `match_and_add_prefix` on a sequence that already holds a row.
    #[error("sequence already holds row {row}")]
    RowAlreadyHeld {
        /// The row held.
        row: RowId,
    },
    /// The row was taken back by [`crate::PageTable::release_all`].
    #[error("row {row} was released by release_all; the lease is stale")]
    StaleLease {
        /// The stale row id.
        row: RowId,
    },
    /// The page table refused for another reason: the row was erased behind the
    /// sequence's back (a caller bug).
    #[error("page table refused")]
    Table {
        /// The page table's error.
        #[source]
        source: KvError,
    },
}

/// Why an `apply_*`, `revert_schedule`, `release`, `reacquire` or `drop_unassigned`
/// call was refused. The sequence and the page table are unchanged when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// The call does not fit the current state.
    #[error("expected {expected}, sequence is {actual:?}")]
    WrongState {
        /// The state the call needs.
        expected: &'static str,
        /// The current state.
        actual: SequenceState,
    },
    /// A token was given for a chunk that generates none: a non-final chunk, a recompute
    /// chunk after `reacquire`, or any chunk when `max_output_tokens == 0`.
    #[error("token provided on a prefill chunk that generates none")]
    TokenOnNonFinalChunk,
    /// The final prefill chunk must carry the first generated token.
    #[error("final prefill chunk requires the first generated token")]
    MissingTokenOnFinalChunk,
    /// More tokens accepted than were scheduled.
    #[error("accepted {accepted} tokens, only {scheduled} were scheduled")]
    AcceptedExceedsScheduled {
        /// Tokens passed.
        accepted: usize,
        /// Tokens scheduled.
        scheduled: usize,
    },
    /// `append_tokens` beyond the output budget.
    #[error("append of {requested} tokens exceeds the {remaining} remaining in the budget")]
    AppendExceedsRemaining {
        /// Tokens passed.
        requested: usize,
        /// Budget left.
        remaining: usize,
    },
    /// `reacquire` on a sequence that holds a row.
    #[error("sequence already holds row {row}")]
    RowAlreadyHeld {
        /// The row held.
        row: RowId,
    },
    /// The row was taken back by [`crate::PageTable::release_all`].
    #[error("row {row} was released by release_all; the lease is stale")]
    StaleLease {
        /// The stale row id.
        row: RowId,
    },
    /// The page table refused: the row was erased behind the sequence's back.
    #[error("page table refused")]
    Table {
        /// The page table's error.
        #[source]
        source: KvError,
    },
}
