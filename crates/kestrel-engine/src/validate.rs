//! The one place a request's rules live: raw [`GenerateRequest`] in,
//! [`ValidRequest`] out, or an [`EngineError`] naming the [`Field`] at fault.
//!
//! Every edge (the gRPC service, the OpenAI HTTP API, the CLI, Rust callers)
//! maps its wire shape onto `GenerateRequest` and calls the engine; none of
//! them checks a range itself. Cheap checks run first; the expensive ones
//! (tokenizing, rendering the chat template, compiling a constraint and
//! computing its first mask) run last and only on input that passed the
//! cheap ones, with the prompt's size capped before it is tokenized.

use std::fmt;

use kestrel_pipeline::{Capabilities, LogitBias, NgramSpec, SamplingParams};
use kestrel_skills::{Skill, SkillOptions, SkillSpec};

use crate::error::EngineError;
use crate::model::ModelContext;
use crate::request::{
    Constraint, GenerateRequest, Prompt, SamplingOptions, Speculation, MAX_DRAFT,
};

/// `max_new_tokens` when a request leaves it unset (capped by the room the
/// prompt leaves in the context).
pub const DEFAULT_MAX_NEW_TOKENS: u32 = 256;
/// Most stop sequences per request.
pub const MAX_STOP_SEQUENCES: usize = 16;
/// Longest stop sequence, in bytes.
pub const MAX_STOP_BYTES: usize = 256;
/// Most stop token ids per request.
pub const MAX_STOP_TOKEN_IDS: usize = 64;
/// Longest caller-chosen request id, in bytes (printable ASCII, no spaces).
pub const MAX_REQUEST_ID_BYTES: usize = 128;
/// Most chat messages per request.
pub const MAX_CHAT_MESSAGES: usize = 1024;
/// Most options in a choice constraint.
pub const MAX_CHOICES: usize = 1024;
/// Most alternatives a request may ask for per token.
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Most `logit_bias` entries per request.
pub const MAX_LOGIT_BIAS: usize = 1024;
/// `logit_bias` value range, inclusive (OpenAI's).
pub const LOGIT_BIAS_RANGE: (f32, f32) = (-100.0, 100.0);
/// Temperature range, inclusive.
pub const TEMPERATURE_RANGE: (f32, f32) = (0.0, 100.0);
/// Largest repetition penalty (the range is `(0, MAX]`).
pub const MAX_REPETITION_PENALTY: f32 = 10.0;
/// Frequency and presence penalty range, inclusive (OpenAI's and vLLM's).
pub const PENALTY_RANGE: (f32, f32) = (-2.0, 2.0);
/// Chat roles a message may have.
pub const CHAT_ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];
/// Largest prompt in bytes, whatever the context: a request this large is
/// refused before it is tokenized.
pub const MAX_PROMPT_BYTES: usize = 8 << 20;
/// Most samples per request (`n`).
pub const MAX_N: u32 = 16;

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
            Field::Config(name) => f.write_str(name),
        }
    }
}

/// A request after [`validate`]: every rule checked, defaults resolved, the
/// prompt tokenized and a skill (with its compiled constraint) built per
/// sample.
pub(crate) struct ValidRequest {
    pub request_id: String,
    /// Sample `i`'s pipeline id is `pipeline_id + i`.
    pub pipeline_id: u64,
    pub prompt: Vec<u32>,
    pub max_new_tokens: u32,
    /// Sample 0's; sample `i` samples with [`ValidRequest::sampling_of`].
    pub sampling: SamplingParams,
    /// Alternatives per prompt position when the prompt is scored.
    pub prompt_logprobs: Option<u32>,
    pub speculate: Option<NgramSpec>,
    /// One per sample (`n` of them), each with its own constraint state.
    pub skills: Vec<Skill>,
}

