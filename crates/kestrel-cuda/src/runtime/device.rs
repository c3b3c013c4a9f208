//! The model on a [`Device`]: weights in their file's encoding
//! (`crate::quant`'s upload plan), the paged KV cache, and the launch
//! sequence of one forward (embed -> per layer: add+RMSNorm -> QKV matmul
//! -> bias -> RoPE + KV append -> paged attention -> O matmul ->
//! add+RMSNorm -> gate|up matmul -> SwiGLU -> down matmul; final
//! add+RMSNorm -> LM head) and of sampling. The family's
//! [`kestrel_model::ArchFeatures`] add steps as kestrel-cpu's forward does,
//! op for op: embedding scale, q/k norms (fused into RoPE + KV append), one
//! RoPE table per distinct layer RoPE (frequency factors, linear scaling,
//! local base), sliding windows and the attention scale (attention's
//! arguments), post-attention / post-FFN norms of the sublayer outputs,
//! GELU-tanh (`gelu_mul*`), and the final logit softcap; Phi's block
//! (`Family::Phi`, Moondream's text model): LayerNorm with bias
//! (`add_layer_norm`), the FFN reading the attention norm's output
//! (parallel block: `x += attn` by `add_f32`, then `x += mlp` at the next
//! norm, the CPU's order), partial rotary (`rotary_dim`), the projections'
//! and LM head's biases (`add_bias`), an ungated FFN (`bias_gelu`);
//! Moondream's region model and spatial stage live in `region.rs`. A matmul of up to
//! `MMVQ_CROSSOVER_ROWS` rows on a quantized weight runs `mmvq_*` on int8
//! activations (quantized fused into the norm / SwiGLU that produces them);
//! larger ones dequantize the weight tile by tile to f16 for the GEMM.
//!
//! Every launch goes to the one compute stream (I1) through the [`Device`]
//! (one call per kernel launch), with raw addresses, so the same code runs
//! eagerly and under graph capture, on the GPU and on the host device. The
//! int8 activations and the f16 tile are model-wide scratch, which one
//! stream makes safe for every slot's graphs.

use half::f16;
use kestrel_model::{Activation, DType, LayerRope, Matrix, ModelConfig, ModelWeights, RopeStyle};

use super::backend::{
    AddBias, AddF32, AddLayerNorm, AddRmsNorm, AddRmsNormQ8, BiasGelu, CountTokens, DequantF16,
    DevMem, Device, EmbedGather, EmbedGatherQ, GeluMul, GeluMulQ8, Gemm, Mmvq, PagedAttention,
    PrefillAttention, QuantizeQ8H, ResetCounts, RmsNormF32, RopeKvAppend, ScaleF32, Softcap,
    Swiglu, SwigluQ8,
};
use super::region::DeviceRegion;
use super::vision::DeviceVision;
use crate::host::{rope_table_of, stack_bias};
use crate::kernels::{ATTENTION_MAX_SPLITS, MAX_HEAD_DIM, MMVQ_MAX_ROWS};
use crate::quant::{
    layer_projections, matmul_path, part_bytes, plan_parts, MatmulPath, BLOCK, MMVQ_CROSSOVER_ROWS,
    Q8_BLOCK_BYTES, TILE_ELEMS,
};
use crate::CudaError;

/// One device matrix of a projection, in its file's encoding: `rows`
/// output columns from `out_offset` (see `quant::PartPlan`).
pub(super) struct Part<D: Device> {
    dtype: DType,
    rows: usize,
    cols: usize,
    out_offset: usize,
    w: D::Buf,
}

/// Matrices sharing one input and writing one output row of `out` values.
pub(super) struct Proj<D: Device> {
    pub(super) parts: Vec<Part<D>>,
    pub(super) out: usize,
    pub(super) inp: usize,
}

impl<D: Device> Proj<D> {
    pub(super) fn upload(
        d: &D,
        what: &str,
        mats: &[&Matrix],
        bytes: &mut usize,
    ) -> Result<Self, CudaError> {
        let mut parts = Vec::new();
        for p in plan_parts(what, mats)? {
            let data = part_bytes(&p, mats);
            *bytes += data.len();
            parts.push(Part {
                dtype: p.dtype,
                rows: p.rows,
                cols: p.cols,
                out_offset: p.out_offset,
                w: d.upload(&data)?,
            });
        }
        Ok(Proj {
            out: mats.iter().map(|m| m.rows).sum(),
            inp: mats[0].cols,
            parts,
        })
    }

