//! The INT8 GEMM for CPUs whose 8-bit multiply-add saturates (x86 AVX2 without VNNI): exact, in one
//! pass.
//!
//! Why 16-bit lanes: AVX2's 8-bit multiply-add (`vpmaddubsw`) sums two u8 * i8 products into a
//! *saturating* i16, and a u8 activation against an i8 weight reaches 2 * 255 * 127 > 32767. Its
//! 16-bit one (`vpmaddwd`) sums two i16 * i16 products into an i32, which 8-bit operands cannot
//! saturate. Both issue on the same two vector-multiply pipes of a Zen 3 core, and both yield 16
//! multiply-accumulates per pipe slot (`vpmaddubsw` does 32 but needs a `vpmaddwd` by ones to widen
//! its i16 sums), so the peak is the same, 32 MACs per cycle per core, with no saturation to work
//! around. The weights stay i8 in memory and are sign-extended as they are loaded (`vpmovsxbw`, off
//! the multiply pipes); the activations are widened to i16 once per call, with their offset folded in.
//!
//! Layout (GotoBLAS blocking, sized for Zen 3: 32 KiB L1d, 512 KiB L2 per core):
//! - weights: panels of [`NR`] = 16 columns; in a panel, each pair of K steps is 32 bytes, the 8
//!   (column, k, k + 1) pairs of columns 0-7, then those of columns 8-15 (one `vpmovsxbw` each);
//! - activations: row-major i16, K padded to even, rows padded to a multiple of [`MR`];
//! - a tile of [`MR`] x [`NR`] outputs keeps its 12 accumulators in registers over a block of at
//!   most `KC` pairs of K, K cut into equal blocks (the weight micro-panel, at most 10 KiB, stays
//!   in L1 while `MC` rows of activations, at most 330 KiB, stream through from L2, their
//!   lines prefetched by the tile two lines ahead);
//! - a tile of fewer than [`MR`] rows (a matrix's or a task's last) runs a kernel compiled for its
//!   row count, at about its share of a full tile's time;
//! - threads split the rows when each gets at least `ROWS_PER_TASK_MIN` (a task widens its own
//!   rows, runs every panel over them and hands the finished rows to the caller's `each`, so
//!   widening, tiles and the caller's dequantization need no barrier between them: +1-2% on a
//!   SmolLM2 prefill, up to +9% on the k, v GEMMs), else the panels (each core reads half of the
//!   weights); both in the caller's rayon pool.

use rayon::prelude::*;

use super::rows::rows_per_task;

/// Columns per weight panel (two 8-lane i32 accumulators).
pub const NR: usize = 16;
/// Rows per tile: 6 x 2 accumulators + 2 weight registers + 1 broadcast = 15 of 16 ymm registers.
pub const MR: usize = 6;
/// K pairs per block at most: a 16 x 640 weight micro-panel is 10 KiB of L1. K is cut into
/// equal blocks ([`k_block`]).
const KC: usize = 320;
/// Rows per block: 264 x 640 i16 activations are 330 KiB of L2.
const MC: usize = 264;

/// What a GEMM's caller runs on blocks of whole finished output rows (see [`Panels::matmul`]).
pub type EachRows<'a> = dyn Fn(&mut [i32]) + Sync + 'a;

/// Which tile kernel runs. The choice is made once per process ([`Int8Path::detect`]); tests run
/// every path this machine can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Path {
    /// `vpmaddwd` on i16 lanes (x86_64 with AVX2).
    Avx2,
    /// Plain Rust on the same layout: any CPU (and the AVX2 kernel's cross-check).
    Portable,
}

impl Int8Path {
    /// The fastest path this CPU runs.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            return Int8Path::Avx2;
        }
        Int8Path::Portable
    }

    fn tile(self) -> unsafe fn(Tile) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Int8Path::Avx2 => tile_avx2,
            #[cfg(not(target_arch = "x86_64"))]
            Int8Path::Avx2 => unreachable!("Int8Path::Avx2 is never detected off x86_64"),
            Int8Path::Portable => tile_portable,
        }
    }
}

/// An INT8 weight `[N, K]` in 16-column panels (see the module docs).
pub struct Panels {
    data: Vec<i8>,
    n: usize,
    k: usize,
    /// K rounded up to even.
    kp: usize,
}

