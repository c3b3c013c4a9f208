//! kestrel-engine: the engine thread that owns a runtime and the pipeline
//! loop, and the async submit/stream API Rust callers (the gRPC server, the
//! CLI) use.
//!
//! **Architecture invariant:** one engine thread owns `EngineLoop<R>` and so
//! every piece of device and KV state; [`Engine`] handles reach it only
//! through command channels, and results come back through per-request
//! channels. Requests are validated (rendered, tokenized, constraint
//! compiled, context checked) on the caller's thread before anything is
//! queued. Request semantics (EOS, stop strings, constraints, streaming
//! deltas) belong to `kestrel-skills`; this crate only routes them.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kestrel_engine::EngineError> {
//! use kestrel_engine::{Engine, EngineConfig, GenerateRequest};
//! let engine = Engine::start(EngineConfig::default(), |_| {})?;
//! let resp = engine.generate(GenerateRequest::text("Hello", 16)).await?;
//! println!("{}", resp.text);
//! engine.shutdown(std::time::Duration::from_secs(5)).await;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

mod backend;
mod config;
mod engine;
mod error;
mod metrics;
mod model;
mod request;
mod skill;
pub mod validate;
mod worker;

pub use config::{
    Backend, EngineConfig, ImageSettings, LoadEvent, ModelSource, DEFAULT_PREFILL_CHUNK,
};
pub use engine::{mode_name, Engine, GenerationStream};
pub use error::{error_causes, error_chain, EngineError};
pub use model::{
    Health, ImageStats, KvStats, ModelContext, ModelContextConfig, ModelInfo, Runtime,
    VisionContext,
};
pub use request::{
    BoundingBox, CaptionLength, ChatMessage, Constraint, FinishReason, GenerateRequest,
    GenerateResponse, Point, Prompt, SamplingOptions, SpatialObject, SpatialResult, Speculation,
    StreamEvent, Timings, TokenLogprob, ToolCall, UnknownCaptionLength, Usage, VisionTask,
    MAX_DRAFT,
};
pub use validate::{seed_for_request_id, Field};

pub use kestrel_cpu::{Numerics, WeightPages};
pub use kestrel_pipeline::{Cause, LoopConfig, PipelineMode, PrefillPolicy};
/// The cause of [`EngineError::SpatialFailed`].
pub use kestrel_skills::{SpatialError, SpatialFailure};
