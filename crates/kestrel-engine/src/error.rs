//! The crate's one error type, [`EngineError`].
//!
//! Every failure a caller can see, with structured fields so the serving
//! layer maps each variant to a status code without parsing messages, and
//! with typed `#[source]` causes so a caller can print the whole chain:
//! `InvalidArgument` / `InvalidConstraint` / `InvalidImage` / `ChatTemplate` /
//! `Tokenizer` / `ContextOverflow` are the caller's fault, `QueueFull` / `Fatal` / `Stopped` / `ShuttingDown` are
//! retryable elsewhere, `ModelLoad` / `SkillSetup` / `BackendUnavailable`
//! happen at start, `RequestFailed` / `ConstraintFailed` / `SpatialFailed`
//! end one request (`ConstraintFailed` by the caller's constraint,
//! `SpatialFailed` by a fault of the runtime).

use kestrel_pipeline::Cause;

use crate::request::GenerateResponse;
use crate::validate::Field;

/// Why an engine call failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A request field is out of range or malformed.
    #[error("invalid argument `{field}`: {message}")]
    InvalidArgument { field: Field, message: String },

    /// A constraint does not compile, or its first mask cannot be computed
    /// within the constraint engine's limits.
    #[error("invalid argument `{field}`")]
    InvalidConstraint {
        field: Field,
        #[source]
        source: kestrel_skills::SkillError,
    },

    /// A chat prompt the model's chat template could not render (the
    /// template's own error, e.g. minijinja's, is the source).
    #[error("invalid argument `{field}`: the chat template could not render it")]
    ChatTemplate {
        field: Field,
        #[source]
        source: kestrel_model::ModelError,
    },

    /// The image of a vision request is not one the engine decodes (not an
    /// image, truncated, an unsupported format, more pixels than the limit);
    /// the field is always [`Field::Image`].
    #[error("invalid argument `image`")]
    InvalidImage {
        #[source]
        source: kestrel_model::vision::ImageError,
    },

    /// Text (or token ids) the model's tokenizer refused.
    #[error("invalid argument `{field}`: the tokenizer failed")]
    Tokenizer {
        field: Field,
        #[source]
        source: tokenizers::Error,
    },

    /// A chat prompt for a model that ships no chat template, none of whose
    /// fallbacks its vocabulary spells, and no `--chat-template` was named.
    #[error("this model ships no chat template and its vocabulary spells no template Kestrel knows: start the server with --chat-template FILE (a Jinja chat template), or send a raw prompt")]
    NoChatTemplate,

    /// The waiting queue is full; the request was not queued.
    #[error("the waiting queue is full ({limit} requests)")]
    QueueFull { limit: usize },

    /// `prompt_tokens + max_new_tokens` exceeds the context length (rejected,
    /// never clamped, like TGI).
    #[error(
        "prompt of {prompt_tokens} tokens plus max_new_tokens {max_new_tokens} exceeds the context of {limit} tokens"
    )]
    ContextOverflow {
        prompt_tokens: usize,
        max_new_tokens: usize,
        limit: usize,
    },

    /// The engine stopped serving after an engine-fatal fault (the cause).
    #[error("the engine stopped serving after a fault")]
    Fatal(#[source] Cause),

    /// The engine thread is gone (it stopped, or panicked).
    #[error("the engine thread has stopped")]
    Stopped,

    /// The engine thread could not be spawned.
    #[error("cannot spawn the engine thread")]
    Spawn(#[source] std::io::Error),

    /// The model could not be fetched or loaded.
    #[error("failed to load the model")]
    ModelLoad(#[source] kestrel_model::ModelError),

    /// The per-model skill context (token trie, grammar compiler) could not be built.
    #[error("failed to prepare the model's tokenizer for skills")]
    SkillSetup(#[source] kestrel_skills::SkillError),

    /// The requested backend could not start on this machine.
    #[error("the {backend} backend is unavailable")]
    BackendUnavailable {
        backend: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },

    /// The request failed while running (its step was rejected before
    /// dispatch, or the runtime refused it); the engine keeps serving.
    #[error("the request failed")]
    RequestFailed(#[source] Cause),

    /// A constrained output could not continue within its constraint
    /// (the constraint engine ran past its limits mid-generation, or the
    /// vocabulary could not complete the output before EOS). `partial` is
    /// what was generated, with `FinishReason::Error`; it does not satisfy
    /// the constraint. The request's constraint (`field`) is the cause: the
    /// edges answer it as an argument error (INVALID_ARGUMENT / 400), not
    /// as the server's fault, since only tokens the constraint's own mask
    /// allowed were ever sampled.
    #[error("the output stopped satisfying its constraint `{field}`")]
    ConstraintFailed {
        field: Field,
        #[source]
        source: kestrel_skills::ConstraintFailure,
        partial: Box<GenerateResponse>,
    },

    /// A point/detect request's output broke the skill's cycle (a token
    /// its own mask did not allow, or a value out of range). Only tokens
    /// that mask allowed are sampled and the runtime's decoders give
    /// values in range, so this is a fault of the runtime, not of the
    /// request: the edges answer it as the server's (INTERNAL / 500).
    /// `partial` holds the objects completed before it, with
    /// `FinishReason::Error`.
    #[error("the point/detect output was refused")]
    SpatialFailed {
        #[source]
        source: kestrel_skills::SpatialFailure,
        partial: Box<GenerateResponse>,
    },

    /// The engine is shutting down and accepts no new work.
    #[error("the engine is shutting down")]
    ShuttingDown,
}

impl EngineError {
    pub(crate) fn invalid(field: Field, message: impl Into<String>) -> Self {
        EngineError::InvalidArgument {
            field,
            message: message.into(),
        }
    }

    /// The field a caller got wrong, for argument errors.
    pub fn field(&self) -> Option<Field> {
        match self {
            EngineError::InvalidArgument { field, .. }
            | EngineError::InvalidConstraint { field, .. }
            | EngineError::ChatTemplate { field, .. }
            | EngineError::Tokenizer { field, .. } => Some(*field),
            EngineError::NoChatTemplate => Some(Field::Messages),
            EngineError::InvalidImage { .. } => Some(Field::Image),
            _ => None,
        }
    }
}

/// The messages of `e` and of each error in its `source()` chain, with
/// every cause printed once: a cause whose message the error above it
/// already spells out (`#[error("... {source}")]`, a common habit of
/// library errors) is left out rather than repeated.
pub fn error_causes(e: &dyn std::error::Error) -> Vec<String> {
    let mut above = e.to_string();
    let mut out = vec![above.clone()];
    let mut cause = e.source();
    while let Some(c) = cause {
        let msg = c.to_string();
        if !above.contains(&msg) {
            out.push(msg.clone());
        }
        above = msg;
        cause = c.source();
    }
    out
}

/// `e` and its `source()` chain ([`error_causes`]), joined with ": " (for
/// one-line messages such as a gRPC status, an HTTP error body or the CLI).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    error_causes(e).join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("loading {path}: {source}")]
    struct Repeats {
        path: &'static str,
        #[source]
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("the engine did not start")]
    struct Outer(#[source] Repeats);

    /// A cause the error above it already prints is not printed again;
    /// the others all are, in order.
    #[test]
    fn each_cause_is_printed_once() {
        let e = Outer(Repeats {
            path: "m.gguf",
            source: std::io::Error::other("no such file"),
        });
        assert_eq!(
            error_causes(&e),
            ["the engine did not start", "loading m.gguf: no such file"]
        );
        assert_eq!(
            error_chain(&e),
            "the engine did not start: loading m.gguf: no such file"
        );
        let plain = EngineError::Fatal(Cause::new(std::io::Error::other("device lost")));
        assert_eq!(
            error_chain(&plain),
            "the engine stopped serving after a fault: device lost"
        );
    }
}
