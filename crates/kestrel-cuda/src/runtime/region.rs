//! Moondream's region model on the device and the step's spatial stage
//! (docs/moondream.md, "Spatial decode in the step"; the CPU's
//! `kestrel-cpu/src/runtime/spatial.rs`), keyed on token ids alone:
//!
//! - in the forward, inside the decode graph: each decode row's pending
//!   values (per KV row, written by the last step's `spatial_values`) go
//!   through `fourier_features` and both encoders (GEMM + bias), and
//!   `spatial_embed` puts the coordinate / size encoding in place of the
//!   token embedding of a row whose pending token is `coord_id` /
//!   `size_id`; then, after the LM head, the sampled rows' hidden states
//!   (the residual stream before the final norm, `hidden_f16`) through both
//!   decoder MLPs (GEMM, `bias_gelu`, GEMM, bias) into model-wide logits
//!   scratch (one compute stream: I1);
//! - after sampling: `spatial_values` writes each row's value for its
//!   sampled token into the slot's values (copied to the RenderBuffer with
//!   the tokens, after the same step-done event) and its KV row's pending
//!   values, so the next forward never waits for the host.
//!   A step that verifies drafts embeds each member's input row from its
//!   KV row's pending values (`FwdArgs::spatial`; its drafts read the
//!   reserved KV row 0, whose pending token is 0: token embeddings),
//!   decodes every row's values and, after `accept_drafts`,
//!   `accept_values` gives each member its last accepted row's.
//! - in a re-prefill after a preemption (`prefill.rs`): the chunk's rows
//!   that are generated `coord_id` / `size_id` tokens take the encoding of
//!   the values committed with them (`PrefillInput::generated_values`,
//!   copied with the step's metadata; `SpatialIn::Rows`), as the decode
//!   step after each did; a chunk without one runs no encoder.
//!
//! Cost per step of a model with a region module: both decoder MLPs and
//! both encoders on every row (a captured graph cannot branch on a sampled
//! token; at Moondream 2's size about 60M multiply-adds a row, decoders
//! 25M and 34M, encoders 1.6M, against the text decoder's 1.4G), whether
//! or not a row is spatial.

use half::f16;
use kestrel_model::moondream::{Mlp, RegionConfig, RegionWeights};
use kestrel_model::{DType, Matrix};

use super::backend::{
    AcceptValues, AddBias, BiasGelu, DevMem, Device, FourierFeatures, HiddenF16, SpatialEmbed,
    SpatialValues,
};
use super::device::{DeviceModel, FwdArgs, Proj, SpatialIn};
use super::slot::VerifyStep;
use crate::quant::{BLOCK, MMVQ_CROSSOVER_ROWS, Q8_BLOCK_BYTES, TILE_ELEMS};
use crate::reference::size_table;
use crate::CudaError;

/// One linear layer: its weight as the text model's projections hold it,
/// and its bias.
pub(super) struct Linear<D: Device> {
    pub w: Proj<D>,
    b: D::Buf,
}

impl<D: Device> Linear<D> {
    pub(super) fn upload(
        d: &D,
        what: &str,
        l: &kestrel_model::moondream::Linear,
        bytes: &mut usize,
    ) -> Result<Self, CudaError> {
        if l.bias.len() != l.weight.rows {
            return Err(CudaError::Unsupported(format!(
                "{what}: {} bias values for {} outputs",
                l.bias.len(),
                l.weight.rows
            )));
        }
        Ok(Linear {
            w: Proj::upload(d, what, &[&l.weight], bytes)?,
            b: d.upload(&l.bias)?,
        })
    }
}

/// The region model's weights, ids and scratch on the device.
pub(crate) struct DeviceRegion<D: Device> {
    coord_id: u32,
    size_id: u32,
    inner: usize,
    coord_bins: usize,
    /// Bins per axis (half the size decoder's outputs).
    size_bins: usize,
    coord_half: usize,
    size_half: usize,
    coord_w: D::Buf,
    size_w: D::Buf,
    coord_encoder: Linear<D>,
    size_encoder: Linear<D>,
    coord_decoder: (Linear<D>, Linear<D>),
    size_decoder: (Linear<D>, Linear<D>),
    size_table: D::Buf,
    /// Each KV row's pending values (coord, w, h): the next input.
    pub pending: D::Buf,
    // Model-wide scratch (rows: the widest step), each written before read.
    hidden16: D::Buf,
    inner32: D::Buf,
    inner16: D::Buf,
    coord_logits: D::Buf,
    size_logits: D::Buf,
    coord_feats: D::Buf,
    size_feats: D::Buf,
    coord_emb: D::Buf,
    size_emb: D::Buf,
}

/// Where the region model reads its ids and shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RegionSpec<'a> {
    pub weights: &'a RegionWeights,
    pub config: &'a RegionConfig,
    pub coord_id: u32,
    pub size_id: u32,
    /// Rows one step runs through the stage at most.
    pub rows: usize,
    /// KV rows (the pending values' rows).
    pub kv_rows: usize,
}

