//! `kestrel perplexity`: a model's perplexity on a text file with the CPU
//! forward directly (no engine, no server), scored by
//! [`kestrel_cpu::perplexity`] the way llama.cpp's `llama-perplexity` does by
//! default, so the two tools' figures are comparable on the same GGUF, text
//! and `--ctx`. The text is tokenized as `llama-perplexity -f` does it: one
//! trailing newline dropped, BOS prepended when the model adds one.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use clap::Args;
use kestrel_cpu::{CpuModel, CpuModelOptions, Numerics, PerplexityConfig};

use crate::cli::engine::NumericsArg;

#[derive(Debug, Args)]
pub(crate) struct PerplexityArgs {
    /// A .gguf file, an HF model directory, or a pinned model (`smollm2-135m`,
    /// `gemma3-270m`) [default: smollm2-135m].
    #[arg(long)]
    model: Option<PathBuf>,
    /// The text to score (UTF-8); it must tokenize to at least 2 * ctx tokens.
    #[arg(long)]
    text: PathBuf,
    /// Tokens per window (llama-perplexity's -c).
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Evaluate at most this many windows (llama-perplexity's --chunks)
    /// [default: all].
    #[arg(long)]
    chunks: Option<usize>,
    /// CPU matmul numerics: int8 activations, or exact f32 (the reference's
    /// numbers) [default: fast].
    #[arg(long, value_enum)]
    numerics: Option<NumericsArg>,
    /// Compute threads [default: one per core].
    #[arg(long)]
    threads: Option<usize>,
}

pub(crate) fn run(args: PerplexityArgs) -> anyhow::Result<()> {
    let path = match &args.model {
        Some(p) => p.clone(),
        None => kestrel_model::default_model_path().context("cannot fetch the default model")?,
    };
    let loaded =
        kestrel_model::load(&path).with_context(|| format!("cannot load {}", path.display()))?;
    let mut text = std::fs::read_to_string(&args.text)
        .with_context(|| format!("cannot read {}", args.text.display()))?;
    if text.ends_with('\n') {
        text.pop();
    }
    let tokens = loaded
        .encode_prompt(&text)
        .context("cannot tokenize the text")?;
    let bos = if loaded.add_bos_token {
        loaded.bos_token_id
    } else {
        None
    };
    let numerics = args.numerics.map_or(Numerics::default(), Numerics::from);
    let name = loaded.name.clone();
    let model = CpuModel::new(
        loaded.weights,
        CpuModelOptions {
            threads: args.threads.unwrap_or(0),
            isa: None,
            numerics,
            ..CpuModelOptions::default()
        },
    )
    .context("cannot build the CPU model")?;
    eprintln!(
        "{name}: {} tokens, {} windows of {} (BOS {}), numerics {numerics:?}, isa {:?}, {} threads",
        tokens.len(),
        (tokens.len() / args.ctx.max(1)).min(args.chunks.map_or(usize::MAX, |c| c.max(1))),
        args.ctx,
        if bos.is_some() { "first" } else { "not added" },
        model.isa(),
        model.threads(),
    );
    let started = Instant::now();
    let cfg = PerplexityConfig {
        ctx: args.ctx,
        bos,
        max_windows: args.chunks,
    };
    let result = kestrel_cpu::perplexity(&model, &tokens, cfg, |w, ppl| {
        eprint!("[{}]{ppl:.4},", w + 1);
        let _ = std::io::stderr().flush();
    })
    .context("perplexity failed")?;
    let secs = started.elapsed().as_secs_f64();
    eprintln!();
    println!(
        "Final estimate: PPL = {:.4} +/- {:.5}",
        result.ppl, result.ppl_stderr
    );
    println!(
        "{} tokens scored in {} windows; mean NLL {:.5}; {:.1}s ({:.0} tokens/s through the model)",
        result.scored,
        result.windows,
        result.mean_nll,
        secs,
        (result.windows * (args.ctx - 1)) as f64 / secs,
    );
    Ok(())
}
