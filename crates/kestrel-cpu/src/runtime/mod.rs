//! The CPU runtime: what the pipeline's [`Executor`] drives on a machine
//! without a GPU, shaped like the CUDA design so the pipeline is real here too.
//!
//! The scheduler thread owns this struct: the KV page table, per-slot
//! `DecodeSlot` metadata and `RenderBuffer` host buffers. A compute stream
//! thread runs forwards and sampling in order; a copy stream thread moves
//! each step's outputs to its slot's host buffer. Launch and finalize only
//! enqueue work; the scheduler waits only inside [`Executor::wait_step`].
//! Slot order (launch -> sample -> wait, FIFO) is kestrel-pipeline's
//! [`PipelineState`], checked before any buffer moves; KV capacity answers
//! and each step's KV plan and commit are kestrel-step's [`StepFront`]'s
//! (admission, chunk planning with undo, the drafts check), as on CUDA.
//! KV is taken lazily: a sequence is admitted with its prompt's pages and
//! grows a page at a time ([`Executor::grow`]); a preempted sequence's
//! written pages go to the prefix cache before its row is freed (its
//! re-prefill embeds the coordinate and size ids it generated from the
//! values committed with them, `PrefillInput::generated_values`). With a
//! vision model ([`CpuRuntime::with_vision`]) a prefill row may carry an
//! image's rows ([`kestrel_pipeline::PromptEmbeds`]): encoded on the
//! compute stream inside that step, cached by content (`images`).

mod images;
mod slot;
mod spatial;
mod stream;

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use kestrel_kv::KvError;
pub use kestrel_kv::KvStats;
use kestrel_model::vision::PreparedImage;
use kestrel_model::{ModelWeights, VisionModel};
use kestrel_pipeline::{
    Capabilities, Drafts, ExecError, Executor, MaskBatch, PipelineState, PrefillInput, RequestId,
    SamplingParams, SlotId, StateError, StepKind, StepOutputs, TokenId,
};
pub use kestrel_step::StepConfig;
use kestrel_step::{executor_kv_queries, StepError, StepFront};

pub use self::images::VisionStats;
use self::images::{ImageCounters, ImageRows};
use self::slot::{Outputs, PrefillRow, SlotMeta};
use self::stream::{run_copy_stream, ComputeStream, Done, MaskBuf, Work};
use crate::kernels::{Isa, Numerics};
use crate::model::{CpuModelOptions, WeightPages};
use crate::{CpuError, CpuModel, KvStore, Scratch};
pub use kestrel_pipeline::StepTiming;

/// Configuration of a [`CpuRuntime`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuRuntimeConfig {
    /// Matmul worker threads (0 = available parallelism).
    pub threads: usize,
    /// The KV and step shape, as every runtime has it (kestrel-step).
    pub step: StepConfig,
    /// The matmuls' numerics ([`Numerics::Fast`] by default).
    pub numerics: Numerics,
    /// Where the weights' bytes live ([`WeightPages::Huge`] by default).
    pub weight_pages: WeightPages,
    /// Encoded images (projector outputs) kept for the next request on the
    /// same image, least recently used dropped first (8 by default; 0
    /// encodes every time). Only a runtime with a vision model uses it.
    pub image_cache: usize,
}

impl Default for CpuRuntimeConfig {
    fn default() -> Self {
        Self {
            threads: 0,
            step: StepConfig::default(),
            numerics: Numerics::default(),
            weight_pages: WeightPages::default(),
            image_cache: 8,
        }
    }
}

/// The CPU runtime scores prompts ([`CpuRuntime::score_prompt`]).
const PROMPT_LOGPROBS: bool = true;

