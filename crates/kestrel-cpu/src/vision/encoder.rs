//! The vision encoder and projector (Moondream's `vision_encoder` and
//! `vision_projection`; docs/moondream.md), batched over every crop of an
//! image: each linear layer is one GEMM over `crops x 729` rows through
//! [`matmul`] (weights as stored: F32, F16, BF16 or quantized), and each
//! (crop, head)'s attention is two more (`Q K^T`, then `softmax V`) with the
//! keys and the transposed values as F32 operands, padded to 736 keys so
//! that `softmax V` runs in whole 32-float blocks; the (crop, head) pairs,
//! and the row-wise LayerNorms, GELUs and sums, run in parallel on the
//! team. Pre-LN blocks with full
//! (bidirectional) attention and GELU-tanh MLPs, then the tiles' features
//! are stitched without their inner margins, average-pooled back to the
//! crop grid, joined after the global crop's, and projected.
//! Cost: `crops * (27 layers of 729-row GEMMs + 16 heads of 729x729x72
//! attention)`; memory: a few `crops x 729 x max(3 * enc_dim, ff)` buffers.

use std::cell::RefCell;

use kestrel_model::moondream::{LayerNorm, Linear, VisionConfig, VisionWeights};
use kestrel_model::vision::{crops::normalize_pixel, pool_tiles, OverlapCrops, Tiling};

use crate::kernels::matmul::{matmul, MatRef};
use crate::kernels::{Isa, Numerics, OutPtr};
use crate::team::Team;
use crate::CpuError;

/// LayerNorm's epsilon (PyTorch's default, which the reference uses).
const LN_EPS: f32 = 1e-5;

/// Rows per task of the row-wise passes ([`par_rows`]).
const ROW_BLOCK: usize = 32;

/// Where and how to run the encoder.
#[derive(Debug, Clone, Copy)]
pub struct VisionRun<'a> {
    pub team: Option<&'a Team>,
    pub isa: Isa,
    pub numerics: Numerics,
}

/// An image's tokens for the text model: `[tokens][dim]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageTokens {
    pub tokens: usize,
    pub dim: usize,
    pub data: Vec<f32>,
}

/// Encodes `crops` and projects them: the image's `patches` tokens of
/// `proj_out_dim` values.
pub fn encode_image(
    run: VisionRun<'_>,
    w: &VisionWeights,
    cfg: &VisionConfig,
    crops: &OverlapCrops,
) -> Result<ImageTokens, CpuError> {
    let features = encode_crops(run, w, cfg, crops)?;
    project(run, w, cfg, &features, crops.tiling)
}

/// The encoder alone: post-LN features of every crop, `[crops][patches]
/// [enc_dim]`, the global crop first.
pub fn encode_crops(
    run: VisionRun<'_>,
    w: &VisionWeights,
    cfg: &VisionConfig,
    crops: &OverlapCrops,
) -> Result<Vec<f32>, CpuError> {
    if crops.crop_size != cfg.crop_size {
        return Err(CpuError::Shape {
            name: "vision crops".into(),
            expected: format!("{} pixels a side", cfg.crop_size),
            got: crops.crop_size.to_string(),
        });
    }
    let (n, p, d) = (crops.count(), cfg.patches(), cfg.enc_dim);
    let rows = n * p;
    let mut x = vec![0f32; rows * d];
    linear(
        run,
        "patch_emb",
        &w.patch_emb,
        &patchify(cfg, crops),
        rows,
        &mut x,
    )?;
    par_rows(run.team, &mut x, d, |r0, rows| {
        for (t, row) in rows.chunks_exact_mut(d).enumerate() {
            let pos = (r0 + t) % p;
            add_assign(row, &w.pos_emb[pos * d..(pos + 1) * d]);
        }
    });
    let mut h = vec![0f32; rows * d];
    let mut qkv = vec![0f32; rows * 3 * d];
    let mut att = vec![0f32; rows * d];
    let mut ff = vec![0f32; rows * cfg.enc_ff_dim];
    let mut delta = vec![0f32; rows * d];
    for (i, b) in w.blocks.iter().enumerate() {
        layer_norm(run.team, &x, &b.ln1, &mut h);
        linear(
            run,
            &format!("vision block {i} qkv"),
            &b.qkv,
            &h,
            rows,
            &mut qkv,
        )?;
        attention(run, cfg, n, &qkv, &mut att)?;
        linear(
            run,
            &format!("vision block {i} proj"),
            &b.proj,
            &att,
            rows,
            &mut delta,
        )?;
        add_rows(run.team, &mut x, &delta, d);
        layer_norm(run.team, &x, &b.ln2, &mut h);
        linear(
            run,
            &format!("vision block {i} fc1"),
            &b.mlp.fc1,
            &h,
            rows,
            &mut ff,
        )?;
        gelu_rows(run.team, &mut ff, cfg.enc_ff_dim);
        linear(
            run,
            &format!("vision block {i} fc2"),
            &b.mlp.fc2,
            &ff,
            rows,
            &mut delta,
        )?;
        add_rows(run.team, &mut x, &delta, d);
    }
    layer_norm(run.team, &x, &w.post_ln, &mut h);
    Ok(h)
}