    pub(super) fn needs(&self, n: usize) -> Needs {
        needs(&self.parts, n)
    }
}

/// The activations a matmul of `n` rows on `parts` reads.
fn needs<D: Device>(parts: &[Part<D>], n: usize) -> Needs {
    let mut need = Needs::default();
    for p in parts {
        match matmul_path(p.dtype, n) {
            MatmulPath::Mmvq => need.q8 = true,
            MatmulPath::GemmF16 | MatmulPath::DequantTiles => need.f16 = true,
        }
    }
    need
}

/// Which forms of its input a projection reads.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Needs {
    f16: bool,
    pub(super) q8: bool,
}

struct Layer<D: Device> {
    attn_norm: D::Buf,
    /// LayerNorm's bias (Phi); `None`: RMSNorm.
    attn_norm_bias: Option<D::Buf>,
    /// `None` for a parallel block (its FFN reads the attention norm's output).
    ffn_norm: Option<D::Buf>,
    /// Per-head q/k RMSNorm weights (Qwen3, Gemma 3).
    qk_norm: Option<(D::Buf, D::Buf)>,
    /// Norms of the attention / FFN outputs before their residual adds (Gemma).
    post_attn_norm: Option<D::Buf>,
    post_ffn_norm: Option<D::Buf>,
    /// Index into `DeviceModel::ropes`.
    rope: usize,
    /// Keys this layer attends: the last `window` positions; 0: all.
    window: usize,
    qkv: Proj<D>,
    bqkv: Option<D::Buf>,
    wo: Proj<D>,
    /// The O projection's bias, the ungated FFN's `fc1` and `fc2` biases (Phi).
    bo: Option<D::Buf>,
    b_up: Option<D::Buf>,
    b_down: Option<D::Buf>,
    gate_up: Proj<D>,
    down: Proj<D>,
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
    /// Where each input row reads its spatial input, when a region model
    /// embeds coordinates and sizes (`region.rs`).
    pub spatial: SpatialIn,
    /// The rows come in runs of one sequence's consecutive positions
    /// (prefill chunks): attention runs `prefill_attention`, which reads
    /// each K/V tile once per run. Otherwise (decode: one row per
    /// sequence) `paged_attention`.
    pub tiled_attention: bool,
    /// Attention's position per row when it differs from the RoPE
    /// position (`positions`): a bidirectional prefix's rows are masked at
    /// the prefix's last position, so they attend all of it (a prefill
    /// with image rows, `prefill.rs`); 0: `positions`.
    pub mask_pos: u64,
    pub x: u64,
    pub xn: u64,
    pub qkv: u64,
    pub attn: u64,
    pub delta: u64,
    pub gate_up: u64,
    pub act: u64,
    pub hidden_last: u64,
}

/// Where a forward's rows read the token and values a region model embeds
/// a coordinate or size input from (`region.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SpatialIn {
    /// No row is a spatial input: every row is its token's embedding.
    None,
    /// Row `i`'s are its KV row `rows[i]`'s pending token and values:
    /// `rows` in decode; in a verifying step, the member's for its input
    /// row, reserved KV row 0 (never sampled into) for its drafts.
    KvRows(u64),
    /// A re-prefill's rows (`prefill.rs`): row `i`'s token is `tokens[i]`
    /// (a generated coordinate or size id; 0, no spatial id, for the other
    /// rows) and its values `values[3 i..3 i + 3]` (f32: coord, w, h), the
    /// ones committed with it.
    Rows { tokens: u64, values: u64 },
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
    /// Rows a verifying decode step samples at most (its draft scratch;
    /// 0: no draft verification).
    pub draft_rows: usize,
}

