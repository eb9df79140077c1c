//! Causal attention of query rows over one KV head, tiled over the keys (flash attention): a
//! tile's scores live in a scratch of [`KEY_BLOCK`] columns, never a row's whole key range (at
//! 4096 tokens, 3 MB for one 64-row block of SmolLM2's 3 query heads per KV head).
//!
//! The layout is the caller's (`models`' attention): the query heads that share a KV head are
//! stacked as the rows of one matrix, `[rows, head_dim]`, so that grouped-query attention is
//! one GEMM per tile and no K/V is copied per query head; each row sees the keys of one range of
//! positions (its causal end, the start of its sliding window), given per row. A tile that no
//! row sees is never computed (block-sparse for sliding windows).
//!
//! Each tile gives a [`Partial`] of its own (its scores shifted by the tile's own maximum), and
//! a row's result is its tiles' partials merged in position order. Tiles start at multiples of
//! [`KEY_BLOCK`] positions, so a row's tiles depend only on the row's own span: its bits do not
//! change with what else the cache holds, nor with whether its tiles ran on one thread
//! ([`attend`]) or were spread over the cores and merged afterwards ([`attend_tile`],
//! [`Partial::merge`]: flash-decoding, how decode's one row uses every core).
//!
//! Accumulation is f32 throughout: the GEMMs are the `gemm` crate's f32 kernels, the softmax
//! numerators [`super::rows::exp_shifted`], the sums f32.
//!
//! Kernels per CPU. A prefill tile is two GEMMs (`Q K^T`, then the numerators times V) through
//! the `gemm` crate, which has kernels of its own for each: AVX2/AVX-512 on x86_64, NEON on
//! aarch64 (`gemm-f32`'s `microkernel::neon`: up to 16 x 4 outputs a step with
//! `vfmaq_laneq_f32`, the right-hand side always packed there). Decode's one-position tile
//! ([`attend_tile_one`]) runs our own `dots` and `weighted_sum`: AVX2 + FMA on x86_64 when
//! `head_dim` is a multiple of 8, NEON on aarch64 when it is a multiple of 4 (`mod neon`; every
//! model's is: 64, 128, 256), the plain loops otherwise.
//!
//! No fp16 arithmetic: it would not be free in accuracy. FEAT_FP16's `fmla .8h` rounds every
//! product and partial sum to 11 bits (relative steps of 2^-11 = 4.9e-4, against f32's 6e-8):
//! a 512-key sum would miss the tests' 2e-5 by orders of magnitude. An f16 KV cache (the
//! default since 2026-12-01, `docs/memory.md`) is read in f16 and widened, exactly, before any
//! product: into a buffer per tile where the tile serves a chunk's rows, in the register
//! (`vcvtph2ps`, `fcvtl`) for a decode step's one position, so every sum stays f32.

use std::ops::Range;

use super::matmul_f32_serial_into;
use super::rows::{exp, exp_shifted, row_max};

/// Keys per tile. On the 2-core build machine one 2048-key task of SmolLM2 (192 stacked rows)
/// took 991 / 938 / 906 us with tiles of 128 / 256 / 512 keys, against 902 us for the whole
/// score matrix at once (`benches/prefill.rs`, `attention_2048`): each tile costs two GEMM calls
/// and a merge, and the whole matrix already ran at the FMA pipes' peak (about 110 GFLOP/s on one
/// core), so only the tile's overhead could show. 512 keys: 384 KB of scores for 192 rows.
pub const KEY_BLOCK: usize = 512;

/// Rows of keys or values as a cache holds them: f32, or f16 (half the memory, llama.cpp's
/// default; each tile's rows are widened to f32 before its products, so every sum stays f32 and
/// only the values held are rounded).
#[derive(Clone, Copy)]
pub enum KvRows<'a> {
    /// As computed.
    F32(&'a [f32]),
    /// Rounded to f16 (nearest, ties to even).
    F16(&'a [half::f16]),
    /// llama.cpp's `q8_0`: blocks of [`Q8_BLOCK`] values, each `q[i] * d[i / 32]` (i8 values,
    /// an f16 scale per block): 1.0625 bytes a value. A range of rows starts and ends on a block
    /// (rows of a head size that is a multiple of 32).
    Q8 {
        /// The values.
        q: &'a [i8],
        /// A scale per block of 32 values.
        d: &'a [half::f16],
    },
}

/// Values per scale of [`KvRows::Q8`].
pub const Q8_BLOCK: usize = 32;

/// `x` (a multiple of [`Q8_BLOCK`] values) as llama.cpp's `q8_0` blocks, into `q` and `d`: per
/// block `d = max |x| / 127` (as f16) and `q = round(x / d)`, so the largest keeps 127 steps.
pub fn quantize_q8(x: &[f32], q: &mut [i8], d: &mut [half::f16]) {
    debug_assert!(x.len().is_multiple_of(Q8_BLOCK) && q.len() == x.len() && d.len() * Q8_BLOCK == x.len());
    for ((x, q), d) in x.chunks_exact(Q8_BLOCK).zip(q.chunks_exact_mut(Q8_BLOCK)).zip(d.iter_mut()) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        *d = half::f16::from_f32(scale);
        for (q, &v) in q.iter_mut().zip(x) {
            *q = (v * inv).round().clamp(-127.0, 127.0) as i8;
        }
    }
}

