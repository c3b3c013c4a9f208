//! How a step's token masks get filled: the [`MaskFiller`] strategy.
//!
//! Between launching a forward and launching its sampling, the scheduler
//! asks every constrained sequence of the step for its mask. Each mask is
//! independent of the others, so a batch with several constrained sequences
//! can compute them in parallel. This crate has no threads of its own; it
//! hands the rows to a [`MaskFiller`]. [`SequentialMasks`] (the default)
//! fills them one by one; a thread-pool filler (e.g. `kestrel-skills`'
//! `ParallelMasks`, built on rayon) is installed with
//! [`crate::EngineLoop::set_mask_filler`].
//!
//! The row list handed over is built in buffers the scheduler reuses, so a
//! steady-state step allocates nothing here.

use crate::skill::{SequenceSkill, TokenMask};
use crate::TokenId;

/// One constrained row of a step: its skill, the drafts its step verifies
/// and its mask words, zeroed (nothing allowed) before the filler sees them.
pub struct MaskRow<'a> {
    pub skill: &'a mut dyn SequenceSkill,
    /// Drafts after the next token (empty: one mask).
    pub drafts: &'a [TokenId],
    /// `(drafts.len() + 1) * TokenMask::words_for(vocab_size)` words.
    pub words: &'a mut [u32],
}

impl MaskRow<'_> {
    /// Ask the skill for its mask (one per verified position): what every
    /// filler does per row.
    pub fn fill(&mut self, vocab_size: usize) {
        if self.drafts.is_empty() {
            let mut mask = TokenMask::new(self.words, vocab_size);
            self.skill.fill_mask(&mut mask);
        } else {
            self.skill
                .fill_masks_ahead(self.drafts, self.words, vocab_size);
        }
    }
}

impl std::fmt::Debug for MaskRow<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MaskRow")
            .field("words", &self.words.len())
            .finish_non_exhaustive()
    }
}

/// Fills the masks of one step's constrained rows (each row exactly once,
/// in any order, on any thread). Rows are disjoint: a filler may run them
/// concurrently.
pub trait MaskFiller: Send {
    fn fill(&mut self, rows: &mut [MaskRow<'_>], vocab_size: usize);
}

/// Fills masks one after the other on the scheduler thread.
#[derive(Debug, Default, Clone, Copy)]
pub struct SequentialMasks;

impl MaskFiller for SequentialMasks {
    fn fill(&mut self, rows: &mut [MaskRow<'_>], vocab_size: usize) {
        for row in rows {
            row.fill(vocab_size);
        }
    }
}

/// Reuse an empty vector's allocation for another element type of the same
/// size and alignment (references with other lifetimes, here). The
/// in-place `collect` keeps the buffer; `no_alloc.rs` checks that it does.
pub(crate) fn recycle<T, U>(mut v: Vec<T>) -> Vec<U> {
    v.clear();
    v.into_iter().map(|_| unreachable!("cleared")).collect()
}
