//! `cargo xtask bench`: what pipelined decoding measurably buys, on the real
//! engine core (`EngineLoop<CpuRuntime>` or, with `--backend cuda`,
//! `EngineLoop<CudaRuntime>`; the default model, real skills).
//!
//! For each workload (1/8/32 concurrent streams, text only and with a share
//! of JSON-constrained requests) it runs Blocking, Pipelined+Drain and
//! Pipelined+RideAlong in rotation within each repetition, so a noisy machine
//! disturbs all three alike. It prints the Photon step table and cost-model
//! table, writes `results.json`/`results.md` and two SVGs. Cost: minutes on 2
//! cores (`--quick`: well under one).

mod dram;
mod harness;
mod peer;
mod plots;
mod prompt;
pub(crate) mod report;
mod runtime;
mod stats;
mod workload;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use indicatif::{ProgressBar, ProgressStyle};
use kestrel_cpu::runtime::{CpuRuntime, CpuRuntimeConfig, StepConfig};
use kestrel_cpu::{Numerics, WeightPages};
use kestrel_cuda::{CudaRuntime, CudaRuntimeConfig};
use kestrel_model::LoadedModel;
use kestrel_pipeline::{EngineLoop, Executor as _, LoopConfig, Request, SamplingParams, Tick};
use kestrel_skills::{Skill, SkillContext, SkillContextConfig, SkillOptions, SkillSpec};

use self::harness::{BenchEngine, Instrumented, RunData};
use self::runtime::BenchRuntime;
use self::stats::{ConfigResult, CostModelRow};
use self::workload::{EngineConfig, LengthPlan, Mix, PromptSet, Workload};

/// Compute backend of the engine under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    Cpu,
    Cuda,
}

/// The CPU runtime's matmul numerics ([`kestrel_cpu::Numerics`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NumericsArg {
    Exact,
    Fast,
}

impl From<NumericsArg> for Numerics {
    fn from(a: NumericsArg) -> Self {
        match a {
            NumericsArg::Exact => Numerics::Exact,
            NumericsArg::Fast => Numerics::Fast,
        }
    }
}

/// `cargo xtask bench` options.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Short smoke run: 1 and 4 streams, 16 tokens, one repetition.
    #[arg(long)]
    quick: bool,
    /// Compute backend.
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
    /// Matmul threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
    /// Concurrent streams, one workload each (default 1,8,32; quick 1,4).
    #[arg(long, value_delimiter = ',')]
    streams: Option<Vec<usize>>,
    /// Requests each stream runs back to back (default: 4 for one stream, else 2).
    #[arg(long)]
    requests_per_stream: Option<usize>,
    /// Shortest output, tokens (default 100; quick 16).
    #[arg(long)]
    min_tokens: Option<u32>,
    /// Longest output, tokens (default 128; quick 16).
    #[arg(long)]
    max_tokens: Option<u32>,
    /// Repetitions of every configuration (default 2; quick 1).
    #[arg(long)]
    reps: Option<usize>,
    /// Share of JSON-constrained requests in the "+JSON" workloads (0 drops them).
    #[arg(long, default_value_t = 0.25)]
    json_share: f64,
    /// Results directory (default: results/bench-<UTC timestamp>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// GGUF model path, or a synthetic model `synth:SHAPE:TYPE[:SEED]`
    /// (e.g. synth:llama-1b:q4_k_m; made once and cached, see `cargo xtask
    /// synth-model`). Default: the cached default model, fetched if missing.
    #[arg(long)]
    model: Option<String>,
    /// CPU matmul numerics (`KESTREL_ISA` picks the kernel ISA)
    /// [default: fast, the engine's default].
    #[arg(long, value_enum)]
    numerics: Option<NumericsArg>,
    /// CPU: read the weights in place from the file's mapping (4 KiB pages)
    /// instead of copying them onto huge pages (the engine's default).
    #[arg(long)]
    mapped_weights: bool,
    /// Also run a peer engine's benchmark on the same GGUF and threads:
    /// `--peer llama.cpp DIR` (DIR holds `llama-batched-bench`, `llama-bench`;
    /// with `--backend cuda`, a CUDA build, run with `-ngl 99`).
    #[arg(long, num_args = 2, value_names = ["ENGINE", "DIR"])]
    peer: Option<Vec<String>>,
    /// Only the prompt-processing table (pp512, pp4096, time to first token
    /// of a 3072-token prompt; with --peer, llama.cpp's llama-bench on the
    /// same lengths), no decode workloads.
    #[arg(long)]
    prompt_table: bool,
}

