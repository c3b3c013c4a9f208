//! [`PageTable::check_invariants`]: the O(rows + pages) audit of every page-table
//! invariant (refcounts, free / used / cached, LRU, prefix index, row counts), run by
//! the tests and proptests after every operation, never on the hot path.

use super::PageTable;
use crate::prefix::PrefixIndex;
use crate::{KvError, PageId};

impl PageTable {
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
