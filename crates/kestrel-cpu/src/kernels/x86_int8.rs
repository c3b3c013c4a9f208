//! AVX2 form of the fast numerics (`int8.rs` defines the results): the
//! activation quantizer, and sweeps of `R x NB` tiles over the same
//! [`Block`] types and tile shape as the f32 kernels in `x86.rs`, with the
//! weights unpacked to bytes instead of floats and `vpmaddubsw`/`vpmaddwd`
//! integer dots. Lane `l` of a 256-bit i32 sum holds elements `4l..4l+4`,
//! exactly the scalar definition's lane, so results are bit-identical to it.

use std::arch::x86_64::*;

use super::int8::Q8Block;
use super::x86::{
    nibble_bytes256, prefetch, scales, Block, PREFETCH_TILES, Q4_0B, Q4_0FB, Q4_1B, Q4_1FB, Q8_0B,
};

/// A weight block with an integer dot: its 32 weights as bytes in element
/// order, its scale and its minimum (0 when none).
pub(crate) trait Int8Block: Block {
    /// Whether the weight bytes are signed (Q8_0, Q4_0's `q - 8`) or not
    /// (Q4_1's nibbles).
    const SIGNED: bool;
    /// Whether the block has a minimum (`m_w * s_x` is then added).
    const HAS_MIN: bool;
    /// # Safety
    /// `p` must be valid for reading `Self::BYTES` bytes; the CPU must support
    /// AVX2, FMA and F16C.
    unsafe fn int8(p: *const u8) -> (__m256i, f32, f32);
}

/// The f32 at `p`.
///
/// # Safety
/// `p` must be valid for reading 4 bytes.
#[inline(always)]
unsafe fn f32_at(p: *const u8) -> f32 {
    // SAFETY: 4 readable bytes at `p` (fn contract); unaligned read.
    unsafe { (p as *const f32).read_unaligned() }
}

impl Int8Block for Q8_0B {
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn int8(p: *const u8) -> (__m256i, f32, f32) {
        // SAFETY: 34 readable bytes at `p` (trait contract): f16 d + 32 i8.
        unsafe {
            let q = _mm256_loadu_si256(p.add(2) as *const __m256i);
            (q, _mm_cvtss_f32(scales(p)), 0.0)
        }
    }
}

impl Int8Block for Q4_0B {
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn int8(p: *const u8) -> (__m256i, f32, f32) {
        // SAFETY: 18 readable bytes at `p` (trait contract): f16 d + 16 nibble bytes.
        unsafe {
            let q = _mm256_sub_epi8(nibble_bytes256(p.add(2)), _mm256_set1_epi8(8));
            (q, _mm_cvtss_f32(scales(p)), 0.0)
        }
    }
}

impl Int8Block for Q4_0FB {
    const SIGNED: bool = true;
    const HAS_MIN: bool = false;
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn int8(p: *const u8) -> (__m256i, f32, f32) {
        // SAFETY: 20 readable bytes at `p` (trait contract): f32 d + 16 nibble bytes.
        unsafe {
            let q = _mm256_sub_epi8(nibble_bytes256(p.add(4)), _mm256_set1_epi8(8));
            (q, f32_at(p), 0.0)
        }
    }
}

impl Int8Block for Q4_1B {
    const SIGNED: bool = false;
    const HAS_MIN: bool = true;
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn int8(p: *const u8) -> (__m256i, f32, f32) {
        // SAFETY: 20 readable bytes at `p` (trait contract): f16 d, m + 16 nibble bytes.
        unsafe {
            let dm = scales(p);
            let m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
            (nibble_bytes256(p.add(4)), _mm_cvtss_f32(dm), m)
        }
    }
}

impl Int8Block for Q4_1FB {
    const SIGNED: bool = false;
    const HAS_MIN: bool = true;
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn int8(p: *const u8) -> (__m256i, f32, f32) {
        // SAFETY: 24 readable bytes at `p` (trait contract): f32 d, f32 m + 16 nibble bytes.
        unsafe { (nibble_bytes256(p.add(8)), f32_at(p), f32_at(p.add(4))) }
    }
}

