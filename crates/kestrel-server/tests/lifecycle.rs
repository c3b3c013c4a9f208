//! Request lifecycle over gRPC, each test on its own engine so the gauges
//! and the queue are not shared: a client that drops a stream mid-way
//! aborts its request, a full waiting queue answers RESOURCE_EXHAUSTED, and
//! a drain flips both health endpoints at once, refuses new work with
//! retryable statuses and lets in-flight requests finish.

mod common;

use std::time::{Duration, Instant};

use common::{client, start_server, text_request};
use kestrel_engine::EngineConfig;
use kestrel_server::pb;
use tonic::Code;

#[tokio::test]
async fn dropping_a_stream_aborts_the_request() {
    use pb::stream_generate_response::Event;
    let server = start_server(EngineConfig {
        max_batch_size: 4,
        ..EngineConfig::default()
    });
    let mut c = client(&server).await;
    let mut req = text_request("Count to a thousand: 1, 2, 3,", 2000);
    req.ignore_eos = true;
    let mut stream = c.stream_generate(req).await.expect("stream").into_inner();
    for _ in 0..2 {
        let msg = stream.message().await.expect("message").expect("a delta");
        assert!(matches!(msg.event, Some(Event::Delta(_))));
    }
    assert_eq!(server.engine.model_info().num_running, 1);
    drop(stream);

    // The request must leave the engine long before 2000 tokens would.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info = server.engine.model_info();
        if info.num_admitted == 0 && info.num_running == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "still running: {info:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let metrics = server.engine.metrics_text();
    assert!(
        metrics
            .lines()
            .any(|l| l.contains("reason=\"abort\"") && l.trim_end().ends_with(" 1")),
        "{metrics}"
    );
    // The engine still serves.
    let resp = c.generate(text_request("Hi", 2)).await.expect("generate");
    assert!(!resp.into_inner().token_ids.is_empty());
}

#[tokio::test]
async fn a_full_queue_is_resource_exhausted() {
    let server = start_server(EngineConfig {
        max_batch_size: 1,
        max_waiting: 1,
        ..EngineConfig::default()
    });
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let server = server.clone();
            tokio::spawn(async move {
                let mut c = client(&server).await;
                let mut req = text_request(&format!("Request number {i} says"), 64);
                req.ignore_eos = true;
                c.generate(req).await
            })
        })
        .collect();
    let mut ok = 0;
    let mut exhausted = 0;
    for t in tasks {
        match t.await.expect("task") {
            Ok(_) => ok += 1,
            Err(e) if e.code() == Code::ResourceExhausted => {
                assert!(e.message().contains("queue is full"), "{e:?}");
                exhausted += 1;
            }
            Err(e) => panic!("unexpected status {e:?}"),
        }
    }
    assert!(ok >= 1, "ok={ok} exhausted={exhausted}");
    assert!(exhausted >= 1, "ok={ok} exhausted={exhausted}");
}

#[tokio::test]
async fn a_drain_flips_health_at_once_and_lets_in_flight_requests_finish() {
    use pb::stream_generate_response::Event;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let server = start_server(EngineConfig {
        max_batch_size: 4,
        ..EngineConfig::default()
    });
    let mut health = HealthClient::new(common::channel(&server).await);
    let mut grpc_health = async || {
        match health
            .check(HealthCheckRequest {
                service: kestrel_server::SERVICE_NAME.into(),
            })
            .await
        {
            Ok(r) => Some(r.into_inner().status()),
            Err(e) if e.code() == Code::NotFound => None, // not published yet
            Err(e) => panic!("health check: {e:?}"),
        }
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while grpc_health().await != Some(ServingStatus::Serving) {
        assert!(Instant::now() < deadline, "never SERVING");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut c = client(&server).await;
    let mut req = text_request("Count to a thousand: 1, 2, 3,", 64);
    req.ignore_eos = true;
    let mut stream = c.stream_generate(req).await.expect("stream").into_inner();
    let first = stream.message().await.expect("message").expect("a delta");
    assert!(matches!(first.event, Some(Event::Delta(_))));

    let engine = server.engine.clone();
    let drain = tokio::spawn(async move { engine.shutdown(Duration::from_secs(60)).await });
    // NOT_SERVING as the drain begins (the watcher wakes on the drain, not
    // at its next poll): while the request in flight is still running.
    let deadline = Instant::now() + Duration::from_secs(5);
    while grpc_health().await != Some(ServingStatus::NotServing) {
        assert!(Instant::now() < deadline, "never NOT_SERVING");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        server.engine.model_info().num_running,
        1,
        "gRPC health turned NOT_SERVING only after the in-flight request ended"
    );
    // The HTTP side: not ready, and new work refused with a retryable 503.
    assert_eq!(
        common::http::get(server.http_addr, "/health").await.status,
        503
    );
    let body = serde_json::json!({
        "model": server.engine.model_info().name,
        "prompt": "Hi",
        "max_tokens": 2,
    });
    let refused = common::http::post(server.http_addr, "/v1/completions", &body).await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    let refused = c
        .generate(text_request("Hi", 2))
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), Code::Unavailable);

    // The request in flight when the drain began runs to its end.
    let done = loop {
        match stream.message().await.expect("message") {
            Some(pb::StreamGenerateResponse {
                event: Some(Event::Done(done)),
            }) => break done,
            Some(_) => {}
            None => panic!("the stream ended without Done"),
        }
    };
    assert_eq!(done.finish_reason(), pb::FinishReason::Length, "{done:?}");
    assert_eq!(done.usage.expect("usage").completion_tokens, 64);
    tokio::time::timeout(Duration::from_secs(30), drain)
        .await
        .expect("the drain ends once nothing is in flight")
        .expect("drain task");
}
