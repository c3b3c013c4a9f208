//! Speculative decoding on the real default model: prompt-lookup drafts
//! verified in one forward must change nothing but the number of steps.
//! Requests that quote their prompt (a list to repeat, code to copy with a
//! change) and plain ones, greedy and seeded-sampled with penalties, alone
//! and batched, in blocking and pipelined modes, and a constrained one whose
//! drafts are masked position by position: every request's tokens, text and
//! log-probabilities with speculation equal those without, drafts are
//! accepted (the counters say so), and a bad setting is refused by name.
//! The CUDA runtime verifies drafts too: on its host device
//! (`Backend::CudaHost`) speculation changes no token or text.

mod common;

use common::{counter, rt, start_default};

use std::time::Duration;

use kestrel_engine::{
    Backend, Constraint, Engine, EngineConfig, EngineError, Field, GenerateRequest,
    GenerateResponse, PipelineMode, PrefillPolicy, SamplingOptions, Speculation,
};

fn engine(mode: PipelineMode, prefill_policy: PrefillPolicy) -> Engine {
    start_default(EngineConfig {
        threads: 2,
        mode,
        prefill_policy,
        max_batch_size: 8,
        kv_pages: 512,
        max_seq_len: Some(1024),
        ..EngineConfig::default()
    })
}

const CODE: &str = "fn area(w: f64, h: f64) -> f64 {\n    let a = w * h;\n    a\n}\n\n\
    fn perimeter(w: f64, h: f64) -> f64 {\n    let p = 2.0 * (w + h);\n    p\n}\n";

fn batch(speculate: Speculation) -> Vec<GenerateRequest> {
    let sampled = |seed| SamplingOptions {
        temperature: Some(0.8),
        top_p: Some(0.95),
        seed: Some(seed),
        repetition_penalty: Some(1.1),
        logprobs: true,
        top_logprobs: 2,
        ..SamplingOptions::default()
    };
    let mut reqs =
        vec![
        GenerateRequest::text(
            "Repeat the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape, \
             honeydew, kiwi, lemon, mango, nectarine.\nRepeated: apple, banana,",
            40,
        ),
        GenerateRequest::text(
            format!("{CODE}\nThe same code with f32 instead of f64:\n\nfn area(w: f32"),
            60,
        ),
        GenerateRequest {
            sampling: sampled(3),
            ..GenerateRequest::text(
                "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
                32,
            )
        },
        GenerateRequest::text("My favourite season is", 24),
        GenerateRequest {
            sampling: sampled(9),
            ..GenerateRequest::text(format!("{CODE}\n{CODE}"), 32)
        },
        GenerateRequest {
            constraint: Some(Constraint::Regex("(apple|banana)(, (apple|banana)){3,6}".into())),
            ..GenerateRequest::text("apple, banana, apple, banana, apple,", 24)
        },
    ];
    for (i, r) in reqs.iter_mut().enumerate() {
        r.speculate = speculate;
        r.request_id = Some(format!("spec-{i}"));
    }
    reqs
}

fn run(engine: &Engine, reqs: &[GenerateRequest]) -> Vec<GenerateResponse> {
    rt().block_on(async {
        let pending: Vec<_> = reqs.iter().map(|r| engine.generate(r.clone())).collect();
        let mut out = Vec::new();
        for p in pending {
            let r = tokio::time::timeout(Duration::from_secs(120), p)
                .await
                .expect("no hang")
                .expect("no error");
            out.push(r);
        }
        out
    })
}

fn same(want: &[GenerateResponse], got: &[GenerateResponse], what: &str) {
    for (a, b) in want.iter().zip(got) {
        let at = format!("{what}: {}", a.request_id);
        assert_eq!(a.token_ids, b.token_ids, "{at}");
        assert_eq!(a.text, b.text, "{at}");
        assert_eq!(a.logprobs, b.logprobs, "{at}");
        assert_eq!(a.finish_reason, b.finish_reason, "{at}");
    }
}

