//! One test per row of the schedulable-sequence error table, plus the lifecycle paths
//! (chunked prefill, speculative decode, revert, preemption with prefix reuse, stale leases).
//! Every refused call must leave the sequence and the page table exactly as they were.

use kestrel_kv::{
    ApplyError, DecodeOutcome, KvError, PageTable, PageTableConfig, SchedulableSequence,
    ScheduleError, SequenceEvent, SequenceState,
};

const PS: usize = 4;

fn table(max_rows: usize, num_pages: usize) -> PageTable {
    PageTable::new(PageTableConfig {
        max_rows,
        num_pages,
        page_size: PS,
        enable_prefix_cache: true,
    })
    .unwrap()
}

fn seq(input: usize, max_output: usize) -> SchedulableSequence {
    SchedulableSequence::new((0..input as u32).collect(), max_output).unwrap()
}

/// A sequence whose prompt is prefilled in one chunk, first token emitted.
fn prefilled(t: &mut PageTable, input: usize, max_output: usize) -> SchedulableSequence {
    let mut s = seq(input, max_output);
    s.schedule_prefill(input, t).unwrap();
    s.apply_prefill(Some(1000), t).unwrap();
    s
}

/// Runs `f`, which must fail, and checks that neither the sequence nor the table changed.
fn refused<T: std::fmt::Debug, E: std::fmt::Debug>(
    s: &mut SchedulableSequence,
    t: &mut PageTable,
    f: impl FnOnce(&mut SchedulableSequence, &mut PageTable) -> Result<T, E>,
) -> E {
    let (before, counts) = (
        s.clone(),
        (
            t.free_pages(),
            t.used_pages(),
            t.cached_pages(),
            t.num_allocated(),
        ),
    );
    let err = f(s, t).expect_err("call should be refused");
    assert_eq!(*s, before, "refused call changed the sequence");
    assert_eq!(
        counts,
        (
            t.free_pages(),
            t.used_pages(),
            t.cached_pages(),
            t.num_allocated()
        )
    );
    t.check_invariants().unwrap();
    err
}

#[test]
fn schedule_not_idle() {
    let mut t = table(4, 16);
    let mut s = seq(8, 4);
    s.schedule_prefill(4, &mut t).unwrap();
    let err = refused(&mut s, &mut t, |s, t| s.schedule_prefill(4, t));
    assert!(matches!(
        err,
        ScheduleError::NotIdle {
            state: SequenceState::PrefillScheduled { num_tokens: 4, .. }
        }
    ));
    assert!(matches!(
        refused(&mut s, &mut t, |s, t| s.schedule_decode(t)),
        ScheduleError::NotIdle { .. }
    ));
    assert!(matches!(
        refused(&mut s, &mut t, |s, t| s.schedule_speculative(2, t)),
        ScheduleError::NotIdle { .. }
    ));
    assert!(matches!(
        refused(&mut s, &mut t, |s, t| s.match_and_add_prefix(t)),
        ScheduleError::NotIdle { .. }
    ));
}

#[test]
fn schedule_prefill_not_complete() {
    let mut t = table(4, 16);
    let mut s = seq(8, 4);
    let err = refused(&mut s, &mut t, |s, t| s.schedule_decode(t));
    assert_eq!(
        err,
        ScheduleError::PrefillNotComplete {
            position: 0,
            num_input_tokens: 8
        }
    );
    s.schedule_prefill(4, &mut t).unwrap();
    s.apply_prefill(None, &mut t).unwrap();
    let err = refused(&mut s, &mut t, |s, t| s.schedule_speculative(3, t));
    assert_eq!(
        err,
        ScheduleError::PrefillNotComplete {
            position: 4,
            num_input_tokens: 8
        }
    );
}

#[test]
fn schedule_prefill_complete() {
    let mut t = table(4, 16);
    let mut s = prefilled(&mut t, 8, 4);
    let err = refused(&mut s, &mut t, |s, t| s.schedule_prefill(1, t));
    assert_eq!(
        err,
        ScheduleError::PrefillComplete {
            position: 8,
            prefill_end: 8
        }
    );
}

#[test]
fn schedule_prefill_overrun() {
    let mut t = table(4, 16);
    let mut s = seq(8, 4);
    let err = refused(&mut s, &mut t, |s, t| s.schedule_prefill(9, t));
    assert_eq!(
        err,
        ScheduleError::PrefillOverrun {
            position: 0,
            num_tokens: 9,
            prefill_end: 8
        }
    );
}

