//! Incremental UTF-8 detokenization: token bytes in, complete characters out.
//!
//! Each push costs O(bytes of the new token); nothing already decoded is
//! looked at again. A character split across tokens is held (at most 3 bytes)
//! until its last byte arrives; bytes that can never form a character become
//! U+FFFD, exactly as `String::from_utf8_lossy` would render the whole output.

/// Holds the incomplete tail of a UTF-8 character between tokens.
#[derive(Debug, Default, Clone)]
pub struct Utf8Decoder {
    pending: [u8; 4],
    pending_len: usize,
    /// Reused when a pending tail must be joined with the next token's bytes.
    scratch: Vec<u8>,
}

impl Utf8Decoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending(&self) -> &[u8] {
        &self.pending[..self.pending_len]
    }

    /// Appends the complete characters of `pending ++ bytes` to `out` and keeps
    /// an incomplete trailing character pending.
    pub fn push(&mut self, bytes: &[u8], out: &mut String) {
        if self.pending_len == 0 {
            self.decode(bytes, out);
        } else {
            let mut scratch = std::mem::take(&mut self.scratch);
            scratch.clear();
            scratch.extend_from_slice(&self.pending[..self.pending_len]);
            scratch.extend_from_slice(bytes);
            self.pending_len = 0;
            self.decode(&scratch, out);
            self.scratch = scratch;
        }
    }

    /// The output ended: a dangling incomplete character becomes U+FFFD.
    pub fn finish(&mut self, out: &mut String) {
        if self.pending_len > 0 {
            self.pending_len = 0;
            out.push(char::REPLACEMENT_CHARACTER);
        }
    }

    fn decode(&mut self, bytes: &[u8], out: &mut String) {
        let mut chunks = bytes.utf8_chunks().peekable();
        while let Some(chunk) = chunks.next() {
            out.push_str(chunk.valid());
            let invalid = chunk.invalid();
            if invalid.is_empty() {
                continue;
            }
            let is_last = chunks.peek().is_none();
            // An incomplete (but so far valid) sequence at the very end waits
            // for the next token; anything else is malformed.
            let incomplete =
                is_last && std::str::from_utf8(invalid).is_err_and(|e| e.error_len().is_none());
            if incomplete {
                self.pending[..invalid.len()].copy_from_slice(invalid);
                self.pending_len = invalid.len();
            } else {
                out.push(char::REPLACEMENT_CHARACTER);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn decode_split(bytes: &[u8], cuts: &[usize]) -> String {
        let mut d = Utf8Decoder::new();
        let mut out = String::new();
        let mut start = 0;
        for &c in cuts {
            let c = c.clamp(start, bytes.len());
            d.push(&bytes[start..c], &mut out);
            start = c;
        }
        d.push(&bytes[start..], &mut out);
        d.finish(&mut out);
        out
    }

    #[test]
    fn multibyte_split_is_held_until_complete() {
        let s = "a😀b";
        let b = s.as_bytes();
        let mut d = Utf8Decoder::new();
        let mut out = String::new();
        d.push(&b[..2], &mut out);
        assert_eq!(out, "a");
        assert_eq!(d.pending().len(), 1);
        d.push(&b[2..4], &mut out);
        assert_eq!(out, "a");
        d.push(&b[4..], &mut out);
        assert_eq!(out, s);
        assert!(d.pending().is_empty());
    }

    #[test]
    fn malformed_bytes_become_replacement() {
        assert_eq!(decode_split(b"a\xffb", &[1, 2]), "a\u{fffd}b");
        // A truncated char followed by ASCII.
        assert_eq!(decode_split(b"\xe2\x82a", &[1]), "\u{fffd}a");
        // Dangling at the end.
        assert_eq!(decode_split(b"ok\xf0\x9f", &[3]), "ok\u{fffd}");
    }

    proptest! {
        /// Any byte string, cut anywhere, decodes like `from_utf8_lossy`.
        #[test]
        fn matches_lossy_decode(bytes in proptest::collection::vec(any::<u8>(), 0..64),
                                mut cuts in proptest::collection::vec(0usize..64, 0..16)) {
            cuts.sort_unstable();
            prop_assert_eq!(decode_split(&bytes, &cuts), String::from_utf8_lossy(&bytes));
        }

        /// Valid text cut at every byte decodes exactly.
        #[test]
        fn valid_text_roundtrips(s in "\\PC{0,24}") {
            let cuts: Vec<usize> = (0..=s.len()).collect();
            prop_assert_eq!(decode_split(s.as_bytes(), &cuts), s);
        }
    }
}
