//! Sampler properties: masks are respected, greedy is argmax with lowest-id
//! ties, the same (seed, position) gives the same token whatever else is
//! sampled, top-k/top-p/min-p keep only allowed sets, penalties move logits
//! as documented, logprobs are consistent.

use kestrel_cpu::sampler::{sample, uniform, PenaltyState, SamplingParams};
use kestrel_cpu::synth::Rng;
use kestrel_pipeline::LogitBias;
use proptest::prelude::*;

fn logits(n: usize, seed: u64) -> Vec<f32> {
    Rng(seed).vec(n, 4.0)
}

fn params(t: f32) -> SamplingParams {
    SamplingParams {
        temperature: t,
        seed: 42,
        ..Default::default()
    }
}

#[test]
fn greedy_is_argmax_with_lowest_id_ties() {
    let mut l = vec![0.0f32; 100];
    l[7] = 3.0;
    l[3] = 3.0;
    l[90] = 2.9;
    let mut st = PenaltyState::new(100);
    let s = sample(
        &mut l.clone(),
        &SamplingParams::greedy(),
        None,
        &mut st,
        0,
        3,
    )
    .unwrap();
    assert_eq!(s.token, 3);
    assert_eq!(s.top.as_slice()[0].0, 3);
    assert_eq!(s.top.as_slice()[1].0, 7);
    let z: f32 = l.iter().map(|v| (v - 3.0).exp()).sum();
    assert!((s.logprob - (-z.ln())).abs() < 1e-5);
}

#[test]
fn logit_bias_moves_logits_and_never_unmasks() {
    let vocab: usize = 64;
    let mut st = PenaltyState::new(vocab);
    let base = logits(vocab, 3);
    let greedy = |bias: Vec<(u32, f32)>, mask: Option<&[u32]>, st: &mut PenaltyState| {
        let p = SamplingParams {
            logit_bias: LogitBias::new(bias),
            ..SamplingParams::greedy()
        };
        sample(&mut base.clone(), &p, mask, st, 0, 2).unwrap()
    };
    let top = greedy(vec![], None, &mut st).token;
    // +100 makes a token the argmax; -100 bans the argmax.
    let lifted = (top + 1) % vocab as u32;
    assert_eq!(greedy(vec![(lifted, 100.0)], None, &mut st).token, lifted);
    assert_ne!(greedy(vec![(top, -100.0)], None, &mut st).token, top);
    // The reported logprob is of the biased distribution.
    let s = greedy(vec![(lifted, 100.0)], None, &mut st);
    assert!(s.logprob > -1e-3, "{}", s.logprob);
    // A masked-out token stays masked whatever its bias.
    let mut mask = vec![0u32; vocab.div_ceil(32)];
    mask[top as usize / 32] |= 1 << (top % 32);
    assert_eq!(
        greedy(vec![(lifted, 100.0)], Some(&mask), &mut st).token,
        top
    );
}

#[test]
fn mask_is_respected_and_empty_mask_gives_none() {
    let vocab: usize = 1000;
    let mut mask = vec![0u32; vocab.div_ceil(32)];
    for t in [5usize, 77, 640, 999] {
        mask[t / 32] |= 1 << (t % 32);
    }
    let mut st = PenaltyState::new(vocab);
    for pos in 0..200 {
        let s = sample(
            &mut logits(vocab, pos as u64),
            &params(1.5),
            Some(&mask),
            &mut st,
            pos,
            5,
        )
        .unwrap();
        assert!([5, 77, 640, 999].contains(&s.token));
        assert!(s.top.as_slice().len() <= 4);
    }
    let g = sample(
        &mut logits(vocab, 1),
        &SamplingParams::greedy(),
        Some(&mask),
        &mut st,
        0,
        0,
    )
    .unwrap();
    assert!([5, 77, 640, 999].contains(&g.token));
    let none = vec![0u32; mask.len()];
    assert!(sample(
        &mut logits(vocab, 1),
        &params(1.0),
        Some(&none),
        &mut st,
        0,
        0
    )
    .is_none());
}

#[test]
fn same_seed_and_position_give_the_same_token() {
    let vocab = 49152;
    let base = logits(vocab, 9);
    let mut a = PenaltyState::new(vocab);
    let mut b = PenaltyState::new(vocab);
    let p = SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        top_k: 50,
        seed: 1234,
        ..Default::default()
    };
    let mut diff = 0;
    for pos in 0..50 {
        let x = sample(&mut base.clone(), &p, None, &mut a, pos, 0).unwrap();
        // Interleave unrelated work with the other state.
        let _ = sample(
            &mut logits(vocab, pos as u64),
            &params(1.0),
            None,
            &mut b,
            pos + 7,
            2,
        );
        let y = sample(&mut base.clone(), &p, None, &mut b, pos, 0).unwrap();
        assert_eq!(x.token, y.token);
        let z = sample(
            &mut base.clone(),
            &SamplingParams {
                seed: 99,
                ..p.clone()
            },
            None,
            &mut b,
            pos,
            0,
        )
        .unwrap();
        diff += (z.token != x.token) as usize;
    }
    assert!(diff > 0, "different seeds should differ somewhere");
    assert_ne!(uniform(1, 2), uniform(1, 3));
    assert_eq!(uniform(5, 9), uniform(5, 9));
}

