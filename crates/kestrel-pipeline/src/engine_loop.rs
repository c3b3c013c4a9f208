//! `EngineLoop`: the unified scheduler loop of section 4.6, one iteration per
//! [`EngineLoop::run_once`], generic over an [`Executor`].
//!
//! The caller (an engine thread) submits requests and aborts between
//! iterations and blocks on its own channel when the loop reports
//! [`Tick::Idle`]. Two modes share every transition: `Blocking` (depth 1:
//! launch, finalize, wait, commit) and `Pipelined` (depth 2: the forward of
//! step t+1 runs while step t commits). Two prefill policies: `Drain` (the
//! seed's I5: prefill only when drained) and `RideAlong` (Photon: a prefill
//! is a `kind=prefill` launch into a free slot), either taking whole prompts
//! or, with `prefill_chunk`, chunks that take turns with decode steps. KV
//! grows as sequences do; when pages run out the youngest running sequence
//! is preempted and later prefilled again with the tokens it generated. Any
//! fault after dispatch is engine-fatal: every request is resolved with an
//! error, all KV released.

use std::num::NonZeroUsize;

use crate::executor::Executor;
use crate::scheduler::{
    Fatal, InvariantError, PipelineStats, PrefillBudget, Scheduler, SchedulerFault, SeqIdx,
    StepPlan,
};
use crate::sequence::Request;
use crate::state::{PipelineState, StateError, StepKind};
use crate::{Cause, RequestId};

/// Launch/commit overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PipelineMode {
    /// Depth 1: every step is launched, sampled, waited on and committed
    /// before the next is planned.
    Blocking,
    /// Depth 2: the next forward is launched before the previous step commits.
    Pipelined,
}

/// When new sequences are prefilled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PrefillPolicy {
    /// Drain the pipeline, then prefill synchronously (design doc I5).
    Drain,
    /// Launch a prefill into a free slot while the other slot's step commits.
    RideAlong,
}

/// Loop configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopConfig {
    pub mode: PipelineMode,
    pub prefill_policy: PrefillPolicy,
    /// KV rows in use at most (zombies count), capped by the executor's rows.
    pub max_batch_size: usize,
    /// Requests that must wait (beyond the batch rows free now) at most;
    /// more are refused.
    pub max_waiting: usize,
    /// Context length: prompt + generated tokens at most.
    pub max_seq_len: usize,
    /// Chunked prefill: prompt tokens one prefill step computes at most
    /// (`None`: whole prompts). A longer prompt is prefilled over several
    /// steps, one prompt at a time, taking turns with decode steps in every
    /// mode and policy, so running sequences wait one chunk's forward at
    /// most rather than a whole prompt's.
    pub prefill_chunk: Option<NonZeroUsize>,
    /// Check I2/I4/I6 and capacity after every iteration (panics on violation).
    pub debug_checks: bool,
}

impl Default for LoopConfig {
    fn default() -> Self {
        Self {
            mode: PipelineMode::Pipelined,
            prefill_policy: PrefillPolicy::RideAlong,
            max_batch_size: 32,
            max_waiting: 1024,
            max_seq_len: 8192,
            prefill_chunk: None,
            debug_checks: cfg!(debug_assertions),
        }
    }
}

/// What one iteration did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tick {
    /// Work was launched, sampled or committed; call again.
    Progress,
    /// Nothing to do until a request arrives.
    Idle,
    /// Drained and paused; call `resume` to continue.
    Paused,
    /// An engine-fatal fault happened; every request was resolved with an error.
    Unhealthy,
}

/// Why a request was refused at submission.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_new_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error(
        "embedded rows {start}..{start}+{len} or bidirectional prefix ..{bidirectional_end} \
         outside a prompt of {prompt_len} tokens"
    )]
    EmbedsOutsidePrompt {
        start: usize,
        len: usize,
        bidirectional_end: usize,
        prompt_len: usize,
    },
    #[error("prompt of {prompt_len} tokens leaves no room in a context of {max_seq_len} tokens")]
    PromptTooLong {
        prompt_len: usize,
        max_seq_len: usize,
    },
    #[error("request needs {needed} KV tokens, more than the cache can ever hold")]
    NeverFits { needed: usize },
    #[error("waiting queue is full ({limit} requests)")]
    QueueFull { limit: usize },
    #[error("request id {0} is already in use")]
    DuplicateId(RequestId),
    /// [`EngineLoop::submit_samples`]: a sample's prompt is not the first's.
    #[error("sample {id}'s prompt differs from its request's first sample")]
    SamplePromptDiffers { id: RequestId },
    #[error("the engine is not serving")]
    Unhealthy(#[source] Cause),
}

