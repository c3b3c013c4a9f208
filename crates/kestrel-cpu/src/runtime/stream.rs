//! The CPU "device": a compute stream and a copy stream, each a dedicated
//! thread executing its queue strictly in order (I1: one compute stream is
//! shared by both slots, so KV writes and input tokens stay ordered).
//!
//! The compute stream runs forwards and sampling, and keeps each sequence's
//! next input token on its side (it never travels through the scheduler).
//! After sampling step t it hands the step's device outputs to the copy
//! stream; that hand-off is the step-done event, anchored to exactly step t
//! (I3). The copy stream copies them into the slot's `RenderBuffer` host
//! buffer and signals the scheduler. With a region model, the spatial stage
//! ([`super::spatial`]) runs between sampling and the hand-off, so a
//! step's values travel with its ids and the next input (an encoded
//! coordinate or size) stays on this side.

use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

use kestrel_model::vision::PreparedImage;
use kestrel_pipeline::{SamplingParams, StepKind, StepTiming, TokenId, TokenValues};

use super::images::ImageRows;
use super::slot::{Outputs, SlotMeta};
use super::spatial::SpatialStage;
use crate::model::{DecodeBatch, LogitsMode, PrefillBatch, PrefillRows};
use crate::sampler::{sample, PenaltyState};
use crate::{CpuError, CpuModel, KvStore, PositionLogprobs, Scratch};
use kestrel_model::moondream::{RegionConfig, RegionWeights};

/// Work for the compute stream, executed in order.
pub(crate) enum Work {
    /// Run the forward described by `meta` into `slot`'s logits.
    Forward { slot: usize, meta: Box<SlotMeta> },
    /// Sample `slot`'s logits (with the slot's mask) and start the copy into `host`.
    Sample {
        slot: usize,
        host: Box<Outputs>,
        mask: Box<MaskBuf>,
    },
    /// Reply once everything before it has executed (stream synchronize).
    Sync(Sender<()>),
    /// Take the vision model (image rows of later prefills).
    Vision(Box<ImageRows>),
    /// Score every position of a prompt on a private cache
    /// ([`crate::prompt_logprobs`]); the runtime's KV is not touched.
    Score {
        tokens: Vec<TokenId>,
        top: usize,
        reply: Sender<Result<Vec<PositionLogprobs>, CpuError>>,
    },
}

/// Mask words for one step, copied from the scheduler before sampling.
#[derive(Debug, Default)]
pub(crate) struct MaskBuf {
    pub words_per_row: usize,
    pub words: Vec<u32>,
    pub rows: Vec<bool>,
    pub any: bool,
}

/// A completed step, delivered by the copy stream to the scheduler.
pub(crate) struct Done {
    pub slot: usize,
    pub meta: Box<SlotMeta>,
    pub host: Box<Outputs>,
    pub mask: Box<MaskBuf>,
    /// A compute fault surfaced at this step (engine-fatal).
    pub error: Option<CpuError>,
    pub timing: StepTiming,
}

/// A step's device outputs on their way to the host.
pub(crate) struct CopyJob {
    done: Done,
    dev: Box<Outputs>,
}

/// Per-KV-row state that lives on the device side.
#[derive(Debug)]
struct DeviceRow {
    params: SamplingParams,
    /// The last sampled token: the next decode step's input.
    pending: TokenId,
    /// The values decoded beside `pending` (its input embedding when it is
    /// a spatial id).
    pending_values: TokenValues,
    penalties: PenaltyState,
}

