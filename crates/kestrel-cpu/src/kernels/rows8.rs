//! Q4_K and Q6_K rows interleaved eight at a time ([`Layout::Rows8`]), for
//! the single-stream GEMV with AVX-512 VNNI. Stored row after row, the
//! GEMV loads each of eight rows' 32 quant bytes of a sub-block against
//! the activation block and folds the eight rows' sums back to one lane
//! each, a shuffle tree per two sub-blocks. Interleaved, one 64-byte load
//! holds four bytes of each of eight rows twice over (chunks `c` and
//! `c + 1`), against the activation's matching dwords spread across lanes
//! once per call ([`Expanded`]): `vpdpbusd` leaves row `r`'s sum in lanes
//! `r` and `r + 8`, and no fold is needed. Measured in L2 on one thread
//! (`docs/bench/cpu-1b.md`, section "Rows interleaved eight at a time"):
//! Q4_K 1.27x and Q6_K about 1.3x the row-by-row GEMVs' rate on a Zen 4,
//! 1.17x and 1.1x on an Emerald Rapids Xeon, bit for bit their outputs.
//!
//! The layout, per tile of rows `8t..8t + 8` and super-block `s` (tile
//! after tile, each tile's super-blocks in order, eight super-blocks'
//! bytes apiece): first the rows' heads (Q4_K: `d`, `dmin` and 12 scale
//! bytes, `H` = 16; Q6_K: `sc[16]` and `d`, `H` = 18), row `r`'s at
//! `H r`; then their quant bytes (Q4_K's 128 nibble bytes, Q6_K's `ql`
//! then `qh`, 192) in four-byte chunks, chunk `c` of row `r` at
//! `8 H + 32 c + 4 r` ([`place`]). The same bytes, moved.
//!
//! Every other reader (more activation rows, exact numerics, another ISA)
//! gets the rows back as stored: [`task`] regroups a chunk of tiles at a
//! time into a thread-local buffer ([`deinterleave`]) and runs the
//! row-by-row task on it, so every output is what the stored rows give.

use super::int8::{Numerics, Q8Block};
use super::matmul::MatRef;
use super::weight::{Encoding, Layout};
use super::{Isa, OutPtr};

/// Where `enc`'s super-block head lies: its first byte and its length.
const fn head(enc: Encoding) -> (usize, usize) {
    match enc {
        Encoding::Q4K => (0, 16),
        Encoding::Q6K => (192, 18),
        _ => panic!("only Q4_K and Q6_K rows are interleaved"),
    }
}

/// Offset, within a tile's group of eight super-blocks, of byte `b` of row
/// `r`'s super-block.
const fn place(enc: Encoding, r: usize, b: usize) -> usize {
    let (h0, hl) = head(enc);
    if b >= h0 && b < h0 + hl {
        hl * r + (b - h0)
    } else {
        let q = if b < h0 { b } else { b - hl };
        8 * hl + 32 * (q / 4) + 4 * r + q % 4
    }
}

/// The pieces of a stored super-block that move whole: `(first byte,
/// length)` of the head, then of every four-byte quant chunk.
fn pieces(enc: Encoding) -> impl Iterator<Item = (usize, usize)> {
    let (h0, hl) = head(enc);
    let chunks = (enc.block_bytes() - hl) / 4;
    std::iter::once((h0, hl)).chain((0..chunks).map(move |c| {
        let q = 4 * c;
        (if q < h0 { q } else { q + hl }, 4)
    }))
}

/// Whether [`super::Weight::for_kernels`] interleaves `rows` rows of `enc`
/// for the kernels on `isa` with `numerics`: where the interleaved GEMV
/// runs ([`native`]), in fast numerics (exact numerics would regroup on
/// every call), rows a nonzero multiple of 16 (the task split's unit, so a
/// task's rows are whole tiles); not Q4_K on AMX, whose many-row sweeps
/// run on tiles unpacked from stored rows (interleaved, they would run on
/// VNNI: not measured on an AMX machine).
pub(crate) fn wanted(isa: Isa, numerics: Numerics, enc: Encoding, rows: usize) -> bool {
    numerics == Numerics::Fast
        && rows > 0
        && rows.is_multiple_of(16)
        && native(isa, enc)
        && !(isa == Isa::Amx && enc == Encoding::Q4K)
}

/// Whether the interleaved GEMV runs for `enc` on `isa`: Q4_K with AVX-512
/// VNNI, Q6_K with GFNI too.
fn native(isa: Isa, enc: Encoding) -> bool {
    #[cfg(target_arch = "x86_64")]
    if isa.is_supported() && super::matmul_int8::uses_vnni(isa) {
        return match enc {
            Encoding::Q4K => true,
            Encoding::Q6K => super::x86_lanes::has_gfni(),
            _ => false,
        };
    }
    let _ = (isa, enc);
    false
}

