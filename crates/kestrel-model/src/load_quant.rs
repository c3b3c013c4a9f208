//! Quantizing at load (`--quantize q8_0`): [`LoadOptions`] and
//! [`quantize_loaded`], which re-encode a safetensors model's 16/32-bit
//! matrices (the text decoder's, and Moondream's vision encoder and
//! projector linears) as Q8_0 so the CPU runtime's int8 kernels serve them.
//! A text matrix whose column count is not a whole number of Q8_0 blocks
//! stays as stored; a vision linear's is padded with zero columns, which the
//! encoder's `linear` meets with zero activations. Cost: one pass over the
//! weights (one row decoded at a time), and the quantized copy replaces the
//! mapped original (about 53% of F16's bytes).

use crate::moondream::{Linear, VisionModel};
use crate::{DType, LoadedModel, Matrix, ModelError, ModelWeights};

/// How [`crate::load_with`] changes a model as it loads it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Re-encode the weights in this block type at load (only
    /// [`DType::Q8_0`] is offered; a GGUF model refuses it,
    /// [`ModelError::QuantizeStored`]); `None`: serve them as stored.
    pub quantize: Option<DType>,
}

/// What [`quantize_loaded`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuantizeReport {
    /// Matrices re-encoded.
    pub quantized: usize,
    /// Matrices already quantized in the file, left as they are.
    pub already_quantized: usize,
    /// Text matrices kept as stored because their column count is not a
    /// whole number of blocks, by name (`blk.3.ffn_down`).
    pub kept: Vec<String>,
    /// Vision linears whose columns were padded with zeros to whole blocks.
    pub padded: Vec<String>,
}

/// The block types `--quantize` offers.
pub const QUANTIZE_TYPES: &[DType] = &[DType::Q8_0];

/// Re-encodes `model`'s F32/F16/BF16 matrices as `dtype` (see the module
/// docs for which, and the exceptions). Errors only for a `dtype` not in
/// [`QUANTIZE_TYPES`].
pub fn quantize_loaded(
    model: &mut LoadedModel,
    dtype: DType,
) -> Result<QuantizeReport, ModelError> {
    if !QUANTIZE_TYPES.contains(&dtype) {
        return Err(ModelError::UnsupportedQuantize { dtype });
    }
    let mut report = QuantizeReport::default();
    text_weights(&mut model.weights, dtype, &mut report);
    if let Some(v) = &mut model.vision {
        vision(v, dtype, &mut report);
    }
    tracing::info!(
        dtype = dtype.name(),
        quantized = report.quantized,
        already_quantized = report.already_quantized,
        "weights quantized at load"
    );
    if !report.kept.is_empty() {
        tracing::warn!(
            kept = ?report.kept,
            "matrices whose column count is not a whole number of {} blocks stay as stored",
            dtype.name()
        );
    }
    if !report.padded.is_empty() {
        tracing::info!(padded = ?report.padded, "vision linears padded with zero columns to whole blocks");
    }
    Ok(report)
}

/// The text decoder's matrices; a tied LM head stays the embedding's twin
/// (quantized once, the bytes shared).
fn text_weights(w: &mut ModelWeights, dtype: DType, report: &mut QuantizeReport) {
    let tied = w.lm_head.data.as_ptr() == w.token_embd.data.as_ptr()
        && w.lm_head.rows == w.token_embd.rows
        && w.lm_head.cols == w.token_embd.cols;
    text(&mut w.token_embd, "token_embd", dtype, report);
    if tied {
        w.lm_head = w.token_embd.clone();
    } else {
        text(&mut w.lm_head, "output", dtype, report);
    }
    for (i, l) in w.layers.iter_mut().enumerate() {
        let mats = [
            (&mut l.wq, "attn_q"),
            (&mut l.wk, "attn_k"),
            (&mut l.wv, "attn_v"),
            (&mut l.wo, "attn_output"),
            (&mut l.w_up, "ffn_up"),
            (&mut l.w_down, "ffn_down"),
        ];
        for (m, name) in mats {
            text(m, &format!("blk.{i}.{name}"), dtype, report);
        }
        if let Some(m) = &mut l.w_gate {
            text(m, &format!("blk.{i}.ffn_gate"), dtype, report);
        }
    }
}

