//! Sampler benches over one SmolLM2-sized row (49152 logits): greedy
//! without logprobs (the argmax-only path), greedy with logprobs, and a
//! temperature + top-p draw. `cargo bench -p kestrel-cpu --bench sampler`.

use criterion::{criterion_group, criterion_main, Criterion};
use kestrel_cpu::synth::Rng;
use kestrel_cpu::{sample, PenaltyState, SamplingParams};

fn bench(c: &mut Criterion) {
    const VOCAB: usize = 49152;
    let mut row = Rng(5).vec(VOCAB, 8.0);
    let mut state = PenaltyState::new(VOCAB);
    let cases = [
        ("greedy", SamplingParams::greedy()),
        (
            "greedy_logprobs",
            SamplingParams {
                logprobs: true,
                ..SamplingParams::greedy()
            },
        ),
        (
            "top_p_0.9",
            SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                ..SamplingParams::greedy()
            },
        ),
    ];
    let mut g = c.benchmark_group("sample_49152");
    for (name, params) in cases {
        g.bench_function(name, |b| {
            // No mask and no penalties: `sample` leaves the row as it is, so
            // there is nothing to restore between iterations.
            b.iter(|| sample(&mut row, &params, None, &mut state, 7, 0))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
