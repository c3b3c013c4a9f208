//! Turns recorded runs into the numbers the bench reports: steady-state step
//! medians, throughput, latency percentiles and the Photon cost model.
//!
//! Definitions (also printed with the results):
//! - steady state: decode steps after the first 3 of a run whose batch holds
//!   at least 3/4 of the workload's streams (no warm-up, no ramp-down);
//! - period: forward start to the next decode forward's start, both steady;
//! - device idle: `forward_start[t+1] - sample_end[t]` (gap on the compute stream);
//! - scheduler busy: time inside `run_once` minus time blocked in `wait_step`,
//!   per committed step;
//! - z (zombie tax): device time spent on zombie rows over all decode device
//!   time; a step of zombies only costs its whole time, a zombie row riding in
//!   a live batch costs the marginal per-row forward time (a least-squares fit
//!   of forward time against batch rows over the workload's decode steps).

use serde::Serialize;

use super::harness::{Kind, RunData, StepRecord};
use super::workload::{EngineConfig, Workload};

/// Percentiles of a sample, in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Dist {
    pub n: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Dist {
    pub fn of_seconds(xs: &[f64]) -> Self {
        let mut v: Vec<f64> = xs.iter().map(|x| x * 1e3).collect();
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        Self {
            n: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: quantile(&v, 0.5),
            p90: quantile(&v, 0.9),
            p99: quantile(&v, 0.99),
        }
    }
}

/// Linear-interpolated quantile of a sorted, non-empty slice.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let pos = q * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

fn median(xs: &[f64]) -> f64 {
    Dist::of_seconds(xs).p50
}

/// One run (workload x configuration x repetition), summarized.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub workload: String,
    pub config: EngineConfig,
    pub rep: usize,
    pub wall_s: f64,
    pub tokens: usize,
    pub tokens_per_s: f64,
}

/// All repetitions of one configuration on one workload.
#[derive(Debug, Clone, Serialize)]
pub struct ConfigResult {
    pub workload: String,
    pub streams: usize,
    pub config: EngineConfig,
    pub reps: usize,
    pub requests: usize,
    pub wall_s: f64,
    pub tokens: usize,
    pub tokens_per_s: f64,
    /// Mean generated length per request.
    pub mean_len: f64,
    pub prompt_tokens: usize,
    pub prefill_steps: usize,
    pub decode_steps: usize,
    pub decode_rows: u64,
    pub zombie_rows: u64,
    /// Decode steps whose rows were all zombies (a wholly wasted forward).
    pub zombie_only_steps: usize,
    pub masked_steps: u64,
    pub steady_steps: usize,
    pub forward_ms: f64,
    pub sampling_ms: f64,
    pub period_ms: f64,
    pub device_idle_ms: f64,
    /// Mean device idle between steady decode steps: includes the rare long
    /// stalls (scheduler thread preempted on a shared machine) medians hide.
    pub device_idle_mean_ms: f64,
    /// Mean scheduler busy time per committed step.
    pub sched_busy_ms: f64,
    /// Device busy (forward + sampling) over wall time.
    pub device_busy_share: f64,
    /// Device seconds spent in decode and in prefill steps.
    pub decode_device_s: f64,
    pub prefill_device_s: f64,
    /// Device seconds spent on zombie rows (see the module docs).
    pub zombie_device_s: f64,
    pub ttft_ms: Dist,
    pub itl_ms: Dist,
    /// Throughput of each repetition, in run order.
    pub rep_tokens_per_s: Vec<f64>,
}

impl ConfigResult {
    /// Steady decode tokens/s: batch rows per period.
    pub fn steady_decode_tokens_per_s(&self) -> f64 {
        if self.period_ms > 0.0 {
            self.streams as f64 / (self.period_ms / 1e3)
        } else {
            0.0
        }
    }

    pub fn zombie_share(&self) -> f64 {
        if self.decode_device_s > 0.0 {
            self.zombie_device_s / self.decode_device_s
        } else {
            0.0
        }
    }
}

fn dur(x: (f64, f64)) -> f64 {
    x.1 - x.0
}

fn device_time(s: &StepRecord) -> f64 {
    dur(s.forward) + dur(s.sample)
}

/// Marginal forward seconds per batch row: least squares over decode steps.
pub fn marginal_row_cost(runs: &[&RunData]) -> Option<f64> {
    let pts: Vec<(f64, f64)> = runs
        .iter()
        .flat_map(|r| r.steps.iter())
        .filter(|s| s.kind == Kind::Decode)
        .map(|s| (s.rows as f64, dur(s.forward)))
        .collect();
    let n = pts.len() as f64;
    if pts.len() < 2 {
        return None;
    }
    let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
    let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| (sxy / sxx).max(0.0))
}