/// Errors of the CPU runtime.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Compute(#[from] CpuError),
    #[error("KV cache")]
    Kv(#[from] KvError),
    /// The step's front end refused it before dispatch (kestrel-step).
    #[error(transparent)]
    Step(#[from] StepError),
    /// The forward of a step failed on the compute stream (engine-fatal).
    #[error("compute fault at step {step}")]
    Fault {
        step: u64,
        #[source]
        source: CpuError,
    },
    #[error("the compute or copy stream stopped")]
    StreamLost,
    /// A call broke the slot protocol, or a slot's buffers are not back.
    #[error("the slot protocol refused the call")]
    Slot(#[from] StateError),
    #[error("invalid runtime config: {0}")]
    Config(String),
    /// A prefill row's image rows the runtime cannot embed (no vision
    /// model, not a prepared image, or rows the projector does not give).
    #[error("request {id}: {reason}")]
    ImageRows { id: RequestId, reason: String },
    /// A re-admission whose generated values are neither none nor one per
    /// generated token ([`PrefillInput::values_fit`]).
    #[error("request {id}: {values} values for {generated} generated tokens (none, or one each)")]
    GeneratedValues {
        id: RequestId,
        values: usize,
        generated: usize,
    },
}

const NUM_SLOTS: usize = 2;

/// The CPU runtime. See the module docs.
pub struct CpuRuntime {
    cfg: CpuRuntimeConfig,
    vocab: usize,
    hidden: usize,
    /// Admitted sequences (no per-sequence extras here) and the step
    /// front end over them.
    front: StepFront<()>,
    work: Option<Sender<Work>>,
    done: Receiver<Done>,
    /// Per slot, when idle: the DecodeSlot metadata, mask buffer and RenderBuffer host buffer.
    metas: Vec<Option<Box<SlotMeta>>>,
    masks: Vec<Option<Box<MaskBuf>>>,
    render: Vec<Option<Box<Outputs>>>,
    /// The slot protocol: slots in flight, the one launched and not
    /// sampled, the step counter.
    slots: PipelineState,
    threads: Vec<JoinHandle<()>>,
    weight_bytes: usize,
    bytes_per_token: usize,
    compute_threads: usize,
    isa: Isa,
    /// Device-side timings of committed steps, when recording is on.
    timings: Option<Vec<StepTiming>>,
    /// The vision model's shape, once it has one ([`Self::with_vision`]).
    vision: Option<VisionShape>,
    images: Arc<ImageCounters>,
}

/// What a prefill's image rows are checked against at launch.
#[derive(Debug, Clone, Copy)]
struct VisionShape {
    /// Rows an image gives (the projector's, 729).
    rows: usize,
    crop_size: usize,
}

impl std::fmt::Debug for CpuRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuRuntime")
            .field("cfg", &self.cfg)
            .field("seqs", &self.front.len())
            .finish_non_exhaustive()
    }
}

impl CpuRuntime {
    /// Build the model, the KV store and start the compute and copy streams.
    pub fn new(weights: ModelWeights, cfg: CpuRuntimeConfig) -> Result<Self, RuntimeError> {
        if cfg.step.has_zero_dimension() {
            return Err(RuntimeError::Config(format!(
                "zero-sized dimension in {cfg:?}"
            )));
        }
        let model_cfg = weights.config.clone();
        let model = Arc::new(CpuModel::new(
            weights,
            CpuModelOptions {
                threads: cfg.threads,
                isa: None,
                numerics: cfg.numerics,
                weight_pages: cfg.weight_pages,
            },
        )?);
        let weight_bytes = model.weight_bytes();
        let bytes_per_token = model.bytes_per_token();
        let compute_threads = model.threads();
        let isa = model.isa();
        let kv = KvStore::for_model(&model_cfg, cfg.step.num_pages, cfg.step.page_size)?;
        let max_context = cfg.step.max_context();
        // A decode step verifying drafts runs its rows and drafts as one forward.
        let step_tokens = cfg.step.max_rows + cfg.step.max_draft_tokens;
        let scratch = Scratch::new(&model, step_tokens.max(cfg.step.forward_rows), max_context);
        let front = StepFront::new(&cfg.step, PROMPT_LOGPROBS)?;
        let (work_tx, work_rx) = channel();
        let (copy_tx, copy_rx) = channel();
        let (back_tx, back_rx) = channel();
        let (done_tx, done_rx) = channel();
        let compute = ComputeStream::new(
            model,
            kv,
            scratch,
            cfg.step.forward_rows,
            cfg.step.max_rows,
            cfg.step.max_draft_tokens,
            NUM_SLOTS,
        );
        let spawn = |name: &str| std::thread::Builder::new().name(name.to_string());
        let threads = vec![
            spawn("kestrel-compute")
                .spawn(move || compute.run(work_rx, copy_tx, back_rx))
                .map_err(|source| CpuError::ThreadSpawn {
                    thread: "kestrel-compute",
                    source,
                })?,
            spawn("kestrel-copy")
                .spawn(move || run_copy_stream(copy_rx, back_tx, done_tx))
                .map_err(|source| CpuError::ThreadSpawn {
                    thread: "kestrel-copy",
                    source,
                })?,
        ];
        Ok(Self {
            cfg,
            vocab: model_cfg.vocab_size,
            hidden: model_cfg.hidden_size,
            front,
            work: Some(work_tx),
            done: done_rx,
            metas: (0..NUM_SLOTS)
                .map(|_| Some(Box::new(SlotMeta::new())))
                .collect(),
            masks: (0..NUM_SLOTS).map(|_| Some(Box::default())).collect(),
            render: (0..NUM_SLOTS).map(|_| Some(Box::default())).collect(),
            slots: PipelineState::new(NUM_SLOTS)?,
            threads,
            weight_bytes,
            bytes_per_token,
            compute_threads,
            isa,
            timings: None,
            vision: None,
            images: Arc::default(),
        })
    }

