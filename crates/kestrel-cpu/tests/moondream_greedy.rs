//! Moondream end to end on the CPU runtime against an independent NumPy
//! reference (`scripts/reference/moondream_greedy.py`, float64, written
//! from the published architecture): a served synthetic checkpoint
//! (`moondream_synth.py --served`: real tensor names, crop geometry and
//! vocabulary, tiny widths) loaded by `kestrel_model::load`, a 378 x 378
//! image (one tile, so both crops are the image and no resampling
//! differs; the reference reads Kestrel's crops anyway), the prompt BOS +
//! 729 image rows (bidirectional) + the Starmie query template around a
//! question. Through the real pipeline loop and `CpuRuntime::with_vision`
//! in exact numerics, in one chunk and in 100-token chunks with 64-row
//! forwards (the bidirectional prefix is then one chunk and one forward
//! longer than both), the 8 greedy tokens are the reference's; the first
//! step's logits (from `CpuModel` directly, with the image rows embedded)
//! are within `LOGIT_TOL x (|reference| + 1)`. A second request on the
//! same image gives the same tokens without running the encoder again
//! (`vision_stats`), unless the image cache is off. Image rows sent to a
//! runtime without a vision model fail that request alone, before
//! dispatch (no Python needed for that one).
//!
//! Skipped, saying so, without numpy unless `KESTREL_REQUIRE_PYTHON` is
//! set (CI).

use std::num::NonZeroUsize;
use std::path::Path;
use std::sync::{Arc, Mutex};

use kestrel_cpu::model::{LogitsMode, PrefillBatch, PrefillRows};
use kestrel_cpu::runtime::{CpuRuntime, CpuRuntimeConfig, StepConfig};
use kestrel_cpu::vision::{encode_image, VisionRun};
use kestrel_cpu::{CpuModel, CpuModelOptions, KvStore, Numerics, Scratch};
use kestrel_model::moondream::image_token_ids;
use kestrel_model::vision::PreparedImage;
use kestrel_model::LoadedModel;
use kestrel_pipeline::{
    CommittedToken, EngineLoop, LoopConfig, Outcome, PromptEmbeds, Request, SamplingParams,
    SequenceSkill, Tick, TokenId, Verdict,
};

#[path = "../../../tests/support/moondream_reference.rs"]
#[allow(dead_code)] // not every including test reads every field
mod moondream_reference;
#[path = "../../../tests/support/pictures.rs"]
#[allow(dead_code)]
mod pictures;
#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

use pictures::picture_378;

/// f32 against float64 through a 2-layer encoder, the projector and a
/// 2-layer decoder over ~740 positions: summation order only (measured
/// 1e-6).
const LOGIT_TOL: f32 = 1e-4;
const STEPS: usize = 8;

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Records every token (and, if given, the outcome); never stops before
/// `max_new_tokens`. Without an outcome slot it must finish normally.
struct Record(
    Arc<Mutex<Vec<TokenId>>>,
    Option<Arc<Mutex<Option<Outcome>>>>,
);

impl SequenceSkill for Record {
    fn consume(&mut self, t: &CommittedToken<'_>) -> Verdict {
        self.0.lock().unwrap().push(t.token);
        Verdict::Continue
    }
    fn finish(&mut self, outcome: Outcome) {
        match &self.1 {
            Some(slot) => *slot.lock().unwrap() = Some(outcome),
            None => assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}"),
        }
    }
}

struct Case {
    model: LoadedModel,
    image: Arc<PreparedImage>,
    prompt: Vec<TokenId>,
    /// Where the template starts (after BOS and the image's rows).
    image_end: usize,
}

impl Case {
    fn embeds(&self) -> PromptEmbeds {
        PromptEmbeds {
            start: 1,
            len: self.image_end - 1,
            bidirectional_end: self.image_end,
            input: self.image.clone(),
        }
    }
}

