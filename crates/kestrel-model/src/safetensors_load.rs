//! HF directory loading: `config.json` -> [`ModelConfig`], `*.safetensors`
//! (single or sharded via `model.safetensors.index.json`) -> mmap-backed
//! F32/F16/BF16 matrices, `tokenizer.json` + `tokenizer_config.json` (or
//! `chat_template.jinja`) -> tokenizer, chat template and special ids.
//! HF checkpoints keep Q/K unpermuted, so RoPE is [`RopeStyle::HalfSplit`].
//! Gemma 3 (`gemma3_text`, or `gemma3` with a `text_config`) resolves to the
//! same [`ModelConfig`] and effective weights as llama.cpp's GGUF of it: its
//! norms, stored as `w` for HF's `x * (1 + w)`, get the `+ 1` at load.
//! Phi (`phi`) has its own tensor names; [`PhiNames`] also maps Moondream
//! 2's `text_model.*` names (fused QKV, split at load) onto the same
//! decoder.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;
use serde_json::Value;

use crate::config::{ModelConfig, RopeStyle};
use crate::family::{gemma3_features, phi_features, rope_scaling, Gemma3Keys, PhiKeys};
use crate::load::{check_matrix, check_vector, LoadedModel};
use crate::{Bytes, DType, Family, LayerWeights, Matrix, ModelError, ModelWeights};

/// The `config.json` fields Kestrel reads (Llama, Mistral, Qwen2, Qwen3,
/// Gemma 3, Phi families).
#[derive(Debug, Deserialize)]
struct HfConfig {
    /// Required: a checkpoint without it is refused, not guessed a Llama.
    model_type: String,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rope_theta: Option<f32>,
    rms_norm_eps: Option<f32>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    rope_scaling: Option<Value>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
    // Gemma 3 (`gemma3_text`).
    hidden_activation: Option<String>,
    query_pre_attn_scalar: Option<f32>,
    final_logit_softcapping: Option<f32>,
    attn_logit_softcapping: Option<f32>,
    rope_local_base_freq: Option<f32>,
    sliding_window_pattern: Option<usize>,
    /// What newer `transformers` write instead of `sliding_window_pattern`.
    #[serde(rename = "_sliding_window_pattern")]
    sliding_window_pattern_private: Option<usize>,
    /// `sliding_attention` / `full_attention` per layer.
    layer_types: Option<Vec<String>>,
    /// EmbeddingGemma: an encoder, not a causal LM.
    use_bidirectional_attention: Option<bool>,
    // Phi.
    partial_rotary_factor: Option<f32>,
    layer_norm_eps: Option<f32>,
    hidden_act: Option<String>,
    qk_layernorm: Option<bool>,
}

/// `Gemma3TextConfig`'s defaults, which `transformers` applies to keys a
/// `gemma3_text` config leaves out (the `text_config` of multimodal Gemma 3
/// checkpoints names only a few).
const GEMMA3_TEXT_DEFAULTS: &[(&str, f64)] = &[
    ("vocab_size", 262_208.0),
    ("hidden_size", 2304.0),
    ("intermediate_size", 9216.0),
    ("num_hidden_layers", 26.0),
    ("num_attention_heads", 8.0),
    ("num_key_value_heads", 4.0),
    ("head_dim", 256.0),
    ("max_position_embeddings", 131_072.0),
    ("rms_norm_eps", 1e-6),
    ("bos_token_id", 2.0),
    ("eos_token_id", 1.0),
    ("rope_theta", 1_000_000.0),
    ("query_pre_attn_scalar", 256.0),
    ("sliding_window", 4096.0),
    ("rope_local_base_freq", 10_000.0),
];

