//! Host references of the kernels added for issue 31 (`kernels/quant.cu`,
//! `add_rms_norm_q8`, `swiglu_q8`, `rope_kv_append`) and for the families of
//! issue 32 (q/k norms in `rope_kv_append`, `rms_norm_f32`, `gelu_mul_q8`,
//! `softcap`): each does its kernel's
//! arithmetic in the kernel's order (warp lanes, butterfly and block sums
//! included), with plain slice signatures, so a host stand-in for the
//! device can call them. `tests/kernel_source.rs` runs the CUDA source on
//! the host against these, bit for bit; `quant::tests` holds them against
//! kestrel-cpu's kernels.

use half::f16;
use kestrel_model::quant::{f16_at, scale_min_k4};
use kestrel_model::DType;

use crate::kernels::MMVQ_WARPS;
use crate::quant::{encoded_bytes, Q8Block, BLOCK};

/// A warp's butterfly sum (`warp_sum` in `common.cuh`): every lane ends with
/// the same value, lane 0's is returned.
pub fn warp_sum(mut v: [f32; 32]) -> f32 {
    for o in [16, 8, 4, 2, 1] {
        let prev = v;
        for (i, x) in v.iter_mut().enumerate() {
            *x = prev[i] + prev[i ^ o];
        }
    }
    v[0]
}

/// `block_sum` of `common.cuh` over one value per thread.
pub fn block_sum(per_thread: &[f32]) -> f32 {
    let warps: Vec<f32> = per_thread
        .chunks(32)
        .map(|w| warp_sum(std::array::from_fn(|i| w.get(i).copied().unwrap_or(0.0))))
        .collect();
    warp_sum(std::array::from_fn(|i| {
        warps.get(i).copied().unwrap_or(0.0)
    }))
}

/// `warp_quantize` of `common.cuh`, for each 32-element block of `x`.
pub fn quantize_q8(x: &[f32], out: &mut [Q8Block]) {
    assert_eq!(x.len(), BLOCK * out.len(), "x must be whole blocks of out");
    for (xb, o) in x.chunks_exact(BLOCK).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        let mut sum = 0i32;
        for (q, &v) in o.q.iter_mut().zip(xb) {
            let qi = (v * id).round_ties_even() as i32;
            sum += qi;
            *q = qi as i8;
        }
        o.d = d;
        o.s = d * sum as f32;
    }
}

/// `quantize_q8_h` of `quant.cu`: f16 rows (the attention output, the final
/// norm's rows) to int8 blocks.
pub fn quantize_q8_h(x: &[f16], out: &mut [Q8Block]) {
    let v: Vec<f32> = x.iter().map(|h| h.to_f32()).collect();
    quantize_q8(&v, out);
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// A 32-element block's integer weights, the scales of its elements 0..16
/// and 16..32 (equal but for Q6_K) and its minimum (`load_block`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WeightBlock {
    pub w: [i32; BLOCK],
    pub d: [f32; 2],
    pub m: f32,
}

/// `load_block<T>` of `quant.cu`: block `b` (of 32 elements) of an encoded
/// row of a quantized `dtype`.
pub fn load_block(dtype: DType, row: &[u8], b: usize) -> WeightBlock {
    let bb = dtype.block_bytes();
    let nib = |qs: &[u8], i: usize| if i < 16 { qs[i] & 15 } else { qs[i - 16] >> 4 };
    let one = |d: f32| [d, d];
    match dtype {
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => {
            let blk = &row[b * bb..(b + 1) * bb];
            let (qs_at, qh, off) = match dtype {
                DType::Q4_0 => (2, 0, 8),
                DType::Q4_1 => (4, 0, 0),
                DType::Q5_0 => (6, u32_at(blk, 2), 16),
                _ => (8, u32_at(blk, 4), 0),
            };
            let m = if matches!(dtype, DType::Q4_1 | DType::Q5_1) {
                f16_at(blk, 2)
            } else {
                0.0
            };
            WeightBlock {
                w: std::array::from_fn(|i| {
                    (i32::from(nib(&blk[qs_at..], i)) | (((qh >> i) & 1) << 4) as i32) - off
                }),
                d: one(f16_at(blk, 0)),
                m,
            }
        }
        DType::Q8_0 => {
            let blk = &row[b * bb..(b + 1) * bb];
            WeightBlock {
                w: std::array::from_fn(|i| i32::from(blk[2 + i] as i8)),
                d: one(f16_at(blk, 0)),
                m: 0.0,
            }
        }
        DType::Q4K | DType::Q5K => {
            let sb = &row[(b / 8) * bb..(b / 8 + 1) * bb];
            let j = b % 8;
            let (sc, mn) = scale_min_k4(j, &sb[4..16]);
            let qs = &sb[if dtype == DType::Q4K { 16 } else { 48 } + 32 * (j / 2)..];
            WeightBlock {
                w: std::array::from_fn(|l| {
                    let q = i32::from((qs[l] >> (4 * (j % 2))) & 15);
                    let h = if dtype == DType::Q5K {
                        i32::from((sb[16 + l] >> j) & 1) << 4
                    } else {
                        0
                    };
                    q | h
                }),
                d: one(f16_at(sb, 0) * f32::from(sc)),
                m: -(f16_at(sb, 2) * f32::from(mn)),
            }
        }
        DType::Q6K => {
            let sb = &row[(b / 8) * bb..(b / 8 + 1) * bb];
            let (n, tt) = ((b % 8) / 4, b % 4);
            let ql = &sb[64 * n + 32 * (tt & 1)..];
            let qh = &sb[128 + 32 * n..];
            let d = f16_at(sb, 208);
            let sc = |k: usize| d * f32::from(sb[192 + 8 * n + 2 * tt + k] as i8);
            WeightBlock {
                w: std::array::from_fn(|l| {
                    let q = (ql[l] >> (4 * (tt >> 1))) & 15;
                    let h = ((qh[l] >> (2 * tt)) & 3) << 4;
                    i32::from(q | h) - 32
                }),
                d: [sc(0), sc(1)],
                m: 0.0,
            }
        }
        DType::F32 | DType::F16 | DType::BF16 => {
            unreachable!("{dtype} has no integer blocks")
        }
    }
}