/// Greedy tokens of `requests` requests on the case's image, one after
/// the other through one runtime; the runtime's encoder runs.
fn run(
    case: &Case,
    requests: usize,
    prefill_chunk: Option<usize>,
    forward_rows: usize,
    image_cache: usize,
    prefix_cache: bool,
) -> (Vec<Vec<TokenId>>, u64) {
    let cfg = CpuRuntimeConfig {
        threads: 2,
        numerics: Numerics::Exact,
        image_cache,
        step: StepConfig {
            max_rows: 4,
            num_pages: 256,
            page_size: 16,
            max_seq_len: 1024,
            forward_rows,
            enable_prefix_cache: prefix_cache,
            ..StepConfig::default()
        },
        ..CpuRuntimeConfig::default()
    };
    let vision = case.model.vision.clone().unwrap();
    let rt = CpuRuntime::new(case.model.weights.clone(), cfg)
        .unwrap()
        .with_vision(vision)
        .unwrap();
    let config = LoopConfig {
        max_seq_len: 1024,
        prefill_chunk: prefill_chunk.and_then(NonZeroUsize::new),
        debug_checks: true,
        ..LoopConfig::default()
    };
    let mut engine = EngineLoop::new(rt, config).unwrap();
    let mut outs = Vec::new();
    for id in 0..requests {
        let out = Arc::new(Mutex::new(Vec::new()));
        engine
            .submit(Request {
                id: id as u64,
                prompt: case.prompt.clone(),
                max_new_tokens: STEPS as u32,
                params: SamplingParams::greedy(),
                speculate: None,
                skill: Box::new(Record(out.clone(), None)),
                embeds: Some(case.embeds()),
            })
            .unwrap();
        assert_eq!(engine.run_until_idle(), Tick::Idle);
        outs.push(out.lock().unwrap().clone());
    }
    let runs = engine.executor().vision_stats().encoder_runs;
    (outs, runs)
}

/// The first step's logits from `CpuModel` with the image rows embedded
/// (what the runtime's prefill runs), in one forward.
fn first_logits(case: &Case) -> Vec<f32> {
    let vision = case.model.vision.as_ref().unwrap();
    let model = CpuModel::new(
        case.model.weights.clone(),
        CpuModelOptions {
            threads: 2,
            numerics: Numerics::Exact,
            ..Default::default()
        },
    )
    .unwrap();
    let run = VisionRun {
        team: None,
        isa: model.isa(),
        numerics: Numerics::Exact,
    };
    let tokens = encode_image(
        run,
        &vision.weights,
        &vision.config.vision,
        &case.image.crops,
    )
    .unwrap();
    let n = case.prompt.len();
    let page = 16;
    let pages = n.div_ceil(page);
    let mut kv = KvStore::for_model(&case.model.weights.config, pages, page).unwrap();
    let mut scratch = Scratch::new(&model, n, 1024);
    let indices: Vec<u32> = (0..pages as u32).collect();
    let embedded: Vec<u32> = (1..case.image_end as u32).collect();
    let vocab = case.model.weights.config.vocab_size;
    let mut logits = vec![0f32; vocab];
    model
        .forward_prefill_rows(
            PrefillBatch {
                tokens: &case.prompt,
                qo_indptr: &[0, n as u32],
                start_pos: &[0],
                kv_indptr: &[0, pages as u32],
                kv_indices: &indices,
                kv_last_page_len: &[(n - (pages - 1) * page) as u32],
            },
            PrefillRows {
                bidirectional_end: &[case.image_end as u32],
                embedded: &embedded,
                embeds: &tokens.data,
            },
            &mut kv,
            &mut logits,
            LogitsMode::LastPerSequence,
            &mut scratch,
        )
        .unwrap();
    logits
}

