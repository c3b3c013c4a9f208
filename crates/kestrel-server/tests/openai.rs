//! End-to-end tests of the OpenAI-compatible HTTP API: the real engine and
//! default model served on `127.0.0.1:0`, called over HTTP/1.1 (hyper).
//! Greedy decoding and a few tokens per request keep the suite quick; one
//! server serves the whole binary.

mod common;
#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

use std::time::{Duration, Instant};

use common::http::{get, post, SseStream};
use common::shared_server;
use serde_json::{json, Value};

fn model_id() -> String {
    shared_server().engine.model_info().name
}

/// A greedy chat request (no `model`: the served one is the default).
fn chat_body(user: &str, max_tokens: u32) -> Value {
    json!({
        "messages": [{"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

/// The text a chat stream's chunks concatenate to, its finish reasons by
/// choice, and the usage chunk if one came.
fn stream_content(chunks: &[Value]) -> (Vec<String>, Vec<Option<String>>, Option<Value>) {
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
async fn completions_prompt_list_logprobs_and_stream() {
    let addr = shared_server().http_addr;
    let body = json!({
        "model": model_id(),
        "prompt": ["The capital of France is", "Water boils at"],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 2,
    });
    let r = post(addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    let mut texts = Vec::new();
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let lp = &c["logprobs"];
        let tokens = lp["tokens"].as_array().unwrap();
        assert!(!tokens.is_empty() && tokens.len() <= 6);
        assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), tokens.len());
        assert!(lp["top_logprobs"][0].as_object().unwrap().len() <= 2);
        assert_eq!(lp["text_offset"][0], 0);
        texts.push(c["text"].as_str().unwrap().to_string());
    }

    let mut sbody = body;
    sbody["stream"] = json!(true);
    let chunks = SseStream::open(addr, "/v1/completions", &sbody)
        .await
        .collect()
        .await;
    let (text, finish, usage) = stream_content(&chunks);
    assert_eq!(text, texts);
    assert!(finish.iter().all(Option::is_some));
    assert!(usage.is_none(), "no usage chunk unless asked");
}

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
    let server = common::start_server(kestrel_engine::EngineConfig::default());
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

#[tokio::test]
async fn json_schema_output_validates() {
    let addr = shared_server().http_addr;
    let mut body = chat_body("Describe a person as JSON.", 60);
    body["response_format"] = json!({"type": "json_schema", "json_schema": {
        "name": "person", "strict": true,
        "schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 120}
            },
            "required": ["name", "age"],
            "additionalProperties": false
        }
    }});
    let v = post(addr, "/v1/chat/completions", &body).await.json();
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "stop", "{v}");
    let content = c["message"]["content"].as_str().unwrap();
    let parsed: Value = serde_json::from_str(content).expect("the output parses");
    let obj = parsed.as_object().unwrap();
    assert_eq!(obj.len(), 2, "{parsed}");
    assert!(obj["name"].as_str().unwrap().chars().count() <= 12);
    assert!((0..=120).contains(&obj["age"].as_i64().unwrap()));
}

fn weather_tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
            },
            "required": ["city", "unit"],
            "additionalProperties": false
        }
    }}])
}

/// A chat request that must call `get_weather` exactly once.
fn weather_call_body(max_tokens: u32) -> Value {
    let mut body = chat_body("What is the weather in Paris?", max_tokens);
    body["tools"] = weather_tools();
    body["tool_choice"] = json!("required");
    body["parallel_tool_calls"] = json!(false);
    body
}

fn check_weather_args(arguments: &str) {
    let args: Value = serde_json::from_str(arguments).expect("arguments parse");
    let obj = args.as_object().unwrap();
    assert!(obj["city"].as_str().unwrap().chars().count() <= 20);
    assert!(matches!(
        obj["unit"].as_str(),
        Some("celsius" | "fahrenheit")
    ));
    assert_eq!(obj.len(), 2);
}

