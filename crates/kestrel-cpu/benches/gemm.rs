//! Many-row matmuls at a real size: the FFN-up shape of a Llama 3.2 1B
//! layer (8192x2048) in the types a Q4_K_M and a Q8_0 file hold, against
//! 8 and 32 activation rows (batched decode) and 512 (a pp512 prefill),
//! fast numerics, on a compute [`kestrel_cpu::Team`] of `KESTREL_THREADS`
//! (2). Throughput is multiply-adds per second (criterion's "elem/s"):
//! these shapes are bound by the kernels' arithmetic, not by DRAM, so the
//! figure against the cores' clock says how many int8 products a cycle
//! the lane sweeps retire.

mod common;

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kestrel_cpu::kernels::{matmul, Weight};
use kestrel_cpu::synth::{random_matrix, Rng};
use kestrel_cpu::{Isa, Numerics};
use kestrel_model::DType;

fn bench(c: &mut Criterion) {
    let threads = common::threads();
    let pool = kestrel_cpu::Team::new(threads, "bench").unwrap();
    let mut rng = Rng(11);
    let (rows, cols) = (8192, 2048);
    let mut g = c.benchmark_group("gemm");
    g.warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
        .sample_size(10);
    for dt in [DType::Q4K, DType::Q6K, DType::Q8_0] {
        let m = random_matrix(&mut rng, dt, rows, cols, 0.05);
        let w = Weight::prepare("w", &m).unwrap();
        let w = w.mat();
        for n in [8usize, 32, 512] {
            let x = rng.vec(n * cols, 1.0);
            let mut y = vec![0f32; n * rows];
            g.throughput(Throughput::Elements((rows * cols * n) as u64));
            g.bench_with_input(BenchmarkId::new(dt.name(), n), &n, |b, &n| {
                b.iter(|| matmul(Some(&pool), Isa::detect(), Numerics::Fast, w, &x, n, &mut y))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
