//! The AVX2 fast numerics (`int8.rs` defines the results) straight from
//! the weight blocks: [`Int8Block`], each block type's integer weights and
//! scales; the activation quantizer ([`quantize_row256`]); and
//! [`int8_sweep256`], tiles of up to four outputs (weight row, activation
//! row) with `vpmaddubsw`/`vpmaddwd` integer dots, each block's sums
//! gathered one output per lane, for two or three activation rows and the
//! rows a GEMV tile leaves over. One row is `x86_gemv*.rs`, four and more
//! `x86_lanes*.rs`. Every kernel runs the definition's float steps lane by
//! lane, so results are `int8::dot`'s bit for bit; the tests here check
//! all three files' kernels against it.

use std::arch::x86_64::*;

use super::int8::{self, Q8Block};
use super::scalar::k_scale_min;
use super::x86::{prefetch_l2, PREFETCH_TILES};
use super::x86_blocks::{
    bits_to_bytes256, k_head, k_nibbles256, locate, nibble_bytes256, q5k_bytes256, q6k_bytes256,
    q6k_scales, scales, Block, Q4KB, Q4_0B, Q4_1B, Q5KB, Q5_0B, Q5_1B, Q6KB, Q8_0B,
};

/// A weight block with an integer dot: its 32 weights as bytes in element
/// order, its scale per i32 lane (lanes 0..4 hold elements 0..16, lanes
/// 4..8 elements 16..32: one value but for Q6_K's two) and its minimum (0
/// when none).
pub(crate) trait Int8Block: Block {
    /// Whether the block has a minimum (`m_w * s_x` is then added).
    const HAS_MIN: bool = int8::has_min(Self::ENC);
    /// Whether the weight bytes are signed (Q8_0, and `q - 8`, `q - 16`,
    /// `q - 32` of Q4_0, Q5_0, Q6_K) or not (the nibbles and five-bit quants
    /// of the types with a minimum: Q4_1, Q5_1, Q4_K, Q5_K).
    const SIGNED: bool = !Self::HAS_MIN;
    /// Whether elements 0..16 and 16..32 have scales of their own (Q6_K).
    const TWO: bool = int8::two_scales(Self::ENC);
    /// The largest `|w|` of the block's integer weights.
    const MAX_W: i32 = int8::max_abs_weight(Self::ENC);
    /// What [`super::x86_lanes_avx2::lanes_sweep256`] adds to the weights to read
    /// them unsigned ([`int8::lane_offset`]): all but Q8_0's, which it
    /// reads signed (with sign steps).
    const LANE_OFFSET: i32 = int8::lane_offset(Self::ENC, false);
    /// [`Int8Block::LANE_OFFSET`] for the VNNI sweeps
    /// ([`super::x86_lanes_vnni::lanes_vnni256`], [`super::x86_lanes_vnni::lanes_vnni512`]):
    /// every type's weights unsigned.
    const VNNI_OFFSET: i32 = int8::lane_offset(Self::ENC, true);
    /// How many `vpmaddubsw` results (two products per i16) of
    /// [`super::x86_lanes_avx2::lanes_sweep256`] add up in i16 without overflow
    /// ([`i16_steps`]; `|w| + LANE_OFFSET` bounds its weights).
    const LANE_STEPS: usize = i16_steps(Self::MAX_W + Self::LANE_OFFSET, Self::TWO);
    /// 32-element block `j` of the stored block at `p` (see [`Block::dq256`]).
    ///
    /// # Safety
    /// `p` must be valid for reading one stored block of [`Block::ENC`]; the
    /// CPU must support AVX2, FMA and F16C.
    unsafe fn int8(p: *const u8, j: usize) -> (__m256i, __m256, f32);
}

