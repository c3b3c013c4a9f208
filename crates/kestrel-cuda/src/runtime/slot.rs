//! Per-slot device state (`DecodeSlot`) and its host destination
//! (`RenderBuffer`), as in the design doc's sections 4.1-4.3.
//!
//! A `DecodeSlot` owns its pinned metadata buffers (H2D sources), mask
//! buffer, forward workspace, hidden/logits buffers, sampling staging
//! buffers, its step-done and timing events and its captured graphs (keyed
//! by bucket): nothing is shared between the two slots except the compute
//! stream (I1) and the model. A `RenderBuffer` owns page-locked host outputs
//! and the copy-done event; its slot is not reused before commit (I6).

use std::collections::HashMap;

use half::f16;
use kestrel_kv::KvStep;
use kestrel_pipeline::{LogitBias, RequestId, StepKind};

use super::backend::Device;
use super::timing::StepEvents;
use crate::ffi::SampleParams;
use crate::host::{mask_words, DecodeLayout};
use crate::CudaError;

/// Most alternatives a row reports (as kestrel-cpu's `MAX_TOP_LOGPROBS`).
pub(crate) const MAX_TOP: usize = 20;

/// Sizes of one slot's buffers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlotDims {
    /// Rows of one forward call: max(decode batch, prefill chunk).
    pub fwd_rows: usize,
    /// Rows sampled at once (decode batch and its drafts, prefill sequences).
    pub max_batch: usize,
    /// Sequences in one step (the decode batch).
    pub max_members: usize,
    pub hidden: usize,
    pub qkv: usize,
    pub q_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub layout: DecodeLayout,
}

/// Forward scratch (the graph workspace): addresses captured by graphs.
pub(crate) struct Workspace<D: Device> {
    pub x: D::Buf,
    pub xn: D::Buf,
    pub qkv: D::Buf,
    pub attn: D::Buf,
    pub delta: D::Buf,
    pub gate_up: D::Buf,
    pub act: D::Buf,
}

/// The step launched on a slot, kept until its commit.
#[derive(Debug)]
pub(crate) struct StepState {
    pub kind: StepKind,
    pub n: usize,
    pub top_n: usize,
    /// Device addresses of each sampled row's KV row and RNG position.
    pub rows_ptr: u64,
    pub positions_ptr: u64,
    /// The step number the slot protocol gave this launch.
    pub step: u64,
    /// The slot's timing events were recorded for this step.
    pub timed: bool,
    /// Some row has a `logit_bias` (packed in the slot's bias buffer).
    pub bias: bool,
    /// A decode step that verifies drafts.
    pub verify: Option<VerifyStep>,
}

/// Device addresses of a verifying decode step's metadata (see
/// `kernels/verify.cu` and `host::VerifyLayout`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct VerifyStep {
    pub members: usize,
    /// Rows of the member with the most drafts.
    pub max_rows: usize,
    pub qo: u64,
    pub kv_rows: u64,
    pub tokens: u64,
}

pub(crate) struct DecodeSlot<D: Device> {
    pub ws: Workspace<D>,
    pub hidden_last: D::Buf,
    pub logits: D::Buf,
    pub layout: DecodeLayout,
    pub meta_host: D::Host<u32>,
    pub meta_dev: D::Buf,
    pub prefill_host: D::Host<u32>,
    pub prefill_dev: D::Buf,
    pub prefill_words: Vec<u32>,
    /// Encoded images dropped from the runtime's cache while launching the
    /// slot's step, which may read them: freed when the slot launches its
    /// next prefill, after its commit (I6).
    pub images: Vec<D::Buf>,
    pub params_host: D::Host<SampleParams>,
    pub params_dev: D::Buf,
    pub mask_host: D::Host<u32>,
    pub mask_dev: D::Buf,
    /// The rows' `logit_bias` as `sample.cu` reads it (grown on demand).
    pub bias_host: D::Host<u32>,
    pub bias_dev: D::Buf,
    pub out_tokens: D::Buf,
    pub out_logprobs: D::Buf,
    pub out_top_ids: D::Buf,
    pub out_top_lps: D::Buf,
    /// Each member's accepted tokens of a verifying step.
    pub out_accepted: D::Buf,
    /// Each sampled row's spatial values (coord, w, h; Moondream).
    pub out_values: D::Buf,
    /// The launched verifying step's member row offsets (host copy).
    pub verify_qo: Vec<u32>,
    pub graphs: HashMap<usize, D::Graph>,
    /// The launched step's KV plan ([`kestrel_kv::SeqBook::plan_step`]),
    /// kept until its commit publishes a prefill's prompt pages.
    pub kv: KvStep<RequestId>,
    pub step_done: D::Event,
    /// Recorded around the step only while the runtime records timings.
    pub timing: StepEvents<D>,
    pub state: Option<StepState>,
}

