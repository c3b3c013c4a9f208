//! The protobuf edge: generated `kestrel.v1` messages map onto
//! `kestrel-engine` types here, by hand, and engine results and errors map
//! back onto messages and statuses.
//!
//! This module maps shapes only. Every rule (ranges, sizes, what combines
//! with what) lives once, in `kestrel_engine::validate`; the only errors
//! raised here are the ones a shape can have and an engine type cannot
//! (an unset `input` oneof, a JSON schema that is not JSON text). An engine
//! error names an engine [`Field`]; [`field_name`] gives the proto's name
//! for it, in the [`FieldScope`] of the request (a point/detect request's
//! `object` is `vision.point.object` or `vision.detect.object`). Pure
//! functions, no I/O: unit-tested without a server.

use kestrel_engine::{
    error_chain, BoundingBox, CaptionLength, ChatMessage, Constraint, EngineError, Field,
    FinishReason, GenerateRequest, GenerateResponse, ModelInfo, Point, Prompt, SamplingOptions,
    SpatialObject, SpatialResult, Speculation, StreamEvent, TokenLogprob, VisionTask,
};
use tonic::{Code, Status};

use crate::pb;

/// A request whose shape does not map onto an engine request. Displays as
/// `"<field> <message>"`, like the engine's argument errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {message}")]
pub struct ShapeError {
    /// The proto field's name.
    pub field: &'static str,
    pub message: &'static str,
}

impl From<ShapeError> for Status {
    fn from(e: ShapeError) -> Self {
        Status::invalid_argument(e.to_string())
    }
}

/// Maps a `GenerateRequest` onto the engine's request (unset optional
/// fields stay `None`: the engine applies its defaults).
pub fn generate_request(req: pb::GenerateRequest) -> Result<GenerateRequest, ShapeError> {
    use pb::generate_request::Input;
    let input = match req.input {
        None => {
            return Err(ShapeError {
                field: "input",
                message: "must be set (prompt, chat, prompt_tokens or vision)",
            })
        }
        Some(Input::Vision(v)) => vision(v)?,
        Some(Input::Prompt(text)) => Prompt::Text(text),
        Some(Input::PromptTokens(tokens)) => Prompt::Tokens(tokens.ids),
        Some(Input::Chat(chat)) => Prompt::chat(
            chat.messages
                .into_iter()
                .map(|m| ChatMessage::new(m.role, m.content))
                .collect(),
        ),
    };
    Ok(GenerateRequest {
        // The proto's "not given" is the empty string.
        request_id: Some(req.request_id).filter(|id| !id.is_empty()),
        input,
        max_new_tokens: req.max_new_tokens,
        sampling: SamplingOptions {
            temperature: req.temperature,
            top_k: req.top_k,
            top_p: req.top_p,
            min_p: req.min_p,
            repetition_penalty: req.repetition_penalty,
            frequency_penalty: req.frequency_penalty,
            presence_penalty: req.presence_penalty,
            seed: req.seed,
            logprobs: req.logprobs,
            top_logprobs: req.top_logprobs,
            logit_bias: req.logit_bias.into_iter().collect(),
            prompt_logprobs: req.prompt_logprobs,
        },
        stop: req.stop,
        stop_token_ids: req.stop_token_ids,
        ignore_eos: req.ignore_eos,
        min_tokens: req.min_tokens,
        constraint: req.constraint.map(constraint).transpose()?,
        speculate: match req.speculate_ngram {
            None => Speculation::Default,
            Some(0) => Speculation::Off,
            Some(max_draft) => Speculation::Ngram { max_draft },
        },
        n: req.n,
    })
}

