//! Requests and the scheduler's per-sequence data.
//!
//! A [`Request`] becomes a `Sequence` when it is accepted: its tokens
//! (prompt, then committed) and the spatial values committed with them (a
//! re-admission embeds its coordinates and sizes from them), caps, sampling
//! parameters, speculation state and skill, and its [`Lifecycle`] (phase and `inflight_refs`, see
//! [`crate::phase`]), which only transitions change. The budget checks of
//! `can_dispatch` read both.

use std::any::Any;
use std::sync::Arc;

use crate::phase::{Lifecycle, Phase, MAX_INFLIGHT_REFS};
use crate::speculate::{DraftControl, NgramSpec};
use crate::{RequestId, SequenceSkill, TokenId, TokenValues};

/// Prompt rows a runtime embeds from an input other than token ids (an
/// image's tokens), opaque to the pipeline.
///
/// The prompt ids at `start..start + len` stand for the rows (for an image:
/// ids past the vocabulary derived from its content, so a prefix cache keyed
/// by ids keys the rows by content); a runtime embeds those rows from
/// `input` instead of looking the ids up.
#[derive(Clone)]
pub struct PromptEmbeds {
    /// The prompt positions the rows cover: `start..start + len`.
    pub start: usize,
    pub len: usize,
    /// Prompt positions `..bidirectional_end` attend each other both ways
    /// (a prefix-LM mask: Moondream's BOS + 729 image rows, 730); a prefill
    /// chunk never ends strictly inside `1..bidirectional_end` (the planner
    /// extends such a chunk to `bidirectional_end`), and later rows are causal.
    pub bidirectional_end: usize,
    /// The runtime's input (for Moondream: `Arc<kestrel_model::vision::PreparedImage>`).
    pub input: Arc<dyn Any + Send + Sync>,
}

impl PromptEmbeds {
    /// Whether these rows fit a prompt of `prompt_len` tokens: the rows and
    /// the bidirectional prefix lie within it.
    pub fn fits(&self, prompt_len: usize) -> bool {
        self.start
            .checked_add(self.len)
            .is_some_and(|end| end <= prompt_len)
            && self.bidirectional_end <= prompt_len
    }

    /// The end of a prefill chunk that starts at `start` and would end at
    /// `end`, moved to `bidirectional_end` when it would end strictly inside
    /// the bidirectional prefix (an earlier chunk's rows cannot attend a
    /// later chunk's keys, so the prefix's rest is computed in one chunk).
    pub fn chunk_end(&self, start: usize, end: usize) -> usize {
        if start < self.bidirectional_end && end < self.bidirectional_end {
            self.bidirectional_end
        } else {
            end
        }
    }
}

impl std::fmt::Debug for PromptEmbeds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptEmbeds")
            .field("start", &self.start)
            .field("len", &self.len)
            .field("bidirectional_end", &self.bidirectional_end)
            .finish_non_exhaustive()
    }
}

/// A request as the pipeline receives it (already validated by the caller).
pub struct Request<P> {
    pub id: RequestId,
    pub prompt: Vec<TokenId>,
    /// Generated tokens at most (the first comes from prefill).
    pub max_new_tokens: u32,
    /// Sampling parameters for the executor.
    pub params: P,
    /// Prompt-lookup speculation (`None`: off). A constrained request drafts
    /// only if its skill can look ahead ([`SequenceSkill::fill_masks_ahead`]),
    /// a request with `embeds` never.
    pub speculate: Option<NgramSpec>,
    pub skill: Box<dyn SequenceSkill>,
    /// Prompt rows embedded from another input (an image), if any.
    pub embeds: Option<PromptEmbeds>,
}

impl<P> Request<P> {
    /// Total token cap: prompt + max_new_tokens, within the context.
    pub(crate) fn max_len(&self, max_seq_len: usize) -> usize {
        (self.prompt.len() + self.max_new_tokens as usize).min(max_seq_len)
    }
}

impl<P> std::fmt::Debug for Request<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("id", &self.id)
            .field("prompt_len", &self.prompt.len())
            .field("max_new_tokens", &self.max_new_tokens)
            .field("embeds", &self.embeds)
            .finish_non_exhaustive()
    }
}

/// An accepted request's sequence: the scheduler's registry holds it from
/// submission to release.
pub(crate) struct Sequence<P> {
    pub id: RequestId,
    /// Submission order: the youngest running sequence is preempted first,
    /// and preempted ones are prefilled again oldest first.
    pub arrival: u64,
    pub prompt_len: usize,
    /// The prompt, then every committed token (a preempted sequence's
    /// re-admission prefills all of them).
    pub tokens: Vec<TokenId>,
    /// The [`TokenValues`] committed with each generated token (one per
    /// token past the prompt), or empty while every one was the default
    /// (zeros): nothing for a text sequence. A re-admission passes them
    /// ([`crate::PrefillInput::generated_values`]), since the runtime embeds
    /// a generated spatial id from its value and cannot recompute it inside
    /// one forward (a value is decoded from the hidden state before it).
    pub values: Vec<TokenValues>,
    /// Its phase and in-flight steps, changed only by transitions.
    pub life: Lifecycle,
    pub max_new_tokens: u32,
    /// Prompt + generated tokens at most (the context cap).
    pub max_len: usize,
    pub params: P,
    /// Speculation settings (a constrained sequence: only if its skill
    /// looks ahead).
    pub speculate: Option<NgramSpec>,
    /// How many drafts it proposes next, and when it next waits to draft.
    pub draft: DraftControl,
    pub skill: Box<dyn SequenceSkill>,
    /// Another sample of the same request (`n > 1`) whose prompt pages this
    /// one shares at its first admission ([`crate::PrefillStart::Fork`]).
    pub fork_of: Option<RequestId>,
    /// Prompt rows embedded from another input (the request's).
    pub embeds: Option<PromptEmbeds>,
}