#[tokio::test]
async fn required_tool_call_parses_and_validates() {
    let addr = shared_server().http_addr;
    let mut body = weather_call_body(60);
    let v = post(addr, "/v1/chat/completions", &body).await.json();
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{v}");
    let calls = c["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let unary_args = calls[0]["function"]["arguments"].as_str().unwrap();
    check_weather_args(unary_args);
    // Compact: no whitespace outside strings (SmolLM2's template renders no
    // tools, so this is Kestrel's Hermes format).
    let parsed: Value = serde_json::from_str(unary_args).unwrap();
    assert_eq!(serde_json::to_string(&parsed).unwrap(), unary_args);

    // Streamed, in OpenAI's delta shape: the first delta of the call has
    // its index, id, type, name and empty arguments; the next ones its
    // index and argument fragments, which add up to the same arguments.
    body["stream"] = json!(true);
    let chunks = SseStream::open(addr, "/v1/chat/completions", &body)
        .await
        .collect()
        .await;
    let deltas: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .map(|d| {
            assert_eq!(d.as_array().unwrap().len(), 1, "{d}");
            &d[0]
        })
        .collect();
    assert!(deltas.len() >= 2, "{chunks:?}");
    let first = deltas[0];
    assert_eq!(first["index"], 0);
    assert!(first["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(first["type"], "function");
    assert_eq!(first["function"]["name"], "get_weather");
    assert_eq!(first["function"]["arguments"], "");
    let mut streamed_args = String::new();
    for d in &deltas[1..] {
        let keys: Vec<&str> = d.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, ["index", "function"], "{d}");
        assert_eq!(d["index"], 0);
        assert_eq!(d["function"].as_object().unwrap().len(), 1, "{d}");
        streamed_args.push_str(d["function"]["arguments"].as_str().unwrap());
    }
    assert_eq!(streamed_args, unary_args);
    let (_, finish, _) = stream_content(&chunks);
    assert_eq!(finish[0].as_deref(), Some("tool_calls"));

    // The tool's answer goes back through the template; `auto` may answer
    // in text or call again, and its grammar compiles.
    let call = calls[0].clone();
    let follow = json!({
        "messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "{\"temp\": 21}"}
        ],
        "tools": weather_tools(),
        "max_tokens": 40,
        "temperature": 0,
    });
    let v = post(addr, "/v1/chat/completions", &follow).await.json();
    let c = &v["choices"][0];
    match c["finish_reason"].as_str().unwrap() {
        "tool_calls" => {
            for call in c["message"]["tool_calls"].as_array().unwrap() {
                check_weather_args(call["function"]["arguments"].as_str().unwrap());
            }
        }
        "stop" | "length" => assert!(c["message"]["content"].is_string(), "{v}"),
        other => panic!("unexpected finish_reason {other}: {v}"),
    }
}

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

/// A constraint past the constraint engine's budget is a 400 naming its
/// parameter before any token, unary or streamed (never a 200 stream that
/// fails later), for a regex, a JSON-Schema `pattern` and a Lark rule
/// reached only after a first token; the server keeps serving.
#[tokio::test]
async fn constraints_past_the_budget_are_a_400_before_any_token() {
    let addr = shared_server().http_addr;
    let nested = "(.{1,100}){1,100}";
    let schema = json!({"type": "object", "required": ["b"],
        "properties": {"b": {"type": "string", "pattern": format!("^{nested}$")}}});
    for (extra, param) in [
        (json!({"guided_regex": nested}), "guided_regex"),
        (
            json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": schema}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"guided_grammar": format!("start: \"x\" X\nX: /{nested}/")}),
            "guided_grammar",
        ),
        (
            json!({"structured_outputs": {"regex": format!("x{nested}")}}),
            "structured_outputs.regex",
        ),
    ] {
        for stream in [false, true] {
            let mut body = chat_body("Say something", 16);
            body["stream"] = json!(stream);
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            let r = post(addr, "/v1/chat/completions", &body).await;
            let v = r.json();
            assert_eq!(r.status, 400, "{body} -> {v}");
            assert_eq!(v["error"]["param"], param, "{v}");
            let message = v["error"]["message"].as_str().unwrap();
            assert!(message.contains("too complex"), "{message}");
        }
    }
    let r = post(addr, "/v1/chat/completions", &chat_body("hi", 2)).await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// The legacy `functions` / `function_call` call a tool like `tools` /
