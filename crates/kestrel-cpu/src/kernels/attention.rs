//! Paged causal attention for one query token against a sequence's KV pages,
//! with grouped-query heads. Decode and prefill call the same per-query
//! routine, so a token's attention output is identical whether it arrived in
//! a prefill chunk or a decode step. Cost: `O(len * head_dim)` per head: one
//! pass over K (scores) and one over V, each K/V row loaded once for all the
//! query heads of its group; scores live in caller scratch.
//!
//! The arithmetic per head is fixed (the order of [`dot8`], the softmax sum
//! in 16 lanes ([`softmax::lane_sum16`]), FMAs into the output in key order), so
//! results do not depend on the group size, the ISA or how pages are laid
//! out. Walking page by page keeps
//! the page lookup (a division) out of the per-key loop, and several
//! independent dot products per K row keep the FMA units busy where one dot
//! alone would wait on its own accumulator chain. With AVX-512 a 512-bit
//! register holds two heads' eight `dot8` lanes (the score pass) or 16
//! output floats (the weighted sum, the softmax's `exp`): the same operations
//! lane for lane, half the instructions (`prefill_row_1b` in the attention
//! bench).
//!
//! A prefill chunk's rows all score the same keys: for them the keys can be
//! transposed once per kv head, a block of 16 keys at a time
//! ([`transpose_keys`]), so that the AVX-512 score pass holds 16 keys' sums
//! per register and needs no horizontal step per key ([`scores_t`]: the
//! same `dot8` products, chains and tree, so the same scores; about a
//! quarter off a 1B prompt row's attention, `prefill_row_1b_keys_t`).
//!
//! At many streams a decode step's KV is far larger than the caches, so the
//! kernel is bound by memory: each page holds one kv head's rows as one
//! contiguous block ([`crate::KvStore`]), the score pass hints the next K
//! page and (up to `V_AHEAD_BYTES` of V per kv head) the current V page
//! into L2, and the weighted sum reads each V page once (`cargo bench -p
//! kestrel-cpu --bench attention`). The passes live in `attention/`: the
//! scores (`scores.rs`, and from transposed keys `keys_t.rs`), the
//! softmax (`softmax.rs`) and the weighted sum (`pv.rs`).

mod keys_t;
mod pv;
mod scores;
mod softmax;

pub use keys_t::{keys_t_len, transpose_keys, KEYS_T_BLOCK};
pub(crate) use softmax::exp_shifted;

use super::ops::{axpy, dot8};
use super::{prefetch_row, Isa, TO_L2};
use keys_t::scores_t;
use pv::pv;
use scores::{dots2, dots4_wide, pair_heads};
#[cfg(target_arch = "x86_64")]
use softmax::{exp_shifted_avx2, exp_shifted_avx512};

/// Where one sequence's KV lives in one layer of a [`crate::KvStore`].
#[derive(Debug, Clone, Copy)]
pub struct PagedSeq<'a> {
    /// Physical page ids, in sequence order.
    pub pages: &'a [u32],
    pub page_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl PagedSeq<'_> {
    /// Float offset of (position `j`, kv head `g`) in the layer's K or V
    /// array (layout `[page][kv head][slot][head_dim]`, see [`crate::KvStore`]).
    #[inline]
    pub fn offset(&self, j: usize, g: usize) -> usize {
        let page = self.pages[j / self.page_size] as usize;
        ((page * self.num_kv_heads + g) * self.page_size + j % self.page_size) * self.head_dim
    }

    /// Calls `f(j0, count, offset, next)` for each page holding positions
    /// `0..len`: positions `j0..j0 + count` of kv head `g` are
    /// `count * head_dim` contiguous floats from `offset`, and `next` is the
    /// offset of the following page's block if positions remain there (for
    /// prefetching).
    #[inline]
    fn for_each_page(
        &self,
        len: usize,
        g: usize,
        mut f: impl FnMut(usize, usize, usize, Option<usize>),
    ) {
        let block =
            |page: u32| (page as usize * self.num_kv_heads + g) * self.page_size * self.head_dim;
        let mut j0 = 0;
        for (i, &page) in self.pages.iter().enumerate() {
            if j0 >= len {
                break;
            }
            let count = self.page_size.min(len - j0);
            let next = match self.pages.get(i + 1) {
                Some(&p) if j0 + count < len => Some(block(p)),
                _ => None,
            };
            f(j0, count, block(page), next);
            j0 += count;
        }
        debug_assert!(j0 >= len, "pages cover {j0} of {len} positions");
    }
}

