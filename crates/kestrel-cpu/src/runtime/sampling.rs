//! Sampling on the device side: mask, penalties, temperature, top-k, top-p,
//! min-p and a per-request RNG keyed by (seed, position), so the same seed
//! gives the same output in any batch. Cost is O(vocab) per row with partial
//! selection (no full sort of the vocabulary unless top-p needs it).

use kestrel_pipeline::{SamplingParams, TokenId};

/// Token history of one sequence for repetition/frequency/presence penalties.
/// Buffers grow once to the vocabulary size and are reused across requests.
#[derive(Debug, Default)]
pub struct PenaltyState {
    /// Output occurrences per token.
    counts: Vec<u32>,
    /// Token appeared in prompt or output.
    seen: Vec<bool>,
    /// Distinct tokens with `seen` set (so penalties cost O(distinct)).
    seen_list: Vec<TokenId>,
}

impl PenaltyState {
    /// Start a new sequence with this prompt.
    pub fn reset(&mut self, prompt: &[TokenId]) {
        for &t in &self.seen_list {
            self.seen[t as usize] = false;
            self.counts[t as usize] = 0;
        }
        self.seen_list.clear();
        for &t in prompt {
            self.mark(t);
        }
    }

    fn mark(&mut self, t: TokenId) {
        let i = t as usize;
        if i >= self.seen.len() {
            self.seen.resize(i + 1, false);
            self.counts.resize(i + 1, 0);
        }
        if !self.seen[i] {
            self.seen[i] = true;
            self.seen_list.push(t);
        }
    }

    /// Record a generated token.
    pub fn observe(&mut self, t: TokenId) {
        self.mark(t);
        self.counts[t as usize] += 1;
    }

    fn apply(&self, logits: &mut [f32], p: &SamplingParams) {
        let rep = p.repetition_penalty != 1.0;
        let freq = p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
        if !rep && !freq {
            return;
        }
        for &t in &self.seen_list {
            let Some(l) = logits.get_mut(t as usize) else {
                continue;
            };
            if rep {
                *l = if *l > 0.0 {
                    *l / p.repetition_penalty
                } else {
                    *l * p.repetition_penalty
                };
            }
            let c = self.counts[t as usize];
            if c > 0 {
                *l -= p.frequency_penalty * c as f32 + p.presence_penalty;
            }
        }
    }
}

/// One sampled token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    pub token: TokenId,
    /// Log-probability under the distribution actually sampled from.
    pub logprob: f32,
}

/// Counter-based RNG: a uniform in [0, 1) from (seed, position).
fn uniform(seed: u64, position: u32) -> f32 {
    let mut z = seed ^ (u64::from(position)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 24) as f32
}