/// Reads `config.json`. A multimodal `gemma3` config is replaced by its
/// `text_config` (keeping the outer special-token ids, which list the
/// end-of-turn token); a `gemma3_text` config gets `transformers`' defaults.
fn read_hf_config(path: &Path) -> Result<HfConfig, ModelError> {
    let mut v: Value = read_json(path)?;
    if v.get("model_type").and_then(Value::as_str) == Some("gemma3") {
        let mut text = match v.get("text_config") {
            Some(Value::Object(t)) => t.clone(),
            _ => {
                return Err(ModelError::MissingMetadata {
                    key: "text_config".into(),
                })
            }
        };
        text.entry("model_type").or_insert("gemma3_text".into());
        for key in ["bos_token_id", "eos_token_id", "tie_word_embeddings"] {
            if let Some(x) = v.get(key).filter(|x| !x.is_null()) {
                text.insert(key.into(), x.clone());
            }
        }
        v = Value::Object(text);
    }
    if v.get("model_type").and_then(Value::as_str).is_none() {
        return Err(ModelError::MissingConfigKey {
            path: path.into(),
            key: "model_type",
        });
    }
    if let Value::Object(o) = &mut v {
        rope_parameters(o);
    }
    if v.get("model_type").and_then(Value::as_str) == Some("gemma3_text") {
        if let Value::Object(o) = &mut v {
            for &(key, x) in GEMMA3_TEXT_DEFAULTS {
                let x = if x.fract() == 0.0 {
                    Value::from(x as u64)
                } else {
                    Value::from(x)
                };
                o.entry(key).or_insert(x);
            }
            o.entry("tie_word_embeddings").or_insert(true.into());
        }
    }
    serde_json::from_value(v).map_err(|source| ModelError::Json {
        path: path.into(),
        source,
    })
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: path.into(),
        source,
    })
}

/// `transformers` 5 writes RoPE as `rope_parameters`: one `{rope_type,
/// rope_theta, ...}`, or one per layer type (Gemma 3: `full_attention` and
/// `sliding_attention`). Rewritten into the older keys Kestrel reads
/// (`rope_theta`, `rope_scaling`, `rope_local_base_freq`) unless those are
/// present.
fn rope_parameters(o: &mut serde_json::Map<String, Value>) {
    let Some(Value::Object(p)) = o.get("rope_parameters").cloned() else {
        return;
    };
    let (global, local) = match p.get("full_attention") {
        Some(Value::Object(g)) => (g.clone(), p.get("sliding_attention").cloned()),
        _ => (p, None),
    };
    if let Some(theta) = global.get("rope_theta") {
        o.entry("rope_theta").or_insert(theta.clone());
    }
    let scaling = o.entry("rope_scaling").or_insert(Value::Null);
    if scaling.is_null() {
        *scaling = Value::Object(global);
    }
    if let Some(theta) = local.as_ref().and_then(|l| l.get("rope_theta")) {
        o.entry("rope_local_base_freq").or_insert(theta.clone());
    }
}

