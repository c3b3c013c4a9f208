//! Threaded, batch-invariant `Y = X W^T` over encoded weight rows.
//!
//! `X` is `n x cols` f32 (one activation row per token), `W` is `rows x cols`
//! in any [`Encoding`], `Y` is `n x rows`. Work is split across threads
//! only over weight rows; each output element is one canonical dot product
//! (`scalar.rs`), so a token's outputs are bit-identical for any `n`, any
//! thread count and any [`Isa`]. Cost: weights are streamed once per call per
//! 64-token column block; each 32-element block is dequantized once per
//! weight row per tile of activation rows.

use kestrel_model::Matrix;

use super::int8::{self, Numerics, Q8Block};
use super::matmul_int8::{
    int8_rows_task, lane_sweep, quantize_lanes, quantize_rows, Quantized, XLANES, XQ,
};
use super::scalar::{self, LANES};
use super::weight::Encoding;
use super::{Isa, OutPtr};
use crate::team::Team;
use crate::CpuError;

/// Activation rows processed against one L1-resident weight tile.
const COL_BLOCK: usize = 64;

/// A borrowed, validated weight matrix.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    pub enc: Encoding,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub data: &'a [u8],
}

impl<'a> MatRef<'a> {
    /// Validate `m` for the kernels, as stored (what [`super::Weight`]
    /// holds): whole blocks for quantized dtypes, and enough bytes.
    pub fn new(name: &str, m: &'a Matrix) -> Result<Self, CpuError> {
        let enc = Encoding::of(m.dtype);
        let (rows, cols, data) = (m.rows, m.cols, &m.data[..]);
        if enc.is_quantized() && !cols.is_multiple_of(enc.block_elems()) {
            return Err(CpuError::Shape {
                name: name.to_owned(),
                expected: format!("cols a multiple of {}", enc.block_elems()),
                got: cols.to_string(),
            });
        }
        let row_bytes = enc.row_bytes(cols);
        if data.len() < rows * row_bytes {
            return Err(CpuError::Shape {
                name: name.to_owned(),
                expected: format!("{} bytes for {rows}x{cols} {enc:?}", rows * row_bytes),
                got: format!("{} bytes", data.len()),
            });
        }
        Ok(MatRef {
            enc,
            rows,
            cols,
            row_bytes,
            data,
        })
    }

    /// A borrowed `rows x cols` F32 matrix (an activation used as the
    /// weight operand, e.g. attention's keys), without copying it.
    ///
    /// # Panics
    /// If `v` holds fewer than `rows * cols` floats, or on a big-endian
    /// target (the F32 encoding is little-endian; these bytes are native).
    #[allow(clippy::assertions_on_constants)] // the endianness check below
    pub fn from_f32(v: &'a [f32], rows: usize, cols: usize) -> Self {
        assert!(
            v.len() >= rows * cols,
            "an F32 MatRef needs rows x cols floats"
        );
        // Constant per target, on purpose: a big-endian build compiles
        // and fails here, not with wrong bytes.
        assert!(
            cfg!(target_endian = "little"),
            "native floats are the F32 encoding's bytes only on little-endian targets"
        );
        // SAFETY: the bytes of `v`'s floats, borrowed for as long as `v`;
        // `u8` has no alignment or validity requirement.
        let data = unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), 4 * v.len()) };
        MatRef {
            enc: Encoding::F32,
            rows,
            cols,
            row_bytes: Encoding::F32.row_bytes(cols),
            data,
        }
    }

    /// Encoded bytes of row `r`.
    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Bytes the kernels stream per full pass.
    pub fn bytes(&self) -> usize {
        self.rows * self.row_bytes
    }
}

/// One matrix of a [`matmul_group`] and its output (`n x w.rows`).
#[derive(Debug)]
pub struct MatmulJob<'a> {
    pub w: MatRef<'a>,
    pub y: &'a mut [f32],
}

