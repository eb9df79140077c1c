//! The decode matrix-vector product (M = 1) on weights in ggml's Q8_0 blocks, at memory speed.
//!
//! Decode reads every weight once per token and does two operations per weight byte, so its speed
//! is the memory's: the kernel only has to keep the loads coming. It reads the weights where they
//! are, in candle's `BlockQ8_0` storage (`QTensor::data()` of a Q8_0 tensor, rows = output
//! features): per 32 consecutive weights of a row, 34 bytes, an f16 scale `d` (little-endian)
//! then 32 i8; a row of K weights is K / 32 blocks, rows one after another. No repacking, so
//! there is no second copy of the weights.
//!
//! The activation is quantized once per token to the same blocks ([`Q8Activation`], ggml's
//! `quantize_row_q8_0`, as candle's Q8_0 matmul does) but with an f32 scale where ggml rounds it
//! to f16: the block dot products are then exact in i32, and the only float work is one
//! multiply-add per block, `d_w * d_x * dot`.
//!
//! Paths, chosen once per process ([`GemvPath::detect`]; tests run every path this machine has):
//! - [`GemvPath::Avx2`] (x86_64 with AVX2, FMA and F16C): a block of 32 i8 x 32 i8 in four
//!   instructions with ggml's sign trick (`vpsignb` twice, `vpmaddubsw`, `vpmaddwd` by ones), the
//!   rows one after another so that the weights are one sequential stream, prefetched 8 KiB
//!   ahead (see `x86` for why, and the measurements).
//! - [`GemvPath::Portable`]: plain Rust, any CPU (aarch64 included), and the AVX2 path's
//!   cross-check.

use std::ops::Range;
use std::sync::OnceLock;

/// Values per Q8_0 block.
pub const QK: usize = 32;
/// Bytes per Q8_0 weight block: an f16 scale, then 32 i8.
pub const BLOCK_BYTES: usize = 34;

/// The activation as Q8_0 blocks: per 32 values one f32 scale and 32 i8 (ggml's
/// `quantize_row_q8_0`: `d = max|x| / 127`, `q = round(x / d)`, so `q` is in [-127, 127]).
///
/// [`gemv_q8_0`] needs `q` in [-127, 127] (its AVX2 path negates `q`, and -(-128) wraps), and
/// asserts it: build the fields by hand only with that range.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Q8Activation {
    /// One per block of 32 values (`q.len() / 32`).
    pub scales: Vec<f32>,
    /// The quantized values, in [-127, 127].
    pub q: Vec<i8>,
}

impl Q8Activation {
    /// `x` (K values, K a multiple of 32) quantized.
    pub fn quantize(x: &[f32]) -> Self {
        let mut a = Self::default();
        a.quantize_into(x);
        a
    }

    /// `x` quantized into this activation's buffers: once they have the capacity of one token's
    /// K, decode quantizes every later token without allocating.
    ///
    /// As ggml (`q = round(x * (1 / d))`, half away from zero); an all-zero block has scale 0 and
    /// q 0. `|x * (1 / d)|` is at most 127 plus a rounding, so `q` is in [-127, 127]; the clamp
    /// only makes that a guarantee (a NaN passes it, and `as i8` makes it 0).
    pub fn quantize_into(&mut self, x: &[f32]) {
        assert!(x.len().is_multiple_of(QK), "Q8Activation: {} values is not a whole number of 32-value blocks", x.len());
        self.q.resize(x.len(), 0);
        self.scales.resize(x.len() / QK, 0.0);
        for ((xb, qb), d) in x.chunks_exact(QK).zip(self.q.chunks_exact_mut(QK)).zip(&mut self.scales) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            *d = amax / 127.0;
            let id = if *d != 0.0 { 1.0 / *d } else { 0.0 };
            for (q, &v) in qb.iter_mut().zip(xb) {
                *q = (v * id).round().clamp(-127.0, 127.0) as i8;
            }
        }
    }
}

/// Which kernel [`gemv_q8_0`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvPath {
    /// x86_64 with AVX2, FMA and F16C (every AVX2 CPU has F16C: Intel since Ivy Bridge, AMD
    /// since Piledriver, so asking for it loses no machine and spares a path without it).
    Avx2,
    /// Plain Rust: any CPU.
    Portable,
}

