//! The CPU runtime driven by the real pipeline loop: blocking and pipelined
//! modes (both prefill policies) give identical tokens; a request gives the
//! same tokens alone and in a batch, on 1 and 2 threads, in the default
//! (fast) numerics; the real default model in exact numerics reproduces the
//! f32 NumPy reference's greedy tokens through the whole stack; step
//! timings come back through the `Executor` trait, one per step, in order;
//! calls that break the slot protocol are refused with kestrel-kv's typed
//! `StateError`, without a hang and without losing the step in flight.

use std::sync::{Arc, Mutex};

use kestrel_cpu::runtime::{CpuRuntime, CpuRuntimeConfig, RuntimeError, StepConfig};
use kestrel_cpu::Numerics;
use kestrel_model::{synthetic_weights, DType, ModelConfig, ModelWeights};
use kestrel_pipeline::{
    CommittedToken, Drafts, DraftsError, EngineLoop, ExecError, Executor, LoopConfig, NgramSpec,
    Observed, Outcome, PipelineMode, PipelineStats, PrefillInput, PrefillPolicy, PrefillStart,
    Request, SamplingParams, SequenceSkill, StateError, Tick, TokenId, Verdict,
};
use kestrel_step::StepError;

/// Records tokens; stops at one of `eos`.
struct Record {
    eos: Vec<TokenId>,
    out: Arc<Mutex<(Vec<TokenId>, Option<Outcome>)>>,
}

impl SequenceSkill for Record {
    fn consume(&mut self, t: &CommittedToken<'_>) -> Verdict {
        self.out.lock().unwrap().0.push(t.token);
        if self.eos.contains(&t.token) {
            Verdict::Stop(kestrel_pipeline::FinishReason::Eos)
        } else {
            Verdict::Continue
        }
    }
    fn finish(&mut self, outcome: Outcome) {
        self.out.lock().unwrap().1 = Some(outcome);
    }
}

struct Job {
    prompt: Vec<TokenId>,
    max_new: u32,
    params: SamplingParams,
    speculate: Option<NgramSpec>,
}

fn run(
    weights: &ModelWeights,
    jobs: &[Job],
    mode: PipelineMode,
    policy: PrefillPolicy,
    eos: &[TokenId],
) -> Vec<Vec<TokenId>> {
    run_in(weights, jobs, mode, policy, eos, (512, 16)).0
}

/// The runtime [`run`] uses: 2 threads, 16 rows, 7-row forwards, the
/// default numerics, in a KV cache of `(pages, page size)`.
fn runtime_config((num_pages, page_size): (usize, usize)) -> CpuRuntimeConfig {
    CpuRuntimeConfig {
        threads: 2,
        step: StepConfig {
            max_rows: 16,
            num_pages,
            page_size,
            max_seq_len: 1024,
            forward_rows: 7,
            ..StepConfig::default()
        },
        ..Default::default()
    }
}

/// [`run`] in a KV cache of `(pages, page size)`; also returns the loop's
/// counters (preemptions, drafts).
fn run_in(
    weights: &ModelWeights,
    jobs: &[Job],
    mode: PipelineMode,
    policy: PrefillPolicy,
    eos: &[TokenId],
    pages: (usize, usize),
) -> (Vec<Vec<TokenId>>, PipelineStats) {
    run_on(weights, jobs, mode, policy, eos, runtime_config(pages))
}

