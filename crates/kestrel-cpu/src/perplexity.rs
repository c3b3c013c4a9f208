//! Perplexity of a token sequence, computed the way llama.cpp's
//! `llama-perplexity` computes it by default, so the two are comparable:
//! non-overlapping windows of `ctx` tokens (a trailing partial window is
//! dropped), each run from position 0 on an empty cache with its first token
//! replaced by BOS when the model adds one, and only the second half scored
//! (the logits at positions `ctx/2 ..= ctx-2`, each against the next token).
//! Cost: one prefill of `ctx - 1` tokens per window; logits are computed for
//! the scored rows only, at most [`ROWS_PER_CALL`] at a time.
//! [`prompt_logprobs`] scores every position of one prompt the same way (a
//! request's prompt logprobs): one prefill of `len - 1` tokens.

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
    /// Evaluate at most this many windows (`llama-perplexity --chunks`);
    /// `None` = every whole window; 0 counts as 1. The text must still hold
    /// `2 * ctx` tokens, as llama.cpp requires.
    pub max_windows: Option<usize>,
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
    /// Windows evaluated (`tokens / ctx`, or fewer with `max_windows`).
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
    let windows = (tokens.len() / ctx).min(cfg.max_windows.map_or(usize::MAX, |w| w.max(1)));
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

/// One prompt position's score: the log-probability of the prompt's token
/// there given the tokens before it, and the `top` most likely tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct PositionLogprobs {
    pub logprob: f32,
    /// `(token, logprob)`, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// The log-probability of each of `tokens[1..]` given the tokens before it
/// (one entry per token after the first), with the `top` most likely tokens
/// at each position (at most [`crate::sampler::MAX_TOP_LOGPROBS`]). Runs
/// from position 0 on a private cache: nothing is shared with a runtime's
/// KV. The math is [`token_nll`]'s.
pub fn prompt_logprobs(
    model: &CpuModel,
    tokens: &[u32],
    top: usize,
) -> Result<Vec<PositionLogprobs>, CpuError> {
    let vocab = model.config().vocab_size;
    if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(CpuError::TokenOutOfRange { token, vocab });
    }
    let top = top.min(crate::sampler::MAX_TOP_LOGPROBS).min(vocab);
    let len = tokens.len();
    if len < 2 {
        return Ok(Vec::new());
    }
    let npages = len.div_ceil(PAGE);
    let pages: Vec<u32> = (0..npages as u32).collect();
    let mut kv = KvStore::for_model(model.config(), npages, PAGE)?;
    let rows = ROWS_PER_CALL.min(len - 1);
    let mut scratch = Scratch::new(model, rows, len);
    let mut logits = vec![0f32; rows * vocab];
    let mut out = Vec::with_capacity(len - 1);
    let mut order: Vec<u32> = Vec::new();
    // Positions 0..len-1 go through the model: the last token is only a target.
    let mut pos = 0;
    while pos < len - 1 {
        let end = (pos + rows).min(len - 1);
        let n = end - pos;
        let batch = PrefillBatch {
            tokens: &tokens[pos..end],
            qo_indptr: &[0, n as u32],
            start_pos: &[pos as u32],
            kv_indptr: &[0, end.div_ceil(PAGE) as u32],
            kv_indices: &pages,
            kv_last_page_len: &[((end - 1) % PAGE + 1) as u32],
        };
        let rows_out = &mut logits[..n * vocab];
        model.forward_prefill(batch, &mut kv, rows_out, LogitsMode::All, &mut scratch)?;
        for (i, row) in rows_out.chunks_exact(vocab).enumerate() {
            let (max, log_sum) = log_normalizer(row);
            let lp = |t: u32| ((row[t as usize] - max) as f64 - log_sum) as f32;
            let mut best = Vec::with_capacity(top);
            if top > 0 {
                order.clear();
                order.extend(0..vocab as u32);
                let by_logit =
                    |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
                order.select_nth_unstable_by(top - 1, by_logit);
                order[..top].sort_unstable_by(by_logit);
                best.extend(order[..top].iter().map(|&t| (t, lp(t))));
            }
            out.push(PositionLogprobs {
                logprob: lp(tokens[pos + i + 1]),
                top: best,
            });
        }
        pos = end;
    }
    Ok(out)
}

/// A row's max and `ln sum exp(l - max)`, as llama.cpp's `log_softmax`:
/// the max and the shifted logits in f32, the sum of exponentials in f64.
fn log_normalizer(row: &[f32]) -> (f32, f64) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&l| (l - max).exp() as f64).sum();
    (max, sum.ln())
}

