//! Shared fixtures: an f64 reference forward pass (contiguous, unpaged), a
//! toy page allocator that hands out shuffled, non-contiguous pages, and
//! one sequence's greedy prefill + decode (what every check against a
//! reference's greedy tokens runs), and the matmul batch-invariance check
//! both numerics run.

#![allow(dead_code)]

use kestrel_cpu::kernels::matmul::{dequant_row, matmul, MatRef};
use kestrel_cpu::kernels::Weight;
use kestrel_cpu::synth::{random_matrix, Rng};
use kestrel_cpu::{
    sample, CpuModel, DecodeBatch, Isa, KvStore, LogitsMode, Numerics, PenaltyState, PrefillBatch,
    SamplingParams, Scratch, Team,
};
use kestrel_model::{DType, Matrix, ModelWeights, RopeStyle};

/// A matmul's output row for an activation row is the same bits whatever
/// the batch it rides in and the thread count: for each dtype, every
/// `(threads, n)` batch of a 203-row matrix against the row computed alone
/// (n = 1, one thread), checked at the batch's first, middle and last row.
/// `cols_256` is K for 256-element block types (160 for the others).
pub fn assert_matmul_batch_invariant(
    numerics: Numerics,
    dtypes: impl IntoIterator<Item = DType>,
    seed: u64,
    cols_256: usize,
) {
    for dtype in dtypes {
        let (rows, cols) = (
            203,
            if dtype.block_elems() == 256 {
                cols_256
            } else {
                160
            },
        );
        let mut rng = Rng(seed);
        let m = random_matrix(&mut rng, dtype, rows, cols, 1.0);
        let w = Weight::prepare("w", &m).unwrap();
        let w = w.mat();
        let xs = rng.vec(70 * cols, 1.0);
        let alone = |c: usize| {
            let mut y = vec![0f32; rows];
            let x = &xs[c * cols..(c + 1) * cols];
            matmul(None, Isa::detect(), numerics, w, x, 1, &mut y);
            y
        };
        for (threads, n) in [(1, 8), (2, 12), (2, 32), (2, 70), (3, 5), (2, 3)] {
            let p = Team::new(threads, "test").unwrap();
            let mut y = vec![0f32; n * rows];
            let x = &xs[..n * cols];
            matmul(Some(&p), Isa::detect(), numerics, w, x, n, &mut y);
            for c in [0, n / 2, n - 1] {
                assert!(
                    alone(c)
                        .iter()
                        .zip(&y[c * rows..(c + 1) * rows])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{numerics:?} {dtype:?} n={n} threads={threads} row {c}"
                );
            }
        }
    }
}

/// One sequence on pages `0..` of `page` tokens: prefills `prompt`, then
/// picks `steps` tokens greedily (the sampler's greedy: argmax, lowest id on
/// ties), decoding each pick but the last. `at_step(step, logits)` sees a
/// step's logits before its pick. Returns the picks.
pub fn greedy_decode(
    model: &CpuModel,
    prompt: &[u32],
    steps: usize,
    page: usize,
    mut at_step: impl FnMut(usize, &[f32]),
) -> Vec<u32> {
    let vocab = model.config().vocab_size;
    let len = prompt.len();
    let npages = (len + steps).div_ceil(page);
    let pages: Vec<u32> = (0..npages as u32).collect();
    let mut kv = KvStore::for_model(model.config(), npages, page).unwrap();
    let mut scratch = Scratch::new(model, len, len + steps);
    let mut logits = vec![0f32; vocab];
    let b = PrefillBatch {
        tokens: prompt,
        qo_indptr: &[0, len as u32],
        start_pos: &[0],
        kv_indptr: &[0, len.div_ceil(page) as u32],
        kv_indices: &pages,
        kv_last_page_len: &[((len - 1) % page + 1) as u32],
    };
    model
        .forward_prefill(
            b,
            &mut kv,
            &mut logits,
            LogitsMode::LastPerSequence,
            &mut scratch,
        )
        .unwrap();
    let mut st = PenaltyState::new(vocab);
    let mut picks = Vec::with_capacity(steps);
    for step in 0..steps {
        at_step(step, &logits);
        let pos = (len + step) as u32;
        let tok = sample(
            &mut logits,
            &SamplingParams::greedy(),
            None,
            &mut st,
            pos,
            0,
        )
        .unwrap()
        .token;
        picks.push(tok);
        if step + 1 == steps {
            break;
        }
        let n = pos as usize + 1;
        let b = DecodeBatch {
            tokens: &[tok],
            positions: &[pos],
            kv_indptr: &[0, n.div_ceil(page) as u32],
            kv_indices: &pages,
            kv_last_page_len: &[((n - 1) % page + 1) as u32],
        };
        model
            .forward_decode(b, &mut kv, &mut logits, &mut scratch)
            .unwrap();
    }
    picks
}

