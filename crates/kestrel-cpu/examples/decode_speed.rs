//! Decode/prefill throughput on SmolLM2-135M's shape (random Q4_1 weights),
//! reporting wall time and the process's CPU time per step (summed from
//! `/proc/self/task/*/schedstat`), which is steadier than wall time on a
//! shared machine. `cargo run --release -p kestrel-cpu --example decode_speed [threads] [steps] [batch]`
//! (batch 0 = the prefill only).

use std::time::Instant;

use kestrel_cpu::synth::{random_model, smollm2_config, DecodeInputs, PrefillInputs};
use kestrel_cpu::{CpuModel, CpuModelOptions, KvStore, LogitsMode, Scratch};
use kestrel_model::DType;

/// CPU nanoseconds used by all threads of this process so far (Linux).
fn cpu_ns() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("schedstat")).ok())
        .filter_map(|s| {
            s.split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
        })
        .sum()
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let threads = args.first().copied().unwrap_or(2);
    let steps = args.get(1).copied().unwrap_or(20);
    let cfg = smollm2_config();
    let model = CpuModel::new(
        random_model(&cfg, DType::Q4_1, DType::Q8_0, 7),
        CpuModelOptions {
            threads,
            ..Default::default()
        },
    )
    .unwrap();
    println!(
        "threads {threads}, isa {:?}, weights streamed per step {} MiB",
        model.isa(),
        model.bytes_per_token() >> 20
    );
    const PAGE: usize = 16;
    const CTX: usize = 128;
    let pps = CTX / PAGE;
    let mut kv = KvStore::for_model(&cfg, 32 * pps + 8, PAGE).unwrap();
    let mut scratch = Scratch::new(&model, 128, 1024);
    let vocab = cfg.vocab_size;
    let only = args.get(2).copied();
    for batch in [1usize, 8, 32]
        .into_iter()
        .filter(|b| only.is_none_or(|o| o == *b))
    {
        let inputs = DecodeInputs::interleaved(batch, CTX, PAGE);
        let mut out = vec![0f32; batch * vocab];
        let mut step = |kv: &mut KvStore, scratch: &mut Scratch| {
            model
                .forward_decode(inputs.batch(), kv, &mut out, scratch)
                .unwrap();
        };
        step(&mut kv, &mut scratch);
        let (t0, c0) = (Instant::now(), cpu_ns());
        let mut best = f64::INFINITY;
        for _ in 0..steps {
            let t = Instant::now();
            step(&mut kv, &mut scratch);
            best = best.min(t.elapsed().as_secs_f64());
        }
        let wall = t0.elapsed().as_secs_f64() / steps as f64;
        let cpu = (cpu_ns() - c0) as f64 * 1e-9 / steps as f64;
        println!(
            "decode batch {batch:2}: wall {:7.2} ms/step (best {:7.2}) -> {:7.1} tok/s (best {:7.1}); cpu {:7.2} ms/step",
            wall * 1e3,
            best * 1e3,
            batch as f64 / wall,
            batch as f64 / best,
            cpu * 1e3
        );
    }
    if only.is_some_and(|o| o != 0) {
        return;
    }
    let n = 128;
    let inputs = PrefillInputs::fresh(n, PAGE, vocab);
    let mut out = vec![0f32; vocab];
    let mut best = f64::INFINITY;
    let (t0, c0) = (Instant::now(), cpu_ns());
    let reps = steps.div_ceil(4).max(2);
    for _ in 0..reps {
        let t = Instant::now();
        model
            .forward_prefill(
                inputs.batch(),
                &mut kv,
                &mut out,
                LogitsMode::LastPerSequence,
                &mut scratch,
            )
            .unwrap();
        best = best.min(t.elapsed().as_secs_f64());
    }
    let wall = t0.elapsed().as_secs_f64() / reps as f64;
    let cpu = (cpu_ns() - c0) as f64 * 1e-9 / reps as f64;
    println!(
        "prefill {n}: wall {:7.1} ms -> {:7.1} tok/s (best {:7.1}); cpu {:7.1} ms",
        wall * 1e3,
        n as f64 / wall,
        n as f64 / best,
        cpu * 1e3
    );
}
