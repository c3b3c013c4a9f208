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

use kestrel_pipeline::{ExecError, PrefillInput, SamplingParams, SlotId, StepKind, TokenValues};

use super::backend::{DevMem, Device, HostMem};
use super::device::{FwdArgs, SpatialIn};
use super::slot::{StepState, MAX_TOP};
use super::{fatal, Runtime};
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
        // Image rows need the vision encoder, which this runtime lacks:
        // refused before any work rather than embedded as token ids.
        if seqs.iter().any(|s| s.embeds.is_some()) {
            return Err(ExecError::PreDispatch(CudaError::Unsupported(
                "prompt rows given as embeddings (an image): the CUDA runtime has no vision \
                 encoder"
                    .into(),
            )));
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
        let mut a = 0;
        while a < layout.tokens_n {
            let n = chunk.min(layout.tokens_n - a);
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
                ..base
            };
            self.dev.forward_layers(&args).map_err(fatal)?;
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