/// `tool_choice` do (the answer in the `tool_calls` shape).
#[tokio::test]
async fn legacy_functions_call_a_tool() {
    let addr = shared_server().http_addr;
    let function = weather_tools()[0]["function"].clone();
    let mut body = chat_body("What is the weather in Paris?", 60);
    body["functions"] = json!([function]);
    body["function_call"] = json!({"name": "get_weather"});
    let v = post(addr, "/v1/chat/completions", &body).await.json();
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{v}");
    let call = &c["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather");
    check_weather_args(call["arguments"].as_str().unwrap());

    body["tools"] = weather_tools();
    let r = post(addr, "/v1/chat/completions", &body).await;
    assert_eq!(
        (r.status, r.json()["error"]["param"].clone()),
        (400, json!("functions"))
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

/// The synthetic Qwen3 GGUF of `scripts/reference/synthetic_fixtures.py`
/// (random weights, SmolLM2's tokenizer cut to 1024 tokens, Qwen3's chat
/// template), written into a fresh directory; `None` (skipped, saying so)
/// when `$KESTREL_PYTHON` lacks its packages and `KESTREL_REQUIRE_PYTHON`
/// is not set.
fn synthetic_qwen3() -> Option<std::path::PathBuf> {
    reference_python::synthetic_fixtures("the Qwen3-template tool test", "openai-qwen3", &["qwen3"])
        .map(|dir| dir.join("qwen3.gguf"))
}

/// A model whose template renders tools gets them from the template, and
/// its calls, in that template's format, come back parsed: Qwen3's
/// template on a tiny random-weight model (the grammar makes any model's
/// call valid).
#[test]
fn a_qwen3_template_renders_the_tools_and_its_calls_parse() {
    let Some(gguf) = synthetic_qwen3() else {
        return;
    };
    let server = common::start_server(kestrel_engine::EngineConfig {
        model: kestrel_engine::ModelSource::Path(gguf),
        ..kestrel_engine::EngineConfig::default()
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let question = "What is the weather in Paris?";
        let body = json!({
            "messages": [{"role": "user", "content": question}],
            "tools": weather_tools(),
            "tool_choice": "required",
            "parallel_tool_calls": false,
            "max_tokens": 400,
            "temperature": 0,
        });
        let v = post(server.http_addr, "/v1/chat/completions", &body)
            .await
            .json();
        // The prompt is the template's own rendering with the tools (its
        // "# Tools" block), not Kestrel's Hermes system prompt.
        let template = kestrel_model::ChatTemplate::new(
            include_str!("../../../tests/chat_templates/qwen3.jinja"),
            "",
            "<|im_end|>",
        )
        .unwrap();
        let tools = weather_tools().as_array().unwrap().clone();
        let want = template
            .render_with_tools(&[kestrel_model::ChatMessage::user(question)], &tools, true)
            .unwrap();
        assert!(want.contains("# Tools\n\nYou may call one or more functions"));
        let prompt_tokens = server.engine.tokenize(&want, false).unwrap().len();
        assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens, "{v}");

        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{v}");
        let calls = c["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{v}");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        check_weather_args(calls[0]["function"]["arguments"].as_str().unwrap());

        // The call and its result go back through the template.
        let follow = json!({
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": null, "tool_calls": [calls[0]]},
                {"role": "tool", "tool_call_id": calls[0]["id"], "content": "21 C"}
            ],
            "tools": weather_tools(),
            "max_tokens": 4,
            "temperature": 0,
        });
        let v = post(server.http_addr, "/v1/chat/completions", &follow)
            .await
            .json();
        assert!(v["choices"][0]["finish_reason"].is_string(), "{v}");
    });
}

