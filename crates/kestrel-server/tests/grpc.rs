//! End-to-end tests of the gRPC API: the real engine and default model,
//! served on `127.0.0.1:0`, called with the generated tonic client.
//! Requests use greedy decoding and a few tokens to keep the suite quick.

mod common;

use std::time::Duration;

use common::{chat_request, client, collect_stream, shared_server, text_request};
use kestrel_server::pb;
use kestrel_server::pb::generate_request::{Constraint, Input};
use tonic::Code;

#[tokio::test]
async fn unary_generate_returns_a_completion() {
    let mut c = client(shared_server()).await;
    let resp = c
        .generate(text_request("The capital of France is", 8))
        .await
        .expect("generate")
        .into_inner();
    assert!(!resp.request_id.is_empty());
    assert!(!resp.token_ids.is_empty() && resp.token_ids.len() <= 8);
    let usage = resp.usage.expect("usage");
    assert!(usage.prompt_tokens > 0);
    assert_eq!(usage.completion_tokens as usize, resp.token_ids.len());
    assert!(matches!(
        resp.finish_reason(),
        pb::FinishReason::Length | pb::FinishReason::Eos
    ));
    assert!(resp.timings.expect("timings").total_ms > 0.0);
    assert!(!resp.text.is_empty(), "{resp:?}");
}

#[tokio::test]
async fn stream_concatenates_to_the_unary_result() {
    let mut c = client(shared_server()).await;
    let req = text_request("Once upon a time", 12);
    let unary = c
        .generate(req.clone())
        .await
        .expect("generate")
        .into_inner();
    let streamed = collect_stream(&mut c, req).await.expect("stream");
    assert!(streamed.deltas >= 1);
    assert_eq!(streamed.text, streamed.done.text);
    assert_eq!(streamed.token_ids, streamed.done.token_ids);
    assert_eq!(streamed.done.text, unary.text);
    assert_eq!(streamed.done.token_ids, unary.token_ids);
    assert_eq!(streamed.done.finish_reason, unary.finish_reason);
}

#[tokio::test]
async fn chat_input_and_logprobs() {
    let mut c = client(shared_server()).await;
    let mut req = chat_request("Say hello.", 6);
    req.top_logprobs = 3;
    let resp = c.generate(req).await.expect("generate").into_inner();
    assert_eq!(resp.logprobs.len(), resp.token_ids.len());
    for (lp, &id) in resp.logprobs.iter().zip(&resp.token_ids) {
        assert_eq!(lp.token_id, id);
        assert!(lp.top.len() <= 3);
    }
}

/// `prompt_logprobs` scores each prompt token (the first has no context:
/// NaN, no alternatives); with `max_new_tokens` 0 nothing is generated and
/// the scores are the same. Out of range it is INVALID_ARGUMENT naming it.
#[tokio::test]
async fn prompt_logprobs_score_the_prompt() {
    let mut c = client(shared_server()).await;
    let mut req = text_request("The sky is blue and the grass is", 3);
    req.prompt_logprobs = Some(2);
    let resp = c
        .generate(req.clone())
        .await
        .expect("generate")
        .into_inner();
    let lps = &resp.prompt_logprobs;
    assert_eq!(lps.len(), resp.usage.unwrap().prompt_tokens as usize);
    assert!(lps[0].logprob.is_nan() && lps[0].top.is_empty());
    for lp in &lps[1..] {
        assert!(lp.logprob.is_finite() && lp.logprob <= 0.0, "{lp:?}");
        assert_eq!(lp.top.len(), 2);
    }
    assert_eq!(resp.token_ids.len(), 3);
    req.max_new_tokens = Some(0);
    let only = c
        .generate(req.clone())
        .await
        .expect("score only")
        .into_inner();
    assert!(only.token_ids.is_empty());
    assert_eq!(only.finish_reason(), pb::FinishReason::Length);
    let bits = |v: &[pb::TokenLogprob]| v.iter().map(|l| l.logprob.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&only.prompt_logprobs), bits(lps));
    req.prompt_logprobs = Some(21);
    let e = c.generate(req).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message()
            .starts_with("prompt_logprobs must be in [0, 20]"),
        "{}",
        e.message()
    );
}

