//! The many-row side of the fast numerics on x86 (AVX2 and AVX-512 VNNI):
//! weight rows unpacked once to [`I8Block`]s ([`unpack_rows256`]; for the
//! AMX sweep whole 16-row tiles to [`TileBlock`]s), then
//! swept against [`LaneRows`], one activation row per SIMD lane: every
//! weight block's four-byte groups are broadcast against the same group of
//! each row, so a block's integer sums land one per lane without a
//! horizontal step ([`lanes_sweep256`], 8 rows; with AVX-512 VNNI
//! [`lanes_vnni256`], 8, and [`lanes_vnni512`], 16, or two groups of 16
//! for each broadcast). The weights are
//! unpacked as unsigned bytes `w + offset` ([`super::int8::lane_offset`];
//! all but Q8_0's on AVX2, swept signed: `|x|` against `w * sgn(x)`,
//! [`lanes_sweep256_absx`], unless a weight is -128), their sums starting
//! at `-offset * sum(x)`.
//! With one lane group nothing reuses an unpacked row: Q8_0 and Q4_K are
//! swept straight from their stored blocks ([`StoredRows`];
//! [`q8_0_vnni256`], [`q4_k_vnni256`], [`q8_0_lanes256`],
//! [`q4_k_lanes256`]); with VNNI so are up to 32 rows of Q4_K
//! ([`q4_k_vnni512`]) and of Q4_0, Q4_1 and Q8_0 ([`stored_vnni256`],
//! [`stored_vnni512`]: the VNNI sweep's body reading stored blocks). On
//! AVX2 CPUs with AVX-VNNI (`super::Isa::AvxVnni`) the 8-lane VNNI
//! sweeps run as second instances compiled for it ([`lanes_avxvnni256`],
//! [`stored_avxvnni256`], [`q8_0_avxvnni256`], [`q4_k_avxvnni256`]: the
//! same bodies with the VEX `vpdpbusd`). Long
//! rows can be swept a chunk of blocks at a time, the sums carried between
//! chunks ([`Carry`]).
//! Results are `int8.rs`'s definition bit for bit (tests in `x86_int8.rs`).

use std::arch::x86_64::*;

use super::int8::LaneRows;
use super::weight::Encoding;
use super::x86::{prefetch_l1, prefetch_l2};
use super::x86_blocks::{scales, Q4KB};
use super::x86_gemv::{Scales8, Tile8};
use super::x86_int8::Int8Block;

/// A weight block unpacked once for the lane sweeps ([`unpack_rows256`]):
/// its integer weights plus the sweep's offset as bytes (unsigned but for
/// Q8_0's on AVX2), the scales of elements 0..16 and 16..32, and the
/// minimum (0 when none). One cache line.
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct I8Block {
    pub(super) q: [i8; 32],
    pub(super) d: [f32; 2],
    pub(super) m: f32,
}

/// Weight rows per [`TileBlock`] (the AMX sweep's tile).
pub(crate) const TILE_ROWS: usize = 16;

/// One block of [`TILE_ROWS`] weight rows unpacked for the AMX sweep
/// (`super::x86_amx::lanes_amx`), one-scale types only: the rows' integer
/// weights plus offset, 32 bytes each and contiguous (the tile's left
/// operand, 8 lines), then their scales and minimums, a line each. Ten
/// lines where sixteen [`I8Block`]s take sixteen, and the float steps read
/// a block's 16 scales from one line.
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy)]
pub(crate) struct TileBlock {
    pub(super) q: [[u8; 32]; TILE_ROWS],
    pub(super) d: [f32; TILE_ROWS],
    pub(super) m: [f32; TILE_ROWS],
}

/// [`I8Block`] slots one [`TileBlock`] takes in an unpack buffer.
pub(crate) const TILE_SLOTS: usize =
    std::mem::size_of::<TileBlock>() / std::mem::size_of::<I8Block>();
const _: () =
    assert!(TILE_SLOTS * std::mem::size_of::<I8Block>() == std::mem::size_of::<TileBlock>());

/// How many rows ahead [`unpack_rows256`] prefetches (rows are contiguous;
/// past the group it reads the next one's).
const UNPACK_AHEAD_ROWS: usize = 4;

/// Where [`unpack_rows256`] puts the rows after a group's whole tiles
/// (`tiled` rows of `nblocks` blocks laid out as [`TileBlock`]s): row
/// after row of [`I8Block`]s from the returned slot on.
#[inline(always)]
pub(crate) fn after_tiles(tiled: usize, nblocks: usize) -> usize {
    tiled / TILE_ROWS * nblocks * TILE_SLOTS
}