/// Validated options.
#[derive(Debug, Clone)]
pub struct Options {
    pub quick: bool,
    pub backend: Backend,
    pub threads: usize,
    pub workloads: Vec<Workload>,
    pub plan: LengthPlan,
    pub reps: usize,
    pub out: PathBuf,
    pub model: Option<String>,
    pub peer: Option<PathBuf>,
    pub numerics: Numerics,
    pub weight_pages: WeightPages,
    pub prompt_table: bool,
}

impl Options {
    fn from_args(a: &BenchArgs) -> anyhow::Result<Self> {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let threads = a.threads.unwrap_or(cores);
        let streams =
            a.streams
                .clone()
                .unwrap_or(if a.quick { vec![1, 4] } else { vec![1, 8, 32] });
        if streams.is_empty() || streams.contains(&0) || streams.iter().any(|&s| s > 64) {
            bail!("--streams must be between 1 and 64, got {streams:?}");
        }
        let (min_default, max_default) = if a.quick { (16, 16) } else { (100, 128) };
        let plan = LengthPlan {
            min_tokens: a.min_tokens.unwrap_or(min_default),
            max_tokens: a.max_tokens.unwrap_or(max_default),
            json_share: a.json_share,
        };
        if plan.min_tokens == 0 || plan.min_tokens > plan.max_tokens || plan.max_tokens > 512 {
            bail!("need 1 <= --min-tokens <= --max-tokens <= 512");
        }
        if !(0.0..=1.0).contains(&plan.json_share) {
            bail!("--json-share must be in 0..=1");
        }
        let mixes: &[Mix] = if plan.json_share > 0.0 {
            &[Mix::Text, Mix::Json]
        } else {
            &[Mix::Text]
        };
        let mut workloads = Vec::new();
        for &s in &streams {
            for &mix in mixes {
                workloads.push(Workload {
                    streams: s,
                    requests_per_stream: a.requests_per_stream.unwrap_or(if s == 1 && !a.quick {
                        4
                    } else {
                        2
                    }),
                    mix,
                });
            }
        }
        let peer = match a.peer.as_deref() {
            None => None,
            Some([engine, dir]) if engine == "llama.cpp" => Some(PathBuf::from(dir)),
            Some([engine, _]) => bail!("unknown peer `{engine}`; supported: llama.cpp"),
            Some(_) => bail!("--peer takes ENGINE DIR"),
        };
        if a.numerics.is_some() && a.backend != Backend::Cpu {
            bail!("--numerics chooses the CPU runtime's matmuls: use it with --backend cpu");
        }
        if a.mapped_weights && a.backend != Backend::Cpu {
            bail!("--mapped-weights places the CPU runtime's weights: use it with --backend cpu");
        }
        Ok(Self {
            quick: a.quick,
            backend: a.backend,
            threads,
            workloads,
            plan,
            reps: a.reps.unwrap_or(if a.quick { 1 } else { 2 }).max(1),
            out: a
                .out
                .clone()
                .unwrap_or_else(|| workspace_root().join("results").join(bench_dir_name())),
            model: a.model.clone(),
            peer,
            numerics: a.numerics.map_or(Numerics::default(), Numerics::from),
            weight_pages: if a.mapped_weights {
                WeightPages::InPlace
            } else {
                WeightPages::Huge
            },
            prompt_table: a.prompt_table,
        })
    }
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// `bench-YYYYMMDD-HHMMSS` (UTC).
pub(crate) fn bench_dir_name() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "bench-{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Timings from a debug build would measure the compiler, not the engine:
/// `cargo xtask` builds in the dev profile, so rebuild and rerun optimized.
/// A full run uses the release profile; `--quick` (a smoke run, e.g. in CI)
/// reuses the `test` profile (opt-level 3), which `cargo test` has built.
pub(crate) fn reexec_optimized(quick: bool) -> anyhow::Result<()> {
    let profile: &[&str] = if quick {
        &["--profile", "test"]
    } else {
        &["--release"]
    };
    eprintln!(
        "cargo xtask bench: rebuilding optimized ({})",
        profile.join(" ")
    );
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = std::process::Command::new(cargo)
        .arg("run")
        .args(profile)
        .args(["--quiet", "--package", "xtask", "--"])
        .args(std::env::args_os().skip(1))
        // The test profile keeps debug assertions on: do not re-exec again.
        .env("KESTREL_BENCH_ALLOW_DEBUG", "1")
        .current_dir(workspace_root())
        .status()
        .context("running cargo for the optimized build")?;
    if !status.success() {
        std::process::exit(status.code().unwrap_or(1));
    }
    Ok(())
}

pub fn main(args: BenchArgs) -> anyhow::Result<()> {
    let opts = Options::from_args(&args)?;
    if cfg!(debug_assertions) && std::env::var_os("KESTREL_BENCH_ALLOW_DEBUG").is_none() {
        return reexec_optimized(args.quick);
    }
    let model_path = match &opts.model {
        Some(m) => match crate::synth_model::SynthModel::parse(m)? {
            Some(synth) => {
                synth.cached(std::thread::available_parallelism().map_or(1, usize::from))?
            }
            None => PathBuf::from(m),
        },
        None => kestrel_model::default_model_path().context("fetching the default model")?,
    };
    eprintln!("loading {}", model_path.display());
    let mut model = kestrel_model::load(&model_path)
        .with_context(|| format!("loading {}", model_path.display()))?;
    // The CPU engines under test share one placement of the weights (each
    // runtime copying them would hold one copy per engine); they read them
    // in place.
    if opts.backend == Backend::Cpu {
        opts.weight_pages
            .place_model(&mut model.weights)
            .context("placing the weights")?;
    }
    let ctx = SkillContext::new(SkillContextConfig {
        tokenizer: Arc::new(model.tokenizer.clone()),
        eos_token_ids: model.eos_token_ids.clone(),
        vocab_size: Some(model.weights.config.vocab_size),
        chat_template: None,
    })
    .context("building the skill context")?;
    let prompts = PromptSet::new(&model, Arc::clone(&ctx))?;
    let max_streams = opts.workloads.iter().map(|w| w.streams).max().unwrap_or(1);
    let bench = Bench {
        opts: &opts,
        model_path: &model_path,
        ctx: &ctx,
        prompts: &prompts,
        max_streams,
    };
    if opts.prompt_table {
        let len = prompt::PROBE_SEQ_LEN;
        return match opts.backend {
            Backend::Cpu => bench.prompt_table(cpu_runtime(&model, &opts, 1, len)?),
            Backend::Cuda => bench.prompt_table(cuda_runtime(&model, 1, len)?),
        };
    }
    match opts.backend {
        Backend::Cpu => bench.run(|| cpu_runtime(&model, &opts, max_streams, MAX_SEQ_LEN)),
        Backend::Cuda => bench.run(|| cuda_runtime(&model, max_streams, MAX_SEQ_LEN)),
    }
}

/// What every configuration's run shares, whatever the runtime.
struct Bench<'a> {
    opts: &'a Options,
    model_path: &'a Path,
    ctx: &'a Arc<SkillContext>,
    prompts: &'a PromptSet,
    /// The most streams any workload runs (the runtimes' row capacity).
    max_streams: usize,
}

