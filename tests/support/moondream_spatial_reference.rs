//! The float64 NumPy point / detect loop (`scripts/reference/moondream_spatial.py`)
//! run on one prepared image, for the tests that hold Kestrel's points and
//! boxes to it: its tokens, and its objects with their values computed as
//! the runtime's decoders compute them from the bins (`bin / 1024`,
//! `2^(bin / 1023 * 10 - 10)` in f32). The including test declares
//! `mod reference_python` beside this module.

use std::path::Path;

use kestrel_model::vision::PreparedImage;
use kestrel_skills::{BoundingBox, Point, SpatialIds, SpatialKind, SpatialResult};

/// Region logits from f32 hidden states against float64: a bin (or an x
/// stage's coord-vs-EOS choice) closer than this could flip by summation
/// order alone, so a reference run whose margins do not all exceed it
/// decides nothing.
pub const MARGIN: f64 = 4e-4;

/// What the reference gave.
#[derive(Debug, Clone, PartialEq)]
pub struct Spatial {
    /// Every sampled id, a final EOS included.
    pub tokens: Vec<u32>,
    pub objects: SpatialResult,
}

/// One reference run.
pub struct SpatialCase<'a> {
    pub kind: SpatialKind,
    pub max_objects: u32,
    pub ids: SpatialIds,
    /// The ids before the image's rows (BOS) and after them (the template).
    pub before: &'a [u32],
    pub after: &'a [u32],
}

/// Runs the reference on `ckpt` for `image`'s crops, writing under `dir`
/// (`tag` names this run's files); panics when a margin is too thin
/// ([`MARGIN`]).
pub fn spatial(
    python: &str,
    ckpt: &Path,
    dir: &Path,
    image: &PreparedImage,
    case: &SpatialCase<'_>,
    tag: &str,
) -> Spatial {
    let crops = dir.join(format!("crops-{tag}.u8"));
    std::fs::write(&crops, &image.crops.pixels).unwrap();
    let prompt = dir.join(format!("spatial-{tag}.json"));
    let spec = serde_json::json!({
        "before": case.before, "after": case.after,
        "kind": match case.kind { SpatialKind::Point => "point", SpatialKind::Detect => "detect" },
        "max_objects": case.max_objects, "coord_id": case.ids.coord,
        "size_id": case.ids.size, "eos_id": case.ids.eos,
    });
    std::fs::write(&prompt, spec.to_string()).unwrap();
    let out = dir.join(format!("spatial-out-{tag}"));
    let (tr, tc) = (
        image.crops.tiling.rows.to_string(),
        image.crops.tiling.cols.to_string(),
    );
    crate::reference_python::run_script(
        python,
        "moondream_spatial.py",
        &[
            &ckpt as &dyn AsRef<std::ffi::OsStr>,
            &crops,
            &tr,
            &tc,
            &prompt,
            &out,
        ],
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("spatial.json")).unwrap()).unwrap();
    let ints = |v: &serde_json::Value| -> Vec<u32> {
        let a = v.as_array().unwrap();
        a.iter().map(|t| t.as_u64().unwrap() as u32).collect()
    };
    let margins: Vec<f64> = r["margins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_f64().unwrap())
        .collect();
    assert!(
        margins.iter().all(|&m| m > MARGIN),
        "{tag}: a reference margin is too thin to decide: {margins:?}"
    );
    let sizes: Vec<Vec<u32>> = r["size_bins"]
        .as_array()
        .unwrap()
        .iter()
        .map(ints)
        .collect();
    Spatial {
        tokens: ints(&r["tokens"]),
        objects: objects(case.kind, &ints(&r["coord_bins"]), &sizes),
    }
}

/// The objects of the reference's bins, as the runtime's decoders compute
/// their values.
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
