//! [`PreparedImage`]: a decoded image as the encoder takes it (its overlap
//! crops) with its content hash, the key of the runtime's encoded-image
//! cache and the seed of the prompt ids that stand for its rows (so the
//! prefix cache, keyed by ids, keys an image prefix by content). Hashing
//! is SHA-256 over the pixels and the crop geometry: about one pass over
//! the image's bytes, small beside cropping and encoding.

use sha2::{Digest, Sha256};

use crate::vision::crops::{overlap_crops, CropGeometry, OverlapCrops};
use crate::vision::image::RgbImage;

/// A decoded image ready for the encoder: its content hash and its crops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedImage {
    /// SHA-256 of the image's size, pixels (RGB, orientation applied) and
    /// the crop geometry: two images with the same hash encode the same.
    pub hash: [u8; 32],
    pub crops: OverlapCrops,
}

impl PreparedImage {
    /// Hashes `image` and cuts its crops for `geometry`.
    pub fn new(image: &RgbImage, geometry: &CropGeometry) -> PreparedImage {
        let mut h = Sha256::new();
        h.update(b"kestrel-image-v1");
        for v in [
            u64::from(image.width()),
            u64::from(image.height()),
            geometry.crop_size as u64,
            geometry.patch_size as u64,
            geometry.overlap_margin as u64,
            geometry.max_crops as u64,
        ] {
            h.update(v.to_le_bytes());
        }
        h.update(image.pixels());
        PreparedImage {
            hash: h.finalize().into(),
            crops: overlap_crops(image, geometry),
        }
    }

    /// The first eight bytes of the hash, as a number (for logs and ids).
    pub fn hash_u64(&self) -> u64 {
        u64::from_le_bytes(self.hash[..8].try_into().expect("eight bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(seed: u8, w: u32, h: u32) -> RgbImage {
        let px = (0..w * h * 3)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect();
        RgbImage::from_raw(w, h, px).unwrap()
    }

    #[test]
    fn the_hash_follows_content_size_and_geometry() {
        let g = CropGeometry::MOONDREAM;
        let a = PreparedImage::new(&image(1, 40, 30), &g);
        assert_eq!(a, PreparedImage::new(&image(1, 40, 30), &g));
        assert_ne!(a.hash, PreparedImage::new(&image(2, 40, 30), &g).hash);
        // Same bytes, other shape.
        assert_ne!(a.hash, PreparedImage::new(&image(1, 30, 40), &g).hash);
        let fewer = CropGeometry { max_crops: 4, ..g };
        assert_ne!(a.hash, PreparedImage::new(&image(1, 40, 30), &fewer).hash);
        assert_eq!(a.crops.count(), 2);
    }
}