#[test]
fn schedule_allocation_failed() {
    // Out of pages: nothing is taken, not even the row the schedule would have acquired.
    let mut t = table(4, 2);
    let mut s = seq(12, 4);
    let err = refused(&mut s, &mut t, |s, t| s.schedule_prefill(12, t));
    assert_eq!(
        err,
        ScheduleError::AllocationFailed {
            source: KvError::OutOfPages {
                needed: 3,
                available: 2
            }
        }
    );
    assert_eq!(t.num_allocated(), 0);
    // Out of rows.
    let mut t = table(2, 16);
    let _holder = prefilled(&mut t, 4, 4);
    let mut s = seq(4, 4);
    let err = refused(&mut s, &mut t, |s, t| s.schedule_prefill(4, t));
    assert_eq!(
        err,
        ScheduleError::AllocationFailed {
            source: KvError::NoFreeRow { usable_rows: 1 }
        }
    );
    let err = refused(&mut s, &mut t, |s, t| s.match_and_add_prefix(t));
    assert!(matches!(err, ScheduleError::AllocationFailed { .. }));
    // Decode out of pages: the generation page cannot be had.
    let mut t = table(4, 2);
    let mut s = prefilled(&mut t, 8, 4);
    let err = refused(&mut s, &mut t, |s, t| s.schedule_decode(t));
    assert_eq!(
        err,
        ScheduleError::AllocationFailed {
            source: KvError::OutOfPages {
                needed: 1,
                available: 0
            }
        }
    );
    assert!(
        std::error::Error::source(&err).is_some(),
        "the cause is chained"
    );
}

#[test]
fn schedule_generation_complete() {
    let mut t = table(4, 16);
    let mut s = prefilled(&mut t, 4, 1);
    assert!(s.is_complete());
    let err = refused(&mut s, &mut t, |s, t| s.schedule_decode(t));
    assert_eq!(
        err,
        ScheduleError::GenerationComplete {
            generated: 1,
            max_output: 1
        }
    );
    let err = refused(&mut s, &mut t, |s, t| s.schedule_speculative(2, t));
    assert_eq!(
        err,
        ScheduleError::GenerationComplete {
            generated: 1,
            max_output: 1
        }
    );
}

#[test]
fn schedule_wrong_dangling_count() {
    let mut t = table(4, 16);
    let mut s = prefilled(&mut t, 8, 8);
    s.append_tokens(&[1, 2]).unwrap(); // forced tokens: no KV yet
    assert_eq!(s.tail_tokens(), 3);
    let err = refused(&mut s, &mut t, |s, t| s.schedule_decode(t));
    assert_eq!(
        err,
        ScheduleError::WrongDanglingCount {
            expected: 1,
            actual: 3
        }
    );
    let err = refused(&mut s, &mut t, |s, t| s.schedule_speculative(2, t));
    assert_eq!(
        err,
        ScheduleError::WrongDanglingCount {
            expected: 1,
            actual: 3
        }
    );
    // Extending KV over all but the last appended token restores the tail rule.
    s.schedule_prefill(2, &mut t).unwrap();
    s.apply_prefill(None, &mut t).unwrap();
    assert_eq!(s.tail_tokens(), 1);
    s.schedule_decode(&mut t).unwrap();
    assert_eq!(
        refused(&mut s, &mut t, |s, _| s.append_tokens(&[1])),
        ApplyError::WrongState {
            expected: "Idle",
            actual: s.state()
        }
    );
}

#[test]
fn apply_append_exceeds_remaining() {
    let mut t = table(4, 16);
    let mut s = prefilled(&mut t, 8, 3);
    assert_eq!(
        refused(&mut s, &mut t, |s, _| s.append_tokens(&[1, 2, 3])),
        ApplyError::AppendExceedsRemaining {
            requested: 3,
            remaining: 2
        }
    );
}

#[test]
fn schedule_rejects_empty_input_and_double_prefix_match() {
    assert_eq!(
        SchedulableSequence::new(vec![], 4),
        Err(ScheduleError::EmptyInput)
    );
    let mut t = table(4, 16);
    let mut s = seq(8, 4);
    s.match_and_add_prefix(&mut t).unwrap();
    let err = refused(&mut s, &mut t, |s, t| s.match_and_add_prefix(t));
    assert_eq!(err, ScheduleError::RowAlreadyHeld { row: 1 });
}