/// [`run`] on a runtime configured by `rt_config`.
fn run_on(
    weights: &ModelWeights,
    jobs: &[Job],
    mode: PipelineMode,
    policy: PrefillPolicy,
    eos: &[TokenId],
    rt_config: CpuRuntimeConfig,
) -> (Vec<Vec<TokenId>>, PipelineStats) {
    let rt = CpuRuntime::new(weights.clone(), rt_config).unwrap();
    let config = LoopConfig {
        mode,
        prefill_policy: policy,
        max_batch_size: 16,
        max_seq_len: 1024,
        debug_checks: true,
        ..Default::default()
    };
    let mut engine = EngineLoop::new(rt, config).unwrap();
    let outs: Vec<_> = jobs
        .iter()
        .enumerate()
        .map(|(i, j)| {
            let out = Arc::new(Mutex::new((Vec::new(), None)));
            let skill = Record {
                eos: eos.to_vec(),
                out: out.clone(),
            };
            engine
                .submit(Request {
                    embeds: None,
                    id: i as u64,
                    prompt: j.prompt.clone(),
                    max_new_tokens: j.max_new,
                    params: j.params.clone(),
                    speculate: j.speculate,
                    skill: Box::new(skill),
                })
                .unwrap();
            out
        })
        .collect();
    assert_eq!(engine.run_until_idle(), Tick::Idle);
    assert_eq!(
        engine.executor().num_allocated(),
        0,
        "KV rows left after idle"
    );
    assert_eq!(
        engine.executor().kv_stats().used_pages,
        0,
        "KV pages left after idle"
    );
    let outs = outs
        .iter()
        .map(|o| {
            let o = o.lock().unwrap();
            assert!(o.1.is_some(), "request not resolved");
            o.0.clone()
        })
        .collect();
    (outs, engine.stats())
}

/// A runtime for a few short sequences: 4 rows, 64 pages of 16, 256 tokens.
fn small_runtime(weights: ModelWeights, threads: usize) -> CpuRuntime {
    CpuRuntime::new(
        weights,
        CpuRuntimeConfig {
            threads,
            step: StepConfig {
                max_rows: 4,
                num_pages: 64,
                page_size: 16,
                max_seq_len: 256,
                ..StepConfig::default()
            },
            ..Default::default()
        },
    )
    .unwrap()
}

fn tiny_jobs() -> Vec<Job> {
    (0..6u64)
        .map(|i| Job {
            prompt: (0..(3 + 5 * i as u32))
                .map(|t| (t * 37 + i as u32) % 500 + 1)
                .collect(),
            max_new: 12 + i as u32 * 3,
            params: SamplingParams {
                temperature: if i % 2 == 0 { 0.0 } else { 0.8 },
                top_k: if i == 3 { 20 } else { 0 },
                top_p: if i == 5 { 0.9 } else { 1.0 },
                repetition_penalty: if i == 1 || i == 5 { 1.3 } else { 1.0 },
                frequency_penalty: if i == 4 { 1.5 } else { 0.0 },
                seed: 1000 + i,
                ..SamplingParams::default()
            },
            speculate: None,
        })
        .collect()
}

#[test]
fn modes_and_policies_agree_on_a_synthetic_model() {
    let w = synthetic_weights(&ModelConfig::tiny(), DType::Q8_0, 3);
    let jobs = tiny_jobs();
    let base = run(&w, &jobs, PipelineMode::Blocking, PrefillPolicy::Drain, &[]);
    for (m, p) in [
        (PipelineMode::Pipelined, PrefillPolicy::Drain),
        (PipelineMode::Pipelined, PrefillPolicy::RideAlong),
    ] {
        assert_eq!(
            run(&w, &jobs, m, p, &[]),
            base,
            "{m:?}/{p:?} differs from blocking"
        );
    }
    for (i, toks) in base.iter().enumerate() {
        assert_eq!(toks.len(), jobs[i].max_new as usize);
    }
}

/// Six jobs (greedy and sampled, three with penalties) in a cache
/// of 16 pages of 4 tokens, where each needs up to 14: sequences are
/// preempted as their KV grows, their written pages filed in the prefix
/// cache, and prefilled again with the tokens they generated. Every job's
/// tokens equal those it gets from a cache that never runs out, in every
/// mode (seeded sampling keys on position; the penalty counts the
/// replayed tokens).
#[test]
fn preempted_sequences_resume_with_the_same_tokens() {
    let w = synthetic_weights(&ModelConfig::tiny(), DType::Q8_0, 3);
    let jobs = tiny_jobs();
    let (roomy, stats) = run_in(
        &w,
        &jobs,
        PipelineMode::Blocking,
        PrefillPolicy::Drain,
        &[],
        (512, 4),
    );
    assert_eq!(stats.preemptions, 0);
    for (m, p) in [
        (PipelineMode::Blocking, PrefillPolicy::Drain),
        (PipelineMode::Pipelined, PrefillPolicy::Drain),
        (PipelineMode::Pipelined, PrefillPolicy::RideAlong),
    ] {
        let (tight, stats) = run_in(&w, &jobs, m, p, &[], (16, 4));
        let preemptions = stats.preemptions;
        assert!(preemptions > 0, "{m:?}/{p:?}: nothing was preempted");
        assert_eq!(tight, roomy, "{m:?}/{p:?}: {preemptions} preemptions");
    }
}

