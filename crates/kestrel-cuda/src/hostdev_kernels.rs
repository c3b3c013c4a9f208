//! The host device's kernel ops: each computes what its entry point in
//! `kernels/*.cu` computes, on the same buffers (weights in their file's
//! encoding, int8 activation blocks, f16 KV cache and GEMM inputs; f32
//! residual stream, matmul outputs and logits), row by row in one thread.
//! The ops of the quantized path, the norms (post-norms included), the
//! fused RoPE + KV append (with its q/k norms), GELU-tanh, the softcap, the
//! tiled prefill attention and the penalty and draft kernels call their
//! kernels' host references ([`crate::reference`], which
//! `tests/kernel_source.rs` holds bit for bit against the CUDA source);
//! decode attention runs the prefill attention's reference too (the same
//! attention, so a position computes alike in any step, as on the CPU);
//! the GEMM (cuBLAS on the GPU) and SwiGLU sum in their own order, so
//! values agree with the GPU's to rounding; greedy tokens are what parity
//! checks.
//!
//! The spatial stage's ops (`kernels/region.cu`) are in `hostdev_region.rs`.
//!
//! Every op slices its buffers through [`HostMemory`] (bounds-checked) after
//! checking its output disjoint from its inputs ([`disjoint`]). Cost: the
//! GEMM converts each weight row to f32 once per call and takes n dot
//! products with it; `mmvq` decodes each weight block once per activation
//! row (as the reference does); the rest is linear in the rows' sizes.

use half::f16;
use half::slice::HalfFloatSliceExt;
use kestrel_numerics::exp as kexp;

use crate::hostdev::{disjoint, HostMemory};
use crate::kernels::MMVQ_MAX_ROWS;
use crate::quant::{encoded_bytes, pack_q8_rows, unpack_q8_rows, Q8Block, BLOCK, Q8_BLOCK_BYTES};
use crate::reference;
use crate::runtime::backend::{
    AcceptDrafts, AddBias, AddRmsNorm, AddRmsNormQ8, CountTokens, DequantF16, DraftCounts,
    EmbedGather, EmbedGatherQ, GeluMul, GeluMulQ8, Gemm, Mmvq, PagedAttention, PrefillAttention,
    QuantizeQ8H, ResetCounts, RmsNormF32, RopeKvAppend, ScaleF32, Softcap, Swiglu, SwigluQ8,
    VerifyInputs,
};
use crate::runtime::backend::{AddF32, AddLayerNorm, BiasGelu};
use crate::CudaError;

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    // Eight independent lanes (no mul_add: without the fma target feature
    // it is a libm call per element), so the loop vectorizes.
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

pub(crate) fn max_u32(v: &[u32]) -> usize {
    v.iter().copied().max().unwrap_or(0) as usize
}

/// The bytes `n` rows of `width` values, rows `ld` apart, span.
fn strided(n: usize, width: usize, ld: usize, size: usize) -> usize {
    if n == 0 {
        0
    } else {
        ((n - 1) * ld + width) * size
    }
}

pub(crate) fn gemm(m: &HostMemory, a: &Gemm) -> Result<(), CudaError> {
    let (n, out, inp, ldy) = (a.n, a.out, a.inp, a.ldy);
    let y_len = strided(n, out, ldy, 4) / 4;
    disjoint(&[(a.y, y_len * 4), (a.x, n * inp * 2), (a.w, out * inp * 2)])?;
    // SAFETY: the output is disjoint from both inputs (checked above).
    let (x, w, y) = unsafe {
        (
            m.slice::<f16>(a.x, n * inp)?,
            m.slice::<f16>(a.w, out * inp)?,
            m.slice_mut::<f32>(a.y, y_len)?,
        )
    };
    let mut xf = vec![0f32; n * inp];
    x.convert_to_f32_slice(&mut xf);
    let mut wr = vec![0f32; inp];
    for o in 0..out {
        w[o * inp..(o + 1) * inp].convert_to_f32_slice(&mut wr);
        for (r, xr) in xf.chunks_exact(inp).enumerate() {
            y[r * ldy + o] = dot(xr, &wr);
        }
    }
    Ok(())
}

