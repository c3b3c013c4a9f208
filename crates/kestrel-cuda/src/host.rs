//! Host-side planning, pure and unit-tested: CUDA-graph batch buckets and
//! padding, the packing of a step's metadata into one `u32` buffer (copied
//! to the device in one H2D), the RoPE table and bias stacking (weights:
//! `crate::quant`).
//!
//! Decode metadata has fixed offsets (by capacity) so captured graphs read
//! stable addresses; padding rows of a bucket read the reserved KV row 0 and
//! write their K/V into a trash page past the pool, so they can never touch a
//! live sequence. Prefill metadata is sized per step (prefill is not graphed).

use kestrel_kv::PagedIndices;
use kestrel_model::LayerRope;
use kestrel_pipeline::TokenMask;

/// Batch sizes the decode forward is captured for: 1, 2, 4, 8, 16, then
/// every multiple of 16, and `max_batch` itself.
pub fn graph_buckets(max_batch: usize) -> Vec<usize> {
    let mut b: Vec<usize> = [1, 2, 4, 8]
        .into_iter()
        .chain((1..).map(|k| 16 * k).take_while(|&s| s < max_batch))
        .filter(|&s| s < max_batch)
        .collect();
    b.push(max_batch.max(1));
    b.dedup();
    b
}

/// The smallest bucket holding `n` rows, if any.
pub fn choose_bucket(buckets: &[usize], n: usize) -> Option<usize> {
    buckets.iter().copied().find(|&b| b >= n && n > 0)
}

/// Fixed offsets (in `u32` words) of a slot's decode metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLayout {
    /// Rows the layout holds (the largest bucket).
    pub cap_rows: usize,
    /// Page indices it holds (real pages plus one trash entry per padding row).
    pub cap_pages: usize,
}

impl DecodeLayout {
    pub fn rows(&self) -> usize {
        0
    }
    pub fn positions(&self) -> usize {
        self.cap_rows
    }
    pub fn row_seq(&self) -> usize {
        2 * self.cap_rows
    }
    pub fn slot_mapping(&self) -> usize {
        3 * self.cap_rows
    }
    pub fn sample_pos(&self) -> usize {
        4 * self.cap_rows
    }
    pub fn kv_indptr(&self) -> usize {
        5 * self.cap_rows
    }
    pub fn kv_indices(&self) -> usize {
        6 * self.cap_rows + 1
    }
    pub fn total_words(&self) -> usize {
        self.kv_indices() + self.cap_pages
    }
}

/// Why a step could not be packed (a planning bug: the step is rejected
/// before dispatch).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PackError {
    #[error("{rows} rows do not fit bucket {bucket} / capacity {cap}")]
    TooManyRows {
        rows: usize,
        bucket: usize,
        cap: usize,
    },
    #[error("{pages} page indices exceed capacity {cap}")]
    TooManyPages { pages: usize, cap: usize },
    #[error("row {row}: position {pos} is not covered by its {pages} pages")]
    PositionOutsidePages { row: usize, pos: u32, pages: usize },
    #[error("indices describe {got} sequences, expected {expected}")]
    IndicesMismatch { got: usize, expected: usize },
}

/// One decode row: its KV row and the position of its input token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeRow {
    pub kv_row: u32,
    pub pos: u32,
}

