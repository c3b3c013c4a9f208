//! `n > 1` on the real default model: the samples of one request are
//! sequences of their own (seed + index, their own stop checks) forked from
//! the first once its prompt is prefilled, sharing its full prompt pages by
//! reference count, on the CPU runtime and on the CUDA runtime's host device
//! (`Backend::CudaHost`). Each seeded sample emits what a request of its own
//! with its seed emits; with the prefix cache off the samples still share
//! the prompt's pages (fewer pages in use than the same requests apart);
//! cancelling samples part-way (one stream dropped, or all by request id)
//! gives every page back; preempted samples come back with their own
//! tokens; each sample holds its own constraint state; `n` out of range is
//! an INVALID_ARGUMENT naming it.

mod common;

use common::{kv_released, rt, start_default, until_done};

use std::time::Duration;

use kestrel_engine::{
    Backend, Constraint, Engine, EngineConfig, EngineError, Field, FinishReason, GenerateRequest,
    GenerateResponse, GenerationStream, SamplingOptions, StreamEvent,
};

const PAGE: usize = 16;

fn engine(backend: Backend, prefix_cache: bool) -> Engine {
    start_default(EngineConfig {
        backend,
        threads: 2,
        max_batch_size: 8,
        kv_pages: 256,
        page_size: PAGE,
        enable_prefix_cache: prefix_cache,
        max_seq_len: Some(1024),
        ..EngineConfig::default()
    })
}

/// A prompt of some 200 tokens: a dozen full pages to share.
fn long_prompt() -> String {
    "The quick brown fox jumps over the lazy dog near the quiet river bank. ".repeat(14)
}

/// `n` samples of `prompt`, sampled at temperature 0.9 with `seed`.
fn sampled(prompt: &str, n: u32, seed: u64, max_new: u32) -> GenerateRequest {
    GenerateRequest {
        sampling: SamplingOptions {
            temperature: Some(0.9),
            seed: Some(seed),
            ..SamplingOptions::default()
        },
        ignore_eos: true,
        n: Some(n),
        ..GenerateRequest::text(prompt, max_new)
    }
}

/// Runs every stream to its end, checking each one's deltas add up to its
/// response and that it names its stream's sample; the responses in order.
async fn finish_all(streams: Vec<GenerationStream>) -> Vec<GenerateResponse> {
    let runs: Vec<_> = streams
        .into_iter()
        .map(|mut s| {
            tokio::spawn(async move {
                let (resp, text, ids) = until_done(&mut s).await;
                assert_eq!((resp.text.as_str(), &resp.token_ids), (text.as_str(), &ids));
                assert_eq!(resp.index, s.index());
                resp
            })
        })
        .collect();
    let mut out = Vec::new();
    for run in runs {
        out.push(run.await.expect("the stream ran"));
    }
    out
}

