//! AVX2 and AVX-512 VNNI forms of the fast numerics (`int8.rs` defines the
//! results). AVX2: the
//! activation quantizer, and sweeps of `R x NB` tiles over the same
//! [`Block`] types and tile shape as the f32 kernels in `x86.rs`, with the
//! weights unpacked to bytes instead of floats and `vpmaddubsw`/`vpmaddwd`
//! integer dots; and [`unpack_rows256`], which unpacks weight rows once into
//! [`I8Block`]s that the same sweep reads when many activation rows share
//! them (prefill). Lane `l` of a 256-bit i32 sum holds elements `4l..4l+4`,
//! exactly the scalar definition's lane, so results are bit-identical to it.
//! [`int8_sweep512`] does the same sums two activation rows per 512-bit
//! register with `vpdpbusd`, for many activation rows on AVX-512 VNNI CPUs.

use std::arch::x86_64::*;

use super::int8::Q8Block;
use super::x86::{
    bits_to_bytes256, nibble_bytes256, prefetch, scales, Block, PREFETCH_TILES, Q4KFB, Q4_0B,
    Q4_0FB, Q4_1B, Q4_1FB, Q5_0FB, Q5_1FB, Q6KFB, Q8_0B,
};

/// A weight block with an integer dot: its 32 weights as bytes in element
/// order, its scale per i32 lane (lanes 0..4 hold elements 0..16, lanes
/// 4..8 elements 16..32: one value but for Q6_K's two) and its minimum (0
/// when none).
pub(crate) trait Int8Block {
    /// Bytes per 32-element block.
    const BYTES: usize;
    /// Whether the weight bytes are signed (Q8_0, and `q - 8`, `q - 16`,
    /// `q - 32` of Q4_0, Q5_0, Q6_K) or not (the nibbles and five-bit quants
    /// of the types with a minimum: Q4_1, Q5_1, Q4_K, Q5_K).
    const SIGNED: bool;
    /// Whether the block has a minimum (`m_w * s_x` is then added).
    const HAS_MIN: bool;
    /// # Safety
    /// `p` must be valid for reading `Self::BYTES` bytes; the CPU must support
    /// AVX2, FMA and F16C.
    unsafe fn int8(p: *const u8) -> (__m256i, __m256, f32);
}

/// The f32 at `p`.
///
/// # Safety
/// `p` must be valid for reading 4 bytes.
#[inline(always)]
unsafe fn f32_at(p: *const u8) -> f32 {
    // SAFETY: 4 readable bytes at `p` (fn contract); unaligned read.
    unsafe { (p as *const f32).read_unaligned() }
}

/// The u32 at `p`.
///
/// # Safety
/// `p` must be valid for reading 4 bytes.
#[inline(always)]
unsafe fn u32_at(p: *const u8) -> u32 {
    // SAFETY: 4 readable bytes at `p` (fn contract); unaligned read.
    unsafe { (p as *const u32).read_unaligned() }
}

/// The f32 at `p` in every lane.
///
/// # Safety
/// `p` must be valid for reading 4 bytes; the CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn splat(p: *const u8) -> __m256 {
    // SAFETY: forwarded contract.
    _mm256_set1_ps(unsafe { f32_at(p) })
}

/// `f32 d`, `f32 m`, 16 nibble bytes: Q4_1 with f32 scales, and one Q4_K
/// sub-block (whose `m` is `-(dmin * m)`; `weight.rs`).
///
/// # Safety
/// 24 readable bytes at `p`; the CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn nibbles_d_m(p: *const u8) -> (__m256i, __m256, f32) {
    // SAFETY: 24 readable bytes at `p` (fn contract).
    unsafe { (nibble_bytes256(p.add(8)), splat(p), f32_at(p.add(4))) }
}

