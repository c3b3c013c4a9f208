//! Sampling controls over HTTP: `logit_bias` bans and forces tokens, and
//! `min_tokens` holds EOS and stop strings back.

use crate::common::http::post;
use crate::common::openai::chat_body;
use crate::common::shared_server;
use serde_json::{json, Value};

#[tokio::test]
async fn logit_bias_bans_and_forces_tokens() {
    let server = shared_server();
    let (addr, engine) = (server.http_addr, &server.engine);
    let complete = |bias: Value| {
        let body = json!({
            "prompt": "The capital of France is",
            "max_tokens": 3,
            "temperature": 0,
            "logit_bias": bias,
        });
        async move {
            let r = post(addr, "/v1/completions", &body).await;
            assert_eq!(r.status, 200, "{}", r.text());
            r.json()["choices"][0]["text"].as_str().unwrap().to_string()
        }
    };
    let plain = complete(json!({})).await;
    let first = engine.tokenize(&plain, false).unwrap()[0];
    // -100 bans the greedy first token.
    let banned = complete(json!({ first.to_string(): -100 })).await;
    assert_ne!(
        engine.tokenize(&banned, false).unwrap()[0],
        first,
        "{banned:?}"
    );
    // +100 makes one token win every step.
    let forced = engine.tokenize(" falcon", false).unwrap()[0];
    let text = complete(json!({ forced.to_string(): 100 })).await;
    assert_eq!(text, engine.detokenize(&[forced; 3], true).unwrap());

    // Out of the vocabulary: a 400 naming the parameter and the token.
    let vocab = engine.model_info().vocab_size;
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 1, "logit_bias": { vocab.to_string(): 1 }}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    let e = &r.json()["error"];
    assert_eq!(e["param"], "logit_bias");
    assert!(
        e["message"].as_str().unwrap().contains(&vocab.to_string()),
        "{e}"
    );
}

/// vLLM's `min_tokens`: EOS cannot end the answer early, and a stop string
/// that would match at once is not looked for before that many tokens.
#[tokio::test]
async fn min_tokens_holds_eos_and_stop_strings_back() {
    let addr = shared_server().http_addr;
    let usage = |v: &Value| v["usage"]["completion_tokens"].as_u64().unwrap();
    // Without it, the model ends its short answer well before 48 tokens.
    let body = chat_body("Say hello.", 48);
    let short = post(addr, "/v1/chat/completions", &body).await.json();
    assert_eq!(short["choices"][0]["finish_reason"], "stop", "{short}");
    assert!(usage(&short) < 40, "{short}");
    let mut body = body;
    body["min_tokens"] = json!(48);
    let v = post(addr, "/v1/chat/completions", &body).await.json();
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(usage(&v), 48, "{v}");

    // Counting: the stop "," fires on the first token without min_tokens.
    let counting =
        json!({"prompt": "1, 2, 3, 4, 5, 6", "max_tokens": 24, "temperature": 0, "stop": [","]});
    let v = post(addr, "/v1/completions", &counting).await.json();
    assert!(usage(&v) <= 2, "{v}");
    let mut body = counting;
    body["min_tokens"] = json!(6);
    let v = post(addr, "/v1/completions", &body).await.json();
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "stop", "{v}");
    assert!(usage(&v) >= 6, "{v}");
    assert!(c["text"].as_str().unwrap().contains(','), "{v}");
}
