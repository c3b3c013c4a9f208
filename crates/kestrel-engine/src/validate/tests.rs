//! Unit tests of the request rules, field by field.

use super::*;
use crate::request::SamplingOptions;

fn field_of<T: std::fmt::Debug>(r: Result<T>) -> (Field, String) {
    match r {
        Err(EngineError::InvalidArgument { field, message }) => (field, message),
        other => panic!("expected an argument error, got {other:?}"),
    }
}

/// Sets one option on the defaults; `good` values pass, `bad` ones
/// fail naming `field` and the range.
fn float_rule(
    field: Field,
    set: fn(&mut SamplingOptions, f32),
    good: &[f32],
    bad: &[f32],
    range: &str,
) {
    for &v in good {
        let mut s = SamplingOptions::default();
        set(&mut s, v);
        sampling(&s, "r").unwrap_or_else(|e| panic!("{field}={v}: {e}"));
    }
    for &v in bad {
        let mut s = SamplingOptions::default();
        set(&mut s, v);
        let (f, msg) = field_of(sampling(&s, "r"));
        assert_eq!(f, field);
        assert_eq!(msg, format!("must be in {range}, got {v}"));
    }
}

/// `top_logprobs`'s range, and a typed refusal on a backend that
/// does not score prompts (CUDA).
#[test]
fn prompt_logprobs_rules() {
    assert_eq!(prompt_logprobs(0, true).unwrap(), 0);
    assert_eq!(prompt_logprobs(20, true).unwrap(), 20);
    let (f, msg) = field_of(prompt_logprobs(21, true));
    assert_eq!(
        (f, msg.as_str()),
        (Field::PromptLogprobs, "must be in [0, 20], got 21")
    );
    let (f, msg) = field_of(prompt_logprobs(1, false));
    assert_eq!(f, Field::PromptLogprobs);
    assert!(msg.contains("not supported by this backend"), "{msg}");
    assert_eq!(Field::PromptLogprobs.to_string(), "prompt_logprobs");
}

#[test]
fn logit_bias_rules() {
    let ok = logit_bias(&[(5, 100.0), (1, -100.0), (5, 2.0)], 10, true).unwrap();
    assert_eq!(ok.entries(), &[(1, -100.0), (5, 2.0)]);
    assert!(logit_bias(&[], 10, false).unwrap().is_empty());
    // (token, bias, backend supports it, field blamed, message part)
    let cases = [
        (1, 1.0, false, Field::LogitBias, "is not supported"),
        (
            10,
            1.0,
            true,
            Field::LogitBiasToken(10),
            "outside the vocabulary",
        ),
        (3, 100.5, true, Field::LogitBiasToken(3), "[-100, 100]"),
        (3, f32::NAN, true, Field::LogitBiasToken(3), "got NaN"),
        (
            3,
            -f32::INFINITY,
            true,
            Field::LogitBiasToken(3),
            "got -inf",
        ),
    ];
    for (token, bias, supported, field, needle) in cases {
        let (f, msg) = field_of(logit_bias(&[(token, bias)], 10, supported));
        assert_eq!(f, field);
        assert!(msg.contains(needle), "{msg}");
    }
    let many: Vec<(u32, f32)> = (0..=MAX_LOGIT_BIAS as u32).map(|t| (t, 1.0)).collect();
    assert_eq!(
        field_of(logit_bias(&many, 1 << 20, true)).0,
        Field::LogitBias
    );
    assert_eq!(Field::LogitBiasToken(7).to_string(), "logit_bias[7]");
}

