//! Tool calls in the model's own format, constrained so they always parse.
//!
//! [`ToolFormat::of_model`] reads the call syntax from the chat template:
//! Hermes / Qwen (`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`),
//! Llama 3.1/3.2 (a bare `{"name": ..., "parameters": {...}}`, one call) or
//! Mistral v3 (`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`). Such a
//! template renders `tools`, calls and results itself; for any other model
//! Kestrel writes Hermes: its own system prompt ([`ToolSet::system_prompt`])
//! and history rendered into content ([`prepare`]). [`ToolSet::grammar`] is an
//! llguidance Lark grammar in the format's syntax whose every call is a
//! `%json` value validated against the function's parameter schema, written
//! compact (no whitespace outside strings). [`CallSplitter`] turns output
//! text, whole or streamed, into content, calls and their argument
//! fragments, and hands back the text of a call the output was cut inside.
//! Pure, no I/O.
//!
//! This file holds the [`ToolFormat`] and the request's [`ToolSet`] ([`parse`]);
//! `grammar.rs` what the model is told and held to (system prompt, Lark
//! grammar), `render.rs` the chat history with calls and results ([`prepare`]),
//! `split.rs` output text back into content and calls ([`CallSplitter`], [`split`]).

mod grammar;
mod render;
mod split;
#[cfg(test)]
mod tests;

use kestrel_engine::ModelContext;
use kestrel_model::ToolSyntax;
use serde_json::{json, Value};

use super::error::ApiError;
pub use render::{arguments_value, prepare};
pub use split::{split, CallSplitter, Piece, Split};

/// Longest function name (OpenAI's limit).
const MAX_NAME_BYTES: usize = 64;

/// How the served model writes tool calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolFormat {
    pub syntax: ToolSyntax,
    /// The chat template renders `tools`, calls and results itself;
    /// otherwise Kestrel writes them (Hermes) into the messages.
    pub by_template: bool,
    /// Mistral: the id of `[TOOL_CALLS]` when it is one token of the
    /// vocabulary (the grammar then emits that token, as the model was
    /// trained to; the output text does not show it).
    call_token: Option<u32>,
}

/// Mistral's call marker.
const MISTRAL_CALLS: &str = "[TOOL_CALLS]";

/// Llama 3.1's marker before a call in "ipython" mode (a control token, so
/// not in the output text; accepted if it is).
const LLAMA_PYTHON_TAG: &str = "<|python_tag|>";

impl ToolFormat {
    /// Hermes written by Kestrel: for models whose template renders no tools.
    pub const HERMES: ToolFormat = ToolFormat {
        syntax: ToolSyntax::Hermes,
        by_template: false,
        call_token: None,
    };

    /// The format of `model`'s chat template, Hermes when it has none that
    /// renders tools.
    pub fn of_model(model: &ModelContext) -> Self {
        match model.chat_template().and_then(|t| t.tool_syntax()) {
            None => Self::HERMES,
            Some(syntax) => ToolFormat {
                syntax,
                by_template: true,
                call_token: match syntax {
                    ToolSyntax::MistralV3 => model.tokenizer().token_to_id(MISTRAL_CALLS),
                    _ => None,
                },
            },
        }
    }

    /// The key of a call's arguments.
    fn args_key(&self) -> &'static str {
        match self.syntax {
            ToolSyntax::Llama3Json => "parameters",
            _ => "arguments",
        }
    }

    /// Texts that open the calls of an answer (a `tool_choice: auto` answer
    /// that begins with one is calls, any other is text).
    fn openers(&self) -> &'static [&'static str] {
        match self.syntax {
            ToolSyntax::Hermes => &["<tool_call>"],
            ToolSyntax::Llama3Json => &["{", LLAMA_PYTHON_TAG],
            ToolSyntax::MistralV3 => &[MISTRAL_CALLS, "[{"],
        }
    }

    /// Text that closes a call (or all of them): after a whole call, only
    /// this (or a beginning of it) is not the start of another.
    fn closers(&self) -> &'static [&'static str] {
        match self.syntax {
            ToolSyntax::Hermes => &["</tool_call>"],
            ToolSyntax::Llama3Json => &[],
            ToolSyntax::MistralV3 => &["]"],
        }
    }

    /// Text around and between calls.
    fn frame(&self) -> &'static [&'static str] {
        match self.syntax {
            ToolSyntax::Hermes => &["<tool_call>", "</tool_call>"],
            ToolSyntax::Llama3Json => &[LLAMA_PYTHON_TAG, ";"],
            ToolSyntax::MistralV3 => &[MISTRAL_CALLS, "[", ",", "]"],
        }
    }
}

