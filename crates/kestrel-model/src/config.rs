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

impl ModelConfig {
    /// SmolLM2-135M(-Instruct) as shipped in the default GGUF.
    pub fn smollm2_135m() -> Self {
        ModelConfig {
            architecture: "llama".into(),
            vocab_size: 49152,
            hidden_size: 576,
            intermediate_size: 1536,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            rope_theta: 100_000.0,
            rope_style: RopeStyle::Interleaved,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 8192,
            tie_word_embeddings: true,
            qkv_bias: false,
        }
    }

    /// Llama 3.2 1B shapes.
    pub fn llama_1b() -> Self {
        ModelConfig {
            architecture: "llama".into(),
            vocab_size: 128_256,
            hidden_size: 2048,
            intermediate_size: 8192,
            num_layers: 16,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 64,
            rope_theta: 500_000.0,
            rope_style: RopeStyle::Interleaved,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 131_072,
            tie_word_embeddings: true,
            qkv_bias: false,
        }
    }

    /// Llama 3.1 8B shapes.
    pub fn llama_8b() -> Self {
        ModelConfig {
            architecture: "llama".into(),
            vocab_size: 128_256,
            hidden_size: 4096,
            intermediate_size: 14_336,
            num_layers: 32,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            rope_theta: 500_000.0,
            rope_style: RopeStyle::Interleaved,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 131_072,
            tie_word_embeddings: false,
            qkv_bias: false,
        }
    }

    /// A tiny GQA model for unit tests: every dimension a multiple of 256 or
    /// of the head size, so all block layouts (including K-quants) tile.
    pub fn tiny() -> Self {
        ModelConfig {
            architecture: "llama".into(),
            vocab_size: 512,
            hidden_size: 256,
            intermediate_size: 512,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 64,
            rope_theta: 10_000.0,
            rope_style: RopeStyle::Interleaved,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 256,
            tie_word_embeddings: false,
            qkv_bias: false,
        }
    }

    /// `num_heads * head_dim`: rows of `wq`, columns of `wo`.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// `num_kv_heads * head_dim`: rows of `wk` and `wv`.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Checks the invariants the runtimes rely on.
    pub fn validate(&self) -> Result<(), crate::ModelError> {
        let fail = |reason: String| Err(crate::ModelError::InvalidConfig { reason });
        let dims = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = dims.iter().find(|(_, v)| *v == 0) {
            return fail(format!("{name} is 0"));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return fail(format!(
                "num_heads {} is not a multiple of num_kv_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return fail(format!(
                "head_dim {} is odd; RoPE needs pairs",
                self.head_dim
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return fail(format!("rope_theta {} is not positive", self.rope_theta));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return fail(format!(
                "rms_norm_eps {} is not positive",
                self.rms_norm_eps
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid() {
        for c in [
            ModelConfig::smollm2_135m(),
            ModelConfig::llama_1b(),
            ModelConfig::llama_8b(),
            ModelConfig::tiny(),
        ] {
            c.validate().unwrap();
            assert_eq!(c.q_dim() % c.kv_dim(), 0);
        }
        let mut bad = ModelConfig::tiny();
        bad.num_kv_heads = 3;
        assert!(bad.validate().is_err());
    }
}
