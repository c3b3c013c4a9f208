//! OpenAI request JSON -> [`Plan`]: the engine requests to submit and how
//! to shape their answers.
//!
//! A chat with an `image_url` content part (a data URL; one per request)
//! is a vision query: the image, with the text of the last user message as
//! its question (`Prompt::Vision`).
//!
//! Shapes only: every range rule lives in `kestrel_engine::validate`, which
//! names a `Field` that [`ParamNames`] spells back the OpenAI way. The
//! rules here are the ones no engine type can express: JSON types, unknown
//! parameters (400 naming them), parameters accepted and ignored because
//! they cannot change a text model's output ([`ignored`]), parameters
//! OpenAI defines that Kestrel cannot honour (400 `unsupported_parameter`),
//! `best_of` (only `n` itself: every sample is returned; `n`'s range is
//! the engine's, [`MAX_N`]), which constraint
//! sources may combine, the legacy `functions` as tools, and the tool
//! format. Pure, no I/O.
//!
//! This file holds the [`Plan`], the parameter reader ([`Fields`]) and
//! [`parse`] itself, with the parameters it takes and ignores;
//! `functions.rs` the chat's tools and legacy functions, `constraint.rs` the
//! structured-output sources, `prompt.rs` the completions prompt and the chat
//! messages.

mod constraint;
mod functions;
mod prompt;
#[cfg(test)]
mod tests;

use kestrel_engine::{
    Constraint, GenerateRequest, Prompt, SamplingOptions, Speculation, VisionTask,
};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::error::{ApiError, ParamNames};
use super::schema::close_objects;
use super::tools::{self, ToolFormat, ToolSet};
use constraint::constraint;
use functions::chat_tools;
use prompt::prompts;
pub(super) use prompt::{chat_messages, ChatInput};

/// Most choices per prompt (`n`): the engine's rule.
pub use kestrel_engine::validate::MAX_N;

/// Most prompts in one completions request.
pub const MAX_PROMPTS: usize = 64;

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// A parsed request: what to submit and how to answer.
#[derive(Debug, Clone)]
pub struct Plan {
    pub endpoint: Endpoint,
    /// One engine request per prompt, each with `n` ([`Plan::n`]) samples:
    /// choice `p * n + i` is prompt `p`'s sample `i` (the engine samples it
    /// with `seed + i`, `kestrel_engine::validate::sample_seed`).
    pub prompts: Vec<GenerateRequest>,
    /// How each prompt's parameters are spelled, for engine errors.
    pub names: Vec<ParamNames>,
    pub n: u32,
    pub stream: bool,
    pub include_usage: bool,
    /// Report logprobs in the answer.
    pub logprobs: bool,
    /// Completions' `echo`: each choice's text starts with its prompt.
    pub echo: bool,
    /// Tools the model may call (chat only).
    pub tools: Option<ToolSet>,
}

impl Plan {
    /// Choices in the answer.
    pub fn choices(&self) -> usize {
        self.prompts.len() * self.n as usize
    }
}

/// A request object whose fields are taken one by one, each type error
/// naming its field; what is left at the end is an unknown parameter.
pub(super) struct Fields(Map<String, Value>);

impl Fields {
    pub(super) fn parse(body: &[u8]) -> Result<Self, ApiError> {
        match serde_json::from_slice::<Value>(body) {
            Ok(Value::Object(map)) => Ok(Self(map)),
            Ok(_) => Err(ApiError::bad_body("the request body must be a JSON object")),
            Err(e) => Err(ApiError::bad_body(format!(
                "the request body is not valid JSON: {e}"
            ))),
        }
    }

    /// The field's value; JSON `null` is "not given".
    pub(super) fn take<T: DeserializeOwned>(&mut self, name: &str) -> Result<Option<T>, ApiError> {
        match self.0.remove(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => serde_json::from_value(v)
                .map(Some)
                .map_err(|e| ApiError::invalid(name, format!("{name}: {e}"))),
        }
    }

    pub(super) fn raw(&mut self, name: &str) -> Option<Value> {
        self.0.remove(name).filter(|v| !v.is_null())
    }

    pub(super) fn finish(self) -> Result<(), ApiError> {
        match self.0.keys().next() {
            None => Ok(()),
            Some(k) => Err(ApiError::invalid(
                k.clone(),
                format!("unrecognized request argument supplied: {k}"),
            )),
        }
    }
}

