//! Weights on the device in their GGUF encoding, and host references of the
//! kernels that read them (`kernels/quant.cu`, `add_rms_norm_q8`,
//! `swiglu_q8`).
//!
//! Upload plan: every matrix keeps its file's blocks (F32 matrices, rare in
//! GGUF files, become f16); a projection made of several matrices (Q|K|V,
//! gate|up) is stacked by rows where neighbours share a dtype, else kept as
//! parts that write their own output columns. [`weight_plan`] counts the
//! device bytes against the file's tensor bytes. The kernels' host
//! references are in [`crate::reference`].

use half::f16;
use kestrel_model::{DType, LayerWeights, Matrix, ModelConfig, ModelWeights};

use crate::kernels::MMVQ_MAX_ROWS;

/// Elements per activation block.
pub const BLOCK: usize = 32;

/// Activation rows up to which a quantized matmul runs `mmvq_*` (int8 dot
/// products; one launch per `MMVQ_MAX_ROWS` rows, each reading the
/// quantized weight once); above it the weight is dequantized tile by tile
/// to f16 and multiplied by cuBLAS. NOT measured: chosen by bytes moved
/// per weight parameter at 64 rows, 4 launches reading a 4.5-bit (Q4_K)
/// weight = 18 bits, against the tile path's 4.5-bit read + f16 write +
/// f16 read = 36.5 bits; larger batches go to tensor cores. The crossover
/// must be taken on a GPU.
pub const MMVQ_CROSSOVER_ROWS: usize = 4 * MMVQ_MAX_ROWS;

/// Elements of the f16 tile a non-f16 weight is dequantized into for the
/// cuBLAS path (32 MiB): whole rows, `TILE_ELEMS / cols` of them.
pub const TILE_ELEMS: usize = 16 << 20;

/// One int8-quantized 32-element activation block (40 bytes): element `i`
/// is `q[i] * d`, and `s = d * sum(q)`. The host references compute these;
/// on the device a row of them is laid out as `common.cuh` says (quants in
/// `mmvq`'s load order, then the scales, then the sums: [`pack_q8_rows`]),
/// in the same 40 bytes a block.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Q8Block {
    pub d: f32,
    pub s: f32,
    pub q: [i8; BLOCK],
}

/// Bytes of one activation block on the device, as of one [`Q8Block`]:
/// an activation row of `nb` blocks takes `nb * Q8_BLOCK_BYTES`.
pub const Q8_BLOCK_BYTES: usize = std::mem::size_of::<Q8Block>();

/// `q8_pos` of `common.cuh`: the byte, in the quants of an activation row
/// of `nb` blocks, of element `e` of block `b`. Blocks go in pairs
/// `(2p, 2p + 1)` of 64 bytes, in which `mmvq`'s thread `k` of a block
/// finds its 16 bytes at `16 k` (block `2p`'s elements `4k..4k+4` and
/// `16+4k..20+4k`, then block `2p + 1`'s); a last unpaired block keeps
/// thread `k`'s 8 bytes at `8 k` of its 32.
pub fn q8_pos(nb: usize, b: usize, e: usize) -> usize {
    let (k, within) = ((e & 15) >> 2, ((e >> 4) << 2) | (e & 3));
    let paired = (b | 1) < nb;
    (b >> 1) * 64 + if paired { 16 * k + 8 * (b & 1) } else { 8 * k } + within
}

/// Activation rows of `nb` blocks each (`blocks.len()` a multiple of `nb`)
/// in the device's layout (`common.cuh`), written into `out` (as many
/// bytes as the blocks take): each row's quants in `mmvq`'s load order
/// ([`q8_pos`]), then its blocks' scales `d`, then their sums `s`
/// (little-endian f32).
pub fn pack_q8_rows(blocks: &[Q8Block], nb: usize, out: &mut [u8]) {
    assert_eq!(blocks.len() % nb, 0, "whole rows of {nb} blocks");
    assert_eq!(
        out.len(),
        blocks.len() * Q8_BLOCK_BYTES,
        "bytes of the blocks"
    );
    for (row, o) in blocks
        .chunks_exact(nb)
        .zip(out.chunks_exact_mut(nb * Q8_BLOCK_BYTES))
    {
        let (q, scales) = o.split_at_mut(nb * BLOCK);
        let (d, s) = scales.split_at_mut(nb * 4);
        for (b, blk) in row.iter().enumerate() {
            for (e, &v) in blk.q.iter().enumerate() {
                q[q8_pos(nb, b, e)] = v as u8;
            }
            d[4 * b..4 * b + 4].copy_from_slice(&blk.d.to_le_bytes());
            s[4 * b..4 * b + 4].copy_from_slice(&blk.s.to_le_bytes());
        }
    }
}

