//! The many-row side of the fast numerics on x86 (AVX2 and AVX-512 VNNI):
//! what every lane sweep shares. Weight rows are unpacked once to
//! [`I8Block`]s ([`unpack_rows256`]; for the AMX sweep whole 16-row tiles
//! to [`TileBlock`]s), as unsigned bytes `w + offset`
//! ([`super::int8::lane_offset`]; all but Q8_0's on AVX2), their sums
//! starting at `-offset * sum(x)`; then swept against [`LaneRows`], one
//! activation row per SIMD lane ([`LaneArgs`], one group's pointers), so a
//! block's integer sums land one per lane without a horizontal step. Rows
//! can also be read in their stored encoding ([`StoredRows`]), and long
//! rows swept a chunk of blocks at a time, the sums carried between chunks
//! ([`Carry`]). A tile's outputs are written by [`scatter`] and
//! [`store_tile8`]; the ISA checks the sweeps need are here too.
//!
//! The sweeps: AVX2 over unpacked rows in `x86_lanes_avx2.rs`, AVX-512
//! VNNI and AVX-VNNI over unpacked and stored one-scale rows in
//! `x86_lanes_vnni.rs`, Q8_0 and Q4_K straight from their stored blocks in
//! `x86_lanes_stored.rs`, AMX in `x86_amx.rs`. Results are `int8.rs`'s
//! definition bit for bit (tests in `x86_int8.rs`).

use std::arch::x86_64::*;

use super::int8::LaneRows;
use super::weight::Encoding;
use super::x86::prefetch_l2;
use super::x86_tile8::{Scales8, Tile8};

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
/// [`Int8Block::VNNI_OFFSET`]: super::x86_int8::Int8Block::VNNI_OFFSET
/// [`Int8Block::LANE_OFFSET`]: super::x86_int8::Int8Block::LANE_OFFSET
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

/// Tile `t`'s `R` rows of 8-lane sums (and minimums' sums) to `y` as
/// [`scatter`] writes them.
///
/// # Safety
/// As [`scatter`] for rows `R t..R t + R`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn store_tile8<const R: usize>(
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
/// in [`super::x86_gemv512::gemv8_q6k_gfni512`]).
pub(crate) fn has_gfni() -> bool {
    is_x86_feature_detected!("gfni")
}
