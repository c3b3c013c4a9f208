//! `cargo xtask bench --prompt-table`: issue 32's prompt-processing table,
//! alone (no decode workloads): Kestrel's pp512 and pp4096 (prompt tokens
//! per second of forward time, median of three fresh prompts, one
//! whole-prompt prefill step each) and its time to first token for a
//! 3072-token prompt (wall time from submit to the sampled token, median of
//! three), against llama.cpp's `llama-bench -p 512,3072,4096 -n 0` on the
//! same GGUF (its CUDA build with every layer offloaded for `--backend
//! cuda`), whose 3072-token prompt time is the TTFT yardstick. Targets:
//! pp512 and pp4096 at least llama.cpp's, TTFT at most 1.2x its prompt time.
//! Writes `prompt.md` and `prompt.json` under `--out` and prints the table.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use kestrel_pipeline::Executor as _;
use kestrel_skills::{Skill, SkillContext, SkillOptions, SkillSpec};
use serde::Serialize;

use super::harness::BenchEngine;
use super::one_token;
use super::runtime::BenchRuntime;
use super::{prefill_probe, Options};

/// The prompt lengths whose prefill rate the table reports.
pub const PP_LENS: [usize; 2] = [512, 4096];
/// The prompt whose time to first token the table reports.
pub const TTFT_LEN: usize = 3072;
/// The longest sequence the probe runtime holds (the longest prompt and
/// its one sampled token, with a page to spare).
pub const PROBE_SEQ_LEN: usize = 4096 + 64;

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct PromptRow {
    pub metric: String,
    pub kestrel: f64,
    pub llama_cpp: Option<f64>,
    /// `kestrel / llama_cpp` (rates) or `llama_cpp`-relative time (TTFT).
    pub ratio: Option<f64>,
    pub target: &'static str,
    pub met: Option<bool>,
}

#[derive(Debug, Serialize)]
struct PromptReport<'a> {
    backend: String,
    model: String,
    llama_bench_command: Option<String>,
    rows: &'a [PromptRow],
}

/// Time to first token of a fresh `len`-token prompt: median of three, wall
/// time from submit until the engine is idle again (one sampled token).
fn ttft_probe<R: BenchRuntime>(
    engine: &mut BenchEngine<R>,
    ctx: &Arc<SkillContext>,
    len: usize,
) -> anyhow::Result<f64> {
    let vocab = engine.executor().vocab_size() as u64;
    let mut secs = Vec::new();
    for salt in 0..3u64 {
        let prompt: Vec<u32> = (0..len as u64)
            .map(|i| ((i * 2_246_822_519 + salt * 131 + 7) % (vocab - 1000)) as u32 + 500)
            .collect();
        let skill = Skill::new(ctx, &SkillSpec::text(), SkillOptions::default())?;
        let t0 = Instant::now();
        one_token(engine, 9_100_000 + salt, prompt, skill, "TTFT probe")?;
        secs.push(t0.elapsed().as_secs_f64());
    }
    secs.sort_by(f64::total_cmp);
    Ok(secs[1])
}

/// llama.cpp's prompt-processing rates (tokens/s) for `lens`, from
/// `llama-bench` in `dir` (or its `bin/`; on the CPU its faster of
/// repacking on and off, [`super::peer::llama_bench`]), and the command run.
fn llama_pp(
    dir: &Path,
    model: &Path,
    threads: usize,
    gpu_layers: u32,
    lens: &[usize],
) -> anyhow::Result<(String, Vec<(usize, f64)>)> {
    let bench = super::peer::find(dir, "llama-bench")
        .with_context(|| format!("no llama-bench in {} (or its bin/)", dir.display()))?;
    let p = lens
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let (shown, rates) = super::peer::llama_bench(&bench, model, threads, gpu_layers, &p, "0")?;
    let rates = rates
        .into_iter()
        .filter(|&(n, g, _)| n > 0 && g == 0)
        .map(|(n, _, ts)| (n, ts))
        .collect();
    Ok((shown, rates))
}

/// The table's rows from Kestrel's measurements and llama.cpp's rates.
pub fn rows(pp: &[(usize, f64)], ttft_s: f64, llama: &[(usize, f64)]) -> Vec<PromptRow> {
    let peer = |len: usize| llama.iter().find(|(n, _)| *n == len).map(|&(_, ts)| ts);
    let mut out: Vec<PromptRow> = pp
        .iter()
        .map(|&(len, ts)| {
            let ratio = peer(len).map(|l| ts / l);
            PromptRow {
                metric: format!("pp{len} (prompt tokens/s)"),
                kestrel: ts,
                llama_cpp: peer(len),
                ratio,
                target: ">= 1.0",
                met: ratio.map(|r| r >= 1.0),
            }
        })
        .collect();
    // llama.cpp's time to process the prompt, in ms.
    let llama_ms = peer(TTFT_LEN).map(|ts| TTFT_LEN as f64 / ts * 1e3);
    let ratio = llama_ms.map(|l| ttft_s * 1e3 / l);
    out.push(PromptRow {
        metric: format!("TTFT, {TTFT_LEN}-token prompt (ms; llama.cpp: its prompt time)"),
        kestrel: ttft_s * 1e3,
        llama_cpp: llama_ms,
        ratio,
        target: "<= 1.2",
        met: ratio.map(|r| r <= 1.2),
    });
    out
}

