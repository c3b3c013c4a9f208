//! Overlap equivalence for Moondream's `point` and `detect`: point and
//! detect requests mixed with text, image-query and constrained requests
//! on a served synthetic checkpoint with a region model, all streamed at
//! once, give identical tokens, text, finish reasons and objects in every
//! mode x prefill policy, with whole-prompt and chunked prefill, and in a
//! KV cache small enough that sequences (point and detect ones among them)
//! are preempted and prefilled again with the coordinates and sizes they
//! generated; each spatial request alone gives what it gives batched. A
//! detect request whose `max_new_tokens` ends it between its second box's
//! coordinates and its size returns the first box only. Cancelled
//! mid-object (between a coordinate and its size), a point/detect request
//! ends with only whole objects, a prefix of its uncancelled result, the
//! others beside it are unchanged, and no KV page is left held, with and
//! without preemption. In the engine's default numerics (fast).
//! Skipped, saying so, without numpy unless `KESTREL_REQUIRE_PYTHON` is
//! set (CI).

mod common;
#[path = "../../../tests/support/pictures.rs"]
#[allow(dead_code)]
mod pictures;
#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

use pictures::picture_378;

use std::path::Path;
use std::time::Duration;

use common::{counter, kv_released, rt, until_done, until_objects};
use kestrel_engine::{
    Constraint, Engine, EngineConfig, FinishReason, GenerateRequest, GenerateResponse, ModelSource,
    PipelineMode, PrefillPolicy, Prompt, SamplingOptions, SpatialResult, StreamEvent, VisionTask,
};

/// Tokens a KV page holds: small, so sequences grow page by page.
const PAGE: usize = 4;
/// The context: a 741-token image prompt and what it generates fit.
const MAX_SEQ_LEN: usize = 800;
/// Pages that never run short for the batch.
const ROOMY: usize = 4096;
/// Pages just above what one image request needs alone (200): the batch's
/// sequences are preempted as they grow.
const TIGHT: usize = 203;
/// Objects a point/detect request finds at most.
const MAX: u32 = 3;

fn engine(
    ckpt: &Path,
    mode: PipelineMode,
    prefill_policy: PrefillPolicy,
    chunk: usize,
    kv_pages: usize,
) -> Engine {
    Engine::start(
        EngineConfig {
            model: ModelSource::Path(ckpt.to_path_buf()),
            threads: 2,
            mode,
            prefill_policy,
            prefill_chunk: Some(chunk),
            max_batch_size: 16,
            kv_pages,
            page_size: PAGE,
            max_seq_len: Some(MAX_SEQ_LEN),
            ..EngineConfig::default()
        },
        |_| {},
    )
    .expect("the Moondream engine starts")
}

fn vision(png: &[u8], task: VisionTask, max_new_tokens: Option<u32>) -> GenerateRequest {
    GenerateRequest {
        input: Prompt::Vision {
            image: png.to_vec(),
            task,
        },
        max_new_tokens,
        ..GenerateRequest::text("unused", 1)
    }
}

fn point(png: &[u8], object: &str) -> GenerateRequest {
    let object = object.into();
    vision(
        png,
        VisionTask::Point {
            object,
            max_objects: Some(MAX),
        },
        None,
    )
}

fn detect(png: &[u8], object: &str, max_new_tokens: Option<u32>) -> GenerateRequest {
    let object = object.into();
    vision(
        png,
        VisionTask::Detect {
            object,
            max_objects: Some(MAX),
        },
        max_new_tokens,
    )
}

/// Whether `req` is a point/detect request (its stream carries objects).
fn is_spatial(req: &GenerateRequest) -> bool {
    matches!(&req.input, Prompt::Vision { task, .. } if task.is_spatial())
}

/// Index of the detect request cut by `max_new_tokens` in [`batch`], and
/// of the same request uncut.
const CUT: usize = 6;
const UNCUT: usize = 9;

