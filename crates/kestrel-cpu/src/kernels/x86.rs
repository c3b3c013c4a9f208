//! x86-64 SIMD tiles of the canonical dot product (see `scalar.rs`).
//!
//! A tile multiplies `R` weight rows by `NB` activation rows over whole
//! 32-element blocks, dequantizing each block once into registers and reusing
//! it for all `NB` activations. Lane `l` of each accumulator receives exactly
//! the fused multiply-adds the scalar definition gives lane `l`, so results
//! are bit-identical to `scalar::dot` whatever `R`, `NB` or the ISA.

// Const-generic tiles index `acc[r][c]` alongside other per-(r, c) arrays.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::scalar::LANES;

/// One 32-element block encoding, dequantized into registers.
pub(crate) trait Block {
    /// Bytes per 32-element block.
    const BYTES: usize;
    /// Elements 0..16 and 16..32 of the block at `p`.
    ///
    /// # Safety
    /// `p` must be valid for reading `Self::BYTES` bytes; the CPU must support
    /// AVX-512F/BW, AVX2, FMA and F16C.
    unsafe fn dq512(p: *const u8) -> (__m512, __m512);
    /// Elements 0..8, 8..16, 16..24, 24..32 of the block at `p`.
    ///
    /// # Safety
    /// `p` must be valid for reading `Self::BYTES` bytes; the CPU must support
    /// AVX2, FMA and F16C.
    unsafe fn dq256(p: *const u8) -> [__m256; 4];
}

#[derive(Debug)]
pub(crate) struct F32B;
#[derive(Debug)]
pub(crate) struct F16B;
#[derive(Debug)]
pub(crate) struct Bf16B;
#[derive(Debug)]
pub(crate) struct Q8_0B;
#[derive(Debug)]
pub(crate) struct Q4_0B;
#[derive(Debug)]
pub(crate) struct Q4_1B;
#[derive(Debug)]
pub(crate) struct Q4_0FB;
#[derive(Debug)]
pub(crate) struct Q4_1FB;
#[derive(Debug)]
pub(crate) struct Q5_0FB;
#[derive(Debug)]
pub(crate) struct Q5_1FB;
#[derive(Debug)]
pub(crate) struct Q4KFB;
#[derive(Debug)]
pub(crate) struct Q6KFB;

/// The f16 scale at `p` as f32, and the one at `p + 2` (lanes 0 and 1).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn scales(p: *const u8) -> __m128 {
    // SAFETY: the caller guarantees `p` is valid for the block's bytes, which
    // start with at least 2 bytes of scale; reading 4 is within every block
    // of a quantized dtype (Q8_0/Q4_0 blocks are 34/18 bytes).
    unsafe { _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned())) }
}

impl Block for F32B {
    const BYTES: usize = 128;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8) -> (__m512, __m512) {
        // SAFETY: 128 readable bytes at `p` (trait contract).
        unsafe {
            (
                _mm512_loadu_ps(p as *const f32),
                _mm512_loadu_ps(p.add(64) as *const f32),
            )
        }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8) -> [__m256; 4] {
        let f = p as *const f32;
        // SAFETY: 128 readable bytes at `p` (trait contract).
        unsafe {
            [
                _mm256_loadu_ps(f),
                _mm256_loadu_ps(f.add(8)),
                _mm256_loadu_ps(f.add(16)),
                _mm256_loadu_ps(f.add(24)),
            ]
        }
    }
}

impl Block for F16B {
    const BYTES: usize = 64;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8) -> (__m512, __m512) {
        // SAFETY: 64 readable bytes at `p` (trait contract); f16 -> f32 is exact.
        unsafe {
            (
                _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
                _mm512_cvtph_ps(_mm256_loadu_si256(p.add(32) as *const __m256i)),
            )
        }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8) -> [__m256; 4] {
        // SAFETY: 64 readable bytes at `p` (trait contract).
        unsafe {
            let l = |o: usize| _mm256_cvtph_ps(_mm_loadu_si128(p.add(o) as *const __m128i));
            [l(0), l(16), l(32), l(48)]
        }
    }
}

impl Block for Bf16B {
    const BYTES: usize = 64;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8) -> (__m512, __m512) {
        // SAFETY: 64 readable bytes at `p` (trait contract); bf16 -> f32 is a shift.
        unsafe {
            let l = |o: usize| {
                let v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(o) as *const __m256i));
                _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))
            };
            (l(0), l(32))
        }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8) -> [__m256; 4] {
        // SAFETY: 64 readable bytes at `p` (trait contract).
        unsafe {
            let l = |o: usize| {
                let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(o) as *const __m128i));
                _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
            };
            [l(0), l(16), l(32), l(48)]
        }
    }
}

