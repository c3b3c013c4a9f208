//! The bench's results document: what `results.json` holds and how
//! `results.md` (also printed) renders it as the Photon tables.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use super::peer::LlamaCpp;
use super::stats::{ConfigResult, CostModelRow, RunSummary};
use super::workload::{EngineConfig, LengthPlan, Workload};
use super::Options;

pub const DEFINITIONS: &str = "\
- **forward / sampling**: device-side time (CPU: the compute-stream thread's clock; CUDA: events on the compute stream) of a decode step's forward and of its sampling.
- **period**: from one decode forward's start to the next one's (steady state).
- **device idle**: `forward_start[t+1] - sample_end[t]`, the gap on the compute stream: the bubble (median; **idle mean** keeps the rare long stalls).
- **sched busy**: scheduler-thread time inside `EngineLoop::run_once` minus the time it was blocked in \
`Executor::wait_step` (waiting for the device), per committed step (prefill and decode).
- **steady state**: decode steps after a run's first 3 whose batch holds at least 3/4 of the streams; \
step columns are medians over them, pooled over repetitions.
- **L**: mean generated tokens per request. **z**: device time spent on zombie rows over decode device time \
(a zombie-only step costs its whole time; a zombie row in a live batch costs the marginal per-row forward \
time, fitted over the workload's decode steps).
- **blocking bubble**: blocking device idle / blocking period: the most pipelining can hide.
- **predicted** = `T_block / T_pipe x (1 - z) - 1`; **observed** = pipelined / blocking tokens/s - 1 \
(end to end: prefill and ramp-down included).
- **TTFT**: submit to first committed token; **ITL**: between consecutive committed tokens of a request.";

#[derive(Debug, Clone, Serialize)]
pub struct Meta {
    pub command: String,
    pub commit: Option<String>,
    pub unix_time: u64,
    /// The CPU's model name (`/proc/cpuinfo`), where the OS gives one.
    pub cpu: Option<String>,
    /// The kernels' ISA (`KESTREL_ISA` if forced, else the best this CPU
    /// runs), as `KESTREL_ISA` spells it.
    pub isa: String,
    pub cores: usize,
    pub threads: usize,
    pub backend: String,
    pub model: String,
    pub weight_bytes: usize,
    /// The CPU's read bandwidth and the one-stream decode floor it gives.
    pub dram: Option<super::dram::DramFloor>,
    pub quick: bool,
    pub reps: usize,
    pub plan: LengthPlan,
    pub workloads: Vec<Workload>,
    pub definitions: &'static str,
}

impl Meta {
    pub fn new(
        opts: &Options,
        model: &Path,
        weight_bytes: usize,
        backend: String,
        dram: Option<super::dram::DramFloor>,
    ) -> Self {
        let commit = std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .current_dir(super::workspace_root())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
        let args: Vec<String> = std::env::args().skip(1).collect();
        Self {
            command: format!("cargo xtask {}", args.join(" ")),
            commit,
            unix_time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            cpu: cpu_model(),
            isa: kestrel_cpu::kernels::coverage::isa_name(kestrel_cpu::Isa::detect()).to_string(),
            cores: std::thread::available_parallelism().map_or(1, usize::from),
            threads: opts.threads,
            backend,
            model: model.display().to_string(),
            weight_bytes,
            dram,
            quick: opts.quick,
            reps: opts.reps,
            plan: opts.plan,
            workloads: opts.workloads.clone(),
            definitions: DEFINITIONS,
        }
    }
}

/// Writes a bench's `results.md` and `results.json` into `out`, prints the
/// markdown, and fails with `other_error` (what the compared engine, the
/// peer or the floor, gave instead of figures) once Kestrel's are written.
pub(crate) fn write_results(
    out: &Path,
    md: &str,
    doc: &impl Serialize,
    other: &str,
    other_error: Option<anyhow::Error>,
) -> anyhow::Result<()> {
    std::fs::write(out.join("results.md"), md)?;
    std::fs::write(out.join("results.json"), serde_json::to_string_pretty(doc)?)?;
    println!("{md}");
    println!("wrote {}", out.display());
    match other_error {
        Some(e) => Err(e.context(format!(
            "{other} failed; Kestrel's results are in {}",
            out.display()
        ))),
        None => Ok(()),
    }
}

/// The first `model name` in `/proc/cpuinfo` (x86 Linux), if any.
pub(crate) fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
        .map(|(_, name)| name.trim().to_string())
}

