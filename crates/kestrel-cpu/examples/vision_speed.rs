//! Moondream's image encoder (`kestrel_cpu::vision::encode_image`) timed per
//! crop count on a checkpoint directory (e.g. the bench's synthetic one,
//! `~/.cache/kestrel/moondream-synth-bench-seed7-v1`): wall time and the
//! process's CPU time (summed from `/proc/self/task/*/schedstat`, steadier
//! than wall time on a shared machine), per image and per crop.
//! `cargo run --release -p kestrel-cpu --example vision_speed DIR [threads] [reps]`

use std::time::Instant;

use kestrel_cpu::vision::{encode_image, VisionRun};
use kestrel_cpu::{Isa, Numerics, Team};
use kestrel_model::moondream::{load_checkpoint, MoondreamConfig};
use kestrel_model::vision::{overlap_crops, RgbImage};

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
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(dir) = args.first().map(std::path::PathBuf::from) else {
        eprintln!("usage: vision_speed CHECKPOINT_DIR [threads] [reps]");
        std::process::exit(2);
    };
    let threads: usize = args.get(1).map_or(2, |s| s.parse().expect("threads"));
    let reps: usize = args.get(2).map_or(3, |s| s.parse().expect("reps"));
    let config = MoondreamConfig::from_file(&dir.join("config.json")).expect("config.json");
    let weights = load_checkpoint(&dir, config.clone()).expect("checkpoint");
    let team = Team::new(threads, "vision-speed").expect("team");
    let run = VisionRun {
        team: Some(&team),
        isa: Isa::detect(),
        numerics: Numerics::Fast,
    };
    // The bench's image sizes: 1 tile (2 crops) and 3x3 tiles (10 crops).
    for (w, h) in [(378u32, 378u32), (392, 392)] {
        let px = (0..w * h * 3)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let image = RgbImage::from_raw(w, h, px).expect("image");
        let crops = overlap_crops(&image, &config.vision.crop_geometry());
        let n = crops.count() as f64;
        for _ in 0..reps {
            let (t0, c0) = (Instant::now(), cpu_ns());
            let tokens =
                encode_image(run, &weights.vision, &config.vision, &crops).expect("encode");
            let (wall, cpu) = (
                t0.elapsed().as_secs_f64() * 1e3,
                (cpu_ns() - c0) as f64 / 1e6,
            );
            std::hint::black_box(tokens);
            println!(
                "{w}x{h} crops {n:2}: wall {wall:7.1} ms ({:6.1}/crop), cpu {cpu:7.1} ms ({:6.1}/crop)",
                wall / n,
                cpu / n
            );
        }
    }
}
