//! [`Runtime`]: the pipeline's [`Executor`] over a [`backend::Device`]:
//! [`CudaRuntime`] on an NVIDIA GPU ([`cuda::CudaDevice`]), and
//! [`crate::hostdev::HostRuntime`] on the host device CI runs. Every line
//! below is shared by both; only the device calls differ.
//!
//! Shaped like kestrel-cpu's runtime and the design doc: one compute stream
//! for both slots (I1); two [`slot::DecodeSlot`]s; one copy stream filling
//! each slot's [`slot::RenderBuffer`] after waiting on exactly that step's
//! step-done event (I3); a slot's host buffers untouched until its commit
//! (I6, enforced by the engine loop's [`PipelineState`] and checked here by
//! the runtime's own, as on the CPU; kestrel-step's [`StepFront`] admits,
//! plans and commits each step's KV and answers the KV capacity queries,
//! as on the CPU). Launch and finalize
//! only enqueue; the scheduler thread blocks only in `wait_step`. The next
//! input token stays on the device (`pending`, written by sampling). Any
//! CUDA error after dispatch is [`ExecError::Fatal`]. On request
//! ([`Executor::record_timings`]) each step's forward and sampling are
//! timed with CUDA events ([`timing`]).

pub mod backend;
pub mod cuda;
mod device;
mod mem;
mod prefill;
mod region;
mod sampling;
mod slot;
pub mod timing;
mod verify;
mod vision;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result, CudaContext};
use kestrel_kv::{KvStats, PagedIndices};
use kestrel_model::{ModelWeights, VisionModel};
use kestrel_pipeline::{
    Capabilities, Drafts, ExecError, Executor, LogitBias, MaskBatch, PipelineState, PrefillInput,
    RequestId, SamplingParams, SlotId, StateError, StepKind, StepOutputs, TokenId, TokenValues,
};
pub use kestrel_step::StepConfig;
use kestrel_step::{executor_kv_queries, StepError, StepFront};

use self::backend::{DevMem, Device, HostMem, Stream};
use self::cuda::CudaDevice;
use self::device::{DeviceModel, FwdArgs, KvGeometry, SpatialIn};
use self::slot::{DecodeSlot, RenderBuffer, SlotDims, StepState, MAX_TOP};
use self::timing::{StepEvents, StepTiming};
pub use self::vision::DeviceImageTokens;
use crate::compile::{compile_all, default_cache_dir, Arch};
use crate::ffi::SampleParams;
use crate::host::{choose_bucket, graph_buckets, pack_decode, DecodeLayout, DecodeRow};
use crate::{libs, CudaError};

const NUM_SLOTS: usize = 2;

/// Configuration of a [`CudaRuntime`] (mirrors `CpuRuntimeConfig`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaRuntimeConfig {
    /// CUDA device ordinal.
    pub device: usize,
    /// The KV and step shape, as every runtime has it (kestrel-step).
    pub step: StepConfig,
    /// Capture the decode forward in CUDA graphs (per slot, per bucket).
    pub cuda_graphs: bool,
    /// PTX cache directory (`None`: `<kestrel cache>/ptx`).
    pub ptx_cache: Option<PathBuf>,
}

impl Default for CudaRuntimeConfig {
    fn default() -> Self {
        Self {
            device: 0,
            step: StepConfig::default(),
            cuda_graphs: true,
            ptx_cache: None,
        }
    }
}

/// The CUDA runtime does not score prompts.
const PROMPT_LOGPROBS: bool = false;

