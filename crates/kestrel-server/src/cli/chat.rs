//! `kestrel chat`: an interactive REPL that keeps the conversation between
//! turns.

use std::io::Write;

use anyhow::Context as _;
use clap::Args;
use kestrel_server::pb;
use kestrel_server::pb::generate_request::Input;
use tokio::io::AsyncBufReadExt;

use crate::cli::client::{chat_message, print_stream, ClientArgs, Outcome, Target};
use crate::cli::engine::EngineArgs;
use crate::cli::sampling::SamplingArgs;

#[derive(Debug, Args)]
pub(crate) struct ChatArgs {
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

pub(crate) async fn chat(args: ChatArgs) -> anyhow::Result<()> {
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
