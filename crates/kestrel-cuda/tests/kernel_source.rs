//! The own CUDA source of every kernel file (`common.cuh` and all of
//! `kestrel_cuda::kernels::SOURCES`, as embedded for NVRTC), built for the host by
//! a C++20 compiler with `tests/host/shim.h` standing in for CUDA and run
//! block by block with one host thread per CUDA thread (real barriers for
//! `__syncthreads` and warp shuffles), against the Rust references of
//! `kestrel_cuda::reference`, bit for bit: `mmvq_*` for the eight quantized
//! types, `dequant_f16` and `embed_gather_q` for every type,
//! `quantize_q8_h`, `add_rms_norm_q8`, `swiglu_q8`, `rope_kv_append` (with
//! and without q/k norms, both RoPE styles), the families' `rms_norm_f32`,
//! `gelu_mul`, `gelu_mul_q8`, `scale_f32`, `softcap`, and issue 32's
//! `prefill_attention` (ragged runs of query rows, cached prefixes, page and
//! tile boundaries, GQA ratios, sliding windows) and `count_tokens` (a
//! re-admitted sequence's penalty counts), and the draft verification
//! kernels of `verify.cu`; and (issue 75) decode attention split over key
//! ranges (`attention.cu`'s `paged_attention` and its merge) against
//! `reference::decode_attention`, `embed_gather` and `add_bias` bit for
//! bit, and `sample.cu`'s `sample_rows` itself against kestrel-cpu's
//! sampler (tokens and top-n ids exact, logprobs to 1e-4) and the host
//! device's `sample_row`. The
//! only text changed
//! is the three inline-PTX statements (f16 conversions, `dp4a`), rewritten
//! to their host definitions. This checks the CUDA code itself, not a
//! transcription of it; what it cannot check without a GPU is the device:
//! its intrinsics, memory system and scheduling.
//!
//! Needs a C++20 compiler (`$CXX`, `c++`, `g++` or `clang++`); without one
//! the tests print SKIPPED, unless `KESTREL_REQUIRE_NVRTC=1` (as in CI,
//! where every kernel check must run).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use half::f16;
use kestrel_cuda::kernels::{COMMON, MMVQ_MAX_ROWS, SOURCES};
use kestrel_cuda::quant::{self, Q8Block};
use kestrel_cuda::reference;
use kestrel_model::synthetic::Rng;
use kestrel_model::{DType, Matrix};

/// Every block-quantized type Kestrel reads.
fn quantized() -> impl Iterator<Item = DType> {
    DType::ALL.into_iter().filter(|d| d.is_quantized())
}

