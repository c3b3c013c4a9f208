//! Qwen3 and Gemma 3 HF directories against their GGUF: each tiny
//! directory is converted in-test the way llama.cpp's converter does (tensor
//! names, 1-D tensors as F32, Gemma's `+ 1` on every `*norm.weight`), and
//! both loads must give an equal config and bit-equal weights. Also Gemma 3
//! config resolution (the real 270M `config.json`, `transformers` 5
//! `rope_parameters`) and what is refused.

use super::*;
/// HF tensors of a Qwen3 or Gemma 3 config (q/k norms; Gemma's four layer
/// norms), matrices alternating F16/BF16/F32, norms BF16 or F32. Gemma's
/// norms are stored as HF stores them: `w` for `x * (1 + w)`, so the
/// synthetic effective norm minus 1.
fn family_tensors(c: &ModelConfig) -> Vec<Entry> {
    let shift = if c.features.post_norms { 1.0 } else { 0.0 };
    let mut k = 0usize;
    let norm = |name: String, v: &[f32]| {
        let raw: Vec<f32> = v.iter().map(|x| x - shift).collect();
        let m = Matrix::quantize(DType::F32, 1, raw.len(), &raw);
        k += 1;
        let dt = if k.is_multiple_of(2) {
            DType::BF16
        } else {
            DType::F32
        };
        entry(name, &m, dt, true)
    };
    hf_tensors_with(c, 11, true, norm)
}

/// llama.cpp's tensor name for an HF one (`gguf-py` `tensor_mapping.py`).
/// Gemma's `post_attention_layernorm` is a post-norm (`post_attention_norm`)
/// and `pre_feedforward_layernorm` the FFN norm; Llama/Qwen's
/// `post_attention_layernorm` is the FFN norm.
fn gguf_name(hf: &str, gemma: bool) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").expect(hf);
    let (i, part) = rest.split_once('.').unwrap();
    let (stem, suffix) = part.rsplit_once('.').unwrap();
    let post_attn = if gemma {
        "post_attention_norm"
    } else {
        "ffn_norm"
    };
    let g = match stem {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => post_attn,
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        other => panic!("no GGUF name for {other}"),
    };
    format!("blk.{i}.{g}.{suffix}")
}

/// The GGUF llama.cpp's converter writes for these HF tensors: matrices
/// byte for byte in their dtype, 1-D tensors as F32, and for Gemma every
/// `*norm.weight` plus 1 (its `norm_shift`). Metadata as the converter
/// writes it for `c` (Gemma: no `query_pre_attn_scalar`, so the loader's
/// `head_dim` default stands in for it).
fn converted_gguf(c: &ModelConfig, tensors: &[Entry]) -> crate::GgufFile {
    use crate::GgufValue;
    let gemma = c.architecture == crate::Family::Gemma3;
    let st_dtype = |d: &Dtype| match d {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        _ => DType::BF16,
    };
    let out: Vec<(String, Vec<u64>, DType, Vec<u8>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            let g = gguf_name(name, gemma);
            match shape.as_slice() {
                [n] => {
                    let stored = Matrix {
                        dtype: st_dtype(dtype),
                        rows: 1,
                        cols: *n,
                        data: bytes.clone().into(),
                    };
                    let shift = if gemma && name.ends_with("norm.weight") {
                        1.0
                    } else {
                        0.0
                    };
                    let v: Vec<u8> = stored
                        .to_f32()
                        .iter()
                        .flat_map(|x| (x + shift).to_le_bytes())
                        .collect();
                    (g, vec![*n as u64], DType::F32, v)
                }
                [r, cols] => (
                    g,
                    vec![*cols as u64, *r as u64],
                    st_dtype(dtype),
                    bytes.clone(),
                ),
                _ => unreachable!(),
            }
        })
        .collect();
    let arch = c.architecture.name();
    let u = |x: usize| GgufValue::U32(x as u32);
    let mut meta = vec![
        (
            "general.architecture".to_string(),
            GgufValue::String(arch.into()),
        ),
        (format!("{arch}.vocab_size"), u(c.vocab_size)),
        (format!("{arch}.embedding_length"), u(c.hidden_size)),
        (
            format!("{arch}.feed_forward_length"),
            u(c.intermediate_size),
        ),
        (format!("{arch}.block_count"), u(c.num_layers)),
        (format!("{arch}.attention.head_count"), u(c.num_heads)),
        (format!("{arch}.attention.head_count_kv"), u(c.num_kv_heads)),
        (format!("{arch}.attention.key_length"), u(c.head_dim)),
        (format!("{arch}.attention.value_length"), u(c.head_dim)),
        (
            format!("{arch}.rope.freq_base"),
            GgufValue::F32(c.rope_theta),
        ),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            GgufValue::F32(c.rms_norm_eps),
        ),
        (
            format!("{arch}.context_length"),
            u(c.max_position_embeddings),
        ),
    ];
    if let crate::SlidingWindow::Interleaved { window, period } = c.features.sliding_window {
        meta.push((format!("{arch}.attention.sliding_window"), u(window)));
        meta.push((
            format!("{arch}.attention.sliding_window_pattern"),
            u(period),
        ));
    }
    if let Some(cap) = c.features.final_logit_softcap {
        meta.push((
            format!("{arch}.final_logit_softcapping"),
            GgufValue::F32(cap),
        ));
    }
    let meta_ref: Vec<(&str, GgufValue)> =
        meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let tref: Vec<_> = out
        .iter()
        .map(|(n, d, t, b)| (n.as_str(), d.clone(), *t, b.clone()))
        .collect();
    let bytes = crate::gguf::write_gguf(&meta_ref, &tref);
    crate::GgufFile::parse(bytes.into(), "converted.gguf".into()).unwrap()
}

