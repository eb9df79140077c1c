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
//! helper may need). The helpers are rayon's workers, asked with `rayon::spawn`: no thread of
//! ours, nothing to shut down.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Shared by the caller and its helpers for one loop.
struct Cursor {
    next: AtomicUsize,
    done: AtomicUsize,
    chunks: usize,
    chunk: usize,
    n: usize,
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
            unsafe { (*job)(start..(start + self.chunk).min(self.n)) };
            self.done.fetch_add(1, Ordering::AcqRel);
            ran += 1;
        }
    }
}

/// A `*const` that may cross to a helper thread (see the SAFETY notes at its uses).
struct SendPtr(*const (dyn Fn(Range<usize>) + Sync + 'static));
// SAFETY: the pointee is `Sync`, and it is only dereferenced while the caller keeps it alive.
unsafe impl Send for SendPtr {}

/// Runs `f` over `0..n` in chunks of `chunk` items, on the calling thread and on up to
/// `helpers` of rayon's workers; returns when every chunk is done. Every chunk runs exactly
/// once; which thread runs it is not determined, so `f` must write disjoint outputs per range.
pub fn for_each_chunk(n: usize, chunk: usize, helpers: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
    let chunk = chunk.max(1);
    let chunks = n.div_ceil(chunk);
    if chunks <= 1 || helpers == 0 {
        if n > 0 {
            f(0..n);
        }
        return;
    }
    let cursor = Arc::new(Cursor { next: AtomicUsize::new(0), done: AtomicUsize::new(0), chunks, chunk, n });
    // SAFETY: the lifetime is erased so that a helper (a `'static` job) can hold the pointer; it
    // dereferences it only for a chunk it claimed, and this function returns only when every
    // claimed chunk is done, so `f` outlives every use.
    let job: *const (dyn Fn(Range<usize>) + Sync + 'static) = unsafe { std::mem::transmute(f as *const (dyn Fn(Range<usize>) + Sync)) };
    for _ in 0..helpers.min(chunks - 1) {
        let (cursor, job) = (cursor.clone(), SendPtr(job));
        rayon::spawn(move || {
            let job = job;
            // SAFETY: see `Cursor::work`.
            unsafe { cursor.work(job.0) };
        });
    }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

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
