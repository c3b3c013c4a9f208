//! Mask computation per sequence per step for a JSON schema at SmolLM2's
//! vocabulary size (49152), plus a 4-row batch (sequential and parallel fillers) and the text skill's per-token
//! consume + stream cost.
//!
//! Vocabulary: set `KESTREL_SKILLS_TOKENIZER_JSON` to a `tokenizer.json` (e.g.
//! SmolLM2's) to bench the real vocabulary; otherwise a synthetic 49152-token
//! byte-level vocabulary is used. Each measured step is one `fill_mask` on a
//! skill walking a valid document token by token (consume is not timed).

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use kestrel_pipeline::{
    CommittedToken, FinishReason, MaskFiller, MaskRow, Outcome, SequenceSkill, SequentialMasks,
    TokenId, TokenMask,
};
use kestrel_skills::{
    testing, ParallelMasks, Skill, SkillContext, SkillContextConfig, SkillOptions, SkillSpec,
};
use serde_json::json;
use tokenizers::Tokenizer;

const VOCAB: usize = 49152;

fn context() -> (Arc<SkillContext>, &'static str) {
    let (tok, label, eos) = match std::env::var("KESTREL_SKILLS_TOKENIZER_JSON") {
        Ok(path) => {
            let tok = Tokenizer::from_file(&path).expect("tokenizer.json loads");
            let eos = tok.token_to_id("<|im_end|>").unwrap_or(0);
            (tok, "tokenizer.json", eos)
        }
        Err(_) => (
            testing::synthetic_tokenizer(VOCAB),
            "synthetic",
            testing::IM_END,
        ),
    };
    let ctx = SkillContext::new(SkillContextConfig {
        tokenizer: Arc::new(tok),
        eos_token_ids: vec![eos],
        vocab_size: None,
        chat_template: None,
    })
    .expect("context builds");
    (ctx, label)
}

fn schema() -> serde_json::Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "email": {"type": "string"},
            "active": {"type": "boolean"},
            "score": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]
            }
        },
        "required": ["name", "age", "email", "active", "score", "tags", "address"],
        "additionalProperties": false
    })
}

const DOC: &str = r#"{"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "active": true, "score": 97.5, "tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "W1 2AB"}}"#;

fn doc_tokens(ctx: &SkillContext) -> Vec<TokenId> {
    ctx.tokenizer()
        .encode(DOC, false)
        .expect("encodes")
        .get_ids()
        .to_vec()
}

fn commit(s: &mut Skill, token: TokenId) {
    s.consume(&CommittedToken {
        token,
        logprob: None,
        top_logprobs: &[],
        coord: 0.0,
        size: [0.0; 2],
    });
}

/// Walks the document once, timing each fill_mask; returns per-step times.
fn walk(ctx: &Arc<SkillContext>, toks: &[TokenId], words: &mut [u32]) -> Vec<Duration> {
    let mut s = Skill::new(
        ctx,
        &SkillSpec::Json { schema: schema() },
        SkillOptions::default(),
    )
    .unwrap();
    let mut times = Vec::with_capacity(toks.len());
    for &t in toks {
        if !s.is_constrained() {
            break;
        }
        let mut mask = TokenMask::new(words, ctx.vocab_size());
        let t0 = Instant::now();
        s.fill_mask(&mut mask);
        times.push(t0.elapsed());
        assert!(mask.is_allowed(t), "document token {t} must be allowed");
        commit(&mut s, t);
    }
    s.finish(Outcome::Finished(FinishReason::Stop));
    times
}

fn bench(c: &mut Criterion) {
    let (ctx, label) = context();
    let toks = doc_tokens(&ctx);
    let mut words = vec![0u32; TokenMask::words_for(ctx.vocab_size())];

    // Percentiles over individual steps (criterion reports per-walk means).
    let mut all: Vec<Duration> = (0..30)
        .flat_map(|_| walk(&ctx, &toks, &mut words))
        .collect();
    all.sort_unstable();
    let pct = |p: f64| all[((all.len() - 1) as f64 * p) as usize];
    eprintln!(
        "json mask per step ({label}, vocab {}, {} steps/doc, {} samples): p50 {:?} p90 {:?} p99 {:?} max {:?}",
        ctx.vocab_size(),
        toks.len(),
        all.len(),
        pct(0.5),
        pct(0.9),
        pct(0.99),
        all[all.len() - 1]
    );

    c.bench_function(&format!("json_mask_per_step/{label}"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let times = walk(&ctx, &toks, &mut words);
                total += times.iter().sum::<Duration>() / times.len() as u32;
            }
            total
        })
    });

    // Four and sixteen JSON rows of one step, filled by the pipeline's filler: one by
    // one, and on rayon's pool (what the engine installs).
    for rows in [4, 16] {
        let fillers: [(&str, Box<dyn MaskFiller>); 3] = [
            ("sequential", Box::new(SequentialMasks)),
            ("parallel", Box::new(ParallelMasks::always())),
            ("adaptive", Box::new(ParallelMasks::default())),
        ];
        for (name, mut filler) in fillers {
            c.bench_function(
                &format!("json_batch{rows}_masks_per_step/{name}/{label}"),
                |b| {
                    let per_row = TokenMask::words_for(ctx.vocab_size());
                    let mut batch_words = vec![0u32; rows * per_row];
                    b.iter_custom(|iters| {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            let spec = SkillSpec::Json { schema: schema() };
                            let mut skills: Vec<Skill> = (0..rows)
                                .map(|_| Skill::new(&ctx, &spec, SkillOptions::default()).unwrap())
                                .collect();
                            let mut steps = 0u32;
                            let mut elapsed = Duration::ZERO;
                            for &t in &toks {
                                if !skills[0].is_constrained() {
                                    break;
                                }
                                let mut rows: Vec<MaskRow<'_>> = skills
                                    .iter_mut()
                                    .zip(batch_words.chunks_mut(per_row))
                                    .map(|(s, w)| MaskRow {
                                        skill: s,
                                        drafts: &[],
                                        words: w,
                                    })
                                    .collect();
                                let t0 = Instant::now();
                                filler.fill(&mut rows, ctx.vocab_size());
                                elapsed += t0.elapsed();
                                drop(rows);
                                steps += 1;
                                for s in &mut skills {
                                    commit(s, t);
                                }
                            }
                            total += elapsed / steps.max(1);
                        }
                        total
                    })
                },
            );
        }
    }
    // Text skill: consume + take_delta per token (streaming detokenization).
    c.bench_function(&format!("text_consume_and_delta_per_token/{label}"), |b| {
        let spec = SkillSpec::Text {
            stop: vec!["\n\nUser:".into()],
            stop_token_ids: vec![],
            ignore_eos: true,
            min_tokens: 0,
        };
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut s = Skill::new(&ctx, &spec, SkillOptions::default()).unwrap();
                let t0 = Instant::now();
                for &t in &toks {
                    commit(&mut s, t);
                    black_box(s.take_delta());
                }
                total += t0.elapsed() / toks.len() as u32;
            }
            total
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
