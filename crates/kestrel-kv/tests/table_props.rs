//! Property tests of [`PageTable`] against a model with simulated KV memory.
//!
//! Random operations (allocate with prefix, grow, shrink, erase, fork a row, memory pressure that forces
//! eviction, release_all, write_indices) run against a table and a model that "writes" each
//! token into a simulated KV buffer at its page slot. After every operation: the table's own
//! invariant audit passes, `free + used + cached == total`, `num_allocated` equals the model's
//! rows, every row's pages still hold exactly its tokens (so no page is owned twice unless
//! shared with matching refcounts), and every prefix hit reads back the prompt it claims.

use std::collections::BTreeMap;

use kestrel_kv::{KvError, PageTable, PageTableConfig, PagedIndices, RowId};
use proptest::prelude::*;

const PS: usize = 4;
const PAGES: usize = 24;
const ROWS: usize = 5;

#[derive(Debug, Clone)]
enum Op {
    /// Admit `prompt(family, len)`: allocate with prefix, reserve, "prefill", publish.
    Admit {
        family: usize,
        len: usize,
    },
    /// Decode `extra` tokens on the `idx`-th live row.
    Grow {
        idx: usize,
        extra: usize,
    },
    /// Drop the `idx`-th live row's last `cut` tokens (a rejected speculation).
    Shrink {
        idx: usize,
        cut: usize,
    },
    Erase {
        idx: usize,
    },
    /// Fork the `idx`-th live row (a sample of the same request, `n > 1`):
    /// a new row whose prompt is its tokens, sharing its full pages.
    Fork {
        idx: usize,
    },
    /// Take every available page in a scratch row, then give them back: evicts the cache.
    Pressure,
    ReleaseAll,
    WriteIndices,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..4usize, 1..28usize).prop_map(|(family, len)| Op::Admit { family, len }),
        3 => (0..8usize, 1..9usize).prop_map(|(idx, extra)| Op::Grow { idx, extra }),
        1 => (0..8usize, 0..6usize).prop_map(|(idx, cut)| Op::Shrink { idx, cut }),
        2 => (0..8usize).prop_map(|idx| Op::Erase { idx }),
        2 => (0..8usize).prop_map(|idx| Op::Fork { idx }),
        1 => Just(Op::Pressure),
        1 => Just(Op::ReleaseAll),
        1 => Just(Op::WriteIndices),
    ]
}

/// Prompts of different families share their first `4 * family` tokens.
fn prompt(family: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| {
            if i < 4 * family {
                i as u32
            } else {
                (family * 1000 + i) as u32
            }
        })
        .collect()
}

struct Model {
    table: PageTable,
    /// Simulated KV memory: the token whose KV each slot holds.
    kv: Vec<Option<u32>>,
    /// Live rows and the tokens whose KV they hold.
    rows: BTreeMap<RowId, Vec<u32>>,
    next_token: u32,
}

impl Model {
    fn new() -> Self {
        let table = PageTable::new(PageTableConfig {
            max_rows: ROWS,
            num_pages: PAGES,
            page_size: PS,
            enable_prefix_cache: true,
        })
        .unwrap();
        Self {
            table,
            kv: vec![None; PAGES * PS],
            rows: BTreeMap::new(),
            next_token: 100_000,
        }
    }

    fn slot(&self, row: RowId, pos: usize) -> usize {
        self.table.pages(row)[pos / PS] as usize * PS + pos % PS
    }

    /// The kernel writing KV for `tokens[from..]`: only ever into pages this row owns alone.
    fn write(&mut self, row: RowId, tokens: &[u32], from: usize) {
        for (pos, &tok) in tokens.iter().enumerate().skip(from) {
            let page = self.table.pages(row)[pos / PS];
            assert_eq!(
                self.table.refcount(page),
                1,
                "KV written into shared page {page}"
            );
            let slot = self.slot(row, pos);
            self.kv[slot] = Some(tok);
        }
    }

