//! `Scheduler`: waiting queue, running and preempted sequences, the pure
//! decode selector, and the launch/finalize/commit operations that mutate
//! sequence state.
//!
//! Mutation happens only where work is launched or committed: launch
//! increments `inflight_refs`, commit decrements it, consumes tokens into
//! skills, finalizes and releases. `schedule_decode_step` reads only;
//! `make_room` then grows each planned sequence's KV, preempting the
//! youngest running sequence when pages run out. A speculating sequence
//! drafts from its committed tokens, so it joins a step only with none in
//! flight (or, backing off after fruitless tries, as a plain overlapped
//! row). Steady-state steps do not allocate: plans, row lists, drafts and
//! masks reuse buffers.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;

use crate::executor::PrefillStart;
use crate::executor::{Drafts, ExecError, Executor, MaskBatch, PrefillInput, SlotId};
use crate::masks::{recycle, MaskFiller, MaskRow, SequentialMasks};
use crate::sequence::{Request, Residency, Sequence, MAX_INFLIGHT_REFS};
use crate::skill::{CommittedToken, FailureKind, Outcome, TokenMask, Verdict};
use crate::state::{LaunchHandle, PendingCommit, StepKind};
use crate::{Cause, FinishReason, RequestId, TokenId};

/// Handle to an admitted sequence inside the scheduler.
pub type SeqIdx = u32;

/// The sequences chosen for one decode step (a pure selection).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StepPlan {
    pub sequences: Vec<SeqIdx>,
    /// Per sequence: `Some(drafts)` when it tried to draft (the range of
    /// `draft_tokens` it proposed, maybe empty), `None` otherwise.
    drafts: Vec<Option<Range<u32>>>,
    draft_tokens: Vec<TokenId>,
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }
    pub fn len(&self) -> usize {
        self.sequences.len()
    }

    /// Draft tokens of member `k`.
    pub fn drafts(&self, k: usize) -> &[TokenId] {
        match &self.drafts[k] {
            Some(r) => &self.draft_tokens[r.start as usize..r.end as usize],
            None => &[],
        }
    }

    fn clear(&mut self) {
        self.sequences.clear();
        self.drafts.clear();
        self.draft_tokens.clear();
    }
}

/// Counters for benchmarks and metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PipelineStats {
    pub prefill_steps: u64,
    pub decode_steps: u64,
    /// Decode rows launched (sum of batch sizes).
    pub decode_rows: u64,
    pub committed_tokens: u64,
    /// Rows committed for sequences already finalized (outputs discarded).
    pub zombie_rows: u64,
    pub finished: u64,
    pub failed: u64,
    /// Steps whose sampling waited for a mask.
    pub masked_steps: u64,
    /// Sequences preempted for KV pages (each is prefilled again later).
    pub preemptions: u64,
    /// Draft tokens sent for verification, and how many were accepted.
    pub draft_tokens: u64,
    pub accepted_drafts: u64,
}

/// A fault the loop must turn into engine-fatal handling.
#[derive(Debug)]
pub(crate) struct Fatal(pub Cause);

/// A sequence admitted with part of its prompt still to prefill.
struct PartialPrefill {
    idx: SeqIdx,
    /// Prompt tokens launched so far (the prefix-cache hit included).
    done: usize,
}

/// What the next prefill step would admit, if the KV allows.
pub(crate) struct Admission<'a> {
    /// Its prompt (for a preempted sequence: prompt and generated tokens).
    pub tokens: &'a [TokenId],
    pub max_len: usize,
}

enum Location {
    Waiting,
    Admitted(SeqIdx),
}

pub(crate) struct Scheduler<P> {
    seqs: Vec<Option<Sequence<P>>>,
    free_idx: Vec<SeqIdx>,
    by_id: HashMap<RequestId, Location>,
    pub waiting: VecDeque<Request<P>>,
    /// Resident, not finalized, in arrival order (oldest first).
    pub running: Vec<SeqIdx>,
    /// Preempting or preempted, not finalized, in arrival order: they are
    /// prefilled again, oldest first, before any waiting request.
    preempted: Vec<SeqIdx>,
    /// Sequences preempted that hold no KV (`Residency::Preempted`).
    num_evicted: usize,
    next_arrival: u64,
    /// Members of the step held by each slot (the PendingCommit's sequences).
    slot_rows: Vec<Vec<SeqIdx>>,
    /// Whether each slot's step samples a token per member: false only for
    /// a prefill chunk short of its prompt's end (no row comes back).
    slot_samples: Vec<bool>,
    /// The drafts each slot's step verifies, compacted as the executor
    /// takes them (offsets per member, tokens; empty: none), for its masks.
    slot_draft_indptr: Vec<Vec<u32>>,
    slot_drafts: Vec<Vec<TokenId>>,
    /// The prompt being prefilled in chunks, at most one at a time.
    partial: Option<PartialPrefill>,
    row_ids: Vec<RequestId>,
    to_release: Vec<SeqIdx>,
    mask_words: Vec<u32>,
    mask_flags: Vec<bool>,
    /// Step row of each sequence index while masks are built (`u32::MAX`: none).
    mask_row_of: Vec<u32>,
    /// Empty between steps; their allocations are reused by `build_masks`.
    mask_chunks: Vec<Option<&'static mut [u32]>>,
    mask_rows: Vec<MaskRow<'static>>,
    pub filler: Box<dyn MaskFiller>,
    words_per_row: usize,
    vocab_size: usize,
    pub stats: PipelineStats,
    next_step: u64,
}

