//! The design doc's "Invariant tests" (section 5), one test each, on the
//! simulated executor, plus the overlap the pipelined mode must show.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use kestrel_pipeline::testing::{
    sim_sample, SimConfig, SimExecutor, SimLog, SimParams, SimSkill, SIM_EOS,
};
use kestrel_pipeline::{
    EngineLoop, Executor, FinishReason, LoopConfig, MaskFiller, MaskRow, Outcome, PipelineMode,
    PrefillPolicy, Request, Tick,
};

fn engine(mode: PipelineMode, policy: PrefillPolicy) -> EngineLoop<SimExecutor> {
    engine_with(SimConfig::default(), mode, policy, |_| {})
}

/// A checked loop over `sim` in `mode` and `policy`, its config otherwise
/// the default as `tune` leaves it.
fn engine_with(
    sim: SimConfig,
    mode: PipelineMode,
    policy: PrefillPolicy,
    tune: impl FnOnce(&mut LoopConfig),
) -> EngineLoop<SimExecutor> {
    let mut config = LoopConfig {
        mode,
        prefill_policy: policy,
        debug_checks: true,
        ..LoopConfig::default()
    };
    tune(&mut config);
    EngineLoop::new(SimExecutor::new(sim), config).unwrap()
}

fn submit(
    e: &mut EngineLoop<SimExecutor>,
    id: u64,
    seed: u64,
    max_new: u32,
    constrained: bool,
) -> Arc<Mutex<SimLog>> {
    let (skill, log) = SimSkill::new(None, constrained.then_some(seed));
    let req = Request {
        id,
        prompt: vec![5; 4],
        max_new_tokens: max_new,
        params: SimParams {
            seed,
            ..Default::default()
        },
        speculate: None,
        embeds: None,
        skill: Box::new(skill),
    };
    e.submit(req).unwrap();
    log
}

/// A seed whose unconstrained stream (prompt of 4) has EOS first at generated token `k` (0-based).
fn seed_with_eos_at(k: usize) -> u64 {
    (1u64..)
        .find(|&s| (0..=k).all(|i| (sim_sample(s, 4 + i, 64, None) == SIM_EOS) == (i == k)))
        .unwrap()
}

/// Step t+1 is launched and sampled before step t's outputs are read; the
/// outputs of step t are still exactly those of step t (slot-owned host buffers).
#[test]
fn staging_buffers_survive_run_ahead() {
    let mut e = engine(PipelineMode::Pipelined, PrefillPolicy::RideAlong);
    let seed = 1234;
    let log = submit(&mut e, 1, seed, 20, false);
    assert_eq!(e.run_until_idle(), Tick::Idle);
    let trace = &e.executor().trace;
    // Somewhere a second step was sampled while the first was uncommitted.
    let overlapped = trace
        .windows(3)
        .any(|w| w[0].0 == "sample" && w[1].0 == "decode" && w[2].0 == "sample");
    assert!(overlapped, "no run-ahead in trace {trace:?}");
    let expected: Vec<u32> = (0..20)
        .map(|i| sim_sample(seed, 4 + i, 64, None))
        .scan(false, |done, t| {
            if *done {
                return None;
            }
            *done = t == SIM_EOS;
            Some(t)
        })
        .collect();
    assert_eq!(log.lock().unwrap().tokens, expected);
}

/// EOS found at step t: the request resolves at t, its row stays allocated
/// while step t+1 (already launched) is in flight, then is released.
#[test]
fn zombie_released_after_last_inflight_step() {
    let mut e = engine(PipelineMode::Pipelined, PrefillPolicy::RideAlong);
    let seed = seed_with_eos_at(3);
    let log = submit(&mut e, 7, seed, 50, false);
    let mut resolved_while_allocated = false;
    loop {
        let t = e.run_once();
        let resolved = log.lock().unwrap().outcome.is_some();
        if resolved && e.num_admitted() == 1 {
            resolved_while_allocated = true;
            assert_eq!(e.num_running(), 0, "a finalized sequence is not running");
        }
        if t == Tick::Idle {
            break;
        }
    }
    let log = log.lock().unwrap();
    assert_eq!(log.outcome, Some(Outcome::Finished(FinishReason::Eos)));
    assert_eq!(log.tokens.len(), 4, "zombie outputs must not be emitted");
    assert!(
        resolved_while_allocated,
        "EOS sequence should have been a zombie for one step"
    );
    assert!(e.stats().zombie_rows >= 1);
    assert_eq!(e.num_admitted(), 0);
    assert!(
        e.executor().violations.is_empty(),
        "{:?}",
        e.executor().violations
    );
}

