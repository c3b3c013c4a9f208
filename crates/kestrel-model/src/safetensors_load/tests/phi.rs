//! Phi from an HF directory (`model_type: phi`, `modeling_phi.py`'s names)
//! and the same decoder under Moondream 2's `text_model.*` and `model.text.*`
//! names (fused `Wqkv` / `attn.qkv`, split at load): all give the same
//! config features and bit-equal weights; what the block cannot compute is
//! refused.

use super::*;
use crate::safetensors_load::{PhiNames, PhiTensor};
use crate::{Family, NormKind};

/// `(rows, cols)` deterministic values, distinct per `seed`.
fn values(seed: usize, rows: usize, cols: usize) -> Matrix {
    let v: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919 + seed * 104_729) % 997) as f32 / 997.0 - 0.5)
        .collect();
    Matrix::quantize(DType::F32, rows, cols, &v)
}

/// Phi's tensors in one of the two namings, F16 matrices, F32 vectors.
fn phi_tensors(c: &ModelConfig, names: PhiNames) -> Vec<Entry> {
    let (h, q, kv, ff, vocab) = (
        c.hidden_size,
        c.q_dim(),
        c.kv_dim(),
        c.intermediate_size,
        c.vocab_size,
    );
    let mut t = Vec::new();
    let mut seed = 0;
    let mut add = |tensor: PhiTensor, rows: usize, cols: usize, bias: bool| {
        seed += 1;
        let m = values(seed, rows, cols);
        t.push(entry(names.weight(tensor), &m, DType::F16, rows == 1));
        if bias {
            let b = values(seed + 1000, 1, if rows == 1 { cols } else { rows });
            t.push(entry(names.bias(tensor), &b, DType::F32, true));
        }
    };
    add(PhiTensor::Embed, vocab, h, false);
    for i in 0..c.num_layers {
        add(PhiTensor::Norm(i), 1, h, true);
        if names.fused_qkv() {
            add(PhiTensor::Qkv(i, 0), q + 2 * kv, h, true)
        } else {
            for (p, rows) in [(0, q), (1, kv), (2, kv)] {
                add(PhiTensor::Qkv(i, p), rows, h, true);
            }
        }
        add(PhiTensor::Out(i), h, q, true);
        add(PhiTensor::Fc1(i), ff, h, true);
        add(PhiTensor::Fc2(i), h, ff, true);
    }
    add(PhiTensor::FinalNorm, 1, h, true);
    add(PhiTensor::LmHead, vocab, h, true);
    t
}

/// The fused tensors' values split as HF names them: Moondream's `Wqkv`
/// rows (and bias) q, then k, then v.
fn as_hf(c: &ModelConfig, md: &[Entry]) -> Vec<Entry> {
    let (q, kv) = (c.q_dim(), c.kv_dim());
    let mut out = Vec::new();
    for (name, dt, shape, bytes) in md {
        let stem = name.rsplit_once('.').unwrap().0;
        let suffix = &name[stem.len()..];
        let rest = stem.strip_prefix("text_model.").unwrap();
        let hf = match rest {
            "transformer.embd.wte" => "model.embed_tokens".to_string(),
            "lm_head.ln" => "model.final_layernorm".into(),
            "lm_head.linear" => "lm_head".into(),
            _ => {
                let r = rest.strip_prefix("transformer.h.").unwrap();
                let (i, part) = r.split_once('.').unwrap();
                let p = format!("model.layers.{i}.");
                match part {
                    "ln" => p + "input_layernorm",
                    "mixer.out_proj" => p + "self_attn.dense",
                    "mlp.fc1" | "mlp.fc2" => p + part,
                    "mixer.Wqkv" => {
                        // Row-major: a row's bytes are contiguous, so the
                        // split is three byte ranges.
                        let row = bytes.len() / shape[0];
                        for (n, (a, len)) in
                            ["q", "k", "v"]
                                .into_iter()
                                .zip([(0, q), (q, kv), (q + kv, kv)])
                        {
                            let mut s = shape.clone();
                            s[0] = len;
                            out.push((
                                format!("{p}self_attn.{n}_proj{suffix}"),
                                *dt,
                                s,
                                bytes[a * row..(a + len) * row].to_vec(),
                            ));
                        }
                        continue;
                    }
                    other => panic!("no HF name for {other}"),
                }
            }
        };
        out.push((format!("{hf}{suffix}"), *dt, shape.clone(), bytes.clone()));
    }
    out
}

fn phi_config() -> ModelConfig {
    let mut c = ModelConfig::moondream2_text();
    c.vocab_size = 96;
    c.hidden_size = 64;
    c.intermediate_size = 128;
    c.num_layers = 2;
    c.num_heads = 4;
    c.num_kv_heads = 4;
    c.head_dim = 16;
    c.max_position_embeddings = 256;
    c.features.rotary_dim = Some(8);
    c
}

fn phi_config_json(c: &ModelConfig) -> serde_json::Value {
    json!({
        "model_type": "phi",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "partial_rotary_factor": 0.5,
        "layer_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "gelu_new",
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": false,
        "bos_token_id": 1,
        "eos_token_id": 2,
    })
}

