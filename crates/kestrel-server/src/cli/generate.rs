//! `kestrel generate`: one completion, streamed to the terminal; with
//! `--image FILE`, a question about the image (or `--caption LENGTH`, its
//! caption; `--point OBJECT` / `--detect OBJECT`, one JSON line per point
//! `{"x", "y"}` or box `{"x_min", "y_min", "x_max", "y_max"}` as each is
//! found) to a vision model.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use kestrel_engine::CaptionLength;
use kestrel_server::pb;
use kestrel_server::pb::generate_request::Input;

use crate::cli::client::{chat_message, print_stats, print_stream, ClientArgs, Outcome, Target};
use crate::cli::engine::EngineArgs;
use crate::cli::sampling::SamplingArgs;

#[derive(Debug, Args)]
pub(crate) struct GenerateArgs {
    /// The prompt (raw text, the user turn with --chat, or the question
    /// about the image with --image).
    #[arg(required_unless_present_any = ["caption", "point", "detect"])]
    prompt: Option<String>,
    /// Send the prompt as a chat user turn (rendered with the chat template).
    #[arg(long)]
    chat: bool,
    /// System prompt (implies --chat).
    #[arg(long)]
    system: Option<String>,
    /// An image (JPEG, PNG or WebP) for a vision model (Moondream): the
    /// prompt is a question about it.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["chat", "system"])]
    image: Option<PathBuf>,
    /// Caption the --image instead of asking about it: short, normal or long.
    #[arg(
        long,
        value_name = "LENGTH",
        requires = "image",
        conflicts_with = "prompt",
        value_parser = parse_caption
    )]
    caption: Option<CaptionLength>,
    /// Point at each OBJECT in the --image (Moondream's point; needs a
    /// region module): one JSON line `{"x", "y"}` per point, normalized to
    /// the image.
    #[arg(
        long,
        value_name = "OBJECT",
        requires = "image",
        conflicts_with_all = ["prompt", "caption", "detect"]
    )]
    point: Option<String>,
    /// Find each OBJECT in the --image (Moondream's detect): one JSON line
    /// `{"x_min", "y_min", "x_max", "y_max"}` per box, normalized.
    #[arg(
        long,
        value_name = "OBJECT",
        requires = "image",
        conflicts_with_all = ["prompt", "caption"]
    )]
    detect: Option<String>,
    /// The most points or boxes (1 to 256) [default: 50].
    #[arg(long, value_name = "N")]
    max_objects: Option<u32>,
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

fn parse_caption(s: &str) -> Result<CaptionLength, kestrel_engine::UnknownCaptionLength> {
    s.parse()
}

pub(crate) async fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    let prompt = args.prompt.clone().unwrap_or_default();
    let input = if let Some(path) = &args.image {
        let image = std::fs::read(path)
            .with_context(|| format!("cannot read the image {}", path.display()))?;
        Input::Vision(vision_input(image, &prompt, &args))
    } else if args.chat || args.system.is_some() {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(chat_message("system", system));
        }
        messages.push(chat_message("user", &prompt));
        Input::Chat(pb::ChatMessages { messages })
    } else {
        Input::Prompt(prompt)
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

/// The proto's vision input: a point or detect request, a caption of
/// `--caption`'s length, or `question`.
fn vision_input(image: Vec<u8>, question: &str, args: &GenerateArgs) -> pb::VisionInput {
    use pb::vision_input::Skill;
    let spatial = |object: &String| pb::VisionSpatial {
        object: object.clone(),
        max_objects: args.max_objects,
    };
    let skill = match (args.caption, &args.point, &args.detect) {
        (_, Some(object), _) => Skill::Point(spatial(object)),
        (_, _, Some(object)) => Skill::Detect(spatial(object)),
        (None, None, None) => Skill::Query(pb::VisionQuery {
            question: question.to_string(),
        }),
        (Some(length), None, None) => Skill::Caption(pb::VisionCaption {
            length: match length {
                CaptionLength::Short => pb::CaptionLength::Short,
                CaptionLength::Normal => pb::CaptionLength::Normal,
                CaptionLength::Long => pb::CaptionLength::Long,
            }
            .into(),
        }),
    };
    pb::VisionInput {
        image,
        skill: Some(skill),
    }
}
