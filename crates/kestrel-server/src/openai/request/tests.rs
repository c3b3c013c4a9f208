//! Unit tests of the request shapes: parameters taken, ignored and refused,
//! constraints, prompts, messages and tools.

use super::*;
use kestrel_engine::ChatMessage;
use serde_json::json;

fn chat(body: Value) -> Result<Plan, ApiError> {
    parse(
        Endpoint::Chat,
        body.to_string().as_bytes(),
        "m",
        &ToolFormat::HERMES,
    )
}

fn user() -> Value {
    json!([{"role": "user", "content": "hi"}])
}

#[test]
fn maps_every_sampling_field() {
    let p = chat(json!({
        "model": "m", "messages": user(), "max_completion_tokens": 9,
        "temperature": 0.5, "top_p": 0.9, "top_k": -1, "min_p": 0.1,
        "repetition_penalty": 1.1, "frequency_penalty": -0.5, "presence_penalty": 0.5,
        "seed": -1, "logprobs": true, "top_logprobs": 2, "stop": "\n", "n": 3,
        "user": "ignored", "logit_bias": {"7": -100, "3": 2.5}, "stream": true,
        "stream_options": {"include_usage": true}
    }))
    .unwrap();
    let r = &p.prompts[0];
    assert_eq!((r.max_new_tokens, r.n), (Some(9), Some(3)));
    assert_eq!(r.sampling.top_k, Some(0));
    // -1 as its bits; the engine gives sample i seed + i.
    assert_eq!(r.sampling.seed, Some(u64::MAX));
    assert_eq!(r.stop, vec!["\n".to_string()]);
    assert!(r.sampling.logprobs && r.sampling.top_logprobs == 2);
    let mut bias = r.sampling.logit_bias.clone();
    bias.sort_by_key(|b| b.0);
    assert_eq!(bias, vec![(3, 2.5), (7, -100.0)]);
    assert_eq!(r.input, Prompt::chat(vec![ChatMessage::user("hi")]));
    assert!(p.stream && p.include_usage && p.logprobs);
    assert_eq!(p.choices(), 3);
    assert_eq!(p.names[0].max_tokens, Some("max_completion_tokens"));
    assert!(p.names[0].stop_is_string);
}

