//! Owned device and page-locked host buffers with raw, stable addresses
//! (the CUDA device's `Buf` and `Host`).
//!
//! The runtime hands raw pointers to kernels, cuBLAS and captured CUDA
//! graphs, so buffers are plain allocations that never move while alive and
//! are freed on drop (with their context bound). Host buffers are pinned
//! without `WRITECOMBINED` (the design's RenderBuffer reads them on the CPU).

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, DriverError};

use super::backend::{DevMem, HostMem, Plain};

/// A device allocation of `bytes` bytes.
#[derive(Debug)]
pub struct DevBuf {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DevBuf {
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, DriverError> {
        ctx.bind_to_thread()?;
        // SAFETY: the context is current on this thread; a zero-byte request
        // is rounded up so every buffer has a distinct valid address.
        let ptr = unsafe { result::malloc_sync(bytes.max(16)) }?;
        Ok(DevBuf {
            ptr,
            bytes,
            ctx: Arc::clone(ctx),
        })
    }

    /// A buffer of `bytes` zero bytes, the fill enqueued on `stream`
    /// (`cuMemsetD8Async`), so every later operation on that stream sees
    /// zeros. Never the synchronous `cuMemsetD8`: it runs on the legacy
    /// default stream, which the runtime's non-blocking streams do not wait
    /// for, so a copy queued on the compute stream right after it could land
    /// first and be zeroed over (issue 75 item 4). Scratch and metadata that
    /// a kernel might read before the step writes it (graph warm-up, padding
    /// rows) is allocated this way, so no kernel ever reads memory nothing
    /// wrote (compute-sanitizer initcheck), and a missed write shows up as
    /// zeros, not as garbage.
    pub fn zeroed(
        ctx: &Arc<CudaContext>,
        bytes: usize,
        stream: sys::CUstream,
    ) -> Result<Self, DriverError> {
        let b = Self::new(ctx, bytes)?;
        // SAFETY: `b` owns at least `bytes.max(16)` bytes at `b.ptr` and
        // lives until its drop, which frees it with `cuMemFree` (that waits
        // for the device); its context is current (`new` bound it) and
        // `stream` is a live stream of that context.
        unsafe { result::memset_d8_async(b.ptr, 0, bytes.max(16), stream) }?;
        Ok(b)
    }

    /// A buffer holding `data` (synchronous copy; load time only).
    pub fn from_slice<T: Copy>(ctx: &Arc<CudaContext>, data: &[T]) -> Result<Self, DriverError> {
        let b = Self::new(ctx, std::mem::size_of_val(data))?;
        // SAFETY: `b` holds at least size_of_val(data) bytes and `data` is a
        // live host slice; the copy is synchronous.
        unsafe { result::memcpy_htod_sync(b.ptr, data) }?;
        Ok(b)
    }
}

impl DevMem for DevBuf {
    fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `malloc_sync` in this context and is freed
        // once; the runtime synchronizes its streams before dropping buffers.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// A page-locked host buffer of `len` values of `T`.
#[derive(Debug)]
pub struct HostBuf<T: Copy + Default> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is uniquely owned host memory; the runtime that owns it
// is used by one thread at a time (the engine thread), and device access to
// it is ordered by the stream events the runtime waits on.
unsafe impl<T: Copy + Default + Send> Send for HostBuf<T> {}

impl<T: Copy + Default> HostBuf<T> {
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, DriverError> {
        ctx.bind_to_thread()?;
        let bytes = (len.max(1)) * std::mem::size_of::<T>();
        // SAFETY: the context is current; flags 0 = portable-less, not
        // write-combined page-locked memory, which is read back by the CPU.
        let ptr = unsafe { result::malloc_host(bytes, 0) }? as *mut T;
        // Initialize so safe slices over it are never uninitialized memory.
        for i in 0..len.max(1) {
            // SAFETY: `i` is within the allocation of len.max(1) elements.
            unsafe { ptr.add(i).write(T::default()) };
        }
        Ok(HostBuf {
            ptr,
            len,
            ctx: Arc::clone(ctx),
        })
    }
}

impl<T: Plain> HostMem<T> for HostBuf<T> {
    /// The host values. Callers only touch a slot's buffers while the slot
    /// is idle or after its copy-done event (I6), so no DMA is in flight.
    fn as_slice(&self) -> &[T] {
        // SAFETY: `ptr` points to `len` initialized values owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above, and `&mut self` makes this the only host borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: Copy + Default> Drop for HostBuf<T> {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `malloc_host` and is freed once, after the
        // runtime synchronized every stream that could copy into it.
        let _ = unsafe { result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}
