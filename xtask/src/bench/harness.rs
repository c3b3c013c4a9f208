//! Drives the real engine core (`EngineLoop<R>` for any [`BenchRuntime`])
//! through one workload and records what happened, step by step.
//!
//! Two transparent wrappers do the recording without touching the engine:
//! [`Instrumented`] forwards every `Executor` call and times `wait_step` (the
//! scheduler thread blocked on the device), and [`Recording`] forwards every
//! `SequenceSkill` call and timestamps each committed token. Device timings
//! come from the runtime itself ([`kestrel_pipeline::Executor::drain_timings`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::Instant;

use anyhow::{bail, Context as _};
use kestrel_pipeline::{
    CommittedToken, EngineLoop, Observed, Outcome, Request, SamplingParams, SequenceSkill, SlotId,
    Tick, TokenMask, Verdict, WaitObserver,
};

use super::runtime::BenchRuntime;
use super::workload::{LengthPlan, PreparedRequest, PromptSet, Workload};

/// Times how long the scheduler thread waits for each step (the observer
/// of the pipeline's forwarding `Observed` executor).
#[derive(Debug, Default)]
pub struct WaitTimer {
    started: Option<Instant>,
    /// `wait_step` intervals since the last [`WaitTimer::take_waits`].
    waits: Vec<(Instant, Instant)>,
}

impl WaitTimer {
    pub fn take_waits(&mut self) -> Vec<(Instant, Instant)> {
        std::mem::replace(&mut self.waits, Vec::with_capacity(4096))
    }
}

impl WaitObserver for WaitTimer {
    fn before_wait(&mut self, _slot: SlotId) {
        self.started = Some(Instant::now());
    }
    fn after_wait(&mut self, _slot: SlotId) {
        if let Some(start) = self.started.take() {
            self.waits.push((start, Instant::now()));
        }
    }
}

/// An executor whose `wait_step` calls are timed.
pub type Instrumented<E> = Observed<E, WaitTimer>;

/// The engine as the bench drives it.
pub type BenchEngine<R> = EngineLoop<Instrumented<R>>;

/// What one request's recording wrapper reports when it finishes.
#[derive(Debug)]
struct RequestRecord {
    stream: usize,
    submitted: Instant,
    tokens: Vec<Instant>,
    failed: Option<String>,
}

/// A `SequenceSkill` that forwards to the real skill and timestamps tokens.
struct Recording {
    inner: Box<dyn SequenceSkill>,
    stream: usize,
    submitted: Instant,
    tokens: Vec<Instant>,
    done: Sender<RequestRecord>,
}

impl SequenceSkill for Recording {
    fn consume(&mut self, token: &CommittedToken<'_>) -> Verdict {
        self.tokens.push(Instant::now());
        self.inner.consume(token)
    }
    fn is_constrained(&self) -> bool {
        self.inner.is_constrained()
    }
    fn fill_mask(&mut self, mask: &mut TokenMask<'_>) {
        self.inner.fill_mask(mask)
    }
    fn finish(&mut self, outcome: Outcome) {
        let failed = match &outcome {
            Outcome::Failed(kind, why) => Some(format!("{kind:?}: {why}")),
            Outcome::Finished(_) => None,
        };
        self.inner.finish(outcome);
        // The driver outlives every request; a closed channel only means it
        // already gave up on this run.
        let _ = self.done.send(RequestRecord {
            stream: self.stream,
            submitted: self.submitted,
            tokens: std::mem::take(&mut self.tokens),
            failed,
        });
    }
}

/// Kind of a recorded step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Kind {
    Prefill,
    Decode,
}

/// One committed step; times in seconds from the start of the run.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct StepRecord {
    pub kind: Kind,
    pub rows: usize,
    /// Rows of this step whose sequence had already finished (outputs discarded).
    pub zombie_rows: usize,
    pub forward: (f64, f64),
    pub sample: (f64, f64),
}

/// Everything recorded in one run of one workload under one configuration.
#[derive(Debug, Default)]
pub struct RunData {
    pub wall_s: f64,
    pub steps: Vec<StepRecord>,
    /// `run_once` intervals (scheduler thread inside the engine loop).
    pub ticks: Vec<(f64, f64)>,
    /// `wait_step` intervals (scheduler thread blocked on the device).
    pub waits: Vec<(f64, f64)>,
    /// Per request: time to first token (s) and its tokens' commit times.
    pub ttft_s: Vec<f64>,
    pub itl_s: Vec<f64>,
    pub lengths: Vec<usize>,
    pub prompt_tokens: usize,
    pub zombie_rows: u64,
    pub decode_rows: u64,
    pub masked_steps: u64,
}