#[test]
fn shape_errors_name_the_parameter() {
    let param = |body: Value| chat(body).unwrap_err().param;
    let base = |extra: Value| {
        let mut b = json!({"messages": user()});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    assert_eq!(
        param(base(json!({"temperature": "hot"}))).as_deref(),
        Some("temperature")
    );
    assert_eq!(
        param(base(json!({"max_tokens": -1}))).as_deref(),
        Some("max_tokens")
    );
    assert_eq!(param(base(json!({"n": "two"}))).as_deref(), Some("n"));
    // The range is the engine's rule: the request carries `n` as given.
    assert_eq!(chat(base(json!({"n": 0}))).unwrap().prompts[0].n, Some(0));
    assert_eq!(
        param(base(json!({"frobnicate": 1}))).as_deref(),
        Some("frobnicate")
    );
    let completions = |body: Value| {
        parse(
            Endpoint::Completions,
            body.to_string().as_bytes(),
            "m",
            &ToolFormat::HERMES,
        )
    };
    assert!(
        !completions(json!({"prompt": "hi", "echo": false}))
            .unwrap()
            .echo
    );
    assert!(
        completions(json!({"prompt": "hi", "echo": true}))
            .unwrap()
            .echo
    );
    // echo with logprobs asks the engine for the prompt's, as many alternatives.
    let p = completions(json!({"prompt": "hi", "echo": true, "logprobs": 3})).unwrap();
    assert_eq!(p.prompts[0].sampling.prompt_logprobs, Some(3));
    let p = completions(json!({"prompt": "hi", "logprobs": 3})).unwrap();
    assert_eq!(p.prompts[0].sampling.prompt_logprobs, None);
    assert_eq!(
        completions(json!({"prompt": "hi", "echo": true, "logprobs": 0, "stream": true}))
            .unwrap_err()
            .param
            .as_deref(),
        Some("echo")
    );
    for bias in [json!({"x": 1}), json!({"5": "1"}), json!([1])] {
        assert_eq!(
            param(base(json!({ "logit_bias": bias }))).as_deref(),
            Some("logit_bias")
        );
    }
    assert_eq!(param(base(json!({"stop": 5}))).as_deref(), Some("stop"));
    assert_eq!(
        param(base(json!({"response_format": {"type": "yaml"}}))).as_deref(),
        Some("response_format.type")
    );
    assert_eq!(
        param(base(json!({"guided_regex": "a", "guided_choice": ["a"]}))).as_deref(),
        Some("guided_choice")
    );
    assert_eq!(param(json!({"model": "m"})).as_deref(), Some("messages"));
    assert_eq!(
        param(json!({"messages": [{"role": "user", "content": 5}]})).as_deref(),
        Some("messages[0].content")
    );
    assert_eq!(
        param(json!({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}))
            .as_deref(),
        Some("messages[0].content[0].type")
    );
    // An image part without its URL object names the part's image_url.
    assert_eq!(
        param(json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}))
            .as_deref(),
        Some("messages[0].content[0].image_url")
    );
    assert_eq!(
        param(json!({"messages": [{"content": "x"}]})).as_deref(),
        Some("messages[0]")
    );
    let e = chat(json!({"model": "gpt-4", "messages": user()})).unwrap_err();
    assert_eq!(e.status, axum::http::StatusCode::NOT_FOUND);
    for bad in [&b"{"[..], b"[1]", b"", b"{\"temperature\": NaN}"] {
        let e = parse(Endpoint::Chat, bad, "m", &ToolFormat::HERMES).unwrap_err();
        assert_eq!((e.status.as_u16(), e.param), (400, None));
    }
}

