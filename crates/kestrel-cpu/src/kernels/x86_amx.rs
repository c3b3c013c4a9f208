//! The 16-lane sweep on AMX-INT8 tiles ([`lanes_amx`]), for one-scale
//! blocks (every int8 type but Q6_K): the same unpacked weights (unsigned
//! `w + offset`) and 16-lane [`LaneRows`](super::int8::LaneRows) group as
//! [`super::x86_lanes_vnni::lanes_vnni512`], with each block's integer sums for
//! 16 weight rows x 16 activation rows from one `tdpbusd` instead of 128
//! `vpdpbusd`.
//!
//! Why it lines up: a 16-lane group's block is already a `tdpbusd` right
//! operand (eight rows of four-byte groups, one per lane), and the weights
//! unpacked in 16-row tiles ([`TileBlock`]) put a block's 16 rows' quants
//! in 8 consecutive lines, its left operand. The integer
//! sums are exact in i32; the VNNI sweep's start, `-offset * sum(x)`, is
//! added to them before its float step, which follows row by row; so the
//! results are `int8.rs`'s definition bit for bit (tests in `x86_int8.rs`).
//!
//! What it costs (the 2-vCPU Emerald Rapids VM of
//! `docs/bench/notes/2026-11-26-amx-tiles.md`):
//! a block's tile work, zero + two loads + `tdpbusd` + store, runs about
//! 25 ns, so the products run a few blocks ahead of their float steps, and
//! each block's sums are stored only after the next block's product is
//! issued (a store straight after its own product waited for it, and the
//! next product for the store: `perf` put half the sweep's samples there).
//! Two-scale blocks (Q6_K) would take two half-depth products each and
//! measured no faster than VNNI: not here.
//!
//! Tiles need the process's permission (Linux's `ARCH_REQ_XCOMP_PERM`,
//! [`has_amx`]) and a tile configuration per thread ([`configure`]). Rust
//! has no stable AMX intrinsics; the tile instructions are inline `asm!`
//! (the compiler never uses tile registers, so none of its state is
//! touched).

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::Cell;

use super::x86::prefetch_l1;
use super::x86_int8::Int8Block;
use super::x86_lanes::{LaneArgs, TileBlock, TILE_SLOTS};

/// Weight rows (and outputs) per [`lanes_amx`] tile.
pub(crate) const AMX_ROWS: usize = super::x86_lanes::TILE_ROWS;

/// The fewest blocks per row the tiles take: they paid from the 1B shape's
/// 2048-column rows (64 blocks) on; with them at 32 and at 0, the 135M
/// default model (576- and 1536-column rows, 18 and 48 blocks) ran 32
/// streams no faster than on VNNI, so it keeps the VNNI sweep.
pub(crate) const AMX_MIN_BLOCKS: usize = 64;

/// Whether AMX-INT8 runs in this process: the CPU reports AMX-TILE and
/// AMX-INT8 (CPUID leaf 7), and Linux grants the tile data state (asked
/// once; a kernel without AMX support refuses, and so does one where some
/// thread's signal stack is too small for the state).
pub(crate) fn has_amx() -> bool {
    static AMX: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AMX.get_or_init(|| {
        let edx = __cpuid_count(7, 0).edx;
        let (tile, int8) = (edx & (1 << 24) != 0, edx & (1 << 25) != 0);
        tile && int8 && request_tile_state()
    })
}

/// Ask Linux for the AMX tile data state (`XFEATURE_XTILEDATA`).
#[cfg(target_os = "linux")]
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, feature) reads no memory; it
    // only extends the process's permitted xstate features, or fails.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

/// Elsewhere the state's permission is not known to be granted: no tiles.
#[cfg(not(target_os = "linux"))]
fn request_tile_state() -> bool {
    false
}

