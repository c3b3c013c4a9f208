//! The fast numerics' side of [`super::matmul`]: activations quantized to
//! int8 blocks once per call ([`quantize_rows`], and one per SIMD lane from
//! [`LANES_MIN_ROWS`] rows on), and a task's output rows computed from them
//! ([`int8_rows_task`]): one activation row through the eight-row GEMV,
//! two or three through small tiles straight from the weight blocks, more
//! through the lane sweeps: weight rows unpacked once and swept against
//! every lane group (two 16-lane groups at a time with VNNI), or with one
//! lane group (Q8_0, Q4_K), and with VNNI up to two 16-lane groups of
//! Q4_K, swept straight from the stored blocks.

use super::int8::{self, LaneRows, Q8Block};
#[cfg(target_arch = "x86_64")]
use super::line_buf::LineBuf;
use super::matmul::MatRef;
use super::weight::Encoding;
#[cfg(target_arch = "x86_64")]
use super::x86_lanes_avx2::{lanes_sweep256, lanes_sweep256_absx};
#[cfg(target_arch = "x86_64")]
use super::x86_lanes_stored::{
    q4_k_avxvnni256, q4_k_lanes256, q4_k_vnni256, q4_k_vnni512, q8_0_avxvnni256, q8_0_lanes256,
    q8_0_vnni256,
};
#[cfg(target_arch = "x86_64")]
use super::x86_lanes_vnni::{
    lanes_avxvnni256, lanes_vnni256, lanes_vnni512, stored_avxvnni256, stored_vnni256,
    stored_vnni512,
};
#[cfg(target_arch = "x86_64")]
use super::{x86_amx, x86_blocks, x86_gemv, x86_gemv512, x86_int8, x86_lanes, x86_tile8};
use super::{Isa, OutPtr};
use crate::team::Team;

/// Quantized activations for [`int8_rows_task`]: `n` rows of blocks, and
/// from [`LANES_MIN_ROWS`] rows on (x86 SIMD), the same rows one per lane
/// for the [`LaneSweep`] they were laid out for.
#[derive(Clone, Copy)]
pub(super) struct Quantized<'a> {
    pub(super) rows: &'a [Q8Block],
    pub(super) lanes: Option<(&'a LaneRows, LaneSweep)>,
}

/// Activation rows from which the lane sweeps run (weight rows unpacked
/// once per task group, activation rows one per lane).
const LANES_MIN_ROWS: usize = 4;

/// How the lane sweeps run: activation rows per lane group, whether with
/// `vpdpbusd` (AVX-512 VNNI's, or with `avx_vnni` AVX-VNNI's on 8 lanes)
/// or AVX2's `vpmaddubsw`, and whether 16-lane groups run on AMX tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct LaneSweep {
    pub(super) lanes: usize,
    pub(super) vnni: bool,
    pub(super) avx_vnni: bool,
    pub(super) amx: bool,
}

/// The lane sweep for `n` activation rows on `isa`, if one runs: with
/// AVX-512 VNNI, 16 lanes for more than 8 rows (on AMX tiles with
/// [`Isa::Amx`]), else 8 (a 16-lane sweep of 8 rows leaves half its lanes
/// idle); otherwise 8, with AVX-VNNI's `vpdpbusd` on [`Isa::AvxVnni`],
/// else AVX2's `vpmaddubsw`.
pub(super) fn lane_sweep(isa: Isa, n: usize) -> Option<LaneSweep> {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar && n >= LANES_MIN_ROWS {
        let avx_vnni = isa == Isa::AvxVnni;
        let vnni = uses_vnni(isa) || avx_vnni;
        let lanes = if vnni && !avx_vnni && n > 8 { 16 } else { 8 };
        let amx = isa == Isa::Amx && lanes == 16;
        return Some(LaneSweep {
            lanes,
            vnni,
            avx_vnni,
            amx,
        });
    }
    let _ = (isa, n);
    None
}

/// Whether the int8 kernels on `isa` run with AVX-512 VNNI (`vpdpbusd`):
/// AVX-512 or AMX, on a CPU that has VNNI and VL.
#[cfg(target_arch = "x86_64")]
fn uses_vnni(isa: Isa) -> bool {
    isa >= Isa::Avx512 && x86_lanes::has_avx512_vnni()
}

thread_local! {
    /// The calling thread's quantized activations (grows once to the
    /// largest `n * cols / 32` blocks).
    pub(super) static XQ: std::cell::RefCell<Vec<Q8Block>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The same rows one per lane (grows once likewise).
    pub(super) static XLANES: std::cell::RefCell<LaneRows> = std::cell::RefCell::new(LaneRows::default());
}

