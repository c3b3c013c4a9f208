//! Request and response types of the public API.
//!
//! [`GenerateRequest`] is raw input, as any edge (gRPC, OpenAI HTTP, the
//! CLI, a Rust caller) maps it from its wire shape: `None` means "not
//! given". [`crate::validate`] holds every rule and turns it into a
//! validated submission once, on the caller's thread, so nothing invalid
//! is ever queued and the engine thread never re-validates.

pub use kestrel_model::{ChatMessage, ToolCall};

/// What the model continues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Raw text; BOS is prepended when the model wants one.
    Text(String),
    /// A conversation, rendered with the model's chat template (generation
    /// prompt appended). `tools` (OpenAI's `{"type": "function", ...}`
    /// objects) are given to the template as `tools` when there are any:
    /// only for templates that render them (`ChatTemplate::tool_syntax`).
    Chat {
        messages: Vec<ChatMessage>,
        tools: Vec<serde_json::Value>,
    },
    /// Token ids, used as given (no BOS is added); each must be inside the
    /// vocabulary.
    Tokens(Vec<u32>),
    /// A vision-language request (a Moondream skill) on one image. The
    /// model writes the prompt itself (BOS, the image's rows, the skill's
    /// template); a model without a vision encoder refuses it
    /// ([`crate::Field::Image`]).
    Vision {
        /// The image as sent: encoded JPEG, PNG or WebP bytes (decoded by
        /// the engine's validation, which refuses anything else with
        /// [`crate::EngineError::InvalidImage`]).
        image: Vec<u8>,
        task: VisionTask,
    },
}

/// What a vision request asks of its image (Moondream's skills).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VisionTask {
    /// Answer a question about the image (must not be empty:
    /// [`crate::Field::Question`]).
    Query { question: String },
    /// Describe the image at this length.
    Caption { length: CaptionLength },
    /// One point per instance of `object` (Moondream's `point`); the
    /// response's [`GenerateResponse::objects`] holds the points. `object`
    /// must not be blank ([`crate::Field::Object`]); `max_objects` is 1 to
    /// [`MAX_OBJECTS`](crate::validate::MAX_OBJECTS), `None`:
    /// [`DEFAULT_MAX_OBJECTS`](crate::validate::DEFAULT_MAX_OBJECTS)
    /// ([`crate::Field::MaxObjects`]). Only a model with a region module
    /// takes it ([`crate::Field::Skill`]).
    Point {
        object: String,
        max_objects: Option<u32>,
    },
    /// One box per instance of `object` (Moondream's `detect`); the same
    /// rules as [`VisionTask::Point`].
    Detect {
        object: String,
        max_objects: Option<u32>,
    },
}

impl VisionTask {
    /// The Moondream skill's name (`query`, `caption`, `point`, `detect`).
    pub fn skill_name(&self) -> &'static str {
        match self {
            VisionTask::Query { .. } => "query",
            VisionTask::Caption { .. } => "caption",
            VisionTask::Point { .. } => "point",
            VisionTask::Detect { .. } => "detect",
        }
    }

    /// Whether the task answers with points or boxes rather than text.
    pub fn is_spatial(&self) -> bool {
        matches!(self, VisionTask::Point { .. } | VisionTask::Detect { .. })
    }
}

pub use kestrel_skills::{BoundingBox, Point, SpatialResult};

/// One finished object of a point/detect request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SpatialObject {
    Point(Point),
    Box(BoundingBox),
}

pub use kestrel_model::moondream::{CaptionLength, UnknownCaptionLength};

impl Prompt {
    /// A conversation without tools.
    pub fn chat(messages: Vec<ChatMessage>) -> Self {
        Prompt::Chat {
            messages,
            tools: Vec::new(),
        }
    }
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

/// Sampling knobs as a caller gives them; `None` takes the engine default
/// (greedy, no truncation, no penalties). Ranges are checked by the engine
/// ([`crate::validate`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingOptions {
    /// `[0, 100]`; 0 is greedy.
    pub temperature: Option<f32>,
    /// Any value; 0 (or at least the vocabulary) disables top-k.
    pub top_k: Option<u32>,
    /// `(0, 1]`.
    pub top_p: Option<f32>,
    /// `[0, 1]`.
    pub min_p: Option<f32>,
    /// `(0, 10]`; 1 disables.
    pub repetition_penalty: Option<f32>,
    /// `[-2, 2]`.
    pub frequency_penalty: Option<f32>,
    /// `[-2, 2]`.
    pub presence_penalty: Option<f32>,
    /// Honoured whatever its value; without one the seed derives from the
    /// request id (FNV-1a of its bytes), so a retried id reproduces its output.
    pub seed: Option<u64>,
    /// Report each sampled token's log-probability.
    pub logprobs: bool,
    /// Alternatives per token, `[0, 20]`; more than 0 implies `logprobs`.
    pub top_logprobs: u32,
    /// `(token id, bias)`: the bias, in `[-100, 100]`, is added to that
    /// token's logit before sampling (OpenAI's `logit_bias`; -100 in effect
    /// bans a token). At most 1024 entries, ids inside the vocabulary; a
    /// later entry for the same id wins. Not every backend has it.
    pub logit_bias: Vec<(u32, f32)>,
    /// Score the prompt: the log-probability of each prompt token given the
    /// ones before it, with this many alternatives per position (`[0, 20]`,
    /// as `top_logprobs`); `None`: not scored. Not every backend has it.
    pub prompt_logprobs: Option<u32>,
}

