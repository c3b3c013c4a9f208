//! Chat templates: the model's own Jinja template (GGUF
//! `tokenizer.chat_template`, HF `tokenizer_config.json` `chat_template`),
//! rendered with minijinja the way `transformers` renders it (trim_blocks,
//! lstrip_blocks, `raise_exception`, Python string methods, `tojson` with
//! Python's separators), with ChatML as the fallback for models that ship
//! none. A conversation may carry tool calls and tool results and the
//! request's `tools`, which templates that know them render themselves;
//! [`ChatTemplate::tool_syntax`] says which call syntax such a template
//! writes.

use minijinja::{context, Environment, Error as JinjaError, ErrorKind};
use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};
use serde_json::Value;

use crate::ModelError;

/// ChatML, used when a model has no template.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// One turn of a conversation. Templates see `role`, `content`, and, only
/// when present, `tool_calls` (an assistant's calls) and `tool_call_id` (a
/// `tool` result's call), as Hugging Face's `apply_chat_template` gets them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool` (or whatever the template accepts).
    pub role: String,
    pub content: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// An assistant's earlier call of a function, seen by templates as
/// `{"id", "type": "function", "function": {"name", "arguments"}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON (templates apply `tojson` to them); a string
    /// when the caller's arguments text was not JSON.
    pub arguments: Value,
}

impl Serialize for ToolCall {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Function<'a> {
            name: &'a str,
            arguments: &'a Value,
        }
        let mut m = s.serialize_map(Some(3))?;
        m.serialize_entry("id", &self.id)?;
        m.serialize_entry("type", "function")?;
        m.serialize_entry(
            "function",
            &Function {
                name: &self.name,
                arguments: &self.arguments,
            },
        )?;
        m.end()
    }
}

/// How a chat template writes a model's tool calls, when it renders
/// `tools` and `tool_calls` itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, results
    /// in `<tool_response>` (Hermes 2 Pro, Qwen 2.5 and 3).
    Hermes,
    /// A bare `{"name": ..., "parameters": {...}}`, one call per turn,
    /// results in the `ipython` role (Llama 3.1 and 3.2).
    Llama3Json,
    /// `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, results in
    /// `[TOOL_RESULTS]`, call ids of nine alphanumerics (Mistral's v3
    /// tokenizer templates: Mistral 7B v0.3, Nemo).
    MistralV3,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A model's chat template with the special-token strings it may reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTemplate {
    /// Jinja source.
    pub source: String,
    /// True when the model shipped no template and [`CHATML_TEMPLATE`] is used.
    pub is_fallback: bool,
    /// Exposed to the template as `bos_token` (empty if the model has none).
    pub bos_token: String,
    /// Exposed to the template as `eos_token`.
    pub eos_token: String,
}

impl ChatTemplate {
    /// A template from source; fails if it does not compile.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, ModelError> {
        let t = ChatTemplate {
            source: source.into(),
            is_fallback: false,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        };
        t.environment()
            .map_err(|source| ModelError::ChatTemplate { source })?;
        Ok(t)
    }

    /// The ChatML fallback.
    pub fn chatml() -> Self {
        ChatTemplate {
            source: CHATML_TEMPLATE.into(),
            is_fallback: true,
            bos_token: String::new(),
            eos_token: "<|im_end|>".into(),
        }
    }

    /// `source` if present (and compiling), else ChatML.
    pub fn from_optional(
        source: Option<&str>,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Self, ModelError> {
        match source {
            Some(s) if !s.trim().is_empty() => Self::new(s, bos_token, eos_token),
            _ => Ok(ChatTemplate {
                bos_token: bos_token.into(),
                eos_token: eos_token.into(),
                ..Self::chatml()
            }),
        }
    }

    /// The tool-call syntax this template renders `tools` and `tool_calls`
    /// in, read from its text; `None` when it renders no tools (or in a
    /// syntax Kestrel does not know).
    pub fn tool_syntax(&self) -> Option<ToolSyntax> {
        let s = self.source.as_str();
        if self.is_fallback || !s.contains("tools") || !s.contains("tool_calls") {
            return None;
        }
        if s.contains("[TOOL_CALLS]") && s.contains("[AVAILABLE_TOOLS]") {
            Some(ToolSyntax::MistralV3)
        } else if s.contains("<|start_header_id|>")
            && s.contains("\"parameters\": ")
            && s.contains("ipython")
        {
            Some(ToolSyntax::Llama3Json)
        } else if s.contains("<tool_call>") && s.contains("<tool_response>") {
            Some(ToolSyntax::Hermes)
        } else {
            None
        }
    }

    fn environment(&self) -> Result<Environment<'_>, JinjaError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_filter("tojson", tojson);
        env.add_template("chat", &self.source)?;
        Ok(env)
    }

    /// Renders the conversation; with `add_generation_prompt` the result ends
    /// where the assistant's reply should begin.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`Self::render`] with the request's `tools` (OpenAI's
    /// `{"type": "function", "function": {...}}` objects) given to the
    /// template as `tools`; none is `tools` undefined, as in `transformers`.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        let wrap = |source| ModelError::ChatTemplate { source };
        let env = self.environment().map_err(wrap)?;
        let tmpl = env.get_template("chat").map_err(wrap)?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            tools => (!tools.is_empty()).then_some(tools),
        })
        .map_err(wrap)
    }
}

