//! Weight encodings the kernels read, and the load-time repacking of GGUF
//! blocks into encodings that are cheaper to decode.
//!
//! A GGUF Q4_0/Q4_1 block stores its scale (and minimum) as f16. Decoding a
//! block then costs a conversion and two register broadcasts before the
//! first weight, all on the shuffle ports that the nibble lookup also needs:
//! single-stream decode is bound by exactly that decode work, not by memory.
//! [`Weight::prepare`] widens the scales to f32 once, at load, so each block
//! starts with plain broadcast loads ([`Encoding::Q4_0F`], [`Encoding::Q4_1F`]).
//! f16 -> f32 is exact, so a repacked block decodes to the very same values
//! and every result stays bit-identical to the stored encoding's. The cost is
//! bytes: 20 instead of 18 (Q4_0) and 24 instead of 20 (Q4_1) per 32 weights.
//!
//! Q5_0/Q5_1 and the K-quants (Q4_K, Q5_K, Q6_K: 256-element super-blocks
//! with 6- or 8-bit sub-block scales) are only read repacked: every
//! 32-element sub-block becomes a self-contained block with its f32 scale
//! products (`d * sc`, `dmin * m`, computed once exactly as ggml does) and
//! its quants in Q4_0's nibble order, so one kernel structure (32-element
//! [`super::x86::Block`]s) serves every type, and each weight decodes to
//! ggml's reference value bit for bit (`kestrel_model::quant::dequantize`).
//!
//! These repackings hold 9-33% more bytes than the file (Q4_K 1.33x, Q5_K
//! 1.27x, Q6_K 1.22x, Q4_1 1.20x, Q5_1 1.17x, Q4_0 1.11x, Q5_0 1.09x), over
//! issue 30's 1.05x target: `tests/resident_weights.rs` measures it per
//! type (ignored until the kernels read the stored blocks directly).
use kestrel_model::{Bytes, DType, Matrix};

use super::matmul::MatRef;
use crate::CpuError;

/// How the kernels read a weight row's bytes: a GGUF dtype as stored, or
/// one of the repackings [`Weight::prepare`] makes. Every quantized encoding
/// is made of 32-element blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Encoding {
    F32,
    F16,
    Bf16,
    /// GGUF Q8_0: f16 scale `d`, 32 x i8; weight `q * d`.
    Q8_0,
    /// GGUF Q4_0: f16 scale `d`, 16 bytes of nibbles; weight `(q - 8) * d`.
    Q4_0,
    /// GGUF Q4_1: f16 `d`, f16 `m`, 16 bytes of nibbles; weight `fma(q, d, m)`.
    Q4_1,
    /// Q4_0 with `d` as f32 (20-byte blocks); same weights.
    Q4_0F,
    /// Q4_1 with `d` and `m` as f32 (24-byte blocks); same weights.
    Q4_1F,
    /// Q5_0 with `d` as f32: `f32 d`, `u32 qh` (bit e = bit 4 of element
    /// e), 16 bytes of nibbles (24-byte blocks); weight `(q - 16) * d`.
    Q5_0F,
    /// Q5_1 with f32 scales, and one Q5_K sub-block (`d = d * sc`,
    /// `m = -(dmin * m)`): `f32 d`, `f32 m`, `u32 qh`, 16 bytes of nibbles
    /// (28-byte blocks); weight `q * d + m`, two roundings as in ggml.
    Q5_1F,
    /// One Q4_K sub-block: `f32 d` (`d * sc`), `f32 m` (`-(dmin * m)`), 16
    /// bytes of nibbles (24-byte blocks); weight `q * d + m`, two roundings.
    Q4KF,
    /// 32 elements of a Q6_K super-block: `f32 d0`, `f32 d1` (`d * sc` of
    /// elements 0..16 and 16..32), `u32` bit planes of bit 4 and of bit 5
    /// (bit e = that bit of element e; they expand to bytes or lane masks
    /// in one step), 16 bytes of nibbles (32-byte blocks); weight
    /// `(q - 32) * d`.
    Q6KF,
}