impl<P> Scheduler<P> {
    pub fn new(num_slots: usize, vocab_size: usize) -> Self {
        Self {
            seqs: Vec::new(),
            free_idx: Vec::new(),
            by_id: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            preempted: Vec::new(),
            num_evicted: 0,
            next_arrival: 0,
            slot_rows: vec![Vec::new(); num_slots],
            slot_samples: vec![true; num_slots],
            slot_draft_indptr: vec![Vec::new(); num_slots],
            slot_drafts: vec![Vec::new(); num_slots],
            partial: None,
            row_ids: Vec::new(),
            to_release: Vec::new(),
            mask_words: Vec::new(),
            mask_flags: Vec::new(),
            mask_row_of: Vec::new(),
            mask_chunks: Vec::new(),
            mask_rows: Vec::new(),
            filler: Box::new(SequentialMasks),
            words_per_row: TokenMask::words_for(vocab_size),
            vocab_size,
            stats: PipelineStats::default(),
            next_step: 0,
        }
    }

    pub fn contains(&self, id: RequestId) -> bool {
        self.by_id.contains_key(&id)
    }

    pub fn enqueue(&mut self, req: Request<P>) {
        self.by_id.insert(req.id, Location::Waiting);
        self.waiting.push_back(req);
    }

    /// Admitted sequences not yet released, preempted ones included.
    pub fn num_live(&self) -> usize {
        self.seqs.len() - self.free_idx.len()
    }

    /// Sequences holding KV (zombies and preempting ones included).
    pub fn num_admitted(&self) -> usize {
        self.num_live() - self.num_evicted
    }

    /// Preempted sequences (holding KV or not) waiting to be prefilled again.
    pub fn num_preempted(&self) -> usize {
        self.preempted.len()
    }

    fn seq(&self, idx: SeqIdx) -> &Sequence<P> {
        self.seqs[idx as usize]
            .as_ref()
            .expect("live sequence index")
    }

    fn seq_mut(&mut self, idx: SeqIdx) -> &mut Sequence<P> {
        self.seqs[idx as usize]
            .as_mut()
            .expect("live sequence index")
    }

    /// Pure selector: the running sequences that may join the next decode
    /// step (`decodable`), in arrival order, with their drafts (at most
    /// `max_drafts` in all). A speculating sequence with no step in flight
    /// drafts from its tokens; with one in flight it waits for its tokens
    /// unless it is backing off (then it decodes overlapped). Never mutates.
    pub fn schedule_decode_step(&self, plan: &mut StepPlan, max_rows: usize, max_drafts: usize) {
        plan.clear();
        let mut budget = max_drafts;
        for &i in &self.running {
            if plan.sequences.len() == max_rows {
                break;
            }
            if !self.decodable(i) {
                continue;
            }
            let seq = self.seq(i);
            let mut tried = None;
            if let (Some(spec), true) = (&seq.speculate, max_drafts > 0) {
                let room = seq
                    .draft_room()
                    .min(budget)
                    .min(seq.draft.len(spec.max_draft));
                if seq.inflight_refs == 0 {
                    // No room (the step's budget or the sequence's caps):
                    // a plain row, not a try.
                    if room > 0 {
                        let start = plan.draft_tokens.len() as u32;
                        budget -= spec.propose(&seq.tokens, room, &mut plan.draft_tokens);
                        tried = Some(start..plan.draft_tokens.len() as u32);
                    }
                } else if seq.draft.wait == 0 && room > 0 {
                    continue;
                }
            }
            plan.sequences.push(i);
            plan.drafts.push(tried);
        }
    }

    /// Whether sequence `i` may join a decode step: its own budget checks,
    /// and not part-way through a chunked prefill.
    fn decodable(&self, i: SeqIdx) -> bool {
        self.seq(i).can_dispatch() && self.partial.as_ref().is_none_or(|p| p.idx != i)
    }

    /// Whether `schedule_decode_step` would select anything.
    pub fn any_dispatchable(&self) -> bool {
        self.running.iter().any(|&i| self.decodable(i))
    }

    fn next_step(&mut self) -> u64 {
        let s = self.next_step;
        self.next_step += 1;
        s
    }

