//! Criterion benches of the KV bookkeeping hot paths: page allocate/free, prefix lookup for
//! a 4k-token prompt, and building the FlashInfer page-index buffer for 256 sequences.
//! Run: `cargo bench -p kestrel-kv -- --warm-up-time 1 --measurement-time 2`.

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kestrel_kv::{BlockPool, PageTable, PageTableConfig, PagedIndices};

const PS: usize = 16;

fn table(max_rows: usize, num_pages: usize) -> PageTable {
    PageTable::new(PageTableConfig {
        max_rows,
        num_pages,
        page_size: PS,
        enable_prefix_cache: true,
    })
    .unwrap()
}

fn page_ops(c: &mut Criterion) {
    let mut g = c.benchmark_group("page");
    const N: usize = 64;
    g.throughput(Throughput::Elements(N as u64));
    let mut pool = BlockPool::new(4096);
    let mut pages = Vec::with_capacity(N);
    g.bench_function("pool_alloc_free_x64", |b| {
        b.iter(|| {
            for _ in 0..N {
                pages.push(pool.alloc().unwrap().page);
            }
            for p in pages.drain(..) {
                pool.release(black_box(p));
            }
        })
    });
    let mut t = table(2, 4096);
    let row = t.allocate().unwrap();
    g.bench_function("table_reserve_shrink_x64", |b| {
        b.iter(|| {
            t.reserve(row, black_box(N * PS)).unwrap();
            t.shrink(row, 0).unwrap();
        })
    });
    // Growth that must evict: every page is cached, so each allocation takes the LRU head.
    let mut t = table(2, N);
    let r = t.allocate().unwrap();
    let tokens: Vec<u32> = (0..(N * PS) as u32).collect();
    t.reserve(r, tokens.len()).unwrap();
    t.register_prefix(r, &tokens);
    t.erase(r).unwrap();
    g.bench_function("table_reserve_evicting_x64", |b| {
        b.iter_batched_ref(
            || t.clone(),
            |t| {
                let row = t.allocate().unwrap();
                t.reserve(row, N * PS).unwrap();
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn prefix_lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefix");
    let prompt: Vec<u32> = (0..4096u32)
        .map(|i| i.wrapping_mul(2_654_435_761) >> 8)
        .collect();
    let mut t = table(4, 1024);
    let row = t.allocate().unwrap();
    t.reserve(row, prompt.len()).unwrap();
    t.register_prefix(row, &prompt);
    t.erase(row).unwrap();
    assert_eq!(t.peek_prefix(&prompt), 4096 - PS);
    g.throughput(Throughput::Elements(prompt.len() as u64));
    g.bench_function("peek_4k_tokens", |b| {
        b.iter(|| t.peek_prefix(black_box(&prompt)))
    });
    g.bench_function("allocate_with_prefix_4k_then_erase", |b| {
        b.iter(|| {
            let (row, hit) = t.allocate_with_prefix(black_box(&prompt)).unwrap();
            t.erase(row).unwrap();
            hit
        })
    });
    let cold: Vec<u32> = prompt.iter().map(|x| x ^ 1).collect();
    g.bench_function("register_4k_tokens", |b| {
        b.iter_batched_ref(
            || {
                let mut t = t.clone();
                let row = t.allocate().unwrap();
                t.reserve(row, cold.len()).unwrap();
                (t, row)
            },
            |(t, row)| t.register_prefix(*row, black_box(&cold)),
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

fn page_indices(c: &mut Criterion) {
    let mut g = c.benchmark_group("indices");
    const ROWS: usize = 256;
    let mut t = table(ROWS + 1, ROWS * 64);
    let batch: Vec<_> = (0..ROWS)
        .map(|i| {
            let row = t.allocate().unwrap();
            let kv_len = 512 + (i * 37) % 512;
            t.reserve(row, kv_len).unwrap();
            (row, kv_len)
        })
        .collect();
    let pages: usize = batch.iter().map(|&(_, len)| len.div_ceil(PS)).sum();
    let mut out = PagedIndices::with_capacity(ROWS, pages);
    g.throughput(Throughput::Elements(ROWS as u64));
    g.bench_function("write_indices_256_seqs", |b| {
        b.iter(|| t.write_indices(black_box(&batch), &mut out).unwrap())
    });
    g.finish();
}

criterion_group!(benches, page_ops, prefix_lookup, page_indices);
criterion_main!(benches);
