//! A deterministic simulated device and skills, for tests, benches and demos.
//!
//! [`SimExecutor`] behaves like a runtime with two slots: a sampled token is
//! a pure function of (request seed, position, mask), so blocking and
//! pipelined runs must emit identical streams; beside each it decodes
//! spatial values, a pure function of (seed, position, token)
//! ([`sim_values`]), so a skill can be checked to receive exactly its
//! token's. It checks the runtime-side
//! invariants itself (I6: a slot's host buffer is never overwritten before
//! commit; decode inputs come from the previous step's sampling) and records
//! violations instead of trusting the loop. Its KV grows lazily, a page at a
//! time, so a small cache makes the loop preempt; a re-admitted sequence
//! must bring back exactly the tokens the device sampled for it (none lost
//! or repeated), and each chunk of a re-prefill must bring the values it
//! decoded beside those tokens ([`PrefillInput::generated_values`], which a
//! runtime embeds a spatial id from). Pages are refcounted: a fork ([`PrefillStart::Fork`])
//! shares its parent's full prompt pages, which must hold the fork's
//! prompt, and [`SimExecutor::used_pages`] counts each page once, so a leak
//! of any reference shows. A prompt with a bidirectional prefix
//! ([`crate::PromptEmbeds`]) must have the prefix's rest computed in the
//! chunk that starts inside it. Faults can be injected per call.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use crate::executor::{
    Capabilities, Drafts, ExecError, Executor, MaskBatch, PrefillInput, PrefillStart, SlotId,
    StepOutputs, TokenValues,
};
use crate::skill::{CommittedToken, FinishReason, Outcome, SequenceSkill, TokenMask, Verdict};
use crate::{RequestId, TokenId};

/// The end-of-sequence token of the simulated vocabulary.
pub const SIM_EOS: TokenId = 0;

/// The simulated device reads only `seed` of the standard parameters.
pub type SimParams = crate::SamplingParams;

/// Shape and fault plan of a [`SimExecutor`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    pub vocab_size: usize,
    pub max_rows: usize,
    pub num_pages: usize,
    pub page_size: usize,
    /// Decode launches (0-based count) that fail before dispatch.
    pub fail_decode_launch: HashSet<u64>,
    /// Prefill launches that fail before dispatch.
    pub fail_prefill_launch: HashSet<u64>,
    /// `wait_step` calls that report a device fault.
    pub fail_wait: HashSet<u64>,
    /// Record every device operation in [`SimExecutor::trace`].
    pub trace: bool,
    /// Draft tokens a decode step may verify in all.
    pub max_draft_tokens: usize,
    /// Sample from `position % period`: outputs repeat, so drafts match
    /// and are accepted (`None`: no repetition beyond chance).
    pub period: Option<usize>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            vocab_size: 64,
            max_rows: 64,
            num_pages: 4096,
            page_size: 16,
            fail_decode_launch: HashSet::new(),
            fail_prefill_launch: HashSet::new(),
            fail_wait: HashSet::new(),
            trace: true,
            max_draft_tokens: 64,
            period: None,
        }
    }
}

