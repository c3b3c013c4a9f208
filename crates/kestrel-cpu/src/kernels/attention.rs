//! Paged causal attention for one query token against a sequence's KV pages,
//! with grouped-query heads. Decode and prefill call the same per-query
//! routine, so a token's attention output is identical whether it arrived in
//! a prefill chunk or a decode step. Cost: `O(len * head_dim)` per head: one
//! pass over K (scores) and one over V, each K/V row loaded once for all the
//! query heads of its group; scores live in caller scratch.
//!
//! The arithmetic per head is fixed (the order of [`dot8`], the softmax sum
//! in 16 lanes ([`lane_sum16`]), FMAs into the output in key order), so
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
//! into L2, and the weighted sum reads each V page once (`cargo bench -p kestrel-cpu --bench attention`).

use super::ops::{axpy, dot8, exp};
use super::{prefetch_row, Isa, TO_L1, TO_L2};

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

/// Keys per block of [`transpose_keys`]' layout (one 512-bit register of
/// scores).
pub const KEYS_T_BLOCK: usize = 16;

/// Floats [`transpose_keys`] writes for `len` keys of `head_dim` floats.
pub fn keys_t_len(len: usize, head_dim: usize) -> usize {
    len.div_ceil(KEYS_T_BLOCK) * KEYS_T_BLOCK * head_dim
}

/// `dot8`'s lanes in the order its tree sums them: ((0 + 4) + (2 + 6)) +
/// ((1 + 5) + (3 + 7)), lane `l` at `DOT8_TREE[l]`: the order is the
/// lanes' three bits reversed, its own inverse.
const DOT8_TREE: [usize; 8] = [0, 4, 2, 6, 1, 5, 3, 7];

/// Row of a [`transpose_keys`] block holding element `d` of its keys: the
/// block's rows grouped by `dot8` lane (`d % 8`), lanes in [`DOT8_TREE`]
/// order, so that [`scores_t`] reads a block front to back.
#[inline]
fn keys_t_row(d: usize, head_dim: usize) -> usize {
    DOT8_TREE[d % 8] * (head_dim / 8) + d / 8
}

/// Kv head `g`'s keys `0..len` of `seq` into `out`, transposed a block of
/// [`KEYS_T_BLOCK`] keys at a time: block `j / KEYS_T_BLOCK` (`head_dim`
/// rows of [`KEYS_T_BLOCK`] floats, from `out[(j / KEYS_T_BLOCK) *
/// KEYS_T_BLOCK * head_dim]` on) holds element `d` of key `j` in lane `j %
/// KEYS_T_BLOCK` of row `keys_t_row(d)`; the last block's keys past `len`
/// are zero. Built once for a prefill chunk's rows, which all score the
/// same keys ([`scores_t`]). `head_dim % 8 == 0`.
///
/// # Panics
/// If `out` is shorter than [`keys_t_len`]`(len, head_dim)`.
pub fn transpose_keys(k: &[f32], seq: PagedSeq<'_>, g: usize, len: usize, out: &mut [f32]) {
    let (hd, kb) = (seq.head_dim, KEYS_T_BLOCK);
    debug_assert!(hd.is_multiple_of(8));
    let out = &mut out[..keys_t_len(len, hd)];
    out[len / kb * kb * hd..].fill(0.0);
    seq.for_each_page(len, g, |j0, count, base, _| {
        for t in 0..count {
            let j = j0 + t;
            let block = &mut out[j / kb * kb * hd..][..kb * hd];
            for (d, &x) in k[base + t * hd..][..hd].iter().enumerate() {
                block[keys_t_row(d, hd) * kb + j % kb] = x;
            }
        }
    });
}

