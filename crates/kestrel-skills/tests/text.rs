//! Text skill: EOS, stop ids, stop strings across token boundaries, UTF-8
//! streaming, logprobs, and the property that streamed deltas always
//! concatenate to the final text.

mod common;

use common::*;
use kestrel_pipeline::{CommittedToken, FinishReason, Outcome, SequenceSkill, TokenId, Verdict};
use kestrel_skills::testing::{ENDOFTEXT, IM_END, IM_START};
use kestrel_skills::{Skill, SkillOptions, SkillSpec};
use proptest::prelude::*;

fn text_spec(stop: &[&str], stop_token_ids: &[TokenId], ignore_eos: bool) -> SkillSpec {
    SkillSpec::Text {
        stop: stop.iter().map(|s| s.to_string()).collect(),
        stop_token_ids: stop_token_ids.to_vec(),
        ignore_eos,
        min_tokens: 0,
    }
}

fn bytes(s: &str) -> Vec<TokenId> {
    s.bytes().map(TokenId::from).collect()
}

#[test]
fn eos_ends_with_eos_and_is_not_text() {
    let ctx = ctx();
    let mut s = skill(&ctx, SkillSpec::text());
    assert!(!s.is_constrained());
    let mut toks = encode(&ctx, "hello world");
    toks.push(IM_END);
    toks.extend(bytes("ignored"));
    let (r, deltas) = run(&mut s, &toks, |_| true);
    assert_eq!(r.text, "hello world");
    assert_eq!(r.finish_reason(), Some(FinishReason::Eos));
    assert_eq!(
        r.token_ids,
        [&encode(&ctx, "hello world")[..], &[IM_END]].concat()
    );
    assert_eq!(concat(&deltas), r.text);
    assert_eq!(r.json, None);
}

#[test]
fn ignore_eos_and_stop_token_ids() {
    let ctx = ctx();
    let mut s = skill(&ctx, text_spec(&[], &[ENDOFTEXT], true));
    let toks = [
        bytes("ab"),
        vec![IM_END],
        bytes("c"),
        vec![ENDOFTEXT],
        bytes("zz"),
    ]
    .concat();
    let (r, _) = run(&mut s, &toks, |_| true);
    // EOS is ignored (and, being special, not text); the stop id ends the request.
    assert_eq!(r.text, "abc");
    assert_eq!(r.finish_reason(), Some(FinishReason::Stop));
    assert_eq!(r.token_ids.len(), 5);
}

