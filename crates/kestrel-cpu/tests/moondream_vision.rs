//! Moondream's vision encoder and projector against the NumPy reference
//! (`scripts/reference/moondream_vision.py`, float64, written from the
//! published architecture) on synthetic checkpoints with the real tensor
//! names (`moondream_synth.py`: the real crop geometry, tiny widths): both
//! namings, stored F32 and BF16, a 3x4 tiling and a single-tile image.
//! The reference is fed Kestrel's own crops, so this is the encoder alone.
//! Tolerance: every encoder feature and image token within 5e-5 x
//! (|reference| + 1) (f32 GEMMs and attention over 729 positions against
//! float64; measured 8e-6 at worst). Skipped, saying so, without numpy unless
//! `KESTREL_REQUIRE_PYTHON` is set (CI).

use std::path::{Path, PathBuf};

use kestrel_cpu::vision::{encode_crops, project, VisionRun};
use kestrel_cpu::{Isa, Numerics, Team};
use kestrel_model::moondream::{load_checkpoint, MoondreamConfig};
use kestrel_model::vision::{overlap_crops, RgbImage};

#[path = "../../../tests/support/pictures.rs"]
#[allow(dead_code)]
mod pictures;
#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

use pictures::picture;

const TOL: f32 = 5e-5;

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn close(what: &str, ours: &[f32], theirs: &[f32]) -> f32 {
    assert_eq!(ours.len(), theirs.len(), "{what}: lengths");
    let mut worst = 0f32;
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        let err = (a - b).abs() / (b.abs() + 1.0);
        assert!(err <= TOL, "{what}[{i}]: ours {a}, reference {b}");
        worst = worst.max(err);
    }
    worst
}

fn check(python: &str, tag: &str, synth_args: &[&str], image: RgbImage) {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("kestrel-md-vision-{tag}-{}", std::process::id()));
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![&dir];
    args.extend(synth_args.iter().map(|a| a as &dyn AsRef<std::ffi::OsStr>));
    reference_python::run_script(python, "moondream_synth.py", &args);

    let config = MoondreamConfig::from_file(&dir.join("config.json")).unwrap();
    let weights = load_checkpoint(&dir, config.clone()).unwrap();
    let crops = overlap_crops(&image, &config.vision.crop_geometry());
    std::fs::write(dir.join("crops.u8"), &crops.pixels).unwrap();
    let (rows, cols) = (crops.tiling.rows.to_string(), crops.tiling.cols.to_string());
    let out = dir.join("out");
    reference_python::run_script(
        python,
        "moondream_vision.py",
        &[&dir, &dir.join("crops.u8"), &rows, &cols, &out],
    );

    // Scalar on one thread and the best ISA on two: bit-identical (the
    // kernels' batch and thread invariance), and both the reference's.
    let team = Team::new(2, "md-vision-test").unwrap();
    let mut results = Vec::new();
    for (team, isa) in [(None, Isa::Scalar), (Some(&team), Isa::detect())] {
        let run = VisionRun {
            team,
            isa,
            numerics: Numerics::Exact,
        };
        let features = encode_crops(run, &weights.vision, &config.vision, &crops).unwrap();
        let tokens = project(
            run,
            &weights.vision,
            &config.vision,
            &features,
            crops.tiling,
        )
        .unwrap();
        results.push((features, tokens));
    }
    assert!(
        results[0] == results[1],
        "{tag}: scalar and SIMD runs differ"
    );
    let (features, tokens) = &results[0];
    let f = close(
        &format!("{tag} encoder"),
        features,
        &read_f32(&out.join("encoded.f32")),
    );
    assert_eq!((tokens.tokens, tokens.dim), (729, config.text.dim));
    let t = close(
        &format!("{tag} tokens"),
        &tokens.data,
        &read_f32(&out.join("tokens.f32")),
    );
    eprintln!("{tag}: worst relative error {f:.2e} (features), {t:.2e} (tokens)");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn vision_encoder_matches_the_reference() {
    let Some(python) = reference_python::python_with(
        "moondream_vision",
        "numpy",
        "scripts/reference/requirements.txt",
    ) else {
        return;
    };
    // 900x700 less margins (788 x 588) tiles 3 x 4: 12 tiles + the global crop.
    let wide = picture(900, 700, 1);
    assert_eq!(
        overlap_crops(&wide, &MoondreamConfig::moondream2().vision.crop_geometry()).count(),
        13
    );
    check(&python, "hf-f32", &["--seed", "11"], wide);
    check(
        &python,
        "exported-bf16",
        &["--seed", "12", "--names", "exported", "--dtype", "BF16"],
        picture(300, 200, 2),
    );
}
