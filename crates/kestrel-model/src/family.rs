//! [`Family`]: the model families Kestrel runs, resolved once from a GGUF
//! `general.architecture` or an HF `model_type`, and what each family's
//! block adds to Llama's. Both loaders read their own keys into the same
//! inputs ([`Gemma3Keys`], a RoPE scaling kind) and this file turns them into
//! [`ArchFeatures`], so a checkpoint resolves the same from either format and
//! what Kestrel cannot compute is refused by name on both
//! ([`ModelError::Unsupported`]), never computed wrong.

use std::fmt;

use crate::config::{Activation, ArchFeatures, NormKind, RopeStyle, SlidingWindow};
use crate::ModelError;

/// A decoder family Kestrel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama 2/3.x and anything shaped like it (SmolLM2, TinyLlama).
    Llama,
    /// Mistral: Llama's block with a sliding window on every layer. Its
    /// GGUFs say `llama` (llama.cpp converts it as one), so only an HF
    /// checkpoint resolves to this.
    Mistral,
    /// Qwen2 / Qwen2.5: Q/K/V biases.
    Qwen2,
    /// Qwen3: per-head q/k norms.
    Qwen3,
    /// Gemma 3 (text): see [`gemma3_features`].
    Gemma3,
    /// Phi (Phi 1.5 / Phi 2 shape, and Moondream 2's text decoder): see
    /// [`phi_features`].
    Phi,
}

/// The GGUF `general.architecture` values Kestrel runs.
pub const GGUF_ARCHITECTURES: &str = "llama (incl. Llama 3.x, Mistral), qwen2, qwen3, gemma3";

/// The HF `model_type`s Kestrel loads from safetensors.
pub const HF_ARCHITECTURES: &str =
    "llama, mistral, qwen2, qwen3, gemma3_text, gemma3 (its text_config), phi";

impl Family {
    /// The family of a GGUF `general.architecture`.
    pub fn from_gguf(architecture: &str) -> Result<Family, ModelError> {
        match architecture {
            "llama" => Ok(Family::Llama),
            "qwen2" => Ok(Family::Qwen2),
            "qwen3" => Ok(Family::Qwen3),
            "gemma3" => Ok(Family::Gemma3),
            _ => Err(ModelError::UnsupportedArchitecture {
                architecture: architecture.into(),
                supported: GGUF_ARCHITECTURES,
            }),
        }
    }

    /// The family of an HF `model_type` (a multimodal `gemma3` config has
    /// already been replaced by its `gemma3_text` `text_config`).
    pub fn from_hf(model_type: &str) -> Result<Family, ModelError> {
        match model_type {
            "llama" => Ok(Family::Llama),
            "mistral" => Ok(Family::Mistral),
            "qwen2" => Ok(Family::Qwen2),
            "qwen3" => Ok(Family::Qwen3),
            "gemma3_text" => Ok(Family::Gemma3),
            "phi" => Ok(Family::Phi),
            _ => Err(ModelError::UnsupportedArchitecture {
                architecture: model_type.into(),
                supported: HF_ARCHITECTURES,
            }),
        }
    }

