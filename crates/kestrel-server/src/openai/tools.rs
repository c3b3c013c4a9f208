//! Tool calls in the Hermes format, constrained so they always parse.
//!
//! A call is written `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
//! (calls separated by one newline). [`ToolSet::system_prompt`] tells the
//! model the tools and the format; [`ToolSet::grammar`] is an llguidance
//! Lark grammar whose every call is a `%json` value validated against the
//! function's parameter schema, so the arguments of every produced call
//! parse and validate. [`CallSplitter`] turns output text (whole or
//! streamed) into content or calls. History messages (assistant
//! `tool_calls`, `tool` results) are rendered into content in the same
//! format ([`render_call`], [`render_result`]). Pure, no I/O.

use serde_json::{json, Value};

use super::error::ApiError;

/// Opens a call.
pub const CALL_OPEN: &str = "<tool_call>";
/// Closes a call.
pub const CALL_CLOSE: &str = "</tool_call>";
/// Longest function name (OpenAI's limit).
const MAX_NAME_BYTES: usize = 64;

/// One function a client offers.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    pub name: String,
    pub description: Option<String>,
    /// A JSON Schema for the arguments object.
    pub parameters: Value,
}

/// What `tool_choice` asks of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Answer with text or calls.
    Auto,
    /// At least one call.
    Required,
    /// Exactly this function.
    Named(String),
}

/// The tools of a request that may call them (`tool_choice` is not `none`).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSet {
    pub functions: Vec<Function>,
    pub choice: ToolChoice,
    /// More than one call per answer allowed.
    pub parallel: bool,
}

/// Parses `tools`, `tool_choice` and `parallel_tool_calls`. `None` when no
/// tool may be called (no tools, or `tool_choice: "none"`).
pub fn parse(
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel: Option<bool>,
) -> Result<Option<ToolSet>, ApiError> {
    let list = match tools {
        None => Vec::new(),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(ApiError::invalid("tools", "tools must be an array")),
    };
    let mut functions = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        let f = function(i, t)?;
        if functions.iter().any(|g: &Function| g.name == f.name) {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.name"),
                format!("duplicate function name {:?}", f.name),
            ));
        }
        functions.push(f);
    }
    let choice = match tool_choice {
        None if functions.is_empty() => return Ok(None),
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => return Ok(None),
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "tool_choice must be none, auto, required or a named function, got {s:?}"
                    ),
                ))
            }
        },
        Some(v @ Value::Object(_)) => {
            let name = v
                .pointer("/function/name")
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "tool_choice must look like {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if !functions.iter().any(|f| f.name == name) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice names {name:?}, which is not in tools"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "tool_choice must be a string or an object",
            ))
        }
    };
    if functions.is_empty() {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice needs a non-empty tools list",
        ));
    }
    Ok(Some(ToolSet {
        functions,
        choice,
        parallel: parallel.unwrap_or(true),
    }))
}

fn function(i: usize, t: Value) -> Result<Function, ApiError> {
    let param = format!("tools[{i}]");
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(ApiError::invalid(
            format!("{param}.type"),
            "only tools of type \"function\" are supported",
        ));
    }
    let f = t
        .get("function")
        .filter(|f| f.is_object())
        .ok_or_else(|| ApiError::invalid(format!("{param}.function"), "must be an object"))?;
    let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
    let name_ok = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !name_ok {
        return Err(ApiError::invalid(
            format!("{param}.function.name"),
            format!("must be 1 to {MAX_NAME_BYTES} characters of a-z, A-Z, 0-9, _ and -"),
        ));
    }
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{param}.function.parameters"),
                "must be a JSON Schema object",
            ))
        }
    };
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{param}.function.description"),
                "must be a string",
            ))
        }
    };
    Ok(Function {
        name: name.to_string(),
        description,
        parameters,
    })
}

