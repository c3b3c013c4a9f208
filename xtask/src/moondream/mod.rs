//! `cargo xtask moondream-bench`: Moondream on the real engine
//! (`kestrel_engine::Engine` on the CPU backend: image decoding, crops, the
//! encoded-image cache, the prefix cache, the query skill) against a
//! PyTorch float32 floor (`scripts/bench/moondream_torch.py`: the published
//! architecture, batched and KV-cached) on the same machine, in the same
//! run, the two alternated round by round (`--reps` rounds; the first
//! engine of a round alternates too).
//!
//! Measured per engine and round: image-encode time per crop count, a
//! query's time to first token on a new image and on one already seen,
//! one sequence's decode tokens/s, and requests/s with 1, 8 and 32
//! requests in flight, each on an image of its own. The checkpoint is a
//! Hugging Face Moondream directory (`--model DIR`) or a synthetic one
//! (`--model synth:SHAPE[:SEED]`, `moondream_synth.py --served --shape
//! SHAPE`, cached). Then issue 73's table (`spatial.rs`): point, detect
//! and a text-only query with the same slots in flight, blocking against
//! pipelined, objects/s, step time and device idle, and the text bench's
//! cost-model prediction beside the observation. Cost: minutes on 2 cores at the `bench` shape
//! (`--quick`: the tiny shape, no floor, well under a minute).

mod floor;
mod kestrel;
mod report;
mod spatial;

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context as _};
use kestrel_model::vision::{PreparedImage, RgbImage};

use crate::bench::{bench_dir_name, workspace_root, NumericsArg};

/// `cargo xtask moondream-bench` options.
#[derive(Debug, clap::Args)]
pub struct MoondreamArgs {
    /// Smoke run: the tiny synthetic checkpoint, 1 and 4 requests in
    /// flight, 4 tokens, one round.
    #[arg(long)]
    quick: bool,
    /// A Moondream checkpoint directory (`model.safetensors`,
    /// `config.json`, `tokenizer.json`), or `synth:SHAPE[:SEED]` (SHAPE
    /// `tiny`, `bench` or `moondream2`: `moondream_synth.py --served`,
    /// written once into ~/.cache/kestrel). Default: synth:bench (quick:
    /// synth:tiny).
    #[arg(long)]
    model: Option<String>,
    /// A Python with torch, numpy and safetensors: runs the PyTorch floor
    /// (default: `$KESTREL_TORCH_PYTHON`; neither: no floor, said in the
    /// report).
    #[arg(long)]
    torch: Option<PathBuf>,
    /// A Python with numpy, for writing a synthetic checkpoint (default
    /// `$KESTREL_PYTHON`, else python3).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Compute threads of both engines (default: every core).
    #[arg(long)]
    threads: Option<usize>,
    /// Requests in flight, one row each (default 1,8,32; quick 1,4).
    #[arg(long, value_delimiter = ',')]
    streams: Option<Vec<usize>>,
    /// Requests each in-flight slot runs back to back (default 2).
    #[arg(long)]
    requests_per_stream: Option<usize>,
    /// Tokens each request of the concurrency rows generates (default 16;
    /// quick 4).
    #[arg(long)]
    max_tokens: Option<u32>,
    /// Tokens of the decode-rate request (default 64; quick 8).
    #[arg(long)]
    decode_tokens: Option<u32>,
    /// Rounds, each engine once per round, alternated (default 2; quick 1).
    #[arg(long)]
    reps: Option<usize>,
    /// Crop counts of the encode table (global crop + tiles; each from the
    /// smallest image whose tiling gives it; with 12 tiles at most, 2, 7-11
    /// and 13 occur; default 2,9,10,13; quick 2,10).
    #[arg(long, value_delimiter = ',')]
    crops: Option<Vec<usize>>,
    /// Skip the point/detect table (blocking against pipelined).
    #[arg(long)]
    no_spatial: bool,
    /// Objects a point/detect request may return (default 8; quick 2).
    #[arg(long)]
    max_objects: Option<u32>,
    /// Kestrel's CPU matmul numerics [default: fast, the engine's default].
    #[arg(long, value_enum)]
    numerics: Option<NumericsArg>,
    /// Results directory (default: results/moondream-<UTC timestamp>).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Validated options.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Options {
    pub quick: bool,
    pub model: String,
    #[serde(skip)]
    pub torch: Option<PathBuf>,
    #[serde(skip)]
    pub python: PathBuf,
    pub threads: usize,
    pub streams: Vec<usize>,
    pub requests_per_stream: usize,
    pub max_tokens: u32,
    pub decode_tokens: u32,
    pub reps: usize,
    pub crops: Vec<usize>,
    pub spatial: bool,
    pub max_objects: u32,
    #[serde(skip)]
    pub numerics: kestrel_engine::Numerics,
    pub out: PathBuf,
}

