//! [`Team`]: a fixed set of compute threads for the forward pass's
//! fork/join regions, with a hand-off that costs well under a microsecond.
//!
//! A decode step runs about 150 parallel regions (the matmuls of 30 layers,
//! attention, the LM head). A general-purpose pool pays several
//! microseconds per region to inject work and to put idle workers to sleep
//! and wake them, which at batch 1 was a fifth of the step. A `Team` instead
//! keeps `threads - 1` helpers spinning briefly between regions, and the
//! calling thread works too: [`Team::for_each`] publishes the region in one
//! atomic word, every member claims task indices from it, and the caller
//! returns once its claims are exhausted and no helper is still inside a
//! task. Helpers that are parked or slow simply miss a region (the caller
//! and the others do its tasks), so no region ever waits for a sleeping
//! thread to wake.
//!
//! Which thread runs which task is not fixed; callers that need results
//! independent of the thread count (all of ours: see the crate's batch
//! invariance) make each task's output depend only on its index.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle helper spins for the next region before parking. Long
/// enough to bridge the gaps inside a forward pass and between pipelined
/// steps, short enough not to steal a core from an idle engine.
const SPIN: Duration = Duration::from_micros(50);

/// Bits of the region word: `epoch (24) | tasks (20) | next claim (20)`.
const IDX_BITS: u32 = 20;
/// Most tasks one published region carries; larger calls are folded.
const MAX_TASKS: usize = (1 << (IDX_BITS - 1)) - 1;
const IDX_MASK: u64 = (1 << IDX_BITS) - 1;

fn pack(epoch: u64, n: usize, next: usize) -> u64 {
    (epoch << (2 * IDX_BITS)) | ((n as u64) << IDX_BITS) | next as u64
}

/// `(epoch, tasks, next claim)` of a region word.
fn unpack(w: u64) -> (u64, usize, usize) {
    (
        w >> (2 * IDX_BITS),
        ((w >> IDX_BITS) & IDX_MASK) as usize,
        (w & IDX_MASK) as usize,
    )
}

thread_local! {
    /// Set on helpers and on a caller inside a region: nested regions run inline.
    static IN_REGION: Cell<bool> = const { Cell::new(false) };
}

/// The published task body, type-erased to a data pointer and a trampoline.
#[derive(Clone, Copy)]
struct Job {
    data: *const (),
    call: unsafe fn(*const (), usize),
}

/// Calls the `F` at `data` on task `i`.
///
/// # Safety
/// `data` must point at a live `F`.
unsafe fn trampoline<F: Fn(usize) + Sync>(data: *const (), i: usize) {
    // SAFETY: the caller guarantees `data` is a live `&F`.
    unsafe { (*(data as *const F))(i) }
}

/// State shared by the caller and the helpers.
struct Shared {
    /// The current region: see [`pack`]. Claims are `fetch_add(1)`.
    state: AtomicU64,
    /// The current region's body. Written only by the caller holding
    /// [`Team::caller`] while no helper can read it (see [`Team::for_each`]).
    job: UnsafeCell<Option<Job>>,
    /// Helpers between announcing themselves and finishing their claims.
    active: AtomicUsize,
    /// The first panic a helper caught in the current region.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    sleepers: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
}

// SAFETY: every field but `job` is Sync; `job` is written only by the one
// caller holding the team's caller lock, before it publishes the region with
// a SeqCst store, and read by helpers only after a successful claim (a SeqCst
// read-modify-write of that store or a later one) while they are counted in
// `active`, which the caller drains to zero before it writes `job` again.
// The `Job`'s pointee is `Sync` (`F: Sync`), so sharing it across threads is
// sound.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer in `job` is only a borrowed `&F` with
// `F: Sync`, valid for the region that published it.
unsafe impl Send for Shared {}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Claim and run tasks of the current region until it is exhausted.
    /// Must be called while counted in `active`.
    fn help(&self) {
        loop {
            let (_, n, i) = unpack(self.state.fetch_add(1, SeqCst));
            if i >= n {
                return;
            }
            // SAFETY: the claim succeeded, so the region that wrote `job`
            // is live and its caller is waiting for `active` to drain (see
            // the `Sync` impl); `job` is `Some` for every published region.
            let job = unsafe { (*self.job.get()).expect("published region has a job") };
            // SAFETY: `job.data` is the caller's `&F`, alive until the region ends.
            let run = panic::catch_unwind(AssertUnwindSafe(|| unsafe { (job.call)(job.data, i) }));
            if let Err(p) = run {
                lock(&self.panic).get_or_insert(p);
            }
        }
    }

    /// End the region with `epoch` and `n` tasks early: later claims fail.
    fn close(&self, epoch: u64, n: usize) {
        self.state.store(pack(epoch, n, n), SeqCst);
    }

    fn drain(&self) {
        let mut spins = 0u32;
        while self.active.load(SeqCst) != 0 {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            // A helper preempted mid-task: give its core back rather than
            // burn the rest of this time slice.
            if spins.is_multiple_of(1024) {
                std::thread::yield_now();
            }
        }
    }
}