/// `impl Int8Block` for each block type: whether its weight bytes are
/// signed, whether it has a minimum, and its decoding of the block at `p`
/// (valid for `BYTES` bytes by the trait's contract; the CPU has AVX2, FMA
/// and F16C).
macro_rules! int8_blocks {
    ($($B:ty { signed: $signed:literal, min: $min:literal } => |$p:ident| $decode:block)*) => {$(
        impl Int8Block for $B {
            const BYTES: usize = <Self as Block>::BYTES;
            const SIGNED: bool = $signed;
            const HAS_MIN: bool = $min;
            #[target_feature(enable = "avx2,fma,f16c")]
            #[inline]
            unsafe fn int8($p: *const u8) -> (__m256i, __m256, f32) $decode
        }
    )*};
}

int8_blocks! {
    Q8_0B { signed: true, min: false } => |p| {
        // SAFETY: 34 readable bytes at `p` (trait contract): f16 d + 32 i8.
        unsafe {
            let q = _mm256_loadu_si256(p.add(2) as *const __m256i);
            (q, _mm256_broadcastss_ps(scales(p)), 0.0)
        }
    }

    Q4_0B { signed: true, min: false } => |p| {
        // SAFETY: 18 readable bytes at `p` (trait contract): f16 d + 16 nibble bytes.
        unsafe {
            let q = _mm256_sub_epi8(nibble_bytes256(p.add(2)), _mm256_set1_epi8(8));
            (q, _mm256_broadcastss_ps(scales(p)), 0.0)
        }
    }

    Q4_0FB { signed: true, min: false } => |p| {
        // SAFETY: 20 readable bytes at `p` (trait contract): f32 d + 16 nibble bytes.
        unsafe {
            let q = _mm256_sub_epi8(nibble_bytes256(p.add(4)), _mm256_set1_epi8(8));
            (q, splat(p), 0.0)
        }
    }

    Q4_1B { signed: false, min: true } => |p| {
        // SAFETY: 20 readable bytes at `p` (trait contract): f16 d, m + 16 nibble bytes.
        unsafe {
            let dm = scales(p);
            let m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
            (nibble_bytes256(p.add(4)), _mm256_broadcastss_ps(dm), m)
        }
    }

    Q4_1FB { signed: false, min: true } => |p| {
        // SAFETY: 24 readable bytes at `p` (trait contract): f32 d, f32 m + 16 nibble bytes.
        unsafe { nibbles_d_m(p) }
    }

    Q4KFB { signed: false, min: true } => |p| {
        // SAFETY: 24 readable bytes at `p` (trait contract): f32 d, f32 m + 16 nibble bytes.
        unsafe { nibbles_d_m(p) }
    }

    Q5_0FB { signed: true, min: false } => |p| {
        // SAFETY: 24 readable bytes at `p` (trait contract): f32 d, u32 qh,
        // 16 nibble bytes.
        unsafe {
            // q - 16 as a signed byte: the nibble where bit 4 is set (16 + k
            // - 16 = k), the nibble with the high bits set (k - 16) where not.
            let high =
                _mm256_andnot_si256(bits_to_bytes256(u32_at(p.add(4))), _mm256_set1_epi8(-16));
            (
                _mm256_or_si256(nibble_bytes256(p.add(8)), high),
                splat(p),
                0.0,
            )
        }
    }

    Q5_1FB { signed: false, min: true } => |p| {
        // SAFETY: 28 readable bytes at `p` (trait contract): f32 d, f32 m,
        // u32 qh, 16 nibble bytes.
        unsafe {
            let high = _mm256_and_si256(bits_to_bytes256(u32_at(p.add(8))), _mm256_set1_epi8(16));
            let q = _mm256_or_si256(nibble_bytes256(p.add(12)), high);
            (q, splat(p), f32_at(p.add(4)))
        }
    }

    Q6KFB { signed: true, min: false } => |p| {
        // SAFETY: 32 readable bytes at `p` (trait contract): f32 d0, f32 d1,
        // u32 bit-4 plane, u32 bit-5 plane, 16 nibble bytes.
        unsafe {
            // q - 32 as a signed byte: the low five bits where bit 5 is set
            // (32 + k - 32 = k), those bits with the top three set (k - 32)
            // where not.
            let b4 = _mm256_and_si256(bits_to_bytes256(u32_at(p.add(8))), _mm256_set1_epi8(16));
            let b5 =
                _mm256_andnot_si256(bits_to_bytes256(u32_at(p.add(12))), _mm256_set1_epi8(-32));
            let q = _mm256_or_si256(nibble_bytes256(p.add(16)), _mm256_or_si256(b4, b5));
            // d0 in lanes 0..4 (elements 0..16), d1 in lanes 4..8.
            let d01 = _mm_castsi128_ps(_mm_loadl_epi64(p as *const __m128i));
            let d = _mm256_permutevar8x32_ps(
                _mm256_castps128_ps256(d01),
                _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
            );
            (q, d, 0.0)
        }
    }
}

