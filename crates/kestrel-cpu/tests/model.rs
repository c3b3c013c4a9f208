//! Forward-pass tests on tiny synthetic models: agreement with an f64
//! reference (both RoPE styles, GQA/MQA/MHA, biases, every weight dtype),
//! chunked == one-shot prefill, decode == longer prefill, batch invariance
//! (alone vs batches of 8 and 32, 1 vs 2 threads; exact and fast numerics,
//! fast for Q4_1, Q5_0, Q4_K/Q6_K and the Phi block in Q8_0),
//! batched prefill, and rejection of bad indices. Bit-identical where the
//! design promises it.

mod common;

use common::{indices, reference_logits, Pages};
use kestrel_cpu::synth::{config, random_model, Rng};
use kestrel_cpu::{
    CpuModel, CpuModelOptions, DecodeBatch, KvStore, LogitsMode, Numerics, PrefillBatch, Scratch,
    WeightPages,
};
use kestrel_model::{
    Activation, ArchFeatures, DType, ModelConfig, ModelWeights, NormKind, RopeStyle,
};

fn tiny(style: RopeStyle, heads: usize, kv_heads: usize) -> ModelConfig {
    config(97, 64, 96, 2, heads, kv_heads, style)
}

fn model(w: &ModelWeights, threads: usize) -> CpuModel {
    model_with(w, threads, Numerics::Exact)
}

fn model_with(w: &ModelWeights, threads: usize, numerics: Numerics) -> CpuModel {
    CpuModel::new(
        w.clone(),
        CpuModelOptions {
            threads,
            numerics,
            ..Default::default()
        },
    )
    .unwrap()
}

/// Prefill `tokens` of one sequence (pages already grown) from `start`.
fn prefill(
    m: &CpuModel,
    kv: &mut KvStore,
    s: &mut Scratch,
    pages: &[u32],
    start: usize,
    tokens: &[u32],
    mode: LogitsMode,
) -> Vec<f32> {
    let len = start + tokens.len();
    let (indptr, idx, last) = indices(&[(pages, len)], kv.page_size());
    let rows = if mode == LogitsMode::All {
        tokens.len()
    } else {
        1
    };
    let mut out = vec![0f32; rows * m.config().vocab_size];
    let b = PrefillBatch {
        tokens,
        qo_indptr: &[0, tokens.len() as u32],
        start_pos: &[start as u32],
        kv_indptr: &indptr,
        kv_indices: &idx,
        kv_last_page_len: &last,
    };
    m.forward_prefill(b, kv, &mut out, mode, s).unwrap();
    out
}

fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut r = Rng(seed);
    (0..n)
        .map(|_| (r.next_u64() % vocab as u64) as u32)
        .collect()
}

fn check_against_reference(w: &ModelWeights, tol: f64) {
    let m = model(w, 2);
    let mut kv = KvStore::for_model(&w.config, 64, 4).unwrap();
    let mut s = Scratch::new(&m, 32, 128);
    let mut pages = Pages::new(64, 4, 1);
    let toks = tokens(19, 3, w.config.vocab_size);
    let mut pl = vec![];
    pages.grow(&mut pl, toks.len());
    let got = prefill(&m, &mut kv, &mut s, &pl, 0, &toks, LogitsMode::All);
    let want = reference_logits(w, &toks);
    let v = w.config.vocab_size;
    for (p, row) in want.iter().enumerate() {
        for (t, e) in row.iter().enumerate() {
            let g = got[p * v + t] as f64;
            assert!(
                (g - e).abs() <= tol * (1.0 + e.abs()),
                "pos {p} token {t}: {g} vs {e}"
            );
        }
    }
}

#[test]
fn matches_reference_both_rope_styles_and_head_layouts() {
    for style in [RopeStyle::Interleaved, RopeStyle::HalfSplit] {
        for (h, kvh) in [(4, 2), (4, 1), (4, 4)] {
            let w = random_model(&tiny(style, h, kvh), DType::F32, DType::F32, 11);
            check_against_reference(&w, 2e-4);
        }
    }
}

#[test]
fn matches_reference_for_every_weight_dtype() {
    for (dt, et) in [
        (DType::Q4_1, DType::Q8_0),
        (DType::Q4_0, DType::Q8_0),
        (DType::Q8_0, DType::F16),
        (DType::F16, DType::BF16),
        (DType::BF16, DType::Q4_1),
    ] {
        let w = random_model(&tiny(RopeStyle::Interleaved, 4, 2), dt, et, 5);
        check_against_reference(&w, 2e-4);
    }
}

#[test]
fn qkv_bias_matches_reference() {
    let mut c = tiny(RopeStyle::HalfSplit, 4, 2);
    c.qkv_bias = true;
    c.architecture = kestrel_model::Family::Qwen2;
    let w = random_model(&c, DType::Q8_0, DType::Q8_0, 9);
    check_against_reference(&w, 2e-4);
}

