//! Images at every edge, against the real default text model served on
//! `127.0.0.1:0` (gRPC and HTTP, real clients): the Moondream API
//! (`/v1/query`, `/v1/caption`, unary and streamed), an OpenAI chat with an
//! `image_url` part, gRPC's `vision` input and `kestrel generate --image`
//! each refuse what they must
//! with a 400 / INVALID_ARGUMENT naming the field (an image to a model that
//! takes none, a remote URL, an empty question, an unknown caption length,
//! a second image; for `/v1/point`, `/v1/detect` and gRPC's point and
//! detect, a blank object and `max_objects` 0 or past 256), before any work: nothing is queued or held, and the
//! engine keeps serving text. The happy path, on a served Moondream
//! checkpoint, is `python.rs`'s `python_moondream_client`.

mod common;

use std::time::{Duration, Instant};

use base64::Engine as _;
use common::http::{post, SseStream};
use common::{client, collect_stream, shared_server, text_request};
use kestrel_server::pb;
use serde_json::{json, Value};
use tonic::Code;

/// A 1x1 PNG: a real image, so each refusal is the model's or the field's,
/// not the bytes'.
const PNG_1X1: &[u8] = &[
    0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x02, 0x00, 0x00, 0x00, 0x90, 0x77, 0x53,
    0xde, 0x00, 0x00, 0x00, 0x0c, 0x49, 0x44, 0x41, 0x54, 0x08, 0xd7, 0x63, 0xf8, 0xcf, 0xc0, 0x00,
    0x00, 0x03, 0x01, 0x01, 0x00, 0x18, 0xdd, 0x8d, 0xb0, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45, 0x4e,
    0x44, 0xae, 0x42, 0x60, 0x82,
];