impl<'a> KvRows<'a> {
    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            KvRows::F32(v) => v.len(),
            KvRows::F16(v) => v.len(),
            KvRows::Q8 { q, .. } => q.len(),
        }
    }

    /// No values held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values `r`.
    fn range(&self, r: Range<usize>) -> KvRows<'a> {
        match self {
            KvRows::F32(v) => KvRows::F32(&v[r]),
            KvRows::F16(v) => KvRows::F16(&v[r]),
            KvRows::Q8 { q, d } => {
                debug_assert!(r.start.is_multiple_of(Q8_BLOCK) && r.end.is_multiple_of(Q8_BLOCK), "q8 rows of whole blocks");
                KvRows::Q8 { q: &q[r.clone()], d: &d[r.start / Q8_BLOCK..r.end / Q8_BLOCK] }
            }
        }
    }

    /// The values as f32: in place, or widened into `buf` (F16C on x86_64, the FP16
    /// conversions on aarch64, through `half`'s slice conversion; q8 blocks times their scale,
    /// exact in f32).
    pub fn as_f32<'b>(&self, buf: &'b mut Vec<f32>) -> &'b [f32]
    where
        'a: 'b,
    {
        use half::slice::HalfFloatSliceExt;
        match self {
            KvRows::F32(v) => v,
            KvRows::F16(v) => {
                buf.resize(v.len(), 0.0);
                v.convert_to_f32_slice(buf);
                buf
            }
            KvRows::Q8 { q, d } => {
                buf.resize(q.len(), 0.0);
                for ((out, q), d) in buf.chunks_exact_mut(Q8_BLOCK).zip(q.chunks_exact(Q8_BLOCK)).zip(d.iter()) {
                    let d = d.to_f32();
                    for (o, &v) in out.iter_mut().zip(q) {
                        *o = v as f32 * d;
                    }
                }
                buf
            }
        }
    }
}

/// The keys and values of one KV head, `[len, head_dim]` each, position `first + i` at row `i`.
#[derive(Clone, Copy)]
pub struct HeadKv<'a> {
    /// Keys, row-major.
    pub keys: KvRows<'a>,
    /// Values, row-major.
    pub values: KvRows<'a>,
    /// The position of the first row.
    pub first: usize,
    /// Values per key (the head's dimension).
    pub head_dim: usize,
}

impl HeadKv<'_> {
    /// The positions held: `first..first + len`.
    fn positions(&self) -> Range<usize> {
        self.first..self.first + self.keys.len() / self.head_dim
    }
}

