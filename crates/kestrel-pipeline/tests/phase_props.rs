//! Property tests of a sequence's [`Lifecycle`]: random runs of transitions
//! (legal and not) against a reference model written from the lifecycle's
//! description, plus the invariants every phase must hold after every step:
//! at most two steps in flight, a drafting sequence in exactly one, no step
//! for a waiting, preempted or released sequence, launches minus commits
//! equal to `inflight_refs`, KV held exactly between admission and eviction
//! or release, a refused transition changing nothing, and `Released`
//! terminal. A transition that moves to a wrong phase, or that accepts a
//! move the model refuses, fails them.

use kestrel_pipeline::{Lifecycle, Phase, Transition, MAX_INFLIGHT_REFS};
use proptest::prelude::*;

/// A transition with its arguments.
#[derive(Debug, Clone, Copy)]
enum Op {
    Admit { end: usize, len: usize },
    LaunchChunk { end: usize, len: usize },
    LaunchDecode { drafts: usize },
    Commit,
    Preempt,
    Evict,
    Finalize,
    Release,
}

impl Op {
    fn transition(self) -> Transition {
        match self {
            Op::Admit { .. } => Transition::Admit,
            Op::LaunchChunk { .. } => Transition::LaunchChunk,
            Op::LaunchDecode { .. } => Transition::LaunchDecode,
            Op::Commit => Transition::Commit,
            Op::Preempt => Transition::Preempt,
            Op::Evict => Transition::Evict,
            Op::Finalize => Transition::Finalize,
            Op::Release => Transition::Release,
        }
    }

    fn apply(self, l: &mut Lifecycle) -> Result<Option<bool>, kestrel_pipeline::PhaseError> {
        match self {
            Op::Admit { end, len } => l.admit(end, len).map(|()| None),
            Op::LaunchChunk { end, len } => l.launch_chunk(end, len).map(|()| None),
            Op::LaunchDecode { drafts } => l.launch_decode(drafts).map(|()| None),
            Op::Commit => l.commit().map(|()| None),
            Op::Preempt => l.preempt().map(|()| None),
            Op::Evict => l.evict().map(|()| None),
            Op::Finalize => l.finalize().map(|()| None),
            Op::Release => l.release().map(Some),
        }
    }
}

fn op() -> impl Strategy<Value = Op> {
    // Prompt lengths from a small range so chunk ends often meet them.
    let chunk = (0usize..8, 4usize..8);
    prop_oneof![
        3 => chunk.clone().prop_map(|(end, len)| Op::Admit { end, len }),
        3 => chunk.prop_map(|(end, len)| Op::LaunchChunk { end, len }),
        5 => prop_oneof![3 => Just(0usize), 1 => 1usize..4].prop_map(|drafts| Op::LaunchDecode { drafts }),
        5 => Just(Op::Commit),
        1 => Just(Op::Preempt),
        2 => Just(Op::Evict),
        1 => Just(Op::Finalize),
        2 => Just(Op::Release),
    ]
}

/// The reference model: the lifecycle as its documentation states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Model {
    phase: Phase,
    refs: u8,
    kv: bool,
}

