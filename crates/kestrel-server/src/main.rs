//! The `kestrel` command-line tool: `serve` (gRPC, the OpenAI-compatible
//! HTTP API and `/metrics`), `generate`
//! (one-shot, streamed to the terminal), `chat` (an interactive REPL that
//! keeps the conversation) and `perplexity` (a model's perplexity on a text,
//! as llama-perplexity computes it; `perplexity.rs`). `generate` and `chat`
//! run the engine in-process, or talk to a server with `--server URL`; both
//! paths build the same proto request and go through the same validation as
//! the server.
//!
//! This file parses the command line and dispatches; each subcommand is in
//! `cli/` (`serve.rs`, `generate.rs`, `chat.rs`), with the flags they share
//! (`engine.rs`, `sampling.rs`) and the client both `generate` and `chat` use
//! (`client.rs`); `perplexity.rs` is `kestrel perplexity`.

mod cli;
mod perplexity;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use crate::cli::chat::{chat, ChatArgs};
use crate::cli::generate::{generate, GenerateArgs};
use crate::cli::serve::{serve, ServeArgs};

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
