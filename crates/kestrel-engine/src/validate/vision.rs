//! A vision request's rules ([`Prompt::Vision`](crate::Prompt::Vision)):
//! its question, and whether the model takes images at all. Both are cheap
//! and run before anything is decoded or tokenized, so an image sent to a
//! text-only model costs nothing but this check.

use super::{bad, Field, Result};
use crate::error::EngineError;
use crate::model::ModelContext;
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
            "model `{}` ({}) has no vision encoder and takes text only: serve a Moondream checkpoint to send images",
            model.name(),
            model.architecture()
        ),
    )
}

/// Whether `model` takes images; refuses with [`no_vision`] when it does
/// not. No [`ModelContext`] carries a vision encoder yet, so every model
/// refuses: the engine's vision path (decoding, crops, the image's prompt
/// ids) is what makes a Moondream model answer here.
pub(super) fn check_model(model: &ModelContext) -> Result<()> {
    Err(no_vision(model))
}
