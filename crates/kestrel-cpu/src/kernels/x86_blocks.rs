//! x86-64 decoders of the stored weight blocks (AVX2, and AVX-512 where a
//! block has its own form): each reads one 32-element block (or K-quant
//! sub-block) in place, f16 scales converted with F16C and K-quant 6-bit
//! scales decoded from the super-block's packed bytes, into canonical f32
//! weights (`scalar.rs`) or, for the fast numerics, integer weight bytes
//! (`x86_int8.rs`). The tiles that consume them are `x86.rs`.

// Const-generic decoders index per-half arrays alongside lanes.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::scalar::k_scale_min;
use super::weight::Encoding;

/// One stored block encoding, dequantized into registers 32 elements at a
/// time.
pub(crate) trait Block {
    /// The encoding this block type reads.
    const ENC: Encoding;
    /// Bytes per 32 elements over a row (whole for every type but Q6_K's
    /// 26.25, rounded down): prefetch distances.
    const STRIDE: usize = Self::ENC.block_bytes() * 32 / Self::ENC.block_elems();
    /// Elements 0..16 and 16..32 of 32-element block `j` of the stored block
    /// at `p` (`j` is 0 but for a K-quant's sub-blocks 0..8). Without an
    /// AVX-512 form of its own, the AVX2 one's halves joined.
    ///
    /// # Safety
    /// `p` must be valid for reading one stored block of [`Block::ENC`]; the
    /// CPU must support AVX-512F/BW, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8, j: usize) -> (__m512, __m512) {
        // SAFETY: forwarded contract (AVX-512 implies what `dq256` needs).
        let v = unsafe { Self::dq256(p, j) };
        let join = |lo: __m256, hi: __m256| {
            let lo = _mm512_castpd256_pd512(_mm256_castps_pd(lo));
            _mm512_castpd_ps(_mm512_insertf64x4::<1>(lo, _mm256_castps_pd(hi)))
        };
        (join(v[0], v[1]), join(v[2], v[3]))
    }
    /// Elements 0..8, 8..16, 16..24, 24..32 of block `j` of the stored
    /// block at `p`.
    ///
    /// # Safety
    /// `p` must be valid for reading one stored block of [`Block::ENC`]; the
    /// CPU must support AVX2, FMA and F16C.
    unsafe fn dq256(p: *const u8, j: usize) -> [__m256; 4];
}

/// The stored block of `B` that holds 32-element block `blk` of the row at
/// `row`, and `blk`'s index within it (a K-quant sub-block; else 0). Only
/// the address is computed: the decoder that reads it states its bounds.
#[inline(always)]
pub(crate) fn locate<B: Block>(row: *const u8, blk: usize) -> (*const u8, usize) {
    (
        row.wrapping_add(B::ENC.block_offset(blk)),
        blk % (B::ENC.block_elems() / 32),
    )
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
pub(crate) struct Q5_0B;
#[derive(Debug)]
pub(crate) struct Q5_1B;
#[derive(Debug)]
pub(crate) struct Q4KB;
#[derive(Debug)]
pub(crate) struct Q5KB;
#[derive(Debug)]
pub(crate) struct Q6KB;

/// The f16 scale at `p` as f32, and the one at `p + 2` (lanes 0 and 1).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn scales(p: *const u8) -> __m128 {
    // SAFETY: the caller guarantees `p` is valid for the block's bytes, which
    // start with at least 2 bytes of scale; reading 4 is within every
    // block that starts with one (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: 18 bytes
    // or more).
    unsafe { _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned())) }
}

