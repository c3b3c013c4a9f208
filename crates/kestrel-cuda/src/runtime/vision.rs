//! Moondream's vision encoder and projector on the device (docs/moondream.md,
//! "Vision encoder and projector"; the CPU's `kestrel-cpu/src/vision/encoder.rs`),
//! attached by `Runtime::with_vision` and built from the text model's
//! kernels, no new one:
//!
//! - the patches (each crop's 14x14x3 pixels, channel-major, in [-1, 1]) are
//!   cut on the host and uploaded as f16 rows; `patch_emb` is a GEMM with
//!   `add_bias`, the position embedding one more `add_bias` (one row of
//!   `patches x enc_dim` per crop);
//! - each of the pre-LN blocks: `add_layer_norm` (the residual add of the
//!   last sublayer fused in, as the text model's Phi blocks), the QKV GEMM +
//!   bias, attention, `proj`, `add_layer_norm`, `fc1` + bias, `bias_gelu`,
//!   `fc2` + bias; then the post LN (f16 features);
//! - attention is the text model's tiled `prefill_attention` over a scratch
//!   f16 K/V cache of one page per crop (`patches` keys a page), written by
//!   `rope_kv_append` with no rotary dimension (K and V copied as f16, Q
//!   untouched); every row's mask position is the crop's last patch, so each
//!   row attends all of its crop's keys and no other crop's (full,
//!   bidirectional attention per crop);
//! - the features come back to the host, where the tiles are stitched
//!   without their inner margins and average-pooled back to the crop grid
//!   (`kestrel_model::vision::pool_tiles`, as kestrel-cpu, here in f32 over the
//!   f16 features) and joined after the global crop's, channel-wise; the
//!   joined rows go up again as f16 for the projector (`fc1` + bias,
//!   `bias_gelu`, `fc2` + bias; f32 out).
//!
//! Precision: every GEMM reads f16 activations and the K/V are f16 (the
//! text model's numerics), against kestrel-cpu's f32: `tests/moondream_vision.rs`
//! states the tolerance. Cost per image: the encoder on `crops x patches`
//! rows (as the CPU) plus one download of the features (`crops x patches x
//! enc_dim` f16) and one upload of the joined rows; the scratch
//! (`crops x patches x max(3 enc_dim, ff)` f32 and f16 rows) is allocated
//! per image and freed after it.

use half::f16;
use kestrel_model::moondream::{LayerNorm, VisionConfig, VisionWeights};
use kestrel_model::vision::{crops::normalize_pixel, pool_tiles, OverlapCrops, Tiling};
use kestrel_model::{DType, VisionModel};

use super::backend::{
    AddBias, AddLayerNorm, BiasGelu, DevMem, Device, HostMem, PagedAttention, PrefillAttention,
    RopeKvAppend,
};
use super::device::DeviceModel;
use super::region::Linear;
use super::Runtime;
use crate::quant::{BLOCK, MMVQ_CROSSOVER_ROWS, Q8_BLOCK_BYTES, TILE_ELEMS};
use crate::CudaError;

/// LayerNorm's epsilon (PyTorch's default, as kestrel-cpu's encoder).
const LN_EPS: f32 = 1e-5;

/// A LayerNorm's weight and bias on the device.
struct Norm<D: Device> {
    w: D::Buf,
    b: D::Buf,
}

impl<D: Device> Norm<D> {
    fn upload(d: &D, what: &str, ln: &LayerNorm, dim: usize) -> Result<Self, CudaError> {
        if ln.weight.len() != dim || ln.bias.len() != dim {
            return Err(CudaError::Unsupported(format!(
                "{what}: a LayerNorm of {} / {} values on width {dim}",
                ln.weight.len(),
                ln.bias.len()
            )));
        }
        Ok(Norm {
            w: d.upload(&ln.weight)?,
            b: d.upload(&ln.bias)?,
        })
    }
}

/// One pre-LN block.
struct Block<D: Device> {
    ln1: Norm<D>,
    qkv: Linear<D>,
    proj: Linear<D>,
    ln2: Norm<D>,
    fc1: Linear<D>,
    fc2: Linear<D>,
}

