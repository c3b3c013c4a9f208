//! Real-size synthetic models as GGUF files: Llama-architecture shapes of
//! the published Llama 3.2 1B / 3B and Llama 3.1 8B configs (RoPE base and
//! llama3 frequency factors included), random weights from a seed, and a
//! real tokenizer (another GGUF's `tokenizer.*` metadata, copied; the
//! vocabulary follows it), in the tensor types `llama-quantize` would pick
//! for F16, Q8_0, Q4_0 and Q4_K_M (see [`tensor_dtype`]).
//!
//! Written streaming ([`GgufWriter`]): a few row groups per thread of f32 at
//! a time, quantized by [`crate::quant`] (ggml's reference, byte for byte),
//! so an 8B file never has its f32 weights in memory. Same spec, same bytes.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use crate::gguf::{GgufWriter, TensorDesc};
use crate::synthetic::{Rng, INIT_STD};
use crate::{llama3_rope_freq_factors, quant, DType, GgufFile, GgufValue, ModelConfig, ModelError};

/// Bumped whenever the bytes a spec produces change (cache file names carry it).
pub const SYNTH_FORMAT_VERSION: u32 = 1;

/// The published shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthShape {
    /// Llama 3.2 1B: hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, tied.
    Llama1B,
    /// Llama 3.2 3B: hidden 3072, 28 layers, 24 heads, 8 KV heads, FFN 8192, tied.
    Llama3B,
    /// Llama 3.1 8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, untied.
    Llama8B,
}

/// Llama 3.x `rope_scaling` (`rope_type: llama3`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Rope {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position: f32,
}

/// The file's tensor types, named as llama.cpp names its file types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthFormat {
    F16,
    Q8_0,
    Q4_0,
    Q4KM,
}

impl SynthShape {
    pub const ALL: [SynthShape; 3] = [
        SynthShape::Llama1B,
        SynthShape::Llama3B,
        SynthShape::Llama8B,
    ];

    /// `llama-1b`, `llama-3b`, `llama-8b`.
    pub fn name(self) -> &'static str {
        match self {
            SynthShape::Llama1B => "llama-1b",
            SynthShape::Llama3B => "llama-3b",
            SynthShape::Llama8B => "llama-8b",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|x| x.name() == s)
    }

    /// The formats this shape is offered in (8B: what fits 24 GiB with the engine).
    pub fn formats(self) -> &'static [SynthFormat] {
        match self {
            SynthShape::Llama8B => &[SynthFormat::Q4KM, SynthFormat::Q8_0],
            _ => &SynthFormat::ALL,
        }
    }

    /// The published config with `vocab_size` tokens and its llama3 RoPE factors.
    pub fn config(self, vocab_size: usize) -> (ModelConfig, Llama3Rope) {
        let (hidden, layers, heads, ffn, factor, tied) = match self {
            SynthShape::Llama1B => (2048, 16, 32, 8192, 32.0, true),
            SynthShape::Llama3B => (3072, 28, 24, 8192, 32.0, true),
            SynthShape::Llama8B => (4096, 32, 32, 14_336, 8.0, false),
        };
        let rope = Llama3Rope {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192.0,
        };
        let mut c = ModelConfig {
            vocab_size,
            hidden_size: hidden,
            intermediate_size: ffn,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: 8,
            head_dim: hidden / heads,
            rope_theta: 500_000.0,
            max_position_embeddings: 131_072,
            tie_word_embeddings: tied,
            ..ModelConfig::llama_8b()
        };
        c.features.rope_freq_factors = Some(rope.freq_factors(&c));
        (c, rope)
    }
}

impl Llama3Rope {
    /// The per-pair divisors llama.cpp's converter stores as `rope_freqs.weight`.
    pub fn freq_factors(&self, c: &ModelConfig) -> Vec<f32> {
        llama3_rope_freq_factors(
            c.head_dim,
            c.rope_theta,
            self.factor,
            self.low_freq_factor,
            self.high_freq_factor,
            self.original_max_position,
        )
    }
}

