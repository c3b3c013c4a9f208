//! Weight encodings the kernels read: every GGUF/safetensors type the
//! loader accepts, in its file layout. Nothing is repacked: a memory-mapped
//! GGUF's bytes are the kernels' bytes (resident weights = the file's tensor
//! bytes; `tests/resident_weights.rs`). Block scales stay f16 (the kernels
//! convert them with F16C); K-quant super-blocks (256 elements, 6- or 8-bit
//! sub-block scales) are read in place, each 32-element sub-block's scale
//! products (`d * sc`, `dmin * m`) formed in registers exactly as ggml
//! forms them, so every weight decodes to ggml's reference value bit for
//! bit (`kestrel_model::quant::dequantize`).
use kestrel_model::{Bytes, DType, Matrix};

use super::matmul::MatRef;
use crate::CpuError;

/// How the kernels read a weight row's bytes: a GGUF dtype as stored. The
/// kernels work in 32-element blocks; a K-quant super-block is eight of them
/// (its sub-blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Encoding {
    F32,
    F16,
    Bf16,
    /// f16 scale `d`, 32 x i8; weight `q * d`.
    Q8_0,
    /// f16 scale `d`, 16 bytes of nibbles (byte i: element i low, i + 16
    /// high); weight `(q - 8) * d`.
    Q4_0,
    /// f16 `d`, f16 `m`, 16 bytes of nibbles; weight `fma(q, d, m)`.
    Q4_1,
    /// f16 `d`, `u32 qh` (bit e = bit 4 of element e), 16 bytes of nibbles
    /// (22 bytes); weight `(q - 16) * d`.
    Q5_0,
    /// f16 `d`, f16 `m`, `u32 qh`, 16 bytes of nibbles (24 bytes); weight
    /// `q * d + m`, two roundings as in ggml.
    Q5_1,
    /// 256-element super-block (144 bytes): f16 `d`, f16 `dmin`, 12 bytes of
    /// 6-bit scales and minimums, 128 bytes of nibbles (sub-block j: the low
    /// (even j) or high (odd j) nibbles of bytes `32 * (j / 2)..`); weight
    /// `q * (d * sc) - dmin * m`, two roundings.
    Q4K,
    /// Q4_K plus `qh[32]` after the scales (bit j of `qh[l]`: bit 4 of
    /// element l of sub-block j) (176 bytes).
    Q5K,
    /// 256-element super-block (210 bytes): `ql[128]` low nibbles, `qh[64]`
    /// 2-bit pairs, `i8 sc[16]` (one per 16 elements), f16 `d`; weight
    /// `(q - 32) * (d * sc)`.
    Q6K,
}

impl Encoding {
    /// The encoding of a stored GGUF/safetensors dtype.
    pub const fn of(dtype: DType) -> Encoding {
        match dtype {
            DType::F32 => Encoding::F32,
            DType::F16 => Encoding::F16,
            DType::BF16 => Encoding::Bf16,
            DType::Q8_0 => Encoding::Q8_0,
            DType::Q4_0 => Encoding::Q4_0,
            DType::Q4_1 => Encoding::Q4_1,
            DType::Q5_0 => Encoding::Q5_0,
            DType::Q5_1 => Encoding::Q5_1,
            DType::Q4K => Encoding::Q4K,
            DType::Q5K => Encoding::Q5K,
            DType::Q6K => Encoding::Q6K,
        }
    }

    /// Whether rows are made of quantized blocks with their own scales
    /// (`cols` must then be a multiple of [`Encoding::block_elems`]).
    pub const fn is_quantized(self) -> bool {
        !matches!(self, Encoding::F32 | Encoding::F16 | Encoding::Bf16)
    }

    /// Whether the blocks are 256-element super-blocks of eight 32-element
    /// sub-blocks.
    pub const fn is_k_quant(self) -> bool {
        matches!(self, Encoding::Q4K | Encoding::Q5K | Encoding::Q6K)
    }

    /// Elements per stored block: 256 for the K-quants, else 32 (for a dense
    /// encoding, the kernels' 32-element unit).
    pub const fn block_elems(self) -> usize {
        if self.is_k_quant() {
            256
        } else {
            32
        }
    }

