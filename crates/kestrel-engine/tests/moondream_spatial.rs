//! Moondream's `point` and `detect` served end to end on the CPU backend
//! (and the first test again on the CUDA runtime over kestrel-cuda's host
//! device, `Backend::CudaHost`):
//! `Engine::start` on a served synthetic checkpoint with a region model
//! (`moondream_synth.py --served`), a PNG sent as a `Prompt::Vision` with
//! `VisionTask::Point` / `Detect`. Each request's tokens and objects equal
//! the float64 NumPy loop's (`moondream_spatial.py`, exact numerics),
//! unary and streamed (one `StreamEvent::Object` per object, in order,
//! the final `objects` the same), alone and all four batched beside a
//! text request whose tokens are those it gets alone; two samples (`n`)
//! each give the reference's boxes, and a stream aborted after its first
//! object ends with only complete objects and holds no KV page. Bad input is refused
//! before any work, naming its field: a blank object, `max_objects` 0 or
//! past `MAX_OBJECTS`, a text-only option; and a checkpoint without a
//! region model refuses both skills naming `skill` and the model, while
//! still answering a query.
//! Skipped, saying so, without numpy unless `KESTREL_REQUIRE_PYTHON` is
//! set (CI).

mod common;
#[path = "../../../tests/support/moondream_spatial_reference.rs"]
mod moondream_spatial_reference;
#[path = "../../../tests/support/pictures.rs"]
#[allow(dead_code)]
mod pictures;
#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

use pictures::picture_378;

use std::path::Path;
use std::time::Duration;

use common::{kv_released, rt, until_objects};
use kestrel_engine::validate::{DEFAULT_MAX_OBJECTS, MAX_OBJECTS};
use kestrel_engine::{
    Backend, Constraint, Engine, EngineConfig, EngineError, Field, FinishReason, GenerateRequest,
    ModelSource, Numerics, Prompt, SpatialResult, StreamEvent, VisionTask,
};
use kestrel_model::vision::PreparedImage;
use kestrel_skills::{SpatialIds, SpatialKind};
use moondream_spatial_reference::{spatial, SpatialCase};

/// Few enough that a case ends by `max_objects` or EOS well inside its
/// token budget.
const MAX: u32 = 3;
const TEXT_TOKENS: u32 = 12;

fn engine_on(ckpt: &Path) -> Engine {
    engine_with(ckpt, Backend::Cpu)
}

fn engine_with(ckpt: &Path, backend: Backend) -> Engine {
    Engine::start(
        EngineConfig {
            backend,
            model: ModelSource::Path(ckpt.to_path_buf()),
            threads: 2,
            numerics: Numerics::Exact,
            kv_pages: 512,
            page_size: 16,
            max_seq_len: Some(1024),
            ..EngineConfig::default()
        },
        |_| {},
    )
    .expect("the Moondream engine starts")
}

fn task(kind: SpatialKind, object: &str, max_objects: Option<u32>) -> VisionTask {
    let object = object.to_string();
    match kind {
        SpatialKind::Point => VisionTask::Point {
            object,
            max_objects,
        },
        SpatialKind::Detect => VisionTask::Detect {
            object,
            max_objects,
        },
    }
}

/// A point/detect request as an edge sends it: everything else left unset.
fn request(image: &[u8], task: VisionTask) -> GenerateRequest {
    GenerateRequest {
        input: Prompt::Vision {
            image: image.to_vec(),
            task,
        },
        max_new_tokens: None,
        ..GenerateRequest::text("unused", 1)
    }
}

#[test]
fn points_and_boxes_served_match_the_numpy_reference() {
    served(Backend::Cpu, "engine-md-spatial");
}

/// The same on the CUDA runtime over kestrel-cuda's host device: image
/// rows, the spatial stage and its values in the CUDA step.
#[test]
fn points_and_boxes_served_on_the_cuda_host_device_match_the_numpy_reference() {
    served(Backend::CudaHost, "engine-md-spatial-cuda-host");
}