std::thread_local! {
    /// A tile's keys and values widened from f16 or q8 ([`KvRows::as_f32`]), per thread.
    static WIDE: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// `f` on the keys and values `range` of `kv` as f32 slices.
fn with_f32_kv<R>(kv: &HeadKv<'_>, range: Range<usize>, f: impl FnOnce(&[f32], &[f32]) -> R) -> R {
    if let (KvRows::F32(k), KvRows::F32(v)) = (kv.keys, kv.values) {
        return f(&k[range.clone()], &v[range]);
    }
    WIDE.with_borrow_mut(|(kb, vb)| f(kv.keys.range(range.clone()).as_f32(kb), kv.values.range(range).as_f32(vb)))
}

/// Attention over some of the keys, not yet normalized: per row the largest scaled score seen
/// (`max`), the sum of the numerators against it (`sum`) and their product with the values
/// (`out`, `[rows, head_dim]`). A row that has seen no key has `max = -inf`, `sum = 0`.
#[derive(Debug, Clone, Default)]
pub struct Partial {
    /// Per row: the largest `scale * q.k` so far.
    pub max: Vec<f32>,
    /// Per row: `sum_j e^(scale * q.k_j - max)`.
    pub sum: Vec<f32>,
    /// Per row: `sum_j e^(scale * q.k_j - max) v_j`.
    pub out: Vec<f32>,
    /// Values per row of `out`.
    pub head_dim: usize,
}

impl Partial {
    /// No keys seen yet, for `rows` rows of `head_dim` (reusing the buffers).
    pub fn reset(&mut self, rows: usize, head_dim: usize) {
        self.max.clear();
        self.max.resize(rows, f32::NEG_INFINITY);
        self.sum.clear();
        self.sum.resize(rows, 0.0);
        self.out.clear();
        self.out.resize(rows * head_dim, 0.0);
        self.head_dim = head_dim;
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.max.len()
    }

    /// Folds in `other`, the same rows over other keys (flash-decoding's combine): both are
    /// rescaled to the larger maximum.
    pub fn merge(&mut self, other: &Partial) {
        assert_eq!((self.rows(), self.head_dim), (other.rows(), other.head_dim), "Partial::merge: other rows or head_dim");
        let hd = self.head_dim;
        for r in 0..self.rows() {
            let (a, b) = (self.max[r], other.max[r]);
            if b == f32::NEG_INFINITY {
                continue;
            }
            let (out, add) = (&mut self.out[r * hd..][..hd], &other.out[r * hd..][..hd]);
            if a == f32::NEG_INFINITY {
                // A row that had seen nothing takes the other's as it is.
                (self.max[r], self.sum[r]) = (b, other.sum[r]);
                out.copy_from_slice(add);
                continue;
            }
            // Both factors are e^(<= 0), one of them e^0 = 1 exactly.
            let m = a.max(b);
            let (ca, cb) = (exp(a - m), exp(b - m));
            self.sum[r] = self.sum[r] * ca + other.sum[r] * cb;
            out.iter_mut().zip(add).for_each(|(o, &p)| *o = *o * ca + p * cb);
            self.max[r] = m;
        }
    }

    /// The attention output of every row, `out / sum`, into `dst` (`[rows, head_dim]`). A row
    /// that saw no key gives zeros.
    pub fn normalized_into(&self, dst: &mut [f32]) {
        let hd = self.head_dim;
        for ((d, o), &s) in dst.chunks_exact_mut(hd).zip(self.out.chunks_exact(hd)).zip(&self.sum) {
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            d.iter_mut().zip(o).for_each(|(d, &o)| *d = o * inv);
        }
    }
}

/// A task's reusable buffers: a tile's scores and its partial.
#[derive(Debug, Default)]
pub struct Scratch {
    scores: Vec<f32>,
    tile: Partial,
}

/// The positions of the tiles that rows seeing `spans` (within `held`) need, in order.
pub fn tile_starts(spans: impl Iterator<Item = Range<usize>>, held: Range<usize>) -> impl Iterator<Item = usize> {
    let (mut lo, mut hi) = (usize::MAX, 0);
    for s in spans.map(|s| clip(s, &held)).filter(|s| !s.is_empty()) {
        (lo, hi) = (lo.min(s.start), hi.max(s.end));
    }
    (lo < hi).then(|| (lo / KEY_BLOCK * KEY_BLOCK..hi).step_by(KEY_BLOCK)).into_iter().flatten()
}

/// Attention of the query rows `q` (`[acc.rows(), head_dim]`) over every key of `kv` they see,
/// merged into `acc`: row `r` sees the positions `span(r)` (intersected with those `kv` holds; it
/// may be empty), with scores `scale * q.k`. The tiles run in order on this thread.
///
/// Wrong sizes are the caller's bug and panic, naming them.
pub fn attend(q: &[f32], kv: HeadKv<'_>, span: &dyn Fn(usize) -> Range<usize>, scale: f32, acc: &mut Partial, scratch: &mut Scratch) {
    let held = kv.positions();
    for t in tile_starts((0..acc.rows()).map(span), held) {
        let Scratch { scores, tile } = scratch;
        tile.reset(acc.rows(), kv.head_dim);
        attend_tile(q, kv, span, scale, t, tile, scores);
        acc.merge(tile);
    }
}

/// The tile of keys at positions `start..start + KEY_BLOCK` (`start` a multiple of
/// [`KEY_BLOCK`]) of [`attend`], into `tile` (reset by the caller to the rows and head
/// dimension): each row's scores shifted by the row's largest in the tile. A row that sees no key
/// of the tile is left as reset. `scores` is scratch.
pub fn attend_tile(q: &[f32], kv: HeadKv<'_>, span: &dyn Fn(usize) -> Range<usize>, scale: f32, start: usize, tile: &mut Partial, scores: &mut Vec<f32>) {
    let (rows, hd) = check_sizes("attend_tile", q, kv, tile, start);
    let held = kv.positions();
    let (b0, b1) = (start.max(held.start), (start + KEY_BLOCK).min(held.end));
    if b0 >= b1 {
        return;
    }
    let n = b1 - b0;
    let at = (b0 - held.start) * hd;
    with_f32_kv(&kv, at..at + n * hd, |keys, values| tile_products(q, keys, values, rows, hd, n, b0, b1, span, scale, tile, scores));
}

/// [`attend_tile`] on the tile's keys and values (`[n, hd]`, positions `b0..b1`) as f32.
#[allow(clippy::too_many_arguments)]
fn tile_products(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    rows: usize,
    hd: usize,
    n: usize,
    b0: usize,
    b1: usize,
    span: &dyn Fn(usize) -> Range<usize>,
    scale: f32,
    tile: &mut Partial,
    scores: &mut Vec<f32>,
) {
    // Fewer rows than the GEMM's blocked kernel takes: zero rows after them (their scores are
    // zeros, never exponentiated, and their outputs are dropped).
    let m = rows.max(GEMM_MIN_ROWS);
    let padded: Vec<f32>;
    let q = match m > rows {
        true => {
            padded = q[..rows * hd].iter().copied().chain(std::iter::repeat_n(0.0, (m - rows) * hd)).collect();
            &padded[..]
        }
        false => q,
    };
    scores.resize(m * n, 0.0);
    let s = &mut scores[..m * n];
    matmul_f32_serial_into(s, false, q, keys, m, hd, n, true);
    for (r, row) in s.chunks_exact_mut(n).take(rows).enumerate() {
        let seen = clip(span(r), &(b0..b1));
        let (a, z) = (seen.start - b0, seen.end - b0);
        if a < z {
            let m = scale * row_max(&row[a..z]);
            tile.sum[r] = exp_shifted(&mut row[a..z], scale, m);
            tile.max[r] = m;
        }
        row[..a].fill(0.0);
        row[z..].fill(0.0);
    }
    match m > rows {
        true => {
            let mut out = vec![0.0; m * hd];
            matmul_f32_serial_into(&mut out, false, s, values, m, n, hd, false);
            tile.out[..rows * hd].copy_from_slice(&out[..rows * hd]);
        }
        false => matmul_f32_serial_into(&mut tile.out, false, s, values, rows, n, hd, false),
    }
}

/// Rows below which the `gemm` crate multiplies with another kernel, whose sums run in another
/// order: a row's q.k scores moved by up to 9.5e-7 between 7 and 8 stacked rows (identical from
/// 8 to 768). A tile of fewer rows is multiplied as this many, so that a row's bits do not
/// depend on how many rows share its chunk: without it, the first row of a padded chunk of
/// SmolLM2 (3 query heads per KV head) came out 0.38 apart in logits between 2 and 3 real rows
/// in the chunk, as W8A8 rounding amplifies the difference over 30 layers.
const GEMM_MIN_ROWS: usize = 8;

/// [`attend_tile`] for the rows of one query position (a decode step: the query heads of one KV
/// head), by dot products straight off the keys and values as they lie. The GEMMs' per-call
/// cost (two calls a tile, a tile per KV head and layer) was about a tenth of a SmolLM2 decode
/// step at a short context, and their packing of the keys read them twice at a long one.
/// Every row sees `span` (one position's keys). Agrees with [`attend_tile`] to rounding, not
/// bit for bit: decode's rows are never compared with a prefill's (their linears differ).
pub fn attend_tile_one(q: &[f32], kv: HeadKv<'_>, span: Range<usize>, scale: f32, start: usize, tile: &mut Partial, scores: &mut Vec<f32>) {
    let (rows, hd) = check_sizes("attend_tile_one", q, kv, tile, start);
    let held = kv.positions();
    let seen = clip(clip(span, &held), &(start..start + KEY_BLOCK));
    if seen.is_empty() {
        return;
    }
    let n = seen.len();
    let at = (seen.start - held.start) * hd;
    scores.resize(rows * n, 0.0);
    let s = &mut scores[..rows * n];
    dots(q, kv.keys.range(at..at + n * hd), hd, s);
    for (r, row) in s.chunks_exact_mut(n).enumerate() {
        let m = scale * row_max(row);
        tile.sum[r] = exp_shifted(row, scale, m);
        tile.max[r] = m;
    }
    weighted_sum(s, kv.values.range(at..at + n * hd), hd, &mut tile.out);
}

/// `s[r * n + j] = q_r . k_j` for the rows of `q` and the `n` keys (`[n, hd]`). f16 keys are
/// read as they lie and widened in the register on the vector paths (a decode step reads each
/// once: widening them into a buffer first cost 8% of SmolLM2's decode at 1.4k tokens on x86);
/// q8 keys, and f16 ones elsewhere, are widened into a buffer. The same f32 values and sums
/// either way, so the same bits.
fn dots(q: &[f32], keys: KvRows<'_>, hd: usize, s: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(8) && super::rows::avx2_fma() {
        // SAFETY (each): the CPU has AVX2 and FMA (and F16C for f16); the sizes are whole
        // vectors (checked above).
        match keys {
            KvRows::F32(k) => return unsafe { x86::dots(q, k, hd, s) },
            KvRows::F16(k) if super::cpu::cpu().f16c => return unsafe { x86::dots_f16(q, k, hd, s) },
            _ => {}
        }
    }
    #[cfg(target_arch = "aarch64")]
    if hd.is_multiple_of(4) {
        // SAFETY (each): NEON is in the aarch64 baseline; the sizes are whole vectors (checked
        // above).
        match keys {
            KvRows::F32(k) => return unsafe { neon::dots(q, k, hd, s) },
            KvRows::F16(k) => return unsafe { neon::dots_f16(q, k, hd, s) },
            _ => {}
        }
    }
    match keys {
        KvRows::F32(k) => dots_plain(q, k, hd, s),
        _ => WIDE.with_borrow_mut(|(kb, _)| dots(q, KvRows::F32(keys.as_f32(kb)), hd, s)),
    }
}

