//! Compute kernels: quantized/dense matrix products, elementwise ops and
//! paged attention. Each kernel has a portable scalar form that defines its
//! exact floating-point result; the SIMD forms reproduce it bit for bit, so
//! the choice of [`Isa`] never changes a logit. [`Numerics::Fast`] swaps the
//! matmuls of quantized weights (every type) for int8-activation ones
//! (`int8.rs`), again one definition for every ISA, batch size and thread
//! count.

// The one map from a weight's [`weight::Encoding`] to its x86 block type,
// for the modules below (callers have `x86_blocks` and `Encoding` in scope).

/// `$go!(B)` with `B` the x86 `x86_int8::Int8Block` type of quantized
/// encoding `$enc` (a dense one has no integer dot: unreachable).
#[cfg(target_arch = "x86_64")]
macro_rules! for_int8_block {
    ($enc:expr, $go:ident) => {
        match $enc {
            Encoding::Q8_0 => $go!(x86_blocks::Q8_0B),
            Encoding::Q4_0 => $go!(x86_blocks::Q4_0B),
            Encoding::Q4_1 => $go!(x86_blocks::Q4_1B),
            Encoding::Q5_0 => $go!(x86_blocks::Q5_0B),
            Encoding::Q5_1 => $go!(x86_blocks::Q5_1B),
            Encoding::Q4K => $go!(x86_blocks::Q4KB),
            Encoding::Q5K => $go!(x86_blocks::Q5KB),
            Encoding::Q6K => $go!(x86_blocks::Q6KB),
            dense @ (Encoding::F32 | Encoding::F16 | Encoding::Bf16) => {
                unreachable!("{dense:?} has no integer dot")
            }
        }
    };
}

/// `$go!(B)` with `B` the x86 `x86_blocks::Block` type of encoding `$enc`.
#[cfg(target_arch = "x86_64")]
macro_rules! for_block {
    ($enc:expr, $go:ident) => {
        match $enc {
            Encoding::F32 => $go!(x86_blocks::F32B),
            Encoding::F16 => $go!(x86_blocks::F16B),
            Encoding::Bf16 => $go!(x86_blocks::Bf16B),
            quantized => for_int8_block!(quantized, $go),
        }
    };
}

pub mod attention;
pub mod coverage;
pub(crate) mod int8;
mod line_buf;
pub(crate) use line_buf::LineBuf;
pub mod matmul;
mod matmul_int8;
pub mod ops;
pub(crate) mod scalar;
pub mod weight;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_amx;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_blocks;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_gemv;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_gemv512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_int8;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_lanes;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_lanes_avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_lanes_stored;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_lanes_vnni;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_tile8;

use std::sync::OnceLock;

use crate::CpuError;

pub use int8::Numerics;
pub use matmul::{matmul, matmul_group, MatRef, MatmulJob};
pub use weight::{Encoding, Weight};

/// Hint the `floats` floats from `p` (a K or V row, a lane of matmul
/// outputs) into L1 (`HINT` = [`TO_L1`]) or L2 ([`TO_L2`]), a line every
/// 16 floats from `p`. A no-op off x86-64; never faults, whatever `p` is.
#[inline(always)]
pub(crate) fn prefetch_row<const HINT: i32>(p: *const f32, floats: usize) {
    #[cfg(target_arch = "x86_64")]
    for i in (0..floats).step_by(16) {
        // SAFETY: prefetch is a hint: it does not dereference
        // architecturally and cannot fault, so any address is fine.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(p.wrapping_add(i) as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, floats);
}

#[cfg(target_arch = "x86_64")]
pub(crate) use std::arch::x86_64::{_MM_HINT_T0 as TO_L1, _MM_HINT_T1 as TO_L2};
#[cfg(not(target_arch = "x86_64"))]
pub(crate) const TO_L1: i32 = 0;
#[cfg(not(target_arch = "x86_64"))]
pub(crate) const TO_L2: i32 = 0;

/// A raw output pointer shared by the tasks of one parallel region (the
/// matmuls' weight rows, attention's heads, `act_mul`'s ranges, a
/// prefill's activation blocks), each task writing elements that no other
/// task reads or writes.
#[derive(Debug)]
pub(crate) struct OutPtr<T = f32>(pub(crate) *mut T);
// SAFETY: every region that shares one hands its tasks disjoint elements of
// a buffer that it borrows mutably for longer than the region runs.
unsafe impl<T> Send for OutPtr<T> {}
// SAFETY: as above; no element is accessed by two tasks.
unsafe impl<T> Sync for OutPtr<T> {}

// By hand, not derived: a derive would ask `T: Copy` of the pointee.
impl<T> Clone for OutPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for OutPtr<T> {}

impl<T> OutPtr<T> {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    pub(crate) fn ptr(self) -> *mut T {
        self.0
    }
}

/// Which instruction set the matrix kernels use. All produce identical bits.
/// Ordered by capability: each ISA's CPUs also run the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Portable Rust; the definition of every kernel's result.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// [`Isa::Avx2`] with AVX-VNNI, the VEX `vpdpbusd` on 256-bit
    /// registers (Intel's client cores since Alder Lake, Sierra Forest:
    /// no AVX-512): the 8-lane int8 sweeps multiply with it, as AVX-512
    /// VNNI's do. Not implied by [`Isa::Avx512`] (Zen 4 and Ice Lake have
    /// AVX-512 VNNI but not AVX-VNNI), so it is granted on its own flag.
    AvxVnni,
    /// x86-64 AVX-512 F/BW (plus AVX2/FMA/F16C).
    Avx512,
    /// [`Isa::Avx512`] with AVX-512 VNNI and AMX-INT8 tiles the OS grants
    /// (Sapphire Rapids on, Linux): the 16-lane int8 sweeps run on tiles
    /// (`x86_amx.rs`).
    Amx,
}

