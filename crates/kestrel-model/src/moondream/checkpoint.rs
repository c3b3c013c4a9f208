//! A Moondream 2 `model.safetensors` into typed, shape-checked weights.
//!
//! Two tensor namings are published (docs/moondream.md): the Hugging Face
//! repository's state-dict names (`model.vision.*`, `model.text.*`,
//! `model.region.*`, [`NameScheme::Hf`]) and the exported names the
//! reference's `weights.py` maps (`vision_encoder.*`, `text_model.*`,
//! `region_model.*`, [`NameScheme::Exported`]; its Fourier feature
//! matrices stored transposed). Both load into one [`MoondreamWeights`].
//! Matrices stay mapped as stored (F32, F16 or BF16); vectors (biases,
//! norms, position embedding, Fourier features) are read to f32. Every
//! missing tensor, wrong shape or dtype is a [`ModelError`] naming it.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::{Dtype, SafeTensors};

use super::config::MoondreamConfig;
use crate::{Bytes, Matrix, ModelError, ModelWeights};

/// Which published tensor naming a checkpoint uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameScheme {
    /// `model.vision.blocks.0.attn.qkv.weight`, ... (the HF repository).
    Hf,
    /// `vision_encoder.encoder.model.visual.blocks.0.attn.qkv.weight`, ...
    Exported,
}

/// `y = x W^T + b`: `weight` is `[out, in]` as stored.
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Matrix,
    pub bias: Vec<f32>,
}

/// LayerNorm's scale and shift (eps 1e-5, PyTorch's default).
#[derive(Debug, Clone)]
pub struct LayerNorm {
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
}

/// `fc2(gelu_tanh(fc1(x)))`.
#[derive(Debug, Clone)]
pub struct Mlp {
    pub fc1: Linear,
    pub fc2: Linear,
}

/// One pre-LN ViT block.
#[derive(Debug, Clone)]
pub struct VisionBlock {
    pub ln1: LayerNorm,
    /// `[3 * enc_dim, enc_dim]`: Q, K, V stacked.
    pub qkv: Linear,
    pub proj: Linear,
    pub ln2: LayerNorm,
    pub mlp: Mlp,
}

/// The vision encoder and projector.
#[derive(Debug, Clone)]
pub struct VisionWeights {
    /// `[enc_dim, 3 * 14 * 14]`, input channel-major (c, y, x).
    pub patch_emb: Linear,
    /// `[patches][enc_dim]`.
    pub pos_emb: Vec<f32>,
    pub blocks: Vec<VisionBlock>,
    pub post_ln: LayerNorm,
    /// `fc1`: `[proj_inner_dim, 2 * enc_dim]`; `fc2`: `[proj_out_dim, proj_inner_dim]`.
    pub proj: Mlp,
}

/// The region model (coordinates and sizes).
#[derive(Debug, Clone)]
pub struct RegionWeights {
    /// `[1][coord_feat_dim / 2]`: Fourier frequencies, `x @ w`.
    pub coord_features: Vec<f32>,
    pub coord_encoder: Linear,
    pub coord_decoder: Mlp,
    /// `[2][size_feat_dim / 2]`.
    pub size_features: Vec<f32>,
    pub size_encoder: Linear,
    pub size_decoder: Mlp,
}

/// A loaded checkpoint.
#[derive(Debug, Clone)]
pub struct MoondreamWeights {
    pub config: MoondreamConfig,
    pub names: NameScheme,
    pub vision: VisionWeights,
    /// The text decoder as `Family::Phi` weights
    /// ([`super::TextConfig::model_config`]).
    pub text: ModelWeights,
    /// `None` when the checkpoint has no region model (text skills only).
    pub region: Option<RegionWeights>,
}

