//! [`SeqBook`]: the KV bookkeeping every runtime keeps for its admitted
//! sequences: the [`PageTable`], each sequence's row, length and prefix-cache
//! hit, and the cumulative [`KvStats`] counters. Admission of a prefill batch
//! is all or nothing, so a rejected launch leaves no row or page behind. A
//! runtime reserves at admission what it chooses (the prompt, growing later
//! with [`SeqBook::grow`], or the whole sequence) and, when the pipeline
//! preempts a sequence, files its written pages into the prefix cache before
//! freeing them ([`SeqBook::preempt`]). It
//! answers the pipeline `Executor`'s capacity queries (`num_allocated`,
//! `can_reserve`, `could_ever_fit`, `cached_prompt_tokens`), so a runtime
//! delegates them here rather than re-deriving them. Each step's KV is
//! planned and committed here too (`plan_step` / `commit_step`, in `step.rs`).

use std::collections::HashMap;
use std::hash::Hash;

use crate::{KvError, KvStats, PageTable, RowId};

/// One admitted sequence. `meta` is whatever else the runtime keeps per
/// sequence (e.g. its sampling parameters).
#[derive(Debug, Clone)]
pub struct SeqEntry<M> {
    /// The sequence's page-table row.
    pub row: RowId,
    /// Positions whose KV is written once every launched step has run (at
    /// admission: the prefix-cache hit; [`SeqBook::plan_step`] advances it).
    pub len: usize,
    /// Prompt tokens whose KV it had at admission: its prefix-cache hit, or
    /// for a fork the prompt pages it shares with its parent.
    pub cached: usize,
    /// The runtime's per-sequence data.
    pub meta: M,
}

/// A sequence to admit: its id, prompt, the tokens to reserve KV for now,
/// and the runtime's per-sequence data.
#[derive(Debug)]
pub struct Admission<'a, K, M> {
    /// The caller's id for the sequence.
    pub id: K,
    /// Its prompt tokens.
    pub prompt: &'a [u32],
    /// Tokens to reserve KV for now (at least the prompt; a runtime that
    /// grows sequences lazily reserves just that, [`SeqBook::grow`] adds more).
    pub reserve: usize,
    /// The runtime's per-sequence data.
    pub meta: M,
    /// A sample of the same request whose prompt this one repeats (`n > 1`):
    /// when it is admitted, the new sequence shares its full prompt pages by
    /// reference count ([`PageTable::admit_fork`]) instead of looking the
    /// prompt up in the prefix cache; when it is gone, admission is as
    /// without it.
    pub fork_of: Option<K>,
}

/// The page table plus the sequences holding rows in it. See the module docs.
#[derive(Debug)]
pub struct SeqBook<K, M> {
    pub(crate) table: PageTable,
    pub(crate) seqs: HashMap<K, SeqEntry<M>>,
    stats: KvStats,
    /// Longest sequence (prompt + generated) the runtime accepts.
    max_seq_len: usize,
    /// `admit_all`'s sequences so far, to undo them (scratch, kept for its capacity).
    admitted: Vec<(K, RowId)>,
    /// `plan_step`'s `(row, KV length)` pairs (scratch).
    pub(crate) lens: Vec<(RowId, usize)>,
}

impl<K: Hash + Eq + Copy, M> SeqBook<K, M> {
    /// An empty book over `table`.
    pub fn new(table: PageTable) -> Self {
        let stats = KvStats {
            total_pages: table.num_pages(),
            ..KvStats::default()
        };
        SeqBook {
            table,
            seqs: HashMap::new(),
            stats,
            max_seq_len: usize::MAX,
            admitted: Vec::new(),
            lens: Vec::new(),
        }
    }

    /// Caps the sequences [`could_ever_fit`](Self::could_ever_fit) accepts at
    /// `max_seq_len` tokens (prompt + generated), e.g. a runtime's position
    /// limit; uncapped by default.
    #[must_use]
    pub fn with_max_seq_len(mut self, max_seq_len: usize) -> Self {
        self.max_seq_len = max_seq_len;
        self
    }

    /// Rows allocated now.
    pub fn num_allocated(&self) -> usize {
        self.table.num_allocated()
    }

    /// Whether `prompt` could be admitted now with KV for `reserve` tokens
    /// ([`PageTable::can_reserve_prompt`]: counts its prefix-cache hit).
    pub fn can_reserve(&self, prompt: &[u32], reserve: usize) -> bool {
        self.table
            .can_reserve_prompt(prompt, reserve.max(prompt.len()))
    }

