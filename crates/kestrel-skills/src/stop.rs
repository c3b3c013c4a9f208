//! Stop strings that may span token boundaries.
//!
//! After each append, only the new text plus the `max_len - 1` bytes before it
//! are searched, so a step costs O(new text + stop lengths). Text that could
//! still grow into a stop string (the longest suffix that is a proper prefix of
//! one) is held back from streaming; a match truncates the output before it.

/// A validated, non-empty list of non-empty stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    max_len: usize,
}

impl StopStrings {
    /// `stops` must be non-empty strings (validated by the caller).
    pub fn new(stops: Vec<String>) -> Self {
        debug_assert!(stops.iter().all(|s| !s.is_empty()));
        let max_len = stops.iter().map(String::len).max().unwrap_or(0);
        Self { stops, max_len }
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Earliest start of a stop string in `text` that ends past `old_len`
    /// (the length before the latest append). Matches ending at or before
    /// `old_len` were already found by earlier calls.
    pub fn find(&self, text: &str, old_len: usize) -> Option<usize> {
        if self.stops.is_empty() {
            return None;
        }
        let mut start = old_len.saturating_sub(self.max_len - 1).min(text.len());
        while !text.is_char_boundary(start) {
            start -= 1;
        }
        let hay = &text[start..];
        self.stops
            .iter()
            .filter_map(|s| hay.find(s.as_str()))
            .min()
            .map(|p| start + p)
    }

    /// Length of the longest suffix of `text` that is a proper prefix of some
    /// stop string: the bytes that must not be streamed yet. The suffix always
    /// starts on a char boundary (it equals the start of a valid string).
    pub fn holdback(&self, text: &str) -> usize {
        let t = text.as_bytes();
        let mut best = 0;
        for s in &self.stops {
            let s = s.as_bytes();
            let mut k = (s.len() - 1).min(t.len());
            while k > best {
                if t.ends_with(&s[..k]) {
                    best = k;
                    break;
                }
                k -= 1;
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(v: &[&str]) -> StopStrings {
        StopStrings::new(v.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn finds_across_appends() {
        let s = stops(&["END", "\n\n"]);
        let mut text = String::from("abc E");
        assert_eq!(s.find(&text, 0), None);
        assert_eq!(s.holdback(&text), 1);
        let old = text.len();
        text.push_str("NDxyz");
        assert_eq!(s.find(&text, old), Some(4));
    }

    #[test]
    fn earliest_match_wins() {
        let s = stops(&["cd", "b"]);
        assert_eq!(s.find("abcd", 0), Some(1));
    }

    #[test]
    fn holdback_respects_multibyte() {
        let s = stops(&["é!"]);
        assert_eq!(s.holdback("café"), "é".len());
        assert_eq!(s.holdback("caf"), 0);
        // Search start never splits a char.
        assert_eq!(s.find("ééé!", "éé".len() + 1), Some("éé".len()));
    }
}
