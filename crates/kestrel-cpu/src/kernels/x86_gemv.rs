//! The single-stream GEMV of the fast numerics on AVX2 ([`gemv8_256`]):
//! eight weight rows per tile, one output per lane of a 256-bit register,
//! reading every weight type in its file encoding; with AVX-512 VNNI,
//! Q4_K's and Q6_K's two sub-blocks to a 512-bit register
//! ([`gemv8_q4k_vnni512`], [`gemv8_q6k_vnni512`]; with GFNI
//! [`gemv8_q6k_gfni512`]). All of them walk the weights the same way
//! ([`tiles8`]).
//!
//! Single-stream decode streams each weight byte once, so this kernel must
//! keep up with DRAM: per weight byte it may spend only a few instructions.
//! What costs is not the integer dot (`vpmaddubsw` + `vpmaddwd` per 32
//! weights) but the scales around it: a K-quant's 6-bit sub-block scales
//! and minimums packed in 12 bytes, and every type's f16 scales. Decoded per
//! row and per 32-element block, they cost more than the bytes they save.
//! So [`Tile8::scales8`] decodes them once per *stored* block for the
//! tile's eight rows at once, lane `r` = row `r` (a K-quant's words
//! transposed from the rows' whole 16-byte loads, [`words8`]): the K-quant
//! unpacking (ggml's `kmask` steps) runs on eight rows' words in one
//! register, and the f16 scales of eight rows convert with one
//! `vcvtph2ps`. The 32-element loop then reads each sub-block's scales
//! ready in lane order. Q4_0,
//! Q5_0 and Q6_K weights (`q - 8/16/32`) are read unsigned and the bias
//! comes off the integer sums once per eight rows (`BIAS * sum(x)`, formed
//! once per activation block for every tile), not by signing every row's
//! bytes. `x86_lanes::unpack_rows256` (the
//! many-stream path) decodes scales the same way, a row in every lane.
//!
//! Results are `int8.rs`'s definition bit for bit: per output, block by
//! block in order, `acc = fma(float(isum), d_w * d_x, acc)` (Q6_K's halves
//! first then second), minimums in a second sum. `d_w = d * sc` and
//! `m_w = -(dmin * m)` are exact in f32 however they are formed.

use std::arch::x86_64::*;

use super::int8::Q8Block;
use super::x86::{gemv_next_block_l1, gemv_prefetch_tiles, prefetch_l1, prefetch_l2};
use super::x86_blocks::{
    k_nibbles256, nibble_bytes256, q5_bytes256, q5k_bytes256, q6k_bytes256, u32_at, Q4KB, Q4_0B,
    Q4_1B, Q5KB, Q5_0B, Q5_1B, Q6KB, Q8_0B,
};
use super::x86_int8::{Int8Args, Int8Block};

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
    /// How many levels of a sub-block's fold run in i16 ([`sub_block`]):
    /// level `l` sums `2^(l+1)` products, which must stay within i16 for
    /// `|x| <= 127` and the largest quant [`Tile8::quants`] gives: 3 for
    /// nibbles (0..16: 16 products <= 30,480), 2 for five-bit quants, 1 for
    /// Q6_K's six-bit ones, 0 for Q8_0's signed bytes.
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

