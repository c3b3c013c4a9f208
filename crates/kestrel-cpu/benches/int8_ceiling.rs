//! The machine's ceiling for int8 multiply-adds on AVX2 and on AVX-512
//! VNNI: how many a second its cores can issue at all, the figure the
//! many-row lane sweeps (and any peer's kernels) are judged against, as
//! `gemv_dram` judges the GEMVs against DRAM.
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
//!
//! With AVX-512 VNNI, two more: `vpdpbusd` on 512-bit registers alone (64
//! multiply-adds each, accumulating; twelve independent chains, since one
//! takes about six cycles and a core issues two a cycle: with eight or ten
//! chains the loop measures their latency, not the pipes), and the same
//! `vpdpbusd`s with the float steps the fast numerics' definition adds in
//! the 16-lane sweeps: per 32-element block of each (weight row, lane
//! group), eight `vpdpbusd`, one `vcvtdq2ps`, one `vmulps` (`d_w * d_x`)
//! and two FMAs (the scaled sum, the minimum's): twelve vector operations
//! where the multiplies alone are eight. Where the float operations share
//! the multiplying pipes (on an Emerald Rapids Xeon this loop runs at two
//! thirds of the bare one), it is the most a sweep of the definition can
//! retire, the figure `gemm`'s many-row Q4_K rates are judged against.

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

    /// [`super::TRIPS`] trips of the loop body `$body` (assembly lines
    /// after a `2:` label), after the set-up lines `$setup`: the trip
    /// counter, the clobbers and the options every loop here shares.
    /// Expands to an `unsafe` block: the caller's CPU must support every
    /// instruction in it.
    macro_rules! trips {
        ([$($setup:expr),* $(,)?], [$($body:expr),* $(,)?]) => {
            // SAFETY: register-only arithmetic (the CPU supports it: the
            // caller's contract); the registers written are vector ones,
            // which the SysV ABI's clobber set declares all clobbered (on
            // any target), and the loop counter (`rcx`) is an in-out
            // operand.
            unsafe {
                asm!(
                    $($setup,)*
                    "2:",
                    $($body,)*
                    "dec rcx",
                    "jnz 2b",
                    inout("rcx") super::TRIPS => _,
                    clobber_abi("sysv64"),
                    options(nostack, nomem),
                )
            }
        };
    }

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
        trips!(
            ["vpxor ymm0, ymm0, ymm0", "vpxor ymm1, ymm1, ymm1"],
            [
                product_add!(2, 10),
                product_add!(3, 11),
                product_add!(4, 12),
                product_add!(5, 13),
                product_add!(6, 14),
                product_add!(7, 15),
                product_add!(8, 10),
                product_add!(9, 11),
            ]
        );
    }

    /// Twelve independent `vpdpbusd` into `zmm2..=zmm13`.
    macro_rules! twelve_dpbusd {
        () => {
            concat!(
                "vpdpbusd zmm2, zmm0, zmm1\n",
                "vpdpbusd zmm3, zmm0, zmm1\n",
                "vpdpbusd zmm4, zmm0, zmm1\n",
                "vpdpbusd zmm5, zmm0, zmm1\n",
                "vpdpbusd zmm6, zmm0, zmm1\n",
                "vpdpbusd zmm7, zmm0, zmm1\n",
                "vpdpbusd zmm8, zmm0, zmm1\n",
                "vpdpbusd zmm9, zmm0, zmm1\n",
                "vpdpbusd zmm10, zmm0, zmm1\n",
                "vpdpbusd zmm11, zmm0, zmm1\n",
                "vpdpbusd zmm12, zmm0, zmm1\n",
                "vpdpbusd zmm13, zmm0, zmm1\n",
            )
        };
    }

    /// [`super::TRIPS`] trips of twelve independent `vpdpbusd` on 512-bit
    /// registers.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and AVX-512 VNNI.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub unsafe fn dpbusd_only() {
        trips!(
            ["vpxord zmm0, zmm0, zmm0", "vpxord zmm1, zmm1, zmm1"],
            [twelve_dpbusd!()]
        );
    }

    /// [`super::TRIPS`] trips of [`dpbusd_only`]'s twelve `vpdpbusd` chains
    /// twice over (three blocks' worth at eight a block), with the
    /// definition's float steps for those three blocks: three `vcvtdq2ps`
    /// of sums, three `vmulps` (`d_w * d_x`), three FMAs into scaled sums
    /// and three into minimums'.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and AVX-512 VNNI.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub unsafe fn dpbusd_float_steps() {
        trips!(
            [
                "vpxord zmm0, zmm0, zmm0",
                "vpxord zmm1, zmm1, zmm1",
                "vxorps zmm14, zmm14, zmm14",
                "vxorps zmm15, zmm15, zmm15",
                "vxorps zmm16, zmm16, zmm16",
                "vxorps zmm17, zmm17, zmm17",
                "vxorps zmm18, zmm18, zmm18",
                "vxorps zmm19, zmm19, zmm19",
            ],
            [
                twelve_dpbusd!(),
                "vcvtdq2ps zmm20, zmm2",
                "vcvtdq2ps zmm21, zmm3",
                "vcvtdq2ps zmm22, zmm4",
                "vmulps zmm23, zmm1, zmm0",
                "vmulps zmm24, zmm1, zmm0",
                "vmulps zmm25, zmm1, zmm0",
                twelve_dpbusd!(),
                "vfmadd231ps zmm14, zmm20, zmm23",
                "vfmadd231ps zmm15, zmm21, zmm24",
                "vfmadd231ps zmm16, zmm22, zmm25",
                "vfmadd231ps zmm17, zmm0, zmm1",
                "vfmadd231ps zmm18, zmm0, zmm1",
                "vfmadd231ps zmm19, zmm0, zmm1",
            ]
        );
    }

    /// [`super::TRIPS`] trips of eight independent `vpmaddubsw`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn products_only() {
        trips!(
            ["vpxor ymm0, ymm0, ymm0", "vpxor ymm1, ymm1, ymm1"],
            [
                "vpmaddubsw ymm2, ymm0, ymm1",
                "vpmaddubsw ymm3, ymm0, ymm1",
                "vpmaddubsw ymm4, ymm0, ymm1",
                "vpmaddubsw ymm5, ymm0, ymm1",
                "vpmaddubsw ymm6, ymm0, ymm1",
                "vpmaddubsw ymm7, ymm0, ymm1",
                "vpmaddubsw ymm8, ymm0, ymm1",
                "vpmaddubsw ymm9, ymm0, ymm1",
            ]
        );
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
    let vnni = std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512vnni");
    // Multiply-adds per trip: 12 or 24 `vpdpbusd` of 64 each.
    let vnni_loops: [(&str, unsafe fn(), u64); 2] = [
        ("vpdpbusd-zmm", loops::dpbusd_only, 12 * 64),
        (
            "vpdpbusd-zmm+float-steps",
            loops::dpbusd_float_steps,
            24 * 64,
        ),
    ];
    for (name, f, per_trip) in vnni_loops.into_iter().filter(|_| vnni) {
        for &n in &counts {
            g.throughput(Throughput::Elements(TRIPS as u64 * per_trip * n as u64));
            g.bench_with_input(BenchmarkId::new(name, format!("{n}t")), &n, |b, &n| {
                // SAFETY: AVX-512F and AVX-512 VNNI were detected above.
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
