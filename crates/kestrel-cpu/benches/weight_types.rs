//! Matmul per weight type: every dtype the kernels read, prepared as the
//! model prepares it ([`kestrel_cpu::kernels::Weight`]), at one shape that
//! tiles both 32- and 256-element blocks (1536x768, the FFN-up shape of a
//! SmolLM2/Gemma-3-size model), GEMV (batch 1) and batch-32 GEMM, on a
//! compute [`kestrel_cpu::Team`] of `KESTREL_THREADS` (2). Figures:
//! `docs/bench/notes/2026-11-23-weight-types.md`.

mod common;

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kestrel_cpu::kernels::{matmul, Weight};
use kestrel_cpu::synth::{random_matrix, Rng};
use kestrel_cpu::{Isa, Numerics, SUPPORTED_DTYPES};

fn bench(c: &mut Criterion) {
    let threads = common::threads();
    let pool = kestrel_cpu::Team::new(threads, "bench").unwrap();
    let mut rng = Rng(1);
    let (rows, cols) = (1536, 768);
    let mut g = c.benchmark_group("weight_types");
    g.warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    for dt in SUPPORTED_DTYPES {
        let m = random_matrix(&mut rng, dt, rows, cols, 0.1);
        let w = Weight::prepare(dt.name(), &m).unwrap();
        let w = w.mat();
        for n in [1usize, 32] {
            let x = rng.vec(n * cols, 1.0);
            let mut y = vec![0f32; n * rows];
            g.throughput(Throughput::Elements((n * rows * cols) as u64));
            g.bench_with_input(BenchmarkId::new(dt.name(), n), &n, |b, &n| {
                b.iter(|| {
                    matmul(
                        Some(&pool),
                        Isa::detect(),
                        Numerics::Exact,
                        w,
                        &x,
                        n,
                        &mut y,
                    )
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
