//! kestrel-step: the front end of a step, written once for every runtime.
//!
//! What a runtime does with a launch before it touches its device is the
//! same on the CPU and on CUDA: admit a prefill's new sequences (all or
//! none), put each input's chunk after its prefix-cache hit or where its
//! last chunk ended, plan the step's KV, and give back what it admitted
//! when the plan is refused; check a decode step's rows and [`Drafts`]; and
//! name the request a refusal is about ([`StepError`]). [`StepFront`] does
//! all of it over kestrel-kv's [`SeqBook`], answers the pipeline
//! `Executor`'s KV queries ([`executor_kv_queries!`]) and the runtime's
//! [`Capabilities`] ([`StepConfig::capabilities`]). The runtimes keep only
//! what touches their device: packing the planned [`KvStep`] into their
//! buffers and running it.
//!
//! Pure bookkeeping: no device, no threads, no unsafe. A call costs what
//! kestrel-kv's `admit_all` and `plan_step` cost (O(rows + pages written));
//! no allocation once its scratch has grown.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use kestrel_kv::{
    Admission, KvError, KvStats, KvStep, PageTable, PageTableConfig, SeqBook, SeqEntry, Span,
};
use kestrel_pipeline::{
    Capabilities, Drafts, DraftsError, PrefillInput, PrefillStart, RequestId, TokenId,
};

/// The shape of a runtime's KV and of its steps: the part of its
/// configuration every runtime has and reads alike (each runtime's config
/// embeds it as its `step` field). The front end is built from it
/// ([`StepFront::new`]); `forward_rows` is read by the runtime alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepConfig {
    /// Sequences holding KV at once (the largest batch); the table has one
    /// more row, row 0 being reserved.
    pub max_rows: usize,
    /// KV pages in the pool.
    pub num_pages: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Longest sequence (prompt + generated) the runtime accepts.
    pub max_seq_len: usize,
    /// Whether full prompt pages are kept for reuse.
    pub enable_prefix_cache: bool,
    /// Prompt tokens per forward call (the runtime's workspace is sized for
    /// it): a prefill step runs its chunk in calls of at most this many
    /// rows. The pipeline's chunk budget (`LoopConfig::prefill_chunk`)
    /// decides how many prompt tokens a step takes; this only bounds one
    /// call's memory.
    pub forward_rows: usize,
    /// Draft tokens one decode step may verify in all (speculative
    /// decoding; 0: none). A decode step's rows and drafts run as one
    /// forward, so the runtime sizes its sampled rows `max_rows` plus this.
    pub max_draft_tokens: usize,
}

impl Default for StepConfig {
    fn default() -> Self {
        Self {
            max_rows: 32,
            num_pages: 2048,
            page_size: 16,
            max_seq_len: 8192,
            enable_prefix_cache: true,
            forward_rows: 256,
            max_draft_tokens: 32,
        }
    }
}

impl StepConfig {
    /// Whether a dimension a runtime sizes its buffers by is zero (rows,
    /// pages, page size, forward rows): such a configuration is refused.
    pub fn has_zero_dimension(&self) -> bool {
        self.max_rows == 0 || self.page_size == 0 || self.num_pages == 0 || self.forward_rows == 0
    }

    /// The longest context one sequence can hold: `max_seq_len`, or the
    /// whole pool when that is smaller.
    pub fn max_context(&self) -> usize {
        self.max_seq_len.min(self.num_pages * self.page_size)
    }

    /// What a runtime built with this configuration can do: everything the
    /// pipeline drives (logit bias, chunked prefill, re-admission of a
    /// preempted sequence: KV grows lazily), drafts up to
    /// `max_draft_tokens`, and prompt scoring when the runtime has it
    /// (`prompt_logprobs`, a property of the runtime, not of its
    /// configuration). Known before the runtime is built, so the engine
    /// checks its configuration against the value `Executor::capabilities`
    /// answers.
    pub fn capabilities(&self, prompt_logprobs: bool) -> Capabilities {
        Capabilities {
            max_rows: self.max_rows,
            max_draft_tokens: self.max_draft_tokens,
            logit_bias: true,
            chunked_prefill: true,
            readmission: true,
            prompt_logprobs,
        }
    }
}

