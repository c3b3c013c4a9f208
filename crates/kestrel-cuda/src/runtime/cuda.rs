//! [`CudaDevice`]: the [`Device`] on an NVIDIA GPU through cudarc: one
//! compute stream (I1) for every kernel, GEMM (cuBLAS, workspace set so it
//! can be captured) and H2D copy; one copy stream for the D2H copies into
//! the render buffers; NVRTC-compiled kernels launched with raw addresses,
//! so the same launches run eagerly and under CUDA-graph capture.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaStream,
    LaunchConfig, PushKernelArg,
};

use super::backend::{
    AcceptDrafts, AddBias, AddRmsNorm, AddRmsNormQ8, CountTokens, DequantF16, Device, DraftCounts,
    EmbedGather, EmbedGatherQ, GeluMul, GeluMulQ8, Gemm, Mmvq, PagedAttention, Plain,
    PrefillAttention, QuantizeQ8H, ResetCounts, RmsNormF32, RopeKvAppend, SampleRows, ScaleF32,
    Softcap, Stream, Swiglu, SwigluQ8, VerifyInputs,
};
use super::backend::{
    AcceptValues, AddF32, AddLayerNorm, BiasGelu, FourierFeatures, HiddenF16, SpatialEmbed,
    SpatialValues,
};
use super::mem::{DevBuf, HostBuf};
use super::timing::DeviceClock;
use crate::compile::CompiledKernel;
use crate::kernels::{
    ATTENTION_HEADS_PER_BLOCK, ATTENTION_THREADS, MMVQ_MAX_ROWS, MMVQ_WARPS, PREFILL_Q_ROWS,
    PREFILL_THREADS, SAMPLE_THREADS, SPATIAL_THREADS,
};
use crate::quant::{mmvq_kernel, type_code, BLOCK};
use crate::reference::NORM_THREADS;
use crate::CudaError;

/// cuBLAS workspace, set explicitly so GEMMs can be captured in graphs.
const CUBLAS_WORKSPACE: usize = 32 << 20;

/// The loaded kernels, by entry point.
struct Kernels {
    _modules: Vec<Arc<CudaModule>>,
    f: HashMap<&'static str, CudaFunction>,
}

impl Kernels {
    fn load(ctx: &Arc<CudaContext>, compiled: &[CompiledKernel]) -> Result<Self, CudaError> {
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

/// A captured forward. `CudaGraph` is not `Send`; see the impl below.
pub struct Graph(CudaGraph);

// SAFETY: a graph exec is a driver handle usable from any thread with its
// context bound; the runtime owning it is used by one thread at a time.
unsafe impl Send for Graph {}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Graph")
    }
}

/// One GPU: context, streams, kernels, cuBLAS and the event clock.
pub struct CudaDevice {
    pub ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    copy_stream: Arc<CudaStream>,
    kernels: Kernels,
    // Declared before its workspace so the handle is destroyed first.
    blas: CudaBlas,
    _blas_ws: DevBuf,
    /// Created by the first `anchor_clock`.
    clock: Option<DeviceClock>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ctx.ordinal())
            .finish_non_exhaustive()
    }
}

