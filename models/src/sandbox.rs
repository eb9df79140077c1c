//! Bounds for running code that comes with a model file: its chat template (Jinja, from a GGUF
//! or a `tokenizer_config.json`, written by whoever published the file).
//!
//! minijinja's sandbox keeps a template from files and the network, and
//! [`crate::chat::JinjaTemplate`] gives each render fuel (an instruction budget) and a bound on
//! the text it writes. Neither bounds memory: one instruction doubles a string
//! (`{% set ns.s = ns.s ~ ns.s %}`), so thirty of them hold a gigabyte. [`bounded`] runs a
//! render on a thread of its own under a memory budget and a deadline. The budget is
//! enforced by [`GuardedAlloc`] when the program installs it as its global allocator (the
//! example CLIs do; a library cannot choose a program's allocator):
//!
//! ```
//! #[global_allocator]
//! static ALLOC: candle_npu_models::sandbox::GuardedAlloc = candle_npu_models::sandbox::GuardedAlloc;
//! # fn main() {}
//! ```
//!
//! Without it, the fuel, the text bound and the deadline still hold. A run past its budget or
//! deadline cannot be stopped from outside its thread (Rust cannot kill a thread) and an
//! allocator must not unwind, so the allocator puts the thread to sleep for good at its next
//! allocation and the caller gets its error at once. The sleeping thread keeps what it took (at
//! most the budget); the template that did it is refused from then on, so a loaded model leaves
//! at most one such thread.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// What a bounded run may take.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Bytes its thread may hold at once (what it frees counts back; what it hands to its
    /// caller counts as still held).
    pub memory: usize,
    /// How long it may run.
    pub time: Duration,
}

/// Why a bounded run was stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stopped {
    /// It asked to hold more than [`Limits::memory`] bytes.
    Memory(usize),
    /// It ran past [`Limits::time`].
    Time(Duration),
    /// It panicked (a bug in the code it ran; the panic's message went to standard error).
    Panicked,
    /// No thread could be started for it.
    Spawn(String),
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stopped::Memory(b) => write!(f, "it asked for more than its {} MiB of memory", b >> 20),
            Stopped::Time(t) => write!(f, "it ran past its {:.0} s", t.as_secs_f64()),
            Stopped::Panicked => write!(f, "it panicked"),
            Stopped::Spawn(e) => write!(f, "no thread to run it on: {e}"),
        }
    }
}

/// A [`Watch`]'s states.
const RUNNING: u8 = 0;
const OVER_BUDGET: u8 = 1;
const CANCELLED: u8 = 2;

/// The state of one bounded run, shared by its thread and its caller.
struct Watch {
    state: AtomicU8,
}

thread_local! {
    /// Bytes this thread may hold; `usize::MAX` on every thread but a bounded run's. (`const`
    /// and without a destructor: reading it never allocates, which an allocator needs.)
    static LIMIT: Cell<usize> = const { Cell::new(usize::MAX) };
    /// Bytes this thread holds, as far as it allocated them (counted on a bounded run's only).
    static HELD: Cell<usize> = const { Cell::new(0) };
    /// The bounded run's watch on its thread, null elsewhere.
    static WATCH: Cell<*const Watch> = const { Cell::new(std::ptr::null()) };
}

/// Whether [`GuardedAlloc`] is the program's allocator (set at its first allocation).
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting what a [`bounded`] run's thread holds against its budget
/// (every other thread pays a thread-local read per call).
pub struct GuardedAlloc;

// SAFETY: every call is passed to `System` unchanged; `charge` and `release` only read and write
// this thread's counters, and past a budget `charge` never returns (it does not unwind).
unsafe impl GlobalAlloc for GuardedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        charge(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        charge(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        release(layout.size());
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        charge(new_size);
        release(layout.size());
        System.realloc(ptr, layout, new_size)
    }
}