impl Block for Q8_0B {
    const BYTES: usize = 34;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8) -> (__m512, __m512) {
        // SAFETY: 34 readable bytes at `p` (trait contract): f16 d + 32 quants.
        unsafe {
            let d = _mm512_broadcastss_ps(scales(p));
            let l = |o: usize| {
                let q = _mm_loadu_si128(p.add(o) as *const __m128i);
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d)
            };
            (l(2), l(18))
        }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8) -> [__m256; 4] {
        // SAFETY: 34 readable bytes at `p` (trait contract).
        unsafe {
            let d = _mm256_broadcastss_ps(scales(p));
            let a = _mm_loadu_si128(p.add(2) as *const __m128i);
            let b = _mm_loadu_si128(p.add(18) as *const __m128i);
            let c = |v: __m128i| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
            [c(a), c(_mm_srli_si128(a, 8)), c(b), c(_mm_srli_si128(b, 8))]
        }
    }
}

/// `[0.0, 1.0, .., 15.0]`: every value of a nibble.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
fn nibble_values() -> __m512 {
    _mm512_setr_ps(
        0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.,
    )
}

/// Elements 0..16 (low nibbles) and 16..32 (high nibbles) of the 16 packed
/// bytes at `q`, each mapped through the 16-entry `table`. One permute per
/// 16 weights replaces masking, widening, converting and scaling them.
///
/// # Safety
/// `q` must be valid for reading 16 bytes; the CPU must support AVX-512F.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn nibble_lookup(q: *const u8, table: __m512) -> (__m512, __m512) {
    // SAFETY: 16 readable bytes at `q` (fn contract).
    let q = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(q as *const __m128i) });
    // vpermps reads only the low 4 bits of each index lane, so the low
    // nibble needs no mask and the high one only a shift.
    (
        _mm512_permutexvar_ps(q, table),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), table),
    )
}

/// The f32 at `p` (a repacked block's scale) in every lane.
///
/// # Safety
/// `p` must be valid for reading 4 bytes; the CPU must support AVX-512F.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn splat512(p: *const u8) -> __m512 {
    // SAFETY: 4 readable bytes at `p` (fn contract); a broadcast load.
    _mm512_set1_ps(unsafe { (p as *const f32).read_unaligned() })
}

/// As [`splat512`], 8 lanes.
///
/// # Safety
/// `p` must be valid for reading 4 bytes; the CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn splat256(p: *const u8) -> __m256 {
    // SAFETY: 4 readable bytes at `p` (fn contract).
    _mm256_set1_ps(unsafe { (p as *const f32).read_unaligned() })
}

/// A Q4_0 block's 32 weights `(q - 8) * d` from scale `d` and the 16
/// nibble bytes at `qs` (AVX-512).
///
/// # Safety
/// `qs` must be valid for reading 16 bytes; the CPU must support AVX-512F/BW.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn q4_0_512(d: __m512, qs: *const u8) -> (__m512, __m512) {
    // The block's 16 possible weights, looked up by nibble.
    let table = _mm512_mul_ps(_mm512_sub_ps(nibble_values(), _mm512_set1_ps(8.0)), d);
    // SAFETY: forwarded contract.
    unsafe { nibble_lookup(qs, table) }
}

/// As [`q4_0_512`] with AVX2: elements 0..8, 8..16, 16..24, 24..32.
///
/// # Safety
/// `qs` must be valid for reading 16 bytes; the CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_0_256(d: __m256, qs: *const u8) -> [__m256; 4] {
    // SAFETY: 16 readable bytes at `qs` (fn contract).
    let q = unsafe { _mm_loadu_si128(qs as *const __m128i) };
    let mask = _mm_set1_epi8(0x0F);
    let eight = _mm_set1_epi8(8);
    let lo = _mm_sub_epi8(_mm_and_si128(q, mask), eight);
    let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), mask), eight);
    let c = |v: __m128i| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
    [
        c(lo),
        c(_mm_srli_si128(lo, 8)),
        c(hi),
        c(_mm_srli_si128(hi, 8)),
    ]
}

/// A Q4_1 block's 32 weights `fma(q, d, m)` from `d`, `m` and the 16
/// nibble bytes at `qs` (AVX-512).
///
/// # Safety
/// `qs` must be valid for reading 16 bytes; the CPU must support AVX-512F/BW.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn q4_1_512(d: __m512, m: __m512, qs: *const u8) -> (__m512, __m512) {
    // The block's 16 possible weights, each the fused `q * d + m` of the
    // scalar definition, then looked up by nibble.
    let table = _mm512_fmadd_ps(nibble_values(), d, m);
    // SAFETY: forwarded contract.
    unsafe { nibble_lookup(qs, table) }
}