/// Parses a request body for `endpoint`; `served` is the model id served,
/// `tool_format` how it writes tool calls.
pub fn parse(
    endpoint: Endpoint,
    body: &[u8],
    served: &str,
    tool_format: &ToolFormat,
) -> Result<Plan, ApiError> {
    let mut f = Fields::parse(body)?;
    if let Some(model) = f.take::<String>("model")? {
        if model != served {
            return Err(ApiError::model_not_found(&model, served));
        }
    }
    let mut names = ParamNames {
        max_tokens: None,
        top_logprobs: match endpoint {
            Endpoint::Chat => "top_logprobs",
            Endpoint::Completions => "logprobs",
        },
        stop_is_string: false,
        constraint: "response_format",
        prompt: String::new(),
        message_offset: 0,
        image: None,
    };

    // Output budget: OpenAI's two spellings.
    let max_completion = match endpoint {
        Endpoint::Chat => f.take::<u32>("max_completion_tokens")?,
        Endpoint::Completions => None,
    };
    let max_tokens = f.take::<u32>("max_tokens")?;
    let max_new_tokens = match (max_completion, max_tokens) {
        (Some(m), _) => {
            names.max_tokens = Some("max_completion_tokens");
            Some(m)
        }
        (None, Some(m)) => {
            names.max_tokens = Some("max_tokens");
            Some(m)
        }
        (None, None) => None,
    };

    // Its range is the engine's rule (a 400 naming `n` at submission).
    let n = f.take::<u32>("n")?.unwrap_or(1);
    // Every sample is returned: `best_of` can only be `n` itself.
    if let Some(best_of) = f.take::<u32>("best_of")? {
        if best_of != n {
            return Err(ApiError::unsupported(
                "best_of",
                &format!("best_of other than n (got {best_of}, n is {n})"),
            ));
        }
    }
    ignored(&mut f, endpoint)?;
    let stream = f.take::<bool>("stream")?.unwrap_or(false);
    let include_usage = match f.raw("stream_options") {
        None => false,
        Some(v) => {
            let o: StreamOptions = serde_json::from_value(v)
                .map_err(|e| ApiError::invalid("stream_options", format!("stream_options: {e}")))?;
            o.include_usage.unwrap_or(false)
        }
    };

    let (logprobs, top_logprobs) = match endpoint {
        Endpoint::Chat => {
            let want = f.take::<bool>("logprobs")?.unwrap_or(false);
            let top = f.take::<u32>("top_logprobs")?.unwrap_or(0);
            (want || top > 0, top)
        }
        // The completions form: an integer count of alternatives.
        Endpoint::Completions => match f.take::<u32>("logprobs")? {
            None => (false, 0),
            Some(k) => (true, k),
        },
    };

    // Keys are token ids written as strings; ranges are the engine's.
    let logit_bias = f
        .take::<Map<String, Value>>("logit_bias")?
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| match (k.parse::<u32>(), v.as_f64()) {
            (Ok(t), Some(b)) => Ok((t, b as f32)),
            (Err(_), _) => Err(ApiError::invalid(
                "logit_bias",
                format!("logit_bias keys must be token ids, got {k:?}"),
            )),
            (_, None) => Err(ApiError::invalid(
                "logit_bias",
                format!("logit_bias[{k}] must be a number, got {v}"),
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;

    let (stop, stop_is_string) = match f.raw("stop") {
        None => (Vec::new(), false),
        Some(Value::String(s)) => (vec![s], true),
        Some(v) => (
            serde_json::from_value::<Vec<String>>(v).map_err(|_| {
                ApiError::invalid("stop", "stop must be a string or a list of strings")
            })?,
            false,
        ),
    };
    names.stop_is_string = stop_is_string;

    let top_k = match f.take::<i64>("top_k")? {
        None => None,
        // vLLM's spelling of "disabled".
        Some(-1) => Some(0),
        Some(k) => Some(u32::try_from(k).map_err(|_| {
            ApiError::invalid(
                "top_k",
                format!("top_k must be -1 or in [0, {}], got {k}", u32::MAX),
            )
        })?),
    };
    let seed = match f.raw("seed") {
        None => None,
        // OpenAI's seed is any integer; a negative one is taken by its
        // two's-complement bits (still one fixed seed).
        Some(v) => Some(
            v.as_u64()
                .or_else(|| v.as_i64().map(|s| s as u64))
                .ok_or_else(|| ApiError::invalid("seed", "seed must be an integer"))?,
        ),
    };
    let sampling = SamplingOptions {
        temperature: f.take("temperature")?,
        top_k,
        top_p: f.take("top_p")?,
        min_p: f.take("min_p")?,
        repetition_penalty: f.take("repetition_penalty")?,
        frequency_penalty: f.take("frequency_penalty")?,
        presence_penalty: f.take("presence_penalty")?,
        seed,
        logprobs,
        top_logprobs,
        logit_bias,
        prompt_logprobs: None,
    };
    let stop_token_ids = f.take::<Vec<u32>>("stop_token_ids")?.unwrap_or_default();
    let ignore_eos = f.take::<bool>("ignore_eos")?.unwrap_or(false);
    let min_tokens = f.take::<u32>("min_tokens")?.unwrap_or(0);
    // Completions' `echo`: the answer's text starts with the prompt's.
    let echo = match endpoint {
        Endpoint::Completions => f.take::<bool>("echo")?.unwrap_or(false),
        Endpoint::Chat => false,
    };
    // With echo, the logprobs object starts with the prompt tokens' (the
    // engine scores the prompt). They arrive with the finished request, so
    // a stream cannot put them first.
    let mut sampling = sampling;
    if echo && logprobs {
        if stream {
            return Err(ApiError::unsupported(
                "echo",
                "echo: true with logprobs and stream: true (prompt logprobs are not streamed)",
            ));
        }
        sampling.prompt_logprobs = Some(top_logprobs);
    }

    // Kestrel's extension: JSON Schemas (response_format, guided_json,
    // structured_outputs.json, tool parameters) allow unlisted keys only
    // where they say so, unless the request asks for plain JSON Schema.
    let plain_json_schema = f.take::<bool>("plain_json_schema")?.unwrap_or(false);
    let constraint = constraint(&mut f)?.map(|(c, param)| match c {
        Constraint::JsonSchema(s) if !plain_json_schema => {
            (Constraint::JsonSchema(close_objects(s)), param)
        }
        c => (c, param),
    });
    let tools = match endpoint {
        Endpoint::Chat => chat_tools(&mut f, tool_format)?.map(|t| ToolSet {
            closed_objects: !plain_json_schema,
            ..t
        }),
        Endpoint::Completions => None,
    };
    let constraint = match (&tools, constraint) {
        (Some(_), Some((_, param))) => {
            return Err(ApiError::invalid(
                param,
                format!("{param} cannot be combined with tools (unless tool_choice is \"none\")"),
            ))
        }
        (Some(t), None) => {
            names.constraint = "tools";
            Some(Constraint::Grammar(t.grammar()))
        }
        (None, Some((c, param))) => {
            names.constraint = param;
            Some(c)
        }
        (None, None) => None,
    };

    let inputs: Vec<(Prompt, String)> = match endpoint {
        Endpoint::Chat => {
            let messages = f
                .raw("messages")
                .ok_or_else(|| ApiError::invalid("messages", "messages is required"))?;
            let chat = chat_messages(messages)?;
            if chat.images.is_empty() {
                let (prompt, offset) = tools::prepare(tool_format, chat.messages, tools.as_ref());
                names.message_offset = offset;
                vec![(prompt, "messages".into())]
            } else {
                if tools.is_some() {
                    return Err(ApiError::unsupported(
                        "tools",
                        "tools with an image (an image chat is answered as a Moondream query)",
                    ));
                }
                let (prompt, question, image) = image_query(chat)?;
                names.image = Some(image);
                vec![(prompt, question)]
            }
        }
        Endpoint::Completions => prompts(
            f.raw("prompt")
                .ok_or_else(|| ApiError::invalid("prompt", "prompt is required"))?,
        )?,
    };
    f.finish()?;

    let mut requests = Vec::with_capacity(inputs.len());
    let mut all_names = Vec::with_capacity(inputs.len());
    for (input, prompt_param) in inputs {
        requests.push(GenerateRequest {
            request_id: None,
            input,
            max_new_tokens,
            sampling: sampling.clone(),
            stop: stop.clone(),
            stop_token_ids: stop_token_ids.clone(),
            ignore_eos,
            min_tokens,
            constraint: constraint.clone(),
            // OpenAI has no such field: the server's default applies.
            speculate: Speculation::Default,
            n: Some(n),
        });
        all_names.push(ParamNames {
            prompt: prompt_param,
            ..names.clone()
        });
    }
    Ok(Plan {
        endpoint,
        prompts: requests,
        names: all_names,
        n,
        stream,
        include_usage,
        logprobs,
        echo,
        tools,
    })
}

/// An image chat as the engine's vision query: the one image, and the
/// text parts of the last user message as the question (earlier turns are
/// not part of a Moondream prompt). Returns the prompt with the parameters
/// that name its question and its image.
fn image_query(chat: prompt::ChatInput) -> Result<(Prompt, String, String), ApiError> {
    if let Some(second) = chat.images.get(1) {
        return Err(ApiError::invalid(
            second.param.clone(),
            format!(
                "{}: at most one image per request, got {}",
                second.param,
                chat.images.len()
            ),
        ));
    }
    let Some(image) = chat.images.into_iter().next() else {
        unreachable!("image_query is called with an image");
    };
    let role = &chat.messages[image.message].role;
    if role != "user" {
        let param = format!("messages[{}].role", image.message);
        return Err(ApiError::invalid(
            param.clone(),
            format!("{param}: an image must come in a user message, not {role:?}"),
        ));
    }
    // The image's own message is a user message, so there is a last one.
    let (last, question) = chat
        .messages
        .iter()
        .enumerate()
        .rev()
        .find(|(_, m)| m.role == "user")
        .map(|(i, m)| (i, m.content.clone()))
        .unwrap_or((image.message, String::new()));
    let prompt = Prompt::Vision {
        image: image.bytes,
        task: VisionTask::Query { question },
    };
    Ok((prompt, format!("messages[{last}].content"), image.param))
}

/// `reasoning_effort` values OpenAI defines; every Kestrel model answers
/// without a reasoning phase, so any of them means the same.
const REASONING_EFFORTS: [&str; 6] = ["none", "minimal", "low", "medium", "high", "xhigh"];

/// `verbosity` values OpenAI defines (a hint to models trained for it).
const VERBOSITIES: [&str; 3] = ["low", "medium", "high"];

/// Takes the parameters that cannot change a text model's output (each
/// still type-checked, so a malformed one is a 400 naming it) and refuses
/// the ones that would need what Kestrel does not have (audio output,
/// predicted outputs, web search, completions' `suffix`).
fn ignored(f: &mut Fields, endpoint: Endpoint) -> Result<(), ApiError> {
    f.take::<String>("user")?;
    f.take::<bool>("store")?;
    if endpoint == Endpoint::Completions {
        if f.take::<String>("suffix")?.is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::unsupported(
                "suffix",
                "suffix (text after the completion)",
            ));
        }
        return Ok(());
    }
    f.take::<Map<String, Value>>("metadata")?;
    for name in [
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
    ] {
        f.take::<String>(name)?;
    }
    let one_of = |f: &mut Fields, name: &str, allowed: &[&str]| -> Result<(), ApiError> {
        match f.take::<String>(name)? {
            Some(v) if !allowed.contains(&v.as_str()) => Err(ApiError::invalid(
                name,
                format!("{name} must be one of {}, got {v:?}", allowed.join(", ")),
            )),
            _ => Ok(()),
        }
    };
    one_of(f, "reasoning_effort", &REASONING_EFFORTS)?;
    one_of(f, "verbosity", &VERBOSITIES)?;
    if let Some(m) = f.take::<Vec<String>>("modalities")? {
        if m.iter().any(|m| m != "text") {
            return Err(ApiError::unsupported(
                "modalities",
                "an output modality other than \"text\"",
            ));
        }
    }
    for (name, what) in [
        ("audio", "audio output"),
        ("prediction", "predicted output"),
        ("web_search_options", "web search"),
    ] {
        if f.raw(name).is_some() {
            return Err(ApiError::unsupported(name, what));
        }
    }
    Ok(())
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    include_usage: Option<bool>,
    #[allow(dead_code)]
    continuous_usage_stats: Option<bool>,
}
