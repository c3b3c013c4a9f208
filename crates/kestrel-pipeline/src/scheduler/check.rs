//! What the types cannot say, checked after every loop iteration in tests
//! and debug builds: each sequence's `inflight_refs` equals the in-flight
//! steps that hold it (I4), its list matches its phase, counts and caps
//! hold, and the lists keep arrival order. [`crate::phase::Lifecycle`]
//! already holds the rest (at most two steps, a drafting sequence in one, a
//! preempted one in none).

use super::{Scheduler, SeqIdx};
use crate::executor::SlotId;
use crate::phase::Phase;
use crate::RequestId;

/// A broken invariant: always a bug in the pipeline (or its executor).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvariantError {
    /// The slot state machine's own check failed.
    #[error("slot protocol")]
    Slots(#[from] crate::state::ProtocolViolation),
    #[error("request {id}: inflight_refs {refs} but in {steps} in-flight steps")]
    RefsMismatch { id: RequestId, refs: u8, steps: u8 },
    #[error("released sequence {idx} is still in an in-flight step")]
    ReleasedInFlight { idx: SeqIdx },
    #[error("request {id} in phase {phase:?} but waiting={waiting} running={running} preempted={preempted}")]
    Membership {
        id: RequestId,
        phase: Phase,
        waiting: bool,
        running: bool,
        preempted: bool,
    },
    #[error("request {id}: in phase {phase:?} and unreferenced")]
    Unreferenced { id: RequestId, phase: Phase },
    #[error(
        "request {id}: {committed} tokens committed (max {max_new}), {len} in all (max {max_len})"
    )]
    OverCap {
        id: RequestId,
        committed: u32,
        max_new: u32,
        len: usize,
        max_len: usize,
    },
    #[error("{0} prompts part-way through a chunked prefill (one at most)")]
    ManyPrefilling(usize),
    #[error("{actual} sequences hold KV but {counted} are counted")]
    KvCount { actual: usize, counted: usize },
    #[error("waiting, running or preempted sequences out of arrival order")]
    ArrivalOrder,
    #[error("executor holds {allocated} KV rows but {admitted} sequences are admitted")]
    KvRows { allocated: usize, admitted: usize },
    #[error("{admitted} rows allocated over the limit {limit}")]
    OverRows { admitted: usize, limit: usize },
}

impl<P> Scheduler<P> {
    /// The checks against the in-flight steps' slots.
    pub fn check(&self, inflight_slots: &[SlotId]) -> Result<(), InvariantError> {
        let mut counts = vec![0u8; self.seqs.len()];
        for &slot in inflight_slots {
            for &i in &self.slots[slot].rows {
                counts[i as usize] += 1;
            }
        }
        let mut prefilling = 0;
        for (i, s) in self.seqs.iter().enumerate() {
            let idx = i as SeqIdx;
            let Some(seq) = s else {
                if counts[i] != 0 {
                    return Err(InvariantError::ReleasedInFlight { idx });
                }
                continue;
            };
            let (id, phase, refs) = (seq.id, seq.phase(), seq.inflight_refs());
            if refs != counts[i] {
                return Err(InvariantError::RefsMismatch {
                    id,
                    refs,
                    steps: counts[i],
                });
            }
            let waiting = self.waiting.contains(&idx);
            let running = self.running.contains(&idx);
            let preempted = self.preempted.contains(&idx);
            if waiting != (phase == Phase::Waiting)
                || running != phase.is_running()
                || preempted != phase.is_preempted()
            {
                return Err(InvariantError::Membership {
                    id,
                    phase,
                    waiting,
                    running,
                    preempted,
                });
            }
            // Both give their KV (or their row) back as their last step commits.
            if refs == 0 && matches!(phase, Phase::Preempting | Phase::Finalized { .. }) {
                return Err(InvariantError::Unreferenced { id, phase });
            }
            if seq.committed() > seq.max_new_tokens || seq.tokens.len() > seq.max_len {
                return Err(InvariantError::OverCap {
                    id,
                    committed: seq.committed(),
                    max_new: seq.max_new_tokens,
                    len: seq.tokens.len(),
                    max_len: seq.max_len,
                });
            }
            prefilling += usize::from(matches!(phase, Phase::Prefilling { .. }));
        }
        if prefilling > 1 {
            return Err(InvariantError::ManyPrefilling(prefilling));
        }
        let actual = self
            .seqs
            .iter()
            .flatten()
            .filter(|s| s.phase().holds_kv())
            .count();
        if actual != self.num_kv {
            return Err(InvariantError::KvCount {
                actual,
                counted: self.num_kv,
            });
        }
        let in_order = |list: &mut dyn Iterator<Item = &SeqIdx>| {
            let arrivals: Vec<u64> = list.map(|&i| self.seq(i).arrival).collect();
            arrivals.windows(2).all(|w| w[0] < w[1])
        };
        if !in_order(&mut self.waiting.iter())
            || !in_order(&mut self.running.iter())
            || !in_order(&mut self.preempted.iter())
        {
            return Err(InvariantError::ArrivalOrder);
        }
        Ok(())
    }
}