/// Quantize the rows `x` (whole 32-element blocks) into `out`, one block each.
pub(super) fn quantize_rows(isa: Isa, x: &[f32], out: &mut [Q8Block]) {
    assert_eq!(x.len(), 32 * out.len());
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        // SAFETY: `x` holds 32 floats per block of `out` (asserted); `isa`
        // was checked supported by `matmul_group`, and both SIMD ISAs
        // include AVX2, FMA and F16C.
        unsafe { x86_int8::quantize_row256(x.as_ptr(), out.len(), out.as_mut_ptr()) };
        return;
    }
    let _ = isa;
    int8::quantize_row(x, out);
}

/// Quantize the `n` rows of `x` into `xq` and lay them out one per lane,
/// `lanes` to a group, in `l` (with their integer sums if `sums`): a group
/// per task, each quantizing its own rows and then laying them out, on the
/// team's threads from [`SHARED_LAYOUT_ROWS`] rows on (a prefill's), on the
/// caller's alone below (a decode step's). Either way the bytes
/// are [`quantize_rows`]' and [`LaneRows::fill`]'s. Done by the caller
/// alone, a pp512 of a 1B Q4_K_M model spent 2.7% of its samples here
/// while the other threads waited.
#[allow(clippy::too_many_arguments)]
pub(super) fn quantize_lanes(
    team: Option<&Team>,
    isa: Isa,
    x: &[f32],
    n: usize,
    xq: &mut [Q8Block],
    l: &mut LaneRows,
    lanes: usize,
    sums: bool,
) {
    let nb = xq.len() / n;
    let cols = 32 * nb;
    assert!(n >= 1 && x.len() == n * cols && xq.len() == n * nb);
    let w = l.shape(n, nb, lanes);
    let groups = n.div_ceil(lanes);
    let out = OutPtr(xq.as_mut_ptr());
    let task = |g: usize| {
        let rows = g * lanes..((g + 1) * lanes).min(n);
        // SAFETY: task g alone touches blocks `rows * nb` of `xq`, which is
        // borrowed mutably for the whole call.
        let xg = unsafe {
            std::slice::from_raw_parts_mut(out.ptr().add(rows.start * nb), rows.len() * nb)
        };
        quantize_rows(isa, &x[rows.start * cols..rows.end * cols], xg);
        // SAFETY: `l` is shaped for the `n` rows and borrowed mutably for
        // the whole call; task g alone fills group g.
        unsafe { w.fill_group(g, xg, sums) };
    };
    match team.filter(|t| t.threads() > 1 && n >= SHARED_LAYOUT_ROWS) {
        Some(t) => t.for_each(groups, task),
        None => (0..groups).for_each(task),
    }
}

/// Activation rows from which [`quantize_lanes`] shares its work with the
/// team: above the 32 rows of a full decode batch, so a decode step keeps
/// its one region per matmul.
const SHARED_LAYOUT_ROWS: usize = 64;

