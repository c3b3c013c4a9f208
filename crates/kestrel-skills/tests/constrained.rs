//! Constrained skills (JSON, regex, choice, grammar): masks only allow valid
//! continuations, finished outputs always parse/match (property tests over
//! random walks through the mask), EOS handling, the zombie rule, and batch
//! mask filling.

mod common;

use common::*;
use kestrel_pipeline::{
    FinishReason, MaskFiller, MaskRow, Outcome, SequenceSkill, TokenId, TokenMask, Verdict,
};
use kestrel_skills::testing::IM_END;
use kestrel_skills::{
    fill_batch_masks, ParallelMasks, Skill, SkillContext, SkillResult, SkillSpec,
};
use proptest::prelude::*;
use serde_json::json;

/// Walks the skill by sampling uniformly among allowed tokens (`picks` drive
/// the choice), checking that every allowed token is accepted. Returns the
/// result, the deltas' text, and whether the walk ended by itself.
fn random_walk(ctx: &SkillContext, s: &mut Skill, picks: &[u32]) -> (SkillResult, String, bool) {
    let vocab = ctx.vocab_size();
    let mut streamed = String::new();
    let mut reason = None;
    for &p in picks {
        assert!(s.is_constrained());
        let words = mask_of(s, vocab);
        let allowed = allowed(&words, vocab);
        assert!(
            !allowed.is_empty(),
            "a running constrained skill allows something"
        );
        let tok = allowed[p as usize % allowed.len()];
        let v = commit(s, tok);
        streamed.extend(s.take_delta().map(|d| d.text));
        if let Verdict::Stop(r) = v {
            reason = Some(r);
            break;
        }
    }
    let ended = reason.is_some();
    s.finish(Outcome::Finished(reason.unwrap_or(FinishReason::Length)));
    streamed.extend(s.take_delta().map(|d| d.text));
    let r = s.result().unwrap();
    assert_eq!(
        r.constraint_error, None,
        "an allowed token was rejected: {r:?}"
    );
    assert_eq!(streamed, r.text);
    (r, streamed, ended)
}

/// The bytes of the non-EOS tokens of an output.
fn raw_bytes(ctx: &SkillContext, toks: &[TokenId]) -> Vec<u8> {
    toks.iter()
        .filter(|&&t| t != IM_END)
        .flat_map(|&t| ctx.token_bytes(t).to_vec())
        .collect()
}

fn person_schema() -> serde_json::Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 4},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": false
    })
}

fn check_person(v: &serde_json::Value) {
    let o = v.as_object().expect("object");
    assert!(
        o.keys()
            .all(|k| ["name", "age", "ok", "tags"].contains(&k.as_str())),
        "{v}"
    );
    assert!(
        o["name"].as_str().is_some_and(|s| s.chars().count() <= 4),
        "{v}"
    );
    assert!(o["age"].as_u64().is_some_and(|a| a <= 150), "{v}");
    assert!(o["ok"].is_boolean(), "{v}");
    if let Some(t) = o.get("tags") {
        let t = t.as_array().expect("tags array");
        assert!(
            t.len() <= 2 && t.iter().all(|x| x == "a" || x == "b"),
            "{v}"
        );
    }
}

#[test]
fn json_forced_walk_parses_to_value() {
    let ctx = ctx();
    let mut s = skill(
        &ctx,
        SkillSpec::Json {
            schema: person_schema(),
        },
    );
    let text = r#"{"name": "é", "age": 42, "ok": true}"#;
    let vocab = ctx.vocab_size();
    let mut verdict = Verdict::Continue;
    for t in encode(&ctx, text) {
        assert_eq!(verdict, Verdict::Continue);
        let words = mask_of(&mut s, vocab);
        assert!(
            allowed(&words, vocab).contains(&t),
            "token {t} should be allowed"
        );
        verdict = commit(&mut s, t);
    }
    // The closing brace completes the grammar: the skill stops by itself.
    assert_eq!(verdict, Verdict::Stop(FinishReason::Stop));
    assert!(!s.is_constrained(), "finalized skills are unconstrained");
    s.finish(Outcome::Finished(FinishReason::Stop));
    let r = s.into_result().unwrap();
    assert_eq!(r.json, Some(json!({"name": "é", "age": 42, "ok": true})));
}

