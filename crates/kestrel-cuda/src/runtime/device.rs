//! The model on the device: weights in their file's encoding
//! (`crate::quant`'s upload plan), the paged KV cache, the loaded kernels and
//! cuBLAS, and the launch sequence of one forward (embed -> per layer:
//! add+RMSNorm -> QKV matmul -> bias -> RoPE + KV append -> paged attention
//! -> O matmul -> add+RMSNorm -> gate|up matmul -> SwiGLU -> down matmul;
//! final add+RMSNorm -> LM head) and of sampling. A matmul of up to
//! `MMVQ_CROSSOVER_ROWS` rows on a quantized weight runs `mmvq_*` on int8
//! activations (quantized fused into the norm / SwiGLU that produces them);
//! larger ones dequantize the weight tile by tile to f16 for cuBLAS.
//!
//! Every launch goes to the one compute stream (I1). Launches take raw
//! addresses, so the same code runs eagerly and under CUDA-graph capture;
//! the int8 activations and the f16 tile are model-wide scratch, which one
//! stream makes safe for every slot's graphs.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};
use half::f16;
use kestrel_model::{ModelConfig, ModelWeights, RopeStyle};

use super::mem::DevBuf;
use crate::compile::CompiledKernel;
use crate::host::{rope_table, stack_bias};
use crate::kernels::{ATTENTION_THREADS, MAX_HEAD_DIM, MMVQ_MAX_ROWS, MMVQ_WARPS, SAMPLE_THREADS};
use crate::quant::{
    layer_projections, matmul_path, mmvq_kernel, part_bytes, plan_parts, type_code, MatmulPath,
    Q8Block, BLOCK, MMVQ_CROSSOVER_ROWS, TILE_ELEMS,
};
use crate::reference::NORM_THREADS;
use crate::CudaError;

/// cuBLAS workspace, set explicitly so GEMMs can be captured in graphs.
const CUBLAS_WORKSPACE: usize = 32 << 20;

/// One device matrix of a projection, in its file's encoding: `rows`
/// output columns from `out_offset` (see `quant::PartPlan`).
struct Part {
    dtype: kestrel_model::DType,
    rows: usize,
    cols: usize,
    out_offset: usize,
    w: DevBuf,
}

/// Matrices sharing one input and writing one output row of `out` values.
struct Proj {
    parts: Vec<Part>,
    out: usize,
    inp: usize,
}

impl Proj {
    fn upload(
        ctx: &Arc<CudaContext>,
        what: &str,
        mats: &[&kestrel_model::Matrix],
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
                w: DevBuf::from_slice(ctx, &data)?,
            });
        }
        Ok(Proj {
            out: mats.iter().map(|m| m.rows).sum(),
            inp: mats[0].cols,
            parts,
        })
    }

    fn needs(&self, n: usize) -> Needs {
        needs(&self.parts, n)
    }
}

