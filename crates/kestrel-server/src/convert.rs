//! The protobuf edge: generated `kestrel.v1` messages become validated
//! `kestrel-engine` types here, by hand, and engine results become messages.
//!
//! Every field is checked once, with a [`ValidationError`] that names the
//! field and its allowed range; the engine never sees an out-of-range value
//! or an `Option` it must guess about. Pure functions, no I/O: unit-tested
//! without a server.

use kestrel_engine::{
    ChatMessage, Constraint, EngineError, FinishReason, GenerateRequest, GenerateResponse,
    ModelInfo, Prompt, SamplingParams, StreamEvent, TokenLogprob, MAX_TOP_LOGPROBS,
};
use tonic::{Code, Status};

use crate::pb;

/// `max_new_tokens` when a request leaves it unset (capped by the limit).
pub const DEFAULT_MAX_NEW_TOKENS: u32 = 256;
/// Most stop sequences per request.
pub const MAX_STOP_SEQUENCES: usize = 16;
/// Longest stop sequence, in bytes.
pub const MAX_STOP_BYTES: usize = 256;
/// Most stop token ids per request.
pub const MAX_STOP_TOKEN_IDS: usize = 64;
/// Longest client-chosen request id, in bytes.
pub const MAX_REQUEST_ID_BYTES: usize = 128;
/// Most chat messages per request.
pub const MAX_CHAT_MESSAGES: usize = 1024;
/// Most choices in a choice constraint.
pub const MAX_CHOICES: usize = 1024;
/// Temperature range, inclusive.
pub const TEMPERATURE_RANGE: (f32, f32) = (0.0, 100.0);
/// Largest repetition penalty (the range is `(0, MAX]`).
pub const MAX_REPETITION_PENALTY: f32 = 10.0;
/// Frequency and presence penalty range, inclusive (OpenAI's and vLLM's).
pub const PENALTY_RANGE: (f32, f32) = (-2.0, 2.0);
/// Chat roles the server accepts.
pub const CHAT_ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// A request field that failed validation. Displays as
/// `"<field> <message>"`, e.g. `temperature must be in [0, 100], got -1`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {message}")]
pub struct ValidationError {
    /// The proto field's name (dotted for nested fields, e.g. `chat.messages[2].role`).
    pub field: String,
    /// What is allowed, and what was given.
    pub message: String,
}

impl ValidationError {
    fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl From<ValidationError> for Status {
    fn from(e: ValidationError) -> Self {
        Status::invalid_argument(e.to_string())
    }
}

/// The limits requests are validated against, from the served model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest `max_new_tokens` (the context minus one prompt token).
    pub max_new_tokens: u32,
    /// Token ids must be below this.
    pub vocab_size: u32,
}

impl Limits {
    /// Limits of the model and context an engine serves.
    pub fn from_model_info(info: &ModelInfo) -> Self {
        Self {
            max_new_tokens: saturating_u32(info.context_length.saturating_sub(1)).max(1),
            vocab_size: saturating_u32(info.vocab_size),
        }
    }
}

fn saturating_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

type Result<T, E = ValidationError> = std::result::Result<T, E>;

/// Validates a `GenerateRequest` and builds the engine's request.
pub fn generate_request(req: pb::GenerateRequest, limits: &Limits) -> Result<GenerateRequest> {
    let sampling = sampling(&req)?;
    let input = prompt(req.input)?;
    let max_new_tokens = match req.max_new_tokens {
        None => DEFAULT_MAX_NEW_TOKENS.min(limits.max_new_tokens),
        Some(n) if (1..=limits.max_new_tokens).contains(&n) => n,
        Some(n) => {
            return Err(ValidationError::new(
                "max_new_tokens",
                format!("must be in [1, {}], got {n}", limits.max_new_tokens),
            ))
        }
    };
    let stop = stop_sequences(req.stop)?;
    let stop_token_ids = stop_token_ids(req.stop_token_ids, limits)?;
    let request_id = request_id(req.request_id)?;
    let constraint = req.constraint.map(constraint).transpose()?;
    if constraint.is_some() && (!stop.is_empty() || !stop_token_ids.is_empty() || req.ignore_eos) {
        return Err(ValidationError::new(
            "constraint",
            "cannot be combined with stop, stop_token_ids or ignore_eos",
        ));
    }
    Ok(GenerateRequest {
        request_id,
        input,
        max_new_tokens,
        sampling,
        stop,
        stop_token_ids,
        ignore_eos: req.ignore_eos,
        constraint,
    })
}