/// vLLM's `min_tokens`: the first `min_tokens` tokens are masked from
/// being EOS or a stop id, a stop string counts from the `min_tokens`-th
/// token on, and after that the skill is unconstrained again.
#[test]
fn min_tokens_holds_every_stop_condition_back() {
    let ctx = ctx();
    let vocab = ctx.vocab_size();
    let spec = SkillSpec::Text {
        stop: vec!["a".into()],
        stop_token_ids: vec![ENDOFTEXT],
        ignore_eos: false,
        min_tokens: 3,
    };
    let mut s = skill(&ctx, spec.clone());
    for _ in 0..3 {
        assert!(s.is_constrained() && s.looks_ahead());
        let allowed = allowed(&mask_of(&mut s, vocab), vocab);
        assert!(!allowed.contains(&IM_END) && !allowed.contains(&ENDOFTEXT));
        assert!(allowed.contains(&(b'a' as TokenId)) && allowed.contains(&IM_START));
        // "a" is a stop string, but not before the third token.
        if s.token_ids().len() < 2 {
            assert_eq!(commit(&mut s, b'a' as TokenId), Verdict::Continue);
        } else {
            assert_eq!(
                commit(&mut s, b'b' as TokenId),
                Verdict::Continue,
                "a stop string that ended early does not match later"
            );
        }
    }
    assert!(!s.is_constrained());
    assert_eq!(commit(&mut s, ENDOFTEXT), Verdict::Stop(FinishReason::Stop));
    s.finish(Outcome::Finished(FinishReason::Stop));
    assert_eq!(s.result().unwrap().text, "aab");

    // The third token may complete a stop string; EOS ends it after that.
    let (r, _) = run(&mut skill(&ctx, spec.clone()), &bytes("bba"), |_| true);
    assert_eq!(
        (r.text.as_str(), r.finish_reason()),
        ("bb", Some(FinishReason::Stop))
    );
    let toks = [bytes("bbb"), vec![IM_END]].concat();
    let (r, _) = run(&mut skill(&ctx, spec.clone()), &toks, |_| true);
    assert_eq!(
        (r.text.as_str(), r.finish_reason()),
        ("bbb", Some(FinishReason::Eos))
    );

    // Drafted positions get the mask their position calls for.
    let mut s = skill(&ctx, spec);
    commit(&mut s, b'b' as TokenId);
    let wpr = kestrel_pipeline::TokenMask::words_for(vocab);
    let mut words = vec![0u32; wpr * 3];
    s.fill_masks_ahead(&[b'b' as TokenId, b'b' as TokenId], &mut words, vocab);
    let banned = |m: &[u32]| !allowed(m, vocab).contains(&IM_END);
    assert!(banned(&words[..wpr]) && banned(&words[wpr..2 * wpr]));
    assert!(!banned(&words[2 * wpr..]), "the fourth token may be EOS");
    assert_eq!(s.token_ids().len(), 1, "looking ahead changes nothing");
}

#[test]
fn special_tokens_are_not_text() {
    let ctx = ctx();
    let mut s = skill(&ctx, SkillSpec::text());
    let toks = [bytes("a"), vec![IM_START], bytes("b")].concat();
    let (r, _) = run(&mut s, &toks, |_| true);
    assert_eq!(r.text, "ab");
    assert_eq!(r.finish_reason(), Some(FinishReason::Length));
}

#[test]
fn stop_string_across_tokens_is_held_back_and_cut() {
    let ctx = ctx();
    let mut s = skill(&ctx, text_spec(&["END"], &[], false));
    let mut step = |t: &str| {
        let mut last = Verdict::Continue;
        for tok in encode(&ctx, t) {
            last = commit(&mut s, tok);
        }
        (last, s.take_delta().map(|d| d.text).unwrap_or_default())
    };
    assert_eq!(step("abc "), (Verdict::Continue, "abc ".into()));
    // "E" could start "END": held.
    assert_eq!(step("E"), (Verdict::Continue, "".into()));
    // "EN" is one merged token in the fixture; still a prefix.
    assert_eq!(step("N"), (Verdict::Continue, "".into()));
    assert_eq!(step("D"), (Verdict::Stop(FinishReason::Stop), "".into()));
    s.finish(Outcome::Finished(FinishReason::Stop));
    assert!(s.take_delta().is_none_or(|d| d.text.is_empty()));
    assert_eq!(s.result().unwrap().text, "abc ");
}

#[test]
fn held_back_text_is_released_when_it_diverges_or_ends() {
    let ctx = ctx();
    let mut s = skill(&ctx, text_spec(&["END", "\n\n"], &[], false));
    for t in bytes("xEN") {
        assert_eq!(commit(&mut s, t), Verdict::Continue);
    }
    assert_eq!(s.take_delta().unwrap().text, "x");
    commit(&mut s, b'!' as TokenId);
    assert_eq!(s.take_delta().unwrap().text, "EN!");
    commit(&mut s, b'\n' as TokenId);
    assert_eq!(s.take_delta().unwrap().text, "");
    // The request ends by length: held text is part of the output.
    s.finish(Outcome::Finished(FinishReason::Length));
    assert_eq!(s.take_delta().unwrap().text, "\n");
    assert_eq!(s.result().unwrap().text, "xEN!\n");
}