/// A tile configuration (`ldtilecfg`'s 64-byte layout, palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// [`lanes_amx`]'s tiles: two sets, `tmm0`-`tmm2` and `tmm3`-`tmm5`, of left
/// operand (16 weight rows x 32 bytes), right operand (8 rows of 16 lanes'
/// four-byte groups) and sums (16 x 16 i32).
const CONFIG: TileConfig = {
    let mut c = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb: [0; 16],
        rows: [0; 16],
    };
    let mut set = 0;
    while set < 2 {
        let t = 3 * set;
        (c.rows[t], c.colsb[t]) = (16, 32);
        (c.rows[t + 1], c.colsb[t + 1]) = (8, 64);
        (c.rows[t + 2], c.colsb[t + 2]) = (16, 64);
        set += 1;
    }
    c
};

thread_local! {
    /// Whether this thread's tiles hold [`CONFIG`].
    static CONFIGURED: Cell<bool> = const { Cell::new(false) };
}

/// Load [`CONFIG`] into this thread's tile state, once per thread (nothing
/// else in the process configures tiles).
///
/// # Safety
/// [`has_amx`] must have returned true.
unsafe fn configure() {
    CONFIGURED.with(|c| {
        if !c.get() {
            // SAFETY: AMX is granted (fn contract); `CONFIG` is a valid,
            // aligned 64-byte palette-1 configuration.
            unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
            c.set(true);
        }
    });
}

/// 64-byte aligned scratch for tiles moved through memory.
#[repr(C, align(64))]
struct Aligned<T>(T);

/// How many blocks [`lanes_amx`] runs its products ahead of their float
/// steps (the tiles' stores are done when the float step reads them, and
/// the tile unit works beside the vector ports; 1 and 8 measured slower),
/// and the ring of sums tiles that lag takes.
const LAG: usize = 4;
const RING: usize = 8;

/// How many blocks ahead [`lanes_amx`] prefetches its tile operands.
const AHEAD: usize = 4;

/// One block's products on the tile set of sums `tmm$c`, left `tmm$l` and
/// right `tmm$r`: the sums zeroed, the left operand's 16 rows at `$a`, 32
/// bytes apart, and the right's 8 at `$xq`, 64 apart, multiplied into
/// them. The sums are stored by [`tile_store`] one block later.
macro_rules! tile_product {
    ($c:literal, $l:literal, $r:literal, $a:expr, $xq:expr) => {
        asm!(
            concat!("tilezero tmm", $c),
            concat!("tileloadd tmm", $l, ", [{a} + {row} * 1]"),
            concat!("tileloadd tmm", $r, ", [{xq} + {line} * 1]"),
            concat!("tdpbusd tmm", $c, ", tmm", $l, ", tmm", $r),
            a = in(reg) $a,
            xq = in(reg) $xq,
            row = in(reg) 32usize,
            line = in(reg) 64usize,
            options(nostack),
        )
    };
}

/// The sums tile `tmm$c` stored to `$out`, 64 bytes apart.
macro_rules! tile_store {
    ($c:literal, $out:expr) => {
        asm!(
            concat!("tilestored [{out} + {line} * 1], tmm", $c),
            out = in(reg) $out,
            line = in(reg) 64usize,
            options(nostack),
        )
    };
}