/// A simulated device fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    #[error("injected fault at {0}")]
    Injected(&'static str),
    #[error("out of KV: {0}")]
    OutOfKv(&'static str),
    #[error("protocol violation: {0}")]
    Protocol(String),
}

#[derive(Debug)]
struct SimSeq {
    seed: u64,
    /// The token whose KV is written at each position (its length is the
    /// "GPU length"): what the sequence's next samples attend to.
    kv: Vec<TokenId>,
    /// The last sampled token, still "on the device": the next decode input.
    device_token: Option<TokenId>,
    /// Its pages, in position order (the first ones maybe shared with
    /// forks or a parent).
    pages: Vec<u32>,
    /// Prompt tokens whose KV it shared from its parent at admission.
    shared: usize,
}

/// Every token sampled for a request so far, across preemptions, and the
/// values decoded beside each.
#[derive(Debug, Default)]
struct SimHistory {
    prompt_len: usize,
    sampled: Vec<TokenId>,
    values: Vec<TokenValues>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum SlotPhase {
    #[default]
    Free,
    Launched,
    Sampled,
}

#[derive(Debug, Default)]
struct SimSlot {
    phase: SlotPhase,
    /// Every sequence the step touches (a prefill chunk short of its
    /// prompt's end included).
    members: Vec<RequestId>,
    rows: Vec<RequestId>,
    /// Position of the token each row will sample.
    positions: Vec<usize>,
    /// Each row's drafts (`draft_indptr` empty: none).
    draft_indptr: Vec<u32>,
    draft_tokens: Vec<TokenId>,
    host_tokens: Vec<TokenId>,
    host_logprobs: Vec<f32>,
    host_indptr: Vec<u32>,
    host_values: Vec<TokenValues>,
}

/// The simulated device. See the module docs.
#[derive(Debug)]
pub struct SimExecutor {
    config: SimConfig,
    seqs: HashMap<RequestId, SimSeq>,
    history: HashMap<RequestId, SimHistory>,
    slots: Vec<SimSlot>,
    /// References to each page.
    refs: Vec<u32>,
    /// Pages no sequence references.
    free: Vec<u32>,
    decode_launches: u64,
    prefill_launches: u64,
    waits: u64,
    resumes: u64,
    /// Runtime-side invariant violations seen (should stay empty).
    pub violations: Vec<String>,
    /// Order of device operations, for timeline tests: (kind, slot).
    pub trace: Vec<(&'static str, SlotId)>,
    /// Every prefill chunk computed, when tracing: (request, start, end).
    pub chunks: Vec<(RequestId, usize, usize)>,
}

impl SimExecutor {
    pub fn new(config: SimConfig) -> Self {
        let pages = config.num_pages;
        Self {
            config,
            seqs: HashMap::new(),
            history: HashMap::new(),
            slots: (0..2).map(|_| SimSlot::default()).collect(),
            refs: vec![0; pages],
            free: (0..pages as u32).rev().collect(),
            decode_launches: 0,
            prefill_launches: 0,
            waits: 0,
            resumes: 0,
            violations: Vec::new(),
            trace: Vec::new(),
            chunks: Vec::new(),
        }
    }

    /// How often the loop resumed this executor after a drained pause.
    pub fn resumes(&self) -> u64 {
        self.resumes
    }

    /// Pages some sequence references (a shared page counts once).
    pub fn used_pages(&self) -> usize {
        self.config.num_pages - self.free.len()
    }

    /// Takes `n` free pages for `id` (the caller checked there are enough).
    fn take_pages(&mut self, id: RequestId, n: usize) {
        for _ in 0..n {
            let page = self.free.pop().expect("pages counted before taking");
            self.refs[page as usize] = 1;
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.pages.push(page);
            }
        }
    }

    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    fn record(&mut self, what: &'static str, slot: SlotId) {
        if self.config.trace {
            self.trace.push((what, slot));
        }
    }

    /// Check (and, when tracing, record) the prefill chunk `start..end` of
    /// `input`: one that starts inside a bidirectional prefix must reach
    /// its end, since a row of the prefix attends all of it.
    fn check_chunk(&mut self, input: &PrefillInput<'_, SimParams>, start: usize, end: usize) {
        if let Some(e) = input.embeds {
            if start < e.bidirectional_end && end < e.bidirectional_end {
                self.violations.push(format!(
                    "request {}: chunk {start}..{end} ends inside its bidirectional prefix ..{}",
                    input.id, e.bidirectional_end
                ));
            }
        }
        if self.config.trace {
            self.chunks.push((input.id, start, end));
        }
    }

    /// Check that the chunk `start..end` of `input` brings, for each
    /// generated token it computes, the values decoded beside that token
    /// when it was sampled (what a runtime embeds a spatial id from), and
    /// that its values fit (none, or one per generated token).
    fn check_values(&mut self, input: &PrefillInput<'_, SimParams>, start: usize, end: usize) {
        let Some(h) = self.history.get(&input.id) else {
            return;
        };
        let mut wrong = !input.values_fit();
        for pos in start.max(h.prompt_len)..end {
            let want = h.values.get(pos - h.prompt_len).copied();
            wrong |= want != Some(input.values_at(pos));
        }
        if wrong {
            self.violations.push(format!(
                "request {}: chunk {start}..{end} re-prefilled with values {:?} for {} \
                 generated tokens, but the device decoded {:?}",
                input.id, input.generated_values, input.generated, h.values
            ));
        }
    }

    fn pages_for(&self, len: usize) -> usize {
        len.div_ceil(self.config.page_size)
    }

    /// The simulated sampler at `position` (repeating under `period`).
    fn sample_at(&self, seed: u64, position: usize, mask: Option<&[u32]>) -> TokenId {
        let position = self.config.period.map_or(position, |p| position % p);
        sim_sample(seed, position, self.config.vocab_size, mask)
    }

    fn begin_launch(&mut self, slot: SlotId) -> Result<(), SimError> {
        let s = &self.slots[slot];
        if s.phase != SlotPhase::Free {
            let v = format!("launch into slot {slot} in phase {:?} (I6)", s.phase);
            self.violations.push(v.clone());
            return Err(SimError::Protocol(v));
        }
        Ok(())
    }
}

/// The simulated sampler: a pure function of (seed, position, mask).
pub fn sim_sample(seed: u64, position: usize, vocab: usize, mask: Option<&[u32]>) -> TokenId {
    let h = mix(seed ^ (position as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    match mask {
        None => (h % vocab as u64) as TokenId,
        Some(words) => {
            let allowed: u64 = (0..vocab)
                .filter(|&t| words[t / 32] & (1 << (t % 32)) != 0)
                .count() as u64;
            if allowed == 0 {
                return SIM_EOS;
            }
            let k = h % allowed;
            (0..vocab)
                .filter(|&t| words[t / 32] & (1 << (t % 32)) != 0)
                .nth(k as usize)
                .unwrap_or(0) as TokenId
        }
    }
}

/// The tokens the simulated spatial stage decodes values for: those below
/// this (as a real stage decodes them only for its spatial ids); every
/// other token's are zeros, so a sequence of such tokens keeps none.
pub const SIM_VALUED: TokenId = 32;

/// The simulated spatial stage: the values decoded beside `token` sampled
/// at `position` by the request with `seed`, a pure function of the three
/// (so values handed to the wrong token, row or position show): for a
/// token below [`SIM_VALUED`], a coordinate in `[0, 1)` and sizes in
/// `(0, 1]` (the ranges a spatial skill accepts), multiples of 2^-16;
/// zeros for any other token.
pub fn sim_values(seed: u64, position: usize, token: TokenId) -> TokenValues {
    if token >= SIM_VALUED {
        return TokenValues::default();
    }
    let h = mix(seed ^ mix(position as u64 ^ (u64::from(token) << 32)));
    let bits = |shift: u32| ((h >> shift) & 0xffff) as f32;
    TokenValues {
        coord: bits(0) / 65536.0,
        size: [(bits(16) + 1.0) / 65536.0, (bits(32) + 1.0) / 65536.0],
    }
}

/// splitmix64 finalizer.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Executor for SimExecutor {
    type Params = SimParams;
    type Error = SimError;

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    /// Everything the pipeline can drive: drafts up to the configured
    /// budget, chunked prefill and re-admission.
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            max_rows: self.config.max_rows,
            max_draft_tokens: self.config.max_draft_tokens,
            logit_bias: true,
            chunked_prefill: true,
            readmission: true,
            prompt_logprobs: false,
        }
    }

    fn num_allocated(&self) -> usize {
        self.seqs.len()
    }

    fn can_admit(&self, prompt: &[TokenId], _max_len: usize) -> bool {
        self.seqs.len() < self.config.max_rows && self.pages_for(prompt.len()) <= self.free.len()
    }

    fn grow(&mut self, id: RequestId, len: usize) -> bool {
        let need = self.pages_for(len);
        let Some(seq) = self.seqs.get_mut(&id) else {
            self.violations
                .push(format!("growth of unknown request {id}"));
            return false;
        };
        let more = need.saturating_sub(seq.pages.len());
        if more > self.free.len() {
            return false;
        }
        self.take_pages(id, more);
        true
    }

    fn could_ever_fit(&self, max_len: usize) -> bool {
        self.pages_for(max_len) <= self.config.num_pages
    }

    fn launch_prefill(
        &mut self,
        slot: SlotId,
        seqs: &[PrefillInput<'_, SimParams>],
    ) -> Result<(), ExecError<SimError>> {
        let n = self.prefill_launches;
        self.prefill_launches += 1;
        if self.config.fail_prefill_launch.contains(&n) {
            return Err(ExecError::PreDispatch(SimError::Injected("prefill launch")));
        }
        // A fork shares its parent's full pages of written prompt KV.
        let shared_pages = |s: &PrefillInput<'_, SimParams>| {
            let parent = s.start.fork_of().and_then(|p| self.seqs.get(&p));
            parent.map_or(0, |p| {
                let written = p.kv.len().min(s.prompt.len() - 1);
                (written / self.config.page_size).min(p.pages.len())
            })
        };
        let pages: usize = seqs
            .iter()
            .filter(|s| s.start.admits())
            .map(|s| self.pages_for(s.prompt.len()) - shared_pages(s))
            .sum();
        let admits = seqs.iter().filter(|s| s.start.admits()).count();
        if self.seqs.len() + admits > self.config.max_rows || pages > self.free.len() {
            return Err(ExecError::PreDispatch(SimError::OutOfKv("prefill")));
        }
        let shared: Vec<usize> = seqs.iter().map(shared_pages).collect();
        self.begin_launch(slot).map_err(ExecError::Fatal)?;
        let page_size = self.config.page_size;
        let mut s = std::mem::take(&mut self.slots[slot]);
        s.members.clear();
        s.rows.clear();
        s.positions.clear();
        s.draft_indptr.clear();
        s.draft_tokens.clear();
        for (input, &shared) in seqs.iter().zip(&shared) {
            let end = match input.start {
                PrefillStart::Admit | PrefillStart::Fork { .. } => {
                    // The shared pages must hold this prompt's KV.
                    let from = shared * page_size;
                    let mut pages = Vec::new();
                    if let Some(parent) = input.start.fork_of().and_then(|p| self.seqs.get(&p)) {
                        if parent.kv[..from] != input.prompt[..from] {
                            self.violations.push(format!(
                                "fork {} shares KV of {:?}, its prompt is {:?}",
                                input.id,
                                &parent.kv[..from],
                                &input.prompt[..from]
                            ));
                        }
                        pages.extend_from_slice(&parent.pages[..shared]);
                    }
                    for &page in &pages {
                        self.refs[page as usize] += 1;
                    }
                    let end = input.chunk_end(from);
                    // A re-admission brings back every token sampled so far.
                    let h = self.history.entry(input.id).or_default();
                    if h.sampled.is_empty() && input.generated == 0 {
                        h.prompt_len = input.prompt.len();
                        // Sampling then records without allocating.
                        h.sampled.reserve(input.max_len - input.prompt.len());
                        h.values.reserve(input.max_len - input.prompt.len());
                    } else {
                        let tail = input.prompt.len().checked_sub(input.generated);
                        if tail != Some(h.prompt_len)
                            || input.prompt[h.prompt_len.min(input.prompt.len())..] != h.sampled[..]
                        {
                            self.violations.push(format!(
                                "request {} re-admitted with {} generated tokens {:?}, but the device sampled {:?}",
                                input.id,
                                input.generated,
                                &input.prompt[h.prompt_len.min(input.prompt.len())..],
                                h.sampled
                            ));
                        }
                    }
                    let prev = self.seqs.insert(
                        input.id,
                        SimSeq {
                            seed: input.params.seed,
                            kv: {
                                // Decoding then writes without allocating.
                                let mut kv = Vec::with_capacity(
                                    input.max_len + self.config.max_draft_tokens,
                                );
                                kv.extend_from_slice(&input.prompt[..end]);
                                kv
                            },
                            device_token: None,
                            pages,
                            shared: from,
                        },
                    );
                    if prev.is_some() {
                        self.violations
                            .push(format!("request {} prefilled twice", input.id));
                    }
                    self.take_pages(input.id, input.prompt.len().div_ceil(page_size) - shared);
                    self.check_chunk(input, from, end);
                    self.check_values(input, from, end);
                    end
                }
                PrefillStart::Resume(start) => {
                    let Some(seq) = self.seqs.get_mut(&input.id) else {
                        let v = format!("prefill chunk of unknown request {}", input.id);
                        self.violations.push(v.clone());
                        return Err(ExecError::Fatal(SimError::Protocol(v)));
                    };
                    if seq.kv.len() != start || start >= input.prompt.len() {
                        self.violations.push(format!(
                            "request {}: chunk from {start} after {} of {} prompt tokens",
                            input.id,
                            seq.kv.len(),
                            input.prompt.len()
                        ));
                    }
                    let end = input.chunk_end(start);
                    seq.kv.truncate(start);
                    seq.kv.extend_from_slice(&input.prompt[seq.kv.len()..end]);
                    self.check_chunk(input, start, end);
                    self.check_values(input, start, end);
                    end
                }
            };
            s.members.push(input.id);
            if end == input.prompt.len() {
                s.rows.push(input.id);
                s.positions.push(end);
            }
        }
        s.phase = SlotPhase::Launched;
        self.slots[slot] = s;
        self.record("prefill", slot);
        Ok(())
    }

    fn cached_prompt_tokens(&self, id: RequestId) -> usize {
        self.seqs.get(&id).map_or(0, |s| s.shared)
    }

    fn launch_decode(
        &mut self,
        slot: SlotId,
        rows: &[RequestId],
        drafts: Drafts<'_>,
    ) -> Result<(), ExecError<SimError>> {
        let n = self.decode_launches;
        self.decode_launches += 1;
        if self.config.fail_decode_launch.contains(&n) {
            return Err(ExecError::PreDispatch(SimError::Injected("decode launch")));
        }
        if let Err(e) = drafts.check(rows.len(), self.config.max_draft_tokens) {
            self.violations.push(e.to_string());
        }
        self.begin_launch(slot).map_err(ExecError::Fatal)?;
        let s = &mut self.slots[slot];
        s.members.clear();
        s.members.extend_from_slice(rows);
        s.rows.clear();
        s.positions.clear();
        s.draft_indptr.clear();
        s.draft_indptr.extend_from_slice(drafts.indptr);
        s.draft_tokens.clear();
        s.draft_tokens.extend_from_slice(drafts.tokens);
        for (r, &id) in rows.iter().enumerate() {
            let Some(seq) = self.seqs.get_mut(&id) else {
                self.violations
                    .push(format!("decode of unknown request {id}"));
                return Err(ExecError::Fatal(SimError::Protocol(format!(
                    "unknown request {id}"
                ))));
            };
            let Some(input) = seq.device_token.take() else {
                self.violations.push(format!(
                    "request {id}: decode before its previous token was sampled"
                ));
                return Err(ExecError::Fatal(SimError::Protocol(format!(
                    "request {id}: no input token"
                ))));
            };
            // The input token and the drafts after it get their KV written
            // now; sampling rolls back the rejected ones.
            seq.kv.push(input);
            seq.kv.extend_from_slice(drafts.row(r));
            // No sequence writes into a page another one reads.
            let first = seq.kv.len() - 1 - drafts.row(r).len();
            let ps = self.config.page_size;
            let written = seq
                .pages
                .get(first / ps..seq.kv.len().div_ceil(ps).min(seq.pages.len()));
            if written.is_some_and(|p| p.iter().any(|&p| self.refs[p as usize] > 1)) {
                self.violations
                    .push(format!("request {id}: KV written into a shared page"));
            }
            if seq.kv.len() > seq.pages.len() * self.config.page_size {
                self.violations
                    .push(format!("request {id}: KV write past its reserved pages"));
            }
            s.rows.push(id);
            s.positions.push(seq.kv.len() - drafts.row(r).len());
        }
        s.phase = SlotPhase::Launched;
        self.record("decode", slot);
        Ok(())
    }

    fn finalize_sampling(
        &mut self,
        slot: SlotId,
        masks: Option<&MaskBatch<'_>>,
    ) -> Result<(), ExecError<SimError>> {
        if self.slots[slot].phase != SlotPhase::Launched {
            let v = format!("sampling slot {slot} in phase {:?}", self.slots[slot].phase);
            self.violations.push(v.clone());
            return Err(ExecError::Fatal(SimError::Protocol(v)));
        }
        let mut s = std::mem::take(&mut self.slots[slot]);
        s.host_tokens.clear();
        s.host_logprobs.clear();
        s.host_indptr.clear();
        s.host_values.clear();
        let drafts = Drafts {
            indptr: &s.draft_indptr,
            tokens: &s.draft_tokens,
        };
        if !drafts.indptr.is_empty() {
            s.host_indptr.push(0);
        }
        for (r, (&id, &pos)) in s.rows.iter().zip(&s.positions).enumerate() {
            // Mask rows: one per position the member may sample.
            let first = match drafts.indptr.is_empty() {
                true => r,
                false => r + drafts.indptr[r] as usize,
            };
            let mask = |j: usize| masks.and_then(|m| m.row(first + j));
            let seed = self.seqs[&id].seed;
            let d = drafts.row(r);
            // Verify: sample each position as decoding would, while the
            // sampled token is the draft that was computed after it.
            let mut t = self.sample_at(seed, pos, mask(0));
            let mut accepted = 0;
            loop {
                s.host_tokens.push(t);
                s.host_logprobs.push(-(t as f32) / 64.0);
                let values = sim_values(seed, pos + accepted, t);
                s.host_values.push(values);
                if let Some(h) = self.history.get_mut(&id) {
                    h.sampled.push(t);
                    h.values.push(values);
                }
                if accepted == d.len() || d[accepted] != t {
                    break;
                }
                accepted += 1;
                t = self.sample_at(seed, pos + accepted, mask(accepted));
            }
            let seq = self
                .seqs
                .get_mut(&id)
                .expect("rows were validated at launch");
            seq.device_token = Some(t);
            seq.kv.truncate(pos + accepted);
            // What the sequence attends to must be what it sampled: the
            // KV after its prompt holds its sampled tokens, all but `t`.
            if let Some(h) = self.history.get(&id) {
                let generated = seq.kv.get(h.prompt_len..).unwrap_or(&[]);
                if generated != &h.sampled[..h.sampled.len() - 1] {
                    self.violations.push(format!(
                        "request {id}: KV holds {generated:?} after its prompt but it sampled {:?}",
                        h.sampled
                    ));
                }
            }
            if !drafts.indptr.is_empty() {
                s.host_indptr.push(s.host_tokens.len() as u32);
            }
        }
        s.phase = SlotPhase::Sampled;
        self.slots[slot] = s;
        self.record("sample", slot);
        Ok(())
    }

    fn wait_step(&mut self, slot: SlotId) -> Result<StepOutputs<'_>, SimError> {
        let n = self.waits;
        self.waits += 1;
        if self.config.fail_wait.contains(&n) {
            return Err(SimError::Injected("wait"));
        }
        let s = &mut self.slots[slot];
        if s.phase != SlotPhase::Sampled {
            let v = format!("wait on slot {slot} in phase {:?}", s.phase);
            self.violations.push(v.clone());
            return Err(SimError::Protocol(v));
        }
        s.phase = SlotPhase::Free;
        self.record("commit", slot);
        let s = &self.slots[slot];
        Ok(StepOutputs {
            tokens: &s.host_tokens,
            logprobs: Some(&s.host_logprobs),
            top_logprobs: &[],
            top_n: 0,
            row_indptr: &s.host_indptr,
            values: &s.host_values,
        })
    }

    fn release(&mut self, id: RequestId) {
        self.history.remove(&id);
        self.evict(id);
    }

    fn preempt(&mut self, id: RequestId, _tokens: &[TokenId]) {
        self.evict(id);
    }

    fn release_all(&mut self) {
        self.seqs.clear();
        self.history.clear();
        self.refs.fill(0);
        self.free.clear();
        self.free.extend((0..self.config.num_pages as u32).rev());
        for s in &mut self.slots {
            s.phase = SlotPhase::Free;
        }
    }

    fn on_resume(&mut self) -> Result<(), SimError> {
        if let Some(i) = self.slots.iter().position(|s| s.phase != SlotPhase::Free) {
            self.violations.push(format!(
                "resumed with slot {i} in flight ({:?})",
                self.slots[i].phase
            ));
        }
        self.resumes += 1;
        Ok(())
    }
}