/// `8 * tiles` consecutive weight rows from `a.w` against the one quantized
/// activation row `a.x`: row `i`'s output goes to `y[i]`. Per stored block,
/// the eight rows' scales are decoded at once ([`Tile8::scales8`]); per
/// 32-element sub-block, each row's integer sums (8 lanes from
/// `vpmaddubsw`/`vpmaddwd`) are folded to one lane per row by six `vphaddd`
/// and two lane permutes, and the definition's float steps run for the
/// eight rows at once; the activation block is loaded once per eight rows.
///
/// # Safety
/// `a.w` must be valid for `8 * tiles` rows of `a.nblocks` 32-element
/// blocks of `B`, `a.x` for one row of `a.nblocks` blocks, `y` for writing
/// `8 * tiles` floats; the CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn gemv8_256<B: Tile8>(a: Int8Args, tiles: usize, y: *mut f32) {
    // `BIAS * sum(x)` per activation block and half, the same for every
    // tile: formed once here, not per tile in `sub_block` (a few hundred
    // bytes per call, for the biased types only).
    let biases: Vec<[i32; 2]> = if B::BIAS == 0 {
        Vec::new()
    } else {
        (0..a.nblocks)
            // SAFETY: block `b < a.nblocks` of the activation row is in
            // bounds (fn contract).
            .map(|b| unsafe { &*a.x.add(b) }.half_sums().map(|h| B::BIAS * h))
            .collect()
    };
    let block =
        |s: usize, p: &[*const u8; 8], sc: &[Scales8; 8], acc: &mut __m256, mins: &mut __m256| {
            let xs = a.x.wrapping_add(s * B::SUB);
            let bias = biases.as_ptr().wrapping_add(s * B::SUB);
            // SAFETY: stored block `s` of each row and the activation's
            // blocks `s * SUB..` + SUB are in bounds (fn contract).
            unsafe {
                if B::SUB == 8 {
                    // Unrolled: each sub-block's shifts and offsets constant.
                    sub_block::<B>(p, 0, xs, bias, sc, acc, mins);
                    sub_block::<B>(p, 1, xs, bias, sc, acc, mins);
                    sub_block::<B>(p, 2, xs, bias, sc, acc, mins);
                    sub_block::<B>(p, 3, xs, bias, sc, acc, mins);
                    sub_block::<B>(p, 4, xs, bias, sc, acc, mins);
                    sub_block::<B>(p, 5, xs, bias, sc, acc, mins);
                    sub_block::<B>(p, 6, xs, bias, sc, acc, mins);
                    sub_block::<B>(p, 7, xs, bias, sc, acc, mins);
                } else {
                    for j in 0..B::SUB {
                        sub_block::<B>(p, j, xs, bias, sc, acc, mins);
                    }
                }
            }
        };
    // SAFETY: forwarded contract.
    unsafe { tiles8::<B>(a, tiles, y, block) }
}

/// The GEMVs' walk: `tiles` 8-row tiles from `a.w`, and per stored block
/// `s` of a tile, the same bytes of the tile [`gemv_prefetch_tiles`] ahead
/// prefetched (rows are contiguous) and, where [`gemv_next_block_l1`], the
/// rows' block `s + 1` hinted into L1, the eight rows' block addresses `p`
/// and their scales decoded at once ([`Tile8::scales8`]) handed to
/// `block(s, p, scales, acc, mins)`, which takes the definition's float
/// steps into `acc` and `mins`; tile `t`'s outputs, `acc + mins`, go to
/// `y[8t..8t + 8]`.
///
/// # Safety
/// As [`gemv8_256`]; `block` must be safe to call for every stored block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tiles8<B: Tile8>(
    a: Int8Args,
    tiles: usize,
    y: *mut f32,
    mut block: impl FnMut(usize, &[*const u8; 8], &[Scales8; 8], &mut __m256, &mut __m256),
) {
    let block_bytes = B::ENC.block_bytes();
    // Bytes of one stored block of all eight rows: what the prefetch
    // streams per stored block.
    let step = 8 * block_bytes;
    let mut sc = Scales8::zeros();
    let ahead_bytes = gemv_prefetch_tiles(B::SUB == 8) * 8 * a.row_bytes;
    let next_l1 = gemv_next_block_l1(B::SUB == 8);
    for t in 0..tiles {
        let w = a.w.wrapping_add(8 * t * a.row_bytes);
        let ahead = w.wrapping_add(ahead_bytes);
        let mut acc = _mm256_setzero_ps();
        let mut mins = _mm256_setzero_ps();
        for s in 0..a.nblocks / B::SUB {
            for line in 0..step.div_ceil(64) {
                prefetch_l2(ahead.wrapping_add(s * step + 64 * line));
            }
            let p: [*const u8; 8] =
                std::array::from_fn(|r| w.wrapping_add(r * a.row_bytes + s * block_bytes));
            if next_l1 {
                // Each row's next stored block (one line more than its
                // length: it need not start on a line), L2 to L1. Past a
                // row's end it is the next row's start: a hint, never a
                // fault.
                for q in p {
                    for line in 0..=block_bytes.div_ceil(64) {
                        prefetch_l1(q.wrapping_add(block_bytes + 64 * line));
                    }
                }
            }
            // SAFETY: stored block `s` of each of the tile's rows is in
            // bounds (fn contract).
            unsafe { B::scales8(&p, &mut sc) };
            block(s, &p, &sc, &mut acc, &mut mins);
        }
        // Without a minimum the definition's sum stays +0.0.
        // SAFETY: outputs 8t..8t + 8 are in bounds (fn contract).
        unsafe { _mm256_storeu_ps(y.add(8 * t), _mm256_add_ps(acc, mins)) };
    }
}

