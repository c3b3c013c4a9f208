//! [`Skill`]: one request's per-sequence state, driven by the pipeline through
//! [`SequenceSkill`].
//!
//! Lifecycle: `Running` -> (`consume` returns `Stop`) `Stopped` -> (`finish`)
//! `Finished`; `finish` may also come straight from `Running` (length, abort,
//! failure). Only a `Running` constrained skill is constrained: a stopped or
//! finished skill (a zombie row) reports unconstrained and fills an all-ones
//! mask without touching the grammar. Per step: `consume` is O(token bytes)
//! plus llguidance's token commit; `fill_mask` is one llguidance mask
//! computation plus a copy of `vocab/32` words.

use std::sync::Arc;

use kestrel_pipeline::{
    CommittedToken, FinishReason, Outcome, SequenceSkill, TokenId, TokenMask, Verdict,
};
use llguidance::Matcher;

use crate::context::SkillContext;
use crate::error::{ConstraintCause, ConstraintFailure, SkillError};
use crate::output::{OutputBuffer, StreamDelta, TokenLogprob};
use crate::spec::{compile, Compiled, SkillKind, SkillOptions, SkillSpec, TextRules};
use crate::stop::StopStrings;

/// Where a skill is in its lifecycle.
#[derive(Debug, Clone, PartialEq)]
pub enum SkillPhase {
    /// Consuming tokens.
    Running,
    /// `consume` returned `Stop(reason)`; waiting for `finish`.
    Stopped(FinishReason),
    /// `finish` was called.
    Finished(Outcome),
}

impl SkillPhase {
    /// The verdict a `consume` after `Stop` or `finish` returns (a caller's
    /// bug, asserted in debug builds), `None` while running: the one guard
    /// every skill's `consume` starts with.
    pub fn refuse_after_stop(&self) -> Option<Verdict> {
        match self {
            SkillPhase::Running => None,
            SkillPhase::Stopped(reason) => {
                debug_assert!(false, "consume after Stop");
                Some(Verdict::Stop(*reason))
            }
            SkillPhase::Finished(_) => {
                debug_assert!(false, "consume after finish");
                Some(Verdict::Stop(FinishReason::Abort))
            }
        }
    }
}

/// The final output of a request, available once [`SequenceSkill::finish`] ran.
#[derive(Debug, Clone, PartialEq)]
pub struct SkillResult {
    /// The output text: special tokens, EOS and a matched stop string excluded.
    /// Equal to the concatenation of every [`StreamDelta::text`].
    pub text: String,
    /// Every committed token, including a final EOS or stop token.
    pub token_ids: Vec<TokenId>,
    /// How the request ended.
    pub outcome: Outcome,
    /// The parsed value, for a JSON skill whose output parses.
    pub json: Option<serde_json::Value>,
    /// Per-token log-probabilities, when requested.
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// Why a constrained output is not a complete sentence of its language
    /// (EOS before the end, or a grammar engine error), if it is not.
    pub constraint_error: Option<String>,
}

impl SkillResult {
    pub fn finish_reason(&self) -> Option<FinishReason> {
        match self.outcome {
            Outcome::Finished(r) => Some(r),
            Outcome::Failed(..) => None,
        }
    }
}

enum Rules {
    Text(TextRules),
    Constrained(Box<Matcher>),
}

/// A request's skill: text generation or a grammar-constrained output.
pub struct Skill {
    ctx: Arc<SkillContext>,
    kind: SkillKind,
    options: SkillOptions,
    rules: Rules,
    out: OutputBuffer,
    phase: SkillPhase,
    constraint_error: Option<ConstraintFailure>,
}

impl std::fmt::Debug for Skill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Skill")
            .field("kind", &self.kind)
            .field("phase", &self.phase)
            .field("tokens", &self.out.tokens.len())
            .field("constraint_error", &self.constraint_error)
            .finish_non_exhaustive()
    }
}