impl<D: Device> DecodeSlot<D> {
    pub fn new(d: &D, dims: &SlotDims) -> Result<Self, CudaError> {
        let r = dims.fwd_rows;
        // Every device buffer of a slot starts zeroed: the graph warm-up of
        // `rebuild_graphs` runs each bucket's forward before any step wrote
        // these buffers, so no kernel reads memory nothing wrote.
        let f32s = |n: usize| d.alloc_zeroed(n * 4);
        let f16s = |n: usize| d.alloc_zeroed(n * std::mem::size_of::<f16>());
        let u32s = |n: usize| d.alloc_zeroed(n * 4);
        let mw = mask_words(dims.max_batch, dims.vocab);
        Ok(DecodeSlot {
            ws: Workspace {
                x: f32s(r * dims.hidden)?,
                xn: f16s(r * dims.hidden)?,
                qkv: f32s(r * dims.qkv)?,
                attn: f16s(r * dims.q_dim)?,
                delta: f32s(r * dims.hidden)?,
                gate_up: f32s(r * 2 * dims.ffn)?,
                act: f16s(r * dims.ffn)?,
            },
            hidden_last: f16s(dims.max_batch * dims.hidden)?,
            logits: f32s(dims.max_batch * dims.vocab)?,
            layout: dims.layout,
            meta_host: d.host(dims.layout.total_words())?,
            meta_dev: u32s(dims.layout.total_words())?,
            prefill_host: d.host(0)?,
            prefill_dev: u32s(0)?,
            prefill_words: Vec::new(),
            images: Vec::new(),
            params_host: d.host(dims.max_batch)?,
            params_dev: d.alloc_zeroed(dims.max_batch * std::mem::size_of::<SampleParams>())?,
            mask_host: d.host(mw)?,
            mask_dev: u32s(mw)?,
            bias_host: d.host(0)?,
            bias_dev: u32s(0)?,
            out_tokens: u32s(dims.max_batch)?,
            out_logprobs: f32s(dims.max_batch)?,
            out_top_ids: u32s(dims.max_batch * MAX_TOP)?,
            out_top_lps: f32s(dims.max_batch * MAX_TOP)?,
            out_accepted: u32s(dims.max_members)?,
            out_values: f32s(dims.max_batch * 3)?,
            verify_qo: Vec::new(),
            graphs: HashMap::new(),
            kv: KvStep::default(),
            step_done: d.event(false)?,
            timing: StepEvents::new(d)?,
            state: None,
        })
    }

    /// Grow the prefill metadata buffers to `words` (only while the slot is
    /// idle: its previous copies have completed).
    pub fn ensure_prefill_capacity(&mut self, d: &D, words: usize) -> Result<(), CudaError> {
        use super::backend::HostMem;
        if self.prefill_host.as_slice().len() < words {
            let cap = words.next_power_of_two();
            self.prefill_host = d.host(cap)?;
            self.prefill_dev = d.alloc_zeroed(cap * 4)?;
        }
        Ok(())
    }

    /// Pack the rows' `logit_bias` into the slot's pinned bias buffer as
    /// `sample.cu` reads it (`n + 1` offsets, then (token, f32 bits)
    /// pairs), growing it first (only while the slot is idle); returns the
    /// words to copy, 0 when no row has a bias.
    pub fn pack_bias(&mut self, d: &D, biases: &[LogitBias]) -> Result<usize, CudaError> {
        use super::backend::HostMem;
        let n = biases.len();
        let entries: usize = biases.iter().map(|b| b.entries().len()).sum();
        if entries == 0 {
            return Ok(0);
        }
        let words = n + 1 + 2 * entries;
        if self.bias_host.as_slice().len() < words {
            let cap = words.next_power_of_two();
            self.bias_host = d.host(cap)?;
            self.bias_dev = d.alloc_zeroed(cap * 4)?;
        }
        let host = self.bias_host.as_mut_slice();
        let (offsets, pairs) = host.split_at_mut(n + 1);
        offsets[0] = 0;
        let mut e = 0;
        for (i, b) in biases.iter().enumerate() {
            for &(t, v) in b.entries() {
                pairs[2 * e] = t;
                pairs[2 * e + 1] = v.to_bits();
                e += 1;
            }
            offsets[i + 1] = e as u32;
        }
        Ok(words)
    }
}

/// Host copies of one slot's sampled outputs (page-locked on CUDA).
pub(crate) struct RenderBuffer<D: Device> {
    pub tokens: D::Host<u32>,
    pub logprobs: D::Host<f32>,
    pub top_ids: D::Host<u32>,
    pub top_lps: D::Host<f32>,
    /// Each member's accepted tokens of a verifying step.
    pub accepted: D::Host<u32>,
    /// Each row's spatial values (coord, w, h), with a region model.
    pub values: D::Host<f32>,
    pub copy_done: D::Event,
}

impl<D: Device> RenderBuffer<D> {
    pub fn new(d: &D, max_batch: usize, max_members: usize) -> Result<Self, CudaError> {
        Ok(RenderBuffer {
            tokens: d.host(max_batch)?,
            logprobs: d.host(max_batch)?,
            top_ids: d.host(max_batch * MAX_TOP)?,
            top_lps: d.host(max_batch * MAX_TOP)?,
            accepted: d.host(max_members)?,
            values: d.host(max_batch * 3)?,
            copy_done: d.event(false)?,
        })
    }
}
