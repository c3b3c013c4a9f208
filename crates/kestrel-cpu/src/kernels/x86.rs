//! x86-64 SIMD tiles of the canonical dot product (see `scalar.rs`).
//!
//! A tile multiplies `R` weight rows by `NB` activation rows over whole
//! 32-element blocks, dequantizing each block once into registers
//! (`x86_blocks.rs`) and reusing it for all `NB` activations. Lane `l` of
//! each accumulator receives exactly the fused multiply-adds the scalar
//! definition gives lane `l`, so results are bit-identical to `scalar::dot`
//! whatever `R`, `NB` or the ISA.

// Const-generic tiles index `acc[r][c]` alongside other per-(r, c) arrays.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::scalar::LANES;
use super::x86_blocks::{locate, Block, F32B};

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

/// What the GEMVs' prefetch rules ask of the CPU, read once (CPUID traps
/// to the hypervisor in a VM).
#[derive(Debug, Clone, Copy)]
struct Core {
    amd: bool,
    /// CPUID's family, the extended one added in (AMD's Zen 4 is 0x19,
    /// Zen 5 0x1A).
    family: u32,
    avx512f: bool,
}

impl Core {
    fn this() -> Core {
        static CORE: std::sync::OnceLock<Core> = std::sync::OnceLock::new();
        *CORE.get_or_init(|| {
            let id = __cpuid(0);
            let eax = __cpuid(1).eax;
            let base = (eax >> 8) & 0xF;
            Core {
                // "AuthenticAMD" in EBX, EDX, ECX.
                amd: (id.ebx, id.edx, id.ecx) == (0x6874_7541, 0x6974_6e65, 0x444d_4163),
                family: if base == 0xF {
                    base + ((eax >> 20) & 0xFF)
                } else {
                    base
                },
                avx512f: is_x86_feature_detected!("avx512f"),
            }
        })
    }

    /// Whether `prefetcht1` fills L1: on AMD's cores before Zen 4, the
    /// ones without AVX-512.
    fn prefetcht1_fills_l1(self) -> bool {
        self.amd && !self.avx512f
    }

    /// Whether the GEMVs hint each row's next stored block into L1
    /// ([`gemv_next_block_l1`]): on AMD's Zen 5 and later.
    fn next_block_l1(self) -> bool {
        self.amd && self.family >= 0x1A
    }
}

/// How many 8-row tiles ahead the single-stream GEMVs (`x86_gemv.rs`)
/// prefetch their weight stream with [`prefetch_l2`]: [`PREFETCH_TILES`],
/// but one for the K-quants (`k_quant`) where `prefetcht1` fills L1 too.
/// AMD's cores before Zen 4 (Zen 1-3) fill L1 with it (Zen 4 made it an
/// L2 hint); those are the AMD cores without AVX-512, so that is the test
/// (measured on Zen 3 only; Zen 1 and 2 take it on that documented
/// behaviour).
/// On a Zen 3 EPYC the Q4_K and Q6_K GEMVs streamed 9.2-10.8 and 7.6-9.0
/// GiB/s from DRAM four tiles ahead, 11.0-12.6 and 10.1-11.0 one tile
/// ahead, and a 1B Q4_K_M stream decoded 14.7, 11.0 -> 17.6, 16.1 tokens/s
/// (alternated); the one-scale types (Q8_0, Q4_0, Q4_1) measured level
/// within the noise in the kernel and slower in the decode step (the
/// default model's Q4_1 stream 96-110 -> 88-90 tokens/s), so they keep
/// four (`docs/bench/notes/2026-12-01-zen3-one-tile-prefetch.md`).
pub(crate) fn gemv_prefetch_tiles(k_quant: bool) -> usize {
    if k_quant && Core::this().prefetcht1_fills_l1() {
        1
    } else {
        PREFETCH_TILES
    }
}

/// Whether the single-stream GEMVs also hint each of a tile's eight rows'
/// next stored block from L2 into L1 ([`prefetch_l1`]) as they start a
/// block: for the K-quants (`k_quant`) on AMD's Zen 5 and later. The tile
/// prefetch brings the lines to L2 well ahead, but a tile reads eight
/// streams a row apart, more than the L1 prefetcher follows, so each
/// block's loads otherwise wait on L2.
/// On a Zen 5 EPYC (2026-12-02,
/// `docs/bench/notes/2026-12-02-zen5-l1-hint.md`) the GEMVs from DRAM gained about 5% (Q4_K), 8%
/// (Q6_K) and 11% (Q8_0) over seven alternated rounds, and the 1B Q4_K_M
/// and Q8_0 streams about 5% each (8B Q4_K_M level); in L2 the extra hints
/// cost a little, Q8_0's the most, and the default model (Q4_1 layers, a
/// Q8_0 head) streamed about 6% slower with every type hinted, so the
/// one-scale types, whose short blocks take two hints per row for a
/// fraction of a line, keep the tile prefetch alone. Not measured on Zen
/// 4 (whose GEMVs were bound by their instruction mix) nor on Intel's
/// cores, which keep it alone too.
pub(crate) fn gemv_next_block_l1(k_quant: bool) -> bool {
    k_quant && Core::this().next_block_l1()
}

/// How many rows ahead the row dequantizers prefetch.
const PREFETCH_ROWS: usize = 8;