impl<P> Sequence<P> {
    /// A request just accepted (waiting), capped at `max_len` tokens.
    pub fn waiting(
        req: Request<P>,
        arrival: u64,
        max_len: usize,
        fork_of: Option<RequestId>,
    ) -> Self {
        Self {
            id: req.id,
            arrival,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            values: Vec::new(),
            life: Lifecycle::new(),
            max_new_tokens: req.max_new_tokens,
            max_len,
            params: req.params,
            // A constrained sequence drafts only if its skill can mask the
            // positions after a draft; one with embedded rows never (prompt
            // lookup would propose their ids, which are no tokens).
            speculate: req.speculate.filter(|_| {
                req.embeds.is_none() && (!req.skill.is_constrained() || req.skill.looks_ahead())
            }),
            draft: DraftControl::default(),
            skill: req.skill,
            fork_of,
            embeds: req.embeds,
        }
    }

    pub fn phase(&self) -> Phase {
        self.life.phase()
    }

    pub fn inflight_refs(&self) -> u8 {
        self.life.inflight_refs()
    }

    /// Tokens committed on the CPU (consumed by the skill).
    pub fn committed(&self) -> u32 {
        (self.tokens.len() - self.prompt_len) as u32
    }

    /// Appends a committed token and the values decoded beside it. The
    /// values are kept from the first non-default one on (the earlier
    /// generated tokens' filled in as the zeros they were), so `values`
    /// stays empty for a sequence whose every value was zeros and an empty
    /// list always means that.
    pub fn push_committed(&mut self, token: TokenId, values: TokenValues) {
        self.tokens.push(token);
        if self.values.is_empty() && values != TokenValues::default() {
            let earlier = self.committed() as usize - 1;
            self.values
                .reserve_exact(self.max_len.saturating_sub(self.prompt_len));
            self.values.resize(earlier, TokenValues::default());
            self.values.push(values);
        } else if !self.values.is_empty() {
            self.values.push(values);
        }
    }

    /// The values of its generated tokens: one per generated token, or
    /// empty when all were zeros (see [`Sequence::push_committed`]).
    pub fn generated_values(&self) -> &[TokenValues] {
        &self.values
    }

    /// Tokens that will exist once every in-flight step commits.
    pub fn budgeted_len(&self) -> usize {
        self.tokens.len() + self.inflight_refs() as usize
    }

    /// Section 4.7's eligibility predicate, with budgeted tokens: a
    /// decoding sequence (not drafting: a step verifying drafts commits an
    /// unknown number of them) in fewer than two steps, within its caps.
    pub fn can_dispatch(&self) -> bool {
        self.phase() == Phase::Decoding
            && self.inflight_refs() < MAX_INFLIGHT_REFS
            && self.budgeted_len() < self.max_len
            && self.committed() + u32::from(self.inflight_refs()) < self.max_new_tokens
    }

    /// Whether the committed state reached a length cap.
    pub fn at_length_cap(&self) -> bool {
        self.committed() >= self.max_new_tokens || self.tokens.len() >= self.max_len
    }

    /// The next step must be sampled from a mask (finalized rows never are).
    pub fn needs_mask(&self) -> bool {
        !self.phase().is_finalized() && self.skill.is_constrained()
    }

    /// Drafts a step launched now may carry at most: each accepted draft
    /// and the token after them must fit the length and token caps.
    pub fn draft_room(&self) -> usize {
        let by_len = self.max_len.saturating_sub(self.budgeted_len() + 1);
        let by_new = self
            .max_new_tokens
            .saturating_sub(self.committed() + u32::from(self.inflight_refs()) + 1);
        by_len.min(by_new as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::SimSkill;

    fn seq(prompt_len: usize) -> Sequence<()> {
        let (skill, _) = SimSkill::new(None, None);
        let req = Request {
            id: 1,
            prompt: vec![1; prompt_len],
            max_new_tokens: 8,
            params: (),
            speculate: None,
            skill: Box::new(skill),
            embeds: None,
        };
        Sequence::waiting(req, 0, prompt_len + 8, None)
    }

    fn v(coord: f32) -> TokenValues {
        TokenValues {
            coord,
            size: [0.0; 2],
        }
    }

    /// A text sequence keeps no values; the first non-default one makes
    /// the list one per generated token, the earlier ones zeros (as they
    /// were), and every later one is kept, zeros included.
    #[test]
    fn values_are_kept_from_the_first_non_default_one() {
        let mut s = seq(3);
        for t in [7, 8, 9] {
            s.push_committed(t, TokenValues::default());
        }
        assert!(s.generated_values().is_empty());
        assert_eq!(s.tokens, [1, 1, 1, 7, 8, 9]);
        s.push_committed(5, v(0.5));
        s.push_committed(5, v(0.0));
        s.push_committed(6, v(0.25));
        let zero = TokenValues::default();
        assert_eq!(
            s.generated_values(),
            [zero, zero, zero, v(0.5), v(0.0), v(0.25)]
        );
        assert_eq!(s.generated_values().len(), s.committed() as usize);
    }
}
