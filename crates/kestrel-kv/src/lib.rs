//! kestrel-kv: the KV cache's bookkeeping, which every scheduling decision is about.
//!
//! The runtimes (CPU, CUDA) own the KV memory; this crate only decides which pages of it
//! each sequence uses. Page `p` lives at token offset `p * page_size` in a runtime's
//! buffers. Pure: no device, no async, no unsafe, so it is tested exhaustively.
//!
//! - [`PageTable`]: a fixed number of batch rows (row 0 reserved) over a pool of
//!   fixed-size pages. `allocate` / `reserve` / `erase` / `release_all`, the O(1) capacity
//!   questions (`can_reserve`, `num_allocated`, `available_pages`), and
//!   [`write_indices`](PageTable::write_indices), the FlashInfer page layout
//!   (`kv_indptr` / `kv_indices` / `kv_last_page_len`) written into a reused
//!   [`PagedIndices`] buffer without allocating.
//! - [`BlockPool`]: refcounted pages with O(1) allocate / share / free and an LRU of
//!   unreferenced cached pages; `free + used + cached == total` always.
//! - Prefix cache (inside the table): full pages are filed under a hash chained over their
//!   tokens and the previous page's hash; [`PageTable::allocate_with_prefix`] reuses the
//!   longest cached prefix and reports the hit tokens so prefill can skip them. Cached
//!   pages are evicted least-recently-used, and only when the free list is empty.
//! - What every runtime keeps on top of these: [`SeqBook`] (admitted sequences,
//!   all-or-nothing batch admission, lazy growth, preemption that files written
//!   pages in the prefix cache, the `Executor`'s capacity answers) and
//!   [`SlotLedger`] (the slot protocol's in-flight / launched bookkeeping and
//!   step counter, violations as a typed [`LedgerError`]).
//!
//! # Example
//!
//! ```
//! use kestrel_kv::{Admission, PageTable, PageTableConfig, PagedIndices, SeqBook};
//!
//! let table = PageTable::new(PageTableConfig {
//!     max_rows: 8, // row 0 reserved: 7 sequences at once
//!     num_pages: 64,
//!     page_size: 4,
//!     enable_prefix_cache: true,
//! })?;
//! let mut book: SeqBook<u64, ()> = SeqBook::new(table);
//!
//! // Admission: the capacity check, then the prompt's pages (cold cache).
//! let prompt: Vec<u32> = (100..110).collect();
//! assert!(book.can_reserve(&prompt, prompt.len()));
//! let mut rows = Vec::new();
//! let admit = Admission { id: 1, prompt: &prompt, reserve: prompt.len(), meta: () };
//! book.admit_all([admit], &mut rows)?;
//! assert_eq!((rows[0].1, book.cached_prompt_tokens(1)), (10, 0));
//!
//! // Prefill ran: publish the prompt's full pages.
//! book.table_mut().register_prefix(rows[0].0, &prompt);
//!
//! // Decode: grow a page when the next token needs one, then build the
//! // kernel's page layout for the step.
//! assert!(book.grow(1, 13));
//! let mut indices = PagedIndices::default();
//! book.table().write_indices(&[(rows[0].0, 13)], &mut indices)?;
//! assert_eq!((indices.kv_indptr.as_slice(), indices.kv_last_page_len.as_slice()), (&[0, 4][..], &[1][..]));
//!
//! // Preempted: the written pages go to the prefix cache, the row is freed.
//! book.get_mut(1).unwrap().len = 12;
//! let tokens: Vec<u32> = (100..113).collect();
//! book.preempt(1, &tokens)?;
//! assert_eq!(book.num_allocated(), 0);
//!
//! // Re-admitted with its tokens so far, it recomputes only the last page.
//! let again = Admission { id: 1, prompt: &tokens, reserve: tokens.len(), meta: () };
//! book.admit_all([again], &mut rows)?;
//! assert_eq!(book.cached_prompt_tokens(1), 12);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Costs
//! Page allocate / share / free and every capacity question are O(1); growing or erasing a
//! row is O(pages touched); a prefix lookup is O(prompt tokens) hashing plus one map probe
//! per page; `write_indices` is O(pages written). Measured figures: `benches/kv.rs`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod book;
mod error;
mod ledger;
pub mod pool;
pub mod prefix;
mod stats;
mod table;

pub use book::{Admission, SeqBook, SeqEntry};
pub use error::KvError;
pub use ledger::{LedgerError, SlotIndex, SlotLedger};
pub use pool::BlockPool;
pub use stats::KvStats;
pub use table::{PageTable, PageTableConfig, PagedIndices};

/// Index of a KV page in the pool.
pub type PageId = u32;

/// Index of a batch row; row 0 is reserved and never handed out.
pub type RowId = u32;
