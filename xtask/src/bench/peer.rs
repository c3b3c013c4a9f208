//! `--peer llama.cpp DIR`: llama.cpp's own benchmarks on the same GGUF and
//! thread count (and, with `--backend cuda`, its CUDA build with every layer
//! on the GPU), for an our/their ratio.
//!
//! `llama-batched-bench` gives decode (S_TG) and end-to-end (S) tokens/s for
//! 1..N parallel sequences with our mean prompt and output lengths;
//! `llama-bench` gives prompt processing (pp512) and single-stream
//! generation (tg128) rates. Both run CPU-only (`-ngl 0`) against the CPU
//! backend, fully offloaded (`-ngl 99`) against the CUDA backend.
//!
//! On the CPU, llama.cpp repacks some weight types at load (Q4_K into
//! blocks of eight rows interleaved on any AVX2 x86), which speeds some of
//! its workloads and slows others: on a 2-core Zen 5 EPYC it ran a 1B
//! Q4_K_M's pp512 1.6x faster and 32 streams up to 1.4x faster with it off
//! (`--repack 0`, `-nr`), one stream and 8 streams faster with it on. So
//! on the CPU both benchmarks run both ways and every metric keeps
//! llama.cpp's faster one: a ratio is against its better setting.

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

/// llama.cpp's binary `name` in `dir` or its `bin/`.
pub(super) fn find(dir: &Path, name: &str) -> Option<PathBuf> {
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
    let mut cmd = Command::new(&batched);
    cmd.args([
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
    ]);
    let (mut batched_command, out) = run(&mut cmd)?;
    let mut rows = batched_rows(&out)?;
    if repacks(gpu_layers) {
        // Again without repacking; each metric keeps the faster run.
        let (_, out) = run(cmd.arg("-nr"))?;
        for r in batched_rows(&out)? {
            if let Some(row) = rows.iter_mut().find(|row| row.parallel == r.parallel) {
                row.speed_tg = row.speed_tg.max(r.speed_tg);
                row.speed = row.speed.max(r.speed);
            }
        }
        batched_command.push_str("  # and again with -nr; each metric the faster");
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
        let (cmd, rates) = llama_bench(&bench, model, threads, gpu_layers, "512", "128")?;
        result.bench_command = Some(cmd);
        for r in rates {
            match r {
                (p, 0, ts) if p > 0 => result.pp512_tokens_per_s = Some(ts),
                (0, g, ts) if g > 0 => result.tg128_tokens_per_s = Some(ts),
                _ => {}
            }
        }
    }
    Ok(result)
}

/// Whether llama.cpp's weight repacking applies, so that its benchmarks run
/// with it on and off (module doc): on the CPU, `gpu_layers == 0`.
fn repacks(gpu_layers: u32) -> bool {
    gpu_layers == 0
}

/// One `llama-bench` test: `(n_prompt, n_gen, tokens/s)`.
pub(super) type BenchRate = (usize, usize, f64);

/// `llama-batched-bench`'s JSONL rows.
fn batched_rows(out: &str) -> anyhow::Result<Vec<BatchedRow>> {
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
    Ok(rows)
}

/// `llama-bench` at `llama_bench` on `model` for prompt lengths `prompt` and
/// generation lengths `gen` (its `-p`, `-n` lists; "0" for none), three
/// repetitions; on the CPU (`gpu_layers == 0`) with repacking on and off
/// (`--repack 0,1`), keeping the faster. Returns the command and one
/// `(n_prompt, n_gen, tokens/s)` per test.
pub(super) fn llama_bench(
    llama_bench: &Path,
    model: &Path,
    threads: usize,
    gpu_layers: u32,
    prompt: &str,
    gen: &str,
) -> anyhow::Result<(String, Vec<BenchRate>)> {
    let mut cmd = Command::new(llama_bench);
    cmd.args(["-m", &model.to_string_lossy(), "-t", &threads.to_string()])
        .args(["-ngl", &gpu_layers.to_string(), "-p", prompt, "-n", gen])
        .args(["-r", "3", "-o", "jsonl"]);
    if repacks(gpu_layers) {
        cmd.args(["--repack", "0,1"]);
    }
    let (shown, out) = run(&mut cmd)?;
    let mut rates: Vec<BenchRate> = Vec::new();
    for line in out.lines().filter(|l| l.trim_start().starts_with('{')) {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("parsing llama-bench output `{line}`"))?;
        let get = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
        if let (Some(p), Some(g), Some(ts)) = (get("n_prompt"), get("n_gen"), get("avg_ts")) {
            let (p, g) = (p as usize, g as usize);
            match rates.iter_mut().find(|r| (r.0, r.1) == (p, g)) {
                Some(r) => r.2 = r.2.max(ts),
                None => rates.push((p, g, ts)),
            }
        }
    }
    Ok((shown, rates))
}
