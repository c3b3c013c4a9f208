//! What a [`ToolSet`] tells the model and holds it to: the Hermes system
//! prompt for models whose template renders no tools, and the llguidance Lark
//! grammar in the format's syntax, one compact `%json` per function, so every
//! call parses and its arguments validate (holding only the properties the
//! schema lists, unless it allows more or the request asks for plain JSON
//! Schema: [`ToolSet::closed_objects`]).

use kestrel_model::ToolSyntax;
use serde_json::{json, Value};

use super::{Function, ToolChoice, ToolSet, MISTRAL_CALLS};
use crate::openai::schema::close_objects;

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
            let parameters = if self.closed_objects {
                close_objects(f.parameters.clone())
            } else {
                f.parameters.clone()
            };
            // Written by hand so that `name` comes before the arguments
            // (llguidance emits properties in schema order); compact, as
            // OpenAI writes arguments, so no tokens go to whitespace.
            let schema = json!({
                "type": "object",
                "properties": {"name": {"const": f.name}, (self.format.args_key()): parameters},
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
