//! Mask computation for a whole batch, fanned out across constrained rows.
//!
//! [`ParallelMasks`] is the pipeline's [`MaskFiller`] on rayon's pool: the
//! engine installs it (on hosts with spare cores) so a slow step's
//! constrained rows compute their masks concurrently, under the forward.
//! [`fill_batch_masks`] runs the same filler for callers driving skills
//! without the pipeline, into the layout
//! `kestrel_pipeline::MaskBatch` wants: `rows * words_for(vocab)` contiguous
//! words plus one `constrained` flag per row. Unconstrained rows (text
//! skills, zombies) get an all-ones row there, so a runtime that ignores the
//! flags still samples them correctly. No heap allocation is made here for
//! unconstrained rows; constrained ones take one row list per call
//! (llguidance itself allocates its result bitset per mask).

use kestrel_pipeline::{MaskFiller, MaskRow, SequenceSkill, TokenMask};
use std::time::{Duration, Instant};

/// Fills a step's masks on the calling thread, spilling the remaining rows
/// onto rayon's global pool once the step has taken longer than `spill_after`.
///
/// Handing rows to sleeping pool threads costs wake-ups, while most JSON
/// masks take a few microseconds (median 5.2 µs): a step of cheap rows
/// never pays for the hand-off. An expensive step (a large grammar, lexer
/// states built on first use) spills what is left to the pool after
/// `spill_after`, halving the rows over `rayon::join` (no heap allocation),
/// so that with idle cores its wall time tends toward the longest row, not
/// the sum. Without idle cores it loses: on the 2-core development machine
/// (`cargo bench -p kestrel-skills --bench mask`) 16 JSON rows took 157 µs
/// against 123 µs sequentially, which is why the engine installs it only
/// where cores are left over; it has not been measured on such a host.
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
        for i in 0..rows.len() {
            // The pool is consulted (and started, on first use) only once a
            // step is slow enough to spill.
            if rows.len() - i >= 2
                && start.elapsed() >= self.spill_after
                && rayon::current_num_threads() > 1
            {
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
pub fn fill_batch_masks<S: SequenceSkill>(
    skills: &mut [&mut S],
    vocab_size: usize,
    words: &mut [u32],
    constrained: &mut [bool],
) {
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
    // Constrained rows go to the pipeline's filler (zeroed first, as the
    // scheduler does); the others allow everything. No rows, no allocation.
    let mut jobs = Vec::new();
    for ((skill, row), flag) in skills
        .iter_mut()
        .zip(words.chunks_mut(per_row))
        .zip(constrained.iter_mut())
    {
        *flag = skill.is_constrained();
        if *flag {
            row.fill(0);
            jobs.push(MaskRow {
                skill: &mut **skill,
                drafts: &[],
                words: row,
            });
        } else {
            TokenMask::new(row, vocab_size).allow_all();
        }
    }
    ParallelMasks::default().fill(&mut jobs, vocab_size);
}
