//! Issue 73's workload: `point` and `detect` (and a text-only `query` row
//! beside them) with 1, 8 and 32 requests in flight, on a blocking engine
//! and a pipelined one (`PipelineMode::Blocking` / `Pipelined`, otherwise
//! the same configuration), alternated within each round.
//!
//! Each in-flight slot has an image of its own, prefilled once before the
//! clock starts (a one-token query), so the timed requests find the image's
//! rows and prefix KV cached and spend their time in decode steps, where
//! the spatial stage runs and where pipelining can hide the host's commit
//! and plan. Step time is the run's wall over the steps the engine
//! launched (`kestrel_prefill_steps_total` + `kestrel_decode_steps_total`);
//! device idle is the engine's own `kestrel_device_idle_between_steps_seconds`
//! (the CPU runtime's timestamps), averaged over the run's gaps. The
//! prediction is the text bench's cost model from the bubble alone: with
//! the forward unchanged, a pipelined step lasts `T_block - idle_block +
//! idle_pipe`, so `speedup = T_block / (T_block - idle_block + idle_pipe) x
//! (1 - z)`, with z = 0 (the engine's metrics do not count zombie rows).
//! (`kestrel_step_period_seconds` times `run_once` calls, which in pipelined
//! mode are not step periods, so it is not used.)

use std::time::Instant;

use anyhow::{bail, Context as _};
use kestrel_engine::{Engine, GenerateRequest, Prompt, VisionTask};
use serde::Serialize;

use super::BenchImage;

/// What each request of a row asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Kind {
    /// A query of a fixed length (EOS ignored): the text-only row.
    Query,
    Point,
    Detect,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Query, Kind::Point, Kind::Detect];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Query => "query (text)",
            Kind::Point => "point",
            Kind::Detect => "detect",
        }
    }
}

/// Blocking or pipelined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Mode {
    Blocking,
    Pipelined,
}

/// One run: `streams` slots of one kind on one engine.
#[derive(Debug, Clone, Serialize)]
pub struct SpatialRun {
    pub kind: Kind,
    pub mode: Mode,
    pub streams: usize,
    pub rep: usize,
    pub requests: usize,
    pub wall_s: f64,
    pub tokens: usize,
    /// Points or boxes (0 for the query row).
    pub objects: usize,
    /// Steps the engine launched during the run (prefill and decode).
    pub steps: u64,
    pub decode_steps: u64,
    /// The run's wall over its steps, ms.
    pub step_ms: f64,
    /// Mean device idle between consecutive forwards, ms.
    pub idle_ms: f64,
}

impl SpatialRun {
    /// Objects/s for point and detect, tokens/s for the query row: the
    /// rate the row is judged by.
    pub fn rate(&self) -> f64 {
        match self.kind {
            Kind::Query => self.tokens as f64 / self.wall_s,
            _ => self.objects as f64 / self.wall_s,
        }
    }
}

/// The counters and histogram sums a run reads before and after.
#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    prefill_steps: f64,
    idle_sum: f64,
    idle_count: f64,
    decode_steps: f64,
}

fn counters(engine: &Engine) -> Counters {
    let text = engine.metrics_text();
    let get = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    Counters {
        prefill_steps: get("kestrel_prefill_steps_total"),
        idle_sum: get("kestrel_device_idle_between_steps_seconds_sum"),
        idle_count: get("kestrel_device_idle_between_steps_seconds_count"),
        decode_steps: get("kestrel_decode_steps_total"),
    }
}

/// The objects the spatial rows ask for (`point` / `detect`).
pub const OBJECT: &str = "the red ball";

pub struct Workload {
    pub kind: Kind,
    pub streams: usize,
    pub requests_per_stream: usize,
    /// Query: tokens per request; point/detect: the token budget.
    pub max_tokens: u32,
    pub max_objects: u32,
}

fn request(w: &Workload, img: &BenchImage) -> GenerateRequest {
    let (task, ignore_eos, tokens) = match w.kind {
        Kind::Query => (
            VisionTask::Query {
                question: super::QUESTION.into(),
            },
            true,
            w.max_tokens,
        ),
        // x, y (and a size) per object, then EOS.
        Kind::Point => (
            VisionTask::Point {
                object: OBJECT.into(),
                max_objects: Some(w.max_objects),
            },
            false,
            3 * w.max_objects + 1,
        ),
        Kind::Detect => (
            VisionTask::Detect {
                object: OBJECT.into(),
                max_objects: Some(w.max_objects),
            },
            false,
            4 * w.max_objects + 1,
        ),
    };
    GenerateRequest {
        input: Prompt::Vision {
            image: img.png.clone(),
            task,
        },
        ignore_eos,
        ..GenerateRequest::text("unused", tokens)
    }
}

/// Runs `w` on `engine` with `images` (one per slot): first one untimed
/// one-token query per image (its rows and prefix KV cached), then every
/// slot's requests back to back.
pub fn run(
    rt: &tokio::runtime::Runtime,
    engine: &Engine,
    mode: Mode,
    rep: usize,
    w: &Workload,
    images: &[BenchImage],
) -> anyhow::Result<SpatialRun> {
    if images.len() != w.streams {
        bail!("{} images for {} slots", images.len(), w.streams);
    }
    let warm = Workload {
        kind: Kind::Query,
        max_tokens: 1,
        ..*w
    };
    let per_slot: Vec<Vec<GenerateRequest>> = images
        .iter()
        .map(|img| {
            (0..w.requests_per_stream)
                .map(|_| request(w, img))
                .collect()
        })
        .collect();
    rt.block_on(async {
        let warmups: Vec<_> = images
            .iter()
            .map(|img| {
                let engine = engine.clone();
                let req = request(&warm, img);
                tokio::spawn(async move { engine.generate(req).await })
            })
            .collect();
        for t in warmups {
            t.await.context("a warm-up task")??;
        }
        anyhow::Ok(())
    })?;
    let before = counters(engine);
    let t0 = Instant::now();
    let (tokens, objects) = rt.block_on(async {
        let tasks: Vec<_> = per_slot
            .into_iter()
            .map(|reqs| {
                let engine = engine.clone();
                tokio::spawn(async move {
                    let (mut tokens, mut objects) = (0usize, 0usize);
                    for r in reqs {
                        let resp = engine.generate(r).await?;
                        tokens += resp.token_ids.len();
                        objects += resp.objects.as_ref().map_or(0, |o| o.len());
                    }
                    anyhow::Ok((tokens, objects))
                })
            })
            .collect();
        let (mut tokens, mut objects) = (0, 0);
        for t in tasks {
            let (a, b) = t.await.context("a request task")??;
            tokens += a;
            objects += b;
        }
        anyhow::Ok((tokens, objects))
    })?;
    let wall_s = t0.elapsed().as_secs_f64();
    let after = counters(engine);
    let decode_steps = after.decode_steps - before.decode_steps;
    let steps = decode_steps + after.prefill_steps - before.prefill_steps;
    let gaps = after.idle_count - before.idle_count;
    Ok(SpatialRun {
        kind: w.kind,
        mode,
        streams: w.streams,
        rep,
        requests: w.streams * w.requests_per_stream,
        wall_s,
        tokens,
        objects,
        steps: steps as u64,
        decode_steps: decode_steps as u64,
        step_ms: if steps > 0.0 {
            wall_s / steps * 1e3
        } else {
            f64::NAN
        },
        idle_ms: if gaps > 0.0 {
            (after.idle_sum - before.idle_sum) / gaps * 1e3
        } else {
            f64::NAN
        },
    })
}