#[test]
fn penalties_follow_their_definitions() {
    let mut st = PenaltyState::new(8);
    st.record(1);
    st.record(1);
    st.record(2);
    let l = [0.0f32, 2.0, -2.0, 1.0, 0.0, 0.0, 0.0, 0.0];
    let p = SamplingParams {
        temperature: 0.0,
        repetition_penalty: 2.0,
        frequency_penalty: 0.5,
        presence_penalty: 0.25,
        ..Default::default()
    };
    let mut x = l;
    sample(&mut x, &p, None, &mut st, 0, 0).unwrap();
    assert_eq!(x[1], 2.0 / 2.0 - 0.5 * 2.0 - 0.25);
    assert_eq!(x[2], -2.0 * 2.0 - 0.5 - 0.25);
    assert_eq!(x[3], 1.0);
    st.clear();
    assert_eq!(st.count(1), 0);
}

proptest! {
    #[test]
    fn filters_bound_the_support(seed in 0u64..1000, k in 1u32..20, top_p in 0.05f32..1.0, min_p in 0.0f32..0.5, t in 0.2f32..2.0) {
        let vocab = 300;
        let l = logits(vocab, seed);
        let mut st = PenaltyState::new(vocab);
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
        let rank = |tok: u32| order.iter().position(|&o| o == tok as usize).unwrap();
        // top-k: only the k best.
        let s = sample(&mut l.clone(), &SamplingParams { temperature: t, top_k: k, seed, ..Default::default() }, None, &mut st, 3, 0).unwrap();
        prop_assert!(rank(s.token) < k as usize);
        // top-p: the token is inside the smallest prefix with mass >= p.
        let s = sample(&mut l.clone(), &SamplingParams { temperature: t, top_p, seed, ..Default::default() }, None, &mut st, 3, 0).unwrap();
        let max = l[order[0]] / t;
        let z: f64 = l.iter().map(|v| ((v / t - max) as f64).exp()).sum();
        let mut acc = 0.0;
        let mut cut = vocab;
        for (i, &o) in order.iter().enumerate() {
            acc += ((l[o] / t - max) as f64).exp() / z;
            if acc >= top_p as f64 - 1e-6 { cut = i + 1; break; }
        }
        prop_assert!(rank(s.token) < cut + 1);
        // min-p: p(token) >= min_p * p_max.
        let s = sample(&mut l.clone(), &SamplingParams { temperature: t, min_p, seed, ..Default::default() }, None, &mut st, 3, 4).unwrap();
        prop_assert!(l[s.token as usize] / t >= max + min_p.ln() - 1e-5);
        // Logprobs of the final distribution are <= 0 and sorted.
        let top = s.top.as_slice();
        prop_assert!(top.windows(2).all(|w| w[0].1 >= w[1].1));
        prop_assert!(s.logprob <= 1e-6);
        if let Some(&(tok, lp)) = top.iter().find(|(tok, _)| *tok == s.token) {
            prop_assert!((lp - s.logprob).abs() < 1e-5, "{tok}");
        }
    }
}

/// A greedy row that asks for no logprobs takes the argmax-only path: it
/// picks the same token as the full path (ties to the lowest id, masked and
/// -inf tokens excluded) and reports NaN instead of a logprob.
#[test]
fn greedy_fast_path_matches_the_full_path() {
    let vocab = 3000usize;
    let mut st = PenaltyState::new(vocab);
    for seed in 0..200u64 {
        let mut l = logits(vocab, seed);
        // Quantize so ties happen, and knock some tokens out.
        for (t, v) in l.iter_mut().enumerate() {
            *v = (*v * 2.0).round();
            if (t as u64 + seed).is_multiple_of(11) {
                *v = f32::NEG_INFINITY;
            }
            if (t as u64 + seed).is_multiple_of(13) {
                *v = if t % 2 == 0 { f32::NAN } else { -f32::NAN };
            }
        }
        let mut mask = vec![0u32; vocab.div_ceil(32)];
        for t in (seed as usize % 7..vocab).step_by(3) {
            mask[t / 32] |= 1 << (t % 32);
        }
        for m in [None, Some(&mask[..])] {
            let fast = sample(&mut l.clone(), &SamplingParams::greedy(), m, &mut st, 0, 0).unwrap();
            let full_params = SamplingParams {
                logprobs: true,
                ..SamplingParams::greedy()
            };
            let full = sample(&mut l.clone(), &full_params, m, &mut st, 0, 0).unwrap();
            assert_eq!(fast.token, full.token, "seed {seed}");
            assert!(fast.logprob.is_nan() && full.logprob <= 0.0);
        }
    }
    // Signed zeros: the full path orders -0.0 below +0.0 (`total_cmp`).
    let zeros = [-1.0, -0.0, 0.0, -0.0];
    let fast = sample(
        &mut zeros.to_vec(),
        &SamplingParams::greedy(),
        None,
        &mut st,
        0,
        0,
    );
    let full_params = SamplingParams {
        logprobs: true,
        ..SamplingParams::greedy()
    };
    let full = sample(&mut zeros.to_vec(), &full_params, None, &mut st, 0, 0);
    assert_eq!(full.map(|s| s.token), Some(2));
    assert_eq!(fast.map(|s| s.token), Some(2));
    let mut none = vec![f32::NEG_INFINITY; 8];
    assert!(sample(&mut none, &SamplingParams::greedy(), None, &mut st, 0, 0).is_none());
}
