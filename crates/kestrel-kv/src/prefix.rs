//! Prefix index: published full pages keyed by a hash chained over their tokens.
//!
//! `hash(page i) = chain_hash(hash(page i-1), tokens of page i)`, so one hash names a page
//! *and* everything before it. A hit is verified against the page's stored tokens and parent
//! hash: a collision can cost a miss, never wrong KV. Memory: 4 bytes per token slot plus 16
//! per page, allocated only when prefix caching is on. Per page: one hash over `page_size`
//! tokens and one map probe.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::PageId;

/// The parent hash of a sequence's first page.
pub const ROOT_HASH: u64 = 0x6b65_7374_7265_6c00;

const P0: u64 = 0xa076_1d64_78bd_642f;
const P1: u64 = 0xe703_7ed1_a0b4_28db;
const P2: u64 = 0x8ebc_6af0_9c88_c6e3;

/// 64x64 -> 128 multiply folded back to 64 bits (the wyhash mixing step).
#[inline]
fn fold_mul(a: u64, b: u64) -> u64 {
    let r = u128::from(a) * u128::from(b);
    (r as u64) ^ ((r >> 64) as u64)
}

/// Hash of a page whose content is `tokens` and whose predecessor hashed to `parent`.
/// Deterministic across runs and platforms; about one multiply per two tokens.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = parent ^ P0;
    let mut pairs = tokens.chunks_exact(2);
    for pair in &mut pairs {
        let word = u64::from(pair[0]) | (u64::from(pair[1]) << 32);
        h = fold_mul(h ^ word, P1);
    }
    if let [last] = pairs.remainder() {
        h = fold_mul(h ^ u64::from(*last), P1);
    }
    fold_mul(h ^ tokens.len() as u64, P2)
}

/// A `Hasher` for keys that already are good 64-bit hashes.
#[derive(Debug, Default, Clone, Copy)]
pub struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

type HashIndex = HashMap<u64, PageId, BuildHasherDefault<PassThroughHasher>>;

/// Published pages by chain hash, with each page's tokens kept for verification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixIndex {
    page_size: usize,
    map: HashIndex,
    /// Hash a published page is filed under.
    page_hash: Vec<u64>,
    /// Hash of the page before it (`ROOT_HASH` for a first page).
    parent_hash: Vec<u64>,
    /// `page_size` tokens per page.
    tokens: Vec<u32>,
}

impl PrefixIndex {
    /// An empty index for a pool of `num_pages` pages of `page_size` tokens.
    pub fn new(num_pages: usize, page_size: usize) -> Self {
        let mut map = HashIndex::default();
        map.reserve(num_pages);
        Self {
            page_size,
            map,
            page_hash: vec![0; num_pages],
            parent_hash: vec![0; num_pages],
            tokens: vec![0; num_pages * page_size],
        }
    }

    /// Published pages.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether nothing is published.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Forgets every page.
    pub fn clear(&mut self) {
        self.map.clear();
    }

    /// Hashes the page after `parent` and looks it up. Returns the page's chain
    /// hash and, on a verified hit, the page holding exactly those tokens.
    pub fn lookup(&self, parent: u64, page_tokens: &[u32]) -> (u64, Option<PageId>) {
        debug_assert_eq!(page_tokens.len(), self.page_size);
        let hash = chain_hash(parent, page_tokens);
        let hit = self.map.get(&hash).copied().filter(|&page| {
            self.parent_hash[page as usize] == parent && self.page_tokens(page) == page_tokens
        });
        (hash, hit)
    }

    /// Files `page` under `hash`. Returns `false` (and files nothing) when the
    /// hash is taken: another row published the same content first, or a
    /// collision; the page then simply stays private to its row.
    pub fn insert(&mut self, page: PageId, parent: u64, hash: u64, page_tokens: &[u32]) -> bool {
        use std::collections::hash_map::Entry;
        match self.map.entry(hash) {
            Entry::Occupied(_) => false,
            Entry::Vacant(slot) => {
                slot.insert(page);
                let p = page as usize;
                self.page_hash[p] = hash;
                self.parent_hash[p] = parent;
                self.tokens[p * self.page_size..(p + 1) * self.page_size]
                    .copy_from_slice(page_tokens);
                true
            }
        }
    }

    /// Unfiles an evicted page.
    pub fn remove(&mut self, page: PageId) {
        let removed = self.map.remove(&self.page_hash[page as usize]);
        debug_assert_eq!(
            removed,
            Some(page),
            "evicted page {page} was not filed under its hash"
        );
    }

    /// The page filed under `page`'s recorded hash, if it is `page` itself.
    pub fn is_filed(&self, page: PageId) -> bool {
        self.map.get(&self.page_hash[page as usize]) == Some(&page)
    }

    /// Tokens stored for a published page.
    pub fn page_tokens(&self, page: PageId) -> &[u32] {
        let p = page as usize;
        &self.tokens[p * self.page_size..(p + 1) * self.page_size]
    }

    /// Every filed `(hash, page)` pair, in no particular order.
    pub fn entries(&self) -> impl Iterator<Item = (u64, PageId)> + '_ {
        self.map.iter().map(|(&h, &p)| (h, p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_hash_depends_on_parent_order_and_every_token() {
        let a = chain_hash(ROOT_HASH, &[1, 2, 3, 4]);
        assert_ne!(a, chain_hash(ROOT_HASH, &[1, 2, 3, 5]));
        assert_ne!(a, chain_hash(ROOT_HASH, &[2, 1, 3, 4]));
        assert_ne!(a, chain_hash(a, &[1, 2, 3, 4]));
        assert_eq!(a, chain_hash(ROOT_HASH, &[1, 2, 3, 4]));
    }

    #[test]
    fn lookup_verifies_tokens_and_parent() {
        let mut index = PrefixIndex::new(4, 2);
        let (h, miss) = index.lookup(ROOT_HASH, &[7, 8]);
        assert_eq!(miss, None);
        assert!(index.insert(3, ROOT_HASH, h, &[7, 8]));
        assert_eq!(index.lookup(ROOT_HASH, &[7, 8]), (h, Some(3)));
        // Same key, forged content: the verification turns the hit into a miss.
        index.tokens[6] = 9;
        assert_eq!(index.lookup(ROOT_HASH, &[7, 8]).1, None);
        // A second page with the same hash is not filed.
        assert!(!index.insert(1, ROOT_HASH, h, &[7, 8]));
        index.remove(3);
        assert!(index.is_empty());
    }
}
