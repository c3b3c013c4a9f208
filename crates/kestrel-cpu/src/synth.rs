//! Synthetic weights for tests and benchmarks: a small deterministic RNG,
//! ggml-style quantizers from f32, and random [`ModelWeights`] of any shape.
//! Not used by the forward pass; costs nothing unless called.

use std::sync::Arc;

use half::{bf16, f16};
use kestrel_model::{Bytes, DType, LayerWeights, Matrix, ModelConfig, ModelWeights, RopeStyle};

/// The project's one splitmix64 (kestrel-model's synthetic weights use it too).
pub use kestrel_model::synthetic::Rng;

fn push_f16(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// Encode a row-major `rows x cols` f32 matrix as `dtype` (quantized dtypes
/// need `cols % 32 == 0`).
pub fn encode(dtype: DType, rows: usize, cols: usize, data: &[f32]) -> Matrix {
    assert_eq!(data.len(), rows * cols);
    let mut out = Vec::with_capacity(rows * cols / dtype.block_elems() * dtype.block_bytes());
    match dtype {
        DType::F32 => data
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::F16 => data.iter().for_each(|&v| push_f16(&mut out, v)),
        DType::BF16 => data
            .iter()
            .for_each(|&v| out.extend_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes())),
        DType::Q8_0 => {
            for b in data.chunks_exact(32) {
                let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                push_f16(&mut out, d);
                out.extend(b.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        DType::Q4_0 => {
            for b in data.chunks_exact(32) {
                let max = b
                    .iter()
                    .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = max / -8.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                push_f16(&mut out, d);
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|i| q(b[i]) | (q(b[i + 16]) << 4)));
            }
        }
        DType::Q4_1 => {
            for b in data.chunks_exact(32) {
                let min = b.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                let max = b.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                let d = (max - min) / 15.0;
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                push_f16(&mut out, d);
                push_f16(&mut out, min);
                let q = |v: f32| (((v - min) * id).round() as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|i| q(b[i]) | (q(b[i + 16]) << 4)));
            }
        }
        // kestrel-model's reference quantizers (round to nearest).
        DType::Q5_0 | DType::Q5_1 | DType::Q4K | DType::Q5K | DType::Q6K => {
            return Matrix::quantize(dtype, rows, cols, data)
        }
    }
    Matrix {
        dtype,
        rows,
        cols,
        data: Bytes::Owned(Arc::from(out)),
    }
}

/// A random matrix with entries uniform in `[-scale, scale)`, encoded as `dtype`.
pub fn random_matrix(rng: &mut Rng, dtype: DType, rows: usize, cols: usize, scale: f32) -> Matrix {
    let v = rng.vec(rows * cols, scale);
    encode(dtype, rows, cols, &v)
}

/// A Llama config of the given shape (SmolLM2-like defaults elsewhere).
#[allow(clippy::too_many_arguments)]
pub fn config(
    vocab: usize,
    hidden: usize,
    ffn: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    rope_style: RopeStyle,
) -> ModelConfig {
    ModelConfig {
        architecture: kestrel_model::Family::Llama,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: ffn,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hidden / heads,
        rope_theta: 100_000.0,
        rope_style,
        rms_norm_eps: 1e-5,
        max_position_embeddings: 8192,
        tie_word_embeddings: true,
        qkv_bias: false,
        features: Default::default(),
    }
}

/// SmolLM2-135M's shape.
pub fn smollm2_config() -> ModelConfig {
    config(49152, 576, 1536, 30, 9, 3, RopeStyle::Interleaved)
}