/// Unpack `rows` weight rows of `nblocks` blocks of `B` (row `r` at
/// `w + r * row_bytes`) into `out`, for [`lanes_vnni256`] and
/// [`lanes_vnni512`] if `VNNI`, else [`lanes_sweep256`] (the weights plus
/// [`Int8Block::VNNI_OFFSET`] or [`Int8Block::LANE_OFFSET`]): row after row
/// of [`I8Block`]s, or with `tiles` (the AMX sweep's layout, VNNI and
/// one-scale `B` only) the whole [`TILE_ROWS`]-row tiles first as
/// [`TileBlock`]s (tile `t`'s block `b` at `t * nblocks + b`), then the
/// rest row after row from slot [`after_tiles`] on. Returns whether some
/// weight is -128, for Q8_0 without `VNNI` (which [`lanes_sweep256_absx`]
/// cannot take); `false` for every other sweep.
///
/// # Safety
/// `w` must be valid for those rows, `out` for `rows * nblocks` blocks
/// (at least what either layout takes); the CPU must support AVX2, FMA and
/// F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn unpack_rows256<B: Tile8, const VNNI: bool>(
    w: *const u8,
    row_bytes: usize,
    rows: usize,
    nblocks: usize,
    tiles: bool,
    out: *mut I8Block,
) -> bool {
    // `quants` gives `w + BIAS`.
    let offset = if VNNI { B::VNNI_OFFSET } else { B::LANE_OFFSET };
    let shift = _mm256_set1_epi8((offset - B::BIAS) as i8);
    let tiled = if tiles {
        debug_assert!(VNNI && !B::TWO);
        let tiled = rows / TILE_ROWS * TILE_ROWS;
        // SAFETY: forwarded contract, for rows 0..tiled.
        unsafe { unpack_tiles::<B>(w, row_bytes, tiled, nblocks, shift, out.cast()) };
        tiled
    } else {
        0
    };
    let mut sc = Scales8::zeros();
    let block_bytes = B::ENC.block_bytes();
    let stored = nblocks / B::SUB;
    // For AVX2's Q8_0 sweeps: whether a weight is -128 (bytes equal to it).
    let watch = !VNNI && B::ENC == Encoding::Q8_0;
    let (lowest, mut seen) = (_mm256_set1_epi8(i8::MIN), _mm256_setzero_si256());
    for r in tiled..rows {
        let row = w.wrapping_add(r * row_bytes);
        let own = out.wrapping_add(after_tiles(tiled, nblocks) + (r - tiled) * nblocks);
        let mut s0 = 0;
        while s0 < stored {
            // One-scale blocks eight at a time, their scales decoded at once
            // (block `s0 + i` in lane `i`; one block's scale in all eight
            // lanes cost a quarter of Q8_0's unpack and a third of Q4_0's);
            // a K-quant super-block alone, decoded once for its sub-blocks.
            let n = if B::SUB == 1 { 8.min(stored - s0) } else { 1 };
            let p = |i: usize| row.wrapping_add((s0 + i.min(n - 1)) * block_bytes);
            // Decode streams the weights from DRAM once: ask for the same
            // blocks `UNPACK_AHEAD_ROWS` rows on.
            let ahead = p(0).wrapping_add(UNPACK_AHEAD_ROWS * row_bytes);
            for line in 0..(n * block_bytes).div_ceil(64) {
                prefetch_l2(ahead.wrapping_add(64 * line));
            }
            // SAFETY: stored blocks s0..s0 + n of row `r` are in bounds (fn
            // contract); `p` repeats the last one.
            unsafe { B::scales8(&std::array::from_fn(p), &mut sc) };
            let [d0, d1, m] = sc[0].lanes();
            for i in 0..n {
                for (j, scj) in sc.iter().enumerate().take(B::SUB) {
                    // SAFETY: as above, `j < SUB`.
                    let q = unsafe { B::quants(p(i), j) };
                    let q = if offset != B::BIAS {
                        _mm256_add_epi8(q, shift)
                    } else {
                        q
                    };
                    if watch {
                        seen = _mm256_or_si256(seen, _mm256_cmpeq_epi8(q, lowest));
                    }
                    // Block `s0 + i`'s lane, or the super-block's.
                    let (d, m) = if B::SUB == 1 {
                        ([d0[i], d1[i]], m[i])
                    } else {
                        let [d0, d1, m] = scj.lanes();
                        ([d0[0], d1[0]], m[0])
                    };
                    // SAFETY: row `r`'s block `(s0 + i) * SUB + j` lies
                    // within the layout's `rows * nblocks` slots of `out`
                    // (fn contract); `q` is its first 32 bytes.
                    unsafe {
                        let o = own.add((s0 + i) * B::SUB + j);
                        _mm256_storeu_si256((*o).q.as_mut_ptr() as *mut __m256i, q);
                        (*o).d = d;
                        (*o).m = m;
                    }
                }
            }
            s0 += n;
        }
    }
    _mm256_testz_si256(seen, seen) == 0
}

/// [`unpack_rows256`]'s whole tiles: `rows` (a multiple of [`TILE_ROWS`])
/// weight rows unpacked for VNNI into [`TileBlock`]s at `out`, eight rows
/// at a time: per stored block, the eight rows' scales decoded at once
/// ([`Tile8::scales8`], row `i` in lane `i`) and stored as they come, a
/// vector each, beside the rows' quants (plus `shift`). A K-quant's
/// scales are decoded once for eight rows, not once per row.
///
/// # Safety
/// As [`unpack_rows256`] for those rows, `B` one-scale; `out` valid for
/// `rows / TILE_ROWS * nblocks` tile blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_tiles<B: Tile8>(
    w: *const u8,
    row_bytes: usize,
    rows: usize,
    nblocks: usize,
    shift: __m256i,
    out: *mut TileBlock,
) {
    let mut sc = Scales8::zeros();
    let block_bytes = B::ENC.block_bytes();
    for r0 in (0..rows).step_by(8) {
        let (tile, half) = (out.wrapping_add(r0 / TILE_ROWS * nblocks), r0 % TILE_ROWS);
        for s in 0..nblocks / B::SUB {
            let p: [*const u8; 8] =
                std::array::from_fn(|i| w.wrapping_add((r0 + i) * row_bytes + s * block_bytes));
            // Decode streams the weights from DRAM once: ask for the next
            // eight rows' same block.
            for pi in p {
                for line in 0..block_bytes.div_ceil(64) {
                    prefetch_l2(pi.wrapping_add(8 * row_bytes + 64 * line));
                }
            }
            // SAFETY: stored block `s` of rows r0..r0 + 8 is in bounds (fn
            // contract).
            unsafe { B::scales8(&p, &mut sc) };
            for (j, scj) in sc.iter().enumerate().take(B::SUB) {
                // SAFETY: tile block `s * SUB + j` is in bounds (fn
                // contract), its quant rows, scales and minimums
                // `half..half + 8` those of rows r0..r0 + 8; each `p[i]` is
                // one stored block, `j < SUB`.
                unsafe {
                    let o = tile.add(s * B::SUB + j);
                    _mm256_storeu_ps((*o).d.as_mut_ptr().add(half), scj.d0);
                    _mm256_storeu_ps((*o).m.as_mut_ptr().add(half), scj.m);
                    for (i, &pi) in p.iter().enumerate() {
                        let q = B::quants(pi, j);
                        let q = if B::VNNI_OFFSET != B::BIAS {
                            _mm256_add_epi8(q, shift)
                        } else {
                            q
                        };
                        _mm256_storeu_si256((*o).q[half + i].as_mut_ptr() as *mut __m256i, q);
                    }
                }
            }
        }
    }
}

/// Pointers into one group of [`LaneRows`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct LaneArgs {
    /// The group's first block of four-byte groups.
    pub q: *const u8,
    /// The group's first block of scales.
    pub d: *const f32,
    /// The group's first block of sums.
    pub s: *const f32,
    /// The group's first block of integer sums per half.
    pub sums: *const i32,
}

impl LaneArgs {
    /// Group `g` of `x` (the pointers are only computed; the sweep that
    /// reads them states its bounds).
    pub fn group(x: &LaneRows, g: usize) -> Self {
        let blocks = g * x.nblocks;
        Self {
            q: x.q.as_ptr().wrapping_add(blocks * 32 * x.lanes),
            d: x.d.as_ptr().wrapping_add(blocks * x.lanes),
            s: x.s.as_ptr().wrapping_add(blocks * x.lanes),
            sums: x.sums.as_ptr().wrapping_add(blocks * 2 * x.lanes),
        }
    }

    /// The same group from block `b0` on, for `lanes`-lane groups.
    pub fn skip_blocks(self, b0: usize, lanes: usize) -> Self {
        Self {
            q: self.q.wrapping_add(b0 * 32 * lanes),
            d: self.d.wrapping_add(b0 * lanes),
            s: self.s.wrapping_add(b0 * lanes),
            sums: self.sums.wrapping_add(b0 * 2 * lanes),
        }
    }
}