/// The engine loop. Owns the executor, the pipeline state and the scheduler.
pub struct EngineLoop<E: Executor> {
    exec: E,
    config: LoopConfig,
    state: PipelineState,
    sched: Scheduler<E::Params>,
    plan: StepPlan,
    prefill_plan: Vec<SeqIdx>,
    pause_requested: bool,
    paused: bool,
    unhealthy: Option<Cause>,
    last_was_prefill: bool,
}

impl<E: Executor> std::fmt::Debug for EngineLoop<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineLoop")
            .field("config", &self.config)
            .field("state", &self.state)
            .field("waiting", &self.sched.num_waiting())
            .field("running", &self.sched.num_running())
            .field("unhealthy", &self.unhealthy)
            .finish_non_exhaustive()
    }
}

impl<E: Executor> EngineLoop<E> {
    pub fn new(exec: E, config: LoopConfig) -> Result<Self, StateError> {
        let slots = match config.mode {
            PipelineMode::Blocking => 1,
            PipelineMode::Pipelined => exec.num_slots(),
        };
        let state = PipelineState::new(slots)?;
        let sched = Scheduler::new(exec.num_slots().max(1), exec.vocab_size());
        Ok(Self {
            exec,
            config,
            state,
            sched,
            plan: StepPlan::default(),
            prefill_plan: Vec::new(),
            pause_requested: false,
            paused: false,
            unhealthy: None,
            last_was_prefill: false,
        })
    }

    /// Replace how masks are filled (default: [`crate::SequentialMasks`]),
    /// e.g. with a thread pool so a batch's constrained rows compute their
    /// masks in parallel under the forward.
    pub fn set_mask_filler(&mut self, filler: Box<dyn crate::MaskFiller>) {
        self.sched.masks.filler = filler;
    }

    pub fn executor(&self) -> &E {
        &self.exec
    }

    pub fn executor_mut(&mut self) -> &mut E {
        &mut self.exec
    }

    pub fn config(&self) -> &LoopConfig {
        &self.config
    }

    pub fn state(&self) -> &PipelineState {
        &self.state
    }

    pub fn stats(&self) -> PipelineStats {
        self.sched.stats
    }

    pub fn num_waiting(&self) -> usize {
        self.sched.num_waiting()
    }

    /// Running (admitted, not finalized) sequences.
    pub fn num_running(&self) -> usize {
        self.sched.num_running()
    }

    /// Admitted sequences still holding KV, zombies included.
    pub fn num_admitted(&self) -> usize {
        self.sched.num_admitted()
    }

    /// Preempted sequences waiting to be prefilled again.
    pub fn num_preempted(&self) -> usize {
        self.sched.num_preempted()
    }

    /// No request waiting, running, preempted or in flight.
    pub fn is_idle(&self) -> bool {
        self.sched.num_waiting() == 0 && self.sched.num_live() == 0 && self.state.is_drained()
    }

    pub fn unhealthy(&self) -> Option<&Cause> {
        self.unhealthy.as_ref()
    }

    fn max_rows(&self) -> usize {
        self.config
            .max_batch_size
            .min(self.exec.capabilities().max_rows)
    }

    /// How many requests may wait: `max_waiting` beyond the batch rows that
    /// are free now. The first waiting requests take those rows at the next
    /// iteration, so a burst that fits free rows plus the queue is never
    /// refused (the limit bounds requests that must really wait).
    pub fn waiting_capacity(&self) -> usize {
        let free_rows = self.max_rows().saturating_sub(self.sched.num_admitted());
        self.config.max_waiting + free_rows
    }

    /// Validate and enqueue a request. On error the request is dropped
    /// unresolved: the caller answers the client itself.
    pub fn submit(&mut self, req: Request<E::Params>) -> Result<(), SubmitError> {
        let needed = self.check_submit(&req)?;
        if self.sched.num_waiting() >= self.waiting_capacity() {
            return Err(SubmitError::QueueFull {
                limit: self.config.max_waiting,
            });
        }
        self.sched.enqueue(req, needed, None);
        Ok(())
    }

