//! A prefill step ([`Executor::launch_prefill`]): new sequences admitted
//! (their prompt's pages, growing lazily after; a fork sharing its
//! parent's full prompt pages), each input's chunk planned after its
//! prefix-cache hit or where its last chunk ended, the metadata packed and
//! copied, re-admitted sequences' generated tokens counted back into their
//! penalties (and, with a region model, their generated coordinate and
//! size ids embedded from the values committed with them:
//! `PrefillInput::generated_values`, refused before dispatch unless none
//! or one per generated token), the forward in `forward_rows` chunks
//! through the tiled prefill attention, logits only for the chunks that
//! end their prompts.
//!
//! Image rows (`PrefillInput::embeds`, Moondream; with `Runtime::with_vision`):
//! the image's projector output, from the runtime's cache of the last
//! `IMAGE_CACHE` encoded images (by content hash) or encoded now on the
//! compute stream (`runtime/vision.rs`, synchronous: the prefill waits for
//! it), replaces the placeholder tokens' embeddings of the chunk's image
//! rows (`put_rows`, between the embedding and the blocks), and rows before
//! the bidirectional prefix's end are masked at its last position
//! (`FwdArgs::mask_pos`, a section of the step's words), so they attend all
//! of it. The prefix's rest is in one chunk (`PrefillInput::chunk_end`) and
//! one forward call (a forward call ends before a prefix it would split; a
//! prefix longer than `StepConfig::forward_rows` is refused before
//! dispatch).

use kestrel_model::vision::PreparedImage;
use kestrel_pipeline::{ExecError, PrefillInput, SamplingParams, SlotId, StepKind, TokenValues};

use super::backend::{DevMem, Device, HostMem};
use super::device::{FwdArgs, SpatialIn};
use super::slot::{StepState, MAX_TOP};
use super::{fatal, Runtime, IMAGE_CACHE};
use crate::ffi::SampleParams;
use crate::host::{pack_prefill, PrefillSeq};
use crate::CudaError;

