//! A soak through the real gRPC server on the real model: many mixed
//! requests (plain, streamed, constrained, cancelled at random points,
//! invalid, with deadlines) from concurrent clients, then the engine must
//! be back where it started: every request answered exactly once with the
//! status its kind allows, none hung, no KV page or running request left,
//! health SERVING.
//!
//! CI runs a short one (`KESTREL_SOAK_REQUESTS`, default 200);
//! `cargo xtask soak` runs the long one (10,000 requests) in release mode.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{chat_request, client, collect_stream, start_server, text_request};
use kestrel_server::pb;
use pb::generate_request::Constraint;
use tokio_stream::StreamExt;
use tonic::Code;

/// What a request was, so its answer can be judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Plain,
    Streamed,
    Chat,
    Choice,
    Json,
    Regex,
    Cancelled,
    Invalid,
    Deadline,
}

/// A small deterministic generator (no dependency for a test's dice).
struct Dice(u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn kind_of(roll: u64) -> Kind {
    // Out of 100: 10% cancelled, 5% invalid, 5% with deadlines.
    match roll {
        0..=9 => Kind::Cancelled,
        10..=14 => Kind::Invalid,
        15..=19 => Kind::Deadline,
        20..=39 => Kind::Plain,
        40..=59 => Kind::Streamed,
        60..=69 => Kind::Chat,
        70..=79 => Kind::Choice,
        80..=89 => Kind::Json,
        _ => Kind::Regex,
    }
}

const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "Once upon a time",
    "List three colors:",
    "def fibonacci(n):",
];

/// The options of the choice-constrained requests.
const COLORS: [&str; 3] = ["red", "green", "blue"];

fn request(kind: Kind, dice: &mut Dice) -> pb::GenerateRequest {
    let prompt = PROMPTS[dice.below(PROMPTS.len() as u64) as usize];
    let max = 2 + dice.below(14) as u32;
    let mut r = match kind {
        Kind::Chat => chat_request(prompt, max),
        _ => text_request(prompt, max),
    };
    if dice.below(2) == 0 {
        r.temperature = Some(0.8);
        r.seed = Some(dice.next());
    }
    match kind {
        Kind::Choice => {
            r.constraint = Some(Constraint::Choice(pb::ChoiceList {
                choices: COLORS.iter().map(|c| c.to_string()).collect(),
            }))
        }
        Kind::Json => {
            r.max_new_tokens = Some(48);
            r.constraint = Some(Constraint::JsonSchema(
                r#"{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}"#
                    .into(),
            ))
        }
        Kind::Regex => r.constraint = Some(Constraint::Regex("[0-9]{2,4}".into())),
        Kind::Invalid => match dice.below(3) {
            0 => r.temperature = Some(-1.0),
            1 => r.top_p = Some(f32::NAN),
            _ => r.stop = vec![String::new()],
        },
        Kind::Cancelled => r.max_new_tokens = Some(64),
        _ => {}
    }
    r
}

/// Runs one request; returns the status code it ended with.
async fn run_one(
    c: &mut pb::kestrel_client::KestrelClient<tonic::transport::Channel>,
    kind: Kind,
    req: pb::GenerateRequest,
    dice: &mut Dice,
) -> Code {
    match kind {
        Kind::Streamed | Kind::Chat | Kind::Json => match collect_stream(c, req).await {
            Ok(done) => {
                // A JSON output cut by max_new_tokens is honestly LENGTH.
                if kind == Kind::Json && done.done.finish_reason() == pb::FinishReason::Stop {
                    let v: serde_json::Value =
                        serde_json::from_str(&done.text).expect("schema output parses");
                    assert!(v["n"].is_i64() || v["n"].is_u64(), "{v}");
                }
                Code::Ok
            }
            Err(s) => s.code(),
        },
        Kind::Cancelled => {
            // Drop the stream after a random number of deltas (0: at once).
            let keep = dice.below(4);
            match c.stream_generate(req).await {
                Err(s) => s.code(),
                Ok(resp) => {
                    let mut s = resp.into_inner();
                    for _ in 0..keep {
                        if s.next().await.is_none() {
                            break;
                        }
                    }
                    Code::Cancelled
                }
            }
        }
        Kind::Deadline => {
            let mut r = tonic::Request::new(req);
            r.set_timeout(Duration::from_millis(1 + dice.below(40)));
            match c.generate(r).await {
                Ok(_) => Code::Ok,
                Err(s) => s.code(),
            }
        }
        _ => match c.generate(req).await {
            Ok(resp) => {
                let resp = resp.into_inner();
                if kind == Kind::Choice {
                    // Whole when it stopped; a prefix when max_new_tokens
                    // cut it (a sampled choice may take several tokens).
                    let ok = match resp.finish_reason() {
                        pb::FinishReason::Stop => COLORS.contains(&resp.text.as_str()),
                        pb::FinishReason::Length => {
                            COLORS.iter().any(|c| c.starts_with(resp.text.as_str()))
                        }
                        _ => false,
                    };
                    assert!(ok, "{resp:?}");
                }
                if kind == Kind::Regex {
                    assert!(resp.text.bytes().all(|b| b.is_ascii_digit()), "{resp:?}");
                }
                Code::Ok
            }
            Err(s) => s.code(),
        },
    }
}