    /// Validate and enqueue the samples of one request (`n > 1`): the same
    /// prompt, each its own sequence (seed, skill, stop checks, caps), all
    /// queued or none (each takes a place in the waiting queue). The first
    /// is prefilled as any request; every other one is a fork of it
    /// ([`PrefillStart::Fork`](crate::PrefillStart::Fork)): it waits until
    /// the first one's prompt has been launched to its end, then shares its
    /// full prompt pages by reference count. No samples: nothing is queued.
    pub fn submit_samples(&mut self, samples: Vec<Request<E::Params>>) -> Result<(), SubmitError> {
        let Some(first) = samples.first() else {
            return Ok(());
        };
        let mut needed = Vec::with_capacity(samples.len());
        for (i, req) in samples.iter().enumerate() {
            needed.push(self.check_submit(req)?);
            if req.prompt != first.prompt {
                return Err(SubmitError::SamplePromptDiffers { id: req.id });
            }
            if samples[..i].iter().any(|r| r.id == req.id) {
                return Err(SubmitError::DuplicateId(req.id));
            }
        }
        if self.sched.num_waiting() + samples.len() > self.waiting_capacity() {
            return Err(SubmitError::QueueFull {
                limit: self.config.max_waiting,
            });
        }
        let parent = first.id;
        for (i, (req, needed)) in samples.into_iter().zip(needed).enumerate() {
            self.sched.enqueue(req, needed, (i > 0).then_some(parent));
        }
        Ok(())
    }

    /// Every rule of a submission but the queue's room; the KV tokens the
    /// request may need.
    fn check_submit(&self, req: &Request<E::Params>) -> Result<usize, SubmitError> {
        if let Some(why) = &self.unhealthy {
            return Err(SubmitError::Unhealthy(why.clone()));
        }
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if req.max_new_tokens == 0 {
            return Err(SubmitError::ZeroMaxTokens);
        }
        if let Some(e) = req.embeds.as_ref().filter(|e| !e.fits(req.prompt.len())) {
            return Err(SubmitError::EmbedsOutsidePrompt {
                start: e.start,
                len: e.len,
                bidirectional_end: e.bidirectional_end,
                prompt_len: req.prompt.len(),
            });
        }
        if req.prompt.len() >= self.config.max_seq_len {
            return Err(SubmitError::PromptTooLong {
                prompt_len: req.prompt.len(),
                max_seq_len: self.config.max_seq_len,
            });
        }
        let needed = req.max_len(self.config.max_seq_len);
        if !self.exec.could_ever_fit(needed) {
            return Err(SubmitError::NeverFits { needed });
        }
        if self.sched.contains(req.id) {
            return Err(SubmitError::DuplicateId(req.id));
        }
        Ok(needed)
    }

    /// Cancel a request. Returns false when the id is unknown (already done).
    pub fn abort(&mut self, id: RequestId) -> bool {
        match self.sched.abort(&mut self.exec, id) {
            Ok(known) => known,
            Err(Fatal(why)) => {
                self.fail_all(&why);
                true
            }
        }
    }

    /// Ask the loop to drain and pause at the next iteration (section 4.5a).
    pub fn request_pause(&mut self) {
        self.pause_requested = true;
    }

    /// Continue after [`request_pause`](Self::request_pause). If the loop had
    /// drained and paused, the executor first rebuilds what the pause may
    /// have invalidated ([`Executor::on_resume`]); a failure there is
    /// engine-fatal.
    pub fn resume(&mut self) {
        let was_paused = self.paused;
        self.pause_requested = false;
        self.paused = false;
        if was_paused && self.unhealthy.is_none() {
            if let Err(e) = self.exec.on_resume() {
                self.fail_all(&Cause::new(ResumeFailed(e)));
            }
        }
    }

    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// One iteration of the unified loop.
    pub fn run_once(&mut self) -> Tick {
        if self.unhealthy.is_some() {
            return Tick::Unhealthy;
        }
        let result = if self.pause_requested {
            self.drain().map(|()| {
                self.paused = true;
                Tick::Paused
            })
        } else {
            match self.config.mode {
                PipelineMode::Blocking => self.blocking_iteration(),
                PipelineMode::Pipelined => self.pipelined_iteration(),
            }
        };
        let tick = match result {
            Ok(t) => t,
            Err(Fatal(why)) => {
                self.fail_all(&why);
                Tick::Unhealthy
            }
        };
        if self.config.debug_checks {
            if let Err(e) = self.check_invariants() {
                panic!("pipeline invariant violated: {e}");
            }
        }
        tick
    }

    /// Run until idle, paused or unhealthy.
    pub fn run_until_idle(&mut self) -> Tick {
        loop {
            match self.run_once() {
                Tick::Progress => continue,
                t => return t,
            }
        }
    }

    /// Engine-fatal path (section 4.8): resolve everything, release all KV.
    pub fn fail_all(&mut self, why: &Cause) {
        self.sched.fail_all(why);
        self.state.clear();
        self.exec.release_all();
        self.unhealthy = Some(why.clone());
    }

