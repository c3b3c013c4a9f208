//! The score pass over a sequence's pages: several keys' dot products at
//! once per K row loaded for all the group's query heads ([`dots2`] on
//! AVX2; with AVX-512, two heads' eight `dot8` lanes to a 512-bit register,
//! [`dots4_wide`] over heads paired by [`pair_heads`]). Each score is
//! `dot8(q, k) * scale`, the order of `ops::dot8` lane for lane, so the
//! ISA never changes a score.

use super::MAX_WIDE_HD;

/// The group's (up to four) query heads `qs` of `hd <= MAX_WIDE_HD` floats
/// in pairs, as the wide score pass reads them: pair `p`'s chunk `c` (8
/// floats) of head `2p` then of `2p + 1` (zeros past the group).
pub(super) fn pair_heads(qs: &[f32], hd: usize) -> [f32; 4 * MAX_WIDE_HD] {
    let mut qp = [0f32; 4 * MAX_WIDE_HD];
    for (h, qh) in qs.chunks_exact(hd).enumerate() {
        for (c, qc) in qh.chunks_exact(8).enumerate() {
            let at = (h / 2) * 2 * hd + 16 * c + 8 * (h % 2);
            qp[at..at + 8].copy_from_slice(qc);
        }
    }
    qp
}

/// `G` query heads against the two key rows in `ks` (positions `j` and `j + 1`,
/// contiguous): `sc[h * len + j] = dot8(q_h, k0) * scale` (and `k1` at `j +
/// 1`), with [`dot8`](super::super::ops::dot8)'s exact lane order and reduction
/// tree; the `2G` accumulator chains run interleaved. Caller: `hd % 8 == 0` and
/// a SIMD `isa`.
#[inline]
pub(super) fn dots2<const G: usize>(
    qs: &[f32],
    ks: &[f32],
    sc: &mut [f32],
    len: usize,
    j: usize,
    scale: f32,
) {
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
/// [`dot8`](super::super::ops::dot8) lanes, so one FMA does two heads' chunk, lane for lane the
/// same products in the same order; each pair's eight 8-lane accumulators
/// then go through [`reduce8`], `dot8`'s tree, which leaves a head's four
/// scores side by side for one store.
/// Caller: `hd % 8 == 0`, `hd <= MAX_WIDE_HD`, AVX-512F.
#[inline]
pub(super) fn dots4_wide<const P: usize>(
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
