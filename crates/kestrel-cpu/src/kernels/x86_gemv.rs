//! The single-stream GEMV of the fast numerics on AVX2 ([`gemv8_256`],
//! and for Q4_K [`gemv8_q4k_pair256`]): eight weight rows per tile, one
//! output per lane of a 256-bit register, reading every weight type in its
//! file encoding. All the GEMVs, the AVX-512 ones in `x86_gemv512.rs`
//! included, walk the weights the same way ([`tiles8`]).
//!
//! Single-stream decode streams each weight byte once, so this kernel must
//! keep up with DRAM: per weight byte it may spend only a few instructions.
//! What costs is not the integer dot (`vpmaddubsw` + `vpmaddwd` per 32
//! weights) but the scales around it, so [`Tile8::scales8`] decodes them
//! once per stored block for the tile's eight rows (`x86_tile8.rs`), and
//! the 32-element loop reads each sub-block's scales ready in lane order.
//! Q4_0, Q5_0 and Q6_K weights (`q - 8/16/32`) are read unsigned and the
//! bias comes off the integer sums once per eight rows (`BIAS * sum(x)`,
//! formed once per activation block for every tile), not by signing every
//! row's bytes.
//!
//! Results are `int8.rs`'s definition bit for bit: per output, block by
//! block in order, `acc = fma(float(isum), d_w * d_x, acc)` (Q6_K's halves
//! first then second), minimums in a second sum. `d_w = d * sc` and
//! `m_w = -(dmin * m)` are exact in f32 however they are formed.

use std::arch::x86_64::*;

use super::int8::Q8Block;
use super::x86::{gemv_next_block_l1, gemv_prefetch_tiles, prefetch_l1, prefetch_l2};
use super::x86_blocks::Q4KB;
use super::x86_int8::Int8Args;
use super::x86_tile8::{Scales8, Tile8};

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
pub(super) unsafe fn tiles8<B: Tile8>(
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