/// `mmvq_*` of `quant.cu`: `y[r * rows + o] = W[o] . x[r]` for `n` rows of
/// quantized activations `xq` (`cols / 32` blocks each), `w` the stored
/// rows of a quantized `dtype`. Row `o` is one block of `MMVQ_WARPS` warps;
/// thread `t` takes lane `k = t % 4` of the block pairs `(2p, 2p + 1)` for
/// `p = t / 4, t / 4 + 32, ...` (and of a last unpaired block after its
/// pairs): elements `4k..4k + 4` and `16 + 4k..16 + 4k + 4` of each, its
/// blocks in order. See the kernel for the float steps; the sum is a warp
/// butterfly per warp, then the warps' sums in warp order.
pub fn mmvq(dtype: DType, w: &[u8], rows: usize, cols: usize, xq: &[Q8Block], y: &mut [f32]) {
    const THREADS: usize = MMVQ_WARPS as usize * 32;
    let nb = cols / BLOCK;
    let n = xq.len() / nb;
    assert_eq!(
        xq.len(),
        n * nb,
        "xq must be whole rows of cols / 32 blocks"
    );
    assert_eq!(y.len(), n * rows, "y must be n x rows");
    let rb = encoded_bytes(dtype, 1, cols);
    let has_min = matches!(dtype, DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K);
    let two = dtype == DType::Q6K;
    // Per activation row, each thread's running sums; each weight block is
    // decoded once for all n rows (the kernel's float steps per row and
    // thread are unchanged).
    let mut acc = vec![[0f32; THREADS]; n];
    let mut mins = vec![[0f32; THREADS]; n];
    for o in 0..rows {
        let row = &w[o * rb..(o + 1) * rb];
        acc.iter_mut().for_each(|a| *a = [0.0; THREADS]);
        mins.iter_mut().for_each(|m| *m = [0.0; THREADS]);
        for b in 0..nb {
            let wb = load_block(dtype, row, b);
            for k in 0..4 {
                let t = 4 * ((b / 2) % (THREADS / 4)) + k;
                let (lo, hi) = (4 * k..4 * k + 4, 16 + 4 * k..20 + 4 * k);
                for r in 0..n {
                    let xb = &xq[r * nb + b];
                    let isum = |range: std::ops::Range<usize>| -> i32 {
                        range.map(|i| wb.w[i] * i32::from(xb.q[i])).sum::<i32>()
                    };
                    let a = &mut acc[r][t];
                    if two {
                        *a = (isum(lo.clone()) as f32).mul_add(wb.d[0] * xb.d, *a);
                        *a = (isum(hi.clone()) as f32).mul_add(wb.d[1] * xb.d, *a);
                    } else {
                        let s = isum(lo.clone()) + isum(hi.clone());
                        *a = (s as f32).mul_add(wb.d[0] * xb.d, *a);
                    }
                    if has_min && k == 0 {
                        let m = &mut mins[r][t];
                        *m = wb.m.mul_add(xb.s, *m);
                    }
                }
            }
        }
        for r in 0..n {
            let warps = (0..MMVQ_WARPS as usize).map(|wi| {
                warp_sum(std::array::from_fn(|l| {
                    acc[r][32 * wi + l] + mins[r][32 * wi + l]
                }))
            });
            y[r * rows + o] = warps.reduce(|s, v| s + v).unwrap_or(0.0);
        }
    }
}

/// `dequant_elem` of `quant.cu`: element `e` of an encoded row, exactly as
/// ggml decodes it.
pub fn dequant_elem(dtype: DType, row: &[u8], e: usize) -> f32 {
    match dtype {
        DType::F32 => f32::from_bits(u32_at(row, 4 * e)),
        DType::F16 => f16_at(row, 2 * e),
        DType::BF16 => {
            f32::from_bits(u32::from(u16::from_le_bytes([row[2 * e], row[2 * e + 1]])) << 16)
        }
        DType::Q8_0 => {
            let b = &row[(e / 32) * 34..];
            f16_at(b, 0) * f32::from(b[2 + e % 32] as i8)
        }
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => {
            let b = &row[(e / 32) * dtype.block_bytes()..];
            let l = e % 32;
            let qs_at = match dtype {
                DType::Q4_0 => 2,
                DType::Q4_1 => 4,
                DType::Q5_0 => 6,
                _ => 8,
            };
            let byte = b[qs_at + l % 16];
            let mut q = i32::from(if l < 16 { byte & 15 } else { byte >> 4 });
            let d = f16_at(b, 0);
            match dtype {
                DType::Q4_0 => d * (q as f32 - 8.0),
                DType::Q4_1 => d * q as f32 + f16_at(b, 2),
                _ => {
                    let qh = u32_at(b, if dtype == DType::Q5_0 { 2 } else { 4 });
                    q |= (((qh >> l) & 1) << 4) as i32;
                    if dtype == DType::Q5_0 {
                        d * (q - 16) as f32
                    } else {
                        d * q as f32 + f16_at(b, 2)
                    }
                }
            }
        }
        DType::Q4K | DType::Q5K => {
            let sb = &row[(e / 256) * dtype.block_bytes()..];
            let (j, l) = ((e / 32) % 8, e % 32);
            let (sc, mn) = scale_min_k4(j, &sb[4..16]);
            let d1 = f16_at(sb, 0) * f32::from(sc);
            let m1 = f16_at(sb, 2) * f32::from(mn);
            let at = if dtype == DType::Q4K { 16 } else { 48 } + 32 * (j / 2) + l;
            let mut q = (sb[at] >> (4 * (j % 2))) & 15;
            if dtype == DType::Q5K {
                q |= ((sb[16 + l] >> j) & 1) << 4;
            }
            d1 * f32::from(q) - m1
        }
        DType::Q6K => {
            let sb = &row[(e / 256) * 210..];
            let w = e % 256;
            let (n, tt, l) = (w / 128, (w / 32) % 4, w % 32);
            let mut q = (sb[64 * n + 32 * (tt & 1) + l] >> (4 * (tt >> 1))) & 15;
            q |= ((sb[128 + 32 * n + l] >> (2 * tt)) & 3) << 4;
            let s = f16_at(sb, 208) * f32::from(sb[192 + 8 * n + 2 * tt + l / 16] as i8);
            s * (i32::from(q) - 32) as f32
        }
    }
}