/// As [`q4_1_512`] with AVX2: elements 0..8, 8..16, 16..24, 24..32.
///
/// # Safety
/// `qs` must be valid for reading 16 bytes; the CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_1_256(d: __m256, m: __m256, qs: *const u8) -> [__m256; 4] {
    // SAFETY: 16 readable bytes at `qs` (fn contract).
    let q = unsafe { _mm_loadu_si128(qs as *const __m128i) };
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(q, mask);
    let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    let c = |v: __m128i| _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), d, m);
    [
        c(lo),
        c(_mm_srli_si128(lo, 8)),
        c(hi),
        c(_mm_srli_si128(hi, 8)),
    ]
}

impl Block for Q4_0B {
    const BYTES: usize = 18;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8) -> (__m512, __m512) {
        // SAFETY: 18 readable bytes at `p` (trait contract): f16 d + 16 nibble bytes.
        unsafe { q4_0_512(_mm512_broadcastss_ps(scales(p)), p.add(2)) }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8) -> [__m256; 4] {
        // SAFETY: as above.
        unsafe { q4_0_256(_mm256_broadcastss_ps(scales(p)), p.add(2)) }
    }
}

impl Block for Q4_0FB {
    const BYTES: usize = 20;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8) -> (__m512, __m512) {
        // SAFETY: 20 readable bytes at `p` (trait contract): f32 d + 16 nibble bytes.
        unsafe { q4_0_512(splat512(p), p.add(4)) }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8) -> [__m256; 4] {
        // SAFETY: as above.
        unsafe { q4_0_256(splat256(p), p.add(4)) }
    }
}

impl Block for Q4_1B {
    const BYTES: usize = 20;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8) -> (__m512, __m512) {
        // SAFETY: 20 readable bytes at `p` (trait contract): f16 d, m + 16 nibble bytes.
        unsafe {
            let dm = scales(p);
            let d = _mm512_broadcastss_ps(dm);
            let m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
            q4_1_512(d, m, p.add(4))
        }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8) -> [__m256; 4] {
        // SAFETY: as above.
        unsafe {
            let dm = scales(p);
            let d = _mm256_broadcastss_ps(dm);
            let m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
            q4_1_256(d, m, p.add(4))
        }
    }
}

impl Block for Q4_1FB {
    const BYTES: usize = 24;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8) -> (__m512, __m512) {
        // SAFETY: 24 readable bytes at `p` (trait contract): f32 d, f32 m +
        // 16 nibble bytes. Two broadcast loads replace a conversion and
        // three shuffles of the f16 block.
        unsafe { q4_1_512(splat512(p), splat512(p.add(4)), p.add(8)) }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8) -> [__m256; 4] {
        // SAFETY: as above.
        unsafe { q4_1_256(splat256(p), splat256(p.add(4)), p.add(8)) }
    }
}

/// The little-endian u32 at `p`.
///
/// # Safety
/// `p` must be valid for reading 4 bytes.
#[inline(always)]
unsafe fn u32_at(p: *const u8) -> u32 {
    // SAFETY: 4 readable bytes at `p` (fn contract); unaligned read.
    u32::from_le(unsafe { (p as *const u32).read_unaligned() })
}

/// Elements 0..16 and 16..32 of a 5-bit block: the Q4_0-order nibbles at
/// `qs` look up `t0` (weights of q = 0..16) where the element's fifth bit in
/// `qh` is clear and `t1` (q = 16..32) where it is set. Two permutes per 16
/// weights; the fifth bits are the blend masks as they are.
///
/// # Safety
/// `qs` must be valid for reading 16 bytes; the CPU must support AVX-512F.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn q5_lookup(qh: u32, qs: *const u8, t0: __m512, t1: __m512) -> (__m512, __m512) {
    // SAFETY: 16 readable bytes at `qs` (fn contract).
    let q = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(qs as *const __m128i) });
    let hi = _mm512_srli_epi32::<4>(q);
    // vpermps reads the low 4 bits of each index: no mask needed (as in
    // `nibble_lookup`); lanes whose bit is set take `t1` instead.
    (
        _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(q, t0), qh as u16, q, t1),
        _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(hi, t0), (qh >> 16) as u16, hi, t1),
    )
}

/// The 32 nibbles of 16 Q4_0-order bytes at `qs` as i32, elements 0..8,
/// 8..16, 16..24, 24..32.
///
/// # Safety
/// `qs` must be valid for reading 16 bytes; the CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn nibbles256(qs: *const u8) -> [__m256i; 4] {
    // SAFETY: 16 readable bytes at `qs` (fn contract).
    let q = unsafe { _mm_loadu_si128(qs as *const __m128i) };
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(q, mask);
    let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    [
        _mm256_cvtepu8_epi32(lo),
        _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
        _mm256_cvtepu8_epi32(hi),
        _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)),
    ]
}

