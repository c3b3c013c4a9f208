//! The Moondream API's skills, as the `moondream` Python client
//! (`md.vl(endpoint="http://HOST:PORT/v1")`, version 2.6.1) calls them:
//! `POST /v1/query` (`{"question", "image_url", "stream"?, "settings"?,
//! "model"?}` -> `{"answer"}`), `POST /v1/caption` (`{"image_url",
//! "length"?: "short" | "normal" | "long", ...}` -> `{"caption"}`), `POST
//! /v1/point` (`{"image_url", "object", "settings"?, "model"?}` ->
//! `{"points": [{"x", "y"}]}`) and `POST /v1/detect` (the same in ->
//! `{"objects": [{"x_min", "y_min", "x_max", "y_max"}]}`), coordinates
//! normalized to the image; facts in `docs/moondream.md`.
//!
//! `settings` maps `temperature`, `top_p`, `max_tokens` and (point and
//! detect) `max_objects` onto the engine's request (`max_objects` is
//! type-checked only for query and caption); left out, they take the
//! Moondream skills' defaults (temperature 0.2, top_p 0.9; `max_tokens` the
//! engine's default for an image, 768 or the room the context leaves;
//! `max_objects` 50). Point and detect answer unary only (the client
//! never streams them: `stream: true` is refused by name, as is point's
//! `spatial_refs`). Query and caption stream server-sent events
//! `data: {"chunk": "...", "completed": false}`, then one `data: {"chunk":
//! "", "completed": true, ...}` (the client stops at `completed`); a failure
//! after the stream began is one `data: {"error": {...}, "completed": true}`.
//! Errors are OpenAI-shaped (`{"error": {"message", "type", "param",
//! "code"}}`), 400 naming the field (`image_url`, `question`, `length`,
//! `object`, `settings.max_objects`, `settings.temperature`, ...; `skill`
//! for point or detect on a model without a region module), 500 for a
//! point/detect output the runtime broke. `X-Moondream-Auth` is not read:
//! Kestrel's HTTP API has no API keys.

use std::convert::Infallible;

use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt as _;
use kestrel_engine::{
    CaptionLength, EngineError, Field, FinishReason, GenerateRequest, GenerateResponse,
    GenerationStream, Prompt, SamplingOptions, SpatialResult, Speculation, StreamEvent, VisionTask,
};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::error::{json_response, ApiError, FieldNames};
use super::request::Fields;
use super::App;
use crate::image_url::decode_image_url;

/// The Moondream skills' default temperature (the seed system's
/// `AR_DEFAULT_TEMPERATURE`).
pub const DEFAULT_TEMPERATURE: f32 = 0.2;
/// The Moondream skills' default nucleus mass (`AR_DEFAULT_TOP_P`).
pub const DEFAULT_TOP_P: f32 = 0.9;

/// Which skill a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skill {
    Query,
    Caption,
    Point,
    Detect,
}

impl Skill {
    /// The answer's key (`answer`, `caption`, `points` or `objects`).
    fn key(self) -> &'static str {
        match self {
            Skill::Query => "answer",
            Skill::Caption => "caption",
            Skill::Point => "points",
            Skill::Detect => "objects",
        }
    }
}

/// A parsed Moondream request: what to submit, and whether to stream.
#[derive(Debug, Clone)]
pub struct MoondreamRequest {
    pub skill: Skill,
    pub request: GenerateRequest,
    pub stream: bool,
}

/// The Moondream API's names of the engine's fields.
#[derive(Debug, Clone, Copy)]
struct Names;

impl FieldNames for Names {
    fn param(&self, field: Field) -> String {
        match field {
            Field::Image => "image_url".into(),
            Field::Question | Field::Prompt => "question".into(),
            Field::Temperature => "settings.temperature".into(),
            Field::TopP => "settings.top_p".into(),
            Field::MaxNewTokens => "settings.max_tokens".into(),
            Field::MaxObjects => "settings.max_objects".into(),
            // `object` and `skill` (a model without a region module) keep
            // the engine's names.
            other => other.to_string(),
        }
    }