/// Unconstrained batches run two deep; constrained ones commit before
/// finalizing, so at most one sampled step is ever queued with a forward.
#[test]
fn queue_depth_emerges_from_constraints() {
    for (constrained, want_depth) in [(false, 2), (true, 2)] {
        // One 4-token prompt per prefill step, so admissions interleave
        // with decode steps (a step of all four would leave a constrained
        // batch whose next forward is launched and committed within one
        // iteration, never seen in flight between them).
        let mut e = engine_with(
            SimConfig::default(),
            PipelineMode::Pipelined,
            PrefillPolicy::RideAlong,
            |c| c.prefill_chunk = NonZeroUsize::new(4),
        );
        let logs: Vec<_> = (0..4)
            .map(|i| submit(&mut e, i, 100 + i, 30, constrained))
            .collect();
        let mut max_queue = 0;
        let mut max_in_flight = 0;
        while e.run_once() != Tick::Idle {
            // Steady state: every request admitted, only decode steps in flight.
            if e.num_waiting() == 0
                && e.in_flight_kinds()
                    .all(|k| k == kestrel_pipeline::StepKind::Decode)
            {
                max_queue = max_queue.max(e.state().queue_len());
            }
            max_in_flight = max_in_flight.max(e.state().in_flight());
        }
        assert_eq!(max_in_flight, want_depth);
        if constrained {
            // The forward of t+1 overlaps the commit of t, but sampling waits for the mask.
            assert_eq!(
                max_queue, 1,
                "constrained steps must commit before the next is sampled"
            );
            assert!(e.stats().masked_steps > 0);
        } else {
            assert_eq!(max_queue, 2);
        }
        for log in logs {
            let log = log.lock().unwrap();
            assert!(log.violations.is_empty(), "{:?}", log.violations);
            assert!(log.outcome.is_some());
        }
    }
}

/// A waiting prefill starts within two decode completions, under both policies.
#[test]
fn prefill_fairness() {
    for policy in [PrefillPolicy::Drain, PrefillPolicy::RideAlong] {
        let mut e = engine(PipelineMode::Pipelined, policy);
        let _a = submit(&mut e, 1, seed_with_eos_at(40), 40, false);
        for _ in 0..10 {
            e.run_once();
        }
        let _b = submit(&mut e, 2, 99, 5, false);
        let commits_before = e
            .executor()
            .trace
            .iter()
            .filter(|t| t.0 == "commit")
            .count();
        let prefills_before = e
            .executor()
            .trace
            .iter()
            .filter(|t| t.0 == "prefill")
            .count();
        let mut decode_commits = 0;
        loop {
            e.run_once();
            let trace = &e.executor().trace;
            if trace.iter().filter(|t| t.0 == "prefill").count() > prefills_before {
                break;
            }
            decode_commits = trace.iter().filter(|t| t.0 == "commit").count() - commits_before;
            assert!(
                decode_commits <= 2,
                "{policy:?}: prefill still waiting after {decode_commits} commits"
            );
        }
        assert!(decode_commits <= 2);
        e.run_until_idle();
    }
}

/// Abort of a running request resolves it at once with `Abort` and frees
/// its row once no step references it; others are unaffected.
#[test]
fn abort_mid_stream_frees_row() {
    let mut e = engine(PipelineMode::Pipelined, PrefillPolicy::RideAlong);
    let a = submit(&mut e, 1, seed_with_eos_at(60), 60, false);
    let b = submit(&mut e, 2, seed_with_eos_at(30), 30, false);
    for _ in 0..12 {
        e.run_once();
    }
    assert!(e.abort(1));
    assert_eq!(
        a.lock().unwrap().outcome,
        Some(Outcome::Finished(FinishReason::Abort))
    );
    let n_at_abort = a.lock().unwrap().tokens.len();
    e.run_until_idle();
    assert_eq!(
        a.lock().unwrap().tokens.len(),
        n_at_abort,
        "no tokens after abort"
    );
    assert_eq!(b.lock().unwrap().tokens.len(), 30);
    assert_eq!(e.num_admitted(), 0);
    assert!(!e.abort(1), "aborting a finished request is a no-op");
}