fn prompt(input: Option<pb::generate_request::Input>) -> Result<Prompt> {
    use pb::generate_request::Input;
    match input {
        None => Err(ValidationError::new(
            "input",
            "must be set (either prompt or chat)",
        )),
        Some(Input::Prompt(text)) if text.is_empty() => {
            Err(ValidationError::new("prompt", "must not be empty"))
        }
        Some(Input::Prompt(text)) => Ok(Prompt::Text(text)),
        Some(Input::Chat(chat)) => {
            if chat.messages.is_empty() {
                return Err(ValidationError::new("chat.messages", "must not be empty"));
            }
            if chat.messages.len() > MAX_CHAT_MESSAGES {
                return Err(ValidationError::new(
                    "chat.messages",
                    format!(
                        "must have at most {MAX_CHAT_MESSAGES} entries, got {}",
                        chat.messages.len()
                    ),
                ));
            }
            let mut messages = Vec::with_capacity(chat.messages.len());
            for (i, m) in chat.messages.into_iter().enumerate() {
                if !CHAT_ROLES.contains(&m.role.as_str()) {
                    return Err(ValidationError::new(
                        format!("chat.messages[{i}].role"),
                        format!("must be one of {}, got {:?}", CHAT_ROLES.join(", "), m.role),
                    ));
                }
                messages.push(ChatMessage::new(m.role, m.content));
            }
            Ok(Prompt::Chat(messages))
        }
    }
}

/// `value` if it lies in the range, else an error naming the field and range.
/// NaN lies in no range.
fn check_range(field: &str, value: f32, range: (f32, f32), low_open: bool) -> Result<f32> {
    let (lo, hi) = range;
    let low_ok = if low_open { value > lo } else { value >= lo };
    if low_ok && value <= hi {
        Ok(value)
    } else {
        let open = if low_open { '(' } else { '[' };
        Err(ValidationError::new(
            field,
            format!("must be in {open}{lo}, {hi}], got {value}"),
        ))
    }
}

fn sampling(req: &pb::GenerateRequest) -> Result<SamplingParams> {
    let d = SamplingParams::default();
    let temperature = match req.temperature {
        Some(t) => check_range("temperature", t, TEMPERATURE_RANGE, false)?,
        None => d.temperature,
    };
    let top_p = match req.top_p {
        Some(p) => check_range("top_p", p, (0.0, 1.0), true)?,
        None => d.top_p,
    };
    let min_p = match req.min_p {
        Some(p) => check_range("min_p", p, (0.0, 1.0), false)?,
        None => d.min_p,
    };
    let repetition_penalty = match req.repetition_penalty {
        Some(p) => check_range("repetition_penalty", p, (0.0, MAX_REPETITION_PENALTY), true)?,
        None => d.repetition_penalty,
    };
    let frequency_penalty = match req.frequency_penalty {
        Some(p) => check_range("frequency_penalty", p, PENALTY_RANGE, false)?,
        None => d.frequency_penalty,
    };
    let presence_penalty = match req.presence_penalty {
        Some(p) => check_range("presence_penalty", p, PENALTY_RANGE, false)?,
        None => d.presence_penalty,
    };
    if req.top_logprobs > MAX_TOP_LOGPROBS {
        return Err(ValidationError::new(
            "top_logprobs",
            format!(
                "must be in [0, {MAX_TOP_LOGPROBS}], got {}",
                req.top_logprobs
            ),
        ));
    }
    Ok(SamplingParams {
        temperature,
        // Any value is meaningful: 0 disables, >= vocab is the same as 0.
        top_k: req.top_k.unwrap_or(d.top_k),
        top_p,
        min_p,
        repetition_penalty,
        frequency_penalty,
        presence_penalty,
        // 0 tells the engine "not given" (it derives one from the request id).
        seed: req.seed.unwrap_or(0),
        top_logprobs: req.top_logprobs,
        logprobs: req.logprobs || req.top_logprobs > 0,
    })
}

