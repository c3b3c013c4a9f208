//! [`SlotLedger`]: the runtime side of the pipeline's slot protocol, kept
//! once for every backend: which slots hold a step not yet waited on (oldest
//! first), which one's forward is launched but not yet sampled, and the step
//! counter. `kestrel_pipeline::PipelineState` enforces the same protocol on
//! the scheduler's side; this copy lets a runtime refuse a call that breaks
//! it (I2 FIFO completion, I6 no reuse before commit) with a typed
//! [`LedgerError`] before it touches a buffer. O(1) per call, no allocation
//! after construction.

use std::collections::VecDeque;

/// A runtime's slot index (`kestrel_pipeline::SlotId`).
pub type SlotIndex = usize;

/// A call that breaks the slot protocol. Nothing was booked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    /// The slot does not exist.
    #[error("slot {slot} out of range: the runtime has {num_slots} slots")]
    SlotOutOfRange {
        /// The slot named.
        slot: SlotIndex,
        /// Slots the runtime has.
        num_slots: usize,
    },
    /// A launch into a slot whose previous step is not yet committed (I6).
    #[error("slot {0} is still in use")]
    SlotBusy(SlotIndex),
    /// A launch while another slot's forward still awaits its sampling.
    #[error("launch into slot {slot} while slot {launched}'s forward is not yet sampled")]
    LaunchPending {
        /// The slot named.
        slot: SlotIndex,
        /// The slot whose forward awaits sampling.
        launched: SlotIndex,
    },
    /// Sampling finalized on a slot whose forward is not the one launched.
    #[error("finalize_sampling on slot {slot}, but the launched forward is on {launched:?}")]
    NotLaunched {
        /// The slot named.
        slot: SlotIndex,
        /// The slot whose forward awaits sampling, if any.
        launched: Option<SlotIndex>,
    },
    /// A wait on a slot other than the oldest in flight (I2).
    #[error("waited on slot {slot} but the oldest step in flight is on slot {expected:?}")]
    OutOfOrder {
        /// The slot named.
        slot: SlotIndex,
        /// The oldest slot in flight, if any.
        expected: Option<SlotIndex>,
    },
    /// A wait on the oldest step before its sampling was finalized: its
    /// outputs would never come.
    #[error("waited on slot {0} before its sampling was finalized")]
    NotSampled(SlotIndex),
}

/// The slot protocol's bookkeeping. See the module docs.
///
/// A step's life: [`launch`](Self::launch) (forward dispatched) ->
/// [`sample`](Self::sample) (sampling queued) -> [`complete`](Self::complete)
/// (outputs waited on; the slot is free again). At most one step is launched
/// and not sampled; steps complete in launch order. Each transition has a
/// `check_*` twin that books nothing, for a runtime to call before it
/// touches a buffer, so a refused call leaves the device untouched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotLedger {
    num_slots: usize,
    /// Slots holding a step not yet completed, oldest first.
    in_flight: VecDeque<SlotIndex>,
    /// The slot whose forward is launched but not yet sampled (the newest in flight).
    launched: Option<SlotIndex>,
    /// The step number the next launch gets (launch order, from 0).
    next_step: u64,
}

impl SlotLedger {
    /// An idle ledger over `num_slots` slots.
    pub fn new(num_slots: usize) -> Self {
        SlotLedger {
            num_slots,
            in_flight: VecDeque::with_capacity(num_slots),
            launched: None,
            next_step: 0,
        }
    }

    /// Slots the runtime has.
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// The step number the next launch gets.
    pub fn next_step(&self) -> u64 {
        self.next_step
    }

    /// The slot whose forward is launched but not yet sampled.
    pub fn launched(&self) -> Option<SlotIndex> {
        self.launched
    }

    /// The slot of the oldest step not yet completed.
    pub fn oldest(&self) -> Option<SlotIndex> {
        self.in_flight.front().copied()
    }

    /// Steps launched and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Steps sampled and not yet completed: those whose outputs will still
    /// arrive (a launched, unsampled forward's never will).
    pub fn sampled_in_flight(&self) -> usize {
        self.in_flight.len() - usize::from(self.launched.is_some())
    }

    /// Whether `slot` holds a step not yet completed.
    pub fn is_busy(&self, slot: SlotIndex) -> bool {
        self.in_flight.contains(&slot)
    }

