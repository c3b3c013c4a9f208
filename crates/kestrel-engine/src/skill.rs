//! [`StreamingSkill`]: the `SequenceSkill` the engine hands the pipeline. It
//! wraps a [`RequestSkill`]: a `kestrel_skills::Skill` (all text request
//! semantics: EOS, stop strings, constraints, UTF-8-safe deltas) or a
//! `kestrel_skills::SpatialSkill` (Moondream's `point` / `detect`), and
//! forwards its output to the client's channel: text deltas, or one
//! `StreamEvent::Object` per completed point or box.
//!
//! Runs on the engine thread inside `run_once`: per token it is the inner
//! skill's work plus one unbounded, never-blocking channel send and a few
//! atomics. `finish` sends exactly one terminal item (`Done` or an error).

use std::sync::Arc;
use std::time::Instant;

use kestrel_pipeline::{CommittedToken, FailureKind, Outcome, SequenceSkill, TokenMask, Verdict};
use kestrel_skills::{Skill, SpatialFailure, SpatialResult, SpatialSkill};
use tokio::sync::mpsc::UnboundedSender;

use crate::error::EngineError;
use crate::metrics::Metrics;
use crate::model::ModelContext;
use crate::model::PositionLogprobs;
use crate::request::{
    FinishReason, GenerateResponse, SpatialObject, StreamEvent, Timings, TokenLogprob, Usage,
};
use crate::validate::Field;

/// A sample's request semantics: text (free or constrained) or a
/// point/detect request's objects. Built by the validation, one per sample.
#[derive(Debug)]
pub(crate) enum RequestSkill {
    Text(Skill),
    Spatial(SpatialSkill),
}

impl RequestSkill {
    fn as_sequence(&mut self) -> &mut dyn SequenceSkill {
        match self {
            RequestSkill::Text(s) => s,
            RequestSkill::Spatial(s) => s,
        }
    }

    fn token_ids(&self) -> &[u32] {
        match self {
            RequestSkill::Text(s) => s.token_ids(),
            RequestSkill::Spatial(s) => s.token_ids(),
        }
    }
}

/// What a finished skill ended with, for the terminal item.
enum Failure {
    Constraint(kestrel_skills::ConstraintFailure),
    Spatial(SpatialFailure),
}

/// The `i`-th object of `objects`, as a stream event carries it.
fn object_at(objects: &SpatialResult, i: usize) -> Option<SpatialObject> {
    match objects {
        SpatialResult::Points(p) => p.get(i).copied().map(SpatialObject::Point),
        SpatialResult::Boxes(b) => b.get(i).copied().map(SpatialObject::Box),
    }
}

/// The client's end of a request: events flow here until the terminal one.
pub(crate) type EventSender = UnboundedSender<Result<StreamEvent, EngineError>>;

/// The wrapper skill; see the module docs.
pub(crate) struct StreamingSkill {
    inner: RequestSkill,
    /// Objects already sent as `StreamEvent::Object` (point/detect).
    objects_sent: usize,
    request_id: String,
    pipeline_id: u64,
    /// Which sample of its request (`0..n`).
    index: u32,
    model: ModelContext,
    events: EventSender,
    /// Tells the engine thread the request is resolved (to forget its id).
    done: std::sync::mpsc::Sender<u64>,
    metrics: Arc<Metrics>,
    prompt_tokens: u32,
    submitted: Instant,
    constraint_field: Field,
    /// When the pipeline admitted the sequence (`on_admitted`: prefill launched).
    admitted: Option<Instant>,
    /// Prompt tokens served from the prefix cache.
    cached_prompt_tokens: u32,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// The scored prompt, when the request asked (set before submission).
    prompt_logprobs: Vec<TokenLogprob>,
    span: tracing::Span,
}

impl std::fmt::Debug for StreamingSkill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamingSkill")
            .field("request_id", &self.request_id)
            .field("pipeline_id", &self.pipeline_id)
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// Everything a [`StreamingSkill`] needs besides the inner skill.
pub(crate) struct StreamingSkillParts {
    pub request_id: String,
    pub pipeline_id: u64,
    pub index: u32,
    pub model: ModelContext,
    pub events: EventSender,
    pub done: std::sync::mpsc::Sender<u64>,
    pub metrics: Arc<Metrics>,
    pub prompt_tokens: u32,
    pub submitted: Instant,
    /// The request's constraint field, named when it fails mid-generation.
    pub constraint_field: Field,
}