/// Sub-block `j` of the stored blocks at `p[0..8]` against activation
/// block `x[j]`: the definition's float steps for the eight rows' outputs
/// in `acc` and `mins`. Each row's integer sums (8 lanes from
/// `vpmaddubsw`/`vpmaddwd`) are folded to one lane per row by six `vphaddd`
/// and two lane permutes.
///
/// # Safety
/// Each `p[r]` valid for one stored block of `B`, `x` for `j + 1` blocks,
/// and when `B::BIAS != 0` `bias` for `j + 1` pairs of `BIAS * sum(x)` over
/// those blocks' halves, `j < B::SUB`; the CPU must support AVX2, FMA and
/// F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn sub_block<B: Tile8>(
    p: &[*const u8; 8],
    j: usize,
    x: *const Q8Block,
    bias: *const [i32; 2],
    sc: &[Scales8; 8],
    acc: &mut __m256,
    mins: &mut __m256,
) {
    let ones = _mm256_set1_epi16(1);
    let scj = &sc[j];
    // SAFETY: block `j` of `x` is in bounds (fn contract).
    let xb: &Q8Block = unsafe { &*x.add(j) };
    // SAFETY: `q` is 32 readable bytes.
    let xq = unsafe { _mm256_loadu_si256(xb.q.as_ptr() as *const __m256i) };
    // Each row's products, `vpmaddubsw`'s sixteen i16 pair sums: lanes
    // 0..8 over elements 0..16, lanes 8..16 over 16..32.
    let prods: [__m256i; 8] = std::array::from_fn(|r| {
        // SAFETY: one stored block at `p[r]`, `j < SUB` (fn contract).
        let wq = unsafe { B::quants(p[r], j) };
        // Signed weights: |w| against x with w's sign (`vpmaddubsw`
        // multiplies unsigned by signed bytes).
        let (wu, xs) = if B::SIGNED_BYTES {
            (_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq))
        } else {
            (wq, xq)
        };
        _mm256_maddubs_epi16(wu, xs)
    });
    // `half0` gets row r's sum over elements 0..16 in lane r, `half1` over
    // 16..32.
    let h16 = |a: __m256i, b: __m256i| _mm256_hadd_epi16(a, b);
    let h32 = |a: __m256i, b: __m256i| _mm256_hadd_epi32(a, b);
    let wide = |v: __m256i| _mm256_madd_epi16(v, ones);
    let p = &prods;
    let (mut half0, mut half1) = match B::I16_LEVELS {
        3 => {
            // Seven `vphaddw` leave row r's half sums in i16 lane r of
            // each 128-bit half, then widened.
            let rows = h16(
                h16(h16(p[0], p[1]), h16(p[2], p[3])),
                h16(h16(p[4], p[5]), h16(p[6], p[7])),
            );
            (
                _mm256_cvtepi16_epi32(_mm256_castsi256_si128(rows)),
                _mm256_cvtepi16_epi32(_mm256_extracti128_si256::<1>(rows)),
            )
        }
        levels => {
            // `levels` rounds of `vphaddw`, widened to i32 pairs
            // (`vpmaddwd`), the rest in `vphaddd`: each 128-bit half of `q0`
            // ends with rows 0..4's sums over its half of the elements,
            // `q1` rows 4..8's; two lane permutes put rows in lanes.
            let (q0, q1) = match levels {
                2 => (
                    wide(h16(h16(p[0], p[1]), h16(p[2], p[3]))),
                    wide(h16(h16(p[4], p[5]), h16(p[6], p[7]))),
                ),
                1 => (
                    h32(wide(h16(p[0], p[1])), wide(h16(p[2], p[3]))),
                    h32(wide(h16(p[4], p[5])), wide(h16(p[6], p[7]))),
                ),
                _ => {
                    let w = p.map(wide);
                    (
                        h32(h32(w[0], w[1]), h32(w[2], w[3])),
                        h32(h32(w[4], w[5]), h32(w[6], w[7])),
                    )
                }
            };
            (
                _mm256_permute2x128_si256::<0x20>(q0, q1),
                _mm256_permute2x128_si256::<0x31>(q0, q1),
            )
        }
    };
    if B::BIAS != 0 {
        // sum(w x) = sum((w + BIAS) x) - BIAS sum(x), per half, the same
        // for the eight rows.
        // SAFETY: block `j`'s biases are in bounds (fn contract).
        let [b0, b1] = unsafe { *bias.add(j) };
        half0 = _mm256_sub_epi32(half0, _mm256_set1_epi32(b0));
        half1 = _mm256_sub_epi32(half1, _mm256_set1_epi32(b1));
    }
    if B::TWO {
        // Q6_K: a scale per half, no minimum (`mins` stays +0.0).
        debug_assert!(!B::HAS_MIN);
        let dx = _mm256_set1_ps(xb.d);
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half0), _mm256_mul_ps(scj.d0, dx), *acc);
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half1), _mm256_mul_ps(scj.d1, dx), *acc);
    } else {
        scj.step(_mm256_add_epi32(half0, half1), xb, B::HAS_MIN, acc, mins);
    }
}