impl<D: Device> DeviceModel<D> {
    /// Upload the region model and allocate its scratch; the int8 and tile
    /// scratch grow to cover its matrices.
    pub fn attach_region(&mut self, s: RegionSpec<'_>) -> Result<(), CudaError> {
        let (w, c) = (s.weights, s.config);
        let hidden = self.cfg.hidden_size;
        // A draft row reads reserved KV row 0's pending token (0, never
        // sampled into) and must not be taken for a spatial input.
        if s.coord_id == 0 || s.size_id == 0 {
            return Err(CudaError::Unsupported(
                "spatial ids 0 (the reserved KV row's pending token)".into(),
            ));
        }
        if c.dim != hidden || c.size_out_dim % 2 != 0 || c.size_out_dim < 4 {
            return Err(CudaError::Unsupported(format!(
                "a region model of dim {} ({} size outputs) on a text model of {hidden}",
                c.dim, c.size_out_dim
            )));
        }
        let (coord_half, size_half) = (w.coord_features.len(), w.size_features.len() / 2);
        if 2 * coord_half != c.coord_feat_dim || 4 * size_half != 2 * c.size_feat_dim {
            return Err(CudaError::Unsupported(format!(
                "region features {} / {} for feature dims {} / {}",
                w.coord_features.len(),
                w.size_features.len(),
                c.coord_feat_dim,
                c.size_feat_dim
            )));
        }
        let d = &self.d;
        let mut bytes = 0usize;
        let mut lin = |what: &str, l| Linear::upload(d, what, l, &mut bytes);
        let coord_encoder = lin("region coord_encoder", &w.coord_encoder)?;
        let size_encoder = lin("region size_encoder", &w.size_encoder)?;
        let mut mlp = |what: &str, m: &Mlp| -> Result<_, CudaError> {
            Ok((
                Linear::upload(d, &format!("{what}.fc1"), &m.fc1, &mut bytes)?,
                Linear::upload(d, &format!("{what}.fc2"), &m.fc2, &mut bytes)?,
            ))
        };
        let coord_decoder = mlp("region coord_decoder", &w.coord_decoder)?;
        let size_decoder = mlp("region size_decoder", &w.size_decoder)?;
        let mats: Vec<&Matrix> = [
            &w.coord_encoder,
            &w.size_encoder,
            &w.coord_decoder.fc1,
            &w.coord_decoder.fc2,
            &w.size_decoder.fc1,
            &w.size_decoder.fc2,
        ]
        .iter()
        .map(|l| &l.weight)
        .collect();
        let widest = mats.iter().map(|m| m.cols).max().unwrap_or(0);
        let r = s.rows;
        let f32s = |n: usize| d.alloc(n * 4);
        let f16s = |n: usize| d.alloc(n * std::mem::size_of::<f16>());
        let region = DeviceRegion {
            coord_id: s.coord_id,
            size_id: s.size_id,
            inner: w
                .coord_decoder
                .fc1
                .weight
                .rows
                .max(w.size_decoder.fc1.weight.rows),
            coord_bins: c.coord_out_dim,
            size_bins: c.size_out_dim / 2,
            coord_half,
            size_half,
            coord_w: d.upload(&w.coord_features)?,
            size_w: d.upload(&w.size_features)?,
            coord_encoder,
            size_encoder,
            coord_decoder,
            size_decoder,
            size_table: d.upload(&size_table(c.size_out_dim / 2))?,
            pending: d.alloc_zeroed(s.kv_rows * 3 * 4)?,
            hidden16: f16s(r * c.dim)?,
            inner32: f32s(
                r * widest
                    .max(c.inner_dim)
                    .max(c.coord_out_dim)
                    .max(c.size_out_dim),
            )?,
            inner16: f16s(r * widest.max(c.inner_dim))?,
            coord_logits: f32s(r * c.coord_out_dim)?,
            size_logits: f32s(r * c.size_out_dim)?,
            coord_feats: f16s(r * c.coord_feat_dim)?,
            size_feats: f16s(r * c.size_feat_dim)?,
            coord_emb: f32s(r * c.dim)?,
            size_emb: f32s(r * c.dim)?,
        };
        // The MLPs' widths: fc1's outputs feed fc2.
        for (a, b) in [&region.coord_decoder, &region.size_decoder] {
            if a.w.out != b.w.inp || a.w.inp != hidden || a.w.out > region.inner {
                return Err(CudaError::Unsupported(format!(
                    "a region decoder of {} -> {} -> {}",
                    a.w.inp, a.w.out, b.w.out
                )));
            }
        }
        // The int8 and tile scratch cover the region's matrices too.
        let widest_all = widest.max(region.inner);
        let xq_bytes = MMVQ_CROSSOVER_ROWS * widest_all.div_ceil(BLOCK) * Q8_BLOCK_BYTES;
        self.grow_scratch(
            xq_bytes,
            mats.iter()
                .any(|m| m.dtype != DType::F16)
                .then_some(TILE_ELEMS * 2),
        )?;
        self.weight_bytes += bytes;
        self.region = Some(region);
        Ok(())
    }

