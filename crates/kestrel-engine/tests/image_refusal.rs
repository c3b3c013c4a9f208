//! Vision requests against a model that takes no images (the real default
//! text model): an image is refused at submission with an argument error
//! naming `image` and the model, whatever its bytes; an empty question is
//! refused naming `question` first; point and detect are refused as every
//! vision request is (naming `image`, not `skill`); nothing is queued or held, and the
//! engine keeps serving text. Also the wire names of the request types.

mod common;

use common::{kv_released, rt, start_default};

use kestrel_engine::{
    CaptionLength, EngineConfig, EngineError, Field, GenerateRequest, Prompt, VisionTask,
};

/// A 1x1 PNG (a real, decodable image: the refusal is the model's, not
/// the bytes').
const PNG_1X1: &[u8] = &[
    0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x02, 0x00, 0x00, 0x00, 0x90, 0x77, 0x53,
    0xde, 0x00, 0x00, 0x00, 0x0c, 0x49, 0x44, 0x41, 0x54, 0x08, 0xd7, 0x63, 0xf8, 0xcf, 0xc0, 0x00,
    0x00, 0x03, 0x01, 0x01, 0x00, 0x18, 0xdd, 0x8d, 0xb0, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45, 0x4e,
    0x44, 0xae, 0x42, 0x60, 0x82,
];

fn vision(image: &[u8], task: VisionTask) -> GenerateRequest {
    GenerateRequest {
        input: Prompt::Vision {
            image: image.to_vec(),
            task,
        },
        ..GenerateRequest::text("unused", 8)
    }
}

fn query(q: &str) -> VisionTask {
    VisionTask::Query {
        question: q.to_string(),
    }
}

#[test]
fn a_text_model_refuses_images_and_keeps_serving() {
    let engine = start_default(EngineConfig {
        threads: 2,
        max_seq_len: Some(512),
        kv_pages: 64,
        ..EngineConfig::default()
    });
    let name = engine.model().name().to_string();
    rt().block_on(async {
        let cases = [
            (PNG_1X1, query("What is in the picture?")),
            (b"not an image at all".as_slice(), query("What is this?")),
            (
                PNG_1X1,
                VisionTask::Caption {
                    length: CaptionLength::Long,
                },
            ),
            (
                PNG_1X1,
                VisionTask::Point {
                    object: "cat".into(),
                    max_objects: None,
                },
            ),
            (
                PNG_1X1,
                VisionTask::Detect {
                    object: "cat".into(),
                    max_objects: Some(3),
                },
            ),
        ];
        for (image, task) in cases {
            let err = engine
                .generate(vision(image, task.clone()))
                .await
                .unwrap_err();
            let EngineError::InvalidArgument { field, message } = &err else {
                panic!("{task:?}: expected an argument error, got {err:?}");
            };
            assert_eq!(*field, Field::Image, "{task:?}");
            assert!(message.contains(&format!("model `{name}`")), "{message}");
            assert!(message.contains("no vision encoder"), "{message}");
            assert_eq!(err.field(), Some(Field::Image));
            // The stream API refuses the same way, before a stream exists.
            let err = engine.stream(vision(image, task)).unwrap_err();
            assert_eq!(err.field(), Some(Field::Image));
        }
        // The question is checked first: an empty (or blank) one names it.
        for q in ["", "  \n"] {
            let err = engine
                .generate(vision(PNG_1X1, query(q)))
                .await
                .unwrap_err();
            let EngineError::InvalidArgument { field, message } = &err else {
                panic!("expected an argument error, got {err:?}");
            };
            assert_eq!(
                (*field, message.as_str()),
                (Field::Question, "must not be empty")
            );
        }
        kv_released(&engine).await;
        let info = engine.model_info();
        assert_eq!((info.num_waiting, info.num_running), (0, 0));
        // Text still generates.
        let resp = engine
            .generate(GenerateRequest::text("The capital of France is", 4))
            .await
            .expect("text after refused images");
        assert_eq!(resp.token_ids.len(), 4);
        engine.shutdown(std::time::Duration::from_secs(5)).await;
    });
}

/// The wire names: `Field`s as every edge prints them, caption lengths
/// parsed from exactly the Moondream API's words.
#[test]
fn vision_names() {
    assert_eq!(Field::Image.to_string(), "image");
    assert_eq!(Field::Question.to_string(), "question");
    for l in CaptionLength::ALL {
        assert_eq!(l.as_str().parse::<CaptionLength>(), Ok(l));
        assert_eq!(l.to_string(), l.as_str());
    }
    assert_eq!(
        ["short", "normal", "long"].map(|s| s.parse::<CaptionLength>().unwrap()),
        CaptionLength::ALL
    );
    for bad in ["", "Short", "medium", " long"] {
        let err = bad.parse::<CaptionLength>().unwrap_err();
        assert_eq!(err.given, bad);
        assert!(err.to_string().contains("short, normal, long"), "{err}");
    }
}
