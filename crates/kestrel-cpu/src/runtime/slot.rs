//! Per-slot buffers: the `DecodeSlot`'s metadata (row tokens' positions,
//! paged-attention indices, the mask copied in before sampling) and the
//! `RenderBuffer`'s host outputs.
//!
//! Buffers move between threads by ownership (scheduler -> compute stream ->
//! copy stream -> scheduler), so a slot's host buffer cannot be written while
//! the scheduler still reads it (I6): the type system enforces it. Capacity
//! is kept across steps: a steady-state step allocates nothing.

use kestrel_kv::PagedIndices;
use kestrel_pipeline::{RequestId, SamplingParams, StepKind, TokenId};

/// One sequence's chunk in a prefill step (its prompt rides in
/// `SlotMeta::tokens`); it samples only when the chunk ends the prompt.
#[derive(Debug, Clone)]
pub(crate) struct PrefillRow {
    pub params: SamplingParams,
    /// Prompt tokens already in KV (prefix-cache hit, earlier chunks); the
    /// chunk ends where the row's tokens in `SlotMeta::tokens` end.
    pub start_pos: u32,
    pub prompt_len: u32,
    /// The prompt's last tokens that the sequence generated before a
    /// preemption: penalties count them as sampled tokens.
    pub generated: u32,
}

/// The `DecodeSlot`'s metadata for one step, planned on the scheduler thread.
#[derive(Debug)]
pub(crate) struct SlotMeta {
    pub kind: StepKind,
    pub step: u64,
    /// KV row of each batch row.
    pub rows: Vec<u32>,
    /// Request id of each batch row (for diagnostics).
    pub ids: Vec<RequestId>,
    /// Position of each row's input token (decode) or unused (prefill).
    pub positions: Vec<u32>,
    /// Prefill: each row's prompt up to the end of its chunk (the forward
    /// reads the chunk; publishing prefix pages reads all of it).
    pub tokens: Vec<TokenId>,
    /// Prefill: offsets of each row's prompt in `tokens`.
    pub token_indptr: Vec<u32>,
    pub prefill: Vec<PrefillRow>,
    /// Decode: each row's draft tokens, `drafts[draft_indptr[i]..
    /// draft_indptr[i + 1]]` (`draft_indptr` empty: no row has any).
    pub drafts: Vec<TokenId>,
    pub draft_indptr: Vec<u32>,
    pub indices: PagedIndices,
}

impl SlotMeta {
    pub fn new() -> Self {
        Self {
            kind: StepKind::Decode,
            step: 0,
            rows: Vec::new(),
            ids: Vec::new(),
            positions: Vec::new(),
            tokens: Vec::new(),
            token_indptr: Vec::new(),
            prefill: Vec::new(),
            drafts: Vec::new(),
            draft_indptr: Vec::new(),
            indices: PagedIndices::default(),
        }
    }

    pub fn reset(&mut self, kind: StepKind, step: u64) {
        self.kind = kind;
        self.step = step;
        self.rows.clear();
        self.ids.clear();
        self.positions.clear();
        self.tokens.clear();
        self.token_indptr.clear();
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
    }
}