/// A weight block unpacked once for a sweep over many activation rows
/// ([`unpack_rows256`]): its integer weights as signed bytes (every type's
/// fit: Q8_0's i8, `q - 8/16/32`, and the unsigned quants' 0..32), the
/// scales of elements 0..16 and 16..32, and the minimum (0 when none).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct I8Block {
    q: [i8; 32],
    d: [f32; 2],
    m: f32,
    _pad: f32,
}

/// [`I8Block`]s as an [`Int8Block`] type (`MIN`: the source type's
/// [`Int8Block::HAS_MIN`]). The integer sums it gives are the source
/// block's exactly: every type with a minimum has nonnegative quants (so
/// its bytes are read unsigned, skipping the sign steps), every type
/// without one is signed, as its source block is. Its scales and minimum
/// are the source's, so every result is the source type's, bit for bit.
#[derive(Debug)]
pub(crate) struct I8B<const MIN: bool>;

impl<const MIN: bool> Int8Block for I8B<MIN> {
    const BYTES: usize = std::mem::size_of::<I8Block>();
    const SIGNED: bool = !MIN;
    const HAS_MIN: bool = MIN;
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn int8(p: *const u8) -> (__m256i, __m256, f32) {
        // SAFETY: `p` points at a whole `I8Block` (trait contract: BYTES is
        // its size): q at offset 0, d at 32, m at 40 (`repr(C)`).
        unsafe {
            let q = _mm256_loadu_si256(p as *const __m256i);
            let d01 = _mm_castsi128_ps(_mm_loadl_epi64(p.add(32) as *const __m128i));
            let d = _mm256_permutevar8x32_ps(
                _mm256_castps128_ps256(d01),
                _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
            );
            (q, d, f32_at(p.add(40)))
        }
    }
}

/// Unpack `rows` weight rows of `nblocks` blocks of `B` (row `r` at
/// `w + r * row_bytes`) into `out`, row after row.
///
/// # Safety
/// `w` must be valid for those rows, `out` for `rows * nblocks` blocks; the
/// CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn unpack_rows256<B: Int8Block>(
    w: *const u8,
    row_bytes: usize,
    rows: usize,
    nblocks: usize,
    out: *mut I8Block,
) {
    for r in 0..rows {
        for blk in 0..nblocks {
            // SAFETY: block `blk` of row `r` is in bounds (fn contract).
            let (q, d, m) = unsafe { B::int8(w.add(r * row_bytes + blk * B::BYTES)) };
            let d = [
                _mm256_cvtss_f32(d),
                _mm256_cvtss_f32(_mm256_permute2f128_ps::<1>(d, d)),
            ];
            // SAFETY: block `r * nblocks + blk` of `out` is in bounds (fn
            // contract); `q` is its first 32 bytes.
            unsafe {
                let o = out.add(r * nblocks + blk);
                _mm256_storeu_si256((*o).q.as_mut_ptr() as *mut __m256i, q);
                (*o).d = d;
                (*o).m = m;
            }
        }
    }
}