fn deq(m: &Matrix) -> Vec<Vec<f64>> {
    let w = MatRef::new("m", m).unwrap();
    let mut buf = vec![0f32; m.cols];
    (0..m.rows)
        .map(|r| {
            dequant_row(&w, r, &mut buf);
            buf.iter().map(|&v| v as f64).collect()
        })
        .collect()
}

fn mv(w: &[Vec<f64>], x: &[f64]) -> Vec<f64> {
    w.iter()
        .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

fn rms(x: &[f64], w: &[f32], eps: f32) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    x.iter().zip(w).map(|(v, &g)| v * inv * g as f64).collect()
}

fn rope(x: &mut [f64], hd: usize, pos: usize, theta: f32, style: RopeStyle) {
    let half = hd / 2;
    for head in x.chunks_exact_mut(hd) {
        for i in 0..half {
            let ang = pos as f64 * (theta as f64).powf(-2.0 * i as f64 / hd as f64);
            let (a, b) = match style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::HalfSplit => (i, i + half),
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * ang.cos() - x1 * ang.sin();
            head[b] = x0 * ang.sin() + x1 * ang.cos();
        }
    }
}

/// All-position logits of `tokens` from position 0, in f64.
pub fn reference_logits(w: &ModelWeights, tokens: &[u32]) -> Vec<Vec<f64>> {
    let c = &w.config;
    let (hd, nh, nkv) = (c.head_dim, c.num_heads, c.num_kv_heads);
    let emb = deq(&w.token_embd);
    let head = deq(&w.lm_head);
    let mut xs: Vec<Vec<f64>> = tokens.iter().map(|&t| emb[t as usize].clone()).collect();
    for l in &w.layers {
        let (wq, wk, wv, wo) = (deq(&l.wq), deq(&l.wk), deq(&l.wv), deq(&l.wo));
        let gate = l
            .w_gate
            .as_ref()
            .expect("the f64 reference is Llama's gated FFN");
        let (wg, wu, wd) = (deq(gate), deq(&l.w_up), deq(&l.w_down));
        let mut ks = vec![];
        let mut vs = vec![];
        let mut qs = vec![];
        for (p, x) in xs.iter().enumerate() {
            let xn = rms(x, &l.attn_norm, c.rms_norm_eps);
            let add = |mut v: Vec<f64>, b: &Option<Vec<f32>>| {
                if let Some(b) = b {
                    v.iter_mut().zip(b).for_each(|(a, &b)| *a += b as f64);
                }
                v
            };
            let mut q = add(mv(&wq, &xn), &l.bq);
            let mut k = add(mv(&wk, &xn), &l.bk);
            let v = add(mv(&wv, &xn), &l.bv);
            rope(&mut q, hd, p, c.rope_theta, c.rope_style);
            rope(&mut k, hd, p, c.rope_theta, c.rope_style);
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (p, x) in xs.iter_mut().enumerate() {
            let mut att = vec![0f64; nh * hd];
            for h in 0..nh {
                let g = h / (nh / nkv);
                let q = &qs[p][h * hd..(h + 1) * hd];
                let s: Vec<f64> = (0..=p)
                    .map(|j| {
                        q.iter()
                            .zip(&ks[j][g * hd..(g + 1) * hd])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for j in 0..=p {
                    for d in 0..hd {
                        att[h * hd + d] += e[j] / z * vs[j][g * hd + d];
                    }
                }
            }
            let o = mv(&wo, &att);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let xn = rms(x, &l.ffn_norm, c.rms_norm_eps);
            let g = mv(&wg, &xn);
            let u = mv(&wu, &xn);
            let a: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let d = mv(&wd, &a);
            x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        }
    }
    xs.iter()
        .map(|x| mv(&head, &rms(x, &w.output_norm, c.rms_norm_eps)))
        .collect()
}

/// Hands out pages in a shuffled order so sequences are non-contiguous.
#[derive(Debug)]
pub struct Pages {
    free: Vec<u32>,
    pub page_size: usize,
}

impl Pages {
    pub fn new(num_pages: usize, page_size: usize, seed: u64) -> Self {
        let mut free: Vec<u32> = (0..num_pages as u32).collect();
        let mut rng = Rng(seed);
        for i in (1..free.len()).rev() {
            free.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        Pages { free, page_size }
    }

    /// Grow `pages` to cover `len` positions.
    pub fn grow(&mut self, pages: &mut Vec<u32>, len: usize) {
        while pages.len() * self.page_size < len {
            pages.push(self.free.pop().expect("out of pages"));
        }
    }

    pub fn last_len(&self, len: usize) -> u32 {
        ((len - 1) % self.page_size + 1) as u32
    }
}

/// FlashInfer-style indices for several sequences.
pub fn indices(seqs: &[(&[u32], usize)], page_size: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut indptr = vec![0u32];
    let mut idx = vec![];
    let mut last = vec![];
    for (pages, len) in seqs {
        idx.extend_from_slice(pages);
        indptr.push(idx.len() as u32);
        last.push(((len - 1) % page_size + 1) as u32);
    }
    (indptr, idx, last)
}
