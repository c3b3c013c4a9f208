//! [`HostDevice`]: the runtime's [`Device`] computed in plain Rust on host
//! memory laid out exactly as the GPU's, so CI runs every line of the CUDA
//! runtime's bookkeeping ([`HostRuntime`] = `Runtime<HostDevice>`) with real
//! results that parity with the CPU runtime can fail on.
//!
//! Addresses are real host addresses of 16-byte aligned allocations; every
//! access of every op is checked against the live allocations (a GPU would
//! fault or corrupt: here it is [`CudaError::HostAccess`]), and memory that
//! `alloc` hands out uninitialized (the KV cache) is filled with NaN/`!0`
//! bytes, so a read before a write poisons the logits instead of passing.
//! Work is deferred as on a GPU: kernel ops and async copies queue, in
//! order (both streams as one, a valid order of the GPU's), and run only
//! when the host waits (`event_sync`, `sync`), reading and writing host
//! buffers then. So a host buffer read before its copy's event was waited
//! for holds stale data, and one rewritten before its H2D copy ran is
//! copied rewritten: I3/I6 slips show up as wrong tokens. Host buffers are
//! registered allocations too, so a queued copy into a freed buffer is an
//! error, not a write into freed memory. Graph capture records the ops with
//! their arguments; replay queues the record. Stream order is tracked where
//! the runtime relies on it across streams: a zero fill (`alloc_zeroed`) is
//! a compute-stream item, and a copy-stream copy that reads a filled
//! buffer before the copy stream waited for an event recorded after the
//! fill is an error (on a GPU it could read the bytes from before the
//! fill). Not modelled: kernel timing (events are stamped when the queue
//! reaches them).

use std::alloc::Layout;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use kestrel_model::ModelWeights;

use crate::hostdev_kernels as k;
pub use crate::hostdev_sample::{sample_row, SampleRow};
use crate::runtime::backend::{
    AcceptDrafts, AcceptValues, AddBias, AddF32, AddLayerNorm, AddRmsNorm, AddRmsNormQ8, BiasGelu,
    CountTokens, DequantF16, DevMem, Device, DraftCounts, EmbedGather, EmbedGatherQ,
    FourierFeatures, GeluMul, GeluMulQ8, Gemm, HiddenF16, HostMem, Mmvq, PagedAttention, Plain,
    PrefillAttention, QuantizeQ8H, ResetCounts, RmsNormF32, RopeKvAppend, SampleRows, ScaleF32,
    Softcap, SpatialEmbed, SpatialValues, Stream, Swiglu, SwigluQ8, VerifyInputs,
};
use crate::runtime::{CudaRuntimeConfig, Runtime};
use crate::CudaError;

/// The CUDA runtime's bookkeeping over the host device (CI, no GPU).
pub type HostRuntime = Runtime<HostDevice>;

impl HostRuntime {
    /// The runtime of `cfg` on a fresh [`HostDevice`] (`cfg.device` and
    /// `cfg.ptx_cache` are unused; `cuda_graphs` records and replays ops).
    pub fn new(weights: ModelWeights, cfg: CudaRuntimeConfig) -> Result<Self, CudaError> {
        Runtime::with_device(
            HostDevice::default(),
            "host device (CI stand-in)".to_owned(),
            weights,
            cfg,
        )
    }
}

/// Live allocations: base address -> (bytes, allocation number).
type Registry = Arc<Mutex<BTreeMap<u64, (usize, u64)>>>;

/// A host allocation standing in for a device buffer.
#[derive(Debug)]
pub struct HostDevBuf {
    ptr: u64,
    layout: Layout,
    registry: Registry,
}

// SAFETY: the buffer uniquely owns its allocation; its memory is accessed
// only through the `HostDevice` ops of the runtime that owns both, which one
// thread uses at a time.
unsafe impl Send for HostDevBuf {}

impl DevMem for HostDevBuf {
    fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for HostDevBuf {
    fn drop(&mut self) {
        self.registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.ptr);
        // SAFETY: `ptr` came from `std::alloc::alloc` with `layout` and is
        // freed once; it left the registry above, so no op can reach it.
        unsafe { std::alloc::dealloc(self.ptr as *mut u8, self.layout) };
    }
}

/// A host buffer the host device copies from and into: a registered
/// allocation, so queued copies reach it by address and fail cleanly once
/// it is freed.
#[derive(Debug)]
pub struct HostVec<T> {
    buf: HostDevBuf,
    len: usize,
    _values: std::marker::PhantomData<T>,
}

impl<T: Plain> HostMem<T> for HostVec<T> {
    fn as_slice(&self) -> &[T] {
        // SAFETY: `buf` holds `len` values of T, initialized at creation and
        // only ever written as T; the queue touches it only inside the host
        // device's calls, while no borrow taken here is alive (`&self`
        // borrows end before the runtime calls the device again).
        unsafe { std::slice::from_raw_parts(self.buf.ptr as *const T, self.len) }
    }
    fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above, and `&mut self` makes this the only host borrow.
        unsafe { std::slice::from_raw_parts_mut(self.buf.ptr as *mut T, self.len) }
    }
}