/// Everything the compute stream owns.
pub(crate) struct ComputeStream {
    pub model: Arc<CpuModel>,
    pub kv: KvStore,
    pub scratch: Scratch,
    /// Prefill chunk length (tokens per forward call).
    pub chunk: usize,
    /// Per slot: the DecodeSlot's logits buffer.
    pub logits: Vec<Vec<f32>>,
    /// Per slot: the metadata of the forward in flight.
    pub metas: Vec<Option<Box<SlotMeta>>>,
    /// Per slot: device output buffers (lent to the copy stream while copying).
    pub dev_out: Vec<Option<Box<Outputs>>>,
    /// Per slot: a compute fault to report at this step's commit.
    pub faults: Vec<Option<CpuError>>,
    /// Per slot: forward start and end of the step in flight.
    pub forward_times: Vec<(Instant, Instant)>,
    rows: Vec<DeviceRow>,
    tokens: Vec<TokenId>,
    /// A verifying decode step's per-row query offsets and start positions.
    qo_indptr: Vec<u32>,
    start_pos: Vec<u32>,
    chunk_indptr: Vec<u32>,
    chunk_last: Vec<u32>,
    /// Image rows (Moondream), once the runtime has a vision model.
    vision: Option<Box<ImageRows>>,
    /// A chunk's embedded rows (indices into the chunk).
    embedded: Vec<u32>,
    /// A re-prefill chunk's generated spatial rows (indices into the
    /// chunk), and its embedded rows' inputs when it has both those and
    /// image rows.
    spatial_rows: Vec<u32>,
    merged: Vec<f32>,
    /// The region model's stage, once a vision model with one arrived.
    spatial: Option<SpatialStage>,
    /// Per token sampled this step: its logits row, and its sequence's
    /// KV row.
    sampled_rows: Vec<u32>,
    sampled_seqs: Vec<u32>,
}

impl ComputeStream {
    pub fn new(
        model: Arc<CpuModel>,
        kv: KvStore,
        scratch: Scratch,
        chunk: usize,
        max_rows: usize,
        max_draft_tokens: usize,
        num_slots: usize,
    ) -> Self {
        let vocab = model.config().vocab_size;
        // A verifying decode step has a logits row per row and per draft.
        let max_batch = max_rows.max(1) + max_draft_tokens;
        Self {
            model,
            kv,
            scratch,
            chunk,
            logits: (0..num_slots)
                .map(|_| vec![0.0; max_batch * vocab])
                .collect(),
            metas: (0..num_slots).map(|_| None).collect(),
            dev_out: (0..num_slots).map(|_| Some(Box::default())).collect(),
            faults: (0..num_slots).map(|_| None).collect(),
            forward_times: vec![(Instant::now(), Instant::now()); num_slots],
            rows: (0..max_rows + 1)
                .map(|_| DeviceRow {
                    params: SamplingParams::default(),
                    pending: 0,
                    pending_values: TokenValues::default(),
                    penalties: PenaltyState::new(vocab),
                })
                .collect(),
            tokens: Vec::with_capacity(max_batch),
            qo_indptr: Vec::with_capacity(max_rows + 1),
            start_pos: Vec::with_capacity(max_rows),
            chunk_indptr: Vec::with_capacity(2),
            chunk_last: Vec::with_capacity(1),
            vision: None,
            embedded: Vec::new(),
            spatial_rows: Vec::new(),
            merged: Vec::new(),
            spatial: None,
            sampled_rows: Vec::with_capacity(max_batch),
            sampled_seqs: Vec::with_capacity(max_batch),
        }
    }

    /// The compute thread's loop: execute work in order until the queue closes.
    pub fn run(
        mut self,
        work: Receiver<Work>,
        copy: Sender<CopyJob>,
        returned: Receiver<(usize, Box<Outputs>)>,
    ) {
        while let Ok(w) = work.recv() {
            match w {
                Work::Forward { slot, meta } => {
                    let t0 = Instant::now();
                    if let Err(e) = self.forward(slot, &meta) {
                        self.faults[slot] = Some(e);
                    }
                    self.forward_times[slot] = (t0, Instant::now());
                    self.metas[slot] = Some(meta);
                }
                Work::Sample { slot, host, mask } => {
                    // Wait for the copy stream to give back this slot's device
                    // buffer (a stream waiting on an event).
                    while self.dev_out[slot].is_none() {
                        match returned.recv() {
                            Ok((s, buf)) => self.dev_out[s] = Some(buf),
                            Err(_) => return,
                        }
                    }
                    let meta = match self.metas[slot].take() {
                        Some(m) => m,
                        None => {
                            tracing::error!(slot, "sampling without a forward");
                            return;
                        }
                    };
                    let mut dev = self.dev_out[slot].take().expect("checked above");
                    let sample_start = Instant::now();
                    let error = match self.faults[slot].take() {
                        Some(e) => Some(e),
                        None => {
                            self.sample(slot, &meta, &mask, &mut dev);
                            self.spatial_stage(slot, &mut dev).err()
                        }
                    };
                    let (forward_start, forward_end) = self.forward_times[slot];
                    let timing = StepTiming {
                        step: meta.step,
                        prefill: meta.kind == StepKind::Prefill,
                        rows: meta.kv.rows.len(),
                        forward_start,
                        forward_end,
                        sample_start,
                        sample_end: Instant::now(),
                    };
                    let done = Done {
                        slot,
                        meta,
                        host,
                        mask,
                        error,
                        timing,
                    };
                    let job = CopyJob { done, dev };
                    if copy.send(job).is_err() {
                        return;
                    }
                }
                Work::Sync(reply) => {
                    let _ = reply.send(());
                }
                Work::Vision(v) => {
                    self.spatial = SpatialStage::new(&v.model, self.logits.len());
                    self.vision = Some(v);
                }
                Work::Score { tokens, top, reply } => {
                    let _ = reply.send(crate::prompt_logprobs(&self.model, &tokens, top));
                }
            }
        }
    }

