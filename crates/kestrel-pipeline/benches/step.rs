//! CPU cost of one pipeline step (schedule + launch bookkeeping + sample +
//! commit) with the simulated executor at batch 1, 32 and 256. The
//! simulated device does almost nothing, so the time is the pipeline's own.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kestrel_pipeline::testing::{SimConfig, SimExecutor, SimParams};
use kestrel_pipeline::{
    CommittedToken, EngineLoop, LoopConfig, Outcome, PipelineMode, Request, SequenceSkill, Tick,
    Verdict,
};

/// A skill that never stops (the bench controls length) and does no work.
struct Endless;

impl SequenceSkill for Endless {
    fn consume(&mut self, _token: &CommittedToken<'_>) -> Verdict {
        Verdict::Continue
    }
    fn finish(&mut self, _outcome: Outcome) {}
}

fn bench_steps(c: &mut Criterion) {
    let mut group = c.benchmark_group("pipeline_step");
    for &batch in &[1usize, 32, 256] {
        for mode in [PipelineMode::Blocking, PipelineMode::Pipelined] {
            let config = SimConfig {
                max_rows: batch,
                num_pages: batch * 4096,
                page_size: 1 << 20,
                vocab_size: 64,
                ..SimConfig::default()
            };
            let loop_config = LoopConfig {
                mode,
                max_batch_size: batch,
                max_seq_len: 1 << 31,
                debug_checks: false,
                ..LoopConfig::default()
            };
            let mut engine = EngineLoop::new(SimExecutor::new(config), loop_config).unwrap();
            for id in 0..batch as u64 {
                let req = Request {
                    id,
                    prompt: vec![1; 4],
                    max_new_tokens: 1 << 30,
                    params: SimParams {
                        seed: id,
                        ..Default::default()
                    },
                    speculate: None,
                    embeds: None,
                    skill: Box::new(Endless),
                };
                engine.submit(req).unwrap();
            }
            // Admit everyone, reach steady state.
            while engine.num_waiting() > 0 {
                engine.run_once();
            }
            for _ in 0..8 {
                engine.run_once();
            }
            group.throughput(Throughput::Elements(batch as u64));
            group.bench_with_input(
                BenchmarkId::new(format!("{mode:?}"), batch),
                &batch,
                |b, _| {
                    b.iter(|| {
                        // One decode step = launch+sample and one commit: two iterations
                        // in pipelined steady state, one in blocking.
                        let iters = if mode == PipelineMode::Pipelined {
                            2
                        } else {
                            1
                        };
                        for _ in 0..iters {
                            assert_eq!(engine.run_once(), Tick::Progress);
                        }
                    })
                },
            );
        }
    }
    group.finish();
}

criterion_group!(benches, bench_steps);
criterion_main!(benches);
