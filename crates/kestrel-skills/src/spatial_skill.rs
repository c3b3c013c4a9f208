//! [`SpatialSkill`]: `point` / `detect` as a [`SequenceSkill`], the
//! pipeline's view of a [`SpatialState`] (docs/moondream.md, "Spatial
//! decode in the step", point 4).
//!
//! Every step is constrained by the state's mask; each committed token
//! arrives with the coordinate and size the runtime's spatial stage decoded
//! beside it (`CommittedToken::{coord, size}`) and is fed to
//! [`SpatialState::step`]. A step the state refuses (impossible under its
//! own mask, so a runtime or pipeline fault) stops the request and ends it
//! as a [`SpatialFailure`] whose source is the typed [`SpatialError`]. Per
//! step: O(1), no allocation but the token list's and the result's growth.

use kestrel_pipeline::{
    CommittedToken, FinishReason, Outcome, SequenceSkill, TokenId, TokenMask, Verdict,
};

use crate::skill::SkillPhase;
use crate::spatial::{SpatialError, SpatialResult, SpatialSpec, SpatialState, SpatialStepOutput};

/// A finished spatial request's output.
#[derive(Debug, Clone, PartialEq)]
pub struct SpatialOutput {
    /// The completed objects (a half-decoded one is not one).
    pub objects: SpatialResult,
    /// Every committed token, a final EOS included.
    pub token_ids: Vec<TokenId>,
    /// How the request ended (a failed step of the runtime included).
    pub outcome: Outcome,
}

/// A spatial request whose output broke the point / detect cycle: the
/// objects completed before it, and the refused step as the source.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the spatial output was refused after {} complete objects", objects.len())]
pub struct SpatialFailure {
    pub objects: SpatialResult,
    #[source]
    pub cause: SpatialError,
}

/// One `point` or `detect` request's skill.
#[derive(Debug, Clone)]
pub struct SpatialSkill {
    state: SpatialState,
    tokens: Vec<TokenId>,
    phase: SkillPhase,
    error: Option<SpatialError>,
}

impl SpatialSkill {
    /// A skill for a validated spec (`SpatialSpec::new` refuses a bad one).
    pub fn new(spec: SpatialSpec) -> Self {
        SpatialSkill {
            state: SpatialState::new(spec),
            tokens: Vec::new(),
            phase: SkillPhase::Running,
            error: None,
        }
    }

    pub fn phase(&self) -> &SkillPhase {
        &self.phase
    }

    /// The objects completed so far (for streaming one object per event).
    pub fn objects(&self) -> &SpatialResult {
        self.state.result()
    }

    pub fn token_ids(&self) -> &[TokenId] {
        &self.tokens
    }

    /// The step the state refused, once one was.
    pub fn error(&self) -> Option<&SpatialError> {
        self.error.as_ref()
    }

    /// The final output; `None` until `finish` was called, a
    /// [`SpatialFailure`] when a step was refused.
    pub fn result(&self) -> Option<Result<SpatialOutput, SpatialFailure>> {
        let SkillPhase::Finished(outcome) = &self.phase else {
            return None;
        };
        let objects = self.state.result().clone();
        Some(match &self.error {
            Some(cause) => Err(SpatialFailure {
                objects,
                cause: cause.clone(),
            }),
            None => Ok(SpatialOutput {
                objects,
                token_ids: self.tokens.clone(),
                outcome: outcome.clone(),
            }),
        })
    }
}

impl SequenceSkill for SpatialSkill {
    fn consume(&mut self, token: &CommittedToken<'_>) -> Verdict {
        if let Some(v) = self.phase.refuse_after_stop() {
            return v;
        }
        self.tokens.push(token.token);
        let out = SpatialStepOutput {
            token: token.token,
            coord: token.coord,
            size: token.size,
        };
        let verdict = match self.state.step(&out) {
            Ok(v) => v,
            Err(e) => {
                self.error = Some(e);
                Verdict::Stop(FinishReason::Stop)
            }
        };
        if let Verdict::Stop(reason) = verdict {
            self.phase = SkillPhase::Stopped(reason);
        }
        verdict
    }

    /// Every step of a running spatial sequence is constrained.
    fn is_constrained(&self) -> bool {
        self.phase == SkillPhase::Running
    }

    fn fill_mask(&mut self, mask: &mut TokenMask<'_>) {
        if self.is_constrained() {
            self.state.fill_mask(mask);
        } else {
            // Zombie rule: a finalized sequence is sampled unconstrained.
            mask.allow_all();
        }
    }

