//! A minimal GGUF v3 writer (default 32-byte alignment). [`write_gguf`]
//! builds small images in memory for fixtures; [`GgufWriter`] streams a file
//! of any size: the header first (every tensor's size follows from its
//! shape and type), then each tensor's bytes in order, so a writer never
//! holds more than the tensor it is writing.

use std::io::Write;

use super::{ggml_type_of, GgufValue, DEFAULT_ALIGNMENT, GGUF_MAGIC};
use crate::DType;

/// A tensor's header entry: name, dims in ggml order (`dims[0]` contiguous), type.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorDesc {
    pub name: String,
    pub dims: Vec<u64>,
    pub dtype: DType,
}

impl TensorDesc {
    /// Encoded bytes: whole blocks of the contiguous dimension, times the rest.
    pub fn data_bytes(&self) -> usize {
        let cols = self.dims.first().copied().unwrap_or(1) as usize;
        let rows: u64 = self.dims.iter().skip(1).product();
        cols / self.dtype.block_elems() * self.dtype.block_bytes() * rows as usize
    }
}

/// Streams a GGUF v3 file: [`GgufWriter::new`] writes the header, then
/// [`GgufWriter::tensor`] takes each tensor's bytes in header order (in as
/// many pieces as the caller likes), and [`GgufWriter::finish`] checks that
/// every byte arrived.
#[derive(Debug)]
pub struct GgufWriter<W: Write> {
    out: W,
    tensors: Vec<TensorDesc>,
    /// Index of the tensor being written and bytes of it written so far.
    current: usize,
    written: usize,
}

fn pad_to(out: &mut impl Write, len: usize) -> std::io::Result<()> {
    let align = DEFAULT_ALIGNMENT as usize;
    let pad = len.div_ceil(align) * align - len;
    out.write_all(&[0u8; 32][..pad])
}

impl<W: Write> GgufWriter<W> {
    /// Writes the header and the tensor table (padded to the alignment).
    pub fn new(
        mut out: W,
        metadata: &[(&str, GgufValue)],
        tensors: Vec<TensorDesc>,
    ) -> std::io::Result<Self> {
        let header = header_bytes(metadata, &tensors);
        out.write_all(&header)?;
        Ok(GgufWriter {
            out,
            tensors,
            current: 0,
            written: 0,
        })
    }

    /// Appends `bytes` to the current tensor, moving to the next (after
    /// padding) once it is complete. Panics past the last tensor's end or
    /// if a piece straddles two tensors.
    pub fn tensor(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        let want = self.tensors[self.current].data_bytes();
        assert!(
            self.written + bytes.len() <= want,
            "tensor `{}`: {} bytes past its {want}",
            self.tensors[self.current].name,
            self.written + bytes.len() - want
        );
        self.out.write_all(bytes)?;
        self.written += bytes.len();
        if self.written == want {
            pad_to(&mut self.out, want)?;
            self.current += 1;
            self.written = 0;
        }
        Ok(())
    }

    /// Flushes and returns the sink. Panics if a tensor is incomplete.
    pub fn finish(mut self) -> std::io::Result<W> {
        assert!(
            self.current == self.tensors.len() && self.written == 0,
            "GGUF finished with tensor {} of {} incomplete",
            self.current,
            self.tensors.len()
        );
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Serializes a GGUF v3 image in memory (used by tests and fixture builders).
///
/// `tensors` are `(name, dims in ggml order, dtype, encoded bytes)`.
pub fn write_gguf(
    metadata: &[(&str, GgufValue)],
    tensors: &[(&str, Vec<u64>, DType, Vec<u8>)],
) -> Vec<u8> {
    let descs = tensors
        .iter()
        .map(|(name, dims, dtype, _)| TensorDesc {
            name: name.to_string(),
            dims: dims.clone(),
            dtype: *dtype,
        })
        .collect();
    let mut w = GgufWriter::new(Vec::new(), metadata, descs).expect("writing to memory");
    for (_, _, _, bytes) in tensors {
        w.tensor(bytes).expect("writing to memory");
    }
    w.finish().expect("writing to memory")
}

fn header_bytes(metadata: &[(&str, GgufValue)], tensors: &[TensorDesc]) -> Vec<u8> {
    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    fn type_id(v: &GgufValue) -> u32 {
        match v {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }
    fn put_val(out: &mut Vec<u8>, v: &GgufValue) {
        match v {
            GgufValue::U8(x) => out.push(*x),
            GgufValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::Bool(x) => out.push(u8::from(*x)),
            GgufValue::String(s) => put_str(out, s),
            GgufValue::Array(items) => {
                let elem = items.first().map_or(4, type_id);
                out.extend_from_slice(&elem.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                items.iter().for_each(|i| put_val(out, i));
            }
            GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        }
    }
    let align = DEFAULT_ALIGNMENT as usize;
    let mut out = Vec::new();
    out.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_str(&mut out, k);
        out.extend_from_slice(&type_id(v).to_le_bytes());
        put_val(&mut out, v);
    }
    let mut offset = 0usize;
    for t in tensors {
        put_str(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        t.dims
            .iter()
            .for_each(|d| out.extend_from_slice(&d.to_le_bytes()));
        out.extend_from_slice(&ggml_type_of(t.dtype).to_le_bytes());
        out.extend_from_slice(&(offset as u64).to_le_bytes());
        offset += t.data_bytes().div_ceil(align) * align;
    }
    out.resize(out.len().div_ceil(align) * align, 0);
    out
}