/// The score pass over transposed keys (`kt`, [`transpose_keys`]' layout,
/// holding keys `0..len` at least): `sc[h * len + j] = dot8(q_h, k_j) *
/// scale` for the `gn <= 4` heads of `qs` and keys `j < len`. Keys are the
/// lanes: per [`KEYS_T_BLOCK`] keys and head, `dot8`'s eight lane sums are
/// FMA chains of a broadcast query element against a row of the block (the
/// same products in the same order), then `dot8`'s tree on whole
/// registers, with no horizontal step; each row of the block is loaded
/// once for the `gn` heads. Caller: `hd % 8 == 0`, `hd <= MAX_WIDE_HD`,
/// AVX-512F.
fn scores_t(qs: &[f32], gn: usize, kt: &[f32], len: usize, scale: f32, sc: &mut [f32]) {
    let hd = qs.len() / gn;
    assert!(hd.is_multiple_of(8) && hd <= MAX_WIDE_HD && (1..=4).contains(&gn));
    assert!(kt.len() >= keys_t_len(len, hd) && sc.len() >= gn * len);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `qs` holds `gn` heads of `hd` floats, `kt` the blocks of keys
    // `0..len` and `sc` `gn` rows of `len` scores (asserted above); the
    // caller checked AVX-512F.
    unsafe {
        let (q, k, s) = (qs.as_ptr(), kt.as_ptr(), sc.as_mut_ptr());
        match gn {
            4 => scores_t_avx512::<4>(q, hd, k, len, scale, s),
            3 => scores_t_avx512::<3>(q, hd, k, len, scale, s),
            2 => scores_t_avx512::<2>(q, hd, k, len, scale, s),
            _ => scores_t_avx512::<1>(q, hd, k, len, scale, s),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (qs, gn, kt, len, scale, sc);
        unreachable!("no SIMD isa is supported off x86-64");
    }
}

/// [`scores_t`] for `G` heads.
///
/// # Safety
/// `q` must be valid for `G * hd` floats, `kt` for `len.div_ceil(16)`
/// blocks of `16 * hd`, `sc` for writing floats `h * len..h * len + len`
/// for `h < G`; `hd % 8 == 0`, and the CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn scores_t_avx512<const G: usize>(
    q: *const f32,
    hd: usize,
    kt: *const f32,
    len: usize,
    scale: f32,
    sc: *mut f32,
) {
    use std::arch::x86_64::*;
    const KB: usize = KEYS_T_BLOCK;
    let scale = _mm512_set1_ps(scale);
    for b in 0..len.div_ceil(KB) {
        // SAFETY: block b is in bounds (fn contract).
        let kb = unsafe { kt.add(b * KB * hd) };
        // `dot8`'s lane `l` for the G heads: the FMA chain over elements
        // l, l + 8, ... in order (the block's consecutive rows from
        // `keys_t_row(l)` on).
        let lane = |l: usize| -> [__m512; G] {
            let mut acc = [_mm512_setzero_ps(); G];
            let rows = kb.wrapping_add(keys_t_row(l, hd) * KB);
            for c in (0..hd).step_by(8) {
                // SAFETY: element c + l < hd of the block's keys (row
                // keys_t_row(c + l) = keys_t_row(l) + c / 8) and of each
                // head (fn contract).
                unsafe {
                    let kv = _mm512_loadu_ps(rows.add(c / 8 * KB));
                    for (h, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(_mm512_set1_ps(*q.add(h * hd + c + l)), kv, *a);
                    }
                }
            }
            acc
        };
        let add = |a: [__m512; G], b: [__m512; G]| -> [__m512; G] {
            std::array::from_fn(|h| _mm512_add_ps(a[h], b[h]))
        };
        // ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), each pair
        // summed as soon as both are made (fewer registers live).
        let s04 = add(lane(0), lane(4));
        let left = add(s04, add(lane(2), lane(6)));
        let s15 = add(lane(1), lane(5));
        let right = add(s15, add(lane(3), lane(7)));
        let total = add(left, right);
        let j = b * KB;
        let mask: __mmask16 = if len - j >= KB {
            !0
        } else {
            (1 << (len - j)) - 1
        };
        for (h, t) in total.into_iter().enumerate() {
            // SAFETY: scores j.. below len of head h (fn contract; masked).
            unsafe { _mm512_mask_storeu_ps(sc.add(h * len + j), mask, _mm512_mul_ps(t, scale)) };
        }
    }
}

