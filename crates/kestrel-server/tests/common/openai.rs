//! Request builders and readers for the OpenAI-compatible HTTP API's tests
//! (the `openai` binary's feature files): greedy chat and completions
//! bodies against [`shared_server`], a chat or completions stream's text,
//! finish reasons and usage, and `/tokenize`.

use serde_json::{json, Value};

use super::http::post;
use super::shared_server;

pub fn model_id() -> String {
    shared_server().engine.model_info().name
}

/// A greedy chat request (no `model`: the served one is the default).
pub fn chat_body(user: &str, max_tokens: u32) -> Value {
    json!({
        "messages": [{"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

/// The text a chat stream's chunks concatenate to, its finish reasons by
/// choice, and the usage chunk if one came.
pub fn stream_content(chunks: &[Value]) -> (Vec<String>, Vec<Option<String>>, Option<Value>) {
    let mut text = Vec::new();
    let mut finish = Vec::new();
    let mut usage = None;
    for c in chunks {
        assert!(c.get("error").is_none(), "error chunk: {c}");
        if let Some(u) = c.get("usage").filter(|u| !u.is_null()) {
            assert_eq!(c["choices"], json!([]), "the usage chunk has no choices");
            usage = Some(u.clone());
        }
        for ch in c["choices"].as_array().unwrap() {
            let i = ch["index"].as_u64().unwrap() as usize;
            if text.len() <= i {
                text.resize(i + 1, String::new());
                finish.resize(i + 1, None);
            }
            let piece = ch["delta"]["content"]
                .as_str()
                .or_else(|| ch["text"].as_str())
                .unwrap_or_default();
            text[i].push_str(piece);
            if let Some(f) = ch["finish_reason"].as_str() {
                assert!(finish[i].is_none(), "two finish reasons for choice {i}");
                finish[i] = Some(f.to_string());
            }
        }
    }
    (text, finish, usage)
}

pub async fn tokenize(body: Value) -> Value {
    let r = post(shared_server().http_addr, "/tokenize", &body).await;
    assert_eq!(r.status, 200, "{body} -> {}", r.text());
    r.json()
}

pub fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v["tokens"].clone()).unwrap()
}

/// A greedy completions request's body.
pub fn completion_body(prompt: Value, max_tokens: u32) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

pub async fn complete(body: &Value) -> Value {
    let r = post(shared_server().http_addr, "/v1/completions", body).await;
    assert_eq!(r.status, 200, "{body} -> {}", r.text());
    r.json()
}