impl GemvPath {
    /// The fastest path this CPU runs, detected once.
    pub fn detect() -> Self {
        static PATH: OnceLock<GemvPath> = OnceLock::new();
        *PATH.get_or_init(|| if GemvPath::Avx2.runs_here() { GemvPath::Avx2 } else { GemvPath::Portable })
    }

    /// Whether this CPU has the features the path is compiled for.
    pub fn runs_here(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            GemvPath::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            GemvPath::Avx2 => false,
            GemvPath::Portable => true,
        }
    }
}

/// `out[j] = sum over blocks b of d_w(r, b) * d_x(b) * sum_i w[r, b, i] * q_x[b, i]` for the rows
/// `r` in `rows` (`out[j]` is row `rows.start + j`), on [`GemvPath::detect`]'s path.
///
/// `w` is whole rows of K weights in Q8_0 blocks (see the module docs), `k` a multiple of 32.
/// A caller splits the rows over its threads by giving each a sub-range and its part of `out`.
/// Wrong sizes are the caller's bug and panic, naming them.
pub fn gemv_q8_0(w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>, out: &mut [f32]) {
    gemv_q8_0_on(GemvPath::detect(), w, k, x, rows, out)
}

/// [`gemv_q8_0`] on `path` (tests run every path this machine runs); panics if the CPU lacks
/// the path's features.
pub fn gemv_q8_0_on(path: GemvPath, w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>, out: &mut [f32]) {
    assert!(k.is_multiple_of(QK), "gemv_q8_0: K = {k} is not a multiple of 32");
    let nb = k / QK;
    let row_bytes = nb * BLOCK_BYTES;
    assert_eq!(x.q.len(), k, "gemv_q8_0: the activation has {} values for K = {k}", x.q.len());
    assert_eq!(x.scales.len(), nb, "gemv_q8_0: the activation has {} scales for K = {k} ({nb} blocks)", x.scales.len());
    assert!(rows.start <= rows.end, "gemv_q8_0: rows {rows:?} are reversed");
    assert_eq!(out.len(), rows.len(), "gemv_q8_0: out has {} values for rows {rows:?}", out.len());
    if row_bytes == 0 {
        out.fill(0.0);
        return;
    }
    assert!(
        w.len().is_multiple_of(row_bytes) && rows.end <= w.len() / row_bytes,
        "gemv_q8_0: the weight's {} bytes are not whole rows of K = {k} ({row_bytes} bytes each) up to row {}",
        w.len(),
        rows.end
    );
    // `contains` on bytes is a memchr: K bytes, against rows.len() * K of weights.
    assert!(!x.q.contains(&i8::MIN), "gemv_q8_0: the activation has a -128 (Q8Activation::quantize gives [-127, 127])");
    assert!(path.runs_here(), "gemv_q8_0: this CPU cannot run {path:?}");
    let w = &w[rows.start * row_bytes..rows.end * row_bytes];
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2, FMA and F16C (asserted above); `w` is `out.len()` whole rows
        // of `nb` blocks, and the activation has `nb` blocks (asserted above) with no -128.
        GemvPath::Avx2 => unsafe { x86::gemv_avx2(w, nb, x, out) },
        #[cfg(not(target_arch = "x86_64"))]
        GemvPath::Avx2 => unreachable!("GemvPath::Avx2 never runs off x86_64 (asserted above)"),
        GemvPath::Portable => gemv_portable(w, nb, x, out),
    }
}

/// The portable path: per block an i32 dot of 32 i8 pairs (a fixed-size loop, for the
/// vectorizer), scaled and summed in f32. 12 GB/s on the build machine for SSE2, which has no
/// byte multiply-add: a third of its memory speed (Arm's `sdot` would be the path to add there).
fn gemv_portable(w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
    for (o, row) in out.iter_mut().zip(w.chunks_exact(nb * BLOCK_BYTES)) {
        let mut acc = 0f32;
        for ((blk, qx), &dx) in row.chunks_exact(BLOCK_BYTES).zip(x.q.chunks_exact(QK)).zip(&x.scales) {
            let dw = half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32();
            let qw: &[u8; QK] = blk[2..].try_into().expect("34-byte block");
            let qx: &[i8; QK] = qx.try_into().expect("32-value block");
            let dot: i32 = qw.iter().zip(qx).map(|(&w, &q)| w as i8 as i32 * q as i32).sum();
            acc += dw * dx * dot as f32;
        }
        *o = acc;
    }
}