pub(crate) fn mmvq(m: &HostMemory, a: &Mmvq) -> Result<(), CudaError> {
    let (n, rows, cols, ldy) = (a.n, a.rows, a.cols, a.ldy);
    // The kernel's accumulators hold MMVQ_MAX_ROWS rows: refused as on the GPU.
    if n > MMVQ_MAX_ROWS {
        return Err(CudaError::Unsupported(format!(
            "mmvq of {n} rows (at most {MMVQ_MAX_ROWS} a launch)"
        )));
    }
    let (wb, nb) = (encoded_bytes(a.dtype, rows, cols), cols / BLOCK);
    let y_len = strided(n, rows, ldy, 4) / 4;
    // The kernel reads the activations in 8- and 16-byte loads: 8-byte
    // aligned rows or a misaligned-address fault on the GPU.
    if !a.xq.is_multiple_of(8) {
        return Err(CudaError::Unsupported(format!(
            "mmvq activations at {:#x}: not 8-byte aligned",
            a.xq
        )));
    }
    disjoint(&[(a.y, y_len * 4), (a.w, wb), (a.xq, n * nb * Q8_BLOCK_BYTES)])?;
    // SAFETY: the output is disjoint from both inputs (checked above).
    let (w, xq, y) = unsafe {
        (
            m.slice::<u8>(a.w, wb)?,
            m.slice::<u8>(a.xq, n * nb * Q8_BLOCK_BYTES)?,
            m.slice_mut::<f32>(a.y, y_len)?,
        )
    };
    let xq = unpack_q8_rows(xq, nb);
    let mut dense = vec![0f32; n * rows];
    reference::mmvq(a.dtype, w, rows, cols, &xq, &mut dense);
    for (yr, dr) in y.chunks_mut(ldy).zip(dense.chunks_exact(rows)) {
        yr[..rows].copy_from_slice(dr);
    }
    Ok(())
}

pub(crate) fn quantize_q8_h(m: &HostMemory, a: &QuantizeQ8H) -> Result<(), CudaError> {
    let (n, cols) = (a.n, a.cols);
    let nb = cols / BLOCK;
    disjoint(&[(a.x, n * cols * 2), (a.xq, n * nb * Q8_BLOCK_BYTES)])?;
    // SAFETY: the output is disjoint from the input (checked above).
    let (x, xq) = unsafe {
        (
            m.slice::<f16>(a.x, n * cols)?,
            m.slice_mut::<u8>(a.xq, n * nb * Q8_BLOCK_BYTES)?,
        )
    };
    let mut blocks = vec![Q8Block::default(); n * nb];
    reference::quantize_q8_h(x, &mut blocks);
    pack_q8_rows(&blocks, nb, xq);
    Ok(())
}

pub(crate) fn dequant_f16(m: &HostMemory, a: &DequantF16) -> Result<(), CudaError> {
    let wb = encoded_bytes(a.dtype, a.row0 + a.nrows, a.cols);
    let out_len = a.nrows * a.cols;
    disjoint(&[(a.w, wb), (a.out, out_len * 2)])?;
    // SAFETY: the output is disjoint from the weight (checked above).
    let (w, out) = unsafe { (m.slice::<u8>(a.w, wb)?, m.slice_mut::<f16>(a.out, out_len)?) };
    reference::dequant_f16(a.dtype, w, a.row0, a.cols, out);
    Ok(())
}

/// The table rows `n` gathered rows read: `tokens[rows[i]]` (`rows` 0:
/// `tokens[i]`), out-of-vocabulary ids (padding rows, corrupt ids) as 0,
/// as `embed_gather` and `embed_gather_q` do.
fn gathered_ids(
    m: &HostMemory,
    tokens: u64,
    rows: u64,
    vocab: usize,
    n: usize,
) -> Result<Vec<usize>, CudaError> {
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: read-only slices, dropped before any write.
        let t = unsafe {
            if rows != 0 {
                let r = m.slice::<u32>(rows + 4 * i as u64, 1)?[0];
                m.slice::<u32>(tokens + 4 * u64::from(r), 1)?[0]
            } else {
                m.slice::<u32>(tokens + 4 * i as u64, 1)?[0]
            }
        };
        ids.push(if (t as usize) < vocab { t as usize } else { 0 });
    }
    Ok(ids)
}

