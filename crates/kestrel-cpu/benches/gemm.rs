//! Many-row matmuls at a real size: the FFN-up shape of a Llama 3.2 1B
//! layer (8192x2048) in the types a Q4_K_M and a Q8_0 file hold, against
//! 8 and 32 activation rows (batched decode) and 512 (a pp512 prefill),
//! and (`gemm_8b_down`) the FFN-down shape of a Llama 3.1 8B layer
//! (4096x14336, rows long enough to be swept a chunk of blocks at a time)
//! against 512,
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
    // Group name, rows, columns, types, activation rows.
    type Case = (
        &'static str,
        usize,
        usize,
        &'static [DType],
        &'static [usize],
    );
    let cases: [Case; 2] = [
        (
            "gemm",
            8192,
            2048,
            &[DType::Q4K, DType::Q6K, DType::Q8_0],
            &[8, 32, 512],
        ),
        (
            "gemm_8b_down",
            4096,
            14336,
            &[DType::Q4K, DType::Q6K],
            &[512],
        ),
    ];
    for (name, rows, cols, types, ns) in cases {
        let mut g = c.benchmark_group(name);
        g.warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(4))
            .sample_size(10);
        for &dt in types {
            let m = random_matrix(&mut rng, dt, rows, cols, 0.05);
            let w = Weight::prepare("w", &m).unwrap();
            let w = w.mat();
            for &n in ns {
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
}

criterion_group!(benches, bench);
criterion_main!(benches);
