//! [`Engine`]: the cloneable async handle. It validates requests on the
//! caller's thread and talks to the engine thread ([`crate::worker`]) only
//! through commands; [`GenerationStream`] is one request's event stream.
//!
//! Shared state is read-only model info plus atomics (metrics, health,
//! queue accounting); the engine itself is owned by its thread, never
//! behind a lock.

use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kestrel_pipeline::{Capabilities, Cause, EngineLoop, LoopConfig, NgramSpec, PipelineMode};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::backend::RuntimeConfig;
use crate::config::{EngineConfig, LoadEvent, ModelSource};
use crate::error::EngineError;
use crate::metrics::Metrics;
use crate::model::{Health, ModelContext, ModelInfo, Runtime};
use crate::request::{GenerateRequest, GenerateResponse, StreamEvent};
use crate::skill::{StreamingSkill, StreamingSkillParts};
use crate::validate::{self, Field, ValidRequest};
use crate::worker::{Command, SampleSubmission, Submission, Worker};

/// State shared by every handle and the engine thread (atomics and
/// write-once cells only).
#[derive(Debug)]
pub(crate) struct Shared {
    pub metrics: Arc<Metrics>,
    /// Set once on an engine-fatal fault (or a panic of the engine thread).
    pub fatal: OnceLock<Cause>,
    /// True from the start of a shutdown (the drain) on; a watch so the
    /// servers can flip their health the moment it turns.
    pub shutting_down: tokio::sync::watch::Sender<bool>,
    pub exited: AtomicBool,
    /// Submissions sent but not yet handled by the engine thread.
    pub in_transit: AtomicUsize,
    /// The loop's `EngineLoop::waiting_capacity` as of its last iteration
    /// (published by the engine thread before `start` returns), so a full
    /// queue is refused here by the loop's own rule.
    pub waiting_capacity: AtomicUsize,
    next_id: AtomicU64,
    loop_config: LoopConfig,
    backend: String,
    /// The default speculation.
    speculate: Option<NgramSpec>,
}

