//! Property tests of the engine loop over random workloads: arrivals,
//! lengths, EOS, constrained mixes, pauses, cancellations and faults.
//! After every iteration: I2, I4, I6, capacity, device-side protocol; at the
//! end: every request resolved once, nothing allocated, and Blocking and
//! Pipelined modes, with and without chunked prefill, emit the token streams
//! of a cache large enough that nothing is ever preempted, and each sample
//! of an `n > 1` request (forked from the first, sharing its prompt pages)
//! the stream it gets as a request of its own; a prompt with a bidirectional
//! prefix (an image's) never has a chunk end inside it (the simulated device
//! records a violation); every committed token reaches its skill with the
//! spatial values the device decoded beside it (`sim_values` of its seed,
//! position and id), in every mode, preempted or drafted. The scenarios'
//! small caches (6 to 80 pages of 4 tokens, taken as sequences grow) make
//! about one case in ten preempt (some 300 of the 3,000, 700 preemptions).

mod common;

use std::collections::HashSet;
use std::num::NonZeroUsize;

use common::{check_requests, run, sample_id, spec_of, ReqSpec, Scenario};
use kestrel_pipeline::testing::{sim_values, SIM_EOS};
use kestrel_pipeline::{FailureKind, FinishReason, Outcome, PipelineMode, PrefillPolicy};
use proptest::prelude::*;

fn req_spec() -> impl Strategy<Value = ReqSpec> {
    (
        0usize..40,
        1usize..24,
        1u32..20,
        any::<u64>(),
        prop::option::weighted(0.3, 1u32..12),
        prop::bool::weighted(0.3),
        prop::option::weighted(0.15, 0usize..60),
        prop::option::weighted(0.4, (1usize..8, 1usize..3)),
        prop_oneof![4 => Just(1usize), 1 => 2usize..4],
        prop::option::weighted(0.3, 0usize..24),
    )
        .prop_map(
            |(
                arrive_at,
                prompt_len,
                max_new,
                seed,
                stop_after,
                constrained,
                abort_at,
                speculate,
                samples,
                bidirectional,
            )| {
                ReqSpec {
                    arrive_at,
                    prompt_len,
                    max_new,
                    seed,
                    stop_after,
                    constrained,
                    abort_at,
                    speculate,
                    samples,
                    bidirectional,
                }
            },
        )
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        prop::collection::vec(req_spec(), 1..14),
        1usize..6,
        prop_oneof![6usize..24, 24usize..80],
        prop::sample::select(vec![16usize, 24, 64]),
        prop::option::weighted(0.3, 0usize..40),
        prop::option::weighted(0.5, 1usize..8),
        0usize..16,
        prop::option::weighted(0.5, 2usize..9),
    )
        .prop_map(
            |(
                reqs,
                max_batch,
                num_pages,
                max_seq_len,
                pause_at,
                chunk,
                max_draft_tokens,
                period,
            )| Scenario {
                reqs,
                max_batch,
                num_pages,
                max_seq_len,
                pause_at,
                prefill_chunk: chunk.and_then(NonZeroUsize::new),
                max_draft_tokens,
                period,
                fail_decode_launch: HashSet::new(),
                fail_prefill_launch: HashSet::new(),
                fail_wait: HashSet::new(),
                samples_apart: false,
            },
        )
}

