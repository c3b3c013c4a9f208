//! Tool calls in the model's own format, constrained so they always parse.
//!
//! [`ToolFormat::of_model`] reads the call syntax from the chat template:
//! Hermes / Qwen (`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`),
//! Llama 3.1/3.2 (a bare `{"name": ..., "parameters": {...}}`, one call) or
//! Mistral v3 (`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`). Such a
//! template renders `tools`, calls and results itself; for any other model
//! Kestrel writes Hermes: its own system prompt ([`ToolSet::system_prompt`])
//! and history rendered into content ([`prepare`]). [`ToolSet::grammar`] is an
//! llguidance Lark grammar in the format's syntax whose every call is a
//! `%json` value validated against the function's parameter schema, written
//! compact (no whitespace outside strings). [`CallSplitter`] turns output
//! text, whole or streamed, into content, calls and their argument
//! fragments, and hands back the text of a call the output was cut inside.
//! Pure, no I/O.

use kestrel_engine::{ChatMessage, ModelContext, Prompt, ToolCall};
use kestrel_model::ToolSyntax;
use serde_json::{json, Value};

use super::error::ApiError;

/// Longest function name (OpenAI's limit).
const MAX_NAME_BYTES: usize = 64;

/// How the served model writes tool calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolFormat {
    pub syntax: ToolSyntax,
    /// The chat template renders `tools`, calls and results itself;
    /// otherwise Kestrel writes them (Hermes) into the messages.
    pub by_template: bool,
    /// Mistral: the id of `[TOOL_CALLS]` when it is one token of the
    /// vocabulary (the grammar then emits that token, as the model was
    /// trained to; the output text does not show it).
    call_token: Option<u32>,
}

/// Mistral's call marker.
const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
/// Llama 3.1's marker before a call in "ipython" mode (a control token, so
/// not in the output text; accepted if it is).
const LLAMA_PYTHON_TAG: &str = "<|python_tag|>";

impl ToolFormat {
    /// Hermes written by Kestrel: for models whose template renders no tools.
    pub const HERMES: ToolFormat = ToolFormat {
        syntax: ToolSyntax::Hermes,
        by_template: false,
        call_token: None,
    };

    /// The format of `model`'s chat template, Hermes when it has none that
    /// renders tools.
    pub fn of_model(model: &ModelContext) -> Self {
        match model.chat_template().and_then(|t| t.tool_syntax()) {
            None => Self::HERMES,
            Some(syntax) => ToolFormat {
                syntax,
                by_template: true,
                call_token: match syntax {
                    ToolSyntax::MistralV3 => model.tokenizer().token_to_id(MISTRAL_CALLS),
                    _ => None,
                },
            },
        }
    }

    /// The key of a call's arguments.
    fn args_key(&self) -> &'static str {
        match self.syntax {
            ToolSyntax::Llama3Json => "parameters",
            _ => "arguments",
        }
    }

    /// Texts that open the calls of an answer (a `tool_choice: auto` answer
    /// that begins with one is calls, any other is text).
    fn openers(&self) -> &'static [&'static str] {
        match self.syntax {
            ToolSyntax::Hermes => &["<tool_call>"],
            ToolSyntax::Llama3Json => &["{", LLAMA_PYTHON_TAG],
            ToolSyntax::MistralV3 => &[MISTRAL_CALLS, "[{"],
        }
    }

    /// Text that closes a call (or all of them): after a whole call, only
    /// this (or a beginning of it) is not the start of another.
    fn closers(&self) -> &'static [&'static str] {
        match self.syntax {
            ToolSyntax::Hermes => &["</tool_call>"],
            ToolSyntax::Llama3Json => &[],
            ToolSyntax::MistralV3 => &["]"],
        }
    }

    /// Text around and between calls.
    fn frame(&self) -> &'static [&'static str] {
        match self.syntax {
            ToolSyntax::Hermes => &["<tool_call>", "</tool_call>"],
            ToolSyntax::Llama3Json => &[LLAMA_PYTHON_TAG, ";"],
            ToolSyntax::MistralV3 => &[MISTRAL_CALLS, "[", ",", "]"],
        }
    }
}

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
    /// More than one call per answer allowed (never with Llama 3's
    /// format, whose template takes one call per turn).
    pub parallel: bool,
    pub format: ToolFormat,
}