/// [`gemv8_256`] for Q4_K on AVX2 with rows paired in 128-bit halves: per
/// 32-byte group `i` of a super-block (sub-block `2i` in its low nibbles,
/// `2i + 1` in its high ones), rows `r` and `r + 4` share a register, the
/// first's sixteen bytes in the low half and the second's in the high,
/// against each activation half broadcast to both halves; the products of
/// a sub-block's two sixteen-element halves add in i16 (`vpaddw`), so a
/// register holds two rows' whole-sub-block pair sums and the fold to one
/// lane per row takes three `vphaddw` and one `vpmaddwd` for eight rows,
/// where [`sub_block`] takes seven `vphaddw` and a widening of both halves
/// (sums stay below `4 * 2 * 2 * 15 * 127 = 30480` in i16). Rows land in
/// lane order (rows 0..4 in the low half, 4..8 in the high), and each
/// sub-block takes the definition's float steps in order, as
/// [`sub_block`] does: bit for bit the same outputs.
///
/// # Safety
/// As [`gemv8_256`] for Q4_K rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn gemv8_q4k_pair256(a: Int8Args, tiles: usize, y: *mut f32) {
    let (low4, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    let block =
        |s: usize, p: &[*const u8; 8], sc: &[Scales8; 8], acc: &mut __m256, mins: &mut __m256| {
            for i in 0..4 {
                // SAFETY: activation blocks `8s + 2i` and `+ 1` are in
                // bounds (fn contract).
                let xb: [&Q8Block; 2] =
                    std::array::from_fn(|h| unsafe { &*a.x.add(8 * s + 2 * i + h) });
                // Each block's elements 0..16 and 16..32, in both halves.
                let xh = xb.map(|b| {
                    // SAFETY: each `q` is 32 readable bytes.
                    [0, 16].map(|e| unsafe {
                        _mm256_broadcastsi128_si256(_mm_loadu_si128(b.q.as_ptr().add(e).cast()))
                    })
                });
                // Per row pair (r, r + 4): sub-block 2i's pair sums, then
                // 2i + 1's.
                let mut pairs = [[_mm256_setzero_si256(); 4]; 2];
                for r in 0..4 {
                    // SAFETY: the nibbles are bytes 16..144 of the stored
                    // block at each `p[r]` (fn contract); group `i` is 32
                    // of them, read as two halves of sixteen.
                    let [v0, v1] = [0, 16].map(|e| unsafe {
                        _mm256_loadu2_m128i(
                            p[r + 4].add(16 + 32 * i + e).cast(),
                            p[r].add(16 + 32 * i + e).cast(),
                        )
                    });
                    let lo = [v0, v1].map(|v| _mm256_and_si256(v, low4));
                    let hi = [v0, v1].map(|v| _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4));
                    for (h, q) in [lo, hi].into_iter().enumerate() {
                        pairs[h][r] = _mm256_add_epi16(
                            _mm256_maddubs_epi16(q[0], xh[h][0]),
                            _mm256_maddubs_epi16(q[1], xh[h][1]),
                        );
                    }
                }
                for (h, q) in pairs.into_iter().enumerate() {
                    let h16 = |u, v| _mm256_hadd_epi16(u, v);
                    let sum = _mm256_madd_epi16(h16(h16(q[0], q[1]), h16(q[2], q[3])), ones);
                    sc[2 * i + h].step(sum, xb[h], true, acc, mins);
                }
            }
        };
    // SAFETY: forwarded contract; `block` reads stored block `s` of the
    // tile's rows and activation blocks `8s..8s + 8`, in bounds.
    unsafe { tiles8::<Q4KB>(a, tiles, y, block) }
}

