//! Tile features back to the crop grid: Moondream's tiles' encoder features
//! stitched into one map without their inner margins (the reference's
//! `reconstruct_from_crops`, in patch units) and average-pooled back to the
//! global crop's grid (PyTorch's `adaptive_avg_pool2d`). Host code both
//! runtimes call on their `[tiles][g][g][d]` features (kestrel-cpu on its
//! own, kestrel-cuda after downloading them), so the order of the sums is
//! one.

use super::Tiling;

/// The tiles' `[tiles][g][g][d]` features (row-major tiles, `tiling`'s
/// grid) stitched and pooled to `[g][g][d]`: the map
/// [`stitch`] builds, through [`adaptive_avg_pool`].
pub fn pool_tiles(tiles: &[f32], tiling: Tiling, g: usize, margin: usize, d: usize) -> Vec<f32> {
    let (map, h, w) = stitch(tiles, tiling, g, margin, d);
    adaptive_avg_pool(&map, h, w, g, d)
}

/// The tiles' `[tiles][g][g][d]` features as one map keeping each tile's
/// window, plus the outer margins of the edge tiles (the reference's
/// `reconstruct_from_crops` in patch units): `(map, height, width)`.
pub fn stitch(
    tiles: &[f32],
    tiling: Tiling,
    g: usize,
    margin: usize,
    d: usize,
) -> (Vec<f32>, usize, usize) {
    let win = g - 2 * margin;
    let (h, w) = (
        tiling.rows * win + 2 * margin,
        tiling.cols * win + 2 * margin,
    );
    let mut out = vec![0f32; h * w * d];
    for i in 0..tiling.rows {
        let y0 = if i == 0 { 0 } else { margin };
        let y1 = if i == tiling.rows - 1 { g } else { g - margin };
        for j in 0..tiling.cols {
            let x0 = if j == 0 { 0 } else { margin };
            let x1 = if j == tiling.cols - 1 { g } else { g - margin };
            let tile = &tiles[(i * tiling.cols + j) * g * g * d..][..g * g * d];
            for y in y0..y1 {
                let src = &tile[(y * g + x0) * d..(y * g + x1) * d];
                let dst = ((i * win + y) * w + j * win + x0) * d;
                out[dst..dst + src.len()].copy_from_slice(src);
            }
        }
    }
    (out, h, w)
}

/// PyTorch's `adaptive_avg_pool2d` of an `[h][w][d]` map to `[g][g][d]`:
/// output bin `i` averages input rows `floor(i h / g) .. ceil((i + 1) h / g)`.
pub fn adaptive_avg_pool(x: &[f32], h: usize, w: usize, g: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0f32; g * g * d];
    let bins = |i: usize, n: usize| (i * n / g, ((i + 1) * n).div_ceil(g));
    for i in 0..g {
        let (y0, y1) = bins(i, h);
        for j in 0..g {
            let (x0, x1) = bins(j, w);
            let o = &mut out[(i * g + j) * d..][..d];
            for y in y0..y1 {
                for xx in x0..x1 {
                    o.iter_mut()
                        .zip(&x[(y * w + xx) * d..][..d])
                        .for_each(|(a, b)| *a += b);
                }
            }
            let inv = 1.0 / ((y1 - y0) * (x1 - x0)) as f32;
            o.iter_mut().for_each(|v| *v *= inv);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stitching_keeps_windows_and_outer_margins() {
        // 2x3 tiles of a 5-patch grid with a 1-patch margin: window 3,
        // stitched 2*3+2 = 8 by 3*3+2 = 11. Each patch carries its tile and
        // position, so every stitched cell names the tile it came from.
        let (g, m) = (5, 1);
        let tiling = Tiling { rows: 2, cols: 3 };
        let tiles: Vec<f32> = (0..6)
            .flat_map(|t| (0..g * g).map(move |i| (t * 100 + i) as f32))
            .collect();
        let (map, h, w) = stitch(&tiles, tiling, g, m, 1);
        assert_eq!((h, w), (8, 11));
        let at = |y: usize, x: usize| map[y * w + x] as usize;
        assert_eq!(at(0, 0), 0); // tile 0's own corner (outer margin kept)
        assert_eq!(at(3, 3), 3 * g + 3); // tile 0, its last window row and column
        assert_eq!(at(3, 4), 100 + 3 * g + 1); // tile 1 starts inside its margin
        assert_eq!(at(4, 0), 300 + g); // tile 3, its first window row
        assert_eq!(at(7, 10), 500 + g * g - 1); // tile 5's outer corner
    }

    #[test]
    fn adaptive_pool_matches_pytorch_bins() {
        // 5 -> 3: bins [0,2), [1,4), [3,5) (overlapping, as PyTorch's).
        let x: Vec<f32> = (0..5).map(|v| v as f32).collect();
        // As a 5x1 map pooled to 3x... use a 5x5 map constant along columns.
        let map: Vec<f32> = (0..25).map(|i| x[i / 5]).collect();
        let p = adaptive_avg_pool(&map, 5, 5, 3, 1);
        assert_eq!(&p[..3], &[0.5, 0.5, 0.5]);
        assert_eq!(p[3], 2.0);
        assert_eq!(p[6], 3.5);
    }
}