/// The table as Markdown.
pub fn markdown(rows: &[PromptRow], backend: &str, model: &str) -> String {
    let num = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |x| format!("{x:.1}"));
    let mut s = format!(
        "## Prompt processing ({backend}, {model})\n\n\
         | metric | Kestrel | llama.cpp | Kestrel / llama.cpp | target | met |\n\
         |---|---:|---:|---:|---|---|\n"
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {:.1} | {} | {} | {} | {} |\n",
            r.metric,
            r.kestrel,
            num(r.llama_cpp),
            r.ratio
                .map_or_else(|| "-".to_owned(), |x| format!("{x:.2}")),
            r.target,
            r.met.map_or("-", |m| if m { "yes" } else { "NO" })
        ));
    }
    s
}

/// The first request id of the table's probe `k`: 0 the warm-up, then one
/// per [`PP_LENS`] entry (three requests each, ten apart).
fn probe_id(k: usize) -> u64 {
    super::PROBE_ID + 10 * k as u64
}

/// Measure, compare and report (see the module docs).
pub fn run<R: BenchRuntime>(
    engine: &mut BenchEngine<R>,
    ctx: &Arc<SkillContext>,
    opts: &Options,
    model_path: &Path,
) -> anyhow::Result<()> {
    // Warm-up (weights faulted in, kernels loaded, workspaces grown).
    prefill_probe(engine, ctx, 64, probe_id(0))?;
    let mut pp = Vec::new();
    for (k, len) in PP_LENS.into_iter().enumerate() {
        eprintln!("prefill probe: {len} tokens");
        let rate = prefill_probe(engine, ctx, len, probe_id(k + 1))?;
        eprintln!("prefill probe: {len} tokens at {rate:.1} tokens/s");
        pp.push((len, rate));
    }
    eprintln!("TTFT probe: {TTFT_LEN} tokens");
    let ttft = ttft_probe(engine, ctx, TTFT_LEN)?;
    let (command, llama) = match &opts.peer {
        None => (None, Vec::new()),
        Some(dir) => {
            let gpu_layers = match opts.backend {
                super::Backend::Cpu => 0,
                super::Backend::Cuda => 99,
            };
            let lens = [PP_LENS[0], TTFT_LEN, PP_LENS[1]];
            let (cmd, rates) = llama_pp(dir, model_path, opts.threads, gpu_layers, &lens)?;
            (Some(cmd), rates)
        }
    };
    let rows = rows(&pp, ttft, &llama);
    let backend = engine.executor().inner.describe();
    let model = model_path.file_name().map_or_else(
        || model_path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let md = markdown(&rows, &backend, &model);
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("creating {}", opts.out.display()))?;
    std::fs::write(opts.out.join("prompt.md"), &md)?;
    let report = PromptReport {
        backend,
        model,
        llama_bench_command: command,
        rows: &rows,
    };
    std::fs::write(
        opts.out.join("prompt.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    println!("{md}");
    println!("wrote {}", opts.out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_compare_rates_and_the_ttft_against_llama_cpp_prompt_time() {
        let pp = [(512, 60_000.0), (4096, 70_000.0)];
        // llama.cpp: 3072 tokens at 80k tokens/s = 38.4 ms.
        let llama = [(512, 50_000.0), (3072, 80_000.0), (4096, 80_500.0)];
        let r = rows(&pp, 0.050, &llama);
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].ratio, Some(1.2));
        assert_eq!(r[0].met, Some(true));
        assert_eq!(r[1].met, Some(false));
        let want_ms = 3072.0 / 80_000.0 * 1e3;
        assert!((r[2].llama_cpp.unwrap() - want_ms).abs() < 1e-9);
        assert!((r[2].ratio.unwrap() - 50.0 / want_ms).abs() < 1e-9);
        assert_eq!(r[2].met, Some(false), "50 ms > 1.2 x 38.4 ms");
        let md = markdown(&r, "cuda (test)", "m.gguf");
        assert!(
            md.contains("| pp512 (prompt tokens/s) | 60000.0 | 50000.0 | 1.20 | >= 1.0 | yes |")
        );
        // Without a peer: Kestrel's figures, nothing compared.
        let alone = rows(&pp, 0.050, &[]);
        assert!(alone.iter().all(|r| r.ratio.is_none() && r.met.is_none()));
    }

    #[test]
    fn the_tables_probe_prompts_share_no_prefix() {
        // The request ids `run` gives its probes: warm-up, then each of
        // PP_LENS (three each); the decode bench's probe reuses the warm-up's.
        let ids: Vec<u64> = (0..=PP_LENS.len())
            .flat_map(|k| probe_id(k)..probe_id(k) + 3)
            .collect();
        for vocab in [49_152, 128_256, 262_144] {
            let firsts: Vec<u32> = ids
                .iter()
                .map(|&id| super::super::probe_prompt(4, vocab, id)[0])
                .collect();
            let mut distinct = firsts.clone();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(
                distinct.len(),
                ids.len(),
                "vocab {vocab}: first tokens {firsts:?}"
            );
            assert!(firsts
                .iter()
                .all(|&t| (500..vocab as u32 - 500).contains(&t)));
        }
        // The head of a longer prompt of the same request is the shorter one.
        assert_eq!(
            super::super::probe_prompt(64, 128_256, 7),
            super::super::probe_prompt(512, 128_256, 7)[..64]
        );
    }
}
