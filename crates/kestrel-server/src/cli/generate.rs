//! `kestrel generate`: one completion, streamed to the terminal.

use clap::Args;
use kestrel_server::pb;
use kestrel_server::pb::generate_request::Input;

use crate::cli::client::{chat_message, print_stats, print_stream, ClientArgs, Outcome, Target};
use crate::cli::engine::EngineArgs;
use crate::cli::sampling::SamplingArgs;

#[derive(Debug, Args)]
pub(crate) struct GenerateArgs {
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

pub(crate) async fn generate(args: GenerateArgs) -> anyhow::Result<()> {
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
