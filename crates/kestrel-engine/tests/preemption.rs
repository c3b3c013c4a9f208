//! Preemption under KV pressure on the real default model: eight streams
//! that need some 32 pages at once run in a cache of 10, so the youngest
//! running sequence is preempted whenever pages run out and prefilled again
//! later with the tokens it generated. Every request completes (none fails
//! for lack of KV: each fits alone) with exactly the tokens, text and
//! log-probabilities it gets from a cache that never runs out; its streamed
//! deltas add up to its final text (no token repeated or lost across a
//! preemption); `/metrics` counts the preemptions; and once idle no page
//! is held. Aborting requests while others are preempted frees everything.
//! The CUDA runtime on its host device (`Backend::CudaHost`) preempts and
//! re-admits the same way, with the same tokens as its roomy run.

mod common;

use common::{counter, rt, start_default, stream_all, until_done};

use std::time::Duration;

use kestrel_engine::{
    Backend, Constraint, Engine, EngineConfig, FinishReason, GenerateRequest, GenerateResponse,
    PipelineMode, PrefillPolicy, SamplingOptions, StreamEvent,
};

const ROOMY: usize = 512;
const TIGHT: usize = 10;

fn engine(mode: PipelineMode, policy: PrefillPolicy, chunk: usize, kv_pages: usize) -> Engine {
    engine_on(Backend::Cpu, mode, policy, chunk, kv_pages)
}

fn engine_on(
    backend: Backend,
    mode: PipelineMode,
    policy: PrefillPolicy,
    chunk: usize,
    kv_pages: usize,
) -> Engine {
    start_default(EngineConfig {
        backend,
        threads: 2,
        mode,
        prefill_policy: policy,
        prefill_chunk: Some(chunk),
        max_batch_size: 8,
        kv_pages,
        page_size: 16,
        max_seq_len: Some(1024),
        ..EngineConfig::default()
    })
}

/// Eight requests of about 60 tokens each (4 pages of 16): greedy, seeded
/// sampling with penalties, log-probabilities and a constraint.
fn batch() -> Vec<GenerateRequest> {
    let prompts = [
        "The history of the lighthouse begins",
        "Write a short letter to a friend about",
        "In the garden behind the house there",
        "A recipe for bread: first",
        "The train left the station at dawn and",
        "Ten facts about the moon:",
        "Dear diary, today I",
        "The committee met again to decide",
    ];
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = GenerateRequest::text(*p, 48);
            r.ignore_eos = true;
            r.request_id = Some(format!("pressure-{i}"));
            r.sampling = match i % 4 {
                0 => SamplingOptions::default(),
                1 => SamplingOptions {
                    temperature: Some(0.9),
                    top_p: Some(0.95),
                    seed: Some(i as u64),
                    repetition_penalty: Some(1.2),
                    frequency_penalty: Some(0.7),
                    presence_penalty: Some(0.4),
                    ..SamplingOptions::default()
                },
                2 => SamplingOptions {
                    temperature: Some(0.7),
                    seed: Some(100 + i as u64),
                    logprobs: true,
                    top_logprobs: 2,
                    ..SamplingOptions::default()
                },
                _ => SamplingOptions {
                    repetition_penalty: Some(1.3),
                    ..SamplingOptions::default()
                },
            };
            if i == 6 {
                // A constraint ends on its own (no ignore_eos with it).
                r.ignore_eos = false;
                r.constraint = Some(Constraint::Regex("[a-z]+( [a-z]+){30,40}".into()));
            }
            r
        })
        .collect()
}

fn run(engine: &Engine, reqs: &[GenerateRequest]) -> Vec<GenerateResponse> {
    rt().block_on(stream_all(engine, reqs))
}

fn preemptions(engine: &Engine) -> u64 {
    counter(engine, "kestrel_preemptions_total")
}

