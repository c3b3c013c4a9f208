//! Compute kernels: quantized/dense matrix products, elementwise ops and
//! paged attention. Each kernel has a portable scalar form that defines its
//! exact floating-point result; the SIMD forms reproduce it bit for bit, so
//! the choice of [`Isa`] never changes a logit.

pub mod attention;
pub mod matmul;
pub mod ops;
pub(crate) mod scalar;
pub mod weight;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

use std::sync::OnceLock;

pub use matmul::{matmul, matmul_group, MatRef, MatmulJob};
pub use weight::{Encoding, Weight};

/// Which instruction set the matrix kernels use. All produce identical bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust; the definition of every kernel's result.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 F/BW (plus AVX2/FMA/F16C).
    Avx512,
}

impl Isa {
    /// The best ISA this CPU supports, detected once. `KESTREL_CPU_ISA`
    /// (`scalar`, `avx2`, `avx512`) lowers it, for testing and comparisons.
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let best = Self::best_supported();
            match std::env::var("KESTREL_CPU_ISA").as_deref() {
                Ok("scalar") => Isa::Scalar,
                Ok("avx2") if best != Isa::Scalar => Isa::Avx2,
                _ => best,
            }
        })
    }

    /// Whether this CPU can run kernels of `self`.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => matches!(Self::best_supported(), Isa::Avx2 | Isa::Avx512),
            Isa::Avx512 => Self::best_supported() == Isa::Avx512,
        }
    }

    fn best_supported() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            if avx2 && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                return Isa::Avx512;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }
}
