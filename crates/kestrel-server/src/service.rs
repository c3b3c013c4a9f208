//! [`KestrelService`]: the `kestrel.v1.Kestrel` gRPC handlers, a thin async
//! shell over an [`Engine`] handle.
//!
//! Each handler maps the request's shape (see [`crate::convert`]), makes one
//! engine call and maps the result. The engine's submission work
//! (tokenizing, rendering the chat template, compiling a constraint) runs
//! on tokio's blocking pool, never on an async worker. Cancellation is by
//! drop: when a client goes away tonic drops the handler future or the
//! response stream, which drops the engine's `GenerationStream`, which
//! aborts the request. A unary call's deadline always ends it with
//! DEADLINE_EXCEEDED (see [`Arrival`]).

use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use kestrel_engine::{Engine, EngineError, GenerateRequest, GenerationStream};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::convert;
use crate::pb;

/// The `kestrel.v1.Kestrel` service over one engine.
#[derive(Debug, Clone)]
pub struct KestrelService {
    engine: Engine,
}

impl KestrelService {
    /// Serves `engine`.
    pub fn new(engine: Engine) -> Self {
        Self { engine }
    }
}

/// Validates and submits every sample of `req` (`n`) on the blocking pool
/// (tokenizing a long prompt or compiling a grammar must not stall the
/// async workers): one stream per sample, in sample order.
pub async fn submit_samples(
    engine: &Engine,
    req: GenerateRequest,
) -> Result<Vec<GenerationStream>, EngineError> {
    let engine = engine.clone();
    match tokio::task::spawn_blocking(move || engine.stream_samples(req)).await {
        Ok(r) => r,
        Err(_) => Err(EngineError::Stopped),
    }
}

/// When a call reached the service, stamped by [`stamp_arrival`] before
/// the request body is decoded.
///
/// The server does not run tonic's transport (whose own `grpc-timeout`
/// timer answers CANCELLED); the unary handler runs the deadline itself,
/// measured from this stamp, and answers DEADLINE_EXCEEDED.
#[derive(Debug, Clone, Copy)]
pub struct Arrival(pub Instant);

/// How much earlier than the client's deadline a unary call gives up: its
/// answer then also beats a client-side timer started before the request
/// was sent (loopback and scheduling latency).
pub const DEADLINE_MARGIN: Duration = Duration::from_millis(2);

/// The interceptor that stamps [`Arrival`].
#[allow(clippy::result_large_err)] // tonic's interceptor signature
pub fn stamp_arrival(mut req: Request<()>) -> Result<Request<()>, Status> {
    req.extensions_mut().insert(Arrival(Instant::now()));
    Ok(req)
}

/// The client's deadline for `req`, from its `grpc-timeout` header.
fn deadline<T>(req: &Request<T>) -> Option<Instant> {
    let timeout = parse_grpc_timeout(req.metadata().get("grpc-timeout")?.to_str().ok()?)?;
    let arrival = req
        .extensions()
        .get::<Arrival>()
        .map_or_else(Instant::now, |a| a.0);
    Some(arrival + timeout.saturating_sub(DEADLINE_MARGIN))
}

/// Parses a `grpc-timeout` value: up to 8 digits and a unit (H, M, S, m, u, n).
fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The engine's event streams of a request's samples as proto messages,
/// interleaved as they come (each message names its sample), ending once
/// every sample's stream has. Dropping it drops the engine streams and so
/// aborts the samples. A constrained (or point/detect) output that fails
/// mid-generation ends the call with a `Done` carrying
/// `FINISH_REASON_ERROR` (and the objects completed before it) and then the
/// error status; any other error ends it at once (the other samples are
/// aborted).
#[derive(Debug)]
pub struct ProtoStream {
    /// The samples whose streams have not ended.
    inner: Vec<GenerationStream>,
    /// Where the next poll starts, so no sample starves the others.
    next: usize,
    /// The status to end with after a failed output's final `Done`.
    pending_error: Option<Status>,
    /// Where the request's fields sit, for the names in its errors.
    scope: convert::FieldScope,
}

impl ProtoStream {
    /// Wraps a request's engine streams (one per sample); errors name the
    /// fields in `scope`.
    pub fn new(inner: Vec<GenerationStream>, scope: convert::FieldScope) -> Self {
        Self {
            inner,
            next: 0,
            pending_error: None,
            scope,
        }
    }
}

