//! Request and response types of the public API, and their validation.
//!
//! [`GenerateRequest`] is raw input; [`crate::Engine`] turns it into a
//! validated submission once, on the caller's thread (sampling ranges,
//! prompt rendering and tokenization, constraint compilation, context
//! check), so nothing invalid is ever queued and the engine thread never
//! re-validates.

pub use kestrel_model::ChatMessage;
pub use kestrel_pipeline::SamplingParams;

use crate::error::EngineError;

/// What the model continues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Raw text; BOS is prepended when the model wants one.
    Text(String),
    /// A conversation, rendered with the model's chat template (generation prompt appended).
    Chat(Vec<ChatMessage>),
}

/// A structured-output constraint (compiled by llguidance at submission).
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// JSON matching this JSON Schema; the response carries the parsed value.
    JsonSchema(serde_json::Value),
    /// Text matching this regex (anchored).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar (llguidance dialect, rule `start`).
    Grammar(String),
}

/// One generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    /// Caller-chosen id, unique among live requests; `None` assigns `req-<n>`.
    pub request_id: Option<String>,
    pub input: Prompt,
    /// At least 1; `prompt + max_new_tokens` must fit the context (rejected
    /// with `ContextOverflow` otherwise, never clamped).
    pub max_new_tokens: u32,
    /// `seed == 0` means "not given": the seed is derived from the request id
    /// (FNV-1a of its bytes), so a retried id reproduces its output.
    pub sampling: SamplingParams,
    /// Stop strings (text requests only); the match is not part of the output.
    pub stop: Vec<String>,
    /// Stop token ids (text requests only).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS (text requests only).
    pub ignore_eos: bool,
    pub constraint: Option<Constraint>,
}

impl GenerateRequest {
    /// A text request with greedy sampling and no stop conditions but EOS.
    pub fn text(prompt: impl Into<String>, max_new_tokens: u32) -> Self {
        Self::new(Prompt::Text(prompt.into()), max_new_tokens)
    }

    /// A chat request with greedy sampling.
    pub fn chat(messages: Vec<ChatMessage>, max_new_tokens: u32) -> Self {
        Self::new(Prompt::Chat(messages), max_new_tokens)
    }

    fn new(input: Prompt, max_new_tokens: u32) -> Self {
        Self {
            request_id: None,
            input,
            max_new_tokens,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            constraint: None,
        }
    }
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// A stop string or stop token matched, or a constraint completed.
    Stop,
    /// `max_new_tokens` (or the context) was reached.
    Length,
    /// The model produced end-of-sequence.
    Eos,
    /// The request was aborted (by [`crate::Engine::abort`], a dropped
    /// stream, or shutdown past its deadline).
    Abort,
    /// The request failed (only used by callers mapping errors; the engine
    /// reports failures as `Err(EngineError)`).
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Eos => "eos",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }

    pub(crate) fn from_pipeline(r: kestrel_pipeline::FinishReason) -> Self {
        match r {
            kestrel_pipeline::FinishReason::Eos => FinishReason::Eos,
            kestrel_pipeline::FinishReason::Stop => FinishReason::Stop,
            kestrel_pipeline::FinishReason::Length => FinishReason::Length,
            kestrel_pipeline::FinishReason::Abort => FinishReason::Abort,
        }
    }
}

/// Token counts of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache (0 until the runtime
    /// reports it per request).
    pub cached_prompt_tokens: u32,
}

/// Latencies of a request, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    /// Submission until admission (the prefill launch, observed as the
    /// first scheduler query of the request's skill).
    pub queue_ms: f64,
    /// Submission until the first token was committed.
    pub ttft_ms: f64,
    /// Submission until the request finished.
    pub total_ms: f64,
    /// Completion tokens per second after the first token.
    pub tokens_per_s: f64,
}

/// Log-probabilities of one generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    /// The token's text (lossy UTF-8 of its bytes; empty for control tokens).
    pub text: String,
    /// NaN when the runtime did not compute it for this step.
    pub logprob: f32,
    /// Top alternatives `(token_id, text, logprob)`, best first.
    pub top: Vec<(u32, String, f32)>,
}