/// A step the front end refused. Nothing was dispatched and the book is as
/// it was before the call: the runtime returns it as
/// `ExecError::PreDispatch`, failing only that step's requests.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// More rows than the runtime holds.
    #[error("batch of {rows} rows exceeds the runtime's capacity of {capacity}")]
    BatchTooLarge {
        /// Rows of the step.
        rows: usize,
        /// `StepConfig::max_rows`.
        capacity: usize,
    },
    /// The decode step's drafts do not fit it.
    #[error(transparent)]
    Drafts(#[from] DraftsError),
    /// The prefill's new sequences could not all be admitted (no free row,
    /// out of pages).
    #[error("admitting the prefill's new sequences")]
    Admit(#[source] KvError),
    /// A row names a request that holds no KV.
    #[error("request {0} is not known to the runtime")]
    UnknownRequest(RequestId),
    /// A prefill chunk that does not start where its request's KV ends.
    #[error(
        "prefill chunk of request {id} starts at prompt token {start}, but its KV holds {written} tokens"
    )]
    ChunkOutOfOrder {
        /// The request.
        id: RequestId,
        /// Where the chunk starts.
        start: usize,
        /// Tokens its KV holds (once every launched step has run).
        written: usize,
    },
    /// The step's KV could not be planned otherwise (a row's pages do not
    /// cover its span: it was not grown).
    #[error("planning the step's KV")]
    Plan(#[source] KvError),
}

impl StepError {
    /// A refused [`SeqBook::plan_step`] over rows whose requests are
    /// `ids(index)`, naming the request it is about.
    fn refused(e: KvError, ids: impl Fn(usize) -> RequestId) -> Self {
        match e {
            KvError::UnknownSequence { index } => StepError::UnknownRequest(ids(index)),
            KvError::ChunkOutOfOrder {
                index,
                start,
                written,
            } => StepError::ChunkOutOfOrder {
                id: ids(index),
                start,
                written,
            },
            e => StepError::Plan(e),
        }
    }
}

/// A runtime's admitted sequences and the front end of its steps. `M` is
/// what the runtime keeps per sequence (e.g. its sampling parameters).
#[derive(Debug)]
pub struct StepFront<M> {
    book: SeqBook<RequestId, M>,
    caps: Capabilities,
    /// Each prefill input's chunk start (scratch, kept for its capacity).
    starts: Vec<usize>,
}

impl<M> StepFront<M> {
    /// An empty front end over a page table shaped by `cfg`, of a runtime
    /// that scores prompts or not (`prompt_logprobs`).
    ///
    /// # Errors
    /// The page table's refusal of `cfg`'s shape.
    pub fn new(cfg: &StepConfig, prompt_logprobs: bool) -> Result<Self, KvError> {
        let table = PageTable::new(PageTableConfig {
            max_rows: cfg.max_rows + 1,
            num_pages: cfg.num_pages,
            page_size: cfg.page_size,
            enable_prefix_cache: cfg.enable_prefix_cache,
        })?;
        Ok(StepFront {
            book: SeqBook::new(table).with_max_seq_len(cfg.max_seq_len),
            caps: cfg.capabilities(prompt_logprobs),
            starts: Vec::new(),
        })
    }

    /// The runtime's capabilities ([`StepConfig::capabilities`]).
    pub fn capabilities(&self) -> Capabilities {
        self.caps
    }

    /// The admitted sequences and their page table.
    pub fn book(&self) -> &SeqBook<RequestId, M> {
        &self.book
    }

    /// The admitted sequence `id`.
    pub fn get(&self, id: RequestId) -> Option<&SeqEntry<M>> {
        self.book.get(id)
    }

    /// Admitted sequences.
    pub fn len(&self) -> usize {
        self.book.len()
    }

    /// Whether no sequence is admitted.
    pub fn is_empty(&self) -> bool {
        self.book.is_empty()
    }

