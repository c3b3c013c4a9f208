//! The Moondream bench's results: every round's figures of both engines
//! (`results.json`) and the tables (`results.md`): medians over rounds,
//! each with its range, Kestrel beside the floor and their ratio.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::kestrel::median;
use super::spatial::{Kind, Mode, SpatialRun};
use super::Options;

/// Encode time of one image of `crops` crops (median of the round's encodes).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EncodeRow {
    pub crops: usize,
    pub seconds: f64,
}

/// `streams` requests in flight, each on its own image.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConcurrencyRow {
    pub streams: usize,
    pub requests: usize,
    pub wall_s: f64,
    pub requests_per_s: f64,
    pub tokens_per_s: f64,
}

/// One engine's figures in one round (the floor writes the same shape).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Figures {
    pub engine: String,
    pub encode: Vec<EncodeRow>,
    /// A query on a new image: request in to first token (Kestrel: PNG
    /// bytes in; the floor: crops in).
    pub ttft_cold_s: f64,
    /// A second question on the same image (its encoded rows and prefix KV kept).
    pub ttft_cached_s: f64,
    /// One sequence's tokens/s after its first token.
    pub decode_tokens_per_s: f64,
    pub concurrency: Vec<ConcurrencyRow>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Round {
    pub rep: usize,
    /// Which engine ran first (they alternate by round).
    pub order: Vec<String>,
    pub kestrel: Option<Figures>,
    pub floor: Option<Figures>,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub command: String,
    pub commit: Option<String>,
    pub unix_time: u64,
    pub cpu: Option<String>,
    /// The ISA flags `lscpu` would show that matter here.
    pub cpu_flags: Vec<String>,
    pub cores: usize,
    /// `/proc/loadavg`'s 1-minute load at the start and at the end: on a
    /// shared machine, what else was running.
    pub load_start: Option<f64>,
    pub load_end: Option<f64>,
    pub options: Options,
    pub checkpoint: String,
    /// `text dim/layers, vision dim/layers` of the checkpoint.
    pub shape: String,
    pub weight_bytes: u64,
    /// Image side(s) of each crop count's encode image.
    pub encode_images: Vec<(usize, u32, u32)>,
    pub rounds: Vec<Round>,
    /// The point/detect table's runs (blocking and pipelined).
    pub spatial: Vec<SpatialRun>,
    /// Why the floor gave no figures, if it failed.
    pub floor_error: Option<String>,
}

/// `avx2`, `avx512f`, `avx512_vnni`, `avx512_bf16`, `amx_tile`, ... as
/// `/proc/cpuinfo` lists them.
fn cpu_flags() -> Vec<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = info
        .lines()
        .find_map(|l| l.strip_prefix("flags")?.split_once(':'))
        .map(|(_, f)| f.split_whitespace().collect::<Vec<_>>())
        .unwrap_or_default();
    [
        "avx2",
        "fma",
        "avx512f",
        "avx512_vnni",
        "avx512_bf16",
        "amx_tile",
        "amx_int8",
        "amx_bf16",
    ]
    .iter()
    .filter(|f| flags.contains(f))
    .map(|f| f.to_string())
    .collect()
}

/// The 1-minute load average.
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

impl Report {
    #[allow(clippy::too_many_arguments)] // one call, in `main`
    pub fn new(
        opts: &Options,
        load_start: Option<f64>,
        ckpt: &Path,
        loaded: &kestrel_model::LoadedModel,
        sizes: &[(usize, u32, u32)],
        rounds: Vec<Round>,
        spatial: Vec<SpatialRun>,
        floor_error: &Option<anyhow::Error>,
    ) -> Self {
        let commit = std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .current_dir(crate::bench::workspace_root())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
        let shape = loaded.vision.as_ref().map_or_else(String::new, |v| {
            let (t, e) = (&v.config.text, &v.config.vision);
            format!(
                "text {} wide x {} layers (ff {}), vision {} wide x {} layers (ff {}), projector {}",
                t.dim, t.n_layers, t.ff_dim, e.enc_dim, e.enc_n_layers, e.enc_ff_dim,
                e.proj_inner_dim
            )
        });
        Self {
            command: format!(
                "cargo xtask {}",
                std::env::args().skip(1).collect::<Vec<_>>().join(" ")
            ),
            commit,
            unix_time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            cpu: crate::bench::report::cpu_model(),
            cpu_flags: cpu_flags(),
            cores: std::thread::available_parallelism().map_or(1, usize::from),
            load_start,
            load_end: load_average(),
            options: opts.clone(),
            checkpoint: ckpt.display().to_string(),
            shape,
            weight_bytes: std::fs::metadata(ckpt.join("model.safetensors")).map_or(0, |m| m.len()),
            encode_images: sizes.to_vec(),
            rounds,
            spatial,
            floor_error: floor_error.as_ref().map(|e| format!("{e:#}")),
        }
    }
}