/// The mixed batch: point and detect requests between greedy, sampled and
/// penalised text, an image query and constrained requests.
fn batch(png: &[u8]) -> Vec<GenerateRequest> {
    let sampled = |seed| SamplingOptions {
        temperature: Some(0.9),
        top_k: Some(50),
        seed: Some(seed),
        ..SamplingOptions::default()
    };
    let mut reqs = vec![
        point(png, "cat"),
        GenerateRequest::text("the quick brown fox", 12),
        detect(png, "cat", None),
        GenerateRequest {
            sampling: SamplingOptions {
                frequency_penalty: Some(1.5),
                repetition_penalty: Some(1.2),
                ..sampled(7)
            },
            ..GenerateRequest::text("Once upon a time", 16)
        },
        GenerateRequest {
            constraint: Some(Constraint::Choice(vec![
                "yes".into(),
                "no".into(),
                "maybe".into(),
            ])),
            sampling: sampled(5),
            ..GenerateRequest::text("Is the sky blue?", 8)
        },
        point(png, "red ball"),
        // Five tokens: the first box (x, y, size), then the second's x
        // and y, cut before its size.
        detect(png, "red ball", Some(5)),
        GenerateRequest {
            ignore_eos: true,
            ..vision(
                png,
                VisionTask::Query {
                    question: "What is in the picture?".into(),
                },
                Some(8),
            )
        },
        GenerateRequest {
            constraint: Some(Constraint::Regex("(ab|ba){2,4}".into())),
            sampling: sampled(9),
            ..GenerateRequest::text("Letters:", 12)
        },
        detect(png, "red ball", None),
    ];
    for (i, r) in reqs.iter_mut().enumerate() {
        r.request_id = Some(format!("spatial-{i}"));
    }
    reqs
}

/// Streams every request at once and returns each final response in
/// order (a point/detect stream's objects checked against its response,
/// a text stream's deltas against its text).
async fn stream_all(engine: &Engine, reqs: &[GenerateRequest]) -> Vec<GenerateResponse> {
    let mut streams: Vec<_> = reqs
        .iter()
        .map(|r| engine.stream(r.clone()).expect("accepted"))
        .collect();
    let mut out = Vec::new();
    for (req, s) in reqs.iter().zip(&mut streams) {
        if is_spatial(req) {
            out.push(until_objects(s).await);
        } else {
            let (r, text, ids) = until_done(s).await;
            assert_eq!((&text, &ids), (&r.text, &r.token_ids), "deltas vs final");
            out.push(r);
        }
    }
    out
}

fn boxes(r: &GenerateResponse) -> &[kestrel_engine::BoundingBox] {
    match r.objects.as_ref() {
        Some(SpatialResult::Boxes(b)) => b,
        other => panic!("a detect request's boxes, got {other:?}"),
    }
}

#[test]
fn point_and_detect_agree_blocking_pipelined_chunked_and_preempted() {
    let Some((_python, dir, ckpt)) =
        reference_python::served_moondream("engine spatial overlap", "engine-spatial", 17)
    else {
        return;
    };
    let png = picture_378(3).to_png();
    let reqs = batch(&png);
    let configs = [
        (PipelineMode::Blocking, PrefillPolicy::Drain, 0, ROOMY),
        (PipelineMode::Pipelined, PrefillPolicy::Drain, 0, ROOMY),
        (PipelineMode::Pipelined, PrefillPolicy::RideAlong, 0, ROOMY),
        (PipelineMode::Pipelined, PrefillPolicy::RideAlong, 64, ROOMY),
        (PipelineMode::Blocking, PrefillPolicy::Drain, 0, TIGHT),
        (PipelineMode::Pipelined, PrefillPolicy::RideAlong, 64, TIGHT),
    ];
    let mut reference: Option<Vec<GenerateResponse>> = None;
    for (mode, policy, chunk, kv_pages) in configs {
        let at = format!("{mode:?}/{policy:?}/chunk {chunk}/{kv_pages} pages");
        let engine = engine(&ckpt, mode, policy, chunk, kv_pages);
        let out = rt().block_on(stream_all(&engine, &reqs));
        let preemptions = counter(&engine, "kestrel_preemptions_total");
        eprintln!("{at}: {preemptions} preemptions");
        assert_eq!(
            preemptions > 0,
            kv_pages == TIGHT,
            "{at}: {preemptions} preemptions"
        );
        for (i, (req, r)) in reqs.iter().zip(&out).enumerate() {
            assert_eq!(r.objects.is_some(), is_spatial(req), "{at}: request {i}");
            assert!(!r.token_ids.is_empty(), "{at}: request {i}: {r:?}");
        }
        // The cut detect request: the first box of the uncut one, and
        // nothing of its second, whose coordinates it had generated.
        let (cut, uncut) = (&out[CUT], &out[UNCUT]);
        assert!(boxes(uncut).len() >= 2, "{at}: the seed gives two boxes");
        assert_eq!(cut.finish_reason, FinishReason::Length, "{at}");
        assert_eq!(cut.token_ids, uncut.token_ids[..5], "{at}");
        assert_eq!(boxes(cut), &boxes(uncut)[..1], "{at}: a half box");
        match &reference {
            None => {
                // Alone (one at a time, in the first engine) == batched.
                for (i, req) in reqs.iter().enumerate().filter(|(_, r)| is_spatial(r)) {
                    let alone = rt().block_on(stream_all(&engine, std::slice::from_ref(req)));
                    assert_eq!(alone[0].token_ids, out[i].token_ids, "request {i} alone");
                    assert_eq!(alone[0].objects, out[i].objects, "request {i} alone");
                }
                let found: usize = out
                    .iter()
                    .filter_map(|r| r.objects.as_ref())
                    .map(|o| o.len())
                    .sum();
                assert!(found >= 6, "the seed must give objects to compare: {found}");
                reference = Some(out);
            }
            Some(want) => {
                for (i, (a, b)) in want.iter().zip(&out).enumerate() {
                    assert_eq!(a.token_ids, b.token_ids, "{at}: request {i}");
                    assert_eq!(a.text, b.text, "{at}: request {i}");
                    assert_eq!(a.finish_reason, b.finish_reason, "{at}: request {i}");
                    assert_eq!(a.objects, b.objects, "{at}: request {i}");
                }
            }
        }
        rt().block_on(async {
            kv_released(&engine).await;
            engine.shutdown(Duration::from_secs(1)).await;
        });
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Aborts `s` once it has streamed `after` objects and reads it to its
/// end: every object it streamed, in order, and the final response.
async fn abort_after(
    s: &mut kestrel_engine::GenerationStream,
    after: usize,
) -> (Vec<kestrel_engine::SpatialObject>, GenerateResponse) {
    let mut objects = Vec::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(120), s.next_event())
            .await
            .expect("no hang")
            .expect("a terminal event")
            .expect("no error");
        match event {
            StreamEvent::Object(o) => {
                objects.push(o);
                if objects.len() == after {
                    s.abort();
                }
            }
            StreamEvent::Delta { .. } => panic!("a detect request streamed text"),
            StreamEvent::Done(r) => return (objects, r),
        }
    }
}

