//! [`Device`]: every operation the runtime issues to a device, one method
//! per allocation, copy, event, graph and kernel op, so the runtime's
//! bookkeeping (slots, KV, metadata packing, buckets, dispatch) is one body
//! of code over two implementations: [`super::cuda::CudaDevice`] (cudarc:
//! the GPU) and [`crate::hostdev::HostDevice`] (plain Rust on host memory
//! laid out as the device's, run in CI).
//!
//! Buffers are addressed by raw `u64` addresses as kernels see them, so the
//! runtime computes offsets once for both. Kernel-op argument structs mirror
//! the parameters of their entry point in `kernels/*.cu` (a new kernel is a
//! new struct and a new method). Every call only enqueues on the compute
//! stream (I1), in order; `dtoh` goes to the copy stream.

use std::time::Instant;

use kestrel_model::DType;

use crate::CudaError;

/// Plain values that cross between host and device buffers.
pub trait Plain: Copy + Default + Send + 'static {}
impl Plain for u32 {}
impl Plain for f32 {}
/// f16 bits (the vision encoder's features come back as f16).
impl Plain for u16 {}
impl Plain for crate::ffi::SampleParams {}

/// A device allocation with a stable address.
pub trait DevMem: Send {
    /// Its first byte's address.
    fn ptr(&self) -> u64;
    /// The address `elems` elements of `T` in.
    fn at<T>(&self, elems: usize) -> u64 {
        self.ptr() + (elems * std::mem::size_of::<T>()) as u64
    }
}

/// A host buffer the device copies from and into (page-locked on CUDA).
pub trait HostMem<T: Plain>: Send {
    fn as_slice(&self) -> &[T];
    fn as_mut_slice(&mut self) -> &mut [T];
}

/// Which stream an event is recorded on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Compute,
    Copy,
}

/// `y[n, out] (f32, rows `ldy` apart) = x[n, inp] (f16) * W[out, inp]^T
/// (f16)`, f32 accumulation (cuBLAS).
#[derive(Debug, Clone, Copy)]
pub struct Gemm {
    pub y: u64,
    pub ldy: usize,
    pub x: u64,
    pub w: u64,
    pub n: usize,
    pub out: usize,
    pub inp: usize,
}

/// `mmvq_*` (the entry point of `dtype`, see `quant::mmvq_kernel`):
/// `y[r * ldy + o] = W[o] . xq[r]` for `o < rows`, `r < n <= MMVQ_MAX_ROWS`;
/// `w` holds `rows` encoded rows of `cols`, `xq` (8-byte aligned) n
/// activation rows of `cols / 32` blocks in the device's layout
/// ([`crate::quant::pack_q8_rows`]).
#[derive(Debug, Clone, Copy)]
pub struct Mmvq {
    pub dtype: DType,
    pub w: u64,
    pub xq: u64,
    pub y: u64,
    pub rows: usize,
    pub cols: usize,
    pub ldy: usize,
    pub n: usize,
}

/// `quantize_q8_h`: f16 rows `x` (`cols` wide) to int8 blocks in `xq`.
#[derive(Debug, Clone, Copy)]
pub struct QuantizeQ8H {
    pub x: u64,
    pub xq: u64,
    pub cols: usize,
    pub n: usize,
}

/// `dequant_f16`: rows `row0..row0 + nrows` of the `dtype`-encoded weight
/// `w` (`cols` wide) to f16 in `out`.
#[derive(Debug, Clone, Copy)]
pub struct DequantF16 {
    pub w: u64,
    pub dtype: DType,
    pub row0: usize,
    pub nrows: usize,
    pub cols: usize,
    pub out: u64,
}

/// `embed_gather`: `x[i] = table[tokens[rows ? rows[i] : i]]` (f16 -> f32).
#[derive(Debug, Clone, Copy)]
pub struct EmbedGather {
    pub table: u64,
    pub tokens: u64,
    /// 0: tokens are read directly.
    pub rows: u64,
    pub x: u64,
    pub hidden: usize,
    pub vocab: usize,
    pub n: usize,
}

