//! [`SkillContext`]: everything per model that skills share, built once.
//!
//! Holds the tokenizer, the end-of-sequence ids, the logits vocabulary size,
//! the token-bytes trie (O(1) bytes per token for streaming detokenization)
//! and llguidance's `ParserFactory` (expensive: tokenizer slices are
//! precomputed). Requests share it through an `Arc`; it is immutable.

use std::fmt;
use std::sync::Arc;

use kestrel_pipeline::TokenId;
use llguidance::ParserFactory;
use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;
use toktrie::{TokEnv, TokTrie};

use crate::error::SkillError;
use crate::vocab::build_tok_env;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// What the model is asked to continue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Prompt {
    /// Raw text, tokenized with the tokenizer's special-token post-processing.
    Raw(String),
    /// Messages, rendered with the model's chat template (with the
    /// generation prompt appended), then tokenized as-is.
    Chat(Vec<ChatMessage>),
}

/// Renders chat messages into prompt text. The engine supplies the model's
/// template (kestrel-model owns the Jinja renderer); [`ChatMlTemplate`] is the
/// built-in ChatML format used by SmolLM2 and Qwen-style models.
pub trait ChatTemplate: Send + Sync {
    /// Render `messages` followed by the assistant generation prompt.
    fn render(&self, messages: &[ChatMessage]) -> Result<String, crate::error::BoxedCause>;
}

/// ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then
/// `<|im_start|>assistant\n`. An optional system prompt is prepended when the
/// conversation has none (SmolLM2's template does this).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChatMlTemplate {
    pub default_system: Option<String>,
}

impl ChatTemplate for ChatMlTemplate {
    fn render(&self, messages: &[ChatMessage]) -> Result<String, crate::error::BoxedCause> {
        let mut out = String::new();
        let has_system = messages.first().is_some_and(|m| m.role == "system");
        if let (false, Some(system)) = (has_system, &self.default_system) {
            out.push_str("<|im_start|>system\n");
            out.push_str(system);
            out.push_str("<|im_end|>\n");
        }
        for m in messages {
            out.push_str("<|im_start|>");
            out.push_str(&m.role);
            out.push('\n');
            out.push_str(&m.content);
            out.push_str("<|im_end|>\n");
        }
        out.push_str("<|im_start|>assistant\n");
        Ok(out)
    }
}

/// Inputs to [`SkillContext::new`].
pub struct SkillContextConfig {
    pub tokenizer: Arc<Tokenizer>,
    /// Token ids that end generation (non-empty). The first is the primary EOS.
    pub eos_token_ids: Vec<TokenId>,
    /// Rows of the model's logits; `None` means the tokenizer's vocabulary
    /// size. Must be at least the tokenizer's size (extra rows are padding).
    pub vocab_size: Option<usize>,
    /// The model's chat template, if it has one.
    pub chat_template: Option<Arc<dyn ChatTemplate>>,
}

impl fmt::Debug for SkillContextConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SkillContextConfig")
            .field("eos_token_ids", &self.eos_token_ids)
            .field("vocab_size", &self.vocab_size)
            .field("chat_template", &self.chat_template.is_some())
            .finish_non_exhaustive()
    }
}

/// Per-model state shared by every request's skill.
pub struct SkillContext {
    tokenizer: Arc<Tokenizer>,
    tok_env: TokEnv,
    factory: ParserFactory,
    eos: Vec<TokenId>,
    vocab_size: usize,
    chat_template: Option<Arc<dyn ChatTemplate>>,
}

impl fmt::Debug for SkillContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SkillContext")
            .field("eos", &self.eos)
            .field("vocab_size", &self.vocab_size)
            .field("chat_template", &self.chat_template.is_some())
            .finish_non_exhaustive()
    }
}