impl SynthFormat {
    pub const ALL: [SynthFormat; 4] = [
        SynthFormat::F16,
        SynthFormat::Q8_0,
        SynthFormat::Q4_0,
        SynthFormat::Q4KM,
    ];

    /// `f16`, `q8_0`, `q4_0`, `q4_k_m`.
    pub fn name(self) -> &'static str {
        match self {
            SynthFormat::F16 => "f16",
            SynthFormat::Q8_0 => "q8_0",
            SynthFormat::Q4_0 => "q4_0",
            SynthFormat::Q4KM => "q4_k_m",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|x| x.name() == s.to_ascii_lowercase())
    }

    /// llama.cpp's `llama_ftype` id (`general.file_type`).
    fn file_type(self) -> u32 {
        match self {
            SynthFormat::F16 => 1,
            SynthFormat::Q4_0 => 2,
            SynthFormat::Q8_0 => 7,
            SynthFormat::Q4KM => 15,
        }
    }
}

/// What a matrix is, for [`tensor_dtype`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatrixRole {
    TokenEmbd,
    Output,
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    FfnGate,
    FfnUp,
    FfnDown,
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers and
/// every third one between.
pub fn use_more_bits(layer: usize, n_layers: usize) -> bool {
    layer < n_layers / 8
        || layer >= 7 * n_layers / 8
        || (layer as isize - (n_layers / 8) as isize).rem_euclid(3) == 2
}

/// The type `llama-quantize` (llama-quant.cpp `llama_tensor_get_type`, no
/// importance matrix, no overrides) gives a matrix of a dense Llama with
/// every row a multiple of 256 long:
///
/// - F16 (not a quantized type, so no per-tensor rules): everything F16.
/// - The output head, or the token embedding when it is tied (it is the
///   head then): Q6_K, unless the file type is Q8_0 (stays Q8_0).
/// - Q4_K_M: `attn_v` and `ffn_down` of the layers [`use_more_bits`]
///   picks are Q6_K; every other matrix (the untied token embedding too) Q4_K.
/// - Q8_0 and Q4_0: every other matrix in the file type.
pub fn tensor_dtype(
    format: SynthFormat,
    role: MatrixRole,
    layer: usize,
    n_layers: usize,
    tied: bool,
) -> DType {
    let base = match format {
        SynthFormat::F16 => return DType::F16,
        SynthFormat::Q8_0 => return DType::Q8_0,
        SynthFormat::Q4_0 => DType::Q4_0,
        SynthFormat::Q4KM => DType::Q4K,
    };
    let head = role == MatrixRole::Output || (tied && role == MatrixRole::TokenEmbd);
    let more_bits = format == SynthFormat::Q4KM
        && matches!(role, MatrixRole::AttnV | MatrixRole::FfnDown)
        && use_more_bits(layer, n_layers);
    if head || more_bits {
        DType::Q6K
    } else {
        base
    }
}

/// Everything that determines a synthetic file's bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSpec {
    /// `general.name`.
    pub name: String,
    /// The decoder; its `features.rope_freq_factors` are written as `rope_freqs.weight`.
    pub config: ModelConfig,
    pub format: SynthFormat,
    pub seed: u64,
}

impl SynthSpec {
    /// A published shape with `tokenizer`'s vocabulary.
    pub fn preset(shape: SynthShape, format: SynthFormat, seed: u64, vocab_size: usize) -> Self {
        let (config, _) = shape.config(vocab_size);
        SynthSpec {
            name: format!("synthetic {} {} seed {seed}", shape.name(), format.name()),
            config,
            format,
            seed,
        }
    }