impl Options {
    fn from_args(a: &MoondreamArgs) -> anyhow::Result<Self> {
        let q = a.quick;
        let streams = a
            .streams
            .clone()
            .unwrap_or(if q { vec![1, 4] } else { vec![1, 8, 32] });
        if streams.is_empty() || streams.iter().any(|&s| s == 0 || s > 64) {
            bail!("--streams must be between 1 and 64, got {streams:?}");
        }
        let crops = a
            .crops
            .clone()
            .unwrap_or(if q { vec![2, 10] } else { vec![2, 9, 10, 13] });
        if crops.iter().any(|&c| !(2..=13).contains(&c)) {
            bail!("--crops: an image is 2 to 13 crops (global + 1..12 tiles), got {crops:?}");
        }
        let max_tokens = a.max_tokens.unwrap_or(if q { 4 } else { 16 });
        let decode_tokens = a.decode_tokens.unwrap_or(if q { 8 } else { 64 });
        if !(1..=512).contains(&max_tokens) || !(2..=512).contains(&decode_tokens) {
            bail!("need 1 <= --max-tokens <= 512 and 2 <= --decode-tokens <= 512");
        }
        let env_path = |k: &str| std::env::var_os(k).map(PathBuf::from);
        Ok(Self {
            quick: q,
            model: a
                .model
                .clone()
                .unwrap_or_else(|| if q { "synth:tiny" } else { "synth:bench" }.into()),
            torch: a.torch.clone().or_else(|| env_path("KESTREL_TORCH_PYTHON")),
            python: a
                .python
                .clone()
                .or_else(|| env_path("KESTREL_PYTHON"))
                .unwrap_or_else(|| "python3".into()),
            threads: crate::engine_core::threads(a.threads),
            streams,
            requests_per_stream: a.requests_per_stream.unwrap_or(2).max(1),
            max_tokens,
            decode_tokens,
            reps: a.reps.unwrap_or(if q { 1 } else { 2 }).max(1),
            crops,
            spatial: !a.no_spatial,
            max_objects: a.max_objects.unwrap_or(if q { 2 } else { 8 }).clamp(1, 256),
            numerics: a
                .numerics
                .map_or(kestrel_engine::Numerics::default(), Into::into),
            out: a.out.clone().unwrap_or_else(|| {
                workspace_root()
                    .join("results")
                    .join(bench_dir_name().replacen("bench-", "moondream-", 1))
            }),
        })
    }
}

/// `synth:SHAPE[:SEED]` written (once) into the cache, or a directory.
fn checkpoint(opts: &Options) -> anyhow::Result<PathBuf> {
    let Some(spec) = opts.model.strip_prefix("synth:") else {
        let dir = PathBuf::from(&opts.model);
        if !dir.join("model.safetensors").is_file() {
            bail!("{} holds no model.safetensors", dir.display());
        }
        return Ok(dir);
    };
    let (shape, seed) = spec.split_once(':').unwrap_or((spec, "7"));
    if !["tiny", "bench", "moondream2"].contains(&shape) {
        bail!("synth:{shape}: the shapes are tiny, bench and moondream2");
    }
    let seed: u64 = seed.parse().context("synth:SHAPE:SEED takes a number")?;
    let cache = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join(".cache/kestrel");
    let dir = cache.join(format!("moondream-synth-{shape}-seed{seed}-v1"));
    if dir.join("model.safetensors").is_file() {
        return Ok(dir);
    }
    let partial = cache.join(format!("moondream-synth-{shape}-seed{seed}-v1.partial"));
    eprintln!(
        "writing a synthetic Moondream ({shape}) into {}",
        dir.display()
    );
    let status = Command::new(&opts.python)
        .arg(workspace_root().join("scripts/reference/moondream_synth.py"))
        .arg(&partial)
        .args(["--served", "--shape", shape, "--seed", &seed.to_string()])
        .args(if shape == "moondream2" {
            &["--dtype", "BF16"][..]
        } else {
            &[]
        })
        .status()
        .with_context(|| format!("running {} (numpy)", opts.python.display()))?;
    if !status.success() {
        bail!("moondream_synth.py failed ({status})");
    }
    std::fs::rename(&partial, &dir).context("moving the checkpoint into place")?;
    Ok(dir)
}