/// The projector over [`encode_crops`]' features: the tiles' maps stitched
/// and pooled to the grid, after the global crop's features channel-wise,
/// through `fc1`, GELU-tanh, `fc2`.
pub fn project(
    run: VisionRun<'_>,
    w: &VisionWeights,
    cfg: &VisionConfig,
    features: &[f32],
    tiling: Tiling,
) -> Result<ImageTokens, CpuError> {
    let (g, d, p) = (cfg.grid(), cfg.enc_dim, cfg.patches());
    if features.len() != (tiling.tiles() + 1) * p * d {
        return Err(CpuError::Shape {
            name: "vision features".into(),
            expected: format!("{} crops of {p}x{d}", tiling.tiles() + 1),
            got: format!("{} values", features.len()),
        });
    }
    let pooled = pool_tiles(&features[p * d..], tiling, g, cfg.overlap_margin, d);
    let mut joined = vec![0f32; p * 2 * d];
    for (t, row) in joined.chunks_exact_mut(2 * d).enumerate() {
        row[..d].copy_from_slice(&features[t * d..(t + 1) * d]);
        row[d..].copy_from_slice(&pooled[t * d..(t + 1) * d]);
    }
    let mut hidden = vec![0f32; p * cfg.proj_inner_dim];
    linear(run, "vision proj fc1", &w.proj.fc1, &joined, p, &mut hidden)?;
    gelu_rows(run.team, &mut hidden, cfg.proj_inner_dim);
    let mut out = vec![0f32; p * cfg.proj_out_dim];
    linear(run, "vision proj fc2", &w.proj.fc2, &hidden, p, &mut out)?;
    Ok(ImageTokens {
        tokens: p,
        dim: cfg.proj_out_dim,
        data: out,
    })
}

/// Crops to patch rows `[crops * patches][3 * ps * ps]`, each patch
/// channel-major (c, y, x) as the reference's rearrange, pixels in [-1, 1].
fn patchify(cfg: &VisionConfig, crops: &OverlapCrops) -> Vec<f32> {
    let (s, ps, g) = (cfg.crop_size, cfg.enc_patch_size, cfg.grid());
    let dim = cfg.patch_dim();
    let lut: [f32; 256] = std::array::from_fn(|v| normalize_pixel(v as u8));
    let mut out = vec![0f32; crops.count() * g * g * dim];
    for (c, patches) in out.chunks_exact_mut(g * g * dim).enumerate() {
        let px = crops.crop(c);
        for (t, row) in patches.chunks_exact_mut(dim).enumerate() {
            let (py, pxl) = (t / g * ps, t % g * ps);
            for ch in 0..3 {
                for y in 0..ps {
                    for x in 0..ps {
                        row[(ch * ps + y) * ps + x] =
                            lut[px[((py + y) * s + pxl + x) * 3 + ch] as usize];
                    }
                }
            }
        }
    }
    out
}