#[test]
fn constraints_and_tools() {
    let p = chat(
        json!({"messages": user(), "response_format": {"type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}}}),
    )
    .unwrap();
    assert_eq!(
        p.prompts[0].constraint,
        Some(Constraint::JsonSchema(json!({"type": "object"})))
    );
    assert_eq!(p.names[0].constraint, "response_format.json_schema.schema");
    let p =
        chat(json!({"messages": user(), "structured_outputs": {"choice": ["a", "b"]}})).unwrap();
    assert_eq!(
        p.prompts[0].constraint,
        Some(Constraint::Choice(vec!["a".into(), "b".into()]))
    );

    let tools =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let p = chat(json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{\"a\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}
    ], "tools": tools, "tool_choice": "required"}))
    .unwrap();
    let Prompt::Chat { messages: m, .. } = &p.prompts[0].input else {
        panic!()
    };
    assert_eq!(m.len(), 4);
    assert!(m[0].role == "system" && m[0].content.contains("<tools>"));
    assert_eq!(
        m[2].content,
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\":1}}\n</tool_call>"
    );
    assert_eq!(m[3].content, "<tool_response>\n42\n</tool_response>");
    assert_eq!(p.names[0].message_offset, 1);
    assert!(matches!(
        p.prompts[0].constraint,
        Some(Constraint::Grammar(_))
    ));
    let e = chat(json!({"messages": user(), "tools": tools, "guided_regex": "a"})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("guided_regex"));
}

#[test]
fn fields_that_cannot_change_the_output_are_accepted_and_ignored() {
    let p = chat(json!({
        "messages": user(), "user": "u", "store": false, "metadata": {"k": "v"},
        "service_tier": "auto", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
        "safety_identifier": "s", "reasoning_effort": "low", "verbosity": "medium",
        "modalities": ["text"], "best_of": 2, "n": 2, "min_tokens": 3,
        "audio": null, "prediction": null
    }))
    .unwrap();
    assert_eq!(p.prompts[0].min_tokens, 3);
    assert_eq!(p.choices(), 2);
    let c = parse(
        Endpoint::Completions,
        br#"{"prompt": "a", "user": "u", "suffix": "", "best_of": 1, "min_tokens": 2}"#,
        "m",
        &ToolFormat::HERMES,
    )
    .unwrap();
    assert_eq!(c.prompts[0].min_tokens, 2);
}

#[test]
fn fields_kestrel_cannot_honour_are_a_400_naming_them() {
    let refused = |extra: Value| {
        let mut b = json!({"messages": user()});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        chat(b).unwrap_err()
    };
    for (extra, param, code) in [
        (
            json!({"audio": {"voice": "alloy", "format": "wav"}}),
            "audio",
            Some("unsupported_parameter"),
        ),
        (
            json!({"prediction": {"type": "content", "content": "x"}}),
            "prediction",
            Some("unsupported_parameter"),
        ),
        (
            json!({"web_search_options": {}}),
            "web_search_options",
            Some("unsupported_parameter"),
        ),
        (
            json!({"modalities": ["text", "audio"]}),
            "modalities",
            Some("unsupported_parameter"),
        ),
        (
            json!({"best_of": 3}),
            "best_of",
            Some("unsupported_parameter"),
        ),
        (
            json!({"reasoning_effort": "extreme"}),
            "reasoning_effort",
            None,
        ),
        (json!({"verbosity": 3}), "verbosity", None),
        (json!({"metadata": "x"}), "metadata", None),
        (json!({"min_tokens": -1}), "min_tokens", None),
        (json!({"service_tier": 1}), "service_tier", None),
    ] {
        let e = refused(extra.clone());
        assert_eq!((e.param.as_deref(), e.code), (Some(param), code), "{extra}");
        assert_eq!(e.status.as_u16(), 400);
    }
    let e = parse(
        Endpoint::Completions,
        br#"{"prompt": "a", "suffix": "b"}"#,
        "m",
        &ToolFormat::HERMES,
    )
    .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("suffix"));
    // Chat-only parameters stay unknown on completions.
    let e = parse(
        Endpoint::Completions,
        br#"{"prompt": "a", "metadata": {}}"#,
        "m",
        &ToolFormat::HERMES,
    )
    .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("metadata"));
}

