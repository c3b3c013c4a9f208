//! Moondream's overlap crops (its reference's `select_tiling` and
//! `overlap_crop_image`; facts in docs/moondream.md): one global crop of the
//! whole image resized to `crop_size` square, plus `rows x cols` tiles cut
//! from the image resized to `tiles * window + 2 * margin` pixels a side,
//! where `window` is a crop less its `overlap_margin` patches on each side.
//! Neighbouring tiles overlap by two margins; the encoder keeps each tile's
//! window (and the outer margins) when it stitches features back together.
//! Resizing is Lanczos3 (the reference's Pillow `LANCZOS` / libvips
//! lanczos3); pixel values agree with Pillow's within a few levels, tilings
//! exactly (`tests/moondream_crops.rs`).

use image::imageops::{self, FilterType};

use crate::vision::image::RgbImage;
use crate::ModelError;

/// Crop and tile sizes, in pixels and patches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CropGeometry {
    /// The side of every crop in pixels (378).
    pub crop_size: usize,
    /// The encoder's patch side in pixels (14).
    pub patch_size: usize,
    /// Patches of overlap on each side of a tile (4).
    pub overlap_margin: usize,
    /// The most tiles (not counting the global crop) an image may have (12).
    pub max_crops: usize,
}

impl CropGeometry {
    /// Moondream 2's geometry: 378-pixel crops of 27 x 27 patches, 4-patch
    /// margins, up to 12 tiles.
    pub const MOONDREAM: CropGeometry = CropGeometry {
        crop_size: 378,
        patch_size: 14,
        overlap_margin: 4,
        max_crops: 12,
    };

    /// A geometry whose crop is whole patches with a window left inside
    /// the margins, and at least one tile.
    pub fn validate(self) -> Result<CropGeometry, ModelError> {
        let invalid = |reason: String| Err(ModelError::InvalidConfig { reason });
        if self.patch_size == 0 || !self.crop_size.is_multiple_of(self.patch_size) {
            return invalid(format!(
                "vision crop_size {} is not a whole number of {}-pixel patches",
                self.crop_size, self.patch_size
            ));
        }
        if 2 * self.overlap_margin >= self.grid() {
            return invalid(format!(
                "vision overlap_margin {} leaves no window in a {}-patch crop",
                self.overlap_margin,
                self.grid()
            ));
        }
        if self.max_crops == 0 {
            return invalid("vision max_crops is 0".into());
        }
        Ok(self)
    }

    /// Patches per crop side (27).
    pub fn grid(&self) -> usize {
        self.crop_size / self.patch_size
    }

    /// One margin in pixels (56).
    pub fn margin_pixels(&self) -> usize {
        self.overlap_margin * self.patch_size
    }

    /// The part of a tile inside its margins, in pixels (266).
    pub fn window_pixels(&self) -> usize {
        (self.grid() - 2 * self.overlap_margin) * self.patch_size
    }

    /// The tiling an image of `height x width` pixels gets: its size less
    /// both margins, tiled by windows (the reference's call).
    pub fn tiling_for(&self, height: usize, width: usize) -> Tiling {
        let m = 2 * self.margin_pixels() as i64;
        select_tiling(
            height as i64 - m,
            width as i64 - m,
            self.window_pixels() as i64,
            self.max_crops as i64,
        )
    }
}

/// Tiles down and across.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tiling {
    pub rows: usize,
    pub cols: usize,
}

impl Tiling {
    pub fn tiles(&self) -> usize {
        self.rows * self.cols
    }
}

/// The reference's `select_tiling`: the fewest tiles of `crop_size` that
/// cover `height x width`, spread toward the aspect ratio, at most
/// `max_crops` (scaled down proportionally when even the minimum is more).
/// Sides may be zero or negative (an image smaller than its margins): one
/// tile. Float steps are the reference's (f64 division and `sqrt`, then
/// `floor`), so results match it exactly.
pub fn select_tiling(height: i64, width: i64, crop_size: i64, max_crops: i64) -> Tiling {
    if height <= crop_size || width <= crop_size {
        return Tiling { rows: 1, cols: 1 };
    }
    let min_h = (height + crop_size - 1) / crop_size;
    let min_w = (width + crop_size - 1) / crop_size;
    let tiling = |h: i64, w: i64| Tiling {
        rows: h.max(1) as usize,
        cols: w.max(1) as usize,
    };
    if min_h * min_w > max_crops {
        let ratio = (max_crops as f64 / (min_h * min_w) as f64).sqrt();
        return tiling(
            (min_h as f64 * ratio).floor() as i64,
            (min_w as f64 * ratio).floor() as i64,
        );
    }
    let mut h_tiles = ((max_crops * height) as f64 / width as f64).sqrt().floor() as i64;
    let mut w_tiles = ((max_crops * width) as f64 / height as f64).sqrt().floor() as i64;
    h_tiles = h_tiles.max(min_h);
    w_tiles = w_tiles.max(min_w);
    if h_tiles * w_tiles > max_crops {
        if w_tiles > h_tiles {
            w_tiles = max_crops / h_tiles;
        } else {
            h_tiles = max_crops / w_tiles;
        }
    }
    tiling(h_tiles, w_tiles)
}

/// The crops of one image: `[crops][crop_size][crop_size][3]` bytes, the
/// global crop first, then the tiles row by row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverlapCrops {
    pub tiling: Tiling,
    pub crop_size: usize,
    pub pixels: Vec<u8>,
}

impl OverlapCrops {
    /// Global crop plus tiles.
    pub fn count(&self) -> usize {
        self.tiling.tiles() + 1
    }