#[test]
fn apply_wrong_state() {
    let mut t = table(4, 16);
    let mut s = seq(8, 4);
    let idle = SequenceState::Idle;
    assert_eq!(
        refused(&mut s, &mut t, |s, t| s.apply_prefill(None, t)),
        ApplyError::WrongState {
            expected: "PrefillScheduled",
            actual: idle
        }
    );
    assert_eq!(
        refused(&mut s, &mut t, |s, t| s.apply_decode(1, t)),
        ApplyError::WrongState {
            expected: "DecodeScheduled",
            actual: idle
        }
    );
    assert_eq!(
        refused(&mut s, &mut t, |s, t| s.apply_speculative(&[], t)),
        ApplyError::WrongState {
            expected: "SpeculativeScheduled",
            actual: idle
        }
    );
    assert_eq!(
        refused(&mut s, &mut t, |s, t| s.revert_schedule(t)),
        ApplyError::WrongState {
            expected: "a scheduled state",
            actual: idle
        }
    );
    s.schedule_prefill(8, &mut t).unwrap();
    assert!(matches!(
        refused(&mut s, &mut t, |s, t| s.apply_decode(1, t)),
        ApplyError::WrongState { .. }
    ));
    assert!(matches!(
        refused(&mut s, &mut t, |s, t| s.release(t)),
        ApplyError::WrongState { .. }
    ));
    assert!(matches!(
        refused(&mut s, &mut t, |s, t| s.reacquire(t)),
        ApplyError::WrongState { .. }
    ));
    assert!(matches!(
        refused(&mut s, &mut t, |s, t| s.drop_unassigned(t)),
        ApplyError::WrongState { .. }
    ));
}

#[test]
fn apply_token_on_non_final_chunk() {
    let mut t = table(4, 16);
    let mut s = seq(8, 4);
    s.schedule_prefill(4, &mut t).unwrap();
    assert_eq!(
        refused(&mut s, &mut t, |s, t| s.apply_prefill(Some(5), t)),
        ApplyError::TokenOnNonFinalChunk
    );
    s.apply_prefill(None, &mut t).unwrap();
}

#[test]
fn apply_missing_token_on_final_chunk() {
    let mut t = table(4, 16);
    let mut s = seq(8, 4);
    s.schedule_prefill(4, &mut t).unwrap();
    s.apply_prefill(None, &mut t).unwrap();
    s.schedule_prefill(4, &mut t).unwrap();
    assert_eq!(
        refused(&mut s, &mut t, |s, t| s.apply_prefill(None, t)),
        ApplyError::MissingTokenOnFinalChunk
    );
    s.apply_prefill(Some(9), &mut t).unwrap();
    assert_eq!(s.tail_tokens(), 1);
}

#[test]
fn apply_accepted_exceeds_scheduled() {
    let mut t = table(4, 16);
    let mut s = prefilled(&mut t, 8, 10);
    s.schedule_speculative(2, &mut t).unwrap();
    assert_eq!(
        refused(&mut s, &mut t, |s, t| s.apply_speculative(&[1, 2, 3], t)),
        ApplyError::AcceptedExceedsScheduled {
            accepted: 3,
            scheduled: 2
        }
    );
}

#[test]
fn reacquire_refuses_a_held_row() {
    let mut t = table(4, 16);
    let mut s = prefilled(&mut t, 8, 4);
    assert_eq!(
        refused(&mut s, &mut t, |s, t| s.reacquire(t)),
        ApplyError::RowAlreadyHeld { row: 1 }
    );
}

#[test]
fn stale_lease_after_release_all_never_touches_the_new_owner() {
    let mut t = table(2, 16);
    let mut s = prefilled(&mut t, 8, 4);
    t.release_all();
    let other = t.allocate().unwrap();
    assert_eq!(
        Some(other),
        s.row(),
        "the same row id now belongs to someone else"
    );
    assert_eq!(
        refused(&mut s, &mut t, |s, t| s.schedule_decode(t)),
        ScheduleError::StaleLease { row: other }
    );
    s.release(&mut t).unwrap();
    assert!(
        t.is_allocated(other),
        "a stale release must not erase the new owner's row"
    );
    assert_eq!(s.row(), None);
}

#[test]
fn speculative_accepts_a_prefix_and_releases_excess_lifo() {
    let mut t = table(4, 16);
    let mut s = prefilled(&mut t, 7, 10); // kv 7, tokens 8: 2 pages
    s.schedule_speculative(6, &mut t).unwrap(); // KV up to 7 + 1 + 6 = 14: 4 pages
    assert_eq!(
        s.state(),
        SequenceState::SpeculativeScheduled {
            num_tokens: 6,
            blocks_allocated: 2
        }
    );
    let pages = t.pages(s.row().unwrap()).to_vec();
    assert_eq!(
        s.apply_speculative(&[1, 2], &mut t).unwrap(),
        DecodeOutcome::BlockCompleted
    );
    assert_eq!(
        (s.kv_position(), s.tail_tokens(), s.total_tokens()),
        (9, 1, 10)
    );
    assert_eq!(
        t.pages(s.row().unwrap()),
        &pages[..3],
        "the last page went first"
    );
    assert_eq!(
        s.history().last(),
        Some(&SequenceEvent::SpeculativeApplied {
            accepted: 2,
            scheduled: 6,
            blocks_released: 1
        })
    );
    // Accepting nothing keeps the dangling token dangling.
    s.schedule_speculative(1, &mut t).unwrap();
    assert_eq!(
        s.apply_speculative(&[], &mut t).unwrap(),
        DecodeOutcome::Continue
    );
    assert_eq!(s.tail_tokens(), 1);
    t.check_invariants().unwrap();
}

