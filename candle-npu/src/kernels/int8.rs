//! Our INT8 GEMM: exact, in one pass, for x86 CPUs whose 8-bit multiply-add saturates (AVX2
//! without VNNI) and for every aarch64 CPU (NEON, dotprod, i8mm).
//!
//! # x86_64: 16-bit lanes
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
//! # aarch64: 8-bit lanes
//!
//! Arm's 8-bit instructions are signed x signed and never saturate: `sdot` sums 4 i8 x i8 products
//! into an i32 lane, `smmla` 8 (each at most 128 * 128, so 4 * 2^14 and 8 * 2^14 per step), and
//! `smull` makes exact i16 products that `sadalp` adds in pairs into i32 lanes. So the activations
//! stay 8-bit: a u8 `x` becomes the i8 `x - 128` (the sign bit flipped) and the caller adds
//! `(128 + offset) * col_sums` to the i32 sums after ([`Int8Path::fold`]); an i8 `x` is taken as
//! is, and the caller adds `offset * col_sums`. Every sum is exact mod 2^32, so every output that
//! fits an i32 equals the reference.
//!
//! | path | instruction | MACs per instruction | weight K group | tile (mr x NR) |
//! |------|-------------|----------------------|----------------|----------------|
//! | [`Int8Path::I8mm`] | `smmla` (2 x 8 by 8 x 2) | 32 | 8 | 6 x 16: 24 accumulators |
//! | [`Int8Path::Dotprod`] | `sdot` by element | 16 | 4 | 6 x 16: 24 accumulators |
//! | [`Int8Path::Neon`] | `smull` + `sadalp` | 8 per pair | 2 | 4 x 16: 16 accumulators |
//! | [`Int8Path::Avx2`] | `vpmaddwd` (x86_64) | 16 | 2 | 6 x 16: 12 ymm accumulators |
//!
//! The tiles and their inner loops as compiled (rustc 1.96, read from the disassembly; the
//! symbols are `candle_npu::kernels::int8::tile_i8mm`, `tile_dotprod` and `tile_neon`, one per path,
//! for llvm-mca), of the 32 NEON registers, none spilled:
//! - dotprod, 6 x 16 per K group of 4 (384 MACs): 4 weight registers (16 columns x 4 K: 64
//!   bytes), 2 activation registers (6 rows x 4 K, a row per 32-bit lane: `sdot v.4s, w.16b,
//!   x.4b[row]`, the by-element form, so no broadcast instruction), 24 `sdot`s; 32 instructions
//!   (24 `sdot`, 2 `ldp q` + `ldr q` + `ldr d`, 2 pointer adds, `subs`, `b.ne`), 30 registers.
//! - i8mm, 6 x 16 per K group of 8 (768 MACs): 3 activation registers (row pairs x 8 K), each
//!   column pair's 16 bytes used by 3 `smmla`s; 34 instructions (24 `smmla`, 4 `ldp q` of weights,
//!   `ldp q` + `ldr q` of activations, 2 adds, `subs`, `b.ne`), 29 registers. A 2 x 2 accumulator
//!   holds two rows of two columns: the store zips them back into rows (`zip1`/`zip2`).
//! - NEON, 4 x 16 per pair of K (128 MACs): 4 weight registers (4 columns x 2 K each), a row's
//!   pair broadcast to every 16-bit lane (`ld1r`), 4 `smull` + 4 `sadalp` per row; 45
//!   instructions (16 `smull`, 16 `sadalp`, 2 `ldp d`, 4 `ld1r`, 5 address adds: `ld1r` has no
//!   offset form, `subs`, `b.ne`), 29 registers. 6 rows spilled two accumulators ([`MR_NEON`]).
//!
//! A 4 x 16 sdot tile would load the weights for 4 rows instead of 6 (0.31 loads per `sdot`
//! instead of 0.25); 8 x 16 would need 32 accumulators. The panels are 16 columns wide on every
//! path, so [`Panels::columns`] reads one K group per 16 outputs on each.
//!
//! Phone speed cannot be measured on this machine (the Arm paths run under qemu, which checks the
//! results, not the timing); it can only be estimated: a Cortex-X3/X4 core has four 128-bit
//! vector pipes, so at one `sdot` per pipe and cycle (64 MACs) the dotprod loop takes 6 cycles per
//! step, its 4 loads and 4 scalar instructions beside them, and `smmla` doubles the MACs per
//! instruction where a core issues it at the same rate. llvm-mca 14 (no Cortex-X model) puts the
//! dotprod loop at 13 cycles per step on a Cortex-A76 (2 `sdot` pipes: 30 of its 32 MACs per
//! cycle).
//!
//! # Layout (GotoBLAS blocking)
//!
//! - weights: panels of [`NR`] = 16 columns; in a panel, K is cut into groups of the path's
//!   [`Int8Path::group`] (2, 4 or 8, K zero-padded to a multiple), and a group holds the `group`
//!   values of column 0, then of column 1, and so on: `16 * group` bytes. With groups of 2 that is
//!   the pair layout of `vpmaddwd` (columns 0-7 in the first 16 bytes, one `vpmovsxbw` each) and of
//!   `smull` + `sadalp`; with 4, a 16-byte register holds 4 columns' 4 K (one `sdot`); with 8, two
//!   columns' 8 K (one `smmla` operand);
//! - activations, x86 paths: row-major i16, K padded to even, rows padded to a multiple of [`MR`];
//! - activations, Arm paths: i8, in blocks of the tile's rows ([`Int8Path::mr`]: 6, 4 for NEON;
//!   the last block zero-padded), a block K group by K group, each the `group` values of row 0,
//!   then of row 1, ...: a tile reads its activations as one sequential stream (the x86 tile reads
//!   6 row streams and prefetches them), and a register holds 4 rows' 4 K (sdot) or 2 rows' 8 K
//!   (smmla) as the instruction takes them;
//! - a tile of mr x [`NR`] outputs keeps its accumulators in registers over a block of K, K cut
//!   into equal blocks (`k_block`): the weight micro-panel stays in L1 while `MC` rows of
//!   activations stream through from L2. x86 (Zen 3: 32 KiB L1d, 512 KiB L2 per core): blocks of
//!   at most 640 K (a 10 KiB micro-panel), 264 rows (330 KiB of i16). Arm (a phone's big core:
//!   Cortex-X3/X4, A715/A720: 64 KiB L1d, 0.5-2 MiB L2): at most 1024 K (a 16 KiB micro-panel, a
//!   quarter of L1, half of a Cortex-A55's 32 KiB), 252 rows (252 KiB of i8, half of a 512 KiB L2);
//! - a tile of fewer than mr rows (a matrix's or a task's last): on x86 a kernel compiled for
//!   its row count runs, at about its share of a full tile's time; on Arm the full tile runs on the
//!   zero-padded block and stores its rows (one symbol per path; at most mr - 1 rows of waste per
//!   task and row block: 4 of 128, 3%, for a 256-row GEMM split over two cores);
//! - threads split the rows when each gets at least `ROWS_PER_TASK_MIN` (a task packs its own
//!   rows, runs every panel over them and hands the finished rows to the caller's `each`, so
//!   packing, tiles and the caller's dequantization need no barrier between them: +1-2% on a
//!   SmolLM2 prefill, up to +9% on the k, v GEMMs, measured on x86), else the panels (each core
//!   reads half of the weights); both in the caller's rayon pool.

