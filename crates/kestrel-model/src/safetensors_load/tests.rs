//! HF-directory loading tests on tiny checkpoints written to a temp dir:
//! single-file and sharded safetensors, mixed F32/F16/BF16, Qwen2 biases,
//! tied embeddings, template/special-token discovery, typed shape errors.
//! Qwen3 and Gemma 3 against their converted GGUF: `families.rs`.

use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

use crate::{load, synthetic_weights, DType, Matrix, ModelConfig, ModelError, RopeStyle};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("kestrel-st-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

fn entry(name: String, m: &Matrix, dtype: DType, one_d: bool) -> Entry {
    let values = m.to_f32();
    let re = Matrix::quantize(dtype, m.rows, m.cols, &values);
    let st = match dtype {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        _ => Dtype::BF16,
    };
    let shape = if one_d {
        vec![m.cols]
    } else {
        vec![m.rows, m.cols]
    };
    (name, st, shape, re.data.to_vec())
}

fn vector(name: String, v: &[f32]) -> Entry {
    let m = Matrix::quantize(DType::F32, 1, v.len(), v);
    entry(name, &m, DType::F32, true)
}

/// HF tensors for `c`, matrices alternating F16/BF16/F32.
fn hf_tensors(c: &ModelConfig) -> Vec<Entry> {
    hf_tensors_with(c, 9, false, vector)
}

/// HF tensors of `c`'s synthetic weights (`seed`) with the names HF gives
/// them: the embedding BF16, an untied head F16, each layer's matrices
/// cycling F16/BF16/F32 (shifted by the layer index when `shift_by_layer`),
/// biases F32, and every norm through `norm`. Layer norms are named as the
/// family names them: Gemma's four (the block has post-norms) or Llama's
/// two; q/k norms when the block has them.
fn hf_tensors_with(
    c: &ModelConfig,
    seed: u64,
    shift_by_layer: bool,
    mut norm: impl FnMut(String, &[f32]) -> Entry,
) -> Vec<Entry> {
    let w = synthetic_weights(c, DType::F32, seed);
    let dt = [DType::F16, DType::BF16, DType::F32];
    let mut t = vec![
        entry(
            "model.embed_tokens.weight".into(),
            &w.token_embd,
            DType::BF16,
            false,
        ),
        norm("model.norm.weight".into(), &w.output_norm),
    ];
    if !c.tie_word_embeddings {
        t.push(entry(
            "lm_head.weight".into(),
            &w.lm_head,
            DType::F16,
            false,
        ));
    }
    for (i, l) in w.layers.iter().enumerate() {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        t.push(norm(p("input_layernorm.weight"), &l.attn_norm));
        match (&l.post_attn_norm, &l.post_ffn_norm) {
            (Some(post_attn), Some(post_ffn)) => {
                t.push(norm(p("post_attention_layernorm.weight"), post_attn));
                t.push(norm(p("pre_feedforward_layernorm.weight"), &l.ffn_norm));
                t.push(norm(p("post_feedforward_layernorm.weight"), post_ffn));
            }
            _ => t.push(norm(p("post_attention_layernorm.weight"), &l.ffn_norm)),
        }
        for (n, v) in [("q_norm", &l.q_norm), ("k_norm", &l.k_norm)] {
            if let Some(v) = v {
                t.push(norm(p(&format!("self_attn.{n}.weight")), v));
            }
        }
        let mats = [
            ("self_attn.q_proj", &l.wq),
            ("self_attn.k_proj", &l.wk),
            ("self_attn.v_proj", &l.wv),
            ("self_attn.o_proj", &l.wo),
            ("mlp.gate_proj", l.w_gate.as_ref().unwrap()),
            ("mlp.up_proj", &l.w_up),
            ("mlp.down_proj", &l.w_down),
        ];
        let offset = if shift_by_layer { i } else { 0 };
        for (k, (n, m)) in mats.into_iter().enumerate() {
            t.push(entry(
                p(&format!("{n}.weight")),
                m,
                dt[(offset + k) % 3],
                false,
            ));
        }
        for (n, b) in [("q_proj", &l.bq), ("k_proj", &l.bk), ("v_proj", &l.bv)] {
            if let Some(b) = b {
                t.push(vector(p(&format!("self_attn.{n}.bias")), b));
            }
        }
    }
    t
}

fn write_st(path: &Path, tensors: &[Entry]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn write_dir(dir: &Path, c: &ModelConfig, model_type: &str, tensors: &[Entry], shards: usize) {
    write_dir_with(dir, llama_config_json(c, model_type), tensors, shards);
}

/// The `config.json` of a Llama-shaped family.
fn llama_config_json(c: &ModelConfig, model_type: &str) -> serde_json::Value {
    json!({
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": [2, 0],
    })
}

fn write_dir_with(dir: &Path, cfg: serde_json::Value, tensors: &[Entry], shards: usize) {
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    if shards == 1 {
        write_st(&dir.join("model.safetensors"), tensors);
    } else {
        let mut map = serde_json::Map::new();
        for (s, chunk) in tensors.chunks(tensors.len().div_ceil(shards)).enumerate() {
            let file = format!("model-{:05}-of-{shards:05}.safetensors", s + 1);
            write_st(&dir.join(&file), chunk);
            for t in chunk {
                map.insert(t.0.clone(), json!(file));
            }
        }
        let index = json!({ "metadata": {}, "weight_map": map });
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
    let tk = crate::tokenizer::tokenizer_from_gguf(&crate::tokenizer::tests::tiny_gguf("smollm"))
        .unwrap();
    tk.save(dir.join("tokenizer.json"), false).unwrap();
    let tc = json!({
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": true},
        "chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}",
    });
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
}

fn tiny(vocab: usize) -> ModelConfig {
    ModelConfig {
        vocab_size: vocab,
        rope_style: RopeStyle::HalfSplit,
        ..ModelConfig::tiny()
    }
}

#[test]
fn llama_single_file() {
    let dir = TempDir::new("llama");
    let c = tiny(23);
    let tensors = hf_tensors(&c);
    write_dir(&dir.0, &c, "llama", &tensors, 1);
    let m = load(&dir.0).unwrap();
    assert_eq!(m.weights.config, c);
    let l = &m.weights.layers[1];
    assert_eq!(
        (l.wq.dtype, l.wk.dtype, l.wv.dtype),
        (DType::F16, DType::BF16, DType::F32)
    );
    assert!(l.wq.data.is_mapped() && m.weights.token_embd.data.is_mapped());
    // Values survive the F16 round trip.
    let orig = synthetic_weights(&c, DType::F32, 9);
    let (a, b) = (orig.layers[1].wq.to_f32(), l.wq.to_f32());
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-4));
    assert_eq!(m.bos_token_id, Some(1));
    assert_eq!(m.eos_token_ids, vec![2, 0]);
    assert_eq!(m.encode("<|im_start|>hello").unwrap(), vec![1, 16]);
    let out = m
        .chat_template
        .as_ref()
        .unwrap()
        .render(&[crate::ChatMessage::user("hi")], false)
        .unwrap();
    assert_eq!(out, "[user]hi<|im_end|>");
}

/// A checkpoint that does not say its `model_type` is refused, naming the
/// key and the file, rather than loaded as a Llama.
#[test]
fn a_config_without_model_type_is_refused_by_name() {
    let dir = TempDir::new("nomodeltype");
    let c = tiny(23);
    let mut cfg = llama_config_json(&c, "llama");
    cfg.as_object_mut().unwrap().remove("model_type");
    write_dir_with(&dir.0, cfg, &hf_tensors(&c), 1);
    let err = load(&dir.0).unwrap_err();
    match &err {
        ModelError::MissingConfigKey { path, key } => {
            assert_eq!(*key, "model_type");
            assert_eq!(path, &dir.0.join("config.json"));
        }
        other => panic!("expected MissingConfigKey, got {other:?}"),
    }
    assert!(err.to_string().contains("`model_type`"), "{err}");
}

#[test]
fn qwen2_sharded_tied_with_bias() {
    let dir = TempDir::new("qwen2");
    let mut c = tiny(23);
    c.architecture = crate::Family::Qwen2;
    c.qkv_bias = true;
    c.tie_word_embeddings = true;
    write_dir(&dir.0, &c, "qwen2", &hf_tensors(&c), 3);
    let m = load(&dir.0).unwrap();
    assert_eq!(m.weights.config, c);
    assert_eq!(
        m.weights.layers[0].bk.as_ref().map(Vec::len),
        Some(c.kv_dim())
    );
    assert_eq!(
        m.weights.lm_head.data.as_ptr(),
        m.weights.token_embd.data.as_ptr()
    );
}

#[test]
fn wrong_shape_names_tensor() {
    let dir = TempDir::new("shape");
    let c = tiny(23);
    let mut tensors = hf_tensors(&c);
    let bad = tensors
        .iter_mut()
        .find(|t| t.0 == "model.layers.1.mlp.up_proj.weight")
        .unwrap();
    bad.2 = vec![c.intermediate_size / 2, c.hidden_size * 2];
    write_dir(&dir.0, &c, "llama", &tensors, 1);
    match load(&dir.0) {
        Err(ModelError::ShapeMismatch {
            tensor,
            expected,
            found,
        }) => {
            assert_eq!(tensor, "model.layers.1.mlp.up_proj.weight");
            assert_eq!(expected, vec![512, 256]);
            assert_eq!(found, vec![256, 512]);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn missing_tensor_and_bad_arch() {
    let dir = TempDir::new("missing");
    let c = tiny(23);
    let mut tensors = hf_tensors(&c);
    tensors.retain(|t| t.0 != "model.layers.0.self_attn.k_proj.weight");
    write_dir(&dir.0, &c, "llama", &tensors, 1);
    assert!(
        matches!(load(&dir.0), Err(ModelError::MissingTensor { tensor }) if tensor == "model.layers.0.self_attn.k_proj.weight")
    );
    write_dir(&dir.0, &c, "gpt_neox", &hf_tensors(&c), 1);
    assert!(matches!(
        load(&dir.0),
        Err(ModelError::UnsupportedArchitecture { .. })
    ));
    let empty = TempDir::new("empty");
    assert!(matches!(
        load(&empty.0),
        Err(ModelError::UnknownModelFormat { .. })
    ));
}

mod families;
mod phi;
