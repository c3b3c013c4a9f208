//! `SpatialSkill` driven by the real pipeline over the simulated device:
//! random point / detect requests mixed with text ones, small caches that
//! preempt, blocking and pipelined. Each spatial request's points or boxes
//! must equal an independent reference that replays the cycle with the
//! simulated sampler and the simulated spatial stage (`sim_values`), so a
//! value handed to the wrong token, row or position, a stale mask or a
//! mode that changes results fails it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kestrel_pipeline::testing::{
    sim_sample, sim_values, SimConfig, SimExecutor, SimParams, SimSkill, SIM_EOS,
};
use kestrel_pipeline::{
    CommittedToken, EngineLoop, FinishReason, LoopConfig, Outcome, PipelineMode, PrefillPolicy,
    Request, SequenceSkill, Tick, TokenId, TokenMask, Verdict,
};
use kestrel_skills::{
    BoundingBox, Point, SpatialIds, SpatialKind, SpatialOutput, SpatialResult, SpatialSkill,
    SpatialSpec,
};
use proptest::prelude::*;

const VOCAB: usize = 64;
const IDS: SpatialIds = SpatialIds {
    coord: 5,
    size: 6,
    eos: SIM_EOS,
};

type Shared = Arc<Mutex<Option<SpatialOutput>>>;

/// Hands the skill's result out when the pipeline finishes it.
struct Reporting(SpatialSkill, Shared);

impl SequenceSkill for Reporting {
    fn consume(&mut self, token: &CommittedToken<'_>) -> Verdict {
        self.0.consume(token)
    }
    fn is_constrained(&self) -> bool {
        self.0.is_constrained()
    }
    fn fill_mask(&mut self, mask: &mut TokenMask<'_>) {
        self.0.fill_mask(mask)
    }
    fn finish(&mut self, outcome: Outcome) {
        self.0.finish(outcome);
        let result = self.0.result().expect("finished");
        *self.1.lock().unwrap() = Some(result.expect("no step refused under its own mask"));
    }
}

#[derive(Debug, Clone)]
struct Req {
    spatial: Option<(SpatialKind, u32)>,
    prompt_len: usize,
    max_new: u32,
    seed: u64,
}

/// The reference: the cycle replayed with the simulated sampler under the
/// stage's ids and the simulated spatial stage, written without the skill.
fn reference(kind: SpatialKind, max_objects: u32, r: &Req) -> (SpatialResult, Vec<TokenId>) {
    let cycle = if kind == SpatialKind::Point { 2 } else { 3 };
    let (mut tokens, mut values) = (Vec::new(), Vec::new());
    for i in 0..r.max_new as usize {
        let allowed: &[TokenId] = match i % cycle {
            0 => &[IDS.coord, IDS.eos],
            1 => &[IDS.coord],
            _ => &[IDS.size],
        };
        let mut words = vec![0u32; VOCAB.div_ceil(32)];
        for &t in allowed {
            words[t as usize / 32] |= 1 << (t % 32);
        }
        let pos = r.prompt_len + i;
        let t = sim_sample(r.seed, pos, VOCAB, Some(&words));
        tokens.push(t);
        values.push(sim_values(r.seed, pos, t));
        let objects = (i + 1) / cycle;
        if t == IDS.eos || ((i + 1) % cycle == 0 && objects == max_objects as usize) {
            break;
        }
    }
    let complete = tokens.len() / cycle;
    let objects = (0..complete).map(|o| {
        let v = &values[o * cycle..];
        (v[0].coord, v[1].coord, v.get(2).map(|s| s.size))
    });
    let result = match kind {
        SpatialKind::Point => {
            SpatialResult::Points(objects.map(|(x, y, _)| Point { x, y }).collect())
        }
        SpatialKind::Detect => SpatialResult::Boxes(
            objects
                .map(|(x, y, s)| BoundingBox::from_centre(x, y, s.expect("a detect size")))
                .collect(),
        ),
    };
    (result, tokens)
}

