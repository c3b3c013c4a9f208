//! OpenAI request JSON -> [`Plan`]: the engine requests to submit and how
//! to shape their answers.
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

use kestrel_engine::{
    ChatMessage, Constraint, GenerateRequest, Prompt, SamplingOptions, Speculation, ToolCall,
};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::error::{ApiError, ParamNames};
use super::tools::{self, ToolFormat, ToolSet};

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

    let constraint = constraint(&mut f)?;
    let tools = match endpoint {
        Endpoint::Chat => chat_tools(&mut f, tool_format)?,
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
            let (prompt, offset) =
                tools::prepare(tool_format, chat_messages(messages)?, tools.as_ref());
            names.message_offset = offset;
            vec![(prompt, "messages".into())]
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

/// The chat's tools: `tools` / `tool_choice`, or the legacy `functions` /
/// `function_call` mapped onto them (one `ToolSet` either way; errors name
/// the legacy parameters). The two forms do not mix.
fn chat_tools(f: &mut Fields, format: &ToolFormat) -> Result<Option<ToolSet>, ApiError> {
    let parallel = f.take("parallel_tool_calls")?;
    let (tools, choice) = (f.raw("tools"), f.raw("tool_choice"));
    let (functions, function_call) = (f.raw("functions"), f.raw("function_call"));
    if functions.is_none() && function_call.is_none() {
        return tools::parse(tools, choice, parallel, format);
    }
    if tools.is_some() || choice.is_some() {
        let (param, other) = match (&functions, &tools) {
            (Some(_), Some(_)) => ("functions", "tools"),
            (Some(_), None) => ("functions", "tool_choice"),
            (None, _) if tools.is_some() => ("function_call", "tools"),
            (None, _) => ("function_call", "tool_choice"),
        };
        return Err(ApiError::invalid(
            param,
            format!(
                "{param} (deprecated) cannot be combined with {other}; send tools and tool_choice"
            ),
        ));
    }
    let Some(functions) = functions else {
        return Err(ApiError::invalid(
            "function_call",
            "function_call needs functions",
        ));
    };
    let Value::Array(list) = functions else {
        return Err(ApiError::invalid("functions", "functions must be an array"));
    };
    let tools = list
        .into_iter()
        .map(|function| serde_json::json!({"type": "function", "function": function}))
        .collect();
    let choice = match function_call {
        None => None,
        Some(Value::String(s)) if s == "none" || s == "auto" => Some(Value::String(s)),
        Some(Value::Object(o)) if o.len() == 1 && o.get("name").is_some_and(Value::is_string) => {
            Some(serde_json::json!({"type": "function", "function": o}))
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "function_call",
                "function_call must be \"none\", \"auto\" or {\"name\": ...}",
            ))
        }
    };
    tools::parse(Some(Value::Array(tools)), choice, parallel, format).map_err(legacy_names)
}

/// Respells an error about the tools built from `functions` the legacy way:
/// `tools[i].function.x` is `functions[i].x`, `tool_choice` is
/// `function_call`.
fn legacy_names(mut e: ApiError) -> ApiError {
    let respell = |text: &str| {
        let mut out = text.replace("tool_choice", "function_call");
        while let Some(at) = out.find("tools[") {
            let rest = &out[at + "tools[".len()..];
            let Some(close) = rest.find(']') else { break };
            let index = &rest[..close];
            let tail = rest[close + 1..]
                .strip_prefix(".function")
                .unwrap_or(&rest[close + 1..]);
            out = format!("{}functions[{index}]{tail}", &out[..at]);
        }
        if out == "tools" {
            out = "functions".into();
        }
        out
    };
    e.param = e.param.as_deref().map(respell);
    e.message = respell(&e.message);
    e
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    include_usage: Option<bool>,
    #[allow(dead_code)]
    continuous_usage_stats: Option<bool>,
}