impl Stream for ProtoStream {
    type Item = Result<pb::StreamGenerateResponse, Status>;

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if let Some(status) = this.pending_error.take() {
            this.inner.clear();
            return Poll::Ready(Some(Err(status)));
        }
        let mut k = 0;
        while k < this.inner.len() {
            let i = (this.next + k) % this.inner.len();
            let item = match Pin::new(&mut this.inner[i]).poll_next(cx) {
                Poll::Pending => {
                    k += 1;
                    continue;
                }
                Poll::Ready(None) => {
                    this.inner.remove(i);
                    continue;
                }
                Poll::Ready(Some(item)) => item,
            };
            let index = this.inner[i].index();
            this.next = i + 1;
            return Poll::Ready(Some(match item {
                Ok(ev) => Ok(convert::stream_event(ev, index)),
                Err(e) => {
                    let status = convert::engine_status(&e, this.scope);
                    match e {
                        EngineError::ConstraintFailed { partial, .. }
                        | EngineError::SpatialFailed { partial, .. } => {
                            this.pending_error = Some(status);
                            let done = kestrel_engine::StreamEvent::Done(*partial);
                            Ok(convert::stream_event(done, index))
                        }
                        _ => {
                            this.inner.clear();
                            Err(status)
                        }
                    }
                }
            }));
        }
        if this.inner.is_empty() {
            Poll::Ready(None)
        } else {
            Poll::Pending
        }
    }
}

#[tonic::async_trait]
impl pb::kestrel_server::Kestrel for KestrelService {
    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::GenerateResponse>, Status> {
        let deadline = deadline(&request);
        let req = convert::generate_request(request.into_inner())?;
        let scope = convert::FieldScope::of(&req);
        let run = async {
            let streams = submit_samples(&self.engine, req)
                .await
                .map_err(|e| convert::engine_status(&e, scope))?;
            // The first failure ends the call; dropping the other streams
            // aborts their samples.
            let runs = streams.into_iter().map(|mut s| async move {
                s.finish()
                    .await
                    .map_err(|e| convert::engine_status(&e, scope))
            });
            futures_util::future::try_join_all(runs).await
        };
        let resp = match deadline {
            None => run.await?,
            // Dropping `run` drops the stream, which aborts the request.
            Some(d) => tokio::time::timeout_at(d.into(), run)
                .await
                .map_err(|_| Status::deadline_exceeded("the call's deadline passed"))??,
        };
        Ok(Response::new(convert::generate_responses(resp)))
    }

    type StreamGenerateStream = ProtoStream;

    async fn stream_generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::StreamGenerateStream>, Status> {
        let req = convert::generate_request(request.into_inner())?;
        let scope = convert::FieldScope::of(&req);
        let streams = submit_samples(&self.engine, req)
            .await
            .map_err(|e| convert::engine_status(&e, scope))?;
        Ok(Response::new(ProtoStream::new(streams, scope)))
    }

    async fn abort(
        &self,
        request: Request<pb::AbortRequest>,
    ) -> Result<Response<pb::AbortResponse>, Status> {
        let id = convert::abort_request(request.into_inner())?;
        let accepted = self.engine.abort(&id);
        Ok(Response::new(pb::AbortResponse { accepted }))
    }

    async fn tokenize(
        &self,
        request: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        let req = request.into_inner();
        let engine = self.engine.clone();
        let token_ids =
            tokio::task::spawn_blocking(move || engine.tokenize(&req.text, req.add_special_tokens))
                .await
                .map_err(|_| convert::engine_status(&EngineError::Stopped, Default::default()))?
                .map_err(|e| convert::engine_status(&e, Default::default()))?;
        Ok(Response::new(pb::TokenizeResponse { token_ids }))
    }

    async fn detokenize(
        &self,
        request: Request<pb::DetokenizeRequest>,
    ) -> Result<Response<pb::DetokenizeResponse>, Status> {
        let req = request.into_inner();
        let engine = self.engine.clone();
        let text = tokio::task::spawn_blocking(move || {
            engine.detokenize(&req.token_ids, req.skip_special_tokens)
        })
        .await
        .map_err(|_| convert::engine_status(&EngineError::Stopped, Default::default()))?
        .map_err(|e| convert::engine_status(&e, Default::default()))?;
        Ok(Response::new(pb::DetokenizeResponse { text }))
    }

    async fn model_info(
        &self,
        _request: Request<pb::ModelInfoRequest>,
    ) -> Result<Response<pb::ModelInfoResponse>, Status> {
        Ok(Response::new(convert::model_info(self.engine.model_info())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse() {
        assert_eq!(parse_grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(
            parse_grpc_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        assert_eq!(parse_grpc_timeout("2H"), Some(Duration::from_secs(7200)));
        for bad in ["", "S", "5", "5x", "123456789S", "-1S"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad}");
        }
    }
}
