//! The model on the device: f16 weights (dequantized once at load), the
//! paged KV cache, the loaded kernels and cuBLAS, and the launch sequence of
//! one forward (embed -> per layer: add+RMSNorm -> QKV GEMM -> bias -> RoPE
//! -> KV append -> paged attention -> O GEMM -> add+RMSNorm -> gate|up GEMM
//! -> SwiGLU -> down GEMM; final add+RMSNorm -> LM head) and of sampling.
//!
//! Every launch goes to the one compute stream (I1) through the [`Device`]
//! (one call per kernel op), with raw addresses, so the same code runs
//! eagerly and under graph capture, on the GPU and on the host device.

use half::f16;
use kestrel_model::{ModelConfig, ModelWeights, RopeStyle};

use super::backend::{
    AddBias, AddRmsNorm, DevMem, Device, EmbedGather, Gemm, KvAppend, PagedAttention, ResetCounts,
    RopeQk, SampleRows, Swiglu,
};
use crate::host::{rope_table, stack_bias, stack_f16};
use crate::kernels::MAX_HEAD_DIM;
use crate::CudaError;

struct Layer<D: Device> {
    attn_norm: D::Buf,
    ffn_norm: D::Buf,
    wqkv: D::Buf,
    bqkv: Option<D::Buf>,
    wo: D::Buf,
    w_gate_up: D::Buf,
    w_down: D::Buf,
}

/// Raw addresses of one forward's inputs and scratch (see `slot::Workspace`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FwdArgs {
    pub n: usize,
    /// Token ids: `pending` indexed through `rows` (decode) or the prompt (prefill, `rows` = 0).
    pub tokens: u64,
    pub rows: u64,
    pub positions: u64,
    pub row_seq: u64,
    pub slot_mapping: u64,
    pub kv_indptr: u64,
    pub kv_indices: u64,
    /// Final-norm output row per input row (`i32`, -1 = none), 0 = identity.
    pub out_row: u64,
    pub x: u64,
    pub xn: u64,
    pub qkv: u64,
    pub attn: u64,
    pub delta: u64,
    pub gate_up: u64,
    pub act: u64,
    pub hidden_last: u64,
}

/// Raw addresses of one sampling launch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SampleArgs {
    pub n: usize,
    pub top_n: usize,
    pub logits: u64,
    pub mask_words: u64,
    pub mask_flags: u64,
    pub words_per_row: usize,
    pub params: u64,
    pub rows: u64,
    pub positions: u64,
    pub out_tokens: u64,
    pub out_logprobs: u64,
    pub out_top_ids: u64,
    pub out_top_lps: u64,
}

/// Sizes of the device-side state [`DeviceModel::new`] allocates.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvGeometry {
    pub num_pages: usize,
    pub page_size: usize,
    /// KV rows including the reserved row 0.
    pub kv_rows: usize,
    /// Positions the RoPE table covers.
    pub max_pos: usize,
}

/// Weights and KV cache on one device, and the device itself.
pub(crate) struct DeviceModel<D: Device> {
    pub cfg: ModelConfig,
    embd: D::Buf,
    lm_head: Option<D::Buf>,
    output_norm: D::Buf,
    layers: Vec<Layer<D>>,
    rope: D::Buf,
    pub k_cache: D::Buf,
    pub v_cache: D::Buf,
    /// Generated-token counts per KV row (penalties), `[rows][vocab]`.
    pub counts: D::Buf,
    /// Each KV row's next input token (written by sampling).
    pub pending: D::Buf,
    pub page_size: usize,
    /// The page past the pool that padding rows write to.
    pub trash_page: u32,
    pub weight_bytes: usize,
    // Last: every buffer above is freed before the device goes.
    pub d: D,
}

