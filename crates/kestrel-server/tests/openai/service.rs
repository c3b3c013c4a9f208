//! The service around the API: `/v1/models`, health, version and metrics,
//! and a client that disconnects mid-stream frees its KV.

use std::time::{Duration, Instant};

use crate::common::http::{get, SseStream};
use crate::common::openai::{chat_body, model_id};
use crate::common::shared_server;
use serde_json::json;

#[tokio::test]
async fn models_health_version_and_metrics() {
    let addr = shared_server().http_addr;
    let v = get(addr, "/v1/models").await.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], model_id());
    assert_eq!(v["data"][0]["object"], "model");
    // The id may hold characters a path must escape.
    let escaped: String = model_id()
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    let r = get(addr, &format!("/v1/models/{escaped}")).await;
    assert_eq!(r.status, 200);
    assert_eq!(get(addr, "/v1/models/gpt-4").await.status, 404);
    let r = get(addr, "/health").await;
    assert_eq!(
        (r.status, r.json()["status"].clone()),
        (200, json!("serving"))
    );
    assert_eq!(
        get(addr, "/version").await.json()["version"],
        env!("CARGO_PKG_VERSION")
    );
    let r = get(addr, "/metrics").await;
    assert_eq!(r.status, 200);
    assert!(r.content_type.starts_with("text/plain"));
    assert!(r.text().contains("kestrel_"), "{}", r.text());
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_its_kv() {
    // Its own engine, so that no other test's requests hold KV.
    let server = crate::common::start_server(kestrel_engine::EngineConfig::default());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut body = chat_body("Count to one thousand.", 2000);
        body["model"] = json!(server.engine.model_info().name);
        body["ignore_eos"] = json!(true);
        body["stream"] = json!(true);
        let mut s = SseStream::open(server.http_addr, "/v1/chat/completions", &body).await;
        assert_eq!(s.status, 200);
        // The role chunk, then real output: the request is decoding.
        for _ in 0..3 {
            s.next_data().await.expect("a chunk");
        }
        let info = server.engine.model_info();
        assert_eq!(info.num_admitted, 1);
        assert!(info.kv_pages_used > 0);
        drop(s);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let info = server.engine.model_info();
            if info.num_admitted == 0 && info.kv_pages_used == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "KV still held after the client left: {info:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}
