//! Moondream's vision side on the CPU: the SigLIP-style encoder over all of
//! an image's crops at once and the projector that turns its features into
//! the text model's image tokens ([`encoder`]), and the region model that
//! carries coordinates and sizes in and out of the text model ([`region`]).
//! Weights come from `kestrel_model::moondream`, crops from
//! `kestrel_model::vision`.

pub mod encoder;
pub mod region;

pub use encoder::{encode_crops, encode_image, project, ImageTokens, VisionRun};
pub use region::{DecodedCoord, DecodedSize};