/// Quantize `nblocks` blocks of activations at `x` into `out` (the scalar
/// definition's values for finite inputs: `vcvtps2dq` rounds to nearest
/// even under the default MXCSR, as `round_ties_even`).
///
/// # Safety
/// `x` valid for `32 * nblocks` floats, `out` for `nblocks` blocks; the CPU
/// must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_row256(x: *const f32, nblocks: usize, out: *mut Q8Block) {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    // vpackssdw / vpacksswb interleave 128-bit lanes; this undoes it.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..nblocks {
        // SAFETY: floats 32b..32b + 32 are in bounds (fn contract).
        let v: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.add(32 * b + 8 * i)) });
        let a = v.map(|v| _mm256_and_ps(v, abs_mask));
        let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d == 0.0 { 0.0 } else { 1.0 / d });
        let q = v.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, id)));
        // |q| <= 127: the saturating packs are exact.
        let q16 = (
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16.0, q16.1), order);
        let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)));
        // SAFETY: block `b` of `out` is in bounds (fn contract); `q` is at
        // offset 8 of the `repr(C)` block and 32 bytes long.
        unsafe {
            let o = out.add(b);
            (*o).d = d;
            (*o).s = d * s as f32;
            _mm256_storeu_si256((*o).q.as_mut_ptr() as *mut __m256i, q8);
        }
    }
}

/// Pointers and strides of an int8 sweep.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Int8Args {
    /// First weight row of the sweep.
    pub w: *const u8,
    /// Bytes between consecutive weight rows.
    pub row_bytes: usize,
    /// First quantized activation row of the tile.
    pub x: *const Q8Block,
    /// Blocks per activation row (= weight blocks per row).
    pub nblocks: usize,
}

impl Int8Args {
    /// The same sweep starting `rows` weight rows further on (the address
    /// is only computed; the sweep that reads it states its bounds).
    pub fn skip_rows(self, rows: usize) -> Self {
        Self {
            w: self.w.wrapping_add(rows * self.row_bytes),
            ..self
        }
    }
}

/// The canonical 8-lane tree (`int8::reduce8`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn reduce8(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v)); // l + (l+4)
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4)); // + (l+2)
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2))) // + (l+1)
}

/// `tiles` consecutive `R`-row weight tiles against `NB` quantized
/// activation rows: element `(r, c)` of the sweep (weight row `r` from
/// `a.w`, activation row `c` from `a.x`) goes to `y[c * y_stride + r]`.
///
/// # Safety
/// `a.w` must be valid for `R * tiles` rows of `a.nblocks` blocks of `B`,
/// `a.x` for `NB` rows of `a.nblocks` blocks, `y` for writing every element
/// above; the CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn int8_sweep256<B: Int8Block, const R: usize, const NB: usize>(
    a: Int8Args,
    tiles: usize,
    y: *mut f32,
    y_stride: usize,
) {
    let ones = _mm256_set1_epi16(1);
    let step = R * B::BYTES;
    for t in 0..tiles {
        // SAFETY: rows R t..R t + R are in bounds (fn contract).
        let w = unsafe { a.w.add(R * t * a.row_bytes) };
        let ahead = w.wrapping_add(PREFETCH_TILES * R * a.row_bytes);
        let mut acc = [[_mm256_setzero_ps(); NB]; R];
        let mut mins = [[0f32; NB]; R];
        for blk in 0..a.nblocks {
            // Every line of the tile's next-but-`PREFETCH_TILES` blocks.
            for line in 0..step.div_ceil(64) {
                prefetch(ahead.wrapping_add(blk * step + 64 * line));
            }
            for (r, (acc_r, mins_r)) in acc.iter_mut().zip(mins.iter_mut()).enumerate() {
                // SAFETY: block `blk` of row `r` lies within the sweep (fn contract).
                let (wq, dw, mw) = unsafe { B::int8(w.add(r * a.row_bytes + blk * B::BYTES)) };
                // Signed weights: |w| times x with w's sign (vpmaddubsw
                // multiplies unsigned by signed bytes; |w| <= 128, |x| <=
                // 127, so no pair sum of Q8_0 saturates, and the other
                // types' |w| <= 32 are far from it).
                let wu = if B::SIGNED {
                    _mm256_sign_epi8(wq, wq)
                } else {
                    wq
                };
                for c in 0..NB {
                    // SAFETY: block `blk` of activation row `c` is in bounds.
                    let xb = unsafe { &*a.x.add(c * a.nblocks + blk) };
                    // SAFETY: `q` is 32 readable bytes.
                    let xq = unsafe { _mm256_loadu_si256(xb.q.as_ptr() as *const __m256i) };
                    let xs = if B::SIGNED {
                        _mm256_sign_epi8(xq, wq)
                    } else {
                        xq
                    };
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xs), ones);
                    let dd = _mm256_mul_ps(dw, _mm256_set1_ps(xb.d));
                    acc_r[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dd, acc_r[c]);
                    // Without a minimum the definition's sum stays +0.0.
                    if B::HAS_MIN {
                        mins_r[c] = mw.mul_add(xb.s, mins_r[c]);
                    }
                }
            }
        }
        for r in 0..R {
            for c in 0..NB {
                // SAFETY: element (R t + r, c) is in bounds (fn contract).
                unsafe { *y.add(c * y_stride + R * t + r) = reduce8(acc[r][c]) + mins[r][c] };
            }
        }
    }
}

