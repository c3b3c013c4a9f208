//! Activation buffers of the forward pass, allocated once for a maximum
//! number of token rows per call and a maximum context length, then reused:
//! a steady-state decode step allocates nothing. Size is dominated by
//! `max_rows * (4 * hidden + 3 * intermediate + ...)` floats plus one score
//! row of `max_context` floats per worker thread.

use crate::model::CpuModel;

/// Reusable activation memory for [`CpuModel::forward_decode`] and
/// [`CpuModel::forward_prefill`].
#[derive(Debug)]
pub struct Scratch {
    pub(crate) max_rows: usize,
    pub(crate) max_context: usize,
    pub(crate) x: Vec<f32>,
    pub(crate) xn: Vec<f32>,
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) attn: Vec<f32>,
    pub(crate) tmp: Vec<f32>,
    pub(crate) gate: Vec<f32>,
    pub(crate) up: Vec<f32>,
    /// `model.rope_tables()` tables of `head_dim` floats per row.
    pub(crate) rope: Vec<f32>,
    /// One head's worth, for the per-head q/k norms.
    pub(crate) head_tmp: Vec<f32>,
    pub(crate) row_seq: Vec<u32>,
    pub(crate) row_pos: Vec<u32>,
    pub(crate) logit_rows: Vec<u32>,
    /// One score row of `max_context` per worker thread.
    pub(crate) scores: Vec<f32>,
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
            x: vec![0.0; r * h],
            xn: vec![0.0; r * h],
            q: vec![0.0; r * qd],
            k: vec![0.0; r * kvd],
            v: vec![0.0; r * kvd],
            attn: vec![0.0; r * qd],
            tmp: vec![0.0; r * h],
            gate: vec![0.0; r * f],
            up: vec![0.0; r * f],
            rope: vec![0.0; r * hd * model.rope_tables()],
            head_tmp: vec![0.0; hd],
            row_seq: vec![0; r],
            row_pos: vec![0; r],
            logit_rows: vec![0; r],
            scores: vec![0.0; model.threads() * model.scores_per_worker(max_context)],
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
        ]
        .iter()
        .map(|v| v.len())
        .sum::<usize>();
        4 * (f + self.row_seq.len() + self.row_pos.len() + self.logit_rows.len())
    }
}