impl Skill {
    /// Validates `spec` (compiling any grammar) and builds the skill. Call at
    /// submission, before reserving KV: every [`SkillError`] surfaces here.
    pub fn new(
        ctx: &Arc<SkillContext>,
        spec: &SkillSpec,
        options: SkillOptions,
    ) -> Result<Self, SkillError> {
        let (rules, stops) = match compile(ctx, spec)? {
            Compiled::Text(t) => {
                let stops = StopStrings::new(t.stop.clone());
                (Rules::Text(t), stops)
            }
            Compiled::Constrained(m) => (Rules::Constrained(m), StopStrings::default()),
        };
        Ok(Self {
            ctx: Arc::clone(ctx),
            kind: spec.kind(),
            options,
            rules,
            out: OutputBuffer::new(stops),
            phase: SkillPhase::Running,
            constraint_error: None,
        })
    }

    pub fn kind(&self) -> SkillKind {
        self.kind
    }

    pub fn options(&self) -> SkillOptions {
        self.options
    }

    pub fn phase(&self) -> &SkillPhase {
        &self.phase
    }

    /// Why the output stopped satisfying its constraint, once it has: the
    /// constraint engine failed on a token or a mask, or the model ended
    /// before the output was complete. Such an output must be reported as
    /// a failure, never as a normal stop.
    pub fn constraint_error(&self) -> Option<&ConstraintFailure> {
        self.constraint_error.as_ref()
    }

    /// The text committed so far (including text still held back from streaming).
    pub fn text(&self) -> &str {
        &self.out.text
    }

    pub fn token_ids(&self) -> &[TokenId] {
        &self.out.tokens
    }

    /// Newly committed output that is safe to stream, or `None` if nothing
    /// changed since the last call. After `finish`, the remainder.
    pub fn take_delta(&mut self) -> Option<StreamDelta> {
        self.out.take_delta()
    }

    /// The final result; `None` until `finish` was called.
    pub fn result(&self) -> Option<SkillResult> {
        let SkillPhase::Finished(outcome) = &self.phase else {
            return None;
        };
        Some(SkillResult {
            text: self.out.text.clone(),
            token_ids: self.out.tokens.clone(),
            outcome: outcome.clone(),
            json: self.parse_json(),
            logprobs: self.options.logprobs.then(|| self.out.logprobs.clone()),
            constraint_error: self.constraint_error.as_ref().map(ToString::to_string),
        })
    }

    /// Like [`Skill::result`], without copying the output.
    pub fn into_result(self) -> Option<SkillResult> {
        let SkillPhase::Finished(outcome) = &self.phase else {
            return None;
        };
        let outcome = outcome.clone();
        let json = self.parse_json();
        Some(SkillResult {
            text: self.out.text,
            token_ids: self.out.tokens,
            outcome,
            json,
            logprobs: self.options.logprobs.then_some(self.out.logprobs),
            constraint_error: self.constraint_error.as_ref().map(ToString::to_string),
        })
    }

    fn parse_json(&self) -> Option<serde_json::Value> {
        if self.kind != SkillKind::Json || self.constraint_error.is_some() {
            return None;
        }
        serde_json::from_str(&self.out.text).ok()
    }

    fn stop(&mut self, reason: FinishReason) -> Verdict {
        self.out.seal();
        self.phase = SkillPhase::Stopped(reason);
        Verdict::Stop(reason)
    }

    fn logprob_entry(&self, token: &CommittedToken<'_>) -> Option<TokenLogprob> {
        self.options.logprobs.then(|| {
            let n = self.options.top_logprobs.min(token.top_logprobs.len());
            TokenLogprob {
                token: token.token,
                logprob: token.logprob,
                top: token.top_logprobs[..n].to_vec(),
            }
        })
    }