/// The canonical 8-lane tree of each 256-bit half of `v`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
fn reduce8_halves(v: __m512) -> [f32; 2] {
    [
        reduce8(_mm512_castps512_ps256(v)),
        reduce8(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
            _mm512_castps_pd(v),
        ))),
    ]
}

/// `lo` in the low 256 bits and `hi` in the high ones.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
fn join_ps(lo: __m256, hi: __m256) -> __m512 {
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
        _mm256_castps_pd(hi),
    ))
}

/// As [`int8_sweep256`] with AVX-512 VNNI, for `cn <= 2 * NP` activation
/// rows: a 512-bit register holds one weight row's 8 canonical lanes for
/// two activation rows (pair `j`: rows `2j` and `2j + 1`, the second
/// repeating the first past `cn`, and not written), the weight block
/// broadcast to both halves. `vpdpbusd` multiplies unsigned by signed bytes
/// without saturating: the unsigned-weight types (those with a minimum) go
/// in as they are; for signed weights the activations go in as `x + 128`
/// (`x ^ 0x80`, unsigned) from a start of `-128 * sum(w)` per lane, which
/// is `sum(w * x)` exactly. The float steps per lane (convert, `d_w * d_x`,
/// fused add) and the minimum's fused sum (8 activation rows per vector)
/// are the definition's, so every result is `int8::dot`'s, bit for bit.
///
/// # Safety
/// `a.w` must be valid for `R * tiles` rows of `a.nblocks` blocks of `B`,
/// `a.x` for `cn` rows of `a.nblocks` blocks, `y` for writing every element
/// `(r, c < cn)`; `1 <= cn <= 2 * NP <= 8`; the CPU must support AVX-512F/BW,
/// AVX-512 VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn int8_sweep512<B: Int8Block, const R: usize, const NP: usize>(
    a: Int8Args,
    tiles: usize,
    cn: usize,
    y: *mut f32,
    y_stride: usize,
) {
    debug_assert!((1..=2 * NP).contains(&cn) && 2 * NP <= 8);
    let flip = _mm512_set1_epi8(0x80u8 as i8);
    let step = R * B::BYTES;
    // Activation row of half `h` of pair `j` (the last real row past `cn`).
    let act = |j: usize, h: usize| (2 * j + h).min(cn - 1);
    for t in 0..tiles {
        // SAFETY: rows R t..R t + R are in bounds (fn contract).
        let w = unsafe { a.w.add(R * t * a.row_bytes) };
        let ahead = w.wrapping_add(PREFETCH_TILES * R * a.row_bytes);
        let mut acc = [[_mm512_setzero_ps(); NP]; R];
        let mut mins = [_mm256_setzero_ps(); R];
        for blk in 0..a.nblocks {
            for line in 0..step.div_ceil(64) {
                prefetch(ahead.wrapping_add(blk * step + 64 * line));
            }
            // SAFETY: block `blk` of every activation row below `cn` is in
            // bounds (fn contract); `act` stays below `cn`.
            let xb = |c: usize| unsafe { &*a.x.add(c * a.nblocks + blk) };
            let mut xv = [_mm512_setzero_si512(); NP];
            let mut dx = [_mm512_setzero_ps(); NP];
            for j in 0..NP {
                let (x0, x1) = (xb(act(j, 0)), xb(act(j, 1)));
                // SAFETY: each `q` is 32 readable bytes.
                let v = unsafe {
                    _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm256_loadu_si256(x0.q.as_ptr().cast())),
                        _mm256_loadu_si256(x1.q.as_ptr().cast()),
                    )
                };
                xv[j] = if B::SIGNED {
                    _mm512_xor_si512(v, flip)
                } else {
                    v
                };
                dx[j] = join_ps(_mm256_set1_ps(x0.d), _mm256_set1_ps(x1.d));
            }
            let s = if B::HAS_MIN {
                let s: [f32; 8] = std::array::from_fn(|c| xb(c.min(cn - 1)).s);
                // SAFETY: `s` is 8 floats.
                unsafe { _mm256_loadu_ps(s.as_ptr()) }
            } else {
                _mm256_setzero_ps()
            };
            for r in 0..R {
                // SAFETY: block `blk` of row `r` lies within the sweep (fn contract).
                let (wq, dw, mw) = unsafe { B::int8(w.add(r * a.row_bytes + blk * B::BYTES)) };
                let wb = _mm512_broadcast_i64x4(wq);
                let dwb = join_ps(dw, dw);
                let start = if B::SIGNED {
                    let sum128 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, wb);
                    _mm512_sub_epi32(_mm512_setzero_si512(), sum128)
                } else {
                    _mm512_setzero_si512()
                };
                for j in 0..NP {
                    let p = if B::SIGNED {
                        _mm512_dpbusd_epi32(start, xv[j], wb)
                    } else {
                        _mm512_dpbusd_epi32(start, wb, xv[j])
                    };
                    let dd = _mm512_mul_ps(dwb, dx[j]);
                    acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), dd, acc[r][j]);
                }
                // Without a minimum the definition's sum stays +0.0.
                if B::HAS_MIN {
                    mins[r] = _mm256_fmadd_ps(_mm256_set1_ps(mw), s, mins[r]);
                }
            }
        }
        for (r, (acc_r, mins_r)) in acc.iter().zip(mins).enumerate() {
            let mut m = [0f32; 8];
            // SAFETY: `m` is 8 writable floats.
            unsafe { _mm256_storeu_ps(m.as_mut_ptr(), mins_r) };
            for (j, acc_rj) in acc_r.iter().enumerate() {
                for (h, sum) in reduce8_halves(*acc_rj).into_iter().enumerate() {
                    let c = 2 * j + h;
                    if c < cn {
                        // SAFETY: element (R t + r, c < cn) is in bounds (fn contract).
                        unsafe { *y.add(c * y_stride + R * t + r) = sum + m[c] };
                    }
                }
            }
        }
    }
}