/// `dequant_f16` of `quant.cu` for rows `row0..row0 + out.len() / cols`.
pub fn dequant_f16(dtype: DType, w: &[u8], row0: usize, cols: usize, out: &mut [f16]) {
    let rb = encoded_bytes(dtype, 1, cols);
    for (r, o) in out.chunks_exact_mut(cols).enumerate() {
        let row = &w[(row0 + r) * rb..(row0 + r + 1) * rb];
        for (c, v) in o.iter_mut().enumerate() {
            *v = f16::from_f32(dequant_elem(dtype, row, c));
        }
    }
}

/// `kexp` of `common.cuh` (kestrel-cpu's `ops::exp`, step by step).
pub fn kexp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.3, 88.7);
    let n = (xc * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, xc));
    let mut p = 1.987_569_1e-4f32;
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5, // Cephes' 5.0000001e-1, as f32
    ] {
        p = p.mul_add(r, c);
    }
    let y = (p * r).mul_add(r, r) + 1.0;
    let scale = f32::from_bits((((n as i32) + 127) as u32) << 23);
    if x < -87.3 {
        0.0
    } else {
        y * scale
    }
}

/// Threads per block the runtime launches the norm kernels with (one block
/// per row; `NORM_THREADS` of `rmsnorm.cu`).
pub const NORM_THREADS: usize = 1024;

/// `add_and_inv_rms` of `rmsnorm.cu` for one row: `x += delta` and
/// `1 / sqrt(mean(x^2) + eps)` summed as `NORM_THREADS` threads do.
pub fn add_and_inv_rms(x: &mut [f32], delta: Option<&[f32]>, eps: f32) -> f32 {
    if let Some(d) = delta {
        for (a, b) in x.iter_mut().zip(d) {
            *a += b;
        }
    }
    let partials: Vec<f32> = (0..NORM_THREADS)
        .map(|t| {
            x.iter()
                .skip(t)
                .step_by(NORM_THREADS)
                .fold(0f32, |s, v| v.mul_add(*v, s))
        })
        .collect();
    let ss = block_sum(&partials);
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// `add_rms_norm_q8` of `rmsnorm.cu` for one row (`out_row` aside): updates
/// `x` and writes its normalized values' blocks to `out`.
pub fn add_rms_norm_q8(
    x: &mut [f32],
    delta: Option<&[f32]>,
    w: &[f32],
    eps: f32,
    out: &mut [Q8Block],
) {
    let inv = add_and_inv_rms(x, delta, eps);
    let v: Vec<f32> = x.iter().zip(w).map(|(a, b)| a * inv * b).collect();
    quantize_q8(&v, out);
}

/// `swiglu_q8` of `swiglu.cu` for one row: `gate_up` holds `2 f` values
/// (gate then up); `out` receives `f / 32` blocks.
pub fn swiglu_q8(gate_up: &[f32], out: &mut [Q8Block]) {
    let f = gate_up.len() / 2;
    let (g, u) = gate_up.split_at(f);
    let v: Vec<f32> = g
        .iter()
        .zip(u)
        .map(|(&g, &u)| g / (1.0 + kexp(-g)) * u)
        .collect();
    quantize_q8(&v, out);
}

/// The per-head RMSNorm weights of `rope_kv_append` (Qwen3, Gemma 3):
/// Q heads', K heads' (`head_dim` each) and epsilon.
#[derive(Debug, Clone, Copy)]
pub struct QkNorm<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub eps: f32,
}

/// `1 / rms` of one head as `rope_kv_append`'s warp sums it: lane `j` takes
/// elements `j, j + 32, ...` (fma), then the butterfly.
pub fn head_inv_rms(head: &[f32], eps: f32) -> f32 {
    let lanes: [f32; 32] = std::array::from_fn(|l| {
        head.iter()
            .skip(l)
            .step_by(32)
            .fold(0f32, |s, v| v.mul_add(*v, s))
    });
    1.0 / (warp_sum(lanes) / head.len() as f32 + eps).sqrt()
}

/// `rope_kv_append` of `rope_kv.cu` for one row: rotates the Q heads of
/// `qkv` (Q | K | V, `(num_q_heads + 2 num_k_heads) * head_dim` values) in
/// place and writes the rotated K heads and V as f16 to `k_out` and `v_out`
/// (`num_k_heads * head_dim` each, the row's cache slot), each Q and K head
/// RMS-normed first when `norm` is given. Only the first `rot` dimensions
/// of a head rotate (`rot` = `head_dim` but for Phi's partial rotary).
/// `table_row` is the position's row of its layer's RoPE table
/// (`host::rope_table_of` over `rot` dimensions).
pub fn rope_kv_append(
    qkv: &mut [f32],
    heads: (usize, usize),
    (head_dim, rot): (usize, usize),
    table_row: &[f32],
    interleaved: bool,
    norm: Option<QkNorm<'_>>,
    (k_out, v_out): (&mut [f16], &mut [f16]),
) {
    let (nq, nk) = heads;
    let half = rot / 2;
    let (cos, sin) = table_row.split_at(half);
    let kv_dim = nk * head_dim;
    for head in 0..nq + nk {
        let hp = head * head_dim;
        let w = norm.map(|n| {
            let w = if head < nq { n.q } else { n.k };
            (w, head_inv_rms(&qkv[hp..hp + head_dim], n.eps))
        });
        for k in 0..half {
            let (a, b) = if interleaved {
                (2 * k, 2 * k + 1)
            } else {
                (k, k + half)
            };
            let (mut x0, mut x1) = (qkv[hp + a], qkv[hp + b]);
            if let Some((w, inv)) = w {
                x0 = x0 * inv * w[a];
                x1 = x1 * inv * w[b];
            }
            let y0 = x0 * cos[k] - x1 * sin[k];
            let y1 = x0 * sin[k] + x1 * cos[k];
            if head < nq {
                qkv[hp + a] = y0;
                qkv[hp + b] = y1;
            } else {
                let o = (head - nq) * head_dim;
                k_out[o + a] = f16::from_f32(y0);
                k_out[o + b] = f16::from_f32(y1);
            }
        }
        // Partial rotary: the dimensions past `rot` pass through.
        for j in rot..head_dim {
            let mut x = qkv[hp + j];
            if let Some((w, inv)) = w {
                x = x * inv * w[j];
            }
            if head < nq {
                qkv[hp + j] = x;
            } else {
                k_out[(head - nq) * head_dim + j] = f16::from_f32(x);
            }
        }
    }
    let v = &qkv[(nq + nk) * head_dim..(nq + nk) * head_dim + kv_dim];
    for (o, x) in v_out.iter_mut().zip(v) {
        *o = f16::from_f32(*x);
    }
}

