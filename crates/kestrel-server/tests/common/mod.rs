//! Shared fixtures for the integration tests: a real engine with the real
//! default model served (gRPC and the OpenAI HTTP API) on `127.0.0.1:0`
//! from a dedicated thread (so it outlives each test's own runtime), small
//! request builders, and a plain HTTP/1.1 client ([`http`]).
//!
//! Starting an engine loads the model (a few seconds); tests in one binary
//! share [`shared_server`], and only tests that need a special engine
//! configuration start their own.
#![allow(dead_code)]

pub mod http;
pub mod openai;

use std::net::SocketAddr;
use std::sync::OnceLock;

use kestrel_engine::{Engine, EngineConfig};
use kestrel_server::pb;
use kestrel_server::pb::kestrel_client::KestrelClient;
use tonic::transport::Channel;

/// A server running on its own thread and runtime for the whole test binary.
#[derive(Debug, Clone)]
pub struct TestServer {
    /// gRPC.
    pub addr: SocketAddr,
    /// The OpenAI-compatible HTTP API.
    pub http_addr: SocketAddr,
    pub engine: Engine,
}

/// Starts an engine with `config` and serves it on `127.0.0.1:0` from a
/// dedicated thread. Panics with the engine's error if it cannot start.
pub fn start_server(config: EngineConfig) -> TestServer {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("test-server".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("tokio runtime");
            rt.block_on(async move {
                let engine = match Engine::start(config, |_| {}) {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = tx.send(Err(error_chain(&e)));
                        return;
                    }
                };
                let addr = "127.0.0.1:0".parse().expect("addr");
                let server =
                    match kestrel_server::serve(engine.clone(), addr, std::future::pending()).await
                    {
                        Ok(s) => s,
                        Err(e) => {
                            let _ = tx.send(Err(error_chain(&e)));
                            return;
                        }
                    };
                let http = match kestrel_server::serve_http(
                    engine.clone(),
                    addr,
                    kestrel_server::HttpOptions::default(),
                    std::future::pending(),
                )
                .await
                {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = tx.send(Err(error_chain(&e)));
                        return;
                    }
                };
                let _ = tx.send(Ok(TestServer {
                    addr: server.local_addr(),
                    http_addr: http.local_addr(),
                    engine,
                }));
                let _ = server.wait().await;
            });
        })
        .expect("spawn the server thread");
    match rx.recv().expect("server thread reply") {
        Ok(s) => s,
        Err(e) => panic!("cannot start the test server: {e}"),
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut c = e.source();
    while let Some(x) = c {
        s.push_str(": ");
        s.push_str(&x.to_string());
        c = x.source();
    }
    s
}

/// The binary's shared server with the default engine configuration.
pub fn shared_server() -> &'static TestServer {
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    SERVER.get_or_init(|| start_server(EngineConfig::default()))
}

/// A client of `server`.
pub async fn client(server: &TestServer) -> KestrelClient<Channel> {
    KestrelClient::connect(format!("http://{}", server.addr))
        .await
        .expect("connect")
}

/// A channel to `server` (for the health and reflection clients).
pub async fn channel(server: &TestServer) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect")
}

/// A greedy text request.
pub fn text_request(prompt: &str, max_new_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Prompt(prompt.into())),
        max_new_tokens: Some(max_new_tokens),
        temperature: Some(0.0),
        ..Default::default()
    }
}

/// A greedy single-turn chat request.
pub fn chat_request(user: &str, max_new_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: user.into(),
            }],
        })),
        max_new_tokens: Some(max_new_tokens),
        ..Default::default()
    }
}

/// What a finished stream delivered.
#[derive(Debug)]
pub struct Collected {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub deltas: usize,
    /// A point/detect request's streamed objects, in order.
    pub objects: Vec<pb::StreamObject>,
    pub done: pb::GenerateResponse,
}

/// Runs a StreamGenerate to its end.
pub async fn collect_stream(
    client: &mut KestrelClient<Channel>,
    req: pb::GenerateRequest,
) -> Result<Collected, tonic::Status> {
    use pb::stream_generate_response::Event;
    let mut stream = client.stream_generate(req).await?.into_inner();
    let mut text = String::new();
    let mut token_ids = Vec::new();
    let mut deltas = 0;
    let mut objects = Vec::new();
    while let Some(msg) = stream.message().await? {
        match msg.event.expect("event set") {
            Event::Object(o) => objects.push(o),
            Event::Delta(d) => {
                text.push_str(&d.text);
                token_ids.extend(d.token_ids);
                deltas += 1;
            }
            Event::Done(done) => {
                assert!(
                    stream.message().await?.is_none(),
                    "done must be the last message"
                );
                return Ok(Collected {
                    text,
                    token_ids,
                    deltas,
                    objects,
                    done,
                });
            }
        }
    }
    panic!("the stream ended without a done message");
}
