//! K-quant encoders that reproduce llama.cpp's reference quantization
//! (`quantize_row_q4_K_ref`, `quantize_row_q5_K_ref`, `quantize_row_q6_K_ref`
//! in ggml-quants.c, what `llama-quantize` writes when no importance matrix
//! is given): the same scale searches (`make_qkx2_quants` for Q4_K/Q5_K,
//! `make_qx_quants` with `x^2` weights for Q6_K), every f32 operation in the
//! C source's order and with its rounding (`nearest_int` is round-half-even
//! through the 1.5 * 2^23 trick), so the blocks come out byte for byte the
//! same. `tests/quantize_reference.rs` checks them against the C code.
//! Cost: about twenty trial quantizations per 32-element group.

use half::f16;

const QK_K: usize = 256;
/// ggml's `GROUP_MAX_EPS`: groups whose largest |x| is below it are all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml `nearest_int`: `fval` rounded half to even, valid for |fval| <= 2^22.
fn nearest_int(fval: f32) -> i32 {
    debug_assert!(fval.abs() <= 4_194_303.0, "nearest_int({fval})");
    let val = fval + 12_582_912.0;
    (val.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

fn f16_round(v: f32) -> (f16, f32) {
    let h = f16::from_f32(v);
    (h, h.to_f32())
}

/// ggml `make_qkx2_quants`: `x ~ scale * L - min` with `L` in `0..=nmax`,
/// searching `nstep + 1` scales around `nmax / (max - min)` for the least
/// weighted squared error. Returns `(scale, the_min)` (`the_min >= 0`).
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    l_aux: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out.fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            l_aux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * f32::from(l_aux[i]) + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&l_aux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml `make_qx_quants` with `rmse_type` 1 and no importance weights
/// (weights `x^2`): symmetric `x ~ scale * (L - nmax)`, `L` in `0..2*nmax`,
/// trying 18 scales around `-nmax / max`.
fn make_qx_quants_rmse1(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let mut max = 0f32;
    let mut amax = 0f32;
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let quant = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let mut iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (i, &v) in x.iter().enumerate() {
        let l = quant(iscale, v);
        l_out[i] = (l + nmax) as i8;
        let w = v * v;
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let l = quant(iscale, v);
            let w = v * v;
            sumlx += w * v * l as f32;
            suml2 += w * l as f32 * l as f32;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (i, &v) in x.iter().enumerate() {
                l_out[i] = (nmax + quant(iscale, v)) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// One Q4_K (`nmax` 15) or Q5_K (`nmax` 31) super-block of 256 values:
/// `f16 d, f16 dmin, u8 scales[12], [u8 qh[32] (Q5_K)], u8 qs[128]`.
pub(super) fn quantize_q4_k_block(x: &[f32], out: &mut Vec<u8>, nmax: i32) {
    // Q4_K searches 21 scales from -1.0, Q5_K 16 from -0.5 (ggml's choices).
    let (rmin, nstep) = if nmax == 15 { (-1.0, 20) } else { (-0.5, 15) };
    let mut l = [0u8; QK_K];
    let mut l_aux = [0u8; 32];
    let mut weights = [0f32; 32];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        let sub = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0f32;
        for &v in sub {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &v) in weights.iter_mut().zip(sub) {
            *w = av_x + v.abs();
        }
        let (scale, min) = make_qkx2_quants(
            nmax,
            sub,
            &weights,
            &mut l[32 * j..32 * j + 32],
            &mut l_aux,
            rmin,
            0.1,
            nstep,
        );
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    for j in 0..8 {
        // C stores nearest_int's result in a uint8_t before MIN(63, .).
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0x0F) | ((lm & 0x0F) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let (d16, d) = f16_round(max_scale / 63.0);
    let (dmin16, dmin) = f16_round(max_min / 63.0);
    for j in 0..8 {
        let (sc, m) = super::scale_min_k4(j, &packed);
        let dj = d * f32::from(sc);
        if dj == 0.0 {
            continue;
        }
        let dm = dmin * f32::from(m);
        for ii in 0..32 {
            let q = nearest_int((x[32 * j + ii] + dm) / dj).clamp(0, nmax);
            l[32 * j + ii] = q as u8;
        }
    }
    out.extend_from_slice(&d16.to_le_bytes());
    out.extend_from_slice(&dmin16.to_le_bytes());
    out.extend_from_slice(&packed);
    if nmax > 15 {
        let mut qh = [0u8; 32];
        for (e, &q) in l.iter().enumerate() {
            // Element `e` is lane `e % 32` of sub-block `e / 32`.
            qh[e % 32] |= (q >> 4) << (e / 32);
        }
        out.extend_from_slice(&qh);
    }
    for c in 0..4 {
        out.extend((0..32).map(|i| (l[64 * c + i] & 0x0F) | ((l[64 * c + i + 32] & 0x0F) << 4)));
    }
}

/// One Q6_K super-block: `u8 ql[128], u8 qh[64], i8 scales[16], f16 d`.
pub(super) fn quantize_q6_k_block(x: &[f32], out: &mut Vec<u8>) {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
    for ib in 0..16 {
        let scale =
            make_qx_quants_rmse1(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
        scales[ib] = scale;
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = scale;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        out.extend(std::iter::repeat_n(0u8, 210));
        return;
    }
    let iscale = -128.0 / max_scale;
    let (d16, d) = f16_round(1.0 / iscale);
    let sc: [i8; 16] = std::array::from_fn(|ib| nearest_int(iscale * scales[ib]).min(127) as i8);
    for j in 0..16 {
        let dj = d * f32::from(sc[j]);
        if dj == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let q = nearest_int(x[16 * j + ii] / dj).clamp(-32, 31);
            l[16 * j + ii] = (q + 32) as i8;
        }
    }
    let l = l.map(|v| v as u8);
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for n in 0..2 {
        let b = 128 * n;
        for i in 0..32 {
            let (q1, q2, q3, q4) = (l[b + i], l[b + i + 32], l[b + i + 64], l[b + i + 96]);
            ql[64 * n + i] = (q1 & 0x0F) | ((q3 & 0x0F) << 4);
            ql[64 * n + i + 32] = (q2 & 0x0F) | ((q4 & 0x0F) << 4);
            qh[32 * n + i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    out.extend_from_slice(&d16.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_half_to_even() {
        for (v, want) in [
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (3.49, 3),
            (-7.6, -8),
        ] {
            assert_eq!(nearest_int(v), want, "{v}");
        }
    }

    #[test]
    fn zero_blocks_stay_zero() {
        let x = [0f32; QK_K];
        let mut out = Vec::new();
        quantize_q6_k_block(&x, &mut out);
        assert_eq!(out, vec![0u8; 210]);
        out.clear();
        quantize_q4_k_block(&x, &mut out, 15);
        assert!(out.iter().all(|&b| b == 0), "{out:?}");
    }
}
