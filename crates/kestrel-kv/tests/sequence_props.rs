//! Property tests of [`SchedulableSequence`] driving several sequences over one small table.
//!
//! Random operations (prefix match, chunked prefill, decode, speculative accept, revert,
//! append, release, reacquire, drop_unassigned, release_all, plus a guided `Step` that makes
//! progress) with simulated KV memory written by the "kernel" at each launch. After every
//! operation: a refused call changed nothing, a successful one appended exactly the predicted
//! event, schedule-then-revert restores the exact table and sequence, the table audit passes,
//! `num_allocated` equals the sequences holding rows, and every row still holds its tokens' KV.

use kestrel_kv::{PageTable, PageTableConfig, SchedulableSequence, SequenceEvent, SequenceState};
use proptest::prelude::*;

const PS: usize = 4;
const PAGES: usize = 12;
const ROWS: usize = 4;
const SEQS: usize = 4;
const GARBAGE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
enum Kind {
    Prefill(usize),
    Decode,
    Speculative(usize),
}

#[derive(Debug, Clone)]
enum Op {
    Match(usize),
    SchedulePrefill(usize, usize),
    ApplyPrefill(usize, bool),
    ScheduleDecode(usize),
    ApplyDecode(usize),
    ScheduleSpeculative(usize, usize),
    ApplySpeculative(usize, usize),
    Revert(usize),
    /// Schedule then revert at once: the table must come back bit for bit.
    Bounce(usize, Kind),
    Append(usize, usize),
    DropUnassigned(usize),
    Release(usize),
    Reacquire(usize),
    /// Toggle a scratch row holding every free page, so allocations must evict cached pages.
    Squeeze,
    /// The natural next call for the sequence; keeps runs from stalling on errors.
    Step(usize),
    ReleaseAll,
}

fn op() -> impl Strategy<Value = Op> {
    let i = 0..SEQS;
    let kind = prop_oneof![
        (0..9usize).prop_map(Kind::Prefill),
        Just(Kind::Decode),
        (0..6usize).prop_map(Kind::Speculative)
    ];
    prop_oneof![
        1 => i.clone().prop_map(Op::Match),
        2 => (i.clone(), 0..10usize).prop_map(|(s, n)| Op::SchedulePrefill(s, n)),
        2 => (i.clone(), any::<bool>()).prop_map(|(s, t)| Op::ApplyPrefill(s, t)),
        1 => i.clone().prop_map(Op::ScheduleDecode),
        1 => i.clone().prop_map(Op::ApplyDecode),
        1 => (i.clone(), 0..6usize).prop_map(|(s, n)| Op::ScheduleSpeculative(s, n)),
        1 => (i.clone(), 0..7usize).prop_map(|(s, m)| Op::ApplySpeculative(s, m)),
        1 => i.clone().prop_map(Op::Revert),
        2 => (i.clone(), kind).prop_map(|(s, k)| Op::Bounce(s, k)),
        1 => (i.clone(), 0..4usize).prop_map(|(s, n)| Op::Append(s, n)),
        1 => i.clone().prop_map(Op::DropUnassigned),
        1 => i.clone().prop_map(Op::Release),
        1 => i.clone().prop_map(Op::Reacquire),
        16 => i.prop_map(Op::Step),
        1 => Just(Op::ReleaseAll),
        1 => Just(Op::Squeeze),
    ]
}

struct Harness {
    table: PageTable,
    seqs: Vec<SchedulableSequence>,
    /// Row pages when each sequence's current step was scheduled (for interleaved reverts).
    scheduled_pages: Vec<Option<Vec<u32>>>,
    kv: Vec<u32>,
    next: u32,
    /// Row taken by `Squeeze`, not owned by any sequence.
    scratch: Option<u32>,
}

impl Harness {
    fn new() -> Self {
        let table = PageTable::new(PageTableConfig {
            max_rows: ROWS,
            num_pages: PAGES,
            page_size: PS,
            enable_prefix_cache: true,
        })
        .unwrap();
        let mut h = Self {
            table,
            seqs: Vec::new(),
            scheduled_pages: vec![None; SEQS],
            kv: vec![GARBAGE; PAGES * PS],
            next: 0,
            scratch: None,
        };
        h.seqs = (0..SEQS).map(|i| h.fresh(i)).collect();
        h
    }

    /// A new sequence; prompts of neighbouring ids share a prefix so the cache gets hits.
    fn fresh(&mut self, i: usize) -> SchedulableSequence {
        self.next += 1;
        let len = 3 + (self.next as usize * 7) % 14;
        let prompt = (0..len)
            .map(|p| {
                if p < 4 * (i % 3 + 1) {
                    p as u32
                } else {
                    self.next * 100 + p as u32
                }
            })
            .collect();
        SchedulableSequence::new(prompt, 1 + (self.next as usize) % 9).unwrap()
    }

