//! `load(path)`: a `.gguf` file or an HF directory becomes a [`LoadedModel`]
//! (weights + tokenizer + chat template + special ids), with every tensor's
//! shape checked against the config. GGUF weights stay in the memory map
//! (no copy of quantized data); only norms and biases are decoded to `f32`.

use std::path::Path;

use tokenizers::Tokenizer;

use crate::chat::TemplateOrigin;
use crate::config::ModelConfig;
use crate::family::{gemma3_features, rope_scaling, Gemma3Keys};
use crate::{
    ChatTemplate, Family, GgufFile, LayerWeights, LoadOptions, Matrix, ModelError, ModelWeights,
};

/// A model ready for a runtime: weights plus everything text-side.
#[derive(Clone)]
pub struct LoadedModel {
    pub weights: ModelWeights,
    pub tokenizer: Tokenizer,
    /// What chat is rendered with; `None`: the model ships no template and
    /// none of its family's (nor ChatML) is spelled by its vocabulary, so
    /// chat requests are refused until one is named
    /// ([`LoadedModel::use_chat_template_file`]).
    pub chat_template: Option<ChatTemplate>,
    /// The model's BOS token, if it has one.
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation (EOS, end-of-turn), deduplicated.
    pub eos_token_ids: Vec<u32>,
    /// Whether raw (non-chat) prompts should start with BOS
    /// (`tokenizer.ggml.add_bos_token`, or what the HF tokenizer would add).
    pub add_bos_token: bool,
    /// Human-readable name (`general.name`, or the file/directory name).
    pub name: String,
    /// The vision side of a vision-language model (Moondream), `None` for
    /// a text-only one.
    pub vision: Option<crate::moondream::VisionModel>,
}

impl std::fmt::Debug for LoadedModel {
    // The tokenizer's own Debug prints the whole vocabulary.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("name", &self.name)
            .field("config", &self.weights.config)
            .field("vocab", &self.tokenizer.get_vocab_size(true))
            .field("bos_token_id", &self.bos_token_id)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("add_bos_token", &self.add_bos_token)
            .field("vision", &self.vision.as_ref().map(|v| &v.config))
            .field(
                "chat_template",
                &self.chat_template.as_ref().map(|t| &t.origin),
            )
            .finish_non_exhaustive()
    }
}

impl LoadedModel {
    /// Serves chat with the Jinja template in `path` (`--chat-template`)
    /// instead of the model's own or its fallback.
    pub fn use_chat_template_file(&mut self, path: &Path) -> Result<(), ModelError> {
        let text = |id: Option<u32>| {
            id.and_then(|i| self.tokenizer.id_to_token(i))
                .unwrap_or_default()
        };
        let t = ChatTemplate::from_file(
            path,
            &text(self.bos_token_id),
            &text(self.eos_token_ids.first().copied()),
        )?;
        tracing::info!(template = %t.origin, "chat template");
        self.chat_template = Some(t);
        Ok(())
    }

    /// Encodes `text` as-is (no BOS added); special tokens in the text are recognized.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        crate::tokenizer::encode(&self.tokenizer, text)
    }

    /// Encodes a raw prompt, prepending BOS when the model wants one and the
    /// text does not already start with it.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        let mut ids = self.encode(text)?;
        if let (true, Some(bos)) = (self.add_bos_token, self.bos_token_id) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Decodes ids to text (special tokens kept).
    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        crate::tokenizer::decode(&self.tokenizer, ids)
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id)
    }
}

/// Loads a `.gguf` file or an HF model directory (`config.json`,
/// `*.safetensors`, `tokenizer.json`, optional `tokenizer_config.json`);
/// a Moondream 2 directory (`model_type: "moondream1"`) loads with its
/// [`LoadedModel::vision`].
/// A path that does not exist but names a pinned model (`gemma3-270m`,
/// `smollm2-135m`; see [`crate::fetch`]) is fetched into the cache first.
pub fn load(path: &Path) -> Result<LoadedModel, ModelError> {
    load_with(path, &LoadOptions::default())
}

