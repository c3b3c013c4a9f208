//! The chat's tools: `tools` / `tool_choice` and `parallel_tool_calls`, or the
//! legacy `functions` / `function_call` read as the same [`ToolSet`], with
//! errors that name the parameters the client sent.

use serde_json::Value;

use super::Fields;
use crate::openai::error::ApiError;
use crate::openai::tools::{self, ToolFormat, ToolSet};

/// The chat's tools: `tools` / `tool_choice`, or the legacy `functions` /
/// `function_call` mapped onto them (one `ToolSet` either way; errors name
/// the legacy parameters). The two forms do not mix.
pub(super) fn chat_tools(f: &mut Fields, format: &ToolFormat) -> Result<Option<ToolSet>, ApiError> {
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
