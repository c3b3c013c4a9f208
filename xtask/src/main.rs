//! `cargo xtask`: project automation that is longer than a test.
//!
//! - `cargo xtask bench`: what pipelined decoding measurably buys on the real
//!   engine core (see `bench/mod.rs` for what is measured and how).
//! - `cargo xtask soak`: thousands of mixed requests through the gRPC
//!   server on the real model, then a check that nothing was left behind.

mod bench;
mod soak;

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
    /// A long soak of the gRPC server (the `soak` test with 10,000 requests).
    Soak(soak::SoakArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
        Task::Bench(args) => bench::main(args),
        Task::Soak(args) => soak::main(args),
    }
}