/// [`load`], then what `options` asks: `quantize` re-encodes an HF
/// directory's 16/32-bit matrices ([`crate::quantize_loaded`]) and is
/// refused for a GGUF file ([`ModelError::QuantizeStored`]) before it is read.
pub fn load_with(path: &Path, options: &LoadOptions) -> Result<LoadedModel, ModelError> {
    let started = std::time::Instant::now();
    let fetched;
    let path = match resolve_alias(path)? {
        Some(p) => {
            fetched = p;
            fetched.as_path()
        }
        None => path,
    };
    let model = if path.is_dir() {
        if !path.join("config.json").is_file() {
            return Err(ModelError::UnknownModelFormat { path: path.into() });
        }
        let mut model = crate::safetensors_load::load_hf_dir(path)?;
        if let Some(dtype) = options.quantize {
            crate::quantize_loaded(&mut model, dtype)?;
        }
        model
    } else if path.is_file() {
        if let Some(dtype) = options.quantize {
            return Err(ModelError::QuantizeStored {
                path: path.into(),
                dtype,
            });
        }
        load_gguf(path)?
    } else {
        return Err(ModelError::io(
            path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
        ));
    };
    tracing::info!(
        name = %model.name,
        layers = model.weights.config.num_layers,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "model loaded"
    );
    match &model.chat_template {
        Some(t) if t.origin == TemplateOrigin::Model => {
            tracing::info!(template = %t.origin, "chat template")
        }
        Some(t) => tracing::warn!(
            template = %t.origin,
            "chat is served with a template the model does not ship; --chat-template FILE names another"
        ),
        None => tracing::warn!(
            "the model ships no chat template and its vocabulary spells no known one: chat requests are refused; --chat-template FILE names one"
        ),
    }
    Ok(model)
}

/// The template chat is rendered with ([`ChatTemplate::for_model`]), with
/// the id of its turn end added to `eos_token_ids` when the template is
/// Kestrel's (the model's own states its end ids itself).
pub(crate) fn chat_template_for(
    source: Option<&str>,
    family: Family,
    tokenizer: &Tokenizer,
    eos_token_ids: &mut Vec<u32>,
    bos_token: &str,
    eos_token: &str,
) -> Result<Option<ChatTemplate>, ModelError> {
    let template = ChatTemplate::for_model(
        source,
        Some(family),
        |t| tokenizer.token_to_id(t).is_some(),
        bos_token,
        eos_token,
    )?;
    if let Some(id) = template
        .as_ref()
        .and_then(|t| t.turn_end)
        .and_then(|t| tokenizer.token_to_id(t))
    {
        if !eos_token_ids.contains(&id) {
            eos_token_ids.push(id);
        }
    }
    Ok(template)
}

/// The cached GGUF for `path` when it is not a file or directory but a
/// pinned model's alias.
fn resolve_alias(path: &Path) -> Result<Option<std::path::PathBuf>, ModelError> {
    if path.exists() {
        return Ok(None);
    }
    match path.to_str().and_then(crate::fetch::pinned_model) {
        Some(m) => {
            crate::fetch::pinned_model_path(m, &mut |stage| tracing::info!(?stage, "fetching"))
                .map(Some)
        }
        None => Ok(None),
    }
}