fn wait_idle(engine: &Engine) {
    for _ in 0..200 {
        let info = engine.model_info();
        if info.num_admitted == 0 && info.num_waiting == 0 && info.kv_pages_used == 0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!(
        "KV still held after every request ended: {:?}",
        engine.model_info()
    );
}

#[test]
fn a_small_cache_preempts_and_completes_every_request_identically() {
    let reqs = batch();
    let reference = {
        let e = engine(PipelineMode::Pipelined, PrefillPolicy::RideAlong, 0, ROOMY);
        let out = run(&e, &reqs);
        assert_eq!(preemptions(&e), 0);
        rt().block_on(e.shutdown(Duration::from_secs(1)));
        out
    };
    for (req, r) in reqs.iter().zip(&reference) {
        if req.ignore_eos {
            assert_eq!(r.finish_reason, FinishReason::Length, "{}", r.request_id);
        }
    }
    for (mode, policy, chunk) in [
        (PipelineMode::Pipelined, PrefillPolicy::RideAlong, 0),
        (PipelineMode::Pipelined, PrefillPolicy::RideAlong, 8),
        (PipelineMode::Blocking, PrefillPolicy::Drain, 0),
    ] {
        let e = engine(mode, policy, chunk, TIGHT);
        let out = run(&e, &reqs);
        let n = preemptions(&e);
        assert!(
            n > 0,
            "{mode:?}/{policy:?}/chunk {chunk}: nothing preempted"
        );
        for (want, got) in reference.iter().zip(&out) {
            let at = format!(
                "{mode:?}/{policy:?}/chunk {chunk}, {n} preemptions: {}",
                got.request_id
            );
            assert_eq!(want.token_ids, got.token_ids, "{at}");
            assert_eq!(want.text, got.text, "{at}");
            assert_eq!(want.logprobs, got.logprobs, "{at}");
            assert_eq!(want.finish_reason, got.finish_reason, "{at}");
        }
        wait_idle(&e);
        rt().block_on(e.shutdown(Duration::from_secs(1)));
    }
}

#[test]
fn aborts_under_pressure_free_every_page() {
    let e = engine(PipelineMode::Pipelined, PrefillPolicy::RideAlong, 8, TIGHT);
    let reqs = batch();
    rt().block_on(async {
        let mut streams: Vec<_> = reqs
            .iter()
            .map(|r| e.stream(r.clone()).expect("accepted"))
            .collect();
        // Let every stream start, then abort every other one: some of them
        // are preempted (holding no KV), some running, some in flight.
        for s in &mut streams {
            let first = tokio::time::timeout(Duration::from_secs(120), s.next_event())
                .await
                .expect("no hang");
            assert!(matches!(first, Some(Ok(StreamEvent::Delta { .. }))));
        }
        for s in streams.iter_mut().step_by(2) {
            s.abort();
        }
        for (i, s) in streams.iter_mut().enumerate() {
            let (end, _, _) = until_done(s).await;
            if i % 2 == 1 && reqs[i].ignore_eos {
                assert_eq!(end.finish_reason, FinishReason::Length);
                assert_eq!(end.token_ids.len(), 48);
            }
        }
    });
    assert!(preemptions(&e) > 0);
    wait_idle(&e);
    rt().block_on(e.shutdown(Duration::from_secs(1)));
}

/// The CUDA runtime's re-admission path through the engine, on its host
/// device: KV grows lazily, a preempted sequence files its written pages
/// and is prefilled again (in chunks, the prefix cache serving its first
/// pages) with the tokens it generated counted for its penalties; every
/// request gets exactly the tokens, text and log-probabilities of a roomy
/// cache, and no page is left. 24 tokens a request (the host device is
/// slow), chunks of 8 in both runs: every forward then takes the same
/// matmul path per row (`mmvq_*`), so a position computes alike in any
/// step, as on the CPU.
#[test]
fn the_cuda_runtime_on_its_host_device_preempts_and_completes_every_request() {
    let reqs: Vec<GenerateRequest> = batch()
        .into_iter()
        .map(|mut r| {
            r.max_new_tokens = Some(24);
            if let Some(Constraint::Regex(re)) = &mut r.constraint {
                // Short enough to end within 24 tokens.
                *re = "[a-z]+( [a-z]+){8,12}".into();
            }
            r
        })
        .collect();
    let cuda_host = |pages| {
        engine_on(
            Backend::CudaHost,
            PipelineMode::Pipelined,
            PrefillPolicy::RideAlong,
            8,
            pages,
        )
    };
    let reference = {
        let e = cuda_host(ROOMY);
        let out = run(&e, &reqs);
        assert_eq!(preemptions(&e), 0);
        rt().block_on(e.shutdown(Duration::from_secs(1)));
        out
    };
    let e = cuda_host(TIGHT);
    let out = run(&e, &reqs);
    let n = preemptions(&e);
    assert!(n > 0, "nothing preempted");
    for (want, got) in reference.iter().zip(&out) {
        let at = format!("{n} preemptions: {}", got.request_id);
        assert_eq!(want.token_ids, got.token_ids, "{at}");
        assert_eq!(want.text, got.text, "{at}");
        assert_eq!(want.logprobs, got.logprobs, "{at}");
        assert_eq!(want.finish_reason, got.finish_reason, "{at}");
    }
    wait_idle(&e);
    rt().block_on(e.shutdown(Duration::from_secs(1)));
}