/// Loads `path` (a `model.safetensors`, or a directory holding one) with
/// `config`'s shapes.
pub fn load_checkpoint(
    path: &Path,
    config: MoondreamConfig,
) -> Result<MoondreamWeights, ModelError> {
    let file = if path.is_dir() {
        path.join("model.safetensors")
    } else {
        path.to_owned()
    };
    let store = Store::open(&file)?;
    let names = if store.has("model.vision.blocks.0.attn.proj.bias") {
        NameScheme::Hf
    } else if store.has("vision_encoder.encoder.model.visual.blocks.0.attn.proj.bias") {
        NameScheme::Exported
    } else {
        return Err(ModelError::MissingTensor {
            tensor: "model.vision.blocks.0.attn.proj.bias (or the exported \
                     vision_encoder.encoder.model.visual.blocks.0.attn.proj.bias)"
                .into(),
        });
    };
    let l = Loader {
        s: &store,
        names,
        c: &config,
    };
    let vision = l.vision()?;
    let region = l.region()?;
    let dir = file.parent().unwrap_or(Path::new("."));
    let text = crate::moondream_text_weights(dir, config.text.model_config(), names)?;
    Ok(MoondreamWeights {
        config,
        names,
        vision,
        text,
        region,
    })
}

struct Loader<'a> {
    s: &'a Store,
    names: NameScheme,
    c: &'a MoondreamConfig,
}

impl Loader<'_> {
    /// The name of a tensor in this checkpoint's scheme.
    fn n(&self, hf: &str, exported: &str) -> String {
        match self.names {
            NameScheme::Hf => hf.to_owned(),
            NameScheme::Exported => exported.to_owned(),
        }
    }

    fn linear(&self, name: &str, out: usize, inp: usize) -> Result<Linear, ModelError> {
        Ok(Linear {
            weight: self.s.matrix(&format!("{name}.weight"), out, inp)?,
            bias: self.s.vector(&format!("{name}.bias"), &[out])?,
        })
    }

    fn norm(&self, name: &str, dim: usize) -> Result<LayerNorm, ModelError> {
        Ok(LayerNorm {
            weight: self.s.vector(&format!("{name}.weight"), &[dim])?,
            bias: self.s.vector(&format!("{name}.bias"), &[dim])?,
        })
    }

    fn mlp(&self, fc1: &str, fc2: &str, dims: [usize; 3]) -> Result<Mlp, ModelError> {
        Ok(Mlp {
            fc1: self.linear(fc1, dims[1], dims[0])?,
            fc2: self.linear(fc2, dims[2], dims[1])?,
        })
    }

    fn vision(&self) -> Result<VisionWeights, ModelError> {
        let v = &self.c.vision;
        let d = v.enc_dim;
        let root = self.n("model.vision", "vision_encoder.encoder.model.visual");
        let blocks = (0..v.enc_n_layers)
            .map(|i| {
                let b = format!("{root}.blocks.{i}");
                Ok(VisionBlock {
                    ln1: self.norm(&self.n(&format!("{b}.ln1"), &format!("{b}.norm1")), d)?,
                    qkv: self.linear(&format!("{b}.attn.qkv"), 3 * d, d)?,
                    proj: self.linear(&format!("{b}.attn.proj"), d, d)?,
                    ln2: self.norm(&self.n(&format!("{b}.ln2"), &format!("{b}.norm2")), d)?,
                    mlp: self.mlp(
                        &format!("{b}.mlp.fc1"),
                        &format!("{b}.mlp.fc2"),
                        [d, v.enc_ff_dim, d],
                    )?,
                })
            })
            .collect::<Result<_, ModelError>>()?;
        let proj = self.n("model.vision.proj_mlp", "vision_encoder.projection.mlp");
        Ok(VisionWeights {
            patch_emb: self.linear(
                &self.n(
                    &format!("{root}.patch_emb"),
                    &format!("{root}.patch_embed.linear"),
                ),
                d,
                v.patch_dim(),
            )?,
            pos_emb: self.s.vector(
                &self.n(&format!("{root}.pos_emb"), &format!("{root}.pos_embed")),
                &[1, v.patches(), d],
            )?,
            blocks,
            post_ln: self.norm(
                &self.n(&format!("{root}.post_ln"), &format!("{root}.norm")),
                d,
            )?,
            proj: self.mlp(
                &format!("{proj}.fc1"),
                &format!("{proj}.fc2"),
                [2 * d, v.proj_inner_dim, v.proj_out_dim],
            )?,
        })
    }

    fn region(&self) -> Result<Option<RegionWeights>, ModelError> {
        let r = &self.c.region;
        let root = self.n("model.region", "region_model");
        let coord_enc = self.n(
            "model.region.coord_encoder",
            "region_model.coordinate_encoder",
        );
        if !self.s.has(&format!("{coord_enc}.weight")) {
            return Ok(None);
        }
        let coord_dec = self.n(
            "model.region.coord_decoder",
            "region_model.coordinate_decoder",
        );
        let features = |hf: &str, ex: &str, inputs: usize, feat: usize| match self.names {
            NameScheme::Hf => self.s.vector(hf, &[inputs, feat / 2]),
            // Stored transposed: `[feat / 2, inputs]`.
            NameScheme::Exported => {
                let t = self.s.vector(ex, &[feat / 2, inputs])?;
                Ok((0..inputs)
                    .flat_map(|i| (0..feat / 2).map(move |k| (i, k)))
                    .map(|(i, k)| t[k * inputs + i])
                    .collect())
            }
        };
        Ok(Some(RegionWeights {
            coord_features: features(
                "model.region.coord_features",
                "region_model.coordinate_features.weight",
                1,
                r.coord_feat_dim,
            )?,
            coord_encoder: self.linear(&coord_enc, r.dim, r.coord_feat_dim)?,
            coord_decoder: self.mlp(
                &format!("{coord_dec}.fc1"),
                &format!("{coord_dec}.fc2"),
                [r.dim, r.inner_dim, r.coord_out_dim],
            )?,
            size_features: features(
                "model.region.size_features",
                "region_model.size_features.weight",
                2,
                r.size_feat_dim,
            )?,
            size_encoder: self.linear(&format!("{root}.size_encoder"), r.dim, r.size_feat_dim)?,
            size_decoder: self.mlp(
                &format!("{root}.size_decoder.fc1"),
                &format!("{root}.size_decoder.fc2"),
                [r.dim, r.inner_dim, r.size_out_dim],
            )?,
        }))
    }
}

