//! Prefill steps: a pure planner that chooses the next step's rows, and the
//! launch that applies the plan.
//!
//! The next prefill step is the next chunk of the prompt part-way through
//! (one prompt at a time, so the oldest request's first token comes first),
//! else the oldest preempted sequence once it gave its KV back (with the
//! tokens it generated; none while it still holds it: new requests do not
//! overtake a preempted one), else the oldest waiting requests: as many
//! whole prompts as fit the step's token budget together (each one
//! admissible), or the oldest alone, in chunks if it is longer. The other
//! samples of a request (`n > 1`, forks) wait until the first one's prompt
//! is launched to its end, then are admitted sharing its prompt pages. One step
//! for many short prompts instead of one each: a bigger, cheaper forward,
//! and under `RideAlong` fewer small decode steps between them.

use super::{Fatal, Scheduler, SeqIdx};
use crate::executor::{ExecError, Executor, PrefillInput, PrefillStart, SlotId};
use crate::phase::{Phase, MAX_INFLIGHT_REFS};
use crate::TokenId;

/// What the next prefill step would admit, if the KV allows.
pub(crate) struct Admission<'a> {
    /// Its tokens (for a preempted sequence: prompt and generated tokens).
    pub tokens: &'a [TokenId],
    pub max_len: usize,
}

/// The limits of one prefill step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrefillBudget {
    /// Prompt tokens the step computes at most (`usize::MAX`: whole prompts).
    pub max_tokens: usize,
    /// New sequences it admits at most (the rows free under the batch cap).
    pub max_admits: usize,
}

impl<P> Scheduler<P> {
    /// The sequence part-way through a chunked prefill, if any.
    fn prefilling(&self) -> Option<SeqIdx> {
        self.running
            .iter()
            .copied()
            .find(|&i| matches!(self.seq(i).phase(), Phase::Prefilling { .. }))
    }

    /// Whether a prompt is part-way through a chunked prefill.
    pub fn prefill_in_progress(&self) -> bool {
        self.prefilling().is_some()
    }

    /// Whether the prompt part-way through may launch its next chunk now
    /// (it is in fewer than two steps).
    pub fn resumable_prefill(&self) -> bool {
        self.prefilling()
            .is_some_and(|i| self.seq(i).inflight_refs() < MAX_INFLIGHT_REFS)
    }

    /// The sequence the next prefill step would admit first: the oldest
    /// preempted one once it has given its KV back, else the oldest waiting
    /// one unless it is a fork held back (see `fork_ready`). `None` when
    /// there is nothing to admit now.
    fn next_admitted(&self) -> Option<SeqIdx> {
        match self.preempted.first() {
            Some(&idx) => (self.seq(idx).phase() == Phase::Preempted).then_some(idx),
            None => self
                .waiting
                .front()
                .copied()
                .filter(|&i| self.fork_ready(i)),
        }
    }

    /// Whether waiting sequence `idx` may be admitted now: a fork waits
    /// while its parent is waiting or part-way through its prompt, so that
    /// it is admitted in a later step than the one that ends the parent's
    /// prompt and shares pages that step writes. A parent that is gone (or
    /// preempted) holds nothing back: the fork is then admitted as any
    /// request.
    fn fork_ready(&self, idx: SeqIdx) -> bool {
        let parent = self.seq(idx).fork_of.and_then(|p| self.by_id.get(&p));
        let Some(&parent) = parent else {
            return true;
        };
        !matches!(
            self.seq(parent).phase(),
            Phase::Waiting | Phase::Prefilling { .. }
        )
    }