/// The encoder's and projector's weights on the device.
pub(crate) struct DeviceVision<D: Device> {
    cfg: VisionConfig,
    patch_emb: Linear<D>,
    pos_emb: D::Buf,
    blocks: Vec<Block<D>>,
    post_ln: Norm<D>,
    proj_fc1: Linear<D>,
    proj_fc2: Linear<D>,
}

/// One encoded image's projector output on the host: `[tokens][dim]` f32.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceImageTokens {
    pub tokens: usize,
    pub dim: usize,
    pub data: Vec<f32>,
}

impl<D: Device> DeviceModel<D> {
    /// Upload the vision encoder and projector; the int8 and tile scratch
    /// grow to cover their matrices.
    pub fn attach_vision(&mut self, w: &VisionWeights, c: &VisionConfig) -> Result<(), CudaError> {
        let (d_enc, p) = (c.enc_dim, c.patches());
        if c.enc_n_heads == 0 || d_enc % c.enc_n_heads != 0 || c.head_dim() > 256 {
            return Err(CudaError::Unsupported(format!(
                "a vision encoder of width {d_enc} in {} heads",
                c.enc_n_heads
            )));
        }
        if w.pos_emb.len() != p * d_enc || w.blocks.len() != c.enc_n_layers {
            return Err(CudaError::Unsupported(format!(
                "vision weights: {} position values for {p} x {d_enc}, {} blocks for {}",
                w.pos_emb.len(),
                w.blocks.len(),
                c.enc_n_layers
            )));
        }
        if c.proj_out_dim != self.cfg.hidden_size {
            return Err(CudaError::Unsupported(format!(
                "a projector of {} outputs for a text model of {}",
                c.proj_out_dim, self.cfg.hidden_size
            )));
        }
        let d = &self.d;
        let mut bytes = 0usize;
        let mut lin = |what: &str, l| Linear::upload(d, what, l, &mut bytes);
        let patch_emb = lin("vision patch_emb", &w.patch_emb)?;
        let mut blocks = Vec::with_capacity(w.blocks.len());
        for (i, b) in w.blocks.iter().enumerate() {
            let name = |s: &str| format!("vision block {i} {s}");
            blocks.push(Block {
                ln1: Norm::upload(d, &name("ln1"), &b.ln1, d_enc)?,
                qkv: lin(&name("qkv"), &b.qkv)?,
                proj: lin(&name("proj"), &b.proj)?,
                ln2: Norm::upload(d, &name("ln2"), &b.ln2, d_enc)?,
                fc1: lin(&name("fc1"), &b.mlp.fc1)?,
                fc2: lin(&name("fc2"), &b.mlp.fc2)?,
            });
        }
        let v = DeviceVision {
            cfg: *c,
            patch_emb,
            pos_emb: d.upload(&w.pos_emb)?,
            post_ln: Norm::upload(d, "vision post_ln", &w.post_ln, d_enc)?,
            proj_fc1: lin("vision proj fc1", &w.proj.fc1)?,
            proj_fc2: lin("vision proj fc2", &w.proj.fc2)?,
            blocks,
        };
        // Widths: each linear reads what the one before it wrote.
        let ff = c.enc_ff_dim;
        let bad = v.patch_emb.w.out != d_enc
            || v.patch_emb.w.inp < c.patch_dim()
            || v.blocks.iter().any(|b| {
                (b.qkv.w.inp, b.qkv.w.out) != (d_enc, 3 * d_enc)
                    || (b.proj.w.inp, b.proj.w.out) != (d_enc, d_enc)
                    || (b.fc1.w.inp, b.fc1.w.out) != (d_enc, ff)
                    || (b.fc2.w.inp, b.fc2.w.out) != (ff, d_enc)
            })
            || (v.proj_fc1.w.inp, v.proj_fc1.w.out) != (2 * d_enc, c.proj_inner_dim)
            || (v.proj_fc2.w.inp, v.proj_fc2.w.out) != (c.proj_inner_dim, c.proj_out_dim);
        if bad {
            return Err(CudaError::Unsupported(
                "vision weights whose widths do not chain (patch_emb, blocks, projector)".into(),
            ));
        }
        let mats = std::iter::once(&w.patch_emb)
            .chain(
                w.blocks
                    .iter()
                    .flat_map(|b| [&b.qkv, &b.proj, &b.mlp.fc1, &b.mlp.fc2]),
            )
            .chain([&w.proj.fc1, &w.proj.fc2])
            .map(|l| &l.weight);
        let (widest, quantized) = mats.fold((0, false), |(c, q), m| {
            (c.max(m.cols), q || m.dtype != DType::F16)
        });
        self.grow_scratch(
            MMVQ_CROSSOVER_ROWS * widest.div_ceil(BLOCK) * Q8_BLOCK_BYTES,
            quantized.then_some(TILE_ELEMS * 2),
        )?;
        self.weight_bytes += bytes;
        self.vision = Some(v);
        Ok(())
    }

