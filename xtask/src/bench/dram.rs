//! The DRAM floor of single-stream decode: a stream's step reads every
//! weight matrix once, so it can go no faster than the machine's read
//! bandwidth over the bytes it streams per token. The floor counts the
//! model file's bytes ([`file_bytes_per_token`]: what any engine must
//! read), not Kestrel's own resident copy, which the report shows beside
//! it. A [`Probe`] measures the bandwidth with the bench's thread count
//! once, before the runs; on a shared machine it moves by a quarter
//! and more within minutes, so the probe also reads it beside each
//! one-stream run ([`ProbedRun`]), and the report sets each run against the
//! bandwidth of its own minute.

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use kestrel_cpu::WeightPages;
use kestrel_model::{Bytes, GgufFile};
use serde::Serialize;

/// Bytes read per pass: far past any last-level cache of the machines
/// this runs on, so every pass comes from DRAM.
pub const BUFFER_BYTES: usize = 1 << 30;
/// Passes timed; the fastest counts (the others met neighbours or faults).
pub const PASSES: usize = 5;
/// Passes timed before and after each one-stream run.
pub const BESIDE_PASSES: usize = 3;

/// The measured bandwidth and what it implies for one stream.
#[derive(Debug, Clone, Serialize)]
pub struct DramFloor {
    /// Best read bandwidth over [`PASSES`], bytes per second.
    pub read_bytes_per_s: f64,
    /// Threads that read (the bench's matmul threads).
    pub threads: usize,
    /// The file's tensor bytes a decode step must read ([`file_bytes_per_token`]);
    /// `None` when the model is not a GGUF file (the floor then uses Kestrel's).
    pub file_bytes_per_token: Option<usize>,
    /// The weight bytes Kestrel holds resident and streams per decode step.
    pub resident_bytes_per_token: usize,
    /// The bandwidth read beside each one-stream run, in run order.
    pub runs: Vec<ProbedRun>,
}

/// One one-stream run with the read bandwidth measured beside it: the
/// mean of the best of [`BESIDE_PASSES`] reads just before it and just
/// after.
#[derive(Debug, Clone, Serialize)]
pub struct ProbedRun {
    pub workload: String,
    /// The engine configuration ([`super::workload::EngineConfig::short`]).
    pub config: &'static str,
    pub rep: usize,
    pub read_bytes_per_s: f64,
}

impl DramFloor {
    /// The bytes the floor divides by: the file's, else Kestrel's.
    pub fn bytes_per_token(&self) -> usize {
        self.file_bytes_per_token
            .unwrap_or(self.resident_bytes_per_token)
    }

    /// The most tokens per second one stream of any engine could decode.
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens_per_s_at(self.read_bytes_per_s)
    }

    /// The same limit at another read bandwidth (one read beside a run).
    pub fn tokens_per_s_at(&self, read_bytes_per_s: f64) -> f64 {
        read_bytes_per_s / self.bytes_per_token() as f64
    }

    /// The same limit for Kestrel's resident bytes.
    pub fn resident_tokens_per_s(&self) -> f64 {
        self.read_bytes_per_s / self.resident_bytes_per_token as f64
    }

    /// The mean bandwidth read beside `workload`'s runs on `config`, if
    /// any were probed.
    pub fn beside(&self, workload: &str, config: &str) -> Option<f64> {
        let reads: Vec<f64> = self
            .runs
            .iter()
            .filter(|r| r.workload == workload && r.config == config)
            .map(|r| r.read_bytes_per_s)
            .collect();
        (!reads.is_empty()).then(|| reads.iter().sum::<f64>() / reads.len() as f64)
    }
}

/// What any engine must read per decoded token from the GGUF at `path`:
/// every tensor's data except the token embedding (gathered, one row per
/// token), plus the output head, counted once even when it is the tied
/// embedding. `None` if `path` is not a GGUF file.
pub fn file_bytes_per_token(path: &Path) -> Option<usize> {
    let g = GgufFile::open(path).ok()?;
    let size = |name: &str| g.tensor_bytes(name).map(|(_, _, b)| b.len());
    let mut bytes = 0;
    for t in &g.tensors {
        if t.name != "token_embd.weight" {
            bytes += size(&t.name).ok()?;
        }
    }
    if g.tensor("output.weight").is_none() {
        bytes += size("token_embd.weight").ok()?;
    }
    Some(bytes)
}

/// A [`BUFFER_BYTES`] buffer, allocated once and placed as the engine
/// places a model's weights by default (on huge pages,
/// [`WeightPages::Huge`], also under `--mapped-weights`: on 4 KiB pages a
/// VM's reads ran a third slower, and the floor is the machine's best),
/// whose reads split over the bench's threads time the machine's read
/// bandwidth.
pub struct Probe {
    buf: Bytes,
    threads: usize,
}

