//! kestrel-model: everything about a model that is not compute.
//!
//! Config, weights in their on-disk (possibly quantized) block layout, GGUF and
//! safetensors loading, the tokenizer and the chat template. Runtimes
//! (`kestrel-cpu`, `kestrel-cuda`) consume [`ModelWeights`] and do the math.

pub mod config;
pub mod weights;

pub use config::{ModelConfig, RopeStyle};
pub use weights::{Bytes, DType, LayerWeights, Matrix, ModelWeights};
