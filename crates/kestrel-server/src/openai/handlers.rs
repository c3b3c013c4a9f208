//! Runs a [`Plan`] on the engine and answers in OpenAI's shapes: one JSON
//! response, or server-sent events (`data: {chunk}` ... `data: [DONE]`).
//!
//! Every prompt is one engine request with `n` samples, submitted through
//! [`crate::service::submit_samples`] (the blocking pool): one stream per
//! choice, the samples of a prompt sharing its KV pages in the engine. A
//! stream is pumped by
//! one task per HTTP request; when the client goes away the task notices
//! (`Sender::closed`) and returns, dropping the engine streams, which
//! aborts the requests and frees their KV. A failed request never ends
//! with a normal `finish_reason`: unary calls answer the error, streams
//! send an `{"error": ...}` event and `[DONE]`. With completions' `echo`,
//! each choice's text starts with its prompt (its first chunk, streamed),
//! and with `logprobs` (unary only) its logprobs start with the prompt
//! tokens' as the engine scored them.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::BoxStream;
use futures_util::StreamExt as _;
use kestrel_engine::{
    EngineError, FinishReason, GenerateResponse, Prompt, StreamEvent, TokenLogprob,
};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::error::ApiError;
use super::request::{Endpoint, Plan};
use super::tools::{self, CallSplitter, Piece, Split};
use super::App;

/// Seconds since the Unix epoch (OpenAI's `created`).
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A fresh id with OpenAI's prefix (`chatcmpl-`, `cmpl-`, `call_`): the
/// clock in nanoseconds and a process-wide counter, in hex.
fn new_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!("{prefix}{t:x}{n:04x}")
}

/// What every response and chunk of one request repeats.
#[derive(Debug, Clone)]
struct Head {
    id: String,
    created: u64,
    model: String,
}

