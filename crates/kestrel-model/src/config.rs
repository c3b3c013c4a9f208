//! The resolved model configuration: every field the forward pass needs, with
//! no `Option` left to guess about. Built once from GGUF metadata or an HF
//! `config.json`, or by hand for synthetic models. [`ArchFeatures`] holds the
//! ways a family's block departs from Llama's (all off for Llama), so the
//! runtimes branch on features, never on architecture names.

use crate::Family;

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

/// The FFN's gate activation: `act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `g / (1 + e^-g)` (Llama, Qwen).
    Silu,
    /// GELU, tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

/// How a block normalizes its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// `x / rms(x) * w` (Llama, Qwen, Gemma).
    Rms,
    /// `(x - mean) / sqrt(var + eps) * w + b`: LayerNorm with a bias
    /// (Phi). Every norm of the model then carries a bias vector.
    Layer,
}

/// Which keys a layer's attention sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlidingWindow {
    /// Every layer attends to the whole prefix.
    None,
    /// Every layer attends to the last `window` positions, itself included
    /// (Mistral).
    All { window: usize },
    /// Every `period`-th layer (1-based: layers `period-1`, `2*period-1`, ...)
    /// is global; the others are local with `window` keys (Gemma 3: 512, 6).
    Interleaved { window: usize, period: usize },
}

impl SlidingWindow {
    /// The window of layer `layer`, or `None` when it attends globally.
    pub fn window(&self, layer: usize) -> Option<usize> {
        match *self {
            SlidingWindow::None => None,
            SlidingWindow::All { window } => Some(window),
            SlidingWindow::Interleaved { window, period } => {
                (!(layer + 1).is_multiple_of(period)).then_some(window)
            }
        }
    }
}

/// The ways a family's decoder block departs from Llama's. The default is
/// plain Llama; a runtime that cannot do a feature must refuse the model
/// (see [`ArchFeatures::non_llama`]) rather than compute something else.
#[derive(Debug, Clone, PartialEq)]
pub struct ArchFeatures {
    /// Per-head RMSNorm of q and k (after the projections, before RoPE):
    /// Qwen3, Gemma 3. Weights `[head_dim]`.
    pub qk_norm: bool,
    /// RMSNorm of the attention and FFN outputs before their residual adds
    /// (Gemma 2/3 `post_attention_norm` / `post_ffw_norm`).
    pub post_norms: bool,
    pub activation: Activation,
    /// Embeddings are multiplied by this (Gemma: `sqrt(hidden)`; else 1).
    pub embedding_scale: f32,
    /// Attention logits are `q.k * attn_scale` when set (Gemma:
    /// `1/sqrt(query_pre_attn_scalar)`); `None` is `1/sqrt(head_dim)`. Read
    /// it through [`ModelConfig::attn_scale`].
    pub attn_scale: Option<f32>,
    /// `logits = cap * tanh(logits / cap)` when set (Gemma 2).
    pub final_logit_softcap: Option<f32>,
    pub sliding_window: SlidingWindow,
    /// RoPE base of the local (sliding-window) layers when it differs from
    /// `rope_theta`, the global layers' (Gemma 3: 10 000 vs 1 000 000). Read
    /// it through [`ModelConfig::layer_rope`].
    pub rope_theta_local: Option<f32>,
    /// Divides every RoPE frequency pair `i` of the global layers
    /// (`head_dim / 2` values): Llama 3.x's `rope_freqs`, computed from its
    /// `rope_scaling` when loading HF configs.
    pub rope_freq_factors: Option<Vec<f32>>,
    /// Linear RoPE scaling of the global layers: positions are divided by
    /// this (1 = none).
    pub rope_linear_scale: f32,
    /// RMSNorm, or LayerNorm with a bias (Phi; `rms_norm_eps` is then the
    /// LayerNorm's epsilon).
    pub norm: NormKind,
    /// Attention and FFN both read the one input norm's output and both add
    /// to the residual (`x + attn(ln(x)) + ffn(ln(x))`, Phi): no FFN norm.
    pub parallel_block: bool,
    /// `down(act(gate x) * up x)` (Llama, Qwen, Gemma); when off the FFN is
    /// `down(act(up x + b_up)) + b_down` (Phi's `fc1`/`fc2`), no gate.
    pub gated_ffn: bool,
    /// The attention output projection, both FFN matrices and the LM head
    /// carry biases (Phi).
    pub linear_biases: bool,
    /// Rotary embedding on the first `rotary_dim` dimensions of each head
    /// only (half-split within them; Phi's `partial_rotary_factor`), the
    /// rest passed through; `None` rotates all `head_dim`. Frequencies are
    /// `theta^(-2i / rotary_dim)`.
    pub rotary_dim: Option<usize>,
}