/// Where a VNNI lane sweep ([`lanes_vnni512`], [`lanes_vnni256`]) over
/// one chunk of its rows' blocks starts and leaves the definition's two
/// sums, for rows swept a chunk of blocks at a time
/// (`matmul_int8::lanes_rows_task`: past `CHUNK_BLOCKS`, so that one
/// chunk of every lane group's activations stays in L2 for more weight
/// rows). The first chunk starts the sums at +0.0 as a whole row does,
/// later ones read back what the one before left here, the last writes
/// the outputs. Each sum still runs block after block, so the results are
/// the same bit for bit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Carry {
    /// Row `r`'s sums against group `g` of the sweep's groups: the first
    /// sum's lanes at `p + r * stride + 2 * g * lanes`, the minimums'
    /// right after them.
    pub p: *mut f32,
    /// Floats from one row's sums to the next row's.
    pub stride: usize,
    /// Whether this chunk starts the rows (the sums start at +0.0).
    pub first: bool,
    /// Whether it ends them (the outputs are written, not the sums).
    pub last: bool,
}

impl Carry {
    /// The sums of the rows from row `r` on (the pointer is only computed).
    pub fn rows_from(self, r: usize) -> Self {
        Self {
            p: self.p.wrapping_add(r * self.stride),
            ..self
        }
    }
}

/// Write lanes `0..cn` of `v` (activation rows) as outputs of weight row
/// `row`: lane `c` to `y[c * y_stride + row]`.
///
/// # Safety
/// `y` must be valid for writing those elements; `cn <= N`.
#[inline(always)]
pub(super) unsafe fn scatter<const N: usize>(
    v: [f32; N],
    cn: usize,
    y: *mut f32,
    y_stride: usize,
    row: usize,
) {
    for (c, v) in v.into_iter().take(cn).enumerate() {
        // SAFETY: in bounds (fn contract).
        unsafe { *y.add(c * y_stride + row) = v };
    }
}

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