    fn token(&mut self) -> u32 {
        self.next += 1;
        1_000_000 + self.next
    }

    /// The kernel writes KV for `tokens` at positions `from..` of sequence `i`'s row.
    fn write(&mut self, i: usize, from: usize, tokens: &[u32]) {
        let row = self.seqs[i].row().unwrap();
        for (k, &tok) in tokens.iter().enumerate() {
            let pos = from + k;
            let page = self.table.pages(row)[pos / PS];
            assert_eq!(
                self.table.refcount(page),
                1,
                "kernel write into shared page"
            );
            assert!(
                pos / PS >= self.table.sealed_pages(row),
                "kernel write into a sealed page"
            );
            self.kv[page as usize * PS + pos % PS] = tok;
        }
    }

    fn held_pages(&self, i: usize) -> usize {
        self.seqs[i].row().map_or(0, |r| self.table.pages(r).len())
    }

    /// Runs one op and checks what it did to the sequence's history and the table.
    fn apply(&mut self, op: &Op) {
        let i = match *op {
            Op::Squeeze => {
                if let Some(row) = self.scratch.take() {
                    self.table.erase(row).unwrap();
                } else if let Ok(row) = self.table.allocate() {
                    let free = self.table.free_pages();
                    self.table.reserve(row, free * PS).unwrap();
                    assert_eq!(self.table.free_pages(), 0);
                    self.scratch = Some(row);
                }
                return;
            }
            Op::ReleaseAll => {
                self.scratch = None;
                self.table.release_all();
                for i in 0..SEQS {
                    if self.seqs[i].state() == SequenceState::Idle {
                        // A stale lease is forgotten without touching the table.
                        self.seqs[i].release(&mut self.table).unwrap();
                    }
                    self.seqs[i] = self.fresh(i);
                    self.scheduled_pages[i] = None;
                }
                return;
            }
            Op::Match(i)
            | Op::SchedulePrefill(i, _)
            | Op::ApplyPrefill(i, _)
            | Op::ScheduleDecode(i) => i,
            Op::ApplyDecode(i)
            | Op::ScheduleSpeculative(i, _)
            | Op::ApplySpeculative(i, _)
            | Op::Revert(i) => i,
            Op::Bounce(i, _) | Op::Append(i, _) | Op::DropUnassigned(i) | Op::Release(i) => i,
            Op::Reacquire(i) | Op::Step(i) => i,
        };
        let op = match op {
            Op::Step(_) => self.step(i),
            op => op.clone(),
        };
        let before = self.seqs[i].clone();
        let table_before = self.table.clone();
        let expected = self.run(i, &op);
        let s = &self.seqs[i];
        match expected {
            Err(()) => {
                assert_eq!(*s, before, "refused {op:?} changed the sequence");
                assert_eq!(self.table, table_before, "refused {op:?} changed the table");
            }
            Ok(events) => assert_eq!(
                &s.history()[before.history().len()..],
                events.as_slice(),
                "{op:?}"
            ),
        }
        match s.state() {
            SequenceState::Idle => self.scheduled_pages[i] = None,
            _ if before.state() == SequenceState::Idle => {
                self.scheduled_pages[i] = Some(self.table.pages(s.row().unwrap()).to_vec());
            }
            _ => {}
        }
    }

    /// The next call that makes progress.
    fn step(&mut self, i: usize) -> Op {
        let s = &self.seqs[i];
        match s.state() {
            SequenceState::PrefillScheduled { num_tokens, .. } => {
                let wants = s.kv_position() + num_tokens >= s.prefill_end()
                    && s.generated_tokens() == 0
                    && s.max_output_tokens() > 0;
                Op::ApplyPrefill(i, wants)
            }
            SequenceState::DecodeScheduled { .. } => Op::ApplyDecode(i),
            SequenceState::SpeculativeScheduled { num_tokens, .. } => {
                Op::ApplySpeculative(i, num_tokens.div_ceil(2))
            }
            SequenceState::Idle if s.is_complete() && s.tail_tokens() <= 1 => {
                self.seqs[i].release(&mut self.table).unwrap();
                self.seqs[i] = self.fresh(i);
                Op::Match(i)
            }
            SequenceState::Idle if s.row().is_none() && s.generated_tokens() > 0 => {
                Op::Reacquire(i)
            }
            SequenceState::Idle if s.row().is_none() => Op::Match(i),
            SequenceState::Idle if s.needs_prefill() => {
                Op::SchedulePrefill(i, (s.prefill_end() - s.kv_position()).min(6))
            }
            SequenceState::Idle if s.kv_position().is_multiple_of(3) => {
                Op::ScheduleSpeculative(i, 3)
            }
            SequenceState::Idle => Op::ScheduleDecode(i),
        }
    }

