//! Fast numerics ([`Numerics::Fast`]): activations quantized to int8 per
//! 32-element block, integer dot products with every quantized weight block
//! (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, and the 32-element sub-blocks of the
//! K-quants, read in place; ggml's Q8_1 activations). This file is the
//! *definition* of the mode's results; `x86_int8.rs` reproduces it bit for
//! bit with AVX2 and AVX-512 VNNI for finite activations. Dense encodings
//! (F32/F16/BF16) keep the exact f32 path in either mode.
//!
//! Per activation block: `d = max|x| / 127`, `q = round_ties_even(x / d)`
//! (as `x * (1 / d)`), `s = d * sum(q)`. Per output, one f32 sum over the
//! blocks in order: block b adds `float(sum_i w[i] * q[i]) * (d_w * d_x)`
//! (one fused rounding), with `w` the block's integer weights (Q8_0 `q`,
//! Q4_0 `q - 8`, Q5_0 `q - 16`, Q6_K `q - 32`, Q4_1/Q5_1/Q4_K/Q5_K `q`) and
//! `d_w` its scale; Q6_K, whose elements 0..16 and 16..32 have scales of
//! their own, adds its two halves that way, first then second. A minimum's
//! `m_w * s_x` (Q4_1, Q5_1, Q4_K, Q5_K) goes to a second fused sum; the
//! result is the first sum plus the second. Integer sums are exact (and
//! `|sum| < 2^24` converts exactly), so a kernel may form them in any order,
//! and one result serves every batch size, thread count and ISA: the SIMD
//! kernels put one output (weight row, activation row) in each lane and run
//! the definition's float steps lane by lane.

use super::line_buf::LineBuf;
use super::scalar::{decode_block, BLOCK};
use super::weight::Encoding;

/// How the matrix kernels compute: int8 activations for the encodings that
/// have an integer dot (the default), or exact f32.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Numerics {
    /// Canonical f32 dot products of the weights' exact values: the mode
    /// the f32 NumPy golden files are checked in.
    Exact,
    /// Int8 activations per 32-element block for every quantized weight
    /// type (see the module docs); batch-invariant and deterministic, not
    /// exact (the accuracy gate is `tests/fast_accuracy.rs`). Dense
    /// (F32/F16/BF16) weights stay exact.
    #[default]
    Fast,
}

/// One 32-element block of a quantized activation row.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Q8Block {
    /// Scale: element `i` is `q[i] * d`.
    pub d: f32,
    /// `d * sum(q)`: the block's sum, for weights with a minimum.
    pub s: f32,
    pub q: [i8; BLOCK],
}

impl Q8Block {
    /// The integer sums of elements 0..16 and 16..32: where a sweep of
    /// weights read as `w + offset` takes `offset * sum(x)` off, half by
    /// half ([`lane_offset`]).
    pub(crate) fn half_sums(&self) -> [i32; 2] {
        let sum = |h: &[i8]| h.iter().map(|&v| i32::from(v)).sum();
        [sum(&self.q[..16]), sum(&self.q[16..])]
    }
}

/// Whether [`Numerics::Fast`] has an integer dot for `enc`: every encoding
/// made of quantized 32-element blocks.
pub(crate) const fn has_int8_dot(enc: Encoding) -> bool {
    enc.is_quantized()
}

/// Quantize one activation row (`x.len() == 32 * out.len()`).
pub(crate) fn quantize_row(x: &[f32], out: &mut [Q8Block]) {
    debug_assert_eq!(x.len(), BLOCK * out.len());
    for (xb, o) in x.chunks_exact(BLOCK).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        for (q, &v) in o.q.iter_mut().zip(xb) {
            *q = (v * id).round_ties_even() as i8;
        }
        o.d = d;
        o.s = d * o.q.iter().map(|&q| i32::from(q)).sum::<i32>() as f32;
    }
}

/// Whether `enc`'s blocks have a scale per 16 elements (Q6_K), not one.
pub(crate) const fn two_scales(enc: Encoding) -> bool {
    matches!(enc, Encoding::Q6K)
}

