//! [`SchedulableSequence`]: the two-phase schedule/apply state machine of one request over a
//! [`PageTable`] (the design's "manager").
//!
//! Invariants: `kv_position <= total_tokens`; in `Idle` the row holds at most the pages for
//! `total_tokens` and at least those for `kv_position`; a failed call changes nothing; every
//! successful transition appends one [`SequenceEvent`]. Each call is O(pages it touches).

mod types;

pub use types::{ApplyError, DecodeOutcome, ScheduleError, SequenceEvent, SequenceState};

use crate::{KvError, PageTable, RowId};

/// A row held by a sequence, stamped with the page table's epoch so that a lease that
/// outlived [`PageTable::release_all`] is recognised and never erases someone else's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Lease {
    row: RowId,
    epoch: u64,
}

/// One request's tokens and KV progress, driven through `schedule_*` then `apply_*` (or
/// `revert_schedule`), with chunked prefill, speculative decode and preemption.
///
/// **Tail-token rule.** `kv_position` counts tokens whose KV is computed; `tail_tokens() =
/// total_tokens - kv_position`. After the final prefill chunk the first generated token is
/// dangling (`tail_tokens() == 1`), and every decode or speculative step keeps it at 1.
///
/// **Prefill range.** Prefill computes KV up to [`prefill_end`](Self::prefill_end): the prompt
/// for a fresh sequence, and every token but the dangling one after a preemption (the
/// recompute). Only the chunk that first completes the prompt carries a generated token.
///
/// **Preemption.** [`release`](Self::release) gives the row back (published pages stay cached);
/// [`reacquire`](Self::reacquire) takes a row, reuses the cached prefix and reserves the pages
/// for the recompute; prefill chunks then recompute the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulableSequence {
    tokens: Vec<u32>,
    num_input_tokens: usize,
    max_output_tokens: usize,
    state: SequenceState,
    kv_position: usize,
    lease: Option<Lease>,
    history: Vec<SequenceEvent>,
}

fn alloc_failed(source: KvError) -> ScheduleError {
    match source {
        KvError::NoFreeRow { .. } | KvError::OutOfPages { .. } => {
            ScheduleError::AllocationFailed { source }
        }
        source => ScheduleError::Table { source },
    }
}

fn table_err(source: KvError) -> ApplyError {
    ApplyError::Table { source }
}

impl SchedulableSequence {
    /// A fresh, idle sequence holding no row.
    ///
    /// # Errors
    /// [`ScheduleError::EmptyInput`] for an empty prompt.
    pub fn new(input_tokens: Vec<u32>, max_output_tokens: usize) -> Result<Self, ScheduleError> {
        if input_tokens.is_empty() {
            return Err(ScheduleError::EmptyInput);
        }
        let num_input_tokens = input_tokens.len();
        let mut tokens = input_tokens;
        tokens.reserve(max_output_tokens);
        Ok(Self {
            tokens,
            num_input_tokens,
            max_output_tokens,
            state: SequenceState::Idle,
            kv_position: 0,
            lease: None,
            history: vec![SequenceEvent::Created {
                num_input_tokens,
                max_output_tokens,
            }],
        })
    }

    // ----- accessors -------------------------------------------------------------------

    /// Current protocol state.
    pub fn state(&self) -> SequenceState {
        self.state
    }

    /// Every token: prompt then generated.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Prompt length.
    pub fn num_input_tokens(&self) -> usize {
        self.num_input_tokens
    }

    /// Output budget.
    pub fn max_output_tokens(&self) -> usize {
        self.max_output_tokens
    }

    /// Tokens generated so far.
    pub fn generated_tokens(&self) -> usize {
        self.tokens.len() - self.num_input_tokens
    }

    /// Output tokens still allowed.
    pub fn remaining_tokens(&self) -> usize {
        self.max_output_tokens
            .saturating_sub(self.generated_tokens())
    }

    /// Prompt plus generated tokens.
    pub fn total_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Tokens whose KV is computed (and held by the row).
    pub fn kv_position(&self) -> usize {
        self.kv_position
    }

