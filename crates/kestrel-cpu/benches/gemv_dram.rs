//! Decode's matmuls at a real size, streaming from DRAM: the FFN-up and
//! FFN-down shapes of a Llama 3.2 1B layer (8192x2048, 2048x8192),
//! repeated in distinct buffers until the set outgrows every cache (256 MiB
//! or more), each pass one matmul per matrix in turn as a decode step runs
//! them, fast numerics, on a compute [`kestrel_cpu::Team`] of
//! `KESTREL_THREADS` (2), against one activation row (`1x`, the GEMV of one
//! stream) and eight (`8x`, eight streams' lane sweep). Throughput is the weights' bytes per second: against the
//! machine's read bandwidth it says how close a decode step comes to the
//! DRAM floor. With `GEMV_IN_CACHE=1` the set is one pair of 192x2048
//! matrices (0.3-0.9 MB, in L2 with `KESTREL_THREADS=1`): the kernels'
//! compute rate without DRAM, which says whether a type is bound by
//! memory or by its decode. The set sits on huge pages as the engine's
//! weights do (`WeightPages::Huge`); `GEMV_PAGES=mapped` leaves it on 4 KiB
//! pages, as a file's mapping is. (A larger set sat in L3, which a 2-vCPU VM's
//! neighbours share: on a Zen 4 it read at about the DRAM rate.)

mod common;

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kestrel_cpu::kernels::{matmul, Weight};
use kestrel_cpu::synth::{random_matrix, Rng};
use kestrel_cpu::{Isa, Numerics, WeightPages};
use kestrel_model::{Bytes, DType, Matrix};

/// Bytes of weights one pass streams, at least.
const SET_BYTES: usize = 256 << 20;

fn bench(c: &mut Criterion) {
    let threads = common::threads();
    let pool = kestrel_cpu::Team::new(threads, "bench").unwrap();
    let mut rng = Rng(7);
    let in_cache = std::env::var_os("GEMV_IN_CACHE").is_some();
    let pages = match std::env::var("GEMV_PAGES").as_deref() {
        Ok("mapped") => WeightPages::InPlace,
        _ => WeightPages::Huge,
    };
    let mut g = c.benchmark_group("gemv_dram");
    g.warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
        .sample_size(10);
    for dt in [
        DType::Q4K,
        DType::Q6K,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
    ] {
        let shapes = if in_cache {
            [(192, 2048), (192, 2048)]
        } else {
            [(8192, 2048), (2048, 8192)]
        };
        let protos: Vec<Matrix> = shapes
            .iter()
            .map(|&(r, c)| random_matrix(&mut rng, dt, r, c, 0.05))
            .collect();
        let pair_bytes: usize = protos.iter().map(|m| m.rows * m.row_bytes()).sum();
        let copies = if in_cache {
            1
        } else {
            SET_BYTES.div_ceil(pair_bytes)
        };
        // Distinct buffers of the same blocks: every pass reads DRAM (but
        // in cache), placed as the engine places a model's weights.
        let mut owned: Vec<Matrix> = (0..copies)
            .flat_map(|_| protos.iter())
            .map(|m| Matrix {
                data: Bytes::Owned(Arc::from(&m.data[..])),
                ..m.clone()
            })
            .collect();
        pages
            .place(&mut owned.iter_mut().map(|m| &mut m.data).collect::<Vec<_>>())
            .unwrap();
        let set: Vec<Weight> = owned
            .iter()
            .map(|m| Weight::prepare("w", m).unwrap())
            .collect();
        for n in [1, 8] {
            let x: Vec<Vec<f32>> = shapes.iter().map(|&(_, c)| rng.vec(n * c, 1.0)).collect();
            let mut y = vec![0f32; n * 8192];
            g.throughput(Throughput::Bytes((copies * pair_bytes) as u64));
            g.bench_function(BenchmarkId::new(dt.name(), format!("{n}x")), |b| {
                b.iter(|| {
                    for (i, w) in set.iter().enumerate() {
                        let w = w.mat();
                        matmul(
                            Some(&pool),
                            Isa::detect(),
                            Numerics::Fast,
                            w,
                            &x[i % 2],
                            n,
                            &mut y[..n * w.rows],
                        );
                    }
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