fn resolve_config(hf: &HfConfig) -> Result<ModelConfig, ModelError> {
    let family = Family::from_hf(&hf.model_type)?;
    if hf.num_attention_heads == 0 {
        return Err(ModelError::invalid("num_attention_heads is 0"));
    }
    let head_dim = hf
        .head_dim
        .unwrap_or(hf.hidden_size / hf.num_attention_heads);
    let rope_theta = hf.rope_theta.unwrap_or(10_000.0);
    let mut features = family.base_features();
    if let Some(scaling) = hf.rope_scaling.as_ref().filter(|v| !v.is_null()) {
        let kind = scaling
            .get("rope_type")
            .or_else(|| scaling.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("");
        let num = |key: &str| -> Result<f32, ModelError> {
            scaling
                .get(key)
                .and_then(Value::as_f64)
                .map(|x| x as f32)
                .ok_or_else(|| ModelError::MissingMetadata {
                    key: format!("rope_scaling.{key}"),
                })
        };
        rope_scaling(family, kind, head_dim, rope_theta, num, &mut features)?;
    }
    if family == Family::Gemma3 {
        gemma3_features(&gemma3_keys(hf, head_dim)?, &mut features)?;
    } else if family == Family::Phi {
        let keys = PhiKeys {
            head_dim,
            partial_rotary_factor: hf.partial_rotary_factor.unwrap_or(0.5),
            activation: hf.hidden_act.as_deref(),
            qk_layernorm: hf.qk_layernorm == Some(true),
        };
        phi_features(&keys, &mut features)?;
    } else {
        features.sliding_window =
            family.uniform_window(hf.sliding_window, hf.use_sliding_window == Some(true));
    }
    let config = ModelConfig {
        vocab_size: hf.vocab_size,
        hidden_size: hf.hidden_size,
        intermediate_size: hf.intermediate_size,
        num_layers: hf.num_hidden_layers,
        num_heads: hf.num_attention_heads,
        num_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
        head_dim,
        rope_theta,
        rope_style: RopeStyle::HalfSplit,
        // Phi's LayerNorm epsilon (`layer_norm_eps`, 1e-5 by default).
        rms_norm_eps: match family {
            Family::Phi => hf.layer_norm_eps.unwrap_or(1e-5),
            _ => hf.rms_norm_eps.unwrap_or(1e-6),
        },
        max_position_embeddings: hf.max_position_embeddings.unwrap_or(4096),
        // Phi's head is its own tensor, with its own bias.
        tie_word_embeddings: family != Family::Phi && hf.tie_word_embeddings.unwrap_or(false),
        qkv_bias: family.qkv_bias(hf.attention_bias),
        architecture: family,
        features,
    };
    config.validate()?;
    Ok(config)
}

/// Gemma 3's keys in an HF config: attention scale
/// `query_pre_attn_scalar^-0.5` (`head_dim` when absent), local layers from
/// `layer_types` (or `sliding_window_pattern`) with RoPE base
/// `rope_local_base_freq`, `final_logit_softcapping`, and the keys of what
/// [`gemma3_features`] refuses.
fn gemma3_keys(hf: &HfConfig, head_dim: usize) -> Result<Gemma3Keys<'_>, ModelError> {
    let scalar = hf.query_pre_attn_scalar.unwrap_or(head_dim as f32);
    Ok(Gemma3Keys {
        hidden_size: hf.hidden_size,
        attn_scale: 1.0 / scalar.sqrt(),
        final_logit_softcap: hf.final_logit_softcapping,
        window: hf
            .sliding_window
            .ok_or_else(|| ModelError::MissingMetadata {
                key: "sliding_window".into(),
            })?,
        period: gemma3_period(hf)?,
        rope_theta_local: hf.rope_local_base_freq,
        attn_logit_softcap: hf.attn_logit_softcapping,
        bidirectional: hf.use_bidirectional_attention == Some(true),
        activation: hf.hidden_activation.as_deref(),
    })
}

/// The global-layer period: `layer_types` when given (it must be "every
/// `p`-th layer global", the only pattern Kestrel runs; a stated
/// `sliding_window_pattern` consistent with it is preferred), else
/// `sliding_window_pattern`, else Gemma 3's 6.
fn gemma3_period(hf: &HfConfig) -> Result<usize, ModelError> {
    let pattern = hf
        .sliding_window_pattern
        .or(hf.sliding_window_pattern_private);
    let Some(types) = &hf.layer_types else {
        return Ok(pattern.unwrap_or(6));
    };
    let n = hf.num_hidden_layers;
    if types.len() != n {
        return Err(ModelError::invalid(format!(
            "layer_types lists {} layers, num_hidden_layers is {n}",
            types.len()
        )));
    }
    let global = types
        .iter()
        .map(|t| match t.as_str() {
            "full_attention" => Ok(true),
            "sliding_attention" => Ok(false),
            other => Err(ModelError::invalid(format!(
                "layer_types entry `{other}` (supported: sliding_attention, full_attention)"
            ))),
        })
        .collect::<Result<Vec<bool>, ModelError>>()?;
    let fits = |p: usize| {
        p > 0
            && global
                .iter()
                .enumerate()
                .all(|(i, &g)| g == (i + 1).is_multiple_of(p))
    };
    pattern
        .into_iter()
        .chain(1..=n + 1)
        .find(|&p| fits(p))
        .ok_or_else(|| {
            Family::Gemma3.unsupported(
                "layer_types other than one global layer every p layers (per-layer patterns)",
            )
        })
}

/// All tensors of a checkpoint, by name, as windows of their files' maps.
pub(crate) struct TensorStore {
    tensors: HashMap<String, (Dtype, Vec<usize>, Bytes)>,
}

