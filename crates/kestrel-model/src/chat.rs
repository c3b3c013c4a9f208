//! Chat templates: the model's own Jinja template (GGUF
//! `tokenizer.chat_template`, HF `tokenizer_config.json` `chat_template`),
//! rendered with minijinja the way `transformers` renders it (trim_blocks,
//! lstrip_blocks, `raise_exception`, Python string methods, `tojson` with
//! Python's separators). A model that ships none gets its family's own
//! template when the family is known and its turn markers are tokens of
//! the vocabulary (Gemma 3), else ChatML when `<|im_start|>` and
//! `<|im_end|>` are, else none: chat is refused until `--chat-template`
//! names one ([`ChatTemplate::for_model`]); never markers the tokenizer
//! would split into text. A conversation may carry tool calls and tool results and the
//! request's `tools`, which templates that know them render themselves;
//! [`ChatTemplate::tool_syntax`] says which call syntax such a template
//! writes.

use minijinja::{context, Environment, Error as JinjaError, ErrorKind};
use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};
use serde_json::Value;
use std::path::{Path, PathBuf};

use crate::{Family, ModelError};

/// Gemma 3's template as google/gemma-3-*-it publish it (the fixture the
/// template tests compare with jinja2's rendering).
pub const GEMMA3_TEMPLATE: &str = include_str!("../../../tests/chat_templates/gemma3.jinja");

/// ChatML, used when a model has no template but ChatML's markers are
/// tokens of its vocabulary.
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

/// Where a chat template came from (the load logs it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateOrigin {
    /// The model's own (GGUF `tokenizer.chat_template`, HF `chat_template`).
    Model,
    /// The model shipped none: its family's template, whose turn markers
    /// are tokens of its vocabulary.
    Family(Family),
    /// The model shipped none: [`CHATML_TEMPLATE`], whose markers are
    /// tokens of its vocabulary.
    ChatMl,
    /// A file the operator named (`--chat-template`).
    File(PathBuf),
}

impl std::fmt::Display for TemplateOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TemplateOrigin::Model => f.write_str("the model's own chat template"),
            TemplateOrigin::Family(family) => {
                write!(f, "Kestrel's {family} chat template (the model ships none)")
            }
            TemplateOrigin::ChatMl => f.write_str("ChatML (the model ships no chat template)"),
            TemplateOrigin::File(p) => write!(f, "the chat template in {}", p.display()),
        }
    }
}

