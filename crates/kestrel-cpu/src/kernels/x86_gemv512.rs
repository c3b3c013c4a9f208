//! The single-stream GEMVs with AVX-512 VNNI: Q4_K's and Q6_K's two
//! sub-blocks to a 512-bit register ([`gemv8_q4k_vnni512`],
//! [`gemv8_q6k_vnni512`]; with GFNI picking Q6_K's bits,
//! [`gemv8_q6k_gfni512`]), eight rows' sums folded by shuffles and adds
//! ([`fold8`]). They walk the weights as the AVX2 GEMV does
//! ([`super::x86_gemv::tiles8`]) and give its results bit for bit (tests
//! in `x86_int8.rs`).

use std::arch::x86_64::*;

use super::int8::Q8Block;
use super::x86_blocks::{Q4KB, Q6KB};
use super::x86_gemv::tiles8;
use super::x86_int8::Int8Args;
use super::x86_tile8::Scales8;

/// Eight rows' 512-bit `vpdpbusd` sums folded by shuffles and adds (no
/// `vphaddd`): per 128-bit chunk `c`, rows 0..4's sums over its four lanes
/// in the first result's chunk `c`, rows 4..8's in the second's.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn fold8(p: [__m512i; 8]) -> (__m512i, __m512i) {
    let pairs = |u: __m512i, v: __m512i| {
        _mm512_add_epi32(_mm512_unpacklo_epi32(u, v), _mm512_unpackhi_epi32(u, v))
    };
    let quads = |u: __m512i, v: __m512i| {
        _mm512_add_epi32(_mm512_unpacklo_epi64(u, v), _mm512_unpackhi_epi64(u, v))
    };
    (
        quads(pairs(p[0], p[1]), pairs(p[2], p[3])),
        quads(pairs(p[4], p[5]), pairs(p[6], p[7])),
    )
}

/// Chunks `c` and `d` of a fold's ([`fold8`]) two halves, rows 0..8 each:
/// `[lo.c, hi.c, lo.d, hi.d]`, chunk `c` in the low 256 bits, `d` in the
/// high.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn chunks(lo: __m512i, hi: __m512i, c: i32, d: i32) -> __m512i {
    let idx = |k: i32, src: i32| 16 * src + 4 * k;
    let (c0, c1, d0, d1) = (idx(c, 0), idx(c, 1), idx(d, 0), idx(d, 1));
    let at: [i32; 16] = std::array::from_fn(|l| [c0, c1, d0, d1][l / 4] + (l % 4) as i32);
    // SAFETY: `at` is 16 readable i32.
    let at = unsafe { _mm512_loadu_si512(at.as_ptr().cast()) };
    _mm512_permutex2var_epi32(lo, at, hi)
}

/// [`gemv8_256`](super::x86_gemv::gemv8_256) for Q4_K with AVX-512 VNNI: two
/// sub-blocks per 512-bit register. A Q4_K super-block's 32-byte groups hold
/// sub-block `2i` in their low nibbles and `2i + 1` in their high ones; each
/// row's group is broadcast to both halves and masked to the low nibbles in the
/// first and the high nibbles in place (sixteen times their value) in the
/// second, against the two activation blocks side by side: one `vpdpbusd` per
/// row for 64 weights, sums exact in i32 (at most `4 * 240 * 127` a lane). The
/// eight rows' sums then fold to one lane per row and sub-block by shuffles and
/// adds (no `vphaddd`, half the folds per weight of the 256-bit GEMV), the
/// second sub-block's divided by 16 exactly (a multiple of 16), and each
/// sub-block takes the definition's float steps in order, as
/// [`sub_block`](super::x86_gemv::sub_block) does: bit for bit the same
/// outputs.
///
/// # Safety
/// As [`gemv8_256`](super::x86_gemv::gemv8_256) for Q4_K rows; the CPU must
/// support AVX-512F/BW/VL and AVX-512 VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn gemv8_q4k_vnni512(a: Int8Args, tiles: usize, y: *mut f32) {
    let nibbles = _mm512_inserti64x4::<1>(_mm512_set1_epi8(0x0F), _mm256_set1_epi8(0xF0u8 as i8));
    let block =
        |s: usize, p: &[*const u8; 8], sc: &[Scales8; 8], acc: &mut __m256, mins: &mut __m256| {
            for i in 0..4 {
                // SAFETY: activation blocks `8s + 2i` and `+ 1` are in
                // bounds (fn contract).
                let xb: [&Q8Block; 2] =
                    std::array::from_fn(|h| unsafe { &*a.x.add(8 * s + 2 * i + h) });
                // SAFETY: each `q` is 32 readable bytes.
                let [x0, x1] = xb.map(|b| unsafe { _mm256_loadu_si256(b.q.as_ptr().cast()) });
                let xx = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(x0), x1);
                let prod: [__m512i; 8] = std::array::from_fn(|r| {
                    // SAFETY: the nibbles are bytes 16..144 of the stored
                    // block at `p[r]` (fn contract); group `i` is 32 of them.
                    let q = unsafe { _mm256_loadu_si256(p[r].add(16 + 32 * i).cast()) };
                    let q = _mm512_and_si512(_mm512_broadcast_i64x4(q), nibbles);
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xx)
                });
                // Chunks 0 + 1 (sub-block 2i) and 2 + 3 (2i + 1) of the
                // eight rows.
                let (lo, hi) = fold8(prod);
                let sums = _mm512_add_epi32(chunks(lo, hi, 0, 2), chunks(lo, hi, 1, 3));
                let sub = [
                    _mm512_castsi512_si256(sums),
                    _mm256_srai_epi32::<4>(_mm512_extracti64x4_epi64::<1>(sums)),
                ];
                for (h, sum) in sub.into_iter().enumerate() {
                    sc[2 * i + h].step(sum, xb[h], true, acc, mins);
                }
            }
        };
    // SAFETY: forwarded contract; `block` reads stored block `s` of the
    // tile's rows and activation blocks `8s..8s + 8`, in bounds.
    unsafe { tiles8::<Q4KB>(a, tiles, y, block) }
}