/// One generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    /// Caller-chosen id (1 to 128 bytes of printable ASCII), unique among
    /// live requests; `None` assigns `req-<n>`.
    pub request_id: Option<String>,
    pub input: Prompt,
    /// At least 1 (0 with `sampling.prompt_logprobs`: the prompt is scored,
    /// nothing generated, the finish reason is `Length`);
    /// `prompt + max_new_tokens` must fit the context (rejected
    /// with `ContextOverflow` otherwise, never clamped). `None`: 256 (768
    /// for a [`Prompt::Vision`], the Moondream skills' default), or the
    /// room the prompt leaves in the context if that is less.
    pub max_new_tokens: Option<u32>,
    pub sampling: SamplingOptions,
    /// Stop strings (text requests only); the match is not part of the output.
    pub stop: Vec<String>,
    /// Stop token ids (text requests only).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS (text requests only).
    pub ignore_eos: bool,
    /// No stop condition ends the output before this many tokens (text
    /// requests only; 0 is none, at most `max_new_tokens`): EOS and the
    /// stop token ids are masked from the first `min_tokens` tokens, and a
    /// stop string counts only from the `min_tokens`-th token on (vLLM's
    /// `min_tokens`). `max_new_tokens` and the context still end it.
    pub min_tokens: u32,
    pub constraint: Option<Constraint>,
    /// Speculative decoding; the engine's default unless set.
    pub speculate: Speculation,
    /// Samples of the prompt (OpenAI's `n`), 1 to
    /// [`MAX_N`](crate::validate::MAX_N); `None`: 1. Each sample is a
    /// sequence of its own (its seed, stop checks, constraint state), all
    /// sharing the prompt's KV pages; sample `i` samples with
    /// [`sample_seed`](crate::validate::sample_seed)`(seed, i)`. With greedy
    /// sampling (temperature 0) every sample is the same, as with OpenAI and
    /// vLLM. [`crate::Engine::stream_samples`] gives one stream per sample.
    pub n: Option<u32>,
}

/// Speculative decoding for one request. Outputs are the same with and
/// without it (greedy and seeded sampling alike); it only changes how many
/// tokens a step can commit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Speculation {
    /// The engine's default (`EngineConfig::speculate`).
    #[default]
    Default,
    /// One token per step.
    Off,
    /// Prompt lookup: up to `max_draft` (1 to [`MAX_DRAFT`]) tokens per step
    /// drafted from earlier occurrences of the sequence's last tokens and
    /// verified in one forward; a constraint masks every drafted position.
    Ngram { max_draft: u32 },
}

/// Draft tokens per step a request may ask for at most.
pub const MAX_DRAFT: u32 = 16;

impl GenerateRequest {
    /// A text request with greedy sampling and no stop conditions but EOS.
    pub fn text(prompt: impl Into<String>, max_new_tokens: u32) -> Self {
        Self::new(Prompt::Text(prompt.into()), max_new_tokens)
    }

    /// A chat request with greedy sampling.
    pub fn chat(messages: Vec<ChatMessage>, max_new_tokens: u32) -> Self {
        Self::new(Prompt::chat(messages), max_new_tokens)
    }

    fn new(input: Prompt, max_new_tokens: u32) -> Self {
        Self {
            request_id: None,
            input,
            max_new_tokens: Some(max_new_tokens),
            sampling: SamplingOptions::default(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
            constraint: None,
            speculate: Speculation::Default,
            n: None,
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
    /// The request failed: the partial response of
    /// [`crate::EngineError::ConstraintFailed`] carries it.
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
    /// Prompt tokens whose KV was reused rather than computed: a
    /// prefix-cache hit or, for a sample after the first (`n`), the prompt
    /// pages it shares with the first (0 until the runtime reports it).
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
    /// Which sample of the request this is (`0..n`).
    pub index: u32,
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
    /// One entry per prompt token when `sampling.prompt_logprobs` asked
    /// (empty otherwise): the first token's `logprob` is NaN and its `top`
    /// empty (nothing precedes it); each later one is the token's
    /// log-probability given the prompt before it.
    pub prompt_logprobs: Vec<TokenLogprob>,
    /// A point/detect request's points or boxes, the objects completed
    /// before it ended (`None` for every other request; `text` is then
    /// empty and `token_ids` the coordinate, size and EOS ids).
    pub objects: Option<SpatialResult>,
}

/// One item of a [`crate::GenerationStream`].
// `Done` is larger than the other items, and sent once per request: boxing
// it would cost every caller a deref for nothing measurable.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEvent {
    /// Newly committed output; the concatenated `text`s equal the final text.
    Delta {
        text: String,
        token_ids: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
    },
    /// One point or box of a point/detect request, as soon as its last
    /// value is committed (a point/detect request streams these, never a
    /// `Delta`); in order, the same objects as the final `objects`.
    Object(SpatialObject),
    /// The request finished; always the last item.
    Done(GenerateResponse),
}
