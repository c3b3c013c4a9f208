//! [`PageTable`]: batch rows (row 0 reserved), each a list of pages from one [`BlockPool`].
//!
//! Invariants: a page's refcount equals the number of rows listing it; a row's first
//! `sealed` pages are full, hashed and immutable (shared prefix hits, pages shared from a
//! fork's parent, or pages it published); no row writes into a page another row shares;
//! `num_allocated` counts rows in use, zombies included. Capacity questions are O(1), growth
//! and erase O(pages touched), a prefix lookup O(prompt tokens), `write_indices` O(pages out).

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

    /// Allocates a row and shares the longest cached prefix of `prompt`: full pages only,
    /// always leaving at least one prompt token uncached so prefill produces logits.
    /// Returns `(row, hit_tokens)`; the engine prefills `prompt[hit_tokens..]`.
    /// O(hit pages) hashing; with prefix caching off, `hit_tokens` is 0.
    ///
    /// # Errors
    /// [`KvError::NoFreeRow`]; nothing is taken then.
    pub fn allocate_with_prefix(&mut self, prompt: &[u32]) -> Result<(RowId, usize), KvError> {
        let row = self.allocate()?;
        let Some(prefix) = &self.prefix else {
            return Ok((row, 0));
        };
        let ps = self.cfg.page_size;
        let r = &mut self.rows[row as usize];
        let mut chain = ROOT_HASH;
        for page_tokens in prompt[..prompt.len().saturating_sub(1)].chunks_exact(ps) {
            let (hash, Some(page)) = prefix.lookup(chain, page_tokens) else {
                break;
            };
            self.pool.retain(page);
            r.pages.push(page);
            chain = hash;
        }
        r.sealed = r.pages.len();
        r.chain = chain;
        Ok((row, r.sealed * ps))
    }

    /// Admits a new sequence: [`allocate_with_prefix`](Self::allocate_with_prefix), then
    /// [`reserve`](Self::reserve) pages for `target_len` tokens; all or nothing (a failed
    /// reservation gives the row and its shared prefix pages back). Exactly what
    /// [`can_reserve_prompt`](Self::can_reserve_prompt) predicts. Returns
    /// `(row, hit_tokens)`.
    ///
    /// # Errors
    /// [`KvError::NoFreeRow`], or the reservation's error; nothing is taken then.
    pub fn admit(&mut self, prompt: &[u32], target_len: usize) -> Result<(RowId, usize), KvError> {
        let (row, hit) = self.allocate_with_prefix(prompt)?;
        if let Err(e) = self.reserve(row, target_len) {
            let erased = self.erase(row);
            debug_assert!(erased.is_ok(), "the row was just allocated");
            return Err(e);
        }
        Ok((row, hit))
    }

    /// Admits a fork of `parent`, a sequence whose first `parent_len` tokens have their KV
    /// written (or written by a step already launched) and whose prompt starts with them: the
    /// new row shares, by reference count, the parent's full pages covering at most
    /// `prompt.len() - 1` of those tokens (one prompt token is always left to compute, so
    /// the fork's prefill yields its own logits), then [`reserve`](Self::reserve)s pages for
    /// `target_len` tokens. The shared pages are sealed in the new row (never written,
    /// never cut by [`shrink`](Self::shrink)); the parent's last partial page is not shared:
    /// the fork computes those tokens into a page of its own. Works with the prefix cache
    /// off. All or nothing. Returns `(row, shared_tokens)`; O(shared pages).
    ///
    /// # Errors
    /// [`KvError::UnknownRow`] for `parent`, [`KvError::NoFreeRow`], or the reservation's
    /// error; nothing is taken then.
    pub fn admit_fork(
        &mut self,
        parent: RowId,
        parent_len: usize,
        prompt: &[u32],
        target_len: usize,
    ) -> Result<(RowId, usize), KvError> {
        let ps = self.cfg.page_size;
        let shared = (parent_len.min(prompt.len().saturating_sub(1)) / ps)
            .min(self.row(parent)?.pages.len());
        let row = self.allocate()?;
        let mut chain = ROOT_HASH;
        for i in 0..shared {
            let page = self.rows[parent as usize].pages[i];
            self.pool.retain(page);
            self.rows[row as usize].pages.push(page);
            if let Some(prefix) = &self.prefix {
                chain = prefix.lookup(chain, &prompt[i * ps..(i + 1) * ps]).0;
            }
        }
        let r = &mut self.rows[row as usize];
        r.sealed = shared;
        r.chain = chain;
        if let Err(e) = self.reserve(row, target_len) {
            let erased = self.erase(row);
            debug_assert!(erased.is_ok(), "the row was just allocated");
            return Err(e);
        }
        Ok((row, shared * ps))
    }

    /// Tokens of `prompt` that [`allocate_with_prefix`](Self::allocate_with_prefix) would
    /// reuse now, without taking anything. O(hit pages).
    pub fn peek_prefix(&self, prompt: &[u32]) -> usize {
        self.walk_prefix(prompt).0 * self.cfg.page_size
    }

    /// `(hit pages, hit pages now cached rather than in use)` for `prompt`.
    fn walk_prefix(&self, prompt: &[u32]) -> (usize, usize) {
        let Some(prefix) = &self.prefix else {
            return (0, 0);
        };
        let (mut chain, mut hits, mut cached) = (ROOT_HASH, 0, 0);
        for page_tokens in prompt[..prompt.len().saturating_sub(1)].chunks_exact(self.cfg.page_size)
        {
            let (hash, Some(page)) = prefix.lookup(chain, page_tokens) else {
                break;
            };
            chain = hash;
            hits += 1;
            cached += usize::from(self.pool.refcount(page) == 0);
        }
        (hits, cached)
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

    /// [`can_reserve`](Self::can_reserve) counting the cached prefix of `prompt`: hit pages
    /// need no allocation, but a cached hit stops being evictable once shared. Exact for
    /// `allocate_with_prefix(prompt)` then `reserve(row, target_len)`. O(prompt tokens).
    pub fn can_reserve_prompt(&self, prompt: &[u32], target_len: usize) -> bool {
        if self.free_rows.is_empty() {
            return false;
        }
        let (hits, cached_hits) = self.walk_prefix(prompt);
        self.pages_for(target_len).saturating_sub(hits) <= self.pool.available() - cached_hits
    }

    /// Whether `target_len` tokens could ever fit, in an empty table. O(1).
    pub fn could_ever_fit(&self, target_len: usize) -> bool {
        self.pages_for(target_len) <= self.cfg.num_pages
    }

    /// After prefill (or any step), publishes the row's full pages covering `tokens` (the
    /// row's tokens from position 0, all with KV computed) into the prefix cache.
    /// Incremental: pages sealed earlier are skipped, so calling it after every step costs
    /// O(new full pages). A page whose content another row already published stays
    /// private. No-op with prefix caching off or for an unknown row.
    pub fn register_prefix(&mut self, row: RowId, tokens: &[u32]) {
        debug_assert!(
            self.is_allocated(row),
            "register_prefix on unknown row {row}"
        );
        let ps = self.cfg.page_size;
        let (Some(prefix), Some(r)) = (&mut self.prefix, self.rows.get_mut(row as usize)) else {
            return;
        };
        if row == 0 || !r.in_use {
            return;
        }
        let full = (tokens.len() / ps).min(r.pages.len());
        for i in r.sealed..full {
            let page_tokens = &tokens[i * ps..(i + 1) * ps];
            let (hash, hit) = prefix.lookup(r.chain, page_tokens);
            if hit.is_none() && prefix.insert(r.pages[i], r.chain, hash, page_tokens) {
                self.pool.publish(r.pages[i]);
            }
            r.chain = hash;
            r.sealed = i + 1;
        }
    }

    /// Leading pages of `row` that are sealed: full, hashed, immutable (prefix hits and
    /// published pages). 0 for an unknown row.
    pub fn sealed_pages(&self, row: RowId) -> usize {
        self.row(row).map_or(0, |r| r.sealed)
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

    /// Audits every invariant: refcounts equal row references, each page in exactly
    /// one of free / used / cached, the LRU holds exactly the unreferenced published
    /// pages, the prefix index files exactly the published pages, row counts agree.
    /// O(rows + pages): for tests and debug builds, not the hot path.
    ///
    /// # Errors
    /// [`KvError::InvariantViolated`] naming the first broken invariant.
    pub fn check_invariants(&self) -> Result<(), KvError> {
        let bad = |page: Option<PageId>, what| Err(KvError::InvariantViolated { page, what });
        let n = self.cfg.num_pages;
        let mut refs = vec![0u32; n];
        let mut in_use_rows = 0;
        for (id, r) in self.rows.iter().enumerate() {
            if !r.in_use {
                if !r.pages.is_empty() || r.sealed != 0 {
                    return bad(None, "vacant row holds pages");
                }
                continue;
            }
            if id == 0 {
                return bad(None, "reserved row 0 is in use");
            }
            in_use_rows += 1;
            if r.sealed > r.pages.len() {
                return bad(None, "row sealed more pages than it holds");
            }
            for &p in &r.pages {
                refs[p as usize] += 1;
            }
        }
        if in_use_rows != self.num_allocated
            || in_use_rows + self.free_rows.len() != self.usable_rows()
        {
            return bad(None, "num_allocated disagrees with the rows in use");
        }
        let mut seen = vec![false; n];
        for &p in self.pool.free_pages() {
            if std::mem::replace(&mut seen[p as usize], true)
                || refs[p as usize] != 0
                || self.pool.is_published(p)
            {
                return bad(Some(p), "free page is duplicated, referenced or published");
            }
        }
        for p in self.pool.lru_iter() {
            if std::mem::replace(&mut seen[p as usize], true)
                || refs[p as usize] != 0
                || !self.pool.is_published(p)
            {
                return bad(
                    Some(p),
                    "cached page is duplicated, referenced or unpublished",
                );
            }
        }
        let mut used = 0;
        for (p, &count) in refs.iter().enumerate() {
            let page = p as PageId;
            if self.pool.refcount(page) != count {
                return bad(
                    Some(page),
                    "refcount differs from the rows listing the page",
                );
            }
            if count > 0 {
                used += 1;
                if seen[p] {
                    return bad(Some(page), "referenced page is also free or cached");
                }
            } else if !seen[p] {
                return bad(Some(page), "page is in none of free / used / cached");
            }
            let filed = self.prefix.as_ref().is_some_and(|x| x.is_filed(page));
            if self.pool.is_published(page) != filed {
                return bad(Some(page), "published flag disagrees with the prefix index");
            }
        }
        let published = (0..n as PageId)
            .filter(|&p| self.pool.is_published(p))
            .count();
        if self.prefix.as_ref().map_or(0, PrefixIndex::len) != published {
            return bad(None, "prefix index files pages that are not published");
        }
        if used != self.pool.used_count()
            || self.pool.free_count() + self.pool.used_count() + self.pool.cached_count() != n
            || self.pool.lru_iter().count() != self.pool.cached_count()
        {
            return bad(None, "free + used + cached != total");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(max_rows: usize, num_pages: usize, page_size: usize) -> PageTable {
        PageTable::new(PageTableConfig {
            max_rows,
            num_pages,
            page_size,
            enable_prefix_cache: true,
        })
        .unwrap()
    }

    /// `admit` is all or nothing and agrees with `can_reserve_prompt`, with
    /// a prefix hit and when the reservation cannot be met.
    #[test]
    fn admit_is_all_or_nothing() {
        let mut t = table(4, 6, 4);
        let prompt: Vec<u32> = (0..9).collect();
        let (a, hit) = t.admit(&prompt, 12).unwrap();
        assert_eq!((hit, t.pages(a).len()), (0, 3));
        t.register_prefix(a, &prompt);
        // Two full pages are shared; the third prompt page and growth are new.
        assert!(t.can_reserve_prompt(&prompt, 12));
        let (b, hit) = t.admit(&prompt, 12).unwrap();
        assert_eq!((hit, t.pages(b).len()), (8, 3));
        assert_eq!(t.used_pages(), 4);
        // Too long for what is left: nothing taken, shared refcounts restored.
        let before = (t.num_allocated(), t.used_pages(), t.refcount(t.pages(a)[0]));
        assert!(!t.can_reserve_prompt(&prompt, 40));
        assert!(t.admit(&prompt, 40).is_err());
        assert_eq!(
            before,
            (t.num_allocated(), t.used_pages(), t.refcount(t.pages(a)[0]))
        );
        t.check_invariants().unwrap();
    }

    #[test]
    fn config_is_validated() {
        let ok = PageTableConfig {
            max_rows: 2,
            num_pages: 1,
            page_size: 1,
            enable_prefix_cache: false,
        };
        assert!(PageTable::new(ok).is_ok());
        for (cfg, field) in [
            (PageTableConfig { max_rows: 1, ..ok }, "max_rows"),
            (PageTableConfig { num_pages: 0, ..ok }, "num_pages"),
            (PageTableConfig { page_size: 0, ..ok }, "page_size"),
        ] {
            assert!(
                matches!(PageTable::new(cfg), Err(KvError::InvalidConfig { field: f, .. }) if f == field)
            );
        }
    }

    #[test]
    fn rows_skip_zero_and_run_out() {
        let mut t = table(3, 4, 4);
        assert_eq!(t.allocate(), Ok(1));
        assert_eq!(t.allocate(), Ok(2));
        assert_eq!(t.allocate(), Err(KvError::NoFreeRow { usable_rows: 2 }));
        assert_eq!(t.erase(0), Err(KvError::UnknownRow(0)));
        assert_eq!(t.num_allocated(), 2);
        t.erase(1).unwrap();
        assert_eq!(t.erase(1), Err(KvError::UnknownRow(1)));
        assert_eq!(t.num_allocated(), 1);
        t.check_invariants().unwrap();
    }

    #[test]
    fn reserve_is_all_or_nothing() {
        let mut t = table(3, 4, 4);
        let r = t.allocate().unwrap();
        t.reserve(r, 9).unwrap();
        assert_eq!(t.pages(r), [0, 1, 2]);
        t.reserve(r, 5).unwrap(); // never shrinks
        assert_eq!(t.pages(r).len(), 3);
        assert!(t.can_grow(r, 16) && !t.can_grow(r, 17));
        assert_eq!(
            t.reserve(r, 17),
            Err(KvError::OutOfPages {
                needed: 2,
                available: 1
            })
        );
        assert_eq!(t.pages(r).len(), 3);
        assert!(t.can_reserve(4) && !t.can_reserve(5));
        t.check_invariants().unwrap();
    }

    #[test]
    fn prefix_is_shared_then_cached_then_evicted_lru() {
        let mut t = table(4, 4, 2);
        let prompt = [1, 2, 3, 4, 5];
        let (a, hit) = t.allocate_with_prefix(&prompt).unwrap();
        assert_eq!(hit, 0);
        t.reserve(a, prompt.len()).unwrap();
        t.register_prefix(a, &prompt);
        assert_eq!(t.sealed_pages(a), 2);
        // Only full pages, and never the whole prompt.
        assert_eq!(t.peek_prefix(&prompt), 4);
        assert_eq!(t.peek_prefix(&[1, 2, 3, 4]), 2);
        let (b, hit) = t.allocate_with_prefix(&prompt).unwrap();
        assert_eq!(hit, 4);
        assert_eq!(t.pages(b), &t.pages(a)[..2]);
        assert_eq!(t.refcount(t.pages(a)[0]), 2);
        t.check_invariants().unwrap();
        t.erase(a).unwrap();
        t.erase(b).unwrap();
        assert_eq!(
            (t.free_pages(), t.used_pages(), t.cached_pages()),
            (2, 0, 2)
        );
        // Eviction only when the free list is empty; the deeper page goes first.
        let c = t.allocate().unwrap();
        t.reserve(c, 6).unwrap();
        assert_eq!(t.cached_pages(), 1);
        assert_eq!(t.peek_prefix(&prompt), 2);
        t.check_invariants().unwrap();
        t.release_all();
        assert_eq!((t.free_pages(), t.num_allocated(), t.epoch()), (4, 0, 1));
        assert_eq!(t.peek_prefix(&prompt), 0);
        t.check_invariants().unwrap();
    }

    #[test]
    fn shrink_refuses_to_cut_sealed_pages() {
        let mut t = table(2, 4, 2);
        let r = t.allocate().unwrap();
        t.reserve(r, 8).unwrap();
        t.register_prefix(r, &[1, 2, 3]);
        assert_eq!(
            t.shrink(r, 1),
            Err(KvError::ShrinkBelowPublished {
                row: r,
                len: 1,
                published_tokens: 2
            })
        );
        assert_eq!(t.shrink(r, 3), Ok(2));
        assert_eq!(t.pages(r), [0, 1]);
        t.check_invariants().unwrap();
    }

    #[test]
    fn write_indices_matches_flashinfer_layout() {
        let mut t = table(4, 8, 4);
        let a = t.allocate().unwrap();
        let b = t.allocate().unwrap();
        t.reserve(a, 9).unwrap();
        t.reserve(b, 4).unwrap();
        let mut out = PagedIndices::default();
        t.write_indices(&[(a, 9), (b, 4), (b, 0)], &mut out)
            .unwrap();
        assert_eq!(out.kv_indptr, [0, 3, 4, 4]);
        assert_eq!(out.kv_indices, [0, 1, 2, 3]);
        assert_eq!(out.kv_last_page_len, [1, 4, 0]);
        assert_eq!(
            t.write_indices(&[(b, 5)], &mut out),
            Err(KvError::KvLenExceedsReserved {
                row: b,
                kv_len: 5,
                reserved_tokens: 4
            })
        );
        assert_eq!(
            t.write_indices(&[(3, 1)], &mut out),
            Err(KvError::UnknownRow(3))
        );
    }
}