/// `rms_norm_f32` of `rmsnorm.cu` for one row, in place (a post-norm).
pub fn rms_norm_f32(x: &mut [f32], w: &[f32], eps: f32) {
    let inv = add_and_inv_rms(x, None, eps);
    for (v, wv) in x.iter_mut().zip(w) {
        *v = *v * inv * wv;
    }
}

/// `gelu_tanh` of `swiglu.cu` (kestrel-cpu's `block::gelu_tanh`, step by
/// step, with the host's tanh).
pub fn gelu_tanh(g: f32) -> f32 {
    let inner = 0.797_884_6f32 * (g + 0.044_715 * g * g * g);
    0.5 * g * (1.0 + inner.tanh())
}

/// `gelu_tanh_mul` of `swiglu.cu` (kestrel-cpu's `block::gelu_tanh_mul`).
pub fn gelu_tanh_mul(g: f32, u: f32) -> f32 {
    gelu_tanh(g) * u
}

/// `add_layer_norm` of `rmsnorm.cu` for one row: `x += delta`, then the
/// normalized values (before their f16 rounding) into `out`, each sum as
/// `NORM_THREADS` threads and their block sum take it.
pub fn add_layer_norm(
    x: &mut [f32],
    delta: Option<&[f32]>,
    (w, b): (&[f32], &[f32]),
    eps: f32,
    out: &mut [f32],
) {
    if let Some(d) = delta {
        for (a, b) in x.iter_mut().zip(d) {
            *a += b;
        }
    }
    let per_thread = |f: &dyn Fn(f32, f32) -> f32| -> Vec<f32> {
        (0..NORM_THREADS)
            .map(|t| {
                x.iter()
                    .skip(t)
                    .step_by(NORM_THREADS)
                    .fold(0f32, |s, v| f(*v, s))
            })
            .collect()
    };
    let h = x.len() as f32;
    let mean = block_sum(&per_thread(&|v, s| s + v)) / h;
    let ss = block_sum(&per_thread(&|v, s| (v - mean).mul_add(v - mean, s)));
    let inv = 1.0 / (ss / h + eps).sqrt();
    for (i, o) in out.iter_mut().enumerate() {
        *o = (x[i] - mean) * inv * w[i] + b[i];
    }
}

// ---- region.cu (Moondream's spatial stage) ----

/// The first index of the largest value, a NaN counting as the largest
/// (`torch.argmax`; `block_argmax` of `region.cu`).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if x.is_nan() {
            return i;
        }
        if *x > v[best] {
            best = i;
        }
    }
    best
}

/// The size of each of `bins` size bins, `2^((bin / (bins - 1)) * 10 -
/// 10)` in f32 (kestrel-cpu's `region::size_from_logits` formula): the
/// table `spatial_values` indexes.
pub fn size_table(bins: usize) -> Vec<f32> {
    (0..bins)
        .map(|b| 2f32.powf(b as f32 / (bins - 1) as f32 * 10.0 - 10.0))
        .collect()
}

/// `spatial_values` of `region.cu` for one row: `[coord, w, h]` for its
/// sampled `token` from its coordinate logits and size logits (`2 *
/// size_table.len()`), `(coord_id, size_id)` saying which is meant.
pub fn spatial_values(
    token: u32,
    (coord_logits, size_logits): (&[f32], &[f32]),
    size_table: &[f32],
    (coord_id, size_id): (u32, u32),
) -> [f32; 3] {
    if token == coord_id {
        let bin = argmax(coord_logits);
        [bin as f32 / coord_logits.len() as f32, 0.0, 0.0]
    } else if token == size_id {
        let (w, h) = size_logits.split_at(size_table.len());
        [0.0, size_table[argmax(w)], size_table[argmax(h)]]
    } else {
        [0.0; 3]
    }
}

/// `fourier_features` of `region.cu` for one row's `[coord, w, h]` (before
/// the f16 rounding): the coordinate encoder's input (`2 coord_w.len()`)
/// and the size encoder's (`size_w` is `[2][half]`; `2 half`).
pub fn fourier_features(v: [f32; 3], coord_w: &[f32], size_w: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let two_pi = 2.0 * std::f32::consts::PI;
    let ca: Vec<f32> = coord_w.iter().map(|w| two_pi * v[0] * w).collect();
    let half = size_w.len() / 2;
    let sa: Vec<f32> = (0..half)
        .map(|k| two_pi * v[1] * size_w[k] + two_pi * v[2] * size_w[half + k])
        .collect();
    let feats = |a: &[f32]| -> Vec<f32> {
        a.iter()
            .map(|a| a.cos())
            .chain(a.iter().map(|a| a.sin()))
            .collect()
    };
    (feats(&ca), feats(&sa))
}

/// `gelu_mul_q8` of `swiglu.cu` for one row, as [`swiglu_q8`].
pub fn gelu_mul_q8(gate_up: &[f32], out: &mut [Q8Block]) {
    let f = gate_up.len() / 2;
    let (g, u) = gate_up.split_at(f);
    let v: Vec<f32> = g
        .iter()
        .zip(u)
        .map(|(&g, &u)| gelu_tanh_mul(g, u))
        .collect();
    quantize_q8(&v, out);
}

/// `softcap` of `gemma.cu`: `cap * tanh(x / cap)`.
pub fn softcap(x: f32, cap: f32) -> f32 {
    cap * (x / cap).tanh()
}

