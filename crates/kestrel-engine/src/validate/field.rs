//! [`Field`]: a request field as the engine names it, the name every refusal
//! carries and each edge spells back in its own wire format.

use std::fmt;

/// A request field, as the engine names it. Edges map it to their own
/// wire names (`max_new_tokens` is OpenAI's `max_tokens`, `messages` is the
/// proto's `chat.messages`); [`fmt::Display`] gives the engine's own name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Field {
    RequestId,
    /// The text prompt.
    Prompt,
    /// The chat messages as a whole.
    Messages,
    /// The role of chat message `i`.
    MessageRole(usize),
    MaxNewTokens,
    MinTokens,
    Temperature,
    TopP,
    MinP,
    RepetitionPenalty,
    FrequencyPenalty,
    PresencePenalty,
    TopLogprobs,
    PromptLogprobs,
    /// The logit biases as a whole.
    LogitBias,
    /// The bias of token id `t`.
    LogitBiasToken(u32),
    /// The stop sequences as a whole.
    Stop,
    /// Stop sequence `i`.
    StopEntry(usize),
    /// The stop token ids as a whole.
    StopTokenIds,
    /// Stop token id `i`.
    StopTokenId(usize),
    /// The constraint as a whole (e.g. combined with stop conditions).
    Constraint,
    JsonSchema,
    Regex,
    /// The options of a choice constraint as a whole.
    Choices,
    /// Option `i` of a choice constraint.
    Choice(usize),
    Grammar,
    /// Token id `i` given to a detokenize call.
    TokenId(usize),
    /// Text given to tokenize calls.
    Text,
    /// Speculative decoding.
    Speculate,
    /// Samples per request (`n`).
    N,
    /// The image of a vision request (the Moondream API's `image_url`).
    Image,
    /// The question of a vision query.
    Question,
    /// The object a point/detect request looks for.
    Object,
    /// The most objects a point/detect request returns.
    MaxObjects,
    /// The vision skill asked for (`point`, `detect`, a caption length),
    /// when the model has no such skill (no region module, no template).
    Skill,
    /// An engine setting (not a request field).
    Config(&'static str),
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Field::RequestId => f.write_str("request_id"),
            Field::Prompt => f.write_str("prompt"),
            Field::Messages => f.write_str("messages"),
            Field::MessageRole(i) => write!(f, "messages[{i}].role"),
            Field::MaxNewTokens => f.write_str("max_new_tokens"),
            Field::MinTokens => f.write_str("min_tokens"),
            Field::Temperature => f.write_str("temperature"),
            Field::TopP => f.write_str("top_p"),
            Field::MinP => f.write_str("min_p"),
            Field::RepetitionPenalty => f.write_str("repetition_penalty"),
            Field::FrequencyPenalty => f.write_str("frequency_penalty"),
            Field::PresencePenalty => f.write_str("presence_penalty"),
            Field::TopLogprobs => f.write_str("top_logprobs"),
            Field::PromptLogprobs => f.write_str("prompt_logprobs"),
            Field::LogitBias => f.write_str("logit_bias"),
            Field::LogitBiasToken(t) => write!(f, "logit_bias[{t}]"),
            Field::Stop => f.write_str("stop"),
            Field::StopEntry(i) => write!(f, "stop[{i}]"),
            Field::StopTokenIds => f.write_str("stop_token_ids"),
            Field::StopTokenId(i) => write!(f, "stop_token_ids[{i}]"),
            Field::Constraint => f.write_str("constraint"),
            Field::JsonSchema => f.write_str("json_schema"),
            Field::Regex => f.write_str("regex"),
            Field::Choices => f.write_str("choices"),
            Field::Choice(i) => write!(f, "choices[{i}]"),
            Field::Grammar => f.write_str("grammar"),
            Field::TokenId(i) => write!(f, "token_ids[{i}]"),
            Field::Text => f.write_str("text"),
            Field::Speculate => f.write_str("speculate"),
            Field::N => f.write_str("n"),
            Field::Image => f.write_str("image"),
            Field::Question => f.write_str("question"),
            Field::Object => f.write_str("object"),
            Field::MaxObjects => f.write_str("max_objects"),
            Field::Skill => f.write_str("skill"),
            Field::Config(name) => f.write_str(name),
        }
    }
}
