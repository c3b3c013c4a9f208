//! `PipelineState`: the canonical queue/slot state machine of section 4.6.
//!
//! It owns slot occupancy (a bitmask), the FIFO `batch_queue` of sampled
//! steps, at most one `launch_handle` (forward dispatched, not yet sampled)
//! and the step being committed. Two-phase completion (`pop_oldest` then
//! `on_step_completed`) keeps a slot busy until its commit is done (I6). It
//! never touches sequences or refcounts (I4 belongs to the scheduler).
//! Every illegal transition is a typed [`StateError`], never a panic.

use std::collections::VecDeque;

use crate::executor::SlotId;

/// What a launch computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StepKind {
    /// New sequences' prompts; sampling yields each one's first token.
    Prefill,
    /// One token for each running sequence.
    Decode,
}

/// A forward dispatched into a slot whose sampling is not yet launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchHandle {
    pub kind: StepKind,
    pub slot: SlotId,
    /// Monotonic step number (launch order).
    pub step: u64,
}

/// A sampled step whose outputs are (being) copied to host, awaiting commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingCommit {
    pub kind: StepKind,
    pub slot: SlotId,
    pub step: u64,
}

/// An illegal pipeline transition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    #[error("slot count {0} is outside 1..=32")]
    BadSlotCount(usize),
    #[error("slot {slot} does not exist (pipeline has {num_slots} slots)")]
    NoSuchSlot { slot: SlotId, num_slots: usize },
    #[error("launch into slot {0}, which is still in use")]
    SlotBusy(SlotId),
    #[error("launch while step {0} is dispatched but not yet sampled")]
    LaunchInFlight(u64),
    #[error("pending commit without a launched forward")]
    NoLaunch,
    #[error("pending commit for slot {got} but the launched forward is on slot {expected}")]
    SlotMismatch { expected: SlotId, got: SlotId },
    #[error("pending commit for step {got} but the launched forward is step {expected}")]
    StepMismatch { expected: u64, got: u64 },
    #[error("step {0} is already being committed; complete it first")]
    CommitInProgress(u64),
    #[error("step completed twice, or completed without pop_oldest")]
    NotCommitting,
}

/// Slot and queue bookkeeping for the ping-pong pipeline.
#[derive(Debug, Clone)]
pub struct PipelineState {
    num_slots: usize,
    busy: u32,
    /// Newest at the front, oldest at the back (the doc's appendleft/pop).
    batch_queue: VecDeque<PendingCommit>,
    launch_handle: Option<LaunchHandle>,
    committing: Option<PendingCommit>,
}

impl PipelineState {
    pub fn new(num_slots: usize) -> Result<Self, StateError> {
        if !(1..=32).contains(&num_slots) {
            return Err(StateError::BadSlotCount(num_slots));
        }
        Ok(Self {
            num_slots,
            busy: 0,
            batch_queue: VecDeque::with_capacity(num_slots),
            launch_handle: None,
            committing: None,
        })
    }

    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Lowest-numbered slot not launched, queued or committing.
    pub fn free_slot_id(&self) -> Option<SlotId> {
        let free = !self.busy & low_bits(self.num_slots);
        (free != 0).then(|| free.trailing_zeros() as SlotId)
    }

    pub fn is_slot_busy(&self, slot: SlotId) -> bool {
        slot < self.num_slots && self.busy & (1 << slot) != 0
    }

    pub fn launch_handle(&self) -> Option<&LaunchHandle> {
        self.launch_handle.as_ref()
    }

    /// Sampled steps awaiting commit, oldest first.
    pub fn queued(&self) -> impl Iterator<Item = &PendingCommit> {
        self.batch_queue.iter().rev()
    }

    pub fn queue_len(&self) -> usize {
        self.batch_queue.len()
    }

    pub fn committing(&self) -> Option<&PendingCommit> {
        self.committing.as_ref()
    }