impl Encoding {
    /// The encoding a stored GGUF/safetensors dtype is read in as stored, if
    /// the kernels read it without repacking (Q5_0/Q5_1 and the K-quants are
    /// read only after [`Weight::prepare`]; see [`Encoding::prepared_of`]).
    pub const fn of(dtype: DType) -> Option<Encoding> {
        Some(match dtype {
            DType::F32 => Encoding::F32,
            DType::F16 => Encoding::F16,
            DType::BF16 => Encoding::Bf16,
            DType::Q8_0 => Encoding::Q8_0,
            DType::Q4_0 => Encoding::Q4_0,
            DType::Q4_1 => Encoding::Q4_1,
            DType::Q5_0 | DType::Q5_1 | DType::Q4K | DType::Q5K | DType::Q6K => return None,
        })
    }

    /// The encoding [`Weight::prepare`] makes of `dtype`.
    pub const fn prepared_of(dtype: DType) -> Encoding {
        match dtype {
            DType::Q5_0 => Encoding::Q5_0F,
            DType::Q5_1 | DType::Q5K => Encoding::Q5_1F,
            DType::Q4K => Encoding::Q4KF,
            DType::Q6K => Encoding::Q6KF,
            DType::F32 => Encoding::F32,
            DType::F16 => Encoding::F16,
            DType::BF16 => Encoding::Bf16,
            DType::Q8_0 => Encoding::Q8_0,
            DType::Q4_0 => Encoding::Q4_0F,
            DType::Q4_1 => Encoding::Q4_1F,
        }
    }

    /// Whether rows are made of 32-element blocks with their own scales
    /// (`cols` must then be a multiple of 32).
    pub const fn is_quantized(self) -> bool {
        !matches!(self, Encoding::F32 | Encoding::F16 | Encoding::Bf16)
    }

    /// Bytes per 32 elements (a quantized block, or 32 dense elements).
    pub const fn block_bytes(self) -> usize {
        match self {
            Encoding::F32 => 128,
            Encoding::F16 | Encoding::Bf16 => 64,
            Encoding::Q8_0 => 34,
            Encoding::Q4_0 => 18,
            Encoding::Q4_1 | Encoding::Q4_0F => 20,
            Encoding::Q4_1F | Encoding::Q5_0F | Encoding::Q4KF => 24,
            Encoding::Q5_1F => 28,
            Encoding::Q6KF => 32,
        }
    }

    /// Bytes of one row of `cols` elements (whole blocks when quantized).
    pub const fn row_bytes(self, cols: usize) -> usize {
        match self {
            Encoding::F32 => 4 * cols,
            Encoding::F16 | Encoding::Bf16 => 2 * cols,
            q => cols / 32 * q.block_bytes(),
        }
    }

    /// The encoding [`Weight::prepare`] repacks stored `self` into (`self`
    /// when it is kept as stored). Q8_0 is kept: the LM head it usually holds is
    /// bound by memory, where 2 more bytes per block cost more than the
    /// conversion they save (measured: 49152x576 GEMV 1.44 -> 1.88 ms).
    pub const fn prepared(self) -> Encoding {
        match self {
            Encoding::Q4_0 => Encoding::Q4_0F,
            Encoding::Q4_1 => Encoding::Q4_1F,
            other => other,
        }
    }
}

/// A validated weight matrix in the encoding the kernels read it in,
/// owning (or sharing, when kept as stored) its bytes.
#[derive(Debug, Clone)]
pub struct Weight {
    enc: Encoding,
    rows: usize,
    cols: usize,
    data: Bytes,
}

impl Weight {
    /// Validate `m` (whole blocks, enough bytes) and repack it into
    /// [`Encoding::prepared_of`] its dtype. Bytes that are kept as stored
    /// stay shared (a memory-mapped GGUF is not copied); repacked ones are
    /// owned.
    pub fn prepare(name: &str, m: &Matrix) -> Result<Weight, CpuError> {
        let enc = Encoding::prepared_of(m.dtype);
        let be = m
            .dtype
            .block_elems()
            .max(if enc.is_quantized() { 32 } else { 1 });
        if !m.cols.is_multiple_of(be) {
            return Err(CpuError::Shape {
                name: name.to_owned(),
                expected: format!("cols a multiple of {be} for {}", m.dtype),
                got: m.cols.to_string(),
            });
        }
        let stored_bytes = m.rows * (m.cols / m.dtype.block_elems()) * m.dtype.block_bytes();
        if m.data.len() < stored_bytes {
            return Err(CpuError::Shape {
                name: name.to_owned(),
                expected: format!("{stored_bytes} bytes for {}x{} {}", m.rows, m.cols, m.dtype),
                got: format!("{} bytes", m.data.len()),
            });
        }
        let data = if Encoding::of(m.dtype) == Some(enc) {
            m.data.clone()
        } else {
            Bytes::Owned(repack(m.dtype, &m.data[..stored_bytes], enc).into())
        };
        Ok(Weight {
            enc,
            rows: m.rows,
            cols: m.cols,
            data,
        })
    }

