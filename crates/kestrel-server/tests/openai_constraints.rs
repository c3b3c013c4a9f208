//! End-to-end tests of what the HTTP API holds a model to and refuses up
//! front: a constraint too big to compile is a 400 naming its parameter
//! before any token (unary and streamed), tool arguments and
//! `response_format` objects hold only the properties their schema lists
//! (unless the request asks for plain JSON Schema), and a broken
//! `--chat-template` says why. The real engine and default model, greedy.

mod common;

use common::http::{post, SseStream};
use common::{shared_server, start_server};
use serde_json::{json, Value};

fn chat_body(user: &str, max_tokens: u32) -> Value {
    json!({
        "messages": [{"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

/// `(a{1000}){1000}` forces a million bytes: as `guided_regex`, a JSON
/// Schema `pattern` and a Lark terminal it is refused at validation, a
/// 400 naming the parameter, unary and streamed (no stream opens).
#[tokio::test]
async fn a_constraint_too_big_to_compile_is_a_400_up_front() {
    let addr = shared_server().http_addr;
    let rx = "(a{1000}){1000}";
    let cases = [
        ("guided_regex", json!(rx)),
        (
            "guided_json",
            json!({"type": "object", "required": ["b"],
                "properties": {"b": {"type": "string", "pattern": format!("^{rx}$")}}}),
        ),
        (
            "guided_grammar",
            json!(format!("start: \"x\" X\nX: /{rx}/")),
        ),
    ];
    for (param, value) in cases {
        for stream in [false, true] {
            let mut body = chat_body("Say a", 16);
            body[param] = value.clone();
            body["stream"] = json!(stream);
            let r = post(addr, "/v1/chat/completions", &body).await;
            assert_eq!(r.status, 400, "{param} stream={stream}: {}", r.text());
            let e = r.json();
            assert_eq!(e["error"]["param"], param, "{e}");
            let msg = e["error"]["message"].as_str().unwrap();
            assert!(msg.contains("too complex"), "{msg}");
        }
    }
}

fn weather_tool(additional: Option<Value>) -> Value {
    let mut parameters = json!({
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city", "unit"],
    });
    if let Some(a) = additional {
        parameters["additionalProperties"] = a;
    }
    json!([{"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": parameters,
    }}])
}

/// The `openai` client's case: `get_weather(city, unit)` whose schema says
/// nothing of extra keys, named in `tool_choice`, streamed. The model
/// used to append `"unit_type"`, `"unit_name"`, ... until `max_tokens`;
/// held to the listed properties the call ends, and its arguments are
/// JSON with only those keys.
#[tokio::test]
async fn a_named_tool_call_holds_to_its_listed_properties_and_ends() {
    let addr = shared_server().http_addr;
    let mut body = chat_body("What is the weather in Rome?", 120);
    body["tools"] = weather_tool(None);
    body["tool_choice"] = json!({"type": "function", "function": {"name": "get_weather"}});
    body["stream"] = json!(true);
    let chunks = SseStream::open(addr, "/v1/chat/completions", &body)
        .await
        .collect()
        .await;
    let mut args = String::new();
    let mut finish = None;
    for c in &chunks {
        assert!(c.get("error").is_none(), "{c}");
        let Some(choice) = c["choices"].get(0) else {
            continue;
        };
        if let Some(calls) = choice["delta"].get("tool_calls") {
            args.push_str(
                calls[0]["function"]["arguments"]
                    .as_str()
                    .unwrap_or_default(),
            );
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(finish.as_deref(), Some("tool_calls"), "{chunks:?}");
    let parsed: Value = serde_json::from_str(&args).expect("the arguments parse");
    let mut keys: Vec<&str> = parsed
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, ["city", "unit"], "{args}");
}

/// Closing is what the request and schema choose: unlisted keys stay
/// possible where a schema allows them (`additionalProperties: true`), or
/// everywhere with `plain_json_schema: true`; both still compile and
/// answer, and a non-boolean `plain_json_schema` is a 400 naming it.
#[tokio::test]
async fn open_objects_are_the_schema_or_the_request_choice() {
    let addr = shared_server().http_addr;
    for (tools, plain) in [
        (weather_tool(Some(json!(true))), None),
        (weather_tool(None), Some(json!(true))),
    ] {
        let mut body = chat_body("What is the weather in Rome?", 24);
        body["tools"] = tools;
        body["tool_choice"] = json!("required");
        if let Some(p) = plain {
            body["plain_json_schema"] = p;
        }
        let r = post(addr, "/v1/chat/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // response_format: the listed keys only, greedy and whole.
    let mut body = chat_body("Describe a person as JSON.", 60);
    body["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "p",
        "schema": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
            "required": ["name"]}}});
    let v = post(addr, "/v1/chat/completions", &body).await.json();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let parsed: Value = serde_json::from_str(content).expect("the output parses");
    assert_eq!(parsed.as_object().unwrap().len(), 1, "{parsed}");

    body["plain_json_schema"] = json!("yes");
    let r = post(addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "plain_json_schema");
}

/// `--chat-template` takes a file; when it fails to render, the client is
/// told minijinja's reason (the model error's source), not only "chat
/// template error".
#[tokio::test]
async fn a_broken_chat_template_says_why() {
    let dir = std::env::temp_dir().join(format!("kestrel-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("strict.jinja");
    std::fs::write(
        &path,
        "{% for m in messages %}{% if m.role != 'user' %}{{ raise_exception('only users speak here') }}{% endif %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    let server = start_server(kestrel_engine::EngineConfig {
        chat_template: Some(path),
        ..Default::default()
    });
    let ok = post(
        server.http_addr,
        "/v1/chat/completions",
        &chat_body("Hi", 2),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    let mut body = chat_body("Hi", 2);
    body["messages"] =
        json!([{"role": "system", "content": "x"}, {"role": "user", "content": "Hi"}]);
    let r = post(server.http_addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 400, "{}", r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("only users speak here"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}