/// Pause drains in order (commit sampled steps, then finalize the launched
/// forward) and leaves nothing in flight; resume continues identically.
#[test]
fn pause_drains_and_resume_continues() {
    let mut paused = engine(PipelineMode::Pipelined, PrefillPolicy::RideAlong);
    let log = submit(&mut paused, 1, 77, 25, true);
    for _ in 0..9 {
        paused.run_once();
    }
    paused.request_pause();
    assert_eq!(paused.run_once(), Tick::Paused);
    assert!(paused.state().is_drained());
    assert_eq!(paused.run_once(), Tick::Paused);
    assert_eq!(paused.executor().resumes(), 0);
    paused.resume();
    // The executor rebuilt its state once, with nothing in flight.
    assert_eq!(paused.executor().resumes(), 1);
    paused.run_until_idle();
    assert!(
        paused.executor().violations.is_empty(),
        "{:?}",
        paused.executor().violations
    );
    // A resume without a completed pause has nothing to rebuild.
    paused.resume();
    assert_eq!(paused.executor().resumes(), 1);

    let mut plain = engine(PipelineMode::Blocking, PrefillPolicy::Drain);
    let reference = submit(&mut plain, 1, 77, 25, true);
    plain.run_until_idle();
    assert_eq!(log.lock().unwrap().tokens, reference.lock().unwrap().tokens);
}

/// Admission counts allocated rows (zombies included), never the running list.
#[test]
fn capacity_counts_zombie_rows() {
    let config = LoopConfig {
        max_batch_size: 1,
        debug_checks: true,
        ..LoopConfig::default()
    };
    let mut e = EngineLoop::new(SimExecutor::new(SimConfig::default()), config).unwrap();
    let a = submit(&mut e, 1, seed_with_eos_at(2), 10, false);
    let b = submit(&mut e, 2, 5, 3, false);
    let mut b_started_while_a_zombie = false;
    while e.run_once() != Tick::Idle {
        let a_done = a.lock().unwrap().outcome.is_some();
        if a_done && e.num_admitted() == 1 && !b.lock().unwrap().tokens.is_empty() {
            // fine: a released before b started
        }
        if e.num_admitted() > 1 {
            b_started_while_a_zombie = true;
        }
    }
    assert!(
        !b_started_while_a_zombie,
        "admitted past max_batch_size while a zombie held a row"
    );
    assert_eq!(b.lock().unwrap().tokens.len(), 3);
}

/// Bad submissions are typed errors and do not disturb the engine.
#[test]
fn submit_validation() {
    use kestrel_pipeline::SubmitError;
    let config = LoopConfig {
        max_waiting: 1,
        max_batch_size: 1,
        max_seq_len: 16,
        ..LoopConfig::default()
    };
    let mut e = EngineLoop::new(
        SimExecutor::new(SimConfig {
            num_pages: 2,
            page_size: 4,
            ..SimConfig::default()
        }),
        config,
    )
    .unwrap();
    let mk = |id, prompt: Vec<u32>, max_new| {
        let (skill, _) = SimSkill::new(None, None);
        Request {
            id,
            prompt,
            max_new_tokens: max_new,
            params: SimParams::default(),
            speculate: None,
            embeds: None,
            skill: Box::new(skill),
        }
    };
    assert_eq!(e.submit(mk(1, vec![], 4)), Err(SubmitError::EmptyPrompt));
    assert_eq!(e.submit(mk(1, vec![1], 0)), Err(SubmitError::ZeroMaxTokens));
    assert_eq!(
        e.submit(mk(1, vec![1; 16], 4)),
        Err(SubmitError::PromptTooLong {
            prompt_len: 16,
            max_seq_len: 16
        })
    );
    assert_eq!(
        e.submit(mk(1, vec![1; 8], 4)),
        Err(SubmitError::NeverFits { needed: 12 })
    );
    assert_eq!(e.submit(mk(1, vec![1; 4], 4)), Ok(()));
    assert_eq!(
        e.submit(mk(1, vec![1; 4], 4)),
        Err(SubmitError::DuplicateId(1))
    );
    // One queue place beyond the one free row: a second request waits...
    assert_eq!(e.waiting_capacity(), 2);
    assert_eq!(e.submit(mk(2, vec![1; 4], 4)), Ok(()));
    // ... a third must wait beyond the limit.
    assert_eq!(
        e.submit(mk(3, vec![1; 4], 4)),
        Err(SubmitError::QueueFull { limit: 1 })
    );
    assert_eq!(e.run_until_idle(), Tick::Idle);
}

