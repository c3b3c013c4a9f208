//! kestrel-skills: the per-request skills the pipeline drives.
//!
//! A [`Skill`] consumes each committed token, decides when its request is
//! done, may restrict the next token with a bitmask, streams text deltas and
//! builds the final [`SkillResult`]. Kinds ([`SkillSpec`]): free text with
//! stop strings / stop ids / EOS, and JSON-schema, regex, choice and Lark
//! grammar outputs constrained with llguidance; [`SpatialSkill`] is
//! Moondream's `point` / `detect` (points or boxes from the coordinate and
//! size values committed with each token). Per-model state lives in a
//! shared [`SkillContext`]. [`ParallelMasks`] is the pipeline's
//! `MaskFiller` that computes a step's masks on rayon's pool, and
//! [`fill_batch_masks`] does the same for callers without the pipeline.
//! **Architecture invariant:** no model, runtime or
//! scheduler code here; the only contract is `kestrel_pipeline::SequenceSkill`.
#![forbid(unsafe_code)]

mod batch;
mod context;
mod detok;
mod error;
mod output;
mod repeat;
mod skill;
mod spatial;
mod spatial_skill;
mod spec;
mod stop;
pub mod testing;
mod vocab;

pub use batch::{fill_batch_masks, ParallelMasks};
pub use context::{
    ChatMessage, ChatMlTemplate, ChatTemplate, Prompt, SkillContext, SkillContextConfig,
    PARSER_LIMITS,
};
pub use detok::Utf8Decoder;
pub use error::{BoxedCause, ConstraintCause, ConstraintFailure, SkillError, TooComplex};
pub use output::{StreamDelta, TokenLogprob};
pub use repeat::{looping_tail, LOOP_MAX_PERIOD, LOOP_MIN_REPEATS, LOOP_MIN_TOKENS};
pub use skill::{Skill, SkillPhase, SkillResult};
pub use spatial::{
    BoundingBox, Point, SpatialError, SpatialIds, SpatialKind, SpatialResult, SpatialSpec,
    SpatialState, SpatialStepOutput, Stage,
};
pub use spatial_skill::{SpatialFailure, SpatialOutput, SpatialSkill};
pub use spec::{LexerBudget, SkillKind, SkillOptions, SkillSpec, LEXER_BUDGET};
pub use stop::StopStrings;