impl TensorStore {
    pub(crate) fn open(dir: &Path) -> Result<Self, ModelError> {
        let files = shard_files(dir)?;
        let mut tensors = HashMap::new();
        for path in files {
            let file = File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: read-only map of a checkpoint Kestrel never writes; as
            // with any mmap loader, concurrent truncation by another process
            // is outside our control.
            let map = Arc::new(
                unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?,
            );
            let (header_len, meta) =
                SafeTensors::read_metadata(&map).map_err(|source| ModelError::Safetensors {
                    path: path.clone(),
                    source,
                })?;
            let base = 8 + header_len;
            for (name, info) in meta.tensors() {
                let (start, end) = info.data_offsets;
                let bytes = Bytes::Mapped {
                    map: Arc::clone(&map),
                    offset: base + start,
                    len: end - start,
                };
                // `torch.compile`d exports (Moondream's) add `._orig_mod`;
                // the reference's loader strips it, as here.
                let name = name.replace("._orig_mod", "");
                tensors.insert(name, (info.dtype, info.shape.clone(), bytes));
            }
        }
        Ok(TensorStore { tensors })
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn raw(&self, name: &str) -> Result<Matrix, ModelError> {
        let (dtype, shape, bytes) =
            self.tensors
                .get(name)
                .ok_or_else(|| ModelError::MissingTensor {
                    tensor: name.into(),
                })?;
        let dtype = float_dtype(name, *dtype)?;
        let (rows, cols) = match shape.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            _ => {
                return Err(ModelError::ShapeMismatch {
                    tensor: name.into(),
                    expected: vec![0, 0],
                    found: shape.clone(),
                })
            }
        };
        Ok(Matrix {
            dtype,
            rows,
            cols,
            data: bytes.clone(),
        })
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
        let m = self.raw(name)?;
        if self.tensors[name].1.len() != 2 {
            return Err(ModelError::ShapeMismatch {
                tensor: name.into(),
                expected: vec![rows, cols],
                found: self.tensors[name].1.clone(),
            });
        }
        check_matrix(m, name, rows, cols)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        let m = self.raw(name)?;
        if self.tensors[name].1.len() != 1 {
            return Err(ModelError::ShapeMismatch {
                tensor: name.into(),
                expected: vec![len],
                found: self.tensors[name].1.clone(),
            });
        }
        check_vector(m.to_f32(), name, len)
    }
}

/// The checkpoint's shard files: from the index if there is one, else every
/// `*.safetensors` in the directory (sorted).
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let v: Value = read_json(&index)?;
        let files: BTreeSet<&str> = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| ModelError::invalid(format!("{} has no weight_map", index.display())))?
            .values()
            .filter_map(Value::as_str)
            .collect();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| ModelError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::MissingTensor {
            tensor: format!("{}/*.safetensors", dir.display()),
        });
    }
    Ok(files)
}

/// Where a checkpoint keeps its decoder: `model.` (causal LMs), or inside a
/// multimodal Gemma 3 (`model.language_model.` since `transformers` 4.52,
/// `language_model.model.` before), with the `lm_head` tensor it would use.
fn decoder_prefix(s: &TensorStore) -> (&'static str, &'static str) {
    [
        ("model.language_model.", "lm_head.weight"),
        ("language_model.model.", "language_model.lm_head.weight"),
    ]
    .into_iter()
    .find(|(p, _)| s.contains(&format!("{p}embed_tokens.weight")))
    .unwrap_or(("model.", "lm_head.weight"))
}