// ---- prefill_attention.cu (issue 32: several query rows per sequence) ----

/// Keys per tile of `prefill_attention` (`PF_KEYS`): a row's softmax is
/// merged tile by tile at multiples of this, whatever block the row is in.
pub const PREFILL_KEYS: usize = 32;

/// The shape of one [`prefill_attention`] (the kernel's scalar arguments).
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub page_size: usize,
    pub scale: f32,
    /// A row attends its last `window` positions; 0: all of them.
    pub window: usize,
}

/// The query rows of one [`prefill_attention`] and their sequences' pages:
/// row `i`'s Q heads start at `qkv[i * stride]`; it belongs to sequence
/// `row_seq[i]` (pages `kv_indices[kv_indptr[s]..]`) at `row_pos[i]`.
#[derive(Debug, Clone, Copy)]
pub struct AttnRows<'a> {
    pub qkv: &'a [f32],
    pub stride: usize,
    pub row_seq: &'a [u32],
    pub row_pos: &'a [u32],
    pub kv_indptr: &'a [u32],
    pub kv_indices: &'a [u32],
}

/// The first key a row at `pos` attends (`pf_lo`).
pub fn attention_lo(pos: u32, window: usize) -> usize {
    let len = pos as usize + 1;
    if window > 0 && len > window {
        len - window
    } else {
        0
    }
}

/// `prefill_attention` of `prefill_attention.cu`: for every row and head,
/// the causal (and windowed) softmax over the row's keys in tiles of
/// [`PREFILL_KEYS`] aligned at multiples of it, each tile's max and
/// butterfly sum as the warp takes them, the output accumulated key by key
/// with fused multiply-adds; `out` gets `row_seq.len() * num_heads *
/// head_dim` f16 values.
pub fn prefill_attention(
    s: &AttnShape,
    rows: &AttnRows<'_>,
    k_cache: &[f16],
    v_cache: &[f16],
    out: &mut [f16],
) {
    let hd = s.head_dim;
    let kv_dim = s.num_kv_heads * hd;
    let group = s.num_heads / s.num_kv_heads;
    let mut acc = vec![0f32; hd];
    for (i, (&seq, &pos)) in rows.row_seq.iter().zip(rows.row_pos).enumerate() {
        let pages = &rows.kv_indices[rows.kv_indptr[seq as usize] as usize..];
        let (lo, len) = (attention_lo(pos, s.window), pos as usize + 1);
        for h in 0..s.num_heads {
            let q = &rows.qkv[i * rows.stride + h * hd..][..hd];
            let off = |key: usize| {
                let page = pages[key / s.page_size] as usize;
                (page * s.page_size + key % s.page_size) * kv_dim + h / group * hd
            };
            let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
            acc.iter_mut().for_each(|a| *a = 0.0);
            let mut k0 = lo / PREFILL_KEYS * PREFILL_KEYS;
            while k0 < len {
                let (va, vb) = (lo.saturating_sub(k0), (len - k0).min(PREFILL_KEYS));
                let mut sc = [f32::NEG_INFINITY; PREFILL_KEYS];
                for (j, scj) in sc.iter_mut().enumerate().take(vb).skip(va) {
                    let k = &k_cache[off(k0 + j)..][..hd];
                    let dot = q
                        .iter()
                        .zip(k)
                        .fold(0f32, |d, (&qd, kd)| qd.mul_add(kd.to_f32(), d));
                    *scj = dot * s.scale;
                }
                let mn = m.max(sc.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)));
                let corr = kexp(m - mn);
                let mut p = [0f32; PREFILL_KEYS];
                for j in va..vb {
                    p[j] = kexp(sc[j] - mn);
                }
                l = l.mul_add(corr, warp_sum(p));
                acc.iter_mut().for_each(|a| *a *= corr);
                for (j, &pj) in p.iter().enumerate().take(vb).skip(va) {
                    let v = &v_cache[off(k0 + j)..][..hd];
                    for (a, vd) in acc.iter_mut().zip(v) {
                        *a = pj.mul_add(vd.to_f32(), *a);
                    }
                }
                m = mn;
                k0 += PREFILL_KEYS;
            }
            let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
            let o = &mut out[(i * s.num_heads + h) * hd..][..hd];
            for (ov, a) in o.iter_mut().zip(&acc) {
                *ov = f16::from_f32(a * inv);
            }
        }
    }
}

// ---- attention.cu (issue 75 item 2: decode attention split over keys) ----

/// Threads of a `paged_attention` block (`ATT_THREADS`).
pub const ATT_THREADS: usize = 128;
/// Query heads of a GQA group per block (`ATT_HB`).
pub const ATT_HB: usize = 4;
/// Dimensions per lane (`ATT_VEC`).
const ATT_VEC: usize = 8;
/// Fewest keys of a range (`ATT_SPLIT_MIN`) and the multiple every range's
/// keys are (`ATT_SPLIT_QUANTUM`).
pub const ATT_SPLIT_MIN: usize = 64;
const ATT_SPLIT_QUANTUM: usize = 32;

/// `att_ranges`: a row's keys `first..len` in ranges of the returned
/// `per` keys (the last shorter), at most `max_splits` of them; returns
/// `(ranges, per)`.
pub fn attention_ranges(first: usize, len: usize, max_splits: usize) -> (usize, usize) {
    let keys = len - first;
    let per = keys
        .div_ceil(max_splits)
        .div_ceil(ATT_SPLIT_QUANTUM)
        .saturating_mul(ATT_SPLIT_QUANTUM)
        .max(ATT_SPLIT_MIN);
    (keys.div_ceil(per), per)
}

/// One key range's online softmax for one head, as `paged_attention`'s
/// slots compute it and its block merges them: `(max, sum, unnormalized
/// output)`.
struct RangeSoftmax {
    m: f32,
    l: f32,
    acc: Vec<f32>,
}

