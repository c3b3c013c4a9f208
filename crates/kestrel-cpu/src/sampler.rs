//! Token sampling: mask -> penalties -> temperature -> top-k -> top-p ->
//! min-p -> draw, with logprobs of the final distribution.
//!
//! Randomness is counter-based: the uniform draw for a step is a hash of
//! `(seed, position)`, so a request's output never depends on what else was
//! in its batch. Cost per step: O(vocab) passes (mask, max, exp-sum) plus
//! partial selection; a full sort happens only on the candidate set kept by
//! top-k/top-p. [`PenaltyState`] holds the sequence's token counts and the
//! candidate buffer, allocated once per sequence: steps allocate nothing.

use crate::kernels::ops::exp;

/// Most `top_logprobs` a [`SampledToken`] carries.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Per-request sampling settings: the standard type every runtime shares.
pub use kestrel_pipeline::SamplingParams;

/// Up to [`MAX_TOP_LOGPROBS`] `(token, logprob)` pairs, most likely first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TopLogprobs {
    len: usize,
    items: [(u32, f32); MAX_TOP_LOGPROBS],
}

impl TopLogprobs {
    fn new() -> Self {
        TopLogprobs {
            len: 0,
            items: [(0, 0.0); MAX_TOP_LOGPROBS],
        }
    }
    pub fn as_slice(&self) -> &[(u32, f32)] {
        &self.items[..self.len]
    }
}

/// The outcome of one [`sample`] call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampledToken {
    pub token: u32,
    /// Log-probability of `token` under the final distribution (after all
    /// filters; for greedy, the masked and penalized softmax at temperature 1).
    /// NaN for a greedy row that asked for no logprobs (`params.logprobs`
    /// false and `top_logprobs` 0): its softmax is never computed.
    pub logprob: f32,
    /// The most likely tokens of that same distribution.
    pub top: TopLogprobs,
}

/// A sequence's token counts (for penalties) and reusable sampler buffers.
#[derive(Debug, Clone)]
pub struct PenaltyState {
    counts: Vec<u32>,
    seen: Vec<u32>,
    cand: Vec<(f32, u32)>,
}

impl PenaltyState {
    /// Empty state for a vocabulary of `vocab` tokens (one allocation).
    pub fn new(vocab: usize) -> Self {
        PenaltyState {
            counts: vec![0; vocab],
            seen: Vec::new(),
            cand: Vec::with_capacity(vocab),
        }
    }

    /// Count `token` as part of the sequence (call once per token that the
    /// penalties should see: generated tokens, and the prompt if wanted).
    pub fn record(&mut self, token: u32) {
        let c = &mut self.counts[token as usize];
        if *c == 0 {
            self.seen.push(token);
        }
        *c += 1;
    }

    /// How often `token` was recorded.
    pub fn count(&self, token: u32) -> u32 {
        self.counts[token as usize]
    }

    /// Forget all counts, keeping the buffers.
    pub fn clear(&mut self) {
        for &t in &self.seen {
            self.counts[t as usize] = 0;
        }
        self.seen.clear();
    }
}

/// The counter-based uniform draw for `(seed, position)`: kestrel-numerics'
/// definition, which every runtime's sampler shares.
pub use kestrel_numerics::uniform;

