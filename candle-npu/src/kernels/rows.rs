//! Row kernels of the CPU stages (softmax, the activation quantizer, gated activations, the
//! outlier scan, dequantization) and of weight quantization at load, written once in plain Rust
//! and compiled twice: for the build's baseline and, chosen at run time, for AVX2 + FMA (the
//! outlier scan, the softmax, the gated activations and the shadow path have AVX2 intrinsics of
//! their own, with an 8-lane `exp8` in FMAs). The crate is built for the x86-64 baseline (SSE2,
//! 4 lanes), and the CPU stages run on every machine, so the wide version is picked per call
//! ([`super::cpu::cpu`], detected once) rather than by a build flag.
//!
//! The loops keep 8 independent lanes (`LANES`) so that LLVM vectorizes the reductions (float
//! max and sum do not reassociate otherwise), and `exp` is a polynomial the vectorizer can inline:
//! libm's `expf` is a call per element, and a softmax over a 1024-token prompt's scores takes 4.7
//! million of them per layer (SmolLM2).
//!
//! On aarch64 (a phone's CPU runs every row kernel), NEON is in the baseline: the plain code is
//! compiled once, already with 128-bit vectors, and `multiversion!` adds no copy. The functions
//! with AVX2 intrinsics have NEON ones (`mod neon`: `exp_shifted`, `silu_mul`, `gelu_tanh_mul`,
//! `shadow_row`, `outliers`, on a 4-lane `exp4`), always taken there. What LLVM makes of the
//! generic functions on aarch64 (read in `--emit asm`, rustc 1.96), so no NEON of ours:
//! - `quantize` (u8): 8 values a step in `fmul`, `frinta` (round half away from zero, `round`'s
//!   rule), `fsub`, `fmaxnm`/`fminnm`, `fcvtzs`, `xtn` + `uzp1` to bytes: 23 instructions.
//! - `quantize_row_i8`: `fdiv` (its bits need the division), `frinta`, the clamp as `fcmgt` +
//!   `bsl`, NaN to 0 by `fcmeq` + `and`, `fcvtzs`, narrowed: 30 instructions per 8.
//! - `row_scale_i8`: `fabs` + `fmaxnm` in two vectors (and an `fminnm v, v, v` per vector, LLVM's
//!   NaN quieting for `max`).
//! - `dequantize_row`: `scvtf` + `fmul`, 12 instructions per 8.
//! - `add_rms_norm_rows`: `x += d` and the sums of squares were one loop, which LLVM left
//!   scalar (`fadd s`, `fmul s` one value at a time); as two passes (same operations, same
//!   order) they are `fadd .4s` and `fmul` + `fadd .4s` into two vector sums, and the scaling
//!   `fdiv` + `fmul .4s` (candle's `x / m * w`: the division is kept for its bits). No `fmla`:
//!   LLVM contracts nothing without fast-math, on aarch64 as on x86.
//!
//! f16 <-> f32: the crate converts one value at a time (Q8_0's block scales in `gemv`, the HTP
//! numerics model's rounding, scales at load), never a bulk row. `half` 2.7 converts with
//! `fcvt` (one value) and `fcvtl`/`fcvtn` (its slice methods, 4 at a time) on aarch64, but only
//! when FEAT_FP16 is detected at run time (Armv8.2 cores: Cortex-A55/A75 and later), in
//! software otherwise, although the conversions themselves are in the aarch64 baseline. No
//! NEON path of ours is needed.

use std::mem::MaybeUninit;

use rayon::prelude::*;

const LANES: usize = 8;

/// `f` on the values of a CPU f32 tensor, borrowed (no copy when it is contiguous, which the
/// stage outputs are; `to_vec1` would copy each of them once more).
pub fn with_f32<R>(t: &candle_core::Tensor, f: impl FnOnce(&[f32]) -> R) -> crate::Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return Err(crate::Error::Input(format!("expected a CPU tensor, got one on {:?}", t.device())));
    };
    let values = cpu.as_slice::<f32>()?;
    let (from, to) = layout.contiguous_offsets().expect("contiguous() above");
    Ok(f(&values[from..to]))
}

/// Whether this CPU runs the AVX2 + FMA versions ([`super::cpu::cpu`]).
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2_fma() -> bool {
    super::cpu::cpu().avx2_fma()
}

/// `pub fn $name(..) -> R`, running `$generic` (an `#[inline(always)]` fn) compiled for AVX2 + FMA
/// where the CPU has them, else as built (on aarch64, as built only: NEON is the baseline).
/// LLVM contracts no mul + add into an FMA by itself, so both copies give the same bits.
macro_rules! multiversion {
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $generic:ident;) => {
        $(#[$doc])*
        $vis fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn wide($($arg: $ty),*) -> $ret {
                    $generic($($arg),*)
                }
                if avx2_fma() {
                    // SAFETY: the CPU has the features `wide` is compiled for.
                    return unsafe { wide($($arg),*) };
                }
            }
            $generic($($arg),*)
        }
    };
}

/// The numerators of `softmax(scale * row)`, in place, and their sum (`scale > 0`): the
/// softmax is `row / sum`. Attention multiplies the row by V next, and divides the product
/// (head_dim values) instead of the row (one value per key): one pass fewer.
///
/// AVX2 + FMA has intrinsics of its own (`softmax_avx2`); elsewhere the plain loop, as built.
/// The two differ by the FMAs' rounding (a few ulps).
pub fn softmax_numerators(row: &mut [f32], scale: f32) -> f32 {
    exp_shifted(row, scale, scale * row_max(row))
}

