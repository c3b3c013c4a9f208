//! [`BlockPool`]: the fixed set of KV pages, refcounted, with O(1) allocate, share and free.
//!
//! Invariant: every page is in exactly one place: the free stack (refcount 0, no
//! published content), in use (refcount >= 1), or the LRU list of cached pages
//! (refcount 0, content published in the prefix cache, evictable), so
//! `free + used + cached == total`. Every operation is O(1): the LRU is an
//! intrusive doubly linked list threaded through the per-page metadata.

use crate::PageId;

/// End-of-list marker for the intrusive LRU list.
const NIL: PageId = PageId::MAX;

/// Per-page bookkeeping, kept together for cache locality.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PageMeta {
    /// Rows referencing the page.
    refcount: u32,
    /// The page's content is published in the prefix cache.
    published: bool,
    /// LRU neighbours; meaningful only while the page is cached.
    prev: PageId,
    next: PageId,
}

impl PageMeta {
    const EMPTY: Self = Self {
        refcount: 0,
        published: false,
        prev: NIL,
        next: NIL,
    };
}

/// A page handed out by [`BlockPool::alloc`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocated {
    /// The page, now with refcount 1.
    pub page: PageId,
    /// The page was taken from the cached LRU list: its prefix-cache entry
    /// must be dropped by the caller.
    pub evicted: bool,
}

/// A fixed pool of pages with refcounts and an LRU of unreferenced cached pages.
///
/// The pool knows *that* a page is published, not under which hash; the
/// prefix index ([`crate::prefix`]) owns the hashes and is told about evictions
/// through [`Allocated::evicted`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockPool {
    meta: Vec<PageMeta>,
    /// Pages with refcount 0 and nothing published; popped LIFO.
    free: Vec<PageId>,
    /// Least recently released cached page: evicted first.
    lru_head: PageId,
    /// Most recently released cached page.
    lru_tail: PageId,
    used: usize,
    cached: usize,
}

impl BlockPool {
    /// A pool of `num_pages` free pages. `num_pages` must be below `u32::MAX`
    /// (checked by [`crate::PageTableConfig`] validation).
    pub fn new(num_pages: usize) -> Self {
        let mut pool = Self {
            meta: vec![PageMeta::EMPTY; num_pages],
            free: Vec::with_capacity(num_pages),
            lru_head: NIL,
            lru_tail: NIL,
            used: 0,
            cached: 0,
        };
        pool.reset();
        pool
    }

    /// Every page back to free, nothing published, nothing cached.
    pub fn reset(&mut self) {
        self.meta.fill(PageMeta::EMPTY);
        self.free.clear();
        // Reverse so that pages come out in ascending order: easier to read in tests.
        self.free.extend((0..self.meta.len() as PageId).rev());
        self.lru_head = NIL;
        self.lru_tail = NIL;
        self.used = 0;
        self.cached = 0;
    }

    /// Total pages.
    pub fn total(&self) -> usize {
        self.meta.len()
    }

    /// Pages with refcount 0 and no cached content.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Pages referenced by at least one row.
    pub fn used_count(&self) -> usize {
        self.used
    }

    /// Unreferenced pages holding published content (evictable).
    pub fn cached_count(&self) -> usize {
        self.cached
    }

    /// Pages an allocation can obtain: free plus evictable.
    pub fn available(&self) -> usize {
        self.free.len() + self.cached
    }

    /// Rows referencing `page`.
    pub fn refcount(&self, page: PageId) -> u32 {
        self.meta[page as usize].refcount
    }

    /// Whether `page`'s content is published in the prefix cache.
    pub fn is_published(&self, page: PageId) -> bool {
        self.meta[page as usize].published
    }

    /// Takes a free page, or else evicts the least recently used cached page.
    /// The page comes back with refcount 1. O(1).
    pub fn alloc(&mut self) -> Option<Allocated> {
        let (page, evicted) = match self.free.pop() {
            Some(page) => (page, false),
            None if self.lru_head != NIL => {
                let page = self.lru_head;
                self.unlink(page);
                self.cached -= 1;
                self.meta[page as usize].published = false;
                (page, true)
            }
            None => return None,
        };
        let meta = &mut self.meta[page as usize];
        debug_assert_eq!(meta.refcount, 0, "allocated page {page} was referenced");
        meta.refcount = 1;
        self.used += 1;
        Some(Allocated { page, evicted })
    }