fn data_url(bytes: &[u8]) -> String {
    format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// Posts `body` to `path` and checks the 400 names `param`; returns the
/// error's message.
async fn refused(path: &str, body: Value, param: &str) -> String {
    let server = shared_server();
    let r = post(server.http_addr, path, &body).await;
    assert_eq!(r.status, 400, "{path} {body} -> {}", r.text());
    let e = r.json();
    assert_eq!(e["error"]["param"], param, "{path} {body} -> {e}");
    assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    e["error"]["message"].as_str().unwrap().to_string()
}

/// Waits until nothing is admitted, waiting or running, then checks that
/// text still generates.
async fn still_serving() {
    let server = shared_server();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info = server.engine.model_info();
        if info.num_admitted == 0 && info.num_waiting == 0 && info.kv_pages_used == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "work or KV still held: {info:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut c = client(server).await;
    let r = c
        .generate(text_request("The capital of France is", 3))
        .await
        .expect("text after refused images")
        .into_inner();
    assert_eq!(r.token_ids.len(), 3);
}

#[tokio::test]
async fn moondream_api_refusals_name_the_field() {
    let name = shared_server().engine.model_info().name;
    let png = data_url(PNG_1X1);
    for stream in [false, true] {
        let msg = refused(
            "/v1/query",
            json!({"question": "What is this?", "image_url": png, "stream": stream}),
            "image_url",
        )
        .await;
        assert!(msg.contains(&format!("model `{name}`")), "{msg}");
        assert!(msg.contains("no vision encoder"), "{msg}");
        refused(
            "/v1/caption",
            json!({"image_url": png, "length": "short", "stream": stream}),
            "image_url",
        )
        .await;
    }
    // Not an image: a text model refuses any image, naming the same field.
    refused(
        "/v1/query",
        json!({"question": "What?", "image_url": data_url(b"plain text, not an image")}),
        "image_url",
    )
    .await;
    let msg = refused(
        "/v1/query",
        json!({"question": "What?", "image_url": "https://example.com/cat.jpg"}),
        "image_url",
    )
    .await;
    assert!(msg.contains("fetches nothing"), "{msg}");
    refused(
        "/v1/query",
        json!({"question": "What?", "image_url": "data:image/png;base64,%%%"}),
        "image_url",
    )
    .await;
    refused("/v1/query", json!({"question": "What?"}), "image_url").await;
    // The question is the engine's rule, checked before the model's vision.
    let msg = refused(
        "/v1/query",
        json!({"question": "", "image_url": png}),
        "question",
    )
    .await;
    assert!(msg.contains("must not be empty"), "{msg}");
    refused("/v1/query", json!({"image_url": png}), "question").await;
    let msg = refused(
        "/v1/caption",
        json!({"image_url": png, "length": "medium"}),
        "length",
    )
    .await;
    assert!(msg.contains("short, normal, long"), "{msg}");
    refused(
        "/v1/query",
        json!({"question": "q", "image_url": png, "settings": {"temperature": -1}}),
        "settings.temperature",
    )
    .await;
    refused(
        "/v1/query",
        json!({"question": "q", "image_url": png, "settings": {"top_k": 1}}),
        "settings.top_k",
    )
    .await;
    // point and detect: the object and max_objects are the engine's rules,
    // checked before the model's vision; then the model refuses the image.
    for path in ["/v1/point", "/v1/detect"] {
        let msg = refused(
            path,
            json!({"image_url": png, "object": "cat"}),
            "image_url",
        )
        .await;
        assert!(msg.contains("no vision encoder"), "{msg}");
        let msg = refused(path, json!({"image_url": png, "object": " "}), "object").await;
        assert!(msg.contains("must not be empty"), "{msg}");
        refused(path, json!({"image_url": png}), "object").await;
        for n in [0, 257] {
            let msg = refused(
                path,
                json!({"image_url": png, "object": "cat", "settings": {"max_objects": n}}),
                "settings.max_objects",
            )
            .await;
            assert!(msg.contains("must be in [1, 256]"), "{msg}");
        }
        refused(
            path,
            json!({"image_url": png, "object": "cat", "settings": {"max_objects": -1}}),
            "settings",
        )
        .await;
        refused(
            path,
            json!({"image_url": png, "object": "cat", "stream": true}),
            "stream",
        )
        .await;
        refused(path, json!({"object": "cat"}), "image_url").await;
    }
    refused(
        "/v1/point",
        json!({"image_url": png, "object": "cat", "spatial_refs": [[0.5, 0.5]]}),
        "spatial_refs",
    )
    .await;
    still_serving().await;
}

/// A streamed request the engine refuses answers 400 JSON, not a stream.
#[tokio::test]
async fn a_refused_stream_is_a_plain_400() {
    let server = shared_server();
    let mut s = SseStream::open(
        server.http_addr,
        "/v1/query",
        &json!({"question": "", "image_url": data_url(PNG_1X1), "stream": true}),
    )
    .await;
    assert_eq!(s.status, 400);
    let body = s.next_data().await;
    assert!(body.is_none(), "no event for a refused request: {body:?}");
}

fn image_chat(parts: Value) -> Value {
    json!({
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 4,
        "temperature": 0,
    })
}

#[tokio::test]
async fn openai_image_parts_refusals_name_the_part() {
    let png = data_url(PNG_1X1);
    let text = json!({"type": "text", "text": "What is in the picture?"});
    let part = |url: &str| json!({"type": "image_url", "image_url": {"url": url}});
    let name = shared_server().engine.model_info().name;
    let msg = refused(
        "/v1/chat/completions",
        image_chat(json!([text, part(&png)])),
        "messages[0].content[1].image_url",
    )
    .await;
    assert!(msg.contains(&format!("model `{name}`")), "{msg}");
    let msg = refused(
        "/v1/chat/completions",
        image_chat(json!([part("http://example.com/cat.png"), text])),
        "messages[0].content[0].image_url",
    )
    .await;
    assert!(msg.contains("fetches nothing"), "{msg}");
    let msg = refused(
        "/v1/chat/completions",
        image_chat(json!([part(&png), text, part(&png)])),
        "messages[0].content[2].image_url",
    )
    .await;
    assert!(msg.contains("at most one image"), "{msg}");
    // The question is the last user message's text: none is an empty one.
    refused(
        "/v1/chat/completions",
        image_chat(json!([part(&png)])),
        "messages[0].content",
    )
    .await;
    refused(
        "/v1/chat/completions",
        json!({
            "messages": [{"role": "assistant", "content": [part(&png)]},
                         {"role": "user", "content": "What?"}],
        }),
        "messages[0].role",
    )
    .await;
    refused(
        "/v1/chat/completions",
        image_chat(json!([{"type": "image_url", "image_url": {"detail": "low"}}, text])),
        "messages[0].content[0].image_url.url",
    )
    .await;
    let mut with_tools = image_chat(json!([text, part(&png)]));
    with_tools["tools"] =
        json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    refused("/v1/chat/completions", with_tools, "tools").await;
    // /tokenize takes text only.
    refused(
        "/tokenize",
        json!({"messages": [{"role": "user", "content": [text, part(&png)]}]}),
        "messages[0].content[1].image_url",
    )
    .await;
    still_serving().await;
}

fn vision_request(image: &[u8], skill: pb::vision_input::Skill) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Vision(pb::VisionInput {
            image: image.to_vec(),
            skill: Some(skill),
        })),
        max_new_tokens: Some(4),
        ..Default::default()
    }
}