    /// Appends the token's text unless it is a control token; true when a
    /// stop string matched (looked for only when `match_stops`).
    fn push_text(&mut self, token: TokenId, match_stops: bool) -> bool {
        if self.ctx.is_special(token) {
            return false;
        }
        self.out.push_text(self.ctx.token_bytes(token), match_stops)
    }

    /// Whether the text rules still hold stop conditions back: fewer than
    /// `min_tokens` tokens are committed.
    fn before_min_tokens(&self) -> bool {
        match &self.rules {
            Rules::Text(rules) => self.out.tokens.len() < rules.min_tokens as usize,
            Rules::Constrained(_) => false,
        }
    }

    fn consume_text(&mut self, token: TokenId) -> Verdict {
        let Rules::Text(rules) = &self.rules else {
            unreachable!("text rules")
        };
        // The mask keeps EOS and stop ids out of the first `min_tokens`
        // tokens; a stop string counts from the `min_tokens`-th token on
        // (`record_token` already counted this one).
        let match_stops = self.out.tokens.len() >= rules.min_tokens as usize;
        if !rules.ignore_eos && self.ctx.is_eos(token) {
            return self.stop(FinishReason::Eos);
        }
        if rules.stop_token_ids.contains(&token) {
            return self.stop(FinishReason::Stop);
        }
        if self.push_text(token, match_stops) {
            return self.stop(FinishReason::Stop);
        }
        Verdict::Continue
    }

    /// The `min_tokens` mask: every token but EOS (unless ignored) and the
    /// stop token ids.
    fn fill_min_tokens_mask(&self, mask: &mut TokenMask<'_>) {
        mask.allow_all();
        let Rules::Text(rules) = &self.rules else {
            return;
        };
        if !rules.ignore_eos {
            for &eos in self.ctx.eos_token_ids() {
                mask.disallow(eos);
            }
        }
        for &t in &rules.stop_token_ids {
            mask.disallow(t);
        }
    }

    fn consume_constrained(&mut self, token: TokenId) -> Verdict {
        if self.constraint_error.is_some() {
            // fill_mask hit an engine error and allowed only EOS.
            return self.stop(FinishReason::Stop);
        }
        let is_eos = self.ctx.is_eos(token);
        if !is_eos {
            // The token is committed: its text is part of the output either way.
            self.push_text(token, false);
        }
        let Rules::Constrained(matcher) = &mut self.rules else {
            unreachable!("constrained rules")
        };
        if is_eos {
            let accepting = matcher.is_stopped() || matcher.is_accepting().unwrap_or(false);
            if !accepting {
                self.constraint_error = Some(ConstraintFailure::EndedEarly);
                return self.stop(FinishReason::Eos);
            }
            return self.stop(FinishReason::Stop);
        }
        if let Err(e) = matcher.consume_token(token) {
            self.constraint_error = Some(ConstraintFailure::Engine {
                step: "consuming a token",
                source: ConstraintCause::new(e),
            });
            return self.stop(FinishReason::Stop);
        }
        if matcher.is_stopped() {
            // The grammar accepted and no further token can extend it.
            return self.stop(FinishReason::Stop);
        }
        Verdict::Continue
    }

    fn allow_only_eos(&self, mask: &mut TokenMask<'_>) {
        mask.clear();
        for &eos in self.ctx.eos_token_ids() {
            mask.allow(eos);
        }
    }
}

impl SequenceSkill for Skill {
    fn consume(&mut self, token: &CommittedToken<'_>) -> Verdict {
        if let Some(v) = self.phase.refuse_after_stop() {
            return v;
        }
        let lp = self.logprob_entry(token);
        self.out.record_token(token.token, lp);
        match self.rules {
            Rules::Text(_) => self.consume_text(token.token),
            Rules::Constrained(_) => self.consume_constrained(token.token),
        }
    }

    /// A running grammar, or text still short of `min_tokens`.
    fn is_constrained(&self) -> bool {
        self.phase == SkillPhase::Running
            && (matches!(self.rules, Rules::Constrained(_)) || self.before_min_tokens())
    }