#[test]
fn speculation_changes_no_output_and_accepts_drafts() {
    let off = batch(Speculation::Off);
    let on = batch(Speculation::Ngram { max_draft: 6 });
    let mut reference: Option<Vec<GenerateResponse>> = None;
    for (mode, policy) in [
        (PipelineMode::Blocking, PrefillPolicy::Drain),
        (PipelineMode::Pipelined, PrefillPolicy::RideAlong),
    ] {
        let e = engine(mode, policy);
        let plain = run(&e, &off);
        assert_eq!(counter(&e, "kestrel_spec_draft_tokens_total"), 0);
        match &reference {
            None => reference = Some(plain.clone()),
            Some(want) => same(want, &plain, &format!("{mode:?} without speculation")),
        }
        // Batched, then each alone.
        let batched = run(&e, &on);
        same(&plain, &batched, &format!("{mode:?} batched"));
        for (i, req) in on.iter().enumerate() {
            let before = counter(&e, "kestrel_spec_accepted_tokens_total");
            let alone = run(&e, std::slice::from_ref(req));
            same(&plain[i..=i], &alone, &format!("{mode:?} alone"));
            if req.constraint.is_some() {
                // Its drafts were masked position by position, and accepted.
                let gained = counter(&e, "kestrel_spec_accepted_tokens_total") - before;
                assert!(
                    gained > 0,
                    "{mode:?}: the constrained request accepted no draft"
                );
            }
        }
        let (drafted, accepted) = (
            counter(&e, "kestrel_spec_draft_tokens_total"),
            counter(&e, "kestrel_spec_accepted_tokens_total"),
        );
        assert!(
            accepted >= 20 && accepted < drafted,
            "{mode:?}: {accepted} of {drafted} drafts accepted"
        );
        rt().block_on(e.shutdown(Duration::from_secs(1)));
    }
}

#[test]
fn a_bad_speculation_setting_is_refused_by_name() {
    let e = engine(PipelineMode::Pipelined, PrefillPolicy::RideAlong);
    for max_draft in [0, 17] {
        let req = GenerateRequest {
            speculate: Speculation::Ngram { max_draft },
            ..GenerateRequest::text("Hello", 4)
        };
        match rt().block_on(e.generate(req)) {
            Err(EngineError::InvalidArgument { field, message }) => {
                assert_eq!(field, Field::Speculate);
                assert!(message.contains("1 to 16"), "{message}");
            }
            other => panic!("{max_draft} drafts: {other:?}"),
        }
    }
    let bad = EngineConfig {
        speculate: Some(17),
        ..EngineConfig::default()
    };
    match Engine::start(bad, |_| {}) {
        Err(EngineError::InvalidArgument { field, .. }) => {
            assert_eq!(field, Field::Config("speculate"))
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    rt().block_on(e.shutdown(Duration::from_secs(1)));
}

/// The CUDA runtime's draft verification through the engine, on its host
/// device: each row's input token and drafts in one forward (the tiled
/// prefill attention after its cached prefix), sampled in order on scratch
/// penalty counts, the accepted kept. The batch without its two code
/// prompts (the host device is slow), batched, pipelined: exactly the
/// tokens, text and log-probabilities of decoding without speculation,
/// drafts accepted (and some rejected). Prefill in chunks of 16, so every
/// forward takes the same matmul path per row (`mmvq_*`) and a position
/// computes alike in any step, as on the CPU.
#[test]
fn the_cuda_runtime_on_its_host_device_verifies_drafts_without_changing_output() {
    let e = start_default(EngineConfig {
        backend: Backend::CudaHost,
        mode: PipelineMode::Pipelined,
        prefill_policy: PrefillPolicy::RideAlong,
        prefill_chunk: Some(16),
        max_batch_size: 8,
        kv_pages: 512,
        max_seq_len: Some(1024),
        ..EngineConfig::default()
    });
    // Requests 1 and 4 are the code prompts.
    let short = |s| -> Vec<GenerateRequest> {
        let b = batch(s).into_iter().enumerate();
        b.filter(|(i, _)| ![1, 4].contains(i))
            .map(|(_, r)| r)
            .collect()
    };
    let plain = run(&e, &short(Speculation::Off));
    let drafted = run(&e, &short(Speculation::Ngram { max_draft: 6 }));
    same(&plain, &drafted, "cuda-host");
    let (proposed, accepted) = (
        counter(&e, "kestrel_spec_draft_tokens_total"),
        counter(&e, "kestrel_spec_accepted_tokens_total"),
    );
    assert!(
        accepted >= 20 && accepted < proposed,
        "{accepted} of {proposed} drafts accepted"
    );
    rt().block_on(e.shutdown(Duration::from_secs(1)));
}