/// Submits every choice of `plan` and answers.
pub(crate) async fn run(app: &App, plan: Plan) -> Response {
    let streams = match submit_all(app, &plan).await {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let echoes = match echoes(app, &plan) {
        Ok(e) => e,
        Err(e) => return e.into_response(),
    };
    let head = Head {
        id: new_id(match plan.endpoint {
            Endpoint::Chat => "chatcmpl-",
            Endpoint::Completions => "cmpl-",
        }),
        created: unix_now(),
        model: app.model_id.clone(),
    };
    if plan.stream {
        let (tx, rx) = mpsc::channel(32);
        tokio::spawn(pump(head, plan, echoes, streams, tx));
        let events = ReceiverStream::new(rx).map(Ok::<_, Infallible>);
        Sse::new(events).into_response()
    } else {
        match unary(&plan, streams).await {
            Ok(results) => super::error::json_response(
                axum::http::StatusCode::OK,
                &response_body(&head, &plan, &echoes, &results),
            ),
            Err(e) => e.into_response(),
        }
    }
}

/// Per prompt, the text its choices' text starts with: the prompt itself
/// with `echo` (token ids decoded, special tokens kept), else nothing.
/// Runs after the engine accepted the prompts, so token ids are valid.
fn echoes(app: &App, plan: &Plan) -> Result<Vec<String>, ApiError> {
    plan.prompts
        .iter()
        .zip(&plan.names)
        .map(|(r, names)| match &r.input {
            _ if !plan.echo => Ok(String::new()),
            Prompt::Text(text) => Ok(text.clone()),
            Prompt::Tokens(ids) => app
                .engine
                .detokenize(ids, false)
                .map_err(|e| ApiError::engine(&e, names)),
            // `echo` is a completions field; chat prompts (an image's
            // question included) never echo.
            Prompt::Chat { .. } | Prompt::Vision { .. } => Ok(String::new()),
        })
        .collect()
}

/// One choice's engine events (dropping it aborts the request).
type Events = BoxStream<'static, Result<StreamEvent, EngineError>>;

/// Submits every prompt with its `n` samples: one stream per choice, in
/// choice order (`p * n + i`). On an error the streams already open are
/// dropped, which aborts them.
async fn submit_all(app: &App, plan: &Plan) -> Result<Vec<Events>, ApiError> {
    let mut out = Vec::with_capacity(plan.choices());
    for (req, names) in plan.prompts.iter().zip(&plan.names) {
        let streams = crate::service::submit_samples(&app.engine, req.clone())
            .await
            .map_err(|e| ApiError::engine(&e, names))?;
        out.extend(streams.into_iter().map(|s| s.boxed()));
    }
    Ok(out)
}

/// Runs every choice to its end; the first failure drops (aborts) the rest.
async fn unary(plan: &Plan, streams: Vec<Events>) -> Result<Vec<GenerateResponse>, ApiError> {
    let n = plan.n as usize;
    let runs = streams
        .into_iter()
        .enumerate()
        .map(|(i, mut s)| async move {
            let names = &plan.names[i / n];
            loop {
                match s.next().await {
                    // The OpenAI API asks no point/detect: no objects come.
                    Some(Ok(StreamEvent::Delta { .. } | StreamEvent::Object(_))) => {}
                    Some(Ok(StreamEvent::Done(resp))) => {
                        return match resp.finish_reason {
                            FinishReason::Abort => Err(ApiError::aborted()),
                            _ => Ok(resp),
                        }
                    }
                    Some(Err(e)) => return Err(ApiError::engine(&e, names)),
                    None => return Err(ApiError::engine(&EngineError::Stopped, names)),
                }
            }
        });
    futures_util::future::try_join_all(runs).await
}

/// OpenAI's finish reason of an ended (not aborted, not failed) request.
fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

fn usage(plan: &Plan, results: &[GenerateResponse]) -> Value {
    let n = plan.n as usize;
    // The prompt is counted once per prompt, as OpenAI does for `n`.
    let firsts = results.iter().step_by(n);
    let prompt: u64 = firsts
        .clone()
        .map(|r| u64::from(r.usage.prompt_tokens))
        .sum();
    let cached: u64 = firsts
        .map(|r| u64::from(r.usage.cached_prompt_tokens))
        .sum();
    let completion: u64 = results
        .iter()
        .map(|r| u64::from(r.usage.completion_tokens))
        .sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn response_body(
    head: &Head,
    plan: &Plan,
    echoes: &[String],
    results: &[GenerateResponse],
) -> Value {
    let n = plan.n as usize;
    let choices: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, r)| match plan.endpoint {
            Endpoint::Chat => chat_choice(plan, i, r),
            Endpoint::Completions => json!({
                "index": i,
                "text": format!("{}{}", echoes[i / n], r.text),
                "logprobs": if plan.logprobs {
                    // With echo the prompt's tokens come first (the first
                    // one's logprob null: nothing precedes it).
                    let prompt = if plan.echo { &r.prompt_logprobs[..] } else { &[] };
                    let all: Vec<TokenLogprob> = prompt.iter().chain(&r.logprobs).cloned().collect();
                    completion_logprobs(&all, &mut 0)
                } else {
                    Value::Null
                },
                "finish_reason": finish_reason(r.finish_reason),
            }),
        })
        .collect();
    json!({
        "id": head.id,
        "object": match plan.endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completions => "text_completion",
        },
        "created": head.created,
        "model": head.model,
        "choices": choices,
        "usage": usage(plan, results),
    })
}

/// A chat choice. With tools, whole calls are `tool_calls`; a call the
/// output was cut inside of (by `max_tokens`) is content, and the finish
/// reason is then the engine's (`length`), never `tool_calls`.
fn chat_choice(plan: &Plan, index: usize, r: &GenerateResponse) -> Value {
    let Split {
        mut content,
        calls,
        unfinished,
    } = match &plan.tools {
        Some(t) => tools::split(t, &r.text),
        None => Split {
            content: r.text.clone(),
            ..Split::default()
        },
    };
    content.push_str(&unfinished);
    let mut message = json!({"role": "assistant", "content": content});
    if !calls.is_empty() {
        if content.is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = calls
            .iter()
            .map(|c| {
                json!({
                    "id": new_id("call_"),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                })
            })
            .collect();
    }
    let finish = if !calls.is_empty() && unfinished.is_empty() {
        "tool_calls"
    } else {
        finish_reason(r.finish_reason)
    };
    json!({
        "index": index,
        "message": message,
        "logprobs": if plan.logprobs { chat_logprobs(&r.logprobs) } else { Value::Null },
        "finish_reason": finish,
    })
}

/// Chat-form logprobs: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
fn chat_logprobs(lps: &[TokenLogprob]) -> Value {
    let entry = |text: &str, logprob: f32| json!({"token": text, "logprob": logprob, "bytes": text.as_bytes()});
    let content: Vec<Value> = lps
        .iter()
        .map(|lp| {
            let mut e = entry(&lp.text, lp.logprob);
            e["top_logprobs"] = lp.top.iter().map(|(_, t, l)| entry(t, *l)).collect();
            e
        })
        .collect();
    json!({ "content": content })
}