#[tokio::test]
async fn thirty_two_concurrent_greedy_streams_match_solo_runs() {
    let server = shared_server();
    let prompts = [
        "The quick brown fox",
        "In 1492, Columbus",
        "def fibonacci(n):",
        "The best way to learn Rust is",
        "Water boils at",
        "My favourite colour is",
        "Once upon a time, in a land far away,",
        "The three primary colours are",
        "SELECT * FROM",
    ];
    // 32 distinct prompts: the issue's bar is 32 concurrent streams.
    let prompts: Vec<String> = (0..32)
        .map(|i| {
            format!(
                "{} (take {})",
                prompts[i % prompts.len()],
                i / prompts.len()
            )
        })
        .collect();
    let mut c = client(server).await;
    let mut solo = Vec::new();
    for p in &prompts {
        let mut req = text_request(p, 10);
        req.ignore_eos = true;
        solo.push(c.generate(req).await.expect("solo").into_inner());
    }
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let mut req = text_request(p, 10);
            req.ignore_eos = true;
            tokio::spawn(async move {
                let mut c = client(shared_server()).await;
                collect_stream(&mut c, req)
                    .await
                    .expect("concurrent stream")
            })
        })
        .collect();
    for (task, alone) in tasks.into_iter().zip(&solo) {
        let together = task.await.expect("task");
        assert_eq!(together.done.token_ids, alone.token_ids);
        assert_eq!(together.text, alone.text);
    }
}

/// `n`: Generate returns sample 0 with the others in `samples`;
/// StreamGenerate interleaves the samples' deltas, each naming its sample,
/// and ends after one `done` per sample. Each seeded sample is what a
/// request of its own with seed + index gives.
#[tokio::test]
async fn n_samples_over_generate_and_stream_generate() {
    use pb::stream_generate_response::Event;
    let mut c = client(shared_server()).await;
    let mut req = text_request("Write a short poem about the sea:", 10);
    req.temperature = Some(0.9);
    req.seed = Some(11);
    req.ignore_eos = true;
    req.n = Some(3);
    let unary = c
        .generate(req.clone())
        .await
        .expect("generate")
        .into_inner();
    assert_eq!(unary.index, 0);
    let indices: Vec<u32> = unary.samples.iter().map(|s| s.index).collect();
    assert_eq!(indices, [1, 2]);
    let all: Vec<&pb::GenerateResponse> = std::iter::once(&unary).chain(&unary.samples).collect();
    for s in &all {
        assert_eq!(s.request_id, unary.request_id);
        assert_eq!(s.token_ids.len(), 10);
    }
    assert!(unary.samples.iter().all(|s| s.samples.is_empty()));

    let mut stream = c
        .stream_generate(req.clone())
        .await
        .expect("stream")
        .into_inner();
    let mut texts = vec![String::new(); 3];
    let mut done: Vec<Option<pb::GenerateResponse>> = vec![None; 3];
    while let Some(msg) = stream.message().await.expect("a message") {
        match msg.event.expect("event set") {
            Event::Delta(d) => {
                assert!(done[d.index as usize].is_none(), "a delta after its done");
                texts[d.index as usize].push_str(&d.text);
            }
            Event::Done(d) => {
                let i = d.index as usize;
                assert!(done[i].replace(d).is_none(), "two dones for sample {i}");
            }
            Event::Object(o) => panic!("a text request streamed an object: {o:?}"),
        }
    }
    for (i, (text, d)) in texts.iter().zip(&done).enumerate() {
        let d = d
            .as_ref()
            .unwrap_or_else(|| panic!("no done for sample {i}"));
        assert_eq!(&d.text, text);
        assert_eq!(
            d.token_ids, all[i].token_ids,
            "sample {i}: stream and unary"
        );
        let alone = c
            .generate(pb::GenerateRequest {
                n: None,
                seed: Some(11 + i as u64),
                ..req.clone()
            })
            .await
            .expect("generate")
            .into_inner();
        assert_eq!(
            alone.token_ids,
            d.token_ids,
            "sample {i} and seed {}",
            11 + i
        );
    }
    assert!(
        all[0].token_ids != all[1].token_ids || all[1].token_ids != all[2].token_ids,
        "each sample has its own seed"
    );
}