impl Probe {
    pub fn new(threads: usize) -> anyhow::Result<Self> {
        // Non-zero contents, so every page is really allocated before timing.
        let mut buf = Bytes::from(
            (0..BUFFER_BYTES)
                .map(|i| (i as u8) | 1)
                .collect::<Vec<u8>>(),
        );
        WeightPages::Huge
            .place(&mut [&mut buf])
            .context("placing the read probe's buffer")?;
        Ok(Self {
            buf,
            threads: threads.max(1),
        })
    }

    /// The best of `passes` timed reads of the buffer, in bytes per second.
    pub fn read(&self, passes: usize) -> f64 {
        let chunk = BUFFER_BYTES.div_ceil(self.threads).next_multiple_of(64);
        let mut best = f64::MAX;
        for _ in 0..passes.max(1) {
            let start = Instant::now();
            std::thread::scope(|s| {
                for part in self.buf.chunks(chunk) {
                    s.spawn(move || std::hint::black_box(sum(part)));
                }
            });
            best = best.min(start.elapsed().as_secs_f64());
        }
        BUFFER_BYTES as f64 / best
    }

    /// `run`'s result and the bandwidth beside it: the mean of the best of
    /// [`BESIDE_PASSES`] reads just before it and the best of as many just
    /// after.
    pub fn beside<T>(&self, run: impl FnOnce() -> T) -> (T, f64) {
        let before = self.read(BESIDE_PASSES);
        let out = run();
        (out, (before + self.read(BESIDE_PASSES)) / 2.0)
    }
}

/// A sum the compiler vectorizes, eight independent u64 lanes per 64-byte
/// line, so the loop is bound by loads rather than by one add chain.
fn sum(v: &[u8]) -> u64 {
    let mut acc = [0u64; 8];
    for line in v.chunks_exact(64) {
        for (a, x) in acc.iter_mut().zip(line.chunks_exact(8)) {
            *a = a.wrapping_add(u64::from_ne_bytes(x.try_into().expect("8 bytes")));
        }
    }
    acc.iter().fold(0, |a, x| a.wrapping_add(*x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_bytes_skip_the_gathered_embedding_but_count_a_tied_head() {
        use kestrel_model::gguf::write_gguf;
        use kestrel_model::{DType, GgufValue};
        let dir = std::env::temp_dir().join(format!("kestrel-dram-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let t = |name: &'static str, rows: u64| {
            (
                name,
                vec![32, rows],
                DType::Q8_0,
                vec![0; 34 * rows as usize],
            )
        };
        let arch = [("general.architecture", GgufValue::String("llama".into()))];
        let tied = dir.join("tied.gguf");
        std::fs::write(
            &tied,
            write_gguf(
                &arch,
                &[t("token_embd.weight", 100), t("blk.0.ffn_up.weight", 3)],
            ),
        )
        .unwrap();
        assert_eq!(file_bytes_per_token(&tied), Some(34 * (100 + 3)));
        let untied = dir.join("untied.gguf");
        let tensors = [
            t("token_embd.weight", 100),
            t("output.weight", 100),
            t("blk.0.ffn_up.weight", 3),
        ];
        std::fs::write(&untied, write_gguf(&arch, &tensors)).unwrap();
        assert_eq!(file_bytes_per_token(&untied), Some(34 * (100 + 3)));
        assert_eq!(file_bytes_per_token(&dir), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn floor_is_bandwidth_over_bytes() {
        let mut f = DramFloor {
            read_bytes_per_s: 20e9,
            threads: 2,
            file_bytes_per_token: Some(100_000_000),
            resident_bytes_per_token: 125_000_000,
            runs: Vec::new(),
        };
        assert_eq!(f.tokens_per_s(), 200.0);
        assert_eq!(f.resident_tokens_per_s(), 160.0);
        f.file_bytes_per_token = None;
        assert_eq!(f.tokens_per_s(), 160.0);
        // Two lines of sixteen words.
        assert_eq!(sum(&[1; 128]), 16 * u64::from_ne_bytes([1; 8]));
    }

    #[test]
    fn beside_averages_a_rows_own_runs() {
        let run = |config, rep, gbs: f64| ProbedRun {
            workload: "1 stream, text".into(),
            config,
            rep,
            read_bytes_per_s: gbs * 1e9,
        };
        let f = DramFloor {
            read_bytes_per_s: 20e9,
            threads: 2,
            file_bytes_per_token: Some(100_000_000),
            resident_bytes_per_token: 100_000_000,
            runs: vec![
                run("blocking", 0, 18.0),
                run("pipe/ride", 0, 30.0),
                run("blocking", 1, 22.0),
            ],
        };
        assert_eq!(f.beside("1 stream, text", "blocking"), Some(20e9));
        assert_eq!(f.beside("1 stream, text", "pipe/ride"), Some(30e9));
        assert_eq!(f.beside("1 stream, text", "pipe/drain"), None);
        assert_eq!(f.beside("8 streams, text", "blocking"), None);
    }
}