/// The structured-output constraint and the parameter it came from: at
/// most one of `response_format` (json), `guided_*` and
/// `structured_outputs`.
fn constraint(f: &mut Fields) -> Result<Option<(Constraint, &'static str)>, ApiError> {
    let mut found: Vec<(Constraint, &'static str)> = Vec::new();
    if let Some(rf) = f.raw("response_format") {
        if let Some(c) = response_format(rf)? {
            found.push(c);
        }
    }
    if let Some(v) = f.raw("guided_json") {
        found.push((
            Constraint::JsonSchema(schema_value(v, "guided_json")?),
            "guided_json",
        ));
    }
    if let Some(r) = f.take::<String>("guided_regex")? {
        found.push((Constraint::Regex(r), "guided_regex"));
    }
    if let Some(c) = f.take::<Vec<String>>("guided_choice")? {
        found.push((Constraint::Choice(c), "guided_choice"));
    }
    if let Some(g) = f.take::<String>("guided_grammar")? {
        found.push((Constraint::Grammar(g), "guided_grammar"));
    }
    if let Some(v) = f.raw("structured_outputs") {
        found.extend(structured_outputs(v)?);
    }
    if found.len() > 1 {
        return Err(ApiError::invalid(
            found[1].1,
            format!(
                "only one structured-output constraint per request: {} and {} were both given",
                found[0].1, found[1].1
            ),
        ));
    }
    Ok(found.pop())
}

/// A JSON Schema given as a JSON value or as JSON text.
fn schema_value(v: Value, param: &str) -> Result<Value, ApiError> {
    match v {
        Value::String(text) => serde_json::from_str(&text)
            .map_err(|e| ApiError::invalid(param, format!("{param} is not valid JSON text: {e}"))),
        v => Ok(v),
    }
}

fn response_format(v: Value) -> Result<Option<(Constraint, &'static str)>, ApiError> {
    const P: &str = "response_format";
    let kind = v.get("type").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(P, "response_format must be an object with a string `type`")
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some((
            Constraint::JsonSchema(serde_json::json!({"type": "object"})),
            P,
        ))),
        "json_schema" => {
            const S: &str = "response_format.json_schema";
            let js = v
                .get("json_schema")
                .filter(|j| j.is_object())
                .ok_or_else(|| {
                    ApiError::invalid(S, "response_format.json_schema must be an object")
                })?;
            if !matches!(js.get("strict"), None | Some(Value::Null | Value::Bool(_))) {
                return Err(ApiError::invalid(
                    "response_format.json_schema.strict",
                    "strict must be a boolean",
                ));
            }
            // Output is always held to the schema exactly (strict or not).
            let schema = match js.get("schema") {
                None | Some(Value::Null) => serde_json::json!({"type": "object"}),
                Some(s) => schema_value(s.clone(), "response_format.json_schema.schema")?,
            };
            Ok(Some((
                Constraint::JsonSchema(schema),
                "response_format.json_schema.schema",
            )))
        }
        other => Err(ApiError::invalid(
            "response_format.type",
            format!("response_format.type must be text, json_object or json_schema, got {other:?}"),
        )),
    }
}

/// vLLM's `structured_outputs` object: one of json, regex, choice, grammar.
fn structured_outputs(v: Value) -> Result<Vec<(Constraint, &'static str)>, ApiError> {
    let Value::Object(mut m) = v else {
        return Err(ApiError::invalid(
            "structured_outputs",
            "structured_outputs must be an object",
        ));
    };
    let mut out = Vec::new();
    let mut field = |name: &'static str| m.remove(name).filter(|v| !v.is_null());
    let text = |v: Value, param: &'static str| match v {
        Value::String(s) => Ok(s),
        _ => Err(ApiError::invalid(
            param,
            format!("{param} must be a string"),
        )),
    };
    if let Some(v) = field("json") {
        const P: &str = "structured_outputs.json";
        out.push((Constraint::JsonSchema(schema_value(v, P)?), P));
    }
    if let Some(v) = field("regex") {
        const P: &str = "structured_outputs.regex";
        out.push((Constraint::Regex(text(v, P)?), P));
    }
    if let Some(v) = field("choice") {
        const P: &str = "structured_outputs.choice";
        let c = serde_json::from_value(v)
            .map_err(|_| ApiError::invalid(P, format!("{P} must be a list of strings")))?;
        out.push((Constraint::Choice(c), P));
    }
    if let Some(v) = field("grammar") {
        const P: &str = "structured_outputs.grammar";
        out.push((Constraint::Grammar(text(v, P)?), P));
    }
    if let Some(k) = m.keys().next() {
        return Err(ApiError::invalid(
            format!("structured_outputs.{k}"),
            format!("structured_outputs.{k} is not supported (json, regex, choice, grammar are)"),
        ));
    }
    Ok(out)
}