#[test]
fn legacy_functions_are_tools() {
    let f = json!([{"name": "f", "parameters": {"type": "object"}}]);
    let legacy = chat(json!({"messages": user(), "functions": f,
        "function_call": {"name": "f"}}))
    .unwrap();
    let tools = json!([{"type": "function", "function": f[0]}]);
    let modern = chat(json!({"messages": user(), "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "f"}}}))
    .unwrap();
    assert_eq!(legacy.prompts, modern.prompts);
    assert!(legacy.tools.is_some());
    assert!(
        chat(json!({"messages": user(), "functions": f, "function_call": "none"}))
            .unwrap()
            .tools
            .is_none()
    );
    let param = |body: Value| chat(body).unwrap_err().param;
    assert_eq!(
        param(json!({"messages": user(), "functions": f, "tools": tools})).as_deref(),
        Some("functions")
    );
    assert_eq!(
        param(json!({"messages": user(), "function_call": "auto"})).as_deref(),
        Some("function_call")
    );
    assert_eq!(
        param(json!({"messages": user(), "functions": f, "function_call": {"name": "g"}}))
            .as_deref(),
        Some("function_call")
    );
    assert_eq!(
        param(json!({"messages": user(), "functions": [{"name": "bad name"}]})).as_deref(),
        Some("functions[0].name")
    );
    // A legacy conversation: the assistant's function_call and the
    // function's answer render like their tool_calls counterparts.
    let history = |call: Value, answer_role: &str| {
        json!({"messages": [
            {"role": "user", "content": "hi"},
            call,
            {"role": answer_role, "name": "f", "tool_call_id": "c", "content": "42"}
        ], "functions": f})
    };
    let old = chat(history(
        json!({"role": "assistant", "content": null,
            "function_call": {"name": "f", "arguments": "{}"}}),
        "function",
    ))
    .unwrap();
    let new = chat(history(
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c",
            "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
        "tool",
    ))
    .unwrap();
    assert_eq!(old.prompts, new.prompts);
}

#[test]
fn completions_prompts() {
    let p = parse(
        Endpoint::Completions,
        json!({"prompt": ["a", "b"], "logprobs": 2, "n": 2, "seed": 7})
            .to_string()
            .as_bytes(),
        "m",
        &ToolFormat::HERMES,
    )
    .unwrap();
    assert_eq!(p.choices(), 4);
    assert_eq!(p.prompts[1].input, Prompt::Text("b".into()));
    assert_eq!(
        (p.prompts[1].sampling.seed, p.prompts[1].n),
        (Some(7), Some(2))
    );
    assert_eq!(p.names[1].prompt, "prompt[1]");
    assert_eq!(p.names[1].top_logprobs, "logprobs");
    let tokens = |body: &[u8]| {
        parse(Endpoint::Completions, body, "m", &ToolFormat::HERMES).map(|p| {
            p.prompts
                .into_iter()
                .map(|r| r.input)
                .zip(p.names.into_iter().map(|n| n.prompt))
                .collect::<Vec<_>>()
        })
    };
    assert_eq!(
        tokens(br#"{"prompt": [1, 2]}"#).unwrap(),
        vec![(Prompt::Tokens(vec![1, 2]), "prompt".to_string())]
    );
    assert_eq!(
        tokens(br#"{"prompt": [[1, 2], "a", [3]]}"#).unwrap(),
        vec![
            (Prompt::Tokens(vec![1, 2]), "prompt[0]".to_string()),
            (Prompt::Text("a".into()), "prompt[1]".to_string()),
            (Prompt::Tokens(vec![3]), "prompt[2]".to_string()),
        ]
    );
    for (body, param) in [
        (&br#"{"prompt": [1, "a"]}"#[..], "prompt"),
        (br#"{"prompt": [1, -2]}"#, "prompt"),
        (br#"{"prompt": [[1], [4294967296]]}"#, "prompt[1]"),
        (br#"{"prompt": [[1], true]}"#, "prompt[1]"),
        (br#"{"prompt": []}"#, "prompt"),
        (br#"{"prompt": 5}"#, "prompt"),
    ] {
        let e = tokens(body).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
    }
    let e = parse(
        Endpoint::Completions,
        br#"{"prompt": "a", "max_completion_tokens": 3}"#,
        "m",
        &ToolFormat::HERMES,
    )
    .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
}

/// A chat with an image part is one vision query: the image's bytes, the
/// last user message's text as the question, the image's part named for
/// engine errors about it.
#[test]
fn an_image_chat_is_a_vision_query() {
    use crate::openai::FieldNames as _;
    use kestrel_engine::{Field, VisionTask};
    let png = "data:image/png;base64,iVBORw0KGgo=";
    let p = chat(json!({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": png}}]},
        {"role": "assistant", "content": "Looks like a picture."},
        {"role": "user", "content": [{"type": "text", "text": "What "},
                                     {"type": "text", "text": "colour?"}]},
    ]}))
    .unwrap();
    assert_eq!(
        p.prompts[0].input,
        Prompt::Vision {
            image: b"\x89PNG\r\n\x1a\n".to_vec(),
            task: VisionTask::Query {
                question: "What colour?".into()
            }
        }
    );
    let names = &p.names[0];
    assert_eq!(
        names.param(Field::Image),
        "messages[1].content[0].image_url"
    );
    assert_eq!(names.param(Field::Question), "messages[3].content");
}
