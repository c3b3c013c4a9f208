//! Unit tests of the tool formats: parsing tools and `tool_choice`, the
//! history each format renders, the grammar each format is held to, and
//! splitting output whole and streamed.

use super::render::mistral_id;
use super::split::ParsedCall;
use super::*;
use kestrel_engine::{ChatMessage, Prompt, ToolCall};

fn weather() -> Value {
    json!([{"type": "function", "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    }}, {"type": "function", "function": {"name": "get_time"}}])
}

fn format(syntax: ToolSyntax) -> ToolFormat {
    ToolFormat {
        syntax,
        by_template: syntax != ToolSyntax::Hermes,
        call_token: None,
    }
}

const FORMATS: [ToolSyntax; 3] = [
    ToolSyntax::Hermes,
    ToolSyntax::Llama3Json,
    ToolSyntax::MistralV3,
];

fn set(syntax: ToolSyntax, choice: Value) -> ToolSet {
    parse(Some(weather()), Some(choice), None, &format(syntax))
        .unwrap()
        .unwrap()
}

/// One call of `get_weather` for Paris, compact, in `syntax`.
fn paris(syntax: ToolSyntax) -> &'static str {
    match syntax {
        ToolSyntax::Hermes => {
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>"
        }
        ToolSyntax::Llama3Json => {
            "{\"name\":\"get_weather\",\"parameters\":{\"city\":\"Paris\"}}"
        }
        ToolSyntax::MistralV3 => {
            "[TOOL_CALLS][{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}]"
        }
    }
}

/// Whether llguidance's Lark `grammar` accepts the whole of `text`
/// (byte tokens).
fn accepts(grammar: &str, text: &str) -> bool {
    let env = toktrie::ApproximateTokEnv::single_byte_env();
    let factory = llguidance::ParserFactory::new_simple(&env).unwrap();
    let parser = factory
        .create_parser(llguidance::api::TopLevelGrammar::from_lark(
            grammar.to_string(),
        ))
        .unwrap_or_else(|e| panic!("{e}\n{grammar}"));
    let mut m = llguidance::Matcher::new(Ok(parser));
    let tokens = env.tokenize_bytes(text.as_bytes());
    m.consume_tokens(&tokens).is_ok() && m.is_accepting().unwrap_or(false)
}

#[test]
fn choices_parse() {
    let hermes = &ToolFormat::HERMES;
    assert_eq!(parse(None, None, None, hermes).unwrap(), None);
    assert_eq!(
        parse(Some(weather()), Some(json!("none")), None, hermes).unwrap(),
        None
    );
    let t = parse(Some(weather()), None, None, hermes).unwrap().unwrap();
    assert_eq!(t.choice, ToolChoice::Auto);
    assert!(t.parallel);
    let t = parse(
        Some(weather()),
        Some(json!({"type": "function", "function": {"name": "get_weather"}})),
        Some(false),
        hermes,
    )
    .unwrap()
    .unwrap();
    assert_eq!(t.choice, ToolChoice::Named("get_weather".into()));
    // Llama 3's template takes one call per turn.
    let t = parse(
        Some(weather()),
        None,
        Some(true),
        &format(ToolSyntax::Llama3Json),
    );
    assert!(!t.unwrap().unwrap().parallel);
    let e = parse(
        Some(weather()),
        Some(json!({"type": "function", "function": {"name": "x"}})),
        None,
        hermes,
    )
    .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("tool_choice"));
    let e = parse(
        Some(json!([{"type": "function", "function": {"name": "a b"}}])),
        None,
        None,
        hermes,
    )
    .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("tools[0].function.name"));
    let e = parse(Some(json!([{"type": "retrieval"}])), None, None, hermes).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("tools[0].type"));
    let e = parse(None, Some(json!("required")), None, hermes).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("tool_choice"));
}

fn history() -> Vec<ChatMessage> {
    vec![
        ChatMessage::user("Weather in Paris?"),
        ChatMessage {
            tool_calls: vec![ToolCall {
                id: "call_17".into(),
                name: "get_weather".into(),
                arguments: json!({"city": "Paris"}),
            }],
            ..ChatMessage::assistant("")
        },
        ChatMessage {
            tool_call_id: Some("call_17".into()),
            ..ChatMessage::new("tool", "22 C")
        },
    ]
}

