//! The crate's one error type, [`SkillError`].
//!
//! Every variant is raised while a context or a request's skill is being
//! built, so a bad schema, regex, grammar or stop list is rejected at
//! submission, before the engine reserves any KV. Running skills never fail:
//! a constraint that breaks mid-generation ends the request instead.

use std::sync::Arc;

use kestrel_pipeline::TokenId;

/// Boxed cause from a dependency whose own error type is already boxed
/// (`tokenizers::Error`).
pub type BoxedCause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A failure of the constraint engine (llguidance), kept whole: it reads
/// as llguidance's message without the `<non-verbose/>` marker llguidance
/// ends it with, and [`source`](std::error::Error::source) is what
/// llguidance's error wraps, if anything. Shared, not copied, on clone, so
/// a failed output's [`ConstraintFailure`] can be reported as the source
/// of the caller's error while the skill keeps it.
#[derive(Debug, Clone)]
pub struct ConstraintCause(Arc<dyn std::error::Error + Send + Sync + 'static>);

impl ConstraintCause {
    /// llguidance's error (an `anyhow::Error`, or a message string).
    pub(crate) fn new(e: impl Into<BoxedCause>) -> Self {
        ConstraintCause(Arc::from(e.into()))
    }
}

impl std::fmt::Display for ConstraintCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = self.0.to_string();
        let text = text.trim_end();
        f.write_str(
            text.strip_suffix("<non-verbose/>")
                .unwrap_or(text)
                .trim_end(),
        )
    }
}

impl std::error::Error for ConstraintCause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Why a running constrained output stopped satisfying its constraint
/// ([`crate::Skill::constraint_error`]); such an output is a failure.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ConstraintFailure {
    /// The model ended (EOS) before the output was a complete sentence.
    #[error("end of sequence before the output was complete")]
    EndedEarly,
    /// The constraint engine failed at one `step` (`"consuming a token"`,
    /// `"computing a mask"`, `"rolling back drafts"`).
    #[error("the constraint engine failed {step}: {source}")]
    Engine {
        step: &'static str,
        #[source]
        source: ConstraintCause,
    },
}

/// Why a constraint was refused as too complex.
#[derive(Debug, thiserror::Error)]
pub enum TooComplex {
    /// Building the lexer's first `states` states of each lexeme (breadth
    /// first from its initial state) needs more than `fuel` lexer
    /// expressions ([`crate::LEXER_BUDGET`]).
    #[error(
        "its lexer needs more than {fuel} expressions for the first {states} states of a lexeme"
    )]
    LexerBudget {
        fuel: u64,
        states: usize,
        #[source]
        source: ConstraintCause,
    },
    /// From one of those states the lexer allows one byte only, again and
    /// again, for longer than one mask step's `fuel` lets the parser walk
    /// (`(a{1000}){1000}` forces a million bytes).
    #[error("a run of bytes it forces needs more than one mask step's {fuel} lexer expressions (gave up after {bytes} bytes)")]
    ForcedRun { fuel: u64, bytes: usize },
    /// The constraint engine failed within its own limits
    /// ([`crate::PARSER_LIMITS`]) building the lexer or the first mask.
    #[error("{source}")]
    Engine {
        #[source]
        source: ConstraintCause,
    },
}

/// Why a skill context or a request's skill could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SkillError {
    /// The JSON schema was rejected by the grammar compiler.
    #[error("invalid JSON schema: {source}")]
    InvalidJsonSchema {
        #[source]
        source: ConstraintCause,
    },

    /// The regular expression does not compile.
    #[error("invalid regex {regex:?}: {source}")]
    InvalidRegex {
        regex: String,
        #[source]
        source: ConstraintCause,
    },

    /// The Lark grammar does not compile.
    #[error("invalid grammar: {source}")]
    InvalidGrammar {
        #[source]
        source: ConstraintCause,
    },

    /// The constraint compiles, but its first mask cannot be computed
    /// within [`crate::LEXER_BUDGET`] or the constraint engine's limits
    /// ([`crate::PARSER_LIMITS`]): e.g. nested counted repetitions such as
    /// `(a{1000}){1000}`.
    #[error("the {kind} constraint is too complex for the constraint engine: {source}")]
    ConstraintTooComplex {
        kind: &'static str,
        #[source]
        source: TooComplex,
    },

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
    #[error("this model has no chat template: name one with --chat-template FILE, or submit a raw prompt")]
    NoChatTemplate,
}