/// The runtime over a [`Device`]: every line of bookkeeping (slots, KV,
/// metadata, buckets, dispatch, sampling, commit) is shared by the GPU
/// ([`CudaRuntime`]) and the host device of CI
/// ([`crate::hostdev::HostRuntime`]). See the module docs.
pub struct Runtime<D: Device> {
    cfg: CudaRuntimeConfig,
    // Declared first so buffers below are dropped before the device.
    slots: Vec<DecodeSlot<D>>,
    render: Vec<RenderBuffer<D>>,
    dev: DeviceModel<D>,
    /// Admitted sequences, each with its sampling parameters, and the step
    /// front end over them.
    front: StepFront<SamplingParams>,
    /// The slot protocol: slots in flight, the one launched and not
    /// sampled, the step counter.
    protocol: PipelineState,
    buckets: Vec<usize>,
    decode_rows: Vec<DecodeRow>,
    /// Each sampled row's `logit_bias` for the step being launched (kept
    /// to reuse its allocation).
    step_biases: Vec<LogitBias>,
    out_top: Vec<(TokenId, f32)>,
    /// A verifying step's members' token offsets into its outputs.
    row_indptr: Vec<u32>,
    /// A waited step's values (empty when it sampled no spatial id).
    out_values: Vec<TokenValues>,
    graph_bytes: usize,
    device_name: String,
    /// Completed steps' timings while recording (`record_timings`).
    timings: Option<Vec<StepTiming>>,
    /// The last [`IMAGE_CACHE`] images' projector outputs on the device
    /// (`[tokens][hidden]` f32), keyed by content hash, most recently used
    /// last (`prefill.rs`).
    images: Vec<([u8; 32], D::Buf)>,
    /// Images run through the encoder and projector so far.
    encoder_runs: u64,
    /// Image rows served from the cache of encoded images instead.
    image_cache_hits: u64,
}

/// Encoded images the runtime keeps on the device (a second question on
/// the same image skips the encoder). Memory: `729 x hidden x 4` bytes each
/// (6 MB at Moondream 2's size).
pub const IMAGE_CACHE: usize = 4;

/// The CUDA runtime: [`Runtime`] on a GPU.
pub type CudaRuntime = Runtime<CudaDevice>;

impl<D: Device> std::fmt::Debug for Runtime<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("device", &self.device_name)
            .field("cfg", &self.cfg)
            .field("seqs", &self.front.len())
            .finish_non_exhaustive()
    }
}

/// Open the context of device `ordinal`, or say why not (never panics).
fn open_device(ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
    libs::driver_available()?;
    result::init().map_err(|source| CudaError::DeviceQuery {
        call: "cuInit",
        source,
    })?;
    let present = CudaContext::device_count().map_err(|source| CudaError::DeviceQuery {
        call: "cuDeviceGetCount",
        source,
    })?;
    let present = usize::try_from(present).unwrap_or(0);
    if ordinal >= present {
        return Err(CudaError::NoDevice { ordinal, present });
    }
    Ok(CudaContext::new(ordinal)?)
}

fn fatal<E: Into<CudaError>>(e: E) -> ExecError<CudaError> {
    ExecError::Fatal(e.into())
}

impl CudaRuntime {
    /// Open the device, compile the kernels (PTX cache), upload the weights
    /// (f16), allocate the KV cache and both slots, and capture the decode
    /// graphs of both slots eagerly. Errors, never panics, without a driver.
    pub fn new(weights: ModelWeights, cfg: CudaRuntimeConfig) -> Result<Self, CudaError> {
        check_config(&cfg)?;
        let ctx = open_device(cfg.device)?;
        libs::nvrtc_available()?;
        libs::cublas_available()?;
        // SAFETY: this runtime orders all device work itself (one compute
        // stream, explicit step-done / copy-done events) and never hands
        // cudarc slices to other streams, so cudarc's per-buffer event
        // tracking is redundant; no buffer of this context exists yet.
        unsafe { ctx.disable_event_tracking() };
        let device_name = ctx.name()?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = Arch {
            major: major as u32,
            minor: minor as u32,
        };
        let cache = cfg.ptx_cache.clone().or_else(default_cache_dir);
        let compiled = compile_all(arch, cache.as_deref())?;
        let d = CudaDevice::new(&ctx, &compiled)?;
        let rt = Runtime::with_device(d, device_name, weights, cfg)?;
        tracing::info!(
            device = %rt.device_name,
            arch = %arch.name(),
            weight_bytes = rt.dev.weight_bytes,
            ptx_cached = compiled.iter().all(|k| k.cached),
            "kestrel-cuda model ready"
        );
        Ok(rt)
    }
}

