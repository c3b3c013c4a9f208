//! The float64 NumPy Moondream (`scripts/reference/moondream_greedy.py`:
//! encoder, projector, Phi with the prefix mask) run on one prepared image,
//! for the tests that hold Kestrel's tokens to it. The including test
//! declares `mod reference_python` beside this module.

use std::path::{Path, PathBuf};

use kestrel_model::vision::PreparedImage;

/// What the reference wrote: its greedy tokens, each step's top-two
/// margin, and the directory holding `logits.f32` (the first step's).
pub struct Greedy {
    pub tokens: Vec<u32>,
    pub margins: Vec<f64>,
    pub out: PathBuf,
}

/// Runs the reference on `ckpt` for `image`'s crops, the ids `before` and
/// `after` the image's rows, `steps` greedy steps, writing under `dir`.
pub fn greedy(
    python: &str,
    ckpt: &Path,
    dir: &Path,
    image: &PreparedImage,
    (before, after): (&[u32], &[u32]),
    steps: u32,
) -> Greedy {
    let crops = dir.join("crops.u8");
    std::fs::write(&crops, &image.crops.pixels).unwrap();
    let prompt = dir.join("prompt.json");
    let spec = serde_json::json!({"before": before, "after": after, "steps": steps});
    std::fs::write(&prompt, spec.to_string()).unwrap();
    let out = dir.join("out");
    let (tr, tc) = (
        image.crops.tiling.rows.to_string(),
        image.crops.tiling.cols.to_string(),
    );
    crate::reference_python::run_script(
        python,
        "moondream_greedy.py",
        &[
            &ckpt as &dyn AsRef<std::ffi::OsStr>,
            &crops,
            &tr,
            &tc,
            &prompt,
            &out,
        ],
    );
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("greedy.json")).unwrap()).unwrap();
    let list = |key: &str| want[key].as_array().unwrap().clone();
    Greedy {
        tokens: list("tokens")
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect(),
        margins: list("margins")
            .iter()
            .map(|m| m.as_f64().unwrap())
            .collect(),
        out,
    }
}