    /// The encoder alone: the post-LN features of every crop, `[crops]
    /// [patches][enc_dim]` (f16 on the device, f32 here), the global crop
    /// first. Synchronous: returns once the device has run it.
    pub fn encode_crops(&self, crops: &OverlapCrops) -> Result<Vec<f32>, CudaError> {
        let v = self.vision()?;
        let c = &v.cfg;
        if crops.crop_size != c.crop_size {
            return Err(CudaError::Unsupported(format!(
                "crops of {} pixels for an encoder of {}",
                crops.crop_size, c.crop_size
            )));
        }
        let (n, p, dm, hd) = (crops.count(), c.patches(), c.enc_dim, c.head_dim());
        let (heads, ff, rows) = (c.enc_n_heads, c.enc_ff_dim, n * p);
        let d = &self.d;
        let f32s = |k: usize| d.alloc(k * 4);
        let f16s = |k: usize| d.alloc(k * 2);
        // Patch rows, zero-padded to the weight's width (a quantized
        // weight's columns padded to whole blocks at load meet zeros).
        let cols = v.patch_emb.w.inp;
        let patches = d.upload(&patchify(c, crops, cols))?;
        // Attention's metadata: a page per crop, every row masked at its
        // crop's last patch; K/V slots are the rows themselves.
        let iota: Vec<u32> = (0..rows as u32).collect();
        let slots = d.upload(&iota)?;
        let zeros = d.upload(&vec![0u32; rows])?;
        let row_seq = d.upload(&iota.iter().map(|&r| r / p as u32).collect::<Vec<_>>())?;
        let row_pos = d.upload(&vec![p as u32 - 1; rows])?;
        let kv_indptr = d.upload(&(0..=n as u32).collect::<Vec<_>>())?;
        let kv_indices = d.upload(&(0..n as u32).collect::<Vec<_>>())?;
        let (x, delta, h16) = (f32s(rows * dm)?, f32s(rows * dm)?, f16s(rows * dm)?);
        let (qkv, att16) = (f32s(rows * 3 * dm)?, f16s(rows * dm)?);
        let (kc, vc) = (f16s(rows * dm)?, f16s(rows * dm)?);
        let (ff32, ff16) = (f32s(rows * ff)?, f16s(rows * ff)?);
        self.linear(&v.patch_emb, patches.ptr(), x.ptr(), rows)?;
        d.add_bias(AddBias {
            y: x.ptr(),
            b: v.pos_emb.ptr(),
            stride: p * dm,
            d: p * dm,
            n,
        })?;
        let norm = |delta: u64, ln: &Norm<D>| {
            d.add_layer_norm(AddLayerNorm {
                x: x.ptr(),
                delta,
                w: ln.w.ptr(),
                b: ln.b.ptr(),
                out: h16.ptr(),
                out_row: 0,
                hidden: dm,
                eps: LN_EPS,
                n: rows,
            })
        };
        // The residual's pending sublayer output (none before the first).
        let mut pending = 0u64;
        for b in &v.blocks {
            norm(pending, &b.ln1)?;
            self.linear(&b.qkv, h16.ptr(), qkv.ptr(), rows)?;
            d.rope_kv_append(RopeKvAppend {
                qkv: qkv.ptr(),
                stride: 3 * dm,
                num_q_heads: heads,
                num_k_heads: heads,
                head_dim: hd,
                rotary_dim: 0,
                table: v.pos_emb.ptr(),
                pos: zeros.ptr(),
                interleaved: false,
                q_norm: 0,
                k_norm: 0,
                eps: 0.0,
                k_cache: kc.ptr(),
                v_cache: vc.ptr(),
                slot_mapping: slots.ptr(),
                n: rows,
            })?;
            d.prefill_attention(PrefillAttention {
                attn: PagedAttention {
                    qkv: qkv.ptr(),
                    stride: 3 * dm,
                    out: att16.ptr(),
                    k_cache: kc.ptr(),
                    v_cache: vc.ptr(),
                    row_seq: row_seq.ptr(),
                    row_pos: row_pos.ptr(),
                    kv_indptr: kv_indptr.ptr(),
                    kv_indices: kv_indices.ptr(),
                    num_heads: heads,
                    num_kv_heads: heads,
                    head_dim: hd,
                    page_size: p,
                    scale: 1.0 / (hd as f32).sqrt(),
                    window: 0,
                    n: rows,
                    max_splits: 0,
                    part: 0,
                },
            })?;
            self.linear(&b.proj, att16.ptr(), delta.ptr(), rows)?;
            norm(delta.ptr(), &b.ln2)?;
            self.linear(&b.fc1, h16.ptr(), ff32.ptr(), rows)?;
            d.bias_gelu(BiasGelu {
                y: ff32.ptr(),
                b: 0,
                out: ff16.ptr(),
                f: ff,
                n: rows,
            })?;
            self.linear(&b.fc2, ff16.ptr(), delta.ptr(), rows)?;
            pending = delta.ptr();
        }
        norm(pending, &v.post_ln)?;
        let mut host = d.host::<u16>(rows * dm)?;
        d.sync_compute()?;
        // SAFETY: `host` holds `rows * dm` values, as `h16`; it is read
        // only after `sync` below.
        unsafe { d.dtoh(host.as_mut_slice(), h16.ptr())? };
        d.sync()?;
        Ok(host
            .as_slice()
            .iter()
            .map(|&b| f16::from_bits(b).to_f32())
            .collect())
    }

