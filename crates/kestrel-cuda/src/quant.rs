//! Weights on the device in their GGUF encoding, and host references of the
//! kernels that read them (`kernels/quant.cu`, `add_rms_norm_q8`,
//! `swiglu_q8`).
//!
//! Upload plan: every matrix keeps its file's blocks (F32 matrices, rare in
//! GGUF files, become f16); a projection made of several matrices (Q|K|V,
//! gate|up) is stacked by rows where neighbours share a dtype, else kept as
//! parts that write their own output columns. [`weight_plan`] counts the
//! device bytes against the file's tensor bytes. Each reference below does
//! its kernel's arithmetic in the kernel's order (warp lanes and butterfly
//! sums included), with plain slice signatures, so a host stand-in for the
//! device can call them; the tests hold them against kestrel-cpu's kernels.

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

/// One int8-quantized 32-element activation block, `Q8` in `common.cuh`
/// (40 bytes): element `i` is `q[i] * d`, and `s = d * sum(q)`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Q8Block {
    pub d: f32,
    pub s: f32,
    pub q: [i8; BLOCK],
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

/// The `mmvq_*` entry point of a quantized dtype.
pub fn mmvq_kernel(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::Q4_0 => "mmvq_q4_0",
        DType::Q4_1 => "mmvq_q4_1",
        DType::Q5_0 => "mmvq_q5_0",
        DType::Q5_1 => "mmvq_q5_1",
        DType::Q8_0 => "mmvq_q8_0",
        DType::Q4K => "mmvq_q4_k",
        DType::Q5K => "mmvq_q5_k",
        DType::Q6K => "mmvq_q6_k",
        DType::F32 | DType::F16 | DType::BF16 => return None,
    })
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
        vec![&l.w_gate, &l.w_up],
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

/// A warp's butterfly sum (`warp_sum` in `common.cuh`): every lane ends with
/// the same value, lane 0's is returned.
pub fn warp_sum(mut v: [f32; 32]) -> f32 {
    for o in [16, 8, 4, 2, 1] {
        let prev = v;
        for (i, x) in v.iter_mut().enumerate() {
            *x = prev[i] + prev[i ^ o];
        }
    }
    v[0]
}

/// `block_sum` of `common.cuh` over one value per thread.
pub fn block_sum(per_thread: &[f32]) -> f32 {
    let warps: Vec<f32> = per_thread
        .chunks(32)
        .map(|w| warp_sum(std::array::from_fn(|i| w.get(i).copied().unwrap_or(0.0))))
        .collect();
    warp_sum(std::array::from_fn(|i| {
        warps.get(i).copied().unwrap_or(0.0)
    }))
}

/// `warp_quantize` of `common.cuh`, for each 32-element block of `x`.
pub fn quantize_q8(x: &[f32], out: &mut [Q8Block]) {
    assert_eq!(x.len(), BLOCK * out.len(), "x must be whole blocks of out");
    for (xb, o) in x.chunks_exact(BLOCK).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        let mut sum = 0i32;
        for (q, &v) in o.q.iter_mut().zip(xb) {
            let qi = (v * id).round_ties_even() as i32;
            sum += qi;
            *q = qi as i8;
        }
        o.d = d;
        o.s = d * sum as f32;
    }
}

/// `quantize_q8_h` of `quant.cu`: f16 rows (the attention output, the final
/// norm's rows) to int8 blocks.
pub fn quantize_q8_h(x: &[f16], out: &mut [Q8Block]) {
    let v: Vec<f32> = x.iter().map(|h| h.to_f32()).collect();
    quantize_q8(&v, out);
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// ggml `get_scale_min_k4`.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// A 32-element block's integer weights, the scales of its elements 0..16
/// and 16..32 (equal but for Q6_K) and its minimum (`load_block`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WeightBlock {
    pub w: [i32; BLOCK],
    pub d: [f32; 2],
    pub m: f32,
}

