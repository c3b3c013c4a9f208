//! `EngineConfig::quantize` (`--quantize q8_0`) on safetensors models: the
//! tiny HF Phi directory (`phi_fixtures.py`) and a served synthetic
//! Moondream (`moondream_synth.py --served`) load with every text matrix
//! Q8_0 (their widths are whole blocks, so none is kept as stored) and the
//! Moondream's vision linears Q8_0 too (`fc2`'s 48 and the patch
//! embedding's 588 columns padded to whole blocks); each engine answers,
//! and its greedy tokens (exact numerics, Q8_0 weights) equal the
//! unquantized engine's: all 6 of the Phi's and all 4 of the Moondream
//! query's on these seeds. That is a measurement on these fixed weights,
//! not a property of Q8_0: random weights give flat logits (the Phi
//! fixture's top-2 margins go down to ~1e-2), and Q8_0's per-weight error
//! (half a step of each 32-weight block's scale, <= 0.4% of its largest)
//! can part greedy paths at such near-ties on other weights. The quantized
//! Moondream also answers with the int8 kernels (`Numerics::Fast`), whose
//! tokens are only required to start as exact's do. Skipped, saying so,
//! without numpy unless `KESTREL_REQUIRE_PYTHON` is set (CI).

mod common;
#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

use std::path::Path;

use common::rt;
use kestrel_engine::{
    Engine, EngineConfig, GenerateRequest, ModelSource, Numerics, Prompt, VisionTask,
};
use kestrel_model::vision::RgbImage;
use kestrel_model::{DType, LoadOptions, Matrix};

const Q8: LoadOptions = LoadOptions {
    quantize: Some(DType::Q8_0),
};

fn engine(model: &Path, quantize: Option<DType>, max_seq_len: usize) -> Engine {
    engine_with(model, quantize, max_seq_len, Numerics::Exact)
}

fn engine_with(
    model: &Path,
    quantize: Option<DType>,
    max_seq_len: usize,
    numerics: Numerics,
) -> Engine {
    Engine::start(
        EngineConfig {
            model: ModelSource::Path(model.into()),
            threads: 2,
            numerics,
            kv_pages: 256,
            page_size: 16,
            max_seq_len: Some(max_seq_len),
            quantize,
            ..EngineConfig::default()
        },
        |_| {},
    )
    .expect("the engine starts")
}

fn text_matrices(w: &kestrel_model::ModelWeights) -> Vec<&Matrix> {
    let mut all = vec![&w.token_embd, &w.lm_head];
    for l in &w.layers {
        all.extend([&l.wq, &l.wk, &l.wv, &l.wo, &l.w_up, &l.w_down]);
        all.extend(l.w_gate.as_ref());
    }
    all
}

fn greedy(engine: &Engine, request: GenerateRequest) -> Vec<u32> {
    rt().block_on(engine.generate(request))
        .expect("generate")
        .token_ids
}

#[test]
fn phi_quantized_at_load_is_q8_0_and_keeps_its_greedy_tokens() {
    let Some(dir) = reference_python::fixture_script(
        "phi_fixtures.py",
        "engine quantize phi",
        "engine-quantize-phi",
        &["phi"],
    ) else {
        return;
    };
    let model = dir.join("phi");
    let plain = kestrel_model::load(&model).unwrap();
    assert!(text_matrices(&plain.weights)
        .iter()
        .all(|m| m.dtype == DType::F32));
    let q = kestrel_model::load_with(&model, &Q8).unwrap();
    for (a, b) in text_matrices(&plain.weights)
        .into_iter()
        .zip(text_matrices(&q.weights))
    {
        assert_eq!((b.dtype, b.rows, b.cols), (DType::Q8_0, a.rows, a.cols));
        // Q8_0's error bound: half a step of each block's scale.
        let (x, y) = (a.to_f32(), b.to_f32());
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = x
            .iter()
            .zip(&y)
            .map(|(u, v)| (u - v).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= amax / 127.0 * 0.5 + 1e-3 * amax,
            "{worst} vs {amax}"
        );
    }

    let prompt = "The quick brown fox";
    let request = || GenerateRequest {
        ignore_eos: true,
        ..GenerateRequest::text(prompt, 6)
    };
    let want = greedy(&engine(&model, None, 128), request());
    let got = greedy(&engine(&model, Some(DType::Q8_0), 128), request());
    assert_eq!(got.len(), 6, "the quantized engine answers");
    assert_eq!(got, want, "Q8_0 vs F32 weights, exact numerics");
}