    /// Crop `i`'s bytes (`0` is the global crop).
    pub fn crop(&self, i: usize) -> &[u8] {
        let n = self.crop_size * self.crop_size * 3;
        &self.pixels[i * n..(i + 1) * n]
    }

    /// The pixels as the encoder reads them: `v / 255` mapped to [-1, 1]
    /// (the reference's `(v / 255 - 0.5) / 0.5`), same layout.
    pub fn normalized(&self) -> Vec<f32> {
        self.pixels.iter().map(|&v| normalize_pixel(v)).collect()
    }
}

/// One channel value in [-1, 1], as the reference computes it.
pub fn normalize_pixel(v: u8) -> f32 {
    (f32::from(v) / 255.0 - 0.5) / 0.5
}

/// Cuts `image` into its global crop and overlapping tiles.
pub fn overlap_crops(image: &RgbImage, geometry: &CropGeometry) -> OverlapCrops {
    let (h, w) = (image.height() as usize, image.width() as usize);
    let size = geometry.crop_size;
    let margin = geometry.margin_pixels();
    let window = geometry.window_pixels();
    let tiling = geometry.tiling_for(h, w);
    let crop_bytes = size * size * 3;
    let mut pixels = vec![0u8; (tiling.tiles() + 1) * crop_bytes];

    let global = resize(image, size, size);
    pixels[..crop_bytes].copy_from_slice(global.as_raw());

    let target_h = tiling.rows * window + 2 * margin;
    let target_w = tiling.cols * window + 2 * margin;
    let resized = resize(image, target_w, target_h);
    let src = resized.as_raw();
    for i in 0..tiling.rows {
        for j in 0..tiling.cols {
            let (y0, x0) = (i * window, j * window);
            // Every tile lies inside the resized image (its last one ends at
            // exactly `target`), so no tile is padded; the min is the
            // reference's guard.
            let rows = (y0 + size).min(target_h) - y0;
            let cols = (x0 + size).min(target_w) - x0;
            let dst = &mut pixels[(1 + i * tiling.cols + j) * crop_bytes..][..crop_bytes];
            for r in 0..rows {
                let from = ((y0 + r) * target_w + x0) * 3;
                dst[r * size * 3..][..cols * 3].copy_from_slice(&src[from..from + cols * 3]);
            }
        }
    }
    OverlapCrops {
        tiling,
        crop_size: size,
        pixels,
    }
}

fn resize(image: &RgbImage, width: usize, height: usize) -> image::RgbImage {
    if (image.width() as usize, image.height() as usize) == (width, height) {
        return image.buffer().clone();
    }
    imageops::resize(
        image.buffer(),
        width as u32,
        height as u32,
        FilterType::Lanczos3,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiling_matches_hand_worked_cases() {
        let g = CropGeometry::MOONDREAM;
        assert_eq!(
            (g.grid(), g.margin_pixels(), g.window_pixels()),
            (27, 56, 266)
        );
        // Smaller than a window plus margins: one tile.
        assert_eq!(g.tiling_for(100, 3000), Tiling { rows: 1, cols: 1 });
        assert_eq!(g.tiling_for(378, 378), Tiling { rows: 1, cols: 1 });
        // 1024x768 less margins = 912x656 (w x h): min 3x4 = 12, sqrt(12 * 656
        // / 912) = 2.94 -> 2, raised to min 3; sqrt(12 * 912 / 656) = 4.08 -> 4.
        assert_eq!(g.tiling_for(768, 1024), Tiling { rows: 3, cols: 4 });
        // Huge: min 38 x 38 > 12, scaled by sqrt(12 / 1444): 3 x 3.
        assert_eq!(g.tiling_for(10_000, 10_000), Tiling { rows: 3, cols: 3 });
    }

    #[test]
    fn crops_tile_the_resized_image_with_overlap() {
        let g = CropGeometry::MOONDREAM;
        let (w, h) = (900u32, 500u32);
        let px: Vec<u8> = (0..h)
            .flat_map(|y| (0..w).flat_map(move |x| [(x % 251) as u8, (y % 241) as u8, 7]))
            .collect();
        let img = RgbImage::from_raw(w, h, px).unwrap();
        let crops = overlap_crops(&img, &g);
        assert_eq!(crops.tiling, g.tiling_for(500, 900));
        assert_eq!(crops.count(), crops.tiling.tiles() + 1);
        assert_eq!(crops.pixels.len(), crops.count() * 378 * 378 * 3);
        // Horizontal neighbours share 2 margins = 112 pixel columns: tile
        // (0,0)'s columns 266.. are tile (0,1)'s columns 0..112.
        let (a, b) = (crops.crop(1), crops.crop(2));
        for r in [0usize, 100, 377] {
            let row = |c: &[u8], x: usize| c[(r * 378 + x) * 3..][..3].to_vec();
            for x in 0..112 {
                assert_eq!(row(a, 266 + x), row(b, x));
            }
        }
        assert_eq!(normalize_pixel(0), -1.0);
        assert_eq!(normalize_pixel(255), 1.0);
    }

    #[test]
    fn geometry_is_validated() {
        assert!(CropGeometry::MOONDREAM.validate().is_ok());
        let bad = CropGeometry {
            crop_size: 380,
            ..CropGeometry::MOONDREAM
        };
        assert!(bad.validate().is_err());
        let no_window = CropGeometry {
            overlap_margin: 14,
            ..CropGeometry::MOONDREAM
        };
        assert!(no_window.validate().is_err());
    }
}