/// `load_block<T>` of `quant.cu`: block `b` (of 32 elements) of an encoded
/// row of a quantized `dtype`.
pub fn load_block(dtype: DType, row: &[u8], b: usize) -> WeightBlock {
    let bb = dtype.block_bytes();
    let nib = |qs: &[u8], i: usize| if i < 16 { qs[i] & 15 } else { qs[i - 16] >> 4 };
    let one = |d: f32| [d, d];
    match dtype {
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => {
            let blk = &row[b * bb..(b + 1) * bb];
            let (qs_at, qh, off) = match dtype {
                DType::Q4_0 => (2, 0, 8),
                DType::Q4_1 => (4, 0, 0),
                DType::Q5_0 => (6, u32_at(blk, 2), 16),
                _ => (8, u32_at(blk, 4), 0),
            };
            let m = if matches!(dtype, DType::Q4_1 | DType::Q5_1) {
                f16_at(blk, 2)
            } else {
                0.0
            };
            WeightBlock {
                w: std::array::from_fn(|i| {
                    (i32::from(nib(&blk[qs_at..], i)) | (((qh >> i) & 1) << 4) as i32) - off
                }),
                d: one(f16_at(blk, 0)),
                m,
            }
        }
        DType::Q8_0 => {
            let blk = &row[b * bb..(b + 1) * bb];
            WeightBlock {
                w: std::array::from_fn(|i| i32::from(blk[2 + i] as i8)),
                d: one(f16_at(blk, 0)),
                m: 0.0,
            }
        }
        DType::Q4K | DType::Q5K => {
            let sb = &row[(b / 8) * bb..(b / 8 + 1) * bb];
            let j = b % 8;
            let (sc, mn) = scale_min_k4(j, &sb[4..16]);
            let qs = &sb[if dtype == DType::Q4K { 16 } else { 48 } + 32 * (j / 2)..];
            WeightBlock {
                w: std::array::from_fn(|l| {
                    let q = i32::from((qs[l] >> (4 * (j % 2))) & 15);
                    let h = if dtype == DType::Q5K {
                        i32::from((sb[16 + l] >> j) & 1) << 4
                    } else {
                        0
                    };
                    q | h
                }),
                d: one(f16_at(sb, 0) * f32::from(sc)),
                m: -(f16_at(sb, 2) * f32::from(mn)),
            }
        }
        DType::Q6K => {
            let sb = &row[(b / 8) * bb..(b / 8 + 1) * bb];
            let (n, tt) = ((b % 8) / 4, b % 4);
            let ql = &sb[64 * n + 32 * (tt & 1)..];
            let qh = &sb[128 + 32 * n..];
            let d = f16_at(sb, 208);
            let sc = |k: usize| d * f32::from(sb[192 + 8 * n + 2 * tt + k] as i8);
            WeightBlock {
                w: std::array::from_fn(|l| {
                    let q = (ql[l] >> (4 * (tt >> 1))) & 15;
                    let h = ((qh[l] >> (2 * tt)) & 3) << 4;
                    i32::from(q | h) - 32
                }),
                d: [sc(0), sc(1)],
                m: 0.0,
            }
        }
        DType::F32 | DType::F16 | DType::BF16 => {
            unreachable!("{dtype} has no integer blocks")
        }
    }
}

/// `mmvq_*` of `quant.cu`: `y[r * rows + o] = W[o] . x[r]` for `n` rows of
/// quantized activations `xq` (`cols / 32` blocks each), `w` the stored
/// rows of a quantized `dtype`. Lane `L` of the warp of row `o` takes blocks
/// `L, L + 32, ...`; see the kernel for the float steps.
pub fn mmvq(dtype: DType, w: &[u8], rows: usize, cols: usize, xq: &[Q8Block], y: &mut [f32]) {
    let nb = cols / BLOCK;
    let n = xq.len() / nb;
    assert_eq!(
        xq.len(),
        n * nb,
        "xq must be whole rows of cols / 32 blocks"
    );
    assert_eq!(y.len(), n * rows, "y must be n x rows");
    let rb = encoded_bytes(dtype, 1, cols);
    let has_min = matches!(dtype, DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K);
    let two = dtype == DType::Q6K;
    for o in 0..rows {
        let row = &w[o * rb..(o + 1) * rb];
        for r in 0..n {
            let lanes: [f32; 32] = std::array::from_fn(|lane| {
                let (mut acc, mut mins) = (0f32, 0f32);
                for b in (lane..nb).step_by(32) {
                    let wb = load_block(dtype, row, b);
                    let xb = &xq[r * nb + b];
                    let isum = |range: std::ops::Range<usize>| -> f32 {
                        range.map(|i| wb.w[i] * i32::from(xb.q[i])).sum::<i32>() as f32
                    };
                    if two {
                        acc = isum(0..16).mul_add(wb.d[0] * xb.d, acc);
                        acc = isum(16..32).mul_add(wb.d[1] * xb.d, acc);
                    } else {
                        acc = isum(0..32).mul_add(wb.d[0] * xb.d, acc);
                    }
                    if has_min {
                        mins = wb.m.mul_add(xb.s, mins);
                    }
                }
                acc + mins
            });
            y[r * rows + o] = warp_sum(lanes);
        }
    }
}