/// [`super::int8::Numerics::Fast`]: output rows `r0..r1` for all `n` activation rows,
/// from `xq`. With lanes ([`LANES_MIN_ROWS`] rows or more, x86 SIMD):
/// [`lanes_rows_task`]. Otherwise one activation row: the task's rows in
/// one sweep; two or three: 16 weight rows at a time (L1-resident) against
/// the activation rows, two at a time. Every element is one canonical
/// int8 dot.
///
/// # Safety
/// As `matmul.rs`'s `rows_task`; `w.enc` has an integer dot and `xq` holds `n` rows of
/// `w.cols / 32` blocks.
pub(super) unsafe fn int8_rows_task(
    isa: Isa,
    w: &MatRef<'_>,
    xq: Quantized<'_>,
    n: usize,
    r0: usize,
    r1: usize,
    y: OutPtr,
) {
    let nb = w.cols / 32;
    assert!(
        xq.rows.len() >= n * nb,
        "quantized rows for every activation row"
    );
    #[cfg(target_arch = "x86_64")]
    if let Some((lanes, sweep)) = xq.lanes {
        assert!(
            lanes.nblocks == nb && lanes.d.len() >= n.div_ceil(lanes.lanes) * nb * lanes.lanes,
            "lane rows for every activation row"
        );
        macro_rules! go {
            ($B:ty) => {
                // SAFETY: forwarded from this fn's contract; `lanes` holds
                // the `n` rows (asserted); AVX2, FMA and F16C come with every
                // SIMD ISA, checked supported by `matmul_group`, whose
                // `sweep` ([`lane_sweep`]) is VNNI only with AVX-512 VNNI
                // or on `Isa::AvxVnni` (granted on its flag), and AMX only
                // on `Isa::Amx` (which `has_amx` granted).
                unsafe {
                    if sweep.vnni {
                        lanes_rows_task::<$B, true>(w, lanes, n, r0, r1, y, sweep)
                    } else {
                        lanes_rows_task::<$B, false>(w, lanes, n, r0, r1, y, sweep)
                    }
                }
            };
        }
        return for_int8_block!(w.enc, go);
    }
    let group = if n == 1 { r1 - r0 } else { 16 };
    let mut g0 = r0;
    while g0 < r1 {
        let g1 = (g0 + group).min(r1);
        let mut c = 0;
        while c < n {
            let cn = if n - c >= 2 { 2 } else { 1 };
            // SAFETY: forwarded from this fn's contract, for rows g0..g1 and
            // activation rows c..c + cn < n.
            unsafe { int8_sweep(isa, w, &xq.rows[c * nb..(c + cn) * nb], g0..g1, c, y) };
            c += cn;
        }
        g0 = g1;
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Per-thread buffers of [`lanes_rows_task`] (each grows once to the
    /// largest it needs).
    static UNPACKED: std::cell::RefCell<Unpacked> = const {
        std::cell::RefCell::new(Unpacked { blocks: Vec::new(), carry: LineBuf::new() })
    };
}

/// [`lanes_rows_task`]'s per-thread buffers.
#[cfg(target_arch = "x86_64")]
struct Unpacked {
    /// Unpacked weight rows: a group of them ([`STAGE_ROWS`] rows or
    /// [`UNPACKED_BYTES`]), one chunk of blocks each.
    blocks: Vec<x86_lanes::I8Block>,
    /// Sums carried between chunks of blocks ([`x86_lanes::Carry`]): two
    /// floats per unpacked row and activation row (lanes rounded up to
    /// whole groups), on whole lines as the lanes' rows are.
    carry: LineBuf<f32>,
}

/// Blocks per chunk when [`lanes_rows_task`] sweeps rows a chunk of blocks
/// at a time (16-lane VNNI sweeps, past 1.5 chunks): the 16-lane groups'
/// activations run 40 bytes a block per lane (quants, scale, sum), so two
/// groups over a whole 14336-column row (8B FFN down) take 573 KiB and,
/// beside the unpacked rows, no longer stay in L2 (1 MiB on Zen 5) from
/// one tile of rows to the next: each tile read them from L3 again.
#[cfg(target_arch = "x86_64")]
const CHUNK_BLOCKS: usize = 128;

/// Blocks per chunk of an `nb`-block row for [`lanes_rows_task`]: `nb`
/// unless `chunked` and `nb` is past 1.5 [`CHUNK_BLOCKS`], then near-equal
/// chunks of whole stored blocks (`sub` 32-element blocks each).
#[cfg(target_arch = "x86_64")]
fn chunk_blocks(nb: usize, sub: usize, chunked: bool) -> usize {
    if !chunked || 2 * nb <= 3 * CHUNK_BLOCKS {
        return nb;
    }
    nb.div_ceil(nb.div_ceil(CHUNK_BLOCKS)).div_ceil(sub) * sub
}

/// Bytes of unpacked weight rows [`lanes_rows_task`] sweeps at a time: they
/// stay in L2 across the activation groups, while a tile's rows and a lane
/// group's blocks stream through L1; the more rows, the fewer times every
/// activation group streams past them (at 512 activation rows more than
/// L2 holds). Measured on Zen 5 (1 MiB L2): 384 KiB and 128 rows against
/// 128 KiB and 32 rows, `gemm` Q4_K/512 +2-5%, Q6_K/32 +23%, Q6_K/8
/// +40%, and end to end (1B Q4_K_M) 32 streams and pp512 +2-4%. (On Zen 3
/// a quarter of the old 128 KiB measured 10-25% slower; this size was not
/// measured on its 512 KiB L2.)
#[cfg(target_arch = "x86_64")]
const UNPACKED_BYTES: usize = 384 * 1024;

/// The most rows [`lanes_rows_task`] unpacks (or, straight from the stored
/// blocks, sweeps) at a time, and the rows of its output stage per lane.
#[cfg(target_arch = "x86_64")]
const STAGE_ROWS: usize = 128;

/// Lanes of [`lanes_rows_task`]'s output stage: two 16-lane groups.
#[cfg(target_arch = "x86_64")]
const STAGE_LANES: usize = 32;

/// Copy lanes `0..lanes` of `stage` (rows `0..rows` each, [`STAGE_ROWS`]
/// apart) to `y`, lane `c` at `y + c * y_stride`.
///
/// # Safety
/// `y` must be valid for writing those `lanes x rows` elements.
#[cfg(target_arch = "x86_64")]
unsafe fn unstage(stage: &[f32], lanes: usize, rows: usize, y: *mut f32, y_stride: usize) {
    for (c, lane) in stage.chunks_exact(STAGE_ROWS).take(lanes).enumerate() {
        // SAFETY: in bounds (fn contract); `stage` is not `y`.
        unsafe { std::ptr::copy_nonoverlapping(lane.as_ptr(), y.add(c * y_stride), rows) };
    }
}

/// Hint into L2 the lines [`unstage`] will write for the same arguments,
/// before the sweep that fills the stage. `y` is written a few lines per
/// output row, rows a whole output row apart, none of them cached (a
/// pp512 FFN-up writes 16 MiB): without the hint every line is a miss
/// for ownership, the store buffer fills with them, and the sweep after
/// stalls until it drains (the first load that cannot be forwarded from a
/// store waits for every older store). With it the lines wait in L2 and
/// the stores commit at once. Measured on the Emerald Rapids Xeon (2
/// cores, AVX-512 VNNI, no AMX; 2026-11-29, `cargo bench -p kestrel-cpu
/// --bench gemm`, Q4_K 8192x2048 against 512 rows): 268, 276 -> 293, 307
/// G multiply-adds a second, alternated (hinted into L1, 286, 303); with
/// the outputs not written at all 317, 328.
#[cfg(target_arch = "x86_64")]
fn prefetch_unstage(lanes: usize, rows: usize, y: *mut f32, y_stride: usize) {
    for c in 0..lanes {
        let lane = y.wrapping_add(c * y_stride);
        super::prefetch_row::<{ super::TO_L2 }>(lane, rows);
        // The lane's last line, when its rows do not start on a line.
        super::prefetch_row::<{ super::TO_L2 }>(lane.wrapping_add(rows - 1), 1);
    }
}

/// [`int8_rows_task`] with lanes. With one lane group, Q8_0 and Q4_K rows
/// are swept straight from their stored blocks
/// ([`q8_0_vnni256`], [`q4_k_vnni256`],
/// [`q8_0_lanes256`], [`q4_k_lanes256`]), and with
/// VNNI sweeps (not AMX's) so are Q4_K rows against up to two 16-lane
/// groups ([`q4_k_vnni512`]) and Q4_0, Q4_1 and Q8_0 rows up to
/// 32 activation rows ([`stored_vnni256`],
/// [`stored_vnni512`]; Q8_0's 8-lane group as above). Otherwise
/// weight rows are unpacked a
/// group at a time ([`x86_lanes::unpack_rows256`], at most [`STAGE_ROWS`] rows or
/// [`UNPACKED_BYTES`]; rows past 1.5 [`CHUNK_BLOCKS`] a chunk of blocks at a
/// time on 16-lane VNNI sweeps, the sums carried, [`x86_lanes::Carry`]),
/// then swept against every lane group of `x` in 4-row tiles (with `VNNI`
/// [`lanes_vnni512`] for 16-lane groups, two at a time while
/// two are left, and [`lanes_vnni256`] for 8-lane ones;
/// otherwise [`lanes_sweep256`], or for Q8_0
/// [`lanes_sweep256_absx`] unless the unpack saw a -128, then
/// `lanes_sweep256` in 2-row tiles), the rest a row at a time.
///
/// The sweeps write to a stage of [`STAGE_LANES`] x [`STAGE_ROWS`] floats,
/// copied out a whole lane (the group's rows) at a time, the lines it will
/// write hinted into L2 before the sweep ([`prefetch_unstage`]). Written straight
/// to `y`, a tile's four rows land in each of 16 or 32 output rows a whole
/// output row apart, for the usual widths a multiple of 4 KiB: all in one
/// L1 set, where the stores evicted each other (Zen 5, 1B shapes: the
/// two-group sweep writing straight ran at 0.8-0.9x of one group's at
/// 2048 columns, staged at 1.3-1.45x).
///
/// # Safety
/// As [`int8_rows_task`], with `B` the block type of `w.enc`, `x` holding
/// the `n` rows in 8 lanes, or 16 with `VNNI`; `sweep` from
/// [`lane_sweep`]; the CPU must support AVX2, FMA and F16C, and if `VNNI`
/// AVX-512 VNNI and VL, or AVX-VNNI where `sweep.avx_vnni`.
#[cfg(target_arch = "x86_64")]
unsafe fn lanes_rows_task<B: x86_tile8::Tile8, const VNNI: bool>(
    w: &MatRef<'_>,
    x: &LaneRows,
    n: usize,
    r0: usize,
    r1: usize,
    y: OutPtr,
    sweep: LaneSweep,
) {
    let (amx, avx_vnni) = (sweep.amx, sweep.avx_vnni);
    let nb = w.cols / 32;
    // Two-scale blocks measured no faster on tiles (`x86_amx.rs`), nor did
    // short rows.
    let amx = amx && !B::TWO && nb >= x86_amx::AMX_MIN_BLOCKS;
    // One lane group of Q8_0 or Q4_K, or with VNNI sweeps (not AMX's) up
    // to two 16-lane groups of Q4_K, Q4_0, Q4_1 or Q8_0 (Q4_0 and Q4_1 on
    // 8 lanes too): straight from the stored blocks (nothing would reuse
    // an unpack).
    let direct = match (x.lanes, B::ENC) {
        (8, Encoding::Q8_0 | Encoding::Q4K) => n <= 8,
        (8, Encoding::Q4_0 | Encoding::Q4_1) => VNNI && n <= 8,
        (16, Encoding::Q4K | Encoding::Q4_0 | Encoding::Q4_1 | Encoding::Q8_0) => {
            VNNI && !amx && n <= 2 * 16
        }
        _ => false,
    };
    let mut stage = [0f32; STAGE_LANES * STAGE_ROWS];
    if direct {
        let all = x86_lanes::StoredRows {
            w: w.data.as_ptr(),
            row_bytes: w.row_bytes,
            nblocks: nb,
        };
        let args = x86_lanes::LaneArgs::group(x, 0);
        let out = stage.as_mut_ptr();
        // STAGE_ROWS rows at a time, staged as below.
        let mut c0 = r0;
        while c0 < r1 {
            let (stored, rows) = (all.skip(c0), (r1 - c0).min(STAGE_ROWS));
            macro_rules! direct {
                ($sweep:ident::<$($B:ident,)? $R:literal $(, $G:literal)?>, $x:expr) => {{
                    let done = rows / $R * $R;
                    // SAFETY: rows c0..c0 + rows exist and hold `nb` blocks
                    // of the sweep's type (fn contract), `x` its groups of
                    // the `n` rows with their sums (filled for Q8_0's
                    // nonzero VNNI offset); `stage` is STAGE_ROWS >= rows by
                    // STAGE_LANES >= n; the tail starts at row `done <= rows`.
                    unsafe {
                        $sweep::<$($B,)? $R $(, $G)?>(stored, rows / $R, $x, n, out, STAGE_ROWS);
                        $sweep::<$($B,)? 1 $(, $G)?>(
                            stored.skip(done),
                            rows - done,
                            $x,
                            n,
                            out.wrapping_add(done),
                            STAGE_ROWS,
                        );
                    }
                }};
            }
            // On AVX2, Q8_0's two sign steps per product (the stored blocks
            // are not checked for -128, which the |x| sweep needs) double the
            // work per row: two-row tiles, as for unpacked rows holding a
            // -128 below.
            let one_scale = matches!(B::ENC, Encoding::Q4_0 | Encoding::Q4_1 | Encoding::Q8_0);
            match (VNNI, x.lanes, B::ENC) {
                (true, 16, _) if one_scale && n > 16 => {
                    let pair = [args, x86_lanes::LaneArgs::group(x, 1)];
                    direct!(stored_vnni512::<B, 4, 2>, pair)
                }
                (true, 16, _) if one_scale => direct!(stored_vnni512::<B, 4, 1>, [args]),
                (true, _, Encoding::Q4_0 | Encoding::Q4_1) if avx_vnni => {
                    direct!(stored_avxvnni256::<B, 4, 1>, [args])
                }
                (true, _, Encoding::Q4_0 | Encoding::Q4_1) => {
                    direct!(stored_vnni256::<B, 4, 1>, [args])
                }
                (true, 16, _) if n > 16 => {
                    let pair = [args, x86_lanes::LaneArgs::group(x, 1)];
                    direct!(q4_k_vnni512::<4, 2>, pair)
                }
                (true, 16, _) => direct!(q4_k_vnni512::<4, 1>, [args]),
                (true, _, Encoding::Q8_0) if avx_vnni => direct!(q8_0_avxvnni256::<4>, args),
                (true, _, Encoding::Q8_0) => direct!(q8_0_vnni256::<4>, args),
                (true, _, _) if avx_vnni => direct!(q4_k_avxvnni256::<4>, args),
                (true, _, _) => direct!(q4_k_vnni256::<4>, args),
                (false, _, Encoding::Q4K) => direct!(q4_k_lanes256::<4>, args),
                _ => direct!(q8_0_lanes256::<2>, args),
            }
            // SAFETY: lanes 0..n of `stage` hold rows 0..rows; elements
            // (c0..c0 + rows, 0..n) of `y` belong to this task.
            unsafe { unstage(&stage, n, rows, y.0.wrapping_add(c0), w.rows) };
            c0 += rows;
        }
        return;
    }
    // Past CHUNK_BLOCKS, 16-lane VNNI sweeps (not AMX's) take the rows a
    // chunk of `kc` blocks at a time, the sums carried between chunks.
    let kc = chunk_blocks(nb, B::SUB, VNNI && x.lanes == 16 && !amx);
    let block = std::mem::size_of::<x86_lanes::I8Block>();
    let group = (UNPACKED_BYTES / (kc * block)).clamp(1, STAGE_ROWS);
    // AMX tiles take 16 rows at a time (for rows over 8 KiB unpacked, past
    // UNPACKED_BYTES).
    let group = if amx {
        group.max(x86_amx::AMX_ROWS) / x86_amx::AMX_ROWS * x86_amx::AMX_ROWS
    } else {
        group
    };
    assert!(group <= STAGE_ROWS && 2 * x.lanes <= STAGE_LANES);
    // Carried sums: row after row, each row's for every lane group.
    let carry_stride = 2 * n.div_ceil(x.lanes) * x.lanes;
    UNPACKED.with_borrow_mut(|u| {
        let Unpacked {
            blocks: b,
            carry: c,
        } = u;
        if b.len() < group * kc {
            b.resize(group * kc, x86_lanes::I8Block::default());
        }
        if kc < nb && c.len() < group * carry_stride {
            c.resize(group * carry_stride);
        }
        let mut g0 = r0;
        while g0 < r1 {
            let g1 = (g0 + group).min(r1);
            let rows = g1 - g0;
            for k0 in (0..nb).step_by(kc) {
                let kn = kc.min(nb - k0);
                let buf = b[..rows * kn].as_mut_ptr();
                let w0 = w
                    .data
                    .as_ptr()
                    .wrapping_add(g0 * w.row_bytes + k0 / B::SUB * B::ENC.block_bytes());
                // SAFETY: rows g0..g1 exist (fn contract) and hold `nb` blocks
                // of `B`, blocks k0..k0 + kn whole stored ones from `w0` on
                // (`chunk_blocks`); `buf` holds `rows * kn` blocks; tiles only
                // with VNNI and one-scale `B` (`amx` above).
                let has_lowest = unsafe {
                    x86_lanes::unpack_rows256::<B, VNNI>(w0, w.row_bytes, rows, kn, amx, buf)
                };
                // Every sweep writes its outputs to `stage` (lane after lane,
                // STAGE_ROWS apiece), copied out whole lanes at a time.
                let mut g = 0;
                while g < n.div_ceil(x.lanes) {
                    // With 16-lane VNNI sweeps (not AMX's), two groups at once.
                    let gs = if VNNI && x.lanes == 16 && !amx && (g + 1) * x.lanes < n {
                        2
                    } else {
                        1
                    };
                    let cn = (n - g * x.lanes).min(gs * x.lanes);
                    let args = x86_lanes::LaneArgs::group(x, g).skip_blocks(k0, x.lanes);
                    let carry = (kn < nb).then(|| x86_lanes::Carry {
                        p: c.as_mut_ptr().wrapping_add(2 * g * x.lanes),
                        stride: carry_stride,
                        first: k0 == 0,
                        last: k0 + kn == nb,
                    });
                    let out = stage.as_mut_ptr();
                    // Only here: the stored sweeps' outputs (8-32 rows) stay
                    // cached from step to step, and hinted they measured
                    // level to 7% slower (`gemm` Q4_K/32).
                    if k0 + kn == nb {
                        let y = y.0.wrapping_add(g * x.lanes * w.rows + g0);
                        prefetch_unstage(cn, g1 - g0, y, w.rows);
                    }
                    // On AMX, whole 16-row tiles first; the sweeps below take
                    // the rest.
                    let skip = if amx {
                        debug_assert!(x.lanes == 16 && kn == nb, "AMX sweeps whole 16-lane rows");
                        let tiles = rows / x86_amx::AMX_ROWS;
                        let tiled = buf.cast::<x86_lanes::TileBlock>();
                        // SAFETY: as for `sweep!` below, for rows g0..g0 + 16
                        // tiles, unpacked as `tiles * nb` tile blocks; `amx`
                        // comes from `lane_sweep` on `Isa::Amx`, which
                        // `has_amx` granted.
                        unsafe {
                            x86_amx::lanes_amx::<B>(tiled, kn, tiles, args, cn, out, STAGE_ROWS)
                        };
                        tiles * x86_amx::AMX_ROWS
                    } else {
                        0
                    };
                    let (buf, out, rows) = (
                        buf.wrapping_add(x86_lanes::after_tiles(skip, kn)),
                        out.wrapping_add(skip),
                        rows - skip,
                    );
                    // `$sweep` in `$R`-row tiles, then the rest a row at a time,
                    // with `$x` (one group's `LaneArgs`, or `G` of them) and for
                    // the VNNI sweeps `$carry`.
                    macro_rules! tiles {
                    ($sweep:ident $(::<$G:literal>)?, $R:literal, $x:expr $(, $carry:expr)?) => {{
                        let done = rows / $R * $R;
                        // SAFETY: `buf` holds rows g0 + skip..g1's blocks
                        // k0..k0 + kn unpacked, `x` the groups from `g` on
                        // from block k0 (fn contract); `stage` is
                        // STAGE_ROWS >= rows by STAGE_LANES >= cn; the tail
                        // starts at row `done <= rows`; the `absx` sweep only
                        // where the unpack saw no -128; a carry holds `rows`
                        // rows for every group, left by chunk k0 - kc unless
                        // `first`.
                        unsafe {
                            $sweep::<B, $R $(, $G)?>(
                                buf, kn, rows / $R, $x, cn, out, STAGE_ROWS $(, $carry)?
                            );
                            $sweep::<B, 1 $(, $G)?>(
                                buf.add(done * kn),
                                kn,
                                rows - done,
                                $x,
                                cn,
                                out.add(done),
                                STAGE_ROWS,
                                $($carry.map(|c: x86_lanes::Carry| c.rows_from(done)))?
                            );
                        }
                    }};
                }
                    // AVX2's two-sign Q8_0 sweep (rows holding -128) measured
                    // faster in two-row tiles; the |x| one (Q8_0/512 93 against
                    // 87 G/s in two) and the rest in four.
                    match (VNNI, x.lanes, B::ENC) {
                        (true, 16, _) if gs == 2 => {
                            let next =
                                x86_lanes::LaneArgs::group(x, g + 1).skip_blocks(k0, x.lanes);
                            tiles!(lanes_vnni512::<2>, 4, [args, next], carry)
                        }
                        (true, 16, _) => tiles!(lanes_vnni512::<1>, 4, [args], carry),
                        (true, _, _) if avx_vnni => {
                            tiles!(lanes_avxvnni256::<1>, 4, [args], carry)
                        }
                        (true, _, _) => tiles!(lanes_vnni256::<1>, 4, [args], carry),
                        (false, _, Encoding::Q8_0) if !has_lowest => {
                            tiles!(lanes_sweep256_absx, 4, args)
                        }
                        (false, _, Encoding::Q8_0) => tiles!(lanes_sweep256, 2, args),
                        (false, _, _) => tiles!(lanes_sweep256, 4, args),
                    }
                    // The outputs are staged once the last chunk is swept.
                    if k0 + kn == nb {
                        // SAFETY: lanes 0..cn of `stage` hold rows 0..g1 - g0;
                        // elements (g0..g1, activation rows g * x.lanes.. + cn)
                        // of `y` belong to this task.
                        unsafe {
                            unstage(
                                &stage,
                                cn,
                                g1 - g0,
                                y.0.wrapping_add(g * x.lanes * w.rows + g0),
                                w.rows,
                            )
                        };
                    }
                    g += gs;
                }
            }
            g0 = g1;
        }
    });
}

/// `rows` weight rows from `a.w` against `cn` (1 or 2) activation rows from
/// `a.x`: whole tiles (one row: 8-row GEMV tiles, Q4_K's and Q6_K's with
/// `vnni` on 512-bit registers, Q4_K's without in row pairs, then 4 x 1;
/// two: 2 x 2), then the rest one
/// row at a time. Element `(r, c)` goes to `y[c * y_stride + r]`.
///
/// # Safety
/// As [`x86_int8::int8_sweep256`] for those rows and activation rows; with
/// `vnni` the CPU must support AVX-512F/BW/VL and AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
unsafe fn int8_sweep256<B: x86_tile8::Tile8>(
    a: x86_int8::Int8Args,
    rows: usize,
    cn: usize,
    y: *mut f32,
    y_stride: usize,
    vnni: bool,
) {
    macro_rules! sweep {
        ($R:literal, $NB:literal, $a:expr, $rows:expr, $y:expr) => {{
            let (a, rows, y): (x86_int8::Int8Args, usize, *mut f32) = ($a, $rows, $y);
            let done = rows / $R * $R;
            // SAFETY: rows 0..rows from `a.w` and their outputs exist (fn
            // contract); the rest starts at row `done <= rows`.
            unsafe {
                x86_int8::int8_sweep256::<B, $R, $NB>(a, rows / $R, y, y_stride);
                x86_int8::int8_sweep256::<B, 1, $NB>(
                    a.skip_rows(done),
                    rows - done,
                    y.add(done),
                    y_stride,
                );
            }
        }};
    }
    if cn == 2 {
        sweep!(2, 2, a, rows, y)
    } else {
        // Whole 8-row GEMV tiles, then the rest as 4 x 1 and 1 x 1 tiles.
        let done = rows / 8 * 8;
        // SAFETY: rows 0..done from `a.w` and their outputs exist (fn
        // contract), of Q4_K for `gemv8_q4k_pair256` (AVX2, as every
        // kernel here) and of Q4_K or Q6_K for the VNNI GEMVs, whose
        // features `vnni` vouches for (and `has_gfni` for GFNI's).
        unsafe {
            match B::ENC {
                Encoding::Q4K if vnni => x86_gemv512::gemv8_q4k_vnni512(a, rows / 8, y),
                Encoding::Q4K => x86_gemv::gemv8_q4k_pair256(a, rows / 8, y),
                Encoding::Q6K if vnni && x86_lanes::has_gfni() => {
                    x86_gemv512::gemv8_q6k_gfni512(a, rows / 8, y)
                }
                Encoding::Q6K if vnni => x86_gemv512::gemv8_q6k_vnni512(a, rows / 8, y),
                _ => x86_gemv::gemv8_256::<B>(a, rows / 8, y),
            }
        };
        sweep!(4, 1, a.skip_rows(done), rows - done, y.wrapping_add(done))
    }
}

/// Weight rows `rows` against the quantized activation rows `xq` (one or
/// two, the first being activation row `c`).
///
/// # Safety
/// As [`int8_rows_task`] for those rows.
unsafe fn int8_sweep(
    isa: Isa,
    w: &MatRef<'_>,
    xq: &[Q8Block],
    rows: std::ops::Range<usize>,
    c: usize,
    y: OutPtr,
) {
    let nb = w.cols / 32;
    let cn = xq.len() / nb;
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        let args = x86_int8::Int8Args {
            // SAFETY: `rows.start < w.rows`: row `rows.start` starts within `w.data`.
            w: unsafe { w.data.as_ptr().add(rows.start * w.row_bytes) },
            row_bytes: w.row_bytes,
            x: xq.as_ptr(),
            nblocks: nb,
        };
        let vnni = uses_vnni(isa);
        macro_rules! go {
            ($B:ty) => {
                // SAFETY: rows rows.start..rows.end exist and their elements
                // in activation rows c..c + cn belong to this task (fn
                // contract); `xq` holds cn rows; AVX2, FMA and F16C come with
                // every SIMD ISA, checked supported by `matmul_group`, and
                // `vnni` only with AVX-512 and its VNNI.
                unsafe {
                    int8_sweep256::<$B>(
                        args,
                        rows.len(),
                        cn,
                        y.0.add(c * w.rows + rows.start),
                        w.rows,
                        vnni,
                    )
                }
            };
        }
        for_int8_block!(w.enc, go);
        return;
    }
    let _ = isa;
    for r in rows {
        for j in 0..cn {
            let v = int8::dot(w.enc, w.row(r), &xq[j * nb..(j + 1) * nb]);
            // SAFETY: element (r, c + j) belongs to this task.
            unsafe { *y.0.add((c + j) * w.rows + r) = v };
        }
    }
}