/// Same config, and every weight the forward reads equal: matrices byte for
/// byte in the same dtype, norms and biases bit for bit. The CPU and CUDA
/// forwards are functions of exactly these, so equal here is equal logits.
fn assert_same_model(hf: &crate::ModelWeights, gguf: &crate::ModelWeights) {
    assert_eq!(hf.config, gguf.config);
    let mat = |a: &Matrix, b: &Matrix, what: String| {
        assert_eq!(
            (a.dtype, a.rows, a.cols),
            (b.dtype, b.rows, b.cols),
            "{what}"
        );
        assert!(*a.data == *b.data, "{what}: bytes differ");
    };
    let vec = |a: &Option<Vec<f32>>, b: &Option<Vec<f32>>, what: String| match (a, b) {
        (Some(a), Some(b)) => {
            assert_eq!(a.len(), b.len(), "{what}");
            let bad = a
                .iter()
                .zip(b)
                .position(|(x, y)| x.to_bits() != y.to_bits());
            if let Some(i) = bad {
                panic!("{what}[{i}]: HF {} != GGUF {}", a[i], b[i]);
            }
        }
        (None, None) => {}
        _ => panic!("{what}: present in one model only"),
    };
    mat(&hf.token_embd, &gguf.token_embd, "token_embd".into());
    mat(&hf.lm_head, &gguf.lm_head, "lm_head".into());
    vec(
        &Some(hf.output_norm.clone()),
        &Some(gguf.output_norm.clone()),
        "output_norm".into(),
    );
    assert_eq!(hf.layers.len(), gguf.layers.len());
    for (i, (a, b)) in hf.layers.iter().zip(&gguf.layers).enumerate() {
        let w = |s: &str| format!("layer {i} {s}");
        for (n, x, y) in [
            ("wq", &a.wq, &b.wq),
            ("wk", &a.wk, &b.wk),
            ("wv", &a.wv, &b.wv),
            ("wo", &a.wo, &b.wo),
            (
                "w_gate",
                a.w_gate.as_ref().unwrap(),
                b.w_gate.as_ref().unwrap(),
            ),
            ("w_up", &a.w_up, &b.w_up),
            ("w_down", &a.w_down, &b.w_down),
        ] {
            mat(x, y, w(n));
        }
        for (n, x, y) in [
            (
                "attn_norm",
                Some(a.attn_norm.clone()),
                Some(b.attn_norm.clone()),
            ),
            (
                "ffn_norm",
                Some(a.ffn_norm.clone()),
                Some(b.ffn_norm.clone()),
            ),
            ("q_norm", a.q_norm.clone(), b.q_norm.clone()),
            ("k_norm", a.k_norm.clone(), b.k_norm.clone()),
            (
                "post_attn_norm",
                a.post_attn_norm.clone(),
                b.post_attn_norm.clone(),
            ),
            (
                "post_ffn_norm",
                a.post_ffn_norm.clone(),
                b.post_ffn_norm.clone(),
            ),
            ("bq", a.bq.clone(), b.bq.clone()),
            ("bk", a.bk.clone(), b.bk.clone()),
            ("bv", a.bv.clone(), b.bv.clone()),
        ] {
            vec(&x, &y, w(n));
        }
    }
}