fn stop_sequences(stop: Vec<String>) -> Result<Vec<String>> {
    if stop.len() > MAX_STOP_SEQUENCES {
        return Err(ValidationError::new(
            "stop",
            format!(
                "must have at most {MAX_STOP_SEQUENCES} entries, got {}",
                stop.len()
            ),
        ));
    }
    for (i, s) in stop.iter().enumerate() {
        if s.is_empty() || s.len() > MAX_STOP_BYTES {
            return Err(ValidationError::new(
                format!("stop[{i}]"),
                format!("must be 1 to {MAX_STOP_BYTES} bytes long, got {}", s.len()),
            ));
        }
    }
    Ok(stop)
}

fn stop_token_ids(ids: Vec<u32>, limits: &Limits) -> Result<Vec<u32>> {
    if ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(ValidationError::new(
            "stop_token_ids",
            format!(
                "must have at most {MAX_STOP_TOKEN_IDS} entries, got {}",
                ids.len()
            ),
        ));
    }
    token_ids_in_vocab("stop_token_ids", &ids, limits)?;
    Ok(ids)
}

/// Checks that every id is below the vocabulary size.
pub fn token_ids_in_vocab(field: &str, ids: &[u32], limits: &Limits) -> Result<()> {
    match ids.iter().position(|&id| id >= limits.vocab_size) {
        None => Ok(()),
        Some(i) => Err(ValidationError::new(
            format!("{field}[{i}]"),
            format!("must be in [0, {}), got {}", limits.vocab_size, ids[i]),
        )),
    }
}

fn request_id(id: String) -> Result<Option<String>> {
    if id.is_empty() {
        return Ok(None);
    }
    if id.len() > MAX_REQUEST_ID_BYTES || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ValidationError::new(
            "request_id",
            format!(
                "must be at most {MAX_REQUEST_ID_BYTES} bytes of printable ASCII without spaces, got {id:?}"
            ),
        ));
    }
    Ok(Some(id))
}

fn constraint(c: pb::generate_request::Constraint) -> Result<Constraint> {
    use pb::generate_request::Constraint as C;
    match c {
        C::JsonSchema(text) => {
            let schema: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                ValidationError::new("json_schema", format!("must be valid JSON: {e}"))
            })?;
            if !(schema.is_object() || schema.is_boolean()) {
                return Err(ValidationError::new(
                    "json_schema",
                    "must be a JSON object or boolean (a JSON Schema)",
                ));
            }
            Ok(Constraint::JsonSchema(schema))
        }
        C::Regex(re) if re.is_empty() => Err(ValidationError::new("regex", "must not be empty")),
        C::Regex(re) => Ok(Constraint::Regex(re)),
        C::Choice(list) => {
            if list.choices.is_empty() {
                return Err(ValidationError::new("choice.choices", "must not be empty"));
            }
            if list.choices.len() > MAX_CHOICES {
                return Err(ValidationError::new(
                    "choice.choices",
                    format!(
                        "must have at most {MAX_CHOICES} entries, got {}",
                        list.choices.len()
                    ),
                ));
            }
            if let Some(i) = list.choices.iter().position(String::is_empty) {
                return Err(ValidationError::new(
                    format!("choice.choices[{i}]"),
                    "must not be empty",
                ));
            }
            Ok(Constraint::Choice(list.choices))
        }
        C::Grammar(g) if g.trim().is_empty() => {
            Err(ValidationError::new("grammar", "must not be empty"))
        }
        C::Grammar(g) => Ok(Constraint::Grammar(g)),
    }
}

/// Validates an `AbortRequest`, returning the request id.
pub fn abort_request(req: pb::AbortRequest) -> Result<String> {
    if req.request_id.is_empty() {
        return Err(ValidationError::new("request_id", "must not be empty"));
    }
    Ok(req.request_id)
}