/// The activations a matmul of `n` rows on `parts` reads.
fn needs(parts: &[Part], n: usize) -> Needs {
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
struct Needs {
    f16: bool,
    q8: bool,
}

struct Layer {
    attn_norm: DevBuf,
    ffn_norm: DevBuf,
    qkv: Proj,
    bqkv: Option<DevBuf>,
    wo: Proj,
    gate_up: Proj,
    down: Proj,
}

/// The loaded kernels, by entry point.
pub(crate) struct Kernels {
    _modules: Vec<Arc<CudaModule>>,
    f: HashMap<&'static str, CudaFunction>,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>, compiled: &[CompiledKernel]) -> Result<Self, CudaError> {
        let mut modules = Vec::new();
        let mut f = HashMap::new();
        for k in compiled {
            let m = ctx.load_module(cudarc::nvrtc::Ptx::from_src(k.ptx.clone()))?;
            for name in k.source.functions {
                f.insert(*name, m.load_function(name)?);
            }
            modules.push(m);
        }
        Ok(Kernels {
            _modules: modules,
            f,
        })
    }

    fn get(&self, name: &'static str) -> &CudaFunction {
        // Every name used below is registered in `kernels::SOURCES`, and
        // `load` loaded all of them (a missing one failed at start).
        &self.f[name]
    }
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

/// Weights, KV cache, kernels and cuBLAS on one device.
pub(crate) struct DeviceModel {
    pub cfg: ModelConfig,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    kernels: Kernels,
    blas: CudaBlas,
    _blas_ws: DevBuf,
    embd: Part,
    lm_head: Option<Proj>,
    /// Int8 activations of up to `MMVQ_CROSSOVER_ROWS` rows (the widest input).
    xq: DevBuf,
    /// The f16 tile non-f16 weights are dequantized into for cuBLAS.
    tile: DevBuf,
    output_norm: DevBuf,
    layers: Vec<Layer>,
    rope: DevBuf,
    pub k_cache: DevBuf,
    pub v_cache: DevBuf,
    /// Generated-token counts per KV row (penalties), `[rows][vocab]`.
    pub counts: DevBuf,
    /// Each KV row's next input token (written by sampling).
    pub pending: DevBuf,
    pub page_size: usize,
    /// The page past the pool that padding rows write to.
    pub trash_page: u32,
    pub weight_bytes: usize,
}

fn launch_cfg(grid: (u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl DeviceModel {
    /// Check the shape, upload the weights as f16 and allocate the KV cache
    /// (`num_pages + 1` pages: the last is the trash page) and row state.
    pub fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        compiled: &[CompiledKernel],
        w: &ModelWeights,
        geo: KvGeometry,
    ) -> Result<Self, CudaError> {
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
        let kernels = Kernels::load(ctx, compiled)?;
        let blas = CudaBlas::new(Arc::clone(stream))?;
        let blas_ws = DevBuf::new(ctx, CUBLAS_WORKSPACE)?;
        // SAFETY: the handle is live and the workspace outlives it: both end
        // up in `DeviceModel`, where `blas` is declared (so dropped) first.
        unsafe {
            blas_sys::cublasSetWorkspace_v2(
                *blas.handle(),
                blas_ws.ptr as *mut std::ffi::c_void,
                CUBLAS_WORKSPACE,
            )
        }
        .result()?;
        let mut weight_bytes = 0usize;
        let embd = {
            let mut p = Proj::upload(ctx, "token_embd", &[&w.token_embd], &mut weight_bytes)?;
            p.parts.pop().expect("one matrix, one part")
        };
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(Proj::upload(
                ctx,
                "lm_head",
                &[&w.lm_head],
                &mut weight_bytes,
            )?)
        };
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in &w.layers {
            let bqkv = if l.bq.is_some() || l.bk.is_some() || l.bv.is_some() {
                Some(DevBuf::from_slice(
                    ctx,
                    &stack_bias(&[
                        (l.bq.as_ref(), qd),
                        (l.bk.as_ref(), kvd),
                        (l.bv.as_ref(), kvd),
                    ]),
                )?)
            } else {
                None
            };
            let [qkv, wo, gate_up, down] = layer_projections(l);
            let what = format!("layer {}", layers.len());
            let mut up =
                |mats: &[&kestrel_model::Matrix]| Proj::upload(ctx, &what, mats, &mut weight_bytes);
            layers.push(Layer {
                attn_norm: DevBuf::from_slice(ctx, &l.attn_norm)?,
                ffn_norm: DevBuf::from_slice(ctx, &l.ffn_norm)?,
                qkv: up(&qkv)?,
                bqkv,
                wo: up(&wo)?,
                gate_up: up(&gate_up)?,
                down: up(&down)?,
            });
        }
        let widest = c.hidden_size.max(qd).max(c.intermediate_size);
        let xq = DevBuf::new(
            ctx,
            MMVQ_CROSSOVER_ROWS * widest.div_ceil(BLOCK) * std::mem::size_of::<Q8Block>(),
        )?;
        let any_tiled = layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.wo, &l.gate_up, &l.down])
            .chain(&lm_head)
            .flat_map(|p| &p.parts)
            .chain([&embd].into_iter().filter(|_| c.tie_word_embeddings))
            .any(|p| p.dtype != kestrel_model::DType::F16);
        let tile = DevBuf::new(ctx, if any_tiled { TILE_ELEMS * 2 } else { 0 })?;
        let output_norm = DevBuf::from_slice(ctx, &w.output_norm)?;
        let rope = DevBuf::from_slice(ctx, &rope_table(max_pos, c.head_dim, c.rope_theta))?;
        let kv_elems = c.num_layers * (num_pages + 1) * page_size * kvd;
        let k_cache = DevBuf::new(ctx, kv_elems * 2)?;
        let v_cache = DevBuf::new(ctx, kv_elems * 2)?;
        let counts = DevBuf::from_slice(ctx, &vec![0u32; kv_rows * c.vocab_size])?;
        let pending = DevBuf::from_slice(ctx, &vec![0u32; kv_rows])?;
        Ok(DeviceModel {
            cfg: c,
            ctx: Arc::clone(ctx),
            stream: Arc::clone(stream),
            kernels,
            blas,
            _blas_ws: blas_ws,
            embd,
            lm_head,
            xq,
            tile,
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
        })
    }

    /// `y[n, out] (f32, rows ldy apart) = x[n, inp] (f16) * W[out, inp]^T
    /// (f16)`, f32 accumulation.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        y: u64,
        ldy: usize,
        x: u64,
        w: u64,
        n: usize,
        out: usize,
        inp: usize,
    ) -> Result<(), CudaError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: `w` holds out*inp f16, `x` n*inp f16, `y` n rows of ldy >=
        // out f32 (the workspace is sized for the largest n); alpha/beta are
        // host scalars read during the call (pointer mode host) and captured
        // by value.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                out as i32,
                n as i32,
                inp as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                blas_sys::cudaDataType::CUDA_R_16F,
                inp as i32,
                x as *const _,
                blas_sys::cudaDataType::CUDA_R_16F,
                inp as i32,
                &beta as *const f32 as *const _,
                y as *mut _,
                blas_sys::cudaDataType::CUDA_R_32F,
                ldy as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }

    /// `y[n, out] = x[n, inp] * W^T` over `parts` (each writing its output
    /// columns of rows `out` apart), each on its `matmul_path`: `mmvq_*` on
    /// `self.xq` (written by the caller when `needs(..).q8`), cuBLAS on the
    /// f16 rows `x16` and the f16 weight or its dequantized tiles.
    fn matmul(
        &self,
        y: u64,
        parts: &[Part],
        out: usize,
        x16: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        for part in parts {
            let yp = y + (part.out_offset * 4) as u64;
            match matmul_path(part.dtype, n) {
                MatmulPath::Mmvq => self.mmvq(yp, out, part, n)?,
                MatmulPath::GemmF16 => {
                    self.gemm(yp, out, x16, part.w.ptr, n, part.rows, part.cols)?
                }
                MatmulPath::DequantTiles => {
                    let tile_rows = (TILE_ELEMS / part.cols).max(1);
                    for r0 in (0..part.rows).step_by(tile_rows) {
                        let nr = tile_rows.min(part.rows - r0);
                        self.dequant_tile(part, r0, nr)?;
                        let yt = yp + (r0 * 4) as u64;
                        self.gemm(yt, out, x16, self.tile.ptr, n, nr, part.cols)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// `mmvq_*` over `n` rows of `self.xq`, `MMVQ_MAX_ROWS` rows a launch.
    fn mmvq(&self, y: u64, ldy: usize, part: &Part, n: usize) -> Result<(), CudaError> {
        let name = mmvq_kernel(part.dtype)
            .ok_or_else(|| CudaError::Unsupported(format!("no mmvq kernel for {}", part.dtype)))?;
        let (rows, cols, ldy_i) = (part.rows as i32, part.cols as i32, ldy as i32);
        let grid = part.rows.div_ceil(MMVQ_WARPS as usize) as u32;
        let row_blocks = part.cols / BLOCK * std::mem::size_of::<Q8Block>();
        for r0 in (0..n).step_by(MMVQ_MAX_ROWS) {
            let n_i = MMVQ_MAX_ROWS.min(n - r0) as i32;
            let xq = self.xq.ptr + (r0 * row_blocks) as u64;
            let yr = y + (r0 * ldy * 4) as u64;
            let mut b = self.stream.launch_builder(self.kernels.get(name));
            b.arg(&part.w.ptr).arg(&xq).arg(&yr);
            b.arg(&rows).arg(&cols).arg(&ldy_i).arg(&n_i);
            // SAFETY: matches `mmvq_*`; the weight holds `rows` encoded rows
            // of `cols`; `xq` from row r0 holds n_i <= MMVQ_MAX_ROWS rows of
            // cols / 32 blocks (n <= MMVQ_CROSSOVER_ROWS, its capacity, on
            // the Mmvq path), `y` from row r0 n_i rows of `ldy` floats from
            // the part's output offset.
            unsafe { b.launch(launch_cfg((grid, 1), MMVQ_WARPS * 32)) }?;
        }
        Ok(())
    }

    /// Rows `row0..row0 + nrows` of `part` to f16 in `self.tile`.
    fn dequant_tile(&self, part: &Part, row0: usize, nrows: usize) -> Result<(), CudaError> {
        let t = type_code(part.dtype);
        let (r0, nr, cols) = (row0 as i32, nrows as i32, part.cols as i32);
        let mut b = self.stream.launch_builder(self.kernels.get("dequant_f16"));
        b.arg(&part.w.ptr)
            .arg(&t)
            .arg(&r0)
            .arg(&nr)
            .arg(&cols)
            .arg(&self.tile.ptr);
        let blocks = (nrows * part.cols).div_ceil(256).min(65535) as u32;
        // SAFETY: matches `dequant_f16` (grid-stride); rows row0..row0+nrows
        // exist in the weight and nrows * cols <= TILE_ELEMS fit the tile,
        // which is allocated whenever a part is not f16.
        unsafe { b.launch(launch_cfg((blocks.max(1), 1), 256)) }?;
        Ok(())
    }

    /// f16 rows `x` (`cols` wide) to int8 blocks in `self.xq`.
    fn quantize_q8(&self, x: u64, cols: usize, n: usize) -> Result<(), CudaError> {
        let (cols_i, n_i) = (cols as i32, n as i32);
        let mut b = self
            .stream
            .launch_builder(self.kernels.get("quantize_q8_h"));
        b.arg(&x).arg(&self.xq.ptr).arg(&cols_i).arg(&n_i);
        let grid = (cols / BLOCK).div_ceil(8) as u32;
        // SAFETY: matches `quantize_q8_h` (8 warps, one block each); x holds
        // n rows of cols f16 and xq n <= MMVQ_CROSSOVER_ROWS rows of cols / 32.
        unsafe { b.launch(launch_cfg((grid, n as u32), 256)) }?;
        Ok(())
    }

    /// add + RMSNorm of `n` rows into what `need` asks for: f16 rows in
    /// `out`, int8 blocks in `self.xq` (fused when only they are needed).
    fn norm_into(
        &self,
        x: u64,
        delta: u64,
        w: u64,
        out: u64,
        n: usize,
        need: Needs,
    ) -> Result<(), CudaError> {
        let n_i = n as i32;
        if need.f16 || !need.q8 {
            self.add_rms_norm(x, delta, w, out, 0, n_i)?;
            if need.q8 {
                self.quantize_q8(out, self.cfg.hidden_size, n)?;
            }
            return Ok(());
        }
        let h = self.cfg.hidden_size as i32;
        let eps = self.cfg.rms_norm_eps;
        let null = 0u64;
        let mut b = self
            .stream
            .launch_builder(self.kernels.get("add_rms_norm_q8"));
        b.arg(&x).arg(&delta).arg(&w).arg(&self.xq.ptr).arg(&null);
        b.arg(&h).arg(&eps).arg(&n_i);
        // SAFETY: matches `add_rms_norm_q8`; x/delta hold n rows of hidden
        // (a multiple of 32: the consumer is quantized), xq n <=
        // MMVQ_CROSSOVER_ROWS rows of hidden / 32 blocks; NORM_THREADS is a
        // multiple of 32.
        unsafe { b.launch(launch_cfg((n as u32, 1), NORM_THREADS as u32)) }?;
        Ok(())
    }

    /// Embedding through the final norm for `a.n` rows (no LM head).
    pub fn forward_layers(&self, a: &FwdArgs) -> Result<(), CudaError> {
        let c = &self.cfg;
        let s = &self.stream;
        let k = &self.kernels;
        let (h, f, hd) = (c.hidden_size as i32, c.intermediate_size, c.head_dim);
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let stride = (qd + 2 * kvd) as i32;
        let n = a.n as i32;
        let rows = a.n as u32;
        let vocab = c.vocab_size as i32;
        let null = 0u64;
        let embd = self.embd.w.ptr;
        if self.embd.dtype == kestrel_model::DType::F16 {
            let mut b = s.launch_builder(k.get("embed_gather"));
            b.arg(&embd).arg(&a.tokens).arg(&a.rows).arg(&a.x);
            b.arg(&h).arg(&vocab).arg(&n);
            // SAFETY: argument types and order match `embed_gather`; every
            // pointer addresses a live buffer sized for `n` rows.
            unsafe { b.launch(launch_cfg((rows, 1), 256)) }?;
        } else {
            let t = type_code(self.embd.dtype);
            let mut b = s.launch_builder(k.get("embed_gather_q"));
            b.arg(&embd).arg(&t).arg(&a.tokens).arg(&a.rows).arg(&a.x);
            b.arg(&h).arg(&vocab).arg(&n);
            // SAFETY: matches `embed_gather_q`; the table holds vocab rows
            // of hidden in type t (validated by the upload plan), x n rows.
            unsafe { b.launch(launch_cfg((rows, 1), 256)) }?;
        }
        let layer_elems = (self.trash_page as usize + 1) * self.page_size * kvd;
        let interleaved = i32::from(c.rope_style == RopeStyle::Interleaved);
        let (nq, nk, hd_i) = (c.num_heads as i32, c.num_kv_heads as i32, hd as i32);
        let ps = self.page_size as i32;
        let scale = 1.0f32 / (hd as f32).sqrt();
        for (l, lw) in self.layers.iter().enumerate() {
            let delta = if l == 0 { null } else { a.delta };
            let need = lw.qkv.needs(a.n);
            self.norm_into(a.x, delta, lw.attn_norm.ptr, a.xn, a.n, need)?;
            self.matmul(a.qkv, &lw.qkv.parts, lw.qkv.out, a.xn, a.n)?;
            if let Some(bias) = &lw.bqkv {
                let mut b = s.launch_builder(k.get("add_bias"));
                let d = stride;
                b.arg(&a.qkv).arg(&bias.ptr).arg(&stride).arg(&d).arg(&n);
                // SAFETY: matches `add_bias`; the bias holds `stride` floats.
                unsafe { b.launch(launch_cfg((rows, 1), 256)) }?;
            }
            let kc = self.k_cache.at::<f16>(l * layer_elems);
            let vc = self.v_cache.at::<f16>(l * layer_elems);
            let mut b = s.launch_builder(k.get("rope_kv_append"));
            b.arg(&a.qkv).arg(&stride).arg(&nq).arg(&nk).arg(&hd_i);
            b.arg(&self.rope.ptr).arg(&a.positions).arg(&interleaved);
            b.arg(&kc).arg(&vc).arg(&a.slot_mapping).arg(&n);
            // SAFETY: matches `rope_kv_append`; the table covers every
            // position the runtime admits (max_seq_len rows); slot_mapping
            // entries are below (num_pages + 1) * page_size, the layer's
            // extent; qkv rows hold Q | K | V (stride = q_dim + 2 kv_dim).
            unsafe { b.launch(launch_cfg((rows, 1), 128)) }?;
            let mut b = s.launch_builder(k.get("paged_attention"));
            b.arg(&a.qkv).arg(&stride).arg(&a.attn).arg(&kc).arg(&vc);
            b.arg(&a.row_seq)
                .arg(&a.positions)
                .arg(&a.kv_indptr)
                .arg(&a.kv_indices);
            b.arg(&nq).arg(&nk).arg(&hd_i).arg(&ps).arg(&scale).arg(&n);
            // SAFETY: matches `paged_attention`; head_dim <= 256 and 4 warps
            // fit its shared arrays; indices come from the page table.
            unsafe { b.launch(launch_cfg((c.num_heads as u32, rows), ATTENTION_THREADS)) }?;
            if lw.wo.needs(a.n).q8 {
                self.quantize_q8(a.attn, lw.wo.inp, a.n)?;
            }
            self.matmul(a.delta, &lw.wo.parts, lw.wo.out, a.attn, a.n)?;
            let need = lw.gate_up.needs(a.n);
            self.norm_into(a.x, a.delta, lw.ffn_norm.ptr, a.xn, a.n, need)?;
            self.matmul(a.gate_up, &lw.gate_up.parts, lw.gate_up.out, a.xn, a.n)?;
            let need = lw.down.needs(a.n);
            let f_i = f as i32;
            if need.f16 || !need.q8 {
                let mut b = s.launch_builder(k.get("swiglu"));
                b.arg(&a.gate_up).arg(&a.act).arg(&f_i).arg(&n);
                let blocks = ((a.n * f).div_ceil(256)).min(65535) as u32;
                // SAFETY: matches `swiglu` (grid-stride loop over n*f).
                unsafe { b.launch(launch_cfg((blocks.max(1), 1), 256)) }?;
                if need.q8 {
                    self.quantize_q8(a.act, f, a.n)?;
                }
            } else {
                let mut b = s.launch_builder(k.get("swiglu_q8"));
                b.arg(&a.gate_up).arg(&self.xq.ptr).arg(&f_i).arg(&n);
                let grid = (f / BLOCK).div_ceil(8) as u32;
                // SAFETY: matches `swiglu_q8` (8 warps, one block each); f
                // is a multiple of 32 (the down projection is quantized) and
                // xq holds n <= MMVQ_CROSSOVER_ROWS rows of f / 32 blocks.
                unsafe { b.launch(launch_cfg((grid, rows), 256)) }?;
            }
            self.matmul(a.delta, &lw.down.parts, lw.down.out, a.act, a.n)?;
        }
        self.add_rms_norm(
            a.x,
            a.delta,
            self.output_norm.ptr,
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
        n: i32,
    ) -> Result<(), CudaError> {
        let h = self.cfg.hidden_size as i32;
        let eps = self.cfg.rms_norm_eps;
        let mut b = self.stream.launch_builder(self.kernels.get("add_rms_norm"));
        b.arg(&x).arg(&delta).arg(&w).arg(&out).arg(&out_row);
        b.arg(&h).arg(&eps).arg(&n);
        // SAFETY: matches `add_rms_norm`; x/delta/out hold n rows of hidden.
        unsafe { b.launch(launch_cfg((n as u32, 1), NORM_THREADS as u32)) }?;
        Ok(())
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
        self.matmul(logits, parts, self.cfg.vocab_size, hidden_last, n)
    }

    /// Zero the penalty counts of the KV rows in `rows[..n]` (new sequences).
    pub fn reset_counts(&self, rows: u64, n: usize) -> Result<(), CudaError> {
        let (vocab, n_i) = (self.cfg.vocab_size as i32, n as i32);
        let mut b = self.stream.launch_builder(self.kernels.get("reset_counts"));
        b.arg(&self.counts.ptr).arg(&rows).arg(&vocab).arg(&n_i);
        // SAFETY: matches `reset_counts`; rows are KV rows < counts' rows.
        unsafe { b.launch(launch_cfg((n as u32, 1), 256)) }?;
        Ok(())
    }

    /// Sample `a.n` rows (see `kernels/sample.cu`).
    pub fn sample(&self, a: &SampleArgs) -> Result<(), CudaError> {
        let vocab = self.cfg.vocab_size as i32;
        let (wpr, top_n, n) = (a.words_per_row as i32, a.top_n as i32, a.n as i32);
        let mut b = self.stream.launch_builder(self.kernels.get("sample_rows"));
        b.arg(&a.logits)
            .arg(&vocab)
            .arg(&a.mask_words)
            .arg(&a.mask_flags)
            .arg(&wpr);
        b.arg(&a.params).arg(&a.rows).arg(&a.positions);
        b.arg(&self.counts.ptr).arg(&self.pending.ptr);
        b.arg(&a.out_tokens)
            .arg(&a.out_logprobs)
            .arg(&a.out_top_ids)
            .arg(&a.out_top_lps);
        b.arg(&top_n).arg(&n);
        // SAFETY: matches `sample_rows`; its block size is SAMPLE_THREADS
        // (the scan buffer's size); outputs hold n rows (top_n wide).
        unsafe { b.launch(launch_cfg((a.n as u32, 1), SAMPLE_THREADS)) }?;
        Ok(())
    }

    pub fn sync(&self) -> Result<(), CudaError> {
        self.stream.synchronize()?;
        Ok(())
    }
}