impl Panels {
    /// Repacks `w` (`[N, K]`, row-major) into panels of 16 output columns, `K` zero-padded to even.
    pub fn new(w: &[i8], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "weight is not [N, K]");
        let kp = k.next_multiple_of(2);
        let n_panels = n.div_ceil(NR);
        let mut data = vec![0i8; n_panels * kp * NR];
        for (col, row) in w.chunks_exact(k.max(1)).enumerate() {
            let (p, j) = (col / NR, col % NR);
            let panel = &mut data[p * kp * NR..(p + 1) * kp * NR];
            let at = lane(j);
            for (kk, &v) in row.iter().enumerate() {
                panel[(kk / 2) * 32 + at + kk % 2] = v;
            }
        }
        Panels { data, n, k, kp }
    }

    /// Columns `cs` of the weight (`w[.., c]`, `N` values each), one after another. A column's 16
    /// values in a panel are one 32-byte pair block: a line per 16 outputs, where the row-major
    /// weight has a line per output.
    pub fn columns(&self, cs: &[usize]) -> Vec<i8> {
        let n = self.n;
        let mut out = vec![0i8; cs.len() * n];
        for (p, panel) in self.data.chunks_exact(self.kp * NR).enumerate() {
            let cols = NR.min(n - p * NR);
            for (j, &c) in cs.iter().enumerate() {
                let pair = &panel[(c / 2) * 32..][..32];
                for (i, v) in out[j * n + p * NR..][..cols].iter_mut().enumerate() {
                    *v = pair[lane(i) + c % 2];
                }
            }
        }
        out
    }

    /// `acc[m, n] = sum_k (x[m, k] + x_offset) * w[n, k]` in i32, on `path`. Exact: every
    /// `x + x_offset` must fit an i16 (the caller checks; see [`offset_fits`]).
    ///
    /// `each` runs on blocks of whole output rows once they are final, on the thread that
    /// computed them when rows are split over the threads (the caller's dequantization, while
    /// the rows are in cache), over the pool otherwise; every row is in exactly one block.
    pub fn matmul<T: Copy + Into<i32> + Sync>(&self, path: Int8Path, x: &[T], m: usize, x_offset: i32, each: &EachRows<'_>) -> Vec<i32> {
        assert_eq!(x.len(), m * self.k, "activation is not [M, K]");
        if m == 0 || self.n == 0 || self.k == 0 {
            let mut out = vec![0; m * self.n];
            if !out.is_empty() {
                each(&mut out);
            }
            return out;
        }
        let mut out = Vec::with_capacity(m * self.n);
        let c = SyncPtr(out.spare_capacity_mut().as_mut_ptr().cast::<i32>());
        let n_panels = self.n.div_ceil(NR);
        let threads = rayon::current_num_threads();
        // Rows split over the threads when each gets a few tiles' worth: a task widens its own
        // rows and runs every panel over them (no barrier between widening and the tiles).
        // Fewer rows: the panels are split, and the widening is shared.
        let row_tasks = if m >= threads * ROWS_PER_TASK_MIN { threads } else { 1 };
        if row_tasks > 1 {
            // Equal row counts, not whole tiles (a short tile costs its rows' share): 256 rows
            // were 22 tiles on one thread and 21 on the other (GEMM +1-3% in the micro-benchmark).
            let per = m.div_ceil(row_tasks);
            (0..m.div_ceil(per)).into_par_iter().for_each(|i| {
                let (r0, r1) = (i * per, ((i + 1) * per).min(m));
                with_widened(|a| {
                    self.widen(&x[r0 * self.k..r1 * self.k], r1 - r0, x_offset, a, false);
                    // SAFETY: `a` holds the task's rows padded to MR; the tasks write disjoint rows
                    // of `out` (capacity m * n).
                    unsafe { self.run_panels(path.tile(), a, r1 - r0, 0..n_panels, c.get().add(r0 * self.n)) }
                });
                // SAFETY: rows r0..r1 were all written above, by this task alone.
                each(unsafe { std::slice::from_raw_parts_mut(c.get().add(r0 * self.n), (r1 - r0) * self.n) });
            });
        } else {
            with_widened(|a| {
                self.widen(x, m, x_offset, a, true);
                let a: &[i16] = a;
                let threads = threads.min(n_panels);
                let run = |i: usize| {
                    let panels = n_panels * i / threads..n_panels * (i + 1) / threads;
                    // SAFETY: `a` holds `m` rows padded to MR, `out` has capacity m * n, and the panel
                    // ranges of the tasks are disjoint, so each output element is written by one task.
                    unsafe { self.run_panels(path.tile(), a, m, panels, c.get()) }
                };
                if threads <= 1 {
                    run(0);
                } else {
                    (0..threads).into_par_iter().for_each(run);
                }
            });
        }
        // SAFETY: the first K block of every tile wrote all m * n outputs (run_panels).
        unsafe { out.set_len(m * self.n) };
        if row_tasks == 1 {
            each_over_pool(&mut out, self.n, each);
        }
        out
    }

    /// `x + x_offset` as i16, row-major, K padded to even and rows to a multiple of MR with zeros:
    /// blocks of rows over the rayon pool when `parallel`, else on this thread. Every value of `a`
    /// is written (it is not zeroed first).
    fn widen<T: Copy + Into<i32> + Sync>(&self, x: &[T], m: usize, x_offset: i32, a: &mut Vec<i16>, parallel: bool) {
        let (k, kp) = (self.k, self.kp);
        a.resize(m.next_multiple_of(MR) * kp, 0);
        // In i16 lanes (the caller checked that every sum fits: `offset_fits`), which vectorize
        // without widening to i32 and packing back.
        let offset = x_offset as i16;
        let rows = |first: usize, rows: &mut [i16]| {
            for (i, dst) in rows.chunks_exact_mut(kp).enumerate() {
                let r = first + i;
                let (row, pad) = dst.split_at_mut(if r < m { k } else { 0 });
                if r < m {
                    for (d, &s) in row.iter_mut().zip(&x[r * k..(r + 1) * k]) {
                        *d = (s.into() as i16).wrapping_add(offset);
                    }
                }
                pad.fill(0);
            }
        };
        if parallel {
            let block = rows_per_task(m, kp);
            a.par_chunks_mut(block * kp).enumerate().for_each(|(b, a)| rows(b * block, a));
        } else {
            rows(0, a);
        }
    }

    /// Tiles of the panels in `panels`, blocked over K (`KC`) and rows (`MC`).
    ///
    /// # Safety
    /// `a` holds `m.next_multiple_of(MR)` rows of `kp`; `c` points to `m * n` i32 (maybe
    /// uninitialized: the first K block writes before any later block reads).
    unsafe fn run_panels(&self, tile: unsafe fn(Tile), a: &[i16], m: usize, panels: std::ops::Range<usize>, c: *mut i32) {
        let pairs = self.kp / 2;
        let kc = k_block(pairs);
        for t0 in (0..pairs).step_by(kc) {
            let t1 = (t0 + kc).min(pairs);
            for r0 in (0..m).step_by(MC) {
                let r1 = (r0 + MC).min(m);
                for p in panels.clone() {
                    let b = self.data.as_ptr().add((p * pairs + t0) * 32);
                    let cols = NR.min(self.n - p * NR);
                    for r in (r0..r1).step_by(MR) {
                        tile(Tile {
                            a: a.as_ptr().add(r * self.kp + 2 * t0),
                            a_stride: self.kp,
                            b,
                            pairs: t1 - t0,
                            c: c.add(r * self.n + p * NR),
                            ldc: self.n,
                            rows: MR.min(r1 - r),
                            cols,
                            accumulate: t0 > 0,
                        })
                    }
                }
            }
        }
    }
}