/// One function a client offers.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    pub name: String,
    pub description: Option<String>,
    /// A JSON Schema for the arguments object.
    pub parameters: Value,
}

/// What `tool_choice` asks of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Answer with text or calls.
    Auto,
    /// At least one call.
    Required,
    /// Exactly this function.
    Named(String),
}

/// The tools of a request that may call them (`tool_choice` is not `none`).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSet {
    pub functions: Vec<Function>,
    pub choice: ToolChoice,
    /// More than one call per answer allowed (never with Llama 3's
    /// format, whose template takes one call per turn).
    pub parallel: bool,
    pub format: ToolFormat,
    /// Arguments hold only the properties a parameter schema lists, unless
    /// it allows more explicitly ([`crate::openai::schema::close_objects`]);
    /// `false` (the request's `plain_json_schema`): plain JSON Schema.
    pub closed_objects: bool,
}

/// Parses `tools`, `tool_choice` and `parallel_tool_calls` for a model
/// writing `format`. `None` when no tool may be called (no tools, or
/// `tool_choice: "none"`).
pub fn parse(
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel: Option<bool>,
    format: &ToolFormat,
) -> Result<Option<ToolSet>, ApiError> {
    let list = match tools {
        None => Vec::new(),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(ApiError::invalid("tools", "tools must be an array")),
    };
    let mut functions = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        let f = function(i, t)?;
        if functions.iter().any(|g: &Function| g.name == f.name) {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.name"),
                format!("duplicate function name {:?}", f.name),
            ));
        }
        functions.push(f);
    }
    let choice = match tool_choice {
        None if functions.is_empty() => return Ok(None),
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => return Ok(None),
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "tool_choice must be none, auto, required or a named function, got {s:?}"
                    ),
                ))
            }
        },
        Some(v @ Value::Object(_)) => {
            let name = v
                .pointer("/function/name")
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "tool_choice must look like {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if !functions.iter().any(|f| f.name == name) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice names {name:?}, which is not in tools"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "tool_choice must be a string or an object",
            ))
        }
    };
    if functions.is_empty() {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice needs a non-empty tools list",
        ));
    }
    Ok(Some(ToolSet {
        functions,
        choice,
        parallel: parallel.unwrap_or(true) && format.syntax != ToolSyntax::Llama3Json,
        format: format.clone(),
        closed_objects: true,
    }))
}

fn function(i: usize, t: Value) -> Result<Function, ApiError> {
    let param = format!("tools[{i}]");
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(ApiError::invalid(
            format!("{param}.type"),
            "only tools of type \"function\" are supported",
        ));
    }
    let f = t
        .get("function")
        .filter(|f| f.is_object())
        .ok_or_else(|| ApiError::invalid(format!("{param}.function"), "must be an object"))?;
    let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
    let name_ok = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !name_ok {
        return Err(ApiError::invalid(
            format!("{param}.function.name"),
            format!("must be 1 to {MAX_NAME_BYTES} characters of a-z, A-Z, 0-9, _ and -"),
        ));
    }
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{param}.function.parameters"),
                "must be a JSON Schema object",
            ))
        }
    };
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{param}.function.description"),
                "must be a string",
            ))
        }
    };
    Ok(Function {
        name: name.to_string(),
        description,
        parameters,
    })
}

impl Function {
    /// OpenAI's tool object, as templates and the Hermes prompt show it.
    fn tool_json(&self) -> Value {
        let mut function = json!({"name": self.name});
        if let Some(d) = &self.description {
            function["description"] = json!(d);
        }
        function["parameters"] = self.parameters.clone();
        json!({"type": "function", "function": function})
    }
}
