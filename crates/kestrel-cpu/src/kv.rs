//! Host memory for the paged KV cache.
//!
//! Per layer one K and one V array laid out `[num_pages][num_kv_heads]
//! [page_size][head_dim]` in f32: within a page, one kv head's positions are
//! contiguous, so attention (one kv head at a time) streams each page as one
//! block instead of a strided walk. f32 keeps attention exact against an f32
//! reference; at SmolLM2's shape a token costs
//! `2 * layers * kv_heads * head_dim * 4` = 46 KiB. Which pages belong to
//! which sequence is the page table's business (`kestrel-kv`); this store only
//! reads and writes the pages it is told.

use crate::kernels::LineBuf;
use crate::CpuError;

/// Geometry of a [`KvStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvStoreConfig {
    pub num_layers: usize,
    pub num_pages: usize,
    pub page_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvStoreConfig {
    /// Float offset of (`page`, slot `slot`, kv head `g`) in a layer's K or V
    /// array; the head's `head_dim` floats start there, and the head's next
    /// slots follow `head_dim` floats apart.
    #[inline]
    pub fn offset(&self, page: usize, slot: usize, g: usize) -> usize {
        ((page * self.num_kv_heads + g) * self.page_size + slot) * self.head_dim
    }
}

/// The KV cache's storage. See the module docs for the layout.
#[derive(Debug)]
pub struct KvStore {
    cfg: KvStoreConfig,
    /// One array per layer, each on whole cache lines ([`LineBuf`]):
    /// attention loads a kv head's rows (`head_dim` floats, whole lines)
    /// as 64-byte vectors, which from a plain `Vec` (16 bytes into its
    /// pages) would each straddle two lines.
    k: Vec<LineBuf<f32>>,
    v: Vec<LineBuf<f32>>,
}

impl KvStore {
    /// Allocate (zeroed) storage for `cfg`.
    pub fn new(cfg: KvStoreConfig) -> Result<Self, CpuError> {
        if cfg.page_size == 0 || cfg.num_pages == 0 || cfg.num_kv_heads == 0 || cfg.head_dim == 0 {
            return Err(CpuError::KvGeometry {
                reason: format!("zero-sized dimension in {cfg:?}"),
            });
        }
        let per_layer = cfg.num_pages * cfg.page_size * cfg.num_kv_heads * cfg.head_dim;
        Ok(KvStore {
            cfg,
            k: (0..cfg.num_layers)
                .map(|_| LineBuf::zeroed(per_layer))
                .collect(),
            v: (0..cfg.num_layers)
                .map(|_| LineBuf::zeroed(per_layer))
                .collect(),
        })
    }

    /// Storage for `model`'s layers and heads.
    pub fn for_model(
        model: &kestrel_model::ModelConfig,
        num_pages: usize,
        page_size: usize,
    ) -> Result<Self, CpuError> {
        Self::new(KvStoreConfig {
            num_layers: model.num_layers,
            num_pages,
            page_size,
            num_kv_heads: model.num_kv_heads,
            head_dim: model.head_dim,
        })
    }

    pub fn config(&self) -> KvStoreConfig {
        self.cfg
    }

    pub fn page_size(&self) -> usize {
        self.cfg.page_size
    }

    pub fn num_pages(&self) -> usize {
        self.cfg.num_pages
    }

    /// Bytes of host memory held.
    pub fn bytes(&self) -> usize {
        2 * self.cfg.num_layers * self.page_floats() * self.cfg.num_pages * 4
    }

    /// Floats per page per layer per K or V.
    pub fn page_floats(&self) -> usize {
        self.cfg.page_size * self.cfg.num_kv_heads * self.cfg.head_dim
    }

    /// Layer `l`'s K and V arrays.
    pub fn layer(&self, l: usize) -> (&[f32], &[f32]) {
        (&self.k[l], &self.v[l])
    }

    /// Layer `l`'s K and V arrays, mutable.
    pub fn layer_mut(&mut self, l: usize) -> (&mut [f32], &mut [f32]) {
        (&mut self.k[l], &mut self.v[l])
    }

    /// Copy the first `len` slots of page `src` to page `dst` in every layer
    /// (copy-on-write of a shared, partially filled prefix page).
    pub fn copy_page(&mut self, src: u32, dst: u32, len: usize) -> Result<(), CpuError> {
        let (src, dst) = (src as usize, dst as usize);
        if src >= self.cfg.num_pages || dst >= self.cfg.num_pages || len > self.cfg.page_size {
            return Err(CpuError::KvGeometry {
                reason: format!(
                    "copy_page({src} -> {dst}, {len}) outside {} pages of {}",
                    self.cfg.num_pages, self.cfg.page_size
                ),
            });
        }
        let n = len * self.cfg.head_dim;
        for g in 0..self.cfg.num_kv_heads {
            let (from, to) = (self.cfg.offset(src, 0, g), self.cfg.offset(dst, 0, g));
            for arr in self.k.iter_mut().chain(self.v.iter_mut()) {
                arr.copy_within(from..from + n, to);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_start_on_a_line_and_copy_pages_within_themselves() {
        let cfg = KvStoreConfig {
            num_layers: 2,
            num_pages: 3,
            page_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
        };
        let mut kv = KvStore::new(cfg).unwrap();
        for l in 0..2 {
            let (k, v) = kv.layer(l);
            assert_eq!((k.len(), v.len()), (3 * 4 * 2 * 8, 3 * 4 * 2 * 8));
            assert_eq!(k.as_ptr() as usize % 64, 0);
            assert_eq!(v.as_ptr() as usize % 64, 0);
            assert!(k.iter().chain(v).all(|&x| x == 0.0));
        }
        let (k, _) = kv.layer_mut(1);
        for (i, x) in k.iter_mut().enumerate() {
            *x = i as f32;
        }
        kv.copy_page(0, 2, 3).unwrap();
        let (k, v) = kv.layer(1);
        for g in 0..2 {
            let (from, to) = (cfg.offset(0, 0, g), cfg.offset(2, 0, g));
            assert_eq!(k[to..to + 3 * 8], k[from..from + 3 * 8]);
            assert_eq!(
                k[to + 3 * 8],
                (to + 3 * 8) as f32,
                "slot past len untouched"
            );
        }
        assert!(v.iter().all(|&x| x == 0.0));
        assert!(kv.copy_page(0, 3, 1).is_err());
    }
}