/// `tojson` as `transformers` defines it: `json.dumps` with
/// `ensure_ascii=False`, Python's separators (`", "` and `": "`, or `","`
/// and a newline with `indent`) and no HTML escaping (minijinja's own
/// escapes `<`, `>`, `&` and `'`, which would change what the model sees).
fn tojson(
    value: &minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let ser = |e: serde_json::Error| {
        JinjaError::new(ErrorKind::InvalidOperation, "tojson failed").with_source(e)
    };
    match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut s = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&pad),
            );
            value.serialize(&mut s).map_err(ser)?;
        }
        None => {
            let mut s = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
            value.serialize(&mut s).map_err(ser)?;
        }
    }
    let text = String::from_utf8(out).expect("serde_json writes UTF-8");
    Ok(minijinja::Value::from_safe_string(text))
}

/// Python `json.dumps`'s default separators: `", "` between items, `": "`
/// after keys.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M-Instruct's template, as stored in its GGUF.
    pub(crate) const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn smollm2_system_and_user() {
        let t = ChatTemplate::new(SMOLLM2_TEMPLATE, "<|im_start|>", "<|im_end|>").unwrap();
        let msgs = [
            ChatMessage::system("Be brief."),
            ChatMessage::user("What is the capital of France?"),
        ];
        assert_eq!(
            t.render(&msgs, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        );
        // Without a system message the template injects its default one.
        let out = t.render(&[ChatMessage::user("Hi")], false).unwrap();
        assert!(out.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
        assert!(out.ends_with("<|im_start|>user\nHi<|im_end|>\n"));
    }

    #[test]
    fn chatml_fallback() {
        let t = ChatTemplate::from_optional(None, "", "<|im_end|>").unwrap();
        assert!(t.is_fallback);
        assert_eq!(
            t.render(&[ChatMessage::user("Hi")], true).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn hf_style_features() {
        // raise_exception, pycompat methods, bos_token, trim/lstrip blocks.
        let src = "{{ bos_token }}{% for m in messages %}\n  {% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}\n[{{ m.role.upper() }}] {{ m.content.strip() }}\n{% endfor %}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        assert_eq!(
            t.render(&[ChatMessage::user("  hi ")], false).unwrap(),
            "<s>[USER] hi\n"
        );
        match t.render(&[ChatMessage::system("x")], false) {
            Err(ModelError::ChatTemplate { source }) => {
                assert!(source.to_string().contains("bad role system"))
            }
            other => panic!("{other:?}"),
        }
        // {% break %} / {% continue %} (HF enables jinja2.ext.loopcontrols).
        let first_only = ChatTemplate::new(
            "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let two = [ChatMessage::user("a"), ChatMessage::assistant("b")];
        assert_eq!(first_only.render(&two, false).unwrap(), "a");
        assert!(matches!(
            ChatTemplate::new("{% for %}", "", ""),
            Err(ModelError::ChatTemplate { .. })
        ));
    }
}