/// Byte e all ones where bit e of `bits` is set, zero elsewhere (ggml's
/// `bytes_from_bits_32`: one shuffle, one or, one compare for 32 bits).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn bits_to_bytes256(bits: u32) -> __m256i {
    // Byte e gets byte e / 8 of `bits`, then is all ones iff bit e % 8 is set.
    let spread = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), spread);
    let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi64x(-1))
}

/// The 32 Q4_0-order nibbles at `qs`, one byte each in element order.
///
/// # Safety
/// `qs` must be valid for reading 16 bytes; the CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn nibble_bytes256(qs: *const u8) -> __m256i {
    // SAFETY: 16 readable bytes at `qs` (fn contract).
    let q = unsafe { _mm_loadu_si128(qs as *const __m128i) };
    let mask = _mm_set1_epi8(0x0F);
    _mm256_set_m128i(
        _mm_and_si128(_mm_srli_epi16(q, 4), mask),
        _mm_and_si128(q, mask),
    )
}

/// The 32 five-bit quants of a block, one byte each in element order: the
/// nibbles at `qs` with bit 4 of element e from bit e of `qh`.
///
/// # Safety
/// `qs` must be valid for reading 16 bytes; the CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q5_bytes256(qh: u32, qs: *const u8) -> __m256i {
    // SAFETY: forwarded contract.
    let nib = unsafe { nibble_bytes256(qs) };
    _mm256_or_si256(
        nib,
        _mm256_and_si256(bits_to_bytes256(qh), _mm256_set1_epi8(0x10)),
    )
}

/// 32 bytes as i32 (sign-extended when `SIGNED`), elements 8g..8g+8 for g = 0..4.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn widen256<const SIGNED: bool>(q: __m256i) -> [__m256i; 4] {
    let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
    let w = |v: __m128i| {
        if SIGNED {
            _mm256_cvtepi8_epi32(v)
        } else {
            _mm256_cvtepu8_epi32(v)
        }
    };
    [
        w(lo),
        w(_mm_srli_si128(lo, 8)),
        w(hi),
        w(_mm_srli_si128(hi, 8)),
    ]
}

impl Block for Q5_0FB {
    const BYTES: usize = 24;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8) -> (__m512, __m512) {
        // SAFETY: 24 readable bytes at `p` (trait contract): f32 d, u32 qh,
        // 16 nibble bytes.
        unsafe {
            let d = splat512(p);
            let nv = nibble_values();
            // (q - 16) * d for q = 0..16 and, since (k + 16) - 16 == k, k * d
            // for q = 16 + k: the scalar definition's exact operations.
            let t0 = _mm512_mul_ps(_mm512_sub_ps(nv, _mm512_set1_ps(16.0)), d);
            let t1 = _mm512_mul_ps(nv, d);
            q5_lookup(u32_at(p.add(4)), p.add(8), t0, t1)
        }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8) -> [__m256; 4] {
        // SAFETY: as above.
        unsafe {
            let d = splat256(p);
            // q - 16 in -16..16 fits a signed byte: subtract before widening.
            let q = _mm256_sub_epi8(
                q5_bytes256(u32_at(p.add(4)), p.add(8)),
                _mm256_set1_epi8(16),
            );
            widen256::<true>(q).map(|q| _mm256_mul_ps(_mm256_cvtepi32_ps(q), d))
        }
    }
}

impl Block for Q5_1FB {
    const BYTES: usize = 28;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8) -> (__m512, __m512) {
        // SAFETY: 28 readable bytes at `p` (trait contract): f32 d, f32 m,
        // u32 qh, 16 nibble bytes.
        unsafe {
            let (d, m) = (splat512(p), splat512(p.add(4)));
            let nv = nibble_values();
            // q * d + m, rounded twice, for q = 0..16 and 16..32.
            let t0 = _mm512_add_ps(_mm512_mul_ps(nv, d), m);
            let nv16 = _mm512_add_ps(nv, _mm512_set1_ps(16.0));
            let t1 = _mm512_add_ps(_mm512_mul_ps(nv16, d), m);
            q5_lookup(u32_at(p.add(8)), p.add(12), t0, t1)
        }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8) -> [__m256; 4] {
        // SAFETY: as above.
        unsafe {
            let (d, m) = (splat256(p), splat256(p.add(4)));
            let q = widen256::<false>(q5_bytes256(u32_at(p.add(8)), p.add(12)));
            q.map(|q| _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d), m))
        }
    }
}