#[test]
fn stop_string_inside_one_token() {
    let ctx = ctx();
    // "hello" is a single token in the fixture; the stop "ell" is inside it.
    let mut s = skill(&ctx, text_spec(&["ell"], &[], false));
    let toks = encode(&ctx, "hello");
    assert_eq!(toks.len(), 1);
    let (r, deltas) = run(&mut s, &toks, |_| true);
    assert_eq!(r.text, "h");
    assert_eq!(concat(&deltas), "h");
    assert_eq!(r.finish_reason(), Some(FinishReason::Stop));
}

#[test]
fn a_stop_that_completes_first_wins_over_one_starting_earlier() {
    let ctx = ctx();
    // After "\n" "N" the stop "N" is complete; "\nN " (which starts
    // earlier) would need a token that is never sampled.
    let mut s = skill(&ctx, text_spec(&["\nN ", "N"], &[], false));
    let toks = bytes("\nN ");
    let (r, deltas) = run(&mut s, &toks, |_| true);
    assert_eq!(r.text, "\n");
    assert_eq!(concat(&deltas), "\n");
    assert_eq!(r.finish_reason(), Some(FinishReason::Stop));
    assert_eq!(reference(&ctx, &toks, &["\nN ".into(), "N".into()]).0, "\n");
}

#[test]
fn utf8_split_across_tokens_is_never_broken() {
    let ctx = ctx();
    let mut s = skill(&ctx, SkillSpec::text());
    let text = "a😀é中";
    // Byte tokens split every multi-byte char.
    let mut seen = String::new();
    for t in bytes(text) {
        commit(&mut s, t);
        if let Some(d) = s.take_delta() {
            // Every delta is valid UTF-8 by type; check it is whole chars of the text.
            seen.push_str(&d.text);
            assert!(text.starts_with(&seen));
        }
    }
    assert_eq!(seen, text);
    // "é" as a merged token also works.
    assert_eq!(encode(&ctx, "é").len(), 1);
}

#[test]
fn dangling_partial_char_becomes_replacement_at_the_end() {
    let ctx = ctx();
    let mut s = skill(&ctx, SkillSpec::text());
    let (r, deltas) = run(&mut s, &[b'a' as TokenId, 0xF0, 0x9F], |_| true);
    assert_eq!(r.text, "a\u{FFFD}");
    assert_eq!(concat(&deltas), r.text);
}

#[test]
fn logprobs_are_carried_to_deltas_and_result() {
    let ctx = ctx();
    let opts = SkillOptions {
        logprobs: true,
        top_logprobs: 1,
    };
    let mut s = Skill::new(&ctx, &SkillSpec::text(), opts).unwrap();
    let top = [(b'a' as TokenId, -0.1f32), (b'b' as TokenId, -2.0)];
    s.consume(&CommittedToken {
        token: b'a' as TokenId,
        logprob: Some(-0.1),
        top_logprobs: &top,
        coord: 0.0,
        size: [0.0; 2],
    });
    let d = s.take_delta().unwrap();
    assert_eq!(d.logprobs.len(), 1);
    assert_eq!(d.logprobs[0].top, vec![(b'a' as TokenId, -0.1)]);
    s.consume(&CommittedToken {
        token: IM_END,
        logprob: Some(-0.5),
        top_logprobs: &[],
        coord: 0.0,
        size: [0.0; 2],
    });
    s.finish(Outcome::Finished(FinishReason::Eos));
    let r = s.into_result().unwrap();
    let lps = r.logprobs.unwrap();
    assert_eq!(lps.len(), 2);
    assert_eq!(lps[1].logprob, Some(-0.5));
}

#[test]
fn logprobs_off_by_default() {
    let ctx = ctx();
    let mut s = skill(&ctx, SkillSpec::text());
    s.consume(&CommittedToken {
        token: 1,
        logprob: Some(-1.0),
        top_logprobs: &[],
        coord: 0.0,
        size: [0.0; 2],
    });
    s.finish(Outcome::Finished(FinishReason::Length));
    assert!(s.result().unwrap().logprobs.is_none());
}