/// A team of `threads` compute threads: the caller of [`Team::for_each`]
/// plus `threads - 1` helpers.
pub struct Team {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
    /// Serializes regions published from different threads.
    caller: Mutex<()>,
}

impl std::fmt::Debug for Team {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Team")
            .field("threads", &self.threads())
            .finish()
    }
}

impl Team {
    /// A team of `threads` (at least 1) with helper threads named
    /// `{name}-{i}`.
    pub fn new(threads: usize, name: &str) -> std::io::Result<Team> {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            active: AtomicUsize::new(0),
            panic: Mutex::new(None),
            sleepers: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let mut team = Team {
            shared,
            helpers: Vec::new(),
            caller: Mutex::new(()),
        };
        for i in 1..threads.max(1) {
            let s = Arc::clone(&team.shared);
            // On error `team` drops here, stopping the helpers already started.
            let h = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || helper(&s))?;
            team.helpers.push(h);
        }
        Ok(team)
    }

    /// Threads that run a region's tasks, the caller included.
    pub fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    /// Run `f(0) .. f(n - 1)`, each exactly once, spread over the team,
    /// and return when all have finished. A panic in any task is resumed
    /// on the caller once every task has stopped. Called from inside a
    /// task, it runs inline.
    pub fn for_each<F: Fn(usize) + Sync>(&self, n: usize, f: F) {
        if n == 0 {
            return;
        }
        if self.helpers.is_empty() || n == 1 || IN_REGION.with(Cell::get) {
            (0..n).for_each(f);
            return;
        }
        if n > MAX_TASKS {
            // Fold into MAX_TASKS tasks of consecutive indices.
            let per = n.div_ceil(MAX_TASKS);
            return self.region(n.div_ceil(per), |c| {
                (c * per..((c + 1) * per).min(n)).for_each(&f)
            });
        }
        self.region(n, f)
    }

    /// Publish and run one region of `n` (2..=MAX_TASKS) tasks.
    fn region<F: Fn(usize) + Sync>(&self, n: usize, f: F) {
        let _caller = lock(&self.caller);
        let s = &*self.shared;
        // SAFETY: no helper reads `job` now: the previous region drained
        // `active` to zero before returning, and a helper only reads `job`
        // after a successful claim, which needs a region published below.
        unsafe {
            *s.job.get() = Some(Job {
                data: &f as *const F as *const (),
                call: trampoline::<F>,
            })
        };
        let (epoch, ..) = unpack(s.state.load(SeqCst));
        let epoch = (epoch + 1) & ((1 << (64 - 2 * IDX_BITS)) - 1);
        s.state.store(pack(epoch, n, 0), SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            drop(lock(&s.park));
            s.wake.notify_all();
        }
        // Until the region is over, `f` (borrowed by the helpers) must live:
        // on a panic in the caller's own tasks this guard closes the region
        // and waits for the helpers before the unwind frees `f`.
        struct End<'a>(&'a Shared, u64, usize);
        impl Drop for End<'_> {
            fn drop(&mut self) {
                IN_REGION.with(|r| r.set(false));
                let unwinding = std::thread::panicking();
                if unwinding {
                    self.0.close(self.1, self.2);
                }
                self.0.drain();
                if unwinding {
                    // The caller's own panic wins; drop any helper's.
                    lock(&self.0.panic).take();
                }
                // SAFETY: `active` is zero and claims are exhausted, so no
                // helper reads `job` until the next region publishes.
                unsafe { *self.0.job.get() = None };
            }
        }
        let end = End(s, epoch, n);
        IN_REGION.with(|r| r.set(true));
        loop {
            let (_, n, i) = unpack(s.state.fetch_add(1, SeqCst));
            if i >= n {
                break;
            }
            f(i);
        }
        drop(end);
        if let Some(p) = lock(&s.panic).take() {
            panic::resume_unwind(p);
        }
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, SeqCst);
        drop(lock(&self.shared.park));
        self.shared.wake.notify_all();
        for h in self.helpers.drain(..) {
            let _ = h.join();
        }
    }
}