fn vision(v: pb::VisionInput) -> Result<Prompt, ShapeError> {
    use pb::vision_input::Skill;
    let task = match v.skill {
        None => {
            return Err(ShapeError {
                field: "vision.skill",
                message: "must be set (query, caption, point or detect)",
            })
        }
        Some(Skill::Point(p)) => VisionTask::Point {
            object: p.object,
            max_objects: p.max_objects,
        },
        Some(Skill::Detect(d)) => VisionTask::Detect {
            object: d.object,
            max_objects: d.max_objects,
        },
        Some(Skill::Query(q)) => VisionTask::Query {
            question: q.question,
        },
        Some(Skill::Caption(c)) => VisionTask::Caption {
            length: match pb::CaptionLength::try_from(c.length) {
                Ok(pb::CaptionLength::Unspecified | pb::CaptionLength::Normal) => {
                    CaptionLength::Normal
                }
                Ok(pb::CaptionLength::Short) => CaptionLength::Short,
                Ok(pb::CaptionLength::Long) => CaptionLength::Long,
                Err(_) => {
                    return Err(ShapeError {
                        field: "vision.caption.length",
                        message: "must be CAPTION_LENGTH_SHORT, _NORMAL or _LONG",
                    })
                }
            },
        },
    };
    Ok(Prompt::Vision {
        image: v.image,
        task,
    })
}

fn constraint(c: pb::generate_request::Constraint) -> Result<Constraint, ShapeError> {
    use pb::generate_request::Constraint as C;
    Ok(match c {
        C::JsonSchema(text) => {
            Constraint::JsonSchema(serde_json::from_str(&text).map_err(|_| ShapeError {
                field: "json_schema",
                message: "must be valid JSON text",
            })?)
        }
        C::Regex(re) => Constraint::Regex(re),
        C::Choice(list) => Constraint::Choice(list.choices),
        C::Grammar(g) => Constraint::Grammar(g),
    })
}

/// Validates an `AbortRequest`, returning the request id.
pub fn abort_request(req: pb::AbortRequest) -> Result<String, ShapeError> {
    if req.request_id.is_empty() {
        return Err(ShapeError {
            field: "request_id",
            message: "must not be empty",
        });
    }
    Ok(req.request_id)
}

/// Where a request's skill-specific fields sit in the proto: under
/// `vision.point` or `vision.detect` for a point/detect request (its
/// `object` and `max_objects`), nowhere in particular otherwise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FieldScope {
    spatial: Option<&'static str>,
}

impl FieldScope {
    /// The scope of `req`'s fields (cheap: looks at the skill only).
    pub fn of(req: &GenerateRequest) -> Self {
        let spatial = match &req.input {
            Prompt::Vision { task, .. } if task.is_spatial() => Some(task.skill_name()),
            _ => None,
        };
        FieldScope { spatial }
    }
}

/// The proto's name of an engine field, in a request's `scope`.
pub fn field_name(field: Field, scope: FieldScope) -> String {
    let skill = scope.spatial.unwrap_or("point");
    match field {
        Field::Messages => "chat.messages".into(),
        Field::MessageRole(i) => format!("chat.messages[{i}].role"),
        Field::Choices => "choice.choices".into(),
        Field::Choice(i) => format!("choice.choices[{i}]"),
        Field::Image => "vision.image".into(),
        Field::Question => "vision.query.question".into(),
        Field::Skill => "vision.skill".into(),
        Field::Object => format!("vision.{skill}.object"),
        Field::MaxObjects => format!("vision.{skill}.max_objects"),
        other => other.to_string(),
    }
}

