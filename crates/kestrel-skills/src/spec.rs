//! What a request asks for ([`SkillSpec`], [`SkillOptions`]) and its
//! validation into a compiled constraint.
//!
//! Validation runs at submission: stop lists are checked and grammars are
//! compiled by llguidance (JSON schema, regex, choice and Lark all become one
//! `TokenParser`), so an invalid request never reaches the scheduler. Compiling
//! costs from microseconds (a regex) to milliseconds (a large schema).

use kestrel_pipeline::TokenId;
use llguidance::api::TopLevelGrammar;
use llguidance::Matcher;
use serde::{Deserialize, Serialize};

use crate::context::SkillContext;
use crate::error::SkillError;

/// The kind of output a request wants.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum SkillSpec {
    /// Free text, ended by EOS (unless `ignore_eos`), a stop token id, or a
    /// stop string (which is not part of the output).
    Text {
        stop: Vec<String>,
        stop_token_ids: Vec<TokenId>,
        ignore_eos: bool,
    },
    /// JSON matching a JSON Schema; the result carries the parsed value.
    Json { schema: serde_json::Value },
    /// Text matching a regular expression (Rust `regex` syntax, anchored).
    Regex(String),
    /// Exactly one of the given strings.
    Choice(Vec<String>),
    /// Text in the language of a Lark-style context-free grammar (llguidance
    /// dialect, rule `start`).
    Grammar(String),
}

impl SkillSpec {
    /// Unconstrained text with no stop conditions besides EOS.
    pub fn text() -> Self {
        SkillSpec::Text {
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
        }
    }

    pub fn kind(&self) -> SkillKind {
        match self {
            SkillSpec::Text { .. } => SkillKind::Text,
            SkillSpec::Json { .. } => SkillKind::Json,
            SkillSpec::Regex(_) => SkillKind::Regex,
            SkillSpec::Choice(_) => SkillKind::Choice,
            SkillSpec::Grammar(_) => SkillKind::Grammar,
        }
    }
}

/// The variant of a [`SkillSpec`], without its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SkillKind {
    Text,
    Json,
    Regex,
    Choice,
    Grammar,
}

impl SkillKind {
    /// The kind's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            SkillKind::Text => "text",
            SkillKind::Json => "JSON schema",
            SkillKind::Regex => "regex",
            SkillKind::Choice => "choice",
            SkillKind::Grammar => "grammar",
        }
    }
}

/// Options common to every skill.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkillOptions {
    /// Record the chosen token's log-probability for every step.
    pub logprobs: bool,
    /// How many top alternatives to keep per step (needs `logprobs`); the
    /// engine asks the sampler for this many.
    pub top_logprobs: usize,
}

/// Text rules checked on every committed token of a text skill.
#[derive(Debug, Clone, Default)]
pub(crate) struct TextRules {
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<TokenId>,
    pub ignore_eos: bool,
}

/// A spec after validation: text rules or a started grammar matcher.
pub(crate) enum Compiled {
    Text(TextRules),
    Constrained(Box<Matcher>),
}

/// Lark for "exactly one of `choices`": string literals are JSON-quoted,
/// which is how llguidance's Lark reads them.
fn choice_grammar(choices: &[String]) -> Result<String, SkillError> {
    if choices.is_empty() {
        return Err(SkillError::EmptyChoice);
    }
    let mut lark = String::from("start: ");
    for (index, c) in choices.iter().enumerate() {
        if c.is_empty() {
            return Err(SkillError::EmptyChoiceOption { index });
        }
        if index > 0 {
            lark.push_str(" | ");
        }
        // Serializing a &str cannot fail.
        lark.push_str(&serde_json::to_string(c).unwrap_or_default());
    }
    Ok(lark)
}

/// The constraint engine's error as one line: llguidance appends a
/// `<non-verbose/>` marker (and, verbose, the grammar) after the reason.
pub(crate) fn engine_reason(e: &impl std::fmt::Display) -> String {
    let text = e.to_string();
    text.lines().next().unwrap_or_default().trim().to_string()
}

