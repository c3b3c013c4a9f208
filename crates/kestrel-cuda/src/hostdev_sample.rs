//! The host device's `sample_rows` (`kernels/sample.cu`): [`sample_row`]
//! emulates one row of the kernel step by step (bias, mask, penalties,
//! temperature; top-k and top-p by bisection on order-preserving keys;
//! min-p; the seeded draw; logprob and top-n), its block reductions done by
//! one thread; `tests/sample_emulation.rs` holds it against kestrel-cpu's
//! sampler.

use kestrel_numerics::exp as kexp;
use kestrel_numerics::uniform;

use crate::ffi::SampleParams;
use crate::hostdev::HostMemory;
use crate::runtime::backend::SampleRows;
use crate::CudaError;

const NEG: f32 = f32::NEG_INFINITY;

pub(crate) fn sample_rows(m: &HostMemory, a: &SampleRows) -> Result<(), CudaError> {
    let vocab = a.vocab;
    for i in 0..a.n {
        let at = |base: u64, size: usize| base + (i * size) as u64;
        // SAFETY: read-only slices, copied out before the writes below.
        let (p, kv_row, position, logits, mask, counts, bias) = unsafe {
            let p = m.slice::<SampleParams>(at(a.params, 40), 1)?[0];
            let kv_row = m.slice::<u32>(at(a.rows, 4), 1)?[0];
            let position = m.slice::<u32>(at(a.positions, 4), 1)?[0];
            let logits = m.slice::<f32>(at(a.logits, vocab * 4), vocab)?.to_vec();
            let constrained = a.mask_words != 0
                && a.mask_flags != 0
                && m.slice::<u32>(at(a.mask_flags, 4), 1)?[0] != 0;
            let mask = if constrained {
                let w = m.slice::<u32>(at(a.mask_words, a.words_per_row * 4), a.words_per_row)?;
                Some(w.to_vec())
            } else {
                None
            };
            let counts = a.counts + 4 * u64::from(kv_row) * vocab as u64;
            let bias = if a.bias_indptr != 0 {
                let ends = m.slice::<u32>(at(a.bias_indptr, 4), 2)?;
                let (b0, b1) = (ends[0] as usize, ends[1] as usize);
                let words = m.slice::<u32>(a.bias + 8 * b0 as u64, 2 * (b1 - b0))?;
                let pairs = words.chunks_exact(2);
                pairs.map(|w| (w[0], f32::from_bits(w[1]))).collect()
            } else {
                Vec::new()
            };
            (p, kv_row, position, logits, mask, counts, bias)
        };
        let (token, lp, top) = {
            // SAFETY: read-only; dropped before the counts are written.
            let c = unsafe { m.slice::<u32>(counts, vocab) }?;
            let row = SampleRow {
                mask: mask.as_deref(),
                bias: &bias,
                counts: c,
                position,
            };
            sample_row(&logits, &p, row, a.top_n)
        };
        // SAFETY: each write below is the only slice alive at that moment.
        unsafe {
            m.slice_mut::<u32>(at(a.out_tokens, 4), 1)?[0] = token;
            m.slice_mut::<f32>(at(a.out_logprobs, 4), 1)?[0] = lp;
            if a.top_n > 0 {
                let ids = m.slice_mut::<u32>(at(a.out_top_ids, a.top_n * 4), a.top_n)?;
                for (d, &(id, _)) in ids.iter_mut().zip(&top) {
                    *d = id;
                }
                let lps = m.slice_mut::<f32>(at(a.out_top_lps, a.top_n * 4), a.top_n)?;
                for (d, &(_, l)) in lps.iter_mut().zip(&top) {
                    *d = l;
                }
            }
            m.slice_mut::<u32>(a.pending + 4 * u64::from(kv_row), 1)?[0] = token;
            m.slice_mut::<u32>(counts + 4 * u64::from(token), 1)?[0] += 1;
        }
    }
    Ok(())
}

/// `fkey` of sample.cu: an order-preserving u32 key of an f32.
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

/// Largest `x` in `lo..=hi` with `p(x)`, given `p(lo)`; with the iterations.
pub(crate) fn bisect_last(mut lo: u32, mut hi: u32, p: impl Fn(u32) -> bool) -> (u32, u32) {
    let mut iters = 0;
    while lo < hi {
        let mid = upper_mid(lo, hi);
        if p(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
        iters += 1;
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

/// What one row of `sample_rows` reads besides its logits and parameters.
#[derive(Debug, Clone, Copy)]
pub struct SampleRow<'a> {
    /// The constraint's bitmask, when the row is constrained.
    pub mask: Option<&'a [u32]>,
    /// `logit_bias`: (token, value) pairs, distinct tokens.
    pub bias: &'a [(u32, f32)],
    /// Generated-token counts (penalties).
    pub counts: &'a [u32],
    /// The RNG position of the draw.
    pub position: u32,
}

/// `sample_rows` of `kernels/sample.cu` for one row, its block reductions
/// done by one thread: bias, mask, penalties, temperature; top-k and top-p by
/// bisection on order-preserving keys (ties broken by id); min-p; the
/// seeded draw in id order (or greedy); logprob and top-n (best first,
/// lowest id on ties). Returns (token, logprob, top-n pairs).
/// `tests/sample_emulation.rs` checks it against kestrel-cpu's sampler.
pub fn sample_row(
    logits: &[f32],
    p: &SampleParams,
    row: SampleRow<'_>,
    top_n: usize,
) -> (u32, f32, Vec<(u32, f32)>) {
    let SampleRow {
        mask,
        bias,
        counts,
        position,
    } = row;
    let vocab = logits.len();
    let mut v = logits.to_vec();
    // 0. logit_bias (the mask below sets -inf regardless).
    for &(t, b) in bias {
        if let Some(l) = v.get_mut(t as usize) {
            *l += b;
        }
    }
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
            .map(|(_, &l)| f64::from(kexp(l - mx)))
            .sum()
    };
    // 3. top-p.
    if !greedy && p.top_p < 1.0 {
        let z = mass(&v, &|_, _| true);
        let target = f64::from(p.top_p) * z;
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
        v.iter().position(|&l| l == mx).unwrap_or(0) as u32
    } else {
        let u = uniform(p.seed, position) * z;
        let mut acc = 0f64;
        let mut pick = None;
        let mut last = 0;
        for (t, &l) in v.iter().enumerate() {
            if l > NEG {
                last = t as u32;
                acc += f64::from(kexp(l - mx));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bisection_over_all_of_u32_terminates() {
        // The old midpoint `lo + (hi - lo + 1) / 2` wrapped to `lo` here.
        assert_eq!(bisect_last(0, u32::MAX, |_| true), (u32::MAX, 32));
        assert_eq!(bisect_last(0, u32::MAX, |m| m == 0).0, 0);
        assert_eq!(bisect_last(7, 8, |m| m <= 8).0, 8);
        let src = crate::kernels::SOURCES
            .iter()
            .find(|k| k.file == "sample.cu")
            .expect("sample.cu")
            .source;
        assert!(src.contains("return hi - (hi - lo) / 2;"));
        assert!(!src.contains("mid = lo + (hi - lo + 1)"));
    }
}
