//! The per-family pieces of the decoder block that plain Llama does not
//! need: RoPE tables with frequency factors and linear scaling, rotary on
//! part of each head (Phi), GELU-tanh (gated and not), logit softcapping,
//! and attention restricted to a sliding window. All are
//! per-row and in a fixed order, so they keep the forward batch-invariant.
//! The windowed attention is a plain loop (keys `first..len` of one kv
//! group): it runs only for rows past the window, where the full-prefix
//! kernel (`kernels::attention`) would see keys it must not.

use kestrel_model::LayerRope;

use crate::kernels::attention::{exp_shifted, PagedSeq};
use crate::kernels::ops::{axpy, dot8};

/// The RoPE of a set of layers, owned (see [`LayerRope`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RopeSpec {
    theta: f32,
    freq_factors: Option<Vec<f32>>,
    linear_scale: f32,
}

impl RopeSpec {
    pub(crate) fn of(r: &LayerRope<'_>) -> Self {
        RopeSpec {
            theta: r.theta,
            freq_factors: r.freq_factors.map(<[f32]>::to_vec),
            linear_scale: r.linear_scale,
        }
    }

    /// cos/sin of `(pos / linear_scale) * theta^(-2i/head_dim) / factor_i`,
    /// in f64 and rounded once, as `[cos_0..cos_{d/2}, sin_0..sin_{d/2}]`.
    /// Without factors or scaling this is bit-identical to
    /// `kernels::ops::rope_table`.
    pub(crate) fn table(&self, pos: u32, head_dim: usize, out: &mut [f32]) {
        let half = head_dim / 2;
        let p = pos as f64 / self.linear_scale as f64;
        for i in 0..half {
            let mut freq = (self.theta as f64).powf(-2.0 * i as f64 / head_dim as f64);
            if let Some(ff) = &self.freq_factors {
                freq /= ff[i] as f64;
            }
            let ang = p * freq;
            out[i] = ang.cos() as f32;
            out[half + i] = ang.sin() as f32;
        }
    }
}

/// `gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))`.
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let inner = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
    0.5 * x * (1.0 + inner.tanh())
}

/// `gate = gelu_tanh(gate) * up`.
pub(crate) fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = gelu_tanh(*g) * u;
    }
}

/// `x = gelu_tanh(x + bias)` (an ungated FFN's `fc1` output; no bias when
/// `None`).
pub(crate) fn bias_gelu_tanh(x: &mut [f32], bias: Option<&[f32]>) {
    match bias {
        Some(b) => x
            .iter_mut()
            .zip(b)
            .for_each(|(v, &b)| *v = gelu_tanh(*v + b)),
        None => x.iter_mut().for_each(|v| *v = gelu_tanh(*v)),
    }
}

/// Half-split RoPE on the first `rot` dimensions of each `head_dim` head
/// of `x` (pairs `(i, i + rot/2)`), the rest untouched: Phi's partial
/// rotary (HF `modeling_phi.py`). `table` is [`RopeSpec::table`] for
/// `rot` dimensions.
pub(crate) fn rope_partial(x: &mut [f32], head_dim: usize, rot: usize, table: &[f32]) {
    let half = rot / 2;
    let (cos, sin) = table[..rot].split_at(half);
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let (x0, x1) = (head[i], head[i + half]);
            head[i] = x0 * cos[i] - x1 * sin[i];
            head[i + half] = x0 * sin[i] + x1 * cos[i];
        }
    }
}

/// `x = cap * tanh(x / cap)`.
pub(crate) fn softcap(x: &mut [f32], cap: f32) {
    for v in x {
        *v = cap * (*v / cap).tanh();
    }
}

