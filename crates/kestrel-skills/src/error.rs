//! The crate's one error type, [`SkillError`].
//!
//! Every variant is raised while a context or a request's skill is being
//! built, so a bad schema, regex, grammar or stop list is rejected at
//! submission, before the engine reserves any KV. Running skills never fail:
//! a constraint that breaks mid-generation ends the request instead.

use kestrel_pipeline::TokenId;

/// Boxed cause from a dependency whose own error type is already boxed
/// (`tokenizers::Error`).
pub type BoxedCause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a skill context or a request's skill could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SkillError {
    /// The JSON schema was rejected by the grammar compiler.
    #[error("invalid JSON schema: {reason}")]
    InvalidJsonSchema { reason: String },

    /// The regular expression does not compile.
    #[error("invalid regex {regex:?}: {reason}")]
    InvalidRegex { regex: String, reason: String },

    /// The Lark grammar does not compile.
    #[error("invalid grammar: {reason}")]
    InvalidGrammar { reason: String },

    /// The constraint compiles, but exploring its lexer exceeds
    /// [`crate::LEXER_BUDGET`] or computing its first token mask exceeds
    /// the constraint engine's limits ([`crate::PARSER_LIMITS`]): e.g.
    /// nested counted repetitions such as `(a{1,50}){1,50}`.
    #[error("the {kind} constraint is too complex for the constraint engine: {reason}")]
    ConstraintTooComplex { kind: &'static str, reason: String },

    /// A choice skill was given no options.
    #[error("choice list is empty")]
    EmptyChoice,

    /// One of the choice options is the empty string.
    #[error("choice option {index} is empty")]
    EmptyChoiceOption { index: usize },

    /// A stop string is empty (it would match before any output).
    #[error("stop string {index} is empty")]
    EmptyStopString { index: usize },

    /// A stop token id is not in the vocabulary.
    #[error("stop token id {token} is outside the vocabulary (size {vocab_size})")]
    StopTokenOutOfRange { token: TokenId, vocab_size: usize },

    /// The model declares no end-of-sequence token.
    #[error("the model declares no end-of-sequence token")]
    NoEosToken,

    /// An end-of-sequence id is not in the vocabulary.
    #[error("end-of-sequence id {token} is outside the vocabulary (size {vocab_size})")]
    EosOutOfRange { token: TokenId, vocab_size: usize },

    /// The model's vocabulary is smaller than the tokenizer's.
    #[error("model vocabulary ({model}) is smaller than the tokenizer's ({tokenizer})")]
    VocabTooSmall { model: usize, tokenizer: usize },

    /// The tokenizer's decoder is neither byte-level BPE nor byte-fallback,
    /// so token bytes cannot be recovered exactly.
    #[error("unsupported tokenizer: {reason}")]
    UnsupportedTokenizer { reason: String },

    /// The grammar engine could not be initialised for this vocabulary.
    #[error("cannot build the constraint engine for this tokenizer: {reason}")]
    ConstraintEngine { reason: String },

    /// The tokenizer failed to encode a prompt.
    #[error("tokenizer failed to encode the prompt")]
    Encode {
        #[source]
        source: BoxedCause,
    },

    /// The chat template failed to render the messages.
    #[error("chat template failed to render")]
    ChatTemplate {
        #[source]
        source: BoxedCause,
    },

    /// A chat prompt was submitted but the context has no chat template.
    #[error("this model has no chat template; submit a raw prompt")]
    NoChatTemplate,
}
