//! Pages shared between rows: admission that reuses the longest cached prefix of a
//! prompt or a fork parent's written prompt pages (sealed in the new row, all or
//! nothing), the capacity question that counts those hits, and publishing a row's full
//! pages into the prefix cache. A shared page is never written by a second row.

use super::PageTable;
use crate::prefix::ROOT_HASH;
use crate::{KvError, RowId};

impl PageTable {
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
}