/// Refuses a config with a zero-sized dimension, before touching a device.
fn check_config(cfg: &CudaRuntimeConfig) -> Result<(), CudaError> {
    if cfg.step.has_zero_dimension() {
        return Err(CudaError::Config(format!(
            "zero-sized dimension in {cfg:?}"
        )));
    }
    Ok(())
}

impl<D: Device> Runtime<D> {
    /// Upload the weights (f16) to `d`, allocate the KV cache and both
    /// slots, and capture the decode graphs of both slots when configured.
    pub(crate) fn with_device(
        d: D,
        device_name: String,
        weights: ModelWeights,
        cfg: CudaRuntimeConfig,
    ) -> Result<Self, CudaError> {
        check_config(&cfg)?;
        d.bind()?;
        let mc = &weights.config;
        let max_context = cfg.step.max_context();
        // Rows one step samples: the decode batch and its drafts.
        let sampled_rows = cfg.step.max_rows + cfg.step.max_draft_tokens;
        let dev = DeviceModel::new(
            d,
            &weights,
            KvGeometry {
                num_pages: cfg.step.num_pages,
                page_size: cfg.step.page_size,
                kv_rows: cfg.step.max_rows + 1,
                max_pos: max_context,
                draft_rows: if cfg.step.max_draft_tokens > 0 {
                    sampled_rows
                } else {
                    0
                },
            },
        )?;
        // The uploads above may return before their last DMA lands (on CUDA
        // they are copies from pageable memory on the legacy stream): wait
        // for all of it before any kernel reads them.
        dev.d.sync()?;
        let buckets = graph_buckets(cfg.step.max_rows);
        let max_pages_per_seq = max_context.div_ceil(cfg.step.page_size);
        let dims = SlotDims {
            fwd_rows: sampled_rows.max(cfg.step.forward_rows),
            max_batch: sampled_rows,
            max_members: cfg.step.max_rows,
            hidden: mc.hidden_size,
            qkv: mc.q_dim() + 2 * mc.kv_dim(),
            q_dim: mc.q_dim(),
            ffn: mc.intermediate_size,
            vocab: mc.vocab_size,
            layout: DecodeLayout {
                cap_rows: cfg.step.max_rows,
                // Shared prefix pages appear once per row that lists them.
                cap_pages: cfg.step.max_rows * max_pages_per_seq + cfg.step.max_rows,
            },
        };
        let slots = (0..NUM_SLOTS)
            .map(|_| DecodeSlot::new(&dev.d, &dims))
            .collect::<Result<Vec<_>, _>>()?;
        let render = (0..NUM_SLOTS)
            .map(|_| RenderBuffer::new(&dev.d, sampled_rows, cfg.step.max_rows))
            .collect::<Result<Vec<_>, _>>()?;
        let front = StepFront::new(&cfg.step, PROMPT_LOGPROBS)?;
        let mut rt = Runtime {
            cfg,
            slots,
            render,
            dev,
            front,
            protocol: PipelineState::new(NUM_SLOTS)?,
            buckets,
            decode_rows: Vec::new(),
            step_biases: Vec::new(),
            out_top: Vec::new(),
            row_indptr: Vec::new(),
            out_values: Vec::new(),
            images: Vec::new(),
            encoder_runs: 0,
            image_cache_hits: 0,
            graph_bytes: 0,
            device_name,
            timings: None,
        };
        if rt.cfg.cuda_graphs {
            rt.rebuild_graphs()?;
        }
        Ok(rt)
    }