/// The group's (up to four) query heads `qs` of `hd <= MAX_WIDE_HD` floats
/// in pairs, as the wide score pass reads them: pair `p`'s chunk `c` (8
/// floats) of head `2p` then of `2p + 1` (zeros past the group).
fn pair_heads(qs: &[f32], hd: usize) -> [f32; 4 * MAX_WIDE_HD] {
    let mut qp = [0f32; 4 * MAX_WIDE_HD];
    for (h, qh) in qs.chunks_exact(hd).enumerate() {
        for (c, qc) in qh.chunks_exact(8).enumerate() {
            let at = (h / 2) * 2 * hd + 16 * c + 8 * (h % 2);
            qp[at..at + 8].copy_from_slice(qc);
        }
    }
    qp
}

/// One head's softmax weights in place, `s = exp(s - max(s))`, returning
/// their sum ([`lane_sum16`]): the definition the SIMD routes
/// (`exp_shifted_avx2`, `exp_shifted_avx512`) reproduce.
pub(crate) fn exp_shifted(s: &mut [f32]) -> f32 {
    let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    s.iter_mut().for_each(|x| *x = exp(*x - max));
    lane_sum16(s)
}

/// The softmax normalizer of one head: the sum of its weights `w` (one
/// per key) in the definition's order, 16 partial sums, lane `l` adding
/// the weights of keys `l, l + 16, l + 32, ...` in key order, then
/// [`tree16`]. A vector register adds 16 (or 8) keys' weights at once as
/// `exp` makes them, where a sum in key order was one chain of dependent
/// additions, at one addition per add latency (on long prompts a tenth of
/// a small model's samples).
fn lane_sum16(w: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    for c in w.chunks(16) {
        for (a, &x) in lanes.iter_mut().zip(c) {
            *a += x;
        }
    }
    tree16(lanes)
}

/// The 16 partial sums of [`lane_sum16`] added halves first: lanes `l`
/// and `l + 8`, then `l + 4`, `l + 2`, `l + 1`.
fn tree16(p: [f32; 16]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|l| p[l] + p[l + 8]);
    let s4: [f32; 4] = std::array::from_fn(|l| s8[l] + s8[l + 4]);
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}