/// Random weights for `cfg`: matrices as `dtype`, embeddings as `embd_dtype`
/// (tied: `lm_head` shares the embedding bytes), norms near 1, biases when
/// `cfg.qkv_bias`, and what `cfg.features` asks for (LayerNorm biases,
/// output/FFN/head biases, no gate or FFN norm in a Phi block).
pub fn random_model(cfg: &ModelConfig, dtype: DType, embd_dtype: DType, seed: u64) -> ModelWeights {
    let mut rng = Rng(seed);
    let h = cfg.hidden_size;
    let qd = cfg.num_heads * cfg.head_dim;
    let kvd = cfg.num_kv_heads * cfg.head_dim;
    let f = cfg.intermediate_size;
    let ws = 1.0 / (h as f32).sqrt() * 1.7;
    let norm = |rng: &mut Rng, n: usize| {
        (0..n)
            .map(|_| 1.0 + 0.1 * rng.uniform())
            .collect::<Vec<f32>>()
    };
    let fe = &cfg.features;
    let layer_norm = fe.norm == kestrel_model::NormKind::Layer;
    let layers = (0..cfg.num_layers)
        .map(|_| LayerWeights {
            attn_norm: norm(&mut rng, h),
            wq: random_matrix(&mut rng, dtype, qd, h, ws),
            wk: random_matrix(&mut rng, dtype, kvd, h, ws),
            wv: random_matrix(&mut rng, dtype, kvd, h, ws),
            wo: random_matrix(&mut rng, dtype, h, qd, 1.0 / (qd as f32).sqrt()),
            bq: cfg.qkv_bias.then(|| rng.vec(qd, 0.1)),
            bk: cfg.qkv_bias.then(|| rng.vec(kvd, 0.1)),
            bv: cfg.qkv_bias.then(|| rng.vec(kvd, 0.1)),
            // Drawn only when the family has them, so Llama weights do not move.
            q_norm: cfg.features.qk_norm.then(|| norm(&mut rng, cfg.head_dim)),
            k_norm: cfg.features.qk_norm.then(|| norm(&mut rng, cfg.head_dim)),
            post_attn_norm: cfg.features.post_norms.then(|| norm(&mut rng, h)),
            ffn_norm: if fe.parallel_block {
                Vec::new()
            } else {
                norm(&mut rng, h)
            },
            w_gate: fe
                .gated_ffn
                .then(|| random_matrix(&mut rng, dtype, f, h, ws)),
            w_up: random_matrix(&mut rng, dtype, f, h, ws),
            w_down: random_matrix(&mut rng, dtype, h, f, 1.0 / (f as f32).sqrt()),
            post_ffn_norm: cfg.features.post_norms.then(|| norm(&mut rng, h)),
            attn_norm_bias: layer_norm.then(|| rng.vec(h, 0.1)),
            bo: fe.linear_biases.then(|| rng.vec(h, 0.1)),
            b_up: fe.linear_biases.then(|| rng.vec(f, 0.1)),
            b_down: fe.linear_biases.then(|| rng.vec(h, 0.1)),
        })
        .collect();
    let token_embd = random_matrix(&mut rng, embd_dtype, cfg.vocab_size, h, 1.0);
    ModelWeights {
        config: cfg.clone(),
        lm_head: token_embd.clone(),
        token_embd,
        layers,
        output_norm: norm(&mut rng, h),
        output_norm_bias: layer_norm.then(|| rng.vec(h, 0.1)),
        lm_head_bias: fe.linear_biases.then(|| rng.vec(cfg.vocab_size, 0.1)),
    }
}

/// Decode-step inputs for benchmarks: `batch` sequences each at position
/// `ctx - 1`, their pages interleaved (sequence `s` owns pages
/// `s, s + batch, s + 2 batch, ...`) so no sequence is contiguous.
#[derive(Debug, Clone)]
pub struct DecodeInputs {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub kv_indptr: Vec<u32>,
    pub kv_indices: Vec<u32>,
    pub kv_last_page_len: Vec<u32>,
}

impl DecodeInputs {
    /// `ctx` must be a multiple of `page_size`; the KV store needs
    /// `batch * ctx / page_size` pages.
    pub fn interleaved(batch: usize, ctx: usize, page_size: usize) -> Self {
        let pages = ctx / page_size;
        let mut kv_indices = Vec::with_capacity(batch * pages);
        let mut kv_indptr = vec![0u32];
        for s in 0..batch {
            kv_indices.extend((0..pages).map(|p| (p * batch + s) as u32));
            kv_indptr.push(kv_indices.len() as u32);
        }
        DecodeInputs {
            tokens: (0..batch as u32).map(|i| 100 + i * 37).collect(),
            positions: vec![(ctx - 1) as u32; batch],
            kv_indptr,
            kv_indices,
            kv_last_page_len: vec![page_size as u32; batch],
        }
    }

    pub fn batch(&self) -> crate::DecodeBatch<'_> {
        crate::DecodeBatch {
            tokens: &self.tokens,
            positions: &self.positions,
            kv_indptr: &self.kv_indptr,
            kv_indices: &self.kv_indices,
            kv_last_page_len: &self.kv_last_page_len,
        }
    }
}

/// A fresh `n`-token prompt (one sequence from position 0, pages `0..`) for
/// prefill benchmarks. `n` must be a multiple of `page_size`.
#[derive(Debug, Clone)]
pub struct PrefillInputs {
    pub tokens: Vec<u32>,
    qo_indptr: [u32; 2],
    kv_indptr: [u32; 2],
    kv_indices: Vec<u32>,
    last: [u32; 1],
}

impl PrefillInputs {
    pub fn fresh(n: usize, page_size: usize, vocab: usize) -> Self {
        let pages = n / page_size;
        PrefillInputs {
            tokens: (0..n as u32).map(|i| (i * 91) % vocab as u32).collect(),
            qo_indptr: [0, n as u32],
            kv_indptr: [0, pages as u32],
            kv_indices: (0..pages as u32).collect(),
            last: [page_size as u32],
        }
    }

    pub fn batch(&self) -> crate::PrefillBatch<'_> {
        crate::PrefillBatch {
            tokens: &self.tokens,
            qo_indptr: &self.qo_indptr,
            start_pos: &[0],
            kv_indptr: &self.kv_indptr,
            kv_indices: &self.kv_indices,
            kv_last_page_len: &self.last,
        }
    }
}
