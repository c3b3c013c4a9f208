//! `cargo xtask speculate`: what prompt-lookup speculative decoding buys,
//! and what it costs where there is nothing to look up.
//!
//! On the real engine core (`EngineLoop<CpuRuntime>`, the default model,
//! greedy, EOS ignored): each workload runs with
//! speculation off and with each `--drafts` setting, for each `--streams`
//! count, in rotation within every repetition (a noisy machine disturbs all
//! alike). Workloads: `edit` (copy a block of code with one change),
//! `quote` (repeat a passage), `chat` (a story: little to look up).
//! Recorded: decode tokens/s over all streams while every one of them is
//! decoding (tokens committed from the last stream's first token to the
//! first stream's last, over that time; the streams share their prompt, so
//! the prefix cache makes all but one prefill short), and the drafts
//! proposed and accepted.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use crate::engine_core::{default_model, iterate, threads, Clock, Mode};
use kestrel_cpu::runtime::{CpuRuntime, CpuRuntimeConfig, StepConfig};

use crate::bench::NumericsArg;
use kestrel_pipeline::{
    EngineLoop, LoopConfig, NgramSpec, PipelineMode, PipelineStats, PrefillPolicy, Request,
    SamplingParams, Tick,
};

/// `cargo xtask speculate` options.
#[derive(Debug, clap::Args)]
pub struct SpeculateArgs {
    /// Concurrent streams (each runs the workload's prompt).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    streams: Vec<usize>,
    /// Draft tokens per step to compare with no speculation.
    #[arg(long, value_delimiter = ',', default_value = "4,8")]
    drafts: Vec<usize>,
    /// Tokens each stream generates.
    #[arg(long, default_value_t = 160)]
    tokens: u32,
    /// Repetitions of every configuration.
    #[arg(long, default_value_t = 2)]
    reps: usize,
    /// Matmul threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
    /// Launch/commit overlap.
    #[arg(long, value_enum, default_value_t = Mode::Pipelined)]
    mode: Mode,
    /// CPU matmul numerics.
    #[arg(long, value_enum, default_value_t = NumericsArg::Fast)]
    numerics: NumericsArg,
    /// Smoke run (CI): one stream, 24 tokens, 4 drafts, one repetition,
    /// built in the test profile `cargo test` already built.
    #[arg(long)]
    quick: bool,
}

const CODE: &str = "fn area(width: f64, height: f64) -> f64 {\n    let a = width * height;\n    \
    assert!(a >= 0.0);\n    a\n}\n\nfn perimeter(width: f64, height: f64) -> f64 {\n    \
    let p = 2.0 * (width + height);\n    assert!(p >= 0.0);\n    p\n}\n\nfn diagonal(width: f64, \
    height: f64) -> f64 {\n    let d = (width * width + height * height).sqrt();\n    d\n}\n\n\
    fn scale(width: f64, height: f64, k: f64) -> (f64, f64) {\n    (width * k, height * k)\n}\n";

const PASSAGE: &str = "The lighthouse stood on the northern cliff for two hundred years. Its \
    keepers climbed one hundred and twelve steps each evening to light the lamp, and each \
    morning they climbed them again to put it out. Ships passing in the night counted its \
    flashes, three short and one long, and knew where they were. When the electric lamp came, \
    the last keeper stayed on for a year to teach the engineers the moods of the sea.";

