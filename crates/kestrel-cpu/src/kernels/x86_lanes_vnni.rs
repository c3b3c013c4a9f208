//! The lane sweeps with `vpdpbusd`, from one macro body ([`lanes_vnni`]):
//! AVX-512 VNNI on 8 lanes ([`lanes_vnni256`], [`stored_vnni256`]) and 16
//! ([`lanes_vnni512`], [`stored_vnni512`], one or two groups of 16 for each
//! broadcast), and the 8-lane instance compiled for AVX-VNNI
//! ([`lanes_avxvnni256`], [`stored_avxvnni256`]: the same body with the
//! VEX `vpdpbusd`). `lanes_*` read rows unpacked to [`I8Block`]s, `stored_*`
//! Q4_0, Q4_1 and Q8_0 rows straight from their stored blocks. Results are
//! `int8.rs`'s definition bit for bit (tests in `x86_int8.rs`).

use std::arch::x86_64::*;

use super::weight::Encoding;
use super::x86::prefetch_l1;
use super::x86_blocks::scales;
use super::x86_int8::Int8Block;
use super::x86_lanes::{scatter, Carry, I8Block, LaneArgs, StoredRows};

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
