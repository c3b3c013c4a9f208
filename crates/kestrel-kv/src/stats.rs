//! `KvStats`: KV cache occupancy and prefix-cache effect as a runtime
//! reports it for metrics. One type shared by every runtime and the engine.

/// KV occupancy and prefix-cache effect, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvStats {
    /// Pages in the pool.
    pub total_pages: usize,
    /// Pages referenced by at least one row.
    pub used_pages: usize,
    /// Pages on the free list.
    pub free_pages: usize,
    /// Pages held only by the prefix cache (reusable).
    pub cached_pages: usize,
    /// Prompt tokens served from the prefix cache, cumulative.
    pub prefix_hit_tokens: u64,
    /// Prompt tokens admitted, cumulative.
    pub prompt_tokens: u64,
    /// Prompt tokens a fork (another sample of its request, `n > 1`)
    /// shared from its parent's pages instead of computing, cumulative.
    pub fork_shared_tokens: u64,
}