/// The vision encoder's and projector's linears; the region model (point,
/// detect) stays as stored.
fn vision(v: &mut VisionModel, dtype: DType, report: &mut QuantizeReport) {
    let w = &mut v.weights;
    padded(&mut w.patch_emb, "vision.patch_emb", dtype, report);
    for (i, b) in w.blocks.iter_mut().enumerate() {
        padded(&mut b.qkv, &format!("vision.blocks.{i}.qkv"), dtype, report);
        padded(
            &mut b.proj,
            &format!("vision.blocks.{i}.proj"),
            dtype,
            report,
        );
        padded(
            &mut b.mlp.fc1,
            &format!("vision.blocks.{i}.fc1"),
            dtype,
            report,
        );
        padded(
            &mut b.mlp.fc2,
            &format!("vision.blocks.{i}.fc2"),
            dtype,
            report,
        );
    }
    padded(&mut w.proj.fc1, "vision.proj.fc1", dtype, report);
    padded(&mut w.proj.fc2, "vision.proj.fc2", dtype, report);
}

fn text(m: &mut Matrix, name: &str, dtype: DType, report: &mut QuantizeReport) {
    if m.dtype.is_quantized() {
        report.already_quantized += 1;
    } else if !m.cols.is_multiple_of(dtype.block_elems()) {
        report.kept.push(name.to_owned());
    } else {
        *m = requantize(m, dtype, m.cols);
        report.quantized += 1;
    }
}

fn padded(l: &mut Linear, name: &str, dtype: DType, report: &mut QuantizeReport) {
    let m = &l.weight;
    if m.dtype.is_quantized() {
        report.already_quantized += 1;
        return;
    }
    let cols = m.cols.next_multiple_of(dtype.block_elems());
    if cols != m.cols {
        report.padded.push(name.to_owned());
    }
    l.weight = requantize(m, dtype, cols);
    report.quantized += 1;
}

/// `m` re-encoded as `dtype`, each row zero-padded to `cols` (>= `m.cols`,
/// a multiple of the block).
fn requantize(m: &Matrix, dtype: DType, cols: usize) -> Matrix {
    let mut row = vec![0f32; cols];
    let mut data = Vec::with_capacity(m.rows * cols / dtype.block_elems() * dtype.block_bytes());
    for r in 0..m.rows {
        m.dequantize_row(r, &mut row[..m.cols]);
        crate::quant::quantize(dtype, &row, &mut data);
    }
    Matrix {
        dtype,
        rows: m.rows,
        cols,
        data: data.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_matrix(rows: usize, cols: usize) -> Matrix {
        let v: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        Matrix::quantize(DType::F32, rows, cols, &v)
    }

    #[test]
    fn padding_appends_zero_columns_and_keeps_the_values() {
        let m = f32_matrix(3, 40);
        let q = requantize(&m, DType::Q8_0, 64);
        assert_eq!((q.dtype, q.rows, q.cols), (DType::Q8_0, 3, 64));
        let (a, b) = (m.to_f32(), q.to_f32());
        for r in 0..3 {
            for c in 0..64 {
                let want = if c < 40 { a[r * 40 + c] } else { 0.0 };
                assert!(
                    (b[r * 64 + c] - want).abs() <= 1.0 / 127.0 + 1e-3,
                    "{r},{c}"
                );
            }
        }
    }

    #[test]
    fn a_tied_head_stays_the_embeddings_twin() {
        let mut config = crate::ModelConfig::tiny();
        config.tie_word_embeddings = true;
        let mut w = crate::synthetic_weights(&config, DType::F16, 7);
        let mut report = QuantizeReport::default();
        text_weights(&mut w, DType::Q8_0, &mut report);
        assert_eq!(w.token_embd.dtype, DType::Q8_0);
        assert_eq!(w.lm_head.data.as_ptr(), w.token_embd.data.as_ptr());
        let per_layer = 6 + usize::from(w.layers[0].w_gate.is_some());
        assert_eq!(report.quantized, 1 + per_layer * w.layers.len());
        assert!(report.kept.is_empty());
    }

    #[test]
    fn text_keeps_a_matrix_that_does_not_tile_blocks() {
        let mut report = QuantizeReport::default();
        let mut m = f32_matrix(2, 40);
        text(&mut m, "x", DType::Q8_0, &mut report);
        assert_eq!(m.dtype, DType::F32);
        assert_eq!(report.kept, vec!["x".to_owned()]);
        let mut m = f32_matrix(2, 64);
        text(&mut m, "y", DType::Q8_0, &mut report);
        assert_eq!(m.dtype, DType::Q8_0);
        assert_eq!(report.quantized, 1);
    }
}