    fn forward(&mut self, slot: usize, meta: &SlotMeta) -> Result<(), CpuError> {
        let vocab = self.model.config().vocab_size;
        match meta.kind {
            StepKind::Decode if !meta.draft_indptr.is_empty() => {
                // Each row's input token and drafts, as one prefill-shaped
                // forward with logits at every token (verification reads
                // them in order).
                self.tokens.clear();
                self.qo_indptr.clear();
                self.start_pos.clear();
                self.qo_indptr.push(0);
                for (i, &r) in meta.kv.rows.iter().enumerate() {
                    self.tokens.push(self.rows[r as usize].pending);
                    self.tokens.extend_from_slice(meta.drafts(i));
                    self.qo_indptr.push(self.tokens.len() as u32);
                    self.start_pos.push(meta.kv.starts[i]);
                }
                let batch = PrefillBatch {
                    tokens: &self.tokens,
                    qo_indptr: &self.qo_indptr,
                    start_pos: &self.start_pos,
                    kv_indptr: &meta.kv.indices.kv_indptr,
                    kv_indices: &meta.kv.indices.kv_indices,
                    kv_last_page_len: &meta.kv.indices.kv_last_page_len,
                };
                let run = self.model.vision_run();
                let embeds = match (&mut self.spatial, &self.vision) {
                    (Some(sp), Some(v)) => {
                        let rows = &self.rows;
                        let pending = meta.kv.rows.iter().zip(&self.qo_indptr).map(|(&r, &b)| {
                            let dr = &rows[r as usize];
                            (b, dr.pending, dr.pending_values)
                        });
                        sp.inputs(run, region_of(v)?, pending, &mut self.embedded)?
                    }
                    _ => &[][..],
                };
                let given = PrefillRows {
                    bidirectional_end: &[],
                    embedded: &self.embedded,
                    embeds,
                };
                let n = self.tokens.len();
                let out = &mut self.logits[slot][..n * vocab];
                self.model.forward_prefill_rows(
                    batch,
                    given,
                    &mut self.kv,
                    out,
                    LogitsMode::All,
                    &mut self.scratch,
                )?;
                self.keep_hidden(slot, 0, n);
                Ok(())
            }
            StepKind::Decode => {
                let n = meta.kv.rows.len();
                self.tokens.clear();
                self.tokens
                    .extend(meta.kv.rows.iter().map(|&r| self.rows[r as usize].pending));
                let batch = DecodeBatch {
                    tokens: &self.tokens,
                    positions: &meta.kv.starts,
                    kv_indptr: &meta.kv.indices.kv_indptr,
                    kv_indices: &meta.kv.indices.kv_indices,
                    kv_last_page_len: &meta.kv.indices.kv_last_page_len,
                };
                let run = self.model.vision_run();
                // A row whose input is a spatial id takes its encoded value.
                let embeds = match (&mut self.spatial, &self.vision) {
                    (Some(sp), Some(v)) => {
                        let rows = &self.rows;
                        let pending = meta.kv.rows.iter().enumerate().map(|(i, &r)| {
                            let dr = &rows[r as usize];
                            (i as u32, dr.pending, dr.pending_values)
                        });
                        sp.inputs(run, region_of(v)?, pending, &mut self.embedded)?
                    }
                    _ => &[][..],
                };
                let given = PrefillRows {
                    bidirectional_end: &[],
                    embedded: &self.embedded,
                    embeds,
                };
                let out = &mut self.logits[slot][..n * vocab];
                self.model.forward_decode_rows(
                    batch,
                    given,
                    &mut self.kv,
                    out,
                    &mut self.scratch,
                )?;
                self.keep_hidden(slot, 0, n);
                Ok(())
            }
            StepKind::Prefill => {
                let page_size = self.kv.page_size();
                for (r, p) in meta.prefill.iter().enumerate() {
                    let row = meta.kv.rows[r] as usize;
                    let prompt = meta.kv.tokens(r);
                    let dr = &mut self.rows[row];
                    dr.params.clone_from(&p.params);
                    dr.penalties.clear();
                    // A re-admitted sequence's generated tokens count for
                    // penalties as if this row had sampled them (they are
                    // in `prompt` once the chunk reaches the prompt's end).
                    if prompt.len() == p.prompt_len as usize {
                        for &t in &prompt[prompt.len() - p.generated as usize..] {
                            dr.penalties.record(t);
                        }
                    }
                    let pages = &meta.kv.indices.kv_indices[meta.kv.indices.kv_indptr[r] as usize
                        ..meta.kv.indices.kv_indptr[r + 1] as usize];
                    let mut start = meta.kv.starts[r] as usize;
                    let len = prompt.len();
                    // An image's rows: its projector output (encoded now
                    // unless cached) for positions `e.start..e.start + e.len`.
                    let image = match &p.embeds {
                        Some(e) if start < e.start + e.len => {
                            let (Some(v), Some(img)) = (
                                self.vision.as_mut(),
                                e.input.downcast_ref::<PreparedImage>(),
                            ) else {
                                return Err(bad_rows("image rows without a vision model"));
                            };
                            let run = self.model.vision_run();
                            Some((e, v.tokens(run, img)?))
                        }
                        _ => None,
                    };
                    let prefix = p.embeds.as_ref().map_or(0, |e| e.bidirectional_end);
                    while start < len {
                        let mut end = (start + self.chunk).min(len);
                        // The bidirectional prefix's rows attend all of its
                        // keys: its rest is one forward call.
                        if start < prefix && end < prefix {
                            end = prefix.min(len);
                        }
                        if end - start > self.scratch.max_rows() {
                            let context = self.scratch.max_context();
                            self.scratch = Scratch::new(&self.model, end - start, context);
                        }
                        self.embedded.clear();
                        let mut embeds = match &image {
                            Some((e, t)) if start.max(e.start) < end.min(e.start + e.len) => {
                                let (a, b) = (start.max(e.start), end.min(e.start + e.len));
                                self.embedded.extend((a..b).map(|pos| (pos - start) as u32));
                                &t.data[(a - e.start) * t.dim..(b - e.start) * t.dim]
                            }
                            _ => &[][..],
                        };
                        // A re-admission's generated coordinate and size
                        // ids take their committed values' encodings, as
                        // the decode steps after them did; after any image
                        // rows, which come before them.
                        let generated_from = p.prompt_len.saturating_sub(p.generated) as usize;
                        if let (Some(sp), Some(v), true) =
                            (&mut self.spatial, &self.vision, end > generated_from)
                        {
                            let pending = (start.max(generated_from)..end).map(|pos| {
                                let values = p.generated_values.get(pos - generated_from);
                                (
                                    (pos - start) as u32,
                                    prompt[pos],
                                    values.copied().unwrap_or_default(),
                                )
                            });
                            let run = self.model.vision_run();
                            let coded =
                                sp.inputs(run, region_of(v)?, pending, &mut self.spatial_rows)?;
                            if !coded.is_empty() {
                                self.merged.clear();
                                self.merged.extend_from_slice(embeds);
                                self.merged.extend_from_slice(coded);
                                self.embedded.extend_from_slice(&self.spatial_rows);
                                embeds = &self.merged;
                            }
                        }
                        let npages = end.div_ceil(page_size);
                        self.chunk_indptr.clear();
                        self.chunk_indptr.extend([0, npages as u32]);
                        self.chunk_last.clear();
                        self.chunk_last
                            .push((end - (npages - 1) * page_size) as u32);
                        let start_pos = [start as u32];
                        let qo = [0, (end - start) as u32];
                        let batch = PrefillBatch {
                            tokens: &prompt[start..end],
                            qo_indptr: &qo,
                            start_pos: &start_pos,
                            kv_indptr: &self.chunk_indptr,
                            kv_indices: &pages[..npages],
                            kv_last_page_len: &self.chunk_last,
                        };
                        let prefix_end = [prefix as u32];
                        let rows = PrefillRows {
                            bidirectional_end: if prefix > 0 { &prefix_end } else { &[] },
                            embedded: &self.embedded,
                            embeds,
                        };
                        let out = &mut self.logits[slot][r * vocab..(r + 1) * vocab];
                        self.model.forward_prefill_rows(
                            batch,
                            rows,
                            &mut self.kv,
                            out,
                            LogitsMode::LastPerSequence,
                            &mut self.scratch,
                        )?;
                        // The chunk that ends the prompt writes it last.
                        self.keep_hidden(slot, r, 1);
                        start = end;
                    }
                }
                Ok(())
            }
        }
    }

