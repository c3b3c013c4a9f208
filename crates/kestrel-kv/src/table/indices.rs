//! [`PagedIndices`]: the FlashInfer page layout of a batch, and
//! [`PageTable::write_indices`], which fills it from the rows' page lists without
//! allocating once the buffer has grown to the batch's size. O(pages written).

use super::{pages_for, PageTable};
use crate::{KvError, RowId};

/// Per-row page lists in the layout a paged-attention kernel consumes (FlashInfer's plan).
///
/// For a batch `rows[i] = (row, kv_len)`: sequence `i`'s pages are
/// `kv_indices[kv_indptr[i]..kv_indptr[i + 1]]` and its last page holds
/// `kv_last_page_len[i]` tokens. [`PageTable::write_indices`] clears and refills the
/// vectors, so a buffer reused across steps stops allocating once it has grown.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PagedIndices {
    /// `n + 1` offsets into `kv_indices`, starting at 0.
    pub kv_indptr: Vec<u32>,
    /// Page ids of every sequence, concatenated.
    pub kv_indices: Vec<u32>,
    /// Tokens in each sequence's last page: `1..=page_size`, or 0 for `kv_len == 0`.
    pub kv_last_page_len: Vec<u32>,
}

impl PagedIndices {
    /// A buffer that can describe `rows` sequences over `pages` pages without growing.
    pub fn with_capacity(rows: usize, pages: usize) -> Self {
        Self {
            kv_indptr: Vec::with_capacity(rows + 1),
            kv_indices: Vec::with_capacity(pages),
            kv_last_page_len: Vec::with_capacity(rows),
        }
    }

    /// Empties the vectors, keeping their capacity.
    pub fn clear(&mut self) {
        self.kv_indptr.clear();
        self.kv_indices.clear();
        self.kv_last_page_len.clear();
    }

    /// Sequences described.
    pub fn len(&self) -> usize {
        self.kv_last_page_len.len()
    }

    /// Whether no sequence is described.
    pub fn is_empty(&self) -> bool {
        self.kv_last_page_len.is_empty()
    }
}

impl PageTable {
    /// Writes the FlashInfer page layout of `rows[i] = (row, kv_len)` into `out`
    /// (cleared first). Allocates nothing once `out` has grown to the batch's size.
    /// O(pages written). On error `out`'s contents are unspecified.
    ///
    /// # Errors
    /// [`KvError::UnknownRow`]; [`KvError::KvLenExceedsReserved`] when a row has too few
    /// pages for its `kv_len`; [`KvError::IndexOverflow`] past `u32::MAX` indices.
    pub fn write_indices(
        &self,
        rows: &[(RowId, usize)],
        out: &mut PagedIndices,
    ) -> Result<(), KvError> {
        let ps = self.cfg.page_size;
        out.clear();
        out.kv_indptr.push(0);
        for &(row, kv_len) in rows {
            let r = self.row(row)?;
            let reserved_tokens = r.pages.len() * ps;
            if kv_len > reserved_tokens {
                return Err(KvError::KvLenExceedsReserved {
                    row,
                    kv_len,
                    reserved_tokens,
                });
            }
            out.kv_indices
                .extend_from_slice(&r.pages[..pages_for(kv_len, ps)]);
            let end = out.kv_indices.len();
            out.kv_indptr
                .push(u32::try_from(end).map_err(|_| KvError::IndexOverflow { value: end })?);
            // page_size <= u32::MAX (validated), so the remainder fits.
            let last = if kv_len == 0 {
                0
            } else {
                (kv_len - 1) % ps + 1
            };
            out.kv_last_page_len.push(last as u32);
        }
        Ok(())
    }
}