impl Bench<'_> {
    /// The prompt-processing table alone ([`prompt`]), on one engine.
    fn prompt_table<R: BenchRuntime>(&self, rt: R) -> anyhow::Result<()> {
        let config = EngineConfig::PipelinedRideAlong;
        let mut engine = build_engine(rt, config, 1, prompt::PROBE_SEQ_LEN)?;
        prompt::run(&mut engine, self.ctx, self.opts, self.model_path)
    }

    /// Build one engine per configuration on runtimes from `make`, run every
    /// workload in rotation, then report.
    fn run<R: BenchRuntime>(
        &self,
        mut make: impl FnMut() -> anyhow::Result<R>,
    ) -> anyhow::Result<()> {
        let Bench {
            opts,
            model_path,
            ctx,
            prompts,
            max_streams,
        } = *self;
        let mut engines = EngineConfig::ALL
            .iter()
            .map(|&c| Ok((c, build_engine(make()?, c, max_streams, MAX_SEQ_LEN)?)))
            .collect::<anyhow::Result<Vec<(EngineConfig, BenchEngine<R>)>>>()?;
        let weight_bytes = engines[0].1.executor().inner.weight_bytes();
        let backend = match opts.backend {
            // The runtimes read the weights where `main` placed them.
            Backend::Cpu => format!(
                "{}, weights {:?}",
                engines[0].1.executor().inner.describe(),
                opts.weight_pages
            ),
            Backend::Cuda => engines[0].1.executor().inner.describe(),
        };
        // Not in the smoke run: it reads a GiB several times. The probe's
        // buffer stays for the one-stream runs, each read beside it.
        let (mut dram, probe) = match engines[0].1.executor().inner.bytes_per_token() {
            Some(resident_bytes_per_token) if !opts.quick => {
                let probe = dram::Probe::new(opts.threads)?;
                let floor = dram::DramFloor {
                    read_bytes_per_s: probe.read(dram::PASSES),
                    threads: opts.threads,
                    file_bytes_per_token: dram::file_bytes_per_token(model_path),
                    resident_bytes_per_token,
                    runs: Vec::new(),
                };
                let one_stream = opts.workloads.iter().any(|w| w.streams == 1);
                (Some(floor), one_stream.then_some(probe))
            }
            _ => (None, None),
        };

        // Warm-up: fault in weights, spin up thread pools; not recorded.
        let warm = Workload {
            streams: 2,
            requests_per_stream: 1,
            mix: Mix::Json,
        };
        let warm_plan = LengthPlan {
            min_tokens: 8,
            max_tokens: 8,
            json_share: 0.5,
        };
        for (_, e) in &mut engines {
            harness::run_workload(e, prompts, &warm, &warm_plan, |_| {})?;
        }

        let total_runs = opts.workloads.len() * EngineConfig::ALL.len() * opts.reps;
        let bar = ProgressBar::new(total_runs as u64).with_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} runs, {msg}",
            )
            .context("progress bar template")?,
        );
        bar.enable_steady_tick(Duration::from_millis(200));
        // runs[workload][config] = one RunData per repetition.
        let mut runs: Vec<Vec<Vec<RunData>>> = opts
            .workloads
            .iter()
            .map(|_| EngineConfig::ALL.iter().map(|_| Vec::new()).collect())
            .collect();
        let mut summaries = Vec::new();
        for rep in 0..opts.reps {
            for (wi, w) in opts.workloads.iter().enumerate() {
                // Rotate the order so no configuration always runs first.
                for k in 0..engines.len() {
                    let ci = (k + rep + wi) % engines.len();
                    let (config, engine) = &mut engines[ci];
                    bar.set_message(format!(
                        "{} | {} | rep {}",
                        w.label(),
                        config.short(),
                        rep + 1
                    ));
                    let mut tokens = 0u64;
                    let mut run = || {
                        harness::run_workload(engine, prompts, w, &opts.plan, |n| tokens += n)
                            .with_context(|| format!("{} on {}", config.label(), w.label()))
                    };
                    let data = match (&probe, &mut dram) {
                        (Some(probe), Some(dram)) if w.streams == 1 => {
                            let (data, read_bytes_per_s) = probe.beside(run);
                            dram.runs.push(dram::ProbedRun {
                                workload: w.label(),
                                config: config.short(),
                                rep,
                                read_bytes_per_s,
                            });
                            data?
                        }
                        _ => run()?,
                    };
                    summaries.push(stats::RunSummary {
                        workload: w.label(),
                        config: *config,
                        rep,
                        wall_s: data.wall_s,
                        tokens: tokens as usize,
                        tokens_per_s: tokens as f64 / data.wall_s,
                    });
                    if bar.is_hidden() {
                        // No terminal (CI logs): one line per run instead of a bar.
                        eprintln!(
                            "[{}/{}] {} | {} | rep {}: {:.1} tokens/s",
                            bar.position() + 1,
                            total_runs,
                            w.label(),
                            config.short(),
                            rep + 1,
                            tokens as f64 / data.wall_s
                        );
                    }
                    runs[wi][ci].push(data);
                    bar.inc(1);
                }
            }
        }
        bar.finish_and_clear();
        drop(probe);

        let mut results: Vec<ConfigResult> = Vec::new();
        let mut model_rows: Vec<CostModelRow> = Vec::new();
        for (wi, w) in opts.workloads.iter().enumerate() {
            let all: Vec<&RunData> = runs[wi].iter().flatten().collect();
            let row_cost = stats::marginal_row_cost(&all);
            let per_config: Vec<ConfigResult> = EngineConfig::ALL
                .iter()
                .enumerate()
                .map(|(ci, &c)| {
                    let reps: Vec<&RunData> = runs[wi][ci].iter().collect();
                    stats::summarize(w, c, &reps, row_cost)
                })
                .collect();
            for pipe in &per_config[1..] {
                model_rows.push(stats::cost_model(&per_config[0], pipe));
            }
            results.extend(per_config);
        }

        // A peer that fails (llama.cpp's AMX build dies on some VMs) must
        // not cost the Kestrel runs above: the report is written without
        // it, saying why, and the bench fails after writing.
        let (mut peer, mut peer_error) = (None, None);
        if let Some(dir) = &opts.peer {
            eprintln!("running llama.cpp from {}", dir.display());
            let ride = pipelined_engine(&mut engines);
            let prefill = prefill_probe(ride, ctx, 512, PROBE_ID)?;
            let mut streams: Vec<usize> = opts.workloads.iter().map(|w| w.streams).collect();
            streams.dedup();
            let gen = (opts.plan.min_tokens + opts.plan.max_tokens) as usize / 2;
            match peer::run_llama_cpp(
                dir,
                model_path,
                opts.threads,
                // llama.cpp's CUDA build with every layer offloaded
                // against our CUDA backend, CPU-only against our CPU one.
                match opts.backend {
                    Backend::Cpu => 0,
                    Backend::Cuda => 99,
                },
                &streams,
                prompts.mean_text_prompt_len().round() as usize,
                gen,
            ) {
                Ok(llama) => peer = Some(report::PeerReport::new(llama, prefill, &results)),
                // Said in the report and in the error returned below.
                Err(e) => peer_error = Some(e),
            }
        }

        let meta = report::Meta::new(opts, model_path, weight_bytes, backend, dram);
        let doc = report::Report {
            meta,
            runs: summaries,
            results,
            cost_model: model_rows,
            peer,
            peer_error: peer_error.as_ref().map(|e| format!("{e:#}")),
        };
        std::fs::create_dir_all(&opts.out)
            .with_context(|| format!("creating {}", opts.out.display()))?;
        let timeline = plots::timeline(opts, &runs, &opts.out.join("timeline.svg"))?;
        plots::throughput(&doc.results, &opts.out.join("throughput.svg"))?;
        let md = report::markdown(&doc, timeline.as_deref());
        report::write_results(&opts.out, &md, &doc, "the peer", peer_error)
    }
}

