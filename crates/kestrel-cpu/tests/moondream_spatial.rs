//! Moondream's `point` and `detect` end to end on the CPU runtime against
//! an independent NumPy reference (`scripts/reference/moondream_spatial.py`,
//! float64): a served synthetic checkpoint with a region model
//! (`moondream_synth.py --served`), one 378 x 378 image, the Starmie point
//! and detect templates around an object, the real pipeline loop with
//! `kestrel_skills::SpatialSkill` (its mask every step) over
//! `CpuRuntime::with_vision`: the runtime's spatial stage decodes each
//! sampled `coord_id` / `size_id`'s value from that step's hidden state,
//! hands it to the skill through the step's outputs, and embeds it as the
//! next input. Every request's tokens, points and boxes are the
//! reference's, in exact numerics, blocking and pipelined, all four
//! requests in one batch beside a text request that speculates (they join
//! it once it drafts, so steps that verify drafts carry the spatial rows'
//! encoded inputs too), whose tokens are those it gets alone, without
//! drafts. Then the same again in caches small enough that point and
//! detect sequences are preempted part-way through their objects and
//! prefilled again with the coordinate and size ids they generated, which
//! the runtime embeds from the values committed with them
//! (`PrefillInput::generated_values`): the same tokens, points and boxes.
//!
//! Skipped, saying so, without numpy unless `KESTREL_REQUIRE_PYTHON` is
//! set (CI).

use std::sync::{Arc, Mutex};

use kestrel_cpu::runtime::{CpuRuntime, CpuRuntimeConfig, StepConfig};
use kestrel_cpu::Numerics;
use kestrel_model::moondream::image_token_ids;
use kestrel_model::vision::PreparedImage;
use kestrel_model::LoadedModel;
use kestrel_pipeline::{
    EngineLoop, LoopConfig, NgramSpec, PipelineMode, PrefillPolicy, PromptEmbeds, Request,
    SamplingParams, Tick, TokenId,
};
use kestrel_skills::{
    SpatialIds, SpatialKind, SpatialOutput, SpatialResult, SpatialSkill, SpatialSpec,
};

#[path = "../../../tests/support/pictures.rs"]
#[allow(dead_code)]
mod pictures;
#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

use pictures::picture_378;
#[path = "../../../tests/support/spatial_skills.rs"]
mod spatial_skills;

use spatial_skills::{text_prompt, Record, Reporting};
#[path = "../../../tests/support/moondream_spatial_reference.rs"]
mod spatial_reference;

use spatial_reference::SpatialCase;

const MAX_OBJECTS: u32 = 3;
/// The text request's tokens (enough to keep drafting past the spatial ones).
const TEXT_TOKENS: u32 = 64;

struct Case {
    kind: SpatialKind,
    prompt: Vec<TokenId>,
    want: SpatialResult,
    want_tokens: Vec<TokenId>,
}

/// What a run gave: each case's output, the text request's tokens, the
/// draft tokens the loop verified and its preemptions.
struct Run {
    spatial: Vec<SpatialOutput>,
    text: Vec<TokenId>,
    drafts: u64,
    preemptions: u64,
}

/// The KV cache of a run: pages and tokens a page.
#[derive(Debug, Clone, Copy)]
struct Kv {
    num_pages: usize,
    page_size: usize,
}

/// Caches of 4-token pages a few pages above what the longest request
/// needs alone (768 tokens), so that growing sequences run out and the
/// youngest are preempted mid-object (2 to 3 preemptions in each mode).
/// Embedding a re-prefill's generated coordinate and size ids from the
/// token table instead of their values fails every run at these sizes.
const TIGHT: [Kv; 2] = [
    Kv {
        num_pages: 196,
        page_size: 4,
    },
    Kv {
        num_pages: 198,
        page_size: 4,
    },
];

/// A cache that never runs short for these requests.
const ROOMY: Kv = Kv {
    num_pages: 512,
    page_size: 16,
};