/// The blocks of activation rows of `nb` blocks in the device's layout
/// (inverse of [`pack_q8_rows`]).
pub fn unpack_q8_rows(bytes: &[u8], nb: usize) -> Vec<Q8Block> {
    let row_bytes = nb * Q8_BLOCK_BYTES;
    assert_eq!(bytes.len() % row_bytes, 0, "whole rows of {nb} blocks");
    let f32_at = |b: &[u8], at: usize| f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    bytes
        .chunks_exact(row_bytes)
        .flat_map(|o| {
            let (q, scales) = o.split_at(nb * BLOCK);
            (0..nb).map(move |b| Q8Block {
                d: f32_at(scales, 4 * b),
                s: f32_at(scales, 4 * (nb + b)),
                q: std::array::from_fn(|e| q[q8_pos(nb, b, e)] as i8),
            })
        })
        .collect()
}

/// How one matrix product runs on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulPath {
    /// `mmvq_*` on int8-quantized activations.
    Mmvq,
    /// cuBLAS on the stored f16 weight.
    GemmF16,
    /// `dequant_f16` tiles, each multiplied by cuBLAS.
    DequantTiles,
}

/// The path for `n` activation rows times a weight of (device) `dtype`.
pub fn matmul_path(dtype: DType, n: usize) -> MatmulPath {
    match dtype {
        DType::F16 => MatmulPath::GemmF16,
        d if d.is_quantized() && n <= MMVQ_CROSSOVER_ROWS => MatmulPath::Mmvq,
        _ => MatmulPath::DequantTiles,
    }
}

/// The `mmvq_<type>_r<NR>` entry point of a quantized dtype for `n`
/// activation rows: the smallest NR of 1, 2, 4, 8, 16 holding them (each
/// keeps NR accumulators; the arithmetic per row is the same in all), None
/// past `MMVQ_MAX_ROWS` or for an unquantized dtype.
pub fn mmvq_kernel(dtype: DType, n: usize) -> Option<&'static str> {
    let per_rows = match dtype {
        DType::Q4_0 => [
            "mmvq_q4_0_r1",
            "mmvq_q4_0_r2",
            "mmvq_q4_0_r4",
            "mmvq_q4_0_r8",
            "mmvq_q4_0_r16",
        ],
        DType::Q4_1 => [
            "mmvq_q4_1_r1",
            "mmvq_q4_1_r2",
            "mmvq_q4_1_r4",
            "mmvq_q4_1_r8",
            "mmvq_q4_1_r16",
        ],
        DType::Q5_0 => [
            "mmvq_q5_0_r1",
            "mmvq_q5_0_r2",
            "mmvq_q5_0_r4",
            "mmvq_q5_0_r8",
            "mmvq_q5_0_r16",
        ],
        DType::Q5_1 => [
            "mmvq_q5_1_r1",
            "mmvq_q5_1_r2",
            "mmvq_q5_1_r4",
            "mmvq_q5_1_r8",
            "mmvq_q5_1_r16",
        ],
        DType::Q8_0 => [
            "mmvq_q8_0_r1",
            "mmvq_q8_0_r2",
            "mmvq_q8_0_r4",
            "mmvq_q8_0_r8",
            "mmvq_q8_0_r16",
        ],
        DType::Q4K => [
            "mmvq_q4_k_r1",
            "mmvq_q4_k_r2",
            "mmvq_q4_k_r4",
            "mmvq_q4_k_r8",
            "mmvq_q4_k_r16",
        ],
        DType::Q5K => [
            "mmvq_q5_k_r1",
            "mmvq_q5_k_r2",
            "mmvq_q5_k_r4",
            "mmvq_q5_k_r8",
            "mmvq_q5_k_r16",
        ],
        DType::Q6K => [
            "mmvq_q6_k_r1",
            "mmvq_q6_k_r2",
            "mmvq_q6_k_r4",
            "mmvq_q6_k_r8",
            "mmvq_q6_k_r16",
        ],
        DType::F32 | DType::F16 | DType::BF16 => return None,
    };
    // The entry point with the fewest accumulators that hold n rows.
    let at = match n {
        0 | 1 => 0,
        2 => 1,
        3 | 4 => 2,
        5..=8 => 3,
        9..=MMVQ_MAX_ROWS => 4,
        _ => return None,
    };
    Some(per_rows[at])
}

/// The type code the kernels take (ggml's type id).
pub fn type_code(dtype: DType) -> i32 {
    kestrel_model::gguf::ggml_type_of(dtype) as i32
}

/// The dtype a matrix stored as `dtype` has on the device.
pub fn device_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F32 => DType::F16,
        d => d,
    }
}

/// Bytes of `rows x cols` stored as `dtype` (whole blocks).
pub fn encoded_bytes(dtype: DType, rows: usize, cols: usize) -> usize {
    rows * (cols / dtype.block_elems()) * dtype.block_bytes()
}

/// One device matrix of a projection: `rows` consecutive output columns
/// starting at `out_offset`, made of `mats` (stacked by rows, one dtype).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartPlan {
    /// The dtype on the device.
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub out_offset: usize,
    /// Indices of the stacked matrices in the projection's list.
    pub mats: Vec<usize>,
}

