//! The executor trait: what a runtime (CPU threads, CUDA streams, or the
//! simulated device in [`crate::testing`]) must provide for the engine loop.
//!
//! Every call but [`Executor::wait_step`] returns without waiting for the
//! device. A runtime owns two (or more) slots; the loop guarantees a slot is
//! never launched into before its previous step was committed (I6), and that
//! steps are waited on in launch order (I2). What a runtime can do is one
//! [`Capabilities`] value ([`Executor::capabilities`]) that the loop, the
//! engine's request validation and the bench all read.

use crate::{PromptEmbeds, RequestId, StepTiming, TokenId};

/// Index of a ping-pong slot (`0..num_slots`).
pub type SlotId = usize;

/// One sequence's part of a prefill launch: a chunk of its prompt.
///
/// A prompt is prefilled in one step or, under a chunk budget, in several
/// (`max_tokens` each at most). The first step admits the sequence (its KV
/// is taken for the whole prompt then, so later chunks never run out) and
/// starts after its prefix-cache hit; each later step resumes where the
/// previous one ended. Only the step that reaches the prompt's end samples
/// the sequence's next token; the others return no row for it.
///
/// A sequence re-admitted after a preemption is prefilled again with its
/// prompt and the tokens it had generated (`generated` of them, at the end
/// of `prompt`, with their `generated_values`): the step samples the token
/// its next decode step would have, at the same position.
#[derive(Debug)]
pub struct PrefillInput<'a, P> {
    pub id: RequestId,
    /// The whole prompt (later chunks read their tokens, and penalties all).
    pub prompt: &'a [TokenId],
    /// How many of `prompt`'s last tokens the sequence generated before a
    /// preemption (0 for a new request): the sampler's penalties count them
    /// as tokens it sampled.
    pub generated: usize,
    /// The [`TokenValues`] committed with each of the `generated` tokens
    /// (the spatial stage's, decoded when they were sampled), in order, or
    /// empty when every one was the default (zeros; always for a new
    /// request). A runtime with a spatial stage embeds a generated
    /// coordinate or size id from its value, as the decode step after it
    /// did, not from the token table: a value is decoded from the hidden
    /// state before its token, so a forward over the tokens cannot
    /// recompute it.
    pub generated_values: &'a [TokenValues],
    /// Sampling parameters, opaque to the pipeline.
    pub params: &'a P,
    /// Tokens the sequence may hold in total (prompt + generated): a runtime
    /// may reserve KV for all of it at admission, or grow it step by step
    /// ([`Executor::grow`]).
    pub max_len: usize,
    /// Admission or the next chunk.
    pub start: PrefillStart,
    /// Prompt tokens this step computes at most (`usize::MAX`: the rest),
    /// except that a chunk starting inside a bidirectional prefix computes
    /// the prefix's rest whatever the budget ([`PrefillInput::chunk_end`]).
    pub max_tokens: usize,
    /// Prompt rows the runtime embeds from another input (an image), if any.
    pub embeds: Option<&'a PromptEmbeds>,
}

/// Where a prefill step starts in its sequence's prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillStart {
    /// A new sequence: allocate its KV and start after the prompt tokens the
    /// prefix cache serves ([`Executor::cached_prompt_tokens`]).
    Admit,
    /// A new sequence that is another sample of `parent`'s request (`n >
    /// 1`), with the same prompt, admitted once `parent`'s prompt has been
    /// launched to its end: allocate its KV sharing, by reference count, the
    /// parent's full pages of prompt KV (written by a step launched before
    /// this one, so on one compute stream they are written before they are
    /// read), and start after them, as after a prefix-cache hit
    /// ([`Executor::cached_prompt_tokens`]). The parent's last, partial
    /// page is not shared: the fork computes those few tokens (fewer than a
    /// page, and at least the last prompt token, whose logits it samples
    /// with its own seed) into a page of its own, so no page is ever
    /// written by two sequences and no copy-on-write is needed. If `parent`
    /// no longer holds KV, this is [`PrefillStart::Admit`].
    Fork {
        /// The sample whose prompt pages are shared.
        parent: RequestId,
    },
    /// An admitted sequence whose prompt's first `n` tokens are in KV (or
    /// written by an earlier step still in flight).
    Resume(usize),
}

