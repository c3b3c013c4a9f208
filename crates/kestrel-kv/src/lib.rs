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
//! - [`SchedulableSequence`]: the per-request `Idle / PrefillScheduled / DecodeScheduled /
//!   SpeculativeScheduled` state machine with `schedule_*` / `apply_*` /
//!   `revert_schedule`, chunked prefill, speculative decode, preemption
//!   (`release` / `reacquire`), typed errors and an append-only event history.
//! - What every runtime keeps on top of these: [`SeqBook`] (admitted sequences,
//!   all-or-nothing batch admission, the `Executor`'s capacity answers) and
//!   [`SlotLedger`] (the slot protocol's in-flight / launched bookkeeping and
//!   step counter, violations as a typed [`LedgerError`]).
//!
//! # Example
//!
//! ```
//! use kestrel_kv::{DecodeOutcome, PageTable, PageTableConfig, PagedIndices, SchedulableSequence};
//!
//! let mut table = PageTable::new(PageTableConfig {
//!     max_rows: 8, // row 0 reserved: 7 sequences at once
//!     num_pages: 64,
//!     page_size: 4,
//!     enable_prefix_cache: true,
//! })?;
//!
//! // Admission: the scheduler's O(1) capacity check, then prefix matching.
//! let prompt: Vec<u32> = (100..110).collect();
//! assert!(table.num_allocated() < table.usable_rows() && table.can_reserve(prompt.len() + 1));
//! let mut seq = SchedulableSequence::new(prompt.clone(), 3)?;
//! assert_eq!(seq.match_and_add_prefix(&mut table)?, 0); // cold cache
//!
//! // Chunked prefill: only the final chunk carries the first generated token.
//! seq.schedule_prefill(6, &mut table)?;
//! seq.apply_prefill(None, &mut table)?;
//! seq.schedule_prefill(4, &mut table)?;
//! seq.apply_prefill(Some(7), &mut table)?;
//! assert_eq!((seq.kv_position(), seq.tail_tokens()), (10, 1));
//!
//! // Decode: build the kernel's page layout for the scheduled batch, then commit.
//! seq.schedule_decode(&mut table)?;
//! let row = seq.row().expect("a scheduled sequence holds a row");
//! let mut indices = PagedIndices::default();
//! table.write_indices(&[(row, seq.scheduled_kv_len().unwrap())], &mut indices)?;
//! assert_eq!(indices.kv_indptr, [0, 3]);
//! assert_eq!(indices.kv_last_page_len, [3]);
//! assert_eq!(seq.apply_decode(8, &mut table)?, DecodeOutcome::Continue);
//!
//! // Speculative decode: 2 drafts scheduled (clamped to the budget), 1 accepted.
//! seq.schedule_speculative(5, &mut table)?;
//! assert_eq!(seq.apply_speculative(&[9], &mut table)?, DecodeOutcome::BlockCompletedAndMaxLength);
//! seq.release(&mut table)?;
//! assert_eq!(table.num_allocated(), 0);
//!
//! // The same prompt again reuses the two full pages prefill published.
//! let (row, hit_tokens) = table.allocate_with_prefix(&prompt)?;
//! assert_eq!(hit_tokens, 8);
//! table.erase(row)?;
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
pub mod sequence;
mod stats;
mod table;

pub use book::{Admission, SeqBook, SeqEntry};
pub use error::KvError;
pub use ledger::{LedgerError, SlotIndex, SlotLedger};
pub use pool::BlockPool;
pub use sequence::{
    ApplyError, DecodeOutcome, SchedulableSequence, ScheduleError, SequenceEvent, SequenceState,
};
pub use stats::KvStats;
pub use table::{PageTable, PageTableConfig, PagedIndices};

/// Index of a KV page in the pool.
pub type PageId = u32;

/// Index of a batch row; row 0 is reserved and never handed out.
pub type RowId = u32;
