//! Request images decoded to 8-bit RGB: JPEG, PNG and WebP only, EXIF
//! orientation applied, alpha dropped (as Pillow's `convert("RGB")` does).
//! The pixel count is read from the header and checked against
//! [`DecodeLimits::max_pixels`] before any pixel is decoded, so a
//! decompression bomb costs a header parse, not its pixels. Every failure is
//! an [`ImageError`] naming what was wrong with the bytes.

use std::io::Cursor;

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader};

/// The default pixel limit: 50 megapixels (a 48 MP phone photo fits; at 3
/// bytes a pixel the decoded image is at most 150 MB).
pub const DEFAULT_MAX_PIXELS: u64 = 50_000_000;

/// What a request's image may cost to decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Width x height above which an image is refused before decoding.
    pub max_pixels: u64,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits {
            max_pixels: DEFAULT_MAX_PIXELS,
        }
    }
}

/// The formats Kestrel decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    Jpeg,
    Png,
    WebP,
}

impl std::fmt::Display for ImageKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ImageKind::Jpeg => "JPEG",
            ImageKind::Png => "PNG",
            ImageKind::WebP => "WebP",
        })
    }
}

/// Why bytes did not become an image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("not an image: the bytes start with no JPEG, PNG or WebP signature")]
    NotAnImage,
    #[error("unsupported image format {format}: send JPEG, PNG or WebP")]
    UnsupportedFormat { format: &'static str },
    #[error("the {kind} image is truncated")]
    Truncated {
        kind: ImageKind,
        #[source]
        source: image::ImageError,
    },
    #[error("the {kind} image is malformed")]
    Malformed {
        kind: ImageKind,
        #[source]
        source: image::ImageError,
    },
    #[error("the image is {width}x{height}, more than the limit of {limit} pixels")]
    TooManyPixels { width: u32, height: u32, limit: u64 },
    #[error("the image has no pixels ({width}x{height})")]
    Empty { width: u32, height: u32 },
}

/// An 8-bit RGB image, rows top to bottom, `[height][width][3]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage(image::RgbImage);

impl RgbImage {
    /// An image from `width * height * 3` bytes (`None` if the length is
    /// wrong or a side is zero).
    pub fn from_raw(width: u32, height: u32, pixels: Vec<u8>) -> Option<RgbImage> {
        if width == 0 || height == 0 {
            return None;
        }
        image::RgbImage::from_raw(width, height, pixels).map(RgbImage)
    }

    pub fn width(&self) -> u32 {
        self.0.width()
    }

    pub fn height(&self) -> u32 {
        self.0.height()
    }

    /// The pixels, `[height][width][3]`.
    pub fn pixels(&self) -> &[u8] {
        self.0.as_raw()
    }

    pub(crate) fn buffer(&self) -> &image::RgbImage {
        &self.0
    }

    /// PNG bytes of the image (fixtures and tests).
    pub fn to_png(&self) -> Vec<u8> {
        let mut out = Cursor::new(Vec::new());
        self.0
            .write_to(&mut out, ImageFormat::Png)
            .expect("encoding an in-memory RGB8 PNG cannot fail");
        out.into_inner()
    }
}

/// Decodes `bytes` (JPEG, PNG or WebP) to RGB with its EXIF orientation
/// applied, refusing more than `limits.max_pixels` before decoding pixels.
pub fn decode_image(bytes: &[u8], limits: DecodeLimits) -> Result<RgbImage, ImageError> {
    let (kind, format) = match image::guess_format(bytes) {
        Ok(ImageFormat::Jpeg) => (ImageKind::Jpeg, ImageFormat::Jpeg),
        Ok(ImageFormat::Png) => (ImageKind::Png, ImageFormat::Png),
        Ok(ImageFormat::WebP) => (ImageKind::WebP, ImageFormat::WebP),
        Ok(other) => {
            return Err(ImageError::UnsupportedFormat {
                format: other.extensions_str().first().copied().unwrap_or("unknown"),
            })
        }
        Err(_) => return Err(ImageError::NotAnImage),
    };
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
    // The decoders' own allocation cap, in step with the pixel limit (16
    // bytes a pixel covers 16-bit RGBA), as a second fence behind the
    // header check below.
    let mut decoder_limits = image::Limits::default();
    decoder_limits.max_alloc = Some(limits.max_pixels.saturating_mul(16).max(1 << 20));
    reader.limits(decoder_limits);
    let classify = |source: image::ImageError| classify(kind, source);
    let mut decoder = reader.into_decoder().map_err(classify)?;
    let (width, height) = decoder.dimensions();
    if width == 0 || height == 0 {
        return Err(ImageError::Empty { width, height });
    }
    if u64::from(width) * u64::from(height) > limits.max_pixels {
        return Err(ImageError::TooManyPixels {
            width,
            height,
            limit: limits.max_pixels,
        });
    }
    // An unreadable EXIF block is not a reason to refuse the pixels.
    let orientation = decoder
        .orientation()
        .unwrap_or(image::metadata::Orientation::NoTransforms);
    // zune-jpeg fills a cut-off scan with grey rather than failing, and the
    // WebP decoder reports a short file as a bit-stream error: the
    // containers say where they end, so a short one is refused as such.
    let short = match kind {
        ImageKind::Jpeg => !has_jpeg_end(bytes),
        ImageKind::WebP => bytes.len() < riff_end(bytes),
        ImageKind::Png => false,
    };
    if short {
        return Err(ImageError::Truncated {
            kind,
            source: image::ImageError::IoError(std::io::ErrorKind::UnexpectedEof.into()),
        });
    }
    let mut img = DynamicImage::from_decoder(decoder).map_err(classify)?;
    img.apply_orientation(orientation);
    Ok(RgbImage(img.into_rgb8()))
}

