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
use crate::error::{ConstraintCause, SkillError, TooComplex};

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

pub(crate) fn compile(ctx: &SkillContext, spec: &SkillSpec) -> Result<Compiled, SkillError> {
    let reject = |spec: &SkillSpec, source: ConstraintCause| match spec {
        SkillSpec::Json { .. } => SkillError::InvalidJsonSchema { source },
        SkillSpec::Regex(regex) => SkillError::InvalidRegex {
            regex: regex.clone(),
            source,
        },
        _ => SkillError::InvalidGrammar { source },
    };
    let too_complex = |source: TooComplex| SkillError::ConstraintTooComplex {
        kind: spec.kind().name(),
        source,
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
        .map_err(|e| reject(spec, ConstraintCause::new(e)))?;
    // The lexer builds its states lazily, one mask at a time: a lexeme
    // whose states grow expensive (nested counted repetitions) would pass
    // the first mask and fail tokens later. Explore every lexeme's first
    // states now, within a stated budget, so such a constraint is refused here.
    check_lexer_budget(&parser).map_err(too_complex)?;
    let mut matcher = Matcher::new(Ok(parser));
    if let Some(reason) = matcher.get_error() {
        return Err(reject(spec, ConstraintCause::new(reason)));
    }
    // Some constraints compile lazily and only fail when a mask is first
    // computed (past the engine's limits). Compute it now, at submission,
    // so such a request is refused instead of ending with a wrong output.
    if let Err(e) = matcher.compute_mask() {
        return Err(too_complex(TooComplex::Engine {
            source: ConstraintCause::new(e),
        }));
    }
    Ok(Compiled::Constrained(Box::new(matcher)))
}

/// What validation spends exploring a constraint's lexer
/// ([`check_lexer_budget`]), for each lexeme: its first `states_per_lexeme`
/// states, breadth first over every byte (states a forced run reaches are
/// explored too but not counted: a long literal does not use up the
/// horizon before the part of the constraint that follows it), and from
/// each of them the run of
/// bytes the lexer forces (the only byte it allows, again and again: what
/// the parser walks on its own after a token), each run within
/// `fuel_per_run`; `fuel` in all. One fuel point is one lexer expression
/// built, 10 to 50 ns: `(.{1,100}){1,100}` runs out of `fuel` in ~0.1 s,
/// `(a{1000}){1000}` (a forced run of a million bytes) out of
/// `fuel_per_run` in ~5 ms; a JSON Schema of a few fields, an e-mail or a
/// `[a-z]{1,1000}` regex takes 2 to 20 ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LexerBudget {
    pub states_per_lexeme: usize,
    pub fuel: u64,
    /// A forced run is walked by the parser on its own after a token, so
    /// it must be cheap: a tenth of one mask step's lexer fuel
    /// ([`crate::PARSER_LIMITS`]`.step_lexer_fuel`, which equals `fuel`:
    /// a step may spend what validation spent, so a constraint accepted
    /// here does not run out of fuel mid-generation).
    pub fuel_per_run: u64,
}

/// The budget every constraint is checked against at validation.
pub const LEXER_BUDGET: LexerBudget = LexerBudget {
    states_per_lexeme: 2_000,
    fuel: 2_000_000,
    fuel_per_run: 200_000,
};

