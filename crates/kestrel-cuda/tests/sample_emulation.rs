//! A host emulation of `kernels/sample.cu`'s selection logic, checked against
//! kestrel-cpu's sampler (the reference) on random rows: masks, penalties,
//! temperature, top-k and top-p by bisection on order-preserving keys (with
//! ties broken by id), min-p, the seeded draw, greedy, logprobs and top-n.
//!
//! One "thread" does every block reduction here, so this checks the
//! algorithm (which the GPU has never run) but not the kernel's reduction
//! order. Every case's token is compared exactly with the CPU's (a draw
//! within rounding of a candidate boundary would fail it; none does at these
//! seeds). Keep it in step with the kernel when either changes.

use kestrel_cpu::kernels::ops::exp as kexp;
use kestrel_cpu::sampler::{sample, uniform, PenaltyState, SamplingParams};

fn fkey(f: f32) -> u32 {
    let b = f.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// `upper_mid` of sample.cu.
fn upper_mid(lo: u32, hi: u32) -> u32 {
    hi - (hi - lo) / 2
}

/// Largest `x` in `lo..=hi` with `p(x)`, given `p(lo)`; counts iterations.
fn bisect_last(mut lo: u32, mut hi: u32, p: impl Fn(u32) -> bool) -> (u32, u32) {
    let mut iters = 0;
    while lo < hi {
        let mid = upper_mid(lo, hi);
        if p(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
        iters += 1;
        assert!(iters <= 33, "bisection does not terminate");
    }
    (lo, iters)
}

/// Smallest `x` in `lo..=hi` with `p(x)`, given `p(hi)`.
fn bisect_first(mut lo: u32, mut hi: u32, p: impl Fn(u32) -> bool) -> u32 {
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if p(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

const NEG: f32 = f32::NEG_INFINITY;

/// `sample_rows` for one row. Returns (token, logprob, top-n pairs).
fn emulate(
    logits: &[f32],
    p: &SamplingParams,
    mask: Option<&[u32]>,
    counts: &[u32],
    position: u32,
    top_n: usize,
) -> (u32, f32, Vec<(u32, f32)>) {
    let vocab = logits.len();
    let mut v = logits.to_vec();
    let greedy = p.temperature <= 0.0;
    let inv_t = if greedy { 1.0 } else { 1.0 / p.temperature };
    let (rp, fp, pp) = (
        p.repetition_penalty,
        p.frequency_penalty,
        p.presence_penalty,
    );
    let pen = rp != 1.0 || fp != 0.0 || pp != 0.0;
    // 1. mask, penalties, temperature.
    for (t, l) in v.iter_mut().enumerate() {
        if mask.is_some_and(|m| (m[t >> 5] >> (t & 31)) & 1 == 0) {
            *l = NEG;
        }
        if pen && counts[t] > 0 {
            if rp != 1.0 {
                *l = if *l > 0.0 { *l / rp } else { *l * rp };
            }
            *l -= fp * counts[t] as f32 + pp;
        }
        *l = if *l > NEG { *l * inv_t } else { NEG };
    }
    let mx = v.iter().fold(NEG, |m, &l| m.max(l));
    let count = v.iter().filter(|&&l| l > NEG).count() as u32;
    if count == 0 {
        return (0, NEG, vec![(0, NEG); top_n]);
    }
    let cut = |v: &mut [f32], k: u32, x: u32| {
        for (t, l) in v.iter_mut().enumerate() {
            let key = fkey(*l);
            if !(key > k || (key == k && (t as u32) < x)) {
                *l = NEG;
            }
        }
    };
    // 2. top-k.
    if !greedy && p.top_k > 0 && p.top_k < count {
        let k = p.top_k;
        let ge = |m: u32| v.iter().filter(|&&l| fkey(l) >= m).count() as u32;
        let (kk, _) = bisect_last(fkey(NEG) + 1, u32::MAX, |m| ge(m) >= k);
        let gt = v.iter().filter(|&&l| fkey(l) > kk).count() as u32;
        let need = k - gt;
        let x = bisect_first(1, vocab as u32, |m| {
            v[..m as usize].iter().filter(|&&l| fkey(l) == kk).count() as u32 >= need
        });
        cut(&mut v, kk, x);
    }
    let mass = |v: &[f32], f: &dyn Fn(usize, f32) -> bool| -> f64 {
        v.iter()
            .enumerate()
            .filter(|&(t, &l)| l > NEG && f(t, l))
            .map(|(_, &l)| kexp(l - mx) as f64)
            .sum()
    };
    // 3. top-p.
    if !greedy && p.top_p < 1.0 {
        let z = mass(&v, &|_, _| true);
        let target = p.top_p as f64 * z;
        let lo = fkey(NEG) + 1;
        if mass(&v, &|_, l| fkey(l) >= lo) >= target {
            let (kk, _) = bisect_last(lo, u32::MAX, |m| mass(&v, &|_, l| fkey(l) >= m) >= target);
            let gt = mass(&v, &|_, l| fkey(l) > kk);
            let x = bisect_first(1, vocab as u32, |m| {
                gt + mass(&v, &|t, l| (t as u32) < m && fkey(l) == kk) >= target
            });
            cut(&mut v, kk, x);
        }
    }
    // 4. min-p.
    if !greedy && p.min_p > 0.0 {
        let floor = mx + p.min_p.ln();
        v.iter_mut().filter(|l| **l < floor).for_each(|l| *l = NEG);
    }
    // 5. final distribution and the pick.
    let z = mass(&v, &|_, _| true);
    let lz = mx + z.ln() as f32;
    let token = if greedy {
        v.iter().position(|&l| l == mx).unwrap() as u32
    } else {
        let u = uniform(p.seed, position) * z;
        let mut acc = 0f64;
        let mut pick = None;
        let mut last = 0;
        for (t, &l) in v.iter().enumerate() {
            if l > NEG {
                last = t as u32;
                acc += kexp(l - mx) as f64;
                if acc > u {
                    pick = Some(t as u32);
                    break;
                }
            }
        }
        pick.unwrap_or(last)
    };
    let lp = v[token as usize] - lz;
    // 6. top-n, best first, lowest id on ties.
    let mut top = Vec::with_capacity(top_n);
    for _ in 0..top_n {
        let best = v.iter().fold(NEG, |m, &l| m.max(l));
        match v.iter().position(|&l| l == best && best > NEG) {
            Some(id) => {
                top.push((id as u32, best - lz));
                v[id] = NEG;
            }
            None => top.push((0, NEG)),
        }
    }
    (token, lp, top)
}

fn splitmix(z: &mut u64) -> u64 {
    *z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut x = *z;
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn unit(z: &mut u64) -> f32 {
    (splitmix(z) >> 40) as f32 / (1u64 << 24) as f32
}

#[test]
fn bisection_over_all_of_u32_terminates() {
    // The old midpoint `lo + (hi - lo + 1) / 2` wrapped to `lo` here.
    assert_eq!(bisect_last(0, u32::MAX, |_| true), (u32::MAX, 32));
    assert_eq!(bisect_last(0, u32::MAX, |m| m == 0).0, 0);
    assert_eq!(bisect_last(7, 8, |m| m <= 8).0, 8);
    let src = kestrel_cuda::kernels::SOURCES
        .iter()
        .find(|k| k.file == "sample.cu")
        .expect("sample.cu")
        .source;
    assert!(src.contains("return hi - (hi - lo) / 2;"));
    assert!(!src.contains("mid = lo + (hi - lo + 1)"));
}

#[test]
fn emulated_kernel_matches_the_cpu_sampler() {
    let vocab: usize = 300;
    let mut z = 42u64;
    let (mut compared, mut draws) = (0, 0);
    for case in 0..400u32 {
        // Coarse logits so ties are common; some rows masked, some penalized.
        let logits: Vec<f32> = (0..vocab)
            .map(|_| (unit(&mut z) * 16.0).round() / 2.0 - 4.0)
            .collect();
        let p = SamplingParams {
            temperature: [0.0, 0.7, 1.0, 1.3][case as usize % 4],
            top_k: [0, 1, 5, 40, 299, 300][(case / 4) as usize % 6],
            top_p: [1.0, 0.9, 0.5, 0.05][(case / 24) as usize % 4],
            min_p: [0.0, 0.05, 0.3][(case / 96) as usize % 3],
            repetition_penalty: if case % 3 == 0 { 1.3 } else { 1.0 },
            frequency_penalty: if case % 5 == 0 { 0.4 } else { 0.0 },
            presence_penalty: if case % 7 == 0 { 0.25 } else { 0.0 },
            seed: splitmix(&mut z),
            top_logprobs: case % 6,
            logprobs: true,
            // The CUDA sampler has no bias (the engine refuses one there).
            logit_bias: Default::default(),
        };
        let mask: Option<Vec<u32>> = (case % 4 == 1).then(|| {
            (0..vocab.div_ceil(32))
                .map(|_| (splitmix(&mut z) & splitmix(&mut z)) as u32)
                .collect()
        });
        let mut state = PenaltyState::new(vocab);
        let mut counts = vec![0u32; vocab];
        for _ in 0..20 {
            let t = (splitmix(&mut z) % vocab as u64) as u32;
            state.record(t);
            counts[t as usize] += 1;
        }
        let position = case * 3 + 1;
        let top_n = p.top_logprobs as usize;
        let (tok, lp, top) = emulate(&logits, &p, mask.as_deref(), &counts, position, top_n);
        let mut cpu_logits = logits.clone();
        let cpu = sample(
            &mut cpu_logits,
            &p,
            mask.as_deref(),
            &mut state,
            position,
            top_n,
        );
        let Some(cpu) = cpu else {
            assert_eq!((tok, lp), (0, NEG), "case {case}");
            continue;
        };
        compared += 1;
        draws += usize::from(p.temperature > 0.0);
        assert_eq!(tok, cpu.token, "case {case}: {p:?}");
        assert!(
            (lp - cpu.logprob).abs() < 1e-4,
            "case {case}: {lp} vs {}",
            cpu.logprob
        );
        let cpu_top = cpu.top.as_slice();
        for (j, &(id, l)) in top.iter().enumerate() {
            match cpu_top.get(j) {
                Some(&(cid, cl)) => {
                    assert_eq!(id, cid, "case {case} top {j}");
                    assert!((l - cl).abs() < 1e-4, "case {case} top {j}");
                }
                None => assert_eq!((id, l), (0, NEG), "case {case} top {j} padding"),
            }
        }
    }
    assert!(
        compared > 350 && draws > 250,
        "{compared} rows, {draws} draws"
    );
}