/// Weights and KV cache on one device, and the device itself.
pub(crate) struct DeviceModel<D: Device> {
    pub cfg: ModelConfig,
    embd: Part<D>,
    lm_head: Option<Proj<D>>,
    /// Int8 activations of up to `MMVQ_CROSSOVER_ROWS` rows (the widest input).
    xq: D::Buf,
    xq_bytes: usize,
    /// The f16 tile non-f16 weights are dequantized into for the GEMM.
    tile: D::Buf,
    tile_bytes: usize,
    /// Decode attention's key ranges (`PagedAttention::part`) for the
    /// widest decode step, and how many ranges a row takes at most.
    attn_part: D::Buf,
    attn_splits: usize,
    output_norm: D::Buf,
    /// The final LayerNorm's bias and the LM head's bias (Phi).
    output_norm_bias: Option<D::Buf>,
    lm_head_bias: Option<D::Buf>,
    /// Dimensions RoPE rotates per head (`head_dim` but for partial rotary).
    rotary_dim: usize,
    layers: Vec<Layer<D>>,
    /// One cos/sin table per distinct layer RoPE (global, local).
    ropes: Vec<D::Buf>,
    pub k_cache: D::Buf,
    pub v_cache: D::Buf,
    /// Generated-token counts per KV row (penalties), `[rows][vocab]`.
    pub counts: D::Buf,
    /// Each KV row's next input token (written by sampling).
    pub pending: D::Buf,
    /// A verifying step's per-row penalty counts (`draft_counts`) and the
    /// pending tokens its sampling writes and nothing reads (the members'
    /// own are `accept_drafts`'s): scratch, safe for both slots by I1.
    pub draft_counts: D::Buf,
    pub draft_pending: D::Buf,
    pub page_size: usize,
    /// The page past the pool that padding rows write to.
    pub trash_page: u32,
    pub weight_bytes: usize,
    /// Moondream's region model and the spatial stage's state
    /// (`runtime/region.rs`), once attached.
    pub(super) region: Option<DeviceRegion<D>>,
    /// Moondream's vision encoder and projector (`runtime/vision.rs`), once
    /// attached.
    pub(super) vision: Option<DeviceVision<D>>,
    // Last: every buffer above is freed before the device goes.
    pub d: D,
}