/// Maps an engine error to the status code documented in the proto, the
/// fields named in the request's `scope`. An argument error reads
/// `"<proto field> <what is allowed, what was given>"`; every other message
/// is the error's whole cause chain.
pub fn engine_status(e: &EngineError, scope: FieldScope) -> Status {
    let field_name = |f: Field| field_name(f, scope);
    let code = match e {
        EngineError::InvalidArgument { field, message } => {
            return Status::invalid_argument(format!("{} {message}", field_name(*field)));
        }
        EngineError::InvalidConstraint { field, source } => {
            return Status::invalid_argument(format!(
                "{} {}",
                field_name(*field),
                error_chain(source)
            ));
        }
        EngineError::ConstraintFailed { field, source, .. } => {
            return Status::invalid_argument(format!(
                "{} stopped being satisfiable mid-generation: {}",
                field_name(*field),
                error_chain(source)
            ));
        }
        EngineError::ChatTemplate { field, source } => {
            return Status::invalid_argument(format!(
                "{} could not be rendered by the model's chat template: {}",
                field_name(*field),
                error_chain(source)
            ));
        }
        EngineError::Tokenizer { field, source } => {
            return Status::invalid_argument(format!(
                "{} could not be tokenized: {}",
                field_name(*field),
                error_chain(source.as_ref())
            ));
        }
        EngineError::InvalidImage { source } => {
            return Status::invalid_argument(format!(
                "{} {}",
                field_name(Field::Image),
                error_chain(source)
            ));
        }
        // The request can never fit as sent: an argument error (see the proto).
        EngineError::ContextOverflow { .. } | EngineError::NoChatTemplate => Code::InvalidArgument,
        EngineError::QueueFull { .. } => Code::ResourceExhausted,
        EngineError::Fatal(_)
        | EngineError::Stopped
        | EngineError::ShuttingDown
        | EngineError::BackendUnavailable { .. } => Code::Unavailable,
        // The runtime's fault, not the request's (see the engine's docs).
        EngineError::RequestFailed(_)
        | EngineError::SpatialFailed { .. }
        | EngineError::Spawn(_)
        | EngineError::ModelLoad(_)
        | EngineError::SkillSetup(_) => Code::Internal,
    };
    Status::new(code, error_chain(e))
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

/// The proto message of a finished request's samples (`n`, in order):
/// sample 0, the others in its `samples`.
pub fn generate_responses(rs: Vec<GenerateResponse>) -> pb::GenerateResponse {
    let mut rs = rs.into_iter().map(generate_response);
    let mut first = rs.next().unwrap_or_default();
    first.samples = rs.collect();
    first
}

/// The proto message of one finished sample.
pub fn generate_response(r: GenerateResponse) -> pb::GenerateResponse {
    pb::GenerateResponse {
        request_id: r.request_id,
        index: r.index,
        samples: Vec::new(),
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
        prompt_logprobs: logprobs(r.prompt_logprobs),
        points: match &r.objects {
            Some(SpatialResult::Points(p)) => p.iter().copied().map(point).collect(),
            _ => Vec::new(),
        },
        boxes: match &r.objects {
            Some(SpatialResult::Boxes(b)) => b.iter().copied().map(bounding_box).collect(),
            _ => Vec::new(),
        },
    }
}

fn point(p: Point) -> pb::Point {
    pb::Point { x: p.x, y: p.y }
}

fn bounding_box(b: BoundingBox) -> pb::BoundingBox {
    pb::BoundingBox {
        x_min: b.x_min,
        y_min: b.y_min,
        x_max: b.x_max,
        y_max: b.y_max,
    }
}

/// The proto message of one stream event of sample `index`.
pub fn stream_event(ev: StreamEvent, index: u32) -> pb::StreamGenerateResponse {
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
            index,
        }),
        StreamEvent::Object(o) => Event::Object(pb::StreamObject {
            object: Some(match o {
                SpatialObject::Point(p) => pb::stream_object::Object::Point(point(p)),
                SpatialObject::Box(b) => pb::stream_object::Object::Box(bounding_box(b)),
            }),
            index,
        }),
        StreamEvent::Done(resp) => Event::Done(generate_response(resp)),
    };
    pb::StreamGenerateResponse { event: Some(event) }
}