    fn prefill_wanted(&self) -> bool {
        if self.sched.prefill_in_progress() {
            // One prompt at a time: its next chunk, once a slot may take it.
            return self.sched.resumable_prefill();
        }
        match self.sched.next_admission() {
            None => false,
            Some(a) => {
                self.exec.num_allocated() < self.max_rows()
                    && self.exec.can_admit(a.tokens, a.max_len)
            }
        }
    }

    /// Whether a decode step goes before the wanted prefill: after a
    /// prefill step when decode has work, so neither starves. Whole prompts
    /// take turns only under `RideAlong` (`always`); the chunks of a prompt
    /// part-way through take turns in every mode and policy.
    fn decode_turn(&self, always: bool) -> bool {
        self.last_was_prefill
            && (always || self.sched.prefill_in_progress())
            && self.has_decode_work()
    }

    fn blocking_iteration(&mut self) -> Result<Tick, Fatal> {
        if self.prefill_wanted() && !self.decode_turn(false) {
            self.prefill_sync()?;
            return Ok(Tick::Progress);
        }
        match self.launch_decode(0)? {
            Launch::Launched => {
                self.finalize_launch()?;
                self.commit_oldest()?;
                Ok(Tick::Progress)
            }
            Launch::Failed | Launch::Deferred => Ok(Tick::Progress),
            Launch::Nothing => Ok(Tick::Idle),
        }
    }

    fn pipelined_iteration(&mut self) -> Result<Tick, Fatal> {
        if self.prefill_wanted() {
            match self.config.prefill_policy {
                PrefillPolicy::Drain => {
                    if !self.decode_turn(false) {
                        self.drain()?;
                        self.prefill_sync()?;
                        return Ok(Tick::Progress);
                    }
                }
                PrefillPolicy::RideAlong => {
                    // A waiting prefill starts within two decode completions.
                    if let (Some(slot), false) = (self.state.free_slot_id(), self.decode_turn(true))
                    {
                        // A prefill rejected before dispatch failed its
                        // request alone: progress either way.
                        if self.launch_prefill(slot)? {
                            self.finalize_launch()?;
                        }
                        return Ok(Tick::Progress);
                    }
                }
            }
        }
        if self.state.launch_handle().is_none() {
            match self.state.free_slot_id() {
                None => {
                    // Both slots busy: complete the oldest step to free one.
                    self.commit_oldest()?;
                    return Ok(Tick::Progress);
                }
                Some(slot) => match self.launch_decode(slot)? {
                    Launch::Failed => return Ok(Tick::Progress),
                    Launch::Deferred => {
                        // Waiting for pages an in-flight step gives back.
                        self.commit_oldest()?;
                        return Ok(Tick::Progress);
                    }
                    Launch::Launched | Launch::Nothing => {}
                },
            }
        }
        if let Some(h) = self.state.launch_handle().copied() {
            if self.sched.needs_mask(h.slot) {
                // Commit-before-finalize: the mask for t+1 needs step t consumed.
                self.commit_oldest()?;
            }
            self.finalize_launch()?;
            return Ok(Tick::Progress);
        }
        if self.commit_oldest()? {
            return Ok(Tick::Progress);
        }
        Ok(Tick::Idle)
    }

    fn has_decode_work(&self) -> bool {
        self.sched.any_dispatchable()
    }

    /// Plan the next prefill step (the next chunk of the prompt part-way
    /// through, else the next admissions) and launch it into `slot`.
    fn launch_prefill(&mut self, slot: usize) -> Result<bool, Fatal> {
        let budget = PrefillBudget {
            max_tokens: self
                .config
                .prefill_chunk
                .map_or(usize::MAX, NonZeroUsize::get),
            // Admissions take the rows free under the batch cap.
            max_admits: self
                .max_rows()
                .saturating_sub(self.exec.num_allocated())
                .max(1),
        };
        self.sched
            .plan_prefill(&self.exec, budget, &mut self.prefill_plan);
        if self.prefill_plan.is_empty() {
            return Ok(false);
        }
        let launched = self.sched.launch_prefill(
            &mut self.exec,
            slot,
            &self.prefill_plan,
            budget.max_tokens,
        )?;
        if !launched {
            return Ok(false);
        }
        // The one step counter: the pipeline state numbers the launch.
        self.state.launch(slot, StepKind::Prefill)?;
        self.last_was_prefill = true;
        Ok(true)
    }