/// Parses `tools`, `tool_choice` and `parallel_tool_calls` for a model
/// writing `format`. `None` when no tool may be called (no tools, or
/// `tool_choice: "none"`).
pub fn parse(
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel: Option<bool>,
    format: &ToolFormat,
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
        parallel: parallel.unwrap_or(true) && format.syntax != ToolSyntax::Llama3Json,
        format: format.clone(),
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

impl Function {
    /// OpenAI's tool object, as templates and the Hermes prompt show it.
    fn tool_json(&self) -> Value {
        let mut function = json!({"name": self.name});
        if let Some(d) = &self.description {
            function["description"] = json!(d);
        }
        function["parameters"] = self.parameters.clone();
        json!({"type": "function", "function": function})
    }
}

impl ToolSet {
    /// The system prompt describing the tools and the call format
    /// (Hermes's wording), for models whose template renders no tools.
    pub fn system_prompt(&self) -> String {
        let mut s = String::from(
            "You are a function calling AI model. You are provided with function signatures \
             within <tools></tools> XML tags. You may call one or more functions to assist with \
             the user query. Don't make assumptions about what values to plug into functions. \
             Here are the available tools: <tools>\n",
        );
        for f in &self.functions {
            s.push_str(&f.tool_json().to_string());
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
        let many = self.parallel && !matches!(self.choice, ToolChoice::Named(_));
        let mut g = String::from(match self.choice {
            ToolChoice::Auto => "start: calls | TEXT\n",
            _ => "start: calls\n",
        });
        match self.format.syntax {
            ToolSyntax::Hermes => {
                g.push_str(if many {
                    "calls: call (\"\\n\" call)*\n"
                } else {
                    "calls: call\n"
                });
                g.push_str("call: \"<tool_call>\\n\" body \"\\n</tool_call>\"\n");
            }
            ToolSyntax::Llama3Json => g.push_str("calls: body\n"),
            ToolSyntax::MistralV3 => {
                let open = match self.format.call_token {
                    Some(id) => format!("<[{id}]>"),
                    None => lark_string(MISTRAL_CALLS),
                };
                let rest = if many { " (\", \" body)*" } else { "" };
                g.push_str(&format!("calls: {open} \"[\" body{rest} \"]\"\n"));
            }
        }
        g.push_str(&format!(
            "body: {}\n",
            (0..offered.len())
                .map(|i| format!("fn_{i}"))
                .collect::<Vec<_>>()
                .join(" | ")
        ));
        for (i, f) in offered.iter().enumerate() {
            // Written by hand so that `name` comes before the arguments
            // (llguidance emits properties in schema order); compact, as
            // OpenAI writes arguments, so no tokens go to whitespace.
            let schema = json!({
                "type": "object",
                "properties": {"name": {"const": f.name}, (self.format.args_key()): f.parameters},
                "required": ["name", self.format.args_key()],
                "additionalProperties": false,
                "x-guidance": {"whitespace_flexible": false, "item_separator": ",", "key_separator": ":"},
            });
            g.push_str(&format!("fn_{i}: %json {schema}\n"));
        }
        if self.choice == ToolChoice::Auto {
            // Any non-empty text that does not open a call.
            let not_calls: String = self
                .format
                .openers()
                .iter()
                .map(|o| format!(" & ~/(?s:{}.*)/", regex_escape(o)))
                .collect();
            g.push_str(&format!("TEXT: /(?s:.+)/{not_calls}\n"));
        }
        g
    }
}

/// A Lark string literal for `s` (JSON string escaping is a subset of
/// what llguidance's Lark lexer accepts).
fn lark_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// `s` as a literal inside a Lark `/.../` regex.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 2);
    for c in s.chars() {
        if "\\.+*?()|[]{}^$/".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Makes the prompt of a conversation in `format`, with `tools` offered
/// (when any may be called). A template that renders tools gets them and
/// the structured calls and results; otherwise calls and results are
/// written into content in Hermes's format and a system prompt describing
/// the tools comes first (merged into the client's own system message when
/// there is one). Returns the prompt and how many messages were put in
/// front of the client's.
pub fn prepare(
    format: &ToolFormat,
    mut messages: Vec<ChatMessage>,
    tools: Option<&ToolSet>,
) -> (Prompt, usize) {
    if format.by_template {
        if format.syntax == ToolSyntax::MistralV3 {
            // Mistral's template refuses ids that are not nine alphanumerics.
            for m in &mut messages {
                for c in &mut m.tool_calls {
                    c.id = mistral_id(&c.id);
                }
                if let Some(id) = &mut m.tool_call_id {
                    *id = mistral_id(id);
                }
            }
        }
        let tools = tools
            .map(|t| t.functions.iter().map(Function::tool_json).collect())
            .unwrap_or_default();
        return (Prompt::Chat { messages, tools }, 0);
    }
    for m in &mut messages {
        if m.role == "tool" {
            m.content = render_result(&m.content);
            m.tool_call_id = None;
        }
        for call in std::mem::take(&mut m.tool_calls) {
            if !m.content.is_empty() {
                m.content.push('\n');
            }
            m.content.push_str(&render_call(&call));
        }
    }
    let Some(tools) = tools else {
        return (Prompt::chat(messages), 0);
    };
    let prompt = tools.system_prompt();
    let offset = match messages.first_mut() {
        Some(first) if first.role == "system" => {
            first.content = format!("{}\n\n{prompt}", first.content);
            0
        }
        _ => {
            messages.insert(0, ChatMessage::system(prompt));
            1
        }
    };
    (Prompt::chat(messages), offset)
}

/// `id` as Mistral's template wants it: nine ASCII letters and digits,
/// kept when it is one, else derived from it (FNV-1a, base 62), so a call
/// and its result still match.
fn mistral_id(id: &str) -> String {
    if id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return id.to_string();
    }
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let mut h = kestrel_engine::seed_for_request_id(id);
    (0..9)
        .map(|_| {
            let d = DIGITS[(h % 62) as usize] as char;
            h /= 62;
            d
        })
        .collect()
}

/// An assistant's earlier call, as Hermes history content.
fn render_call(call: &ToolCall) -> String {
    format!(
        "<tool_call>\n{{\"name\": {}, \"arguments\": {}}}\n</tool_call>",
        Value::String(call.name.clone()),
        call.arguments
    )
}

/// A `tool` message's content, as Hermes history content.
fn render_result(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// A call's arguments text as templates get it: JSON when it parses, the
/// text as a JSON string otherwise.
pub fn arguments_value(arguments: &str) -> Value {
    serde_json::from_str(arguments).unwrap_or_else(|_| Value::String(arguments.to_string()))
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
    /// Content.
    Text(String),
    /// A call begins: its function's name.
    CallStart(String),
    /// The next fragment of the current call's arguments JSON.
    Args(String),
    /// The text of a call the output ended inside of (cut by `max_tokens`),
    /// from the end of the last whole call: content, not a call.
    /// `started`: its [`Piece::CallStart`] was already released.
    Unfinished { text: String, started: bool },
}

/// Splits output text into content and calls, whole or as it streams:
/// with `auto` the answer is text unless it opens with one of the format's
/// call openers (held back until that is decided); otherwise it is calls.
/// A call's name is released once written, its arguments as they arrive.
#[derive(Debug, Clone)]
pub struct CallSplitter {
    format: ToolFormat,
    state: SplitState,
    buf: String,
    /// Bytes of `buf` consumed (frame text and whole calls).
    pos: usize,
    /// End of the last whole call in `buf` (0 before the first).
    last_end: usize,
    /// The call being read, from `pos`.
    call: Option<OpenCall>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SplitState {
    Undecided,
    Text,
    Calls,
}

#[derive(Debug, Clone, Copy)]
struct OpenCall {
    /// Where its arguments start in `buf`, once the name is read.
    args_start: Option<usize>,
    /// End of the argument text released so far.
    args_sent: usize,
    /// End of the arguments value, once whole.
    args_end: Option<usize>,
}

/// What [`call_header`] found.
enum Header {
    Incomplete,
    /// Not a call of this format.
    Invalid,
    /// The name and where the arguments value starts (offset in the text).
    Done(String, usize),
}

impl CallSplitter {
    /// A splitter for answers to `tools`.
    pub fn new(tools: &ToolSet) -> Self {
        Self {
            format: tools.format.clone(),
            state: match tools.choice {
                ToolChoice::Auto => SplitState::Undecided,
                _ => SplitState::Calls,
            },
            buf: String::new(),
            pos: 0,
            last_end: 0,
            call: None,
        }
    }

    /// Feeds newly generated text; returns what it completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        match self.state {
            SplitState::Text => return vec![Piece::Text(text.to_string())],
            SplitState::Undecided => {
                self.buf.push_str(text);
                let openers = self.format.openers();
                if openers.iter().any(|o| self.buf.starts_with(o)) {
                    self.state = SplitState::Calls;
                } else if openers.iter().any(|o| o.starts_with(self.buf.as_str())) {
                    return Vec::new();
                } else {
                    self.state = SplitState::Text;
                    return vec![Piece::Text(std::mem::take(&mut self.buf))];
                }
            }
            SplitState::Calls => self.buf.push_str(text),
        }
        let mut out = Vec::new();
        self.scan(&mut out);
        out
    }

    /// Ends the text: text still held back (an answer that only began like
    /// a call) is released, and so is a call the text ended inside of (any
    /// text after the last whole call but its closing tag; all of it when
    /// no call is whole).
    pub fn finish(&mut self) -> Vec<Piece> {
        match self.state {
            SplitState::Undecided if !self.buf.is_empty() => {
                self.state = SplitState::Text;
                vec![Piece::Text(std::mem::take(&mut self.buf))]
            }
            SplitState::Calls => {
                let rest = self.buf[self.last_end..].trim();
                let closing =
                    self.last_end > 0 && self.format.closers().iter().any(|c| c.starts_with(rest));
                if rest.is_empty() || closing {
                    return Vec::new();
                }
                let text = self.buf[self.last_end..].trim_start().to_string();
                let started = self.call.take().is_some_and(|c| c.args_start.is_some());
                self.last_end = self.buf.len();
                self.pos = self.buf.len();
                vec![Piece::Unfinished { text, started }]
            }
            _ => Vec::new(),
        }
    }

    /// Moves `pos` past frame text; `Err` when it stops at text that is
    /// neither frame nor a call, `Ok(true)` at a call's `{`, `Ok(false)`
    /// when the text ends (or ends in a prefix of frame text).
    fn skip_frame(&mut self) -> Result<bool, ()> {
        'outer: loop {
            let rest = &self.buf[self.pos..];
            let trimmed = rest.trim_start();
            self.pos += rest.len() - trimmed.len();
            if trimmed.is_empty() {
                return Ok(false);
            }
            if trimmed.starts_with('{') {
                return Ok(true);
            }
            // Wait while the text may still become a longer frame text
            // (Mistral's `[` vs `[TOOL_CALLS]`).
            if self
                .format
                .frame()
                .iter()
                .any(|f| f.len() > trimmed.len() && f.starts_with(trimmed))
            {
                return Ok(false);
            }
            for f in self.format.frame() {
                if trimmed.starts_with(f) {
                    // A call's closing tag belongs to it.
                    let closes = self.buf[self.last_end..self.pos].trim().is_empty()
                        && self.format.closers().contains(f);
                    self.pos += f.len();
                    if closes && self.last_end > 0 {
                        self.last_end = self.pos;
                    }
                    continue 'outer;
                }
            }
            return Err(());
        }
    }

    fn scan(&mut self, out: &mut Vec<Piece>) {
        loop {
            let call = match &mut self.call {
                Some(c) => c,
                None => match self.skip_frame() {
                    Ok(true) => self.call.insert(OpenCall {
                        args_start: None,
                        args_sent: 0,
                        args_end: None,
                    }),
                    _ => return,
                },
            };
            let args_start = match call.args_start {
                Some(a) => a,
                None => match call_header(&self.buf[self.pos..], self.format.args_key()) {
                    Header::Done(name, offset) => {
                        let a = self.pos + offset;
                        call.args_start = Some(a);
                        call.args_sent = a;
                        out.push(Piece::CallStart(name));
                        a
                    }
                    Header::Incomplete | Header::Invalid => return,
                },
            };
            let args_end = match call.args_end {
                Some(e) => e,
                None => match json_value_end(&self.buf[args_start..]) {
                    Some(len) => {
                        call.args_end = Some(args_start + len);
                        args_start + len
                    }
                    None => {
                        if self.buf.len() > call.args_sent {
                            out.push(Piece::Args(self.buf[call.args_sent..].to_string()));
                            call.args_sent = self.buf.len();
                        }
                        return;
                    }
                },
            };
            if args_end > call.args_sent {
                out.push(Piece::Args(self.buf[call.args_sent..args_end].to_string()));
                call.args_sent = args_end;
            }
            // The call object closes after its arguments.
            let after = &self.buf[args_end..];
            let trimmed = after.trim_start();
            if !trimmed.starts_with('}') {
                return;
            }
            self.pos = args_end + (after.len() - trimmed.len()) + 1;
            self.last_end = self.pos;
            self.call = None;
        }
    }
}

/// Moves `rest` past whitespace and `lit`: `Some(true)` when it was there,
/// `None` when `rest` ends inside it, `Some(false)` when it was not.
fn eat(rest: &mut &str, lit: &str) -> Option<bool> {
    let t = rest.trim_start();
    if let Some(after) = t.strip_prefix(lit) {
        *rest = after;
        Some(true)
    } else if lit.starts_with(t) {
        None
    } else {
        Some(false)
    }
}

/// Eats each of `lits` in turn (whitespace before each allowed); the
/// header's state when one is missing or wrong.
fn eat_all(rest: &mut &str, lits: &[&str]) -> Result<(), Header> {
    for lit in lits {
        match eat(rest, lit) {
            None => return Err(Header::Incomplete),
            Some(false) => return Err(Header::Invalid),
            Some(true) => {}
        }
    }
    Ok(())
}

/// Reads `{"name": "<name>", "<args_key>": ` at the start of `s`.
fn call_header(s: &str, args_key: &str) -> Header {
    let mut rest = s;
    if let Err(h) = eat_all(&mut rest, &["{", "\"name\"", ":"]) {
        return h;
    }
    let t = rest.trim_start();
    if t.is_empty() {
        return Header::Incomplete;
    }
    if !t.starts_with('"') {
        return Header::Invalid;
    }
    let Some(len) = json_value_end(t) else {
        return Header::Incomplete;
    };
    let Ok(name) = serde_json::from_str::<String>(&t[..len]) else {
        return Header::Invalid;
    };
    rest = &t[len..];
    let key = format!("\"{args_key}\"");
    if let Err(h) = eat_all(&mut rest, &[",", &key, ":"]) {
        return h;
    }
    let t = rest.trim_start();
    if t.is_empty() {
        return Header::Incomplete;
    }
    Header::Done(name, s.len() - t.len())
}

/// Length of the JSON value at the start of `s` (no leading whitespace),
/// `None` while it is incomplete. A number or literal ends at the next
/// delimiter.
fn json_value_end(s: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    match bytes.first()? {
        b'{' | b'[' | b'"' => {
            let mut depth = 0usize;
            let mut in_string = false;
            let mut escaped = false;
            for (i, &b) in bytes.iter().enumerate() {
                if in_string {
                    match (escaped, b) {
                        (true, _) => escaped = false,
                        (false, b'\\') => escaped = true,
                        (false, b'"') => {
                            in_string = false;
                            if depth == 0 {
                                return Some(i + 1);
                            }
                        }
                        _ => {}
                    }
                    continue;
                }
                match b {
                    b'"' => in_string = true,
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
            }
            None
        }
        _ => bytes
            .iter()
            .position(|b| matches!(b, b',' | b'}' | b']' | b' ' | b'\n' | b'\t' | b'\r')),
    }
}

/// A whole answer split: its content, its whole calls, and the text of a
/// call it ended inside of (empty if none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    pub content: String,
    pub calls: Vec<ParsedCall>,
    pub unfinished: String,
}

/// Splits a whole answer to `tools`.
pub fn split(tools: &ToolSet, text: &str) -> Split {
    let mut s = CallSplitter::new(tools);
    let mut out = Split::default();
    for piece in s.push(text).into_iter().chain(s.finish()) {
        match piece {
            Piece::Text(t) => out.content.push_str(&t),
            Piece::CallStart(name) => out.calls.push(ParsedCall {
                name,
                arguments: String::new(),
            }),
            Piece::Args(a) => {
                if let Some(c) = out.calls.last_mut() {
                    c.arguments.push_str(&a);
                }
            }
            Piece::Unfinished { text, started } => {
                // The cut call's name and first arguments were released
                // before the cut was known; it is content, not a call.
                if started {
                    out.calls.pop();
                }
                out.unfinished = text;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        }}, {"type": "function", "function": {"name": "get_time"}}])
    }

    fn format(syntax: ToolSyntax) -> ToolFormat {
        ToolFormat {
            syntax,
            by_template: syntax != ToolSyntax::Hermes,
            call_token: None,
        }
    }

    const FORMATS: [ToolSyntax; 3] = [
        ToolSyntax::Hermes,
        ToolSyntax::Llama3Json,
        ToolSyntax::MistralV3,
    ];

    fn set(syntax: ToolSyntax, choice: Value) -> ToolSet {
        parse(Some(weather()), Some(choice), None, &format(syntax))
            .unwrap()
            .unwrap()
    }

    /// One call of `get_weather` for Paris, compact, in `syntax`.
    fn paris(syntax: ToolSyntax) -> &'static str {
        match syntax {
            ToolSyntax::Hermes => {
                "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>"
            }
            ToolSyntax::Llama3Json => {
                "{\"name\":\"get_weather\",\"parameters\":{\"city\":\"Paris\"}}"
            }
            ToolSyntax::MistralV3 => {
                "[TOOL_CALLS][{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}]"
            }
        }
    }

    /// Whether llguidance's Lark `grammar` accepts the whole of `text`
    /// (byte tokens).
    fn accepts(grammar: &str, text: &str) -> bool {
        let env = toktrie::ApproximateTokEnv::single_byte_env();
        let factory = llguidance::ParserFactory::new_simple(&env).unwrap();
        let parser = factory
            .create_parser(llguidance::api::TopLevelGrammar::from_lark(
                grammar.to_string(),
            ))
            .unwrap_or_else(|e| panic!("{e}\n{grammar}"));
        let mut m = llguidance::Matcher::new(Ok(parser));
        let tokens = env.tokenize_bytes(text.as_bytes());
        m.consume_tokens(&tokens).is_ok() && m.is_accepting().unwrap_or(false)
    }

    #[test]
    fn choices_parse() {
        let hermes = &ToolFormat::HERMES;
        assert_eq!(parse(None, None, None, hermes).unwrap(), None);
        assert_eq!(
            parse(Some(weather()), Some(json!("none")), None, hermes).unwrap(),
            None
        );
        let t = parse(Some(weather()), None, None, hermes).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        assert!(t.parallel);
        let t = parse(
            Some(weather()),
            Some(json!({"type": "function", "function": {"name": "get_weather"}})),
            Some(false),
            hermes,
        )
        .unwrap()
        .unwrap();
        assert_eq!(t.choice, ToolChoice::Named("get_weather".into()));
        // Llama 3's template takes one call per turn.
        let t = parse(
            Some(weather()),
            None,
            Some(true),
            &format(ToolSyntax::Llama3Json),
        );
        assert!(!t.unwrap().unwrap().parallel);
        let e = parse(
            Some(weather()),
            Some(json!({"type": "function", "function": {"name": "x"}})),
            None,
            hermes,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let e = parse(
            Some(json!([{"type": "function", "function": {"name": "a b"}}])),
            None,
            None,
            hermes,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].function.name"));
        let e = parse(Some(json!([{"type": "retrieval"}])), None, None, hermes).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].type"));
        let e = parse(None, Some(json!("required")), None, hermes).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
    }

    fn history() -> Vec<ChatMessage> {
        vec![
            ChatMessage::user("Weather in Paris?"),
            ChatMessage {
                tool_calls: vec![ToolCall {
                    id: "call_17".into(),
                    name: "get_weather".into(),
                    arguments: json!({"city": "Paris"}),
                }],
                ..ChatMessage::assistant("")
            },
            ChatMessage {
                tool_call_id: Some("call_17".into()),
                ..ChatMessage::new("tool", "22 C")
            },
        ]
    }

    #[test]
    fn hermes_fallback_writes_prompt_calls_and_results() {
        let t = set(ToolSyntax::Hermes, json!("auto"));
        let (prompt, offset) = prepare(&ToolFormat::HERMES, history(), Some(&t));
        let Prompt::Chat { messages, tools } = prompt else {
            panic!()
        };
        assert_eq!(offset, 1);
        assert!(tools.is_empty(), "the template is not given the tools");
        assert!(
            messages[0].role == "system"
                && messages[0].content.contains(
                    "<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"get_weather\""
                )
        );
        assert_eq!(
            messages[2].content,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>"
        );
        assert!(messages[2].tool_calls.is_empty());
        assert_eq!(
            (messages[3].role.as_str(), messages[3].content.as_str()),
            ("tool", "<tool_response>\n22 C\n</tool_response>")
        );
        // A client system message takes the prompt after its own text.
        let mut h = history();
        h.insert(0, ChatMessage::system("Be brief."));
        let (Prompt::Chat { messages, .. }, 0) = prepare(&ToolFormat::HERMES, h, Some(&t)) else {
            panic!()
        };
        assert!(messages[0]
            .content
            .starts_with("Be brief.\n\nYou are a function calling"));
    }

    #[test]
    fn template_formats_get_structured_history_and_tools() {
        for syntax in FORMATS {
            let f = format(syntax);
            let f = ToolFormat {
                by_template: true,
                ..f
            };
            let t = set(syntax, json!("auto"));
            let (prompt, offset) = prepare(&f, history(), Some(&t));
            let Prompt::Chat { messages, tools } = prompt else {
                panic!()
            };
            assert_eq!(offset, 0);
            assert_eq!(messages.len(), 3);
            assert_eq!(
                tools,
                weather()
                    .as_array()
                    .unwrap()
                    .clone()
                    .into_iter()
                    .map(|mut t| {
                        if t["function"].get("parameters").is_none() {
                            t["function"]["parameters"] =
                                json!({"type": "object", "properties": {}});
                        }
                        t
                    })
                    .collect::<Vec<_>>()
            );
            assert_eq!(messages[1].content, "");
            let id = &messages[1].tool_calls[0].id;
            assert_eq!(messages[2].tool_call_id.as_ref(), Some(id));
            if syntax == ToolSyntax::MistralV3 {
                // Nine alphanumerics, the same for the call and its result.
                assert_eq!(id.len(), 9);
                assert!(id.bytes().all(|b| b.is_ascii_alphanumeric()), "{id}");
                assert_eq!(mistral_id("abc123XYZ"), "abc123XYZ");
            } else {
                assert_eq!(id, "call_17");
            }
        }
        // No tools offered: the template gets none, history stays structured.
        let (Prompt::Chat { tools, messages }, 0) =
            prepare(&format(ToolSyntax::Llama3Json), history(), None)
        else {
            panic!()
        };
        assert!(tools.is_empty() && messages[1].tool_calls.len() == 1);
    }

    #[test]
    fn grammar_holds_each_format_to_compact_valid_calls() {
        for syntax in FORMATS {
            let g = set(syntax, json!("required")).grammar();
            let call = paris(syntax);
            assert!(accepts(&g, call), "{syntax:?} refuses {call}\n{g}");
            // Free whitespace inside the JSON, an argument of the wrong
            // type, a function not offered, a missing argument: refused.
            let spaced = call.replace("\"city\":", "\"city\":  ");
            let wrong_type = call.replace("\"Paris\"", "7");
            let unknown = call.replace("get_weather", "get_wether");
            let missing = call.replace("\"city\":\"Paris\"", "");
            for bad in [&spaced, &wrong_type, &unknown, &missing] {
                assert!(!accepts(&g, bad), "{syntax:?} accepts {bad}");
            }
            assert!(!accepts(&g, "It is sunny."), "{syntax:?}: required");
            // Auto: text, or a call; text that opens like a call is a call.
            let auto = set(syntax, json!("auto")).grammar();
            assert!(accepts(&auto, call), "{syntax:?}\n{auto}");
            assert!(accepts(&auto, "It is sunny."), "{syntax:?}");
            assert!(!accepts(&auto, &wrong_type), "{syntax:?}");
            // A named function: only that one.
            let named = set(
                syntax,
                json!({"type": "function", "function": {"name": "get_time"}}),
            )
            .grammar();
            assert!(!accepts(&named, call), "{syntax:?}");
        }
        // Parallel calls where the format has them.
        let hermes = set(ToolSyntax::Hermes, json!("required")).grammar();
        let two = format!("{0}\n{0}", paris(ToolSyntax::Hermes));
        assert!(accepts(&hermes, &two));
        let mistral = set(ToolSyntax::MistralV3, json!("required")).grammar();
        let two = "[TOOL_CALLS][{\"name\":\"get_time\",\"arguments\":{}}, {\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}]";
        assert!(accepts(&mistral, two));
        let llama = set(ToolSyntax::Llama3Json, json!("required")).grammar();
        let two = format!("{0}; {0}", paris(ToolSyntax::Llama3Json));
        assert!(!accepts(&llama, &two));
        // Mistral's marker as its control token when the vocabulary has it.
        let t = parse(
            Some(weather()),
            None,
            None,
            &ToolFormat {
                call_token: Some(5),
                ..format(ToolSyntax::MistralV3)
            },
        )
        .unwrap()
        .unwrap();
        assert!(
            t.grammar().contains("calls: <[5]> \"[\" body"),
            "{}",
            t.grammar()
        );
    }

    /// Feeds `text` in `chunk`-byte pieces (on char boundaries) and collects.
    fn stream(tools: &ToolSet, text: &str, chunk: usize) -> Vec<Piece> {
        let mut s = CallSplitter::new(tools);
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let mut n = chunk.min(rest.len());
            while !rest.is_char_boundary(n) {
                n += 1;
            }
            out.extend(s.push(&rest[..n]));
            rest = &rest[n..];
        }
        out.extend(s.finish());
        out
    }

    #[test]
    fn splitter_reads_each_format_whole_and_streamed() {
        for syntax in FORMATS {
            let t = set(syntax, json!("auto"));
            let whole = split(&t, paris(syntax));
            assert_eq!(
                whole,
                Split {
                    content: String::new(),
                    calls: vec![ParsedCall {
                        name: "get_weather".into(),
                        arguments: r#"{"city":"Paris"}"#.into()
                    }],
                    unfinished: String::new(),
                },
                "{syntax:?}"
            );
            for chunk in [1, 3, 7] {
                let pieces = stream(&t, paris(syntax), chunk);
                // The name first, then argument fragments that add up.
                assert_eq!(pieces[0], Piece::CallStart("get_weather".into()));
                let args: String = pieces[1..]
                    .iter()
                    .map(|p| match p {
                        Piece::Args(a) => a.as_str(),
                        other => panic!("{syntax:?}: {other:?}"),
                    })
                    .collect();
                assert_eq!(args, r#"{"city":"Paris"}"#);
                if chunk == 1 {
                    assert!(pieces.len() > 3, "arguments stream: {pieces:?}");
                }
            }
            // Text is text, released as soon as it cannot open a call.
            let pieces = stream(&t, "Sunny, 22 C.", 2);
            assert_eq!(pieces[0], Piece::Text("Su".into()), "{syntax:?}");
            assert_eq!(split(&t, "Sunny, 22 C.").content, "Sunny, 22 C.");
        }
        // Hermes: an opener prefix is held back, then released as text.
        let t = set(ToolSyntax::Hermes, json!("auto"));
        let mut s = CallSplitter::new(&t);
        assert!(s.push("<tool").is_empty());
        assert_eq!(s.push("box"), vec![Piece::Text("<toolbox".into())]);
        assert_eq!(split(&t, "<tool").content, "<tool");
        // Two calls, and Mistral's marker left out of the text (a control
        // token the output does not show).
        let two = format!("{0}\n{0}", paris(ToolSyntax::Hermes));
        assert_eq!(split(&t, &two).calls.len(), 2);
        let m = set(ToolSyntax::MistralV3, json!("auto"));
        let marker_skipped = "[{\"name\":\"get_time\",\"arguments\":{}}, {\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}]";
        let got = split(&m, marker_skipped);
        assert_eq!(got.calls.len(), 2, "{got:?}");
        assert_eq!(got.calls[1].arguments, r#"{"city":"Oslo"}"#);
    }

    #[test]
    fn a_call_cut_short_is_content() {
        for syntax in FORMATS {
            let t = set(syntax, json!("required"));
            let call = paris(syntax);
            // Cut inside the arguments, and inside the name.
            for cut in [call.find("Par").unwrap(), call.find("weat").unwrap()] {
                let text = &call[..cut];
                let got = split(&t, text);
                assert_eq!(
                    got,
                    Split {
                        content: String::new(),
                        calls: Vec::new(),
                        unfinished: text.to_string(),
                    },
                    "{syntax:?}"
                );
                let pieces = stream(&t, text, 4);
                assert_eq!(
                    pieces.last(),
                    Some(&Piece::Unfinished {
                        text: text.to_string(),
                        started: cut > call.find("weat").unwrap()
                    }),
                    "{syntax:?}"
                );
            }
        }
        // After a whole call: that call stays, the cut one is content.
        let t = set(ToolSyntax::Hermes, json!("required"));
        let call = paris(ToolSyntax::Hermes);
        let text = format!("{call}\n<tool_call>\n{{\"name\":\"get_ti");
        let got = split(&t, &text);
        assert_eq!(got.calls.len(), 1);
        assert_eq!(got.unfinished, "<tool_call>\n{\"name\":\"get_ti");
        // A whole call followed by a cut closing tag is not cut short.
        let got = split(&t, &call[..call.len() - 3]);
        assert_eq!((got.calls.len(), got.unfinished.as_str()), (1, ""));
    }
}