/// `paged_attention` then `paged_attention_merge` of `attention.cu`: each
/// row's keys (window applied) in [`attention_ranges`]; within a range key
/// `j` belongs to slot `(j - k0) % slots` (slots: `ATT_THREADS / 32 * 32 /
/// seg`, `seg` the power of two of lanes covering `head_dim / 8`), each
/// slot an online softmax over its keys in order (the dot product lane by
/// lane with fused multiply-adds over 8 dimensions, then the lanes'
/// butterfly); the range merges its slots in slot order, the row its
/// ranges in order. `out` gets `row_seq.len() * num_heads * head_dim` f16.
pub fn decode_attention(
    s: &AttnShape,
    rows: &AttnRows<'_>,
    k_cache: &[f16],
    v_cache: &[f16],
    max_splits: usize,
    out: &mut [f16],
) {
    let hd = s.head_dim;
    let kv_dim = s.num_kv_heads * hd;
    let group = s.num_heads / s.num_kv_heads;
    let seg = hd.div_ceil(ATT_VEC).next_power_of_two();
    let slots = ATT_THREADS / 32 * (32 / seg);
    for (i, (&seq, &pos)) in rows.row_seq.iter().zip(rows.row_pos).enumerate() {
        let pages = &rows.kv_indices[rows.kv_indptr[seq as usize] as usize..];
        let (first, len) = (attention_lo(pos, s.window), pos as usize + 1);
        let (ranges, per) = attention_ranges(first, len, max_splits);
        for h in 0..s.num_heads {
            let q = &rows.qkv[i * rows.stride + h * hd..][..hd];
            let off = |key: usize| {
                let page = pages[key / s.page_size] as usize;
                (page * s.page_size + key % s.page_size) * kv_dim + h / group * hd
            };
            let parts: Vec<RangeSoftmax> = (0..ranges)
                .map(|r| {
                    let k0 = first + r * per;
                    let k1 = len.min(k0 + per);
                    let mut ms = vec![f32::NEG_INFINITY; slots];
                    let mut ls = vec![0f32; slots];
                    let mut accs = vec![vec![0f32; hd]; slots];
                    for j in k0..k1 {
                        let slot = (j - k0) % slots;
                        let k = &k_cache[off(j)..][..hd];
                        let v = &v_cache[off(j)..][..hd];
                        let mut lanes = vec![0f32; seg];
                        for (sub, lane) in lanes.iter_mut().enumerate() {
                            for e in 0..ATT_VEC {
                                let d = sub * ATT_VEC + e;
                                if d < hd {
                                    *lane = q[d].mul_add(k[d].to_f32(), *lane);
                                }
                            }
                        }
                        let mut o = seg / 2;
                        while o > 0 {
                            let prev = lanes.clone();
                            for (x, lane) in lanes.iter_mut().enumerate() {
                                *lane = prev[x] + prev[x ^ o];
                            }
                            o /= 2;
                        }
                        let sc = lanes[0] * s.scale;
                        let mn = ms[slot].max(sc);
                        let corr = kexp(ms[slot] - mn);
                        let p = kexp(sc - mn);
                        ls[slot] = ls[slot].mul_add(corr, p);
                        for (a, vd) in accs[slot].iter_mut().zip(v) {
                            *a = p.mul_add(vd.to_f32(), *a * corr);
                        }
                        ms[slot] = mn;
                    }
                    let live = || (0..slots).filter(|&x| ls[x] > 0.0);
                    let m = live().fold(f32::NEG_INFINITY, |a, x| a.max(ms[x]));
                    let mut l = 0f32;
                    let mut acc = vec![0f32; hd];
                    for x in live() {
                        let c = kexp(ms[x] - m);
                        l = ls[x].mul_add(c, l);
                        for (a, &sa) in acc.iter_mut().zip(&accs[x]) {
                            *a = c.mul_add(sa, *a);
                        }
                    }
                    RangeSoftmax { m, l, acc }
                })
                .collect();
            let m = parts.iter().fold(f32::NEG_INFINITY, |a, p| a.max(p.m));
            let l = parts
                .iter()
                .fold(0f32, |l, p| p.l.mul_add(kexp(p.m - m), l));
            let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
            let o = &mut out[(i * s.num_heads + h) * hd..][..hd];
            for (d, ov) in o.iter_mut().enumerate() {
                let v = parts
                    .iter()
                    .fold(0f32, |v, p| kexp(p.m - m).mul_add(p.acc[d], v));
                *ov = f16::from_f32(v * inv);
            }
        }
    }
}

// ---- penalty.cu ----

/// `count_tokens` of `penalty.cu` for one row: `counts[t] += 1` for each
/// of `tokens` below the vocabulary (`counts.len()`).
pub fn count_tokens(counts: &mut [u32], tokens: &[u32]) {
    for &t in tokens {
        if let Some(c) = counts.get_mut(t as usize) {
            *c += 1;
        }
    }
}

// ---- verify.cu (draft verification) ----

/// `verify_inputs` of `verify.cu`: the forward's tokens, member by member:
/// its pending token, then its drafts (`qo` offsets its rows).
pub fn verify_inputs(
    pending: &[u32],
    kv_rows: &[u32],
    qo: &[u32],
    drafts: &[u32],
    tokens: &mut [u32],
) {
    for (i, &row) in kv_rows.iter().enumerate() {
        let (a, b) = (qo[i] as usize, qo[i + 1] as usize);
        tokens[a] = pending[row as usize];
        tokens[a + 1..b].copy_from_slice(&drafts[a - i..b - 1 - i]);
    }
}

/// `draft_counts` of `verify.cu` for one row: the member's counts plus the
/// drafts accepted before it (`before`: d_1..d_j).
pub fn draft_counts(counts: &[u32], before: &[u32], out: &mut [u32]) {
    out.copy_from_slice(counts);
    count_tokens(out, before);
}

