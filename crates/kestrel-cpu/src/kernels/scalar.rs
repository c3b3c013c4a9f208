//! Portable scalar kernels: the *definition* of each dot product's result.
//!
//! Canonical order: a row is consumed in 16-element chunks; element `16c + l`
//! is fused-multiply-added into lane `l` (chunks in order), then the 16 lanes
//! are summed by the fixed tree `l + (l+8)`, `+ (l+4)`, `+ (l+2)`, `+ (l+1)`.
//! Dequantization is exact per element (see [`dequant_block`]). The SIMD
//! kernels in `x86.rs` follow the same operations lane for lane.

#![allow(clippy::needless_range_loop)] // element index drives both lane and source offset

use super::weight::Encoding;
use half::{bf16, f16};

/// Lanes of the canonical accumulator.
pub(crate) const LANES: usize = 16;
/// Elements per quantization block (and per dense "block" of the kernels).
pub(crate) const BLOCK: usize = 32;

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

#[inline]
fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_bits(u32_at(b, i))
}

#[inline]
fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// The 32 elements of the block starting at `b` (32 dense elements, or a
/// quantized block). Canonical dequantization:
/// Q8_0 `q * d`; Q4_0 `(q - 8) * d`; Q4_1 `fma(q, d, m)` (one rounding;
/// the f32 reference's `q * d + m` differs by at most 1 ulp per weight).
/// The f32-scale repackings give the same values as their GGUF blocks.
/// The repacked-only encodings give ggml's reference values exactly:
/// Q5_0F `(q - 16) * d`; Q5_1F and Q4KF `q * d + m` rounded twice (Q4_K and
/// Q5_K store `-(dmin * m)`, and `a + -b == a - b` in IEEE arithmetic);
/// Q6KF `(q - 32) * d` with `d` per 16 elements.
pub(crate) fn dequant_block(enc: Encoding, b: &[u8], out: &mut [f32; BLOCK]) {
    let q8_0 = |d: f32, qs: &[u8], out: &mut [f32; BLOCK]| {
        for (o, &q) in out.iter_mut().zip(qs) {
            *o = (q as i8) as f32 * d;
        }
    };
    let q4_0 = |d: f32, qs: &[u8], out: &mut [f32; BLOCK]| {
        for i in 0..16 {
            let q = qs[i];
            out[i] = ((q & 0x0F) as i32 - 8) as f32 * d;
            out[i + 16] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    };
    let q4_1 = |d: f32, m: f32, qs: &[u8], out: &mut [f32; BLOCK]| {
        for i in 0..16 {
            let q = qs[i];
            out[i] = ((q & 0x0F) as f32).mul_add(d, m);
            out[i + 16] = ((q >> 4) as f32).mul_add(d, m);
        }
    };
    // Element i of 32 from Q4_0-order nibbles and its fifth (and sixth) bits.
    let nib = |qs: &[u8], i: usize| -> u32 {
        if i < 16 {
            u32::from(qs[i] & 0x0F)
        } else {
            u32::from(qs[i - 16] >> 4)
        }
    };
    let q5 = |qh: u32, qs: &[u8], i: usize| nib(qs, i) | (((qh >> i) & 1) << 4);
    match enc {
        Encoding::Q5_0F => {
            let (d, qh) = (f32_at(b, 0), u32_at(b, 4));
            for (i, o) in out.iter_mut().enumerate() {
                *o = (q5(qh, &b[8..24], i) as i32 - 16) as f32 * d;
            }
        }
        Encoding::Q5_1F => {
            let (d, m, qh) = (f32_at(b, 0), f32_at(b, 4), u32_at(b, 8));
            for (i, o) in out.iter_mut().enumerate() {
                *o = q5(qh, &b[12..28], i) as f32 * d + m;
            }
        }
        Encoding::Q4KF => {
            let (d, m) = (f32_at(b, 0), f32_at(b, 4));
            for (i, o) in out.iter_mut().enumerate() {
                *o = nib(&b[8..24], i) as f32 * d + m;
            }
        }
        Encoding::Q6KF => {
            let (d0, d1) = (f32_at(b, 0), f32_at(b, 4));
            let (b4, b5) = (u32_at(b, 8), u32_at(b, 12));
            for (i, o) in out.iter_mut().enumerate() {
                let q = nib(&b[16..32], i) | (((b4 >> i) & 1) << 4) | (((b5 >> i) & 1) << 5);
                *o = (q as i32 - 32) as f32 * if i < 16 { d0 } else { d1 };
            }
        }
        Encoding::F32 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f32_at(b, 4 * i);
            }
        }
        Encoding::F16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f16_at(b, 2 * i);
            }
        }
        Encoding::Bf16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = bf16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])).to_f32();
            }
        }
        Encoding::Q8_0 => q8_0(f16_at(b, 0), &b[2..34], out),
        Encoding::Q4_0 => q4_0(f16_at(b, 0), &b[2..18], out),
        Encoding::Q4_0F => q4_0(f32_at(b, 0), &b[4..20], out),
        Encoding::Q4_1 => q4_1(f16_at(b, 0), f16_at(b, 2), &b[4..20], out),
        Encoding::Q4_1F => q4_1(f32_at(b, 0), f32_at(b, 4), &b[8..24], out),
    }
}