/// Whether this CPU has AVX-512 VNNI, which [`int8_sweep512`] needs on top
/// of [`super::Isa::Avx512`].
pub(crate) fn has_avx512_vnni() -> bool {
    is_x86_feature_detected!("avx512vnni")
}

#[cfg(test)]
mod tests {
    use kestrel_model::DType;

    use super::super::int8::{self, Q8Block};
    use super::super::matmul::MatRef;
    use super::super::weight::{Encoding, Weight};
    use super::super::Isa;
    use super::*;
    use crate::synth::{random_matrix, Rng};

    /// Every tile shape of `B`'s sweep against `int8::dot`, bit for bit.
    fn check<B: Int8Block>(w: &MatRef<'_>, xq: &[Q8Block], n: usize) {
        let args = Int8Args {
            w: w.data.as_ptr(),
            row_bytes: w.row_bytes,
            x: xq.as_ptr(),
            nblocks: w.cols / 32,
        };
        for (r, c) in [(1, 1), (4, 1), (2, 2), (1, 2)] {
            if c > n {
                continue;
            }
            let tiles = w.rows / r;
            let mut y = vec![f32::NAN; c * w.rows];
            // SAFETY: `w` holds `w.rows >= r * tiles` rows of `args.nblocks`
            // blocks of `B` (its encoding), `xq` holds `n >= c` rows of as
            // many blocks, `y` is `c x w.rows`; AVX2 was checked by the caller.
            unsafe {
                match (r, c) {
                    (1, 1) => int8_sweep256::<B, 1, 1>(args, tiles, y.as_mut_ptr(), w.rows),
                    (4, 1) => int8_sweep256::<B, 4, 1>(args, tiles, y.as_mut_ptr(), w.rows),
                    (2, 2) => int8_sweep256::<B, 2, 2>(args, tiles, y.as_mut_ptr(), w.rows),
                    _ => int8_sweep256::<B, 1, 2>(args, tiles, y.as_mut_ptr(), w.rows),
                }
            }
            expect(w, xq, &y, r * tiles, c, &format!("avx2 tile {r}x{c}"));
        }
        if !(Isa::Avx512.is_supported() && has_avx512_vnni()) {
            return;
        }
        for r in [1, 4] {
            for cn in 1..=n.min(8) {
                let tiles = w.rows / r;
                let mut y = vec![f32::NAN; cn * w.rows];
                // SAFETY: as above, with `cn <= n` activation rows; AVX-512
                // and VNNI were just checked.
                unsafe {
                    match r {
                        1 => int8_sweep512::<B, 1, 4>(args, tiles, cn, y.as_mut_ptr(), w.rows),
                        _ => int8_sweep512::<B, 4, 4>(args, tiles, cn, y.as_mut_ptr(), w.rows),
                    }
                }
                expect(
                    w,
                    xq,
                    &y,
                    r * tiles,
                    cn,
                    &format!("avx512 vnni tile {r}x{cn}"),
                );
            }
        }
    }

