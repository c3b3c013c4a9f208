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
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaGraph, DriverError};
use half::f16;
use kestrel_kv::RowId;
use kestrel_pipeline::StepKind;

use super::mem::{DevBuf, HostBuf};
use super::timing::StepEvents;
use crate::ffi::SampleParams;
use crate::host::{mask_words, DecodeLayout};

/// Most alternatives a row reports (as kestrel-cpu's `MAX_TOP_LOGPROBS`).
pub(crate) const MAX_TOP: usize = 20;

/// Sizes of one slot's buffers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlotDims {
    /// Rows of one forward call: max(decode batch, prefill chunk).
    pub fwd_rows: usize,
    /// Rows sampled at once (decode batch, prefill sequences).
    pub max_batch: usize,
    pub hidden: usize,
    pub qkv: usize,
    pub q_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub layout: DecodeLayout,
}

/// Forward scratch (the graph workspace): addresses captured by graphs.
pub(crate) struct Workspace {
    pub x: DevBuf,
    pub xn: DevBuf,
    pub qkv: DevBuf,
    pub attn: DevBuf,
    pub delta: DevBuf,
    pub gate_up: DevBuf,
    pub act: DevBuf,
}

/// A captured forward. `CudaGraph` is not `Send`; see the impl below.
pub(crate) struct Graph(pub CudaGraph);

// SAFETY: a graph exec is a driver handle usable from any thread with its
// context bound; the runtime owning it is used by one thread at a time.
unsafe impl Send for Graph {}

/// The step launched on a slot, kept until its commit.
#[derive(Debug)]
pub(crate) struct StepState {
    pub kind: StepKind,
    pub n: usize,
    pub top_n: usize,
    /// Device addresses of each sampled row's KV row and RNG position.
    pub rows_ptr: u64,
    pub positions_ptr: u64,
    /// Prefill: the rows admitted and their prompts (for prefix publication).
    pub prompts: Vec<(RowId, Vec<u32>)>,
    /// The step number the ledger gave this launch.
    pub step: u64,
    /// The slot's timing events were recorded for this step.
    pub timed: bool,
}

pub(crate) struct DecodeSlot {
    pub ws: Workspace,
    pub hidden_last: DevBuf,
    pub logits: DevBuf,
    pub layout: DecodeLayout,
    pub meta_host: HostBuf<u32>,
    pub meta_dev: DevBuf,
    pub prefill_host: HostBuf<u32>,
    pub prefill_dev: DevBuf,
    pub prefill_words: Vec<u32>,
    pub params_host: HostBuf<SampleParams>,
    pub params_dev: DevBuf,
    pub mask_host: HostBuf<u32>,
    pub mask_dev: DevBuf,
    pub out_tokens: DevBuf,
    pub out_logprobs: DevBuf,
    pub out_top_ids: DevBuf,
    pub out_top_lps: DevBuf,
    pub graphs: HashMap<usize, Graph>,
    pub step_done: CudaEvent,
    /// Recorded around the step only while the runtime records timings.
    pub timing: StepEvents,
    pub state: Option<StepState>,
}

impl DecodeSlot {
    pub fn new(ctx: &Arc<CudaContext>, d: &SlotDims) -> Result<Self, DriverError> {
        let r = d.fwd_rows;
        // Every device buffer of a slot starts zeroed (`DevBuf::zeroed`): the
        // graph warm-up of `rebuild_graphs` runs each bucket's forward before
        // any step wrote these buffers.
        let f32s = |n: usize| DevBuf::zeroed(ctx, n * 4);
        let f16s = |n: usize| DevBuf::zeroed(ctx, n * std::mem::size_of::<f16>());
        let mw = mask_words(d.max_batch, d.vocab);
        Ok(DecodeSlot {
            ws: Workspace {
                x: f32s(r * d.hidden)?,
                xn: f16s(r * d.hidden)?,
                qkv: f32s(r * d.qkv)?,
                attn: f16s(r * d.q_dim)?,
                delta: f32s(r * d.hidden)?,
                gate_up: f32s(r * 2 * d.ffn)?,
                act: f16s(r * d.ffn)?,
            },
            hidden_last: f16s(d.max_batch * d.hidden)?,
            logits: f32s(d.max_batch * d.vocab)?,
            layout: d.layout,
            meta_host: HostBuf::new(ctx, d.layout.total_words())?,
            meta_dev: DevBuf::zeroed(ctx, d.layout.total_words() * 4)?,
            prefill_host: HostBuf::new(ctx, 0)?,
            prefill_dev: DevBuf::zeroed(ctx, 0)?,
            prefill_words: Vec::new(),
            params_host: HostBuf::new(ctx, d.max_batch)?,
            params_dev: DevBuf::zeroed(ctx, d.max_batch * std::mem::size_of::<SampleParams>())?,
            mask_host: HostBuf::new(ctx, mw)?,
            mask_dev: DevBuf::zeroed(ctx, mw * 4)?,
            out_tokens: DevBuf::zeroed(ctx, d.max_batch * 4)?,
            out_logprobs: f32s(d.max_batch)?,
            out_top_ids: DevBuf::zeroed(ctx, d.max_batch * MAX_TOP * 4)?,
            out_top_lps: f32s(d.max_batch * MAX_TOP)?,
            graphs: HashMap::new(),
            step_done: ctx.new_event(None)?,
            timing: StepEvents::new(ctx)?,
            state: None,
        })
    }

    /// Grow the prefill metadata buffers to `words` (only while the slot is
    /// idle: its previous copies have completed).
    pub fn ensure_prefill_capacity(
        &mut self,
        ctx: &Arc<CudaContext>,
        words: usize,
    ) -> Result<(), DriverError> {
        if self.prefill_host.len() < words {
            let cap = words.next_power_of_two();
            self.prefill_host = HostBuf::new(ctx, cap)?;
            self.prefill_dev = DevBuf::zeroed(ctx, cap * 4)?;
        }
        Ok(())
    }
}

/// Page-locked host copies of one slot's sampled outputs.
pub(crate) struct RenderBuffer {
    pub tokens: HostBuf<u32>,
    pub logprobs: HostBuf<f32>,
    pub top_ids: HostBuf<u32>,
    pub top_lps: HostBuf<f32>,
    pub copy_done: CudaEvent,
}

impl RenderBuffer {
    pub fn new(ctx: &Arc<CudaContext>, max_batch: usize) -> Result<Self, DriverError> {
        Ok(RenderBuffer {
            tokens: HostBuf::new(ctx, max_batch)?,
            logprobs: HostBuf::new(ctx, max_batch)?,
            top_ids: HostBuf::new(ctx, max_batch * MAX_TOP)?,
            top_lps: HostBuf::new(ctx, max_batch * MAX_TOP)?,
            copy_done: ctx.new_event(None)?,
        })
    }
}