    /// The projector over [`DeviceModel::encode_crops`]' features: the
    /// tiles' maps stitched and pooled to the grid (host), after the global
    /// crop's features channel-wise, through `fc1`, GELU-tanh, `fc2`
    /// (device). Synchronous.
    pub fn project(
        &self,
        features: &[f32],
        tiling: Tiling,
    ) -> Result<DeviceImageTokens, CudaError> {
        let v = self.vision()?;
        let c = &v.cfg;
        let (g, dm, p) = (c.grid(), c.enc_dim, c.patches());
        if features.len() != (tiling.tiles() + 1) * p * dm {
            return Err(CudaError::Unsupported(format!(
                "{} feature values for {} crops of {p} x {dm}",
                features.len(),
                tiling.tiles() + 1
            )));
        }
        let pooled = pool_tiles(&features[p * dm..], tiling, g, c.overlap_margin, dm);
        let mut joined = vec![f16::ZERO; p * 2 * dm];
        for (t, row) in joined.chunks_exact_mut(2 * dm).enumerate() {
            let (global, tiles) = row.split_at_mut(dm);
            for (o, &f) in global.iter_mut().zip(&features[t * dm..(t + 1) * dm]) {
                *o = f16::from_f32(f);
            }
            for (o, &f) in tiles.iter_mut().zip(&pooled[t * dm..(t + 1) * dm]) {
                *o = f16::from_f32(f);
            }
        }
        let d = &self.d;
        let (inner, out) = (c.proj_inner_dim, c.proj_out_dim);
        let x = d.upload(&joined)?;
        let (h32, h16, y) = (
            d.alloc(p * inner * 4)?,
            d.alloc(p * inner * 2)?,
            d.alloc(p * out * 4)?,
        );
        self.linear(&v.proj_fc1, x.ptr(), h32.ptr(), p)?;
        d.bias_gelu(BiasGelu {
            y: h32.ptr(),
            b: 0,
            out: h16.ptr(),
            f: inner,
            n: p,
        })?;
        self.linear(&v.proj_fc2, h16.ptr(), y.ptr(), p)?;
        let mut host = d.host::<f32>(p * out)?;
        d.sync_compute()?;
        // SAFETY: `host` holds `p * out` f32, as `y`; read after `sync`.
        unsafe { d.dtoh(host.as_mut_slice(), y.ptr())? };
        d.sync()?;
        Ok(DeviceImageTokens {
            tokens: p,
            dim: out,
            data: host.as_slice().to_vec(),
        })
    }