/// Fills the two halves of a step's rows on two threads, and records the
/// largest number of rows it was handed.
struct TwoThreadMasks(Arc<Mutex<usize>>);

impl MaskFiller for TwoThreadMasks {
    fn fill(&mut self, rows: &mut [MaskRow<'_>], vocab_size: usize) {
        let mut most = self.0.lock().unwrap();
        *most = (*most).max(rows.len());
        let (a, b) = rows.split_at_mut(rows.len() / 2);
        std::thread::scope(|s| {
            s.spawn(|| a.iter_mut().for_each(|r| r.fill(vocab_size)));
            b.iter_mut().for_each(|r| r.fill(vocab_size));
        });
    }
}

/// Masks filled concurrently give the same tokens as the sequential
/// default, and only constrained rows are handed to the filler.
#[test]
fn parallel_mask_filling_matches_sequential() {
    let mut outputs = Vec::new();
    for parallel in [false, true] {
        let mut e = engine(PipelineMode::Pipelined, PrefillPolicy::RideAlong);
        let most = Arc::new(Mutex::new(0));
        if parallel {
            e.set_mask_filler(Box::new(TwoThreadMasks(Arc::clone(&most))));
        }
        let logs: Vec<_> = (0..12u64)
            .map(|id| submit(&mut e, id, 31 * id + 5, 40, id % 3 != 0))
            .collect();
        assert_eq!(e.run_until_idle(), Tick::Idle);
        if parallel {
            assert_eq!(
                *most.lock().unwrap(),
                8,
                "the 8 constrained rows, none else"
            );
        }
        outputs.push(
            logs.iter()
                .map(|l| l.lock().unwrap().tokens.clone())
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(outputs[0], outputs[1]);
}

/// Chunked prefill: a long prompt arriving while another sequence decodes
/// is prefilled in `prefill_chunk`-token steps that take turns with decode
/// steps (in every mode and policy), so the running sequence gains a token
/// per chunk instead of waiting for the whole prompt; and the chunked
/// sequence's tokens are those of a whole-prompt prefill.
#[test]
fn prefill_chunks_take_turns_with_decode() {
    let configs = [
        (PipelineMode::Blocking, PrefillPolicy::Drain),
        (PipelineMode::Pipelined, PrefillPolicy::Drain),
        (PipelineMode::Pipelined, PrefillPolicy::RideAlong),
    ];
    for (mode, policy) in configs {
        let config = LoopConfig {
            mode,
            prefill_policy: policy,
            prefill_chunk: std::num::NonZeroUsize::new(4),
            debug_checks: true,
            ..LoopConfig::default()
        };
        let mut e = EngineLoop::new(SimExecutor::new(SimConfig::default()), config).unwrap();
        // A seed without EOS in its first 200 tokens (prompt of 4).
        let quiet = (1u64..)
            .find(|&s| (0..200).all(|i| sim_sample(s, 4 + i, 64, None) != SIM_EOS))
            .unwrap();
        let running = submit(&mut e, 1, quiet, 200, false);
        for _ in 0..6 {
            e.run_once();
        }
        let before = running.lock().unwrap().tokens.len();
        assert!(
            before > 0,
            "{mode:?}/{policy:?}: the first request is decoding"
        );
        let seed = 77;
        let (skill, long) = SimSkill::new(Some(3), None);
        let prompt_len = 40;
        e.submit(Request {
            id: 2,
            prompt: vec![9; prompt_len],
            max_new_tokens: 3,
            params: SimParams {
                seed,
                ..Default::default()
            },
            speculate: None,
            embeds: None,
            skill: Box::new(skill),
        })
        .unwrap();
        // Run until the long prompt's first token is committed.
        while long.lock().unwrap().tokens.is_empty() {
            assert_eq!(e.run_once(), Tick::Progress);
        }
        let during = running.lock().unwrap().tokens.len() - before;
        // Ten chunks of 4: the running sequence decoded between them.
        assert!(
            during >= 9,
            "{mode:?}/{policy:?}: only {during} tokens decoded during a 10-chunk prefill"
        );
        assert_eq!(e.stats().prefill_steps, 1 + 10);
        e.abort(1);
        assert_eq!(e.run_until_idle(), Tick::Idle);
        let expected: Vec<u32> = (0..3)
            .map(|i| sim_sample(seed, prompt_len + i, 64, None))
            .collect();
        assert_eq!(long.lock().unwrap().tokens, expected, "{mode:?}/{policy:?}");
    }
}

/// A prompt with a bidirectional prefix (an image's: BOS and embedded
/// rows that attend each other both ways) under a 2-token chunk budget:
/// the first chunk computes the whole prefix (12 rows, past the budget),
/// later chunks keep the budget; a fork sharing the parent's one full page
/// of 8 starts inside the prefix and computes its rest in one chunk (past
/// the budget too); a broken rule would also be a device violation. Tokens
/// are those of a whole-prompt prefill.
#[test]
fn bidirectional_prefix_is_one_chunk() {
    for (mode, policy) in [
        (PipelineMode::Blocking, PrefillPolicy::Drain),
        (PipelineMode::Pipelined, PrefillPolicy::RideAlong),
    ] {
        let sim = SimConfig {
            page_size: 8,
            ..SimConfig::default()
        };
        let mut e = engine_with(sim, mode, policy, |c| {
            c.prefill_chunk = NonZeroUsize::new(2)
        });
        let embeds = kestrel_pipeline::PromptEmbeds {
            start: 1,
            len: 11,
            bidirectional_end: 12,
            input: Arc::new(()),
        };
        let prompt: Vec<u32> = (0..16).map(|t| t % 60 + 1).collect();
        let mut logs = Vec::new();
        let samples: Vec<_> = (0..2u64)
            .map(|k| {
                let (skill, log) = SimSkill::new(Some(3), None);
                logs.push(log);
                Request {
                    id: 10 + k,
                    prompt: prompt.clone(),
                    max_new_tokens: 3,
                    params: SimParams {
                        seed: 5 + k,
                        ..Default::default()
                    },
                    speculate: None,
                    embeds: Some(embeds.clone()),
                    skill: Box::new(skill),
                }
            })
            .collect();
        e.submit_samples(samples).unwrap();
        assert_eq!(e.run_until_idle(), Tick::Idle);
        let sim = e.executor();
        assert!(sim.violations.is_empty(), "{:?}", sim.violations);
        let chunks = |id| -> Vec<(usize, usize)> {
            let of = sim.chunks.iter().filter(|c| c.0 == id);
            of.map(|&(_, a, b)| (a, b)).collect()
        };
        assert_eq!(chunks(10), [(0, 12), (12, 14), (14, 16)], "{mode:?}");
        // Of the parent's 15 tokens before its last, the fork shares the one
        // full page (8 tokens).
        assert_eq!(chunks(11), [(8, 12), (12, 14), (14, 16)], "{mode:?}");
        for (k, log) in logs.iter().enumerate() {
            let expected: Vec<u32> = (0..3)
                .map(|i| sim_sample(5 + k as u64, prompt.len() + i, 64, None))
                .collect();
            assert_eq!(log.lock().unwrap().tokens, expected, "{mode:?}");
        }
    }
}

/// An embedded range or bidirectional prefix past the prompt is refused at
/// submission.
#[test]
fn embeds_outside_the_prompt_are_refused() {
    let mut e = engine(PipelineMode::Blocking, PrefillPolicy::Drain);
    let (skill, _log) = SimSkill::new(None, None);
    let err = e
        .submit(Request {
            id: 1,
            prompt: vec![1; 8],
            max_new_tokens: 3,
            params: SimParams::default(),
            speculate: None,
            embeds: Some(kestrel_pipeline::PromptEmbeds {
                start: 1,
                len: 8,
                bidirectional_end: 9,
                input: Arc::new(()),
            }),
            skill: Box::new(skill),
        })
        .unwrap_err();
    assert!(
        matches!(
            err,
            kestrel_pipeline::SubmitError::EmbedsOutsidePrompt { prompt_len: 8, .. }
        ),
        "{err:?}"
    );
}

/// Runs four 40-token requests (two constrained) through a cache of
/// `num_pages` pages of 4 tokens; request 3 is aborted after `abort_after`
/// iterations if given. Returns each request's log and the preemptions.
fn pressured_run(
    mode: PipelineMode,
    policy: PrefillPolicy,
    num_pages: usize,
    abort_after: Option<usize>,
) -> (Vec<SimLog>, u64) {
    let config = LoopConfig {
        mode,
        prefill_policy: policy,
        debug_checks: true,
        ..LoopConfig::default()
    };
    let sim = SimConfig {
        num_pages,
        page_size: 4,
        ..SimConfig::default()
    };
    let mut e = EngineLoop::new(SimExecutor::new(sim), config).unwrap();
    // Seeds without EOS in their first 40 unconstrained tokens.
    let quiet: Vec<u64> = (1u64..)
        .filter(|&s| (0..40).all(|i| sim_sample(s, 4 + i, 64, None) != SIM_EOS))
        .take(4)
        .collect();
    let logs: Vec<_> = quiet
        .iter()
        .enumerate()
        .map(|(id, &seed)| submit(&mut e, id as u64, seed, 40, id % 2 == 1))
        .collect();
    let mut iterations = 0;
    loop {
        if abort_after == Some(iterations) {
            e.abort(3);
        }
        iterations += 1;
        assert!(iterations < 100_000, "hung: {e:?}");
        match e.run_once() {
            Tick::Progress => {}
            Tick::Idle => break,
            t => panic!("{t:?}"),
        }
        assert!(
            e.executor().violations.is_empty(),
            "{:?}",
            e.executor().violations
        );
    }
    assert_eq!(
        (e.executor().num_allocated(), e.executor().used_pages()),
        (0, 0)
    );
    let logs = logs.iter().map(|l| l.lock().unwrap().clone()).collect();
    (logs, e.stats().preemptions)
}

/// Four sequences growing to 44 tokens (11 pages each) in a 24-page cache:
/// the youngest is preempted when pages run out, prefilled again with the
/// tokens it generated, and every request emits exactly the tokens it
/// emits in a cache that never runs out (none lost, none repeated; the
/// constrained ones' masks follow), in every mode, also when a preempted
/// request is aborted.
#[test]
fn kv_pressure_preempts_and_loses_no_token() {
    let configs = [
        (PipelineMode::Blocking, PrefillPolicy::Drain),
        (PipelineMode::Pipelined, PrefillPolicy::Drain),
        (PipelineMode::Pipelined, PrefillPolicy::RideAlong),
    ];
    let (reference, none) = pressured_run(PipelineMode::Blocking, PrefillPolicy::Drain, 4096, None);
    assert_eq!(none, 0);
    for log in &reference {
        assert_eq!(log.tokens.len(), 40);
        assert_eq!(log.outcome, Some(Outcome::Finished(FinishReason::Length)));
    }
    for (mode, policy) in configs {
        let (logs, preemptions) = pressured_run(mode, policy, 24, None);
        assert!(
            preemptions > 0,
            "{mode:?}/{policy:?}: nothing was preempted"
        );
        for (id, (log, want)) in logs.iter().zip(&reference).enumerate() {
            assert!(log.violations.is_empty(), "{:?}", log.violations);
            assert_eq!(log.tokens, want.tokens, "{mode:?}/{policy:?}: request {id}");
            assert_eq!(
                log.outcome, want.outcome,
                "{mode:?}/{policy:?}: request {id}"
            );
        }
        // Aborting the youngest (preempted or not) at any point frees everything.
        for abort_after in [10, 60, 120] {
            let (logs, _) = pressured_run(mode, policy, 24, Some(abort_after));
            for (id, (log, want)) in logs.iter().zip(&reference).enumerate().take(3) {
                assert_eq!(log.tokens, want.tokens, "{mode:?}/{policy:?}: request {id}");
            }
            assert_eq!(logs[3].finish_calls, 1);
            assert!(reference[3].tokens.starts_with(&logs[3].tokens));
        }
    }
}

/// Waiting prompts share prefill steps up to the token budget and the free
/// rows; a batch the executor refuses goes back to the queue and its oldest
/// request is admitted alone, so no request fails for another's sake.
#[test]
fn waiting_prompts_share_prefill_steps_within_the_budget() {
    // (chunk budget, batch rows, prefill launch to refuse, prefill steps)
    for (chunk, rows, refuse, want_steps) in [
        (None, 32, None, 1),       // all six 4-token prompts in one step
        (Some(8), 32, None, 3),    // two per step
        (Some(10), 32, None, 3),   // 8 + 4 > 10: still two per step
        (None, 4, None, 2),        // four rows, then two as rows free up
        (Some(8), 32, Some(0), 4), // first pair refused: one alone, then pairs
    ] {
        let mut sim = SimConfig::default();
        sim.fail_prefill_launch.extend(refuse);
        let mut e = engine_with(
            sim,
            PipelineMode::Pipelined,
            PrefillPolicy::RideAlong,
            |c| {
                c.prefill_chunk = chunk.and_then(NonZeroUsize::new);
                c.max_batch_size = rows;
            },
        );
        let logs: Vec<_> = (0..6).map(|i| submit(&mut e, i, 7 + i, 3, false)).collect();
        while e.run_once() != Tick::Idle {}
        let case = format!("chunk {chunk:?}, rows {rows}, refuse {refuse:?}");
        assert_eq!(e.stats().prefill_steps, want_steps, "{case}");
        assert_eq!((e.stats().finished, e.stats().failed), (6, 0), "{case}");
        for log in logs {
            let log = log.lock().unwrap();
            assert!(log.violations.is_empty(), "{case}: {:?}", log.violations);
            assert_eq!(log.tokens.len(), 3, "{case}");
        }
        assert!(e.executor().violations.is_empty(), "{case}");
    }
}

/// `n > 1`: the samples of one request fork from the first once its prompt
/// is launched, share its full prompt pages (fewer pages in use than the
/// same samples as separate requests), each emit the tokens a request of
/// its own with its seed would, and leave no page referenced, whether they
/// finish or one is cancelled part-way.
#[test]
fn forked_samples_share_prompt_pages_and_free_them() {
    let prompt: Vec<u32> = (1..=37).collect();
    let run = |forked: bool, abort: Option<u64>| {
        let sim = SimConfig {
            page_size: 4,
            ..SimConfig::default()
        };
        let mut e = engine_with(
            sim,
            PipelineMode::Pipelined,
            PrefillPolicy::RideAlong,
            |_| {},
        );
        let mut logs = Vec::new();
        let reqs: Vec<_> = (0..3u64)
            .map(|k| {
                let (skill, log) = SimSkill::new(None, None);
                logs.push(log);
                Request {
                    id: 10 + k,
                    prompt: prompt.clone(),
                    max_new_tokens: 12,
                    params: SimParams {
                        seed: 99 + k,
                        ..Default::default()
                    },
                    speculate: None,
                    embeds: None,
                    skill: Box::new(skill),
                }
            })
            .collect();
        if forked {
            e.submit_samples(reqs).unwrap();
        } else {
            for r in reqs {
                e.submit(r).unwrap();
            }
        }
        let mut peak = 0;
        for i in 0.. {
            if Some(i) == abort.map(|_| 4) {
                assert!(e.abort(abort.unwrap()));
            }
            let tick = e.run_once();
            assert!(
                e.executor().violations.is_empty(),
                "{:?}",
                e.executor().violations
            );
            peak = peak.max(e.executor().used_pages());
            if tick == Tick::Idle {
                break;
            }
        }
        assert_eq!(
            (e.executor().used_pages(), e.executor().num_allocated()),
            (0, 0)
        );
        let tokens: Vec<_> = logs
            .iter()
            .map(|l| l.lock().unwrap().tokens.clone())
            .collect();
        (peak, tokens)
    };
    let (apart_peak, apart) = run(false, None);
    let (forked_peak, forked) = run(true, None);
    assert_eq!(forked, apart, "a fork samples as a request of its own");
    assert!(apart.iter().all(|t| !t.is_empty()));
    // 37 prompt tokens: 9 full pages shared by the two forks.
    assert!(
        forked_peak + 2 * 9 <= apart_peak,
        "forks share pages: {forked_peak} vs {apart_peak} apart"
    );
    // The parent or a fork cancelled mid-way: every page still comes back.
    for id in [10, 11] {
        let (_, tokens) = run(true, Some(id));
        assert_eq!(tokens[2], apart[2]);
    }
}