    /// Whether a step may be launched into `slot` now. Books nothing: call
    /// it before preparing the launch, then [`launch`](Self::launch) once
    /// the step is dispatched.
    ///
    /// # Errors
    /// [`LedgerError::SlotOutOfRange`], [`LedgerError::SlotBusy`] or
    /// [`LedgerError::LaunchPending`].
    pub fn check_launch(&self, slot: SlotIndex) -> Result<(), LedgerError> {
        if slot >= self.num_slots {
            return Err(LedgerError::SlotOutOfRange {
                slot,
                num_slots: self.num_slots,
            });
        }
        if self.is_busy(slot) {
            return Err(LedgerError::SlotBusy(slot));
        }
        if let Some(launched) = self.launched {
            return Err(LedgerError::LaunchPending { slot, launched });
        }
        Ok(())
    }

    /// Books a dispatched forward on `slot` and returns its step number.
    ///
    /// # Errors
    /// As [`check_launch`](Self::check_launch).
    pub fn launch(&mut self, slot: SlotIndex) -> Result<u64, LedgerError> {
        self.check_launch(slot)?;
        let step = self.next_step;
        self.in_flight.push_back(slot);
        self.launched = Some(slot);
        self.next_step += 1;
        Ok(step)
    }

    /// Whether `slot`'s launched forward may be sampled now. Books nothing:
    /// call it before touching the slot's buffers, then
    /// [`sample`](Self::sample) once sampling is queued.
    ///
    /// # Errors
    /// [`LedgerError::NotLaunched`] unless `slot` holds the launched forward.
    pub fn check_sample(&self, slot: SlotIndex) -> Result<(), LedgerError> {
        if self.launched != Some(slot) {
            return Err(LedgerError::NotLaunched {
                slot,
                launched: self.launched,
            });
        }
        Ok(())
    }

    /// Books the sampling of `slot`'s launched forward.
    ///
    /// # Errors
    /// As [`check_sample`](Self::check_sample).
    pub fn sample(&mut self, slot: SlotIndex) -> Result<(), LedgerError> {
        self.check_sample(slot)?;
        self.launched = None;
        Ok(())
    }

    /// Whether `slot`'s step may be waited on now. Books nothing: call it
    /// before blocking on the device, then [`complete`](Self::complete).
    ///
    /// # Errors
    /// [`LedgerError::OutOfOrder`] unless `slot` holds the oldest step;
    /// [`LedgerError::NotSampled`] if that step's sampling is not finalized.
    pub fn check_wait(&self, slot: SlotIndex) -> Result<(), LedgerError> {
        let expected = self.oldest();
        if expected != Some(slot) {
            return Err(LedgerError::OutOfOrder { slot, expected });
        }
        if self.launched == Some(slot) {
            return Err(LedgerError::NotSampled(slot));
        }
        Ok(())
    }

    /// Books the completion of `slot`'s step: the slot is free again.
    ///
    /// # Errors
    /// As [`check_wait`](Self::check_wait).
    pub fn complete(&mut self, slot: SlotIndex) -> Result<(), LedgerError> {
        self.check_wait(slot)?;
        self.in_flight.pop_front();
        Ok(())
    }