    /// `y` (`c x w.rows`) holds `int8::dot` bit for bit in its first `rows` rows.
    fn expect(w: &MatRef<'_>, xq: &[Q8Block], y: &[f32], rows: usize, c: usize, what: &str) {
        let nb = w.cols / 32;
        for row in 0..rows {
            for j in 0..c {
                let want = int8::dot(w.enc, w.row(row), &xq[j * nb..(j + 1) * nb]);
                let got = y[j * w.rows + row];
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{:?} {what} row {row} act {j}: {got} vs {want}",
                    w.enc
                );
            }
        }
    }

    #[test]
    fn simd_int8_dot_gives_the_definition_for_every_type() {
        if !Isa::Avx2.is_supported() {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        let (rows, cols, n) = (9, 512, 8);
        let mut rng = Rng(21);
        // Activation blocks of every kind: +-127 extremes, a zero block, a
        // spread of magnitudes.
        let mut x = rng.vec(n * cols, 2.0);
        x[..32].iter_mut().enumerate().for_each(|(i, v)| {
            *v = if i % 2 == 0 { 5.0 } else { -5.0 };
        });
        x[32..64].fill(0.0);
        let mut xq = vec![Q8Block::default(); n * cols / 32];
        int8::quantize_row(&x, &mut xq);
        for dtype in DType::ALL.into_iter().filter(|d| d.is_quantized()) {
            let m = random_matrix(&mut rng, dtype, rows, cols, 1.0);
            let prepared = Weight::prepare("w", &m).unwrap();
            let mut mats = vec![prepared.mat()];
            mats.extend(MatRef::new("w", &m).ok());
            for w in &mats {
                macro_rules! go {
                    ($B:ty) => {
                        check::<$B>(w, &xq, n)
                    };
                }
                use super::super::x86;
                for_int8_block!(w.enc, go);
            }
        }
    }
}