/// The largest value of `row` (`-inf` when it is empty).
pub fn row_max(row: &[f32]) -> f32 {
    lanes_fold(row, f32::NEG_INFINITY, |a, b| if b > a { b } else { a }).iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `e^(scale * v - shift)` in place of every `v`, and their sum, for `shift >= scale * max(row)`
/// (every exponent <= 0): softmax numerators against a maximum the caller chose, as attention's
/// running softmax needs (a block of keys is shifted by the largest score seen so far).
///
/// AVX2 + FMA (`exp_shifted_avx2`) and aarch64 (`neon::exp_shifted`) have intrinsics of their
/// own; elsewhere the plain loop, as built. They differ from it by the FMAs' rounding (a few
/// ulps).
pub fn exp_shifted(row: &mut [f32], scale: f32, shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { exp_shifted_avx2(row, scale, shift) };
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: NEON is in the aarch64 baseline.
    unsafe {
        neon::exp_shifted(row, scale, shift)
    }
    #[cfg(not(target_arch = "aarch64"))]
    exp_shifted_plain(row, scale, shift)
}

/// [`exp_shifted_plain`] with [`exp`]'s steps as FMAs, two vectors at a time. `exp` is a chain of about
/// 20 dependent operations: the vectorized plain loop, one vector per step, was bound by that
/// chain's latency (3.5 cycles a value, a fifth of a 1024-token prefill's attention); fused
/// steps shorten it, and the second vector fills the pipes while the first waits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_avx2(row: &mut [f32], scale: f32, shift: f32) -> f32 {
    use std::arch::x86_64::*;
    if row.is_empty() {
        return 0.0;
    }
    let (vscale, vshift) = (_mm256_set1_ps(scale), _mm256_set1_ps(shift));
    // e^(v * scale - shift), the exponent <= 0.
    let numerator = |v: __m256| exp8(_mm256_fmsub_ps(v, vscale, vshift));
    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut pairs = row.chunks_exact_mut(16);
    for c in &mut pairs {
        // SAFETY: `c` is 16 values.
        unsafe {
            let (e0, e1) = (numerator(_mm256_loadu_ps(c.as_ptr())), numerator(_mm256_loadu_ps(c.as_ptr().add(8))));
            _mm256_storeu_ps(c.as_mut_ptr(), e0);
            _mm256_storeu_ps(c.as_mut_ptr().add(8), e1);
            s0 = _mm256_add_ps(s0, e0);
            s1 = _mm256_add_ps(s1, e1);
        }
    }
    // The tail (< 16 values) through a zero-padded block; its padding lanes are not summed.
    let tail = pairs.into_remainder();
    let mut sum = 0.0;
    if !tail.is_empty() {
        let mut block = [0f32; 16];
        block[..tail.len()].copy_from_slice(tail);
        // SAFETY: `block` is 16 values.
        unsafe {
            _mm256_storeu_ps(block.as_mut_ptr(), numerator(_mm256_loadu_ps(block.as_ptr())));
            _mm256_storeu_ps(block.as_mut_ptr().add(8), numerator(_mm256_loadu_ps(block.as_ptr().add(8))));
        }
        tail.copy_from_slice(&block[..tail.len()]);
        sum = tail.iter().sum();
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` is 8 values.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(s0, s1)) };
    sum + lanes.iter().sum::<f32>()
}

/// [`exp`] of 8 lanes with its steps as FMAs, for `x <= 88` (the caller clamps where it can be
/// more: softmax's exponents are <= 0). Clamped below at -87 as `exp` is; `max_ps` returns its
/// second operand when one is NaN, so NaN goes through.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn exp8(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_max_ps(_mm256_set1_ps(-87.0), x);
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
    let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
    _mm256_mul_ps(e, _mm256_castsi256_ps(two_n))
}

/// `out[i] = f(a[i], b[i])` for every i of `out`, 16 values a step through the 8-lane `f8` (two
/// independent chains in flight: `exp8` is latency-bound alone), the tail through `f`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn map2_avx2(
    a: &[f32],
    b: &[f32],
    out: &mut [MaybeUninit<f32>],
    f8: impl Fn(std::arch::x86_64::__m256, std::arch::x86_64::__m256) -> std::arch::x86_64::__m256,
    f: impl Fn(f32, f32) -> f32,
) -> usize {
    use std::arch::x86_64::*;
    let n = out.len();
    assert!(a.len() >= n && b.len() >= n, "map2 of {n} values over {} and {}", a.len(), b.len());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: 16 values at i < n <= a.len(), b.len(), out.len(); MaybeUninit<f32> is an f32.
        unsafe {
            let (pa, pb, po) = (a.as_ptr().add(i), b.as_ptr().add(i), out.as_mut_ptr().add(i).cast::<f32>());
            let y0 = f8(_mm256_loadu_ps(pa), _mm256_loadu_ps(pb));
            let y1 = f8(_mm256_loadu_ps(pa.add(8)), _mm256_loadu_ps(pb.add(8)));
            _mm256_storeu_ps(po, y0);
            _mm256_storeu_ps(po.add(8), y1);
        }
        i += 16;
    }
    for j in i..n {
        out[j].write(f(a[j], b[j]));
    }
    n
}

/// `clamp(round(v * inv_scale) - offset, 0, 255)` per value (the activation quantizer), over the
/// rayon pool.
pub fn quantize_u8(values: &[f32], inv_scale: f32, offset: f32) -> Vec<u8> {
    par_collect(values.len(), block_len(values.len()), |at, out| quantize_into(&values[at..at + out.len()], inv_scale, offset, out))
}

multiversion! {
    /// [`quantize_u8`] of one block. `round` has no SSE2 instruction: on the baseline build it is
    /// a libm call per value.
    fn quantize_into(values: &[f32], inv_scale: f32, offset: f32, out: &mut [MaybeUninit<u8>]) -> usize = quantize;
}

/// Symmetric INT8 quantization of each row of `w` (`k` values each; the per-tensor form is one
/// row): `round(v / s)` in [-127, 127] with `s = max|v| / 127` (1 for a row of zeros), rows
/// over the rayon pool. Returns
/// the values and the row scales. Model loading quantizes every weight this way; on the baseline
/// build `round` is a libm call per value (a third of SmolLM2's load time, one core).
pub fn quantize_rows_i8(w: &[f32], k: usize) -> (Vec<i8>, Vec<f32>) {
    let k = k.max(1);
    let scales: Vec<f32> = w.par_chunks(k).map(row_scale_i8).collect();
    let q = par_collect(w.len() / k * k, rows_per_task(w.len() / k, k) * k, |at, out| {
        out.chunks_mut(k).zip(&scales[at / k..]).zip(w[at..].chunks(k)).map(|((out, &s), row)| quantize_row_i8(row, s, out)).sum()
    });
    (q, scales)
}

multiversion! {
    /// `max|v| / 127` of a row (1 when it is all zeros): [`quantize_rows_i8`]'s scale.
    fn row_scale_i8(row: &[f32]) -> f32 = row_scale_i8_generic;
}

#[inline(always)]
fn row_scale_i8_generic(row: &[f32]) -> f32 {
    // `max` skips NaN on every lane, as the one-value fold it replaces did.
    let max_abs = lanes_fold(row, 0.0, |m, v| m.max(v.abs())).iter().fold(0f32, |m, &v| m.max(v));
    if max_abs > 0.0 {
        max_abs / 127.0
    } else {
        1.0
    }
}

multiversion! {
    /// One row of [`quantize_rows_i8`].
    fn quantize_row_i8(row: &[f32], scale: f32, out: &mut [MaybeUninit<i8>]) -> usize = quantize_row_i8_generic;
}

#[inline(always)]
fn quantize_row_i8_generic(row: &[f32], scale: f32, out: &mut [MaybeUninit<i8>]) -> usize {
    map2(row, row, out, |v, _| quantize_i8(v, scale))
}

/// `x.round()` (half away from zero) clamped to `[lo, hi]`, NaN to 0, in integer steps that
/// vectorize on every x86_64 build: there `round` has no instruction (SSE4.1's and AVX's round
/// to even or toward an axis) and was a libm call per value, 7-8% of a host prefill's samples in
/// the activation and column quantizers (SmolLM2, 1256 tokens, 2026-11-29); `trunc` is a libm
/// call too on the baseline build. Clamped first into i32's range, `x as i32` truncates, and
/// `x - trunc(x)` is exact. `lo - 1` and `hi + 1` must be exact in f32 (|lo|, |hi| < 2^24).
#[inline(always)]
pub fn round_clamp(x: f32, lo: i32, hi: i32) -> i32 {
    let x = if x.is_nan() { 0.0 } else { x.max(lo as f32 - 1.0).min(hi as f32 + 1.0) };
    // SAFETY: x is finite and within [lo - 1, hi + 1], inside i32's range.
    let t = unsafe { x.to_int_unchecked::<i32>() };
    let d = x - t as f32;
    (t + (d >= 0.5) as i32 - (d <= -0.5) as i32).clamp(lo, hi)
}

/// One value of [`quantize_rows_i8`]: `round(v / scale)` in [-127, 127], NaN to 0. Whoever
/// needs a single weight's INT8 value (a column of it) uses this, so that it is the row
/// kernel's to the bit.
#[inline(always)]
pub fn quantize_i8(v: f32, scale: f32) -> i8 {
    round_clamp(v / scale, -127, 127) as i8
}

/// The residual add and the next RMSNorm in one pass over each row: `x += d`, then
/// `x / sqrt(mean(x^2) + eps) * w` (candle's `rms_norm`, in its order of operations) for each
/// row of `w.len()` values, blocks of rows over the rayon pool. Returns the normalized rows.
pub fn add_rms_norm(x: &mut [f32], d: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let n = w.len();
    assert!(n > 0 && x.len() == d.len() && x.len().is_multiple_of(n), "add_rms_norm: {} + {} values in rows of {n}", x.len(), d.len());
    let block = rows_per_task(x.len() / n, n) * n;
    let len = x.len();
    let mut out = Vec::with_capacity(len);
    out.spare_capacity_mut()[..len]
        .par_chunks_mut(block)
        .zip(x.par_chunks_mut(block).zip(d.par_chunks(block)))
        .for_each(|(out, (x, d))| add_rms_norm_rows(x, d, w, eps, out));
    // SAFETY: the blocks cover all `len` values, and `add_rms_norm_rows` writes all of its block
    // (its rows are whole: `block` and `len` are multiples of `n`); a panic propagates before this.
    unsafe { out.set_len(len) };
    out
}

multiversion! {
    /// [`add_rms_norm`] of whole rows into `out` (as long as `x`).
    fn add_rms_norm_rows(x: &mut [f32], d: &[f32], w: &[f32], eps: f32, out: &mut [MaybeUninit<f32>]) -> () = add_rms_norm_generic;
}

#[inline(always)]
fn add_rms_norm_generic(x: &mut [f32], d: &[f32], w: &[f32], eps: f32, out: &mut [MaybeUninit<f32>]) {
    let n = w.len();
    assert!(out.len() == x.len() && x.len().is_multiple_of(n), "add_rms_norm: rows of {n} into {} of {} values", out.len(), x.len());
    for (row, (x, d)) in out.chunks_exact_mut(n).zip(x.chunks_exact_mut(n).zip(d.chunks_exact(n))) {
        // Two passes over the row (in L1): as one, `x += d` and the sums of squares were left
        // scalar by LLVM on aarch64 (`fadd s`, `fmul s`); apart, each is vectorized.
        x.iter_mut().zip(d).for_each(|(x, &d)| *x += d);
        let mut sums = [0f32; LANES];
        let mut xc = x.chunks_exact(LANES);
        for x in &mut xc {
            for (&x, s) in x.iter().zip(&mut sums) {
                *s += x * x;
            }
        }
        let mut sum: f32 = sums.iter().sum();
        for &x in xc.remainder() {
            sum += x * x;
        }
        let m = (sum / n as f32 + eps).sqrt();
        for ((o, &x), &w) in row.iter_mut().zip(x.iter()).zip(w) {
            o.write(x / m * w);
        }
    }
}

/// `y += s * sum_j(a_j * q_j)` per value: the shadow path of one output row, its outliers `a_j`
/// times their channels' INT8 weight columns `q_j` (`terms`), scaled once by the row scales `s`.
/// The terms are summed in blocks of 64 outputs held in registers, so `y` and `s` are read once
/// per row rather than once per outlier (an axpy per outlier moved 9 bytes per multiply-add).
/// AVX2 + FMA (whole blocks of 64) and aarch64 (`neon::shadow_row`, every output) have
/// intrinsics of their own; the paths differ by the FMAs' rounding.
pub fn shadow_row(y: &mut [f32], terms: &[(f32, &[i8])], s: &[f32]) {
    let n = y.len();
    assert!(s.len() == n && terms.iter().all(|(_, q)| q.len() == n), "shadow row of {n} outputs, {} scales, columns of another length", s.len());
    // The outputs a vector kernel did; the plain loop does the rest.
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has AVX2 and FMA; the lengths are checked above.
    let done = if avx2_fma() { unsafe { shadow_row_avx2(y, terms, s) } } else { 0 };
    #[cfg(target_arch = "aarch64")]
    // SAFETY: NEON is in the aarch64 baseline.
    let done = unsafe { neon::shadow_row(y, terms, s) };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let done = 0;
    for i in done..n {
        let acc: f32 = terms.iter().map(|&(a, q)| a * q[i] as f32).sum();
        y[i] += acc * s[i];
    }
}

/// [`shadow_row`] over the whole blocks of 64 outputs; returns how many outputs it did.
/// SAFETY (caller): `s` and every column are at least `y.len()` long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn shadow_row_avx2(y: &mut [f32], terms: &[(f32, &[i8])], s: &[f32]) -> usize {
    use std::arch::x86_64::*;
    let blocks = y.len() / 64;
    for b in 0..blocks {
        let mut acc = [_mm256_setzero_ps(); 8];
        for &(a, q) in terms {
            let a = _mm256_set1_ps(a);
            for (v, acc) in acc.iter_mut().enumerate() {
                // SAFETY: 8 bytes at b * 64 + 8v < y.len() <= q.len().
                let q = unsafe { _mm_loadl_epi64(q.as_ptr().add(b * 64 + 8 * v) as *const __m128i) };
                *acc = _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), *acc);
            }
        }
        for (v, acc) in acc.into_iter().enumerate() {
            let at = b * 64 + 8 * v;
            // SAFETY: 8 values at `at` < y.len() <= s.len().
            unsafe {
                let yv = y.as_mut_ptr().add(at);
                _mm256_storeu_ps(yv, _mm256_fmadd_ps(acc, _mm256_loadu_ps(s.as_ptr().add(at)), _mm256_loadu_ps(yv)));
            }
        }
    }
    blocks * 64
}

/// Appends the values of `row` outside `[lo, hi]` (NaN included): their indexes to `at` and
/// their remainders `v - clamp(v, lo, hi)` to `rest`. Outliers are rare but not so rare that
/// a 16-value block is usually free of them: AVX2 tests 8 values per compare and visits only the
/// lanes outside (`movemask`), where a scalar test per value was 3% of a prefill's time; aarch64
/// tests 16 values per step (`neon::outliers`).
pub fn outliers_into(row: &[f32], lo: f32, hi: f32, at: &mut Vec<u32>, rest: &mut Vec<f32>) {
    #[cfg(target_arch = "x86_64")]
    if super::cpu::cpu().avx2 {
        // SAFETY: the CPU has AVX2.
        return unsafe { outliers_avx2(row, lo, hi, at, rest) };
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: NEON is in the aarch64 baseline.
    unsafe {
        neon::outliers(row, lo, hi, at, rest)
    }
    #[cfg(not(target_arch = "aarch64"))]
    outliers_scalar(row, 0, lo, hi, at, rest)
}

fn outliers_scalar(row: &[f32], base: usize, lo: f32, hi: f32, at: &mut Vec<u32>, rest: &mut Vec<f32>) {
    for (i, &v) in row.iter().enumerate() {
        if !(v >= lo && v <= hi) {
            at.push((base + i) as u32);
            rest.push(v - v.clamp(lo, hi));
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn outliers_avx2(row: &[f32], lo: f32, hi: f32, at: &mut Vec<u32>, rest: &mut Vec<f32>) {
    use std::arch::x86_64::*;
    let (vlo, vhi) = (_mm256_set1_ps(lo), _mm256_set1_ps(hi));
    let blocks = row.chunks_exact(8);
    let tail = blocks.remainder();
    for (b, block) in blocks.enumerate() {
        // SAFETY: `block` is 8 values.
        let v = unsafe { _mm256_loadu_ps(block.as_ptr()) };
        // Ordered compares: NaN is inside neither bound, so it is an outlier.
        let inside = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(v, vlo), _mm256_cmp_ps::<_CMP_LE_OQ>(v, vhi));
        let mut outside = !_mm256_movemask_ps(inside) as u32 & 0xff;
        while outside != 0 {
            let i = outside.trailing_zeros() as usize;
            at.push((b * 8 + i) as u32);
            rest.push(block[i] - block[i].clamp(lo, hi));
            outside &= outside - 1;
        }
    }
    outliers_scalar(tail, row.len() - tail.len(), lo, hi, at, rest)
}

multiversion! {
    /// `acc * col` per value as f32, written over the accumulator as the f32's bits (the host
    /// FullyConnected's dequantization, in the GEMM output's own allocation).
    pub fn dequantize_row(acc: &mut [i32], col: &[f32]) -> () = dequantize_row_generic;
}

#[inline(always)]
fn dequantize_row_generic(acc: &mut [i32], col: &[f32]) {
    for (a, &c) in acc.iter_mut().zip(col) {
        *a = (*a as f32 * c).to_bits() as i32;
    }
}

/// `silu(gate) * up` (Llama's FFN), one pass, over the rayon pool.
pub fn silu_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    assert_eq!(gate.len(), up.len(), "silu_mul over slices of different lengths");
    par_collect(gate.len(), block_len(gate.len()), |at, out| silu_mul_into(&gate[at..], &up[at..], out))
}

/// `gelu_tanh(gate) * up` (Gemma's FFN, PyTorch's tanh approximation), one pass, over the rayon
/// pool.
pub fn gelu_tanh_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    assert_eq!(gate.len(), up.len(), "gelu_tanh_mul over slices of different lengths");
    par_collect(gate.len(), block_len(gate.len()), |at, out| gelu_tanh_mul_into(&gate[at..], &up[at..], out))
}

/// [`silu_mul`] of one block: AVX2 + FMA intrinsics (`exp8`) where the CPU has them, NEON
/// (`neon::silu_mul`) on aarch64, else the plain loop as built.
fn silu_mul_into(gate: &[f32], up: &[f32], out: &mut [MaybeUninit<f32>]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        #[target_feature(enable = "avx2,fma")]
        fn wide(gate: &[f32], up: &[f32], out: &mut [MaybeUninit<f32>]) -> usize {
            use std::arch::x86_64::*;
            let one = _mm256_set1_ps(1.0);
            let silu8 = |g, u| {
                let e = exp8(_mm256_min_ps(_mm256_set1_ps(88.0), _mm256_sub_ps(_mm256_setzero_ps(), g)));
                _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u)
            };
            map2_avx2(gate, up, out, silu8, silu)
        }
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { wide(gate, up, out) };
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: NEON is in the aarch64 baseline.
    unsafe {
        neon::silu_mul(gate, up, out)
    }
    #[cfg(not(target_arch = "aarch64"))]
    map2(gate, up, out, silu)
}

/// `silu(g) * u` of one value (the plain loop's, and the AVX2 loop's tail).
#[cfg_attr(target_arch = "aarch64", allow(dead_code, reason = "aarch64 runs `neon`'s; its tests compare with this"))]
#[inline(always)]
fn silu(g: f32, u: f32) -> f32 {
    g / (1.0 + exp(-g)) * u
}

/// 0.5 x (1 + tanh(y)) = x - x / (e^(2y) + 1), y = sqrt(2 / pi) (x + 0.044715 x^3).
const GELU_S: f32 = 0.797_884_6;

/// `gelu_tanh(x) * u` of one value.
#[cfg_attr(target_arch = "aarch64", allow(dead_code, reason = "aarch64 runs `neon`'s; its tests compare with this"))]
#[inline(always)]
fn gelu(x: f32, u: f32) -> f32 {
    (x - x / (exp(2.0 * GELU_S * (x + 0.044_715 * x * x * x)) + 1.0)) * u
}

/// [`gelu_tanh_mul`] of one block, as [`silu_mul_into`].
fn gelu_tanh_mul_into(gate: &[f32], up: &[f32], out: &mut [MaybeUninit<f32>]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        #[target_feature(enable = "avx2,fma")]
        fn wide(gate: &[f32], up: &[f32], out: &mut [MaybeUninit<f32>]) -> usize {
            use std::arch::x86_64::*;
            let (one, c, s2) = (_mm256_set1_ps(1.0), _mm256_set1_ps(0.044_715), _mm256_set1_ps(2.0 * GELU_S));
            let gelu8 = |x, u| {
                let y = _mm256_mul_ps(s2, _mm256_fmadd_ps(_mm256_mul_ps(c, x), _mm256_mul_ps(x, x), x));
                _mm256_mul_ps(_mm256_sub_ps(x, _mm256_div_ps(x, _mm256_add_ps(exp8(_mm256_min_ps(_mm256_set1_ps(88.0), y)), one))), u)
            };
            map2_avx2(gate, up, out, gelu8, gelu)
        }
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { wide(gate, up, out) };
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: NEON is in the aarch64 baseline.
    unsafe {
        neon::gelu_tanh_mul(gate, up, out)
    }
    #[cfg(not(target_arch = "aarch64"))]
    map2(gate, up, out, gelu)
}

/// The CPU stages' row kernels split their rows over the rayon pool, which the GEMMs use too: an
/// in-order prefill would otherwise leave one core idle for every CPU stage. A task is at least
/// this many values (below that, the split costs more than it saves: a decode's one row runs
/// inline) and there are up to four tasks a thread (an even split would wait on the slowest).
const MIN_TASK_VALUES: usize = 16 * 1024;

/// Rows per task for `rows` rows of `len` values each (see `MIN_TASK_VALUES`).
pub fn rows_per_task(rows: usize, len: usize) -> usize {
    let min = MIN_TASK_VALUES.div_ceil(len.max(1));
    rows.div_ceil(4 * rayon::current_num_threads()).max(min).max(1)
}

/// Values per task for `len` values without rows.
fn block_len(len: usize) -> usize {
    rows_per_task(len, 1)
}

/// `len` values made by `fill(at, out)`, which writes the block of values `at..at + out.len()`
/// and returns how many it wrote, on blocks of `block` values over the rayon pool.
fn par_collect<T: Send>(len: usize, block: usize, fill: impl Fn(usize, &mut [MaybeUninit<T>]) -> usize + Sync) -> Vec<T> {
    let mut out = Vec::with_capacity(len);
    out.spare_capacity_mut()[..len].par_chunks_mut(block.max(1)).enumerate().for_each(|(i, out)| {
        let n = fill(i * block, out);
        assert_eq!(n, out.len(), "a row kernel wrote {n} of its block's {} values", out.len());
    });
    // SAFETY: every block was written whole (asserted above; a panic propagates before this).
    unsafe { out.set_len(len) };
    out
}

/// `out[i] = f(a[i], b[i])` for every i of `out` (`a` and `b` at least as long), as a plain loop:
/// `collect()` would put the loop in a separate (baseline-compiled) function outside the
/// multiversioned caller. Returns how many values it wrote.
#[inline(always)]
fn map2<A: Copy, B: Copy, T>(a: &[A], b: &[B], out: &mut [MaybeUninit<T>], f: impl Fn(A, B) -> T) -> usize {
    let mut n = 0;
    for (o, (&x, &y)) in out.iter_mut().zip(a.iter().zip(b)) {
        o.write(f(x, y));
        n += 1;
    }
    n
}

#[inline(always)]
fn quantize(values: &[f32], inv_scale: f32, offset: f32, out: &mut [MaybeUninit<u8>]) -> usize {
    // `round(v / s) - offset` in [0, 255] (the offset, an integer, moves the clamp's bounds);
    // NaN to 0, as the saturating `as u8` maps it.
    let off = offset as i32;
    map2(values, values, out, |v, _| {
        let y = v * inv_scale;
        let q = (round_clamp(y, off, 255 + off) - off) as u8;
        if y.is_nan() {
            0
        } else {
            q
        }
    })
}

#[cfg_attr(target_arch = "aarch64", allow(dead_code, reason = "aarch64 runs `neon`'s; its tests compare with this"))]
#[inline(always)]
fn exp_shifted_plain(row: &mut [f32], scale: f32, shift: f32) -> f32 {
    // shift >= scale * max: every exponent is <= 0.
    let mut sums = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (v, s) in c.iter_mut().zip(&mut sums) {
            *v = exp(*v * scale - shift);
            *s += *v;
        }
    }
    let mut sum: f32 = sums.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp(*v * scale - shift);
        sum += *v;
    }
    sum
}

/// `f` folded over the row in `LANES` independent lanes (the remainder into lane 0).
#[inline(always)]
fn lanes_fold(row: &[f32], init: f32, f: impl Fn(f32, f32) -> f32) -> [f32; LANES] {
    let mut acc = [init; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = f(*a, v);
        }
    }
    for &v in chunks.remainder() {
        acc[0] = f(acc[0], v);
    }
    acc
}

/// `exp`'s constants (Cephes' `expf`), shared by every path ([`exp`], `exp8`, `neon::exp4`, the
/// tests' fused twin): ln 2 in two parts, so that `n * EXP_LN2_HI` is exact, and the polynomial's
/// coefficients, highest order first.
const EXP_LN2_HI: f32 = 0.693_359_4;
const EXP_LN2_LO: f32 = -2.121_944_4e-4;
const EXP_POLY: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];

/// 1.5 * 2^23: `t + SHIFTER` for `|t| < 2^22` lies in `[2^23, 2^24)`, where the float spacing is
/// 1, so the addition rounds `t` to an integer, to nearest-even (SHIFTER is even), exactly as
/// `frintn` does; subtracting SHIFTER back is exact. The sum's low mantissa bits hold `n + 2^22`.
const SHIFTER: f32 = 12_582_912.0;

/// `e^x` within 2 ulp of libm on `[-87, 88]`, clamped to it (`e^-87` is near the smallest normal,
/// `e^88` near the largest float):
/// `e^x = 2^n * e^r` with `n = round(x / ln 2)`, `|r| <= ln 2 / 2`, and `e^r` by Cephes' degree-6
/// polynomial.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // Round to nearest by the shifter (SSE2 has no vector round).
    let n = (x * std::f32::consts::LOG2_E + SHIFTER) - SHIFTER;
    let r = x - n * EXP_LN2_HI - n * EXP_LN2_LO;
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    let e = p * r * r + r + 1.0;
    // 2^n from the bits of n + 127 + 2^23, whose low mantissa bits are the integer n + 127:
    // shifted into the exponent field (the rest shifts out). `n as i32` would saturate, which
    // the vectorizer lowers one lane at a time.
    e * f32::from_bits((n + 8_388_735.0).to_bits().wrapping_shl(23))
}

/// The aarch64 kernels of this module's hot rows. NEON is in the aarch64 baseline, so they run on
/// every aarch64 CPU with no run-time check; `#[target_feature(enable = "neon")]` only lets
/// their bodies call the intrinsics as safe functions (a caller outside says why that is sound).
/// Each is a function of its own, for reading its inner loop in the assembly.
///
/// Where [`super::exp`] multiplies then adds, [`exp4`] fuses the two (one `fmla`/`fmls` for
/// `fmul` + `fadd`, 8 of them, and a shorter dependent chain); the values are then within 2 ulp
/// of libm as `exp`'s are, not `exp`'s bits. `fmla` overwrites its addend, which in a Horner
/// step is the coefficient: each is loaded fresh (`coef`) rather than copied from a register
/// with a vector-pipe `mov` (`exp_shifted`'s loop: 115 instructions for 16 values, 80 of them
/// on the vector pipes, no `mov`). The tests hold each kernel to the bits
/// of a scalar twin that does the same fused steps with `f32::mul_add`, in the same order.
/// Tails go through a zero-padded block of vectors, so that every value of a row gets the same
/// arithmetic whatever its position (and whatever block split the rayon pool made).
#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;
    use std::mem::MaybeUninit;

    use super::{EXP_LN2_HI, EXP_LN2_LO, EXP_POLY, GELU_S, SHIFTER};
    use crate::kernels::arm::hsum4;

    /// Cephes' coefficients after the leading one, each broadcast to a vector, 16-byte aligned
    /// for `ldr q`.
    #[repr(C, align(16))]
    struct Lanes([f32; 4]);
    static POLY: [Lanes; 5] = [Lanes([EXP_POLY[1]; 4]), Lanes([EXP_POLY[2]; 4]), Lanes([EXP_POLY[3]; 4]), Lanes([EXP_POLY[4]; 4]), Lanes([EXP_POLY[5]; 4])];

    /// Horner coefficient `i` in a register of its own, loaded from `POLY` at each use. `fmla`
    /// overwrites its addend, which in a Horner step is the coefficient: a coefficient kept in a
    /// register is copied (`mov`, a vector-pipe instruction) before every step, while a load
    /// uses a load pipe, which these loops leave idle. The load is volatile so that LLVM keeps it
    /// in the loop instead of hoisting it back into a register and its copies.
    #[inline(always)]
    fn coef(i: usize) -> float32x4_t {
        // SAFETY: POLY[i] is four f32 (a float32x4_t), 16-byte aligned.
        unsafe { std::ptr::read_volatile(POLY[i].0.as_ptr().cast::<float32x4_t>()) }
    }

    /// `e * 2^n` for `z = n + SHIFTER` (`n` an integer in [-126, 127], as `exp4`'s clamp makes
    /// it): `n + 2^22 + 127` shifted left by 23 leaves `(n + 127) << 23`, 2^n's bits (the rest
    /// shifts out; a NaN `z` makes `e` NaN already).
    #[inline(always)]
    fn times_two_to(e: float32x4_t, z: float32x4_t) -> float32x4_t {
        // SAFETY: NEON is in the aarch64 baseline; registers only.
        unsafe {
            let two_n = vshlq_n_s32::<23>(vaddq_s32(vreinterpretq_s32_f32(z), vdupq_n_s32(127)));
            vmulq_f32(e, vreinterpretq_f32_s32(two_n))
        }
    }

    /// [`super::exp`] of 4 lanes with its multiply-adds fused, clamped to `[-87, 88]` as it is;
    /// NaN goes through (`fmax`/`fmin` return NaN when an operand is). Steps: `n` rounded to
    /// nearest-even by the 1.5 * 2^23 shifter (`exp`'s trick: `fmul`, `fadd`, `fsub`, all
    /// on either vector pipe, where `frintn` and `fcvtzs` are V0-only), `r = x - n ln2` in two
    /// fused parts, Cephes' polynomial by Horner in FMAs, `2^n` from the shifted sum's bits:
    /// `n + 2^22 + 127` shifted left by 23 leaves `(n + 127) << 23` (the rest shifts out).
    /// The multiplier constants are lanes of one register (`fmul`/`fmls`/`fmla` by element).
    #[target_feature(enable = "neon")]
    #[inline]
    pub fn exp4(x: float32x4_t) -> float32x4_t {
        let k = [std::f32::consts::LOG2_E, EXP_LN2_HI, EXP_LN2_LO, EXP_POLY[0]];
        // SAFETY: `k` is 4 values.
        let k = unsafe { vld1q_f32(k.as_ptr()) };
        let x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.0)), vdupq_n_f32(88.0));
        // |x log2 e| < 128: the shifter rounds it.
        let z = vaddq_f32(vmulq_laneq_f32::<0>(x, k), vdupq_n_f32(SHIFTER));
        let n = vsubq_f32(z, vdupq_n_f32(SHIFTER));
        let r = vfmsq_laneq_f32::<1>(x, n, k);
        let r = vfmsq_laneq_f32::<2>(r, n, k);
        // fma(p0, r, c1) = c1 + r p0, then fma(p, r, c) = c + p r.
        let mut p = vfmaq_laneq_f32::<3>(coef(0), r, k);
        for i in 1..5 {
            p = vfmaq_f32(coef(i), p, r);
        }
        let e = vaddq_f32(vfmaq_f32(r, p, vmulq_f32(r, r)), vdupq_n_f32(1.0));
        times_two_to(e, z)
    }

    /// `exp4(-g)`, the same bits, with the negation folded into the steps (one vector
    /// instruction fewer: `silu_mul`'s loop is bound by its vector pipes). With `y = clamp(g,
    /// -88, 87) = -clamp(-g, -87, 88)` and `fl(y log2 e) = -fl(-y log2 e)`, `n` is the shifter's
    /// rounding of `fl(y (-log2 e))`, as `exp4`'s; then every step of `exp4` on `r` is taken on
    /// `s = -r` instead, round-to-nearest-even being odd (`fl(-a) = -fl(a)`): `s = fma(n, ln2,
    /// y)` in two parts, `p = c - p s` (`fmls`), `e = 1 - (s - p s^2)`. They differ from `exp4`'s
    /// only in the sign of a zero, where `r = 0` exactly: `n = 0` then, `x = +-0`, and the
    /// zero is added to 1 before it reaches the result.
    #[target_feature(enable = "neon")]
    #[inline]
    pub fn exp4_neg(g: float32x4_t) -> float32x4_t {
        let k = [-std::f32::consts::LOG2_E, EXP_LN2_HI, EXP_LN2_LO, EXP_POLY[0]];
        // SAFETY: `k` is 4 values.
        let k = unsafe { vld1q_f32(k.as_ptr()) };
        let y = vmaxq_f32(vminq_f32(g, vdupq_n_f32(87.0)), vdupq_n_f32(-88.0));
        let z = vaddq_f32(vmulq_laneq_f32::<0>(y, k), vdupq_n_f32(SHIFTER));
        let n = vsubq_f32(z, vdupq_n_f32(SHIFTER));
        let s = vfmaq_laneq_f32::<1>(y, n, k);
        let s = vfmaq_laneq_f32::<2>(s, n, k);
        let mut p = vfmsq_laneq_f32::<3>(coef(0), s, k);
        for i in 1..5 {
            p = vfmsq_f32(coef(i), p, s);
        }
        let e = vsubq_f32(vdupq_n_f32(1.0), vfmsq_f32(s, p, vmulq_f32(s, s)));
        times_two_to(e, z)
    }

    /// [`super::exp_shifted`]: `e^(fma(v, scale, -shift))` by [`exp4`], 16 values a step (four
    /// independent chains: one `exp4` alone is bound by its latency), in four sums. Each
    /// numerator meets at most `len / 16 + 16` additions (its lane's, the four sums' and the
    /// lanes' two levels each, the tail's 15 and 1).
    #[target_feature(enable = "neon")]
    pub fn exp_shifted(row: &mut [f32], scale: f32, shift: f32) -> f32 {
        let vscale = vdupq_n_f32(scale);
        // `fmla` overwrites its addend, -shift: a fresh copy from memory each time (see `coef`).
        let nshift = Lanes([-shift; 4]);
        // SAFETY: `nshift` is 16 bytes, 16-byte aligned.
        let vnshift = || unsafe { std::ptr::read_volatile(nshift.0.as_ptr().cast::<float32x4_t>()) };
        let numerator = |v: float32x4_t| exp4(vfmaq_f32(vnshift(), v, vscale));
        let mut s = [vdupq_n_f32(0.0); 4];
        let mut blocks = row.chunks_exact_mut(16);
        for c in &mut blocks {
            let p = c.as_mut_ptr();
            for (i, s) in s.iter_mut().enumerate() {
                // SAFETY: `c` is 16 values.
                unsafe {
                    let e = numerator(vld1q_f32(p.add(4 * i)));
                    vst1q_f32(p.add(4 * i), e);
                    *s = vaddq_f32(*s, e);
                }
            }
        }
        // The tail (< 16 values) through a zero-padded block; its padding is not summed.
        let tail = blocks.into_remainder();
        let mut sum = 0.0;
        if !tail.is_empty() {
            let mut block = [0f32; 16];
            block[..tail.len()].copy_from_slice(tail);
            for i in 0..4 {
                // SAFETY: `block` is 16 values.
                unsafe { vst1q_f32(block.as_mut_ptr().add(4 * i), numerator(vld1q_f32(block.as_ptr().add(4 * i)))) };
            }
            tail.copy_from_slice(&block[..tail.len()]);
            sum = tail.iter().sum();
        }
        sum + hsum4(vaddq_f32(vaddq_f32(s[0], s[1]), vaddq_f32(s[2], s[3])))
    }

    /// `out[i] = f4(a[i], b[i])` for every i of `out`, 16 values a step (four independent
    /// chains), the tail through a zero-padded block.
    #[target_feature(enable = "neon")]
    #[inline]
    fn map2(a: &[f32], b: &[f32], out: &mut [MaybeUninit<f32>], f4: impl Fn(float32x4_t, float32x4_t) -> float32x4_t) -> usize {
        let n = out.len();
        assert!(a.len() >= n && b.len() >= n, "map2 of {n} values over {} and {}", a.len(), b.len());
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: 16 values at i < n <= a.len(), b.len(), out.len(); MaybeUninit<f32> is an f32.
            unsafe {
                let (pa, pb, po) = (a.as_ptr().add(i), b.as_ptr().add(i), out.as_mut_ptr().add(i).cast::<f32>());
                for k in 0..4 {
                    vst1q_f32(po.add(4 * k), f4(vld1q_f32(pa.add(4 * k)), vld1q_f32(pb.add(4 * k))));
                }
            }
            i += 16;
        }
        if i < n {
            let (mut ta, mut tb) = ([0f32; 16], [0f32; 16]);
            ta[..n - i].copy_from_slice(&a[i..n]);
            tb[..n - i].copy_from_slice(&b[i..n]);
            for k in 0..4 {
                // SAFETY: `ta` and `tb` are 16 values.
                unsafe { vst1q_f32(ta.as_mut_ptr().add(4 * k), f4(vld1q_f32(ta.as_ptr().add(4 * k)), vld1q_f32(tb.as_ptr().add(4 * k)))) };
            }
            for (o, &y) in out[i..].iter_mut().zip(&ta) {
                o.write(y);
            }
        }
        n
    }

    /// [`super::silu_mul`] of one block: `g / (1 + e^-g) * u`, `e^-g` by [`exp4_neg`] (as
    /// [`exp4`] of `-g`, clamping `-g` at 88).
    #[target_feature(enable = "neon")]
    pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [MaybeUninit<f32>]) -> usize {
        let one = vdupq_n_f32(1.0);
        map2(gate, up, out, |g, u| vmulq_f32(vdivq_f32(g, vaddq_f32(one, exp4_neg(g))), u))
    }

    /// [`super::gelu_tanh_mul`] of one block: `(x - x / (e^(2y) + 1)) * u`, with
    /// `2y = 2 sqrt(2 / pi) fma(0.044715 x, x * x, x)` (the AVX2 kernel's steps).
    #[target_feature(enable = "neon")]
    pub fn gelu_tanh_mul(gate: &[f32], up: &[f32], out: &mut [MaybeUninit<f32>]) -> usize {
        let (one, c, s2) = (vdupq_n_f32(1.0), vdupq_n_f32(0.044_715), vdupq_n_f32(2.0 * GELU_S));
        map2(gate, up, out, |x, u| {
            let y = vmulq_f32(s2, vfmaq_f32(x, vmulq_f32(c, x), vmulq_f32(x, x)));
            vmulq_f32(vsubq_f32(x, vdivq_f32(x, vaddq_f32(exp4(y), one))), u)
        })
    }

    /// [`super::shadow_row`] of every output: blocks of 64 outputs (16 accumulators), then of 16,
    /// then one at a time, each `acc = fma(a_j, q_j, acc)` over the terms in order and
    /// `y = fma(acc, s, y)` (the same steps for every output). Returns `y.len()`.
    #[target_feature(enable = "neon")]
    pub fn shadow_row(y: &mut [f32], terms: &[(f32, &[i8])], s: &[f32]) -> usize {
        let n = y.len();
        assert!(s.len() >= n && terms.iter().all(|(_, q)| q.len() >= n), "neon::shadow_row: {n} outputs, {} scales", s.len());
        let mut at = 0;
        while at + 64 <= n {
            // SAFETY: 64 outputs at `at`, within `y`, `s` and every column (asserted).
            unsafe { shadow_block::<16>(y, terms, s, at) };
            at += 64;
        }
        while at + 16 <= n {
            // SAFETY: as above, 16 outputs.
            unsafe { shadow_block::<4>(y, terms, s, at) };
            at += 16;
        }
        for i in at..n {
            let acc = terms.iter().fold(0f32, |acc, &(a, q)| a.mul_add(q[i] as f32, acc));
            y[i] = acc.mul_add(s[i], y[i]);
        }
        n
    }

    /// `V` vectors of [`shadow_row`]'s outputs from `at` (`V` a multiple of 4: whole 16-byte
    /// loads of the columns, widened i8 -> i16 -> i32 -> f32, all exact).
    ///
    /// # Safety
    /// `y`, `s` and every column hold `at + 4 V` values.
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn shadow_block<const V: usize>(y: &mut [f32], terms: &[(f32, &[i8])], s: &[f32], at: usize) {
        let mut acc = [vdupq_n_f32(0.0); V];
        for &(a, q) in terms {
            for g in 0..V / 4 {
                // SAFETY: 16 bytes at at + 16g < at + 4V (the caller's sizes).
                let b = unsafe { vld1q_s8(q.as_ptr().add(at + 16 * g)) };
                let (lo, hi) = (vmovl_s8(vget_low_s8(b)), vmovl_high_s8(b));
                let w = [vmovl_s16(vget_low_s16(lo)), vmovl_high_s16(lo), vmovl_s16(vget_low_s16(hi)), vmovl_high_s16(hi)];
                for (k, w) in w.into_iter().enumerate() {
                    acc[4 * g + k] = vfmaq_n_f32(acc[4 * g + k], vcvtq_f32_s32(w), a);
                }
            }
        }
        for (v, acc) in acc.into_iter().enumerate() {
            // SAFETY: 4 values at at + 4v < at + 4V (the caller's sizes).
            unsafe {
                let yv = y.as_mut_ptr().add(at + 4 * v);
                vst1q_f32(yv, vfmaq_f32(vld1q_f32(yv), acc, vld1q_f32(s.as_ptr().add(at + 4 * v))));
            }
        }
    }

    /// [`super::outliers_into`]: 16 values a step, their 16 in-range tests narrowed to bytes and
    /// then to 4 bits each (`shrn`, NEON's stand-in for `movemask`), so that a block without
    /// outliers costs one compare of a u64 and only the lanes outside are visited. Ordered
    /// compares: NaN is inside neither bound, so it is an outlier.
    #[target_feature(enable = "neon")]
    pub fn outliers(row: &[f32], lo: f32, hi: f32, at: &mut Vec<u32>, rest: &mut Vec<f32>) {
        let (vlo, vhi) = (vdupq_n_f32(lo), vdupq_n_f32(hi));
        let blocks = row.chunks_exact(16);
        let tail = blocks.remainder();
        for (b, block) in blocks.enumerate() {
            let inside = |i: usize| {
                // SAFETY: `block` is 16 values, i < 4.
                let v = unsafe { vld1q_f32(block.as_ptr().add(4 * i)) };
                vandq_u32(vcgeq_f32(v, vlo), vcleq_f32(v, vhi))
            };
            let (m01, m23) = (vcombine_u16(vmovn_u32(inside(0)), vmovn_u32(inside(1))), vcombine_u16(vmovn_u32(inside(2)), vmovn_u32(inside(3))));
            let bytes = vcombine_u8(vmovn_u16(m01), vmovn_u16(m23));
            // Nibble i of `nibbles` is byte i's (each byte is 0 or 0xff).
            let nibbles = vget_lane_u64::<0>(vreinterpret_u64_u8(vshrn_n_u16::<4>(vreinterpretq_u16_u8(bytes))));
            let mut outside = !nibbles;
            while outside != 0 {
                let i = outside.trailing_zeros() as usize / 4;
                at.push((b * 16 + i) as u32);
                rest.push(block[i] - block[i].clamp(lo, hi));
                outside &= !(0xf_u64 << (4 * i));
            }
        }
        super::outliers_scalar(tail, row.len() - tail.len(), lo, hi, at, rest)
    }
}

#[cfg(test)]
mod tests;
