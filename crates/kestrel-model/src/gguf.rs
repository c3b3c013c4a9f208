//! A memory-mapped GGUF (v2/v3) reader: header, typed metadata, tensor infos.
//!
//! Parsing touches only the header and metadata (a few MB for a 49k-token
//! vocabulary); tensor data stays in the map and is handed out as
//! [`Bytes::Mapped`] windows, so opening a 100 MB model copies no weights.
//! Every length read from the file is checked against the bytes that remain,
//! so a malformed file yields a typed error, never a panic or a huge alloc.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::{Bytes, DType, Matrix, ModelError};

mod write;
pub use write::{write_gguf, GgufWriter, TensorDesc};

pub(crate) const GGUF_MAGIC: u32 = 0x4655_4747; // "GGUF" little-endian
pub(crate) const DEFAULT_ALIGNMENT: u64 = 32;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// Any non-negative integer value.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value, signed.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// A float (or integer) value as `f32`.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            GgufValue::F32(v) => Some(v),
            GgufValue::F64(v) => Some(v as f32),
            _ => self.as_i64().map(|v| v as f32),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where one tensor lives and what it is.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous (column) dimension.
    pub dims: Vec<u64>,
    /// Raw ggml type id; see [`ggml_type_name`] and [`GgufTensorInfo::dtype`].
    pub ggml_type: u32,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// The Kestrel [`DType`], or a typed error naming the tensor and type.
    pub fn dtype(&self) -> Result<DType, ModelError> {
        dtype_from_ggml(self.ggml_type).ok_or_else(|| ModelError::UnsupportedTensorType {
            tensor: self.name.clone(),
            type_id: self.ggml_type,
            type_name: ggml_type_name(self.ggml_type),
            supported: SUPPORTED_TYPE_NAMES,
        })
    }

    pub fn num_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// The tensor types Kestrel reads, for error messages (see [`DType::ALL`]).
pub const SUPPORTED_TYPE_NAMES: &str =
    "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K";

/// Maps a ggml type id to a supported [`DType`].
pub fn dtype_from_ggml(type_id: u32) -> Option<DType> {
    Some(match type_id {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        6 => DType::Q5_0,
        7 => DType::Q5_1,
        8 => DType::Q8_0,
        12 => DType::Q4K,
        13 => DType::Q5K,
        14 => DType::Q6K,
        30 => DType::BF16,
        _ => return None,
    })
}

/// The ggml type id of a [`DType`] (inverse of [`dtype_from_ggml`]).
pub fn ggml_type_of(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q5_0 => 6,
        DType::Q5_1 => 7,
        DType::Q8_0 => 8,
        DType::Q4K => 12,
        DType::Q5K => 13,
        DType::Q6K => 14,
        DType::BF16 => 30,
    }
}

/// ggml's name for a type id (for error messages).
pub fn ggml_type_name(type_id: u32) -> &'static str {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
    ];
    NAMES.get(type_id as usize).copied().unwrap_or("unknown")
}