/// [`gemv8_256`](super::x86_gemv::gemv8_256) for Q6_K with AVX-512 VNNI:
/// sub-blocks `b` and `b + 2` of a super-block's half share their low-bit and
/// high-bit bytes (`ql` nibbles low and high, `qh` bit pairs two apart), so one
/// broadcast of each, shifted per 256-bit half, gives both sub-blocks' six-bit
/// quants (`w + 32`) in one register, against their two activation blocks: one
/// `vpdpbusd` per row for 64 weights. The sums fold as [`gemv8_q4k_vnni512`]'s,
/// per 16-element half; `32 * sum(x)` per half comes off once for the eight
/// rows, and the float steps run in the sub-blocks' order, each half with its
/// scale, as [`sub_block`](super::x86_gemv::sub_block) does: bit for bit the
/// same outputs. With GFNI, [`gemv8_q6k_gfni512`] forms the quants in three
/// operations where this takes six.
///
/// # Safety
/// As [`gemv8_256`](super::x86_gemv::gemv8_256) for Q6_K rows; the CPU must
/// support AVX-512F/BW/VL and AVX-512 VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn gemv8_q6k_vnni512(a: Int8Args, tiles: usize, y: *mut f32) {
    // Per 16-bit lane, for sub-blocks `b = 4n + s2` (first 256-bit half)
    // and `b + 2` (second): the `ql` nibbles' shift, and per `s2` the `qh`
    // bit pairs'.
    let halves =
        |u: i16, v: i16| _mm512_inserti64x4::<1>(_mm512_set1_epi16(u), _mm256_set1_epi16(v));
    let ql_shift = halves(0, 4);
    let qh_shift = [halves(0, 4), halves(2, 6)];
    let (low4, low2) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(3));
    let quants = |ql: __m512i, qh: __m512i, s2: usize| {
        let lo = _mm512_and_si512(_mm512_srlv_epi16(ql, ql_shift), low4);
        let hi = _mm512_and_si512(_mm512_srlv_epi16(qh, qh_shift[s2]), low2);
        // Each byte of `hi` holds 0..4: a 16-bit shift stays within its
        // byte.
        _mm512_or_si512(lo, _mm512_slli_epi16::<4>(hi))
    };
    // SAFETY: forwarded contract.
    unsafe { q6k_vnni512(a, tiles, y, quants) }
}

/// [`gemv8_q6k_vnni512`] with GFNI: each byte's bits are picked and placed
/// by one `vgf2p8affineqb` (an 8x8 bit matrix per 64-bit lane, so one per
/// 256-bit half): the `ql` nibble to bits 0..4, the `qh` bit pair to bits
/// 4..6, then an OR: three operations per row and 64 weights where the
/// shifts and masks take six. The same quants, so the same outputs.
///
/// # Safety
/// As [`gemv8_q6k_vnni512`]; the CPU must also support GFNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx2,fma,f16c")]
pub(crate) unsafe fn gemv8_q6k_gfni512(a: Int8Args, tiles: usize, y: *mut f32) {
    let ql_bits = halves64(
        bit_matrix(&[(0, 0), (1, 1), (2, 2), (3, 3)]),
        bit_matrix(&[(0, 4), (1, 5), (2, 6), (3, 7)]),
    );
    let qh_bits = [(0, 4), (2, 6)].map(|(u, v)| {
        halves64(
            bit_matrix(&[(4, u), (5, u + 1)]),
            bit_matrix(&[(4, v), (5, v + 1)]),
        )
    });
    let quants = |ql: __m512i, qh: __m512i, s2: usize| {
        _mm512_or_si512(
            _mm512_gf2p8affine_epi64_epi8::<0>(ql, ql_bits),
            _mm512_gf2p8affine_epi64_epi8::<0>(qh, qh_bits[s2]),
        )
    };
    // SAFETY: forwarded contract.
    unsafe { q6k_vnni512(a, tiles, y, quants) }
}