impl PrefillStart {
    /// Whether the step admits the sequence (takes its KV): `Admit` or `Fork`.
    pub fn admits(&self) -> bool {
        !matches!(self, PrefillStart::Resume(_))
    }

    /// The parent whose prompt pages a `Fork` shares.
    pub fn fork_of(&self) -> Option<RequestId> {
        match *self {
            PrefillStart::Fork { parent } => Some(parent),
            _ => None,
        }
    }
}

impl<P> PrefillInput<'_, P> {
    /// The end of the chunk that starts at `start`: the one rule both the
    /// pipeline and the runtimes use to agree on a step's tokens. A chunk
    /// never ends strictly inside a bidirectional prefix
    /// ([`PromptEmbeds::bidirectional_end`]): one that would is extended to
    /// the prefix's end, past `max_tokens` if need be.
    pub fn chunk_end(&self, start: usize) -> usize {
        let end = start.saturating_add(self.max_tokens);
        let end = self.embeds.map_or(end, |e| e.chunk_end(start, end));
        end.min(self.prompt.len())
    }

    /// Whether `generated_values` fits the input: empty, or one per
    /// generated token (a runtime refuses anything else before dispatch).
    pub fn values_fit(&self) -> bool {
        self.generated_values.is_empty()
            || (self.generated_values.len() == self.generated
                && self.generated <= self.prompt.len())
    }

    /// The values committed with the token at position `pos` of `prompt`:
    /// a generated token's from `generated_values`, the default (zeros) for
    /// a prompt token or when none were kept.
    pub fn values_at(&self, pos: usize) -> TokenValues {
        let first = self.prompt.len() - self.generated.min(self.prompt.len());
        pos.checked_sub(first)
            .and_then(|i| self.generated_values.get(i))
            .copied()
            .unwrap_or_default()
    }

    /// Whether the chunk starting at `start` reaches the prompt's end, so
    /// the step samples this sequence's first token.
    pub fn samples_from(&self, start: usize) -> bool {
        self.chunk_end(start) == self.prompt.len()
    }
}

/// Draft tokens of a decode step's rows (prompt-lookup speculation): row
/// `i` proposes `tokens[indptr[i]..indptr[i + 1]]` to follow its input
/// token. An empty `indptr` means no row has drafts ([`Drafts::NONE`]).
///
/// For a row with drafts `d_1..d_m` the runtime computes the input token
/// and the drafts in one forward (positions `p..=p+m`) and samples
/// sequentially: `t_0` from the input's logits, then, while `t_j ==
/// d_{j+1}`, `t_{j+1}` from `d_{j+1}`'s logits, each exactly as a decode
/// step at that position would (same random draw, penalties counting the
/// tokens before it). It returns `t_0..=t_a` (`a` drafts accepted) and rolls
/// its KV back to the accepted tokens; `t_a` is the next input. For a
/// one-hot draft this is the standard rejection rule (accept with
/// probability `p(d)`, else sample `p` without `d`), and with the
/// position-keyed draw it emits exactly the tokens decoding without drafts
/// would. A constrained row's masks cover each of its positions (see
/// [`MaskBatch`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Drafts<'a> {
    pub indptr: &'a [u32],
    pub tokens: &'a [TokenId],
}

impl<'a> Drafts<'a> {
    /// No row has drafts.
    pub const NONE: Drafts<'static> = Drafts {
        indptr: &[],
        tokens: &[],
    };

    /// Row `i`'s drafts (empty when none).
    pub fn row(&self, i: usize) -> &'a [TokenId] {
        if self.indptr.is_empty() {
            return &[];
        }
        &self.tokens[self.indptr[i] as usize..self.indptr[i + 1] as usize]
    }

    /// Whether no row has drafts.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Whether these drafts fit a step of `rows` rows that may verify
    /// `limit` draft tokens in all: no offsets and no tokens, or `rows + 1`
    /// offsets rising from 0 to the token count. A runtime checks this
    /// before it plans the step, so a malformed step is refused before
    /// dispatch.
    ///
    /// # Errors
    /// [`DraftsError`], with the counts that did not fit.
    pub fn check(&self, rows: usize, limit: usize) -> Result<(), DraftsError> {
        let d = self.indptr;
        let well_formed = if d.is_empty() {
            self.tokens.is_empty()
        } else {
            d.len() == rows + 1
                && d[0] == 0
                && d.windows(2).all(|w| w[0] <= w[1])
                && d[rows] as usize == self.tokens.len()
        };
        if well_formed && self.tokens.len() <= limit {
            return Ok(());
        }
        Err(DraftsError {
            rows,
            offsets: d.len(),
            tokens: self.tokens.len(),
            limit,
        })
    }
}