/// `y = x W^T + b` over `n` rows. A weight wider than `x` (zero columns
/// padding K to whole Q8_0 blocks at load) meets zero activations there.
pub(crate) fn linear(
    run: VisionRun<'_>,
    name: &str,
    l: &Linear,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) -> Result<(), CpuError> {
    let w = MatRef::new(name, &l.weight)?;
    let k = x.len() / n.max(1);
    if w.cols > k {
        // Quantized at load with zero columns padding K to whole blocks
        // (`kestrel_model::load_quant`): zero activations meet them, so
        // the product is the unpadded one's.
        let mut padded = vec![0f32; n * w.cols];
        for (p, r) in padded.chunks_exact_mut(w.cols).zip(x.chunks_exact(k)) {
            p[..k].copy_from_slice(r);
        }
        matmul(run.team, run.isa, run.numerics, w, &padded, n, y);
    } else {
        matmul(run.team, run.isa, run.numerics, w, x, n, y);
    }
    par_rows(run.team, y, l.bias.len(), |_, rows| {
        for row in rows.chunks_exact_mut(l.bias.len()) {
            add_assign(row, &l.bias);
        }
    });
    Ok(())
}

/// Full attention within each crop, per head: `qkv` is `[crops * patches]
/// [3 * enc_dim]` (Q, K, V stacked, heads contiguous in each), `out` is
/// `[crops * patches][enc_dim]`. The (crop, head) pairs are the team's
/// tasks, each two single-threaded GEMMs over its own scratch
/// ([`HeadScratch`]); keys are padded with zero rows to a multiple of 32
/// (zero scores, zeroed again after the softmax), so `softmax V` runs in
/// whole blocks instead of finishing each of its `patches x head_dim`
/// outputs with a scalar tail.
fn attention(
    run: VisionRun<'_>,
    cfg: &VisionConfig,
    crops: usize,
    qkv: &[f32],
    out: &mut [f32],
) -> Result<(), CpuError> {
    let (p, d, hd, heads) = (cfg.patches(), cfg.enc_dim, cfg.head_dim(), cfg.enc_n_heads);
    if qkv.len() != crops * p * 3 * d || out.len() != crops * p * d {
        return Err(CpuError::Shape {
            name: "vision attention".into(),
            expected: format!("{crops} crops of {p} rows of 3x{d} and {d} values"),
            got: format!("{} and {} values", qkv.len(), out.len()),
        });
    }
    let kp = p.next_multiple_of(32);
    let scale = 1.0 / (hd as f32).sqrt();
    let dst = OutPtr(out.as_mut_ptr());
    let unit = |u: usize| {
        let (c, h) = (u / heads, u % heads);
        let rows = &qkv[c * p * 3 * d..(c + 1) * p * 3 * d];
        HEAD_SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            let s = s.resize(p, kp, hd);
            for (t, row) in rows.chunks_exact(3 * d).enumerate() {
                s.q[t * hd..(t + 1) * hd].copy_from_slice(&row[h * hd..(h + 1) * hd]);
                s.k[t * hd..(t + 1) * hd].copy_from_slice(&row[d + h * hd..d + (h + 1) * hd]);
                for (j, v) in row[2 * d + h * hd..2 * d + (h + 1) * hd].iter().enumerate() {
                    s.vt[j * kp + t] = *v;
                }
            }
            // The padding keys and values stay zero: `resize` zeroed them
            // and nothing writes there.
            let keys = MatRef::from_f32(&s.k, kp, hd);
            matmul(None, run.isa, run.numerics, keys, &s.q, p, &mut s.scores);
            for row in s.scores.chunks_exact_mut(kp) {
                softmax_scaled(&mut row[..p], scale);
                row[p..].fill(0.0);
            }
            let values = MatRef::from_f32(&s.vt, hd, kp);
            matmul(None, run.isa, run.numerics, values, &s.scores, p, &mut s.o);
            for (t, orow) in s.o.chunks_exact(hd).enumerate() {
                let at = (c * p + t) * d + h * hd;
                // SAFETY: `out` holds `crops * p * d` floats (checked above)
                // and is borrowed mutably for this whole region; task (c, h)
                // alone writes the `hd` floats of head `h` in crop `c`'s rows.
                unsafe { std::slice::from_raw_parts_mut(dst.ptr().add(at), hd) }
                    .copy_from_slice(orow);
            }
        });
    };
    match run.team {
        Some(team) => team.for_each(crops * heads, unit),
        None => (0..crops * heads).for_each(unit),
    }
    Ok(())
}

