//! Moondream's spatial stage on the CUDA runtime, run on the host device:
//! a served synthetic checkpoint with a region model
//! (`moondream_synth.py --served`), the Starmie point and detect templates
//! around an object, batched through the real pipeline loop with
//! `kestrel_skills::SpatialSkill` (its mask every step), blocking and
//! pipelined, over `HostRuntime::with_region` and over the CPU runtime's
//! `CpuRuntime::with_vision`: every request's tokens, points and boxes
//! equal. The CUDA runtime decodes each sampled `coord_id` / `size_id`'s
//! value on the device (`spatial_values`, after sampling), hands it out
//! through `StepOutputs::values` and embeds it as the row's next input
//! inside the decode graph (`fourier_features`, the encoders,
//! `spatial_embed`).
//!
//! Run twice: alone, and beside a text request that speculates (the
//! spatial requests join it once it drafts, so steps that verify its
//! drafts carry their encoded inputs and decode their values too:
//! `accept_values`), whose tokens are the CPU runtime's as well. Then
//! again in caches small enough that point and detect sequences are
//! preempted part-way through their objects and prefilled again with the
//! coordinate and size ids they generated, which the CUDA runtime embeds
//! from the values committed with them (`PrefillInput::generated_values`):
//! the CPU runtime's results all the same.
//!
//! The prompts here carry no image (BOS, then the template); point and
//! detect with their image (729 image rows after BOS, as the CPU's
//! `moondream_spatial` test's prompts) are `moondream_image.rs`'s.
//!
//! Skipped, saying so, without numpy unless `KESTREL_REQUIRE_PYTHON` is
//! set (CI).

use std::sync::{Arc, Mutex};

use kestrel_cpu::runtime::{CpuRuntime, CpuRuntimeConfig};
use kestrel_cpu::Numerics;
use kestrel_cuda::{CudaRuntimeConfig, HostRuntime, StepConfig};
use kestrel_model::LoadedModel;
use kestrel_pipeline::{
    EngineLoop, Executor, LoopConfig, NgramSpec, Outcome, PipelineMode, PrefillPolicy, Request,
    SamplingParams, Tick, TokenId,
};
use kestrel_skills::{
    SpatialIds, SpatialKind, SpatialOutput, SpatialResult, SpatialSkill, SpatialSpec,
};

#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;
#[path = "../../../tests/support/spatial_skills.rs"]
mod spatial_skills;

use spatial_skills::{text_prompt, Record, Reporting};

const MAX_OBJECTS: u32 = 3;

/// The KV cache of a run: pages and tokens a page.
#[derive(Debug, Clone, Copy)]
struct Kv {
    num_pages: usize,
    page_size: usize,
}

/// A cache that never runs short for these requests.
const ROOMY: Kv = Kv {
    num_pages: 256,
    page_size: 16,
};

/// Caches of 2-token pages so small that growing sequences run out and the
/// youngest, point and detect ones part-way through their objects, are
/// preempted and prefilled again with the coordinate and size ids they
/// generated (2 to 3 preemptions a run), alone and beside the speculating
/// text request. Embedding those ids from the token table instead of their
/// committed values (the prefill's `SpatialIn::None`) fails all four runs;
/// at the other sizes from 21 to 45 pages it changed no result (nothing
/// was preempted, or no result depended on a preempted spatial id).
const TIGHT: [(Kv, bool); 2] = [
    (
        Kv {
            num_pages: 21,
            page_size: 2,
        },
        false,
    ),
    (
        Kv {
            num_pages: 40,
            page_size: 2,
        },
        true,
    ),
];

fn step(kv: Kv) -> StepConfig {
    StepConfig {
        max_rows: 5,
        num_pages: kv.num_pages,
        page_size: kv.page_size,
        max_seq_len: 256,
        max_draft_tokens: 16,
        ..StepConfig::default()
    }
}

/// What a run gave: each case's output, the text request's tokens (when
/// one speculated beside them), the draft tokens the loop verified and its
/// preemptions.
struct Run {
    spatial: Vec<SpatialOutput>,
    text: Vec<TokenId>,
    drafts: u64,
    preemptions: u64,
}

/// Every case through one runtime, submitted together (after a text
/// request has started verifying drafts, when `speculate`).
fn run<E: Executor<Params = SamplingParams>>(
    rt: E,
    ids: SpatialIds,
    cases: &[(SpatialKind, Vec<u32>)],
    mode: PipelineMode,
    speculate: bool,
) -> Run {
    let config = LoopConfig {
        mode,
        prefill_policy: PrefillPolicy::Drain,
        max_seq_len: 256,
        debug_checks: true,
        ..LoopConfig::default()
    };
    let mut engine = EngineLoop::new(rt, config).unwrap();
    let text = Arc::new(Mutex::new(Vec::new()));
    if speculate {
        engine
            .submit(Request {
                id: 99,
                prompt: text_prompt(),
                max_new_tokens: 64,
                params: SamplingParams::greedy(),
                speculate: Some(NgramSpec {
                    min_ngram: 1,
                    ..NgramSpec::new(4)
                }),
                skill: Box::new(Record(text.clone())),
                embeds: None,
            })
            .unwrap();
        while engine.stats().draft_tokens == 0 {
            assert_eq!(
                engine.run_once(),
                Tick::Progress,
                "no drafts before the end"
            );
        }
    }
    let mut outs = Vec::new();
    for (id, (kind, prompt)) in cases.iter().enumerate() {
        let out = Arc::new(Mutex::new(None));
        let spec = SpatialSpec::new(*kind, ids, MAX_OBJECTS).unwrap();
        engine
            .submit(Request {
                id: id as u64,
                prompt: prompt.clone(),
                max_new_tokens: 32,
                params: SamplingParams::greedy(),
                speculate: None,
                skill: Box::new(Reporting(SpatialSkill::new(spec), out.clone())),
                embeds: None,
            })
            .unwrap();
        outs.push(out);
    }
    assert_eq!(engine.run_until_idle(), Tick::Idle);
    let (drafts, preemptions) = (engine.stats().draft_tokens, engine.stats().preemptions);
    let spatial = outs
        .iter()
        .map(|o| o.lock().unwrap().take().expect("resolved"))
        .collect();
    let text = text.lock().unwrap().clone();
    Run {
        spatial,
        text,
        drafts,
        preemptions,
    }
}

