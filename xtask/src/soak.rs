//! `cargo xtask soak`: the long soak of the gRPC server on the real model.
//!
//! The soak itself is the integration test
//! `crates/kestrel-server/tests/soak.rs` (CI runs a short one); this task
//! runs it with many more requests and clients, and prints its tally
//! (requests per kind and status, wall time). It uses the test profile,
//! which is optimized (opt-level 3) and keeps debug assertions on.

use std::process::Command;

use anyhow::{bail, Context as _};

/// Options of `cargo xtask soak`.
#[derive(Debug, clap::Args)]
pub struct SoakArgs {
    /// Requests in all.
    #[arg(long, default_value_t = 10_000)]
    pub requests: usize,
    /// Concurrent gRPC clients.
    #[arg(long, default_value_t = 48)]
    pub clients: usize,
}

pub fn main(args: SoakArgs) -> anyhow::Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args([
            "test",
            "-p",
            "kestrel-server",
            "--test",
            "soak",
            "--",
            "--nocapture",
        ])
        .env("KESTREL_SOAK_REQUESTS", args.requests.to_string())
        .env("KESTREL_SOAK_CLIENTS", args.clients.to_string())
        .status()
        .context("cannot run cargo test")?;
    if !status.success() {
        bail!("the soak failed ({status})");
    }
    Ok(())
}
