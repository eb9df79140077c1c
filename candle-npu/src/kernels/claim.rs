//! Splitting one short parallel loop (a decode step's matrix-vector product: tens of
//! microseconds) over the cores in a way that holds up beside other busy processes.
//!
//! candle's CPU pool (its barrier pool) hands each worker a share and then spin-waits until
//! every worker has signalled, even one that has not started: on a 2-core machine with one core
//! taken by another process, every product waits for the operating system to give that worker a
//! time slice: SmolLM2 decoded 14 tokens/s beside a busy process against 90 quiet
//! (`docs/decode.md` has the measurements, and the decode speed with this loop).
//!
//! Here the caller works too, and every participant claims the next chunk from a shared cursor:
//! a helper that starts late finds nothing left and returns, and the caller waits only for
//! chunks a helper has claimed and not finished (yielding its core meanwhile, which a preempted
//! helper may need). The helpers are a team of this module's own threads that stay awake briefly
//! between loops (`Team`), so that handing a helper a product costs no system call.

use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

/// Shared by the caller and its helpers for one loop.
struct Cursor {
    next: AtomicUsize,
    done: AtomicUsize,
    chunks: usize,
    chunk: usize,
    n: usize,
    /// The first panic of a chunk, whichever thread ran it: the caller raises it once every
    /// claimed chunk is done (a helper that unwound would leave its chunk undone, and the caller
    /// waiting for it forever; a caller that unwound at once would free `f` under a helper).
    panic: std::sync::Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

impl Cursor {
    /// Claims and runs chunks until none is left. Returns how many this participant ran.
    ///
    /// # Safety
    /// `job` must be alive: the caller of [`for_each_chunk`] keeps it alive until every claimed
    /// chunk is done, and a chunk is only claimed here, before `job` is used.
    unsafe fn work(&self, job: *const (dyn Fn(Range<usize>) + Sync)) -> usize {
        let mut ran = 0;
        loop {
            let c = self.next.fetch_add(1, Ordering::AcqRel);
            if c >= self.chunks {
                return ran;
            }
            let start = c * self.chunk;
            // SAFETY: `c` is claimed, so the caller is still waiting for it (see above).
            let run = || unsafe { (*job)(start..(start + self.chunk).min(self.n)) };
            if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
                self.panic.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(payload);
            }
            self.done.fetch_add(1, Ordering::AcqRel);
            ran += 1;
        }
    }
}

