//! [`CpuModel::new`]: weights validated against their config (every
//! matrix's shape, every norm and bias vector a family needs) and prepared
//! for the kernels in place, then the compute team started.

use kestrel_model::{LayerWeights, Matrix, ModelWeights, NormKind};

use super::{CpuModel, CpuModelOptions, Layer};
use crate::block::RopeSpec;
use crate::kernels::{Isa, Weight};
use crate::team::Team;
use crate::CpuError;

/// Check `m`'s shape and prepare it for the kernels.
fn check_matrix(name: &str, m: &Matrix, rows: usize, cols: usize) -> Result<Weight, CpuError> {
    if m.rows != rows || m.cols != cols {
        return Err(CpuError::Shape {
            name: name.to_owned(),
            expected: format!("{rows}x{cols}"),
            got: format!("{}x{}", m.rows, m.cols),
        });
    }
    Weight::prepare(name, m)
}

fn check_vec(name: &str, v: Option<&Vec<f32>>, len: usize, needed: bool) -> Result<(), CpuError> {
    match v {
        Some(v) if v.len() != len => Err(CpuError::Shape {
            name: name.to_owned(),
            expected: format!("{len} floats"),
            got: v.len().to_string(),
        }),
        None if needed => Err(CpuError::Shape {
            name: name.to_owned(),
            expected: format!("{len} floats"),
            got: "none".into(),
        }),
        _ => Ok(()),
    }
}