#[tokio::test]
async fn abort_rpc_ends_a_running_stream() {
    use pb::stream_generate_response::Event;
    let mut c = client(shared_server()).await;
    let mut req = text_request("Count slowly: one, two,", 1000);
    req.ignore_eos = true;
    req.request_id = "abort-rpc-test".into();
    let mut stream = c.stream_generate(req).await.expect("stream").into_inner();
    let first = stream.message().await.expect("first").expect("a delta");
    assert!(matches!(first.event, Some(Event::Delta(_))));
    let accepted = c
        .abort(pb::AbortRequest {
            request_id: "abort-rpc-test".into(),
        })
        .await
        .expect("abort")
        .into_inner()
        .accepted;
    assert!(accepted);
    let done = loop {
        match stream.message().await.expect("message") {
            Some(pb::StreamGenerateResponse {
                event: Some(Event::Done(d)),
            }) => break d,
            Some(_) => {}
            None => panic!("no done message"),
        }
    };
    assert_eq!(done.finish_reason(), pb::FinishReason::Abort);
    assert!(done.token_ids.len() < 1000);
}

/// A change that makes a valid request invalid.
type Edit = Box<dyn Fn(&mut pb::GenerateRequest)>;

/// Applies `edit` to a valid request; both RPCs must answer
/// INVALID_ARGUMENT with a message containing `needle`.
async fn assert_invalid(edit: impl Fn(&mut pb::GenerateRequest), needle: &str) {
    let mut c = client(shared_server()).await;
    let mut req = text_request("Hello there, how are you today?", 4);
    edit(&mut req);
    let e = c.generate(req.clone()).await.expect_err(needle);
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains(needle),
        "{:?} lacks {needle:?}",
        e.message()
    );
    let e = collect_stream(&mut c, req).await.expect_err(needle);
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains(needle),
        "{:?} lacks {needle:?}",
        e.message()
    );
}

#[tokio::test]
async fn each_invalid_field_is_invalid_argument() {
    let max = shared_server().engine.model_info().context_length as u32 - 1;
    let cases: Vec<(Edit, String)> = vec![
        (Box::new(|r| r.input = None), "input must be set".into()),
        (
            Box::new(|r| r.input = Some(Input::Prompt(String::new()))),
            "prompt must not be empty".into(),
        ),
        (
            Box::new(|r| r.input = Some(Input::Chat(pb::ChatMessages::default()))),
            "chat.messages must not be empty".into(),
        ),
        (
            Box::new(|r| r.max_new_tokens = Some(0)),
            "max_new_tokens must be at least 1, got 0".into(),
        ),
        (
            Box::new(|r| r.temperature = Some(-1.0)),
            "temperature must be in [0, 100], got -1".into(),
        ),
        (
            Box::new(|r| r.n = Some(0)),
            "n must be in [1, 16], got 0".into(),
        ),
        (
            Box::new(|r| r.n = Some(17)),
            "n must be in [1, 16], got 17".into(),
        ),
        (
            Box::new(|r| r.top_p = Some(0.0)),
            "top_p must be in (0, 1], got 0".into(),
        ),
        (
            Box::new(|r| r.min_p = Some(2.0)),
            "min_p must be in [0, 1]".into(),
        ),
        (
            Box::new(|r| r.repetition_penalty = Some(0.0)),
            "repetition_penalty must be in (0, 10]".into(),
        ),
        (
            Box::new(|r| r.frequency_penalty = Some(3.0)),
            "frequency_penalty must be in [-2, 2]".into(),
        ),
        (
            Box::new(|r| r.presence_penalty = Some(-3.0)),
            "presence_penalty must be in [-2, 2]".into(),
        ),
        (
            Box::new(|r| r.top_logprobs = 21),
            "top_logprobs must be in [0, 20], got 21".into(),
        ),
        (Box::new(|r| r.stop = vec![String::new()]), "stop[0]".into()),
        (
            Box::new(|r| r.stop_token_ids = vec![u32::MAX]),
            "stop_token_ids[0] must be in [0,".into(),
        ),
        (
            Box::new(|r| r.request_id = "no spaces".into()),
            "request_id".into(),
        ),
        (
            Box::new(|r| r.constraint = Some(Constraint::JsonSchema("{oops".into()))),
            "json_schema must be valid JSON text".into(),
        ),
        (
            Box::new(|r| r.constraint = Some(Constraint::Regex(String::new()))),
            "regex must not be empty".into(),
        ),
        (
            Box::new(|r| r.constraint = Some(Constraint::Choice(pb::ChoiceList::default()))),
            "choice.choices must not be empty".into(),
        ),
        (
            Box::new(|r| r.constraint = Some(Constraint::Grammar(String::new()))),
            "grammar must not be empty".into(),
        ),
        (
            Box::new(|r| {
                r.stop = vec!["x".into()];
                r.constraint = Some(Constraint::Regex("a+".into()));
            }),
            "constraint cannot be combined".into(),
        ),
        // Prompt + max_new_tokens exceeds the context (documented as
        // INVALID_ARGUMENT).
        (
            Box::new(move |r| r.max_new_tokens = Some(max)),
            "exceeds the context".into(),
        ),
    ];
    for (edit, needle) in &cases {
        assert_invalid(edit, needle).await;
    }
}

