//! The weighted sum of V rows ([`pv`]): each V row loaded once for all the
//! group's heads, `$n` registers of output per head held across a page's
//! keys and parked in `out` between pages, the next page hinted into L1;
//! the same FMAs in key order on AVX2 (8 lanes) and AVX-512 (16 lanes,
//! 64 floats of a head per step), so the same outputs bit for bit.

use super::super::{prefetch_row, TO_L1};
use super::PagedSeq;

/// `out[h] = inv[h] * sum_j p[h][j] * v_j` for `G` heads (`p` head-major,
/// `len` per head): page by page, 16 output floats at a time held in
/// registers across the page's keys and parked in `out` between pages, so
/// each V page is read from memory once: the same FMAs in the same key order
/// as the [`axpy`](super::super::ops::axpy) formulation.
/// Caller: `head_dim % 16 == 0` and a SIMD `isa`; with `wide`,
/// `head_dim % 64 == 0` and AVX-512.
#[allow(clippy::too_many_arguments)]
pub(super) fn pv<const G: usize>(
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
