//! A decode step that verifies drafts (speculative decoding, see
//! [`Drafts`]): one eager forward over each member's input token and drafts
//! (query rows after its cached prefix: the tiled `prefill_attention`),
//! logits at every row. `finalize_sampling` samples them in order on
//! scratch penalty counts and accepts (`kernels/verify.cu`); `wait_step`
//! compacts the accepted tokens and commits them.

use kestrel_pipeline::{Drafts, ExecError, RequestId, SlotId, StepKind};
use kestrel_step::StepError;

use super::backend::{DevMem, Device, HostMem, VerifyInputs};
use super::device::{FwdArgs, SpatialIn};
use super::slot::{StepState, VerifyStep, MAX_TOP};
use super::{fatal, Runtime};
use crate::ffi::SampleParams;
use crate::host::{pack_verify, VerifyRow};
use crate::CudaError;

impl<D: Device> Runtime<D> {
    /// A decode step whose rows carry drafts (see [`Drafts`]): one eager
    /// forward over each member's input token and drafts (query rows after
    /// its cached prefix: the tiled prefill attention), logits at every
    /// row; `finalize_sampling` samples them in order and accepts.
    pub(super) fn launch_verify(
        &mut self,
        slot: SlotId,
        rows: &[RequestId],
        drafts: Drafts<'_>,
    ) -> Result<(), ExecError<CudaError>> {
        self.protocol
            .check_launch(slot)
            .map_err(|e| ExecError::PreDispatch(e.into()))?;
        // Each member's input token and drafts get their KV written; the
        // commit rolls back the rejected.
        self.front
            .plan_decode(rows, drafts, &mut self.slots[slot].kv)
            .map_err(|e| ExecError::PreDispatch(e.into()))?;
        // Planned: from here a failure is a bug or a device fault (fatal).
        let (front, s, biases) = (&self.front, &mut self.slots[slot], &mut self.step_biases);
        let kv = &s.kv;
        let members: Vec<VerifyRow<'_>> = (0..rows.len())
            .map(|i| VerifyRow {
                kv_row: kv.rows[i],
                pos: kv.starts[i],
                drafts: drafts.row(i),
            })
            .collect();
        let mut words = std::mem::take(&mut s.prefill_words);
        let layout = pack_verify(&members, &kv.indices, self.cfg.step.page_size, &mut words)
            .map_err(|e| ExecError::Fatal(e.into()))?;
        // After the layout: each forward row's spatial KV row (the member's
        // for its input row, reserved row 0 for its drafts; `region.rs`).
        let spatial_rows = words.len();
        for m in &members {
            words.push(m.kv_row);
            words.extend(std::iter::repeat_n(0, m.drafts.len()));
        }
        // Every row samples with its member's parameters and logit bias.
        let (params, mut top_n, mut q) = (s.params_host.as_mut_slice(), 0, 0);
        biases.clear();
        for (i, &id) in rows.iter().enumerate() {
            let Some(meta) = front.get(id).map(|seq| &seq.meta) else {
                return Err(fatal(StepError::UnknownRequest(id)));
            };
            top_n = top_n.max(meta.top_logprobs as usize);
            for p in &mut params[q..q + 1 + drafts.row(i).len()] {
                *p = SampleParams::from(meta);
                biases.push(meta.logit_bias.clone());
            }
            q += 1 + drafts.row(i).len();
        }
        s.verify_qo.clear();
        s.verify_qo
            .extend_from_slice(&words[layout.qo()..layout.qo() + rows.len() + 1]);
        s.ensure_prefill_capacity(&self.dev.d, words.len())
            .map_err(ExecError::Fatal)?;
        s.prefill_host.as_mut_slice()[..words.len()].copy_from_slice(&words);
        let total_words = words.len();
        s.prefill_words = words;
        self.dev.d.bind().map_err(fatal)?;
        let timed = self
            .mark(slot, |e| &e.forward_start)
            .map_err(ExecError::Fatal)?;
        let bias = self.upload_bias(slot).map_err(ExecError::Fatal)?;
        self.upload_prefill(slot, total_words, layout.rows)
            .map_err(ExecError::Fatal)?;
        let s = &self.slots[slot];
        let m = &s.prefill_dev;
        let verify = VerifyStep {
            members: rows.len(),
            max_rows: 1
                + (0..rows.len())
                    .map(|i| drafts.row(i).len())
                    .max()
                    .unwrap_or(0),
            qo: m.at::<u32>(layout.qo()),
            kv_rows: m.at::<u32>(layout.kv_rows()),
            tokens: m.at::<u32>(layout.tokens()),
        };
        self.dev
            .d
            .verify_inputs(VerifyInputs {
                pending: self.dev.pending.ptr(),
                kv_rows: verify.kv_rows,
                qo: verify.qo,
                drafts: m.at::<u32>(layout.drafts()),
                tokens: verify.tokens,
                n: rows.len(),
            })
            .map_err(fatal)?;
        // One call: the slot's workspace holds max_rows + max_draft_tokens rows.
        let args = FwdArgs {
            n: layout.rows,
            tokens: verify.tokens,
            rows: 0,
            positions: m.at::<u32>(layout.positions()),
            row_seq: m.at::<u32>(layout.row_seq()),
            slot_mapping: m.at::<u32>(layout.slot_mapping()),
            kv_indptr: m.at::<u32>(layout.kv_indptr()),
            kv_indices: m.at::<u32>(layout.kv_indices()),
            out_row: 0,
            spatial: SpatialIn::KvRows(m.at::<u32>(spatial_rows)),
            tiled_attention: true,
            ..self.fwd_args(slot, 0)
        };
        self.dev.forward_layers(&args).map_err(fatal)?;
        self.dev
            .lm_head(s.hidden_last.ptr(), s.logits.ptr(), layout.rows)
            .map_err(fatal)?;
        self.dev
            .keep_hidden(args.x, 0, layout.rows)
            .map_err(fatal)?;
        self.dev.region_logits(layout.rows).map_err(fatal)?;
        if timed {
            self.mark(slot, |e| &e.forward_end)
                .map_err(ExecError::Fatal)?;
        }
        let state = StepState {
            kind: StepKind::Decode,
            n: layout.rows,
            top_n: top_n.min(MAX_TOP),
            rows_ptr: m.at::<u32>(layout.sample_rows()),
            positions_ptr: m.at::<u32>(layout.sample_pos()),
            step: self.protocol.next_step(),
            timed,
            bias,
            verify: Some(verify),
        };
        self.record_launch(slot, state).map_err(ExecError::Fatal)
    }
}