    /// Steps launched and not yet completed (including one being committed).
    pub fn in_flight(&self) -> usize {
        self.batch_queue.len()
            + usize::from(self.launch_handle.is_some())
            + usize::from(self.committing.is_some())
    }

    /// Nothing launched, queued or committing.
    pub fn is_drained(&self) -> bool {
        self.in_flight() == 0
    }

    /// Record a forward dispatched into `handle.slot`.
    pub fn on_launch(&mut self, handle: LaunchHandle) -> Result<(), StateError> {
        self.check_slot(handle.slot)?;
        if let Some(h) = &self.launch_handle {
            return Err(StateError::LaunchInFlight(h.step));
        }
        if self.is_slot_busy(handle.slot) {
            return Err(StateError::SlotBusy(handle.slot));
        }
        self.busy |= 1 << handle.slot;
        self.launch_handle = Some(handle);
        Ok(())
    }

    /// The launched forward has been sampled: move it to the queue.
    pub fn on_pending_commit(&mut self, step: PendingCommit) -> Result<(), StateError> {
        let h = self.launch_handle.ok_or(StateError::NoLaunch)?;
        if h.slot != step.slot {
            return Err(StateError::SlotMismatch {
                expected: h.slot,
                got: step.slot,
            });
        }
        if h.step != step.step {
            return Err(StateError::StepMismatch {
                expected: h.step,
                got: step.step,
            });
        }
        self.launch_handle = None;
        self.batch_queue.push_front(step);
        Ok(())
    }

    /// Take the oldest sampled step for commit (phase 1). Its slot stays busy
    /// until [`PipelineState::on_step_completed`].
    pub fn pop_oldest(&mut self) -> Result<Option<PendingCommit>, StateError> {
        if let Some(c) = &self.committing {
            return Err(StateError::CommitInProgress(c.step));
        }
        let step = self.batch_queue.pop_back();
        self.committing = step;
        Ok(step)
    }

    /// The step taken by `pop_oldest` is committed: free its slot (phase 2).
    pub fn on_step_completed(&mut self) -> Result<PendingCommit, StateError> {
        let step = self.committing.take().ok_or(StateError::NotCommitting)?;
        self.busy &= !(1 << step.slot);
        Ok(step)
    }

    /// Forget everything (engine-fatal path, after the device was synchronized).
    pub fn clear(&mut self) {
        self.busy = 0;
        self.batch_queue.clear();
        self.launch_handle = None;
        self.committing = None;
    }

    /// Check the structural invariants: total in flight <= slots, busy bits
    /// equal the slots of all records, FIFO step order (I2). Returns a
    /// description of the first violation.
    pub fn check(&self) -> Result<(), String> {
        if self.in_flight() > self.num_slots {
            return Err(format!(
                "{} steps in flight with {} slots",
                self.in_flight(),
                self.num_slots
            ));
        }
        let mut bits = 0u32;
        let mut steps = Vec::with_capacity(self.num_slots);
        let records = self
            .committing
            .iter()
            .map(|c| (c.slot, c.step))
            .chain(self.queued().map(|c| (c.slot, c.step)))
            .chain(self.launch_handle.iter().map(|h| (h.slot, h.step)));
        for (slot, step) in records {
            if bits & (1 << slot) != 0 {
                return Err(format!("slot {slot} holds two steps"));
            }
            bits |= 1 << slot;
            steps.push(step);
        }
        if bits != self.busy {
            return Err(format!(
                "busy mask {:b} but records use {:b}",
                self.busy, bits
            ));
        }
        if steps.windows(2).any(|w| w[0] >= w[1]) {
            return Err(format!("steps out of FIFO order: {steps:?}"));
        }
        Ok(())
    }

    fn check_slot(&self, slot: SlotId) -> Result<(), StateError> {
        if slot >= self.num_slots {
            return Err(StateError::NoSuchSlot {
                slot,
                num_slots: self.num_slots,
            });
        }
        Ok(())
    }
}

