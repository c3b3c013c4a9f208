//! Moondream's region model against the NumPy reference
//! (`scripts/reference/moondream_region.py`, float64, written from the
//! published `region.py`) on synthetic checkpoints with the real tensor
//! names and the real bin counts (1024 coordinate bins, 2 x 1024 size bins;
//! tiny widths): the HF naming stored F32 and the exported naming (Fourier
//! features stored transposed) stored BF16.
//!
//! Tolerances: encoder outputs and decoder logits within 2e-5 x
//! (|reference| + 1) (f32 against float64; cos/sin of arguments up to ~100
//! rad lose ~1e-5 absolute in f32 argument rounding; measured 3.9e-6 at
//! worst). Decoded
//! bins must be identical wherever the reference's margin between its best
//! and second-best logit exceeds twice that tolerance (a nearer tie is one
//! the f32 rounding may legitimately break the other way); the test demands
//! that nearly every row has such a margin, so it never passes vacuously.
//! Decoded values follow from the bins: the coordinate exactly, the size
//! within 1e-6 relative (f32 `powf` against float64). Skipped, saying so,
//! without numpy unless `KESTREL_REQUIRE_PYTHON` is set (CI).

use std::path::{Path, PathBuf};

use kestrel_cpu::vision::region::{
    coord_from_logits, coord_logits, encode_coords, encode_sizes, size_from_logits, size_logits,
};
use kestrel_cpu::vision::VisionRun;
use kestrel_cpu::{Isa, Numerics};
use kestrel_model::moondream::{load_checkpoint, MoondreamConfig};

#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

const TOL: f32 = 2e-5;
const ROWS: usize = 48;

fn read<T, const N: usize>(path: &Path, from: fn([u8; N]) -> T) -> Vec<T> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(N)
        .map(|b| from(b.try_into().unwrap()))
        .collect()
}

fn f32s(path: &Path) -> Vec<f32> {
    read(path, f32::from_le_bytes)
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

/// Whether the reference's argmax of `logits` wins by more than the
/// tolerance allows the two sides to disagree by.
fn clear_winner(logits: &[f32]) -> bool {
    let mut v = logits.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v[1] > 2.0 * TOL * (v[0].abs() + 1.0)
}

fn check(python: &str, tag: &str, synth_args: &[&str]) {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("kestrel-md-region-{tag}-{}", std::process::id()));
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![&dir];
    args.extend(synth_args.iter().map(|a| a as &dyn AsRef<std::ffi::OsStr>));
    reference_python::run_script(python, "moondream_synth.py", &args);
    let out = dir.join("out");
    let rows = ROWS.to_string();
    reference_python::run_script(
        python,
        "moondream_region.py",
        &[&dir, &out, &"--rows", &rows],
    );

    let config = MoondreamConfig::from_file(&dir.join("config.json")).unwrap();
    let weights = load_checkpoint(&dir, config.clone()).unwrap();
    let (w, cfg) = (weights.region.as_ref().unwrap(), &config.region);
    let run = VisionRun {
        team: None,
        isa: Isa::detect(),
        numerics: Numerics::Exact,
    };

    let hidden = f32s(&out.join("hidden.f32"));
    let coords = f32s(&out.join("coords.f32"));
    let sizes: Vec<[f32; 2]> = f32s(&out.join("sizes.f32"))
        .chunks_exact(2)
        .map(|s| [s[0], s[1]])
        .collect();
    let mut worst = 0f32;
    let ce = encode_coords(run, w, cfg, &coords).unwrap();
    worst = worst.max(close("coord_emb", &ce, &f32s(&out.join("coord_emb.f32"))));
    let se = encode_sizes(run, w, cfg, &sizes).unwrap();
    worst = worst.max(close("size_emb", &se, &f32s(&out.join("size_emb.f32"))));
    let cl = coord_logits(run, w, cfg, &hidden, ROWS).unwrap();
    let ref_cl = f32s(&out.join("coord_logits.f32"));
    worst = worst.max(close("coord_logits", &cl, &ref_cl));
    let sl = size_logits(run, w, cfg, &hidden, ROWS).unwrap();
    let ref_sl = f32s(&out.join("size_logits.f32"));
    worst = worst.max(close("size_logits", &sl, &ref_sl));

    let ref_cb = read(&out.join("coord_bins.i32"), i32::from_le_bytes);
    let ref_cv = read(&out.join("coord_values.f64"), f64::from_le_bytes);
    let ref_sb = read(&out.join("size_bins.i32"), i32::from_le_bytes);
    let ref_sv = read(&out.join("size_values.f64"), f64::from_le_bytes);
    let (nc, ns) = (cfg.coord_out_dim, cfg.size_out_dim);
    let mut compared = 0;
    for r in 0..ROWS {
        if clear_winner(&ref_cl[r * nc..][..nc]) {
            let c = coord_from_logits(&cl[r * nc..][..nc]);
            assert_eq!(c.bin as i32, ref_cb[r], "{tag}: coordinate bin of row {r}");
            assert_eq!(
                f64::from(c.value),
                ref_cv[r],
                "{tag}: coordinate of row {r}"
            );
            compared += 1;
        }
        let s = size_from_logits(&sl[r * ns..][..ns]);
        for axis in 0..2 {
            let half = ns / 2;
            if clear_winner(&ref_sl[r * ns + axis * half..][..half]) {
                assert_eq!(s.bins[axis] as i32, ref_sb[2 * r + axis], "{tag}: size bin");
                let want = ref_sv[2 * r + axis];
                let got = f64::from(s.value[axis]);
                assert!(
                    (got - want).abs() <= 1e-6 * want,
                    "{tag}: size {got} vs {want}"
                );
                compared += 1;
            }
        }
    }
    assert!(
        compared >= 3 * ROWS * 9 / 10,
        "{tag}: only {compared} of {} decodes had a clear winner",
        3 * ROWS
    );
    eprintln!("{tag}: worst relative error {worst:.2e}; {compared} decodes compared");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn region_model_matches_the_reference() {
    let Some(python) = reference_python::python_with(
        "moondream_region",
        "numpy",
        "scripts/reference/requirements.txt",
    ) else {
        return;
    };
    check(&python, "hf-f32", &["--seed", "21"]);
    check(
        &python,
        "exported-bf16",
        &["--seed", "22", "--names", "exported", "--dtype", "BF16"],
    );
}