/// Where column `j` (0-15) of a panel's pair block starts: its (k, k + 1) values are at `lane`
/// and `lane + 1`, columns 0-7 in the first 16 bytes, 8-15 in the last (one `vpmovsxbw` each).
fn lane(j: usize) -> usize {
    (j / 8) * 16 + (j % 8) * 2
}

/// Pairs of K per block: `pairs` cut into equal blocks of at most `KC`. A short last block
/// (K = 576, the hidden size of SmolLM2: 256 + 32 pairs) pays a tile's fixed cost (its
/// accumulators read back, added and stored) for little work.
fn k_block(pairs: usize) -> usize {
    pairs.div_ceil(pairs.div_ceil(KC).max(1)).max(1)
}

/// Whether `x + offset` fits an i16 for every u8 or i8 `x` (the folded-offset precondition).
pub fn offset_fits(offset: i32) -> bool {
    (i16::MIN as i32 + 128..=i16::MAX as i32 - 255).contains(&offset)
}

thread_local! {
    /// The widened activations of this thread's last call: reused, so the hot path does not allocate.
    static WIDENED: std::cell::RefCell<Vec<i16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `each` on blocks of whole rows (of `n` values) of a finished product, over the rayon pool.
pub(crate) fn each_over_pool(out: &mut [i32], n: usize, each: &EachRows<'_>) {
    if !out.is_empty() {
        let n = n.max(1);
        out.par_chunks_mut(rows_per_task(out.len() / n, n) * n).for_each(each);
    }
}

/// `f` on this thread's widening buffer. A rayon worker waiting in a GEMM may run another GEMM
/// on its thread: that one widens into a buffer of its own.
fn with_widened<R>(f: impl FnOnce(&mut Vec<i16>) -> R) -> R {
    WIDENED.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => f(&mut buf),
        Err(_) => f(&mut Vec::new()),
    })
}

/// Rows per thread at least, for the GEMM to split rows rather than panels.
pub(crate) const ROWS_PER_TASK_MIN: usize = 8 * MR;