/// The AVX2 path.
///
/// A block's dot product in four instructions (ggml's sign trick): `vpmaddubsw` multiplies
/// *unsigned* bytes by signed bytes, so the weight's sign moves onto the activation first:
/// `|w|` (`vpsignb w, w`) times `x * sign(w)` (`vpsignb x, w`) is `w * x`. `vpmaddubsw` sums each
/// pair of products into an i16, saturating; `vpmaddwd` by ones widens the pairs into 8 i32.
///
/// Why it never saturates: `|w|` is at most 128 (a weight of -128, which the NPU's quantizer may
/// give, becomes the byte 0x80 = 128 as the unsigned operand, its true magnitude), and
/// `x * sign(w)` at most 127 in magnitude because `x` is in [-127, 127] (asserted: -(-128) would
/// wrap to -128), so a pair sums to at most 2 * 128 * 127 = 32512 < 32767. The 8 i32 lanes (at
/// most 4 * 128 * 127 = 65024 each) are exact in f32 and take the block's scale in one FMA.
///
/// One row at a time, so that the weights are read as one sequential stream, each block asking
/// for the line `PREFETCH` bytes ahead; two accumulators (even and odd blocks) halve the FMA
/// chain. Measured single-threaded on the build machine (AMD EPYC, 2 cores; 2026-11-25, issue 26)
/// with the weights read from DRAM (copies of the matrix in turn, 512 MiB in all), for 576x1536 and
/// 49152x576, GB/s of weight bytes (one matrix repeated, from L2/L3, in brackets):
/// - four rows at a time, each activation block loaded once per four rows: 8-11 (50, 9-12). A
///   row is only 612-1632 bytes: four short streams that restart every four rows, which the
///   hardware prefetcher never locks on to; prefetching each 8-16 KiB ahead gave 27-33;
/// - one row at a time: 28-30 (50, 40); prefetching 4 KiB ahead 33-34, 8 KiB ahead 36-39 (50,
///   46), 16-32 KiB ahead no better for the short matrix and a larger overshoot past a
///   caller's rows. The activation block, reloaded per row, comes from L1.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Q8Activation, BLOCK_BYTES, QK};

    /// Bytes ahead of the current block to prefetch (see the module docs).
    pub(super) const PREFETCH: usize = 8192;

    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `w` is `out.len()` whole rows of `nb` blocks; `x` has `nb`
    /// blocks and no -128.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv_avx2(w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
        let (xq, xd) = (x.q.as_ptr(), x.scales.as_ptr());
        for (o, row) in out.iter_mut().zip(w.chunks_exact(nb * BLOCK_BYTES)) {
            // SAFETY: `row` is `nb` blocks, the activation `nb` blocks with no -128; the CPU
            // has the features.
            *o = unsafe { row_dot(row.as_ptr(), nb, xq, xd) };
        }
    }

    /// One row's product.
    ///
    /// # Safety
    /// As [`gemv_avx2`], for the `nb` blocks at `w`; inlined only into it (its features).
    #[inline(always)]
    unsafe fn row_dot(w: *const u8, nb: usize, xq: *const i8, xd: *const f32) -> f32 {
        // SAFETY: every read is of blocks below `nb`, in the row and the activation (the
        // caller's contract); prefetches never fault, wherever they point.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let block = |b: usize, acc: __m256| {
                let blk = w.add(BLOCK_BYTES * b);
                _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH).cast());
                let wv = _mm256_loadu_si256(blk.add(2).cast());
                let xv = _mm256_loadu_si256(xq.add(QK * b).cast());
                let dw = f16_to_f32(u16::from_le(blk.cast::<u16>().read_unaligned()));
                // |w| (unsigned) times x * sign(w): see the module docs for why no pair saturates.
                let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
                let dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * *xd.add(b)), acc)
            };
            let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for b in (0..nb - nb % 2).step_by(2) {
                even = block(b, even);
                odd = block(b + 1, odd);
            }
            if nb % 2 == 1 {
                even = block(nb - 1, even);
            }
            hsum(_mm256_add_ps(even, odd))
        }
    }

    /// An f16 (its bits) as f32, with F16C's `vcvtph2ps`: exact, subnormals included.
    #[inline(always)]
    unsafe fn f16_to_f32(bits: u16) -> f32 {
        // SAFETY: the caller has F16C.
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))) }
    }

    /// [`f16_to_f32`] for the tests (against the `half` crate on every bit pattern).
    ///
    /// # Safety
    /// The CPU has F16C.
    #[cfg(test)]
    #[target_feature(enable = "f16c")]
    pub(super) unsafe fn f16_bits_to_f32(bits: u16) -> f32 {
        // SAFETY: the CPU has F16C (this function's contract).
        unsafe { f16_to_f32(bits) }
    }

    /// The sum of the 8 lanes.
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: the caller has AVX.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
        }
    }
}