pub(crate) fn embed_gather_q(m: &HostMemory, a: &EmbedGatherQ) -> Result<(), CudaError> {
    let (n, h) = (a.n, a.hidden);
    let ids = gathered_ids(m, a.tokens, a.rows, a.vocab, n)?;
    let rb = encoded_bytes(a.dtype, 1, h);
    disjoint(&[(a.x, n * h * 4), (a.table, a.vocab * rb)])?;
    // SAFETY: `x` is disjoint from the table (checked above).
    let (table, x) = unsafe {
        (
            m.slice::<u8>(a.table, a.vocab * rb)?,
            m.slice_mut::<f32>(a.x, n * h)?,
        )
    };
    for (row, &t) in x.chunks_exact_mut(h).zip(&ids) {
        let src = &table[t * rb..(t + 1) * rb];
        for (j, v) in row.iter_mut().enumerate() {
            *v = reference::dequant_elem(a.dtype, src, j);
        }
    }
    Ok(())
}

pub(crate) fn embed_gather(m: &HostMemory, a: &EmbedGather) -> Result<(), CudaError> {
    let (n, h) = (a.n, a.hidden);
    let ids = gathered_ids(m, a.tokens, a.rows, a.vocab, n)?;
    disjoint(&[(a.x, n * h * 4), (a.table, a.vocab * h * 2)])?;
    // SAFETY: `x` is disjoint from the table (checked above).
    let (table, x) = unsafe {
        (
            m.slice::<f16>(a.table, a.vocab * h)?,
            m.slice_mut::<f32>(a.x, n * h)?,
        )
    };
    for (row, &t) in x.chunks_exact_mut(h).zip(&ids) {
        table[t * h..(t + 1) * h].convert_to_f32_slice(row);
    }
    Ok(())
}

/// What both norms read and write but their output: the residual stream
/// `x` (the add writes it), the weight `w`, the optional `delta`, and each
/// row's output row.
struct NormRows<'m> {
    x: &'m mut [f32],
    w: &'m [f32],
    delta: Option<&'m [f32]>,
    out_rows: Vec<i32>,
    /// Output rows to hold: one past the largest row written.
    out_len: usize,
}

/// Checks `x`, `w`, `delta` and the output (`out`, `row_bytes` a row) are
/// disjoint, then takes every slice of a norm but its output.
fn norm_rows<'m>(
    m: &'m HostMemory,
    (x, delta, w): (u64, u64, u64),
    (out, row_bytes): (u64, usize),
    out_row: u64,
    (n, h): (usize, usize),
) -> Result<NormRows<'m>, CudaError> {
    let out_rows = out_rows(m, out_row, n)?;
    let out_len = out_rows
        .iter()
        .map(|&o| o.max(0) as usize + 1)
        .max()
        .unwrap_or(0);
    let mut ranges = vec![(x, n * h * 4), (w, h * 4), (out, out_len * row_bytes)];
    if delta != 0 {
        ranges.push((delta, n * h * 4));
    }
    disjoint(&ranges)?;
    // SAFETY: x is disjoint from w, delta and the output (checked above);
    // w and delta are only read.
    let (x, w) = unsafe { (m.slice_mut::<f32>(x, n * h)?, m.slice::<f32>(w, h)?) };
    let delta = if delta != 0 {
        // SAFETY: read-only, disjoint from x and the output (checked above).
        Some(unsafe { m.slice::<f32>(delta, n * h) }?)
    } else {
        None
    };
    Ok(NormRows {
        x,
        w,
        delta,
        out_rows,
        out_len,
    })
}

pub(crate) fn add_rms_norm(m: &HostMemory, a: &AddRmsNorm) -> Result<(), CudaError> {
    let h = a.hidden;
    let NormRows {
        x,
        w,
        delta,
        out_rows,
        out_len,
    } = norm_rows(m, (a.x, a.delta, a.w), (a.out, h * 2), a.out_row, (a.n, h))?;
    // SAFETY: out is disjoint from x, w and delta (checked by norm_rows).
    let out = unsafe { m.slice_mut::<f16>(a.out, out_len * h)? };
    for (i, xr) in x.chunks_exact_mut(h).enumerate() {
        let inv = reference::add_and_inv_rms(xr, delta.map(|d| &d[i * h..(i + 1) * h]), a.eps);
        let o = out_rows[i];
        if o < 0 {
            continue;
        }
        let orow = &mut out[o as usize * h..(o as usize + 1) * h];
        for ((ov, xv), wv) in orow.iter_mut().zip(xr.iter()).zip(w) {
            *ov = f16::from_f32(xv * inv * wv);
        }
    }
    Ok(())
}

