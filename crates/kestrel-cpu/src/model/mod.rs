//! The Llama-family forward pass over a paged KV cache.
//!
//! [`CpuModel`] holds immutable, validated weights and a compute [`Team`]; every
//! per-request state (KV pages, activations) is passed in. Decode and prefill
//! share one row-wise pass: embed, then per layer RMSNorm -> QKV (one parallel
//! region) -> RoPE -> KV write -> paged attention -> O -> RMSNorm -> gate/up
//! -> SiLU-mul -> down, then the LM head on the rows whose logits are wanted.
//! The family's [`kestrel_model::ArchFeatures`] add steps to that pass
//! (embedding scale, q/k norms, post-norms, GELU, sliding windows, per-layer
//! RoPE, softcapping; Phi's LayerNorm with bias, parallel attention and FFN,
//! ungated biased FFN, partial rotary and head bias; see [`crate::block`]);
//! with none set it is plain Llama.
//! Every step is per-row or a canonical-order matmul, so a row's logits do not
//! depend on its batch (see `kernels::matmul`). Loading and validating
//! the weights is `load.rs`.

use kestrel_model::{Activation, DType, ModelConfig};

use crate::block::{self, RopeSpec};
use crate::kernels::attention::{attend_group, keys_t_len, transpose_keys, wide_route, PagedSeq};
use crate::kernels::matmul::{dequant_row, matmul, matmul_group, MatmulJob};
use crate::kernels::ops;
use crate::kernels::Weight;
use crate::kernels::{Isa, Numerics, OutPtr};
use crate::team::Team;
use crate::{CpuError, KvStore, Scratch};

mod load;
mod pages;

pub use pages::WeightPages;

/// Options of [`CpuModel::new`].
#[derive(Debug, Clone, Default)]
pub struct CpuModelOptions {
    /// Threads of the model's compute team, the calling thread included
    /// (0 = available parallelism).
    pub threads: usize,
    /// Kernel ISA; `None` = [`Isa::try_detect`] (`KESTREL_ISA`, else the
    /// best detected; a forced ISA the CPU lacks fails [`CpuModel::new`]).
    /// All give identical bits.
    pub isa: Option<Isa>,
    /// Int8 activations for the quantized weights ([`Numerics::Fast`], the
    /// default), or exact f32 matmuls ([`Numerics::Exact`]).
    pub numerics: Numerics,
    /// Where the weights' bytes live: copied onto huge pages (the default)
    /// or read from the file's mapping ([`WeightPages`]).
    pub weight_pages: WeightPages,
}

/// One decode step: one new token per row (row `i` is sequence `i` of the
/// indices). `kv_last_page_len` already counts the new token, so each
/// sequence's extent is `positions[i] + 1`.
#[derive(Debug, Clone, Copy)]
pub struct DecodeBatch<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    pub kv_indptr: &'a [u32],
    pub kv_indices: &'a [u32],
    pub kv_last_page_len: &'a [u32],
}

/// Prefill chunks of one or more sequences. Sequence `s` contributes tokens
/// `tokens[qo_indptr[s]..qo_indptr[s+1]]` at positions `start_pos[s]..`; its
/// pages (indices as in [`DecodeBatch`]) cover `start_pos[s] + n_s` positions,
/// the first `start_pos[s]` of which already hold KV (earlier chunks or a
/// prefix-cache hit).
#[derive(Debug, Clone, Copy)]
pub struct PrefillBatch<'a> {
    pub tokens: &'a [u32],
    pub qo_indptr: &'a [u32],
    pub start_pos: &'a [u32],
    pub kv_indptr: &'a [u32],
    pub kv_indices: &'a [u32],
    pub kv_last_page_len: &'a [u32],
}

/// What a prefill takes besides token ids (Moondream's image rows and
/// prefix-LM mask). The default is none: every row looked up, causal.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefillRows<'a> {
    /// Per sequence of the batch (empty: all causal): its rows at positions
    /// below this attend keys `0..bidirectional_end` (a bidirectional
    /// prefix, whose keys this call must write or have written); later rows
    /// are causal. 0: causal.
    pub bidirectional_end: &'a [u32],
    /// Batch rows (indices into the batch's tokens, ascending) that take
    /// their input from `embeds` instead of the embedding table (row
    /// `embedded[j]` takes `embeds[j * hidden..][..hidden]`, as given: no
    /// embedding scale); their token ids are never read.
    pub embedded: &'a [u32],
    pub embeds: &'a [f32],
}

/// Which rows of a prefill get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsMode {
    /// One row per sequence: its last token (`out_logits` = `n_seqs * vocab`).
    LastPerSequence,
    /// Every token (`out_logits` = `tokens.len() * vocab`).
    All,
}