/// `out[h] = inv[h] * sum_j p[h][j] * v_j` for `G` heads (`p` head-major,
/// `len` per head): page by page, 16 output floats at a time held in
/// registers across the page's keys and parked in `out` between pages, so
/// each V page is read from memory once: the same FMAs in the same key order
/// as the [`axpy`] formulation.
/// Caller: `head_dim % 16 == 0` and a SIMD `isa`; with `wide`,
/// `head_dim % 64 == 0` and AVX-512.
#[allow(clippy::too_many_arguments)]
fn pv<const G: usize>(
    wide: bool,
    p: &[f32],
    inv: &[f32],
    v: &[f32],
    seq: PagedSeq<'_>,
    g: usize,
    len: usize,
    out: &mut [f32],
) {
    let hd = seq.head_dim;
    debug_assert!(len > 0, "`out` is written only from the first key on");
    assert!(hd.is_multiple_of(16) && p.len() >= G * len && inv.len() >= G && out.len() >= G * hd);
    seq.for_each_page(len, g, |j0, count, base, _| {
        let end = base + count * hd;
        assert!(end <= v.len(), "keys from {j0} lie outside the V array");
    });
    #[cfg(target_arch = "x86_64")]
    // SAFETY: every page's rows were bounds-checked above, `p`, `inv` and
    // `out` hold `G` heads (asserted), and the caller checked AVX2 and FMA,
    // and with `wide` AVX-512F and `hd % 64 == 0`.
    unsafe {
        if wide {
            pv_avx512::<G>(p, inv, v.as_ptr(), seq, g, len, out)
        } else {
            pv_avx2::<G>(p, inv, v.as_ptr(), seq, g, len, out)
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("no SIMD isa is supported off x86-64");
}

/// The weighted sum's kernel for one ISA, written once for both widths:
/// `$n` registers of `$w` lanes per head and step, held across a page's
/// keys and parked in `out` between pages.
macro_rules! pv_lanes {
    ($(#[$doc:meta])* $name:ident, $feat:literal, $w:literal, $n:literal,
     $setzero:ident, $loadu:ident, $storeu:ident, $set1:ident, $fmadd:ident, $mul:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// See [`pv`]: all V rows of `seq`'s pages below `len` must lie in
        /// `v`, `hd` must be a multiple of the floats a step takes, and the
        /// CPU must support the function's target features.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feat)]
        unsafe fn $name<const G: usize>(
            p: &[f32],
            inv: &[f32],
            v: *const f32,
            seq: PagedSeq<'_>,
            g: usize,
            len: usize,
            out: &mut [f32],
        ) {
            use std::arch::x86_64::*;
            let hd = seq.head_dim;
            let o = out.as_mut_ptr();
            seq.for_each_page(len, g, |j0, count, base, next| {
                for d0 in (0..hd).step_by($n * $w) {
                    let mut acc = [[$setzero(); $n]; G];
                    // Pages after the first continue the sums parked in `out`.
                    if j0 > 0 {
                        for (h, acc_h) in acc.iter_mut().enumerate() {
                            for (i, a) in acc_h.iter_mut().enumerate() {
                                // SAFETY: floats h hd + d0 .. + $n $w of
                                // `out` (G heads, hd a multiple of $n $w).
                                *a = unsafe { $loadu(o.add(h * hd + d0 + $w * i)) };
                            }
                        }
                    }
                    for t in 0..count {
                        if let (0, Some(n)) = (d0, next) {
                            prefetch_row::<TO_L1>(v.wrapping_add(n + t * hd), hd);
                        }
                        let mut vr = [$setzero(); $n];
                        for (i, vr) in vr.iter_mut().enumerate() {
                            // SAFETY: row `t` of this page lies in `v`
                            // (checked by `pv`).
                            *vr = unsafe { $loadu(v.add(base + t * hd + d0 + $w * i)) };
                        }
                        for (h, acc_h) in acc.iter_mut().enumerate() {
                            let w = $set1(p[h * len + j0 + t]);
                            for (a, vr) in acc_h.iter_mut().zip(vr) {
                                *a = $fmadd(w, vr, *a);
                            }
                        }
                    }
                    for (h, acc_h) in acc.iter().enumerate() {
                        for (i, a) in acc_h.iter().enumerate() {
                            // SAFETY: as for the loads above.
                            unsafe { $storeu(o.add(h * hd + d0 + $w * i), *a) };
                        }
                    }
                }
            });
            for (oh, &inv_h) in out.chunks_exact_mut(hd).take(G).zip(inv) {
                let s = $set1(inv_h);
                for c in oh.chunks_exact_mut($w) {
                    // SAFETY: `c` holds $w floats.
                    unsafe { $storeu(c.as_mut_ptr(), $mul($loadu(c.as_ptr()), s)) };
                }
            }
        }
    };
}

pv_lanes!(
    /// 16 output floats of each head per step in two 256-bit registers.
    pv_avx2,
    "avx2,fma",
    8,
    2,
    _mm256_setzero_ps,
    _mm256_loadu_ps,
    _mm256_storeu_ps,
    _mm256_set1_ps,
    _mm256_fmadd_ps,
    _mm256_mul_ps
);
pv_lanes!(
    /// 64 output floats of each head per step in four 512-bit registers.
    pv_avx512,
    "avx512f,avx2,fma",
    16,
    4,
    _mm512_setzero_ps,
    _mm512_loadu_ps,
    _mm512_storeu_ps,
    _mm512_set1_ps,
    _mm512_fmadd_ps,
    _mm512_mul_ps
);

/// `s = exp(s - max(s))` in place, returning the weights' sum
/// ([`lane_sum16`]): the same operations as [`exp`] on 8 lanes
/// (bit-identical for finite scores) and the sum's additions in its order.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_avx2(s: &mut [f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut chunks = s.chunks_exact(8);
    for c in &mut chunks {
        // SAFETY: `c` holds 8 floats.
        mv = _mm256_max_ps(mv, unsafe { _mm256_loadu_ps(c.as_ptr()) });
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), mv) };
    let max = chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let maxv = _mm256_set1_ps(max);
    // Lanes 0..8 of `lane_sum16`'s partial sums take the even chunks of
    // eight keys, lanes 8..16 the odd ones.
    let mut sums = [_mm256_setzero_ps(); 2];
    let whole = s.len() - s.len() % 8;
    let mut chunks = s.chunks_exact_mut(8);
    for (i, c) in (&mut chunks).enumerate() {
        // SAFETY: `c` holds 8 floats.
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), maxv));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            sums[i % 2] = _mm256_add_ps(sums[i % 2], e);
        }
    }
    let mut lanes = [0f32; 16];
    // SAFETY: `lanes` holds 16 floats.
    unsafe {
        _mm256_storeu_ps(lanes.as_mut_ptr(), sums[0]);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), sums[1]);
    }
    for (j, x) in (whole..).zip(chunks.into_remainder()) {
        *x = exp(*x - max);
        lanes[j % 16] += *x;
    }
    tree16(lanes)
}

