//! Output text back into content and tool calls: [`CallSplitter`] reads it
//! whole or streamed (content, call headers and argument fragments), and
//! hands back the text of a call the output was cut inside; [`split`] is
//! the whole-text answer.

use super::{ToolChoice, ToolFormat, ToolSet};

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
