//! Structured output: the one constraint a request may carry and the
//! parameter it came from, out of `response_format`, vLLM's `guided_*` and
//! `structured_outputs` (at most one of them).

use kestrel_engine::Constraint;
use serde_json::Value;

use super::Fields;
use crate::openai::error::ApiError;

/// The structured-output constraint and the parameter it came from: at
/// most one of `response_format` (json), `guided_*` and
/// `structured_outputs`.
pub(super) fn constraint(f: &mut Fields) -> Result<Option<(Constraint, &'static str)>, ApiError> {
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