/// The most `vpmaddubsw` results (each lane two products of a weight up
/// to `max_w` and an activation, `|x| <= 127`) that add up in i16: 8, 4, 2
/// or 1 (a divisor of the block's eight four-element steps, and of the
/// four of a half when `two`).
const fn i16_steps(max_w: i32, two: bool) -> usize {
    let mut steps = if two { 4 } else { 8 };
    while steps > 1 && steps as i32 * 2 * 127 * max_w > i16::MAX as i32 {
        steps /= 2;
    }
    steps
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

/// `impl Int8Block` for each block type: its decoding of block `$j` of
/// the stored block at `$p` (valid for one stored block by the trait's
/// contract; the CPU has AVX2, FMA and F16C).
macro_rules! int8_blocks {
    ($($B:ty => |$p:ident, $j:ident| $decode:block)*) => {$(
        impl Int8Block for $B {
            #[target_feature(enable = "avx2,fma,f16c")]
            #[inline]
            unsafe fn int8($p: *const u8, $j: usize) -> (__m256i, __m256, f32) $decode
        }
    )*};
}

int8_blocks! {
    Q8_0B => |p, _j| {
        // SAFETY: 34 readable bytes at `p` (trait contract): f16 d + 32 i8.
        unsafe {
            let q = _mm256_loadu_si256(p.add(2) as *const __m256i);
            (q, _mm256_broadcastss_ps(scales(p)), 0.0)
        }
    }

    Q4_0B => |p, _j| {
        // SAFETY: 18 readable bytes at `p` (trait contract): f16 d + 16 nibble bytes.
        unsafe {
            let q = _mm256_sub_epi8(nibble_bytes256(p.add(2)), _mm256_set1_epi8(8));
            (q, _mm256_broadcastss_ps(scales(p)), 0.0)
        }
    }

    Q4_1B => |p, _j| {
        // SAFETY: 20 readable bytes at `p` (trait contract): f16 d, m + 16 nibble bytes.
        unsafe {
            let dm = scales(p);
            let m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
            (nibble_bytes256(p.add(4)), _mm256_broadcastss_ps(dm), m)
        }
    }

    Q5_0B => |p, _j| {
        // SAFETY: 22 readable bytes at `p` (trait contract): f16 d, u32 qh,
        // 16 nibble bytes.
        unsafe {
            // q - 16 as a signed byte: the nibble where bit 4 is set (16 + k
            // - 16 = k), the nibble with the high bits set (k - 16) where not.
            let high =
                _mm256_andnot_si256(bits_to_bytes256(u32_at(p.add(2))), _mm256_set1_epi8(-16));
            (
                _mm256_or_si256(nibble_bytes256(p.add(6)), high),
                _mm256_broadcastss_ps(scales(p)),
                0.0,
            )
        }
    }

    Q5_1B => |p, _j| {
        // SAFETY: 24 readable bytes at `p` (trait contract): f16 d, f16 m,
        // u32 qh, 16 nibble bytes.
        unsafe {
            let dm = scales(p);
            let high = _mm256_and_si256(bits_to_bytes256(u32_at(p.add(4))), _mm256_set1_epi8(16));
            let q = _mm256_or_si256(nibble_bytes256(p.add(8)), high);
            (q, _mm256_broadcastss_ps(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)))
        }
    }

    Q4KB => |p, j| {
        // SAFETY: 144 readable bytes at `p` (trait contract); `j < 8`.
        unsafe {
            let (d, m) = k_scale_min(&k_head(p), j);
            (k_nibbles256(p.add(16), j), _mm256_set1_ps(d), -m)
        }
    }

    Q5KB => |p, j| {
        // SAFETY: 176 readable bytes at `p` (trait contract); `j < 8`.
        unsafe {
            let (d, m) = k_scale_min(&k_head(p), j);
            (q5k_bytes256(p, j), _mm256_set1_ps(d), -m)
        }
    }

    Q6KB => |p, j| {
        // SAFETY: 210 readable bytes at `p` (trait contract); `j < 8`.
        unsafe {
            let q = _mm256_sub_epi8(q6k_bytes256(p, j), _mm256_set1_epi8(32));
            let [d0, d1] = q6k_scales(p, j);
            // d0 in lanes 0..4 (elements 0..16), d1 in lanes 4..8.
            (q, _mm256_setr_ps(d0, d0, d0, d0, d1, d1, d1, d1), 0.0)
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

/// The four lanes `f(0..4)`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn lanes4(f: impl Fn(usize) -> f32) -> __m128 {
    _mm_setr_ps(f(0), f(1), f(2), f(3))
}

/// `tiles` consecutive `R`-row weight tiles against `NB` quantized
/// activation rows (`R * NB <= 4` outputs, one per lane of a 128-bit
/// register, output `(r, c)` in lane `r * NB + c`): element `(r, c)` of the
/// sweep (weight row `r` from `a.w`, activation row `c` from `a.x`) goes to
/// `y[c * y_stride + r]`. Per block, each output's 8-lane integer sums go
/// to one lane by three `vphaddd` (elements 0..16 in the low half, 16..32
/// in the high one: the halves of a two-scale block).
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
    const { assert!(R * NB <= 4) };
    let ones = _mm256_set1_epi16(1);
    let step = R * B::STRIDE;
    // The output of lane `l` (lanes past `R * NB` repeat the last one).
    let rc = |l: usize| {
        let o = l.min(R * NB - 1);
        (o / NB, o % NB)
    };
    for t in 0..tiles {
        // SAFETY: rows R t..R t + R are in bounds (fn contract).
        let w = unsafe { a.w.add(R * t * a.row_bytes) };
        let ahead = w.wrapping_add(PREFETCH_TILES * R * a.row_bytes);
        let mut acc = _mm_setzero_ps();
        let mut mins = _mm_setzero_ps();
        for blk in 0..a.nblocks {
            // Every line of the tile's next-but-`PREFETCH_TILES` blocks.
            for line in 0..step.div_ceil(64) {
                prefetch_l2(ahead.wrapping_add(blk * step + 64 * line));
            }
            // SAFETY: block `blk` of activation rows 0..NB is in bounds.
            let xb: [&Q8Block; NB] =
                std::array::from_fn(|c| unsafe { &*a.x.add(c * a.nblocks + blk) });
            // SAFETY: each `q` is 32 readable bytes.
            let xq = xb.map(|b| unsafe { _mm256_loadu_si256(b.q.as_ptr() as *const __m256i) });
            let mut p = [_mm256_setzero_si256(); 4];
            let mut dw = [[0f32; 2]; R];
            let mut mw = [0f32; R];
            for r in 0..R {
                let (at, j) = locate::<B>(w.wrapping_add(r * a.row_bytes), blk);
                // SAFETY: block `blk` of row `r` lies within the sweep (fn contract).
                let (wq, d, m) = unsafe { B::int8(at, j) };
                dw[r] = [
                    _mm256_cvtss_f32(d),
                    _mm256_cvtss_f32(_mm256_permute2f128_ps::<1>(d, d)),
                ];
                mw[r] = m;
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
                    let xs = if B::SIGNED {
                        _mm256_sign_epi8(xq[c], wq)
                    } else {
                        xq[c]
                    };
                    p[r * NB + c] = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xs), ones);
                }
            }
            // Lane l of the low half: output l's sum over elements 0..16;
            // of the high half: over 16..32.
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
            let (lo, hi) = (_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
            let dx = lanes4(|l| xb[rc(l).1].d);
            let dd = |half: usize| _mm_mul_ps(lanes4(|l| dw[rc(l).0][half]), dx);
            if B::TWO {
                acc = _mm_fmadd_ps(_mm_cvtepi32_ps(lo), dd(0), acc);
                acc = _mm_fmadd_ps(_mm_cvtepi32_ps(hi), dd(1), acc);
            } else {
                acc = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_add_epi32(lo, hi)), dd(0), acc);
            }
            // Without a minimum the definition's sum stays +0.0.
            if B::HAS_MIN {
                let s = lanes4(|l| xb[rc(l).1].s);
                mins = _mm_fmadd_ps(lanes4(|l| mw[rc(l).0]), s, mins);
            }
        }
        let mut out = [0f32; 4];
        // SAFETY: `out` is 4 writable floats.
        unsafe { _mm_storeu_ps(out.as_mut_ptr(), _mm_add_ps(acc, mins)) };
        for (l, v) in out.into_iter().take(R * NB).enumerate() {
            let (r, c) = rc(l);
            // SAFETY: element (R t + r, c) is in bounds (fn contract).
            unsafe { *y.add(c * y_stride + R * t + r) = v };
        }
    }
}