    fn finish(&mut self, outcome: Outcome) {
        debug_assert!(
            !matches!(self.phase, SkillPhase::Finished(_)),
            "finish called twice"
        );
        self.phase = SkillPhase::Finished(outcome);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spatial::{BoundingBox, Point, SpatialIds, SpatialKind, Stage};
    use std::error::Error as _;

    const IDS: SpatialIds = SpatialIds {
        coord: 5,
        size: 6,
        eos: 0,
    };
    const VOCAB: usize = 40;

    fn skill(kind: SpatialKind, max: u32) -> SpatialSkill {
        SpatialSkill::new(SpatialSpec::new(kind, IDS, max).unwrap())
    }

    fn commit(s: &mut SpatialSkill, token: TokenId, coord: f32, size: [f32; 2]) -> Verdict {
        s.consume(&CommittedToken {
            token,
            logprob: None,
            top_logprobs: &[],
            coord,
            size,
        })
    }

    fn allowed(s: &mut SpatialSkill) -> Vec<TokenId> {
        let mut words = vec![0u32; TokenMask::words_for(VOCAB)];
        let mut mask = TokenMask::new(&mut words, VOCAB);
        s.fill_mask(&mut mask);
        (0..VOCAB as TokenId)
            .filter(|&t| mask.is_allowed(t))
            .collect()
    }

    #[test]
    fn point_reads_each_coordinate_from_its_own_token() {
        let mut s = skill(SpatialKind::Point, 50);
        assert!(s.is_constrained());
        assert_eq!(allowed(&mut s), vec![IDS.eos, IDS.coord]);
        // The size and the other value are junk a runtime writes anyway.
        assert_eq!(commit(&mut s, 5, 0.25, [0.9, 0.9]), Verdict::Continue);
        assert_eq!(allowed(&mut s), vec![IDS.coord]);
        assert_eq!(commit(&mut s, 5, 0.75, [0.1, 0.1]), Verdict::Continue);
        assert_eq!(
            commit(&mut s, 0, 0.5, [0.5, 0.5]),
            Verdict::Stop(FinishReason::Eos)
        );
        assert!(!s.is_constrained());
        assert_eq!(
            allowed(&mut s).len(),
            VOCAB,
            "zombie rows are unconstrained"
        );
        assert!(s.result().is_none(), "no result before finish");
        s.finish(Outcome::Finished(FinishReason::Eos));
        let out = s.result().unwrap().unwrap();
        assert_eq!(
            out.objects,
            SpatialResult::Points(vec![Point { x: 0.25, y: 0.75 }])
        );
        assert_eq!(out.token_ids, vec![5, 5, 0]);
        assert_eq!(out.outcome, Outcome::Finished(FinishReason::Eos));
    }

    #[test]
    fn detect_builds_boxes_and_stops_at_max_objects() {
        let mut s = skill(SpatialKind::Detect, 2);
        for (x, y, w) in [(0.5, 0.5, 0.25), (0.125, 0.875, 0.5)] {
            assert_eq!(commit(&mut s, 5, x, [0.0, 0.0]), Verdict::Continue);
            assert_eq!(commit(&mut s, 5, y, [0.0, 0.0]), Verdict::Continue);
            assert_eq!(allowed(&mut s), vec![IDS.size]);
            let v = commit(&mut s, 6, 0.0, [w, w]);
            let done = s.objects().len() == 2;
            assert_eq!(
                v,
                match done {
                    true => Verdict::Stop(FinishReason::Length),
                    false => Verdict::Continue,
                }
            );
        }
        s.finish(Outcome::Finished(FinishReason::Length));
        let out = s.result().unwrap().unwrap();
        assert_eq!(
            out.objects,
            SpatialResult::Boxes(vec![
                BoundingBox::from_centre(0.5, 0.5, [0.25, 0.25]),
                BoundingBox::from_centre(0.125, 0.875, [0.5, 0.5]),
            ])
        );
        // Clamped at the image's edges.
        let SpatialResult::Boxes(b) = &out.objects else {
            unreachable!()
        };
        assert_eq!(b[1].x_min, 0.0);
        assert_eq!(b[1].y_max, 1.0);
    }

    #[test]
    fn a_length_cap_mid_object_keeps_only_complete_objects() {
        let mut s = skill(SpatialKind::Detect, 50);
        commit(&mut s, 5, 0.5, [0.0; 2]);
        commit(&mut s, 5, 0.5, [0.0; 2]);
        commit(&mut s, 6, 0.0, [0.5, 0.5]);
        commit(&mut s, 5, 0.1, [0.0; 2]);
        // max_new_tokens reached between a coordinate and its size.
        s.finish(Outcome::Finished(FinishReason::Length));
        let out = s.result().unwrap().unwrap();
        assert_eq!(out.objects.len(), 1);
        assert_eq!(out.outcome, Outcome::Finished(FinishReason::Length));
    }

    #[test]
    fn a_refused_step_fails_with_the_typed_cause() {
        let mut s = skill(SpatialKind::Point, 50);
        commit(&mut s, 5, 0.5, [0.0; 2]);
        commit(&mut s, 5, 0.5, [0.0; 2]);
        // A text token where the x stage allows only coord or EOS.
        assert_eq!(
            commit(&mut s, 17, 0.5, [0.0; 2]),
            Verdict::Stop(FinishReason::Stop)
        );
        assert!(!s.is_constrained());
        s.finish(Outcome::Finished(FinishReason::Stop));
        let failure = s.result().unwrap().unwrap_err();
        assert_eq!(failure.objects.len(), 1);
        let cause = failure
            .source()
            .and_then(|e| e.downcast_ref::<SpatialError>())
            .expect("the SpatialError is the source");
        assert_eq!(
            cause,
            &SpatialError::Unexpected {
                stage: Stage::X,
                allowed: vec![IDS.coord, IDS.eos],
                got: 17,
            }
        );
        assert_eq!(s.error(), Some(cause));
    }

    #[test]
    fn a_value_out_of_range_fails_with_the_typed_cause() {
        let mut s = skill(SpatialKind::Detect, 50);
        commit(&mut s, 5, 0.5, [0.0; 2]);
        commit(&mut s, 5, 0.5, [0.0; 2]);
        commit(&mut s, 6, 0.0, [0.0, 0.5]);
        s.finish(Outcome::Finished(FinishReason::Stop));
        let failure = s.result().unwrap().unwrap_err();
        assert!(matches!(
            failure.cause,
            SpatialError::SizeOutOfRange { value: [0.0, 0.5] }
        ));
        assert!(failure.objects.is_empty());
    }
}
