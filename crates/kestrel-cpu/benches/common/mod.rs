//! What every kestrel-cpu bench shares.

/// Compute threads for a bench: `KESTREL_THREADS`, 2 by default (the
/// figures in `docs/bench/` name the count they ran with).
pub fn threads() -> usize {
    std::env::var("KESTREL_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
}
