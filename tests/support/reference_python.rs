//! The Python side of the reference tests, shared by several crates'
//! integration tests (each includes this file with `#[path]`): finding an
//! interpreter with the modules a test needs, and writing the synthetic
//! family fixtures of `scripts/reference/synthetic_fixtures.py`.
//!
//! A missing module is a skip that says so, or a failure when
//! `KESTREL_REQUIRE_PYTHON` is set (CI installs the requirements and insists
//! on the runs).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `$KESTREL_PYTHON` (default `python3`) if it can import `modules` (a
/// comma-separated list, as `import` takes it); otherwise `None` after
/// saying that `test` was skipped and which `requirements` file to install.
pub fn python_with(test: &str, modules: &str, requirements: &str) -> Option<String> {
    let python = std::env::var("KESTREL_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(python);
    }
    assert!(
        std::env::var_os("KESTREL_REQUIRE_PYTHON").is_none(),
        "KESTREL_REQUIRE_PYTHON is set but {python} cannot import {modules} \
         (pip install -r {requirements})"
    );
    eprintln!(
        "SKIPPED {test}: {python} cannot import {modules} \
         (pip install -r {requirements}, or set KESTREL_PYTHON)"
    );
    None
}

/// Writes the synthetic family fixtures (random weights, the default
/// model's tokenizer cut down; all cases, or only `cases`) into a fresh
/// directory named after `tag`, or `None` (skipped) when the Python side is
/// missing and not required.
pub fn synthetic_fixtures(test: &str, tag: &str, cases: &[&str]) -> Option<PathBuf> {
    fixture_script("synthetic_fixtures.py", test, tag, cases)
}

/// Runs `scripts/reference/{script}` (`synthetic_fixtures.py`, or another
/// that takes the same arguments: the default model's GGUF, an output
/// directory and case names) into a fresh directory named after `tag`, or
/// `None` (skipped) when the Python side is missing and not required.
pub fn fixture_script(script: &str, test: &str, tag: &str, cases: &[&str]) -> Option<PathBuf> {
    let python = python_with(
        test,
        "gguf, numpy, regex",
        "scripts/reference/requirements.txt",
    )?;
    let smol = kestrel_model::default_model_path().expect("default model (its vocabulary)");
    let dir = std::env::temp_dir().join(format!("kestrel-{tag}-{}", std::process::id()));
    let out = Command::new(&python)
        .arg(repo().join("scripts/reference").join(script))
        .arg(&smol)
        .arg(&dir)
        .args(cases)
        .output()
        .expect("run the fixture script");
    assert!(
        out.status.success(),
        "{script} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some(dir)
}

/// Runs `scripts/reference/<script>` under `python` with `args`, failing the
/// test with the script's stderr if it fails.
#[allow(dead_code)] // not every including test runs a script itself
pub fn run_script(python: &str, script: &str, args: &[&dyn AsRef<std::ffi::OsStr>]) {
    let mut cmd = Command::new(python);
    cmd.arg(repo().join("scripts/reference").join(script));
    for a in args {
        cmd.arg(a);
    }
    let out = cmd.output().expect("run the reference");
    assert!(
        out.status.success(),
        "{script} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A synthetic served Moondream checkpoint (`moondream_synth.py OUT
/// --served --seed SEED`: the published names, vocabulary 51200 with its
/// tokenizer, small widths, a region model) made in
/// `<temp>/kestrel-<tag>-<pid>/ckpt`: the python that made it (for the
/// reference scripts), the directory (the caller removes it) and the
/// checkpoint; `None` where the references cannot run ([`python_with`]).
#[allow(dead_code)] // not every including test serves Moondream
pub fn served_moondream(test: &str, tag: &str, seed: u32) -> Option<(String, PathBuf, PathBuf)> {
    served_moondream_with(test, tag, seed, &[])
}

/// [`served_moondream`] with more of `moondream_synth.py`'s flags (e.g.
/// `--no-region`: a checkpoint without a region model).
#[allow(dead_code)] // not every including test serves Moondream
pub fn served_moondream_with(
    test: &str,
    tag: &str,
    seed: u32,
    flags: &[&str],
) -> Option<(String, PathBuf, PathBuf)> {
    let python = python_with(test, "numpy", "scripts/reference/requirements.txt")?;
    let dir = std::env::temp_dir().join(format!("kestrel-{tag}-{}", std::process::id()));
    let ckpt = dir.join("ckpt");
    let seed = seed.to_string();
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![&ckpt, &"--served", &"--seed", &seed];
    args.extend(flags.iter().map(|f| f as &dyn AsRef<std::ffi::OsStr>));
    run_script(&python, "moondream_synth.py", &args);
    Some((python, dir, ckpt))
}
