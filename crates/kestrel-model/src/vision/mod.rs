//! Images in: what a vision-language request's picture becomes before any
//! compute. [`image`] decodes JPEG, PNG and WebP bytes into RGB (EXIF
//! orientation applied, a pixel limit checked before the pixels are
//! decoded); [`crops`] cuts Moondream's global crop and overlapping tiles
//! from it, as its reference does; [`prepared`] holds both with the
//! image's content hash ([`PreparedImage`]); [`features`] stitches and pools
//! the tiles' encoder features back to the crop grid, one implementation for
//! both runtimes. All are pure and allocate only
//! their outputs; the encoders that consume the crops live in the runtimes.

pub mod crops;
pub mod features;
pub mod image;
pub mod prepared;

pub use crops::{overlap_crops, select_tiling, CropGeometry, OverlapCrops, Tiling};
pub use features::pool_tiles;
pub use image::{decode_image, DecodeLimits, ImageError, ImageKind, RgbImage};
pub use prepared::PreparedImage;
