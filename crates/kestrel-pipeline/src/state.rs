//! `PipelineState`: the canonical queue/slot state machine of section 4.6.
//!
//! It owns slot occupancy (a bitmask), the FIFO `batch_queue` of sampled
//! steps, at most one `launch_handle` (forward dispatched, not yet sampled)
//! and the step being committed. Two-phase completion (`pop_oldest` then
//! `on_step_completed`) keeps a slot busy until its commit is done (I6). It
//! never touches sequences or refcounts (I4 belongs to the scheduler).
//! Every illegal transition is a typed [`StateError`], never a panic.
//!
//! It is the one implementation of the slot protocol: the engine loop keeps
//! one for its scheduling, and each runtime keeps one to refuse a call that
//! breaks the protocol before it touches a buffer (`check_launch`,
//! `check_sample`, `check_wait` book nothing; `launch`, `sample`,
//! `complete` book). It numbers the steps (`next_step`). O(1) per call, no
//! allocation after construction.

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
    #[error("waited on slot {slot} but the oldest step in flight is on slot {expected:?}")]
    OutOfOrder {
        slot: SlotId,
        /// The slot of the oldest step in flight, if any.
        expected: Option<SlotId>,
    },
    #[error("waited on slot {0} before its sampling was finalized")]
    NotSampled(SlotId),
}