/// Attention of kv-group `g`'s query heads at one position to keys
/// `first..len` only (a sliding window); same contract as
/// `kernels::attention::attend_group` otherwise. `scores` needs
/// `group * (len - first)` floats.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_window(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    seq: PagedSeq<'_>,
    g: usize,
    first: usize,
    len: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = seq.head_dim;
    let group = q.len() / hd;
    let n = len - first;
    for h in 0..group {
        let qh = &q[h * hd..(h + 1) * hd];
        let sh = &mut scores[h * n..(h + 1) * n];
        for (j, s) in (first..len).zip(sh.iter_mut()) {
            let o = seq.offset(j, g);
            *s = dot8(qh, &k[o..o + hd]) * scale;
        }
        let inv = 1.0 / exp_shifted(sh);
        let oh = &mut out[h * hd..(h + 1) * hd];
        oh.fill(0.0);
        for (j, &p) in (first..len).zip(sh.iter()) {
            let o = seq.offset(j, g);
            axpy(p * inv, &v[o..o + hd], oh);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_rope_spec_matches_the_kernel_table() {
        let spec = RopeSpec {
            theta: 10_000.0,
            freq_factors: None,
            linear_scale: 1.0,
        };
        let (mut a, mut b) = (vec![0f32; 64], vec![0f32; 64]);
        for pos in [0, 1, 17, 4095] {
            spec.table(pos, 64, &mut a);
            crate::kernels::ops::rope_table(pos, 64, 10_000.0, &mut b);
            assert_eq!(a, b);
        }
    }

    #[test]
    fn factors_and_scale_slow_the_rotation() {
        let spec = RopeSpec {
            theta: 10_000.0,
            freq_factors: Some(vec![2.0; 4]),
            linear_scale: 4.0,
        };
        let mut t = vec![0f32; 8];
        spec.table(8, 8, &mut t);
        // Pair 0: angle 8 / 4 * 1 / 2 = 1.
        assert!((t[0] - 1f32.cos()).abs() < 1e-7 && (t[4] - 1f32.sin()).abs() < 1e-7);
    }

    #[test]
    fn partial_rope_rotates_only_the_first_dims() {
        let spec = RopeSpec {
            theta: 10_000.0,
            freq_factors: None,
            linear_scale: 1.0,
        };
        let (hd, rot) = (8, 4);
        let mut t = vec![0f32; rot];
        spec.table(3, rot, &mut t);
        let x: Vec<f32> = (0..2 * hd).map(|i| i as f32 + 1.0).collect();
        let mut y = x.clone();
        rope_partial(&mut y, hd, rot, &t);
        for head in 0..2 {
            let (a, b) = (&x[head * hd..], &y[head * hd..]);
            assert_eq!(a[rot..hd], b[rot..hd], "pass-through dims");
            // Pair (0, 2) turns by 3 rad, pair (1, 3) by 3 / 100 rad.
            for (i, ang) in [(0usize, 3f32), (1, 0.03)] {
                let (c, s) = (ang.cos(), ang.sin());
                assert!((b[i] - (a[i] * c - a[i + 2] * s)).abs() < 1e-5);
                assert!((b[i + 2] - (a[i] * s + a[i + 2] * c)).abs() < 1e-5);
            }
        }
        let mut z = vec![1.0f32, -1.0];
        bias_gelu_tanh(&mut z, Some(&[2.0, 1.0]));
        assert!((z[0] - 2.996_363).abs() < 1e-5 && z[1] == 0.0);
    }

    #[test]
    fn gelu_and_softcap_values() {
        let mut g = vec![-3.0, 0.0, 1.0, 3.0];
        gelu_tanh_mul(&mut g, &[1.0; 4]);
        let want = [-0.003_637_392, 0.0, 0.841_192, 2.996_363];
        for (a, b) in g.iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        let mut x = vec![0.0, 30.0, -1e6];
        softcap(&mut x, 30.0);
        assert_eq!(x[0], 0.0);
        assert!((x[1] - 30.0 * 1f32.tanh()).abs() < 1e-4 && (x[2] + 30.0).abs() < 1e-4);
    }
}