fn cpu_runtime(
    model: &LoadedModel,
    opts: &Options,
    max_streams: usize,
    max_seq_len: usize,
) -> anyhow::Result<CpuRuntime> {
    CpuRuntime::new(
        model.weights.clone(),
        CpuRuntimeConfig {
            threads: opts.threads,
            step: step_config(max_streams, max_seq_len),
            numerics: opts.numerics,
            // Placed once at load (`main`).
            weight_pages: WeightPages::InPlace,
            ..CpuRuntimeConfig::default()
        },
    )
    .context("starting the CPU runtime")
}

/// Device 0, CUDA graphs on, the same KV geometry as the CPU runtime. Without
/// a driver or device this is the runtime's own error, verbatim.
fn cuda_runtime(
    model: &LoadedModel,
    max_streams: usize,
    max_seq_len: usize,
) -> anyhow::Result<CudaRuntime> {
    CudaRuntime::new(
        model.weights.clone(),
        CudaRuntimeConfig {
            step: step_config(max_streams, max_seq_len),
            ..CudaRuntimeConfig::default()
        },
    )
    .context("starting the CUDA runtime")
}

/// The KV geometry both runtimes are given: `max_streams` rows of up to
/// `max_seq_len` tokens, pages of [`PAGE_SIZE`].
fn step_config(max_streams: usize, max_seq_len: usize) -> StepConfig {
    StepConfig {
        max_rows: max_streams,
        num_pages: num_pages(max_streams, max_seq_len),
        page_size: PAGE_SIZE,
        max_seq_len,
        ..StepConfig::default()
    }
}

