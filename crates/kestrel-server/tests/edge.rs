//! The request's edge over gRPC on the real model: a unary call's deadline
//! is always DEADLINE_EXCEEDED (and frees its KV), constraints past the
//! constraint engine's limits are INVALID_ARGUMENT on both RPCs naming the
//! constraint, an over-size message is OUT_OF_RANGE, and the `kestrel` CLI
//! prints an error's whole cause chain.

mod common;

use std::time::{Duration, Instant};

use common::{client, collect_stream, shared_server, text_request};
use kestrel_server::pb;
use pb::generate_request::Constraint;
use tonic::Code;

/// A Kestrel client over a plain HTTP/2 connection. tonic's own transport
/// runs a client-side timer on `grpc-timeout` that answers CANCELLED
/// locally when it fires first; this client has none, so every status it
/// reports is the server's.
fn raw_client(
    addr: std::net::SocketAddr,
) -> pb::kestrel_client::KestrelClient<
    hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        tonic::body::Body,
    >,
> {
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let origin = format!("http://{addr}").parse().expect("uri");
    pb::kestrel_client::KestrelClient::with_origin(http, origin)
}

#[tokio::test]
async fn a_unary_deadline_is_always_deadline_exceeded() {
    let server = shared_server();
    let mut c = raw_client(server.addr);
    for ms in [1u64, 5, 20, 60, 150] {
        for _ in 0..4 {
            let mut req = text_request("Count to a thousand: 1, 2, 3,", 2000);
            req.ignore_eos = true;
            let mut r = tonic::Request::new(req);
            r.set_timeout(Duration::from_millis(ms));
            let e = c.generate(r).await.expect_err("the deadline passes first");
            assert_eq!(e.code(), Code::DeadlineExceeded, "{ms} ms: {e:?}");
        }
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while server.engine.model_info().num_admitted != 0 {
        assert!(Instant::now() < deadline, "KV still held after deadlines");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Nested counted repetitions past the constraint engine's limits.
const NESTED: &str = "(.{1,100}){1,100}";

#[tokio::test]
async fn constraints_past_the_limits_are_invalid_argument_on_both_rpcs() {
    let mut c = client(shared_server()).await;
    let nested = NESTED;
    let cases = [
        (Constraint::Regex(nested.into()), "regex "),
        (
            Constraint::Grammar(format!("start: X\nX: /{nested}/")),
            "grammar ",
        ),
        // Past the limits only once the first token is in: the lexer
        // budget catches these at submission too.
        (
            Constraint::Grammar(format!("start: \"x\" X\nX: /{nested}/")),
            "grammar ",
        ),
        (
            Constraint::JsonSchema(format!(
                r#"{{"type":"object","properties":{{"b":{{"type":"string","pattern":"^{nested}$"}}}},"required":["b"]}}"#
            )),
            "json_schema ",
        ),
    ];
    for (constraint, field) in cases {
        let mut req = text_request("Say something", 8);
        req.constraint = Some(constraint);
        let e = c.generate(req.clone()).await.expect_err(field);
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().starts_with(field), "{:?}", e.message());
        assert!(e.message().contains("too complex"), "{:?}", e.message());
        let e = collect_stream(&mut c, req).await.expect_err(field);
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().starts_with(field), "{:?}", e.message());
    }
    // The engine keeps serving.
    c.generate(text_request("Hello", 2)).await.expect("served");
}

/// vLLM's `min_tokens` over gRPC: end-of-sequence cannot end the output
/// before it.
#[tokio::test]
async fn min_tokens_holds_end_of_sequence_back() {
    let mut c = client(shared_server()).await;
    let req = common::chat_request("Say hello.", 40);
    let short = c.generate(req.clone()).await.expect("served").into_inner();
    assert_eq!(short.finish_reason(), pb::FinishReason::Eos);
    assert!(short.usage.unwrap().completion_tokens < 40);
    let held = c
        .generate(pb::GenerateRequest {
            min_tokens: 40,
            ..req.clone()
        })
        .await
        .expect("served")
        .into_inner();
    assert_eq!(held.finish_reason(), pb::FinishReason::Length);
    assert_eq!(held.usage.unwrap().completion_tokens, 40);
    let e = c
        .generate(pb::GenerateRequest {
            min_tokens: 41,
            ..req
        })
        .await
        .expect_err("more than max_new_tokens");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().starts_with("min_tokens "), "{e:?}");
}