    fn sample(&mut self, slot: usize, meta: &SlotMeta, mask: &MaskBuf, dev: &mut Outputs) {
        let vocab = self.model.config().vocab_size;
        let top_n = meta
            .kv
            .rows
            .iter()
            .map(|&r| self.rows[r as usize].params.top_logprobs as usize)
            .max()
            .unwrap_or(0);
        dev.step = meta.step;
        dev.tokens.clear();
        dev.logprobs.clear();
        dev.top.clear();
        dev.top_n = top_n;
        dev.row_indptr.clear();
        self.sampled_rows.clear();
        self.sampled_seqs.clear();
        let verifying = !meta.draft_indptr.is_empty();
        if verifying {
            dev.row_indptr.push(0);
        }
        // `o`: the output row; a prefill chunk short of its prompt's end
        // samples nothing and has none (nor a mask row).
        let mut o = 0;
        for (i, &row) in meta.kv.rows.iter().enumerate() {
            let position = match meta.kind {
                StepKind::Decode => meta.kv.starts[i] + 1,
                StepKind::Prefill => {
                    let end = meta.kv.token_indptr[i + 1] - meta.kv.token_indptr[i];
                    let prompt_len = meta.prefill[i].prompt_len;
                    if end < prompt_len {
                        continue;
                    }
                    prompt_len
                }
            };
            // The row's first logits (and mask row): its own index, or after
            // the earlier rows' drafts when the step verifies drafts.
            let first = if verifying {
                i + meta.draft_indptr[i] as usize
            } else {
                o
            };
            o += 1;
            let words = |m: usize| {
                (mask.any && mask.rows[m])
                    .then(|| &mask.words[m * mask.words_per_row..(m + 1) * mask.words_per_row])
            };
            let drafts = meta.drafts(i);
            let dr = &mut self.rows[row as usize];
            let at = if verifying { first } else { i };
            let logits = &mut self.logits[slot][at * vocab..(at + 1) * vocab];
            let mut token = sample_into(
                logits,
                dr,
                words(first),
                position,
                top_n,
                dev,
                (meta.step, i),
            );
            self.sampled_rows.push(at as u32);
            self.sampled_seqs.push(row);
            // Verification: the draft computed after `token` was right, so
            // the next logits are that position's: sample it as decoding
            // would (penalties have counted `token`).
            let mut accepted = 0;
            while accepted < drafts.len() && drafts[accepted] == token {
                accepted += 1;
                let at = (first + accepted) * vocab;
                let logits = &mut self.logits[slot][at..at + vocab];
                let position = position + accepted as u32;
                let words = words(first + accepted);
                token = sample_into(logits, dr, words, position, top_n, dev, (meta.step, i));
                self.sampled_rows.push((first + accepted) as u32);
                self.sampled_seqs.push(row);
            }
            dr.pending = token;
            if verifying {
                dev.row_indptr.push(dev.tokens.len() as u32);
            }
        }
    }
}