/// An event: stamped with the instant the queue reached it, and the
/// compute-stream position a stream that waits for it has reached.
#[derive(Debug, Default)]
pub struct HostEvent {
    stamp: Arc<Mutex<Option<Instant>>>,
    compute_pos: std::cell::Cell<u64>,
}

/// One enqueued kernel op (a captured graph is a list of them).
#[derive(Debug, Clone, Copy)]
enum Op {
    Gemm(Gemm),
    Mmvq(Mmvq),
    QuantizeQ8H(QuantizeQ8H),
    DequantF16(DequantF16),
    EmbedGather(EmbedGather),
    EmbedGatherQ(EmbedGatherQ),
    AddRmsNorm(AddRmsNorm),
    AddRmsNormQ8(AddRmsNormQ8),
    AddBias(AddBias),
    RopeKvAppend(RopeKvAppend),
    PagedAttention(PagedAttention),
    PrefillAttention(PrefillAttention),
    Swiglu(Swiglu),
    SwigluQ8(SwigluQ8),
    GeluMul(GeluMul),
    GeluMulQ8(GeluMulQ8),
    RmsNormF32(RmsNormF32),
    ScaleF32(ScaleF32),
    Softcap(Softcap),
    AddLayerNorm(AddLayerNorm),
    AddF32(AddF32),
    BiasGelu(BiasGelu),
    SpatialValues(SpatialValues),
    FourierFeatures(FourierFeatures),
    SpatialEmbed(SpatialEmbed),
    HiddenF16(HiddenF16),
    AcceptValues(AcceptValues),
    ResetCounts(ResetCounts),
    CountTokens(CountTokens),
    VerifyInputs(VerifyInputs),
    DraftCounts(DraftCounts),
    AcceptDrafts(AcceptDrafts),
    SampleRows(SampleRows),
}

/// A captured forward: its ops, arguments as captured.
#[derive(Debug)]
pub struct HostGraph(Vec<Op>);

/// Work waiting for the host to wait on it.
#[derive(Debug)]
enum Queued {
    Op(Op),
    /// A copy of `bytes` bytes between two registered addresses.
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    Stamp(Arc<Mutex<Option<Instant>>>),
    /// A zero fill of `bytes` bytes (`cuMemsetD8Async` on the compute
    /// stream) of allocation number `number`.
    Fill {
        dst: u64,
        bytes: usize,
        number: u64,
    },
}

/// What the streams have waited for, as far as zero fills are concerned.
#[derive(Debug, Default)]
struct Order {
    /// Items enqueued on the compute stream so far.
    compute: u64,
    /// The compute-stream position the copy stream has waited for.
    copy_sees: u64,
    /// Fills not known complete: (address, bytes, allocation number,
    /// compute position).
    fills: Vec<(u64, usize, u64, u64)>,
}

impl Order {
    fn on_compute(&mut self) -> u64 {
        self.compute += 1;
        self.compute
    }

    /// Refuses a copy-stream access to `(addr, bytes)` that no event orders
    /// after a fill of those bytes (of a buffer still live: `mem` tells).
    fn copy_stream_reads(
        &self,
        mem: &HostMemory,
        addr: u64,
        bytes: usize,
    ) -> Result<(), CudaError> {
        match self.fills.iter().find(|&&(a, n, number, pos)| {
            pos > self.copy_sees
                && a < addr + bytes as u64
                && addr < a + n as u64
                && mem.number_at(a) == Some(number)
        }) {
            Some(_) => Err(CudaError::HostAccess {
                what: "a copy-stream copy unordered with a zero fill on the compute stream",
                addr,
                bytes,
            }),
            None => Ok(()),
        }
    }
}

/// The host device. See the module docs.
#[derive(Debug, Default)]
pub struct HostDevice {
    mem: HostMemory,
    /// Ops recorded since `begin_capture`.
    capture: RefCell<Option<Vec<Op>>>,
    /// Enqueued, not yet run.
    queue: RefCell<Vec<Queued>>,
    order: RefCell<Order>,
}

/// Bounds-checked access to the live allocations.
#[derive(Debug, Default)]
pub(crate) struct HostMemory {
    registry: Registry,
    /// Allocations made so far (each one's number tells a freed buffer
    /// from a later one at the same address).
    allocations: std::sync::atomic::AtomicU64,
}