/// Speculation on the CPU runtime: the jobs (greedy, sampled, penalized),
/// with prompts that repeat so their last tokens have earlier matches, and
/// speculating with 4 drafts per step, emit exactly the tokens they emit
/// without speculation, in every mode, also with KV pressure; drafts are
/// proposed and some accepted (the verify forward and the sequential
/// acceptance are exercised, with the KV rolled back after rejections).
#[test]
fn speculation_emits_the_same_tokens_as_plain_decoding() {
    let w = synthetic_weights(&ModelConfig::tiny(), DType::Q8_0, 3);
    let plain = tiny_jobs();
    let reference = run(
        &w,
        &plain,
        PipelineMode::Blocking,
        PrefillPolicy::Drain,
        &[],
    );
    // Prompts that quote themselves; each job's own reference output too,
    // appended so its continuation has matches to draft from.
    let jobs: Vec<Job> = plain
        .into_iter()
        .zip(&reference)
        .map(|(j, out)| Job {
            prompt: [&j.prompt[..], out, &j.prompt[..], out].concat(),
            speculate: Some(NgramSpec {
                min_ngram: 1,
                ..NgramSpec::new(4)
            }),
            ..j
        })
        .collect();
    let no_spec: Vec<Job> = jobs
        .iter()
        .map(|j| Job {
            prompt: j.prompt.clone(),
            speculate: None,
            params: j.params.clone(),
            ..*j
        })
        .collect();
    let (want, _) = run_in(
        &w,
        &no_spec,
        PipelineMode::Blocking,
        PrefillPolicy::Drain,
        &[],
        (512, 16),
    );
    for (m, p) in [
        (PipelineMode::Blocking, PrefillPolicy::Drain),
        (PipelineMode::Pipelined, PrefillPolicy::Drain),
        (PipelineMode::Pipelined, PrefillPolicy::RideAlong),
    ] {
        for pages in [(512, 16), (40, 4)] {
            let (got, stats) = run_in(&w, &jobs, m, p, &[], pages);
            assert!(
                stats.accepted_drafts > 0 && stats.accepted_drafts < stats.draft_tokens,
                "{m:?}/{p:?}: {} of {} drafts accepted",
                stats.accepted_drafts,
                stats.draft_tokens
            );
            assert_eq!(got, want, "{m:?}/{p:?} in {pages:?}: {stats:?}");
        }
    }
}

/// In the default numerics (fast: int8 activations for the Q4_1 weights)
/// a request's tokens are the same alone, batched with others, and on 1
/// compute thread instead of 2.
#[test]
fn batch_and_thread_invariance_in_the_default_numerics() {
    assert_eq!(CpuRuntimeConfig::default().numerics, Numerics::Fast);
    let w = synthetic_weights(&ModelConfig::tiny(), DType::Q4_1, 9);
    let jobs = tiny_jobs();
    let (pm, rp) = (PipelineMode::Pipelined, PrefillPolicy::RideAlong);
    let batched = run(&w, &jobs, pm, rp, &[]);
    let one_thread = CpuRuntimeConfig {
        threads: 1,
        ..runtime_config((512, 16))
    };
    let (batched_1t, _) = run_on(&w, &jobs, pm, rp, &[], one_thread);
    assert_eq!(batched_1t, batched, "tokens depend on the thread count");
    for (i, job) in jobs.into_iter().enumerate() {
        let alone = run(&w, std::slice::from_ref(&job), pm, rp, &[]);
        assert_eq!(alone[0], batched[i], "request {i} depends on its batch");
    }
}