use rayon::prelude::*;

use super::rows::rows_per_task;

/// Columns per weight panel (two 8-lane i32 accumulators on AVX2, four 4-lane ones on NEON).
pub const NR: usize = 16;
/// Rows per tile. AVX2: 6 x 2 accumulators + 2 weight registers + 1 broadcast = 15 of 16 ymm
/// registers. dotprod, i8mm: 6 x 4 accumulators + at most 6 for a step's operands, of 32 (module
/// docs). The NEON path's tile has [`MR_NEON`] rows.
pub const MR: usize = 6;
/// Rows per tile of [`Int8Path::Neon`]: 4 x 4 accumulators, 4 weight registers, a broadcast and the
/// products in flight. With 6 rows LLVM kept two of the 24 accumulators on the stack (a load and
/// a store each per step), for no more multiply-accumulates per instruction: the broadcast and
/// the two multiplies are per row whatever the rows.
pub const MR_NEON: usize = 4;
/// K values per block at most, x86 (16-bit activations): a 16 x 640 weight micro-panel is 10 KiB
/// of L1. K is cut into equal blocks ([`k_block`]).
const KC_I16: usize = 640;
/// Rows per block, x86: 264 x 640 i16 activations are 330 KiB of L2.
const MC_I16: usize = 264;
/// K values per block at most, Arm (8-bit activations): a 16 x 1024 micro-panel is 16 KiB of L1.
const KC_I8: usize = 1024;
/// Rows per block, Arm: 252 x 1024 i8 activations are 252 KiB of L2. A multiple of every path's
/// rows per tile: a row block starts at a block of the packed activations.
const MC_I8: usize = 252;
const _: () = assert!(MC_I8.is_multiple_of(MR) && MC_I8.is_multiple_of(MR_NEON) && MC_I16.is_multiple_of(MR));

/// What a GEMM's caller runs on blocks of whole finished output rows (see [`Panels::matmul`]).
pub type EachRows<'a> = dyn Fn(&mut [i32]) + Sync + 'a;

/// The activation types the GEMM takes: u8 and i8.
pub trait Int8Input: Copy + Into<i32> + Sync {
    /// What maps the type onto i8 (`x + TO_I8`): -128 for u8, 0 for i8.
    const TO_I8: i32;
}

impl Int8Input for u8 {
    const TO_I8: i32 = -128;
}

impl Int8Input for i8 {
    const TO_I8: i32 = 0;
}

/// Which tile kernel runs. The choice is made once per process ([`Int8Path::detect`]); tests run
/// every path this machine can run ([`Int8Path::available`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Path {
    /// `vpmaddwd` on i16 lanes (x86_64 with AVX2).
    Avx2,
    /// Plain Rust on i16 activations and the pair layout: any CPU (and the cross-check).
    Portable,
    /// `smmla` on i8 lanes (aarch64 with FEAT_I8MM: Cortex-A510/A710/X2 and later).
    I8mm,
    /// `sdot` by element on i8 lanes (aarch64 with FEAT_DotProd: Cortex-A55/A76 and later).
    Dotprod,
    /// `smull` + `sadalp` on i8 lanes: every aarch64 CPU (NEON is in the baseline).
    Neon,
}