impl SkillContext {
    /// Builds the token trie and the grammar compiler for this tokenizer.
    /// Expensive (a pass over the vocabulary plus llguidance's slice
    /// precomputation); do it once per loaded model.
    pub fn new(config: SkillContextConfig) -> Result<Arc<Self>, SkillError> {
        let SkillContextConfig {
            tokenizer,
            eos_token_ids,
            vocab_size,
            chat_template,
        } = config;
        let vocab_size = vocab_size.unwrap_or_else(|| tokenizer.get_vocab_size(true));
        if eos_token_ids.is_empty() {
            return Err(SkillError::NoEosToken);
        }
        if let Some(&token) = eos_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(SkillError::EosOutOfRange { token, vocab_size });
        }
        let tok_env = build_tok_env(&tokenizer, vocab_size, &eos_token_ids)?;
        let mut factory =
            ParserFactory::new_simple(&tok_env).map_err(|e| SkillError::ConstraintEngine {
                reason: e.to_string(),
            })?;
        factory.quiet();
        set_limits(factory.limits_mut());
        Ok(Arc::new(Self {
            tokenizer,
            tok_env,
            factory,
            eos: eos_token_ids,
            vocab_size,
            chat_template,
        }))
    }

    /// Rows of the model's logits; masks have [`kestrel_pipeline::TokenMask::words_for`] of this many words.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn eos_token_ids(&self) -> &[TokenId] {
        &self.eos
    }

    pub fn is_eos(&self, token: TokenId) -> bool {
        self.eos.contains(&token)
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The raw bytes of `token` (empty past the vocabulary). Special tokens
    /// start with [`TokTrie::SPECIAL_TOKEN_MARKER`] (`0xFF`, never valid UTF-8).
    pub fn token_bytes(&self, token: TokenId) -> &[u8] {
        self.trie().token(token)
    }

    /// The most bytes any one token stands for (control tokens count their
    /// marker and name, the text they tokenize from).
    pub fn max_token_bytes(&self) -> usize {
        self.trie().max_token_len()
    }

    /// Whether `token` is a control token (never part of the output text).
    pub fn is_special(&self, token: TokenId) -> bool {
        let b = self.token_bytes(token);
        b.is_empty() || b[0] == TokTrie::SPECIAL_TOKEN_MARKER
    }

    pub(crate) fn trie(&self) -> &TokTrie {
        self.tok_env.tok_trie()
    }

    pub(crate) fn parser_factory(&self) -> &ParserFactory {
        &self.factory
    }

    /// Renders (for chats) and tokenizes a prompt.
    pub fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<TokenId>, SkillError> {
        let (text, add_special) = match prompt {
            Prompt::Raw(text) => (std::borrow::Cow::Borrowed(text.as_str()), true),
            Prompt::Chat(messages) => {
                let template = self
                    .chat_template
                    .as_ref()
                    .ok_or(SkillError::NoChatTemplate)?;
                let rendered = template
                    .render(messages)
                    .map_err(|source| SkillError::ChatTemplate { source })?;
                (std::borrow::Cow::Owned(rendered), false)
            }
        };
        let enc = self
            .tokenizer
            .encode(text.as_ref(), add_special)
            .map_err(|source| SkillError::Encode { source })?;
        Ok(enc.get_ids().to_vec())
    }
}

/// The constraint engine's limits, set here explicitly rather than left to
/// llguidance's defaults, so they are part of Kestrel's contract. A
/// constraint whose first mask exceeds them, or whose lexer cannot be
/// explored within [`crate::LEXER_BUDGET`], is refused at submission
/// ([`crate::SkillError::ConstraintTooComplex`]); one that passes and
/// still exceeds them later ends its request with an error, never with a
/// normal stop.
pub const PARSER_LIMITS: llguidance::api::ParserLimits = llguidance::api::ParserLimits {
    max_items_in_row: 2_000,
    initial_lexer_fuel: 1_000_000,
    // One mask step may spend what validation spent exploring the lexer
    // (`spec::LEXER_BUDGET.fuel`): a constraint validation accepted then
    // never runs out mid-generation (at worst 20-100 ms for one step of a
    // pathological constraint; typical steps spend a few hundred).
    step_lexer_fuel: 2_000_000,
    step_max_items: 50_000,
    max_lexer_states: 250_000,
    max_grammar_size: 500_000,
    precompute_large_lexemes: true,
    // Errors reach clients: keep them to the reason, without the grammar.
    verbose_errors: false,
};

fn set_limits(limits: &mut llguidance::api::ParserLimits) {
    *limits = PARSER_LIMITS.clone();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{self, IM_END, IM_START};

    #[test]
    fn chat_prompt_uses_special_tokens() {
        let ctx = testing::small_context();
        let ids = ctx
            .encode_prompt(&Prompt::Chat(vec![ChatMessage::new("user", "hello")]))
            .unwrap();
        assert_eq!(ids[0], IM_START);
        assert!(ids.contains(&IM_END));
        assert_eq!(*ids.last().unwrap(), b'\n' as TokenId);
        let text = ctx.trie().decode_str(&ids);
        assert_eq!(
            text,
            "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raw_prompt_and_missing_template() {
        let ctx = SkillContext::new(SkillContextConfig {
            tokenizer: Arc::new(testing::small_tokenizer()),
            eos_token_ids: vec![IM_END],
            vocab_size: None,
            chat_template: None,
        })
        .unwrap();
        let ids = ctx
            .encode_prompt(&Prompt::Raw("hello world".into()))
            .unwrap();
        assert_eq!(ids.len(), 2);
        let err = ctx.encode_prompt(&Prompt::Chat(vec![])).unwrap_err();
        assert!(matches!(err, SkillError::NoChatTemplate));
    }

    #[test]
    fn eos_is_validated() {
        let mk = |eos: Vec<TokenId>| {
            SkillContext::new(SkillContextConfig {
                tokenizer: Arc::new(testing::small_tokenizer()),
                eos_token_ids: eos,
                vocab_size: None,
                chat_template: None,
            })
        };
        assert!(matches!(mk(vec![]).unwrap_err(), SkillError::NoEosToken));
        assert!(matches!(
            mk(vec![100_000]).unwrap_err(),
            SkillError::EosOutOfRange { token: 100_000, .. }
        ));
    }
}
