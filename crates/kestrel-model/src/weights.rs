//! Weights in their storage layout.
//!
//! A [`Matrix`] is `rows x cols`, row-major, each row `cols` elements encoded
//! in ggml's block layout for its [`DType`] (GGUF's `ne[0]` is `cols`). Rows
//! of `out_features` so `y = W x` reads one row per output. Data is either a
//! slice of the memory-mapped file or owned bytes; cloning is cheap (`Arc`).

use std::ops::Deref;
use std::sync::Arc;

/// Element encodings, with ggml's block layouts for the quantized ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// 32 elements: `f16 d`, `[i8; 32] q`; x = d * q. 34 bytes.
    Q8_0,
    /// 32 elements: `f16 d`, `[u8; 16]` nibbles (low nibbles = elements 0..16,
    /// high = 16..32); x = d * (q - 8). 18 bytes.
    Q4_0,
    /// 32 elements: `f16 d`, `f16 m`, `[u8; 16]` nibbles as Q4_0; x = d * q + m. 20 bytes.
    Q4_1,
    /// 32 elements: `f16 d`, `u32 qh` (bit e = fifth bit of element e),
    /// `[u8; 16]` nibbles as Q4_0; x = d * (q - 16). 22 bytes.
    Q5_0,
    /// 32 elements: `f16 d`, `f16 m`, `u32 qh`, `[u8; 16]` nibbles as Q5_0;
    /// x = d * q + m. 24 bytes.
    Q5_1,
    /// 256-element super-blocks (ggml `block_q4_K`), 144 bytes.
    Q4K,
    /// 256-element super-blocks (ggml `block_q5_K`), 176 bytes.
    Q5K,
    /// 256-element super-blocks (ggml `block_q6_K`), 210 bytes.
    Q6K,
}

impl DType {
    /// Every dtype Kestrel reads, in ggml type-id order.
    pub const ALL: [DType; 11] = [
        DType::F32,
        DType::F16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
        DType::BF16,
    ];

    /// Whether the type is block-quantized (every one but F32/F16/BF16).
    pub const fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// ggml's name for the type (`"Q4_K"`), as llama.cpp and model pages spell it.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q4K => "Q4_K",
            DType::Q5K => "Q5_K",
            DType::Q6K => "Q6_K",
        }
    }

    /// Elements per block.
    pub const fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => 32,
            DType::Q4K | DType::Q5K | DType::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q4K => 144,
            DType::Q5K => 176,
            DType::Q6K => 210,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Immutable bytes: a window of a shared memory map, or an owned buffer.
#[derive(Clone)]
pub enum Bytes {
    Mapped {
        map: Arc<memmap2::Mmap>,
        offset: usize,
        len: usize,
    },
    Owned(Arc<[u8]>),
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bytes::Mapped { offset, len, .. } => {
                write!(f, "Bytes::Mapped({len} bytes at {offset})")
            }
            Bytes::Owned(b) => write!(f, "Bytes::Owned({} bytes)", b.len()),
        }
    }
}

impl Bytes {
    /// A sub-window `[start, start + len)`. Free for mapped bytes; owned bytes
    /// are copied (only small test fixtures are owned).
    ///
    /// Panics if the window is out of bounds (callers check sizes first).
    pub fn slice(&self, start: usize, len: usize) -> Bytes {
        match self {
            Bytes::Mapped {
                map,
                offset,
                len: l,
            } => {
                assert!(start + len <= *l, "Bytes::slice out of bounds");
                Bytes::Mapped {
                    map: Arc::clone(map),
                    offset: offset + start,
                    len,
                }
            }
            Bytes::Owned(b) => Bytes::Owned(b[start..start + len].into()),
        }
    }

    /// Whether the bytes are a window of a memory map (no copy was made).
    pub fn is_mapped(&self) -> bool {
        matches!(self, Bytes::Mapped { .. })
    }
}

impl From<Vec<u8>> for Bytes {
    fn from(v: Vec<u8>) -> Self {
        Bytes::Owned(v.into())
    }
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, offset, len } => &map[*offset..*offset + *len],
            Bytes::Owned(b) => b,
        }
    }
}

/// A 2-D weight in storage layout. See the module docs.
#[derive(Debug, Clone)]
pub struct Matrix {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: Bytes,
}

impl Matrix {
    /// Bytes of one row (`cols` must be a multiple of the block size).
    pub fn row_bytes(&self) -> usize {
        self.cols / self.dtype.block_elems() * self.dtype.block_bytes()
    }

    /// The encoded bytes of row `r`.
    pub fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }
}

/// One decoder layer.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    /// `[num_heads * head_dim, hidden]`
    pub wq: Matrix,
    /// `[num_kv_heads * head_dim, hidden]`
    pub wk: Matrix,
    /// `[num_kv_heads * head_dim, hidden]`
    pub wv: Matrix,
    /// `[hidden, num_heads * head_dim]`
    pub wo: Matrix,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    /// `[head_dim]` per-head norms of q and k (`features.qk_norm`).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// `[hidden]` norm of the attention output (`features.post_norms`).
    pub post_attn_norm: Option<Vec<f32>>,
    /// `[hidden]`; empty in a parallel block (`features.parallel_block`),
    /// whose FFN reads `attn_norm`'s output.
    pub ffn_norm: Vec<f32>,
    /// `[intermediate, hidden]`; `None` in an ungated FFN
    /// (`features.gated_ffn` off: Phi's `fc1` is `w_up`).
    pub w_gate: Option<Matrix>,
    /// `[intermediate, hidden]`
    pub w_up: Matrix,
    /// `[hidden, intermediate]`
    pub w_down: Matrix,
    /// `[hidden]` norm of the FFN output (`features.post_norms`).
    pub post_ffn_norm: Option<Vec<f32>>,
    /// `[hidden]` LayerNorm bias of `attn_norm` (`features.norm` Layer).
    pub attn_norm_bias: Option<Vec<f32>>,
    /// Biases of `wo` (`[hidden]`), `w_up` (`[intermediate]`) and `w_down`
    /// (`[hidden]`) (`features.linear_biases`).
    pub bo: Option<Vec<f32>>,
    pub b_up: Option<Vec<f32>>,
    pub b_down: Option<Vec<f32>>,
}

/// All weights of a Llama-family decoder, in the RoPE convention of
/// `config.rope_style`.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    pub config: crate::ModelConfig,
    /// `[vocab, hidden]`
    pub token_embd: Matrix,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>,
    /// `[vocab, hidden]`; shares `token_embd`'s bytes when embeddings are tied.
    pub lm_head: Matrix,
    /// `[hidden]` LayerNorm bias of `output_norm` (`features.norm` Layer).
    pub output_norm_bias: Option<Vec<f32>>,
    /// `[vocab]` (`features.linear_biases`).
    pub lm_head_bias: Option<Vec<f32>>,
}