impl Int8Path {
    /// The fastest path this CPU runs.
    pub fn detect() -> Self {
        Self::available()[0]
    }

    /// Every path this CPU runs, fastest first: i8mm > dotprod > NEON on aarch64, AVX2 on x86_64,
    /// then the portable one.
    pub fn available() -> Vec<Self> {
        let mut paths = Vec::new();
        #[cfg(target_arch = "x86_64")]
        if super::cpu::cpu().avx2 {
            paths.push(Int8Path::Avx2);
        }
        #[cfg(target_arch = "aarch64")]
        {
            if super::cpu::cpu().i8mm {
                paths.push(Int8Path::I8mm);
            }
            if super::cpu::cpu().dotprod {
                paths.push(Int8Path::Dotprod);
            }
            paths.push(Int8Path::Neon);
        }
        paths.push(Int8Path::Portable);
        paths
    }

    /// K values per group of a weight panel (and of a block of 8-bit activations): the operand
    /// width of the path's instruction per column.
    pub fn group(self) -> usize {
        match self {
            Int8Path::Avx2 | Int8Path::Portable | Int8Path::Neon => 2,
            Int8Path::Dotprod => 4,
            Int8Path::I8mm => 8,
        }
    }

    /// Rows per tile (and per block of packed activations).
    pub fn mr(self) -> usize {
        match self {
            Int8Path::Neon => MR_NEON,
            _ => MR,
        }
    }

    /// Whether the activations are widened to i16 with the offset folded in (x86 and portable),
    /// else kept 8-bit (Arm).
    fn i16_lanes(self) -> bool {
        matches!(self, Int8Path::Avx2 | Int8Path::Portable)
    }

    /// The part of an activation offset this path adds to the activations as it packs them; the
    /// caller adds `(x_offset - fold) * col_sums` to the product. On i16 lanes, all of it when every
    /// `x + x_offset` fits an i16 ([`offset_fits`]: always for QNN's 8-bit offsets), else none; on
    /// i8 lanes, whatever the offset, the shift onto i8 ([`Int8Input::TO_I8`]).
    pub fn fold<T: Int8Input>(self, x_offset: i32) -> i32 {
        match self.i16_lanes() {
            true if offset_fits(x_offset) => x_offset,
            true => 0,
            false => T::TO_I8,
        }
    }

    /// (K values, rows) per block at most: the weight micro-panel in L1, the activations in L2.
    fn blocking(self) -> (usize, usize) {
        if self.i16_lanes() {
            (KC_I16, MC_I16)
        } else {
            (KC_I8, MC_I8)
        }
    }

    fn tile(self) -> unsafe fn(Tile) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Int8Path::Avx2 => tile_avx2,
            #[cfg(target_arch = "aarch64")]
            Int8Path::I8mm => tile_i8mm,
            #[cfg(target_arch = "aarch64")]
            Int8Path::Dotprod => tile_dotprod,
            #[cfg(target_arch = "aarch64")]
            Int8Path::Neon => tile_neon,
            Int8Path::Portable => tile_portable,
            #[allow(unreachable_patterns)]
            other => unreachable!("Int8Path::{other:?} is never available on this architecture"),
        }
    }
}

/// An INT8 weight `[N, K]` in 16-column panels laid out for one [`Int8Path`] (module docs).
pub struct Panels {
    data: PanelData,
    n: usize,
    k: usize,
    /// K rounded up to a multiple of the path's group.
    kp: usize,
    path: Int8Path,
}

/// What a [`Panels`] holds: the INT8 values, or an LPBQ weight's 4-bit parts.
enum PanelData {
    /// The values in the panel layout ([`at`]).
    I8(Vec<i8>),
    /// An LPBQ weight (`value * block scale`, [`crate::quant::Lpbq`]) at half the bytes: its
    /// 4-bit values in the same layout, two a byte (the even position in the low nibble), and
    /// per panel, block of `block` K and column, the block's scale (`scales[(p * blocks + b) *
    /// NR + j]`: a block's 16 scales side by side, as a K group's 16 columns are). A tile's
    /// micro-panel is expanded into INT8 once per row block ([`Panels::expand`]), so the tiles
    /// and the results are the INT8 path's.
    Lpbq { nibbles: Vec<u8>, scales: Vec<u8>, block: usize },
}

impl Panels {
    /// Repacks `w` (`[N, K]`, row-major) into panels of 16 output columns for `path`, `K`
    /// zero-padded to a multiple of its group.
    pub fn new(w: &[i8], n: usize, k: usize, path: Int8Path) -> Self {
        assert_eq!(w.len(), n * k, "weight is not [N, K]");
        let g = path.group();
        let kp = k.next_multiple_of(g);
        let n_panels = n.div_ceil(NR);
        let mut data = vec![0i8; n_panels * kp * NR];
        for (col, row) in w.chunks_exact(k.max(1)).enumerate() {
            let (p, j) = (col / NR, col % NR);
            let panel = &mut data[p * kp * NR..(p + 1) * kp * NR];
            for (kk, &v) in row.iter().enumerate() {
                panel[at(g, j, kk)] = v;
            }
        }
        Panels { data: PanelData::I8(data), n, k, kp, path }
    }