/// Whether `enc`'s blocks have a minimum (`m_w * s_x` is added): Q4_1,
/// Q5_1, Q4_K, Q5_K. Their integer weights are nonnegative, the other
/// types' signed ([`decode_block`]).
pub(crate) const fn has_min(enc: Encoding) -> bool {
    matches!(
        enc,
        Encoding::Q4_1 | Encoding::Q5_1 | Encoding::Q4K | Encoding::Q5K
    )
}

/// What the lane sweeps add to `enc`'s integer weights so they read them
/// as unsigned bytes against the signed activations (`vpdpbusd` and
/// `vpmaddubsw` take one unsigned operand): 0 for the types with a minimum
/// (their weights are nonnegative); 8, 16, 32 for Q4_0, Q5_0, Q6_K (whose
/// weights are `q - 8/16/32`: the stored `q`); for Q8_0 128 with VNNI
/// (`vnni`: i32 sums), 0 on AVX2, whose i16 pair sums could not hold
/// `2 * 255 * 127` (it signs the activations by the weights instead). The
/// sums then start at `-offset * sum(x)` ([`LaneRows`]' sums), which leaves
/// `sum(w * x)` exactly.
pub(crate) const fn lane_offset(enc: Encoding, vnni: bool) -> i32 {
    match enc {
        Encoding::Q4_0 => 8,
        Encoding::Q5_0 => 16,
        Encoding::Q6K => 32,
        Encoding::Q8_0 if vnni => 128,
        _ => 0,
    }
}

/// The largest `|w|` [`decode_block`] gives for `enc` (0 for dense ones).
pub(crate) const fn max_abs_weight(enc: Encoding) -> i32 {
    match enc {
        Encoding::Q8_0 => 128,
        Encoding::Q4_0 => 8,
        Encoding::Q4_1 | Encoding::Q4K => 15,
        Encoding::Q5_0 => 16,
        Encoding::Q5_1 | Encoding::Q5K => 31,
        Encoding::Q6K => 32,
        Encoding::F32 | Encoding::F16 | Encoding::Bf16 => 0,
    }
}

/// The largest `|w|` of block `blk` of `row` (tests).
#[cfg(test)]
pub(crate) fn block_max_abs(enc: Encoding, row: &[u8], blk: usize) -> i32 {
    decode_block(enc, row, blk)
        .0
        .iter()
        .map(|w| w.abs())
        .max()
        .unwrap_or(0)
}

/// Canonical fast-mode dot product of one encoded row with a quantized
/// activation row (one [`Q8Block`] per weight block).
pub(crate) fn dot(enc: Encoding, row: &[u8], xq: &[Q8Block]) -> f32 {
    let two = two_scales(enc);
    let mut acc = 0f32;
    let mut mins = 0f32;
    for (blk, xb) in xq.iter().enumerate() {
        let (w, dw, mw) = decode_block(enc, row, blk);
        let sum = |r: std::ops::Range<usize>| -> f32 {
            r.map(|i| w[i] * i32::from(xb.q[i])).sum::<i32>() as f32
        };
        if two {
            acc = sum(0..16).mul_add(dw[0] * xb.d, acc);
            acc = sum(16..32).mul_add(dw[1] * xb.d, acc);
        } else {
            acc = sum(0..32).mul_add(dw[0] * xb.d, acc);
        }
        mins = mw.mul_add(xb.s, mins);
    }
    acc + mins
}

/// Quantized activation rows laid out one per SIMD lane, for the kernels
/// that hold `lanes` activation rows' blocks in one register: group `g`
/// (rows `lanes * g ..`, the last real row repeated past the end) stores,
/// per block `b`, the bytes `4k..4k + 4` of every lane's row for `k` in
/// `0..8` (`32 * lanes` bytes, lane-major within `k`), the rows' `d` and
/// `s` (`lanes` floats each), and, when a sweep reads them, the integer
/// sums of their elements 0..16 and 16..32 (`lanes` each, the first half's
/// first: where a sweep's sums start, [`lane_offset`]). Each array starts
/// on a cache line ([`LineBuf`]), so the sweeps' vector loads never split
/// across two.
#[derive(Debug, Default)]
pub(crate) struct LaneRows {
    /// Rows per group.
    pub lanes: usize,
    /// Blocks per row.
    pub nblocks: usize,
    pub q: LineBuf<u8>,
    pub d: LineBuf<f32>,
    pub s: LineBuf<f32>,
    pub sums: LineBuf<i32>,
}