impl<D: Device> DeviceModel<D> {
    /// Check the shape, upload the weights as f16 and allocate the KV cache
    /// (`num_pages + 1` pages: the last is the trash page) and row state.
    pub fn new(d: D, w: &ModelWeights, geo: KvGeometry) -> Result<Self, CudaError> {
        let KvGeometry {
            num_pages,
            page_size,
            kv_rows,
            max_pos,
        } = geo;
        let c = w.config.clone();
        if c.num_kv_heads == 0
            || !c.num_heads.is_multiple_of(c.num_kv_heads)
            || !c.head_dim.is_multiple_of(2)
            || c.head_dim > MAX_HEAD_DIM
        {
            return Err(CudaError::Unsupported(format!(
                "{} heads / {} kv heads / head_dim {} (need GQA groups, even head_dim <= {MAX_HEAD_DIM})",
                c.num_heads, c.num_kv_heads, c.head_dim
            )));
        }
        if w.layers.len() != c.num_layers {
            return Err(CudaError::Unsupported(format!(
                "{} layers in the weights, {} in the config",
                w.layers.len(),
                c.num_layers
            )));
        }
        let mut tmp: Vec<f16> = Vec::new();
        let mut weight_bytes = 0usize;
        let mut up16 = |mats: &[&kestrel_model::Matrix]| -> Result<D::Buf, CudaError> {
            stack_f16(mats, &mut tmp);
            weight_bytes += tmp.len() * 2;
            d.upload(&tmp)
        };
        let embd = up16(&[&w.token_embd])?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(up16(&[&w.lm_head])?)
        };
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in &w.layers {
            let bqkv = if l.bq.is_some() || l.bk.is_some() || l.bv.is_some() {
                Some(d.upload(&stack_bias(&[
                    (l.bq.as_ref(), qd),
                    (l.bk.as_ref(), kvd),
                    (l.bv.as_ref(), kvd),
                ]))?)
            } else {
                None
            };
            layers.push(Layer {
                attn_norm: d.upload(&l.attn_norm)?,
                ffn_norm: d.upload(&l.ffn_norm)?,
                wqkv: up16(&[&l.wq, &l.wk, &l.wv])?,
                bqkv,
                wo: up16(&[&l.wo])?,
                w_gate_up: up16(&[&l.w_gate, &l.w_up])?,
                w_down: up16(&[&l.w_down])?,
            });
        }
        let output_norm = d.upload(&w.output_norm)?;
        let rope = d.upload(&rope_table(max_pos, c.head_dim, c.rope_theta))?;
        // The KV cache is not zeroed: attention reads only positions that
        // kv_append wrote, which compute-sanitizer initcheck keeps checking.
        let kv_elems = c.num_layers * (num_pages + 1) * page_size * kvd;
        let k_cache = d.alloc(kv_elems * 2)?;
        let v_cache = d.alloc(kv_elems * 2)?;
        let counts = d.alloc_zeroed(kv_rows * c.vocab_size * 4)?;
        let pending = d.alloc_zeroed(kv_rows * 4)?;
        Ok(DeviceModel {
            cfg: c,
            embd,
            lm_head,
            output_norm,
            layers,
            rope,
            k_cache,
            v_cache,
            counts,
            pending,
            page_size,
            trash_page: num_pages as u32,
            weight_bytes,
            d,
        })
    }

    /// `y[n, out] (f32) = x[n, inp] (f16) * W[out, inp]^T (f16)`, f32 accumulation.
    fn gemm(
        &self,
        y: u64,
        x: u64,
        w: u64,
        n: usize,
        out: usize,
        inp: usize,
    ) -> Result<(), CudaError> {
        self.d.gemm(Gemm {
            y,
            x,
            w,
            n,
            out,
            inp,
        })
    }

    /// Embedding through the final norm for `a.n` rows (no LM head).
    pub fn forward_layers(&self, a: &FwdArgs) -> Result<(), CudaError> {
        let c = &self.cfg;
        let d = &self.d;
        let (hd, f) = (c.head_dim, c.intermediate_size);
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let stride = qd + 2 * kvd;
        let n = a.n;
        d.embed_gather(EmbedGather {
            table: self.embd.ptr(),
            tokens: a.tokens,
            rows: a.rows,
            x: a.x,
            hidden: c.hidden_size,
            vocab: c.vocab_size,
            n,
        })?;
        let layer_elems = (self.trash_page as usize + 1) * self.page_size * kvd;
        for (l, lw) in self.layers.iter().enumerate() {
            let delta = if l == 0 { 0 } else { a.delta };
            self.add_rms_norm(a.x, delta, lw.attn_norm.ptr(), a.xn, 0, n)?;
            self.gemm(a.qkv, a.xn, lw.wqkv.ptr(), n, stride, c.hidden_size)?;
            if let Some(bias) = &lw.bqkv {
                d.add_bias(AddBias {
                    y: a.qkv,
                    b: bias.ptr(),
                    stride,
                    d: stride,
                    n,
                })?;
            }
            d.rope_qk(RopeQk {
                qkv: a.qkv,
                stride,
                num_q_heads: c.num_heads,
                num_k_heads: c.num_kv_heads,
                head_dim: hd,
                table: self.rope.ptr(),
                pos: a.positions,
                interleaved: c.rope_style == RopeStyle::Interleaved,
                n,
            })?;
            let k_cache = self.k_cache.at::<f16>(l * layer_elems);
            let v_cache = self.v_cache.at::<f16>(l * layer_elems);
            d.kv_append(KvAppend {
                qkv: a.qkv,
                stride,
                k_off: qd,
                v_off: qd + kvd,
                k_cache,
                v_cache,
                slot_mapping: a.slot_mapping,
                kv_dim: kvd,
                n,
            })?;
            d.paged_attention(PagedAttention {
                qkv: a.qkv,
                stride,
                out: a.attn,
                k_cache,
                v_cache,
                row_seq: a.row_seq,
                row_pos: a.positions,
                kv_indptr: a.kv_indptr,
                kv_indices: a.kv_indices,
                num_heads: c.num_heads,
                num_kv_heads: c.num_kv_heads,
                head_dim: hd,
                page_size: self.page_size,
                scale: 1.0f32 / (hd as f32).sqrt(),
                n,
            })?;
            self.gemm(a.delta, a.attn, lw.wo.ptr(), n, c.hidden_size, qd)?;
            self.add_rms_norm(a.x, a.delta, lw.ffn_norm.ptr(), a.xn, 0, n)?;
            self.gemm(a.gate_up, a.xn, lw.w_gate_up.ptr(), n, 2 * f, c.hidden_size)?;
            d.swiglu(Swiglu {
                gate_up: a.gate_up,
                out: a.act,
                f,
                n,
            })?;
            self.gemm(a.delta, a.act, lw.w_down.ptr(), n, c.hidden_size, f)?;
        }
        self.add_rms_norm(
            a.x,
            a.delta,
            self.output_norm.ptr(),
            a.hidden_last,
            a.out_row,
            n,
        )
    }

    fn add_rms_norm(
        &self,
        x: u64,
        delta: u64,
        w: u64,
        out: u64,
        out_row: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        self.d.add_rms_norm(AddRmsNorm {
            x,
            delta,
            w,
            out,
            out_row,
            hidden: self.cfg.hidden_size,
            eps: self.cfg.rms_norm_eps,
            n,
        })
    }

    /// `logits[n] = hidden_last[n] * lm_head^T`.
    pub fn lm_head(&self, hidden_last: u64, logits: u64, n: usize) -> Result<(), CudaError> {
        let w = self.lm_head.as_ref().unwrap_or(&self.embd).ptr();
        self.gemm(
            logits,
            hidden_last,
            w,
            n,
            self.cfg.vocab_size,
            self.cfg.hidden_size,
        )
    }

    /// Zero the penalty counts of the KV rows in `rows[..n]` (new sequences).
    pub fn reset_counts(&self, rows: u64, n: usize) -> Result<(), CudaError> {
        self.d.reset_counts(ResetCounts {
            counts: self.counts.ptr(),
            rows,
            vocab: self.cfg.vocab_size,
            n,
        })
    }

    /// Sample `a.n` rows (see `kernels/sample.cu`).
    pub fn sample(&self, a: &SampleArgs) -> Result<(), CudaError> {
        self.d.sample_rows(SampleRows {
            logits: a.logits,
            vocab: self.cfg.vocab_size,
            mask_words: a.mask_words,
            mask_flags: a.mask_flags,
            words_per_row: a.words_per_row,
            params: a.params,
            rows: a.rows,
            positions: a.positions,
            counts: self.counts.ptr(),
            pending: self.pending.ptr(),
            out_tokens: a.out_tokens,
            out_logprobs: a.out_logprobs,
            out_top_ids: a.out_top_ids,
            out_top_lps: a.out_top_lps,
            top_n: a.top_n,
            n: a.n,
        })
    }
}
