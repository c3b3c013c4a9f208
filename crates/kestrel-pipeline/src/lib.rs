//! kestrel-pipeline: the pipelined decode state machine (work in progress).
#![forbid(unsafe_code)]

pub mod skill;

/// A vocabulary index.
pub type TokenId = u32;

pub use skill::{CommittedToken, FailureKind, FinishReason, Outcome, SequenceSkill, TokenMask, Verdict};