pub(crate) fn add_rms_norm_q8(m: &HostMemory, a: &AddRmsNormQ8) -> Result<(), CudaError> {
    let h = a.hidden;
    let nb = h / BLOCK;
    let row_bytes = nb * Q8_BLOCK_BYTES;
    let NormRows {
        x,
        w,
        delta,
        out_rows,
        out_len,
    } = norm_rows(
        m,
        (a.x, a.delta, a.w),
        (a.xq, row_bytes),
        a.out_row,
        (a.n, h),
    )?;
    // SAFETY: xq is disjoint from x, w and delta (checked by norm_rows).
    let xq = unsafe { m.slice_mut::<u8>(a.xq, out_len * row_bytes)? };
    let mut blocks = vec![Q8Block::default(); nb];
    for (i, xr) in x.chunks_exact_mut(h).enumerate() {
        let d = delta.map(|d| &d[i * h..(i + 1) * h]);
        // A skipped row still takes its residual add (as the kernel does).
        reference::add_rms_norm_q8(xr, d, w, a.eps, &mut blocks);
        if let Ok(o) = usize::try_from(out_rows[i]) {
            pack_q8_rows(&blocks, nb, &mut xq[o * row_bytes..(o + 1) * row_bytes]);
        }
    }
    Ok(())
}

/// Each row's output row: `out_row[i]` (`i32`, -1: none), or `i` when 0.
pub(crate) fn out_rows(m: &HostMemory, out_row: u64, n: usize) -> Result<Vec<i32>, CudaError> {
    Ok(if out_row != 0 {
        // SAFETY: read-only; copied out before any write.
        unsafe { m.slice::<i32>(out_row, n) }?.to_vec()
    } else {
        (0..n as i32).collect()
    })
}

pub(crate) fn add_bias(m: &HostMemory, a: &AddBias) -> Result<(), CudaError> {
    disjoint(&[(a.y, a.n * a.stride * 4), (a.b, a.d * 4)])?;
    // SAFETY: y is disjoint from the bias (checked above).
    let (y, b) = unsafe {
        (
            m.slice_mut::<f32>(a.y, a.n * a.stride)?,
            m.slice::<f32>(a.b, a.d)?,
        )
    };
    for row in y.chunks_exact_mut(a.stride) {
        for (v, bv) in row[..a.d].iter_mut().zip(b) {
            *v += bv;
        }
    }
    Ok(())
}

pub(crate) fn rope_kv_append(m: &HostMemory, a: &RopeKvAppend) -> Result<(), CudaError> {
    let (n, hd) = (a.n, a.head_dim);
    let kvd = a.num_k_heads * hd;
    // SAFETY: read-only, copied out before any write.
    let (pos, slots) = unsafe {
        (
            m.slice::<u32>(a.pos, n)?.to_vec(),
            m.slice::<u32>(a.slot_mapping, n)?.to_vec(),
        )
    };
    let rot = a.rotary_dim;
    let table_len = (max_u32(&pos) + 1) * rot;
    let cache_len = (max_u32(&slots) + 1) * kvd;
    let mut ranges = vec![
        (a.qkv, n * a.stride * 4),
        (a.table, table_len * 4),
        (a.k_cache, cache_len * 2),
        (a.v_cache, cache_len * 2),
    ];
    if a.q_norm != 0 {
        ranges.extend([(a.q_norm, hd * 4), (a.k_norm, hd * 4)]);
    }
    disjoint(&ranges)?;
    let norm = if a.q_norm != 0 {
        // SAFETY: read-only weights, disjoint from every output (checked above).
        let (q, k) = unsafe { (m.slice::<f32>(a.q_norm, hd)?, m.slice::<f32>(a.k_norm, hd)?) };
        Some(reference::QkNorm { q, k, eps: a.eps })
    } else {
        None
    };
    // SAFETY: qkv and both caches are disjoint from each other and the
    // table (checked above).
    let (qkv, table, kc, vc) = unsafe {
        (
            m.slice_mut::<f32>(a.qkv, n * a.stride)?,
            m.slice::<f32>(a.table, table_len)?,
            m.slice_mut::<f16>(a.k_cache, cache_len)?,
            m.slice_mut::<f16>(a.v_cache, cache_len)?,
        )
    };
    let width = (a.num_q_heads + 2 * a.num_k_heads) * hd;
    for ((row, &p), &slot) in qkv.chunks_exact_mut(a.stride).zip(&pos).zip(&slots) {
        let dst = slot as usize * kvd..(slot as usize + 1) * kvd;
        reference::rope_kv_append(
            &mut row[..width],
            (a.num_q_heads, a.num_k_heads),
            (hd, rot),
            &table[p as usize * rot..(p as usize + 1) * rot],
            a.interleaved,
            norm,
            (&mut kc[dst.clone()], &mut vc[dst]),
        );
    }
    Ok(())
}

