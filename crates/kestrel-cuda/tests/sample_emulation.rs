//! The host device's `sample_rows` (`hostdev::sample_row`), an emulation of
//! `kernels/sample.cu`'s selection logic, checked against kestrel-cpu's
//! sampler (the reference) on random rows: masks, logit biases, penalties,
//! temperature, top-k and top-p by bisection on order-preserving keys (with
//! ties broken by id), min-p, the seeded draw, greedy, logprobs and top-n.
//!
//! One "thread" does every block reduction here, so this checks the
//! host device's stand-in, not the kernel: `sample.cu` itself runs on the
//! host against the same sampler (and this emulation) in
//! `tests/kernel_source.rs`
//! (`sample_kernel_matches_the_cpu_sampler_and_the_host_device`). Every case's token is compared exactly with the CPU's (a draw
//! within rounding of a candidate boundary would fail it; none does at these
//! seeds). Keep it in step with the kernel when either changes.

use kestrel_cpu::sampler::{sample, PenaltyState, SamplingParams};
use kestrel_cuda::ffi::SampleParams;
use kestrel_cuda::hostdev::{sample_row, SampleRow};
use kestrel_pipeline::LogitBias;

const NEG: f32 = f32::NEG_INFINITY;

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
            // Every fifth row biased: a ban, a boost (both in OpenAI's
            // range) and a small nudge, on tokens masked or not.
            logit_bias: if case % 5 == 2 {
                let t = |z: &mut u64| (splitmix(z) % vocab as u64) as u32;
                LogitBias::new([(t(&mut z), -100.0), (t(&mut z), 7.5), (t(&mut z), 0.5)])
            } else {
                LogitBias::default()
            },
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
        let row = SampleRow {
            mask: mask.as_deref(),
            bias: p.logit_bias.entries(),
            counts: &counts,
            position,
        };
        let (tok, lp, top) = sample_row(&logits, &SampleParams::from(&p), row, top_n);
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
