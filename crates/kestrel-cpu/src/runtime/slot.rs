//! Per-slot buffers: the `DecodeSlot`'s metadata (the step's KV plan:
//! rows, positions, paged-attention indices; sampling parameters, drafts,
//! the mask copied in before sampling) and the `RenderBuffer`'s host outputs
//! (sampled ids and the spatial stage's values).
//!
//! Buffers move between threads by ownership (scheduler -> compute stream ->
//! copy stream -> scheduler), so a slot's host buffer cannot be written while
//! the scheduler still reads it (I6): the type system enforces it. Capacity
//! is kept across steps: a steady-state step allocates nothing.

use kestrel_kv::KvStep;
use kestrel_pipeline::PromptEmbeds;
use kestrel_pipeline::{RequestId, SamplingParams, StepKind, TokenId, TokenValues};

/// One sequence's chunk in a prefill step (its prompt and span ride in
/// `SlotMeta::kv`: the chunk is `kv.tokens(i)[kv.starts[i]..]`); it samples
/// only when the chunk ends the prompt.
#[derive(Debug, Clone)]
pub(crate) struct PrefillRow {
    pub params: SamplingParams,
    pub prompt_len: u32,
    /// The prompt's last tokens that the sequence generated before a
    /// preemption: penalties count them as sampled tokens.
    pub generated: u32,
    /// The values committed with those generated tokens (one each), or
    /// empty when all were zeros: a generated `coord_id` / `size_id` is
    /// embedded from its value ([`kestrel_pipeline::PrefillInput::generated_values`]).
    pub generated_values: Vec<TokenValues>,
    /// Prompt rows embedded from an image (its input checked at launch to
    /// be a `PreparedImage` the runtime's vision model takes).
    pub embeds: Option<PromptEmbeds>,
}

/// The `DecodeSlot`'s metadata for one step, planned on the scheduler thread.
#[derive(Debug)]
pub(crate) struct SlotMeta {
    pub kind: StepKind,
    pub step: u64,
    /// The step's KV plan ([`kestrel_kv::SeqBook::plan_step`]): each batch
    /// row's KV row and request, its first position (a decode row's input
    /// token's), a prefill row's prompt up to its chunk's end, the page layout.
    pub kv: KvStep<RequestId>,
    pub prefill: Vec<PrefillRow>,
    /// Decode: each row's draft tokens, `drafts[draft_indptr[i]..
    /// draft_indptr[i + 1]]` (`draft_indptr` empty: no row has any).
    pub drafts: Vec<TokenId>,
    pub draft_indptr: Vec<u32>,
}

impl SlotMeta {
    pub fn new() -> Self {
        Self {
            kind: StepKind::Decode,
            step: 0,
            kv: KvStep::default(),
            prefill: Vec::new(),
            drafts: Vec::new(),
            draft_indptr: Vec::new(),
        }
    }

    pub fn reset(&mut self, kind: StepKind, step: u64) {
        self.kind = kind;
        self.step = step;
        self.prefill.clear();
        self.drafts.clear();
        self.draft_indptr.clear();
    }

    /// Row `i`'s drafts (empty when none).
    pub fn drafts(&self, i: usize) -> &[TokenId] {
        if self.draft_indptr.is_empty() {
            return &[];
        }
        &self.drafts[self.draft_indptr[i] as usize..self.draft_indptr[i + 1] as usize]
    }
}

/// Sampled outputs of one step, in row order: on the "device" side
/// (`DeviceOutputs`, written by sampling) and in the `RenderBuffer` (host copy).
#[derive(Debug, Default)]
pub(crate) struct Outputs {
    pub step: u64,
    pub tokens: Vec<TokenId>,
    pub logprobs: Vec<f32>,
    pub top: Vec<(TokenId, f32)>,
    pub top_n: usize,
    /// Row `i`'s tokens are `tokens[row_indptr[i]..row_indptr[i + 1]]`
    /// when the step verified drafts; empty when each row has one.
    pub row_indptr: Vec<u32>,
    /// The spatial stage's values, one per token (`coord_id`'s coordinate,
    /// `size_id`'s size, zeros for other ids); empty when no token of the
    /// step is a spatial id (or the runtime has no region model).
    pub values: Vec<TokenValues>,
}

impl Outputs {
    pub fn copy_from(&mut self, src: &Outputs) {
        self.step = src.step;
        self.tokens.clear();
        self.tokens.extend_from_slice(&src.tokens);
        self.logprobs.clear();
        self.logprobs.extend_from_slice(&src.logprobs);
        self.top.clear();
        self.top.extend_from_slice(&src.top);
        self.top_n = src.top_n;
        self.row_indptr.clear();
        self.row_indptr.extend_from_slice(&src.row_indptr);
        self.values.clear();
        self.values.extend_from_slice(&src.values);
    }
}