    /// Gives the runtime Moondream's vision side: prefill rows with image
    /// rows ([`kestrel_pipeline::PromptEmbeds`] whose `input` is a
    /// `kestrel_model::vision::PreparedImage`) are then embedded from the
    /// image's projector output, encoded on the compute stream inside that
    /// prefill step (the last [`CpuRuntimeConfig::image_cache`] kept).
    ///
    /// # Errors
    /// [`RuntimeError::Config`] when the projector's width is not the text
    /// model's.
    pub fn with_vision(mut self, vision: VisionModel) -> Result<Self, RuntimeError> {
        let (v, hidden) = (&vision.config.vision, self.hidden);
        if v.proj_out_dim != hidden {
            return Err(RuntimeError::Config(format!(
                "the vision projector gives {} values per row, the text model takes {hidden}",
                v.proj_out_dim
            )));
        }
        let shape = VisionShape {
            rows: v.patches(),
            crop_size: v.crop_size,
        };
        let rows = ImageRows::new(vision, self.cfg.image_cache, Arc::clone(&self.images));
        self.send(Work::Vision(Box::new(rows)))?;
        self.vision = Some(shape);
        Ok(self)
    }

    /// Encoder runs and image-cache hits so far.
    pub fn vision_stats(&self) -> VisionStats {
        self.images.stats()
    }

    /// Refuses (before dispatch) image rows this runtime cannot embed.
    fn check_embeds(&self, input: &PrefillInput<'_, SamplingParams>) -> Result<(), RuntimeError> {
        let Some(e) = input.embeds else {
            return Ok(());
        };
        let refuse = |reason: String| {
            Err(RuntimeError::ImageRows {
                id: input.id,
                reason,
            })
        };
        let Some(shape) = self.vision else {
            return refuse("image rows for a model without vision".into());
        };
        let Some(image) = e.input.downcast_ref::<PreparedImage>() else {
            return refuse("image rows whose input is not a prepared image".into());
        };
        if e.len != shape.rows || image.crops.crop_size != shape.crop_size {
            return refuse(format!(
                "{} image rows of {}-pixel crops; the vision model gives {} of {}",
                e.len, image.crops.crop_size, shape.rows, shape.crop_size
            ));
        }
        Ok(())
    }

    pub fn config(&self) -> &CpuRuntimeConfig {
        &self.cfg
    }

    /// What a runtime built with `cfg` can do (its [`Executor::capabilities`]),
    /// known before it is built: everything the pipeline drives, drafts up
    /// to `cfg.step.max_draft_tokens`, and prompt scoring ([`Self::score_prompt`]).
    pub fn capabilities_of(cfg: &CpuRuntimeConfig) -> Capabilities {
        cfg.step.capabilities(PROMPT_LOGPROBS)
    }

    /// Bytes of weights the forward reads per step.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Bytes of matrix weights one decode step streams whatever its batch
    /// ([`crate::CpuModel::bytes_per_token`]): a single stream's decode
    /// can go no faster than memory bandwidth over this.
    pub fn bytes_per_token(&self) -> usize {
        self.bytes_per_token
    }

    /// Matmul worker threads the compute stream keeps busy (the config's
    /// `threads`, resolved).
    pub fn compute_threads(&self) -> usize {
        self.compute_threads
    }