/// Checks a matrix against its expected `[rows, cols]`.
pub(crate) fn check_matrix(
    m: Matrix,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Matrix, ModelError> {
    if (m.rows, m.cols) != (rows, cols) {
        return Err(ModelError::ShapeMismatch {
            tensor: name.into(),
            expected: vec![rows, cols],
            found: vec![m.rows, m.cols],
        });
    }
    if !cols.is_multiple_of(m.dtype.block_elems()) {
        return Err(ModelError::BadBlockAlignment {
            tensor: name.into(),
            dtype: m.dtype,
            cols,
        });
    }
    Ok(m)
}

/// Checks a vector's length.
pub(crate) fn check_vector(v: Vec<f32>, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    if v.len() != len {
        return Err(ModelError::ShapeMismatch {
            tensor: name.into(),
            expected: vec![len],
            found: vec![v.len()],
        });
    }
    Ok(v)
}

/// Resolves the decoder config from `{arch}.*` GGUF metadata.
///
/// The family ([`Family::from_gguf`]) decides the RoPE pairing and what the
/// block adds; the file adds `rope_freqs.weight` (Llama 3 frequency factors),
/// a `llama.attention.sliding_window` key (Mistral-style windows on every
/// layer), RoPE scaling ([`crate::family`]'s one policy) and Gemma 3's keys
/// (see [`gemma3_keys`]).
pub fn config_from_gguf(g: &GgufFile) -> Result<ModelConfig, ModelError> {
    let arch = g.get_str("general.architecture")?.to_string();
    let family = Family::from_gguf(&arch)?;
    let k = |s: &str| format!("{arch}.{s}");
    let hidden = g.get_usize(&k("embedding_length"))?;
    let num_heads = g.get_usize(&k("attention.head_count"))?;
    let num_kv_heads = match g.get(&k("attention.head_count_kv")) {
        Some(_) => g.get_usize(&k("attention.head_count_kv"))?,
        None => num_heads,
    };
    if num_heads == 0 {
        return Err(ModelError::invalid("attention.head_count is 0"));
    }
    let head_dim = match g.get(&k("attention.key_length")) {
        Some(_) => g.get_usize(&k("attention.key_length"))?,
        None => hidden / num_heads,
    };
    if let Some(rot) = g.get(&k("rope.dimension_count")).and_then(|v| v.as_u64()) {
        if rot as usize != head_dim {
            return Err(family.unsupported(format!(
                "partial rotary embeddings (rope.dimension_count {rot} != head_dim {head_dim})"
            )));
        }
    }
    let rope_theta = g
        .get(&k("rope.freq_base"))
        .and_then(|v| v.as_f32())
        .unwrap_or(10_000.0);
    let mut features = family.base_features();
    if let Some(kind) = g.get(&k("rope.scaling.type")).and_then(|v| v.as_str()) {
        let num = |key: &str| g.get_f32(&k(&format!("rope.scaling.{key}")));
        rope_scaling(family, kind, head_dim, rope_theta, num, &mut features)?;
    }
    if g.tensor("rope_freqs.weight").is_some() {
        let ff = check_vector(
            g.vector_f32("rope_freqs.weight")?,
            "rope_freqs.weight",
            head_dim / 2,
        )?;
        features.rope_freq_factors = Some(ff);
    }
    let window = match g.get(&k("attention.sliding_window")) {
        Some(_) => Some(g.get_usize(&k("attention.sliding_window"))?),
        None => None,
    };
    if family == Family::Gemma3 {
        let keys = gemma3_keys(g, hidden, num_heads, head_dim, window)?;
        gemma3_features(&keys, &mut features)?;
    } else {
        // A GGUF names a window on every layer only in a `llama` file
        // (Mistral's conversion); other families' window keys are not read.
        features.sliding_window = family.uniform_window(window, family == Family::Llama);
    }
    let vocab_size = match g.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
        Some(tokens) => tokens.len(),
        None => g.get_usize(&k("vocab_size"))?,
    };
    let config = ModelConfig {
        architecture: family,
        vocab_size,
        hidden_size: hidden,
        intermediate_size: g.get_usize(&k("feed_forward_length"))?,
        num_layers: g.get_usize(&k("block_count"))?,
        num_heads,
        num_kv_heads,
        head_dim,
        rope_theta,
        rope_style: family.gguf_rope_style(),
        rms_norm_eps: g.get_f32(&k("attention.layer_norm_rms_epsilon"))?,
        max_position_embeddings: g.get_usize(&k("context_length"))?,
        tie_word_embeddings: g.tensor("output.weight").is_none(),
        qkv_bias: family.qkv_bias(None),
        features,
    };
    config.validate()?;
    Ok(config)
}