fn picture() -> RgbImage {
    let (w, h) = (378u32, 378u32);
    let px = (0..w * h * 3)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ 5).rotate_left(13) as u8 / 2 + (i % 97) as u8)
        .collect();
    RgbImage::from_raw(w, h, px).unwrap()
}

#[test]
fn moondream_quantized_at_load_answers_a_query() {
    let Some((_, dir, ckpt)) =
        reference_python::served_moondream("engine quantize moondream", "engine-md-q8", 11)
    else {
        return;
    };
    let plain = kestrel_model::load(&ckpt).unwrap();
    let q = kestrel_model::load_with(&ckpt, &Q8).unwrap();
    for (a, b) in text_matrices(&plain.weights)
        .into_iter()
        .zip(text_matrices(&q.weights))
    {
        assert!(!a.dtype.is_quantized());
        assert_eq!((b.dtype, b.rows, b.cols), (DType::Q8_0, a.rows, a.cols));
    }
    let (pv, qv) = (
        &plain.vision.as_ref().unwrap().weights,
        &q.vision.as_ref().unwrap().weights,
    );
    let linears = |v: &'_ kestrel_model::moondream::VisionWeights| {
        let mut all = vec![v.patch_emb.weight.clone()];
        for b in &v.blocks {
            all.extend([&b.qkv, &b.proj, &b.mlp.fc1, &b.mlp.fc2].map(|l| l.weight.clone()));
        }
        all.extend([v.proj.fc1.weight.clone(), v.proj.fc2.weight.clone()]);
        all
    };
    for (a, b) in linears(pv).iter().zip(&linears(qv)) {
        assert_eq!(b.dtype, DType::Q8_0);
        assert_eq!((b.rows, b.cols), (a.rows, a.cols.next_multiple_of(32)));
        // The padding is zero columns.
        let (x, y) = (a.to_f32(), b.to_f32());
        for r in 0..a.rows {
            assert!(y[r * b.cols + a.cols..(r + 1) * b.cols]
                .iter()
                .all(|v| *v == 0.0));
            let amax = x[r * a.cols..(r + 1) * a.cols]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            for c in 0..a.cols {
                assert!((x[r * a.cols + c] - y[r * b.cols + c]).abs() <= amax / 127.0);
            }
        }
    }
    // fc2 (48 columns) and the patch embedding (3 * 14 * 14 = 588) are padded.
    assert_eq!(qv.blocks[0].mlp.fc2.weight.cols, 64);
    assert_eq!(qv.patch_emb.weight.cols, 608);

    let png = picture().to_png();
    let request = || GenerateRequest {
        input: Prompt::Vision {
            image: png.clone(),
            task: VisionTask::Query {
                question: "What is in this picture?".into(),
            },
        },
        ignore_eos: true,
        ..GenerateRequest::text("unused", 4)
    };
    let want = greedy(&engine(&ckpt, None, 1024), request());
    let got = greedy(&engine(&ckpt, Some(DType::Q8_0), 1024), request());
    let fast = greedy(
        &engine_with(&ckpt, Some(DType::Q8_0), 1024, Numerics::Fast),
        request(),
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(got.len(), 4, "the quantized Moondream answers");
    assert_eq!(got, want, "Q8_0 vs F32 weights, exact numerics");
    println!("moondream q8_0 int8 kernels: {fast:?} (exact: {want:?})");
    assert_eq!(fast.len(), 4);
    assert_eq!(fast[0], want[0], "int8 kernels: {fast:?} vs {want:?}");
}

#[test]
fn quantize_on_a_gguf_is_refused_before_it_is_read() {
    let dir = std::env::temp_dir().join(format!("kestrel-q8-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("model.gguf");
    std::fs::write(&file, b"not read").unwrap();
    let err = kestrel_model::load_with(&file, &Q8).unwrap_err();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        matches!(&err, kestrel_model::ModelError::QuantizeStored { path, dtype: DType::Q8_0 } if *path == file),
        "{err:?}"
    );
}
