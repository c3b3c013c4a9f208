//! `cargo xtask chunked-prefill`: what chunked prefill buys the streams
//! already decoding when a long prompt arrives.
//!
//! On the real engine core (`EngineLoop<CpuRuntime>`, the default model):
//! `--streams` sequences decode (EOS ignored) until each has a few tokens,
//! then one `--prompt-tokens` prompt arrives. Recorded per configuration
//! (whole-prompt prefill and each `--chunks` budget, run in rotation within
//! each repetition so a noisy machine disturbs all alike): the running
//! streams' inter-token gaps while the long prompt is prefilled (p50, p99,
//! max) and the long prompt's time to first token.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use crate::engine_core::{default_model, iterate, threads, Clock, Mode};
use kestrel_cpu::runtime::{CpuRuntime, CpuRuntimeConfig, StepConfig};
use kestrel_cpu::WeightPages;
use kestrel_pipeline::{
    EngineLoop, LoopConfig, PipelineMode, PrefillPolicy, Request, SamplingParams, Tick,
};

/// `cargo xtask chunked-prefill` options.
#[derive(Debug, clap::Args)]
pub struct ChunkedArgs {
    /// Streams decoding when the long prompt arrives.
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// Length of the arriving prompt, tokens.
    #[arg(long, default_value_t = 4096)]
    prompt_tokens: usize,
    /// Chunk budgets to compare with whole-prompt prefill.
    #[arg(long, value_delimiter = ',', default_value = "256,512")]
    chunks: Vec<usize>,
    /// Repetitions of every configuration.
    #[arg(long, default_value_t = 2)]
    reps: usize,
    /// Matmul threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
    /// Launch/commit overlap.
    #[arg(long, value_enum, default_value_t = Mode::Pipelined)]
    mode: Mode,
    /// Smoke run (CI): 2 streams, a 300-token prompt, chunks of 64, one
    /// repetition, built in the test profile `cargo test` already built.
    #[arg(long)]
    quick: bool,
}

/// One run's figures, milliseconds.
#[derive(Debug, Clone, Copy)]
struct RunFigures {
    /// Inter-token gaps of the running streams during the long prefill.
    gap_p50: f64,
    gap_p99: f64,
    gap_max: f64,
    /// Tokens the running streams committed during it.
    tokens_during: usize,
    ttft: f64,
}