/// `paged_attention` (one query row per sequence) in the arithmetic of
/// `prefill_attention`'s reference: the two kernels compute the same
/// attention (up to the order of their sums on a GPU: the decode pair's is
/// `reference::decode_attention`, held bit for bit against its source by
/// `tests/kernel_source.rs`), and here a position comes out bit for bit
/// alike whichever step computes it (decode, a prefill chunk, a re-prefill
/// after preemption, a drafted row), as on the CPU runtime, so the engine's
/// equivalence tests hold on the host device exactly. The ranges' scratch
/// must be live and large enough for the rows, as the split pass writes it.
pub(crate) fn paged_attention(m: &HostMemory, a: &PagedAttention) -> Result<(), CudaError> {
    if a.max_splits == 0 {
        return Err(CudaError::Unsupported(
            "paged_attention with no key range".to_owned(),
        ));
    }
    m.check::<f32>(a.part, a.n * a.num_heads * a.max_splits * (a.head_dim + 2))?;
    prefill_attention(m, &PrefillAttention { attn: *a })
}

/// `prefill_attention`: its host reference ([`reference::prefill_attention`],
/// held bit for bit against the kernel by `tests/kernel_source.rs`) on the
/// metadata and cache the rows name.
pub(crate) fn prefill_attention(m: &HostMemory, a: &PrefillAttention) -> Result<(), CudaError> {
    let a = a.attn;
    let window = a.window;
    let (n, hd, ps) = (a.n, a.head_dim, a.page_size);
    let kv_dim = a.num_kv_heads * hd;
    // SAFETY: read-only metadata slices, copied before any write.
    let (row_seq, row_pos) = unsafe {
        (
            m.slice::<u32>(a.row_seq, n)?.to_vec(),
            m.slice::<u32>(a.row_pos, n)?.to_vec(),
        )
    };
    // SAFETY: as above.
    let kv_indptr = unsafe { m.slice::<u32>(a.kv_indptr, max_u32(&row_seq) + 2)?.to_vec() };
    // The pages each sequence's furthest row reaches, past its first.
    let reach = row_seq
        .iter()
        .zip(&row_pos)
        .map(|(&s, &p)| kv_indptr[s as usize] as usize + (p as usize / ps + 1))
        .max()
        .unwrap_or(0);
    // SAFETY: as above.
    let kv_indices = unsafe { m.slice::<u32>(a.kv_indices, reach)?.to_vec() };
    let cache_len = (max_u32(&kv_indices) + 1) * ps * kv_dim;
    let out_len = n * a.num_heads * hd;
    disjoint(&[
        (a.out, out_len * 2),
        (a.qkv, n * a.stride * 4),
        (a.k_cache, cache_len * 2),
        (a.v_cache, cache_len * 2),
    ])?;
    // SAFETY: the output is disjoint from every input (checked above).
    let (qkv, kc, vc, out) = unsafe {
        (
            m.slice::<f32>(a.qkv, n * a.stride)?,
            m.slice::<f16>(a.k_cache, cache_len)?,
            m.slice::<f16>(a.v_cache, cache_len)?,
            m.slice_mut::<f16>(a.out, out_len)?,
        )
    };
    let shape = reference::AttnShape {
        num_heads: a.num_heads,
        num_kv_heads: a.num_kv_heads,
        head_dim: hd,
        page_size: ps,
        scale: a.scale,
        window,
    };
    let rows = reference::AttnRows {
        qkv,
        stride: a.stride,
        row_seq: &row_seq,
        row_pos: &row_pos,
        kv_indptr: &kv_indptr,
        kv_indices: &kv_indices,
    };
    reference::prefill_attention(&shape, &rows, kc, vc, out);
    Ok(())
}