/// The widest head the AVX-512 route takes (Gemma 3's 256; wider heads
/// take the AVX2 one).
const MAX_WIDE_HD: usize = 256;

/// Up to this many V bytes per kv head, the score pass pulls each V page into
/// L2 as it goes, so the weighted sum finds V there (a quarter of a Zen 4
/// core's L2; longer sequences rely on the sum's own one-page-ahead hints).
const V_AHEAD_BYTES: usize = 256 << 10;

/// Scratch floats [`attend_group`] needs for `len` keys and `group` heads
/// (the scores, then one softmax normalizer per head).
pub fn scores_len(group: usize, len: usize) -> usize {
    group * (len + 1)
}

/// Attention of the query heads of kv-group `g` at one position.
///
/// `q`: the group's `group` query heads (`group * head_dim`, RoPE applied);
/// attends keys `0..len`; writes `group * head_dim` floats to `out`.
/// `scores` needs [`scores_len`]`(group, len)` floats. `keys_t`, when
/// given, holds the same kv head's keys `0..len` (at least) as
/// [`transpose_keys`] lays them out, which the AVX-512 score pass then
/// reads in place of the pages ([`scores_t`]; the same scores bit for bit).
#[allow(clippy::too_many_arguments)]
pub fn attend_group(
    isa: Isa,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    seq: PagedSeq<'_>,
    g: usize,
    len: usize,
    scale: f32,
    keys_t: Option<&[f32]>,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = seq.head_dim;
    let group = q.len() / hd;
    let (scores, inv) = scores[..scores_len(group, len)].split_at_mut(group * len);

    // Scores, head-major (`scores[h * len + j]`).
    // Both SIMD ISAs include AVX2 + FMA, which the 8-lane kernels use; the
    // 16-lane ones (`wide`) AVX-512F besides.
    let simd = hd.is_multiple_of(8) && isa != Isa::Scalar && isa.is_supported();
    // With AVX-512, two heads' 8-lane accumulators share a 512-bit register.
    let wide = wide_route(isa, hd);
    let v_ahead = len * hd * 4 <= V_AHEAD_BYTES;
    let keys_t = keys_t.filter(|_| wide);
    let mut h0 = 0;
    while h0 < group {
        let gn = (group - h0).min(4);
        let qs = &q[h0 * hd..(h0 + gn) * hd];
        let sc = &mut scores[h0 * len..(h0 + gn) * len];
        if let Some(kt) = keys_t {
            scores_t(qs, gn, kt, len, scale, sc);
            h0 += gn;
            continue;
        }
        // The wide route's heads in pairs (built only for it).
        let qp = wide.then(|| pair_heads(qs, hd));
        seq.for_each_page(len, g, |j0, count, base, next| {
            let mut t = 0;
            // Into L2 ahead of need, the rows of the keys about to be
            // scored: the next page's K (a page is one contiguous block per
            // kv head, but hardware prefetchers stop at its end) and, for
            // the weighted sum, this page's V.
            let k_next = next.filter(|_| h0 == 0).map(|n| k.as_ptr().wrapping_add(n));
            let v_now = (h0 == 0 && v_ahead).then(|| v.as_ptr().wrapping_add(base));
            let ahead = |t: usize, keys: usize| {
                if let Some(a) = k_next {
                    prefetch_row::<TO_L2>(a.wrapping_add(t * hd), keys * hd);
                }
                if let Some(a) = v_now {
                    prefetch_row::<TO_L2>(a.wrapping_add(t * hd), keys * hd);
                }
            };
            if let Some(qp) = &qp {
                while t + 4 <= count {
                    ahead(t, 4);
                    let o = base + t * hd;
                    let ks = &k[o..o + 4 * hd];
                    match gn {
                        3 | 4 => dots4_wide::<2>(qp, gn, ks, sc, len, j0 + t, scale),
                        _ => dots4_wide::<1>(qp, gn, ks, sc, len, j0 + t, scale),
                    }
                    t += 4;
                }
            }
            if simd {
                while t + 2 <= count {
                    ahead(t, 2);
                    let o = base + t * hd;
                    let ks = &k[o..o + 2 * hd];
                    match gn {
                        4 => dots2::<4>(qs, ks, sc, len, j0 + t, scale),
                        3 => dots2::<3>(qs, ks, sc, len, j0 + t, scale),
                        2 => dots2::<2>(qs, ks, sc, len, j0 + t, scale),
                        _ => dots2::<1>(qs, ks, sc, len, j0 + t, scale),
                    }
                    t += 2;
                }
            }
            for t in t..count {
                let o = base + t * hd;
                let krow = &k[o..o + hd];
                for h in 0..gn {
                    sc[h * len + j0 + t] = dot8(&qs[h * hd..(h + 1) * hd], krow) * scale;
                }
            }
        });
        h0 += gn;
    }

    // Softmax per head: max, exp of (score - max) in place, and the sum
    // of the weights ([`lane_sum16`]) as they are made.
    for (sh, inv) in scores.chunks_exact_mut(len).zip(inv.iter_mut()) {
        let sum = if wide {
            // SAFETY: AVX-512F was detected (`wide`).
            unsafe { exp_shifted_avx512(sh) }
        } else if simd {
            // SAFETY: AVX2 and FMA were detected (`simd`).
            unsafe { exp_shifted_avx2(sh) }
        } else {
            exp_shifted(sh)
        };
        *inv = 1.0 / sum;
    }

    // Weighted sum of V rows, each row loaded once for the whole group.
    if simd && hd.is_multiple_of(16) {
        // With AVX-512, 64 output floats of a head per step (four 512-bit
        // registers) where hd allows.
        let wide = wide && hd.is_multiple_of(64);
        for (h0, oh) in (0..group).step_by(4).zip(out.chunks_mut(4 * hd)) {
            let gn = (group - h0).min(4);
            let (p, inv) = (&scores[h0 * len..(h0 + gn) * len], &inv[h0..h0 + gn]);
            match gn {
                4 => pv::<4>(wide, p, inv, v, seq, g, len, oh),
                3 => pv::<3>(wide, p, inv, v, seq, g, len, oh),
                2 => pv::<2>(wide, p, inv, v, seq, g, len, oh),
                _ => pv::<1>(wide, p, inv, v, seq, g, len, oh),
            }
        }
        return;
    }
    out[..group * hd].fill(0.0);
    seq.for_each_page(len, g, |j0, count, base, _| {
        for t in 0..count {
            let o = base + t * hd;
            let vrow = &v[o..o + hd];
            for (h, oh) in out.chunks_exact_mut(hd).take(group).enumerate() {
                axpy(scores[h * len + j0 + t], vrow, oh);
            }
        }
    });
    for (oh, &inv_h) in out.chunks_exact_mut(hd).zip(inv.iter()) {
        for x in oh.iter_mut() {
            *x *= inv_h;
        }
    }
}