impl HostMemory {
    fn alloc(&self, bytes: usize, fill: u8) -> Result<HostDevBuf, CudaError> {
        let oom = || CudaError::HostAccess {
            what: "allocation failed",
            addr: 0,
            bytes,
        };
        let layout = Layout::from_size_align(bytes.max(16), 16).map_err(|_| oom())?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(oom());
        }
        // SAFETY: `ptr` owns `layout.size()` writable bytes.
        unsafe { ptr.write_bytes(fill, layout.size()) };
        let ptr = ptr as u64;
        let number = self
            .allocations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(ptr, (layout.size(), number));
        Ok(HostDevBuf {
            ptr,
            layout,
            registry: Arc::clone(&self.registry),
        })
    }

    /// The number of the live allocation based at `addr`.
    fn number_at(&self, addr: u64) -> Option<u64> {
        let reg = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
        reg.get(&addr).map(|&(_, number)| number)
    }

    /// Checks that `len` values of `T` at `addr` lie inside one live allocation.
    pub(crate) fn check<T>(&self, addr: u64, len: usize) -> Result<(), CudaError> {
        let bytes = len * std::mem::size_of::<T>();
        let reg = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
        let inside = reg
            .range(..=addr)
            .next_back()
            .is_some_and(|(&base, &(size, _))| addr + bytes as u64 <= base + size as u64);
        if inside && addr.is_multiple_of(std::mem::align_of::<T>() as u64) {
            Ok(())
        } else {
            Err(CudaError::HostAccess {
                what: "access outside every live allocation",
                addr,
                bytes,
            })
        }
    }

    /// `len` values of `T` at `addr`, read-only.
    ///
    /// # Safety
    /// No `&mut` slice over these bytes is alive while the result is (ops
    /// take their outputs with [`HostMemory::slice_mut`] after checking
    /// them disjoint from their inputs with [`disjoint`]).
    pub(crate) unsafe fn slice<T: Copy>(&self, addr: u64, len: usize) -> Result<&[T], CudaError> {
        self.check::<T>(addr, len)?;
        // SAFETY: `check` proved the range inside a live allocation and
        // aligned for T; every T used here (f32, f16, u8, u32, i32, Q8Block,
        // SampleParams) is valid for any bit pattern; the caller rules out aliasing writes.
        Ok(unsafe { std::slice::from_raw_parts(addr as *const T, len) })
    }

    /// `len` values of `T` at `addr`, writable.
    ///
    /// # Safety
    /// No other slice over these bytes is alive while the result is.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut<T: Copy>(
        &self,
        addr: u64,
        len: usize,
    ) -> Result<&mut [T], CudaError> {
        self.check::<T>(addr, len)?;
        // SAFETY: as in `slice`; the caller guarantees exclusivity.
        Ok(unsafe { std::slice::from_raw_parts_mut(addr as *mut T, len) })
    }
}

/// Checks that the byte ranges `(addr, bytes)` do not overlap: an op's
/// output must not alias its inputs (as `__restrict__` promises the GPU).
pub(crate) fn disjoint(ranges: &[(u64, usize)]) -> Result<(), CudaError> {
    for (i, &(a, na)) in ranges.iter().enumerate() {
        for &(b, nb) in &ranges[i + 1..] {
            if na > 0 && nb > 0 && a < b + nb as u64 && b < a + na as u64 {
                return Err(CudaError::HostAccess {
                    what: "an op's output overlaps another of its buffers",
                    addr: a.max(b),
                    bytes: na.min(nb),
                });
            }
        }
    }
    Ok(())
}

impl HostDevice {
    fn submit(&self, op: Op) -> Result<(), CudaError> {
        if let Some(ops) = self.capture.borrow_mut().as_mut() {
            ops.push(op);
            return Ok(());
        }
        self.queue.borrow_mut().push(Queued::Op(op));
        self.order.borrow_mut().on_compute();
        Ok(())
    }

    /// Run everything enqueued, in order (what a wait for the last of it
    /// would see done). The queue is emptied even on an error, as a faulted
    /// device's work is gone.
    fn drain(&self) -> Result<(), CudaError> {
        let work = std::mem::take(&mut *self.queue.borrow_mut());
        {
            let mut o = self.order.borrow_mut();
            o.fills.clear();
            o.copy_sees = o.compute;
        }
        for q in work {
            match q {
                Queued::Op(op) => self.run(&op)?,
                Queued::Copy { dst, src, bytes } => {
                    disjoint(&[(dst, bytes), (src, bytes)])?;
                    // SAFETY: both ranges lie in live allocations (checked
                    // by `slice`/`slice_mut`) and do not overlap (above).
                    let (d, s) = unsafe {
                        (
                            self.mem.slice_mut::<u8>(dst, bytes)?,
                            self.mem.slice::<u8>(src, bytes)?,
                        )
                    };
                    d.copy_from_slice(s);
                }
                Queued::Stamp(at) => {
                    *at.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
                }
                Queued::Fill { dst, bytes, number } => {
                    // A buffer freed before the queue reached its fill: on
                    // a GPU `cuMemFree` waits for the device, so the fill
                    // ran into the live buffer and nothing can see it now.
                    if self.mem.number_at(dst) != Some(number) {
                        continue;
                    }
                    // SAFETY: nothing else borrows device memory while the
                    // queue runs; `slice_mut` checks the range is live.
                    unsafe { self.mem.slice_mut::<u8>(dst, bytes)? }.fill(0);
                }
            }
        }
        Ok(())
    }

