//! Elementwise and per-row kernels: RMSNorm, LayerNorm, RoPE (both pairings),
//! SiLU-mul, a vectorizable `exp` (kestrel-numerics' definition, shared with
//! kestrel-cuda), and residual adds. All are per-row and run in a fixed
//! order, so they are batch-invariant by construction. Written as plain
//! lane-array loops that LLVM vectorizes for the build's target CPU.

use kestrel_model::RopeStyle;

/// `out = x / sqrt(mean(x^2) + eps) * w` for one row. The sum of squares uses
/// 8 lanes then a fixed tree, independent of batch.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len();
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let rem = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] = c[l].mul_add(c[l], acc[l]);
        }
    }
    for (l, v) in rem.iter().enumerate() {
        acc[l] = v.mul_add(*v, acc[l]);
    }
    let s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    let inv = 1.0 / (s / n as f32 + eps).sqrt();
    for i in 0..n {
        out[i] = x[i] * inv * w[i];
    }
}

/// `x`'s 8-lane sum of `f(x_i)` with the fixed final tree of [`rms_norm`].
#[inline(always)]
fn sum8(x: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let rem = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] = f(c[l], acc[l]);
        }
    }
    for (l, v) in rem.iter().enumerate() {
        acc[l] = f(*v, acc[l]);
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `out = (x - mean) / sqrt(var + eps) * w + b` for one row: LayerNorm with
/// PyTorch's biased variance, the mean and then the centred sum of squares
/// each in 8 lanes with a fixed tree, independent of batch.
pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len() as f32;
    let mean = sum8(x, |v, a| a + v) / n;
    let var = sum8(x, |v, a| (v - mean).mul_add(v - mean, a)) / n;
    let inv = 1.0 / (var + eps).sqrt();
    for i in 0..x.len() {
        out[i] = (x[i] - mean) * inv * w[i] + b[i];
    }
}

/// cos/sin of `pos * theta^(-2i/head_dim)` for `i < head_dim/2`, computed in
/// f64 and rounded once, stored as `[cos_0..cos_{d/2}, sin_0..sin_{d/2}]`.
pub fn rope_table(pos: u32, head_dim: usize, theta: f32, out: &mut [f32]) {
    let half = head_dim / 2;
    for i in 0..half {
        let freq = (theta as f64).powf(-2.0 * i as f64 / head_dim as f64);
        let ang = pos as f64 * freq;
        out[i] = ang.cos() as f32;
        out[half + i] = ang.sin() as f32;
    }
}

/// Rotate every head of `x` (`heads * head_dim`) in place with a table from
/// [`rope_table`].
pub fn rope(x: &mut [f32], head_dim: usize, table: &[f32], style: RopeStyle) {
    let half = head_dim / 2;
    let (cos, sin) = table.split_at(half);
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let (a, b) = match style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::HalfSplit => (i, i + half),
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * cos[i] - x1 * sin[i];
            head[b] = x0 * sin[i] + x1 * cos[i];
        }
    }
}

pub use kestrel_numerics::exp;
/// `e^x` and its constants, shared with the SIMD versions here and with
/// kestrel-cuda: the definitions live in kestrel-numerics, below both runtimes.
pub(crate) use kestrel_numerics::exp_consts;

/// `out[i] = silu(gate[i]) * up[i]`, `silu(g) = g / (1 + e^-g)`.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + exp(-g)) * u;
    }
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += *b;
    }
}

/// Dot product in 8 lanes with a fixed final tree (attention scores).
#[inline]
pub fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let ra = ca.remainder();
    let cb = b.chunks_exact(8);
    let rb = cb.remainder();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[l] = x.mul_add(*y, acc[l]);
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `y += a * x`.
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (o, v) in y.iter_mut().zip(x) {
        *o = a.mul_add(*v, *o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_styles_pair_the_documented_dimensions() {
        let mut t = vec![0f32; 8];
        rope_table(3, 8, 10000.0, &mut t);
        let base: Vec<f32> = (0..8).map(|i| i as f32 + 1.0).collect();
        let mut a = base.clone();
        rope(&mut a, 8, &t, RopeStyle::Interleaved);
        let mut b = base.clone();
        rope(&mut b, 8, &t, RopeStyle::HalfSplit);
        let (c0, s0) = (3f32.cos(), 3f32.sin());
        assert!((a[0] - (1.0 * c0 - 2.0 * s0)).abs() < 1e-6);
        assert!((a[1] - (1.0 * s0 + 2.0 * c0)).abs() < 1e-6);
        assert!((b[0] - (1.0 * c0 - 5.0 * s0)).abs() < 1e-6);
        assert!((b[4] - (1.0 * s0 + 5.0 * c0)).abs() < 1e-6);
        // Norm of each rotated pair is preserved.
        let n: f32 = base.iter().map(|v| v * v).sum();
        assert!((a.iter().map(|v| v * v).sum::<f32>() - n).abs() < 1e-3);
    }
}