    fn nth_row(&self, idx: usize) -> Option<RowId> {
        (!self.rows.is_empty()).then(|| *self.rows.keys().nth(idx % self.rows.len()).unwrap())
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Admit { family, len } => {
                let p = prompt(family, len);
                let can = self.table.can_reserve(len);
                let can_prompt = self.table.can_reserve_prompt(&p, len);
                assert!(can_prompt || !can, "prefix hits can only lower the need");
                let peek = self.table.peek_prefix(&p);
                let (row, hit) = match self.table.allocate_with_prefix(&p) {
                    Ok(x) => x,
                    Err(e) => {
                        assert_eq!(
                            e,
                            KvError::NoFreeRow {
                                usable_rows: ROWS - 1
                            }
                        );
                        assert!(!can && !can_prompt);
                        return;
                    }
                };
                assert_eq!(hit, peek);
                assert!(
                    hit % PS == 0 && hit < len,
                    "hit {hit} for a {len}-token prompt"
                );
                for (pos, &tok) in p[..hit].iter().enumerate() {
                    assert_eq!(
                        self.kv[self.slot(row, pos)],
                        Some(tok),
                        "prefix hit reads wrong KV"
                    );
                }
                let available = self.table.available_pages();
                match self.table.reserve(row, len) {
                    Ok(()) => {}
                    Err(e) => {
                        let needed = len.div_ceil(PS) - hit / PS;
                        assert_eq!(e, KvError::OutOfPages { needed, available });
                        assert!(!can && !can_prompt, "can_reserve_prompt must be exact");
                        self.table.erase(row).unwrap();
                        return;
                    }
                }
                assert!(can_prompt, "can_reserve_prompt must be exact");
                assert_eq!(self.table.pages(row).len(), len.div_ceil(PS));
                self.write(row, &p, hit);
                self.table.register_prefix(row, &p);
                assert_eq!(self.table.sealed_pages(row), len / PS);
                self.rows.insert(row, p);
            }
            Op::Grow { idx, extra } => {
                let Some(row) = self.nth_row(idx) else { return };
                let len = self.rows[&row].len();
                let needed = self.table.pages_needed(row, len + extra).unwrap();
                let available = self.table.available_pages();
                assert_eq!(self.table.can_grow(row, len + extra), needed <= available);
                match self.table.reserve(row, len + extra) {
                    Ok(()) => {
                        let mut tokens = self.rows.remove(&row).unwrap();
                        tokens.extend((0..extra as u32).map(|i| self.next_token + i));
                        self.next_token += extra as u32;
                        self.write(row, &tokens, len);
                        self.table.register_prefix(row, &tokens);
                        self.rows.insert(row, tokens);
                    }
                    Err(e) => assert_eq!(e, KvError::OutOfPages { needed, available }),
                }
            }
            Op::Shrink { idx, cut } => {
                let Some(row) = self.nth_row(idx) else { return };
                let len = self.rows[&row].len();
                let new_len = len.saturating_sub(cut);
                let sealed = self.table.sealed_pages(row) * PS;
                let next_page = self.table.pages(row).get(new_len / PS).copied();
                let into_shared = next_page
                    .filter(|&p| !new_len.is_multiple_of(PS) && self.table.refcount(p) > 1)
                    .filter(|_| new_len >= sealed);
                match self.table.shrink(row, new_len) {
                    Err(KvError::ShrinkIntoShared { row: r, len, page }) => {
                        assert_eq!((r, len, Some(page)), (row, new_len, into_shared));
                    }
                    Ok(_) => {
                        assert!(new_len >= sealed && into_shared.is_none());
                        self.rows.get_mut(&row).unwrap().truncate(new_len);
                        assert_eq!(self.table.pages(row).len(), new_len.div_ceil(PS));
                    }
                    Err(e) => {
                        assert!(new_len < sealed);
                        assert_eq!(
                            e,
                            KvError::ShrinkBelowPublished {
                                row,
                                len: new_len,
                                published_tokens: sealed
                            }
                        );
                    }
                }
            }
            Op::Erase { idx } => {
                let Some(row) = self.nth_row(idx) else { return };
                self.table.erase(row).unwrap();
                self.rows.remove(&row);
                assert_eq!(self.table.erase(row), Err(KvError::UnknownRow(row)));
            }
            Op::Fork { idx } => {
                let Some(parent) = self.nth_row(idx) else {
                    return;
                };
                let p = self.rows[&parent].clone();
                let len = p.len();
                let before = (self.table.used_pages(), self.table.num_allocated());
                let (row, shared) = match self.table.admit_fork(parent, len, &p, len) {
                    Ok(x) => x,
                    Err(KvError::NoFreeRow { .. } | KvError::OutOfPages { .. }) => {
                        let after = (self.table.used_pages(), self.table.num_allocated());
                        assert_eq!(before, after, "a refused fork took something");
                        return;
                    }
                    Err(e) => panic!("fork of a live row: {e}"),
                };
                let expect = (len.saturating_sub(1) / PS).min(self.table.pages(parent).len());
                assert_eq!(shared, expect * PS);
                assert_eq!(
                    self.table.pages(row)[..expect],
                    self.table.pages(parent)[..expect]
                );
                for (pos, &tok) in p[..shared].iter().enumerate() {
                    assert_eq!(
                        self.kv[self.slot(row, pos)],
                        Some(tok),
                        "fork reads wrong KV"
                    );
                }
                self.write(row, &p, shared);
                self.table.register_prefix(row, &p);
                self.rows.insert(row, p);
            }
            Op::Pressure => {
                let Ok(row) = self.table.allocate() else {
                    return;
                };
                let all = self.table.available_pages();
                self.table.reserve(row, all * PS).unwrap();
                assert_eq!((self.table.free_pages(), self.table.cached_pages()), (0, 0));
                self.table.erase(row).unwrap();
                assert_eq!(self.table.cached_pages(), 0, "a private page became cached");
            }
            Op::ReleaseAll => {
                self.table.release_all();
                self.rows.clear();
                assert_eq!(self.table.free_pages(), PAGES);
            }
            Op::WriteIndices => {
                let batch: Vec<_> = self.rows.iter().map(|(&r, t)| (r, t.len())).collect();
                let mut out = PagedIndices::default();
                self.table.write_indices(&batch, &mut out).unwrap();
                assert_eq!(out.kv_indptr.len(), batch.len() + 1);
                for (i, &(row, len)) in batch.iter().enumerate() {
                    let (a, b) = (out.kv_indptr[i] as usize, out.kv_indptr[i + 1] as usize);
                    assert_eq!(
                        &out.kv_indices[a..b],
                        &self.table.pages(row)[..len.div_ceil(PS)]
                    );
                    assert_eq!(
                        out.kv_last_page_len[i] as usize,
                        if len == 0 { 0 } else { (len - 1) % PS + 1 }
                    );
                }
            }
        }
    }

    fn check(&self) {
        self.table.check_invariants().unwrap();
        let t = &self.table;
        assert_eq!(t.free_pages() + t.used_pages() + t.cached_pages(), PAGES);
        assert_eq!(t.num_allocated(), self.rows.len());
        assert_eq!(t.can_reserve(0), self.rows.len() < ROWS - 1);
        for (&row, tokens) in &self.rows {
            assert!(t.is_allocated(row));
            assert_eq!(t.pages(row).len(), tokens.len().div_ceil(PS));
            for (pos, &tok) in tokens.iter().enumerate() {
                assert_eq!(
                    self.kv[self.slot(row, pos)],
                    Some(tok),
                    "row {row} lost its KV at {pos}"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn page_table_matches_model(ops in prop::collection::vec(op(), 1..80)) {
        let mut model = Model::new();
        for op in &ops {
            model.apply(op);
            model.check();
        }
        // No page leaks: once every row (parents and forks) is gone, no
        // page is referenced.
        for row in std::mem::take(&mut model.rows).into_keys() {
            model.table.erase(row).unwrap();
        }
        model.table.check_invariants().unwrap();
        prop_assert_eq!(model.table.used_pages(), 0);
    }
}
