//! Moondream's configuration, as its reference's `config.py` dataclasses
//! (`TextConfig`, `VisionConfig`, `RegionConfig`, `TokenizerConfig`) define
//! it: [`MoondreamConfig::moondream2`] is the 2B model's 2025 revisions,
//! [`MoondreamConfig::moondream2_0_5b`] the published 0.5B configuration
//! (`moondream/config/config_md05.json`). A Hugging Face `config.json`
//! carries overrides in its `config` object (usually empty); unknown keys
//! are ignored, Moondream 3's mixture of experts is refused.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::vision::CropGeometry;
use crate::{ModelConfig, ModelError};

/// The SigLIP-style vision encoder and its projector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct VisionConfig {
    /// Encoder width (1152).
    pub enc_dim: usize,
    /// Patch side in pixels (14).
    pub enc_patch_size: usize,
    /// Encoder blocks (27).
    pub enc_n_layers: usize,
    /// Encoder MLP width (4304).
    pub enc_ff_dim: usize,
    pub enc_n_heads: usize,
    /// The projector's hidden width (8192; `hid_dim` in the 0.5B json).
    #[serde(alias = "hid_dim")]
    pub proj_inner_dim: usize,
    /// The projector's output: the text model's width (2048).
    pub proj_out_dim: usize,
    /// Crop side in pixels (378).
    pub crop_size: usize,
    pub in_channels: usize,
    /// Tiles at most, besides the global crop (12).
    pub max_crops: usize,
    /// Patches of overlap on each side of a tile (4).
    pub overlap_margin: usize,
}

impl Default for VisionConfig {
    fn default() -> Self {
        VisionConfig {
            enc_dim: 1152,
            enc_patch_size: 14,
            enc_n_layers: 27,
            enc_ff_dim: 4304,
            enc_n_heads: 16,
            proj_inner_dim: 8192,
            proj_out_dim: 2048,
            crop_size: 378,
            in_channels: 3,
            max_crops: 12,
            overlap_margin: 4,
        }
    }
}

impl VisionConfig {
    /// Patches per crop side (27).
    pub fn grid(&self) -> usize {
        self.crop_size / self.enc_patch_size
    }

    /// Patches per crop (729): also the image tokens per image.
    pub fn patches(&self) -> usize {
        self.grid() * self.grid()
    }

    /// One patch's input values, channel-major (588).
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.enc_patch_size * self.enc_patch_size
    }

    pub fn head_dim(&self) -> usize {
        self.enc_dim / self.enc_n_heads
    }

    /// The crop geometry these settings describe.
    pub fn crop_geometry(&self) -> CropGeometry {
        CropGeometry {
            crop_size: self.crop_size,
            patch_size: self.enc_patch_size,
            overlap_margin: self.overlap_margin,
            max_crops: self.max_crops,
        }
    }
}

/// The Phi-style text decoder.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(default)]
pub struct TextConfig {
    pub dim: usize,
    pub ff_dim: usize,
    pub n_layers: usize,
    pub vocab_size: usize,
    pub max_context: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Leading positions attended bidirectionally: BOS + one crop's patches
    /// (730).
    pub prefix_attn: usize,
    pub rope_theta: f32,
}

impl Default for TextConfig {
    fn default() -> Self {
        TextConfig {
            dim: 2048,
            ff_dim: 8192,
            n_layers: 24,
            vocab_size: 51200,
            max_context: 2048,
            n_heads: 32,
            n_kv_heads: 32,
            prefix_attn: 730,
            rope_theta: 10_000.0,
        }
    }
}

impl TextConfig {
    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads
    }

    /// Rotated dimensions per head: the reference's
    /// `precompute_freqs_cis(dim // (2 * n_heads))` frequencies, two dims
    /// each (32 of 64).
    pub fn rotary_dim(&self) -> usize {
        self.head_dim() / 2
    }

    /// Output rows of the fused QKV projection.
    pub fn qkv_dim(&self) -> usize {
        (self.n_heads + 2 * self.n_kv_heads) * self.head_dim()
    }

    /// The decoder as the runtimes run it: `Family::Phi` with these
    /// widths ([`ModelConfig::moondream2_text`]'s features, the rotary part
    /// [`TextConfig::rotary_dim`]).
    pub fn model_config(&self) -> ModelConfig {
        let mut c = ModelConfig::moondream2_text();
        c.vocab_size = self.vocab_size;
        c.hidden_size = self.dim;
        c.intermediate_size = self.ff_dim;
        c.num_layers = self.n_layers;
        c.num_heads = self.n_heads;
        c.num_kv_heads = self.n_kv_heads;
        c.head_dim = self.head_dim();
        c.rope_theta = self.rope_theta;
        c.max_position_embeddings = self.max_context;
        let rotary = self.rotary_dim();
        c.features.rotary_dim = (rotary < c.head_dim).then_some(rotary);
        c
    }
}