/// `accept_drafts` of `verify.cu` for one member: with `drafts` d_1..d_m and
/// `sampled` t_0..t_m, the tokens accepted (t_0..=t_k while t_j == d_{j+1}),
/// counted into `counts`; returns (the member's next pending token, k + 1).
pub fn accept_drafts(drafts: &[u32], sampled: &[u32], counts: &mut [u32]) -> (u32, u32) {
    let k = sampled
        .iter()
        .zip(drafts)
        .take_while(|(t, d)| t == d)
        .count();
    count_tokens(counts, &sampled[..=k]);
    (sampled[k], k as u32 + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kestrel_cpu::kernels::ops;
    use kestrel_model::synthetic::Rng;
    use kestrel_model::RopeStyle;

    #[test]
    fn rope_kv_append_rotates_as_the_cpu_runtime_bit_for_bit() {
        let (nq, nk, hd) = (4, 2, 64);
        let table = crate::host::rope_table(40, hd, 10_000.0);
        for (style, interleaved) in [
            (RopeStyle::Interleaved, true),
            (RopeStyle::HalfSplit, false),
        ] {
            let row = Rng(3).vec((nq + 2 * nk) * hd, 2.0);
            let t = &table[37 * hd..38 * hd];
            let mut got = row.clone();
            let (mut k, mut v) = (vec![f16::ZERO; nk * hd], vec![f16::ZERO; nk * hd]);
            rope_kv_append(
                &mut got,
                (nq, nk),
                (hd, hd),
                t,
                interleaved,
                None,
                (&mut k, &mut v),
            );
            let mut cpu = row.clone();
            ops::rope(&mut cpu[..(nq + nk) * hd], hd, t, style);
            assert_eq!(&got[..nq * hd], &cpu[..nq * hd], "{style:?} Q in place");
            let want_k: Vec<f16> = cpu[nq * hd..(nq + nk) * hd]
                .iter()
                .map(|&x| f16::from_f32(x))
                .collect();
            assert_eq!(k, want_k, "{style:?} K to the cache");
            let want_v: Vec<f16> = row[(nq + nk) * hd..]
                .iter()
                .map(|&x| f16::from_f32(x))
                .collect();
            assert_eq!(v, want_v, "{style:?} V to the cache");
            assert_eq!(
                &got[nq * hd..],
                &row[nq * hd..],
                "K and V stay as they were in qkv"
            );
        }
    }

    /// With q/k norms: kestrel-cpu's per-head `ops::rms_norm` then
    /// `ops::rope`, to the rounding of the sum of squares' order (32 lanes
    /// and a butterfly against 8 accumulators).
    #[test]
    fn rope_kv_append_with_qk_norms_follows_the_cpu_runtime() {
        let (nq, nk, hd, eps) = (4, 2, 64, 1e-6);
        let table = crate::host::rope_table(40, hd, 10_000.0);
        let t = &table[21 * hd..22 * hd];
        let (qn, kn) = (Rng(4).vec(hd, 1.0), Rng(5).vec(hd, 1.0));
        let row = Rng(6).vec((nq + 2 * nk) * hd, 3.0);
        let mut got = row.clone();
        let (mut k, mut v) = (vec![f16::ZERO; nk * hd], vec![f16::ZERO; nk * hd]);
        let norm = QkNorm {
            q: &qn,
            k: &kn,
            eps,
        };
        rope_kv_append(
            &mut got,
            (nq, nk),
            (hd, hd),
            t,
            false,
            Some(norm),
            (&mut k, &mut v),
        );
        let mut cpu = row.clone();
        for (h, head) in cpu[..(nq + nk) * hd].chunks_exact_mut(hd).enumerate() {
            let tmp = head.to_vec();
            ops::rms_norm(&tmp, if h < nq { &qn } else { &kn }, eps, head);
        }
        ops::rope(&mut cpu[..(nq + nk) * hd], hd, t, RopeStyle::HalfSplit);
        for (a, b) in got[..nq * hd].iter().zip(&cpu[..nq * hd]) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "Q: {a} vs {b}");
        }
        for (a, b) in k.iter().zip(&cpu[nq * hd..(nq + nk) * hd]) {
            // f16: within one step of the CPU's value rounded.
            assert!(
                (a.to_f32() - b).abs() <= 1e-3 * b.abs().max(1.0),
                "K: {a} vs {b}"
            );
        }
    }

    /// The tiled online softmax is attention: against a two-pass softmax
    /// in f64 over each row's visible keys (GQA 2:1, a cached prefix, a
    /// window that cuts into a tile, pages of 4 in scattered order).
    #[test]
    fn prefill_attention_is_softmax_attention() {
        softmax_attention_case(32, |sh, rows, kc, vc, out| {
            prefill_attention(sh, rows, kc, vc, out)
        });
    }

    /// The split decode attention, the same way: one range and several
    /// (keys past 64 at 4 splits), 8-dimension lanes and a head_dim that is
    /// not a multiple of 8.
    #[test]
    fn decode_attention_is_softmax_attention() {
        assert_eq!(attention_ranges(0, 64, 4), (1, 64));
        assert_eq!(attention_ranges(0, 65, 4), (2, 64));
        assert_eq!(attention_ranges(100, 4196, 16), (16, 256));
        assert_eq!(attention_ranges(0, 4100, 16), (15, 288));
        for hd in [32, 24] {
            for splits in [1, 4] {
                softmax_attention_case(hd, |sh, rows, kc, vc, out| {
                    decode_attention(sh, rows, kc, vc, splits, out)
                });
            }
        }
    }

    fn softmax_attention_case(
        hd: usize,
        run: impl Fn(&AttnShape, &AttnRows<'_>, &[f16], &[f16], &mut [f16]),
    ) {
        let (nh, nkv, ps) = (4usize, 2usize, 4usize);
        let kv_dim = nkv * hd;
        for window in [0usize, 23] {
            let shape = AttnShape {
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                page_size: ps,
                scale: 0.2,
                window,
            };
            let (q_start, n) = (30usize, 40usize);
            let pages: Vec<u32> = (0..(q_start + n).div_ceil(ps) as u32).rev().collect();
            let slots = pages.len() * ps;
            let to16 = |v: Vec<f32>| v.into_iter().map(f16::from_f32).collect::<Vec<_>>();
            let kc = to16(Rng(1).vec(slots * kv_dim, 1.0));
            let vc = to16(Rng(2).vec(slots * kv_dim, 1.0));
            let qkv = Rng(3).vec(n * nh * hd, 1.5);
            let row_seq = vec![0u32; n];
            let row_pos: Vec<u32> = (q_start as u32..(q_start + n) as u32).collect();
            let kv_indptr = [0u32, pages.len() as u32];
            let rows = AttnRows {
                qkv: &qkv,
                stride: nh * hd,
                row_seq: &row_seq,
                row_pos: &row_pos,
                kv_indptr: &kv_indptr,
                kv_indices: &pages,
            };
            let mut out = vec![f16::ZERO; n * nh * hd];
            run(&shape, &rows, &kc, &vc, &mut out);
            for (i, &pos) in row_pos.iter().enumerate() {
                let keys = attention_lo(pos, window)..pos as usize + 1;
                if window > 0 {
                    assert_eq!(keys.len(), window.min(pos as usize + 1));
                }
                for h in 0..nh {
                    let q = &qkv[(i * nh + h) * hd..][..hd];
                    let at =
                        |k: usize| (pages[k / ps] as usize * ps + k % ps) * kv_dim + h / 2 * hd;
                    let sc: Vec<f64> = keys
                        .clone()
                        .map(|k| {
                            let kr = &kc[at(k)..][..hd];
                            let dot: f64 =
                                q.iter().zip(kr).map(|(&a, b)| a as f64 * b.to_f64()).sum();
                            dot * 0.2
                        })
                        .collect();
                    let mx = sc.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                    let w: Vec<f64> = sc.iter().map(|s| (s - mx).exp()).collect();
                    let total: f64 = w.iter().sum();
                    for d in 0..hd {
                        let want: f64 = keys
                            .clone()
                            .zip(&w)
                            .map(|(k, p)| p * vc[at(k) + d].to_f64())
                            .sum::<f64>()
                            / total;
                        let got = out[(i * nh + h) * hd + d].to_f64();
                        assert!(
                            (got - want).abs() < 2e-3,
                            "window {window} row {i} head {h} dim {d}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// LayerNorm: kestrel-cpu's `ops::layer_norm` to the rounding of the
    /// sums' order (1024 threads against 8 lanes).
    #[test]
    fn add_layer_norm_follows_the_cpu_runtime() {
        let h = 2048;
        let (w, b) = (Rng(31).vec(h, 1.0), Rng(32).vec(h, 0.5));
        let (x0, d) = (Rng(33).vec(h, 4.0), Rng(34).vec(h, 1.0));
        let mut x = x0.clone();
        let mut got = vec![0f32; h];
        add_layer_norm(&mut x, Some(&d), (&w, &b), 1e-5, &mut got);
        let sum: Vec<f32> = x0.iter().zip(&d).map(|(a, b)| a + b).collect();
        assert_eq!(x, sum, "x += delta in place");
        let mut cpu = vec![0f32; h];
        ops::layer_norm(&sum, &w, &b, 1e-5, &mut cpu);
        for (g, c) in got.iter().zip(&cpu) {
            assert!((g - c).abs() <= 1e-5 * (1.0 + c.abs()), "{g} vs {c}");
        }
    }

    /// Partial rotary (Phi: the first 32 of 64 dimensions): kestrel-cpu's
    /// `block::rope_partial` is `ops::rope` (half-split) on each head's
    /// first `rot` dimensions with a `rot`-wide table; the rest pass through.
    #[test]
    fn partial_rotary_rotates_the_first_dimensions_only() {
        let (nq, nk, hd, rot) = (4, 4, 64, 32);
        let table = crate::host::rope_table(40, rot, 10_000.0);
        let t = &table[29 * rot..30 * rot];
        let row = Rng(35).vec((nq + 2 * nk) * hd, 2.0);
        let mut got = row.clone();
        let (mut k, mut v) = (vec![f16::ZERO; nk * hd], vec![f16::ZERO; nk * hd]);
        rope_kv_append(
            &mut got,
            (nq, nk),
            (hd, rot),
            t,
            false,
            None,
            (&mut k, &mut v),
        );
        let mut cpu = row.clone();
        for head in cpu[..(nq + nk) * hd].chunks_exact_mut(hd) {
            ops::rope(&mut head[..rot], rot, t, RopeStyle::HalfSplit);
        }
        assert_eq!(&got[..nq * hd], &cpu[..nq * hd], "Q in place");
        let want_k: Vec<f16> = cpu[nq * hd..(nq + nk) * hd]
            .iter()
            .map(|&x| f16::from_f32(x))
            .collect();
        assert_eq!(k, want_k, "K to the cache, its unrotated half included");
        assert_ne!(&got[..rot], &row[..rot], "the rotated part moved");
    }

    /// The spatial stage's pieces against kestrel-cpu's region model:
    /// argmax (first maximum, NaN first), the size of every bin, and the
    /// Fourier features, bit for bit.
    #[test]
    fn spatial_pieces_are_the_cpu_region_model() {
        use kestrel_cpu::vision::region;
        let table = size_table(1024);
        for bin in 0..1024 {
            let mut logits = vec![0f32; 2048];
            logits[bin] = 1.0;
            logits[1024 + (bin * 7) % 1024] = 1.0;
            let cpu = region::size_from_logits(&logits);
            let got = spatial_values(6, (&[0.0; 4], &logits), &table, (5, 6));
            assert_eq!([got[1], got[2]], cpu.value, "bin {bin}");
        }
        let mut v = Rng(36).vec(1024, 3.0);
        v[700] = 50.0;
        v[900] = 50.0;
        assert_eq!(argmax(&v), region::coord_from_logits(&v).bin);
        let got = spatial_values(5, (&v, &[]), &table, (5, 6));
        assert_eq!(got, [700.0 / 1024.0, 0.0, 0.0]);
        v[800] = f32::NAN;
        assert_eq!(argmax(&v), 800);
        assert_eq!(spatial_values(7, (&v, &[]), &table, (5, 6)), [0.0; 3]);
        let (cw, sw) = (Rng(37).vec(128, 8.0), Rng(38).vec(2 * 256, 8.0));
        for vals in [[0.3125f32, 0.0, 0.0], [0.0, 0.125, 0.75]] {
            let (c, s) = fourier_features(vals, &cw, &sw);
            assert_eq!(c, region::fourier_features(&vals[..1], 1, &cw));
            assert_eq!(s, region::fourier_features(&vals[1..], 2, &sw));
        }
    }
}
