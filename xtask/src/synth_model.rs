//! `cargo xtask synth-model`: writes a real-size synthetic Llama GGUF (see
//! `kestrel_model::synth_gguf`) with the default model's tokenizer, and
//! the `synth:SHAPE:TYPE[:SEED]` model names `cargo xtask bench --model`
//! takes: made once, deterministically, then cached in the model cache
//! (`~/.cache/kestrel`) under a name carrying shape, type, seed and format
//! version. Cost: about a minute per billion parameters per core for Q4_K_M.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context as _};
use kestrel_model::{
    synth_file_name, write_synth_gguf, GgufFile, SynthFormat, SynthShape, SynthSpec,
};

/// The seed a `synth:` name without one uses.
pub const DEFAULT_SEED: u64 = 30;

#[derive(Debug, clap::Args)]
pub struct SynthModelArgs {
    /// Shape: llama-1b (Llama 3.2 1B), llama-3b (Llama 3.2 3B), llama-8b (Llama 3.1 8B).
    #[arg(long)]
    shape: String,
    /// Tensor types: f16, q8_0, q4_0, q4_k_m (llama-8b: q4_k_m, q8_0).
    #[arg(long = "type")]
    format: String,
    #[arg(long, default_value_t = DEFAULT_SEED)]
    seed: u64,
    /// Where to write (default: the model cache, reused if already there).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Threads that make and quantize the weights (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

/// A synthetic model by name: `synth:llama-1b:q4_k_m[:SEED]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SynthModel {
    pub shape: SynthShape,
    pub format: SynthFormat,
    pub seed: u64,
}

impl SynthModel {
    fn new(shape: &str, format: &str, seed: u64) -> anyhow::Result<Self> {
        let names = |v: &mut dyn Iterator<Item = &'static str>| v.collect::<Vec<_>>().join(", ");
        let Some(shape) = SynthShape::parse(shape) else {
            bail!(
                "unknown synthetic shape `{shape}` (one of {})",
                names(&mut SynthShape::ALL.iter().map(|s| s.name()))
            );
        };
        let format = SynthFormat::parse(format)
            .filter(|f| shape.formats().contains(f))
            .with_context(|| {
                format!(
                    "{} comes in {}, not `{format}`",
                    shape.name(),
                    names(&mut shape.formats().iter().map(|f| f.name()))
                )
            })?;
        Ok(SynthModel {
            shape,
            format,
            seed,
        })
    }

    /// `Some` for a `synth:` name (an error if it is malformed), `None` for a path.
    pub fn parse(model: &str) -> anyhow::Result<Option<Self>> {
        let Some(rest) = model.strip_prefix("synth:") else {
            return Ok(None);
        };
        let parts: Vec<&str> = rest.split(':').collect();
        let seed = match parts.get(2) {
            Some(s) => s
                .parse()
                .with_context(|| format!("`{model}`: seed `{s}` is not a number"))?,
            None => DEFAULT_SEED,
        };
        if !(2..=3).contains(&parts.len()) {
            bail!("`{model}`: expected synth:SHAPE:TYPE[:SEED], e.g. synth:llama-1b:q4_k_m");
        }
        Self::new(parts[0], parts[1], seed).map(Some)
    }

    /// The cached file, written first if it is not there yet.
    pub fn cached(self, threads: usize) -> anyhow::Result<PathBuf> {
        let dir = kestrel_model::fetch::cache_dir()?;
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(synth_file_name(self.shape, self.format, self.seed));
        if !path.exists() {
            self.write(&path, threads)?;
        }
        Ok(path)
    }

    fn write(self, path: &std::path::Path, threads: usize) -> anyhow::Result<()> {
        let tokenizer_path = kestrel_model::default_model_path()
            .context("fetching the default model (tokenizer)")?;
        let tokenizer = GgufFile::open(&tokenizer_path)?;
        let vocab = tokenizer.get_array("tokenizer.ggml.tokens")?.len();
        let spec = SynthSpec::preset(self.shape, self.format, self.seed, vocab);
        eprintln!(
            "writing {} ({} threads; tokenizer from {})",
            path.display(),
            threads,
            tokenizer_path.display()
        );
        let start = Instant::now();
        let stats = write_synth_gguf(&spec, &tokenizer, path, threads)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!(
            "wrote {}: {:.2}B parameters, {:.1} MB of tensors, {:.1} MB file, in {:.1} s",
            path.display(),
            stats.parameters as f64 / 1e9,
            stats.tensor_bytes as f64 / 1e6,
            stats.file_bytes as f64 / 1e6,
            start.elapsed().as_secs_f64()
        );
        Ok(())
    }
}

pub fn main(args: SynthModelArgs) -> anyhow::Result<()> {
    let model = SynthModel::new(&args.shape, &args.format, args.seed)?;
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
    let path = match args.out {
        Some(out) => {
            model.write(&out, threads)?;
            out
        }
        None => model.cached(threads)?,
    };
    println!("{}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synth_names_parse() {
        let m = SynthModel::parse("synth:llama-1b:q4_k_m").unwrap().unwrap();
        assert_eq!(
            (m.shape, m.format, m.seed),
            (SynthShape::Llama1B, SynthFormat::Q4KM, DEFAULT_SEED)
        );
        let m = SynthModel::parse("synth:llama-3b:Q8_0:7").unwrap().unwrap();
        assert_eq!(
            (m.shape, m.format, m.seed),
            (SynthShape::Llama3B, SynthFormat::Q8_0, 7)
        );
        assert_eq!(SynthModel::parse("models/x.gguf").unwrap(), None);
        let err = |s: &str| SynthModel::parse(s).unwrap_err().to_string();
        assert!(
            err("synth:llama-8b:f16").contains("q4_k_m, q8_0"),
            "{}",
            err("synth:llama-8b:f16")
        );
        assert!(err("synth:llama-2b:q8_0").contains("llama-1b, llama-3b, llama-8b"));
        assert!(err("synth:llama-1b").contains("synth:SHAPE:TYPE"));
        assert!(err("synth:llama-1b:q8_0:x").contains("seed `x`"));
    }
}