/// Eight rows' 512-bit `vpdpbusd` sums folded by shuffles and adds (no
/// `vphaddd`): per 128-bit chunk `c`, rows 0..4's sums over its four lanes
/// in the first result's chunk `c`, rows 4..8's in the second's.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn fold8(p: [__m512i; 8]) -> (__m512i, __m512i) {
    let pairs = |u: __m512i, v: __m512i| {
        _mm512_add_epi32(_mm512_unpacklo_epi32(u, v), _mm512_unpackhi_epi32(u, v))
    };
    let quads = |u: __m512i, v: __m512i| {
        _mm512_add_epi32(_mm512_unpacklo_epi64(u, v), _mm512_unpackhi_epi64(u, v))
    };
    (
        quads(pairs(p[0], p[1]), pairs(p[2], p[3])),
        quads(pairs(p[4], p[5]), pairs(p[6], p[7])),
    )
}

/// Chunks `c` and `d` of a fold's ([`fold8`]) two halves, rows 0..8 each:
/// `[lo.c, hi.c, lo.d, hi.d]`, chunk `c` in the low 256 bits, `d` in the
/// high.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn chunks(lo: __m512i, hi: __m512i, c: i32, d: i32) -> __m512i {
    let idx = |k: i32, src: i32| 16 * src + 4 * k;
    let (c0, c1, d0, d1) = (idx(c, 0), idx(c, 1), idx(d, 0), idx(d, 1));
    let at: [i32; 16] = std::array::from_fn(|l| [c0, c1, d0, d1][l / 4] + (l % 4) as i32);
    // SAFETY: `at` is 16 readable i32.
    let at = unsafe { _mm512_loadu_si512(at.as_ptr().cast()) };
    _mm512_permutex2var_epi32(lo, at, hi)
}