/// `src`'s `rows` rows of `enc` (`row_bytes` each, a multiple of 8 rows)
/// interleaved eight at a time.
pub(crate) fn interleave(enc: Encoding, src: &[u8], rows: usize, row_bytes: usize) -> Vec<u8> {
    assert!(rows.is_multiple_of(8) && src.len() == rows * row_bytes);
    let bb = enc.block_bytes();
    let mut out = vec![0u8; src.len()];
    for (t, tile) in out.chunks_exact_mut(8 * row_bytes).enumerate() {
        for (s, group) in tile.chunks_exact_mut(8 * bb).enumerate() {
            for r in 0..8 {
                let sb = &src[(8 * t + r) * row_bytes + s * bb..][..bb];
                for (b, len) in pieces(enc) {
                    group[place(enc, r, b)..][..len].copy_from_slice(&sb[b..b + len]);
                }
            }
        }
    }
    out
}

/// The whole tiles `src` (interleaved rows of `enc`, `row_bytes` each as
/// stored) back as stored, into `out` (as many bytes): with AVX2 an 8 x 8
/// transpose per 256 quant bytes, else piece by piece.
pub(crate) fn deinterleave(enc: Encoding, src: &[u8], row_bytes: usize, out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    let simd = std::arch::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    let simd = false;
    deinterleave_with(enc, src, row_bytes, out, simd);
}

/// [`deinterleave`], with the AVX2 transpose if `simd` (which the CPU must
/// then support).
fn deinterleave_with(enc: Encoding, src: &[u8], row_bytes: usize, out: &mut [u8], simd: bool) {
    assert!(src.len() == out.len() && src.len().is_multiple_of(8 * row_bytes));
    let bb = enc.block_bytes();
    let tiles = src
        .chunks_exact(8 * row_bytes)
        .zip(out.chunks_exact_mut(8 * row_bytes));
    for (tile, rows) in tiles {
        for (s, group) in tile.chunks_exact(8 * bb).enumerate() {
            if !simd {
                for r in 0..8 {
                    let sb = &mut rows[r * row_bytes + s * bb..][..bb];
                    for (b, len) in pieces(enc) {
                        sb[b..b + len].copy_from_slice(&group[place(enc, r, b)..][..len]);
                    }
                }
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the group is `8 * bb` bytes of `tile`; row r's stored
            // super-block `s` is `bb` bytes of `rows` from `r * row_bytes +
            // s * bb`, apart from `src`; `simd` only where AVX2 was detected
            // (fn contract).
            unsafe {
                regroup(enc, group.as_ptr(), rows[s * bb..].as_mut_ptr(), row_bytes)
            };
        }
    }
}

/// One tile's group of super-blocks (interleaved, at `group`) as stored:
/// row `r`'s super-block at `dst + r * stride`.
///
/// # Safety
/// `group` must be readable for eight super-blocks of `enc` (Q4_K or Q6_K)
/// and each `dst + r * stride` writable for one, not overlapping it; the
/// CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) unsafe fn regroup(enc: Encoding, group: *const u8, dst: *mut u8, stride: usize) {
    // SAFETY: forwarded contract.
    unsafe { regroup_into(enc, group, |r| dst.wrapping_add(r * stride)) }
}

/// [`regroup`] with row `r`'s super-block at `dst(r)`.
///
/// # Safety
/// As [`regroup`], for each `dst(r)`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn regroup_into(enc: Encoding, group: *const u8, dst: impl Fn(usize) -> *mut u8) {
    let (h0, hl) = head(enc);
    let dst: [*mut u8; 8] = std::array::from_fn(dst);
    for (r, &d) in dst.iter().enumerate() {
        // SAFETY: row r's head is `hl` bytes of the group from `hl * r`, and
        // of its stored super-block from `h0` (fn contract).
        unsafe { std::ptr::copy_nonoverlapping(group.add(hl * r), d.add(h0), hl) };
    }
    // Eight chunks of eight rows (256 bytes) at a time: row r's quant bytes
    // 32g..32g + 32, at their place in the stored super-block (Q4_K's after
    // the head, Q6_K's before it).
    for g in 0..(enc.block_bytes() - hl) / 32 {
        let q = 32 * g;
        let at = if q < h0 { q } else { q + hl };
        // SAFETY: the group's bytes 8 hl + 256 g.. + 256 and each row's 32
        // from `at` are in bounds (fn contract); AVX2 likewise.
        unsafe { transpose8x8(group.add(8 * hl + 256 * g), dst.map(|d| d.add(at))) };
    }
}

