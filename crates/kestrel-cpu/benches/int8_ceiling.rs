//! The machine's ceiling for int8 multiply-adds on AVX2: how many a second
//! its cores can issue at all, the figure the many-row lane sweeps (and any
//! peer's AVX2 kernels) are judged against, as `gemv_dram` judges the
//! GEMVs against DRAM.
//!
//! AVX2's widest integer product is `vpmaddubsw` (32 byte products summed
//! in pairs to 16 i16 lanes); it cannot accumulate, so `n` of them need at
//! least `n - 1` further operations to be summed. Two register-only loops,
//! eight independent chains each, no memory: `vpmaddubsw` alone (the
//! absolute ceiling) and `vpmaddubsw` + `vpaddw` (the ceiling of any design
//! that sums its products). Throughput is multiply-adds per second, on one
//! thread and on a [`kestrel_cpu::Team`] of `KESTREL_THREADS` (2); where
//! the two agree, the threads share one core's vector units. On
//! AVX-512 machines the loops still run (AVX2 is a subset); elsewhere the
//! bench is empty.

mod common;

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// Loop trips per call (8 products of 32 multiply-adds each per trip).
const TRIPS: usize = 1 << 20;
/// Multiply-adds one call issues.
const MACS: u64 = (TRIPS * 8 * 32) as u64;

#[cfg(target_arch = "x86_64")]
mod loops {
    use std::arch::asm;

    /// One `vpmaddubsw` into `ymm{t}`, added into accumulator `ymm{acc}`.
    macro_rules! product_add {
        ($acc:literal, $t:literal) => {
            concat!(
                "vpmaddubsw ymm",
                $t,
                ", ymm0, ymm1\n",
                "vpaddw ymm",
                $acc,
                ", ymm",
                $acc,
                ", ymm",
                $t,
                "\n"
            )
        };
    }

    /// [`super::TRIPS`] trips of eight `vpmaddubsw` + `vpaddw` pairs on
    /// eight accumulators.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn products_summed() {
        // SAFETY: register-only AVX2 arithmetic (the CPU has AVX2: fn
        // contract); every register written is declared clobbered, and the
        // loop counter is an in-out operand.
        unsafe {
            asm!(
                "vpxor ymm0, ymm0, ymm0",
                "vpxor ymm1, ymm1, ymm1",
                "2:",
                product_add!(2, 10),
                product_add!(3, 11),
                product_add!(4, 12),
                product_add!(5, 13),
                product_add!(6, 14),
                product_add!(7, 15),
                product_add!(8, 10),
                product_add!(9, 11),
                "dec {n}",
                "jnz 2b",
                n = inout(reg) super::TRIPS => _,
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
                options(nostack, nomem),
            );
        }
    }

    /// [`super::TRIPS`] trips of eight independent `vpmaddubsw`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn products_only() {
        // SAFETY: as in `products_summed`.
        unsafe {
            asm!(
                "vpxor ymm0, ymm0, ymm0",
                "vpxor ymm1, ymm1, ymm1",
                "2:",
                "vpmaddubsw ymm2, ymm0, ymm1",
                "vpmaddubsw ymm3, ymm0, ymm1",
                "vpmaddubsw ymm4, ymm0, ymm1",
                "vpmaddubsw ymm5, ymm0, ymm1",
                "vpmaddubsw ymm6, ymm0, ymm1",
                "vpmaddubsw ymm7, ymm0, ymm1",
                "vpmaddubsw ymm8, ymm0, ymm1",
                "vpmaddubsw ymm9, ymm0, ymm1",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) super::TRIPS => _,
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                out("ymm8") _, out("ymm9") _,
                options(nostack, nomem),
            );
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn bench(c: &mut Criterion) {
    if !std::arch::is_x86_feature_detected!("avx2") {
        return;
    }
    let threads = common::threads();
    let pool = kestrel_cpu::Team::new(threads, "bench").unwrap();
    let mut g = c.benchmark_group("int8_ceiling");
    g.warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10);
    let loops: [(&str, unsafe fn()); 2] = [
        ("vpmaddubsw", loops::products_only),
        ("vpmaddubsw+vpaddw", loops::products_summed),
    ];
    let mut counts = vec![1, threads];
    counts.dedup();
    for (name, f) in loops {
        for &n in &counts {
            g.throughput(Throughput::Elements(MACS * n as u64));
            g.bench_with_input(BenchmarkId::new(name, format!("{n}t")), &n, |b, &n| {
                // SAFETY: AVX2 was detected above.
                b.iter(|| pool.for_each(n, |_| unsafe { f() }))
            });
        }
    }
    g.finish();
}

#[cfg(not(target_arch = "x86_64"))]
fn bench(_: &mut Criterion) {}

criterion_group!(benches, bench);
criterion_main!(benches);