impl ValidRequest {
    /// The sampling parameters of sample `index`: the request's, with the
    /// sample's seed.
    pub fn sampling_of(&self, index: u32) -> SamplingParams {
        SamplingParams {
            seed: sample_seed(self.sampling.seed, index),
            ..self.sampling.clone()
        }
    }
}

/// The one place a sample's seed is derived: sample `index` of a request
/// whose seed is `seed` (given, or derived from its request id) samples
/// with `seed + index` (wrapping), the derivation the OpenAI edge used when
/// it submitted each sample as a request of its own, so seeded outputs are
/// what they were. Sample 0 keeps the request's seed.
pub fn sample_seed(seed: u64, index: u32) -> u64 {
    seed.wrapping_add(u64::from(index))
}

/// What [`validate`] checks against besides the request.
pub(crate) struct Limits<'a> {
    pub model: &'a ModelContext,
    /// The context a sequence may fill (prompt + output).
    pub max_seq_len: usize,
    /// What the runtime can do (logit bias, drafts, ...).
    pub caps: Capabilities,
    /// Whether the backend scores prompts (`prompt_logprobs`).
    pub prompt_logprobs: bool,
    /// The engine's default speculation.
    pub speculate: Option<NgramSpec>,
}

type Result<T> = std::result::Result<T, EngineError>;

fn bad<T>(field: Field, message: impl Into<String>) -> Result<T> {
    Err(EngineError::invalid(field, message))
}