/// [`exp_shifted_avx2`] on 16 lanes, the tail masked: the same operations
/// lane for lane ([`exp16`]).
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn exp_shifted_avx512(s: &mut [f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = s.len();
    let tail = |i: usize| -> __mmask16 { (((1u32 << (n - i).min(16)) - 1) & 0xffff) as u16 };
    let mut mv = _mm512_set1_ps(f32::NEG_INFINITY);
    for i in (0..n).step_by(16) {
        // SAFETY: the mask covers floats i..min(i + 16, n) of `s`.
        let x = unsafe { _mm512_mask_loadu_ps(mv, tail(i), s.as_ptr().add(i)) };
        mv = _mm512_max_ps(mv, x);
    }
    let max = _mm512_reduce_max_ps(mv);
    let maxv = _mm512_set1_ps(max);
    // `lane_sum16`'s partial sums, one per lane; the tail's missing keys
    // add nothing.
    let mut sums = _mm512_setzero_ps();
    for i in (0..n).step_by(16) {
        // SAFETY: as above, for reading and writing.
        unsafe {
            let p = s.as_mut_ptr().add(i);
            let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail(i), p), maxv));
            _mm512_mask_storeu_ps(p, tail(i), e);
            sums = _mm512_mask_add_ps(sums, tail(i), sums, e);
        }
    }
    let mut lanes = [0f32; 16];
    // SAFETY: `lanes` holds 16 floats.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), sums) };
    tree16(lanes)
}

/// [`exp`] on a register of lanes, operation for operation, written once
/// for both widths: the ISA's vector type `$v` and its intrinsics, `$round`
/// rounding to nearest and `$zero_below(x, e, lo)` zeroing `e` where
/// `x < lo`.
macro_rules! exp_lanes {
    ($(#[$doc:meta])* $name:ident, $feat:literal, $v:ident, $min:ident, $max:ident,
     $set1:ident, $mul:ident, $fmadd:ident, $add:ident, $cvt:ident, $add_epi32:ident,
     $set1_epi32:ident, $slli:ident, $cast:ident, $round:expr, $zero_below:expr) => {
        $(#[$doc])*
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feat)]
        fn $name(x: std::arch::x86_64::$v) -> std::arch::x86_64::$v {
            use super::ops::exp_consts as k;
            use std::arch::x86_64::*;
            let xc = $min($max(x, $set1(k::LO)), $set1(k::HI));
            let n = ($round)($mul(xc, $set1(k::LOG2E)));
            let r = $fmadd(n, $set1(-k::LN2_HI), xc);
            let r = $fmadd(n, $set1(-k::LN2_LO), r);
            let mut p = $set1(k::P[0]);
            for &c in &k::P[1..] {
                p = $fmadd(p, r, $set1(c));
            }
            let y = $add($fmadd($mul(p, r), r, r), $set1(1.0));
            let bits = $slli::<23>($add_epi32($cvt(n), $set1_epi32(127)));
            ($zero_below)(x, $mul(y, $cast(bits)), $set1(k::LO))
        }
    };
}

