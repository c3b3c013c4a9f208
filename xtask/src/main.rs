//! `cargo xtask`: project automation that is longer than a test (benchmarks, model fetch).

fn main() -> anyhow::Result<()> {
    let task = std::env::args().nth(1).unwrap_or_default();
    anyhow::bail!("unknown xtask `{task}`; available: bench")
}
