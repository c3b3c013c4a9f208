//! What is generated from: the completions `prompt` (strings, token ids, or
//! lists of either) and the chat `messages` (roles, text and image content
//! parts, tool calls and results), shapes only. An `image_url` part's data
//! URL is decoded here ([`crate::image_url`]); the image itself is the
//! engine's to decode.

use kestrel_engine::{ChatMessage, Prompt, ToolCall};
use serde_json::Value;

use super::MAX_PROMPTS;
use crate::image_url::decode_image_url;
use crate::openai::error::ApiError;
use crate::openai::tools;

/// An `image_url` content part of a chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::openai) struct ChatImage {
    /// The message it came in.
    pub message: usize,
    /// Its parameter, `messages[i].content[j].image_url`.
    pub param: String,
    /// The bytes its data URL carried.
    pub bytes: Vec<u8>,
}

/// The chat `messages`: their text (with calls and results) and any images.
#[derive(Debug, Clone)]
pub(in crate::openai) struct ChatInput {
    pub messages: Vec<ChatMessage>,
    pub images: Vec<ChatImage>,
}

/// The completions `prompt`: a string, a list of token ids, or a list of
/// either (one prompt each), each with the parameter name engine errors
/// about it should carry. Token ids are checked against the vocabulary by
/// the engine.
pub(super) fn prompts(v: Value) -> Result<Vec<(Prompt, String)>, ApiError> {
    const SHAPE: &str =
        "prompt must be a string, a list of token ids, or a list of strings or of token-id lists";
    let tokens = |v: Value, param: &str| {
        serde_json::from_value::<Vec<u32>>(v).map_err(|_| {
            ApiError::invalid(
                param,
                format!("{param} must be a list of token ids (integers in [0, 2^32)): {SHAPE}"),
            )
        })
    };
    match v {
        Value::String(s) => Ok(vec![(Prompt::Text(s), "prompt".into())]),
        // One prompt of token ids.
        Value::Array(list) if list.first().is_some_and(Value::is_number) => Ok(vec![(
            Prompt::Tokens(tokens(Value::Array(list), "prompt")?),
            "prompt".into(),
        )]),
        Value::Array(list) => {
            if list.is_empty() || list.len() > MAX_PROMPTS {
                return Err(ApiError::invalid(
                    "prompt",
                    format!(
                        "prompt must have 1 to {MAX_PROMPTS} entries, got {}",
                        list.len()
                    ),
                ));
            }
            list.into_iter()
                .enumerate()
                .map(|(i, p)| {
                    let param = format!("prompt[{i}]");
                    match p {
                        Value::String(s) => Ok((Prompt::Text(s), param)),
                        Value::Array(_) => Ok((Prompt::Tokens(tokens(p, &param)?), param)),
                        _ => Err(ApiError::invalid(param, SHAPE)),
                    }
                })
                .collect()
        }
        _ => Err(ApiError::invalid("prompt", SHAPE)),
    }
}

/// A chat message as sent. Fields a client may echo back from a response
/// (`refusal`, `annotations`, `audio`) are accepted and ignored; the legacy
/// `function_call` is rendered like one entry of `tool_calls`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct WireMessage {
    role: String,
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    tool_calls: Option<Vec<WireToolCall>>,
    #[serde(default, rename = "name")]
    _name: Option<String>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default, rename = "refusal")]
    _refusal: Option<Value>,
    #[serde(default, rename = "annotations")]
    _annotations: Option<Value>,
    #[serde(default, rename = "audio")]
    _audio: Option<Value>,
    #[serde(default)]
    function_call: Option<WireFunctionCall>,
}

#[derive(serde::Deserialize)]
struct WireToolCall {
    #[serde(default)]
    id: Option<String>,
    function: WireFunctionCall,
}

#[derive(serde::Deserialize)]
struct WireFunctionCall {
    name: String,
    arguments: String,
}