#[cfg(test)]
mod tests {
    use kestrel_model::DType;

    use super::super::coverage::{report, tested_isas};
    use super::super::int8::{LaneRows, Numerics};
    use super::super::matmul::{matmul, MatRef};
    use super::super::scalar::decode_block;
    use super::super::weight::{Encoding, Weight};
    use super::super::x86_amx::{lanes_amx, AMX_ROWS};
    use super::super::x86_gemv::{gemv8_256, gemv8_q4k_pair256};
    use super::super::x86_gemv512::{gemv8_q4k_vnni512, gemv8_q6k_gfni512, gemv8_q6k_vnni512};
    use super::super::x86_lanes::{
        after_tiles, has_avx512_vnni, has_avx_vnni, has_gfni, unpack_rows256, Carry, I8Block,
        LaneArgs, StoredRows,
    };
    use super::super::x86_lanes_avx2::{lanes_sweep256, lanes_sweep256_absx};
    use super::super::x86_lanes_stored::{
        q4_k_avxvnni256, q4_k_lanes256, q4_k_vnni256, q4_k_vnni512, q8_0_avxvnni256, q8_0_lanes256,
        q8_0_vnni256,
    };
    use super::super::x86_lanes_vnni::{
        lanes_avxvnni256, lanes_vnni256, lanes_vnni512, stored_avxvnni256, stored_vnni256,
        stored_vnni512,
    };
    use super::super::x86_tile8::Tile8;
    use super::super::Isa;
    use super::*;
    use crate::synth::{random_matrix, Rng};