    /// Occupancy now plus the cumulative prompt and prefix-hit counters.
    pub fn kv_stats(&self) -> KvStats {
        self.book.kv_stats()
    }

    /// A prefill step over `seqs` planned into `step`: the inputs that start
    /// a sequence are admitted (with `meta` of each, their prompt's pages;
    /// a fork shares its parent's), each input's chunk starts after its
    /// prefix-cache hit or where its last chunk ended (`step.starts[i]`),
    /// and the KV is planned. On a refusal every sequence this call
    /// admitted is released again, so the book is as before.
    ///
    /// # Errors
    /// [`StepError::BatchTooLarge`], [`StepError::Admit`], or the plan's
    /// refusal naming its request.
    pub fn plan_prefill<P>(
        &mut self,
        seqs: &[PrefillInput<'_, P>],
        meta: impl Fn(&PrefillInput<'_, P>) -> M,
        step: &mut KvStep<RequestId>,
    ) -> Result<(), StepError> {
        self.check_rows(seqs.len())?;
        let admissions = seqs
            .iter()
            .filter(|input| input.start.admits())
            .map(|input| Admission {
                id: input.id,
                prompt: input.prompt,
                reserve: input.prompt.len(),
                meta: meta(input),
                fork_of: input.start.fork_of(),
            });
        self.book.admit_all(admissions).map_err(StepError::Admit)?;
        // Each input's chunk: after its prefix-cache hit, or where its last
        // chunk ended (the book refuses one that does not resume there).
        self.starts.clear();
        for input in seqs {
            self.starts.push(match input.start {
                PrefillStart::Admit | PrefillStart::Fork { .. } => {
                    self.book.cached_prompt_tokens(input.id)
                }
                PrefillStart::Resume(start) => start,
            });
        }
        let spans = seqs.iter().zip(&self.starts).map(|(input, &start)| {
            let (prompt, end) = (input.prompt, input.chunk_end(start));
            (input.id, Span::Chunk { prompt, start, end })
        });
        if let Err(e) = self.book.plan_step(spans, step) {
            // Nothing was dispatched: give back what this call admitted.
            for input in seqs.iter().filter(|input| input.start.admits()) {
                self.release(input.id);
            }
            return Err(StepError::refused(e, |i| seqs[i].id));
        }
        Ok(())
    }

    /// A decode step over `rows` planned into `step`: each row's input
    /// token and its drafts at its KV length (the lengths advance; the
    /// commit rolls back rejected drafts). The rows and drafts are checked
    /// first; a refusal leaves the book as it was.
    ///
    /// # Errors
    /// [`StepError::BatchTooLarge`], [`StepError::Drafts`], or the plan's
    /// refusal naming its request.
    pub fn plan_decode(
        &mut self,
        rows: &[RequestId],
        drafts: Drafts<'_>,
        step: &mut KvStep<RequestId>,
    ) -> Result<(), StepError> {
        self.check_rows(rows.len())?;
        drafts.check(rows.len(), self.caps.max_draft_tokens)?;
        let spans = rows.iter().enumerate().map(|(r, &id)| {
            let drafts = drafts.row(r).len();
            (id, Span::Decode { drafts })
        });
        self.book
            .plan_step(spans, step)
            .map_err(|e| StepError::refused(e, |i| rows[i]))
    }

    /// Refuses a step of more rows than the runtime holds.
    pub fn check_rows(&self, rows: usize) -> Result<(), StepError> {
        if rows > self.caps.max_rows {
            return Err(StepError::BatchTooLarge {
                rows,
                capacity: self.caps.max_rows,
            });
        }
        Ok(())
    }

    /// After a step ran: a prefill publishes its prompt pages, a verifying
    /// step's rows keep the drafts they `accepted` ([`SeqBook::commit_step`]).
    ///
    /// # Errors
    /// The book's, on a step it did not plan (a bug).
    pub fn commit_step(
        &mut self,
        step: &KvStep<RequestId>,
        accepted: Option<&[u32]>,
    ) -> Result<(), KvError> {
        self.book.commit_step(step, accepted)
    }

    /// Sequences holding a row now.
    pub fn num_allocated(&self) -> usize {
        self.book.num_allocated()
    }

    /// Whether `prompt` could be admitted now: its pages past its
    /// prefix-cache hit (it grows a page at a time after).
    pub fn can_admit(&self, prompt: &[TokenId]) -> bool {
        self.book.can_reserve(prompt, prompt.len())
    }

    /// Grows `id`'s pages to hold `len` tokens; `false`, taking nothing,
    /// when pages run short.
    pub fn grow(&mut self, id: RequestId, len: usize) -> bool {
        self.book.grow(id, len)
    }

    /// Whether a sequence of `max_len` tokens could ever be admitted.
    pub fn could_ever_fit(&self, max_len: usize) -> bool {
        self.book.could_ever_fit(max_len)
    }

    /// Prompt tokens of `id` whose KV it had at admission.
    pub fn cached_prompt_tokens(&self, id: RequestId) -> usize {
        self.book.cached_prompt_tokens(id)
    }

    /// Frees `id`'s row and pages (a no-op for an unknown id). The book's
    /// refusal is a bookkeeping bug, logged: the pipeline's release cannot
    /// fail.
    pub fn release(&mut self, id: RequestId) {
        if let Err(e) = self.book.release(id) {
            tracing::error!(request = id, error = %e, "erasing a KV row failed");
        }
    }

    /// Files `id`'s written pages of `tokens` in the prefix cache and frees
    /// its row (logged as [`release`](Self::release)).
    pub fn preempt(&mut self, id: RequestId, tokens: &[TokenId]) {
        if let Err(e) = self.book.preempt(id, tokens) {
            tracing::error!(request = id, error = %e, "erasing a preempted KV row failed");
        }
    }

    /// Forgets every sequence and frees every row.
    pub fn release_all(&mut self) {
        self.book.release_all();
    }
}

#[doc(hidden)]
pub use kestrel_pipeline as __pipeline;

/// The pipeline `Executor`'s KV queries of a runtime whose [`StepFront`] is
/// its field `$front`, written once for every runtime: expand it inside the
/// runtime's `impl Executor` block.
#[macro_export]
macro_rules! executor_kv_queries {
    ($front:ident) => {
        fn capabilities(&self) -> $crate::__pipeline::Capabilities {
            self.$front.capabilities()
        }

        fn num_allocated(&self) -> usize {
            self.$front.num_allocated()
        }

        /// A new sequence takes its prompt's pages and grows step by step
        /// (`grow`); when pages run short the pipeline preempts and
        /// re-admits.
        fn can_admit(&self, prompt: &[$crate::__pipeline::TokenId], _max_len: usize) -> bool {
            self.$front.can_admit(prompt)
        }

        fn grow(&mut self, id: $crate::__pipeline::RequestId, len: usize) -> bool {
            self.$front.grow(id, len)
        }

        fn could_ever_fit(&self, max_len: usize) -> bool {
            self.$front.could_ever_fit(max_len)
        }

        fn cached_prompt_tokens(&self, id: $crate::__pipeline::RequestId) -> usize {
            self.$front.cached_prompt_tokens(id)
        }

        fn release(&mut self, id: $crate::__pipeline::RequestId) {
            self.$front.release(id)
        }

        fn preempt(
            &mut self,
            id: $crate::__pipeline::RequestId,
            tokens: &[$crate::__pipeline::TokenId],
        ) {
            self.$front.preempt(id, tokens)
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use kestrel_pipeline::SamplingParams;

    fn front() -> StepFront<u8> {
        StepFront::new(
            &StepConfig {
                max_rows: 2,
                num_pages: 8,
                page_size: 4,
                max_seq_len: 32,
                enable_prefix_cache: true,
                forward_rows: 8,
                max_draft_tokens: 3,
            },
            false,
        )
        .unwrap()
    }

    fn input<'a>(
        id: RequestId,
        prompt: &'a [u32],
        params: &'a SamplingParams,
        start: PrefillStart,
        max_tokens: usize,
    ) -> PrefillInput<'a, SamplingParams> {
        PrefillInput {
            id,
            prompt,
            generated: 0,
            generated_values: &[],
            params,
            max_len: 32,
            start,
            max_tokens,
            embeds: None,
        }
    }

    #[test]
    fn a_refused_prefill_plan_gives_back_what_it_admitted() {
        let (mut f, mut step) = (front(), KvStep::default());
        let p = SamplingParams::greedy();
        let prompt: Vec<u32> = (1..10).collect();
        f.plan_prefill(
            &[input(1, &prompt, &p, PrefillStart::Admit, 4)],
            |_| 7,
            &mut step,
        )
        .unwrap();
        assert_eq!(
            (step.starts[0], step.ends[0], f.get(1).unwrap().meta),
            (0, 4, 7)
        );
        f.commit_step(&step, None).unwrap();
        // A new request beside a chunk that skips tokens: the plan names
        // the skipping request, and the new one is released again.
        let batch = [
            input(2, &prompt, &p, PrefillStart::Admit, 9),
            input(1, &prompt, &p, PrefillStart::Resume(6), 4),
        ];
        let e = f.plan_prefill(&batch, |_| 8, &mut step).unwrap_err();
        assert_eq!(
            e,
            StepError::ChunkOutOfOrder {
                id: 1,
                start: 6,
                written: 4
            }
        );
        assert!(f.get(2).is_none());
        assert_eq!(f.num_allocated(), 1);
        f.book().table().check_invariants().unwrap();
        // Resumed where it ended, the chunk is planned.
        let resume = [input(1, &prompt, &p, PrefillStart::Resume(4), 4)];
        f.plan_prefill(&resume, |_| 0, &mut step).unwrap();
        assert_eq!((step.starts[0], step.ends[0]), (4, 8));
    }

    #[test]
    fn decode_refusals_name_the_rows_and_drafts() {
        let (mut f, mut step) = (front(), KvStep::default());
        let p = SamplingParams::greedy();
        let prompt: Vec<u32> = (1..4).collect();
        let admit = [input(5, &prompt, &p, PrefillStart::Admit, 9)];
        f.plan_prefill(&admit, |_| 0, &mut step).unwrap();
        f.commit_step(&step, None).unwrap();
        assert_eq!(
            f.plan_decode(&[5, 5, 5], Drafts::NONE, &mut step),
            Err(StepError::BatchTooLarge {
                rows: 3,
                capacity: 2
            })
        );
        let four = Drafts {
            indptr: &[0, 4],
            tokens: &[1, 2, 3, 4],
        };
        assert!(matches!(
            f.plan_decode(&[5], four, &mut step),
            Err(StepError::Drafts(DraftsError {
                tokens: 4,
                limit: 3,
                ..
            }))
        ));
        assert_eq!(
            f.plan_decode(&[5, 9], Drafts::NONE, &mut step),
            Err(StepError::UnknownRequest(9))
        );
        // The refusals moved nothing: the decode starts at the prompt's end.
        assert!(f.grow(5, 4));
        f.plan_decode(&[5], Drafts::NONE, &mut step).unwrap();
        assert_eq!((step.starts[0], step.ends[0]), (3, 4));
    }

    #[test]
    fn drafts_check_accepts_exactly_the_well_formed() {
        let ok = |indptr: &[u32], tokens: &[u32]| Drafts { indptr, tokens }.check(2, 4).is_ok();
        assert!(ok(&[], &[]));
        assert!(ok(&[0, 1, 3], &[7, 8, 9]));
        assert!(ok(&[0, 0, 0], &[]));
        assert!(!ok(&[], &[7]), "tokens without offsets");
        assert!(!ok(&[0, 3], &[7, 8, 9]), "offsets for one row of two");
        assert!(!ok(&[1, 1, 3], &[7, 8, 9]), "not starting at 0");
        assert!(!ok(&[0, 2, 1], &[7]), "falling");
        assert!(!ok(&[0, 1, 2], &[7, 8, 9]), "not ending at the tokens");
        assert!(!ok(&[0, 2, 5], &[1, 2, 3, 4, 5]), "past the limit");
    }
}