/// Qwen3 at a tiny shape: head_dim 96 != hidden / heads, tied.
fn qwen3_tiny() -> ModelConfig {
    ModelConfig {
        architecture: crate::Family::Qwen3,
        head_dim: 96,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        features: crate::ArchFeatures {
            qk_norm: true,
            ..crate::ArchFeatures::default()
        },
        ..tiny(23)
    }
}

/// Qwen3's `config.json` as Qwen publishes it (window named, switched off).
fn qwen3_json(c: &ModelConfig) -> serde_json::Value {
    let mut v = llama_config_json(c, "qwen3");
    let o = v.as_object_mut().unwrap();
    o.insert("architectures".into(), json!(["Qwen3ForCausalLM"]));
    o.insert("head_dim".into(), json!(c.head_dim));
    o.insert("hidden_act".into(), json!("silu"));
    o.insert("attention_bias".into(), json!(false));
    o.insert("sliding_window".into(), json!(null));
    o.insert("use_sliding_window".into(), json!(false));
    o.insert("max_window_layers".into(), json!(28));
    o.insert("rope_scaling".into(), json!(null));
    o.insert("torch_dtype".into(), json!("bfloat16"));
    v
}

/// Gemma 3 at a tiny shape: 3 layers, the last global (period 3, window 6),
/// head_dim 96 != hidden / heads, one kv head, softcap 30, tied.
fn gemma3_tiny() -> ModelConfig {
    ModelConfig {
        architecture: crate::Family::Gemma3,
        num_layers: 3,
        num_kv_heads: 1,
        head_dim: 96,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        features: crate::ArchFeatures {
            qk_norm: true,
            post_norms: true,
            activation: crate::Activation::GeluTanh,
            embedding_scale: 16.0,
            attn_scale: Some(1.0 / 96f32.sqrt()),
            final_logit_softcap: Some(30.0),
            sliding_window: crate::SlidingWindow::Interleaved {
                window: 6,
                period: 3,
            },
            rope_theta_local: Some(10_000.0),
            ..crate::ArchFeatures::default()
        },
        ..tiny(23)
    }
}

/// Gemma 3's `config.json` in the shape google/gemma-3-270m publishes
/// (`transformers` 4.55: both `layer_types` and `_sliding_window_pattern`,
/// no `tie_word_embeddings`, so tied by default).
fn gemma3_json(c: &ModelConfig) -> serde_json::Value {
    let types: Vec<&str> = (0..c.num_layers)
        .map(|l| match c.layer_rope(l).window {
            Some(_) => "sliding_attention",
            None => "full_attention",
        })
        .collect();
    json!({
        "_sliding_window_pattern": 3,
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": null,
        "bos_token_id": 1,
        "eos_token_id": [2, 0],
        "final_logit_softcapping": c.features.final_logit_softcap,
        "head_dim": c.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": c.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": c.intermediate_size,
        "layer_types": types,
        "max_position_embeddings": c.max_position_embeddings,
        "model_type": "gemma3_text",
        "num_attention_heads": c.num_heads,
        "num_hidden_layers": c.num_layers,
        "num_key_value_heads": c.num_kv_heads,
        "pad_token_id": 0,
        "query_pre_attn_scalar": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": null,
        "rope_theta": c.rope_theta,
        "sliding_window": 6,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0.dev0",
        "use_bidirectional_attention": false,
        "use_cache": true,
        "vocab_size": c.vocab_size,
    })
}

#[test]
fn qwen3_loads_as_its_gguf() {
    let dir = TempDir::new("qwen3");
    let c = qwen3_tiny();
    let tensors = family_tensors(&c);
    write_dir_with(&dir.0, qwen3_json(&c), &tensors, 2);
    let m = load(&dir.0).unwrap();
    assert_eq!(m.weights.config, c);
    let gguf = crate::load::weights_from_gguf(&converted_gguf(&c, &tensors)).unwrap();
    assert_same_model(&m.weights, &gguf);
}