/// `tiles` consecutive 16-row tiles of unpacked weight rows (`w`: tile
/// `t`'s block `b` the [`TileBlock`] at `t * nblocks + b`, as
/// [`super::x86_lanes::unpack_rows256`] lays them out for VNNI) against
/// one 16-lane group of
/// [`LaneRows`](super::int8::LaneRows) (`x`; lanes `0..cn` written):
/// element `(r, c)` goes to `y[c * y_stride + r]`.
///
/// Per block: the sums tile zeroed, `tdpbusd` adding the 16 rows'
/// unsigned weights times the lanes' signed activations, the tile stored
/// to a ring slot (consecutive blocks on the two tile sets); [`LAG`] blocks
/// later that block's float step, row by row: the start `-offset * sum(x)`
/// added, then [`super::x86_lanes_vnni::lanes_vnni512`]'s step. The minimums'
/// sums run in a pass of their own.
///
/// # Safety
/// `w` must be valid for `tiles * nblocks` [`TileBlock`]s of `B` (one
/// scale per block); otherwise as [`super::x86_lanes_vnni::lanes_vnni512`];
/// [`has_amx`] must have returned true.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn lanes_amx<B: Int8Block>(
    w: *const TileBlock,
    nblocks: usize,
    tiles: usize,
    x: LaneArgs,
    cn: usize,
    y: *mut f32,
    y_stride: usize,
) {
    debug_assert!(cn <= 16 && !B::TWO);
    // SAFETY: AMX is granted (fn contract).
    unsafe { configure() };
    let neg_offset = _mm512_set1_epi32(-B::VNNI_OFFSET);
    // Per ring slot: a sums tile, written by `tilestored` before its float
    // step reads it (left uninitialized: zeroing it was a memset per call).
    let mut ring = std::mem::MaybeUninit::<Aligned<[[[i32; 16]; AMX_ROWS]; RING]>>::uninit();
    let sums = ring.as_mut_ptr().cast::<[[i32; 16]; AMX_ROWS]>();
    for t in 0..tiles {
        // SAFETY: tile `t`'s `nblocks` blocks are in bounds (fn contract).
        let wt = unsafe { w.add(t * nblocks) };
        let mut acc = [_mm512_setzero_ps(); AMX_ROWS];
        for i in 0..nblocks + LAG {
            if i < nblocks {
                let b = i;
                // Block `b` of the tile's 16 rows.
                let a = wt.wrapping_add(b) as *const u8;
                let xq = x.q.wrapping_add(32 * 16 * b);
                // Ask for the operands `AHEAD` blocks on into L1 (no
                // difference measured with the unpacked group in L2, where
                // the 1B shape's is).
                for line in 0..TILE_SLOTS {
                    prefetch_l1(a.wrapping_add(AHEAD * size_of::<TileBlock>() + 64 * line));
                }
                for line in 0..8 {
                    prefetch_l1(xq.wrapping_add(AHEAD * 512 + 64 * line));
                }
                // SAFETY: the tiles are configured (above); the left
                // operand's 16 rows of 32 bytes at `a` are block `b`'s
                // quants, the right operand's 8 x 64 bytes block b of
                // the lane group (in bounds, fn contract).
                unsafe {
                    if b % 2 == 0 {
                        tile_product!(2, 0, 1, a, xq);
                    } else {
                        tile_product!(5, 3, 4, a, xq);
                    }
                }
            }
            // The previous block's sums, stored once this block's product is
            // issued on the other tile set: stored straight after their own
            // product, the store waited for it and the next block's tile
            // work waited for the store (the `gemm` bench's 1B FFN up +6%
            // on an AMX Xeon; storing two blocks later on four sums tiles
            // measured the same).
            if i >= 1 && i <= nblocks {
                let b = i - 1;
                let out = sums.wrapping_add(b % RING);
                // SAFETY: the tiles are configured; block b's product (the
                // iteration before) left its sums in its set's tile, which no
                // product since has reused; `out` is 16 x 64 writable bytes.
                unsafe {
                    if b % 2 == 0 {
                        tile_store!(2, out);
                    } else {
                        tile_store!(5, out);
                    }
                }
            }
            if i >= LAG {
                let (b, k) = (i - LAG, (i - LAG) % RING);
                // SAFETY: block b's 16 scales are in bounds (fn contract).
                let dx = unsafe { _mm512_loadu_ps(x.d.add(16 * b)) };
                // The sums start at -offset * sum(x), the same for every row.
                // SAFETY: block b's 2 x 16 integer sums are in bounds (fn
                // contract).
                let [lo, hi] = [0, 1]
                    .map(|h| unsafe { _mm512_loadu_si512(x.sums.add(16 * (2 * b + h)).cast()) });
                let start = _mm512_mullo_epi32(_mm512_add_epi32(lo, hi), neg_offset);
                // SAFETY: block `b` of the tile is in bounds.
                let blk = unsafe { &*wt.add(b) };
                for (r, acc) in acc.iter_mut().enumerate() {
                    let dd = _mm512_mul_ps(_mm512_set1_ps(blk.d[r]), dx);
                    // SAFETY: slot `k`'s row `r` is 64 aligned bytes, stored
                    // by block b's product `LAG` blocks ago.
                    let s =
                        unsafe { _mm512_load_si512(sums.add(k).cast::<[i32; 16]>().add(r).cast()) };
                    let s = _mm512_cvtepi32_ps(_mm512_add_epi32(s, start));
                    *acc = _mm512_fmadd_ps(s, dd, *acc);
                }
            }
        }
        // Without a minimum the definition's sum stays +0.0.
        let mut mins = [_mm512_setzero_ps(); AMX_ROWS];
        if B::HAS_MIN {
            for b in 0..nblocks {
                // SAFETY: block b's 16 sums are in bounds (fn contract).
                let sx = unsafe { _mm512_loadu_ps(x.s.add(16 * b)) };
                // SAFETY: block `b` of the tile is in bounds.
                let m = unsafe { &(*wt.add(b)).m };
                for (mr, &m) in mins.iter_mut().zip(m) {
                    *mr = _mm512_fmadd_ps(_mm512_set1_ps(m), sx, *mr);
                }
            }
        }
        // Lane `c`'s 16 outputs are consecutive in `y`: one store each
        // (scattered element by element, rows `y_stride` apart, they cost a
        // tenth of the sweep).
        let lanes = transpose16(std::array::from_fn(|r| _mm512_add_ps(acc[r], mins[r])));
        for (c, v) in lanes.into_iter().take(cn).enumerate() {
            // SAFETY: elements (16 t..16 t + 16, c < cn) are in bounds (fn
            // contract).
            unsafe { _mm512_storeu_ps(y.add(c * y_stride + AMX_ROWS * t), v) };
        }
    }
}