/// Indices of steady-state decode steps of one run.
fn steady(run: &RunData, streams: usize) -> Vec<bool> {
    let min_rows = (streams * 3).div_ceil(4);
    let mut seen = 0;
    run.steps
        .iter()
        .map(|s| {
            if s.kind != Kind::Decode {
                return false;
            }
            seen += 1;
            seen > 3 && s.rows >= min_rows
        })
        .collect()
}

/// Summarize one configuration's repetitions of a workload.
pub fn summarize(
    w: &Workload,
    config: EngineConfig,
    runs: &[&RunData],
    row_cost_s: Option<f64>,
) -> ConfigResult {
    let mut fwd = Vec::new();
    let mut samp = Vec::new();
    let mut period = Vec::new();
    let mut idle = Vec::new();
    let (mut wall, mut busy_sched, mut committed) = (0.0, 0.0, 0usize);
    let (mut dec_dev, mut pre_dev, mut zombie_dev) = (0.0, 0.0, 0.0);
    let (mut prefill_steps, mut decode_steps, mut zombie_only, mut steady_n) = (0, 0, 0, 0);
    let (mut ttft, mut itl, mut lengths) = (Vec::new(), Vec::new(), Vec::new());
    let (mut zombie_rows, mut decode_rows, mut masked, mut prompt_tokens) = (0, 0, 0, 0);
    let mut rep_tps = Vec::new();
    for run in runs {
        let st = steady(run, w.streams);
        for (i, s) in run.steps.iter().enumerate() {
            match s.kind {
                Kind::Prefill => {
                    prefill_steps += 1;
                    pre_dev += device_time(s);
                }
                Kind::Decode => {
                    decode_steps += 1;
                    dec_dev += device_time(s);
                    if s.zombie_rows > 0 && s.zombie_rows >= s.rows {
                        zombie_only += 1;
                        zombie_dev += device_time(s);
                    } else if s.zombie_rows > 0 {
                        let per_row = row_cost_s.unwrap_or(dur(s.forward) / s.rows as f64);
                        zombie_dev += s.zombie_rows as f64 * per_row;
                    }
                }
            }
            if !st[i] {
                continue;
            }
            steady_n += 1;
            fwd.push(dur(s.forward));
            samp.push(dur(s.sample));
            if let (Some(next), Some(true)) = (run.steps.get(i + 1), st.get(i + 1)) {
                period.push(next.forward.0 - s.forward.0);
                idle.push(next.forward.0 - s.sample.1);
            }
        }
        wall += run.wall_s;
        let ticks: f64 = run.ticks.iter().map(|&t| dur(t)).sum();
        let waits: f64 = run.waits.iter().map(|&t| dur(t)).sum();
        busy_sched += ticks - waits;
        committed += run.steps.len();
        ttft.extend_from_slice(&run.ttft_s);
        itl.extend_from_slice(&run.itl_s);
        lengths.extend_from_slice(&run.lengths);
        zombie_rows += run.zombie_rows;
        decode_rows += run.decode_rows;
        masked += run.masked_steps;
        prompt_tokens += run.prompt_tokens;
        rep_tps.push(run.lengths.iter().sum::<usize>() as f64 / run.wall_s);
    }
    let tokens: usize = lengths.iter().sum();
    ConfigResult {
        workload: w.label(),
        streams: w.streams,
        config,
        reps: runs.len(),
        requests: lengths.len(),
        wall_s: wall,
        tokens,
        tokens_per_s: tokens as f64 / wall,
        mean_len: tokens as f64 / lengths.len().max(1) as f64,
        prompt_tokens,
        prefill_steps,
        decode_steps,
        decode_rows,
        zombie_rows,
        zombie_only_steps: zombie_only,
        masked_steps: masked,
        steady_steps: steady_n,
        forward_ms: median(&fwd),
        sampling_ms: median(&samp),
        period_ms: median(&period),
        device_idle_ms: median(&idle),
        device_idle_mean_ms: Dist::of_seconds(&idle).mean,
        sched_busy_ms: busy_sched * 1e3 / committed.max(1) as f64,
        device_busy_share: (dec_dev + pre_dev) / wall,
        decode_device_s: dec_dev,
        prefill_device_s: pre_dev,
        zombie_device_s: zombie_dev,
        ttft_ms: Dist::of_seconds(&ttft),
        itl_ms: Dist::of_seconds(&itl),
        rep_tokens_per_s: rep_tps,
    }
}