fn served(backend: Backend, tag: &str) {
    // The seed and picture of kestrel-cpu's moondream_spatial test, whose
    // x stages do not all choose EOS at once.
    let Some((python, dir, ckpt)) =
        reference_python::served_moondream("engine moondream_spatial", tag, 17)
    else {
        return;
    };
    let engine = engine_with(&ckpt, backend);
    let img = picture_378(3);
    let png = img.to_png();
    let loaded = kestrel_model::load(&ckpt).unwrap();
    let v = loaded.vision.as_ref().unwrap();
    let prepared = PreparedImage::new(&img, &v.config.vision.crop_geometry());
    let p = &v.prompts;
    let ids = SpatialIds {
        coord: p.coord_id.unwrap(),
        size: p.size_id.unwrap(),
        eos: p.eos_id,
    };

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
        let words = engine.tokenize(&format!(" {object}"), false).unwrap();
        let (prefix, suffix) = match kind {
            SpatialKind::Point => (&p.point_prefix, &p.point_suffix),
            SpatialKind::Detect => (&p.detect_prefix, &p.detect_suffix),
        };
        let template: Vec<u32> = [&prefix[..], &words, &suffix[..]].concat();
        let want = spatial(
            &python,
            &ckpt,
            &dir,
            &prepared,
            &SpatialCase {
                kind,
                max_objects: MAX,
                ids,
                before: &[p.bos_id],
                after: &template,
            },
            &i.to_string(),
        );
        eprintln!("case {i} ({kind:?} {object:?}): {:?}", want.objects);
        cases.push((request(&png, task(kind, object, Some(MAX))), want, template));
    }
    let found: usize = cases.iter().map(|c| c.1.objects.len()).sum();
    assert!(found >= 2, "the seed must give objects to compare: {found}");

    let text = GenerateRequest::text("the quick brown fox", TEXT_TOKENS);
    rt().block_on(async {
        let text_alone = engine.generate(text.clone()).await.expect("text");
        for (i, (req, want, template)) in cases.iter().enumerate() {
            let r = engine.generate(req.clone()).await.expect("point/detect");
            assert_eq!(r.token_ids, want.tokens, "case {i} tokens");
            assert_eq!(r.objects.as_ref(), Some(&want.objects), "case {i} objects");
            assert_eq!(r.text, "", "case {i}: no text");
            let reason = match want.objects.len() as u32 {
                MAX => FinishReason::Length,
                _ => FinishReason::Eos,
            };
            assert_eq!(r.finish_reason, reason, "case {i}");
            // BOS + 729 image rows + the template.
            assert_eq!(r.usage.prompt_tokens as usize, 730 + template.len());
            assert_eq!(r.usage.completion_tokens as usize, want.tokens.len());
            // Streamed: one object per event, the same objects.
            let mut s = engine.stream(req.clone()).expect("accepted");
            let streamed = until_objects(&mut s).await;
            assert_eq!(streamed.objects, r.objects, "case {i}, streamed");
            assert_eq!(streamed.token_ids, r.token_ids, "case {i}, streamed");
        }
        // All four batched beside a text request, streamed together.
        let mut streams = vec![engine.stream(text.clone()).expect("text accepted")];
        streams.extend(
            cases
                .iter()
                .map(|c| engine.stream(c.0.clone()).expect("accepted")),
        );
        let (t, ..) = common::until_done(&mut streams[0]).await;
        assert_eq!(t.token_ids, text_alone.token_ids, "text beside them");
        for (i, s) in streams[1..].iter_mut().enumerate() {
            let r = until_objects(s).await;
            assert_eq!(r.token_ids, cases[i].1.tokens, "case {i} tokens, batched");
            assert_eq!(
                r.objects.as_ref(),
                Some(&cases[i].1.objects),
                "case {i}, batched"
            );
        }
        // Two samples (n = 2) of a greedy detect: each the reference's.
        let detect = &cases[1];
        let mut two = engine
            .stream_samples(GenerateRequest {
                n: Some(2),
                ..detect.0.clone()
            })
            .expect("n = 2 accepted");
        for (i, s) in two.iter_mut().enumerate() {
            let r = until_objects(s).await;
            assert_eq!(
                (r.index, r.objects.as_ref()),
                (i as u32, Some(&detect.1.objects))
            );
        }
        // Aborted after its first object: the stream ends with `Abort` and
        // the complete objects so far (a prefix of the reference's, never a
        // half-decoded one), and every KV page comes back.
        let mut s = engine.stream(detect.0.clone()).expect("accepted");
        let mut streamed = Vec::new();
        let end = loop {
            match s.next_event().await.expect("terminal").expect("no error") {
                StreamEvent::Object(o) => {
                    streamed.push(o);
                    s.abort();
                }
                StreamEvent::Delta { .. } => panic!("a detect request streamed text"),
                StreamEvent::Done(r) => break r,
            }
        };
        let SpatialResult::Boxes(want) = &detect.1.objects else {
            unreachable!("a detect case")
        };
        let Some(SpatialResult::Boxes(got)) = &end.objects else {
            panic!("boxes: {end:?}")
        };
        assert!(
            !got.is_empty() && want.starts_with(got),
            "{got:?} vs {want:?}"
        );
        assert_eq!(
            streamed.len(),
            got.len(),
            "the objects streamed are the final ones"
        );
        if got.len() < want.len() {
            assert_eq!(end.finish_reason, FinishReason::Abort);
        }
        kv_released(&engine).await;
        // The default max_objects (the seed system's 50) leaves room for
        // what the reference found under 3 (a prefix of it, or all).
        let r = engine
            .generate(request(&png, task(SpatialKind::Point, "cat", None)))
            .await
            .expect("default max_objects");
        assert!(r.objects.unwrap().len() as u32 <= DEFAULT_MAX_OBJECTS);
        kv_released(&engine).await;
        engine.shutdown(Duration::from_secs(1)).await;
    });
    std::fs::remove_dir_all(&dir).ok();
}