/// The workloads: name and prompt text.
fn workloads() -> [(&'static str, String); 3] {
    [
        (
            "edit",
            format!(
                "{CODE}\nHere is the same code with every f64 changed to f32:\n\nfn area(width: f32"
            ),
        ),
        (
            "quote",
            format!("{PASSAGE}\n\nRepeat the passage above word for word.\n\nThe lighthouse"),
        ),
        (
            "chat",
            "Write a short story about a dragon who learns to cook soup for the village.\n\n"
                .to_string(),
        ),
    ]
}

/// One run's figures.
#[derive(Debug, Clone, Copy, Default)]
struct Figures {
    tok_s: f64,
    drafted: u64,
    accepted: u64,
}

pub fn main(mut args: SpeculateArgs) -> anyhow::Result<()> {
    if cfg!(debug_assertions) && std::env::var_os("KESTREL_BENCH_ALLOW_DEBUG").is_none() {
        return crate::bench::reexec_optimized(args.quick);
    }
    if args.quick {
        args.streams = vec![1];
        args.drafts = vec![4];
        args.tokens = 24;
        args.reps = 1;
    }
    if args.streams.contains(&0) || args.tokens < 2 || args.reps == 0 {
        bail!("need --streams >= 1, --tokens >= 2, --reps >= 1");
    }
    let model = default_model()?;
    let threads = threads(args.threads);
    let mode = PipelineMode::from(args.mode);
    let max_streams = *args.streams.iter().max().expect("non-empty");
    let max_seq_len = 2048;
    let rt = CpuRuntime::new(
        model.weights.clone(),
        CpuRuntimeConfig {
            threads,
            step: StepConfig {
                max_rows: max_streams,
                num_pages: max_streams * max_seq_len / 16 + 8,
                page_size: 16,
                max_seq_len,
                // The streams share their prompt: prefilled once, decoding
                // starts together.
                enable_prefix_cache: true,
                ..StepConfig::default()
            },
            numerics: args.numerics.into(),
            ..CpuRuntimeConfig::default()
        },
    )
    .context("starting the CPU runtime")?;
    let mut engine = EngineLoop::new(
        rt,
        LoopConfig {
            mode,
            prefill_policy: PrefillPolicy::RideAlong,
            max_batch_size: max_streams,
            max_waiting: 64,
            max_seq_len,
            prefill_chunk: None,
            debug_checks: false,
        },
    )
    .context("building the engine loop")?;
    let mut specs: Vec<Option<usize>> = vec![None];
    specs.extend(args.drafts.iter().map(|&k| Some(k)));
    eprintln!(
        "{threads} threads, {mode:?}, {:?} numerics, {} tokens per stream, isa {:?}",
        args.numerics,
        args.tokens,
        engine.executor().isa()
    );
    let mut next_id = 0;
    println!("| workload | streams | speculation | decode tok/s | vs off | drafts accepted |");
    println!("|---|---:|---|---:|---:|---:|");
    for (name, text) in workloads() {
        let prompt = model
            .tokenizer
            .encode(text.as_str(), true)
            .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?
            .get_ids()
            .to_vec();
        for &streams in &args.streams {
            let mut results: Vec<Vec<Figures>> = vec![Vec::new(); specs.len()];
            for rep in 0..args.reps {
                for k in 0..specs.len() {
                    let si = (k + rep) % specs.len();
                    let f = run_once(
                        &mut engine,
                        &prompt,
                        streams,
                        args.tokens,
                        specs[si],
                        &mut next_id,
                    )?;
                    eprintln!(
                        "rep {} {name} x{streams} {}: {:.1} tok/s, {}/{} drafts accepted",
                        rep + 1,
                        label(specs[si]),
                        f.tok_s,
                        f.accepted,
                        f.drafted
                    );
                    results[si].push(f);
                }
            }
            let mean =
                |runs: &[Figures]| runs.iter().map(|f| f.tok_s).sum::<f64>() / runs.len() as f64;
            let off = mean(&results[0]);
            for (spec, runs) in specs.iter().zip(&results) {
                let (drafted, accepted) = runs
                    .iter()
                    .fold((0, 0), |(d, a), f| (d + f.drafted, a + f.accepted));
                let rate = match drafted {
                    0 => "-".to_string(),
                    d => format!(
                        "{accepted}/{d} ({:.0}%)",
                        100.0 * accepted as f64 / d as f64
                    ),
                };
                println!(
                    "| {name} | {streams} | {} | {:.1} | {:.2}x | {rate} |",
                    label(*spec),
                    mean(runs),
                    mean(runs) / off
                );
            }
        }
    }
    Ok(())
}

fn label(spec: Option<usize>) -> String {
    spec.map_or_else(|| "off".into(), |k| format!("ngram:{k}"))
}

/// Runs `streams` copies of `prompt` to `tokens` tokens each.
fn run_once(
    engine: &mut EngineLoop<CpuRuntime>,
    prompt: &[u32],
    streams: usize,
    tokens: u32,
    spec: Option<usize>,
    next_id: &mut u64,
) -> anyhow::Result<Figures> {
    let before = engine.stats();
    let clocks: Vec<Arc<Mutex<Vec<Instant>>>> = (0..streams).map(|_| Arc::default()).collect();
    for clock in &clocks {
        let req = Request {
            embeds: None,
            id: *next_id,
            prompt: prompt.to_vec(),
            max_new_tokens: tokens,
            params: SamplingParams::greedy(),
            speculate: spec.map(NgramSpec::new),
            skill: Box::new(Clock {
                times: Arc::clone(clock),
            }),
        };
        *next_id += 1;
        engine
            .submit(req)
            .map_err(|e| anyhow::anyhow!("submitting: {e}"))?;
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    while iterate(engine, deadline)? == Tick::Progress {}
    let times: Vec<Vec<Instant>> = clocks
        .iter()
        .map(|c| c.lock().expect("clock lock").clone())
        .collect();
    if times.iter().any(|t| t.len() != tokens as usize) {
        bail!("a stream ended early");
    }
    // The window in which every stream is decoding.
    let first = times.iter().map(|t| t[0]).max().expect("streams >= 1");
    let last = times
        .iter()
        .map(|t| t[t.len() - 1])
        .min()
        .expect("streams >= 1");
    if last <= first {
        bail!("the streams never all decoded at once: raise --tokens");
    }
    let decoded = times
        .iter()
        .flatten()
        .filter(|&&t| t > first && t <= last)
        .count() as f64;
    let after: PipelineStats = engine.stats();
    Ok(Figures {
        tok_s: decoded / last.duration_since(first).as_secs_f64().max(1e-9),
        drafted: after.draft_tokens - before.draft_tokens,
        accepted: after.accepted_drafts - before.accepted_drafts,
    })
}