/// One our-vs-llama.cpp comparison.
#[derive(Debug, Clone, Serialize)]
pub struct PeerRow {
    pub metric: String,
    pub kestrel: f64,
    pub llama_cpp: f64,
    pub ratio: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PeerReport {
    pub llama_cpp: LlamaCpp,
    pub rows: Vec<PeerRow>,
}

impl PeerReport {
    pub fn new(llama: LlamaCpp, our_pp512: f64, results: &[ConfigResult]) -> Self {
        let ours = |streams: usize| {
            results.iter().find(|r| {
                r.streams == streams
                    && r.config == EngineConfig::PipelinedRideAlong
                    && !r.workload.contains("JSON")
            })
        };
        let mut rows = Vec::new();
        let mut push = |metric: String, k: f64, l: f64| {
            rows.push(PeerRow {
                metric,
                kestrel: k,
                llama_cpp: l,
                ratio: if l > 0.0 { k / l } else { 0.0 },
            })
        };
        for b in &llama.batched {
            let Some(r) = ours(b.parallel) else { continue };
            push(
                format!("decode tokens/s, {} parallel (steady)", b.parallel),
                r.steady_decode_tokens_per_s(),
                b.speed_tg,
            );
            push(
                format!("end-to-end (prompt+gen) tokens/s, {} parallel", b.parallel),
                (r.prompt_tokens + r.tokens) as f64 / r.wall_s,
                b.speed,
            );
        }
        if let Some(pp) = llama.pp512_tokens_per_s {
            push("prompt processing tokens/s (pp512)".into(), our_pp512, pp);
        }
        if let (Some(tg), Some(r)) = (llama.tg128_tokens_per_s, ours(1)) {
            push(
                "single-stream generation tokens/s (tg128)".into(),
                r.steady_decode_tokens_per_s(),
                tg,
            );
        }
        Self {
            llama_cpp: llama,
            rows,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub meta: Meta,
    pub runs: Vec<RunSummary>,
    pub results: Vec<ConfigResult>,
    pub cost_model: Vec<CostModelRow>,
    pub peer: Option<PeerReport>,
    /// Why `--peer`'s benchmark gave no figures (its error and causes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_error: Option<String>,
}

/// The report's section on `--peer`, with figures or with why there are none.
const PEER_HEADING: &str = "## Against llama.cpp (same GGUF, same threads)";

fn pct(x: f64) -> String {
    format!("{x:+.1}%")
}

/// The Markdown report (also what the bench prints).
pub fn markdown(doc: &Report, timeline_caption: Option<&str>) -> String {
    let m = &doc.meta;
    let mut s = String::new();
    let _ = writeln!(s, "# Kestrel pipelining bench\n");
    let _ = writeln!(
        s,
        "`{}` at {} on {} ({}, kernels {}), {} cores, {} matmul threads, {} backend; model `{}` \
         ({:.1} MB of weights). \
         Outputs {}..={} tokens (greedy, EOS ignored for text), {}% JSON-constrained in the +JSON \
         workloads, {} repetition(s), configurations rotated within each.\n",
        m.command,
        m.commit.as_deref().unwrap_or("an unknown commit"),
        m.cpu.as_deref().unwrap_or("an unnamed CPU"),
        std::env::consts::ARCH,
        m.isa,
        m.cores,
        m.threads,
        m.backend,
        Path::new(&m.model)
            .file_name()
            .map_or(m.model.clone(), |f| f.to_string_lossy().into_owned()),
        m.weight_bytes as f64 / 1e6,
        m.plan.min_tokens,
        m.plan.max_tokens,
        (m.plan.json_share * 100.0).round(),
        m.reps,
    );

    let _ = writeln!(s, "## Per step (steady-state medians, ms)\n");
    let _ = writeln!(
        s,
        "| workload | configuration | forward | sampling | period | device idle | idle mean | sched busy |"
    );
    let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|");
    for r in &doc.results {
        let _ = writeln!(
            s,
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} | {:.2} |",
            r.workload,
            r.config.short(),
            r.forward_ms,
            r.sampling_ms,
            r.period_ms,
            r.device_idle_ms,
            r.device_idle_mean_ms,
            r.sched_busy_ms
        );
    }

    let _ = writeln!(s, "\n## Cost model: speedup = T_block / T_pipe x (1 - z)\n");
    let _ = writeln!(
        s,
        "| workload | pipelined | blocking (ms) | pipelined (ms) | blocking bubble | L | z | predicted | observed | why they differ |"
    );
    let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|---:|---|");
    for c in &doc.cost_model {
        let _ = writeln!(
            s,
            "| {} | {} | {:.2} | {:.2} | {:.2}% | {:.0} | {:.2}% | {} | {} | {} |",
            c.workload,
            c.config.short(),
            c.t_block_ms,
            c.t_pipe_ms,
            c.block_bubble * 100.0,
            c.mean_len,
            c.z * 100.0,
            pct(c.predicted_pct),
            pct(c.observed_pct),
            c.note.as_deref().unwrap_or("agree within 3 points")
        );
    }

    let _ = writeln!(s, "\n## Per run (pooled over repetitions)\n");
    let _ = writeln!(
        s,
        "| workload | configuration | tokens/s | L | zombie rows | zombie-only steps | TTFT p50 / p99 (ms) | ITL p50 / p90 / p99 (ms) | device busy |"
    );
    let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in &doc.results {
        let _ = writeln!(
            s,
            "| {} | {} | {:.1} | {:.1} | {} | {} | {:.0} / {:.0} | {:.1} / {:.1} / {:.1} | {:.0}% |",
            r.workload,
            r.config.short(),
            r.tokens_per_s,
            r.mean_len,
            r.zombie_rows,
            r.zombie_only_steps,
            r.ttft_ms.p50,
            r.ttft_ms.p99,
            r.itl_ms.p50,
            r.itl_ms.p90,
            r.itl_ms.p99,
            r.device_busy_share * 100.0
        );
    }

    if let Some(d) = &m.dram {
        let _ = writeln!(s, "\n## One stream against the DRAM floor\n");
        let floor_bytes = match d.file_bytes_per_token {
            Some(b) => format!(
                "a decode step must read {:.1} MB of the file's tensors (all of them but the token \
                 embedding, which is gathered one row per token; the output head counted even when \
                 tied): what any engine reads per token",
                b as f64 / 1e6
            ),
            None => format!(
                "the model is not a GGUF file, so the floor counts Kestrel's resident {:.1} MB",
                d.resident_bytes_per_token as f64 / 1e6
            ),
        };
        let _ = writeln!(
            s,
            "Read bandwidth {:.1} GB/s ({} threads, best of {} reads of {} MiB); {floor_bytes}; so \
             one stream can decode at most {:.0} tokens/s. Kestrel holds {:.1} MB of those weights \
             resident ({:.2}x the file's bytes), which it could stream at most {:.0} times a second.\n",
            d.read_bytes_per_s / 1e9,
            d.threads,
            super::dram::PASSES,
            super::dram::BUFFER_BYTES >> 20,
            d.tokens_per_s(),
            d.resident_bytes_per_token as f64 / 1e6,
            d.resident_bytes_per_token as f64 / d.bytes_per_token() as f64,
            d.resident_tokens_per_s(),
        );
        if !d.runs.is_empty() {
            let _ = writeln!(
                s,
                "Beside each one-stream run the bandwidth was read again (best of {} reads just \
                 before it and just after, the two averaged): the machine's own minute, which on \
                 a shared machine moves by a quarter and more; the last two columns set the run \
                 against it.\n",
                super::dram::BESIDE_PASSES,
            );
        }
        let _ = writeln!(
            s,
            "| workload | configuration | steady decode tokens/s | of the floor (file bytes) | \
             Kestrel resident weights MB | of Kestrel's floor (resident bytes) | read GB/s beside \
             the runs | of that floor (file bytes) |"
        );
        let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|");
        for r in doc.results.iter().filter(|r| r.streams == 1) {
            let tps = r.steady_decode_tokens_per_s();
            let beside = d.beside(&r.workload, r.config.short());
            let (beside_gbs, beside_share) = match beside {
                Some(bw) => (
                    format!("{:.1}", bw / 1e9),
                    format!("{:.0}%", 100.0 * tps / d.tokens_per_s_at(bw)),
                ),
                None => ("-".into(), "-".into()),
            };
            let _ = writeln!(
                s,
                "| {} | {} | {:.1} | {:.0}% | {:.1} | {:.0}% | {beside_gbs} | {beside_share} |",
                r.workload,
                r.config.short(),
                tps,
                100.0 * tps / d.tokens_per_s(),
                d.resident_bytes_per_token as f64 / 1e6,
                100.0 * tps / d.resident_tokens_per_s()
            );
        }
    }

    if let Some(p) = &doc.peer {
        let _ = writeln!(s, "\n{PEER_HEADING}\n");
        let _ = writeln!(s, "| metric | Kestrel | llama.cpp | Kestrel / llama.cpp |");
        let _ = writeln!(s, "|---|---:|---:|---:|");
        for r in &p.rows {
            let _ = writeln!(
                s,
                "| {} | {:.1} | {:.1} | {:.2} |",
                r.metric, r.kestrel, r.llama_cpp, r.ratio
            );
        }
        let _ = writeln!(s, "\nllama.cpp commands:\n");
        let _ = writeln!(s, "    {}", p.llama_cpp.batched_command);
        if let Some(c) = &p.llama_cpp.bench_command {
            let _ = writeln!(s, "    {c}");
        }
        let _ = writeln!(
            s,
            "\nKestrel decode is pipelined + ride-along on the text workload: batch rows / median \
             steady period; end to end counts (prompt + generated) tokens over the wall, like \
             llama-batched-bench's S. Kestrel's pp512 is the forward time of a 512-token prefill \
             of fresh tokens."
        );
    }

    if let Some(e) = &doc.peer_error {
        let _ = writeln!(s, "\n{PEER_HEADING}\n\nNo figures: the peer failed: {e}");
    }

    let _ = writeln!(s, "\n## Pictures\n");
    if let Some(c) = timeline_caption {
        let _ = writeln!(s, "![timeline](timeline.svg)\n\n{c}\n");
    }
    let _ = writeln!(s, "![throughput](throughput.svg)\n");
    let _ = writeln!(s, "## Definitions\n\n{DEFINITIONS}");
    s
}