    fn overflow_param(&self) -> String {
        "settings.max_tokens".into()
    }
}

/// The `settings` object: `temperature`, `top_p`, `max_tokens`,
/// `max_objects` (all optional; anything else is a 400 naming it).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    temperature: Option<f32>,
    top_p: Option<f32>,
    max_tokens: Option<u32>,
    /// `point`/`detect`'s; accepted (and type-checked) by every skill so
    /// one settings object serves them all, as the client's
    /// `SamplingSettings` does.
    max_objects: Option<u32>,
}

/// Parses a request body for `skill`; `served` is the model id served.
pub fn parse(skill: Skill, body: &[u8], served: &str) -> Result<MoondreamRequest, ApiError> {
    let mut f = Fields::parse(body)?;
    if let Some(model) = f.take::<String>("model")? {
        if model != served {
            return Err(ApiError::model_not_found(&model, served));
        }
    }
    let stream = f.take::<bool>("stream")?.unwrap_or(false);
    let settings = match f.raw("settings") {
        None => Settings::default(),
        Some(v) => serde_json::from_value::<Settings>(v).map_err(|e| {
            let msg = e.to_string();
            // serde names an unknown key in backquotes: blame it.
            let param = msg
                .strip_prefix("unknown field `")
                .and_then(|r| r.split_once('`'))
                .map_or_else(|| "settings".to_string(), |(k, _)| format!("settings.{k}"));
            ApiError::invalid(param, format!("settings: {msg}"))
        })?,
    };
    let task = match skill {
        Skill::Query => {
            if f.take::<bool>("reasoning")? == Some(true) {
                return Err(ApiError::unsupported("reasoning", "reasoning mode"));
            }
            if f.raw("spatial_refs").is_some() {
                return Err(ApiError::unsupported("spatial_refs", "spatial_refs"));
            }
            let question = f
                .take::<String>("question")?
                .ok_or_else(|| ApiError::invalid("question", "question is required"))?;
            VisionTask::Query { question }
        }
        Skill::Caption => {
            let length = match f.take::<String>("length")? {
                None => CaptionLength::default(),
                Some(l) => l
                    .parse::<CaptionLength>()
                    .map_err(|e| ApiError::invalid("length", format!("length: {e}")))?,
            };
            VisionTask::Caption { length }
        }
        Skill::Point | Skill::Detect => {
            if stream {
                return Err(ApiError::unsupported(
                    "stream",
                    "streaming point or detect (the moondream client never asks it)",
                ));
            }
            if f.raw("spatial_refs").is_some() {
                return Err(ApiError::unsupported("spatial_refs", "spatial_refs"));
            }
            let object = f
                .take::<String>("object")?
                .ok_or_else(|| ApiError::invalid("object", "object is required"))?;
            let max_objects = settings.max_objects;
            match skill {
                Skill::Point => VisionTask::Point {
                    object,
                    max_objects,
                },
                _ => VisionTask::Detect {
                    object,
                    max_objects,
                },
            }
        }
    };
    let image = match f.take::<String>("image_url")? {
        None => {
            return Err(ApiError::invalid(
                "image_url",
                "image_url is required (a data URL: data:image/jpeg;base64,...)",
            ))
        }
        Some(url) => decode_image_url(&url)
            .map_err(|e| ApiError::invalid("image_url", format!("image_url {e}")))?,
    };
    f.finish()?;
    let request = GenerateRequest {
        input: Prompt::Vision { image, task },
        max_new_tokens: settings.max_tokens,
        sampling: SamplingOptions {
            temperature: Some(settings.temperature.unwrap_or(DEFAULT_TEMPERATURE)),
            top_p: Some(settings.top_p.unwrap_or(DEFAULT_TOP_P)),
            ..SamplingOptions::default()
        },
        // The Moondream API has no stop conditions, constraints or samples:
        // the skill's own end (EOS) and the engine's defaults.
        request_id: None,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        min_tokens: 0,
        constraint: None,
        speculate: Speculation::Default,
        n: None,
    };
    Ok(MoondreamRequest {
        skill,
        request,
        stream,
    })
}