/// The lane sweep with AVX-512 VNNI, at one register width (`$lanes`
/// activation rows per group), against `G` consecutive lane groups at
/// once: `vpdpbusd` adds four products of unsigned by signed bytes to each
/// i32 lane, so a block's sums land in i32 with no i16 step. Every type's
/// weights come unsigned, `w + offset` ([`Int8Block::VNNI_OFFSET`]),
/// against `x`, the sums starting at `-offset * sum(x)` (once per block
/// and group for the tile), which leaves `sum(w * x)` exactly. Per block
/// and four-byte step, each group's activations are loaded once for the
/// tile's `R` rows and each row's four weight bytes broadcast once for the
/// `G` groups: a `vpdpbusd` needs its broadcast and its activations from
/// memory, and the load ports, not the multipliers, bound a sweep of one
/// group (Zen 5: one `vpdpbusd` per cycle of the two it can issue), so two
/// groups take a broadcast to two. The minimums' sum runs beside.
///
/// `$unpacked` sweeps rows unpacked to [`I8Block`]s. `$stored` sweeps
/// Q4_0, Q4_1 and Q8_0 rows straight from their stored blocks, where an
/// unpack would be read by one sweep only (up to 32 activation rows; the
/// default 135M model is Q4_1: at 32 streams its unpack took 20% of a
/// decode's samples, the sweep reading it 32%): each row's four bytes are
/// made `w + offset` in place once for the `G` groups (a Q4 block's
/// elements 0..16 are its 16 quant bytes' low nibbles, 16..32 their high
/// ones, shifted down, both masked; Q8_0's bytes take 128, their top bit
/// flipped), its scale and minimum read from the block's f16s. Both run
/// `$sweep`'s one body, so every sum and float step is the same.
///
/// Lanes `0..cn` of the `G` groups (group `g` lanes `g * $lanes..`; every
/// group holds one of them) are written: element `(r, c)` to
/// `y[c * y_stride + r]`; with a [`Carry`] (`nblocks` one chunk of the
/// rows' blocks; unpacked rows only), only by the last chunk, the sums
/// starting from and left in the carry otherwise.
///
/// # Safety
/// `$unpacked`: `w` must be valid for `R * tiles * nblocks` blocks
/// unpacked for VNNI from `B`; `$stored`: `w` for `R * tiles` rows of
/// `w.nblocks` blocks of `B` (Q4_0, Q4_1 or Q8_0). Each of `x` must be
/// valid for those blocks of a `$lanes`-lane group (with their integer
/// sums where the offset is not 0), `y` for writing every element `(r, c
/// < cn)`; `(G - 1) * $lanes < cn <= G * $lanes`; a carry valid for
/// reading and writing its `R * tiles` rows' sums for the `G` groups,
/// holding what the chunk before left there unless `first`; the CPU must
/// support `$features` (AVX-512F/BW/VL, AVX-512 VNNI, AVX2, FMA and F16C;
/// for the AVX-VNNI instance AVX2, FMA, F16C and AVX-VNNI).
macro_rules! lanes_vnni {
    ($(#[$doc:meta])* $features:literal, $unpacked:ident, $stored:ident, $sweep:ident, $lanes:literal,
     $loadu:ident, $loadu_ps:ident, $storeu_ps:ident, $set1_epi32:ident, $set1_epi8:ident,
     $setzero:ident, $add_epi32:ident, $mullo:ident, $and:ident, $xor:ident,
     $srli_epi16:ident, $dpbusd:ident, $cvt:ident, $set1_ps:ident, $mul_ps:ident,
     $fmadd_ps:ident, $add_ps:ident, $setzero_ps:ident) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        pub(crate) unsafe fn $unpacked<B: Int8Block, const R: usize, const G: usize>(
            w: *const I8Block,
            nblocks: usize,
            tiles: usize,
            x: [LaneArgs; G],
            cn: usize,
            y: *mut f32,
            y_stride: usize,
            carry: Option<Carry>,
        ) {
            let block = std::mem::size_of::<I8Block>();
            let rows = StoredRows { w: w.cast(), row_bytes: nblocks * block, nblocks };
            // SAFETY: forwarded contract.
            unsafe { $sweep::<B, R, G, false>(rows, block, tiles, x, cn, y, y_stride, carry) }
        }

        $(#[$doc])*
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $stored<B: Int8Block, const R: usize, const G: usize>(
            w: StoredRows,
            tiles: usize,
            x: [LaneArgs; G],
            cn: usize,
            y: *mut f32,
            y_stride: usize,
        ) {
            debug_assert!(matches!(B::ENC, Encoding::Q4_0 | Encoding::Q4_1 | Encoding::Q8_0));
            let block = B::ENC.block_bytes();
            // SAFETY: forwarded contract.
            unsafe { $sweep::<B, R, G, true>(w, block, tiles, x, cn, y, y_stride, None) }
        }

        /// The body of both: `rows` laid out as [`StoredRows`] says, a
        /// block every `block` bytes.
        #[target_feature(enable = $features)]
        #[inline]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $sweep<B: Int8Block, const R: usize, const G: usize, const STORED: bool>(
            rows: StoredRows,
            block: usize,
            tiles: usize,
            x: [LaneArgs; G],
            cn: usize,
            y: *mut f32,
            y_stride: usize,
            carry: Option<Carry>,
        ) {
            debug_assert!((G - 1) * $lanes < cn && cn <= G * $lanes);
            let StoredRows { w, row_bytes, nblocks } = rows;
            // Row `r`'s sums against group `g` in the carry.
            let kept = |c: Carry, r: usize, g: usize| c.p.wrapping_add(r * c.stride + 2 * g * $lanes);
            let offset = B::VNNI_OFFSET;
            let neg_offset = $set1_epi32(-offset);
            let halves = if B::TWO { 2 } else { 1 };
            // Stored: Q8_0's quants follow its scale, a Q4's 16 end the block.
            let q8 = B::ENC == Encoding::Q8_0;
            let quants = if q8 { 2 } else { block - 16 };
            let (nibble, top) = ($set1_epi8(0x0f), $set1_epi8(i8::MIN));
            for t in 0..tiles {
                let wt = w.wrapping_add(R * t * row_bytes);
                let mut acc = [[$setzero_ps(); G]; R];
                let mut mins = [[$setzero_ps(); G]; R];
                if let Some(c) = carry.filter(|c| !c.first) {
                    for r in 0..R {
                        for g in 0..G {
                            let p = kept(c, R * t + r, g);
                            // SAFETY: the carry holds row R t + r's sums for
                            // group g (fn contract).
                            unsafe {
                                acc[r][g] = $loadu_ps(p);
                                mins[r][g] = $loadu_ps(p.add($lanes));
                            }
                        }
                    }
                }
                for b in 0..nblocks {
                    // The sums start at -offset * sum(x) per half (one start
                    // for a one-scale block), the same for every row. (No
                    // closures over vectors here or below: one left
                    // uninlined passes its vectors through memory.)
                    let mut start = [[$setzero(); 2]; G];
                    if offset != 0 {
                        for (st, x) in start.iter_mut().zip(&x) {
                            // SAFETY: block b's 2 x $lanes integer sums are
                            // in bounds (fn contract).
                            let (lo, hi) = unsafe {
                                (
                                    $loadu(x.sums.add($lanes * 2 * b).cast()),
                                    $loadu(x.sums.add($lanes * (2 * b + 1)).cast()),
                                )
                            };
                            if B::TWO {
                                *st = [$mullo(lo, neg_offset), $mullo(hi, neg_offset)];
                            } else {
                                st[0] = $mullo($add_epi32(lo, hi), neg_offset);
                            }
                        }
                    }
                    let blk: [*const u8; R] =
                        std::array::from_fn(|r| wt.wrapping_add(r * row_bytes + b * block));
                    // Stored rows stream from memory: the same blocks of the
                    // next tile's rows, a line (three or more blocks) at a
                    // time, into L1 (this sweep is bound by its multiplies,
                    // not by DRAM: the default 135M model's 32 streams ran
                    // about 4% slower with the lines left in L2).
                    if STORED && b % 3 == 0 {
                        for p in blk {
                            prefetch_l1(p.wrapping_add(R * row_bytes));
                        }
                    }
                    let mut sums = [start; R];
                    for k in 0..8 {
                        let h = if B::TWO { k / 4 } else { 0 };
                        let mut xk = [$setzero(); G];
                        for (xk, x) in xk.iter_mut().zip(&x) {
                            // SAFETY: block b's four-byte step k of every
                            // group is in bounds (fn contract).
                            *xk = unsafe { $loadu(x.q.add(32 * $lanes * b + 4 * $lanes * k).cast()) };
                        }
                        // Elements 4k..4k + 4: an unpacked block's bytes 4k..
                        // (`I8Block::q` leads), Q8_0's quant bytes 4k.., a
                        // Q4's nibble k / 4 of quant bytes 4 (k % 4)...
                        let at = if !STORED {
                            4 * k
                        } else if q8 {
                            quants + 4 * k
                        } else {
                            quants + 4 * (k % 4)
                        };
                        for (r, sr) in sums.iter_mut().enumerate() {
                            // SAFETY: those four bytes are in row r's block b
                            // (fn contract).
                            let four = $set1_epi32(unsafe {
                                (blk[r].add(at) as *const i32).read_unaligned()
                            });
                            let wk = if !STORED {
                                four
                            } else if q8 {
                                $xor(four, top)
                            } else if k < 4 {
                                $and(four, nibble)
                            } else {
                                $and($srli_epi16::<4>(four), nibble)
                            };
                            for (s, xk) in sr.iter_mut().zip(xk) {
                                s[h] = $dpbusd(s[h], wk, xk);
                            }
                        }
                    }
                    // A stored block's scale and minimum, from its f16s (an
                    // unpacked block's are read in place below, broadcast
                    // from memory).
                    let stored: [[f32; 2]; R] = std::array::from_fn(|r| {
                        if !STORED {
                            return [0.0; 2];
                        }
                        // SAFETY: row r's block b starts with its scale's
                        // f16, Q4_1's minimum's next (fn contract).
                        let v = unsafe { scales(blk[r]) };
                        [_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v))]
                    });
                    // Row r's scale of half h, and its minimum.
                    let scale = |r: usize, h: usize| {
                        if STORED {
                            stored[r][0]
                        } else {
                            // SAFETY: row r's block b is an I8Block (fn
                            // contract).
                            unsafe { (*blk[r].cast::<I8Block>()).d[h] }
                        }
                    };
                    let min = |r: usize| {
                        if STORED {
                            stored[r][1]
                        } else {
                            // SAFETY: as above.
                            unsafe { (*blk[r].cast::<I8Block>()).m }
                        }
                    };
                    for (g, x) in x.iter().enumerate() {
                        // SAFETY: block b's $lanes scales and sums of the
                        // group are in bounds (fn contract).
                        let (dx, sx) = unsafe {
                            ($loadu_ps(x.d.add($lanes * b)), $loadu_ps(x.s.add($lanes * b)))
                        };
                        for r in 0..R {
                            for h in 0..halves {
                                let dd = $mul_ps($set1_ps(scale(r, h)), dx);
                                acc[r][g] = $fmadd_ps($cvt(sums[r][g][h]), dd, acc[r][g]);
                            }
                            // Without a minimum the definition's sum stays +0.0.
                            if B::HAS_MIN {
                                mins[r][g] = $fmadd_ps($set1_ps(min(r)), sx, mins[r][g]);
                            }
                        }
                    }
                }
                if let Some(c) = carry.filter(|c| !c.last) {
                    for r in 0..R {
                        for g in 0..G {
                            let p = kept(c, R * t + r, g);
                            // SAFETY: as above.
                            unsafe {
                                $storeu_ps(p, acc[r][g]);
                                $storeu_ps(p.add($lanes), mins[r][g]);
                            }
                        }
                    }
                    continue;
                }
                for r in 0..R {
                    for g in 0..G {
                        let mut out = [0f32; $lanes];
                        let lanes = (cn - g * $lanes).min($lanes);
                        // SAFETY: `out` is $lanes writable floats; elements
                        // (R t + r, g * $lanes + c) for c < lanes are in
                        // bounds (fn contract).
                        unsafe {
                            $storeu_ps(out.as_mut_ptr(), $add_ps(acc[r][g], mins[r][g]));
                            scatter(out, lanes, y.add(g * $lanes * y_stride), y_stride, R * t + r);
                        }
                    }
                }
            }
        }
    };
}

