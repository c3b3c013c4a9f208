//! Exact vs fast (int8-activation) numerics per matmul, at the default
//! model's (SmolLM2-135M Q4_1, Q8_0 head) shapes: hidden 576, intermediate
//! 1536, vocab 49152; and per other weight type at the shapes its
//! llama.cpp Q4_K_M requantization gives it (Q5_0 for the 576-column
//! matrices, Q4_K/Q6_K ffn_down), plus Q5_1/Q5_K at those shapes;
//! batch 1 (decode GEMV), 8 and 32 (the unpacked int8 GEMM, 4 x 8 tiles
//! on AVX-512 VNNI). Weights prepared as the
//! model prepares them; a compute [`kestrel_cpu::Team`] of `KESTREL_THREADS`
//! (2); the ISA is [`Isa::detect`] (force one with `KESTREL_ISA`) and is
//! part of the group name. Exact and fast of one shape run back to back.

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
    let isa = Isa::detect();
    let mut rng = Rng(1);
    let shapes = [
        ("q4_1_qo_576x576", DType::Q4_1, 576, 576),
        ("q4_1_up_1536x576", DType::Q4_1, 1536, 576),
        ("q4_1_down_576x1536", DType::Q4_1, 576, 1536),
        ("q8_0_lm_head_49152x576", DType::Q8_0, 49152, 576),
        ("q5_0_up_1536x576", DType::Q5_0, 1536, 576),
        ("q5_1_up_1536x576", DType::Q5_1, 1536, 576),
        ("q4_k_down_576x1536", DType::Q4K, 576, 1536),
        ("q5_k_down_576x1536", DType::Q5K, 576, 1536),
        ("q6_k_down_576x1536", DType::Q6K, 576, 1536),
    ];
    let mut g = c.benchmark_group(format!("numerics_{isa:?}").to_lowercase());
    g.warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    for (name, dt, rows, cols) in shapes {
        let m = random_matrix(&mut rng, dt, rows, cols, 0.1);
        let w = Weight::prepare(name, &m).unwrap();
        let w = w.mat();
        for n in [1usize, 8, 32] {
            let x = rng.vec(n * cols, 1.0);
            let mut y = vec![0f32; n * rows];
            g.throughput(Throughput::Bytes(w.bytes() as u64));
            for numerics in [Numerics::Exact, Numerics::Fast] {
                let id = format!("{name}/{numerics:?}").to_lowercase();
                g.bench_with_input(BenchmarkId::new(id, n), &n, |b, &n| {
                    b.iter(|| matmul(Some(&pool), isa, numerics, w, &x, n, &mut y))
                });
            }
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