#[test]
fn json_mask_rejects_invalid_starts() {
    let ctx = ctx();
    let mut s = skill(
        &ctx,
        SkillSpec::Json {
            schema: person_schema(),
        },
    );
    let words = mask_of(&mut s, ctx.vocab_size());
    let ok = allowed(&words, ctx.vocab_size());
    assert!(ok.contains(&(b'{' as TokenId)));
    assert!(!ok.contains(&(b'[' as TokenId)));
    assert!(!ok.contains(&(b'a' as TokenId)));
    assert!(!ok.contains(&IM_END), "EOS only where the grammar may end");
}

#[test]
fn choice_mask_is_exactly_the_valid_prefixes() {
    let ctx = ctx();
    let choices = ["yes", "no", "hello world", "é!"];
    let mut s = skill(
        &ctx,
        SkillSpec::Choice(choices.iter().map(|c| c.to_string()).collect()),
    );
    let vocab = ctx.vocab_size();
    let mut text: Vec<u8> = Vec::new();
    // Follow "hello world" token by token and compare with brute force: the
    // mask is a subset of the valid prefixes (llguidance narrows fully forced
    // text to its canonical tokenization) and exactly them before any forcing.
    for (step, t) in encode(&ctx, "hello world").into_iter().enumerate() {
        let got = allowed(&mask_of(&mut s, vocab), vocab);
        let want: Vec<TokenId> = (0..vocab as TokenId)
            .filter(|&c| {
                let b = ctx.token_bytes(c);
                !ctx.is_special(c) && {
                    let mut cand = text.clone();
                    cand.extend_from_slice(b);
                    choices.iter().any(|ch| ch.as_bytes().starts_with(&cand))
                }
            })
            .collect();
        let at = String::from_utf8_lossy(&text).into_owned();
        assert!(
            got.iter().all(|t| want.contains(t)),
            "after {at:?}: {got:?} not within {want:?}"
        );
        assert!(
            got.contains(&t),
            "after {at:?}: the canonical token {t} is allowed"
        );
        if step == 0 {
            assert_eq!(got, want);
        }
        text.extend_from_slice(ctx.token_bytes(t));
        commit(&mut s, t);
    }
    assert!(!s.is_constrained());
    s.finish(Outcome::Finished(FinishReason::Stop));
    assert_eq!(s.result().unwrap().text, "hello world");
}

#[test]
fn regex_allows_eos_only_when_accepting() {
    let ctx = ctx();
    let mut s = skill(&ctx, SkillSpec::Regex("a+b?".into()));
    let vocab = ctx.vocab_size();
    assert!(!allowed(&mask_of(&mut s, vocab), vocab).contains(&IM_END));
    commit(&mut s, b'a' as TokenId);
    let ok = allowed(&mask_of(&mut s, vocab), vocab);
    assert!(ok.contains(&IM_END) && ok.contains(&(b'b' as TokenId)));
    assert_eq!(commit(&mut s, IM_END), Verdict::Stop(FinishReason::Stop));
    s.finish(Outcome::Finished(FinishReason::Stop));
    let r = s.result().unwrap();
    assert_eq!((r.text.as_str(), r.constraint_error), ("a", None));
    assert_eq!(r.token_ids, vec![b'a' as TokenId, IM_END]);
}

#[test]
fn eos_before_completion_is_reported_not_panicked() {
    let ctx = ctx();
    let mut s = skill(&ctx, SkillSpec::Regex("ab".into()));
    commit(&mut s, b'a' as TokenId);
    // A misbehaving sampler ignored the mask.
    assert_eq!(commit(&mut s, IM_END), Verdict::Stop(FinishReason::Eos));
    s.finish(Outcome::Finished(FinishReason::Eos));
    assert!(s.result().unwrap().constraint_error.is_some());
}

#[test]
fn disallowed_token_ends_the_request_with_an_error() {
    let ctx = ctx();
    let mut s = skill(
        &ctx,
        SkillSpec::Json {
            schema: json!({"type": "object"}),
        },
    );
    assert_eq!(
        commit(&mut s, b'x' as TokenId),
        Verdict::Stop(FinishReason::Stop)
    );
    s.finish(Outcome::Finished(FinishReason::Stop));
    let r = s.result().unwrap();
    assert!(r.constraint_error.is_some());
    assert_eq!(r.json, None);
}