/// Pack a decode step of `rows.len()` rows, padded to `bucket`, into `out`
/// (at `layout`'s offsets). `idx` holds each row's pages (already covering
/// `pos + 1` tokens). Returns the number of words to copy to the device.
pub fn pack_decode(
    layout: &DecodeLayout,
    rows: &[DecodeRow],
    idx: &PagedIndices,
    bucket: usize,
    trash_page: u32,
    page_size: usize,
    out: &mut [u32],
) -> Result<usize, PackError> {
    let n = rows.len();
    if n > bucket || bucket > layout.cap_rows || out.len() < layout.total_words() {
        return Err(PackError::TooManyRows {
            rows: n,
            bucket,
            cap: layout.cap_rows,
        });
    }
    if idx.len() != n || idx.kv_indptr.len() != n + 1 {
        return Err(PackError::IndicesMismatch {
            got: idx.len(),
            expected: n,
        });
    }
    let real_pages = idx.kv_indptr[n] as usize;
    let total_pages = real_pages + (bucket - n);
    if total_pages > layout.cap_pages {
        return Err(PackError::TooManyPages {
            pages: total_pages,
            cap: layout.cap_pages,
        });
    }
    let ps = page_size as u32;
    for (i, r) in rows.iter().enumerate() {
        let (a, b) = (idx.kv_indptr[i] as usize, idx.kv_indptr[i + 1] as usize);
        let page_no = (r.pos / ps) as usize;
        if a + page_no >= b {
            return Err(PackError::PositionOutsidePages {
                row: i,
                pos: r.pos,
                pages: b - a,
            });
        }
        out[layout.rows() + i] = r.kv_row;
        out[layout.positions() + i] = r.pos;
        out[layout.row_seq() + i] = i as u32;
        out[layout.slot_mapping() + i] = idx.kv_indices[a + page_no] * ps + r.pos % ps;
        out[layout.sample_pos() + i] = r.pos + 1;
        out[layout.kv_indptr() + i] = idx.kv_indptr[i];
    }
    let ki = layout.kv_indices();
    out[ki..ki + real_pages].copy_from_slice(&idx.kv_indices[..real_pages]);
    for (j, i) in (n..bucket).enumerate() {
        out[layout.rows() + i] = 0;
        out[layout.positions() + i] = 0;
        out[layout.row_seq() + i] = i as u32;
        out[layout.slot_mapping() + i] = trash_page * ps;
        out[layout.sample_pos() + i] = 0;
        out[layout.kv_indptr() + i] = (real_pages + j) as u32;
        out[ki + real_pages + j] = trash_page;
    }
    out[layout.kv_indptr() + bucket] = total_pages as u32;
    Ok(ki + total_pages)
}

/// One sequence of a prefill step: tokens `start..prompt.len()` are computed
/// (the first `start` are in KV: served from the prefix cache or written by
/// an earlier chunk).
#[derive(Debug, Clone, Copy)]
pub struct PrefillSeq<'a> {
    pub kv_row: u32,
    /// The prompt up to this step's chunk end.
    pub prompt: &'a [u32],
    pub start: usize,
    /// The chunk ends the whole prompt: the step samples the sequence's
    /// next token from its last row.
    pub samples: bool,
    /// This step admits the sequence: its penalty counts are reset, then
    /// count `generated` (the tokens a preempted sequence had sampled).
    pub admitted: bool,
    pub generated: &'a [u32],
}

/// Offsets of a prefill step's metadata (sized per step).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefillLayout {
    /// Token rows computed.
    pub tokens_n: usize,
    pub seqs: usize,
    /// Sequences sampled (their chunk ends their prompt), in step order.
    pub sampled: usize,
    /// Sequences admitted by this step.
    pub admitted: usize,
    /// Generated tokens of the re-admitted sequences, counted for penalties.
    pub counted: usize,
    pub pages: usize,
}

impl PrefillLayout {
    pub fn tokens(&self) -> usize {
        0
    }
    pub fn positions(&self) -> usize {
        self.tokens_n
    }
    pub fn row_seq(&self) -> usize {
        2 * self.tokens_n
    }
    pub fn slot_mapping(&self) -> usize {
        3 * self.tokens_n
    }
    /// `i32` per token: the logits row it feeds (the index of its sequence
    /// among the sampled), or -1.
    pub fn out_row(&self) -> usize {
        4 * self.tokens_n
    }
    /// KV row of each sampled sequence.
    pub fn kv_rows(&self) -> usize {
        5 * self.tokens_n
    }
    /// RNG position of each sampled sequence (its prompt's length).
    pub fn sample_pos(&self) -> usize {
        self.kv_rows() + self.sampled
    }
    /// KV row of each admitted sequence (penalty counts reset).
    pub fn admit_rows(&self) -> usize {
        self.sample_pos() + self.sampled
    }
    /// Admitted sequence `i` counts `count_tokens[count_indptr[i]..count_indptr[i + 1]]`.
    pub fn count_indptr(&self) -> usize {
        self.admit_rows() + self.admitted
    }
    pub fn count_tokens(&self) -> usize {
        self.count_indptr() + self.admitted + 1
    }
    pub fn kv_indptr(&self) -> usize {
        self.count_tokens() + self.counted
    }
    pub fn kv_indices(&self) -> usize {
        self.kv_indptr() + self.seqs + 1
    }
    pub fn total_words(&self) -> usize {
        self.kv_indices() + self.pages
    }
}

