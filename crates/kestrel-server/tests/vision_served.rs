//! A served Moondream checkpoint (synthetic: `scripts/reference/
//! moondream_synth.py --served`, the real tensor names, vocabulary and
//! prompt templates at tiny widths) on `127.0.0.1:0`, through every edge:
//! the Moondream API's `/v1/query` and `/v1/caption` (unary, and SSE whose
//! `chunk`s concatenate to the unary answer and end with one `completed`
//! event), an OpenAI chat with the same image, and gRPC's `vision` input
//! give one greedy answer; a second question on the same image reuses its
//! prefix; bytes that are not an image, or a truncated one, are a 400 /
//! INVALID_ARGUMENT naming the image, and the server keeps answering.
//! Needs Python with numpy (skipped, saying so, unless
//! `KESTREL_REQUIRE_PYTHON`).

mod common;
#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

use std::io::Cursor;
use std::path::PathBuf;
use std::sync::OnceLock;

use base64::Engine as _;
use common::http::{post, SseStream};
use common::{client, start_server, TestServer};
use kestrel_engine::{EngineConfig, ModelSource};
use kestrel_server::pb;
use serde_json::{json, Value};
use tonic::Code;

/// The synthetic checkpoint, written once per test binary.
fn checkpoint(test: &str) -> Option<PathBuf> {
    let python =
        reference_python::python_with(test, "numpy", "scripts/reference/requirements.txt")?;
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    Some(
        DIR.get_or_init(|| {
            let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("vision-served");
            let _ = std::fs::remove_dir_all(&dir);
            let out = std::process::Command::new(python)
                .arg(reference_python::repo().join("scripts/reference/moondream_synth.py"))
                .arg(&dir)
                .arg("--served")
                .output()
                .expect("run moondream_synth.py");
            assert!(
                out.status.success(),
                "moondream_synth.py --served failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            dir
        })
        .clone(),
    )
}

fn server(test: &str) -> Option<&'static TestServer> {
    let dir = checkpoint(test)?;
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    Some(SERVER.get_or_init(|| {
        start_server(EngineConfig {
            model: ModelSource::Path(dir),
            threads: 2,
            ..EngineConfig::default()
        })
    }))
}

/// A 500x380 picture (a 2x2 tiling), encoded in `format`.
fn picture(format: image::ImageFormat) -> Vec<u8> {
    let img = image::RgbImage::from_fn(500, 380, |x, y| {
        image::Rgb([(x % 256) as u8, (y % 256) as u8, ((x * y) % 251) as u8])
    });
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, format).expect("encode the picture");
    out.into_inner()
}

fn data_url(mime: &str, bytes: &[u8]) -> String {
    format!(
        "data:{mime};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// Moondream `settings` for a short greedy answer.
fn greedy() -> Value {
    json!({"temperature": 0, "max_tokens": 8})
}

/// The SSE events of a Moondream stream, up to its `completed` one (which
/// must be last); returns the concatenated chunks and the last event.
async fn moondream_stream(addr: std::net::SocketAddr, path: &str, body: Value) -> (String, Value) {
    let mut s = SseStream::open(addr, path, &body).await;
    assert_eq!(s.status, 200);
    let mut text = String::new();
    while let Some(data) = s.next_data().await {
        let ev: Value = serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}"));
        assert!(ev.get("error").is_none(), "error event: {ev}");
        text.push_str(ev["chunk"].as_str().expect("every event has a chunk"));
        if ev["completed"] == true {
            assert!(s.next_data().await.is_none(), "completed must be last");
            return (text, ev);
        }
        assert_eq!(ev["completed"], false, "{ev}");
    }
    panic!("the stream ended without a completed event");
}

#[tokio::test]
async fn every_edge_answers_about_an_image() {
    let Some(server) = server("every_edge_answers_about_an_image") else {
        return;
    };
    let addr = server.http_addr;
    let jpeg = picture(image::ImageFormat::Jpeg);
    let url = data_url("image/jpeg", &jpeg);
    let question = "What is in the picture?";
    let body = json!({"question": question, "image_url": url, "settings": greedy()});
    let r = post(addr, "/v1/query", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let unary = r.json();
    let answer = unary["answer"].as_str().expect("answer").to_string();
    assert!(
        unary["usage"]["prompt_tokens"].as_u64().unwrap() > 730,
        "BOS + 729 image rows + the template: {unary}"
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (text, last) = moondream_stream(addr, "/v1/query", streamed).await;
    assert_eq!(text, answer);
    assert_eq!(last["finish_reason"], unary["finish_reason"]);
    // The same image again: its prefix (BOS + image rows) comes from the cache.
    assert!(
        last["usage"]["cached_prompt_tokens"].as_u64().unwrap() >= 729,
        "a second question on the same image reuses its prefix: {last}"
    );

    for length in ["short", "normal", "long"] {
        let body = json!({"image_url": url, "length": length, "settings": greedy()});
        let r = post(addr, "/v1/caption", &body).await;
        assert_eq!(r.status, 200, "{length}: {}", r.text());
        let caption = r.json()["caption"].as_str().expect("caption").to_string();
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (text, _) = moondream_stream(addr, "/v1/caption", streamed).await;
        assert_eq!(text, caption, "{length}");
    }

    let chat = json!({
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": question},
            {"type": "image_url", "image_url": {"url": url}},
        ]}],
        "temperature": 0,
        "max_tokens": 8,
    });
    let r = post(addr, "/v1/chat/completions", &chat).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"][0]["message"]["content"], answer);

    let mut c = client(server).await;
    let req = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Vision(pb::VisionInput {
            image: jpeg.clone(),
            skill: Some(pb::vision_input::Skill::Query(pb::VisionQuery {
                question: question.into(),
            })),
        })),
        max_new_tokens: Some(8),
        temperature: Some(0.0),
        ..Default::default()
    };
    let r = c.generate(req).await.expect("gRPC vision").into_inner();
    assert_eq!(r.text, answer);
}