/// Every case's output through one runtime, all submitted together with a
/// text request (speculating when `speculate`).
fn run(
    model: &LoadedModel,
    image: &Arc<PreparedImage>,
    cases: &[Case],
    mode: PipelineMode,
    speculate: bool,
    kv: Kv,
) -> Run {
    let cfg = CpuRuntimeConfig {
        threads: 2,
        numerics: Numerics::Exact,
        step: StepConfig {
            max_rows: 4,
            num_pages: kv.num_pages,
            page_size: kv.page_size,
            max_seq_len: 1024,
            max_draft_tokens: 16,
            ..StepConfig::default()
        },
        ..CpuRuntimeConfig::default()
    };
    let vision = model.vision.clone().unwrap();
    let p = vision.prompts.clone();
    let ids = SpatialIds {
        coord: p.coord_id.unwrap(),
        size: p.size_id.unwrap(),
        eos: p.eos_id,
    };
    let rt = CpuRuntime::new(model.weights.clone(), cfg)
        .unwrap()
        .with_vision(vision.clone())
        .unwrap();
    let image_end = vision.config.text.prefix_attn;
    let config = LoopConfig {
        mode,
        prefill_policy: PrefillPolicy::Drain,
        max_seq_len: 1024,
        debug_checks: true,
        ..LoopConfig::default()
    };
    let mut engine = EngineLoop::new(rt, config).unwrap();
    let text = Arc::new(Mutex::new(Vec::new()));
    engine
        .submit(Request {
            id: 99,
            prompt: text_prompt(),
            max_new_tokens: TEXT_TOKENS,
            params: SamplingParams::greedy(),
            speculate: speculate.then(|| NgramSpec {
                min_ngram: 1,
                ..NgramSpec::new(4)
            }),
            skill: Box::new(Record(text.clone())),
            embeds: None,
        })
        .unwrap();
    // A speculating text request runs until it verifies drafts (its
    // greedy output loops, so it keeps drafting), then the spatial
    // requests join its steps.
    if speculate {
        while engine.stats().draft_tokens == 0 {
            assert_eq!(
                engine.run_once(),
                Tick::Progress,
                "no drafts before the end"
            );
        }
    }
    let mut outs = Vec::new();
    for (id, case) in cases.iter().enumerate() {
        let out = Arc::new(Mutex::new(None));
        let spec = SpatialSpec::new(case.kind, ids, MAX_OBJECTS).unwrap();
        engine
            .submit(Request {
                id: id as u64,
                prompt: case.prompt.clone(),
                max_new_tokens: 32,
                params: SamplingParams::greedy(),
                speculate: None,
                skill: Box::new(Reporting(SpatialSkill::new(spec), out.clone())),
                embeds: Some(PromptEmbeds {
                    start: 1,
                    len: image_end - 1,
                    bidirectional_end: image_end,
                    input: image.clone(),
                }),
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

#[test]
fn points_and_boxes_match_the_numpy_reference_pipelined_blocking_and_preempted() {
    // A seed whose x stages do not all choose EOS at once (11,
    // A's query seed, stops every case before its first object).
    let Some((python, dir, ckpt)) =
        reference_python::served_moondream("moondream_spatial", "md-spatial", 17)
    else {
        return;
    };
    let model = kestrel_model::load(&ckpt).unwrap();
    let vision = model.vision.clone().expect("vision");
    assert!(
        vision.region.is_some(),
        "the synthetic checkpoint has a region model"
    );
    let image = Arc::new(PreparedImage::new(
        &picture_378(3),
        &vision.config.vision.crop_geometry(),
    ));
    let p = &vision.prompts;
    let (coord_id, size_id) = (p.coord_id.unwrap(), p.size_id.unwrap());
    let vocab = model.weights.config.vocab_size;
    let mut before = vec![p.bos_id];
    before.extend(image_token_ids(
        &image,
        vocab,
        vision.config.vision.patches(),
    ));
    let mut cases = Vec::new();
    for (i, (kind, object)) in [
        (SpatialKind::Point, "cat"),
        (SpatialKind::Detect, "cat"),
        (SpatialKind::Point, "red ball"),
        (SpatialKind::Detect, "red ball"),
    ]
    .into_iter()
    .enumerate()
    {
        // As the published `point` / `detect` tokenize it: `" " + object`.
        let words = model.encode(&format!(" {object}")).unwrap();
        let (prefix, suffix) = match kind {
            SpatialKind::Point => (&p.point_prefix, &p.point_suffix),
            SpatialKind::Detect => (&p.detect_prefix, &p.detect_suffix),
        };
        let template: Vec<u32> = prefix.iter().chain(&words).chain(suffix).copied().collect();
        let r = spatial_reference::spatial(
            &python,
            &ckpt,
            &dir,
            &image,
            &SpatialCase {
                kind,
                max_objects: MAX_OBJECTS,
                ids: SpatialIds {
                    coord: coord_id,
                    size: size_id,
                    eos: p.eos_id,
                },
                before: &[p.bos_id],
                after: &template,
            },
            &format!("case{i}"),
        );
        let want = r.objects;
        eprintln!("case {i} ({kind:?} {object:?}): {want:?}");
        let mut prompt = before.clone();
        prompt.extend(&template);
        cases.push(Case {
            kind,
            prompt,
            want,
            want_tokens: r.tokens,
        });
    }
    let found: usize = cases.iter().map(|c| c.want.len()).sum();
    assert!(found >= 2, "the seed must give objects to compare: {found}");

    // The text request alone (no spatial case, no drafts): its reference.
    let alone = run(&model, &image, &[], PipelineMode::Blocking, false, ROOMY);
    assert_eq!(alone.text.len(), TEXT_TOKENS as usize);
    for mode in [PipelineMode::Blocking, PipelineMode::Pipelined] {
        let r = run(&model, &image, &cases, mode, true, ROOMY);
        for (i, (case, out)) in cases.iter().zip(&r.spatial).enumerate() {
            assert_eq!(out.token_ids, case.want_tokens, "case {i} tokens, {mode:?}");
            assert_eq!(out.objects, case.want, "case {i} objects, {mode:?}");
        }
        assert_eq!(r.text, alone.text, "the text request beside them, {mode:?}");
        assert!(r.drafts > 0, "{mode:?}: no drafts for {:?}", r.text);
        assert_eq!(r.preemptions, 0, "{mode:?}: the roomy cache preempted");
    }
    // A cache so small that the youngest sequences, point and detect ones
    // part-way through their objects, are preempted and prefilled again
    // with the coordinates and sizes they generated: the same results.
    for kv in TIGHT {
        for mode in [PipelineMode::Blocking, PipelineMode::Pipelined] {
            let r = run(&model, &image, &cases, mode, true, kv);
            assert!(r.preemptions > 0, "{kv:?}, {mode:?}: nothing was preempted");
            for (i, (case, out)) in cases.iter().zip(&r.spatial).enumerate() {
                let at = format!("case {i}, {kv:?}, {mode:?}");
                assert_eq!(out.token_ids, case.want_tokens, "{at}: tokens");
                assert_eq!(out.objects, case.want, "{at}: objects");
            }
            assert_eq!(r.text, alone.text, "the text request, {kv:?}, {mode:?}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