exp_lanes!(
    /// [`exp`] on 16 lanes.
    exp16,
    "avx512f,avx2,fma",
    __m512,
    _mm512_min_ps,
    _mm512_max_ps,
    _mm512_set1_ps,
    _mm512_mul_ps,
    _mm512_fmadd_ps,
    _mm512_add_ps,
    _mm512_cvtps_epi32,
    _mm512_add_epi32,
    _mm512_set1_epi32,
    _mm512_slli_epi32,
    _mm512_castsi512_ps,
    |v| _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v),
    |x, e, lo| _mm512_maskz_mov_ps(!_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, lo), e)
);
exp_lanes!(
    /// [`exp`] on 8 lanes.
    exp8,
    "avx2,fma",
    __m256,
    _mm256_min_ps,
    _mm256_max_ps,
    _mm256_set1_ps,
    _mm256_mul_ps,
    _mm256_fmadd_ps,
    _mm256_add_ps,
    _mm256_cvtps_epi32,
    _mm256_add_epi32,
    _mm256_set1_epi32,
    _mm256_slli_epi32,
    _mm256_castsi256_ps,
    |v| _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v),
    |x, e, lo| _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(x, lo), e)
);

/// `G` query heads against the two key rows in `ks` (positions `j` and
/// `j + 1`, contiguous): `sc[h * len + j] = dot8(q_h, k0) * scale` (and `k1`
/// at `j + 1`), with [`dot8`]'s exact lane order and reduction tree; the `2G`
/// accumulator chains run interleaved. Caller: `hd % 8 == 0` and a SIMD `isa`.
#[inline]
fn dots2<const G: usize>(qs: &[f32], ks: &[f32], sc: &mut [f32], len: usize, j: usize, scale: f32) {
    let hd = ks.len() / 2;
    assert!(hd.is_multiple_of(8) && ks.len() == 2 * hd && qs.len() >= G * hd);
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `qs` holds `G` rows of `hd` floats and `ks` two (asserted
        // above); the caller checked AVX2 and FMA.
        let (d0, d1) = unsafe { dots2_avx2::<G>(qs.as_ptr(), hd, ks.as_ptr()) };
        for h in 0..G {
            sc[h * len + j] = d0[h] * scale;
            sc[h * len + j + 1] = d1[h] * scale;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (qs, ks, sc, len, j, scale);
        unreachable!("no SIMD isa is supported off x86-64");
    }
}

/// # Safety
/// `qs` must be valid for `G * hd` floats, `ks` for `2 * hd` floats,
/// `hd % 8 == 0`, and the CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots2_avx2<const G: usize>(
    qs: *const f32,
    hd: usize,
    ks: *const f32,
) -> ([f32; G], [f32; G]) {
    use std::arch::x86_64::*;
    let mut a0 = [_mm256_setzero_ps(); G];
    let mut a1 = [_mm256_setzero_ps(); G];
    for c in (0..hd).step_by(8) {
        // SAFETY: `c + 8 <= hd` floats of each row are in bounds (fn contract).
        unsafe {
            let kc0 = _mm256_loadu_ps(ks.add(c));
            let kc1 = _mm256_loadu_ps(ks.add(hd + c));
            for h in 0..G {
                let qc = _mm256_loadu_ps(qs.add(h * hd + c));
                a0[h] = _mm256_fmadd_ps(qc, kc0, a0[h]);
                a1[h] = _mm256_fmadd_ps(qc, kc1, a1[h]);
            }
        }
    }
    /// `dot8`'s tree: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).
    #[target_feature(enable = "avx2,fma")]
    fn reduce(v: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
    }
    let mut d0 = [0f32; G];
    let mut d1 = [0f32; G];
    if G >= 3 {
        // Up to eight accumulators at once (head h's keys in 2h, 2h + 1;
        // missing heads zero), each level of the tree one add for all.
        let zero = _mm256_setzero_ps();
        let acc: [__m256; 8] = std::array::from_fn(|i| {
            let h = i / 2;
            match (h < G, i % 2) {
                (false, _) => zero,
                (true, 0) => a0[h],
                (true, _) => a1[h],
            }
        });
        let mut r = [0f32; 8];
        // SAFETY: `r` holds 8 floats.
        unsafe { _mm256_storeu_ps(r.as_mut_ptr(), reduce8(acc)) };
        // `reduce8` gives accumulators 0, 2, 4, 6, then 1, 3, 5, 7.
        d0.copy_from_slice(&r[..G]);
        d1.copy_from_slice(&r[4..4 + G]);
    } else {
        for h in 0..G {
            d0[h] = reduce(a0[h]);
            d1[h] = reduce(a1[h]);
        }
    }
    (d0, d1)
}

