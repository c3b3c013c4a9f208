//! One step's KV bookkeeping, written once for every runtime:
//! [`SeqBook::plan_step`] at launch (each row's span of positions, the
//! kernel's page layout, the lengths advanced) and [`SeqBook::commit_step`]
//! once the step has run (a prefill's full prompt pages published to the
//! prefix cache, a verified row's rejected drafts rolled back). The plan is
//! a [`KvStep`] the runtime keeps with its slot until the commit, so the
//! tokens to publish are the ones the step computed, on every backend.
//! O(rows + pages written) per call; no allocation once the buffers grew.

use std::hash::Hash;

use crate::{KvError, PagedIndices, RowId, SeqBook};

/// What one sequence computes in a step.
#[derive(Debug, Clone, Copy)]
pub enum Span<'a> {
    /// Decode: its input token and `drafts` draft tokens, from its KV length on.
    Decode {
        /// Draft tokens the row verifies after its input token.
        drafts: usize,
    },
    /// Prefill: `prompt[start..end]`. `start` must be where the sequence's
    /// KV ends (its prefix-cache hit at admission, else the last chunk's end).
    Chunk {
        /// The whole prompt (the step keeps `prompt[..end]` to publish).
        prompt: &'a [u32],
        /// First prompt token computed.
        start: usize,
        /// One past the last prompt token computed.
        end: usize,
    },
}

/// One step's KV plan, row by row: written by [`SeqBook::plan_step`], read
/// by the kernels, handed back to [`SeqBook::commit_step`]. Kept per slot
/// and reused, so a steady-state step allocates nothing.
#[derive(Debug, Clone)]
pub struct KvStep<K> {
    /// Each row's sequence.
    pub ids: Vec<K>,
    /// Each row's page-table row.
    pub rows: Vec<RowId>,
    /// Each row's first computed position (its KV length before the step).
    pub starts: Vec<u32>,
    /// Each row's KV length once the step has run.
    pub ends: Vec<u32>,
    /// Prefill: each row's prompt up to its chunk's end (the forward reads
    /// the chunk, the commit publishes all of it); empty for decode.
    pub tokens: Vec<u32>,
    /// Prefill: row `i`'s tokens are `tokens[token_indptr[i]..token_indptr[i + 1]]`.
    pub token_indptr: Vec<u32>,
    /// The rows' page layout at their `ends`.
    pub indices: PagedIndices,
}

impl<K> Default for KvStep<K> {
    fn default() -> Self {
        KvStep {
            ids: Vec::new(),
            rows: Vec::new(),
            starts: Vec::new(),
            ends: Vec::new(),
            tokens: Vec::new(),
            token_indptr: Vec::new(),
            indices: PagedIndices::default(),
        }
    }
}

impl<K> KvStep<K> {
    /// Rows in the step.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the step has no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Whether the step prefills prompt chunks.
    pub fn is_prefill(&self) -> bool {
        !self.token_indptr.is_empty()
    }

    /// Prefill: row `i`'s prompt up to its chunk's end (empty for decode).
    pub fn tokens(&self, i: usize) -> &[u32] {
        if self.token_indptr.is_empty() {
            return &[];
        }
        &self.tokens[self.token_indptr[i] as usize..self.token_indptr[i + 1] as usize]
    }

    fn clear(&mut self) {
        self.ids.clear();
        self.rows.clear();
        self.starts.clear();
        self.ends.clear();
        self.tokens.clear();
        self.token_indptr.clear();
    }
}

impl<K: Hash + Eq + Copy, M> SeqBook<K, M> {
    /// Plans a step over `seqs` into `step`: each row's KV row and span of
    /// positions, and the page layout of the rows at their new lengths.
    /// Only when all of it succeeded are the sequences' lengths advanced
    /// (for a row with drafts, to their end; [`commit_step`](Self::commit_step)
    /// rolls back the rejected), so a refused plan leaves the book as it was.
    ///
    /// # Errors
    /// [`KvError::UnknownSequence`], [`KvError::ChunkOutOfOrder`], or
    /// [`KvError::KvLenExceedsReserved`] when a row's pages do not cover its
    /// span (the runtime should have grown it).
    pub fn plan_step<'a>(
        &mut self,
        seqs: impl IntoIterator<Item = (K, Span<'a>)>,
        step: &mut KvStep<K>,
    ) -> Result<(), KvError> {
        step.clear();
        self.lens.clear();
        for (index, (id, span)) in seqs.into_iter().enumerate() {
            let seq = self
                .seqs
                .get(&id)
                .ok_or(KvError::UnknownSequence { index })?;
            let (start, end) = match span {
                Span::Decode { drafts } => (seq.len, seq.len + 1 + drafts),
                Span::Chunk { prompt, start, end } => {
                    if start != seq.len || start >= end || end > prompt.len() {
                        return Err(KvError::ChunkOutOfOrder {
                            index,
                            start,
                            written: seq.len,
                        });
                    }
                    if step.token_indptr.is_empty() {
                        step.token_indptr.push(0);
                    }
                    step.tokens.extend_from_slice(&prompt[..end]);
                    step.token_indptr.push(to_u32(step.tokens.len())?);
                    (start, end)
                }
            };
            step.ids.push(id);
            step.rows.push(seq.row);
            step.starts.push(to_u32(start)?);
            step.ends.push(to_u32(end)?);
            self.lens.push((seq.row, end));
        }
        self.table.write_indices(&self.lens, &mut step.indices)?;
        for (id, &end) in step.ids.iter().zip(&step.ends) {
            if let Some(seq) = self.seqs.get_mut(id) {
                seq.len = end as usize;
            }
        }
        Ok(())
    }