/// An 8 x 8 transpose of four-byte chunks: the 32 bytes at `src + 32 k`
/// hold chunk `k` of rows 0..8; row `r`'s eight chunks go to `dst[r]`.
///
/// # Safety
/// `src` must be readable for 256 bytes and each `dst[r]` writable for 32,
/// not overlapping `src`; the CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose8x8(src: *const u8, dst: [*mut u8; 8]) {
    use std::arch::x86_64::*;
    // SAFETY: 32 readable bytes at each `src + 32 k` (fn contract).
    let a: [__m256i; 8] =
        std::array::from_fn(|k| unsafe { _mm256_loadu_si256(src.add(32 * k).cast()) });
    // Pairs of chunks, then quads, within each 128-bit half; then halves.
    let t: [__m256i; 8] = std::array::from_fn(|i| {
        let (u, v) = (a[i / 2 * 2], a[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_epi32(u, v)
        } else {
            _mm256_unpackhi_epi32(u, v)
        }
    });
    // u[j] (j in 0..4) for rows 0..4 of chunks j and j + 4, u[4 + j] for 4..8.
    let u: [__m256i; 8] = std::array::from_fn(|i| {
        let (p, j) = (4 * (i / 4), i % 4);
        let (x, y) = (t[p + j / 2], t[p + 2 + j / 2]);
        if j % 2 == 0 {
            _mm256_unpacklo_epi64(x, y)
        } else {
            _mm256_unpackhi_epi64(x, y)
        }
    });
    for r in 0..8 {
        let (x, y) = (u[r % 4], u[4 + r % 4]);
        let row = if r < 4 {
            _mm256_permute2x128_si256::<0x20>(x, y)
        } else {
            _mm256_permute2x128_si256::<0x31>(x, y)
        };
        // SAFETY: 32 writable bytes at `dst[r]` (fn contract).
        unsafe { _mm256_storeu_si256(dst[r].cast(), row) };
    }
}

/// The interleaved GEMVs' activation rows (up to [`GEMV_ROWS`]) as they
/// read them, row after row.
#[derive(Debug, Default)]
pub(crate) struct Expanded {
    /// Per block, four 64-byte vectors: vector `k` holds the block's dword
    /// `2k` in lanes 0..8 and `2k + 1` in lanes 8..16, matching a load of
    /// eight rows' chunks `2k` and `2k + 1`.
    pub(crate) q: Vec<[i32; 16]>,
    /// Per block, `32 * sum` of each 16-element half (Q6_K's offset).
    pub(crate) half32: Vec<[i32; 2]>,
}

impl Expanded {
    /// Spread the blocks `xq` (whole activation rows, one after another).
    pub(crate) fn fill(&mut self, xq: &[Q8Block]) {
        self.q.clear();
        self.half32.clear();
        for b in xq {
            let d: [i32; 8] = std::array::from_fn(|k| {
                let c = &b.q[4 * k..4 * k + 4];
                i32::from_le_bytes([c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8])
            });
            self.q
                .extend((0..4).map(|k| std::array::from_fn(|l| d[2 * k + l / 8])));
            self.half32.push(b.half_sums().map(|s| 32 * s));
        }
    }
}

/// The most activation rows the interleaved GEMVs take at once (each
/// weight load serving them all); more go to the lane sweeps.
pub(crate) const GEMV_ROWS: usize = 3;

/// Tiles [`task`] regroups at a time for the row-by-row kernels: 128 rows,
/// the most the lane sweeps take at once.
const CHUNK_TILES: usize = 16;