impl SimExecutor {
    /// Free `id`'s pages (released or preempted).
    fn evict(&mut self, id: RequestId) {
        match self.seqs.remove(&id) {
            Some(seq) => {
                for page in seq.pages {
                    self.refs[page as usize] -= 1;
                    if self.refs[page as usize] == 0 {
                        self.free.push(page);
                    }
                }
            }
            None => self
                .violations
                .push(format!("release of unknown request {id}")),
        }
        for s in &self.slots {
            if s.phase != SlotPhase::Free && s.members.contains(&id) {
                self.violations.push(format!(
                    "request {id} released while an in-flight step uses it"
                ));
            }
        }
    }
}

/// What a [`SimSkill`] saw.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct SimLog {
    pub tokens: Vec<TokenId>,
    /// The values committed with each token ([`sim_values`] of it).
    pub values: Vec<TokenValues>,
    pub outcome: Option<Outcome>,
    pub finish_calls: u32,
    pub violations: Vec<String>,
}

/// A skill that stops at [`SIM_EOS`] or after `stop_after` tokens, and, when
/// constrained, admits a pseudo-random subset of tokens depending on what it
/// has consumed (so a stale mask is detected).
#[derive(Debug)]
pub struct SimSkill {
    stop_after: Option<u32>,
    constraint: Option<u64>,
    state: u64,
    log: Arc<Mutex<SimLog>>,
}