/// [`gemv8_256`] for Q4_K with AVX-512 VNNI: two sub-blocks per 512-bit
/// register. A Q4_K super-block's 32-byte groups hold sub-block `2i` in
/// their low nibbles and `2i + 1` in their high ones; each row's group is
/// broadcast to both halves and masked to the low nibbles in the first and
/// the high nibbles in place (sixteen times their value) in the second,
/// against the two activation blocks side by side: one `vpdpbusd` per row
/// for 64 weights, sums exact in i32 (at most `4 * 240 * 127` a lane).
/// The eight rows' sums then fold to one lane per row and sub-block by
/// shuffles and adds (no `vphaddd`, half the folds per weight of the
/// 256-bit GEMV), the second sub-block's divided by 16 exactly (a
/// multiple of 16), and each sub-block takes the definition's float steps
/// in order, as [`sub_block`] does: bit for bit the same outputs.
///
/// # Safety
/// As [`gemv8_256`] for Q4_K rows; the CPU must support AVX-512F/BW/VL and
/// AVX-512 VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn gemv8_q4k_vnni512(a: Int8Args, tiles: usize, y: *mut f32) {
    let nibbles = _mm512_inserti64x4::<1>(_mm512_set1_epi8(0x0F), _mm256_set1_epi8(0xF0u8 as i8));
    let block =
        |s: usize, p: &[*const u8; 8], sc: &[Scales8; 8], acc: &mut __m256, mins: &mut __m256| {
            for i in 0..4 {
                // SAFETY: activation blocks `8s + 2i` and `+ 1` are in
                // bounds (fn contract).
                let xb: [&Q8Block; 2] =
                    std::array::from_fn(|h| unsafe { &*a.x.add(8 * s + 2 * i + h) });
                // SAFETY: each `q` is 32 readable bytes.
                let [x0, x1] = xb.map(|b| unsafe { _mm256_loadu_si256(b.q.as_ptr().cast()) });
                let xx = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(x0), x1);
                let prod: [__m512i; 8] = std::array::from_fn(|r| {
                    // SAFETY: the nibbles are bytes 16..144 of the stored
                    // block at `p[r]` (fn contract); group `i` is 32 of them.
                    let q = unsafe { _mm256_loadu_si256(p[r].add(16 + 32 * i).cast()) };
                    let q = _mm512_and_si512(_mm512_broadcast_i64x4(q), nibbles);
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xx)
                });
                // Chunks 0 + 1 (sub-block 2i) and 2 + 3 (2i + 1) of the
                // eight rows.
                let (lo, hi) = fold8(prod);
                let sums = _mm512_add_epi32(chunks(lo, hi, 0, 2), chunks(lo, hi, 1, 3));
                let sub = [
                    _mm512_castsi512_si256(sums),
                    _mm256_srai_epi32::<4>(_mm512_extracti64x4_epi64::<1>(sums)),
                ];
                for (h, sum) in sub.into_iter().enumerate() {
                    sc[2 * i + h].step(sum, xb[h], true, acc, mins);
                }
            }
        };
    // SAFETY: forwarded contract; `block` reads stored block `s` of the
    // tile's rows and activation blocks `8s..8s + 8`, in bounds.
    unsafe { tiles8::<Q4KB>(a, tiles, y, block) }
}

