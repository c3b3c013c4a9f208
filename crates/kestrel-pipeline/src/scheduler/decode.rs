//! Decode steps: the pure selector ([`StepPlan`]), making KV room for a
//! plan (preempting the youngest running sequence when pages run out), and
//! the launch that applies it.
//!
//! A speculating sequence drafts from its committed tokens, so it joins a
//! step only with none in flight (or, backing off after fruitless tries, as
//! a plain overlapped row).

use std::ops::Range;

use super::{Fatal, Scheduler, SchedulerFault, SeqIdx};
use crate::executor::{Drafts, Executor, SlotId};
use crate::phase::{Lifecycle, Phase};
use crate::skill::{FailureKind, Outcome};
use crate::{Cause, TokenId};

/// The sequences chosen for one decode step (a pure selection).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StepPlan {
    pub sequences: Vec<SeqIdx>,
    /// Per sequence: `Some(drafts)` when it tried to draft (the range of
    /// `draft_tokens` it proposed, maybe empty), `None` otherwise.
    drafts: Vec<Option<Range<u32>>>,
    draft_tokens: Vec<TokenId>,
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }
    pub fn len(&self) -> usize {
        self.sequences.len()
    }

    /// Draft tokens of member `k`.
    pub fn drafts(&self, k: usize) -> &[TokenId] {
        match &self.drafts[k] {
            Some(r) => &self.draft_tokens[r.start as usize..r.end as usize],
            None => &[],
        }
    }

    fn clear(&mut self) {
        self.sequences.clear();
        self.drafts.clear();
        self.draft_tokens.clear();
    }
}

impl<P> Scheduler<P> {
    /// Pure selector: the running sequences that may join the next decode
    /// step ([`crate::sequence::Sequence::can_dispatch`]), in arrival
    /// order, with their drafts (at most `max_drafts` in all). A
    /// speculating sequence with no step in flight drafts from its tokens;
    /// with one in flight it waits for its tokens unless it is backing off
    /// (then it decodes overlapped). Never mutates.
    pub fn schedule_decode_step(&self, plan: &mut StepPlan, max_rows: usize, max_drafts: usize) {
        plan.clear();
        let mut budget = max_drafts;
        for &i in &self.running {
            if plan.sequences.len() == max_rows {
                break;
            }
            let seq = self.seq(i);
            if !seq.can_dispatch() {
                continue;
            }
            let mut tried = None;
            if let (Some(spec), true) = (&seq.speculate, max_drafts > 0) {
                let room = seq
                    .draft_room()
                    .min(budget)
                    .min(seq.draft.len(spec.max_draft));
                if seq.inflight_refs() == 0 {
                    // No room (the step's budget or the sequence's caps):
                    // a plain row, not a try.
                    if room > 0 {
                        let start = plan.draft_tokens.len() as u32;
                        budget -= spec.propose(&seq.tokens, room, &mut plan.draft_tokens);
                        tried = Some(start..plan.draft_tokens.len() as u32);
                    }
                } else if seq.draft.wait == 0 && room > 0 {
                    continue;
                }
            }
            plan.sequences.push(i);
            plan.drafts.push(tried);
        }
    }

    /// Whether `schedule_decode_step` would select anything.
    pub fn any_dispatchable(&self) -> bool {
        self.running.iter().any(|&i| self.seq(i).can_dispatch())
    }

