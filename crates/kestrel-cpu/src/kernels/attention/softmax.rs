//! The softmax's weights and sums: [`exp_shifted`] makes a head's scores
//! `exp(s - max)` in place and returns their sum in 16 lanes
//! ([`lane_sum16`], folded by [`tree16`]); its AVX2 and AVX-512 forms
//! ([`exp_shifted_avx2`], [`exp_shifted_avx512`], from one macro body)
//! run `ops::exp` operation for operation on registers of lanes, so every
//! weight and sum is the scalar definition's bit for bit.

use super::super::ops::exp;

/// One head's softmax weights in place, `s = exp(s - max(s))`, returning
/// their sum ([`lane_sum16`]): the definition the SIMD routes
/// (`exp_shifted_avx2`, `exp_shifted_avx512`) reproduce.
pub(crate) fn exp_shifted(s: &mut [f32]) -> f32 {
    let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    s.iter_mut().for_each(|x| *x = exp(*x - max));
    lane_sum16(s)
}

/// The softmax normalizer of one head: the sum of its weights `w` (one
/// per key) in the definition's order, 16 partial sums, lane `l` adding
/// the weights of keys `l, l + 16, l + 32, ...` in key order, then
/// [`tree16`]. A vector register adds 16 (or 8) keys' weights at once as
/// `exp` makes them, where a sum in key order was one chain of dependent
/// additions, at one addition per add latency (on long prompts a tenth of
/// a small model's samples).
pub(super) fn lane_sum16(w: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    for c in w.chunks(16) {
        for (a, &x) in lanes.iter_mut().zip(c) {
            *a += x;
        }
    }
    tree16(lanes)
}

/// The 16 partial sums of [`lane_sum16`] added halves first: lanes `l`
/// and `l + 8`, then `l + 4`, `l + 2`, `l + 1`.
fn tree16(p: [f32; 16]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|l| p[l] + p[l + 8]);
    let s4: [f32; 4] = std::array::from_fn(|l| s8[l] + s8[l + 4]);
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}

/// `s = exp(s - max(s))` in place, returning the weights' sum
/// ([`lane_sum16`]): the same operations as [`exp`] on 8 lanes
/// (bit-identical for finite scores) and the sum's additions in its order.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_shifted_avx2(s: &mut [f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut chunks = s.chunks_exact(8);
    for c in &mut chunks {
        // SAFETY: `c` holds 8 floats.
        mv = _mm256_max_ps(mv, unsafe { _mm256_loadu_ps(c.as_ptr()) });
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), mv) };
    let max = chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let maxv = _mm256_set1_ps(max);
    // Lanes 0..8 of `lane_sum16`'s partial sums take the even chunks of
    // eight keys, lanes 8..16 the odd ones.
    let mut sums = [_mm256_setzero_ps(); 2];
    let whole = s.len() - s.len() % 8;
    let mut chunks = s.chunks_exact_mut(8);
    for (i, c) in (&mut chunks).enumerate() {
        // SAFETY: `c` holds 8 floats.
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), maxv));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            sums[i % 2] = _mm256_add_ps(sums[i % 2], e);
        }
    }
    let mut lanes = [0f32; 16];
    // SAFETY: `lanes` holds 16 floats.
    unsafe {
        _mm256_storeu_ps(lanes.as_mut_ptr(), sums[0]);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), sums[1]);
    }
    for (j, x) in (whole..).zip(chunks.into_remainder()) {
        *x = exp(*x - max);
        lanes[j % 16] += *x;
    }
    tree16(lanes)
}