    /// The kernel ISA the model runs (see [`Isa::try_detect`]).
    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn kv_stats(&self) -> KvStats {
        self.front.kv_stats()
    }

    fn send(&self, w: Work) -> Result<(), RuntimeError> {
        self.work
            .as_ref()
            .ok_or(RuntimeError::StreamLost)?
            .send(w)
            .map_err(|_| RuntimeError::StreamLost)
    }

    /// Block until the compute stream has executed everything enqueued.
    pub fn synchronize(&self) -> Result<(), RuntimeError> {
        let (tx, rx) = channel();
        self.send(Work::Sync(tx))?;
        rx.recv().map_err(|_| RuntimeError::StreamLost)
    }

    /// Log-probabilities of each of `tokens[1..]` given the tokens before
    /// it, with the `top` most likely tokens at each position (a request's
    /// prompt logprobs). Runs on the compute stream after the work already
    /// enqueued, on a private cache (the runtime's KV and prefix cache are
    /// untouched), and blocks until done: one prefill of the prompt.
    pub fn score_prompt(
        &self,
        tokens: &[TokenId],
        top: usize,
    ) -> Result<Vec<crate::PositionLogprobs>, RuntimeError> {
        let (tx, rx) = channel();
        self.send(Work::Score {
            tokens: tokens.to_vec(),
            top,
            reply: tx,
        })?;
        Ok(rx.recv().map_err(|_| RuntimeError::StreamLost)??)
    }

    /// Take an idle slot's metadata buffer for a new launch of `kind`,
    /// once the slot protocol allows a launch into `slot`.
    fn take_meta(&mut self, slot: SlotId, kind: StepKind) -> Result<Box<SlotMeta>, RuntimeError> {
        self.slots.check_launch(slot)?;
        let mut meta = self
            .metas
            .get_mut(slot)
            .and_then(Option::take)
            .ok_or(StateError::SlotBusy(slot))?;
        meta.reset(kind, self.slots.next_step());
        Ok(meta)
    }

    fn dispatch(
        &mut self,
        slot: SlotId,
        meta: Box<SlotMeta>,
    ) -> Result<(), ExecError<RuntimeError>> {
        let kind = meta.kind;
        self.send(Work::Forward { slot, meta })
            .map_err(ExecError::Fatal)?;
        self.slots
            .launch(slot, kind)
            .map_err(|e| ExecError::Fatal(e.into()))?;
        Ok(())
    }
}

impl Executor for CpuRuntime {
    type Params = SamplingParams;
    type Error = RuntimeError;

