//! Kernel tests: every dtype, as stored and as repacked for the kernels,
//! and every ISA against the scalar definition (bit for bit) and against an
//! f64 reference (tolerance), at odd sizes; batch invariance of the matmul
//! across `n` and thread counts. Dtypes read only repacked (Q5_0, Q5_1, the
//! K-quants) are also checked against kestrel-model's dequantization (ggml's
//! reference values): every kernel result equals the canonical-order dot
//! product of those values, bit for bit.

mod common;

use kestrel_cpu::kernels::coverage::tested_isas;
use kestrel_cpu::kernels::{matmul, MatRef, Weight};
use kestrel_cpu::synth::{random_matrix, Rng};
use kestrel_cpu::{Isa, Numerics};
use kestrel_model::DType;

/// Every dtype the kernels accept.
const ALL: [DType; 11] = kestrel_cpu::SUPPORTED_DTYPES;

/// The canonical order of `kernels::scalar::dot` on already dequantized
/// weights: element `16c + l` fused into lane `l`, then the fixed tree.
fn canonical_dot(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (i, (a, b)) in w.iter().zip(x).enumerate() {
        acc[i % 16] = a.mul_add(*b, acc[i % 16]);
    }
    let s8: Vec<f32> = (0..8).map(|l| acc[l] + acc[l + 8]).collect();
    let s4: Vec<f32> = (0..4).map(|l| s8[l] + s8[l + 4]).collect();
    (s4[0] + s4[2]) + (s4[1] + s4[3])
}

/// Every ISA this CPU runs, the rest reported skipped (and failing where
/// `KESTREL_REQUIRE_ISA` lists them).
fn isas(test: &str) -> Vec<Isa> {
    tested_isas(
        test,
        &[Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512, Isa::Amx],
    )
}

fn pool(n: usize) -> kestrel_cpu::Team {
    kestrel_cpu::Team::new(n, "test").unwrap()
}

#[test]
fn matmul_matches_f64_reference_and_all_isas_agree() {
    let p = pool(2);
    let isas = isas("matmul_matches_f64_reference_and_all_isas_agree");
    for dtype in ALL {
        let be = dtype
            .block_elems()
            .max(if dtype.block_elems() > 1 { 32 } else { 1 });
        for &(rows, cols, n) in &[
            (1, 32, 1),
            (7, 64, 3),
            (37, 96, 5),
            (130, 576, 9),
            (130, 576, 1),
            (39, 96, 1),
            (5, 45, 2),
            (9, 17, 6),
            (3, 256, 2),
            (37, 512, 5),
            (130, 768, 9),
            (39, 768, 1),
        ] {
            if cols % be != 0 {
                continue;
            }
            let mut rng = Rng(rows as u64 * 1000 + cols as u64);
            let m = random_matrix(&mut rng, dtype, rows, cols, 1.0);
            let prepared = Weight::prepare("w", &m).unwrap();
            // Dtypes read only repacked have no stored view.
            let stored = MatRef::new("w", &m).ok();
            let x = rng.vec(n * cols, 1.0);
            let mut deq = vec![0f32; cols];
            let mut want = vec![0f64; n * rows];
            let mut exact = vec![0f32; n * rows];
            for r in 0..rows {
                match &stored {
                    Some(w) => kestrel_cpu::kernels::matmul::dequant_row(w, r, &mut deq),
                    None => m.dequantize_row(r, &mut deq),
                }
                for c in 0..n {
                    let xc = &x[c * cols..(c + 1) * cols];
                    want[c * rows + r] = (0..cols).map(|i| deq[i] as f64 * xc[i] as f64).sum();
                    exact[c * rows + r] = canonical_dot(&deq, xc);
                }
            }
            // The repacked encoding must give the stored one's bits.
            let mut first: Option<Vec<f32>> = None;
            for (isa, w) in isas.iter().copied().flat_map(|i| {
                stored
                    .map(|s| (i, s))
                    .into_iter()
                    .chain([(i, prepared.mat())])
            }) {
                let mut y = vec![0f32; n * rows];
                matmul(Some(&p), isa, Numerics::Exact, w, &x, n, &mut y);
                for (g, e) in y.iter().zip(&want) {
                    assert!(
                        (*g as f64 - e).abs() <= 1e-4 * (1.0 + e.abs()),
                        "{:?} {isa:?} {rows}x{cols}: {g} vs {e}",
                        w.enc
                    );
                }
                if stored.is_none() {
                    // Bit for bit the canonical dot of ggml's values.
                    for (i, (g, e)) in y.iter().zip(&exact).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            e.to_bits(),
                            "{dtype:?} {isa:?} {rows}x{cols} n={n} output {i}: {g} vs {e}"
                        );
                    }
                }
                match &first {
                    None => first = Some(y),
                    Some(f) => assert!(
                        f.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{:?} {isa:?} differs from scalar {dtype:?}",
                        w.enc
                    ),
                }
            }
        }
    }
}

#[test]
fn matmul_is_batch_invariant() {
    common::assert_matmul_batch_invariant(Numerics::Exact, ALL, 7, 512);
}