    /// Forgets every step in flight (after the runtime synchronized and
    /// took its buffers back). The step counter keeps counting.
    pub fn reset(&mut self) {
        self.in_flight.clear();
        self.launched = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn pipelined_protocol_is_accepted() {
        let mut l = SlotLedger::new(2);
        assert_eq!(l.launch(0), Ok(0));
        l.sample(0).unwrap();
        assert_eq!(l.launch(1), Ok(1));
        l.sample(1).unwrap();
        assert_eq!((l.in_flight(), l.sampled_in_flight()), (2, 2));
        l.complete(0).unwrap();
        assert_eq!(l.launch(0), Ok(2));
        assert_eq!((l.oldest(), l.launched()), (Some(1), Some(0)));
        assert_eq!(l.sampled_in_flight(), 1);
        l.complete(1).unwrap();
        l.sample(0).unwrap();
        l.complete(0).unwrap();
        assert_eq!((l.in_flight(), l.next_step()), (0, 3));
    }

    #[test]
    fn violations_are_typed_and_book_nothing() {
        let mut l = SlotLedger::new(2);
        assert_eq!(
            l.launch(2),
            Err(LedgerError::SlotOutOfRange {
                slot: 2,
                num_slots: 2
            })
        );
        assert_eq!(
            l.sample(0),
            Err(LedgerError::NotLaunched {
                slot: 0,
                launched: None
            })
        );
        assert_eq!(
            l.complete(0),
            Err(LedgerError::OutOfOrder {
                slot: 0,
                expected: None
            })
        );
        l.launch(0).unwrap();
        let before = l.clone();
        assert_eq!(l.launch(0), Err(LedgerError::SlotBusy(0)));
        assert_eq!(
            l.launch(1),
            Err(LedgerError::LaunchPending {
                slot: 1,
                launched: 0
            })
        );
        assert_eq!(l.complete(0), Err(LedgerError::NotSampled(0)));
        assert_eq!(
            l.sample(1),
            Err(LedgerError::NotLaunched {
                slot: 1,
                launched: Some(0)
            })
        );
        assert_eq!(l, before);
        l.sample(0).unwrap();
        l.launch(1).unwrap();
        assert_eq!(
            l.complete(1),
            Err(LedgerError::OutOfOrder {
                slot: 1,
                expected: Some(0)
            })
        );
    }

    #[test]
    fn reset_frees_every_slot_and_keeps_counting() {
        let mut l = SlotLedger::new(2);
        l.launch(0).unwrap();
        l.sample(0).unwrap();
        l.launch(1).unwrap();
        assert_eq!(l.sampled_in_flight(), 1);
        l.reset();
        assert_eq!((l.in_flight(), l.launched()), (0, None));
        assert_eq!(l.launch(1), Ok(2));
    }

    #[derive(Debug, Clone, Copy)]
    enum Op {
        Launch(SlotIndex),
        Sample(SlotIndex),
        Complete(SlotIndex),
        Reset,
    }

    fn op() -> impl Strategy<Value = Op> {
        // One slot past the range, to exercise `SlotOutOfRange`.
        prop_oneof![
            8 => (0..4usize).prop_map(Op::Launch),
            6 => (0..4usize).prop_map(Op::Sample),
            6 => (0..4usize).prop_map(Op::Complete),
            1 => Just(Op::Reset),
        ]
    }

    /// The protocol written as a list of steps, independently of the ledger.
    #[derive(Debug, Default)]
    struct Model {
        /// (slot, step, sampled), launch order.
        steps: Vec<(SlotIndex, u64, bool)>,
        next: u64,
    }

    impl Model {
        fn launch(&mut self, slot: SlotIndex, n: usize) -> Option<u64> {
            let ok = slot < n
                && self.steps.iter().all(|s| s.0 != slot)
                && self.steps.iter().all(|s| s.2);
            ok.then(|| {
                self.steps.push((slot, self.next, false));
                self.next += 1;
                self.next - 1
            })
        }

        fn sample(&mut self, slot: SlotIndex) -> bool {
            match self.steps.iter_mut().find(|s| !s.2) {
                Some(s) if s.0 == slot => {
                    s.2 = true;
                    true
                }
                _ => false,
            }
        }

        fn complete(&mut self, slot: SlotIndex) -> bool {
            let ok = matches!(self.steps.first(), Some(&(s, _, true)) if s == slot);
            if ok {
                self.steps.remove(0);
            }
            ok
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Random calls, legal or not: the ledger accepts exactly the calls
        /// the protocol allows, a refused call changes nothing, and at most
        /// one step is ever launched and unsampled.
        #[test]
        fn ledger_accepts_exactly_the_protocol(
            num_slots in 1..4usize,
            ops in proptest::collection::vec(op(), 0..64),
        ) {
            let mut l = SlotLedger::new(num_slots);
            let mut m = Model::default();
            for op in ops {
                let before = l.clone();
                let ok = match op {
                    Op::Launch(s) => {
                        prop_assert_eq!(l.check_launch(s).is_ok(), l.clone().launch(s).is_ok());
                        let got = l.launch(s);
                        prop_assert_eq!(got.ok(), m.launch(s, num_slots), "{:?}", op);
                        got.is_ok()
                    }
                    Op::Sample(s) => {
                        prop_assert_eq!(l.check_sample(s).is_ok(), l.clone().sample(s).is_ok());
                        let ok = l.sample(s).is_ok();
                        prop_assert_eq!(ok, m.sample(s), "{:?}", op);
                        ok
                    }
                    Op::Complete(s) => {
                        prop_assert_eq!(l.check_wait(s).is_ok(), l.complete(s).is_ok());
                        let ok = before != l;
                        prop_assert_eq!(ok, m.complete(s), "{:?}", op);
                        ok
                    }
                    Op::Reset => {
                        l.reset();
                        m.steps.clear();
                        true
                    }
                };
                if !ok {
                    prop_assert_eq!(&l, &before);
                }
                prop_assert_eq!(l.in_flight(), m.steps.len());
                prop_assert!(l.in_flight() <= num_slots);
                prop_assert_eq!(l.oldest(), m.steps.first().map(|s| s.0));
                let unsampled: Vec<_> = m.steps.iter().filter(|s| !s.2).map(|s| s.0).collect();
                prop_assert_eq!(l.launched(), unsampled.first().copied());
                prop_assert!(unsampled.len() <= 1);
                prop_assert_eq!(l.sampled_in_flight(), m.steps.len() - unsampled.len());
                prop_assert_eq!(l.next_step(), m.next);
            }
        }
    }
}