/// Pack a prefill step into `out` (resized as needed). `idx` holds each
/// sequence's pages covering its chunk.
pub fn pack_prefill(
    seqs: &[PrefillSeq<'_>],
    idx: &PagedIndices,
    page_size: usize,
    out: &mut Vec<u32>,
) -> Result<PrefillLayout, PackError> {
    if idx.len() != seqs.len() {
        return Err(PackError::IndicesMismatch {
            got: idx.len(),
            expected: seqs.len(),
        });
    }
    let admitted = seqs.iter().filter(|s| s.admitted);
    let l = PrefillLayout {
        tokens_n: seqs.iter().map(|s| s.prompt.len() - s.start).sum(),
        seqs: seqs.len(),
        sampled: seqs.iter().filter(|s| s.samples).count(),
        admitted: admitted.clone().count(),
        counted: admitted.map(|s| s.generated.len()).sum(),
        pages: idx.kv_indptr[seqs.len()] as usize,
    };
    out.clear();
    out.resize(l.total_words(), 0);
    let ps = page_size as u32;
    let (mut t, mut sampled, mut admit, mut counted) = (0, 0, 0, 0);
    out[l.count_indptr()] = 0;
    for (s, seq) in seqs.iter().enumerate() {
        let a = idx.kv_indptr[s] as usize;
        let b = idx.kv_indptr[s + 1] as usize;
        for pos in seq.start..seq.prompt.len() {
            let page_no = pos / page_size;
            if a + page_no >= b {
                return Err(PackError::PositionOutsidePages {
                    row: s,
                    pos: pos as u32,
                    pages: b - a,
                });
            }
            out[l.tokens() + t] = seq.prompt[pos];
            out[l.positions() + t] = pos as u32;
            out[l.row_seq() + t] = s as u32;
            out[l.slot_mapping() + t] = idx.kv_indices[a + page_no] * ps + pos as u32 % ps;
            out[l.out_row() + t] = if seq.samples && pos + 1 == seq.prompt.len() {
                sampled as u32
            } else {
                -1i32 as u32
            };
            t += 1;
        }
        if seq.samples {
            out[l.kv_rows() + sampled] = seq.kv_row;
            out[l.sample_pos() + sampled] = seq.prompt.len() as u32;
            sampled += 1;
        }
        if seq.admitted {
            out[l.admit_rows() + admit] = seq.kv_row;
            let ct = l.count_tokens() + counted;
            out[ct..ct + seq.generated.len()].copy_from_slice(seq.generated);
            counted += seq.generated.len();
            admit += 1;
            out[l.count_indptr() + admit] = counted as u32;
        }
    }
    let ip = l.kv_indptr();
    out[ip..ip + seqs.len() + 1].copy_from_slice(&idx.kv_indptr[..seqs.len() + 1]);
    let ki = l.kv_indices();
    out[ki..ki + l.pages].copy_from_slice(&idx.kv_indices[..l.pages]);
    Ok(l)
}

/// One member of a decode step that verifies drafts: its KV row, the
/// position of its input token, and its drafts (positions after it).
#[derive(Debug, Clone, Copy)]
pub struct VerifyRow<'a> {
    pub kv_row: u32,
    pub pos: u32,
    pub drafts: &'a [u32],
}

/// Offsets of a verifying decode step's metadata (sized per step): one
/// forward row per member and per draft, member by member.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VerifyLayout {
    /// Forward (and sampled) rows: members plus drafts.
    pub rows: usize,
    pub members: usize,
    pub pages: usize,
}

impl VerifyLayout {
    /// The forward's tokens, written on the device (`verify_inputs`).
    pub fn tokens(&self) -> usize {
        0
    }
    pub fn positions(&self) -> usize {
        self.rows
    }
    pub fn row_seq(&self) -> usize {
        2 * self.rows
    }
    pub fn slot_mapping(&self) -> usize {
        3 * self.rows
    }
    /// `0..rows`: the sampled rows' counts rows in the draft scratch.
    pub fn sample_rows(&self) -> usize {
        4 * self.rows
    }
    /// Each row's RNG position (its position + 1, as decoding samples it).
    pub fn sample_pos(&self) -> usize {
        5 * self.rows
    }
    pub fn kv_rows(&self) -> usize {
        6 * self.rows
    }
    /// Member `i`'s rows are `qo[i]..qo[i + 1]`.
    pub fn qo(&self) -> usize {
        self.kv_rows() + self.members
    }
    /// Every member's drafts, in member order.
    pub fn drafts(&self) -> usize {
        self.qo() + self.members + 1
    }
    pub fn kv_indptr(&self) -> usize {
        self.drafts() + self.rows - self.members
    }
    pub fn kv_indices(&self) -> usize {
        self.kv_indptr() + self.members + 1
    }
    pub fn total_words(&self) -> usize {
        self.kv_indices() + self.pages
    }
}