impl Default for ArchFeatures {
    /// Plain Llama: nothing extra.
    fn default() -> Self {
        ArchFeatures {
            qk_norm: false,
            post_norms: false,
            activation: Activation::Silu,
            embedding_scale: 1.0,
            attn_scale: None,
            final_logit_softcap: None,
            sliding_window: SlidingWindow::None,
            rope_theta_local: None,
            rope_freq_factors: None,
            rope_linear_scale: 1.0,
            norm: NormKind::Rms,
            parallel_block: false,
            gated_ffn: true,
            linear_biases: false,
            rotary_dim: None,
        }
    }
}

impl ArchFeatures {
    /// The features that differ from plain Llama, by name (empty for a
    /// Llama/Qwen2-shaped model). A runtime that implements only the Llama
    /// block refuses a model for which this is not empty.
    pub fn non_llama(&self) -> Vec<&'static str> {
        let base = ArchFeatures::default();
        let mut out = Vec::new();
        let checks = [
            (self.qk_norm != base.qk_norm, "q/k norm"),
            (self.post_norms != base.post_norms, "post-norms"),
            (self.activation != base.activation, "GELU-tanh FFN"),
            (
                self.embedding_scale != base.embedding_scale,
                "embedding scale",
            ),
            (self.attn_scale.is_some(), "attention scale"),
            (self.final_logit_softcap.is_some(), "logit softcapping"),
            (
                self.sliding_window != base.sliding_window,
                "sliding-window attention",
            ),
            (self.rope_theta_local.is_some(), "local RoPE base"),
            (self.rope_freq_factors.is_some(), "RoPE frequency factors"),
            (
                self.rope_linear_scale != base.rope_linear_scale,
                "linear RoPE scaling",
            ),
            (self.norm != base.norm, "LayerNorm"),
            (self.parallel_block, "parallel attention and FFN"),
            (!self.gated_ffn, "ungated FFN"),
            (self.linear_biases, "output/FFN/LM-head biases"),
            (self.rotary_dim.is_some(), "partial rotary"),
        ];
        for (differs, name) in checks {
            if differs {
                out.push(name);
            }
        }
        out
    }
}