/// `y = x w^T` for one matrix. See [`matmul_group`].
pub fn matmul(
    team: Option<&Team>,
    isa: Isa,
    numerics: Numerics,
    w: MatRef<'_>,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) {
    matmul_group(team, isa, numerics, x, n, &mut [MatmulJob { w, y }]);
}

/// `job.y = x job.w^T` for several matrices sharing the input `x`
/// (`n x cols`), in one parallel region (e.g. Q, K and V). With
/// [`Numerics::Fast`], `x` is quantized once (`int8.rs`) for every matrix
/// whose encoding has an integer dot; the others are computed exactly.
///
/// # Panics
/// If a matrix's `cols` differs from `x.len() / n` or a `y` is not `n x rows`.
pub fn matmul_group(
    team: Option<&Team>,
    isa: Isa,
    numerics: Numerics,
    x: &[f32],
    n: usize,
    jobs: &mut [MatmulJob<'_>],
) {
    if n == 0 || jobs.is_empty() {
        return;
    }
    let cols = jobs[0].w.cols;
    assert_eq!(x.len(), n * cols, "x must be n x cols");
    let isa = if isa.is_supported() { isa } else { Isa::Scalar };
    let mut total_rows = 0;
    for j in jobs.iter() {
        assert_eq!(j.w.cols, cols, "all matrices of a group share cols");
        assert_eq!(j.y.len(), n * j.w.rows, "y must be n x rows");
        // `MatRef`'s fields are public, so the kernels' reads rest on this
        // (one comparison per matrix per call), not on how it was built.
        assert!(
            j.w.row_bytes == j.w.enc.row_bytes(cols) && j.w.data.len() >= j.w.bytes(),
            "a MatRef's bytes must hold rows x row_bytes of its encoding"
        );
        total_rows += j.w.rows;
    }
    let threads = team.map_or(1, Team::threads);
    let split = TaskSplit::new(total_rows, threads);
    let ntasks = split.tasks();
    let ptrs: [Option<(MatRef<'_>, OutPtr)>; 8] = {
        assert!(jobs.len() <= 8, "at most 8 matrices per group");
        let mut a = [None; 8];
        for (slot, j) in a.iter_mut().zip(jobs.iter_mut()) {
            *slot = Some((j.w, OutPtr(j.y.as_mut_ptr())));
        }
        a
    };
    let region = |xq: Option<Quantized<'_>>| {
        let run = |t: usize| {
            // Task `t` covers rows v0..v1 of all the jobs' rows laid end to end.
            let (v0, v1) = (split.start(t), split.start(t + 1));
            let mut off = 0;
            for (w, y) in ptrs.iter().flatten() {
                let (r0, r1) = (v0.max(off) - off, v1.min(off + w.rows).saturating_sub(off));
                if r0 < r1 {
                    // SAFETY: `y` is the `n x w.rows` buffer of this job, borrowed
                    // mutably for the whole call; task `t` alone writes rows r0..r1
                    // (tasks cover disjoint row ranges).
                    unsafe {
                        match xq.filter(|_| int8::has_int8_dot(w.enc)) {
                            Some(xq) => int8_rows_task(isa, w, xq, n, r0, r1, *y),
                            None => rows_task(isa, *w, x, n, r0, r1, *y),
                        }
                    }
                }
                off += w.rows;
            }
        };
        match team {
            Some(t) => t.for_each(ntasks, run),
            _ => (0..ntasks).for_each(run),
        }
    };
    let fast = numerics == Numerics::Fast
        && cols.is_multiple_of(32)
        && jobs.iter().any(|j| int8::has_int8_dot(j.w.enc));
    if !fast {
        return region(None);
    }
    XQ.with(|b| {
        let mut b = b.borrow_mut();
        let nb = n * cols / 32;
        if b.len() < nb {
            b.resize(nb, Q8Block::default());
        }
        match lane_sweep(isa, n) {
            Some(sweep) => XLANES.with(|l| {
                let mut l = l.borrow_mut();
                let sums = jobs
                    .iter()
                    .any(|j| int8::lane_offset(j.w.enc, sweep.vnni) != 0);
                quantize_lanes(team, isa, x, n, &mut b[..nb], &mut l, sweep.lanes, sums);
                region(Some(Quantized {
                    rows: &b[..nb],
                    lanes: Some((&l, sweep)),
                }))
            }),
            None => {
                quantize_rows(isa, x, &mut b[..nb]);
                region(Some(Quantized {
                    rows: &b[..nb],
                    lanes: None,
                }))
            }
        }
    });
}

/// How a region's weight rows are cut into tasks: a head of large tasks
/// (a quarter of a thread's share each, at most 1024 rows, covering three
/// quarters of the rows), then a tail of 16-row ones, so that the last tasks
/// claimed are short and no thread waits long for another at the region's
/// end. Boundaries are multiples of 16 in the group's rows laid end to end
/// (a job's own tiles stay whole where earlier jobs' row counts are
/// multiples of 16, as every model matrix's are).
#[derive(Debug, Clone, Copy)]
struct TaskSplit {
    total: usize,
    big: usize,
    head_tasks: usize,
}

impl TaskSplit {
    const SMALL: usize = 16;

    fn new(total: usize, threads: usize) -> Self {
        let big = (total.div_ceil(threads * 4).div_ceil(16) * 16).clamp(16, 1024);
        TaskSplit {
            total,
            big,
            head_tasks: total * 3 / 4 / big,
        }
    }

    fn head_rows(&self) -> usize {
        self.head_tasks * self.big
    }

    fn tasks(&self) -> usize {
        self.head_tasks + (self.total - self.head_rows()).div_ceil(Self::SMALL)
    }

    /// First row of task `t` (`total` for `t == tasks()`).
    fn start(&self, t: usize) -> usize {
        if t <= self.head_tasks {
            t * self.big
        } else {
            (self.head_rows() + (t - self.head_tasks) * Self::SMALL).min(self.total)
        }
    }
}

/// Compute output rows `r0..r1` for all `n` activation rows.
///
/// # Safety
/// `y.0` must point at an `n x w.rows` f32 buffer that no other thread
/// accesses at rows `r0..r1`.
unsafe fn rows_task(isa: Isa, w: MatRef<'_>, x: &[f32], n: usize, r0: usize, r1: usize, y: OutPtr) {
    let (rt, ct) = match isa {
        Isa::Avx512 | Isa::Amx => (4, 4),
        Isa::Avx2 | Isa::AvxVnni => (2, 2),
        Isa::Scalar => (1, 1),
    };
    // With many activation rows, dequantize each weight-row tile once into an
    // L1-resident f32 buffer and run the dense kernel on it: same canonical
    // values and FMA order (bit-identical), dequant cost amortized over the
    // whole column block instead of each `ct`-column tile.
    let buffered = isa != Isa::Scalar
        && w.enc != Encoding::F32
        && w.cols.is_multiple_of(32)
        && n >= BUFFERED_MIN_COLS;
    // One activation row (single-stream decode): whole 4-row tiles in one
    // kernel call, the rest below.
    let gemv_rows = if n == 1 {
        // SAFETY: forwarded from this fn's contract, with n == 1.
        unsafe { gemv_sweep(isa, &w, x, r0, r1, y) }
    } else {
        0
    };
    let mut cb = 0;
    while cb < n {
        let ce = (cb + COL_BLOCK).min(n);
        let mut r = r0 + gemv_rows;
        while r < r1 {
            let rn = if r1 - r >= rt { rt } else { 1 };
            let direct = Src {
                // SAFETY: `r < r1 <= w.rows`, so row `r` starts within `w.data`.
                ptr: unsafe { w.data.as_ptr().add(r * w.row_bytes) },
                row_bytes: w.row_bytes,
                enc: w.enc,
            };
            let run = |src: Src, from: usize| {
                let mut c = from;
                while c < ce {
                    let cn = if ce - c >= ct { ct } else { 1 };
                    // SAFETY: forwarded from this fn's contract; the tile covers
                    // rows r..r+rn < r1 and columns c..c+cn < n; `src` holds rn rows.
                    unsafe { tile(isa, w, src, x, r, rn, c, cn, y) };
                    c += cn;
                }
            };
            if buffered {
                WBUF.with(|b| {
                    let mut b = b.borrow_mut();
                    if b.len() < rn * w.cols {
                        b.resize(rn * w.cols, 0.0);
                    }
                    for i in 0..rn {
                        dequant_row_simd(isa, &w, r + i, &mut b[i * w.cols..(i + 1) * w.cols]);
                    }
                    let src = Src {
                        ptr: b.as_ptr() as *const u8,
                        row_bytes: w.cols * 4,
                        enc: Encoding::F32,
                    };
                    // SAFETY: `src` holds the rn rows r.. dequantized; the
                    // rest is this fn's contract.
                    let swept = unsafe { sweep(isa, &w, src, x, r, rn, cb..ce, y) };
                    run(src, cb + swept);
                });
            } else if w.enc == Encoding::F32 && w.cols.is_multiple_of(32) {
                // Dense f32 rows in whole blocks are the sweep's operand as
                // stored (the vision encoder's F32 weights and attention
                // operands): one kernel call per weight tile, not per 4x4.
                // SAFETY: `direct` holds the rn rows r.. of `w`; the rest
                // is this fn's contract.
                let swept = unsafe { sweep(isa, &w, direct, x, r, rn, cb..ce, y) };
                run(direct, cb + swept);
            } else {
                run(direct, cb);
            }
            r += rn;
        }
        cb = ce;
    }
}

/// With AVX-512 and a full 4-row weight tile in dense f32 (`src`), run
/// every whole 4x4 tile of activation rows `cols` in one kernel call that
/// stores straight into `y`; returns how many activation rows it covered
/// (the caller finishes the rest tile by tile, with identical results).
///
/// # Safety
/// As [`tile`] for rows `r..r + rn` and activation rows `cols`.
#[allow(clippy::too_many_arguments)]
unsafe fn sweep(
    isa: Isa,
    w: &MatRef<'_>,
    src: Src,
    x: &[f32],
    r: usize,
    rn: usize,
    cols: std::ops::Range<usize>,
    y: OutPtr,
) -> usize {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx512 && rn == 4 {
        debug_assert!(
            src.enc == Encoding::F32 && w.cols.is_multiple_of(32),
            "the buffered path's rows"
        );
        let col_tiles = cols.len() / 4;
        let args = x86::TileArgs {
            w: src.ptr,
            row_bytes: src.row_bytes,
            // SAFETY: activation row `cols.start` exists (fn contract).
            x: unsafe { x.as_ptr().add(cols.start * w.cols) },
            x_stride: w.cols,
            nblocks: w.cols / 32,
        };
        // SAFETY: `src` holds 4 rows of `w.cols` floats, activation rows
        // cols.start .. + 4 * col_tiles exist, AVX-512 is supported (checked
        // by `matmul_group`), and elements (r..r + 4, cols) of `y` belong to
        // the calling task (fn contract).
        unsafe { x86::rows4_sweep512(args, col_tiles, y.0.add(cols.start * w.rows + r), w.rows) };
        return 4 * col_tiles;
    }
    let _ = (isa, w, src, x, r, rn, cols, y);
    0
}

/// With AVX-512 and one activation row, compute output rows `r0..` in
/// whole 4-row tiles with one kernel call (instead of one dispatch per
/// tile: ~50k per decode step); returns how many rows it covered (the
/// caller finishes the rest tile by tile, with identical results).
///
/// # Safety
/// As [`rows_task`] with `n == 1`.
unsafe fn gemv_sweep(
    isa: Isa,
    w: &MatRef<'_>,
    x: &[f32],
    r0: usize,
    r1: usize,
    y: OutPtr,
) -> usize {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx512 && w.cols.is_multiple_of(32) {
        let tiles = (r1 - r0) / 4;
        let args = x86::TileArgs {
            // SAFETY: `r0 < r1 <= w.rows`, so row `r0` starts within `w.data`.
            w: unsafe { w.data.as_ptr().add(r0 * w.row_bytes) },
            row_bytes: w.row_bytes,
            x: x.as_ptr(),
            x_stride: w.cols,
            nblocks: w.cols / 32,
        };
        macro_rules! go {
            ($B:ty) => {
                // SAFETY: rows r0..r0 + 4 * tiles <= r1 exist and their
                // outputs y[r0..] belong to the calling task (fn contract);
                // `x` is one row of `cols` floats; AVX-512 was checked
                // supported by `matmul_group`.
                unsafe { x86::rows4_gemv512::<$B>(args, tiles, y.0.add(r0)) }
            };
        }
        for_block!(w.enc, go);
        return 4 * tiles;
    }
    let _ = (isa, w, x, r0, r1, y);
    0
}

/// Activation rows from which [`rows_task`] dequantizes into a buffer.
const BUFFERED_MIN_COLS: usize = 8;

thread_local! {
    /// Per-thread dequantized weight tile (grows once to `rows * cols`).
    static WBUF: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Canonical dequantization of row `r` with SIMD (identical values to `scalar::dequant_row`).
fn dequant_row_simd(isa: Isa, w: &MatRef<'_>, r: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar && w.cols.is_multiple_of(32) {
        assert!(out.len() >= w.cols);
        let row = w.row(r);
        macro_rules! go {
            ($B:ty) => {
                // SAFETY: `row` holds cols/32 blocks of `$B` and `out` at least
                // `cols` floats; `isa` was checked supported by the caller.
                unsafe {
                    x86::dequant_row::<$B>(
                        isa >= Isa::Avx512,
                        row.as_ptr(),
                        w.cols / 32,
                        out.as_mut_ptr(),
                    )
                }
            };
        }
        for_block!(w.enc, go);
        return;
    }
    let _ = isa;
    scalar::dequant_row(w.enc, w.row(r), &mut out[..w.cols]);
}

/// Finish one element from its lanes (dense tail, canonical reduction) and store it.
///
/// # Safety
/// `y.0 + c * rows + r` must be in bounds and owned by the caller.
#[inline]
unsafe fn finish(
    w: &MatRef<'_>,
    x: &[f32],
    r: usize,
    c: usize,
    lanes: &mut [f32; LANES],
    done: usize,
    y: OutPtr,
) {
    let xr = &x[c * w.cols..(c + 1) * w.cols];
    scalar::dense_tail(w.enc, w.row(r), xr, done, lanes);
    // SAFETY: in bounds by the caller's contract.
    unsafe { *y.0.add(c * w.rows + r) = scalar::reduce16(lanes) };
}

macro_rules! simd_tile {
    ($kernel:ident, $isa_rt:literal, $isa_ct:literal, $w:expr, $src:expr, $x:expr, $r:expr, $rn:expr, $c:expr, $cn:expr, $y:expr) => {{
        let w = $w;
        let src: Src = $src;
        let nblocks = w.cols / 32;
        let args = x86::TileArgs {
            w: src.ptr,
            row_bytes: src.row_bytes,
            // SAFETY: activation row `$c` exists (c < n).
            x: unsafe { $x.as_ptr().add($c * w.cols) },
            x_stride: w.cols,
            nblocks,
        };
        let want_lanes = w.cols % 32 != 0;
        macro_rules! run {
            ($B:ty, $R:literal, $C:literal) => {{
                let mut out = x86::TileOut::<$R, $C>::new(want_lanes);
                // SAFETY: the tile's rows/columns are in bounds (see
                // `rows_task`) and `Isa::is_supported` was checked.
                unsafe { x86::$kernel::<$B, $R, $C>(args, &mut out) };
                // SAFETY: with `want_lanes` the kernel wrote every element's
                // lanes; without it the lanes are never read.
                let lanes = want_lanes.then(|| unsafe { out.lanes.assume_init_mut() });
                let mut lanes = lanes;
                for i in 0..$R {
                    for j in 0..$C {
                        if let Some(lanes) = lanes.as_deref_mut() {
                            // SAFETY: element (r+i, c+j) belongs to this task.
                            unsafe {
                                finish(&w, $x, $r + i, $c + j, &mut lanes[i][j], nblocks * 32, $y)
                            };
                        } else {
                            // SAFETY: element (r+i, c+j) belongs to this task
                            // and lies inside the n x rows output.
                            unsafe { *$y.0.add(($c + j) * w.rows + $r + i) = out.sums[i][j] };
                        }
                    }
                }
            }};
        }
        macro_rules! go {
            ($B:ty) => {
                match ($rn, $cn) {
                    ($isa_rt, $isa_ct) => run!($B, $isa_rt, $isa_ct),
                    ($isa_rt, 1) => run!($B, $isa_rt, 1),
                    (1, $isa_ct) => run!($B, 1, $isa_ct),
                    _ => run!($B, 1, 1),
                }
            };
        }
        for_block!(src.enc, go)
    }};
}

/// Where a tile kernel reads its weight rows: the encoded matrix, or a
/// buffer of canonically dequantized f32 rows.
#[derive(Clone, Copy)]
struct Src {
    ptr: *const u8,
    row_bytes: usize,
    enc: Encoding,
}

/// One `rn x cn` tile at weight row `r`, activation row `c`, reading the
/// weight rows from `src` (pointing at row `r`).
///
/// # Safety
/// As [`rows_task`], for the tile's elements; `src` must hold `rn` rows.
#[allow(clippy::too_many_arguments)]
unsafe fn tile(
    isa: Isa,
    w: MatRef<'_>,
    src: Src,
    x: &[f32],
    r: usize,
    rn: usize,
    c: usize,
    cn: usize,
    y: OutPtr,
) {
    let _ = src;
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => simd_tile!(tile512, 4, 4, w, src, x, r, rn, c, cn, y),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::AvxVnni => simd_tile!(tile256, 2, 2, w, src, x, r, rn, c, cn, y),
        _ => {
            for i in 0..rn {
                for j in 0..cn {
                    let v = scalar::dot(
                        w.enc,
                        w.row(r + i),
                        &x[(c + j) * w.cols..(c + j + 1) * w.cols],
                    );
                    // SAFETY: element (r+i, c+j) belongs to this task.
                    unsafe { *y.0.add((c + j) * w.rows + r + i) = v };
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
use super::{x86, x86_blocks};

/// Dequantize row `r` of `w` into `out` (`cols` floats), canonical values.
pub fn dequant_row(w: &MatRef<'_>, r: usize, out: &mut [f32]) {
    scalar::dequant_row(w.enc, w.row(r), out);
}

#[cfg(test)]
mod tests {
    use super::TaskSplit;

    #[test]
    fn task_split_tiles_all_rows_in_order_with_a_short_tail() {
        for total in [1, 15, 16, 17, 203, 576, 960, 3072, 49152] {
            for threads in 1..=4 {
                let s = TaskSplit::new(total, threads);
                let n = s.tasks();
                assert_eq!(s.start(0), 0);
                assert_eq!(s.start(n), total, "total {total}, threads {threads}");
                for t in 0..n {
                    let (a, b) = (s.start(t), s.start(t + 1));
                    assert!(a < b, "task {t} of {n} is empty ({total}, {threads})");
                    assert_eq!(a % 16, 0, "task {t} starts off a 16-row boundary");
                }
                if total >= 64 * threads {
                    let last = s.start(n) - s.start(n - 1);
                    assert!(last <= TaskSplit::SMALL, "last task has {last} rows");
                }
            }
        }
    }
}