/// A raw output pointer shared by the tasks of one GEMM (they write disjoint columns).
#[derive(Clone, Copy)]
struct SyncPtr(*mut i32);
// SAFETY: the tasks that share it write disjoint elements (see `Panels::matmul`).
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// A method (not a field access), so that closures capture the whole `Sync` wrapper.
    fn get(self) -> *mut i32 {
        self.0
    }
}

/// One MR x NR output tile over `pairs` pairs of K.
struct Tile {
    /// Row 0 of the activations at this K block; MR rows, `a_stride` i16 apart (rows past `rows`
    /// are padding and may be read).
    a: *const i16,
    a_stride: usize,
    /// The panel at this K block: 32 bytes per pair.
    b: *const i8,
    pairs: usize,
    /// Output row 0, column 0 of the tile; rows `ldc` apart.
    c: *mut i32,
    ldc: usize,
    rows: usize,
    cols: usize,
    /// Add to the outputs (a later K block) instead of writing them.
    accumulate: bool,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn tile_avx2(t: Tile) {
    match t.rows {
        1 => rows_avx2::<1>(t),
        2 => rows_avx2::<2>(t),
        3 => rows_avx2::<3>(t),
        4 => rows_avx2::<4>(t),
        5 => rows_avx2::<5>(t),
        _ => rows_avx2::<MR>(t),
    }
}

/// The AVX2 tile on its first `R` rows: `R` pairs of accumulators, `R` broadcasts per pair.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn rows_avx2<const R: usize>(t: Tile) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_si256(); 2]; R];
    let a = t.a.cast::<i32>();
    let stride = t.a_stride / 2;
    for p in 0..t.pairs {
        // Each row's activations 32 pairs (two cache lines) ahead, once per line: the tile reads
        // MR rows of A from L2 in MR interleaved streams, and the hardware prefetcher left it
        // waiting on them (+8-10% GOPS on every SmolLM2 shape, 88-91% of the exact peak). A
        // prefetch never faults, so the lines past the block's end need no test. (Prefetching
        // the weight panel, one sequential stream, made it slower.)
        if p % 16 == 0 {
            for r in 0..R {
                _mm_prefetch::<_MM_HINT_T0>(a.wrapping_add(r * stride + p + 32).cast());
            }
        }
        // Columns 0-7 and 8-15, each lane pair (w[col, k], w[col, k + 1]) as i16.
        let b0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(t.b.add(32 * p).cast()));
        let b1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(t.b.add(32 * p + 16).cast()));
        for (r, acc) in acc.iter_mut().enumerate() {
            // (x[r, k], x[r, k + 1]) in every i32 lane.
            let x = _mm256_set1_epi32(a.add(r * stride + p).read_unaligned());
            acc[0] = _mm256_add_epi32(acc[0], _mm256_madd_epi16(x, b0));
            acc[1] = _mm256_add_epi32(acc[1], _mm256_madd_epi16(x, b1));
        }
    }
    for (r, &[lo, hi]) in acc.iter().enumerate().take(t.rows) {
        let c = t.c.add(r * t.ldc);
        if t.cols == NR {
            let (mut lo, mut hi) = (lo, hi);
            if t.accumulate {
                lo = _mm256_add_epi32(lo, _mm256_loadu_si256(c.cast()));
                hi = _mm256_add_epi32(hi, _mm256_loadu_si256(c.add(8).cast()));
            }
            _mm256_storeu_si256(c.cast(), lo);
            _mm256_storeu_si256(c.add(8).cast(), hi);
        } else {
            let mut row = [0i32; NR];
            _mm256_storeu_si256(row.as_mut_ptr().cast(), lo);
            _mm256_storeu_si256(row.as_mut_ptr().add(8).cast(), hi);
            store_row(c, &row[..t.cols], t.accumulate);
        }
    }
}

unsafe fn tile_portable(t: Tile) {
    let mut acc = [[0i32; NR]; MR];
    for p in 0..t.pairs {
        let b = std::slice::from_raw_parts(t.b.add(32 * p), 32);
        for (r, acc) in acc.iter_mut().enumerate() {
            let (x0, x1) = (*t.a.add(r * t.a_stride + 2 * p) as i32, *t.a.add(r * t.a_stride + 2 * p + 1) as i32);
            for (j, acc) in acc.iter_mut().enumerate() {
                let at = lane(j);
                *acc += x0 * b[at] as i32 + x1 * b[at + 1] as i32;
            }
        }
    }
    for (r, acc) in acc.iter().enumerate().take(t.rows) {
        store_row(t.c.add(r * t.ldc), &acc[..t.cols], t.accumulate);
    }
}

unsafe fn store_row(c: *mut i32, row: &[i32], accumulate: bool) {
    for (j, &v) in row.iter().enumerate() {
        *c.add(j) = if accumulate { *c.add(j) + v } else { v };
    }
}