#[test]
fn gemma3_text_loads_as_its_gguf() {
    let dir = TempDir::new("gemma3");
    let c = gemma3_tiny();
    let tensors = family_tensors(&c);
    write_dir_with(&dir.0, gemma3_json(&c), &tensors, 1);
    let m = load(&dir.0).unwrap();
    assert_eq!(m.weights.config, c);
    // Layers 0 and 1 local (RoPE base 1e4, 6 keys), layer 2 global.
    let ropes: Vec<_> = (0..3)
        .map(|l| (c.layer_rope(l).theta, c.layer_rope(l).window))
        .collect();
    assert_eq!(
        ropes,
        [(10_000.0, Some(6)), (10_000.0, Some(6)), (1e6, None)]
    );
    let gguf = crate::load::weights_from_gguf(&converted_gguf(&c, &tensors)).unwrap();
    assert_same_model(&m.weights, &gguf);
    // The stored `w` became `1 + w`: the norms are ~1, not ~0.
    assert!(m.weights.layers[0].attn_norm.iter().all(|&x| x > 0.8));
    assert_eq!(m.eos_token_ids, vec![2, 0]);
}

/// Multimodal `gemma3`: the decoder is read from `text_config`, which names
/// only a few keys (the rest are `Gemma3TextConfig`'s defaults, as in
/// google/gemma-3-4b-it), from either tensor layout `transformers` has
/// written; vision tensors are ignored.
#[test]
fn gemma3_multimodal_text_config_loads_as_its_gguf() {
    let c = ModelConfig {
        num_heads: 8,
        num_kv_heads: 4,
        head_dim: 256,
        max_position_embeddings: 131_072,
        features: crate::ArchFeatures {
            attn_scale: Some(1.0 / 16.0),
            final_logit_softcap: None,
            sliding_window: crate::SlidingWindow::Interleaved {
                window: 6,
                period: 6,
            },
            ..gemma3_tiny().features
        },
        ..gemma3_tiny()
    };
    let text = json!({
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "model_type": "gemma3_text",
        "num_hidden_layers": c.num_layers,
        "sliding_window": 6,
        "vocab_size": c.vocab_size,
    });
    let cfg = json!({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
        "eos_token_id": [1, 21],
        "mm_tokens_per_image": 256,
    });
    let tensors = family_tensors(&c);
    let gguf = crate::load::weights_from_gguf(&converted_gguf(&c, &tensors)).unwrap();
    for prefix in ["model.language_model.", "language_model.model."] {
        let dir = TempDir::new("gemma3mm");
        let mut renamed: Vec<Entry> = tensors
            .iter()
            .map(|(n, d, s, b)| {
                let n = n.replacen("model.", prefix, 1);
                (n, *d, s.clone(), b.clone())
            })
            .collect();
        renamed.push(vector(
            "vision_tower.vision_model.post_layernorm.weight".into(),
            &[1.0; 8],
        ));
        write_dir_with(&dir.0, cfg.clone(), &renamed, 1);
        let m = load(&dir.0).unwrap();
        assert_same_model(&m.weights, &gguf);
        // The outer ids win; `<|im_end|>` (2) comes from tokenizer_config.json.
        assert_eq!(
            (m.bos_token_id, m.eos_token_ids.clone()),
            (Some(2), vec![1, 21, 2])
        );
    }
}

