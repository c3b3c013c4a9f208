//! [`PageTable`]: batch rows (row 0 reserved), each a list of pages from one [`BlockPool`].
//!
//! Invariants: a page's refcount equals the number of rows listing it; a row's first
//! `sealed` pages are full, hashed and immutable (shared prefix hits, pages shared from a
//! fork's parent, or pages it published); no row writes into a page another row shares;
//! `num_allocated` counts rows in use, zombies included. Capacity questions are O(1), growth
//! and erase O(pages touched), a prefix lookup O(prompt tokens), `write_indices` O(pages out).
//!
//! This file holds the rows and their pages (allocate, reserve, shrink, erase, counts);
//! `sharing.rs` admission with shared pages (prefix-cache hits, forks) and publishing,
//! `indices.rs` the kernel's page layout, `audit.rs` the invariant check.

mod audit;
mod indices;
mod sharing;
#[cfg(test)]
mod tests;

pub use indices::PagedIndices;

use crate::pool::BlockPool;
use crate::prefix::{PrefixIndex, ROOT_HASH};
use crate::{KvError, PageId, RowId};

/// Shape of a [`PageTable`]; validated once by [`PageTable::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageTableConfig {
    /// Batch rows, including the reserved row 0: at most `max_rows - 1` sequences at once.
    pub max_rows: usize,
    /// Pages in the pool. A runtime sizes its KV memory as `num_pages * page_size` tokens.
    pub num_pages: usize,
    /// Tokens per page (16 is typical).
    pub page_size: usize,
    /// Publish full pages and reuse them across requests.
    pub enable_prefix_cache: bool,
}

/// One batch row.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Row {
    in_use: bool,
    pages: Vec<PageId>,
    /// Leading pages whose content is final and hashed (shared hits or published).
    sealed: usize,
    /// Chain hash of page `sealed - 1`, or `ROOT_HASH` when `sealed == 0`.
    chain: u64,
}

impl Row {
    const fn vacant() -> Self {
        Self {
            in_use: false,
            pages: Vec::new(),
            sealed: 0,
            chain: ROOT_HASH,
        }
    }
}

/// KV-cache bookkeeping: which pages each batch row holds, which are shared or cached.
///
/// The runtimes own the memory: page `p` lives at token offset `p * page_size` in their
/// KV buffers. This type only decides which `p`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageTable {
    cfg: PageTableConfig,
    rows: Vec<Row>,
    /// Unallocated rows; popped LIFO, so row 1 comes out first.
    free_rows: Vec<RowId>,
    num_allocated: usize,
    pool: BlockPool,
    prefix: Option<PrefixIndex>,
    /// Bumped by `release_all`: row ids handed out before it are void.
    epoch: u64,
}

fn pages_for(tokens: usize, page_size: usize) -> usize {
    tokens.div_ceil(page_size)
}

impl PageTable {
    /// Validates `cfg` and builds an empty table: every row and page free.
    ///
    /// # Errors
    /// [`KvError::InvalidConfig`] when `max_rows < 2` (row 0 is reserved), `num_pages` or
    /// `page_size` is 0, or a page/row id would not fit in `u32`.
    pub fn new(cfg: PageTableConfig) -> Result<Self, KvError> {
        let limit = u32::MAX as usize;
        let checks = [
            (
                "max_rows",
                cfg.max_rows,
                (2..=limit).contains(&cfg.max_rows),
                "2..=u32::MAX; row 0 is reserved",
            ),
            (
                "num_pages",
                cfg.num_pages,
                (1..limit).contains(&cfg.num_pages),
                "1..u32::MAX",
            ),
            (
                "page_size",
                cfg.page_size,
                (1..=limit).contains(&cfg.page_size),
                "1..=u32::MAX",
            ),
        ];
        if let Some(&(field, value, _, requirement)) = checks.iter().find(|c| !c.2) {
            return Err(KvError::InvalidConfig {
                field,
                value,
                requirement,
            });
        }
        Ok(Self {
            cfg,
            rows: vec![Row::vacant(); cfg.max_rows],
            free_rows: (1..cfg.max_rows as RowId).rev().collect(),
            num_allocated: 0,
            pool: BlockPool::new(cfg.num_pages),
            prefix: cfg
                .enable_prefix_cache
                .then(|| PrefixIndex::new(cfg.num_pages, cfg.page_size)),
            epoch: 0,
        })
    }