    /// Launch a decode forward for `plan` into `slot` (apply): increments
    /// its members' refs. `false` when the executor refused it before
    /// dispatch (its members failed). The caller books the launch in its
    /// `PipelineState`, which numbers the step.
    pub fn launch_decode<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        plan: &StepPlan,
        slot: SlotId,
    ) -> Result<bool, Fatal> {
        self.row_ids.clear();
        for &i in &plan.sequences {
            let id = self.seq(i).id;
            self.row_ids.push(id);
        }
        // Compacted into the slot's buffers: the slot is free (I6), and a
        // launch refused before dispatch leaves it free for the next.
        let step = &mut self.slots[slot];
        step.draft_indptr.clear();
        step.drafts.clear();
        if !plan.draft_tokens.is_empty() {
            step.draft_indptr.push(0);
            for k in 0..plan.len() {
                step.drafts.extend_from_slice(plan.drafts(k));
                step.draft_indptr.push(step.drafts.len() as u32);
            }
        }
        let drafts = Drafts {
            indptr: &step.draft_indptr,
            tokens: &step.drafts,
        };
        if let Err(e) = exec.launch_decode(slot, &self.row_ids, drafts) {
            self.launch_refused(exec, &plan.sequences, e)?;
            return Ok(false);
        }
        let step = &mut self.slots[slot];
        step.rows.clear();
        step.rows.extend_from_slice(&plan.sequences);
        step.samples = true;
        for (k, &i) in plan.sequences.iter().enumerate() {
            let n = plan.drafts(k).len();
            self.transition(i, |l| l.launch_decode(n))?;
            let seq = self.seq_mut(i);
            let max_draft = seq.speculate.map_or(0, |s| s.max_draft);
            if n > 0 {
                self.stats.draft_tokens += n as u64;
            } else if plan.drafts[k].is_some() {
                seq.draft.tried(0, 0, max_draft);
            } else if seq.speculate.is_some() {
                seq.draft.wait = seq.draft.wait.saturating_sub(1);
            }
        }
        self.stats.decode_steps += 1;
        self.stats.decode_rows += plan.sequences.len() as u64;
        Ok(true)
    }

    /// Grow the KV of each sequence in `plan` (oldest first) to hold the
    /// token its decode step writes. When the cache is short, the youngest
    /// running sequence is preempted ([`Scheduler::preempt`]) and the growth
    /// retried; while pages are already on their way back (a zombie or a
    /// preempting sequence still in an in-flight step), a short sequence
    /// sits this step out instead, so no more is preempted than needed. A
    /// sequence that cannot grow with every other one gone fails alone
    /// (`could_ever_fit` should have refused it). Returns whether any
    /// sequence was preempted or failed.
    pub fn make_room<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        plan: &mut StepPlan,
    ) -> Result<bool, Fatal> {
        let mut changed = false;
        let mut keep = 0;
        for k in 0..plan.sequences.len() {
            let i = plan.sequences[k];
            let drafts = plan.drafts(k).len();
            loop {
                let seq = self.seq(i);
                // A victim of an earlier member's growth.
                if !seq.phase().is_running() {
                    break;
                }
                if exec.grow(seq.id, seq.budgeted_len() + drafts) {
                    plan.sequences[keep] = i;
                    plan.drafts.swap(keep, k);
                    keep += 1;
                    break;
                }
                if self.pages_returning() {
                    break;
                }
                changed = true;
                let victim = *self.running.last().expect("`i` is running");
                if victim == i && self.running.len() == 1 {
                    let why = SchedulerFault::CannotFitAlone {
                        id: seq.id,
                        tokens: seq.budgeted_len(),
                    };
                    let outcome = Outcome::Failed(FailureKind::Rejected, Cause::new(why));
                    self.resolve(exec, i, outcome)?;
                    break;
                }
                self.preempt(exec, victim)?;
            }
        }
        plan.sequences.truncate(keep);
        plan.drafts.truncate(keep);
        Ok(changed)
    }

    /// Whether KV pages will come back when an in-flight step commits: a
    /// zombie's, or a preempting sequence's.
    fn pages_returning(&self) -> bool {
        self.seqs.iter().flatten().any(|s| {
            matches!(s.phase(), Phase::Preempting | Phase::Finalized { .. })
                && s.inflight_refs() > 0
        })
    }

    /// Preempt sequence `idx`: it leaves `running` (and a chunked prefill),
    /// keeps the tokens it has committed and those its in-flight steps will
    /// commit, and gives its KV back once no in-flight step references it.
    /// It is prefilled again with all its tokens before any new request is
    /// admitted.
    fn preempt<E: Executor<Params = P>>(&mut self, exec: &mut E, idx: SeqIdx) -> Result<(), Fatal> {
        self.transition(idx, Lifecycle::preempt)?;
        self.running.retain(|&x| x != idx);
        let arrival = self.seq(idx).arrival;
        let at = self
            .preempted
            .partition_point(|&x| self.seq(x).arrival < arrival);
        self.preempted.insert(at, idx);
        self.stats.preemptions += 1;
        self.evict_if_idle(exec, idx)
    }

    /// Give a preempting sequence's KV back once no in-flight step uses it.
    pub(super) fn evict_if_idle<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        idx: SeqIdx,
    ) -> Result<(), Fatal> {
        let seq = self.seq(idx);
        if seq.phase() != Phase::Preempting || seq.inflight_refs() > 0 {
            return Ok(());
        }
        exec.preempt(seq.id, &seq.tokens);
        self.transition(idx, Lifecycle::evict)?;
        self.num_kv -= 1;
        Ok(())
    }
}