impl ComputeStream {
    /// Keeps the hidden states of logits rows `0..n` of the last forward
    /// as `slot`'s rows `first..first + n`, when a spatial stage runs.
    fn keep_hidden(&mut self, slot: usize, first: usize, n: usize) {
        if let Some(sp) = &mut self.spatial {
            for j in 0..n {
                sp.keep(slot, first + j, self.model.last_hidden(&self.scratch, j));
            }
        }
    }

    /// The spatial stage: the values of the step's sampled spatial ids
    /// into `dev` and into each sequence's pending input.
    fn spatial_stage(&mut self, slot: usize, dev: &mut Outputs) -> Result<(), CpuError> {
        dev.values.clear();
        let (Some(sp), Some(v)) = (&mut self.spatial, &self.vision) else {
            return Ok(());
        };
        let run = self.model.vision_run();
        let (tokens, rows) = (&dev.tokens, &self.sampled_rows);
        sp.decode(run, region_of(v)?, slot, tokens, rows, &mut dev.values)?;
        for (k, &seq) in self.sampled_seqs.iter().enumerate() {
            // A sequence's last token is its pending input.
            let values = dev.values.get(k).copied().unwrap_or_default();
            self.rows[seq as usize].pending_values = values;
        }
        Ok(())
    }
}

