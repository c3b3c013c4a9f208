//! [`looping_tail`]: whether an output ends repeating one n-gram, the mark
//! of a greedy loop ("la Femme, la Femme, la Femme, ...") that ran until
//! `max_tokens`.
//!
//! The engine counts outputs cut by length that end so, so an operator sees
//! loops on a metric. Pure; O(`LOOP_MAX_PERIOD` x tail) per call, once per
//! finished request.

use kestrel_pipeline::TokenId;

/// Longest n-gram (in tokens) counted as a loop.
pub const LOOP_MAX_PERIOD: usize = 16;
/// Repetitions of the n-gram the tail must hold.
pub const LOOP_MIN_REPEATS: usize = 4;
/// Fewest tokens the repeating tail must cover (so `"!!!!"` is not a loop).
pub const LOOP_MIN_TOKENS: usize = 16;

/// The shortest period `n` (1 to [`LOOP_MAX_PERIOD`] tokens) such that
/// `tokens` ends with at least [`LOOP_MIN_REPEATS`] repetitions of its
/// last `n` tokens, covering at least [`LOOP_MIN_TOKENS`] tokens; `None`
/// when the output does not end in such a loop.
pub fn looping_tail(tokens: &[TokenId]) -> Option<usize> {
    (1..=LOOP_MAX_PERIOD).find(|&n| {
        let need = (n * LOOP_MIN_REPEATS).max(LOOP_MIN_TOKENS);
        need <= tokens.len() && {
            let tail = &tokens[tokens.len() - need..];
            tail.iter().zip(&tail[n..]).all(|(a, b)| a == b)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn loops_and_non_loops() {
        // "la Femme, " as four tokens, five times, after other text.
        let mut t: Vec<TokenId> = vec![9, 8, 7];
        for _ in 0..5 {
            t.extend([1, 2, 3, 4]);
        }
        assert_eq!(looping_tail(&t), Some(4));
        // One token repeated: period 1, once there are 16 of them.
        assert_eq!(looping_tail(&[5; 15]), None);
        assert_eq!(looping_tail(&[5; 16]), Some(1));
        // A loop broken by its last token is not a loop.
        t.push(9);
        assert_eq!(looping_tail(&t), None);
        // Three repetitions of an 8-gram are too few.
        let three: Vec<TokenId> = (0..24).map(|i| i % 8).collect();
        assert_eq!(looping_tail(&three), None);
        let four: Vec<TokenId> = (0..32).map(|i| i % 8).collect();
        assert_eq!(looping_tail(&four), Some(8));
    }

    proptest! {
        /// Any n-gram of distinct tokens repeated enough is found with its
        /// own period, whatever comes before it; cut one token short of
        /// the needed length, it is not.
        #[test]
        fn a_repeated_ngram_is_found_with_its_period(
            n in 1..=LOOP_MAX_PERIOD,
            prefix in proptest::collection::vec(1000u32..2000, 0..20),
        ) {
            let gram: Vec<TokenId> = (0..n as TokenId).collect();
            let need = (n * LOOP_MIN_REPEATS).max(LOOP_MIN_TOKENS);
            let mut t = prefix.clone();
            t.extend(gram.iter().cycle().take(need));
            prop_assert_eq!(looping_tail(&t), Some(n));
            // One fewer token of loop, after a prefix that cannot continue it.
            let mut short = vec![5000];
            short.extend(gram.iter().cycle().skip(1).take(need - 1));
            prop_assert_eq!(looping_tail(&short), None);
        }
    }
}