    /// The image tokens an encoded image gives (the crop grid's patches),
    /// with a vision encoder attached.
    pub fn image_tokens(&self) -> Option<usize> {
        self.vision.as_ref().map(|v| v.cfg.patches())
    }

    fn vision(&self) -> Result<&DeviceVision<D>, CudaError> {
        self.vision
            .as_ref()
            .ok_or_else(|| CudaError::Unsupported("no vision encoder attached".into()))
    }
}

impl<D: Device> Runtime<D> {
    /// Gives the runtime Moondream's vision encoder and projector
    /// (`runtime/vision.rs`): uploaded in their file's encoding, run by
    /// [`Runtime::encode_crops`] and [`Runtime::encode_image`].
    pub fn with_vision(mut self, vision: &VisionModel) -> Result<Self, CudaError> {
        self.dev.d.bind()?;
        self.synchronize()?;
        self.dev
            .attach_vision(&vision.weights, &vision.config.vision)?;
        self.dev.d.sync()?;
        Ok(self)
    }

    /// The vision encoder's post-LN features of every crop (`[crops]
    /// [patches][enc_dim]`, the global crop first), run on the device now,
    /// between steps (the compute stream is drained first).
    pub fn encode_crops(&mut self, crops: &OverlapCrops) -> Result<Vec<f32>, CudaError> {
        self.dev.d.bind()?;
        self.synchronize()?;
        self.dev.encode_crops(crops)
    }

    /// An image's tokens for the text model: the encoder, then the
    /// projector over its stitched and pooled features.
    pub fn encode_image(&mut self, crops: &OverlapCrops) -> Result<DeviceImageTokens, CudaError> {
        let features = self.encode_crops(crops)?;
        self.dev.project(&features, crops.tiling)
    }

    /// Images the prefills have run through the encoder and projector
    /// (an image served from the cache of encoded images is not counted).
    pub fn encoder_runs(&self) -> u64 {
        self.encoder_runs
    }

    /// Image rows the prefills served from the cache of encoded images.
    pub fn image_cache_hits(&self) -> u64 {
        self.image_cache_hits
    }
}

/// Crops to f16 patch rows `[crops * patches][cols]`, each patch
/// channel-major (c, y, x) as kestrel-cpu's `patchify`, pixels in [-1, 1],
/// columns past the patch's zero.
fn patchify(cfg: &VisionConfig, crops: &OverlapCrops, cols: usize) -> Vec<f16> {
    let (s, ps, g) = (cfg.crop_size, cfg.enc_patch_size, cfg.grid());
    let lut: [f16; 256] = std::array::from_fn(|v| f16::from_f32(normalize_pixel(v as u8)));
    let mut out = vec![f16::ZERO; crops.count() * g * g * cols];
    for (c, patches) in out.chunks_exact_mut(g * g * cols).enumerate() {
        let px = crops.crop(c);
        for (t, row) in patches.chunks_exact_mut(cols).enumerate() {
            let (py, pxl) = (t / g * ps, t % g * ps);
            for ch in 0..3 {
                for y in 0..ps {
                    for x in 0..ps {
                        row[(ch * ps + y) * ps + x] =
                            lut[px[((py + y) * s + pxl + x) * 3 + ch] as usize];
                    }
                }
            }
        }
    }
    out
}