/// Maps an engine error to the status code documented in the proto.
pub fn engine_status(e: &EngineError) -> Status {
    let code = match e {
        EngineError::InvalidArgument { .. } => Code::InvalidArgument,
        // The request can never fit as sent: an argument error (see the proto).
        EngineError::ContextOverflow { .. } => Code::InvalidArgument,
        EngineError::QueueFull { .. } => Code::ResourceExhausted,
        EngineError::Unavailable(_)
        | EngineError::ShuttingDown
        | EngineError::BackendUnavailable(_) => Code::Unavailable,
        EngineError::RequestFailed(_) | EngineError::ModelLoad(_) | EngineError::SkillSetup(_) => {
            Code::Internal
        }
    };
    Status::new(code, error_chain(e))
}

/// `e` and its `source()` chain, joined with ": ".
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        msg.push_str(": ");
        msg.push_str(&c.to_string());
        cause = c.source();
    }
    msg
}

/// The proto value of a finish reason.
pub fn finish_reason(r: FinishReason) -> pb::FinishReason {
    match r {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Eos => pb::FinishReason::Eos,
        FinishReason::Abort => pb::FinishReason::Abort,
        FinishReason::Error => pb::FinishReason::Error,
    }
}

fn logprobs(lps: Vec<TokenLogprob>) -> Vec<pb::TokenLogprob> {
    lps.into_iter()
        .map(|lp| pb::TokenLogprob {
            token_id: lp.token_id,
            text: lp.text,
            logprob: lp.logprob,
            top: lp
                .top
                .into_iter()
                .map(|(token_id, text, logprob)| pb::TopLogprob {
                    token_id,
                    text,
                    logprob,
                })
                .collect(),
        })
        .collect()
}

/// The proto message of a finished request.
pub fn generate_response(r: GenerateResponse) -> pb::GenerateResponse {
    pb::GenerateResponse {
        request_id: r.request_id,
        text: r.text,
        token_ids: r.token_ids,
        finish_reason: finish_reason(r.finish_reason).into(),
        usage: Some(pb::Usage {
            prompt_tokens: r.usage.prompt_tokens,
            completion_tokens: r.usage.completion_tokens,
            cached_prompt_tokens: r.usage.cached_prompt_tokens,
        }),
        timings: Some(pb::Timings {
            queue_ms: r.timings.queue_ms,
            ttft_ms: r.timings.ttft_ms,
            total_ms: r.timings.total_ms,
            tokens_per_s: r.timings.tokens_per_s,
        }),
        logprobs: logprobs(r.logprobs),
        json: r.json.map(|v| v.to_string()),
    }
}

/// The proto message of one stream event.
pub fn stream_event(ev: StreamEvent) -> pb::StreamGenerateResponse {
    use pb::stream_generate_response::Event;
    let event = match ev {
        StreamEvent::Delta {
            text,
            token_ids,
            logprobs: lps,
        } => Event::Delta(pb::StreamDelta {
            text,
            token_ids,
            logprobs: logprobs(lps),
        }),
        StreamEvent::Done(resp) => Event::Done(generate_response(resp)),
    };
    pb::StreamGenerateResponse { event: Some(event) }
}

