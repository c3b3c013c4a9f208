//! Moondream's vision side on the CPU: the SigLIP-style encoder over all of
//! an image's crops at once and the projector that turns its features into
//! the text model's image tokens ([`encoder`]). Weights come from
//! `kestrel_model::moondream`, crops from `kestrel_model::vision`.

pub mod encoder;

pub use encoder::{encode_crops, encode_image, project, ImageTokens, VisionRun};
