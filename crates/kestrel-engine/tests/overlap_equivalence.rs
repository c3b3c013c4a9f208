//! Overlap equivalence on the real default model: the bugs that hit async
//! (overlapped) schedulers elsewhere (penalties ignored under overlap, a
//! token past `max_new_tokens` or past a stop, garbled structured output, a
//! reused request id colliding with a finished one) would show here as a
//! difference between blocking and pipelined decoding.
//!
//! The same mixed batch runs, all at once, on every mode x prefill policy,
//! with whole-prompt and chunked prefill (a chunk of 3 tokens, so every
//! prompt, and a long one most of all, is prefilled in many steps that take
//! turns with the others' decode steps), and in a KV cache of 26 pages where
//! the batch needs over 50 at once (sequences are preempted as they grow and
//! prefilled again with the tokens they generated), and on 1 compute thread
//! instead of 2; every request's tokens, text, finish reason and
//! log-probabilities must be identical across the engines, and equal to
//! those of the request run alone. All in the engine's default numerics
//! (fast: int8 activations), whose kernels promise batch and thread
//! invariance as exact's do.

mod common;

use common::{counter, kv_released, rt, start_default, stream_all};

use std::time::Duration;

use kestrel_engine::{
    Backend, Constraint, Engine, EngineConfig, FinishReason, GenerateRequest, GenerateResponse,
    PipelineMode, PrefillPolicy, SamplingOptions,
};

fn engine(
    mode: PipelineMode,
    prefill_policy: PrefillPolicy,
    prefill_chunk: usize,
    kv_pages: usize,
) -> Engine {
    engine_on(2, mode, prefill_policy, prefill_chunk, kv_pages)
}

/// [`engine`] on `threads` compute threads.
fn engine_on(
    threads: usize,
    mode: PipelineMode,
    prefill_policy: PrefillPolicy,
    prefill_chunk: usize,
    kv_pages: usize,
) -> Engine {
    start_default(EngineConfig {
        threads,
        mode,
        prefill_policy,
        prefill_chunk: Some(prefill_chunk),
        max_batch_size: 16,
        kv_pages,
        max_seq_len: Some(1024),
        ..EngineConfig::default()
    })
}

const LONG_PROMPT: &str = "The river ran past the old mill, under the stone bridge and on \
    towards the sea, where the boats waited for the morning tide. ";

/// The mixed batch: penalties, seeded sampling, constraints, stop strings
/// and ids, log-probabilities. `stop_id` is a token the model emits early.
fn batch(stop_id: u32) -> Vec<GenerateRequest> {
    let text = |p: &str, n| GenerateRequest::text(p, n);
    let sampled = |seed| SamplingOptions {
        temperature: Some(0.9),
        top_k: Some(50),
        top_p: Some(0.95),
        seed: Some(seed),
        ..SamplingOptions::default()
    };
    let mut reqs = vec![
        // A long prompt: many chunks, and pages published along the way;
        // first, so in a small cache the rest squeeze into what it leaves.
        text(&LONG_PROMPT.repeat(12), 12),
        GenerateRequest {
            sampling: SamplingOptions {
                repetition_penalty: Some(1.3),
                frequency_penalty: Some(0.8),
                presence_penalty: Some(0.6),
                ..SamplingOptions::default()
            },
            ..text("The the the the the", 24)
        },
        GenerateRequest {
            sampling: SamplingOptions {
                frequency_penalty: Some(1.5),
                ..sampled(7)
            },
            ..text("Once upon a time", 24)
        },
        GenerateRequest {
            sampling: sampled(0),
            ..text("My favourite food is", 20)
        },
        GenerateRequest {
            sampling: SamplingOptions {
                min_p: Some(0.1),
                ..sampled(u64::MAX)
            },
            ..text("Here is a list of fruits:", 20)
        },
        GenerateRequest {
            stop: vec![".".into(), "\n".into()],
            ..text("The capital of France is", 40)
        },
        GenerateRequest {
            stop_token_ids: vec![stop_id],
            ..text("Write about the sea and the sky and the", 40)
        },
        GenerateRequest {
            sampling: SamplingOptions {
                logprobs: true,
                top_logprobs: 3,
                ..sampled(11)
            },
            ..text("2 + 2 =", 8)
        },
        GenerateRequest {
            constraint: Some(Constraint::JsonSchema(serde_json::json!({
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
                "required": ["name", "age"]
            }))),
            sampling: sampled(3),
            ..text("A person as JSON:", 48)
        },
        GenerateRequest {
            constraint: Some(Constraint::Regex("[0-9]{3}-[0-9]{4}".into())),
            ..text("Call me at", 16)
        },
        GenerateRequest {
            constraint: Some(Constraint::Choice(vec![
                "yes".into(),
                "no".into(),
                "maybe".into(),
            ])),
            sampling: sampled(5),
            ..text("Is the sky blue?", 8)
        },
    ];
    for (i, r) in reqs.iter_mut().enumerate() {
        r.request_id = Some(format!("overlap-{i}"));
    }
    reqs
}