/// `err` is an argument error naming `field`.
fn assert_refused(err: &EngineError, field: Field, what: &str) {
    assert!(
        matches!(err, EngineError::InvalidArgument { field: f, .. } if *f == field),
        "{what}: expected an argument error naming {field}, got {err:?}"
    );
    assert_eq!(err.field(), Some(field), "{what}");
}

#[test]
fn bad_point_and_detect_requests_are_refused_naming_the_field() {
    let Some((_python, dir, ckpt)) = reference_python::served_moondream(
        "engine moondream_spatial refusals",
        "engine-md-spatial-bad",
        17,
    ) else {
        return;
    };
    let engine = engine_on(&ckpt);
    let png = picture_378(3).to_png();
    rt().block_on(async {
        for kind in [SpatialKind::Point, SpatialKind::Detect] {
            let cases: Vec<(GenerateRequest, Field)> = vec![
                (request(&png, task(kind, "", None)), Field::Object),
                (request(&png, task(kind, " \n\t", Some(3))), Field::Object),
                (request(&png, task(kind, "cat", Some(0))), Field::MaxObjects),
                (
                    request(&png, task(kind, "cat", Some(MAX_OBJECTS + 1))),
                    Field::MaxObjects,
                ),
                (
                    GenerateRequest {
                        stop: vec!["x".into()],
                        ..request(&png, task(kind, "cat", None))
                    },
                    Field::Stop,
                ),
                (
                    GenerateRequest {
                        constraint: Some(Constraint::Regex("a+".into())),
                        ..request(&png, task(kind, "cat", None))
                    },
                    Field::Constraint,
                ),
                (
                    GenerateRequest {
                        min_tokens: 2,
                        ..request(&png, task(kind, "cat", None))
                    },
                    Field::MinTokens,
                ),
                (
                    GenerateRequest {
                        sampling: kestrel_engine::SamplingOptions {
                            top_logprobs: 2,
                            ..Default::default()
                        },
                        ..request(&png, task(kind, "cat", None))
                    },
                    Field::TopLogprobs,
                ),
            ];
            for (req, field) in cases {
                let what = format!("{kind:?} {field}");
                let err = engine.generate(req.clone()).await.unwrap_err();
                assert_refused(&err, field, &what);
                // The stream API refuses the same way, before a stream exists.
                let err = engine.stream(req).unwrap_err();
                assert_refused(&err, field, &what);
            }
            // The object is checked before the image is decoded.
            let err = engine
                .generate(request(b"no image", task(kind, "", None)))
                .await
                .unwrap_err();
            assert_refused(&err, Field::Object, "object before image");
            // The largest max_objects is taken.
            engine
                .generate(request(&png, task(kind, "cat", Some(MAX_OBJECTS))))
                .await
                .expect("max_objects at the bound");
        }
        kv_released(&engine).await;
        let info = engine.model_info();
        assert_eq!((info.num_waiting, info.num_running), (0, 0));
        engine.shutdown(Duration::from_secs(1)).await;
    });
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_checkpoint_without_a_region_model_refuses_point_and_detect() {
    let Some((_python, dir, ckpt)) = reference_python::served_moondream_with(
        "engine moondream_spatial without region",
        "engine-md-noregion",
        17,
        &["--no-region"],
    ) else {
        return;
    };
    let engine = engine_on(&ckpt);
    let name = engine.model().name().to_string();
    let png = picture_378(3).to_png();
    rt().block_on(async {
        for kind in [SpatialKind::Point, SpatialKind::Detect] {
            let err = engine
                .generate(request(&png, task(kind, "cat", None)))
                .await
                .unwrap_err();
            assert_refused(&err, Field::Skill, &format!("{kind:?}"));
            let message = err.to_string();
            assert!(message.contains(&format!("model `{name}`")), "{message}");
            assert!(message.contains("no region module"), "{message}");
        }
        // Its text skills still answer.
        let q = engine
            .generate(GenerateRequest {
                max_new_tokens: Some(4),
                ignore_eos: true,
                ..request(
                    &png,
                    VisionTask::Query {
                        question: "What is this?".into(),
                    },
                )
            })
            .await
            .expect("a query without a region model");
        assert_eq!((q.token_ids.len(), q.objects), (4, None));
        engine.shutdown(Duration::from_secs(1)).await;
    });
    std::fs::remove_dir_all(&dir).ok();
}

/// The wire names of the new fields, as every edge's default.
#[test]
fn spatial_field_names() {
    assert_eq!(Field::Object.to_string(), "object");
    assert_eq!(Field::MaxObjects.to_string(), "max_objects");
    assert_eq!(Field::Skill.to_string(), "skill");
    assert_eq!((DEFAULT_MAX_OBJECTS, MAX_OBJECTS), (50, 256));
}