    /// Gives the runtime Moondream's region model (`point` / `detect`): the
    /// step's spatial stage decodes a value for every sampled `coord_id` /
    /// `size_id` into `StepOutputs::values` and embeds it as the row's next
    /// input, device-side (`runtime/region.rs`). Recaptures the decode
    /// graphs. A vision model without a region module or spatial ids is a
    /// `CudaError::Unsupported`; its encoder and projector are
    /// [`Runtime::with_vision`]'s.
    pub fn with_region(mut self, vision: &VisionModel) -> Result<Self, CudaError> {
        let (Some(weights), Some(coord_id), Some(size_id)) = (
            vision.region.as_ref(),
            vision.prompts.coord_id,
            vision.prompts.size_id,
        ) else {
            return Err(CudaError::Unsupported(
                "a vision model without a region module or spatial ids".into(),
            ));
        };
        self.dev.d.bind()?;
        self.synchronize()?;
        let rows = self.cfg.step.max_rows + self.cfg.step.max_draft_tokens;
        self.dev.attach_region(region::RegionSpec {
            weights,
            config: &vision.config.region,
            coord_id,
            size_id,
            rows: rows.max(self.cfg.step.forward_rows),
            kv_rows: self.cfg.step.max_rows + 1,
        })?;
        self.dev.d.sync()?;
        if self.cfg.cuda_graphs {
            self.rebuild_graphs()?;
        }
        Ok(self)
    }

    /// The device's name, as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Bytes of device memory the captured graphs of both slots took at start.
    pub fn graph_bytes(&self) -> usize {
        self.graph_bytes
    }

    /// Bytes of weight matrices on the device, in their file's encoding.
    pub fn weight_bytes(&self) -> usize {
        self.dev.weight_bytes
    }

    pub fn config(&self) -> &CudaRuntimeConfig {
        &self.cfg
    }

    /// What a runtime built with `cfg` can do (its [`Executor::capabilities`]),
    /// known before a device is opened: logit bias, chunked prefill,
    /// re-admission of preempted sequences (KV grows lazily) and draft
    /// verification up to `cfg.step.max_draft_tokens`; no prompt scoring.
    pub fn capabilities_of(cfg: &CudaRuntimeConfig) -> Capabilities {
        cfg.step.capabilities(PROMPT_LOGPROBS)
    }

    /// Convert a waited step's events into host instants (all four have
    /// completed: the step's copy, which waited on its step-done event, has).
    fn step_timing(&self, slot: SlotId, state: &StepState) -> Result<StepTiming, CudaError> {
        let (d, ev) = (&self.dev.d, &self.slots[slot].timing);
        Ok(StepTiming {
            step: state.step,
            prefill: state.kind == StepKind::Prefill,
            rows: state.n,
            forward_start: d.instant(&ev.forward_start)?,
            forward_end: d.instant(&ev.forward_end)?,
            sample_start: d.instant(&ev.sample_start)?,
            sample_end: d.instant(&ev.sample_end)?,
        })
    }

    /// Record one of `slot`'s timing events on the compute stream when the
    /// runtime records timings; returns whether it did.
    fn mark(
        &self,
        slot: SlotId,
        which: fn(&StepEvents<D>) -> &D::Event,
    ) -> Result<bool, CudaError> {
        if self.timings.is_none() {
            return Ok(false);
        }
        self.dev
            .d
            .record(which(&self.slots[slot].timing), Stream::Compute)?;
        Ok(true)
    }

    pub fn kv_stats(&self) -> KvStats {
        self.front.kv_stats()
    }