/// `x @ w^T` for one F32 row `x` (`[1, K]`) and a Q8_0 matrix `w` (`[N, K]`) on the CPU, by
/// [`gemv_q8_0`] in 64-row chunks over the cores ([`super::claim`]: it keeps its speed beside
/// busy processes, where candle's pool does not); `None` for any other operands, which the
/// caller's candle matmul then takes.
pub fn matvec(w: &candle_core::quantized::QTensor, x: &candle_core::Tensor) -> crate::Result<Option<candle_core::Tensor>> {
    let (n, k) = match w.shape().dims() {
        &[n, k] => (n, k),
        _ => return Ok(None),
    };
    if w.dtype() != candle_core::quantized::GgmlDType::Q8_0 || x.dims() != [1, k] || x.dtype() != candle_core::DType::F32 || !x.device().is_cpu() {
        return Ok(None);
    }
    let bytes = w.data()?;
    let xq = Q8Activation::quantize(&x.flatten_all()?.to_vec1::<f32>()?);
    let mut y = vec![0f32; n];
    let out = OutPtr(y.as_mut_ptr());
    // Chunks of 64 rows (64 x 576 weights of SmolLM2 are ~38 KB: microseconds, enough to amortize
    // claiming one, small enough that a late helper leaves little to wait for). Small products
    // stay on the caller.
    let helpers = if n * k >= 1 << 16 { rayon::current_num_threads().saturating_sub(1) } else { 0 };
    super::claim::for_each_chunk(n, 64, helpers, &|rows| {
        // SAFETY: `rows` is within 0..n and each range goes to exactly one call
        // (`for_each_chunk`), so the slices are disjoint; `y` outlives the loop.
        let out = unsafe { std::slice::from_raw_parts_mut(out.get().add(rows.start), rows.len()) };
        gemv_q8_0(&bytes, k, &xq, rows, out);
    });
    Ok(Some(candle_core::Tensor::from_vec(y, (1, n), &candle_core::Device::Cpu)?))
}