#[tokio::test]
async fn invalid_regex_is_rejected_by_the_engine() {
    let mut c = client(shared_server()).await;
    let mut req = text_request("Hello", 4);
    req.constraint = Some(Constraint::Regex("(unclosed".into()));
    let e = c.generate(req).await.expect_err("bad regex");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
}

#[tokio::test]
async fn json_schema_constraint_returns_valid_json() {
    let mut c = client(shared_server()).await;
    let mut req = chat_request("Is the sky blue? Answer in JSON.", 48);
    req.constraint = Some(Constraint::JsonSchema(
        r#"{"type":"object","properties":{"answer":{"type":"boolean"}},"required":["answer"],"additionalProperties":false}"#.into(),
    ));
    let resp = c.generate(req).await.expect("generate").into_inner();
    assert_eq!(resp.finish_reason(), pb::FinishReason::Stop, "{resp:?}");
    let v: serde_json::Value = serde_json::from_str(&resp.text).expect("output is JSON");
    assert!(v["answer"].is_boolean(), "{v}");
    let json: serde_json::Value =
        serde_json::from_str(resp.json.as_deref().expect("json field")).expect("json field parses");
    assert_eq!(json, v);
}

#[tokio::test]
async fn choice_constraint_returns_a_listed_choice() {
    let mut c = client(shared_server()).await;
    let choices = vec!["red".to_string(), "green".into(), "blue".into()];
    let mut req = chat_request("What colour is grass?", 8);
    req.constraint = Some(Constraint::Choice(pb::ChoiceList {
        choices: choices.clone(),
    }));
    let streamed = collect_stream(&mut c, req).await.expect("stream");
    assert!(choices.contains(&streamed.done.text), "{:?}", streamed.done);
    assert_eq!(streamed.done.finish_reason(), pb::FinishReason::Stop);
}

#[tokio::test]
async fn tokenize_detokenize_round_trip_and_model_info() {
    let mut c = client(shared_server()).await;
    let ids = c
        .tokenize(pb::TokenizeRequest {
            text: "Hello, world!".into(),
            add_special_tokens: false,
        })
        .await
        .expect("tokenize")
        .into_inner()
        .token_ids;
    assert!(!ids.is_empty());
    let text = c
        .detokenize(pb::DetokenizeRequest {
            token_ids: ids,
            skip_special_tokens: true,
        })
        .await
        .expect("detokenize")
        .into_inner()
        .text;
    assert_eq!(text, "Hello, world!");
    let info = c
        .model_info(pb::ModelInfoRequest {})
        .await
        .expect("model info")
        .into_inner();
    assert!(info.vocab_size > 0 && info.context_length > 1);
    assert_eq!(info.max_new_tokens, info.context_length - 1);
    assert!(!info.eos_token_ids.is_empty());
    assert_eq!(info.backend, "cpu");

    let e = c
        .detokenize(pb::DetokenizeRequest {
            token_ids: vec![info.vocab_size],
            skip_special_tokens: false,
        })
        .await
        .expect_err("out of vocab");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().starts_with("token_ids[0] must be in [0,"),
        "{e:?}"
    );
    let e = c
        .abort(pb::AbortRequest::default())
        .await
        .expect_err("empty id");
    assert_eq!(e.code(), Code::InvalidArgument);
}