/// Reference semantics: decode the non-special tokens before the first EOS
/// lossily, token by token, and stop at the first token after which a stop
/// string is in the text.
fn reference(
    ctx: &kestrel_skills::SkillContext,
    toks: &[TokenId],
    stops: &[String],
) -> (String, FinishReason) {
    let end = toks.iter().position(|&t| t == IM_END);
    let body = &toks[..end.unwrap_or(toks.len())];
    // Generation stops at the first token after which the text holds a stop
    // string (the tokens after it are never sampled), cut at the earliest
    // start among the stop strings then present. The text after a token is
    // its bytes so far decoded, less a trailing character still incomplete.
    let mut raw = Vec::new();
    for &t in body.iter().filter(|&&t| !ctx.is_special(t)) {
        raw.extend_from_slice(ctx.token_bytes(t));
        let text = String::from_utf8_lossy(&raw[..complete_len(&raw)]).into_owned();
        if let Some(p) = stops.iter().filter_map(|s| text.find(s.as_str())).min() {
            return (text[..p].to_owned(), FinishReason::Stop);
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    match end {
        Some(_) => (text, FinishReason::Eos),
        None => (text, FinishReason::Length),
    }
}

/// `bytes.len()` less a trailing UTF-8 sequence that is valid so far but
/// incomplete (a streaming decoder holds it for the next token).
fn complete_len(bytes: &[u8]) -> usize {
    match std::str::from_utf8(bytes) {
        Err(e) if e.error_len().is_none() => e.valid_up_to(),
        _ => {
            // Errors earlier on: only the tail's own validity matters.
            (bytes.len().saturating_sub(3)..bytes.len())
                .find(|&i| {
                    std::str::from_utf8(&bytes[i..])
                        .is_err_and(|e| e.valid_up_to() == 0 && e.error_len().is_none())
                })
                .unwrap_or(bytes.len())
        }
    }
}

fn token_strategy() -> impl Strategy<Value = TokenId> {
    // Mostly a small alphabet (so stop strings occur), some arbitrary bytes
    // (multi-byte and malformed UTF-8), merges, and rare specials/EOS.
    prop_oneof![
        8 => prop::sample::select(b"abE ND\n".to_vec()).prop_map(TokenId::from),
        3 => 0u32..256,
        2 => 256u32..256 + kestrel_skills::testing::N_MERGES,
        1 => prop::sample::select(vec![IM_START, ENDOFTEXT]),
        1 => Just(IM_END),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Deltas concatenate to the final text, whatever the stop strings,
    /// token boundaries and delta timing; the text matches the reference.
    #[test]
    fn deltas_concatenate_to_final_text(
        toks in prop::collection::vec(token_strategy(), 0..60),
        stops in prop::collection::vec("[abEND\n é]{1,4}", 0..3),
        take_mask in any::<u64>(),
    ) {
        let ctx = ctx();
        let spec = SkillSpec::Text { stop: stops.clone(), stop_token_ids: vec![], ignore_eos: false, min_tokens: 0 };
        let mut s = skill(&ctx, spec);
        let (r, deltas) = run(&mut s, &toks, |i| take_mask >> (i % 64) & 1 == 1);
        prop_assert_eq!(concat(&deltas), r.text.clone());
        let (want, reason) = reference(&ctx, &toks, &stops);
        prop_assert_eq!(&r.text, &want);
        prop_assert_eq!(r.finish_reason(), Some(reason));
        let n_tokens: usize = deltas.iter().map(|d| d.token_ids.len()).sum();
        prop_assert_eq!(n_tokens, r.token_ids.len());
        // No delta ever streams the start of a stop string that later matched.
        prop_assert!(!stops.iter().any(|s| r.text.contains(s.as_str())));
    }
}
