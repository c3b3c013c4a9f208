//! The deterministic test pictures the Moondream tests send through crops,
//! encoders and references: pixels from a multiplicative hash of their
//! index and a seed (no image file is committed).

use kestrel_model::vision::RgbImage;

/// A `w` x `h` picture of `seed`.
pub fn picture(w: u32, h: u32, seed: u32) -> RgbImage {
    let px = (0..w * h * 3)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed).rotate_left(13) as u8 / 2 + (i % 97) as u8)
        .collect();
    RgbImage::from_raw(w, h, px).unwrap()
}

/// A 378 x 378 picture of `seed`: one crop size, the global crop alone.
pub fn picture_378(seed: u32) -> RgbImage {
    picture(378, 378, seed)
}
