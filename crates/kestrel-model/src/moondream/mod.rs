//! Moondream 2, the vision-language model the seed system serves: its
//! configuration ([`config`], the 2B 2025 revisions and the 0.5B preset,
//! with the prompt templates' token ids) and its checkpoint ([`checkpoint`]:
//! `model.safetensors` under either published tensor naming, stored
//! F32/F16/BF16, shape-checked into typed weights), and the model as served
//! ([`served`]: [`VisionModel`], [`image_token_ids`], the directory
//! loader behind `kestrel_model::load`). The facts and their
//! sources are in docs/moondream.md; the compute is in `kestrel-cpu`.

pub mod checkpoint;
pub mod config;
pub mod served;

pub use checkpoint::{
    load_checkpoint, LayerNorm, Linear, Mlp, MoondreamWeights, NameScheme, RegionWeights,
    VisionBlock, VisionWeights,
};
pub use config::{
    CaptionLength, MoondreamConfig, PromptTokens, RegionConfig, TextConfig, UnknownCaptionLength,
    VisionConfig,
};
pub use served::{image_token_ids, prompt_tokens_for, VisionModel};