/// A `*const` that may cross to a helper thread (see the SAFETY notes at its uses).
#[derive(Clone, Copy)]
struct SendPtr(*const (dyn Fn(Range<usize>) + Sync + 'static));
// SAFETY: the pointee is `Sync`, and it is only dereferenced while the caller keeps it alive.
unsafe impl Send for SendPtr {}
// SAFETY: as for `Send`: shared only to be copied out and dereferenced under the same rule.
unsafe impl Sync for SendPtr {}

/// Runs `f` over `0..n` in chunks of `chunk` items, on the calling thread and, when `helpers`
/// is not 0, on the team's threads (`Team`); returns when every chunk is done. Every chunk runs
/// exactly once; which thread runs it is not determined, so `f` must write disjoint outputs per
/// range.
pub fn for_each_chunk(n: usize, chunk: usize, helpers: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
    let chunk = chunk.max(1);
    let chunks = n.div_ceil(chunk);
    // The team is started by the first loop that could use it, not by every caller.
    let Some(team) = (chunks > 1 && helpers > 0).then(Team::get).filter(|t| t.size > 0) else {
        if n > 0 {
            f(0..n);
        }
        return;
    };
    let cursor = Arc::new(Cursor { next: AtomicUsize::new(0), done: AtomicUsize::new(0), chunks, chunk, n, panic: Default::default() });
    // SAFETY: the lifetime is erased so that a helper (a `'static` thread) can hold the pointer;
    // it dereferences it only for a chunk it claimed, and this function returns only when every
    // claimed chunk is done, so `f` outlives every use.
    let job: *const (dyn Fn(Range<usize>) + Sync + 'static) = unsafe { std::mem::transmute(f as *const (dyn Fn(Range<usize>) + Sync)) };
    team.post(Posted { cursor: cursor.clone(), job: SendPtr(job), epoch: 0 });
    // SAFETY: `f` is alive for this whole call.
    unsafe { cursor.work(job) };
    // Every chunk is claimed now; wait for the ones helpers are still running. Spin briefly
    // (a chunk takes microseconds), then yield: a helper preempted mid-chunk needs a core.
    let mut spins = 0u32;
    while cursor.done.load(Ordering::Acquire) < chunks {
        if spins < 2_000 {
            std::hint::spin_loop();
            spins += 1;
        } else {
            std::thread::yield_now();
        }
    }
    let panic = cursor.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(payload) = panic {
        std::panic::resume_unwind(payload);
    }
}

/// Whether helpers pay for a loop of a given size, learnt from the loops' own times.
///
/// Below [`Tuner::ALONE`] units of work (a product's weights times its input rows) the caller
/// works alone, from [`Tuner::TEAM`] on with the team; in between it depends on the machine,
/// by a factor: SmolLM2's one-stream decode, whose products but the output table are all in the
/// band, decoded 1.18-1.21x llama.cpp's speed with them alone on a 2-core AMD EPYC, where one
/// core reads most of the machine's bandwidth, and 1.10-1.15x with helpers (`docs/decode.md`);
/// on a 2-core Intel Xeon it decoded 100.6-101.5 tokens/s alone, 137.6-143.5 with helpers and
/// 137.1-145.9 with this tuner (2026-12-02, `bench_decode --streams 1`, three interleaved runs of
/// three rounds). So in the band each size class (a power of two, and one input row
/// or several) measures both: each way [`Tuner::WARMUP`] times first, then the faster by the
/// mean of its recent times (ns per unit, weight 1/8 to the newest), and the other every
/// [`Tuner::EXPLORE`]th loop, so a machine whose load changes (a busy process on the other core)
/// turns back. Who runs a chunk never changes its values, so neither does the choice. What it
/// does not see: beside a busy process, a helper kept awake costs the caller time slices outside
/// the products (the Xeon's one stream 77-80 tokens/s there, 83-88 never asking helpers;
/// `docs/decode.md`).
pub struct Tuner {
    classes: [Class; 2 * Tuner::BANDS],
}

/// One size class's record: per way (alone, with the team) the loops timed and their recent
/// mean (f32 bits, ns per unit). Updated without a lock: two loops recording at once may lose
/// one sample, which a mean of many does not miss.
struct Class {
    loops: AtomicU32,
    timed: [AtomicU32; 2],
    mean: [AtomicU32; 2],
}

impl Class {
    const fn new() -> Self {
        Class { loops: AtomicU32::new(0), timed: [const { AtomicU32::new(0) }; 2], mean: [const { AtomicU32::new(0) }; 2] }
    }
}

impl Tuner {
    /// Below this many units a loop runs on the caller alone (a helper's start costs about a
    /// microsecond, a few percent of such a loop).
    pub const ALONE: usize = 1 << 16;
    /// From this many a loop runs with the team (alone it takes over 50 us on the cores
    /// measured, and helpers were faster on both machines).
    pub const TEAM: usize = 1 << 21;
    const BANDS: usize = (Self::TEAM.trailing_zeros() - Self::ALONE.trailing_zeros()) as usize;
    /// Times each way is measured before the faster is chosen.
    pub const WARMUP: u32 = 8;
    /// Every this many loops of a class take the way not chosen.
    pub const EXPLORE: u32 = 32;

    /// A tuner that has measured nothing yet.
    pub const fn new() -> Self {
        Tuner { classes: [const { Class::new() }; 2 * Self::BANDS] }
    }

    /// [`for_each_chunk`] of `n` items in chunks of `chunk` with helpers when they pay for
    /// `units` of work; `rows` (the input rows) picks the class with `units`.
    pub fn for_each_chunk(&self, units: usize, rows: usize, n: usize, chunk: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        let helpers = rayon::current_num_threads().saturating_sub(1);
        let class = match units {
            _ if helpers == 0 || units < Self::ALONE => return for_each_chunk(n, chunk, 0, f),
            _ if units >= Self::TEAM => return for_each_chunk(n, chunk, helpers, f),
            _ => (units.ilog2() - Self::ALONE.ilog2()) as usize + Self::BANDS * usize::from(rows > 1),
        };
        let team = self.choose(class);
        let t = std::time::Instant::now();
        for_each_chunk(n, chunk, if team { helpers } else { 0 }, f);
        self.record(class, team, t.elapsed().as_nanos() as f32 / units as f32);
    }

    /// Whether the next loop of `class` takes the team.
    fn choose(&self, class: usize) -> bool {
        let c = &self.classes[class];
        let loops = c.loops.fetch_add(1, Ordering::Relaxed);
        let [alone, team] = [0, 1].map(|w| c.timed[w].load(Ordering::Relaxed));
        if alone < Self::WARMUP || team < Self::WARMUP {
            return team < alone;
        }
        let faster = f32::from_bits(c.mean[1].load(Ordering::Relaxed)) < f32::from_bits(c.mean[0].load(Ordering::Relaxed));
        faster != loops.is_multiple_of(Self::EXPLORE)
    }

    /// A loop of `class` took `ns` per unit, with the team or alone.
    fn record(&self, class: usize, team: bool, ns: f32) {
        let c = &self.classes[class];
        let w = usize::from(team);
        let timed = c.timed[w].fetch_add(1, Ordering::Relaxed);
        let mean = f32::from_bits(c.mean[w].load(Ordering::Relaxed));
        // A loop that waited for the system (a parked helper's wake-up, a preemption) counts as
        // at most twice the mean: such outliers would otherwise steer the choice for many loops,
        // where a lasting change still moves the mean by an eighth a loop.
        let mean = if timed == 0 { ns } else { mean + (ns.min(2.0 * mean) - mean) / 8.0 };
        c.mean[w].store(mean.to_bits(), Ordering::Relaxed);
    }
}

impl Default for Tuner {
    fn default() -> Self {
        Self::new()
    }
}

/// A loop posted to the team.
#[derive(Clone)]
struct Posted {
    cursor: Arc<Cursor>,
    job: SendPtr,
    epoch: u64,
}

/// The helper threads, one per core but the caller's (rayon's thread count, less one), started
/// at first use and kept for the process. Between loops a helper spins for [`Team::HOT`], then
/// goes on spinning with a yield every 64 turns until [`Team::WARM`], then parks: within a decode step (a product every 10-40 us) it
/// is awake when the next loop is posted, so handing it work costs no system call; beside a busy
/// process its yields give the core away, and an idle process parks it at once.
///
/// (Rayon's `spawn` woke a parked worker per product: with helpers for every product of 64K
/// weights or more, SmolLM2 decoded 197 tokens/s on 2 threads against 226 on one.)
struct Team {
    size: usize,
    epoch: std::sync::atomic::AtomicU64,
    job: std::sync::Mutex<Option<Posted>>,
    wake: std::sync::Condvar,
    parked: AtomicUsize,
}

impl Team {
    /// Spinning on the epoch after a loop.
    const HOT: std::time::Duration = std::time::Duration::from_micros(50);
    /// Spinning with yields after that, before parking.
    const WARM: std::time::Duration = std::time::Duration::from_micros(500);

    fn get() -> &'static Team {
        static TEAM: std::sync::OnceLock<&'static Team> = std::sync::OnceLock::new();
        TEAM.get_or_init(|| {
            let size = rayon::current_num_threads().saturating_sub(1);
            let team: &'static Team = Box::leak(Box::new(Team {
                size,
                epoch: std::sync::atomic::AtomicU64::new(0),
                job: std::sync::Mutex::new(None),
                wake: std::sync::Condvar::new(),
                parked: AtomicUsize::new(0),
            }));
            for i in 0..size {
                // A helper that did not start leaves its share to the others and the caller,
                // which runs every chunk no one claims.
                if let Err(e) = std::thread::Builder::new().name(format!("candle-npu-claim-{i}")).spawn(move || team.help()) {
                    tracing::warn!("claim: helper thread {i} not started ({e}); loops run with fewer helpers");
                }
            }
            team
        })
    }

    /// Makes `p` the loop helpers take next, waking parked ones.
    fn post(&self, mut p: Posted) {
        let mut job = self.job.lock().unwrap_or_else(|e| e.into_inner());
        p.epoch = self.epoch.load(Ordering::Relaxed) + 1;
        *job = Some(p);
        // Under the lock: a helper checks the epoch under it before it waits.
        self.epoch.fetch_add(1, Ordering::AcqRel);
        if self.parked.load(Ordering::Acquire) > 0 {
            self.wake.notify_all();
        }
    }

    /// A helper's life: wait for a loop newer than the last one it saw, claim its chunks.
    fn help(&self) {
        let mut seen = 0u64;
        loop {
            let since = std::time::Instant::now();
            let mut spins = 0u32;
            while self.epoch.load(Ordering::Acquire) == seen {
                spins = spins.wrapping_add(1);
                // The clock is read every 64 spins only.
                let waited = if spins.is_multiple_of(64) { since.elapsed() } else { std::time::Duration::ZERO };
                if waited < Self::HOT {
                    std::hint::spin_loop();
                } else if waited < Self::WARM || !spins.is_multiple_of(64) {
                    std::thread::yield_now();
                } else {
                    let mut job = self.job.lock().unwrap_or_else(|e| e.into_inner());
                    self.parked.fetch_add(1, Ordering::AcqRel);
                    while self.epoch.load(Ordering::Acquire) == seen {
                        job = self.wake.wait(job).unwrap_or_else(|e| e.into_inner());
                    }
                    self.parked.fetch_sub(1, Ordering::AcqRel);
                    break;
                }
            }
            let posted = self.job.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if let Some(p) = posted {
                seen = p.epoch;
                // SAFETY: see `Cursor::work`: a chunk is dereferenced only once claimed, while
                // the poster waits for it.
                unsafe { p.cursor.work(p.job.0) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fed times, the tuner measures each way first, then takes the faster with the other every
    /// `EXPLORE`th loop, and turns when the times do (the other core taken, say).
    #[test]
    fn the_tuner_takes_the_faster_way_and_turns_when_it_changes() {
        let t = Tuner::new();
        let run = |team_ns: f32, alone_ns: f32, loops: usize| -> usize {
            (0..loops)
                .filter(|_| {
                    let team = t.choose(3);
                    t.record(3, team, if team { team_ns } else { alone_ns });
                    team
                })
                .count()
        };
        assert_eq!(run(1.0, 2.0, 2 * Tuner::WARMUP as usize), Tuner::WARMUP as usize, "each way measured first");
        let n = 32 * Tuner::EXPLORE as usize;
        let with_team = run(1.0, 2.0, n);
        assert_eq!(with_team, n - n / Tuner::EXPLORE as usize, "the team, the faster, but every EXPLORE-th loop");
        let after = run(3.0, 2.0, n);
        assert!(after < n / 8, "the team slower now: {after} of {n} loops still took it");
        assert_eq!(t.classes[4].timed.each_ref().map(|c| c.load(Ordering::Relaxed)), [0, 0], "another class untouched");
    }

    #[test]
    fn every_item_runs_exactly_once_whatever_the_chunking() {
        for (n, chunk, helpers) in [(0, 4, 1), (1, 4, 1), (10, 3, 1), (1000, 7, 3), (64, 64, 1), (65, 64, 2), (5, 1, 8)] {
            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            for_each_chunk(n, chunk, helpers, &|r: Range<usize>| {
                assert!(r.end <= n && r.start < r.end, "{r:?} of {n}");
                r.for_each(|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n {n} chunk {chunk} helpers {helpers}");
        }
    }

    /// A chunk that panics, on a helper or on the caller, panics the caller with its message
    /// once the other chunks are done (not a hang, not an abort), and the team keeps working.
    #[test]
    fn a_panicking_chunk_panics_the_caller_after_the_others() {
        for bad in [0usize, 7] {
            let done = AtomicU32::new(0);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                for_each_chunk(8, 1, 1, &|r: Range<usize>| {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                    if r.start == bad {
                        panic!("chunk {bad} failed");
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                });
            }));
            let msg = r.expect_err("the loop must panic").downcast::<String>().map(|m| *m).unwrap_or_default();
            assert_eq!(msg, format!("chunk {bad} failed"));
            assert_eq!(done.load(Ordering::Relaxed), 7, "every other chunk ran before the panic was raised");
        }
        let hits = AtomicU32::new(0);
        for_each_chunk(100, 3, 1, &|r: Range<usize>| {
            hits.fetch_add(r.len() as u32, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 100, "the team works after a panic");
    }

    #[test]
    fn returns_only_when_a_slow_helper_chunk_is_done() {
        // Chunks that take a while: whatever thread runs them, all are done at return.
        let done = AtomicU32::new(0);
        for_each_chunk(8, 1, 1, &|_| {
            std::thread::sleep(std::time::Duration::from_millis(5));
            done.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(done.load(Ordering::Relaxed), 8);
    }
}
