//! Fast numerics (int8 activations, `Numerics::Fast`) at kernel level: every
//! ISA gives the scalar definition's bits (integer sums are exact, and the
//! float steps are the same operations in the same order); results stay
//! within the stated quantization bound of an f64 reference; a row's outputs
//! do not depend on the batch or the thread count; encodings without an
//! integer dot are computed exactly in a fast group.
//!
//! The bound: with block scale `d_b = max|x_b| / 127`, quantizing moves each
//! activation by at most `d_b / 2`, so
//! `|y_fast - y| <= sum_b (d_b / 2) * sum_{i in b} |w_i|`, plus f32 rounding,
//! allowed as `1e-5 * (1 + sum_i |w_i x_i|)`.

mod common;

use kestrel_cpu::kernels::coverage::tested_isas;
use kestrel_cpu::kernels::{matmul, matmul_group, MatRef, MatmulJob, Weight};
use kestrel_cpu::synth::{random_matrix, Rng};
use kestrel_cpu::{Isa, Numerics, Team};
use kestrel_model::DType;

/// The dtypes with an integer dot: every quantized one.
fn int8_dtypes() -> impl Iterator<Item = DType> {
    DType::ALL.into_iter().filter(|d| d.is_quantized())
}

/// Every ISA this CPU runs, the rest reported skipped (and failing where
/// `KESTREL_REQUIRE_ISA` lists them).
fn isas(test: &str) -> Vec<Isa> {
    tested_isas(
        test,
        &[Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512, Isa::Amx],
    )
}

/// The stated bound on `|y_fast - y|` for weights `w` and activations `x`.
fn bound(w: &[f32], x: &[f32]) -> f64 {
    let quant: f64 = w
        .chunks_exact(32)
        .zip(x.chunks_exact(32))
        .map(|(wb, xb)| {
            let d = xb.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 127.0;
            d / 2.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>()
        })
        .sum();
    let mag: f64 = w.iter().zip(x).map(|(a, b)| (a * b).abs() as f64).sum();
    quant * (1.0 + 1e-6) + 1e-5 * (1.0 + mag)
}

#[test]
fn every_isa_gives_the_definition_and_stays_within_the_bound() {
    let p = Team::new(2, "test").unwrap();
    let isas = isas("every_isa_gives_the_definition_and_stays_within_the_bound");
    let mut worst_share = 0f64;
    for dtype in int8_dtypes() {
        for &(rows, cols, n) in &[
            (1, 32, 1),
            (7, 64, 3),
            (37, 96, 5),
            (130, 576, 1),
            (130, 576, 9),
            (39, 768, 2),
            (64, 1536, 1),
            (5, 256, 3),
            (33, 512, 9),
            (42, 1536, 6),
            (70, 256, 20),
            // Tasks of 144 rows (two threads): more than one 128-row chunk
            // of unpacked rows (two 16-lane groups and a third) and of
            // stored ones (up to 32 rows).
            (1040, 512, 40),
            (1040, 512, 24),
            // Five 16-lane groups, the last partial: two threads quantize
            // and lay them out a group per task.
            (64, 512, 70),
            // AMX tiles (64 blocks a row and up): whole 16-row tiles, a
            // tail, a partial second lane group.
            (70, 2048, 20),
            // Rows past 1.5 chunks of blocks (the 16-lane VNNI sweeps take
            // them a chunk at a time, the sums carried: 104 blocks and then
            // 96 for the K-quants' whole super-blocks, 100 and 100 for the
            // rest): a pair of groups and a partial third, tasks with a
            // tail row.
            (42, 6400, 33),
        ] {
            if cols % dtype.block_elems() != 0 {
                continue;
            }
            let mut rng = Rng(rows as u64 * 7919 + cols as u64 + n as u64);
            let m = random_matrix(&mut rng, dtype, rows, cols, 1.0);
            let prepared = Weight::prepare("w", &m).unwrap();
            // Q5_0/Q5_1 and the K-quants are read only repacked.
            let stored = MatRef::new("w", &m).ok();
            // Activations with a spread of block magnitudes, as after RMSNorm.
            let x: Vec<f32> = rng
                .vec(n * cols, 1.0)
                .iter()
                .enumerate()
                .map(|(i, v)| v * (1.0 + (i / 32 % 5) as f32))
                .collect();
            let mut deq = vec![0f32; cols];
            let mut first: Option<Vec<f32>> = None;
            for &isa in &isas {
                for w in stored.into_iter().chain([prepared.mat()]) {
                    let mut y = vec![0f32; n * rows];
                    matmul(Some(&p), isa, Numerics::Fast, w, &x, n, &mut y);
                    match &first {
                        None => first = Some(y.clone()),
                        Some(f) => {
                            for (i, (a, b)) in f.iter().zip(&y).enumerate() {
                                assert_eq!(
                                    a.to_bits(),
                                    b.to_bits(),
                                    "{:?} {isa:?} {rows}x{cols} n={n} output {i}: {a} vs {b}",
                                    w.enc
                                );
                            }
                        }
                    }
                    for r in 0..rows {
                        kestrel_cpu::kernels::matmul::dequant_row(&prepared.mat(), r, &mut deq);
                        for c in 0..n {
                            let xc = &x[c * cols..(c + 1) * cols];
                            let want: f64 =
                                deq.iter().zip(xc).map(|(a, b)| *a as f64 * *b as f64).sum();
                            let (got, b) = (y[c * rows + r] as f64, bound(&deq, xc));
                            assert!(
                                (got - want).abs() <= b,
                                "{dtype:?} {isa:?} {rows}x{cols} ({r}, {c}): {got} vs {want}, bound {b}"
                            );
                            worst_share = worst_share.max((got - want).abs() / b);
                        }
                    }
                }
            }
        }
    }
    eprintln!("worst |fast - f64| / bound: {worst_share:.3}");
}

#[test]
fn fast_matmul_is_batch_invariant() {
    common::assert_matmul_batch_invariant(Numerics::Fast, int8_dtypes(), 11, 256);
}

#[test]
fn a_fast_group_computes_encodings_without_an_integer_dot_exactly() {
    let p = Team::new(2, "test").unwrap();
    let (cols, n) = (96, 3);
    let mut rng = Rng(5);
    let q = Weight::prepare("q", &random_matrix(&mut rng, DType::Q4_1, 40, cols, 1.0)).unwrap();
    let f = Weight::prepare("f", &random_matrix(&mut rng, DType::F16, 24, cols, 1.0)).unwrap();
    let x = rng.vec(n * cols, 1.0);
    let (mut yq, mut yf) = (vec![0f32; n * 40], vec![0f32; n * 24]);
    let mut jobs = [
        MatmulJob {
            w: q.mat(),
            y: &mut yq,
        },
        MatmulJob {
            w: f.mat(),
            y: &mut yf,
        },
    ];
    matmul_group(Some(&p), Isa::detect(), Numerics::Fast, &x, n, &mut jobs);
    let alone = |w, numerics, rows| {
        let mut y = vec![0f32; n * rows];
        matmul(Some(&p), Isa::detect(), numerics, w, &x, n, &mut y);
        y
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&yq), bits(&alone(q.mat(), Numerics::Fast, 40)));
    assert_eq!(bits(&yf), bits(&alone(f.mat(), Numerics::Exact, 24)));
    assert_ne!(
        bits(&yq),
        bits(&alone(q.mat(), Numerics::Exact, 40)),
        "the Q4_1 matrix took the int8 path"
    );
}