/// A call cut by `max_tokens` is not lost: its text is the content, the
/// finish reason `length`, unary and streamed alike.
#[tokio::test]
async fn a_tool_call_cut_by_max_tokens_is_content() {
    let addr = shared_server().http_addr;
    let mut body = weather_call_body(80);
    let whole = post(addr, "/v1/chat/completions", &body).await.json();
    assert_eq!(
        whole["choices"][0]["finish_reason"], "tool_calls",
        "{whole}"
    );
    // Greedy: half the tokens are a prefix of the same call, cut inside it.
    let half = whole["usage"]["completion_tokens"].as_u64().unwrap() / 2;
    assert!(half > 8, "{whole}");
    body["max_tokens"] = json!(half);
    let v = post(addr, "/v1/chat/completions", &body).await.json();
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "length", "{v}");
    assert!(c["message"].get("tool_calls").is_none(), "{v}");
    let content = c["message"]["content"].as_str().unwrap();
    assert!(
        content.starts_with("<tool_call>\n{\"name\":\"get_weather\",\"arguments\":"),
        "{v}"
    );
    assert_eq!(v["usage"]["completion_tokens"], half);

    // Cut before the call's JSON begins: still the text, never empty.
    body["max_tokens"] = json!(2);
    let v = post(addr, "/v1/chat/completions", &body).await.json();
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "length", "{v}");
    assert!(!c["message"]["content"].as_str().unwrap().is_empty(), "{v}");
    body["max_tokens"] = json!(half);

    body["stream"] = json!(true);
    let chunks = SseStream::open(addr, "/v1/chat/completions", &body)
        .await
        .collect()
        .await;
    let (text, finish, _) = stream_content(&chunks);
    assert_eq!(finish[0].as_deref(), Some("length"));
    assert_eq!(text[0], content);
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
            chat(json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})),
            400,
            Some("messages[0].content[0].type"),
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
        common::http::call(addr, "POST", "/v1/chat/completions", body.to_vec())
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
    let r = common::http::call(addr, "POST", "/v1/chat/completions", huge).await;
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

async fn tokenize(body: Value) -> Value {
    let r = post(shared_server().http_addr, "/tokenize", &body).await;
    assert_eq!(r.status, 200, "{body} -> {}", r.text());
    r.json()
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v["tokens"].clone()).unwrap()
}

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

/// A greedy completions request's body.
fn completion_body(prompt: Value, max_tokens: u32) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

async fn complete(body: &Value) -> Value {
    let r = post(shared_server().http_addr, "/v1/completions", body).await;
    assert_eq!(r.status, 200, "{body} -> {}", r.text());
    r.json()
}

#[tokio::test]
async fn token_id_prompts_answer_as_their_text_does() {
    let addr = shared_server().http_addr;
    let (a, b) = ("The capital of France is", "Once upon a time");
    let (ta, tb) = (
        ids(&tokenize(json!({"prompt": a})).await),
        ids(&tokenize(json!({"prompt": b})).await),
    );
    let text = complete(&completion_body(json!([a, b]), 8)).await;
    let one = complete(&completion_body(json!(ta), 8)).await;
    assert_eq!(one["choices"][0]["text"], text["choices"][0]["text"]);
    assert_eq!(one["usage"]["prompt_tokens"], ta.len());
    let both = complete(&completion_body(json!([ta, tb]), 8)).await;
    assert_eq!(both["choices"], text["choices"]);
    assert_eq!(both["usage"], text["usage"]);

    let vocab = shared_server().engine.model_info().vocab_size;
    let r = post(
        addr,
        "/v1/completions",
        &completion_body(json!([1, vocab, 2]), 4),
    )
    .await;
    let v = r.json();
    assert_eq!(r.status, 400, "{v}");
    assert_eq!(v["error"]["param"], "prompt");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("token 1"),
        "{v}"
    );
}

