//! Moondream served end to end on the CPU backend, and on the CUDA runtime
//! over kestrel-cuda's host device (`Backend::CudaHost`): `Engine::start` on a
//! served synthetic checkpoint (`scripts/reference/moondream_synth.py
//! --served`: real tensor names, crop geometry, vocabulary and Starmie
//! templates, tiny widths), a PNG image sent as a `Prompt::Vision`.
//! A query's greedy tokens equal the float64 NumPy Moondream's
//! (`moondream_greedy.py`, exact numerics; the image is 378 x 378, one
//! tile, so the reference's crops are the engine's); the query and a
//! caption give the same tokens alone, batched with a text request and
//! each other, and asked again (the image's prefix then comes from the
//! prefix cache, keyed by the image's content); an image that is no image
//! is refused naming the field.
//! Skipped, saying so, without numpy unless `KESTREL_REQUIRE_PYTHON` is
//! set (CI).

mod common;
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

use std::time::Duration;

use common::{counter, rt, stream_all};
use kestrel_engine::{
    Backend, CaptionLength, Engine, EngineConfig, EngineError, Field, GenerateRequest, ModelSource,
    Numerics, Prompt, VisionTask,
};
use kestrel_model::vision::PreparedImage;

const STEPS: u32 = 8;
const QUESTION: &str = "What is in this picture?";

fn vision(image: &[u8], task: VisionTask) -> GenerateRequest {
    GenerateRequest {
        input: Prompt::Vision {
            image: image.to_vec(),
            task,
        },
        // Every step compared, EOS or not.
        ignore_eos: true,
        ..GenerateRequest::text("unused", STEPS)
    }
}

#[test]
fn moondream_query_and_caption_served_on_the_cpu() {
    served(Backend::Cpu, "engine-md");
}

/// The same on the CUDA runtime over kestrel-cuda's host device: the vision
/// encoder and projector on the device model, the image rows and the
/// bidirectional prefix in its prefill (its image rows are f16-computed,
/// yet the greedy tokens are the reference's on this seed).
#[test]
fn moondream_query_and_caption_served_on_the_cuda_host_device() {
    served(Backend::CudaHost, "engine-md-cuda-host");
}

fn served(backend: Backend, tag: &str) {
    let Some((python, dir, ckpt)) = reference_python::served_moondream("engine moondream", tag, 11)
    else {
        return;
    };
    let engine = Engine::start(
        EngineConfig {
            backend,
            model: ModelSource::Path(ckpt.clone()),
            threads: 2,
            numerics: Numerics::Exact,
            kv_pages: 512,
            page_size: 16,
            max_seq_len: Some(1024),
            ..EngineConfig::default()
        },
        |_| {},
    )
    .expect("the Moondream engine starts");
    let img = picture_378(5);
    let png = img.to_png();

    // The reference on the same crops and template.
    let loaded = kestrel_model::load(&ckpt).unwrap();
    let v = loaded.vision.as_ref().unwrap();
    let prepared = PreparedImage::new(&img, &v.config.vision.crop_geometry());
    let p = &v.prompts;
    let question = engine.tokenize(QUESTION, false).unwrap();
    let template: Vec<u32> = [&p.query_prefix[..], &question, &p.query_suffix].concat();
    let want = moondream_reference::greedy(
        &python,
        &ckpt,
        &dir,
        &prepared,
        (&[p.bos_id], &template),
        STEPS,
    )
    .tokens;

    let query = vision(
        &png,
        VisionTask::Query {
            question: QUESTION.into(),
        },
    );
    let caption = vision(
        &png,
        VisionTask::Caption {
            length: CaptionLength::Short,
        },
    );
    let text = GenerateRequest::text("the quick brown fox", STEPS);
    rt().block_on(async {
        let q = engine.generate(query.clone()).await.expect("query");
        assert_eq!(q.token_ids, want, "query vs the NumPy reference");
        // 1 + 729 image rows + the template.
        assert_eq!(q.usage.prompt_tokens as usize, 730 + template.len());
        let c = engine.generate(caption.clone()).await.expect("caption");
        assert_eq!(c.token_ids.len(), STEPS as usize);
        let t = engine.generate(text.clone()).await.expect("text");
        let batched = stream_all(&engine, &[text, query.clone(), caption]).await;
        assert_eq!(batched[0].token_ids, t.token_ids, "text, batched");
        assert_eq!(batched[1].token_ids, want, "query, batched");
        assert_eq!(batched[2].token_ids, c.token_ids, "caption, batched");
        let again = engine.generate(query).await.expect("query again");
        assert_eq!(again.token_ids, want, "query again");
        // The image's prefix is keyed by its content: its full pages (720
        // of BOS + 729 rows, in pages of 16) come from the prefix cache.
        assert!(again.usage.cached_prompt_tokens >= 720, "{:?}", again.usage);
        // One image, encoded once: every later request found its rows in
        // the encoded-image cache (or all of them in the prefix cache).
        assert_eq!(counter(&engine, "kestrel_image_encodes_total"), 1);

        let err = engine
            .generate(vision(
                b"not an image at all",
                VisionTask::Query {
                    question: QUESTION.into(),
                },
            ))
            .await
            .unwrap_err();
        assert!(matches!(err, EngineError::InvalidImage { .. }), "{err:?}");
        assert_eq!(err.field(), Some(Field::Image));
        engine.shutdown(Duration::from_secs(1)).await;
    });
    std::fs::remove_dir_all(&dir).ok();
}
