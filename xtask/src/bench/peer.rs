//! `--peer llama.cpp DIR`: llama.cpp's own benchmarks on the same GGUF and
//! thread count (and, with `--backend cuda`, its CUDA build with every layer
//! on the GPU), for an our/their ratio.
//!
//! `llama-batched-bench` gives decode (S_TG) and end-to-end (S) tokens/s for
//! 1..N parallel sequences with our mean prompt and output lengths;
//! `llama-bench` gives prompt processing (pp512) and single-stream
//! generation (tg128) rates. Both run CPU-only (`-ngl 0`) against the CPU
//! backend, fully offloaded (`-ngl 99`) against the CUDA backend.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};
use serde::Serialize;

/// One `llama-batched-bench` row.
#[derive(Debug, Clone, Serialize)]
pub struct BatchedRow {
    pub parallel: usize,
    pub prompt: usize,
    pub gen: usize,
    /// Decode tokens/s over all sequences.
    pub speed_tg: f64,
    /// (prompt + generated) tokens/s over the whole run.
    pub speed: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct LlamaCpp {
    pub dir: PathBuf,
    pub batched_command: String,
    pub batched: Vec<BatchedRow>,
    pub bench_command: Option<String>,
    pub pp512_tokens_per_s: Option<f64>,
    pub tg128_tokens_per_s: Option<f64>,
}

fn find(dir: &Path, name: &str) -> Option<PathBuf> {
    [dir.join(name), dir.join("bin").join(name)]
        .into_iter()
        .find(|p| p.is_file())
}

fn run(cmd: &mut Command) -> anyhow::Result<(String, String)> {
    let shown = format!("{cmd:?}").replace('"', "");
    let out = cmd.output().with_context(|| format!("running {shown}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "{shown} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .join(" | ")
        );
    }
    Ok((shown, stdout))
}

/// Run llama.cpp's benchmarks from `dir` on `model`.
pub fn run_llama_cpp(
    dir: &Path,
    model: &Path,
    threads: usize,
    gpu_layers: u32,
    parallel: &[usize],
    prompt: usize,
    gen: usize,
) -> anyhow::Result<LlamaCpp> {
    let batched = find(dir, "llama-batched-bench").with_context(|| {
        format!(
            "no llama-batched-bench in {} (or its bin/): build llama.cpp's \
             `llama-batched-bench` and `llama-bench` targets first",
            dir.display()
        )
    })?;
    let max_par = parallel.iter().copied().max().unwrap_or(1);
    let ctx = (max_par * (prompt + gen) + 256).next_power_of_two();
    let npl = parallel
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let t = threads.to_string();
    let ngl = gpu_layers.to_string();
    let (batched_command, out) = run(Command::new(&batched).args([
        "-m",
        &model.to_string_lossy(),
        "-t",
        &t,
        "-tb",
        &t,
        "-ngl",
        &ngl,
        "-c",
        &ctx.to_string(),
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        &prompt.to_string(),
        "-ntg",
        &gen.to_string(),
        "-npl",
        &npl,
        "--output-format",
        "jsonl",
    ]))?;
    let mut rows = Vec::new();
    for line in out.lines().filter(|l| l.trim_start().starts_with('{')) {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("parsing llama-batched-bench output `{line}`"))?;
        let num = |k: &str| v.get(k).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
        rows.push(BatchedRow {
            parallel: num("pl") as usize,
            prompt: num("pp") as usize,
            gen: num("tg") as usize,
            speed_tg: num("speed_tg"),
            speed: num("speed"),
        });
    }
    if rows.is_empty() {
        bail!("llama-batched-bench printed no results");
    }
    let mut result = LlamaCpp {
        dir: dir.to_path_buf(),
        batched_command,
        batched: rows,
        bench_command: None,
        pp512_tokens_per_s: None,
        tg128_tokens_per_s: None,
    };
    if let Some(bench) = find(dir, "llama-bench") {
        let (cmd, out) = run(Command::new(bench).args([
            "-m",
            &model.to_string_lossy(),
            "-t",
            &t,
            "-ngl",
            &ngl,
            "-p",
            "512",
            "-n",
            "128",
            "-r",
            "3",
            "-o",
            "jsonl",
        ]))?;
        result.bench_command = Some(cmd);
        for line in out.lines().filter(|l| l.trim_start().starts_with('{')) {
            let v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("parsing llama-bench output `{line}`"))?;
            let get = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
            match (get("n_prompt"), get("n_gen"), get("avg_ts")) {
                (Some(p), Some(g), Some(ts)) if p > 0.0 && g == 0.0 => {
                    result.pp512_tokens_per_s = Some(ts)
                }
                (Some(p), Some(g), Some(ts)) if p == 0.0 && g > 0.0 => {
                    result.tg128_tokens_per_s = Some(ts)
                }
                _ => {}
            }
        }
    }
    Ok(result)
}