/// The region weights and shape of a vision model the stage exists for.
fn region_of(v: &ImageRows) -> Result<(&RegionWeights, &RegionConfig), CpuError> {
    match &v.model.region {
        Some(w) => Ok((w, &v.model.config.region)),
        None => Err(bad_rows("a spatial stage without a region model")),
    }
}

fn bad_rows(reason: &str) -> CpuError {
    CpuError::BadIndices {
        reason: reason.into(),
    }
}

/// Samples one token of `dr`'s sequence at `position` from `logits` into
/// `dev` (padding its alternatives to `top_n`) and counts it for penalties.
fn sample_into(
    logits: &mut [f32],
    dr: &mut DeviceRow,
    words: Option<&[u32]>,
    position: u32,
    top_n: usize,
    dev: &mut Outputs,
    (step, row): (u64, usize),
) -> TokenId {
    // Each row computes only the alternatives it asked for (a greedy row
    // that asked none skips the softmax); rows are padded below.
    let want_top = dr.params.top_logprobs as usize;
    let (token, logprob) = match sample(
        logits,
        &dr.params,
        words,
        &mut dr.penalties,
        position,
        want_top,
    ) {
        Some(s) => {
            // Rows are `top_n` wide whatever each row asked for.
            let top = s.top.as_slice();
            dev.top.extend_from_slice(top);
            dev.top
                .extend((top.len()..top_n).map(|_| (0, f32::NEG_INFINITY)));
            (s.token, s.logprob)
        }
        None => {
            // A mask that allows nothing is a skill bug: emit token 0
            // with -inf; the skill rejects it and ends the request.
            tracing::warn!(step, row, "mask allows no token");
            dev.top.extend((0..top_n).map(|_| (0, f32::NEG_INFINITY)));
            (0, f32::NEG_INFINITY)
        }
    };
    dr.penalties.record(token);
    dev.tokens.push(token);
    dev.logprobs.push(logprob);
    token
}

/// The copy stream's loop: copy each finished step into its RenderBuffer
/// host buffer, give the device buffer back, and signal the scheduler.
pub(crate) fn run_copy_stream(
    jobs: Receiver<CopyJob>,
    give_back: Sender<(usize, Box<Outputs>)>,
    done: Sender<Done>,
) {
    while let Ok(CopyJob { done: mut msg, dev }) = jobs.recv() {
        msg.host.copy_from(&dev);
        if give_back.send((msg.slot, dev)).is_err() || done.send(msg).is_err() {
            return;
        }
    }
}
