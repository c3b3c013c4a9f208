//! The two `SequenceSkill`s the runtime-level point / detect tests drive
//! the real pipeline loop with: [`Reporting`] (a `SpatialSkill` whose
//! output is handed out when the pipeline finishes it) and [`Record`] (a
//! text request's tokens), plus the self-repeating text prompt that makes
//! prompt lookup draft at once.

use std::sync::{Arc, Mutex};

use kestrel_pipeline::{CommittedToken, Outcome, SequenceSkill, TokenId, TokenMask, Verdict};
use kestrel_skills::{SpatialOutput, SpatialSkill};

/// Hands the skill's output out when the pipeline finishes it.
pub struct Reporting(pub SpatialSkill, pub Arc<Mutex<Option<SpatialOutput>>>);

impl SequenceSkill for Reporting {
    fn consume(&mut self, token: &CommittedToken<'_>) -> Verdict {
        self.0.consume(token)
    }
    fn is_constrained(&self) -> bool {
        self.0.is_constrained()
    }
    fn fill_mask(&mut self, mask: &mut TokenMask<'_>) {
        self.0.fill_mask(mask)
    }
    fn finish(&mut self, outcome: Outcome) {
        self.0.finish(outcome);
        let out = self.0.result().expect("finished");
        *self.1.lock().unwrap() = Some(out.expect("no step refused under the skill's mask"));
    }
}

/// Records a text request's tokens.
pub struct Record(pub Arc<Mutex<Vec<TokenId>>>);

impl SequenceSkill for Record {
    fn consume(&mut self, t: &CommittedToken<'_>) -> Verdict {
        self.0.lock().unwrap().push(t.token);
        Verdict::Continue
    }
    fn finish(&mut self, outcome: Outcome) {
        assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}");
    }
}

/// A text prompt that repeats itself, so prompt lookup drafts at once.
pub fn text_prompt() -> Vec<TokenId> {
    let mut p = vec![0];
    for _ in 0..5 {
        p.extend([100, 2000, 30_000]);
    }
    p
}