/// Runs the batch concurrently and returns the responses in order.
fn run(engine: &Engine, reqs: &[GenerateRequest]) -> Vec<GenerateResponse> {
    rt().block_on(stream_all(engine, reqs))
}

#[test]
fn blocking_pipelined_and_chunked_agree_on_every_request() {
    const ROOMY: usize = 512;
    const TIGHT: usize = 26;
    assert_eq!(
        EngineConfig::default().numerics,
        kestrel_engine::Numerics::Fast
    );
    let configs = [
        (2, PipelineMode::Blocking, PrefillPolicy::Drain, 0, ROOMY),
        (
            2,
            PipelineMode::Blocking,
            PrefillPolicy::RideAlong,
            0,
            ROOMY,
        ),
        (2, PipelineMode::Pipelined, PrefillPolicy::Drain, 0, ROOMY),
        (
            2,
            PipelineMode::Pipelined,
            PrefillPolicy::RideAlong,
            0,
            ROOMY,
        ),
        (2, PipelineMode::Blocking, PrefillPolicy::Drain, 3, ROOMY),
        (2, PipelineMode::Pipelined, PrefillPolicy::Drain, 3, ROOMY),
        (
            2,
            PipelineMode::Pipelined,
            PrefillPolicy::RideAlong,
            3,
            ROOMY,
        ),
        (2, PipelineMode::Blocking, PrefillPolicy::Drain, 0, TIGHT),
        (2, PipelineMode::Pipelined, PrefillPolicy::Drain, 32, TIGHT),
        (
            1,
            PipelineMode::Pipelined,
            PrefillPolicy::RideAlong,
            0,
            ROOMY,
        ),
    ];
    let mut reference: Option<Vec<GenerateResponse>> = None;
    for (threads, mode, policy, chunk, kv_pages) in configs {
        let engine = engine_on(threads, mode, policy, chunk, kv_pages);
        let stop_id = engine.tokenize(" the", false).expect("tokenize")[0];
        let reqs = batch(stop_id);
        let out = run(&engine, &reqs);
        for (req, resp) in reqs.iter().zip(&out) {
            let max = req.max_new_tokens.unwrap() as usize;
            assert!(resp.token_ids.len() <= max, "{mode:?}: past max_new_tokens");
            if !req.stop_token_ids.is_empty() && resp.finish_reason == FinishReason::Stop {
                assert_eq!(
                    resp.token_ids.last(),
                    Some(&stop_id),
                    "nothing past the stop id"
                );
                assert_eq!(
                    resp.token_ids.iter().filter(|&&t| t == stop_id).count(),
                    1,
                    "{mode:?}: a token past the stop id"
                );
            }
            if let Some(Constraint::JsonSchema(_)) = req.constraint {
                if resp.finish_reason == FinishReason::Stop {
                    let v: serde_json::Value =
                        serde_json::from_str(&resp.text).expect("schema output parses");
                    assert!(v["age"].is_i64() || v["age"].is_u64(), "{v}");
                }
            }
            if req.sampling.top_logprobs > 0 {
                assert_eq!(resp.logprobs.len(), resp.token_ids.len());
                assert!(resp.logprobs.iter().all(|l| l.top.len() == 3));
            }
        }
        let (prefill_steps, preemptions) = (
            counter(&engine, "kestrel_prefill_steps_total") as usize,
            counter(&engine, "kestrel_preemptions_total") as usize,
        );
        // Preempted sequences are prefilled again: more prefill steps.
        assert_eq!(
            preemptions > 0,
            kv_pages == TIGHT,
            "{mode:?}/{policy:?} with {kv_pages} pages: {preemptions} preemptions"
        );
        // The long prompt alone takes over a hundred chunks.
        let long = engine
            .tokenize(&LONG_PROMPT.repeat(12), true)
            .expect("tokenize")
            .len();
        assert!(long > 300, "a long prompt of {long} tokens");
        match long.checked_div(chunk) {
            // Prompts waiting together share a step (how many wait
            // together depends on arrival timing).
            None => assert!(
                (1..=reqs.len() + preemptions).contains(&prefill_steps),
                "{prefill_steps} prefill steps: at most one per prompt and per preemption"
            ),
            Some(chunks) => assert!(
                prefill_steps >= chunks,
                "{prefill_steps} prefill steps in chunks of {chunk}"
            ),
        }
        match &reference {
            None => {
                // Alone (one at a time, after the batch, in the first
                // engine) == batched: a penalised, a seeded-sampled and a
                // constrained request.
                for i in [1, 2, 9] {
                    let alone = run(&engine, std::slice::from_ref(&reqs[i]));
                    assert_eq!(alone[0].token_ids, out[i].token_ids, "request {i} alone");
                    assert_eq!(alone[0].logprobs, out[i].logprobs, "request {i} alone");
                }
                reference = Some(out)
            }
            Some(want) => {
                for (i, (a, b)) in want.iter().zip(&out).enumerate() {
                    assert_eq!(
                        a.token_ids, b.token_ids,
                        "{threads} threads {mode:?}/{policy:?}/chunk {chunk}/{kv_pages} pages: request {i}"
                    );
                    assert_eq!(a.text, b.text, "request {i}");
                    assert_eq!(a.finish_reason, b.finish_reason, "request {i}");
                    assert_eq!(a.logprobs, b.logprobs, "request {i}");
                    assert_eq!(a.json, b.json, "request {i}");
                }
            }
        }
        rt().block_on(engine.shutdown(Duration::from_secs(1)));
    }
}

