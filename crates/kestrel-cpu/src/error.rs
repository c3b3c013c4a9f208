//! The crate's one error type. Every fallible public entry point returns
//! [`CpuError`]; variants carry the numbers that were wrong so a caller can
//! report them without re-deriving anything.

/// Errors of the CPU runtime's compute layer.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    /// A weight or buffer has a shape that disagrees with the model config.
    #[error("`{name}`: expected {expected}, got {got}")]
    Shape {
        name: String,
        expected: String,
        got: String,
    },

    /// A batch is larger than the [`crate::Scratch`] it was given was sized for.
    #[error("batch of {rows} rows exceeds scratch capacity of {capacity} rows")]
    ScratchTooSmall { rows: usize, capacity: usize },

    /// A sequence is longer than the scratch's attention buffers allow.
    #[error("sequence length {len} exceeds scratch max_context {max_context}")]
    ContextTooLong { len: usize, max_context: usize },

    /// The page-table indices handed in are inconsistent.
    #[error("invalid paged indices: {reason}")]
    BadIndices { reason: String },

    /// A token id is outside the vocabulary.
    #[error("token id {token} out of range for vocab of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },

    /// Perplexity needs windows of at least 4 tokens and text for two of
    /// them (llama-perplexity's rule).
    #[error("perplexity over windows of {ctx} tokens needs ctx >= 4 and at least 2 * ctx tokens; the text has {tokens}")]
    PerplexityTooShort { tokens: usize, ctx: usize },

    /// The output logits buffer has the wrong length.
    #[error("logits buffer has {got} floats, need {expected}")]
    LogitsLen { expected: usize, got: usize },

    /// The KV store's geometry does not match the model.
    #[error("KV store geometry mismatch: {reason}")]
    KvGeometry { reason: String },

    /// The forced ISA (`KESTREL_ISA`) was refused.
    #[error(transparent)]
    Isa(#[from] crate::kernels::IsaRequestError),

    /// The memory the weights are copied into could not be mapped
    /// ([`crate::WeightPages::Huge`]).
    #[error("mapping {bytes} bytes for the weights failed")]
    WeightMemory {
        bytes: usize,
        #[source]
        source: std::io::Error,
    },

    /// Starting one of the runtime's threads (the compute team's helpers,
    /// the compute or copy stream) failed.
    #[error("starting the {thread} thread failed")]
    ThreadSpawn {
        thread: &'static str,
        #[source]
        source: std::io::Error,
    },
}