/// Pack a verifying decode step into `out` (resized as needed). `idx`
/// holds each member's pages covering its input token and drafts.
pub fn pack_verify(
    members: &[VerifyRow<'_>],
    idx: &PagedIndices,
    page_size: usize,
    out: &mut Vec<u32>,
) -> Result<VerifyLayout, PackError> {
    if idx.len() != members.len() {
        return Err(PackError::IndicesMismatch {
            got: idx.len(),
            expected: members.len(),
        });
    }
    let l = VerifyLayout {
        rows: members.iter().map(|m| 1 + m.drafts.len()).sum(),
        members: members.len(),
        pages: idx.kv_indptr[members.len()] as usize,
    };
    out.clear();
    out.resize(l.total_words(), 0);
    let ps = page_size as u32;
    let (mut q, mut d) = (0, 0);
    for (i, m) in members.iter().enumerate() {
        let (a, b) = (idx.kv_indptr[i] as usize, idx.kv_indptr[i + 1] as usize);
        out[l.qo() + i] = q as u32;
        for j in 0..=m.drafts.len() {
            let pos = m.pos + j as u32;
            let page_no = (pos / ps) as usize;
            if a + page_no >= b {
                return Err(PackError::PositionOutsidePages {
                    row: i,
                    pos,
                    pages: b - a,
                });
            }
            out[l.positions() + q] = pos;
            out[l.row_seq() + q] = i as u32;
            out[l.slot_mapping() + q] = idx.kv_indices[a + page_no] * ps + pos % ps;
            out[l.sample_rows() + q] = q as u32;
            out[l.sample_pos() + q] = pos + 1;
            q += 1;
        }
        out[l.kv_rows() + i] = m.kv_row;
        out[l.drafts() + d..l.drafts() + d + m.drafts.len()].copy_from_slice(m.drafts);
        d += m.drafts.len();
    }
    out[l.qo() + members.len()] = q as u32;
    let ip = l.kv_indptr();
    out[ip..ip + members.len() + 1].copy_from_slice(&idx.kv_indptr[..members.len() + 1]);
    let ki = l.kv_indices();
    out[ki..ki + l.pages].copy_from_slice(&idx.kv_indices[..l.pages]);
    Ok(l)
}

/// cos/sin table for positions `0..max_pos`, computed exactly as
/// kestrel-cpu's `ops::rope_table` (f64, rounded once): row `p` is
/// `[cos_0..cos_{d/2}, sin_0..sin_{d/2}]`.
pub fn rope_table(max_pos: usize, head_dim: usize, theta: f32) -> Vec<f32> {
    let plain = LayerRope {
        theta,
        freq_factors: None,
        linear_scale: 1.0,
        window: None,
    };
    rope_table_of(&plain, max_pos, head_dim)
}

/// The table of one layer RoPE (Llama 3's frequency factors and linear
/// scaling, Gemma 3's local base): cos/sin of
/// `(pos / linear_scale) * theta^(-2i/head_dim) / factor_i` in f64, rounded
/// once, as kestrel-cpu's `RopeSpec::table` (plain: its `ops::rope_table`).
pub fn rope_table_of(r: &LayerRope<'_>, max_pos: usize, head_dim: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0f32; max_pos * head_dim];
    for (pos, row) in out.chunks_exact_mut(head_dim).enumerate() {
        let p = pos as f64 / r.linear_scale as f64;
        for i in 0..half {
            let mut freq = (r.theta as f64).powf(-2.0 * i as f64 / head_dim as f64);
            if let Some(ff) = r.freq_factors {
                freq /= ff[i] as f64;
            }
            let ang = p * freq;
            row[i] = ang.cos() as f32;
            row[half + i] = ang.sin() as f32;
        }
    }
    out
}

/// Optional biases stacked by rows, as Q|K|V (zeros where absent).
pub fn stack_bias(parts: &[(Option<&Vec<f32>>, usize)]) -> Vec<f32> {
    parts
        .iter()
        .flat_map(|(b, n)| match b {
            Some(v) => v.to_vec(),
            None => vec![0.0; *n],
        })
        .collect()
}

/// Words of mask buffer for `rows` rows of `vocab` tokens: one flag per row,
/// then `words_per_row` words per row.
pub fn mask_words(rows: usize, vocab: usize) -> usize {
    rows + rows * TokenMask::words_for(vocab)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kestrel_kv::{PageTable, PageTableConfig};

    #[test]
    fn buckets_cover_every_batch_size_with_bounded_padding() {
        assert_eq!(graph_buckets(1), vec![1]);
        assert_eq!(graph_buckets(8), vec![1, 2, 4, 8]);
        assert_eq!(graph_buckets(32), vec![1, 2, 4, 8, 16, 32]);
        assert_eq!(graph_buckets(40), vec![1, 2, 4, 8, 16, 32, 40]);
        for max in 1..=80 {
            let b = graph_buckets(max);
            assert!(b.windows(2).all(|w| w[0] < w[1]), "{b:?}");
            assert_eq!(*b.last().unwrap(), max);
            for n in 1..=max {
                let k = choose_bucket(&b, n).unwrap();
                assert!(k >= n && k <= max);
                assert!(k - n < 16.max(n), "bucket {k} for {n}");
            }
            assert_eq!(choose_bucket(&b, max + 1), None);
            assert_eq!(choose_bucket(&b, 0), None);
        }
    }

    fn table() -> PageTable {
        PageTable::new(PageTableConfig {
            max_rows: 8,
            num_pages: 32,
            page_size: 4,
            enable_prefix_cache: false,
        })
        .unwrap()
    }

    #[test]
    fn decode_packing_pads_into_the_trash_page() {
        let mut t = table();
        let (r1, r2) = (t.allocate().unwrap(), t.allocate().unwrap());
        t.reserve(r1, 6).unwrap();
        t.reserve(r2, 9).unwrap();
        let mut idx = PagedIndices::default();
        t.write_indices(&[(r1, 6), (r2, 9)], &mut idx).unwrap();
        let layout = DecodeLayout {
            cap_rows: 4,
            cap_pages: 16,
        };
        let mut out = vec![u32::MAX; layout.total_words()];
        let rows = [
            DecodeRow { kv_row: r1, pos: 5 },
            DecodeRow { kv_row: r2, pos: 8 },
        ];
        let trash = 32;
        let used = pack_decode(&layout, &rows, &idx, 4, trash, 4, &mut out).unwrap();
        let real = idx.kv_indptr[2] as usize;
        assert_eq!(used, layout.kv_indices() + real + 2);
        let p1 = t.pages(r1);
        let p2 = t.pages(r2);
        assert_eq!(out[layout.slot_mapping()], p1[1] * 4 + 1);
        assert_eq!(out[layout.slot_mapping() + 1], p2[2] * 4);
        assert_eq!(&out[layout.rows()..layout.rows() + 4], &[r1, r2, 0, 0]);
        assert_eq!(
            &out[layout.sample_pos()..layout.sample_pos() + 4],
            &[6, 9, 0, 0]
        );
        assert_eq!(&out[layout.row_seq()..layout.row_seq() + 4], &[0, 1, 2, 3]);
        // Padding rows: one trash page each, writing slot 0 of it.
        assert_eq!(out[layout.slot_mapping() + 2], trash * 4);
        let ip = layout.kv_indptr();
        assert_eq!(out[ip + 2] as usize, real);
        assert_eq!(out[ip + 4] as usize, real + 2);
        let ki = layout.kv_indices();
        assert_eq!(&out[ki + real..ki + real + 2], &[trash, trash]);
        // Real pages are untouched and in order.
        assert_eq!(&out[ki..ki + real], &idx.kv_indices[..real]);
    }

    #[test]
    fn decode_packing_rejects_bad_plans() {
        let layout = DecodeLayout {
            cap_rows: 2,
            cap_pages: 2,
        };
        let mut out = vec![0; layout.total_words()];
        let mut idx = PagedIndices::default();
        idx.kv_indptr.extend([0, 1]);
        idx.kv_indices.push(3);
        idx.kv_last_page_len.push(4);
        let row = [DecodeRow { kv_row: 1, pos: 4 }];
        assert!(matches!(
            pack_decode(&layout, &row, &idx, 1, 9, 4, &mut out),
            Err(PackError::PositionOutsidePages { .. })
        ));
        let row = [DecodeRow { kv_row: 1, pos: 3 }];
        assert!(pack_decode(&layout, &row, &idx, 1, 9, 4, &mut out).is_ok());
        assert!(matches!(
            pack_decode(&layout, &row, &idx, 3, 9, 4, &mut out),
            Err(PackError::TooManyRows { .. })
        ));
    }

    #[test]
    fn prefill_packing_maps_last_tokens_to_logit_rows() {
        let mut t = table();
        let (r1, r2) = (t.allocate().unwrap(), t.allocate().unwrap());
        t.reserve(r1, 5).unwrap();
        t.reserve(r2, 3).unwrap();
        let mut idx = PagedIndices::default();
        t.write_indices(&[(r1, 5), (r2, 3)], &mut idx).unwrap();
        let p1 = [10, 11, 12, 13, 14];
        let p2 = [20, 21, 22];
        let seqs = [
            PrefillSeq {
                kv_row: r1,
                prompt: &p1,
                start: 4,
                samples: true,
                admitted: false,
                generated: &[],
            },
            PrefillSeq {
                kv_row: r2,
                prompt: &p2,
                start: 0,
                samples: true,
                admitted: true,
                generated: &[],
            },
        ];
        let mut out = Vec::new();
        let l = pack_prefill(&seqs, &idx, 4, &mut out).unwrap();
        assert_eq!(l.tokens_n, 4);
        assert_eq!(&out[l.tokens()..l.tokens() + 4], &[14, 20, 21, 22]);
        assert_eq!(&out[l.positions()..l.positions() + 4], &[4, 0, 1, 2]);
        assert_eq!(&out[l.row_seq()..l.row_seq() + 4], &[0, 1, 1, 1]);
        let m = u32::MAX;
        assert_eq!(&out[l.out_row()..l.out_row() + 4], &[0, m, m, 1]);
        assert_eq!(out[l.slot_mapping()], t.pages(r1)[1] * 4);
        assert_eq!(out[l.slot_mapping() + 3], t.pages(r2)[0] * 4 + 2);
        assert_eq!(&out[l.sample_pos()..l.sample_pos() + 2], &[5, 3]);
        assert_eq!(&out[l.admit_rows()..l.admit_rows() + 1], &[r2]);
        assert_eq!(out.len(), l.total_words());
    }

    #[test]
    fn verify_packing_lays_out_each_member_and_its_drafts() {
        let mut t = table();
        let (r1, r2) = (t.allocate().unwrap(), t.allocate().unwrap());
        t.reserve(r1, 7).unwrap();
        t.reserve(r2, 2).unwrap();
        let mut idx = PagedIndices::default();
        t.write_indices(&[(r1, 7), (r2, 2)], &mut idx).unwrap();
        // Member 1 at position 3 with drafts 8, 9, 10 (positions 4..=6:
        // across a page boundary); member 2 at 1 without drafts.
        let members = [
            VerifyRow {
                kv_row: r1,
                pos: 3,
                drafts: &[8, 9, 10],
            },
            VerifyRow {
                kv_row: r2,
                pos: 1,
                drafts: &[],
            },
        ];
        let mut out = Vec::new();
        let l = pack_verify(&members, &idx, 4, &mut out).unwrap();
        assert_eq!((l.rows, l.members), (5, 2));
        assert_eq!(&out[l.positions()..l.positions() + 5], &[3, 4, 5, 6, 1]);
        assert_eq!(&out[l.row_seq()..l.row_seq() + 5], &[0, 0, 0, 0, 1]);
        assert_eq!(&out[l.sample_pos()..l.sample_pos() + 5], &[4, 5, 6, 7, 2]);
        assert_eq!(&out[l.sample_rows()..l.sample_rows() + 5], &[0, 1, 2, 3, 4]);
        assert_eq!(&out[l.qo()..l.qo() + 3], &[0, 4, 5]);
        assert_eq!(&out[l.drafts()..l.drafts() + 3], &[8, 9, 10]);
        assert_eq!(&out[l.kv_rows()..l.kv_rows() + 2], &[r1, r2]);
        assert_eq!(out[l.slot_mapping() + 1], t.pages(r1)[1] * 4);
        assert_eq!(out.len(), l.total_words());
        let short = [VerifyRow {
            kv_row: r2,
            pos: 1,
            drafts: &[5, 6, 7],
        }];
        let mut one = PagedIndices::default();
        t.write_indices(&[(r2, 2)], &mut one).unwrap();
        assert!(matches!(
            pack_verify(&short, &one, 4, &mut out),
            Err(PackError::PositionOutsidePages { pos: 4, .. })
        ));
    }

    /// A chunk short of its prompt's end feeds no logits row and is not
    /// sampled; sampled sequences are numbered among themselves; a
    /// re-admitted sequence's generated tokens are listed for its counts.
    #[test]
    fn prefill_packing_samples_only_chunks_that_end_their_prompt() {
        let mut t = table();
        let (r1, r2, r3) = (
            t.allocate().unwrap(),
            t.allocate().unwrap(),
            t.allocate().unwrap(),
        );
        for r in [r1, r2, r3] {
            t.reserve(r, 6).unwrap();
        }
        let mut idx = PagedIndices::default();
        t.write_indices(&[(r1, 3), (r2, 6), (r3, 2)], &mut idx)
            .unwrap();
        let (p1, p2, p3) = ([10, 11, 12], [20, 21, 22, 23, 24, 25], [30, 31]);
        let seq = |kv_row, prompt, start, samples, admitted, generated| PrefillSeq {
            kv_row,
            prompt,
            start,
            samples,
            admitted,
            generated,
        };
        let seqs = [
            // The first chunk of a longer prompt: admitted, not sampled.
            seq(r1, &p1[..], 0, false, true, &[][..]),
            // A resumed chunk that ends its prompt.
            seq(r2, &p2[..], 4, true, false, &[]),
            // A re-admission that had generated 31, in one chunk.
            seq(r3, &p3[..], 0, true, true, &p3[1..]),
        ];
        let mut out = Vec::new();
        let l = pack_prefill(&seqs, &idx, 4, &mut out).unwrap();
        assert_eq!((l.tokens_n, l.sampled, l.admitted, l.counted), (7, 2, 2, 1));
        let m = u32::MAX;
        let rows = &out[l.out_row()..l.out_row() + 7];
        assert_eq!(rows, &[m, m, m, m, 0, m, 1]);
        assert_eq!(&out[l.kv_rows()..l.kv_rows() + 2], &[r2, r3]);
        assert_eq!(&out[l.sample_pos()..l.sample_pos() + 2], &[6, 2]);
        assert_eq!(&out[l.admit_rows()..l.admit_rows() + 2], &[r1, r3]);
        assert_eq!(&out[l.count_indptr()..l.count_indptr() + 3], &[0, 0, 1]);
        assert_eq!(out[l.count_tokens()], 31);
        assert_eq!(&out[l.positions() + 3..l.positions() + 5], &[4, 5]);
        assert_eq!(out.len(), l.total_words());
    }

    #[test]
    fn rope_table_matches_the_cpu_runtime_bit_for_bit() {
        let (d, theta) = (64, 10000.0);
        let t = rope_table(300, d, theta);
        let mut cpu = vec![0f32; d];
        for pos in [0usize, 1, 7, 255, 299] {
            kestrel_cpu::kernels::ops::rope_table(pos as u32, d, theta, &mut cpu);
            let gpu = &t[pos * d..(pos + 1) * d];
            assert!(gpu
                .iter()
                .zip(&cpu)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn factors_and_scale_slow_the_rotation() {
        // As kestrel-cpu's RopeSpec test: pair 0 of position 8 with factor
        // 2 and linear scale 4 turns by 8 / 4 * 1 / 2 = 1 radian.
        let ff = [2.0f32; 4];
        let r = LayerRope {
            theta: 10_000.0,
            freq_factors: Some(&ff),
            linear_scale: 4.0,
            window: None,
        };
        let t = rope_table_of(&r, 9, 8);
        let row = &t[8 * 8..9 * 8];
        assert_eq!((row[0], row[4]), (1f64.cos() as f32, 1f64.sin() as f32));
        // Pair 1: 8 / 4 * 10000^(-1/4) / 2.
        let a = 2.0 * 10_000f64.powf(-0.25) / 2.0;
        assert_eq!((row[1], row[5]), (a.cos() as f32, a.sin() as f32));
    }

    #[test]
    fn biases_stack_with_zeros_where_absent() {
        let bias = stack_bias(&[(None, 2), (Some(&vec![3.0]), 1)]);
        assert_eq!(bias, vec![0.0, 0.0, 3.0]);
        assert_eq!(mask_words(2, 33), 2 + 4);
    }
}