    /// Books a step that has run: a prefill's rows publish their prompt's
    /// full pages to the prefix cache; with `accepted` (the step's
    /// `row_indptr`: row `i` kept `accepted[i + 1] - accepted[i]` tokens),
    /// each row that verified drafts keeps its input token and the drafts
    /// it accepted, and gives back the pages past them. Rows without drafts
    /// are left alone: the next step may already have advanced them.
    /// Sequences released since the launch are skipped.
    ///
    /// # Errors
    /// The page table's, should a rollback cut into published pages (a
    /// bookkeeping bug).
    pub fn commit_step(
        &mut self,
        step: &KvStep<K>,
        accepted: Option<&[u32]>,
    ) -> Result<(), KvError> {
        let accepted = accepted.filter(|a| !a.is_empty());
        if !step.is_prefill() && accepted.is_none() {
            return Ok(());
        }
        for (i, (id, &row)) in step.ids.iter().zip(&step.rows).enumerate() {
            let Some(seq) = self.seqs.get_mut(id).filter(|s| s.row == row) else {
                continue;
            };
            if step.is_prefill() {
                self.table.register_prefix(row, step.tokens(i));
                continue;
            }
            let (start, end) = (step.starts[i] as usize, step.ends[i] as usize);
            if let Some(kept) = accepted.filter(|_| end > start + 1) {
                let len = start + (kept[i + 1] - kept[i]) as usize;
                seq.len = len;
                self.table.shrink(row, len)?;
            }
        }
        Ok(())
    }
}

fn to_u32(value: usize) -> Result<u32, KvError> {
    u32::try_from(value).map_err(|_| KvError::IndexOverflow { value })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Admission, PageTable, PageTableConfig};

    fn book() -> SeqBook<u64, ()> {
        let table = PageTable::new(PageTableConfig {
            max_rows: 4,
            num_pages: 16,
            page_size: 4,
            enable_prefix_cache: true,
        })
        .unwrap();
        SeqBook::new(table)
    }

    fn admit(b: &mut SeqBook<u64, ()>, id: u64, prompt: &[u32], reserve: usize) {
        let a = Admission {
            id,
            prompt,
            reserve,
            meta: (),
            fork_of: None,
        };
        b.admit_all([a]).unwrap();
    }

    #[test]
    fn chunks_resume_in_order_and_publish_what_they_computed() {
        let mut b = book();
        let prompt: Vec<u32> = (0..10).collect();
        admit(&mut b, 1, &prompt, 10);
        assert_eq!(b.get(1).unwrap().len, 0, "nothing written at admission");
        let mut step = KvStep::default();
        let chunk = |start, end| Span::Chunk {
            prompt: &prompt,
            start,
            end,
        };
        b.plan_step([(1, chunk(0, 6))], &mut step).unwrap();
        assert_eq!(
            (step.starts[0], step.ends[0], step.tokens(0).len()),
            (0, 6, 6)
        );
        assert_eq!(step.indices.kv_indptr, [0, 2]);
        // A chunk that skips tokens is refused, and books nothing.
        let mut other = KvStep::default();
        assert_eq!(
            b.plan_step([(1, chunk(7, 10))], &mut other),
            Err(KvError::ChunkOutOfOrder {
                index: 0,
                start: 7,
                written: 6
            })
        );
        assert_eq!(
            b.plan_step([(9, chunk(0, 4))], &mut other),
            Err(KvError::UnknownSequence { index: 0 })
        );
        assert_eq!(b.get(1).unwrap().len, 6);
        // The first chunk has run: its full page is published.
        b.commit_step(&step, None).unwrap();
        assert_eq!(b.kv_stats().cached_pages + b.table().used_pages(), 3);
        b.plan_step([(1, chunk(6, 10))], &mut step).unwrap();
        assert_eq!(step.tokens(0), &prompt[..]);
        b.commit_step(&step, None).unwrap();
        // A second sequence with the same prompt hits both full pages.
        admit(&mut b, 2, &prompt, 10);
        assert_eq!((b.cached_prompt_tokens(2), b.get(2).unwrap().len), (8, 8));
        b.table().check_invariants().unwrap();
    }

    #[test]
    fn decode_advances_and_drafts_roll_back_to_the_accepted() {
        let mut b = book();
        let p: Vec<u32> = (0..5).collect();
        admit(&mut b, 1, &p, 5);
        admit(&mut b, 2, &p[..3], 3);
        for id in [1, 2] {
            b.get_mut(id).unwrap().len = if id == 1 { 5 } else { 3 };
        }
        // The pages must cover the span: growth is the runtime's call.
        let mut step = KvStep::default();
        let spans = [
            (1, Span::Decode { drafts: 3 }),
            (2, Span::Decode { drafts: 0 }),
        ];
        assert!(matches!(
            b.plan_step(spans, &mut step),
            Err(KvError::KvLenExceedsReserved { kv_len: 9, .. })
        ));
        assert_eq!(b.get(1).unwrap().len, 5, "a refused plan books nothing");
        assert!(b.grow(1, 9) && b.grow(2, 4));
        b.plan_step(spans, &mut step).unwrap();
        assert_eq!(
            (step.starts.as_slice(), step.ends.as_slice()),
            (&[5, 3][..], &[9, 4][..])
        );
        assert_eq!((b.get(1).unwrap().len, b.get(2).unwrap().len), (9, 4));
        // Row 1 kept its input token and one draft (2 tokens), row 2 its one.
        b.commit_step(&step, Some(&[0, 2, 3])).unwrap();
        assert_eq!((b.get(1).unwrap().len, b.get(2).unwrap().len), (7, 4));
        assert_eq!(b.kv_stats().used_pages, 3);
        b.table().check_invariants().unwrap();
    }
}