/// A family's chat template and the tokens that mark its turns.
struct FamilyTemplate {
    source: &'static str,
    /// Every one must be a token of the vocabulary.
    markers: [&'static str; 2],
    /// Ends the model's turn: an end of sequence for chat.
    turn_end: &'static str,
}

/// The template a model without one gets for its family, if Kestrel has it.
fn family_template(family: Family) -> Option<FamilyTemplate> {
    match family {
        Family::Gemma3 => Some(FamilyTemplate {
            source: GEMMA3_TEMPLATE,
            markers: ["<start_of_turn>", "<end_of_turn>"],
            turn_end: "<end_of_turn>",
        }),
        Family::Llama | Family::Mistral | Family::Qwen2 | Family::Qwen3 | Family::Phi => None,
    }
}

/// ChatML's markers; its turns end with the second.
const CHATML_MARKERS: [&str; 2] = ["<|im_start|>", "<|im_end|>"];

/// A model's chat template with the special-token strings it may reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTemplate {
    /// Jinja source.
    pub source: String,
    /// Where it came from.
    pub origin: TemplateOrigin,
    /// The marker that ends an assistant turn when the template is not the
    /// model's own (`<end_of_turn>`, `<|im_end|>`): the model's loader adds
    /// its id to the end-of-sequence ids.
    pub turn_end: Option<&'static str>,
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
            origin: TemplateOrigin::Model,
            turn_end: None,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        };
        t.environment()
            .map_err(|source| ModelError::ChatTemplate { source })?;
        Ok(t)
    }

    /// ChatML (for models and tests whose vocabulary has its markers).
    pub fn chatml() -> Self {
        ChatTemplate {
            source: CHATML_TEMPLATE.into(),
            origin: TemplateOrigin::ChatMl,
            turn_end: Some(CHATML_MARKERS[1]),
            bos_token: String::new(),
            eos_token: CHATML_MARKERS[1].into(),
        }
    }

    /// The template a model's chat is rendered with: its own `source` if it
    /// ships one (and it compiles); else its family's, when Kestrel has it
    /// and `is_token` says its turn markers are single tokens; else ChatML
    /// when its markers are; else `None` (chat requests are refused until
    /// an operator names a template, [`ChatTemplate::from_file`]).
    pub fn for_model(
        source: Option<&str>,
        family: Option<Family>,
        is_token: impl Fn(&str) -> bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Option<Self>, ModelError> {
        if let Some(s) = source.filter(|s| !s.trim().is_empty()) {
            return Self::new(s, bos_token, eos_token).map(Some);
        }
        let with = |source: &str, origin, turn_end| ChatTemplate {
            source: source.into(),
            origin,
            turn_end: Some(turn_end),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        };
        if let Some(family) = family {
            if let Some(t) = family_template(family) {
                if t.markers.iter().all(|m| is_token(m)) {
                    return Ok(Some(with(
                        t.source,
                        TemplateOrigin::Family(family),
                        t.turn_end,
                    )));
                }
            }
        }
        if CHATML_MARKERS.iter().all(|m| is_token(m)) {
            return Ok(Some(with(
                CHATML_TEMPLATE,
                TemplateOrigin::ChatMl,
                CHATML_MARKERS[1],
            )));
        }
        Ok(None)
    }

    /// The template in the file at `path` (`--chat-template`): Jinja
    /// source, as a model would ship it.
    pub fn from_file(path: &Path, bos_token: &str, eos_token: &str) -> Result<Self, ModelError> {
        let source = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let t = Self::new(source, bos_token, eos_token)?;
        Ok(ChatTemplate {
            origin: TemplateOrigin::File(path.to_path_buf()),
            ..t
        })
    }

    /// The tool-call syntax this template renders `tools` and `tool_calls`
    /// in, read from its text; `None` when it renders no tools (or in a
    /// syntax Kestrel does not know).
    pub fn tool_syntax(&self) -> Option<ToolSyntax> {
        let s = self.source.as_str();
        if self.origin == TemplateOrigin::ChatMl
            || !s.contains("tools")
            || !s.contains("tool_calls")
        {
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

    /// A vocabulary of these tokens.
    fn vocab(tokens: &'static [&'static str]) -> impl Fn(&str) -> bool {
        move |t| tokens.contains(&t)
    }

    #[test]
    fn a_model_without_a_template_gets_one_its_vocabulary_spells() {
        const GEMMA: &[&str] = &["<start_of_turn>", "<end_of_turn>", "<bos>"];
        const CHATML: &[&str] = &["<|im_start|>", "<|im_end|>"];
        // Gemma 3 with its turn markers in the vocabulary: its own template.
        let t = ChatTemplate::for_model(None, Some(Family::Gemma3), vocab(GEMMA), "<bos>", "<eos>")
            .unwrap()
            .unwrap();
        assert_eq!(t.origin, TemplateOrigin::Family(Family::Gemma3));
        assert_eq!(t.turn_end, Some("<end_of_turn>"));
        assert_eq!(
            t.render(&[ChatMessage::user("Hi")], true).unwrap(),
            "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
        );
        // ChatML only where its markers are tokens.
        let t = ChatTemplate::for_model(Some(" "), None, vocab(CHATML), "", "<|im_end|>")
            .unwrap()
            .unwrap();
        assert_eq!(t.origin, TemplateOrigin::ChatMl);
        assert_eq!(
            t.render(&[ChatMessage::user("Hi")], true).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        // Neither: no template (a Gemma vocabulary without its markers, a
        // Llama one without ChatML's).
        for family in [Some(Family::Gemma3), Some(Family::Llama), None] {
            assert_eq!(
                ChatTemplate::for_model(None, family, vocab(&["<bos>"]), "", "").unwrap(),
                None
            );
        }
        // A shipped template wins, whatever the vocabulary.
        let own = ChatTemplate::for_model(
            Some("{{ 'x' }}"),
            Some(Family::Gemma3),
            vocab(GEMMA),
            "",
            "",
        )
        .unwrap()
        .unwrap();
        assert_eq!((own.origin, own.turn_end), (TemplateOrigin::Model, None));
    }

    #[test]
    fn a_template_file_is_read_and_a_broken_one_says_why() {
        let dir = std::env::temp_dir().join(format!("kestrel-chat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.jinja");
        std::fs::write(&good, "{% for m in messages %}[{{ m.role }}]{% endfor %}").unwrap();
        let t = ChatTemplate::from_file(&good, "", "").unwrap();
        assert_eq!(t.origin, TemplateOrigin::File(good.clone()));
        assert_eq!(
            t.render(&[ChatMessage::user("Hi")], false).unwrap(),
            "[user]"
        );
        let broken = dir.join("broken.jinja");
        std::fs::write(&broken, "{% for m in messages %}{{ m.content }").unwrap();
        let e = ChatTemplate::from_file(&broken, "", "").unwrap_err();
        // The cause is kept (typed) and its reason reaches whoever prints
        // the error's chain.
        let source = std::error::Error::source(&e).expect("minijinja's error is the source");
        assert!(source.to_string().contains("syntax error"), "{source}");
        assert!(matches!(
            ChatTemplate::from_file(&dir.join("missing.jinja"), "", ""),
            Err(ModelError::Io { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
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
