//! The steady-state decode step allocates nothing: plans, row lists and
//! mask buffers are reused (a sequence's first token with spatial values
//! reserves its list of them, once). Checked with a counting global allocator that
//! counts the test's own thread only: the engine loop and the simulated
//! executor run on the caller's thread (this crate starts none), while the
//! test harness's main thread may still be formatting its "test ... " line
//! when a loaded machine lets the test reach its window (seen once in CI:
//! 4 allocations in the window, none in 200 reruns).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use kestrel_pipeline::testing::{SimConfig, SimExecutor, SimParams, SimSkill};
use kestrel_pipeline::{EngineLoop, LoopConfig, PipelineMode, Request, Tick, TokenValues};

struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Whether this thread's allocations count (the test's thread). A
    /// const-initialized `Cell` without a destructor: reading it never
    /// allocates.
    static COUNTED: Cell<bool> = const { Cell::new(false) };
}

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // `try_with`: a thread being torn down has no flag, and is not ours.
        if COUNTED.try_with(Cell::get).unwrap_or(false) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn steady_state_steps_do_not_allocate() {
    COUNTED.with(|c| c.set(true));
    for mode in [PipelineMode::Blocking, PipelineMode::Pipelined] {
        for constrained in [false, true] {
            let sim = SimConfig {
                trace: false,
                page_size: 1 << 16,
                ..SimConfig::default()
            };
            let config = LoopConfig {
                mode,
                max_seq_len: 1 << 20,
                debug_checks: false,
                ..LoopConfig::default()
            };
            let mut e = EngineLoop::new(SimExecutor::new(sim), config).unwrap();
            let mut logs = Vec::new();
            for id in 0..16u64 {
                // SimSkill logs every token into a Vec: reserve so logging is not counted.
                let (skill, log) = SimSkill::new(Some(400), constrained.then_some(id));
                {
                    let mut log = log.lock().unwrap();
                    log.tokens.reserve(1000);
                    log.values.reserve(1000);
                }
                logs.push(log);
                let req = Request {
                    id,
                    prompt: vec![7; 3],
                    max_new_tokens: 10_000,
                    params: SimParams {
                        seed: id * 7919,
                        ..Default::default()
                    },
                    speculate: None,
                    embeds: None,
                    skill: Box::new(skill),
                };
                e.submit(req).unwrap();
            }
            while e.num_waiting() > 0 {
                e.run_once();
            }
            for _ in 0..6 {
                e.run_once();
            }
            // Whether each sequence has committed a token with values yet.
            let valued = || -> Vec<bool> {
                let zero = TokenValues::default();
                logs.iter()
                    .map(|l| l.lock().unwrap().values.iter().any(|v| *v != zero))
                    .collect()
            };
            let valued_before = valued();
            let before = ALLOCS.load(Ordering::Relaxed);
            for _ in 0..40 {
                assert_eq!(e.run_once(), Tick::Progress);
            }
            let allocs = ALLOCS.load(Ordering::Relaxed) - before;
            // EOS may finish a sequence in the window (finish() logs); only steps are measured.
            let finished = logs
                .iter()
                .filter(|l| l.lock().unwrap().outcome.is_some())
                .count();
            // A sequence starts keeping values at its first token with
            // non-zero ones: one allocation, once (`SIM_VALUED` leaves
            // some sequences none before the window).
            let started = valued_before
                .iter()
                .zip(valued())
                .filter(|&(&b, a)| !b && a)
                .count();
            assert!(allocs <= finished * 2 + started, "{mode:?} constrained={constrained}: {allocs} allocations in 40 steady-state iterations");
        }
    }
}