    /// The kernels' view of this matrix.
    pub fn mat(&self) -> MatRef<'_> {
        MatRef {
            enc: self.enc,
            rows: self.rows,
            cols: self.cols,
            row_bytes: self.enc.row_bytes(self.cols),
            data: &self.data,
        }
    }

    /// Bytes held (and streamed per full pass).
    pub fn bytes(&self) -> usize {
        self.enc.row_bytes(self.cols) * self.rows
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Q4_0's nibble order: byte i holds element i (low) and i + 16 (high).
fn nibbles(q: &[u8; 32]) -> [u8; 16] {
    std::array::from_fn(|i| (q[i] & 0x0F) | ((q[i + 16] & 0x0F) << 4))
}

/// `stored` (whole blocks of `dtype`) rewritten in `to` (its prepared encoding).
fn repack(dtype: DType, stored: &[u8], to: Encoding) -> Vec<u8> {
    let (sb, se) = (dtype.block_bytes(), dtype.block_elems());
    let out_len = stored.len() / sb * (se / 32) * to.block_bytes();
    let mut out = Vec::with_capacity(out_len);
    for src in stored.chunks_exact(sb) {
        match (dtype, to) {
            // f16 scales widened, the rest copied as is.
            (DType::Q4_0, Encoding::Q4_0F) | (DType::Q5_0, Encoding::Q5_0F) => {
                out.extend_from_slice(&f16_at(src, 0).to_le_bytes());
                out.extend_from_slice(&src[2..]);
            }
            (DType::Q4_1, Encoding::Q4_1F) | (DType::Q5_1, Encoding::Q5_1F) => {
                out.extend_from_slice(&f16_at(src, 0).to_le_bytes());
                out.extend_from_slice(&f16_at(src, 2).to_le_bytes());
                out.extend_from_slice(&src[4..]);
            }
            (DType::Q4K | DType::Q5K, _) => {
                let scales = kestrel_model::quant::k_sub_block_scales(src);
                let (qh, qs) = if dtype == DType::Q5K {
                    (Some(&src[16..48]), &src[48..176])
                } else {
                    (None, &src[16..144])
                };
                for (j, &(d, m)) in scales.iter().enumerate() {
                    // Sub-block j: low (even j) or high (odd j) nibbles of
                    // bytes 32 * (j / 2)..; Q5_K's fifth bit is bit j of qh[l].
                    let shift = 4 * (j % 2);
                    let q: [u8; 32] =
                        std::array::from_fn(|l| (qs[32 * (j / 2) + l] >> shift) & 0x0F);
                    out.extend_from_slice(&d.to_le_bytes());
                    out.extend_from_slice(&(-m).to_le_bytes());
                    if let Some(qh) = qh {
                        let h = (0..32).fold(0u32, |h, l| h | (u32::from((qh[l] >> j) & 1) << l));
                        out.extend_from_slice(&h.to_le_bytes());
                    }
                    out.extend_from_slice(&nibbles(&q));
                }
            }
            (DType::Q6K, Encoding::Q6KF) => {
                let (ql, qh, sc) = (&src[..128], &src[128..192], &src[192..208]);
                let d = f16_at(src, 208);
                // The 256 six-bit quants in element order (ggml's layout:
                // halves of 128, each from 64 low-nibble bytes and 32 bytes of
                // 2-bit pairs).
                let mut q = [0u8; 256];
                for n in 0..2 {
                    for l in 0..32 {
                        let (a, b, h) = (ql[64 * n + l], ql[64 * n + l + 32], qh[32 * n + l]);
                        let e = 128 * n + l;
                        q[e] = (a & 0x0F) | ((h & 3) << 4);
                        q[e + 32] = (b & 0x0F) | (((h >> 2) & 3) << 4);
                        q[e + 64] = (a >> 4) | (((h >> 4) & 3) << 4);
                        q[e + 96] = (b >> 4) | (((h >> 6) & 3) << 4);
                    }
                }
                for b in 0..8 {
                    let q: &[u8; 32] = q[32 * b..32 * b + 32].try_into().expect("32 quants");
                    for half in 0..2 {
                        let s = d * f32::from(sc[2 * b + half] as i8);
                        out.extend_from_slice(&s.to_le_bytes());
                    }
                    for bit in [4, 5] {
                        let plane =
                            (0..32).fold(0u32, |h, e| h | (u32::from((q[e] >> bit) & 1) << e));
                        out.extend_from_slice(&plane.to_le_bytes());
                    }
                    out.extend_from_slice(&nibbles(q));
                }
            }
            pair => unreachable!("no repacking {pair:?}"),
        }
    }
    debug_assert_eq!(out.len(), out_len);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{random_matrix, Rng};

    #[test]
    fn repacked_rows_decode_to_the_stored_values() {
        // Q8_0, F16 and the rest are kept as stored: nothing to compare.
        for dtype in [DType::Q4_0, DType::Q4_1] {
            let m = random_matrix(&mut Rng(3), dtype, 5, 96, 1.0);
            let w = Weight::prepare("w", &m).unwrap();
            let stored = MatRef::new("w", &m).unwrap();
            assert_eq!(w.mat().enc, stored.enc.prepared());
            assert_eq!(w.bytes(), w.data.len());
            let (mut a, mut b) = (vec![0f32; 96], vec![0f32; 96]);
            for r in 0..5 {
                super::super::matmul::dequant_row(&stored, r, &mut a);
                super::super::matmul::dequant_row(&w.mat(), r, &mut b);
                assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
            }
        }
    }

    #[test]
    fn repacked_only_dtypes_decode_to_ggml_reference_values() {
        // Exact ggml values (the f16 -> f32 widening and the f32 scale
        // products are exact copies of kestrel-model's dequantization).
        for dtype in [DType::Q5_0, DType::Q5_1, DType::Q4K, DType::Q5K, DType::Q6K] {
            let m = random_matrix(&mut Rng(5), dtype, 3, 512, 1.0);
            let w = Weight::prepare("w", &m).unwrap();
            assert_eq!(w.mat().enc, Encoding::prepared_of(dtype));
            assert_eq!(w.bytes(), w.data.len());
            assert!(
                MatRef::new("w", &m).is_err(),
                "{dtype} is read only repacked"
            );
            let (mut a, mut b) = (vec![0f32; 512], vec![0f32; 512]);
            for r in 0..3 {
                m.dequantize_row(r, &mut a);
                super::super::matmul::dequant_row(&w.mat(), r, &mut b);
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert_eq!(
                        x.to_bits(),
                        y.to_bits(),
                        "{dtype} row {r} element {i}: {x} vs {y}"
                    );
                }
            }
        }
    }

    #[test]
    fn misshapen_matrices_are_typed_errors() {
        let mut m = random_matrix(&mut Rng(1), DType::Q4K, 2, 256, 1.0);
        m.cols = 128;
        assert!(matches!(
            Weight::prepare("w", &m),
            Err(CpuError::Shape { .. })
        ));
        let mut m = random_matrix(&mut Rng(1), DType::Q6K, 2, 256, 1.0);
        m.rows = 3;
        assert!(matches!(
            Weight::prepare("w", &m),
            Err(CpuError::Shape { .. })
        ));
    }

    #[test]
    fn row_bytes_agree_with_gguf_for_stored_encodings() {
        for dtype in crate::SUPPORTED_DTYPES {
            let Some(e) = Encoding::of(dtype) else {
                continue;
            };
            assert_eq!(
                e.row_bytes(256),
                256 / dtype.block_elems() * dtype.block_bytes()
            );
            assert_eq!(Encoding::prepared_of(dtype), e.prepared());
        }
        assert_eq!(Encoding::of(DType::Q4K), None);
    }
}
