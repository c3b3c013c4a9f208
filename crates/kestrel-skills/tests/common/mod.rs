//! Shared drivers for the integration tests: feed tokens the way the
//! pipeline does (consume, is_constrained/fill_mask, finish exactly once).
#![allow(dead_code)]

use std::sync::Arc;

use kestrel_pipeline::{
    CommittedToken, FinishReason, Outcome, SequenceSkill, TokenId, TokenMask, Verdict,
};
use kestrel_skills::{Skill, SkillContext, SkillOptions, SkillResult, SkillSpec, StreamDelta};

pub fn ctx() -> Arc<SkillContext> {
    kestrel_skills::testing::small_context()
}

pub fn skill(ctx: &Arc<SkillContext>, spec: SkillSpec) -> Skill {
    Skill::new(ctx, &spec, SkillOptions::default()).expect("valid spec")
}

pub fn commit(skill: &mut Skill, token: TokenId) -> Verdict {
    skill.consume(&CommittedToken {
        token,
        logprob: None,
        top_logprobs: &[],
        coord: 0.0,
        size: [0.0; 2],
    })
}

/// Feeds `tokens` until the skill stops, taking deltas after every step (or
/// only when `take[i]` is true), then finishes. Returns the result and deltas.
pub fn run(
    skill: &mut Skill,
    tokens: &[TokenId],
    take: impl Fn(usize) -> bool,
) -> (SkillResult, Vec<StreamDelta>) {
    let mut deltas = Vec::new();
    let mut reason = FinishReason::Length;
    for (i, &t) in tokens.iter().enumerate() {
        let v = commit(skill, t);
        if take(i) {
            deltas.extend(skill.take_delta());
        }
        if let Verdict::Stop(r) = v {
            reason = r;
            break;
        }
    }
    skill.finish(Outcome::Finished(reason));
    deltas.extend(skill.take_delta());
    assert!(
        skill.take_delta().is_none(),
        "nothing left after the final delta"
    );
    (skill.result().expect("finished"), deltas)
}

pub fn concat(deltas: &[StreamDelta]) -> String {
    deltas.iter().map(|d| d.text.as_str()).collect()
}

pub fn mask_of(skill: &mut Skill, vocab: usize) -> Vec<u32> {
    let mut words = vec![0u32; TokenMask::words_for(vocab)];
    let mut m = TokenMask::new(&mut words, vocab);
    skill.fill_mask(&mut m);
    words
}

pub fn allowed(words: &[u32], vocab: usize) -> Vec<TokenId> {
    (0..vocab as TokenId)
        .filter(|&t| words[t as usize / 32] >> (t % 32) & 1 == 1)
        .collect()
}

pub fn encode(ctx: &SkillContext, s: &str) -> Vec<TokenId> {
    ctx.tokenizer().encode(s, false).unwrap().get_ids().to_vec()
}
