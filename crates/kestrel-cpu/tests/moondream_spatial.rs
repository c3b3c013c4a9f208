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

use std::path::Path;
use std::sync::{Arc, Mutex};

use kestrel_cpu::runtime::{CpuRuntime, CpuRuntimeConfig, StepConfig};
use kestrel_cpu::Numerics;
use kestrel_model::moondream::image_token_ids;
use kestrel_model::vision::{PreparedImage, RgbImage};
use kestrel_model::LoadedModel;
use kestrel_pipeline::{
    CommittedToken, EngineLoop, LoopConfig, NgramSpec, Outcome, PipelineMode, PrefillPolicy,
    PromptEmbeds, Request, SamplingParams, SequenceSkill, Tick, TokenId, TokenMask, Verdict,
};
use kestrel_skills::{
    BoundingBox, Point, SpatialIds, SpatialKind, SpatialOutput, SpatialResult, SpatialSkill,
    SpatialSpec,
};

#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

/// Region logits from f32 hidden states against float64: a bin (or the x
/// stage's coord-vs-EOS choice) closer than this could flip by summation
/// order alone, so the seed's margins must exceed it.
const MARGIN: f64 = 4e-4;
const MAX_OBJECTS: u32 = 3;
/// The text request's tokens (enough to keep drafting past the spatial ones).
const TEXT_TOKENS: u32 = 64;

fn picture(seed: u32) -> RgbImage {
    let (w, h) = (378u32, 378u32);
    let px = (0..w * h * 3)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed).rotate_left(13) as u8 / 2 + (i % 97) as u8)
        .collect();
    RgbImage::from_raw(w, h, px).unwrap()
}

/// Hands the skill's output out when the pipeline finishes it.
struct Reporting(SpatialSkill, Arc<Mutex<Option<SpatialOutput>>>);

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
        let out = self.0.result().expect("finished");
        *self.1.lock().unwrap() = Some(out.expect("no step refused under the skill's mask"));
    }
}

/// Records a text request's tokens.
struct Record(Arc<Mutex<Vec<TokenId>>>);

impl SequenceSkill for Record {
    fn consume(&mut self, t: &CommittedToken<'_>) -> Verdict {
        self.0.lock().unwrap().push(t.token);
        Verdict::Continue
    }
    fn finish(&mut self, outcome: Outcome) {
        assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}");
    }
}

/// A text prompt that repeats itself, so prompt lookup drafts at once.
fn text_prompt() -> Vec<TokenId> {
    let mut p = vec![0];
    for _ in 0..5 {
        p.extend([100, 2000, 30_000]);
    }
    p
}

struct Case {
    kind: SpatialKind,
    prompt: Vec<TokenId>,
    want: SpatialResult,
    want_tokens: Vec<TokenId>,
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ints(v: &serde_json::Value) -> Vec<u32> {
    let a = v.as_array().unwrap();
    a.iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

/// The reference's objects, their values computed as the runtime's
/// decoders compute them from the bins (`bin / 1024`, `2^(bin / 1023 * 10
/// - 10)` in f32).
fn objects(kind: SpatialKind, coords: &[u32], sizes: &[Vec<u32>]) -> SpatialResult {
    let c = |i: usize| coords[i] as f32 / 1024.0;
    let s = |b: u32| 2f32.powf(b as f32 / 1023.0 * 10.0 - 10.0);
    let n = coords.len() / 2;
    match kind {
        SpatialKind::Point => SpatialResult::Points(
            (0..n)
                .map(|o| Point {
                    x: c(2 * o),
                    y: c(2 * o + 1),
                })
                .collect(),
        ),
        SpatialKind::Detect => SpatialResult::Boxes(
            (0..n.min(sizes.len()))
                .map(|o| {
                    let wh = [s(sizes[o][0]), s(sizes[o][1])];
                    BoundingBox::from_centre(c(2 * o), c(2 * o + 1), wh)
                })
                .collect(),
        ),
    }
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
        &picture(3),
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
    let crops_path = dir.join("crops.u8");
    std::fs::write(&crops_path, &image.crops.pixels).unwrap();
    let (tr, tc) = (
        image.crops.tiling.rows.to_string(),
        image.crops.tiling.cols.to_string(),
    );

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
        let spec = serde_json::json!({
            "before": [p.bos_id], "after": template,
            "kind": if kind == SpatialKind::Point { "point" } else { "detect" },
            "max_objects": MAX_OBJECTS, "coord_id": coord_id, "size_id": size_id,
            "eos_id": p.eos_id,
        });
        let prompt_path = dir.join(format!("prompt{i}.json"));
        std::fs::write(&prompt_path, spec.to_string()).unwrap();
        let out = dir.join(format!("out{i}"));
        reference_python::run_script(
            &python,
            "moondream_spatial.py",
            &[
                &ckpt as &dyn AsRef<std::ffi::OsStr>,
                &crops_path,
                &tr,
                &tc,
                &prompt_path,
                &out,
            ],
        );
        let r = read_json(&out.join("spatial.json"));
        let margins: Vec<f64> = r["margins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_f64().unwrap())
            .collect();
        assert!(
            margins.iter().all(|&m| m > MARGIN),
            "case {i}: a reference margin is too thin to decide: {margins:?}"
        );
        let sizes: Vec<Vec<u32>> = r["size_bins"]
            .as_array()
            .unwrap()
            .iter()
            .map(ints)
            .collect();
        let want = objects(kind, &ints(&r["coord_bins"]), &sizes);
        eprintln!("case {i} ({kind:?} {object:?}): {want:?}");
        let mut prompt = before.clone();
        prompt.extend(&template);
        cases.push(Case {
            kind,
            prompt,
            want,
            want_tokens: ints(&r["tokens"]),
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