/// Serves one parsed request: one JSON answer, or its stream.
pub(super) async fn run(app: &App, req: MoondreamRequest) -> Response {
    let mut streams = match crate::service::submit_samples(&app.engine, req.request).await {
        Ok(s) => s,
        Err(e) => return ApiError::engine(&e, &Names).into_response(),
    };
    let stream = streams.remove(0);
    if req.stream {
        let (tx, rx) = mpsc::channel(32);
        tokio::spawn(pump(stream, tx));
        let events = ReceiverStream::new(rx).map(Ok::<_, Infallible>);
        return Sse::new(events).into_response();
    }
    match finish(stream).await {
        Ok(resp) => json_response(StatusCode::OK, &answer(req.skill, &resp)),
        Err(e) => e.into_response(),
    }
}

/// Runs a request to its end.
async fn finish(mut s: GenerationStream) -> Result<GenerateResponse, ApiError> {
    loop {
        match s.next().await {
            Some(Ok(StreamEvent::Delta { .. } | StreamEvent::Object(_))) => {}
            Some(Ok(StreamEvent::Done(resp))) => return done(resp),
            Some(Err(e)) => return Err(ApiError::engine(&e, &Names)),
            None => return Err(ApiError::engine(&EngineError::Stopped, &Names)),
        }
    }
}

/// A finished request, or the error of an aborted one.
fn done(resp: GenerateResponse) -> Result<GenerateResponse, ApiError> {
    match resp.finish_reason {
        FinishReason::Abort => Err(ApiError::aborted()),
        _ => Ok(resp),
    }
}

/// The Moondream finish reason: `length` when the budget ended it, else
/// `stop`.
fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

/// The unary answer: `{"answer"}`, `{"caption"}`, `{"points"}` or
/// `{"objects"}`, with the request id, finish reason and token counts
/// beside it.
fn answer(skill: Skill, resp: &GenerateResponse) -> Value {
    let mut body = Map::new();
    body.insert("request_id".into(), json!(resp.request_id));
    let value = match &resp.objects {
        None => json!(resp.text),
        Some(SpatialResult::Points(p)) => {
            Value::Array(p.iter().map(|p| json!({"x": p.x, "y": p.y})).collect())
        }
        Some(SpatialResult::Boxes(b)) => Value::Array(
            b.iter()
                .map(|b| json!({"x_min": b.x_min, "y_min": b.y_min, "x_max": b.x_max, "y_max": b.y_max}))
                .collect(),
        ),
    };
    body.insert(skill.key().into(), value);
    body.insert(
        "finish_reason".into(),
        json!(finish_reason(resp.finish_reason)),
    );
    body.insert("usage".into(), usage(resp));
    Value::Object(body)
}

fn usage(resp: &GenerateResponse) -> Value {
    json!({
        "prompt_tokens": resp.usage.prompt_tokens,
        "completion_tokens": resp.usage.completion_tokens,
        "cached_prompt_tokens": resp.usage.cached_prompt_tokens,
    })
}

/// Feeds a stream's text to `tx` as `chunk` events, then the `completed`
/// one. Returns (dropping the engine stream, which aborts the request) as
/// soon as the client is gone.
async fn pump(mut s: GenerationStream, tx: mpsc::Sender<Event>) {
    loop {
        let item = tokio::select! {
            item = s.next() => item,
            _ = tx.closed() => return,
        };
        let event = match item {
            // Point and detect are never streamed here (see `parse`).
            Some(Ok(StreamEvent::Object(_))) => continue,
            Some(Ok(StreamEvent::Delta { text, .. })) => {
                if text.is_empty() {
                    continue;
                }
                json!({"chunk": text, "completed": false})
            }
            Some(Ok(StreamEvent::Done(resp))) => match done(resp) {
                Ok(resp) => json!({
                    "chunk": "",
                    "completed": true,
                    "request_id": resp.request_id,
                    "finish_reason": finish_reason(resp.finish_reason),
                    "usage": usage(&resp),
                }),
                Err(e) => failed(&e),
            },
            Some(Err(e)) => failed(&ApiError::engine(&e, &Names)),
            None => failed(&ApiError::engine(&EngineError::Stopped, &Names)),
        };
        let last = event["completed"] == true;
        if tx
            .send(Event::default().data(event.to_string()))
            .await
            .is_err()
            || last
        {
            return;
        }
    }
}