    /// Seed rule: prefill, sample, wait and commit synchronously on slot 0
    /// of a drained pipeline.
    fn prefill_sync(&mut self) -> Result<(), Fatal> {
        debug_assert!(self.state.is_drained());
        let slot = self
            .state
            .free_slot_id()
            .ok_or(SchedulerFault::NoFreeSlot)?;
        if self.launch_prefill(slot)? {
            self.finalize_launch()?;
            self.commit_oldest()?;
        }
        Ok(())
    }

    /// Plan a decode step, make KV room for it (preempting if pages ran
    /// out) and launch its forward into `slot`.
    fn launch_decode(&mut self, slot: usize) -> Result<Launch, Fatal> {
        let max_rows = self.max_rows();
        let max_drafts = self.exec.capabilities().max_draft_tokens;
        self.sched
            .schedule_decode_step(&mut self.plan, max_rows, max_drafts);
        if self.plan.is_empty() {
            return Ok(Launch::Nothing);
        }
        let changed = self.sched.make_room(&mut self.exec, &mut self.plan)?;
        if self.plan.is_empty() {
            // Sequences were preempted (or failed alone) or wait for pages
            // an in-flight step gives back: progress, not idleness.
            debug_assert!(changed || !self.state.is_drained());
            return Ok(Launch::Deferred);
        }
        if !self.sched.launch_decode(&mut self.exec, &self.plan, slot)? {
            return Ok(Launch::Failed);
        }
        self.state.launch(slot, StepKind::Decode)?;
        self.last_was_prefill = false;
        Ok(Launch::Launched)
    }

    /// Sample the launched forward (with masks when needed) and queue it.
    fn finalize_launch(&mut self) -> Result<(), Fatal> {
        let Some(h) = self.state.launch_handle().copied() else {
            return Ok(());
        };
        let pending = self.sched.finalize_sampling(&mut self.exec, h)?;
        Ok(self.state.on_pending_commit(pending)?)
    }

    /// Commit the oldest sampled step (two-phase). False when none.
    fn commit_oldest(&mut self) -> Result<bool, Fatal> {
        let Some(step) = self.state.pop_oldest()? else {
            return Ok(false);
        };
        self.sched.commit_step(&mut self.exec, step)?;
        self.state.on_step_completed()?;
        Ok(true)
    }

    /// Drain order of sections 4.5a / 4.6: commit sampled steps first, then
    /// finalize (with masks from the updated state) and commit a pending forward.
    fn drain(&mut self) -> Result<(), Fatal> {
        while self.commit_oldest()? {}
        if self.state.launch_handle().is_some() {
            self.finalize_launch()?;
            while self.commit_oldest()? {}
        }
        Ok(())
    }

    /// Check I2 (FIFO), I4 (refs equal membership), I6 (slot busy until
    /// commit) and capacity against the executor. For tests and debug builds.
    pub fn check_invariants(&self) -> Result<(), InvariantError> {
        self.state.check()?;
        let mut slots = Vec::with_capacity(self.state.num_slots());
        slots.extend(self.state.queued().map(|c| c.slot));
        slots.extend(self.state.launch_handle().map(|h| h.slot));
        slots.extend(self.state.committing().map(|c| c.slot));
        self.sched.check(&slots)?;
        if self.unhealthy.is_none() && self.exec.num_allocated() != self.sched.num_admitted() {
            return Err(InvariantError::KvRows {
                allocated: self.exec.num_allocated(),
                admitted: self.sched.num_admitted(),
            });
        }
        if self.sched.num_admitted() > self.max_rows() {
            return Err(InvariantError::OverRows {
                admitted: self.sched.num_admitted(),
                limit: self.max_rows(),
            });
        }
        Ok(())
    }

    /// Which kind of step each in-flight slot holds (for observers and tests).
    pub fn in_flight_kinds(&self) -> impl Iterator<Item = StepKind> + '_ {
        self.state
            .queued()
            .map(|c| c.kind)
            .chain(self.state.launch_handle().map(|h| h.kind))
    }
}

/// Result of trying to launch a decode step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Launch {
    Launched,
    /// No sequence could be dispatched.
    Nothing,
    /// Rejected before dispatch; its requests failed, others may now proceed.
    Failed,
    /// Nothing launched for lack of KV pages: sequences were preempted, or
    /// wait for the pages an in-flight step gives back.
    Deferred,
}

/// [`Executor::on_resume`] failed after a pause.
#[derive(Debug, thiserror::Error)]
#[error("resuming the executor failed")]
struct ResumeFailed<E: std::error::Error + 'static>(#[source] E);