#[test]
fn sampling_ranges() {
    float_rule(
        Field::Temperature,
        |s, v| s.temperature = Some(v),
        &[0.0, 0.5, 100.0],
        &[-1.0, 100.5, f32::NAN, f32::INFINITY],
        "[0, 100]",
    );
    float_rule(
        Field::TopP,
        |s, v| s.top_p = Some(v),
        &[0.01, 1.0],
        &[0.0, -0.1, 1.01, f32::NAN],
        "(0, 1]",
    );
    float_rule(
        Field::MinP,
        |s, v| s.min_p = Some(v),
        &[0.0, 1.0],
        &[-0.01, 1.5, f32::NAN],
        "[0, 1]",
    );
    float_rule(
        Field::RepetitionPenalty,
        |s, v| s.repetition_penalty = Some(v),
        &[0.5, 1.0, 10.0],
        &[0.0, -1.0, 10.5, f32::NAN],
        "(0, 10]",
    );
    float_rule(
        Field::FrequencyPenalty,
        |s, v| s.frequency_penalty = Some(v),
        &[-2.0, 0.0, 2.0],
        &[-2.5, 2.5, f32::NAN],
        "[-2, 2]",
    );
    float_rule(
        Field::PresencePenalty,
        |s, v| s.presence_penalty = Some(v),
        &[-2.0, 0.0, 2.0],
        &[-2.5, 2.5, f32::NEG_INFINITY],
        "[-2, 2]",
    );
}

#[test]
fn top_logprobs_at_most_20_and_imply_logprobs() {
    let s = SamplingOptions {
        top_logprobs: 20,
        ..Default::default()
    };
    let p = sampling(&s, "r").unwrap();
    assert!(p.logprobs && p.top_logprobs == 20);
    let s = SamplingOptions {
        top_logprobs: 21,
        ..Default::default()
    };
    assert_eq!(
        field_of(sampling(&s, "r")),
        (Field::TopLogprobs, "must be in [0, 20], got 21".into())
    );
}

#[test]
fn an_explicit_seed_is_honoured_whatever_its_value() {
    for seed in [0, 1, u64::MAX] {
        let s = SamplingOptions {
            seed: Some(seed),
            ..Default::default()
        };
        assert_eq!(sampling(&s, "any-id").unwrap().seed, seed);
    }
    let derived = sampling(&SamplingOptions::default(), "abc").unwrap().seed;
    assert_eq!(derived, seed_for_request_id("abc"));
    assert_ne!(seed_for_request_id("abc"), seed_for_request_id("abd"));
    let s = SamplingOptions {
        top_k: Some(u32::MAX),
        ..Default::default()
    };
    assert_eq!(sampling(&s, "r").unwrap().top_k, u32::MAX);
}

#[test]
fn request_ids_are_short_printable_ascii() {
    assert_eq!(request_id("my-req_1".into()).unwrap(), "my-req_1");
    assert!(request_id("x".repeat(128)).is_ok());
    for bad in ["", "has space", "tab\t", "é", &"x".repeat(129)] {
        let (f, msg) = field_of(request_id(bad.into()));
        assert_eq!(f, Field::RequestId);
        assert!(msg.contains("printable ASCII"), "{msg}");
    }
}

#[test]
fn stop_lists_are_bounded() {
    assert_eq!(
        field_of(stop_sequences(vec!["a".into(), String::new()])),
        (
            Field::StopEntry(1),
            "must be 1 to 256 bytes long, got 0".into()
        )
    );
    assert_eq!(
        field_of(stop_sequences(vec!["x".repeat(257)])).0,
        Field::StopEntry(0)
    );
    assert_eq!(
        field_of(stop_sequences(vec!["s".into(); 17])),
        (Field::Stop, "must have at most 16 entries, got 17".into())
    );
    assert_eq!(
        field_of(stop_token_ids(vec![1, 49152], 49152)),
        (
            Field::StopTokenId(1),
            "must be in [0, 49152), got 49152".into()
        )
    );
    assert_eq!(
        field_of(stop_token_ids(vec![1; 65], 49152)).0,
        Field::StopTokenIds
    );
}

