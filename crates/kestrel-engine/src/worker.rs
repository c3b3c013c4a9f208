//! The engine thread: the one owner of `EngineLoop<R>` (and so of the
//! runtime and all KV). Handlers reach it only through [`Command`]s.
//!
//! Loop: drain commands without blocking, run one pipeline iteration,
//! publish gauges; block on the channel only when the loop is idle, paused
//! or unhealthy. Nothing here waits on a client: replies go through
//! unbounded or oneshot channels. After an engine-fatal fault the thread
//! keeps answering commands (with `Unavailable`) until shutdown.

use std::collections::HashMap;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kestrel_pipeline::{
    EngineLoop, Outcome, Request, SamplingParams, SequenceSkill as _, StepTiming, SubmitError, Tick,
};

use crate::engine::Shared;
use crate::error::EngineError;
use crate::model::Runtime;
use crate::skill::{EventSender, StreamingSkill};
use crate::validate::Field;

/// A request validated on the caller's thread, ready for `EngineLoop::submit`
/// (one sample) or `EngineLoop::submit_samples` (`n > 1`) once its prompt
/// is scored (when it asked).
pub(crate) struct Submission {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub max_new_tokens: u32,
    pub speculate: Option<kestrel_pipeline::NgramSpec>,
    /// Alternatives per prompt position when the prompt is to be scored.
    pub prompt_logprobs: Option<u32>,
    /// One per sample, in sample order (at least one).
    pub samples: Vec<SampleSubmission>,
    /// Prompt rows embedded from an image, if any (every sample's).
    pub embeds: Option<kestrel_pipeline::PromptEmbeds>,
}

/// One sample of a [`Submission`]: a pipeline sequence of its own.
pub(crate) struct SampleSubmission {
    pub pipeline_id: u64,
    /// The request's parameters with the sample's seed.
    pub params: SamplingParams,
    pub skill: StreamingSkill,
    /// The client's channel, for errors raised before the skill owns it.
    pub events: EventSender,
}

/// What handlers ask of the engine thread.
pub(crate) enum Command {
    Submit(Box<Submission>),
    /// Abort by the caller's request id.
    Abort {
        request_id: String,
    },
    /// Abort by pipeline id (a dropped stream).
    AbortPipeline(u64),
    /// Stop accepting work; finish or cancel in-flight requests by `deadline`, then exit.
    Shutdown {
        deadline: Instant,
        reply: tokio::sync::oneshot::Sender<()>,
    },
}

pub(crate) struct Worker<R: Runtime> {
    lp: EngineLoop<R>,
    commands: Receiver<Command>,
    done_rx: Receiver<u64>,
    /// Live requests: caller id -> its samples' pipeline ids, and back.
    live: HashMap<String, Vec<u64>>,
    by_pipeline: HashMap<u64, String>,
    shared: Arc<Shared>,
    shutdown_deadline: Option<Instant>,
    deadline_aborted: bool,
    shutdown_replies: Vec<tokio::sync::oneshot::Sender<()>>,
    /// Step timings reported by the runtime (reused buffer).
    timings: Vec<StepTiming>,
    /// The runtime reports device intervals: no host-side approximation.
    device_measured: bool,
    last_device_end: Option<Instant>,
}

/// Marks the thread as gone (and unhealthy on a panic) however it exits.
struct ExitGuard(Arc<Shared>);

impl Drop for ExitGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = self.0.fatal.set(kestrel_pipeline::Cause::message(
                "the engine thread panicked",
            ));
            self.0.metrics.healthy.set(0);
        }
        self.0.exited.store(true, SeqCst);
    }
}

/// Whether a step's masks should be filled on a thread pool: only with at
/// least two cores beyond the runtime's compute threads and this thread. On
/// a CPU runtime using every core, the pool would steal cycles from the
/// forward the masks hide under, and its wake-ups cost more than a typical
/// mask (see the `mask` bench of kestrel-skills).
fn parallel_masks_pay(runtime_threads: usize) -> bool {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores >= runtime_threads + 3
}

impl<R: Runtime> Worker<R> {
    pub fn new(
        mut lp: EngineLoop<R>,
        commands: Receiver<Command>,
        done_rx: Receiver<u64>,
        shared: Arc<Shared>,
    ) -> Self {
        if parallel_masks_pay(lp.executor().host_compute_threads()) {
            lp.set_mask_filler(Box::new(kestrel_skills::ParallelMasks::default()));
        }
        Self {
            lp,
            commands,
            done_rx,
            live: HashMap::new(),
            by_pipeline: HashMap::new(),
            shared,
            shutdown_deadline: None,
            deadline_aborted: false,
            shutdown_replies: Vec::new(),
            timings: Vec::new(),
            device_measured: false,
            last_device_end: None,
        }
    }