/// `gated_f16` of `swiglu.cu`: `act(gate, up)` of each row's halves, as f16.
fn gated_f16(
    m: &HostMemory,
    (gate_up, out, f, n): (u64, u64, usize, usize),
    act: impl Fn(f32, f32) -> f32,
) -> Result<(), CudaError> {
    disjoint(&[(gate_up, n * 2 * f * 4), (out, n * f * 2)])?;
    // SAFETY: the output is disjoint from the input (checked above).
    let (gu, out) = unsafe {
        (
            m.slice::<f32>(gate_up, n * 2 * f)?,
            m.slice_mut::<f16>(out, n * f)?,
        )
    };
    for (row, o) in gu.chunks_exact(2 * f).zip(out.chunks_exact_mut(f)) {
        let (g, u) = row.split_at(f);
        for ((ov, &gv), &uv) in o.iter_mut().zip(g).zip(u) {
            *ov = f16::from_f32(act(gv, uv));
        }
    }
    Ok(())
}

/// `gated_q8` of `swiglu.cu`: each row's gated activation quantized per
/// 32-element block (`row_q8`, the activation's reference).
fn gated_q8(
    m: &HostMemory,
    (gate_up, xq, f, n): (u64, u64, usize, usize),
    row_q8: impl Fn(&[f32], &mut [Q8Block]),
) -> Result<(), CudaError> {
    let nb = f / BLOCK;
    disjoint(&[(gate_up, n * 2 * f * 4), (xq, n * nb * Q8_BLOCK_BYTES)])?;
    // SAFETY: the output is disjoint from the input (checked above).
    let (gu, xq) = unsafe {
        (
            m.slice::<f32>(gate_up, n * 2 * f)?,
            m.slice_mut::<u8>(xq, n * nb * Q8_BLOCK_BYTES)?,
        )
    };
    let mut blocks = vec![Q8Block::default(); nb];
    for (row, o) in gu
        .chunks_exact(2 * f)
        .zip(xq.chunks_exact_mut(nb * Q8_BLOCK_BYTES))
    {
        row_q8(row, &mut blocks);
        pack_q8_rows(&blocks, nb, o);
    }
    Ok(())
}

pub(crate) fn swiglu(m: &HostMemory, a: &Swiglu) -> Result<(), CudaError> {
    gated_f16(m, (a.gate_up, a.out, a.f, a.n), |g, u| {
        g / (1.0 + kexp(-g)) * u
    })
}

pub(crate) fn swiglu_q8(m: &HostMemory, a: &SwigluQ8) -> Result<(), CudaError> {
    gated_q8(m, (a.gate_up, a.xq, a.f, a.n), reference::swiglu_q8)
}

pub(crate) fn gelu_mul(m: &HostMemory, a: &GeluMul) -> Result<(), CudaError> {
    gated_f16(m, (a.gate_up, a.out, a.f, a.n), reference::gelu_tanh_mul)
}

pub(crate) fn gelu_mul_q8(m: &HostMemory, a: &GeluMulQ8) -> Result<(), CudaError> {
    gated_q8(m, (a.gate_up, a.xq, a.f, a.n), reference::gelu_mul_q8)
}

pub(crate) fn rms_norm_f32(m: &HostMemory, a: &RmsNormF32) -> Result<(), CudaError> {
    let h = a.hidden;
    disjoint(&[(a.x, a.n * h * 4), (a.w, h * 4)])?;
    // SAFETY: x (rewritten in place) is disjoint from w (checked above).
    let (x, w) = unsafe { (m.slice_mut::<f32>(a.x, a.n * h)?, m.slice::<f32>(a.w, h)?) };
    for row in x.chunks_exact_mut(h) {
        reference::rms_norm_f32(row, w, a.eps);
    }
    Ok(())
}

pub(crate) fn scale_f32(m: &HostMemory, a: &ScaleF32) -> Result<(), CudaError> {
    // SAFETY: the only slice alive.
    let x = unsafe { m.slice_mut::<f32>(a.x, a.len)? };
    x.iter_mut().for_each(|v| *v *= a.s);
    Ok(())
}

pub(crate) fn softcap(m: &HostMemory, a: &Softcap) -> Result<(), CudaError> {
    // SAFETY: the only slice alive.
    let x = unsafe { m.slice_mut::<f32>(a.x, a.len)? };
    x.iter_mut()
        .for_each(|v| *v = reference::softcap(*v, a.cap));
    Ok(())
}