/// One row of the cost-model table: a pipelined configuration against blocking.
#[derive(Debug, Clone, Serialize)]
pub struct CostModelRow {
    pub workload: String,
    pub config: EngineConfig,
    pub t_block_ms: f64,
    pub t_pipe_ms: f64,
    /// Blocking device idle over blocking period: what there is to hide.
    pub block_bubble: f64,
    pub mean_len: f64,
    pub z: f64,
    /// `T_block / T_pipe x (1 - z) - 1`, in percent.
    pub predicted_pct: f64,
    /// Pipelined over blocking throughput - 1, in percent.
    pub observed_pct: f64,
    /// Share of the blocking wall spent in decode steps (the part the model speaks about).
    pub decode_share: f64,
    /// The prediction if only the decode share of the wall speeds up.
    pub prefill_aware_pct: f64,
    /// Observed speedup of each repetition (pipelined and blocking of the same round).
    pub rep_observed_pct: Vec<f64>,
    /// Why prediction and observation differ, when they differ by more than 3 points.
    pub note: Option<String>,
}

pub fn cost_model(block: &ConfigResult, pipe: &ConfigResult) -> CostModelRow {
    let z = pipe.zombie_share();
    let factor = block.period_ms / pipe.period_ms * (1.0 - z);
    let predicted_pct = (factor - 1.0) * 100.0;
    let observed_pct = (pipe.tokens_per_s / block.tokens_per_s - 1.0) * 100.0;
    // Decode wall in blocking: one period per decode step.
    let decode_share =
        (block.decode_steps as f64 * block.period_ms / 1e3 / block.wall_s).clamp(0.0, 1.0);
    let prefill_aware = 1.0 / (decode_share / factor + (1.0 - decode_share));
    let prefill_aware_pct = (prefill_aware - 1.0) * 100.0;
    let rep_observed_pct: Vec<f64> = pipe
        .rep_tokens_per_s
        .iter()
        .zip(&block.rep_tokens_per_s)
        .map(|(p, b)| (p / b - 1.0) * 100.0)
        .collect();
    let mut why = Vec::new();
    if (predicted_pct - observed_pct).abs() > 3.0 {
        if decode_share < 0.9 {
            why.push(format!(
                "decode is {:.0}% of the blocking wall (prefill, ramp-down are the rest); \
                 speeding up only that part predicts {:+.1}%",
                decode_share * 100.0,
                prefill_aware_pct
            ));
        }
        if rep_observed_pct.len() > 1 {
            let lo = rep_observed_pct
                .iter()
                .copied()
                .fold(f64::INFINITY, f64::min);
            let hi = rep_observed_pct
                .iter()
                .copied()
                .fold(f64::NEG_INFINITY, f64::max);
            if hi - lo > 3.0 {
                why.push(format!(
                    "repetitions range {lo:+.1}%..{hi:+.1}%: machine noise"
                ));
            }
        }
        if pipe.period_ms > 0.0 && pipe.forward_ms + pipe.sampling_ms < 0.9 * pipe.period_ms {
            why.push(format!(
                "pipelined period {:.2} ms exceeds forward + sampling {:.2} ms: \
                 the bubble is not fully hidden",
                pipe.period_ms,
                pipe.forward_ms + pipe.sampling_ms
            ));
        }
        let drift = pipe.forward_ms / block.forward_ms - 1.0;
        if drift.abs() > 0.03 {
            // The pipeline does not change the forward: a different forward
            // time is the machine's load moving under the runs.
            let bubble_only = (block.period_ms
                / (block.period_ms - block.device_idle_ms + pipe.device_idle_ms)
                * (1.0 - z)
                - 1.0)
                * 100.0;
            why.push(format!(
                "the forward itself differs by {:+.0}% (machine load, not the pipeline); \
                 from the bubble alone the model predicts {bubble_only:+.2}%",
                drift * 100.0
            ));
        }
        if block.device_idle_mean_ms > 3.0 * block.device_idle_ms.max(0.01) {
            why.push(format!(
                "blocking idle is {:.2} ms on average vs {:.3} ms median: scheduler-thread \
                 stalls (preemption on a shared machine) that pipelining hides",
                block.device_idle_mean_ms, block.device_idle_ms
            ));
        }
        if why.is_empty() {
            why.push("unexplained by prefill share, noise or bubble; see results.json".into());
        }
    }
    CostModelRow {
        workload: pipe.workload.clone(),
        config: pipe.config,
        t_block_ms: block.period_ms,
        t_pipe_ms: pipe.period_ms,
        block_bubble: if block.period_ms > 0.0 {
            block.device_idle_ms / block.period_ms
        } else {
            0.0
        },
        mean_len: pipe.mean_len,
        z,
        predicted_pct,
        observed_pct,
        decode_share,
        prefill_aware_pct,
        rep_observed_pct,
        note: (!why.is_empty()).then(|| why.join("; ")),
    }
}