#[test]
fn hermes_fallback_writes_prompt_calls_and_results() {
    let t = set(ToolSyntax::Hermes, json!("auto"));
    let (prompt, offset) = prepare(&ToolFormat::HERMES, history(), Some(&t));
    let Prompt::Chat { messages, tools } = prompt else {
        panic!()
    };
    assert_eq!(offset, 1);
    assert!(tools.is_empty(), "the template is not given the tools");
    assert!(
        messages[0].role == "system"
            && messages[0]
                .content
                .contains("<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"")
    );
    assert_eq!(
        messages[2].content,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>"
    );
    assert!(messages[2].tool_calls.is_empty());
    assert_eq!(
        (messages[3].role.as_str(), messages[3].content.as_str()),
        ("tool", "<tool_response>\n22 C\n</tool_response>")
    );
    // A client system message takes the prompt after its own text.
    let mut h = history();
    h.insert(0, ChatMessage::system("Be brief."));
    let (Prompt::Chat { messages, .. }, 0) = prepare(&ToolFormat::HERMES, h, Some(&t)) else {
        panic!()
    };
    assert!(messages[0]
        .content
        .starts_with("Be brief.\n\nYou are a function calling"));
}

#[test]
fn template_formats_get_structured_history_and_tools() {
    for syntax in FORMATS {
        let f = format(syntax);
        let f = ToolFormat {
            by_template: true,
            ..f
        };
        let t = set(syntax, json!("auto"));
        let (prompt, offset) = prepare(&f, history(), Some(&t));
        let Prompt::Chat { messages, tools } = prompt else {
            panic!()
        };
        assert_eq!(offset, 0);
        assert_eq!(messages.len(), 3);
        assert_eq!(
            tools,
            weather()
                .as_array()
                .unwrap()
                .clone()
                .into_iter()
                .map(|mut t| {
                    if t["function"].get("parameters").is_none() {
                        t["function"]["parameters"] = json!({"type": "object", "properties": {}});
                    }
                    t
                })
                .collect::<Vec<_>>()
        );
        assert_eq!(messages[1].content, "");
        let id = &messages[1].tool_calls[0].id;
        assert_eq!(messages[2].tool_call_id.as_ref(), Some(id));
        if syntax == ToolSyntax::MistralV3 {
            // Nine alphanumerics, the same for the call and its result.
            assert_eq!(id.len(), 9);
            assert!(id.bytes().all(|b| b.is_ascii_alphanumeric()), "{id}");
            assert_eq!(mistral_id("abc123XYZ"), "abc123XYZ");
        } else {
            assert_eq!(id, "call_17");
        }
    }
    // No tools offered: the template gets none, history stays structured.
    let (Prompt::Chat { tools, messages }, 0) =
        prepare(&format(ToolSyntax::Llama3Json), history(), None)
    else {
        panic!()
    };
    assert!(tools.is_empty() && messages[1].tool_calls.len() == 1);
}

#[test]
fn grammar_holds_each_format_to_compact_valid_calls() {
    for syntax in FORMATS {
        let g = set(syntax, json!("required")).grammar();
        let call = paris(syntax);
        assert!(accepts(&g, call), "{syntax:?} refuses {call}\n{g}");
        // Free whitespace inside the JSON, an argument of the wrong
        // type, a function not offered, a missing argument: refused.
        let spaced = call.replace("\"city\":", "\"city\":  ");
        let wrong_type = call.replace("\"Paris\"", "7");
        let unknown = call.replace("get_weather", "get_wether");
        let missing = call.replace("\"city\":\"Paris\"", "");
        for bad in [&spaced, &wrong_type, &unknown, &missing] {
            assert!(!accepts(&g, bad), "{syntax:?} accepts {bad}");
        }
        assert!(!accepts(&g, "It is sunny."), "{syntax:?}: required");
        // Auto: text, or a call; text that opens like a call is a call.
        let auto = set(syntax, json!("auto")).grammar();
        assert!(accepts(&auto, call), "{syntax:?}\n{auto}");
        assert!(accepts(&auto, "It is sunny."), "{syntax:?}");
        assert!(!accepts(&auto, &wrong_type), "{syntax:?}");
        // A named function: only that one.
        let named = set(
            syntax,
            json!({"type": "function", "function": {"name": "get_time"}}),
        )
        .grammar();
        assert!(!accepts(&named, call), "{syntax:?}");
    }
    // Parallel calls where the format has them.
    let hermes = set(ToolSyntax::Hermes, json!("required")).grammar();
    let two = format!("{0}\n{0}", paris(ToolSyntax::Hermes));
    assert!(accepts(&hermes, &two));
    let mistral = set(ToolSyntax::MistralV3, json!("required")).grammar();
    let two = "[TOOL_CALLS][{\"name\":\"get_time\",\"arguments\":{}}, {\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}]";
    assert!(accepts(&mistral, two));
    let llama = set(ToolSyntax::Llama3Json, json!("required")).grammar();
    let two = format!("{0}; {0}", paris(ToolSyntax::Llama3Json));
    assert!(!accepts(&llama, &two));
    // Mistral's marker as its control token when the vocabulary has it.
    let t = parse(
        Some(weather()),
        None,
        None,
        &ToolFormat {
            call_token: Some(5),
            ..format(ToolSyntax::MistralV3)
        },
    )
    .unwrap()
    .unwrap();
    assert!(
        t.grammar().contains("calls: <[5]> \"[\" body"),
        "{}",
        t.grammar()
    );
}

/// Feeds `text` in `chunk`-byte pieces (on char boundaries) and collects.
fn stream(tools: &ToolSet, text: &str, chunk: usize) -> Vec<Piece> {
    let mut s = CallSplitter::new(tools);
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut n = chunk.min(rest.len());
        while !rest.is_char_boundary(n) {
            n += 1;
        }
        out.extend(s.push(&rest[..n]));
        rest = &rest[n..];
    }
    out.extend(s.finish());
    out
}