impl LaneRows {
    /// Lay out the `n` rows of `xq` (`nblocks` blocks each) `lanes` to a
    /// group, with their integer sums if `sums` (a weight type with a
    /// nonzero [`lane_offset`] reads them; summed always, `fill` took 2.0%
    /// of `perf record`'s samples of a 135M Q4_1 model's 32-stream decode
    /// instead of 1.0%): [`LaneRows::shape`], then every group in turn
    /// ([`LaneWriter::fill_group`]). The matmuls lay rows out through
    /// `matmul_int8::quantize_lanes`, a group per task.
    #[cfg(test)]
    pub fn fill(&mut self, xq: &[Q8Block], n: usize, nblocks: usize, lanes: usize, sums: bool) {
        assert!(n >= 1 && xq.len() >= n * nblocks);
        let w = self.shape(n, nblocks, lanes);
        for g in 0..n.div_ceil(lanes) {
            let rows = &xq[g * lanes * nblocks..((g + 1) * lanes).min(n) * nblocks];
            // SAFETY: `self` is shaped for `n` rows and borrowed mutably
            // here; one group at a time.
            unsafe { w.fill_group(g, rows, sums) };
        }
    }

    /// Size the buffers for `n` rows of `nblocks` blocks, `lanes` to a
    /// group, and return the writer that fills them a group at a time.
    pub fn shape(&mut self, n: usize, nblocks: usize, lanes: usize) -> LaneWriter {
        assert!(n >= 1 && lanes >= 1);
        let groups = n.div_ceil(lanes);
        (self.lanes, self.nblocks) = (lanes, nblocks);
        self.q.resize(groups * nblocks * BLOCK * lanes);
        self.d.resize(groups * nblocks * lanes);
        self.s.resize(groups * nblocks * lanes);
        self.sums.resize(groups * nblocks * 2 * lanes);
        LaneWriter {
            q: self.q.as_mut_ptr(),
            d: self.d.as_mut_ptr(),
            s: self.s.as_mut_ptr(),
            sums: self.sums.as_mut_ptr(),
            lanes,
            nblocks,
            groups,
        }
    }
}

/// Where [`LaneRows::shape`] left a [`LaneRows`]' buffers: each lane group
/// is filled on its own ([`LaneWriter::fill_group`]), so the groups of a
/// many-row matmul's activations can be laid out by the team's threads at
/// once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LaneWriter {
    q: *mut u8,
    d: *mut f32,
    s: *mut f32,
    sums: *mut i32,
    lanes: usize,
    nblocks: usize,
    groups: usize,
}

// SAFETY: a LaneWriter is only pointers into buffers the caller of
// `LaneRows::shape` holds borrowed, and `fill_group`'s contract keeps any
// two threads' writes to distinct groups.
unsafe impl Send for LaneWriter {}
// SAFETY: as above.
unsafe impl Sync for LaneWriter {}

