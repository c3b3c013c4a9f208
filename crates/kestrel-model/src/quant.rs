//! Dequantization (and reference quantization) of ggml block layouts.
//!
//! Dequantization follows ggml-quants.c `dequantize_row_*` exactly, every
//! product and sum rounded to f32 on its own (no fused multiply-add), which is
//! also what the `gguf` Python package computes: `tests/dequant_gguf_py.rs`
//! checks every type against it bit for bit. A runtime can use
//! [`Matrix::dequantize_row`] as the oracle for its fused kernels.
//! Quantization is ggml's reference, byte for byte (`quantize_row_*_ref`:
//! round to nearest for the legacy types, the scale searches of
//! [`kquant`] for K-quants), so synthetic models are real files of their
//! type; `tests/quantize_reference.rs` checks it against the `gguf` Python
//! package and llama.cpp's C.

use half::{bf16, f16};

use crate::{DType, Matrix};

mod kquant;

/// The little-endian f16 at byte `i` of a block, widened (every block
/// scale in ggml's formats).
pub fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Decodes `out.len()` elements (a multiple of the block size) from `src`.
///
/// Panics if `src` is shorter than the blocks `out` needs.
pub fn dequantize(dtype: DType, src: &[u8], out: &mut [f32]) {
    let be = dtype.block_elems();
    let bb = dtype.block_bytes();
    assert!(
        out.len().is_multiple_of(be),
        "{} elements is not a whole number of {dtype:?} blocks",
        out.len()
    );
    for (blk, y) in src.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        match dtype {
            DType::F32 => y[0] = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]),
            DType::F16 => y[0] = f16_at(blk, 0),
            DType::BF16 => y[0] = bf16::from_le_bytes([blk[0], blk[1]]).to_f32(),
            DType::Q8_0 => {
                let d = f16_at(blk, 0);
                for (y, &q) in y.iter_mut().zip(&blk[2..34]) {
                    *y = d * f32::from(q as i8);
                }
            }
            DType::Q4_0 => {
                let d = f16_at(blk, 0);
                for (j, &q) in blk[2..18].iter().enumerate() {
                    y[j] = d * (f32::from(q & 0x0F) - 8.0);
                    y[j + 16] = d * (f32::from(q >> 4) - 8.0);
                }
            }
            DType::Q4_1 => {
                let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
                for (j, &q) in blk[4..20].iter().enumerate() {
                    y[j] = d * f32::from(q & 0x0F) + m;
                    y[j + 16] = d * f32::from(q >> 4) + m;
                }
            }
            DType::Q5_0 => {
                let d = f16_at(blk, 0);
                let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                for (j, &q) in blk[6..22].iter().enumerate() {
                    let h0 = ((qh >> j) & 1) << 4;
                    let h1 = ((qh >> (j + 16)) & 1) << 4;
                    y[j] = d * ((u32::from(q & 0x0F) | h0) as i32 - 16) as f32;
                    y[j + 16] = d * ((u32::from(q >> 4) | h1) as i32 - 16) as f32;
                }
            }
            DType::Q5_1 => {
                let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
                let qh = u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]);
                for (j, &q) in blk[8..24].iter().enumerate() {
                    let h0 = ((qh >> j) & 1) << 4;
                    let h1 = ((qh >> (j + 16)) & 1) << 4;
                    y[j] = d * (u32::from(q & 0x0F) | h0) as f32 + m;
                    y[j + 16] = d * (u32::from(q >> 4) | h1) as f32 + m;
                }
            }
            DType::Q4K => dequantize_q4_k(blk, y),
            DType::Q5K => dequantize_q5_k(blk, y),
            DType::Q6K => dequantize_q6_k(blk, y),
        }
    }
}

/// The f32 scale and min of the eight 32-element sub-blocks of a Q4_K or
/// Q5_K super-block (`d * sc`, `dmin * m`, each one f32 product), as ggml
/// computes them before decoding the quants.
pub fn k_sub_block_scales(blk: &[u8]) -> [(f32, f32); 8] {
    let (d, min) = (f16_at(blk, 0), f16_at(blk, 2));
    let scales = &blk[4..16];
    std::array::from_fn(|j| {
        let (sc, m) = scale_min_k4(j, scales);
        (d * f32::from(sc), min * f32::from(m))
    })
}