/// [`lanes_vnni`] on 8 lanes (256-bit registers) for a CPU with
/// `$features`, multiplying with `$dpbusd`.
macro_rules! lanes_vnni8 {
    ($(#[$doc:meta])* $features:literal, $unpacked:ident, $stored:ident, $sweep:ident,
     $dpbusd:ident) => {
        lanes_vnni!(
            $(#[$doc])*
            $features,
            $unpacked,
            $stored,
            $sweep,
            8,
            _mm256_loadu_si256,
            _mm256_loadu_ps,
            _mm256_storeu_ps,
            _mm256_set1_epi32,
            _mm256_set1_epi8,
            _mm256_setzero_si256,
            _mm256_add_epi32,
            _mm256_mullo_epi32,
            _mm256_and_si256,
            _mm256_xor_si256,
            _mm256_srli_epi16,
            $dpbusd,
            _mm256_cvtepi32_ps,
            _mm256_set1_ps,
            _mm256_mul_ps,
            _mm256_fmadd_ps,
            _mm256_add_ps,
            _mm256_setzero_ps
        );
    };
}

lanes_vnni8!(
    /// [`lanes_vnni`] on 8 lanes (256-bit registers, AVX-512 VL): up to 8
    /// activation rows.
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    lanes_vnni256,
    stored_vnni256,
    sweep_vnni256,
    _mm256_dpbusd_epi32
);
lanes_vnni8!(
    /// [`lanes_vnni`] on 8 lanes with AVX-VNNI (the VEX `vpdpbusd` of
    /// Intel's client cores since Alder Lake and of Sierra Forest, which
    /// have no AVX-512): [`lanes_vnni256`]'s body, instruction for
    /// instruction but the encoding, so the same sums bit for bit.
    "avx2,fma,f16c,avxvnni",
    lanes_avxvnni256,
    stored_avxvnni256,
    sweep_avxvnni256,
    _mm256_dpbusd_avx_epi32
);
lanes_vnni!(
    /// [`lanes_vnni`] on 16 lanes (512-bit registers): more than 8
    /// activation rows.
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    lanes_vnni512,
    stored_vnni512,
    sweep_vnni512,
    16,
    _mm512_loadu_si512,
    _mm512_loadu_ps,
    _mm512_storeu_ps,
    _mm512_set1_epi32,
    _mm512_set1_epi8,
    _mm512_setzero_si512,
    _mm512_add_epi32,
    _mm512_mullo_epi32,
    _mm512_and_si512,
    _mm512_xor_si512,
    _mm512_srli_epi16,
    _mm512_dpbusd_epi32,
    _mm512_cvtepi32_ps,
    _mm512_set1_ps,
    _mm512_mul_ps,
    _mm512_fmadd_ps,
    _mm512_add_ps,
    _mm512_setzero_ps
);

/// Weight rows in their stored encoding: row `r` at `w + r * row_bytes`,
/// `nblocks` 32-element blocks each.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StoredRows {
    pub w: *const u8,
    pub row_bytes: usize,
    pub nblocks: usize,
}

impl StoredRows {
    /// The rows from row `r` on (the pointer is only computed).
    pub fn skip(self, r: usize) -> Self {
        Self {
            w: self.w.wrapping_add(r * self.row_bytes),
            ..self
        }
    }
}

/// Block `b` of an 8-lane group: its eight 32-byte steps (four bytes of
/// each lane's row) and its eight scales.
///
/// # Safety
/// Block `b` of the group must be in bounds; the CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn group8(x: LaneArgs, b: usize) -> ([__m256i; 8], __m256) {
    // SAFETY: 256 bytes and 8 floats of block `b` (fn contract).
    unsafe {
        let q = x.q.add(256 * b);
        (
            std::array::from_fn(|k| _mm256_loadu_si256(q.add(32 * k).cast())),
            _mm256_loadu_ps(x.d.add(8 * b)),
        )
    }
}

/// Tile `t`'s `R` rows of 8-lane sums (and minimums' sums) to `y` as
/// [`scatter`] writes them.
///
/// # Safety
/// As [`scatter`] for rows `R t..R t + R`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn store_tile8<const R: usize>(
    acc: [__m256; R],
    mins: [__m256; R],
    t: usize,
    cn: usize,
    y: *mut f32,
    y_stride: usize,
) {
    for (r, (acc, mins)) in acc.into_iter().zip(mins).enumerate() {
        let mut out = [0f32; 8];
        // SAFETY: `out` is 8 writable floats; elements (R t + r, c < cn) are
        // in bounds (fn contract).
        unsafe {
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(acc, mins));
            scatter(out, cn, y, y_stride, R * t + r);
        }
    }
}

/// `tiles` consecutive `R`-row tiles of Q8_0 rows straight from their
/// stored blocks against one 8-lane group of [`LaneRows`]: per block, the
/// group's activations loaded once for the tile, `start(b)` where each
/// row's integer sums start, `dot(q, xk, start)` a row's sums from its 32
/// stored bytes `q`; the block's f16 scale read as the sums take the
/// definition's float step, the next tile's block prefetched.
///
/// # Safety
/// As [`q8_0_vnni256`], the CPU supporting what `start` and `dot` use.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q8_0_stored<const R: usize>(
    w: StoredRows,
    tiles: usize,
    x: LaneArgs,
    out: (usize, *mut f32, usize),
    start: impl Fn(usize) -> __m256i,
    dot: impl Fn(*const u8, &[__m256i; 8], __m256i) -> __m256i,
) {
    let (cn, y, y_stride) = out;
    debug_assert!(cn <= 8);
    let block = Encoding::Q8_0.block_bytes();
    for t in 0..tiles {
        let wt = w.skip(R * t);
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..w.nblocks {
            // SAFETY: block `b` of the group is in bounds (fn contract).
            let (xk, dx) = unsafe { group8(x, b) };
            let start = start(b);
            for (r, acc) in acc.iter_mut().enumerate() {
                let blk = wt.skip(r).w.wrapping_add(block * b);
                prefetch_l2(blk.wrapping_add(R * w.row_bytes));
                // SAFETY: block `b` of row `r` of the tile (f16 d, then 32
                // bytes) is in bounds (fn contract).
                let (all, d) = unsafe { (dot(blk.add(2), &xk, start), _mm_cvtss_f32(scales(blk))) };
                let dd = _mm256_mul_ps(_mm256_set1_ps(d), dx);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(all), dd, *acc);
            }
        }
        // Without a minimum the definition's sum stays +0.0.
        // SAFETY: rows R t..R t + R of `y` (fn contract).
        unsafe { store_tile8(acc, [_mm256_setzero_ps(); R], t, cn, y, y_stride) };
    }
}