#[tokio::test]
async fn grpc_vision_refusals_name_the_field() {
    use pb::vision_input::Skill;
    let server = shared_server();
    let name = server.engine.model_info().name;
    let mut c = client(server).await;
    let query = |q: &str| Skill::Query(pb::VisionQuery { question: q.into() });
    let caption = |length: i32| Skill::Caption(pb::VisionCaption { length });
    let spatial = |object: &str, max_objects| pb::VisionSpatial {
        object: object.into(),
        max_objects,
    };
    let cases = [
        (
            vision_request(PNG_1X1, Skill::Point(spatial("cat", None))),
            "vision.image",
        ),
        (
            vision_request(PNG_1X1, Skill::Detect(spatial("cat", Some(3)))),
            "vision.image",
        ),
        (
            vision_request(PNG_1X1, Skill::Point(spatial("", None))),
            "vision.point.object",
        ),
        (
            vision_request(PNG_1X1, Skill::Detect(spatial(" \n", None))),
            "vision.detect.object",
        ),
        (
            vision_request(PNG_1X1, Skill::Point(spatial("cat", Some(0)))),
            "vision.point.max_objects",
        ),
        (
            vision_request(PNG_1X1, Skill::Detect(spatial("cat", Some(257)))),
            "vision.detect.max_objects",
        ),
        (vision_request(PNG_1X1, query("What?")), "vision.image"),
        (
            vision_request(b"not an image", query("What?")),
            "vision.image",
        ),
        (
            vision_request(PNG_1X1, caption(pb::CaptionLength::Long.into())),
            "vision.image",
        ),
        (vision_request(PNG_1X1, query("")), "vision.query.question"),
        (vision_request(PNG_1X1, caption(9)), "vision.caption.length"),
        (
            pb::GenerateRequest {
                input: Some(pb::generate_request::Input::Vision(pb::VisionInput {
                    image: PNG_1X1.to_vec(),
                    skill: None,
                })),
                ..Default::default()
            },
            "vision.skill",
        ),
    ];
    for (req, field) in cases {
        let e = c.generate(req.clone()).await.expect_err("refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(
            e.message().starts_with(&format!("{field} ")),
            "{field}: {}",
            e.message()
        );
        if field == "vision.image" {
            assert!(e.message().contains(&format!("model `{name}`")), "{e:?}");
        }
        let e = collect_stream(&mut c, req).await.expect_err("refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().starts_with(&format!("{field} ")), "{e:?}");
    }
    still_serving().await;
}

/// `kestrel generate --image FILE "question"` sends the image (the default
/// text model refuses it, naming the proto field and the model), as do
/// `--point` and `--detect` (a blank object named first), and `--caption`
/// takes exactly Moondream's lengths.
#[test]
fn the_cli_sends_an_image() {
    let dir = std::env::temp_dir().join(format!("kestrel-cli-image-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let png = dir.join("pixel.png");
    std::fs::write(&png, PNG_1X1).unwrap();
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kestrel"))
            .args(["generate", "--threads", "2", "--image"])
            .arg(&png)
            .args(args)
            .output()
            .expect("run kestrel")
    };
    let out = run(&["What is in the picture?"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("vision.image"), "{stderr}");
    assert!(stderr.contains("no vision encoder"), "{stderr}");
    let out = run(&["--caption", "medium"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("short, normal, long"), "{stderr}");
    let out = run(&["--point", "cat"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("vision.image"), "{stderr}");
    let out = run(&["--detect", " ", "--max-objects", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("vision.detect.object"), "{stderr}");
    for flags in [
        &["--caption", "short"][..],
        &["--point", "cat"],
        &["--detect", "cat"],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kestrel"))
            .arg("generate")
            .args(flags)
            .output()
            .expect("run kestrel");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            stderr.contains("--image"),
            "{flags:?} needs an image: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