    /// Block until both streams have executed everything enqueued.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.dev.d.sync()
    }

    fn fwd_args(&self, slot: SlotId, n: usize) -> FwdArgs {
        let s = &self.slots[slot];
        let l = &s.layout;
        let m = &s.meta_dev;
        FwdArgs {
            n,
            tokens: self.dev.pending.ptr(),
            rows: m.at::<u32>(l.rows()),
            positions: m.at::<u32>(l.positions()),
            row_seq: m.at::<u32>(l.row_seq()),
            slot_mapping: m.at::<u32>(l.slot_mapping()),
            kv_indptr: m.at::<u32>(l.kv_indptr()),
            kv_indices: m.at::<u32>(l.kv_indices()),
            out_row: 0,
            spatial: SpatialIn::KvRows(m.at::<u32>(l.rows())),
            tiled_attention: false,
            mask_pos: 0,
            x: s.ws.x.ptr(),
            xn: s.ws.xn.ptr(),
            qkv: s.ws.qkv.ptr(),
            attn: s.ws.attn.ptr(),
            delta: s.ws.delta.ptr(),
            gate_up: s.ws.gate_up.ptr(),
            act: s.ws.act.ptr(),
            hidden_last: s.hidden_last.ptr(),
        }
    }

    /// The decode forward of `bucket` rows on `slot`, eagerly.
    fn decode_forward(&self, slot: SlotId, bucket: usize) -> Result<(), CudaError> {
        let a = self.fwd_args(slot, bucket);
        self.dev.forward_layers(&a)?;
        let s = &self.slots[slot];
        self.dev
            .lm_head(s.hidden_last.ptr(), s.logits.ptr(), bucket)?;
        // The region decoders' logits, inside the graph (Moondream).
        self.dev.keep_hidden(a.x, 0, bucket)?;
        self.dev.region_logits(bucket)
    }

    /// (Re)capture the decode forward of both slots for every bucket (at
    /// start, and after a pause that invalidated them). Each bucket first
    /// runs once eagerly on all-padding metadata (rows write only the trash
    /// page), which also warms cuBLAS outside capture.
    pub fn rebuild_graphs(&mut self) -> Result<(), CudaError> {
        self.dev.d.bind()?;
        self.synchronize()?;
        let free_before = self.dev.d.free_memory()?;
        let buckets = self.buckets.clone();
        for slot in 0..NUM_SLOTS {
            self.slots[slot].graphs.clear();
            for &b in &buckets {
                let empty = PagedIndices {
                    kv_indptr: vec![0],
                    ..PagedIndices::default()
                };
                let s = &mut self.slots[slot];
                let layout = s.layout;
                let used = pack_decode(
                    &layout,
                    &[],
                    &empty,
                    b,
                    self.dev.trash_page,
                    self.dev.page_size,
                    s.meta_host.as_mut_slice(),
                )?;
                // meta_dev holds total_words >= used words.
                self.dev
                    .d
                    .htod_sync(s.meta_dev.ptr(), &s.meta_host.as_slice()[..used])?;
                self.decode_forward(slot, b)?;
                self.dev.d.sync_compute()?;
                self.dev.d.begin_capture()?;
                let captured = self.decode_forward(slot, b);
                let graph = self.dev.d.end_capture()?;
                captured?;
                let graph = graph.ok_or_else(|| {
                    CudaError::Config(format!("capturing bucket {b} produced no graph"))
                })?;
                self.slots[slot].graphs.insert(b, graph);
            }
        }
        self.dev.d.sync()?;
        let free_after = self.dev.d.free_memory()?;
        self.graph_bytes = free_before.saturating_sub(free_after);
        tracing::info!(
            buckets = ?buckets,
            graph_bytes = self.graph_bytes,
            "captured decode graphs for both slots"
        );
        Ok(())
    }

    /// Copy `words` of the slot's pinned decode metadata and its params to the device.
    fn upload_meta(&self, slot: SlotId, words: usize, rows: usize) -> Result<(), CudaError> {
        let s = &self.slots[slot];
        // SAFETY: the pinned sources stay untouched until this slot's commit
        // (I6), after which these copies (earlier on the compute stream than
        // the step-done event the commit waited for) have completed; the
        // destinations hold at least as many bytes.
        unsafe {
            self.dev
                .d
                .htod(s.meta_dev.ptr(), &s.meta_host.as_slice()[..words])?;
            self.dev
                .d
                .htod(s.params_dev.ptr(), &s.params_host.as_slice()[..rows])?;
        }
        Ok(())
    }

    /// Enqueue the copies of a prefill-shaped step's metadata (the first
    /// `words` of the slot's prefill buffer) and of its first `params` rows'
    /// sampling parameters.
    fn upload_prefill(&self, slot: SlotId, words: usize, params: usize) -> Result<(), CudaError> {
        let s = &self.slots[slot];
        // SAFETY: as in `upload_meta` (I6 keeps the pinned sources intact
        // until this step's commit); the caller sized both destinations.
        unsafe {
            self.dev
                .d
                .htod(s.prefill_dev.ptr(), &s.prefill_host.as_slice()[..words])?;
            self.dev
                .d
                .htod(s.params_dev.ptr(), &s.params_host.as_slice()[..params])?;
        }
        Ok(())
    }

    /// Pack `step_biases` (one per sampled row) into the slot's bias buffer
    /// and enqueue its copy; returns whether any row has a bias.
    fn upload_bias(&mut self, slot: SlotId) -> Result<bool, CudaError> {
        let s = &mut self.slots[slot];
        let words = s.pack_bias(&self.dev.d, &self.step_biases)?;
        if words > 0 {
            // SAFETY: as in `upload_meta` (the pinned source is untouched
            // until this slot's commit, I6); bias_dev holds >= words words.
            unsafe {
                self.dev
                    .d
                    .htod(s.bias_dev.ptr(), &s.bias_host.as_slice()[..words])?;
            }
        }
        Ok(words > 0)
    }

    /// Book a launched step: the slot's place in launch order (checked by
    /// `check_launch` before anything was enqueued), and its state until commit.
    fn record_launch(&mut self, slot: SlotId, state: StepState) -> Result<(), CudaError> {
        self.protocol.launch(slot, state.kind)?;
        self.slots[slot].state = Some(state);
        Ok(())
    }
}