    /// What the next prefill step would admit first (see `next_admitted`).
    pub fn next_admission(&self) -> Option<Admission<'_>> {
        self.next_admitted().map(|i| {
            let seq = self.seq(i);
            Admission {
                tokens: &seq.tokens,
                max_len: seq.max_len,
            }
        })
    }

    /// Pure planner: the rows of the next prefill step into `plan` (empty:
    /// none). Never mutates the scheduler.
    pub fn plan_prefill<E: Executor<Params = P>>(
        &self,
        exec: &E,
        budget: PrefillBudget,
        plan: &mut Vec<SeqIdx>,
    ) {
        plan.clear();
        if let Some(i) = self.prefilling() {
            plan.push(i);
            return;
        }
        let Some(first) = self.next_admitted() else {
            return;
        };
        plan.push(first);
        if self.seq(first).phase() == Phase::Preempted {
            return;
        }
        let mut tokens = self.seq(first).tokens.len();
        if tokens > budget.max_tokens {
            return;
        }
        for &next in self.waiting.iter().skip(1) {
            let seq = self.seq(next);
            if plan.len() >= budget.max_admits
                || tokens + seq.tokens.len() > budget.max_tokens
                || !exec.can_admit(&seq.tokens, seq.max_len)
                || !self.fork_ready(next)
            {
                break;
            }
            tokens += seq.tokens.len();
            plan.push(next);
        }
    }

    /// The prefill input of sequence `idx`: its tokens so far (the generated
    /// ones counted for penalties, with the values committed beside them),
    /// from where its phase says.
    fn prefill_input(&self, idx: SeqIdx, max_tokens: usize) -> PrefillInput<'_, P> {
        let seq = self.seq(idx);
        PrefillInput {
            id: seq.id,
            prompt: &seq.tokens,
            generated: seq.committed() as usize,
            generated_values: seq.generated_values(),
            params: &seq.params,
            max_len: seq.max_len,
            start: match (seq.phase(), seq.fork_of) {
                (Phase::Prefilling { done }, _) => PrefillStart::Resume(done),
                // Only a first admission shares: a re-admitted fork's
                // tokens past the prompt are its own.
                (Phase::Waiting, Some(parent)) => PrefillStart::Fork { parent },
                _ => PrefillStart::Admit,
            },
            max_tokens,
            embeds: seq.embeds.as_ref(),
        }
    }

    /// Launch the planned prefill step into `slot` (apply): each row takes
    /// its next chunk, admitted ones take their place in `running`. A
    /// batch of admissions the executor refuses before dispatch is tried
    /// again with its oldest alone; a lone row refused fails alone (an
    /// admission took no KV; a resumed sequence keeps its KV until it is
    /// released as finalized): then `false`. The caller books the launch
    /// in its `PipelineState`, which numbers the step.
    pub fn launch_prefill<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        slot: SlotId,
        plan: &[SeqIdx],
        max_tokens: usize,
    ) -> Result<bool, Fatal> {
        let mut rows = plan;
        loop {
            let inputs: Vec<PrefillInput<'_, P>> = rows
                .iter()
                .map(|&i| self.prefill_input(i, max_tokens))
                .collect();
            match exec.launch_prefill(slot, &inputs) {
                Ok(()) => break,
                // Together they did not fit: the oldest goes alone.
                Err(ExecError::PreDispatch(_)) if rows.len() > 1 => rows = &rows[..1],
                Err(e) => {
                    drop(inputs);
                    self.launch_refused(exec, rows, e)?;
                    return Ok(false);
                }
            }
        }
        let mut samples = true;
        for &i in rows {
            let input = self.prefill_input(i, max_tokens);
            let from = match input.start {
                PrefillStart::Admit | PrefillStart::Fork { .. } => {
                    exec.cached_prompt_tokens(input.id)
                }
                PrefillStart::Resume(done) => done,
            };
            let (end, len) = (input.chunk_end(from), input.prompt.len());
            samples &= end == len;
            match self.seq(i).phase() {
                Phase::Prefilling { .. } => self.transition(i, |l| l.launch_chunk(end, len))?,
                Phase::Waiting => {
                    let seq = self.seq_mut(i);
                    seq.skill.on_admitted(from);
                    // Committed tokens never reallocate them.
                    seq.tokens
                        .reserve_exact(seq.max_len.saturating_sub(seq.prompt_len));
                    self.transition(i, |l| l.admit(end, len))?;
                    debug_assert_eq!(self.waiting.front(), Some(&i));
                    self.waiting.pop_front();
                    self.running.push(i);
                    self.num_kv += 1;
                }
                _ => {
                    self.transition(i, |l| l.admit(end, len))?;
                    debug_assert_eq!(self.preempted.first(), Some(&i));
                    self.preempted.remove(0);
                    let arrival = self.seq(i).arrival;
                    let at = self
                        .running
                        .partition_point(|&x| self.seq(x).arrival < arrival);
                    self.running.insert(at, i);
                    self.num_kv += 1;
                }
            }
        }
        self.slots[slot].prefill(rows, samples);
        self.stats.prefill_steps += 1;
        Ok(true)
    }
}