    /// `y[n, out] = x16 * W^T + b` (the int8 rows quantized from `x16`
    /// first when the weight takes `mmvq_*`).
    pub(super) fn linear(
        &self,
        l: &Linear<D>,
        x16: u64,
        y: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        if l.w.needs(n).q8 {
            self.quantize_q8(x16, l.w.inp, n)?;
        }
        self.matmul(y, &l.w.parts, l.w.out, x16, n)?;
        self.d.add_bias(AddBias {
            y,
            b: l.b.ptr(),
            stride: l.w.out,
            d: l.w.out,
            n,
        })
    }

    /// In the forward, after the token embedding of `a.n` rows: rows whose
    /// input token (`a.spatial`: a decode row's KV row's pending token, a
    /// re-prefill's generated token) is `coord_id` / `size_id` take the
    /// encoding of their values (the KV row's pending values, the values
    /// committed with the generated token). Nothing without a region model
    /// or for [`SpatialIn::None`] (rows of prompt tokens only).
    pub fn spatial_inputs(&self, a: &FwdArgs) -> Result<(), CudaError> {
        let Some(r) = &self.region else {
            return Ok(());
        };
        let (values, tokens, rows) = match a.spatial {
            SpatialIn::None => return Ok(()),
            SpatialIn::KvRows(rows) => (r.pending.ptr(), self.pending.ptr(), rows),
            SpatialIn::Rows { tokens, values } => (values, tokens, 0),
        };
        let d = &self.d;
        d.fourier_features(FourierFeatures {
            values,
            rows,
            coord_w: r.coord_w.ptr(),
            coord_half: r.coord_half,
            size_w: r.size_w.ptr(),
            size_half: r.size_half,
            coord_feats: r.coord_feats.ptr(),
            size_feats: r.size_feats.ptr(),
            n: a.n,
        })?;
        self.linear(
            &r.coord_encoder,
            r.coord_feats.ptr(),
            r.coord_emb.ptr(),
            a.n,
        )?;
        self.linear(&r.size_encoder, r.size_feats.ptr(), r.size_emb.ptr(), a.n)?;
        d.spatial_embed(SpatialEmbed {
            x: a.x,
            coord_emb: r.coord_emb.ptr(),
            size_emb: r.size_emb.ptr(),
            tokens,
            rows,
            coord_id: r.coord_id,
            size_id: r.size_id,
            hidden: self.cfg.hidden_size,
            n: a.n,
        })
    }

    /// After a forward call: its rows' hidden states (`x`, before the final
    /// norm) to the decoders' input rows, routed by `out_row` as the final
    /// norm routes them.
    pub fn keep_hidden(&self, x: u64, out_row: u64, n: usize) -> Result<(), CudaError> {
        let Some(r) = &self.region else {
            return Ok(());
        };
        self.d.hidden_f16(HiddenF16 {
            x,
            out_row,
            out: r.hidden16.ptr(),
            hidden: self.cfg.hidden_size,
            n,
        })
    }

    /// Both decoders' logits for the `n` kept rows.
    pub fn region_logits(&self, n: usize) -> Result<(), CudaError> {
        let Some(r) = &self.region else {
            return Ok(());
        };
        for ((fc1, fc2), logits) in [
            (&r.coord_decoder, r.coord_logits.ptr()),
            (&r.size_decoder, r.size_logits.ptr()),
        ] {
            self.linear(fc1, r.hidden16.ptr(), r.inner32.ptr(), n)?;
            self.d.bias_gelu(BiasGelu {
                y: r.inner32.ptr(),
                b: 0,
                out: r.inner16.ptr(),
                f: fc1.w.out,
                n,
            })?;
            self.linear(fc2, r.inner16.ptr(), logits, n)?;
        }
        Ok(())
    }

    /// After sampling `n` rows (`tokens`, their KV rows `rows`): each row's
    /// value into `values` (3 f32 a row) and its KV row's pending values.
    pub fn spatial_values(
        &self,
        tokens: u64,
        rows: u64,
        values: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        let Some(r) = &self.region else {
            return Ok(());
        };
        self.d.spatial_values(SpatialValues {
            coord_logits: r.coord_logits.ptr(),
            coord_bins: r.coord_bins,
            size_logits: r.size_logits.ptr(),
            size_bins: r.size_bins,
            size_table: r.size_table.ptr(),
            tokens,
            rows,
            coord_id: r.coord_id,
            size_id: r.size_id,
            values,
            pending: r.pending.ptr(),
            n,
        })
    }

    /// After `accept_drafts` of the verifying step `v`: each member's
    /// pending values from its last accepted row of `values`.
    pub fn accept_values(
        &self,
        v: VerifyStep,
        accepted: u64,
        values: u64,
    ) -> Result<(), CudaError> {
        let Some(r) = &self.region else {
            return Ok(());
        };
        self.d.accept_values(AcceptValues {
            qo: v.qo,
            accepted,
            kv_rows: v.kv_rows,
            values,
            pending: r.pending.ptr(),
            n: v.members,
        })
    }

    /// The spatial ids, with a region model.
    pub fn spatial_ids(&self) -> Option<(u32, u32)> {
        self.region.as_ref().map(|r| (r.coord_id, r.size_id))
    }
}