impl Block for Q4KFB {
    const BYTES: usize = 24;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8) -> (__m512, __m512) {
        // SAFETY: 24 readable bytes at `p` (trait contract): f32 d, f32 m,
        // 16 nibble bytes.
        unsafe {
            // q * d + m, rounded twice (ggml's `d * q - min`), by nibble.
            let table = _mm512_add_ps(
                _mm512_mul_ps(nibble_values(), splat512(p)),
                splat512(p.add(4)),
            );
            nibble_lookup(p.add(8), table)
        }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8) -> [__m256; 4] {
        // SAFETY: as above.
        unsafe {
            let (d, m) = (splat256(p), splat256(p.add(4)));
            nibbles256(p.add(8)).map(|q| _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d), m))
        }
    }
}

impl Block for Q6KFB {
    const BYTES: usize = 32;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8) -> (__m512, __m512) {
        // SAFETY: 32 readable bytes at `p` (trait contract): f32 d0, f32 d1,
        // u32 bit-4 plane, u32 bit-5 plane, 16 nibble bytes.
        unsafe {
            let (d0, d1) = (splat512(p), splat512(p.add(4)));
            let (b4, b5) = (u32_at(p.add(8)), u32_at(p.add(12)));
            let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(16) as *const __m128i));
            let lo = _mm512_and_si512(q, _mm512_set1_epi32(0x0F));
            let hi = _mm512_srli_epi32::<4>(q);
            let (v16, v32) = (_mm512_set1_epi32(16), _mm512_set1_epi32(32));
            // The planes' bits are the masks of the lanes that gain 16 / 32.
            let w = |nib: __m512i, k4: u16, k5: u16, d: __m512| {
                let q = _mm512_mask_or_epi32(nib, k4, nib, v16);
                let q = _mm512_mask_or_epi32(q, k5, q, v32);
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, v32)), d)
            };
            (
                w(lo, b4 as u16, b5 as u16, d0),
                w(hi, (b4 >> 16) as u16, (b5 >> 16) as u16, d1),
            )
        }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8) -> [__m256; 4] {
        // SAFETY: as above.
        unsafe {
            let (d0, d1) = (splat256(p), splat256(p.add(4)));
            let b4 = _mm256_and_si256(bits_to_bytes256(u32_at(p.add(8))), _mm256_set1_epi8(0x10));
            let b5 = _mm256_and_si256(bits_to_bytes256(u32_at(p.add(12))), _mm256_set1_epi8(0x20));
            let q = _mm256_or_si256(nibble_bytes256(p.add(16)), _mm256_or_si256(b4, b5));
            // q - 32 in -32..32 fits a signed byte: subtract before widening.
            let q = widen256::<true>(_mm256_sub_epi8(q, _mm256_set1_epi8(32)));
            let w = |q: __m256i, d: __m256| _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
            [w(q[0], d0), w(q[1], d0), w(q[2], d1), w(q[3], d1)]
        }
    }
}

/// Pointers and strides of one tile.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TileArgs {
    /// First weight row of the tile.
    pub w: *const u8,
    /// Bytes between consecutive weight rows.
    pub row_bytes: usize,
    /// First activation row of the tile.
    pub x: *const f32,
    /// Floats between consecutive activation rows (= cols).
    pub x_stride: usize,
    /// Whole 32-element blocks to process.
    pub nblocks: usize,
}

/// How many row tiles ahead [`tile512`] prefetches.
pub(crate) const PREFETCH_TILES: usize = 4;

/// How many rows ahead the row dequantizers prefetch.
const PREFETCH_ROWS: usize = 8;

/// Hint the line at `p` into cache. Never faults, whatever `p` is.
#[inline(always)]
pub(crate) fn prefetch(p: *const u8) {
    // SAFETY: prefetch is a hint: it does not dereference architecturally and
    // cannot fault, so any address (even past an allocation) is fine.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
}