    pub fn run(mut self) {
        let _guard = ExitGuard(Arc::clone(&self.shared));
        let mut last_busy_end: Option<Instant> = None;
        loop {
            if !self.drain_commands() {
                break;
            }
            self.reap_done();
            if self.shutdown_deadline.is_some() {
                self.enforce_deadline();
                if self.lp.is_idle() || self.lp.unhealthy().is_some() {
                    break;
                }
            }
            if self.lp.unhealthy().is_some() {
                if !self.block_for_command() {
                    break;
                }
                continue;
            }
            let start = Instant::now();
            if let (Some(end), false) = (last_busy_end, self.device_measured) {
                self.shared.metrics.device_gap.observe(start - end);
            }
            let tick = self.lp.run_once();
            let end = Instant::now();
            self.record_device_intervals();
            self.reap_done();
            self.publish();
            match tick {
                Tick::Progress => {
                    self.shared.metrics.step_period.observe(end - start);
                    last_busy_end = Some(end);
                }
                Tick::Idle | Tick::Paused => {
                    last_busy_end = None;
                    self.last_device_end = None;
                    if self.shutdown_deadline.is_some() && self.lp.is_idle() {
                        break;
                    }
                    if !self.block_for_command() {
                        break;
                    }
                }
                Tick::Unhealthy => {
                    last_busy_end = None;
                    let why = self
                        .lp
                        .unhealthy()
                        .cloned()
                        .unwrap_or_else(|| kestrel_pipeline::Cause::message("engine fault"));
                    tracing::error!(
                        why = %crate::error::error_chain(&why),
                        "engine-fatal fault: every request failed, not serving"
                    );
                    let _ = self.shared.fatal.set(why);
                    self.shared.metrics.healthy.set(0);
                    self.live.clear();
                    self.by_pipeline.clear();
                }
            }
        }
        self.finish_shutdown();
    }

    /// Handle every queued command. False when every sender is gone.
    fn drain_commands(&mut self) -> bool {
        loop {
            match self.commands.try_recv() {
                Ok(cmd) => self.handle(cmd),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => {
                    // No handle and no stream left: nobody can see the results.
                    self.begin_shutdown(Instant::now());
                    return false;
                }
            }
        }
    }

    /// Block until a command arrives (or the shutdown deadline). False when
    /// every sender is gone.
    fn block_for_command(&mut self) -> bool {
        let start = Instant::now();
        let got = match self.shutdown_deadline {
            None => self
                .commands
                .recv()
                .map_err(|_| RecvTimeoutError::Disconnected),
            Some(d) => self.commands.recv_timeout(
                d.saturating_duration_since(start)
                    .max(Duration::from_millis(1)),
            ),
        };
        let waited = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.shared.metrics.idle_nanos.fetch_add(waited, Relaxed);
        match got {
            Ok(cmd) => {
                self.handle(cmd);
                true
            }
            Err(RecvTimeoutError::Timeout) => true,
            Err(RecvTimeoutError::Disconnected) => false,
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(sub) => self.submit(*sub),
            Command::Abort { request_id } => {
                for pid in self.live.get(&request_id).cloned().unwrap_or_default() {
                    self.lp.abort(pid);
                }
            }
            Command::AbortPipeline(pid) => {
                self.lp.abort(pid);
            }
            Command::Shutdown { deadline, reply } => {
                self.shutdown_replies.push(reply);
                self.begin_shutdown(deadline);
            }
        }
        self.reap_done();
    }

