//! The lane sweep on AVX2 ([`lanes_sweep256`]): weight rows unpacked to
//! [`I8Block`]s swept against one 8-lane group of [`LaneRows`], the
//! unsigned weights `w + offset` against `x` with `vpmaddubsw`, and for
//! Q8_0 rows none of whose weights is -128 the activations' magnitude
//! against the weights with their sign ([`lanes_sweep256_absx`]). Results
//! are `int8.rs`'s definition bit for bit (tests in `x86_int8.rs`).
//!
//! [`LaneRows`]: super::int8::LaneRows

use std::arch::x86_64::*;

use super::x86_int8::Int8Block;
use super::x86_lanes::{store_tile8, I8Block, LaneArgs};

/// `tiles` consecutive `R`-row tiles of unpacked weight rows (`w`, row
/// after row, `nblocks` blocks each) against one 8-lane group of
/// [`LaneRows`] (`x`; lanes `0..cn` written): element `(r, c)` goes to
/// `y[c * y_stride + r]`.
///
/// A register tile of `R x 8` outputs: per block and four-element step,
/// the group's activations are loaded once for the tile's rows and each
/// row's four weight bytes broadcast against them (`vpmaddubsw`): the
/// unsigned weights `w + offset` ([`Int8Block::LANE_OFFSET`]) against `x`,
/// the sums starting at `-offset * sum(x)` (once per block for the tile);
/// for Q8_0 the weights' magnitude against `x` with their sign.
/// [`Int8Block::LANE_STEPS`] products add in i16 before `vpmaddwd` widens
/// them; each block's sums then take the definition's float step lane by
/// lane, and the minimums' sum (a sum of its own) runs in a second pass
/// over the tile's blocks.
///
/// # Safety
/// `w` must be valid for `R * tiles * nblocks` blocks unpacked from `B`
/// (not `VNNI`), `x` for `nblocks` blocks of an 8-lane group, `y` for
/// writing every element `(r, c < cn)`; `cn <= 8`; the CPU must support
/// AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn lanes_sweep256<B: Int8Block, const R: usize>(
    w: *const I8Block,
    nblocks: usize,
    tiles: usize,
    x: LaneArgs,
    cn: usize,
    y: *mut f32,
    y_stride: usize,
) {
    // SAFETY: forwarded contract.
    unsafe { sweep256::<B, R, false>(w, nblocks, tiles, x, cn, y, y_stride) }
}

/// [`lanes_sweep256`] for Q8_0 rows none of whose weights is -128 (what
/// [`unpack_rows256`] reports): the activations' magnitude `|x|` (once per
/// step for the tile) against each row's weights with the activations'
/// sign, `w * sgn(x)`, which fits a signed byte when `w > -128`. One sign
/// step per product where [`lanes_sweep256`] takes two (`|w|` and
/// `x * sgn(w)`); the pair sums stay below `2 * 127 * 127`.
///
/// # Safety
/// As [`lanes_sweep256`], `B` Q8_0 and no weight of the unpacked rows -128.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn lanes_sweep256_absx<B: Int8Block, const R: usize>(
    w: *const I8Block,
    nblocks: usize,
    tiles: usize,
    x: LaneArgs,
    cn: usize,
    y: *mut f32,
    y_stride: usize,
) {
    debug_assert!(B::SIGNED && B::LANE_OFFSET == 0);
    // SAFETY: forwarded contract.
    unsafe { sweep256::<B, R, true>(w, nblocks, tiles, x, cn, y, y_stride) }
}