/// [`gemv8_256`] for Q6_K with AVX-512 VNNI: sub-blocks `b` and `b + 2`
/// of a super-block's half share their low-bit and high-bit bytes (`ql`
/// nibbles low and high, `qh` bit pairs two apart), so one broadcast of
/// each, shifted per 256-bit half, gives both sub-blocks' six-bit quants
/// (`w + 32`) in one register, against their two activation blocks: one
/// `vpdpbusd` per row for 64 weights. The sums fold as
/// [`gemv8_q4k_vnni512`]'s, per 16-element half; `32 * sum(x)` per half
/// comes off once for the eight rows, and the float steps run in the
/// sub-blocks' order, each half with its scale, as [`sub_block`] does: bit
/// for bit the same outputs. With GFNI, [`gemv8_q6k_gfni512`] forms the
/// quants in three operations where this takes six.
///
/// # Safety
/// As [`gemv8_256`] for Q6_K rows; the CPU must support AVX-512F/BW/VL and
/// AVX-512 VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn gemv8_q6k_vnni512(a: Int8Args, tiles: usize, y: *mut f32) {
    // Per 16-bit lane, for sub-blocks `b = 4n + s2` (first 256-bit half)
    // and `b + 2` (second): the `ql` nibbles' shift, and per `s2` the `qh`
    // bit pairs'.
    let halves =
        |u: i16, v: i16| _mm512_inserti64x4::<1>(_mm512_set1_epi16(u), _mm256_set1_epi16(v));
    let ql_shift = halves(0, 4);
    let qh_shift = [halves(0, 4), halves(2, 6)];
    let (low4, low2) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(3));
    let quants = |ql: __m512i, qh: __m512i, s2: usize| {
        let lo = _mm512_and_si512(_mm512_srlv_epi16(ql, ql_shift), low4);
        let hi = _mm512_and_si512(_mm512_srlv_epi16(qh, qh_shift[s2]), low2);
        // Each byte of `hi` holds 0..4: a 16-bit shift stays within its
        // byte.
        _mm512_or_si512(lo, _mm512_slli_epi16::<4>(hi))
    };
    // SAFETY: forwarded contract.
    unsafe { q6k_vnni512(a, tiles, y, quants) }
}

/// [`gemv8_q6k_vnni512`] with GFNI: each byte's bits are picked and placed
/// by one `vgf2p8affineqb` (an 8x8 bit matrix per 64-bit lane, so one per
/// 256-bit half): the `ql` nibble to bits 0..4, the `qh` bit pair to bits
/// 4..6, then an OR: three operations per row and 64 weights where the
/// shifts and masks take six. The same quants, so the same outputs.
///
/// # Safety
/// As [`gemv8_q6k_vnni512`]; the CPU must also support GFNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
pub(crate) unsafe fn gemv8_q6k_gfni512(a: Int8Args, tiles: usize, y: *mut f32) {
    let ql_bits = halves64(
        bit_matrix(&[(0, 0), (1, 1), (2, 2), (3, 3)]),
        bit_matrix(&[(0, 4), (1, 5), (2, 6), (3, 7)]),
    );
    let qh_bits = [(0, 4), (2, 6)].map(|(u, v)| {
        halves64(
            bit_matrix(&[(4, u), (5, u + 1)]),
            bit_matrix(&[(4, v), (5, v + 1)]),
        )
    });
    let quants = |ql: __m512i, qh: __m512i, s2: usize| {
        _mm512_or_si512(
            _mm512_gf2p8affine_epi64_epi8::<0>(ql, ql_bits),
            _mm512_gf2p8affine_epi64_epi8::<0>(qh, qh_bits[s2]),
        )
    };
    // SAFETY: forwarded contract.
    unsafe { q6k_vnni512(a, tiles, y, quants) }
}

/// The `vgf2p8affineqb` matrix that sets output bit `o` of each byte to its
/// input bit `i` for each `(o, i)` in `picks`, and every other bit to 0
/// (output bit `o` is the parity of the input and the matrix's byte
/// `7 - o`).
const fn bit_matrix(picks: &[(u32, u32)]) -> i64 {
    let mut m = 0u64;
    let mut k = 0;
    while k < picks.len() {
        let (o, i) = picks[k];
        m |= (1u64 << i) << (8 * (7 - o));
        k += 1;
    }
    m as i64
}

/// `u` in each 64-bit lane of the low 256 bits, `v` in the high.
#[target_feature(enable = "avx512f,avx2")]
#[inline]
fn halves64(u: i64, v: i64) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_set1_epi64(u), _mm256_set1_epi64x(v))
}