impl<D: Device> Executor for Runtime<D> {
    type Params = SamplingParams;
    type Error = CudaError;

    fn num_slots(&self) -> usize {
        self.protocol.num_slots()
    }

    fn vocab_size(&self) -> usize {
        self.dev.cfg.vocab_size
    }

    executor_kv_queries!(front);

    fn launch_prefill(
        &mut self,
        slot: SlotId,
        seqs: &[PrefillInput<'_, SamplingParams>],
    ) -> Result<(), ExecError<CudaError>> {
        self.prefill(slot, seqs)
    }

    /// A step with drafts verifies them (`launch_verify`, `verify.rs`);
    /// otherwise the bucket's captured graph (or its eager forward) runs.
    fn launch_decode(
        &mut self,
        slot: SlotId,
        rows: &[RequestId],
        drafts: Drafts<'_>,
    ) -> Result<(), ExecError<CudaError>> {
        if !drafts.is_empty() {
            return self.launch_verify(slot, rows, drafts);
        }
        self.protocol
            .check_launch(slot)
            .map_err(|e| ExecError::PreDispatch(e.into()))?;
        let n = rows.len();
        self.front
            .check_rows(n)
            .map_err(|e| ExecError::PreDispatch(e.into()))?;
        // The largest bucket holds `max_rows` rows.
        let bucket = choose_bucket(&self.buckets, n).ok_or_else(|| {
            ExecError::PreDispatch(CudaError::from(StepError::BatchTooLarge {
                rows: n,
                capacity: self.cfg.step.max_rows,
            }))
        })?;
        // Each row's input token at its KV length (the lengths advance here).
        self.front
            .plan_decode(rows, drafts, &mut self.slots[slot].kv)
            .map_err(|e| ExecError::PreDispatch(e.into()))?;
        // Per row: its sampling parameters (the slot's pinned buffer is
        // free: `check_launch`), its top-n width, its KV row and position.
        self.decode_rows.clear();
        let s = &mut self.slots[slot];
        let (kv, params) = (&s.kv, s.params_host.as_mut_slice());
        let mut top_n = 0;
        self.step_biases.clear();
        for (i, (&id, p)) in rows.iter().zip(params.iter_mut()).enumerate() {
            // Planned above, so admitted; were it not, the lengths moved: fatal.
            let Some(meta) = self.front.get(id).map(|seq| &seq.meta) else {
                return Err(fatal(StepError::UnknownRequest(id)));
            };
            *p = SampleParams::from(meta);
            self.step_biases.push(meta.logit_bias.clone());
            top_n = top_n.max(meta.top_logprobs as usize);
            self.decode_rows.push(DecodeRow {
                kv_row: kv.rows[i],
                pos: kv.starts[i],
            });
        }
        let top_n = top_n.min(MAX_TOP);
        let (trash, ps) = (self.dev.trash_page, self.dev.page_size);
        let layout = s.layout;
        // The step is planned: a packing failure (a sizing bug) is fatal.
        let used = pack_decode(
            &layout,
            &self.decode_rows,
            &s.kv.indices,
            bucket,
            trash,
            ps,
            s.meta_host.as_mut_slice(),
        )
        .map_err(|e| ExecError::Fatal(e.into()))?;
        self.dev.d.bind().map_err(fatal)?;
        let timed = self
            .mark(slot, |e| &e.forward_start)
            .map_err(ExecError::Fatal)?;
        self.upload_meta(slot, used, n).map_err(ExecError::Fatal)?;
        let bias = self.upload_bias(slot).map_err(ExecError::Fatal)?;
        match self.slots[slot].graphs.get(&bucket) {
            Some(g) => self.dev.d.replay(g).map_err(ExecError::Fatal)?,
            None => self
                .decode_forward(slot, bucket)
                .map_err(ExecError::Fatal)?,
        }
        if timed {
            self.mark(slot, |e| &e.forward_end)
                .map_err(ExecError::Fatal)?;
        }
        let s = &self.slots[slot];
        let state = StepState {
            kind: StepKind::Decode,
            n,
            top_n,
            rows_ptr: s.meta_dev.at::<u32>(layout.rows()),
            positions_ptr: s.meta_dev.at::<u32>(layout.sample_pos()),
            step: self.protocol.next_step(),
            timed,
            bias,
            verify: None,
        };
        self.record_launch(slot, state).map_err(ExecError::Fatal)
    }

    fn finalize_sampling(
        &mut self,
        slot: SlotId,
        masks: Option<&MaskBatch<'_>>,
    ) -> Result<(), ExecError<CudaError>> {
        self.sample(slot, masks)
    }

    fn wait_step(&mut self, slot: SlotId) -> Result<StepOutputs<'_>, CudaError> {
        self.protocol.check_wait(slot)?;
        self.dev.d.bind()?;
        self.dev.d.event_sync(&self.render[slot].copy_done)?;
        self.protocol.complete(slot)?;
        let state = self.slots[slot]
            .state
            .take()
            .ok_or(StateError::SlotBusy(slot))?;
        // A verifying step's outputs, compacted to each member's accepted
        // tokens (row `qo[i] + j` moves to `row_indptr[i] + j`).
        self.row_indptr.clear();
        let mut n_out = state.n;
        if let Some(v) = state.verify {
            let qo = &self.slots[slot].verify_qo;
            let RenderBuffer {
                tokens,
                logprobs,
                top_ids,
                top_lps,
                accepted,
                values,
                ..
            } = &mut self.render[slot];
            let t = state.top_n;
            self.row_indptr.push(0);
            let mut w = 0usize;
            for (i, &k) in accepted.as_slice()[..v.members].iter().enumerate() {
                let (a, k) = (qo[i] as usize, k as usize);
                tokens.as_mut_slice().copy_within(a..a + k, w);
                logprobs.as_mut_slice().copy_within(a..a + k, w);
                values.as_mut_slice().copy_within(a * 3..(a + k) * 3, w * 3);
                top_ids
                    .as_mut_slice()
                    .copy_within(a * t..(a + k) * t, w * t);
                top_lps
                    .as_mut_slice()
                    .copy_within(a * t..(a + k) * t, w * t);
                w += k;
                self.row_indptr.push(w as u32);
            }
            n_out = w;
        }
        // The step's KV is written: a prefill publishes its prompt pages, a
        // verifying member keeps the positions of the tokens it accepted.
        let accepted = state.verify.map(|_| &self.row_indptr[..]);
        self.front.commit_step(&self.slots[slot].kv, accepted)?;
        if state.timed && self.timings.is_some() {
            // A timing the driver cannot give is lost, not the step: a real
            // device fault surfaces at the next launch or wait anyway.
            match self.step_timing(slot, &state) {
                Ok(t) => self.timings.get_or_insert_default().push(t),
                Err(e) => tracing::warn!(error = %e, "dropping a step's device timing"),
            }
            if self.dev.d.clock_stale(Instant::now()) {
                if let Err(e) = self.dev.d.anchor_clock() {
                    tracing::warn!(error = %e, "re-anchoring the device clock failed");
                }
            }
        }
        let r = &self.render[slot];
        let (n, top_n) = (n_out, state.top_n);
        // The spatial stage's values, when the step sampled a spatial id.
        self.out_values.clear();
        if let Some((coord, size)) = self.dev.spatial_ids() {
            let tokens = &r.tokens.as_slice()[..n];
            if tokens.iter().any(|&t| t == coord || t == size) {
                let v = &r.values.as_slice()[..n * 3];
                self.out_values
                    .extend(v.chunks_exact(3).map(|v| TokenValues {
                        coord: v[0],
                        size: [v[1], v[2]],
                    }));
            }
        }
        self.out_top.clear();
        let ids = &r.top_ids.as_slice()[..n * top_n];
        let lps = &r.top_lps.as_slice()[..n * top_n];
        self.out_top
            .extend(ids.iter().copied().zip(lps.iter().copied()));
        Ok(StepOutputs {
            tokens: &r.tokens.as_slice()[..n],
            logprobs: Some(&r.logprobs.as_slice()[..n]),
            top_logprobs: &self.out_top,
            top_n,
            row_indptr: &self.row_indptr,
            values: &self.out_values,
        })
    }