/// The completions `prompt`: a string, a list of token ids, or a list of
/// either (one prompt each), each with the parameter name engine errors
/// about it should carry. Token ids are checked against the vocabulary by
/// the engine.
fn prompts(v: Value) -> Result<Vec<(Prompt, String)>, ApiError> {
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
/// ([`tools::prepare`] writes them in the model's format).
pub(super) fn chat_messages(v: Value) -> Result<Vec<ChatMessage>, ApiError> {
    let Value::Array(list) = v else {
        return Err(ApiError::invalid("messages", "messages must be an array"));
    };
    let mut out = Vec::with_capacity(list.len() + 1);
    for (i, m) in list.into_iter().enumerate() {
        let param = format!("messages[{i}]");
        let m: WireMessage = serde_json::from_value(m)
            .map_err(|e| ApiError::invalid(param.clone(), format!("{param}: {e}")))?;
        let content = match m.content {
            None => String::new(),
            Some(c) => content_text(c, &param)?,
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
    Ok(out)
}

/// Message content: a string, or text content parts joined.
fn content_text(c: Value, param: &str) -> Result<String, ApiError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(body: Value) -> Result<Plan, ApiError> {
        parse(
            Endpoint::Chat,
            body.to_string().as_bytes(),
            "m",
            &ToolFormat::HERMES,
        )
    }

    fn user() -> Value {
        json!([{"role": "user", "content": "hi"}])
    }

    #[test]
    fn maps_every_sampling_field() {
        let p = chat(json!({
            "model": "m", "messages": user(), "max_completion_tokens": 9,
            "temperature": 0.5, "top_p": 0.9, "top_k": -1, "min_p": 0.1,
            "repetition_penalty": 1.1, "frequency_penalty": -0.5, "presence_penalty": 0.5,
            "seed": -1, "logprobs": true, "top_logprobs": 2, "stop": "\n", "n": 3,
            "user": "ignored", "logit_bias": {"7": -100, "3": 2.5}, "stream": true,
            "stream_options": {"include_usage": true}
        }))
        .unwrap();
        let r = &p.prompts[0];
        assert_eq!((r.max_new_tokens, r.n), (Some(9), Some(3)));
        assert_eq!(r.sampling.top_k, Some(0));
        // -1 as its bits; the engine gives sample i seed + i.
        assert_eq!(r.sampling.seed, Some(u64::MAX));
        assert_eq!(r.stop, vec!["\n".to_string()]);
        assert!(r.sampling.logprobs && r.sampling.top_logprobs == 2);
        let mut bias = r.sampling.logit_bias.clone();
        bias.sort_by_key(|b| b.0);
        assert_eq!(bias, vec![(3, 2.5), (7, -100.0)]);
        assert_eq!(r.input, Prompt::chat(vec![ChatMessage::user("hi")]));
        assert!(p.stream && p.include_usage && p.logprobs);
        assert_eq!(p.choices(), 3);
        assert_eq!(p.names[0].max_tokens, Some("max_completion_tokens"));
        assert!(p.names[0].stop_is_string);
    }

    #[test]
    fn shape_errors_name_the_parameter() {
        let param = |body: Value| chat(body).unwrap_err().param;
        let base = |extra: Value| {
            let mut b = json!({"messages": user()});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            b
        };
        assert_eq!(
            param(base(json!({"temperature": "hot"}))).as_deref(),
            Some("temperature")
        );
        assert_eq!(
            param(base(json!({"max_tokens": -1}))).as_deref(),
            Some("max_tokens")
        );
        assert_eq!(param(base(json!({"n": "two"}))).as_deref(), Some("n"));
        // The range is the engine's rule: the request carries `n` as given.
        assert_eq!(chat(base(json!({"n": 0}))).unwrap().prompts[0].n, Some(0));
        assert_eq!(
            param(base(json!({"frobnicate": 1}))).as_deref(),
            Some("frobnicate")
        );
        let completions = |body: Value| {
            parse(
                Endpoint::Completions,
                body.to_string().as_bytes(),
                "m",
                &ToolFormat::HERMES,
            )
        };
        assert!(
            !completions(json!({"prompt": "hi", "echo": false}))
                .unwrap()
                .echo
        );
        assert!(
            completions(json!({"prompt": "hi", "echo": true}))
                .unwrap()
                .echo
        );
        // echo with logprobs asks the engine for the prompt's, as many alternatives.
        let p = completions(json!({"prompt": "hi", "echo": true, "logprobs": 3})).unwrap();
        assert_eq!(p.prompts[0].sampling.prompt_logprobs, Some(3));
        let p = completions(json!({"prompt": "hi", "logprobs": 3})).unwrap();
        assert_eq!(p.prompts[0].sampling.prompt_logprobs, None);
        assert_eq!(
            completions(json!({"prompt": "hi", "echo": true, "logprobs": 0, "stream": true}))
                .unwrap_err()
                .param
                .as_deref(),
            Some("echo")
        );
        for bias in [json!({"x": 1}), json!({"5": "1"}), json!([1])] {
            assert_eq!(
                param(base(json!({ "logit_bias": bias }))).as_deref(),
                Some("logit_bias")
            );
        }
        assert_eq!(param(base(json!({"stop": 5}))).as_deref(), Some("stop"));
        assert_eq!(
            param(base(json!({"response_format": {"type": "yaml"}}))).as_deref(),
            Some("response_format.type")
        );
        assert_eq!(
            param(base(json!({"guided_regex": "a", "guided_choice": ["a"]}))).as_deref(),
            Some("guided_choice")
        );
        assert_eq!(param(json!({"model": "m"})).as_deref(), Some("messages"));
        assert_eq!(
            param(json!({"messages": [{"role": "user", "content": 5}]})).as_deref(),
            Some("messages[0].content")
        );
        assert_eq!(
            param(json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}))
                .as_deref(),
            Some("messages[0].content[0].type")
        );
        assert_eq!(
            param(json!({"messages": [{"content": "x"}]})).as_deref(),
            Some("messages[0]")
        );
        let e = chat(json!({"model": "gpt-4", "messages": user()})).unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::NOT_FOUND);
        for bad in [&b"{"[..], b"[1]", b"", b"{\"temperature\": NaN}"] {
            let e = parse(Endpoint::Chat, bad, "m", &ToolFormat::HERMES).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param), (400, None));
        }
    }

    #[test]
    fn constraints_and_tools() {
        let p = chat(
            json!({"messages": user(), "response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}}}),
        )
        .unwrap();
        assert_eq!(
            p.prompts[0].constraint,
            Some(Constraint::JsonSchema(json!({"type": "object"})))
        );
        assert_eq!(p.names[0].constraint, "response_format.json_schema.schema");
        let p = chat(json!({"messages": user(), "structured_outputs": {"choice": ["a", "b"]}}))
            .unwrap();
        assert_eq!(
            p.prompts[0].constraint,
            Some(Constraint::Choice(vec!["a".into(), "b".into()]))
        );

        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
        let p = chat(json!({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "f", "arguments": "{\"a\":1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}
        ], "tools": tools, "tool_choice": "required"}))
        .unwrap();
        let Prompt::Chat { messages: m, .. } = &p.prompts[0].input else {
            panic!()
        };
        assert_eq!(m.len(), 4);
        assert!(m[0].role == "system" && m[0].content.contains("<tools>"));
        assert_eq!(
            m[2].content,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\":1}}\n</tool_call>"
        );
        assert_eq!(m[3].content, "<tool_response>\n42\n</tool_response>");
        assert_eq!(p.names[0].message_offset, 1);
        assert!(matches!(
            p.prompts[0].constraint,
            Some(Constraint::Grammar(_))
        ));
        let e = chat(json!({"messages": user(), "tools": tools, "guided_regex": "a"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("guided_regex"));
    }

    #[test]
    fn fields_that_cannot_change_the_output_are_accepted_and_ignored() {
        let p = chat(json!({
            "messages": user(), "user": "u", "store": false, "metadata": {"k": "v"},
            "service_tier": "auto", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
            "safety_identifier": "s", "reasoning_effort": "low", "verbosity": "medium",
            "modalities": ["text"], "best_of": 2, "n": 2, "min_tokens": 3,
            "audio": null, "prediction": null
        }))
        .unwrap();
        assert_eq!(p.prompts[0].min_tokens, 3);
        assert_eq!(p.choices(), 2);
        let c = parse(
            Endpoint::Completions,
            br#"{"prompt": "a", "user": "u", "suffix": "", "best_of": 1, "min_tokens": 2}"#,
            "m",
            &ToolFormat::HERMES,
        )
        .unwrap();
        assert_eq!(c.prompts[0].min_tokens, 2);
    }

    #[test]
    fn fields_kestrel_cannot_honour_are_a_400_naming_them() {
        let refused = |extra: Value| {
            let mut b = json!({"messages": user()});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            chat(b).unwrap_err()
        };
        for (extra, param, code) in [
            (
                json!({"audio": {"voice": "alloy", "format": "wav"}}),
                "audio",
                Some("unsupported_parameter"),
            ),
            (
                json!({"prediction": {"type": "content", "content": "x"}}),
                "prediction",
                Some("unsupported_parameter"),
            ),
            (
                json!({"web_search_options": {}}),
                "web_search_options",
                Some("unsupported_parameter"),
            ),
            (
                json!({"modalities": ["text", "audio"]}),
                "modalities",
                Some("unsupported_parameter"),
            ),
            (
                json!({"best_of": 3}),
                "best_of",
                Some("unsupported_parameter"),
            ),
            (
                json!({"reasoning_effort": "extreme"}),
                "reasoning_effort",
                None,
            ),
            (json!({"verbosity": 3}), "verbosity", None),
            (json!({"metadata": "x"}), "metadata", None),
            (json!({"min_tokens": -1}), "min_tokens", None),
            (json!({"service_tier": 1}), "service_tier", None),
        ] {
            let e = refused(extra.clone());
            assert_eq!((e.param.as_deref(), e.code), (Some(param), code), "{extra}");
            assert_eq!(e.status.as_u16(), 400);
        }
        let e = parse(
            Endpoint::Completions,
            br#"{"prompt": "a", "suffix": "b"}"#,
            "m",
            &ToolFormat::HERMES,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("suffix"));
        // Chat-only parameters stay unknown on completions.
        let e = parse(
            Endpoint::Completions,
            br#"{"prompt": "a", "metadata": {}}"#,
            "m",
            &ToolFormat::HERMES,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("metadata"));
    }

    #[test]
    fn legacy_functions_are_tools() {
        let f = json!([{"name": "f", "parameters": {"type": "object"}}]);
        let legacy = chat(json!({"messages": user(), "functions": f,
            "function_call": {"name": "f"}}))
        .unwrap();
        let tools = json!([{"type": "function", "function": f[0]}]);
        let modern = chat(json!({"messages": user(), "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "f"}}}))
        .unwrap();
        assert_eq!(legacy.prompts, modern.prompts);
        assert!(legacy.tools.is_some());
        assert!(
            chat(json!({"messages": user(), "functions": f, "function_call": "none"}))
                .unwrap()
                .tools
                .is_none()
        );
        let param = |body: Value| chat(body).unwrap_err().param;
        assert_eq!(
            param(json!({"messages": user(), "functions": f, "tools": tools})).as_deref(),
            Some("functions")
        );
        assert_eq!(
            param(json!({"messages": user(), "function_call": "auto"})).as_deref(),
            Some("function_call")
        );
        assert_eq!(
            param(json!({"messages": user(), "functions": f, "function_call": {"name": "g"}}))
                .as_deref(),
            Some("function_call")
        );
        assert_eq!(
            param(json!({"messages": user(), "functions": [{"name": "bad name"}]})).as_deref(),
            Some("functions[0].name")
        );
        // A legacy conversation: the assistant's function_call and the
        // function's answer render like their tool_calls counterparts.
        let history = |call: Value, answer_role: &str| {
            json!({"messages": [
                {"role": "user", "content": "hi"},
                call,
                {"role": answer_role, "name": "f", "tool_call_id": "c", "content": "42"}
            ], "functions": f})
        };
        let old = chat(history(
            json!({"role": "assistant", "content": null,
                "function_call": {"name": "f", "arguments": "{}"}}),
            "function",
        ))
        .unwrap();
        let new = chat(history(
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c",
                "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
            "tool",
        ))
        .unwrap();
        assert_eq!(old.prompts, new.prompts);
    }

    #[test]
    fn completions_prompts() {
        let p = parse(
            Endpoint::Completions,
            json!({"prompt": ["a", "b"], "logprobs": 2, "n": 2, "seed": 7})
                .to_string()
                .as_bytes(),
            "m",
            &ToolFormat::HERMES,
        )
        .unwrap();
        assert_eq!(p.choices(), 4);
        assert_eq!(p.prompts[1].input, Prompt::Text("b".into()));
        assert_eq!(
            (p.prompts[1].sampling.seed, p.prompts[1].n),
            (Some(7), Some(2))
        );
        assert_eq!(p.names[1].prompt, "prompt[1]");
        assert_eq!(p.names[1].top_logprobs, "logprobs");
        let tokens = |body: &[u8]| {
            parse(Endpoint::Completions, body, "m", &ToolFormat::HERMES).map(|p| {
                p.prompts
                    .into_iter()
                    .map(|r| r.input)
                    .zip(p.names.into_iter().map(|n| n.prompt))
                    .collect::<Vec<_>>()
            })
        };
        assert_eq!(
            tokens(br#"{"prompt": [1, 2]}"#).unwrap(),
            vec![(Prompt::Tokens(vec![1, 2]), "prompt".to_string())]
        );
        assert_eq!(
            tokens(br#"{"prompt": [[1, 2], "a", [3]]}"#).unwrap(),
            vec![
                (Prompt::Tokens(vec![1, 2]), "prompt[0]".to_string()),
                (Prompt::Text("a".into()), "prompt[1]".to_string()),
                (Prompt::Tokens(vec![3]), "prompt[2]".to_string()),
            ]
        );
        for (body, param) in [
            (&br#"{"prompt": [1, "a"]}"#[..], "prompt"),
            (br#"{"prompt": [1, -2]}"#, "prompt"),
            (br#"{"prompt": [[1], [4294967296]]}"#, "prompt[1]"),
            (br#"{"prompt": [[1], true]}"#, "prompt[1]"),
            (br#"{"prompt": []}"#, "prompt"),
            (br#"{"prompt": 5}"#, "prompt"),
        ] {
            let e = tokens(body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
        }
        let e = parse(
            Endpoint::Completions,
            br#"{"prompt": "a", "max_completion_tokens": 3}"#,
            "m",
            &ToolFormat::HERMES,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
    }
}
