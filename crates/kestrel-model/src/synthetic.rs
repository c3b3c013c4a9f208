//! Deterministic synthetic weights for tests and benchmarks of any shape.
//!
//! Values are uniform with a GPT/Llama-style init scale (std 0.02, output
//! projections shrunk by `1/sqrt(2 * layers)`), so activations stay finite
//! through many layers; norms are ~1. Matrices are quantized with the real
//! block encoders, so a Q4_1 synthetic model has a real Q4_1 byte profile.
//! Cost: one PRNG draw per parameter (an 8B preset takes a while and ~GBs).

use crate::{DType, LayerWeights, Matrix, ModelConfig, ModelWeights};

/// SplitMix64: tiny, seedable, good enough for weights and test data (the
/// one generator of the project's synthetic weights; `kestrel-cpu`'s test
/// helpers use it too).
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// `n` uniform values scaled by `scale`.
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

/// The init scale of every synthetic matrix (GPT/Llama-style std).
pub const INIT_STD: f32 = 0.02;

/// Builds all weights for `config`, every matrix encoded as `dtype` (norms
/// and biases are `f32`). Same `(config, dtype, seed)`, same bytes.
///
/// Panics if a matrix's column count does not tile `dtype`'s blocks (e.g.
/// Q4_K needs multiples of 256: use [`ModelConfig::tiny`]-like shapes).
pub fn synthetic_weights(config: &ModelConfig, dtype: DType, seed: u64) -> ModelWeights {
    let mut tensor_id = 0u64;
    let mut next_rng = || {
        tensor_id += 1;
        Rng(seed ^ tensor_id.wrapping_mul(0xD1B5_4A32_D192_ED03))
    };
    // Uniform on [-a, a] has std a / sqrt(3).
    let std = INIT_STD;
    let out_std = std / (2.0 * config.num_layers as f32).sqrt();
    let matrix = |rng: &mut Rng, rows: usize, cols: usize, std: f32| {
        let amp = std * 3f32.sqrt();
        let values: Vec<f32> = (0..rows * cols).map(|_| rng.uniform() * amp).collect();
        Matrix::quantize(dtype, rows, cols, &values)
    };
    let vector = |rng: &mut Rng, n: usize, center: f32, spread: f32| -> Vec<f32> {
        (0..n).map(|_| center + rng.uniform() * spread).collect()
    };

    let (h, q, kv, ff) = (
        config.hidden_size,
        config.q_dim(),
        config.kv_dim(),
        config.intermediate_size,
    );
    let token_embd = matrix(&mut next_rng(), config.vocab_size, h, std);
    let layers = (0..config.num_layers)
        .map(|_| {
            let bias = |rng: &mut Rng, n| config.qkv_bias.then(|| vector(rng, n, 0.0, 0.02));
            // Drawn only when the family has them, so Llama bytes do not move.
            let norm = |on: bool, rng: &mut dyn FnMut() -> Rng, n| {
                on.then(|| vector(&mut rng(), n, 1.0, 0.1))
            };
            let (qk, post) = (config.features.qk_norm, config.features.post_norms);
            LayerWeights {
                attn_norm: vector(&mut next_rng(), h, 1.0, 0.1),
                wq: matrix(&mut next_rng(), q, h, std),
                wk: matrix(&mut next_rng(), kv, h, std),
                wv: matrix(&mut next_rng(), kv, h, std),
                wo: matrix(&mut next_rng(), h, q, out_std),
                bq: bias(&mut next_rng(), q),
                bk: bias(&mut next_rng(), kv),
                bv: bias(&mut next_rng(), kv),
                q_norm: norm(qk, &mut next_rng, config.head_dim),
                k_norm: norm(qk, &mut next_rng, config.head_dim),
                post_attn_norm: norm(post, &mut next_rng, h),
                ffn_norm: vector(&mut next_rng(), h, 1.0, 0.1),
                w_gate: Some(matrix(&mut next_rng(), ff, h, std)),
                w_up: matrix(&mut next_rng(), ff, h, std),
                w_down: matrix(&mut next_rng(), h, ff, out_std),
                post_ffn_norm: norm(post, &mut next_rng, h),
                attn_norm_bias: None,
                bo: None,
                b_up: None,
                b_down: None,
            }
        })
        .collect();
    let output_norm = vector(&mut next_rng(), h, 1.0, 0.1);
    let lm_head = if config.tie_word_embeddings {
        token_embd.clone()
    } else {
        matrix(&mut next_rng(), config.vocab_size, h, std)
    };
    ModelWeights {
        config: config.clone(),
        token_embd,
        layers,
        output_norm,
        lm_head,
        output_norm_bias: None,
        lm_head_bias: None,
    }
}

impl ModelConfig {
    /// [`ModelConfig::smollm2_135m`] cut to `layers` layers (fast tests with real shapes).
    pub fn smollm2_135m_layers(layers: usize) -> Self {
        ModelConfig {
            num_layers: layers,
            ..ModelConfig::smollm2_135m()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_seed_dependent() {
        let c = ModelConfig::tiny();
        let a = synthetic_weights(&c, DType::Q4_1, 7);
        let b = synthetic_weights(&c, DType::Q4_1, 7);
        let d = synthetic_weights(&c, DType::Q4_1, 8);
        assert_eq!(&*a.layers[1].wq.data, &*b.layers[1].wq.data);
        assert_ne!(&*a.layers[1].wq.data, &*d.layers[1].wq.data);
        assert_ne!(&*a.layers[0].wq.data, &*a.layers[1].wq.data);
    }

    #[test]
    fn shapes_and_dtypes() {
        let mut c = ModelConfig::tiny();
        c.qkv_bias = true;
        for dtype in DType::ALL {
            let w = synthetic_weights(&c, dtype, 1);
            let l = &w.layers[0];
            assert_eq!((l.wq.rows, l.wq.cols), (c.q_dim(), c.hidden_size));
            assert_eq!((l.wk.rows, l.wv.rows), (c.kv_dim(), c.kv_dim()));
            assert_eq!((l.wo.rows, l.wo.cols), (c.hidden_size, c.q_dim()));
            assert_eq!(
                (l.w_down.rows, l.w_down.cols),
                (c.hidden_size, c.intermediate_size)
            );
            let gate = l.w_gate.as_ref().expect("a gated FFN");
            assert_eq!(gate.dtype, dtype);
            assert_eq!(gate.data.len(), gate.rows * gate.row_bytes());
            assert_eq!(l.bq.as_ref().map(Vec::len), Some(c.q_dim()));
            assert_eq!(w.lm_head.rows, c.vocab_size);
            let vals = l.wq.to_f32();
            let rms = (vals.iter().map(|v| v * v).sum::<f32>() / vals.len() as f32).sqrt();
            assert!((0.01..0.03).contains(&rms), "{dtype:?} rms {rms}");
        }
    }

    #[test]
    fn tied_embeddings_share_bytes() {
        let w = synthetic_weights(&ModelConfig::smollm2_135m_layers(1), DType::Q8_0, 3);
        assert_eq!(w.lm_head.data.as_ptr(), w.token_embd.data.as_ptr());
    }
}