/// The region model: coordinates and sizes in and out of the text model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct RegionConfig {
    pub dim: usize,
    pub coord_feat_dim: usize,
    /// Coordinate bins (1024).
    pub coord_out_dim: usize,
    pub size_feat_dim: usize,
    /// Width and height bins, 1024 each (2048).
    pub size_out_dim: usize,
    /// The decoders' MLP hidden width (8192; `hid_dim` in the 0.5B json).
    #[serde(alias = "hid_dim")]
    pub inner_dim: usize,
}

impl Default for RegionConfig {
    fn default() -> Self {
        RegionConfig {
            dim: 2048,
            coord_feat_dim: 256,
            coord_out_dim: 1024,
            size_feat_dim: 512,
            size_out_dim: 2048,
            inner_dim: 8192,
        }
    }
}

/// `caption`'s `length`: each is its own prompt template of the model
/// ([`PromptTokens::caption`]), and the one type the engine's requests and
/// every edge use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum CaptionLength {
    Short,
    #[default]
    Normal,
    Long,
}

impl CaptionLength {
    /// Every length, in the order the wire formats list them.
    pub const ALL: [CaptionLength; 3] = [
        CaptionLength::Short,
        CaptionLength::Normal,
        CaptionLength::Long,
    ];

    /// The wire name (`"short"`, `"normal"`, `"long"`), as the Moondream
    /// API spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            CaptionLength::Short => "short",
            CaptionLength::Normal => "normal",
            CaptionLength::Long => "long",
        }
    }
}

impl std::fmt::Display for CaptionLength {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A caption length that is none of `short`, `normal`, `long`; each edge
/// refuses it naming its own field (`length`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown caption length {given:?}: expected one of short, normal, long")]
pub struct UnknownCaptionLength {
    pub given: String,
}

impl std::str::FromStr for CaptionLength {
    type Err = UnknownCaptionLength;

    /// Exactly the wire names, lower case (the Moondream API's).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CaptionLength::ALL
            .into_iter()
            .find(|l| l.as_str() == s)
            .ok_or_else(|| UnknownCaptionLength {
                given: s.to_string(),
            })
    }
}

/// Token ids of the prompt templates (the reference's `TokenizerConfig`).
/// A prompt is BOS, the image's tokens, then the template: for `query`,
/// `query_prefix` + the question's tokens + `query_suffix`; for `caption`,
/// the length's ids; for `detect` / `point`, prefix + the object's tokens +
/// suffix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptTokens {
    pub bos_id: u32,
    pub eos_id: u32,
    /// The answer-begins token the model may emit (`None` for the GPT-2
    /// vocabulary revisions, which have none).
    pub answer_id: Option<u32>,
    pub coord_id: Option<u32>,
    pub size_id: Option<u32>,
    pub caption_short: Vec<u32>,
    pub caption_normal: Vec<u32>,
    /// `None` where the revision has no long caption (the 0.5B model).
    pub caption_long: Option<Vec<u32>>,
    pub query_prefix: Vec<u32>,
    pub query_suffix: Vec<u32>,
    pub detect_prefix: Vec<u32>,
    pub detect_suffix: Vec<u32>,
    pub point_prefix: Vec<u32>,
    pub point_suffix: Vec<u32>,
    /// Whether the question / object text is tokenized with a leading space
    /// (`" " + question`, the GPT-2 vocabulary revisions).
    pub leading_space: bool,
}

impl PromptTokens {
    /// The 2025-06-21 revision's ("Starmie" vocabulary) templates. Its
    /// query ends in a doubled answer id, as the model was trained.
    pub fn starmie() -> PromptTokens {
        PromptTokens {
            bos_id: 0,
            eos_id: 0,
            answer_id: Some(3),
            coord_id: Some(5),
            size_id: Some(6),
            caption_short: vec![1, 32708, 2, 12492, 3],
            caption_normal: vec![1, 32708, 2, 6382, 3],
            caption_long: Some(vec![1, 32708, 2, 4059, 3]),
            query_prefix: vec![1, 15381, 2],
            query_suffix: vec![3, 3],
            detect_prefix: vec![1, 7235, 476, 2],
            detect_suffix: vec![3],
            point_prefix: vec![1, 2581, 2],
            point_suffix: vec![3],
            leading_space: false,
        }
    }

