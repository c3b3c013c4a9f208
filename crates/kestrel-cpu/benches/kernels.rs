//! Matmul kernel benches at SmolLM2-135M shapes, weights prepared as the
//! model prepares them ([`kestrel_cpu::kernels::Weight`]): Q4_1 GEMV/GEMM
//! (FFN up 1536x576 and down 576x1536, and up as Q4_0) and the Q8_0 LM head 49152x576, at
//! batch 1, 8 and 32, on a compute [`kestrel_cpu::Team`] of `KESTREL_THREADS` (2).

mod common;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kestrel_cpu::kernels::{matmul, Weight};
use kestrel_cpu::synth::{random_matrix, Rng};
use kestrel_cpu::{Isa, Numerics};
use kestrel_model::DType;

fn bench(c: &mut Criterion) {
    let threads = common::threads();
    let pool = kestrel_cpu::Team::new(threads, "bench").unwrap();
    let mut rng = Rng(1);
    let shapes = [
        ("q4_1_up_1536x576", DType::Q4_1, 1536, 576),
        ("q4_0_up_1536x576", DType::Q4_0, 1536, 576),
        ("q4_1_down_576x1536", DType::Q4_1, 576, 1536),
        ("q8_0_lm_head_49152x576", DType::Q8_0, 49152, 576),
    ];
    let mut g = c.benchmark_group("matmul");
    for (name, dt, rows, cols) in shapes {
        let m = random_matrix(&mut rng, dt, rows, cols, 0.1);
        let w = Weight::prepare(name, &m).unwrap();
        let w = w.mat();
        for n in [1usize, 8, 32] {
            let x = rng.vec(n * cols, 1.0);
            let mut y = vec![0f32; n * rows];
            g.throughput(Throughput::Bytes(w.bytes() as u64));
            g.bench_with_input(BenchmarkId::new(name, n), &n, |b, &n| {
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