/// [`exp_shifted_avx2`] on 16 lanes, the tail masked: the same operations
/// lane for lane ([`exp16`]).
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn exp_shifted_avx512(s: &mut [f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = s.len();
    let tail = |i: usize| -> __mmask16 { (((1u32 << (n - i).min(16)) - 1) & 0xffff) as u16 };
    let mut mv = _mm512_set1_ps(f32::NEG_INFINITY);
    for i in (0..n).step_by(16) {
        // SAFETY: the mask covers floats i..min(i + 16, n) of `s`.
        let x = unsafe { _mm512_mask_loadu_ps(mv, tail(i), s.as_ptr().add(i)) };
        mv = _mm512_max_ps(mv, x);
    }
    let max = _mm512_reduce_max_ps(mv);
    let maxv = _mm512_set1_ps(max);
    // `lane_sum16`'s partial sums, one per lane; the tail's missing keys
    // add nothing.
    let mut sums = _mm512_setzero_ps();
    for i in (0..n).step_by(16) {
        // SAFETY: as above, for reading and writing.
        unsafe {
            let p = s.as_mut_ptr().add(i);
            let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail(i), p), maxv));
            _mm512_mask_storeu_ps(p, tail(i), e);
            sums = _mm512_mask_add_ps(sums, tail(i), sums, e);
        }
    }
    let mut lanes = [0f32; 16];
    // SAFETY: `lanes` holds 16 floats.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), sums) };
    tree16(lanes)
}

/// [`exp`] on a register of lanes, operation for operation, written once
/// for both widths: the ISA's vector type `$v` and its intrinsics, `$round`
/// rounding to nearest and `$zero_below(x, e, lo)` zeroing `e` where
/// `x < lo`.
macro_rules! exp_lanes {
    ($(#[$doc:meta])* $name:ident, $feat:literal, $v:ident, $min:ident, $max:ident,
     $set1:ident, $mul:ident, $fmadd:ident, $add:ident, $cvt:ident, $add_epi32:ident,
     $set1_epi32:ident, $slli:ident, $cast:ident, $round:expr, $zero_below:expr) => {
        $(#[$doc])*
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feat)]
        fn $name(x: std::arch::x86_64::$v) -> std::arch::x86_64::$v {
            use super::super::ops::exp_consts as k;
            use std::arch::x86_64::*;
            let xc = $min($max(x, $set1(k::LO)), $set1(k::HI));
            let n = ($round)($mul(xc, $set1(k::LOG2E)));
            let r = $fmadd(n, $set1(-k::LN2_HI), xc);
            let r = $fmadd(n, $set1(-k::LN2_LO), r);
            let mut p = $set1(k::P[0]);
            for &c in &k::P[1..] {
                p = $fmadd(p, r, $set1(c));
            }
            let y = $add($fmadd($mul(p, r), r, r), $set1(1.0));
            let bits = $slli::<23>($add_epi32($cvt(n), $set1_epi32(127)));
            ($zero_below)(x, $mul(y, $cast(bits)), $set1(k::LO))
        }
    };
}

exp_lanes!(
    /// [`exp`] on 16 lanes.
    exp16,
    "avx512f,avx2,fma",
    __m512,
    _mm512_min_ps,
    _mm512_max_ps,
    _mm512_set1_ps,
    _mm512_mul_ps,
    _mm512_fmadd_ps,
    _mm512_add_ps,
    _mm512_cvtps_epi32,
    _mm512_add_epi32,
    _mm512_set1_epi32,
    _mm512_slli_epi32,
    _mm512_castsi512_ps,
    |v| _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v),
    |x, e, lo| _mm512_maskz_mov_ps(!_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, lo), e)
);
exp_lanes!(
    /// [`exp`] on 8 lanes.
    exp8,
    "avx2,fma",
    __m256,
    _mm256_min_ps,
    _mm256_max_ps,
    _mm256_set1_ps,
    _mm256_mul_ps,
    _mm256_fmadd_ps,
    _mm256_add_ps,
    _mm256_cvtps_epi32,
    _mm256_add_epi32,
    _mm256_set1_epi32,
    _mm256_slli_epi32,
    _mm256_castsi256_ps,
    |v| _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v),
    |x, e, lo| _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(x, lo), e)
);