/// The most KV pages in use while `streams` run to their end (the engine's
/// gauge, polled), and their responses.
async fn peak_pages(
    engine: &Engine,
    streams: Vec<GenerationStream>,
) -> (usize, Vec<GenerateResponse>) {
    let run = tokio::spawn(finish_all(streams));
    let mut peak = 0;
    while !run.is_finished() {
        peak = peak.max(engine.model_info().kv_pages_used);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    (peak, run.await.expect("the streams ran"))
}

/// Seeded samples equal requests of their own with seeds `seed + i`, run
/// one at a time after them (so each hits the prompt pages the samples
/// published, as a fork shares them). Every page comes back.
fn samples_equal_requests_of_their_own(backend: Backend, prompt: &str, max_new: u32) {
    let engine = engine(backend, true);
    rt().block_on(async {
        let streams = engine
            .stream_samples(sampled(prompt, 3, 42, max_new))
            .unwrap();
        let samples = finish_all(streams).await;
        let ids: Vec<_> = samples.iter().map(|r| r.token_ids.clone()).collect();
        assert!(ids.iter().all(|t| t.len() == max_new as usize));
        assert!(samples
            .iter()
            .enumerate()
            .all(|(i, r)| r.index as usize == i));
        assert!(
            ids[0] != ids[1] || ids[1] != ids[2],
            "seeds differ per sample"
        );
        assert!(samples
            .iter()
            .all(|r| r.request_id == samples[0].request_id));
        for (i, sample) in samples.iter().enumerate() {
            let alone = engine
                .generate(sampled(prompt, 1, 42 + i as u64, max_new))
                .await
                .unwrap();
            assert_eq!(alone.token_ids, sample.token_ids, "sample {i}");
            assert_eq!(alone.index, 0);
        }
        kv_released(&engine).await;
        engine.shutdown(Duration::from_secs(1)).await;
    });
}

#[test]
fn seeded_samples_equal_requests_of_their_own_on_the_cpu_runtime() {
    samples_equal_requests_of_their_own(Backend::Cpu, &long_prompt(), 24);
}

#[test]
fn seeded_samples_equal_requests_of_their_own_on_the_cuda_runtime() {
    // The host device runs the CUDA kernels' reference code: a shorter
    // prompt (two full pages) and output keep it quick. (It also keeps the
    // whole prompt's prefill on the same matmul path as the forks' last
    // tokens, below `kestrel_cuda::quant::MMVQ_CROSSOVER_ROWS`: past it the
    // first sample's prefill is computed in f16 and its tokens may differ
    // from a request whose prompt pages are a prefix-cache hit.)
    let prompt = "The quick brown fox jumps over the lazy dog near the river. ".repeat(3);
    samples_equal_requests_of_their_own(Backend::CudaHost, &prompt, 8);
}

/// With the prefix cache off, three greedy samples (all the same, as
/// OpenAI and vLLM give them) hold fewer pages than three requests apart:
/// the two forks share the first sample's full prompt pages.
#[test]
fn samples_share_prompt_pages_with_the_prefix_cache_off() {
    let engine = engine(Backend::Cpu, false);
    let greedy = |n| GenerateRequest {
        ignore_eos: true,
        n: Some(n),
        ..GenerateRequest::text(long_prompt(), 40)
    };
    rt().block_on(async {
        let forked = engine.stream_samples(greedy(3)).unwrap();
        let (forked_peak, samples) = peak_pages(&engine, forked).await;
        kv_released(&engine).await;
        let apart = (0..3).map(|_| engine.stream(greedy(1)).unwrap()).collect();
        let (apart_peak, alone) = peak_pages(&engine, apart).await;
        kv_released(&engine).await;
        for r in samples.iter().chain(&alone) {
            assert_eq!(
                r.token_ids, samples[0].token_ids,
                "greedy samples are the same"
            );
        }
        eprintln!("KV pages in use at most: {forked_peak} as samples, {apart_peak} apart");
        let prompt = samples[0].usage.prompt_tokens as usize;
        let shared = (prompt - 1) / PAGE;
        assert!(shared >= 10, "a {prompt}-token prompt");
        assert!(
            forked_peak + 2 * shared <= apart_peak,
            "samples use {forked_peak} pages at most, requests apart {apart_peak}"
        );
        engine.shutdown(Duration::from_secs(1)).await;
    });
}

/// Cancelled part-way, with the prefix cache off: the first sample's stream
/// dropped while its forks run on, then every sample aborted by request id.
/// Each ends as it should and every page comes back.
#[test]
fn cancelled_samples_free_every_page() {
    let engine = engine(Backend::Cpu, false);
    rt().block_on(async {
        let mut req = sampled(&long_prompt(), 3, 7, 48);
        req.request_id = Some("cancel-me".into());
        let mut streams = engine.stream_samples(req.clone()).unwrap();
        // Every sample has started; the parent goes away.
        for s in &mut streams {
            assert!(matches!(
                s.next_event().await,
                Some(Ok(StreamEvent::Delta { .. }))
            ));
        }
        drop(streams.remove(0));
        for mut s in streams {
            let r = s.finish().await.unwrap();
            assert_eq!(
                (r.finish_reason, r.token_ids.len()),
                (FinishReason::Length, 48)
            );
        }
        kv_released(&engine).await;

        let streams = engine.stream_samples(req).unwrap();
        let mut first = streams.into_iter();
        let mut s0 = first.next().unwrap();
        assert!(matches!(
            s0.next_event().await,
            Some(Ok(StreamEvent::Delta { .. }))
        ));
        assert!(engine.abort("cancel-me"));
        for mut s in std::iter::once(s0).chain(first) {
            let (r, _, _) = until_done(&mut s).await;
            assert_eq!(r.finish_reason, FinishReason::Abort, "sample {}", r.index);
        }
        kv_released(&engine).await;
        engine.shutdown(Duration::from_secs(1)).await;
    });
}

/// `n` is 1 to 16 (unset: 1); `Engine::stream` gives one sample only.
#[test]
fn n_out_of_range_is_an_invalid_argument_naming_it() {
    let engine = engine(Backend::Cpu, true);
    let with_n = |n| GenerateRequest {
        n: Some(n),
        ..GenerateRequest::text("Hi", 2)
    };
    for n in [0, 17] {
        match engine.stream_samples(with_n(n)) {
            Err(e @ EngineError::InvalidArgument { .. }) => {
                assert_eq!(e.field(), Some(Field::N));
                assert!(e.to_string().contains("[1, 16]"), "{e}");
            }
            other => panic!("n = {n}: {other:?}"),
        }
    }
    match engine.stream(with_n(2)) {
        Err(e) => assert_eq!(e.field(), Some(Field::N)),
        Ok(_) => panic!("Engine::stream took n = 2"),
    }
    rt().block_on(async {
        assert_eq!(engine.generate_samples(with_n(16)).await.unwrap().len(), 16);
        assert_eq!(engine.generate(with_n(1)).await.unwrap().index, 0);
        kv_released(&engine).await;
        engine.shutdown(Duration::from_secs(1)).await;
    });
}

/// Under KV pressure, samples are preempted and prefilled again like any
/// sequence (with their own tokens, not their parent's pages): four seeded
/// samples in a cache too small for them all at once each emit what they
/// emit in a roomy cache, and every page comes back.
#[test]
fn preempted_samples_emit_what_they_emit_in_a_roomy_cache() {
    let prompt = "Kestrels hover over fields and dive on voles at dusk. ".repeat(5);
    let req = sampled(&prompt, 4, 5, 64);
    let run = |kv_pages| {
        let engine = start_default(EngineConfig {
            threads: 2,
            max_batch_size: 8,
            kv_pages,
            page_size: PAGE,
            max_seq_len: Some(1024),
            ..EngineConfig::default()
        });
        rt().block_on(async {
            let samples = finish_all(engine.stream_samples(req.clone()).unwrap()).await;
            kv_released(&engine).await;
            let preemptions = common::counter(&engine, "kestrel_preemptions_total");
            engine.shutdown(Duration::from_secs(1)).await;
            (samples, preemptions)
        })
    };
    let (roomy, none) = run(512);
    let (tight, preemptions) = run(16);
    assert_eq!(none, 0);
    assert!(preemptions > 0, "16 pages hold all four samples");
    for (a, b) in roomy.iter().zip(&tight) {
        assert_eq!((a.index, &a.token_ids), (b.index, &b.token_ids));
        assert_eq!(b.token_ids.len(), 64);
    }
}

/// Each sample holds its own constraint state: every one of six sampled
/// answers to a choice constraint is one of the choices, whichever it took.
#[test]
fn each_sample_holds_its_own_constraint() {
    let engine = engine(Backend::Cpu, true);
    let choices: Vec<String> = ["red", "green", "blue", "yellow"]
        .map(String::from)
        .to_vec();
    let req = GenerateRequest {
        constraint: Some(Constraint::Choice(choices.clone())),
        sampling: SamplingOptions {
            temperature: Some(1.5),
            seed: Some(3),
            ..SamplingOptions::default()
        },
        n: Some(6),
        ..GenerateRequest::text("My favourite colour is", 8)
    };
    rt().block_on(async {
        let samples = engine.generate_samples(req).await.unwrap();
        assert_eq!(samples.len(), 6);
        for r in &samples {
            assert!(
                choices.contains(&r.text),
                "sample {}: {:?}",
                r.index,
                r.text
            );
            assert_eq!(r.finish_reason, FinishReason::Stop);
        }
        kv_released(&engine).await;
        engine.shutdown(Duration::from_secs(1)).await;
    });
}
