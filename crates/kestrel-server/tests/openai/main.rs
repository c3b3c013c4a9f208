//! End-to-end tests of the OpenAI-compatible HTTP API: the real engine and
//! default model served on `127.0.0.1:0`, called over HTTP/1.1 (hyper).
//! Greedy decoding and a few tokens per request keep the suite quick; one
//! server serves the whole binary, its tests one file per feature, the
//! request builders in `common/openai.rs`.

#[path = "../common/mod.rs"]
mod common;
#[path = "../../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

mod chat;
mod completions;
mod fields;
mod sampling;
mod service;
mod structured;
mod tokenize;
mod tools;