/// Defines a [`q8_0_stored`] sweep with VNNI: `$name`, for a CPU with
/// `$features`, multiplying with `$dpbusd` (AVX-512 VL's or AVX-VNNI's).
macro_rules! q8_0_vnni {
    ($(#[$doc:meta])* $features:literal, $name:ident, $dpbusd:ident) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $name<const R: usize>(
            w: StoredRows,
            tiles: usize,
            x: LaneArgs,
            cn: usize,
            y: *mut f32,
            y_stride: usize,
        ) {
            let flip = _mm256_set1_epi8(i8::MIN);
            let neg_offset = _mm256_set1_epi32(-128);
            // SAFETY: block `b`'s 16 integer sums are in bounds (fn contract).
            let start = |b: usize| unsafe {
                let [lo, hi] = [0, 1].map(|h| _mm256_loadu_si256(x.sums.add(8 * (2 * b + h)).cast()));
                _mm256_mullo_epi32(_mm256_add_epi32(lo, hi), neg_offset)
            };
            // SAFETY: `q` holds the block's 32 bytes (q8_0_stored's contract).
            let dot = |q: *const u8, xk: &[__m256i; 8], start| unsafe {
                (0..8).fold(start, |s, k| {
                    let four = (q.add(4 * k) as *const i32).read_unaligned();
                    $dpbusd(s, _mm256_xor_si256(_mm256_set1_epi32(four), flip), xk[k])
                })
            };
            // SAFETY: forwarded contract; this CPU has VNNI.
            unsafe { q8_0_stored::<R>(w, tiles, x, (cn, y, y_stride), start, dot) }
        }
    };
}

q8_0_vnni!(
    /// [`q8_0_stored`] with VNNI, as [`lanes_vnni256`] computes Q8_0 from
    /// unpacked rows: each four-byte group broadcast from the block and made
    /// unsigned there (`w + 128`, a `vpxor` on a port the products leave
    /// idle), the sums starting at `-128 * sum(x)`. With one lane group (8
    /// activation rows or fewer) nothing reuses an unpack, and unpacking cost
    /// as much as the sweep.
    ///
    /// # Safety
    /// `w` must be valid for `R * tiles` rows of Q8_0 blocks, `x` for
    /// `w.nblocks` blocks of an 8-lane group with its integer sums, `y` for
    /// writing every element `(r, c < cn)`; `cn <= 8`; the CPU must support
    /// AVX-512F/BW/VL, AVX-512 VNNI, AVX2, FMA and F16C.
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    q8_0_vnni256,
    _mm256_dpbusd_epi32
);
q8_0_vnni!(
    /// [`q8_0_vnni256`] with AVX-VNNI (as [`lanes_avxvnni256`]): the same
    /// body and sums.
    ///
    /// # Safety
    /// As [`q8_0_vnni256`], the CPU supporting AVX2, FMA, F16C and AVX-VNNI.
    "avx2,fma,f16c,avxvnni",
    q8_0_avxvnni256,
    _mm256_dpbusd_avx_epi32
);

/// [`q8_0_stored`] on AVX2, as [`lanes_sweep256`] takes Q8_0: each
/// four-byte group's magnitude against the activations with its sign
/// (`vpmaddubsw`), widened every step.
///
/// # Safety
/// As [`q8_0_vnni256`] (no integer sums needed), the CPU supporting AVX2,
/// FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q8_0_lanes256<const R: usize>(
    w: StoredRows,
    tiles: usize,
    x: LaneArgs,
    cn: usize,
    y: *mut f32,
    y_stride: usize,
) {
    let ones = _mm256_set1_epi16(1);
    // SAFETY: `q` holds the block's 32 bytes (q8_0_stored's contract).
    let dot = |q: *const u8, xk: &[__m256i; 8], start| unsafe {
        (0..8).fold(start, |sum, k| {
            let wv = _mm256_set1_epi32((q.add(4 * k) as *const i32).read_unaligned());
            let prod = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xk[k], wv));
            _mm256_add_epi32(sum, _mm256_madd_epi16(prod, ones))
        })
    };
    // SAFETY: forwarded contract.
    unsafe {
        q8_0_stored::<R>(
            w,
            tiles,
            x,
            (cn, y, y_stride),
            |_| _mm256_setzero_si256(),
            dot,
        )
    }
}

/// `tiles` consecutive `R`-row tiles of Q4_K rows straight from their
/// stored blocks against one 8-lane group of [`LaneRows`]: per
/// super-block, the next tile's same bytes prefetched, the tile's rows'
/// scales decoded at once ([`Tile8::scales8`], row `r` in lane `r`) and
/// `split(sb, state)` handed their super-blocks (lanes past the tile
/// repeat its last row); per 32-element
/// sub-block `j`, the group's activations loaded once for the tile and
/// `dot(state, r, j, sb[r], xk)` row `r`'s integer sums, whose scale takes
/// `unit[j % 2]` in the definition's float step (a power of two, which
/// leaves the step's results as they were); the minimums' sum beside.
///
/// # Safety
/// As [`q4_k_vnni256`], the CPU supporting what `split` and `dot` use.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn q4_k_stored<const R: usize, S>(
    w: StoredRows,
    tiles: usize,
    x: LaneArgs,
    out: (usize, *mut f32, usize),
    unit: [f32; 2],
    mut state: S,
    split: impl Fn(&[*const u8; 8], &mut S),
    dot: impl Fn(&S, usize, usize, *const u8, &[__m256i; 8]) -> __m256i,
) {
    let (cn, y, y_stride) = out;
    debug_assert!(cn <= 8 && R <= 8);
    let mut dm: SubScales = [[[0.0; 8]; 2]; 8];
    for t in 0..tiles {
        let wt = w.skip(R * t);
        let mut acc = [_mm256_setzero_ps(); R];
        let mut mins = [_mm256_setzero_ps(); R];
        for s in 0..w.nblocks / 8 {
            // SAFETY: super-block `s` of each row of the tile is in bounds
            // (fn contract).
            let sbs = unsafe { q4_k_tile::<R>(wt, s, unit, &mut dm) };
            split(&sbs, &mut state);
            for (j, [d, m]) in dm.iter().enumerate() {
                let b = 8 * s + j;
                // SAFETY: block `b` of the group and its 8 sums are in
                // bounds (fn contract).
                let ((xk, dx), sx) = unsafe { (group8(x, b), _mm256_loadu_ps(x.s.add(8 * b))) };
                for (r, (acc, mins)) in acc.iter_mut().zip(&mut mins).enumerate() {
                    let all = dot(&state, r, j, sbs[r], &xk);
                    let dd = _mm256_mul_ps(_mm256_set1_ps(d[r]), dx);
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(all), dd, *acc);
                    *mins = _mm256_fmadd_ps(_mm256_set1_ps(m[r]), sx, *mins);
                }
            }
        }
        // SAFETY: rows R t..R t + R of `y` (fn contract).
        unsafe { store_tile8(acc, mins, t, cn, y, y_stride) };
    }
}

