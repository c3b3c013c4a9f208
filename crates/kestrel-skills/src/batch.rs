//! Mask computation for a whole batch, fanned out across constrained rows.
//!
//! [`ParallelMasks`] is the pipeline's [`MaskFiller`] on rayon's pool: the
//! engine installs it so a step's constrained rows compute their masks
//! concurrently, under the forward. [`fill_batch_masks`] does the same for
//! callers driving skills without the pipeline, into the layout
//! `kestrel_pipeline::MaskBatch` wants: `rows * words_for(vocab)` contiguous
//! words plus one `constrained` flag per row. Unconstrained rows (text
//! skills, zombies) get an all-ones row there, so a runtime that ignores the
//! flags still samples them correctly. No heap allocation is made here
//! (llguidance itself allocates its result bitset per call).

use kestrel_pipeline::{MaskFiller, MaskRow, SequenceSkill, TokenMask};
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// Fills a step's masks on the calling thread, spilling the remaining rows
/// onto rayon's global pool once the step has taken longer than `spill_after`.
///
/// Handing rows to sleeping pool threads costs wake-ups (about 10-15 µs
/// measured here), while most JSON masks take a few microseconds: a step of
/// cheap rows never pays for the hand-off. An expensive step (a large
/// grammar, lexer states built on first use) spills what is left to the
/// pool after `spill_after`, halving the rows over `rayon::join` (no heap
/// allocation), so its wall time approaches the longest row, not the sum.
#[derive(Debug, Clone, Copy)]
pub struct ParallelMasks {
    pub spill_after: Duration,
}

impl Default for ParallelMasks {
    fn default() -> Self {
        Self {
            spill_after: Duration::from_micros(50),
        }
    }
}

impl ParallelMasks {
    /// Spill every step of two or more rows at once (for tests and benches).
    pub fn always() -> Self {
        Self {
            spill_after: Duration::ZERO,
        }
    }
}

impl MaskFiller for ParallelMasks {
    fn fill(&mut self, rows: &mut [MaskRow<'_>], vocab_size: usize) {
        let start = Instant::now();
        let can_spill = rayon::current_num_threads() > 1;
        for i in 0..rows.len() {
            if can_spill && rows.len() - i >= 2 && start.elapsed() >= self.spill_after {
                fill_split(&mut rows[i..], vocab_size);
                return;
            }
            rows[i].fill(vocab_size);
        }
    }
}

/// Fill `rows` on rayon's pool by halving: `join`'s jobs live on the stack,
/// so spilling allocates nothing.
fn fill_split(rows: &mut [MaskRow<'_>], vocab_size: usize) {
    match rows {
        [] => {}
        [row] => row.fill(vocab_size),
        _ => {
            let (a, b) = rows.split_at_mut(rows.len() / 2);
            rayon::join(|| fill_split(a, vocab_size), || fill_split(b, vocab_size));
        }
    }
}

/// Fills `words` (row `i` at `i * words_for(vocab_size)`) and `constrained`
/// for `skills`, in row order.
///
/// # Panics
/// If `words` or `constrained` is too short for `skills.len()` rows.
pub fn fill_batch_masks<S>(
    skills: &mut [&mut S],
    vocab_size: usize,
    words: &mut [u32],
    constrained: &mut [bool],
) where
    S: SequenceSkill + ?Sized,
{
    let per_row = TokenMask::words_for(vocab_size);
    let rows = skills.len();
    assert!(
        words.len() >= rows * per_row,
        "mask buffer too short for {rows} rows"
    );
    assert!(
        constrained.len() >= rows,
        "constrained flags too short for {rows} rows"
    );
    let words = &mut words[..rows * per_row];
    let constrained = &mut constrained[..rows];
    let mut n_constrained = 0;
    for (flag, skill) in constrained.iter_mut().zip(skills.iter()) {
        *flag = skill.is_constrained();
        n_constrained += usize::from(*flag);
    }
    let fill = |((skill, row), &flag): ((&mut &mut S, &mut [u32]), &bool)| {
        let mut mask = TokenMask::new(row, vocab_size);
        if flag {
            skill.fill_mask(&mut mask);
        } else {
            mask.allow_all();
        }
    };
    if n_constrained >= 2 {
        skills
            .par_iter_mut()
            .zip(words.par_chunks_mut(per_row))
            .zip(constrained.par_iter())
            .for_each(fill);
    } else {
        skills
            .iter_mut()
            .zip(words.chunks_mut(per_row))
            .zip(constrained.iter())
            .for_each(fill);
    }
}