    /// Tokens without KV: 1 (the dangling token) once decoding, more during prefill.
    pub fn tail_tokens(&self) -> usize {
        self.tokens.len() - self.kv_position
    }

    /// Where prefill ends: the prompt length before the first token is generated, every
    /// token but the dangling one afterwards (the recompute range after a preemption, or
    /// the tokens added by [`append_tokens`](Self::append_tokens)).
    pub fn prefill_end(&self) -> usize {
        if self.generated_tokens() == 0 {
            self.num_input_tokens
        } else {
            self.tokens.len() - 1
        }
    }

    /// Whether the prompt has KV (decode may start once the tail is 1).
    pub fn is_prefill_complete(&self) -> bool {
        self.kv_position >= self.num_input_tokens
    }

    /// Whether `schedule_prefill` has work: the prefill range (prompt, or recompute after a
    /// preemption, or tokens added by [`append_tokens`](Self::append_tokens)) lacks KV.
    pub fn needs_prefill(&self) -> bool {
        self.kv_position < self.prefill_end()
    }

    /// Whether the output budget is spent.
    pub fn is_complete(&self) -> bool {
        self.generated_tokens() >= self.max_output_tokens
    }

    /// The row held, if any (possibly stale after [`PageTable::release_all`]).
    pub fn row(&self) -> Option<RowId> {
        self.lease.map(|l| l.row)
    }

    /// Every transition so far, oldest first.
    pub fn history(&self) -> &[SequenceEvent] {
        &self.history
    }

    /// The KV length the kernel attends over for the scheduled step (the `kv_len` to pass
    /// to [`PageTable::write_indices`]); `None` when idle.
    pub fn scheduled_kv_len(&self) -> Option<usize> {
        match self.state {
            SequenceState::Idle => None,
            SequenceState::PrefillScheduled { num_tokens, .. } => {
                Some(self.kv_position + num_tokens)
            }
            SequenceState::DecodeScheduled { .. } => Some(self.kv_position + 1),
            SequenceState::SpeculativeScheduled { num_tokens, .. } => {
                Some(self.kv_position + 1 + num_tokens)
            }
        }
    }

    /// Pages a `schedule_*` reaching `kv_len` tokens would allocate: O(1), for the
    /// scheduler's capacity checks (compare with [`PageTable::available_pages`]). A sequence
    /// without a row also needs a free row.
    pub fn pages_needed_for(&self, kv_len: usize, table: &PageTable) -> usize {
        let held = self
            .live_row(table)
            .ok()
            .flatten()
            .map_or(0, |row| table.pages(row).len());
        table.pages_for(kv_len).saturating_sub(held)
    }

    // ----- helpers ---------------------------------------------------------------------

    /// The row, if held and not stale.
    fn live_row(&self, table: &PageTable) -> Result<Option<RowId>, RowId> {
        match self.lease {
            Some(Lease { row, epoch }) if epoch != table.epoch() => Err(row),
            lease => Ok(lease.map(|l| l.row)),
        }
    }

    fn require_idle(&self) -> Result<(), ScheduleError> {
        match self.state {
            SequenceState::Idle => Ok(()),
            state => Err(ScheduleError::NotIdle { state }),
        }
    }

    fn require_idle_for_apply(&self) -> Result<(), ApplyError> {
        match self.state {
            SequenceState::Idle => Ok(()),
            actual => Err(ApplyError::WrongState {
                expected: "Idle",
                actual,
            }),
        }
    }

    /// The checks shared by `schedule_decode` and `schedule_speculative`, in the doc's
    /// order; returns the row.
    fn require_decodable(&self, table: &PageTable) -> Result<RowId, ScheduleError> {
        self.require_idle()?;
        let row = self
            .live_row(table)
            .map_err(|row| ScheduleError::StaleLease { row })?;
        if !self.is_prefill_complete() {
            return Err(ScheduleError::PrefillNotComplete {
                position: self.kv_position,
                num_input_tokens: self.num_input_tokens,
            });
        }
        if self.is_complete() {
            return Err(ScheduleError::GenerationComplete {
                generated: self.generated_tokens(),
                max_output: self.max_output_tokens,
            });
        }
        if self.tail_tokens() != 1 {
            return Err(ScheduleError::WrongDanglingCount {
                expected: 1,
                actual: self.tail_tokens(),
            });
        }
        // kv_position >= num_input_tokens >= 1 implies a row: release() resets kv_position.
        row.ok_or(ScheduleError::PrefillNotComplete {
            position: self.kv_position,
            num_input_tokens: self.num_input_tokens,
        })
    }

