//! The per-sequence trait the scheduler drives without looking inside.
//!
//! A skill consumes each committed token, says when its request is done, may
//! restrict the next token with a bitmask, and is told exactly once how the
//! request ended. `kestrel-skills` implements it; the pipeline never knows
//! what a skill is.

use crate::{Cause, TokenId};

/// One committed token as the skill sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CommittedToken<'a> {
    pub token: TokenId,
    /// Log-probability of `token` under the sampling distribution, when requested.
    pub logprob: Option<f32>,
    /// The top alternatives `(token, logprob)`, best first (empty unless requested).
    pub top_logprobs: &'a [(TokenId, f32)],
    /// The coordinate the runtime's spatial stage decoded beside `token`
    /// ([`crate::TokenValues`]; 0 when it decoded none).
    pub coord: f32,
    /// The (width, height) size decoded beside `token` (zeros when none).
    pub size: [f32; 2],
}

/// What a skill decides after consuming a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Keep generating.
    Continue,
    /// The request is complete; the token just consumed is the last one.
    Stop(FinishReason),
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// The model produced an end-of-sequence token.
    Eos,
    /// A stop string or stop token id matched, or a constraint was satisfied.
    Stop,
    /// `max_new_tokens` or the context length was reached.
    Length,
    /// The caller cancelled the request.
    Abort,
}

/// A bitmask over the vocabulary: bit `t % 32` of word `t / 32` set means
/// token `t` may be sampled. Runtimes copy it to the device as-is.
#[derive(Debug)]
pub struct TokenMask<'a> {
    words: &'a mut [u32],
    vocab_size: usize,
}

impl<'a> TokenMask<'a> {
    /// Number of `u32` words needed for `vocab_size` tokens.
    pub const fn words_for(vocab_size: usize) -> usize {
        vocab_size.div_ceil(32)
    }

    /// Wraps `words` (at least [`TokenMask::words_for`]`(vocab_size)` long).
    pub fn new(words: &'a mut [u32], vocab_size: usize) -> Self {
        assert!(
            words.len() >= Self::words_for(vocab_size),
            "mask buffer too short"
        );
        let n = Self::words_for(vocab_size);
        Self {
            words: &mut words[..n],
            vocab_size,
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The raw words, for skills that compute masks in bulk (e.g. llguidance).
    pub fn words_mut(&mut self) -> &mut [u32] {
        self.words
    }

    pub fn words(&self) -> &[u32] {
        self.words
    }

    /// Disallow every token.
    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    /// Allow every token (bits past `vocab_size` stay clear).
    pub fn allow_all(&mut self) {
        self.words.fill(u32::MAX);
        let tail = self.vocab_size % 32;
        if tail != 0 {
            if let Some(last) = self.words.last_mut() {
                *last = (1u32 << tail) - 1;
            }
        }
    }

    pub fn allow(&mut self, token: TokenId) {
        let t = token as usize;
        if t < self.vocab_size {
            self.words[t / 32] |= 1 << (t % 32);
        }
    }

    pub fn disallow(&mut self, token: TokenId) {
        let t = token as usize;
        if t < self.vocab_size {
            self.words[t / 32] &= !(1 << (t % 32));
        }
    }

    pub fn is_allowed(&self, token: TokenId) -> bool {
        let t = token as usize;
        t < self.vocab_size && self.words[t / 32] & (1 << (t % 32)) != 0
    }
}

/// How a request ended, delivered to its skill exactly once.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Generation ended normally (including abort by the caller).
    Finished(FinishReason),
    /// The request failed; the cause says why (an executor error, an engine fault).
    Failed(FailureKind, Cause),
}

/// The class of a failure, so the serving layer can map it to a status code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// A pre-dispatch error that failed only this step's requests; the engine keeps serving.
    StepFailed,
    /// The engine hit a fatal fault and stopped serving.
    EngineFatal,
    /// The request can never fit (context or KV capacity).
    Rejected,
}

/// Per-request state the scheduler drives.
///
/// Call order, enforced by the pipeline: any number of `consume` calls (one
/// per committed token, in order, never after a `Stop`), interleaved with
/// `is_constrained`/`fill_mask` for the next step; then `finish` exactly once.
/// A finalized sequence is never asked for a mask again (zombie rows are
/// sampled unconstrained and their tokens discarded).
pub trait SequenceSkill: Send {
    /// The request was admitted: its prefill launched with KV reserved.
    /// `cached_prompt_tokens` prompt tokens were served from the prefix cache.
    /// Called once, before any `consume`.
    fn on_admitted(&mut self, cached_prompt_tokens: usize) {
        let _ = cached_prompt_tokens;
    }

    /// Consume one committed token.
    fn consume(&mut self, token: &CommittedToken<'_>) -> Verdict;

    /// Whether the next token must be drawn from a mask.
    fn is_constrained(&self) -> bool {
        false
    }

    /// Fill `mask` with the tokens allowed next. Called only when
    /// [`SequenceSkill::is_constrained`] returned true. Must not allocate in
    /// the steady state.
    fn fill_mask(&mut self, mask: &mut TokenMask<'_>) {
        mask.allow_all();
    }

    /// Whether [`SequenceSkill::fill_masks_ahead`] can look past the next
    /// token. A constrained sequence speculates only if it can.
    fn looks_ahead(&self) -> bool {
        false
    }

    /// The masks of a step that verifies `drafts` after the next token:
    /// `words` holds `drafts.len() + 1` zeroed masks of
    /// `TokenMask::words_for(vocab_size)` words each. Mask 0 is
    /// [`SequenceSkill::fill_mask`]'s; mask `j` is the one after
    /// `drafts[..j]` were consumed. The skill's state is unchanged
    /// afterwards. Masks after a draft the skill would not accept may stay
    /// zeroed: sampling never reaches them. Called only when
    /// [`SequenceSkill::looks_ahead`] is true; by default, mask 0 only.
    fn fill_masks_ahead(&mut self, drafts: &[TokenId], words: &mut [u32], vocab_size: usize) {
        let _ = drafts;
        self.fill_mask(&mut TokenMask::new(words, vocab_size));
    }

    /// The request ended; called exactly once.
    fn finish(&mut self, outcome: Outcome);
}
