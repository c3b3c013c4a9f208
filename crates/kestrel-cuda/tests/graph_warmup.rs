//! The metadata a decode forward reads, as `CudaRuntime::rebuild_graphs`
//! and `launch_decode` pack it: every word the forward's kernels read for a
//! bucket (`embed_gather` / `embed_gather_q`: rows; `rope_kv_append` and
//! `paged_attention`: positions, row_seq, kv_indptr, kv_indices;
//! `rope_kv_append`: slot_mapping; sampling: sample_pos) is written by
//! `pack_decode` and in range, for the all-padding warm-up that runs before
//! capture and for a real step padded to its bucket. compute-sanitizer
//! initcheck on the H100 reported uninitialized reads in `rope_qk` (since
//! fused into `rope_kv_append`) during that warm-up; with the slot buffers
//! zeroed at allocation and this invariant held, nothing the RoPE kernel
//! reads is unwritten.

use kestrel_cuda::host::{graph_buckets, pack_decode, DecodeLayout, DecodeRow};
use kestrel_kv::{PageTable, PageTableConfig, PagedIndices, RowId};

/// A word no packing writes: any left in a read range is an unwritten read.
const UNWRITTEN: u32 = 0xDEAD_BEEF;

struct Geometry {
    max_rows: usize,
    num_pages: usize,
    page_size: usize,
    /// Positions the RoPE table covers (`max_pos` of `KvGeometry`).
    max_pos: usize,
}

impl Geometry {
    fn trash_page(&self) -> u32 {
        self.num_pages as u32
    }

    fn layout(&self) -> DecodeLayout {
        let pages_per_seq = self.max_pos.div_ceil(self.page_size);
        DecodeLayout {
            cap_rows: self.max_rows,
            cap_pages: self.max_rows * pages_per_seq + self.max_rows,
        }
    }

    /// Checks the words a forward of `bucket` rows reads, of which the first
    /// `real` are real rows and the rest padding.
    fn check(&self, meta: &[u32], used: usize, bucket: usize, real: usize) {
        let l = self.layout();
        let ps = self.page_size as u32;
        let read = |off: usize, n: usize| -> &[u32] {
            let w = &meta[off..off + n];
            assert!(
                w.iter().all(|&v| v != UNWRITTEN),
                "bucket {bucket}: unwritten word in {off}..{}: {w:?}",
                off + n
            );
            w
        };
        let rows = read(l.rows(), bucket);
        let positions = read(l.positions(), bucket);
        let row_seq = read(l.row_seq(), bucket);
        let slots = read(l.slot_mapping(), bucket);
        let sample_pos = read(l.sample_pos(), bucket);
        let indptr = read(l.kv_indptr(), bucket + 1);
        let pages = indptr[bucket] as usize;
        assert_eq!(used, l.kv_indices() + pages, "words uploaded");
        let indices = read(l.kv_indices(), pages);
        assert_eq!(indptr[0], 0);
        for i in 0..bucket {
            let padding = i >= real;
            // embed_gather reads `pending[rows[i]]`: a KV row of the cache
            // (padding rows read the reserved row 0).
            assert!((rows[i] as usize) <= self.max_rows, "row {i}: {rows:?}");
            assert_eq!(padding, rows[i] == 0, "row {i}: {rows:?}");
            // rope_kv_append reads the RoPE table at `positions[i]`.
            assert!(
                (positions[i] as usize) < self.max_pos,
                "row {i}: {positions:?}"
            );
            assert_eq!(row_seq[i], i as u32);
            // rope_kv_append writes `slot_mapping[i]`; padding rows the trash page.
            let page = slots[i] / ps;
            assert!(page <= self.trash_page(), "row {i}: slot {}", slots[i]);
            assert_eq!(padding, page == self.trash_page(), "row {i}");
            assert!(sample_pos[i] <= self.max_pos as u32);
            // paged_attention reads pages indptr[i]..indptr[i+1], which
            // cover `positions[i]` and include the page rope_kv_append wrote.
            let (a, b) = (indptr[i] as usize, indptr[i + 1] as usize);
            assert!(a < b && b <= pages, "row {i}: {indptr:?}");
            let pos = positions[i] as usize;
            assert!(pos / self.page_size < b - a, "row {i}: pos {pos}");
            assert_eq!(indices[a + pos / self.page_size], page, "row {i}");
            assert!(indices[a..b].iter().all(|&p| p <= self.trash_page()));
        }
    }
}

#[test]
fn graph_warmup_metadata_is_written_and_in_range_for_every_bucket() {
    for g in [
        Geometry {
            max_rows: 8,
            num_pages: 256,
            page_size: 16,
            max_pos: 512,
        },
        Geometry {
            max_rows: 48,
            num_pages: 64,
            page_size: 16,
            max_pos: 1,
        },
    ] {
        let layout = g.layout();
        let empty = PagedIndices {
            kv_indptr: vec![0],
            ..PagedIndices::default()
        };
        for b in graph_buckets(g.max_rows) {
            let mut meta = vec![UNWRITTEN; layout.total_words()];
            let used = pack_decode(
                &layout,
                &[],
                &empty,
                b,
                g.trash_page(),
                g.page_size,
                &mut meta,
            )
            .unwrap();
            g.check(&meta, used, b, 0);
        }
    }
}

#[test]
fn a_decode_step_padded_to_its_bucket_reads_only_written_metadata() {
    let g = Geometry {
        max_rows: 8,
        num_pages: 64,
        page_size: 4,
        max_pos: 256,
    };
    let mut table = PageTable::new(PageTableConfig {
        max_rows: g.max_rows + 1,
        num_pages: g.num_pages,
        page_size: g.page_size,
        enable_prefix_cache: false,
    })
    .unwrap();
    // Three sequences about to decode at positions 0, 4 (a page boundary)
    // and 9; each holds KV for its position + 1.
    let mut rows: Vec<(RowId, usize)> = Vec::new();
    let mut decode = Vec::new();
    for pos in [0usize, 4, 9] {
        let row = table.allocate().unwrap();
        table.reserve(row, pos + 1).unwrap();
        rows.push((row, pos + 1));
        decode.push(DecodeRow {
            kv_row: row,
            pos: pos as u32,
        });
    }
    let mut idx = PagedIndices::default();
    table.write_indices(&rows, &mut idx).unwrap();
    let layout = g.layout();
    for bucket in [3, 4, 8] {
        let mut meta = vec![UNWRITTEN; layout.total_words()];
        let used = pack_decode(
            &layout,
            &decode,
            &idx,
            bucket,
            g.trash_page(),
            g.page_size,
            &mut meta,
        )
        .unwrap();
        g.check(&meta, used, bucket, decode.len());
        // The real rows keep their own KV rows and positions.
        for (i, r) in decode.iter().enumerate() {
            assert_eq!(meta[layout.rows() + i], r.kv_row);
            assert_eq!(meta[layout.positions() + i], r.pos);
        }
    }
}