pub(crate) fn add_layer_norm(m: &HostMemory, a: &AddLayerNorm) -> Result<(), CudaError> {
    let (h, n) = (a.hidden, a.n);
    let out_row = out_rows(m, a.out_row, n)?;
    let out_rows_n = out_row.iter().map(|&o| o + 1).max().unwrap_or(0).max(0) as usize;
    let mut ranges = vec![
        (a.x, n * h * 4),
        (a.w, h * 4),
        (a.b, h * 4),
        (a.out, out_rows_n * h * 2),
    ];
    if a.delta != 0 {
        ranges.push((a.delta, n * h * 4));
    }
    disjoint(&ranges)?;
    // SAFETY: x and out are disjoint from each other and the read-only
    // inputs (checked above).
    let (x, w, b, out) = unsafe {
        (
            m.slice_mut::<f32>(a.x, n * h)?,
            m.slice::<f32>(a.w, h)?,
            m.slice::<f32>(a.b, h)?,
            m.slice_mut::<f16>(a.out, out_rows_n * h)?,
        )
    };
    let delta = if a.delta != 0 {
        // SAFETY: read-only, disjoint from the outputs (checked above).
        Some(unsafe { m.slice::<f32>(a.delta, n * h)? })
    } else {
        None
    };
    let mut row = vec![0f32; h];
    for (i, xr) in x.chunks_exact_mut(h).enumerate() {
        let d = delta.map(|d| &d[i * h..(i + 1) * h]);
        reference::add_layer_norm(xr, d, (w, b), a.eps, &mut row);
        if let Ok(o) = usize::try_from(out_row[i]) {
            out[o * h..(o + 1) * h].convert_from_f32_slice(&row);
        }
    }
    Ok(())
}

pub(crate) fn add_f32(m: &HostMemory, a: &AddF32) -> Result<(), CudaError> {
    disjoint(&[(a.x, a.len * 4), (a.y, a.len * 4)])?;
    // SAFETY: x is disjoint from y (checked above).
    let (x, y) = unsafe { (m.slice_mut::<f32>(a.x, a.len)?, m.slice::<f32>(a.y, a.len)?) };
    x.iter_mut().zip(y).for_each(|(x, y)| *x += y);
    Ok(())
}

pub(crate) fn bias_gelu(m: &HostMemory, a: &BiasGelu) -> Result<(), CudaError> {
    let (f, n) = (a.f, a.n);
    let mut ranges = vec![(a.y, n * f * 4), (a.out, n * f * 2)];
    if a.b != 0 {
        ranges.push((a.b, f * 4));
    }
    disjoint(&ranges)?;
    // SAFETY: the output is disjoint from the inputs (checked above).
    let (y, out) = unsafe {
        (
            m.slice::<f32>(a.y, n * f)?,
            m.slice_mut::<f16>(a.out, n * f)?,
        )
    };
    let b = if a.b != 0 {
        // SAFETY: read-only, disjoint from the output (checked above).
        Some(unsafe { m.slice::<f32>(a.b, f)? })
    } else {
        None
    };
    for (yr, or) in y.chunks_exact(f).zip(out.chunks_exact_mut(f)) {
        for (j, (&v, o)) in yr.iter().zip(or).enumerate() {
            let v = b.map_or(v, |b| v + b[j]);
            *o = f16::from_f32(reference::gelu_tanh(v));
        }
    }
    Ok(())
}

pub(crate) fn reset_counts(m: &HostMemory, a: &ResetCounts) -> Result<(), CudaError> {
    // SAFETY: read-only, copied out before any write.
    let rows = unsafe { m.slice::<u32>(a.rows, a.n) }?.to_vec();
    for r in rows {
        // SAFETY: the only slice alive.
        let c = unsafe { m.slice_mut::<u32>(a.counts + 4 * (r as u64 * a.vocab as u64), a.vocab) }?;
        c.fill(0);
    }
    Ok(())
}

