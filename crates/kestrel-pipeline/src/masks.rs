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
//! [`MaskBuilder`] lays out a step's masks (one per position a member may
//! sample) and hands the constrained rows to the filler, in buffers it
//! reuses, so a steady-state step allocates nothing here.

use crate::executor::MaskBatch;
use crate::scheduler::SlotStep;
use crate::sequence::Sequence;
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

/// Builds each sampled step's [`MaskBatch`], reusing its buffers.
pub(crate) struct MaskBuilder {
    words: Vec<u32>,
    flags: Vec<bool>,
    /// Step row of each sequence index while masks are built (`u32::MAX`: none).
    row_of: Vec<u32>,
    /// Empty between steps; their allocations are reused by `build`.
    chunks: Vec<Option<&'static mut [u32]>>,
    rows: Vec<MaskRow<'static>>,
    pub filler: Box<dyn MaskFiller>,
    words_per_row: usize,
    vocab_size: usize,
}

impl MaskBuilder {
    pub fn new(vocab_size: usize) -> Self {
        Self {
            words: Vec::new(),
            flags: Vec::new(),
            row_of: Vec::new(),
            chunks: Vec::new(),
            rows: Vec::new(),
            filler: Box::new(SequentialMasks),
            words_per_row: TokenMask::words_for(vocab_size),
            vocab_size,
        }
    }

    /// Fill the masks of `step` (whose members index `seqs`): one per
    /// position a member may sample (its next token, and one per draft its
    /// step verifies), see [`MaskBatch`]. `None` when no member needs one.
    pub fn build<P>(
        &mut self,
        seqs: &mut [Option<Sequence<P>>],
        step: &SlotStep,
    ) -> Option<MaskBatch<'_>> {
        self.flags.clear();
        if !step.samples {
            return None;
        }
        let indptr = &step.draft_indptr;
        // Member `r`'s first mask row, and how many it has.
        let first = |r: usize| match indptr.is_empty() {
            true => r,
            false => r + indptr[r] as usize,
        };
        let span = |r: usize| 1 + step.drafts_of(r).len();
        let mut any = false;
        for (r, &i) in step.rows.iter().enumerate() {
            let seq = seqs[i as usize].as_ref().expect("live sequence index");
            let c = seq.needs_mask();
            any |= c;
            self.flags.extend(std::iter::repeat_n(c, span(r)));
        }
        if !any {
            return None;
        }
        let wpr = self.words_per_row;
        let need = self.flags.len() * wpr;
        if self.words.len() < need {
            self.words.resize(need, 0);
        }
        // Pair each constrained sequence with its rows' words. Sequences
        // are visited in index order (one `iter_mut` gives disjoint
        // `&mut`s); `row_of` maps an index to its member.
        self.row_of.clear();
        self.row_of.resize(seqs.len(), u32::MAX);
        for (r, &i) in step.rows.iter().enumerate() {
            if self.flags[first(r)] {
                self.row_of[i as usize] = r as u32;
            }
        }
        let mut chunks: Vec<Option<&mut [u32]>> = recycle(std::mem::take(&mut self.chunks));
        let mut rest = &mut self.words[..need];
        for r in 0..step.rows.len() {
            let (head, tail) = rest.split_at_mut(span(r) * wpr);
            chunks.push(Some(head));
            rest = tail;
        }
        let mut jobs: Vec<MaskRow<'_>> = recycle(std::mem::take(&mut self.rows));
        for (seq, &r) in seqs.iter_mut().zip(&self.row_of) {
            if r == u32::MAX {
                continue;
            }
            let seq = seq.as_mut().expect("live sequence index");
            let words = chunks[r as usize].take().expect("one member per sequence");
            words.fill(0);
            jobs.push(MaskRow {
                skill: &mut *seq.skill,
                drafts: step.drafts_of(r as usize),
                words,
            });
        }
        self.filler.fill(&mut jobs, self.vocab_size);
        self.rows = recycle(jobs);
        self.chunks = recycle(chunks);
        Some(MaskBatch {
            words_per_row: wpr,
            words: &self.words,
            constrained: &self.flags,
        })
    }
}

/// Reuse an empty vector's allocation for another element type of the same
/// size and alignment (references with other lifetimes, here). The
/// in-place `collect` keeps the buffer; `no_alloc.rs` checks that it does.
fn recycle<T, U>(mut v: Vec<T>) -> Vec<U> {
    v.clear();
    v.into_iter().map(|_| unreachable!("cleared")).collect()
}