#[test]
fn greedy_query_matches_the_numpy_reference_and_reuses_the_encoded_image() {
    let Some((python, dir, ckpt)) =
        reference_python::served_moondream("moondream_greedy", "md-greedy", 11)
    else {
        return;
    };
    let model = kestrel_model::load(&ckpt).unwrap();
    let vision = model.vision.clone().expect("vision");
    let image = Arc::new(PreparedImage::new(
        &picture_378(3),
        &vision.config.vision.crop_geometry(),
    ));
    assert_eq!(image.crops.count(), 2, "one tile and the global crop");
    let p = &vision.prompts;
    let rows = vision.config.vision.patches();
    let vocab = model.weights.config.vocab_size;
    let mut prompt = vec![p.bos_id];
    prompt.extend(image_token_ids(&image, vocab, rows));
    let image_end = prompt.len();
    assert_eq!(image_end, vision.config.text.prefix_attn);
    let template: Vec<u32> = p
        .query_prefix
        .iter()
        .copied()
        .chain(model.encode("What is in this picture?").unwrap())
        .chain(p.query_suffix.iter().copied())
        .collect();
    prompt.extend(&template);

    let reference = moondream_reference::greedy(
        &python,
        &ckpt,
        &dir,
        &image,
        (&[p.bos_id], &template),
        STEPS as u32,
    );
    let (want_tokens, margins, out) = (reference.tokens, reference.margins, reference.out);

    let case = Case {
        model,
        image,
        prompt,
        image_end,
    };
    // The first step's logits.
    let ours = first_logits(&case);
    let theirs = read_f32(&out.join("logits.f32"));
    assert_eq!(ours.len(), theirs.len());
    let mut worst = 0f32;
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        let err = (a - b).abs() / (b.abs() + 1.0);
        assert!(err <= LOGIT_TOL, "logit {i}: ours {a}, reference {b}");
        worst = worst.max(err);
    }
    // A top-1 margin under the logits' error could flip a token by
    // summation order alone: the seed's margins must leave room.
    for (step, m) in margins.iter().enumerate() {
        assert!(
            *m > 4.0 * f64::from(LOGIT_TOL),
            "step {step}: the reference's top-1 margin {m} is too thin to decide"
        );
    }
    eprintln!("worst logit error {worst:e}; margins {margins:?}; tokens {want_tokens:?}");

    // Whole prompt in one chunk, no prefix cache: the second request on
    // the image is served from the image cache.
    let (outs, runs) = run(&case, 2, None, 1024, 8, false);
    assert_eq!(outs[0], want_tokens, "greedy tokens, one chunk");
    assert_eq!(outs[1], want_tokens, "the second request on the image");
    assert_eq!(runs, 1, "the second request skipped the encoder");
    // Without the image cache the encoder runs for each.
    let (outs, runs) = run(&case, 2, None, 1024, 0, false);
    assert_eq!((&outs[1], runs), (&want_tokens, 2));
    // 100-token chunks of 64-row forwards: the 730-row prefix is one chunk
    // and one forward all the same; with the prefix cache on, the second
    // request reuses the image's pages.
    let (outs, runs) = run(&case, 2, Some(100), 64, 8, true);
    assert_eq!(outs[0], want_tokens, "greedy tokens, chunked");
    assert_eq!(outs[1], want_tokens, "chunked, second request");
    assert_eq!(runs, 1);
    std::fs::remove_dir_all(&dir).ok();
}

/// A request with image rows on a runtime that has no vision model is
/// refused before dispatch: it fails alone, and a text request after it
/// is served.
#[test]
fn image_rows_without_a_vision_model_fail_alone() {
    use kestrel_model::{synthetic_weights, DType, ModelConfig};
    use kestrel_pipeline::FailureKind;
    let weights = synthetic_weights(&ModelConfig::tiny(), DType::F32, 3);
    let rt = CpuRuntime::new(weights, CpuRuntimeConfig::default()).unwrap();
    let mut engine = EngineLoop::new(rt, LoopConfig::default()).unwrap();
    let image = PreparedImage::new(
        &picture_378(1),
        &kestrel_model::vision::CropGeometry::MOONDREAM,
    );
    let mut prompt = vec![1];
    prompt.extend(image_token_ids(&image, 512, 729));
    prompt.push(2);
    let (out, outcome) = (Arc::default(), Arc::new(Mutex::new(None)));
    engine
        .submit(Request {
            id: 1,
            prompt,
            max_new_tokens: 2,
            params: SamplingParams::greedy(),
            speculate: None,
            skill: Box::new(Record(Arc::clone(&out), Some(outcome.clone()))),
            embeds: Some(PromptEmbeds {
                start: 1,
                len: 729,
                bidirectional_end: 730,
                input: Arc::new(image),
            }),
        })
        .unwrap();
    let text = Arc::new(Mutex::new(Vec::new()));
    engine
        .submit(Request {
            id: 2,
            prompt: vec![1, 2, 3],
            max_new_tokens: 2,
            params: SamplingParams::greedy(),
            speculate: None,
            skill: Box::new(Record(text.clone(), None)),
            embeds: None,
        })
        .unwrap();
    assert_eq!(engine.run_until_idle(), Tick::Idle);
    let outcome = outcome.lock().unwrap().take();
    let Some(Outcome::Failed(FailureKind::StepFailed, cause)) = outcome else {
        panic!("{outcome:?}");
    };
    // The runtime's typed refusal, somewhere in the chain.
    let mut chain: Option<&(dyn std::error::Error + 'static)> = Some(cause.get());
    let mut refused = false;
    while let Some(e) = chain {
        refused |= e
            .downcast_ref::<kestrel_cpu::runtime::RuntimeError>()
            .is_some_and(|e| {
                matches!(
                    e,
                    kestrel_cpu::runtime::RuntimeError::ImageRows { id: 1, .. }
                )
            });
        chain = e.source();
    }
    assert!(refused, "{cause}");
    assert!(out.lock().unwrap().is_empty());
    assert_eq!(text.lock().unwrap().len(), 2, "the text request is served");
}
