//! Paged decode attention at SmolLM2-135M's shape (9 query heads over 3 kv
//! heads, head_dim 64, pages of 16): one decode row for each of 32
//! sequences, every kv group, single-threaded, with each sequence's pages
//! interleaved with the others' as a busy pool leaves them. Each iteration
//! moves to the next of 8 layers' K/V arrays: 50 MB in all at context 128,
//! 200 MB at 512, against a 32 MB L3, so K/V come from memory as in a real
//! decode step. And one long prompt's row at the 1B shape (`prefill_row_1b`;
//! `prefill_row_1b_keys_t` over the keys transposed, as a prefill chunk's rows
//! score them).
//! `cargo bench -p kestrel-cpu --bench attention`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kestrel_cpu::kernels::attention::{
    attend_group, keys_t_len, scores_len, transpose_keys, PagedSeq,
};
use kestrel_cpu::synth::Rng;
use kestrel_cpu::Isa;

fn bench(c: &mut Criterion) {
    const SEQS: usize = 32;
    const LAYERS: usize = 8;
    const PAGE: usize = 16;
    const NKV: usize = 3;
    const GROUP: usize = 3;
    const HD: usize = 64;
    let mut rng = Rng(3);
    let mut g = c.benchmark_group("attention");
    for ctx in [128usize, 512] {
        let pps = ctx.div_ceil(PAGE);
        let floats = SEQS * pps * PAGE * NKV * HD;
        let k: Vec<Vec<f32>> = (0..LAYERS).map(|_| rng.vec(floats, 1.0)).collect();
        let v: Vec<Vec<f32>> = (0..LAYERS).map(|_| rng.vec(floats, 1.0)).collect();
        let pages: Vec<Vec<u32>> = (0..SEQS)
            .map(|s| (0..pps).map(|p| (p * SEQS + s) as u32).collect())
            .collect();
        let q = rng.vec(GROUP * HD, 4.0);
        let mut scores = vec![0f32; scores_len(GROUP, ctx)];
        let mut out = vec![0f32; GROUP * HD];
        let mut layer = 0;
        let isa = Isa::detect();
        g.throughput(Throughput::Elements((SEQS * ctx) as u64));
        g.bench_with_input(BenchmarkId::new("decode_32_seqs", ctx), &ctx, |b, &ctx| {
            b.iter(|| {
                layer = (layer + 1) % LAYERS;
                for pages in &pages {
                    let seq = PagedSeq {
                        pages,
                        page_size: PAGE,
                        num_kv_heads: NKV,
                        head_dim: HD,
                    };
                    for kg in 0..NKV {
                        attend_group(
                            isa,
                            &q,
                            &k[layer],
                            &v[layer],
                            seq,
                            kg,
                            ctx,
                            0.125,
                            None,
                            &mut scores,
                            &mut out,
                        );
                    }
                }
            })
        });
    }
    prefill(&mut g, &mut rng);
    g.finish();
}

/// A long prompt's attention at the Llama 3.2 1B shape (32 query heads over
/// 8 kv heads, head_dim 64): the query row at position `ctx - 1` of one
/// sequence (pages in order), every kv group, against one layer's K/V (a
/// prefill chunk's last row; 8 MiB of K at 4096 keys, so they come from L3
/// as they do when the prompt's rows run one after another).
fn prefill(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>, rng: &mut Rng) {
    const PAGE: usize = 16;
    const NKV: usize = 8;
    const GROUP: usize = 4;
    const HD: usize = 64;
    let isa = Isa::detect();
    for ctx in [512usize, 4096] {
        let pages: Vec<u32> = (0..ctx.div_ceil(PAGE) as u32).collect();
        let floats = pages.len() * PAGE * NKV * HD;
        let (k, v) = (rng.vec(floats, 1.0), rng.vec(floats, 1.0));
        let q = rng.vec(NKV * GROUP * HD, 4.0);
        let mut scores = vec![0f32; scores_len(GROUP, ctx)];
        let mut out = vec![0f32; GROUP * HD];
        let seq = PagedSeq {
            pages: &pages,
            page_size: PAGE,
            num_kv_heads: NKV,
            head_dim: HD,
        };
        // The same row against the keys transposed, as a prefill chunk's
        // rows read them (built once per chunk, outside the timing).
        let kts: Vec<Vec<f32>> = (0..NKV)
            .map(|kg| {
                let mut kt = vec![0f32; keys_t_len(ctx, HD)];
                transpose_keys(&k, seq, kg, ctx, &mut kt);
                kt
            })
            .collect();
        g.throughput(Throughput::Elements((NKV * ctx) as u64));
        for (name, keys_t) in [
            ("prefill_row_1b", None),
            ("prefill_row_1b_keys_t", Some(&kts)),
        ] {
            g.bench_with_input(BenchmarkId::new(name, ctx), &ctx, |b, &ctx| {
                b.iter(|| {
                    for (kg, qg) in q.chunks_exact(GROUP * HD).enumerate() {
                        let kt = keys_t.map(|kts| &kts[kg][..]);
                        attend_group(
                            isa,
                            qg,
                            &k,
                            &v,
                            seq,
                            kg,
                            ctx,
                            0.125,
                            kt,
                            &mut scores,
                            &mut out,
                        );
                    }
                })
            });
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