#[tokio::test]
async fn bad_images_are_refused_naming_the_image() {
    let Some(server) = server("bad_images_are_refused_naming_the_image") else {
        return;
    };
    let addr = server.http_addr;
    let png = picture(image::ImageFormat::Png);
    let jpeg = picture(image::ImageFormat::Jpeg);
    let cases = [
        (
            data_url("image/png", b"plain text, not an image"),
            "not an image",
        ),
        (data_url("image/jpeg", &jpeg[..jpeg.len() / 2]), "truncated"),
        (data_url("image/gif", b"GIF89a\x01\x00\x01\x00"), "gif"),
    ];
    for (url, needle) in &cases {
        let r = post(
            addr,
            "/v1/query",
            &json!({"question": "What?", "image_url": url}),
        )
        .await;
        assert_eq!(r.status, 400, "{needle}: {}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["param"], "image_url", "{e}");
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{needle}: {msg}");
    }
    let mut c = client(server).await;
    let e = c
        .generate(pb::GenerateRequest {
            input: Some(pb::generate_request::Input::Vision(pb::VisionInput {
                image: jpeg[..jpeg.len() / 2].to_vec(),
                skill: Some(pb::vision_input::Skill::Caption(pb::VisionCaption {
                    length: pb::CaptionLength::Short.into(),
                })),
            })),
            ..Default::default()
        })
        .await
        .expect_err("a truncated image");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().starts_with("vision.image "), "{e:?}");
    // Still answering.
    let r = post(
        addr,
        "/v1/caption",
        &json!({"image_url": data_url("image/png", &png), "settings": greedy()}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// `kestrel generate --model DIR --image FILE "question"` (and
/// `--caption`) answers with the engine in-process, under the image
/// settings `--max-image-pixels`, `--max-crops` and `--image-cache`.
#[test]
fn the_cli_answers_about_an_image() {
    let Some(dir) = checkpoint("the_cli_answers_about_an_image") else {
        return;
    };
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("vision-served-picture.png");
    std::fs::write(&file, picture(image::ImageFormat::Png)).unwrap();
    for args in [
        &["What is in the picture?"][..],
        &["--caption", "short"][..],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kestrel"))
            .arg("generate")
            .arg("--model")
            .arg(&dir)
            .args([
                "--threads",
                "2",
                "--max-new-tokens",
                "4",
                "--stats",
                "--image",
            ])
            .arg(&file)
            .args(args)
            .output()
            .expect("run kestrel generate");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {stderr}");
        // The stats line counts BOS, the image's 729 rows and the template.
        let prompt_tokens: u32 = stderr
            .split(" prompt + ")
            .next()
            .and_then(|s| s.rsplit(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no stats line: {stderr}"));
        assert!(prompt_tokens > 730, "{args:?}: {stderr}");
    }
    // The server's image settings: a pixel limit below the picture's
    // refuses it naming the image; no crop limit below one is taken.
    let run = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kestrel"))
            .arg("generate")
            .arg("--model")
            .arg(&dir)
            .args(["--threads", "2", "--max-new-tokens", "2"])
            .args(extra)
            .arg("--image")
            .arg(&file)
            .arg("What is it?")
            .output()
            .expect("run kestrel generate")
    };
    let out = run(&["--max-image-pixels", "1000"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("vision.image"), "{stderr}");
    assert!(stderr.contains("500x380"), "{stderr}");
    let out = run(&["--max-crops", "1", "--image-cache", "0"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&["--max-crops", "0"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--max-crops"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