/// A picture of `w` x `h` whose pixels follow from `seed`: each byte a
/// SplitMix64 hash of (seed, index), so distinct seeds give distinct images
/// (and content hashes). A hash mixing the seed into only a few bits of
/// each pixel once made every 256th image the same, and the bench measured
/// the prefix cache instead of the encoder.
pub(crate) fn picture(w: u32, h: u32, seed: u32) -> RgbImage {
    let px = (0..u64::from(w * h * 3))
        .map(|i| {
            let mut x = (u64::from(seed) << 32 | i).wrapping_add(0x9E37_79B9_7F4A_7C15);
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((x ^ (x >> 31)) >> 56) as u8
        })
        .collect();
    RgbImage::from_raw(w, h, px).expect("w x h x 3 bytes")
}

/// For each wanted crop count, the smallest image (in pixels, sides in
/// steps of one patch) whose tiling gives it under `geometry`. With the
/// published 12-tile limit only 2, 7-11 and 13 crops occur (the tiling
/// spreads toward 12 tiles: a 392 x 392 image is cut 3 x 3).
fn sizes_for_crops(
    wanted: &[usize],
    geometry: &kestrel_model::vision::CropGeometry,
) -> anyhow::Result<Vec<(usize, u32, u32)>> {
    let crop = geometry.crop_size as u32;
    let step = geometry.patch_size as u32;
    let mut found: Vec<(usize, u32, u32)> = Vec::new();
    for h in (crop..5 * crop).step_by(step as usize) {
        for w in (crop..10 * crop).step_by(step as usize) {
            let t = kestrel_model::vision::select_tiling(
                i64::from(h) - 2 * (geometry.overlap_margin * geometry.patch_size) as i64,
                i64::from(w) - 2 * (geometry.overlap_margin * geometry.patch_size) as i64,
                ((geometry.crop_size / geometry.patch_size - 2 * geometry.overlap_margin)
                    * geometry.patch_size) as i64,
                geometry.max_crops as i64,
            );
            let n = t.tiles() + 1;
            match found.iter_mut().find(|f| f.0 == n) {
                Some(f) if u64::from(f.1) * u64::from(f.2) > u64::from(w) * u64::from(h) => {
                    *f = (n, w, h)
                }
                Some(_) => {}
                None => found.push((n, w, h)),
            }
        }
    }
    wanted
        .iter()
        .map(|&n| {
            found.iter().find(|f| f.0 == n).copied().with_context(|| {
                let have: Vec<usize> = found.iter().map(|f| f.0).collect();
                format!("no image gives {n} crops; these do: {have:?}")
            })
        })
        .collect()
}

/// An image prepared both ways: the PNG a request sends and the crops the
/// floor encodes (Kestrel's own cut, so both encode the same pixels).
pub(crate) struct BenchImage {
    pub png: Vec<u8>,
    pub prepared: PreparedImage,
}

impl BenchImage {
    fn new(w: u32, h: u32, seed: u32, geometry: &kestrel_model::vision::CropGeometry) -> Self {
        let img = picture(w, h, seed);
        Self {
            png: img.to_png(),
            prepared: PreparedImage::new(&img, geometry),
        }
    }
}

/// The images of one round, fresh for each engine (no cache carries over).
pub(crate) struct RoundImages {
    /// One per crop count of the encode table.
    pub encode: Vec<BenchImage>,
    /// The query probes: a new image each (cold, then asked again).
    pub query: Vec<BenchImage>,
    /// The decode-rate request's image.
    pub decode: BenchImage,
    /// Per concurrency row, per stream, per request.
    pub concurrency: Vec<Vec<Vec<BenchImage>>>,
    /// Per concurrency row, one per slot: the point/detect table's images
    /// (each slot asks about its own image; every kind and mode of the
    /// round asks about the same ones).
    pub spatial: Vec<Vec<BenchImage>>,
}

/// Query probes per round (the median is reported).
pub(crate) const QUERY_PROBES: usize = 3;
/// Encodes per crop count per round (the median is reported).
pub(crate) const ENCODE_REPS: usize = 3;
/// The side of the concurrency rows' images (one tile: 2 crops).
const REQUEST_SIDE: u32 = 378;

