//! `SamplingParams`: the standard per-request sampling parameters that every
//! Kestrel runtime's sampler understands. The pipeline itself treats them as
//! opaque [`crate::Executor::Params`]; they live here so runtimes, the engine
//! and the simulated executor share one validated type.

/// Validated sampling parameters (ranges are checked at the edge, once).
#[derive(Debug, Clone, Copy, PartialEq)]
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