/// The last event of a stream that failed: the error, and `completed`.
fn failed(e: &ApiError) -> Value {
    let mut body = e.body();
    body["completed"] = json!(true);
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_json(skill: Skill, v: Value) -> Result<MoondreamRequest, ApiError> {
        parse(skill, v.to_string().as_bytes(), "md")
    }

    const PNG_B64: &str = "iVBORw0KGgo=";

    #[test]
    fn query_maps_settings_and_defaults() {
        let r = parse_json(
            Skill::Query,
            json!({"question": "What?", "image_url": format!("data:image/png;base64,{PNG_B64}"),
                   "stream": true, "settings": {"temperature": 0.0, "max_tokens": 7, "max_objects": 3}}),
        )
        .unwrap();
        assert!(r.stream);
        assert_eq!(r.request.max_new_tokens, Some(7));
        assert_eq!(r.request.sampling.temperature, Some(0.0));
        assert_eq!(r.request.sampling.top_p, Some(DEFAULT_TOP_P));
        assert_eq!(
            r.request.input,
            Prompt::Vision {
                image: b"\x89PNG\r\n\x1a\n".to_vec(),
                task: VisionTask::Query {
                    question: "What?".into()
                }
            }
        );
        let c = parse_json(Skill::Caption, json!({"image_url": PNG_B64})).unwrap();
        assert!(!c.stream);
        assert_eq!(c.request.max_new_tokens, None);
        assert_eq!(c.request.sampling.temperature, Some(DEFAULT_TEMPERATURE));
        let Prompt::Vision { task, .. } = c.request.input else {
            panic!("a vision prompt")
        };
        assert_eq!(
            task,
            VisionTask::Caption {
                length: CaptionLength::Normal
            }
        );
    }

    /// Each refusal names its field.
    #[test]
    fn refusals_name_the_field() {
        let img = format!("data:image/png;base64,{PNG_B64}");
        let cases = [
            (
                Skill::Caption,
                json!({"image_url": img, "length": "medium"}),
                "length",
            ),
            (
                Skill::Caption,
                json!({"image_url": img, "length": 3}),
                "length",
            ),
            (Skill::Caption, json!({}), "image_url"),
            (Skill::Query, json!({"image_url": img}), "question"),
            (Skill::Query, json!({"question": "q"}), "image_url"),
            (
                Skill::Query,
                json!({"question": "q", "image_url": "https://example.com/a.jpg"}),
                "image_url",
            ),
            (
                Skill::Query,
                json!({"question": "q", "image_url": img, "settings": {"top_k": 3}}),
                "settings.top_k",
            ),
            (
                Skill::Query,
                json!({"question": "q", "image_url": img, "settings": {"temperature": "hot"}}),
                "settings",
            ),
            (
                Skill::Query,
                json!({"question": "q", "image_url": img, "reasoning": true}),
                "reasoning",
            ),
            (
                Skill::Query,
                json!({"question": "q", "image_url": img, "extra": 1}),
                "extra",
            ),
        ];
        for (skill, body, param) in cases {
            let e = parse_json(skill, body.clone()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        let e = parse_json(
            Skill::Query,
            json!({"question": "q", "image_url": img, "model": "other"}),
        )
        .unwrap_err();
        assert_eq!(e.status, StatusCode::NOT_FOUND);
    }

    #[test]
    fn engine_fields_take_moondream_names() {
        let e = ApiError::engine(
            &EngineError::InvalidArgument {
                field: Field::TopP,
                message: "must be in (0, 1], got 2".into(),
            },
            &Names,
        );
        assert_eq!(e.param.as_deref(), Some("settings.top_p"));
        assert_eq!(Names.param(Field::Image), "image_url");
        assert_eq!(Names.param(Field::Question), "question");
        assert_eq!(Names.param(Field::MaxNewTokens), "settings.max_tokens");
    }
}
