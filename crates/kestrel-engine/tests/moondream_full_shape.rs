//! Issue 72 item 5's full-size-shape checkpoint: a synthetic Moondream 2
//! at every published width and depth (`moondream_synth.py --served
//! --shape moondream2 --dtype BF16`: 1.9 G parameters, 3.8 GB, written
//! streaming into a temporary directory and removed after) loads through
//! `Engine::start` and answers one token of a query on a 378 x 378 image
//! (the global crop and one tile through the 27-layer encoder, 730 prefix
//! rows through the 24-layer decoder).
//!
//! `#[ignore]`d: it needs a release build and minutes of CPU (about 1.2
//! TFLOP of encoder and 1.8 TFLOP of prefill for one token) and 4 GB of
//! disk. Run it with
//! `cargo test --release -p kestrel-engine --test moondream_full_shape -- --ignored`.

mod common;
#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

use std::time::{Duration, Instant};

use common::rt;
use kestrel_engine::{Engine, EngineConfig, GenerateRequest, ModelSource, Prompt, VisionTask};
use kestrel_model::moondream::MoondreamConfig;
use kestrel_model::vision::RgbImage;

/// Free space the checkpoint needs, with room to spare (bytes).
const NEEDS_DISK: u64 = 5 << 30;

fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    let out = std::process::Command::new("df")
        .args(["--output=avail", "-B1"])
        .arg(dir)
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .nth(1)?
        .trim()
        .parse()
        .ok()
}

#[test]
#[ignore = "release build and minutes of CPU: a 3.8 GB full-size-shape checkpoint through the whole model"]
fn full_size_shape_moondream2_loads_and_answers_one_token() {
    if cfg!(debug_assertions) {
        panic!(
            "run in release: cargo test --release -p kestrel-engine --test moondream_full_shape -- --ignored"
        );
    }
    let Some(python) = reference_python::python_with(
        "moondream full shape",
        "numpy",
        "scripts/reference/requirements.txt",
    ) else {
        return;
    };
    let tmp = std::env::temp_dir();
    let free = free_bytes(&tmp).expect("df reads the temporary directory's free space");
    assert!(
        free > NEEDS_DISK,
        "{} has {free} bytes free; the checkpoint needs {NEEDS_DISK}",
        tmp.display()
    );
    let dir = tmp.join(format!("kestrel-md2-full-{}", std::process::id()));
    let ckpt = dir.join("ckpt");
    let t0 = Instant::now();
    reference_python::run_script(
        &python,
        "moondream_synth.py",
        &[
            &ckpt as &dyn AsRef<std::ffi::OsStr>,
            &"--served",
            &"--shape",
            &"moondream2",
            &"--dtype",
            &"BF16",
        ],
    );
    eprintln!("wrote the checkpoint in {:.1?}", t0.elapsed());

    // The file's configuration is the published 2B one, width for width.
    let cfg = MoondreamConfig::from_file(&ckpt.join("config.json")).expect("config.json");
    let md2 = MoondreamConfig::moondream2();
    assert_eq!(
        (&cfg.text, &cfg.vision, &cfg.region),
        (&md2.text, &md2.vision, &md2.region)
    );
    let bytes = std::fs::metadata(ckpt.join("model.safetensors"))
        .expect("model.safetensors")
        .len();
    assert!(bytes > 3_500_000_000, "{bytes} bytes is not the full model");

    let t1 = Instant::now();
    let engine = Engine::start(
        EngineConfig {
            model: ModelSource::Path(ckpt.clone()),
            kv_pages: 128,
            page_size: 16,
            max_seq_len: Some(1024),
            max_batch_size: 1,
            ..EngineConfig::default()
        },
        |_| {},
    )
    .expect("the full-size-shape Moondream engine starts");
    eprintln!("engine started in {:.1?}", t1.elapsed());

    let (w, h) = (378u32, 378u32);
    let px = (0..w * h * 3)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8)
        .collect();
    let png = RgbImage::from_raw(w, h, px).unwrap().to_png();
    let req = GenerateRequest {
        input: Prompt::Vision {
            image: png,
            task: VisionTask::Query {
                question: "What is in this picture?".into(),
            },
        },
        ignore_eos: true,
        ..GenerateRequest::text("unused", 1)
    };
    let t2 = Instant::now();
    let resp = rt().block_on(async {
        let resp = engine.generate(req).await.expect("one token");
        engine.shutdown(Duration::from_secs(5)).await;
        resp
    });
    eprintln!(
        "one token ({:?}) in {:.1?}; prompt {} tokens",
        resp.token_ids,
        t2.elapsed(),
        resp.usage.prompt_tokens
    );
    assert_eq!(resp.token_ids.len(), 1);
    assert!((resp.token_ids[0] as usize) < md2.text.vocab_size);
    // BOS + 729 image rows + the query template around the question.
    assert!(resp.usage.prompt_tokens as usize > 730, "{:?}", resp.usage);
    std::fs::remove_dir_all(&dir).ok();
}