/// A helper's life: wait for a region, help with it, repeat.
fn helper(s: &Shared) {
    IN_REGION.with(|r| r.set(true));
    let mut seen = unpack(s.state.load(SeqCst)).0;
    loop {
        let mut start = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(SeqCst) {
                return;
            }
            let (epoch, n, next) = unpack(s.state.load(SeqCst));
            if epoch != seen {
                seen = epoch;
                if next < n {
                    break;
                }
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && start.elapsed() > SPIN {
                let mut g = lock(&s.park);
                s.sleepers.fetch_add(1, SeqCst);
                while unpack(s.state.load(SeqCst)).0 == seen && !s.shutdown.load(SeqCst) {
                    g = s.wake.wait(g).unwrap_or_else(PoisonError::into_inner);
                }
                s.sleepers.fetch_sub(1, SeqCst);
                // Woken: spin a full period again (the waking region may
                // already be over; the next one is likely close behind).
                start = Instant::now();
            }
        }
        s.active.fetch_add(1, SeqCst);
        s.help();
        s.active.fetch_sub(1, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_exactly_once() {
        let team = Team::new(3, "t").unwrap();
        for n in [0usize, 1, 2, 3, 7, 64, 1000] {
            for _ in 0..200 {
                let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                team.for_each(n, |i| {
                    hits[i].fetch_add(1, SeqCst);
                });
                assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "n = {n}");
            }
        }
    }

    #[test]
    fn helpers_share_the_work_and_survive_parking() {
        let team = Team::new(2, "t").unwrap();
        let others = AtomicU32::new(0);
        let me = std::thread::current().id();
        for round in 0..50 {
            if round % 10 == 9 {
                // Long enough for the helper to park; the next region wakes it.
                std::thread::sleep(SPIN * 4);
            }
            team.for_each(64, |_| {
                std::thread::sleep(Duration::from_micros(20));
                // Only rounds after the first park count: a helper that never
                // woke again must fail this.
                if round >= 10 && std::thread::current().id() != me {
                    others.fetch_add(1, SeqCst);
                }
            });
        }
        assert!(
            others.load(SeqCst) > 0,
            "the helper never ran a task after parking"
        );
    }

    #[test]
    fn nested_regions_run_inline() {
        let team = Team::new(2, "t").unwrap();
        let total = AtomicU32::new(0);
        team.for_each(8, |_| {
            team.for_each(8, |_| {
                total.fetch_add(1, SeqCst);
            })
        });
        assert_eq!(total.load(SeqCst), 64);
    }

    #[test]
    fn concurrent_callers_are_serialized() {
        let team = Team::new(2, "t").unwrap();
        let total = AtomicU32::new(0);
        std::thread::scope(|sc| {
            for _ in 0..3 {
                sc.spawn(|| {
                    for _ in 0..200 {
                        team.for_each(16, |_| {
                            total.fetch_add(1, SeqCst);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(SeqCst), 3 * 200 * 16);
    }

    #[test]
    fn a_task_panic_reaches_the_caller_and_the_team_keeps_working() {
        let team = Team::new(2, "t").unwrap();
        for bad in [0usize, 5, 63] {
            let r = panic::catch_unwind(AssertUnwindSafe(|| {
                team.for_each(64, |i| {
                    std::thread::sleep(Duration::from_micros(5));
                    assert!(i != bad, "task {i} fails");
                })
            }));
            assert!(r.is_err());
            let hits = AtomicU32::new(0);
            team.for_each(64, |_| {
                hits.fetch_add(1, SeqCst);
            });
            assert_eq!(hits.load(SeqCst), 64);
        }
    }

    #[test]
    fn folds_huge_task_counts() {
        let team = Team::new(2, "t").unwrap();
        let n = MAX_TASKS * 2 + 3;
        let sum = AtomicU64::new(0);
        team.for_each(n, |i| {
            sum.fetch_add(i as u64, SeqCst);
        });
        assert_eq!(sum.load(SeqCst), (n as u64 - 1) * n as u64 / 2);
    }

    #[test]
    fn word_packing_round_trips() {
        let w = pack(0xAB_CDEF, MAX_TASKS, 17);
        assert_eq!(unpack(w), (0xAB_CDEF, MAX_TASKS, 17));
    }
}