/// `embed_gather_q`: as [`EmbedGather`] from a `dtype`-encoded table.
#[derive(Debug, Clone, Copy)]
pub struct EmbedGatherQ {
    pub table: u64,
    pub dtype: DType,
    pub tokens: u64,
    /// 0: tokens are read directly.
    pub rows: u64,
    pub x: u64,
    pub hidden: usize,
    pub vocab: usize,
    pub n: usize,
}

/// `add_rms_norm`: `x += delta` (delta 0: none), `out[out_row[i]] = rmsnorm(x) * w` (f16).
#[derive(Debug, Clone, Copy)]
pub struct AddRmsNorm {
    pub x: u64,
    pub delta: u64,
    pub w: u64,
    pub out: u64,
    /// `i32` per row (-1: skip), 0: identity.
    pub out_row: u64,
    pub hidden: usize,
    pub eps: f32,
    pub n: usize,
}

/// `add_rms_norm_q8`: as [`AddRmsNorm`], the normalized rows quantized to
/// int8 blocks in `xq` (`hidden / 32` per row) instead of f16.
#[derive(Debug, Clone, Copy)]
pub struct AddRmsNormQ8 {
    pub x: u64,
    pub delta: u64,
    pub w: u64,
    pub xq: u64,
    /// `i32` per row (-1: skip), 0: identity.
    pub out_row: u64,
    pub hidden: usize,
    pub eps: f32,
    pub n: usize,
}

/// `add_bias`: `y[i * stride + j] += b[j]` for `j < d`.
#[derive(Debug, Clone, Copy)]
pub struct AddBias {
    pub y: u64,
    pub b: u64,
    pub stride: usize,
    pub d: usize,
    pub n: usize,
}

/// `rope_kv_append`: rotate the Q heads of each `qkv` row (Q | K | V) at
/// `pos[i]` in place; write its rotated K heads and its V (f16) to its
/// `slot_mapping` slot of the caches (K is not written back to `qkv`).
/// With `q_norm`/`k_norm` each Q/K head is RMS-normed before its rotation.
#[derive(Debug, Clone, Copy)]
pub struct RopeKvAppend {
    pub qkv: u64,
    pub stride: usize,
    pub num_q_heads: usize,
    pub num_k_heads: usize,
    pub head_dim: usize,
    /// Dimensions rotated per head (the first ones; `head_dim` but for
    /// Phi's partial rotary); the rest pass through.
    pub rotary_dim: usize,
    /// `[max_pos][cos.. | sin..]` (`rotary_dim` floats a row), f32.
    pub table: u64,
    pub pos: u64,
    pub interleaved: bool,
    /// Per-head RMSNorm weights (`head_dim` f32 each), 0: no q/k norm.
    pub q_norm: u64,
    pub k_norm: u64,
    pub eps: f32,
    pub k_cache: u64,
    pub v_cache: u64,
    pub slot_mapping: u64,
    pub n: usize,
}

/// `paged_attention`: one query row per token, causal by position, over
/// the pages of its sequence (`row_seq`), GQA; output f16.
#[derive(Debug, Clone, Copy)]
pub struct PagedAttention {
    pub qkv: u64,
    pub stride: usize,
    pub out: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub row_seq: u64,
    pub row_pos: u64,
    pub kv_indptr: u64,
    pub kv_indices: u64,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub page_size: usize,
    pub scale: f32,
    /// Sliding window: keys of the last `window` positions only; 0: all.
    pub window: usize,
    pub n: usize,
    /// Decode only (`paged_attention`, split over keys): a row's keys go in
    /// at most `max_splits` ranges, each range's (max, sum, output) into
    /// `part`, `n * num_heads * max_splits * (head_dim + 2)` f32, which the
    /// merge pass reads. `prefill_attention` ignores both.
    pub max_splits: usize,
    pub part: u64,
}

