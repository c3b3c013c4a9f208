//! Kernel tests: every dtype, as stored and as repacked for the kernels,
//! and every ISA against the scalar definition (bit for bit) and against an
//! f64 reference (tolerance), at odd sizes; batch invariance of the matmul
//! across `n` and thread counts.

use kestrel_cpu::kernels::{matmul, MatRef, Weight};
use kestrel_cpu::synth::{random_matrix, Rng};
use kestrel_cpu::Isa;
use kestrel_model::DType;

/// Every dtype the kernels accept.
const ALL: [DType; 6] = kestrel_cpu::SUPPORTED_DTYPES;

fn isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|i| i.is_supported())
        .collect()
}

fn pool(n: usize) -> kestrel_cpu::Team {
    kestrel_cpu::Team::new(n, "test").unwrap()
}

#[test]
fn matmul_matches_f64_reference_and_all_isas_agree() {
    let p = pool(2);
    for dtype in ALL {
        let quant = dtype.block_elems() > 1;
        for &(rows, cols, n) in &[
            (1, 32, 1),
            (7, 64, 3),
            (37, 96, 5),
            (130, 576, 9),
            (130, 576, 1),
            (39, 96, 1),
            (5, 45, 2),
            (9, 17, 6),
        ] {
            if quant && cols % 32 != 0 {
                continue;
            }
            let mut rng = Rng(rows as u64 * 1000 + cols as u64);
            let m = random_matrix(&mut rng, dtype, rows, cols, 1.0);
            let prepared = Weight::prepare("w", &m).unwrap();
            let w = MatRef::new("w", &m).unwrap();
            let x = rng.vec(n * cols, 1.0);
            let mut deq = vec![0f32; cols];
            let mut want = vec![0f64; n * rows];
            for r in 0..rows {
                kestrel_cpu::kernels::matmul::dequant_row(&w, r, &mut deq);
                for c in 0..n {
                    want[c * rows + r] = (0..cols)
                        .map(|i| deq[i] as f64 * x[c * cols + i] as f64)
                        .sum();
                }
            }
            // The repacked encoding must give the stored one's bits.
            let mut first: Option<Vec<f32>> = None;
            for (isa, w) in isas()
                .into_iter()
                .flat_map(|i| [(i, w), (i, prepared.mat())])
            {
                let mut y = vec![0f32; n * rows];
                matmul(Some(&p), isa, w, &x, n, &mut y);
                for (g, e) in y.iter().zip(&want) {
                    assert!(
                        (*g as f64 - e).abs() <= 1e-4 * (1.0 + e.abs()),
                        "{:?} {isa:?} {rows}x{cols}: {g} vs {e}",
                        w.enc
                    );
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
    for dtype in ALL {
        let (rows, cols) = (203, 160);
        let mut rng = Rng(7);
        let m = random_matrix(&mut rng, dtype, rows, cols, 1.0);
        let w = Weight::prepare("w", &m).unwrap();
        let w = w.mat();
        let xs = rng.vec(70 * cols, 1.0);
        let mut alone = vec![0f32; rows];
        matmul(None, Isa::detect(), w, &xs[..cols], 1, &mut alone);
        for (threads, n) in [(1, 8), (2, 32), (2, 70), (3, 5)] {
            let p = pool(threads);
            let mut y = vec![0f32; n * rows];
            matmul(Some(&p), Isa::detect(), w, &xs[..n * cols], n, &mut y);
            assert!(
                alone
                    .iter()
                    .zip(&y[..rows])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{dtype:?} n={n}"
            );
        }
    }
}