#[test]
fn prefix_cache_hit_gives_same_tokens() {
    let w = synthetic_weights(&ModelConfig::tiny(), DType::F32, 5);
    let prompt: Vec<TokenId> = (0..70).map(|t| t % 400 + 2).collect();
    let job = || Job {
        prompt: prompt.clone(),
        max_new: 10,
        params: SamplingParams::greedy(),
        speculate: None,
    };
    let rt = small_runtime(w.clone(), 1);
    let mut engine = EngineLoop::new(
        rt,
        LoopConfig {
            max_seq_len: 256,
            ..Default::default()
        },
    )
    .unwrap();
    let mut outs = Vec::new();
    for id in 0..2 {
        let out = Arc::new(Mutex::new((Vec::new(), None)));
        let j = job();
        engine
            .submit(Request {
                embeds: None,
                id,
                prompt: j.prompt,
                max_new_tokens: j.max_new,
                params: j.params,
                speculate: None,
                skill: Box::new(Record {
                    eos: vec![],
                    out: out.clone(),
                }),
            })
            .unwrap();
        engine.run_until_idle();
        outs.push(out.lock().unwrap().0.clone());
    }
    let stats = engine.executor().kv_stats();
    assert_eq!(
        stats.prefix_hit_tokens, 64,
        "the second request should reuse 4 full pages"
    );
    assert_eq!(outs[0], outs[1]);
}

#[derive(serde::Deserialize)]
struct Golden {
    prompts: Vec<GoldenPrompt>,
}

#[derive(serde::Deserialize)]
struct GoldenPrompt {
    name: String,
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
}

/// The whole stack (pipeline + runtime + forward + sampler) in exact
/// numerics, all prompts batched together in pipelined mode, reproduces the
/// f32 reference's 32 greedy tokens.
#[test]
fn real_model_matches_reference_greedy_tokens() {
    let path =
        kestrel_model::fetch::default_model_path().expect("default model (fetched with pip)");
    let model = kestrel_model::load(&path).unwrap();
    let golden: Golden = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/golden/smollm2-135m-q4_1.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let jobs: Vec<Job> = golden
        .prompts
        .iter()
        .map(|p| Job {
            prompt: p.prompt_ids.clone(),
            max_new: p.greedy_ids.len() as u32,
            params: SamplingParams::greedy(),
            speculate: None,
        })
        .collect();
    let exact = CpuRuntimeConfig {
        numerics: Numerics::Exact,
        ..runtime_config((512, 16))
    };
    let (outs, _) = run_on(
        &model.weights,
        &jobs,
        PipelineMode::Pipelined,
        PrefillPolicy::RideAlong,
        &[],
        exact,
    );
    for (p, out) in golden.prompts.iter().zip(&outs) {
        assert_eq!(out, &p.greedy_ids, "prompt {}", p.name);
    }
}

/// An observer that watches nothing: `Observed` must still hand the
/// runtime's own step timings through.
struct NoObserver;
impl kestrel_pipeline::WaitObserver for NoObserver {}

#[test]
fn step_timings_cover_every_step_in_order_through_a_wrapper() {
    let w = synthetic_weights(&ModelConfig::tiny(), DType::Q8_0, 4);
    let rt = small_runtime(w, 2);
    let observed = Observed {
        inner: rt,
        observer: NoObserver,
    };
    let config = LoopConfig {
        mode: PipelineMode::Pipelined,
        max_batch_size: 4,
        max_seq_len: 256,
        ..Default::default()
    };
    let mut engine = EngineLoop::new(observed, config).unwrap();
    // One request to completion, then whatever timings it left.
    let serve =
        |engine: &mut EngineLoop<Observed<CpuRuntime, NoObserver>>, id: u64, t: &mut Vec<_>| {
            let out = Arc::new(Mutex::new((Vec::new(), None)));
            engine
                .submit(Request {
                    embeds: None,
                    id,
                    prompt: (1..20).collect(),
                    max_new_tokens: 6,
                    params: SamplingParams::greedy(),
                    speculate: None,
                    skill: Box::new(Record { eos: vec![], out }),
                })
                .unwrap();
            assert_eq!(engine.run_until_idle(), Tick::Idle);
            engine.executor_mut().drain_timings(t);
        };
    let mut t = Vec::new();
    serve(&mut engine, 0, &mut t);
    assert!(t.is_empty(), "nothing recorded before recording starts");

    engine.executor_mut().record_timings(true).unwrap();
    serve(&mut engine, 1, &mut t);
    // One prefill (it samples the first token), then one decode step per
    // further token.
    assert_eq!(t.len(), 6, "{t:?}");
    assert!(t[0].prefill && t[1..].iter().all(|s| !s.prefill && s.rows == 1));
    for s in &t {
        assert!(s.forward_start <= s.forward_end, "{s:?}");
        assert!(s.forward_end <= s.sample_start, "{s:?}");
        assert!(s.sample_start <= s.sample_end, "{s:?}");
    }
    for p in t.windows(2) {
        assert!(p[0].step < p[1].step, "{p:?} out of launch order");
        assert!(
            p[0].sample_end <= p[1].forward_start,
            "{p:?} overlap on one stream"
        );
    }
    t.clear();
    engine.executor_mut().drain_timings(&mut t);
    assert!(t.is_empty(), "drained steps are gone");

    engine.executor_mut().record_timings(false).unwrap();
    serve(&mut engine, 2, &mut t);
    assert!(t.is_empty(), "nothing recorded after recording stops");
}