#[test]
fn a_detect_request_cancelled_mid_object_leaves_whole_boxes_and_no_page() {
    let Some((_python, dir, ckpt)) =
        reference_python::served_moondream("engine spatial cancel", "engine-spatial-cancel", 17)
    else {
        return;
    };
    let png = picture_378(3).to_png();
    let reqs = batch(&png);
    let mut cancelled = detect(&png, "red ball", None);
    cancelled.request_id = Some("cancelled".into());
    let (mut mid_object, mut attempts) = (0, 0);
    for kv_pages in [ROOMY, TIGHT] {
        let engine = engine(
            &ckpt,
            PipelineMode::Pipelined,
            PrefillPolicy::RideAlong,
            0,
            kv_pages,
        );
        rt().block_on(async {
            let full = engine.generate(cancelled.clone()).await.expect("detect");
            let want = stream_all(&engine, &reqs).await;
            let n = boxes(&full).len();
            assert!(n >= 2, "the seed gives two boxes: {full:?}");
            for after in 1..n {
                for _ in 0..3 {
                    // The batch beside it, then the request to cancel.
                    let batch = stream_all(&engine, &reqs);
                    let mut s = engine.stream(cancelled.clone()).expect("accepted");
                    let (got, (streamed, r)) = tokio::join!(batch, abort_after(&mut s, after));
                    let at = format!("{kv_pages} pages, aborted after {after} boxes");
                    // Only whole boxes, a prefix of the uncancelled ones,
                    // and the tokens it had committed.
                    let b = boxes(&r);
                    assert_eq!(b, &boxes(&full)[..b.len()], "{at}");
                    assert_eq!(streamed.len(), b.len(), "{at}: streamed vs final");
                    assert_eq!(r.token_ids, full.token_ids[..r.token_ids.len()], "{at}");
                    assert_eq!(b.len(), r.token_ids.len() / 3, "{at}: a half box");
                    attempts += 1;
                    if r.finish_reason == FinishReason::Abort && r.token_ids.len() % 3 != 0 {
                        mid_object += 1;
                    }
                    // The requests beside it are unchanged.
                    for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                        assert_eq!(a.token_ids, b.token_ids, "{at}: request {i}");
                        assert_eq!(a.objects, b.objects, "{at}: request {i}");
                        assert_eq!(a.finish_reason, b.finish_reason, "{at}: request {i}");
                    }
                    kv_released(&engine).await;
                }
            }
            let preemptions = counter(&engine, "kestrel_preemptions_total");
            assert_eq!(
                preemptions > 0,
                kv_pages == TIGHT,
                "{kv_pages} pages: {preemptions} preemptions"
            );
            let info = engine.model_info();
            assert_eq!((info.num_waiting, info.num_running), (0, 0));
            engine.shutdown(Duration::from_secs(1)).await;
        });
    }
    eprintln!("{mid_object} of {attempts} aborts landed between a coordinate and its size");
    assert!(
        mid_object > 0,
        "no abort landed between a coordinate and its size"
    );
    std::fs::remove_dir_all(&dir).ok();
}