    /// The GPT-2-vocabulary templates of the 2025-01-09 / 2025-04-14
    /// revisions ("\n\nQuestion:" ... "\n\nAnswer:"); `long` exists from
    /// the 2025-01-09 `config.py`, not in the 0.5B json.
    pub fn gpt2(with_long_caption: bool) -> PromptTokens {
        PromptTokens {
            bos_id: 50256,
            eos_id: 50256,
            answer_id: None,
            coord_id: None,
            size_id: None,
            caption_short: vec![198, 198, 16438, 8305, 25],
            caption_normal: vec![198, 198, 24334, 1159, 25],
            caption_long: with_long_caption.then(|| vec![198, 198, 14617, 8305, 25]),
            query_prefix: vec![198, 198, 24361, 25],
            query_suffix: vec![198, 198, 33706, 25],
            detect_prefix: vec![198, 198, 47504, 25],
            detect_suffix: vec![628],
            point_prefix: vec![198, 198, 12727, 25],
            point_suffix: vec![628],
            leading_space: true,
        }
    }

    /// The caption template for `length` (`None` if the revision has none).
    pub fn caption(&self, length: CaptionLength) -> Option<&[u32]> {
        match length {
            CaptionLength::Short => Some(&self.caption_short),
            CaptionLength::Normal => Some(&self.caption_normal),
            CaptionLength::Long => self.caption_long.as_deref(),
        }
    }
}

/// A whole Moondream configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct MoondreamConfig {
    pub text: TextConfig,
    pub vision: VisionConfig,
    pub region: RegionConfig,
    pub tokens: PromptTokens,
}

impl MoondreamConfig {
    /// Moondream 2 (2B), its 2025-06-21 revision: the reference's defaults.
    pub fn moondream2() -> MoondreamConfig {
        MoondreamConfig {
            text: TextConfig::default(),
            vision: VisionConfig::default(),
            region: RegionConfig::default(),
            tokens: PromptTokens::starmie(),
        }
    }

    /// The published 0.5B configuration (`config_md05.json`). Its json
    /// has no text `ff_dim`: 4096 (4 x 1024, the Phi convention of the
    /// reference's text model of its time) is this preset's reading, and
    /// the checkpoint's `fc1` shape check holds it to account.
    pub fn moondream2_0_5b() -> MoondreamConfig {
        MoondreamConfig {
            text: TextConfig {
                dim: 1024,
                ff_dim: 4096,
                n_heads: 16,
                n_kv_heads: 16,
                ..TextConfig::default()
            },
            vision: VisionConfig {
                enc_dim: 720,
                enc_ff_dim: 2690,
                enc_n_heads: 10,
                proj_out_dim: 1024,
                ..VisionConfig::default()
            },
            region: RegionConfig {
                dim: 1024,
                ..RegionConfig::default()
            },
            tokens: PromptTokens::gpt2(false),
        }
    }

    /// The 2B configuration with the overrides of a Hugging Face
    /// `config.json` (`{"config": {"text": {...}, "vision": {...}, ...}}`,
    /// or the reference's own `{"text": ..., "vision": ...}` layout).
    pub fn from_json(v: &Value) -> Result<MoondreamConfig, ModelError> {
        let inner = v.get("config").filter(|c| c.is_object()).unwrap_or(v);
        let mut c = MoondreamConfig::moondream2();
        if let Some(t) = inner.get("text") {
            if t.get("moe").is_some_and(|m| !m.is_null()) {
                return Err(ModelError::UnsupportedArchitecture {
                    architecture: "Moondream 3 (a mixture-of-experts text model)".into(),
                    supported: "Moondream 2 (2B, 0.5B)",
                });
            }
            c.text = section(t, "text")?;
        }
        if let Some(s) = inner.get("vision") {
            c.vision = section(s, "vision")?;
        }
        if let Some(s) = inner.get("region") {
            c.region = section(s, "region")?;
        }
        c.validate()
    }