/// A decode step's [`Drafts`] that do not fit it ([`Drafts::check`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "a decode step's drafts do not fit: {tokens} tokens (at most {limit}) over {offsets} \
     offsets for {rows} rows (0 or rows + 1, rising from 0 to the tokens)"
)]
pub struct DraftsError {
    /// Rows of the step.
    pub rows: usize,
    /// Offsets given (`Drafts::indptr`'s length).
    pub offsets: usize,
    /// Draft tokens given.
    pub tokens: usize,
    /// Draft tokens the runtime verifies in one step at most.
    pub limit: usize,
}

/// Masks for the rows of one step, in member order: one row per position a
/// member may sample (its next token, then one per draft it verifies), so
/// member `i`'s first mask row is `i + drafts.indptr[i]` when the step
/// carries drafts, and `i` otherwise.
#[derive(Debug, Clone, Copy)]
pub struct MaskBatch<'a> {
    /// `u32` words per row (`vocab_size.div_ceil(32)`).
    pub words_per_row: usize,
    /// `rows * words_per_row` words; rows with `constrained[i] == false` are unspecified.
    pub words: &'a [u32],
    /// Whether row `i` is masked.
    pub constrained: &'a [bool],
}

impl MaskBatch<'_> {
    /// The mask of row `i`, or `None` when the row is unconstrained.
    pub fn row(&self, i: usize) -> Option<&[u32]> {
        self.constrained[i]
            .then(|| &self.words[i * self.words_per_row..(i + 1) * self.words_per_row])
    }
}

/// Host copies of one step's sampled outputs: one token per member, or,
/// when a decode step carried [`Drafts`], each member's accepted tokens.
#[derive(Debug, Clone, Copy)]
pub struct StepOutputs<'a> {
    pub tokens: &'a [TokenId],
    /// Log-probability of each sampled token, if the runtime computed them.
    pub logprobs: Option<&'a [f32]>,
    /// `tokens.len() * top_n` alternatives, best first per token.
    pub top_logprobs: &'a [(TokenId, f32)],
    pub top_n: usize,
    /// Member `i`'s tokens are `tokens[row_indptr[i]..row_indptr[i + 1]]`;
    /// empty when every member has exactly one (token `i`).
    pub row_indptr: &'a [u32],
    /// The spatial values decoded beside each sampled token (one per
    /// token, same order), or empty when the runtime decoded none (no
    /// spatial stage, or none ran this step).
    pub values: &'a [TokenValues],
}

/// What a runtime's spatial stage decoded from the hidden state a token was
/// sampled from (the seeds' `coord_values` `[B, 1]` and `size_values`
/// `[B, 2]`): a coordinate and a (width, height) size, both meant in
/// `[0, 1]`. The sampled id says which one the sequence means; the pipeline
/// carries both to the skill and reads neither.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TokenValues {
    pub coord: f32,
    pub size: [f32; 2],
}

impl<'a> StepOutputs<'a> {
    /// The values decoded beside sampled token `i` (zeros when the runtime
    /// decoded none).
    pub fn values_of(&self, i: usize) -> TokenValues {
        self.values.get(i).copied().unwrap_or_default()
    }

    /// The alternatives of sampled token `i` (an index into `tokens`).
    pub fn top(&self, i: usize) -> &'a [(TokenId, f32)] {
        if self.top_n == 0 {
            return &[];
        }
        &self.top_logprobs[i * self.top_n..(i + 1) * self.top_n]
    }

    /// The indices into `tokens` of member `row`'s tokens.
    pub fn row_range(&self, row: usize) -> std::ops::Range<usize> {
        if self.row_indptr.is_empty() {
            return row..row + 1;
        }
        self.row_indptr[row] as usize..self.row_indptr[row + 1] as usize
    }

    /// Members the outputs cover.
    pub fn num_rows(&self) -> usize {
        match self.row_indptr.len() {
            0 => self.tokens.len(),
            n => n - 1,
        }
    }
}