impl<D: Device> DeviceModel<D> {
    /// Check the shape, upload the weights in their encoding (the upload
    /// plan) and allocate the scratch, the KV cache (`num_pages + 1` pages:
    /// the last is the trash page) and row state.
    pub fn new(d: D, w: &ModelWeights, geo: KvGeometry) -> Result<Self, CudaError> {
        let KvGeometry {
            num_pages,
            page_size,
            kv_rows,
            max_pos,
            draft_rows,
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
        let fe = &c.features;
        let layer_norm = fe.norm == kestrel_model::NormKind::Layer;
        let rotary_dim = fe.rotary_dim.unwrap_or(c.head_dim);
        // kestrel-cpu's block: a LayerNorm model is a parallel one (its
        // FFN norm is RMS otherwise), an ungated FFN is GELU-tanh.
        if (layer_norm && !fe.parallel_block)
            || (!fe.gated_ffn && fe.activation != Activation::GeluTanh)
            || rotary_dim > c.head_dim
            || !rotary_dim.is_multiple_of(2)
        {
            return Err(CudaError::Unsupported(format!(
                "the {} block (LayerNorm without a parallel block, an ungated FFN \
                 without GELU-tanh, or rotary_dim {rotary_dim} of head_dim {})",
                c.architecture, c.head_dim
            )));
        }
        if w.layers.len() != c.num_layers {
            return Err(CudaError::Unsupported(format!(
                "{} layers in the weights, {} in the config",
                w.layers.len(),
                c.num_layers
            )));
        }
        let mut weight_bytes = 0usize;
        let embd = {
            let mut p = Proj::upload(&d, "token_embd", &[&w.token_embd], &mut weight_bytes)?;
            p.parts.pop().expect("one matrix, one part")
        };
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(Proj::upload(
                &d,
                "lm_head",
                &[&w.lm_head],
                &mut weight_bytes,
            )?)
        };
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let fe = &c.features;
        let mut layers = Vec::with_capacity(c.num_layers);
        // The distinct layer RoPEs (window aside), as kestrel-cpu's `ropes`.
        let mut rope_specs: Vec<LayerRope<'_>> = Vec::new();
        let mut ropes = Vec::new();
        for (i, l) in w.layers.iter().enumerate() {
            let lr = c.layer_rope(i);
            let same = |r: &LayerRope<'_>| {
                (r.theta, r.freq_factors, r.linear_scale)
                    == (lr.theta, lr.freq_factors, lr.linear_scale)
            };
            let rope = match rope_specs.iter().position(same) {
                Some(r) => r,
                None => {
                    ropes.push(d.upload(&rope_table_of(&lr, max_pos, rotary_dim))?);
                    rope_specs.push(lr);
                    rope_specs.len() - 1
                }
            };
            let norm = |on: bool, v: &Option<Vec<f32>>, what: &str, len: usize| match v {
                Some(v) if on && v.len() == len => d.upload(v).map(Some),
                _ if on => Err(CudaError::Unsupported(format!(
                    "layer {i}: {what} missing or not {len} floats"
                ))),
                _ => Ok(None),
            };
            let qk_norm = match (
                norm(fe.qk_norm, &l.q_norm, "q_norm", c.head_dim)?,
                norm(fe.qk_norm, &l.k_norm, "k_norm", c.head_dim)?,
            ) {
                (Some(q), Some(k)) => Some((q, k)),
                _ => None,
            };
            let post_attn_norm = norm(
                fe.post_norms,
                &l.post_attn_norm,
                "post_attn_norm",
                c.hidden_size,
            )?;
            let post_ffn_norm = norm(
                fe.post_norms,
                &l.post_ffn_norm,
                "post_ffn_norm",
                c.hidden_size,
            )?;
            let bqkv = if l.bq.is_some() || l.bk.is_some() || l.bv.is_some() {
                Some(d.upload(&stack_bias(&[
                    (l.bq.as_ref(), qd),
                    (l.bk.as_ref(), kvd),
                    (l.bv.as_ref(), kvd),
                ]))?)
            } else {
                None
            };
            let vector = |v: &Option<Vec<f32>>, what: &str, len: usize| match v {
                Some(v) if v.len() == len => d.upload(v).map(Some),
                Some(_) => Err(CudaError::Unsupported(format!(
                    "layer {i}: {what} not {len} floats"
                ))),
                None => Ok(None),
            };
            let attn_norm_bias = vector(&l.attn_norm_bias, "attn_norm_bias", c.hidden_size)?;
            if layer_norm != attn_norm_bias.is_some() {
                return Err(CudaError::Unsupported(format!(
                    "layer {i}: a LayerNorm needs its bias (and an RMSNorm has none)"
                )));
            }
            let bo = vector(&l.bo, "bo", c.hidden_size)?;
            let b_up = vector(&l.b_up, "b_up", c.intermediate_size)?;
            let b_down = vector(&l.b_down, "b_down", c.hidden_size)?;
            if b_up.is_some() && l.w_gate.is_some() {
                return Err(CudaError::Unsupported(format!(
                    "layer {i}: an FFN bias on a gated FFN"
                )));
            }
            let ffn_norm = if fe.parallel_block {
                None
            } else {
                Some(d.upload(&l.ffn_norm)?)
            };
            let [qkv, wo, gate_up, down] = layer_projections(l);
            let what = format!("layer {}", layers.len());
            let mut up = |mats: &[&Matrix]| Proj::upload(&d, &what, mats, &mut weight_bytes);
            layers.push(Layer {
                attn_norm: d.upload(&l.attn_norm)?,
                attn_norm_bias,
                ffn_norm,
                qk_norm,
                post_attn_norm,
                post_ffn_norm,
                rope,
                window: lr.window.unwrap_or(0),
                qkv: up(&qkv)?,
                bqkv,
                wo: up(&wo)?,
                bo,
                b_up,
                b_down,
                gate_up: up(&gate_up)?,
                down: up(&down)?,
            });
        }
        // Neither scratch is zeroed: each forward writes what it reads of
        // them first, and the host device's poisoned `alloc` makes CI fail
        // if a change breaks that.
        let widest = c.hidden_size.max(qd).max(c.intermediate_size);
        let xq_bytes = MMVQ_CROSSOVER_ROWS * widest.div_ceil(BLOCK) * Q8_BLOCK_BYTES;
        let xq = d.alloc(xq_bytes)?;
        let any_tiled = layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.wo, &l.gate_up, &l.down])
            .chain(&lm_head)
            .flat_map(|p| &p.parts)
            .chain([&embd].into_iter().filter(|_| c.tie_word_embeddings))
            .any(|p| p.dtype != DType::F16);
        let tile_bytes = if any_tiled { TILE_ELEMS * 2 } else { 0 };
        let tile = d.alloc(tile_bytes)?;
        let output_norm = d.upload(&w.output_norm)?;
        let head_vector = |v: &Option<Vec<f32>>, what: &str, len: usize| match v {
            Some(v) if v.len() == len => d.upload(v).map(Some),
            Some(_) => Err(CudaError::Unsupported(format!("{what} not {len} floats"))),
            None => Ok(None),
        };
        let output_norm_bias = head_vector(&w.output_norm_bias, "output_norm_bias", c.hidden_size)?;
        if layer_norm != output_norm_bias.is_some() {
            return Err(CudaError::Unsupported(
                "the final LayerNorm needs its bias (and an RMSNorm has none)".into(),
            ));
        }
        let lm_head_bias = head_vector(&w.lm_head_bias, "lm_head_bias", c.vocab_size)?;
        // Decode attention: every row's ranges at the longest context, for
        // the widest decode step (a row per KV row but the reserved one).
        // Written by the split pass before the merge reads it.
        let attn_splits = max_pos
            .div_ceil(crate::reference::ATT_SPLIT_MIN)
            .clamp(1, ATTENTION_MAX_SPLITS);
        let decode_rows = kv_rows.saturating_sub(1).max(1);
        let attn_part = d.alloc(decode_rows * c.num_heads * attn_splits * (c.head_dim + 2) * 4)?;
        // The KV cache is not zeroed: attention reads only positions that
        // rope_kv_append wrote, which compute-sanitizer initcheck keeps
        // checking.
        let kv_elems = c.num_layers * (num_pages + 1) * page_size * kvd;
        let k_cache = d.alloc(kv_elems * 2)?;
        let v_cache = d.alloc(kv_elems * 2)?;
        let counts = d.alloc_zeroed(kv_rows * c.vocab_size * 4)?;
        let pending = d.alloc_zeroed(kv_rows * 4)?;
        // Written (draft_counts, sample_rows) before anything reads them.
        let draft_counts = d.alloc(draft_rows * c.vocab_size * 4)?;
        let draft_pending = d.alloc(draft_rows * 4)?;
        Ok(DeviceModel {
            cfg: c,
            embd,
            lm_head,
            xq,
            xq_bytes,
            tile,
            tile_bytes,
            attn_part,
            attn_splits,
            output_norm,
            output_norm_bias,
            lm_head_bias,
            rotary_dim,
            layers,
            ropes,
            k_cache,
            v_cache,
            counts,
            pending,
            draft_counts,
            draft_pending,
            page_size,
            trash_page: num_pages as u32,
            weight_bytes,
            region: None,
            vision: None,
            d,
        })
    }

    /// `y[n, out] = x[n, inp] * W^T` over `parts` (each writing its output
    /// columns of rows `out` apart), each on its `matmul_path`: `mmvq_*` on
    /// `self.xq` (written by the caller when `needs(..).q8`), the GEMM on
    /// the f16 rows `x16` and the f16 weight or its dequantized tiles.
    pub(super) fn matmul(
        &self,
        y: u64,
        parts: &[Part<D>],
        out: usize,
        x16: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        for part in parts {
            let yp = y + (part.out_offset * 4) as u64;
            let gemm = |y: u64, w: u64, rows: usize| {
                self.d.gemm(Gemm {
                    y,
                    ldy: out,
                    x: x16,
                    w,
                    n,
                    out: rows,
                    inp: part.cols,
                })
            };
            match matmul_path(part.dtype, n) {
                MatmulPath::Mmvq => self.mmvq(yp, out, part, n)?,
                MatmulPath::GemmF16 => gemm(yp, part.w.ptr(), part.rows)?,
                MatmulPath::DequantTiles => {
                    let tile_rows = (TILE_ELEMS / part.cols).max(1);
                    for r0 in (0..part.rows).step_by(tile_rows) {
                        let nr = tile_rows.min(part.rows - r0);
                        self.d.dequant_f16(DequantF16 {
                            w: part.w.ptr(),
                            dtype: part.dtype,
                            row0: r0,
                            nrows: nr,
                            cols: part.cols,
                            out: self.tile.ptr(),
                        })?;
                        gemm(yp + (r0 * 4) as u64, self.tile.ptr(), nr)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// `mmvq_*` over `n` rows of `self.xq`, `MMVQ_MAX_ROWS` rows a launch.
    fn mmvq(&self, y: u64, ldy: usize, part: &Part<D>, n: usize) -> Result<(), CudaError> {
        let row_bytes = part.cols / BLOCK * Q8_BLOCK_BYTES;
        for r0 in (0..n).step_by(MMVQ_MAX_ROWS) {
            self.d.mmvq(Mmvq {
                dtype: part.dtype,
                w: part.w.ptr(),
                xq: self.xq.ptr() + (r0 * row_bytes) as u64,
                y: y + (r0 * ldy * 4) as u64,
                rows: part.rows,
                cols: part.cols,
                ldy,
                n: MMVQ_MAX_ROWS.min(n - r0),
            })?;
        }
        Ok(())
    }

    /// Grow the int8 activation scratch to `xq_bytes` and, when `tile` is
    /// given, the dequantization tile to `tile` bytes (at load: nothing
    /// captured reads them yet).
    pub(super) fn grow_scratch(
        &mut self,
        xq_bytes: usize,
        tile: Option<usize>,
    ) -> Result<(), CudaError> {
        if xq_bytes > self.xq_bytes {
            self.xq = self.d.alloc(xq_bytes)?;
            self.xq_bytes = xq_bytes;
        }
        if let Some(t) = tile.filter(|&t| t > self.tile_bytes) {
            self.tile = self.d.alloc(t)?;
            self.tile_bytes = t;
        }
        Ok(())
    }

    /// f16 rows `x` (`cols` wide) to int8 blocks in `self.xq`.
    pub(super) fn quantize_q8(&self, x: u64, cols: usize, n: usize) -> Result<(), CudaError> {
        self.d.quantize_q8_h(QuantizeQ8H {
            x,
            xq: self.xq.ptr(),
            cols,
            n,
        })
    }

    /// add + RMSNorm (LayerNorm when `w` comes with a bias) of `n` rows
    /// into what `need` asks for: f16 rows in `out`, int8 blocks in
    /// `self.xq` (fused when only they are needed, RMSNorm only).
    fn norm_into(
        &self,
        x: u64,
        delta: u64,
        (w, bias): (u64, Option<&D::Buf>),
        out: u64,
        n: usize,
        need: Needs,
    ) -> Result<(), CudaError> {
        if let Some(b) = bias {
            self.d.add_layer_norm(AddLayerNorm {
                x,
                delta,
                w,
                b: b.ptr(),
                out,
                out_row: 0,
                hidden: self.cfg.hidden_size,
                eps: self.cfg.rms_norm_eps,
                n,
            })?;
            if need.q8 {
                self.quantize_q8(out, self.cfg.hidden_size, n)?;
            }
            return Ok(());
        }
        if need.f16 || !need.q8 {
            self.add_rms_norm(x, delta, w, out, 0, n)?;
            if need.q8 {
                self.quantize_q8(out, self.cfg.hidden_size, n)?;
            }
            return Ok(());
        }
        self.d.add_rms_norm_q8(AddRmsNormQ8 {
            x,
            delta,
            w,
            xq: self.xq.ptr(),
            out_row: 0,
            hidden: self.cfg.hidden_size,
            eps: self.cfg.rms_norm_eps,
            n,
        })
    }

    /// Embedding through the final norm for `a.n` rows (no LM head).
    pub fn forward_layers(&self, a: &FwdArgs) -> Result<(), CudaError> {
        self.forward_embed(a)?;
        self.forward_blocks(a)
    }

    /// Rows `row..row + len` of `x` (f32, `hidden` wide) become `len` rows
    /// of `src` (f32): an image's rows in place of their token embeddings
    /// (`scale_f32` by 0, then `add_f32`; no kernel of their own).
    pub fn put_rows(&self, x: u64, row: usize, src: u64, len: usize) -> Result<(), CudaError> {
        let h = self.cfg.hidden_size;
        let x = x + (row * h * 4) as u64;
        self.d.scale_f32(ScaleF32 {
            x,
            s: 0.0,
            len: len * h,
        })?;
        self.d.add_f32(AddF32 {
            x,
            y: src,
            len: len * h,
        })
    }

    /// The token embedding of `a.n` rows (scaled, and spatial inputs
    /// embedded), into `a.x`.
    pub fn forward_embed(&self, a: &FwdArgs) -> Result<(), CudaError> {
        let c = &self.cfg;
        let d = &self.d;
        let n = a.n;
        if self.embd.dtype == DType::F16 {
            d.embed_gather(EmbedGather {
                table: self.embd.w.ptr(),
                tokens: a.tokens,
                rows: a.rows,
                x: a.x,
                hidden: c.hidden_size,
                vocab: c.vocab_size,
                n,
            })?;
        } else {
            d.embed_gather_q(EmbedGatherQ {
                table: self.embd.w.ptr(),
                dtype: self.embd.dtype,
                tokens: a.tokens,
                rows: a.rows,
                x: a.x,
                hidden: c.hidden_size,
                vocab: c.vocab_size,
                n,
            })?;
        }
        if c.features.embedding_scale != 1.0 {
            d.scale_f32(ScaleF32 {
                x: a.x,
                s: c.features.embedding_scale,
                len: n * c.hidden_size,
            })?;
        }
        // Decode rows whose input is a coordinate or a size (Moondream).
        self.spatial_inputs(a)?;
        Ok(())
    }

    /// The blocks and the final norm over `a.x` ([`DeviceModel::forward_embed`]'s rows).
    pub fn forward_blocks(&self, a: &FwdArgs) -> Result<(), CudaError> {
        let c = &self.cfg;
        let d = &self.d;
        let hd = c.head_dim;
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let stride = qd + 2 * kvd;
        let n = a.n;
        let layer_elems = (self.trash_page as usize + 1) * self.page_size * kvd;
        let h = c.hidden_size;
        let parallel = c.features.parallel_block;
        for (l, lw) in self.layers.iter().enumerate() {
            let delta = if l == 0 { 0 } else { a.delta };
            let mut need = lw.qkv.needs(n);
            // A parallel block's FFN reads the norm's f16 rows too.
            need.f16 |= parallel;
            let norm = (lw.attn_norm.ptr(), lw.attn_norm_bias.as_ref());
            self.norm_into(a.x, delta, norm, a.xn, n, need)?;
            self.matmul(a.qkv, &lw.qkv.parts, lw.qkv.out, a.xn, n)?;
            if let Some(bias) = &lw.bqkv {
                d.add_bias(AddBias {
                    y: a.qkv,
                    b: bias.ptr(),
                    stride,
                    d: stride,
                    n,
                })?;
            }
            let k_cache = self.k_cache.at::<f16>(l * layer_elems);
            let v_cache = self.v_cache.at::<f16>(l * layer_elems);
            d.rope_kv_append(RopeKvAppend {
                qkv: a.qkv,
                stride,
                num_q_heads: c.num_heads,
                num_k_heads: c.num_kv_heads,
                head_dim: hd,
                rotary_dim: self.rotary_dim,
                table: self.ropes[lw.rope].ptr(),
                pos: a.positions,
                // Partial rotary is half-split (kestrel-cpu's `rope_partial`).
                interleaved: c.rope_style == RopeStyle::Interleaved && self.rotary_dim == hd,
                q_norm: lw.qk_norm.as_ref().map_or(0, |(q, _)| q.ptr()),
                k_norm: lw.qk_norm.as_ref().map_or(0, |(_, k)| k.ptr()),
                eps: c.rms_norm_eps,
                k_cache,
                v_cache,
                slot_mapping: a.slot_mapping,
                n,
            })?;
            let attn = PagedAttention {
                qkv: a.qkv,
                stride,
                out: a.attn,
                k_cache,
                v_cache,
                row_seq: a.row_seq,
                row_pos: if a.mask_pos != 0 {
                    a.mask_pos
                } else {
                    a.positions
                },
                kv_indptr: a.kv_indptr,
                kv_indices: a.kv_indices,
                num_heads: c.num_heads,
                num_kv_heads: c.num_kv_heads,
                head_dim: hd,
                page_size: self.page_size,
                scale: c.attn_scale(),
                window: lw.window,
                n,
                max_splits: self.attn_splits,
                part: self.attn_part.ptr(),
            };
            if a.tiled_attention {
                d.prefill_attention(PrefillAttention { attn })?;
            } else {
                d.paged_attention(attn)?;
            }
            if lw.wo.needs(n).q8 {
                self.quantize_q8(a.attn, lw.wo.inp, n)?;
            }
            self.matmul(a.delta, &lw.wo.parts, lw.wo.out, a.attn, n)?;
            self.bias(a.delta, lw.bo.as_ref(), h, n)?;
            self.post_norm(a.delta, lw.post_attn_norm.as_ref(), n)?;
            let need = lw.gate_up.needs(n);
            match &lw.ffn_norm {
                Some(ffn_norm) => {
                    self.norm_into(a.x, a.delta, (ffn_norm.ptr(), None), a.xn, n, need)?
                }
                None => {
                    // Parallel: x += attn now; the FFN reads the attention
                    // norm's rows, still in `xn`.
                    d.add_f32(AddF32 {
                        x: a.x,
                        y: a.delta,
                        len: n * h,
                    })?;
                    if need.q8 {
                        self.quantize_q8(a.xn, h, n)?;
                    }
                }
            }
            self.matmul(a.gate_up, &lw.gate_up.parts, lw.gate_up.out, a.xn, n)?;
            if lw.gate_up.parts.len() == 1 && lw.gate_up.out == c.intermediate_size {
                // Ungated (Phi's fc1): gelu_tanh(up x + b_up).
                d.bias_gelu(BiasGelu {
                    y: a.gate_up,
                    b: lw.b_up.as_ref().map_or(0, |b| b.ptr()),
                    out: a.act,
                    f: c.intermediate_size,
                    n,
                })?;
                if lw.down.needs(n).q8 {
                    self.quantize_q8(a.act, c.intermediate_size, n)?;
                }
            } else {
                self.act_mul(a.gate_up, a.act, lw.down.needs(n), n)?;
            }
            self.matmul(a.delta, &lw.down.parts, lw.down.out, a.act, n)?;
            self.bias(a.delta, lw.b_down.as_ref(), h, n)?;
            self.post_norm(a.delta, lw.post_ffn_norm.as_ref(), n)?;
        }
        match &self.output_norm_bias {
            Some(b) => d.add_layer_norm(AddLayerNorm {
                x: a.x,
                delta: a.delta,
                w: self.output_norm.ptr(),
                b: b.ptr(),
                out: a.hidden_last,
                out_row: a.out_row,
                hidden: h,
                eps: c.rms_norm_eps,
                n,
            }),
            None => self.add_rms_norm(
                a.x,
                a.delta,
                self.output_norm.ptr(),
                a.hidden_last,
                a.out_row,
                n,
            ),
        }
    }

    /// `y[i] += b` for `n` rows of `d` (a projection's bias), if any.
    fn bias(&self, y: u64, b: Option<&D::Buf>, d: usize, n: usize) -> Result<(), CudaError> {
        let Some(b) = b else { return Ok(()) };
        self.d.add_bias(AddBias {
            y,
            b: b.ptr(),
            stride: d,
            d,
            n,
        })
    }

    /// `act(gate) * up` of `n` rows into what `need` asks for: f16 rows in
    /// `act`, int8 blocks in `self.xq` (fused when only they are needed);
    /// SiLU, or GELU-tanh for Gemma.
    fn act_mul(&self, gate_up: u64, act: u64, need: Needs, n: usize) -> Result<(), CudaError> {
        let (d, f) = (&self.d, self.cfg.intermediate_size);
        let gelu = self.cfg.features.activation == Activation::GeluTanh;
        if need.f16 || !need.q8 {
            if gelu {
                d.gelu_mul(GeluMul {
                    gate_up,
                    out: act,
                    f,
                    n,
                })?;
            } else {
                d.swiglu(Swiglu {
                    gate_up,
                    out: act,
                    f,
                    n,
                })?;
            }
            if need.q8 {
                self.quantize_q8(act, f, n)?;
            }
            return Ok(());
        }
        let xq = self.xq.ptr();
        if gelu {
            d.gelu_mul_q8(GeluMulQ8 { gate_up, xq, f, n })
        } else {
            d.swiglu_q8(SwigluQ8 { gate_up, xq, f, n })
        }
    }

    /// A sublayer's output `delta` normed in place by its post-norm (Gemma),
    /// before the next `add_rms_norm` adds it to the residual stream.
    fn post_norm(&self, delta: u64, w: Option<&D::Buf>, n: usize) -> Result<(), CudaError> {
        let Some(w) = w else { return Ok(()) };
        self.d.rms_norm_f32(RmsNormF32 {
            x: delta,
            w: w.ptr(),
            hidden: self.cfg.hidden_size,
            eps: self.cfg.rms_norm_eps,
            n,
        })
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
        let parts = match &self.lm_head {
            Some(p) => &p.parts[..],
            None => std::slice::from_ref(&self.embd),
        };
        if needs(parts, n).q8 {
            self.quantize_q8(hidden_last, self.cfg.hidden_size, n)?;
        }
        self.matmul(logits, parts, self.cfg.vocab_size, hidden_last, n)?;
        self.bias(logits, self.lm_head_bias.as_ref(), self.cfg.vocab_size, n)?;
        if let Some(cap) = self.cfg.features.final_logit_softcap {
            self.d.softcap(Softcap {
                x: logits,
                cap,
                len: n * self.cfg.vocab_size,
            })?;
        }
        Ok(())
    }

    /// The penalty counts of the sequences a prefill admits (`rows[..n]`):
    /// zeroed, then counting each one's generated tokens
    /// (`tokens[indptr[i]..indptr[i + 1]]`, `counted` in all: a re-admission).
    pub fn admit_counts(
        &self,
        rows: u64,
        indptr: u64,
        tokens: u64,
        (n, counted): (usize, usize),
    ) -> Result<(), CudaError> {
        self.reset_counts(rows, n)?;
        if counted == 0 {
            return Ok(());
        }
        self.d.count_tokens(CountTokens {
            counts: self.counts.ptr(),
            rows,
            indptr,
            tokens,
            vocab: self.cfg.vocab_size,
            n,
        })
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
}