    fn run(&self, op: &Op) -> Result<(), CudaError> {
        let m = &self.mem;
        match op {
            Op::Gemm(a) => k::gemm(m, a),
            Op::Mmvq(a) => k::mmvq(m, a),
            Op::QuantizeQ8H(a) => k::quantize_q8_h(m, a),
            Op::DequantF16(a) => k::dequant_f16(m, a),
            Op::EmbedGather(a) => k::embed_gather(m, a),
            Op::EmbedGatherQ(a) => k::embed_gather_q(m, a),
            Op::AddRmsNorm(a) => k::add_rms_norm(m, a),
            Op::AddRmsNormQ8(a) => k::add_rms_norm_q8(m, a),
            Op::AddBias(a) => k::add_bias(m, a),
            Op::RopeKvAppend(a) => k::rope_kv_append(m, a),
            Op::PagedAttention(a) => k::paged_attention(m, a),
            Op::PrefillAttention(a) => k::prefill_attention(m, a),
            Op::Swiglu(a) => k::swiglu(m, a),
            Op::SwigluQ8(a) => k::swiglu_q8(m, a),
            Op::GeluMul(a) => k::gelu_mul(m, a),
            Op::GeluMulQ8(a) => k::gelu_mul_q8(m, a),
            Op::RmsNormF32(a) => k::rms_norm_f32(m, a),
            Op::ScaleF32(a) => k::scale_f32(m, a),
            Op::Softcap(a) => k::softcap(m, a),
            Op::AddLayerNorm(a) => k::add_layer_norm(m, a),
            Op::AddF32(a) => k::add_f32(m, a),
            Op::BiasGelu(a) => k::bias_gelu(m, a),
            Op::SpatialValues(a) => crate::hostdev_region::spatial_values(m, a),
            Op::FourierFeatures(a) => crate::hostdev_region::fourier_features(m, a),
            Op::SpatialEmbed(a) => crate::hostdev_region::spatial_embed(m, a),
            Op::HiddenF16(a) => crate::hostdev_region::hidden_f16(m, a),
            Op::AcceptValues(a) => crate::hostdev_region::accept_values(m, a),
            Op::ResetCounts(a) => k::reset_counts(m, a),
            Op::CountTokens(a) => k::count_tokens(m, a),
            Op::VerifyInputs(a) => k::verify_inputs(m, a),
            Op::DraftCounts(a) => k::draft_counts(m, a),
            Op::AcceptDrafts(a) => k::accept_drafts(m, a),
            Op::SampleRows(a) => crate::hostdev_sample::sample_rows(m, a),
        }
    }
}

impl Device for HostDevice {
    type Buf = HostDevBuf;
    type Host<T: Plain> = HostVec<T>;
    type Event = HostEvent;
    type Graph = HostGraph;

    fn bind(&self) -> Result<(), CudaError> {
        Ok(())
    }

    /// `0xFF` bytes until the queue reaches its fill (a compute-stream
    /// item, as `cuMemsetD8Async` on the compute stream).
    fn alloc_zeroed(&self, bytes: usize) -> Result<HostDevBuf, CudaError> {
        if self.capture.borrow().is_some() {
            return Err(CudaError::Config(
                "a zero fill enqueued during a graph capture".to_owned(),
            ));
        }
        let b = self.mem.alloc(bytes, 0xFF)?;
        let n = b.layout.size();
        let number = self.mem.number_at(b.ptr).unwrap_or(u64::MAX);
        self.queue.borrow_mut().push(Queued::Fill {
            dst: b.ptr,
            bytes: n,
            number,
        });
        let mut o = self.order.borrow_mut();
        let pos = o.on_compute();
        o.fills.push((b.ptr, n, number, pos));
        Ok(b)
    }

    /// Filled with `0xFF` bytes: NaN as f32 and f16, `u32::MAX` as an index.
    fn alloc(&self, bytes: usize) -> Result<HostDevBuf, CudaError> {
        self.mem.alloc(bytes, 0xFF)
    }