    fn applied_row(&self, table: &PageTable) -> Result<RowId, ApplyError> {
        match self.live_row(table) {
            Ok(Some(row)) => Ok(row),
            Ok(None) => Err(ApplyError::WrongState {
                expected: "a sequence holding a row",
                actual: self.state,
            }),
            Err(row) => Err(ApplyError::StaleLease { row }),
        }
    }

    /// Grows `row` to `kv_len`, returning the pages allocated.
    fn grow(table: &mut PageTable, row: RowId, kv_len: usize) -> Result<usize, KvError> {
        let before = table.pages(row).len();
        table.reserve(row, kv_len)?;
        Ok(table.pages(row).len() - before)
    }

    /// Publishes newly full pages of computed KV; returns how many were sealed.
    fn publish(&self, table: &mut PageTable, row: RowId) -> usize {
        let before = table.sealed_pages(row);
        table.register_prefix(row, &self.tokens[..self.kv_position]);
        table.sealed_pages(row) - before
    }

    // ----- prefix ----------------------------------------------------------------------

    /// Takes a row and shares the longest cached prefix of the sequence's tokens (full pages,
    /// always leaving one token to compute). Returns the pages matched; `kv_position`
    /// advances by `matched * page_size`.
    ///
    /// # Errors
    /// [`ScheduleError::NotIdle`], [`ScheduleError::RowAlreadyHeld`],
    /// [`ScheduleError::AllocationFailed`] (no free row).
    pub fn match_and_add_prefix(&mut self, table: &mut PageTable) -> Result<usize, ScheduleError> {
        self.require_idle()?;
        if let Some(Lease { row, .. }) = self.lease {
            return Err(ScheduleError::RowAlreadyHeld { row });
        }
        let (row, hit) = table
            .allocate_with_prefix(&self.tokens)
            .map_err(alloc_failed)?;
        self.lease = Some(Lease {
            row,
            epoch: table.epoch(),
        });
        self.kv_position = hit;
        let blocks_matched = hit / table.page_size();
        self.history
            .push(SequenceEvent::PrefixMatched { blocks_matched });
        Ok(blocks_matched)
    }

    // ----- prefill ---------------------------------------------------------------------

    /// Schedules a prefill chunk of `num_tokens` tokens, taking a row if the sequence has
    /// none and growing it to `kv_position + num_tokens`.
    ///
    /// # Errors
    /// [`ScheduleError::NotIdle`], [`ScheduleError::PrefillComplete`],
    /// [`ScheduleError::PrefillOverrun`], [`ScheduleError::AllocationFailed`],
    /// [`ScheduleError::StaleLease`].
    pub fn schedule_prefill(
        &mut self,
        num_tokens: usize,
        table: &mut PageTable,
    ) -> Result<(), ScheduleError> {
        self.require_idle()?;
        let held = self
            .live_row(table)
            .map_err(|row| ScheduleError::StaleLease { row })?;
        let (position, prefill_end) = (self.kv_position, self.prefill_end());
        if position >= prefill_end {
            return Err(ScheduleError::PrefillComplete {
                position,
                prefill_end,
            });
        }
        if position + num_tokens > prefill_end {
            return Err(ScheduleError::PrefillOverrun {
                position,
                num_tokens,
                prefill_end,
            });
        }
        let row = match held {
            Some(row) => row,
            None => table.allocate().map_err(alloc_failed)?,
        };
        let blocks_allocated = match Self::grow(table, row, position + num_tokens) {
            Ok(n) => n,
            Err(e) => {
                if held.is_none() {
                    table.erase(row).map_err(alloc_failed)?;
                }
                return Err(alloc_failed(e));
            }
        };
        self.lease = Some(Lease {
            row,
            epoch: table.epoch(),
        });
        self.state = SequenceState::PrefillScheduled {
            num_tokens,
            blocks_allocated,
            row_acquired: held.is_none(),
        };
        self.history.push(SequenceEvent::PrefillScheduled {
            num_tokens,
            blocks_allocated,
        });
        Ok(())
    }