impl LaneWriter {
    /// Lay out group `g` from its rows `xq` (`lanes` rows of `nblocks`
    /// blocks, fewer for the last group, whose last row fills the lanes
    /// past them), with their integer sums if `sums`.
    ///
    /// # Safety
    /// The [`LaneRows`] this writer came from must not have been reshaped
    /// or dropped, and nothing else may read or write its group `g` during
    /// the call (other threads may fill other groups).
    pub(crate) unsafe fn fill_group(self, g: usize, xq: &[Q8Block], sums: bool) {
        let (lanes, nblocks) = (self.lanes, self.nblocks);
        let rows = xq.len() / nblocks;
        assert!(g < self.groups && rows >= 1 && rows <= lanes && xq.len() == rows * nblocks);
        // SAFETY: group g's blocks of each buffer lie within what `shape`
        // sized (g < groups) and are this call's alone (fn contract).
        let (q, d, s, all_sums) = unsafe {
            let at = g * nblocks;
            (
                std::slice::from_raw_parts_mut(
                    self.q.add(at * BLOCK * lanes),
                    nblocks * BLOCK * lanes,
                ),
                std::slice::from_raw_parts_mut(self.d.add(at * lanes), nblocks * lanes),
                std::slice::from_raw_parts_mut(self.s.add(at * lanes), nblocks * lanes),
                std::slice::from_raw_parts_mut(self.sums.add(2 * at * lanes), nblocks * 2 * lanes),
            )
        };
        for b in 0..nblocks {
            let q = &mut q[b * BLOCK * lanes..(b + 1) * BLOCK * lanes];
            for lane in 0..lanes {
                let xb = &xq[lane.min(rows - 1) * nblocks + b];
                // Whole four-byte groups (this runs before every many-row
                // fast matmul: byte by byte it was 2-3% of a decode step).
                for (k, four) in xb.q.chunks_exact(4).enumerate() {
                    let at = (k * lanes + lane) * 4;
                    q[at..at + 4]
                        .copy_from_slice(&std::array::from_fn::<u8, 4, _>(|e| four[e] as u8));
                }
                d[b * lanes + lane] = xb.d;
                s[b * lanes + lane] = xb.s;
                if sums {
                    for (h, sum) in xb.half_sums().into_iter().enumerate() {
                        all_sums[(2 * b + h) * lanes + lane] = sum;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantized_blocks_reconstruct_within_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 29) as f32 - 14.0) * 0.37)
            .collect();
        let mut q = [Q8Block::default(); 2];
        quantize_row(&x, &mut q);
        for (xb, b) in x.chunks_exact(32).zip(&q) {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            assert_eq!(b.d, amax / 127.0);
            assert!(b.q.iter().any(|&v| v.abs() == 127));
            for (v, &qi) in xb.iter().zip(&b.q) {
                assert!((v - f32::from(qi) * b.d).abs() <= b.d * 0.5 * (1.0 + 1e-6));
            }
            let sum: i32 = b.q.iter().map(|&v| i32::from(v)).sum();
            assert_eq!(b.s, b.d * sum as f32);
        }
        // A zero block quantizes to zeros with a zero scale.
        let mut z = [Q8Block::default()];
        quantize_row(&[0.0; 32], &mut z);
        assert_eq!((z[0].d, z[0].s, z[0].q), (0.0, 0.0, [0; 32]));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_quantizer_gives_the_definition_ties_included() {
        use super::super::coverage::tested_isas;
        use super::super::Isa;
        let test = "avx2_quantizer_gives_the_definition_ties_included";
        if tested_isas(test, &[Isa::Avx2]).is_empty() {
            return;
        }
        // Block 0: amax 127, so d = 1 and every .5 is a tie (to even);
        // block 1: zeros; blocks 2..: random magnitudes.
        let mut x: Vec<f32> = (0..32).map(|i| i as f32 * 2.5 - 40.25).collect();
        x[31] = -127.0;
        x[3] = 2.5;
        x[4] = -3.5;
        x.extend([0.0; 32]);
        let mut rng = crate::synth::Rng(9);
        x.extend(rng.vec(32 * 40, 3.0));
        let nb = x.len() / 32;
        let (mut a, mut b) = (vec![Q8Block::default(); nb], vec![Q8Block::default(); nb]);
        quantize_row(&x, &mut a);
        // SAFETY: `x` holds 32 floats per block of `b`; AVX2 checked above.
        unsafe { super::super::x86_int8::quantize_row256(x.as_ptr(), nb, b.as_mut_ptr()) };
        assert_eq!((a[0].q[3], a[0].q[4]), (2, -4), "ties go to even");
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            assert_eq!(
                (a.d.to_bits(), a.s.to_bits(), a.q),
                (b.d.to_bits(), b.s.to_bits(), b.q),
                "block {i}"
            );
        }
    }
}