/// A Q4_K super-block's eight sub-blocks of eight rows, as [`q4_k_tile`]
/// sets them out: per sub-block the row scales (taking `unit`) and the
/// minimums' factors, row `r` in lane `r`.
type SubScales = [[[f32; 8]; 2]; 8];

/// Super-block `s` of the `R` rows from `wt` (lanes past them repeat the
/// last row), their eight sub-blocks' scales decoded and set out in `dm`:
/// sub-block `j`'s row scales times `unit[j % 2]` and its minimums'
/// factors. The sweeps' float steps broadcast them from there, a load
/// each, not a multiply and a shuffle on the vector pipes the dot products
/// need (`gemm` Q4_K/32 +4% on Zen 5). The same super-blocks of the next
/// `R` rows are asked for, to be in cache when that tile reads them.
///
/// # Safety
/// Super-block `s` of each of the `R` rows must be in bounds, `R <= 8`;
/// the CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_k_tile<const R: usize>(
    wt: StoredRows,
    s: usize,
    unit: [f32; 2],
    dm: &mut SubScales,
) -> [*const u8; 8] {
    let block = Encoding::Q4K.block_bytes();
    let sb = |r: usize| wt.skip(r.min(R - 1)).w.wrapping_add(block * s);
    for r in 0..R {
        for line in 0..block.div_ceil(64) {
            prefetch_l2(sb(r).wrapping_add(R * wt.row_bytes + 64 * line));
        }
    }
    let sbs = std::array::from_fn(sb);
    let mut sc = Scales8::zeros();
    // SAFETY: in bounds (fn contract).
    unsafe { Q4KB::scales8(&sbs, &mut sc) };
    for ((j, sc), dm) in sc.iter().enumerate().zip(dm) {
        let d = _mm256_mul_ps(sc.d0, _mm256_set1_ps(unit[j % 2]));
        // SAFETY: each `dm[j][i]` is 8 writable floats.
        unsafe {
            _mm256_storeu_ps(dm[0].as_mut_ptr(), d);
            _mm256_storeu_ps(dm[1].as_mut_ptr(), sc.m);
        }
    }
    sbs
}

/// Defines a [`q4_k_stored`] sweep with VNNI: `$name`, for a CPU with
/// `$features`, multiplying with `$dpbusd` (AVX-512 VL's or AVX-VNNI's).
macro_rules! q4_k_vnni {
    ($(#[$doc:meta])* $features:literal, $name:ident, $dpbusd:ident) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $name<const R: usize>(
            w: StoredRows,
            tiles: usize,
            x: LaneArgs,
            cn: usize,
            y: *mut f32,
            y_stride: usize,
        ) {
            let masks = [_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0xf0u8 as i8)];
            // Sub-block j: nibble j % 2 of the stored bytes 32 (j / 2)..
            // SAFETY: those 32 bytes are in the super-block at `sb`
            // (q4_k_stored's contract).
            let dot = |_: &(), _, j: usize, sb: *const u8, xk: &[__m256i; 8]| unsafe {
                let q = sb.add(16 + 32 * (j / 2));
                (0..8).fold(_mm256_setzero_si256(), |sum, k| {
                    let four = (q.add(4 * k) as *const i32).read_unaligned();
                    let wk = _mm256_and_si256(_mm256_set1_epi32(four), masks[j % 2]);
                    $dpbusd(sum, wk, xk[k])
                })
            };
            // SAFETY: forwarded contract; this CPU has VNNI.
            unsafe {
                q4_k_stored::<R, ()>(
                    w,
                    tiles,
                    x,
                    (cn, y, y_stride),
                    [1.0, 1.0 / 16.0],
                    (),
                    |_, _| {},
                    dot,
                )
            }
        }
    };
}

q4_k_vnni!(
    /// [`q8_0_vnni256`] for Q4_K ([`q4_k_stored`]): each four-byte group
    /// broadcast from the stored nibbles and masked in place: low nibbles as
    /// they are, high nibbles sixteen times their value, their scale taking
    /// the 1/16 (a power of two: the product with the activations' scale, and
    /// every step after it, come out as the definition's). Sums of at most 32
    /// x 240 x 127 stay exact in f32.
    ///
    /// # Safety
    /// As [`q8_0_vnni256`], for rows of `w.nblocks / 8` Q4_K super-blocks (no
    /// integer sums needed).
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    q4_k_vnni256,
    _mm256_dpbusd_epi32
);
q4_k_vnni!(
    /// [`q4_k_vnni256`] with AVX-VNNI (as [`lanes_avxvnni256`]): the same
    /// body and sums.
    ///
    /// # Safety
    /// As [`q4_k_vnni256`], the CPU supporting AVX2, FMA, F16C and AVX-VNNI.
    "avx2,fma,f16c,avxvnni",
    q4_k_avxvnni256,
    _mm256_dpbusd_avx_epi32
);

