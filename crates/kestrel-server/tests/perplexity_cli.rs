//! `kestrel perplexity` end to end on the default model: the figure it
//! prints, in the default (fast) numerics, is `kestrel_cpu::perplexity`'s
//! with `CpuModelOptions::default()` numerics on the text tokenized as
//! llama-perplexity does, and a text too short for two windows is refused
//! with llama-perplexity's rule. Two windows of 64 keep it to a second.

use std::path::PathBuf;
use std::process::{Command, Output};

use kestrel_cpu::{CpuModel, CpuModelOptions, PerplexityConfig};

fn text_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/text/alice-ch1-3.txt")
}

fn kestrel_perplexity(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .arg("perplexity")
        .arg("--text")
        .arg(text_path())
        .args(args)
        .output()
        .expect("run kestrel")
}

#[test]
fn the_cli_prints_the_library_figure() {
    let out = kestrel_perplexity(&["--ctx", "64", "--chunks", "2", "--threads", "2"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    // The CLI's default numerics are the library's (fast).
    assert!(stderr.contains("numerics Fast"), "{stderr}");
    let printed: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("Final estimate: PPL = "))
        .and_then(|l| l.split(' ').next())
        .unwrap_or_else(|| panic!("no final estimate:\n{stdout}"))
        .parse()
        .unwrap();

    let path = kestrel_model::default_model_path().expect("default model (fetched with pip)");
    let loaded = kestrel_model::load(&path).unwrap();
    let text = std::fs::read_to_string(text_path()).unwrap();
    let tokens = loaded
        .encode_prompt(text.strip_suffix('\n').unwrap_or(&text))
        .unwrap();
    let cfg = PerplexityConfig {
        ctx: 64,
        bos: loaded.bos_token_id.filter(|_| loaded.add_bos_token),
        max_windows: Some(2),
    };
    let opts = CpuModelOptions {
        threads: 2,
        ..Default::default()
    };
    let model = CpuModel::new(loaded.weights, opts).unwrap();
    let want = kestrel_cpu::perplexity(&model, &tokens, cfg, |_, _| {}).unwrap();
    assert_eq!(want.windows, 2);
    assert!(
        (printed - want.ppl).abs() <= 5e-5,
        "printed {printed}, library {}",
        want.ppl
    );
}

#[test]
fn a_text_too_short_for_two_windows_is_refused() {
    // 8,455 tokens: not 2 * 8192.
    let out = kestrel_perplexity(&["--ctx", "8192", "--threads", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("at least 2 * ctx tokens"), "{stderr}");
}