/// What a runtime can do, in one value: the pipeline sizes its steps by it
/// (`max_rows`, `max_draft_tokens`), the engine validates requests and its
/// configuration against it, and wrappers forward it whole, so no capability
/// can be forwarded in one place and silently defaulted in another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// KV rows the runtime can hold at once (excluding any reserved row):
    /// the largest batch.
    pub max_rows: usize,
    /// Draft tokens one decode step may carry in all (0: the runtime does
    /// not verify drafts, and the scheduler never sends any).
    pub max_draft_tokens: usize,
    /// Whether the sampler applies `SamplingParams::logit_bias`.
    pub logit_bias: bool,
    /// Whether a prompt may be prefilled in several steps
    /// ([`PrefillStart::Resume`], `LoopConfig::prefill_chunk`).
    pub chunked_prefill: bool,
    /// Whether a preempted sequence may be prefilled again with the tokens
    /// it generated ([`PrefillInput::generated`] > 0). A runtime without it
    /// must reserve each sequence's whole `max_len` at admission, so that
    /// [`Executor::grow`] never runs short and nothing is preempted.
    pub readmission: bool,
    /// Whether the runtime scores a request's prompt (its prompt
    /// logprobs); a request asking for them on a runtime without it is
    /// refused.
    pub prompt_logprobs: bool,
}

impl Capabilities {
    /// Whether the runtime verifies draft tokens (speculative decoding).
    pub fn drafts(&self) -> bool {
        self.max_draft_tokens > 0
    }
}