/// `R x NB` tile with AVX-512; writes each element's 16 canonical lanes.
///
/// # Safety
/// `a.w` must be valid for `R` rows of `a.nblocks` blocks of `B`, `a.x` for
/// `NB` rows of `a.nblocks * 32` floats; the CPU must support AVX-512F/BW,
/// AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(crate) unsafe fn tile512<B: Block, const R: usize, const NB: usize>(
    a: TileArgs,
    out: &mut TileOut<R, NB>,
) {
    // SAFETY: forwarded contract.
    let acc = unsafe { acc512::<B, R, NB>(a) };
    if R == 4 && NB == 4 && !out.want_lanes {
        let mut sums = [0f32; 16];
        // SAFETY: AVX-512 is enabled for this function; `sums` holds 16 floats.
        unsafe { _mm512_storeu_ps(sums.as_mut_ptr(), sums4x4(&acc)) };
        for r in 0..R {
            for c in 0..NB {
                // Lane 4c + r holds vector 4r + c (see `sums4x4`).
                out.sums[r][c] = sums[4 * c + r];
            }
        }
        return;
    }
    for r in 0..R {
        for c in 0..NB {
            if out.want_lanes {
                // SAFETY: `lane_ptr(r, c)` addresses 16 writable f32s.
                unsafe { _mm512_storeu_ps(out.lane_ptr(r, c), acc[r][c]) };
            } else {
                // SAFETY: AVX-512 is enabled for this function.
                out.sums[r][c] = unsafe { reduce512(acc[r][c]) };
            }
        }
    }
}

/// The `R x NB` accumulators of a tile: lane `l` of `acc[r][c]` holds the
/// canonical lane-`l` sum of weight row `r` with activation row `c`.
///
/// # Safety
/// As [`tile512`].
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn acc512<B: Block, const R: usize, const NB: usize>(a: TileArgs) -> [[__m512; NB]; R] {
    let mut acc = [[_mm512_setzero_ps(); NB]; R];
    // Rows of a tile are adjacent, so the next tile starts R rows on; touch it
    // a few lines at a time while this one computes (decode is DRAM-bound).
    let ahead = a.w.wrapping_add(PREFETCH_TILES * R * a.row_bytes);
    let step = R * B::BYTES;
    for blk in 0..a.nblocks {
        prefetch(ahead.wrapping_add(blk * step));
        prefetch(ahead.wrapping_add(blk * step + 64));
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: block `blk` of row `r` lies within the tile (fn contract).
            let (wl, wh) = unsafe { B::dq512(a.w.add(r * a.row_bytes + blk * B::BYTES)) };
            for (c, acc_rc) in acc_r.iter_mut().enumerate() {
                // SAFETY: floats `blk*32 .. blk*32+32` of activation row `c` are in bounds.
                unsafe {
                    let xp = a.x.add(c * a.x_stride + blk * 32);
                    *acc_rc = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xp), *acc_rc);
                    *acc_rc = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xp.add(16)), *acc_rc);
                }
            }
        }
    }
    acc
}

/// `4 * tiles` consecutive weight rows of `B` against the one activation
/// row `a.x`: row `i`'s canonical sum goes to `y[i]`. Bit-identical to
/// [`tile512`] with `R = 4, NB = 1` on each tile, in one call.
///
/// # Safety
/// `a.w` must be valid for `4 * tiles` rows of `a.nblocks` blocks of `B`,
/// `a.x` for `a.nblocks * 32` floats, `y` for writing `4 * tiles` floats;
/// the CPU must support AVX-512F/BW, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(crate) unsafe fn rows4_gemv512<B: Block>(a: TileArgs, tiles: usize, y: *mut f32) {
    for t in 0..tiles {
        let at = TileArgs {
            // SAFETY: rows 4t..4t + 4 are in bounds (fn contract).
            w: unsafe { a.w.add(4 * t * a.row_bytes) },
            ..a
        };
        // SAFETY: forwarded contract, for this tile's 4 rows.
        let acc = unsafe { acc512::<B, 4, 1>(at) };
        for (i, acc_i) in acc.iter().enumerate() {
            // SAFETY: output 4t + i is in bounds (fn contract); AVX-512 is
            // enabled for this function.
            unsafe { *y.add(4 * t + i) = reduce512(acc_i[0]) };
        }
    }
}

/// Four dense f32 weight rows of `a.nblocks * 32` floats against `4 * col_tiles` activation rows: each 4x4 tile reduced
/// with [`reduce512x16`] and stored straight into `y`, element `(r, c)` at
/// `y[c * y_stride + r]`. Bit-identical to [`tile512`] on each tile; one
/// call per weight tile instead of one per 4x4 tile, and four vector
/// stores per tile instead of sixteen scalar ones.
///
/// # Safety
/// `a` as for [`tile512`] with `R = 4`, for `NB = 4 * col_tiles` activation
/// rows; `y` must be valid for writing every `(r, c)` element above.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(crate) unsafe fn rows4_sweep512(a: TileArgs, col_tiles: usize, y: *mut f32, y_stride: usize) {
    for t in 0..col_tiles {
        let at = TileArgs {
            // SAFETY: activation rows 4t..4t + 4 are in bounds (fn contract).
            x: unsafe { a.x.add(4 * t * a.x_stride) },
            ..a
        };
        // SAFETY: forwarded contract, for this tile's 4 activation rows.
        let acc = unsafe { acc512::<F32B, 4, 4>(at) };
        // Each 128-bit quarter is one activation row's 4 consecutive outputs.
        let sums = sums4x4(&acc);
        // SAFETY: element (r, c) of this tile is at y[(4t + c) * y_stride + r],
        // valid for writing (fn contract); each store covers r = 0..4.
        unsafe {
            let yp = y.add(4 * t * y_stride);
            _mm_storeu_ps(yp, _mm512_extractf32x4_ps::<0>(sums));
            _mm_storeu_ps(yp.add(y_stride), _mm512_extractf32x4_ps::<1>(sums));
            _mm_storeu_ps(yp.add(2 * y_stride), _mm512_extractf32x4_ps::<2>(sums));
            _mm_storeu_ps(yp.add(3 * y_stride), _mm512_extractf32x4_ps::<3>(sums));
        }
    }
}

