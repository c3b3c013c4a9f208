//! The spatial stage of a step (Moondream's `point` / `detect`;
//! docs/moondream.md, "Spatial decode in the step"), on the compute stream.
//!
//! The forward keeps the hidden state of each logits row (the residual
//! stream after the last block, before the output norm: what the published
//! region decoders read); after sampling, every token sampled as `coord_id`
//! gets its coordinate decoded from its own row's hidden state and every
//! `size_id` its size, into the step's outputs (the RenderBuffer's values)
//! and the sequence's pending input; the next forward embeds a pending
//! `coord_id` as `encode_coords(value)` and `size_id` as
//! `encode_sizes(value)` instead of the token's embedding. Keyed on the
//! sampled id alone, as the next input is: the stage knows no skill.
//! Cost: nothing for a step with no spatial id; otherwise one region MLP
//! per spatial token (17M multiply-adds at full width) and one encoder per
//! spatial input.

use kestrel_model::moondream::{RegionConfig, RegionWeights};
use kestrel_model::VisionModel;
use kestrel_pipeline::{TokenId, TokenValues};

use crate::vision::region::{decode_coords, decode_sizes, encode_coords, encode_sizes};
use crate::vision::VisionRun;
use crate::CpuError;

/// The region model's side of the compute stream, present when the vision
/// model has a region module and its vocabulary spatial ids.
pub(crate) struct SpatialStage {
    coord_id: TokenId,
    size_id: TokenId,
    dim: usize,
    /// Per slot: the hidden states of the step's logits rows, `[rows][dim]`.
    hidden: Vec<Vec<f32>>,
    /// Reused buffers: the gathered hidden states or values of one kind,
    /// the tokens (or batch rows) they belong to, the next inputs.
    gather: Vec<f32>,
    picks: Vec<usize>,
    coords: Vec<f32>,
    sizes: Vec<[f32; 2]>,
    order: Vec<(u32, bool, usize)>,
    embeds: Vec<f32>,
}

impl SpatialStage {
    /// `None` for a vision model without a region module or spatial ids.
    pub fn new(model: &VisionModel, num_slots: usize) -> Option<Self> {
        model.region.as_ref()?;
        Some(SpatialStage {
            coord_id: model.prompts.coord_id?,
            size_id: model.prompts.size_id?,
            dim: model.config.region.dim,
            hidden: vec![Vec::new(); num_slots],
            gather: Vec::new(),
            picks: Vec::new(),
            coords: Vec::new(),
            sizes: Vec::new(),
            order: Vec::new(),
            embeds: Vec::new(),
        })
    }

    /// Keeps `hidden` as logits row `row` of `slot`'s step.
    pub fn keep(&mut self, slot: usize, row: usize, hidden: &[f32]) {
        let buf = &mut self.hidden[slot];
        let end = (row + 1) * self.dim;
        if buf.len() < end {
            buf.resize(end, 0.0);
        }
        buf[row * self.dim..end].copy_from_slice(hidden);
    }

    /// The next forward's embedded rows: for each `(batch row, pending
    /// token, its values)` in ascending batch order, a spatial id's
    /// encoding. Fills `embedded` with those batch rows and returns their
    /// embeddings, in the same order (`[rows][dim]`).
    pub fn inputs(
        &mut self,
        run: VisionRun<'_>,
        (w, cfg): (&RegionWeights, &RegionConfig),
        pending: impl Iterator<Item = (u32, TokenId, TokenValues)>,
        embedded: &mut Vec<u32>,
    ) -> Result<&[f32], CpuError> {
        self.coords.clear();
        self.sizes.clear();
        self.order.clear();
        embedded.clear();
        self.embeds.clear();
        for (row, token, v) in pending {
            if token == self.coord_id {
                self.order.push((row, true, self.coords.len()));
                self.coords.push(v.coord);
            } else if token == self.size_id {
                self.order.push((row, false, self.sizes.len()));
                self.sizes.push(v.size);
            }
        }
        if self.order.is_empty() {
            return Ok(&[]);
        }
        let coords = match self.coords.is_empty() {
            true => Vec::new(),
            false => encode_coords(run, w, cfg, &self.coords)?,
        };
        let sizes = match self.sizes.is_empty() {
            true => Vec::new(),
            false => encode_sizes(run, w, cfg, &self.sizes)?,
        };
        let d = self.dim;
        for &(row, is_coord, k) in &self.order {
            embedded.push(row);
            let src = if is_coord { &coords } else { &sizes };
            self.embeds.extend_from_slice(&src[k * d..(k + 1) * d]);
        }
        Ok(&self.embeds)
    }

    /// The values of `slot`'s sampled `tokens` (token `k` sampled from
    /// logits row `rows[k]`): `values` gets one per token, or stays empty
    /// when no token is a spatial id.
    pub fn decode(
        &mut self,
        run: VisionRun<'_>,
        (w, cfg): (&RegionWeights, &RegionConfig),
        slot: usize,
        tokens: &[TokenId],
        rows: &[u32],
        values: &mut Vec<TokenValues>,
    ) -> Result<(), CpuError> {
        values.clear();
        if !tokens
            .iter()
            .any(|&t| t == self.coord_id || t == self.size_id)
        {
            return Ok(());
        }
        values.resize(tokens.len(), TokenValues::default());
        for want in [self.coord_id, self.size_id] {
            self.picks.clear();
            self.gather.clear();
            for (k, &t) in tokens.iter().enumerate() {
                if t == want {
                    let r = rows[k] as usize;
                    self.picks.push(k);
                    self.gather
                        .extend_from_slice(&self.hidden[slot][r * self.dim..(r + 1) * self.dim]);
                }
            }
            if self.picks.is_empty() {
                continue;
            }
            let n = self.picks.len();
            if want == self.coord_id {
                let decoded = decode_coords(run, w, cfg, &self.gather, n)?;
                for (&k, c) in self.picks.iter().zip(decoded) {
                    values[k].coord = c.value;
                }
            } else {
                let decoded = decode_sizes(run, w, cfg, &self.gather, n)?;
                for (&k, s) in self.picks.iter().zip(decoded) {
                    values[k].size = s.value;
                }
            }
        }
        Ok(())
    }
}