fn low_bits(n: usize) -> u32 {
    if n >= 32 {
        u32::MAX
    } else {
        (1u32 << n) - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(slot: SlotId, step: u64) -> LaunchHandle {
        LaunchHandle {
            kind: StepKind::Decode,
            slot,
            step,
        }
    }
    fn pending(slot: SlotId, step: u64) -> PendingCommit {
        PendingCommit {
            kind: StepKind::Decode,
            slot,
            step,
        }
    }

    #[test]
    fn ping_pong_two_deep() {
        let mut p = PipelineState::new(2).unwrap();
        assert_eq!(p.free_slot_id(), Some(0));
        p.on_launch(launch(0, 0)).unwrap();
        p.on_pending_commit(pending(0, 0)).unwrap();
        assert_eq!(p.free_slot_id(), Some(1));
        p.on_launch(launch(1, 1)).unwrap();
        p.on_pending_commit(pending(1, 1)).unwrap();
        assert_eq!(p.free_slot_id(), None);
        assert_eq!(p.in_flight(), 2);
        p.check().unwrap();
        let oldest = p.pop_oldest().unwrap().unwrap();
        assert_eq!(oldest.step, 0);
        // Two-phase completion: the slot stays busy while committing (I6).
        assert_eq!(p.free_slot_id(), None);
        p.on_step_completed().unwrap();
        assert_eq!(p.free_slot_id(), Some(0));
        p.check().unwrap();
    }

    #[test]
    fn illegal_transitions_are_typed_errors() {
        let mut p = PipelineState::new(2).unwrap();
        assert_eq!(
            p.on_pending_commit(pending(0, 0)),
            Err(StateError::NoLaunch)
        );
        assert_eq!(p.on_step_completed(), Err(StateError::NotCommitting));
        assert_eq!(
            p.on_launch(launch(2, 0)),
            Err(StateError::NoSuchSlot {
                slot: 2,
                num_slots: 2
            })
        );
        p.on_launch(launch(0, 0)).unwrap();
        assert_eq!(
            p.on_launch(launch(1, 1)),
            Err(StateError::LaunchInFlight(0))
        );
        assert_eq!(
            p.on_pending_commit(pending(1, 0)),
            Err(StateError::SlotMismatch {
                expected: 0,
                got: 1
            })
        );
        assert_eq!(
            p.on_pending_commit(pending(0, 7)),
            Err(StateError::StepMismatch {
                expected: 0,
                got: 7
            })
        );
        p.on_pending_commit(pending(0, 0)).unwrap();
        assert_eq!(p.on_launch(launch(0, 1)), Err(StateError::SlotBusy(0)));
        p.pop_oldest().unwrap();
        assert_eq!(p.pop_oldest(), Err(StateError::CommitInProgress(0)));
        p.on_step_completed().unwrap();
        assert_eq!(p.on_step_completed(), Err(StateError::NotCommitting));
        assert_eq!(
            PipelineState::new(0).unwrap_err(),
            StateError::BadSlotCount(0)
        );
        assert!(p.is_drained());
    }

    #[test]
    fn fifo_order_oldest_first() {
        let mut p = PipelineState::new(3).unwrap();
        for (slot, step) in [(0, 10), (1, 11), (2, 12)] {
            p.on_launch(launch(slot, step)).unwrap();
            p.on_pending_commit(pending(slot, step)).unwrap();
        }
        let order: Vec<u64> = p.queued().map(|c| c.step).collect();
        assert_eq!(order, vec![10, 11, 12]);
        for want in [10, 11, 12] {
            assert_eq!(p.pop_oldest().unwrap().unwrap().step, want);
            p.on_step_completed().unwrap();
        }
        assert_eq!(p.pop_oldest().unwrap(), None);
        assert_eq!(p.on_step_completed(), Err(StateError::NotCommitting));
    }
}