/// A regex whose forced run of a million bytes (`(a{1000}){1000}`) lies
/// past the lexer budget's horizon:
/// behind 200 branches, each a tag of its own, 40 free `x`/`y` bytes and
/// the tag again, so every depth holds 200 distinct branching states and
/// the 2,000 a lexeme is explored for end some 30 bytes short of the
/// run (a forced prefix such as `={2100}` would not hide it: its states
/// are not counted). It passes validation and fails once the model reaches
/// the run, a few dozen tokens in.
fn past_the_budget_horizon() -> String {
    let branches: Vec<String> = (0..200u8)
        .map(|i| {
            let tag = format!("{}{}", (b'a' + i / 10) as char, i % 10);
            format!("{tag}[xy]{{40}}{tag}")
        })
        .collect();
    format!("({})(a{{1000}}){{1000}}", branches.join("|"))
}

/// Past the limits only after the budget's horizon: Generate answers
/// INVALID_ARGUMENT naming the constraint (it is the request's constraint,
/// not a server fault); StreamGenerate sends a final `done` with
/// FINISH_REASON_ERROR, then INVALID_ARGUMENT. Never a normal stop, never
/// INTERNAL.
#[tokio::test]
async fn a_constraint_failing_mid_generation_is_an_error_on_both_rpcs() {
    use pb::stream_generate_response::Event;
    let mut c = client(shared_server()).await;
    let cases = [Constraint::Regex(past_the_budget_horizon())];
    for constraint in cases {
        let mut req = text_request("Say something", 600);
        req.constraint = Some(constraint);
        let e = c.generate(req.clone()).await.expect_err("constraint fails");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(
            e.message()
                .starts_with("regex stopped being satisfiable mid-generation: "),
            "{e:?}"
        );
        assert!(e.message().contains("lexer error: too many"), "{e:?}");
        let mut s = c.stream_generate(req).await.expect("stream").into_inner();
        let mut done = None;
        let status = loop {
            match s.message().await {
                Ok(Some(m)) => {
                    if let Some(Event::Done(d)) = m.event {
                        done = Some(d);
                    }
                }
                Ok(None) => panic!("the stream ended OK after a failed constraint"),
                Err(status) => break status,
            }
        };
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        let done = done.expect("a final done before the error");
        assert_eq!(done.finish_reason(), pb::FinishReason::Error);
    }
}

#[tokio::test]
async fn an_oversize_message_is_out_of_range() {
    let mut c = client(shared_server())
        .await
        .max_encoding_message_size(64 << 20);
    let req = text_request(&"x".repeat(kestrel_server::MAX_MESSAGE_BYTES + 1), 4);
    let e = c.generate(req).await.expect_err("too large");
    assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
    // The server keeps serving.
    c.generate(text_request("Hello", 2)).await.expect("served");
}

/// An error whose message already includes its cause (`ModelError::Io`:
/// "I/O error on PATH: CAUSE") gets that cause printed once, not again as
/// the next "Caused by" line.
#[test]
fn the_cli_prints_each_cause_once() {
    let missing =
        std::env::temp_dir().join(format!("kestrel-no-model-{}.gguf", std::process::id()));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["generate", "--model"])
        .arg(&missing)
        .arg("hi")
        .output()
        .expect("run kestrel");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let reason = "no such file or directory";
    assert!(stderr.contains("Caused by:"), "{stderr}");
    assert!(
        stderr.contains(&format!("I/O error on {}", missing.display())),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches(reason).count(),
        1,
        "the cause is printed once:\n{stderr}"
    );
}

#[test]
fn the_cli_prints_the_whole_cause_chain() {
    let dir = std::env::temp_dir().join(format!("kestrel-cli-chain-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("not-a-model.gguf");
    std::fs::write(&bad, b"GGUF but not really a model file").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["generate", "--model"])
        .arg(&bad)
        .arg("hi")
        .output()
        .expect("run kestrel");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail = stderr
        .split("Caused by:")
        .nth(1)
        .unwrap_or_else(|| panic!("no cause chain:\n{stderr}"));
    let causes: Vec<&str> = tail
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    assert!(!causes.is_empty(), "an empty cause chain:\n{stderr}");
    assert!(
        stderr.contains("failed to load the model"),
        "the chain names what failed:\n{stderr}"
    );
}

/// `--quantize q8_0` re-encodes an HF directory's weights; a GGUF file's
/// are served as stored, so the flag is refused with the typed error
/// (`ModelError::QuantizeStored`) naming it, before the file is read.
#[test]
fn the_cli_refuses_quantize_for_a_gguf() {
    let dir = std::env::temp_dir().join(format!("kestrel-cli-quantize-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let gguf = dir.join("model.gguf");
    std::fs::write(&gguf, b"never read").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["generate", "--quantize", "q8_0", "--model"])
        .arg(&gguf)
        .arg("hi")
        .output()
        .expect("run kestrel");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "--quantize Q8_0 applies to safetensors (HF directory) models; {} is a GGUF file",
            gguf.display()
        )),
        "{stderr}"
    );
}