/// The `vgf2p8affineqb` matrix that sets output bit `o` of each byte to its
/// input bit `i` for each `(o, i)` in `picks`, and every other bit to 0
/// (output bit `o` is the parity of the input and the matrix's byte
/// `7 - o`).
const fn bit_matrix(picks: &[(u32, u32)]) -> i64 {
    let mut m = 0u64;
    let mut k = 0;
    while k < picks.len() {
        let (o, i) = picks[k];
        m |= (1u64 << i) << (8 * (7 - o));
        k += 1;
    }
    m as i64
}

/// `u` in each 64-bit lane of the low 256 bits, `v` in the high.
#[target_feature(enable = "avx512f,avx2")]
#[inline]
fn halves64(u: i64, v: i64) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_set1_epi64(u), _mm256_set1_epi64x(v))
}

/// The Q6_K VNNI GEMV's body ([`gemv8_q6k_vnni512`]), the six-bit quants
/// of a row's sub-blocks `4n + s2` (low 256 bits) and `4n + s2 + 2` (high)
/// formed by `quants(ql, qh, s2)` from its 32 `ql` and 32 `qh` bytes of
/// them, each broadcast to both halves.
///
/// # Safety
/// As [`gemv8_q6k_vnni512`], the CPU supporting what `quants` uses.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn q6k_vnni512(
    a: Int8Args,
    tiles: usize,
    y: *mut f32,
    quants: impl Fn(__m512i, __m512i, usize) -> __m512i,
) {
    let ones = _mm512_set1_epi8(1);
    // No minimum: `mins` stays zero.
    let block =
        |s: usize, p: &[*const u8; 8], sc: &[Scales8; 8], acc: &mut __m256, _: &mut __m256| {
            for n in 0..2 {
                // Sub-blocks 4n + k (k < 4): per pair `s2` (4n + s2 and
                // 4n + s2 + 2), each's two halves' sums for the eight rows.
                let mut sums = [[_mm256_setzero_si256(); 2]; 4];
                let mut dx = [0f32; 4];
                for s2 in 0..2 {
                    let (b0, b1) = (4 * n + s2, 4 * n + s2 + 2);
                    // SAFETY: activation blocks `8s + b0`, `8s + b1` are in
                    // bounds (fn contract).
                    let [x0, x1] = [b0, b1].map(|b| unsafe { &*a.x.add(8 * s + b) });
                    (dx[s2], dx[s2 + 2]) = (x0.d, x1.d);
                    // SAFETY: each `q` is 32 readable bytes.
                    let [q0, q1] =
                        [x0, x1].map(|b| unsafe { _mm256_loadu_si256(b.q.as_ptr().cast()) });
                    let xx = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q0), q1);
                    let prod: [__m512i; 8] = std::array::from_fn(|r| {
                        // SAFETY: `ql` is bytes 0..128 of the stored block
                        // at `p[r]` (read at 64 n + 32 s2 .. + 32) and `qh`
                        // 128..192 (read at 128 + 32 n .. + 32).
                        let (ql, qh) = unsafe {
                            (
                                _mm256_loadu_si256(p[r].add(64 * n + 32 * s2).cast()),
                                _mm256_loadu_si256(p[r].add(128 + 32 * n).cast()),
                            )
                        };
                        let q = quants(_mm512_broadcast_i64x4(ql), _mm512_broadcast_i64x4(qh), s2);
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xx)
                    });
                    // The activations' sums per 16-element half, chunk by
                    // chunk (a chunk is a half), in every lane of it.
                    let xs = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, xx);
                    let xs = _mm512_add_epi32(xs, _mm512_shuffle_epi32::<0x4E>(xs));
                    let xs = _mm512_add_epi32(xs, _mm512_shuffle_epi32::<0xB1>(xs));
                    let (lo, hi) = fold8(prod);
                    // Sub-block b0's halves (chunks 0, 1) and b1's (2, 3),
                    // less 32 sum(x) of theirs.
                    for (k, (c, d)) in [(0, 1), (2, 3)].into_iter().enumerate() {
                        let at: [i32; 16] = std::array::from_fn(|l| 4 * [c, d][l / 8]);
                        // SAFETY: `at` is 16 readable i32.
                        let at = unsafe { _mm512_loadu_si512(at.as_ptr().cast()) };
                        let bias = _mm512_permutexvar_epi32(at, xs);
                        let v =
                            _mm512_sub_epi32(chunks(lo, hi, c, d), _mm512_slli_epi32::<5>(bias));
                        sums[s2 + 2 * k] =
                            [_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v)];
                    }
                }
                for (k, [h0, h1]) in sums.into_iter().enumerate() {
                    let scj = &sc[4 * n + k];
                    let dx = _mm256_set1_ps(dx[k]);
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h0), _mm256_mul_ps(scj.d0, dx), *acc);
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h1), _mm256_mul_ps(scj.d1, dx), *acc);
                }
            }
        };
    // SAFETY: forwarded contract; `block` reads stored block `s` of the
    // tile's rows and activation blocks `8s..8s + 8`, in bounds.
    unsafe { tiles8::<Q6KB>(a, tiles, y, block) }
}