const MAX_SEQ_LEN: usize = 1024;
const PAGE_SIZE: usize = 16;

/// Every stream at full length at once, plus slack for prefix-cached pages.
fn num_pages(max_streams: usize, max_seq_len: usize) -> usize {
    max_streams * max_seq_len / PAGE_SIZE + 64
}

fn build_engine<R: BenchRuntime>(
    rt: R,
    config: EngineConfig,
    max_streams: usize,
    max_seq_len: usize,
) -> anyhow::Result<BenchEngine<R>> {
    let engine = EngineLoop::new(
        Instrumented {
            inner: rt,
            observer: harness::WaitTimer::default(),
        },
        LoopConfig {
            mode: config.mode(),
            prefill_policy: config.prefill_policy(),
            max_batch_size: max_streams,
            max_waiting: 1024,
            max_seq_len,
            // The tables measure whole-prompt prefill (pp512 is one step).
            prefill_chunk: None,
            debug_checks: false,
        },
    )
    .context("building the engine loop")?;
    // The capabilities the engine drives, read through the timing wrapper:
    // every workload's streams must fit the runtime's rows at once.
    let rows = engine.executor().capabilities().max_rows;
    if rows < max_streams {
        bail!(
            "the runtime holds {rows} sequences at once; the workloads run {max_streams} streams"
        );
    }
    Ok(engine)
}

