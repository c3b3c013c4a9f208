//! Structured output: a `json_schema` response validates, and constraints
//! past the compile budget are a 400 before any token.

use crate::common::http::post;
use crate::common::openai::chat_body;
use crate::common::shared_server;
use serde_json::{json, Value};

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
