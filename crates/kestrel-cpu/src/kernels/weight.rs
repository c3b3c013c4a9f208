//! Weight encodings the kernels read, and the load-time repacking of the
//! 4-bit GGUF blocks into encodings that are cheaper to decode.
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

use kestrel_model::{Bytes, DType, Matrix};

use super::matmul::MatRef;
use crate::CpuError;

/// How the kernels read a weight row's bytes: a GGUF dtype as stored, or
/// one of the repackings [`Weight::prepare`] makes.
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
}

impl Encoding {
    /// The encoding of a stored GGUF/safetensors dtype, if the kernels read it.
    pub const fn of(dtype: DType) -> Option<Encoding> {
        Some(match dtype {
            DType::F32 => Encoding::F32,
            DType::F16 => Encoding::F16,
            DType::BF16 => Encoding::Bf16,
            DType::Q8_0 => Encoding::Q8_0,
            DType::Q4_0 => Encoding::Q4_0,
            DType::Q4_1 => Encoding::Q4_1,
            DType::Q4K | DType::Q6K => return None,
        })
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
            Encoding::Q4_1F => 24,
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

    /// The encoding [`Weight::prepare`] repacks `self` into (`self` when it
    /// is kept as stored). Q8_0 is kept: the LM head it usually holds is
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
    /// Validate `m` (see [`MatRef::new`]) and repack it into
    /// [`Encoding::prepared`]. Bytes that are kept as stored stay shared
    /// (a memory-mapped GGUF is not copied); repacked ones are owned.
    pub fn prepare(name: &str, m: &Matrix) -> Result<Weight, CpuError> {
        let stored = MatRef::new(name, m)?;
        let enc = stored.enc.prepared();
        let data = if enc == stored.enc {
            m.data.clone()
        } else {
            Bytes::Owned(repack(stored, enc).into())
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

/// `m`'s blocks rewritten in `to` (a 4-bit repacking of `m.enc`).
fn repack(m: MatRef<'_>, to: Encoding) -> Vec<u8> {
    let (from_b, to_b) = (m.enc.block_bytes(), to.block_bytes());
    // Scale fields: (count, bytes before the nibbles) in each encoding.
    let nscales = match (m.enc, to) {
        (Encoding::Q4_0, Encoding::Q4_0F) => 1,
        (Encoding::Q4_1, Encoding::Q4_1F) => 2,
        pair => unreachable!("no repacking {pair:?}"),
    };
    let nblocks = m.bytes() / from_b;
    let mut out = vec![0u8; nblocks * to_b];
    for (src, dst) in m.data[..m.bytes()]
        .chunks_exact(from_b)
        .zip(out.chunks_exact_mut(to_b))
    {
        for s in 0..nscales {
            let h = half::f16::from_le_bytes([src[2 * s], src[2 * s + 1]]);
            dst[4 * s..4 * s + 4].copy_from_slice(&h.to_f32().to_le_bytes());
        }
        dst[4 * nscales..].copy_from_slice(&src[2 * nscales..]);
    }
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
    fn row_bytes_agree_with_gguf_for_stored_encodings() {
        for dtype in crate::SUPPORTED_DTYPES {
            let e = Encoding::of(dtype).unwrap();
            assert_eq!(
                e.row_bytes(64),
                64 / dtype.block_elems() * dtype.block_bytes()
            );
        }
        assert_eq!(Encoding::of(DType::Q4K), None);
    }
}
