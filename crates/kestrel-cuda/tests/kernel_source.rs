//! `kernels/quant.cu`'s own source, compiled for the host by a C++ compiler
//! with `tests/host/shim.h` standing in for CUDA, against the Rust
//! references of `kestrel_cuda::quant`, bit for bit: `dequant_elem` (the
//! decode of `dequant_f16` and `embed_gather_q`) for every type, and the
//! eight `mmvq_*` kernels (each warp's lanes run one after another; their
//! partial sums are added in the butterfly's order). This checks the CUDA
//! code itself, not a transcription of it; what it cannot check without a
//! GPU is the device: its intrinsics, memory accesses and scheduling.
//!
//! Needs `c++` (or `$CXX`); without one the test prints SKIPPED, unless
//! `KESTREL_REQUIRE_NVRTC=1` (as in CI, where every kernel check must run).

use std::path::{Path, PathBuf};
use std::process::Command;

use kestrel_cuda::kernels::{MMVQ_MAX_ROWS, SOURCES};
use kestrel_cuda::quant::{self, Q8Block};
use kestrel_model::synthetic::Rng;
use kestrel_model::{DType, Matrix};

const QUANTIZED: [DType; 8] = [
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
];

fn compiler() -> Option<String> {
    let candidates = std::env::var("CXX")
        .ok()
        .into_iter()
        .chain(["c++", "g++", "clang++"].map(String::from));
    for c in candidates {
        let ok = Command::new(&c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Some(c);
        }
    }
    None
}

/// The harness built in a fresh directory, or None (skipped) without a compiler.
fn harness(test: &str) -> Option<(PathBuf, PathBuf)> {
    let Some(cxx) = compiler() else {
        if std::env::var_os("KESTREL_REQUIRE_NVRTC").is_some_and(|v| v == "1") {
            panic!("KESTREL_REQUIRE_NVRTC=1 but no C++ compiler (c++, g++, clang++, $CXX)");
        }
        eprintln!("SKIPPED {test}: no C++ compiler (c++, g++, clang++, $CXX)");
        return None;
    };
    let dir = std::env::temp_dir().join(format!(
        "kestrel-kernel-source-{test}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let quant_cu = SOURCES
        .iter()
        .find(|k| k.file == "quant.cu")
        .expect("quant.cu is registered");
    std::fs::write(dir.join("quant.cu"), quant_cu.source).expect("write");
    std::fs::write(dir.join("shim.h"), include_str!("host/shim.h")).expect("write");
    std::fs::write(dir.join("harness.cpp"), include_str!("host/harness.cpp")).expect("write");
    let exe = dir.join("harness");
    let out = Command::new(&cxx)
        .args([
            "-std=c++17",
            "-O1",
            "-ffp-contract=off",
            "-w",
            "-DKERNEL=\"quant.cu\"",
        ])
        .arg("-I")
        .arg(&dir)
        .arg(dir.join("harness.cpp"))
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run the C++ compiler");
    assert!(
        out.status.success(),
        "{cxx} failed on quant.cu + shim.h:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some((dir, exe))
}

fn run(exe: &Path, args: &[String], out: &Path) -> Vec<f32> {
    let status = Command::new(exe).args(args).status().expect("run harness");
    assert!(status.success(), "harness {args:?}: {status}");
    std::fs::read(out)
        .expect("harness output")
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn q8_bytes(blocks: &[Q8Block]) -> Vec<u8> {
    let mut out = Vec::with_capacity(40 * blocks.len());
    for b in blocks {
        out.extend(b.d.to_le_bytes());
        out.extend(b.s.to_le_bytes());
        out.extend(b.q.iter().map(|&q| q as u8));
    }
    out
}

#[test]
fn quant_cu_dequantizes_as_the_reference_bit_for_bit() {
    let Some((dir, exe)) = harness("deq") else {
        return;
    };
    let cols = 512;
    for (t, dtype) in DType::ALL.into_iter().enumerate() {
        let vals = Rng(40 + t as u64).vec(cols, 3.0);
        let m = Matrix::quantize(dtype, 1, cols, &vals);
        let (row, out) = (dir.join("row.bin"), dir.join("deq.bin"));
        std::fs::write(&row, m.row(0)).expect("write");
        let args = [
            "deq".to_owned(),
            quant::type_code(dtype).to_string(),
            cols.to_string(),
            row.display().to_string(),
            out.display().to_string(),
        ];
        let got = run(&exe, &args, &out);
        let ggml = m.to_f32();
        for e in 0..cols {
            let want = quant::dequant_elem(dtype, m.row(0), e);
            assert_eq!(got[e].to_bits(), want.to_bits(), "{dtype} element {e}");
            assert_eq!(want.to_bits(), ggml[e].to_bits(), "{dtype} element {e}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn quant_cu_mmvq_is_the_reference_bit_for_bit() {
    let Some((dir, exe)) = harness("mmvq") else {
        return;
    };
    let (rows, cols) = (9, 1024);
    for (t, dtype) in QUANTIZED.into_iter().enumerate() {
        let m = Matrix::quantize(dtype, rows, cols, &Rng(60 + t as u64).vec(rows * cols, 1.0));
        for n in [1, 3, MMVQ_MAX_ROWS] {
            let x = Rng(80 + n as u64).vec(n * cols, 2.0);
            let mut xq = vec![Q8Block::default(); n * cols / 32];
            for (xr, qr) in x.chunks_exact(cols).zip(xq.chunks_exact_mut(cols / 32)) {
                quant::quantize_q8(xr, qr);
            }
            let (w, xf, out) = (dir.join("w.bin"), dir.join("x.bin"), dir.join("y.bin"));
            std::fs::write(&w, &m.data[..]).expect("write");
            std::fs::write(&xf, q8_bytes(&xq)).expect("write");
            let args = [
                "mmvq".to_owned(),
                quant::type_code(dtype).to_string(),
                rows.to_string(),
                cols.to_string(),
                n.to_string(),
                w.display().to_string(),
                xf.display().to_string(),
                out.display().to_string(),
            ];
            let got = run(&exe, &args, &out);
            let mut want = vec![0f32; n * rows];
            quant::mmvq(dtype, &m.data, rows, cols, &xq, &mut want);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{dtype} n={n} row {} out {}: kernel {g} vs reference {w}",
                    i / rows,
                    i % rows
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