/// Gemma 3's keys in a GGUF. The converter already added Gemma's `1 +` to
/// every `*norm.weight` it stored (`norm_shift`), so the norms are plain
/// RMSNorms. GGUF does not carry `query_pre_attn_scalar`: llama.cpp uses
/// `hidden / heads` for the 62-layer 27B and `head_dim` for every other
/// size; `attention.scale` overrides. Local layers: window
/// `attention.sliding_window`, RoPE base `rope.freq_base_swa`, one global
/// layer every `attention.sliding_window_pattern` (6 when absent).
fn gemma3_keys(
    g: &GgufFile,
    hidden: usize,
    num_heads: usize,
    head_dim: usize,
    window: Option<usize>,
) -> Result<Gemma3Keys<'static>, ModelError> {
    let k = |s: &str| format!("gemma3.{s}");
    let attn_scale = match g.get(&k("attention.scale")) {
        Some(_) => g.get_f32(&k("attention.scale"))?,
        None => {
            let layers = g.get_usize(&k("block_count"))?;
            let scalar = if layers == 62 {
                hidden / num_heads
            } else {
                head_dim
            };
            1.0 / (scalar as f32).sqrt()
        }
    };
    let window = window.ok_or_else(|| ModelError::MissingMetadata {
        key: k("attention.sliding_window"),
    })?;
    let period = match g.get(&k("attention.sliding_window_pattern")) {
        None => 6,
        Some(v) => v.as_u64().map(|p| p as usize).ok_or_else(|| {
            Family::Gemma3.unsupported(
                "a per-layer gemma3.attention.sliding_window_pattern (Kestrel runs one global layer every p layers)",
            )
        })?,
    };
    Ok(Gemma3Keys {
        hidden_size: hidden,
        attn_scale,
        final_logit_softcap: g
            .get(&k("final_logit_softcapping"))
            .and_then(|v| v.as_f32()),
        window,
        period,
        rope_theta_local: g.get(&k("rope.freq_base_swa")).and_then(|v| v.as_f32()),
        attn_logit_softcap: None,
        bidirectional: false,
        activation: None,
    })
}

