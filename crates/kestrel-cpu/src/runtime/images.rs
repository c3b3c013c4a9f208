//! Image rows of a prefill (Moondream): the encoder and projector run on
//! the compute stream, inside the prefill step that needs them, on the
//! model's compute team; the last `capacity` images' projector outputs stay
//! in an LRU keyed by the image's content hash, so a second question on
//! the same image skips the encoder. Cost per miss: the whole encoder
//! (`crops x 27 layers`); memory per cached image: `rows x dim` floats
//! (729 x 2048 x 4 = 6 MB at full size).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use kestrel_model::vision::PreparedImage;
use kestrel_model::VisionModel;

use crate::vision::{encode_image, ImageTokens, VisionRun};
use crate::CpuError;

/// Counters of the image rows, shared by the compute stream (which
/// counts) and the runtime (which reads them).
#[derive(Debug, Default)]
pub(crate) struct ImageCounters {
    pub encoder_runs: AtomicU64,
    pub cache_hits: AtomicU64,
}

/// What the runtime's image rows have cost so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VisionStats {
    /// Images run through the encoder and projector.
    pub encoder_runs: u64,
    /// Image rows served from the LRU of encoded images instead.
    pub cache_hits: u64,
}

impl ImageCounters {
    pub fn stats(&self) -> VisionStats {
        VisionStats {
            encoder_runs: self.encoder_runs.load(Relaxed),
            cache_hits: self.cache_hits.load(Relaxed),
        }
    }
}

/// The compute stream's vision side: the model and the encoded-image LRU.
pub(crate) struct ImageRows {
    pub model: VisionModel,
    /// Most recently used last; at most `capacity` entries.
    cache: Vec<([u8; 32], Arc<ImageTokens>)>,
    capacity: usize,
    counters: Arc<ImageCounters>,
}

impl ImageRows {
    pub fn new(model: VisionModel, capacity: usize, counters: Arc<ImageCounters>) -> Self {
        Self {
            model,
            cache: Vec::with_capacity(capacity + 1),
            capacity,
            counters,
        }
    }

    /// The projector output of `image` (`[rows][dim]`): from the LRU, or
    /// encoded now on `run` and kept (the least recently used dropped).
    pub fn tokens(
        &mut self,
        run: VisionRun<'_>,
        image: &PreparedImage,
    ) -> Result<Arc<ImageTokens>, CpuError> {
        if let Some(i) = self.cache.iter().position(|(h, _)| *h == image.hash) {
            let hit = self.cache.remove(i);
            let tokens = Arc::clone(&hit.1);
            self.cache.push(hit);
            self.counters.cache_hits.fetch_add(1, Relaxed);
            return Ok(tokens);
        }
        let v = &self.model;
        let tokens = Arc::new(encode_image(
            run,
            &v.weights,
            &v.config.vision,
            &image.crops,
        )?);
        self.counters.encoder_runs.fetch_add(1, Relaxed);
        if self.capacity > 0 {
            if self.cache.len() == self.capacity {
                self.cache.remove(0);
            }
            self.cache.push((image.hash, Arc::clone(&tokens)));
        }
        Ok(tokens)
    }
}