fn launch_cfg(grid: (u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn i(v: usize) -> i32 {
    // Every dimension passed to a kernel is a model or batch size far below
    // i32::MAX (checked at load), as the kernels' `int` parameters need.
    v as i32
}

impl CudaDevice {
    /// Load `compiled` into `ctx`, create both streams and cuBLAS.
    pub fn new(ctx: &Arc<CudaContext>, compiled: &[CompiledKernel]) -> Result<Self, CudaError> {
        let stream = ctx.new_stream()?;
        let copy_stream = ctx.new_stream()?;
        let kernels = Kernels::load(ctx, compiled)?;
        let blas = CudaBlas::new(Arc::clone(&stream))?;
        let blas_ws = DevBuf::new(ctx, CUBLAS_WORKSPACE)?;
        // SAFETY: the handle is live and the workspace outlives it: both end
        // up in `CudaDevice`, where `blas` is declared (so dropped) first.
        unsafe {
            blas_sys::cublasSetWorkspace_v2(
                *blas.handle(),
                blas_ws.ptr as *mut std::ffi::c_void,
                CUBLAS_WORKSPACE,
            )
        }
        .result()?;
        Ok(CudaDevice {
            ctx: Arc::clone(ctx),
            stream,
            copy_stream,
            kernels,
            blas,
            _blas_ws: blas_ws,
            clock: None,
        })
    }

    fn stream_of(&self, on: Stream) -> &Arc<CudaStream> {
        match on {
            Stream::Compute => &self.stream,
            Stream::Copy => &self.copy_stream,
        }
    }

    /// Launch `kernel` (`prefill_attention`, which takes
    /// [`PagedAttention`]'s arguments in this order but the decode pair's
    /// `max_splits` and `part`), with `cfg`.
    ///
    /// # Safety
    /// `cfg` must be the launch shape `kernel` is written for, and `a`'s
    /// buffers and metadata what it reads and writes.
    unsafe fn attention(
        &self,
        kernel: &'static str,
        a: &PagedAttention,
        cfg: LaunchConfig,
    ) -> Result<(), CudaError> {
        let (stride, window, n) = (i(a.stride), i(a.window), i(a.n));
        let (nq, nk, hd, ps) = (
            i(a.num_heads),
            i(a.num_kv_heads),
            i(a.head_dim),
            i(a.page_size),
        );
        let mut b = self.stream.launch_builder(self.kernels.get(kernel));
        b.arg(&a.qkv)
            .arg(&stride)
            .arg(&a.out)
            .arg(&a.k_cache)
            .arg(&a.v_cache);
        b.arg(&a.row_seq)
            .arg(&a.row_pos)
            .arg(&a.kv_indptr)
            .arg(&a.kv_indices);
        b.arg(&nq).arg(&nk).arg(&hd).arg(&ps).arg(&a.scale);
        b.arg(&window).arg(&n);
        // SAFETY: forwarded contract (the arguments above are the kernel's,
        // in its order).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// A `gated_f16` kernel of `swiglu.cu` (`swiglu`, `gelu_mul`) over n
    /// rows of a fused gate|up output of width 2f, written as f16.
    fn gated_f16(
        &self,
        kernel: &'static str,
        (gate_up, out, f, n): (u64, u64, usize, usize),
    ) -> Result<(), CudaError> {
        let (fi, ni) = (i(f), i(n));
        let mut b = self.stream.launch_builder(self.kernels.get(kernel));
        b.arg(&gate_up).arg(&out).arg(&fi).arg(&ni);
        let blocks = ((n * f).div_ceil(256)).min(65535) as u32;
        // SAFETY: matches `gated_f16` (a grid-stride loop over n*f); the
        // caller's op names n rows of 2f floats in and n*f halves out.
        unsafe { b.launch(launch_cfg((blocks.max(1), 1), 256)) }?;
        Ok(())
    }

    /// A `gated_q8` kernel of `swiglu.cu` (`swiglu_q8`, `gelu_mul_q8`): the
    /// same activation quantized into n rows of f / 32 int8 blocks.
    fn gated_q8(
        &self,
        kernel: &'static str,
        (gate_up, xq, f, n): (u64, u64, usize, usize),
    ) -> Result<(), CudaError> {
        let (fi, ni) = (i(f), i(n));
        let mut b = self.stream.launch_builder(self.kernels.get(kernel));
        b.arg(&gate_up).arg(&xq).arg(&fi).arg(&ni);
        let grid = (f / BLOCK).div_ceil(8) as u32;
        // SAFETY: matches `gated_q8` (8 warps, one block each); f is a
        // multiple of 32 (the down projection is quantized) and xq holds n
        // rows of f / 32 blocks.
        unsafe { b.launch(launch_cfg((grid, n as u32), 256)) }?;
        Ok(())
    }
}

impl Device for CudaDevice {
    type Buf = DevBuf;
    type Host<T: Plain> = HostBuf<T>;
    type Event = CudaEvent;
    type Graph = Graph;

    fn bind(&self) -> Result<(), CudaError> {
        Ok(self.ctx.bind_to_thread()?)
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<DevBuf, CudaError> {
        Ok(DevBuf::zeroed(&self.ctx, bytes, self.stream.cu_stream())?)
    }

    fn alloc(&self, bytes: usize) -> Result<DevBuf, CudaError> {
        Ok(DevBuf::new(&self.ctx, bytes)?)
    }

    fn upload<T: Copy>(&self, data: &[T]) -> Result<DevBuf, CudaError> {
        Ok(DevBuf::from_slice(&self.ctx, data)?)
    }

    fn host<T: Plain>(&self, len: usize) -> Result<HostBuf<T>, CudaError> {
        Ok(HostBuf::new(&self.ctx, len)?)
    }

    fn htod_sync<T: Plain>(&self, dst: u64, src: &[T]) -> Result<(), CudaError> {
        // On the compute stream, then waited for: ordered after every fill
        // and kernel enqueued before it (a synchronous `cuMemcpyHtoD` runs
        // on the legacy stream, which the compute stream does not wait for).
        // SAFETY: callers pass a destination of at least size_of_val(src)
        // bytes (a slot's metadata buffer); the stream is synchronized
        // before this returns, so `src` outlives the copy.
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }?;
        Ok(self.stream.synchronize()?)
    }

    unsafe fn htod<T: Plain>(&self, dst: u64, src: &[T]) -> Result<(), CudaError> {
        // SAFETY: the caller keeps `src` intact until the copy has run and
        // sized `dst` (this method's contract).
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }?;
        Ok(())
    }

    unsafe fn dtoh<T: Plain>(&self, dst: &mut [T], src: u64) -> Result<(), CudaError> {
        // SAFETY: the caller leaves `dst` alone until a later copy-stream
        // event completes and sized `src` (this method's contract).
        unsafe { result::memcpy_dtoh_async(dst, src, self.copy_stream.cu_stream()) }?;
        Ok(())
    }

    fn event(&self, timed: bool) -> Result<CudaEvent, CudaError> {
        // CU_EVENT_DEFAULT: timing enabled (cudarc's default disables it).
        let flags = timed.then_some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        Ok(self.ctx.new_event(flags)?)
    }

    fn record(&self, ev: &CudaEvent, on: Stream) -> Result<(), CudaError> {
        Ok(ev.record(self.stream_of(on))?)
    }

    fn copy_waits(&self, ev: &CudaEvent) -> Result<(), CudaError> {
        Ok(self.copy_stream.wait(ev)?)
    }

    fn event_sync(&self, ev: &CudaEvent) -> Result<(), CudaError> {
        Ok(ev.synchronize()?)
    }

    fn sync_compute(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    /// The whole context: both streams, and the legacy stream that the
    /// synchronous load-time copies from pageable memory run on.
    fn sync(&self) -> Result<(), CudaError> {
        Ok(self.ctx.synchronize()?)
    }

    fn begin_capture(&self) -> Result<(), CudaError> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        Ok(())
    }

    fn end_capture(&self) -> Result<Option<Graph>, CudaError> {
        let Some(g) = self.stream.end_capture(sys::CUgraphInstantiate_flags(0))? else {
            return Ok(None);
        };
        g.upload()?;
        Ok(Some(Graph(g)))
    }

    fn replay(&self, g: &Graph) -> Result<(), CudaError> {
        Ok(g.0.launch()?)
    }

    fn free_memory(&self) -> Result<usize, CudaError> {
        Ok(self.ctx.mem_get_info()?.0)
    }

    fn anchor_clock(&mut self) -> Result<(), CudaError> {
        match &mut self.clock {
            Some(c) => c.anchor(),
            None => {
                self.clock = Some(DeviceClock::new(&self.ctx)?);
                Ok(())
            }
        }
    }

    fn clock_stale(&self, now: Instant) -> bool {
        self.clock.as_ref().is_none_or(|c| c.stale(now))
    }

    fn instant(&self, ev: &CudaEvent) -> Result<Instant, CudaError> {
        self.clock
            .as_ref()
            .ok_or(CudaError::Config(
                "timed step without a device clock".to_owned(),
            ))?
            .instant(ev)
    }

    fn gemm(&self, a: Gemm) -> Result<(), CudaError> {
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
                i(a.out),
                i(a.n),
                i(a.inp),
                &alpha as *const f32 as *const _,
                a.w as *const _,
                blas_sys::cudaDataType::CUDA_R_16F,
                i(a.inp),
                a.x as *const _,
                blas_sys::cudaDataType::CUDA_R_16F,
                i(a.inp),
                &beta as *const f32 as *const _,
                a.y as *mut _,
                blas_sys::cudaDataType::CUDA_R_32F,
                i(a.ldy),
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }

    fn mmvq(&self, a: Mmvq) -> Result<(), CudaError> {
        if a.n > MMVQ_MAX_ROWS {
            return Err(CudaError::Unsupported(format!(
                "mmvq of {} rows (at most {MMVQ_MAX_ROWS} a launch)",
                a.n
            )));
        }
        let name = mmvq_kernel(a.dtype, a.n)
            .ok_or_else(|| CudaError::Unsupported(format!("no mmvq kernel for {}", a.dtype)))?;
        let (rows, cols, ldy, n) = (i(a.rows), i(a.cols), i(a.ldy), i(a.n));
        // One block per weight row.
        let grid = u32::try_from(a.rows)
            .map_err(|_| CudaError::Unsupported(format!("mmvq of {} weight rows", a.rows)))?;
        let mut b = self.stream.launch_builder(self.kernels.get(name));
        b.arg(&a.w).arg(&a.xq).arg(&a.y);
        b.arg(&rows).arg(&cols).arg(&ldy).arg(&n);
        // SAFETY: matches `mmvq_*`; the weight holds `rows` encoded rows of
        // `cols`; `xq` holds n <= MMVQ_MAX_ROWS rows of cols / 32 blocks,
        // `y` n rows of `ldy` floats from the part's output offset.
        unsafe { b.launch(launch_cfg((grid, 1), MMVQ_WARPS * 32)) }?;
        Ok(())
    }

    fn quantize_q8_h(&self, a: QuantizeQ8H) -> Result<(), CudaError> {
        let (cols, n) = (i(a.cols), i(a.n));
        let mut b = self
            .stream
            .launch_builder(self.kernels.get("quantize_q8_h"));
        b.arg(&a.x).arg(&a.xq).arg(&cols).arg(&n);
        let grid = (a.cols / BLOCK).div_ceil(8) as u32;
        // SAFETY: matches `quantize_q8_h` (8 warps, one block each); x holds
        // n rows of cols f16 and xq n rows of cols / 32 blocks.
        unsafe { b.launch(launch_cfg((grid, a.n as u32), 256)) }?;
        Ok(())
    }

    fn dequant_f16(&self, a: DequantF16) -> Result<(), CudaError> {
        let t = type_code(a.dtype);
        let (r0, nr, cols) = (i(a.row0), i(a.nrows), i(a.cols));
        let mut b = self.stream.launch_builder(self.kernels.get("dequant_f16"));
        b.arg(&a.w).arg(&t).arg(&r0).arg(&nr).arg(&cols).arg(&a.out);
        let blocks = (a.nrows * a.cols).div_ceil(256).min(65535) as u32;
        // SAFETY: matches `dequant_f16` (grid-stride); rows row0..row0+nrows
        // exist in the weight and `out` holds nrows * cols f16.
        unsafe { b.launch(launch_cfg((blocks.max(1), 1), 256)) }?;
        Ok(())
    }

    fn embed_gather(&self, a: EmbedGather) -> Result<(), CudaError> {
        let (h, vocab, n) = (i(a.hidden), i(a.vocab), i(a.n));
        let mut b = self.stream.launch_builder(self.kernels.get("embed_gather"));
        b.arg(&a.table).arg(&a.tokens).arg(&a.rows).arg(&a.x);
        b.arg(&h).arg(&vocab).arg(&n);
        // SAFETY: argument types and order match `embed_gather`; every
        // pointer addresses a live buffer sized for `n` rows.
        unsafe { b.launch(launch_cfg((a.n as u32, 1), 256)) }?;
        Ok(())
    }

    fn embed_gather_q(&self, a: EmbedGatherQ) -> Result<(), CudaError> {
        let t = type_code(a.dtype);
        let (h, vocab, n) = (i(a.hidden), i(a.vocab), i(a.n));
        let mut b = self
            .stream
            .launch_builder(self.kernels.get("embed_gather_q"));
        b.arg(&a.table)
            .arg(&t)
            .arg(&a.tokens)
            .arg(&a.rows)
            .arg(&a.x);
        b.arg(&h).arg(&vocab).arg(&n);
        // SAFETY: matches `embed_gather_q`; the table holds vocab rows of
        // hidden in type t (validated by the upload plan), x n rows.
        unsafe { b.launch(launch_cfg((a.n as u32, 1), 256)) }?;
        Ok(())
    }

    fn add_rms_norm(&self, a: AddRmsNorm) -> Result<(), CudaError> {
        let (h, n) = (i(a.hidden), i(a.n));
        let mut b = self.stream.launch_builder(self.kernels.get("add_rms_norm"));
        b.arg(&a.x)
            .arg(&a.delta)
            .arg(&a.w)
            .arg(&a.out)
            .arg(&a.out_row);
        b.arg(&h).arg(&a.eps).arg(&n);
        // SAFETY: matches `add_rms_norm`; x/delta/out hold n rows of hidden;
        // NORM_THREADS is a multiple of 32 (its block sum's warps).
        unsafe { b.launch(launch_cfg((a.n as u32, 1), NORM_THREADS as u32)) }?;
        Ok(())
    }

    fn add_rms_norm_q8(&self, a: AddRmsNormQ8) -> Result<(), CudaError> {
        let (h, n) = (i(a.hidden), i(a.n));
        let mut b = self
            .stream
            .launch_builder(self.kernels.get("add_rms_norm_q8"));
        b.arg(&a.x)
            .arg(&a.delta)
            .arg(&a.w)
            .arg(&a.xq)
            .arg(&a.out_row);
        b.arg(&h).arg(&a.eps).arg(&n);
        // SAFETY: matches `add_rms_norm_q8`; x/delta hold n rows of hidden
        // (a multiple of 32: the consumer is quantized), xq n rows of
        // hidden / 32 blocks; NORM_THREADS is a multiple of 32.
        unsafe { b.launch(launch_cfg((a.n as u32, 1), NORM_THREADS as u32)) }?;
        Ok(())
    }

    fn add_bias(&self, a: AddBias) -> Result<(), CudaError> {
        let (stride, d, n) = (i(a.stride), i(a.d), i(a.n));
        let mut b = self.stream.launch_builder(self.kernels.get("add_bias"));
        b.arg(&a.y).arg(&a.b).arg(&stride).arg(&d).arg(&n);
        // SAFETY: matches `add_bias`; the bias holds `d` floats, y n rows.
        unsafe { b.launch(launch_cfg((a.n as u32, 1), 256)) }?;
        Ok(())
    }

    fn rope_kv_append(&self, a: RopeKvAppend) -> Result<(), CudaError> {
        let (stride, nq, nk, hd) = (
            i(a.stride),
            i(a.num_q_heads),
            i(a.num_k_heads),
            i(a.head_dim),
        );
        let (interleaved, n) = (i32::from(a.interleaved), i(a.n));
        let mut b = self
            .stream
            .launch_builder(self.kernels.get("rope_kv_append"));
        let rot = i(a.rotary_dim);
        b.arg(&a.qkv)
            .arg(&stride)
            .arg(&nq)
            .arg(&nk)
            .arg(&hd)
            .arg(&rot);
        b.arg(&a.table).arg(&a.pos).arg(&interleaved);
        b.arg(&a.q_norm).arg(&a.k_norm).arg(&a.eps);
        b.arg(&a.k_cache)
            .arg(&a.v_cache)
            .arg(&a.slot_mapping)
            .arg(&n);
        let head_blocks = (a.num_q_heads + a.num_k_heads).div_ceil(4) as u32;
        // SAFETY: matches `rope_kv_append`; the table covers every position
        // the runtime admits (max_seq_len rows of rotary_dim <= head_dim); slot_mapping entries are
        // below (num_pages + 1) * page_size, the layer's extent; qkv rows
        // hold Q | K | V (stride = q_dim + 2 kv_dim); q_norm / k_norm are
        // 0 or head_dim floats; 128 threads are 4 whole warps (one per
        // head), a block per 4 heads of a row.
        unsafe { b.launch(launch_cfg((a.n as u32, head_blocks), 128)) }?;
        Ok(())
    }

    fn paged_attention(&self, a: PagedAttention) -> Result<(), CudaError> {
        let (stride, window, n, splits) = (i(a.stride), i(a.window), i(a.n), i(a.max_splits));
        let (nq, nk, hd, ps) = (
            i(a.num_heads),
            i(a.num_kv_heads),
            i(a.head_dim),
            i(a.page_size),
        );
        let group = a.num_heads / a.num_kv_heads;
        let head_blocks = (a.num_kv_heads * group.div_ceil(ATTENTION_HEADS_PER_BLOCK)) as u32;
        let mut b = self
            .stream
            .launch_builder(self.kernels.get("paged_attention"));
        b.arg(&a.qkv)
            .arg(&stride)
            .arg(&a.k_cache)
            .arg(&a.v_cache)
            .arg(&a.row_seq)
            .arg(&a.row_pos)
            .arg(&a.kv_indptr)
            .arg(&a.kv_indices);
        b.arg(&nq).arg(&nk).arg(&hd).arg(&ps).arg(&a.scale);
        b.arg(&window).arg(&n).arg(&splits).arg(&a.part);
        let cfg = LaunchConfig {
            grid_dim: (head_blocks, a.n as u32, a.max_splits as u32),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `paged_attention`'s launch shape (a block per KV head and
        // head block, row and key range; head_dim <= 256, checked at load,
        // fits its shared arrays); indices come from the page table; `part`
        // holds n * num_heads * max_splits * (head_dim + 2) floats (the
        // model's decode scratch).
        unsafe { b.launch(cfg) }?;
        let mut b = self
            .stream
            .launch_builder(self.kernels.get("paged_attention_merge"));
        b.arg(&a.part)
            .arg(&a.row_pos)
            .arg(&a.out)
            .arg(&nq)
            .arg(&hd)
            .arg(&window)
            .arg(&n)
            .arg(&splits);
        // SAFETY: `paged_attention_merge` reads the ranges the launch above
        // wrote (the same row_pos, window and max_splits pick them) and
        // writes n rows of num_heads * head_dim f16 to `out`.
        unsafe {
            b.launch(launch_cfg(
                (a.num_heads as u32, a.n as u32),
                ATTENTION_THREADS,
            ))
        }?;
        Ok(())
    }

    fn prefill_attention(&self, pa: PrefillAttention) -> Result<(), CudaError> {
        let a = pa.attn;
        let tiles = a.n.div_ceil(PREFILL_Q_ROWS) as u32;
        let cfg = launch_cfg((a.num_heads as u32, tiles), PREFILL_THREADS);
        // SAFETY: `prefill_attention`'s launch shape; head_dim <= 256
        // (checked at load) fits its shared Q and K/V tiles, PREFILL_THREADS
        // its rows per warp; every row's pages cover its position (the page
        // table).
        unsafe { self.attention("prefill_attention", &a, cfg) }
    }

    fn swiglu(&self, a: Swiglu) -> Result<(), CudaError> {
        self.gated_f16("swiglu", (a.gate_up, a.out, a.f, a.n))
    }

    fn swiglu_q8(&self, a: SwigluQ8) -> Result<(), CudaError> {
        self.gated_q8("swiglu_q8", (a.gate_up, a.xq, a.f, a.n))
    }

    fn gelu_mul(&self, a: GeluMul) -> Result<(), CudaError> {
        self.gated_f16("gelu_mul", (a.gate_up, a.out, a.f, a.n))
    }

    fn gelu_mul_q8(&self, a: GeluMulQ8) -> Result<(), CudaError> {
        self.gated_q8("gelu_mul_q8", (a.gate_up, a.xq, a.f, a.n))
    }

    fn rms_norm_f32(&self, a: RmsNormF32) -> Result<(), CudaError> {
        let (h, n) = (i(a.hidden), i(a.n));
        let mut b = self.stream.launch_builder(self.kernels.get("rms_norm_f32"));
        b.arg(&a.x).arg(&a.w).arg(&h).arg(&a.eps).arg(&n);
        // SAFETY: matches `rms_norm_f32`; x holds n rows of hidden, w hidden
        // floats; NORM_THREADS is a multiple of 32 (its block sum's warps).
        unsafe { b.launch(launch_cfg((a.n as u32, 1), NORM_THREADS as u32)) }?;
        Ok(())
    }

    fn scale_f32(&self, a: ScaleF32) -> Result<(), CudaError> {
        let len = a.len as u64;
        let mut b = self.stream.launch_builder(self.kernels.get("scale_f32"));
        b.arg(&a.x).arg(&a.s).arg(&len);
        let blocks = a.len.div_ceil(256).clamp(1, 65535) as u32;
        // SAFETY: matches `scale_f32` (grid-stride); x holds len floats.
        unsafe { b.launch(launch_cfg((blocks, 1), 256)) }?;
        Ok(())
    }

    fn softcap(&self, a: Softcap) -> Result<(), CudaError> {
        let len = a.len as u64;
        let mut b = self.stream.launch_builder(self.kernels.get("softcap"));
        b.arg(&a.x).arg(&a.cap).arg(&len);
        let blocks = a.len.div_ceil(256).clamp(1, 65535) as u32;
        // SAFETY: matches `softcap` (grid-stride); x holds len floats.
        unsafe { b.launch(launch_cfg((blocks, 1), 256)) }?;
        Ok(())
    }

    fn add_layer_norm(&self, a: AddLayerNorm) -> Result<(), CudaError> {
        let (h, n) = (i(a.hidden), i(a.n));
        let mut b = self
            .stream
            .launch_builder(self.kernels.get("add_layer_norm"));
        b.arg(&a.x)
            .arg(&a.delta)
            .arg(&a.w)
            .arg(&a.b)
            .arg(&a.out)
            .arg(&a.out_row);
        b.arg(&h).arg(&a.eps).arg(&n);
        // SAFETY: matches `add_layer_norm`; x/delta/out hold n rows of
        // hidden, w and b hidden floats; NORM_THREADS is a multiple of 32
        // (its block sums' warps).
        unsafe { b.launch(launch_cfg((a.n as u32, 1), NORM_THREADS as u32)) }?;
        Ok(())
    }

    fn add_f32(&self, a: AddF32) -> Result<(), CudaError> {
        let len = a.len as u64;
        let mut b = self.stream.launch_builder(self.kernels.get("add_f32"));
        b.arg(&a.x).arg(&a.y).arg(&len);
        let blocks = a.len.div_ceil(256).clamp(1, 65535) as u32;
        // SAFETY: matches `add_f32` (grid-stride); x and y hold len floats.
        unsafe { b.launch(launch_cfg((blocks, 1), 256)) }?;
        Ok(())
    }

    fn bias_gelu(&self, a: BiasGelu) -> Result<(), CudaError> {
        let (f, n) = (i(a.f), i(a.n));
        let mut b = self.stream.launch_builder(self.kernels.get("bias_gelu"));
        b.arg(&a.y).arg(&a.b).arg(&a.out).arg(&f).arg(&n);
        let blocks = (a.n * a.f).div_ceil(256).clamp(1, 65535) as u32;
        // SAFETY: matches `bias_gelu` (grid-stride); y holds n rows of f
        // floats, out n rows of f halves, b 0 or f floats.
        unsafe { b.launch(launch_cfg((blocks, 1), 256)) }?;
        Ok(())
    }

    fn spatial_values(&self, a: SpatialValues) -> Result<(), CudaError> {
        let (cb, sb, n) = (i(a.coord_bins), i(a.size_bins), i(a.n));
        let mut b = self
            .stream
            .launch_builder(self.kernels.get("spatial_values"));
        b.arg(&a.coord_logits).arg(&cb).arg(&a.size_logits).arg(&sb);
        b.arg(&a.size_table).arg(&a.tokens).arg(&a.rows);
        b.arg(&a.coord_id).arg(&a.size_id);
        b.arg(&a.values).arg(&a.pending).arg(&n);
        // SAFETY: matches `spatial_values`; the logits hold n rows of
        // coord_bins / 2 size_bins floats, the table size_bins, tokens and
        // rows n entries, values n * 3 floats and pending 3 floats per KV
        // row; SPATIAL_THREADS sizes its shared arrays.
        unsafe { b.launch(launch_cfg((a.n as u32, 1), SPATIAL_THREADS)) }?;
        Ok(())
    }

    fn fourier_features(&self, a: FourierFeatures) -> Result<(), CudaError> {
        let (ch, sh, n) = (i(a.coord_half), i(a.size_half), i(a.n));
        let mut b = self
            .stream
            .launch_builder(self.kernels.get("fourier_features"));
        b.arg(&a.values).arg(&a.rows).arg(&a.coord_w).arg(&ch);
        b.arg(&a.size_w)
            .arg(&sh)
            .arg(&a.coord_feats)
            .arg(&a.size_feats);
        b.arg(&n);
        let blocks = (a.n * (a.coord_half + a.size_half))
            .div_ceil(256)
            .clamp(1, 65535) as u32;
        // SAFETY: matches `fourier_features` (grid-stride); values hold 3
        // floats per row (through rows when given), the frequencies
        // coord_half and 2 size_half floats, the features n rows each.
        unsafe { b.launch(launch_cfg((blocks, 1), 256)) }?;
        Ok(())
    }

    fn spatial_embed(&self, a: SpatialEmbed) -> Result<(), CudaError> {
        let (h, n) = (i(a.hidden), i(a.n));
        let mut b = self
            .stream
            .launch_builder(self.kernels.get("spatial_embed"));
        b.arg(&a.x).arg(&a.coord_emb).arg(&a.size_emb);
        b.arg(&a.tokens)
            .arg(&a.rows)
            .arg(&a.coord_id)
            .arg(&a.size_id);
        b.arg(&h).arg(&n);
        // SAFETY: matches `spatial_embed`; x and both embeddings hold n rows
        // of hidden floats, tokens cover every row's (indirect) index.
        unsafe { b.launch(launch_cfg((a.n as u32, 1), 256)) }?;
        Ok(())
    }

    fn hidden_f16(&self, a: HiddenF16) -> Result<(), CudaError> {
        let (h, n) = (i(a.hidden), i(a.n));
        let mut b = self.stream.launch_builder(self.kernels.get("hidden_f16"));
        b.arg(&a.x).arg(&a.out_row).arg(&a.out).arg(&h).arg(&n);
        // SAFETY: matches `hidden_f16`; x holds n rows of hidden floats,
        // out every row out_row names (or n), out_row 0 or n entries.
        unsafe { b.launch(launch_cfg((a.n as u32, 1), 256)) }?;
        Ok(())
    }

    fn accept_values(&self, a: AcceptValues) -> Result<(), CudaError> {
        let n = i(a.n);
        let mut b = self
            .stream
            .launch_builder(self.kernels.get("accept_values"));
        b.arg(&a.qo).arg(&a.accepted).arg(&a.kv_rows);
        b.arg(&a.values).arg(&a.pending).arg(&n);
        // SAFETY: matches `accept_values`; qo holds n + 1 offsets, accepted
        // (>= 1 each, from accept_drafts) and kv_rows n entries, values 3
        // floats per row, pending 3 per KV row.
        unsafe { b.launch(launch_cfg((a.n.div_ceil(64) as u32, 1), 64)) }?;
        Ok(())
    }

    fn reset_counts(&self, a: ResetCounts) -> Result<(), CudaError> {
        let (vocab, n) = (i(a.vocab), i(a.n));
        let mut b = self.stream.launch_builder(self.kernels.get("reset_counts"));
        b.arg(&a.counts).arg(&a.rows).arg(&vocab).arg(&n);
        // SAFETY: matches `reset_counts`; rows are KV rows < counts' rows.
        unsafe { b.launch(launch_cfg((a.n as u32, 1), 256)) }?;
        Ok(())
    }

    fn count_tokens(&self, a: CountTokens) -> Result<(), CudaError> {
        let (vocab, n) = (i(a.vocab), i(a.n));
        let mut b = self.stream.launch_builder(self.kernels.get("count_tokens"));
        b.arg(&a.counts)
            .arg(&a.rows)
            .arg(&a.indptr)
            .arg(&a.tokens)
            .arg(&vocab)
            .arg(&n);
        // SAFETY: matches `count_tokens`; rows are KV rows < counts' rows,
        // indptr holds n + 1 offsets into tokens; ids past vocab are skipped.
        unsafe { b.launch(launch_cfg((a.n as u32, 1), 128)) }?;
        Ok(())
    }

    fn verify_inputs(&self, a: VerifyInputs) -> Result<(), CudaError> {
        let n = i(a.n);
        let mut b = self
            .stream
            .launch_builder(self.kernels.get("verify_inputs"));
        b.arg(&a.pending).arg(&a.kv_rows).arg(&a.qo);
        b.arg(&a.drafts).arg(&a.tokens).arg(&n);
        // SAFETY: matches `verify_inputs`; qo holds n + 1 offsets into
        // tokens, drafts qo[n] - n tokens, kv_rows n rows of pending.
        unsafe { b.launch(launch_cfg((a.n as u32, 1), 32)) }?;
        Ok(())
    }

    fn draft_counts(&self, a: DraftCounts) -> Result<(), CudaError> {
        let (vocab, n) = (i(a.vocab), i(a.n));
        let mut b = self.stream.launch_builder(self.kernels.get("draft_counts"));
        b.arg(&a.counts).arg(&a.kv_rows).arg(&a.qo).arg(&a.tokens);
        b.arg(&a.scratch).arg(&vocab).arg(&n);
        // SAFETY: matches `draft_counts`; scratch holds qo[n] rows of vocab
        // counts, kv_rows are rows of counts; blocks past a member's rows return.
        unsafe { b.launch(launch_cfg((a.n as u32, a.max_rows as u32), 256)) }?;
        Ok(())
    }

    fn accept_drafts(&self, a: AcceptDrafts) -> Result<(), CudaError> {
        let (vocab, n) = (i(a.vocab), i(a.n));
        let mut b = self
            .stream
            .launch_builder(self.kernels.get("accept_drafts"));
        b.arg(&a.qo).arg(&a.tokens).arg(&a.sampled).arg(&a.kv_rows);
        b.arg(&a.counts).arg(&a.pending).arg(&a.accepted);
        b.arg(&vocab).arg(&n);
        // SAFETY: matches `accept_drafts` (one thread per member, members on
        // distinct KV rows); sampled and tokens hold qo[n] rows, accepted n.
        unsafe { b.launch(launch_cfg((a.n.div_ceil(64) as u32, 1), 64)) }?;
        Ok(())
    }

    fn sample_rows(&self, a: SampleRows) -> Result<(), CudaError> {
        let vocab = i(a.vocab);
        let (wpr, top_n, n) = (i(a.words_per_row), i(a.top_n), i(a.n));
        let mut b = self.stream.launch_builder(self.kernels.get("sample_rows"));
        b.arg(&a.logits)
            .arg(&vocab)
            .arg(&a.mask_words)
            .arg(&a.mask_flags)
            .arg(&wpr);
        b.arg(&a.params).arg(&a.rows).arg(&a.positions);
        b.arg(&a.counts).arg(&a.pending);
        b.arg(&a.out_tokens)
            .arg(&a.out_logprobs)
            .arg(&a.out_top_ids)
            .arg(&a.out_top_lps);
        b.arg(&a.bias_indptr).arg(&a.bias);
        b.arg(&top_n).arg(&n);
        // SAFETY: matches `sample_rows`; its block size is SAMPLE_THREADS
        // (the scan buffer's size); outputs hold n rows (top_n wide); the
        // bias offsets (when not 0) hold n + 1 words indexing its pairs.
        unsafe { b.launch(launch_cfg((a.n as u32, 1), SAMPLE_THREADS)) }?;
        Ok(())
    }
}