/// An executor failure, classified by whether device work had started.
#[derive(Debug, thiserror::Error)]
pub enum ExecError<E: std::error::Error + 'static> {
    /// Nothing reached the device; the executor's state is as before the
    /// call. Only this step's requests fail; the engine keeps serving.
    #[error("step rejected before dispatch")]
    PreDispatch(#[source] E),
    /// Device work may be in flight or corrupt: engine-fatal (section 4.8).
    #[error("device fault")]
    Fatal(#[source] E),
}

/// The device side of the pipeline.
pub trait Executor {
    /// Per-request sampling parameters, carried opaquely from submit to prefill.
    type Params;
    type Error: std::error::Error + Send + Sync + 'static;

    /// Number of ping-pong slots (2 for pipelined decoding).
    fn num_slots(&self) -> usize {
        2
    }

    fn vocab_size(&self) -> usize;

    /// What the runtime can do (rows, drafts, logit bias, chunked prefill,
    /// re-admission). Constant for the runtime's life.
    fn capabilities(&self) -> Capabilities;

    /// KV rows allocated now, zombies included. The scheduler's capacity truth.
    fn num_allocated(&self) -> usize;

    /// Whether a new sequence with this prompt, growing to `max_len` tokens,
    /// could be admitted now: a free row and the KV the runtime takes at
    /// admission (the prompt's pages for a runtime that grows sequences with
    /// [`Executor::grow`], all of `max_len` for one that reserves up front).
    fn can_admit(&self, prompt: &[TokenId], max_len: usize) -> bool;

    /// Make room for `len` KV positions of the admitted sequence `id`, taking
    /// pages as it grows. `false` when the cache is short of pages, with
    /// nothing taken: the scheduler then preempts a sequence (or lets this
    /// one wait a step) and asks again. A runtime that reserved `max_len` at
    /// admission answers `true` within it.
    fn grow(&mut self, id: RequestId, len: usize) -> bool;

    /// Whether a sequence of `max_len` tokens could ever fit in an empty cache.
    fn could_ever_fit(&self, max_len: usize) -> bool;

    /// Allocate KV for each new sequence ([`PrefillStart::Admit`]) and launch
    /// the forward of each input's chunk on `slot`. Sampling is launched
    /// separately by [`Executor::finalize_sampling`], for the inputs whose
    /// chunk ends their prompt only (in input order).
    fn launch_prefill(
        &mut self,
        slot: SlotId,
        seqs: &[PrefillInput<'_, Self::Params>],
    ) -> Result<(), ExecError<Self::Error>>;

    /// Prompt tokens of an admitted sequence whose KV it had at admission
    /// (their prefill was skipped): a prefix-cache hit, or the pages a
    /// [`PrefillStart::Fork`] shares. Runtimes without either report 0.
    fn cached_prompt_tokens(&self, id: RequestId) -> usize {
        let _ = id;
        0
    }

    /// Launch one decode forward on `slot` for `rows` (request ids, in row
    /// order). Each row's input token is the one its previous step sampled,
    /// already on the device; a row with `drafts` verifies them in the same
    /// forward (see [`Drafts`]; the scheduler grew its KV for them, and
    /// sends at most [`Capabilities::max_draft_tokens`] in all).
    fn launch_decode(
        &mut self,
        slot: SlotId,
        rows: &[RequestId],
        drafts: Drafts<'_>,
    ) -> Result<(), ExecError<Self::Error>>;

    /// Launch sampling (with the masks, if any) for the forward on `slot`,
    /// record the step-done event and start the deferred copy to host.
    fn finalize_sampling(
        &mut self,
        slot: SlotId,
        masks: Option<&MaskBatch<'_>>,
    ) -> Result<(), ExecError<Self::Error>>;

    /// Block until the copy of `slot`'s step is on the host and return it.
    /// Every error here is engine-fatal.
    fn wait_step(&mut self, slot: SlotId) -> Result<StepOutputs<'_>, Self::Error>;

    /// Free the KV of a sequence no in-flight step references any more.
    fn release(&mut self, id: RequestId);

    /// Free the KV of a preempted sequence no in-flight step references.
    /// `tokens` are its prompt and generated tokens; a runtime with a prefix
    /// cache files the pages it has written first, so the re-admission
    /// ([`PrefillInput::generated`]) recomputes only the rest. By default,
    /// [`Executor::release`].
    fn preempt(&mut self, id: RequestId, tokens: &[TokenId]) {
        let _ = tokens;
        self.release(id);
    }

    /// Free everything (engine-fatal path); the runtime must synchronize first.
    fn release_all(&mut self);

    /// The loop drained and paused (section 4.5a) and is resuming: nothing
    /// is in flight. Rebuild what a pause may have invalidated (a CUDA
    /// runtime recaptures its graphs here). An error is engine-fatal.
    fn on_resume(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Start (`true`) or stop recording when the device ran each step's
    /// forward and sampling ([`StepTiming`]), for device-idle metrics and
    /// benchmarks; read them with [`Executor::drain_timings`]. Runtimes that
    /// cannot time their device record nothing (the default).
    fn record_timings(&mut self, on: bool) -> Result<(), Self::Error> {
        let _ = on;
        Ok(())
    }

    /// Append to `out` the timings of the steps committed since the last
    /// call, in commit order (nothing when not recording).
    fn drain_timings(&mut self, out: &mut Vec<StepTiming>) {
        let _ = out;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn input<'a>(
        prompt: &'a [TokenId],
        max_tokens: usize,
        embeds: Option<&'a PromptEmbeds>,
    ) -> PrefillInput<'a, ()> {
        PrefillInput {
            id: 1,
            prompt,
            generated: 0,
            generated_values: &[],
            params: &(),
            max_len: prompt.len() + 4,
            start: PrefillStart::Admit,
            max_tokens,
            embeds,
        }
    }

    /// A chunk starting inside a bidirectional prefix reaches its end, even
    /// past the budget; elsewhere the budget holds, and no chunk passes
    /// the prompt.
    #[test]
    fn chunk_end_never_ends_inside_the_bidirectional_prefix() {
        let prompt = [1; 40];
        let e = PromptEmbeds {
            start: 1,
            len: 29,
            bidirectional_end: 30,
            input: Arc::new(()),
        };
        for max_tokens in 1..45 {
            let plain = input(&prompt, max_tokens, None);
            let with = input(&prompt, max_tokens, Some(&e));
            for start in 0..prompt.len() {
                let end = with.chunk_end(start);
                assert_eq!(plain.chunk_end(start), (start + max_tokens).min(40));
                if start < 30 {
                    assert_eq!(
                        end,
                        (start + max_tokens).clamp(30, 40),
                        "{start}+{max_tokens}"
                    );
                } else {
                    assert_eq!(end, plain.chunk_end(start));
                }
            }
        }
        // Each chunk of a whole run at any budget starts outside the prefix
        // or ends at or past its end.
        for max_tokens in 1..45 {
            let with = input(&prompt, max_tokens, Some(&e));
            let mut start = 0;
            while start < prompt.len() {
                let end = with.chunk_end(start);
                assert!(end > start && (start >= 30 || end >= 30));
                start = end;
            }
        }
        assert_eq!(input(&prompt, usize::MAX, Some(&e)).chunk_end(3), 40);
    }
}
