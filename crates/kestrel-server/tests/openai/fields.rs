//! Request fields: every OpenAI field is honoured, ignored or refused by
//! name, and every invalid one is a typed 4xx after which the server keeps
//! serving.

use crate::common::http::{get, post};
use crate::common::openai::chat_body;
use crate::common::shared_server;
use serde_json::{json, Value};

/// Every OpenAI request field either works or is a 400 naming it: the ones
/// that cannot change a text model's output are accepted and ignored (the
/// answer is the one without them), the ones Kestrel cannot honour are
/// `unsupported_parameter`.
#[tokio::test]
async fn openai_fields_are_honoured_ignored_or_refused_by_name() {
    let addr = shared_server().http_addr;
    let plain = post(addr, "/v1/chat/completions", &chat_body("Name a fruit.", 8))
        .await
        .json();
    let mut body = chat_body("Name a fruit.", 8);
    for (k, v) in json!({
        "user": "u-1", "store": false, "metadata": {"run": "t"}, "service_tier": "auto",
        "prompt_cache_key": "k", "prompt_cache_retention": "in-memory",
        "safety_identifier": "s-1", "reasoning_effort": "low", "verbosity": "low",
        "modalities": ["text"], "n": 1, "best_of": 1, "audio": null, "prediction": null,
    })
    .as_object()
    .unwrap()
    {
        body[k] = v.clone();
    }
    let r = post(addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["choices"][0]["message"]["content"],
        plain["choices"][0]["message"]["content"]
    );
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 2, "user": "u", "best_of": 2, "n": 2, "suffix": ""}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());

    for (endpoint, extra, param) in [
        (
            "chat/completions",
            json!({"audio": {"voice": "alloy", "format": "mp3"}}),
            "audio",
        ),
        (
            "chat/completions",
            json!({"prediction": {"type": "content", "content": "x"}}),
            "prediction",
        ),
        (
            "chat/completions",
            json!({"web_search_options": {}}),
            "web_search_options",
        ),
        (
            "chat/completions",
            json!({"modalities": ["text", "audio"]}),
            "modalities",
        ),
        ("chat/completions", json!({"best_of": 2}), "best_of"),
        ("completions", json!({"suffix": " end"}), "suffix"),
    ] {
        let mut body = match endpoint {
            "completions" => json!({"prompt": "Hello", "max_tokens": 2}),
            _ => chat_body("hi", 2),
        };
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = post(addr, &format!("/v1/{endpoint}"), &body).await;
        let v = r.json();
        assert_eq!(r.status, 400, "{body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        assert_eq!(v["error"]["code"], "unsupported_parameter", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
    for (extra, param) in [
        (json!({"reasoning_effort": "maximal"}), "reasoning_effort"),
        (json!({"metadata": ["x"]}), "metadata"),
        (json!({"frobnicate": true}), "frobnicate"),
        (json!({"min_tokens": 9}), "min_tokens"),
        (
            json!({"min_tokens": 1, "guided_regex": "[a-z]+"}),
            "min_tokens",
        ),
    ] {
        let mut body = chat_body("hi", 4);
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = post(addr, "/v1/chat/completions", &body).await;
        let v = r.json();
        assert_eq!(r.status, 400, "{body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
}

#[tokio::test]
async fn every_invalid_field_is_a_typed_4xx_and_the_server_keeps_serving() {
    let addr = shared_server().http_addr;
    let chat = |extra: Value| {
        let mut b = chat_body("hi", 4);
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let cases: Vec<(&str, Value, u16, Option<&str>)> = vec![
        (
            "chat/completions",
            chat(json!({"temperature": 101})),
            400,
            Some("temperature"),
        ),
        (
            "chat/completions",
            chat(json!({"temperature": -1})),
            400,
            Some("temperature"),
        ),
        (
            "chat/completions",
            chat(json!({"temperature": "hot"})),
            400,
            Some("temperature"),
        ),
        (
            "chat/completions",
            chat(json!({"top_p": 0})),
            400,
            Some("top_p"),
        ),
        (
            "chat/completions",
            chat(json!({"top_p": 1e40})),
            400,
            Some("top_p"),
        ),
        (
            "chat/completions",
            chat(json!({"presence_penalty": 3})),
            400,
            Some("presence_penalty"),
        ),
        (
            "chat/completions",
            chat(json!({"frequency_penalty": -2.5})),
            400,
            Some("frequency_penalty"),
        ),
        (
            "chat/completions",
            chat(json!({"repetition_penalty": 0})),
            400,
            Some("repetition_penalty"),
        ),
        (
            "chat/completions",
            chat(json!({"min_p": 2})),
            400,
            Some("min_p"),
        ),
        (
            "chat/completions",
            chat(json!({"top_k": -5})),
            400,
            Some("top_k"),
        ),
        (
            "chat/completions",
            chat(json!({"max_tokens": 0})),
            400,
            Some("max_tokens"),
        ),
        (
            "chat/completions",
            chat(json!({"max_tokens": -3})),
            400,
            Some("max_tokens"),
        ),
        (
            "chat/completions",
            chat(json!({"max_completion_tokens": 0})),
            400,
            Some("max_completion_tokens"),
        ),
        (
            "chat/completions",
            chat(json!({"max_tokens": 100_000_000})),
            400,
            Some("max_tokens"),
        ),
        (
            "chat/completions",
            chat(json!({"top_logprobs": 21})),
            400,
            Some("top_logprobs"),
        ),
        ("chat/completions", chat(json!({"n": 0})), 400, Some("n")),
        ("chat/completions", chat(json!({"n": 17})), 400, Some("n")),
        (
            "chat/completions",
            chat(json!({"seed": "x"})),
            400,
            Some("seed"),
        ),
        (
            "chat/completions",
            chat(json!({"stop": [""]})),
            400,
            Some("stop[0]"),
        ),
        (
            "chat/completions",
            chat(json!({"stop": vec!["x"; 17]})),
            400,
            Some("stop"),
        ),
        (
            "chat/completions",
            chat(json!({"logit_bias": {"42": 100.5}})),
            400,
            Some("logit_bias"),
        ),
        (
            "chat/completions",
            chat(json!({"logit_bias": {"forty-two": 5}})),
            400,
            Some("logit_bias"),
        ),
        (
            "chat/completions",
            chat(json!({"best_of": 2})),
            400,
            Some("best_of"),
        ),
        (
            "chat/completions",
            chat(json!({"messages": []})),
            400,
            Some("messages"),
        ),
        (
            "chat/completions",
            chat(json!({"messages": "hi"})),
            400,
            Some("messages"),
        ),
        (
            "chat/completions",
            chat(json!({"messages": [{"role": "wizard", "content": "x"}]})),
            400,
            Some("messages[0].role"),
        ),
        (
            "chat/completions",
            chat(json!({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]})),
            400,
            Some("messages[0].content[0].type"),
        ),
        (
            "chat/completions",
            chat(json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})),
            400,
            Some("messages[0].content[0].image_url"),
        ),
        (
            "chat/completions",
            chat(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}),
            ),
            400,
            Some("response_format.json_schema.schema"),
        ),
        (
            "chat/completions",
            chat(json!({"guided_regex": "("})),
            400,
            Some("guided_regex"),
        ),
        (
            "chat/completions",
            chat(json!({"guided_choice": []})),
            400,
            Some("guided_choice"),
        ),
        (
            "chat/completions",
            chat(json!({"guided_json": {"type": "object"}, "stop": ["x"]})),
            400,
            Some("guided_json"),
        ),
        (
            "chat/completions",
            chat(json!({"tool_choice": "required"})),
            400,
            Some("tool_choice"),
        ),
        (
            "chat/completions",
            chat(json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]})),
            400,
            Some("tools[0].function.name"),
        ),
        (
            "chat/completions",
            chat(json!({"model": "gpt-4o"})),
            404,
            Some("model"),
        ),
        ("completions", json!({"prompt": ""}), 400, Some("prompt")),
        (
            "completions",
            json!({"prompt": ["ok", ""]}),
            400,
            Some("prompt[1]"),
        ),
        (
            "completions",
            json!({"prompt": "x", "logprobs": 21}),
            400,
            Some("logprobs"),
        ),
        (
            "completions",
            json!({"prompt": [[1, 2], [1, 4_000_000_000u32]]}),
            400,
            Some("prompt[1]"),
        ),
        (
            "completions",
            json!({"prompt": [4_000_000_000u32]}),
            400,
            Some("prompt"),
        ),
        (
            "completions",
            json!({"prompt": [1, -2]}),
            400,
            Some("prompt"),
        ),
        (
            "completions",
            json!({"prompt": [[]]}),
            400,
            Some("prompt[0]"),
        ),
        (
            "completions",
            json!({"prompt": "x", "echo": true, "logprobs": 1, "stream": true}),
            400,
            Some("echo"),
        ),
        ("completions", json!({}), 400, Some("prompt")),
    ];
    for (endpoint, body, status, param) in cases {
        let r = post(addr, &format!("/v1/{endpoint}"), &body).await;
        let v = r.json();
        assert_eq!(r.status, status, "{body} -> {v}");
        assert_eq!(v["error"]["param"].as_str(), param, "{body} -> {v}");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
        assert!(v["error"]["type"].is_string());
    }

    let raw = |body: &'static [u8]| {
        crate::common::http::call(addr, "POST", "/v1/chat/completions", body.to_vec())
    };
    for body in [
        &b"{"[..],
        b"",
        b"[1, 2]",
        b"null",
        b"{\"messages\": NaN}",
        b"\xff\xfe",
    ] {
        let r = raw(body).await;
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(body));
        assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    }
    let huge = vec![b' '; kestrel_server::openai::MAX_BODY_BYTES + 1];
    let r = crate::common::http::call(addr, "POST", "/v1/chat/completions", huge).await;
    assert_eq!(r.status, 413);
    assert_eq!(r.json()["error"]["code"], "request_too_large");
    let r = get(addr, "/v1/chat/completions").await;
    assert_eq!(r.status, 405);
    let r = get(addr, "/v1/nothing").await;
    assert_eq!(r.status, 404);
    assert!(r.json()["error"].is_object());

    // Still serving.
    let r = post(addr, "/v1/chat/completions", &chat_body("hi", 2)).await;
    assert_eq!(r.status, 200, "{}", r.text());
}