    fn num_slots(&self) -> usize {
        self.slots.num_slots()
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    executor_kv_queries!(front);

    fn launch_prefill(
        &mut self,
        slot: SlotId,
        seqs: &[PrefillInput<'_, SamplingParams>],
    ) -> Result<(), ExecError<RuntimeError>> {
        for input in seqs {
            self.check_embeds(input).map_err(ExecError::PreDispatch)?;
            if !input.values_fit() {
                return Err(ExecError::PreDispatch(RuntimeError::GeneratedValues {
                    id: input.id,
                    values: input.generated_values.len(),
                    generated: input.generated,
                }));
            }
        }
        let mut meta = self
            .take_meta(slot, StepKind::Prefill)
            .map_err(ExecError::PreDispatch)?;
        if let Err(e) = self.front.plan_prefill(seqs, |_| (), &mut meta.kv) {
            self.metas[slot] = Some(meta);
            return Err(ExecError::PreDispatch(e.into()));
        }
        for input in seqs {
            meta.prefill.push(PrefillRow {
                params: input.params.clone(),
                prompt_len: input.prompt.len() as u32,
                generated: input.generated as u32,
                generated_values: input.generated_values.to_vec(),
                embeds: input.embeds.cloned(),
            });
        }
        self.dispatch(slot, meta)
    }

    fn launch_decode(
        &mut self,
        slot: SlotId,
        rows: &[RequestId],
        drafts: Drafts<'_>,
    ) -> Result<(), ExecError<RuntimeError>> {
        let mut meta = self
            .take_meta(slot, StepKind::Decode)
            .map_err(ExecError::PreDispatch)?;
        // The input token and its drafts get their KV written; for a row
        // with drafts its wait rolls back the rejected.
        if let Err(e) = self.front.plan_decode(rows, drafts, &mut meta.kv) {
            self.metas[slot] = Some(meta);
            return Err(ExecError::PreDispatch(e.into()));
        }
        meta.draft_indptr.extend_from_slice(drafts.indptr);
        meta.drafts.extend_from_slice(drafts.tokens);
        self.dispatch(slot, meta)
    }

    fn finalize_sampling(
        &mut self,
        slot: SlotId,
        masks: Option<&MaskBatch<'_>>,
    ) -> Result<(), ExecError<RuntimeError>> {
        let busy = || ExecError::Fatal(StateError::SlotBusy(slot).into());
        self.slots
            .check_sample(slot)
            .map_err(|e| ExecError::Fatal(e.into()))?;
        let mut mask = self.masks[slot].take().ok_or_else(busy)?;
        let host = self.render[slot].take().ok_or_else(busy)?;
        mask.rows.clear();
        mask.words.clear();
        mask.any = false;
        if let Some(m) = masks {
            // The "H2D copy" of the mask, ordered before sampling on the compute stream.
            mask.any = true;
            mask.words_per_row = m.words_per_row;
            mask.words.extend_from_slice(m.words);
            mask.rows.extend_from_slice(m.constrained);
        }
        self.slots
            .sample(slot)
            .map_err(|e| ExecError::Fatal(e.into()))?;
        self.send(Work::Sample { slot, host, mask })
            .map_err(ExecError::Fatal)
    }

    fn wait_step(&mut self, slot: SlotId) -> Result<StepOutputs<'_>, RuntimeError> {
        self.slots.check_wait(slot)?;
        let done = self.done.recv().map_err(|_| RuntimeError::StreamLost)?;
        // The copy stream delivers in launch order; a step of another slot
        // here is refused as out of order (slot = the delivered one).
        self.slots.complete(done.slot)?;
        let Done {
            meta,
            host,
            mask,
            error,
            timing,
            ..
        } = done;
        if let Some(t) = self.timings.as_mut() {
            t.push(timing);
        }
        if let Some(source) = error {
            return Err(RuntimeError::Fault {
                step: meta.step,
                source,
            });
        }
        // The step's KV is written: a prefill publishes its prompt pages,
        // a row that verified drafts keeps only the ones it accepted.
        let accepted = (!meta.draft_indptr.is_empty()).then_some(&host.row_indptr[..]);
        self.front.commit_step(&meta.kv, accepted)?;
        self.metas[slot] = Some(meta);
        self.masks[slot] = Some(mask);
        let host = self.render[slot].insert(host);
        Ok(StepOutputs {
            tokens: &host.tokens,
            logprobs: Some(&host.logprobs),
            top_logprobs: &host.top,
            top_n: host.top_n,
            row_indptr: &host.row_indptr,
            values: &host.values,
        })
    }

    fn release_all(&mut self) {
        // Synchronize first: no stream may still touch a slot or a page.
        if let Err(e) = self.synchronize() {
            tracing::error!(error = %e, "synchronize before release_all failed");
        }
        // Sampled steps still deliver their buffers; a launched but unsampled
        // forward never will, so its slot gets fresh buffers.
        let sampled = self.slots.sampled_in_flight();
        for _ in 0..sampled {
            if let Ok(done) = self.done.recv_timeout(std::time::Duration::from_secs(5)) {
                let slot = done.slot;
                self.metas[slot] = Some(done.meta);
                self.masks[slot] = Some(done.mask);
                self.render[slot] = Some(done.host);
            }
        }
        self.slots.clear();
        for slot in 0..NUM_SLOTS {
            self.metas[slot].get_or_insert_with(|| Box::new(SlotMeta::new()));
            self.masks[slot].get_or_insert_with(Box::default);
            self.render[slot].get_or_insert_with(Box::default);
        }
        self.front.release_all();
    }

    /// Timings come from the compute stream's clock around each step's
    /// forward and sampling.
    fn record_timings(&mut self, on: bool) -> Result<(), RuntimeError> {
        if on {
            self.timings.get_or_insert_default();
        } else {
            self.timings = None;
        }
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

impl Drop for CpuRuntime {
    fn drop(&mut self) {
        // Closing the work queue stops the compute stream, which closes the copy stream.
        self.work = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