    /// Performs `op` on sequence `i`; `Err(())` if refused, else the events it must append.
    fn run(&mut self, i: usize, op: &Op) -> Result<Vec<SequenceEvent>, ()> {
        let (kv, held) = (self.seqs[i].kv_position(), self.held_pages(i));
        let t = &mut self.table;
        let s = &self.seqs[i];
        match *op {
            Op::Match(_) => {
                let peek = t.peek_prefix(s.tokens()) / PS;
                let blocks_matched = self.seqs[i].match_and_add_prefix(t).map_err(drop)?;
                assert_eq!(blocks_matched, peek);
                Ok(vec![SequenceEvent::PrefixMatched { blocks_matched }])
            }
            Op::SchedulePrefill(_, n) => {
                let blocks_allocated = s.pages_needed_for(kv + n, t);
                self.seqs[i].schedule_prefill(n, t).map_err(drop)?;
                Ok(vec![SequenceEvent::PrefillScheduled {
                    num_tokens: n,
                    blocks_allocated,
                }])
            }
            Op::ApplyPrefill(_, with_token) => {
                if let SequenceState::PrefillScheduled { num_tokens, .. } = s.state() {
                    let tokens = s.tokens()[kv..kv + num_tokens].to_vec();
                    self.write(i, kv, &tokens);
                }
                let token = with_token.then(|| self.token());
                let (t, s) = (&mut self.table, &mut self.seqs[i]);
                let sealed = s.row().map_or(0, |r| t.sealed_pages(r));
                s.apply_prefill(token, t).map_err(drop)?;
                let SequenceEvent::PrefillApplied { num_tokens, .. } = *s.history().last().unwrap()
                else {
                    panic!()
                };
                let blocks_registered = s.kv_position() / PS - sealed;
                Ok(vec![SequenceEvent::PrefillApplied {
                    num_tokens,
                    blocks_registered,
                    token_emitted: with_token,
                }])
            }
            Op::ScheduleDecode(_) => {
                let blocks_allocated = s.pages_needed_for(kv + 1, t);
                self.seqs[i].schedule_decode(t).map_err(drop)?;
                Ok(vec![SequenceEvent::DecodeScheduled { blocks_allocated }])
            }
            Op::ApplyDecode(_) => {
                if let SequenceState::DecodeScheduled { .. } = s.state() {
                    let dangling = [s.tokens()[kv]];
                    self.write(i, kv, &dangling);
                }
                let token = self.token();
                self.seqs[i]
                    .apply_decode(token, &mut self.table)
                    .map_err(drop)?;
                Ok(vec![SequenceEvent::DecodeApplied {
                    token,
                    block_completed: (kv + 1) % PS == 0,
                }])
            }
            Op::ScheduleSpeculative(_, k) => {
                let num_tokens = k.min(s.remaining_tokens());
                let blocks_allocated = s.pages_needed_for(kv + 1 + num_tokens, t);
                self.seqs[i].schedule_speculative(k, t).map_err(drop)?;
                Ok(vec![SequenceEvent::SpeculativeScheduled {
                    num_tokens,
                    blocks_allocated,
                }])
            }
            Op::ApplySpeculative(_, m) => {
                let accepted: Vec<u32> = (0..m).map(|_| self.token()).collect();
                let s = &self.seqs[i];
                let scheduled = match s.state() {
                    SequenceState::SpeculativeScheduled { num_tokens, .. } => num_tokens,
                    _ => usize::MAX,
                };
                if scheduled != usize::MAX {
                    self.write(i, kv, &vec![GARBAGE; scheduled + 1]); // drafts, launched
                    if m <= scheduled {
                        let mut verified = vec![self.seqs[i].tokens()[kv]];
                        verified.extend_from_slice(&accepted[..m.saturating_sub(1)]);
                        self.write(i, kv, &verified[..m]);
                    }
                }
                let (t, s) = (&mut self.table, &mut self.seqs[i]);
                s.apply_speculative(&accepted, t).map_err(drop)?;
                let blocks_released = held - t.pages_for(s.total_tokens());
                Ok(vec![SequenceEvent::SpeculativeApplied {
                    accepted: m,
                    scheduled,
                    blocks_released,
                }])
            }
            Op::Revert(_) => {
                let pages = self.scheduled_pages[i].clone();
                let blocks_released = match s.state() {
                    SequenceState::PrefillScheduled {
                        blocks_allocated, ..
                    }
                    | SequenceState::DecodeScheduled { blocks_allocated }
                    | SequenceState::SpeculativeScheduled {
                        blocks_allocated, ..
                    } => blocks_allocated,
                    SequenceState::Idle => 0,
                };
                let (t, s) = (&mut self.table, &mut self.seqs[i]);
                s.revert_schedule(t).map_err(drop)?;
                if let Some(row) = s.row() {
                    let now = t.pages(row);
                    assert_eq!(now, &pages.unwrap()[..now.len()]);
                    assert_eq!(now.len(), held - blocks_released);
                }
                Ok(vec![SequenceEvent::ScheduleReverted { blocks_released }])
            }
            Op::Bounce(_, kind) => self.bounce(i, kind),
            Op::Append(_, n) => {
                let tokens: Vec<u32> = (0..n).map(|_| self.token()).collect();
                self.seqs[i].append_tokens(&tokens).map_err(drop)?;
                Ok(vec![SequenceEvent::TokensAppended { count: n }])
            }
            Op::DropUnassigned(_) => {
                let count = self.seqs[i]
                    .drop_unassigned(&mut self.table)
                    .map_err(drop)?;
                assert_eq!(count, held.saturating_sub(kv.div_ceil(PS)));
                Ok(if count > 0 {
                    vec![SequenceEvent::UnassignedDropped { count }]
                } else {
                    vec![]
                })
            }
            Op::Release(_) => {
                self.seqs[i].release(t).map_err(drop)?;
                Ok(vec![SequenceEvent::Released])
            }
            Op::Reacquire(_) => {
                let row_free = t.num_allocated() < ROWS - 1;
                let prefix_matched = if row_free {
                    t.peek_prefix(s.tokens()) / PS
                } else {
                    0
                };
                let success = self.seqs[i].reacquire(t).map_err(drop)?;
                assert!(row_free || !success);
                Ok(vec![SequenceEvent::Reacquired {
                    prefix_matched,
                    success,
                }])
            }
            Op::Step(_) | Op::ReleaseAll | Op::Squeeze => unreachable!("resolved by apply"),
        }
    }