/// A handle to a running engine. Cheap to clone; every clone talks to the
/// same engine thread.
#[derive(Clone)]
pub struct Engine {
    /// The runtime's [`Executor::capabilities`], which requests are validated against.
    caps: Capabilities,
    commands: Sender<Command>,
    done_tx: Sender<u64>,
    model: ModelContext,
    shared: Arc<Shared>,
    thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.model)
            .field("backend", &self.shared.backend)
            .field("loop_config", &self.shared.loop_config)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Fetches/loads the model, builds the skill context, and starts the
    /// engine thread, which constructs the runtime itself (so device state
    /// is created by the thread that owns it). Blocks until serving.
    pub fn start(
        config: EngineConfig,
        progress: impl Fn(LoadEvent) + Send + 'static,
    ) -> Result<Engine, EngineError> {
        let path = match &config.model {
            ModelSource::Default => kestrel_model::default_model_path_with_progress(&mut |s| {
                progress(LoadEvent::Fetch(s))
            })
            .map_err(EngineError::ModelLoad)?,
            ModelSource::Path(p) => p.clone(),
        };
        progress(LoadEvent::Loading { path: path.clone() });
        let started = Instant::now();
        let options = kestrel_model::LoadOptions {
            quantize: config.quantize,
        };
        let mut loaded =
            kestrel_model::load_with(&path, &options).map_err(EngineError::ModelLoad)?;
        if let Some(template) = &config.chat_template {
            loaded
                .use_chat_template_file(template)
                .map_err(EngineError::ModelLoad)?;
        }
        progress(LoadEvent::Loaded {
            name: loaded.name.clone(),
            seconds: started.elapsed().as_secs_f64(),
        });
        progress(LoadEvent::PreparingSkills);
        let model = ModelContext::from_loaded_with(&loaded, &config.images)?;
        let max_seq_len = config.max_seq_len.unwrap_or(model.context_length());
        let runtime = RuntimeConfig::new(&config, max_seq_len);
        let caps = runtime.capabilities();
        let loop_config = LoopConfig {
            mode: config.mode,
            prefill_policy: config.prefill_policy,
            max_batch_size: config.max_batch_size,
            max_waiting: config.max_waiting,
            max_seq_len,
            prefill_chunk: prefill_chunk(&config, &caps)?,
            debug_checks: cfg!(debug_assertions),
        };
        validate_engine_config(&config, &loop_config)?;
        let speculate = default_speculation(&config, &caps)?;
        progress(LoadEvent::StartingRuntime {
            backend: config.backend,
        });
        let engine = runtime.start(model, loop_config, speculate, loaded.weights, loaded.vision)?;
        progress(LoadEvent::Ready);
        Ok(engine)
    }

    /// Starts the engine thread with a runtime built by `make` on that
    /// thread (tests use `SimExecutor`; CUDA plugs in here).
    pub fn start_with_runtime<R: Runtime>(
        model: ModelContext,
        loop_config: LoopConfig,
        make: impl FnOnce() -> Result<R, EngineError> + Send + 'static,
    ) -> Result<Engine, EngineError> {
        Self::spawn(model, loop_config, "custom".into(), None, make)
    }

    pub(crate) fn spawn<R: Runtime>(
        model: ModelContext,
        loop_config: LoopConfig,
        backend: String,
        speculate: Option<NgramSpec>,
        make: impl FnOnce() -> Result<R, EngineError> + Send + 'static,
    ) -> Result<Engine, EngineError> {
        if loop_config.max_seq_len < 2 || loop_config.max_batch_size == 0 {
            return Err(EngineError::invalid(
                Field::Config("loop_config"),
                "max_seq_len must be >= 2 and max_batch_size >= 1",
            ));
        }
        let shared = Arc::new(Shared {
            metrics: Arc::new(Metrics::new()),
            fatal: OnceLock::new(),
            shutting_down: tokio::sync::watch::Sender::new(false),
            exited: AtomicBool::new(false),
            in_transit: AtomicUsize::new(0),
            waiting_capacity: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
            loop_config,
            backend,
            speculate,
        });
        let (cmd_tx, cmd_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let (ready_tx, ready_rx) =
            std::sync::mpsc::sync_channel::<Result<Capabilities, EngineError>>(1);
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("kestrel-engine".into())
            .spawn(move || {
                let lp = make().and_then(|rt| {
                    EngineLoop::new(rt, loop_config).map_err(|e| EngineError::BackendUnavailable {
                        backend: "pipeline",
                        source: Box::new(e),
                    })
                });
                match lp {
                    Err(e) => {
                        thread_shared.exited.store(true, SeqCst);
                        let _ = ready_tx.send(Err(e));
                    }
                    Ok(lp) => {
                        let caps = lp.executor().capabilities();
                        let worker = Worker::new(lp, cmd_rx, done_rx, thread_shared);
                        // The gauges (KV pages, ...) are true before
                        // `start` returns: `model_info` right after reads them.
                        worker.publish();
                        let _ = ready_tx.send(Ok(caps));
                        worker.run();
                    }
                }
            })
            .map_err(EngineError::Spawn)?;
        let caps = match ready_rx.recv() {
            Ok(Ok(caps)) => caps,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(EngineError::Stopped);
            }
        };
        Ok(Engine {
            caps,
            commands: cmd_tx,
            done_tx,
            model,
            shared,
            thread: Arc::new(Mutex::new(Some(thread))),
        })
    }

    /// Runs a request of one sample (`n` unset or 1) to completion.
    pub async fn generate(&self, req: GenerateRequest) -> Result<GenerateResponse, EngineError> {
        let mut stream = self.stream(req)?;
        stream.finish().await
    }

    /// Runs every sample of a request (`n`) to completion: the responses in
    /// sample order. The first failure is returned (the other samples are
    /// aborted as their streams drop).
    pub async fn generate_samples(
        &self,
        req: GenerateRequest,
    ) -> Result<Vec<GenerateResponse>, EngineError> {
        let mut out = Vec::new();
        for mut stream in self.stream_samples(req)? {
            out.push(stream.finish().await?);
        }
        Ok(out)
    }

    /// Validates and queues a request of one sample (`n` unset or 1; see
    /// [`Engine::stream_samples`] for more); its events arrive on the
    /// returned stream. Errors detectable before queueing (arguments,
    /// constraint, context, a full queue, health) are returned here, at
    /// once; a request refused later by the engine thread yields one `Err`
    /// item. Dropping the stream before `Done` aborts the request.
    pub fn stream(&self, req: GenerateRequest) -> Result<GenerationStream, EngineError> {
        if let Some(n) = req.n.filter(|&n| n > 1) {
            validate::samples(Some(n))?;
            return Err(EngineError::invalid(
                Field::N,
                format!("is {n}: Engine::stream gives one sample; use Engine::stream_samples"),
            ));
        }
        let mut streams = self.stream_samples(req)?;
        Ok(streams.remove(0))
    }

    /// Validates and queues a request and returns one stream per sample
    /// (`n`, in sample order: stream `i` has [`GenerationStream::index`]
    /// `i`). The samples are queued together (all or none, each taking a
    /// place in the queue): the first is prefilled as any request, the
    /// others fork from it once its prompt is launched, sharing its prompt
    /// pages (`kestrel_pipeline::PrefillStart::Fork`). Dropping a stream
    /// aborts its sample only; [`Engine::abort`] with the request id aborts
    /// them all. Errors as [`Engine::stream`].
    pub fn stream_samples(
        &self,
        req: GenerateRequest,
    ) -> Result<Vec<GenerationStream>, EngineError> {
        self.check_serving()?;
        let submitted = Instant::now();
        let n = validate::samples(req.n)?;
        let pipeline_id = self.shared.next_id.fetch_add(u64::from(n), SeqCst);
        let limits = validate::Limits {
            model: &self.model,
            max_seq_len: self.shared.loop_config.max_seq_len,
            caps: self.caps,
            prompt_logprobs: self.caps.prompt_logprobs,
            speculate: self.shared.speculate,
        };
        let mut valid: ValidRequest = validate::validate(req, &limits, pipeline_id)?;
        let limit = self.shared.loop_config.max_waiting;
        // Reserve a queue place per sample; the engine thread releases them
        // on receipt. The loop's capacity (`max_waiting` beyond the batch
        // rows free) and the waiting gauge are as of its last iteration.
        let places = n as usize;
        let in_transit = self.shared.in_transit.fetch_add(places, SeqCst) + places;
        let waiting = self.shared.metrics.waiting.get() as usize;
        if waiting + in_transit > self.shared.waiting_capacity.load(SeqCst) {
            self.shared.in_transit.fetch_sub(places, SeqCst);
            self.shared.metrics.rejected.fetch_add(1, SeqCst);
            return Err(EngineError::QueueFull { limit });
        }
        let mut samples = Vec::with_capacity(places);
        let mut streams = Vec::with_capacity(places);
        for (index, skill) in (0..n).zip(std::mem::take(&mut valid.skills)) {
            let pipeline_id = valid.pipeline_id + u64::from(index);
            let (events, rx) = tokio::sync::mpsc::unbounded_channel();
            let skill = StreamingSkill::new(
                skill,
                StreamingSkillParts {
                    request_id: valid.request_id.clone(),
                    pipeline_id,
                    index,
                    model: self.model.clone(),
                    events: events.clone(),
                    done: self.done_tx.clone(),
                    metrics: Arc::clone(&self.shared.metrics),
                    prompt_tokens: valid.prompt.len() as u32,
                    submitted,
                    constraint_field: valid.constraint_field,
                },
            );
            samples.push(SampleSubmission {
                pipeline_id,
                params: valid.sampling_of(index),
                skill,
                events,
            });
            streams.push(GenerationStream {
                request_id: valid.request_id.clone(),
                pipeline_id,
                index,
                rx,
                commands: self.commands.clone(),
                finished: false,
            });
        }
        let sub = Submission {
            request_id: valid.request_id,
            prompt: valid.prompt,
            max_new_tokens: valid.max_new_tokens,
            speculate: valid.speculate,
            prompt_logprobs: valid.prompt_logprobs,
            samples,
            embeds: valid.embeds,
        };
        if self.commands.send(Command::Submit(Box::new(sub))).is_err() {
            self.shared.in_transit.fetch_sub(places, SeqCst);
            return Err(EngineError::Stopped);
        }
        Ok(streams)
    }

    /// Asks the engine to abort `request_id`. Returns whether the command was
    /// delivered to a running engine; the request (if still live) then ends
    /// with `FinishReason::Abort` on its stream. Unknown ids are ignored.
    pub fn abort(&self, request_id: &str) -> bool {
        !self.shared.exited.load(SeqCst)
            && self
                .commands
                .send(Command::Abort {
                    request_id: request_id.to_string(),
                })
                .is_ok()
    }

    /// Tokenizes on the caller's thread (the tokenizer is shared, read-only).
    /// Text longer than [`validate::MAX_PROMPT_BYTES`] is refused untokenized.
    pub fn tokenize(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, EngineError> {
        if text.len() > validate::MAX_PROMPT_BYTES {
            return Err(EngineError::invalid(
                Field::Text,
                format!(
                    "is {} bytes, more than {} bytes",
                    text.len(),
                    validate::MAX_PROMPT_BYTES
                ),
            ));
        }
        self.model.tokenize(text, add_special_tokens)
    }

    /// Every id must be below the vocabulary size.
    pub fn detokenize(
        &self,
        ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String, EngineError> {
        validate::token_ids_in_vocab(ids, self.model.vocab_size(), Field::TokenId)?;
        self.model.detokenize(ids, skip_special_tokens)
    }

    /// The shared model context (tokenizer, template).
    pub fn model(&self) -> &ModelContext {
        &self.model
    }

    /// Model facts plus live KV and queue gauges (as of the last loop iteration).
    pub fn model_info(&self) -> ModelInfo {
        let m = &self.shared.metrics;
        let lc = &self.shared.loop_config;
        ModelInfo {
            name: self.model.name().to_string(),
            architecture: self.model.architecture().to_string(),
            vocab_size: self.model.vocab_size(),
            context_length: lc.max_seq_len,
            eos_token_ids: self.model.eos_token_ids().to_vec(),
            backend: self.shared.backend.clone(),
            mode: lc.mode,
            max_batch_size: lc.max_batch_size,
            kv_pages_total: m.kv_total.get() as usize,
            kv_pages_used: m.kv_used.get() as usize,
            kv_pages_free: m.kv_free.get() as usize,
            num_admitted: m.admitted.get() as usize,
            num_running: m.running.get() as usize,
            num_waiting: m.waiting.get() as usize,
        }
    }

    pub fn health(&self) -> Health {
        if let Some(why) = self.shared.fatal.get() {
            return Health::NotServing(crate::error::error_chain(why));
        }
        if *self.shared.shutting_down.borrow() {
            return Health::NotServing("shutting down".into());
        }
        if self.shared.exited.load(SeqCst) {
            return Health::NotServing("the engine thread has stopped".into());
        }
        Health::Serving
    }

    /// Completes once a shutdown has begun (at once if one has): from then
    /// on [`Engine::health`] is `NotServing` and new requests are refused
    /// with [`EngineError::ShuttingDown`] while in-flight ones drain.
    pub async fn shutting_down(&self) {
        let mut rx = self.shared.shutting_down.subscribe();
        // An error means the sender is gone, i.e. the engine with it.
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Prometheus text exposition of the engine's metrics, with the
    /// router-readable `vllm:` series labelled with the model's name.
    pub fn metrics_text(&self) -> String {
        self.shared.metrics.render(self.model.name())
    }

    /// Stops accepting requests, lets in-flight ones finish until `deadline`
    /// from now, aborts the rest (they end with `FinishReason::Abort`),
    /// then joins the engine thread. Idempotent.
    pub async fn shutdown(&self, deadline: Duration) {
        self.shared.shutting_down.send_replace(true);
        let (reply, done) = tokio::sync::oneshot::channel();
        let sent = self
            .commands
            .send(Command::Shutdown {
                deadline: Instant::now() + deadline,
                reply,
            })
            .is_ok();
        if sent {
            // An error means the thread exited without replying (it is gone either way).
            let _ = done.await;
        }
        let handle = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            // The thread replied as its last act: this join does not wait on work.
            let _ = h.join();
        }
    }

    fn check_serving(&self) -> Result<(), EngineError> {
        if let Some(why) = self.shared.fatal.get() {
            return Err(EngineError::Fatal(why.clone()));
        }
        if *self.shared.shutting_down.borrow() {
            return Err(EngineError::ShuttingDown);
        }
        if self.shared.exited.load(SeqCst) {
            return Err(EngineError::Stopped);
        }
        Ok(())
    }
}

fn validate_engine_config(c: &EngineConfig, lc: &LoopConfig) -> Result<(), EngineError> {
    let check = |ok: bool, field, msg: &str| {
        if ok {
            Ok(())
        } else {
            Err(EngineError::invalid(Field::Config(field), msg.to_string()))
        }
    };
    check(c.threads >= 1, "threads", "must be at least 1")?;
    check(
        c.max_batch_size >= 1,
        "max_batch_size",
        "must be at least 1",
    )?;
    check(c.page_size >= 1, "page_size", "must be at least 1")?;
    check(c.kv_pages >= 1, "kv_pages", "must be at least 1")?;
    check(c.max_waiting >= 1, "max_waiting", "must be at least 1")?;
    check(lc.max_seq_len >= 2, "max_seq_len", "must be at least 2")?;
    Ok(())
}

/// [`EngineConfig::speculate`] checked by the requests' rule against the
/// runtime's capabilities.
fn default_speculation(
    c: &EngineConfig,
    caps: &Capabilities,
) -> Result<Option<NgramSpec>, EngineError> {
    c.speculate
        .map(|k| validate::ngram_spec(k, caps))
        .transpose()
        .map_err(|m| EngineError::invalid(Field::Config("speculate"), m))
}

/// [`EngineConfig::prefill_chunk`] resolved against the runtime's
/// capabilities: by default chunked where the runtime can, whole prompts
/// where it cannot (and a chunk asked of such a runtime is refused).
fn prefill_chunk(
    c: &EngineConfig,
    caps: &Capabilities,
) -> Result<Option<NonZeroUsize>, EngineError> {
    match c.prefill_chunk {
        None if caps.chunked_prefill => Ok(NonZeroUsize::new(crate::config::DEFAULT_PREFILL_CHUNK)),
        None => Ok(None),
        Some(n) if n > 0 && !caps.chunked_prefill => Err(EngineError::invalid(
            Field::Config("prefill_chunk"),
            format!(
                "{n}: the {} runtime prefills whole prompts only (no chunked prefill yet); use 0",
                c.backend.as_str().to_uppercase()
            ),
        )),
        Some(n) => Ok(NonZeroUsize::new(n)),
    }
}

/// One sample's events: `Delta`s, then exactly one `Done` or `Err`, then
/// the end. Dropping it before the end aborts the sample (the pipeline
/// finalizes it and frees its KV once no in-flight step references it).
pub struct GenerationStream {
    request_id: String,
    pipeline_id: u64,
    index: u32,
    rx: UnboundedReceiver<Result<StreamEvent, EngineError>>,
    commands: Sender<Command>,
    finished: bool,
}

impl std::fmt::Debug for GenerationStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenerationStream")
            .field("request_id", &self.request_id)
            .field("index", &self.index)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl GenerationStream {
    /// The request id (given or assigned).
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// Which sample of its request this stream carries (`0..n`).
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Reads the stream to its end: the final response, or the error.
    pub async fn finish(&mut self) -> Result<GenerateResponse, EngineError> {
        loop {
            match self.next_event().await {
                Some(Ok(StreamEvent::Done(resp))) => return Ok(resp),
                Some(Ok(StreamEvent::Delta { .. } | StreamEvent::Object(_))) => {}
                Some(Err(e)) => return Err(e),
                None => return Err(EngineError::Stopped),
            }
        }
    }

    /// The next event, without a `StreamExt` dependency.
    pub async fn next_event(&mut self) -> Option<Result<StreamEvent, EngineError>> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_event(cx)).await
    }

    /// Aborts the request now (same as dropping the stream, but the stream
    /// still delivers the final `Done` with `FinishReason::Abort`).
    pub fn abort(&self) {
        if !self.finished {
            let _ = self.commands.send(Command::AbortPipeline(self.pipeline_id));
        }
    }

    fn poll_event(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<StreamEvent, EngineError>>> {
        if self.finished {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(item)) => {
                if matches!(item, Ok(StreamEvent::Done(_)) | Err(_)) {
                    self.finished = true;
                }
                Poll::Ready(Some(item))
            }
            Poll::Ready(None) => {
                // Every sender is gone without a terminal event: the engine
                // thread stopped. Report it once instead of ending silently.
                self.finished = true;
                Poll::Ready(Some(Err(EngineError::Stopped)))
            }
        }
    }
}

impl futures_core::Stream for GenerationStream {
    type Item = Result<StreamEvent, EngineError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_event(cx)
    }
}

impl Drop for GenerationStream {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.commands.send(Command::AbortPipeline(self.pipeline_id));
        }
    }
}

/// The pipeline mode as a metric/log label.
pub fn mode_name(mode: PipelineMode) -> &'static str {
    match mode {
        PipelineMode::Blocking => "blocking",
        PipelineMode::Pipelined => "pipelined",
    }
}