/// One attention task's buffers: `q` and `o` are `patches x head_dim`, `k`
/// is `keys x head_dim` and `vt` is `head_dim x keys` (keys padded to a
/// multiple of 32 with zeros), `scores` is `patches x keys`.
#[derive(Debug, Default)]
struct HeadScratch {
    q: Vec<f32>,
    k: Vec<f32>,
    vt: Vec<f32>,
    scores: Vec<f32>,
    o: Vec<f32>,
}

impl HeadScratch {
    /// Sized for `p` patches, `kp` padded keys and `hd` head dims, zeroed
    /// when (re)allocated: the padding rows of `k` and columns of `vt`
    /// are never written after.
    fn resize(&mut self, p: usize, kp: usize, hd: usize) -> &mut Self {
        if self.q.len() != p * hd || self.vt.len() != hd * kp {
            *self = HeadScratch {
                q: vec![0.0; p * hd],
                k: vec![0.0; kp * hd],
                vt: vec![0.0; hd * kp],
                scores: vec![0.0; p * kp],
                o: vec![0.0; p * hd],
            };
        }
        self
    }
}

thread_local! {
    /// Each team thread's attention buffers, kept across tasks and calls
    /// (about 2.6 MB at 729 patches and head_dim 72).
    static HEAD_SCRATCH: RefCell<HeadScratch> = RefCell::new(HeadScratch::default());
}

/// `body(first_row, rows)` over blocks of [`ROW_BLOCK`] `width`-float rows
/// of `buf`, in parallel on the team. Each row is computed alone, so the
/// result does not depend on the split.
fn par_rows(
    team: Option<&Team>,
    buf: &mut [f32],
    width: usize,
    body: impl Fn(usize, &mut [f32]) + Sync,
) {
    let rows = buf.len() / width.max(1);
    let blocks = rows.div_ceil(ROW_BLOCK);
    match team {
        Some(team) if blocks > 1 => {
            let out = OutPtr(buf.as_mut_ptr());
            team.for_each(blocks, |b| {
                let (r0, r1) = (b * ROW_BLOCK, ((b + 1) * ROW_BLOCK).min(rows));
                // SAFETY: task `b` alone touches rows r0..r1 < rows of
                // `buf` (rows * width floats), which is borrowed mutably
                // for the whole region.
                let block = unsafe {
                    std::slice::from_raw_parts_mut(out.ptr().add(r0 * width), (r1 - r0) * width)
                };
                body(r0, block);
            });
        }
        _ => body(0, &mut buf[..rows * width]),
    }
}

/// `x += y`, row blocks of `width` in parallel.
fn add_rows(team: Option<&Team>, x: &mut [f32], y: &[f32], width: usize) {
    par_rows(team, x, width, |r0, rows| {
        add_assign(rows, &y[r0 * width..r0 * width + rows.len()]);
    });
}

/// GELU-tanh of every value, row blocks of `width` in parallel.
fn gelu_rows(team: Option<&Team>, x: &mut [f32], width: usize) {
    par_rows(team, x, width, |_, rows| {
        rows.iter_mut().for_each(|v| *v = gelu_tanh(*v));
    });
}