/// A parsed GGUF file. Cloning is cheap (the data is shared).
#[derive(Debug, Clone)]
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: u64,
    /// Absolute file offset of the tensor data section.
    pub data_offset: u64,
    index: HashMap<String, usize>,
    data: Bytes,
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: the map is read-only and Kestrel never writes model files.
        // As with every mmap-based loader, another process truncating or
        // rewriting the file while it is mapped is outside our control.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let len = map.len();
        let data = Bytes::Mapped {
            map: Arc::new(map),
            offset: 0,
            len,
        };
        Self::parse(data, path.to_path_buf())
    }

    /// Parses an in-memory (or already mapped) GGUF image; `path` labels errors.
    pub fn parse(data: Bytes, path: PathBuf) -> Result<Self, ModelError> {
        let mut r = Reader {
            buf: &data,
            pos: 0,
            path: &path,
        };
        let magic = r.u32("magic")?;
        if magic != GGUF_MAGIC {
            return Err(ModelError::BadMagic { path, found: magic });
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(ModelError::UnsupportedGgufVersion { path, version });
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        r.check_count(n_kv, 13, "metadata count")?;
        r.check_count(n_tensors, 24, "tensor count")?;

        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let ty = r.u32("metadata value type")?;
            let value = r.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => return Err(malformed(&path, format!("bad general.alignment {v:?}"))),
            },
        };

        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut index = HashMap::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = r.string("tensor name")?;
            let n_dims = r.u32("tensor dims")?;
            if n_dims == 0 || n_dims > 4 {
                return Err(malformed(
                    &path,
                    format!("tensor `{name}` has {n_dims} dims"),
                ));
            }
            let dims = (0..n_dims)
                .map(|_| r.u64("tensor dim"))
                .collect::<Result<Vec<_>, _>>()?;
            let ggml_type = r.u32("tensor type")?;
            let offset = r.u64("tensor offset")?;
            if offset % alignment != 0 {
                return Err(malformed(
                    &path,
                    format!("tensor `{name}` offset {offset} is not {alignment}-aligned"),
                ));
            }
            if index.insert(name.clone(), tensors.len()).is_some() {
                return Err(malformed(&path, format!("duplicate tensor `{name}`")));
            }
            tensors.push(GgufTensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }

        let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
        let file_len = data.len() as u64;
        for t in &tensors {
            let Some(dtype) = dtype_from_ggml(t.ggml_type) else {
                continue;
            };
            let size = tensor_nbytes(t, dtype).ok_or_else(|| {
                malformed(
                    &path,
                    format!(
                        "tensor `{}` dims {:?} do not fit {dtype:?} blocks",
                        t.name, t.dims
                    ),
                )
            })?;
            let end = data_offset
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(size));
            if end.is_none_or(|e| e > file_len) {
                return Err(ModelError::Truncated {
                    path,
                    what: format!("data of tensor `{}`", t.name),
                    offset: data_offset.saturating_add(t.offset),
                });
            }
        }

        Ok(GgufFile {
            path,
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
            index,
            data,
        })
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    fn require(&self, key: &str) -> Result<&GgufValue, ModelError> {
        self.get(key)
            .ok_or_else(|| ModelError::MissingMetadata { key: key.into() })
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, ModelError> {
        self.require(key)?
            .as_u64()
            .ok_or_else(|| type_err(key, "unsigned integer"))
    }

    pub fn get_usize(&self, key: &str) -> Result<usize, ModelError> {
        usize::try_from(self.get_u64(key)?).map_err(|_| type_err(key, "usize"))
    }

    pub fn get_f32(&self, key: &str) -> Result<f32, ModelError> {
        self.require(key)?
            .as_f32()
            .ok_or_else(|| type_err(key, "float"))
    }

    pub fn get_str(&self, key: &str) -> Result<&str, ModelError> {
        self.require(key)?
            .as_str()
            .ok_or_else(|| type_err(key, "string"))
    }

    pub fn get_array(&self, key: &str) -> Result<&[GgufValue], ModelError> {
        self.require(key)?
            .as_array()
            .ok_or_else(|| type_err(key, "array"))
    }

    /// An array of strings (e.g. `tokenizer.ggml.tokens`).
    pub fn get_string_array(&self, key: &str) -> Result<Vec<&str>, ModelError> {
        self.get_array(key)?
            .iter()
            .map(|v| v.as_str().ok_or_else(|| type_err(key, "array of strings")))
            .collect()
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor (a window of the map, no copy).
    pub fn tensor_bytes(&self, name: &str) -> Result<(&GgufTensorInfo, DType, Bytes), ModelError> {
        let t = self.tensor(name).ok_or_else(|| ModelError::MissingTensor {
            tensor: name.into(),
        })?;
        let dtype = t.dtype()?;
        // Size and bounds were checked in `parse` for every supported type.
        let size = tensor_nbytes(t, dtype).unwrap_or(0);
        let start = (self.data_offset + t.offset) as usize;
        Ok((t, dtype, self.data.slice(start, size as usize)))
    }

    /// A 2-D tensor as a [`Matrix`] (`rows = dims[1]`, `cols = dims[0]`).
    pub fn matrix(&self, name: &str) -> Result<Matrix, ModelError> {
        let (t, dtype, data) = self.tensor_bytes(name)?;
        if t.dims.len() != 2 {
            return Err(ModelError::ShapeMismatch {
                tensor: name.into(),
                expected: vec![0, 0],
                found: t.dims.iter().map(|&d| d as usize).collect(),
            });
        }
        Ok(Matrix {
            dtype,
            rows: t.dims[1] as usize,
            cols: t.dims[0] as usize,
            data,
        })
    }

    /// A 1-D tensor (a norm weight or a bias) dequantized to `f32`.
    pub fn vector_f32(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let (t, dtype, data) = self.tensor_bytes(name)?;
        if t.dims.len() != 1 {
            return Err(ModelError::ShapeMismatch {
                tensor: name.into(),
                expected: vec![t.num_elements() as usize],
                found: t.dims.iter().map(|&d| d as usize).collect(),
            });
        }
        let m = Matrix {
            dtype,
            rows: 1,
            cols: t.dims[0] as usize,
            data,
        };
        Ok(m.to_f32())
    }
}

/// Bytes of a tensor, or `None` if the dims do not tile into blocks.
fn tensor_nbytes(t: &GgufTensorInfo, dtype: DType) -> Option<u64> {
    let cols = *t.dims.first()?;
    let be = dtype.block_elems() as u64;
    if cols % be != 0 {
        return None;
    }
    let rows = t.dims[1..]
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))?;
    (cols / be)
        .checked_mul(dtype.block_bytes() as u64)?
        .checked_mul(rows)
}

