//! Engine configuration ([`EngineConfig`]) and start-up progress events.
//!
//! Raw knobs as the CLI/server gives them; [`crate::Engine::start`] resolves
//! them once into a `LoopConfig` and a runtime config (the model's context
//! length fills `max_seq_len: None`).

use std::path::PathBuf;

use kestrel_cpu::{Numerics, WeightPages};
use kestrel_pipeline::{PipelineMode, PrefillPolicy};

/// Where the model comes from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ModelSource {
    /// The default model (SmolLM2-135M-Instruct Q4_1), fetched into the cache on first use.
    #[default]
    Default,
    /// A `.gguf` file or an HF model directory.
    Path(PathBuf),
}

/// Which runtime executes the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Backend {
    /// `kestrel-cpu`.
    #[default]
    Cpu,
    /// `kestrel-cuda` ([`crate::EngineError::BackendUnavailable`] without a driver or device).
    Cuda,
    /// `kestrel-cuda`'s runtime on its host device: every line of the CUDA
    /// runtime's bookkeeping with the kernels computed on the CPU, one
    /// thread (tests and CI without a GPU; slow, not for serving).
    CudaHost,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::CudaHost => "cuda-host",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The CPU backend's prefill chunk (tokens) when none is configured: the
/// runtime's rows per forward call, so chunking adds steps but no forward
/// calls. Against 512 it halves the running streams' worst gap for the same
/// long-prompt TTFT (`docs/bench/chunked-prefill.md`).
pub const DEFAULT_PREFILL_CHUNK: usize = 256;

/// How a vision model's images are taken: decoding limits, crops and the
/// encoded-image cache. A text-only model ignores them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageSettings {
    /// Width x height above which an image is refused before its pixels
    /// are decoded (decompression bombs): 50 MP by default.
    pub max_pixels: u64,
    /// Tiles an image is cut into at most, besides its global crop
    /// (`None`: the model's own, 12 for Moondream 2); fewer is cheaper to
    /// encode (each tile is 729 rows through the whole encoder).
    pub max_crops: Option<usize>,
    /// Encoded images (projector outputs) the CPU runtime keeps for the
    /// next question on the same image (0: none).
    pub cache: usize,
}

impl Default for ImageSettings {
    fn default() -> Self {
        Self {
            max_pixels: kestrel_model::vision::DecodeLimits::default().max_pixels,
            max_crops: None,
            cache: 8,
        }
    }
}

/// Engine configuration. See [`EngineConfig::default`] for the defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    pub model: ModelSource,
    pub backend: Backend,
    /// Compute threads of the CPU runtime.
    pub threads: usize,
    /// Sequences decoded together at most.
    pub max_batch_size: usize,
    /// KV cache pages.
    pub kv_pages: usize,
    /// Tokens per KV page.
    pub page_size: usize,
    /// Requests waiting for admission at most; more fail with `QueueFull`.
    pub max_waiting: usize,
    /// Context length (prompt + generated); `None` means the model's.
    pub max_seq_len: Option<usize>,
    pub mode: PipelineMode,
    pub prefill_policy: PrefillPolicy,
    /// Chunked prefill: prompt tokens per prefill step at most, so decoding
    /// sequences wait one chunk's forward rather than a long prompt's.
    /// `None`: the backend's default ([`DEFAULT_PREFILL_CHUNK`] where the
    /// runtime prefills in chunks, as the CPU and CUDA ones do; whole
    /// prompts elsewhere); `Some(0)`: whole prompts.
    pub prefill_chunk: Option<usize>,
    pub enable_prefix_cache: bool,
    /// The CPU runtime's matmul numerics: int8 activations
    /// ([`Numerics::Fast`], the default), or exact f32 ([`Numerics::Exact`],
    /// the mode the f32 golden files hold). The CUDA runtime's f16 GEMMs do
    /// not read it.
    pub numerics: Numerics,
    /// Where the CPU runtime keeps the weights: copied onto huge pages
    /// ([`WeightPages::Huge`], the default; faster streaming) or read in
    /// place from the file's mapping ([`WeightPages::InPlace`]; shared with
    /// other processes mapping the file). The CUDA runtime does not read it.
    pub weight_pages: WeightPages,
    /// Default speculative decoding for requests that do not choose:
    /// prompt lookup with up to this many draft tokens per step (1 to
    /// [`crate::MAX_DRAFT`]); `None`: off. CPU backend only.
    pub speculate: Option<u32>,
    /// A Jinja chat template file that serves chat instead of the model's
    /// own (or, for a model that ships none, its fallback); `None`: the
    /// model's (`kestrel_model::ChatTemplate::for_model`).
    pub chat_template: Option<std::path::PathBuf>,
    /// Image limits of a vision model ([`ImageSettings::default`]).
    pub images: ImageSettings,
    /// Re-encode an HF directory's 16/32-bit weights at load
    /// (`kestrel_model::LoadOptions::quantize`; `--quantize q8_0`); a GGUF
    /// model refuses it. `None`: weights as stored.
    pub quantize: Option<kestrel_model::DType>,
}

impl Default for EngineConfig {
    /// Default model on the CPU, one thread per core, 32 rows, pages for
    /// 32 x 2048 tokens (4096 pages of 16), 256 waiting, the model's
    /// context, pipelined with ride-along prefill in chunks of the
    /// backend's default, prefix cache on, fast numerics, weights on huge
    /// pages, no speculation.
    fn default() -> Self {
        let page_size = 16;
        Self {
            model: ModelSource::Default,
            backend: Backend::Cpu,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            max_batch_size: 32,
            kv_pages: 32 * 2048 / page_size,
            page_size,
            max_waiting: 256,
            max_seq_len: None,
            mode: PipelineMode::Pipelined,
            prefill_policy: PrefillPolicy::RideAlong,
            prefill_chunk: None,
            enable_prefix_cache: true,
            numerics: Numerics::Fast,
            weight_pages: WeightPages::Huge,
            speculate: None,
            chat_template: None,
            images: ImageSettings::default(),
            quantize: None,
        }
    }
}

/// What [`crate::Engine::start`] is doing, for a CLI spinner.
#[derive(Debug, Clone, PartialEq)]
pub enum LoadEvent {
    /// Fetching or verifying the default model.
    Fetch(kestrel_model::FetchStage),
    /// Reading the model file.
    Loading { path: PathBuf },
    /// The model is loaded.
    Loaded { name: String, seconds: f64 },
    /// Building the token trie and grammar compiler.
    PreparingSkills,
    /// Constructing the runtime on the engine thread.
    StartingRuntime { backend: Backend },
    /// Serving.
    Ready,
}
