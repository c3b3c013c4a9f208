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
//!   pages in the prefix cache, the `Executor`'s capacity answers) and its
//!   per-step bookkeeping: [`SeqBook::plan_step`] at launch (each row's span,
//!   the page layout, lengths advanced) and [`SeqBook::commit_step`] after
//!   the step ran (prefix pages published, rejected drafts rolled back),
//!   through a [`KvStep`] the runtime keeps per slot. The slot protocol
//!   itself is kestrel-pipeline's `PipelineState`.
//!
//! # Example
//!
//! ```
//! use kestrel_kv::{Admission, KvStep, PageTable, PageTableConfig, SeqBook, Span};
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
//! let admit = Admission { id: 1, prompt: &prompt, reserve: prompt.len(), meta: (), fork_of: None };
//! book.admit_all([admit])?;
//! assert_eq!(book.cached_prompt_tokens(1), 0);
//!
//! // Prefill: plan the step (the kernel's page layout, the length advanced),
//! // then, once it ran, commit it: the prompt's full pages are published.
//! let mut step = KvStep::default();
//! let chunk = Span::Chunk { prompt: &prompt, start: 0, end: prompt.len() };
//! book.plan_step([(1, chunk)], &mut step)?;
//! book.commit_step(&step, None)?;
//!
//! // Decode: grow a page when the next token needs one, then plan the step.
//! assert!(book.grow(1, 11));
//! book.plan_step([(1, Span::Decode { drafts: 0 })], &mut step)?;
//! assert_eq!((step.starts[0], step.ends[0]), (10, 11));
//! assert_eq!(step.indices.kv_last_page_len, [3]);
//! book.commit_step(&step, None)?;
//!
//! // Preempted: the written pages go to the prefix cache, the row is freed.
//! let tokens: Vec<u32> = (100..113).collect();
//! book.preempt(1, &tokens)?;
//! assert_eq!(book.num_allocated(), 0);
//!
//! // Re-admitted with its tokens so far, it recomputes only past the filed pages.
//! let again = Admission { id: 1, prompt: &tokens, reserve: tokens.len(), meta: (), fork_of: None };
//! book.admit_all([again])?;
//! assert_eq!(book.cached_prompt_tokens(1), 8);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Costs
//! Page allocate / share / free and every capacity question are O(1); growing or erasing a
//! row is O(pages touched); a prefix lookup is O(prompt tokens) hashing plus one map probe
//! per page; `write_indices` (and so `plan_step`) is O(pages written). Measured figures: `benches/kv.rs`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod book;
mod error;
pub mod pool;
pub mod prefix;
mod stats;
mod step;
mod table;

pub use book::{Admission, SeqBook, SeqEntry};
pub use error::KvError;
pub use pool::BlockPool;
pub use stats::KvStats;
pub use step::{KvStep, Span};
pub use table::{PageTable, PageTableConfig, PagedIndices};

/// Index of a KV page in the pool.
pub type PageId = u32;

/// Index of a batch row; row 0 is reserved and never handed out.
pub type RowId = u32;