    fn submit(&mut self, sub: Submission) {
        let Submission {
            request_id,
            prompt,
            max_new_tokens,
            speculate,
            prompt_logprobs,
            mut samples,
            embeds,
        } = sub;
        let places = samples.len();
        let prompt_tokens = prompt.len();
        let events: Vec<EventSender> = samples.iter().map(|s| s.events.clone()).collect();
        // Why the request is refused, as a maker: every sample's stream
        // gets the error.
        let refused: Option<Box<dyn Fn() -> EngineError>> = if self.shutdown_deadline.is_some() {
            Some(Box::new(|| EngineError::ShuttingDown))
        } else if let Some(why) = self.lp.unhealthy().cloned() {
            Some(Box::new(move || EngineError::Fatal(why.clone())))
        } else if self.live.contains_key(&request_id) {
            let message = format!("request id {request_id:?} is already in use");
            Some(Box::new(move || {
                EngineError::invalid(Field::RequestId, message.clone())
            }))
        } else if let Some(Err(why)) = prompt_logprobs
            .map(|top| self.lp.executor().score_prompt(&prompt, top as usize))
            .map(|scored| {
                // Scored once; every sample's response carries the scores.
                scored.map(|s| {
                    for sample in &mut samples {
                        sample.skill.set_prompt_logprobs(&prompt, s.clone());
                    }
                })
            })
        {
            // Scoring runs on the runtime before the request exists in the
            // pipeline: a failure is this request's alone.
            Some(Box::new(move || EngineError::RequestFailed(why.clone())))
        } else if max_new_tokens == 0 {
            // Only the prompt was asked for (validation allows 0 only with
            // prompt_logprobs): the request ends here, never queued.
            self.shared
                .metrics
                .prompt_tokens
                .fetch_add(prompt_tokens as u64, Relaxed);
            for sample in &mut samples {
                let length = kestrel_pipeline::FinishReason::Length;
                sample.skill.finish(Outcome::Finished(length));
            }
            None
        } else {
            let pids: Vec<u64> = samples.iter().map(|s| s.pipeline_id).collect();
            let mut requests: Vec<_> = samples
                .drain(..)
                .map(|s| Request {
                    id: s.pipeline_id,
                    prompt: prompt.clone(),
                    max_new_tokens,
                    params: s.params,
                    speculate,
                    skill: Box::new(s.skill),
                    embeds: embeds.clone(),
                })
                .collect();
            let submitted = match requests.len() {
                1 => self.lp.submit(requests.remove(0)),
                _ => self.lp.submit_samples(requests),
            };
            match submitted {
                Ok(()) => {
                    self.shared
                        .metrics
                        .prompt_tokens
                        .fetch_add(prompt_tokens as u64, Relaxed);
                    for &pid in &pids {
                        self.by_pipeline.insert(pid, request_id.clone());
                    }
                    self.live.insert(request_id.clone(), pids);
                    None
                }
                Err(e) => {
                    let max_seq_len = self.lp.config().max_seq_len;
                    let max_new = max_new_tokens as usize;
                    Some(Box::new(move || {
                        submit_error(e.clone(), prompt_tokens, max_new, max_seq_len)
                    }))
                }
            }
        };
        if let Some(error) = refused {
            tracing::debug!(id = %request_id, error = %error(), "request refused");
            self.shared.metrics.rejected.fetch_add(1, Relaxed);
            for tx in &events {
                let _ = tx.send(Err(error()));
            }
        }
        self.shared
            .metrics
            .waiting
            .set(self.lp.num_waiting() as u64);
        // Release the caller's queue reservations only now that the waiting
        // gauge counts the request: otherwise, for a moment, it is counted
        // nowhere and a full queue admits one more.
        self.shared.in_transit.fetch_sub(places, SeqCst);
    }

    /// Forget ids of requests whose skill finished.
    fn reap_done(&mut self) {
        while let Ok(pid) = self.done_rx.try_recv() {
            let Some(id) = self.by_pipeline.remove(&pid) else {
                continue;
            };
            if let Some(pids) = self.live.get_mut(&id) {
                pids.retain(|&p| p != pid);
                if pids.is_empty() {
                    self.live.remove(&id);
                }
            }
        }
    }

    fn begin_shutdown(&mut self, deadline: Instant) {
        self.shared.shutting_down.send_replace(true);
        self.shutdown_deadline = Some(match self.shutdown_deadline {
            Some(d) => d.min(deadline),
            None => deadline,
        });
    }

    /// Past the shutdown deadline: abort everything still live (once).
    fn enforce_deadline(&mut self) {
        let Some(d) = self.shutdown_deadline else {
            return;
        };
        if self.deadline_aborted || Instant::now() < d {
            return;
        }
        self.deadline_aborted = true;
        let pids: Vec<u64> = self.by_pipeline.keys().copied().collect();
        tracing::info!(requests = pids.len(), "shutdown deadline passed: aborting");
        for pid in pids {
            self.lp.abort(pid);
        }
    }