/// `prefill_attention`: [`PagedAttention`]'s rows and arguments (its
/// `window` included), computed in tiles (several query rows of one
/// sequence share each K/V tile: a prefill chunk after its cached prefix).
/// See `kernels/prefill_attention.cu`.
#[derive(Debug, Clone, Copy)]
pub struct PrefillAttention {
    pub attn: PagedAttention,
}

/// `swiglu`: `out[i, j] = silu(gate_up[i, j]) * gate_up[i, f + j]` (f16).
#[derive(Debug, Clone, Copy)]
pub struct Swiglu {
    pub gate_up: u64,
    pub out: u64,
    pub f: usize,
    pub n: usize,
}

/// `swiglu_q8`: as [`Swiglu`], quantized to int8 blocks in `xq` (`f / 32`
/// per row) instead of f16.
#[derive(Debug, Clone, Copy)]
pub struct SwigluQ8 {
    pub gate_up: u64,
    pub xq: u64,
    pub f: usize,
    pub n: usize,
}

/// `gelu_mul`: as [`Swiglu`] with GELU-tanh for SiLU (Gemma).
#[derive(Debug, Clone, Copy)]
pub struct GeluMul {
    pub gate_up: u64,
    pub out: u64,
    pub f: usize,
    pub n: usize,
}

/// `gelu_mul_q8`: as [`SwigluQ8`] with GELU-tanh for SiLU (Gemma).
#[derive(Debug, Clone, Copy)]
pub struct GeluMulQ8 {
    pub gate_up: u64,
    pub xq: u64,
    pub f: usize,
    pub n: usize,
}

/// `rms_norm_f32`: `x = rmsnorm(x) * w` in place, `n` f32 rows of `hidden`
/// (Gemma's post-attention / post-FFN norm of a sublayer's output).
#[derive(Debug, Clone, Copy)]
pub struct RmsNormF32 {
    pub x: u64,
    pub w: u64,
    pub hidden: usize,
    pub eps: f32,
    pub n: usize,
}

/// `scale_f32`: `x[j] *= s` for `j < len` (the embedding scale).
#[derive(Debug, Clone, Copy)]
pub struct ScaleF32 {
    pub x: u64,
    pub s: f32,
    pub len: usize,
}

/// `softcap`: `x[j] = cap * tanh(x[j] / cap)` for `j < len` (final logits).
#[derive(Debug, Clone, Copy)]
pub struct Softcap {
    pub x: u64,
    pub cap: f32,
    pub len: usize,
}

/// `add_layer_norm`: `x += delta` (delta 0: none), `out[out_row[i]] =
/// layernorm(x) * w + b` (f16): Phi's norms.
#[derive(Debug, Clone, Copy)]
pub struct AddLayerNorm {
    pub x: u64,
    pub delta: u64,
    pub w: u64,
    pub b: u64,
    pub out: u64,
    /// `i32` per row (-1: skip), 0: identity.
    pub out_row: u64,
    pub hidden: usize,
    pub eps: f32,
    pub n: usize,
}

/// `add_f32`: `x[j] += y[j]` for `j < len` (a residual add without a norm).
#[derive(Debug, Clone, Copy)]
pub struct AddF32 {
    pub x: u64,
    pub y: u64,
    pub len: usize,
}

/// `bias_gelu`: `out[i, j] = gelu_tanh(y[i, j] + b[j])` (f16), rows of `f`
/// (an ungated FFN's `fc1`; `b` 0: no bias).
#[derive(Debug, Clone, Copy)]
pub struct BiasGelu {
    pub y: u64,
    pub b: u64,
    pub out: u64,
    pub f: usize,
    pub n: usize,
}

/// `spatial_values` (`kernels/region.cu`): row i's value for its sampled
/// token `tokens[i]` from its decoder logits, into `values[i]` and (with
/// `rows`) `pending[rows[i]]` (3 f32 each: coord, w, h).
#[derive(Debug, Clone, Copy)]
pub struct SpatialValues {
    pub coord_logits: u64,
    pub coord_bins: usize,
    /// Rows of `2 * size_bins` (width bins, then height bins).
    pub size_logits: u64,
    pub size_bins: usize,
    /// `size_bins` f32: the size of each bin.
    pub size_table: u64,
    pub tokens: u64,
    /// 0: no pending values written.
    pub rows: u64,
    pub coord_id: u32,
    pub size_id: u32,
    pub values: u64,
    pub pending: u64,
    pub n: usize,
}