    /// Reads `config.json` at `path` (see [`MoondreamConfig::from_json`]).
    pub fn from_file(path: &Path) -> Result<MoondreamConfig, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let v: Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: path.to_owned(),
            source,
        })?;
        MoondreamConfig::from_json(&v)
    }

    /// Checks what the compute relies on: whole heads, a crop of whole
    /// patches with a window inside its margins, a projector fed by the
    /// global and pooled features (2 x `enc_dim`) that outputs the text
    /// width, and a rotary part that fits a head.
    pub fn validate(self) -> Result<MoondreamConfig, ModelError> {
        let (v, t) = (&self.vision, &self.text);
        let bad = |reason: String| Err(ModelError::invalid(reason));
        if v.enc_n_heads == 0 || !v.enc_dim.is_multiple_of(v.enc_n_heads) {
            return bad(format!(
                "vision enc_dim {} is not a whole number of {} heads",
                v.enc_dim, v.enc_n_heads
            ));
        }
        if v.in_channels != 3 {
            return bad(format!(
                "vision in_channels is {}, not 3 (RGB)",
                v.in_channels
            ));
        }
        v.crop_geometry().validate()?;
        if v.proj_out_dim != t.dim {
            return bad(format!(
                "vision proj_out_dim {} is not the text dim {}",
                v.proj_out_dim, t.dim
            ));
        }
        if t.n_heads == 0
            || t.n_kv_heads == 0
            || !t.dim.is_multiple_of(t.n_heads)
            || !t.n_heads.is_multiple_of(t.n_kv_heads)
            || !t.head_dim().is_multiple_of(4)
        {
            return bad(format!(
                "text dim {} with {} heads ({} KV heads) is not whole heads of a \
                 multiple-of-4 width",
                t.dim, t.n_heads, t.n_kv_heads
            ));
        }
        if t.prefix_attn != 1 + v.patches() {
            return bad(format!(
                "text prefix_attn {} is not BOS + {} image tokens",
                t.prefix_attn,
                v.patches()
            ));
        }
        if self.region.dim != t.dim {
            return bad(format!(
                "region dim {} is not the text dim {}",
                self.region.dim, t.dim
            ));
        }
        Ok(self)
    }
}

fn section<T: for<'de> Deserialize<'de>>(v: &Value, name: &str) -> Result<T, ModelError> {
    T::deserialize(v).map_err(|e| ModelError::invalid(format!("config `{name}`: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn presets_are_valid_and_hold_the_published_numbers() {
        let c = MoondreamConfig::moondream2().validate().unwrap();
        assert_eq!(
            (c.vision.grid(), c.vision.patches(), c.vision.patch_dim()),
            (27, 729, 588)
        );
        assert_eq!(
            (c.text.head_dim(), c.text.rotary_dim(), c.text.qkv_dim()),
            (64, 32, 6144)
        );
        assert_eq!(c.text.model_config(), ModelConfig::moondream2_text());
        let small = MoondreamConfig::moondream2_0_5b().validate().unwrap();
        assert_eq!((small.vision.head_dim(), small.text.head_dim()), (72, 64));
        assert_eq!(small.tokens.caption(CaptionLength::Long), None);
    }

    #[test]
    fn hf_config_overrides_and_refusals() {
        let empty = json!({"architectures": ["HfMoondream"], "config": {}});
        assert_eq!(
            MoondreamConfig::from_json(&empty).unwrap(),
            MoondreamConfig::moondream2()
        );
        let md05 = json!({"text": {"dim": 1024, "n_heads": 16, "n_kv_heads": 16, "ff_dim": 4096},
            "vision": {"enc_dim": 720, "enc_ff_dim": 2690, "enc_n_heads": 10,
                       "proj_out_dim": 1024, "hid_dim": 8192},
            "region": {"dim": 1024, "hid_dim": 8192}});
        let c = MoondreamConfig::from_json(&md05).unwrap();
        assert_eq!((c.text, c.vision, c.region), {
            let p = MoondreamConfig::moondream2_0_5b();
            (p.text, p.vision, p.region)
        });
        let moe = json!({"config": {"text": {"moe": {"num_experts": 64}}}});
        assert!(matches!(
            MoondreamConfig::from_json(&moe),
            Err(ModelError::UnsupportedArchitecture { .. })
        ));
        let wrong = json!({"config": {"vision": {"proj_out_dim": 1024}}});
        assert!(matches!(
            MoondreamConfig::from_json(&wrong),
            Err(ModelError::InvalidConfig { .. })
        ));
        let typo = json!({"config": {"text": {"dim": "wide"}}});
        assert!(matches!(
            MoondreamConfig::from_json(&typo),
            Err(ModelError::InvalidConfig { .. })
        ));
    }
}