impl Block for F32B {
    const ENC: Encoding = Encoding::F32;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8, _j: usize) -> (__m512, __m512) {
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
    unsafe fn dq256(p: *const u8, _j: usize) -> [__m256; 4] {
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
    const ENC: Encoding = Encoding::F16;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8, _j: usize) -> (__m512, __m512) {
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
    unsafe fn dq256(p: *const u8, _j: usize) -> [__m256; 4] {
        // SAFETY: 64 readable bytes at `p` (trait contract).
        unsafe {
            let l = |o: usize| _mm256_cvtph_ps(_mm_loadu_si128(p.add(o) as *const __m128i));
            [l(0), l(16), l(32), l(48)]
        }
    }
}

impl Block for Bf16B {
    const ENC: Encoding = Encoding::Bf16;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8, _j: usize) -> (__m512, __m512) {
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
    unsafe fn dq256(p: *const u8, _j: usize) -> [__m256; 4] {
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
    const ENC: Encoding = Encoding::Q8_0;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8, _j: usize) -> (__m512, __m512) {
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
    unsafe fn dq256(p: *const u8, _j: usize) -> [__m256; 4] {
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
    const ENC: Encoding = Encoding::Q4_0;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8, _j: usize) -> (__m512, __m512) {
        // SAFETY: 18 readable bytes at `p` (trait contract): f16 d + 16 nibble bytes.
        unsafe { q4_0_512(_mm512_broadcastss_ps(scales(p)), p.add(2)) }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8, _j: usize) -> [__m256; 4] {
        // SAFETY: as above.
        unsafe { q4_0_256(_mm256_broadcastss_ps(scales(p)), p.add(2)) }
    }
}

impl Block for Q4_1B {
    const ENC: Encoding = Encoding::Q4_1;
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn dq512(p: *const u8, _j: usize) -> (__m512, __m512) {
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
    unsafe fn dq256(p: *const u8, _j: usize) -> [__m256; 4] {
        // SAFETY: as above.
        unsafe {
            let dm = scales(p);
            let d = _mm256_broadcastss_ps(dm);
            let m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
            q4_1_256(d, m, p.add(4))
        }
    }
}

/// The little-endian u32 at `p`.
///
/// # Safety
/// `p` must be valid for reading 4 bytes.
#[inline(always)]
pub(crate) unsafe fn u32_at(p: *const u8) -> u32 {
    // SAFETY: 4 readable bytes at `p` (fn contract); unaligned read.
    u32::from_le(unsafe { (p as *const u32).read_unaligned() })
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
pub(crate) unsafe fn q5_bytes256(qh: u32, qs: *const u8) -> __m256i {
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

/// Sub-block `j`'s 32 nibbles of a Q4_K/Q5_K super-block whose 128 nibble
/// bytes start at `qs` (the low nibbles of bytes `32 * (j / 2)..` for even
/// `j`, the high ones for odd), one byte each in element order.
///
/// # Safety
/// `qs` must be valid for reading 128 bytes, `j < 8`; the CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn k_nibbles256(qs: *const u8, j: usize) -> __m256i {
    // SAFETY: bytes 32 (j / 2) .. + 32 <= 128 are readable (fn contract).
    let v = unsafe { _mm256_loadu_si256(qs.add(32 * (j / 2)) as *const __m256i) };
    let shift = _mm_cvtsi32_si128(4 * (j % 2) as i32);
    _mm256_and_si256(_mm256_srl_epi16(v, shift), _mm256_set1_epi8(0x0F))
}

/// Sub-block `j`'s 32 quants (0..32) of the Q5_K super-block at `sb`: its
/// nibbles with bit 4 of element l from bit j of `qh[l]`.
///
/// # Safety
/// `sb` must be valid for reading 176 bytes, `j < 8`; the CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn q5k_bytes256(sb: *const u8, j: usize) -> __m256i {
    // SAFETY: `qh` is bytes 16..48 and the nibbles 48..176 (fn contract).
    unsafe {
        let qh = _mm256_loadu_si256(sb.add(16) as *const __m256i);
        let bit = _mm256_and_si256(
            _mm256_srl_epi16(qh, _mm_cvtsi32_si128(j as i32)),
            _mm256_set1_epi8(1),
        );
        // Each byte holds 0 or 1: a 16-bit shift stays within its byte.
        _mm256_or_si256(k_nibbles256(sb.add(48), j), _mm256_slli_epi16::<4>(bit))
    }
}

/// Sub-block `b`'s 32 six-bit quants (0..64, `q - 32` not yet taken) of the
/// Q6_K super-block at `sb`, one byte each in element order (see
/// `scalar::q6k_quants`).
///
/// # Safety
/// `sb` must be valid for reading 210 bytes, `b < 8`; the CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn q6k_bytes256(sb: *const u8, b: usize) -> __m256i {
    let (n, s) = (b / 4, b % 4);
    // SAFETY: `ql` is bytes 0..128 (read at 64 n + 32 (s % 2) .. + 32 <=
    // 128) and `qh` 128..192 (read at 128 + 32 n .. + 32 <= 192).
    let (ql, qh) = unsafe {
        (
            _mm256_loadu_si256(sb.add(64 * n + 32 * (s % 2)) as *const __m256i),
            _mm256_loadu_si256(sb.add(128 + 32 * n) as *const __m256i),
        )
    };
    let lo = _mm256_and_si256(
        _mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (s / 2) as i32)),
        _mm256_set1_epi8(0x0F),
    );
    // Bits 2s, 2s + 1 of each `qh` byte moved to bits 4, 5 by one 16-bit
    // shift (none for s = 2), then masked: what a shift brings across from
    // the lane's other byte lands outside 0x30.
    let hi = match s {
        0 => _mm256_slli_epi16::<4>(qh),
        1 => _mm256_slli_epi16::<2>(qh),
        2 => qh,
        _ => _mm256_srli_epi16::<2>(qh),
    };
    _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)))
}

