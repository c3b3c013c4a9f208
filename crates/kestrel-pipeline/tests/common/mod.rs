//! Scenario runner shared by the pipeline's integration tests: drives an
//! `EngineLoop` over a `SimExecutor` with timed arrivals, aborts, pauses and
//! faults, checking every invariant after every iteration.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashSet};
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use kestrel_pipeline::testing::{SimConfig, SimExecutor, SimLog, SimParams, SimSkill};
use kestrel_pipeline::{
    EngineLoop, Executor, LoopConfig, MaskFiller, MaskRow, NgramSpec, PipelineMode, PrefillPolicy,
    PromptEmbeds, Request, Tick,
};

#[derive(Debug, Clone)]
pub struct ReqSpec {
    pub arrive_at: usize,
    pub prompt_len: usize,
    pub max_new: u32,
    pub seed: u64,
    pub stop_after: Option<u32>,
    pub constrained: bool,
    pub abort_at: Option<usize>,
    /// Speculation: drafts per step at most, and the shortest suffix matched.
    pub speculate: Option<(usize, usize)>,
    /// Samples of the prompt (`n`): sample `k` is request [`sample_id`]`(i,
    /// k)` with seed `seed + k`, all submitted together
    /// (`EngineLoop::submit_samples`: the others fork from sample 0). An
    /// abort cancels sample `abort_at % samples` only.
    pub samples: usize,
    /// A bidirectional prefix (as an image's): embedded rows `1..b` and
    /// `PromptEmbeds::bidirectional_end` `b = 1 + x % prompt_len` for
    /// `Some(x)`.
    pub bidirectional: Option<usize>,
}

/// The embedded rows of a request with a bidirectional prefix
/// ([`ReqSpec::bidirectional`]).
pub fn embeds_of(spec: &ReqSpec) -> Option<PromptEmbeds> {
    spec.bidirectional.map(|x| {
        let end = 1 + x % spec.prompt_len;
        PromptEmbeds {
            start: 1.min(end),
            len: end - 1.min(end),
            bidirectional_end: end,
            input: Arc::new(x),
        }
    })
}

/// The pipeline id of sample `k` of request `i`.
pub fn sample_id(i: usize, k: usize) -> u64 {
    (i as u64) << 3 | k as u64
}

/// The request spec of a pipeline id.
pub fn spec_of(sc: &Scenario, id: u64) -> &ReqSpec {
    &sc.reqs[(id >> 3) as usize]
}

#[derive(Debug, Clone)]
pub struct Scenario {
    pub reqs: Vec<ReqSpec>,
    pub max_batch: usize,
    pub num_pages: usize,
    pub max_seq_len: usize,
    pub pause_at: Option<usize>,
    /// Chunked prefill budget (`LoopConfig::prefill_chunk`).
    pub prefill_chunk: Option<NonZeroUsize>,
    /// Draft tokens a step may verify in all (`SimConfig::max_draft_tokens`).
    pub max_draft_tokens: usize,
    /// Outputs repeat with this period (`SimConfig::period`), so drafts hit.
    pub period: Option<usize>,
    pub fail_decode_launch: HashSet<u64>,
    pub fail_prefill_launch: HashSet<u64>,
    pub fail_wait: HashSet<u64>,
    /// Submit each sample as a request of its own (no forks): the reference
    /// a run with forks must agree with.
    pub samples_apart: bool,
}

#[derive(Debug)]
pub struct RunResult {
    pub logs: BTreeMap<u64, SimLog>,
    pub rejected: BTreeMap<u64, String>,
    pub unhealthy: bool,
    pub max_in_flight: usize,
    pub stats: kestrel_pipeline::PipelineStats,
}

/// A [`MaskFiller`] that fills rows in reverse order.
pub struct ReversedMasks;

