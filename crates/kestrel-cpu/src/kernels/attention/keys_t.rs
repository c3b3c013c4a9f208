//! Keys transposed for a prefill chunk, whose rows all score the same keys:
//! [`transpose_keys`] lays a kv head's keys out a block of
//! [`KEYS_T_BLOCK`] at a time, grouped by `dot8` lane in its tree's order,
//! so that the AVX-512 score pass ([`scores_t`]) holds 16 keys' sums per
//! register and needs no horizontal step per key: the same `dot8`
//! products, chains and tree, so the same scores bit for bit. Built once
//! per kv head and chunk (`keys_t_len` floats).

use super::{PagedSeq, MAX_WIDE_HD};

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
pub(super) fn scores_t(qs: &[f32], gn: usize, kt: &[f32], len: usize, scale: f32, sc: &mut [f32]) {
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
