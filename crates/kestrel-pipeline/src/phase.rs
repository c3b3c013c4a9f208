//! [`Phase`]: where one sequence is in its life, from waiting to released,
//! and [`Lifecycle`]: its phase with the number of in-flight steps that
//! include it (`inflight_refs`, 0..=2: invariant I4).
//!
//! A `Lifecycle` changes only through its transition methods, each named for
//! what the scheduler does (admit, launch a chunk or a decode step, commit,
//! preempt, evict, finalize, release); an illegal move is a typed
//! [`PhaseError`] and changes nothing. What the type holds by construction:
//! at most [`MAX_INFLIGHT_REFS`] steps, a drafting sequence in exactly one
//! step, no step launched for a sequence that is waiting, preempted or
//! finalized, and a sequence released only once no step references it.

/// The most steps a sequence may be part of at once (the pipeline depth).
pub const MAX_INFLIGHT_REFS: u8 = 2;

/// One sequence's phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Accepted, not yet admitted: holds no KV.
    Waiting,
    /// Admitted, its prompt prefilled in chunks: the first `done` tokens
    /// are launched (one prompt at a time is part-way through).
    Prefilling { done: usize },
    /// Decodes one token per step, in up to two steps at once.
    Decoding,
    /// Its one in-flight step verifies `drafts` draft tokens (it drafted
    /// from its committed tokens, so it joins no other step).
    Drafting { drafts: usize },
    /// Chosen for preemption: dispatched no more, it keeps its KV until its
    /// in-flight steps commit (their tokens count), then gives it back.
    Preempting,
    /// Holds no KV; waits to be prefilled again with its tokens so far.
    Preempted,
    /// Resolved (finished, aborted or failed). With steps in flight it is a
    /// zombie: their rows are discarded, and it keeps its KV (if it holds
    /// any) until the last one commits.
    Finalized { holds_kv: bool },
    /// Forgotten, its KV released. Terminal.
    Released,
}

impl Phase {
    /// Whether the sequence holds KV in the executor.
    pub fn holds_kv(self) -> bool {
        match self {
            Phase::Prefilling { .. } | Phase::Decoding | Phase::Drafting { .. } => true,
            Phase::Preempting => true,
            Phase::Finalized { holds_kv } => holds_kv,
            Phase::Waiting | Phase::Preempted | Phase::Released => false,
        }
    }

    /// Resolved: its request has had its outcome.
    pub fn is_finalized(self) -> bool {
        matches!(self, Phase::Finalized { .. } | Phase::Released)
    }

    /// Admitted, holding KV and not finalized: one of the scheduler's
    /// running sequences.
    pub fn is_running(self) -> bool {
        matches!(
            self,
            Phase::Prefilling { .. } | Phase::Decoding | Phase::Drafting { .. }
        )
    }

    /// Preempting or preempted (not finalized): waiting to be prefilled again.
    pub fn is_preempted(self) -> bool {
        matches!(self, Phase::Preempting | Phase::Preempted)
    }
}

/// A transition the scheduler asked of a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transition {
    /// Launch its first prefill chunk (a new or a preempted sequence).
    Admit,
    /// Launch the next chunk of a prompt part-way through.
    LaunchChunk,
    /// Launch a decode step (with drafts to verify, or none).
    LaunchDecode,
    /// One of its in-flight steps committed.
    Commit,
    Preempt,
    /// Give a preempting sequence's KV back.
    Evict,
    Finalize,
    Release,
}

/// An illegal transition: a scheduler bug, refused with nothing changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cannot {transition:?} a sequence in phase {phase:?} with {refs} steps in flight")]
pub struct PhaseError {
    pub phase: Phase,
    pub refs: u8,
    pub transition: Transition,
}

/// A sequence's phase and in-flight step count, changed only by transitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifecycle {
    phase: Phase,
    refs: u8,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self::new()
    }
}