/// The 16 sums of a full 4x4 tile with one transposed reduction (15 adds
/// instead of 16 separate 4-level trees; same tree, same values): lane
/// `4c + r` holds element `(r, c)`. `R` and `NB` must both be 4.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
fn sums4x4<const R: usize, const NB: usize>(acc: &[[__m512; NB]; R]) -> __m512 {
    debug_assert!(R == 4 && NB == 4, "a {R}x{NB} tile");
    let mut v = [_mm512_setzero_ps(); 16];
    for r in 0..R {
        for c in 0..NB {
            v[4 * r + c] = acc[r][c];
        }
    }
    reduce512x16(&v)
}

/// The canonical 16-lane tree (`scalar::reduce16`) of 16 vectors at once,
/// by transposition: level by level, pairs of vectors share one add, so the
/// whole reduction costs 15 adds and 30 shuffles. Each sum is computed with
/// exactly the tree's additions (a + b == b + a in IEEE arithmetic), so the
/// results equal 16 separate [`reduce512`]s. Lane `4q + k` of the result
/// holds the sum of `v[4k + q]`.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
fn reduce512x16(v: &[__m512; 16]) -> __m512 {
    // Level 1, lanes l + (l + 8): [A.s8 | B.s8] per pair (A, B).
    let mut w = [_mm512_setzero_ps(); 8];
    for i in 0..8 {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b);
        let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b);
        w[i] = _mm512_add_ps(lo, hi);
    }
    // Level 2, s8[l] + s8[l + 4]: [A.s4 | B.s4 | C.s4 | D.s4].
    let mut x = [_mm512_setzero_ps(); 4];
    for i in 0..4 {
        let (a, b) = (w[2 * i], w[2 * i + 1]);
        let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b);
        let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b);
        x[i] = _mm512_add_ps(lo, hi);
    }
    // Level 3, s4[0] + s4[2] and s4[1] + s4[3], within each 128-bit quarter.
    let mut y = [_mm512_setzero_ps(); 2];
    for i in 0..2 {
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        let lo = _mm512_shuffle_ps::<0b01_00_01_00>(a, b);
        let hi = _mm512_shuffle_ps::<0b11_10_11_10>(a, b);
        y[i] = _mm512_add_ps(lo, hi);
    }
    // Level 4, s2[0] + s2[1].
    let lo = _mm512_shuffle_ps::<0b10_00_10_00>(y[0], y[1]);
    let hi = _mm512_shuffle_ps::<0b11_01_11_01>(y[0], y[1]);
    _mm512_add_ps(lo, hi)
}

/// Output of a tile: the canonical sums, or (for dense rows with a tail
/// still to add) the 16 lanes of each element. Lanes are left uninitialized
/// unless wanted, so the common case pays no zeroing.
#[derive(Debug)]
pub(crate) struct TileOut<const R: usize, const NB: usize> {
    pub want_lanes: bool,
    pub lanes: std::mem::MaybeUninit<[[[f32; LANES]; NB]; R]>,
    pub sums: [[f32; NB]; R],
}

impl<const R: usize, const NB: usize> TileOut<R, NB> {
    pub fn new(want_lanes: bool) -> Self {
        TileOut {
            want_lanes,
            lanes: std::mem::MaybeUninit::uninit(),
            sums: [[0.0; NB]; R],
        }
    }

    /// Pointer to the 16 lanes of element `(r, c)`.
    fn lane_ptr(&mut self, r: usize, c: usize) -> *mut f32 {
        // SAFETY: `(r * NB + c) * LANES` is within the `R * NB * LANES` floats
        // of the array (r < R, c < NB at every call site).
        unsafe { (self.lanes.as_mut_ptr() as *mut f32).add((r * NB + c) * LANES) }
    }
}