/// `block_q5_K { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; }`:
/// Q4_K's layout plus a fifth bit per element (bit j of `qh[l]` for element
/// `l` of sub-block j).
fn dequantize_q5_k(blk: &[u8], y: &mut [f32]) {
    let sub = k_sub_block_scales(blk);
    let qh = &blk[16..48];
    let qs = &blk[48..176];
    for (j, &(d1, m1)) in sub.iter().enumerate() {
        let q = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        let shift = 4 * (j % 2);
        for l in 0..32 {
            let v = ((q[l] >> shift) & 0x0F) | (((qh[l] >> j) & 1) << 4);
            y[32 * j + l] = d1 * f32::from(v) - m1;
        }
    }
}

/// ggml `get_scale_min_k4`: 6-bit scale and min of sub-block `j` from the 12 packed bytes.
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }`
fn dequantize_q4_k(blk: &[u8], y: &mut [f32]) {
    let (d, min) = (f16_at(blk, 0), f16_at(blk, 2));
    let scales = &blk[4..16];
    let qs = &blk[16..144];
    for c in 0..4 {
        let q = &qs[32 * c..32 * c + 32];
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), min * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), min * f32::from(m2));
        let out = &mut y[64 * c..64 * c + 64];
        for l in 0..32 {
            out[l] = d1 * f32::from(q[l] & 0x0F) - m1;
            out[l + 32] = d2 * f32::from(q[l] >> 4) - m2;
        }
    }
}

/// `block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }`
fn dequantize_q6_k(blk: &[u8], y: &mut [f32]) {
    let d = f16_at(blk, 208);
    for n in 0..2 {
        let ql = &blk[64 * n..64 * n + 64];
        let qh = &blk[128 + 32 * n..128 + 32 * n + 32];
        let sc = &blk[192 + 8 * n..192 + 8 * n + 8];
        let out = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| d * f32::from(sc[is + k] as i8);
            out[l] = s(0) * q1 as f32;
            out[l + 32] = s(2) * q2 as f32;
            out[l + 64] = s(4) * q3 as f32;
            out[l + 96] = s(6) * q4 as f32;
        }
    }
}

/// Encodes `src` (a multiple of the block size) in `dtype`'s layout, appending to `out`.
pub fn quantize(dtype: DType, src: &[f32], out: &mut Vec<u8>) {
    let be = dtype.block_elems();
    assert!(
        src.len().is_multiple_of(be),
        "{} elements is not a whole number of {dtype:?} blocks",
        src.len()
    );
    for x in src.chunks_exact(be) {
        match dtype {
            DType::F32 => out.extend_from_slice(&x[0].to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f32(x[0]).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f32(x[0]).to_le_bytes()),
            DType::Q8_0 => {
                let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(x.iter().map(|v| (v * id).round() as i8 as u8));
            }
            DType::Q4_0 => {
                // The signed value of largest magnitude maps to -8.
                let max = x
                    .iter()
                    .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                // `x * id + 8.5` in f64 then rounded to f32, as gguf-py does
                // (ggml's own result depends on whether the C compiler fused
                // the multiply-add; this is what a fused one computes).
                let q = |v: f32| {
                    ((f64::from(v) * f64::from(id) + 8.5) as f32 as i32).clamp(0, 15) as u8
                };
                out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
            }
            DType::Q4_1 => {
                let (min, max) = x
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
            }
            DType::Q5_0 => {
                // ggml quantize_row_q5_0_ref: the signed extreme maps to
                // -16; rounded in f64 like Q4_0.
                let max = x
                    .iter()
                    .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = max / -16.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q: Vec<u8> = x
                    .iter()
                    .map(|&v| {
                        ((f64::from(v) * f64::from(id) + 16.5) as f32 as i32).clamp(0, 31) as u8
                    })
                    .collect();
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                push_5bit(&q, out);
            }
            DType::Q5_1 => {
                let (min, max) = x
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
                let d = (max - min) / 31.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q: Vec<u8> = x
                    .iter()
                    .map(|&v| (((v - min) * id + 0.5) as i32).clamp(0, 31) as u8)
                    .collect();
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                push_5bit(&q, out);
            }
            DType::Q4K => kquant::quantize_q4_k_block(x, out, 15),
            DType::Q5K => kquant::quantize_q4_k_block(x, out, 31),
            DType::Q6K => kquant::quantize_q6_k_block(x, out),
        }
    }
}

/// 32 five-bit values as `u32 qh` (bit e = bit 4 of element e) then Q4_0's nibbles.
fn push_5bit(q: &[u8], out: &mut Vec<u8>) {
    let qh = q
        .iter()
        .enumerate()
        .fold(0u32, |h, (e, &v)| h | (u32::from(v >> 4) << e));
    out.extend_from_slice(&qh.to_le_bytes());
    out.extend((0..16).map(|j| (q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4)));
}

impl Matrix {
    /// Decodes row `r` into `out` (`out.len() == self.cols`).
    ///
    /// Panics if `r >= rows` or `out` has the wrong length.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols, "dequantize_row: output length");
        dequantize(self.dtype, self.row(r), out);
    }

    /// The whole matrix as row-major `f32` (`rows * cols` values).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        if self.cols > 0 {
            for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
                self.dequantize_row(r, row);
            }
        }
        out
    }

    /// Encodes row-major `values` (`rows * cols`) as an owned matrix in `dtype`.
    ///
    /// Panics if `values.len() != rows * cols` or `cols` is not a multiple of
    /// the block size.
    pub fn quantize(dtype: DType, rows: usize, cols: usize, values: &[f32]) -> Matrix {
        assert_eq!(values.len(), rows * cols, "Matrix::quantize: value count");
        assert!(
            cols.is_multiple_of(dtype.block_elems()),
            "{cols} columns do not tile {dtype:?} blocks"
        );
        let mut data = Vec::with_capacity(rows * cols / dtype.block_elems() * dtype.block_bytes());
        quantize(dtype, values, &mut data);
        Matrix {
            dtype,
            rows,
            cols,
            data: data.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    fn deq(dtype: DType, blk: &[u8]) -> Vec<f32> {
        let mut y = vec![0.0; dtype.block_elems()];
        dequantize(dtype, blk, &mut y);
        y
    }

    #[test]
    fn q8_0_block() {
        let mut b = h(0.5).to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let y = deq(DType::Q8_0, &b);
        assert_eq!(y[0], -8.0);
        assert_eq!(y[16], 0.0);
        assert_eq!(y[31], 7.5);
    }

    #[test]
    fn q4_0_block_nibble_order() {
        let mut b = h(2.0).to_vec();
        // byte j: low nibble = element j, high nibble = element j + 16.
        b.extend((0..16u8).map(|j| j | (15 - j) << 4));
        let y = deq(DType::Q4_0, &b);
        assert_eq!(y[0], -16.0); // (0 - 8) * 2
        assert_eq!(y[15], 14.0); // (15 - 8) * 2
        assert_eq!(y[16], 14.0); // high nibble of byte 0 = 15
        assert_eq!(y[31], -16.0);
    }

    #[test]
    fn q4_1_block() {
        let mut b = h(0.25).to_vec();
        b.extend_from_slice(&h(-1.0));
        b.extend((0..16u8).map(|j| j | (j << 4)));
        let y = deq(DType::Q4_1, &b);
        assert_eq!(y[0], -1.0);
        assert_eq!(y[4], 0.0);
        assert_eq!(y[20], 0.0);
        assert_eq!(y[31], 2.75);
    }

    #[test]
    fn q4_k_block_scales_and_mins() {
        let mut b = Vec::new();
        b.extend_from_slice(&h(1.0)); // d
        b.extend_from_slice(&h(0.5)); // dmin
                                      // sub-block scales 1..=8 and mins 10..=17 (6-bit), packed per get_scale_min_k4.
        let sc: Vec<u8> = (1..=8).collect();
        let mn: Vec<u8> = (10..=17).collect();
        let mut s = [0u8; 12];
        for j in 0..4 {
            s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            s[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            s[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4);
        }
        b.extend_from_slice(&s);
        b.extend(std::iter::repeat_n(0x31u8, 128)); // low nibble 1, high nibble 3
        let y = deq(DType::Q4K, &b);
        for sub in 0..8 {
            let q = if sub % 2 == 0 { 1.0 } else { 3.0 };
            let want = f32::from(sc[sub]) * q - 0.5 * f32::from(mn[sub]);
            assert!(
                y[sub * 32..sub * 32 + 32].iter().all(|&v| v == want),
                "sub-block {sub}"
            );
        }
    }

    #[test]
    fn q6_k_block_layout() {
        let mut b = vec![0u8; 210];
        // Element e gets q = (e % 64) - 32 in the 6-bit layout.
        for n in 0..2 {
            for l in 0..32 {
                let q = |k: usize| ((l + 32 * k) % 64) as u8; // stored value (q + 32)
                let (q1, q2, q3, q4) = (q(0), q(1), q(2), q(3));
                b[64 * n + l] = (q1 & 15) | ((q3 & 15) << 4);
                b[64 * n + l + 32] = (q2 & 15) | ((q4 & 15) << 4);
                b[128 + 32 * n + l] =
                    (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
            }
        }
        for j in 0..16 {
            b[192 + j] = (j as i8 - 8) as u8;
        }
        b[208..210].copy_from_slice(&h(0.5));
        let y = deq(DType::Q6K, &b);
        for (e, &v) in y.iter().enumerate() {
            let want = 0.5 * ((e / 16) as f32 - 8.0) * ((e % 64) as f32 - 32.0);
            assert_eq!(v, want, "element {e}");
        }
    }

    /// Blocks dequantized by the `gguf` Python package (gguf==0.17.1,
    /// `gguf.quants.dequantize`) from the byte pattern `(i * 37 + 11) % 256`
    /// with `d`/`dmin` overwritten by f16 0.01 / 0.02: an independent check of
    /// the K-quant layouts.
    #[test]
    fn k_quants_match_gguf_py() {
        let mut q4k: Vec<u8> = (0..144).map(|i| ((i * 37 + 11) % 256) as u8).collect();
        q4k[0..2].copy_from_slice(&h(0.01));
        q4k[2..4].copy_from_slice(&h(0.02));
        let y = deq(DType::Q4K, &q4k);
        let sum: f64 = y.iter().map(|&v| f64::from(v)).sum();
        assert!((sum - Q4K_SUM).abs() < 1e-3, "q4_K sum {sum}");
        for &(i, v) in Q4K_PICKS {
            assert!(
                (f64::from(y[i]) - v).abs() < 1e-5,
                "q4_K[{i}] = {} want {v}",
                y[i]
            );
        }
        let mut q6k: Vec<u8> = (0..210).map(|i| ((i * 37 + 11) % 256) as u8).collect();
        q6k[208..210].copy_from_slice(&h(0.01));
        let y = deq(DType::Q6K, &q6k);
        let sum: f64 = y.iter().map(|&v| f64::from(v)).sum();
        assert!((sum - Q6K_SUM).abs() < 1e-3, "q6_K sum {sum}");
        for &(i, v) in Q6K_PICKS {
            assert!(
                (f64::from(y[i]) - v).abs() < 1e-5,
                "q6_K[{i}] = {} want {v}",
                y[i]
            );
        }
    }

    #[rustfmt::skip]
    const Q4K_SUM: f64 = 417.76922607421875;
    #[rustfmt::skip]
    const Q4K_PICKS: &[(usize, f64)] = &[(0, 2.3905105590820312), (1, -1.0202178955078125), (17, -1.0202178955078125), (31, 0.840179443359375), (32, -0.280059814453125), (63, 0.040008544921875), (64, 3.2907028198242188), (100, 0.440093994140625), (127, 0.3000640869140625), (128, 4.050865173339844), (150, 3.2706985473632812), (191, 0.0), (192, 5.051078796386719), (230, -0.64013671875), (255, -0.040008544921875)];
    #[rustfmt::skip]
    const Q6K_SUM: f64 = 46.129852294921875;
    #[rustfmt::skip]
    const Q6K_PICKS: &[(usize, f64)] = &[(0, -14.313056945800781), (1, 16.963623046875), (17, 5.12109375), (31, -0.960205078125), (32, 2.3104934692382812), (63, -5.801239013671875), (64, -30.406494140625), (100, 25.235389709472656), (127, 15.003204345703125), (128, -3.5107498168945312), (150, -1.68035888671875), (191, -9.802093505859375), (192, -4.841033935546875), (230, 9.402008056640625), (255, -0.600128173828125)];

    #[test]
    fn quantize_round_trips_within_block_error() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        for (dtype, tol) in [
            (DType::F32, 0.0),
            (DType::F16, 1e-3),
            (DType::BF16, 1e-2),
            (DType::Q8_0, 1e-2),
            (DType::Q4_0, 0.15),
            (DType::Q4_1, 0.08),
            (DType::Q5_0, 0.07),
            (DType::Q5_1, 0.04),
            (DType::Q4K, 0.1),
            (DType::Q5K, 0.05),
            (DType::Q6K, 0.04),
        ] {
            let m = Matrix::quantize(dtype, 2, 256, &x);
            assert_eq!(m.data.len(), 2 * m.row_bytes(), "{dtype:?}");
            let y = m.to_f32();
            let err = x
                .iter()
                .zip(&y)
                .fold(0f32, |a, (p, q)| a.max((p - q).abs()));
            assert!(err <= tol, "{dtype:?}: max error {err}");
        }
    }
}
