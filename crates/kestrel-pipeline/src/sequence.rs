//! Requests and the scheduler's per-sequence lifecycle.
//!
//! A [`Request`] waits (no KV) until prefill admits it; from then on a
//! `Sequence` tracks `finalized`, `inflight_refs` (0..=2, mutated only by
//! launch and commit: I4), its tokens (prompt, then committed), the budget
//! checks of `can_dispatch` and its [`Residency`]. A sequence part-way
//! through a chunked prefill is the scheduler's `partial` and is not
//! dispatched to decode until its last chunk has launched. A finalized
//! sequence with `inflight_refs > 0` is a zombie: it still holds its KV row
//! until its last in-flight step commits. A preempted sequence gives its KV
//! back the same way (once its in-flight steps commit) and is prefilled
//! again, with the tokens it generated, when pages allow.

use crate::speculate::{DraftControl, NgramSpec};
use crate::{RequestId, SequenceSkill, TokenId};

/// A request as the pipeline receives it (already validated by the caller).
pub struct Request<P> {
    pub id: RequestId,
    pub prompt: Vec<TokenId>,
    /// Generated tokens at most (the first comes from prefill).
    pub max_new_tokens: u32,
    /// Sampling parameters for the executor.
    pub params: P,
    /// Prompt-lookup speculation (`None`: off). A constrained request drafts
    /// only if its skill can look ahead ([`SequenceSkill::fill_masks_ahead`]).
    pub speculate: Option<NgramSpec>,
    pub skill: Box<dyn SequenceSkill>,
}

impl<P> std::fmt::Debug for Request<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("id", &self.id)
            .field("prompt_len", &self.prompt.len())
            .field("max_new_tokens", &self.max_new_tokens)
            .finish_non_exhaustive()
    }
}

/// The most steps a sequence may be part of at once (the pipeline depth).
pub const MAX_INFLIGHT_REFS: u8 = 2;

/// Whether an admitted sequence holds its KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Residency {
    /// Holds its KV; decodes while running.
    Resident,
    /// Chosen for preemption: dispatched no more, it keeps its KV until its
    /// in-flight steps commit (their tokens count), then gives it back.
    Preempting,
    /// Holds no KV; waits to be prefilled again with its tokens so far.
    Preempted,
}

/// An admitted sequence: it holds a KV row unless preempted.
pub(crate) struct Sequence<P> {
    pub id: RequestId,
    /// Admission order of first admission (re-admissions keep it): the
    /// youngest running sequence is preempted first.
    pub arrival: u64,
    pub prompt_len: usize,
    /// The prompt, then every committed token (a preempted sequence's
    /// re-admission prefills all of them).
    pub tokens: Vec<TokenId>,
    /// In-flight steps (launched, not yet committed) that include this sequence.
    pub inflight_refs: u8,
    pub finalized: bool,
    pub residency: Residency,
    pub max_new_tokens: u32,
    /// Prompt + generated tokens at most (the context cap).
    pub max_len: usize,
    pub params: P,
    /// Speculation settings (a constrained sequence: only if its skill
    /// looks ahead).
    pub speculate: Option<NgramSpec>,
    /// How many drafts it proposes next, and when it next waits to draft.
    pub draft: DraftControl,
    /// Drafts its in-flight step verifies (0: none; else it is in no
    /// other step).
    pub drafting: usize,
    pub skill: Box<dyn SequenceSkill>,
}

impl<P> Sequence<P> {
    /// Tokens committed on the CPU (consumed by the skill).
    pub fn committed(&self) -> u32 {
        (self.tokens.len() - self.prompt_len) as u32
    }

    /// Tokens that will exist once every in-flight step commits.
    pub fn budgeted_len(&self) -> usize {
        self.tokens.len() + self.inflight_refs as usize
    }

    /// Section 4.7's eligibility predicate, with budgeted tokens (a step
    /// verifying drafts commits an unknown number of them: not before it).
    pub fn can_dispatch(&self) -> bool {
        !self.finalized
            && self.drafting == 0
            && self.residency == Residency::Resident
            && self.inflight_refs < MAX_INFLIGHT_REFS
            && self.budgeted_len() < self.max_len
            && self.committed() + u32::from(self.inflight_refs) < self.max_new_tokens
    }

    /// Whether the committed state reached a length cap.
    pub fn at_length_cap(&self) -> bool {
        self.committed() >= self.max_new_tokens || self.tokens.len() >= self.max_len
    }

    /// The next step must be sampled from a mask (finalized rows never are).
    pub fn needs_mask(&self) -> bool {
        !self.finalized && self.skill.is_constrained()
    }

    /// Drafts a step launched now may carry at most: each accepted draft
    /// and the token after them must fit the length and token caps.
    pub fn draft_room(&self) -> usize {
        let by_len = self.max_len.saturating_sub(self.budgeted_len() + 1);
        let by_new = self
            .max_new_tokens
            .saturating_sub(self.committed() + u32::from(self.inflight_refs) + 1);
        by_len.min(by_new as usize)
    }

    /// Whether the sequence holds KV in the executor.
    pub fn holds_kv(&self) -> bool {
        self.residency != Residency::Preempted
    }
}