    /// Whether a sequence of `max_len` tokens could be admitted into an empty
    /// book: within the `max_seq_len` cap and the table's pages.
    pub fn could_ever_fit(&self, max_len: usize) -> bool {
        max_len <= self.max_seq_len && self.table.could_ever_fit(max_len)
    }

    /// The page table (capacity questions, `write_indices`).
    pub fn table(&self) -> &PageTable {
        &self.table
    }

    /// The page table, e.g. to publish prefixes.
    pub fn table_mut(&mut self) -> &mut PageTable {
        &mut self.table
    }

    /// Admits every sequence ([`PageTable::admit`]: prefix hit + reservation)
    /// or none: on the first failure the rows this call took are given back
    /// and its sequences forgotten. An admitted sequence's KV holds its
    /// prefix-cache hit; its prefill is planned with [`SeqBook::plan_step`].
    ///
    /// # Errors
    /// The failing admission's [`KvError`].
    pub fn admit_all<'a>(
        &mut self,
        seqs: impl IntoIterator<Item = Admission<'a, K, M>>,
    ) -> Result<(), KvError> {
        self.admitted.clear();
        let (mut prompt_tokens, mut hit_tokens, mut shared_tokens) = (0, 0, 0);
        for s in seqs {
            let reserve = s.reserve.max(s.prompt.len());
            let parent = s.fork_of.and_then(|p| self.seqs.get(&p));
            let admitted = match parent {
                Some(p) => self
                    .table
                    .admit_fork(p.row, p.len, s.prompt, reserve)
                    .map(|(row, shared)| (row, shared, 0)),
                None => self
                    .table
                    .admit(s.prompt, reserve)
                    .map(|(row, hit)| (row, hit, hit)),
            };
            match admitted {
                Ok((row, hit, cache_hit)) => {
                    self.admitted.push((s.id, row));
                    prompt_tokens += s.prompt.len() as u64;
                    hit_tokens += cache_hit as u64;
                    shared_tokens += (hit - cache_hit) as u64;
                    let entry = SeqEntry {
                        row,
                        len: hit,
                        cached: hit,
                        meta: s.meta,
                    };
                    self.seqs.insert(s.id, entry);
                }
                Err(e) => {
                    for (id, row) in &self.admitted {
                        let erased = self.table.erase(*row);
                        debug_assert!(erased.is_ok(), "row {row} was just admitted");
                        self.seqs.remove(id);
                    }
                    return Err(e);
                }
            }
        }
        self.stats.prompt_tokens += prompt_tokens;
        self.stats.prefix_hit_tokens += hit_tokens;
        self.stats.fork_shared_tokens += shared_tokens;
        Ok(())
    }

    /// The admitted sequence `id`.
    pub fn get(&self, id: K) -> Option<&SeqEntry<M>> {
        self.seqs.get(&id)
    }

    /// The admitted sequence `id`, mutably (its length grows per step).
    pub fn get_mut(&mut self, id: K) -> Option<&mut SeqEntry<M>> {
        self.seqs.get_mut(&id)
    }

    /// Grows `id`'s pages to hold `len` tokens (evicting unreferenced cached
    /// pages if need be); `false`, with nothing taken, when free and
    /// evictable pages fall short or `id` is unknown.
    pub fn grow(&mut self, id: K, len: usize) -> bool {
        self.seqs
            .get(&id)
            .is_some_and(|s| self.table.reserve(s.row, len).is_ok())
    }

    /// Frees a preempted sequence's row, first filing the full pages of
    /// `tokens` it has written (its first `len` tokens) into the prefix
    /// cache, so its re-admission recomputes only the rest. `tokens` are the
    /// sequence's tokens from position 0 (at least `len` of them); unknown
    /// ids are a no-op.
    ///
    /// # Errors
    /// The page table's, should the row not be allocated (a bookkeeping bug).
    pub fn preempt(&mut self, id: K, tokens: &[u32]) -> Result<(), KvError> {
        let Some(seq) = self.seqs.remove(&id) else {
            return Ok(());
        };
        let written = &tokens[..seq.len.min(tokens.len())];
        self.table.register_prefix(seq.row, written);
        self.table.erase(seq.row)
    }

    /// Prompt tokens of `id` whose KV it had at admission: its prefix-cache
    /// hit, or a fork's shared pages (0 if unknown).
    pub fn cached_prompt_tokens(&self, id: K) -> usize {
        self.seqs.get(&id).map_or(0, |s| s.cached)
    }

    /// Frees `id`'s row and pages; unknown ids are a no-op.
    ///
    /// # Errors
    /// The page table's, should the row not be allocated (a bookkeeping bug).
    pub fn release(&mut self, id: K) -> Result<(), KvError> {
        match self.seqs.remove(&id) {
            Some(seq) => self.table.erase(seq.row),
            None => Ok(()),
        }
    }

    /// Forgets every sequence and frees every row.
    pub fn release_all(&mut self) {
        self.seqs.clear();
        self.table.release_all();
    }

    /// Admitted sequences.
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// Whether no sequence is admitted.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Occupancy now plus the cumulative prompt and prefix-hit counters.
    pub fn kv_stats(&self) -> KvStats {
        KvStats {
            used_pages: self.table.used_pages(),
            free_pages: self.table.free_pages(),
            cached_pages: self.table.cached_pages(),
            ..self.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PageTableConfig;

    fn book() -> SeqBook<u64, char> {
        let table = PageTable::new(PageTableConfig {
            max_rows: 4,
            num_pages: 6,
            page_size: 4,
            enable_prefix_cache: true,
        })
        .unwrap();
        SeqBook::new(table)
    }

    #[test]
    fn admit_all_is_all_or_nothing() {
        let mut b = book();
        let p: Vec<u32> = (0..5).collect();
        let ok = [
            Admission {
                id: 1,
                prompt: &p,
                reserve: 8,
                meta: 'a',
                fork_of: None,
            },
            Admission {
                id: 2,
                prompt: &p[..3],
                reserve: 4,
                meta: 'b',
                fork_of: None,
            },
        ];
        b.admit_all(ok).unwrap();
        assert_eq!((b.get(1).unwrap().len, b.get(2).unwrap().len), (0, 0));
        assert_eq!((b.len(), b.get(2).unwrap().meta), (2, 'b'));
        let before = b.kv_stats();
        assert_eq!((before.prompt_tokens, before.used_pages), (8, 3));
        // The second sequence cannot get 5 pages: the first is undone too.
        let too_many = [
            Admission {
                id: 3,
                prompt: &p,
                reserve: 4,
                meta: 'c',
                fork_of: None,
            },
            Admission {
                id: 4,
                prompt: &p,
                reserve: 20,
                meta: 'd',
                fork_of: None,
            },
        ];
        assert!(b.admit_all(too_many).is_err());
        assert!(b.get(3).is_none() && b.get(4).is_none());
        assert_eq!(b.kv_stats(), before);
        b.table().check_invariants().unwrap();
        assert_eq!(b.num_allocated(), 2);
        assert_eq!(b.cached_prompt_tokens(1), 0);
        b.release(1).unwrap();
        b.release(99).unwrap();
        assert_eq!((b.len(), b.table().num_allocated()), (1, 1));
        b.release_all();
        assert_eq!(
            (b.len(), b.table().num_allocated(), b.kv_stats().used_pages),
            (0, 0, 0)
        );
    }

    /// Forks share their parent's full prompt pages with the prefix cache
    /// off, compute the partial page themselves, and every page is free
    /// again once parent and forks are gone, in any order.
    #[test]
    fn forks_share_full_prompt_pages_by_refcount() {
        let table = PageTable::new(PageTableConfig {
            max_rows: 5,
            num_pages: 12,
            page_size: 4,
            enable_prefix_cache: false,
        })
        .unwrap();
        let mut b: SeqBook<u64, char> = SeqBook::new(table);
        let p: Vec<u32> = (0..10).collect();
        let admit = |id, fork_of| Admission {
            id,
            prompt: &p,
            reserve: 12,
            meta: 'x',
            fork_of,
        };
        b.admit_all([admit(1, None)]).unwrap();
        // The parent's prefill was launched: its KV holds the prompt.
        b.get_mut(1).unwrap().len = 10;
        b.admit_all([admit(2, Some(1)), admit(3, Some(1))]).unwrap();
        // Two full pages shared; the partial third and growth are private.
        assert_eq!((b.cached_prompt_tokens(2), b.get(3).unwrap().len), (8, 8));
        let (parent, fork) = (b.get(1).unwrap().row, b.get(2).unwrap().row);
        assert_eq!(b.table().pages(fork)[..2], b.table().pages(parent)[..2]);
        assert_eq!(b.table().refcount(b.table().pages(parent)[0]), 3);
        assert_eq!(b.kv_stats().used_pages, 3 + 1 + 1);
        assert_eq!(b.kv_stats().prefix_hit_tokens, 0, "a fork is no cache hit");
        assert_eq!(b.kv_stats().fork_shared_tokens, 16);
        // The parent cannot roll back into the pages its forks read.
        let row = b.get(1).unwrap().row;
        assert!(matches!(
            b.table_mut().shrink(row, 7),
            Err(KvError::ShrinkIntoShared { len: 7, .. })
        ));
        b.table().check_invariants().unwrap();
        b.release(1).unwrap();
        assert_eq!(b.kv_stats().used_pages, 4, "the shared pages stay");
        // A fork of a parent that is gone is admitted as any prompt.
        b.admit_all([admit(4, Some(1))]).unwrap();
        assert_eq!(b.cached_prompt_tokens(4), 0);
        for id in [3, 4, 2] {
            b.release(id).unwrap();
            b.table().check_invariants().unwrap();
        }
        assert_eq!((b.kv_stats().used_pages, b.table().free_pages()), (0, 12));
    }

    #[test]
    fn capacity_queries_answer_from_the_table_and_the_cap() {
        let b = book();
        // 6 pages of 4 tokens.
        assert!(b.could_ever_fit(24) && !b.could_ever_fit(25));
        let capped = book().with_max_seq_len(10);
        assert!(capped.could_ever_fit(10) && !capped.could_ever_fit(11));
        let p: Vec<u32> = (0..5).collect();
        assert!(b.can_reserve(&p, 24) && !b.can_reserve(&p, 25));
        let mut b = book();
        let a = Admission {
            id: 1,
            prompt: &p,
            reserve: 8,
            meta: 'a',
            fork_of: None,
        };
        b.admit_all([a]).unwrap();
        let row = b.get(1).unwrap().row;
        b.table_mut().register_prefix(row, &p);
        let again = Admission {
            id: 2,
            prompt: &p,
            reserve: 8,
            meta: 'b',
            fork_of: None,
        };
        b.admit_all([again]).unwrap();
        assert_eq!((b.num_allocated(), b.cached_prompt_tokens(2)), (2, 4));
        assert_eq!(b.get(2).unwrap().len, 4, "the hit is written");
        assert!(!b.can_reserve(&p, 24));
    }

    #[test]
    fn grow_takes_pages_lazily_and_preempt_files_what_was_written() {
        let mut b = book();
        let p: Vec<u32> = (0..6).collect();
        let a = Admission {
            id: 1,
            prompt: &p,
            reserve: 0,
            meta: 'a',
            fork_of: None,
        };
        b.admit_all([a]).unwrap();
        // Reserving less than the prompt still covers the prompt: 2 pages.
        assert_eq!(b.kv_stats().used_pages, 2);
        assert!(b.grow(1, 9));
        assert_eq!(b.kv_stats().used_pages, 3);
        // 6 pages in all: 3 more fit (24 tokens), a fourth does not, and a
        // refused growth takes nothing.
        assert!(!b.grow(1, 25));
        assert_eq!(b.kv_stats().used_pages, 3);
        assert!(!b.grow(7, 4), "unknown ids grow nothing");
        // The sequence wrote 9 tokens: its two full pages are filed, the
        // third (one token) is not.
        let tokens: Vec<u32> = (0..10).collect();
        b.get_mut(1).unwrap().len = 9;
        b.preempt(1, &tokens).unwrap();
        assert!(b.is_empty());
        let stats = b.kv_stats();
        assert_eq!((stats.used_pages, stats.cached_pages), (0, 2));
        // Re-admitted with its tokens as the prompt, it starts after them.
        let again = Admission {
            id: 1,
            prompt: &tokens,
            reserve: 0,
            meta: 'a',
            fork_of: None,
        };
        b.admit_all([again]).unwrap();
        assert_eq!(b.cached_prompt_tokens(1), 8);
        b.preempt(99, &tokens).unwrap();
        b.table().check_invariants().unwrap();
    }
}