#[test]
fn a_request_id_is_free_again_the_moment_its_request_ends() {
    let engine = engine(PipelineMode::Pipelined, PrefillPolicy::RideAlong, 0, 512);
    rt().block_on(async {
        for _ in 0..3 {
            let mut req = GenerateRequest::text("Hello", 4);
            req.request_id = Some("reused".into());
            let resp = engine
                .generate(req)
                .await
                .expect("finished request frees its id");
            assert_eq!(resp.request_id, "reused");
        }
        for _ in 0..3 {
            let mut req = GenerateRequest::text("Tell me a long story", 200);
            req.request_id = Some("aborted".into());
            let mut s = engine.stream(req).expect("accepted");
            s.abort();
            let end = loop {
                match s.next_event().await.expect("terminal").expect("no error") {
                    kestrel_engine::StreamEvent::Done(r) => break r,
                    kestrel_engine::StreamEvent::Delta { .. } => {}
                    kestrel_engine::StreamEvent::Object(o) => {
                        panic!("a text request's object {o:?}")
                    }
                }
            };
            assert!(matches!(
                end.finish_reason,
                FinishReason::Abort | FinishReason::Length | FinishReason::Eos
            ));
        }
        engine.shutdown(Duration::from_secs(1)).await;
    });
}

/// The CUDA runtime's bookkeeping (slots, KV, metadata, buckets, graphs,
/// dispatch, device sampling) through the engine, on kestrel-cuda's host
/// device (its kernels computed on the CPU: no GPU needed): blocking and
/// pipelined, drain and ride-along, and chunked prefill (chunks of 3, so
/// every prompt is prefilled in several steps through the tiled prefill
/// kernel, resuming after its cached prefix) agree on every request of the
/// mixed batch, and a request alone equals it batched. The long prompt is
/// left out, as the host device computes in one thread.
#[test]
fn the_cuda_runtime_on_its_host_device_agrees_blocking_and_pipelined() {
    let configs = [
        (PipelineMode::Blocking, PrefillPolicy::Drain, 0),
        (PipelineMode::Pipelined, PrefillPolicy::RideAlong, 0),
        (PipelineMode::Pipelined, PrefillPolicy::RideAlong, 3),
    ];
    let mut reference: Option<Vec<GenerateResponse>> = None;
    for (mode, policy, chunk) in configs {
        let engine = start_default(EngineConfig {
            backend: Backend::CudaHost,
            mode,
            prefill_policy: policy,
            prefill_chunk: Some(chunk),
            max_batch_size: 16,
            kv_pages: 512,
            max_seq_len: Some(1024),
            ..EngineConfig::default()
        });
        assert_eq!(engine.model_info().backend, "cuda-host");
        let stop_id = engine.tokenize(" the", false).expect("tokenize")[0];
        let reqs = batch(stop_id).split_off(1);
        let out = run(&engine, &reqs);
        for (i, (req, resp)) in reqs.iter().zip(&out).enumerate() {
            assert!(
                resp.token_ids.len() <= req.max_new_tokens.unwrap() as usize,
                "{mode:?}: request {i} past max_new_tokens"
            );
            assert!(
                !resp.token_ids.is_empty(),
                "{mode:?}: request {i}: {resp:?}"
            );
        }
        match &reference {
            None => {
                // A penalised, a seeded-sampled and a constrained request.
                for i in [0, 1, 8] {
                    let alone = run(&engine, std::slice::from_ref(&reqs[i]));
                    assert_eq!(alone[0].token_ids, out[i].token_ids, "request {i} alone");
                    assert_eq!(alone[0].logprobs, out[i].logprobs, "request {i} alone");
                }
                reference = Some(out);
            }
            Some(want) => {
                for (i, (a, b)) in want.iter().zip(&out).enumerate() {
                    assert_eq!(
                        a.token_ids, b.token_ids,
                        "{mode:?}/{policy:?}/chunk {chunk}: request {i}"
                    );
                    assert_eq!(a.text, b.text, "request {i}");
                    assert_eq!(a.finish_reason, b.finish_reason, "request {i}");
                    assert_eq!(a.logprobs, b.logprobs, "request {i}");
                    assert_eq!(a.json, b.json, "request {i}");
                }
            }
        }
        rt().block_on(async {
            kv_released(&engine).await;
            engine.shutdown(Duration::from_secs(1)).await;
        });
    }
}
