//! A vision request's rules ([`Prompt::Vision`](crate::Prompt::Vision)):
//! its question, and whether the model takes images at all (cheap, before
//! anything is decoded or tokenized, so an image sent to a text-only model
//! costs nothing but this check); then [`prepare`] decodes the image
//! (refused with [`EngineError::InvalidImage`]), cuts its crops and hashes
//! it, and builds the prompt: `[BOS] + image_token_ids + template`, with
//! the image's rows as the request's `PromptEmbeds` (BOS and the image
//! attend each other both ways). Cost: one decode, resize and hash of the
//! image on the caller's thread.

use std::sync::Arc;

use kestrel_model::moondream::image_token_ids;
use kestrel_model::vision::{decode_image, PreparedImage};
use kestrel_pipeline::PromptEmbeds;

use super::{bad, Field, Result};
use crate::error::EngineError;
use crate::model::{ModelContext, VisionContext};
use crate::request::VisionTask;

/// A query's question must say something (a caption's length is an enum:
/// the edges refuse an unknown one, naming their own field).
pub(super) fn check_task(task: &VisionTask) -> Result<()> {
    match task {
        VisionTask::Query { question } if question.trim().is_empty() => {
            bad(Field::Question, "must not be empty")
        }
        VisionTask::Query { .. } | VisionTask::Caption { .. } => Ok(()),
    }
}

/// The refusal of an image by a model with no vision encoder, naming the
/// model, so the caller learns which model to send images to instead.
pub(crate) fn no_vision(model: &ModelContext) -> EngineError {
    EngineError::invalid(
        Field::Image,
        format!(
            "is refused: model `{}` ({}) has no vision encoder and takes text only; serve a Moondream checkpoint to send images",
            model.name(),
            model.architecture()
        ),
    )
}

/// Whether `model` takes images; refuses with [`no_vision`] when it does
/// not (its [`ModelContext::vision`] is `None`).
pub(super) fn check_model(model: &ModelContext) -> Result<()> {
    match model.vision() {
        Some(_) => Ok(()),
        None => Err(no_vision(model)),
    }
}

/// A vision request's prompt ids and its image's rows.
pub(super) struct VisionPrompt {
    pub prompt: Vec<u32>,
    pub embeds: PromptEmbeds,
}

/// Decodes `image` and builds the request's prompt for `task` on `model`
/// (which [`check_model`] found to take images).
pub(super) fn prepare(
    model: &ModelContext,
    image: &[u8],
    task: &VisionTask,
) -> Result<VisionPrompt> {
    let v = model.vision().ok_or_else(|| no_vision(model))?;
    let template = template(model, v, task)?;
    let rgb =
        decode_image(image, v.limits).map_err(|source| EngineError::InvalidImage { source })?;
    let prepared = PreparedImage::new(&rgb, &v.geometry);
    let mut prompt = Vec::with_capacity(1 + v.image_rows + template.len());
    prompt.push(v.prompts.bos_id);
    // Ids past the vocabulary (the model's and the tokenizer's): never
    // looked up, only keys of the prefix cache.
    prompt.extend(image_token_ids(&prepared, model.vocab_size(), v.image_rows));
    prompt.extend(template);
    Ok(VisionPrompt {
        prompt,
        embeds: PromptEmbeds {
            start: 1,
            len: v.image_rows,
            bidirectional_end: v.bidirectional_end,
            input: Arc::new(prepared),
        },
    })
}

/// The ids after the image: the query template around the question
/// (tokenized without special tokens, after a space in the GPT-2
/// revisions), or the caption template of the length.
fn template(model: &ModelContext, v: &VisionContext, task: &VisionTask) -> Result<Vec<u32>> {
    let p = &v.prompts;
    match task {
        VisionTask::Query { question } => {
            let text = match p.leading_space {
                true => format!(" {question}"),
                false => question.clone(),
            };
            let ids = model.tokenize(&text, false).map_err(|e| match e {
                EngineError::Tokenizer { source, .. } => EngineError::Tokenizer {
                    field: Field::Question,
                    source,
                },
                other => other,
            })?;
            let mut out = p.query_prefix.clone();
            out.extend(ids);
            out.extend(&p.query_suffix);
            Ok(out)
        }
        VisionTask::Caption { length } => {
            let length = *length;
            match p.caption(length) {
                Some(ids) => Ok(ids.to_vec()),
                None => bad(
                    Field::Image,
                    format!(
                        "model `{}` has no {} caption (its revision's templates lack one)",
                        model.name(),
                        length.as_str()
                    ),
                ),
            }
        }
    }
}
