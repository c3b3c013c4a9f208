//! kestrel-cpu: the CPU runtime's compute layer.
//!
//! Batch-invariant SIMD kernels ([`kernels`]), the Llama forward pass over a
//! paged KV cache ([`CpuModel`], [`KvStore`], [`Scratch`]), sampling
//! ([`sampler`]) and llama-perplexity's measurement ([`perplexity()`]).
//! **Invariant:** a row's results never depend on the other rows of its
//! batch: every dot product reduces along K in one canonical order (see
//! [`kernels::matmul`]), whatever the batch size, thread count or ISA.

pub(crate) mod block;
pub mod error;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod perplexity;
pub mod runtime;
pub mod sampler;
pub mod scratch;
pub mod synth;
pub mod team;
pub mod vision;

pub use kv::{KvStore, KvStoreConfig};
pub use model::{
    CpuModel, CpuModelOptions, DecodeBatch, LogitsMode, PrefillBatch, WeightPages, SUPPORTED_DTYPES,
};
pub use perplexity::{perplexity, prompt_logprobs, Perplexity, PerplexityConfig, PositionLogprobs};
pub use sampler::{sample, PenaltyState, SampledToken, SamplingParams, TopLogprobs};
pub use scratch::Scratch;

pub use error::CpuError;
pub use kernels::{Isa, Numerics};
pub use team::Team;
