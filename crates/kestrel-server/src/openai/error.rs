//! [`ApiError`]: every failure of the HTTP API in OpenAI's error shape,
//! `{"error": {"message", "type", "param", "code"}}`, with its HTTP status.
//!
//! Engine errors map here once ([`ApiError::engine`]); the engine's
//! [`Field`] becomes OpenAI's parameter name through [`ParamNames`], which
//! remembers how the request spelled each field (`max_tokens` or
//! `max_completion_tokens`, which constraint source was used, ...).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kestrel_engine::{error_chain, EngineError, Field};
use serde_json::json;

/// An HTTP API error: status, OpenAI's `type`, message, `param`, `code`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type` (`invalid_request_error`, `server_error`, ...).
    pub kind: &'static str,
    pub message: String,
    /// The request parameter at fault, in OpenAI's spelling.
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 naming `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some(param.into()),
            code: None,
        }
    }

    /// A 400 about the request as a whole (malformed JSON, not an object).
    pub fn bad_body(message: impl Into<String>) -> Self {
        Self {
            param: None,
            ..Self::invalid("", message)
        }
    }

    /// A 400 for a parameter OpenAI defines that Kestrel does not implement.
    pub fn unsupported(param: &str, what: &str) -> Self {
        Self {
            code: Some("unsupported_parameter"),
            ..Self::invalid(
                param,
                format!("{param}: {what} is not supported by Kestrel"),
            )
        }
    }

    /// 404 for a model id other than the served one.
    pub fn model_not_found(requested: &str, served: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            code: Some("model_not_found"),
            ..Self::invalid(
                "model",
                format!("The model `{requested}` does not exist; this server serves `{served}`"),
            )
        }
    }

    /// 404 for an unknown path.
    pub fn no_route(path: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            param: None,
            code: Some("unknown_url"),
            ..Self::invalid("", format!("Unknown request URL: {path}"))
        }
    }

    /// 405 for a known path with the wrong method.
    pub fn method_not_allowed() -> Self {
        Self {
            status: StatusCode::METHOD_NOT_ALLOWED,
            param: None,
            code: Some("method_not_allowed"),
            ..Self::invalid("", "method not allowed for this URL")
        }
    }

    /// 413: the body is larger than the cap (checked before parsing).
    pub fn too_large(limit: usize) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            param: None,
            code: Some("request_too_large"),
            ..Self::invalid("", format!("the request body exceeds {limit} bytes"))
        }
    }

    /// 503: the engine is not serving.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "service_unavailable_error",
            message: message.into(),
            param: None,
            code: Some("engine_not_serving"),
        }
    }

    /// Maps an engine error. Argument errors name the parameter as the
    /// request spelled it (see [`ParamNames`], and the Moondream API's
    /// names).
    pub fn engine(e: &EngineError, names: &impl FieldNames) -> Self {
        match e {
            EngineError::InvalidArgument { field, message } => {
                let param = names.param(*field);
                Self::invalid(param.clone(), format!("{param} {message}"))
            }
            EngineError::InvalidConstraint { field, source } => {
                let param = names.param(*field);
                Self::invalid(param.clone(), format!("{param} {}", error_chain(source)))
            }
            EngineError::ChatTemplate { field, source } => {
                let param = names.param(*field);
                let why = error_chain(source);
                let message =
                    format!("{param} could not be rendered by the model's chat template: {why}");
                Self::invalid(param, message)
            }
            EngineError::Tokenizer { field, source } => {
                let param = names.param(*field);
                let why = error_chain(source.as_ref());
                Self::invalid(
                    param.clone(),
                    format!("{param} could not be tokenized: {why}"),
                )
            }
            EngineError::InvalidImage { source } => {
                let param = names.param(Field::Image);
                Self::invalid(param.clone(), format!("{param}: {}", error_chain(source)))
            }
            EngineError::NoChatTemplate => Self {
                code: Some("no_chat_template"),
                ..Self::invalid(names.param(Field::Messages), error_chain(e))
            },
            EngineError::ContextOverflow { .. } => Self {
                code: Some("context_length_exceeded"),
                ..Self::invalid(names.overflow_param(), error_chain(e))
            },
            EngineError::QueueFull { .. } => Self {
                status: StatusCode::TOO_MANY_REQUESTS,
                kind: "rate_limit_error",
                message: error_chain(e),
                param: None,
                code: Some("queue_full"),
            },
            EngineError::Fatal(_)
            | EngineError::Stopped
            | EngineError::ShuttingDown
            | EngineError::BackendUnavailable { .. } => Self::unavailable(error_chain(e)),
            EngineError::ConstraintFailed { field, source, .. } => {
                let param = names.param(*field);
                let why = error_chain(source);
                Self {
                    code: Some("constraint_failed"),
                    ..Self::invalid(
                        param.clone(),
                        format!("{param} stopped being satisfiable mid-generation: {why}"),
                    )
                }
            }
            // The runtime's fault, not the request's (see the engine's docs).
            EngineError::RequestFailed(_)
            | EngineError::SpatialFailed { .. }
            | EngineError::Spawn(_)
            | EngineError::ModelLoad(_)
            | EngineError::SkillSetup(_) => Self::internal(error_chain(e)),
        }
    }

    /// A request aborted by the server (shutdown past its grace period).
    pub fn aborted() -> Self {
        Self::unavailable("the request was aborted: the server is shutting down")
    }

    fn internal(message: String) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message,
            param: None,
            code: None,
        }
    }

    /// The JSON body, `{"error": {...}}`.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json_response(self.status, &self.body())
    }
}

/// A JSON response with `status`.
pub(crate) fn json_response(status: StatusCode, body: &serde_json::Value) -> Response {
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// How one HTTP API spells the engine's fields in a request: OpenAI's
/// ([`ParamNames`]) or the Moondream API's.
pub trait FieldNames {
    /// The request's name of an engine field.
    fn param(&self, field: Field) -> String;

    /// The parameter blamed for a context overflow.
    fn overflow_param(&self) -> String;
}

/// How a request spelled the fields the engine may complain about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamNames {
    /// `max_tokens` or `max_completion_tokens` (`None`: neither was sent).
    pub max_tokens: Option<&'static str>,
    /// `top_logprobs` (chat) or `logprobs` (completions).
    pub top_logprobs: &'static str,
    /// `stop` was one string, not a list: its entry is `stop` itself.
    pub stop_is_string: bool,
    /// The parameter the constraint came from (`response_format...`,
    /// `guided_json`, `tools`, ...).
    pub constraint: &'static str,
    /// The prompt's parameter: `messages`, `prompt` or `prompt[i]`.
    pub prompt: String,
    /// Messages the server put in front of the client's (a tools system
    /// prompt): engine message indices are this much larger.
    pub message_offset: usize,
    /// The image's parameter (`messages[i].content[j].image_url`), when the
    /// chat has one; its text is the question.
    pub image: Option<String>,
}

impl FieldNames for ParamNames {
    /// OpenAI's name of an engine field for this request.
    fn param(&self, field: Field) -> String {
        match field {
            Field::Prompt | Field::Messages => self.prompt.clone(),
            Field::Image => self.image.clone().unwrap_or_else(|| "image_url".into()),
            // An image chat's question is its last user message's text.
            Field::Question => self.prompt.clone(),
            Field::MessageRole(i) => {
                format!("messages[{}].role", i.saturating_sub(self.message_offset))
            }
            Field::MaxNewTokens => self.max_tokens.unwrap_or("max_tokens").into(),
            Field::TopLogprobs => self.top_logprobs.into(),
            // Only completions' echo with logprobs asks the engine for them.
            Field::PromptLogprobs => "echo".into(),
            Field::StopEntry(_) if self.stop_is_string => "stop".into(),
            Field::Constraint
            | Field::JsonSchema
            | Field::Regex
            | Field::Choices
            | Field::Grammar => self.constraint.into(),
            Field::Choice(i) => format!("{}[{i}]", self.constraint),
            // OpenAI names the map; the message names the token.
            Field::LogitBiasToken(_) => "logit_bias".into(),
            // Same spelling as the engine's: temperature, top_p, min_p,
            // repetition_penalty, frequency/presence_penalty, stop,
            // stop[i], stop_token_ids[i], ...
            other => other.to_string(),
        }
    }

    /// The output budget if the client set one, else the prompt.
    fn overflow_param(&self) -> String {
        self.max_tokens
            .map_or_else(|| self.prompt.clone(), str::to_string)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> ParamNames {
        ParamNames {
            max_tokens: Some("max_completion_tokens"),
            top_logprobs: "top_logprobs",
            stop_is_string: true,
            constraint: "response_format",
            prompt: "messages".into(),
            message_offset: 1,
            image: Some("messages[1].content[0].image_url".into()),
        }
    }

    #[test]
    fn engine_fields_take_openai_names() {
        let n = names();
        assert_eq!(n.param(Field::MaxNewTokens), "max_completion_tokens");
        assert_eq!(n.param(Field::MessageRole(3)), "messages[2].role");
        assert_eq!(n.param(Field::StopEntry(0)), "stop");
        assert_eq!(n.param(Field::JsonSchema), "response_format");
        assert_eq!(n.param(Field::Temperature), "temperature");
        assert_eq!(n.param(Field::Messages), "messages");
        assert_eq!(n.param(Field::Image), "messages[1].content[0].image_url");
        assert_eq!(n.param(Field::Question), "messages");
        let e = ApiError::engine(
            &EngineError::InvalidArgument {
                field: Field::TopP,
                message: "must be in (0, 1], got 2".into(),
            },
            &n,
        );
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("top_p"));
        assert_eq!(e.message, "top_p must be in (0, 1], got 2");
    }

    /// A template's or tokenizer's refusal is a 400 on the prompt's
    /// parameter, its cause in the message.
    #[test]
    fn prompt_errors_keep_their_cause() {
        let e = ApiError::engine(
            &EngineError::ChatTemplate {
                field: Field::Messages,
                source: kestrel_model::ModelError::Io {
                    path: "template.jinja".into(),
                    source: std::io::Error::other("the reason underneath"),
                },
            },
            &names(),
        );
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(
            e.message.ends_with("the reason underneath"),
            "{}",
            e.message
        );
    }

    #[test]
    fn engine_errors_take_http_statuses() {
        let n = names();
        let status = |e: EngineError| ApiError::engine(&e, &n).status;
        assert_eq!(
            status(EngineError::QueueFull { limit: 1 }),
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(
            status(EngineError::ShuttingDown),
            StatusCode::SERVICE_UNAVAILABLE
        );
        let overflow = ApiError::engine(
            &EngineError::ContextOverflow {
                prompt_tokens: 10,
                max_new_tokens: 10,
                limit: 12,
            },
            &n,
        );
        assert_eq!(overflow.status, StatusCode::BAD_REQUEST);
        assert_eq!(overflow.param.as_deref(), Some("max_completion_tokens"));
        assert_eq!(overflow.code, Some("context_length_exceeded"));
        let body = ApiError::model_not_found("gpt-4", "smol").body();
        assert_eq!(body["error"]["code"], "model_not_found");
        assert_eq!(body["error"]["param"], "model");
    }
}
