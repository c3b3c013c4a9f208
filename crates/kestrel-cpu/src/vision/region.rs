//! Moondream's region model on the CPU (docs/moondream.md, "Region model"):
//! coordinates and sizes in and out of the text model, batched over rows
//! (one row per sequence of a step).
//!
//! - in: `fourier(v, W) = [cos(2 pi v W), sin(2 pi v W)]` with the stored
//!   frequencies `W` (`[inputs][feat / 2]`), then one linear layer: a
//!   coordinate (1 -> 256 -> 2048) or a size `[w, h]` (2 -> 512 -> 2048)
//!   becomes the next step's input embedding;
//! - out: an MLP (`fc1`, GELU-tanh, `fc2`) of the last hidden state gives
//!   1024 coordinate logits (value `argmax / 1024`) or 2 x 1024 size logits
//!   (width bins, then height bins; value `2^((argmax / 1023) * 10 - 10)`).
//!
//! Argmax takes the first of equal maxima, as `torch.argmax` does. Values are
//! f32 throughout; the reference casts a decoded coordinate to the model's
//! dtype before re-encoding it (a bf16 model rounds `bin / 1024` to 8
//! significant bits), which a bf16 runtime must match where it re-encodes.
//! Cost per row: `dim x inner + inner x bins` multiply-adds a decoder (17M
//! for the coordinate at full width), `feat x dim` an encoder.

use kestrel_model::moondream::{Mlp, RegionConfig, RegionWeights};

use super::encoder::{gelu_tanh, linear, VisionRun};
use crate::CpuError;

/// A decoded coordinate: its bin and its value in `[0, 1)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodedCoord {
    pub bin: usize,
    pub value: f32,
}

/// A decoded size: width and height bins and values in `[2^-10, 1]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodedSize {
    pub bins: [usize; 2],
    pub value: [f32; 2],
}

/// `[cos(2 pi v W), sin(2 pi v W)]` for each row of `values` (`inputs`
/// wide), `W` being `[inputs][half]`: `[rows][2 half]`. As the reference:
/// `f = (2 pi) * v`, then `f @ W`.
pub fn fourier_features(values: &[f32], inputs: usize, w: &[f32]) -> Vec<f32> {
    let half = w.len() / inputs;
    let two_pi = 2.0 * std::f32::consts::PI;
    let mut out = Vec::with_capacity(values.len() / inputs * 2 * half);
    for row in values.chunks_exact(inputs) {
        let f: Vec<f32> = (0..half)
            .map(|k| {
                row.iter()
                    .enumerate()
                    .map(|(i, v)| two_pi * v * w[i * half + k])
                    .sum()
            })
            .collect();
        out.extend(f.iter().map(|a| a.cos()));
        out.extend(f.iter().map(|a| a.sin()));
    }
    out
}

/// The input embeddings of `coords` (one per row): `[rows][dim]`.
pub fn encode_coords(
    run: VisionRun<'_>,
    w: &RegionWeights,
    cfg: &RegionConfig,
    coords: &[f32],
) -> Result<Vec<f32>, CpuError> {
    let feats = fourier_features(coords, 1, &w.coord_features);
    let mut out = vec![0f32; coords.len() * cfg.dim];
    linear(
        run,
        "region coord_encoder",
        &w.coord_encoder,
        &feats,
        coords.len(),
        &mut out,
    )?;
    Ok(out)
}

/// The input embeddings of `sizes` (`[w, h]` per row): `[rows][dim]`.
pub fn encode_sizes(
    run: VisionRun<'_>,
    w: &RegionWeights,
    cfg: &RegionConfig,
    sizes: &[[f32; 2]],
) -> Result<Vec<f32>, CpuError> {
    let flat: Vec<f32> = sizes.iter().flatten().copied().collect();
    let feats = fourier_features(&flat, 2, &w.size_features);
    let mut out = vec![0f32; sizes.len() * cfg.dim];
    linear(
        run,
        "region size_encoder",
        &w.size_encoder,
        &feats,
        sizes.len(),
        &mut out,
    )?;
    Ok(out)
}

/// The coordinate decoder's logits for `rows` hidden states: `[rows][1024]`.
pub fn coord_logits(
    run: VisionRun<'_>,
    w: &RegionWeights,
    cfg: &RegionConfig,
    hidden: &[f32],
    rows: usize,
) -> Result<Vec<f32>, CpuError> {
    mlp(
        run,
        "region coord_decoder",
        &w.coord_decoder,
        cfg,
        hidden,
        rows,
        cfg.coord_out_dim,
    )
}