/// One safetensors file's tensors, as windows of its map. Names lose the
/// `._orig_mod` that `torch.compile`d modules add (as the reference's
/// loader strips it).
struct Store {
    path: PathBuf,
    tensors: HashMap<String, (Dtype, Vec<usize>, Bytes)>,
}

impl Store {
    fn open(path: &Path) -> Result<Store, ModelError> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: a read-only map of a checkpoint Kestrel never writes; as
        // with any mmap loader, truncation by another process while mapped
        // is outside our control.
        let map =
            Arc::new(unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?);
        let (header_len, meta) =
            SafeTensors::read_metadata(&map).map_err(|source| ModelError::Safetensors {
                path: path.to_owned(),
                source,
            })?;
        let base = 8 + header_len;
        let tensors = meta
            .tensors()
            .into_iter()
            .map(|(name, info)| {
                let (start, end) = info.data_offsets;
                let bytes = Bytes::Mapped {
                    map: Arc::clone(&map),
                    offset: base + start,
                    len: end - start,
                };
                (
                    name.replace("._orig_mod", ""),
                    (info.dtype, info.shape.clone(), bytes),
                )
            })
            .collect();
        Ok(Store {
            path: path.to_owned(),
            tensors,
        })
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The tensor's data as a `rows x cols` matrix of its stored dtype,
    /// after checking its shape is exactly `shape`.
    fn get(&self, name: &str, shape: &[usize]) -> Result<Matrix, ModelError> {
        let (dtype, found, bytes) =
            self.tensors
                .get(name)
                .ok_or_else(|| ModelError::MissingTensor {
                    tensor: format!("{name} (in {})", self.path.display()),
                })?;
        if found.as_slice() != shape {
            return Err(ModelError::ShapeMismatch {
                tensor: name.into(),
                expected: shape.to_vec(),
                found: found.clone(),
            });
        }
        let dtype = crate::safetensors_load::float_dtype(name, *dtype)?;
        let cols = *shape.last().unwrap_or(&1);
        Ok(Matrix {
            dtype,
            rows: shape.iter().product::<usize>() / cols.max(1),
            cols,
            data: bytes.clone(),
        })
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
        self.get(name, &[rows, cols])
    }

    fn vector(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        Ok(self.get(name, shape)?.to_f32())
    }
}
