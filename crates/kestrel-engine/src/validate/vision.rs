//! A vision request's rules ([`Prompt::Vision`](crate::Prompt::Vision)):
//! its question or object and `max_objects`, whether the model takes images
//! at all and has the skill asked for (a region module for `point` and
//! `detect`), and what a point/detect request may not combine with (cheap,
//! before anything is decoded or tokenized, so an image sent to a text-only
//! model costs nothing but this check); then [`prepare`] decodes the image
//! (refused with [`EngineError::InvalidImage`]), cuts its crops and hashes
//! it, and builds the prompt: `[BOS] + image_token_ids + template`, with
//! the image's rows as the request's `PromptEmbeds` (BOS and the image
//! attend each other both ways). Cost: one decode, resize and hash of the
//! image on the caller's thread.

use std::sync::Arc;

use kestrel_model::moondream::image_token_ids;
use kestrel_model::vision::{decode_image, PreparedImage};
use kestrel_pipeline::PromptEmbeds;
use kestrel_skills::{SpatialError, SpatialKind, SpatialSpec};

use super::{bad, Field, Result, DEFAULT_MAX_OBJECTS, MAX_OBJECTS};
use crate::error::EngineError;
use crate::model::{ModelContext, VisionContext};
use crate::request::{GenerateRequest, VisionTask};

/// A query's question and a point/detect request's object must say
/// something, and `max_objects` is 1 to [`MAX_OBJECTS`] (a caption's
/// length is an enum: the edges refuse an unknown one, naming their own
/// field).
pub(super) fn check_task(task: &VisionTask) -> Result<()> {
    match task {
        VisionTask::Query { question } if question.trim().is_empty() => {
            bad(Field::Question, "must not be empty")
        }
        VisionTask::Point {
            object,
            max_objects,
        }
        | VisionTask::Detect {
            object,
            max_objects,
        } => {
            if object.trim().is_empty() {
                return bad(Field::Object, "must not be empty");
            }
            match max_objects.unwrap_or(DEFAULT_MAX_OBJECTS) {
                1..=MAX_OBJECTS => Ok(()),
                n => bad(
                    Field::MaxObjects,
                    format!("must be in [1, {MAX_OBJECTS}], got {n}"),
                ),
            }
        }
        VisionTask::Query { .. } | VisionTask::Caption { .. } => Ok(()),
    }
}

/// What a point/detect request may not ask for: its output is objects,
/// ended by the skill's cycle, EOS, `max_objects` or `max_new_tokens`, so
/// text stop conditions, a constraint and token log-probabilities have
/// nothing to act on; each is refused naming its field.
pub(super) fn check_spatial_request(req: &GenerateRequest) -> Result<()> {
    const WHY: &str = "cannot be combined with point or detect (their output is objects, not text)";
    if req.constraint.is_some() {
        return bad(Field::Constraint, WHY);
    }
    if !req.stop.is_empty() {
        return bad(Field::Stop, WHY);
    }
    if !req.stop_token_ids.is_empty() {
        return bad(Field::StopTokenIds, WHY);
    }
    if req.min_tokens > 0 {
        return bad(Field::MinTokens, WHY);
    }
    if req.ignore_eos {
        // No field of its own: the proto and OpenAI name it beside the
        // stop conditions.
        return bad(
            Field::Stop,
            "ignore_eos cannot be combined with point or detect",
        );
    }
    if req.sampling.logprobs || req.sampling.top_logprobs > 0 {
        return bad(Field::TopLogprobs, WHY);
    }
    Ok(())
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

/// Whether `model` takes images (refused with [`no_vision`] when its
/// [`ModelContext::vision`] is `None`) and, for `point` and `detect`, has
/// a region module ([`Field::Skill`], naming the model).
pub(super) fn check_model(model: &ModelContext, task: &VisionTask) -> Result<()> {
    let v = model.vision().ok_or_else(|| no_vision(model))?;
    if task.is_spatial() && v.spatial.is_none() {
        return bad(
            Field::Skill,
            format!(
                "`{}` is refused: model `{}` has no region module (or no coordinate and size tokens), so it cannot point or detect; serve a Moondream 2 checkpoint with its region model",
                task.skill_name(),
                model.name()
            ),
        );
    }
    Ok(())
}

/// The spatial skill's spec of a point/detect request (`None` for a query
/// or caption) on a model [`check_model`] accepted.
pub(super) fn spatial_spec(model: &ModelContext, task: &VisionTask) -> Result<Option<SpatialSpec>> {
    let (kind, max_objects) = match task {
        VisionTask::Point { max_objects, .. } => (SpatialKind::Point, max_objects),
        VisionTask::Detect { max_objects, .. } => (SpatialKind::Detect, max_objects),
        VisionTask::Query { .. } | VisionTask::Caption { .. } => return Ok(None),
    };
    let Some(ids) = model.vision().and_then(|v| v.spatial) else {
        return Err(no_vision(model));
    };
    let max_objects = max_objects.unwrap_or(DEFAULT_MAX_OBJECTS);
    SpatialSpec::new(kind, ids, max_objects)
        .map(Some)
        .map_err(|e| match e {
            SpatialError::NoObjectsAllowed => {
                EngineError::invalid(Field::MaxObjects, e.to_string())
            }
            // The model's ids, not the request: no spatial skill on it.
            other => EngineError::invalid(
                Field::Skill,
                format!("model `{}` cannot point or detect: {other}", model.name()),
            ),
        })
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
/// revisions), the caption template of the length, or the point / detect
/// template around the object (tokenized after a space in every revision,
/// as the published `point` and `detect` do).
fn template(model: &ModelContext, v: &VisionContext, task: &VisionTask) -> Result<Vec<u32>> {
    let p = &v.prompts;
    let around = |prefix: &[u32], text: String, suffix: &[u32], field: Field| {
        let ids = model.tokenize(&text, false).map_err(|e| match e {
            EngineError::Tokenizer { source, .. } => EngineError::Tokenizer { field, source },
            other => other,
        })?;
        let mut out = prefix.to_vec();
        out.extend(ids);
        out.extend(suffix);
        Ok(out)
    };
    match task {
        VisionTask::Query { question } => {
            let text = match p.leading_space {
                true => format!(" {question}"),
                false => question.clone(),
            };
            around(&p.query_prefix, text, &p.query_suffix, Field::Question)
        }
        VisionTask::Point { object, .. } => around(
            &p.point_prefix,
            format!(" {object}"),
            &p.point_suffix,
            Field::Object,
        ),
        VisionTask::Detect { object, .. } => around(
            &p.detect_prefix,
            format!(" {object}"),
            &p.detect_suffix,
            Field::Object,
        ),
        VisionTask::Caption { length } => {
            let length = *length;
            match p.caption(length) {
                Some(ids) => Ok(ids.to_vec()),
                None => bad(
                    Field::Skill,
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