/// Counts `bytes` more held by this thread; past its budget (or once the caller gave up), the
/// thread sleeps for good. Allocates nothing.
fn charge(bytes: usize) {
    if !INSTALLED.load(Ordering::Relaxed) {
        INSTALLED.store(true, Ordering::Relaxed);
    }
    let limit = LIMIT.get();
    if limit == usize::MAX {
        return;
    }
    let held = HELD.get().saturating_add(bytes);
    // SAFETY: set with `LIMIT` by `bounded`'s thread, which holds the `Arc` it points into
    // until it clears both (or forever, asleep below).
    let state = unsafe { &(*WATCH.get()).state };
    if held > limit || state.load(Ordering::Relaxed) == CANCELLED {
        let _ = state.compare_exchange(RUNNING, OVER_BUDGET, Ordering::AcqRel, Ordering::Relaxed);
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    HELD.set(held);
}

/// Counts `bytes` freed by this thread (memory it did not allocate counts as nothing held).
fn release(bytes: usize) {
    if LIMIT.get() != usize::MAX {
        HELD.set(HELD.get().saturating_sub(bytes));
    }
}

/// Whether the memory budget of [`bounded`] is enforced: [`GuardedAlloc`] is the program's
/// global allocator.
pub fn memory_bounded() -> bool {
    // An allocation first, so that an installed allocator has said so.
    drop(std::hint::black_box(Box::new(0u8)));
    INSTALLED.load(Ordering::Relaxed)
}

/// Runs `f` on a thread of its own within `limits` (see the module's docs), and its result.
pub fn bounded<T: Send + 'static>(limits: Limits, f: impl FnOnce() -> T + Send + 'static) -> Result<T, Stopped> {
    let watch = Arc::new(Watch { state: AtomicU8::new(RUNNING) });
    let (tx, rx) = mpsc::sync_channel(1);
    let theirs = watch.clone();
    std::thread::Builder::new()
        .name("bounded".into())
        .spawn(move || {
            WATCH.set(Arc::as_ptr(&theirs));
            LIMIT.set(limits.memory);
            let out = f();
            LIMIT.set(usize::MAX);
            WATCH.set(std::ptr::null());
            let _ = tx.send(out);
        })
        .map_err(|e| Stopped::Spawn(e.to_string()))?;
    let start = Instant::now();
    loop {
        match rx.recv_timeout(Duration::from_millis(5)) {
            Ok(out) => return Ok(out),
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(Stopped::Panicked),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if watch.state.load(Ordering::Acquire) == OVER_BUDGET {
                    return Err(Stopped::Memory(limits.memory));
                }
                if start.elapsed() > limits.time {
                    watch.state.store(CANCELLED, Ordering::Release);
                    return Err(Stopped::Time(limits.time));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits { memory: 1 << 20, time: Duration::from_secs(5) };

    #[test]
    fn a_run_within_its_limits_gives_its_result() {
        assert_eq!(bounded(LIMITS, || vec![1u8; 1000].len()), Ok(1000));
    }

    #[test]
    fn a_run_past_its_time_is_given_up() {
        let limits = Limits { time: Duration::from_millis(50), ..LIMITS };
        let t = Instant::now();
        assert_eq!(bounded(limits, || std::thread::sleep(Duration::from_secs(3))), Err(Stopped::Time(limits.time)));
        assert!(t.elapsed() < Duration::from_secs(2), "the caller waited for the run: {:?}", t.elapsed());
    }

    #[test]
    fn a_panicking_run_is_an_error() {
        assert_eq!(bounded(LIMITS, || -> u8 { panic!("a bug") }), Err(Stopped::Panicked));
    }

    #[test]
    fn without_the_allocator_memory_is_not_bounded_and_says_so() {
        // This binary's allocator is the system's: a run may take more than its budget.
        assert!(!memory_bounded());
        assert_eq!(bounded(LIMITS, || vec![0u8; 4 << 20].len()), Ok(4 << 20));
    }

    // With `GuardedAlloc` installed (`tests/chat.rs`, `tests/fuzz.rs`) a run past its budget is
    // stopped: `tests/chat.rs::a_hostile_template_is_stopped_at_its_bounds`.
}