/// Explores each lexeme of `parser`'s grammar in a lexer of its own (the
/// request's lexer is left as the first mask needs it) within
/// [`LEXER_BUDGET`]; the error says what ran out.
fn check_lexer_budget(parser: &llguidance::TokenParser) -> Result<(), TooComplex> {
    use llguidance::derivre::NextByte;
    use llguidance::earley::lexerspec::LexemeIdx;
    let spec = parser.parser.grammar().lexer_spec();
    let mut limits = crate::context::PARSER_LIMITS.clone();
    let mut lexer = spec
        .to_regex_vec(&mut limits)
        .map_err(|e| TooComplex::Engine {
            source: ConstraintCause::new(e),
        })?;
    lexer.set_fuel(LEXER_BUDGET.fuel);
    lexer.set_max_states(crate::context::PARSER_LIMITS.max_lexer_states);
    let out_of_fuel = |why: Option<String>| TooComplex::LexerBudget {
        fuel: LEXER_BUDGET.fuel,
        states: LEXER_BUDGET.states_per_lexeme,
        source: ConstraintCause::new(why.unwrap_or_default()),
    };
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
        // States a forced run reaches are walked by the parser without a
        // choice, so they do not count against the horizon: a constraint
        // whose expensive part sits behind a long literal (`={2100}...`) is
        // explored past it, as its first branching state is.
        let mut forced = llguidance::HashSet::default();
        let mut explored = 0;
        while let Some(state) = queue.pop_front() {
            if !forced.contains(&state) {
                explored += 1;
                if explored > LEXER_BUDGET.states_per_lexeme {
                    break;
                }
            }
            // The forced run from here, as the parser would walk it.
            let (mut at, run_start, mut bytes) = (state, lexer.total_fuel_spent(), 0);
            while let NextByte::ForcedByte(b) = lexer.next_byte(at) {
                at = lexer.transition(at, b);
                bytes += 1;
                if lexer.has_error() {
                    return Err(out_of_fuel(lexer.get_error()));
                }
                if lexer.total_fuel_spent() - run_start > LEXER_BUDGET.fuel_per_run {
                    return Err(TooComplex::ForcedRun {
                        fuel: LEXER_BUDGET.fuel_per_run,
                        bytes,
                    });
                }
                if at.is_dead() || !seen.insert(at) {
                    break;
                }
                forced.insert(at);
                queue.push_back(at);
            }
            for b in 0..=255u8 {
                let next = lexer.transition(state, b);
                if lexer.has_error() {
                    return Err(out_of_fuel(lexer.get_error()));
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
    use std::sync::Arc;

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
                SkillError::ConstraintTooComplex {
                    source: TooComplex::LexerBudget { fuel, .. },
                    ..
                } => assert_eq!(fuel, LEXER_BUDGET.fuel),
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

    /// A long literal before the expensive part does not hide it: the
    /// states of a forced run are explored without counting against the
    /// horizon. Branching states still do, so `[=-]{2100}` before it does
    /// hide it (the engine tests build that on purpose).
    #[test]
    fn a_long_literal_does_not_hide_what_follows_it() {
        let nested = "(.{1,100}){1,100}";
        match err(SkillSpec::Regex(format!("={{2100}}{nested}"))) {
            SkillError::ConstraintTooComplex {
                source: TooComplex::LexerBudget { .. },
                ..
            } => {}
            e => panic!("{e}"),
        }
        let ctx = testing::small_context();
        assert!(compile(&ctx, &SkillSpec::Regex(format!("[=-]{{2100}}{nested}"))).is_ok());
    }

    /// `(a{1000}){1000}` forces a million bytes from its first state: in
    /// each form it is refused at compile time, naming the forced run, where
    /// it used to pass and fail after the first token.
    #[test]
    fn a_forced_run_past_one_step_is_refused() {
        let rx = "(a{1000}){1000}";
        for spec in [
            SkillSpec::Regex(rx.into()),
            SkillSpec::Regex(format!("b|{rx}")),
            SkillSpec::Grammar(format!("start: \"x\" X\nX: /{rx}/")),
            SkillSpec::Json {
                schema: json!({"type": "object", "required": ["b"],
                    "properties": {"b": {"type": "string", "pattern": format!("^{rx}$")}}}),
            },
        ] {
            match err(spec.clone()) {
                SkillError::ConstraintTooComplex {
                    source: TooComplex::ForcedRun { fuel, bytes },
                    ..
                } => assert!(fuel == LEXER_BUDGET.fuel_per_run && bytes > 0),
                e => panic!("{spec:?}: {e}"),
            }
        }
    }

    /// The constraint engine's messages read without llguidance's
    /// `<non-verbose/>` marker, and the cause is kept as the source.
    #[test]
    fn engine_causes_are_kept_typed() {
        let e = err(SkillSpec::Grammar("start: foo".into()));
        let SkillError::InvalidGrammar { source } = &e else {
            panic!("{e}")
        };
        let text = source.to_string();
        assert!(!text.is_empty() && !text.contains("non-verbose"), "{text}");
        assert!(e.to_string().ends_with(&text), "{e}");
    }

    /// A context over a vocabulary with multi-letter pieces ("aaaa"), as
    /// real ones have: a token can take a lexer several states at once.
    fn synthetic_context() -> Arc<SkillContext> {
        static CTX: std::sync::OnceLock<Arc<SkillContext>> = std::sync::OnceLock::new();
        CTX.get_or_init(|| {
            SkillContext::new(crate::context::SkillContextConfig {
                tokenizer: Arc::new(testing::synthetic_tokenizer(8192)),
                eos_token_ids: vec![testing::IM_END],
                vocab_size: None,
                chat_template: None,
            })
            .expect("synthetic context builds")
        })
        .clone()
    }

    /// One nested counted repetition, in one of the forms a request can
    /// carry it.
    fn nested_spec(form: u8, atom: &str, counts: &[(u32, u32)]) -> SkillSpec {
        let mut rx = atom.to_string();
        for &(lo, hi) in counts {
            rx = if lo == hi {
                format!("({rx}){{{lo}}}")
            } else {
                format!("({rx}){{{lo},{hi}}}")
            };
        }
        match form {
            0 => SkillSpec::Regex(rx),
            1 => SkillSpec::Regex(format!("z|{rx}")),
            2 => SkillSpec::Grammar(format!("start: \"x\" X\nX: /{rx}/")),
            _ => SkillSpec::Json {
                schema: json!({"type": "object", "required": ["b"],
                    "properties": {"b": {"type": "string", "pattern": format!("^{rx}$")}}}),
            },
        }
    }

    use proptest::prelude::*;

    /// Whether `spec` is refused as too complex at compile time, or else
    /// generates 24 tokens (the longest allowed token, a run such as
    /// "aaaa", and the lowest id, alternately) or to its end without the
    /// constraint engine failing; the failure, if it does.
    fn refused_or_generates(ctx: &SkillContext, spec: &SkillSpec) -> Result<(), String> {
        let mut matcher = match compile(ctx, spec) {
            Err(SkillError::ConstraintTooComplex { .. }) => return Ok(()),
            Err(e) => return Err(format!("{spec:?}: {e}")),
            Ok(Compiled::Text(_)) => unreachable!("a constraint"),
            Ok(Compiled::Constrained(m)) => m,
        };
        for step in 0..24 {
            let mask = matcher
                .compute_mask_or_eos()
                .map_err(|e| format!("{spec:?} mask {step}: {e}"))?;
            // Text tokens only: the output ends when EOS is all that is left.
            let allowed: Vec<TokenId> = (0..ctx.vocab_size() as TokenId)
                .filter(|&t| mask.is_allowed(t) && !ctx.is_eos(t))
                .collect();
            let pick = if step % 2 == 0 {
                allowed.iter().max_by_key(|&&t| ctx.token_bytes(t).len())
            } else {
                allowed.first()
            };
            let Some(&token) = pick else { break };
            matcher
                .consume_token(token)
                .map_err(|e| format!("{spec:?} token {step}: {e}"))?;
            if matcher.is_stopped() {
                break;
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        /// Nested counted repetitions, as a regex, an alternative of one, a
        /// Lark terminal and a JSON Schema pattern, with counts growing
        /// from 1 to 1000 (each level's count that one, or a tenth of it;
        /// exact, or a range from 1): each is refused as too complex up
        /// front or generates without the constraint engine failing (the
        /// request's INTERNAL).
        #[test]
        fn nested_repetitions_are_refused_up_front_or_generate(
            form in 0u8..4,
            atom in proptest::sample::select(vec!["a", "[ab]", "."]),
            levels in proptest::collection::vec((proptest::bool::ANY, proptest::bool::ANY), 2..=3),
        ) {
            let ctx = synthetic_context();
            for c in [1u32, 3, 10, 30, 100, 300, 1000] {
                let counts: Vec<(u32, u32)> = levels
                    .iter()
                    .map(|&(tenth, range)| {
                        let n = if tenth { (c / 10).max(1) } else { c };
                        if range { (1, n) } else { (n, n) }
                    })
                    .collect();
                let spec = nested_spec(form, atom, &counts);
                refused_or_generates(&ctx, &spec).map_err(TestCaseError::fail)?;
            }
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