thread_local! {
    /// [`task`]'s regrouped rows and their outputs (each grows once to the
    /// largest it needs).
    static PLAIN: std::cell::RefCell<(Vec<u8>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Output rows `r0..r1` (of all `n` activation rows) of `w`, a
/// [`Layout::Rows8`] matrix: where the interleaved GEMV runs ([`native`]),
/// and `gemv` gives the one activation row quantized and expanded, straight
/// from the tiles; otherwise by `plain` on the rows regrouped as stored,
/// [`CHUNK_TILES`] tiles at a time. Rows of a tile that `r0..r1` cuts are
/// computed and dropped.
///
/// `plain(m, out)` must write every output of `m` (a [`Layout::Rows`]
/// matrix; all its rows, all `n` activation rows) to `out`, an
/// `n x m.rows` buffer.
///
/// # Safety
/// `y.0` must point at an `n x w.rows` f32 buffer that no other thread
/// accesses at rows `r0..r1`; `r0 < r1 <= w.rows`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn task(
    isa: Isa,
    w: &MatRef<'_>,
    n: usize,
    r0: usize,
    r1: usize,
    y: OutPtr,
    gemv: Option<(&[Q8Block], &Expanded)>,
    plain: impl Fn(&MatRef<'_>, OutPtr),
) {
    assert!(w.layout == Layout::Rows8 && r0 < r1 && r1 <= w.rows);
    let rb = w.row_bytes;
    let (t0, t1) = (r0 / 8, r1.div_ceil(8));
    // Output rows r0..r1 of tiles t..t + tn, whose outputs are in `out`
    // (`n` rows of `8 tn`).
    let scatter = |t: usize, tn: usize, out: &[f32]| {
        let (lo, hi) = (r0.max(8 * t), r1.min(8 * (t + tn)));
        for c in 0..n {
            let from = &out[c * 8 * tn + lo - 8 * t..][..hi - lo];
            // SAFETY: elements (lo..hi, c) of `y` are this task's (fn
            // contract); `from` is a separate buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(from.as_ptr(), y.0.add(c * w.rows + lo), hi - lo)
            };
        }
    };
    #[cfg(target_arch = "x86_64")]
    if let Some((xq, e)) = gemv.filter(|_| n <= GEMV_ROWS && native(isa, w.enc)) {
        let nb = w.cols / 32;
        assert!(xq.len() >= n * nb && e.q.len() >= 4 * n * nb && e.half32.len() >= n * nb);
        // Tiles t..t + tiles, activation row c's outputs at `out + c * stride`.
        let run = |t: usize, tiles: usize, out: *mut f32, stride: usize| {
            let a = super::x86_int8::Int8Args {
                w: w.data[8 * t * rb..].as_ptr(),
                row_bytes: rb,
                x: xq.as_ptr(),
                nblocks: nb,
            };
            macro_rules! go {
                ($C:literal) => {
                    match w.enc {
                        Encoding::Q4K => {
                            super::x86_gemv::gemv8_q4k_rows8::<$C>(a, e, tiles, out, stride)
                        }
                        _ => super::x86_gemv::gemv8_q6k_rows8::<$C>(a, e, tiles, out, stride),
                    }
                };
            }
            // SAFETY: tiles t..t + tiles are in `w.data` (t + tiles <= t1 <=
            // w.rows / 8, `MatRef` checked by `matmul_group`) and
            // interleaved; `xq` and `e` hold the `n` rows' `nb` blocks
            // (asserted); `out` takes 8 * tiles outputs per row (below);
            // `native` vouched for AVX-512 VNNI (and GFNI for Q6_K).
            unsafe {
                match n {
                    1 => go!(1),
                    2 => go!(2),
                    _ => go!(3),
                }
            }
        };
        // Whole tiles within r0..r1 straight to `y`, a cut one through `tmp`.
        let (a, b) = (r0.div_ceil(8), r1 / 8);
        if a < b {
            // SAFETY: outputs (8a..8b, 0..n) of `y` are this task's (fn
            // contract).
            run(a, b - a, unsafe { y.0.add(8 * a) }, w.rows);
        }
        for t in (t0..t1).filter(|t| !(a..b).contains(t)) {
            let mut tmp = [0f32; 8 * GEMV_ROWS];
            run(t, 1, tmp.as_mut_ptr(), 8);
            scatter(t, 1, &tmp[..8 * n]);
        }
        return;
    }
    let _ = (isa, gemv);
    PLAIN.with_borrow_mut(|(bytes, out)| {
        let mut t = t0;
        while t < t1 {
            let tn = (t1 - t).min(CHUNK_TILES);
            let rows = 8 * tn;
            if bytes.len() < rows * rb {
                bytes.resize(rows * rb, 0);
            }
            if out.len() < n * rows {
                out.resize(n * rows, 0.0);
            }
            let bytes = &mut bytes[..rows * rb];
            deinterleave(w.enc, &w.data[8 * t * rb..][..rows * rb], rb, bytes);
            let m = MatRef {
                enc: w.enc,
                layout: Layout::Rows,
                rows,
                cols: w.cols,
                row_bytes: rb,
                data: bytes,
            };
            plain(&m, OutPtr(out.as_mut_ptr()));
            scatter(t, tn, &out[..n * rows]);
            t += tn;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{random_matrix, Rng};
    use kestrel_model::DType;

    #[test]
    fn place_is_a_permutation_of_each_group() {
        for enc in [Encoding::Q4K, Encoding::Q6K] {
            let bb = enc.block_bytes();
            let mut seen = vec![false; 8 * bb];
            for r in 0..8 {
                for b in 0..bb {
                    let at = place(enc, r, b);
                    assert!(!seen[at], "{enc:?}: row {r} byte {b} collides at {at}");
                    seen[at] = true;
                }
            }
            let moved: usize = pieces(enc).map(|(_, len)| len).sum();
            assert_eq!(moved, bb, "{enc:?}: the pieces cover the super-block");
        }
    }

    #[test]
    fn deinterleave_restores_the_stored_rows() {
        for (dtype, cols) in [(DType::Q4K, 768), (DType::Q6K, 512)] {
            let m = random_matrix(&mut Rng(9), dtype, 32, cols, 1.0);
            let enc = Encoding::of(dtype);
            let rb = m.row_bytes();
            let il = interleave(enc, &m.data, 32, rb);
            assert_ne!(il[..], m.data[..], "{dtype}: regrouped");
            // Quant chunk 1 of row 1 sits right after row 0's chunk 1.
            let (h0, hl) = head(enc);
            let q1 = if h0 == 0 { hl + 4 } else { 4 };
            assert_eq!(il[8 * hl + 32 + 4..][..4], m.data[rb + q1..][..4]);
            // Tiles from any tile on, as the task regroups them; piece by
            // piece and (where the CPU has it) by the AVX2 transpose.
            #[cfg(target_arch = "x86_64")]
            let simd = std::arch::is_x86_feature_detected!("avx2");
            #[cfg(not(target_arch = "x86_64"))]
            let simd = false;
            for simd in [false, simd] {
                let mut back = vec![0u8; 16 * rb];
                deinterleave_with(enc, &il[16 * rb..], rb, &mut back, simd);
                assert_eq!(back[..], m.data[16 * rb..], "{dtype} simd {simd}");
                let mut all = vec![0u8; 32 * rb];
                deinterleave_with(enc, &il, rb, &mut all, simd);
                assert_eq!(all[..], m.data[..], "{dtype} simd {simd}");
            }
        }
    }

    /// `matmul_group` on interleaved rows gives the stored rows' outputs bit
    /// for bit, for every ISA here, both numerics and any count of
    /// activation rows (the GEMV, the small tiles, the lane sweeps of one
    /// and two groups, the unpacked sweeps), with an odd-sized matrix ahead
    /// in the group so that tasks cut the interleaved tiles.
    #[test]
    fn interleaved_rows_give_the_stored_rows_outputs() {
        use crate::kernels::{matmul_group, MatmulJob};
        let isas = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Amx];
        let few: Vec<usize> = (1..=40).chain([64, 512]).collect();
        // Rows long enough that 16-lane sweeps take them a chunk of blocks
        // at a time (`CHUNK_BLOCKS`), for a few counts.
        let cases = [
            (DType::Q4K, 512, &few[..]),
            (DType::Q6K, 768, &few[..]),
            (DType::Q4K, 7168, &[1, 3, 17, 33][..]),
            (DType::Q6K, 7168, &[2, 5, 17, 64][..]),
        ];
        for (dtype, cols, ns) in cases {
            let mut rng = Rng(21);
            let m = random_matrix(&mut rng, dtype, 48, cols, 0.1);
            let head = random_matrix(&mut rng, DType::F16, 20, cols, 0.1);
            let plain = MatRef::new("w", &m).unwrap();
            let il = interleave(plain.enc, plain.data, 48, plain.row_bytes);
            let rows8 = MatRef {
                layout: Layout::Rows8,
                data: &il,
                ..plain
            };
            let head = MatRef::new("head", &head).unwrap();
            for &n in ns {
                let x = rng.vec(n * cols, 1.0);
                for isa in isas.into_iter().filter(|i| i.is_supported()) {
                    for numerics in [Numerics::Fast, Numerics::Exact] {
                        let run = |w: MatRef<'_>| {
                            let (mut y0, mut y) = (vec![0f32; n * 20], vec![f32::NAN; n * 48]);
                            let mut jobs = [
                                MatmulJob {
                                    w: head,
                                    y: &mut y0,
                                },
                                MatmulJob { w, y: &mut y },
                            ];
                            matmul_group(None, isa, numerics, &x, n, &mut jobs);
                            y
                        };
                        let (want, got) = (run(plain), run(rows8));
                        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "{dtype} {isa:?} {numerics:?} n {n}: output {i}: {a} vs {b}"
                            );
                        }
                    }
                }
            }
        }
    }
}
