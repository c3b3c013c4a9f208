//! The page table's typed error, [`KvError`].
//!
//! Every variant carries the numbers a caller needs to act on it (how many
//! pages were needed and how many were available, which row was unknown), so
//! no message string has to be parsed.

use crate::{PageId, RowId};

/// Everything the page table can refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// A [`crate::PageTableConfig`] field is out of range.
    #[error("invalid page-table config: {field} = {value} ({requirement})")]
    InvalidConfig {
        /// The offending field.
        field: &'static str,
        /// The value it had.
        value: usize,
        /// What it must satisfy.
        requirement: &'static str,
    },
    /// Every usable row (all but the reserved row 0) is allocated.
    #[error("no free row: all {usable_rows} usable rows are allocated")]
    NoFreeRow {
        /// `max_rows - 1`: the rows a caller can ever hold at once.
        usable_rows: usize,
    },
    /// The pool cannot supply the pages a request needs, even after evicting
    /// every unreferenced cached page. Nothing was allocated.
    #[error("out of KV pages: needed {needed}, available {available} (free + evictable)")]
    OutOfPages {
        /// Pages the request needed beyond what the row already holds.
        needed: usize,
        /// Free plus evictable cached pages at the time of the request.
        available: usize,
    },
    /// The row is reserved (row 0), out of range, or not allocated.
    #[error("unknown row {0}: reserved, out of range or not allocated")]
    UnknownRow(RowId),
    /// [`crate::PageTable::write_indices`] was asked for more tokens than the
    /// row has pages for.
    #[error("row {row}: kv_len {kv_len} exceeds the {reserved_tokens} tokens its pages hold")]
    KvLenExceedsReserved {
        /// The row.
        row: RowId,
        /// The requested KV length.
        kv_len: usize,
        /// `pages(row).len() * page_size`.
        reserved_tokens: usize,
    },
    /// A step names a sequence that is not admitted.
    #[error("step row {index} names a sequence that is not admitted")]
    UnknownSequence {
        /// The row's index in the step.
        index: usize,
    },
    /// A prefill chunk does not start where its sequence's KV ends (or is
    /// empty, or runs past its prompt).
    #[error(
        "step row {index}: prefill chunk starts at {start}, but its KV holds {written} tokens"
    )]
    ChunkOutOfOrder {
        /// The row's index in the step.
        index: usize,
        /// Where the chunk starts.
        start: usize,
        /// Tokens the sequence's KV holds (or will, once every launched step has run).
        written: usize,
    },
    /// Shrinking a row would cut into pages published to the prefix cache (or
    /// shared with other rows), whose contents must stay immutable.
    #[error(
        "row {row}: cannot shrink to {len} tokens, its first {published_tokens} are published"
    )]
    ShrinkBelowPublished {
        /// The row.
        row: RowId,
        /// The requested length.
        len: usize,
        /// Tokens covered by the row's published pages.
        published_tokens: usize,
    },
    /// Shrinking a row would leave its next position inside a page another
    /// row shares (a fork's parent cut back into the pages its forks hold):
    /// the row's next write would change their KV.
    #[error(
        "row {row}: cannot shrink to {len} tokens, page {page} holding position {len} is shared"
    )]
    ShrinkIntoShared {
        /// The row.
        row: RowId,
        /// The requested length.
        len: usize,
        /// The shared page the next position falls in.
        page: PageId,
    },
    /// A page-index buffer entry does not fit the `u32` a paged-attention
    /// kernel consumes.
    #[error("page-index buffer overflow: {value} does not fit in u32")]
    IndexOverflow {
        /// The value that did not fit.
        value: usize,
    },
    /// Internal consistency check failed (only from
    /// [`crate::PageTable::check_invariants`]); always a bug in this crate.
    #[error("page-table invariant violated at page {page:?}: {what}")]
    InvariantViolated {
        /// The page involved, if one.
        page: Option<PageId>,
        /// What was wrong.
        what: &'static str,
    },
}