/// Maps `messages` onto chat messages, calls and results kept structured
/// ([`tools::prepare`] writes them in the model's format), and their
/// images' bytes.
pub(in crate::openai) fn chat_messages(v: Value) -> Result<ChatInput, ApiError> {
    let Value::Array(list) = v else {
        return Err(ApiError::invalid("messages", "messages must be an array"));
    };
    let mut out = Vec::with_capacity(list.len() + 1);
    let mut images = Vec::new();
    for (i, m) in list.into_iter().enumerate() {
        let param = format!("messages[{i}]");
        let m: WireMessage = serde_json::from_value(m)
            .map_err(|e| ApiError::invalid(param.clone(), format!("{param}: {e}")))?;
        let content = match m.content {
            None => String::new(),
            Some(c) => content_text(c, &param, |p, part| {
                images.push(ChatImage {
                    message: i,
                    bytes: image_part(part, &p)?,
                    param: p,
                });
                Ok(())
            })?,
        };
        // OpenAI's newer name for the system role, and the legacy name of
        // a tool's answer.
        let role = match m.role.as_str() {
            "developer" => "system".to_string(),
            "function" => "tool".to_string(),
            _ => m.role,
        };
        let tool_calls = m
            .tool_calls
            .unwrap_or_default()
            .into_iter()
            .map(|c| (c.id, c.function))
            // The legacy `function_call` is one more call.
            .chain(m.function_call.map(|f| (None, f)))
            .enumerate()
            .map(|(j, (id, function))| ToolCall {
                // Templates that show ids need one; a client may omit it.
                id: id.unwrap_or_else(|| format!("call_{i}_{j}")),
                name: function.name,
                arguments: tools::arguments_value(&function.arguments),
            })
            .collect();
        out.push(ChatMessage {
            tool_calls,
            tool_call_id: m.tool_call_id,
            ..ChatMessage::new(role, content)
        });
    }
    Ok(ChatInput {
        messages: out,
        images,
    })
}

/// The bytes of an `image_url` part, `{"type": "image_url", "image_url":
/// {"url": "data:...", "detail"?}}` (or the URL as a plain string, as some
/// clients send it); `param` is the part's `.image_url`.
fn image_part(part: &Value, param: &str) -> Result<Vec<u8>, ApiError> {
    let url = match part.get("image_url") {
        Some(Value::String(url)) => url,
        Some(Value::Object(o)) => match o.get("url") {
            Some(Value::String(url)) => url,
            _ => {
                return Err(ApiError::invalid(
                    format!("{param}.url"),
                    format!("{param}.url must be a string (a data URL)"),
                ))
            }
        },
        _ => {
            return Err(ApiError::invalid(
                param,
                format!("{param} must be {{\"url\": \"data:image/...;base64,...\"}}"),
            ))
        }
    };
    decode_image_url(url).map_err(|e| ApiError::invalid(param, format!("{param} {e}")))
}

/// Message content: a string, or text content parts joined; each
/// `image_url` part goes to `image(its parameter, the part)`.
fn content_text(
    c: Value,
    param: &str,
    mut image: impl FnMut(String, &Value) -> Result<(), ApiError>,
) -> Result<String, ApiError> {
    match c {
        Value::String(s) => Ok(s),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let p = format!("{param}.content[{j}]");
                match part.get("type").and_then(Value::as_str) {
                    Some("text") => match part.get("text") {
                        Some(Value::String(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                format!("{p}.text"),
                                "a text part needs a string `text`",
                            ))
                        }
                    },
                    Some("image_url") => image(format!("{p}.image_url"), part)?,
                    Some(other) => {
                        return Err(ApiError::unsupported(
                            &format!("{p}.type"),
                            &format!("content of type {other:?}"),
                        ))
                    }
                    None => {
                        return Err(ApiError::invalid(
                            format!("{p}.type"),
                            "a content part needs a string `type`",
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::invalid(
            format!("{param}.content"),
            "content must be a string or a list of content parts",
        )),
    }
}
