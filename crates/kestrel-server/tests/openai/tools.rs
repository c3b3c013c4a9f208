//! Tool calls: a required call parses and validates against its schema,
//! legacy `functions` call a tool, a Qwen3 template renders the tools and
//! its calls parse, and a call cut by `max_tokens` comes back as content.

use crate::common::http::{post, SseStream};
use crate::common::openai::{chat_body, stream_content};
use crate::common::shared_server;
use crate::reference_python;
use serde_json::{json, Value};

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
    let server = crate::common::start_server(kestrel_engine::EngineConfig {
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
            include_str!("../../../../tests/chat_templates/qwen3.jinja"),
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