/// The slot-protocol error inside a runtime error, if that is what it is.
fn ledger(e: &RuntimeError) -> Option<StateError> {
    match e {
        RuntimeError::Slot(l) => Some(l.clone()),
        _ => None,
    }
}

#[test]
fn slot_protocol_violations_are_typed_and_leave_the_step_intact() {
    let w = synthetic_weights(&ModelConfig::tiny(), DType::Q8_0, 3);
    let mut rt = small_runtime(w, 1);
    let prompt: Vec<TokenId> = (1..6).collect();
    let params = SamplingParams::default();
    let input = PrefillInput {
        id: 7,
        prompt: &prompt,
        generated: 0,
        generated_values: &[],
        params: &params,
        max_len: 16,
        start: PrefillStart::Admit,
        max_tokens: usize::MAX,
        embeds: None,
    };
    rt.launch_prefill(0, &[input]).unwrap();
    // Waiting before sampling used to block forever on this runtime.
    let e = rt.wait_step(0).unwrap_err();
    assert_eq!(ledger(&e), Some(StateError::NotSampled(0)));
    let Err(ExecError::PreDispatch(e)) = rt.launch_decode(1, &[7], Drafts::NONE) else {
        panic!("a launch while a forward awaits sampling must be refused before dispatch");
    };
    assert_eq!(ledger(&e), Some(StateError::LaunchInFlight(0)));
    let Err(ExecError::Fatal(e)) = rt.finalize_sampling(1, None) else {
        panic!("sampling the wrong slot must be refused");
    };
    assert_eq!(
        ledger(&e),
        Some(StateError::SlotMismatch {
            expected: 0,
            got: 1
        })
    );
    rt.finalize_sampling(0, None).unwrap();
    let e = rt.wait_step(1).unwrap_err();
    assert_eq!(
        ledger(&e),
        Some(StateError::OutOfOrder {
            slot: 1,
            expected: Some(0)
        })
    );
    // The refused calls booked nothing: the step completes as usual.
    assert_eq!(rt.wait_step(0).unwrap().tokens.len(), 1);
    // Drafts that do not add up to the rows are refused before dispatch.
    let bad = Drafts {
        indptr: &[0, 3],
        tokens: &[1, 2],
    };
    let Err(ExecError::PreDispatch(e)) = rt.launch_decode(1, &[7], bad) else {
        panic!("malformed drafts must be refused before dispatch");
    };
    assert!(matches!(
        e,
        RuntimeError::Step(StepError::Drafts(DraftsError {
            rows: 1,
            offsets: 2,
            tokens: 2,
            ..
        }))
    ));
    // KV is taken lazily: the decode's token needs its page first.
    assert!(rt.grow(7, prompt.len() + 1));
    rt.launch_decode(1, &[7], Drafts::NONE).unwrap();
    rt.finalize_sampling(1, None).unwrap();
    assert_eq!(rt.wait_step(1).unwrap().tokens.len(), 1);
    rt.release(7);
    assert_eq!(rt.num_allocated(), 0);
}