/// Run `w` to completion on `engine` (which must be idle).
pub fn run_workload<R: BenchRuntime>(
    engine: &mut BenchEngine<R>,
    prompts: &PromptSet,
    w: &Workload,
    plan: &LengthPlan,
    mut on_token: impl FnMut(u64),
) -> anyhow::Result<RunData> {
    if !engine.is_idle() {
        bail!("engine is not idle before a run");
    }
    // Build every request (grammars compiled) before the clock starts: in a
    // server that happens on the request's own task, not on the engine thread.
    let mut per_stream: Vec<VecDeque<PreparedRequest>> =
        (0..w.streams).map(|_| VecDeque::new()).collect();
    for i in 0..w.requests() {
        per_stream[i % w.streams].push_back(prompts.request(w, plan, i)?);
    }
    let mut data = RunData::default();
    let (tx, rx): (Sender<RequestRecord>, Receiver<RequestRecord>) = channel();
    let exec = engine.executor_mut();
    exec.observer.take_waits();
    exec.inner
        .record_timings(true)
        .context("recording step timings")?;
    let stats0 = engine.stats();
    let start = Instant::now();
    let secs = |t: Instant| t.saturating_duration_since(start).as_secs_f64();
    let mut submit =
        |engine: &mut BenchEngine<R>, stream: usize, data: &mut RunData| -> anyhow::Result<bool> {
            let Some(req) = per_stream[stream].pop_front() else {
                return Ok(false);
            };
            data.prompt_tokens += req.prompt.len();
            let skill = Recording {
                inner: Box::new(req.skill),
                stream,
                submitted: Instant::now(),
                tokens: Vec::with_capacity(req.max_new_tokens as usize),
                done: tx.clone(),
            };
            engine
                .submit(Request {
                    embeds: None,
                    id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                    prompt: req.prompt,
                    max_new_tokens: req.max_new_tokens,
                    params: SamplingParams::greedy(),
                    speculate: None,
                    skill: Box::new(skill),
                })
                .context("submitting a request")?;
            Ok(true)
        };
    for stream in 0..w.streams {
        submit(engine, stream, &mut data)?;
    }
    let mut finished = 0;
    let mut zombies_seen = stats0.zombie_rows;
    let mut timings = Vec::new();
    while finished < w.requests() {
        let t0 = Instant::now();
        let tick = engine.run_once();
        let t1 = Instant::now();
        data.ticks.push((secs(t0), secs(t1)));
        timings.clear();
        engine.executor_mut().inner.drain_timings(&mut timings);
        let zombies = engine.stats().zombie_rows;
        let mut new_zombies = (zombies - zombies_seen) as usize;
        zombies_seen = zombies;
        // Zombie rows are counted at their step's commit: attribute them to
        // the last decode step committed by this iteration.
        for t in timings.iter().rev() {
            let zombie_rows = if t.prefill {
                0
            } else {
                std::mem::take(&mut new_zombies)
            };
            data.steps.push(StepRecord {
                kind: if t.prefill {
                    Kind::Prefill
                } else {
                    Kind::Decode
                },
                rows: t.rows,
                zombie_rows,
                forward: (secs(t.forward_start), secs(t.forward_end)),
                sample: (secs(t.sample_start), secs(t.sample_end)),
            });
        }
        let n = timings.len();
        let len = data.steps.len();
        data.steps[len - n..].reverse();
        while let Ok(rec) = rx.try_recv() {
            finished += 1;
            if let Some(why) = rec.failed {
                bail!("a request failed: {why}");
            }
            on_token(rec.tokens.len() as u64);
            if let Some(first) = rec.tokens.first() {
                data.ttft_s
                    .push(first.saturating_duration_since(rec.submitted).as_secs_f64());
            }
            data.itl_s.extend(
                rec.tokens
                    .windows(2)
                    .map(|p| p[1].saturating_duration_since(p[0]).as_secs_f64()),
            );
            data.lengths.push(rec.tokens.len());
            submit(engine, rec.stream, &mut data)?;
        }
        match tick {
            Tick::Progress => {}
            Tick::Idle if finished < w.requests() => {
                bail!(
                    "engine went idle with {} requests unfinished",
                    w.requests() - finished
                )
            }
            Tick::Idle => {}
            Tick::Paused => bail!("engine paused during a run"),
            Tick::Unhealthy => {
                let cause = engine
                    .unhealthy()
                    .cloned()
                    .unwrap_or_else(|| kestrel_pipeline::Cause::message("unknown fault"));
                return Err(anyhow::Error::new(cause).context("engine unhealthy"));
            }
        }
    }
    // The user-visible end: the last token of the last request.
    data.wall_s = start.elapsed().as_secs_f64();
    // Let any zombie-only step still in flight commit so the engine is idle.
    while engine.run_once() == Tick::Progress {}
    let exec = engine.executor_mut();
    exec.inner
        .record_timings(false)
        .context("recording step timings")?;
    data.waits = exec
        .observer
        .take_waits()
        .into_iter()
        .map(|(a, b)| (secs(a), secs(b)))
        .collect();
    let stats = engine.stats();
    data.zombie_rows = stats.zombie_rows - stats0.zombie_rows;
    data.decode_rows = stats.decode_rows - stats0.decode_rows;
    data.masked_steps = stats.masked_steps - stats0.masked_steps;
    data.steps
        .sort_by(|a, b| a.forward.0.total_cmp(&b.forward.0));
    Ok(data)
}

/// Request ids only need to be unique among live requests.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

#[cfg(test)]
mod tests {
    use kestrel_pipeline::testing::{SimConfig, SimExecutor};
    use kestrel_pipeline::Executor;

    use super::*;

    /// The bench's wrapper reports its runtime's capabilities unchanged.
    #[test]
    fn instrumented_forwards_capabilities() {
        let inner = SimExecutor::new(SimConfig {
            max_rows: 5,
            max_draft_tokens: 0,
            ..SimConfig::default()
        });
        let caps = inner.capabilities();
        let wrapped: Instrumented<SimExecutor> = Observed {
            inner,
            observer: WaitTimer::default(),
        };
        assert_eq!(wrapped.capabilities(), caps);
        assert_eq!((caps.max_rows, caps.max_draft_tokens), (5, 0));
    }
}
