//! vLLM's `POST /tokenize` and `POST /detokenize`: the served model's
//! tokenizer and chat template over HTTP, in vLLM's request and response
//! shapes.
//!
//! `/tokenize` takes `{"prompt", "add_special_tokens" = true}` or
//! `{"messages", "add_generation_prompt" = true, "add_special_tokens" =
//! false}` (plus `model` and `return_token_strs`) and answers `{"count",
//! "max_model_len", "tokens", "token_strs"}`; `/detokenize` takes
//! `{"tokens"}` and answers `{"prompt"}`. The prompt is tokenized exactly as
//! a generation request's would be, so `tokens` sent back as a completions
//! `prompt` is the same request. Work runs on the blocking pool.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kestrel_engine::{EngineError, Field};
use serde_json::json;

use super::error::{json_response, ApiError, ParamNames};
use super::request::{chat_messages, Fields};
use super::tools::{self, ToolFormat};
use super::App;

/// What to tokenize.
enum Input {
    Text(String),
    /// A conversation as a chat request renders it (tool calls and results
    /// in the model's format).
    Chat {
        messages: Vec<kestrel_engine::ChatMessage>,
        tools: Vec<serde_json::Value>,
    },
}

/// A tokenize request after its fields were taken.
struct TokenizeRequest {
    input: Input,
    add_special_tokens: bool,
    add_generation_prompt: bool,
    return_token_strs: bool,
}

/// A tokenize call's messages, which must be text: an image's tokens are
/// the model's, not the tokenizer's.
fn text_only(
    chat: super::request::ChatInput,
) -> Result<Vec<kestrel_engine::ChatMessage>, ApiError> {
    match chat.images.first() {
        None => Ok(chat.messages),
        Some(image) => Err(ApiError::unsupported(
            &image.param,
            "tokenizing an image content part",
        )),
    }
}

fn check_model(f: &mut Fields, served: &str) -> Result<(), ApiError> {
    match f.take::<String>("model")? {
        Some(model) if model != served => Err(ApiError::model_not_found(&model, served)),
        _ => Ok(()),
    }
}

fn parse_tokenize(
    body: &[u8],
    served: &str,
    format: &ToolFormat,
) -> Result<TokenizeRequest, ApiError> {
    let mut f = Fields::parse(body)?;
    check_model(&mut f, served)?;
    let return_token_strs = f.take::<bool>("return_token_strs")?.unwrap_or(false);
    let prompt = f.take::<String>("prompt")?;
    let messages = f.raw("messages");
    let req = match (prompt, messages) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "messages",
                "give either prompt or messages, not both",
            ))
        }
        (None, None) => {
            return Err(ApiError::invalid(
                "prompt",
                "prompt or messages is required",
            ))
        }
        (Some(text), None) => TokenizeRequest {
            input: Input::Text(text),
            add_special_tokens: f.take::<bool>("add_special_tokens")?.unwrap_or(true),
            add_generation_prompt: false,
            return_token_strs,
        },
        (None, Some(messages)) => TokenizeRequest {
            input: match tools::prepare(format, text_only(chat_messages(messages)?)?, None).0 {
                kestrel_engine::Prompt::Chat { messages, tools } => Input::Chat { messages, tools },
                _ => unreachable!("tools::prepare always makes a chat prompt"),
            },
            // The chat template writes BOS itself.
            add_special_tokens: f.take::<bool>("add_special_tokens")?.unwrap_or(false),
            add_generation_prompt: f.take::<bool>("add_generation_prompt")?.unwrap_or(true),
            return_token_strs,
        },
    };
    f.finish()?;
    Ok(req)
}

/// The parameter an engine error about a tokenize call blames.
fn tokenize_error(e: &EngineError, input: &Input) -> ApiError {
    let prompt = match input {
        Input::Text(_) => "prompt",
        Input::Chat { .. } => "messages",
    };
    let names = ParamNames {
        max_tokens: None,
        top_logprobs: "logprobs",
        stop_is_string: false,
        constraint: "",
        prompt: prompt.into(),
        message_offset: 0,
        image: None,
    };
    match e {
        EngineError::InvalidArgument {
            field: Field::Text,
            message,
        } => ApiError::invalid(prompt, format!("{prompt} {message}")),
        EngineError::Tokenizer {
            field: Field::Text,
            source,
        } => ApiError::invalid(
            prompt,
            format!(
                "{prompt} could not be tokenized: {}",
                kestrel_engine::error_chain(source.as_ref())
            ),
        ),
        _ => ApiError::engine(e, &names),
    }
}

pub(super) async fn tokenize(app: &App, body: &[u8]) -> Response {
    let req = match parse_tokenize(body, &app.model_id, &app.tool_format) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let engine = app.engine.clone();
    let max_model_len = engine.model_info().context_length;
    let run = move || {
        let ids = match &req.input {
            Input::Text(text) => engine.tokenize(text, req.add_special_tokens),
            Input::Chat { messages, tools } => engine
                .model()
                .render_chat(messages, tools, req.add_generation_prompt)
                .and_then(|text| engine.tokenize(&text, req.add_special_tokens)),
        }
        .map_err(|e| tokenize_error(&e, &req.input))?;
        let mut body = json!({
            "count": ids.len(),
            "max_model_len": max_model_len,
            "tokens": ids,
            "token_strs": null,
        });
        if req.return_token_strs {
            let tokenizer = engine.model().tokenizer();
            body["token_strs"] = ids
                .iter()
                .map(|&id| tokenizer.id_to_token(id).unwrap_or_default())
                .collect();
        }
        Ok::<_, ApiError>(body)
    };
    answer(tokio::task::spawn_blocking(run).await)
}

pub(super) async fn detokenize(app: &App, body: &[u8]) -> Response {
    let parsed = (|| {
        let mut f = Fields::parse(body)?;
        check_model(&mut f, &app.model_id)?;
        let tokens = f
            .take::<Vec<u32>>("tokens")?
            .ok_or_else(|| ApiError::invalid("tokens", "tokens is required"))?;
        f.finish()?;
        Ok::<_, ApiError>(tokens)
    })();
    let tokens = match parsed {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    let engine = app.engine.clone();
    let run = move || match engine.detokenize(&tokens, false) {
        Ok(text) => Ok(json!({ "prompt": text })),
        Err(EngineError::InvalidArgument {
            field: Field::TokenId(i),
            message,
        }) => Err(ApiError::invalid(
            format!("tokens[{i}]"),
            format!("tokens[{i}] {message}"),
        )),
        Err(e) => Err(ApiError::invalid(
            "tokens",
            format!("tokens: {}", kestrel_engine::error_chain(&e)),
        )),
    };
    answer(tokio::task::spawn_blocking(run).await)
}

fn answer(r: Result<Result<serde_json::Value, ApiError>, tokio::task::JoinError>) -> Response {
    match r {
        Ok(Ok(body)) => json_response(StatusCode::OK, &body),
        Ok(Err(e)) => e.into_response(),
        // The blocking task panicked or the runtime is shutting down.
        Err(_) => ApiError::unavailable("the server is shutting down").into_response(),
    }
}
