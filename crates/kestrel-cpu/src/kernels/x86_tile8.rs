//! [`Tile8`]: a stored block type as the eight-row tiles read it, its
//! sub-blocks' scales decoded once per *stored* block for eight rows at
//! once, lane `r` = row `r` ([`Scales8`]; a K-quant's words transposed from
//! the rows' whole 16-byte loads, [`words8`]): the K-quant unpacking
//! (ggml's `kmask` steps) runs on eight rows' words in one register, and
//! the f16 scales of eight rows convert with one `vcvtph2ps`. Decoded per
//! row and per 32-element block, they cost more than the bytes they save.
//! Read by the single-stream GEMVs (`x86_gemv.rs`, `x86_gemv512.rs`) and
//! by `x86_lanes::unpack_rows256` (the many-stream path), a row in every
//! lane.

use std::arch::x86_64::*;

use super::int8::Q8Block;
use super::x86_blocks::{
    k_nibbles256, nibble_bytes256, q5_bytes256, q5k_bytes256, q6k_bytes256, u32_at, Q4KB, Q4_0B,
    Q4_1B, Q5KB, Q5_0B, Q5_1B, Q6KB, Q8_0B,
};
use super::x86_int8::Int8Block;

/// Lane-per-row scales of one 32-element sub-block of eight weight rows:
/// the scale of its elements 0..16 and of 16..32 (equal but for Q6_K) and
/// its minimum term's factor `m_w` (zero when the type has none).
#[derive(Clone, Copy)]
pub(crate) struct Scales8 {
    pub(super) d0: __m256,
    pub(super) d1: __m256,
    pub(super) m: __m256,
}

impl Scales8 {
    /// The scales of elements 0..16 and 16..32, and the minimum factors,
    /// lane by lane.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) fn lanes(&self) -> [[f32; 8]; 3] {
        // SAFETY: `__m256` and `[f32; 8]` have the same size, and every bit
        // pattern is valid for both.
        [self.d0, self.d1, self.m].map(|v| unsafe { std::mem::transmute::<__m256, [f32; 8]>(v) })
    }

    /// The definition's float step for one one-scale sub-block of the
    /// eight rows, whose integer sums are `sum` (row `r` in lane `r`)
    /// against activation block `xb`: `acc += float(sum) * (d * d_x)`, one
    /// fused rounding, and with a minimum (`min`) `mins += m_w * s_x`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) fn step(
        &self,
        sum: __m256i,
        xb: &Q8Block,
        min: bool,
        acc: &mut __m256,
        mins: &mut __m256,
    ) {
        let dd = _mm256_mul_ps(self.d0, _mm256_set1_ps(xb.d));
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), dd, *acc);
        // Without a minimum the definition's sum stays +0.0.
        if min {
            *mins = _mm256_fmadd_ps(self.m, _mm256_set1_ps(xb.s), *mins);
        }
    }

    /// Eight zero scales (what [`Tile8::scales8`] overwrites).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) fn zeros() -> [Scales8; 8] {
        let zero = _mm256_setzero_ps();
        [Scales8 {
            d0: zero,
            d1: zero,
            m: zero,
        }; 8]
    }
}