#[test]
fn prompt_shapes() {
    use crate::request::ChatMessage;
    assert_eq!(
        field_of(check_prompt_shape(&Prompt::Text(String::new()))).0,
        Field::Prompt
    );
    assert_eq!(
        field_of(check_prompt_shape(&Prompt::chat(vec![]))).0,
        Field::Messages
    );
    let (f, msg) = field_of(check_prompt_shape(&Prompt::chat(vec![
        ChatMessage::user("hi"),
        ChatMessage::new("wizard", "x"),
    ])));
    assert_eq!(f, Field::MessageRole(1));
    assert_eq!(
        msg,
        "must be one of system, user, assistant, tool, got \"wizard\""
    );
    let many = vec![ChatMessage::user("x"); MAX_CHAT_MESSAGES + 1];
    assert_eq!(
        field_of(check_prompt_shape(&Prompt::chat(many))),
        (
            Field::Messages,
            "must have at most 1024 entries, got 1025".into()
        )
    );
}

#[test]
fn constraint_shapes() {
    assert!(check_constraint(Constraint::JsonSchema(serde_json::json!(true))).is_ok());
    assert_eq!(
        field_of(check_constraint(Constraint::JsonSchema(serde_json::json!(
            [1]
        ))))
        .0,
        Field::JsonSchema
    );
    assert_eq!(
        field_of(check_constraint(Constraint::Regex(String::new()))).0,
        Field::Regex
    );
    assert_eq!(
        field_of(check_constraint(Constraint::Grammar(" \n".into()))).0,
        Field::Grammar
    );
    assert_eq!(
        field_of(check_constraint(Constraint::Choice(vec![]))).0,
        Field::Choices
    );
    assert_eq!(
        field_of(check_constraint(Constraint::Choice(vec![
            "a".into(),
            String::new()
        ])))
        .0,
        Field::Choice(1)
    );
}

/// A point/detect request's object and `max_objects`, and what it may not
/// combine with, each refused naming its field (no model needed).
#[test]
fn point_and_detect_rules() {
    use crate::request::{Constraint, GenerateRequest, Prompt, VisionTask};
    let point = |object: &str, max_objects| VisionTask::Point {
        object: object.into(),
        max_objects,
    };
    let detect = |object: &str, max_objects| VisionTask::Detect {
        object: object.into(),
        max_objects,
    };
    for ok in [
        point("cat", None),
        detect("red ball", Some(1)),
        point("x", Some(MAX_OBJECTS)),
    ] {
        vision::check_task(&ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
    }
    for (bad, field, message) in [
        (
            point("", None),
            Field::Object,
            "must not be empty".to_string(),
        ),
        (
            detect(" \t\n", Some(3)),
            Field::Object,
            "must not be empty".into(),
        ),
        (
            point("cat", Some(0)),
            Field::MaxObjects,
            "must be in [1, 256], got 0".into(),
        ),
        (
            detect("cat", Some(MAX_OBJECTS + 1)),
            Field::MaxObjects,
            format!("must be in [1, 256], got {}", MAX_OBJECTS + 1),
        ),
    ] {
        assert_eq!(
            field_of(vision::check_task(&bad)),
            (field, message),
            "{bad:?}"
        );
    }
    let spatial = GenerateRequest {
        input: Prompt::Vision {
            image: Vec::new(),
            task: point("cat", None),
        },
        ..GenerateRequest::text("", 8)
    };
    vision::check_spatial_request(&spatial).unwrap();
    type Set = fn(&mut GenerateRequest);
    let cases: [(Set, Field); 6] = [
        (|r| r.stop = vec!["a".into()], Field::Stop),
        (|r| r.stop_token_ids = vec![1], Field::StopTokenIds),
        (|r| r.ignore_eos = true, Field::Stop),
        (|r| r.min_tokens = 1, Field::MinTokens),
        (
            |r| r.constraint = Some(Constraint::Regex("a".into())),
            Field::Constraint,
        ),
        (|r| r.sampling.logprobs = true, Field::TopLogprobs),
    ];
    for (set, field) in cases {
        let mut r = spatial.clone();
        set(&mut r);
        assert_eq!(field_of(vision::check_spatial_request(&r)).0, field);
    }
}