fn round_images(
    opts: &Options,
    sizes: &[(usize, u32, u32)],
    geometry: &kestrel_model::vision::CropGeometry,
    seed: &mut u32,
) -> RoundImages {
    let mut next = |w: u32, h: u32| {
        *seed += 1;
        BenchImage::new(w, h, *seed, geometry)
    };
    let s = REQUEST_SIDE;
    RoundImages {
        encode: sizes.iter().map(|&(_, w, h)| next(w, h)).collect(),
        query: (0..QUERY_PROBES).map(|_| next(s, s)).collect(),
        decode: next(s, s),
        concurrency: opts
            .streams
            .iter()
            .map(|&c| {
                (0..c)
                    .map(|_| (0..opts.requests_per_stream).map(|_| next(s, s)).collect())
                    .collect()
            })
            .collect(),
        spatial: if opts.spatial {
            opts.streams
                .iter()
                .map(|&c| (0..c).map(|_| next(s, s)).collect())
                .collect()
        } else {
            Vec::new()
        },
    }
}

/// The questions of the query probes: the first on a new image, the second
/// on the same image (its encoded rows and prefix KV kept).
pub(crate) const QUESTION: &str = "What is in this picture?";
pub(crate) const SECOND_QUESTION: &str = "What colour is it?";

pub fn main(args: MoondreamArgs) -> anyhow::Result<()> {
    let opts = Options::from_args(&args)?;
    if cfg!(debug_assertions) && std::env::var_os("KESTREL_BENCH_ALLOW_DEBUG").is_none() {
        return crate::bench::reexec_optimized(args.quick);
    }
    let ckpt = checkpoint(&opts)?;
    eprintln!("loading {}", ckpt.display());
    let loaded =
        kestrel_model::load(&ckpt).with_context(|| format!("loading {}", ckpt.display()))?;
    let Some(vision) = loaded.vision.as_ref() else {
        bail!("{} is not a vision model", ckpt.display());
    };
    let geometry = vision.config.vision.crop_geometry();
    let sizes = sizes_for_crops(&opts.crops, &geometry)?;
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("creating {}", opts.out.display()))?;

    let load_start = report::load_average();
    let mut kestrel = kestrel::KestrelBench::start(&opts, &ckpt, &loaded)?;
    let floor = match &opts.torch {
        Some(python) => Some(floor::Floor::new(python, &ckpt, &opts)?),
        None => None,
    };
    let mut seed = 0u32;
    let mut rounds = Vec::new();
    let mut spatial_runs = Vec::new();
    let mut floor_error = None;
    for rep in 0..opts.reps {
        let images = round_images(&opts, &sizes, &geometry, &mut seed);
        let torch_first = rep % 2 == 1;
        let mut round = report::Round {
            rep,
            order: Vec::new(),
            kestrel: None,
            floor: None,
        };
        for turn in 0..2 {
            if (turn == 0) == torch_first {
                if let (Some(f), None) = (&floor, &floor_error) {
                    eprintln!("round {}: PyTorch floor", rep + 1);
                    round.order.push("pytorch".into());
                    match f.run(&images, &kestrel.prompts, rep) {
                        Ok(fig) => round.floor = Some(fig),
                        Err(e) => floor_error = Some(e),
                    }
                }
            } else {
                eprintln!("round {}: Kestrel", rep + 1);
                round.order.push("kestrel".into());
                round.kestrel = Some(kestrel.run(&images)?);
            }
        }
        rounds.push(round);
        if opts.spatial {
            eprintln!("round {}: point / detect, blocking and pipelined", rep + 1);
            spatial_runs.extend(kestrel.spatial(&images, rep)?);
        }
    }
    kestrel.shutdown();

    let doc = report::Report::new(
        &opts,
        load_start,
        &ckpt,
        &loaded,
        &sizes,
        rounds,
        spatial_runs,
        &floor_error,
    );
    let md = report::markdown(&doc);
    crate::bench::report::write_results(&opts.out, &md, &doc, "the PyTorch floor", floor_error)
}

/// Where the floor's files of round `rep` go.
pub(crate) fn floor_dir(opts: &Options, rep: usize) -> PathBuf {
    opts.out.join(format!("floor-round{}", rep + 1))
}