/// Hint the line at `p` of a weight stream into L2 (`prefetcht1`), not L1:
/// a prefetch into L1 holds one of the core's few L1 miss buffers until
/// its line arrives from DRAM, so a stream prefetched that way has only
/// those in flight (on a Zen 4 EPYC the 1B Q4_K GEMV streamed 16 GiB/s
/// with `prefetcht0`, 27 GiB/s with `prefetcht1`:
/// `docs/bench/notes/2026-11-28-zen4-l2-prefetch.md`).
/// L2 misses have more; the demand load then hits L2 (on AMD's cores
/// before Zen 4 `prefetcht1` fills L1 as well: [`gemv_prefetch_tiles`]).
/// Never faults, whatever `p` is.
#[inline(always)]
pub(crate) fn prefetch_l2(p: *const u8) {
    // SAFETY: prefetch is a hint: it does not dereference architecturally and
    // cannot fault, so any address (even past an allocation) is fine.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) };
}

/// Hint the line at `p` into L1 (`prefetcht0`): for operands a kernel
/// bound by its multiplies reads a few steps on, where a load from L2
/// would cost (AMX's operands, already in L2; the one-scale stored lane
/// sweep's next tile; on Zen 5 the K-quant GEMVs' next block of each row,
/// [`gemv_next_block_l1`]). Never faults, whatever `p` is.
#[inline(always)]
pub(crate) fn prefetch_l1(p: *const u8) {
    // SAFETY: as `prefetch_l2`.
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
    let step = R * B::STRIDE;
    for blk in 0..a.nblocks {
        prefetch_l2(ahead.wrapping_add(blk * step));
        prefetch_l2(ahead.wrapping_add(blk * step + 64));
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let (p, j) = locate::<B>(a.w.wrapping_add(r * a.row_bytes), blk);
            // SAFETY: block `blk` of row `r` lies within the tile (fn contract).
            let (wl, wh) = unsafe { B::dq512(p, j) };
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
    let step = R * B::STRIDE;
    for blk in 0..a.nblocks {
        prefetch_l2(ahead.wrapping_add(blk * step));
        prefetch_l2(ahead.wrapping_add(blk * step + 64));
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let (p, j) = locate::<B>(a.w.wrapping_add(r * a.row_bytes), blk);
            // SAFETY: block `blk` of row `r` lies within the tile (fn contract).
            let w = unsafe { B::dq256(p, j) };
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

/// Dequantize the `nblocks` 32-element blocks of the row of `B` at `src`
/// into `out` (canonical values).
///
/// # Safety
/// `src` valid for those blocks' bytes, `out` for `nblocks * 32` f32s;
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
    let ahead = src.wrapping_add(PREFETCH_ROWS * nblocks * B::STRIDE);
    for blk in 0..nblocks {
        prefetch_l2(ahead.wrapping_add(blk * B::STRIDE));
        let (p, j) = locate::<B>(src, blk);
        // SAFETY: block `blk` and its 32 output floats are in bounds (fn contract).
        unsafe {
            let (lo, hi) = B::dq512(p, j);
            _mm512_storeu_ps(out.add(blk * 32), lo);
            _mm512_storeu_ps(out.add(blk * 32 + 16), hi);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant_row256<B: Block>(src: *const u8, nblocks: usize, out: *mut f32) {
    let ahead = src.wrapping_add(PREFETCH_ROWS * nblocks * B::STRIDE);
    for blk in 0..nblocks {
        prefetch_l2(ahead.wrapping_add(blk * B::STRIDE));
        let (p, j) = locate::<B>(src, blk);
        // SAFETY: block `blk` and its 32 output floats are in bounds (fn contract).
        unsafe {
            let v = B::dq256(p, j);
            for (i, x) in v.iter().enumerate() {
                _mm256_storeu_ps(out.add(blk * 32 + 8 * i), *x);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gemv_prefetch_rules_follow_the_core() {
        let core = |amd, family, avx512f| Core {
            amd,
            family,
            avx512f,
        };
        assert!(core(true, 0x19, false).prefetcht1_fills_l1(), "Zen 3");
        assert!(!core(true, 0x19, true).prefetcht1_fills_l1(), "Zen 4");
        assert!(!core(true, 0x1A, true).prefetcht1_fills_l1(), "Zen 5");
        assert!(!core(false, 6, true).prefetcht1_fills_l1());
        assert!(!core(false, 6, false).prefetcht1_fills_l1());
        assert!(!core(true, 0x19, true).next_block_l1(), "Zen 4");
        assert!(core(true, 0x1A, true).next_block_l1(), "Zen 5");
        assert!(!core(false, 6, true).next_block_l1());
        // CPUID's vendor and family read as /proc/cpuinfo names them.
        if let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") {
            let this = Core::this();
            assert_eq!(this.amd, info.contains("AuthenticAMD"));
            let family = info
                .lines()
                .find_map(|l| l.strip_prefix("cpu family"))
                .and_then(|v| {
                    v.trim_start_matches([' ', '\t', ':'])
                        .trim()
                        .parse::<u32>()
                        .ok()
                });
            if let Some(family) = family {
                assert_eq!(this.family, family);
            }
            assert_eq!(
                gemv_prefetch_tiles(true),
                if this.prefetcht1_fills_l1() {
                    1
                } else {
                    PREFETCH_TILES
                }
            );
            assert_eq!(gemv_next_block_l1(true), this.next_block_l1());
        }
        assert_eq!(gemv_prefetch_tiles(false), PREFETCH_TILES);
        assert!(!gemv_next_block_l1(false));
    }
}