/// Checks every rule and builds the submission; `pipeline_id` names the
/// request's first sample inside the engine (and its `req-<n>` id when none
/// was given), the others take the ids after it.
pub(crate) fn validate(
    req: GenerateRequest,
    limits: &Limits<'_>,
    pipeline_id: u64,
) -> Result<ValidRequest> {
    // Cheap checks first: nothing is tokenized or compiled for a request
    // that fails one of them.
    let request_id = match req.request_id {
        None => format!("req-{pipeline_id}"),
        Some(id) => request_id(id)?,
    };
    let n = samples(req.n)?;
    let mut sampling = sampling(&req.sampling, &request_id)?;
    sampling.logit_bias = logit_bias(
        &req.sampling.logit_bias,
        limits.model.vocab_size(),
        limits.caps.logit_bias,
    )?;
    let prompt_logprobs = req
        .sampling
        .prompt_logprobs
        .map(|k| prompt_logprobs(k, limits.prompt_logprobs))
        .transpose()?;
    // 0 only scores a prompt: nothing is generated.
    let score_only = req.max_new_tokens == Some(0);
    if score_only && prompt_logprobs.is_none() {
        return bad(
            Field::MaxNewTokens,
            "must be at least 1, got 0 (0 is allowed with prompt_logprobs: only the prompt is scored)",
        );
    }
    let speculate = speculation(req.speculate, limits)?;
    check_prompt_shape(&req.input)?;
    check_prompt_size(&req.input, limits)?;
    let vocab = limits.model.vocab_size();
    let stop = stop_sequences(req.stop)?;
    let stop_token_ids = stop_token_ids(req.stop_token_ids, vocab)?;
    let constraint = req.constraint.map(check_constraint).transpose()?;
    if constraint.is_some() && (!stop.is_empty() || !stop_token_ids.is_empty() || req.ignore_eos) {
        return bad(
            Field::Constraint,
            "cannot be combined with stop, stop_token_ids or ignore_eos",
        );
    }
    if constraint.is_some() && req.min_tokens > 0 {
        // The constraint alone decides where its output ends.
        return bad(Field::MinTokens, "cannot be combined with a constraint");
    }
    if let Some(max) = req.max_new_tokens.filter(|&m| req.min_tokens > m) {
        return bad(
            Field::MinTokens,
            format!(
                "must be at most max_new_tokens ({max}), got {}",
                req.min_tokens
            ),
        );
    }

    // The expensive part: render and tokenize, then the context check.
    let prompt = limits.model.encode_prompt(&req.input)?;
    if prompt.is_empty() {
        let field = match req.input {
            Prompt::Text(_) | Prompt::Tokens(_) => Field::Prompt,
            Prompt::Chat { .. } => Field::Messages,
        };
        return bad(field, "renders to no tokens");
    }
    let room = limits.max_seq_len.saturating_sub(prompt.len());
    let max_new_tokens = match req.max_new_tokens {
        Some(n) => n,
        None => DEFAULT_MAX_NEW_TOKENS.min(u32::try_from(room).unwrap_or(u32::MAX)),
    };
    if (max_new_tokens == 0 && !score_only)
        || prompt.len() + max_new_tokens as usize > limits.max_seq_len
    {
        return Err(EngineError::ContextOverflow {
            prompt_tokens: prompt.len(),
            max_new_tokens: max_new_tokens.max(1) as usize,
            limit: limits.max_seq_len,
        });
    }
    if req.min_tokens > max_new_tokens {
        // Only an unset max_new_tokens gets here: its default is smaller.
        return bad(
            Field::MinTokens,
            format!(
                "must be at most the default max_new_tokens ({max_new_tokens}, what the context leaves), got {}",
                req.min_tokens
            ),
        );
    }

    let spec = match constraint {
        None => SkillSpec::Text {
            stop,
            stop_token_ids,
            ignore_eos: req.ignore_eos,
            min_tokens: req.min_tokens,
        },
        Some(Constraint::JsonSchema(schema)) => SkillSpec::Json { schema },
        Some(Constraint::Regex(r)) => SkillSpec::Regex(r),
        Some(Constraint::Choice(c)) => SkillSpec::Choice(c),
        Some(Constraint::Grammar(g)) => SkillSpec::Grammar(g),
    };
    let options = SkillOptions {
        logprobs: sampling.logprobs,
        top_logprobs: sampling.top_logprobs as usize,
    };
    let constraint_field = constraint_field(&spec);
    // A skill holds its sample's constraint state: one each, compiled from
    // the same spec (a constraint that fails, fails on the first).
    let skills = (0..n)
        .map(|_| {
            Skill::new(limits.model.skills(), &spec, options).map_err(|source| {
                EngineError::InvalidConstraint {
                    field: constraint_field,
                    source,
                }
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ValidRequest {
        request_id,
        pipeline_id,
        prompt,
        max_new_tokens,
        sampling,
        prompt_logprobs,
        speculate,
        skills,
    })
}

/// `n`: 1 to [`MAX_N`] samples, 1 when not given.
pub(crate) fn samples(n: Option<u32>) -> Result<u32> {
    match n.unwrap_or(1) {
        n @ 1..=MAX_N => Ok(n),
        n => bad(Field::N, format!("must be in [1, {MAX_N}], got {n}")),
    }
}

/// `prompt_logprobs`: the range of `top_logprobs`, on a backend that scores prompts.
fn prompt_logprobs(top: u32, supported: bool) -> Result<u32> {
    if top > MAX_TOP_LOGPROBS {
        return bad(
            Field::PromptLogprobs,
            format!("must be in [0, {MAX_TOP_LOGPROBS}], got {top}"),
        );
    }
    if !supported {
        return bad(
            Field::PromptLogprobs,
            "is not supported by this backend (no prompt scoring yet)",
        );
    }
    Ok(top)
}

/// The request's speculation, the engine's default resolved.
fn speculation(s: Speculation, limits: &Limits<'_>) -> Result<Option<NgramSpec>> {
    match s {
        Speculation::Default => Ok(limits.speculate),
        Speculation::Off => Ok(None),
        Speculation::Ngram { max_draft } => ngram_spec(max_draft, &limits.caps)
            .map(Some)
            .map_err(|m| EngineError::invalid(Field::Speculate, m)),
    }
}

/// The one rule for prompt-lookup speculation, a request's or the engine's
/// default: 1 to [`MAX_DRAFT`] drafts per step, on a backend that verifies
/// drafts (`drafts`). The message says what was wrong.
pub(crate) fn ngram_spec(
    max_draft: u32,
    caps: &Capabilities,
) -> std::result::Result<NgramSpec, String> {
    if !(1..=MAX_DRAFT).contains(&max_draft) {
        return Err(format!(
            "ngram drafts must be 1 to {MAX_DRAFT} per step, got {max_draft}"
        ));
    }
    if !caps.drafts() {
        return Err("this backend does not verify drafts (no speculative decoding yet)".into());
    }
    Ok(NgramSpec::new(max_draft as usize))
}

fn constraint_field(spec: &SkillSpec) -> Field {
    match spec {
        SkillSpec::Text { .. } => Field::Constraint,
        SkillSpec::Json { .. } => Field::JsonSchema,
        SkillSpec::Regex(_) => Field::Regex,
        SkillSpec::Choice(_) => Field::Choices,
        SkillSpec::Grammar(_) => Field::Grammar,
    }
}

fn request_id(id: String) -> Result<String> {
    if id.is_empty() || id.len() > MAX_REQUEST_ID_BYTES || !id.bytes().all(|b| b.is_ascii_graphic())
    {
        return bad(
            Field::RequestId,
            format!(
                "must be 1 to {MAX_REQUEST_ID_BYTES} bytes of printable ASCII without spaces, got {id:?}"
            ),
        );
    }
    Ok(id)
}

/// `value` if it lies in the range, else an error naming the field and
/// range. NaN lies in no range.
fn check_range(field: Field, value: f32, (lo, hi): (f32, f32), low_open: bool) -> Result<f32> {
    let low_ok = if low_open { value > lo } else { value >= lo };
    if low_ok && value <= hi {
        Ok(value)
    } else {
        let open = if low_open { '(' } else { '[' };
        bad(field, format!("must be in {open}{lo}, {hi}], got {value}"))
    }
}

/// Resolves sampling options against the defaults. An explicit seed is
/// honoured whatever its value; without one the seed derives from the
/// request id, so a retried id reproduces its output.
/// (`logit_bias`, which needs the vocabulary, is [`logit_bias`]'s.)
fn sampling(s: &SamplingOptions, request_id: &str) -> Result<SamplingParams> {
    let d = SamplingParams::default();
    let opt = |v: Option<f32>, field, range, low_open, default| {
        v.map_or(Ok(default), |v| check_range(field, v, range, low_open))
    };
    if s.top_logprobs > MAX_TOP_LOGPROBS {
        return bad(
            Field::TopLogprobs,
            format!("must be in [0, {MAX_TOP_LOGPROBS}], got {}", s.top_logprobs),
        );
    }
    Ok(SamplingParams {
        temperature: opt(
            s.temperature,
            Field::Temperature,
            TEMPERATURE_RANGE,
            false,
            d.temperature,
        )?,
        // Any value is meaningful: 0 disables, >= vocab is the same as 0.
        top_k: s.top_k.unwrap_or(d.top_k),
        top_p: opt(s.top_p, Field::TopP, (0.0, 1.0), true, d.top_p)?,
        min_p: opt(s.min_p, Field::MinP, (0.0, 1.0), false, d.min_p)?,
        repetition_penalty: opt(
            s.repetition_penalty,
            Field::RepetitionPenalty,
            (0.0, MAX_REPETITION_PENALTY),
            true,
            d.repetition_penalty,
        )?,
        frequency_penalty: opt(
            s.frequency_penalty,
            Field::FrequencyPenalty,
            PENALTY_RANGE,
            false,
            d.frequency_penalty,
        )?,
        presence_penalty: opt(
            s.presence_penalty,
            Field::PresencePenalty,
            PENALTY_RANGE,
            false,
            d.presence_penalty,
        )?,
        seed: s.seed.unwrap_or_else(|| seed_for_request_id(request_id)),
        top_logprobs: s.top_logprobs,
        logprobs: s.logprobs || s.top_logprobs > 0,
        logit_bias: LogitBias::default(),
    })
}

/// Checks the biases against the vocabulary and what the backend supports.
fn logit_bias(entries: &[(u32, f32)], vocab: usize, supported: bool) -> Result<LogitBias> {
    if entries.is_empty() {
        return Ok(LogitBias::default());
    }
    if !supported {
        return bad(
            Field::LogitBias,
            "is not supported by this backend's sampler",
        );
    }
    if entries.len() > MAX_LOGIT_BIAS {
        return bad(
            Field::LogitBias,
            format!("at most {MAX_LOGIT_BIAS} entries, got {}", entries.len()),
        );
    }
    for &(t, b) in entries {
        if t as usize >= vocab {
            return bad(
                Field::LogitBiasToken(t),
                format!("token id {t} is outside the vocabulary (size {vocab})"),
            );
        }
        check_range(Field::LogitBiasToken(t), b, LOGIT_BIAS_RANGE, false)?;
    }
    Ok(LogitBias::new(entries.iter().copied()))
}

/// The seed used when a request gives none: FNV-1a of the request id.
pub fn seed_for_request_id(request_id: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in request_id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn check_prompt_shape(input: &Prompt) -> Result<()> {
    match input {
        Prompt::Text(text) if text.is_empty() => bad(Field::Prompt, "must not be empty"),
        Prompt::Text(_) => Ok(()),
        Prompt::Tokens(ids) if ids.is_empty() => bad(Field::Prompt, "must not be empty"),
        Prompt::Tokens(_) => Ok(()),
        Prompt::Chat { messages, .. } => {
            if messages.is_empty() {
                return bad(Field::Messages, "must not be empty");
            }
            if messages.len() > MAX_CHAT_MESSAGES {
                return bad(
                    Field::Messages,
                    format!(
                        "must have at most {MAX_CHAT_MESSAGES} entries, got {}",
                        messages.len()
                    ),
                );
            }
            for (i, m) in messages.iter().enumerate() {
                if !CHAT_ROLES.contains(&m.role.as_str()) {
                    return bad(
                        Field::MessageRole(i),
                        format!("must be one of {}, got {:?}", CHAT_ROLES.join(", "), m.role),
                    );
                }
            }
            Ok(())
        }
    }
}

/// Refuses, before tokenizing, a prompt too large to fit the context
/// whatever it tokenizes to: every token covers at most
/// `max_token_bytes` bytes, so more bytes than `context x max_token_bytes`
/// is more tokens than the context holds. Token ids need no tokenizing:
/// their count is checked against the context with the output budget.
fn check_prompt_size(input: &Prompt, limits: &Limits<'_>) -> Result<()> {
    let (field, bytes) = match input {
        Prompt::Text(text) => (Field::Prompt, text.len()),
        Prompt::Tokens(_) => return Ok(()),
        // Calls and tools are rendered too; their JSON length bounds
        // their share of the prompt.
        Prompt::Chat { messages, tools } => (
            Field::Messages,
            messages
                .iter()
                .map(|m| {
                    m.content.len()
                        + m.tool_calls
                            .iter()
                            .map(|c| c.name.len() + c.arguments.to_string().len())
                            .sum::<usize>()
                })
                .sum::<usize>()
                + tools.iter().map(|t| t.to_string().len()).sum::<usize>(),
        ),
    };
    let fits = limits
        .max_seq_len
        .saturating_mul(limits.model.max_token_bytes().max(1))
        .min(MAX_PROMPT_BYTES);
    if bytes > fits {
        return bad(
            field,
            format!(
                "is {bytes} bytes, more than a context of {} tokens can hold (at most {fits} bytes)",
                limits.max_seq_len
            ),
        );
    }
    Ok(())
}

fn stop_sequences(stop: Vec<String>) -> Result<Vec<String>> {
    if stop.len() > MAX_STOP_SEQUENCES {
        return bad(
            Field::Stop,
            format!(
                "must have at most {MAX_STOP_SEQUENCES} entries, got {}",
                stop.len()
            ),
        );
    }
    for (i, s) in stop.iter().enumerate() {
        if s.is_empty() || s.len() > MAX_STOP_BYTES {
            return bad(
                Field::StopEntry(i),
                format!("must be 1 to {MAX_STOP_BYTES} bytes long, got {}", s.len()),
            );
        }
    }
    Ok(stop)
}

fn stop_token_ids(ids: Vec<u32>, vocab_size: usize) -> Result<Vec<u32>> {
    if ids.len() > MAX_STOP_TOKEN_IDS {
        return bad(
            Field::StopTokenIds,
            format!(
                "must have at most {MAX_STOP_TOKEN_IDS} entries, got {}",
                ids.len()
            ),
        );
    }
    token_ids_in_vocab(&ids, vocab_size, Field::StopTokenId)?;
    Ok(ids)
}

/// Checks that every id is below the vocabulary size; `field(i)` names the
/// offending entry.
pub(crate) fn token_ids_in_vocab(
    ids: &[u32],
    vocab_size: usize,
    field: impl Fn(usize) -> Field,
) -> Result<()> {
    match ids.iter().position(|&id| id as usize >= vocab_size) {
        None => Ok(()),
        Some(i) => bad(
            field(i),
            format!("must be in [0, {vocab_size}), got {}", ids[i]),
        ),
    }
}

fn check_constraint(c: Constraint) -> Result<Constraint> {
    match &c {
        Constraint::JsonSchema(schema) if !(schema.is_object() || schema.is_boolean()) => bad(
            Field::JsonSchema,
            "must be a JSON object or boolean (a JSON Schema)",
        ),
        Constraint::Regex(re) if re.is_empty() => bad(Field::Regex, "must not be empty"),
        Constraint::Grammar(g) if g.trim().is_empty() => bad(Field::Grammar, "must not be empty"),
        Constraint::Choice(list) => {
            if list.is_empty() {
                return bad(Field::Choices, "must not be empty");
            }
            if list.len() > MAX_CHOICES {
                return bad(
                    Field::Choices,
                    format!(
                        "must have at most {MAX_CHOICES} entries, got {}",
                        list.len()
                    ),
                );
            }
            if let Some(i) = list.iter().position(String::is_empty) {
                return bad(Field::Choice(i), "must not be empty");
            }
            Ok(c)
        }
        _ => Ok(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of<T: std::fmt::Debug>(r: Result<T>) -> (Field, String) {
        match r {
            Err(EngineError::InvalidArgument { field, message }) => (field, message),
            other => panic!("expected an argument error, got {other:?}"),
        }
    }

    /// Sets one option on the defaults; `good` values pass, `bad` ones
    /// fail naming `field` and the range.
    fn float_rule(
        field: Field,
        set: fn(&mut SamplingOptions, f32),
        good: &[f32],
        bad: &[f32],
        range: &str,
    ) {
        for &v in good {
            let mut s = SamplingOptions::default();
            set(&mut s, v);
            sampling(&s, "r").unwrap_or_else(|e| panic!("{field}={v}: {e}"));
        }
        for &v in bad {
            let mut s = SamplingOptions::default();
            set(&mut s, v);
            let (f, msg) = field_of(sampling(&s, "r"));
            assert_eq!(f, field);
            assert_eq!(msg, format!("must be in {range}, got {v}"));
        }
    }

    /// `top_logprobs`'s range, and a typed refusal on a backend that
    /// does not score prompts (CUDA).
    #[test]
    fn prompt_logprobs_rules() {
        assert_eq!(prompt_logprobs(0, true).unwrap(), 0);
        assert_eq!(prompt_logprobs(20, true).unwrap(), 20);
        let (f, msg) = field_of(prompt_logprobs(21, true));
        assert_eq!(
            (f, msg.as_str()),
            (Field::PromptLogprobs, "must be in [0, 20], got 21")
        );
        let (f, msg) = field_of(prompt_logprobs(1, false));
        assert_eq!(f, Field::PromptLogprobs);
        assert!(msg.contains("not supported by this backend"), "{msg}");
        assert_eq!(Field::PromptLogprobs.to_string(), "prompt_logprobs");
    }

    #[test]
    fn logit_bias_rules() {
        let ok = logit_bias(&[(5, 100.0), (1, -100.0), (5, 2.0)], 10, true).unwrap();
        assert_eq!(ok.entries(), &[(1, -100.0), (5, 2.0)]);
        assert!(logit_bias(&[], 10, false).unwrap().is_empty());
        // (token, bias, backend supports it, field blamed, message part)
        let cases = [
            (1, 1.0, false, Field::LogitBias, "is not supported"),
            (
                10,
                1.0,
                true,
                Field::LogitBiasToken(10),
                "outside the vocabulary",
            ),
            (3, 100.5, true, Field::LogitBiasToken(3), "[-100, 100]"),
            (3, f32::NAN, true, Field::LogitBiasToken(3), "got NaN"),
            (
                3,
                -f32::INFINITY,
                true,
                Field::LogitBiasToken(3),
                "got -inf",
            ),
        ];
        for (token, bias, supported, field, needle) in cases {
            let (f, msg) = field_of(logit_bias(&[(token, bias)], 10, supported));
            assert_eq!(f, field);
            assert!(msg.contains(needle), "{msg}");
        }
        let many: Vec<(u32, f32)> = (0..=MAX_LOGIT_BIAS as u32).map(|t| (t, 1.0)).collect();
        assert_eq!(
            field_of(logit_bias(&many, 1 << 20, true)).0,
            Field::LogitBias
        );
        assert_eq!(Field::LogitBiasToken(7).to_string(), "logit_bias[7]");
    }

    #[test]
    fn sampling_ranges() {
        float_rule(
            Field::Temperature,
            |s, v| s.temperature = Some(v),
            &[0.0, 0.5, 100.0],
            &[-1.0, 100.5, f32::NAN, f32::INFINITY],
            "[0, 100]",
        );
        float_rule(
            Field::TopP,
            |s, v| s.top_p = Some(v),
            &[0.01, 1.0],
            &[0.0, -0.1, 1.01, f32::NAN],
            "(0, 1]",
        );
        float_rule(
            Field::MinP,
            |s, v| s.min_p = Some(v),
            &[0.0, 1.0],
            &[-0.01, 1.5, f32::NAN],
            "[0, 1]",
        );
        float_rule(
            Field::RepetitionPenalty,
            |s, v| s.repetition_penalty = Some(v),
            &[0.5, 1.0, 10.0],
            &[0.0, -1.0, 10.5, f32::NAN],
            "(0, 10]",
        );
        float_rule(
            Field::FrequencyPenalty,
            |s, v| s.frequency_penalty = Some(v),
            &[-2.0, 0.0, 2.0],
            &[-2.5, 2.5, f32::NAN],
            "[-2, 2]",
        );
        float_rule(
            Field::PresencePenalty,
            |s, v| s.presence_penalty = Some(v),
            &[-2.0, 0.0, 2.0],
            &[-2.5, 2.5, f32::NEG_INFINITY],
            "[-2, 2]",
        );
    }

    #[test]
    fn top_logprobs_at_most_20_and_imply_logprobs() {
        let s = SamplingOptions {
            top_logprobs: 20,
            ..Default::default()
        };
        let p = sampling(&s, "r").unwrap();
        assert!(p.logprobs && p.top_logprobs == 20);
        let s = SamplingOptions {
            top_logprobs: 21,
            ..Default::default()
        };
        assert_eq!(
            field_of(sampling(&s, "r")),
            (Field::TopLogprobs, "must be in [0, 20], got 21".into())
        );
    }

    #[test]
    fn an_explicit_seed_is_honoured_whatever_its_value() {
        for seed in [0, 1, u64::MAX] {
            let s = SamplingOptions {
                seed: Some(seed),
                ..Default::default()
            };
            assert_eq!(sampling(&s, "any-id").unwrap().seed, seed);
        }
        let derived = sampling(&SamplingOptions::default(), "abc").unwrap().seed;
        assert_eq!(derived, seed_for_request_id("abc"));
        assert_ne!(seed_for_request_id("abc"), seed_for_request_id("abd"));
        let s = SamplingOptions {
            top_k: Some(u32::MAX),
            ..Default::default()
        };
        assert_eq!(sampling(&s, "r").unwrap().top_k, u32::MAX);
    }

    #[test]
    fn request_ids_are_short_printable_ascii() {
        assert_eq!(request_id("my-req_1".into()).unwrap(), "my-req_1");
        assert!(request_id("x".repeat(128)).is_ok());
        for bad in ["", "has space", "tab\t", "é", &"x".repeat(129)] {
            let (f, msg) = field_of(request_id(bad.into()));
            assert_eq!(f, Field::RequestId);
            assert!(msg.contains("printable ASCII"), "{msg}");
        }
    }

    #[test]
    fn stop_lists_are_bounded() {
        assert_eq!(
            field_of(stop_sequences(vec!["a".into(), String::new()])),
            (
                Field::StopEntry(1),
                "must be 1 to 256 bytes long, got 0".into()
            )
        );
        assert_eq!(
            field_of(stop_sequences(vec!["x".repeat(257)])).0,
            Field::StopEntry(0)
        );
        assert_eq!(
            field_of(stop_sequences(vec!["s".into(); 17])),
            (Field::Stop, "must have at most 16 entries, got 17".into())
        );
        assert_eq!(
            field_of(stop_token_ids(vec![1, 49152], 49152)),
            (
                Field::StopTokenId(1),
                "must be in [0, 49152), got 49152".into()
            )
        );
        assert_eq!(
            field_of(stop_token_ids(vec![1; 65], 49152)).0,
            Field::StopTokenIds
        );
    }

    #[test]
    fn prompt_shapes() {
        use crate::request::ChatMessage;
        assert_eq!(
            field_of(check_prompt_shape(&Prompt::Text(String::new()))).0,
            Field::Prompt
        );
        assert_eq!(
            field_of(check_prompt_shape(&Prompt::chat(vec![]))).0,
            Field::Messages
        );
        let (f, msg) = field_of(check_prompt_shape(&Prompt::chat(vec![
            ChatMessage::user("hi"),
            ChatMessage::new("wizard", "x"),
        ])));
        assert_eq!(f, Field::MessageRole(1));
        assert_eq!(
            msg,
            "must be one of system, user, assistant, tool, got \"wizard\""
        );
        let many = vec![ChatMessage::user("x"); MAX_CHAT_MESSAGES + 1];
        assert_eq!(
            field_of(check_prompt_shape(&Prompt::chat(many))),
            (
                Field::Messages,
                "must have at most 1024 entries, got 1025".into()
            )
        );
    }

    #[test]
    fn constraint_shapes() {
        assert!(check_constraint(Constraint::JsonSchema(serde_json::json!(true))).is_ok());
        assert_eq!(
            field_of(check_constraint(Constraint::JsonSchema(serde_json::json!(
                [1]
            ))))
            .0,
            Field::JsonSchema
        );
        assert_eq!(
            field_of(check_constraint(Constraint::Regex(String::new()))).0,
            Field::Regex
        );
        assert_eq!(
            field_of(check_constraint(Constraint::Grammar(" \n".into()))).0,
            Field::Grammar
        );
        assert_eq!(
            field_of(check_constraint(Constraint::Choice(vec![]))).0,
            Field::Choices
        );
        assert_eq!(
            field_of(check_constraint(Constraint::Choice(vec![
                "a".into(),
                String::new()
            ])))
            .0,
            Field::Choice(1)
        );
    }
}