const MODES: [(PipelineMode, PrefillPolicy); 3] = [
    (PipelineMode::Blocking, PrefillPolicy::Drain),
    (PipelineMode::Pipelined, PrefillPolicy::Drain),
    (PipelineMode::Pipelined, PrefillPolicy::RideAlong),
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, max_shrink_iters: 2000, ..ProptestConfig::default() })]

    /// Without faults, all three configurations answer every request and
    /// emit, for every request that was not cancelled, the tokens it gets
    /// from a cache that never runs out (its single-sequence reference:
    /// the simulated device samples from seed, position and mask only),
    /// with the scenario's prefill chunk budget and with whole-prompt
    /// prefill, however often it was preempted.
    #[test]
    fn modes_agree_and_invariants_hold(sc in scenario()) {
        let mut roomy = Scenario {
            num_pages: 1 << 16,
            max_draft_tokens: 0,
            samples_apart: true,
            ..sc.clone()
        };
        for r in &mut roomy.reqs {
            r.speculate = None;
        }
        let reference = run(&roomy, PipelineMode::Blocking, PrefillPolicy::Drain);
        prop_assert_eq!((reference.stats.preemptions, reference.stats.draft_tokens), (0, 0));
        let mut runs: Vec<_> = MODES.iter().map(|&(m, p)| run(&sc, m, p)).collect();
        if sc.prefill_chunk.is_some() {
            let whole = Scenario { prefill_chunk: None, ..sc.clone() };
            runs.extend(MODES.iter().map(|&(m, p)| run(&whole, m, p)));
        }
        for r in &runs {
            check_requests(&sc, r);
            prop_assert!(!r.unhealthy);
            for (id, log) in &r.logs {
                let spec = spec_of(&sc, *id);
                let seed = spec.seed.wrapping_add(*id & 7);
                let expected: Vec<_> = log.tokens.iter().enumerate()
                    .map(|(i, &t)| sim_values(seed, spec.prompt_len + i, t))
                    .collect();
                prop_assert_eq!(&log.values, &expected, "request {} got values not its tokens'", id);
                match &log.outcome {
                    Some(Outcome::Finished(FinishReason::Eos)) => prop_assert_eq!(log.tokens.last(), Some(&SIM_EOS)),
                    Some(Outcome::Finished(FinishReason::Length)) => prop_assert!(
                        log.tokens.len() == spec.max_new as usize || spec.prompt_len + log.tokens.len() == sc.max_seq_len
                    ),
                    Some(Outcome::Finished(FinishReason::Stop)) => prop_assert_eq!(Some(log.tokens.len() as u32), spec.stop_after),
                    Some(Outcome::Finished(FinishReason::Abort)) => prop_assert!(spec.abort_at.is_some()),
                    other => prop_assert!(false, "request {} ended with {:?}", id, other),
                }
            }
        }
        let ids = sc.reqs.iter().enumerate().flat_map(|(i, spec)| {
            (0..spec.samples).map(move |k| (sample_id(i, k), spec))
        });
        for (id, spec) in ids {
            if spec.abort_at.is_some() {
                continue;
            }
            let base = runs[0].logs.get(&id).map(|l| &l.tokens);
            for r in &runs[1..] {
                prop_assert_eq!(base, r.logs.get(&id).map(|l| &l.tokens), "request {} differs between modes", id);
            }
            // Refused only for a cache it could never fit in.
            if let Some(tokens) = base {
                prop_assert_eq!(Some(tokens), reference.logs.get(&id).map(|l| &l.tokens), "request {} differs from its reference", id);
            }
        }
    }

    /// With injected faults: pre-dispatch failures fail only their step's
    /// requests; a device fault is engine-fatal. Nothing hangs, every request
    /// is resolved exactly once, all KV is released.
    #[test]
    fn faults_resolve_everything(
        mut sc in scenario(),
        decode_fail in prop::collection::hash_set(0u64..30, 0..3),
        prefill_fail in prop::collection::hash_set(0u64..10, 0..2),
        wait_fail in prop::option::weighted(0.5, 0u64..60),
        mode in 0usize..3,
    ) {
        sc.fail_decode_launch = decode_fail;
        sc.fail_prefill_launch = prefill_fail;
        sc.fail_wait = wait_fail.into_iter().collect();
        let (m, p) = MODES[mode];
        let r = run(&sc, m, p);
        check_requests(&sc, &r);
        for log in r.logs.values() {
            if let Some(Outcome::Failed(kind, _)) = &log.outcome {
                prop_assert!(matches!(kind, FailureKind::StepFailed | FailureKind::EngineFatal));
                if *kind == FailureKind::EngineFatal {
                    prop_assert!(r.unhealthy);
                }
            }
        }
    }
}