/// Median and range of `f` over the rounds where `pick` has figures.
fn over_rounds(
    doc: &Report,
    pick: impl Fn(&Round) -> Option<&Figures>,
    f: impl Fn(&Figures) -> Option<f64>,
) -> Option<(f64, f64, f64)> {
    let mut v: Vec<f64> = doc
        .rounds
        .iter()
        .filter_map(|r| pick(r).and_then(&f))
        .collect();
    if v.is_empty() {
        return None;
    }
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    Some((median(&mut v), lo, hi))
}

fn cell(x: Option<(f64, f64, f64)>, scale: f64, digits: usize) -> String {
    match x {
        None => "-".into(),
        Some((m, lo, hi)) if (hi - lo) * scale >= 10f64.powi(-(digits as i32)) => format!(
            "{:.d$} ({:.d$}-{:.d$})",
            m * scale,
            lo * scale,
            hi * scale,
            d = digits
        ),
        Some((m, _, _)) => format!("{:.d$}", m * scale, d = digits),
    }
}

/// Kestrel over the floor where larger is better (`higher`), else floor
/// over Kestrel: above 1, Kestrel is ahead.
fn ratio(k: Option<(f64, f64, f64)>, f: Option<(f64, f64, f64)>, higher: bool) -> String {
    match (k, f) {
        (Some((k, ..)), Some((f, ..))) if k > 0.0 && f > 0.0 => {
            format!("{:.2}", if higher { k / f } else { f / k })
        }
        _ => "-".into(),
    }
}

pub fn markdown(doc: &Report) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    fn kest(r: &Round) -> Option<&Figures> {
        r.kestrel.as_ref()
    }
    fn flr(r: &Round) -> Option<&Figures> {
        r.floor.as_ref()
    }
    let o = &doc.options;
    let _ = writeln!(s, "# Moondream: Kestrel against a PyTorch floor\n");
    let _ = writeln!(s, "- Command: `{}`", doc.command);
    let _ = writeln!(
        s,
        "- Commit: {}; unix time {}",
        doc.commit.as_deref().unwrap_or("unknown"),
        doc.unix_time
    );
    let _ = writeln!(
        s,
        "- Machine: {}, {} cores; flags: {}",
        doc.cpu.as_deref().unwrap_or("unknown CPU"),
        doc.cores,
        if doc.cpu_flags.is_empty() {
            "none of AVX2/AVX-512/AMX".into()
        } else {
            doc.cpu_flags.join(" ")
        }
    );
    let load = |l: Option<f64>| l.map_or("?".into(), |l| format!("{l:.1}"));
    let _ = writeln!(
        s,
        "- Load average (1 min) at start / end: {} / {}",
        load(doc.load_start),
        load(doc.load_end)
    );
    let _ = writeln!(
        s,
        "- Checkpoint: {} ({:.1} MB; {})",
        doc.checkpoint,
        doc.weight_bytes as f64 / 1e6,
        doc.shape
    );
    let engines: Vec<&str> = doc
        .rounds
        .iter()
        .flat_map(|r| [r.kestrel.as_ref(), r.floor.as_ref()])
        .flatten()
        .map(|f| f.engine.as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let _ = writeln!(s, "- Engines: {}", engines.join("; "));
    let _ = writeln!(
        s,
        "- {} round(s), engines alternated; each cell is the median over rounds (range in brackets)",
        doc.rounds.len()
    );
    match (
        &doc.floor_error,
        doc.rounds.iter().any(|r| r.floor.is_some()),
    ) {
        (Some(e), _) => {
            let _ = writeln!(s, "\n**No floor figures: the PyTorch floor failed:** {e}");
        }
        (None, false) => {
            let _ = writeln!(
                s,
                "\nNo floor: pass `--torch PYTHON` (a Python with torch, numpy, safetensors)."
            );
        }
        _ => {}
    }

    let _ = writeln!(
        s,
        "\n## Image encode (encoder + projector), ms\n\n| crops | image | Kestrel | PyTorch | PyTorch / Kestrel |\n|---:|---|---:|---:|---:|"
    );
    for (i, &(crops, w, h)) in doc.encode_images.iter().enumerate() {
        let get = |f: &Figures| f.encode.get(i).map(|e| e.seconds);
        let (k, f) = (over_rounds(doc, kest, get), over_rounds(doc, flr, get));
        let _ = writeln!(
            s,
            "| {crops} | {w}x{h} | {} | {} | {} |",
            cell(k, 1e3, 1),
            cell(f, 1e3, 1),
            ratio(k, f, false)
        );
    }

    let _ = writeln!(
        s,
        "\n## One query\n\n| figure | Kestrel | PyTorch | Kestrel ahead by |\n|---|---:|---:|---:|"
    );
    /// A row: name, the figure, its scale, whether larger is better.
    type Row = (&'static str, fn(&Figures) -> Option<f64>, f64, bool);
    let rows: [Row; 3] = [
        (
            "time to first token, new image (ms)",
            |f| Some(f.ttft_cold_s),
            1e3,
            false,
        ),
        (
            "time to first token, same image again (ms)",
            |f| Some(f.ttft_cached_s),
            1e3,
            false,
        ),
        (
            "decode tokens/s, one sequence",
            |f| Some(f.decode_tokens_per_s),
            1.0,
            true,
        ),
    ];
    for (name, get, scale, higher) in rows {
        let (k, f) = (over_rounds(doc, kest, get), over_rounds(doc, flr, get));
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {} |",
            cell(k, scale, 1),
            cell(f, scale, 1),
            ratio(k, f, higher)
        );
    }

    let _ = writeln!(
        s,
        "\n## Requests in flight, each on its own image ({} tokens each, {} per slot)\n\n| in flight | requests/s Kestrel | requests/s PyTorch | ratio | tokens/s Kestrel | tokens/s PyTorch |\n|---:|---:|---:|---:|---:|---:|",
        o.max_tokens, o.requests_per_stream
    );
    for (i, &c) in o.streams.iter().enumerate() {
        let rps = |f: &Figures| f.concurrency.get(i).map(|c| c.requests_per_s);
        let tps = |f: &Figures| f.concurrency.get(i).map(|c| c.tokens_per_s);
        let (k, f) = (over_rounds(doc, kest, rps), over_rounds(doc, flr, rps));
        let _ = writeln!(
            s,
            "| {c} | {} | {} | {} | {} | {} |",
            cell(k, 1.0, 2),
            cell(f, 1.0, 2),
            ratio(k, f, true),
            cell(over_rounds(doc, kest, tps), 1.0, 1),
            cell(over_rounds(doc, flr, tps), 1.0, 1)
        );
    }
    let _ = writeln!(
        s,
        "\nKestrel's request figures include PNG decoding, cropping and hashing \
         (a request arrives as PNG bytes); the floor is handed Kestrel's crops. \
         The floor batches statically (a wave of `in flight` requests encoded, \
         prefilled and decoded together); Kestrel admits continuously."
    );
    if !doc.spatial.is_empty() {
        spatial_markdown(doc, &mut s);
    }
    s
}

