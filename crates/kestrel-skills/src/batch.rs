//! Mask computation for a whole batch, fanned out across constrained rows.
//!
//! The output is the layout `kestrel_pipeline::executor::MaskBatch` wants:
//! `rows * words_for(vocab)` contiguous words plus one `constrained` flag per
//! row. Unconstrained rows (text skills, zombies) get an all-ones row, so a
//! runtime that ignores the flags still samples them correctly. With two or
//! more constrained rows the work runs on rayon's pool; no heap allocation is
//! made here (llguidance itself allocates its result bitset per call).

use kestrel_pipeline::{SequenceSkill, TokenMask};
use rayon::prelude::*;

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