#[test]
fn revert_restores_the_state_before_schedule() {
    let mut t = table(4, 16);
    let mut s = seq(8, 4);
    let (before, free) = (s.clone(), t.free_pages());
    s.schedule_prefill(8, &mut t).unwrap();
    s.revert_schedule(&mut t).unwrap();
    assert_eq!(
        (s.row(), s.kv_position(), s.state()),
        (before.row(), 0, SequenceState::Idle)
    );
    assert_eq!(
        (t.free_pages(), t.num_allocated()),
        (free, 0),
        "the acquired row went back too"
    );
    let mut s = prefilled(&mut t, 8, 4);
    let pages = t.pages(s.row().unwrap()).to_vec();
    s.schedule_decode(&mut t).unwrap();
    s.revert_schedule(&mut t).unwrap();
    assert_eq!(t.pages(s.row().unwrap()), pages);
    assert_eq!(
        s.history().last(),
        Some(&SequenceEvent::ScheduleReverted { blocks_released: 1 })
    );
}

#[test]
fn preemption_reacquires_with_prefix_reuse_then_recomputes() {
    let mut t = table(4, 16);
    let mut s = prefilled(&mut t, 10, 8); // kv 10: pages 0..2 full (8 tokens) published
    for tok in [1, 2, 3] {
        s.schedule_decode(&mut t).unwrap();
        s.apply_decode(tok, &mut t).unwrap();
    }
    assert_eq!((s.kv_position(), s.total_tokens()), (13, 14));
    s.release(&mut t).unwrap();
    assert_eq!(
        (s.kv_position(), t.num_allocated(), t.cached_pages()),
        (0, 0, 3)
    );
    assert!(s.reacquire(&mut t).unwrap());
    assert_eq!(s.kv_position(), 12, "three cached pages reused");
    assert_eq!(s.prefill_end(), 13);
    assert!(s.needs_prefill());
    assert_eq!(
        refused(&mut s, &mut t, |s, t| s.schedule_decode(t)),
        ScheduleError::WrongDanglingCount {
            expected: 1,
            actual: 2
        }
    );
    // Recompute chunk: no token, even though it is the last chunk of the range.
    s.schedule_prefill(1, &mut t).unwrap();
    assert_eq!(
        refused(&mut s, &mut t, |s, t| s.apply_prefill(Some(4), t)),
        ApplyError::TokenOnNonFinalChunk
    );
    s.apply_prefill(None, &mut t).unwrap();
    assert_eq!(s.tail_tokens(), 1);
    s.schedule_decode(&mut t).unwrap();
    s.apply_decode(4, &mut t).unwrap();
    let kinds: Vec<_> = s.history().iter().map(std::mem::discriminant).collect();
    assert_eq!(kinds.len(), 1 + 2 + 6 + 1 + 1 + 2 + 2);
    assert_eq!(
        s.history()[10],
        SequenceEvent::Reacquired {
            prefix_matched: 3,
            success: true
        }
    );
    s.release(&mut t).unwrap();
    t.check_invariants().unwrap();
}

#[test]
fn reacquire_without_capacity_holds_nothing() {
    let mut t = table(2, 4);
    let mut s = prefilled(&mut t, 8, 4);
    s.release(&mut t).unwrap();
    let mut hog = seq(16, 1);
    hog.schedule_prefill(16, &mut t).unwrap(); // evicts the cached pages and takes the only row
    assert!(!s.reacquire(&mut t).unwrap());
    assert_eq!(s.row(), None);
    assert_eq!(
        s.history().last(),
        Some(&SequenceEvent::Reacquired {
            prefix_matched: 0,
            success: false
        })
    );
    t.check_invariants().unwrap();
}

#[test]
fn revert_after_eviction_restores_the_sequence_and_the_counts() {
    let mut t = table(3, 4);
    let mut a = prefilled(&mut t, 8, 1); // publishes 2 pages
    a.release(&mut t).unwrap();
    assert_eq!((t.free_pages(), t.cached_pages()), (2, 2));
    let mut b = SchedulableSequence::new((50..62).collect(), 4).unwrap();
    let before = b.clone();
    b.schedule_prefill(12, &mut t).unwrap(); // 3 pages: 2 free + 1 evicted
    assert_eq!(t.cached_pages(), 1);
    b.revert_schedule(&mut t).unwrap();
    assert_eq!(
        (b.kv_position(), b.row(), b.state()),
        (before.kv_position(), None, SequenceState::Idle)
    );
    // The evicted entry is gone for good; the pages are all back.
    assert_eq!(
        (t.free_pages(), t.cached_pages(), t.used_pages()),
        (3, 1, 0)
    );
    t.check_invariants().unwrap();
}
