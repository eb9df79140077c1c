//! Row kernels of the CPU stages (softmax), written once in plain Rust and compiled twice: for the
//! build's baseline and, chosen at run time, for AVX2 + FMA. The crate is built for the x86-64
//! baseline (SSE2, 4 lanes), and the CPU stages run on every machine, so the wide version is
//! picked per call (`is_x86_feature_detected` caches its answer) rather than by a build flag.
//!
//! The loops keep 8 independent lanes (`LANES`) so that LLVM vectorizes the reductions (float
//! max and sum do not reassociate otherwise), and `exp` is a polynomial the vectorizer can inline:
//! libm's `expf` is a call per element, and a softmax over a 1024-token prompt's scores takes 4.7
//! million of them per layer (SmolLM2).

const LANES: usize = 8;

/// `row = softmax(scale * row)`, in place.
pub fn softmax_scaled(row: &mut [f32], scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features the function is compiled for.
        return unsafe { softmax_avx2(row, scale) };
    }
    softmax(row, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_avx2(row: &mut [f32], scale: f32) {
    softmax(row, scale)
}

#[inline(always)]
fn softmax(row: &mut [f32], scale: f32) {
    if row.is_empty() {
        return;
    }
    let max = lanes_fold(row, f32::NEG_INFINITY, |a, b| if b > a { b } else { a });
    let max = max.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let shift = scale * max;
    // scale > 0: the scaled row's max is scale * max, and every exponent is <= 0.
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
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|v| *v *= inv);
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

/// `e^x` for `x <= 0` (within 2 ulp of libm; flushes below `e^-87`, the smallest normal, to that):
/// `e^x = 2^n * e^r` with `n = round(x / ln 2)`, `|r| <= ln 2 / 2`, and `e^r` by Cephes' degree-6
/// polynomial.
#[inline(always)]
fn exp(x: f32) -> f32 {
    let x = x.max(-87.0);
    // Round to nearest by the 1.5 * 2^23 trick (SSE2 has no vector round).
    const MAGIC: f32 = 12_582_912.0;
    let n = (x * std::f32::consts::LOG2_E + MAGIC) - MAGIC;
    // ln 2 in two parts, so that n * C1 is exact.
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    e * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_2_ulp_of_libm() {
        let mut worst = 0f32;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let (got, want) = (exp(x), x.exp());
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 2.5e-7, "worst relative error {worst}");
    }

    #[test]
    fn softmax_matches_the_definition_on_every_path() {
        // Lengths around the lane width, one element, and a long row with a large spread.
        for len in [1usize, 7, 8, 9, 31, 1000] {
            let row: Vec<f32> = (0..len).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.7).collect();
            let scale = 0.125;
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f64 = row.iter().map(|&v| ((scale * (v - max)) as f64).exp()).sum();
            let want: Vec<f64> = row.iter().map(|&v| ((scale * (v - max)) as f64).exp() / z).collect();
            let mut paths: Vec<Vec<f32>> = vec![row.clone(), row.clone()];
            softmax(&mut paths[0], scale);
            softmax_scaled(&mut paths[1], scale);
            for got in paths {
                for (g, w) in got.iter().zip(&want) {
                    assert!((*g as f64 - w).abs() <= 1e-6 * w.max(1e-3), "len {len}: {g} vs {w}");
                }
            }
        }
    }
}