    /// The family's name ([`crate::ModelConfig::architecture`]'s `Display`):
    /// GGUF's spelling, so both formats of one checkpoint read the same.
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3",
            Family::Phi => "phi",
        }
    }

    /// How a GGUF of this family pairs RoPE dimensions: llama.cpp's
    /// converter permutes Llama's Q/K rows for adjacent pairs and leaves the
    /// others as HF has them (half-split, "neox"). HF checkpoints are always
    /// [`RopeStyle::HalfSplit`].
    pub fn gguf_rope_style(self) -> RopeStyle {
        match self {
            Family::Llama | Family::Mistral => RopeStyle::Interleaved,
            Family::Qwen2 | Family::Qwen3 | Family::Gemma3 | Family::Phi => RopeStyle::HalfSplit,
        }
    }

    /// Whether the Q/K/V projections carry a bias: always for Qwen2 and
    /// Phi, else when the config says so (`attention_bias`; GGUF says
    /// nothing).
    pub fn qkv_bias(self, stated: Option<bool>) -> bool {
        matches!(self, Family::Qwen2 | Family::Phi) || stated.unwrap_or(false)
    }

    /// What the family's block always adds to Llama's, before the
    /// checkpoint's own keys (windows, RoPE scaling, Gemma's numbers).
    pub fn base_features(self) -> ArchFeatures {
        ArchFeatures {
            qk_norm: matches!(self, Family::Qwen3 | Family::Gemma3),
            ..ArchFeatures::default()
        }
    }

    /// The window of a family whose every layer slides, when the checkpoint
    /// names one: always for Mistral, and for the others only when switched
    /// on (`use_sliding_window`; Qwen2 configs name a window they switch
    /// off). Gemma 3's interleaved window is [`gemma3_features`]'.
    pub fn uniform_window(self, window: Option<usize>, switched_on: bool) -> SlidingWindow {
        match (self, window) {
            (Family::Gemma3, _) | (_, None) => SlidingWindow::None,
            (Family::Mistral, Some(window)) => SlidingWindow::All { window },
            (_, Some(window)) if switched_on => SlidingWindow::All { window },
            _ => SlidingWindow::None,
        }
    }

    /// Added to each stored norm weight of an HF checkpoint: HF's Gemma
    /// RMSNorm computes `x * (1 + w)` and stores `w`, where llama.cpp's
    /// converter (and Kestrel's norm) uses the stored weight as the factor.
    pub fn hf_norm_shift(self) -> f32 {
        if self == Family::Gemma3 {
            1.0
        } else {
            0.0
        }
    }

    /// A refusal of what this family's checkpoint asks for and Kestrel's
    /// block does not compute.
    pub fn unsupported(self, feature: impl Into<String>) -> ModelError {
        ModelError::Unsupported {
            family: self,
            feature: feature.into(),
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Gemma 3's numbers, read by each loader from its own keys.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Gemma3Keys<'a> {
    pub hidden_size: usize,
    /// Attention logits are `q.k * attn_scale` (`query_pre_attn_scalar^-0.5`).
    pub attn_scale: f32,
    pub final_logit_softcap: Option<f32>,
    /// Keys a local layer sees.
    pub window: usize,
    /// Every `period`-th layer is global.
    pub period: usize,
    /// RoPE base of the local layers (10 000 when the checkpoint is silent).
    pub rope_theta_local: Option<f32>,
    /// What Kestrel's block cannot compute, when a checkpoint asks for it
    /// (HF keys; GGUF carries none of them).
    pub attn_logit_softcap: Option<f32>,
    pub bidirectional: bool,
    pub activation: Option<&'a str>,
}

/// Gemma 3, as llama.cpp runs it: embeddings times `sqrt(hidden)`, per-head
/// q/k norms, post-attention and post-FFN norms, GELU-tanh, and local
/// layers (with their own RoPE base) between global ones. Gemma 2's
/// attention-logit softcap, EmbeddingGemma's bidirectional attention and any
/// other activation are refused.
pub(crate) fn gemma3_features(k: &Gemma3Keys<'_>, f: &mut ArchFeatures) -> Result<(), ModelError> {
    let family = Family::Gemma3;
    if let Some(cap) = k.attn_logit_softcap {
        return Err(family.unsupported(format!(
            "attention-logit softcapping (attn_logit_softcapping {cap})"
        )));
    }
    if k.bidirectional {
        return Err(family.unsupported(
            "bidirectional attention (use_bidirectional_attention: EmbeddingGemma is not a causal LM)",
        ));
    }
    match k.activation {
        None | Some("gelu_pytorch_tanh") => f.activation = Activation::GeluTanh,
        Some(other) => {
            return Err(family.unsupported(format!(
                "hidden_activation `{other}` (Gemma 3 runs gelu_pytorch_tanh)"
            )))
        }
    }
    f.qk_norm = true;
    f.post_norms = true;
    f.embedding_scale = (k.hidden_size as f32).sqrt();
    f.attn_scale = Some(k.attn_scale);
    f.final_logit_softcap = k.final_logit_softcap;
    f.sliding_window = SlidingWindow::Interleaved {
        window: k.window,
        period: k.period,
    };
    f.rope_theta_local = Some(k.rope_theta_local.unwrap_or(10_000.0));
    Ok(())
}

/// Phi's keys, read from an HF `config.json` (or stated by a Moondream
/// loader for its text model).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PhiKeys<'a> {
    pub head_dim: usize,
    /// `partial_rotary_factor` (Phi 1.5/2: 0.5; Moondream 2: 32 of 64).
    pub partial_rotary_factor: f32,
    /// `hidden_act` (`gelu_new`, the tanh approximation).
    pub activation: Option<&'a str>,
    /// `qk_layernorm`: per-head LayerNorms of q and k, which Kestrel's
    /// block does not compute.
    pub qk_layernorm: bool,
}

/// Phi, as HF `modeling_phi.py` runs it: one LayerNorm (with bias) per
/// block feeding attention and the FFN in parallel (`x + attn(ln(x)) +
/// mlp(ln(x))`), Q/K/V, output, `fc1`/`fc2` and LM-head biases, an ungated
/// GELU-tanh FFN, and rotary on the first `partial_rotary_factor * head_dim`
/// dimensions of each head (half-split within them). Moondream 2's text
/// model is this block (its RoPE writes the rotated pairs interleaved,
/// the same permutation on q and k, so the same scores).
pub(crate) fn phi_features(k: &PhiKeys<'_>, f: &mut ArchFeatures) -> Result<(), ModelError> {
    let family = Family::Phi;
    if k.qk_layernorm {
        return Err(family.unsupported("qk_layernorm (per-head LayerNorms of q and k)"));
    }
    match k.activation {
        None | Some("gelu_new" | "gelu_pytorch_tanh" | "gelu_fast") => {
            f.activation = Activation::GeluTanh
        }
        Some(other) => {
            return Err(family.unsupported(format!(
                "hidden_act `{other}` (Kestrel runs Phi with gelu_new, the tanh approximation)"
            )))
        }
    }
    let rot = k.head_dim as f32 * k.partial_rotary_factor;
    let rotary_dim = rot as usize;
    if !(rot > 0.0
        && rot.fract() == 0.0
        && rotary_dim <= k.head_dim
        && rotary_dim.is_multiple_of(2))
    {
        return Err(family.unsupported(format!(
            "partial_rotary_factor {} of head_dim {} (not an even count of dimensions)",
            k.partial_rotary_factor, k.head_dim
        )));
    }
    f.norm = NormKind::Layer;
    f.parallel_block = true;
    f.gated_ffn = false;
    f.linear_biases = true;
    f.rotary_dim = (rotary_dim < k.head_dim).then_some(rotary_dim);
    Ok(())
}

/// Applies a declared RoPE scaling kind (GGUF `rope.scaling.type`, HF
/// `rope_scaling.rope_type`): none/default, `linear` (a position divisor)
/// and `llama3` (per-pair frequency factors; GGUF stores these as the
/// `rope_freqs` tensor instead) are computed; any other kind (`yarn`,
/// `dynamic`, `longrope`, ...) is refused by name, on both paths: a model
/// computed with the wrong positions is worse than a clear refusal. `num`
/// reads a scaling parameter by its HF name from the checkpoint's keys.
pub(crate) fn rope_scaling(
    family: Family,
    kind: &str,
    head_dim: usize,
    rope_theta: f32,
    num: impl Fn(&str) -> Result<f32, ModelError>,
    f: &mut ArchFeatures,
) -> Result<(), ModelError> {
    match kind {
        "" | "none" | "default" => {}
        "linear" => f.rope_linear_scale = num("factor")?,
        "llama3" => {
            f.rope_freq_factors = Some(crate::config::llama3_rope_freq_factors(
                head_dim,
                rope_theta,
                num("factor")?,
                num("low_freq_factor")?,
                num("high_freq_factor")?,
                num("original_max_position_embeddings")?,
            ))
        }
        other => {
            return Err(family.unsupported(format!(
                "RoPE scaling `{other}` (Kestrel computes none, linear and llama3)"
            )))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct_and_both_formats_agree() {
        let all = [
            Family::Llama,
            Family::Mistral,
            Family::Qwen2,
            Family::Qwen3,
            Family::Gemma3,
            Family::Phi,
        ];
        let names: std::collections::HashSet<_> = all.iter().map(|f| f.name()).collect();
        assert_eq!(names.len(), all.len());
        for f in all
            .into_iter()
            .filter(|&f| !matches!(f, Family::Mistral | Family::Phi))
        {
            assert_eq!(Family::from_gguf(f.name()).unwrap(), f);
        }
        for arch in ["llama", "qwen2", "qwen3"] {
            assert_eq!(
                Family::from_gguf(arch).unwrap(),
                Family::from_hf(arch).unwrap()
            );
        }
        assert_eq!(
            Family::from_gguf("gemma3").unwrap(),
            Family::from_hf("gemma3_text").unwrap()
        );
        assert!(matches!(
            Family::from_gguf("mistral"),
            Err(ModelError::UnsupportedArchitecture { .. })
        ));
        assert_eq!(Family::from_hf("phi").unwrap(), Family::Phi);
    }

    #[test]
    fn phi_features_are_the_phi_block() {
        let keys = PhiKeys {
            head_dim: 64,
            partial_rotary_factor: 0.5,
            activation: Some("gelu_new"),
            qk_layernorm: false,
        };
        let mut f = ArchFeatures::default();
        phi_features(&keys, &mut f).unwrap();
        assert_eq!(f.rotary_dim, Some(32));
        assert_eq!(
            (f.norm, f.parallel_block, f.gated_ffn),
            (NormKind::Layer, true, false)
        );
        assert_eq!(f.activation, Activation::GeluTanh);
        let mut full = ArchFeatures::default();
        let whole = PhiKeys {
            partial_rotary_factor: 1.0,
            ..keys.clone()
        };
        phi_features(&whole, &mut full).unwrap();
        assert_eq!(full.rotary_dim, None);
        for bad in [
            PhiKeys {
                qk_layernorm: true,
                ..keys.clone()
            },
            PhiKeys {
                activation: Some("relu"),
                ..keys.clone()
            },
            PhiKeys {
                partial_rotary_factor: 0.4,
                ..keys.clone()
            },
        ] {
            let err = phi_features(&bad, &mut ArchFeatures::default()).unwrap_err();
            assert!(
                matches!(
                    err,
                    ModelError::Unsupported {
                        family: Family::Phi,
                        ..
                    }
                ),
                "{err}"
            );
        }
    }

    #[test]
    fn unknown_rope_scaling_is_refused_by_name() {
        let mut f = ArchFeatures::default();
        let num = |_: &str| Ok(2.0);
        for kind in ["", "none", "default"] {
            rope_scaling(Family::Llama, kind, 64, 1e4, num, &mut f).unwrap();
        }
        assert_eq!(f, ArchFeatures::default());
        rope_scaling(Family::Llama, "linear", 64, 1e4, num, &mut f).unwrap();
        assert_eq!(f.rope_linear_scale, 2.0);
        let err = rope_scaling(Family::Qwen2, "yarn", 64, 1e4, num, &mut f).unwrap_err();
        assert!(
            matches!(err, ModelError::Unsupported { family: Family::Qwen2, ref feature } if feature.contains("`yarn`")),
            "{err}"
        );
        assert!(err.to_string().contains("qwen2"), "{err}");
    }

    #[test]
    fn windows_follow_the_family() {
        let w = Some(4096);
        assert_eq!(
            Family::Mistral.uniform_window(w, false),
            SlidingWindow::All { window: 4096 }
        );
        assert_eq!(Family::Qwen2.uniform_window(w, false), SlidingWindow::None);
        assert_eq!(
            Family::Qwen2.uniform_window(w, true),
            SlidingWindow::All { window: 4096 }
        );
        assert_eq!(Family::Gemma3.uniform_window(w, true), SlidingWindow::None);
        assert_eq!(
            Family::Llama.uniform_window(None, true),
            SlidingWindow::None
        );
    }
}