    fn fill_mask(&mut self, mask: &mut TokenMask<'_>) {
        if !self.is_constrained() {
            // Zombie rule: a finalized sequence is sampled unconstrained.
            mask.allow_all();
            return;
        }
        if let Rules::Text(_) = self.rules {
            self.fill_min_tokens_mask(mask);
            return;
        }
        if self.constraint_error.is_some() {
            self.allow_only_eos(mask);
            return;
        }
        let Rules::Constrained(matcher) = &mut self.rules else {
            return;
        };
        match matcher.compute_mask_or_eos() {
            Ok(vob) => {
                let src = vob.as_slice();
                let dst = mask.words_mut();
                let n = src.len().min(dst.len());
                dst[..n].copy_from_slice(&src[..n]);
                dst[n..].fill(0);
            }
            Err(e) => {
                // Finish rather than panic: only EOS may follow, and the next
                // consume ends the request with the error recorded.
                tracing::warn!(error = %e, "constraint engine failed computing a mask");
                self.constraint_error = Some(ConstraintFailure::Engine {
                    step: "computing a mask",
                    source: ConstraintCause::new(e),
                });
                self.allow_only_eos(mask);
            }
        }
    }

    /// A running constraint can: its matcher consumes drafts tentatively
    /// and rolls them back; the `min_tokens` mask depends only on the
    /// position.
    fn looks_ahead(&self) -> bool {
        self.is_constrained()
    }

    fn fill_masks_ahead(&mut self, drafts: &[TokenId], words: &mut [u32], vocab_size: usize) {
        let wpr = TokenMask::words_for(vocab_size);
        let mut masks = words.chunks_mut(wpr);
        let Some(first) = masks.next() else {
            return;
        };
        self.fill_mask(&mut TokenMask::new(first, vocab_size));
        if let Rules::Text(rules) = &self.rules {
            // Mask `j + 1` is token `committed + j + 2`'s (counting from 1).
            let committed = self.out.tokens.len();
            for (j, words) in masks.take(drafts.len()).enumerate() {
                let mut mask = TokenMask::new(words, vocab_size);
                if committed + j + 1 < rules.min_tokens as usize {
                    self.fill_min_tokens_mask(&mut mask);
                } else {
                    mask.allow_all();
                }
            }
            return;
        }
        if self.constraint_error.is_some() || !self.is_constrained() {
            return;
        }
        let mut consumed = 0;
        for (&d, words) in drafts.iter().zip(masks) {
            // EOS ends the sequence: nothing after it is sampled.
            if self.ctx.is_eos(d) {
                break;
            }
            let Rules::Constrained(matcher) = &mut self.rules else {
                unreachable!("constrained rules")
            };
            // A draft the grammar refuses is never sampled, nor what follows.
            if !matches!(matcher.try_consume_tokens(&[d]), Ok(1)) {
                break;
            }
            consumed += 1;
            match matcher.compute_mask_or_eos() {
                Ok(vob) => {
                    let src = vob.as_slice();
                    let n = src.len().min(words.len());
                    words[..n].copy_from_slice(&src[..n]);
                }
                Err(_) => break,
            }
        }
        if consumed > 0 {
            let Rules::Constrained(matcher) = &mut self.rules else {
                unreachable!("constrained rules")
            };
            if let Err(e) = matcher.rollback(consumed) {
                // The committed state is lost: end with the error, as a
                // failed mask would.
                tracing::warn!(error = %e, "constraint engine failed rolling back drafts");
                self.constraint_error = Some(ConstraintFailure::Engine {
                    step: "rolling back drafts",
                    source: ConstraintCause::new(e),
                });
            }
        }
    }

    fn finish(&mut self, outcome: Outcome) {
        debug_assert!(
            !matches!(self.phase, SkillPhase::Finished(_)),
            "finish called twice"
        );
        self.out.seal();
        self.phase = SkillPhase::Finished(outcome);
    }
}
