//! The DRAM floor of single-stream decode: a stream's step reads every
//! weight matrix once, so it can go no faster than the machine's read
//! bandwidth over the bytes it streams per token. [`read_bandwidth`]
//! measures that bandwidth with the bench's thread count, and the report
//! states Kestrel's one-stream decode against the floor it gives.

use std::time::Instant;

use serde::Serialize;

/// Bytes read per pass: far past any last-level cache of the machines
/// this runs on, so every pass comes from DRAM.
pub const BUFFER_BYTES: usize = 1 << 30;
/// Passes timed; the fastest counts (the others met neighbours or faults).
pub const PASSES: usize = 5;

/// The measured bandwidth and what it implies for one stream.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct DramFloor {
    /// Best read bandwidth over [`PASSES`], bytes per second.
    pub read_bytes_per_s: f64,
    /// Threads that read (the bench's matmul threads).
    pub threads: usize,
    /// Weight bytes a decode step streams.
    pub bytes_per_token: usize,
}

impl DramFloor {
    /// The most tokens per second one stream could decode.
    pub fn tokens_per_s(&self) -> f64 {
        self.read_bytes_per_s / self.bytes_per_token as f64
    }
}

/// The best of [`PASSES`] timed reads of a [`BUFFER_BYTES`] buffer split
/// over `threads` threads, in bytes per second.
pub fn read_bandwidth(threads: usize) -> f64 {
    let threads = threads.max(1);
    // Non-zero contents, so every page is really allocated before timing.
    let buf: Vec<u64> = (0..BUFFER_BYTES / 8).map(|i| i as u64 | 1).collect();
    let chunk = buf.len().div_ceil(threads);
    let mut best = f64::MAX;
    for _ in 0..PASSES {
        let start = Instant::now();
        std::thread::scope(|s| {
            for part in buf.chunks(chunk) {
                s.spawn(move || std::hint::black_box(sum(part)));
            }
        });
        best = best.min(start.elapsed().as_secs_f64());
    }
    BUFFER_BYTES as f64 / best
}

/// A sum the compiler vectorizes, eight independent lanes wide, so the
/// loop is bound by loads rather than by one add chain.
fn sum(v: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(*x);
        }
    }
    acc.iter().chain(rest).fold(0, |a, x| a.wrapping_add(*x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_is_bandwidth_over_bytes() {
        let f = DramFloor {
            read_bytes_per_s: 20e9,
            threads: 2,
            bytes_per_token: 100_000_000,
        };
        assert_eq!(f.tokens_per_s(), 200.0);
        assert_eq!(sum(&[1, 2, 3, 4, 5, 6, 7, 8, 9]), 45);
    }
}