/// Validated weights plus the compute team. Immutable during inference.
#[derive(Debug)]
pub struct CpuModel {
    cfg: ModelConfig,
    token_embd: Weight,
    /// A clone of `token_embd` (same bytes) when embeddings are tied.
    lm_head: Weight,
    output_norm: Vec<f32>,
    /// LayerNorm bias of `output_norm` and the LM head's bias (Phi).
    output_norm_bias: Option<Vec<f32>>,
    lm_head_bias: Option<Vec<f32>>,
    layers: Vec<Layer>,
    /// The distinct RoPEs of the layers (one, or global + local); each
    /// row gets one table per spec (`Scratch::rope`).
    ropes: Vec<RopeSpec>,
    team: Team,
    isa: Isa,
    numerics: Numerics,
}

/// One decoder layer, its matrices in the encodings the kernels read.
#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    wo: Weight,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    post_attn_norm: Option<Vec<f32>>,
    /// Empty in a parallel block.
    ffn_norm: Vec<f32>,
    /// `None` in an ungated FFN (`w_up` is then Phi's `fc1`).
    w_gate: Option<Weight>,
    w_up: Weight,
    w_down: Weight,
    post_ffn_norm: Option<Vec<f32>>,
    attn_norm_bias: Option<Vec<f32>>,
    bo: Option<Vec<f32>>,
    b_up: Option<Vec<f32>>,
    b_down: Option<Vec<f32>>,
    /// Index into `CpuModel::ropes`.
    rope: usize,
    /// Keys this layer attends: the last `window` positions, or all.
    window: Option<usize>,
}

impl Layer {
    /// The first key a row of `len` keys attends where this layer's window
    /// cuts its prefix (`block::attend_window` then takes it), or `None`
    /// where it attends them all.
    fn window_start(&self, len: usize) -> Option<usize> {
        self.window.filter(|&w| len > w).map(|w| len - w)
    }

    fn matrices(&self) -> impl Iterator<Item = &Weight> {
        [&self.wq, &self.wk, &self.wv, &self.wo]
            .into_iter()
            .chain(&self.w_gate)
            .chain([&self.w_up, &self.w_down])
    }

    /// Floats of the layer's norm and bias vectors.
    fn vector_floats(&self) -> usize {
        let extra = [
            &self.q_norm,
            &self.k_norm,
            &self.post_attn_norm,
            &self.post_ffn_norm,
            &self.attn_norm_bias,
            &self.bo,
            &self.b_up,
            &self.b_down,
        ];
        let extra: usize = extra.iter().filter_map(|v| v.as_ref()).map(Vec::len).sum();
        self.attn_norm.len() + self.ffn_norm.len() + extra
    }
}

/// The sequences of one forward call, validated.
struct Seqs<'a> {
    indptr: &'a [u32],
    indices: &'a [u32],
    last: &'a [u32],
}

impl Seqs<'_> {
    fn pages(&self, s: usize) -> &[u32] {
        &self.indices[self.indptr[s] as usize..self.indptr[s + 1] as usize]
    }
}

impl CpuModel {
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Attention score scratch one worker needs for `max_context` keys.
    pub(crate) fn scores_per_worker(&self, max_context: usize) -> usize {
        let c = &self.cfg;
        crate::kernels::attention::scores_len(c.num_heads / c.num_kv_heads, max_context)
    }

    /// RoPE tables each row needs (one per distinct layer RoPE).
    pub(crate) fn rope_tables(&self) -> usize {
        self.ropes.len().max(1)
    }

