//! The claim loop's helpers, in a process of their own: the team has one job slot for the whole
//! process, and a loop another test posts after this one's takes the helper (correct: the caller
//! then runs the rest itself, but not what is checked here). Among the library's unit tests,
//! whose decode kernels post loops all the time, this check failed once under qemu in CI.

use std::sync::atomic::{AtomicU32, Ordering};

/// The team's helpers take chunks (a loop of slow chunks is not all the caller's), and a helper
/// parked after a quiet spell wakes for the next loop.
#[test]
fn helpers_take_chunks_and_wake_after_parking() {
    if rayon::current_num_threads() < 2 {
        eprintln!("one thread here: no helper to check");
        return;
    }
    for pause in [0, 5] {
        // A round passes when a helper ran a chunk; a busy machine (qemu beside other jobs) may
        // not schedule the helper within one round's 200 ms, a helper that never takes work or
        // never wakes fails all eight.
        let helped = (0..8).any(|_| {
            // Longer than the team's warm spell: the helpers are parked when the loop comes.
            std::thread::sleep(std::time::Duration::from_millis(pause));
            let by_helper = AtomicU32::new(0);
            candle_npu::kernels::claim::for_each_chunk(100, 1, 1, &|_| {
                std::thread::sleep(std::time::Duration::from_millis(2));
                if std::thread::current().name().is_some_and(|n| n.starts_with("candle-npu-claim")) {
                    by_helper.fetch_add(1, Ordering::Relaxed);
                }
            });
            by_helper.load(Ordering::Relaxed) > 0
        });
        assert!(helped, "after a pause of {pause} ms, no chunk ran on a helper in any of 8 rounds");
    }
}