/// Completions-form logprobs; `offset` is the text offset of the first
/// token (advanced past these tokens).
fn completion_logprobs(lps: &[TokenLogprob], offset: &mut usize) -> Value {
    let mut text_offset = Vec::with_capacity(lps.len());
    for lp in lps {
        text_offset.push(*offset);
        *offset += lp.text.len();
    }
    json!({
        "tokens": lps.iter().map(|lp| lp.text.as_str()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|lp| lp.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps
            .iter()
            .map(|lp| lp.top.iter().map(|(_, t, l)| (t.clone(), json!(l))).collect::<serde_json::Map<_, _>>())
            .collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

/// Per-choice streaming state.
struct ChoiceStream {
    splitter: Option<CallSplitter>,
    /// Logprobs of tokens whose text is held back (tool-call detection).
    pending_logprobs: Vec<TokenLogprob>,
    /// Completions-form text offset.
    offset: usize,
    /// Tool calls begun so far (the next one's `index`).
    calls_sent: usize,
    /// The output ended inside a call (sent as content).
    cut: bool,
}

/// Feeds a stream's events to `tx` as chunks. Returns (dropping the engine
/// streams, so aborting them) as soon as the client is gone.
async fn pump(
    head: Head,
    plan: Plan,
    echoes: Vec<String>,
    streams: Vec<Events>,
    tx: mpsc::Sender<Event>,
) {
    let n = plan.n as usize;
    let mut merged = futures_util::stream::select_all(
        streams
            .into_iter()
            .enumerate()
            .map(|(i, s)| s.map(move |ev| (i, ev))),
    );
    let mut states: Vec<ChoiceStream> = (0..plan.choices())
        .map(|_| ChoiceStream {
            splitter: plan.tools.as_ref().map(CallSplitter::new),
            pending_logprobs: Vec::new(),
            offset: 0,
            calls_sent: 0,
            cut: false,
        })
        .collect();
    let chunker = Chunker {
        head: &head,
        plan: &plan,
    };
    if plan.endpoint == Endpoint::Chat {
        for i in 0..plan.choices() {
            let role = json!({"role": "assistant", "content": ""});
            if !send(&tx, chunker.chat(i, role, None, None)).await {
                return;
            }
        }
    }
    if plan.echo {
        // The echoed prompt is each choice's first chunk.
        for i in 0..plan.choices() {
            if !send(&tx, chunker.completion(i, &echoes[i / n], None, None)).await {
                return;
            }
        }
    }
    let mut results: Vec<Option<GenerateResponse>> = vec![None; plan.choices()];
    loop {
        let item = tokio::select! {
            item = merged.next() => item,
            _ = tx.closed() => return,
        };
        let Some((i, ev)) = item else { break };
        let chunks = match ev {
            Ok(StreamEvent::Delta { text, logprobs, .. }) => {
                chunker.delta(i, &mut states[i], &text, logprobs)
            }
            // The OpenAI API asks no point/detect: no objects come.
            Ok(StreamEvent::Object(_)) => Vec::new(),
            Ok(StreamEvent::Done(resp)) if resp.finish_reason == FinishReason::Abort => {
                fail(&tx, ApiError::aborted()).await;
                return;
            }
            Ok(StreamEvent::Done(resp)) => {
                let chunks = chunker.finish(i, &mut states[i], &resp);
                results[i] = Some(resp);
                chunks
            }
            Err(e) => {
                fail(&tx, ApiError::engine(&e, &plan.names[i / n])).await;
                return;
            }
        };
        for c in chunks {
            if !send(&tx, c).await {
                return;
            }
        }
    }
    let results: Option<Vec<GenerateResponse>> = results.into_iter().collect();
    let Some(results) = results else {
        // A stream ended without its final event: the engine stopped.
        fail(&tx, ApiError::unavailable("the engine thread has stopped")).await;
        return;
    };
    if plan.include_usage {
        let mut last = chunker.base(Vec::new());
        last["usage"] = usage(&plan, &results);
        if !send(&tx, last).await {
            return;
        }
    }
    let _ = tx.send(Event::default().data("[DONE]")).await;
}

/// Sends one JSON chunk; false when the client is gone.
async fn send(tx: &mpsc::Sender<Event>, chunk: Value) -> bool {
    tx.send(Event::default().data(chunk.to_string()))
        .await
        .is_ok()
}

/// Ends a stream with an error event and `[DONE]`.
async fn fail(tx: &mpsc::Sender<Event>, e: ApiError) {
    if send(tx, e.body()).await {
        let _ = tx.send(Event::default().data("[DONE]")).await;
    }
}

/// Builds the chunks of one streamed request.
struct Chunker<'a> {
    head: &'a Head,
    plan: &'a Plan,
}

impl Chunker<'_> {
    fn base(&self, choices: Vec<Value>) -> Value {
        json!({
            "id": self.head.id,
            "object": match self.plan.endpoint {
                Endpoint::Chat => "chat.completion.chunk",
                Endpoint::Completions => "text_completion",
            },
            "created": self.head.created,
            "model": self.head.model,
            "choices": choices,
        })
    }

    fn chat(
        &self,
        index: usize,
        delta: Value,
        logprobs: Option<Value>,
        finish: Option<&str>,
    ) -> Value {
        self.base(vec![json!({
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
        })])
    }

    fn completion(
        &self,
        index: usize,
        text: &str,
        logprobs: Option<Value>,
        finish: Option<&str>,
    ) -> Value {
        self.base(vec![json!({
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
        })])
    }

    /// Logprobs waiting in `state`, in the endpoint's form (if asked).
    fn take_logprobs(&self, state: &mut ChoiceStream) -> Option<Value> {
        if !self.plan.logprobs {
            return None;
        }
        let lps = std::mem::take(&mut state.pending_logprobs);
        Some(match self.plan.endpoint {
            Endpoint::Chat => chat_logprobs(&lps),
            Endpoint::Completions => completion_logprobs(&lps, &mut state.offset),
        })
    }

    fn delta(
        &self,
        index: usize,
        state: &mut ChoiceStream,
        text: &str,
        logprobs: Vec<TokenLogprob>,
    ) -> Vec<Value> {
        state.pending_logprobs.extend(logprobs);
        if self.plan.endpoint == Endpoint::Completions {
            let lp = self.take_logprobs(state);
            return vec![self.completion(index, text, lp, None)];
        }
        let pieces = match &mut state.splitter {
            Some(s) => s.push(text),
            None => vec![Piece::Text(text.to_string())],
        };
        self.pieces(index, state, pieces)
    }

    /// Chunks for what the splitter released, in OpenAI's delta shapes: a
    /// call's first delta carries its index, id, type, name and empty
    /// arguments; the next ones its index and argument fragments.
    fn pieces(&self, index: usize, state: &mut ChoiceStream, pieces: Vec<Piece>) -> Vec<Value> {
        let mut out = Vec::with_capacity(pieces.len());
        for p in pieces {
            let delta = match p {
                Piece::Text(t) => json!({ "content": t }),
                Piece::CallStart(name) => {
                    state.calls_sent += 1;
                    json!({"tool_calls": [{
                        "index": state.calls_sent - 1,
                        "id": new_id("call_"),
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }]})
                }
                Piece::Args(a) => json!({"tool_calls": [{
                    "index": state.calls_sent.saturating_sub(1),
                    "function": {"arguments": a},
                }]}),
                Piece::Unfinished { text, .. } => {
                    state.cut = true;
                    json!({ "content": text })
                }
            };
            let lp = self.take_logprobs(state);
            out.push(self.chat(index, delta, lp, None));
        }
        out
    }

    fn finish(
        &self,
        index: usize,
        state: &mut ChoiceStream,
        resp: &GenerateResponse,
    ) -> Vec<Value> {
        let reason = finish_reason(resp.finish_reason);
        if self.plan.endpoint == Endpoint::Completions {
            let lp = if state.pending_logprobs.is_empty() {
                None
            } else {
                self.take_logprobs(state)
            };
            return vec![self.completion(index, "", lp, Some(reason))];
        }
        let rest = state
            .splitter
            .as_mut()
            .map(CallSplitter::finish)
            .unwrap_or_default();
        let mut out = self.pieces(index, state, rest);
        let reason = if state.calls_sent > 0 && !state.cut {
            "tool_calls"
        } else {
            reason
        };
        let lp = if state.pending_logprobs.is_empty() {
            None
        } else {
            self.take_logprobs(state)
        };
        out.push(self.chat(index, json!({}), lp, Some(reason)));
        out
    }
}
