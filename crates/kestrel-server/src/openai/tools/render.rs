//! The chat history as the model's format writes it ([`prepare`]): the tools
//! and their calls and results passed to a template that renders them, or
//! rendered into content (Hermes) for one that does not; and a call's
//! arguments as the JSON value a template expects ([`arguments_value`]).

use kestrel_engine::{ChatMessage, Prompt, ToolCall};
use kestrel_model::ToolSyntax;
use serde_json::Value;

use super::{Function, ToolFormat, ToolSet};

/// Makes the prompt of a conversation in `format`, with `tools` offered
/// (when any may be called). A template that renders tools gets them and
/// the structured calls and results; otherwise calls and results are
/// written into content in Hermes's format and a system prompt describing
/// the tools comes first (merged into the client's own system message when
/// there is one). Returns the prompt and how many messages were put in
/// front of the client's.
pub fn prepare(
    format: &ToolFormat,
    mut messages: Vec<ChatMessage>,
    tools: Option<&ToolSet>,
) -> (Prompt, usize) {
    if format.by_template {
        if format.syntax == ToolSyntax::MistralV3 {
            // Mistral's template refuses ids that are not nine alphanumerics.
            for m in &mut messages {
                for c in &mut m.tool_calls {
                    c.id = mistral_id(&c.id);
                }
                if let Some(id) = &mut m.tool_call_id {
                    *id = mistral_id(id);
                }
            }
        }
        let tools = tools
            .map(|t| t.functions.iter().map(Function::tool_json).collect())
            .unwrap_or_default();
        return (Prompt::Chat { messages, tools }, 0);
    }
    for m in &mut messages {
        if m.role == "tool" {
            m.content = render_result(&m.content);
            m.tool_call_id = None;
        }
        for call in std::mem::take(&mut m.tool_calls) {
            if !m.content.is_empty() {
                m.content.push('\n');
            }
            m.content.push_str(&render_call(&call));
        }
    }
    let Some(tools) = tools else {
        return (Prompt::chat(messages), 0);
    };
    let prompt = tools.system_prompt();
    let offset = match messages.first_mut() {
        Some(first) if first.role == "system" => {
            first.content = format!("{}\n\n{prompt}", first.content);
            0
        }
        _ => {
            messages.insert(0, ChatMessage::system(prompt));
            1
        }
    };
    (Prompt::chat(messages), offset)
}

/// `id` as Mistral's template wants it: nine ASCII letters and digits,
/// kept when it is one, else derived from it (FNV-1a, base 62), so a call
/// and its result still match.
pub(super) fn mistral_id(id: &str) -> String {
    if id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return id.to_string();
    }
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let mut h = kestrel_engine::seed_for_request_id(id);
    (0..9)
        .map(|_| {
            let d = DIGITS[(h % 62) as usize] as char;
            h /= 62;
            d
        })
        .collect()
}

/// An assistant's earlier call, as Hermes history content.
fn render_call(call: &ToolCall) -> String {
    format!(
        "<tool_call>\n{{\"name\": {}, \"arguments\": {}}}\n</tool_call>",
        Value::String(call.name.clone()),
        call.arguments
    )
}

/// A `tool` message's content, as Hermes history content.
fn render_result(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// A call's arguments text as templates get it: JSON when it parses, the
/// text as a JSON string otherwise.
pub fn arguments_value(arguments: &str) -> Value {
    serde_json::from_str(arguments).unwrap_or_else(|_| Value::String(arguments.to_string()))
}
