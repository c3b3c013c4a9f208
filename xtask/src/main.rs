//! `cargo xtask`: project automation that is longer than a test.
//!
//! - `cargo xtask bench`: what pipelined decoding measurably buys on the real
//!   engine core (see `bench/mod.rs` for what is measured and how).
//! - `cargo xtask chunked-prefill`: running streams' latency while a long
//!   prompt is prefilled, whole vs chunked (`chunked.rs`).
//! - `cargo xtask speculate`: prompt-lookup speculative decoding's tokens/s
//!   on workloads that repeat their context and on one that does not
//!   (`speculate.rs`).
//! - `cargo xtask synth-model`: a real-size synthetic Llama GGUF (1B, 3B,
//!   8B shapes; F16, Q8_0, Q4_0, Q4_K_M), cached; `bench --model
//!   synth:llama-1b:q4_k_m` makes and uses the same files
//!   (`synth_model.rs`).
//! - `cargo xtask moondream-bench`: Moondream (image encode per crop count,
//!   time to first token with and without the image cached, decode, requests
//!   in flight) against a PyTorch floor, alternated (`moondream/mod.rs`).
//! - `cargo xtask soak`: thousands of mixed requests through the gRPC
//!   server on the real model, then a check that nothing was left behind.

mod bench;
mod chunked;
mod engine_core;
mod moondream;
mod soak;
mod speculate;
mod synth_model;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "Kestrel project automation")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Blocking vs pipelined decoding on the real engine: step tables, the
    /// Photon cost model, latency percentiles, JSON/Markdown results and SVGs.
    Bench(bench::BenchArgs),
    /// Chunked prefill: the running streams' token gaps and the long
    /// prompt's TTFT when a long prompt arrives, whole vs chunked.
    ChunkedPrefill(chunked::ChunkedArgs),
    /// Moondream on the engine against a PyTorch float32 floor: encode time
    /// per crop count, TTFT with and without the cached image, decode,
    /// requests/s in flight; alternated rounds, JSON/Markdown results.
    MoondreamBench(moondream::MoondreamArgs),
    /// A long soak of the gRPC server (the `soak` test with 10,000 requests).
    Soak(soak::SoakArgs),
    /// Speculative decoding: decode tokens/s with and without prompt-lookup
    /// drafts, on edit/quote workloads and on plain chat.
    Speculate(speculate::SpeculateArgs),
    /// Writes a synthetic Llama GGUF at a published shape (random weights
    /// from a seed, the default model's tokenizer), cached unless --out.
    SynthModel(synth_model::SynthModelArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
        Task::Bench(args) => bench::main(args),
        Task::ChunkedPrefill(args) => chunked::main(args),
        Task::MoondreamBench(args) => moondream::main(args),
        Task::Soak(args) => soak::main(args),
        Task::Speculate(args) => speculate::main(args),
        Task::SynthModel(args) => synth_model::main(args),
    }
}