/// [`dots`] as plain loops (each product rounded, then summed in order), for any `hd`.
fn dots_plain(q: &[f32], keys: &[f32], hd: usize, s: &mut [f32]) {
    let n = keys.len() / hd;
    for (qr, sr) in q.chunks_exact(hd).zip(s.chunks_exact_mut(n)) {
        for (k, out) in keys.chunks_exact(hd).zip(sr) {
            *out = qr.iter().zip(k).map(|(a, b)| a * b).sum();
        }
    }
}

/// `out[r] = sum_j p[r * n + j] v_j` for the rows of `p` and the `n` values (`[n, hd]`), the
/// values read as [`dots`] reads the keys.
fn weighted_sum(p: &[f32], values: KvRows<'_>, hd: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(8) && super::rows::avx2_fma() {
        // SAFETY (each): as in `dots`.
        match values {
            KvRows::F32(v) => return unsafe { x86::weighted_sum(p, v, hd, out) },
            KvRows::F16(v) if super::cpu::cpu().f16c => return unsafe { x86::weighted_sum_f16(p, v, hd, out) },
            _ => {}
        }
    }
    #[cfg(target_arch = "aarch64")]
    if hd.is_multiple_of(4) {
        // SAFETY (each): as in `dots`.
        match values {
            KvRows::F32(v) => return unsafe { neon::weighted_sum(p, v, hd, out) },
            KvRows::F16(v) => return unsafe { neon::weighted_sum_f16(p, v, hd, out) },
            _ => {}
        }
    }
    match values {
        KvRows::F32(v) => weighted_sum_plain(p, v, hd, out),
        _ => WIDE.with_borrow_mut(|(_, vb)| weighted_sum(p, KvRows::F32(values.as_f32(vb)), hd, out)),
    }
}