    /// The file's tensors in write order, with their types.
    pub fn tensors(&self) -> Vec<TensorDesc> {
        let c = &self.config;
        let (h, q, kv, ff, n) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.intermediate_size,
            c.num_layers,
        );
        let tied = c.tie_word_embeddings;
        let mat = |name: String, role, layer, rows: usize, cols: usize| TensorDesc {
            name,
            dims: vec![cols as u64, rows as u64],
            dtype: tensor_dtype(self.format, role, layer, n, tied),
        };
        let vec = |name: String, len: usize| TensorDesc {
            name,
            dims: vec![len as u64],
            dtype: DType::F32,
        };
        let mut t = Vec::new();
        if let Some(ff) = &c.features.rope_freq_factors {
            t.push(vec("rope_freqs.weight".into(), ff.len()));
        }
        t.push(mat(
            "token_embd.weight".into(),
            MatrixRole::TokenEmbd,
            0,
            c.vocab_size,
            h,
        ));
        t.push(vec("output_norm.weight".into(), h));
        if !tied {
            t.push(mat(
                "output.weight".into(),
                MatrixRole::Output,
                0,
                c.vocab_size,
                h,
            ));
        }
        for i in 0..n {
            let b = |s: &str| format!("blk.{i}.{s}.weight");
            t.push(vec(b("attn_norm"), h));
            t.push(mat(b("attn_q"), MatrixRole::AttnQ, i, q, h));
            t.push(mat(b("attn_k"), MatrixRole::AttnK, i, kv, h));
            t.push(mat(b("attn_v"), MatrixRole::AttnV, i, kv, h));
            t.push(mat(b("attn_output"), MatrixRole::AttnOutput, i, h, q));
            t.push(vec(b("ffn_norm"), h));
            t.push(mat(b("ffn_gate"), MatrixRole::FfnGate, i, ff, h));
            t.push(mat(b("ffn_up"), MatrixRole::FfnUp, i, ff, h));
            t.push(mat(b("ffn_down"), MatrixRole::FfnDown, i, h, ff));
        }
        t
    }

    /// The `llama.*` and `general.*` metadata (tokenizer keys come from elsewhere).
    fn metadata(&self) -> Vec<(&'static str, GgufValue)> {
        let c = &self.config;
        let u = |x: usize| GgufValue::U32(x as u32);
        vec![
            ("general.architecture", GgufValue::String("llama".into())),
            ("general.name", GgufValue::String(self.name.clone())),
            ("general.file_type", GgufValue::U32(self.format.file_type())),
            ("general.quantization_version", GgufValue::U32(2)),
            ("kestrel.synthetic.seed", GgufValue::U64(self.seed)),
            (
                "kestrel.synthetic.format_version",
                GgufValue::U32(SYNTH_FORMAT_VERSION),
            ),
            ("llama.vocab_size", u(c.vocab_size)),
            ("llama.context_length", u(c.max_position_embeddings)),
            ("llama.embedding_length", u(c.hidden_size)),
            ("llama.block_count", u(c.num_layers)),
            ("llama.feed_forward_length", u(c.intermediate_size)),
            ("llama.attention.head_count", u(c.num_heads)),
            ("llama.attention.head_count_kv", u(c.num_kv_heads)),
            (
                "llama.attention.layer_norm_rms_epsilon",
                GgufValue::F32(c.rms_norm_eps),
            ),
            ("llama.rope.freq_base", GgufValue::F32(c.rope_theta)),
            ("llama.rope.dimension_count", u(c.head_dim)),
        ]
    }

    /// The f32 values of one tensor's rows `rows` (row-major), drawn from a
    /// generator keyed by the seed, the tensor's index and the row group,
    /// so any row group can be made on any thread.
    pub fn values(
        &self,
        index: usize,
        desc: &TensorDesc,
        rows: std::ops::Range<usize>,
    ) -> Vec<f32> {
        let cols = desc.dims[0] as usize;
        if desc.name == "rope_freqs.weight" {
            return self
                .config
                .features
                .rope_freq_factors
                .clone()
                .unwrap_or_default();
        }
        let key = self.seed ^ (index as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
        let mut out = Vec::with_capacity(rows.len() * cols);
        if desc.dims.len() == 1 {
            // Norm weights, ~1.
            let mut rng = Rng(key);
            out.extend((0..cols).map(|_| 1.0 + 0.1 * rng.uniform()));
            return out;
        }
        let out_proj =
            desc.name.ends_with("attn_output.weight") || desc.name.ends_with("ffn_down.weight");
        let std = if out_proj {
            INIT_STD / (2.0 * self.config.num_layers as f32).sqrt()
        } else {
            INIT_STD
        };
        // Uniform on [-a, a] has std a / sqrt(3).
        let amp = std * 3f32.sqrt();
        for group in rows.start / ROW_GROUP..rows.end.div_ceil(ROW_GROUP) {
            let mut rng = Rng(key ^ (group as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let first = group * ROW_GROUP;
            for r in first..first + ROW_GROUP {
                for _ in 0..cols {
                    let v = rng.uniform() * amp;
                    if rows.contains(&r) {
                        out.push(v);
                    }
                }
            }
        }
        out
    }
}

/// Rows drawn from one generator (the unit of parallel work).
const ROW_GROUP: usize = 64;

/// What [`write_synth_gguf`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthFileStats {
    /// The whole file.
    pub file_bytes: u64,
    /// Sum of the tensors' data sizes.
    pub tensor_bytes: u64,
    pub parameters: u64,
}

/// Writes `spec` as a GGUF at `path` (via `path.tmp`, renamed when
/// complete, so a crash never leaves a truncated model under the real
/// name), with the `tokenizer.*` metadata of `tokenizer`. `threads` make the
/// values and quantize them.
pub fn write_synth_gguf(
    spec: &SynthSpec,
    tokenizer: &GgufFile,
    path: &Path,
    threads: usize,
) -> Result<SynthFileStats, ModelError> {
    let vocab = tokenizer.get_array("tokenizer.ggml.tokens")?.len();
    if vocab != spec.config.vocab_size {
        return Err(ModelError::invalid(format!(
            "the tokenizer has {vocab} tokens but the spec's vocab_size is {}",
            spec.config.vocab_size
        )));
    }
    spec.config.validate()?;
    let descs = spec.tensors();
    for d in &descs {
        if !(d.dims[0] as usize).is_multiple_of(d.dtype.block_elems()) {
            return Err(ModelError::invalid(format!(
                "tensor `{}`: rows of {} do not tile {:?} blocks of {}",
                d.name,
                d.dims[0],
                d.dtype,
                d.dtype.block_elems()
            )));
        }
    }
    let mut metadata = spec.metadata();
    metadata.extend(
        tokenizer
            .metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .map(|(k, v)| (k.as_str(), v.clone())),
    );
    let tmp = path.with_extension("gguf.tmp");
    let io = |source| ModelError::Io {
        path: tmp.clone(),
        source,
    };
    let file = File::create(&tmp).map_err(io)?;
    let mut w = GgufWriter::new(
        BufWriter::with_capacity(1 << 20, file),
        &metadata,
        descs.clone(),
    )
    .map_err(io)?;
    let threads = threads.max(1);
    let mut stats = SynthFileStats {
        file_bytes: 0,
        tensor_bytes: 0,
        parameters: 0,
    };
    for (index, d) in descs.iter().enumerate() {
        let rows: usize = d.dims.iter().skip(1).product::<u64>() as usize;
        let rows = rows.max(1);
        stats.tensor_bytes += d.data_bytes() as u64;
        stats.parameters += d.dims.iter().product::<u64>();
        // One round: `threads` chunks of whole row groups, written in order.
        let chunk = ROW_GROUP * 4;
        let mut start = 0;
        while start < rows {
            let round_end = (start + chunk * threads).min(rows);
            let parts: Vec<Vec<u8>> = std::thread::scope(|s| {
                let handles: Vec<_> = (start..round_end)
                    .step_by(chunk)
                    .map(|a| {
                        let b = (a + chunk).min(round_end);
                        s.spawn(move || {
                            let values = spec.values(index, d, a..b);
                            let mut bytes = Vec::with_capacity(d.data_bytes() / rows * (b - a));
                            quant::quantize(d.dtype, &values, &mut bytes);
                            bytes
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("quantize thread"))
                    .collect()
            });
            for p in &parts {
                w.tensor(p).map_err(io)?;
            }
            start = round_end;
        }
    }
    let file = w.finish().map_err(io)?;
    file.into_inner()
        .map_err(|e| io(e.into_error()))?
        .sync_all()
        .map_err(io)?;
    std::fs::rename(&tmp, path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    stats.file_bytes = std::fs::metadata(path)
        .map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?
        .len();
    Ok(stats)
}

/// The cache file name of a preset: shape, format, seed and [`SYNTH_FORMAT_VERSION`].
pub fn synth_file_name(shape: SynthShape, format: SynthFormat, seed: u64) -> String {
    format!(
        "synth-{}-{}-seed{seed}-v{SYNTH_FORMAT_VERSION}.gguf",
        shape.name(),
        format.name()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_more_bits_matches_llama_cpp_for_16_layers() {
        // n/8 = 2: layers 0, 1, 14, 15, and (i - 2) % 3 == 2: 4, 7, 10, 13.
        let picked: Vec<usize> = (0..16).filter(|&i| use_more_bits(i, 16)).collect();
        assert_eq!(picked, vec![0, 1, 4, 7, 10, 13, 14, 15]);
    }

    #[test]
    fn q4_k_m_types() {
        let t = |role, layer, tied| tensor_dtype(SynthFormat::Q4KM, role, layer, 16, tied);
        assert_eq!(t(MatrixRole::TokenEmbd, 0, true), DType::Q6K);
        assert_eq!(t(MatrixRole::TokenEmbd, 0, false), DType::Q4K);
        assert_eq!(t(MatrixRole::Output, 0, false), DType::Q6K);
        assert_eq!(t(MatrixRole::AttnV, 4, true), DType::Q6K);
        assert_eq!(t(MatrixRole::AttnV, 5, true), DType::Q4K);
        assert_eq!(t(MatrixRole::FfnDown, 15, true), DType::Q6K);
        assert_eq!(t(MatrixRole::FfnUp, 15, true), DType::Q4K);
        assert_eq!(
            tensor_dtype(SynthFormat::Q4_0, MatrixRole::Output, 0, 16, false),
            DType::Q6K
        );
        assert_eq!(
            tensor_dtype(SynthFormat::Q8_0, MatrixRole::Output, 0, 16, false),
            DType::Q8_0
        );
        assert_eq!(
            tensor_dtype(SynthFormat::F16, MatrixRole::TokenEmbd, 0, 16, true),
            DType::F16
        );
    }

    #[test]
    fn presets_match_the_published_shapes() {
        let (c, r) = SynthShape::Llama1B.config(49152);
        assert_eq!(
            (
                c.hidden_size,
                c.num_layers,
                c.num_heads,
                c.num_kv_heads,
                c.intermediate_size
            ),
            (2048, 16, 32, 8, 8192)
        );
        assert_eq!(
            (c.head_dim, c.tie_word_embeddings, r.factor),
            (64, true, 32.0)
        );
        let (c, _) = SynthShape::Llama3B.config(49152);
        assert_eq!(
            (c.hidden_size, c.num_layers, c.num_heads, c.head_dim),
            (3072, 28, 24, 128)
        );
        let (c, r) = SynthShape::Llama8B.config(49152);
        assert_eq!(
            (
                c.hidden_size,
                c.intermediate_size,
                c.tie_word_embeddings,
                r.factor
            ),
            (4096, 14_336, false, 8.0)
        );
        assert_eq!(
            c.features.rope_freq_factors.as_ref().map(Vec::len),
            Some(64)
        );
    }

    #[test]
    fn values_do_not_depend_on_how_rows_are_split() {
        let spec = SynthSpec::preset(SynthShape::Llama1B, SynthFormat::Q8_0, 3, 512);
        let d = &spec.tensors()[1];
        assert_eq!(d.name, "token_embd.weight");
        let whole = spec.values(1, d, 0..200);
        let mut parts = spec.values(1, d, 0..70);
        parts.extend(spec.values(1, d, 70..200));
        assert_eq!(whole, parts);
        assert_ne!(
            whole,
            SynthSpec {
                seed: 4,
                ..spec.clone()
            }
            .values(1, d, 0..200)
        );
    }
}