impl PartPlan {
    pub fn bytes(&self) -> usize {
        encoded_bytes(self.dtype, self.rows, self.cols)
    }
}

/// Why a weight cannot be held on the device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("{what}: {cols} columns do not tile {dtype}'s {block}-element blocks")]
    Cols {
        what: String,
        dtype: DType,
        cols: usize,
        block: usize,
    },
    #[error("{what}: {got} bytes, {expected} expected")]
    Bytes {
        what: String,
        got: usize,
        expected: usize,
    },
    #[error("{what}: matrices with {a} and {b} columns cannot share one input")]
    Mismatch { what: String, a: usize, b: usize },
}

/// Plan the device matrices of one projection (`mats` share their input).
pub fn plan_parts(what: &str, mats: &[&Matrix]) -> Result<Vec<PartPlan>, PlanError> {
    let mut parts: Vec<PartPlan> = Vec::new();
    let mut offset = 0;
    for (i, m) in mats.iter().enumerate() {
        // Quantized blocks hold 32 or 256 elements: whole activation blocks.
        let block = m.dtype.block_elems();
        if !m.cols.is_multiple_of(block) {
            return Err(PlanError::Cols {
                what: what.to_owned(),
                dtype: m.dtype,
                cols: m.cols,
                block,
            });
        }
        let expected = encoded_bytes(m.dtype, m.rows, m.cols);
        if m.data.len() < expected {
            return Err(PlanError::Bytes {
                what: what.to_owned(),
                got: m.data.len(),
                expected,
            });
        }
        if m.cols != mats[0].cols {
            return Err(PlanError::Mismatch {
                what: what.to_owned(),
                a: mats[0].cols,
                b: m.cols,
            });
        }
        let dtype = device_dtype(m.dtype);
        match parts.last_mut() {
            Some(p) if p.dtype == dtype => {
                p.rows += m.rows;
                p.mats.push(i);
            }
            _ => parts.push(PartPlan {
                dtype,
                rows: m.rows,
                cols: m.cols,
                out_offset: offset,
                mats: vec![i],
            }),
        }
        offset += m.rows;
    }
    Ok(parts)
}

/// The device bytes of `part`: its matrices' blocks as stored, one after
/// the other (F32 rounded to f16).
pub fn part_bytes(part: &PartPlan, mats: &[&Matrix]) -> Vec<u8> {
    let mut out = Vec::with_capacity(part.bytes());
    for &i in &part.mats {
        let m = mats[i];
        if m.dtype == DType::F32 {
            let mut row = vec![0f32; m.cols];
            for r in 0..m.rows {
                m.dequantize_row(r, &mut row);
                out.extend(row.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()));
            }
        } else {
            out.extend_from_slice(&m.data[..encoded_bytes(m.dtype, m.rows, m.cols)]);
        }
    }
    out
}

/// A layer's four projections, in forward order: Q|K|V, O, gate|up, down.
pub fn layer_projections(l: &LayerWeights) -> [Vec<&Matrix>; 4] {
    [
        vec![&l.wq, &l.wk, &l.wv],
        vec![&l.wo],
        l.w_gate.iter().chain([&l.w_up]).collect(),
        vec![&l.w_down],
    ]
}

/// The device's weight bytes against the file's tensor bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightPlan {
    pub device_bytes: usize,
    pub file_bytes: usize,
}

/// Count what `DeviceModel::new` uploads for `w`: matrices by
/// [`plan_parts`], the embedding table as stored (once when tied to the LM
/// head), norms and biases as f32.
pub fn weight_plan(w: &ModelWeights) -> Result<WeightPlan, PlanError> {
    let c: &ModelConfig = &w.config;
    let mut p = WeightPlan {
        device_bytes: 0,
        file_bytes: 0,
    };
    let mut add = |what: &str, mats: &[&Matrix]| -> Result<(), PlanError> {
        for part in plan_parts(what, mats)? {
            p.device_bytes += part.bytes();
        }
        p.file_bytes += mats
            .iter()
            .map(|m| encoded_bytes(m.dtype, m.rows, m.cols))
            .sum::<usize>();
        Ok(())
    };
    add("token_embd", &[&w.token_embd])?;
    if !c.tie_word_embeddings {
        add("lm_head", &[&w.lm_head])?;
    }
    for (i, l) in w.layers.iter().enumerate() {
        for mats in layer_projections(l) {
            add(&format!("layer {i}"), &mats)?;
        }
    }
    let vectors: usize = w.output_norm.len()
        + w.layers
            .iter()
            .map(|l| {
                l.attn_norm.len()
                    + l.ffn_norm.len()
                    + [&l.bq, &l.bk, &l.bv]
                        .iter()
                        .map(|b| b.as_ref().map_or(0, Vec::len))
                        .sum::<usize>()
            })
            .sum::<usize>();
    p.device_bytes += 4 * vectors;
    p.file_bytes += 4 * vectors;
    Ok(p)
}

#[cfg(test)]
mod tests;
