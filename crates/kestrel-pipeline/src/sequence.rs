//! Requests and the scheduler's per-sequence tracking.
//!
//! A [`Request`] waits (no KV) until prefill admits it; from then on a
//! `Sequence` tracks `finalized`, `inflight_refs` (0..=2, mutated only by
//! launch and commit: I4), the committed token count and the budget checks
//! of `can_dispatch`. A sequence part-way through a chunked prefill is the
//! scheduler's `partial` and is not dispatched to decode until its last
//! chunk has launched. A finalized sequence with `inflight_refs > 0` is a
//! zombie: it still holds its KV row until its last in-flight step commits.

use crate::{RequestId, SequenceSkill, TokenId};

/// A request as the pipeline receives it (already validated by the caller).
pub struct Request<P> {
    pub id: RequestId,
    pub prompt: Vec<TokenId>,
    /// Generated tokens at most (the first comes from prefill).
    pub max_new_tokens: u32,
    /// Sampling parameters for the executor.
    pub params: P,
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

/// An admitted sequence (it holds a KV row).
pub(crate) struct Sequence {
    pub id: RequestId,
    pub prompt_len: usize,
    /// Tokens committed on the CPU (consumed by the skill).
    pub committed: u32,
    /// In-flight steps (launched, not yet committed) that include this sequence.
    pub inflight_refs: u8,
    pub finalized: bool,
    pub max_new_tokens: u32,
    /// Prompt + generated tokens at most (the context cap).
    pub max_len: usize,
    pub skill: Box<dyn SequenceSkill>,
}

impl Sequence {
    /// Tokens that will exist once every in-flight step commits.
    pub fn budgeted_len(&self) -> usize {
        self.prompt_len + self.committed as usize + self.inflight_refs as usize
    }

    /// Section 4.7's eligibility predicate, with budgeted tokens.
    pub fn can_dispatch(&self) -> bool {
        !self.finalized
            && self.inflight_refs < MAX_INFLIGHT_REFS
            && self.budgeted_len() < self.max_len
            && self.committed + u32::from(self.inflight_refs) < self.max_new_tokens
    }

    /// Whether the committed state reached a length cap.
    pub fn at_length_cap(&self) -> bool {
        self.committed >= self.max_new_tokens
            || self.prompt_len + self.committed as usize >= self.max_len
    }

    /// The next step must be sampled from a mask (finalized rows never are).
    pub fn needs_mask(&self) -> bool {
        !self.finalized && self.skill.is_constrained()
    }
}