/// `fourier_features`: the region encoders' f16 inputs from each row's
/// values (`values[rows ? rows[i] : i]`).
#[derive(Debug, Clone, Copy)]
pub struct FourierFeatures {
    pub values: u64,
    /// 0: rows read directly.
    pub rows: u64,
    pub coord_w: u64,
    pub coord_half: usize,
    pub size_w: u64,
    pub size_half: usize,
    pub coord_feats: u64,
    pub size_feats: u64,
    pub n: usize,
}

/// `spatial_embed`: rows of `x` whose input token is `coord_id` /
/// `size_id` take the coordinate / size encoder's output row.
#[derive(Debug, Clone, Copy)]
pub struct SpatialEmbed {
    pub x: u64,
    pub coord_emb: u64,
    pub size_emb: u64,
    pub tokens: u64,
    /// 0: tokens read directly.
    pub rows: u64,
    pub coord_id: u32,
    pub size_id: u32,
    pub hidden: usize,
    pub n: usize,
}

/// `hidden_f16`: row i of the f32 rows `x` to row `out_row[i]` of `out`
/// (f16; -1: none; `out_row` 0: identity).
#[derive(Debug, Clone, Copy)]
pub struct HiddenF16 {
    pub x: u64,
    pub out_row: u64,
    pub out: u64,
    pub hidden: usize,
    pub n: usize,
}

/// `accept_values` (`kernels/region.cu`): member i's pending values
/// (`pending[kv_rows[i]]`, 3 f32) = `values[qo[i] + accepted[i] - 1]`.
#[derive(Debug, Clone, Copy)]
pub struct AcceptValues {
    pub qo: u64,
    pub accepted: u64,
    pub kv_rows: u64,
    pub values: u64,
    pub pending: u64,
    pub n: usize,
}

/// `reset_counts`: zero the penalty counts of the KV rows `rows[..n]`.
#[derive(Debug, Clone, Copy)]
pub struct ResetCounts {
    pub counts: u64,
    pub rows: u64,
    pub vocab: usize,
    pub n: usize,
}

/// `count_tokens` (`kernels/penalty.cu`): KV row `rows[i]`'s counts gain
/// one for each of `tokens[indptr[i]..indptr[i + 1]]` (a re-admitted
/// sequence's generated tokens), for `i < n`.
#[derive(Debug, Clone, Copy)]
pub struct CountTokens {
    pub counts: u64,
    pub rows: u64,
    pub indptr: u64,
    pub tokens: u64,
    pub vocab: usize,
    pub n: usize,
}

/// `verify_inputs` (`kernels/verify.cu`): member `i`'s forward rows
/// `qo[i]..qo[i + 1]` get `pending[kv_rows[i]]`, then its drafts.
#[derive(Debug, Clone, Copy)]
pub struct VerifyInputs {
    pub pending: u64,
    pub kv_rows: u64,
    pub qo: u64,
    pub drafts: u64,
    pub tokens: u64,
    pub n: usize,
}

/// `draft_counts`: scratch counts row `qo[i] + j` = member `i`'s counts
/// plus its drafts `1..=j` (read from `tokens`), for rows up to
/// `max_rows` per member.
#[derive(Debug, Clone, Copy)]
pub struct DraftCounts {
    pub counts: u64,
    pub kv_rows: u64,
    pub qo: u64,
    pub tokens: u64,
    pub scratch: u64,
    pub vocab: usize,
    pub max_rows: usize,
    pub n: usize,
}

/// `accept_drafts`: per member, the sampled tokens accepted (`accepted[i]`
/// of them), counted into its counts, the last its pending token.
#[derive(Debug, Clone, Copy)]
pub struct AcceptDrafts {
    pub qo: u64,
    pub tokens: u64,
    pub sampled: u64,
    pub kv_rows: u64,
    pub counts: u64,
    pub pending: u64,
    pub accepted: u64,
    pub vocab: usize,
    pub n: usize,
}

