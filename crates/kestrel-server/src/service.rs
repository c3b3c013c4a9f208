//! [`KestrelService`]: the `kestrel.v1.Kestrel` gRPC handlers, a thin async
//! shell over an [`Engine`] handle.
//!
//! Each handler converts the request (see [`crate::convert`]), makes one
//! engine call and converts the result. Cancellation is by drop: when a
//! client goes away tonic drops the handler future or the response stream,
//! which drops the engine's `GenerationStream`, which aborts the request.

use std::pin::Pin;

use kestrel_engine::{Engine, GenerationStream};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::convert::{self, Limits};
use crate::pb;

/// The `kestrel.v1.Kestrel` service over one engine.
#[derive(Debug, Clone)]
pub struct KestrelService {
    engine: Engine,
    limits: Limits,
}

impl KestrelService {
    /// Serves `engine`; request limits come from its model.
    pub fn new(engine: Engine) -> Self {
        let limits = Limits::from_model_info(&engine.model_info());
        Self { engine, limits }
    }

    /// The limits requests are validated against.
    pub fn limits(&self) -> Limits {
        self.limits
    }
}

/// The engine's event stream as proto messages. Dropping it drops the
/// engine stream and so aborts the request.
#[derive(Debug)]
pub struct ProtoStream {
    inner: GenerationStream,
}

impl ProtoStream {
    /// Wraps an engine stream.
    pub fn new(inner: GenerationStream) -> Self {
        Self { inner }
    }
}

impl Stream for ProtoStream {
    type Item = Result<pb::StreamGenerateResponse, Status>;

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        Pin::new(&mut self.get_mut().inner)
            .poll_next(cx)
            .map(|item| {
                item.map(|r| {
                    r.map(convert::stream_event)
                        .map_err(|e| convert::engine_status(&e))
                })
            })
    }
}

#[tonic::async_trait]
impl pb::kestrel_server::Kestrel for KestrelService {
    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::GenerateResponse>, Status> {
        let req = convert::generate_request(request.into_inner(), &self.limits)?;
        let resp = self
            .engine
            .generate(req)
            .await
            .map_err(|e| convert::engine_status(&e))?;
        Ok(Response::new(convert::generate_response(resp)))
    }

    type StreamGenerateStream = ProtoStream;

    async fn stream_generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::StreamGenerateStream>, Status> {
        let req = convert::generate_request(request.into_inner(), &self.limits)?;
        let stream = self
            .engine
            .stream(req)
            .map_err(|e| convert::engine_status(&e))?;
        Ok(Response::new(ProtoStream::new(stream)))
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
        let token_ids = self
            .engine
            .tokenize(&req.text, req.add_special_tokens)
            .map_err(|e| convert::engine_status(&e))?;
        Ok(Response::new(pb::TokenizeResponse { token_ids }))
    }

    async fn detokenize(
        &self,
        request: Request<pb::DetokenizeRequest>,
    ) -> Result<Response<pb::DetokenizeResponse>, Status> {
        let req = request.into_inner();
        convert::token_ids_in_vocab("token_ids", &req.token_ids, &self.limits)?;
        let text = self
            .engine
            .detokenize(&req.token_ids, req.skip_special_tokens)
            .map_err(|e| convert::engine_status(&e))?;
        Ok(Response::new(pb::DetokenizeResponse { text }))
    }

    async fn model_info(
        &self,
        _request: Request<pb::ModelInfoRequest>,
    ) -> Result<Response<pb::ModelInfoResponse>, Status> {
        Ok(Response::new(convert::model_info(self.engine.model_info())))
    }
}
