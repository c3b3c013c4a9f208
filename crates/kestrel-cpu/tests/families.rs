//! Every family Kestrel runs, on tiny synthetic GGUFs written at test time by
//! `scripts/reference/synthetic_fixtures.py` (the `gguf` package's writer,
//! the family's metadata and tensor names, SmolLM2's real tokenizer) and
//! checked against that script's f32 NumPy reference: the prompt's ids, then
//! per greedy step the logits within `LOGIT_ATOL` and the chosen token
//! exactly. Cases: Llama 3 (rope_freqs, 128k vocabulary, untied), Mistral
//! (sliding window), Qwen2 (bias), Qwen3 (q/k norm), Gemma 3 (F32 and Q8_0).
//!
//! Needs `$KESTREL_PYTHON` (default `python3`) with numpy and gguf
//! (`pip install -r scripts/reference/requirements.txt`); skipped, saying so,
//! without them unless `KESTREL_REQUIRE_PYTHON` is set (CI), and needs the
//! default model (its vocabulary), fetched like every real-model test.

mod common;
#[path = "../../../tests/support/reference_python.rs"]
mod reference_python;

use std::path::{Path, PathBuf};

use kestrel_cpu::{CpuModel, CpuModelOptions, Numerics};

/// f32 Rust vs f32 NumPy on tiny random models: summation order only.
const LOGIT_ATOL: f32 = 5e-4;
const CASES: [&str; 6] = [
    "llama3",
    "mistral_swa",
    "qwen2",
    "qwen3",
    "gemma3",
    "gemma3_q8",
];

/// Writes the fixtures into a fresh directory, or `None` (skipped) when the
/// Python side is missing and not required.
fn fixtures() -> Option<PathBuf> {
    reference_python::synthetic_fixtures("families", "families", &[])
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    let a = v.as_array().expect("array");
    a.iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Runs one case; returns the worst logit difference.
fn check_case(dir: &Path, name: &str) -> f32 {
    let want: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join(format!("{name}.json"))).expect("fixture json"),
    )
    .expect("fixture json parses");
    let loaded = kestrel_model::load(&dir.join(format!("{name}.gguf"))).expect("load fixture");
    let prompt = ids(&want["prompt_ids"]);
    assert_eq!(
        loaded.encode(want["prompt"].as_str().unwrap()).unwrap(),
        prompt,
        "{name}: tokenizer"
    );
    let model = CpuModel::new(
        loaded.weights,
        CpuModelOptions {
            threads: 2,
            // The f32 NumPy reference's numbers: exact numerics.
            numerics: Numerics::Exact,
            ..Default::default()
        },
    )
    .unwrap();
    let steps = want["steps"].as_array().unwrap();
    let mut worst = 0f32;
    // Small pages: windows and prompts cross page boundaries.
    let got = common::greedy_decode(&model, &prompt, steps.len(), 4, |step, logits| {
        for pair in steps[step]["logits"].as_array().unwrap() {
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
fn families_match_numpy_reference() {
    let Some(dir) = fixtures() else { return };
    for name in CASES {
        let worst = check_case(&dir, name);
        eprintln!("{name}: max |dlogit| = {worst:.2e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
