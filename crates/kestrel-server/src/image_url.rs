//! An image as the HTTP APIs send it: a `data:` URL with base64 content
//! (the Moondream client's `image_url`, OpenAI's `image_url.url`), or bare
//! base64. The server fetches nothing: an `http(s)` URL, or any other
//! scheme, is refused here with a typed [`ImageUrlError`] each edge turns
//! into a 400 naming its own field. Only the transport is decoded: the
//! bytes go to the engine, which decodes the image itself and refuses
//! anything that is not a JPEG, PNG or WebP.

use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::Engine as _;

/// Standard base64, padded or not (clients differ).
const BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Why an `image_url` did not give image bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageUrlError {
    /// A remote URL: the server fetches nothing.
    #[error("is a remote {scheme} URL; this server fetches nothing: send the image inline as a data URL (data:image/jpeg;base64,...)")]
    Remote { scheme: String },
    /// A URL scheme other than `data:`.
    #[error("has the URL scheme {scheme:?}; send the image inline as a data URL (data:image/jpeg;base64,...)")]
    UnsupportedScheme { scheme: String },
    /// A `data:` URL without `;base64` (percent-encoded data).
    #[error(
        "is a data URL without ;base64: send the image base64-encoded (data:image/jpeg;base64,...)"
    )]
    NotBase64,
    /// A `data:` URL with no comma before its data.
    #[error("is a data URL without a comma before its data")]
    MalformedDataUrl,
    /// The base64 did not decode (the decoder's reason is the message).
    #[error("does not decode as base64: {reason}")]
    BadBase64 { reason: String },
    /// Nothing to decode.
    #[error("is empty")]
    Empty,
}

/// The image bytes an `image_url` carries: `data:[<type>][;params];base64,<data>`
/// or bare base64 (standard alphabet, padding optional, whitespace ignored
/// as browsers and Python's `b64decode` with line breaks produce it).
pub fn decode_image_url(url: &str) -> Result<Vec<u8>, ImageUrlError> {
    let url = url.trim();
    if url.is_empty() {
        return Err(ImageUrlError::Empty);
    }
    let data = match scheme(url) {
        Some(s) if s.eq_ignore_ascii_case("data") => {
            let rest = &url[s.len() + 1..];
            let (meta, data) = rest
                .split_once(',')
                .ok_or(ImageUrlError::MalformedDataUrl)?;
            if !meta
                .split(';')
                .skip(1)
                .any(|p| p.trim().eq_ignore_ascii_case("base64"))
            {
                return Err(ImageUrlError::NotBase64);
            }
            data
        }
        Some(s) if s.eq_ignore_ascii_case("http") || s.eq_ignore_ascii_case("https") => {
            return Err(ImageUrlError::Remote {
                scheme: s.to_ascii_lowercase(),
            })
        }
        Some(s) => {
            return Err(ImageUrlError::UnsupportedScheme {
                scheme: s.to_string(),
            })
        }
        None => url,
    };
    let compact: Vec<u8> = data.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    if compact.is_empty() {
        return Err(ImageUrlError::Empty);
    }
    BASE64
        .decode(&compact)
        .map_err(|e| ImageUrlError::BadBase64 {
            reason: e.to_string(),
        })
}

/// The URL's scheme (RFC 3986: a letter, then letters, digits, `+ - .`,
/// then `:`), or `None` when the text has none (bare base64 has no `:`).
fn scheme(url: &str) -> Option<&str> {
    let (s, _) = url.split_once(':')?;
    let mut chars = s.chars();
    let first = chars.next()?;
    (first.is_ascii_alphabetic()
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
    .then_some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_urls_and_bare_base64_decode() {
        let bytes = b"\x89PNG\r\n\x1a\n-and-more";
        let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
        for url in [
            format!("data:image/png;base64,{b64}"),
            format!("DATA:image/jpeg;charset=x;BASE64,{b64}"),
            format!("data:;base64,{b64}"),
            format!("  {b64}\n"),
            // Line-wrapped and unpadded forms.
            format!("data:image/png;base64,{}\n{}", &b64[..8], &b64[8..]),
            b64.trim_end_matches('=').to_string(),
        ] {
            assert_eq!(decode_image_url(&url).as_deref(), Ok(&bytes[..]), "{url}");
        }
    }

    #[test]
    fn refusals_are_typed() {
        let cases = [
            (
                "https://example.com/cat.jpg",
                ImageUrlError::Remote {
                    scheme: "https".into(),
                },
            ),
            (
                "HTTP://example.com/cat.jpg",
                ImageUrlError::Remote {
                    scheme: "http".into(),
                },
            ),
            (
                "file:///etc/passwd",
                ImageUrlError::UnsupportedScheme {
                    scheme: "file".into(),
                },
            ),
            ("data:image/png,%89PNG", ImageUrlError::NotBase64),
            ("data:image/png;base64", ImageUrlError::MalformedDataUrl),
            ("data:image/png;base64,", ImageUrlError::Empty),
            ("", ImageUrlError::Empty),
        ];
        for (url, want) in cases {
            assert_eq!(decode_image_url(url), Err(want), "{url}");
        }
        assert!(matches!(
            decode_image_url("data:image/png;base64,not base64!"),
            Err(ImageUrlError::BadBase64 { .. })
        ));
        let msg = decode_image_url("https://x/y.png").unwrap_err().to_string();
        assert!(msg.contains("fetches nothing"), "{msg}");
    }
}
