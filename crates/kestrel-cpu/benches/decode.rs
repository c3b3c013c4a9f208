//! Full forward-step benches on SmolLM2-135M's shape with random weights
//! (Q4_1 layers, Q8_0 tied embeddings): a decode step at batch 1, 8 and 32
//! (each sequence at position 127 over non-contiguous 16-token pages) and a
//! 128-token prefill, in the default numerics (fast). tokens/s = batch /
//! step time.

mod common;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kestrel_cpu::synth::{random_model, smollm2_config, DecodeInputs, PrefillInputs};
use kestrel_cpu::{CpuModel, CpuModelOptions, KvStore, LogitsMode, Scratch};
use kestrel_model::DType;

const PAGE: usize = 16;
const CTX: usize = 128;

fn bench(c: &mut Criterion) {
    let threads = common::threads();
    let cfg = smollm2_config();
    let model = CpuModel::new(
        random_model(&cfg, DType::Q4_1, DType::Q8_0, 7),
        CpuModelOptions {
            threads,
            ..Default::default()
        },
    )
    .unwrap();
    eprintln!(
        "weights {} MiB, streamed per token {} MiB, isa {:?}",
        model.weight_bytes() >> 20,
        model.bytes_per_token() >> 20,
        model.isa()
    );
    let pages_per_seq = CTX / PAGE;
    let mut kv = KvStore::for_model(&cfg, 32 * pages_per_seq + 8, PAGE).unwrap();
    let mut scratch = Scratch::new(&model, 128, 1024);
    let vocab = cfg.vocab_size;
    let mut g = c.benchmark_group("decode_step");
    g.sample_size(10);
    for batch in [1usize, 8, 32] {
        let inputs = DecodeInputs::interleaved(batch, CTX, PAGE);
        let mut out = vec![0f32; batch * vocab];
        g.throughput(Throughput::Elements(batch as u64));
        g.bench_with_input(BenchmarkId::from_parameter(batch), &batch, |b, _| {
            b.iter(|| {
                model
                    .forward_decode(inputs.batch(), &mut kv, &mut out, &mut scratch)
                    .unwrap();
            })
        });
    }
    g.finish();
    let mut g = c.benchmark_group("prefill");
    g.sample_size(10);
    let n = 128;
    let inputs = PrefillInputs::fresh(n, PAGE, vocab);
    let mut out = vec![0f32; vocab];
    g.throughput(Throughput::Elements(n as u64));
    g.bench_function(BenchmarkId::from_parameter(n), |b| {
        b.iter(|| {
            model
                .forward_prefill(
                    inputs.batch(),
                    &mut kv,
                    &mut out,
                    LogitsMode::LastPerSequence,
                    &mut scratch,
                )
                .unwrap();
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