impl StreamingSkill {
    pub fn new(inner: RequestSkill, p: StreamingSkillParts) -> Self {
        let span = tracing::info_span!(
            "request",
            id = %p.request_id,
            pid = p.pipeline_id,
            index = p.index
        );
        Self {
            inner,
            objects_sent: 0,
            request_id: p.request_id,
            pipeline_id: p.pipeline_id,
            index: p.index,
            model: p.model,
            events: p.events,
            done: p.done,
            metrics: p.metrics,
            prompt_tokens: p.prompt_tokens,
            submitted: p.submitted,
            constraint_field: p.constraint_field,
            admitted: None,
            cached_prompt_tokens: 0,
            first_token: None,
            last_token: None,
            prompt_logprobs: Vec::new(),
            span,
        }
    }

    /// Keeps the runtime's scores of `prompt` for the response: the first
    /// token has none (NaN), token `i` gets `scores[i - 1]`.
    pub fn set_prompt_logprobs(&mut self, prompt: &[u32], scores: Vec<PositionLogprobs>) {
        debug_assert_eq!(scores.len() + 1, prompt.len().max(1));
        let first = prompt.first().map(|&t| TokenLogprob {
            token_id: t,
            text: self.model.token_text(t),
            logprob: f32::NAN,
            top: Vec::new(),
        });
        let rest = prompt
            .iter()
            .skip(1)
            .zip(scores)
            .map(|(&t, s)| TokenLogprob {
                token_id: t,
                text: self.model.token_text(t),
                logprob: s.logprob,
                top: s
                    .top
                    .into_iter()
                    .map(|(t, l)| (t, self.model.token_text(t), l))
                    .collect(),
            });
        self.prompt_logprobs = first.into_iter().chain(rest).collect();
    }

    fn convert_logprobs(&self, lps: Vec<kestrel_skills::TokenLogprob>) -> Vec<TokenLogprob> {
        lps.into_iter()
            .map(|lp| TokenLogprob {
                token_id: lp.token,
                text: self.model.token_text(lp.token),
                logprob: lp.logprob.unwrap_or(f32::NAN),
                top: lp
                    .top
                    .into_iter()
                    .map(|(t, l)| (t, self.model.token_text(t), l))
                    .collect(),
            })
            .collect()
    }

    /// Sends what the last commit completed: a text delta, or each newly
    /// completed object. A closed channel means the client went away (its
    /// drop sent an abort), so send errors are ignored.
    fn send_delta(&mut self) {
        match &mut self.inner {
            RequestSkill::Text(skill) => {
                if let Some(d) = skill.take_delta() {
                    let logprobs = self.convert_logprobs(d.logprobs);
                    let _ = self.events.send(Ok(StreamEvent::Delta {
                        text: d.text,
                        token_ids: d.token_ids,
                        logprobs,
                    }));
                }
            }
            RequestSkill::Spatial(skill) => {
                while let Some(o) = object_at(skill.objects(), self.objects_sent) {
                    self.objects_sent += 1;
                    let _ = self.events.send(Ok(StreamEvent::Object(o)));
                }
            }
        }
    }

    /// The failure a finished skill ended with, if any.
    fn failure(&self) -> Option<Failure> {
        match &self.inner {
            RequestSkill::Text(s) => s.constraint_error().cloned().map(Failure::Constraint),
            RequestSkill::Spatial(s) => match s.result() {
                Some(Err(f)) => Some(Failure::Spatial(f)),
                _ => None,
            },
        }
    }

    fn respond(&mut self, reason: FinishReason, now: Instant) -> GenerateResponse {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let (text, token_ids, json, logprobs, objects) = match &self.inner {
            RequestSkill::Text(skill) => match skill.result() {
                Some(r) => (
                    r.text,
                    r.token_ids,
                    r.json,
                    self.convert_logprobs(r.logprobs.unwrap_or_default()),
                    None,
                ),
                None => (String::new(), Vec::new(), None, Vec::new(), None),
            },
            // A refused step keeps the objects completed before it.
            RequestSkill::Spatial(skill) => (
                String::new(),
                skill.token_ids().to_vec(),
                None,
                Vec::new(),
                Some(skill.objects().clone()),
            ),
        };
        let admitted = self.admitted.unwrap_or(now);
        let completion = token_ids.len() as u32;
        let tokens_per_s = match (self.first_token, self.last_token) {
            (Some(a), Some(b)) if completion > 1 && b > a => {
                f64::from(completion - 1) / (b - a).as_secs_f64()
            }
            _ => 0.0,
        };
        GenerateResponse {
            request_id: self.request_id.clone(),
            index: self.index,
            text,
            token_ids,
            finish_reason: reason,
            usage: Usage {
                prompt_tokens: self.prompt_tokens,
                completion_tokens: completion,
                cached_prompt_tokens: self.cached_prompt_tokens,
            },
            timings: Timings {
                queue_ms: ms(admitted.saturating_duration_since(self.submitted)),
                ttft_ms: self
                    .first_token
                    .map_or(0.0, |t| ms(t.saturating_duration_since(self.submitted))),
                total_ms: ms(now.saturating_duration_since(self.submitted)),
                tokens_per_s,
            },
            logprobs,
            json,
            prompt_logprobs: std::mem::take(&mut self.prompt_logprobs),
            objects,
        }
    }
}

