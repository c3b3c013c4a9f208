//! The chat templates of the new families, as their models publish them
//! (`tests/chat_templates/`: Gemma 3's from google/gemma-3-*-it, Qwen3's from
//! Qwen/Qwen3-*), rendered by Kestrel's minijinja environment and compared
//! with what Python's jinja2 renders in `transformers`' configuration
//! (trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`); the
//! expected strings were produced that way. They use what SmolLM2's template
//! does not: `is string` / `is iterable` tests, `| trim`, `messages[1:]` and
//! `messages[::-1]`, `namespace()` mutated in a loop, `str.split/lstrip/
//! rstrip/strip/startswith`, `is defined`, and role checks that raise.
//!
//! The tool-calling templates (Qwen 2.5 from Qwen/Qwen2.5-*-Instruct, Llama
//! 3.1 from meta-llama/Llama-3.1-8B-Instruct, Llama 3.2 from
//! meta-llama/Llama-3.2-*-Instruct, Mistral from
//! mistralai/Mistral-7B-Instruct-v0.3, each their `tokenizer_config.json`'s
//! `chat_template`) render one conversation with `tools`, an assistant's
//! call and its result; the expected strings come from
//! `scripts/reference/tool_templates.py` (jinja2 as `transformers` sets it up).

use kestrel_model::{ChatMessage, ChatTemplate, ModelError, ToolCall, ToolSyntax};

const GEMMA3: &str = include_str!("../../../tests/chat_templates/gemma3.jinja");
const QWEN3: &str = include_str!("../../../tests/chat_templates/qwen3.jinja");
const QWEN25: &str = include_str!("../../../tests/chat_templates/qwen2.5.jinja");
const LLAMA31: &str = include_str!("../../../tests/chat_templates/llama3.1.jinja");
const LLAMA32: &str = include_str!("../../../tests/chat_templates/llama3.2.jinja");
const MISTRAL: &str = include_str!("../../../tests/chat_templates/mistral-v0.3.jinja");

fn system_user() -> Vec<ChatMessage> {
    vec![
        ChatMessage::system("Be brief."),
        ChatMessage::user("  What is 2+2? "),
    ]
}

fn multi_turn() -> Vec<ChatMessage> {
    vec![
        ChatMessage::user("Hi"),
        ChatMessage::assistant("<think>\nhmm\n</think>\n\nHello!"),
        ChatMessage::user("Bye"),
    ]
}

#[test]
fn gemma3_template() {
    let t = ChatTemplate::new(GEMMA3, "<bos>", "<eos>").unwrap();
    assert_eq!(
        t.render(&system_user(), true).unwrap(),
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    );
    assert_eq!(
        t.render(&multi_turn(), true).unwrap(),
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n<think>\nhmm\n</think>\n\nHello!<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    );
    // Roles must alternate starting with the user: the template raises.
    match t.render(&[ChatMessage::assistant("x")], false) {
        Err(ModelError::ChatTemplate { source }) => {
            assert!(source.to_string().contains("must alternate"), "{source}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn qwen3_template() {
    let t = ChatTemplate::new(QWEN3, "", "<|im_end|>").unwrap();
    assert_eq!(
        t.render(&system_user(), true).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n  What is 2+2? <|im_end|>\n<|im_start|>assistant\n"
    );
    // Reasoning of turns before the last user query is dropped.
    assert_eq!(
        t.render(&multi_turn(), true).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    );
}

/// The conversation of `scripts/reference/tool_templates.py`.
fn tool_conversation() -> (Vec<ChatMessage>, Vec<serde_json::Value>) {
    let tools = vec![serde_json::json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    }})];
    let call = ToolCall {
        id: "abc123XYZ".into(),
        name: "get_weather".into(),
        arguments: serde_json::json!({"city": "Paris"}),
    };
    let messages = vec![
        ChatMessage::system("Be brief."),
        ChatMessage::user("Weather in Paris?"),
        ChatMessage {
            tool_calls: vec![call],
            ..ChatMessage::assistant("")
        },
        ChatMessage {
            tool_call_id: Some("abc123XYZ".into()),
            ..ChatMessage::new("tool", "22 C")
        },
    ];
    (messages, tools)
}

fn render_tools(source: &str, bos: &str, eos: &str) -> String {
    let (messages, tools) = tool_conversation();
    ChatTemplate::new(source, bos, eos)
        .unwrap()
        .render_with_tools(&messages, &tools, true)
        .unwrap()
}

#[test]
fn tool_templates_render_as_transformers_does() {
    assert_eq!(
        render_tools(QWEN25, "", "<|im_end|>"),
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather in a city\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        "qwen2.5.jinja"
    );
    assert_eq!(
        render_tools(QWEN3, "", "<|im_end|>"),
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather in a city\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        "qwen3.jinja"
    );
    assert_eq!(
        render_tools(LLAMA31, "<|begin_of_text|>", "<|eot_id|>"),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"get_weather\",\n        \"description\": \"Weather in a city\",\n        \"parameters\": {\n            \"type\": \"object\",\n            \"properties\": {\n                \"city\": {\n                    \"type\": \"string\"\n                }\n            },\n            \"required\": [\n                \"city\"\n            ]\n        }\n    }\n}\n\nWeather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n\"22 C\"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "llama3.1.jinja"
    );
    assert_eq!(
        render_tools(LLAMA32, "<|begin_of_text|>", "<|eot_id|>"),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"get_weather\",\n        \"description\": \"Weather in a city\",\n        \"parameters\": {\n            \"type\": \"object\",\n            \"properties\": {\n                \"city\": {\n                    \"type\": \"string\"\n                }\n            },\n            \"required\": [\n                \"city\"\n            ]\n        }\n    }\n}\n\nWeather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n\"22 C\"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "llama3.2.jinja"
    );
    assert_eq!(
        render_tools(MISTRAL, "<s>", "</s>"),
        "<s>[AVAILABLE_TOOLS][{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather in a city\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}][/AVAILABLE_TOOLS][INST]Weather in Paris?[/INST][TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": \"abc123XYZ\"}]</s>[TOOL_RESULTS]{\"content\": 22 C, \"call_id\": \"abc123XYZ\"}[/TOOL_RESULTS]",
        "mistral-v0.3.jinja"
    );
}

#[test]
fn tool_syntax_is_read_from_the_template() {
    let syntax = |src: &str| ChatTemplate::new(src, "", "").unwrap().tool_syntax();
    assert_eq!(syntax(QWEN25), Some(ToolSyntax::Hermes));
    assert_eq!(syntax(QWEN3), Some(ToolSyntax::Hermes));
    assert_eq!(syntax(LLAMA31), Some(ToolSyntax::Llama3Json));
    assert_eq!(syntax(LLAMA32), Some(ToolSyntax::Llama3Json));
    assert_eq!(syntax(MISTRAL), Some(ToolSyntax::MistralV3));
    // Templates that render no tools: Kestrel's own Hermes prompt applies.
    assert_eq!(syntax(GEMMA3), None);
    assert_eq!(ChatTemplate::chatml().tool_syntax(), None);
}