fn pipelined_engine<R: BenchRuntime>(
    engines: &mut [(EngineConfig, BenchEngine<R>)],
) -> &mut BenchEngine<R> {
    let i = engines
        .iter()
        .position(|(c, _)| *c == EngineConfig::PipelinedRideAlong)
        .unwrap_or(0);
    &mut engines[i].1
}

/// Submit `prompt` as request `id` for one greedy token and run the engine
/// until it is idle again (`what` names the probe in the error).
fn one_token<R: BenchRuntime>(
    engine: &mut BenchEngine<R>,
    id: u64,
    prompt: Vec<u32>,
    skill: Skill,
    what: &str,
) -> anyhow::Result<()> {
    engine.submit(Request {
        embeds: None,
        id,
        prompt,
        max_new_tokens: 1,
        params: SamplingParams::greedy(),
        speculate: None,
        skill: Box::new(skill),
    })?;
    if engine.run_until_idle() != Tick::Idle {
        bail!("{what} did not finish");
    }
    Ok(())
}

/// The first request id of the prefill probes (`prefill_probe` takes three
/// from its `first_id`; the prompt table's probes follow ten apart,
/// [`prompt::probe_id`]).
const PROBE_ID: u64 = 9_000_000;

/// The `len`-token prompt of probe request `id`: tokens in `500..vocab -
/// 500`, the first decided by `id`, so that the prompts of different
/// requests share no prefix (the prompt table's 64-token warm-up was once
/// the head of its pp512 prompts, and its pp512 prompts the head of its
/// pp4096 ones: the prefix cache took 64 and 512 tokens off the forwards
/// those rates were computed for, 14% too fast).
fn probe_prompt(len: usize, vocab: usize, id: u64) -> Vec<u32> {
    let span = vocab as u64 - 1000;
    (0..len as u64)
        .map(|i| ((i * 2_654_435_761 + id * 97 + 1000) % span) as u32 + 500)
        .collect()
}

/// Prompt-processing rate: median of three prefills of `len` fresh tokens
/// (no prefix-cache hits: [`probe_prompt`]), forward time only; requests
/// `first_id..+3`.
fn prefill_probe<R: BenchRuntime>(
    engine: &mut BenchEngine<R>,
    ctx: &Arc<SkillContext>,
    len: usize,
    first_id: u64,
) -> anyhow::Result<f64> {
    let vocab = engine.executor().vocab_size();
    let mut rates = Vec::new();
    for salt in 0..3u64 {
        let prompt = probe_prompt(len, vocab, first_id + salt);
        let skill = Skill::new(ctx, &SkillSpec::text(), SkillOptions::default())?;
        engine
            .executor_mut()
            .inner
            .record_timings(true)
            .context("recording step timings")?;
        one_token(engine, first_id + salt, prompt, skill, "prefill probe")?;
        let mut t = Vec::new();
        engine.executor_mut().inner.drain_timings(&mut t);
        engine
            .executor_mut()
            .inner
            .record_timings(false)
            .context("recording step timings")?;
        let step = t
            .iter()
            .find(|s| s.prefill)
            .context("no prefill step recorded")?;
        let secs = (step.forward_end - step.forward_start).as_secs_f64();
        rates.push(len as f64 / secs);
    }
    rates.sort_by(f64::total_cmp);
    Ok(rates[1])
}