#[tokio::test]
async fn echo_puts_the_prompt_first_unary_and_streamed() {
    let addr = shared_server().http_addr;
    let prompt = "Roses are red, violets are";
    let plain = complete(&completion_body(json!(prompt), 6)).await;
    let generated = plain["choices"][0]["text"].as_str().unwrap();
    assert!(!generated.is_empty());
    let mut body = completion_body(json!(prompt), 6);
    body["echo"] = json!(true);
    let v = complete(&body).await;
    assert_eq!(v["choices"][0]["text"], format!("{prompt}{generated}"));
    assert_eq!(v["usage"], plain["usage"]);

    // Token ids echo as their text.
    let tokens = ids(&tokenize(json!({"prompt": prompt, "add_special_tokens": false})).await);
    body["prompt"] = json!(tokens);
    let v = complete(&body).await;
    assert!(
        v["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with(prompt),
        "{v}"
    );

    // Streamed: the echo is each choice's first chunk.
    let mut sbody = completion_body(json!([prompt, "Twinkle twinkle"]), 6);
    sbody["echo"] = json!(true);
    sbody["n"] = json!(2);
    let unary = complete(&sbody).await;
    sbody["stream"] = json!(true);
    let s = SseStream::open(addr, "/v1/completions", &sbody).await;
    assert_eq!(s.status, 200);
    let chunks = s.collect().await;
    let firsts: Vec<&Value> = (0..4)
        .map(|i| {
            chunks
                .iter()
                .flat_map(|c| c["choices"].as_array().unwrap())
                .find(|ch| ch["index"] == i)
                .unwrap()
        })
        .collect();
    for (i, first) in firsts.iter().enumerate() {
        let p = if i < 2 { prompt } else { "Twinkle twinkle" };
        assert_eq!(first["text"], p, "choice {i}'s first chunk is its prompt");
        assert!(first["finish_reason"].is_null());
    }
    let (text, finish, _) = stream_content(&chunks);
    let expect: Vec<String> = unary["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, expect);
    assert!(finish.iter().all(Option::is_some));
}

/// Long enough to fill a KV page (the second request's prefix-cache hit).
const CAPITALS: &str = "The capital of France is Paris. The capital of Germany is Berlin. \
                        The capital of Italy is Rome. The capital of Spain is";

/// `echo` with `logprobs`: the prompt tokens' logprobs come first (the
/// first null), and they line up: a prompt made of a greedy completion's
/// prompt and output scores the output tokens as generation sampled them.
/// The same prompt again (a prefix-cache hit) scores the same, and
/// `max_tokens: 0` scores it without generating.
#[tokio::test]
async fn echo_with_logprobs_scores_the_prompt_first() {
    let engine = &shared_server().engine;
    let prompt = ids(&tokenize(json!({"prompt": CAPITALS})).await);
    let n = 5;
    let mut req = kestrel_engine::GenerateRequest {
        input: kestrel_engine::Prompt::Tokens(prompt.clone()),
        ..kestrel_engine::GenerateRequest::text("", n)
    };
    req.sampling.logprobs = true;
    req.speculate = kestrel_engine::Speculation::Off;
    let gen = engine.generate(req).await.unwrap();
    assert_eq!(gen.token_ids.len(), n as usize);
    let all: Vec<u32> = prompt.iter().chain(&gen.token_ids).copied().collect();

    let mut body = completion_body(json!(all), 1);
    body["echo"] = json!(true);
    body["logprobs"] = json!(2);
    let v = complete(&body).await;
    let again = complete(&body).await;
    let lp = &v["choices"][0]["logprobs"];
    let token_logprobs = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(
        token_logprobs.len(),
        all.len() + 1,
        "prompt tokens + 1 generated"
    );
    assert_eq!(v["usage"]["prompt_tokens"], all.len());
    for key in ["tokens", "top_logprobs", "text_offset"] {
        assert_eq!(lp[key].as_array().unwrap().len(), all.len() + 1, "{key}");
    }
    assert!(token_logprobs[0].is_null(), "{lp}");
    assert_eq!(lp["top_logprobs"][0], json!({}));
    for (i, l) in token_logprobs.iter().enumerate().skip(1) {
        let l = l.as_f64().unwrap();
        assert!(l.is_finite() && l <= 0.0, "position {i}: {l}");
        assert!(lp["top_logprobs"][i].as_object().unwrap().len() <= 2);
    }
    let offsets: Vec<u64> = serde_json::from_value(lp["text_offset"].clone()).unwrap();
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    let tokens: Vec<String> = serde_json::from_value(lp["tokens"].clone()).unwrap();
    assert_eq!(tokens.concat(), text, "the tokens spell the echoed text");
    for (k, g) in gen.logprobs.iter().enumerate() {
        let scored = token_logprobs[prompt.len() + k].as_f64().unwrap();
        assert!(
            (scored - f64::from(g.logprob)).abs() < 1e-4,
            "generated token {k}: scored {scored}, sampled {}",
            g.logprob
        );
        assert_eq!(tokens[prompt.len() + k], g.text);
    }
    assert_eq!(again["choices"][0]["logprobs"], v["choices"][0]["logprobs"]);
    assert!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );

    // max_tokens 0: the prompt scored and echoed, nothing generated.
    body["max_tokens"] = json!(0);
    let only = complete(&body).await;
    let c = &only["choices"][0];
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(only["usage"]["completion_tokens"], 0);
    assert_eq!(
        c["logprobs"]["token_logprobs"].as_array().unwrap()[..],
        token_logprobs[..all.len()]
    );
    assert_eq!(
        c["text"].as_str().unwrap().len(),
        offsets[all.len()] as usize
    );
    body["max_tokens"] = json!(1);

    // Without echo only the generated token has logprobs.
    body["echo"] = json!(false);
    let plain = complete(&body).await;
    let plain_lps = &plain["choices"][0]["logprobs"]["token_logprobs"];
    assert_eq!(plain_lps.as_array().unwrap().len(), 1);
    assert_eq!(plain_lps[0], token_logprobs[all.len()]);
}

#[tokio::test]
async fn models_health_version_and_metrics() {
    let addr = shared_server().http_addr;
    let v = get(addr, "/v1/models").await.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], model_id());
    assert_eq!(v["data"][0]["object"], "model");
    // The id may hold characters a path must escape.
    let escaped: String = model_id()
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    let r = get(addr, &format!("/v1/models/{escaped}")).await;
    assert_eq!(r.status, 200);
    assert_eq!(get(addr, "/v1/models/gpt-4").await.status, 404);
    let r = get(addr, "/health").await;
    assert_eq!(
        (r.status, r.json()["status"].clone()),
        (200, json!("serving"))
    );
    assert_eq!(
        get(addr, "/version").await.json()["version"],
        env!("CARGO_PKG_VERSION")
    );
    let r = get(addr, "/metrics").await;
    assert_eq!(r.status, 200);
    assert!(r.content_type.starts_with("text/plain"));
    assert!(r.text().contains("kestrel_"), "{}", r.text());
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_its_kv() {
    // Its own engine, so that no other test's requests hold KV.
    let server = common::start_server(kestrel_engine::EngineConfig::default());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut body = chat_body("Count to one thousand.", 2000);
        body["model"] = json!(server.engine.model_info().name);
        body["ignore_eos"] = json!(true);
        body["stream"] = json!(true);
        let mut s = SseStream::open(server.http_addr, "/v1/chat/completions", &body).await;
        assert_eq!(s.status, 200);
        // The role chunk, then real output: the request is decoding.
        for _ in 0..3 {
            s.next_data().await.expect("a chunk");
        }
        let info = server.engine.model_info();
        assert_eq!(info.num_admitted, 1);
        assert!(info.kv_pages_used > 0);
        drop(s);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let info = server.engine.model_info();
            if info.num_admitted == 0 && info.kv_pages_used == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "KV still held after the client left: {info:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}