impl Model {
    /// The model after `op`, or `None` when the lifecycle must refuse it;
    /// with what `release` reports.
    fn after(self, op: Op) -> Option<(Model, Option<bool>)> {
        let Model { phase, refs, kv } = self;
        let chunked = |end: usize, len: usize| {
            if end == len {
                Phase::Decoding
            } else {
                Phase::Prefilling { done: end }
            }
        };
        let next = |phase, refs, kv| Some((Model { phase, refs, kv }, None));
        match op {
            // Waiting or preempted sequences (in no step) take KV and one step.
            Op::Admit { end, len } => match phase {
                Phase::Waiting | Phase::Preempted if end <= len => next(chunked(end, len), 1, true),
                _ => None,
            },
            // Only forward, within the prompt, and within the pipeline depth.
            Op::LaunchChunk { end, len } => match phase {
                Phase::Prefilling { done }
                    if done < end && end <= len && refs < MAX_INFLIGHT_REFS =>
                {
                    next(chunked(end, len), refs + 1, kv)
                }
                _ => None,
            },
            // Decoding only; drafts only from committed tokens (no step in flight).
            Op::LaunchDecode { drafts } => match phase {
                Phase::Decoding if refs < MAX_INFLIGHT_REFS && (drafts == 0 || refs == 0) => {
                    let phase = if drafts > 0 {
                        Phase::Drafting { drafts }
                    } else {
                        Phase::Decoding
                    };
                    next(phase, refs + 1, kv)
                }
                _ => None,
            },
            Op::Commit => match phase {
                _ if refs == 0 => None,
                Phase::Drafting { .. } => next(Phase::Decoding, refs - 1, kv),
                _ => next(phase, refs - 1, kv),
            },
            Op::Preempt => match phase {
                Phase::Prefilling { .. } | Phase::Decoding | Phase::Drafting { .. } => {
                    next(Phase::Preempting, refs, kv)
                }
                _ => None,
            },
            Op::Evict => match phase {
                Phase::Preempting if refs == 0 => next(Phase::Preempted, 0, false),
                _ => None,
            },
            Op::Finalize => match phase {
                Phase::Finalized { .. } | Phase::Released => None,
                _ => next(Phase::Finalized { holds_kv: kv }, refs, kv),
            },
            Op::Release => match phase {
                Phase::Finalized { .. } if refs == 0 => Some((
                    Model {
                        phase: Phase::Released,
                        refs: 0,
                        kv: false,
                    },
                    Some(kv),
                )),
                _ => None,
            },
        }
    }
}

/// What must hold in every phase, whatever the history.
fn check_phase(l: &Lifecycle, kv: bool, launched: u32, committed: u32) {
    let (phase, refs) = (l.phase(), l.inflight_refs());
    assert!(refs <= MAX_INFLIGHT_REFS, "{phase:?} in {refs} steps");
    assert_eq!(
        u32::from(refs),
        launched - committed,
        "refs are launches minus commits"
    );
    match phase {
        Phase::Drafting { drafts } => {
            assert!(drafts > 0);
            assert_eq!(refs, 1, "a drafting sequence is in exactly one step");
        }
        Phase::Waiting | Phase::Preempted | Phase::Released => {
            assert_eq!(refs, 0, "{phase:?} in {refs} steps")
        }
        _ => {}
    }
    assert_eq!(phase.holds_kv(), kv, "{phase:?}: KV held {kv}");
    assert_eq!(
        phase.is_running() as u8 + phase.is_preempted() as u8 + phase.is_finalized() as u8,
        u8::from(phase != Phase::Waiting),
        "{phase:?} is in exactly one of running, preempted, finalized (waiting: none)"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn transitions_follow_the_lifecycle(ops in prop::collection::vec(op(), 1..60)) {
        let mut l = Lifecycle::new();
        let mut model = Model { phase: Phase::Waiting, refs: 0, kv: false };
        let (mut launched, mut committed) = (0u32, 0u32);
        for op in ops {
            let before = l;
            let got = op.apply(&mut l);
            match (model.after(op), got) {
                (Some((next, released)), Ok(reported)) => {
                    prop_assert_eq!(l.phase(), next.phase, "{:?} from {:?}", op, before);
                    prop_assert_eq!(l.inflight_refs(), next.refs, "{:?} from {:?}", op, before);
                    prop_assert_eq!(reported, released, "{:?}: what release reports", op);
                    model = next;
                    match op {
                        Op::Admit { .. } | Op::LaunchChunk { .. } | Op::LaunchDecode { .. } => {
                            launched += 1
                        }
                        Op::Commit => committed += 1,
                        _ => {}
                    }
                }
                (None, Err(e)) => {
                    prop_assert_eq!(l, before, "a refused {:?} changed the lifecycle", op);
                    prop_assert_eq!(e.transition, op.transition());
                    prop_assert_eq!((e.phase, e.refs), (before.phase(), before.inflight_refs()));
                }
                (want, got) => {
                    prop_assert!(false, "{:?} from {:?}: model {:?}, lifecycle {:?}", op, before, want, got);
                }
            }
            check_phase(&l, model.kv, launched, committed);
            if before.phase() == Phase::Released {
                prop_assert_eq!(l, before, "Released is terminal");
            }
        }
    }
}
