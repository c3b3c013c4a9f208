//! Where the weights' bytes live: copied out of the file's mapping into one
//! anonymous mapping advised for transparent huge pages
//! ([`WeightPages::Huge`], the default), or left where they are
//! ([`WeightPages::InPlace`]: a loaded GGUF's file mapping, or memory the
//! caller placed them in before, as the bench does once for the several
//! runtimes it builds on one model). Either way they stay in their file
//! encoding, byte for byte (`kernels::weight`).
//!
//! Why: a decode step streams every weight once, so the kernels walk the
//! weights page after page. On 4 KiB pages every page costs a TLB miss, and
//! under a hypervisor each miss a two-level page walk. On a 2-vCPU KVM Xeon
//! (2026-12-02) a 1 GiB two-thread read ran at 18-20 GB/s on 4 KiB pages and
//! 28-30 GB/s on 2 MiB ones, and the `gemv_dram` bench's one-row GEMVs at
//! 14-16.5 GiB/s against 16.6-19.7 (`docs/bench/notes/2026-12-02-huge-pages.md`). A file's mapping cannot take huge pages (the page cache is
//! in 4 KiB pages), so the bytes are copied once at load.
//!
//! What it costs: the copy (a read of the file, as the first decode step
//! would do anyway), and processes that load the same file no longer share
//! its page cache: `InPlace` keeps that sharing. Where the kernel has no
//! transparent huge pages (or they are off) the copy still runs, on 4 KiB
//! pages, and reads as fast as the mapping did.

use std::sync::Arc;

use kestrel_model::{Bytes, ModelWeights};
use memmap2::MmapOptions;

use crate::CpuError;

/// Where [`crate::CpuModel::new`] keeps the weights' bytes (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightPages {
    /// Copied into anonymous memory on transparent huge pages (faster
    /// streaming; one copy per process).
    #[default]
    Huge,
    /// Read where they are: for a loaded GGUF the file's mapping (4 KiB
    /// pages, shared with every process that maps the file).
    InPlace,
}

/// A transparent huge page (x86-64's and most Linux kernels' PMD size).
const HUGE_PAGE: usize = 2 << 20;

/// Each buffer starts on a cache line in the copy.
const ALIGN: usize = 64;

impl WeightPages {
    /// Put every matrix of `w` where `self` says (for
    /// [`WeightPages::InPlace`] nothing moves; a tied head is the
    /// embedding, placed once). [`crate::CpuModel::new`] places its
    /// weights so.
    pub fn place_model(self, w: &mut ModelWeights) -> Result<(), CpuError> {
        let tied = w.config.tie_word_embeddings;
        let mut all: Vec<&mut Bytes> = vec![&mut w.token_embd.data];
        for l in &mut w.layers {
            all.extend(
                [
                    &mut l.wq,
                    &mut l.wk,
                    &mut l.wv,
                    &mut l.wo,
                    &mut l.w_up,
                    &mut l.w_down,
                ]
                .map(|m| &mut m.data),
            );
            all.extend(l.w_gate.as_mut().map(|m| &mut m.data));
        }
        if !tied {
            all.push(&mut w.lm_head.data);
        }
        self.place(&mut all)?;
        if tied {
            w.lm_head.data = w.token_embd.data.clone();
        }
        Ok(())
    }

    /// Put `bytes` where `self` says (module doc); the kernel benches and
    /// the bench's read probe place theirs so.
    pub fn place(self, bytes: &mut [&mut Bytes]) -> Result<(), CpuError> {
        match self {
            WeightPages::Huge => place_on_huge_pages(bytes),
            WeightPages::InPlace => Ok(()),
        }
    }
}

/// Copy every buffer of `bytes` into one anonymous mapping advised for
/// huge pages (from a 2 MiB boundary on), each from a cache line on, and
/// point each at its copy. The bytes are unchanged; the old ones (the
/// file's mapping) are released as their last holders drop.
fn place_on_huge_pages(bytes: &mut [&mut Bytes]) -> Result<(), CpuError> {
    if bytes.is_empty() {
        return Ok(());
    }
    let mut total = 0usize;
    let offsets: Vec<usize> = bytes
        .iter()
        .map(|b| {
            let at = total.next_multiple_of(ALIGN);
            total = at + b.len();
            at
        })
        .collect();
    let mut map = MmapOptions::new()
        .len(total + HUGE_PAGE)
        .map_anon()
        .map_err(|e| CpuError::WeightMemory {
            bytes: total,
            source: e,
        })?;
    // The mapping's first 2 MiB boundary: huge pages cover aligned 2 MiB.
    let start = (map.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - map.as_ptr() as usize;
    // Best effort: a kernel without transparent huge pages refuses the
    // advice, and the copy lives on 4 KiB pages (module doc).
    #[cfg(target_os = "linux")]
    if let Err(e) = map.advise_range(memmap2::Advice::HugePage, start, total) {
        tracing::info!(error = %e, "weights stay on 4 KiB pages: no transparent huge pages");
    }
    for (b, &at) in bytes.iter().zip(&offsets) {
        map[start + at..start + at + b.len()].copy_from_slice(b);
    }
    let map = Arc::new(map.make_read_only().map_err(|e| CpuError::WeightMemory {
        bytes: total,
        source: e,
    })?);
    for (b, &at) in bytes.iter_mut().zip(&offsets) {
        **b = Bytes::Mapped {
            map: Arc::clone(&map),
            offset: start + at,
            len: b.len(),
        };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buffer(len: usize, fill: u8) -> Bytes {
        let data: Vec<u8> = (0..len).map(|i| fill.wrapping_add(i as u8)).collect();
        data.into()
    }

    #[test]
    fn placed_matrices_keep_their_bytes_on_aligned_lines() {
        let (mut a, mut b, mut c) = (buffer(3 * 34, 1), buffer(1000 * 34, 7), buffer(34, 200));
        let before: Vec<Vec<u8>> = [&a, &b, &c].iter().map(|b| b.to_vec()).collect();
        WeightPages::Huge
            .place(&mut [&mut a, &mut b, &mut c])
            .unwrap();
        for (b, want) in [&a, &b, &c].into_iter().zip(&before) {
            assert!(b.is_mapped());
            assert_eq!(&b[..], &want[..]);
            assert_eq!(b.as_ptr() as usize % ALIGN, 0);
        }
        // One mapping, from a huge-page boundary on.
        assert_eq!(a.as_ptr() as usize % HUGE_PAGE, 0);
    }
}
