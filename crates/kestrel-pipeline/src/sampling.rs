//! `SamplingParams`: the standard per-request sampling parameters that every
//! Kestrel runtime's sampler understands. The pipeline itself treats them as
//! opaque [`crate::Executor::Params`]; they live here so runtimes, the engine
//! and the simulated executor share one validated type.

use std::sync::Arc;

use crate::TokenId;

/// Additive per-token logit biases (OpenAI's `logit_bias`): sorted by token
/// id, each id once. Cheap to clone; empty by default. Ranges (ids inside
/// the vocabulary, values in OpenAI's `[-100, 100]`) are the edge's to check.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogitBias(Arc<[(TokenId, f32)]>);

impl LogitBias {
    /// From `(token, bias)` pairs; a later entry for the same token replaces
    /// an earlier one.
    pub fn new(entries: impl IntoIterator<Item = (TokenId, f32)>) -> Self {
        let mut v: Vec<(TokenId, f32)> = entries.into_iter().collect();
        // Stable, so among equal ids the last given stays last.
        v.sort_by_key(|&(t, _)| t);
        let mut out: Vec<(TokenId, f32)> = Vec::with_capacity(v.len());
        for (t, b) in v {
            match out.last_mut() {
                Some(last) if last.0 == t => last.1 = b,
                _ => out.push((t, b)),
            }
        }
        Self(out.into())
    }

    /// The biases, in token-id order.
    pub fn entries(&self) -> &[(TokenId, f32)] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Validated sampling parameters (ranges are checked at the edge, once).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax, ties to the lowest id).
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    /// 1.0 disables nucleus sampling.
    pub top_p: f32,
    /// 0 disables min-p.
    pub min_p: f32,
    /// 1.0 disables; > 1 penalizes tokens already in prompt or output.
    pub repetition_penalty: f32,
    /// Subtracted once per occurrence in the output.
    pub frequency_penalty: f32,
    /// Subtracted once if present in the output.
    pub presence_penalty: f32,
    /// Per-request RNG seed: same seed, same output, in any batch.
    pub seed: u64,
    /// Alternatives to report per token (0 = none).
    pub top_logprobs: u32,
    /// Whether to report the sampled token's log-probability.
    pub logprobs: bool,
    /// Added to the logits after the constraint's mask (a masked token
    /// stays masked) and before penalties and temperature.
    pub logit_bias: LogitBias,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
            top_logprobs: 0,
            logprobs: false,
            logit_bias: LogitBias::default(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Whether the sampler must look past the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logit_bias_sorts_and_keeps_the_last_entry_per_token() {
        let b = LogitBias::new([(9, 1.0), (2, -5.0), (9, 3.0), (4, 0.5)]);
        assert_eq!(b.entries(), &[(2, -5.0), (4, 0.5), (9, 3.0)]);
        assert!(LogitBias::default().is_empty());
    }
}