fn weights_from_store(c: ModelConfig, s: &TensorStore) -> Result<ModelWeights, ModelError> {
    if c.architecture == Family::Phi {
        return phi_weights(c, s, PhiNames::Hf);
    }
    let (h, q, kv, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let (prefix, lm_head_name) = decoder_prefix(s);
    let bias = |name: String, len| -> Result<Option<Vec<f32>>, ModelError> {
        if c.qkv_bias {
            Ok(Some(s.vector(&name, len)?))
        } else {
            Ok(None)
        }
    };
    // HF's Gemma RMSNorm computes `x * (1 + w)` (in f32) and stores `w`;
    // llama.cpp's converter stores `w + 1` and Kestrel's norms multiply by
    // the stored weight, so Gemma's norms get the `+ 1` here.
    let shift = c.architecture.hf_norm_shift();
    let norm = |name: &str, len| -> Result<Vec<f32>, ModelError> {
        let mut v = s.vector(name, len)?;
        v.iter_mut().for_each(|x| *x += shift);
        Ok(v)
    };
    let qk = c.features.qk_norm;
    let qk_norm = |name: String| qk.then(|| norm(&name, c.head_dim)).transpose();
    let token_embd = s.matrix(&format!("{prefix}embed_tokens.weight"), c.vocab_size, h)?;
    let layers = (0..c.num_layers)
        .map(|i| {
            let n = |x: &str| format!("{prefix}layers.{i}.{x}");
            // Llama's `post_attention_layernorm` is the pre-FFN norm; Gemma's
            // is a post-norm, with `pre_feedforward_layernorm` before the FFN.
            let (ffn_norm, post_attn_norm, post_ffn_norm) = if c.features.post_norms {
                (
                    norm(&n("pre_feedforward_layernorm.weight"), h)?,
                    Some(norm(&n("post_attention_layernorm.weight"), h)?),
                    Some(norm(&n("post_feedforward_layernorm.weight"), h)?),
                )
            } else {
                (norm(&n("post_attention_layernorm.weight"), h)?, None, None)
            };
            Ok(LayerWeights {
                attn_norm: norm(&n("input_layernorm.weight"), h)?,
                wq: s.matrix(&n("self_attn.q_proj.weight"), q, h)?,
                wk: s.matrix(&n("self_attn.k_proj.weight"), kv, h)?,
                wv: s.matrix(&n("self_attn.v_proj.weight"), kv, h)?,
                wo: s.matrix(&n("self_attn.o_proj.weight"), h, q)?,
                bq: bias(n("self_attn.q_proj.bias"), q)?,
                bk: bias(n("self_attn.k_proj.bias"), kv)?,
                bv: bias(n("self_attn.v_proj.bias"), kv)?,
                q_norm: qk_norm(n("self_attn.q_norm.weight"))?,
                k_norm: qk_norm(n("self_attn.k_norm.weight"))?,
                post_attn_norm,
                ffn_norm,
                w_gate: Some(s.matrix(&n("mlp.gate_proj.weight"), ff, h)?),
                w_up: s.matrix(&n("mlp.up_proj.weight"), ff, h)?,
                w_down: s.matrix(&n("mlp.down_proj.weight"), h, ff)?,
                post_ffn_norm,
                attn_norm_bias: None,
                bo: None,
                b_up: None,
                b_down: None,
            })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let output_norm = norm(&format!("{prefix}norm.weight"), h)?;
    let lm_head = if c.tie_word_embeddings && !s.contains(lm_head_name) {
        token_embd.clone()
    } else {
        s.matrix(lm_head_name, c.vocab_size, h)?
    };
    Ok(ModelWeights {
        config: c,
        token_embd,
        layers,
        output_norm,
        lm_head,
        output_norm_bias: None,
        lm_head_bias: None,
    })
}

/// Where a Phi-shaped decoder keeps its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PhiNames {
    /// HF `modeling_phi.py`: `model.embed_tokens`, `model.layers.{i}.`
    /// `input_layernorm`, `self_attn.{q,k,v}_proj`, `self_attn.dense`,
    /// `mlp.fc1`/`mlp.fc2`, `model.final_layernorm`, `lm_head` (weights and
    /// biases).
    Hf,
    /// Moondream 2's text model as exported (`NameScheme::Exported`):
    /// `text_model.transformer.embd.wte`, `text_model.transformer.h.{i}.ln`,
    /// `mixer.Wqkv` (Q, K and V stacked by rows, split here),
    /// `mixer.out_proj`, `mlp.fc1`/`mlp.fc2`, `text_model.lm_head.ln` (the
    /// final LayerNorm) and `text_model.lm_head.linear`.
    Moondream,
    /// Moondream 2's text model as its HF state dict names it
    /// (`NameScheme::Hf`): `model.text.wte` (a bare parameter, no
    /// `.weight`), `model.text.blocks.{i}.ln`, `attn.qkv` (stacked),
    /// `attn.proj`, `mlp.fc1`/`mlp.fc2`, `model.text.post_ln`,
    /// `model.text.lm_head`.
    MoondreamHf,
}

impl From<crate::moondream::NameScheme> for PhiNames {
    fn from(n: crate::moondream::NameScheme) -> PhiNames {
        match n {
            crate::moondream::NameScheme::Hf => PhiNames::MoondreamHf,
            crate::moondream::NameScheme::Exported => PhiNames::Moondream,
        }
    }
}

/// One tensor of a Phi decoder, by role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PhiTensor {
    Embed,
    FinalNorm,
    LmHead,
    Norm(usize),
    /// HF's separate `q_proj`/`k_proj`/`v_proj` (`0..3`), or Moondream's
    /// fused `Wqkv` (the same name for all three).
    Qkv(usize, usize),
    Out(usize),
    Fc1(usize),
    Fc2(usize),
}

impl PhiNames {
    /// The name of `t`'s weight.
    pub(crate) fn weight(self, t: PhiTensor) -> String {
        match (self, t) {
            (PhiNames::MoondreamHf, PhiTensor::Embed) => "model.text.wte".into(),
            _ => format!("{}.weight", self.stem(t)),
        }
    }

    /// The name of `t`'s bias.
    pub(crate) fn bias(self, t: PhiTensor) -> String {
        format!("{}.bias", self.stem(t))
    }

    /// The stem of `t` (append `.weight` / `.bias`).
    pub(crate) fn stem(self, t: PhiTensor) -> String {
        use PhiTensor as T;
        match self {
            PhiNames::Hf => match t {
                T::Embed => "model.embed_tokens".into(),
                T::FinalNorm => "model.final_layernorm".into(),
                T::LmHead => "lm_head".into(),
                T::Norm(i) => format!("model.layers.{i}.input_layernorm"),
                T::Qkv(i, part) => {
                    format!("model.layers.{i}.self_attn.{}_proj", ["q", "k", "v"][part])
                }
                T::Out(i) => format!("model.layers.{i}.self_attn.dense"),
                T::Fc1(i) => format!("model.layers.{i}.mlp.fc1"),
                T::Fc2(i) => format!("model.layers.{i}.mlp.fc2"),
            },
            PhiNames::Moondream => match t {
                T::Embed => "text_model.transformer.embd.wte".into(),
                T::FinalNorm => "text_model.lm_head.ln".into(),
                T::LmHead => "text_model.lm_head.linear".into(),
                T::Norm(i) => format!("text_model.transformer.h.{i}.ln"),
                T::Qkv(i, _) => format!("text_model.transformer.h.{i}.mixer.Wqkv"),
                T::Out(i) => format!("text_model.transformer.h.{i}.mixer.out_proj"),
                T::Fc1(i) => format!("text_model.transformer.h.{i}.mlp.fc1"),
                T::Fc2(i) => format!("text_model.transformer.h.{i}.mlp.fc2"),
            },
            PhiNames::MoondreamHf => match t {
                T::Embed => "model.text.wte".into(),
                T::FinalNorm => "model.text.post_ln".into(),
                T::LmHead => "model.text.lm_head".into(),
                T::Norm(i) => format!("model.text.blocks.{i}.ln"),
                T::Qkv(i, _) => format!("model.text.blocks.{i}.attn.qkv"),
                T::Out(i) => format!("model.text.blocks.{i}.attn.proj"),
                T::Fc1(i) => format!("model.text.blocks.{i}.mlp.fc1"),
                T::Fc2(i) => format!("model.text.blocks.{i}.mlp.fc2"),
            },
        }
    }

    pub(crate) fn fused_qkv(self) -> bool {
        matches!(self, PhiNames::Moondream | PhiNames::MoondreamHf)
    }
}

/// Moondream 2's text decoder from the checkpoint in `dir` (its
/// `model.safetensors`) under either published naming, for `config` (Phi
/// features: [`crate::moondream::TextConfig::model_config`]). The one
/// reader of Moondream's text weights: [`crate::moondream::load_checkpoint`]
/// calls it. The vision side of the checkpoint is not read here.
pub fn moondream_text_weights(
    dir: &Path,
    config: ModelConfig,
    names: crate::moondream::NameScheme,
) -> Result<ModelWeights, ModelError> {
    config.validate()?;
    let store = TensorStore::open(dir)?;
    phi_weights(config, &store, names.into())
}

/// A Phi decoder's weights (see [`PhiNames`]): every linear with its bias,
/// LayerNorms with theirs, `fc1` as the ungated FFN's `w_up`. A fused QKV
/// is split by rows (`q_dim`, `kv_dim`, `kv_dim`) into windows of the same
/// bytes, its bias likewise.
pub(crate) fn phi_weights(
    c: ModelConfig,
    s: &TensorStore,
    names: PhiNames,
) -> Result<ModelWeights, ModelError> {
    let (h, q, kv, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let w = |t: PhiTensor| names.weight(t);
    let b = |t: PhiTensor| names.bias(t);
    let token_embd = s.matrix(&w(PhiTensor::Embed), c.vocab_size, h)?;
    let layers = (0..c.num_layers)
        .map(|i| {
            let (wq, wk, wv, bq, bk, bv) = if names.fused_qkv() {
                let t = PhiTensor::Qkv(i, 0);
                let fused = s.matrix(&w(t), q + 2 * kv, h)?;
                let bias = s.vector(&b(t), q + 2 * kv)?;
                let rows = |start: usize, n: usize| {
                    let rb = fused.row_bytes();
                    Matrix {
                        rows: n,
                        data: fused.data.slice(start * rb, n * rb),
                        ..fused.clone()
                    }
                };
                (
                    rows(0, q),
                    rows(q, kv),
                    rows(q + kv, kv),
                    bias[..q].to_vec(),
                    bias[q..q + kv].to_vec(),
                    bias[q + kv..].to_vec(),
                )
            } else {
                let part = |p: usize, rows| -> Result<(Matrix, Vec<f32>), ModelError> {
                    let t = PhiTensor::Qkv(i, p);
                    Ok((s.matrix(&w(t), rows, h)?, s.vector(&b(t), rows)?))
                };
                let ((wq, bq), (wk, bk), (wv, bv)) = (part(0, q)?, part(1, kv)?, part(2, kv)?);
                (wq, wk, wv, bq, bk, bv)
            };
            Ok(LayerWeights {
                attn_norm: s.vector(&w(PhiTensor::Norm(i)), h)?,
                attn_norm_bias: Some(s.vector(&b(PhiTensor::Norm(i)), h)?),
                wq,
                wk,
                wv,
                bq: Some(bq),
                bk: Some(bk),
                bv: Some(bv),
                wo: s.matrix(&w(PhiTensor::Out(i)), h, q)?,
                bo: Some(s.vector(&b(PhiTensor::Out(i)), h)?),
                q_norm: None,
                k_norm: None,
                post_attn_norm: None,
                ffn_norm: Vec::new(),
                w_gate: None,
                w_up: s.matrix(&w(PhiTensor::Fc1(i)), ff, h)?,
                b_up: Some(s.vector(&b(PhiTensor::Fc1(i)), ff)?),
                w_down: s.matrix(&w(PhiTensor::Fc2(i)), h, ff)?,
                b_down: Some(s.vector(&b(PhiTensor::Fc2(i)), h)?),
                post_ffn_norm: None,
            })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    Ok(ModelWeights {
        token_embd,
        layers,
        output_norm: s.vector(&w(PhiTensor::FinalNorm), h)?,
        output_norm_bias: Some(s.vector(&b(PhiTensor::FinalNorm), h)?),
        lm_head: s.matrix(&w(PhiTensor::LmHead), c.vocab_size, h)?,
        lm_head_bias: Some(s.vector(&b(PhiTensor::LmHead), c.vocab_size)?),
        config: c,
    })
}

/// A token given as `"<s>"` or `{"content": "<s>", ...}` in tokenizer_config.json.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(String::from),
        _ => None,
    }
}

/// Token ids given as a number or a list of numbers.
fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .into_iter()
            .collect(),
        Some(Value::Array(a)) => a.iter().flat_map(|x| ids(Some(x))).collect(),
        _ => Vec::new(),
    }
}

