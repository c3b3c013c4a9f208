//! kestrel-model: everything about a model that is not compute.
//!
//! Config, weights in their on-disk (possibly quantized) block layout, GGUF and
//! safetensors loading, the tokenizer and the chat template. Runtimes
//! (`kestrel-cpu`, `kestrel-cuda`) consume [`ModelWeights`] and do the math.
//!
//! ```no_run
//! use kestrel_model::{default_model_path, load, ChatMessage};
//!
//! # fn main() -> Result<(), kestrel_model::ModelError> {
//! // Fetches SmolLM2-135M-Instruct (Q4_1 GGUF) into the cache on first use.
//! let model = load(&default_model_path()?)?;
//! assert_eq!(model.weights.config.num_layers, 30);
//! let template = model.chat_template.as_ref().expect("SmolLM2 ships a chat template");
//! let prompt = template.render(&[ChatMessage::user("Hi!")], true)?;
//! let ids = model.encode(&prompt)?;
//! let mut row = vec![0f32; model.weights.config.hidden_size];
//! model.weights.token_embd.dequantize_row(ids[0] as usize, &mut row);
//! # Ok(()) }
//! ```

pub mod chat;
pub mod config;
pub mod error;
pub mod family;
pub mod fetch;
pub mod gguf;
pub mod load;
pub mod load_quant;
pub mod moondream;
pub mod quant;
mod safetensors_load;
pub mod synth_gguf;
pub mod synthetic;
pub mod tokenizer;
pub mod vision;
pub mod weights;

pub use chat::{ChatMessage, ChatTemplate, TemplateOrigin, ToolCall, ToolSyntax};
pub use config::{
    llama3_rope_freq_factors, Activation, ArchFeatures, LayerRope, ModelConfig, NormKind,
    RopeStyle, SlidingWindow,
};
pub use error::ModelError;
pub use family::Family;
pub use fetch::{
    default_model_path, default_model_path_with_progress, pinned_model, pinned_model_path,
    FetchStage, PinnedModel,
};
pub use gguf::{GgufFile, GgufTensorInfo, GgufValue};
pub use load::{load, load_with, LoadedModel};
pub use load_quant::{quantize_loaded, LoadOptions, QuantizeReport};
pub use moondream::VisionModel;
pub use safetensors_load::moondream_text_weights;
pub use synth_gguf::{
    synth_file_name, write_synth_gguf, SynthFileStats, SynthFormat, SynthShape, SynthSpec,
};
pub use synthetic::synthetic_weights;
pub use weights::{Bytes, DType, LayerWeights, Matrix, ModelWeights};