    fn bounce(&mut self, i: usize, kind: Kind) -> Result<Vec<SequenceEvent>, ()> {
        let (seq0, table0) = (self.seqs[i].clone(), self.table.clone());
        let (t, s) = (&mut self.table, &mut self.seqs[i]);
        match kind {
            Kind::Prefill(n) => s.schedule_prefill(n, t).map_err(drop)?,
            Kind::Decode => s.schedule_decode(t).map_err(drop)?,
            Kind::Speculative(k) => s.schedule_speculative(k, t).map_err(drop)?,
        }
        let evicted = t.cached_pages() < table0.cached_pages();
        let sched_event = s.history().last().unwrap().clone();
        let blocks_released = match s.state() {
            SequenceState::PrefillScheduled {
                blocks_allocated, ..
            }
            | SequenceState::DecodeScheduled { blocks_allocated }
            | SequenceState::SpeculativeScheduled {
                blocks_allocated, ..
            } => blocks_allocated,
            SequenceState::Idle => panic!("scheduled sequence is idle"),
        };
        s.revert_schedule(t).unwrap();
        let view =
            |s: &SchedulableSequence| (s.tokens().to_vec(), s.kv_position(), s.state(), s.row());
        assert_eq!(view(s), view(&seq0), "revert did not restore the sequence");
        if evicted {
            // Evicted cache entries are not resurrected; everything else is restored.
            assert_eq!(t.used_pages(), table0.used_pages());
            assert_eq!(
                t.free_pages() + t.cached_pages(),
                table0.free_pages() + table0.cached_pages()
            );
            assert_eq!(t.num_allocated(), table0.num_allocated());
        } else {
            assert_eq!(*t, table0, "revert did not restore the table exactly");
        }
        Ok(vec![
            sched_event,
            SequenceEvent::ScheduleReverted { blocks_released },
        ])
    }

    fn check(&self) {
        let t = &self.table;
        t.check_invariants().unwrap();
        assert_eq!(t.free_pages() + t.used_pages() + t.cached_pages(), PAGES);
        let holding = self.seqs.iter().filter(|s| s.row().is_some()).count()
            + usize::from(self.scratch.is_some());
        assert_eq!(t.num_allocated(), holding, "num_allocated != rows in use");
        for s in &self.seqs {
            assert!(s.kv_position() <= s.total_tokens());
            let Some(row) = s.row() else {
                assert_eq!(s.kv_position(), 0);
                continue;
            };
            let pages = t.pages(row);
            assert!(pages.len() >= t.pages_for(s.kv_position()));
            if s.state() == SequenceState::Idle {
                assert!(
                    pages.len() <= t.pages_for(s.total_tokens()),
                    "idle row holds surplus pages"
                );
            }
            for (pos, &tok) in s.tokens()[..s.kv_position()].iter().enumerate() {
                let slot = pages[pos / PS] as usize * PS + pos % PS;
                assert_eq!(self.kv[slot], tok, "row {row} reads wrong KV at {pos}");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn sequences_match_model(ops in prop::collection::vec(op(), 1..120)) {
        let mut h = Harness::new();
        for op in &ops {
            h.apply(op);
            h.check();
        }
    }
}
