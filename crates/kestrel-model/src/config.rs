//! The resolved model configuration: every field the forward pass needs, with
//! no `Option` left to guess about. Built once from GGUF metadata or an HF
//! `config.json`, or by hand for synthetic models.

/// How rotary embeddings pair the dimensions of a head.
///
/// llama.cpp's HF-to-GGUF converter permutes the Q/K rows of Llama models so
/// that its "normal" RoPE (adjacent pairs) computes what HF's `rotate_half`
/// (pairs split at half the head) computes on the original weights. So a
/// GGUF `llama` model uses [`RopeStyle::Interleaved`] and an HF safetensors
/// checkpoint uses [`RopeStyle::HalfSplit`]; both runtimes implement both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Rotate pairs `(2i, 2i + 1)` with frequency index `i` (GGUF / llama.cpp "norm").
    Interleaved,
    /// Rotate pairs `(i, i + head_dim / 2)` with frequency index `i` (HF `rotate_half`, "neox").
    HalfSplit,
}

/// A Llama-family decoder configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `general.architecture` (GGUF) or `model_type` (HF), e.g. `llama`, `qwen2`.
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub rms_norm_eps: f32,
    /// Maximum context length (prompt + generated tokens).
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Q/K/V projections carry a bias (Qwen2).
    pub qkv_bias: bool,
}