/// A forward that fails on the compute stream comes back at that step's
/// wait as `RuntimeError::Fault` with the compute layer's own error as its
/// typed source (not its message), printed once in the chain; the
/// request's KV is released as usual.
#[test]
fn a_compute_fault_keeps_its_typed_cause() {
    let c = ModelConfig::tiny();
    let mut rt = small_runtime(synthetic_weights(&c, DType::Q8_0, 3), 1);
    let vocab = c.vocab_size as TokenId;
    let prompt: Vec<TokenId> = vec![1, 2, vocab + 5];
    let params = SamplingParams::default();
    let input = PrefillInput {
        id: 9,
        prompt: &prompt,
        generated: 0,
        generated_values: &[],
        params: &params,
        max_len: 16,
        start: PrefillStart::Admit,
        max_tokens: usize::MAX,
        embeds: None,
    };
    rt.launch_prefill(0, &[input]).unwrap();
    rt.finalize_sampling(0, None).unwrap();
    let e = rt.wait_step(0).unwrap_err();
    let RuntimeError::Fault { source, .. } = &e else {
        panic!("expected a compute fault, got {e:?}");
    };
    assert!(
        matches!(source, kestrel_cpu::CpuError::TokenOutOfRange { token, .. } if *token == vocab + 5),
        "{source:?}"
    );
    let chained = std::error::Error::source(&e).map(ToString::to_string);
    assert_eq!(chained, Some(source.to_string()));
    assert!(!e.to_string().contains(&source.to_string()), "{e}");
    rt.release(9);
    assert_eq!(rt.num_allocated(), 0);
}

/// A prompt prefilled in chunks at the runtime's level: a chunk short of
/// the prompt's end returns no row; a chunk that does not resume where the
/// last one ended is refused before dispatch with a typed error naming it;
/// and the first token and the decode after it equal a whole-prompt
/// prefill's.
#[test]
fn prefill_chunks_resume_in_order_and_match_a_whole_prefill() {
    let w = synthetic_weights(&ModelConfig::tiny(), DType::Q8_0, 3);
    let prompt: Vec<TokenId> = (1..40).collect();
    let params = SamplingParams::default();
    let input = |id, start, max_tokens| PrefillInput {
        id,
        prompt: &prompt,
        generated: 0,
        generated_values: &[],
        params: &params,
        max_len: 64,
        start,
        max_tokens,
        embeds: None,
    };
    let first_two = |rt: &mut CpuRuntime, id| -> Vec<TokenId> {
        let mut out = vec![rt.wait_step(0).unwrap().tokens[0]];
        assert!(rt.grow(id, prompt.len() + 1));
        rt.launch_decode(1, &[id], Drafts::NONE).unwrap();
        rt.finalize_sampling(1, None).unwrap();
        out.push(rt.wait_step(1).unwrap().tokens[0]);
        out
    };
    let mut whole = small_runtime(w.clone(), 1);
    whole
        .launch_prefill(0, &[input(1, PrefillStart::Admit, usize::MAX)])
        .unwrap();
    whole.finalize_sampling(0, None).unwrap();
    let want = first_two(&mut whole, 1);

    let mut rt = small_runtime(w, 1);
    rt.launch_prefill(0, &[input(2, PrefillStart::Admit, 16)])
        .unwrap();
    rt.finalize_sampling(0, None).unwrap();
    assert!(
        rt.wait_step(0).unwrap().tokens.is_empty(),
        "a partial chunk samples nothing"
    );
    let Err(ExecError::PreDispatch(e)) =
        rt.launch_prefill(1, &[input(2, PrefillStart::Resume(20), 16)])
    else {
        panic!("a chunk that skips tokens must be refused");
    };
    assert!(
        matches!(
            e,
            RuntimeError::Step(StepError::ChunkOutOfOrder {
                id: 2,
                start: 20,
                written: 16
            })
        ),
        "{e}"
    );
    for (slot, start) in [(1, 16), (0, 32)] {
        rt.launch_prefill(slot, &[input(2, PrefillStart::Resume(start), 16)])
            .unwrap();
        rt.finalize_sampling(slot, None).unwrap();
        if start == 16 {
            assert!(rt.wait_step(slot).unwrap().tokens.is_empty());
        }
    }
    // The last chunk (32..39) ran in slot 0: its token, then a decode.
    assert_eq!(first_two(&mut rt, 2), want);
    rt.release(2);
    assert_eq!(rt.num_allocated(), 0);
}
