//! `kestrel serve`: the gRPC and OpenAI HTTP listeners and `/metrics` over one
//! engine, drained on SIGTERM or Ctrl-C, and `--first-request`'s one chat
//! question asked as any client would.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Args;
use kestrel_server::pb;
use kestrel_server::pb::generate_request::Input;
use tokio::sync::watch;

use crate::cli::client::{chat_message, print_stats, print_stream, Outcome, Target};
use crate::cli::engine::{start_engine, EngineArgs};

#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
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

pub(crate) async fn serve(args: ServeArgs) -> anyhow::Result<()> {
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
