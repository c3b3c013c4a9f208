//! HF directory loading: `config.json` -> [`ModelConfig`], `*.safetensors`
//! (single or sharded via `model.safetensors.index.json`) -> mmap-backed
//! F32/F16/BF16 matrices, `tokenizer.json` + `tokenizer_config.json` (or
//! `chat_template.jinja`) -> tokenizer, chat template and special ids.
//! HF checkpoints keep Q/K unpermuted, so RoPE is [`RopeStyle::HalfSplit`].

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;
use serde_json::Value;

use crate::config::{ArchFeatures, ModelConfig, RopeStyle, SlidingWindow};
use crate::load::{check_matrix, check_vector, LoadedModel};
use crate::{Bytes, ChatTemplate, DType, LayerWeights, Matrix, ModelError, ModelWeights};

/// The `config.json` fields Kestrel reads (Llama, Mistral, Qwen2, Qwen3 families).
#[derive(Debug, Deserialize)]
struct HfConfig {
    model_type: Option<String>,
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
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: path.into(),
        source,
    })
}

fn resolve_config(hf: &HfConfig) -> Result<ModelConfig, ModelError> {
    let arch = hf.model_type.clone().unwrap_or_else(|| "llama".into());
    let qkv_bias = match arch.as_str() {
        "llama" | "mistral" | "qwen3" => hf.attention_bias.unwrap_or(false),
        "qwen2" => true,
        _ => {
            return Err(ModelError::UnsupportedArchitecture {
                architecture: arch,
                supported: HF_ARCHITECTURES,
            })
        }
    };
    if hf.num_attention_heads == 0 {
        return Err(ModelError::invalid("num_attention_heads is 0"));
    }
    let head_dim = hf
        .head_dim
        .unwrap_or(hf.hidden_size / hf.num_attention_heads);
    let rope_theta = hf.rope_theta.unwrap_or(10_000.0);
    let mut features = ArchFeatures {
        qk_norm: arch == "qwen3",
        ..ArchFeatures::default()
    };
    if let Some(scaling) = hf.rope_scaling.as_ref().filter(|v| !v.is_null()) {
        rope_scaling(scaling, head_dim, rope_theta, &mut features)?;
    }
    // Qwen2 configs name a window but switch it off (`use_sliding_window`).
    if let Some(window) = hf.sliding_window {
        if arch == "mistral" || hf.use_sliding_window == Some(true) {
            features.sliding_window = SlidingWindow::All { window };
        }
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
        rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-6),
        max_position_embeddings: hf.max_position_embeddings.unwrap_or(4096),
        tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
        qkv_bias,
        architecture: arch,
        features,
    };
    config.validate()?;
    Ok(config)
}

/// The HF `model_type`s Kestrel loads from safetensors.
pub const HF_ARCHITECTURES: &str = "llama, mistral, qwen2, qwen3";

/// `rope_scaling`: `llama3` becomes frequency factors, `linear` a position
/// scale; other kinds are ignored with a warning (exact within the original
/// training length).
fn rope_scaling(
    v: &Value,
    head_dim: usize,
    theta: f32,
    f: &mut ArchFeatures,
) -> Result<(), ModelError> {
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("");
    let num = |key: &str| -> Result<f32, ModelError> {
        v.get(key)
            .and_then(Value::as_f64)
            .map(|x| x as f32)
            .ok_or_else(|| ModelError::MissingMetadata {
                key: format!("rope_scaling.{key}"),
            })
    };
    match kind {
        "llama3" => {
            f.rope_freq_factors = Some(crate::config::llama3_rope_freq_factors(
                head_dim,
                theta,
                num("factor")?,
                num("low_freq_factor")?,
                num("high_freq_factor")?,
                num("original_max_position_embeddings")?,
            ))
        }
        "linear" => f.rope_linear_scale = num("factor")?,
        "default" => {}
        _ => {
            tracing::warn!(%v, "config.json declares rope_scaling Kestrel does not implement; it is ignored (fine for short contexts)")
        }
    }
    Ok(())
}

/// All tensors of a checkpoint, by name, as windows of their files' maps.
struct TensorStore {
    tensors: HashMap<String, (Dtype, Vec<usize>, Bytes)>,
}

impl TensorStore {
    fn open(dir: &Path) -> Result<Self, ModelError> {
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
        let dtype = match dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => {
                return Err(ModelError::UnsupportedSafetensorsDtype {
                    tensor: name.into(),
                    dtype: format!("{other:?}"),
                })
            }
        };
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

fn weights_from_store(c: ModelConfig, s: &TensorStore) -> Result<ModelWeights, ModelError> {
    let (h, q, kv, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let bias = |name: String, len| -> Result<Option<Vec<f32>>, ModelError> {
        if c.qkv_bias {
            Ok(Some(s.vector(&name, len)?))
        } else {
            Ok(None)
        }
    };
    let qk = c.features.qk_norm;
    let qk_norm = |name: String| qk.then(|| s.vector(&name, c.head_dim)).transpose();
    let token_embd = s.matrix("model.embed_tokens.weight", c.vocab_size, h)?;
    let layers = (0..c.num_layers)
        .map(|i| {
            let n = |x: &str| format!("model.layers.{i}.{x}");
            Ok(LayerWeights {
                attn_norm: s.vector(&n("input_layernorm.weight"), h)?,
                wq: s.matrix(&n("self_attn.q_proj.weight"), q, h)?,
                wk: s.matrix(&n("self_attn.k_proj.weight"), kv, h)?,
                wv: s.matrix(&n("self_attn.v_proj.weight"), kv, h)?,
                wo: s.matrix(&n("self_attn.o_proj.weight"), h, q)?,
                bq: bias(n("self_attn.q_proj.bias"), q)?,
                bk: bias(n("self_attn.k_proj.bias"), kv)?,
                bv: bias(n("self_attn.v_proj.bias"), kv)?,
                q_norm: qk_norm(n("self_attn.q_norm.weight"))?,
                k_norm: qk_norm(n("self_attn.k_norm.weight"))?,
                post_attn_norm: None,
                ffn_norm: s.vector(&n("post_attention_layernorm.weight"), h)?,
                w_gate: s.matrix(&n("mlp.gate_proj.weight"), ff, h)?,
                w_up: s.matrix(&n("mlp.up_proj.weight"), ff, h)?,
                w_down: s.matrix(&n("mlp.down_proj.weight"), h, ff)?,
                post_ffn_norm: None,
            })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let output_norm = s.vector("model.norm.weight", h)?;
    let lm_head = if c.tie_word_embeddings && !s.contains("lm_head.weight") {
        token_embd.clone()
    } else {
        s.matrix("lm_head.weight", c.vocab_size, h)?
    };
    Ok(ModelWeights {
        config: c,
        token_embd,
        layers,
        output_norm,
        lm_head,
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
    let hf: HfConfig = read_json(&dir.join("config.json"))?;
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
    let chat_template = ChatTemplate::from_optional(
        source.as_deref(),
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
    })
}

#[cfg(test)]
mod tests;