/// [`dots2`] with AVX-512 for four key rows `ks` (positions `j..j + 4`)
/// and the group's `gn <= 2P` heads, paired in `qp` (as `attend_group`
/// lays them out): each 512-bit accumulator holds a key's two heads' eight
/// [`dot8`] lanes, so one FMA does two heads' chunk, lane for lane the
/// same products in the same order; each pair's eight 8-lane accumulators
/// then go through [`reduce8`], `dot8`'s tree, which leaves a head's four
/// scores side by side for one store.
/// Caller: `hd % 8 == 0`, `hd <= MAX_WIDE_HD`, AVX-512F.
#[inline]
fn dots4_wide<const P: usize>(
    qp: &[f32],
    gn: usize,
    ks: &[f32],
    sc: &mut [f32],
    len: usize,
    j: usize,
    scale: f32,
) {
    let hd = ks.len() / 4;
    assert!(hd.is_multiple_of(8) && ks.len() == 4 * hd && qp.len() >= 2 * P * hd);
    assert!(gn <= 2 * P && j + 4 <= len && sc.len() >= gn * len);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `qp` holds `P` pairs of `hd` floats, `ks` four rows and `sc`
    // scores `j..j + 4` of `gn` heads (asserted above); the caller checked
    // AVX-512F.
    unsafe {
        dots4_avx512::<P>(
            qp.as_ptr(),
            hd,
            ks.as_ptr(),
            gn,
            sc.as_mut_ptr().add(j),
            len,
            scale,
        )
    };
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (qp, gn, ks, sc, len, j, scale);
        unreachable!("no SIMD isa is supported off x86-64");
    }
}