    fn upload<T: Copy>(&self, data: &[T]) -> Result<HostDevBuf, CudaError> {
        let bytes = std::mem::size_of_val(data);
        let b = self.mem.alloc(bytes, 0)?;
        // SAFETY: `b` owns at least `bytes` bytes, 16-byte aligned (enough for
        // every T uploaded: f16, f32), and is not yet shared.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr() as *const u8, b.ptr as *mut u8, bytes)
        };
        Ok(b)
    }

    fn host<T: Plain>(&self, len: usize) -> Result<HostVec<T>, CudaError> {
        let mut v = HostVec {
            buf: self.mem.alloc(len * std::mem::size_of::<T>(), 0)?,
            len,
            _values: std::marker::PhantomData,
        };
        // Every value starts as T's default, as the CUDA host buffers do.
        v.as_mut_slice().fill(T::default());
        Ok(v)
    }

    /// After everything enqueued (on the compute stream, then waited for).
    fn htod_sync<T: Plain>(&self, dst: u64, src: &[T]) -> Result<(), CudaError> {
        self.drain()?;
        // SAFETY: nothing else borrows device memory while no op runs.
        let d = unsafe { self.mem.slice_mut::<T>(dst, src.len()) }?;
        d.copy_from_slice(src);
        Ok(())
    }

    /// Queued: `src` (a host buffer of this device) is read when the queue
    /// runs, as a GPU's DMA reads pinned memory when the copy executes.
    unsafe fn htod<T: Plain>(&self, dst: u64, src: &[T]) -> Result<(), CudaError> {
        let bytes = std::mem::size_of_val(src);
        self.mem.check::<u8>(src.as_ptr() as u64, bytes)?;
        self.mem.check::<T>(dst, src.len())?;
        self.queue.borrow_mut().push(Queued::Copy {
            dst,
            src: src.as_ptr() as u64,
            bytes,
        });
        self.order.borrow_mut().on_compute();
        Ok(())
    }

    /// Queued: `dst` (a host buffer of this device) is written when the
    /// queue runs, i.e. when the host waits.
    unsafe fn dtoh<T: Plain>(&self, dst: &mut [T], src: u64) -> Result<(), CudaError> {
        let bytes = std::mem::size_of_val(dst);
        self.mem.check::<u8>(dst.as_ptr() as u64, bytes)?;
        self.mem.check::<T>(src, dst.len())?;
        self.order
            .borrow()
            .copy_stream_reads(&self.mem, src, bytes)?;
        self.queue.borrow_mut().push(Queued::Copy {
            dst: dst.as_mut_ptr() as u64,
            src,
            bytes,
        });
        Ok(())
    }

    fn event(&self, _timed: bool) -> Result<HostEvent, CudaError> {
        Ok(HostEvent::default())
    }

    fn record(&self, ev: &HostEvent, on: Stream) -> Result<(), CudaError> {
        *ev.stamp.lock().unwrap_or_else(PoisonError::into_inner) = None;
        self.queue
            .borrow_mut()
            .push(Queued::Stamp(Arc::clone(&ev.stamp)));
        let o = self.order.borrow();
        ev.compute_pos.set(match on {
            Stream::Compute => o.compute,
            Stream::Copy => o.copy_sees,
        });
        Ok(())
    }

    fn copy_waits(&self, ev: &HostEvent) -> Result<(), CudaError> {
        let mut o = self.order.borrow_mut();
        o.copy_sees = o.copy_sees.max(ev.compute_pos.get());
        Ok(())
    }

    fn event_sync(&self, _ev: &HostEvent) -> Result<(), CudaError> {
        self.drain()
    }

    fn sync_compute(&self) -> Result<(), CudaError> {
        self.drain()
    }

    fn sync(&self) -> Result<(), CudaError> {
        self.drain()
    }

    fn begin_capture(&self) -> Result<(), CudaError> {
        *self.capture.borrow_mut() = Some(Vec::new());
        Ok(())
    }

    fn end_capture(&self) -> Result<Option<HostGraph>, CudaError> {
        Ok(self
            .capture
            .borrow_mut()
            .take()
            .filter(|ops| !ops.is_empty())
            .map(HostGraph))
    }

    fn replay(&self, g: &HostGraph) -> Result<(), CudaError> {
        self.queue
            .borrow_mut()
            .extend(g.0.iter().copied().map(Queued::Op));
        self.order.borrow_mut().compute += g.0.len() as u64;
        Ok(())
    }

    fn free_memory(&self) -> Result<usize, CudaError> {
        Ok(0)
    }

    fn anchor_clock(&mut self) -> Result<(), CudaError> {
        Ok(())
    }

    fn clock_stale(&self, _now: Instant) -> bool {
        false
    }

    fn instant(&self, ev: &HostEvent) -> Result<Instant, CudaError> {
        ev.stamp
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .ok_or(CudaError::Config(
                "a timing event the queue has not reached".to_owned(),
            ))
    }

    fn gemm(&self, a: Gemm) -> Result<(), CudaError> {
        self.submit(Op::Gemm(a))
    }
    fn mmvq(&self, a: Mmvq) -> Result<(), CudaError> {
        self.submit(Op::Mmvq(a))
    }
    fn quantize_q8_h(&self, a: QuantizeQ8H) -> Result<(), CudaError> {
        self.submit(Op::QuantizeQ8H(a))
    }
    fn dequant_f16(&self, a: DequantF16) -> Result<(), CudaError> {
        self.submit(Op::DequantF16(a))
    }
    fn embed_gather(&self, a: EmbedGather) -> Result<(), CudaError> {
        self.submit(Op::EmbedGather(a))
    }
    fn embed_gather_q(&self, a: EmbedGatherQ) -> Result<(), CudaError> {
        self.submit(Op::EmbedGatherQ(a))
    }
    fn add_rms_norm(&self, a: AddRmsNorm) -> Result<(), CudaError> {
        self.submit(Op::AddRmsNorm(a))
    }
    fn add_rms_norm_q8(&self, a: AddRmsNormQ8) -> Result<(), CudaError> {
        self.submit(Op::AddRmsNormQ8(a))
    }
    fn add_bias(&self, a: AddBias) -> Result<(), CudaError> {
        self.submit(Op::AddBias(a))
    }
    fn rope_kv_append(&self, a: RopeKvAppend) -> Result<(), CudaError> {
        self.submit(Op::RopeKvAppend(a))
    }
    fn paged_attention(&self, a: PagedAttention) -> Result<(), CudaError> {
        self.submit(Op::PagedAttention(a))
    }
    fn prefill_attention(&self, a: PrefillAttention) -> Result<(), CudaError> {
        self.submit(Op::PrefillAttention(a))
    }
    fn swiglu(&self, a: Swiglu) -> Result<(), CudaError> {
        self.submit(Op::Swiglu(a))
    }
    fn swiglu_q8(&self, a: SwigluQ8) -> Result<(), CudaError> {
        self.submit(Op::SwigluQ8(a))
    }
    fn gelu_mul(&self, a: GeluMul) -> Result<(), CudaError> {
        self.submit(Op::GeluMul(a))
    }
    fn gelu_mul_q8(&self, a: GeluMulQ8) -> Result<(), CudaError> {
        self.submit(Op::GeluMulQ8(a))
    }
    fn rms_norm_f32(&self, a: RmsNormF32) -> Result<(), CudaError> {
        self.submit(Op::RmsNormF32(a))
    }
    fn scale_f32(&self, a: ScaleF32) -> Result<(), CudaError> {
        self.submit(Op::ScaleF32(a))
    }
    fn softcap(&self, a: Softcap) -> Result<(), CudaError> {
        self.submit(Op::Softcap(a))
    }
    fn add_layer_norm(&self, a: AddLayerNorm) -> Result<(), CudaError> {
        self.submit(Op::AddLayerNorm(a))
    }
    fn add_f32(&self, a: AddF32) -> Result<(), CudaError> {
        self.submit(Op::AddF32(a))
    }
    fn bias_gelu(&self, a: BiasGelu) -> Result<(), CudaError> {
        self.submit(Op::BiasGelu(a))
    }
    fn spatial_values(&self, a: SpatialValues) -> Result<(), CudaError> {
        self.submit(Op::SpatialValues(a))
    }
    fn fourier_features(&self, a: FourierFeatures) -> Result<(), CudaError> {
        self.submit(Op::FourierFeatures(a))
    }
    fn spatial_embed(&self, a: SpatialEmbed) -> Result<(), CudaError> {
        self.submit(Op::SpatialEmbed(a))
    }
    fn hidden_f16(&self, a: HiddenF16) -> Result<(), CudaError> {
        self.submit(Op::HiddenF16(a))
    }
    fn accept_values(&self, a: AcceptValues) -> Result<(), CudaError> {
        self.submit(Op::AcceptValues(a))
    }
    fn reset_counts(&self, a: ResetCounts) -> Result<(), CudaError> {
        self.submit(Op::ResetCounts(a))
    }
    fn count_tokens(&self, a: CountTokens) -> Result<(), CudaError> {
        self.submit(Op::CountTokens(a))
    }
    fn verify_inputs(&self, a: VerifyInputs) -> Result<(), CudaError> {
        self.submit(Op::VerifyInputs(a))
    }
    fn draft_counts(&self, a: DraftCounts) -> Result<(), CudaError> {
        self.submit(Op::DraftCounts(a))
    }
    fn accept_drafts(&self, a: AcceptDrafts) -> Result<(), CudaError> {
        self.submit(Op::AcceptDrafts(a))
    }
    fn sample_rows(&self, a: SampleRows) -> Result<(), CudaError> {
        self.submit(Op::SampleRows(a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    fn caught(r: Result<(), CudaError>) -> &'static str {
        match r {
            Err(CudaError::HostAccess { what, .. }) => what,
            other => panic!("expected a HostAccess error, got {other:?}"),
        }
    }

    #[test]
    fn accesses_outside_live_allocations_are_caught() {
        let d = HostDevice::default();
        let b = d.alloc_zeroed(64).unwrap();
        d.mem.check::<f32>(b.ptr(), 16).unwrap();
        d.mem.check::<f32>(b.at::<f32>(15), 1).unwrap();
        assert!(caught(d.mem.check::<f32>(b.at::<f32>(15), 2)).contains("outside"));
        assert!(caught(d.mem.check::<f32>(b.ptr() + 2, 1)).contains("outside"));
        let stale = b.ptr();
        drop(b);
        assert!(caught(d.mem.check::<u8>(stale, 1)).contains("outside"));
        assert!(caught(d.htod_sync(stale, &[1u32])).contains("outside"));
    }

    #[test]
    fn an_output_overlapping_an_input_is_caught() {
        disjoint(&[(0x1000, 16), (0x1010, 16), (0x2000, 0)]).unwrap();
        assert!(caught(disjoint(&[(0x1000, 16), (0x100f, 4)])).contains("overlaps"));
        let d = HostDevice::default();
        let b = d.alloc_zeroed(4 * 64).unwrap();
        // A GEMM writing into its own input: caught when the queue runs it.
        d.gemm(Gemm {
            y: b.ptr(),
            ldy: 2,
            x: b.ptr(),
            w: b.at::<f32>(32),
            n: 1,
            out: 2,
            inp: 2,
        })
        .unwrap();
        assert!(caught(d.sync()).contains("overlaps"));
    }

    /// An `mmvq` launch of more rows than the kernel's accumulators hold is
    /// refused (as `CudaDevice` refuses it), and so are misaligned
    /// activations; one within them writes only its columns of rows `ldy`
    /// apart (a projection's part).
    #[test]
    fn mmvq_takes_at_most_its_rows_and_writes_only_its_columns() {
        use crate::kernels::MMVQ_MAX_ROWS;
        use crate::quant::{pack_q8_rows, Q8Block, Q8_BLOCK_BYTES};
        use kestrel_model::DType;
        let d = HostDevice::default();
        // One Q8_0 row of 32: scale 1.0, every weight 1.
        let mut w = f16::from_f32(1.0).to_le_bytes().to_vec();
        w.extend([1u8; 32]);
        let w = d.upload(&w).unwrap();
        let n = MMVQ_MAX_ROWS + 1;
        let blocks = vec![
            Q8Block {
                d: 0.5,
                s: 16.0,
                q: [1; 32],
            };
            n
        ];
        let mut rows = vec![0u8; n * Q8_BLOCK_BYTES];
        pack_q8_rows(&blocks, 1, &mut rows);
        let xq = d.upload(&rows).unwrap();
        let y = d.upload(&vec![7f32; 2 * n]).unwrap();
        let a = Mmvq {
            dtype: DType::Q8_0,
            w: w.ptr(),
            xq: xq.ptr(),
            y: y.ptr(),
            rows: 1,
            cols: 32,
            ldy: 2,
            n,
        };
        d.mmvq(a).unwrap();
        assert!(matches!(d.sync(), Err(CudaError::Unsupported(_))));
        // Rows that are not 8-byte aligned (the kernel's 8- and 16-byte
        // loads would fault) are refused too.
        d.mmvq(Mmvq {
            xq: xq.ptr() + 4,
            n: 1,
            ..a
        })
        .unwrap();
        assert!(matches!(d.sync(), Err(CudaError::Unsupported(_))));
        d.mmvq(Mmvq {
            n: MMVQ_MAX_ROWS,
            ..a
        })
        .unwrap();
        let mut out = d.host::<f32>(2 * n).unwrap();
        // SAFETY: `out` is this device's host buffer, read after the wait.
        unsafe { d.dtoh(out.as_mut_slice(), y.ptr()) }.unwrap();
        d.sync().unwrap();
        for (r, row) in out.as_slice().chunks(2).enumerate() {
            let want = if r < MMVQ_MAX_ROWS { 16.0 } else { 7.0 };
            assert_eq!(row, [want, 7.0], "row {r}");
        }
    }

    /// `x`'s one f32, copied back through the queue (and the host waiting).
    fn read(d: &HostDevice, out: &mut HostVec<f32>, x: u64) -> f32 {
        // SAFETY: `out` is this device's host buffer, read after the wait.
        unsafe { d.dtoh(out.as_mut_slice(), x) }.unwrap();
        d.sync().unwrap();
        out.as_slice()[0]
    }

    #[test]
    fn uninitialized_memory_reads_as_nan_and_captured_ops_replay() {
        let d = HostDevice::default();
        let table = d
            .upload(&[f16::from_f32(1.5), f16::from_f32(-2.0)])
            .unwrap();
        let tokens = d.upload(&[1u32]).unwrap();
        let x = d.alloc(4).unwrap();
        let mut out = d.host::<f32>(1).unwrap();
        assert!(read(&d, &mut out, x.ptr()).is_nan(), "alloc poisons");
        let gather = EmbedGather {
            table: table.ptr(),
            tokens: tokens.ptr(),
            rows: 0,
            x: x.ptr(),
            hidden: 1,
            vocab: 2,
            n: 1,
        };
        d.begin_capture().unwrap();
        d.embed_gather(gather).unwrap();
        let g = d.end_capture().unwrap().expect("one op captured");
        assert!(read(&d, &mut out, x.ptr()).is_nan(), "captured, not run");
        d.replay(&g).unwrap();
        assert_eq!(read(&d, &mut out, x.ptr()), -2.0);
    }

    /// Issue 75 item 4: a zero fill is a compute-stream item. A compute-stream
    /// copy after it lands after it; a copy-stream copy of the filled bytes
    /// needs an event recorded after the fill (or a host wait) first.
    #[test]
    fn a_zero_fill_is_ordered_on_the_compute_stream_only() {
        let d = HostDevice::default();
        let mut src = d.host::<u32>(4).unwrap();
        let mut dst = d.host::<u32>(4).unwrap();
        src.as_mut_slice().copy_from_slice(&[1, 2, 3, 4]);
        let dev = d.alloc_zeroed(16).unwrap();
        // SAFETY: both host buffers are this device's and outlive the queue.
        unsafe { d.htod(dev.at::<u32>(2), &src.as_slice()[..2]) }.unwrap();
        // Unordered: the copy stream has not waited for the fill.
        // SAFETY: as above.
        let r = unsafe { d.dtoh(dst.as_mut_slice(), dev.ptr()) };
        assert!(caught(r).contains("unordered with a zero fill"));
        let ev = d.event(false).unwrap();
        d.record(&ev, Stream::Copy).unwrap();
        d.copy_waits(&ev).unwrap();
        // SAFETY: as above.
        let r = unsafe { d.dtoh(dst.as_mut_slice(), dev.ptr()) };
        assert!(
            caught(r).contains("unordered"),
            "a copy-stream event orders nothing"
        );
        d.record(&ev, Stream::Compute).unwrap();
        d.copy_waits(&ev).unwrap();
        // SAFETY: as above.
        unsafe { d.dtoh(dst.as_mut_slice(), dev.ptr()) }.unwrap();
        d.sync().unwrap();
        // The fill ran before the copy queued after it.
        assert_eq!(dst.as_slice(), [0, 0, 1, 2]);
        // A fill another buffer's event does not cover; a host wait does.
        let late = d.alloc_zeroed(16).unwrap();
        // SAFETY: as above.
        assert!(caught(unsafe { d.dtoh(dst.as_mut_slice(), late.ptr()) }).contains("unordered"));
        d.sync_compute().unwrap();
        // SAFETY: as above.
        unsafe { d.dtoh(dst.as_mut_slice(), late.ptr()) }.unwrap();
        d.sync().unwrap();
        assert_eq!(dst.as_slice(), [0; 4]);
        // And never inside a capture.
        d.begin_capture().unwrap();
        assert!(matches!(d.alloc_zeroed(4), Err(CudaError::Config(_))));
        d.end_capture().unwrap();
    }

    #[test]
    fn copies_run_when_the_host_waits_and_fail_cleanly_into_freed_buffers() {
        let d = HostDevice::default();
        let dev = d.alloc_zeroed(4).unwrap();
        let mut src = d.host::<u32>(1).unwrap();
        let mut dst = d.host::<u32>(1).unwrap();
        src.as_mut_slice()[0] = 7;
        // The copy stream reads `dev` after the compute stream's fill and
        // copy, as the runtime orders its render copies.
        let filled = d.event(false).unwrap();
        // SAFETY: both host buffers are this device's and outlive the queue.
        unsafe {
            d.htod(dev.ptr(), src.as_slice()).unwrap();
            d.record(&filled, Stream::Compute).unwrap();
            d.copy_waits(&filled).unwrap();
            d.dtoh(dst.as_mut_slice(), dev.ptr()).unwrap();
        }
        // Rewritten before the queue ran: the copy reads the new value, as a
        // GPU's DMA would (the I6 hazard), and nothing has arrived yet.
        src.as_mut_slice()[0] = 9;
        assert_eq!(dst.as_slice()[0], 0, "read before the wait");
        let ev = d.event(true).unwrap();
        d.record(&ev, Stream::Copy).unwrap();
        assert!(d.instant(&ev).is_err(), "not reached yet");
        d.event_sync(&ev).unwrap();
        assert_eq!(dst.as_slice()[0], 9);
        d.instant(&ev).unwrap();
        // A copy queued into a buffer freed before the wait.
        // SAFETY: as above, until `dst` is dropped (on purpose).
        unsafe { d.dtoh(dst.as_mut_slice(), dev.ptr()) }.unwrap();
        drop(dst);
        assert!(caught(d.sync()).contains("outside"));
    }
}
