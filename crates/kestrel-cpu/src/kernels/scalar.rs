//! Portable scalar kernels: the *definition* of each dot product's result.
//!
//! Canonical order: a row is consumed in 16-element chunks; element `16c + l`
//! is fused-multiply-added into lane `l` (chunks in order), then the 16 lanes
//! are summed by the fixed tree `l + (l+8)`, `+ (l+4)`, `+ (l+2)`, `+ (l+1)`.
//! Dequantization is exact per element (see [`dequant_block`]), read from
//! the stored blocks in place. The SIMD
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

/// The 6-bit scale and minimum of sub-block `j` of a Q4_K/Q5_K super-block
/// whose first 16 bytes are `head` (f16 `d`, f16 `dmin`, 12 packed bytes:
/// ggml's `get_scale_min_k4`), as the f32 products `d * sc` and `dmin * m`.
#[inline(always)]
pub(crate) fn k_scale_min(head: &[u8; 16], j: usize) -> (f32, f32) {
    let q = &head[4..16];
    let (sc, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    };
    (
        f16_at(head, 0) * f32::from(sc),
        f16_at(head, 2) * f32::from(m),
    )
}

/// The 32 six-bit quants of sub-block `b` (0..8) of a Q6_K super-block
/// `sb`, in element order (ggml's layout: halves of 128 elements, each from
/// 64 low-nibble bytes and 32 bytes of 2-bit pairs).
#[inline]
pub(crate) fn q6k_quants(sb: &[u8], b: usize) -> [u8; BLOCK] {
    let (n, s) = (b / 4, b % 4);
    let ql = &sb[64 * n + 32 * (s % 2)..];
    let qh = &sb[128 + 32 * n..];
    std::array::from_fn(|l| ((ql[l] >> (4 * (s / 2))) & 0x0F) | (((qh[l] >> (2 * s)) & 3) << 4))
}

/// A quantized block's integer weights, the scales of its elements 0..16
/// and 16..32 (equal but for Q6_K), and its minimum (0 when none): block
/// `blk` (32 elements) of `row`, read in place (layouts: [`Encoding`]).
/// Integer weights: Q8_0 `q`, Q4_0 `q - 8`, Q5_0 `q - 16`, Q6_K `q - 32`,
/// Q4_1/Q5_1/Q4_K/Q5_K `q` (those have a minimum: Q4_1/Q5_1 `m`, Q4_K/Q5_K
/// `-(dmin * m)`).
pub(crate) fn decode_block(enc: Encoding, row: &[u8], blk: usize) -> ([i32; BLOCK], [f32; 2], f32) {
    let b = &row[enc.block_offset(blk)..];
    // Element i of 16 Q4_0-order nibble bytes, bit 4 from bit i of `qh`,
    // minus `off`.
    let q5 = |qs: &[u8], qh: u32, off: i32| -> [i32; BLOCK] {
        std::array::from_fn(|i| {
            let q = if i < 16 {
                qs[i] & 0x0F
            } else {
                qs[i - 16] >> 4
            };
            (u32::from(q) | ((qh >> i) & 1) << 4) as i32 - off
        })
    };
    let one = |d: f32| [d, d];
    // Sub-block j's nibbles of a Q4_K/Q5_K super-block.
    let k_nibbles = |qs: &[u8], j: usize| -> [u8; BLOCK] {
        std::array::from_fn(|l| (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F)
    };
    let j = blk % 8;
    match enc {
        Encoding::Q8_0 => (
            std::array::from_fn(|i| i32::from(b[2 + i] as i8)),
            one(f16_at(b, 0)),
            0.0,
        ),
        Encoding::Q4_0 => (q5(&b[2..18], 0, 8), one(f16_at(b, 0)), 0.0),
        Encoding::Q4_1 => (q5(&b[4..20], 0, 0), one(f16_at(b, 0)), f16_at(b, 2)),
        Encoding::Q5_0 => (q5(&b[6..22], u32_at(b, 2), 16), one(f16_at(b, 0)), 0.0),
        Encoding::Q5_1 => (
            q5(&b[8..24], u32_at(b, 4), 0),
            one(f16_at(b, 0)),
            f16_at(b, 2),
        ),
        Encoding::Q4K | Encoding::Q5K => {
            let head: &[u8; 16] = b[..16].try_into().expect("a K-quant head");
            let (d, m) = k_scale_min(head, j);
            let qs = if enc == Encoding::Q5K {
                &b[48..176]
            } else {
                &b[16..144]
            };
            let nib = k_nibbles(qs, j);
            let w = std::array::from_fn(|l| {
                let high = if enc == Encoding::Q5K {
                    ((b[16 + l] >> j) & 1) << 4
                } else {
                    0
                };
                i32::from(nib[l] | high)
            });
            (w, one(d), -m)
        }
        Encoding::Q6K => {
            let q = q6k_quants(b, j);
            let d = f16_at(b, 208);
            let sc = |h: usize| d * f32::from(b[192 + 2 * j + h] as i8);
            (
                std::array::from_fn(|l| i32::from(q[l]) - 32),
                [sc(0), sc(1)],
                0.0,
            )
        }
        dense @ (Encoding::F32 | Encoding::F16 | Encoding::Bf16) => {
            unreachable!("{dense:?} has no quantized blocks")
        }
    }
}

/// The 32 elements of block `blk` of `row` (32 dense elements, or a
/// quantized block or K-quant sub-block). Canonical dequantization, from
/// [`decode_block`]'s integer weights `w`, scale `d` and minimum `m`:
/// Q8_0, Q4_0, Q5_0, Q6_K `w * d`; Q4_1 `fma(w, d, m)` (one rounding; the
/// f32 reference's `q * d + m` differs by at most 1 ulp per weight);
/// Q5_1, Q4_K, Q5_K `w * d + m` rounded twice (ggml's reference values
/// exactly: Q4_K and Q5_K's `m` is `-(dmin * m)`, and `a + -b == a - b` in
/// IEEE arithmetic).
pub(crate) fn dequant_block(enc: Encoding, row: &[u8], blk: usize, out: &mut [f32; BLOCK]) {
    let dense = &row[enc.block_offset(blk)..];
    match enc {
        Encoding::F32 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f32_at(dense, 4 * i);
            }
        }
        Encoding::F16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f16_at(dense, 2 * i);
            }
        }
        Encoding::Bf16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = bf16::from_bits(u16::from_le_bytes([dense[2 * i], dense[2 * i + 1]])).to_f32();
            }
        }
        q => {
            let (w, d, m) = decode_block(q, row, blk);
            for (i, o) in out.iter_mut().enumerate() {
                let (w, d) = (w[i] as f32, d[i / 16]);
                *o = match q {
                    Encoding::Q4_1 => w.mul_add(d, m),
                    Encoding::Q5_1 | Encoding::Q4K | Encoding::Q5K => w * d + m,
                    _ => w * d,
                };
            }
        }
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
    let mut buf = [0f32; BLOCK];
    for blk in 0..nfull {
        dequant_block(enc, row, blk, &mut buf);
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
    let mut acc = [0f32; LANES];
    let mut w = [0f32; BLOCK];
    for blk in 0..nfull {
        dequant_block(enc, row, blk, &mut w);
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