/// Whether a JPEG's last scan is followed by its end-of-image marker
/// (`FF D9` after the last start-of-scan `FF DA`; inside entropy-coded data
/// an `FF` is always stuffed, so neither pair occurs there, and an embedded
/// thumbnail's own markers all precede the main image's scans). Trailing
/// bytes after the marker are allowed, as decoders allow them.
fn has_jpeg_end(bytes: &[u8]) -> bool {
    let last_scan = bytes.windows(2).rposition(|w| w == [0xFF, 0xDA]);
    last_scan.is_some_and(|s| bytes[s + 2..].windows(2).any(|w| w == [0xFF, 0xD9]))
}

/// The length a RIFF (WebP) file declares: 8 header bytes plus the size
/// field at bytes 4..8 (`guess_format` saw the `RIFF....WEBP` signature).
fn riff_end(bytes: &[u8]) -> usize {
    let size = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    8 + size as usize
}

fn classify(kind: ImageKind, source: image::ImageError) -> ImageError {
    let truncated = match &source {
        image::ImageError::IoError(e) => e.kind() == std::io::ErrorKind::UnexpectedEof,
        image::ImageError::Decoding(_) => {
            // The decoders report a short read as a decoding error whose
            // cause is an unexpected EOF, or say so in the message.
            let mut cause = std::error::Error::source(&source);
            let mut eof = false;
            while let Some(c) = cause {
                if let Some(io) = c.downcast_ref::<std::io::Error>() {
                    eof |= io.kind() == std::io::ErrorKind::UnexpectedEof;
                }
                cause = c.source();
            }
            eof || source.to_string().to_ascii_lowercase().contains("eof")
        }
        _ => false,
    };
    if truncated {
        ImageError::Truncated { kind, source }
    } else {
        ImageError::Malformed { kind, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gradient(w: u32, h: u32) -> RgbImage {
        let mut px = Vec::with_capacity((w * h * 3) as usize);
        for y in 0..h {
            for x in 0..w {
                px.extend([
                    (x * 255 / w) as u8,
                    (y * 255 / h) as u8,
                    ((x + y) % 256) as u8,
                ]);
            }
        }
        RgbImage::from_raw(w, h, px).unwrap()
    }

    fn encode(img: &RgbImage, format: ImageFormat) -> Vec<u8> {
        let mut out = Cursor::new(Vec::new());
        img.buffer().write_to(&mut out, format).unwrap();
        out.into_inner()
    }

    #[test]
    fn png_round_trips_exactly() {
        let img = gradient(37, 21);
        let back = decode_image(&img.to_png(), DecodeLimits::default()).unwrap();
        assert_eq!(back, img);
    }

    #[test]
    fn jpeg_and_webp_decode_to_their_size() {
        let img = gradient(64, 40);
        let jpeg = encode(&img, ImageFormat::Jpeg);
        let back = decode_image(&jpeg, DecodeLimits::default()).unwrap();
        assert_eq!((back.width(), back.height()), (64, 40));
        // Lossy, but close: the gradient survives within a few levels.
        let diff = back
            .pixels()
            .iter()
            .zip(img.pixels())
            .map(|(a, b)| a.abs_diff(*b) as u32)
            .max()
            .unwrap();
        assert!(diff < 40, "JPEG round trip off by {diff}");
        let webp = encode(&img, ImageFormat::WebP);
        assert_eq!(decode_image(&webp, DecodeLimits::default()).unwrap(), img);
    }

    #[test]
    fn grey_and_alpha_become_rgb() {
        let grey = image::GrayImage::from_fn(5, 3, |x, y| image::Luma([(x * 40 + y) as u8]));
        let mut png = Cursor::new(Vec::new());
        grey.write_to(&mut png, ImageFormat::Png).unwrap();
        let rgb = decode_image(png.get_ref(), DecodeLimits::default()).unwrap();
        assert_eq!(&rgb.pixels()[..6], &[0, 0, 0, 40, 40, 40]);
        let rgba = image::RgbaImage::from_fn(2, 1, |x, _| image::Rgba([10, 20, 30, x as u8]));
        let mut png = Cursor::new(Vec::new());
        rgba.write_to(&mut png, ImageFormat::Png).unwrap();
        let rgb = decode_image(png.get_ref(), DecodeLimits::default()).unwrap();
        assert_eq!(rgb.pixels(), &[10, 20, 30, 10, 20, 30]);
    }

    #[test]
    fn not_an_image_and_unsupported_formats_are_named() {
        assert!(matches!(
            decode_image(b"hello, world", DecodeLimits::default()),
            Err(ImageError::NotAnImage)
        ));
        assert!(matches!(
            decode_image(&[], DecodeLimits::default()),
            Err(ImageError::NotAnImage)
        ));
        let gif = b"GIF89a\x01\x00\x01\x00\x00\x00\x00;";
        assert!(matches!(
            decode_image(gif, DecodeLimits::default()),
            Err(ImageError::UnsupportedFormat { format: "gif" })
        ));
    }

    #[test]
    fn truncated_images_are_refused_as_truncated() {
        let img = gradient(50, 50);
        for format in [ImageFormat::Png, ImageFormat::Jpeg, ImageFormat::WebP] {
            let bytes = encode(&img, format);
            let cut = &bytes[..bytes.len() * 2 / 3];
            match decode_image(cut, DecodeLimits::default()) {
                Err(ImageError::Truncated { .. }) => {}
                other => panic!("{format:?} cut short: {other:?}"),
            }
        }
    }

    #[test]
    fn too_many_pixels_is_refused_from_the_header() {
        let img = gradient(40, 30);
        let limits = DecodeLimits { max_pixels: 1199 };
        match decode_image(&img.to_png(), limits) {
            Err(ImageError::TooManyPixels {
                width: 40,
                height: 30,
                limit: 1199,
            }) => {}
            other => panic!("{other:?}"),
        }
        assert!(decode_image(&img.to_png(), DecodeLimits { max_pixels: 1200 }).is_ok());
        // A PNG header claiming 100k x 100k pixels with no pixel data: refused
        // by the limit, not by a failed allocation or a decode.
        let mut bomb = img.to_png();
        bomb[16..20].copy_from_slice(&100_000u32.to_be_bytes());
        bomb[20..24].copy_from_slice(&100_000u32.to_be_bytes());
        // The IHDR CRC covers the size; fix it so the decoder reads the header.
        let crc = crc32(&bomb[12..29]);
        bomb[29..33].copy_from_slice(&crc.to_be_bytes());
        match decode_image(&bomb, DecodeLimits::default()) {
            Err(ImageError::TooManyPixels {
                width: 100_000,
                height: 100_000,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn exif_orientation_is_applied() {
        // A 2x1 JPEG (red, blue) with an EXIF APP1 segment saying "rotate
        // 90 degrees clockwise" (orientation 6) decodes to 1x2.
        let img = RgbImage::from_raw(16, 8, {
            let mut px = Vec::new();
            for _y in 0..8 {
                for x in 0..16 {
                    px.extend(if x < 8 { [255, 0, 0] } else { [0, 0, 255] });
                }
            }
            px
        })
        .unwrap();
        let jpeg = encode(&img, ImageFormat::Jpeg);
        let plain = decode_image(&jpeg, DecodeLimits::default()).unwrap();
        assert_eq!((plain.width(), plain.height()), (16, 8));
        let rotated =
            decode_image(&with_exif_orientation(&jpeg, 6), DecodeLimits::default()).unwrap();
        assert_eq!((rotated.width(), rotated.height()), (8, 16));
        // Rotated clockwise: the left (red) half is now on top.
        let top = &rotated.pixels()[..3];
        let bottom = &rotated.pixels()[rotated.pixels().len() - 3..];
        assert!(top[0] > 200 && top[2] < 60, "top {top:?}");
        assert!(bottom[2] > 200 && bottom[0] < 60, "bottom {bottom:?}");
    }

    /// `jpeg` with an APP1 Exif segment (big-endian TIFF, one IFD entry:
    /// Orientation = `value`) inserted after SOI.
    fn with_exif_orientation(jpeg: &[u8], value: u16) -> Vec<u8> {
        let mut tiff = Vec::new();
        tiff.extend(b"MM\x00\x2a");
        tiff.extend(8u32.to_be_bytes());
        tiff.extend(1u16.to_be_bytes());
        tiff.extend(0x0112u16.to_be_bytes());
        tiff.extend(3u16.to_be_bytes());
        tiff.extend(1u32.to_be_bytes());
        tiff.extend(value.to_be_bytes());
        tiff.extend([0, 0]);
        tiff.extend(0u32.to_be_bytes());
        let mut app1 = b"Exif\x00\x00".to_vec();
        app1.extend(tiff);
        let mut out = jpeg[..2].to_vec();
        out.extend([0xFF, 0xE1]);
        out.extend(((app1.len() + 2) as u16).to_be_bytes());
        out.extend(app1);
        out.extend(&jpeg[2..]);
        out
    }

    fn crc32(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in bytes {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }
}