/// A stored block type as the GEMV reads it: its sub-blocks' scales for
/// eight rows at once, and a sub-block's integer weight bytes.
pub(crate) trait Tile8: Int8Block {
    /// 32-element sub-blocks per stored block (1, or 8 for the K-quants).
    const SUB: usize = Self::ENC.block_elems() / 32;
    /// The scales of every sub-block of the stored blocks at `p[0..8]`
    /// (row `r`'s in lane `r`) into `out[..Self::SUB]`.
    ///
    /// # Safety
    /// Each `p[r]` must be valid for reading one stored block of
    /// [`super::x86_blocks::Block::ENC`]; the CPU must support AVX2, FMA and
    /// F16C.
    unsafe fn scales8(p: &[*const u8; 8], out: &mut [Scales8; 8]);
    /// What [`Tile8::quants`] gives is `w + BIAS` (unsigned bytes) for
    /// Q4_0, Q5_0 and Q6_K, whose integer weights are `q - 8`, `q - 16`,
    /// `q - 32`: the kernel subtracts `BIAS * sum(x)` from the integer sums
    /// once for eight rows instead of signing every row's bytes.
    const BIAS: i32 = 0;
    /// How many levels of a sub-block's fold run in i16
    /// ([`sub_block`](super::x86_gemv::sub_block)): level `l` sums `2^(l+1)`
    /// products, which must stay within i16 for `|x| <= 127` and the largest
    /// quant [`Tile8::quants`] gives: 3 for nibbles (0..16: 16 products <=
    /// 30,480), 2 for five-bit quants, 1 for Q6_K's six-bit ones, 0 for Q8_0's
    /// signed bytes.
    const I16_LEVELS: usize = 0;
    /// Whether [`Tile8::quants`] gives signed bytes (Q8_0 only).
    const SIGNED_BYTES: bool = Self::SIGNED && Self::BIAS == 0;
    /// Sub-block `j`'s 32 integer weights as bytes, plus [`Tile8::BIAS`]
    /// (signed when [`Tile8::SIGNED_BYTES`]).
    ///
    /// # Safety
    /// As [`Int8Block::int8`], `j < Self::SUB`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn quants(p: *const u8, j: usize) -> __m256i {
        // SAFETY: forwarded contract.
        unsafe { Self::int8(p, j).0 }
    }
}

/// The u16 at `p[r] + off` of each row, as eight f32 from f16 (F16C).
///
/// # Safety
/// Each `p[r] + off` must be valid for reading 2 bytes; the CPU must
/// support AVX2 and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16x8(p: &[*const u8; 8], off: usize) -> __m256 {
    // SAFETY: 2 readable bytes at each `p[r] + off` (fn contract).
    let h = |r: usize| unsafe { (p[r].add(off) as *const i16).read_unaligned() };
    _mm256_cvtph_ps(_mm_setr_epi16(
        h(0),
        h(1),
        h(2),
        h(3),
        h(4),
        h(5),
        h(6),
        h(7),
    ))
}

/// The four u32 words at `p[r] + off..+ 16` of each row: word `k` in
/// result `k`, row `r` in lane `r`. Loaded as 16 bytes a row, two rows to
/// a register, and transposed in eight unpacks: a dozen shuffles where
/// inserting each word into its lane takes 32 two-uop `vpinsrd` (a
/// super-block's scales were about an eighth of the Q4_K GEMV's time).
///
/// # Safety
/// Each `p[r] + off` must be valid for reading 16 bytes; the CPU must
/// support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn words8(p: &[*const u8; 8], off: usize) -> [__m256i; 4] {
    // Rows r (low half) and r + 4 (high half).
    // SAFETY: 16 readable bytes at each `p[r] + off` (fn contract).
    let rows: [__m256i; 4] = std::array::from_fn(|r| unsafe {
        _mm256_loadu2_m128i(p[r + 4].add(off).cast(), p[r].add(off).cast())
    });
    // Per half: words 0, 1 of rows 0, 1 (then 2, 3) in `lo01`, words 2, 3
    // in `hi01`.
    let (lo01, hi01) = (
        _mm256_unpacklo_epi32(rows[0], rows[1]),
        _mm256_unpackhi_epi32(rows[0], rows[1]),
    );
    let (lo23, hi23) = (
        _mm256_unpacklo_epi32(rows[2], rows[3]),
        _mm256_unpackhi_epi32(rows[2], rows[3]),
    );
    [
        _mm256_unpacklo_epi64(lo01, lo23),
        _mm256_unpackhi_epi64(lo01, lo23),
        _mm256_unpacklo_epi64(hi01, hi23),
        _mm256_unpackhi_epi64(hi01, hi23),
    ]
}