    /// An LPBQ weight's panels at half the bytes: `w` (`[N, K]`, row-major) is its INT8 form,
    /// each value its 4-bit value (in [-8, 7]) times `scales[n * K / block + k / block]` (in
    /// 1..=15); `None` when it is not (a weight that is no LPBQ weight is packed as INT8 by the
    /// caller), or when a block is not whole K groups of the path.
    pub fn new_lpbq(w: &[i8], n: usize, k: usize, block: usize, scales: &[u8], path: Int8Path) -> Option<Self> {
        let g = path.group();
        if w.len() != n * k || block == 0 || !k.is_multiple_of(block) || !block.is_multiple_of(g) || scales.len() != n * (k / block) {
            return None;
        }
        let (kp, blocks, n_panels) = (k, k / block, n.div_ceil(NR));
        let mut nibbles = vec![0u8; (n_panels * kp * NR).div_ceil(2)];
        let mut packed = vec![0u8; n_panels * blocks * NR];
        for (col, row) in w.chunks_exact(k.max(1)).enumerate() {
            let (p, j) = (col / NR, col % NR);
            for (b, vals) in row.chunks_exact(block).enumerate() {
                let s = scales[col * blocks + b];
                if !(1..=15).contains(&s) {
                    return None;
                }
                packed[(p * blocks + b) * NR + j] = s;
                for (i, &v) in vals.iter().enumerate() {
                    let q = v / s as i8;
                    if q * s as i8 != v || !(-8..=7).contains(&q) {
                        return None;
                    }
                    put_nibble(&mut nibbles, p * kp * NR + at(g, j, b * block + i), q);
                }
            }
        }
        Some(Panels { data: PanelData::Lpbq { nibbles, scales: packed, block }, n, k, kp, path })
    }

    /// Bytes the weight takes (values and block scales).
    pub fn bytes(&self) -> usize {
        match &self.data {
            PanelData::I8(d) => d.len(),
            PanelData::Lpbq { nibbles, scales, .. } => nibbles.len() + scales.len(),
        }
    }

    /// The value at `at` of panel `p` (`at(g, j, k)`), from either form.
    fn value(&self, p: usize, j: usize, kk: usize) -> i8 {
        let i = p * self.kp * NR + at(self.path.group(), j, kk);
        match &self.data {
            PanelData::I8(d) => d[i],
            PanelData::Lpbq { nibbles, scales, block } => nibble(nibbles, i) * scales[(p * (self.k / block) + kk / block) * NR + j] as i8,
        }
    }

    /// Groups `t0..t1` of panel `p` as INT8 in `out` (`(t1 - t0) * g * NR` values, the layout of
    /// [`PanelData::I8`]): what a tile reads. A group's `g * NR` values are the `g` of column 0,
    /// then of column 1, ..., and one block's 16 scales serve every group in it: each byte of
    /// nibbles gives two values of one column.
    fn expand(&self, p: usize, t0: usize, t1: usize, out: &mut Vec<i8>) {
        let PanelData::Lpbq { nibbles, scales, block } = &self.data else { unreachable!("an LPBQ panel") };
        let g = self.path.group();
        let (gbytes, blocks) = (g * NR, self.k / block);
        out.resize((t1 - t0) * gbytes, 0);
        let mut rep = [0i8; 8 * NR];
        let mut held = usize::MAX;
        for (t, dst) in (t0..t1).zip(out.chunks_exact_mut(gbytes)) {
            let b = t * g / block;
            if b != held {
                // Each column's scale, once per value of the column in a group.
                let s = &scales[(p * blocks + b) * NR..][..NR];
                for (i, r) in rep[..gbytes].iter_mut().enumerate() {
                    *r = s[i / g] as i8;
                }
                held = b;
            }
            // g is even: a group starts on a whole byte.
            let src = &nibbles[(p * self.kp * NR + t * gbytes) / 2..][..gbytes / 2];
            for ((pair, &byte), s) in dst.chunks_exact_mut(2).zip(src).zip(rep[..gbytes].chunks_exact(2)) {
                pair[0] = (((byte << 4) as i8) >> 4).wrapping_mul(s[0]);
                pair[1] = ((byte as i8) >> 4).wrapping_mul(s[1]);
            }
        }
    }

    /// The path the panels are laid out for, and the one [`Self::matmul`] runs.
    pub fn path(&self) -> Int8Path {
        self.path
    }

