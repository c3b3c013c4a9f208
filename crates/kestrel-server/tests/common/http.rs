//! A plain HTTP/1.1 client for the OpenAI API tests (hyper, one connection
//! per request): JSON calls, raw bodies, and server-sent event streams read
//! event by event (dropping an [`SseStream`] closes its connection).

use std::net::SocketAddr;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// A finished response.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub content_type: String,
    pub body: Vec<u8>,
}

impl Reply {
    /// The body as JSON (panics, showing it, if it is not).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

async fn open(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> hyper::Response<Incoming> {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("request");
    sender.send_request(req).await.expect("send")
}

/// Sends `body` with `method` to `path` and reads the whole reply.
pub async fn call(addr: SocketAddr, method: &str, path: &str, body: Vec<u8>) -> Reply {
    let resp = open(addr, method, path, body).await;
    let status = resp.status().as_u16();
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("read body")
        .to_bytes()
        .to_vec();
    Reply {
        status,
        content_type,
        body,
    }
}

/// POSTs JSON.
pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    call(addr, "POST", path, body.to_string().into_bytes()).await
}

pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    call(addr, "GET", path, Vec::new()).await
}

/// A server-sent event stream.
#[derive(Debug)]
pub struct SseStream {
    pub status: u16,
    body: Incoming,
    buf: String,
}

impl SseStream {
    /// POSTs JSON and opens the reply as an event stream.
    pub async fn open(addr: SocketAddr, path: &str, body: &Value) -> Self {
        let resp = open(addr, "POST", path, body.to_string().into_bytes()).await;
        Self {
            status: resp.status().as_u16(),
            body: resp.into_body(),
            buf: String::new(),
        }
    }

    /// The next event's `data`, or `None` at the end of the body.
    pub async fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let event: String = self.buf.drain(..end + 2).collect();
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if !data.is_empty() {
                    return Some(data.join("\n"));
                }
                continue;
            }
            let frame = self.body.frame().await?.expect("read frame");
            if let Ok(bytes) = frame.into_data() {
                self.buf
                    .push_str(std::str::from_utf8(&bytes).expect("utf-8"));
            }
        }
    }

    /// Every event's data as JSON up to `[DONE]` (which must be last).
    pub async fn collect(mut self) -> Vec<Value> {
        let mut out = Vec::new();
        while let Some(d) = self.next_data().await {
            if d == "[DONE]" {
                assert!(self.next_data().await.is_none(), "[DONE] must be last");
                return out;
            }
            out.push(serde_json::from_str(&d).unwrap_or_else(|e| panic!("{e}: {d}")));
        }
        panic!("the stream ended without [DONE]: {out:?}");
    }
}