/// `row = softmax(row * scale)`, in [`SOFTMAX_LANES`] lanes so that the
/// max, the exponentials ([`exp_poly`]) and their sum vectorize (libm's
/// `expf` one call per score was a fifth of the encoder's CPU time). One
/// fixed order, in plain Rust: the result depends on the row alone, for
/// every [`Isa`] and thread count.
fn softmax_scaled(row: &mut [f32], scale: f32) {
    const L: usize = SOFTMAX_LANES;
    let mut lanes = [f32::NEG_INFINITY; L];
    let mut chunks = row.chunks_exact(L);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = m.max(v);
        }
    }
    let max = chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v))
        * scale;
    row.iter_mut().for_each(|v| *v = exp_poly(*v * scale - max));
    let mut sums = [0f32; L];
    let mut chunks = row.chunks_exact(L);
    for c in &mut chunks {
        for (s, &v) in sums.iter_mut().zip(c) {
            *s += v;
        }
    }
    let sum = chunks.remainder().iter().chain(&sums).sum::<f32>();
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|v| *v *= inv);
}

/// Lanes of [`softmax_scaled`]'s max and sum.
const SOFTMAX_LANES: usize = 16;

/// `exp(x)` for `x` in [-87, 88] (clamped there; NaN stays NaN), within
/// 3e-7 relative (unit-tested against float64): Cephes' `expf`, `2^n
/// p(r)` with `n` rounded by the 1.5 * 2^23 shift and `r = x - n ln 2`
/// in two parts, in plain float arithmetic that vectorizes.
#[inline(always)]
fn exp_poly(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0; // 1.5 * 2^23: t - SHIFT is round(t)
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let t = x * std::f32::consts::LOG2_E + SHIFT;
    let n = t - SHIFT;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let y = p * r * r + r + 1.0;
    // n in [-126, 127]: the exponent field n + 127 of 2^n is normal.
    let e = (t.to_bits() as i32 - SHIFT.to_bits() as i32 + 127) as u32;
    y * f32::from_bits(e << 23)
}

/// LayerNorm of each row of `x` into `out` (two-pass mean and variance),
/// row blocks in parallel.
fn layer_norm(team: Option<&Team>, x: &[f32], ln: &LayerNorm, out: &mut [f32]) {
    let d = ln.weight.len();
    par_rows(team, out, d, |r0, outs| {
        let xs = &x[r0 * d..r0 * d + outs.len()];
        for (row, o) in xs.chunks_exact(d).zip(outs.chunks_exact_mut(d)) {
            let mean = row.iter().sum::<f32>() / d as f32;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
            let inv = 1.0 / (var + LN_EPS).sqrt();
            for (((o, v), w), b) in o.iter_mut().zip(row).zip(&ln.weight).zip(&ln.bias) {
                *o = (v - mean) * inv * w + b;
            }
        }
    });
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// GELU, tanh approximation (PyTorch's `approximate="tanh"`), as the
/// equal `x * sigmoid(2 z)` for `0.5 x (1 + tanh(z))`: one `expf` instead
/// of libm's `tanhf` (through `expm1f`; a quarter of the encoder's CPU time
/// on the bench shape when it was used), and no cancellation in `1 + tanh`
/// for negative `z`. Saturates to `x` and to `-0`, never NaN, for finite `x`.
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    let z = C * (x + 0.044_715 * x * x * x);
    x / (1.0 + (-2.0 * z).exp())
}

#[cfg(test)]
mod tests {
    use kestrel_model::{DType, Matrix};

    use super::*;