impl SequenceSkill for StreamingSkill {
    fn on_admitted(&mut self, cached_prompt_tokens: usize) {
        self.admitted = Some(Instant::now());
        self.cached_prompt_tokens = u32::try_from(cached_prompt_tokens).unwrap_or(u32::MAX);
    }

    fn consume(&mut self, token: &CommittedToken<'_>) -> Verdict {
        let now = Instant::now();
        match self.last_token {
            None => {
                self.first_token = Some(now);
                self.metrics.ttft.observe(now - self.submitted);
            }
            Some(prev) => self.metrics.inter_token.observe(now - prev),
        }
        self.last_token = Some(now);
        self.metrics
            .tokens_generated
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let verdict = self.inner.as_sequence().consume(token);
        self.send_delta();
        verdict
    }

    fn is_constrained(&self) -> bool {
        match &self.inner {
            RequestSkill::Text(s) => s.is_constrained(),
            RequestSkill::Spatial(s) => s.is_constrained(),
        }
    }

    fn fill_mask(&mut self, mask: &mut TokenMask<'_>) {
        self.inner.as_sequence().fill_mask(mask);
    }

    fn looks_ahead(&self) -> bool {
        match &self.inner {
            RequestSkill::Text(s) => s.looks_ahead(),
            RequestSkill::Spatial(s) => s.looks_ahead(),
        }
    }

    fn fill_masks_ahead(&mut self, drafts: &[u32], words: &mut [u32], vocab_size: usize) {
        self.inner
            .as_sequence()
            .fill_masks_ahead(drafts, words, vocab_size);
    }

    fn finish(&mut self, outcome: Outcome) {
        let now = Instant::now();
        self.inner.as_sequence().finish(outcome.clone());
        self.send_delta();
        self.metrics.e2e.observe(now - self.submitted);
        if let Some(a) = self.admitted {
            self.metrics.queue_time.observe(a - self.submitted);
        }
        let _enter = self.span.clone().entered();
        let terminal = match (outcome, self.failure()) {
            (Outcome::Finished(_), Some(Failure::Constraint(source))) => {
                self.metrics.request_finished(FinishReason::Error);
                tracing::warn!(reason = %source, "constrained output failed mid-generation");
                let partial = Box::new(self.respond(FinishReason::Error, now));
                Err(EngineError::ConstraintFailed {
                    field: self.constraint_field,
                    source,
                    partial,
                })
            }
            (Outcome::Finished(_), Some(Failure::Spatial(source))) => {
                self.metrics.request_finished(FinishReason::Error);
                tracing::error!(
                    why = %crate::error::error_chain(&source),
                    "point/detect output refused: a runtime fault"
                );
                let partial = Box::new(self.respond(FinishReason::Error, now));
                Err(EngineError::SpatialFailed { source, partial })
            }
            (Outcome::Finished(r), None) => {
                let reason = FinishReason::from_pipeline(r);
                self.metrics.request_finished(reason);
                if reason == FinishReason::Length {
                    if let Some(period) = kestrel_skills::looping_tail(self.inner.token_ids()) {
                        self.metrics
                            .length_loops
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::info!(period, "output cut by max_tokens in a loop");
                    }
                }
                let resp = self.respond(reason, now);
                tracing::debug!(
                    reason = reason.as_str(),
                    tokens = resp.usage.completion_tokens,
                    total_ms = resp.timings.total_ms,
                    "request finished"
                );
                Ok(StreamEvent::Done(resp))
            }
            (Outcome::Failed(kind, why), _) => {
                self.metrics.request_finished(FinishReason::Error);
                tracing::warn!(?kind, why = %crate::error::error_chain(&why), "request failed");
                Err(match kind {
                    FailureKind::EngineFatal => EngineError::Fatal(why),
                    FailureKind::StepFailed | FailureKind::Rejected => {
                        EngineError::RequestFailed(why)
                    }
                })
            }
        };
        let _ = self.events.send(terminal);
        let _ = self.done.send(self.pipeline_id);
    }
}