/// Whether [`attend_group`] on `isa` takes the 16-lane (AVX-512) route for
/// heads of `head_dim` floats (the route that reads transposed keys when
/// given them; the same pass on AVX2's 8-lane registers, a broadcast load
/// per FMA, measured level with its paged one at 512 keys and slower at
/// 4096, `prefill_row_1b`, so AVX2 keeps the paged pass).
pub fn wide_route(isa: Isa, head_dim: usize) -> bool {
    head_dim.is_multiple_of(8)
        && head_dim <= MAX_WIDE_HD
        && matches!(isa, Isa::Avx512 | Isa::Amx)
        && isa.is_supported()
}

#[cfg(test)]
mod tests {
    use super::super::coverage::tested_isas;
    use super::super::ops::exp;
    use super::softmax::lane_sum16;
    use super::*;

    /// The straightforward per-head, per-key formulation the kernel must
    /// reproduce bit for bit.
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        seq: PagedSeq<'_>,
        g: usize,
        len: usize,
        scale: f32,
    ) -> Vec<f32> {
        let hd = seq.head_dim;
        let mut out = vec![0f32; q.len()];
        for (qh, oh) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)) {
            let mut s: Vec<f32> = (0..len)
                .map(|j| {
                    let o = seq.offset(j, g);
                    dot8(qh, &k[o..o + hd]) * scale
                })
                .collect();
            let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            s.iter_mut().for_each(|x| *x = exp(*x - max));
            let sum = lane_sum16(&s);
            for (j, &p) in s.iter().enumerate() {
                let o = seq.offset(j, g);
                axpy(p, &v[o..o + hd], oh);
            }
            let inv = 1.0 / sum;
            oh.iter_mut().for_each(|x| *x *= inv);
        }
        out
    }

    #[test]
    fn matches_the_per_head_formulation_bit_for_bit() {
        // AMX's route is AVX-512's.
        let isas = tested_isas("attention per head", &[Isa::Scalar, Isa::Avx2, Isa::Avx512]);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for (group, hd, nkv, page_size, len) in [
            (3usize, 64usize, 3usize, 16usize, 37usize),
            (4, 64, 2, 16, 16),
            (7, 32, 2, 4, 9),
            (1, 24, 1, 8, 1),
            (2, 12, 2, 5, 23),
            (2, 16, 2, 8, 30),
            (5, 32, 1, 8, 19),
            (1, 64, 2, 16, 50),
            (4, 128, 2, 16, 43),
            (3, 256, 1, 8, 21),
        ] {
            let pages: Vec<u32> = (0..len.div_ceil(page_size) as u32)
                .rev()
                .map(|p| 2 * p + 1)
                .collect();
            let floats = (2 * pages.len() + 2) * page_size * nkv * hd;
            let k: Vec<f32> = (0..floats).map(|_| rnd()).collect();
            let v: Vec<f32> = (0..floats).map(|_| rnd()).collect();
            let seq = PagedSeq {
                pages: &pages,
                page_size,
                num_kv_heads: nkv,
                head_dim: hd,
            };
            for g in 0..nkv {
                let q: Vec<f32> = (0..group * hd).map(|_| 4.0 * rnd()).collect();
                let want = reference(&q, &k, &v, seq, g, len, 0.125);
                let mut scores = vec![0f32; scores_len(group, len)];
                let mut out = vec![f32::NAN; group * hd];
                // AVX2's route ignores the transposed keys (on 8-lane
                // registers it measured level with its paged pass).
                for &isa in &isas {
                    out.fill(f32::NAN);
                    attend_group(
                        isa,
                        &q,
                        &k,
                        &v,
                        seq,
                        g,
                        len,
                        0.125,
                        None,
                        &mut scores,
                        &mut out,
                    );
                    let at =
                        format!("{isa:?} group {group} hd {hd} page {page_size} len {len} g {g}");
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&out), bits(&want), "{at}");
                    // The keys transposed (a prefill chunk's path, for
                    // heads of whole 8-float chunks), built for more keys
                    // than this row scores, as for a chunk's earlier rows.
                    if !hd.is_multiple_of(8) {
                        continue;
                    }
                    let mut kt = vec![f32::NAN; keys_t_len(len + 5, hd)];
                    let built = (len + 5).min(pages.len() * page_size);
                    transpose_keys(&k, seq, g, built, &mut kt);
                    out.fill(f32::NAN);
                    let kt = Some(&kt[..]);
                    attend_group(
                        isa,
                        &q,
                        &k,
                        &v,
                        seq,
                        g,
                        len,
                        0.125,
                        kt,
                        &mut scores,
                        &mut out,
                    );
                    assert_eq!(bits(&out), bits(&want), "{at}, keys transposed");
                }
            }
        }
    }

    #[test]
    fn simd_softmax_weights_and_sums_equal_the_definition() {
        let isas = tested_isas("attention softmax", &[Isa::Avx2, Isa::Avx512]);
        let (avx2, wide) = (isas.contains(&Isa::Avx2), isas.contains(&Isa::Avx512));
        let mut xs: Vec<f32> = (0..4000).map(|i| (i as f32 - 3000.0) * 0.037).collect();
        xs.extend([-1e30, -200.0, -87.31, -87.29, 0.0, -0.0, 1e-30, 88.0]);
        // Every tail length of both widths, odd and even chunk counts.
        for n in [xs.len(), xs.len() - 1, xs.len() - 9, 31, 24, 17, 15, 8, 1] {
            let x = &xs[xs.len() - n..];
            let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let want: Vec<f32> = x.iter().map(|&v| exp(v - max)).collect();
            let want_sum = lane_sum16(&want);
            let mut runs: Vec<(&str, Vec<f32>, f32)> = Vec::new();
            if avx2 {
                let mut got = x.to_vec();
                // SAFETY: AVX2 and FMA were detected above.
                let sum = unsafe { exp_shifted_avx2(&mut got) };
                runs.push(("avx2", got, sum));
            }
            if wide {
                let mut got = x.to_vec();
                // SAFETY: AVX-512F was detected above.
                let sum = unsafe { exp_shifted_avx512(&mut got) };
                runs.push(("avx512", got, sum));
            }
            for (isa, got, sum) in runs {
                assert_eq!(sum.to_bits(), want_sum.to_bits(), "{isa} n = {n}");
                for (g, (w, v)) in got.iter().zip(want.iter().zip(x)) {
                    assert_eq!(g.to_bits(), w.to_bits(), "{isa} x = {v}, n = {n}");
                }
            }
        }
    }
}
