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
//! instruction stream on aligned data. The KV cache's arrays and the
//! forward pass's activation rows are `LineBuf`s for the same reason.

use std::ops::{Deref, DerefMut};

/// Elements per 64-byte line, for the element sizes a [`LineBuf`] holds.
const fn line_elems<T>() -> usize {
    64 / std::mem::size_of::<T>()
}

/// A buffer of `T` whose first element starts a 64-byte line (see the
/// module docs). It is a plain zeroed `Vec` one line longer than needed,
/// used from its first line boundary on: no `unsafe`, and the allocator's
/// zeroed pages (a large `vec![0; n]` is `calloc`) are only touched as
/// they are written, so a large buffer held for the worst case (the KV
/// cache, a long prompt's activations) costs address space, not resident
/// memory, until used. Grows with zeros, never shrinks its storage.
#[derive(Debug)]
pub(crate) struct LineBuf<T> {
    buf: Vec<T>,
    start: usize,
    len: usize,
}

impl<T: Copy + Default> Default for LineBuf<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Copy + Default> LineBuf<T> {
    /// An empty buffer (no allocation).
    pub(crate) const fn new() -> Self {
        Self {
            buf: Vec::new(),
            start: 0,
            len: 0,
        }
    }

    /// `len` zeros (`T::default()`).
    pub(crate) fn zeroed(len: usize) -> Self {
        let mut b = Self::new();
        b.resize(len);
        b
    }

    /// Make the buffer `len` elements long: the first `min(len, old len)`
    /// keep their values, the rest read as whatever the storage held
    /// (zeros where it grew).
    pub(crate) fn resize(&mut self, len: usize) {
        if self.start + len > self.buf.len() {
            let buf = vec![T::default(); len + line_elems::<T>()];
            let start = buf.as_ptr().align_offset(64);
            debug_assert!(start < line_elems::<T>());
            let old = std::mem::replace(&mut self.buf, buf);
            self.buf[start..start + self.len]
                .copy_from_slice(&old[self.start..self.start + self.len]);
            self.start = start;
        }
        self.len = len;
    }
}

impl<T> Deref for LineBuf<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl<T> DerefMut for LineBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.start..self.start + self.len]
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
        assert_eq!(&b[..], &[0.0; 5]);
        b[4] = 2.5;
        b.resize(1000);
        assert_eq!(b.as_ptr() as usize % 64, 0);
        assert_eq!(b.len(), 1000);
        assert_eq!(b[4], 2.5);
        assert!(b[5..].iter().all(|&v| v == 0.0));
        b.resize(3);
        assert_eq!(b.len(), 3);
        let big = LineBuf::<u8>::zeroed(1 << 22);
        assert_eq!(big.as_ptr() as usize % 64, 0);
        assert!(big.iter().all(|&v| v == 0));
    }
}
