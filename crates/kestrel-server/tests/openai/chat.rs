//! Chat completions: unary and streamed answers agree (text, finish reason,
//! usage), `n` choices reproduce with a seed, and `n` samples share their
//! prompt's KV prefix.

use std::time::Duration;

use crate::common::http::{post, SseStream};
use crate::common::openai::{chat_body, model_id, stream_content};
use crate::common::shared_server;
use serde_json::{json, Value};

#[tokio::test]
async fn chat_unary_and_streamed_agree() {
    let addr = shared_server().http_addr;
    let mut body = chat_body("Name three colours.", 12);
    body["model"] = json!(model_id());
    let r = post(addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.content_type.starts_with("application/json"));
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], model_id());
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let unary = choice["message"]["content"].as_str().unwrap().to_string();
    assert!(!unary.is_empty());
    assert!(matches!(
        choice["finish_reason"].as_str(),
        Some("stop" | "length")
    ));
    let usage = &v["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 0);
    let completion = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=12).contains(&completion));
    assert_eq!(
        usage["total_tokens"],
        usage["prompt_tokens"].as_u64().unwrap() + completion
    );
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let s = SseStream::open(addr, "/v1/chat/completions", &sbody).await;
    assert_eq!(s.status, 200);
    let chunks = s.collect().await;
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"]));
    let (text, finish, usage) = stream_content(&chunks);
    assert_eq!(
        text,
        vec![unary],
        "streamed deltas concatenate to the unary text"
    );
    assert_eq!(finish[0].as_deref(), choice["finish_reason"].as_str());
    let usage = usage.expect("include_usage sends a usage chunk");
    assert_eq!(usage["completion_tokens"].as_u64(), Some(completion));
}

#[tokio::test]
async fn n_choices_with_a_seed_reproduce() {
    let addr = shared_server().http_addr;
    let body = json!({
        "messages": [{"role": "user", "content": "Tell me a word."}],
        "max_completion_tokens": 8,
        "temperature": 1.0,
        "seed": 42,
        "n": 3,
    });
    let texts = |v: Value| -> Vec<String> {
        let choices = v["choices"].as_array().unwrap().clone();
        assert_eq!(choices.len(), 3);
        choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                assert_eq!(c["index"], i);
                c["message"]["content"].as_str().unwrap().to_string()
            })
            .collect()
    };
    let a = texts(post(addr, "/v1/chat/completions", &body).await.json());
    let b = texts(post(addr, "/v1/chat/completions", &body).await.json());
    assert_eq!(a, b, "a seed reproduces every choice");
    assert!(
        a[0] != a[1] || a[1] != a[2],
        "choices are distinct samples: {a:?}"
    );
}

/// The samples of one prompt share its KV: one engine request with `n`,
/// whose other samples fork from the first once its prompt is launched and
/// share its full pages (or, had it ended first, hit them in the prefix
/// cache). A server of its own, so the engine's counters are this test's;
/// a request decoding in the background keeps the engine stepping, so the
/// three samples would land in one prefill if nothing held two back.
#[tokio::test]
async fn n_samples_share_the_prompt_prefix() {
    let server = crate::common::start_server(kestrel_engine::EngineConfig::default());
    let addr = server.http_addr;
    let background = tokio::spawn(async move {
        let body = json!({"prompt": "Count:", "max_tokens": 48, "ignore_eos": true});
        post(addr, "/v1/completions", &body).await.json()
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let story = "Kestrels hover over fields and dive on voles. ".repeat(12);
    let body = json!({
        "prompt": story,
        "max_tokens": 2,
        "temperature": 0.7,
        "seed": 1,
        "n": 3,
    });
    let r = post(addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["choices"].as_array().unwrap().len(), 3);
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt >= 100, "{prompt}");
    let bg = background.await.unwrap();
    assert_eq!(bg["choices"][0]["finish_reason"], "length", "{bg}");
    let bg_prompt = bg["usage"]["prompt_tokens"].as_u64().unwrap();
    // Samples 2 and 3 share every full 16-token page of the prompt but
    // the last token's.
    let text = server.engine.metrics_text();
    let metric = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("metric {name}"))
            .trim()
            .parse()
            .unwrap()
    };
    let shared = metric("kestrel_fork_shared_prompt_tokens_total");
    let hits = metric("kestrel_prefix_cache_hit_rate") * (3 * prompt + bg_prompt) as f64;
    let floor = 2 * ((prompt - 1) / 16 * 16);
    assert!(
        shared + hits >= floor as f64 - 1e-6,
        "{shared} shared + {hits} hit < {floor}\n{text}"
    );
}