/// The 16 bytes of a K-quant super-block's head (`d`, `dmin`, packed
/// scales) at `sb`.
///
/// # Safety
/// `sb` must be valid for reading 16 bytes.
#[inline(always)]
pub(crate) unsafe fn k_head(sb: *const u8) -> [u8; 16] {
    // SAFETY: 16 readable bytes (fn contract); unaligned read of a byte array.
    unsafe { (sb as *const [u8; 16]).read_unaligned() }
}

/// A Q6_K sub-block's two scales `d * sc` (elements 0..16, 16..32), as
/// `scalar::decode_block` forms them.
///
/// # Safety
/// `sb` must be valid for reading 210 bytes, `b < 8`.
#[inline(always)]
pub(crate) unsafe fn q6k_scales(sb: *const u8, b: usize) -> [f32; 2] {
    // SAFETY: `d` is bytes 208..210, the scales 192..208 (fn contract).
    unsafe {
        let d = half::f16::from_bits((sb.add(208) as *const u16).read_unaligned()).to_f32();
        [0, 1].map(|h| d * f32::from(*sb.add(192 + 2 * b + h) as i8))
    }
}

impl Block for Q5_0B {
    const ENC: Encoding = Encoding::Q5_0;
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8, _j: usize) -> [__m256; 4] {
        // SAFETY: 22 readable bytes at `p` (trait contract): f16 d, u32 qh,
        // 16 nibble bytes.
        unsafe {
            let d = _mm256_broadcastss_ps(scales(p));
            // q - 16 in -16..16 fits a signed byte: subtract before widening.
            let q = _mm256_sub_epi8(
                q5_bytes256(u32_at(p.add(2)), p.add(6)),
                _mm256_set1_epi8(16),
            );
            widen256::<true>(q).map(|q| _mm256_mul_ps(_mm256_cvtepi32_ps(q), d))
        }
    }
}

impl Block for Q5_1B {
    const ENC: Encoding = Encoding::Q5_1;
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8, _j: usize) -> [__m256; 4] {
        // SAFETY: 24 readable bytes at `p` (trait contract): f16 d, f16 m,
        // u32 qh, 16 nibble bytes.
        unsafe {
            let dm = scales(p);
            let d = _mm256_broadcastss_ps(dm);
            let m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
            let q = widen256::<false>(q5_bytes256(u32_at(p.add(4)), p.add(8)));
            q.map(|q| _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d), m))
        }
    }
}

/// `q * d + m` (two roundings) of 32 unsigned quant bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q_d_m256(q: __m256i, d: f32, m: f32) -> [__m256; 4] {
    let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
    widen256::<false>(q).map(|q| _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d), m))
}

impl Block for Q4KB {
    const ENC: Encoding = Encoding::Q4K;
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8, j: usize) -> [__m256; 4] {
        // SAFETY: 144 readable bytes at `p` (trait contract): head, then
        // 128 nibble bytes; `j < 8`.
        unsafe {
            let (d, m) = k_scale_min(&k_head(p), j);
            q_d_m256(k_nibbles256(p.add(16), j), d, -m)
        }
    }
}

impl Block for Q5KB {
    const ENC: Encoding = Encoding::Q5K;
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8, j: usize) -> [__m256; 4] {
        // SAFETY: 176 readable bytes at `p` (trait contract); `j < 8`.
        unsafe {
            let (d, m) = k_scale_min(&k_head(p), j);
            q_d_m256(q5k_bytes256(p, j), d, -m)
        }
    }
}

impl Block for Q6KB {
    const ENC: Encoding = Encoding::Q6K;
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dq256(p: *const u8, j: usize) -> [__m256; 4] {
        // SAFETY: 210 readable bytes at `p` (trait contract); `j < 8`.
        unsafe {
            let [d0, d1] = q6k_scales(p, j).map(|d| _mm256_set1_ps(d));
            // q - 32 in -32..32 fits a signed byte: subtract before widening.
            let q = _mm256_sub_epi8(q6k_bytes256(p, j), _mm256_set1_epi8(32));
            let q = widen256::<true>(q);
            let w = |q: __m256i, d: __m256| _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
            [w(q[0], d0), w(q[1], d0), w(q[2], d1), w(q[3], d1)]
        }
    }
}