/// The AVX2 lane sweep ([`lanes_sweep256`]; with `ABS_X`
/// [`lanes_sweep256_absx`]).
///
/// # Safety
/// As [`lanes_sweep256`]; with `ABS_X`, as [`lanes_sweep256_absx`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn sweep256<B: Int8Block, const R: usize, const ABS_X: bool>(
    w: *const I8Block,
    nblocks: usize,
    tiles: usize,
    x: LaneArgs,
    cn: usize,
    y: *mut f32,
    y_stride: usize,
) {
    debug_assert!(cn <= 8);
    let ones = _mm256_set1_epi16(1);
    let offset = B::LANE_OFFSET;
    let neg_offset = _mm256_set1_epi32(-offset);
    let signed = B::SIGNED && offset == 0;
    for t in 0..tiles {
        // SAFETY: rows R t..R t + R are in bounds (fn contract).
        let wt = unsafe { w.add(R * t * nblocks) };
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nblocks {
            // SAFETY: block `b` of each row of the tile is in bounds.
            let blk: [&I8Block; R] = std::array::from_fn(|r| unsafe { &*wt.add(r * nblocks + b) });
            // The sums start at -offset * sum(x) per half (one start for a
            // one-scale block), the same for every row.
            let mut start = [_mm256_setzero_si256(); 2];
            if offset != 0 {
                // SAFETY: block b's 2 x 8 integer sums are in bounds.
                let [lo, hi] = [0, 1].map(|h| unsafe {
                    _mm256_loadu_si256(x.sums.add(16 * b + 8 * h) as *const __m256i)
                });
                if B::TWO {
                    start = [lo, hi].map(|v| _mm256_mullo_epi32(v, neg_offset));
                } else {
                    start[0] = _mm256_mullo_epi32(_mm256_add_epi32(lo, hi), neg_offset);
                }
            }
            let mut sums = start.map(|v| [v; R]);
            for k0 in (0..8).step_by(B::LANE_STEPS) {
                let mut s16 = [_mm256_setzero_si256(); R];
                for k in k0..k0 + B::LANE_STEPS {
                    // SAFETY: block b's 32-byte group k of `x` is in bounds
                    // (fn contract).
                    let xk =
                        unsafe { _mm256_loadu_si256(x.q.add(256 * b + 32 * k) as *const __m256i) };
                    let abs_xk = if ABS_X { _mm256_abs_epi8(xk) } else { xk };
                    for r in 0..R {
                        // SAFETY: bytes 4k..4k + 4 of the block's 32 are in bounds.
                        let wv = _mm256_set1_epi32(unsafe {
                            (blk[r].q.as_ptr().add(4 * k) as *const i32).read_unaligned()
                        });
                        let prod = if ABS_X {
                            _mm256_maddubs_epi16(abs_xk, _mm256_sign_epi8(wv, xk))
                        } else if signed {
                            _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xk, wv))
                        } else {
                            _mm256_maddubs_epi16(wv, xk)
                        };
                        s16[r] = _mm256_add_epi16(s16[r], prod);
                    }
                }
                let h = if B::TWO { k0 / 4 } else { 0 };
                for r in 0..R {
                    sums[h][r] = _mm256_add_epi32(sums[h][r], _mm256_madd_epi16(s16[r], ones));
                }
            }
            // SAFETY: block b's 8 scales are in bounds.
            let dx = unsafe { _mm256_loadu_ps(x.d.add(8 * b)) };
            for r in 0..R {
                let dd = |h: usize| _mm256_mul_ps(_mm256_set1_ps(blk[r].d[h]), dx);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[0][r]), dd(0), acc[r]);
                if B::TWO {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[1][r]), dd(1), acc[r]);
                }
            }
        }
        // Without a minimum the definition's sum stays +0.0.
        let mut mins = [_mm256_setzero_ps(); R];
        if B::HAS_MIN {
            for b in 0..nblocks {
                // SAFETY: block b's 8 sums are in bounds.
                let sx = unsafe { _mm256_loadu_ps(x.s.add(8 * b)) };
                for (r, mr) in mins.iter_mut().enumerate() {
                    // SAFETY: block `b` of row `r` of the tile is in bounds.
                    let m = unsafe { (*wt.add(r * nblocks + b)).m };
                    *mr = _mm256_fmadd_ps(_mm256_set1_ps(m), sx, *mr);
                }
            }
        }
        // SAFETY: rows R t..R t + R of `y` (fn contract).
        unsafe { store_tile8(acc, mins, t, cn, y, y_stride) };
    }
}
