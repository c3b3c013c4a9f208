//! Prompt-lookup (n-gram) drafting for speculative decoding without a
//! draft model: the tokens that followed the latest earlier occurrence of a
//! sequence's last `n` tokens are proposed to follow it again. Outputs that
//! quote or rewrite their context (code edits, summaries, extraction) find
//! long matches; a forward verifies them all at once (see
//! [`crate::executor::Drafts`]).
//!
//! Whether a sequence drafts is the scheduler's call: a drafting sequence
//! waits for its previous step's tokens (it drafts from them), so it gives
//! up overlapping its own steps. After a try that gained nothing (no match,
//! or no draft accepted) it decodes overlapped for a while before trying
//! again, so a sequence whose text does not repeat loses little; and it
//! proposes about as many drafts as it has lately had accepted, since on a
//! CPU each draft costs a good part of a decode step's compute
//! ([`DraftControl`]).

use crate::TokenId;

/// A request's speculation settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NgramSpec {
    /// Draft tokens per step at most (`k`).
    pub max_draft: usize,
    /// Longest suffix matched; tried first.
    pub max_ngram: usize,
    /// Shortest suffix matched (at least 1).
    pub min_ngram: usize,
}

impl NgramSpec {
    /// Suffix lengths tried by default: 3 down to 2 (a single-token match
    /// is too often a coincidence to pay for its verification).
    pub const DEFAULT_NGRAM: (usize, usize) = (2, 3);

    /// `k` drafts per step, matching suffixes of 3 then 2 tokens.
    pub fn new(max_draft: usize) -> Self {
        Self {
            max_draft,
            max_ngram: Self::DEFAULT_NGRAM.1,
            min_ngram: Self::DEFAULT_NGRAM.0,
        }
    }

    /// Appends to `out` up to `max` tokens that followed the latest earlier
    /// occurrence of `context`'s last `n` tokens, for `n` from `max_ngram`
    /// down to `min_ngram` (the longest suffix with a match wins). Returns
    /// how many it appended. O(`context.len()` x `max_ngram`).
    pub fn propose(&self, context: &[TokenId], max: usize, out: &mut Vec<TokenId>) -> usize {
        let max = max.min(self.max_draft);
        if max == 0 {
            return 0;
        }
        let len = context.len();
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if len <= n {
                continue;
            }
            let suffix = &context[len - n..];
            // Latest first: occurrences starting before the suffix itself.
            if let Some(start) = (0..len - n).rev().find(|&i| &context[i..i + n] == suffix) {
                let from = start + n;
                let take = max.min(len - from);
                out.extend_from_slice(&context[from..from + take]);
                return take;
            }
        }
        0
    }
}

/// How a sequence drafts next: how many tokens (adapted to what it had
/// accepted, since every draft costs a forward row whether accepted or
/// not), and when it next waits for its tokens to draft (after a try that
/// gained nothing it decodes `2^misses` steps, up to [`DraftControl::MAX_WAIT`],
/// overlapped first).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct DraftControl {
    misses: u32,
    /// Overlapped steps left before the next try.
    pub wait: u32,
    /// Drafts the next try proposes at most (0: not yet tried, the maximum).
    len: usize,
}

impl DraftControl {
    /// Overlapped steps after a long run of fruitless tries.
    pub const MAX_WAIT: u32 = 64;

    /// Drafts the next try may propose, of `max_draft`.
    pub fn len(&self, max_draft: usize) -> usize {
        match self.len {
            0 => max_draft,
            n => n.min(max_draft),
        }
    }

    /// A try proposed `proposed` drafts and `accepted` of them were
    /// accepted. All accepted: one more next time; some: one more than
    /// were; none (or nothing proposed): back off.
    pub fn tried(&mut self, proposed: usize, accepted: usize, max_draft: usize) {
        if accepted == 0 {
            self.misses = (self.misses + 1).min(6);
            self.wait = (1u32 << self.misses).min(Self::MAX_WAIT);
            if proposed > 0 {
                self.len = 1;
            }
            return;
        }
        self.misses = 0;
        self.wait = 0;
        self.len = if accepted == proposed {
            (self.len(max_draft) + 1).min(max_draft)
        } else {
            accepted + 1
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn propose(spec: NgramSpec, context: &[TokenId], max: usize) -> Vec<TokenId> {
        let mut out = vec![99];
        let n = spec.propose(context, max, &mut out);
        assert_eq!(n, out.len() - 1);
        out.split_off(1)
    }

    #[test]
    fn the_longest_suffix_with_a_match_wins_and_the_latest_occurrence() {
        let spec = NgramSpec::new(4);
        // "1 2 3" occurs at 0 (followed by 4 5) and at 5 (followed by 7 8 1 2).
        let ctx = [1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 1, 2, 3];
        assert_eq!(propose(spec, &ctx, 8), [7, 8, 1, 2]);
        assert_eq!(propose(spec, &ctx, 2), [7, 8]);
        // No 3- or 2-token match: nothing (single tokens are not matched).
        assert_eq!(propose(spec, &[5, 6, 7, 5, 9], 4), Vec::<u32>::new());
        let single = NgramSpec {
            min_ngram: 1,
            ..spec
        };
        assert_eq!(propose(single, &[5, 6, 7, 5], 4), [6, 7, 5]);
        // A match that runs into the end proposes what there is.
        assert_eq!(propose(spec, &[1, 2, 1, 2], 4), [1, 2]);
        assert_eq!(propose(spec, &[1, 2], 4), Vec::<u32>::new());
        assert_eq!(propose(NgramSpec::new(0), &ctx, 4), Vec::<u32>::new());
    }

    #[test]
    fn draft_control_backs_off_on_misses_and_follows_acceptance() {
        let mut c = DraftControl::default();
        assert_eq!(c.len(8), 8);
        let waits: Vec<u32> = (0..8)
            .map(|_| {
                c.tried(0, 0, 8);
                c.wait
            })
            .collect();
        assert_eq!(waits, [2, 4, 8, 16, 32, 64, 64, 64]);
        assert_eq!(c.len(8), 8, "nothing proposed: the length stays");
        c.tried(8, 0, 8);
        assert_eq!((c.len(8), c.wait), (1, 64));
        c.tried(1, 1, 8);
        assert_eq!((c.len(8), c.wait), (2, 0));
        c.tried(2, 2, 8);
        c.tried(3, 3, 8);
        assert_eq!(c.len(8), 4);
        c.tried(4, 2, 8);
        assert_eq!(c.len(8), 3);
        assert_eq!(c.len(2), 2, "never past the request's maximum");
        for _ in 0..10 {
            c.tried(8, 8, 8);
        }
        assert_eq!(c.len(8), 8);
    }
}
