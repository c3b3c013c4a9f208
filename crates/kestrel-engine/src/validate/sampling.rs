//! The sampling rules: each option's range, the seed (given, or derived from the
//! request id), `logit_bias` against the vocabulary and the backend, prompt
//! scoring's `top_logprobs`, and prompt-lookup speculation's one rule.

use kestrel_pipeline::{Capabilities, LogitBias, NgramSpec, SamplingParams};

use super::{bad, Field, Limits, Result};
use super::{
    LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS, PENALTY_RANGE,
    TEMPERATURE_RANGE,
};
use crate::error::EngineError;
use crate::request::{SamplingOptions, Speculation, MAX_DRAFT};

/// `prompt_logprobs`: the range of `top_logprobs`, on a backend that scores prompts.
pub(super) fn prompt_logprobs(top: u32, supported: bool) -> Result<u32> {
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
pub(super) fn speculation(s: Speculation, limits: &Limits<'_>) -> Result<Option<NgramSpec>> {
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

/// `value` if it lies in the range, else an error naming the field and
/// range. NaN lies in no range.
pub(super) fn check_range(
    field: Field,
    value: f32,
    (lo, hi): (f32, f32),
    low_open: bool,
) -> Result<f32> {
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
pub(super) fn sampling(s: &SamplingOptions, request_id: &str) -> Result<SamplingParams> {
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
pub(super) fn logit_bias(
    entries: &[(u32, f32)],
    vocab: usize,
    supported: bool,
) -> Result<LogitBias> {
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