/// The two f16 of each lane's word of `w` (low, high) as two rows of f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn f16_pairs(w: __m256i) -> (__m256, __m256) {
    // Per 128-bit half: the four low halves, then the four high ones.
    let split = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7,
        10, 11, 14, 15,
    );
    // Quad words: rows 0..4's lows, 4..8's lows, 0..4's highs, 4..8's.
    let v = _mm256_permute4x64_epi64::<0xD8>(_mm256_shuffle_epi8(w, split));
    (
        _mm256_cvtph_ps(_mm256_castsi256_si128(v)),
        _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(v)),
    )
}

/// Byte `k` (0..4) of each lane of `v`, unsigned, as f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn byte_u(v: __m256i, k: i32) -> __m256 {
    let b = _mm256_and_si256(
        _mm256_srlv_epi32(v, _mm256_set1_epi32(8 * k)),
        _mm256_set1_epi32(0xFF),
    );
    _mm256_cvtepi32_ps(b)
}

/// Byte `k` (0..4) of each lane of `v`, signed, as f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn byte_i(v: __m256i, k: i32) -> __m256 {
    let b = _mm256_srai_epi32::<24>(_mm256_sllv_epi32(v, _mm256_set1_epi32(24 - 8 * k)));
    _mm256_cvtepi32_ps(b)
}

/// One scale per block (f16 `d` at byte 0), no minimum: Q8_0, Q4_0, Q5_0.
///
/// # Safety
/// As [`Tile8::scales8`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn scale_only(p: &[*const u8; 8], out: &mut [Scales8; 8]) {
    // SAFETY: every such block starts with its f16 `d` (fn contract).
    let d = unsafe { f16x8(p, 0) };
    out[0] = Scales8 {
        d0: d,
        d1: d,
        m: _mm256_setzero_ps(),
    };
}

/// f16 `d`, f16 `m` at bytes 0 and 2: Q4_1, Q5_1 (`m_w = m`).
///
/// # Safety
/// As [`Tile8::scales8`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn scale_min(p: &[*const u8; 8], out: &mut [Scales8; 8]) {
    // SAFETY: every such block starts with f16 `d`, f16 `m` (fn contract).
    let (d, m) = unsafe { (f16x8(p, 0), f16x8(p, 2)) };
    out[0] = Scales8 { d0: d, d1: d, m };
}

/// A Q4_K/Q5_K super-block head (f16 `d`, f16 `dmin`, 12 bytes of packed
/// 6-bit scales and minimums) of eight rows: sub-block `j`'s
/// `d * sc[j]` and `-(dmin * m[j])`, unpacked as ggml's `kmask` steps on
/// one register of eight rows' words.
///
/// # Safety
/// As [`Tile8::scales8`] for a K-quant super-block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn k_scales8(p: &[*const u8; 8], out: &mut [Scales8; 8]) {
    // SAFETY: the head is the super-block's first 16 bytes (fn contract).
    let [dd, u0, u1, u2] = unsafe { words8(p, 0) };
    let (d, dmin) = f16_pairs(dd);
    let (k1, k2, k3) = (
        _mm256_set1_epi32(0x3f3f_3f3f),
        _mm256_set1_epi32(0x0f0f_0f0f),
        _mm256_set1_epi32(0x0303_0303),
    );
    let and = _mm256_and_si256;
    // Bytes of `sc_lo` are sc[0..4], `sc_hi` sc[4..8], `m_lo` m[0..4],
    // `m_hi` m[4..8] (`scalar::k_scale_min`'s bit layout).
    let sc_lo = and(u0, k1);
    let m_lo = and(u1, k1);
    let sc_hi = _mm256_or_si256(
        and(u2, k2),
        _mm256_slli_epi32::<4>(and(_mm256_srli_epi32::<6>(u0), k3)),
    );
    let m_hi = _mm256_or_si256(
        and(_mm256_srli_epi32::<4>(u2), k2),
        _mm256_slli_epi32::<4>(and(_mm256_srli_epi32::<6>(u1), k3)),
    );
    let neg_dmin = _mm256_sub_ps(_mm256_setzero_ps(), dmin);
    for (j, o) in out.iter_mut().enumerate() {
        let (sc, m) = if j < 4 { (sc_lo, m_lo) } else { (sc_hi, m_hi) };
        let k = (j % 4) as i32;
        let dw = _mm256_mul_ps(d, byte_u(sc, k));
        *o = Scales8 {
            d0: dw,
            d1: dw,
            m: _mm256_mul_ps(neg_dmin, byte_u(m, k)),
        };
    }
}