/// Sample one row. `logits` is modified in place (mask, penalties,
/// temperature). Appends `top_n` (token, logprob) pairs, best first, to `top`.
pub fn sample_row(
    logits: &mut [f32],
    p: &SamplingParams,
    mask: Option<&[u32]>,
    penalties: &mut PenaltyState,
    position: u32,
    top_n: usize,
    top: &mut Vec<(TokenId, f32)>,
) -> Sampled {
    if let Some(words) = mask {
        for (t, l) in logits.iter_mut().enumerate() {
            if words.get(t / 32).is_none_or(|w| w & (1 << (t % 32)) == 0) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    penalties.apply(logits, p);
    let greedy = p.is_greedy();
    if !greedy {
        let inv = 1.0 / p.temperature;
        for l in logits.iter_mut() {
            *l *= inv;
        }
    }
    // log-softmax normalizer over the (masked, penalized, tempered) logits.
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    let lse = max + sum.ln();
    let token = if greedy {
        argmax(logits)
    } else {
        sample_filtered(logits, p, max, uniform(p.seed, position))
    };
    if top_n > 0 {
        push_top(logits, lse, top_n, top);
    }
    Sampled {
        token,
        logprob: logits[token as usize] - lse,
    }
}

/// First index of the maximum (ties go to the lowest id).
fn argmax(logits: &[f32]) -> TokenId {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as TokenId
}

fn sample_filtered(logits: &[f32], p: &SamplingParams, max: f32, u: f32) -> TokenId {
    // Candidates: indices above min-p, then top-k, then top-p.
    let min_logit = if p.min_p > 0.0 {
        max + p.min_p.ln()
    } else {
        f32::NEG_INFINITY
    };
    let mut cand: Vec<(f32, u32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, &l)| l >= min_logit && l > f32::NEG_INFINITY)
        .map(|(i, &l)| (l, i as u32))
        .collect();
    if cand.is_empty() {
        return argmax(logits);
    }
    let by_logit = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    if p.top_k > 0 && (p.top_k as usize) < cand.len() {
        cand.select_nth_unstable_by(p.top_k as usize - 1, by_logit);
        cand.truncate(p.top_k as usize);
    }
    cand.sort_unstable_by(by_logit);
    let mut probs: Vec<f32> = cand.iter().map(|&(l, _)| (l - max).exp()).collect();
    let total: f32 = probs.iter().sum();
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, &q) in probs.iter().enumerate() {
            acc += q / total;
            if acc >= p.top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        cand.truncate(keep);
    }
    let total: f32 = probs.iter().sum();
    let mut target = u * total;
    for (i, &q) in probs.iter().enumerate() {
        if target < q {
            return cand[i].1;
        }
        target -= q;
    }
    cand[cand.len() - 1].1
}

fn push_top(logits: &[f32], lse: f32, n: usize, top: &mut Vec<(TokenId, f32)>) {
    let start = top.len();
    for (i, &l) in logits.iter().enumerate() {
        let entry = (i as TokenId, l - lse);
        let cur = &mut top[start..];
        if cur.len() < n {
            top.push(entry);
        } else if let Some(min_pos) = (0..cur.len()).min_by(|&a, &b| cur[a].1.total_cmp(&cur[b].1))
        {
            if entry.1 > cur[min_pos].1 {
                cur[min_pos] = entry;
            }
        }
        let _ = i;
    }
    top[start..].sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: t,
            seed,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_and_mask() {
        let mut pen = PenaltyState::default();
        let mut top = Vec::new();
        let mut l = vec![0.0, 3.0, 3.0, 1.0];
        assert_eq!(
            sample_row(&mut l, &params(0.0, 0), None, &mut pen, 0, 2, &mut top).token,
            1,
            "ties go low"
        );
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        let mut l = vec![0.0, 3.0, 3.0, 1.0];
        let mask = [0b1001u32];
        assert_eq!(
            sample_row(
                &mut l,
                &params(0.0, 0),
                Some(&mask),
                &mut pen,
                0,
                0,
                &mut top
            )
            .token,
            3
        );
    }

    #[test]
    fn seeded_sampling_is_deterministic_and_respects_top_k() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
        let mut pen = PenaltyState::default();
        let mut top = Vec::new();
        for pos in 0..50 {
            let p = SamplingParams {
                top_k: 3,
                ..params(1.0, 42)
            };
            let a = sample_row(&mut logits.clone(), &p, None, &mut pen, pos, 0, &mut top);
            let b = sample_row(&mut logits.clone(), &p, None, &mut pen, pos, 0, &mut top);
            assert_eq!(a, b);
            assert_eq!(
                logits[a.token as usize],
                6.0 * 0.3,
                "top-3 keeps only the max-logit ties"
            );
        }
    }

    #[test]
    fn repetition_penalty_discourages_seen_tokens() {
        let mut pen = PenaltyState::default();
        pen.reset(&[1]);
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..params(0.0, 0)
        };
        let mut top = Vec::new();
        let mut l = vec![0.0, 2.0, 1.5];
        assert_eq!(
            sample_row(&mut l, &p, None, &mut pen, 0, 0, &mut top).token,
            2
        );
    }
}