/// Set the logits of tokens `mask` forbids to -inf (tokens past the mask's
/// words are forbidden too). Whole words of allowed tokens are skipped.
fn apply_mask(logits: &mut [f32], mask: &[u32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let word = mask.get(w).copied().unwrap_or(0);
        if word == u32::MAX {
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if word >> b & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// `l`'s rank in `f32::total_cmp` order as an i32 (+0.0 above -0.0), or
/// `i32::MIN` (below every ranked value) for -inf and NaN, which sampling
/// excludes.
#[inline(always)]
fn greedy_key(l: f32) -> i32 {
    let b = l.to_bits() as i32;
    let key = b ^ (((b >> 31) as u32) >> 1) as i32;
    if l > f32::NEG_INFINITY {
        key
    } else {
        i32::MIN
    }
}

/// The largest [`greedy_key`] of `logits`, over 16 independent lanes so
/// that the compiler vectorizes it.
#[inline(always)]
fn max_key(logits: &[f32]) -> i32 {
    let mut acc = [i32::MIN; 16];
    let mut chunks = logits.chunks_exact(16);
    for c in &mut chunks {
        for (a, &l) in acc.iter_mut().zip(c) {
            *a = (*a).max(greedy_key(l));
        }
    }
    let tail = chunks.remainder().iter().map(|&l| greedy_key(l));
    acc.into_iter().chain(tail).fold(i32::MIN, i32::max)
}

/// [`max_key`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn max_key_avx2(logits: &[f32]) -> i32 {
    max_key(logits)
}

/// The id of the largest logit (`total_cmp` order, lowest id on ties,
/// -inf and NaN excluded): the full path's greedy pick. Two branch-free
/// passes over integer keys, which vectorize: a compare-and-branch chain
/// costs about a nanosecond per logit, under 40 us per 49k-token row (6 us
/// now, `cargo bench -p kestrel-cpu --bench sampler`).
fn greedy_argmax(logits: &[f32]) -> Option<u32> {
    const CHUNK: usize = 64;
    #[cfg(target_arch = "x86_64")]
    let max = if crate::kernels::Isa::detect() != crate::kernels::Isa::Scalar {
        // SAFETY: any ISA but Scalar implies AVX2 (see `Isa::is_supported`).
        unsafe { max_key_avx2(logits) }
    } else {
        max_key(logits)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let max = max_key(logits);
    if max == i32::MIN {
        return None;
    }
    // The first chunk holding the max, then the position inside it.
    let (c, chunk) = logits.chunks(CHUNK).enumerate().find(|(_, ch)| {
        ch.iter()
            .fold(false, |any, &l| any | (greedy_key(l) == max))
    })?;
    let i = chunk.iter().position(|&l| greedy_key(l) == max)?;
    Some((c * CHUNK + i) as u32)
}

/// Descending by logit, ascending by id: a total, deterministic order.
#[inline]
fn desc(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Sample one token from `logits` (one row, modified in place: the mask and
/// penalties are applied to it). `position` keys the random draw.
/// Returns `None` only when the mask allows no token. `top_logprobs`
/// alternatives are returned (at most [`MAX_TOP_LOGPROBS`]).
pub fn sample(
    logits: &mut [f32],
    params: &SamplingParams,
    mask: Option<&[u32]>,
    state: &mut PenaltyState,
    position: u32,
    top_logprobs: usize,
) -> Option<SampledToken> {
    let vocab = logits.len();
    if let Some(m) = mask {
        apply_mask(logits, m);
    }
    // After the mask: -inf plus a bias stays -inf, so no bias unmasks.
    for &(t, b) in params.logit_bias.entries() {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
    let (rp, fp, pp) = (
        params.repetition_penalty,
        params.frequency_penalty,
        params.presence_penalty,
    );
    if rp != 1.0 || fp != 0.0 || pp != 0.0 {
        for &t in &state.seen {
            let (l, c) = (&mut logits[t as usize], state.counts[t as usize]);
            if rp != 1.0 {
                *l = if *l > 0.0 { *l / rp } else { *l * rp };
            }
            *l -= fp * c as f32 + pp;
        }
    }
    let greedy = params.temperature <= 0.0;
    if greedy && !params.logprobs && top_logprobs == 0 {
        // Argmax only: no candidate list, no softmax.
        return greedy_argmax(logits).map(|token| SampledToken {
            token,
            logprob: f32::NAN,
            top: TopLogprobs::new(),
        });
    }
    let inv_t = if greedy {
        1.0
    } else {
        1.0 / params.temperature
    };
    // Candidates in id order, temperature applied.
    let cand = &mut state.cand;
    cand.clear();
    cand.extend(
        logits
            .iter()
            .enumerate()
            .filter(|(_, l)| **l > f32::NEG_INFINITY)
            .map(|(t, &l)| (l * inv_t, t as u32)),
    );
    if cand.is_empty() {
        return None;
    }
    let k = params.top_k as usize;
    if !greedy && k > 0 && k < cand.len() {
        cand.select_nth_unstable_by(k - 1, desc);
        cand.truncate(k);
    }
    let max = cand.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.0));
    if !greedy && params.top_p < 1.0 {
        let z: f64 = cand.iter().map(|c| exp(c.0 - max) as f64).sum();
        let target = params.top_p as f64 * z;
        // Sort a growing prefix until it holds `top_p` of the mass.
        let mut m = 64.min(cand.len());
        loop {
            if m < cand.len() {
                cand.select_nth_unstable_by(m - 1, desc);
            }
            cand[..m].sort_unstable_by(desc);
            let mut acc = 0f64;
            let cut = cand[..m].iter().position(|c| {
                acc += exp(c.0 - max) as f64;
                acc >= target
            });
            if let Some(i) = cut {
                cand.truncate(i + 1);
                break;
            }
            if m == cand.len() {
                break;
            }
            m = (m * 8).min(cand.len());
        }
    }
    if !greedy && params.min_p > 0.0 {
        let floor = max + params.min_p.ln();
        cand.retain(|c| c.0 >= floor);
    }
    // Final distribution over `cand`: logprob = l - max - ln z.
    let z: f64 = cand.iter().map(|c| exp(c.0 - max) as f64).sum();
    let lz = max + z.ln() as f32;
    let token = if greedy {
        cand.iter()
            .fold(cand[0], |b, c| if desc(c, &b).is_lt() { *c } else { b })
            .1
    } else {
        // Walk in id order so the draw does not depend on selection internals.
        if cand.len() < vocab {
            cand.sort_unstable_by_key(|c| c.1);
        }
        let u = uniform(params.seed, position) * z;
        let mut acc = 0f64;
        let mut pick = cand[cand.len() - 1].1;
        for c in cand.iter() {
            acc += exp(c.0 - max) as f64;
            if acc > u {
                pick = c.1;
                break;
            }
        }
        pick
    };
    let logprob = logits[token as usize] * inv_t - lz;
    let mut top = TopLogprobs::new();
    let n = top_logprobs.min(MAX_TOP_LOGPROBS).min(cand.len());
    if n > 0 {
        if n < cand.len() {
            cand.select_nth_unstable_by(n - 1, desc);
        }
        cand[..n].sort_unstable_by(desc);
        for (slot, c) in top.items.iter_mut().zip(&cand[..n]) {
            *slot = (c.1, c.0 - lz);
        }
        top.len = n;
    }
    Some(SampledToken {
        token,
        logprob,
        top,
    })
}