/// The inline PTX of the compiled sources and its host replacement.
const PTX_REWRITES: [(&str, &str); 3] = [
    (
        r#"asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));"#,
        "f = host_h2f(h);",
    ),
    (
        r#"asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));"#,
        "h = host_f2h(f);",
    ),
    (
        r#"asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));"#,
        "d = host_dp4a(a, b, c);",
    ),
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

/// The translation unit: shim, common.cuh, the kernel files, harness.
fn translation_unit() -> String {
    let mut text = String::from(include_str!("host/shim.h"));
    let mut rewritten = [0usize; 3];
    // Every registered kernel file (issue 75 item 5), in registry order.
    for src in std::iter::once(COMMON).chain(SOURCES.iter().map(|k| k.source)) {
        let mut s = src.to_owned();
        for (i, (from, to)) in PTX_REWRITES.iter().enumerate() {
            rewritten[i] += s.matches(from).count();
            s = s.replace(from, to);
        }
        assert!(
            !s.contains("asm("),
            "inline PTX the harness cannot run:\n{s}"
        );
        text.push_str(&s);
        text.push('\n');
    }
    assert_eq!(rewritten, [1, 1, 1], "each PTX statement is rewritten once");
    text.push_str(include_str!("host/harness.cpp"));
    text
}

/// The harness (built once per process) and a fresh directory for `test`'s
/// files, or None (skipped) without a compiler.
fn harness(test: &str) -> Option<(PathBuf, PathBuf)> {
    static BUILT: OnceLock<Option<PathBuf>> = OnceLock::new();
    let exe = BUILT.get_or_init(build).as_ref();
    let Some(exe) = exe else {
        if std::env::var_os("KESTREL_REQUIRE_NVRTC").is_some_and(|v| v == "1") {
            panic!("KESTREL_REQUIRE_NVRTC=1 but no C++ compiler (c++, g++, clang++, $CXX)");
        }
        eprintln!("SKIPPED {test}: no C++ compiler (c++, g++, clang++, $CXX)");
        return None;
    };
    let dir = exe.with_file_name(test);
    std::fs::create_dir_all(&dir).expect("test dir");
    Some((dir, exe.clone()))
}

fn build() -> Option<PathBuf> {
    let cxx = compiler()?;
    let dir = std::env::temp_dir().join(format!("kestrel-kernel-source-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("kernels.cpp"), translation_unit()).expect("write");
    let exe = dir.join("harness");
    let out = Command::new(&cxx)
        .args([
            "-std=c++20",
            "-O1",
            "-ffp-contract=off",
            "-fno-strict-aliasing",
            "-pthread",
            "-w",
        ])
        .arg(dir.join("kernels.cpp"))
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run the C++ compiler");
    assert!(
        out.status.success(),
        "{cxx} failed on the kernels + shim.h:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(exe)
}

/// Run one harness mode; `files` are (name, bytes) inputs, outputs are read back.
fn run(
    exe: &Path,
    dir: &Path,
    args: &[String],
    inputs: &[(&str, Vec<u8>)],
    outputs: &[&str],
) -> Vec<Vec<u8>> {
    let mut argv: Vec<String> = args.to_vec();
    for (name, bytes) in inputs {
        let p = dir.join(name);
        std::fs::write(&p, bytes).expect("write input");
        argv.push(p.display().to_string());
    }
    for name in outputs {
        argv.push(dir.join(name).display().to_string());
    }
    let status = Command::new(exe).args(&argv).status().expect("run harness");
    assert!(status.success(), "harness {argv:?}: {status}");
    outputs
        .iter()
        .map(|n| std::fs::read(dir.join(n)).expect("harness output"))
        .collect()
}

/// `got == want` byte for byte; else the first difference, in units of
/// `unit` bytes (4: an f32, 2: an f16, 40: a Q8 block).
fn assert_same(got: &[u8], want: &[u8], unit: usize, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: output size");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        let at = i / unit * unit;
        panic!(
            "{what}: differs at element {} (bytes {at}..): kernel {:?}, reference {:?}",
            i / unit,
            &got[at..at + unit],
            &want[at..at + unit]
        );
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Activation rows of `nb` blocks in the device's layout (`common.cuh`).
fn q8_bytes(blocks: &[Q8Block], nb: usize) -> Vec<u8> {
    let mut out = vec![0u8; blocks.len() * quant::Q8_BLOCK_BYTES];
    quant::pack_q8_rows(blocks, nb, &mut out);
    out
}

fn quantized_rows(x: &[f32], cols: usize) -> Vec<Q8Block> {
    let mut q = vec![Q8Block::default(); x.len() / 32];
    for (xr, qr) in x.chunks_exact(cols).zip(q.chunks_exact_mut(cols / 32)) {
        reference::quantize_q8(xr, qr);
    }
    q
}

#[test]
fn mmvq_kernels_are_their_reference_bit_for_bit() {
    let Some((dir, exe)) = harness("mmvq") else {
        return;
    };
    // (cols, activation offset): 72 blocks a row, 36 pairs over the
    // block's 32 four-thread groups (2 or 1 pairs each), read with 16-byte
    // loads (offset 0) and with 8-byte loads (offset 8: rows not 16-byte
    // aligned); 73 blocks (36 pairs and the unpaired last block, 8-byte
    // loads) and 1 block (only the unpaired one) for the 32-block types.
    let shapes = [(2304, 0), (2304, 8), (2336, 0), (32, 0)];
    let rows = 9;
    for (t, dtype) in quantized().enumerate() {
        for (cols, off) in shapes {
            if cols % dtype.block_elems() != 0 {
                continue;
            }
            let nb = cols / 32;
            let data = Rng(60 + t as u64).vec(rows * cols, 1.0);
            let m = Matrix::quantize(dtype, rows, cols, &data);
            for n in [1, 2, 3, 5, MMVQ_MAX_ROWS] {
                let xq = quantized_rows(&Rng(80 + n as u64).vec(n * cols, 2.0), cols);
                let args = [
                    "mmvq",
                    &quant::type_code(dtype).to_string(),
                    &rows.to_string(),
                    &cols.to_string(),
                    &n.to_string(),
                    &off.to_string(),
                ]
                .map(String::from);
                let out = run(
                    &exe,
                    &dir,
                    &args,
                    &[("w.bin", m.data.to_vec()), ("x.bin", q8_bytes(&xq, nb))],
                    &["y.bin"],
                );
                let mut want = vec![0f32; n * rows];
                reference::mmvq(dtype, &m.data, rows, cols, &xq, &mut want);
                let what = format!("{dtype} mmvq, n={n}, {nb} blocks, offset {off}");
                assert_same(&out[0], &f32_bytes(&want), 4, &what);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The device's activation layout round-trips, and every byte of a row is
/// one block's element or scale (no two elements share a byte).
#[test]
fn activation_rows_pack_every_element_once() {
    for nb in [1, 2, 3, 8, 73] {
        let x = Rng(nb as u64).vec(nb * 32 * 2, 3.0);
        let blocks = quantized_rows(&x, nb * 32);
        let bytes = q8_bytes(&blocks, nb);
        assert_eq!(quant::unpack_q8_rows(&bytes, nb), blocks, "{nb} blocks");
        let mut seen = vec![false; nb * 32];
        for b in 0..nb {
            for e in 0..32 {
                let at = quant::q8_pos(nb, b, e);
                assert!(!std::mem::replace(&mut seen[at], true), "{nb}: {b}.{e}");
            }
        }
    }
}

#[test]
fn dequantization_kernels_are_their_reference_bit_for_bit() {
    let Some((dir, exe)) = harness("dequant") else {
        return;
    };
    let (rows, cols) = (5, 512);
    for (t, dtype) in DType::ALL.into_iter().enumerate() {
        let m = Matrix::quantize(dtype, rows, cols, &Rng(40 + t as u64).vec(rows * cols, 3.0));
        let code = quant::type_code(dtype).to_string();
        // dequant_f16: rows 1..4 (a tile that does not start at row 0).
        let args = ["dequant", &code, "1", "3", &cols.to_string()].map(String::from);
        let out = run(
            &exe,
            &dir,
            &args,
            &[("w.bin", m.data.to_vec())],
            &["tile.bin"],
        );
        let mut want = vec![f16::ZERO; 3 * cols];
        reference::dequant_f16(dtype, &m.data, 1, cols, &mut want);
        let want: Vec<u8> = want.iter().flat_map(|h| h.to_le_bytes()).collect();
        assert_same(&out[0], &want, 2, &format!("{dtype} dequant_f16"));
        // embed_gather_q: tokens 3, 0, 4 and an out-of-range id (row 0).
        let tokens: Vec<u8> = [3u32, 0, 4, 99]
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect();
        let args = ["embed", &code, &cols.to_string(), &rows.to_string(), "4"].map(String::from);
        let out = run(
            &exe,
            &dir,
            &args,
            &[("table.bin", m.data.to_vec()), ("tokens.bin", tokens)],
            &["x.bin"],
        );
        let ggml = m.to_f32();
        let want: Vec<f32> = [3usize, 0, 4, 0]
            .iter()
            .flat_map(|&r| ggml[r * cols..(r + 1) * cols].iter().copied())
            .collect();
        assert_same(
            &out[0],
            &f32_bytes(&want),
            4,
            &format!("{dtype} embed_gather_q"),
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fused_quantizing_kernels_are_their_reference_bit_for_bit() {
    let Some((dir, exe)) = harness("fused") else {
        return;
    };
    let n = 3;
    // quantize_q8_h: 72 blocks a row (a partial last block of 8 warps) and
    // 73 (an unpaired last block in the activation layout).
    for cols in [2304, 2336] {
        let x: Vec<f16> = Rng(5)
            .vec(n * cols, 4.0)
            .into_iter()
            .map(f16::from_f32)
            .collect();
        let args = ["quant_h", &cols.to_string(), &n.to_string()].map(String::from);
        let xb: Vec<u8> = x.iter().flat_map(|h| h.to_le_bytes()).collect();
        let out = run(&exe, &dir, &args, &[("x.bin", xb)], &["q.bin"]);
        let mut want = vec![Q8Block::default(); n * cols / 32];
        for (xr, qr) in x.chunks_exact(cols).zip(want.chunks_exact_mut(cols / 32)) {
            reference::quantize_q8_h(xr, qr);
        }
        let what = format!("quantize_q8_h, {cols} wide");
        assert_same(&out[0], &q8_bytes(&want, cols / 32), 40, &what);
    }

    // add_rms_norm_q8: SmolLM2's hidden size (576: not a multiple of 256).
    let hidden = 576;
    let eps = 1e-5f32;
    let x0 = Rng(6).vec(n * hidden, 3.0);
    let delta = Rng(7).vec(n * hidden, 1.0);
    let w = Rng(8).vec(hidden, 1.0);
    let args = [
        "norm",
        &hidden.to_string(),
        &n.to_string(),
        &format!("{eps:e}"),
    ]
    .map(String::from);
    let out = run(
        &exe,
        &dir,
        &args,
        &[
            ("x.bin", f32_bytes(&x0)),
            ("d.bin", f32_bytes(&delta)),
            ("w.bin", f32_bytes(&w)),
        ],
        &["x_out.bin", "q.bin"],
    );
    let mut x = x0.clone();
    let mut want = vec![Q8Block::default(); n * hidden / 32];
    for ((xr, dr), qr) in x
        .chunks_exact_mut(hidden)
        .zip(delta.chunks_exact(hidden))
        .zip(want.chunks_exact_mut(hidden / 32))
    {
        reference::add_rms_norm_q8(xr, Some(dr), &w, eps, qr);
    }
    assert_same(&out[0], &f32_bytes(&x), 4, "add_rms_norm_q8's residual");
    assert_same(
        &out[1],
        &q8_bytes(&want, hidden / 32),
        40,
        "add_rms_norm_q8",
    );

    // swiglu_q8: an FFN of 1536 (48 blocks).
    let f = 1536;
    let gu = Rng(9).vec(n * 2 * f, 6.0);
    let args = ["swiglu", &f.to_string(), &n.to_string()].map(String::from);
    let out = run(&exe, &dir, &args, &[("gu.bin", f32_bytes(&gu))], &["q.bin"]);
    let mut want = vec![Q8Block::default(); n * f / 32];
    for (g, qr) in gu.chunks_exact(2 * f).zip(want.chunks_exact_mut(f / 32)) {
        reference::swiglu_q8(g, qr);
    }
    assert_same(&out[0], &q8_bytes(&want, f / 32), 40, "swiglu_q8");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fused_rope_and_kv_append_is_its_reference_bit_for_bit() {
    let Some((dir, exe)) = harness("rope_kv") else {
        return;
    };
    // SmolLM2's heads (9 Q, 3 KV, 64 wide); 3 rows at positions 5, 0, 31
    // writing cache slots 7, 2 and 4 of 8.
    let (nq, nk, hd, n) = (9usize, 3usize, 64usize, 3usize);
    let (stride, kv_dim) = ((nq + 2 * nk) * hd, nk * hd);
    let table = kestrel_cuda::host::rope_table(32, hd, 10_000.0);
    let (pos, slots) = ([5u32, 0, 31], [7u32, 2, 4]);
    let u32_bytes = |v: &[u32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let (qn, kn, eps) = (Rng(12).vec(hd, 1.0), Rng(13).vec(hd, 1.0), 1e-6f32);
    // Rotary over every dimension, and Phi's partial rotary (the first 32
    // of 64; its table 32 wide).
    let partial = kestrel_cuda::host::rope_table(32, 32, 10_000.0);
    for (interleaved, norm, rot) in [
        (true, false, hd),
        (false, false, hd),
        (true, true, hd),
        (false, true, hd),
        (false, false, 32),
        (false, true, 32),
    ] {
        let table = if rot == hd { &table } else { &partial };
        let qkv = Rng(11).vec(n * stride, 2.0);
        let args = [
            "rope_kv".to_owned(),
            nq.to_string(),
            nk.to_string(),
            hd.to_string(),
            rot.to_string(),
            i32::from(interleaved).to_string(),
            n.to_string(),
            "8".to_owned(),
            i32::from(norm).to_string(),
            format!("{eps:e}"),
        ];
        let out = run(
            &exe,
            &dir,
            &args,
            &[
                ("qkv.bin", f32_bytes(&qkv)),
                ("table.bin", f32_bytes(table)),
                ("pos.bin", u32_bytes(&pos)),
                ("slots.bin", u32_bytes(&slots)),
                ("qn.bin", f32_bytes(&qn)),
                ("kn.bin", f32_bytes(&kn)),
            ],
            &["qkv_out.bin", "k.bin", "v.bin"],
        );
        let mut want_qkv = qkv.clone();
        let (mut kc, mut vc) = (vec![f16::ZERO; 8 * kv_dim], vec![f16::ZERO; 8 * kv_dim]);
        for i in 0..n {
            let (p, s) = (pos[i] as usize, slots[i] as usize);
            reference::rope_kv_append(
                &mut want_qkv[i * stride..(i + 1) * stride],
                (nq, nk),
                (hd, rot),
                &table[p * rot..(p + 1) * rot],
                interleaved,
                norm.then_some(reference::QkNorm {
                    q: &qn,
                    k: &kn,
                    eps,
                }),
                (
                    &mut kc[s * kv_dim..(s + 1) * kv_dim],
                    &mut vc[s * kv_dim..(s + 1) * kv_dim],
                ),
            );
        }
        let f16_bytes = |v: &[f16]| -> Vec<u8> { v.iter().flat_map(|h| h.to_le_bytes()).collect() };
        let what = |x: &str| {
            format!("rope_kv_append {x}, interleaved={interleaved}, norm={norm}, rot={rot}")
        };
        assert_same(&out[0], &f32_bytes(&want_qkv), 4, &what("qkv"));
        assert_same(&out[1], &f16_bytes(&kc), 2, &what("K cache"));
        assert_same(&out[2], &f16_bytes(&vc), 2, &what("V cache"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn family_kernels_are_their_reference_bit_for_bit() {
    let Some((dir, exe)) = harness("family") else {
        return;
    };
    let n = 3;
    // rms_norm_f32 (post-norms): Gemma 3 270M's hidden size, 640.
    let (hidden, eps) = (640, 1e-6f32);
    let x = Rng(21).vec(n * hidden, 3.0);
    let w = Rng(22).vec(hidden, 1.0);
    let args = [
        "post_norm".to_owned(),
        hidden.to_string(),
        n.to_string(),
        format!("{eps:e}"),
    ];
    let out = run(
        &exe,
        &dir,
        &args,
        &[("x.bin", f32_bytes(&x)), ("w.bin", f32_bytes(&w))],
        &["x_out.bin"],
    );
    let mut want = x.clone();
    for row in want.chunks_exact_mut(hidden) {
        reference::rms_norm_f32(row, &w, eps);
    }
    assert_same(&out[0], &f32_bytes(&want), 4, "rms_norm_f32");

    // gelu_mul / gelu_mul_q8: Gemma 3 270M's FFN, 2048 (64 blocks).
    let f = 2048;
    let gu = Rng(23).vec(n * 2 * f, 6.0);
    let args = ["gelu", &f.to_string(), &n.to_string()].map(String::from);
    let out = run(
        &exe,
        &dir,
        &args,
        &[("gu.bin", f32_bytes(&gu))],
        &["h.bin", "q.bin"],
    );
    let mut want_h = Vec::with_capacity(n * f * 2);
    let mut want_q = vec![Q8Block::default(); n * f / 32];
    for (row, qr) in gu.chunks_exact(2 * f).zip(want_q.chunks_exact_mut(f / 32)) {
        let (g, u) = row.split_at(f);
        for (&g, &u) in g.iter().zip(u) {
            want_h.extend(f16::from_f32(reference::gelu_tanh_mul(g, u)).to_le_bytes());
        }
        reference::gelu_mul_q8(row, qr);
    }
    assert_same(&out[0], &want_h, 2, "gelu_mul");
    assert_same(&out[1], &q8_bytes(&want_q, f / 32), 40, "gelu_mul_q8");

    // scale_f32 (embedding scale) and softcap (final logits), past one
    // grid-stride round (2 blocks of 64 threads, 300 floats).
    let (s, cap, len) = ((640f32).sqrt(), 30f32, 300);
    let x = Rng(24).vec(len, 80.0);
    let args = [
        "elementwise".to_owned(),
        format!("{s:e}"),
        format!("{cap:e}"),
        len.to_string(),
    ];
    let out = run(
        &exe,
        &dir,
        &args,
        &[("x.bin", f32_bytes(&x))],
        &["scaled.bin", "capped.bin"],
    );
    let scaled: Vec<f32> = x.iter().map(|v| v * s).collect();
    let capped: Vec<f32> = x.iter().map(|&v| reference::softcap(v, cap)).collect();
    assert_same(&out[0], &f32_bytes(&scaled), 4, "scale_f32");
    assert_same(&out[1], &f32_bytes(&capped), 4, "softcap");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Phi's kernels: `add_layer_norm` (Moondream 2's hidden size, 2048; a
/// delta added), `bias_gelu` (an ungated `fc1` output with its bias, past
/// one grid-stride round) and `add_f32` against their references.
#[test]
fn phi_kernels_are_their_reference_bit_for_bit() {
    let Some((dir, exe)) = harness("phi") else {
        return;
    };
    let (hidden, f, n, eps) = (2048, 1000, 3, 1e-5f32);
    let (x, delta) = (Rng(41).vec(n * hidden, 4.0), Rng(42).vec(n * hidden, 1.0));
    let (w, b) = (Rng(43).vec(hidden, 1.0), Rng(44).vec(hidden, 0.5));
    let (y, fb) = (Rng(45).vec(n * f, 5.0), Rng(46).vec(f, 1.0));
    let args = [
        "phi".to_owned(),
        hidden.to_string(),
        f.to_string(),
        n.to_string(),
        format!("{eps:e}"),
    ];
    let out = run(
        &exe,
        &dir,
        &args,
        &[
            ("x.bin", f32_bytes(&x)),
            ("delta.bin", f32_bytes(&delta)),
            ("w.bin", f32_bytes(&w)),
            ("b.bin", f32_bytes(&b)),
            ("y.bin", f32_bytes(&y)),
            ("fb.bin", f32_bytes(&fb)),
        ],
        &["x_out.bin", "h.bin", "g.bin", "xy.bin"],
    );
    let (mut want_x, mut want_h) = (x.clone(), Vec::new());
    let mut row = vec![0f32; hidden];
    for (xr, dr) in want_x
        .chunks_exact_mut(hidden)
        .zip(delta.chunks_exact(hidden))
    {
        reference::add_layer_norm(xr, Some(dr), (&w, &b), eps, &mut row);
        want_h.extend(row.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()));
    }
    assert_same(&out[0], &f32_bytes(&want_x), 4, "add_layer_norm x");
    assert_same(&out[1], &want_h, 2, "add_layer_norm");
    let want_g: Vec<u8> = y
        .iter()
        .enumerate()
        .flat_map(|(i, &v)| f16::from_f32(reference::gelu_tanh(v + fb[i % f])).to_le_bytes())
        .collect();
    assert_same(&out[2], &want_g, 2, "bias_gelu");
    let want_xy: Vec<f32> = want_x.iter().zip(&delta).map(|(a, b)| a + b).collect();
    assert_same(&out[3], &f32_bytes(&want_xy), 4, "add_f32");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The spatial stage (`region.cu`) against its references: four rows (a
/// coordinate with tied maxima, a size, a text token, a coordinate whose
/// logits hold a NaN) at scattered KV rows; their values, the pending
/// values by KV row, the Fourier features of the pending values and the
/// rows `spatial_embed` replaces.
#[test]
fn spatial_stage_kernels_are_their_reference_bit_for_bit() {
    let Some((dir, exe)) = harness("spatial") else {
        return;
    };
    let (cb, sb, n, ch, sh, hidden) = (1024usize, 1024usize, 4usize, 128usize, 256usize, 96);
    let (coord_id, size_id) = (5u32, 6u32);
    let mut cl = Rng(51).vec(n * cb, 3.0);
    cl[300] = 9.0;
    cl[301] = 9.0;
    cl[3 * cb + 17] = f32::NAN;
    let sl = Rng(52).vec(n * 2 * sb, 3.0);
    let table = reference::size_table(sb);
    let tokens = [coord_id, size_id, 42, coord_id];
    let rows = [3u32, 0, 6, 2];
    let pending = vec![7.0f32; 8 * 3];
    let (cw, sw) = (Rng(53).vec(ch, 8.0), Rng(54).vec(2 * sh, 8.0));
    let x = Rng(55).vec(n * hidden, 1.0);
    let (ce, se) = (Rng(56).vec(n * hidden, 1.0), Rng(57).vec(n * hidden, 1.0));
    let args = [
        "spatial".to_owned(),
        cb.to_string(),
        sb.to_string(),
        n.to_string(),
        coord_id.to_string(),
        size_id.to_string(),
        ch.to_string(),
        sh.to_string(),
        hidden.to_string(),
    ];
    let out = run(
        &exe,
        &dir,
        &args,
        &[
            ("cl.bin", f32_bytes(&cl)),
            ("sl.bin", f32_bytes(&sl)),
            ("table.bin", f32_bytes(&table)),
            ("tokens.bin", u32_bytes(&tokens)),
            ("rows.bin", u32_bytes(&rows)),
            ("pending.bin", f32_bytes(&pending)),
            ("cw.bin", f32_bytes(&cw)),
            ("sw.bin", f32_bytes(&sw)),
            ("x.bin", f32_bytes(&x)),
            ("ce.bin", f32_bytes(&ce)),
            ("se.bin", f32_bytes(&se)),
        ],
        &[
            "values.bin",
            "pending_out.bin",
            "cf.bin",
            "sf.bin",
            "x_out.bin",
        ],
    );
    let (mut values, mut want_pending) = (Vec::new(), pending.clone());
    let (mut cf, mut sf, mut want_x) = (Vec::new(), Vec::new(), x.clone());
    for i in 0..n {
        let v = reference::spatial_values(
            tokens[i],
            (&cl[i * cb..(i + 1) * cb], &sl[i * 2 * sb..(i + 1) * 2 * sb]),
            &table,
            (coord_id, size_id),
        );
        values.extend(v);
        let r = rows[i] as usize;
        want_pending[r * 3..r * 3 + 3].copy_from_slice(&v);
        let (c, s) = reference::fourier_features(v, &cw, &sw);
        cf.extend(c.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()));
        sf.extend(s.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()));
        let src = match tokens[i] {
            t if t == coord_id => Some(&ce),
            t if t == size_id => Some(&se),
            _ => None,
        };
        if let Some(src) = src {
            want_x[i * hidden..(i + 1) * hidden]
                .copy_from_slice(&src[i * hidden..(i + 1) * hidden]);
        }
    }
    assert_eq!(values[0], 300.0 / 1024.0, "the first of tied maxima");
    assert_eq!(values[9], 17.0 / 1024.0, "a NaN counts as the largest");
    assert_eq!(&values[6..9], &[0.0; 3], "a text token decodes nothing");
    assert_same(&out[0], &f32_bytes(&values), 4, "spatial_values");
    assert_same(&out[1], &f32_bytes(&want_pending), 4, "pending values");
    assert_same(&out[2], &cf, 2, "coordinate features");
    assert_same(&out[3], &sf, 2, "size features");
    assert_same(&out[4], &f32_bytes(&want_x), 4, "spatial_embed");

    // hidden_f16: rows 0 and 2 of 3 to rows 1 and 0, row 1 dropped.
    let xs = Rng(58).vec(3 * hidden, 4.0);
    let out_row: Vec<u8> = [1i32, -1, 0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let args = ["hidden_f16".to_owned(), hidden.to_string(), "3".to_owned()];
    let out = run(
        &exe,
        &dir,
        &args,
        &[("xs.bin", f32_bytes(&xs)), ("out_row.bin", out_row)],
        &["h.bin"],
    );
    let row = |i: usize| {
        xs[i * hidden..(i + 1) * hidden]
            .iter()
            .map(|v| f16::from_f32(*v))
    };
    let want: Vec<u8> = row(2)
        .chain(row(0))
        .chain(std::iter::repeat_n(f16::ZERO, hidden))
        .flat_map(|h| h.to_le_bytes())
        .collect();
    assert_same(&out[0], &want, 2, "hidden_f16");

    // accept_values: members of 3, 1 and 2 rows accepting 2, 1 and 2, at
    // KV rows 4, 1, 2 of 5.
    let (qo, acc, kv) = ([0u32, 3, 4, 6], [2u32, 1, 2], [4u32, 1, 2]);
    let vals = Rng(59).vec(6 * 3, 1.0);
    let pend = Rng(60).vec(5 * 3, 1.0);
    let args = ["accept_values".to_owned(), "3".to_owned()];
    let out = run(
        &exe,
        &dir,
        &args,
        &[
            ("qo.bin", u32_bytes(&qo)),
            ("acc.bin", u32_bytes(&acc)),
            ("kv.bin", u32_bytes(&kv)),
            ("vals.bin", f32_bytes(&vals)),
            ("pend.bin", f32_bytes(&pend)),
        ],
        &["pend_out.bin"],
    );
    let mut want = pend.clone();
    for i in 0..3 {
        let (r, k) = ((qo[i] + acc[i] - 1) as usize, kv[i] as usize);
        want[k * 3..k * 3 + 3].copy_from_slice(&vals[r * 3..r * 3 + 3]);
    }
    assert_same(&out[0], &f32_bytes(&want), 4, "accept_values");
    let _ = std::fs::remove_dir_all(&dir);
}

/// One sequence of a `prefill_attention` case: query rows at positions
/// `q_start..q_start + rows` (keys below `q_start` are a cached prefix).
struct PfSeq {
    q_start: usize,
    rows: usize,
}

/// Runs `prefill_attention` (or, with `splits`, decode's `paged_attention`
/// and its merge, the rows' keys in at most that many ranges) on the host
/// against its reference for `seqs` (their rows in order, so runs of a
/// sequence straddle blocks of `PREFILL_Q_ROWS`), each sequence's pages
/// scattered over the pool; cache slots no row may read hold NaN, so
/// reading one would poison the output.
fn attention_case(
    exe: &Path,
    dir: &Path,
    shape: reference::AttnShape,
    seqs: &[PfSeq],
    seed: u64,
    splits: Option<usize>,
) {
    let (nh, nkv, hd, ps) = (
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.page_size,
    );
    let kv_dim = nkv * hd;
    let stride = (nh + 2 * nkv) * hd;
    let mut rng = Rng(seed);
    let need: Vec<usize> = seqs
        .iter()
        .map(|s| (s.q_start + s.rows).div_ceil(ps))
        .collect();
    let num_pages = need.iter().sum::<usize>() + 3;
    // Pages handed out from the pool's end backwards, every other one, so
    // no sequence's pages are contiguous.
    let mut order: Vec<u32> = (0..num_pages as u32).rev().collect();
    order.sort_by_key(|p| p % 2);
    let (mut indptr, mut indices) = (vec![0u32], Vec::new());
    for &n in &need {
        indices.extend(order.drain(..n));
        indptr.push(indices.len() as u32);
    }
    let slots = num_pages * ps;
    let (mut kc, mut vc) = (
        vec![f16::NAN; slots * kv_dim],
        vec![f16::NAN; slots * kv_dim],
    );
    let (mut row_seq, mut row_pos) = (Vec::new(), Vec::new());
    for (s, seq) in seqs.iter().enumerate() {
        let pages = &indices[indptr[s] as usize..indptr[s + 1] as usize];
        for pos in 0..seq.q_start + seq.rows {
            let slot = pages[pos / ps] as usize * ps + pos % ps;
            let (k, v) = (rng.vec(kv_dim, 1.5), rng.vec(kv_dim, 1.0));
            for d in 0..kv_dim {
                kc[slot * kv_dim + d] = f16::from_f32(k[d]);
                vc[slot * kv_dim + d] = f16::from_f32(v[d]);
            }
        }
        row_seq.extend(std::iter::repeat_n(s as u32, seq.rows));
        row_pos.extend((seq.q_start..seq.q_start + seq.rows).map(|p| p as u32));
    }
    let n = row_seq.len();
    let qkv = rng.vec(n * stride, 2.0);
    let u32_bytes = |v: &[u32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let f16_bytes = |v: &[f16]| -> Vec<u8> { v.iter().flat_map(|h| h.to_le_bytes()).collect() };
    let mut args = vec![
        if splits.is_some() {
            "decode_attn"
        } else {
            "prefill_attn"
        }
        .to_owned(),
        nh.to_string(),
        nkv.to_string(),
        hd.to_string(),
        ps.to_string(),
        format!("{:e}", shape.scale),
        shape.window.to_string(),
        stride.to_string(),
        n.to_string(),
    ];
    args.extend(splits.map(|s| s.to_string()));
    let out = run(
        exe,
        dir,
        &args,
        &[
            ("qkv.bin", f32_bytes(&qkv)),
            ("seq.bin", u32_bytes(&row_seq)),
            ("pos.bin", u32_bytes(&row_pos)),
            ("indptr.bin", u32_bytes(&indptr)),
            ("indices.bin", u32_bytes(&indices)),
            ("k.bin", f16_bytes(&kc)),
            ("v.bin", f16_bytes(&vc)),
        ],
        &["out.bin"],
    );
    let mut want = vec![f16::ZERO; n * nh * hd];
    let rows = reference::AttnRows {
        qkv: &qkv,
        stride,
        row_seq: &row_seq,
        row_pos: &row_pos,
        kv_indptr: &indptr,
        kv_indices: &indices,
    };
    let kernel = match splits {
        Some(s) => {
            reference::decode_attention(&shape, &rows, &kc, &vc, s, &mut want);
            format!("paged_attention in {s} ranges")
        }
        None => {
            reference::prefill_attention(&shape, &rows, &kc, &vc, &mut want);
            "prefill_attention".to_owned()
        }
    };
    assert!(want.iter().all(|h| h.is_finite()), "the reference read NaN");
    let what = format!(
        "{kernel} {nh}/{nkv} heads of {hd}, pages of {ps}, window {}",
        shape.window
    );
    assert_same(&out[0], &f16_bytes(&want), 2, &what);
}

#[test]
fn prefill_attention_is_its_reference_bit_for_bit() {
    let Some((dir, exe)) = harness("prefill_attn") else {
        return;
    };
    let shape = |nh, nkv, hd: usize, ps, window| reference::AttnShape {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        page_size: ps,
        scale: 1.0 / (hd as f32).sqrt(),
        window,
    };
    // GQA 3:1, SmolLM2's head width: a whole prompt of 21 rows, a chunk of
    // 45 rows after a 37-token cached prefix (tiles and pages straddled),
    // and a single row (a decode-like run inside a block of rows).
    let mixed = [
        PfSeq {
            q_start: 0,
            rows: 21,
        },
        PfSeq {
            q_start: 37,
            rows: 45,
        },
        PfSeq {
            q_start: 5,
            rows: 1,
        },
    ];
    attention_case(&exe, &dir, shape(6, 2, 64, 16, 0), &mixed, 1, None);
    // No grouping, 128 wide, pages of 4, a sliding window of 20 keys over a
    // chunk at 50 (the window's start moves through a tile).
    let windowed = [PfSeq {
        q_start: 50,
        rows: 13,
    }];
    attention_case(&exe, &dir, shape(4, 4, 128, 4, 20), &windowed, 2, None);
    // GQA 8:1 at the widest head (the shared tiles' limit), 9 rows at 3.
    let wide = [PfSeq {
        q_start: 3,
        rows: 9,
    }];
    attention_case(&exe, &dir, shape(8, 1, 256, 16, 0), &wide, 3, None);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Decode attention split over keys (issue 75 items 2 and 5): the source of
/// `paged_attention` and `paged_attention_merge` against
/// `reference::decode_attention` bit for bit. Rows at 1 to 300 keys (one
/// range up to 64 keys, up to four past it), GQA 3:1 at SmolLM2's head
/// width (3 heads a block), 8:1 at 256 (two blocks of 4 per KV head, 32
/// lanes a key), 1:1 at 128 with a window of 70 (the ranges start inside
/// the window), 6:1 at 24 (not a multiple of 8: element loads, 3 of 4
/// lanes a key; the second block of heads holds 2).
#[test]
fn decode_attention_is_its_reference_bit_for_bit() {
    let Some((dir, exe)) = harness("decode_attn") else {
        return;
    };
    let shape = |nh, nkv, hd: usize, ps, window| reference::AttnShape {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        page_size: ps,
        scale: 1.0 / (hd as f32).sqrt(),
        window,
    };
    let decode = |positions: &[usize]| -> Vec<PfSeq> {
        positions
            .iter()
            .map(|&p| PfSeq {
                q_start: p,
                rows: 1,
            })
            .collect()
    };
    let rows = decode(&[0, 40, 64, 65, 299, 130]);
    attention_case(&exe, &dir, shape(6, 2, 64, 16, 0), &rows, 11, Some(4));
    attention_case(&exe, &dir, shape(6, 2, 64, 16, 0), &rows, 12, Some(1));
    attention_case(
        &exe,
        &dir,
        shape(8, 1, 256, 16, 0),
        &decode(&[200, 3]),
        13,
        Some(4),
    );
    attention_case(
        &exe,
        &dir,
        shape(4, 4, 128, 4, 70),
        &decode(&[250, 69, 20]),
        14,
        Some(8),
    );
    attention_case(
        &exe,
        &dir,
        shape(6, 1, 24, 8, 0),
        &decode(&[150, 7]),
        15,
        Some(2),
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn count_tokens_is_its_reference() {
    let Some((dir, exe)) = harness("count") else {
        return;
    };
    // KV rows 2 and 0 of 3 (vocabulary 300): 200 tokens for row 2 with
    // repeats (threads of a block add to one count at once), none for row
    // 0, and ids past the vocabulary, which are skipped.
    let vocab = 300usize;
    let rows = [2u32, 0];
    let mut tokens: Vec<u32> = (0..200u32).map(|i| (i * 7) % 50).collect();
    tokens.extend([300, 299, 1000]);
    let indptr = [0u32, tokens.len() as u32, tokens.len() as u32];
    let counts: Vec<u32> = (0..3 * vocab as u32).map(|i| i % 3).collect();
    let u32_bytes = |v: &[u32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let args = ["count".to_owned(), vocab.to_string(), "2".to_owned()];
    let out = run(
        &exe,
        &dir,
        &args,
        &[
            ("rows.bin", u32_bytes(&rows)),
            ("indptr.bin", u32_bytes(&indptr)),
            ("tokens.bin", u32_bytes(&tokens)),
            ("counts.bin", u32_bytes(&counts)),
        ],
        &["out.bin"],
    );
    let mut want = counts.clone();
    for (i, &r) in rows.iter().enumerate() {
        let row = &mut want[r as usize * vocab..(r as usize + 1) * vocab];
        reference::count_tokens(row, &tokens[indptr[i] as usize..indptr[i + 1] as usize]);
    }
    assert_eq!(want[2 * vocab], counts[2 * vocab] + 4, "token 0 four times");
    assert_same(&out[0], &u32_bytes(&want), 4, "count_tokens");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn draft_verification_kernels_are_their_references() {
    let Some((dir, exe)) = harness("verify") else {
        return;
    };
    // Three members on KV rows 3, 0, 2 of 4 (vocabulary 40): no drafts;
    // drafts [5, 6] of which the first is accepted; drafts [7, 7, 9] all
    // accepted (repeats: the scratch counts count 7 twice).
    let vocab = 40usize;
    let rows = [3u32, 0, 2];
    let qo = [0u32, 1, 4, 8];
    let drafts = [5u32, 6, 7, 7, 9];
    let pending = [11u32, 0, 12, 13];
    let counts: Vec<u32> = (0..4 * vocab as u32).map(|i| i % 2).collect();
    // What sample_rows would return: row 4's 5 matches d_1, row 5's 1
    // rejects 6; member 2 accepts everything and samples 8 after.
    let sampled = [21u32, 5, 1, 30, 7, 7, 9, 8];
    let u32_bytes = |v: &[u32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let args = ["verify", &vocab.to_string(), "3", "4"].map(String::from);
    let out = run(
        &exe,
        &dir,
        &args,
        &[
            ("pending.bin", u32_bytes(&pending)),
            ("rows.bin", u32_bytes(&rows)),
            ("qo.bin", u32_bytes(&qo)),
            ("drafts.bin", u32_bytes(&drafts)),
            ("counts.bin", u32_bytes(&counts)),
            ("sampled.bin", u32_bytes(&sampled)),
        ],
        &[
            "tokens.bin",
            "scratch.bin",
            "counts_out.bin",
            "pending_out.bin",
            "acc.bin",
        ],
    );
    let mut tokens = vec![0u32; 8];
    reference::verify_inputs(&pending, &rows, &qo, &drafts, &mut tokens);
    assert_eq!(tokens, [13, 11, 5, 6, 12, 7, 7, 9]);
    assert_same(&out[0], &u32_bytes(&tokens), 4, "verify_inputs");
    let mut scratch = vec![0u32; 8 * vocab];
    let (mut want_counts, mut want_pending, mut accepted) = (counts.clone(), pending, Vec::new());
    for (i, &r) in rows.iter().enumerate() {
        let (s, e, r) = (qo[i] as usize, qo[i + 1] as usize, r as usize);
        let base = counts[r * vocab..(r + 1) * vocab].to_vec();
        for q in s..e {
            let out = &mut scratch[q * vocab..(q + 1) * vocab];
            reference::draft_counts(&base, &tokens[s + 1..=q], out);
        }
        let c = &mut want_counts[r * vocab..(r + 1) * vocab];
        let (next, took) = reference::accept_drafts(&tokens[s + 1..e], &sampled[s..e], c);
        want_pending[r] = next;
        accepted.push(took);
    }
    assert_eq!(accepted, [1, 2, 4]);
    assert_eq!(want_pending, [1, 0, 8, 21]);
    assert_eq!(
        scratch[7 * vocab + 7],
        counts[2 * vocab + 7] + 2,
        "7 counted twice"
    );
    assert_same(&out[1], &u32_bytes(&scratch), 4, "draft_counts");
    assert_same(
        &out[2],
        &u32_bytes(&want_counts),
        4,
        "accept_drafts' counts",
    );
    assert_same(
        &out[3],
        &u32_bytes(&want_pending),
        4,
        "accept_drafts' pending",
    );
    assert_same(&out[4], &u32_bytes(&accepted), 4, "accept_drafts' accepted");
    let _ = std::fs::remove_dir_all(&dir);
}

fn u32_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn u32s(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    u32s(bytes).into_iter().map(f32::from_bits).collect()
}

/// `embedding.cu` and `rope.cu` (issue 75 item 5): `embed_gather` converts
/// each row's f16 table row to f32 (prompt tokens directly, decode tokens
/// through `rows`; an id past the vocabulary reads row 0), `add_bias` adds
/// the bias to the first `d` columns of each row and leaves the rest.
#[test]
fn embedding_and_bias_kernels_are_their_reference_bit_for_bit() {
    let Some((dir, exe)) = harness("embed_bias") else {
        return;
    };
    let (hidden, vocab) = (200, 7);
    let table: Vec<f16> = Rng(3)
        .vec(vocab * hidden, 70_000.0)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    let table_bytes: Vec<u8> = table.iter().flat_map(|h| h.to_le_bytes()).collect();
    let tokens = [6u32, 0, 3, 9, 2];
    let rows = [4u32, 2, 0];
    for (indirect, ids) in [(0, vec![6usize, 0, 3, 0, 2]), (1, vec![2, 3, 6])] {
        let n = ids.len();
        let args = [
            "embed_f16".to_owned(),
            hidden.to_string(),
            vocab.to_string(),
            n.to_string(),
            indirect.to_string(),
        ];
        let out = run(
            &exe,
            &dir,
            &args,
            &[
                ("table.bin", table_bytes.clone()),
                ("tokens.bin", u32_bytes(&tokens)),
                ("rows.bin", u32_bytes(&rows)),
            ],
            &["x.bin"],
        );
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&t| {
                table[t * hidden..(t + 1) * hidden]
                    .iter()
                    .map(|h| h.to_f32())
            })
            .collect();
        assert_same(
            &out[0],
            &f32_bytes(&want),
            4,
            &format!("embed_gather {indirect}"),
        );
    }
    let (stride, d, n) = (100, 72, 3);
    let y = Rng(4).vec(n * stride, 5.0);
    let b = Rng(5).vec(d, 5.0);
    let args = ["bias", &stride.to_string(), &d.to_string(), &n.to_string()].map(String::from);
    let out = run(
        &exe,
        &dir,
        &args,
        &[("y.bin", f32_bytes(&y)), ("b.bin", f32_bytes(&b))],
        &["out.bin"],
    );
    let mut want = y.clone();
    for row in want.chunks_exact_mut(stride) {
        for (v, bias) in row.iter_mut().zip(&b) {
            *v += bias;
        }
    }
    assert_same(&out[0], &f32_bytes(&want), 4, "add_bias");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `sample.cu` itself (issue 75 item 5: the kernel, not the host device's
/// transcription of it) against kestrel-cpu's sampler, the reference, on
/// rows that exercise every stage: greedy and seeded draws, top-k, top-p,
/// min-p, penalties, masks (one allowing nothing), logit biases, top-n,
/// 1024 threads over a vocabulary of 3000 (three tokens a thread in the
/// draw's id-order walk). Tokens, top-n ids, the counts and `pending` must
/// be equal; logprobs within 1e-4 (masses are f64 sums in another order).
/// The host device's `sample_row` must pick the kernel's tokens too.
#[test]
fn sample_kernel_matches_the_cpu_sampler_and_the_host_device() {
    use kestrel_cpu::sampler::{sample, PenaltyState, SamplingParams};
    use kestrel_cuda::ffi::SampleParams;
    use kestrel_cuda::hostdev::{sample_row, SampleRow};
    use kestrel_pipeline::LogitBias;
    let Some((dir, exe)) = harness("sample") else {
        return;
    };
    let (vocab, n, top_n) = (3000usize, 20usize, 3usize);
    let words = vocab.div_ceil(32);
    let mut rng = Rng(77);
    let mut pick = |m: usize| (rng.next_u64() % m as u64) as usize;
    let mut logits = Vec::new();
    let (mut mask_words, mut mask_flags) = (Vec::new(), Vec::new());
    let (mut params, mut cpu_params) = (Vec::new(), Vec::new());
    let (mut counts, mut positions) = (Vec::new(), Vec::new());
    let (mut bias_indptr, mut bias) = (vec![0u32], Vec::new());
    for case in 0..n {
        // Coarse logits, so ties are common.
        let row: Vec<f32> = Rng(100 + case as u64)
            .vec(vocab, 8.0)
            .into_iter()
            .map(|x| (x * 2.0).round() / 2.0)
            .collect();
        logits.extend_from_slice(&row);
        let p = SamplingParams {
            temperature: [0.0, 0.7, 1.0, 1.3][case % 4],
            top_k: [0, 1, 5, 40, 2999][case % 5],
            top_p: [1.0, 0.9, 0.5][case % 3],
            min_p: if case % 6 == 5 { 0.05 } else { 0.0 },
            repetition_penalty: if case % 3 == 0 { 1.3 } else { 1.0 },
            frequency_penalty: if case % 5 == 0 { 0.4 } else { 0.0 },
            presence_penalty: if case % 7 == 0 { 0.25 } else { 0.0 },
            seed: 1000 + case as u64,
            top_logprobs: top_n as u32,
            logprobs: true,
            logit_bias: if case % 5 == 2 {
                LogitBias::new([
                    (pick(vocab) as u32, -100.0),
                    (pick(vocab) as u32, 7.5),
                    (pick(vocab) as u32, 0.5),
                ])
            } else {
                LogitBias::default()
            },
        };
        for &(t, v) in p.logit_bias.entries() {
            bias.extend([t, v.to_bits()]);
        }
        bias_indptr.push((bias.len() / 2) as u32);
        // Every fourth row masked; row 13 allows nothing.
        let masked = case % 4 == 1 || case == 13;
        mask_flags.push(u32::from(masked));
        for _ in 0..words {
            let w = if case == 13 {
                0
            } else {
                (pick(1 << 16) as u32) << 16 | pick(1 << 16) as u32
            };
            mask_words.push(w);
        }
        let mut c = vec![0u32; vocab];
        for _ in 0..20 {
            c[pick(vocab)] += 1;
        }
        counts.extend_from_slice(&c);
        positions.push(case as u32 * 3 + 1);
        params.push(SampleParams::from(&p));
        cpu_params.push(p);
    }
    // Rows sample into KV rows in reverse order.
    let rows: Vec<u32> = (0..n as u32).rev().collect();
    let mut kv_counts = vec![0u32; n * vocab];
    for (i, &r) in rows.iter().enumerate() {
        let r = r as usize;
        kv_counts[r * vocab..(r + 1) * vocab].copy_from_slice(&counts[i * vocab..(i + 1) * vocab]);
    }
    let params_bytes: Vec<u8> = params
        .iter()
        .flat_map(|p| {
            let mut b = Vec::with_capacity(40);
            for w in [
                p.temperature.to_bits(),
                p.top_k,
                p.top_p.to_bits(),
                p.min_p.to_bits(),
                p.repetition_penalty.to_bits(),
                p.frequency_penalty.to_bits(),
                p.presence_penalty.to_bits(),
                0,
            ] {
                b.extend(w.to_le_bytes());
            }
            b.extend(p.seed.to_le_bytes());
            b
        })
        .collect();
    let args = [vocab, n, words, top_n].map(|x| x.to_string());
    let out = run(
        &exe,
        &dir,
        &[&["sample".to_owned()][..], &args].concat(),
        &[
            ("logits.bin", f32_bytes(&logits)),
            ("mask_words.bin", u32_bytes(&mask_words)),
            ("mask_flags.bin", u32_bytes(&mask_flags)),
            ("params.bin", params_bytes),
            ("rows.bin", u32_bytes(&rows)),
            ("positions.bin", u32_bytes(&positions)),
            ("counts.bin", u32_bytes(&kv_counts)),
            ("bias_indptr.bin", u32_bytes(&bias_indptr)),
            ("bias.bin", u32_bytes(&bias)),
        ],
        &[
            "tokens.bin",
            "lps.bin",
            "top_ids.bin",
            "top_lps.bin",
            "counts_out.bin",
            "pending.bin",
        ],
    );
    let (tokens, lps) = (u32s(&out[0]), f32s(&out[1]));
    let (top_ids, top_lps) = (u32s(&out[2]), f32s(&out[3]));
    let (counts_out, pending) = (u32s(&out[4]), u32s(&out[5]));
    let mut want_counts = kv_counts.clone();
    let mut draws = 0;
    for i in 0..n {
        let row_logits = &logits[i * vocab..(i + 1) * vocab];
        let row_counts = &counts[i * vocab..(i + 1) * vocab];
        let mask = (mask_flags[i] == 1).then(|| &mask_words[i * words..(i + 1) * words]);
        let p = &cpu_params[i];
        let mut state = PenaltyState::new(vocab);
        for (t, &c) in row_counts.iter().enumerate() {
            for _ in 0..c {
                state.record(t as u32);
            }
        }
        let mut cpu_logits = row_logits.to_vec();
        let cpu = sample(&mut cpu_logits, p, mask, &mut state, positions[i], top_n);
        let (tok, lp) = (tokens[i], lps[i]);
        let top: Vec<(u32, f32)> = (0..top_n)
            .map(|j| (top_ids[i * top_n + j], top_lps[i * top_n + j]))
            .collect();
        match cpu {
            None => {
                assert_eq!(i, 13, "only row 13 allows nothing");
                assert_eq!((tok, lp), (0, f32::NEG_INFINITY), "row {i}");
                assert!(top.iter().all(|&t| t == (0, f32::NEG_INFINITY)));
            }
            Some(cpu) => {
                draws += usize::from(p.temperature > 0.0);
                assert_eq!(tok, cpu.token, "row {i}: {p:?}");
                assert!(
                    (lp - cpu.logprob).abs() < 1e-4,
                    "row {i}: {lp} vs {}",
                    cpu.logprob
                );
                for (j, &(id, l)) in top.iter().enumerate() {
                    match cpu.top.as_slice().get(j) {
                        Some(&(cid, cl)) => {
                            assert_eq!(id, cid, "row {i} top {j}");
                            assert!((l - cl).abs() < 1e-4, "row {i} top {j}: {l} vs {cl}");
                        }
                        None => assert_eq!((id, l), (0, f32::NEG_INFINITY), "row {i} top {j}"),
                    }
                }
            }
        }
        let entries: Vec<(u32, f32)> = bias
            [2 * bias_indptr[i] as usize..2 * bias_indptr[i + 1] as usize]
            .chunks_exact(2)
            .map(|w| (w[0], f32::from_bits(w[1])))
            .collect();
        let host_row = SampleRow {
            mask,
            bias: &entries,
            counts: row_counts,
            position: positions[i],
        };
        let (htok, _, htop) = sample_row(row_logits, &params[i], host_row, top_n);
        assert_eq!(htok, tok, "row {i}: the host device's sample_row");
        let hids: Vec<u32> = htop.iter().map(|&(id, _)| id).collect();
        let ids: Vec<u32> = top.iter().map(|&(id, _)| id).collect();
        assert_eq!(hids, ids, "row {i}: the host device's top-n");
        let r = rows[i] as usize;
        want_counts[r * vocab + tok as usize] += 1;
        assert_eq!(pending[r], tok, "row {i}: pending");
    }
    assert!(draws >= 10, "{draws} draws");
    assert_eq!(counts_out, want_counts, "counts");
    let _ = std::fs::remove_dir_all(&dir);
}