/// `dequant_elem` of `quant.cu`: element `e` of an encoded row, exactly as
/// ggml decodes it.
pub fn dequant_elem(dtype: DType, row: &[u8], e: usize) -> f32 {
    match dtype {
        DType::F32 => f32::from_bits(u32_at(row, 4 * e)),
        DType::F16 => f16_at(row, 2 * e),
        DType::BF16 => {
            f32::from_bits(u32::from(u16::from_le_bytes([row[2 * e], row[2 * e + 1]])) << 16)
        }
        DType::Q8_0 => {
            let b = &row[(e / 32) * 34..];
            f16_at(b, 0) * f32::from(b[2 + e % 32] as i8)
        }
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => {
            let b = &row[(e / 32) * dtype.block_bytes()..];
            let l = e % 32;
            let qs_at = match dtype {
                DType::Q4_0 => 2,
                DType::Q4_1 => 4,
                DType::Q5_0 => 6,
                _ => 8,
            };
            let byte = b[qs_at + l % 16];
            let mut q = i32::from(if l < 16 { byte & 15 } else { byte >> 4 });
            let d = f16_at(b, 0);
            match dtype {
                DType::Q4_0 => d * (q as f32 - 8.0),
                DType::Q4_1 => d * q as f32 + f16_at(b, 2),
                _ => {
                    let qh = u32_at(b, if dtype == DType::Q5_0 { 2 } else { 4 });
                    q |= (((qh >> l) & 1) << 4) as i32;
                    if dtype == DType::Q5_0 {
                        d * (q - 16) as f32
                    } else {
                        d * q as f32 + f16_at(b, 2)
                    }
                }
            }
        }
        DType::Q4K | DType::Q5K => {
            let sb = &row[(e / 256) * dtype.block_bytes()..];
            let (j, l) = ((e / 32) % 8, e % 32);
            let (sc, mn) = scale_min_k4(j, &sb[4..16]);
            let d1 = f16_at(sb, 0) * f32::from(sc);
            let m1 = f16_at(sb, 2) * f32::from(mn);
            let at = if dtype == DType::Q4K { 16 } else { 48 } + 32 * (j / 2) + l;
            let mut q = (sb[at] >> (4 * (j % 2))) & 15;
            if dtype == DType::Q5K {
                q |= ((sb[16 + l] >> j) & 1) << 4;
            }
            d1 * f32::from(q) - m1
        }
        DType::Q6K => {
            let sb = &row[(e / 256) * 210..];
            let w = e % 256;
            let (n, tt, l) = (w / 128, (w / 32) % 4, w % 32);
            let mut q = (sb[64 * n + 32 * (tt & 1) + l] >> (4 * (tt >> 1))) & 15;
            q |= ((sb[128 + 32 * n + l] >> (2 * tt)) & 3) << 4;
            let s = f16_at(sb, 208) * f32::from(sb[192 + 8 * n + 2 * tt + l / 16] as i8);
            s * (i32::from(q) - 32) as f32
        }
    }
}

/// `dequant_f16` of `quant.cu` for rows `row0..row0 + out.len() / cols`.
pub fn dequant_f16(dtype: DType, w: &[u8], row0: usize, cols: usize, out: &mut [f16]) {
    let rb = encoded_bytes(dtype, 1, cols);
    for (r, o) in out.chunks_exact_mut(cols).enumerate() {
        let row = &w[(row0 + r) * rb..(row0 + r + 1) * rb];
        for (c, v) in o.iter_mut().enumerate() {
            *v = f16::from_f32(dequant_elem(dtype, row, c));
        }
    }
}

/// `kexp` of `common.cuh` (kestrel-cpu's `ops::exp`, step by step).
pub fn kexp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.3, 88.7);
    let n = (xc * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, xc));
    let mut p = 1.987_569_1e-4f32;
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5, // Cephes' 5.0000001e-1, as f32
    ] {
        p = p.mul_add(r, c);
    }
    let y = (p * r).mul_add(r, r) + 1.0;
    let scale = f32::from_bits((((n as i32) + 127) as u32) << 23);
    if x < -87.3 {
        0.0
    } else {
        y * scale
    }
}

/// Threads per block the runtime launches the norm kernels with.
pub const NORM_THREADS: usize = 256;

/// `add_and_inv_rms` of `rmsnorm.cu` for one row: `x += delta` and
/// `1 / sqrt(mean(x^2) + eps)` summed as `NORM_THREADS` threads do.
pub fn add_and_inv_rms(x: &mut [f32], delta: Option<&[f32]>, eps: f32) -> f32 {
    if let Some(d) = delta {
        for (a, b) in x.iter_mut().zip(d) {
            *a += b;
        }
    }
    let partials: Vec<f32> = (0..NORM_THREADS)
        .map(|t| {
            x.iter()
                .skip(t)
                .step_by(NORM_THREADS)
                .fold(0f32, |s, v| v.mul_add(*v, s))
        })
        .collect();
    let ss = block_sum(&partials);
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// `add_rms_norm_q8` of `rmsnorm.cu` for one row (`out_row` aside): updates
/// `x` and writes its normalized values' blocks to `out`.
pub fn add_rms_norm_q8(
    x: &mut [f32],
    delta: Option<&[f32]>,
    w: &[f32],
    eps: f32,
    out: &mut [Q8Block],
) {
    let inv = add_and_inv_rms(x, delta, eps);
    let v: Vec<f32> = x.iter().zip(w).map(|(a, b)| a * inv * b).collect();
    quantize_q8(&v, out);
}

/// `swiglu_q8` of `swiglu.cu` for one row: `gate_up` holds `2 f` values
/// (gate then up); `out` receives `f / 32` blocks.
pub fn swiglu_q8(gate_up: &[f32], out: &mut [Q8Block]) {
    let f = gate_up.len() / 2;
    let (g, u) = gate_up.split_at(f);
    let v: Vec<f32> = g
        .iter()
        .zip(u)
        .map(|(&g, &u)| g / (1.0 + kexp(-g)) * u)
        .collect();
    quantize_q8(&v, out);
}

#[cfg(test)]
mod tests;