impl MaskFiller for ReversedMasks {
    fn fill(&mut self, rows: &mut [MaskRow<'_>], vocab_size: usize) {
        for row in rows.iter_mut().rev() {
            row.fill(vocab_size);
        }
    }
}

pub fn run(sc: &Scenario, mode: PipelineMode, policy: PrefillPolicy) -> RunResult {
    let exec = SimExecutor::new(SimConfig {
        vocab_size: 64,
        max_rows: 64,
        num_pages: sc.num_pages,
        page_size: 4,
        fail_decode_launch: sc.fail_decode_launch.clone(),
        fail_prefill_launch: sc.fail_prefill_launch.clone(),
        fail_wait: sc.fail_wait.clone(),
        trace: false,
        max_draft_tokens: sc.max_draft_tokens,
        period: sc.period,
    });
    let config = LoopConfig {
        mode,
        prefill_policy: policy,
        max_batch_size: sc.max_batch,
        max_waiting: 1 << 20,
        max_seq_len: sc.max_seq_len,
        prefill_chunk: sc.prefill_chunk,
        debug_checks: false,
    };
    let mut engine = EngineLoop::new(exec, config).expect("valid config");
    if policy == PrefillPolicy::RideAlong {
        // Masks filled last row first: tokens must not depend on fill order
        // (and a row paired with the wrong sequence's mask would show).
        engine.set_mask_filler(Box::new(ReversedMasks));
    }
    let mut logs: BTreeMap<u64, Arc<Mutex<SimLog>>> = BTreeMap::new();
    let mut rejected = BTreeMap::new();
    let mut submitted = 0usize;
    let mut order: Vec<usize> = (0..sc.reqs.len()).collect();
    order.sort_by_key(|&i| sc.reqs[i].arrive_at);
    let mut clock = 0usize;
    let mut max_in_flight = 0;
    let mut paused_once = false;
    for _guard in 0..200_000 {
        // Arrivals due now (when idle, time jumps to the next arrival).
        while submitted < order.len() && sc.reqs[order[submitted]].arrive_at <= clock {
            let i = order[submitted];
            let spec = &sc.reqs[i];
            let mut samples = Vec::new();
            for k in 0..spec.samples.max(1) {
                let (skill, log) = SimSkill::new(
                    spec.stop_after,
                    spec.constrained.then_some(spec.seed ^ 0xabc),
                );
                let req = Request {
                    id: sample_id(i, k),
                    prompt: (0..spec.prompt_len as u32).map(|t| t % 60 + 1).collect(),
                    max_new_tokens: spec.max_new,
                    params: SimParams {
                        seed: spec.seed.wrapping_add(k as u64),
                        ..Default::default()
                    },
                    speculate: spec.speculate.map(|(k, min_ngram)| NgramSpec {
                        min_ngram,
                        ..NgramSpec::new(k)
                    }),
                    skill: Box::new(skill),
                    embeds: embeds_of(spec),
                };
                samples.push((req, log));
            }
            let ids: Vec<u64> = samples.iter().map(|(r, _)| r.id).collect();
            let (reqs, sample_logs): (Vec<_>, Vec<_>) = samples.into_iter().unzip();
            let submitted_ok = if sc.samples_apart {
                reqs.into_iter()
                    .map(|r| engine.submit(r))
                    .collect::<Result<Vec<()>, _>>()
                    .map(drop)
            } else {
                engine.submit_samples(reqs)
            };
            match submitted_ok {
                Ok(()) => {
                    logs.extend(ids.into_iter().zip(sample_logs));
                }
                Err(e) => {
                    for id in ids {
                        rejected.insert(id, e.to_string());
                    }
                }
            }
            submitted += 1;
        }
        for (i, spec) in sc.reqs.iter().enumerate() {
            if let Some(at) = spec.abort_at.filter(|&at| at == clock) {
                engine.abort(sample_id(i, at % spec.samples.max(1)));
            }
        }
        if sc.pause_at == Some(clock) && !paused_once {
            paused_once = true;
            engine.request_pause();
            let t = engine.run_once();
            if t == Tick::Paused {
                assert!(engine.state().is_drained(), "paused with steps in flight");
                assert_eq!(engine.run_once(), Tick::Paused);
                engine.resume();
            }
        }
        let tick = engine.run_once();
        max_in_flight = max_in_flight.max(engine.state().in_flight());
        if let Err(e) = engine.check_invariants() {
            panic!("invariant violated at clock {clock}: {e}");
        }
        assert!(
            engine.executor().violations.is_empty(),
            "device violations: {:?}",
            engine.executor().violations
        );
        clock += 1;
        match tick {
            Tick::Progress => {}
            Tick::Paused => panic!("paused without a pause request"),
            Tick::Unhealthy => {
                assert_eq!(
                    engine.executor().num_allocated(),
                    0,
                    "KV left allocated after engine-fatal"
                );
                // Later arrivals are refused.
                while submitted < order.len() {
                    let i = order[submitted];
                    for k in 0..sc.reqs[i].samples.max(1) {
                        rejected.insert(sample_id(i, k), "unhealthy".into());
                    }
                    submitted += 1;
                }
                return finish(logs, rejected, true, max_in_flight, engine.stats());
            }
            Tick::Idle => {
                if submitted == order.len() {
                    assert!(
                        engine.is_idle(),
                        "idle tick with work left: {engine:?} alloc={} pages={}",
                        engine.executor().num_allocated(),
                        engine.executor().used_pages()
                    );
                    assert_eq!(
                        engine.executor().num_allocated(),
                        0,
                        "rows left allocated when idle"
                    );
                    assert_eq!(
                        engine.executor().used_pages(),
                        0,
                        "pages left allocated when idle"
                    );
                    return finish(logs, rejected, false, max_in_flight, engine.stats());
                }
                clock = clock.max(sc.reqs[order[submitted]].arrive_at);
            }
        }
    }
    panic!("engine did not finish: hung? {engine:?}");
}

fn finish(
    logs: BTreeMap<u64, Arc<Mutex<SimLog>>>,
    rejected: BTreeMap<u64, String>,
    unhealthy: bool,
    max_in_flight: usize,
    stats: kestrel_pipeline::PipelineStats,
) -> RunResult {
    let logs = logs
        .into_iter()
        .map(|(k, v)| (k, v.lock().unwrap().clone()))
        .collect();
    RunResult {
        logs,
        rejected,
        unhealthy,
        max_in_flight,
        stats,
    }
}

/// Per-request checks that hold in every run.
pub fn check_requests(sc: &Scenario, r: &RunResult) {
    for (id, log) in &r.logs {
        let spec = spec_of(sc, *id);
        assert!(
            log.violations.is_empty(),
            "request {id}: {:?}",
            log.violations
        );
        assert_eq!(
            log.finish_calls, 1,
            "request {id} resolved {} times",
            log.finish_calls
        );
        assert!(
            log.tokens.len() <= spec.max_new as usize,
            "request {id} emitted past max_new_tokens"
        );
        assert!(
            spec.prompt_len + log.tokens.len() <= sc.max_seq_len,
            "request {id} exceeded the context"
        );
    }
    let samples: usize = sc.reqs.iter().map(|r| r.samples.max(1)).sum();
    assert_eq!(
        r.logs.len() + r.rejected.len(),
        samples,
        "every request answered"
    );
}