/// The proto message of the engine's model info.
pub fn model_info(info: ModelInfo) -> pb::ModelInfoResponse {
    let u = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    pb::ModelInfoResponse {
        model: info.name,
        architecture: info.architecture,
        vocab_size: u(info.vocab_size),
        context_length: u(info.context_length),
        max_new_tokens: u(info.context_length.saturating_sub(1)).max(1),
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

    fn base() -> pb::GenerateRequest {
        pb::GenerateRequest {
            input: Some(Input::Prompt("Hello".into())),
            ..Default::default()
        }
    }

    #[test]
    fn every_field_maps_and_unset_stays_unset() {
        let r = generate_request(pb::GenerateRequest {
            max_new_tokens: Some(7),
            temperature: Some(0.7),
            top_k: Some(40),
            top_p: Some(0.9),
            min_p: Some(0.05),
            repetition_penalty: Some(1.1),
            frequency_penalty: Some(-0.5),
            presence_penalty: Some(0.5),
            seed: Some(0),
            stop: vec!["\n\n".into()],
            stop_token_ids: vec![2],
            ignore_eos: true,
            min_tokens: 5,
            logprobs: false,
            top_logprobs: 3,
            prompt_logprobs: Some(4),
            logit_bias: [(17, -100.0)].into(),
            request_id: "my-req_1".into(),
            ..base()
        })
        .unwrap();
        assert_eq!(r.input, Prompt::Text("Hello".into()));
        assert_eq!(r.max_new_tokens, Some(7));
        assert_eq!(
            r.sampling,
            SamplingOptions {
                temperature: Some(0.7),
                top_k: Some(40),
                top_p: Some(0.9),
                min_p: Some(0.05),
                repetition_penalty: Some(1.1),
                frequency_penalty: Some(-0.5),
                presence_penalty: Some(0.5),
                // An explicit 0 is a seed like any other.
                seed: Some(0),
                logprobs: false,
                top_logprobs: 3,
                logit_bias: vec![(17, -100.0)],
                prompt_logprobs: Some(4),
            }
        );
        assert_eq!(r.stop, vec!["\n\n".to_string()]);
        assert_eq!(r.stop_token_ids, vec![2]);
        assert!(r.ignore_eos);
        assert_eq!(r.min_tokens, 5);
        assert_eq!(r.request_id.as_deref(), Some("my-req_1"));

        let r = generate_request(base()).unwrap();
        assert_eq!((r.max_new_tokens, r.request_id), (None, None));
        assert_eq!(r.sampling, SamplingOptions::default());

        let r = generate_request(pb::GenerateRequest {
            input: Some(pb::generate_request::Input::PromptTokens(pb::TokenIds {
                ids: vec![1, 2, 3],
            })),
            ..base()
        })
        .unwrap();
        assert_eq!(r.input, Prompt::Tokens(vec![1, 2, 3]));
    }

    #[test]
    fn shape_errors_name_the_field() {
        let e = generate_request(pb::GenerateRequest::default()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "input must be set (prompt, chat, prompt_tokens or vision)"
        );
        let e = generate_request(pb::GenerateRequest {
            constraint: Some(PbConstraint::JsonSchema("{not json".into())),
            ..base()
        })
        .unwrap_err();
        assert_eq!(Status::from(e).code(), Code::InvalidArgument);
        assert!(abort_request(pb::AbortRequest::default()).is_err());
    }

    /// A vision input maps its image and skill; an unset skill and an
    /// unknown caption length are shape errors naming their fields.
    #[test]
    fn vision_maps() {
        use pb::vision_input::Skill;
        let with = |skill| pb::GenerateRequest {
            input: Some(Input::Vision(pb::VisionInput {
                image: b"jpeg bytes".to_vec(),
                skill,
            })),
            ..base()
        };
        let r = generate_request(with(Some(Skill::Query(pb::VisionQuery {
            question: "What?".into(),
        }))))
        .unwrap();
        assert_eq!(
            r.input,
            Prompt::Vision {
                image: b"jpeg bytes".to_vec(),
                task: VisionTask::Query {
                    question: "What?".into()
                }
            }
        );
        for (wire, length) in [
            (pb::CaptionLength::Unspecified, CaptionLength::Normal),
            (pb::CaptionLength::Short, CaptionLength::Short),
            (pb::CaptionLength::Normal, CaptionLength::Normal),
            (pb::CaptionLength::Long, CaptionLength::Long),
        ] {
            let r = generate_request(with(Some(Skill::Caption(pb::VisionCaption {
                length: wire.into(),
            }))))
            .unwrap();
            let Prompt::Vision { task, .. } = r.input else {
                panic!("a vision prompt");
            };
            assert_eq!(task, VisionTask::Caption { length });
        }
        let e = generate_request(with(Some(Skill::Caption(pb::VisionCaption { length: 9 }))))
            .unwrap_err();
        assert_eq!(e.field, "vision.caption.length");
        let e = generate_request(with(None)).unwrap_err();
        assert_eq!(e.field, "vision.skill");
        let none = FieldScope::default();
        assert_eq!(field_name(Field::Image, none), "vision.image");
        assert_eq!(field_name(Field::Question, none), "vision.query.question");
        assert_eq!(field_name(Field::Skill, none), "vision.skill");
        // Point and detect: the same message under each skill, their
        // fields named under it.
        for (skill, name) in [
            (
                Skill::Point(pb::VisionSpatial {
                    object: "cat".into(),
                    max_objects: Some(3),
                }),
                "point",
            ),
            (
                Skill::Detect(pb::VisionSpatial {
                    object: "cat".into(),
                    max_objects: Some(3),
                }),
                "detect",
            ),
        ] {
            let r = generate_request(with(Some(skill))).unwrap();
            let scope = FieldScope::of(&r);
            let Prompt::Vision { task, .. } = r.input else {
                panic!("a vision prompt");
            };
            let want = match name {
                "point" => VisionTask::Point {
                    object: "cat".into(),
                    max_objects: Some(3),
                },
                _ => VisionTask::Detect {
                    object: "cat".into(),
                    max_objects: Some(3),
                },
            };
            assert_eq!(task, want);
            assert_eq!(
                field_name(Field::Object, scope),
                format!("vision.{name}.object")
            );
            let s = engine_status(
                &EngineError::InvalidArgument {
                    field: Field::MaxObjects,
                    message: "must be in [1, 256], got 0".into(),
                },
                scope,
            );
            assert_eq!(s.code(), Code::InvalidArgument);
            assert_eq!(
                s.message(),
                format!("vision.{name}.max_objects must be in [1, 256], got 0")
            );
        }
    }

    #[test]
    fn chat_and_constraints_map() {
        let r = generate_request(pb::GenerateRequest {
            input: Some(Input::Chat(pb::ChatMessages {
                messages: vec![pb::ChatMessage {
                    role: "user".into(),
                    content: "hi".into(),
                }],
            })),
            constraint: Some(PbConstraint::Choice(pb::ChoiceList {
                choices: vec!["a".into(), "b".into()],
            })),
            ..base()
        })
        .unwrap();
        assert_eq!(r.input, Prompt::chat(vec![ChatMessage::user("hi")]));
        assert_eq!(
            r.constraint,
            Some(Constraint::Choice(vec!["a".into(), "b".into()]))
        );
    }

    #[test]
    fn engine_errors_map_to_documented_codes_and_proto_names() {
        let s = engine_status(
            &EngineError::InvalidArgument {
                field: Field::MessageRole(2),
                message: "must be one of system, user".into(),
            },
            FieldScope::default(),
        );
        assert_eq!(s.code(), Code::InvalidArgument);
        assert_eq!(
            s.message(),
            "chat.messages[2].role must be one of system, user"
        );
        let cases = [
            (EngineError::QueueFull { limit: 4 }, Code::ResourceExhausted),
            (
                EngineError::ContextOverflow {
                    prompt_tokens: 10,
                    max_new_tokens: 10,
                    limit: 12,
                },
                Code::InvalidArgument,
            ),
            (EngineError::Stopped, Code::Unavailable),
            (EngineError::ShuttingDown, Code::Unavailable),
            (
                EngineError::Fatal(kestrel_engine::Cause::message("device lost")),
                Code::Unavailable,
            ),
            (
                EngineError::RequestFailed(kestrel_engine::Cause::message("x")),
                Code::Internal,
            ),
        ];
        for (e, code) in cases {
            let s = engine_status(&e, FieldScope::default());
            assert_eq!(s.code(), code, "{e}");
            assert_eq!(s.message(), error_chain(&e));
        }
        assert_eq!(
            engine_status(
                &EngineError::Fatal(kestrel_engine::Cause::message("device lost")),
                FieldScope::default()
            )
            .message(),
            "the engine stopped serving after a fault: device lost"
        );
    }

    /// A prompt the tokenizer or the chat template refused is the caller's
    /// fault, and its cause reaches the message, chain and all.
    #[test]
    fn prompt_errors_keep_their_cause() {
        let s = engine_status(
            &EngineError::Tokenizer {
                field: Field::Text,
                source: "no piece for byte 0xff".into(),
            },
            FieldScope::default(),
        );
        assert_eq!(s.code(), Code::InvalidArgument);
        assert_eq!(
            s.message(),
            "text could not be tokenized: no piece for byte 0xff"
        );
        let template = kestrel_model::ModelError::Io {
            path: "template.jinja".into(),
            source: std::io::Error::other("the reason underneath"),
        };
        let s = engine_status(
            &EngineError::ChatTemplate {
                field: Field::Messages,
                source: template,
            },
            FieldScope::default(),
        );
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(
            s.message()
                .starts_with("chat.messages could not be rendered"),
            "{}",
            s.message()
        );
        assert!(
            s.message().ends_with("the reason underneath"),
            "{}",
            s.message()
        );
    }

    #[test]
    fn responses_convert_every_field() {
        let resp = GenerateResponse {
            request_id: "r1".into(),
            index: 0,
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
            prompt_logprobs: vec![TokenLogprob {
                token_id: 9,
                text: "p".into(),
                logprob: -1.5,
                top: vec![],
            }],
            objects: None,
        };
        let p = generate_response(resp.clone());
        assert!(p.points.is_empty() && p.boxes.is_empty());
        assert_eq!(p.prompt_logprobs[0].token_id, 9);
        assert_eq!(p.prompt_logprobs[0].logprob, -1.5);
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
        match stream_event(StreamEvent::Done(resp.clone()), 0).event {
            Some(Event::Done(d)) => assert_eq!(d, p),
            other => panic!("{other:?}"),
        }
        match stream_event(
            StreamEvent::Delta {
                text: "é".into(),
                token_ids: vec![9],
                logprobs: vec![],
            },
            2,
        )
        .event
        {
            Some(Event::Delta(d)) => {
                assert_eq!((d.text.as_str(), d.token_ids, d.index), ("é", vec![9], 2))
            }
            other => panic!("{other:?}"),
        }
        // Samples: the first at the top, the others in `samples`, in order.
        let second = GenerateResponse {
            index: 1,
            ..resp.clone()
        };
        let all = generate_responses(vec![resp, second]);
        assert_eq!((all.index, all.samples.len()), (0, 1));
        assert_eq!(all.samples[0].index, 1);
        assert!(all.samples[0].samples.is_empty());
    }

    /// Points and boxes reach the unary response's `points` / `boxes`, and
    /// one object per stream event.
    #[test]
    fn spatial_results_convert() {
        use pb::stream_generate_response::Event;
        use pb::stream_object::Object;
        let p = Point { x: 0.25, y: 0.5 };
        let b = BoundingBox {
            x_min: 0.0,
            y_min: 0.125,
            x_max: 0.5,
            y_max: 1.0,
        };
        let resp = |objects| GenerateResponse {
            request_id: "r".into(),
            index: 0,
            text: String::new(),
            token_ids: vec![5, 5, 0],
            finish_reason: FinishReason::Eos,
            usage: Default::default(),
            timings: Default::default(),
            logprobs: vec![],
            json: None,
            prompt_logprobs: vec![],
            objects: Some(objects),
        };
        let points = generate_response(resp(SpatialResult::Points(vec![p, p])));
        assert_eq!(points.points, vec![pb::Point { x: 0.25, y: 0.5 }; 2]);
        assert!(points.boxes.is_empty());
        let boxes = generate_response(resp(SpatialResult::Boxes(vec![b])));
        assert_eq!(
            boxes.boxes,
            vec![pb::BoundingBox {
                x_min: 0.0,
                y_min: 0.125,
                x_max: 0.5,
                y_max: 1.0
            }]
        );
        assert!(boxes.points.is_empty());
        match stream_event(StreamEvent::Object(SpatialObject::Box(b)), 1).event {
            Some(Event::Object(o)) => {
                assert_eq!(o.index, 1);
                assert_eq!(o.object, Some(Object::Box(boxes.boxes[0])));
            }
            other => panic!("{other:?}"),
        }
        match stream_event(StreamEvent::Object(SpatialObject::Point(p)), 0).event {
            Some(Event::Object(o)) => {
                assert_eq!(o.object, Some(Object::Point(points.points[0])))
            }
            other => panic!("{other:?}"),
        }
        let s = engine_status(
            &EngineError::SpatialFailed {
                source: kestrel_engine::SpatialFailure {
                    objects: SpatialResult::Points(vec![]),
                    cause: kestrel_engine::SpatialError::CoordOutOfRange { value: 2.0 },
                },
                partial: Box::new(resp(SpatialResult::Points(vec![]))),
            },
            FieldScope::default(),
        );
        assert_eq!(
            s.code(),
            Code::Internal,
            "a runtime fault, not the request's"
        );
        assert!(
            s.message().contains("coordinate 2 is outside [0, 1]"),
            "{}",
            s.message()
        );
    }
}