    fn finish_shutdown(&mut self) {
        if self.lp.unhealthy().is_none() && !self.lp.is_idle() {
            // Every sender is gone: cancel what is left and drain it.
            for pid in self.by_pipeline.keys().copied().collect::<Vec<_>>() {
                self.lp.abort(pid);
            }
            self.lp.run_until_idle();
        }
        self.reap_done();
        self.publish();
        self.shared.metrics.healthy.set(0);
        self.shared.exited.store(true, SeqCst);
        for reply in self.shutdown_replies.drain(..) {
            let _ = reply.send(());
        }
        tracing::info!("engine thread stopped");
    }

    /// Device idle between forwards (sampling end to the next forward's
    /// start), from the runtime's own timestamps. Runtimes that do not
    /// measure report none; the engine then approximates device idle from
    /// host timestamps around `run_once`.
    fn record_device_intervals(&mut self) {
        self.timings.clear();
        self.lp.executor_mut().drain_timings(&mut self.timings);
        for t in &self.timings {
            let (start, end) = (t.forward_start, t.sample_end);
            self.device_measured = true;
            if let Some(prev) = self.last_device_end {
                self.shared
                    .metrics
                    .device_gap
                    .observe(start.saturating_duration_since(prev));
            }
            self.last_device_end = Some(end);
        }
    }

    /// Sets the gauges from the loop's and the runtime's state.
    pub(crate) fn publish(&self) {
        let m = &self.shared.metrics;
        m.waiting.set(self.lp.num_waiting() as u64);
        m.running.set(self.lp.num_running() as u64);
        m.admitted.set(self.lp.num_admitted() as u64);
        self.shared
            .waiting_capacity
            .store(self.lp.waiting_capacity(), SeqCst);
        let kv = self.lp.executor().kv_stats();
        m.kv_total.set(kv.total_pages as u64);
        m.kv_used.set(kv.used_pages as u64);
        m.kv_free.set(kv.free_pages as u64);
        m.kv_cached.set(kv.cached_pages as u64);
        m.prefix_hit_tokens.set(kv.prefix_hit_tokens);
        m.fork_shared_tokens.set(kv.fork_shared_tokens);
        m.kv_prompt_tokens.set(kv.prompt_tokens);
        let steps = self.lp.stats();
        m.prefill_steps.set(steps.prefill_steps);
        m.decode_steps.set(steps.decode_steps);
        m.preemptions.set(steps.preemptions);
        m.draft_tokens.set(steps.draft_tokens);
        m.accepted_drafts.set(steps.accepted_drafts);
        m.preempted.set(self.lp.num_preempted() as u64);
        let images = self.lp.executor().image_stats();
        m.image_encodes.set(images.encodes);
        m.image_cache_hits.set(images.cache_hits);
    }
}

/// The engine's error for a submission the loop refused.
fn submit_error(
    e: SubmitError,
    prompt_tokens: usize,
    max_new_tokens: usize,
    max_seq_len: usize,
) -> EngineError {
    match e {
        SubmitError::QueueFull { limit } => EngineError::QueueFull { limit },
        SubmitError::PromptTooLong { max_seq_len, .. } => EngineError::ContextOverflow {
            prompt_tokens,
            max_new_tokens,
            limit: max_seq_len,
        },
        // The KV cache is smaller than this request's budget.
        SubmitError::NeverFits { needed } => EngineError::ContextOverflow {
            prompt_tokens,
            max_new_tokens,
            limit: needed.saturating_sub(1).min(max_seq_len),
        },
        SubmitError::EmptyPrompt => EngineError::invalid(Field::Prompt, "the prompt is empty"),
        SubmitError::ZeroMaxTokens => {
            EngineError::invalid(Field::MaxNewTokens, "must be at least 1")
        }
        SubmitError::DuplicateId(id) => {
            EngineError::invalid(Field::RequestId, format!("internal id {id} in use"))
        }
        SubmitError::Unhealthy(why) => EngineError::Fatal(why),
        // The engine gives every sample the request's one prompt.
        SubmitError::SamplePromptDiffers { id } => {
            EngineError::invalid(Field::N, format!("sample {id}'s prompt differs"))
        }
        // The engine's validation builds the embedded rows inside the
        // prompt it builds with them.
        e @ SubmitError::EmbedsOutsidePrompt { .. } => {
            EngineError::invalid(Field::Prompt, e.to_string())
        }
    }
}
