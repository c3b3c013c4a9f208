//! Unit tests of the [`PageTable`]: configuration, rows, reservation, the prefix
//! cache's share / cache / evict cycle, shrink and the FlashInfer layout.

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
