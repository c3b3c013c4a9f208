//! A served Moondream checkpoint (synthetic: `scripts/reference/
//! moondream_synth.py --served`, the real tensor names, vocabulary and
//! prompt templates at tiny widths) on `127.0.0.1:0`, through every edge:
//! the Moondream API's `/v1/query` and `/v1/caption` (unary, and SSE whose
//! `chunk`s concatenate to the unary answer and end with one `completed`
//! event), an OpenAI chat with the same image, and gRPC's `vision` input
//! give one greedy answer; a second question on the same image reuses its
//! prefix; bytes that are not an image, or a truncated one, are a 400 /
//! INVALID_ARGUMENT naming the image, and the server keeps answering.
//! `point` and `detect` give the same objects over HTTP (`/v1/point`,
//! `/v1/detect`), gRPC (unary and streamed) and the CLI; a checkpoint
//! without a region model refuses them naming the skill.
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
use common::{client, collect_stream, start_server, TestServer};
use kestrel_engine::{EngineConfig, ModelSource};
use kestrel_server::pb;
use serde_json::{json, Value};
use tonic::Code;

/// The synthetic checkpoint (with a region model), written once per test
/// binary.
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
                // Seed 17: its x stages do not all choose EOS at once, so
                // point and detect find objects (seed 72's find none).
                .args(["--served", "--seed", "17"])
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

/// The objects a Moondream answer holds, as `[x_min, y_min, x_max, y_max]`
/// (a point's `[x, y, x, y]`): the HTTP JSON shape.
fn http_objects(body: &Value, key: &str) -> Vec<[f32; 4]> {
    let get = |o: &Value, k: &str| o[k].as_f64().unwrap_or_else(|| panic!("{k}: {o}")) as f32;
    body[key]
        .as_array()
        .unwrap_or_else(|| panic!("no {key}: {body}"))
        .iter()
        .map(|o| match key {
            "points" => [get(o, "x"), get(o, "y"), get(o, "x"), get(o, "y")],
            _ => [
                get(o, "x_min"),
                get(o, "y_min"),
                get(o, "x_max"),
                get(o, "y_max"),
            ],
        })
        .collect()
}

/// The same objects from a gRPC unary response.
fn grpc_objects(r: &pb::GenerateResponse) -> Vec<[f32; 4]> {
    let points = r.points.iter().map(|p| [p.x, p.y, p.x, p.y]);
    let boxes = r.boxes.iter().map(|b| [b.x_min, b.y_min, b.x_max, b.y_max]);
    points.chain(boxes).collect()
}

/// The same objects from gRPC stream events.
fn streamed_objects(objects: &[pb::StreamObject]) -> Vec<[f32; 4]> {
    use pb::stream_object::Object;
    objects
        .iter()
        .map(|o| match o.object.expect("object set") {
            Object::Point(p) => [p.x, p.y, p.x, p.y],
            Object::Box(b) => [b.x_min, b.y_min, b.x_max, b.y_max],
        })
        .collect()
}

/// `/v1/point` and `/v1/detect` (the moondream client's shapes), gRPC's
/// point and detect (unary `points` / `boxes`, and one `object` event per
/// object) and `kestrel generate --point / --detect` (one JSON line per
/// object) give the same greedy objects, all inside the image; a smaller
/// `max_objects` gives a prefix of them.
#[tokio::test]
async fn points_and_boxes_at_every_edge() {
    use pb::vision_input::Skill;
    let Some(server) = server("points_and_boxes_at_every_edge") else {
        return;
    };
    let addr = server.http_addr;
    let png = picture(image::ImageFormat::Png);
    let url = data_url("image/png", &png);
    let mut c = client(server).await;
    let mut found = 0;
    for (path, key) in [("/v1/point", "points"), ("/v1/detect", "objects")] {
        for object in ["cat", "red ball"] {
            let body = json!({"image_url": url, "object": object,
                              "settings": {"temperature": 0, "max_objects": 3}});
            let r = post(addr, path, &body).await;
            assert_eq!(r.status, 200, "{path} {object}: {}", r.text());
            let http = http_objects(&r.json(), key);
            eprintln!("{path} {object:?}: {http:?}");
            assert!(http.len() <= 3, "{path}: max_objects 3: {http:?}");
            for o in &http {
                assert!(o.iter().all(|v| (0.0..=1.0).contains(v)), "{o:?}");
                assert!(o[0] <= o[2] && o[1] <= o[3], "{o:?}");
            }
            found += http.len();
            let spatial = pb::VisionSpatial {
                object: object.into(),
                max_objects: Some(3),
            };
            let skill = match key {
                "points" => Skill::Point(spatial),
                _ => Skill::Detect(spatial),
            };
            let req = pb::GenerateRequest {
                input: Some(pb::generate_request::Input::Vision(pb::VisionInput {
                    image: png.clone(),
                    skill: Some(skill),
                })),
                temperature: Some(0.0),
                ..Default::default()
            };
            let unary = c.generate(req.clone()).await.expect("gRPC").into_inner();
            assert_eq!(grpc_objects(&unary), http, "{path} {object}: gRPC unary");
            assert_eq!(unary.text, "");
            let streamed = collect_stream(&mut c, req).await.expect("gRPC stream");
            assert_eq!(streamed.deltas, 0, "a point/detect stream sends no text");
            assert_eq!(
                streamed_objects(&streamed.objects),
                http,
                "{path}: streamed"
            );
            assert_eq!(grpc_objects(&streamed.done), http, "{path}: stream's done");
            // max_objects 1: the first object (or none, as before).
            let one = json!({"image_url": url, "object": object,
                             "settings": {"temperature": 0, "max_objects": 1}});
            let r = post(addr, path, &one).await;
            assert_eq!(r.status, 200, "{}", r.text());
            let first = http_objects(&r.json(), key);
            assert_eq!(first[..], http[..http.len().min(1)], "{path} {object}");
        }
    }
    assert!(
        found > 0,
        "the synthetic model must find something to compare"
    );
}

