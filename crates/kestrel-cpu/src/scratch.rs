//! Activation buffers of the forward pass, allocated once for a maximum
//! number of token rows per call and a maximum context length, then reused:
//! a steady-state decode step allocates nothing. Size is dominated by
//! `max_rows * (4 * hidden + 3 * intermediate + ...)` floats plus one score
//! row of `max_context` floats per worker thread. The float buffers start
//! on cache lines ([`LineBuf`]), so the kernels' 64-byte vector loads and
//! stores of a row never straddle two.

use crate::kernels::LineBuf;
use crate::model::CpuModel;

/// Reusable activation memory for [`CpuModel::forward_decode`] and
/// [`CpuModel::forward_prefill`].
#[derive(Debug)]
pub struct Scratch {
    pub(crate) max_rows: usize,
    pub(crate) max_context: usize,
    pub(crate) x: LineBuf<f32>,
    pub(crate) xn: LineBuf<f32>,
    pub(crate) q: LineBuf<f32>,
    pub(crate) k: LineBuf<f32>,
    pub(crate) v: LineBuf<f32>,
    pub(crate) attn: LineBuf<f32>,
    pub(crate) tmp: LineBuf<f32>,
    pub(crate) gate: LineBuf<f32>,
    pub(crate) up: LineBuf<f32>,
    /// `model.rope_tables()` tables of `head_dim` floats per row.
    pub(crate) rope: LineBuf<f32>,
    /// One head's worth, for the per-head q/k norms.
    pub(crate) head_tmp: LineBuf<f32>,
    pub(crate) row_seq: Vec<u32>,
    pub(crate) row_pos: Vec<u32>,
    /// Keys each row attends: `row_pos + 1` (causal), or the end of a
    /// bidirectional prefix the row lies in.
    pub(crate) row_len: Vec<u32>,
    pub(crate) logit_rows: Vec<u32>,
    /// One score row of `max_context` per worker thread.
    pub(crate) scores: LineBuf<f32>,
    /// A prefill chunk's keys transposed, every kv head's (grown on first
    /// use; `CpuModel::attention`).
    pub(crate) keys_t: LineBuf<f32>,
}

impl Scratch {
    /// Buffers for up to `max_rows` token rows per call (decode batch size or
    /// prefill chunk length, whichever is larger) and sequences of up to
    /// `max_context` positions.
    pub fn new(model: &CpuModel, max_rows: usize, max_context: usize) -> Scratch {
        let c = model.config();
        let (h, f, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let qd = c.num_heads * hd;
        let kvd = c.num_kv_heads * hd;
        let r = max_rows.max(1);
        Scratch {
            max_rows: r,
            max_context,
            x: LineBuf::zeroed(r * h),
            xn: LineBuf::zeroed(r * h),
            q: LineBuf::zeroed(r * qd),
            k: LineBuf::zeroed(r * kvd),
            v: LineBuf::zeroed(r * kvd),
            attn: LineBuf::zeroed(r * qd),
            tmp: LineBuf::zeroed(r * h),
            gate: LineBuf::zeroed(r * f),
            up: LineBuf::zeroed(r * f),
            rope: LineBuf::zeroed(r * hd * model.rope_tables()),
            head_tmp: LineBuf::zeroed(hd),
            row_seq: vec![0; r],
            row_pos: vec![0; r],
            row_len: vec![0; r],
            logit_rows: vec![0; r],
            scores: LineBuf::zeroed(model.threads() * model.scores_per_worker(max_context)),
            keys_t: LineBuf::new(),
        }
    }

    /// Maximum token rows per forward call.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Maximum sequence length attended.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        let f = [
            &self.x,
            &self.xn,
            &self.q,
            &self.k,
            &self.v,
            &self.attn,
            &self.tmp,
            &self.gate,
            &self.up,
            &self.rope,
            &self.head_tmp,
            &self.scores,
            &self.keys_t,
        ]
        .iter()
        .map(|v| v.len())
        .sum::<usize>();
        4 * (f
            + self.row_seq.len()
            + self.row_pos.len()
            + self.row_len.len()
            + self.logit_rows.len())
    }
}