fn allowed(kind: Kind, code: Code) -> bool {
    match kind {
        Kind::Invalid => code == Code::InvalidArgument,
        Kind::Cancelled => code == Code::Cancelled,
        // tonic's client runs its own timer and answers CANCELLED locally
        // when it fires before the server's DEADLINE_EXCEEDED arrives (the
        // server's own answer is checked in `edge.rs` with a timer-less client).
        Kind::Deadline => matches!(code, Code::Ok | Code::DeadlineExceeded | Code::Cancelled),
        // A full queue is a legitimate answer under load.
        _ => matches!(code, Code::Ok | Code::ResourceExhausted),
    }
}

#[test]
fn soak_mixed_requests_leave_nothing_behind() {
    let total: usize = std::env::var("KESTREL_SOAK_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let clients: usize = std::env::var("KESTREL_SOAK_CLIENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24);
    let server = start_server(kestrel_engine::EngineConfig {
        max_batch_size: 16,
        max_waiting: 64,
        ..kestrel_engine::EngineConfig::default()
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let started = Instant::now();
    let tally = rt.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..clients {
            let server = server.clone();
            let share = total / clients + usize::from(w < total % clients);
            tasks.spawn(async move {
                let mut dice = Dice(0x5eed ^ (w as u64) << 17);
                let mut c = client(&server).await;
                let mut tally: BTreeMap<(Kind, i32), usize> = BTreeMap::new();
                for _ in 0..share {
                    let kind = kind_of(dice.below(100));
                    let req = request(kind, &mut dice);
                    // A hang is a failure, not a slow test.
                    let code = tokio::time::timeout(
                        Duration::from_secs(120),
                        run_one(&mut c, kind, req, &mut dice),
                    )
                    .await
                    .unwrap_or_else(|_| panic!("a {kind:?} request hung"));
                    assert!(allowed(kind, code), "{kind:?} answered {code:?}");
                    *tally.entry((kind, code as i32)).or_default() += 1;
                }
                tally
            });
        }
        let mut all: BTreeMap<(Kind, i32), usize> = BTreeMap::new();
        while let Some(t) = tasks.join_next().await {
            for (k, n) in t.expect("client task") {
                *all.entry(k).or_default() += n;
            }
        }
        all
    });
    let answered: usize = tally.values().sum();
    assert_eq!(answered, total, "every request answered exactly once");
    let elapsed = started.elapsed();
    for ((kind, code), n) in &tally {
        eprintln!("soak: {kind:?} {:?}: {n}", Code::from_i32(*code));
    }
    eprintln!(
        "soak: {total} requests from {clients} clients in {:.1} s",
        elapsed.as_secs_f64()
    );

    // Cancelled streams are aborted asynchronously: give the engine a moment.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info = server.engine.model_info();
        if info.num_admitted == 0 && info.num_running == 0 && info.num_waiting == 0 {
            // Published pages may stay cached for reuse; none is held.
            assert_eq!(info.kv_pages_used, 0, "{info:?}");
            let metrics = server.engine.metrics_text();
            for gauge in ["kestrel_running_sequences 0", "kestrel_kv_pages_used 0"] {
                assert!(metrics.contains(gauge), "{gauge} missing:\n{metrics}");
            }
            break;
        }
        assert!(Instant::now() < deadline, "engine not idle: {info:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        server.engine.health(),
        kestrel_engine::Health::Serving,
        "the engine keeps serving"
    );
}
