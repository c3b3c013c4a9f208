//! [`LineBuf`]: a growable buffer of plain numbers whose storage starts on
//! a 64-byte cache line.
//!
//! The lane sweeps load whole vectors of their activation rows (64 bytes
//! for 16 lanes, 32 for 8) at offsets that are multiples of the vector,
//! so from line-aligned storage no load straddles two lines. A `Vec`'s
//! allocation is only 16-byte aligned (a large one sits 16 bytes into its
//! pages), and there every 64-byte load split across two lines: measured
//! on an Emerald Rapids Xeon (2026-11-29), the two-group Q4_K sweep against
//! activations 48 bytes into a line ran at 0.8x of a C replica of the same
//! instruction stream on aligned data.

use std::marker::PhantomData;

/// One cache line of storage.
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy)]
struct Line([u8; 64]);

/// Element types a [`LineBuf`] holds: plain numbers, valid for every bit
/// pattern (all zeros included), aligned to at most a line.
///
/// # Safety
/// Implementors must be `Copy` types without padding or invalid bit
/// patterns, with `align_of::<Self>() <= 64`.
pub(crate) unsafe trait LineElem: Copy {}
// SAFETY: primitive numbers: every bit pattern is a value, no padding,
// alignment at most 4.
unsafe impl LineElem for u8 {}
// SAFETY: as above.
unsafe impl LineElem for i32 {}
// SAFETY: as above.
unsafe impl LineElem for f32 {}

/// A growable buffer of `T` starting on a 64-byte line (see the module
/// docs). Grows with zeros, never shrinks its storage.
#[derive(Debug)]
pub(crate) struct LineBuf<T: LineElem> {
    lines: Vec<Line>,
    len: usize,
    elem: PhantomData<T>,
}

impl<T: LineElem> Default for LineBuf<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: LineElem> LineBuf<T> {
    /// An empty buffer (no allocation).
    pub(crate) const fn new() -> Self {
        Self {
            lines: Vec::new(),
            len: 0,
            elem: PhantomData,
        }
    }

    /// Make the buffer `len` elements long: the first `min(len, old len)`
    /// keep their values, the rest read as whatever the storage held
    /// (zeros where it grew).
    pub(crate) fn resize(&mut self, len: usize) {
        let bytes = len * std::mem::size_of::<T>();
        let lines = bytes.div_ceil(64);
        if self.lines.len() < lines {
            self.lines.resize(lines, Line([0; 64]));
        }
        self.len = len;
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn as_ptr(&self) -> *const T {
        self.lines.as_ptr().cast()
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut T {
        self.lines.as_mut_ptr().cast()
    }

    #[cfg(test)]
    fn as_slice(&self) -> &[T] {
        // SAFETY: `lines` holds at least `len * size_of::<T>()` initialized
        // bytes (`resize`), on a 64-byte boundary, which `T`'s alignment
        // divides; every bit pattern is a `T` (`LineElem`).
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_line_and_keeps_values_as_it_grows() {
        let mut b = LineBuf::<f32>::default();
        b.resize(5);
        assert_eq!(b.as_ptr() as usize % 64, 0);
        assert_eq!(b.as_slice(), &[0.0; 5]);
        b.as_mut_slice()[4] = 2.5;
        b.resize(1000);
        assert_eq!(b.as_ptr() as usize % 64, 0);
        assert_eq!(b.len(), 1000);
        assert_eq!(b.as_slice()[4], 2.5);
        assert!(b.as_slice()[5..].iter().all(|&v| v == 0.0));
        b.resize(3);
        assert_eq!(b.as_slice().len(), 3);
    }
}
