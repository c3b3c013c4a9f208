//! Where `generate` and `chat` send a request ([`Target`]: the engine
//! in-process or a server over gRPC, the same proto request either way) and
//! how a streamed answer is printed to the terminal.

use std::io::Write;
use std::pin::Pin;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Args;
use kestrel_engine::Engine;
use kestrel_server::convert;
use kestrel_server::pb;
use kestrel_server::service::{submit_samples, ProtoStream};
use tokio_stream::{Stream, StreamExt};

use crate::cli::engine::{start_engine, EngineArgs};

#[derive(Debug, Args)]
pub(crate) struct ClientArgs {
    /// Talk to a running server (e.g. http://127.0.0.1:50051) instead of
    /// starting an engine in-process; the engine options are then ignored.
    #[arg(long)]
    server: Option<String>,
}

pub(crate) type EventStream =
    Pin<Box<dyn Stream<Item = Result<pb::StreamGenerateResponse, tonic::Status>> + Send>>;

/// Where `generate` and `chat` send requests.
pub(crate) enum Target {
    Local { engine: Engine },
    Remote(pb::kestrel_client::KestrelClient<tonic::transport::Channel>),
}

impl Target {
    pub(crate) async fn open(client: &ClientArgs, engine: &EngineArgs) -> anyhow::Result<Self> {
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

    pub(crate) async fn stream(
        &mut self,
        req: pb::GenerateRequest,
    ) -> Result<EventStream, tonic::Status> {
        match self {
            Target::Local { engine } => {
                let req = convert::generate_request(req)?;
                let scope = convert::FieldScope::of(&req);
                let streams = submit_samples(engine, req)
                    .await
                    .map_err(|e| convert::engine_status(&e, scope))?;
                Ok(Box::pin(ProtoStream::new(streams, scope)))
            }
            Target::Remote(client) => Ok(Box::pin(client.stream_generate(req).await?.into_inner())),
        }
    }

    pub(crate) async fn close(self) {
        if let Target::Local { engine } = self {
            engine.shutdown(Duration::from_secs(2)).await;
        }
    }
}

/// How a streamed completion ended.
pub(crate) enum Outcome {
    Done(Box<pb::GenerateResponse>),
    Interrupted,
}

/// Streams a completion to stdout as it arrives. Ctrl-C drops the stream,
/// which aborts the request.
pub(crate) async fn print_stream(mut stream: EventStream) -> anyhow::Result<Outcome> {
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
                Some(Event::Object(o)) => {
                    println!("{}", object_line(o.object));
                }
                Some(Event::Done(done)) => {
                    // A point/detect stream printed whole lines.
                    if done.points.is_empty() && done.boxes.is_empty() {
                        println!();
                    }
                    return Ok(Outcome::Done(Box::new(done)));
                }
                None => {}
            },
        }
    }
}

/// One streamed point or box as a JSON line, normalized to the image:
/// `{"x", "y"}` or `{"x_min", "y_min", "x_max", "y_max"}` (the Moondream
/// API's shapes).
fn object_line(o: Option<pb::stream_object::Object>) -> serde_json::Value {
    use pb::stream_object::Object;
    match o {
        Some(Object::Point(p)) => serde_json::json!({"x": p.x, "y": p.y}),
        Some(Object::Box(b)) => serde_json::json!({
            "x_min": b.x_min, "y_min": b.y_min, "x_max": b.x_max, "y_max": b.y_max
        }),
        None => serde_json::Value::Null,
    }
}

pub(crate) fn print_stats(done: &pb::GenerateResponse) {
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

pub(crate) fn chat_message(role: &str, content: &str) -> pb::ChatMessage {
    pb::ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}