    /// Bytes per stored block ([`Encoding::block_elems`] elements).
    pub const fn block_bytes(self) -> usize {
        match self {
            Encoding::F32 => 128,
            Encoding::F16 | Encoding::Bf16 => 64,
            Encoding::Q8_0 => 34,
            Encoding::Q4_0 => 18,
            Encoding::Q4_1 => 20,
            Encoding::Q5_0 => 22,
            Encoding::Q5_1 => 24,
            Encoding::Q4K => 144,
            Encoding::Q5K => 176,
            Encoding::Q6K => 210,
        }
    }

    /// Bytes of one row of `cols` elements (whole blocks when quantized).
    pub const fn row_bytes(self, cols: usize) -> usize {
        match self {
            Encoding::F32 => 4 * cols,
            Encoding::F16 | Encoding::Bf16 => 2 * cols,
            q => cols / q.block_elems() * q.block_bytes(),
        }
    }

    /// Byte offset of 32-element block `blk` of a row: the block itself, or
    /// for a K-quant the super-block holding it (the sub-block is `blk % 8`).
    pub const fn block_offset(self, blk: usize) -> usize {
        blk / (self.block_elems() / 32) * self.block_bytes()
    }
}

/// A validated weight matrix as the kernels read it: its stored bytes,
/// shared (a memory-mapped GGUF is not copied).
#[derive(Debug, Clone)]
pub struct Weight {
    enc: Encoding,
    rows: usize,
    cols: usize,
    data: Bytes,
}

impl Weight {
    /// Validate `m` (whole blocks, enough bytes) and share its bytes.
    pub fn prepare(name: &str, m: &Matrix) -> Result<Weight, CpuError> {
        let enc = Encoding::of(m.dtype);
        let be = if enc.is_quantized() {
            enc.block_elems()
        } else {
            1
        };
        if !m.cols.is_multiple_of(be) {
            return Err(CpuError::Shape {
                name: name.to_owned(),
                expected: format!("cols a multiple of {be} for {}", m.dtype),
                got: m.cols.to_string(),
            });
        }
        let stored_bytes = m.rows * enc.row_bytes(m.cols);
        if m.data.len() < stored_bytes {
            return Err(CpuError::Shape {
                name: name.to_owned(),
                expected: format!("{stored_bytes} bytes for {}x{} {}", m.rows, m.cols, m.dtype),
                got: format!("{} bytes", m.data.len()),
            });
        }
        Ok(Weight {
            enc,
            rows: m.rows,
            cols: m.cols,
            data: m.data.clone(),
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

    /// Bytes held (and streamed per full pass): the file's bytes.
    pub fn bytes(&self) -> usize {
        self.enc.row_bytes(self.cols) * self.rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{random_matrix, Rng};

    #[test]
    fn every_type_decodes_to_ggml_reference_values_in_place() {
        // The kernels' canonical values, read from the stored blocks, are
        // ggml's (kestrel-model's dequantization) bit for bit; Q4_1 differs
        // by design (one fused rounding, see `scalar::dequant_block`).
        for dtype in crate::SUPPORTED_DTYPES {
            if dtype == DType::Q4_1 {
                continue;
            }
            let m = random_matrix(&mut Rng(5), dtype, 3, 512, 1.0);
            let w = Weight::prepare("w", &m).unwrap();
            assert_eq!(w.mat().enc, Encoding::of(dtype));
            assert_eq!(
                w.bytes(),
                m.rows * m.row_bytes(),
                "{dtype}: the file's bytes"
            );
            assert_eq!(
                w.mat().data.as_ptr(),
                m.data.as_ptr(),
                "{dtype}: bytes shared, not copied"
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
    fn row_bytes_agree_with_gguf() {
        for dtype in crate::SUPPORTED_DTYPES {
            let e = Encoding::of(dtype);
            assert_eq!(
                e.row_bytes(512),
                512 / dtype.block_elems() * dtype.block_bytes(),
                "{dtype}"
            );
        }
        assert_eq!(Encoding::Q4K.block_offset(7), 0);
        assert_eq!(Encoding::Q6K.block_offset(8), 210);
        assert_eq!(Encoding::Q8_0.block_offset(3), 102);
    }
}