/// The canonical 16-lane tree (`scalar::reduce16`) on 8-lane halves.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn reduce_halves(lo: __m256, hi: __m256) -> f32 {
    let s8 = _mm256_add_ps(lo, hi); // l + (l+8)
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1)); // + (l+4)
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4)); // + (l+2)
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2))) // + (l+1)
}

/// The canonical 16-lane tree on one 512-bit accumulator.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn reduce512(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    // SAFETY: AVX2 is implied by this function's features.
    unsafe { reduce_halves(lo, hi) }
}

/// `R x NB` tile with AVX2 (two 8-lane halves per canonical accumulator).
///
/// # Safety
/// As [`tile512`], with AVX2, FMA and F16C required.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile256<B: Block, const R: usize, const NB: usize>(
    a: TileArgs,
    out: &mut TileOut<R, NB>,
) {
    let mut acc = [[[_mm256_setzero_ps(); 2]; NB]; R];
    let ahead = a.w.wrapping_add(PREFETCH_TILES * R * a.row_bytes);
    let step = R * B::BYTES;
    for blk in 0..a.nblocks {
        prefetch(ahead.wrapping_add(blk * step));
        prefetch(ahead.wrapping_add(blk * step + 64));
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: block `blk` of row `r` lies within the tile (fn contract).
            let w = unsafe { B::dq256(a.w.add(r * a.row_bytes + blk * B::BYTES)) };
            for (c, acc_rc) in acc_r.iter_mut().enumerate() {
                // SAFETY: floats `blk*32 .. blk*32+32` of activation row `c` are in bounds.
                unsafe {
                    let xp = a.x.add(c * a.x_stride + blk * 32);
                    acc_rc[0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xp), acc_rc[0]);
                    acc_rc[1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp.add(8)), acc_rc[1]);
                    acc_rc[0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp.add(16)), acc_rc[0]);
                    acc_rc[1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp.add(24)), acc_rc[1]);
                }
            }
        }
    }
    for r in 0..R {
        for c in 0..NB {
            if out.want_lanes {
                // SAFETY: `lane_ptr(r, c)` addresses 16 writable f32s.
                unsafe {
                    _mm256_storeu_ps(out.lane_ptr(r, c), acc[r][c][0]);
                    _mm256_storeu_ps(out.lane_ptr(r, c).add(8), acc[r][c][1]);
                }
            } else {
                // SAFETY: AVX2 is enabled for this function.
                out.sums[r][c] = unsafe { reduce_halves(acc[r][c][0], acc[r][c][1]) };
            }
        }
    }
}

/// Dequantize `nblocks` blocks of `B` at `src` into `out` (canonical values).
///
/// # Safety
/// `src` valid for `nblocks * B::BYTES` bytes, `out` for `nblocks * 32` f32s;
/// the CPU must support AVX-512F/BW (when `avx512`) or AVX2, FMA and F16C.
pub(crate) unsafe fn dequant_row<B: Block>(
    avx512: bool,
    src: *const u8,
    nblocks: usize,
    out: *mut f32,
) {
    if avx512 {
        // SAFETY: forwarded contract.
        unsafe { dequant_row512::<B>(src, nblocks, out) }
    } else {
        // SAFETY: forwarded contract.
        unsafe { dequant_row256::<B>(src, nblocks, out) }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn dequant_row512<B: Block>(src: *const u8, nblocks: usize, out: *mut f32) {
    // Rows are dequantized in order: touch the row PREFETCH_ROWS ahead.
    let ahead = src.wrapping_add(PREFETCH_ROWS * nblocks * B::BYTES);
    for blk in 0..nblocks {
        prefetch(ahead.wrapping_add(blk * B::BYTES));
        // SAFETY: block `blk` and its 32 output floats are in bounds (fn contract).
        unsafe {
            let (lo, hi) = B::dq512(src.add(blk * B::BYTES));
            _mm512_storeu_ps(out.add(blk * 32), lo);
            _mm512_storeu_ps(out.add(blk * 32 + 16), hi);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant_row256<B: Block>(src: *const u8, nblocks: usize, out: *mut f32) {
    let ahead = src.wrapping_add(PREFETCH_ROWS * nblocks * B::BYTES);
    for blk in 0..nblocks {
        prefetch(ahead.wrapping_add(blk * B::BYTES));
        // SAFETY: block `blk` and its 32 output floats are in bounds (fn contract).
        unsafe {
            let v = B::dq256(src.add(blk * B::BYTES));
            for (i, x) in v.iter().enumerate() {
                _mm256_storeu_ps(out.add(blk * 32 + 8 * i), *x);
            }
        }
    }
}