impl ToolSet {
    /// The system prompt describing the tools and the call format
    /// (Hermes's wording).
    pub fn system_prompt(&self) -> String {
        let mut s = String::from(
            "You are a function calling AI model. You are provided with function signatures \
             within <tools></tools> XML tags. You may call one or more functions to assist with \
             the user query. Don't make assumptions about what values to plug into functions. \
             Here are the available tools: <tools>\n",
        );
        for f in &self.functions {
            let mut function = json!({"name": f.name, "parameters": f.parameters});
            if let Some(d) = &f.description {
                function["description"] = json!(d);
            }
            s.push_str(&json!({"type": "function", "function": function}).to_string());
            s.push('\n');
        }
        s.push_str(
            "</tools>\nFor each function call, return a json object with function name and \
             arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
             {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
        );
        s
    }

    /// The Lark grammar (llguidance dialect) the answer must match.
    pub fn grammar(&self) -> String {
        let offered: Vec<&Function> = match &self.choice {
            ToolChoice::Named(name) => self.functions.iter().filter(|f| &f.name == name).collect(),
            _ => self.functions.iter().collect(),
        };
        let calls = if self.parallel && !matches!(self.choice, ToolChoice::Named(_)) {
            "call (\"\\n\" call)*"
        } else {
            "call"
        };
        let start = match self.choice {
            ToolChoice::Auto => "start: calls | TEXT",
            _ => "start: calls",
        };
        let mut g = format!(
            "{start}\ncalls: {calls}\ncall: {} body {}\nbody: {}\n",
            lark_string(&format!("{CALL_OPEN}\n")),
            lark_string(&format!("\n{CALL_CLOSE}")),
            (0..offered.len())
                .map(|i| format!("fn_{i}"))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        for (i, f) in offered.iter().enumerate() {
            // Written by hand so that `name` comes before `arguments`
            // (llguidance emits properties in schema order).
            let schema = format!(
                r#"{{"type":"object","properties":{{"name":{{"const":{}}},"arguments":{}}},"required":["name","arguments"],"additionalProperties":false}}"#,
                Value::String(f.name.clone()),
                f.parameters
            );
            g.push_str(&format!("fn_{i}: %json {schema}\n"));
        }
        if self.choice == ToolChoice::Auto {
            // Any non-empty text that does not open a call.
            g.push_str("TEXT: /(?s:.+)/ & ~/(?s:<tool_call>.*)/\n");
        }
        g
    }
}

/// A Lark string literal for `s` (JSON string escaping is a subset of
/// what llguidance's Lark lexer accepts).
fn lark_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// An assistant's earlier call, as history content.
pub fn render_call(name: &str, arguments: &str) -> String {
    // Arguments are a JSON string in OpenAI's shape; embed them as JSON
    // when they parse, as a string otherwise.
    let args = serde_json::from_str::<Value>(arguments)
        .unwrap_or_else(|_| Value::String(arguments.to_string()));
    format!(
        "{CALL_OPEN}\n{{\"name\": {}, \"arguments\": {args}}}\n{CALL_CLOSE}",
        Value::String(name.to_string())
    )
}

/// A `tool` message's content, as history content.
pub fn render_result(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// One parsed call: function name and its arguments as JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: String,
}

/// What a [`CallSplitter`] released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Call(ParsedCall),
}

/// Splits output text into content and calls, whole or as it streams:
/// with `auto` the answer is text unless it opens with [`CALL_OPEN`] (held
/// back until that is decided); otherwise it is calls. Each call is
/// released when its closing tag arrives.
#[derive(Debug, Clone)]
pub struct CallSplitter {
    state: SplitState,
    buf: String,
    /// Bytes of `buf` already released as calls.
    consumed: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SplitState {
    Undecided,
    Text,
    Calls,
}

impl CallSplitter {
    /// A splitter for answers under `choice`.
    pub fn new(choice: &ToolChoice) -> Self {
        Self {
            state: match choice {
                ToolChoice::Auto => SplitState::Undecided,
                _ => SplitState::Calls,
            },
            buf: String::new(),
            consumed: 0,
        }
    }

    /// Feeds newly generated text; returns what it completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        match self.state {
            SplitState::Text => return vec![Piece::Text(text.to_string())],
            SplitState::Undecided => {
                self.buf.push_str(text);
                if self.buf.starts_with(CALL_OPEN) {
                    self.state = SplitState::Calls;
                } else if CALL_OPEN.starts_with(self.buf.as_str()) {
                    return Vec::new();
                } else {
                    self.state = SplitState::Text;
                    return vec![Piece::Text(std::mem::take(&mut self.buf))];
                }
            }
            SplitState::Calls => self.buf.push_str(text),
        }
        let mut out = Vec::new();
        while let Some(call) = self.next_call() {
            out.push(Piece::Call(call));
        }
        out
    }