/// `count_tokens`: its reference on each listed row's counts.
pub(crate) fn count_tokens(m: &HostMemory, a: &CountTokens) -> Result<(), CudaError> {
    // SAFETY: read-only, copied out before any write.
    let (rows, indptr) = unsafe {
        (
            m.slice::<u32>(a.rows, a.n)?.to_vec(),
            m.slice::<u32>(a.indptr, a.n + 1)?.to_vec(),
        )
    };
    // SAFETY: as above.
    let tokens = unsafe { m.slice::<u32>(a.tokens, max_u32(&indptr))?.to_vec() };
    for (i, &r) in rows.iter().enumerate() {
        // SAFETY: the only slice alive.
        let c = unsafe { m.slice_mut::<u32>(a.counts + 4 * (r as u64 * a.vocab as u64), a.vocab) }?;
        reference::count_tokens(c, &tokens[indptr[i] as usize..indptr[i + 1] as usize]);
    }
    Ok(())
}

/// Member `i`'s row offsets `qo[i]..=qo[i + 1]` and KV rows, copied out.
fn members(
    m: &HostMemory,
    qo: u64,
    kv_rows: u64,
    n: usize,
) -> Result<(Vec<u32>, Vec<u32>), CudaError> {
    // SAFETY: read-only, copied out before any write.
    unsafe {
        Ok((
            m.slice::<u32>(qo, n + 1)?.to_vec(),
            m.slice::<u32>(kv_rows, n)?.to_vec(),
        ))
    }
}

/// `verify_inputs`: its reference.
pub(crate) fn verify_inputs(m: &HostMemory, a: &VerifyInputs) -> Result<(), CudaError> {
    let (qo, rows) = members(m, a.qo, a.kv_rows, a.n)?;
    let total = qo[a.n] as usize;
    // SAFETY: read-only, copied out before any write.
    let (pending, drafts) = unsafe {
        (
            m.slice::<u32>(a.pending, max_u32(&rows) + 1)?.to_vec(),
            m.slice::<u32>(a.drafts, total - a.n)?.to_vec(),
        )
    };
    // SAFETY: the only slice alive.
    let tokens = unsafe { m.slice_mut::<u32>(a.tokens, total)? };
    reference::verify_inputs(&pending, &rows, &qo, &drafts, tokens);
    Ok(())
}

/// `draft_counts`: its reference, row by row.
pub(crate) fn draft_counts(m: &HostMemory, a: &DraftCounts) -> Result<(), CudaError> {
    let (qo, rows) = members(m, a.qo, a.kv_rows, a.n)?;
    let v = a.vocab;
    // SAFETY: read-only, copied out before any write.
    let tokens = unsafe { m.slice::<u32>(a.tokens, qo[a.n] as usize)?.to_vec() };
    for (i, &r) in rows.iter().enumerate() {
        // SAFETY: as above.
        let counts = unsafe {
            m.slice::<u32>(a.counts + 4 * (r as u64 * v as u64), v)?
                .to_vec()
        };
        let start = qo[i] as usize;
        for q in start..(qo[i + 1] as usize).min(start + a.max_rows) {
            // SAFETY: the only slice alive.
            let out = unsafe { m.slice_mut::<u32>(a.scratch + 4 * (q * v) as u64, v)? };
            reference::draft_counts(&counts, &tokens[start + 1..=q], out);
        }
    }
    Ok(())
}

/// `accept_drafts`: its reference, member by member.
pub(crate) fn accept_drafts(m: &HostMemory, a: &AcceptDrafts) -> Result<(), CudaError> {
    let (qo, rows) = members(m, a.qo, a.kv_rows, a.n)?;
    let total = qo[a.n] as usize;
    // SAFETY: read-only, copied out before any write.
    let (tokens, sampled) = unsafe {
        (
            m.slice::<u32>(a.tokens, total)?.to_vec(),
            m.slice::<u32>(a.sampled, total)?.to_vec(),
        )
    };
    for (i, &r) in rows.iter().enumerate() {
        let (s, e) = (qo[i] as usize, qo[i + 1] as usize);
        // SAFETY: the only slice alive.
        let c = unsafe { m.slice_mut::<u32>(a.counts + 4 * (r as u64 * a.vocab as u64), a.vocab)? };
        let (next, took) = reference::accept_drafts(&tokens[s + 1..e], &sampled[s..e], c);
        // SAFETY: the only slice alive (one word).
        let p = unsafe { m.slice_mut::<u32>(a.pending + 4 * u64::from(r), 1)? };
        p[0] = next;
        // SAFETY: as above.
        let n = unsafe { m.slice_mut::<u32>(a.accepted + 4 * i as u64, 1)? };
        n[0] = took;
    }
    Ok(())
}