/// `kestrel generate --model DIR --image FILE --point OBJECT` (and
/// `--detect`) prints one JSON line per object, the HTTP API's objects.
#[tokio::test]
async fn the_cli_points_and_detects() {
    let Some(server) = server("the_cli_points_and_detects") else {
        return;
    };
    let dir = checkpoint("the_cli_points_and_detects").unwrap();
    let png = picture(image::ImageFormat::Png);
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("vision-served-spatial.png");
    std::fs::write(&file, &png).unwrap();
    for (flag, path, key) in [
        ("--point", "/v1/point", "points"),
        ("--detect", "/v1/detect", "objects"),
    ] {
        let body = json!({"image_url": data_url("image/png", &png), "object": "cat",
                          "settings": {"temperature": 0, "max_objects": 2}});
        let r = post(server.http_addr, path, &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let want = r.json()[key].clone();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kestrel"))
            .arg("generate")
            .arg("--model")
            .arg(&dir)
            .args(["--threads", "2", "--temperature", "0", "--max-objects", "2"])
            .arg("--image")
            .arg(&file)
            .args([flag, "cat"])
            .output()
            .expect("run kestrel generate");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{flag}: {stderr}");
        let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
            .collect();
        assert_eq!(Value::Array(lines), want, "{flag}");
    }
}

/// A Moondream checkpoint without a region model answers queries but
/// refuses point and detect, naming the skill and the model: a 400 naming
/// `skill` on HTTP, INVALID_ARGUMENT naming `vision.skill` on gRPC.
#[tokio::test]
async fn a_model_without_a_region_module_refuses_point_and_detect() {
    use pb::vision_input::Skill;
    let test = "a_model_without_a_region_module_refuses_point_and_detect";
    let Some(python) =
        reference_python::python_with(test, "numpy", "scripts/reference/requirements.txt")
    else {
        return;
    };
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("vision-served-no-region");
    let _ = std::fs::remove_dir_all(&dir);
    let out = std::process::Command::new(python)
        .arg(reference_python::repo().join("scripts/reference/moondream_synth.py"))
        .arg(&dir)
        .args(["--served", "--no-region"])
        .output()
        .expect("run moondream_synth.py");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let server = start_server(EngineConfig {
        model: ModelSource::Path(dir),
        threads: 2,
        ..EngineConfig::default()
    });
    let name = server.engine.model_info().name;
    let png = picture(image::ImageFormat::Png);
    let url = data_url("image/png", &png);
    for path in ["/v1/point", "/v1/detect"] {
        let r = post(
            server.http_addr,
            path,
            &json!({"image_url": url, "object": "cat"}),
        )
        .await;
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["param"], "skill", "{e}");
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(msg.contains("no region module"), "{msg}");
        assert!(msg.contains(&format!("model `{name}`")), "{msg}");
    }
    let mut c = client(&server).await;
    for skill in [
        Skill::Point(pb::VisionSpatial {
            object: "cat".into(),
            max_objects: None,
        }),
        Skill::Detect(pb::VisionSpatial {
            object: "cat".into(),
            max_objects: None,
        }),
    ] {
        let req = pb::GenerateRequest {
            input: Some(pb::generate_request::Input::Vision(pb::VisionInput {
                image: png.clone(),
                skill: Some(skill),
            })),
            ..Default::default()
        };
        let e = c.generate(req).await.expect_err("no region module");
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().starts_with("vision.skill "), "{e:?}");
    }
    let r = post(
        server.http_addr,
        "/v1/query",
        &json!({"image_url": url, "question": "What?", "settings": greedy()}),
    )
    .await;
    assert_eq!(r.status, 200, "a query still answers: {}", r.text());
}
