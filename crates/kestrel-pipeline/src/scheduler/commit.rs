//! Completing a launched step: sampling (with the masks its constrained
//! members need, built by [`crate::masks::MaskBuilder`]) and the commit,
//! which owns the only wait on the device, consumes tokens (and the
//! values decoded beside them) into skills and the sequence, finalizes, and releases or evicts what no step references any more.

use super::{Fatal, Scheduler, SchedulerFault};
use crate::executor::{Executor, SlotId};
use crate::phase::Lifecycle;
use crate::skill::{CommittedToken, Outcome, Verdict};
use crate::state::{LaunchHandle, PendingCommit};
use crate::{Cause, FinishReason};

impl<P> Scheduler<P> {
    /// `plan_needs_mask`: any non-finalized member of `slot`'s step is constrained.
    pub fn needs_mask(&self, slot: SlotId) -> bool {
        let step = &self.slots[slot];
        step.samples && step.rows.iter().any(|&i| self.seq(i).needs_mask())
    }

    /// `compute_mask` then `finalize_sampling`: finalized rows are unconstrained.
    pub fn finalize_sampling<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        handle: LaunchHandle,
    ) -> Result<PendingCommit, Fatal> {
        let masks = self.masks.build(&mut self.seqs, &self.slots[handle.slot]);
        if masks.is_some() {
            self.stats.masked_steps += 1;
        }
        // After a forward was dispatched every sampling error is device-side: fatal.
        exec.finalize_sampling(handle.slot, masks.as_ref())
            .map_err(|e| Fatal(Cause::new(e)))?;
        Ok(PendingCommit {
            kind: handle.kind,
            slot: handle.slot,
            step: handle.step,
        })
    }

    /// `commit_step`: wait for the step's copy, consume tokens, finalize and
    /// release. Owns the only `wait` (callers never wait directly).
    pub fn commit_step<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        pending: PendingCommit,
    ) -> Result<(), Fatal> {
        let slot = pending.slot;
        let outs = exec.wait_step(slot).map_err(|e| Fatal(Cause::new(e)))?;
        let step = &self.slots[slot];
        let expected = if step.samples { step.rows.len() } else { 0 };
        let well_formed = outs.num_rows() == expected
            && (outs.row_indptr.is_empty()
                || (outs.row_indptr[0] == 0
                    && outs.row_indptr.windows(2).all(|w| w[0] < w[1])
                    && outs.row_indptr[expected] as usize == outs.tokens.len()))
            && (outs.values.is_empty() || outs.values.len() == outs.tokens.len());
        if !well_formed {
            return Err(SchedulerFault::MalformedOutputs {
                step: pending.step,
                rows: outs.num_rows(),
                tokens: outs.tokens.len(),
                values: outs.values.len(),
                expected,
            }
            .into());
        }
        let step = std::mem::take(&mut self.slots[slot]);
        self.to_release.clear();
        for (r, &i) in step.rows.iter().enumerate() {
            self.transition(i, Lifecycle::commit)?;
            let seq = self.seqs[i as usize].as_mut().expect("live sequence index");
            // A prefill chunk short of its prompt's end (`!samples`) wrote
            // KV only. A preempting sequence's tokens count like any other.
            if seq.phase().is_finalized() {
                self.stats.zombie_rows += 1;
            } else if step.samples {
                // A row that verified drafts brings the accepted ones and
                // the token after them; a stop among them drops the rest.
                let range = outs.row_range(r);
                let accepted = range.len() - 1;
                let mut reason = None;
                for j in range {
                    let values = outs.values_of(j);
                    let token = CommittedToken {
                        token: outs.tokens[j],
                        logprob: outs.logprobs.map(|l| l[j]),
                        top_logprobs: outs.top(j),
                        coord: values.coord,
                        size: values.size,
                    };
                    seq.push_committed(token.token, values);
                    self.stats.committed_tokens += 1;
                    reason = match seq.skill.consume(&token) {
                        Verdict::Stop(reason) => Some(reason),
                        Verdict::Continue => seq.at_length_cap().then_some(FinishReason::Length),
                    };
                    if reason.is_some() {
                        break;
                    }
                }
                let drafted = step.drafts_of(r).len();
                if drafted > 0 {
                    let max_draft = seq.speculate.map_or(0, |s| s.max_draft);
                    seq.draft.tried(drafted, accepted, max_draft);
                    self.stats.accepted_drafts += accepted as u64;
                }
                if let Some(reason) = reason {
                    self.finalize(i, Outcome::Finished(reason))?;
                }
            }
            if self.seq(i).inflight_refs() == 0 {
                self.to_release.push(i);
            }
        }
        self.slots[slot] = step;
        let release = std::mem::take(&mut self.to_release);
        for &i in &release {
            self.release_if_done(exec, i)?;
            if self.seqs[i as usize].is_some() {
                self.evict_if_idle(exec, i)?;
            }
        }
        self.to_release = release;
        Ok(())
    }
}