impl SimSkill {
    pub fn new(stop_after: Option<u32>, constraint: Option<u64>) -> (Self, Arc<Mutex<SimLog>>) {
        let log = Arc::new(Mutex::new(SimLog::default()));
        (
            Self {
                stop_after,
                constraint,
                state: constraint.unwrap_or(0),
                log: log.clone(),
            },
            log,
        )
    }

    fn allowed(&self, token: TokenId) -> bool {
        match self.constraint {
            None => true,
            // Always allow a few tokens; EOS only sometimes.
            Some(_) => {
                token != SIM_EOS
                    && (mix(self.state ^ u64::from(token)).is_multiple_of(4) || token % 16 == 1)
            }
        }
    }
}

impl SequenceSkill for SimSkill {
    fn consume(&mut self, token: &CommittedToken<'_>) -> Verdict {
        let mut log = self.log.lock().expect("sim log lock");
        if log.finish_calls > 0 {
            log.violations
                .push(format!("token {} consumed after finish", token.token));
        }
        if !self.allowed(token.token) {
            log.violations.push(format!(
                "token {} outside the mask for state {:#x}",
                token.token, self.state
            ));
        }
        log.tokens.push(token.token);
        log.values.push(TokenValues {
            coord: token.coord,
            size: token.size,
        });
        self.state = mix(self.state ^ u64::from(token.token));
        if token.token == SIM_EOS {
            return Verdict::Stop(FinishReason::Eos);
        }
        if self
            .stop_after
            .is_some_and(|n| log.tokens.len() as u32 >= n)
        {
            return Verdict::Stop(FinishReason::Stop);
        }
        Verdict::Continue
    }