impl Isa {
    /// The environment variable that forces an ISA: `scalar`, `avx2`,
    /// `avxvnni`, `avx512` or `amx`. Lets an AVX-512 machine measure the
    /// AVX2 kernels, or any machine the scalar definition.
    pub const ENV: &'static str = "KESTREL_ISA";

    /// The ISA the kernels use, decided once per process: [`Isa::ENV`] if
    /// set, else the best this CPU supports. A forced ISA the CPU lacks, or
    /// an unknown name, is a [`CpuError::Isa`] (cached: every call gives the
    /// same answer).
    pub fn try_detect() -> Result<Isa, CpuError> {
        static ISA: OnceLock<Result<Isa, IsaRequestError>> = OnceLock::new();
        ISA.get_or_init(|| match std::env::var(Self::ENV) {
            Ok(v) => Self::resolve(&v, Self::best_supported()),
            Err(_) => Ok(Self::best_supported()),
        })
        .clone()
        .map_err(CpuError::from)
    }

    /// As [`Isa::try_detect`], for callers with no error path (benches,
    /// tests, the sampler): a refused request is logged as a warning and the
    /// best supported ISA is used. [`crate::CpuModel::new`] refuses instead.
    pub fn detect() -> Isa {
        Self::try_detect().unwrap_or_else(|e| {
            let best = Self::best_supported();
            tracing::warn!(error = %e, using = ?best, "ignoring {}", Self::ENV);
            best
        })
    }

    /// The ISA a forced `value` of [`Isa::ENV`] names, on a CPU whose best
    /// ISA is `best`.
    pub fn resolve(value: &str, best: Isa) -> Result<Isa, IsaRequestError> {
        let isa = match value.trim().to_ascii_lowercase().as_str() {
            "scalar" => Isa::Scalar,
            "avx2" => Isa::Avx2,
            "avxvnni" => Isa::AvxVnni,
            "avx512" => Isa::Avx512,
            "amx" => Isa::Amx,
            _ => {
                return Err(IsaRequestError::Unknown {
                    value: value.to_owned(),
                })
            }
        };
        if isa > best {
            return Err(IsaRequestError::Unsupported {
                requested: isa,
                best,
            });
        }
        if isa == Isa::AvxVnni && !Self::has_avx_vnni() {
            return Err(IsaRequestError::NoAvxVnni);
        }
        Ok(isa)
    }

    /// Whether this CPU can run kernels of `self`.
    pub fn is_supported(self) -> bool {
        self <= Self::best_supported() && (self != Isa::AvxVnni || Self::has_avx_vnni())
    }

    /// Whether this CPU has the AVX-VNNI flag (AVX2 comes from the ladder:
    /// both callers have checked `AvxVnni` against the best ISA first).
    fn has_avx_vnni() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            x86_lanes::has_avx_vnni()
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    fn best_supported() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            if avx2 && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                if x86_lanes::has_avx512_vnni() && x86_amx::has_amx() {
                    return Isa::Amx;
                }
                return Isa::Avx512;
            }
            if avx2 {
                return if x86_lanes::has_avx_vnni() {
                    Isa::AvxVnni
                } else {
                    Isa::Avx2
                };
            }
        }
        Isa::Scalar
    }
}

/// Why a forced ISA ([`Isa::ENV`]) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IsaRequestError {
    #[error("{env}={value:?} names no ISA (scalar, avx2, avxvnni, avx512, amx)", env = Isa::ENV)]
    Unknown { value: String },
    #[error("{env} asks for {requested:?}, but this CPU supports at most {best:?}", env = Isa::ENV)]
    Unsupported { requested: Isa, best: Isa },
    #[error("{env} asks for AvxVnni, but this CPU has no AVX-VNNI (avxvnni)", env = Isa::ENV)]
    NoAvxVnni,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forced_isa_is_refused_above_the_cpu_and_parsed_by_name() {
        assert_eq!(Isa::resolve("avx2", Isa::Avx512), Ok(Isa::Avx2));
        assert_eq!(Isa::resolve(" AVX512 ", Isa::Avx512), Ok(Isa::Avx512));
        assert_eq!(Isa::resolve("scalar", Isa::Scalar), Ok(Isa::Scalar));
        assert_eq!(
            Isa::resolve("avx512", Isa::Avx2),
            Err(IsaRequestError::Unsupported {
                requested: Isa::Avx512,
                best: Isa::Avx2
            })
        );
        assert_eq!(
            Isa::resolve("avx2", Isa::Scalar),
            Err(IsaRequestError::Unsupported {
                requested: Isa::Avx2,
                best: Isa::Scalar
            })
        );
        assert!(matches!(
            Isa::resolve("sse4", Isa::Avx512),
            Err(IsaRequestError::Unknown { .. })
        ));
        // AVX-VNNI: above AVX2 on the ladder, and asked of the CPU's own
        // flag even under AVX-512 (Zen 4 has AVX-512 VNNI, not AVX-VNNI).
        assert_eq!(
            Isa::resolve("avxvnni", Isa::Avx2),
            Err(IsaRequestError::Unsupported {
                requested: Isa::AvxVnni,
                best: Isa::Avx2
            })
        );
        let want = if Isa::has_avx_vnni() {
            Ok(Isa::AvxVnni)
        } else {
            Err(IsaRequestError::NoAvxVnni)
        };
        assert_eq!(Isa::resolve("AvxVnni", Isa::Avx512), want);
        assert_eq!(Isa::AvxVnni.is_supported(), Isa::has_avx_vnni());
    }
}