    /// Columns `cs` of the weight (`w[.., c]`, `N` values each), one after another. A column's 16
    /// values in a panel are in one K group of 32, 64 or 128 bytes: a line or two per 16 outputs,
    /// where the row-major weight has a line per output.
    pub fn columns(&self, cs: &[usize]) -> Vec<i8> {
        let (n, g) = (self.n, self.path.group());
        let mut out = vec![0i8; cs.len() * n];
        for p in 0..n.div_ceil(NR) {
            let cols = NR.min(n - p * NR);
            for (j, &c) in cs.iter().enumerate() {
                let dst = &mut out[j * n + p * NR..][..cols];
                match &self.data {
                    PanelData::I8(d) => {
                        let panel = &d[p * self.kp * NR..][..self.kp * NR];
                        dst.iter_mut().enumerate().for_each(|(i, v)| *v = panel[at(g, i, c)]);
                    }
                    PanelData::Lpbq { .. } => dst.iter_mut().enumerate().for_each(|(i, v)| *v = self.value(p, i, c)),
                }
            }
        }
        out
    }

    /// `acc[m, n] = sum_k (x[m, k] + fold) * w[n, k]` in i32, exactly, where `fold` is what
    /// [`Int8Path::fold`] gives for this path and `T` (the caller applies the rest of its offset).
    ///
    /// `each` runs on blocks of whole output rows once they are final, on the thread that
    /// computed them when rows are split over the threads (the caller's dequantization, while
    /// the rows are in cache), over the pool otherwise; every row is in exactly one block.
    pub fn matmul<T: Int8Input>(&self, x: &[T], m: usize, fold: i32, each: &EachRows<'_>) -> Vec<i32> {
        assert_eq!(x.len(), m * self.k, "activation is not [M, K]");
        assert_eq!(fold, self.path.fold::<T>(fold), "{:?} cannot fold the offset {fold}", self.path);
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
        // Rows split over the threads when each gets a few tiles' worth: a task packs its own
        // rows and runs every panel over them (no barrier between packing and the tiles).
        // Fewer rows: the panels are split, and the packing is shared.
        let row_tasks = if m >= threads * ROWS_PER_TASK_MIN { threads } else { 1 };
        if row_tasks > 1 {
            // Equal row counts, not whole tiles (a short tile costs its rows' share on x86): 256
            // rows were 22 tiles on one thread and 21 on the other (GEMM +1-3% in the
            // micro-benchmark).
            let per = m.div_ceil(row_tasks);
            (0..m.div_ceil(per)).into_par_iter().for_each(|i| {
                let (r0, r1) = (i * per, ((i + 1) * per).min(m));
                with_packed(|a| {
                    self.pack(&x[r0 * self.k..r1 * self.k], r1 - r0, fold, a, false);
                    // SAFETY: `a` holds the task's rows padded to mr in the path's layout; the
                    // tasks write disjoint rows of `out` (capacity m * n).
                    unsafe { self.run_panels(a.as_ptr().cast(), r1 - r0, 0..n_panels, c.get().add(r0 * self.n)) }
                });
                // SAFETY: rows r0..r1 were all written above, by this task alone.
                each(unsafe { std::slice::from_raw_parts_mut(c.get().add(r0 * self.n), (r1 - r0) * self.n) });
            });
        } else {
            with_packed(|a| {
                self.pack(x, m, fold, a, true);
                let a: &[i16] = a;
                let threads = threads.min(n_panels);
                let run = |i: usize| {
                    let panels = n_panels * i / threads..n_panels * (i + 1) / threads;
                    // SAFETY: `a` holds `m` rows padded to mr in the path's layout, `out` has
                    // capacity m * n, and the panel ranges of the tasks are disjoint, so each
                    // output element is written by one task.
                    unsafe { self.run_panels(a.as_ptr().cast(), m, panels, c.get()) }
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

    /// The activations in the path's layout, in `a` (its i16s reused as bytes on the Arm paths):
    /// blocks of rows over the rayon pool when `parallel`, else on this thread. Every value the
    /// tiles read is written (`a` is not zeroed first).
    fn pack<T: Int8Input>(&self, x: &[T], m: usize, fold: i32, a: &mut Vec<i16>, parallel: bool) {
        if self.path.i16_lanes() {
            self.widen(x, m, fold, a, parallel)
        } else {
            self.interleave(x, m, fold, a, parallel)
        }
    }

    /// `x + x_offset` as i16, row-major, K padded to even and rows to a multiple of mr with zeros.
    fn widen<T: Int8Input>(&self, x: &[T], m: usize, x_offset: i32, a: &mut Vec<i16>, parallel: bool) {
        let (k, kp) = (self.k, self.kp);
        a.resize(m.next_multiple_of(self.path.mr()) * kp, 0);
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

    /// `x + shift` as i8 (`shift` maps `T` onto i8), in blocks of mr rows, each K group by K group
    /// with the group's values of row 0, then row 1, ... (module docs); the last block's missing
    /// rows and K past `k` are zeros. Stored in `a`'s i16s, so every group (an even number of
    /// bytes) and every row's pair in it is 2-byte aligned for the NEON tile's 16-bit broadcast.
    fn interleave<T: Int8Input>(&self, x: &[T], m: usize, shift: i32, a: &mut Vec<i16>, parallel: bool) {
        let (k, kp, g, mr) = (self.k, self.kp, self.path.group(), self.path.mr());
        let block = mr * kp;
        a.resize(m.div_ceil(mr) * block / 2, 0);
        // SAFETY: the byte view covers `a`'s own initialized memory (block is even: kp is a
        // multiple of 2), i8 has no alignment and takes every bit pattern, and `a` is not used
        // while the view lives.
        let bytes = unsafe { std::slice::from_raw_parts_mut(a.as_mut_ptr().cast::<i8>(), a.len() * 2) };
        let blocks = |first: usize, out: &mut [i8]| {
            for (b, out) in out.chunks_exact_mut(block).enumerate() {
                for r in 0..mr {
                    let row = (first + b) * mr + r;
                    let src = if row < m { &x[row * k..(row + 1) * k] } else { &[] };
                    let full = src.len().div_ceil(g);
                    for (gi, chunk) in src.chunks(g).enumerate() {
                        let dst = &mut out[gi * mr * g + r * g..][..g];
                        for (d, &v) in dst.iter_mut().zip(chunk) {
                            *d = (v.into() + shift) as i8;
                        }
                        dst[chunk.len()..].fill(0);
                    }
                    for gi in full..kp / g {
                        out[gi * mr * g + r * g..][..g].fill(0);
                    }
                }
            }
        };
        if parallel {
            let per = rows_per_task(m.div_ceil(mr), block);
            bytes.par_chunks_mut(per * block).enumerate().for_each(|(i, out)| blocks(i * per, out));
        } else {
            blocks(0, bytes);
        }
    }

    /// Tiles of the panels in `panels`, blocked over K and rows ([`Int8Path::blocking`]).
    ///
    /// # Safety
    /// `a` holds `m` rows packed for the path ([`Self::pack`]); `c` points to `m * n` i32 (maybe
    /// uninitialized: the first K block writes before any later block reads).
    unsafe fn run_panels(&self, a: *const u8, m: usize, panels: std::ops::Range<usize>, c: *mut i32) {
        let (tile, g, mr) = (self.path.tile(), self.path.group(), self.path.mr());
        let (kc, mc) = self.path.blocking();
        let groups = self.kp / g;
        let kc = k_block(groups, kc / g);
        // An LPBQ micro-panel, expanded to INT8 (once per row block: once per GEMM up to `mc`
        // rows, where each of its values then serves every row).
        let mut wide = Vec::new();
        for t0 in (0..groups).step_by(kc) {
            let t1 = (t0 + kc).min(groups);
            for r0 in (0..m).step_by(mc) {
                let r1 = (r0 + mc).min(m);
                for p in panels.clone() {
                    let b = match &self.data {
                        PanelData::I8(d) => d.as_ptr().add((p * self.kp + t0 * g) * NR),
                        PanelData::Lpbq { .. } => {
                            self.expand(p, t0, t1, &mut wide);
                            wide.as_ptr()
                        }
                    };
                    let cols = NR.min(self.n - p * NR);
                    for r in (r0..r1).step_by(mr) {
                        // i16 rows (`kp` apart), or the block of mr rows at `r` (a multiple of mr:
                        // so is `mc`), at group t0.
                        let a = if self.path.i16_lanes() { a.add(2 * (r * self.kp + t0 * g)) } else { a.add(r * self.kp + t0 * g * mr) };
                        tile(Tile {
                            a,
                            a_stride: self.kp,
                            b,
                            groups: t1 - t0,
                            c: c.add(r * self.n + p * NR),
                            ldc: self.n,
                            rows: mr.min(r1 - r),
                            cols,
                            accumulate: t0 > 0,
                        })
                    }
                }
            }
        }
    }
}

/// The 4-bit value at `i` of `v` (two a byte, the even one in the low nibble), sign-extended:
/// how LPBQ's values are held on the host (the panels' and a float checkpoint's linears).
pub fn nibble(v: &[u8], i: usize) -> i8 {
    (((v[i / 2] >> (4 * (i % 2))) << 4) as i8) >> 4
}

/// Writes the 4-bit value `q` (in [-8, 7]) at `i` of `v`, whose nibble there is zero.
pub fn put_nibble(v: &mut [u8], i: usize, q: i8) {
    v[i / 2] |= ((q as u8) & 0xf) << (4 * (i % 2));
}

/// Where value `k` of column `j` (0-15) is in a panel of K groups of `g`: the group's `g * NR`
/// bytes hold the `g` values of column 0, then of column 1, ... With `g` = 2 that is the pair
/// layout: columns 0-7 in the first 16 bytes, 8-15 in the last (one `vpmovsxbw` each).
fn at(g: usize, j: usize, k: usize) -> usize {
    (k / g) * g * NR + g * j + k % g
}

/// K groups per block: `groups` cut into equal blocks of at most `max`. A short last block
/// (K = 576, the hidden size of SmolLM2, in blocks of 640 would be 512 + 64) pays a tile's fixed
/// cost (its accumulators read back, added and stored) for little work.
fn k_block(groups: usize, max: usize) -> usize {
    groups.div_ceil(groups.div_ceil(max).max(1)).max(1)
}

/// Whether `x + offset` fits an i16 for every u8 or i8 `x` (the folded-offset precondition).
pub fn offset_fits(offset: i32) -> bool {
    (i16::MIN as i32 + 128..=i16::MAX as i32 - 255).contains(&offset)
}

thread_local! {
    /// The packed activations of this thread's last call: reused, so the hot path does not
    /// allocate. i16 (and so 2-byte aligned) for every path: the Arm paths use it as bytes.
    static PACKED: std::cell::RefCell<Vec<i16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `each` on blocks of whole rows (of `n` values) of a finished product, over the rayon pool.
pub(crate) fn each_over_pool(out: &mut [i32], n: usize, each: &EachRows<'_>) {
    if !out.is_empty() {
        let n = n.max(1);
        out.par_chunks_mut(rows_per_task(out.len() / n, n) * n).for_each(each);
    }
}

/// `f` on this thread's packing buffer. A rayon worker waiting in a GEMM may run another GEMM
/// on its thread: that one packs into a buffer of its own.
fn with_packed<R>(f: impl FnOnce(&mut Vec<i16>) -> R) -> R {
    PACKED.with(|cell| match cell.try_borrow_mut() {
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

/// One mr x NR output tile over `groups` K groups of the path.
struct Tile {
    /// The activations at this K block. i16 paths: row 0, MR rows `a_stride` i16 apart (rows past
    /// `rows` are padding and may be read). Arm paths: the mr rows' block, `mr * group` bytes per
    /// group (2-byte aligned).
    a: *const u8,
    a_stride: usize,
    /// The panel at this K block: `16 * group` bytes per group.
    b: *const i8,
    groups: usize,
    /// Output row 0, column 0 of the tile; rows `ldc` apart.
    c: *mut i32,
    ldc: usize,
    rows: usize,
    cols: usize,
    /// Add to the outputs (a later K block) instead of writing them.
    accumulate: bool,
}

/// # Safety
/// The CPU has AVX2; `t` points into a packed GEMM as [`Panels::run_panels`] makes it.
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
    for p in 0..t.groups {
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

/// The dotprod tile: per K group of 4, the 64 weight bytes in 4 registers (columns 4q..4q + 4 in
/// register q), the 6 rows' 4 bytes in the 32-bit lanes of 2 registers (rows 0-3, then 4-5), and
/// 24 `sdot`s by element: `acc[r][q] += w[q] . x[r]`. Every row runs (the block's padding rows are
/// zeros); `t.rows` are stored.
///
/// # Safety
/// The CPU has dotprod; `t` points into a GEMM packed for [`Int8Path::Dotprod`] as
/// [`Panels::run_panels`] makes it.
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "dotprod")]
unsafe fn tile_dotprod(t: Tile) {
    use super::arm::sdot_lane;
    use std::arch::aarch64::*;
    let mut acc = [[vdupq_n_s32(0); 4]; MR];
    let (mut a, mut b) = (t.a.cast::<i8>(), t.b);
    for _ in 0..t.groups {
        // 24 bytes: rows 0-3 in one register, rows 4-5 in the low half of another (an 8-byte
        // load, which zeroes the high half: the next group is not read).
        let x03 = vld1q_s8(a);
        let x45 = vcombine_s8(vld1_s8(a.add(16)), vdup_n_s8(0));
        let w = [vld1q_s8(b), vld1q_s8(b.add(16)), vld1q_s8(b.add(32)), vld1q_s8(b.add(48))];
        for (q, &w) in w.iter().enumerate() {
            acc[0][q] = sdot_lane::<0>(acc[0][q], w, x03);
            acc[1][q] = sdot_lane::<1>(acc[1][q], w, x03);
            acc[2][q] = sdot_lane::<2>(acc[2][q], w, x03);
            acc[3][q] = sdot_lane::<3>(acc[3][q], w, x03);
            acc[4][q] = sdot_lane::<0>(acc[4][q], w, x45);
            acc[5][q] = sdot_lane::<1>(acc[5][q], w, x45);
        }
        a = a.add(4 * MR);
        b = b.add(4 * NR);
    }
    for (r, &row) in acc.iter().enumerate().take(t.rows) {
        store_row_neon(t.c.add(r * t.ldc), row, t.cols, t.accumulate);
    }
}

/// The i8mm tile: per K group of 8, the 3 row pairs' 8 bytes in 3 registers (rows 2p, 2p + 1 in
/// register p), each column pair's 8 bytes loaded once and used by 3 `smmla`s: `acc[p][q]` holds
/// rows 2p, 2p + 1 of columns 2q, 2q + 1 (`[r0.c0, r0.c1, r1.c0, r1.c1]`). Every row runs (the
/// block's padding rows are zeros); `t.rows` are stored, unzipped into rows.
///
/// # Safety
/// The CPU has i8mm; `t` points into a GEMM packed for [`Int8Path::I8mm`] as
/// [`Panels::run_panels`] makes it.
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "i8mm")]
unsafe fn tile_i8mm(t: Tile) {
    use super::arm::smmla;
    use std::arch::aarch64::*;
    let mut acc = [[vdupq_n_s32(0); NR / 2]; MR / 2];
    let (mut a, mut b) = (t.a.cast::<i8>(), t.b);
    for _ in 0..t.groups {
        let x = [vld1q_s8(a), vld1q_s8(a.add(16)), vld1q_s8(a.add(32))];
        for q in 0..NR / 2 {
            let w = vld1q_s8(b.add(16 * q));
            for (acc, &x) in acc.iter_mut().zip(&x) {
                acc[q] = smmla(acc[q], x, w);
            }
        }
        a = a.add(8 * MR);
        b = b.add(8 * NR);
    }
    // Loops over the array itself, not indexed by a row count known at run time: the accumulators
    // then stay registers (indexed by `r / 2`, LLVM stored all 24 to the stack in every step).
    for (p, pair) in acc.iter().enumerate() {
        for h in 0..2 {
            let r = 2 * p + h;
            if r < t.rows {
                // Row r of columns 4v..4v + 4: the 64-bit half h of column pairs 2v and 2v + 1.
                let row: [int32x4_t; 4] = std::array::from_fn(|v| {
                    let (lo, hi) = (vreinterpretq_s64_s32(pair[2 * v]), vreinterpretq_s64_s32(pair[2 * v + 1]));
                    vreinterpretq_s32_s64(if h == 0 { vzip1q_s64(lo, hi) } else { vzip2q_s64(lo, hi) })
                });
                store_row_neon(t.c.add(r * t.ldc), row, t.cols, t.accumulate);
            }
        }
    }
}

/// The NEON tile (no dotprod): per pair of K, the 32 weight bytes in 2 registers (columns 0-7, then
/// 8-15, each as (k, k + 1) byte pairs), and per row its activation pair broadcast to every 16-bit
/// lane; `smull`/`smull2` make the 4 x 8 exact i16 products, and `sadalp` adds each column's two
/// into its i32 lane. Every row runs (the block's padding rows are zeros); `t.rows` are stored.
///
/// # Safety
/// `t` points into a GEMM packed for [`Int8Path::Neon`] as [`Panels::run_panels`] makes it (its
/// activation pairs 2-byte aligned).
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
unsafe fn tile_neon(t: Tile) {
    use std::arch::aarch64::*;
    let mut acc = [[vdupq_n_s32(0); 4]; MR_NEON];
    let (mut a, mut b) = (t.a.cast::<i16>(), t.b);
    for _ in 0..t.groups {
        // Columns 4q..4q + 4 as (k, k + 1) byte pairs in 8-byte register q.
        let w = [vld1_s8(b), vld1_s8(b.add(8)), vld1_s8(b.add(16)), vld1_s8(b.add(24))];
        for (r, acc) in acc.iter_mut().enumerate() {
            // (x[r, k], x[r, k + 1]) in every 16-bit lane (`ld1r`).
            let x = vreinterpret_s8_s16(vld1_dup_s16(a.add(r)));
            for (acc, &w) in acc.iter_mut().zip(&w) {
                *acc = vpadalq_s16(*acc, vmull_s8(w, x));
            }
        }
        a = a.add(MR_NEON);
        b = b.add(2 * NR);
    }
    for (r, &row) in acc.iter().enumerate().take(t.rows) {
        store_row_neon(t.c.add(r * t.ldc), row, t.cols, t.accumulate);
    }
}

/// One output row of an Arm tile: 16 i32 in 4 registers, `cols` of them stored (added to the
/// outputs on a later K block).
///
/// # Safety
/// `c` points to `cols` i32 (initialized when `accumulate`).
#[cfg(target_arch = "aarch64")]
#[inline(always)]
unsafe fn store_row_neon(c: *mut i32, row: [std::arch::aarch64::int32x4_t; 4], cols: usize, accumulate: bool) {
    use std::arch::aarch64::*;
    if cols == NR {
        for (v, &x) in row.iter().enumerate() {
            let x = if accumulate { vaddq_s32(x, vld1q_s32(c.add(4 * v))) } else { x };
            vst1q_s32(c.add(4 * v), x);
        }
    } else {
        let mut tmp = [0i32; NR];
        for (v, &x) in row.iter().enumerate() {
            vst1q_s32(tmp.as_mut_ptr().add(4 * v), x);
        }
        store_row(c, &tmp[..cols], accumulate);
    }
}

/// The portable tile, on the x86 layout (i16 rows, pair panels).
///
/// # Safety
/// `t` points into a GEMM packed for [`Int8Path::Portable`] as [`Panels::run_panels`] makes it.
unsafe fn tile_portable(t: Tile) {
    let a = t.a.cast::<i16>();
    let mut acc = [[0i32; NR]; MR];
    for p in 0..t.groups {
        let b = std::slice::from_raw_parts(t.b.add(32 * p), 32);
        for (r, acc) in acc.iter_mut().enumerate() {
            let (x0, x1) = (*a.add(r * t.a_stride + 2 * p) as i32, *a.add(r * t.a_stride + 2 * p + 1) as i32);
            for (j, acc) in acc.iter_mut().enumerate() {
                let at = at(2, j, 0);
                *acc += x0 * b[at] as i32 + x1 * b[at + 1] as i32;
            }
        }
    }
    for (r, acc) in acc.iter().enumerate().take(t.rows) {
        store_row(t.c.add(r * t.ldc), &acc[..t.cols], t.accumulate);
    }
}

/// # Safety
/// `c` points to `row.len()` i32 (initialized when `accumulate`).
unsafe fn store_row(c: *mut i32, row: &[i32], accumulate: bool) {
    for (j, &v) in row.iter().enumerate() {
        *c.add(j) = if accumulate { *c.add(j) + v } else { v };
    }
}
