//! Sampling a launched step ([`Executor::finalize_sampling`]): the
//! grammar masks and the step's sampling parameters and logit biases to
//! the device, `sample_rows` over the step's logits (a verifying step's
//! rows on scratch penalty counts, then `accept_drafts`), and the copy of
//! the sampled tokens, logprobs and top-n into the slot's render buffer on
//! the copy stream after the step-done event (I3).

use kestrel_pipeline::{ExecError, MaskBatch, SlotId, StateError, TokenMask};

use super::backend::{AcceptDrafts, DevMem, Device, DraftCounts, HostMem, SampleRows, Stream};
use super::{fatal, Runtime};
use crate::CudaError;

impl<D: Device> Runtime<D> {
    pub(super) fn sample(
        &mut self,
        slot: SlotId,
        masks: Option<&MaskBatch<'_>>,
    ) -> Result<(), ExecError<CudaError>> {
        self.protocol.check_sample(slot).map_err(fatal)?;
        self.dev.d.bind().map_err(fatal)?;
        let vocab = self.dev.cfg.vocab_size;
        let s = &mut self.slots[slot];
        let Some(state) = s.state.as_ref() else {
            return Err(fatal(StateError::SlotBusy(slot)));
        };
        let (n, top_n, timed) = (state.n, state.top_n, state.timed);
        let (bias_indptr, bias) = if state.bias {
            (s.bias_dev.ptr(), s.bias_dev.at::<u32>(n + 1))
        } else {
            (0, 0)
        };
        let d = &self.dev.d;
        if timed {
            d.record(&s.timing.sample_start, Stream::Compute)
                .map_err(ExecError::Fatal)?;
        }
        // The mask goes H2D on the compute stream right before sampling (a
        // step of prefill chunks that end no prompt samples nothing).
        let (mask_flags, mask_words, wpr) = match masks.filter(|_| n > 0) {
            Some(m)
                if m.words_per_row == TokenMask::words_for(vocab)
                    && m.words.len() >= n * m.words_per_row
                    && m.constrained.len() >= n =>
            {
                let host = s.mask_host.as_mut_slice();
                for (f, &c) in host[..n].iter_mut().zip(m.constrained) {
                    *f = u32::from(c);
                }
                let w = n * m.words_per_row;
                host[n..n + w].copy_from_slice(&m.words[..w]);
                // SAFETY: mask_dev, like mask_host, holds flags + words for
                // max_batch rows, so the n + w copied words fit; the host
                // source is not rewritten before this slot's commit (I6).
                unsafe { d.htod(s.mask_dev.ptr(), &host[..n + w]) }.map_err(ExecError::Fatal)?;
                (s.mask_dev.ptr(), s.mask_dev.at::<u32>(n), m.words_per_row)
            }
            Some(m) => {
                return Err(ExecError::Fatal(CudaError::Config(format!(
                    "mask of {} words per row ({} words, {} row flags) for {n} rows \
                     of a vocabulary of {vocab}",
                    m.words_per_row,
                    m.words.len(),
                    m.constrained.len()
                ))))
            }
            None => (0, 0, 0),
        };
        // A verifying step samples each row on scratch counts that include
        // the drafts before it, then accepts (see `kernels/verify.cu`).
        let verify = state.verify;
        let (counts, pending) = match verify {
            Some(v) => {
                self.dev
                    .d
                    .draft_counts(DraftCounts {
                        counts: self.dev.counts.ptr(),
                        kv_rows: v.kv_rows,
                        qo: v.qo,
                        tokens: v.tokens,
                        scratch: self.dev.draft_counts.ptr(),
                        vocab,
                        max_rows: v.max_rows,
                        n: v.members,
                    })
                    .map_err(fatal)?;
                (self.dev.draft_counts.ptr(), self.dev.draft_pending.ptr())
            }
            None => (self.dev.counts.ptr(), self.dev.pending.ptr()),
        };
        // Sample `n` rows (see `kernels/sample.cu`).
        let a = SampleRows {
            n,
            top_n,
            logits: s.logits.ptr(),
            vocab,
            counts,
            pending,
            mask_words,
            mask_flags,
            words_per_row: wpr,
            params: s.params_dev.ptr(),
            rows: state.rows_ptr,
            positions: state.positions_ptr,
            out_tokens: s.out_tokens.ptr(),
            out_logprobs: s.out_logprobs.ptr(),
            out_top_ids: s.out_top_ids.ptr(),
            out_top_lps: s.out_top_lps.ptr(),
            bias_indptr,
            bias,
        };
        if n > 0 {
            self.dev.d.sample_rows(a).map_err(fatal)?;
        }
        // The spatial stage (Moondream): each row's value for its sampled
        // id, before step-done; a verifying step's pending values follow
        // its accepted rows (below).
        let spatial = n > 0 && self.dev.spatial_ids().is_some();
        if spatial {
            let rows = if verify.is_some() { 0 } else { state.rows_ptr };
            self.dev
                .spatial_values(s.out_tokens.ptr(), rows, s.out_values.ptr(), n)
                .map_err(fatal)?;
        }
        if let Some(v) = verify {
            self.dev
                .d
                .accept_drafts(AcceptDrafts {
                    qo: v.qo,
                    tokens: v.tokens,
                    sampled: s.out_tokens.ptr(),
                    kv_rows: v.kv_rows,
                    counts: self.dev.counts.ptr(),
                    pending: self.dev.pending.ptr(),
                    accepted: s.out_accepted.ptr(),
                    vocab,
                    n: v.members,
                })
                .map_err(fatal)?;
            if spatial {
                self.dev
                    .accept_values(v, s.out_accepted.ptr(), s.out_values.ptr())
                    .map_err(fatal)?;
            }
        }
        let (s, d) = (&self.slots[slot], &self.dev.d);
        if timed {
            d.record(&s.timing.sample_end, Stream::Compute)
                .map_err(ExecError::Fatal)?;
        }
        // Step-done: after this step's last device write (I3).
        d.record(&s.step_done, Stream::Compute)
            .map_err(ExecError::Fatal)?;
        d.copy_waits(&s.step_done).map_err(ExecError::Fatal)?;
        let r = &mut self.render[slot];
        if n > 0 {
            // SAFETY: the copy stream waits on exactly this step's step-done
            // event, so the staging buffers hold its outputs; the pinned
            // destinations are this slot's and are read only after copy_done.
            unsafe {
                d.dtoh(&mut r.tokens.as_mut_slice()[..n], s.out_tokens.ptr())
                    .map_err(ExecError::Fatal)?;
                d.dtoh(&mut r.logprobs.as_mut_slice()[..n], s.out_logprobs.ptr())
                    .map_err(ExecError::Fatal)?;
                if top_n > 0 {
                    let k = n * top_n;
                    d.dtoh(&mut r.top_ids.as_mut_slice()[..k], s.out_top_ids.ptr())
                        .map_err(ExecError::Fatal)?;
                    d.dtoh(&mut r.top_lps.as_mut_slice()[..k], s.out_top_lps.ptr())
                        .map_err(ExecError::Fatal)?;
                }
                if spatial {
                    d.dtoh(&mut r.values.as_mut_slice()[..n * 3], s.out_values.ptr())
                        .map_err(ExecError::Fatal)?;
                }
                if let Some(v) = verify {
                    let acc = &mut r.accepted.as_mut_slice()[..v.members];
                    d.dtoh(acc, s.out_accepted.ptr())
                        .map_err(ExecError::Fatal)?;
                }
            }
        }
        d.record(&r.copy_done, Stream::Copy)
            .map_err(ExecError::Fatal)?;
        self.protocol.sample(slot).map_err(fatal)?;
        Ok(())
    }
}