/// `sample_rows` (see `kernels/sample.cu`): sample `n` rows, bump each
/// row's counts and write its `pending` token.
#[derive(Debug, Clone, Copy)]
pub struct SampleRows {
    pub logits: u64,
    pub vocab: usize,
    /// 0 with `mask_flags` 0: unconstrained.
    pub mask_words: u64,
    pub mask_flags: u64,
    pub words_per_row: usize,
    pub params: u64,
    pub rows: u64,
    pub positions: u64,
    pub counts: u64,
    pub pending: u64,
    pub out_tokens: u64,
    pub out_logprobs: u64,
    pub out_top_ids: u64,
    pub out_top_lps: u64,
    /// `n + 1` u32 offsets into `bias` per row (`logit_bias`), 0: none.
    pub bias_indptr: u64,
    /// (token, f32 bits) u32 pairs.
    pub bias: u64,
    pub top_n: usize,
    pub n: usize,
}

/// The device operations of the runtime. See the module docs.
///
/// Implementations execute or enqueue in call order; `sync` waits for all of
/// it. Between `begin_capture` and `end_capture` kernel ops are recorded,
/// not run, with their arguments as given, and `replay` runs them again.
pub trait Device: Send + Sized + 'static {
    type Buf: DevMem;
    type Host<T: Plain>: HostMem<T>;
    type Event: Send;
    type Graph: Send;

    /// Make this device current on the calling thread.
    fn bind(&self) -> Result<(), CudaError>;
    /// `bytes` zero bytes, the fill enqueued on the compute stream: every
    /// later compute-stream op and copy sees zeros; the copy stream, after
    /// an event recorded on the compute stream after this call. Not during
    /// a capture (the fill would become part of the graph).
    fn alloc_zeroed(&self, bytes: usize) -> Result<Self::Buf, CudaError>;
    /// `bytes` bytes whose content nothing reads before a kernel writes it.
    fn alloc(&self, bytes: usize) -> Result<Self::Buf, CudaError>;
    /// A buffer holding `data` (load time only: synchronous).
    fn upload<T: Copy>(&self, data: &[T]) -> Result<Self::Buf, CudaError>;
    /// A host buffer of `len` default values the device copies from/into.
    fn host<T: Plain>(&self, len: usize) -> Result<Self::Host<T>, CudaError>;
    /// A copy of `src` to `dst` on the compute stream, ordered after all
    /// work enqueued there and complete when this returns.
    fn htod_sync<T: Plain>(&self, dst: u64, src: &[T]) -> Result<(), CudaError>;
    /// Enqueue a copy of `src` to `dst` on the compute stream.
    ///
    /// # Safety
    /// `src` stays alive and unwritten until the copy has run (the runtime:
    /// until the slot's commit, I6), and `dst` holds `size_of_val(src)` bytes.
    unsafe fn htod<T: Plain>(&self, dst: u64, src: &[T]) -> Result<(), CudaError>;
    /// Enqueue a copy of `src` into `dst` on the copy stream.
    ///
    /// # Safety
    /// `dst` is not read or written by the host until an event recorded on
    /// the copy stream after this call has completed; `src` holds as many bytes.
    unsafe fn dtoh<T: Plain>(&self, dst: &mut [T], src: u64) -> Result<(), CudaError>;
    /// An event; `timed` ones can be converted to host instants.
    fn event(&self, timed: bool) -> Result<Self::Event, CudaError>;
    fn record(&self, ev: &Self::Event, on: Stream) -> Result<(), CudaError>;
    /// The copy stream waits for `ev` before its later copies.
    fn copy_waits(&self, ev: &Self::Event) -> Result<(), CudaError>;
    /// Block the host until `ev` has completed.
    fn event_sync(&self, ev: &Self::Event) -> Result<(), CudaError>;
    /// Block until the compute stream has run everything enqueued.
    fn sync_compute(&self) -> Result<(), CudaError>;
    /// Block until both streams have run everything enqueued.
    fn sync(&self) -> Result<(), CudaError>;
    fn begin_capture(&self) -> Result<(), CudaError>;
    /// The ops since `begin_capture`, as a graph (`None` if nothing was captured).
    fn end_capture(&self) -> Result<Option<Self::Graph>, CudaError>;
    fn replay(&self, g: &Self::Graph) -> Result<(), CudaError>;
    /// Free device memory now, in bytes.
    fn free_memory(&self) -> Result<usize, CudaError>;
    /// Start (or re-anchor) the clock that turns timed events into instants.
    fn anchor_clock(&mut self) -> Result<(), CudaError>;
    /// Whether the clock should be re-anchored (or was never started).
    fn clock_stale(&self, now: Instant) -> bool;
    /// The host instant at which the completed, timed event `ev` completed.
    fn instant(&self, ev: &Self::Event) -> Result<Instant, CudaError>;

    fn gemm(&self, a: Gemm) -> Result<(), CudaError>;
    fn mmvq(&self, a: Mmvq) -> Result<(), CudaError>;
    fn quantize_q8_h(&self, a: QuantizeQ8H) -> Result<(), CudaError>;
    fn dequant_f16(&self, a: DequantF16) -> Result<(), CudaError>;
    fn embed_gather(&self, a: EmbedGather) -> Result<(), CudaError>;
    fn embed_gather_q(&self, a: EmbedGatherQ) -> Result<(), CudaError>;
    fn add_rms_norm(&self, a: AddRmsNorm) -> Result<(), CudaError>;
    fn add_rms_norm_q8(&self, a: AddRmsNormQ8) -> Result<(), CudaError>;
    fn add_bias(&self, a: AddBias) -> Result<(), CudaError>;
    fn rope_kv_append(&self, a: RopeKvAppend) -> Result<(), CudaError>;
    fn paged_attention(&self, a: PagedAttention) -> Result<(), CudaError>;
    fn prefill_attention(&self, a: PrefillAttention) -> Result<(), CudaError>;
    fn swiglu(&self, a: Swiglu) -> Result<(), CudaError>;
    fn swiglu_q8(&self, a: SwigluQ8) -> Result<(), CudaError>;
    fn gelu_mul(&self, a: GeluMul) -> Result<(), CudaError>;
    fn gelu_mul_q8(&self, a: GeluMulQ8) -> Result<(), CudaError>;
    fn rms_norm_f32(&self, a: RmsNormF32) -> Result<(), CudaError>;
    fn scale_f32(&self, a: ScaleF32) -> Result<(), CudaError>;
    fn softcap(&self, a: Softcap) -> Result<(), CudaError>;
    fn add_layer_norm(&self, a: AddLayerNorm) -> Result<(), CudaError>;
    fn add_f32(&self, a: AddF32) -> Result<(), CudaError>;
    fn bias_gelu(&self, a: BiasGelu) -> Result<(), CudaError>;
    fn spatial_values(&self, a: SpatialValues) -> Result<(), CudaError>;
    fn fourier_features(&self, a: FourierFeatures) -> Result<(), CudaError>;
    fn spatial_embed(&self, a: SpatialEmbed) -> Result<(), CudaError>;
    fn hidden_f16(&self, a: HiddenF16) -> Result<(), CudaError>;
    fn accept_values(&self, a: AcceptValues) -> Result<(), CudaError>;
    fn reset_counts(&self, a: ResetCounts) -> Result<(), CudaError>;
    fn count_tokens(&self, a: CountTokens) -> Result<(), CudaError>;
    fn verify_inputs(&self, a: VerifyInputs) -> Result<(), CudaError>;
    fn draft_counts(&self, a: DraftCounts) -> Result<(), CudaError>;
    fn accept_drafts(&self, a: AcceptDrafts) -> Result<(), CudaError>;
    fn sample_rows(&self, a: SampleRows) -> Result<(), CudaError>;
}