    /// Every tile shape of `B`'s sweeps against `int8::dot`, bit for bit.
    fn check<B: Tile8>(w: &MatRef<'_>, xq: &[Q8Block], n: usize) {
        let nb = w.cols / 32;
        let args = Int8Args {
            w: w.data.as_ptr(),
            row_bytes: w.row_bytes,
            x: xq.as_ptr(),
            nblocks: nb,
        };
        for (r, c) in [(1, 1), (4, 1), (2, 2), (1, 2), (1, 3)] {
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
                    (1, 2) => int8_sweep256::<B, 1, 2>(args, tiles, y.as_mut_ptr(), w.rows),
                    _ => int8_sweep256::<B, 1, 3>(args, tiles, y.as_mut_ptr(), w.rows),
                }
            }
            expect(w, xq, &y, r * tiles, c, &format!("avx2 tile {r}x{c}"));
        }
        let mut y = vec![f32::NAN; w.rows];
        // SAFETY: `w` holds `w.rows >= 8 * (w.rows / 8)` rows of `B`, `xq`
        // at least one row, `y` `w.rows` floats; AVX2 was checked by the caller.
        unsafe { gemv8_256::<B>(args, w.rows / 8, y.as_mut_ptr()) };
        expect(w, xq, &y, w.rows / 8 * 8, 1, "avx2 gemv 8x1");
        if B::ENC == Encoding::Q4K {
            let mut y = vec![f32::NAN; w.rows];
            // SAFETY: as for `gemv8_256` above, on Q4_K rows.
            unsafe { gemv8_q4k_pair256(args, w.rows / 8, y.as_mut_ptr()) };
            expect(w, xq, &y, w.rows / 8 * 8, 1, "avx2 paired gemv 8x1");
        }
        let vnni = Isa::Avx512.is_supported() && has_avx512_vnni();
        let gemv_vnni: &[(unsafe fn(_, _, _), bool, &str)] = match B::ENC {
            Encoding::Q4K => &[(gemv8_q4k_vnni512, vnni, "vnni gemv 8x1")],
            Encoding::Q6K => &[
                (gemv8_q6k_vnni512, vnni, "vnni gemv 8x1"),
                (gemv8_q6k_gfni512, vnni && has_gfni(), "gfni gemv 8x1"),
            ],
            _ => &[],
        };
        for &(gemv, supported, what) in gemv_vnni {
            if !supported {
                continue;
            }
            let mut y = vec![f32::NAN; w.rows];
            // SAFETY: as for `gemv8_256` above, the rows of the GEMV's
            // type; AVX-512 VNNI (and for GFNI's, GFNI) checked just now.
            unsafe { gemv(args, w.rows / 8, y.as_mut_ptr()) };
            expect(w, xq, &y, w.rows / 8 * 8, 1, what);
        }
        // Unpacked for each sweep's offsets.
        let unpacked = [false, true].map(|vnni| {
            let mut u = vec![I8Block::default(); w.rows * nb];
            let unpack = if vnni {
                unpack_rows256::<B, true>
            } else {
                unpack_rows256::<B, false>
            };
            // SAFETY: `w` holds `w.rows` rows of `nb` blocks of `B`, `u`
            // as many; AVX2 was checked by the caller.
            let lowest = unsafe { unpack(args.w, w.row_bytes, w.rows, nb, false, u.as_mut_ptr()) };
            (u, lowest)
        });
        let has_lowest = B::ENC == Encoding::Q8_0
            && (0..w.rows)
                .any(|row| (0..nb).any(|b| decode_block(w.enc, w.row(row), b).0.contains(&-128)));
        assert_eq!(
            unpacked[0].1, has_lowest,
            "AVX2 unpack: -128 among the weights"
        );
        assert!(!unpacked[1].1, "VNNI unpack reports no -128");
        // The VNNI sweeps of 16 lanes also take two groups at once; the
        // 8-lane ones run once more with AVX-VNNI's encoding (`avx`).
        let avx_vnni = Isa::Avx2.is_supported() && has_avx_vnni();
        for (lanes, on_vnni, groups, avx) in [
            (8, false, 1, false),
            (8, true, 1, false),
            (8, true, 1, true),
            (16, true, 1, false),
            (16, true, 2, false),
        ] {
            if if avx { !avx_vnni } else { on_vnni && !vnni } {
                continue;
            }
            for cn in (groups - 1) * lanes + 1..=n.min(groups * lanes) {
                let mut x = LaneRows::default();
                x.fill(xq, cn, nb, lanes, true);
                for r in [1, 2, 4] {
                    let tiles = w.rows / r;
                    let mut y = vec![f32::NAN; cn * w.rows];
                    let p = unpacked[usize::from(on_vnni)].0.as_ptr();
                    let (a, out) = (LaneArgs::group(&x, 0), y.as_mut_ptr());
                    macro_rules! run {
                        ($sweep:ident) => {
                            match r {
                                1 => $sweep::<B, 1>(p, nb, tiles, a, cn, out, w.rows),
                                2 => $sweep::<B, 2>(p, nb, tiles, a, cn, out, w.rows),
                                _ => $sweep::<B, 4>(p, nb, tiles, a, cn, out, w.rows),
                            }
                        };
                        ($sweep:ident::<$G:literal>, $a:expr) => {
                            run!($sweep::<$G>, $a, p, nb, out, None)
                        };
                        ($sweep:ident::<$G:literal>, $a:expr, $p:expr, $nb:expr, $out:expr, $carry:expr) => {
                            match r {
                                1 => {
                                    $sweep::<B, 1, $G>($p, $nb, tiles, $a, cn, $out, w.rows, $carry)
                                }
                                2 => {
                                    $sweep::<B, 2, $G>($p, $nb, tiles, $a, cn, $out, w.rows, $carry)
                                }
                                _ => {
                                    $sweep::<B, 4, $G>($p, $nb, tiles, $a, cn, $out, w.rows, $carry)
                                }
                            }
                        };
                    }
                    // SAFETY: `p` holds `w.rows >= r * tiles` rows unpacked
                    // for this sweep, `x` `groups` groups of `nb` blocks,
                    // `y` is `cn x w.rows`; the ISA was checked above.
                    unsafe {
                        match (lanes, on_vnni, groups) {
                            (8, false, _) => run!(lanes_sweep256),
                            (8, true, _) if avx => run!(lanes_avxvnni256::<1>, [a]),
                            (8, true, _) => run!(lanes_vnni256::<1>, [a]),
                            (_, _, 1) => run!(lanes_vnni512::<1>, [a]),
                            _ => run!(lanes_vnni512::<2>, [a, LaneArgs::group(&x, 1)]),
                        }
                    }
                    let what = format!(
                        "{lanes}-lane x{groups} (vnni {on_vnni}, avx-vnni {avx}) tile {r}x{cn}"
                    );
                    expect(w, xq, &y, r * tiles, cn, &what);
                    if on_vnni && nb >= 2 * B::SUB {
                        // In two chunks of whole stored blocks, unpacked
                        // apart, the sums carried from one to the next.
                        let k1 = nb / B::SUB / 2 * B::SUB;
                        let stride = 2 * groups * lanes;
                        let mut kept = vec![f32::NAN; w.rows * stride];
                        let mut y = vec![f32::NAN; cn * w.rows];
                        let out = y.as_mut_ptr();
                        for (k0, kn) in [(0, k1), (k1, nb - k1)] {
                            let mut u = vec![I8Block::default(); w.rows * kn];
                            let from = |g| LaneArgs::group(&x, g).skip_blocks(k0, lanes);
                            let carry = Some(Carry {
                                p: kept.as_mut_ptr(),
                                stride,
                                first: k0 == 0,
                                last: k0 + kn == nb,
                            });
                            let p = u.as_ptr();
                            // SAFETY: blocks k0..k0 + kn of each row are
                            // whole stored blocks of `B` from that pointer
                            // on, `u` holds `w.rows * kn` blocks; `kept` the
                            // sums of `w.rows` rows for `groups` groups,
                            // left by the first chunk for the second; as
                            // above otherwise.
                            unsafe {
                                let at = args.w.add(k0 / B::SUB * B::ENC.block_bytes());
                                unpack_rows256::<B, true>(
                                    at,
                                    w.row_bytes,
                                    w.rows,
                                    kn,
                                    false,
                                    u.as_mut_ptr(),
                                );
                                match (lanes, groups) {
                                    (8, _) if avx => {
                                        run!(lanes_avxvnni256::<1>, [from(0)], p, kn, out, carry)
                                    }
                                    (8, _) => {
                                        run!(lanes_vnni256::<1>, [from(0)], p, kn, out, carry)
                                    }
                                    (_, 1) => {
                                        run!(lanes_vnni512::<1>, [from(0)], p, kn, out, carry)
                                    }
                                    _ => run!(
                                        lanes_vnni512::<2>,
                                        [from(0), from(1)],
                                        p,
                                        kn,
                                        out,
                                        carry
                                    ),
                                }
                            }
                        }
                        expect(w, xq, &y, r * tiles, cn, &format!("{what}, in two chunks"));
                    }
                    if !on_vnni && B::ENC == Encoding::Q8_0 && !has_lowest {
                        let mut y = vec![f32::NAN; cn * w.rows];
                        let out = y.as_mut_ptr();
                        // SAFETY: as above; no weight is -128 (checked).
                        unsafe {
                            match r {
                                1 => lanes_sweep256_absx::<B, 1>(p, nb, tiles, a, cn, out, w.rows),
                                2 => lanes_sweep256_absx::<B, 2>(p, nb, tiles, a, cn, out, w.rows),
                                _ => lanes_sweep256_absx::<B, 4>(p, nb, tiles, a, cn, out, w.rows),
                            }
                        };
                        expect(
                            w,
                            xq,
                            &y,
                            r * tiles,
                            cn,
                            &format!("8-lane |x| tile {r}x{cn}"),
                        );
                    }
                    // The one-scale sweeps straight from stored blocks:
                    // Q4_0 and Q4_1, and Q8_0 on 16 lanes.
                    let one_scale = on_vnni
                        && match B::ENC {
                            Encoding::Q4_0 | Encoding::Q4_1 => true,
                            Encoding::Q8_0 => lanes == 16,
                            _ => false,
                        };
                    if matches!(
                        (lanes, B::ENC),
                        (8, Encoding::Q8_0 | Encoding::Q4K) | (16, Encoding::Q4K)
                    ) || one_scale
                    {
                        let mut y = vec![f32::NAN; cn * w.rows];
                        let wp = StoredRows {
                            w: args.w,
                            row_bytes: w.row_bytes,
                            nblocks: nb,
                        };
                        let out = y.as_mut_ptr();
                        let pair = [a, LaneArgs::group(&x, 1)];
                        macro_rules! direct {
                            ($sweep:ident $(::<$($B:ident,)? $G:literal>)?, $x:expr) => {
                                match r {
                                    1 => $sweep::<$($($B,)?)? 1 $(, $G)?>(wp, tiles, $x, cn, out, w.rows),
                                    2 => $sweep::<$($($B,)?)? 2 $(, $G)?>(wp, tiles, $x, cn, out, w.rows),
                                    _ => $sweep::<$($($B,)?)? 4 $(, $G)?>(wp, tiles, $x, cn, out, w.rows),
                                }
                            };
                        }
                        // SAFETY: `w` holds `w.rows >= r * tiles` rows of
                        // `nb` blocks of the sweep's type, `x` `groups`
                        // groups of `nb` blocks with their sums, `y` is `cn
                        // x w.rows`; the ISA was checked above.
                        unsafe {
                            match (lanes, groups, on_vnni, B::ENC) {
                                (16, 2, ..) if one_scale => direct!(stored_vnni512::<B, 2>, pair),
                                (16, ..) if one_scale => direct!(stored_vnni512::<B, 1>, [a]),
                                _ if one_scale && avx => {
                                    direct!(stored_avxvnni256::<B, 1>, [a])
                                }
                                _ if one_scale => direct!(stored_vnni256::<B, 1>, [a]),
                                (16, 2, ..) => direct!(q4_k_vnni512::<2>, pair),
                                (16, ..) => direct!(q4_k_vnni512::<1>, [a]),
                                (_, _, true, Encoding::Q8_0) if avx => direct!(q8_0_avxvnni256, a),
                                (_, _, true, Encoding::Q8_0) => direct!(q8_0_vnni256, a),
                                (_, _, true, _) if avx => direct!(q4_k_avxvnni256, a),
                                (_, _, true, _) => direct!(q4_k_vnni256, a),
                                (_, _, false, Encoding::Q4K) => direct!(q4_k_lanes256, a),
                                _ => direct!(q8_0_lanes256, a),
                            }
                        }
                        let what = format!("{lanes}-lane x{groups} stored-block tile {r}x{cn}");
                        expect(w, xq, &y, r * tiles, cn, &what);
                    }
                }
            }
        }
        if Isa::Amx.is_supported() && w.rows >= AMX_ROWS && !B::TWO {
            let mut tiled = vec![I8Block::default(); w.rows * nb];
            // SAFETY: `w` holds `w.rows` rows of `nb` blocks of `B`, `tiled`
            // as many; AVX2 was checked by the caller.
            unsafe {
                unpack_rows256::<B, true>(args.w, w.row_bytes, w.rows, nb, true, tiled.as_mut_ptr())
            };
            for cn in 1..=n.min(16) {
                let mut x = LaneRows::default();
                x.fill(xq, cn, nb, 16, true);
                let tiles = w.rows / AMX_ROWS;
                let rest = w.rows - AMX_ROWS * tiles;
                let mut y = vec![f32::NAN; cn * w.rows];
                // SAFETY: `tiled` holds `w.rows >= 16 * tiles` rows
                // unpacked for VNNI, the whole tiles as tile blocks, then
                // the `rest` rows row after row from `after_tiles` on; `x`
                // is one 16-lane group of `nb` blocks, `y` `cn x w.rows`;
                // AMX was checked above (AVX-512 VNNI with it).
                unsafe {
                    lanes_amx::<B>(
                        tiled.as_ptr().cast(),
                        nb,
                        tiles,
                        LaneArgs::group(&x, 0),
                        cn,
                        y.as_mut_ptr(),
                        w.rows,
                    );
                    lanes_vnni512::<B, 1, 1>(
                        tiled.as_ptr().add(after_tiles(AMX_ROWS * tiles, nb)),
                        nb,
                        rest,
                        [LaneArgs::group(&x, 0)],
                        cn,
                        y.as_mut_ptr().add(AMX_ROWS * tiles),
                        w.rows,
                        None,
                    );
                };
                expect(w, xq, &y, w.rows, cn, &format!("amx x{cn}"));
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

    /// Weights at their type's largest `|w|` against activations all at
    /// 127: every i16 sum the sweeps keep reaches its bound (`i16_steps`),
    /// and still gives the definition. The signed types' blocks hold their
    /// most negative weight and, elsewhere, their most positive one (the lane
    /// sweep reads `w + offset`, largest there).
    #[test]
    fn extreme_blocks_stay_within_i16() {
        if tested_isas("extreme_blocks_stay_within_i16", &[Isa::Avx2]).is_empty() {
            return;
        }
        let (rows, cols, n) = (8, 256, 32);
        let mut xq = vec![Q8Block::default(); n * cols / 32];
        int8::quantize_row(&vec![1.0; n * cols], &mut xq);
        assert!(xq.iter().all(|b| b.q == [127; 32]));
        for dtype in DType::ALL.into_iter().filter(|d| d.is_quantized()) {
            // Types with a minimum quantize a block of 0 then 1s to the top
            // quant; the others quantize -1 to their most negative one,
            // -2^(b-1), and 1 - 2^(1-b) to the most positive, 2^(b-1) - 1.
            let enc = Encoding::of(dtype);
            let v: Vec<f32> = if int8::has_min(enc) {
                (0..rows * cols)
                    .map(|i| if i % 32 == 0 { 0.0 } else { 1.0 })
                    .collect()
            } else {
                let most = int8::max_abs_weight(enc) as f32;
                (0..rows * cols)
                    .map(|i| if i % 16 == 0 { -1.0 } else { 1.0 - 1.0 / most })
                    .collect()
            };
            let m = kestrel_model::Matrix::quantize(dtype, rows, cols, &v);
            let prepared = Weight::prepare("w", &m).unwrap();
            let mats = [prepared.mat()];
            for w in &mats {
                macro_rules! go {
                    ($B:ty) => {{
                        // The block's integer weights do reach MAX_W.
                        let row = w.row(0);
                        let top = (0..w.cols / 32)
                            .map(|b| int8::block_max_abs(w.enc, row, b))
                            .max()
                            .unwrap();
                        assert!(
                            top >= <$B as Int8Block>::MAX_W - 1,
                            "{dtype:?}: |w| reaches {top} of {}",
                            <$B as Int8Block>::MAX_W
                        );
                        let high = (0..w.cols / 32)
                            .flat_map(|b| decode_block(w.enc, row, b).0)
                            .max()
                            .unwrap();
                        assert!(
                            high >= <$B as Int8Block>::MAX_W - 2,
                            "{dtype:?}: w reaches {high} of {}",
                            <$B as Int8Block>::MAX_W - 1
                        );
                        check::<$B>(w, &xq, n)
                    }};
                }
                use super::super::x86_blocks;
                for_int8_block!(w.enc, go);
            }
        }
    }

    #[test]
    fn simd_int8_dot_gives_the_definition_for_every_type() {
        // The kernels `check` runs, each where this CPU has its features.
        let vnni = Isa::Avx512.is_supported() && has_avx512_vnni();
        report(
            "simd_int8_dot_gives_the_definition_for_every_type",
            &[
                ("avx2", Isa::Avx2.is_supported()),
                ("avxvnni", Isa::Avx2.is_supported() && has_avx_vnni()),
                ("avx512vnni", vnni),
                ("gfni", vnni && has_gfni()),
                ("amx", Isa::Amx.is_supported()),
            ],
        );
        if !Isa::Avx2.is_supported() {
            return;
        }
        let mut rng = Rng(21);
        // 352 columns: one-scale blocks unpack eight at a time, then a tail
        // of three.
        for dtype in DType::ALL.into_iter().filter(|d| d.is_quantized()) {
            for cols in [512, 352]
                .into_iter()
                .filter(|c| c % dtype.block_elems() == 0)
            {
                check_type(&mut rng, dtype, 9, cols, 32);
            }
        }
    }

    /// Q8_0 rows holding -128 (no quantizer writes it; a file may): the
    /// AVX2 unpack reports it, and the many-row matmul keeps such rows off
    /// the `|x|` sweep (`w * sgn(x)` would not fit a byte); with or without
    /// it, held to AVX2, the definition bit for bit.
    #[test]
    fn q8_0_lowest_weight_keeps_the_definition() {
        if tested_isas("q8_0_lowest_weight_keeps_the_definition", &[Isa::Avx2]).is_empty() {
            return;
        }
        let mut rng = Rng(23);
        // 12 activation rows: two 8-lane groups, so the weights unpack.
        let (rows, cols, n) = (16, 256, 12);
        let x = rng.vec(n * cols, 2.0);
        let mut xq = vec![Q8Block::default(); n * cols / 32];
        int8::quantize_row(&x, &mut xq);
        let plain = random_matrix(&mut rng, DType::Q8_0, rows, cols, 1.0);
        let mut data = plain.data.to_vec();
        // Row 7, block 3 (2 bytes of f16 scale, then 32 weights), weight 5.
        data[7 * plain.row_bytes() + 3 * 34 + 2 + 5] = 0x80;
        let lowest = kestrel_model::Matrix {
            data: data.into(),
            ..plain.clone()
        };
        for (m, what) in [(&plain, "no -128"), (&lowest, "-128")] {
            let prepared = Weight::prepare("w", m).unwrap();
            let w = prepared.mat();
            check::<super::super::x86_blocks::Q8_0B>(&w, &xq, n);
            let mut y = vec![f32::NAN; n * rows];
            matmul(None, Isa::Avx2, Numerics::Fast, w, &x, n, &mut y);
            expect(&w, &xq, &y, rows, n, &format!("avx2 matmul, {what}"));
        }
    }

    /// The AMX sweep (one-scale types; and every other sweep) on whole
    /// 16-row tiles and a tail, where the CPU and OS grant AMX.
    #[test]
    fn amx_int8_sweep_gives_the_definition_for_every_type() {
        if tested_isas(
            "amx_int8_sweep_gives_the_definition_for_every_type",
            &[Isa::Amx],
        )
        .is_empty()
        {
            return;
        }
        let mut rng = Rng(22);
        for dtype in DType::ALL.into_iter().filter(|d| d.is_quantized()) {
            check_type(&mut rng, dtype, 35, 512, 16);
        }
    }

    /// [`check`] on a random `rows x cols` matrix of `dtype` against `n`
    /// activation rows with blocks of every kind: +-127 extremes, a zero
    /// block, a spread of magnitudes.
    fn check_type(rng: &mut Rng, dtype: DType, rows: usize, cols: usize, n: usize) {
        let mut x = rng.vec(n * cols, 2.0);
        x[..32].iter_mut().enumerate().for_each(|(i, v)| {
            *v = if i % 2 == 0 { 5.0 } else { -5.0 };
        });
        x[32..64].fill(0.0);
        let mut xq = vec![Q8Block::default(); n * cols / 32];
        int8::quantize_row(&x, &mut xq);
        let m = random_matrix(rng, dtype, rows, cols, 1.0);
        let prepared = Weight::prepare("w", &m).unwrap();
        let w = prepared.mat();
        macro_rules! go {
            ($B:ty) => {
                check::<$B>(&w, &xq, n)
            };
        }
        use super::super::x86_blocks;
        for_int8_block!(w.enc, go);
    }
}
