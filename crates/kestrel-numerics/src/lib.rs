//! kestrel-numerics: the numeric definitions every runtime computes alike,
//! so a token sampled on the GPU, on CI's host device or on the CPU is the
//! same token. [`exp`] is the `e^x` every kernel matches operation for
//! operation (kestrel-cpu's SIMD lanes, `kernels/common.cuh`'s `kexp`, the
//! host device), with its constants in [`exp_consts`]; [`uniform`] is the
//! sampler's counter-based draw for `(seed, position)`.
//!
//! Below both runtimes, so kestrel-cuda need not depend on kestrel-cpu for
//! them. Pure: no dependencies, no unsafe, no allocation; O(1) per call.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// The constants of [`exp`], shared with its SIMD and CUDA versions.
#[allow(clippy::excessive_precision)] // Cephes' constants, as published.
pub mod exp_consts {
    /// `log2(e)`.
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    /// `ln 2`'s high part (Cody-Waite range reduction).
    pub const LN2_HI: f32 = 0.693_359_4;
    /// `ln 2`'s low part.
    pub const LN2_LO: f32 = -2.121_944_4e-4;
    /// Clamp range: `e^x` is 0 below `LO` and saturates at `HI`.
    pub const LO: f32 = -87.3;
    /// See [`LO`].
    pub const HI: f32 = 88.7;
    /// Polynomial coefficients, highest degree first (Horner order).
    pub const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        5.000_000_1e-1,
    ];
}

/// `e^x` to ~2 ulp (Cephes `expf` polynomial), vectorizable; 0 below -87.3,
/// saturating at 88.7.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    use exp_consts as k;
    let xc = x.clamp(k::LO, k::HI);
    let n = (xc * k::LOG2E).round_ties_even();
    let r = n.mul_add(-k::LN2_LO, n.mul_add(-k::LN2_HI, xc));
    let mut p = k::P[0];
    for &c in &k::P[1..] {
        p = p.mul_add(r, c);
    }
    let y = (p * r).mul_add(r, r) + 1.0;
    let scale = f32::from_bits((((n as i32) + 127) as u32) << 23);
    if x < k::LO {
        0.0
    } else {
        y * scale
    }
}

/// Counter-based uniform in `[0, 1)` for `(seed, position)` (splitmix64):
/// a request's draw at a position never depends on what else was in its
/// batch, nor on the runtime that draws it.
pub fn uniform(seed: u64, position: u32) -> f64 {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let h = mix(seed ^ mix(position as u64 ^ 0xD1B5_4A32_D192_ED03));
    (h >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate() {
        let mut x = -90.0f32;
        while x < 88.0 {
            let e = (x as f64).exp();
            let g = exp(x) as f64;
            if e > 1e-37 {
                assert!(((g - e) / e).abs() < 3e-7, "exp({x}) = {g}, want {e}");
            }
            x += 0.0137;
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn uniform_is_keyed_by_seed_and_position_and_stays_in_range() {
        assert_eq!(uniform(5, 9), uniform(5, 9));
        assert_ne!(uniform(1, 2), uniform(1, 3));
        assert_ne!(uniform(1, 2), uniform(2, 2));
        let draws: Vec<f64> = (0..1000).map(|p| uniform(42, p)).collect();
        assert!(draws.iter().all(|u| (0.0..1.0).contains(u)));
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 0.5).abs() < 0.05, "mean {mean}");
    }
}