/// [`weighted_sum`] as plain loops (a product rounded, then added, key after key), for any `hd`.
fn weighted_sum_plain(p: &[f32], values: &[f32], hd: usize, out: &mut [f32]) {
    let n = values.len() / hd;
    for (pr, o) in p.chunks_exact(n).zip(out.chunks_exact_mut(hd)) {
        o.fill(0.0);
        for (&w, v) in pr.iter().zip(values.chunks_exact(hd)) {
            o.iter_mut().zip(v).for_each(|(o, &v)| *o += w * v);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::kernels::hsum8;

    /// Eight keys or values at `p` (element `i`) as f32: f32 as they are, or f16 (`F16`)
    /// widened by F16C's `vcvtph2ps` (exact: the values `half` widens them to). Inlined into
    /// its callers, whose features (F16C for `F16`) it needs.
    #[inline(always)]
    unsafe fn load8<const F16: bool>(p: *const u8, i: usize) -> __m256 {
        // SAFETY: the caller's: eight elements from `i` lie in `p`'s allocation, and F16C for f16.
        unsafe {
            match F16 {
                true => _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i).cast())),
                false => _mm256_loadu_ps(p.add(4 * i).cast()),
            }
        }
    }

    /// [`super::dots`], `hd` a multiple of 8: blocks of four keys by up to three query rows,
    /// each key vector widened once for all the rows (12 independent FMA chains, enough for two
    /// FMA pipes of latency 4; a query vector is a memory operand), and the four keys' sums of a
    /// row reduced together. Before, keys went two at a time against one row, so every key was
    /// loaded and widened once per row, and each sum reduced alone.
    ///
    /// Every score is [`hsum8`] of the chain `fma(q_c, k_c, acc)` over the key's vectors in
    /// order, whichever block it falls in: the same bits as one key at a time.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dots(q: &[f32], keys: &[f32], hd: usize, s: &mut [f32]) {
        // SAFETY: the caller's (AVX2, FMA, whole vectors); `keys` holds `len` f32.
        unsafe { dots_of::<false>(q, keys.as_ptr().cast(), keys.len(), hd, s) }
    }

    /// [`dots`] on f16 keys, widened as they are loaded.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots_f16(q: &[f32], keys: &[half::f16], hd: usize, s: &mut [f32]) {
        // SAFETY: the caller's (AVX2, FMA, F16C, whole vectors); `keys` holds `len` f16.
        unsafe { dots_of::<true>(q, keys.as_ptr().cast(), keys.len(), hd, s) }
    }

    /// [`dots`] over `len` keys' values at `keys` (f32, or f16 with `F16`).
    #[inline(always)]
    unsafe fn dots_of<const F16: bool>(q: &[f32], keys: *const u8, len: usize, hd: usize, s: &mut [f32]) {
        let n = len / hd;
        let rows = q.len() / hd;
        assert!(hd.is_multiple_of(8) && len == n * hd && s.len() >= rows * n, "x86::dots: {len} keys of {hd}, {} scores", s.len());
        for r0 in (0..rows).step_by(3) {
            let (q, s) = (&q[r0 * hd..], &mut s[r0 * n..]);
            // SAFETY (each): `rows - r0` rows of `hd` query values and of `n` scores from `q`
            // and `s` (asserted), `keys` `n` rows of `hd`, `hd` a multiple of 8.
            unsafe {
                match rows - r0 {
                    1 => key_blocks::<1, F16>(q, keys, hd, n, s),
                    2 => key_blocks::<2, F16>(q, keys, hd, n, s),
                    _ => key_blocks::<3, F16>(q, keys, hd, n, s),
                }
            }
        }
    }

    /// The scores of `R` query rows (`q` and `s` start at the first) against the `n` keys: blocks
    /// of four keys, the last one to three keys one at a time.
    ///
    /// # Safety
    /// `q` holds `R` rows of `hd`, `s` `R` rows of `n`, `keys` `n` rows of `hd` (f32, or f16 with
    /// `F16`); `hd` is a multiple of 8; the CPU has the callers' features.
    #[inline(always)]
    unsafe fn key_blocks<const R: usize, const F16: bool>(q: &[f32], keys: *const u8, hd: usize, n: usize, s: &mut [f32]) {
        let q = q.as_ptr();
        let mut j = 0;
        // SAFETY (both): keys j..j + K of the n, c + 8 <= hd, rows i < R: the caller's sizes.
        while j + 4 <= n {
            unsafe {
                let acc = dot_keys::<R, 4, F16>(q, keys, hd, j);
                for (i, a) in acc.iter().enumerate() {
                    _mm_storeu_ps(s.as_mut_ptr().add(i * n + j), hsum8x4(a));
                }
            }
            j += 4;
        }
        while j < n {
            unsafe {
                let acc = dot_keys::<R, 1, F16>(q, keys, hd, j);
                for (i, a) in acc.iter().enumerate() {
                    s[i * n + j] = hsum8(a[0]);
                }
            }
            j += 1;
        }
    }

    /// `q_i . k_j` for the `R` rows from `q` and the `K` keys from key `j0`, as vectors of eight
    /// partial sums.
    ///
    /// # Safety
    /// As [`key_blocks`], and keys `j0..j0 + K` exist.
    #[inline(always)]
    unsafe fn dot_keys<const R: usize, const K: usize, const F16: bool>(q: *const f32, keys: *const u8, hd: usize, j0: usize) -> [[__m256; K]; R] {
        let mut acc = [[_mm256_setzero_ps(); K]; R];
        for c in (0..hd).step_by(8) {
            for k in 0..K {
                // SAFETY: the caller's sizes (c + 8 <= hd, key j0 + k, row i).
                unsafe {
                    let kv = load8::<F16>(keys, (j0 + k) * hd + c);
                    for (i, a) in acc.iter_mut().enumerate() {
                        a[k] = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(i * hd + c)), kv, a[k]);
                    }
                }
            }
        }
        acc
    }

    /// [`hsum8`] of each of four vectors, together: `[hsum8(a[0]), .., hsum8(a[3])]`, in its order
    /// of additions (`x_i + x_(i+4)`, then lanes 0 + 2 and 1 + 3, then those two), so the same bits.
    #[inline(always)]
    unsafe fn hsum8x4(a: &[__m256; 4]) -> __m128 {
        // SAFETY: registers only (the callers have AVX).
        unsafe {
            // [a.y | b.y] and [c.y | d.y], y_i = x_i + x_(i+4).
            let ab = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(a[0], a[1]), _mm256_permute2f128_ps::<0x31>(a[0], a[1]));
            let cd = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(a[2], a[3]), _mm256_permute2f128_ps::<0x31>(a[2], a[3]));
            // Per half: [y0 + y2, y1 + y3] of a and c (b and d in the upper half).
            let w = _mm256_add_ps(_mm256_shuffle_ps::<0b01_00_01_00>(ab, cd), _mm256_shuffle_ps::<0b11_10_11_10>(ab, cd));
            // Per half: [a, c, a, c] (upper: b, d), then interleaved into [a, b, c, d].
            let z = _mm256_hadd_ps(w, w);
            _mm_unpacklo_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps::<1>(z))
        }
    }

    /// [`super::weighted_sum`], `hd` a multiple of 8: blocks of up to three rows by 32 values
    /// (four vectors: a cache line of f16 values; four rows by 16) summed in registers over
    /// every key: 12 independent FMA chains for three rows, 8 for four. Before, one vector of
    /// each row at a time, so three rows (SmolLM2) were three FMA chains, waiting on the FMA's
    /// latency.
    ///
    /// Every output is `fma(p_j, v_j, acc)` over the keys in order from 0, as before.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn weighted_sum(p: &[f32], values: &[f32], hd: usize, out: &mut [f32]) {
        // SAFETY: the caller's (AVX2, FMA, whole vectors); `values` holds `len` f32.
        unsafe { weighted_sum_of::<false>(p, values.as_ptr().cast(), values.len(), hd, out) }
    }

    /// [`weighted_sum`] on f16 values, widened as they are loaded.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn weighted_sum_f16(p: &[f32], values: &[half::f16], hd: usize, out: &mut [f32]) {
        // SAFETY: the caller's (AVX2, FMA, F16C, whole vectors); `values` holds `len` f16.
        unsafe { weighted_sum_of::<true>(p, values.as_ptr().cast(), values.len(), hd, out) }
    }

    /// [`weighted_sum`] over `len` values at `values` (f32, or f16 with `F16`).
    #[inline(always)]
    unsafe fn weighted_sum_of<const F16: bool>(p: &[f32], values: *const u8, len: usize, hd: usize, out: &mut [f32]) {
        let n = len / hd;
        let rows = p.len() / n.max(1);
        assert!(
            hd.is_multiple_of(8) && len == n * hd && p.len() == rows * n && out.len() >= rows * hd,
            "x86::weighted_sum: {} weights, {len} values of {hd}, {} outputs",
            p.len(),
            out.len()
        );
        for r0 in (0..rows).step_by(4) {
            let (p, out) = (&p[r0 * n..], &mut out[r0 * hd..]);
            // SAFETY (each): `rows - r0` rows of `n` weights and `hd` outputs from `p` and `out`
            // (asserted), `values` `n` rows of `hd`, `hd` a multiple of 8.
            unsafe {
                match rows - r0 {
                    1 => strips::<1, F16>(p, values, hd, n, out),
                    2 => strips::<2, F16>(p, values, hd, n, out),
                    3 => strips::<3, F16>(p, values, hd, n, out),
                    _ => strips::<4, F16>(p, values, hd, n, out),
                }
            }
        }
    }

    /// `R` rows of [`weighted_sum`] (`p` and `out` start at the first): 32 values at a time (16
    /// for four rows), then 16, then 8.
    ///
    /// # Safety
    /// `p` holds `R` rows of `n` weights, `out` `R` rows of `hd`, `values` `n` rows of `hd` (f32,
    /// or f16 with `F16`); `hd` is a multiple of 8; the CPU has the callers' features.
    #[inline(always)]
    unsafe fn strips<const R: usize, const F16: bool>(p: &[f32], values: *const u8, hd: usize, n: usize, out: &mut [f32]) {
        let (p, o) = (p.as_ptr(), out.as_mut_ptr());
        let mut c = 0;
        // SAFETY (each): c + 8 * S <= hd; the caller's sizes. Four vectors a row for up to three
        // rows (12 accumulators); four rows of four would spill AVX2's 16 registers (they
        // measured slower than four rows of two).
        while R <= 3 && c + 32 <= hd {
            unsafe { columns::<R, 4, F16>(p, values, hd, n, o, c) };
            c += 32;
        }
        while c + 16 <= hd {
            unsafe { columns::<R, 2, F16>(p, values, hd, n, o, c) };
            c += 16;
        }
        if c < hd {
            unsafe { columns::<R, 1, F16>(p, values, hd, n, o, c) };
        }
    }

    /// Values `c..c + 8 * S` of `R` output rows: their sums over the `n` keys in registers.
    ///
    /// # Safety
    /// As [`strips`], and `c + 8 * S <= hd`.
    #[inline(always)]
    unsafe fn columns<const R: usize, const S: usize, const F16: bool>(p: *const f32, values: *const u8, hd: usize, n: usize, o: *mut f32, c: usize) {
        let mut acc = [[_mm256_setzero_ps(); S]; R];
        for j in 0..n {
            // SAFETY: key j < n, values c..c + 8 * S of its row, rows i < R: the caller's sizes.
            unsafe {
                let v: [__m256; S] = std::array::from_fn(|t| load8::<F16>(values, j * hd + c + 8 * t));
                for (i, a) in acc.iter_mut().enumerate() {
                    let w = _mm256_set1_ps(*p.add(i * n + j));
                    for t in 0..S {
                        a[t] = _mm256_fmadd_ps(w, v[t], a[t]);
                    }
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            for (t, a) in a.iter().enumerate() {
                // SAFETY: row i < R, values c + 8t..c + 8t + 8 <= hd: within `out`.
                unsafe { _mm256_storeu_ps(o.add(i * hd + c + 8 * t), *a) };
            }
        }
    }
}

/// The aarch64 kernels. NEON is in the aarch64 baseline, so they run on every aarch64 CPU, with
/// no run-time check; `#[target_feature(enable = "neon")]` only lets their bodies call the
/// intrinsics as safe functions. Each is a function of its own (`neon::dots`,
/// `neon::weighted_sum`, `neon::strip`), so that its inner loop can be read in the assembly.
#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    use crate::kernels::arm::hsum4;

    /// [`super::dots`], `hd` a multiple of 4: four keys at a time, so that each query vector
    /// loaded serves four products, and two accumulators per key (the even and odd vectors of
    /// the row): eight independent FMA chains, as many as two FMA pipes of latency 4 keep busy.
    /// The keys are read once, in order (again per row, from L1).
    ///
    /// Each product meets at most `ceil(hd / 8) + 3` roundings (its chain, the two accumulators'
    /// sum, [`hsum4`]'s two levels); the plain loop's first meets `hd + 1`. Four keys' sums are
    /// reduced together, by three `faddp` of two vectors each, in [`hsum4`]'s order.
    #[target_feature(enable = "neon")]
    pub fn dots(q: &[f32], keys: &[f32], hd: usize, s: &mut [f32]) {
        dots_of::<false>(q, keys.as_ptr().cast(), keys.len(), hd, s)
    }

    /// [`dots`] on f16 keys, widened as they are loaded (`fcvtl`: the values `half` widens them
    /// to, so the same sums and bits).
    #[target_feature(enable = "neon")]
    pub fn dots_f16(q: &[f32], keys: &[half::f16], hd: usize, s: &mut [f32]) {
        dots_of::<true>(q, keys.as_ptr().cast(), keys.len(), hd, s)
    }

    /// Four values at element `i` of `p` as f32: f32 as they are, or f16 (`F16`) widened.
    ///
    /// # Safety
    /// Four elements from `i` lie within `p`'s allocation.
    #[inline(always)]
    unsafe fn load4<const F16: bool>(p: *const u8, i: usize) -> float32x4_t {
        // SAFETY: the caller's; NEON and its f16 conversions are in the aarch64 baseline.
        unsafe {
            match F16 {
                true => vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p.add(2 * i).cast()))),
                false => vld1q_f32(p.add(4 * i).cast()),
            }
        }
    }

    /// [`dots`] over `len` keys' values at `keys` (f32, or f16 with `F16`).
    #[target_feature(enable = "neon")]
    #[inline]
    fn dots_of<const F16: bool>(q: &[f32], keys: *const u8, len: usize, hd: usize, s: &mut [f32]) {
        let n = len / hd;
        let rows = q.len() / hd;
        assert!(hd.is_multiple_of(4) && len == n * hd && s.len() >= rows * n, "neon::dots: {len} keys of {hd}, {} scores", s.len());
        let size = if F16 { 2 } else { 4 };
        let mut j = 0;
        while j < n {
            // SAFETY: key j < n starts within the `len` values.
            let k = unsafe { keys.add(j * hd * size) };
            for r in 0..rows {
                let qr = q[r * hd..][..hd].as_ptr();
                let out = &mut s[r * n + j..];
                // SAFETY (each): `qr` starts a row of `hd` values and `k` the rows of the keys
                // j.. (at least as many as the const count: `n - j` of them); `hd` is a multiple
                // of 4.
                unsafe {
                    match n - j {
                        1 => out[0] = hsum4(dot_keys::<1, F16>(qr, k, hd)[0]),
                        2 => out[..2].copy_from_slice(&dot_keys::<2, F16>(qr, k, hd).map(hsum4)),
                        3 => out[..3].copy_from_slice(&dot_keys::<3, F16>(qr, k, hd).map(hsum4)),
                        _ => {
                            // [(a0 + a1) + (a2 + a3), (b0 + b1) + (b2 + b3), ...]: hsum4 of each.
                            let [a, b, c, d] = dot_keys::<4, F16>(qr, k, hd);
                            vst1q_f32(out[..4].as_mut_ptr(), vpaddq_f32(vpaddq_f32(a, b), vpaddq_f32(c, d)));
                        }
                    }
                }
            }
            j += 4;
        }
    }

    /// `q . k_i` for the `K` keys of `hd` values from `k` on, as a vector of 4 partial sums each.
    ///
    /// # Safety
    /// `q` points at `hd` values, `k` at `K * hd` (f32, or f16 with `F16`), and `hd` is a
    /// multiple of 4.
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn dot_keys<const K: usize, const F16: bool>(q: *const f32, k: *const u8, hd: usize) -> [float32x4_t; K] {
        let (mut even, mut odd) = ([vdupq_n_f32(0.0); K], [vdupq_n_f32(0.0); K]);
        let mut c = 0;
        // SAFETY (both blocks): c + 8 <= hd, or c + 4 <= hd in the last; the caller's sizes.
        while c + 8 <= hd {
            unsafe {
                let (x0, x1) = (vld1q_f32(q.add(c)), vld1q_f32(q.add(c + 4)));
                for i in 0..K {
                    even[i] = vfmaq_f32(even[i], x0, load4::<F16>(k, i * hd + c));
                    odd[i] = vfmaq_f32(odd[i], x1, load4::<F16>(k, i * hd + c + 4));
                }
            }
            c += 8;
        }
        if c < hd {
            unsafe {
                let x = vld1q_f32(q.add(c));
                for i in 0..K {
                    even[i] = vfmaq_f32(even[i], x, load4::<F16>(k, i * hd + c));
                }
            }
        }
        std::array::from_fn(|i| vaddq_f32(even[i], odd[i]))
    }

    /// [`super::weighted_sum`], `hd` a multiple of 4: blocks of up to 4 rows by 16 values (4
    /// vectors) held in registers over every key (16 accumulators, 4 value vectors, 4 weight
    /// vectors: 24 of the 32 registers). Each step loads the weights of 4 keys per row as one
    /// vector and multiplies by its lanes (`fmla .4s, v, w.s[l]`): 4 + 16 loads for 64 FMAs.
    ///
    /// Every output is `fma(p_j, v_j, acc)` over the keys in order from 0: the bits of the AVX2
    /// kernel, and of `f32::mul_add` in that order (the tests' twin).
    #[target_feature(enable = "neon")]
    pub fn weighted_sum(p: &[f32], values: &[f32], hd: usize, out: &mut [f32]) {
        weighted_sum_of::<false>(p, values.as_ptr().cast(), values.len(), hd, out)
    }

    /// [`weighted_sum`] on f16 values, widened as they are loaded.
    #[target_feature(enable = "neon")]
    pub fn weighted_sum_f16(p: &[f32], values: &[half::f16], hd: usize, out: &mut [f32]) {
        weighted_sum_of::<true>(p, values.as_ptr().cast(), values.len(), hd, out)
    }

    /// [`weighted_sum`] over `len` values at `values` (f32, or f16 with `F16`).
    #[target_feature(enable = "neon")]
    #[inline]
    fn weighted_sum_of<const F16: bool>(p: &[f32], values: *const u8, len: usize, hd: usize, out: &mut [f32]) {
        let n = len / hd;
        let rows = p.len() / n.max(1);
        assert!(
            hd.is_multiple_of(4) && len == n * hd && p.len() == rows * n && out.len() >= rows * hd,
            "neon::weighted_sum: {} weights, {len} values of {hd}, {} outputs",
            p.len(),
            out.len()
        );
        for r0 in (0..rows).step_by(4) {
            let (p, out) = (&p[r0 * n..], &mut out[r0 * hd..]);
            // SAFETY (each): `rows - r0` rows of `n` weights and `hd` outputs from `p` and `out`
            // (asserted), `values` `n` rows of `hd`, `hd` a multiple of 4.
            unsafe {
                match rows - r0 {
                    1 => strip::<1, F16>(p, values, hd, n, out),
                    2 => strip::<2, F16>(p, values, hd, n, out),
                    3 => strip::<3, F16>(p, values, hd, n, out),
                    _ => strip::<4, F16>(p, values, hd, n, out),
                }
            }
        }
    }

    /// `R` rows of [`weighted_sum`] (`p` and `out` start at the first), 16 values at a time and
    /// the last 4, 8 or 12 one vector at a time.
    ///
    /// # Safety
    /// `p` holds `R` rows of `n` weights, `out` `R` rows of `hd`, `values` `n` rows of `hd` (f32,
    /// or f16 with `F16`), and `hd` is a multiple of 4.
    #[target_feature(enable = "neon")]
    #[inline(never)]
    unsafe fn strip<const R: usize, const F16: bool>(p: &[f32], values: *const u8, hd: usize, n: usize, out: &mut [f32]) {
        let (p, v, o) = (p.as_ptr(), values, out.as_mut_ptr());
        let mut c = 0;
        while c + 16 <= hd {
            // SAFETY: c + 16 <= hd; the caller's sizes.
            unsafe { columns::<R, 4, F16>(p, v, hd, n, o.add(c), c) };
            c += 16;
        }
        while c < hd {
            // SAFETY: c + 4 <= hd (a multiple of 4); the caller's sizes.
            unsafe { columns::<R, 1, F16>(p, v, hd, n, o.add(c), c) };
            c += 4;
        }
    }

    /// The `C` vectors of outputs at column `c` of `R` rows (`o` points at row 0's).
    ///
    /// # Safety
    /// As [`strip`], and `c + 4 C <= hd`.
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn columns<const R: usize, const C: usize, const F16: bool>(p: *const f32, v: *const u8, hd: usize, n: usize, o: *mut f32, c: usize) {
        let mut acc = [[vdupq_n_f32(0.0); C]; R];
        let mut j = 0;
        // SAFETY (each block): keys j..j + 4 (or j) < n, rows i < R, columns c..c + 4C <= hd.
        while j + 4 <= n {
            unsafe {
                let w: [float32x4_t; R] = std::array::from_fn(|i| vld1q_f32(p.add(i * n + j)));
                macro_rules! key {
                    ($l:literal) => {
                        let x: [float32x4_t; C] = std::array::from_fn(|k| load4::<F16>(v, (j + $l) * hd + c + 4 * k));
                        for i in 0..R {
                            for k in 0..C {
                                acc[i][k] = vfmaq_laneq_f32::<$l>(acc[i][k], x[k], w[i]);
                            }
                        }
                    };
                }
                key!(0);
                key!(1);
                key!(2);
                key!(3);
            }
            j += 4;
        }
        while j < n {
            unsafe {
                let x: [float32x4_t; C] = std::array::from_fn(|k| load4::<F16>(v, j * hd + c + 4 * k));
                for i in 0..R {
                    let w = *p.add(i * n + j);
                    for k in 0..C {
                        acc[i][k] = vfmaq_n_f32(acc[i][k], x[k], w);
                    }
                }
            }
            j += 1;
        }
        for i in 0..R {
            for k in 0..C {
                // SAFETY: row i < R, columns c + 4k + 4 <= hd: within `out`.
                unsafe { vst1q_f32(o.add(i * hd + 4 * k), acc[i][k]) };
            }
        }
    }
}

/// (rows, head_dim) of a tile call, after checking that its sizes agree; wrong sizes are the
/// caller's bug and panic, naming `what` and them.
fn check_sizes(what: &str, q: &[f32], kv: HeadKv<'_>, tile: &Partial, start: usize) -> (usize, usize) {
    let (rows, hd) = (tile.rows(), kv.head_dim);
    assert!(
        hd > 0
            && tile.head_dim == hd
            && q.len() == rows * hd
            && kv.keys.len() == kv.values.len()
            && kv.keys.len().is_multiple_of(hd)
            && start.is_multiple_of(KEY_BLOCK),
        "attention::{what}: q {} for {rows} rows of {hd}, keys {}, values {}, partial of {}, tile at {start}",
        q.len(),
        kv.keys.len(),
        kv.values.len(),
        tile.head_dim
    );
    (rows, hd)
}

/// `a` within `b` (an empty range inside `b` when they do not meet).
fn clip(a: Range<usize>, b: &Range<usize>) -> Range<usize> {
    let start = a.start.max(b.start).min(b.end);
    start..a.end.min(b.end).max(start)
}

#[cfg(test)]
mod tests;