#[test]
fn zombie_rule_finalized_skill_fills_all_ones() {
    let ctx = ctx();
    let vocab = ctx.vocab_size();
    let mut s = skill(&ctx, SkillSpec::Choice(vec!["yes".into()]));
    for t in encode(&ctx, "yes") {
        commit(&mut s, t);
    }
    assert!(!s.is_constrained());
    let words = mask_of(&mut s, vocab);
    assert_eq!(allowed(&words, vocab).len(), vocab);
    s.finish(Outcome::Finished(FinishReason::Stop));
    assert_eq!(allowed(&mask_of(&mut s, vocab), vocab).len(), vocab);
}

#[test]
fn length_cut_json_has_no_value() {
    let ctx = ctx();
    let mut s = skill(
        &ctx,
        SkillSpec::Json {
            schema: person_schema(),
        },
    );
    commit(&mut s, b'{' as TokenId);
    s.finish(Outcome::Finished(FinishReason::Length));
    let r = s.result().unwrap();
    assert_eq!((r.text.as_str(), r.json), ("{", None));
}

#[test]
fn batch_masks_match_per_sequence_masks() {
    let ctx = ctx();
    let vocab = ctx.vocab_size();
    let per_row = TokenMask::words_for(vocab);
    let mut text = skill(&ctx, SkillSpec::text());
    let mut json = skill(
        &ctx,
        SkillSpec::Json {
            schema: person_schema(),
        },
    );
    let mut rx = skill(&ctx, SkillSpec::Regex("[0-9]+".into()));
    let mut zombie = skill(&ctx, SkillSpec::Regex("x".into()));
    commit(&mut zombie, b'x' as TokenId);
    let want_json = mask_of(&mut json, vocab);
    let want_rx = mask_of(&mut rx, vocab);
    let mut rows: Vec<&mut Skill> = vec![&mut text, &mut json, &mut rx, &mut zombie];
    let mut words = vec![7u32; 4 * per_row];
    let mut flags = vec![false; 4];
    fill_batch_masks(&mut rows, vocab, &mut words, &mut flags);
    assert_eq!(flags, [false, true, true, false]);
    let row = |i: usize| &words[i * per_row..(i + 1) * per_row];
    assert_eq!(allowed(row(0), vocab).len(), vocab);
    assert_eq!(row(1), &want_json[..]);
    assert_eq!(row(2), &want_rx[..]);
    assert_eq!(allowed(row(3), vocab).len(), vocab);
}