impl<D: Device> Runtime<D> {
    pub(super) fn prefill(
        &mut self,
        slot: SlotId,
        seqs: &[PrefillInput<'_, SamplingParams>],
    ) -> Result<(), ExecError<CudaError>> {
        self.protocol
            .check_launch(slot)
            .map_err(|e| ExecError::PreDispatch(e.into()))?;
        // Image rows: a vision encoder, a prepared image, rows within the
        // prompt and the encoder's output, a prefix one forward call holds.
        if let Some(e) = self.check_image_rows(seqs) {
            return Err(ExecError::PreDispatch(e));
        }
        // A re-admission's values are none or one per generated token.
        if let Some(input) = seqs.iter().find(|s| !s.values_fit()) {
            return Err(ExecError::PreDispatch(CudaError::GeneratedValues {
                id: input.id,
                values: input.generated_values.len(),
                generated: input.generated,
            }));
        }
        self.dev.d.bind().map_err(fatal)?;
        // New sequences take their prompt's pages (they grow lazily, as on
        // the CPU: `grow` before each decode step); a resumed chunk's
        // sequence was admitted by its first. Each input's chunk starts at
        // `kv.starts[i]`.
        self.front
            .plan_prefill(seqs, |input| input.params.clone(), &mut self.slots[slot].kv)
            .map_err(|e| ExecError::PreDispatch(e.into()))?;
        let starts: Vec<usize> = self.slots[slot]
            .kv
            .starts
            .iter()
            .map(|&start| start as usize)
            .collect();
        // Which inputs' chunks end their prompts: only those are sampled.
        let samples: Vec<bool> = seqs
            .iter()
            .zip(&starts)
            .map(|(input, &start)| input.samples_from(start))
            .collect();
        let mut words = std::mem::take(&mut self.slots[slot].prefill_words);
        let kv = &self.slots[slot].kv;
        let plan: Vec<PrefillSeq<'_>> = seqs
            .iter()
            .zip(&starts)
            .enumerate()
            .map(|(i, (input, &start))| PrefillSeq {
                kv_row: kv.rows[i],
                prompt: kv.tokens(i),
                start,
                samples: samples[i],
                admitted: input.start.admits(),
                generated: &input.prompt[input.prompt.len().saturating_sub(input.generated)..],
            })
            .collect();
        let layout = pack_prefill(&plan, &kv.indices, self.cfg.step.page_size, &mut words)
            .map_err(|e| ExecError::Fatal(e.into()))?;
        // Each input's first step row (its chunk's rows are consecutive).
        let row0: Vec<usize> = plan
            .iter()
            .scan(0, |r, p| {
                let at = *r;
                *r += p.prompt.len() - p.start;
                Some(at)
            })
            .collect();
        // After the layout, with a region model and a re-admission's
        // generated coordinate or size id among the rows: each row's
        // spatial token and values (`SpatialIn::Rows`).
        let spatial = self.dev.spatial_ids().and_then(|ids| {
            let rows = seqs
                .iter()
                .zip(&starts)
                .enumerate()
                .flat_map(|(i, (input, &start))| {
                    let generated_from = input.prompt.len().saturating_sub(input.generated);
                    (start..kv.tokens(i).len()).map(move |pos| (input, generated_from, pos))
                });
            pack_spatial_rows(rows, ids, layout.tokens_n, &mut words)
        });
        // Bidirectional prefixes in this step: each row's attention
        // position after the layout (and spatial section), the prefix's
        // last position for its rows.
        let prefixes: Vec<(usize, usize)> = seqs
            .iter()
            .zip(&starts)
            .zip(&row0)
            .filter_map(|((input, &start), &r0)| {
                let end = input.embeds.map_or(0, |e| e.bidirectional_end);
                (start < end).then(|| (r0, r0 + end - start))
            })
            .collect();
        let mask_at = (!prefixes.is_empty()).then(|| {
            let at = words.len();
            for (i, (input, &start)) in seqs.iter().zip(&starts).enumerate() {
                let last = input.embeds.map_or(0, |e| e.bidirectional_end).max(1) - 1;
                let end = kv.tokens(i).len();
                words.extend((start..end).map(|pos| pos.max(last) as u32));
            }
            at
        });
        let s = &mut self.slots[slot];
        let total_words = words.len();
        s.ensure_prefill_capacity(&self.dev.d, total_words)
            .map_err(ExecError::Fatal)?;
        s.prefill_host.as_mut_slice()[..total_words].copy_from_slice(&words);
        // Sampling parameters of the sampled sequences, in step order.
        let sampled = seqs.iter().zip(&samples).filter(|(_, &x)| x);
        for (p, (input, _)) in s.params_host.as_mut_slice().iter_mut().zip(sampled) {
            *p = SampleParams::from(input.params);
        }
        s.prefill_words = words;
        // The images whose rows this step embeds, encoded now unless cached
        // (the encoder runs and syncs on the compute stream here), and
        // where: (step row, rows, image, first image row).
        let mut spans = Vec::new();
        let mut retired = Vec::new();
        for (i, input) in seqs.iter().enumerate() {
            let Some(e) = input.embeds else { continue };
            let (start, end) = (starts[i], self.slots[slot].kv.tokens(i).len());
            let (a, b) = (start.max(e.start), end.min(e.start + e.len));
            if a >= b {
                continue;
            }
            let img = e
                .input
                .downcast_ref::<PreparedImage>()
                .expect("checked before dispatch");
            let ptr = self
                .image_rows(img, &mut retired)
                .map_err(ExecError::Fatal)?;
            spans.push((row0[i] + a - start, b - a, ptr, a - e.start));
        }
        self.slots[slot].images = retired;
        // Past this point device work is enqueued: every error is fatal.
        let timed = self
            .mark(slot, |e| &e.forward_start)
            .map_err(ExecError::Fatal)?;
        // The sampled sequences' biases, in the order of their parameters.
        self.step_biases.clear();
        let biases = seqs.iter().zip(&samples).filter(|(_, &x)| x);
        self.step_biases
            .extend(biases.map(|(i, _)| i.params.logit_bias.clone()));
        let bias = self.upload_bias(slot).map_err(ExecError::Fatal)?;
        self.upload_prefill(slot, total_words, layout.sampled)
            .map_err(ExecError::Fatal)?;
        let s = &self.slots[slot];
        let m = &s.prefill_dev;
        if layout.admitted > 0 {
            self.dev
                .admit_counts(
                    m.at::<u32>(layout.admit_rows()),
                    m.at::<u32>(layout.count_indptr()),
                    m.at::<u32>(layout.count_tokens()),
                    (layout.admitted, layout.counted),
                )
                .map_err(fatal)?;
        }
        let base = self.fwd_args(slot, 0);
        let chunk = self.cfg.step.forward_rows;
        let hidden = self.dev.cfg.hidden_size;
        let mut a = 0;
        while a < layout.tokens_n {
            let mut n = chunk.min(layout.tokens_n - a);
            // A forward call never ends inside a bidirectional prefix (its
            // rows attend all of its keys, written in the same call): it
            // ends before one that would not fit (one fits a call:
            // `check_image_rows`).
            if let Some(&(b, _)) = prefixes
                .iter()
                .find(|&&(b, e)| b > a && b < a + n && a + n < e)
            {
                n = b - a;
            }
            // The chunk's spatial inputs, when it has any.
            let spatial = match &spatial {
                Some(sp) if sp.any_in(a, n) => SpatialIn::Rows {
                    tokens: m.at::<u32>(sp.at + a),
                    values: m.at::<u32>(sp.at + layout.tokens_n + 3 * a),
                },
                _ => SpatialIn::None,
            };
            let args = FwdArgs {
                n,
                tokens: m.at::<u32>(layout.tokens() + a),
                rows: 0,
                positions: m.at::<u32>(layout.positions() + a),
                row_seq: m.at::<u32>(layout.row_seq() + a),
                slot_mapping: m.at::<u32>(layout.slot_mapping() + a),
                kv_indptr: m.at::<u32>(layout.kv_indptr()),
                kv_indices: m.at::<u32>(layout.kv_indices()),
                out_row: m.at::<u32>(layout.out_row() + a),
                spatial,
                tiled_attention: true,
                mask_pos: mask_at.map_or(0, |at| m.at::<u32>(at + a)),
                ..base
            };
            self.dev.forward_embed(&args).map_err(fatal)?;
            for &(row, len, src, first) in &spans {
                let (lo, hi) = (row.max(a), (row + len).min(a + n));
                if lo < hi {
                    let src = src + ((first + lo - row) * hidden * 4) as u64;
                    self.dev
                        .put_rows(args.x, lo - a, src, hi - lo)
                        .map_err(fatal)?;
                }
            }
            self.dev.forward_blocks(&args).map_err(fatal)?;
            self.dev
                .keep_hidden(args.x, args.out_row, n)
                .map_err(fatal)?;
            a += n;
        }
        if layout.sampled > 0 {
            self.dev
                .lm_head(s.hidden_last.ptr(), s.logits.ptr(), layout.sampled)
                .map_err(fatal)?;
            self.dev.region_logits(layout.sampled).map_err(fatal)?;
        }
        if timed {
            self.mark(slot, |e| &e.forward_end)
                .map_err(ExecError::Fatal)?;
        }
        let top_n = seqs
            .iter()
            .zip(&samples)
            .filter(|(_, &x)| x)
            .map(|(i, _)| i.params.top_logprobs as usize)
            .max()
            .unwrap_or(0);
        let state = StepState {
            kind: StepKind::Prefill,
            n: layout.sampled,
            top_n: top_n.min(MAX_TOP),
            rows_ptr: m.at::<u32>(layout.kv_rows()),
            positions_ptr: m.at::<u32>(layout.sample_pos()),
            step: self.protocol.next_step(),
            timed,
            bias,
            verify: None,
        };
        self.record_launch(slot, state).map_err(ExecError::Fatal)
    }

    /// Why the step's image rows cannot be served, if they cannot: no
    /// vision encoder, an input that is not a `PreparedImage`, rows outside
    /// the prompt or past the encoder's output, or a bidirectional prefix
    /// longer than one forward call (`StepConfig::forward_rows`).
    fn check_image_rows(&self, seqs: &[PrefillInput<'_, SamplingParams>]) -> Option<CudaError> {
        let forward_rows = self.cfg.step.forward_rows;
        seqs.iter().find_map(|input| {
            let e = input.embeds?;
            let bad = |why: String| Some(CudaError::Unsupported(why));
            let Some(tokens) = self.dev.image_tokens() else {
                return bad("image rows without a vision encoder (Runtime::with_vision)".into());
            };
            if e.input.downcast_ref::<PreparedImage>().is_none() {
                return bad("image rows whose input is not a prepared image".into());
            }
            if !e.fits(input.prompt.len()) || e.len > tokens {
                return bad(format!(
                    "image rows {}..{}+{} (prefix ..{}) in a prompt of {} with {tokens} image tokens",
                    e.start,
                    e.start,
                    e.len,
                    e.bidirectional_end,
                    input.prompt.len()
                ));
            }
            (e.bidirectional_end > forward_rows).then(|| {
                CudaError::Unsupported(format!(
                    "a bidirectional prefix of {} rows with forward_rows {forward_rows}",
                    e.bidirectional_end
                ))
            })
        })
    }

    /// `image`'s projector output on the device (`[tokens][hidden]` f32,
    /// its address): from the cache of encoded images, or encoded now and
    /// kept. The least recently used image it drops goes to `retired`
    /// (this step's earlier rows may read it; nothing in flight before
    /// does: encoding synchronized both streams).
    fn image_rows(
        &mut self,
        image: &PreparedImage,
        retired: &mut Vec<D::Buf>,
    ) -> Result<u64, CudaError> {
        if let Some(i) = self.images.iter().position(|(h, _)| *h == image.hash) {
            let hit = self.images.remove(i);
            let ptr = hit.1.ptr();
            self.images.push(hit);
            self.image_cache_hits += 1;
            return Ok(ptr);
        }
        let features = self.dev.encode_crops(&image.crops)?;
        let tokens = self.dev.project(&features, image.crops.tiling)?;
        let buf = self.dev.d.upload(&tokens.data)?;
        self.encoder_runs += 1;
        if self.images.len() == IMAGE_CACHE {
            retired.push(self.images.remove(0).1);
        }
        let ptr = buf.ptr();
        self.images.push((image.hash, buf));
        Ok(ptr)
    }
}

/// Where a prefill step's spatial rows lie in its words, after the layout:
/// `tokens_n` tokens (a generated coordinate or size id, 0 for any other
/// row), then 3 f32 a row (as bits: coord, w, h), the values committed with
/// the token.
struct SpatialRows {
    /// The first word of the tokens.
    at: usize,
    /// The step rows that are spatial inputs, in order.
    rows: Vec<usize>,
}

impl SpatialRows {
    /// Whether rows `a..a + n` hold a spatial input.
    fn any_in(&self, a: usize, n: usize) -> bool {
        let i = self.rows.partition_point(|&r| r < a);
        self.rows.get(i).is_some_and(|&r| r < a + n)
    }
}

/// Append the spatial section for the step's rows (`rows`, in step order:
/// each one's input, the position its generated tokens start at, and its
/// position) to `words`, when any row is a generated coordinate or size id
/// (`ids`); `None`, and nothing appended, otherwise. A generated id takes
/// the values committed with it ([`PrefillInput::values_at`]; zeros when
/// none were kept), as the decode step after it embedded it; a prompt's
/// own spatial id is a token embedding (kestrel-cpu's prefill alike).
fn pack_spatial_rows<'a, 'b: 'a>(
    rows: impl Iterator<Item = (&'a PrefillInput<'b, SamplingParams>, usize, usize)>,
    (coord_id, size_id): (u32, u32),
    tokens_n: usize,
    words: &mut Vec<u32>,
) -> Option<SpatialRows> {
    let inputs: Vec<(usize, u32, TokenValues)> = rows
        .enumerate()
        .filter_map(|(row, (input, generated_from, pos))| {
            let token = input.prompt[pos];
            (pos >= generated_from && (token == coord_id || token == size_id))
                .then(|| (row, token, input.values_at(pos)))
        })
        .collect();
    if inputs.is_empty() {
        return None;
    }
    let at = words.len();
    words.resize(at + 4 * tokens_n, 0);
    for &(row, token, v) in &inputs {
        words[at + row] = token;
        let o = at + tokens_n + 3 * row;
        words[o..o + 3].copy_from_slice(&[
            v.coord.to_bits(),
            v.size[0].to_bits(),
            v.size[1].to_bits(),
        ]);
    }
    Some(SpatialRows {
        at,
        rows: inputs.iter().map(|&(row, ..)| row).collect(),
    })
}