/// `-log softmax(row)[target]`, as llama.cpp's `log_softmax`: the max and
/// the shifted logits in f32, the sum of their exponentials in f64.
fn token_nll(row: &[f32], target: u32) -> f64 {
    let (max, log_sum) = log_normalizer(row);
    -((row[target as usize] - max) as f64 - log_sum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuModelOptions;
    use kestrel_model::{synthetic_weights, DType, ModelConfig};

    fn tiny_model() -> CpuModel {
        let mut cfg = ModelConfig::tiny();
        cfg.max_position_embeddings = 512;
        let opts = CpuModelOptions {
            threads: 2,
            ..Default::default()
        };
        CpuModel::new(synthetic_weights(&cfg, DType::Q8_0, 7), opts).unwrap()
    }

    /// A window's logits from one prefill of every position, scored by hand.
    fn one_call_nll(model: &CpuModel, window: &[u32]) -> Vec<f64> {
        let (ctx, vocab) = (window.len(), model.config().vocab_size);
        let pages: Vec<u32> = (0..ctx.div_ceil(PAGE) as u32).collect();
        let mut kv = KvStore::for_model(model.config(), pages.len(), PAGE).unwrap();
        let mut scratch = Scratch::new(model, ctx, ctx);
        let mut logits = vec![0f32; ctx * vocab];
        let batch = PrefillBatch {
            tokens: window,
            qo_indptr: &[0, ctx as u32],
            start_pos: &[0],
            kv_indptr: &[0, pages.len() as u32],
            kv_indices: &pages,
            kv_last_page_len: &[((ctx - 1) % PAGE + 1) as u32],
        };
        let mode = LogitsMode::All;
        model
            .forward_prefill(batch, &mut kv, &mut logits, mode, &mut scratch)
            .unwrap();
        (ctx / 2..ctx - 1)
            .map(|i| token_nll(&logits[i * vocab..(i + 1) * vocab], window[i + 1]))
            .collect()
    }

    #[test]
    fn chunked_windows_score_what_one_prefill_per_window_scores() {
        let model = tiny_model();
        // Both halves span more than one call; 2.5 windows, so the tail is dropped.
        let ctx = 2 * ROWS_PER_CALL + 44;
        let tokens: Vec<u32> = (0..5 * ctx / 2).map(|i| (i * 7919 % 509) as u32).collect();
        let bos = 1;
        let mut seen = vec![];
        let cfg = PerplexityConfig {
            ctx,
            bos: Some(bos),
            max_windows: None,
        };
        let got = perplexity(&model, &tokens, cfg, |w, p| seen.push((w, p))).unwrap();
        let mut nlls = vec![];
        for w in 0..2 {
            let mut window = tokens[w * ctx..(w + 1) * ctx].to_vec();
            window[0] = bos;
            nlls.extend(one_call_nll(&model, &window));
        }
        let mean = nlls.iter().sum::<f64>() / nlls.len() as f64;
        assert_eq!((got.windows, got.scored), (2, 2 * (ctx - ctx / 2 - 1)));
        assert_eq!(got.scored, nlls.len());
        // Rows do not depend on their batch: the same bits, summed in the same order.
        assert_eq!(got.mean_nll, mean);
        assert_eq!(got.ppl, mean.exp());
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[1], (1, got.ppl));
        let first = PerplexityConfig {
            max_windows: Some(1),
            ..cfg
        };
        let one = perplexity(&model, &tokens, first, |_, _| {}).unwrap();
        assert_eq!((one.windows, one.ppl), (1, seen[0].1));
    }

    #[test]
    fn too_short_a_text_or_window_is_refused() {
        let model = tiny_model();
        let cfg = |ctx| PerplexityConfig {
            ctx,
            bos: None,
            max_windows: None,
        };
        let e = perplexity(&model, &[3; 15], cfg(8), |_, _| {}).unwrap_err();
        assert!(matches!(
            e,
            CpuError::PerplexityTooShort { tokens: 15, ctx: 8 }
        ));
        let e = perplexity(&model, &[3; 15], cfg(3), |_, _| {}).unwrap_err();
        assert!(matches!(e, CpuError::PerplexityTooShort { ctx: 3, .. }));
        let e = perplexity(&model, &[3, 9999, 3, 3, 3, 3, 3, 3], cfg(4), |_, _| {}).unwrap_err();
        assert!(matches!(e, CpuError::TokenOutOfRange { token: 9999, .. }));
    }

    #[test]
    fn prompt_logprobs_score_every_position_across_calls() {
        let model = tiny_model();
        let len = ROWS_PER_CALL + 37;
        let tokens: Vec<u32> = (0..len).map(|i| (i * 7919 % 509) as u32).collect();
        let got = prompt_logprobs(&model, &tokens, 3).unwrap();
        assert_eq!(got.len(), len - 1);
        let mut nlls = one_call_nll(&model, &tokens);
        // one_call_nll scores the second half only; compare those positions.
        let tail = &got[len / 2..];
        assert_eq!(tail.len(), nlls.len());
        for (p, nll) in tail.iter().zip(nlls.drain(..)) {
            assert!(
                (f64::from(p.logprob) + nll).abs() < 1e-4,
                "{} vs {}",
                p.logprob,
                -nll
            );
            assert_eq!(p.top.len(), 3);
            assert!(p.top.windows(2).all(|w| w[0].1 >= w[1].1));
            assert!(p.top[0].1 >= p.logprob && p.top[0].1 <= 0.0);
        }
        assert!(prompt_logprobs(&model, &tokens[..1], 3).unwrap().is_empty());
        let e = prompt_logprobs(&model, &[3, 9999], 0).unwrap_err();
        assert!(matches!(e, CpuError::TokenOutOfRange { token: 9999, .. }));
    }

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