/// Q6_K's scales: 16 signed 8-bit scales at bytes 192..208 (two per
/// sub-block, elements 0..16 and 16..32), f16 `d` at 208.
///
/// # Safety
/// As [`Tile8::scales8`] for a Q6_K super-block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q6k_scales8(p: &[*const u8; 8], out: &mut [Scales8; 8]) {
    // SAFETY: one 210-byte super-block at each `p[r]` (fn contract).
    let (d, w) = unsafe { (f16x8(p, 208), words8(p, 192)) };
    for (j, o) in out.iter_mut().enumerate() {
        // Scale 2j + h is byte (2j + h) % 4 of word (2j + h) / 4.
        let sc = |h: usize| byte_i(w[(2 * j + h) / 4], ((2 * j + h) % 4) as i32);
        *o = Scales8 {
            d0: _mm256_mul_ps(d, sc(0)),
            d1: _mm256_mul_ps(d, sc(1)),
            m: _mm256_setzero_ps(),
        };
    }
}

/// `impl Tile8` for each block type: its fold depth, its bias, the function
/// decoding its scales (above), and where [`Int8Block::int8`]'s bytes are
/// not what the GEMV reads, its quants at `$p` (one stored block, by the
/// trait's contract; `$j < SUB`; the CPU has AVX2, FMA and F16C).
macro_rules! tile8 {
    ($($B:ty: levels $l:literal, bias $b:literal, $scales:ident $(, |$p:ident, $j:ident| $q:expr)?;)*) => {$(
        impl Tile8 for $B {
            const I16_LEVELS: usize = $l;
            const BIAS: i32 = $b;
            #[target_feature(enable = "avx2,fma,f16c")]
            #[inline]
            unsafe fn scales8(p: &[*const u8; 8], out: &mut [Scales8; 8]) {
                // SAFETY: forwarded contract.
                unsafe { $scales(p, out) }
            }
            $(
                #[target_feature(enable = "avx2,fma,f16c")]
                #[inline]
                unsafe fn quants($p: *const u8, $j: usize) -> __m256i {
                    // SAFETY: the block's bytes named below are within the
                    // stored block at `p` (trait contract).
                    unsafe { $q }
                }
            )?
        }
    )*};
}

tile8! {
    // f16 d, 32 i8.
    Q8_0B: levels 0, bias 0, scale_only;
    // f16 d, 16 nibble bytes: q = w + 8.
    Q4_0B: levels 3, bias 8, scale_only, |p, _j| nibble_bytes256(p.add(2));
    // f16 d, u32 qh, 16 nibble bytes: q = w + 16.
    Q5_0B: levels 2, bias 16, scale_only, |p, _j| q5_bytes256(u32_at(p.add(2)), p.add(6));
    // f16 d, f16 m, 16 nibble bytes.
    Q4_1B: levels 3, bias 0, scale_min;
    // f16 d, f16 m, u32 qh, 16 nibble bytes.
    Q5_1B: levels 2, bias 0, scale_min;
    // 16-byte head, then 128 bytes of nibbles (two sub-blocks per 32).
    Q4KB: levels 3, bias 0, k_scales8, |p, j| k_nibbles256(p.add(16), j);
    // 16-byte head, 32 bytes of fifth bits, 128 bytes of nibbles.
    Q5KB: levels 2, bias 0, k_scales8, |p, j| q5k_bytes256(p, j);
    // 128 bytes of low nibbles, 64 of high bit pairs, scales, d: q = w + 32.
    Q6KB: levels 1, bias 32, q6k_scales8, |p, j| q6k_bytes256(p, j);
}
