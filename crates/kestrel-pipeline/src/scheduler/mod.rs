//! `Scheduler`: the registry of accepted sequences (waiting, running,
//! preempted), and the places where their phases change.
//!
//! Every accepted request is a `Sequence` here from submission to release;
//! its [`Phase`] says where it is, and the three lists (`waiting`,
//! `running`, `preempted`) order the sequences of the matching phases. The
//! work is split by what it does: `decode` and `prefill` are pure
//! planners (choose a step, then apply it: launch, the only place refcounts
//! grow), `commit` samples and commits a step (the only place refcounts
//! shrink), `check` verifies what the types cannot say. A launch the
//! executor refuses is handled once (`Scheduler::launch_refused`).
//! Steady-state steps do not allocate: plans, row lists, drafts and masks
//! reuse buffers.

mod check;
mod commit;
mod decode;
mod fault;
mod prefill;

use std::collections::{HashMap, VecDeque};

pub use check::InvariantError;
pub use decode::StepPlan;
pub(crate) use fault::Fatal;
pub use fault::SchedulerFault;
pub(crate) use prefill::PrefillBudget;

use crate::executor::{ExecError, Executor};
use crate::masks::MaskBuilder;
use crate::phase::{Lifecycle, Phase, PhaseError};
use crate::sequence::{Request, Sequence};
use crate::skill::{FailureKind, Outcome};
use crate::{Cause, FinishReason, RequestId, TokenId};

/// Handle to an accepted sequence inside the scheduler.
pub type SeqIdx = u32;

/// Counters for benchmarks and metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PipelineStats {
    pub prefill_steps: u64,
    pub decode_steps: u64,
    /// Decode rows launched (sum of batch sizes).
    pub decode_rows: u64,
    pub committed_tokens: u64,
    /// Rows committed for sequences already finalized (outputs discarded).
    pub zombie_rows: u64,
    pub finished: u64,
    pub failed: u64,
    /// Steps whose sampling waited for a mask.
    pub masked_steps: u64,
    /// Sequences preempted for KV pages (each is prefilled again later).
    pub preemptions: u64,
    /// Draft tokens sent for verification, and how many were accepted.
    pub draft_tokens: u64,
    pub accepted_drafts: u64,
}

/// The step one slot holds, from its launch to its commit (I6: the slot is
/// not launched into again before then).
#[derive(Debug, Clone, Default)]
pub(crate) struct SlotStep {
    /// Its members, in row order (the PendingCommit's sequences).
    pub rows: Vec<SeqIdx>,
    /// Whether it samples a token per member: false only for a prefill
    /// chunk short of its prompt's end (no row comes back).
    pub samples: bool,
    /// The drafts it verifies, compacted as the executor takes them
    /// (offsets per member, tokens; both empty: none), for its masks.
    pub draft_indptr: Vec<u32>,
    pub drafts: Vec<TokenId>,
}

impl SlotStep {
    /// Member `r`'s drafts.
    pub fn drafts_of(&self, r: usize) -> &[TokenId] {
        match self.draft_indptr.is_empty() {
            true => &[],
            false => &self.drafts[self.draft_indptr[r] as usize..self.draft_indptr[r + 1] as usize],
        }
    }

    /// A prefill step of `rows` (no drafts).
    fn prefill(&mut self, rows: &[SeqIdx], samples: bool) {
        self.rows.clear();
        self.rows.extend_from_slice(rows);
        self.samples = samples;
        self.draft_indptr.clear();
        self.drafts.clear();
    }
}

pub(crate) struct Scheduler<P> {
    seqs: Vec<Option<Sequence<P>>>,
    free_idx: Vec<SeqIdx>,
    by_id: HashMap<RequestId, SeqIdx>,
    /// `Waiting`, in arrival order.
    waiting: VecDeque<SeqIdx>,
    /// `Prefilling`, `Decoding` or `Drafting`, in arrival order (oldest first).
    running: Vec<SeqIdx>,
    /// `Preempting` or `Preempted`, in arrival order: they are prefilled
    /// again, oldest first, before any waiting request.
    preempted: Vec<SeqIdx>,
    /// Sequences holding KV (zombies and preempting ones included).
    num_kv: usize,
    next_arrival: u64,
    slots: Vec<SlotStep>,
    row_ids: Vec<RequestId>,
    to_release: Vec<SeqIdx>,
    pub masks: MaskBuilder,
    pub stats: PipelineStats,
}

impl<P> Scheduler<P> {
    pub fn new(num_slots: usize, vocab_size: usize) -> Self {
        Self {
            seqs: Vec::new(),
            free_idx: Vec::new(),
            by_id: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            preempted: Vec::new(),
            num_kv: 0,
            next_arrival: 0,
            slots: vec![SlotStep::default(); num_slots],
            row_ids: Vec::new(),
            to_release: Vec::new(),
            masks: MaskBuilder::new(vocab_size),
            stats: PipelineStats::default(),
        }
    }

    pub fn contains(&self, id: RequestId) -> bool {
        self.by_id.contains_key(&id)
    }