#[test]
fn chunked_prefill_equals_one_shot_bitwise() {
    let w = random_model(
        &tiny(RopeStyle::Interleaved, 4, 2),
        DType::Q4_1,
        DType::Q8_0,
        21,
    );
    let m = model(&w, 2);
    let toks = tokens(23, 8, 97);
    let mut s = Scratch::new(&m, 32, 64);
    let mut kv1 = KvStore::for_model(&w.config, 32, 4).unwrap();
    let mut p1 = Pages::new(32, 4, 2);
    let mut pl1 = vec![];
    p1.grow(&mut pl1, 23);
    let one = prefill(&m, &mut kv1, &mut s, &pl1, 0, &toks, LogitsMode::All);
    let mut kv2 = KvStore::for_model(&w.config, 32, 4).unwrap();
    let mut p2 = Pages::new(32, 4, 99);
    let mut pl2 = vec![];
    let mut chunked = vec![];
    for (a, b) in [(0, 5), (5, 6), (6, 15), (15, 23)] {
        p2.grow(&mut pl2, b);
        chunked.extend(prefill(
            &m,
            &mut kv2,
            &mut s,
            &pl2,
            a,
            &toks[a..b],
            LogitsMode::All,
        ));
    }
    assert_eq!(one.len(), chunked.len());
    assert!(one
        .iter()
        .zip(&chunked)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// The weights copied onto huge pages (the default) and read in place give
/// the same logits, bit for bit, for a model in K-quants with an untied
/// head (placed apart from the embedding, though `random_model` gives it the
/// embedding's bytes).
#[test]
fn weights_on_huge_pages_give_the_same_logits_as_in_place() {
    // 256 columns: whole K-quant super-blocks.
    let mut cfg = config(97, 256, 512, 2, 4, 2, RopeStyle::Interleaved);
    cfg.tie_word_embeddings = false;
    let w = random_model(&cfg, DType::Q4K, DType::Q6K, 5);
    let toks = tokens(17, 2, cfg.vocab_size);
    let logits = |pages: WeightPages| {
        let m = CpuModel::new(
            w.clone(),
            CpuModelOptions {
                threads: 2,
                numerics: Numerics::Fast,
                weight_pages: pages,
                ..Default::default()
            },
        )
        .unwrap();
        let mut s = Scratch::new(&m, 32, 64);
        let mut kv = KvStore::for_model(&w.config, 32, 4).unwrap();
        let (mut p, mut pl) = (Pages::new(32, 4, 3), vec![]);
        p.grow(&mut pl, toks.len());
        prefill(&m, &mut kv, &mut s, &pl, 0, &toks, LogitsMode::All)
    };
    let (huge, mapped) = (logits(WeightPages::Huge), logits(WeightPages::InPlace));
    assert!(huge.iter().all(|x| x.is_finite()));
    assert_eq!(
        huge.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        mapped.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
}

#[test]
fn decode_after_prefill_equals_longer_prefill_bitwise() {
    for numerics in [Numerics::Exact, Numerics::Fast] {
        decode_after_prefill_equals_longer_prefill(numerics);
    }
}

fn decode_after_prefill_equals_longer_prefill(numerics: Numerics) {
    let w = random_model(
        &tiny(RopeStyle::HalfSplit, 4, 1),
        DType::Q4_1,
        DType::Q8_0,
        4,
    );
    let m = model_with(&w, 2, numerics);
    let toks = tokens(14, 2, 97);
    let mut s = Scratch::new(&m, 32, 64);
    let mut kv = KvStore::for_model(&w.config, 32, 3).unwrap();
    let mut pages = Pages::new(32, 3, 5);
    let mut pl = vec![];
    pages.grow(&mut pl, 10);
    prefill(
        &m,
        &mut kv,
        &mut s,
        &pl,
        0,
        &toks[..10],
        LogitsMode::LastPerSequence,
    );
    let mut last = vec![];
    for p in 10..14 {
        pages.grow(&mut pl, p + 1);
        let (indptr, idx, lp) = indices(&[(&pl, p + 1)], 3);
        let mut out = vec![0f32; 97];
        let b = DecodeBatch {
            tokens: &toks[p..p + 1],
            positions: &[p as u32],
            kv_indptr: &indptr,
            kv_indices: &idx,
            kv_last_page_len: &lp,
        };
        m.forward_decode(b, &mut kv, &mut out, &mut s).unwrap();
        last = out;
    }
    let mut kv2 = KvStore::for_model(&w.config, 32, 3).unwrap();
    let mut pl2 = vec![];
    Pages::new(32, 3, 77).grow(&mut pl2, 14);
    let full = prefill(
        &m,
        &mut kv2,
        &mut s,
        &pl2,
        0,
        &toks,
        LogitsMode::LastPerSequence,
    );
    assert!(
        last.iter()
            .zip(&full)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{numerics:?}"
    );
}

/// Decode one step of sequence 0 alone and inside batches with other
/// sequences of different lengths; all must give the same bits, in either
/// numerics, and in fast numerics for the repacked types too (Q5_0; Q4_K
/// matrices with a Q6_K embedding and head, on a 256-wide model).
#[test]
fn decode_is_batch_invariant() {
    let tiny = || tiny(RopeStyle::Interleaved, 4, 2);
    let k_wide = || config(97, 256, 512, 1, 4, 2, RopeStyle::Interleaved);
    // The Phi block: LayerNorm with bias, parallel attention and FFN,
    // ungated biased FFN, rotary on half of each head, head bias.
    let phi = || {
        let mut c = config(97, 64, 96, 2, 4, 4, RopeStyle::HalfSplit);
        c.qkv_bias = true;
        c.features = ArchFeatures {
            activation: Activation::GeluTanh,
            norm: NormKind::Layer,
            parallel_block: true,
            gated_ffn: false,
            linear_biases: true,
            rotary_dim: Some(c.head_dim / 2),
            ..ArchFeatures::default()
        };
        c
    };
    for (numerics, cfg, dtype, embd) in [
        (Numerics::Exact, tiny(), DType::Q4_1, DType::Q8_0),
        (Numerics::Fast, tiny(), DType::Q4_1, DType::Q8_0),
        (Numerics::Fast, tiny(), DType::Q5_0, DType::Q8_0),
        (Numerics::Fast, k_wide(), DType::Q4K, DType::Q6K),
        (Numerics::Exact, phi(), DType::F16, DType::F16),
        (Numerics::Fast, phi(), DType::Q8_0, DType::Q8_0),
    ] {
        let w = random_model(&cfg, dtype, embd, 31);
        decode_is_batch_invariant_in(&w, numerics);
    }
}

fn decode_is_batch_invariant_in(w: &ModelWeights, numerics: Numerics) {
    let v = 97;
    let mut reference: Option<Vec<f32>> = None;
    for (threads, batch) in [(1, 1), (2, 1), (2, 8), (2, 32), (1, 32), (3, 8)] {
        let m = model_with(w, threads, numerics);
        let mut s = Scratch::new(&m, 32, 64);
        let mut kv = KvStore::for_model(&w.config, 512, 4).unwrap();
        let mut pages = Pages::new(512, 4, batch as u64);
        // Sequence i has a prompt of 5 + 3*i tokens (seq 0: the one we watch).
        let mut seqs = vec![];
        for i in 0..batch {
            let n = if i == 0 { 9 } else { 3 + (i * 7) % 20 };
            let toks = tokens(n + 1, 100 + i as u64 * (threads as u64 + batch as u64), v);
            let toks = if i == 0 { tokens(10, 1, v) } else { toks };
            let mut pl = vec![];
            pages.grow(&mut pl, n);
            prefill(
                &m,
                &mut kv,
                &mut s,
                &pl,
                0,
                &toks[..n],
                LogitsMode::LastPerSequence,
            );
            pages.grow(&mut pl, n + 1);
            seqs.push((pl, n, toks[n]));
        }
        let ix: Vec<(&[u32], usize)> = seqs
            .iter()
            .map(|(pl, n, _)| (pl.as_slice(), n + 1))
            .collect();
        let (indptr, idx, last) = indices(&ix, 4);
        let toks: Vec<u32> = seqs.iter().map(|s| s.2).collect();
        let pos: Vec<u32> = seqs.iter().map(|s| s.1 as u32).collect();
        let mut out = vec![0f32; batch * v];
        let b = DecodeBatch {
            tokens: &toks,
            positions: &pos,
            kv_indptr: &indptr,
            kv_indices: &idx,
            kv_last_page_len: &last,
        };
        m.forward_decode(b, &mut kv, &mut out, &mut s).unwrap();
        let row0 = out[..v].to_vec();
        match &reference {
            None => reference = Some(row0),
            Some(r) => assert!(
                r.iter().zip(&row0).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{numerics:?} {:?} threads {threads} batch {batch}",
                w.layers[0].wq.dtype
            ),
        }
    }
}

#[test]
fn batched_prefill_equals_separate_prefills() {
    let w = random_model(
        &tiny(RopeStyle::Interleaved, 4, 2),
        DType::Q4_0,
        DType::Q8_0,
        12,
    );
    let m = model(&w, 2);
    let mut s = Scratch::new(&m, 32, 64);
    let (a, b) = (tokens(7, 1, 97), tokens(12, 2, 97));
    let mut kv = KvStore::for_model(&w.config, 32, 4).unwrap();
    let mut pages = Pages::new(32, 4, 3);
    let (mut pa, mut pb) = (vec![], vec![]);
    pages.grow(&mut pa, 7);
    pages.grow(&mut pb, 12);
    let sa = prefill(&m, &mut kv, &mut s, &pa, 0, &a, LogitsMode::LastPerSequence);
    let sb = prefill(&m, &mut kv, &mut s, &pb, 0, &b, LogitsMode::LastPerSequence);
    let (indptr, idx, last) = indices(&[(&pa, 7), (&pb, 12)], 4);
    let all: Vec<u32> = a.iter().chain(&b).copied().collect();
    let mut out = vec![0f32; 2 * 97];
    let batch = PrefillBatch {
        tokens: &all,
        qo_indptr: &[0, 7, 19],
        start_pos: &[0, 0],
        kv_indptr: &indptr,
        kv_indices: &idx,
        kv_last_page_len: &last,
    };
    m.forward_prefill(
        batch,
        &mut kv,
        &mut out,
        LogitsMode::LastPerSequence,
        &mut s,
    )
    .unwrap();
    assert!(out[..97]
        .iter()
        .zip(&sa)
        .all(|(x, y)| x.to_bits() == y.to_bits()));
    assert!(out[97..]
        .iter()
        .zip(&sb)
        .all(|(x, y)| x.to_bits() == y.to_bits()));
}

#[test]
fn bad_inputs_are_rejected() {
    let w = random_model(
        &tiny(RopeStyle::Interleaved, 4, 2),
        DType::F32,
        DType::F32,
        1,
    );
    let m = model(&w, 1);
    let mut s = Scratch::new(&m, 4, 16);
    let mut kv = KvStore::for_model(&w.config, 8, 4).unwrap();
    let mut out = vec![0f32; 97];
    let mk = |pos: &'static [u32], last: &'static [u32], idx: &'static [u32]| DecodeBatch {
        tokens: &[1],
        positions: pos,
        kv_indptr: &[0, 1],
        kv_indices: idx,
        kv_last_page_len: last,
    };
    // Position disagrees with the pages' extent.
    assert!(m
        .forward_decode(mk(&[3], &[2], &[0]), &mut kv, &mut out, &mut s)
        .is_err());
    // Page out of range.
    assert!(m
        .forward_decode(mk(&[0], &[1], &[8]), &mut kv, &mut out, &mut s)
        .is_err());
    // Last page length 0.
    assert!(m
        .forward_decode(mk(&[0], &[0], &[0]), &mut kv, &mut out, &mut s)
        .is_err());
    // Wrong logits length.
    assert!(m
        .forward_decode(mk(&[0], &[1], &[0]), &mut kv, &mut out[..5], &mut s)
        .is_err());
    // Token out of vocab.
    let b = DecodeBatch {
        tokens: &[500],
        positions: &[0],
        kv_indptr: &[0, 1],
        kv_indices: &[0],
        kv_last_page_len: &[1],
    };
    assert!(m.forward_decode(b, &mut kv, &mut out, &mut s).is_err());
    assert!(m
        .forward_decode(mk(&[0], &[1], &[0]), &mut kv, &mut out, &mut s)
        .is_ok());
}

/// A prefix-cache hit: sequence B shares A's first two full pages, gets a
/// copy of A's partially filled third page, and prefills only its own tail
/// from `start_pos` 10. Its logits equal a from-scratch prefill of B.
#[test]
fn prefix_hit_with_shared_and_copied_pages_equals_full_prefill() {
    let w = random_model(
        &tiny(RopeStyle::Interleaved, 4, 2),
        DType::Q4_1,
        DType::Q8_0,
        8,
    );
    let m = model(&w, 2);
    let mut s = Scratch::new(&m, 32, 64);
    let mut kv = KvStore::for_model(&w.config, 32, 4).unwrap();
    let a = tokens(10, 5, 97);
    let mut b = a.clone();
    b.extend(tokens(7, 6, 97));
    let pa = vec![3u32, 9, 4];
    prefill(&m, &mut kv, &mut s, &pa, 0, &a, LogitsMode::LastPerSequence);
    kv.copy_page(4, 20, 2).unwrap();
    let pb = vec![3u32, 9, 20, 11, 17];
    let hit = prefill(&m, &mut kv, &mut s, &pb, 10, &b[10..], LogitsMode::All);
    let mut kv2 = KvStore::for_model(&w.config, 32, 4).unwrap();
    let full = prefill(
        &m,
        &mut kv2,
        &mut s,
        &[0, 1, 2, 5, 6],
        0,
        &b,
        LogitsMode::All,
    );
    assert_eq!(hit.len(), 7 * 97);
    assert!(hit
        .iter()
        .zip(&full[10 * 97..])
        .all(|(x, y)| x.to_bits() == y.to_bits()));
    assert!(kv.copy_page(4, 32, 1).is_err());
}
