//! The lane sweeps of one lane group straight from stored blocks, where
//! nothing would reuse an unpacked row: Q8_0 ([`q8_0_vnni256`],
//! [`q8_0_avxvnni256`], [`q8_0_lanes256`] on AVX2) and Q4_K
//! ([`q4_k_vnni256`], [`q4_k_avxvnni256`], [`q4_k_lanes256`]; with
//! AVX-512 VNNI up to two 16-lane groups, [`q4_k_vnni512`]). Results are
//! `int8.rs`'s definition bit for bit (tests in `x86_int8.rs`).

use std::arch::x86_64::*;

use super::weight::Encoding;
use super::x86::prefetch_l2;
use super::x86_blocks::{scales, Q4KB};
use super::x86_lanes::{scatter, store_tile8, LaneArgs, StoredRows};
use super::x86_tile8::{Scales8, Tile8};

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

/// `tiles` consecutive `R`-row tiles of Q8_0 rows straight from their
/// stored blocks against one 8-lane group of [`LaneRows`](super::int8::LaneRows): per block, the
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
/// stored blocks against one 8-lane group of [`LaneRows`](super::int8::LaneRows): per
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
/// [`I8Block`](super::x86_lanes::I8Block)s took a third as long as the sweep that read them.
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