fn malformed(path: &Path, reason: String) -> ModelError {
    ModelError::MalformedGguf {
        path: path.to_path_buf(),
        reason,
    }
}

fn type_err(key: &str, expected: &'static str) -> ModelError {
    ModelError::MetadataType {
        key: key.into(),
        expected,
    }
}

/// Bounds-checked little-endian cursor.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl Reader<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], ModelError> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.buf.len() => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            _ => Err(ModelError::Truncated {
                path: self.path.to_path_buf(),
                what: what.to_string(),
                offset: self.pos as u64,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], ModelError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, ModelError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, ModelError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Rejects counts that could not fit in the rest of the file.
    fn check_count(&self, count: u64, min_elem_bytes: u64, what: &str) -> Result<(), ModelError> {
        let remaining = (self.buf.len() - self.pos) as u64;
        if count.saturating_mul(min_elem_bytes) > remaining {
            return Err(ModelError::Truncated {
                path: self.path.to_path_buf(),
                what: format!("{what} ({count} entries)"),
                offset: self.pos as u64,
            });
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String, ModelError> {
        let len = self.u64(what)?;
        self.check_count(len, 1, what)?;
        let bytes = self.take(len as usize, what)?;
        // Token strings are occasionally not valid UTF-8 (partial byte tokens
        // in some vocabularies); keep them readable rather than failing.
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<GgufValue, ModelError> {
        Ok(match ty {
            0 => GgufValue::U8(u8::from_le_bytes(self.array(key)?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.array(key)?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => GgufValue::U32(self.u32(key)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => GgufValue::Bool(self.array::<1>(key)?[0] != 0),
            8 => GgufValue::String(self.string(key)?),
            9 if depth < 4 => {
                let elem_ty = self.u32(key)?;
                let n = self.u64(key)?;
                self.check_count(n, 1, key)?;
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(key)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(key)?)),
            _ => {
                return Err(ModelError::UnknownValueType {
                    path: self.path.to_path_buf(),
                    key: key.to_string(),
                    type_id: ty,
                })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: Vec<u8>) -> Result<GgufFile, ModelError> {
        GgufFile::parse(Bytes::Owned(bytes.into()), PathBuf::from("test.gguf"))
    }

    fn sample() -> Vec<u8> {
        let f32s: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        write_gguf(
            &[
                ("general.architecture", GgufValue::String("llama".into())),
                ("llama.block_count", GgufValue::U32(2)),
                ("x.f", GgufValue::F32(0.5)),
                ("x.i64", GgufValue::I64(-3)),
                ("x.f64", GgufValue::F64(2.5)),
                ("x.b", GgufValue::Bool(true)),
                (
                    "x.arr",
                    GgufValue::Array(vec![
                        GgufValue::String("a".into()),
                        GgufValue::String("b".into()),
                    ]),
                ),
                (
                    "x.nested",
                    GgufValue::Array(vec![GgufValue::Array(vec![
                        GgufValue::U8(1),
                        GgufValue::U8(2),
                    ])]),
                ),
            ],
            &[
                ("w", vec![3, 2], DType::F32, f32s),
                ("n", vec![2], DType::F32, vec![0; 8]),
            ],
        )
    }

    #[test]
    fn parses_metadata_and_tensors() {
        let g = parse(sample()).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(g.get_usize("llama.block_count").unwrap(), 2);
        assert_eq!(g.get_f32("x.f").unwrap(), 0.5);
        assert_eq!(g.get("x.i64").unwrap().as_i64(), Some(-3));
        assert_eq!(g.get_f32("x.f64").unwrap(), 2.5);
        assert_eq!(g.get("x.b").unwrap().as_bool(), Some(true));
        assert_eq!(g.get_string_array("x.arr").unwrap(), vec!["a", "b"]);
        assert_eq!(
            g.get_array("x.nested").unwrap()[0]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        let m = g.matrix("w").unwrap();
        assert_eq!((m.rows, m.cols), (2, 3));
        assert_eq!(m.to_f32(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(g.vector_f32("n").unwrap(), vec![0.0, 0.0]);
        assert!(matches!(
            g.get_str("llama.block_count"),
            Err(ModelError::MetadataType { .. })
        ));
        assert!(matches!(
            g.get_u64("nope"),
            Err(ModelError::MissingMetadata { .. })
        ));
        assert!(matches!(
            g.matrix("nope"),
            Err(ModelError::MissingTensor { .. })
        ));
    }

    #[test]
    fn bad_magic_and_version() {
        let mut b = sample();
        b[0] = b'X';
        assert!(matches!(parse(b), Err(ModelError::BadMagic { .. })));
        let mut b = sample();
        b[4] = 1;
        assert!(matches!(
            parse(b),
            Err(ModelError::UnsupportedGgufVersion { version: 1, .. })
        ));
    }

    #[test]
    fn every_truncation_is_a_typed_error() {
        let b = sample();
        let full = parse(b.clone()).unwrap();
        // The last tensor ("n", 2 x f32) ends 40 bytes into the data section.
        let end = full.data_offset as usize + 40;
        for cut in 0..end {
            let r = parse(b[..cut].to_vec());
            assert!(
                matches!(
                    r,
                    Err(ModelError::Truncated { .. }) | Err(ModelError::MalformedGguf { .. })
                ),
                "cut at {cut}: {r:?}"
            );
        }
    }

    #[test]
    fn unknown_value_type() {
        let mut b = write_gguf(&[("k", GgufValue::U32(1))], &[]);
        // magic(4) version(4) n_tensors(8) n_kv(8) keylen(8) "k"(1) -> type at 33
        b[33] = 99;
        assert!(matches!(
            parse(b),
            Err(ModelError::UnknownValueType { type_id: 99, .. })
        ));
    }

    #[test]
    fn unsupported_tensor_type_names_tensor() {
        let mut b = write_gguf(
            &[],
            &[("blk.0.attn_q.weight", vec![32, 1], DType::Q4_0, vec![0; 18])],
        );
        // header 24 + name(8 + 19) + ndims 4 + dims 16 -> type at 71
        b[71] = 10; // Q2_K
        let g = parse(b).unwrap();
        match g.matrix("blk.0.attn_q.weight") {
            Err(e @ ModelError::UnsupportedTensorType { .. }) => {
                let msg = e.to_string();
                let ModelError::UnsupportedTensorType {
                    tensor, type_name, ..
                } = e
                else {
                    unreachable!()
                };
                assert_eq!(tensor, "blk.0.attn_q.weight");
                assert_eq!(type_name, "Q2_K");
                assert!(
                    msg.contains("Q2_K") && msg.contains("Q4_K, Q5_K, Q6_K"),
                    "{msg}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn ggml_type_ids_round_trip_and_name_every_dtype() {
        for d in DType::ALL {
            let id = ggml_type_of(d);
            assert_eq!(dtype_from_ggml(id), Some(d));
            assert_eq!(ggml_type_name(id), d.name());
            assert!(SUPPORTED_TYPE_NAMES.contains(d.name()), "{d}");
        }
        assert_eq!(SUPPORTED_TYPE_NAMES.split(", ").count(), DType::ALL.len());
    }

    #[test]
    fn custom_alignment_is_honoured() {
        // Re-layout with alignment 64 by hand: one F32 tensor.
        let data: Vec<u8> = (0..4u32).flat_map(|x| (x as f32).to_le_bytes()).collect();
        let mut b = write_gguf(
            &[("general.alignment", GgufValue::U32(64))],
            &[("t", vec![4], DType::F32, data.clone())],
        );
        // write_gguf aligns to 32; move the data to the next 64 boundary.
        let data_start = b.len() - 32;
        let aligned = data_start.div_ceil(64) * 64;
        b.truncate(data_start);
        b.resize(aligned, 0);
        b.extend_from_slice(&data);
        let g = parse(b).unwrap();
        assert_eq!(g.alignment, 64);
        assert_eq!(g.data_offset % 64, 0);
        assert_eq!(g.vector_f32("t").unwrap(), vec![0.0, 1.0, 2.0, 3.0]);
    }
}