impl CpuModel {
    /// Validate `weights` against their config, prepare them for the
    /// kernels and start the compute team. Every matrix is kept in its file
    /// encoding (see [`crate::kernels::weight`]), copied onto huge pages or
    /// read from the file's mapping as `opts.weight_pages` says
    /// ([`crate::WeightPages`]).
    pub fn new(mut weights: ModelWeights, opts: CpuModelOptions) -> Result<CpuModel, CpuError> {
        let c = weights.config.clone();
        opts.weight_pages.place_model(&mut weights)?;
        let (h, f) = (c.hidden_size, c.intermediate_size);
        let qd = c.num_heads * c.head_dim;
        let kvd = c.num_kv_heads * c.head_dim;
        if c.num_kv_heads == 0
            || !c.num_heads.is_multiple_of(c.num_kv_heads)
            || !c.head_dim.is_multiple_of(2)
        {
            return Err(CpuError::Shape {
                name: "config heads".into(),
                expected: "num_heads a multiple of num_kv_heads, even head_dim".into(),
                got: format!(
                    "{} heads, {} kv heads, head_dim {}",
                    c.num_heads, c.num_kv_heads, c.head_dim
                ),
            });
        }
        let token_embd = check_matrix("token_embd", &weights.token_embd, c.vocab_size, h)?;
        let lm_head = if c.tie_word_embeddings {
            token_embd.clone()
        } else {
            check_matrix("lm_head", &weights.lm_head, c.vocab_size, h)?
        };
        check_vec("output_norm", Some(&weights.output_norm), h, true)?;
        let fe = &c.features;
        let ln = fe.norm == NormKind::Layer;
        let lb = fe.linear_biases;
        check_vec("output_norm_bias", weights.output_norm_bias.as_ref(), h, ln)?;
        check_vec(
            "lm_head_bias",
            weights.lm_head_bias.as_ref(),
            c.vocab_size,
            lb,
        )?;
        if weights.layers.len() != c.num_layers {
            return Err(CpuError::Shape {
                name: "layers".into(),
                expected: c.num_layers.to_string(),
                got: weights.layers.len().to_string(),
            });
        }
        let ModelWeights {
            layers: stored,
            output_norm,
            output_norm_bias,
            lm_head_bias,
            ..
        } = weights;
        let mut layers = Vec::with_capacity(stored.len());
        let mut ropes: Vec<RopeSpec> = Vec::new();
        let (qk, post) = (c.features.qk_norm, c.features.post_norms);
        for (i, l) in stored.into_iter().enumerate() {
            let n = |s: &str| format!("layers.{i}.{s}");
            check_vec(&n("attn_norm"), Some(&l.attn_norm), h, true)?;
            // A parallel block's FFN reads the attention norm's output.
            let ffn_norm_len = if fe.parallel_block { 0 } else { h };
            check_vec(&n("ffn_norm"), Some(&l.ffn_norm), ffn_norm_len, true)?;
            check_vec(&n("attn_norm_bias"), l.attn_norm_bias.as_ref(), h, ln)?;
            check_vec(&n("bo"), l.bo.as_ref(), h, lb)?;
            check_vec(&n("b_up"), l.b_up.as_ref(), f, lb)?;
            check_vec(&n("b_down"), l.b_down.as_ref(), h, lb)?;
            check_vec(&n("bq"), l.bq.as_ref(), qd, c.qkv_bias)?;
            check_vec(&n("bk"), l.bk.as_ref(), kvd, c.qkv_bias)?;
            check_vec(&n("bv"), l.bv.as_ref(), kvd, c.qkv_bias)?;
            check_vec(&n("q_norm"), l.q_norm.as_ref(), c.head_dim, qk)?;
            check_vec(&n("k_norm"), l.k_norm.as_ref(), c.head_dim, qk)?;
            check_vec(&n("post_attn_norm"), l.post_attn_norm.as_ref(), h, post)?;
            check_vec(&n("post_ffn_norm"), l.post_ffn_norm.as_ref(), h, post)?;
            let lr = c.layer_rope(i);
            let spec = RopeSpec::of(&lr);
            let rope = match ropes.iter().position(|r| *r == spec) {
                Some(r) => r,
                None => {
                    ropes.push(spec);
                    ropes.len() - 1
                }
            };
            let LayerWeights {
                attn_norm,
                wq,
                wk,
                wv,
                wo,
                bq,
                bk,
                bv,
                q_norm,
                k_norm,
                post_attn_norm,
                ffn_norm,
                w_gate,
                w_up,
                w_down,
                post_ffn_norm,
                attn_norm_bias,
                bo,
                b_up,
                b_down,
            } = l;
            let w_gate = match (w_gate, fe.gated_ffn) {
                (Some(g), true) => Some(check_matrix(&n("w_gate"), &g, f, h)?),
                (None, false) => None,
                (g, _) => {
                    return Err(CpuError::Shape {
                        name: n("w_gate"),
                        expected: format!("present iff the FFN is gated ({})", fe.gated_ffn),
                        got: if g.is_some() { "a matrix" } else { "none" }.into(),
                    })
                }
            };
            layers.push(Layer {
                wq: check_matrix(&n("wq"), &wq, qd, h)?,
                wk: check_matrix(&n("wk"), &wk, kvd, h)?,
                wv: check_matrix(&n("wv"), &wv, kvd, h)?,
                wo: check_matrix(&n("wo"), &wo, h, qd)?,
                w_gate,
                w_up: check_matrix(&n("w_up"), &w_up, f, h)?,
                w_down: check_matrix(&n("w_down"), &w_down, h, f)?,
                attn_norm,
                ffn_norm,
                bq,
                bk,
                bv,
                // A family without the feature runs without the weight.
                q_norm: q_norm.filter(|_| qk),
                k_norm: k_norm.filter(|_| qk),
                post_attn_norm: post_attn_norm.filter(|_| post),
                post_ffn_norm: post_ffn_norm.filter(|_| post),
                attn_norm_bias: attn_norm_bias.filter(|_| ln),
                bo: bo.filter(|_| lb),
                b_up: b_up.filter(|_| lb),
                b_down: b_down.filter(|_| lb),
                rope,
                window: lr.window,
            });
        }
        let threads = if opts.threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            opts.threads
        };
        let team = Team::new(threads, "kestrel-cpu").map_err(|source| CpuError::ThreadSpawn {
            thread: "compute team's helper",
            source,
        })?;
        let isa = match opts.isa.filter(|i| i.is_supported()) {
            Some(isa) => isa,
            None => Isa::try_detect()?,
        };
        let model = CpuModel {
            cfg: c,
            token_embd,
            lm_head,
            output_norm,
            output_norm_bias: output_norm_bias.filter(|_| ln),
            lm_head_bias: lm_head_bias.filter(|_| lb),
            layers,
            ropes,
            team,
            isa,
            numerics: opts.numerics,
        };
        tracing::info!(
            threads,
            ?isa,
            numerics = ?opts.numerics,
            weight_bytes = model.weight_bytes(),
            "kestrel-cpu model ready"
        );
        Ok(model)
    }
}