/// Llama 3.x's `rope_scaling` (`rope_type: llama3`) as per-pair frequency
/// divisors, the values llama.cpp's converter stores as `rope_freqs.weight`.
pub fn llama3_rope_freq_factors(
    head_dim: usize,
    rope_theta: f32,
    factor: f32,
    low_freq_factor: f32,
    high_freq_factor: f32,
    original_max_position: f32,
) -> Vec<f32> {
    let low_wavelen = original_max_position / low_freq_factor;
    let high_wavelen = original_max_position / high_freq_factor;
    (0..head_dim / 2)
        .map(|i| {
            let freq = (rope_theta as f64).powf(-2.0 * i as f64 / head_dim as f64) as f32;
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (original_max_position / wavelen - low_freq_factor)
                    / (high_freq_factor - low_freq_factor);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// RoPE and attention span of one layer, resolved from [`ModelConfig`].
///
/// Local (sliding-window) layers use the plain base `rope_theta_local`:
/// llama.cpp applies frequency factors and scaling to global layers only.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerRope<'a> {
    pub theta: f32,
    pub freq_factors: Option<&'a [f32]>,
    pub linear_scale: f32,
    /// Keys seen: the last `window` positions, or all when `None`.
    pub window: Option<usize>,
}

/// A Llama-family decoder configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The family, resolved once from `general.architecture` (GGUF) or
    /// `model_type` (HF); its name is GGUF's spelling, e.g. `llama`, `qwen2`.
    pub architecture: Family,
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
    /// What the family changes in the block (plain Llama by default).
    pub features: ArchFeatures,
}

impl ModelConfig {
    /// SmolLM2-135M(-Instruct) as shipped in the default GGUF.
    pub fn smollm2_135m() -> Self {
        ModelConfig {
            architecture: Family::Llama,
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
            features: ArchFeatures::default(),
        }
    }

    /// Llama 3.2 1B shapes.
    pub fn llama_1b() -> Self {
        ModelConfig {
            architecture: Family::Llama,
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
            features: ArchFeatures::default(),
        }
    }

    /// Llama 3.1 8B shapes.
    pub fn llama_8b() -> Self {
        ModelConfig {
            architecture: Family::Llama,
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
            features: ArchFeatures::default(),
        }
    }

    /// Moondream 2's text decoder (`vikhyat/moondream` `TextConfig`): Phi
    /// 1.5's shape, 24 layers of width 2048, 32 heads of 64 (rotary on 32),
    /// FFN 8192, vocabulary 51 200, 2048 positions, LayerNorm eps 1e-5
    /// (`F.layer_norm`'s default), RoPE base 10 000.
    pub fn moondream2_text() -> Self {
        let mut features = ArchFeatures::default();
        let keys = crate::family::PhiKeys {
            head_dim: 64,
            partial_rotary_factor: 0.5,
            activation: None,
            qk_layernorm: false,
        };
        crate::family::phi_features(&keys, &mut features).expect("Moondream's own numbers");
        ModelConfig {
            architecture: crate::Family::Phi,
            vocab_size: 51_200,
            hidden_size: 2048,
            intermediate_size: 8192,
            num_layers: 24,
            num_heads: 32,
            num_kv_heads: 32,
            head_dim: 64,
            rope_theta: 10_000.0,
            rope_style: RopeStyle::HalfSplit,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 2048,
            tie_word_embeddings: false,
            qkv_bias: true,
            features,
        }
    }

    /// A tiny GQA model for unit tests: every dimension a multiple of 256 or
    /// of the head size, so all block layouts (including K-quants) tile.
    pub fn tiny() -> Self {
        ModelConfig {
            architecture: Family::Llama,
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
            features: ArchFeatures::default(),
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

    /// The attention logit scale (see [`ArchFeatures::attn_scale`]).
    pub fn attn_scale(&self) -> f32 {
        self.features
            .attn_scale
            .unwrap_or_else(|| 1.0 / (self.head_dim as f32).sqrt())
    }

    /// How layer `layer` rotates and which keys it sees.
    pub fn layer_rope(&self, layer: usize) -> LayerRope<'_> {
        let f = &self.features;
        let window = f.sliding_window.window(layer);
        // Only interleaved models have a second ("local") RoPE; a model whose
        // every layer slides (Mistral) rotates them all like global layers.
        let local =
            window.is_some() && matches!(f.sliding_window, SlidingWindow::Interleaved { .. });
        if local {
            LayerRope {
                theta: f.rope_theta_local.unwrap_or(self.rope_theta),
                freq_factors: None,
                linear_scale: 1.0,
                window,
            }
        } else {
            LayerRope {
                theta: self.rope_theta,
                freq_factors: f.rope_freq_factors.as_deref(),
                linear_scale: f.rope_linear_scale,
                window,
            }
        }
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
        let f = &self.features;
        let positive = |x: f32| x.is_finite() && x > 0.0;
        for (name, v) in [
            ("embedding_scale", Some(f.embedding_scale)),
            ("attn_scale", f.attn_scale),
            ("final_logit_softcap", f.final_logit_softcap),
            ("rope_theta_local", f.rope_theta_local),
            ("rope_linear_scale", Some(f.rope_linear_scale)),
        ] {
            if let Some(v) = v.filter(|&v| !positive(v)) {
                return fail(format!("{name} {v} is not positive"));
            }
        }
        if let Some(ff) = &f.rope_freq_factors {
            if ff.len() != self.head_dim / 2 || !ff.iter().all(|&v| positive(v)) {
                return fail(format!(
                    "rope frequency factors: {} values (need head_dim / 2 = {}, all positive)",
                    ff.len(),
                    self.head_dim / 2
                ));
            }
        }
        match f.sliding_window {
            SlidingWindow::All { window: 0 } | SlidingWindow::Interleaved { window: 0, .. } => {
                return fail("sliding window of 0 positions".into())
            }
            SlidingWindow::Interleaved { period: 0, .. } => {
                return fail("sliding-window layer period 0".into())
            }
            _ => {}
        }
        if let Some(rd) = f.rotary_dim {
            if rd == 0 || !rd.is_multiple_of(2) || rd > self.head_dim {
                return fail(format!(
                    "rotary_dim {rd} (need an even count in 2..=head_dim {})",
                    self.head_dim
                ));
            }
            if f.rope_freq_factors.is_some() {
                return fail("RoPE frequency factors with a partial rotary".into());
            }
        }
        if f.parallel_block && f.post_norms {
            return fail("post-norms in a parallel block".into());
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
            ModelConfig::moondream2_text(),
        ] {
            c.validate().unwrap();
            assert_eq!(c.q_dim() % c.kv_dim(), 0);
        }
        let mut bad = ModelConfig::tiny();
        bad.num_kv_heads = 3;
        assert!(bad.validate().is_err());
    }
}
