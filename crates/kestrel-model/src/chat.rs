//! Chat templates: the model's own Jinja template (GGUF
//! `tokenizer.chat_template`, HF `tokenizer_config.json` `chat_template`),
//! rendered with minijinja the way `transformers` renders it (trim_blocks,
//! lstrip_blocks, `raise_exception`, Python string methods), with ChatML as
//! the fallback for models that ship none.

use minijinja::{context, Environment, Error as JinjaError, ErrorKind};
use serde::Serialize;

use crate::ModelError;

/// ChatML, used when a model has no template.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or whatever the template accepts).
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
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
        let wrap = |source| ModelError::ChatTemplate { source };
        let env = self.environment().map_err(wrap)?;
        let tmpl = env.get_template("chat").map_err(wrap)?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            tools => Option::<()>::None,
        })
        .map_err(wrap)
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