    /// The validated configuration.
    pub fn config(&self) -> &PageTableConfig {
        &self.cfg
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.cfg.page_size
    }

    /// Rows including the reserved row 0.
    pub fn max_rows(&self) -> usize {
        self.cfg.max_rows
    }

    /// Rows a caller can hold at once: `max_rows - 1`.
    pub fn usable_rows(&self) -> usize {
        self.cfg.max_rows - 1
    }

    /// Pages in the pool.
    pub fn num_pages(&self) -> usize {
        self.cfg.num_pages
    }

    /// Incremented by every [`release_all`](Self::release_all); a lease taken in an
    /// earlier epoch refers to nothing.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        pages_for(tokens, self.cfg.page_size)
    }

    fn row(&self, row: RowId) -> Result<&Row, KvError> {
        match self.rows.get(row as usize) {
            Some(r) if row != 0 && r.in_use => Ok(r),
            _ => Err(KvError::UnknownRow(row)),
        }
    }

    /// Whether `row` is allocated.
    pub fn is_allocated(&self, row: RowId) -> bool {
        self.row(row).is_ok()
    }

    /// Takes a free row (never row 0) with no pages. O(1).
    ///
    /// # Errors
    /// [`KvError::NoFreeRow`] when all `max_rows - 1` usable rows are in use.
    pub fn allocate(&mut self) -> Result<RowId, KvError> {
        let row = self.free_rows.pop().ok_or(KvError::NoFreeRow {
            usable_rows: self.usable_rows(),
        })?;
        self.rows[row as usize].in_use = true;
        self.num_allocated += 1;
        Ok(row)
    }

    /// Pages `row` would have to gain to hold `target_len` tokens. O(1).
    ///
    /// # Errors
    /// [`KvError::UnknownRow`].
    pub fn pages_needed(&self, row: RowId, target_len: usize) -> Result<usize, KvError> {
        let have = self.row(row)?.pages.len();
        Ok(self.pages_for(target_len).saturating_sub(have))
    }

    /// Whether `row` could grow to `target_len` tokens now (evicting if need be). O(1).
    pub fn can_grow(&self, row: RowId, target_len: usize) -> bool {
        self.pages_needed(row, target_len)
            .is_ok_and(|need| need <= self.pool.available())
    }

    /// Grows `row` so it holds `target_len` tokens, evicting least recently used
    /// unreferenced cached pages if the free list runs dry. Never shrinks.
    /// All or nothing; O(pages added).
    ///
    /// # Errors
    /// [`KvError::UnknownRow`]; [`KvError::OutOfPages`] when free + evictable pages
    /// do not cover the growth (nothing is allocated then).
    pub fn reserve(&mut self, row: RowId, target_len: usize) -> Result<(), KvError> {
        let needed = self.pages_needed(row, target_len)?;
        let available = self.pool.available();
        if needed > available {
            return Err(KvError::OutOfPages { needed, available });
        }
        let r = &mut self.rows[row as usize];
        r.pages.reserve(needed);
        for _ in 0..needed {
            let Some(allocated) = self.pool.alloc() else {
                return Err(KvError::InvariantViolated {
                    page: None,
                    what: "pool ran dry below its reported availability",
                });
            };
            if allocated.evicted {
                if let Some(prefix) = &mut self.prefix {
                    prefix.remove(allocated.page);
                }
            }
            r.pages.push(allocated.page);
        }
        Ok(())
    }

    /// Whether a new row could be allocated and grown to `target_len` tokens now:
    /// a free row and enough free + evictable pages. O(1). Prefix hits only lower
    /// the real need, so a `true` here is never wrong.
    pub fn can_reserve(&self, target_len: usize) -> bool {
        !self.free_rows.is_empty() && self.pages_for(target_len) <= self.pool.available()
    }

    /// Whether `target_len` tokens could ever fit, in an empty table. O(1).
    pub fn could_ever_fit(&self, target_len: usize) -> bool {
        self.pages_for(target_len) <= self.cfg.num_pages
    }

    /// Releases `row`'s pages beyond those holding `len` tokens, last page first, and
    /// returns how many it released. O(pages released).
    ///
    /// # Errors
    /// [`KvError::UnknownRow`]; [`KvError::ShrinkBelowPublished`] when `len` cuts into the
    /// row's sealed pages (their content must not be overwritten);
    /// [`KvError::ShrinkIntoShared`] when position `len` (the next one written) falls in a
    /// page another row shares.
    pub fn shrink(&mut self, row: RowId, len: usize) -> Result<usize, KvError> {
        let ps = self.cfg.page_size;
        let keep = self.pages_for(len);
        self.row(row)?;
        let r = &mut self.rows[row as usize];
        if len < r.sealed * ps {
            return Err(KvError::ShrinkBelowPublished {
                row,
                len,
                published_tokens: r.sealed * ps,
            });
        }
        // The next write lands at `len`: inside a kept page only when `len`
        // is not page-aligned, and that page must be this row's alone.
        if let Some(&page) = r.pages.get(len / ps).filter(|_| !len.is_multiple_of(ps)) {
            if self.pool.refcount(page) > 1 {
                return Err(KvError::ShrinkIntoShared { row, len, page });
            }
        }
        let released = r.pages.len().saturating_sub(keep);
        for _ in 0..released {
            if let Some(page) = r.pages.pop() {
                self.pool.release(page);
            }
        }
        Ok(released)
    }

    /// Returns `row` and drops its page references. Published pages with no other
    /// reference stay cached (evictable); the deepest pages are released first so they
    /// are evicted first. O(pages of the row).
    ///
    /// # Errors
    /// [`KvError::UnknownRow`].
    pub fn erase(&mut self, row: RowId) -> Result<(), KvError> {
        self.row(row)?;
        let r = &mut self.rows[row as usize];
        for &page in r.pages.iter().rev() {
            self.pool.release(page);
        }
        r.pages.clear();
        r.sealed = 0;
        r.chain = ROOT_HASH;
        r.in_use = false;
        self.free_rows.push(row);
        self.num_allocated -= 1;
        Ok(())
    }

    /// Every row and page back, prefix cache cleared: the engine-fatal path. Bumps
    /// [`epoch`](Self::epoch) so stale leases can be recognised. O(rows + pages).
    pub fn release_all(&mut self) {
        for r in &mut self.rows {
            r.in_use = false;
            r.pages.clear(); // keeps capacity for the next occupant
            r.sealed = 0;
            r.chain = ROOT_HASH;
        }
        self.free_rows.clear();
        self.free_rows.extend((1..self.cfg.max_rows as RowId).rev());
        self.num_allocated = 0;
        self.pool.reset();
        if let Some(prefix) = &mut self.prefix {
            prefix.clear();
        }
        self.epoch += 1;
    }

    /// Rows in use, zombies included. The capacity check is
    /// `num_allocated() < usable_rows()`, never a count of running sequences.
    pub fn num_allocated(&self) -> usize {
        self.num_allocated
    }

    /// `row`'s pages in token order; empty for an unknown row.
    pub fn pages(&self, row: RowId) -> &[PageId] {
        self.row(row).map_or(&[], |r| &r.pages)
    }

    /// Pages with no reference and no cached content.
    pub fn free_pages(&self) -> usize {
        self.pool.free_count()
    }

    /// Pages referenced by at least one row (a shared page counts once).
    pub fn used_pages(&self) -> usize {
        self.pool.used_count()
    }

    /// Unreferenced pages kept for prefix reuse; evicted LRU when needed.
    pub fn cached_pages(&self) -> usize {
        self.pool.cached_count()
    }

    /// Pages an allocation can obtain now: free plus evictable cached.
    pub fn available_pages(&self) -> usize {
        self.pool.available()
    }

    /// Rows referencing `page`.
    pub fn refcount(&self, page: PageId) -> u32 {
        self.pool.refcount(page)
    }
}