    /// Launch a decode forward for `plan` into `slot`; increments refs on success.
    pub fn launch_decode<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        plan: &StepPlan,
        slot: SlotId,
    ) -> Result<LaunchHandle, ExecError<E::Error>> {
        self.row_ids.clear();
        for &i in &plan.sequences {
            let id = self.seq(i).id;
            self.row_ids.push(id);
        }
        // Compacted into the slot's buffers: the slot is free (I6), and a
        // launch refused before dispatch leaves it free for the next.
        let (indptr, tokens) = (
            &mut self.slot_draft_indptr[slot],
            &mut self.slot_drafts[slot],
        );
        indptr.clear();
        tokens.clear();
        if !plan.draft_tokens.is_empty() {
            indptr.push(0);
            for k in 0..plan.len() {
                tokens.extend_from_slice(plan.drafts(k));
                indptr.push(tokens.len() as u32);
            }
        }
        exec.launch_decode(slot, &self.row_ids, Drafts { indptr, tokens })?;
        let rows = &mut self.slot_rows[slot];
        rows.clear();
        rows.extend_from_slice(&plan.sequences);
        self.slot_samples[slot] = true;
        for (k, &i) in plan.sequences.iter().enumerate() {
            let n = plan.drafts(k).len();
            let tried = plan.drafts[k].is_some();
            let seq = self.seqs[i as usize].as_mut().expect("live sequence index");
            seq.inflight_refs += 1;
            let max_draft = seq.speculate.map_or(0, |s| s.max_draft);
            if n > 0 {
                seq.drafting = n;
                self.stats.draft_tokens += n as u64;
            } else if tried {
                seq.draft.tried(0, 0, max_draft);
            } else if seq.speculate.is_some() {
                seq.draft.wait = seq.draft.wait.saturating_sub(1);
            }
        }
        self.stats.decode_steps += 1;
        self.stats.decode_rows += plan.sequences.len() as u64;
        Ok(LaunchHandle {
            kind: StepKind::Decode,
            slot,
            step: self.next_step(),
        })
    }

    /// Grow the KV of each sequence in `plan` (oldest first) to hold the
    /// token its decode step writes. When the cache is short, the youngest
    /// running sequence is preempted ([`Scheduler::preempt`]) and the growth
    /// retried; while pages are already on their way back (a zombie or a
    /// preempted sequence still in an in-flight step), a short sequence sits
    /// this step out instead, so no more is preempted than needed. A
    /// sequence that cannot grow with every other one gone fails alone
    /// (`could_ever_fit` should have refused it). Returns whether any
    /// sequence was preempted or failed.
    pub fn make_room<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        plan: &mut StepPlan,
    ) -> bool {
        let mut changed = false;
        let mut keep = 0;
        for k in 0..plan.sequences.len() {
            let i = plan.sequences[k];
            let drafts = plan.drafts(k).len();
            loop {
                let seq = self.seq(i);
                // A victim of an earlier member's growth.
                if seq.residency != Residency::Resident {
                    break;
                }
                if exec.grow(seq.id, seq.budgeted_len() + drafts) {
                    plan.sequences[keep] = i;
                    plan.drafts.swap(keep, k);
                    keep += 1;
                    break;
                }
                if self.pages_returning() {
                    break;
                }
                changed = true;
                let victim = *self.running.last().expect("`i` is running");
                if victim == i && self.running.len() == 1 {
                    let why = Cause::message(format!(
                        "the KV cache cannot hold request {} at {} tokens even alone",
                        seq.id,
                        seq.budgeted_len()
                    ));
                    self.finalize(i, Outcome::Failed(FailureKind::Rejected, why));
                    self.release_if_done(exec, i);
                    break;
                }
                self.preempt(exec, victim);
            }
        }
        plan.sequences.truncate(keep);
        plan.drafts.truncate(keep);
        changed
    }

    /// Whether KV pages will come back when an in-flight step commits: a
    /// zombie's, or a preempted sequence's that is still in flight.
    fn pages_returning(&self) -> bool {
        self.preempted
            .iter()
            .any(|&i| self.seq(i).residency == Residency::Preempting)
            || self
                .seqs
                .iter()
                .flatten()
                .any(|s| s.finalized && s.inflight_refs > 0)
    }

    /// Preempt sequence `idx` (section "preemption" of the lifecycle): it
    /// leaves `running` (and a chunked prefill), keeps the tokens it has
    /// committed and those its in-flight steps will commit, and gives its KV
    /// back once no in-flight step references it. It is prefilled again
    /// with all its tokens before any new request is admitted.
    fn preempt<E: Executor<Params = P>>(&mut self, exec: &mut E, idx: SeqIdx) {
        self.running.retain(|&x| x != idx);
        if self.partial.as_ref().is_some_and(|p| p.idx == idx) {
            self.partial = None;
        }
        let arrival = self.seq(idx).arrival;
        let at = self
            .preempted
            .partition_point(|&x| self.seq(x).arrival < arrival);
        self.preempted.insert(at, idx);
        self.seq_mut(idx).residency = Residency::Preempting;
        self.stats.preemptions += 1;
        self.evict_if_idle(exec, idx);
    }

    /// Give a preempting sequence's KV back once no in-flight step uses it.
    fn evict_if_idle<E: Executor<Params = P>>(&mut self, exec: &mut E, idx: SeqIdx) {
        let seq = self.seqs[idx as usize]
            .as_mut()
            .expect("live sequence index");
        if seq.finalized || seq.residency != Residency::Preempting || seq.inflight_refs > 0 {
            return;
        }
        exec.preempt(seq.id, &seq.tokens);
        seq.residency = Residency::Preempted;
        self.num_evicted += 1;
    }

    /// The sequence whose prompt is being prefilled in chunks, if its next
    /// chunk may launch now (it is in fewer than two steps).
    pub fn resumable_prefill(&self) -> bool {
        self.partial
            .as_ref()
            .is_some_and(|p| self.seq(p.idx).inflight_refs < MAX_INFLIGHT_REFS)
    }

    /// Whether a prompt is part-way through a chunked prefill.
    pub fn prefill_in_progress(&self) -> bool {
        self.partial.is_some()
    }

    /// What the next prefill step would admit: the oldest preempted
    /// sequence once it has given its KV back (none while it still holds
    /// it: new requests do not overtake a preempted one), else the oldest
    /// waiting request. `None` when there is nothing to admit now.
    pub fn next_admission(&self, max_seq_len: usize) -> Option<Admission<'_>> {
        match self.preempted.first() {
            Some(&idx) => {
                let seq = self.seq(idx);
                (seq.residency == Residency::Preempted).then_some(Admission {
                    tokens: &seq.tokens,
                    max_len: seq.max_len,
                })
            }
            None => self.waiting.front().map(|req| Admission {
                tokens: &req.prompt,
                max_len: max_len_of(req, max_seq_len),
            }),
        }
    }

    /// Launch the next prefill chunk into `slot`: the sequence part-way
    /// through its prompt if there is one (one prompt at a time, so the
    /// oldest request's first token comes first), else the oldest preempted
    /// sequence (with the tokens it generated), else the oldest waiting
    /// requests, admitted now: as many whole prompts as fit the step's
    /// token budget `max_tokens` together (at most `max_admits`, each one
    /// admissible), or the oldest alone, in chunks if it is longer. One
    /// step for many short prompts instead of one each: a bigger, cheaper
    /// forward, and under `RideAlong` fewer small decode steps between
    /// them. On a pre-dispatch error a lone request fails alone (an
    /// admission took no KV; a resumed sequence keeps its KV until it is
    /// released as finalized); a refused batch goes back to the queue and
    /// its oldest request is tried alone.
    pub fn launch_prefill<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        slot: SlotId,
        max_seq_len: usize,
        max_tokens: usize,
        max_admits: usize,
    ) -> Result<Option<LaunchHandle>, Fatal> {
        if let Some(p) = self.partial.take() {
            return self.resume_prefill(exec, slot, p, max_tokens);
        }
        if let Some(&idx) = self.preempted.first() {
            if self.seq(idx).residency != Residency::Preempted {
                return Ok(None);
            }
            return self.readmit(exec, slot, idx, max_tokens);
        }
        let Some(first) = self.waiting.front() else {
            return Ok(None);
        };
        let mut take = 1;
        let mut tokens = first.prompt.len();
        if tokens <= max_tokens {
            while let Some(next) = self.waiting.get(take).filter(|_| take < max_admits) {
                if tokens + next.prompt.len() > max_tokens
                    || !exec.can_admit(&next.prompt, max_len_of(next, max_seq_len))
                {
                    break;
                }
                tokens += next.prompt.len();
                take += 1;
            }
        }
        let mut reqs: Vec<Request<P>> = self.waiting.drain(..take).collect();
        let inputs: Vec<PrefillInput<'_, P>> = reqs
            .iter()
            .map(|req| PrefillInput {
                id: req.id,
                prompt: &req.prompt,
                generated: 0,
                params: &req.params,
                max_len: max_len_of(req, max_seq_len),
                start: PrefillStart::Admit,
                max_tokens,
            })
            .collect();
        // Each admission's length cap, prefix-cache hit and chunk end.
        let launched = exec.launch_prefill(slot, &inputs).map(|()| {
            inputs
                .iter()
                .map(|input| {
                    let cached = exec.cached_prompt_tokens(input.id);
                    (input.max_len, cached, input.chunk_end(cached))
                })
                .collect::<Vec<_>>()
        });
        drop(inputs);
        let admits = match launched {
            Ok(admits) => admits,
            Err(ExecError::PreDispatch(_)) if reqs.len() > 1 => {
                // Together they did not fit: the oldest goes alone.
                for req in reqs.into_iter().rev() {
                    self.waiting.push_front(req);
                }
                return self.launch_prefill(exec, slot, max_seq_len, max_tokens, 1);
            }
            Err(ExecError::PreDispatch(e)) => {
                let mut req = reqs.pop().expect("one request");
                self.by_id.remove(&req.id);
                req.skill
                    .finish(Outcome::Failed(FailureKind::StepFailed, Cause::new(e)));
                self.stats.failed += 1;
                return Ok(None);
            }
            Err(ExecError::Fatal(e)) => {
                // The requests are still ours: put them back so fail_all
                // resolves them.
                for req in reqs.into_iter().rev() {
                    self.waiting.push_front(req);
                }
                return Err(Fatal(Cause::new(e)));
            }
        };
        let mut rows = std::mem::take(&mut self.slot_rows[slot]);
        rows.clear();
        let mut samples = true;
        for (req, (max_len, cached, end)) in reqs.into_iter().zip(admits) {
            let (idx, sampled) = self.admitted(req, max_len, cached, end);
            rows.push(idx);
            samples &= sampled;
        }
        self.slot_rows[slot] = rows;
        Ok(Some(self.prefill_launched(slot, None, samples)))
    }

    /// Record a request whose prefill was just launched (length cap
    /// `max_len`, `cached` prompt tokens from the prefix cache, chunk ending
    /// at `end`) as an admitted sequence: its index, and whether the step
    /// samples its first token (its chunk ends the prompt; otherwise it is
    /// the partial prefill).
    fn admitted(
        &mut self,
        mut req: Request<P>,
        max_len: usize,
        cached: usize,
        end: usize,
    ) -> (SeqIdx, bool) {
        req.skill.on_admitted(cached);
        let prompt_len = req.prompt.len();
        let mut tokens = req.prompt;
        // Committed tokens never reallocate it.
        tokens.reserve_exact(max_len.saturating_sub(prompt_len));
        let seq = Sequence {
            id: req.id,
            arrival: self.next_arrival,
            prompt_len,
            tokens,
            inflight_refs: 1,
            finalized: false,
            residency: Residency::Resident,
            max_new_tokens: req.max_new_tokens,
            max_len,
            params: req.params,
            // A constrained sequence drafts only if its skill can mask
            // the positions after a draft.
            speculate: req
                .speculate
                .filter(|_| !req.skill.is_constrained() || req.skill.looks_ahead()),
            draft: Default::default(),
            drafting: 0,
            skill: req.skill,
        };
        self.next_arrival += 1;
        let idx = match self.free_idx.pop() {
            Some(i) => {
                self.seqs[i as usize] = Some(seq);
                i
            }
            None => {
                self.seqs.push(Some(seq));
                (self.seqs.len() - 1) as SeqIdx
            }
        };
        self.by_id.insert(self.seq(idx).id, Location::Admitted(idx));
        self.running.push(idx);
        let samples = end == prompt_len;
        if !samples {
            self.partial = Some(PartialPrefill { idx, done: end });
        }
        (idx, samples)
    }

    /// Prefill a preempted sequence again (its prompt and generated tokens):
    /// it takes its place in `running` by arrival.
    fn readmit<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        slot: SlotId,
        idx: SeqIdx,
        max_tokens: usize,
    ) -> Result<Option<LaunchHandle>, Fatal> {
        let input = self.prefill_input(idx, PrefillStart::Admit, max_tokens);
        match exec.launch_prefill(slot, std::slice::from_ref(&input)) {
            Ok(()) => {}
            Err(ExecError::PreDispatch(e)) => {
                let why = Cause::new(e);
                self.finalize(idx, Outcome::Failed(FailureKind::StepFailed, why));
                self.release_if_done(exec, idx);
                return Ok(None);
            }
            Err(ExecError::Fatal(e)) => return Err(Fatal(Cause::new(e))),
        }
        let end = input.chunk_end(exec.cached_prompt_tokens(input.id));
        let samples = end == input.prompt.len();
        let arrival = self.seq(idx).arrival;
        self.preempted.remove(0);
        self.num_evicted -= 1;
        let at = self
            .running
            .partition_point(|&x| self.seq(x).arrival < arrival);
        self.running.insert(at, idx);
        let seq = self.seq_mut(idx);
        seq.residency = Residency::Resident;
        seq.inflight_refs += 1;
        if !samples {
            self.partial = Some(PartialPrefill { idx, done: end });
        }
        Ok(Some(self.prefill_launched(slot, Some(idx), samples)))
    }

    /// The prefill input of admitted sequence `idx`: its tokens so far (the
    /// generated ones counted for penalties), from `start`.
    fn prefill_input(
        &self,
        idx: SeqIdx,
        start: PrefillStart,
        max_tokens: usize,
    ) -> PrefillInput<'_, P> {
        let seq = self.seq(idx);
        PrefillInput {
            id: seq.id,
            prompt: &seq.tokens,
            generated: seq.committed() as usize,
            params: &seq.params,
            max_len: seq.max_len,
            start,
            max_tokens,
        }
    }

    /// Launch the next chunk of the sequence part-way through its prompt.
    fn resume_prefill<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        slot: SlotId,
        mut p: PartialPrefill,
        max_tokens: usize,
    ) -> Result<Option<LaunchHandle>, Fatal> {
        let input = self.prefill_input(p.idx, PrefillStart::Resume(p.done), max_tokens);
        let end = input.chunk_end(p.done);
        let samples = end == input.prompt.len();
        match exec.launch_prefill(slot, std::slice::from_ref(&input)) {
            Ok(()) => {}
            Err(ExecError::PreDispatch(e)) => {
                let why = Cause::new(e);
                self.finalize(p.idx, Outcome::Failed(FailureKind::StepFailed, why));
                self.release_if_done(exec, p.idx);
                return Ok(None);
            }
            Err(ExecError::Fatal(e)) => {
                self.partial = Some(p);
                return Err(Fatal(Cause::new(e)));
            }
        }
        let idx = p.idx;
        self.seq_mut(idx).inflight_refs += 1;
        if !samples {
            p.done = end;
            self.partial = Some(p);
        }
        Ok(Some(self.prefill_launched(slot, Some(idx), samples)))
    }

    /// Book a launched prefill step of sequence `idx` in `slot`.
    /// The handle of a prefill step launched on `slot` for `idx` alone, or
    /// (`None`) for the rows already in `slot_rows[slot]`.
    fn prefill_launched(
        &mut self,
        slot: SlotId,
        idx: Option<SeqIdx>,
        samples: bool,
    ) -> LaunchHandle {
        if let Some(idx) = idx {
            let rows = &mut self.slot_rows[slot];
            rows.clear();
            rows.push(idx);
        }
        self.slot_samples[slot] = samples;
        self.slot_draft_indptr[slot].clear();
        self.slot_drafts[slot].clear();
        self.stats.prefill_steps += 1;
        LaunchHandle {
            kind: StepKind::Prefill,
            slot,
            step: self.next_step(),
        }
    }
    /// Fail a decode plan whose launch was rejected before dispatch.
    pub fn fail_plan<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        plan: &StepPlan,
        why: &Cause,
    ) {
        for &i in &plan.sequences {
            self.finalize(i, Outcome::Failed(FailureKind::StepFailed, why.clone()));
            self.release_if_done(exec, i);
        }
    }

    /// `plan_needs_mask`: any non-finalized member of `slot`'s step is constrained.
    pub fn needs_mask(&self, slot: SlotId) -> bool {
        self.slot_samples[slot]
            && self.slot_rows[slot]
                .iter()
                .any(|&i| self.seq(i).needs_mask())
    }

    /// `compute_mask` then `finalize_sampling`: finalized rows are unconstrained.
    pub fn finalize_sampling<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        handle: LaunchHandle,
    ) -> Result<PendingCommit, Fatal> {
        let masked = self.build_masks(handle.slot);
        let result = if masked {
            self.stats.masked_steps += 1;
            let batch = MaskBatch {
                words_per_row: self.words_per_row,
                words: &self.mask_words,
                constrained: &self.mask_flags,
            };
            exec.finalize_sampling(handle.slot, Some(&batch))
        } else {
            exec.finalize_sampling(handle.slot, None)
        };
        // After a forward was dispatched every sampling error is device-side: fatal.
        result.map_err(|e| Fatal(Cause::new(e)))?;
        Ok(PendingCommit {
            kind: handle.kind,
            slot: handle.slot,
            step: handle.step,
        })
    }

    /// Fill the step's masks: one per position a member may sample (its
    /// next token, and one per draft its step verifies), see [`MaskBatch`].
    fn build_masks(&mut self, slot: SlotId) -> bool {
        self.mask_flags.clear();
        if !self.slot_samples[slot] {
            return false;
        }
        let rows = std::mem::take(&mut self.slot_rows[slot]);
        let indptr = &self.slot_draft_indptr[slot];
        // Member `r`'s first mask row, and how many it has.
        let first = |r: usize| match indptr.is_empty() {
            true => r,
            false => r + indptr[r] as usize,
        };
        let span = |r: usize| match indptr.is_empty() {
            true => 1,
            false => 1 + (indptr[r + 1] - indptr[r]) as usize,
        };
        let mut any = false;
        for (r, &i) in rows.iter().enumerate() {
            let c = self.seq(i).needs_mask();
            any |= c;
            self.mask_flags.extend(std::iter::repeat_n(c, span(r)));
        }
        if any {
            let wpr = self.words_per_row;
            let need = self.mask_flags.len() * wpr;
            if self.mask_words.len() < need {
                self.mask_words.resize(need, 0);
            }
            // Pair each constrained sequence with its rows' words. Sequences
            // are visited in index order (one `iter_mut` gives disjoint
            // `&mut`s); `mask_row_of` maps an index to its member.
            self.mask_row_of.clear();
            self.mask_row_of.resize(self.seqs.len(), u32::MAX);
            for (r, &i) in rows.iter().enumerate() {
                if self.mask_flags[first(r)] {
                    self.mask_row_of[i as usize] = r as u32;
                }
            }
            let mut chunks: Vec<Option<&mut [u32]>> =
                recycle(std::mem::take(&mut self.mask_chunks));
            let mut rest = &mut self.mask_words[..need];
            for r in 0..rows.len() {
                let (head, tail) = rest.split_at_mut(span(r) * wpr);
                chunks.push(Some(head));
                rest = tail;
            }
            let drafts = &self.slot_drafts[slot];
            let mut jobs: Vec<MaskRow<'_>> = recycle(std::mem::take(&mut self.mask_rows));
            for (seq, &r) in self.seqs.iter_mut().zip(&self.mask_row_of) {
                if r == u32::MAX {
                    continue;
                }
                let seq = seq.as_mut().expect("live sequence index");
                let words = chunks[r as usize].take().expect("one member per sequence");
                words.fill(0);
                let own = match indptr.is_empty() {
                    true => &drafts[..0],
                    false => &drafts[indptr[r as usize] as usize..indptr[r as usize + 1] as usize],
                };
                jobs.push(MaskRow {
                    skill: &mut *seq.skill,
                    drafts: own,
                    words,
                });
            }
            self.filler.fill(&mut jobs, self.vocab_size);
            self.mask_rows = recycle(jobs);
            self.mask_chunks = recycle(chunks);
        }
        self.slot_rows[slot] = rows;
        any
    }

    /// `commit_step`: wait for the step's copy, consume tokens, finalize and
    /// release. Owns the only `wait` (callers never wait directly).
    pub fn commit_step<E: Executor<Params = P>>(
        &mut self,
        exec: &mut E,
        step: PendingCommit,
    ) -> Result<(), Fatal> {
        let rows = std::mem::take(&mut self.slot_rows[step.slot]);
        let outs = match exec.wait_step(step.slot) {
            Ok(o) => o,
            Err(e) => {
                self.slot_rows[step.slot] = rows;
                return Err(Fatal(Cause::new(e)));
            }
        };
        let samples = self.slot_samples[step.slot];
        let expected = if samples { rows.len() } else { 0 };
        let well_formed = outs.num_rows() == expected
            && (outs.row_indptr.is_empty()
                || (outs.row_indptr[0] == 0
                    && outs.row_indptr.windows(2).all(|w| w[0] < w[1])
                    && outs.row_indptr[expected] as usize == outs.tokens.len()));
        if !well_formed {
            let msg = format!(
                "step {} returned {} rows ({} tokens) for {} sampled sequences",
                step.step,
                outs.num_rows(),
                outs.tokens.len(),
                expected
            );
            self.slot_rows[step.slot] = rows;
            return Err(Fatal(Cause::message(msg)));
        }
        self.to_release.clear();
        for (r, &i) in rows.iter().enumerate() {
            let seq = self.seqs[i as usize].as_mut().expect("live sequence index");
            seq.inflight_refs -= 1;
            let drafted = std::mem::take(&mut seq.drafting);
            // A prefill chunk short of its prompt's end (`!samples`) wrote
            // KV only. A preempting sequence's tokens count like any other.
            if seq.finalized {
                self.stats.zombie_rows += 1;
            } else if samples {
                // A row that verified drafts brings the accepted ones and
                // the token after them; a stop among them drops the rest.
                let range = outs.row_range(r);
                let accepted = range.len() - 1;
                let mut reason = None;
                for j in range {
                    let token = CommittedToken {
                        token: outs.tokens[j],
                        logprob: outs.logprobs.map(|l| l[j]),
                        top_logprobs: outs.top(j),
                    };
                    seq.tokens.push(token.token);
                    self.stats.committed_tokens += 1;
                    reason = match seq.skill.consume(&token) {
                        Verdict::Stop(reason) => Some(reason),
                        Verdict::Continue => seq.at_length_cap().then_some(FinishReason::Length),
                    };
                    if reason.is_some() {
                        break;
                    }
                }
                if drafted > 0 {
                    let max_draft = seq.speculate.map_or(0, |s| s.max_draft);
                    seq.draft.tried(drafted, accepted, max_draft);
                    self.stats.accepted_drafts += accepted as u64;
                }
                if let Some(reason) = reason {
                    self.finalize(i, Outcome::Finished(reason));
                }
            }
            if self.seq(i).inflight_refs == 0 {
                self.to_release.push(i);
            }
        }
        self.slot_rows[step.slot] = rows;
        let mut release = std::mem::take(&mut self.to_release);
        for &i in &release {
            self.release_if_done(exec, i);
            if self.seqs[i as usize].is_some() {
                self.evict_if_idle(exec, i);
            }
        }
        release.clear();
        self.to_release = release;
        Ok(())
    }

    /// Mark finalized and resolve the request (once); keeps the KV row.
    fn finalize(&mut self, idx: SeqIdx, outcome: Outcome) {
        let seq = self.seq_mut(idx);
        if seq.finalized {
            return;
        }
        seq.finalized = true;
        let preempted = seq.residency != Residency::Resident;
        let failed = matches!(outcome, Outcome::Failed(..));
        seq.skill.finish(outcome);
        if failed {
            self.stats.failed += 1;
        } else {
            self.stats.finished += 1;
        }
        if self.partial.as_ref().is_some_and(|p| p.idx == idx) {
            self.partial = None;
        }
        if preempted {
            self.preempted.retain(|&x| x != idx);
        } else {
            self.running.retain(|&x| x != idx);
        }
    }

    /// Release a finalized sequence's KV (if it holds any) once no step
    /// references it, and forget it.
    fn release_if_done<E: Executor<Params = P>>(&mut self, exec: &mut E, idx: SeqIdx) {
        let seq = self.seq(idx);
        if !(seq.finalized && seq.inflight_refs == 0) {
            return;
        }
        let id = seq.id;
        if seq.holds_kv() {
            exec.release(id);
        } else {
            self.num_evicted -= 1;
        }
        self.seqs[idx as usize] = None;
        self.free_idx.push(idx);
        self.by_id.remove(&id);
    }

    /// Cancel a request: waiting ones resolve now; admitted ones finalize now
    /// and release once no in-flight step references them. Unknown: false.
    pub fn abort<E: Executor<Params = P>>(&mut self, exec: &mut E, id: RequestId) -> bool {
        match self.by_id.get(&id) {
            None => false,
            Some(Location::Waiting) => {
                if let Some(pos) = self.waiting.iter().position(|r| r.id == id) {
                    let mut req = self.waiting.remove(pos).expect("position is in range");
                    req.skill.finish(Outcome::Finished(FinishReason::Abort));
                    self.stats.finished += 1;
                }
                self.by_id.remove(&id);
                true
            }
            Some(&Location::Admitted(idx)) => {
                self.finalize(idx, Outcome::Finished(FinishReason::Abort));
                self.release_if_done(exec, idx);
                true
            }
        }
    }

    /// Engine-fatal: resolve every accepted request with an error and forget
    /// all state. The caller releases the executor's KV.
    pub fn fail_all(&mut self, why: &Cause) {
        for slot in self.seqs.iter_mut() {
            if let Some(seq) = slot {
                if !seq.finalized {
                    seq.finalized = true;
                    seq.skill
                        .finish(Outcome::Failed(FailureKind::EngineFatal, why.clone()));
                    self.stats.failed += 1;
                }
            }
            *slot = None;
        }
        for mut req in self.waiting.drain(..) {
            req.skill
                .finish(Outcome::Failed(FailureKind::EngineFatal, why.clone()));
            self.stats.failed += 1;
        }
        self.seqs.clear();
        self.partial = None;
        self.free_idx.clear();
        self.by_id.clear();
        self.running.clear();
        self.preempted.clear();
        self.num_evicted = 0;
        for rows in &mut self.slot_rows {
            rows.clear();
        }
    }

    /// I4 and membership checks against the in-flight steps' slots.
    pub fn check(&self, inflight_slots: &[SlotId]) -> Result<(), String> {
        let mut counts = vec![0u8; self.seqs.len()];
        for &slot in inflight_slots {
            for &i in &self.slot_rows[slot] {
                counts[i as usize] += 1;
            }
        }
        for (i, s) in self.seqs.iter().enumerate() {
            match s {
                Some(seq) => {
                    if seq.inflight_refs != counts[i] {
                        return Err(format!(
                            "request {}: inflight_refs {} but in {} in-flight steps",
                            seq.id, seq.inflight_refs, counts[i]
                        ));
                    }
                    if seq.inflight_refs > crate::sequence::MAX_INFLIGHT_REFS {
                        return Err(format!(
                            "request {}: inflight_refs {}",
                            seq.id, seq.inflight_refs
                        ));
                    }
                    let idx = i as SeqIdx;
                    let (in_running, in_preempted) =
                        (self.running.contains(&idx), self.preempted.contains(&idx));
                    let resident = seq.residency == Residency::Resident;
                    if in_running != (!seq.finalized && resident)
                        || in_preempted != (!seq.finalized && !resident)
                    {
                        return Err(format!(
                            "request {}: finalized={} residency={:?} but running={in_running} preempted={in_preempted}",
                            seq.id, seq.finalized, seq.residency
                        ));
                    }
                    if seq.drafting > 0 && seq.inflight_refs != 1 {
                        return Err(format!(
                            "request {}: verifying drafts in {} in-flight steps",
                            seq.id, seq.inflight_refs
                        ));
                    }
                    if seq.residency == Residency::Preempted && seq.inflight_refs > 0 {
                        return Err(format!(
                            "request {}: gave its KV back while in {} in-flight steps",
                            seq.id, seq.inflight_refs
                        ));
                    }
                    if seq.residency == Residency::Preempting
                        && !seq.finalized
                        && seq.inflight_refs == 0
                    {
                        return Err(format!(
                            "request {}: preempted and unreferenced but still holds KV",
                            seq.id
                        ));
                    }
                    if seq.committed() > seq.max_new_tokens || seq.tokens.len() > seq.max_len {
                        return Err(format!(
                            "request {}: {} tokens committed (max {}), {} in all (max {})",
                            seq.id,
                            seq.committed(),
                            seq.max_new_tokens,
                            seq.tokens.len(),
                            seq.max_len
                        ));
                    }
                    if (seq.finalized || !resident)
                        && self.partial.as_ref().is_some_and(|p| p.idx as usize == i)
                    {
                        return Err(format!(
                            "request {}: finalized or preempted but still part-way through its prefill",
                            seq.id
                        ));
                    }
                    if seq.finalized && seq.inflight_refs == 0 {
                        return Err(format!(
                            "request {}: finalized and unreferenced but not released",
                            seq.id
                        ));
                    }
                }
                None => {
                    if counts[i] != 0 {
                        return Err(format!(
                            "released sequence {i} is still in an in-flight step"
                        ));
                    }
                }
            }
        }
        let evicted = self.seqs.iter().flatten().filter(|s| !s.holds_kv()).count();
        if evicted != self.num_evicted {
            return Err(format!(
                "{evicted} sequences hold no KV but {} are counted",
                self.num_evicted
            ));
        }
        let arrivals = |list: &[SeqIdx]| {
            list.windows(2)
                .all(|w| self.seq(w[0]).arrival < self.seq(w[1]).arrival)
        };
        if !arrivals(&self.running) || !arrivals(&self.preempted) {
            return Err("running or preempted sequences out of arrival order".into());
        }
        Ok(())
    }
}

#[cfg(test)]
impl<P> Scheduler<P> {
    /// (id, inflight_refs, finalized, committed) of every admitted sequence.
    pub fn snapshot(&self) -> Vec<(RequestId, u8, bool, u32)> {
        self.seqs
            .iter()
            .flatten()
            .map(|s| (s.id, s.inflight_refs, s.finalized, s.committed()))
            .collect()
    }
}

/// Total token cap of a request: prompt + max_new_tokens, within the context.
pub(crate) fn max_len_of<P>(req: &Request<P>, max_seq_len: usize) -> usize {
    (req.prompt.len() + req.max_new_tokens as usize).min(max_seq_len)
}