/// Quantize `nblocks` blocks of activations at `x` into `out` (the scalar
/// definition's values for finite inputs: `vcvtps2dq` rounds to nearest
/// even under the default MXCSR, as `round_ties_even`).
///
/// # Safety
/// `x` valid for `32 * nblocks` floats, `out` for `nblocks` blocks; the CPU
/// must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_row256(x: *const f32, nblocks: usize, out: *mut Q8Block) {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    // vpackssdw / vpacksswb interleave 128-bit lanes; this undoes it.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..nblocks {
        // SAFETY: floats 32b..32b + 32 are in bounds (fn contract).
        let v: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.add(32 * b + 8 * i)) });
        let a = v.map(|v| _mm256_and_ps(v, abs_mask));
        let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d == 0.0 { 0.0 } else { 1.0 / d });
        let q = v.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, id)));
        // |q| <= 127: the saturating packs are exact.
        let q16 = (
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16.0, q16.1), order);
        let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)));
        // SAFETY: block `b` of `out` is in bounds (fn contract); `q` is at
        // offset 8 of the `repr(C)` block and 32 bytes long.
        unsafe {
            let o = out.add(b);
            (*o).d = d;
            (*o).s = d * s as f32;
            _mm256_storeu_si256((*o).q.as_mut_ptr() as *mut __m256i, q8);
        }
    }
}

/// Pointers and strides of an int8 sweep.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Int8Args {
    /// First weight row of the sweep.
    pub w: *const u8,
    /// Bytes between consecutive weight rows.
    pub row_bytes: usize,
    /// First quantized activation row of the tile.
    pub x: *const Q8Block,
    /// Blocks per activation row (= weight blocks per row).
    pub nblocks: usize,
}

/// The canonical 8-lane tree (`int8::reduce8`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn reduce8(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v)); // l + (l+4)
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4)); // + (l+2)
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2))) // + (l+1)
}

/// `tiles` consecutive `R`-row weight tiles against `NB` quantized
/// activation rows: element `(r, c)` of the sweep (weight row `r` from
/// `a.w`, activation row `c` from `a.x`) goes to `y[c * y_stride + r]`.
///
/// # Safety
/// `a.w` must be valid for `R * tiles` rows of `a.nblocks` blocks of `B`,
/// `a.x` for `NB` rows of `a.nblocks` blocks, `y` for writing every element
/// above; the CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn int8_sweep256<B: Int8Block, const R: usize, const NB: usize>(
    a: Int8Args,
    tiles: usize,
    y: *mut f32,
    y_stride: usize,
) {
    let ones = _mm256_set1_epi16(1);
    let step = R * B::BYTES;
    for t in 0..tiles {
        // SAFETY: rows R t..R t + R are in bounds (fn contract).
        let w = unsafe { a.w.add(R * t * a.row_bytes) };
        let ahead = w.wrapping_add(PREFETCH_TILES * R * a.row_bytes);
        let mut acc = [[_mm256_setzero_ps(); NB]; R];
        let mut mins = [[0f32; NB]; R];
        for blk in 0..a.nblocks {
            // Every line of the tile's next-but-`PREFETCH_TILES` blocks.
            for line in 0..step.div_ceil(64) {
                prefetch(ahead.wrapping_add(blk * step + 64 * line));
            }
            for (r, (acc_r, mins_r)) in acc.iter_mut().zip(mins.iter_mut()).enumerate() {
                // SAFETY: block `blk` of row `r` lies within the sweep (fn contract).
                let (wq, dw, mw) = unsafe { B::int8(w.add(r * a.row_bytes + blk * B::BYTES)) };
                // Signed weights: |w| times x with w's sign (vpmaddubsw
                // multiplies unsigned by signed bytes; |w| <= 128, |x| <=
                // 127, so no pair sum saturates).
                let wu = if B::SIGNED {
                    _mm256_sign_epi8(wq, wq)
                } else {
                    wq
                };
                for c in 0..NB {
                    // SAFETY: block `blk` of activation row `c` is in bounds.
                    let xb = unsafe { &*a.x.add(c * a.nblocks + blk) };
                    // SAFETY: `q` is 32 readable bytes.
                    let xq = unsafe { _mm256_loadu_si256(xb.q.as_ptr() as *const __m256i) };
                    let xs = if B::SIGNED {
                        _mm256_sign_epi8(xq, wq)
                    } else {
                        xq
                    };
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xs), ones);
                    let dd = _mm256_set1_ps(dw * xb.d);
                    acc_r[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dd, acc_r[c]);
                    // Without a minimum the definition's sum stays +0.0.
                    if B::HAS_MIN {
                        mins_r[c] = mw.mul_add(xb.s, mins_r[c]);
                    }
                }
            }
        }
        for r in 0..R {
            for c in 0..NB {
                // SAFETY: element (R t + r, c) is in bounds (fn contract).
                unsafe { *y.add(c * y_stride + R * t + r) = reduce8(acc[r][c]) + mins[r][c] };
            }
        }
    }
}
