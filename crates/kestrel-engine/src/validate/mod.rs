//! The one place a request's rules live: raw [`GenerateRequest`] in,
//! [`ValidRequest`] out, or an [`EngineError`] naming the [`Field`] at fault.
//!
//! Every edge (the gRPC service, the OpenAI HTTP API, the CLI, Rust callers)
//! maps its wire shape onto `GenerateRequest` and calls the engine; none of
//! them checks a range itself. Cheap checks run first; the expensive ones
//! (tokenizing, rendering the chat template, compiling a constraint and
//! computing its first mask) run last and only on input that passed the
//! cheap ones, with the prompt's size capped before it is tokenized.
//!
//! This file holds the limits, the validated request and `validate` itself;
//! `field.rs` the [`Field`] a refusal names, `sampling.rs` the sampling,
//! logit-bias and speculation rules, `prompt.rs` the prompt, stop and
//! constraint rules, `vision.rs` a vision request's question or object,
//! `max_objects`, and whether the model takes images and has the skill.

mod field;
mod prompt;
mod sampling;
#[cfg(test)]
mod tests;
mod vision;

use kestrel_pipeline::{Capabilities, NgramSpec, SamplingParams};
use kestrel_skills::{Skill, SkillOptions, SkillSpec, SpatialSkill};

use crate::error::EngineError;
use crate::model::ModelContext;
use crate::request::{Constraint, GenerateRequest, Prompt};
use crate::skill::RequestSkill;

pub use field::Field;
pub(crate) use prompt::token_ids_in_vocab;
use prompt::{
    check_constraint, check_prompt_shape, check_prompt_size, stop_sequences, stop_token_ids,
};
pub(crate) use sampling::ngram_spec;
pub use sampling::seed_for_request_id;
use sampling::{logit_bias, prompt_logprobs, sampling, speculation};
pub(crate) use vision::no_vision;

/// `max_new_tokens` when a request leaves it unset (capped by the room the
/// prompt leaves in the context).
pub const DEFAULT_MAX_NEW_TOKENS: u32 = 256;
/// `max_new_tokens` of a vision request that leaves it unset (the
/// Moondream skills' default, also capped by the room in the context).
pub const DEFAULT_VISION_MAX_NEW_TOKENS: u32 = 768;
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
/// `max_objects` of a point/detect request that leaves it unset (the seed
/// system's default).
pub const DEFAULT_MAX_OBJECTS: u32 = 50;
/// Most objects a point/detect request may ask for: the objects a detect
/// request's default budget of [`DEFAULT_VISION_MAX_NEW_TOKENS`] tokens
/// holds (x, y and size: three tokens each).
pub const MAX_OBJECTS: u32 = DEFAULT_VISION_MAX_NEW_TOKENS / 3;

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
    /// One per sample (`n` of them), each with its own constraint (or
    /// point/detect) state.
    pub skills: Vec<RequestSkill>,
    /// A vision request's image rows (`None` for text).
    pub embeds: Option<kestrel_pipeline::PromptEmbeds>,
    /// The field the skills' constraint came from ([`Field::Constraint`]
    /// for plain text): a constraint failing mid-generation names it.
    pub constraint_field: Field,
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
    mut req: GenerateRequest,
    limits: &Limits<'_>,
    pipeline_id: u64,
) -> Result<ValidRequest> {
    // Cheap checks first: nothing is tokenized or compiled for a request
    // that fails one of them.
    let request_id = match req.request_id.take() {
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
    let mut spatial = None;
    if let Prompt::Vision { task, .. } = &req.input {
        vision::check_task(task)?;
        vision::check_model(limits.model, task)?;
        if task.is_spatial() {
            vision::check_spatial_request(&req)?;
            spatial = vision::spatial_spec(limits.model, task)?;
        }
    }
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

    // The expensive part: render and tokenize (or decode the image), then
    // the context check.
    let (prompt, embeds) = match &req.input {
        Prompt::Vision { image, task } => {
            let v = vision::prepare(limits.model, image, task)?;
            (v.prompt, Some(v.embeds))
        }
        _ => (limits.model.encode_prompt(&req.input)?, None),
    };
    if embeds.is_some() && prompt_logprobs.is_some() {
        // An image's rows are no tokens to score.
        return bad(Field::PromptLogprobs, "cannot be asked of a vision request");
    }
    // Prompt lookup would draft an image's ids (past the vocabulary).
    let speculate = speculate.filter(|_| embeds.is_none());
    if prompt.is_empty() {
        let field = match req.input {
            Prompt::Text(_) | Prompt::Tokens(_) => Field::Prompt,
            Prompt::Chat { .. } => Field::Messages,
            Prompt::Vision { .. } => Field::Image,
        };
        return bad(field, "renders to no tokens");
    }
    let room = limits.max_seq_len.saturating_sub(prompt.len());
    let max_new_tokens = match req.max_new_tokens {
        Some(n) => n,
        None => {
            let default = match req.input {
                Prompt::Vision { .. } => DEFAULT_VISION_MAX_NEW_TOKENS,
                _ => DEFAULT_MAX_NEW_TOKENS,
            };
            default.min(u32::try_from(room).unwrap_or(u32::MAX))
        }
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
    // A skill holds its sample's constraint (or point/detect) state: one
    // each, compiled from the same spec (a constraint that fails, fails on
    // the first).
    let skills = (0..n)
        .map(|_| match spatial {
            Some(spec) => Ok(RequestSkill::Spatial(SpatialSkill::new(spec))),
            None => Skill::new(limits.model.skills(), &spec, options)
                .map(RequestSkill::Text)
                .map_err(|source| EngineError::InvalidConstraint {
                    field: constraint_field,
                    source,
                }),
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
        embeds,
        constraint_field,
    })
}

/// `n`: 1 to [`MAX_N`] samples, 1 when not given.
pub(crate) fn samples(n: Option<u32>) -> Result<u32> {
    match n.unwrap_or(1) {
        n @ 1..=MAX_N => Ok(n),
        n => bad(Field::N, format!("must be in [1, {MAX_N}], got {n}")),
    }
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