/// The Q6_K VNNI GEMV's body ([`gemv8_q6k_vnni512`]), the six-bit quants
/// of a row's sub-blocks `4n + s2` (low 256 bits) and `4n + s2 + 2` (high)
/// formed by `quants(ql, qh, s2)` from its 32 `ql` and 32 `qh` bytes of
/// them, each broadcast to both halves.
///
/// # Safety
/// As [`gemv8_q6k_vnni512`], the CPU supporting what `quants` uses.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn q6k_vnni512(
    a: Int8Args,
    tiles: usize,
    y: *mut f32,
    quants: impl Fn(__m512i, __m512i, usize) -> __m512i,
) {
    let ones = _mm512_set1_epi8(1);
    // No minimum: `mins` stays zero.
    let block =
        |s: usize, p: &[*const u8; 8], sc: &[Scales8; 8], acc: &mut __m256, _: &mut __m256| {
            for n in 0..2 {
                // Sub-blocks 4n + k (k < 4): per pair `s2` (4n + s2 and
                // 4n + s2 + 2), each's two halves' sums for the eight rows.
                let mut sums = [[_mm256_setzero_si256(); 2]; 4];
                let mut dx = [0f32; 4];
                for s2 in 0..2 {
                    let (b0, b1) = (4 * n + s2, 4 * n + s2 + 2);
                    // SAFETY: activation blocks `8s + b0`, `8s + b1` are in
                    // bounds (fn contract).
                    let [x0, x1] = [b0, b1].map(|b| unsafe { &*a.x.add(8 * s + b) });
                    (dx[s2], dx[s2 + 2]) = (x0.d, x1.d);
                    // SAFETY: each `q` is 32 readable bytes.
                    let [q0, q1] =
                        [x0, x1].map(|b| unsafe { _mm256_loadu_si256(b.q.as_ptr().cast()) });
                    let xx = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q0), q1);
                    let prod: [__m512i; 8] = std::array::from_fn(|r| {
                        // SAFETY: `ql` is bytes 0..128 of the stored block
                        // at `p[r]` (read at 64 n + 32 s2 .. + 32) and `qh`
                        // 128..192 (read at 128 + 32 n .. + 32).
                        let (ql, qh) = unsafe {
                            (
                                _mm256_loadu_si256(p[r].add(64 * n + 32 * s2).cast()),
                                _mm256_loadu_si256(p[r].add(128 + 32 * n).cast()),
                            )
                        };
                        let q = quants(_mm512_broadcast_i64x4(ql), _mm512_broadcast_i64x4(qh), s2);
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xx)
                    });
                    // The activations' sums per 16-element half, chunk by
                    // chunk (a chunk is a half), in every lane of it.
                    let xs = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, xx);
                    let xs = _mm512_add_epi32(xs, _mm512_shuffle_epi32::<0x4E>(xs));
                    let xs = _mm512_add_epi32(xs, _mm512_shuffle_epi32::<0xB1>(xs));
                    let (lo, hi) = fold8(prod);
                    // Sub-block b0's halves (chunks 0, 1) and b1's (2, 3),
                    // less 32 sum(x) of theirs.
                    for (k, (c, d)) in [(0, 1), (2, 3)].into_iter().enumerate() {
                        let at: [i32; 16] = std::array::from_fn(|l| 4 * [c, d][l / 8]);
                        // SAFETY: `at` is 16 readable i32.
                        let at = unsafe { _mm512_loadu_si512(at.as_ptr().cast()) };
                        let bias = _mm512_permutexvar_epi32(at, xs);
                        let v =
                            _mm512_sub_epi32(chunks(lo, hi, c, d), _mm512_slli_epi32::<5>(bias));
                        sums[s2 + 2 * k] =
                            [_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v)];
                    }
                }
                for (k, [h0, h1]) in sums.into_iter().enumerate() {
                    let scj = &sc[4 * n + k];
                    let dx = _mm256_set1_ps(dx[k]);
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h0), _mm256_mul_ps(scj.d0, dx), *acc);
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h1), _mm256_mul_ps(scj.d1, dx), *acc);
                }
            }
        };
    // SAFETY: forwarded contract; `block` reads stored block `s` of the
    // tile's rows and activation blocks `8s..8s + 8`, in bounds.
    unsafe { tiles8::<Q6KB>(a, tiles, y, block) }
}