/// Each spatial request's output, and how often the loop preempted.
fn run(
    reqs: &[Req],
    mode: PipelineMode,
    num_pages: usize,
) -> (BTreeMap<usize, SpatialOutput>, u64) {
    let exec = SimExecutor::new(SimConfig {
        vocab_size: VOCAB,
        num_pages,
        page_size: 4,
        trace: false,
        ..SimConfig::default()
    });
    let mut engine = EngineLoop::new(
        exec,
        LoopConfig {
            mode,
            prefill_policy: PrefillPolicy::Drain,
            max_batch_size: 4,
            max_seq_len: 256,
            debug_checks: true,
            ..LoopConfig::default()
        },
    )
    .unwrap();
    let mut shared = BTreeMap::new();
    for (i, r) in reqs.iter().enumerate() {
        let skill: Box<dyn SequenceSkill> = match r.spatial {
            Some((kind, max)) => {
                let out = Shared::default();
                shared.insert(i, out.clone());
                let spec = SpatialSpec::new(kind, IDS, max).unwrap();
                Box::new(Reporting(SpatialSkill::new(spec), out))
            }
            None => Box::new(SimSkill::new(None, None).0),
        };
        engine
            .submit(Request {
                id: i as u64,
                prompt: (0..r.prompt_len as u32).map(|t| t % 60 + 1).collect(),
                max_new_tokens: r.max_new,
                params: SimParams {
                    seed: r.seed,
                    ..Default::default()
                },
                speculate: None,
                skill,
                embeds: None,
            })
            .unwrap();
    }
    for _ in 0..100_000 {
        match engine.run_once() {
            Tick::Idle => break,
            Tick::Progress => {}
            t => panic!("{t:?}"),
        }
        assert!(engine.executor().violations.is_empty());
    }
    assert!(engine.is_idle());
    let outs = shared
        .into_iter()
        .map(|(i, s)| (i, s.lock().unwrap().take().expect("resolved")))
        .collect();
    (outs, engine.stats().preemptions)
}

fn check(reqs: &[Req], got: &BTreeMap<usize, SpatialOutput>) -> Result<(), TestCaseError> {
    for (i, out) in got {
        let (kind, max) = reqs[*i].spatial.unwrap();
        let (objects, tokens) = reference(kind, max, &reqs[*i]);
        prop_assert_eq!(&out.objects, &objects, "request {}", i);
        prop_assert_eq!(&out.token_ids, &tokens, "request {}", i);
        let reason = match tokens.last() {
            Some(&t) if t == IDS.eos => FinishReason::Eos,
            _ => FinishReason::Length,
        };
        prop_assert_eq!(&out.outcome, &Outcome::Finished(reason));
    }
    Ok(())
}

/// Long detect requests in a cache that holds about two of them: the loop
/// preempts and re-admits, and every box is still its reference's.
#[test]
fn preempted_spatial_requests_keep_their_values() {
    let reqs: Vec<Req> = (0..8)
        .map(|i| Req {
            spatial: Some((SpatialKind::Detect, 50)),
            prompt_len: 10,
            max_new: 30,
            seed: 1000 + i,
        })
        .collect();
    for mode in [PipelineMode::Blocking, PipelineMode::Pipelined] {
        let (got, preemptions) = run(&reqs, mode, 14);
        assert!(preemptions > 0, "{mode:?}: the scenario must preempt");
        assert_eq!(got.len(), reqs.len());
        check(&reqs, &got).unwrap();
        assert!(got.values().any(|o| o.objects.len() >= 2));
    }
}

fn req() -> impl Strategy<Value = Req> {
    (
        prop::option::weighted(
            0.7,
            (
                prop_oneof![Just(SpatialKind::Point), Just(SpatialKind::Detect)],
                1u32..6,
            ),
        ),
        1usize..20,
        1u32..24,
        any::<u64>(),
    )
        .prop_map(|(spatial, prompt_len, max_new, seed)| Req {
            spatial,
            prompt_len,
            max_new,
            seed,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn spatial_results_match_the_reference_in_every_mode(
        reqs in prop::collection::vec(req(), 1..10),
        num_pages in prop_oneof![12usize..24, Just(4096)],
    ) {
        for mode in [PipelineMode::Blocking, PipelineMode::Pipelined] {
            let (got, _) = run(&reqs, mode, num_pages);
            check(&reqs, &got)?;
        }
    }
}