/// Writes `sc[h * len + t] = dot8(q_h, k_t) * scale` for keys `t < 4` and
/// heads `h < gn`.
///
/// # Safety
/// `qp` must be valid for `2 * P * hd` floats, `ks` for `4 * hd`, `sc` for
/// writing floats `h * len..h * len + 4` for `h < gn <= 2P`; `hd % 8 ==
/// 0`, and the CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dots4_avx512<const P: usize>(
    qp: *const f32,
    hd: usize,
    ks: *const f32,
    gn: usize,
    sc: *mut f32,
    len: usize,
    scale: f32,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 4]; P];
    for c in (0..hd).step_by(8) {
        // SAFETY: `c + 8 <= hd` floats of each key row and of each pair's
        // two heads are in bounds (fn contract).
        unsafe {
            let kc: [__m512; 4] = std::array::from_fn(|t| {
                let k8 = _mm256_castps_pd(_mm256_loadu_ps(ks.add(t * hd + c)));
                _mm512_castpd_ps(_mm512_broadcast_f64x4(k8))
            });
            for (p, acc_p) in acc.iter_mut().enumerate() {
                let qc = _mm512_loadu_ps(qp.add(2 * p * hd + 2 * c));
                for (a, kc) in acc_p.iter_mut().zip(kc) {
                    *a = _mm512_fmadd_ps(qc, kc, *a);
                }
            }
        }
    }
    let scale = _mm256_set1_ps(scale);
    for (p, acc_p) in acc.iter().enumerate() {
        // Key t's head 2p in accumulator 2t, head 2p + 1 in 2t + 1:
        // `reduce8`'s order (0, 2, 4, 6, 1, 3, 5, 7) puts head 2p's four
        // keys in the low 128 bits and head 2p + 1's in the high.
        let mut v = [_mm256_setzero_ps(); 8];
        for (t, a) in acc_p.iter().enumerate() {
            v[2 * t] = _mm512_castps512_ps256(*a);
            v[2 * t + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*a)));
        }
        let r = _mm256_mul_ps(reduce8(v), scale);
        // SAFETY: four scores of each head below `gn` (fn contract).
        unsafe {
            if 2 * p < gn {
                _mm_storeu_ps(sc.add(2 * p * len), _mm256_castps256_ps128(r));
            }
            if 2 * p + 1 < gn {
                _mm_storeu_ps(sc.add((2 * p + 1) * len), _mm256_extractf128_ps::<1>(r));
            }
        }
    }
}

/// Eight accumulators `v[0..8]` reduced by `dot8`'s tree at once,
/// ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) each, returned in the lane order
/// `v[0], v[2], v[4], v[6], v[1], v[3], v[5], v[7]`: 21 operations where one
/// accumulator at a time takes six each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn reduce8(v: [std::arch::x86_64::__m256; 8]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // Pairs (2i, 2i + 1): lanes j of a 128-bit half hold `a_j + a_(j+4)`.
    let s4: [__m256; 4] = std::array::from_fn(|i| {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        )
    });
    // Then `(a0+a4)+(a2+a6)` and `(a1+a5)+(a3+a7)`, two accumulators per
    // 128-bit half.
    let s2: [__m256; 2] = std::array::from_fn(|i| {
        let (a, b) = (s4[2 * i], s4[2 * i + 1]);
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    });
    _mm256_add_ps(
        _mm256_shuffle_ps::<0b10_00_10_00>(s2[0], s2[1]),
        _mm256_shuffle_ps::<0b11_01_11_01>(s2[0], s2[1]),
    )
}

#[cfg(test)]
mod tests {
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
                let isas = [Isa::Scalar, Isa::Avx2, Isa::detect()];
                for isa in isas.into_iter().filter(|i| i.is_supported()) {
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
        if Isa::detect() == Isa::Scalar {
            return;
        }
        let mut xs: Vec<f32> = (0..4000).map(|i| (i as f32 - 3000.0) * 0.037).collect();
        xs.extend([-1e30, -200.0, -87.31, -87.29, 0.0, -0.0, 1e-30, 88.0]);
        let wide = matches!(Isa::detect(), Isa::Avx512 | Isa::Amx);
        // Every tail length of both widths, odd and even chunk counts.
        for n in [xs.len(), xs.len() - 1, xs.len() - 9, 31, 24, 17, 15, 8, 1] {
            let x = &xs[xs.len() - n..];
            let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let want: Vec<f32> = x.iter().map(|&v| exp(v - max)).collect();
            let want_sum = lane_sum16(&want);
            let mut runs: Vec<(&str, Vec<f32>, f32)> = Vec::new();
            let mut got = x.to_vec();
            // SAFETY: AVX2 and FMA were detected above.
            let sum = unsafe { exp_shifted_avx2(&mut got) };
            runs.push(("avx2", got, sum));
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