    fn is_constrained(&self) -> bool {
        self.constraint.is_some()
    }

    fn fill_mask(&mut self, mask: &mut TokenMask<'_>) {
        for t in 0..mask.vocab_size() as TokenId {
            if self.allowed(t) {
                mask.allow(t);
            }
        }
    }

    fn looks_ahead(&self) -> bool {
        true
    }

    /// Steps its state through the drafts it allows, then restores it.
    fn fill_masks_ahead(&mut self, drafts: &[TokenId], words: &mut [u32], vocab_size: usize) {
        let saved = self.state;
        let wpr = TokenMask::words_for(vocab_size);
        for (j, chunk) in words.chunks_mut(wpr).enumerate() {
            let mut mask = TokenMask::new(chunk, vocab_size);
            self.fill_mask(&mut mask);
            match drafts.get(j) {
                Some(&d) if self.allowed(d) && d != SIM_EOS => {
                    self.state = mix(self.state ^ u64::from(d));
                }
                _ => break,
            }
        }
        self.state = saved;
    }

    fn finish(&mut self, outcome: Outcome) {
        let mut log = self.log.lock().expect("sim log lock");
        log.finish_calls += 1;
        if log.finish_calls > 1 {
            log.violations
                .push(format!("finish called again with {outcome:?}"));
        }
        log.outcome = Some(outcome);
    }
}