pub fn main(mut args: ChunkedArgs) -> anyhow::Result<()> {
    if cfg!(debug_assertions) && std::env::var_os("KESTREL_BENCH_ALLOW_DEBUG").is_none() {
        return crate::bench::reexec_optimized(args.quick);
    }
    if args.quick {
        args.streams = 2;
        args.prompt_tokens = 300;
        args.chunks = vec![64];
        args.reps = 1;
    }
    if args.streams == 0 || args.prompt_tokens < 2 || args.reps == 0 {
        bail!("need --streams >= 1, --prompt-tokens >= 2, --reps >= 1");
    }
    let model = default_model()?;
    let max_seq_len = args.prompt_tokens + 2048;
    if max_seq_len > model.weights.config.max_position_embeddings {
        bail!(
            "--prompt-tokens {} does not fit the model's context of {}",
            args.prompt_tokens,
            model.weights.config.max_position_embeddings
        );
    }
    let text = "The river ran past the old mill, under the stone bridge and on towards \
                the sea, where the boats waited for the morning tide. ";
    let enc = model
        .tokenizer
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
    let unit = enc.get_ids();
    let long: Vec<u32> = unit
        .iter()
        .copied()
        .cycle()
        .take(args.prompt_tokens)
        .collect();
    let threads = threads(args.threads);
    let mode = PipelineMode::from(args.mode);
    let mut configs: Vec<Option<NonZeroUsize>> = vec![None];
    configs.extend(args.chunks.iter().map(|&c| NonZeroUsize::new(c)));
    configs.dedup();
    // Placed once for the engines below (each runtime placing them would
    // hold a copy per engine); they read them in place.
    let mut weights = model.weights.clone();
    WeightPages::default()
        .place_model(&mut weights)
        .context("placing the weights")?;
    let mut engines = configs
        .iter()
        .map(|&chunk| {
            let rt = CpuRuntime::new(
                weights.clone(),
                CpuRuntimeConfig {
                    threads,
                    step: StepConfig {
                        max_rows: args.streams + 1,
                        num_pages: (args.streams + 1) * max_seq_len.div_ceil(16) + 8,
                        page_size: 16,
                        max_seq_len,
                        // No prefix cache: every repetition prefills the whole prompt.
                        enable_prefix_cache: false,
                        ..StepConfig::default()
                    },
                    weight_pages: WeightPages::InPlace,
                    ..CpuRuntimeConfig::default()
                },
            )
            .context("starting the CPU runtime")?;
            EngineLoop::new(
                rt,
                LoopConfig {
                    mode,
                    prefill_policy: PrefillPolicy::RideAlong,
                    max_batch_size: args.streams + 1,
                    max_waiting: 16,
                    max_seq_len,
                    prefill_chunk: chunk,
                    debug_checks: false,
                },
            )
            .context("building the engine loop")
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    eprintln!(
        "{} streams decoding, then a {}-token prompt; {threads} threads, {mode:?}",
        args.streams, args.prompt_tokens
    );
    let mut results: Vec<Vec<RunFigures>> = vec![Vec::new(); configs.len()];
    for rep in 0..args.reps {
        for k in 0..configs.len() {
            let ci = (k + rep) % configs.len();
            let f = run_once(&mut engines[ci], unit, &long, args.streams)?;
            eprintln!(
                "rep {} {:>6}: gaps p50 {:.0} ms p99 {:.0} ms max {:.0} ms, {} tokens during, TTFT {:.0} ms",
                rep + 1,
                label(configs[ci]),
                f.gap_p50,
                f.gap_p99,
                f.gap_max,
                f.tokens_during,
                f.ttft
            );
            results[ci].push(f);
        }
    }
    println!(
        "| prefill | running streams' gap p50 | p99 | max | their tokens during the prefill | long prompt TTFT |"
    );
    println!("|---|---|---|---|---|---|");
    for (c, runs) in configs.iter().zip(&results) {
        let mean = |f: fn(&RunFigures) -> f64| runs.iter().map(f).sum::<f64>() / runs.len() as f64;
        println!(
            "| {} | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} | {:.2} s |",
            label(*c),
            mean(|f| f.gap_p50),
            mean(|f| f.gap_p99),
            mean(|f| f.gap_max),
            mean(|f| f.tokens_during as f64),
            mean(|f| f.ttft) / 1e3
        );
    }
    Ok(())
}

fn label(chunk: Option<NonZeroUsize>) -> String {
    chunk.map_or_else(|| "whole".into(), |c| format!("{c}"))
}

/// Start the streams, let them decode, send the long prompt, measure until
/// its first token, then cancel everything and drain.
fn run_once(
    engine: &mut EngineLoop<CpuRuntime>,
    short: &[u32],
    long: &[u32],
    streams: usize,
) -> anyhow::Result<RunFigures> {
    let clocks: Vec<Arc<Mutex<Vec<Instant>>>> = (0..=streams).map(|_| Arc::default()).collect();
    // Running streams never run out of tokens first; the long prompt needs one.
    let request =
        |id: u64, prompt: &[u32], max_new_tokens, clock: &Arc<Mutex<Vec<Instant>>>| Request {
            embeds: None,
            id,
            prompt: prompt.to_vec(),
            max_new_tokens,
            params: SamplingParams::greedy(),
            speculate: None,
            skill: Box::new(Clock {
                times: Arc::clone(clock),
            }),
        };
    for (i, clock) in clocks[..streams].iter().enumerate() {
        engine
            .submit(request(i as u64, short, 2000, clock))
            .map_err(|e| anyhow::anyhow!("submitting stream {i}: {e}"))?;
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    let decoding = |c: &[Arc<Mutex<Vec<Instant>>>]| {
        c[..streams]
            .iter()
            .all(|t| t.lock().expect("clock lock").len() >= 4)
    };
    while !decoding(&clocks) {
        step(engine, deadline)?;
    }
    let long_clock = &clocks[streams];
    let sent = Instant::now();
    engine
        .submit(request(streams as u64, long, 1, long_clock))
        .map_err(|e| anyhow::anyhow!("submitting the long prompt: {e}"))?;
    while long_clock.lock().expect("clock lock").is_empty() {
        step(engine, deadline)?;
    }
    let first = long_clock.lock().expect("clock lock")[0];
    // Each running stream's gap that straddles the prompt's first token
    // ends with its next token: wait for it.
    let resumed = |c: &[Arc<Mutex<Vec<Instant>>>]| {
        c[..streams].iter().all(|t| {
            t.lock()
                .expect("clock lock")
                .last()
                .is_some_and(|&l| l > first)
        })
    };
    while !resumed(&clocks) {
        step(engine, deadline)?;
    }
    for id in 0..=streams as u64 {
        engine.abort(id);
    }
    while engine.run_once() == Tick::Progress {}
    // Gaps between consecutive tokens of each running stream from its last
    // token before the prompt arrived to its first after the prompt's first
    // token (both straddling gaps counted).
    let mut gaps = Vec::new();
    let mut during = 0;
    for clock in &clocks[..streams] {
        let times = clock.lock().expect("clock lock");
        let last_before = times.iter().rposition(|&t| t <= sent).unwrap_or(0);
        for w in times[last_before..].windows(2) {
            if w[0] >= first {
                break;
            }
            gaps.push(w[1].duration_since(w[0]).as_secs_f64() * 1e3);
        }
        during += times.iter().filter(|&&t| t > sent && t <= first).count();
    }
    if gaps.is_empty() {
        bail!("no running stream committed a token during the prefill");
    }
    gaps.sort_by(f64::total_cmp);
    let pct = |p: f64| gaps[((gaps.len() - 1) as f64 * p).round() as usize];
    Ok(RunFigures {
        gap_p50: pct(0.5),
        gap_p99: pct(0.99),
        gap_max: *gaps.last().expect("non-empty"),
        tokens_during: during,
        ttft: first.duration_since(sent).as_secs_f64() * 1e3,
    })
}

fn step(engine: &mut EngineLoop<CpuRuntime>, deadline: Instant) -> anyhow::Result<()> {
    if iterate(engine, deadline)? == Tick::Idle {
        bail!("the engine went idle with requests running");
    }
    Ok(())
}
