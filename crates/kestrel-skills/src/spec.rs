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
    /// stop string (which is not part of the output). None of them ends
    /// the output before `min_tokens` tokens: the first `min_tokens`
    /// tokens are masked from being EOS or a stop token id, and a stop
    /// string counts only once that many tokens are committed (vLLM's
    /// `min_tokens`).
    Text {
        stop: Vec<String>,
        stop_token_ids: Vec<TokenId>,
        ignore_eos: bool,
        #[serde(default)]
        min_tokens: u32,
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
            min_tokens: 0,
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
    /// No stop condition ends the output before this many tokens.
    pub min_tokens: u32,
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
            min_tokens,
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
                min_tokens: *min_tokens,
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
    // The lexer builds its states lazily, one mask at a time: a lexeme
    // whose states grow expensive (nested counted repetitions) would pass
    // the first mask and fail tokens later. Explore every lexeme's states
    // now, within a stated budget, so such a constraint is refused here.
    check_lexer_budget(&parser).map_err(|reason| SkillError::ConstraintTooComplex {
        kind: spec.kind().name(),
        reason,
    })?;
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

/// What validation spends exploring a constraint's lexer
/// ([`check_lexer_budget`]): the first `states_per_lexeme` states of each
/// lexeme, breadth first over every byte, within `fuel` in all (one fuel
/// point is one lexer expression built, 10 to 50 ns: `(.{1,100}){1,100}`
/// runs out in ~0.1 s; a JSON Schema of a few fields, an e-mail or a
/// `[a-z]{1,1000}` regex takes 2 to 20 ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LexerBudget {
    pub states_per_lexeme: usize,
    pub fuel: u64,
}

/// The budget every constraint is checked against at validation.
pub const LEXER_BUDGET: LexerBudget = LexerBudget {
    states_per_lexeme: 2_000,
    fuel: 2_000_000,
};

/// Explores each lexeme of `parser`'s grammar in a lexer of its own (the
/// request's lexer is left as the first mask needs it) within
/// [`LEXER_BUDGET`]; the error says what ran out.
fn check_lexer_budget(parser: &llguidance::TokenParser) -> Result<(), String> {
    use llguidance::earley::lexerspec::LexemeIdx;
    let spec = parser.parser.grammar().lexer_spec();
    let mut limits = crate::context::PARSER_LIMITS.clone();
    let mut lexer = spec
        .to_regex_vec(&mut limits)
        .map_err(|e| engine_reason(&e))?;
    lexer.set_fuel(LEXER_BUDGET.fuel);
    lexer.set_max_states(crate::context::PARSER_LIMITS.max_lexer_states);
    let mut seen = llguidance::HashSet::default();
    let mut queue = std::collections::VecDeque::new();
    for i in 0..spec.lexemes.len() {
        let mut only = spec.alloc_lexeme_set();
        only.add(LexemeIdx::new(i));
        let start = lexer.initial_state(&only);
        seen.clear();
        queue.clear();
        seen.insert(start);
        queue.push_back(start);
        let mut explored = 0;
        while let Some(state) = queue.pop_front() {
            explored += 1;
            if explored > LEXER_BUDGET.states_per_lexeme {
                break;
            }
            for b in 0..=255u8 {
                let next = lexer.transition(state, b);
                if lexer.has_error() {
                    let why = lexer.get_error().unwrap_or_default();
                    return Err(format!(
                        "its lexer needs more than {} fuel for the first {} states of a lexeme ({why})",
                        LEXER_BUDGET.fuel, LEXER_BUDGET.states_per_lexeme
                    ));
                }
                if !next.is_dead() && seen.insert(next) {
                    queue.push_back(next);
                }
            }
        }
    }
    Ok(())
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
                ignore_eos: false,
                min_tokens: 0,
            }),
            SkillError::EmptyStopString { index: 0 }
        ));
        assert!(matches!(
            err(SkillSpec::Text {
                stop: vec![],
                stop_token_ids: vec![1 << 30],
                ignore_eos: false,
                min_tokens: 0,
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

    /// Nested counted repetition past [`LEXER_BUDGET`] is refused at
    /// compile time in each form, including those whose first mask is
    /// cheap (a Lark rule after a literal, a JSON Schema pattern).
    #[test]
    fn constraints_past_the_lexer_budget_are_refused() {
        let nested = "(.{1,100}){1,100}";
        for spec in [
            SkillSpec::Regex(nested.into()),
            SkillSpec::Grammar(format!("start: \"x\" X\nX: /{nested}/")),
            SkillSpec::Json {
                schema: json!({"type": "object", "required": ["b"],
                    "properties": {"b": {"type": "string", "pattern": format!("^{nested}$")}}}),
            },
        ] {
            match err(spec.clone()) {
                SkillError::ConstraintTooComplex { reason, .. } => {
                    assert!(reason.contains("2000000 fuel"), "{reason}")
                }
                e => panic!("{spec:?}: {e}"),
            }
        }
        let ctx = testing::small_context();
        for ok in [
            "(a{1,10}){1,10}",
            "[a-z]{1,1000}",
            "[a-z0-9.]{1,64}@[a-z0-9.-]{1,255}",
        ] {
            assert!(compile(&ctx, &SkillSpec::Regex(ok.into())).is_ok(), "{ok}");
        }
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
