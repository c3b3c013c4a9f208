//! Paged causal attention for one query token against a sequence's KV pages,
//! with grouped-query heads. Decode and prefill call the same per-query
//! routine, so a token's attention output is identical whether it arrived in
//! a prefill chunk or a decode step. Cost: `O(len * head_dim)` per head, two
//! passes over K (scores) and one over V; scores live in caller scratch.

use super::ops::{axpy, dot8, exp};

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
    /// Float offset of (position `j`, kv head `g`) in the layer's K or V array.
    #[inline]
    pub fn offset(&self, j: usize, g: usize) -> usize {
        let page = self.pages[j / self.page_size] as usize;
        ((page * self.page_size + j % self.page_size) * self.num_kv_heads + g) * self.head_dim
    }
}

/// Attention of the query heads of kv-group `g` at one position.
///
/// `q`: the group's `group` query heads (`group * head_dim`, RoPE applied);
/// attends keys `0..len`; writes `group * head_dim` floats to `out`.
/// `scores` needs `len` floats.
#[allow(clippy::too_many_arguments)]
pub fn attend_group(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    seq: PagedSeq<'_>,
    g: usize,
    len: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = seq.head_dim;
    let scores = &mut scores[..len];
    for (qh, oh) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)) {
        let mut max = f32::NEG_INFINITY;
        for (j, s) in scores.iter_mut().enumerate() {
            let o = seq.offset(j, g);
            *s = dot8(qh, &k[o..o + hd]) * scale;
            max = max.max(*s);
        }
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = exp(*s - max);
            sum += *s;
        }
        oh.fill(0.0);
        for (j, &p) in scores.iter().enumerate() {
            let o = seq.offset(j, g);
            axpy(p, &v[o..o + hd], oh);
        }
        let inv = 1.0 / sum;
        for x in oh.iter_mut() {
            *x *= inv;
        }
    }
}
