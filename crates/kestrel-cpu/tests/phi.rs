//! Phi (the Phi 1.5 block Moondream 2's text model is), loaded from tiny
//! synthetic HF directories written at test time by
//! `scripts/reference/phi_fixtures.py` (HF `modeling_phi.py`'s tensor names
//! and `config.json` keys, SmolLM2's tokenizer cut to 1024 tokens as a
//! `tokenizer.json`) and checked against that script's f32 NumPy Phi: the
//! prompt's ids, then per greedy step every logit within `LOGIT_ATOL` and
//! the chosen token exactly, in exact numerics. Cases: `phi` (F32, rotary on
//! half of each head) and `phi_bf16` (BF16 matrices, rotary on a quarter,
//! three layers).
//!
//! Needs `$KESTREL_PYTHON` (default `python3`) with numpy and gguf
//! (`pip install -r scripts/reference/requirements.txt`); skipped, saying
//! so, without them unless `KESTREL_REQUIRE_PYTHON` is set (CI), and needs
//! the default model (its vocabulary), fetched like every real-model test.

mod common;
#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

use std::path::Path;

use kestrel_cpu::{CpuModel, CpuModelOptions, Numerics};

/// f32 Rust vs f32 NumPy on tiny random models: summation order only.
const LOGIT_ATOL: f32 = 5e-4;

fn ids(v: &serde_json::Value) -> Vec<u32> {
    let a = v.as_array().expect("array");
    a.iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Runs one case; returns the worst logit difference.
fn check_case(dir: &Path, name: &str, threads: usize) -> f32 {
    let want: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join(format!("{name}.json"))).expect("fixture json"),
    )
    .expect("fixture json parses");
    let loaded = kestrel_model::load(&dir.join(name)).expect("load the HF directory");
    assert_eq!(
        loaded.weights.config.architecture,
        kestrel_model::Family::Phi
    );
    let prompt = ids(&want["prompt_ids"]);
    assert_eq!(
        loaded.encode(want["prompt"].as_str().unwrap()).unwrap(),
        prompt,
        "{name}: tokenizer"
    );
    let model = CpuModel::new(
        loaded.weights,
        CpuModelOptions {
            threads,
            numerics: Numerics::Exact,
            ..Default::default()
        },
    )
    .unwrap();
    let steps = want["steps"].as_array().unwrap();
    let mut worst = 0f32;
    // Pages of 4: the prompt and its decode cross page boundaries.
    let got = common::greedy_decode(&model, &prompt, steps.len(), 4, |step, logits| {
        let pairs = steps[step]["logits"].as_array().unwrap();
        assert_eq!(pairs.len(), logits.len(), "{name}: every logit is checked");
        for pair in pairs {
            let (i, w) = (
                pair[0].as_u64().unwrap() as usize,
                pair[1].as_f64().unwrap() as f32,
            );
            let d = (logits[i] - w).abs();
            worst = worst.max(d);
            assert!(
                d <= LOGIT_ATOL,
                "{name} step {step} logit {i}: {} vs {w}",
                logits[i]
            );
        }
    });
    for (step, (s, tok)) in steps.iter().zip(got).enumerate() {
        assert_eq!(
            u64::from(tok),
            s["token"].as_u64().unwrap(),
            "{name} step {step}: greedy token (reference margin {})",
            s["margin"]
        );
    }
    worst
}

#[test]
fn phi_matches_numpy_reference() {
    let Some(dir) = reference_python::fixture_script("phi_fixtures.py", "phi", "phi", &[]) else {
        return;
    };
    for (name, threads) in [("phi", 2), ("phi_bf16", 1)] {
        let worst = check_case(&dir, name, threads);
        eprintln!("{name}: max |dlogit| = {worst:.2e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