    /// Commits the scheduled prefill chunk: its KV is computed. `token` is the first
    /// generated token, required on the chunk that completes the prompt and refused on any
    /// other. Publishes newly full pages to the prefix cache.
    ///
    /// # Errors
    /// [`ApplyError::WrongState`], [`ApplyError::TokenOnNonFinalChunk`],
    /// [`ApplyError::MissingTokenOnFinalChunk`], [`ApplyError::StaleLease`].
    pub fn apply_prefill(
        &mut self,
        token: Option<u32>,
        table: &mut PageTable,
    ) -> Result<(), ApplyError> {
        let SequenceState::PrefillScheduled { num_tokens, .. } = self.state else {
            return Err(ApplyError::WrongState {
                expected: "PrefillScheduled",
                actual: self.state,
            });
        };
        let row = self.applied_row(table)?;
        let is_final = self.kv_position + num_tokens >= self.prefill_end();
        let wants_token = is_final && self.generated_tokens() == 0 && self.max_output_tokens > 0;
        match (token, wants_token) {
            (Some(_), false) => return Err(ApplyError::TokenOnNonFinalChunk),
            (None, true) => return Err(ApplyError::MissingTokenOnFinalChunk),
            _ => {}
        }
        self.kv_position += num_tokens;
        let blocks_registered = self.publish(table, row);
        self.tokens.extend(token);
        self.state = SequenceState::Idle;
        self.history.push(SequenceEvent::PrefillApplied {
            num_tokens,
            blocks_registered,
            token_emitted: token.is_some(),
        });
        Ok(())
    }

    // ----- decode ----------------------------------------------------------------------

    /// Schedules one decode step: the dangling token's KV, growing the row to
    /// `kv_position + 1`.
    ///
    /// # Errors
    /// [`ScheduleError::NotIdle`], [`ScheduleError::PrefillNotComplete`],
    /// [`ScheduleError::GenerationComplete`], [`ScheduleError::WrongDanglingCount`],
    /// [`ScheduleError::AllocationFailed`], [`ScheduleError::StaleLease`].
    pub fn schedule_decode(&mut self, table: &mut PageTable) -> Result<(), ScheduleError> {
        let row = self.require_decodable(table)?;
        let blocks_allocated =
            Self::grow(table, row, self.kv_position + 1).map_err(alloc_failed)?;
        self.state = SequenceState::DecodeScheduled { blocks_allocated };
        self.history
            .push(SequenceEvent::DecodeScheduled { blocks_allocated });
        Ok(())
    }

    /// Commits the decode step: the dangling token has KV and `token` becomes the new
    /// dangling token.
    ///
    /// # Errors
    /// [`ApplyError::WrongState`], [`ApplyError::StaleLease`].
    pub fn apply_decode(
        &mut self,
        token: u32,
        table: &mut PageTable,
    ) -> Result<DecodeOutcome, ApplyError> {
        let SequenceState::DecodeScheduled { .. } = self.state else {
            return Err(ApplyError::WrongState {
                expected: "DecodeScheduled",
                actual: self.state,
            });
        };
        let row = self.applied_row(table)?;
        self.kv_position += 1;
        let block_completed = self.kv_position.is_multiple_of(table.page_size());
        self.publish(table, row);
        self.tokens.push(token);
        self.state = SequenceState::Idle;
        self.history.push(SequenceEvent::DecodeApplied {
            token,
            block_completed,
        });
        Ok(DecodeOutcome::new(block_completed, self.is_complete()))
    }