/// Median of `f` over the runs of one kind, slot count and mode.
fn spatial_median(
    doc: &Report,
    kind: Kind,
    streams: usize,
    mode: Mode,
    f: impl Fn(&SpatialRun) -> f64,
) -> f64 {
    let mut v: Vec<f64> = doc
        .spatial
        .iter()
        .filter(|r| r.kind == kind && r.streams == streams && r.mode == mode)
        .map(f)
        .collect();
    median(&mut v)
}

fn spatial_markdown(doc: &Report, s: &mut String) {
    use std::fmt::Write as _;
    let o = &doc.options;
    let _ = writeln!(
        s,
        "\n## Point and detect: blocking against pipelined\n\n\
         Each slot asks about its own image, whose rows and prefix KV were \
         cached before the clock started; point/detect ask for `{}` with at \
         most {} objects, the query row generates {} tokens; {} requests per \
         slot. Rate: objects/s (point, detect) or tokens/s (query). Step: the \
         run's wall over the steps the engine launched; device idle: the mean \
         gap between forwards (the CPU runtime's timestamps, the engine's \
         metric). Predicted: the cost model from the bubble, \
         `T_block / (T_block - idle_block + idle_pipe) x (1 - z) - 1` with z = 0 \
         (the engine's metrics do not count zombie rows); observed: pipelined \
         rate over blocking - 1. Medians over rounds.\n",
        super::spatial::OBJECT,
        o.max_objects,
        o.max_tokens,
        o.requests_per_stream
    );
    let _ = writeln!(
        s,
        "| kind | in flight | rate, blocking | rate, pipelined | objects per run | tokens per run | step ms, blocking | step ms, pipelined | idle ms, blocking | idle ms, pipelined | predicted | observed |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for &streams in &o.streams {
        for kind in Kind::ALL {
            let m =
                |mode: Mode, f: fn(&SpatialRun) -> f64| spatial_median(doc, kind, streams, mode, f);
            let (rb, rp) = (
                m(Mode::Blocking, SpatialRun::rate),
                m(Mode::Pipelined, SpatialRun::rate),
            );
            let (tb, tp) = (
                m(Mode::Blocking, |r| r.step_ms),
                m(Mode::Pipelined, |r| r.step_ms),
            );
            let (ib, ip) = (
                m(Mode::Blocking, |r| r.idle_ms),
                m(Mode::Pipelined, |r| r.idle_ms),
            );
            let objects = m(Mode::Pipelined, |r| r.objects as f64);
            let tokens = m(Mode::Pipelined, |r| r.tokens as f64);
            let unit = if kind == Kind::Query { " tok/s" } else { "" };
            let _ = writeln!(
                s,
                "| {} | {streams} | {rb:.2}{unit} | {rp:.2}{unit} | {objects:.0} | {tokens:.0} | {tb:.2} | {tp:.2} | {ib:.3} | {ip:.3} | {:+.1}% | {:+.1}% |",
                kind.name(),
                (tb / (tb - ib + ip) - 1.0) * 100.0,
                (rp / rb - 1.0) * 100.0
            );
        }
    }
}