/// google/gemma-3-270m's `config.json` resolves to what its GGUF resolves
/// to (the values `tests/gemma3.rs` reads from the real Q4_K_M file); and
/// the `transformers` 5 spelling (`rope_parameters` per layer type, no
/// pattern key) to the same.
#[test]
fn gemma3_270m_config_json_resolves_like_its_gguf() {
    let real = ModelConfig {
        architecture: crate::Family::Gemma3,
        vocab_size: 262_144,
        hidden_size: 640,
        intermediate_size: 2048,
        num_layers: 18,
        num_heads: 4,
        num_kv_heads: 1,
        head_dim: 256,
        rope_theta: 1_000_000.0,
        rope_style: RopeStyle::HalfSplit,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 32_768,
        tie_word_embeddings: true,
        qkv_bias: false,
        features: crate::ArchFeatures {
            qk_norm: true,
            post_norms: true,
            activation: crate::Activation::GeluTanh,
            embedding_scale: 640f32.sqrt(),
            attn_scale: Some(1.0 / 16.0),
            final_logit_softcap: None,
            sliding_window: crate::SlidingWindow::Interleaved {
                window: 512,
                period: 6,
            },
            rope_theta_local: Some(10_000.0),
            ..crate::ArchFeatures::default()
        },
    };
    let layer_types: Vec<&str> = (0..18)
        .map(|l| {
            if l % 6 == 5 {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    let mut v = gemma3_json(&real);
    let o = v.as_object_mut().unwrap();
    o.insert("_sliding_window_pattern".into(), json!(6));
    o.insert("sliding_window".into(), json!(512));
    o.insert("query_pre_attn_scalar".into(), json!(256));
    o.insert("layer_types".into(), json!(layer_types));
    o.insert("bos_token_id".into(), json!(2));
    o.insert("eos_token_id".into(), json!(1));
    let dir = TempDir::new("gemma270m");
    let path = dir.0.join("config.json");
    let resolve = |v: &serde_json::Value| {
        std::fs::write(&path, v.to_string()).unwrap();
        crate::safetensors_load::resolve_config(&crate::safetensors_load::read_hf_config(&path)?)
    };
    assert_eq!(resolve(&v).unwrap(), real);
    let mut v5 = v.clone();
    let o = v5.as_object_mut().unwrap();
    for key in [
        "_sliding_window_pattern",
        "rope_theta",
        "rope_local_base_freq",
        "rope_scaling",
    ] {
        o.remove(key);
    }
    o.insert(
        "rope_parameters".into(),
        json!({
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        }),
    );
    assert_eq!(resolve(&v5).unwrap(), real);
    // The 4B+ checkpoints' linear scaling (global layers only).
    v5.as_object_mut().unwrap().insert(
        "rope_parameters".into(),
        json!({
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        }),
    );
    let scaled = resolve(&v5).unwrap();
    assert_eq!(scaled.features.rope_linear_scale, 8.0);
    assert_eq!(
        (
            scaled.layer_rope(0).linear_scale,
            scaled.layer_rope(5).linear_scale
        ),
        (1.0, 8.0)
    );
    // query_pre_attn_scalar, not head_dim, sets the attention scale.
    let mut q = v.clone();
    q["query_pre_attn_scalar"] = json!(144);
    assert_eq!(resolve(&q).unwrap().attn_scale(), 1.0 / 12.0);
}

/// What Kestrel's Gemma block cannot compute (RoPE scaling it does not
/// implement included) is refused by name as `ModelError::Unsupported`, not
/// run wrong; an unknown `model_type` names itself and the supported ones.
#[test]
fn gemma3_configs_kestrel_cannot_run_are_refused() {
    let c = gemma3_tiny();
    let dir = TempDir::new("gemma3bad");
    let path = dir.0.join("config.json");
    let resolve = |v: &serde_json::Value| {
        std::fs::write(&path, v.to_string()).unwrap();
        crate::safetensors_load::resolve_config(&crate::safetensors_load::read_hf_config(&path)?)
    };
    let patched = |patch: serde_json::Value| {
        let mut v = gemma3_json(&c);
        for (k, x) in patch.as_object().unwrap() {
            v[k] = x.clone();
        }
        resolve(&v)
    };
    let unsupported = |patch: serde_json::Value, needle: &str| match patched(patch.clone()) {
        Err(ModelError::Unsupported {
            family: crate::Family::Gemma3,
            feature,
        }) => assert!(feature.contains(needle), "{feature}"),
        other => panic!("{patch}: {other:?}"),
    };
    unsupported(
        json!({"attn_logit_softcapping": 50.0}),
        "attn_logit_softcapping",
    );
    unsupported(
        json!({"use_bidirectional_attention": true}),
        "EmbeddingGemma",
    );
    unsupported(json!({"hidden_activation": "gelu"}), "gelu_pytorch_tanh");
    unsupported(
        json!({"layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
        "per-layer patterns",
    );
    unsupported(
        json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
        "`yarn`",
    );
    match patched(json!({"layer_types": ["sliding_attention"]})) {
        Err(ModelError::InvalidConfig { reason }) => {
            assert!(reason.contains("layer_types lists 1"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    let mut mm = json!({"model_type": "gemma3"});
    assert!(matches!(
        resolve(&mm),
        Err(ModelError::MissingMetadata { key }) if key == "text_config"
    ));
    mm = gemma3_json(&c);
    mm["model_type"] = json!("gemma2");
    let err = resolve(&mm).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, ModelError::UnsupportedArchitecture { ref architecture, .. } if architecture == "gemma2"),
        "{msg}"
    );
    for arch in [
        "`gemma2`",
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma3_text",
        "text_config",
    ] {
        assert!(msg.contains(arch), "{msg}");
    }
}