    /// Compute threads (the calling thread included).
    /// The compute team (the vision encoder runs its GEMMs on it too).
    /// How the vision side (encoder, projector, region model) runs beside
    /// this model: on its compute team, with its ISA and numerics.
    pub(crate) fn vision_run(&self) -> crate::vision::VisionRun<'_> {
        crate::vision::VisionRun {
            team: Some(self.team()),
            isa: self.isa(),
            numerics: self.numerics(),
        }
    }

    pub(crate) fn team(&self) -> &Team {
        &self.team
    }

    pub fn threads(&self) -> usize {
        self.team.threads()
    }

    /// The kernel ISA in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// The matmuls' numerics.
    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    /// Bytes of weights held (mapped or owned, in the kernels' encodings);
    /// tied embeddings counted once.
    pub fn weight_bytes(&self) -> usize {
        let mut b = self.token_embd.bytes() + 4 * self.output_norm.len();
        let head_vectors = [&self.output_norm_bias, &self.lm_head_bias];
        b += 4 * head_vectors
            .iter()
            .filter_map(|v| v.as_ref())
            .map(Vec::len)
            .sum::<usize>();
        if !self.cfg.tie_word_embeddings {
            b += self.lm_head.bytes();
        }
        for l in &self.layers {
            b += 4 * l.vector_floats();
        }
        b + self.layer_matrix_bytes()
    }

    /// Bytes of weights streamed per decode step (all layers + LM head).
    pub fn bytes_per_token(&self) -> usize {
        self.lm_head.bytes() + self.layer_matrix_bytes()
    }

    fn layer_matrix_bytes(&self) -> usize {
        let mats = self.layers.iter().flat_map(Layer::matrices);
        mats.map(Weight::bytes).sum()
    }

    /// One decode step for `batch.tokens.len()` sequences; writes
    /// `rows * vocab` logits.
    pub fn forward_decode(
        &self,
        batch: DecodeBatch<'_>,
        kv: &mut KvStore,
        out_logits: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<(), CpuError> {
        let rows = PrefillRows::default();
        self.forward_decode_rows(batch, rows, kv, out_logits, scratch)
    }

    /// [`CpuModel::forward_decode`] with some rows' inputs given as
    /// embeddings (`rows.embedded` / `rows.embeds`: Moondream's encoded
    /// coordinates and sizes); a decode row is never in a bidirectional
    /// prefix, so `rows.bidirectional_end` must be empty.
    pub fn forward_decode_rows(
        &self,
        batch: DecodeBatch<'_>,
        rows: PrefillRows<'_>,
        kv: &mut KvStore,
        out_logits: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<(), CpuError> {
        let n = batch.tokens.len();
        let h = self.cfg.hidden_size;
        if !rows.bidirectional_end.is_empty()
            || rows.embeds.len() != rows.embedded.len() * h
            || rows.embedded.windows(2).any(|w| w[0] >= w[1])
            || rows.embedded.last().is_some_and(|&r| r as usize >= n)
        {
            return Err(bad(format!(
                "decode of {n} rows with {} prefix ends, {} embedded rows ({} floats)",
                rows.bidirectional_end.len(),
                rows.embedded.len(),
                rows.embeds.len()
            )));
        }
        if batch.positions.len() != n {
            return Err(bad(format!(
                "{} positions for {n} tokens",
                batch.positions.len()
            )));
        }
        let seqs = self.check_seqs(
            n,
            batch.kv_indptr,
            batch.kv_indices,
            batch.kv_last_page_len,
            kv,
        )?;
        self.check_rows(n, scratch)?;
        for (i, &p) in batch.positions.iter().enumerate() {
            let ext = self.extent(&seqs, i, kv);
            if p as usize + 1 != ext {
                return Err(bad(format!(
                    "row {i}: position {p} but its pages hold {ext} positions"
                )));
            }
            scratch.row_seq[i] = i as u32;
            scratch.row_pos[i] = p;
            scratch.row_len[i] = p + 1;
            scratch.logit_rows[i] = i as u32;
        }
        self.forward_rows(batch.tokens, rows, &seqs, n, kv, out_logits, scratch)
    }

    /// Prefill chunks (see [`PrefillBatch`]); writes logits per `mode`.
    pub fn forward_prefill(
        &self,
        batch: PrefillBatch<'_>,
        kv: &mut KvStore,
        out_logits: &mut [f32],
        mode: LogitsMode,
        scratch: &mut Scratch,
    ) -> Result<(), CpuError> {
        let rows = PrefillRows::default();
        self.forward_prefill_rows(batch, rows, kv, out_logits, mode, scratch)
    }

    /// [`CpuModel::forward_prefill`] with rows given as embeddings and
    /// bidirectional prefixes ([`PrefillRows`]). Every step after the
    /// embedding is per row as before, so batch invariance holds.
    pub fn forward_prefill_rows(
        &self,
        batch: PrefillBatch<'_>,
        rows: PrefillRows<'_>,
        kv: &mut KvStore,
        out_logits: &mut [f32],
        mode: LogitsMode,
        scratch: &mut Scratch,
    ) -> Result<(), CpuError> {
        let n = batch.tokens.len();
        let ns = batch.start_pos.len();
        if batch.qo_indptr.len() != ns + 1
            || batch.qo_indptr[0] != 0
            || batch.qo_indptr[ns] as usize != n
        {
            return Err(bad(format!(
                "qo_indptr {:?} does not split {n} tokens into {ns} sequences",
                batch.qo_indptr
            )));
        }
        let seqs = self.check_seqs(
            ns,
            batch.kv_indptr,
            batch.kv_indices,
            batch.kv_last_page_len,
            kv,
        )?;
        self.check_rows(n, scratch)?;
        let h = self.cfg.hidden_size;
        if !(rows.bidirectional_end.is_empty() || rows.bidirectional_end.len() == ns)
            || rows.embeds.len() != rows.embedded.len() * h
            || rows.embedded.windows(2).any(|w| w[0] >= w[1])
            || rows.embedded.last().is_some_and(|&r| r as usize >= n)
        {
            return Err(bad(format!(
                "{} prefix ends for {ns} sequences, {} embedded rows ({} floats) of {n}",
                rows.bidirectional_end.len(),
                rows.embedded.len(),
                rows.embeds.len()
            )));
        }
        let mut nlogits = 0;
        for s in 0..ns {
            let (a, b) = (batch.qo_indptr[s] as usize, batch.qo_indptr[s + 1] as usize);
            if b <= a {
                return Err(bad(format!("sequence {s} has no tokens")));
            }
            let ext = self.extent(&seqs, s, kv);
            if batch.start_pos[s] as usize + (b - a) != ext {
                return Err(bad(format!(
                    "sequence {s}: start {} + {} tokens but its pages hold {ext}",
                    batch.start_pos[s],
                    b - a
                )));
            }
            let prefix = rows.bidirectional_end.get(s).copied().unwrap_or(0);
            if prefix as usize > ext && batch.start_pos[s] < prefix {
                return Err(bad(format!(
                    "sequence {s}: rows before {prefix} attend keys its pages do not hold ({ext})"
                )));
            }
            for i in a..b {
                let pos = batch.start_pos[s] + (i - a) as u32;
                scratch.row_seq[i] = s as u32;
                scratch.row_pos[i] = pos;
                scratch.row_len[i] = if pos < prefix { prefix } else { pos + 1 };
                if mode == LogitsMode::All {
                    scratch.logit_rows[nlogits] = i as u32;
                    nlogits += 1;
                }
            }
            if mode == LogitsMode::LastPerSequence {
                scratch.logit_rows[nlogits] = (b - 1) as u32;
                nlogits += 1;
            }
        }
        self.forward_rows(batch.tokens, rows, &seqs, nlogits, kv, out_logits, scratch)
    }

    /// The hidden state (the residual stream after the last block, before
    /// the output norm) of the `j`-th logits row of the last forward that
    /// used `scratch`: what Moondream's region decoders read.
    pub fn last_hidden<'s>(&self, scratch: &'s Scratch, j: usize) -> &'s [f32] {
        let h = self.cfg.hidden_size;
        let i = scratch.logit_rows[j] as usize;
        &scratch.x[i * h..(i + 1) * h]
    }

    fn check_rows(&self, n: usize, scratch: &Scratch) -> Result<(), CpuError> {
        if n > scratch.max_rows {
            return Err(CpuError::ScratchTooSmall {
                rows: n,
                capacity: scratch.max_rows,
            });
        }
        if scratch.scores.len() < self.threads() * self.scores_per_worker(scratch.max_context) {
            return Err(bad(
                "scratch was built for a model with fewer threads".into()
            ));
        }
        Ok(())
    }

    fn extent(&self, seqs: &Seqs<'_>, s: usize, kv: &KvStore) -> usize {
        let np = seqs.pages(s).len();
        (np - 1) * kv.page_size() + seqs.last[s] as usize
    }

    fn check_seqs<'a>(
        &self,
        ns: usize,
        indptr: &'a [u32],
        indices: &'a [u32],
        last: &'a [u32],
        kv: &KvStore,
    ) -> Result<Seqs<'a>, CpuError> {
        let kc = kv.config();
        if kc.num_layers != self.cfg.num_layers
            || kc.num_kv_heads != self.cfg.num_kv_heads
            || kc.head_dim != self.cfg.head_dim
        {
            return Err(CpuError::KvGeometry {
                reason: format!("{kc:?} does not fit the model"),
            });
        }
        if indptr.len() != ns + 1
            || last.len() != ns
            || indptr[0] != 0
            || indptr[ns] as usize > indices.len()
        {
            return Err(bad(format!(
                "kv_indptr {} / kv_last_page_len {} / kv_indices {} for {ns} sequences",
                indptr.len(),
                last.len(),
                indices.len()
            )));
        }
        for s in 0..ns {
            if indptr[s + 1] <= indptr[s] {
                return Err(bad(format!("sequence {s} has no pages")));
            }
            if last[s] == 0 || last[s] as usize > kc.page_size {
                return Err(bad(format!(
                    "sequence {s}: last page length {} not in 1..={}",
                    last[s], kc.page_size
                )));
            }
        }
        if let Some(p) = indices[..indptr[ns] as usize]
            .iter()
            .find(|&&p| p as usize >= kc.num_pages)
        {
            return Err(bad(format!("page {p} out of {} pages", kc.num_pages)));
        }
        Ok(Seqs {
            indptr,
            indices,
            last,
        })
    }

    /// The shared pass over `tokens.len()` rows whose sequence/position are in
    /// `scratch.row_seq/row_pos`; logits for rows `scratch.logit_rows[..nlogits]`.
    #[allow(clippy::too_many_arguments)]
    fn forward_rows(
        &self,
        tokens: &[u32],
        given: PrefillRows<'_>,
        seqs: &Seqs<'_>,
        nlogits: usize,
        kv: &mut KvStore,
        out_logits: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<(), CpuError> {
        let c = &self.cfg;
        let n = tokens.len();
        let (h, f, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let qd = c.num_heads * hd;
        let kvd = c.num_kv_heads * hd;
        if out_logits.len() != nlogits * c.vocab_size {
            return Err(CpuError::LogitsLen {
                expected: nlogits * c.vocab_size,
                got: out_logits.len(),
            });
        }
        // Embedded rows' ids are never looked up (an image's are past the
        // vocabulary); `given.embedded` is ascending.
        let mut embedded = given.embedded.iter().peekable();
        let looked_up = tokens.iter().enumerate().filter(move |&(i, _)| {
            let skip = embedded.peek().is_some_and(|&&r| r as usize == i);
            if skip {
                embedded.next();
            }
            !skip
        });
        if let Some((_, &t)) = looked_up
            .clone()
            .find(|&(_, &t)| t as usize >= c.vocab_size)
        {
            return Err(CpuError::TokenOutOfRange {
                token: t,
                vocab: c.vocab_size,
            });
        }
        if let Some(&p) = scratch.row_pos[..n]
            .iter()
            .find(|&&p| p as usize >= scratch.max_context)
        {
            return Err(CpuError::ContextTooLong {
                len: p as usize + 1,
                max_context: scratch.max_context,
            });
        }
        let team = Some(&self.team);
        let (isa, numerics) = (self.isa, self.numerics);
        let embd = self.token_embd.mat();
        let nr = self.rope_tables();
        let fe = &c.features;
        // Rotated dimensions per head (Phi rotates the first `rot` only).
        let rot = fe.rotary_dim.unwrap_or(hd);
        for (i, &t) in looked_up {
            let xr = &mut scratch.x[i * h..(i + 1) * h];
            dequant_row(&embd, t as usize, xr);
            if fe.embedding_scale != 1.0 {
                xr.iter_mut().for_each(|v| *v *= fe.embedding_scale);
            }
        }
        for (j, &i) in given.embedded.iter().enumerate() {
            let i = i as usize;
            scratch.x[i * h..(i + 1) * h].copy_from_slice(&given.embeds[j * h..(j + 1) * h]);
        }
        for i in 0..n {
            for (r, spec) in self.ropes.iter().enumerate() {
                let o = (i * nr + r) * hd;
                spec.table(scratch.row_pos[i], rot, &mut scratch.rope[o..o + rot]);
            }
        }
        for (l, lw) in self.layers.iter().enumerate() {
            let s = &mut *scratch;
            let (x, xn) = (&mut s.x[..n * h], &mut s.xn[..n * h]);
            for (xr, or) in x.chunks_exact(h).zip(xn.chunks_exact_mut(h)) {
                self.norm(xr, &lw.attn_norm, lw.attn_norm_bias.as_deref(), or);
            }
            let (q, k, v) = (&mut s.q[..n * qd], &mut s.k[..n * kvd], &mut s.v[..n * kvd]);
            matmul_group(
                team,
                isa,
                numerics,
                xn,
                n,
                &mut [
                    MatmulJob {
                        w: lw.wq.mat(),
                        y: q,
                    },
                    MatmulJob {
                        w: lw.wk.mat(),
                        y: k,
                    },
                    MatmulJob {
                        w: lw.wv.mat(),
                        y: v,
                    },
                ],
            );
            for (buf, bias, d) in [
                (&mut *q, &lw.bq, qd),
                (&mut *k, &lw.bk, kvd),
                (&mut *v, &lw.bv, kvd),
            ] {
                if let Some(b) = bias {
                    buf.chunks_exact_mut(d).for_each(|r| ops::add_assign(r, b));
                }
            }
            for (buf, norm) in [(&mut *q, &lw.q_norm), (&mut *k, &lw.k_norm)] {
                if let Some(w) = norm {
                    let tmp = &mut s.head_tmp[..hd];
                    for head in buf.chunks_exact_mut(hd) {
                        tmp.copy_from_slice(head);
                        ops::rms_norm(tmp, w, c.rms_norm_eps, head);
                    }
                }
            }
            let geo = kv.config();
            let ps = geo.page_size;
            let (kl, vl) = kv.layer_mut(l);
            for i in 0..n {
                let o = (i * nr + lw.rope) * hd;
                let t = &s.rope[o..o + hd];
                let (qr, kr) = (&mut q[i * qd..(i + 1) * qd], &mut k[i * kvd..(i + 1) * kvd]);
                if rot == hd {
                    ops::rope(qr, hd, t, c.rope_style);
                    ops::rope(kr, hd, t, c.rope_style);
                } else {
                    block::rope_partial(qr, hd, rot, t);
                    block::rope_partial(kr, hd, rot, t);
                }
                let pos = s.row_pos[i] as usize;
                let page = seqs.pages(s.row_seq[i] as usize)[pos / ps] as usize;
                for g in 0..c.num_kv_heads {
                    let (off, src) = (geo.offset(page, pos % ps, g), i * kvd + g * hd);
                    kl[off..off + hd].copy_from_slice(&k[src..src + hd]);
                    vl[off..off + hd].copy_from_slice(&v[src..src + hd]);
                }
            }
            self.attention(l, n, seqs, kv, s);
            let s = &mut *scratch;
            matmul(
                team,
                isa,
                numerics,
                lw.wo.mat(),
                &s.attn[..n * qd],
                n,
                &mut s.tmp[..n * h],
            );
            add_rows(&mut s.tmp[..n * h], lw.bo.as_deref());
            residual_add(s, n, h, lw.post_attn_norm.as_deref(), c.rms_norm_eps);
            // A parallel block's FFN reads the attention norm's output,
            // still in `xn` (Phi: x + attn(ln(x)) + mlp(ln(x)), added in
            // that order).
            if !fe.parallel_block {
                let (x, xn) = (&s.x[..n * h], &mut s.xn[..n * h]);
                for (xr, or) in x.chunks_exact(h).zip(xn.chunks_exact_mut(h)) {
                    ops::rms_norm(xr, &lw.ffn_norm, c.rms_norm_eps, or);
                }
            }
            let (xn, gate, up) = (&s.xn[..n * h], &mut s.gate[..n * f], &mut s.up[..n * f]);
            match &lw.w_gate {
                Some(w_gate) => {
                    matmul_group(
                        team,
                        isa,
                        numerics,
                        xn,
                        n,
                        &mut [
                            MatmulJob {
                                w: w_gate.mat(),
                                y: gate,
                            },
                            MatmulJob {
                                w: lw.w_up.mat(),
                                y: up,
                            },
                        ],
                    );
                    self.act_mul(gate, up, f);
                }
                None => {
                    // Ungated (Phi's fc1): `gate = gelu(up x + b_up)`.
                    matmul(team, isa, numerics, lw.w_up.mat(), xn, n, gate);
                    self.bias_act(gate, lw.b_up.as_deref(), f);
                }
            }
            matmul(
                team,
                isa,
                numerics,
                lw.w_down.mat(),
                &s.gate[..n * f],
                n,
                &mut s.tmp[..n * h],
            );
            add_rows(&mut s.tmp[..n * h], lw.b_down.as_deref());
            residual_add(s, n, h, lw.post_ffn_norm.as_deref(), c.rms_norm_eps);
        }
        let s = &mut *scratch;
        for j in 0..nlogits {
            let i = s.logit_rows[j] as usize;
            let (x, xn) = (&s.x[i * h..(i + 1) * h], &mut s.xn[j * h..(j + 1) * h]);
            self.norm(x, &self.output_norm, self.output_norm_bias.as_deref(), xn);
        }
        matmul(
            team,
            isa,
            numerics,
            self.lm_head.mat(),
            &s.xn[..nlogits * h],
            nlogits,
            out_logits,
        );
        add_rows(out_logits, self.lm_head_bias.as_deref());
        if let Some(cap) = fe.final_logit_softcap {
            block::softcap(out_logits, cap);
        }
        Ok(())
    }

    /// One row's norm: LayerNorm when the model's norms carry a bias
    /// (kept at load only for [`kestrel_model::NormKind::Layer`]), else
    /// RMSNorm.
    fn norm(&self, x: &[f32], w: &[f32], bias: Option<&[f32]>, out: &mut [f32]) {
        let eps = self.cfg.rms_norm_eps;
        match bias {
            Some(b) => ops::layer_norm(x, w, b, eps, out),
            None => ops::rms_norm(x, w, eps, out),
        }
    }

    /// `gate = act(gate) * up`, rows in parallel when there are several.
    fn act_mul(&self, gate: &mut [f32], up: &[f32], f: usize) {
        let gelu = self.cfg.features.activation == Activation::GeluTanh;
        self.each_row(gate, f, |r, g| {
            let u = &up[r * f..(r + 1) * f];
            if gelu {
                return block::gelu_tanh_mul(g, u);
            }
            for (gv, uv) in g.iter_mut().zip(u) {
                *gv = *gv / (1.0 + ops::exp(-*gv)) * uv;
            }
        });
    }

    /// `x = gelu_tanh(x + bias)` per row (an ungated FFN; the only
    /// activation a model with one resolves to).
    fn bias_act(&self, x: &mut [f32], bias: Option<&[f32]>, f: usize) {
        debug_assert_eq!(self.cfg.features.activation, Activation::GeluTanh);
        self.each_row(x, f, |_, row| block::bias_gelu_tanh(row, bias));
    }

    /// `body(r, row)` for each `f`-float row of `buf`, rows in parallel
    /// when there are several. Each row is computed alone, so the result
    /// does not depend on the split.
    fn each_row(&self, buf: &mut [f32], f: usize, body: impl Fn(usize, &mut [f32]) + Sync) {
        let rows = buf.len() / f;
        if rows >= 4 {
            let out = OutPtr(buf.as_mut_ptr());
            self.team.for_each(rows, |r| {
                // SAFETY: task `r` alone touches floats r*f..(r+1)*f of
                // `buf`, which is borrowed mutably for the whole region.
                let row = unsafe { std::slice::from_raw_parts_mut(out.ptr().add(r * f), f) };
                body(r, row);
            });
        } else {
            buf.chunks_mut(f)
                .enumerate()
                .for_each(|(r, row)| body(r, row));
        }
    }

    /// Paged attention of layer `l` for all `n` rows into `s.attn`. Tasks
    /// are (kv head, row) pairs, dealt round-robin to a fixed number of
    /// workers, each with its own score row. Kv-head-major order: a
    /// worker's consecutive tasks attend the same kv head's K and V (a
    /// prefill chunk's rows share one sequence), which its previous task
    /// left in the core's caches; row-major order would walk all of a
    /// row's kv heads first, and at long prompts their K and V together
    /// overflow L2, so every row re-read its keys from L3 or DRAM.
    fn attention(&self, l: usize, n: usize, seqs: &Seqs<'_>, kv: &KvStore, s: &mut Scratch) {
        let c = &self.cfg;
        let hd = c.head_dim;
        let qd = c.num_heads * hd;
        let group = c.num_heads / c.num_kv_heads;
        let nkv = c.num_kv_heads;
        let scale = c.attn_scale();
        let layer = &self.layers[l];
        let (kl, vl) = kv.layer(l);
        let ntasks = n * nkv;
        // Below ~1k key visits (a few microseconds) splitting gains nothing.
        let visits: usize = keys_sum(&s.row_len[..n]) * group * nkv;
        let workers = if visits < 1024 {
            1
        } else {
            self.threads().min(ntasks)
        };
        let keys_t = self.transpose_chunk_keys(l, n, seqs, kv, s);
        let out = OutPtr(s.attn.as_mut_ptr());
        let (q, row_seq, row_len) = (&s.q[..n * qd], &s.row_seq[..n], &s.row_len[..n]);
        let per_head = keys_t.map_or(0, |(_, len)| keys_t_len(len, hd));
        let mc = self.scores_per_worker(s.max_context);
        let scores_ptr = OutPtr(s.scores.as_mut_ptr());
        assert!(s.scores.len() >= workers * mc, "checked by check_rows");
        let work = |w: usize| {
            // SAFETY: worker `w` alone uses floats w*mc..(w+1)*mc of
            // `s.scores` (at least workers*mc long), borrowed mutably here.
            let scores =
                unsafe { std::slice::from_raw_parts_mut(scores_ptr.ptr().add(w * mc), mc) };
            let mut t = w;
            while t < ntasks {
                let (g, i) = (t / n, t % n);
                let seq = PagedSeq {
                    pages: seqs.pages(row_seq[i] as usize),
                    page_size: kv.page_size(),
                    num_kv_heads: nkv,
                    head_dim: hd,
                };
                let o = i * qd + g * group * hd;
                // SAFETY: task (i, g) alone writes floats o..o + group*hd of
                // `s.attn` (rows and groups are disjoint), which is at least
                // n*qd long and is not otherwise borrowed during this region.
                let out_slice =
                    unsafe { std::slice::from_raw_parts_mut(out.ptr().add(o), group * hd) };
                let (qg, len) = (&q[o..o + group * hd], row_len[i] as usize);
                match layer.window_start(len) {
                    Some(first) => block::attend_window(
                        qg, kl, vl, seq, g, first, len, scale, scores, out_slice,
                    ),
                    None => {
                        // The chunk's keys transposed, for its sequence's rows.
                        let kt = keys_t
                            .filter(|&(kseq, klen)| kseq == row_seq[i] && len <= klen)
                            .map(|_| &s.keys_t[g * per_head..(g + 1) * per_head]);
                        attend_group(
                            self.isa, qg, kl, vl, seq, g, len, scale, kt, scores, out_slice,
                        )
                    }
                }
                t += workers;
            }
        };
        self.team.for_each(workers, work);
    }

    /// With AVX-512, a prefill chunk's rows (the longest run of one
    /// sequence's rows this step that layer `l`'s window, if any, leaves to
    /// [`attend_group`], if [`KEYS_T_MIN_ROWS`] or more) all score
    /// the same keys of layer `l`: those keys, transposed once per kv head
    /// into `s.keys_t` ([`transpose_keys`], kv head `g` at `g *
    /// keys_t_len(len)`), which the score pass then reads without a
    /// horizontal step per key (`attention.rs`'s `scores_t`; the same
    /// scores). Returns the sequence and how many keys were transposed.
    fn transpose_chunk_keys(
        &self,
        l: usize,
        n: usize,
        seqs: &Seqs<'_>,
        kv: &KvStore,
        s: &mut Scratch,
    ) -> Option<(u32, usize)> {
        let c = &self.cfg;
        let hd = c.head_dim;
        if n < KEYS_T_MIN_ROWS || !wide_route(self.isa, hd) {
            return None;
        }
        let (row_seq, row_len) = (&s.row_seq[..n], &s.row_len[..n]);
        // Past its window a row attends through `attend_window`, which does
        // not read transposed keys.
        let layer = &self.layers[l];
        // The longest run of consecutive rows of one sequence (counting
        // those within the window), and its furthest key.
        let (mut best, mut i) = ((0u32, 0usize, 0usize), 0);
        while i < n {
            let seq = row_seq[i];
            let run = row_seq[i..].iter().take_while(|&&r| r == seq).count();
            let lens = row_len[i..i + run].iter().map(|&len| len as usize);
            let lens = lens.filter(|&len| layer.window_start(len).is_none());
            let (rows, len) = lens.fold((0, 0), |(r, m), len| (r + 1, m.max(len)));
            if rows > best.1 {
                best = (seq, rows, len);
            }
            i += run;
        }
        let (seq, rows, len) = best;
        if rows < KEYS_T_MIN_ROWS {
            return None;
        }
        let per_head = keys_t_len(len, hd);
        let need = c.num_kv_heads * per_head;
        if s.keys_t.len() < need {
            // Grown by doubling (a chunked prompt's chunks ask for more
            // keys each time), up to the whole context.
            let most = c.num_kv_heads * keys_t_len(s.max_context, hd);
            s.keys_t.resize((2 * s.keys_t.len()).min(most).max(need));
        }
        let paged = PagedSeq {
            pages: seqs.pages(seq as usize),
            page_size: kv.page_size(),
            num_kv_heads: c.num_kv_heads,
            head_dim: hd,
        };
        let (kl, _) = kv.layer(l);
        let out = OutPtr(s.keys_t.as_mut_ptr());
        self.team.for_each(c.num_kv_heads, |g| {
            // SAFETY: task `g` alone writes floats g*per_head..(g+1)*per_head
            // of `s.keys_t` (at least num_kv_heads * per_head long, above),
            // which is borrowed mutably for the whole region.
            let kt =
                unsafe { std::slice::from_raw_parts_mut(out.ptr().add(g * per_head), per_head) };
            transpose_keys(kl, paged, g, len, kt);
        });
        Some((seq, len))
    }
}

/// Rows of one sequence in a step from which [`CpuModel::attention`]
/// transposes its keys for them (below it, building the copy costs about
/// what the rows' score passes would save).
const KEYS_T_MIN_ROWS: usize = 16;

/// `x += o` for the `n` rows of `s.tmp`, through `post_norm` when the
/// family norms a sublayer's output before its residual add (into `s.xn`,
/// free by then).
fn residual_add(s: &mut Scratch, n: usize, h: usize, post_norm: Option<&[f32]>, eps: f32) {
    match post_norm {
        Some(w) => {
            let (o, on) = (&s.tmp[..n * h], &mut s.xn[..n * h]);
            for (or, nr) in o.chunks_exact(h).zip(on.chunks_exact_mut(h)) {
                ops::rms_norm(or, w, eps, nr);
            }
            ops::add_assign(&mut s.x[..n * h], &s.xn[..n * h]);
        }
        None => ops::add_assign(&mut s.x[..n * h], &s.tmp[..n * h]),
    }
}

/// `row += bias` for each row of `rows` (nothing without a bias).
fn add_rows(rows: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        rows.chunks_exact_mut(b.len())
            .for_each(|r| ops::add_assign(r, b));
    }
}

/// Keys attended by rows of these lengths, in all.
fn keys_sum(lens: &[u32]) -> usize {
    lens.iter().map(|&len| len as usize).sum()
}

fn bad(reason: String) -> CpuError {
    CpuError::BadIndices { reason }
}

/// Dtypes the kernels accept (every one kestrel-model reads; see `kernels::weight`).
pub const SUPPORTED_DTYPES: [DType; 11] = DType::ALL;