#[tokio::test]
async fn health_reports_serving() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let server = shared_server();
    let mut h = HealthClient::new(common::channel(server).await);
    for service in ["", kestrel_server::SERVICE_NAME] {
        let mut status = None;
        // The watcher publishes the first status right after start.
        for _ in 0..50 {
            match h
                .check(HealthCheckRequest {
                    service: service.into(),
                })
                .await
            {
                Ok(r) => {
                    status = Some(r.into_inner().status());
                    break;
                }
                Err(e) if e.code() == Code::NotFound => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(e) => panic!("health check: {e:?}"),
            }
        }
        assert_eq!(status, Some(ServingStatus::Serving), "service {service:?}");
    }
}

#[tokio::test]
async fn reflection_lists_and_describes_the_service() {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let server = shared_server();
    let mut r = ServerReflectionClient::new(common::channel(server).await);
    let requests = vec![
        ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        },
        ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::FileContainingSymbol(
                "kestrel.v1.Kestrel".into(),
            )),
        },
    ];
    let mut responses = r
        .server_reflection_info(tokio_stream::iter(requests))
        .await
        .expect("reflection")
        .into_inner();
    let list = responses
        .message()
        .await
        .expect("list")
        .expect("a response");
    match list.message_response {
        Some(MessageResponse::ListServicesResponse(l)) => {
            let names: Vec<_> = l.service.iter().map(|s| s.name.as_str()).collect();
            assert!(names.contains(&"kestrel.v1.Kestrel"), "{names:?}");
            assert!(names.contains(&"grpc.health.v1.Health"), "{names:?}");
        }
        other => panic!("{other:?}"),
    }
    let file = responses
        .message()
        .await
        .expect("file")
        .expect("a response");
    match file.message_response {
        Some(MessageResponse::FileDescriptorResponse(f)) => {
            assert!(!f.file_descriptor_proto.is_empty())
        }
        other => panic!("{other:?}"),
    }
}

/// The scrape listener (`kestrel serve --metrics-addr`) over a real HTTP
/// client: `GET /metrics` (query ignored) answers the exposition, another
/// method there 405, any other path 404, and it stops on its shutdown signal.
#[tokio::test]
async fn metrics_endpoint_serves_prometheus_text() {
    use common::http::{call, get};
    let server = shared_server();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let metrics = kestrel_server::metrics_http::serve_metrics(
        server.engine.clone(),
        "127.0.0.1:0".parse().unwrap(),
        async {
            let _ = stop_rx.await;
        },
    )
    .await
    .expect("serve /metrics");
    let addr = metrics.local_addr();
    for path in ["/metrics", "/metrics?x=1"] {
        let ok = get(addr, path).await;
        assert_eq!(ok.status, 200, "{}", ok.text());
        assert!(ok.content_type.starts_with("text/plain; version=0.0.4"));
        assert!(
            ok.text().contains("kestrel_requests_finished_total"),
            "{}",
            ok.text()
        );
    }
    let post = call(addr, "POST", "/metrics", Vec::new()).await;
    assert_eq!((post.status, post.text().as_str()), (405, "use GET\n"));
    let missing = get(addr, "/").await;
    assert_eq!(missing.status, 404, "{}", missing.text());
    assert!(missing.text().contains("try /metrics"));
    stop_tx.send(()).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(5), metrics.wait())
        .await
        .expect("the metrics server stops")
        .expect("cleanly");
}
