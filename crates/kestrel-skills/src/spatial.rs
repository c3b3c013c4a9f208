//! The spatial skills `point` and `detect` (Moondream; docs/moondream.md,
//! "Region model" and "Spatial decode in the step"): the per-sequence state
//! machine that says what each step must emit and builds the points or
//! boxes.
//!
//! Every step of a spatial sequence samples one token id under this state's
//! mask, and the runtime decodes, for every row, a coordinate and a size
//! from the same last hidden state; the sampled id says which value is
//! meant (`coord_id`: the coordinate, `size_id`: the size, anything else:
//! none). One step's row is a [`SpatialStepOutput`], the RenderBuffer's
//! `(token_ids, coord_values, size_values)` for that sequence. The cycle,
//! as the published loop (`_generate_points`) and the seed system's skills
//! run it:
//!
//! - `x`: `coord_id` (a new object's x) or `eos` (done);
//! - `y`: `coord_id`;
//! - `size` (detect only): `size_id`;
//!
//! then back to `x`. After `max_objects` objects the request stops at once
//! ([`FinishReason::Length`]); the reference runs one more forward there and
//! discards its token, which changes no result. The scheduler never looks
//! inside: it sees a constrained skill with a mask, and the runtime keys
//! the next input embedding on the sampled id alone.
//!
//! A box is the centre +/- size / 2, clamped to `[0, 1]` as the seed
//! system's `detect` does (the `vikhyat/moondream` loop leaves it
//! unclamped). A step that breaks the cycle or carries a value out of range
//! is refused with a [`SpatialError`] and leaves the state as it was.

use kestrel_pipeline::{FinishReason, TokenId, TokenMask, Verdict};

/// Which spatial skill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpatialKind {
    /// Points `{x, y}`: x, y per object.
    Point,
    /// Boxes: x, y, size per object.
    Detect,
}

/// The model's spatial token ids (Moondream 2's 2025 vocabulary: coord 5,
/// size 6, EOS 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpatialIds {
    pub coord: TokenId,
    pub size: TokenId,
    pub eos: TokenId,
}

/// Why a spatial skill could not be built, or why a step was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpatialError {
    /// `max_objects` must be at least 1.
    #[error("max_objects must be at least 1")]
    NoObjectsAllowed,
    /// Two of the model's spatial ids (coord, size, EOS) coincide.
    #[error("the model's coord, size and end-of-sequence ids must differ ({ids:?})")]
    AmbiguousIds { ids: SpatialIds },
    /// A step emitted an id the current stage does not allow.
    #[error("the {stage:?} stage allows only {allowed:?}, got token {got}")]
    Unexpected {
        stage: Stage,
        allowed: Vec<TokenId>,
        got: TokenId,
    },
    /// A coordinate outside `[0, 1]` (or not a number).
    #[error("coordinate {value} is outside [0, 1]")]
    CoordOutOfRange { value: f32 },
    /// A width or height outside `(0, 1]` (or not a number).
    #[error("size {value:?} is outside (0, 1]")]
    SizeOutOfRange { value: [f32; 2] },
    /// A step arrived after the skill stopped.
    #[error("the spatial skill already stopped ({reason:?})")]
    Stopped { reason: FinishReason },
}

/// What the next step must emit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// A new object's x coordinate, or the end.
    X,
    /// The object's y coordinate.
    Y,
    /// The object's width and height (detect).
    Size,
}

/// A validated spatial request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpatialSpec {
    kind: SpatialKind,
    ids: SpatialIds,
    max_objects: u32,
}

impl SpatialSpec {
    /// Checks `max_objects >= 1` and that the ids are distinct.
    pub fn new(kind: SpatialKind, ids: SpatialIds, max_objects: u32) -> Result<Self, SpatialError> {
        if max_objects == 0 {
            return Err(SpatialError::NoObjectsAllowed);
        }
        if ids.coord == ids.size || ids.coord == ids.eos || ids.size == ids.eos {
            return Err(SpatialError::AmbiguousIds { ids });
        }
        Ok(SpatialSpec {
            kind,
            ids,
            max_objects,
        })
    }

    pub fn kind(&self) -> SpatialKind {
        self.kind
    }

    pub fn max_objects(&self) -> u32 {
        self.max_objects
    }
}

/// One step's output for one sequence, as the step's RenderBuffer carries
/// it: the sampled id and the values decoded from the same hidden state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpatialStepOutput {
    pub token: TokenId,
    /// Meaningful when `token` is the coord id.
    pub coord: f32,
    /// `[width, height]`; meaningful when `token` is the size id.
    pub size: [f32; 2],
}