    /// Ends the text; text still held back (an answer that only began
    /// like a call) is released.
    pub fn finish(&mut self) -> Vec<Piece> {
        match self.state {
            SplitState::Undecided if !self.buf.is_empty() => {
                self.state = SplitState::Text;
                vec![Piece::Text(std::mem::take(&mut self.buf))]
            }
            _ => Vec::new(),
        }
    }

    fn next_call(&mut self) -> Option<ParsedCall> {
        let rest = &self.buf[self.consumed..];
        let start = rest.find(CALL_OPEN)?;
        let body_start = start + CALL_OPEN.len();
        let end = rest[body_start..].find(CALL_CLOSE)? + body_start;
        let body = rest[body_start..end].trim();
        self.consumed += end + CALL_CLOSE.len();
        let v: Value = serde_json::from_str(body).ok()?;
        let name = v.get("name")?.as_str()?.to_string();
        let arguments = v.get("arguments")?.to_string();
        Some(ParsedCall { name, arguments })
    }
}

/// Splits a whole answer: its text content (if any) and its calls.
pub fn split(choice: &ToolChoice, text: &str) -> (String, Vec<ParsedCall>) {
    let mut s = CallSplitter::new(choice);
    let mut content = String::new();
    let mut calls = Vec::new();
    for piece in s.push(text).into_iter().chain(s.finish()) {
        match piece {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        }}])
    }

    #[test]
    fn choices_parse() {
        assert_eq!(parse(None, None, None).unwrap(), None);
        assert_eq!(
            parse(Some(weather()), Some(json!("none")), None).unwrap(),
            None
        );
        let t = parse(Some(weather()), None, None).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        let t = parse(
            Some(weather()),
            Some(json!({"type": "function", "function": {"name": "get_weather"}})),
            Some(false),
        )
        .unwrap()
        .unwrap();
        assert_eq!(t.choice, ToolChoice::Named("get_weather".into()));
        let e = parse(
            Some(weather()),
            Some(json!({"type": "function", "function": {"name": "x"}})),
            None,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let e = parse(
            Some(json!([{"type": "function", "function": {"name": "a b"}}])),
            None,
            None,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].function.name"));
        let e = parse(Some(json!([{"type": "retrieval"}])), None, None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].type"));
        let e = parse(None, Some(json!("required")), None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn grammar_offers_each_function_as_json() {
        let t = parse(Some(weather()), Some(json!("required")), Some(false))
            .unwrap()
            .unwrap();
        let g = t.grammar();
        assert!(g.starts_with("start: calls\ncalls: call\n"), "{g}");
        assert!(g.contains("fn_0: %json {"), "{g}");
        assert!(g.contains(r#""const":"get_weather""#), "{g}");
        let auto = parse(Some(weather()), None, None)
            .unwrap()
            .unwrap()
            .grammar();
        assert!(auto.contains("start: calls | TEXT") && auto.contains("TEXT:"));
    }

    #[test]
    fn splitter_streams_text_and_calls() {
        let call = render_call("get_weather", r#"{"city":"Paris"}"#);
        let (content, calls) = split(&ToolChoice::Required, &call);
        assert_eq!(content, "");
        assert_eq!(
            calls,
            vec![ParsedCall {
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into()
            }]
        );

        // Auto: a prefix of the open tag is held back, then released as text.
        let mut s = CallSplitter::new(&ToolChoice::Auto);
        assert!(s.push("<tool").is_empty());
        assert_eq!(s.push("box"), vec![Piece::Text("<toolbox".into())]);
        assert_eq!(s.push(" x"), vec![Piece::Text(" x".into())]);

        // Auto: two calls arriving in pieces.
        let two = format!(
            "{call}\n{}",
            render_call("get_weather", r#"{"city":"Oslo"}"#)
        );
        let mut s = CallSplitter::new(&ToolChoice::Auto);
        let mut got = Vec::new();
        for chunk in two.as_bytes().chunks(7) {
            got.extend(s.push(std::str::from_utf8(chunk).unwrap()));
        }
        got.extend(s.finish());
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got.iter().all(|p| matches!(p, Piece::Call(_))));
        let (content, _) = split(&ToolChoice::Auto, "<tool");
        assert_eq!(content, "<tool");
    }
}