impl Lifecycle {
    /// A sequence just accepted: waiting, in no step.
    pub fn new() -> Self {
        Self {
            phase: Phase::Waiting,
            refs: 0,
        }
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// In-flight steps (launched, not yet committed) that include it.
    pub fn inflight_refs(&self) -> u8 {
        self.refs
    }

    fn refuse<T>(&self, transition: Transition) -> Result<T, PhaseError> {
        Err(PhaseError {
            phase: self.phase,
            refs: self.refs,
            transition,
        })
    }

    /// The phase after a prefill chunk ending at `end` of `len` tokens.
    fn after_chunk(end: usize, len: usize) -> Phase {
        if end == len {
            Phase::Decoding
        } else {
            Phase::Prefilling { done: end }
        }
    }

    /// Launch the first prefill chunk (ending at `end` of its `len` tokens)
    /// of a waiting or a preempted sequence: it takes KV, and decodes after
    /// this step if the chunk ends its prompt.
    pub fn admit(&mut self, end: usize, len: usize) -> Result<(), PhaseError> {
        match self.phase {
            Phase::Waiting | Phase::Preempted if self.refs == 0 && end <= len => {
                self.refs = 1;
                self.phase = Self::after_chunk(end, len);
                Ok(())
            }
            _ => self.refuse(Transition::Admit),
        }
    }

    /// Launch the next chunk (ending at `end` of `len`) of a prompt part-way
    /// through its prefill.
    pub fn launch_chunk(&mut self, end: usize, len: usize) -> Result<(), PhaseError> {
        match self.phase {
            Phase::Prefilling { done }
                if self.refs < MAX_INFLIGHT_REFS && done < end && end <= len =>
            {
                self.refs += 1;
                self.phase = Self::after_chunk(end, len);
                Ok(())
            }
            _ => self.refuse(Transition::LaunchChunk),
        }
    }

    /// Launch a decode step that verifies `drafts` draft tokens (0: a plain
    /// step). A sequence drafts only with no step in flight.
    pub fn launch_decode(&mut self, drafts: usize) -> Result<(), PhaseError> {
        match self.phase {
            Phase::Decoding if self.refs < MAX_INFLIGHT_REFS && (drafts == 0 || self.refs == 0) => {
                self.refs += 1;
                if drafts > 0 {
                    self.phase = Phase::Drafting { drafts };
                }
                Ok(())
            }
            _ => self.refuse(Transition::LaunchDecode),
        }
    }

    /// One of its in-flight steps committed: a drafting sequence decodes
    /// again (finalized or preempting ones stay so).
    pub fn commit(&mut self) -> Result<(), PhaseError> {
        match self.phase {
            Phase::Waiting | Phase::Preempted | Phase::Released => self.refuse(Transition::Commit),
            _ if self.refs == 0 => self.refuse(Transition::Commit),
            phase => {
                self.refs -= 1;
                if let Phase::Drafting { .. } = phase {
                    self.phase = Phase::Decoding;
                }
                Ok(())
            }
        }
    }

    /// Stop dispatching a running sequence; it keeps its KV until
    /// [`Lifecycle::evict`].
    pub fn preempt(&mut self) -> Result<(), PhaseError> {
        if !self.phase.is_running() {
            return self.refuse(Transition::Preempt);
        }
        self.phase = Phase::Preempting;
        Ok(())
    }

    /// A preempting sequence that no step references gives its KV back.
    pub fn evict(&mut self) -> Result<(), PhaseError> {
        match self.phase {
            Phase::Preempting if self.refs == 0 => {
                self.phase = Phase::Preempted;
                Ok(())
            }
            _ => self.refuse(Transition::Evict),
        }
    }

    /// Resolve the sequence (once). It keeps whatever KV it holds until
    /// [`Lifecycle::release`].
    pub fn finalize(&mut self) -> Result<(), PhaseError> {
        if self.phase.is_finalized() {
            return self.refuse(Transition::Finalize);
        }
        self.phase = Phase::Finalized {
            holds_kv: self.phase.holds_kv(),
        };
        Ok(())
    }

    /// Forget a finalized sequence no step references. Returns whether it
    /// held KV (the executor releases it).
    pub fn release(&mut self) -> Result<bool, PhaseError> {
        match self.phase {
            Phase::Finalized { holds_kv } if self.refs == 0 => {
                self.phase = Phase::Released;
                Ok(holds_kv)
            }
            _ => self.refuse(Transition::Release),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_lives_from_waiting_to_released() {
        let mut l = Lifecycle::new();
        l.admit(4, 10).unwrap();
        assert_eq!(l.phase(), Phase::Prefilling { done: 4 });
        l.launch_chunk(10, 10).unwrap();
        assert_eq!((l.phase(), l.inflight_refs()), (Phase::Decoding, 2));
        assert!(l.launch_decode(0).is_err(), "a third step");
        l.commit().unwrap();
        l.commit().unwrap();
        l.launch_decode(3).unwrap();
        assert_eq!(l.phase(), Phase::Drafting { drafts: 3 });
        assert!(
            l.launch_decode(0).is_err(),
            "a drafting sequence is in one step"
        );
        l.preempt().unwrap();
        assert!(l.evict().is_err(), "its step is in flight");
        l.commit().unwrap();
        l.evict().unwrap();
        l.admit(11, 11).unwrap();
        l.finalize().unwrap();
        assert_eq!(l.phase(), Phase::Finalized { holds_kv: true });
        assert!(l.release().is_err(), "a zombie keeps its KV");
        l.commit().unwrap();
        assert_eq!(l.release(), Ok(true));
        let refused = l.finalize().unwrap_err();
        assert_eq!(refused.transition, Transition::Finalize);
        assert_eq!(l.phase(), Phase::Released);
    }
}