    /// Adds a reference to a page that is in use or cached (a prefix hit).
    /// A cached page leaves the LRU list. O(1).
    pub fn retain(&mut self, page: PageId) {
        let meta = self.meta[page as usize];
        if meta.refcount == 0 {
            debug_assert!(meta.published, "retain of free page {page}");
            self.unlink(page);
            self.cached -= 1;
            self.used += 1;
        }
        self.meta[page as usize].refcount += 1;
    }

    /// Drops a reference. At refcount 0 a published page becomes the most
    /// recently used cached page; any other page goes back to the free stack. O(1).
    pub fn release(&mut self, page: PageId) {
        let meta = &mut self.meta[page as usize];
        debug_assert!(meta.refcount > 0, "release of unreferenced page {page}");
        meta.refcount -= 1;
        if meta.refcount > 0 {
            return;
        }
        self.used -= 1;
        if meta.published {
            self.push_tail(page);
            self.cached += 1;
        } else {
            self.free.push(page);
        }
    }

    /// Marks a referenced page's content as published in the prefix cache:
    /// from now on it is cached, not freed, when its last reference goes.
    pub fn publish(&mut self, page: PageId) {
        let meta = &mut self.meta[page as usize];
        debug_assert!(meta.refcount > 0, "publish of unreferenced page {page}");
        meta.published = true;
    }

    /// The cached pages from least to most recently released (eviction order).
    pub fn lru_iter(&self) -> impl Iterator<Item = PageId> + '_ {
        let mut cursor = self.lru_head;
        std::iter::from_fn(move || {
            if cursor == NIL {
                return None;
            }
            let page = cursor;
            cursor = self.meta[page as usize].next;
            Some(page)
        })
    }

    /// The free stack, bottom first.
    pub fn free_pages(&self) -> &[PageId] {
        &self.free
    }

    fn unlink(&mut self, page: PageId) {
        let PageMeta { prev, next, .. } = self.meta[page as usize];
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.meta[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.meta[next as usize].prev = prev;
        }
        let meta = &mut self.meta[page as usize];
        meta.prev = NIL;
        meta.next = NIL;
    }

    fn push_tail(&mut self, page: PageId) {
        let tail = self.lru_tail;
        {
            let meta = &mut self.meta[page as usize];
            meta.prev = tail;
            meta.next = NIL;
        }
        if tail == NIL {
            self.lru_head = page;
        } else {
            self.meta[tail as usize].next = page;
        }
        self.lru_tail = page;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_hands_out_every_page_once_then_none() {
        let mut pool = BlockPool::new(3);
        let pages: Vec<_> = (0..3).map(|_| pool.alloc().unwrap().page).collect();
        assert_eq!(pages, [0, 1, 2]);
        assert_eq!(pool.alloc(), None);
        assert_eq!(
            (pool.free_count(), pool.used_count(), pool.cached_count()),
            (0, 3, 0)
        );
    }

    #[test]
    fn published_pages_are_cached_then_evicted_least_recent_first() {
        let mut pool = BlockPool::new(3);
        let a = pool.alloc().unwrap().page;
        let b = pool.alloc().unwrap().page;
        pool.publish(a);
        pool.publish(b);
        pool.release(b);
        pool.release(a);
        assert_eq!(pool.lru_iter().collect::<Vec<_>>(), [b, a]);
        assert_eq!(
            (pool.free_count(), pool.used_count(), pool.cached_count()),
            (1, 0, 2)
        );
        // The free page goes first, then eviction in LRU order.
        assert_eq!(
            pool.alloc().unwrap(),
            Allocated {
                page: 2,
                evicted: false
            }
        );
        assert_eq!(
            pool.alloc().unwrap(),
            Allocated {
                page: b,
                evicted: true
            }
        );
        assert!(!pool.is_published(b));
        // A hit on a cached page takes it off the LRU list.
        pool.retain(a);
        assert_eq!(pool.lru_iter().count(), 0);
        assert_eq!(pool.alloc(), None);
    }

    #[test]
    fn shared_page_is_released_by_its_last_reference() {
        let mut pool = BlockPool::new(1);
        let a = pool.alloc().unwrap().page;
        pool.retain(a);
        pool.release(a);
        assert_eq!(pool.refcount(a), 1);
        assert_eq!(pool.free_count(), 0);
        pool.release(a);
        assert_eq!(pool.free_count(), 1);
    }
}