#[test]
fn phi_hf_and_moondream_names_load_the_same_decoder() {
    let c = phi_config();
    let md = phi_tensors(&c, PhiNames::Moondream);
    let hf = as_hf(&c, &md);
    // The HF naming [`PhiNames::Hf`] gives is what `as_hf` wrote.
    let mut want: Vec<String> = phi_tensors(&c, PhiNames::Hf)
        .into_iter()
        .map(|e| e.0)
        .collect();
    let mut got: Vec<String> = hf.iter().map(|e| e.0.clone()).collect();
    want.sort();
    got.sort();
    assert_eq!(got, want);

    let hf_dir = TempDir::new("phi-hf");
    write_dir_with(&hf_dir.0, phi_config_json(&c), &hf, 1);
    let a = load(&hf_dir.0).unwrap().weights;
    assert_eq!(a.config, c, "config.json resolves to Moondream's features");
    assert_eq!(a.config.architecture, Family::Phi);
    assert_eq!(a.config.features.norm, NormKind::Layer);

    let md_dir = TempDir::new("phi-md");
    write_st(&md_dir.0.join("model.safetensors"), &md);
    let exported = crate::moondream::NameScheme::Exported;
    let b = crate::moondream_text_weights(&md_dir.0, c.clone(), exported).unwrap();
    // Moondream's HF state-dict names (`model.text.*`), same values.
    let md_hf_dir = TempDir::new("phi-md-hf");
    write_st(
        &md_hf_dir.0.join("model.safetensors"),
        &phi_tensors(&c, PhiNames::MoondreamHf),
    );
    let hf_names = crate::moondream::NameScheme::Hf;
    let b_hf = crate::moondream_text_weights(&md_hf_dir.0, c.clone(), hf_names).unwrap();

    let mat = |x: &Matrix, y: &Matrix, what: String| {
        assert_eq!(
            (x.dtype, x.rows, x.cols),
            (y.dtype, y.rows, y.cols),
            "{what}"
        );
        assert_eq!(x.data.to_vec(), y.data.to_vec(), "{what}");
    };
    let vec = |x: &Option<Vec<f32>>, y: &Option<Vec<f32>>, what: String| {
        assert!(x.is_some(), "{what} present");
        assert_eq!(x, y, "{what}");
    };
    mat(&a.token_embd, &b.token_embd, "token_embd".into());
    mat(&a.lm_head, &b.lm_head, "lm_head".into());
    vec(
        &Some(a.output_norm.clone()),
        &Some(b.output_norm.clone()),
        "output_norm".into(),
    );
    vec(
        &a.output_norm_bias,
        &b.output_norm_bias,
        "output_norm_bias".into(),
    );
    vec(&a.lm_head_bias, &b.lm_head_bias, "lm_head_bias".into());
    mat(&b.token_embd, &b_hf.token_embd, "md hf token_embd".into());
    mat(&b.lm_head, &b_hf.lm_head, "md hf lm_head".into());
    vec(
        &b.lm_head_bias,
        &b_hf.lm_head_bias,
        "md hf lm_head_bias".into(),
    );
    let pairs = a
        .layers
        .iter()
        .zip(&b.layers)
        .chain(b.layers.iter().zip(&b_hf.layers));
    for (i, (x, y)) in pairs.enumerate() {
        let w = |s: &str| format!("layer {i} {s}");
        for (n, p, q) in [
            ("wq", &x.wq, &y.wq),
            ("wk", &x.wk, &y.wk),
            ("wv", &x.wv, &y.wv),
            ("wo", &x.wo, &y.wo),
            ("w_up", &x.w_up, &y.w_up),
            ("w_down", &x.w_down, &y.w_down),
        ] {
            mat(p, q, w(n));
        }
        assert!(x.w_gate.is_none() && y.w_gate.is_none() && x.ffn_norm.is_empty());
        vec(
            &Some(x.attn_norm.clone()),
            &Some(y.attn_norm.clone()),
            w("attn_norm"),
        );
        for (n, p, q) in [
            ("attn_norm_bias", &x.attn_norm_bias, &y.attn_norm_bias),
            ("bq", &x.bq, &y.bq),
            ("bk", &x.bk, &y.bk),
            ("bv", &x.bv, &y.bv),
            ("bo", &x.bo, &y.bo),
            ("b_up", &x.b_up, &y.b_up),
            ("b_down", &x.b_down, &y.b_down),
        ] {
            vec(p, q, w(n));
        }
    }
}

#[test]
fn phi_refusals_name_what_is_missing() {
    let c = phi_config();
    let hf = as_hf(&c, &phi_tensors(&c, PhiNames::Moondream));
    let dir = TempDir::new("phi-refuse");
    let mut cfg = phi_config_json(&c);
    cfg["qk_layernorm"] = json!(true);
    write_dir_with(&dir.0, cfg, &hf, 1);
    let err = load(&dir.0).unwrap_err();
    assert!(
        matches!(err, ModelError::Unsupported { family: Family::Phi, ref feature } if feature.contains("qk_layernorm")),
        "{err}"
    );
    // A missing bias is named.
    let no_bias: Vec<Entry> = hf
        .into_iter()
        .filter(|e| e.0 != "model.layers.1.mlp.fc2.bias")
        .collect();
    write_dir_with(&dir.0, phi_config_json(&c), &no_bias, 1);
    let err = load(&dir.0).unwrap_err();
    assert!(
        matches!(err, ModelError::MissingTensor { ref tensor } if tensor == "model.layers.1.mlp.fc2.bias"),
        "{err}"
    );
}