/// A broken structural invariant of [`PipelineState`] ([`PipelineState::check`]):
/// always a bug, never a refused call (those are [`StateError`]s).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolViolation {
    #[error("{in_flight} steps in flight with {num_slots} slots")]
    TooManyInFlight { in_flight: usize, num_slots: usize },
    #[error("slot {slot} holds two steps")]
    SlotHoldsTwoSteps { slot: SlotId },
    #[error("busy mask {busy:b} but records use {records:b}")]
    BusyMismatch { busy: u32, records: u32 },
    #[error("steps out of FIFO order: {steps:?}")]
    OutOfFifoOrder { steps: Vec<u64> },
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
    /// The step number the next launch gets (one past the last launched).
    next_step: u64,
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
            next_step: 0,
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

    /// The step number the next [`launch`](Self::launch) gets.
    pub fn next_step(&self) -> u64 {
        self.next_step
    }

    /// Steps sampled and not yet completed: those whose outputs will still
    /// arrive (a launched, unsampled forward's never will).
    pub fn sampled_in_flight(&self) -> usize {
        self.batch_queue.len() + usize::from(self.committing.is_some())
    }

    /// Whether a forward may be launched into `slot` now. Books nothing: a
    /// runtime calls it before preparing the launch.
    pub fn check_launch(&self, slot: SlotId) -> Result<(), StateError> {
        self.check_slot(slot)?;
        if let Some(h) = &self.launch_handle {
            return Err(StateError::LaunchInFlight(h.step));
        }
        if self.is_slot_busy(slot) {
            return Err(StateError::SlotBusy(slot));
        }
        Ok(())
    }

    /// Record a forward dispatched into `handle.slot`.
    pub fn on_launch(&mut self, handle: LaunchHandle) -> Result<(), StateError> {
        self.check_launch(handle.slot)?;
        self.busy |= 1 << handle.slot;
        self.launch_handle = Some(handle);
        self.next_step = self.next_step.max(handle.step + 1);
        Ok(())
    }

    /// Record a forward of `kind` dispatched into `slot`, numbered
    /// [`next_step`](Self::next_step); returns its number.
    pub fn launch(&mut self, slot: SlotId, kind: StepKind) -> Result<u64, StateError> {
        let step = self.next_step;
        self.on_launch(LaunchHandle { kind, slot, step })?;
        Ok(step)
    }

    /// Whether `slot`'s launched forward may be sampled now. Books nothing.
    pub fn check_sample(&self, slot: SlotId) -> Result<LaunchHandle, StateError> {
        let h = self.launch_handle.ok_or(StateError::NoLaunch)?;
        if h.slot != slot {
            return Err(StateError::SlotMismatch {
                expected: h.slot,
                got: slot,
            });
        }
        Ok(h)
    }

    /// Record the sampling of `slot`'s launched forward
    /// ([`on_pending_commit`](Self::on_pending_commit) of that forward).
    pub fn sample(&mut self, slot: SlotId) -> Result<PendingCommit, StateError> {
        let h = self.check_sample(slot)?;
        let step = PendingCommit {
            kind: h.kind,
            slot,
            step: h.step,
        };
        self.on_pending_commit(step)?;
        Ok(step)
    }

    /// Whether `slot`'s step may be waited on now: it is the oldest in
    /// flight and sampled, and no commit is under way. Books nothing.
    pub fn check_wait(&self, slot: SlotId) -> Result<(), StateError> {
        if let Some(c) = &self.committing {
            return Err(StateError::CommitInProgress(c.step));
        }
        match (self.batch_queue.back(), &self.launch_handle) {
            (Some(c), _) if c.slot == slot => Ok(()),
            (None, Some(h)) if h.slot == slot => Err(StateError::NotSampled(slot)),
            (oldest, h) => Err(StateError::OutOfOrder {
                slot,
                expected: oldest.map(|c| c.slot).or(h.map(|h| h.slot)),
            }),
        }
    }

    /// Wait and commit in one call, for a runtime (whose commit is handing
    /// the outputs back): `slot`'s step must be the oldest, sampled; its
    /// slot is free again.
    pub fn complete(&mut self, slot: SlotId) -> Result<PendingCommit, StateError> {
        self.check_wait(slot)?;
        self.pop_oldest()?;
        self.on_step_completed()
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

    /// Forget everything (engine-fatal path, after the device was
    /// synchronized). The step counter keeps counting.
    pub fn clear(&mut self) {
        self.busy = 0;
        self.batch_queue.clear();
        self.launch_handle = None;
        self.committing = None;
    }

    /// Check the structural invariants: total in flight <= slots, busy bits
    /// equal the slots of all records, FIFO step order (I2). Returns the
    /// first violation.
    pub fn check(&self) -> Result<(), ProtocolViolation> {
        if self.in_flight() > self.num_slots {
            return Err(ProtocolViolation::TooManyInFlight {
                in_flight: self.in_flight(),
                num_slots: self.num_slots,
            });
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
                return Err(ProtocolViolation::SlotHoldsTwoSteps { slot });
            }
            bits |= 1 << slot;
            steps.push(step);
        }
        if bits != self.busy {
            return Err(ProtocolViolation::BusyMismatch {
                busy: self.busy,
                records: bits,
            });
        }
        if steps.windows(2).any(|w| w[0] >= w[1]) {
            return Err(ProtocolViolation::OutOfFifoOrder { steps });
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

    #[test]
    fn runtime_protocol_numbers_steps_and_refuses_misuse() {
        let mut p = PipelineState::new(2).unwrap();
        assert_eq!(p.launch(0, StepKind::Prefill), Ok(0));
        assert_eq!(p.check_wait(0), Err(StateError::NotSampled(0)));
        assert_eq!(
            p.launch(1, StepKind::Decode),
            Err(StateError::LaunchInFlight(0))
        );
        assert_eq!(
            p.sample(1),
            Err(StateError::SlotMismatch {
                expected: 0,
                got: 1
            })
        );
        p.sample(0).unwrap();
        assert_eq!(p.launch(1, StepKind::Decode), Ok(1));
        assert_eq!(p.sampled_in_flight(), 1);
        assert_eq!(
            p.complete(1),
            Err(StateError::OutOfOrder {
                slot: 1,
                expected: Some(0)
            })
        );
        assert_eq!(p.complete(0).unwrap().kind, StepKind::Prefill);
        assert_eq!(
            p.launch(0, StepKind::Decode),
            Err(StateError::LaunchInFlight(1))
        );
        p.sample(1).unwrap();
        p.clear();
        assert_eq!((p.in_flight(), p.next_step()), (0, 2));
        assert_eq!(p.launch(1, StepKind::Decode), Ok(2));
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone, Copy)]
        enum Op {
            Launch(SlotId),
            Sample(SlotId),
            Complete(SlotId),
            Clear,
        }

        fn op() -> impl Strategy<Value = Op> {
            // One slot past the range, to exercise `NoSuchSlot`.
            prop_oneof![
                8 => (0..4usize).prop_map(Op::Launch),
                6 => (0..4usize).prop_map(Op::Sample),
                6 => (0..4usize).prop_map(Op::Complete),
                1 => Just(Op::Clear),
            ]
        }

        /// The protocol written as a list of steps, independently of the state.
        #[derive(Debug, Default)]
        struct Model {
            /// (slot, step, sampled), launch order.
            steps: Vec<(SlotId, u64, bool)>,
            next: u64,
        }

        impl Model {
            fn launch(&mut self, slot: SlotId, n: usize) -> Option<u64> {
                let ok = slot < n
                    && self.steps.iter().all(|s| s.0 != slot)
                    && self.steps.iter().all(|s| s.2);
                ok.then(|| {
                    self.steps.push((slot, self.next, false));
                    self.next += 1;
                    self.next - 1
                })
            }

            fn sample(&mut self, slot: SlotId) -> bool {
                match self.steps.iter_mut().find(|s| !s.2) {
                    Some(s) if s.0 == slot => {
                        s.2 = true;
                        true
                    }
                    _ => false,
                }
            }

            fn complete(&mut self, slot: SlotId) -> bool {
                let ok = matches!(self.steps.first(), Some(&(s, _, true)) if s == slot);
                if ok {
                    self.steps.remove(0);
                }
                ok
            }
        }

        fn same(a: &PipelineState, b: &PipelineState) -> bool {
            format!("{a:?}") == format!("{b:?}")
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// Random runtime calls, legal or not: the state accepts exactly
            /// the calls the protocol allows, each `check_*` agrees with its
            /// booking twin, a refused call changes nothing, and at most one
            /// step is ever launched and unsampled.
            #[test]
            fn state_accepts_exactly_the_protocol(
                num_slots in 1..4usize,
                ops in proptest::collection::vec(op(), 0..64),
            ) {
                let mut p = PipelineState::new(num_slots).unwrap();
                let mut m = Model::default();
                for op in ops {
                    let before = p.clone();
                    let ok = match op {
                        Op::Launch(s) => {
                            let got = p.launch(s, StepKind::Decode);
                            prop_assert_eq!(before.check_launch(s).is_ok(), got.is_ok());
                            prop_assert_eq!(got.clone().ok(), m.launch(s, num_slots), "{:?}", op);
                            got.is_ok()
                        }
                        Op::Sample(s) => {
                            let ok = p.sample(s).is_ok();
                            prop_assert_eq!(before.check_sample(s).is_ok(), ok);
                            prop_assert_eq!(ok, m.sample(s), "{:?}", op);
                            ok
                        }
                        Op::Complete(s) => {
                            let ok = p.complete(s).is_ok();
                            prop_assert_eq!(before.check_wait(s).is_ok(), ok);
                            prop_assert_eq!(ok, m.complete(s), "{:?}", op);
                            ok
                        }
                        Op::Clear => {
                            p.clear();
                            m.steps.clear();
                            true
                        }
                    };
                    if !ok {
                        prop_assert!(same(&p, &before));
                    }
                    prop_assert!(p.check().is_ok(), "{:?}", p.check());
                    prop_assert_eq!(p.in_flight(), m.steps.len());
                    let unsampled: Vec<_> = m.steps.iter().filter(|s| !s.2).map(|s| s.0).collect();
                    prop_assert_eq!(p.launch_handle().map(|h| h.slot), unsampled.first().copied());
                    prop_assert!(unsampled.len() <= 1);
                    prop_assert_eq!(p.sampled_in_flight(), m.steps.len() - unsampled.len());
                    prop_assert_eq!(p.next_step(), m.next);
                    let oldest = p.queued().next().map(|c| c.slot).or(p.launch_handle().map(|h| h.slot));
                    prop_assert_eq!(oldest, m.steps.first().map(|s| s.0));
                }
            }
        }
    }
}