/// One dense element `i` of a row (for tails that are not a whole block).
pub(crate) fn dense_elem(enc: Encoding, row: &[u8], i: usize) -> f32 {
    match enc {
        Encoding::F32 => f32_at(row, 4 * i),
        Encoding::F16 => f16_at(row, 2 * i),
        Encoding::Bf16 => {
            bf16::from_bits(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])).to_f32()
        }
        _ => unreachable!("quantized rows are whole blocks"),
    }
}

/// Dequantize a whole row (`out.len()` = cols) in canonical values.
pub(crate) fn dequant_row(enc: Encoding, row: &[u8], out: &mut [f32]) {
    let nfull = out.len() / BLOCK;
    let bb = enc.block_bytes();
    let mut buf = [0f32; BLOCK];
    for blk in 0..nfull {
        dequant_block(enc, &row[blk * bb..(blk + 1) * bb], &mut buf);
        out[blk * BLOCK..(blk + 1) * BLOCK].copy_from_slice(&buf);
    }
    for i in nfull * BLOCK..out.len() {
        out[i] = dense_elem(enc, row, i);
    }
}

/// Accumulate the elements `from..x.len()` of a dense row into `acc`, in the
/// canonical order (element `from + j` goes to lane `j % 16`).
#[inline]
pub(crate) fn dense_tail(
    enc: Encoding,
    row: &[u8],
    x: &[f32],
    from: usize,
    acc: &mut [f32; LANES],
) {
    for i in from..x.len() {
        let l = (i - from) % LANES;
        acc[l] = dense_elem(enc, row, i).mul_add(x[i], acc[l]);
    }
}

/// The canonical 16-lane reduction tree.
#[inline]
pub(crate) fn reduce16(a: &[f32; LANES]) -> f32 {
    let mut s8 = [0f32; 8];
    for l in 0..8 {
        s8[l] = a[l] + a[l + 8];
    }
    let mut s4 = [0f32; 4];
    for l in 0..4 {
        s4[l] = s8[l] + s8[l + 4];
    }
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}

/// Canonical dot product of one encoded row with `x` (`x.len()` = cols).
pub(crate) fn dot(enc: Encoding, row: &[u8], x: &[f32]) -> f32 {
    let nfull = x.len() / BLOCK;
    let bb = enc.block_bytes();
    let mut acc = [0f32; LANES];
    let mut w = [0f32; BLOCK];
    for blk in 0..nfull {
        dequant_block(enc, &row[blk * bb..(blk + 1) * bb], &mut w);
        let xb = &x[blk * BLOCK..(blk + 1) * BLOCK];
        for l in 0..LANES {
            acc[l] = w[l].mul_add(xb[l], acc[l]);
        }
        for l in 0..LANES {
            acc[l] = w[LANES + l].mul_add(xb[LANES + l], acc[l]);
        }
    }
    dense_tail(enc, row, x, nfull * BLOCK, &mut acc);
    reduce16(&acc)
}