/// The proto message of the engine's model info.
pub fn model_info(info: ModelInfo) -> pb::ModelInfoResponse {
    let limits = Limits::from_model_info(&info);
    let u = saturating_u32;
    pb::ModelInfoResponse {
        model: info.name,
        architecture: info.architecture,
        vocab_size: u(info.vocab_size),
        context_length: u(info.context_length),
        max_new_tokens: limits.max_new_tokens,
        eos_token_ids: info.eos_token_ids,
        backend: info.backend,
        mode: kestrel_engine::mode_name(info.mode).to_string(),
        max_batch_size: u(info.max_batch_size),
        kv_pages_total: u(info.kv_pages_total),
        kv_pages_used: u(info.kv_pages_used),
        kv_pages_free: u(info.kv_pages_free),
        num_admitted: u(info.num_admitted),
        num_running: u(info.num_running),
        num_waiting: u(info.num_waiting),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::generate_request::{Constraint as PbConstraint, Input};

    const LIMITS: Limits = Limits {
        max_new_tokens: 2047,
        vocab_size: 49152,
    };

    fn base() -> pb::GenerateRequest {
        pb::GenerateRequest {
            input: Some(Input::Prompt("Hello".into())),
            ..Default::default()
        }
    }

    fn ok(req: pb::GenerateRequest) -> GenerateRequest {
        generate_request(req, &LIMITS).expect("valid request")
    }

    /// Asserts the request is rejected for `field` with a message containing `needle`.
    fn rejects(req: pb::GenerateRequest, field: &str, needle: &str) {
        let e = generate_request(req, &LIMITS).expect_err("invalid request");
        assert_eq!(e.field, field, "{e}");
        let text = e.to_string();
        assert!(text.contains(needle), "{text:?} lacks {needle:?}");
        let status = Status::from(e);
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().starts_with(field), "{}", status.message());
    }

    #[test]
    fn minimal_request_gets_documented_defaults() {
        let r = ok(base());
        assert_eq!(r.input, Prompt::Text("Hello".into()));
        assert_eq!(r.max_new_tokens, DEFAULT_MAX_NEW_TOKENS);
        assert_eq!(r.sampling, SamplingParams::default());
        assert_eq!(r.request_id, None);
        assert!(r.stop.is_empty() && r.stop_token_ids.is_empty() && !r.ignore_eos);
        assert_eq!(r.constraint, None);
    }

    #[test]
    fn full_request_maps_every_field() {
        let r = ok(pb::GenerateRequest {
            input: Some(Input::Prompt("p".into())),
            max_new_tokens: Some(7),
            temperature: Some(0.7),
            top_p: Some(0.9),
            top_k: Some(40),
            min_p: Some(0.05),
            repetition_penalty: Some(1.1),
            frequency_penalty: Some(-0.5),
            presence_penalty: Some(0.5),
            seed: Some(42),
            stop: vec!["\n\n".into()],
            stop_token_ids: vec![2],
            ignore_eos: true,
            logprobs: false,
            top_logprobs: 3,
            request_id: "my-req_1".into(),
            constraint: None,
        });
        assert_eq!(r.max_new_tokens, 7);
        assert_eq!(
            r.sampling,
            SamplingParams {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                min_p: 0.05,
                repetition_penalty: 1.1,
                frequency_penalty: -0.5,
                presence_penalty: 0.5,
                seed: 42,
                top_logprobs: 3,
                // top_logprobs implies logprobs
                logprobs: true,
            }
        );
        assert_eq!(r.stop, vec!["\n\n".to_string()]);
        assert_eq!(r.stop_token_ids, vec![2]);
        assert!(r.ignore_eos);
        assert_eq!(r.request_id.as_deref(), Some("my-req_1"));
    }

    #[test]
    fn default_max_new_tokens_is_capped_by_the_limit() {
        let small = Limits {
            max_new_tokens: 10,
            vocab_size: 100,
        };
        assert_eq!(generate_request(base(), &small).unwrap().max_new_tokens, 10);
    }

    #[test]
    fn input_must_be_set_and_non_empty() {
        rejects(
            pb::GenerateRequest::default(),
            "input",
            "must be set (either prompt or chat)",
        );
        rejects(
            pb::GenerateRequest {
                input: Some(Input::Prompt(String::new())),
                ..base()
            },
            "prompt",
            "must not be empty",
        );
    }

    fn chat(messages: Vec<(&str, &str)>) -> pb::GenerateRequest {
        pb::GenerateRequest {
            input: Some(Input::Chat(pb::ChatMessages {
                messages: messages
                    .into_iter()
                    .map(|(role, content)| pb::ChatMessage {
                        role: role.into(),
                        content: content.into(),
                    })
                    .collect(),
            })),
            ..base()
        }
    }

    #[test]
    fn chat_input_is_validated() {
        let r = ok(chat(vec![("system", ""), ("user", "hi")]));
        assert_eq!(
            r.input,
            Prompt::Chat(vec![ChatMessage::system(""), ChatMessage::user("hi")])
        );
        rejects(chat(vec![]), "chat.messages", "must not be empty");
        rejects(
            chat(vec![("user", "hi"), ("wizard", "x")]),
            "chat.messages[1].role",
            "must be one of system, user, assistant, tool, got \"wizard\"",
        );
        rejects(
            chat(vec![("", "x")]),
            "chat.messages[0].role",
            "must be one of",
        );
        let many = vec![("user", "x"); MAX_CHAT_MESSAGES + 1];
        rejects(chat(many), "chat.messages", "at most 1024");
    }

    #[test]
    fn max_new_tokens_range() {
        for n in [1, 2047] {
            assert_eq!(
                ok(pb::GenerateRequest {
                    max_new_tokens: Some(n),
                    ..base()
                })
                .max_new_tokens,
                n
            );
        }
        for n in [0, 2048, u32::MAX] {
            rejects(
                pb::GenerateRequest {
                    max_new_tokens: Some(n),
                    ..base()
                },
                "max_new_tokens",
                &format!("must be in [1, 2047], got {n}"),
            );
        }
    }

    /// Applies `set` to a base request and expects acceptance for `good`
    /// values and a range message for `bad` ones.
    fn float_rule(
        field: &str,
        set: fn(&mut pb::GenerateRequest, f32),
        good: &[f32],
        bad: &[f32],
        range: &str,
    ) {
        for &v in good {
            let mut r = base();
            set(&mut r, v);
            generate_request(r, &LIMITS).unwrap_or_else(|e| panic!("{field}={v}: {e}"));
        }
        for &v in bad {
            let mut r = base();
            set(&mut r, v);
            rejects(r, field, &format!("must be in {range}, got {v}"));
        }
    }

    #[test]
    fn temperature_range() {
        float_rule(
            "temperature",
            |r, v| r.temperature = Some(v),
            &[0.0, 0.5, 100.0],
            &[-1.0, 100.5, f32::NAN, f32::INFINITY],
            "[0, 100]",
        );
        let e = generate_request(
            pb::GenerateRequest {
                temperature: Some(-1.0),
                ..base()
            },
            &LIMITS,
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "temperature must be in [0, 100], got -1");
    }

    #[test]
    fn top_p_range() {
        float_rule(
            "top_p",
            |r, v| r.top_p = Some(v),
            &[0.01, 1.0],
            &[0.0, -0.1, 1.01, f32::NAN],
            "(0, 1]",
        );
    }

    #[test]
    fn min_p_range() {
        float_rule(
            "min_p",
            |r, v| r.min_p = Some(v),
            &[0.0, 1.0],
            &[-0.01, 1.5, f32::NAN],
            "[0, 1]",
        );
    }

    #[test]
    fn repetition_penalty_range() {
        float_rule(
            "repetition_penalty",
            |r, v| r.repetition_penalty = Some(v),
            &[0.5, 1.0, 10.0],
            &[0.0, -1.0, 10.5, f32::NAN],
            "(0, 10]",
        );
    }

    #[test]
    fn frequency_and_presence_penalty_ranges() {
        float_rule(
            "frequency_penalty",
            |r, v| r.frequency_penalty = Some(v),
            &[-2.0, 0.0, 2.0],
            &[-2.5, 2.5, f32::NAN],
            "[-2, 2]",
        );
        float_rule(
            "presence_penalty",
            |r, v| r.presence_penalty = Some(v),
            &[-2.0, 0.0, 2.0],
            &[-2.5, 2.5, f32::NEG_INFINITY],
            "[-2, 2]",
        );
    }

    #[test]
    fn top_k_and_seed_take_any_value() {
        let r = ok(pb::GenerateRequest {
            top_k: Some(u32::MAX),
            seed: Some(u64::MAX),
            ..base()
        });
        assert_eq!((r.sampling.top_k, r.sampling.seed), (u32::MAX, u64::MAX));
    }

    #[test]
    fn top_logprobs_at_most_20() {
        let r = ok(pb::GenerateRequest {
            top_logprobs: 20,
            ..base()
        });
        assert_eq!(r.sampling.top_logprobs, 20);
        rejects(
            pb::GenerateRequest {
                top_logprobs: 21,
                ..base()
            },
            "top_logprobs",
            "must be in [0, 20], got 21",
        );
        let r = ok(pb::GenerateRequest {
            logprobs: true,
            ..base()
        });
        assert!(r.sampling.logprobs && r.sampling.top_logprobs == 0);
    }

    #[test]
    fn stop_sequences_are_bounded() {
        rejects(
            pb::GenerateRequest {
                stop: vec!["a".into(), String::new()],
                ..base()
            },
            "stop[1]",
            "must be 1 to 256 bytes long, got 0",
        );
        rejects(
            pb::GenerateRequest {
                stop: vec!["x".repeat(257)],
                ..base()
            },
            "stop[0]",
            "got 257",
        );
        rejects(
            pb::GenerateRequest {
                stop: vec!["s".into(); 17],
                ..base()
            },
            "stop",
            "at most 16 entries, got 17",
        );
    }

    #[test]
    fn stop_token_ids_are_in_vocab_and_bounded() {
        rejects(
            pb::GenerateRequest {
                stop_token_ids: vec![1, 49152],
                ..base()
            },
            "stop_token_ids[1]",
            "must be in [0, 49152), got 49152",
        );
        rejects(
            pb::GenerateRequest {
                stop_token_ids: vec![1; 65],
                ..base()
            },
            "stop_token_ids",
            "at most 64 entries, got 65",
        );
    }

    #[test]
    fn request_id_is_printable_and_short() {
        for bad in ["has space", "tab\t", "é", &"x".repeat(129)] {
            rejects(
                pb::GenerateRequest {
                    request_id: bad.into(),
                    ..base()
                },
                "request_id",
                "printable ASCII",
            );
        }
    }

    fn constrained(c: PbConstraint) -> pb::GenerateRequest {
        pb::GenerateRequest {
            constraint: Some(c),
            ..base()
        }
    }

    #[test]
    fn json_schema_must_parse_as_a_schema() {
        let r = ok(constrained(PbConstraint::JsonSchema(
            r#"{"type":"object"}"#.into(),
        )));
        assert_eq!(
            r.constraint,
            Some(Constraint::JsonSchema(
                serde_json::json!({"type": "object"})
            ))
        );
        ok(constrained(PbConstraint::JsonSchema("true".into())));
        rejects(
            constrained(PbConstraint::JsonSchema("{not json".into())),
            "json_schema",
            "must be valid JSON",
        );
        rejects(
            constrained(PbConstraint::JsonSchema(String::new())),
            "json_schema",
            "must be valid JSON",
        );
        rejects(
            constrained(PbConstraint::JsonSchema("[1,2]".into())),
            "json_schema",
            "must be a JSON object or boolean",
        );
    }

    #[test]
    fn regex_and_grammar_must_not_be_empty() {
        assert_eq!(
            ok(constrained(PbConstraint::Regex("[0-9]+".into()))).constraint,
            Some(Constraint::Regex("[0-9]+".into()))
        );
        rejects(
            constrained(PbConstraint::Regex(String::new())),
            "regex",
            "must not be empty",
        );
        ok(constrained(PbConstraint::Grammar("start: \"a\"".into())));
        rejects(
            constrained(PbConstraint::Grammar("  \n".into())),
            "grammar",
            "must not be empty",
        );
    }

    #[test]
    fn choice_list_must_be_non_empty() {
        let list = |c: &[&str]| {
            constrained(PbConstraint::Choice(pb::ChoiceList {
                choices: c.iter().map(|s| s.to_string()).collect(),
            }))
        };
        assert_eq!(
            ok(list(&["yes", "no"])).constraint,
            Some(Constraint::Choice(vec!["yes".into(), "no".into()]))
        );
        rejects(list(&[]), "choice.choices", "must not be empty");
        rejects(list(&["yes", ""]), "choice.choices[1]", "must not be empty");
    }

    #[test]
    fn constraints_exclude_stop_conditions() {
        let c = || Some(PbConstraint::Regex("a".into()));
        for req in [
            pb::GenerateRequest {
                stop: vec!["x".into()],
                constraint: c(),
                ..base()
            },
            pb::GenerateRequest {
                stop_token_ids: vec![1],
                constraint: c(),
                ..base()
            },
            pb::GenerateRequest {
                ignore_eos: true,
                constraint: c(),
                ..base()
            },
        ] {
            rejects(req, "constraint", "cannot be combined");
        }
    }

    #[test]
    fn abort_needs_an_id() {
        assert!(abort_request(pb::AbortRequest::default()).is_err());
        assert_eq!(
            abort_request(pb::AbortRequest {
                request_id: "r".into()
            })
            .unwrap(),
            "r"
        );
    }

    #[test]
    fn detokenize_ids_must_be_in_vocab() {
        assert!(token_ids_in_vocab("token_ids", &[0, 49151], &LIMITS).is_ok());
        let e = token_ids_in_vocab("token_ids", &[0, 49152], &LIMITS).unwrap_err();
        assert_eq!(
            e.to_string(),
            "token_ids[1] must be in [0, 49152), got 49152"
        );
    }

    #[test]
    fn engine_errors_map_to_documented_codes() {
        let cases = [
            (
                EngineError::InvalidArgument {
                    field: "regex",
                    message: "bad".into(),
                },
                Code::InvalidArgument,
            ),
            (EngineError::QueueFull { limit: 4 }, Code::ResourceExhausted),
            (
                EngineError::ContextOverflow {
                    prompt_tokens: 10,
                    max_new_tokens: 10,
                    limit: 12,
                },
                Code::InvalidArgument,
            ),
            (EngineError::Unavailable("x".into()), Code::Unavailable),
            (EngineError::ShuttingDown, Code::Unavailable),
            (
                EngineError::BackendUnavailable("x".into()),
                Code::Unavailable,
            ),
            (EngineError::RequestFailed("x".into()), Code::Internal),
        ];
        for (e, code) in cases {
            let s = engine_status(&e);
            assert_eq!(s.code(), code, "{e}");
            assert_eq!(s.message(), e.to_string());
        }
    }

    #[test]
    fn responses_convert_every_field() {
        let resp = GenerateResponse {
            request_id: "r1".into(),
            text: "hi".into(),
            token_ids: vec![5, 6],
            finish_reason: FinishReason::Length,
            usage: kestrel_engine::Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
                cached_prompt_tokens: 1,
            },
            timings: kestrel_engine::Timings {
                queue_ms: 1.0,
                ttft_ms: 2.0,
                total_ms: 3.0,
                tokens_per_s: 4.0,
            },
            logprobs: vec![TokenLogprob {
                token_id: 5,
                text: "h".into(),
                logprob: -0.5,
                top: vec![(5, "h".into(), -0.5), (7, "x".into(), -2.0)],
            }],
            json: Some(serde_json::json!({"a": 1})),
        };
        let p = generate_response(resp.clone());
        assert_eq!(p.request_id, "r1");
        assert_eq!(p.text, "hi");
        assert_eq!(p.token_ids, vec![5, 6]);
        assert_eq!(p.finish_reason(), pb::FinishReason::Length);
        assert_eq!(
            p.usage,
            Some(pb::Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
                cached_prompt_tokens: 1
            })
        );
        assert_eq!(p.timings.unwrap().tokens_per_s, 4.0);
        assert_eq!(p.logprobs[0].top[1].token_id, 7);
        assert_eq!(p.json.as_deref(), Some(r#"{"a":1}"#));

        use pb::stream_generate_response::Event;
        match stream_event(StreamEvent::Done(resp)).event {
            Some(Event::Done(d)) => assert_eq!(d, p),
            other => panic!("{other:?}"),
        }
        match stream_event(StreamEvent::Delta {
            text: "é".into(),
            token_ids: vec![9],
            logprobs: vec![],
        })
        .event
        {
            Some(Event::Delta(d)) => assert_eq!((d.text.as_str(), d.token_ids), ("é", vec![9])),
            other => panic!("{other:?}"),
        }
    }
}