/// A point, normalized to the image: `[0, 1]` each.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    pub x: f32,
    pub y: f32,
}

/// A box, normalized to the image and clamped to `[0, 1]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BoundingBox {
    pub x_min: f32,
    pub y_min: f32,
    pub x_max: f32,
    pub y_max: f32,
}

impl BoundingBox {
    /// The box of centre `(x, y)` and size `[w, h]`, clamped to `[0, 1]`.
    pub fn from_centre(x: f32, y: f32, [w, h]: [f32; 2]) -> Self {
        BoundingBox {
            x_min: (x - w / 2.0).max(0.0),
            y_min: (y - h / 2.0).max(0.0),
            x_max: (x + w / 2.0).min(1.0),
            y_max: (y + h / 2.0).min(1.0),
        }
    }
}

/// A spatial request's result so far.
#[derive(Debug, Clone, PartialEq)]
pub enum SpatialResult {
    Points(Vec<Point>),
    Boxes(Vec<BoundingBox>),
}

impl SpatialResult {
    pub fn len(&self) -> usize {
        match self {
            SpatialResult::Points(p) => p.len(),
            SpatialResult::Boxes(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One spatial sequence's state. Per step: O(1), no allocation but the
/// result's growth.
#[derive(Debug, Clone)]
pub struct SpatialState {
    spec: SpatialSpec,
    stage: Stage,
    x: f32,
    y: f32,
    result: SpatialResult,
    stopped: Option<FinishReason>,
}

impl SpatialState {
    pub fn new(spec: SpatialSpec) -> Self {
        let result = match spec.kind {
            SpatialKind::Point => SpatialResult::Points(Vec::new()),
            SpatialKind::Detect => SpatialResult::Boxes(Vec::new()),
        };
        SpatialState {
            spec,
            stage: Stage::X,
            x: 0.0,
            y: 0.0,
            result,
            stopped: None,
        }
    }

    /// What the next step must emit; `None` once stopped.
    pub fn stage(&self) -> Option<Stage> {
        match self.stopped {
            Some(_) => None,
            None => Some(self.stage),
        }
    }

    /// The ids the next step may sample (empty once stopped).
    pub fn allowed(&self) -> Vec<TokenId> {
        let ids = self.spec.ids;
        match self.stage() {
            None => Vec::new(),
            Some(Stage::X) => vec![ids.coord, ids.eos],
            Some(Stage::Y) => vec![ids.coord],
            Some(Stage::Size) => vec![ids.size],
        }
    }

    /// The next step's mask: exactly [`SpatialState::allowed`]. A stopped
    /// state (a zombie row) allows everything, as the text skills do.
    pub fn fill_mask(&self, mask: &mut TokenMask<'_>) {
        if self.stopped.is_some() {
            mask.allow_all();
            return;
        }
        let ids = self.spec.ids;
        mask.clear();
        match self.stage {
            Stage::X => {
                mask.allow(ids.coord);
                mask.allow(ids.eos);
            }
            Stage::Y => mask.allow(ids.coord),
            Stage::Size => mask.allow(ids.size),
        }
    }

    /// Consumes one step's output. A refused step changes nothing.
    pub fn step(&mut self, out: &SpatialStepOutput) -> Result<Verdict, SpatialError> {
        if let Some(reason) = self.stopped {
            return Err(SpatialError::Stopped { reason });
        }
        let ids = self.spec.ids;
        let unexpected = || SpatialError::Unexpected {
            stage: self.stage,
            allowed: self.allowed(),
            got: out.token,
        };
        let coord = || {
            if (0.0..=1.0).contains(&out.coord) {
                Ok(out.coord)
            } else {
                Err(SpatialError::CoordOutOfRange { value: out.coord })
            }
        };
        match self.stage {
            Stage::X if out.token == ids.eos => {
                self.stopped = Some(FinishReason::Eos);
                return Ok(Verdict::Stop(FinishReason::Eos));
            }
            Stage::X if out.token == ids.coord => {
                self.x = coord()?;
                self.stage = Stage::Y;
                return Ok(Verdict::Continue);
            }
            Stage::Y if out.token == ids.coord => {
                self.y = coord()?;
                match &mut self.result {
                    SpatialResult::Points(p) => p.push(Point {
                        x: self.x,
                        y: self.y,
                    }),
                    SpatialResult::Boxes(_) => {
                        self.stage = Stage::Size;
                        return Ok(Verdict::Continue);
                    }
                }
            }
            Stage::Size if out.token == ids.size => {
                if !out.size.iter().all(|v| *v > 0.0 && *v <= 1.0) {
                    return Err(SpatialError::SizeOutOfRange { value: out.size });
                }
                let b = BoundingBox::from_centre(self.x, self.y, out.size);
                match &mut self.result {
                    SpatialResult::Boxes(boxes) => boxes.push(b),
                    SpatialResult::Points(_) => unreachable!("a point sequence has no size stage"),
                }
            }
            _ => return Err(unexpected()),
        }
        // An object is complete.
        self.stage = Stage::X;
        if self.result.len() >= self.spec.max_objects as usize {
            self.stopped = Some(FinishReason::Length);
            return Ok(Verdict::Stop(FinishReason::Length));
        }
        Ok(Verdict::Continue)
    }

    /// The objects completed so far (a half-decoded object is not one).
    pub fn result(&self) -> &SpatialResult {
        &self.result
    }
}

#[cfg(test)]
mod tests {
    //! The state machine against a reference model written differently: the
    //! stage of emission `i` is `i mod 2` (point) or `i mod 3` (detect), the
    //! objects are read off a finished list. Sabotage check (done by hand
    //! when this was written): making detect's `Y` go to `X` instead of
    //! `Size` fails `legal_sequences_are_accepted` (the size step refused),
    //! and dropping the `max_objects` stop fails it too (no `Length` stop).
    use super::*;
    use proptest::prelude::*;

    const IDS: SpatialIds = SpatialIds {
        coord: 5,
        size: 6,
        eos: 0,
    };
    const VOCAB: usize = 40;

    /// An emission of the reference model.
    #[derive(Debug, Clone, Copy)]
    enum E {
        Coord(f32),
        Size(f32, f32),
        Token(TokenId),
    }

    fn row(e: E) -> SpatialStepOutput {
        // The values a runtime writes for every row, meaningful or not.
        let junk = SpatialStepOutput {
            token: 0,
            coord: 0.37,
            size: [0.11, 0.22],
        };
        match e {
            E::Coord(c) => SpatialStepOutput {
                token: IDS.coord,
                coord: c,
                ..junk
            },
            E::Size(w, h) => SpatialStepOutput {
                token: IDS.size,
                size: [w, h],
                ..junk
            },
            E::Token(t) => SpatialStepOutput { token: t, ..junk },
        }
    }

    /// The reference: which ids emission `i` (0-based, after the prompt)
    /// may carry.
    fn expected_ids(kind: SpatialKind, i: usize) -> Vec<TokenId> {
        let cycle = if kind == SpatialKind::Point { 2 } else { 3 };
        match i % cycle {
            0 => vec![IDS.coord, IDS.eos],
            1 => vec![IDS.coord],
            _ => vec![IDS.size],
        }
    }

    fn coord_value() -> impl Strategy<Value = f32> {
        (0u32..1024).prop_map(|b| b as f32 / 1024.0)
    }

    fn size_value() -> impl Strategy<Value = f32> {
        (0u32..1024).prop_map(|b| 2f32.powf(b as f32 / 1023.0 * 10.0 - 10.0))
    }

    type Object = (f32, f32, f32, f32);

    fn case() -> impl Strategy<Value = (SpatialKind, u32, Vec<Object>)> {
        (
            prop_oneof![Just(SpatialKind::Point), Just(SpatialKind::Detect)],
            1u32..5,
            prop::collection::vec(
                (coord_value(), coord_value(), size_value(), size_value()),
                0..7,
            ),
        )
    }

    /// The emissions of a legal run and the result the reference expects.
    fn legal(
        kind: SpatialKind,
        max: u32,
        objects: &[Object],
    ) -> (Vec<E>, SpatialResult, FinishReason) {
        let n = objects.len().min(max as usize);
        let mut es = Vec::new();
        for &(x, y, w, h) in &objects[..n] {
            es.push(E::Coord(x));
            es.push(E::Coord(y));
            if kind == SpatialKind::Detect {
                es.push(E::Size(w, h));
            }
        }
        let reason = if n == max as usize {
            FinishReason::Length
        } else {
            es.push(E::Token(IDS.eos));
            FinishReason::Eos
        };
        let result = match kind {
            SpatialKind::Point => SpatialResult::Points(
                objects[..n]
                    .iter()
                    .map(|o| Point { x: o.0, y: o.1 })
                    .collect(),
            ),
            SpatialKind::Detect => SpatialResult::Boxes(
                objects[..n]
                    .iter()
                    .map(|&(x, y, w, h)| BoundingBox {
                        x_min: f32::max(x - w * 0.5, 0.0),
                        y_min: f32::max(y - h * 0.5, 0.0),
                        x_max: f32::min(x + w * 0.5, 1.0),
                        y_max: f32::min(y + h * 0.5, 1.0),
                    })
                    .collect(),
            ),
        };
        (es, result, reason)
    }

    fn state(kind: SpatialKind, max: u32) -> SpatialState {
        SpatialState::new(SpatialSpec::new(kind, IDS, max).unwrap())
    }

    proptest! {
        #[test]
        fn legal_sequences_are_accepted((kind, max, objects) in case()) {
            let (es, want, reason) = legal(kind, max, &objects);
            let mut s = state(kind, max);
            for (i, e) in es.iter().enumerate() {
                let mut words = vec![0u32; TokenMask::words_for(VOCAB)];
                s.fill_mask(&mut TokenMask::new(&mut words, VOCAB));
                let mask = TokenMask::new(&mut words, VOCAB);
                let allowed: Vec<TokenId> =
                    (0..VOCAB as TokenId).filter(|t| mask.is_allowed(*t)).collect();
                let mut expected = expected_ids(kind, i);
                expected.sort_unstable();
                prop_assert_eq!(&allowed, &expected, "mask at emission {}", i);
                let v = s.step(&row(*e)).unwrap();
                let last = i + 1 == es.len();
                prop_assert_eq!(v, if last { Verdict::Stop(reason) } else { Verdict::Continue });
            }
            prop_assert_eq!(s.stage(), None);
            prop_assert_eq!(s.result(), &want);
            let after = s.step(&row(E::Token(IDS.eos)));
            prop_assert!(matches!(after, Err(SpatialError::Stopped { reason: r }) if r == reason),
                "after the stop: {:?}", after);
        }

        #[test]
        fn illegal_steps_are_refused_and_change_nothing(
            (kind, max, objects) in case(),
            at in any::<prop::sample::Index>(),
            bad in 0..VOCAB as TokenId,
        ) {
            let (es, want, _) = legal(kind, max, &objects);
            let i = at.index(es.len());
            let mut s = state(kind, max);
            for e in &es[..i] {
                s.step(&row(*e)).unwrap();
            }
            let before = (s.stage(), s.result().clone());
            // A run cut here (cancelled, say between a coordinate and its
            // size) holds only its completed objects.
            let cycle = if kind == SpatialKind::Point { 2 } else { 3 };
            prop_assert_eq!(before.1.len(), i / cycle);
            let expected = expected_ids(kind, i);
            if !expected.contains(&bad) {
                let err = s.step(&row(E::Token(bad))).unwrap_err();
                prop_assert!(
                    matches!(&err, SpatialError::Unexpected { got, allowed, .. }
                        if *got == bad && *allowed == expected),
                    "{:?}", err
                );
                prop_assert_eq!((s.stage(), s.result().clone()), before.clone());
            }
            // Out-of-range values are refused where the id is right.
            if expected[0] == IDS.coord {
                for c in [-0.25, 1.5, f32::NAN] {
                    let r = s.step(&row(E::Coord(c)));
                    prop_assert!(matches!(r, Err(SpatialError::CoordOutOfRange { .. })), "{:?}", r);
                }
            } else {
                for sz in [(0.0, 0.5), (0.5, 1.25), (f32::NAN, 0.5)] {
                    let r = s.step(&row(E::Size(sz.0, sz.1)));
                    prop_assert!(matches!(r, Err(SpatialError::SizeOutOfRange { .. })), "{:?}", r);
                }
            }
            prop_assert_eq!((s.stage(), s.result().clone()), before);
            // The refusals left a state that accepts the rest of the run.
            for e in &es[i..] {
                s.step(&row(*e)).unwrap();
            }
            prop_assert_eq!(s.result(), &want);
        }
    }

    #[test]
    fn specs_are_validated() {
        assert_eq!(
            SpatialSpec::new(SpatialKind::Point, IDS, 0),
            Err(SpatialError::NoObjectsAllowed)
        );
        let ids = SpatialIds { size: 5, ..IDS };
        assert_eq!(
            SpatialSpec::new(SpatialKind::Detect, ids, 3),
            Err(SpatialError::AmbiguousIds { ids })
        );
    }

    #[test]
    fn boxes_are_clamped_to_the_image() {
        let b = BoundingBox::from_centre(0.1, 0.9, [0.5, 0.25]);
        assert_eq!(
            (b.x_min, b.y_min, b.x_max, b.y_max),
            (0.0, 0.775, 0.35, 1.0)
        );
    }
}