/// The 16 x 16 transpose: element `c` of `v[r]` to element `r` of the
/// result's `c`.
#[target_feature(enable = "avx512f")]
#[inline]
fn transpose16(v: [__m512; 16]) -> [__m512; 16] {
    // Within 128-bit lanes: pairs of rows interleaved, then pairs of
    // pairs, so that `b[4 q + k]` holds in 128-bit lane `l` rows 4q..4q+4
    // of column 4l + k.
    let a: [__m512; 16] = std::array::from_fn(|i| {
        let (x, y) = (v[i / 2 * 2], v[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(x, y)
        } else {
            _mm512_unpackhi_ps(x, y)
        }
    });
    let b: [__m512; 16] = std::array::from_fn(|i| {
        let base = i / 4 * 4 + i % 4 / 2;
        let (x, y) = (_mm512_castps_pd(a[base]), _mm512_castps_pd(a[base + 2]));
        _mm512_castpd_ps(if i % 2 == 0 {
            _mm512_unpacklo_pd(x, y)
        } else {
            _mm512_unpackhi_pd(x, y)
        })
    });
    // Across 128-bit lanes: `c[8 h + 4 p + k]` holds rows 8h..8h+8 of
    // columns k + 4p and k + 4p + 8, then the result's `k + 4p (+ 8)` all
    // 16 rows.
    let c: [__m512; 16] = std::array::from_fn(|i| {
        let (x, y) = (b[i % 4 + i / 8 * 8], b[i % 4 + i / 8 * 8 + 4]);
        if i / 4 % 2 == 0 {
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y)
        } else {
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y)
        }
    });
    std::array::from_fn(|i| {
        let (x, y) = (c[i % 8], c[i % 8 + 8]);
        if i / 8 == 0 {
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y)
        } else {
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y)
        }
    })
}