/// The size decoder's logits: `[rows][2048]`, width bins then height bins.
pub fn size_logits(
    run: VisionRun<'_>,
    w: &RegionWeights,
    cfg: &RegionConfig,
    hidden: &[f32],
    rows: usize,
) -> Result<Vec<f32>, CpuError> {
    mlp(
        run,
        "region size_decoder",
        &w.size_decoder,
        cfg,
        hidden,
        rows,
        cfg.size_out_dim,
    )
}

/// A coordinate from one row of [`coord_logits`]: `argmax / bins`.
pub fn coord_from_logits(logits: &[f32]) -> DecodedCoord {
    let bin = argmax(logits);
    DecodedCoord {
        bin,
        value: bin as f32 / logits.len() as f32,
    }
}

/// A size from one row of [`size_logits`]: per axis `2^((argmax / (bins -
/// 1)) * 10 - 10)`, `bins` being half the row (1023 as the divisor in every
/// published config).
pub fn size_from_logits(logits: &[f32]) -> DecodedSize {
    let half = logits.len() / 2;
    let bins = [argmax(&logits[..half]), argmax(&logits[half..])];
    let value = bins.map(|b| 2f32.powf(b as f32 / (half - 1) as f32 * 10.0 - 10.0));
    DecodedSize { bins, value }
}

/// Decodes a coordinate from each of `rows` hidden states.
pub fn decode_coords(
    run: VisionRun<'_>,
    w: &RegionWeights,
    cfg: &RegionConfig,
    hidden: &[f32],
    rows: usize,
) -> Result<Vec<DecodedCoord>, CpuError> {
    let logits = coord_logits(run, w, cfg, hidden, rows)?;
    Ok(logits
        .chunks_exact(cfg.coord_out_dim)
        .map(coord_from_logits)
        .collect())
}

/// Decodes a size from each of `rows` hidden states.
pub fn decode_sizes(
    run: VisionRun<'_>,
    w: &RegionWeights,
    cfg: &RegionConfig,
    hidden: &[f32],
    rows: usize,
) -> Result<Vec<DecodedSize>, CpuError> {
    let logits = size_logits(run, w, cfg, hidden, rows)?;
    Ok(logits
        .chunks_exact(cfg.size_out_dim)
        .map(size_from_logits)
        .collect())
}

/// The first index of the largest value; a NaN counts as the largest, as in
/// `torch.argmax`.
fn argmax(v: &[f32]) -> usize {
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

fn mlp(
    run: VisionRun<'_>,
    name: &str,
    m: &Mlp,
    cfg: &RegionConfig,
    hidden: &[f32],
    rows: usize,
    out_dim: usize,
) -> Result<Vec<f32>, CpuError> {
    if hidden.len() != rows * cfg.dim {
        return Err(CpuError::Shape {
            name: format!("{name} input"),
            expected: format!("{rows} x {}", cfg.dim),
            got: hidden.len().to_string(),
        });
    }
    let mut inner = vec![0f32; rows * cfg.inner_dim];
    linear(
        run,
        &format!("{name}.fc1"),
        &m.fc1,
        hidden,
        rows,
        &mut inner,
    )?;
    inner.iter_mut().for_each(|v| *v = gelu_tanh(*v));
    let mut out = vec![0f32; rows * out_dim];
    linear(run, &format!("{name}.fc2"), &m.fc2, &inner, rows, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[0.5, 2.0, f32::NAN, f32::NAN]), 2);
    }

    #[test]
    fn size_bins_map_to_the_published_log_scale() {
        let mut logits = vec![0f32; 2048];
        logits[0] = 1.0; // width bin 0: 2^-10
        logits[1024 + 1023] = 1.0; // height bin 1023: 2^0
        let s = size_from_logits(&logits);
        assert_eq!(s.bins, [0, 1023]);
        assert_eq!(s.value, [2f32.powi(-10), 1.0]);
        let c = coord_from_logits(&logits[1024..]);
        assert_eq!((c.bin, c.value), (1023, 1023.0 / 1024.0));
    }

    #[test]
    fn fourier_features_are_cos_then_sin_of_two_pi_v_w() {
        // Two inputs, two frequencies: f_k = 2 pi (v0 W[0][k] + v1 W[1][k]).
        let w = [1.0, 0.5, 0.25, 2.0];
        let f = fourier_features(&[0.25, 0.5], 2, &w);
        let tau = 2.0 * std::f32::consts::PI;
        let a = [tau * (0.25 + 0.125), tau * (0.125 + 1.0)];
        let want = [a[0].cos(), a[1].cos(), a[0].sin(), a[1].sin()];
        for (x, y) in f.iter().zip(want) {
            assert!((x - y).abs() < 1e-6, "{f:?} vs {want:?}");
        }
    }
}