fn objects(r: &SpatialResult) -> usize {
    match r {
        SpatialResult::Points(p) => p.len(),
        SpatialResult::Boxes(b) => b.len(),
    }
}

fn prompts(model: &LoadedModel) -> Vec<(SpatialKind, Vec<u32>)> {
    let p = &model.vision.as_ref().unwrap().prompts;
    let mut cases = Vec::new();
    for (kind, object) in [
        (SpatialKind::Point, "cat"),
        (SpatialKind::Detect, "cat"),
        (SpatialKind::Point, "red ball"),
        (SpatialKind::Detect, "red ball"),
    ] {
        let words = model.encode(&format!(" {object}")).unwrap();
        let (prefix, suffix) = match kind {
            SpatialKind::Point => (&p.point_prefix, &p.point_suffix),
            SpatialKind::Detect => (&p.detect_prefix, &p.detect_suffix),
        };
        let mut prompt = vec![p.bos_id];
        prompt.extend(prefix.iter().chain(&words).chain(suffix));
        cases.push((kind, prompt));
    }
    cases
}

#[test]
fn points_and_boxes_on_the_host_device_equal_the_cpu_runtimes() {
    let Some((_python, dir, ckpt)) =
        reference_python::served_moondream("cuda moondream_spatial", "cuda-md-spatial", 17)
    else {
        return;
    };
    let model = kestrel_model::load(&ckpt).unwrap();
    let vision = model.vision.clone().expect("vision");
    assert!(vision.region.is_some(), "a region model");
    let p = &vision.prompts;
    let ids = SpatialIds {
        coord: p.coord_id.unwrap(),
        size: p.size_id.unwrap(),
        eos: p.eos_id,
    };
    let cases = prompts(&model);
    let cpu = |kv| {
        let cfg = CpuRuntimeConfig {
            threads: 1,
            numerics: Numerics::Exact,
            step: step(kv),
            ..CpuRuntimeConfig::default()
        };
        CpuRuntime::new(model.weights.clone(), cfg)
            .unwrap()
            .with_vision(vision.clone())
            .unwrap()
    };
    let host = |kv| {
        let cfg = CudaRuntimeConfig {
            step: step(kv),
            cuda_graphs: true,
            ..CudaRuntimeConfig::default()
        };
        HostRuntime::new(model.weights.clone(), cfg)
            .unwrap()
            .with_region(&vision)
            .unwrap()
    };
    let mut wants = Vec::new();
    for speculate in [false, true] {
        let want = run(cpu(ROOMY), ids, &cases, PipelineMode::Blocking, speculate);
        let found: usize = want.spatial.iter().map(|o| objects(&o.objects)).sum();
        eprintln!(
            "CPU (speculate {speculate}): {found} objects, {} drafts; {:?}",
            want.drafts,
            want.spatial
                .iter()
                .map(|o| &o.token_ids)
                .collect::<Vec<_>>()
        );
        assert!(
            found > 0,
            "the seed's prompts find objects (else the test checks nothing)"
        );
        assert_eq!(speculate, want.drafts > 0);
        for mode in [PipelineMode::Blocking, PipelineMode::Pipelined] {
            let got = run(host(ROOMY), ids, &cases, mode, speculate);
            let what = format!("{mode:?}, speculate {speculate}");
            for (i, (g, w)) in got.spatial.iter().zip(&want.spatial).enumerate() {
                assert_eq!(g.token_ids, w.token_ids, "case {i} {what}: tokens");
                assert_eq!(g.objects, w.objects, "case {i} {what}: objects");
                assert!(matches!(g.outcome, Outcome::Finished(_)), "{:?}", g.outcome);
            }
            assert_eq!(got.text, want.text, "{what}: the text request");
            assert_eq!(speculate, got.drafts > 0, "{what}: drafts verified");
            assert_eq!(got.preemptions, 0, "{what}: the roomy cache preempted");
        }
        wants.push(want);
    }
    // Preempted mid-object and prefilled again with the values committed
    // with the generated coordinate and size ids (`generated_values`): the
    // CPU runtime's results in the roomy cache all the same.
    for (kv, speculate) in TIGHT {
        let want = &wants[usize::from(speculate)];
        for mode in [PipelineMode::Blocking, PipelineMode::Pipelined] {
            let got = run(host(kv), ids, &cases, mode, speculate);
            let what = format!("{kv:?}, {mode:?}, speculate {speculate}");
            assert!(got.preemptions > 0, "{what}: nothing was preempted");
            for (i, (g, w)) in got.spatial.iter().zip(&want.spatial).enumerate() {
                assert_eq!(g.token_ids, w.token_ids, "case {i} {what}: tokens");
                assert_eq!(g.objects, w.objects, "case {i} {what}: objects");
                assert!(matches!(g.outcome, Outcome::Finished(_)), "{:?}", g.outcome);
            }
            assert_eq!(got.text, want.text, "{what}: the text request");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