/// `chat_template` is a string, or a list of `{name, template}` (use "default").
fn template_source(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(String::from)),
        _ => None,
    }
}

pub(crate) fn load_hf_dir(dir: &Path) -> Result<LoadedModel, ModelError> {
    let raw: Value = read_json(&dir.join("config.json"))?;
    if crate::moondream::served::is_moondream_dir(&raw) {
        return crate::moondream::served::load_dir(dir);
    }
    let hf = read_hf_config(&dir.join("config.json"))?;
    let config = resolve_config(&hf)?;
    let store = TensorStore::open(dir)?;
    let weights = weights_from_store(config, &store)?;

    let tokenizer = crate::tokenizer::tokenizer_from_file(&dir.join("tokenizer.json"))?;
    let tc_path = dir.join("tokenizer_config.json");
    let tc: Value = if tc_path.is_file() {
        read_json(&tc_path)?
    } else {
        Value::Null
    };
    let gen_path = dir.join("generation_config.json");
    let generation: Value = if gen_path.is_file() {
        read_json(&gen_path)?
    } else {
        Value::Null
    };

    let bos_text = token_string(tc.get("bos_token"));
    let eos_text = token_string(tc.get("eos_token"));
    let bos_token_id = ids(hf.bos_token_id.as_ref())
        .first()
        .copied()
        .or_else(|| bos_text.as_deref().and_then(|t| tokenizer.token_to_id(t)));
    let mut eos_token_ids = Vec::new();
    let candidates = ids(generation.get("eos_token_id"))
        .into_iter()
        .chain(ids(hf.eos_token_id.as_ref()))
        .chain(eos_text.as_deref().and_then(|t| tokenizer.token_to_id(t)));
    for id in candidates {
        if !eos_token_ids.contains(&id) {
            eos_token_ids.push(id);
        }
    }
    // Newer checkpoints ship the template as its own file.
    let jinja_path = dir.join("chat_template.jinja");
    let source = if jinja_path.is_file() {
        Some(std::fs::read_to_string(&jinja_path).map_err(|e| ModelError::io(&jinja_path, e))?)
    } else {
        template_source(tc.get("chat_template"))
    };
    let chat_template = crate::load::chat_template_for(
        source.as_deref(),
        weights.config.architecture,
        &tokenizer,
        &mut eos_token_ids,
        bos_text.as_deref().unwrap_or(""),
        eos_text.as_deref().unwrap_or(""),
    )?;
    // Explicit flag, else whatever the tokenizer's post-processor would add.
    let add_bos_token = match tc.get("add_bos_token").and_then(Value::as_bool) {
        Some(b) => b,
        None => match (bos_token_id, tokenizer.encode("", true)) {
            (Some(bos), Ok(enc)) => enc.get_ids().first() == Some(&bos),
            _ => false,
        },
    };
    let name = dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(LoadedModel {
        weights,
        tokenizer,
        chat_template,
        bos_token_id,
        eos_token_ids,
        add_bos_token,
        name,
        vision: None,
    })
}

/// The weight type of a stored safetensors tensor: the float types Kestrel
/// keeps as stored; anything else is refused naming the tensor.
pub(crate) fn float_dtype(name: &str, dtype: Dtype) -> Result<DType, ModelError> {
    match dtype {
        Dtype::F32 => Ok(DType::F32),
        Dtype::F16 => Ok(DType::F16),
        Dtype::BF16 => Ok(DType::BF16),
        other => Err(ModelError::UnsupportedSafetensorsDtype {
            tensor: name.into(),
            dtype: format!("{other:?}"),
        }),
    }
}

#[cfg(test)]
mod tests;