#[test]
fn splitter_reads_each_format_whole_and_streamed() {
    for syntax in FORMATS {
        let t = set(syntax, json!("auto"));
        let whole = split(&t, paris(syntax));
        assert_eq!(
            whole,
            Split {
                content: String::new(),
                calls: vec![ParsedCall {
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris"}"#.into()
                }],
                unfinished: String::new(),
            },
            "{syntax:?}"
        );
        for chunk in [1, 3, 7] {
            let pieces = stream(&t, paris(syntax), chunk);
            // The name first, then argument fragments that add up.
            assert_eq!(pieces[0], Piece::CallStart("get_weather".into()));
            let args: String = pieces[1..]
                .iter()
                .map(|p| match p {
                    Piece::Args(a) => a.as_str(),
                    other => panic!("{syntax:?}: {other:?}"),
                })
                .collect();
            assert_eq!(args, r#"{"city":"Paris"}"#);
            if chunk == 1 {
                assert!(pieces.len() > 3, "arguments stream: {pieces:?}");
            }
        }
        // Text is text, released as soon as it cannot open a call.
        let pieces = stream(&t, "Sunny, 22 C.", 2);
        assert_eq!(pieces[0], Piece::Text("Su".into()), "{syntax:?}");
        assert_eq!(split(&t, "Sunny, 22 C.").content, "Sunny, 22 C.");
    }
    // Hermes: an opener prefix is held back, then released as text.
    let t = set(ToolSyntax::Hermes, json!("auto"));
    let mut s = CallSplitter::new(&t);
    assert!(s.push("<tool").is_empty());
    assert_eq!(s.push("box"), vec![Piece::Text("<toolbox".into())]);
    assert_eq!(split(&t, "<tool").content, "<tool");
    // Two calls, and Mistral's marker left out of the text (a control
    // token the output does not show).
    let two = format!("{0}\n{0}", paris(ToolSyntax::Hermes));
    assert_eq!(split(&t, &two).calls.len(), 2);
    let m = set(ToolSyntax::MistralV3, json!("auto"));
    let marker_skipped = "[{\"name\":\"get_time\",\"arguments\":{}}, {\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}]";
    let got = split(&m, marker_skipped);
    assert_eq!(got.calls.len(), 2, "{got:?}");
    assert_eq!(got.calls[1].arguments, r#"{"city":"Oslo"}"#);
}

#[test]
fn a_call_cut_short_is_content() {
    for syntax in FORMATS {
        let t = set(syntax, json!("required"));
        let call = paris(syntax);
        // Cut inside the arguments, and inside the name.
        for cut in [call.find("Par").unwrap(), call.find("weat").unwrap()] {
            let text = &call[..cut];
            let got = split(&t, text);
            assert_eq!(
                got,
                Split {
                    content: String::new(),
                    calls: Vec::new(),
                    unfinished: text.to_string(),
                },
                "{syntax:?}"
            );
            let pieces = stream(&t, text, 4);
            assert_eq!(
                pieces.last(),
                Some(&Piece::Unfinished {
                    text: text.to_string(),
                    started: cut > call.find("weat").unwrap()
                }),
                "{syntax:?}"
            );
        }
    }
    // After a whole call: that call stays, the cut one is content.
    let t = set(ToolSyntax::Hermes, json!("required"));
    let call = paris(ToolSyntax::Hermes);
    let text = format!("{call}\n<tool_call>\n{{\"name\":\"get_ti");
    let got = split(&t, &text);
    assert_eq!(got.calls.len(), 1);
    assert_eq!(got.unfinished, "<tool_call>\n{\"name\":\"get_ti");
    // A whole call followed by a cut closing tag is not cut short.
    let got = split(&t, &call[..call.len() - 3]);
    assert_eq!((got.calls.len(), got.unfinished.as_str()), (1, ""));
}