    fn release_all(&mut self) {
        // Synchronize first: no stream may still touch a slot or a page.
        if let Err(e) = self.dev.d.bind().and_then(|_| self.synchronize()) {
            tracing::error!(error = %e, "synchronize before release_all failed");
        }
        for s in &mut self.slots {
            s.state = None;
        }
        self.protocol.clear();
        self.front.release_all();
    }

    /// After a drained pause (weights or buffers may have changed), the
    /// decode graphs are captured again (section 4.5a).
    fn on_resume(&mut self) -> Result<(), CudaError> {
        if self.cfg.cuda_graphs {
            self.rebuild_graphs()?;
        }
        Ok(())
    }

    /// Steps launched while recording get four timing events on the compute
    /// stream, converted to host instants once the step is committed.
    fn record_timings(&mut self, on: bool) -> Result<(), CudaError> {
        if !on {
            self.timings = None;
            return Ok(());
        }
        self.dev.d.bind()?;
        self.dev.d.anchor_clock()?;
        self.timings.get_or_insert_default();
        Ok(())
    }

    fn drain_timings(&mut self, out: &mut Vec<StepTiming>) {
        // Drained, not taken: the buffer keeps its capacity, so recording
        // allocates nothing per step.
        if let Some(t) = &mut self.timings {
            out.append(t);
        }
    }
}

impl<D: Device> Drop for Runtime<D> {
    fn drop(&mut self) {
        let _ = self.dev.d.bind();
        let _ = self.synchronize();
    }
}