pub(crate) fn compile(ctx: &SkillContext, spec: &SkillSpec) -> Result<Compiled, SkillError> {
    let reject = |spec: &SkillSpec, reason: String| match spec {
        SkillSpec::Json { .. } => SkillError::InvalidJsonSchema { reason },
        SkillSpec::Regex(regex) => SkillError::InvalidRegex {
            regex: regex.clone(),
            reason,
        },
        _ => SkillError::InvalidGrammar { reason },
    };
    let grammar = match spec {
        SkillSpec::Text {
            stop,
            stop_token_ids,
            ignore_eos,
        } => {
            if let Some(index) = stop.iter().position(String::is_empty) {
                return Err(SkillError::EmptyStopString { index });
            }
            let vocab_size = ctx.vocab_size();
            if let Some(&token) = stop_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
                return Err(SkillError::StopTokenOutOfRange { token, vocab_size });
            }
            return Ok(Compiled::Text(TextRules {
                stop: stop.clone(),
                stop_token_ids: stop_token_ids.clone(),
                ignore_eos: *ignore_eos,
            }));
        }
        SkillSpec::Json { schema } => TopLevelGrammar::from_json_schema(schema.clone()),
        SkillSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
        SkillSpec::Choice(choices) => TopLevelGrammar::from_lark(choice_grammar(choices)?),
        SkillSpec::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
    };
    let parser = ctx
        .parser_factory()
        .create_parser(grammar)
        .map_err(|e| reject(spec, e.to_string()))?;
    let mut matcher = Matcher::new(Ok(parser));
    if let Some(reason) = matcher.get_error() {
        return Err(reject(spec, reason));
    }
    // Some constraints compile lazily and only fail when a mask is first
    // computed (past the engine's limits). Compute it now, at submission,
    // so such a request is refused instead of ending with a wrong output.
    if let Err(e) = matcher.compute_mask() {
        return Err(SkillError::ConstraintTooComplex {
            kind: spec.kind().name(),
            reason: engine_reason(&e),
        });
    }
    Ok(Compiled::Constrained(Box::new(matcher)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing;
    use serde_json::json;

    fn err(spec: SkillSpec) -> SkillError {
        match compile(&testing::small_context(), &spec) {
            Ok(_) => panic!("{spec:?} should be rejected"),
            Err(e) => e,
        }
    }

    #[test]
    fn invalid_specs_are_rejected_with_typed_errors() {
        assert!(matches!(
            err(SkillSpec::Regex("a(b".into())),
            SkillError::InvalidRegex { .. }
        ));
        assert!(matches!(
            err(SkillSpec::Grammar("start: foo".into())),
            SkillError::InvalidGrammar { .. }
        ));
        assert!(matches!(
            err(SkillSpec::Grammar("nonsense ::: ".into())),
            SkillError::InvalidGrammar { .. }
        ));
        assert!(matches!(
            err(SkillSpec::Json {
                schema: json!({"type": "no-such-type"})
            }),
            SkillError::InvalidJsonSchema { .. }
        ));
        assert!(matches!(
            err(SkillSpec::Choice(vec![])),
            SkillError::EmptyChoice
        ));
        assert!(matches!(
            err(SkillSpec::Choice(vec!["a".into(), String::new()])),
            SkillError::EmptyChoiceOption { index: 1 }
        ));
        assert!(matches!(
            err(SkillSpec::Text {
                stop: vec![String::new()],
                stop_token_ids: vec![],
                ignore_eos: false
            }),
            SkillError::EmptyStopString { index: 0 }
        ));
        assert!(matches!(
            err(SkillSpec::Text {
                stop: vec![],
                stop_token_ids: vec![1 << 30],
                ignore_eos: false
            }),
            SkillError::StopTokenOutOfRange { .. }
        ));
    }

    #[test]
    fn error_messages_are_clear() {
        let e = err(SkillSpec::Regex("a(b".into()));
        let msg = e.to_string();
        assert!(msg.starts_with("invalid regex \"a(b\""), "{msg}");
    }

    #[test]
    fn choice_literals_are_escaped() {
        let g = choice_grammar(&["a\"b".into(), "c\\d".into()]).unwrap();
        assert_eq!(g, r#"start: "a\"b" | "c\\d""#);
        assert!(compile(
            &testing::small_context(),
            &SkillSpec::Choice(vec!["a\"b".into(), "\n".into()])
        )
        .is_ok());
    }
}