/// Builds [`ModelWeights`] from a parsed GGUF, validating every shape.
pub fn weights_from_gguf(g: &GgufFile) -> Result<ModelWeights, ModelError> {
    let c = config_from_gguf(g)?;
    let (h, q, kv, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let mat = |name: &str, rows, cols| check_matrix(g.matrix(name)?, name, rows, cols);
    let vec = |name: &str, len| check_vector(g.vector_f32(name)?, name, len);
    let bias = |name: String, len| -> Result<Option<Vec<f32>>, ModelError> {
        match (c.qkv_bias, g.tensor(&name).is_some()) {
            (_, true) => Ok(Some(vec(&name, len)?)),
            (true, false) => Err(ModelError::MissingTensor { tensor: name }),
            (false, false) => Ok(None),
        }
    };
    // A norm the family needs (missing = error), or none.
    let norm = |needed: bool, name: String, len| needed.then(|| vec(&name, len)).transpose();
    let (qk_norm, post) = (c.features.qk_norm, c.features.post_norms);
    let token_embd = mat("token_embd.weight", c.vocab_size, h)?;
    let layers = (0..c.num_layers)
        .map(|i| {
            let n = |s: &str| format!("blk.{i}.{s}");
            Ok(LayerWeights {
                attn_norm: vec(&n("attn_norm.weight"), h)?,
                wq: mat(&n("attn_q.weight"), q, h)?,
                wk: mat(&n("attn_k.weight"), kv, h)?,
                wv: mat(&n("attn_v.weight"), kv, h)?,
                wo: mat(&n("attn_output.weight"), h, q)?,
                bq: bias(n("attn_q.bias"), q)?,
                bk: bias(n("attn_k.bias"), kv)?,
                bv: bias(n("attn_v.bias"), kv)?,
                q_norm: norm(qk_norm, n("attn_q_norm.weight"), c.head_dim)?,
                k_norm: norm(qk_norm, n("attn_k_norm.weight"), c.head_dim)?,
                post_attn_norm: norm(post, n("post_attention_norm.weight"), h)?,
                ffn_norm: vec(&n("ffn_norm.weight"), h)?,
                w_gate: Some(mat(&n("ffn_gate.weight"), ff, h)?),
                w_up: mat(&n("ffn_up.weight"), ff, h)?,
                w_down: mat(&n("ffn_down.weight"), h, ff)?,
                post_ffn_norm: norm(post, n("post_ffw_norm.weight"), h)?,
                attn_norm_bias: None,
                bo: None,
                b_up: None,
                b_down: None,
            })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let output_norm = vec("output_norm.weight", h)?;
    let lm_head = if c.tie_word_embeddings {
        token_embd.clone()
    } else {
        mat("output.weight", c.vocab_size, h)?
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

fn load_gguf(path: &Path) -> Result<LoadedModel, ModelError> {
    let g = GgufFile::open(path)?;
    let weights = weights_from_gguf(&g)?;
    let tokenizer = crate::tokenizer::tokenizer_from_gguf(&g)?;
    let tokens = g.get_string_array("tokenizer.ggml.tokens")?;
    let id = |key: &str| -> Option<u32> {
        let v = g.get(key)?.as_u64()?;
        u32::try_from(v)
            .ok()
            .filter(|&i| (i as usize) < tokens.len())
    };
    let token_text = |i: Option<u32>| {
        i.map(|i| tokens[i as usize].to_string())
            .unwrap_or_default()
    };
    let bos_token_id = id("tokenizer.ggml.bos_token_id");
    let mut eos_token_ids = Vec::new();
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if let Some(i) = id(key).filter(|i| !eos_token_ids.contains(i)) {
            eos_token_ids.push(i);
        }
    }
    let eos_text = token_text(eos_token_ids.first().copied());
    let chat_template = chat_template_for(
        g.get("tokenizer.chat_template").and_then(|v| v.as_str()),
        weights.config.architecture,
        &tokenizer,
        &mut eos_token_ids,
        &token_text(bos_token_id),
        &eos_text,
    )?;
    let name = match g.get("general.name").and_then(|v| v.as_str()) {
        Some(n) => n.to_string(),
        None => path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
    };
    Ok(LoadedModel {
        weights,
        tokenizer,
        chat_template,
        bos_token_id,
        eos_token_ids,
        add_bos_token: g
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false),
        name,
        vision: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::write_gguf;
    use crate::{synthetic_weights, DType, GgufValue};

    /// Writes synthetic weights out as a llama GGUF (no tokenizer).
    fn synthetic_gguf(c: &ModelConfig, dtype: DType, drop: Option<&str>) -> GgufFile {
        let w = synthetic_weights(c, dtype, 5);
        let m = |name: String, m: &Matrix| {
            (
                name,
                vec![m.cols as u64, m.rows as u64],
                m.dtype,
                m.data.to_vec(),
            )
        };
        let v = |name: String, v: &[f32]| {
            (
                name,
                vec![v.len() as u64],
                DType::F32,
                v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
            )
        };
        let mut tensors = vec![
            m("token_embd.weight".into(), &w.token_embd),
            v("output_norm.weight".into(), &w.output_norm),
        ];
        if !c.tie_word_embeddings {
            tensors.push(m("output.weight".into(), &w.lm_head));
        }
        for (i, l) in w.layers.iter().enumerate() {
            tensors.push(v(format!("blk.{i}.attn_norm.weight"), &l.attn_norm));
            tensors.push(v(format!("blk.{i}.ffn_norm.weight"), &l.ffn_norm));
            for (n, mm) in [
                ("attn_q", &l.wq),
                ("attn_k", &l.wk),
                ("attn_v", &l.wv),
                ("attn_output", &l.wo),
                ("ffn_gate", l.w_gate.as_ref().unwrap()),
                ("ffn_up", &l.w_up),
                ("ffn_down", &l.w_down),
            ] {
                tensors.push(m(format!("blk.{i}.{n}.weight"), mm));
            }
        }
        tensors.retain(|t| Some(t.0.as_str()) != drop);
        let tref: Vec<_> = tensors
            .iter()
            .map(|(n, d, t, b)| (n.as_str(), d.clone(), *t, b.clone()))
            .collect();
        let u = |x: usize| GgufValue::U32(x as u32);
        let bytes = write_gguf(
            &[
                ("general.architecture", GgufValue::String("llama".into())),
                ("llama.vocab_size", u(c.vocab_size)),
                ("llama.embedding_length", u(c.hidden_size)),
                ("llama.feed_forward_length", u(c.intermediate_size)),
                ("llama.block_count", u(c.num_layers)),
                ("llama.attention.head_count", u(c.num_heads)),
                ("llama.attention.head_count_kv", u(c.num_kv_heads)),
                ("llama.rope.freq_base", GgufValue::F32(c.rope_theta)),
                (
                    "llama.attention.layer_norm_rms_epsilon",
                    GgufValue::F32(c.rms_norm_eps),
                ),
                ("llama.context_length", u(c.max_position_embeddings)),
                ("llama.rope.dimension_count", u(c.head_dim)),
            ],
            &tref,
        );
        GgufFile::parse(bytes.into(), "synthetic.gguf".into()).unwrap()
    }

    #[test]
    fn synthetic_gguf_round_trips() {
        let c = ModelConfig::tiny();
        let g = synthetic_gguf(&c, DType::Q4K, None);
        assert_eq!(config_from_gguf(&g).unwrap(), c);
        let w = weights_from_gguf(&g).unwrap();
        let orig = synthetic_weights(&c, DType::Q4K, 5);
        assert_eq!(&*w.layers[1].w_down.data, &*orig.layers[1].w_down.data);
        assert_eq!(w.layers[1].ffn_norm, orig.layers[1].ffn_norm);
    }

    #[test]
    fn tied_when_output_missing() {
        let mut c = ModelConfig::tiny();
        c.tie_word_embeddings = true;
        let w = weights_from_gguf(&synthetic_gguf(&c, DType::Q8_0, None)).unwrap();
        assert!(w.config.tie_word_embeddings);
        assert_eq!(w.lm_head.data.as_ptr(), w.token_embd.data.as_ptr());
    }

    #[test]
    fn unsupported_architecture_names_it_and_lists_the_supported() {
        let bytes = write_gguf(
            &[("general.architecture", GgufValue::String("phi3".into()))],
            &[],
        );
        let g = GgufFile::parse(bytes.into(), "phi3.gguf".into()).unwrap();
        let err = config_from_gguf(&g).unwrap_err();
        assert!(
            matches!(err, ModelError::UnsupportedArchitecture { ref architecture, .. } if architecture == "phi3")
        );
        let msg = err.to_string();
        for arch in ["`phi3`", "llama", "qwen2", "qwen3", "gemma3"] {
            assert!(msg.contains(arch), "{msg}");
        }
    }

    /// RoPE scaling Kestrel does not compute is refused by name, as the HF
    /// path refuses it (one policy, `family::rope_scaling`).
    #[test]
    fn unknown_rope_scaling_is_refused_by_name() {
        let u = |x: u32| GgufValue::U32(x);
        let bytes = write_gguf(
            &[
                ("general.architecture", GgufValue::String("llama".into())),
                ("llama.embedding_length", u(256)),
                ("llama.attention.head_count", u(4)),
                ("llama.rope.scaling.type", GgufValue::String("yarn".into())),
                ("llama.rope.scaling.factor", GgufValue::F32(4.0)),
            ],
            &[],
        );
        let g = GgufFile::parse(bytes.into(), "yarn.gguf".into()).unwrap();
        let err = config_from_gguf(&g).unwrap_err();
        assert!(
            matches!(err, ModelError::Unsupported { family: Family::Llama, ref feature } if feature.contains("`yarn`")),
            "{err}"
        );
    }

    #[test]
    fn missing_tensor_is_named() {
        let g = synthetic_gguf(
            &ModelConfig::tiny(),
            DType::F32,
            Some("blk.1.ffn_up.weight"),
        );
        match weights_from_gguf(&g) {
            Err(ModelError::MissingTensor { tensor }) => assert_eq!(tensor, "blk.1.ffn_up.weight"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn wrong_shape_is_named() {
        let mut c = ModelConfig::tiny();
        c.intermediate_size = 256; // the file says 512
        let g = synthetic_gguf(&ModelConfig::tiny(), DType::F32, None);
        let err = check_matrix(
            g.matrix("blk.0.ffn_up.weight").unwrap(),
            "blk.0.ffn_up.weight",
            c.intermediate_size,
            256,
        );
        assert!(
            matches!(err, Err(ModelError::ShapeMismatch { ref tensor, .. }) if tensor == "blk.0.ffn_up.weight")
        );
    }
}