/// The pipeline's parallel filler hands each skill its own row: the masks
/// equal those computed one by one.
#[test]
fn parallel_filler_matches_per_sequence_masks() {
    let ctx = ctx();
    let vocab = ctx.vocab_size();
    let per_row = TokenMask::words_for(vocab);
    let specs = [
        SkillSpec::Json {
            schema: person_schema(),
        },
        SkillSpec::Regex("[0-9]+".into()),
        SkillSpec::Choice(vec!["yes".into(), "no".into()]),
        SkillSpec::Regex("[a-z]+@[a-z]+".into()),
    ];
    let mut skills: Vec<Skill> = specs.iter().map(|s| skill(&ctx, s.clone())).collect();
    let want: Vec<Vec<u32>> = skills.iter_mut().map(|s| mask_of(s, vocab)).collect();
    let mut words = vec![0u32; skills.len() * per_row];
    let mut rows: Vec<MaskRow<'_>> = skills
        .iter_mut()
        .zip(words.chunks_mut(per_row))
        .map(|(s, w)| MaskRow {
            skill: s,
            drafts: &[],
            words: w,
        })
        .collect();
    ParallelMasks::always().fill(&mut rows, vocab);
    drop(rows);
    for (i, want) in want.iter().enumerate() {
        assert_eq!(&words[i * per_row..(i + 1) * per_row], &want[..], "row {i}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn json_walks_stay_valid(picks in prop::collection::vec(any::<u32>(), 1..120)) {
        let ctx = ctx();
        let mut s = skill(&ctx, SkillSpec::Json { schema: person_schema() });
        let (r, _, ended) = random_walk(&ctx, &mut s, &picks);
        if ended {
            let v = r.json.as_ref().unwrap_or_else(|| panic!("finished JSON must parse: {:?}", r.text));
            check_person(v);
        }
    }

    #[test]
    fn regex_walks_match(picks in prop::collection::vec(any::<u32>(), 1..12)) {
        let ctx = ctx();
        let mut s = skill(&ctx, SkillSpec::Regex("[a-c]{2,4}(x|é)".into()));
        let (r, _, ended) = random_walk(&ctx, &mut s, &picks);
        // Always a valid prefix (bytes: an unfinished walk may end mid-char)...
        let raw = raw_bytes(&ctx, &r.token_ids);
        prop_assert!(raw.iter().all(|b| b"abcx\xc3\xa9".contains(b)), "{:?}", raw);
        let chars: Vec<char> = r.text.chars().collect();
        if ended {
            // ...and a full match when finished.
            let (last, body) = chars.split_last().unwrap();
            prop_assert!(*last == 'x' || *last == 'é', "{}", r.text);
            prop_assert!((2..=4).contains(&body.len()) && body.iter().all(|c| ('a'..='c').contains(c)), "{}", r.text);
        }
    }

    #[test]
    fn choice_walks_pick_one(picks in prop::collection::vec(any::<u32>(), 1..16)) {
        let ctx = ctx();
        let choices = vec!["yes".to_string(), "no".into(), "hello world".into(), "é!".into(), "yesno".into()];
        let mut s = skill(&ctx, SkillSpec::Choice(choices.clone()));
        let (r, _, ended) = random_walk(&ctx, &mut s, &picks);
        // An unfinished walk may end inside a multi-byte char: compare bytes.
        let raw = raw_bytes(&ctx, &r.token_ids);
        prop_assert!(choices.iter().any(|c| c.as_bytes().starts_with(&raw)), "{:?}", raw);
        if ended {
            prop_assert!(choices.contains(&r.text), "{}", r.text);
        }
    }

    #[test]
    fn grammar_walks_are_balanced(picks in prop::collection::vec(any::<u32>(), 1..40)) {
        let ctx = ctx();
        let lark = "start: expr\nexpr: \"x\" | \"(\" expr (\",\" expr)* \")\"";
        let mut s = skill(&ctx, SkillSpec::Grammar(lark.into()));
        let (r, _, ended) = random_walk(&ctx, &mut s, &picks);
        let mut depth = 0i32;
        for c in r.text.chars() {
            prop_assert!("x(),".contains(c), "{}", r.text);
            depth += match c { '(' => 1, ')' => -1, _ => 0 };
            prop_assert!(depth >= 0);
        }
        if ended {
            prop_assert_eq!(depth, 0, "{}", r.text);
        }
    }
}

/// Speculative decoding's masks: `fill_masks_ahead` over a JSON output's
/// tokens gives, at every position, the mask the skill has once it really
/// consumed the tokens before it, and leaves the skill as it was; masks
/// after a draft the grammar refuses stay empty (never sampled).
#[test]
fn masks_ahead_equal_the_masks_after_consuming_the_drafts() {
    let ctx = ctx();
    let vocab = ctx.vocab_size();
    let wpr = TokenMask::words_for(vocab);
    let spec = SkillSpec::Json {
        schema: person_schema(),
    };
    let tokens = encode(&ctx, r#"{"name": "ab", "age": 42, "ok": false}"#);
    let mut ahead = skill(&ctx, spec.clone());
    assert!(ahead.looks_ahead());
    for start in (0..tokens.len() - 1).step_by(3) {
        let drafts = &tokens[start..(start + 5).min(tokens.len())];
        let before = mask_of(&mut ahead, vocab);
        let mut words = vec![0u32; (drafts.len() + 1) * wpr];
        ahead.fill_masks_ahead(drafts, &mut words, vocab);
        assert_eq!(mask_of(&mut ahead, vocab), before, "state restored");
        // The same positions reached for real, on a skill walked alike.
        let mut real = skill(&ctx, spec.clone());
        for &t in &tokens[..start] {
            commit(&mut real, t);
        }
        for (j, &d) in drafts.iter().enumerate() {
            assert_eq!(
                &words[j * wpr..(j + 1) * wpr],
                mask_of(&mut real, vocab),
                "position {j} after {start}"
            );
            if commit(&mut real, d) != Verdict::Continue {
                break;
            }
        }
        for &t in &tokens[start..(start + 3).min(tokens.len())] {
            commit(&mut ahead, t);
        }
    }
    // A draft the grammar refuses: the masks after it stay empty.
    let mut s = skill(&ctx, spec);
    let bad = encode(&ctx, "xy");
    let mut words = vec![0u32; (bad.len() + 1) * wpr];
    s.fill_masks_ahead(&bad, &mut words, vocab);
    assert!(!allowed(&words[..wpr], vocab).is_empty());
    assert!(words[wpr..].iter().all(|&w| w == 0));
}