/// The final result of a request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateResponse {
    pub request_id: String,
    /// Output text (control tokens, EOS and a matched stop string excluded).
    pub text: String,
    /// Every generated token, including a final EOS or stop token.
    pub token_ids: Vec<u32>,
    pub finish_reason: FinishReason,
    pub usage: Usage,
    pub timings: Timings,
    /// Per-token log-probabilities, when `sampling.logprobs` or `top_logprobs` asked.
    pub logprobs: Vec<TokenLogprob>,
    /// The parsed value for a `JsonSchema` constraint whose output parses.
    pub json: Option<serde_json::Value>,
}

/// One item of a [`crate::GenerationStream`].
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEvent {
    /// Newly committed output; the concatenated `text`s equal the final text.
    Delta {
        text: String,
        token_ids: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
    },
    /// The request finished; always the last item.
    Done(GenerateResponse),
}

/// Most alternatives a request may ask for per token.
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Checks sampling ranges (the pipeline treats them as already valid).
pub(crate) fn validate_sampling(s: &SamplingParams) -> Result<(), EngineError> {
    let bad = |field, message: String| Err(EngineError::invalid(field, message));
    if !s.temperature.is_finite() || s.temperature < 0.0 {
        return bad(
            "temperature",
            format!("must be finite and >= 0, got {}", s.temperature),
        );
    }
    if !(s.top_p > 0.0 && s.top_p <= 1.0) {
        return bad("top_p", format!("must be in (0, 1], got {}", s.top_p));
    }
    if !(0.0..=1.0).contains(&s.min_p) {
        return bad("min_p", format!("must be in [0, 1], got {}", s.min_p));
    }
    if !s.repetition_penalty.is_finite() || s.repetition_penalty <= 0.0 {
        return bad(
            "repetition_penalty",
            format!("must be finite and > 0, got {}", s.repetition_penalty),
        );
    }
    if !s.frequency_penalty.is_finite() {
        return bad("frequency_penalty", "must be finite".into());
    }
    if !s.presence_penalty.is_finite() {
        return bad("presence_penalty", "must be finite".into());
    }
    if s.top_logprobs > MAX_TOP_LOGPROBS {
        return bad(
            "top_logprobs",
            format!("at most {MAX_TOP_LOGPROBS}, got {}", s.top_logprobs),
        );
    }
    Ok(())
}

/// The seed used when a request gives none: FNV-1a of the request id, never 0.
pub fn seed_for_request_id(request_id: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in request_id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_ranges_are_checked() {
        assert!(validate_sampling(&SamplingParams::default()).is_ok());
        let field = |s: SamplingParams| match validate_sampling(&s) {
            Err(EngineError::InvalidArgument { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let d = SamplingParams::default();
        assert_eq!(
            field(SamplingParams {
                temperature: -1.0,
                ..d
            }),
            "temperature"
        );
        assert_eq!(field(SamplingParams { top_p: 1.5, ..d }), "top_p");
        assert_eq!(field(SamplingParams { min_p: -0.1, ..d }), "min_p");
        assert_eq!(
            field(SamplingParams {
                repetition_penalty: 0.0,
                ..d
            }),
            "repetition_penalty"
        );
        assert_eq!(
            field(SamplingParams {
                frequency_penalty: f32::INFINITY,
                ..d
            }),
            "frequency_penalty"
        );
        assert_eq!(
            field(SamplingParams {
                top_logprobs: MAX_TOP_LOGPROBS + 1,
                ..d
            }),
            "top_logprobs"
        );
    }

    #[test]
    fn derived_seeds_are_stable_and_nonzero() {
        assert_eq!(seed_for_request_id("abc"), seed_for_request_id("abc"));
        assert_ne!(seed_for_request_id("abc"), seed_for_request_id("abd"));
        assert_ne!(seed_for_request_id(""), 0);
    }
}