/// The output of a parallel loop whose ranges write disjoint parts (see its use).
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every use writes a range no other use writes, and the buffer outlives the loop.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Every path this machine runs.
    fn paths() -> Vec<GemvPath> {
        [GemvPath::Portable, GemvPath::Avx2].into_iter().filter(|p| p.runs_here()).collect()
    }

    /// f16 scale bits of kind `kind` (0-4): subnormal (below 2^-14, down to 2^-24), large (up to
    /// 65504, the largest finite f16), zero, negative, ordinary; any kind for 5 and above.
    fn scale_bits(rng: &mut impl Rng, kind: usize) -> u16 {
        match if kind < 5 { kind } else { rng.random_range(0..5) } {
            0 => rng.random_range(0x0001..=0x03ff),
            1 => half::f16::from_f32(rng.random_range(1000.0..65504.0)).to_bits(),
            2 => 0,
            3 => 0x8000 | half::f16::from_f32(rng.random_range(1e-3..1.0)).to_bits(),
            _ => half::f16::from_f32(rng.random_range(1e-4..1.0)).to_bits(),
        }
    }

    /// `n` rows of `k` random weights as Q8_0 bytes, i8 values over the whole range (-128 too).
    /// Row `r`'s scales are of kind `r % 6` ([`scale_bits`]): one kind per row keeps the
    /// tolerance tight (a block 10^8 times larger than the rest would hide their errors), and
    /// every sixth row mixes them all.
    fn weights(rng: &mut impl Rng, n: usize, k: usize) -> Vec<u8> {
        let mut w = Vec::with_capacity(n * k / QK * BLOCK_BYTES);
        for r in 0..n {
            for _ in 0..k / QK {
                w.extend(scale_bits(rng, r % 6).to_le_bytes());
                w.extend((0..QK).map(|_| rng.random::<i8>() as u8));
            }
        }
        w
    }

    /// `k` activations in [-1, 1], or with `mixed` each block at its own magnitude (0 for an
    /// all-zero block, up to 1e4: a decode activation's outliers).
    fn activations(rng: &mut impl Rng, k: usize, mixed: bool) -> Vec<f32> {
        let mut x = Vec::with_capacity(k);
        for _ in 0..k / QK {
            let m = if mixed { [0.0, 1e-3, 1.0, 30.0, 1e4][rng.random_range(0..5)] } else { 1.0 };
            x.extend((0..QK).map(|_| if m == 0.0 { 0.0 } else { rng.random_range(-m..m) }));
        }
        x
    }

    /// Row `r`'s product in f64 (exact but for the final roundings) and the sum of the absolute
    /// block products, `sum_b |d_w d_x| sum_i |w_i q_i|`, that bounds the f32 error.
    fn reference(w: &[u8], k: usize, x: &Q8Activation, r: usize) -> (f64, f64) {
        let nb = k / QK;
        let (mut sum, mut abs) = (0f64, 0f64);
        for b in 0..nb {
            let blk = &w[(r * nb + b) * BLOCK_BYTES..][..BLOCK_BYTES];
            let s = half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f64() * x.scales[b] as f64;
            let prods = (0..QK).map(|i| blk[2 + i] as i8 as i64 * x.q[b * QK + i] as i64);
            sum += s * prods.clone().sum::<i64>() as f64;
            abs += s.abs() * prods.map(i64::abs).sum::<i64>() as f64;
        }
        (sum, abs)
    }

    /// The f32 error bound for K = `k`. Each block's dot is exact (i32, and below 2^24 in f32:
    /// the AVX2 lanes hold at most 65024, a whole block 520192), so the error is the float work:
    /// `d_w * d_x` rounded once, its product with the dot once (the FMA's), one rounding per block
    /// added to an accumulator (K / 32), and on the AVX2 path the sum of its two accumulators and
    /// the 3 levels of its 8-lane sum: a sum of depth at most K / 32 + 3. Standard summation
    /// analysis bounds that by `(K / 32 + 5) u * sum |terms|` with u = 2^-24;
    /// `f32::EPSILON` is 2u, a factor 2 of margin. It is tight enough to see a single weight off
    /// by one (see `the_tolerance_sees_one_weight_off_by_one`).
    fn tolerance(k: usize, abs: f64) -> f64 {
        (k / QK + 5) as f64 * f32::EPSILON as f64 * abs
    }

    fn check(path: GemvPath, w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>) {
        let mut out = vec![f32::NAN; rows.len()];
        gemv_q8_0_on(path, w, k, x, rows.clone(), &mut out);
        for (j, r) in rows.clone().enumerate() {
            let (want, abs) = reference(w, k, x, r);
            let err = (out[j] as f64 - want).abs();
            assert!(
                err <= tolerance(k, abs),
                "{path:?} K = {k} rows {rows:?}: row {r} is {} for {want} (error {err:e} > {:e})",
                out[j],
                tolerance(k, abs)
            );
        }
    }

    #[test]
    fn every_path_matches_the_f64_reference() {
        // K of one block, two, SmolLM2's hidden and intermediate sizes, and past 2048; row counts
        // with every tail (n % 4 = 1, 2, 3, and 0 with a sub-range that leaves a tail).
        let mut rng = rand::rngs::StdRng::seed_from_u64(26);
        for k in [32, 64, 576, 1536, 2048 + 32] {
            for n in [1, 2, 3, 4, 7, 13, 22] {
                let w = weights(&mut rng, n, k);
                for mixed in [false, true] {
                    let x = Q8Activation::quantize(&activations(&mut rng, k, mixed));
                    for path in paths() {
                        for rows in [0..n, 1..n, n / 2..n, 0..n / 2 + 1, n..n] {
                            check(path, &w, k, &x, rows);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_tolerance_sees_one_weight_off_by_one() {
        // A weight one step off against an activation at its block's maximum (127) changes the
        // product by 127 d_w d_x: the tolerance at K = 576 must be below that, or the tests above
        // could miss a wrong weight.
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let k = 576;
        // Ordinary scales (row kind 4), the activation's blocks all of one magnitude.
        let mut w = weights(&mut rng, 5, k).split_off(4 * k / QK * BLOCK_BYTES);
        let x = Q8Activation::quantize(&activations(&mut rng, k, false));
        let i = x.q[..QK].iter().position(|q| q.abs() == 127).expect("a block's maximum quantizes to +-127");
        let (want, abs) = reference(&w, k, &x, 0);
        let v = w[2 + i] as i8;
        w[2 + i] = if v == 127 { 126 } else { (v + 1) as u8 };
        let (off, _) = reference(&w, k, &x, 0);
        assert!((off - want).abs() > tolerance(k, abs), "one step is {:e}, the tolerance {:e}", (off - want).abs(), tolerance(k, abs));
    }

    #[test]
    fn every_path_is_exact_at_the_saturation_corners() {
        // The largest pair sums the AVX2 path forms: w = -128 (|w| = 128 as the unsigned operand)
        // and +127 against activations of +-127, in runs of equal signs. With unit scales the
        // products are integers below 2^24, exact in f32: any saturation or sign wrap shows.
        let k = 64;
        let minus_128 = |row: usize, b: usize, i: usize| match row {
            0 => true,
            1 => false,
            2 => (i / 8).is_multiple_of(2),
            3 => (i / 2).is_multiple_of(2),
            _ => (b + i).is_multiple_of(3),
        };
        let mut w = Vec::new();
        for row in 0..5 {
            for b in 0..k / QK {
                w.extend(half::f16::from_f32(1.0).to_bits().to_le_bytes());
                w.extend((0..QK).map(|i| if minus_128(row, b, i) { -128i8 } else { 127 } as u8));
            }
        }
        let xs: [Vec<f32>; 3] = [vec![-1.0; k], vec![1.0; k], (0..k).map(|i| if i % 4 < 2 { 1.0 } else { -1.0 }).collect()];
        for x in xs {
            let x = Q8Activation::quantize(&x);
            assert!(x.scales.iter().all(|&d| d == 1.0 / 127.0) && x.q.iter().all(|q| q.abs() == 127));
            let x = Q8Activation { scales: vec![1.0; k / QK], q: x.q };
            let want: Vec<f32> = (0..5).map(|r| reference(&w, k, &x, r).0 as f32).collect();
            assert!(want.iter().any(|v| v.abs() >= 32.0 * 128.0 * 127.0), "the corner must be reached: {want:?}");
            for path in paths() {
                let mut out = vec![0.0; 5];
                gemv_q8_0_on(path, &w, k, &x, 0..5, &mut out);
                assert_eq!(out, want, "{path:?}");
            }
        }
    }

    #[test]
    fn reads_candles_q8_0_storage() {
        // A Q8_0 QTensor's bytes, as candle stores them: the product is the dequantized weights'
        // (exact in f32: an i8 times an f16 scale) with the dequantized activation.
        use candle_core::quantized::{GgmlDType, QTensor};
        use candle_core::{Device, Tensor};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (n, k) = (9, 96);
        let wf: Vec<f32> = (0..n * k).map(|_| rng.random_range(-2.0..2.0)).collect();
        let qt = QTensor::quantize(&Tensor::from_vec(wf, (n, k), &Device::Cpu).unwrap(), GgmlDType::Q8_0).unwrap();
        let wd: Vec<f32> = qt.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let bytes = qt.data().unwrap();
        let x = Q8Activation::quantize(&activations(&mut rng, k, true));
        for path in paths() {
            let mut out = vec![0.0; n];
            gemv_q8_0_on(path, &bytes, k, &x, 0..n, &mut out);
            for r in 0..n {
                let want: f64 = (0..k).map(|i| wd[r * k + i] as f64 * x.q[i] as f64 * x.scales[i / QK] as f64).sum();
                let abs: f64 = (0..k).map(|i| (wd[r * k + i] as f64 * x.q[i] as f64 * x.scales[i / QK] as f64).abs()).sum();
                assert!((out[r] as f64 - want).abs() <= tolerance(k, abs), "{path:?} row {r}: {} for {want}", out[r]);
            }
        }
    }

    #[test]
    fn the_quantizer_is_ggmls() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let k = 2048 + 32;
        let x = activations(&mut rng, k, true);
        assert!(x.chunks_exact(QK).any(|b| b.iter().all(|&v| v == 0.0)), "the data must have an all-zero block");
        let a = Q8Activation::quantize(&x);
        assert_eq!((a.q.len(), a.scales.len()), (k, k / QK));
        for ((xb, qb), &d) in x.chunks_exact(QK).zip(a.q.chunks_exact(QK)).zip(&a.scales) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(d, amax / 127.0);
            if amax == 0.0 {
                assert!(qb.iter().all(|&q| q == 0), "an all-zero block quantizes to 0");
                continue;
            }
            // The maximum maps to +-127, and nothing beyond it.
            assert!(qb.iter().all(|q| (-127..=127).contains(q)) && qb.iter().any(|q| q.abs() == 127), "{qb:?}");
            for (&v, &q) in xb.iter().zip(qb) {
                // Round to nearest: within d/2, but for the f32 roundings of 1/d and x * (1/d)
                // (relative 2^-24 each, on a value up to 127): 128 ulps of d cover them.
                let err = (v as f64 - q as f64 * d as f64).abs();
                assert!(err <= d as f64 * (0.5 + 128.0 * f32::EPSILON as f64), "{v} -> {q} * {d}: error {err}");
            }
        }
    }

    #[test]
    fn quantize_into_reuses_its_buffers() {
        // A token's activation into the buffers of the last: the same allocations.
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let mut a = Q8Activation::quantize(&activations(&mut rng, 576, true));
        let (q, s) = (a.q.as_ptr(), a.scales.as_ptr());
        let x = activations(&mut rng, 576, true);
        a.quantize_into(&x);
        assert_eq!((a.q.as_ptr(), a.scales.as_ptr()), (q, s), "quantize_into reallocated");
        assert_eq!(a, Q8Activation::quantize(&x));
        // A shorter K shrinks the lengths (not the buffers).
        a.quantize_into(&x[..64]);
        assert_eq!(a, Q8Activation::quantize(&x[..64]));
    }

    #[test]
    fn the_default_path_is_the_fastest_here() {
        let want = if GemvPath::Avx2.runs_here() { GemvPath::Avx2 } else { GemvPath::Portable };
        assert_eq!(GemvPath::detect(), want);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            assert!(std::arch::is_x86_feature_detected!("f16c"), "an AVX2 CPU without F16C: the AVX2 path assumed none exists");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16c_converts_every_f16_as_half_does() {
        if !std::arch::is_x86_feature_detected!("f16c") {
            return;
        }
        for bits in 0..=u16::MAX {
            // SAFETY: the CPU has F16C (checked above).
            let got = unsafe { x86::f16_bits_to_f32(bits) };
            let want = half::f16::from_bits(bits).to_f32();
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{bits:#06x}: {got} for {want}");
        }
    }

    #[test]
    fn an_empty_k_or_row_range_gives_zeros_or_nothing() {
        let x = Q8Activation::quantize(&[]);
        for path in paths() {
            let mut out = vec![f32::NAN; 3];
            gemv_q8_0_on(path, &[], 0, &x, 0..3, &mut out);
            assert_eq!(out, [0.0; 3], "{path:?}");
            gemv_q8_0_on(
                path,
                &weights(&mut rand::rngs::StdRng::seed_from_u64(1), 2, 64),
                64,
                &Q8Activation::quantize(&[1.0; 64]),
                2..2,
                &mut [],
            );
        }
    }

    #[test]
    #[should_panic(expected = "not a multiple of 32")]
    fn a_k_off_the_blocks_panics() {
        gemv_q8_0(&[0; 34], 48, &Q8Activation::default(), 0..1, &mut [0.0]);
    }

    #[test]
    #[should_panic(expected = "up to row 3")]
    fn rows_past_the_weight_panic() {
        let w = weights(&mut rand::rngs::StdRng::seed_from_u64(1), 2, 64);
        gemv_q8_0(&w, 64, &Q8Activation::quantize(&[1.0; 64]), 1..3, &mut [0.0; 2]);
    }

    #[test]
    #[should_panic(expected = "out has 1 values for rows 0..2")]
    fn a_short_out_panics() {
        let w = weights(&mut rand::rngs::StdRng::seed_from_u64(1), 2, 64);
        gemv_q8_0(&w, 64, &Q8Activation::quantize(&[1.0; 64]), 0..2, &mut [0.0; 1]);
    }

    #[test]
    #[should_panic(expected = "has a -128")]
    fn an_activation_of_minus_128_panics() {
        let w = weights(&mut rand::rngs::StdRng::seed_from_u64(1), 1, 32);
        let mut x = Q8Activation::quantize(&[1.0; 32]);
        x.q[5] = i8::MIN;
        gemv_q8_0(&w, 32, &x, 0..1, &mut [0.0]);
    }
}