    // ----- speculative decode ----------------------------------------------------------

    /// Schedules verification of `num_draft_tokens` draft tokens (clamped to the output
    /// budget): KV for the dangling token and every draft, growing the row to
    /// `kv_position + 1 + drafts`.
    ///
    /// # Errors
    /// As [`schedule_decode`](Self::schedule_decode).
    pub fn schedule_speculative(
        &mut self,
        num_draft_tokens: usize,
        table: &mut PageTable,
    ) -> Result<(), ScheduleError> {
        let row = self.require_decodable(table)?;
        let num_tokens = num_draft_tokens.min(self.remaining_tokens());
        let blocks_allocated =
            Self::grow(table, row, self.kv_position + 1 + num_tokens).map_err(alloc_failed)?;
        self.state = SequenceState::SpeculativeScheduled {
            num_tokens,
            blocks_allocated,
        };
        self.history.push(SequenceEvent::SpeculativeScheduled {
            num_tokens,
            blocks_allocated,
        });
        Ok(())
    }

    /// Commits a speculative step that accepted `accepted` tokens (at most the scheduled
    /// count). The old dangling token and all accepted tokens but the last now have KV; the
    /// last is the new dangling token. Pages beyond those the tokens need are released LIFO.
    ///
    /// # Errors
    /// [`ApplyError::WrongState`], [`ApplyError::AcceptedExceedsScheduled`],
    /// [`ApplyError::StaleLease`].
    pub fn apply_speculative(
        &mut self,
        accepted: &[u32],
        table: &mut PageTable,
    ) -> Result<DecodeOutcome, ApplyError> {
        let SequenceState::SpeculativeScheduled { num_tokens, .. } = self.state else {
            return Err(ApplyError::WrongState {
                expected: "SpeculativeScheduled",
                actual: self.state,
            });
        };
        if accepted.len() > num_tokens {
            return Err(ApplyError::AcceptedExceedsScheduled {
                accepted: accepted.len(),
                scheduled: num_tokens,
            });
        }
        let row = self.applied_row(table)?;
        let ps = table.page_size();
        let before = self.kv_position;
        self.kv_position += accepted.len();
        let block_completed = self.kv_position / ps > before / ps;
        self.tokens.extend_from_slice(accepted);
        self.publish(table, row);
        // Keeps the pages of every token, the dangling one included.
        let blocks_released = table.shrink(row, self.tokens.len()).map_err(table_err)?;
        self.state = SequenceState::Idle;
        self.history.push(SequenceEvent::SpeculativeApplied {
            accepted: accepted.len(),
            scheduled: num_tokens,
            blocks_released,
        });
        Ok(DecodeOutcome::new(block_completed, self.is_complete()))
    }

    // ----- forced tokens -----------------------------------------------------------------

    /// Appends tokens decided without the model (forced or jump-forward tokens) as
    /// generated output without KV. The tail grows, so decode is refused
    /// ([`ScheduleError::WrongDanglingCount`]) until `schedule_prefill` chunks have computed
    /// KV for all but the last of them.
    ///
    /// # Errors
    /// [`ApplyError::WrongState`] unless idle; [`ApplyError::AppendExceedsRemaining`].
    pub fn append_tokens(&mut self, tokens: &[u32]) -> Result<(), ApplyError> {
        self.require_idle_for_apply()?;
        let remaining = self.remaining_tokens();
        if tokens.len() > remaining {
            return Err(ApplyError::AppendExceedsRemaining {
                requested: tokens.len(),
                remaining,
            });
        }
        self.tokens.extend_from_slice(tokens);
        self.history.push(SequenceEvent::TokensAppended {
            count: tokens.len(),
        });
        Ok(())
    }

    // ----- revert, trim, preemption ----------------------------------------------------

