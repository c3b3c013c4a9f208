//! `/tokenize` and `/detokenize`: text, chat messages and ids round trip.

use crate::common::http::post;
use crate::common::openai::{ids, model_id, tokenize};
use crate::common::shared_server;
use serde_json::{json, Value};

#[tokio::test]
async fn tokenize_and_detokenize_round_trip() {
    let addr = shared_server().http_addr;
    let info = shared_server().engine.model_info();
    let text = "The quick brown fox jumps over the lazy dog.";
    let v = tokenize(json!({"model": model_id(), "prompt": text, "return_token_strs": true})).await;
    let tokens = ids(&v);
    assert!(tokens.len() > 5);
    assert_eq!(v["count"], tokens.len());
    assert_eq!(v["max_model_len"], info.context_length);
    let strs = v["token_strs"].as_array().unwrap();
    assert_eq!(strs.len(), tokens.len());
    assert!(strs
        .iter()
        .all(|s| s.as_str().is_some_and(|s| !s.is_empty())));
    // What the engine itself tokenizes a text prompt to.
    assert_eq!(tokens, shared_server().engine.tokenize(text, true).unwrap());
    let plain = ids(&tokenize(json!({"prompt": text, "add_special_tokens": false})).await);
    assert!(tokens.ends_with(&plain));
    assert!(tokenize(json!({"prompt": text})).await["token_strs"].is_null());

    let r = post(addr, "/detokenize", &json!({"tokens": plain})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json(), json!({"prompt": text}));

    // Messages: the chat template, with and without the generation prompt;
    // the first is exactly what a chat request's prompt counts.
    let messages = json!([{"role": "user", "content": "Hello there"}]);
    let with = ids(&tokenize(json!({"messages": messages})).await);
    let without =
        ids(&tokenize(json!({"messages": messages, "add_generation_prompt": false})).await);
    assert!(with.len() > without.len() && with.starts_with(&without));
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.json()["usage"]["prompt_tokens"], with.len());

    let vocab = info.vocab_size;
    let cases: Vec<(&str, Value, u16, Option<&str>)> = vec![
        ("/tokenize", json!({}), 400, Some("prompt")),
        ("/tokenize", json!({"prompt": 5}), 400, Some("prompt")),
        (
            "/tokenize",
            json!({"prompt": "x", "frob": 1}),
            400,
            Some("frob"),
        ),
        (
            "/tokenize",
            json!({"prompt": "x", "messages": messages}),
            400,
            Some("messages"),
        ),
        (
            "/tokenize",
            json!({"messages": "hi"}),
            400,
            Some("messages"),
        ),
        (
            "/tokenize",
            json!({"prompt": "x", "model": "gpt-4"}),
            404,
            Some("model"),
        ),
        ("/detokenize", json!({}), 400, Some("tokens")),
        (
            "/detokenize",
            json!({"tokens": [1, vocab]}),
            400,
            Some("tokens[1]"),
        ),
        ("/detokenize", json!({"tokens": [-1]}), 400, Some("tokens")),
    ];
    for (path, body, status, param) in cases {
        let r = post(addr, path, &body).await;
        let v = r.json();
        assert_eq!(r.status, status, "{path} {body} -> {v}");
        assert_eq!(v["error"]["param"].as_str(), param, "{path} {body} -> {v}");
    }
}
