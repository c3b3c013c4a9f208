//! The crate's one error type, [`EngineError`].
//!
//! Every failure a caller can see, with structured fields so the serving
//! layer maps each variant to a status code without parsing messages:
//! `InvalidArgument` / `ContextOverflow` are the caller's fault,
//! `QueueFull` / `Unavailable` / `ShuttingDown` are retryable elsewhere,
//! `ModelLoad` / `SkillSetup` / `BackendUnavailable` happen at start.

/// Why an engine call failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A request field is out of range or does not compile (schema, regex, grammar).
    #[error("invalid argument `{field}`: {message}")]
    InvalidArgument {
        field: &'static str,
        message: String,
    },

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

    /// The engine is not serving (an engine-fatal fault, or its thread stopped).
    #[error("engine unavailable: {0}")]
    Unavailable(String),

    /// The model could not be fetched or loaded.
    #[error("failed to load the model")]
    ModelLoad(#[source] kestrel_model::ModelError),

    /// The per-model skill context (token trie, grammar compiler) could not be built.
    #[error("failed to prepare the model's tokenizer for skills")]
    SkillSetup(#[source] kestrel_skills::SkillError),

    /// The requested backend is not available in this build or on this machine.
    #[error("backend unavailable: {0}")]
    BackendUnavailable(String),

    /// The request failed while running (a step failed before dispatch, or
    /// the request was rejected by the runtime); the engine keeps serving.
    #[error("request failed: {0}")]
    RequestFailed(String),

    /// The engine is shutting down and accepts no new work.
    #[error("the engine is shutting down")]
    ShuttingDown,
}

impl EngineError {
    pub(crate) fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        EngineError::InvalidArgument {
            field,
            message: message.into(),
        }
    }
}