    /// Undoes the scheduled step without applying it: the pages it allocated are released
    /// LIFO and a row it took is given back. The sequence is as before the `schedule_*`
    /// call; the pool is too, except for cached pages that allocation evicted.
    ///
    /// # Errors
    /// [`ApplyError::WrongState`] when nothing is scheduled; [`ApplyError::StaleLease`].
    pub fn revert_schedule(&mut self, table: &mut PageTable) -> Result<(), ApplyError> {
        let (blocks_allocated, row_acquired) = match self.state {
            SequenceState::PrefillScheduled {
                blocks_allocated,
                row_acquired,
                ..
            } => (blocks_allocated, row_acquired),
            SequenceState::DecodeScheduled { blocks_allocated }
            | SequenceState::SpeculativeScheduled {
                blocks_allocated, ..
            } => (blocks_allocated, false),
            SequenceState::Idle => {
                return Err(ApplyError::WrongState {
                    expected: "a scheduled state",
                    actual: self.state,
                })
            }
        };
        let row = self.applied_row(table)?;
        let keep = table.pages(row).len() - blocks_allocated;
        table
            .shrink(row, keep * table.page_size())
            .map_err(table_err)?;
        if row_acquired {
            table.erase(row).map_err(table_err)?;
            self.lease = None;
        }
        self.state = SequenceState::Idle;
        self.history.push(SequenceEvent::ScheduleReverted {
            blocks_released: blocks_allocated,
        });
        Ok(())
    }

    /// Releases, LIFO, the row's pages that hold no computed KV (e.g. the page reserved for
    /// the dangling token), to give memory back under pressure. Returns how many.
    ///
    /// # Errors
    /// [`ApplyError::WrongState`], [`ApplyError::StaleLease`].
    pub fn drop_unassigned(&mut self, table: &mut PageTable) -> Result<usize, ApplyError> {
        self.require_idle_for_apply()?;
        let row = match self.live_row(table) {
            Ok(Some(row)) => row,
            Ok(None) => return Ok(0),
            Err(row) => return Err(ApplyError::StaleLease { row }),
        };
        let count = table.shrink(row, self.kv_position).map_err(table_err)?;
        if count > 0 {
            self.history
                .push(SequenceEvent::UnassignedDropped { count });
        }
        Ok(count)
    }

    /// Preemption or completion: gives the row and its pages back (published pages stay
    /// cached for a later [`reacquire`](Self::reacquire)) and resets `kv_position` to 0. A
    /// lease made stale by [`PageTable::release_all`] is just forgotten.
    ///
    /// # Errors
    /// [`ApplyError::WrongState`] unless idle.
    pub fn release(&mut self, table: &mut PageTable) -> Result<(), ApplyError> {
        self.require_idle_for_apply()?;
        if let Ok(Some(row)) = self.live_row(table) {
            table.erase(row).map_err(table_err)?;
        }
        self.lease = None;
        self.kv_position = 0;
        self.history.push(SequenceEvent::Released);
        Ok(())
    }

    /// After a [`release`](Self::release): takes a row, reuses the longest cached prefix and
    /// reserves pages for the rest of the prefill range (not the generation page; the next
    /// `schedule_decode` takes that). Returns `Ok(false)`, holding nothing, when there is no
    /// row or not enough pages. Any range left uncached is recomputed by prefill chunks.
    ///
    /// # Errors
    /// [`ApplyError::WrongState`] unless idle; [`ApplyError::RowAlreadyHeld`].
    pub fn reacquire(&mut self, table: &mut PageTable) -> Result<bool, ApplyError> {
        self.require_idle_for_apply()?;
        if let Some(Lease { row, .. }) = self.lease {
            return Err(ApplyError::RowAlreadyHeld { row });
        }
        let (mut prefix_matched, mut success) = (0, false);
        if let Ok((row, hit)) = table.allocate_with_prefix(&self.tokens) {
            prefix_matched = hit / table.page_size();
            if table.reserve(row, self.prefill_end()).is_ok() {
                self.lease = Some(Lease {
                    row,
                    epoch: table.epoch(),
                });
                self.kv_position = hit;
                success = true;
            } else {
                table.erase(row).map_err(table_err)?;
            }
        }
        self.history.push(SequenceEvent::Reacquired {
            prefix_matched,
            success,
        });
        Ok(success)
    }
}
