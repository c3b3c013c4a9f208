//! Perplexity of a token sequence, computed the way llama.cpp's
//! `llama-perplexity` computes it by default, so the two are comparable:
//! non-overlapping windows of `ctx` tokens (a trailing partial window is
//! dropped), each run from position 0 on an empty cache with its first token
//! replaced by BOS when the model adds one, and only the second half scored
//! (the logits at positions `ctx/2 ..= ctx-2`, each against the next token).
//! Cost: one prefill of `ctx - 1` tokens per window; logits are computed for
//! the scored rows only, at most [`ROWS_PER_CALL`] at a time.

use crate::{CpuError, CpuModel, KvStore, LogitsMode, PrefillBatch, Scratch};

/// Rows per `forward_prefill` call: bounds the logits buffer
/// (`ROWS_PER_CALL * vocab` floats) whatever `ctx` is.
pub const ROWS_PER_CALL: usize = 128;

/// Tokens per KV page of the window's private cache.
const PAGE: usize = 16;

/// How [`perplexity`] cuts and scores the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerplexityConfig {
    /// Tokens per window (`llama-perplexity -c`, 512 by default there).
    pub ctx: usize,
    /// The token every window starts with instead of its own first token:
    /// the model's BOS when it adds one (llama.cpp's `add_bos`), else `None`.
    pub bos: Option<u32>,
}

/// The result, with llama.cpp's error estimate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Perplexity {
    /// `exp(mean negative log-likelihood)` over every scored token.
    pub ppl: f64,
    /// llama.cpp's `+/-`: the standard error of the mean NLL times `ppl`.
    pub ppl_stderr: f64,
    /// Mean negative log-likelihood (nats per token).
    pub mean_nll: f64,
    /// Windows evaluated (`tokens / ctx`).
    pub windows: usize,
    /// Tokens scored (`windows * (ctx - ctx/2 - 1)`).
    pub scored: usize,
}

/// Scores `tokens` (already tokenized, BOS included if the model adds one)
/// with `model`. `after_window(w, ppl)` sees the running perplexity after
/// window `w` (llama.cpp prints it as `[w+1]ppl`).
pub fn perplexity(
    model: &CpuModel,
    tokens: &[u32],
    cfg: PerplexityConfig,
    mut after_window: impl FnMut(usize, f64),
) -> Result<Perplexity, CpuError> {
    let ctx = cfg.ctx;
    if ctx < 4 || tokens.len() < 2 * ctx {
        return Err(CpuError::PerplexityTooShort {
            tokens: tokens.len(),
            ctx,
        });
    }
    let vocab = model.config().vocab_size;
    if let Some(&token) = tokens
        .iter()
        .chain(&cfg.bos)
        .find(|&&t| t as usize >= vocab)
    {
        return Err(CpuError::TokenOutOfRange { token, vocab });
    }
    let first = ctx / 2;
    let windows = tokens.len() / ctx;
    let npages = ctx.div_ceil(PAGE);
    let pages: Vec<u32> = (0..npages as u32).collect();
    let mut kv = KvStore::for_model(model.config(), npages, PAGE)?;
    let rows = ROWS_PER_CALL.min(ctx);
    let mut scratch = Scratch::new(model, rows, ctx);
    let mut logits = vec![0f32; rows * vocab];
    let mut window = vec![0u32; ctx];
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    for w in 0..windows {
        window.copy_from_slice(&tokens[w * ctx..(w + 1) * ctx]);
        if let Some(bos) = cfg.bos {
            window[0] = bos;
        }
        // Positions 0..ctx-1 go through the model: the last token is only a
        // target. Calls never straddle `first`, so the unscored half asks
        // for one row of logits per call and the scored half for all.
        let mut pos = 0;
        while pos < ctx - 1 {
            let limit = if pos < first { first } else { ctx - 1 };
            let end = (pos + rows).min(limit);
            let n = end - pos;
            let (mode, out_rows) = if pos < first {
                (LogitsMode::LastPerSequence, 1)
            } else {
                (LogitsMode::All, n)
            };
            let batch = PrefillBatch {
                tokens: &window[pos..end],
                qo_indptr: &[0, n as u32],
                start_pos: &[pos as u32],
                kv_indptr: &[0, end.div_ceil(PAGE) as u32],
                kv_indices: &pages,
                kv_last_page_len: &[((end - 1) % PAGE + 1) as u32],
            };
            let out = &mut logits[..out_rows * vocab];
            model.forward_prefill(batch, &mut kv, out, mode, &mut scratch)?;
            if mode == LogitsMode::All {
                for (i, row) in out.chunks_exact(vocab).enumerate() {
                    let v = token_nll(row, window[pos + i + 1]);
                    nll += v;
                    nll2 += v * v;
                    count += 1;
                }
            }
            pos = end;
        }
        after_window(w, (nll / count as f64).exp());
    }
    let mean = nll / count as f64;
    let ppl = mean.exp();
    // llama.cpp: sqrt((E[v^2] - E[v]^2) / (count - 1)) * ppl.
    let var = nll2 / count as f64 - mean * mean;
    let ppl_stderr = if var > 0.0 {
        (var / (count - 1) as f64).sqrt() * ppl
    } else {
        0.0
    };
    Ok(Perplexity {
        ppl,
        ppl_stderr,
        mean_nll: mean,
        windows,
        scored: count,
    })
}

/// `-log softmax(row)[target]`, as llama.cpp's `log_softmax`: the max and
/// the shifted logits in f32, the sum of their exponentials in f64.
fn token_nll(row: &[f32], target: u32) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&l| (l - max).exp() as f64).sum();
    -((row[target as usize] - max) as f64 - sum.ln())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_nll_is_the_negative_log_softmax() {
        let row = [1.0f32, 2.0, 3.0, -1.0];
        let z: f64 = row.iter().map(|&l| (l as f64).exp()).sum();
        for (t, &l) in row.iter().enumerate() {
            let want = -(l as f64 - z.ln());
            assert!((token_nll(&row, t as u32) - want).abs() < 1e-6);
        }
    }
}