    /// Accept a request (capped at `max_len` tokens): it waits for prefill.
    /// A fork (`fork_of`: another sample of its request, with the same
    /// prompt) waits until that one's prompt has been launched to its end.
    pub fn enqueue(&mut self, req: Request<P>, max_len: usize, fork_of: Option<RequestId>) {
        let seq = Sequence::waiting(req, self.next_arrival, max_len, fork_of);
        self.next_arrival += 1;
        let id = seq.id;
        let idx = match self.free_idx.pop() {
            Some(i) => {
                self.seqs[i as usize] = Some(seq);
                i
            }
            None => {
                self.seqs.push(Some(seq));
                (self.seqs.len() - 1) as SeqIdx
            }
        };
        self.by_id.insert(id, idx);
        self.waiting.push_back(idx);
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Admitted sequences not yet released, preempted ones included.
    pub fn num_live(&self) -> usize {
        self.seqs.len() - self.free_idx.len() - self.waiting.len()
    }

    /// Sequences holding KV (zombies and preempting ones included).
    pub fn num_admitted(&self) -> usize {
        self.num_kv
    }

    /// Preempted sequences (holding KV or not) waiting to be prefilled again.
    pub fn num_preempted(&self) -> usize {
        self.preempted.len()
    }

    fn seq(&self, idx: SeqIdx) -> &Sequence<P> {
        self.seqs[idx as usize]
            .as_ref()
            .expect("live sequence index")
    }

    fn seq_mut(&mut self, idx: SeqIdx) -> &mut Sequence<P> {
        self.seqs[idx as usize]
            .as_mut()
            .expect("live sequence index")
    }

    /// Apply a phase transition to sequence `idx`; a refusal is a
    /// scheduler bug, and fatal.
    fn transition<T>(
        &mut self,
        idx: SeqIdx,
        f: impl FnOnce(&mut Lifecycle) -> Result<T, PhaseError>,
    ) -> Result<T, Fatal> {
        let seq = self.seq_mut(idx);
        f(&mut seq.life).map_err(|source| Fatal::phase(seq.id, source))
    }

    /// A launch of `rows` the executor refused: before dispatch, exactly
    /// these rows fail (the engine keeps serving); after, the engine does.
    fn launch_refused<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        rows: &[SeqIdx],
        e: ExecError<E::Error>,
    ) -> Result<(), Fatal> {
        match e {
            ExecError::PreDispatch(e) => {
                let why = Cause::new(e);
                for &i in rows {
                    let outcome = Outcome::Failed(FailureKind::StepFailed, why.clone());
                    self.resolve(exec, i, outcome)?;
                }
                Ok(())
            }
            ExecError::Fatal(e) => Err(Fatal(Cause::new(e))),
        }
    }

    /// Finalize `idx` with `outcome` and release it if no step references it.
    fn resolve<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        idx: SeqIdx,
        outcome: Outcome,
    ) -> Result<(), Fatal> {
        self.finalize(idx, outcome)?;
        self.release_if_done(exec, idx)
    }

    /// Finalize and resolve the request (once); it keeps whatever KV it holds.
    fn finalize(&mut self, idx: SeqIdx, outcome: Outcome) -> Result<(), Fatal> {
        let before = self.seq(idx).phase();
        if before.is_finalized() {
            return Ok(());
        }
        self.transition(idx, Lifecycle::finalize)?;
        let failed = matches!(outcome, Outcome::Failed(..));
        self.seq_mut(idx).skill.finish(outcome);
        if failed {
            self.stats.failed += 1;
        } else {
            self.stats.finished += 1;
        }
        match before {
            Phase::Waiting => self.waiting.retain(|&x| x != idx),
            p if p.is_preempted() => self.preempted.retain(|&x| x != idx),
            _ => self.running.retain(|&x| x != idx),
        }
        Ok(())
    }

    /// Release a finalized sequence's KV (if it holds any) once no step
    /// references it, and forget it.
    fn release_if_done<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        idx: SeqIdx,
    ) -> Result<(), Fatal> {
        let seq = self.seq(idx);
        if !(matches!(seq.phase(), Phase::Finalized { .. }) && seq.inflight_refs() == 0) {
            return Ok(());
        }
        let id = seq.id;
        if self.transition(idx, Lifecycle::release)? {
            exec.release(id);
            self.num_kv -= 1;
        }
        self.seqs[idx as usize] = None;
        self.free_idx.push(idx);
        self.by_id.remove(&id);
        Ok(())
    }

    /// Cancel a request: it finalizes now and is released once no in-flight
    /// step references it. Unknown: false.
    pub fn abort<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        id: RequestId,
    ) -> Result<bool, Fatal> {
        let Some(&idx) = self.by_id.get(&id) else {
            return Ok(false);
        };
        self.resolve(exec, idx, Outcome::Finished(FinishReason::Abort))?;
        Ok(true)
    }

    /// Engine-fatal: resolve every accepted request with an error and forget
    /// all state. The caller releases the executor's KV.
    pub fn fail_all(&mut self, why: &Cause) {
        for seq in self.seqs.iter_mut().flatten() {
            if !seq.phase().is_finalized() {
                seq.skill
                    .finish(Outcome::Failed(FailureKind::EngineFatal, why.clone()));
                self.stats.failed += 1;
            }
        }
        self.seqs.clear();
        self.free_idx.clear();
        self.by_id.clear();
        self.waiting.clear();
        self.running.clear();
        self.preempted.clear();
        self.num_kv = 0;
        for slot in &mut self.slots {
            slot.rows.clear();
        }
    }
}