    /// A linear whose weight was zero-padded to whole Q8_0 blocks at load
    /// (40 -> 64 columns) gives the product of the unpadded weight it
    /// encodes: its zero columns meet zero activations.
    #[test]
    fn a_padded_q8_0_linear_is_the_unpadded_product() {
        let (rows, k, n) = (5, 40, 3);
        let w: Vec<f32> = (0..rows * 64)
            .map(|i| {
                if i % 64 < k {
                    ((i * 7919) % 113) as f32 / 56.0 - 1.0
                } else {
                    0.0
                }
            })
            .collect();
        let padded = Matrix::quantize(DType::Q8_0, rows, 64, &w);
        let values: Vec<f32> = padded
            .to_f32()
            .chunks_exact(64)
            .flat_map(|r| r[..k].to_vec())
            .collect();
        let plain = Matrix::quantize(DType::F32, rows, k, &values);
        let x: Vec<f32> = (0..n * k)
            .map(|i| ((i * 31) % 17) as f32 / 8.0 - 1.0)
            .collect();
        let bias = vec![0.25; rows];
        for isa in [Isa::Scalar, Isa::detect()] {
            let run = VisionRun {
                team: None,
                isa,
                numerics: Numerics::Exact,
            };
            let (mut a, mut b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
            let l = |weight: &Matrix| Linear {
                weight: weight.clone(),
                bias: bias.clone(),
            };
            linear(run, "padded", &l(&padded), &x, n, &mut a).unwrap();
            linear(run, "plain", &l(&plain), &x, n, &mut b).unwrap();
            for (u, v) in a.iter().zip(&b) {
                assert!(
                    (u - v).abs() <= 1e-5 * (v.abs() + 1.0),
                    "{isa:?}: {u} vs {v}"
                );
            }
        }
    }

    #[test]
    fn exp_poly_is_exp() {
        let mut worst = 0f64;
        for i in -870_000..=880_000 {
            let x = i as f32 / 10_000.0;
            let want = (x as f64).exp();
            let err = ((exp_poly(x) as f64) - want).abs() / want;
            assert!(err <= 3e-7, "x {x}: {} vs {want}", exp_poly(x));
            worst = worst.max(err);
        }
        assert!(worst > 0.0);
        assert_eq!(exp_poly(0.0), 1.0);
        assert!(exp_poly(f32::NAN).is_nan());
    }

    #[test]
    fn softmax_is_the_plain_one() {
        for len in [1, 15, 16, 17, 729] {
            let row: Vec<f32> = (0..len).map(|i| ((i * 37) % 23) as f32 - 11.0).collect();
            let mut ours = row.clone();
            softmax_scaled(&mut ours, 0.125);
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let e: Vec<f64> = row
                .iter()
                .map(|&v| ((v as f64 - max) * 0.125).exp())
                .collect();
            let sum: f64 = e.iter().sum();
            for (o, e) in ours.iter().zip(&e) {
                assert!(
                    (*o as f64 - e / sum).abs() <= 1e-6 * (e / sum),
                    "{len}: {o} vs {}",
                    e / sum
                );
            }
        }
    }

    #[test]
    fn gelu_tanh_matches_known_values() {
        assert_eq!(gelu_tanh(0.0), 0.0);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
        assert!((gelu_tanh(-2.0) - -0.045_402_3).abs() < 1e-5);
        // Saturated tails: x itself, and zero (not NaN) far below.
        assert_eq!(gelu_tanh(60.0), 60.0);
        assert_eq!(gelu_tanh(-60.0), 0.0);
    }

    /// The sigmoid form against the tanh form in float64, over [-12, 12].
    #[test]
    fn gelu_tanh_is_the_tanh_form() {
        for i in -12_000..=12_000 {
            let x = i as f32 / 1000.0;
            let xd = x as f64;
            let want =
                0.5 * xd * (1.0 + (0.797_884_560_802_865_4 * (xd + 0.044_715 * xd.powi(3))).tanh());
            let got = gelu_tanh(x) as f64;
            assert!(
                (got - want).abs() <= 1e-6 * (want.abs() + 1e-3),
                "x {x}: {got} vs {want}"
            );
        }
    }
}