/// [`q4_k_vnni256`] on 16 lanes against `G` consecutive lane groups at
/// once (as [`lanes_vnni512`]): up to 32 activation rows, where an unpack
/// would be read by one sweep only. Each row's four-byte group is
/// broadcast from the stored nibbles and masked once for the `G` groups.
/// Lanes `0..cn` of the groups are written, element `(r, c)` to
/// `y[c * y_stride + r]`.
///
/// # Safety
/// `w` must be valid for `R * tiles` rows of `w.nblocks / 8` Q4_K
/// super-blocks, each of `x` for `w.nblocks` blocks of a 16-lane group, `y`
/// for writing every element `(r, c < cn)`; `(G - 1) * 16 < cn <= 16 * G`,
/// `R <= 8`; the CPU must support AVX-512F/BW/VL, AVX-512 VNNI, AVX2, FMA
/// and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn q4_k_vnni512<const R: usize, const G: usize>(
    w: StoredRows,
    tiles: usize,
    x: [LaneArgs; G],
    cn: usize,
    y: *mut f32,
    y_stride: usize,
) {
    debug_assert!((G - 1) * 16 < cn && cn <= 16 * G && R <= 8);
    let masks = [_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0xf0u8 as i8)];
    // High nibbles count sixteen times their value: their scale takes 1/16.
    let unit = [1.0, 1.0 / 16.0];
    let mut dm: SubScales = [[[0.0; 8]; 2]; 8];
    for t in 0..tiles {
        let wt = w.skip(R * t);
        let mut acc = [[_mm512_setzero_ps(); G]; R];
        let mut mins = [[_mm512_setzero_ps(); G]; R];
        for s in 0..w.nblocks / 8 {
            // SAFETY: super-block `s` of each row of the tile is in bounds
            // (fn contract).
            let sbs = unsafe { q4_k_tile::<R>(wt, s, unit, &mut dm) };
            for (j, [d, m]) in dm.iter().enumerate() {
                let b = 8 * s + j;
                let mut sums = [[_mm512_setzero_si512(); G]; R];
                for k in 0..8 {
                    let mut xk = [_mm512_setzero_si512(); G];
                    for (xk, x) in xk.iter_mut().zip(&x) {
                        // SAFETY: block b's four-byte step k of every group
                        // is in bounds (fn contract).
                        *xk = unsafe { _mm512_loadu_si512(x.q.add(512 * b + 64 * k).cast()) };
                    }
                    for (r, sr) in sums.iter_mut().enumerate() {
                        // Sub-block j: nibble j % 2 of the stored bytes
                        // 32 (j / 2).., in the super-block at sbs[r].
                        // SAFETY: in bounds (fn contract).
                        let four = unsafe {
                            (sbs[r].add(16 + 32 * (j / 2) + 4 * k) as *const i32).read_unaligned()
                        };
                        let wk = _mm512_and_si512(_mm512_set1_epi32(four), masks[j % 2]);
                        for (s, xk) in sr.iter_mut().zip(xk) {
                            *s = _mm512_dpbusd_epi32(*s, wk, xk);
                        }
                    }
                }
                for (g, x) in x.iter().enumerate() {
                    // SAFETY: block b's 16 scales and sums of the group are
                    // in bounds (fn contract).
                    let (dx, sx) = unsafe {
                        (
                            _mm512_loadu_ps(x.d.add(16 * b)),
                            _mm512_loadu_ps(x.s.add(16 * b)),
                        )
                    };
                    for r in 0..R {
                        let dd = _mm512_mul_ps(_mm512_set1_ps(d[r]), dx);
                        acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][g]), dd, acc[r][g]);
                        mins[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(m[r]), sx, mins[r][g]);
                    }
                }
            }
        }
        for r in 0..R {
            for g in 0..G {
                let mut out = [0f32; 16];
                // SAFETY: `out` is 16 writable floats; elements (R t + r,
                // 16 g + c) for the group's lanes are in bounds (fn contract).
                unsafe {
                    _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(acc[r][g], mins[r][g]));
                    scatter(
                        out,
                        (cn - 16 * g).min(16),
                        y.add(16 * g * y_stride),
                        y_stride,
                        R * t + r,
                    );
                }
            }
        }
    }
}

/// [`q4_k_vnni256`] on AVX2: `vpmaddubsw`'s i16 pair sums could not hold
/// a high nibble taken sixteen times its value, so per super-block each
/// row's 128 stored bytes are split into its 256 nibbles once
/// ([`Tile8::quants`], into an L1 buffer), and each
/// sub-block's four-byte groups broadcast from there against the group's
/// activations, the eight products of a sub-block summed in i16 (16
/// products of at most 15 x 127 each) before `vpmaddwd` widens them, as in
/// [`lanes_sweep256`]. With one lane group, unpacking the rows to
/// [`I8Block`]s took a third as long as the sweep that read them.
///
/// # Safety
/// As [`q4_k_vnni256`], the CPU supporting AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4_k_lanes256<const R: usize>(
    w: StoredRows,
    tiles: usize,
    x: LaneArgs,
    cn: usize,
    y: *mut f32,
    y_stride: usize,
) {
    let ones = _mm256_set1_epi16(1);
    // Row `r`'s nibbles of one super-block: sub-block `j` at `nib[r][j]`.
    let nib = [[_mm256_setzero_si256(); 8]; R];
    let split = |sb: &[*const u8; 8], nib: &mut [[__m256i; 8]; R]| {
        for (&sb, nib) in sb.iter().zip(nib) {
            for (j, q) in nib.iter_mut().enumerate() {
                // SAFETY: one Q4_K super-block at `sb` (q4_k_stored's
                // contract), `j < 8`.
                *q = unsafe { Q4KB::quants(sb, j) };
            }
        }
    };
    let dot = |nib: &[[__m256i; 8]; R], r: usize, j: usize, _, xk: &[__m256i; 8]| {
        let q = nib[r][j..].as_ptr().cast::<i32>();
        // SAFETY: four-byte group `k < 8` of the sub-block's 32 bytes.
        let s16 = (0..8).fold(_mm256_setzero_si256(), |s16, k| unsafe {
            let wk = _mm256_set1_epi32(q.add(k).read_unaligned());
            _mm256_add_epi16(s16, _mm256_maddubs_epi16(wk, xk[k]))
        });
        _mm256_madd_epi16(s16, ones)
    };
    // SAFETY: forwarded contract.
    unsafe { q4_k_stored::<R, _>(w, tiles, x, (cn, y, y_stride), [1.0; 2], nib, split, dot) }
}

/// Whether this CPU has AVX-VNNI (VEX `vpdpbusd` on 256-bit registers),
/// which [`lanes_avxvnni256`], [`stored_avxvnni256`],
/// [`q8_0_avxvnni256`] and [`q4_k_avxvnni256`] need on top of AVX2.
pub(crate) fn has_avx_vnni() -> bool {
    is_x86_feature_detected!("avxvnni")
}

/// Whether this CPU has AVX-512 VNNI and VL, which [`lanes_vnni256`] and
/// [`lanes_vnni512`] need on top of [`super::Isa::Avx512`].
pub(crate) fn has_avx512_vnni() -> bool {
    is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl")
}

/// Whether this CPU has GFNI (its byte affine transform picks Q6_K's bits
/// in [`super::x86_gemv::gemv8_q6k_gfni512`]).
pub(crate) fn has_gfni() -> bool {
    is_x86_feature_detected!("gfni")
}
