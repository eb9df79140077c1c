use super::*;

#[test]
fn outliers_are_the_values_outside_the_range_on_every_path() {
    // Lanes inside, on the bounds, beyond them, NaN and infinities, across 8- and 16-lane
    // blocks and a tail.
    let specials = [0.0, -1.5, 2.0, -1.5001, 2.0001, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, -0.0];
    let row: Vec<f32> = (0..77).map(|i| if i % 3 == 0 { specials[i / 3 % specials.len()] } else { (i as f32 * 0.37).sin() * 2.2 }).collect();
    let (lo, hi) = (-1.5, 2.0);
    let want: Vec<(u32, f32)> = row.iter().enumerate().map(|(i, &v)| (i as u32, v - v.clamp(lo, hi))).filter(|&(_, r)| r != 0.0 || r.is_nan()).collect();
    assert!(want.len() > 10 && want.iter().any(|(_, r)| r.is_nan()), "the test must exercise outliers and NaN");
    type Scan = fn(&[f32], f32, f32, &mut Vec<u32>, &mut Vec<f32>);
    let paths: &[Option<(&str, Scan)>] = &[
        Some(("scalar", |r, lo, hi, a, v| outliers_scalar(r, 0, lo, hi, a, v))),
        #[cfg(target_arch = "x86_64")]
        std::arch::is_x86_feature_detected!("avx2").then_some(("avx2", |r, lo, hi, a, v| unsafe { outliers_avx2(r, lo, hi, a, v) })),
        #[cfg(target_arch = "aarch64")]
        Some(("neon", |r, lo, hi, a, v| unsafe { neon::outliers(r, lo, hi, a, v) })),
    ];
    for &(name, f) in paths.iter().flatten() {
        let (mut at, mut rest) = (vec![], vec![]);
        f(&row, lo, hi, &mut at, &mut rest);
        let got: Vec<(u32, f32)> = at.into_iter().zip(rest).collect();
        assert_eq!(got.len(), want.len(), "{name}");
        for (g, w) in got.iter().zip(&want) {
            assert!(g.0 == w.0 && (g.1 == w.1 || g.1.is_nan() && w.1.is_nan()), "{name}: {g:?} != {w:?}");
        }
    }
}

/// The largest relative error of `f` against libm's `exp` on a grid over exp's f32 range.
fn worst_against_libm(f: impl Fn(f32) -> f32) -> f32 {
    (-870_000..=880_000).map(|i| i as f32 * 1e-4).fold(0f32, |worst, x| worst.max((f(x) - x.exp()).abs() / x.exp()))
}

#[test]
fn exp_is_within_2_ulp_of_libm() {
    let worst = worst_against_libm(exp);
    assert!(worst < 2.5e-7, "worst relative error {worst}");
}

#[test]
fn quantize_rounds_ties_away_and_saturates_on_every_path() {
    let xs: Vec<f32> = (-600..600).map(|i| i as f32 * 0.25).chain([f32::NAN, f32::INFINITY, f32::NEG_INFINITY]).collect();
    let want: Vec<u8> = xs.iter().map(|&v| ((v * 2.0).round() + 128.0).clamp(0.0, 255.0) as u8).collect();
    let mut out = vec![MaybeUninit::new(0); xs.len()];
    assert_eq!(quantize(&xs, 2.0, -128.0, &mut out), xs.len());
    assert_eq!(out.iter().map(|v| unsafe { v.assume_init() }).collect::<Vec<u8>>(), want);
    assert_eq!(quantize_u8(&xs, 2.0, -128.0), want);
    // Ties: 0.5 -> 1, -0.5 -> -1 (+128).
    assert_eq!(quantize_u8(&[0.25, -0.25], 2.0, -128.0), vec![129, 127]);
}

#[test]
fn gated_activations_match_their_definitions() {
    let gate: Vec<f32> = (-4000..4000).map(|i| i as f32 * 0.01).chain([-100.0, 100.0]).collect();
    let up: Vec<f32> = gate.iter().map(|g| 1.5 - g * 0.1).collect();
    let plain = |f: fn(f32, f32) -> f32| {
        let mut out = vec![MaybeUninit::new(0.0); gate.len()];
        map2(&gate, &up, &mut out, f);
        out.into_iter().map(|v| unsafe { v.assume_init() }).collect::<Vec<f32>>()
    };
    // The dispatched kernels (AVX2 + FMA here) and the plain loops.
    for (silu, gelu) in [(silu_mul(&gate, &up), gelu_tanh_mul(&gate, &up)), (plain(silu), plain(gelu))] {
        for (i, (&g, &u)) in gate.iter().zip(&up).enumerate() {
            let (x, u) = (g as f64, u as f64);
            let want_silu = x / (1.0 + (-x).exp()) * u;
            let want_gelu = 0.5 * x * (1.0 + (0.797_884_560_8 * (x + 0.044715 * x * x * x)).tanh()) * u;
            for (got, want) in [(silu[i], want_silu), (gelu[i], want_gelu)] {
                // 2e-6 relative, plus one f32 ulp of x * u: for very negative x, GELU's
                // 1 + tanh(y) cancels to a few ulp of x (candle's f32 GELU does the same).
                let tol = 2e-6 * want.abs() + f32::EPSILON as f64 * (x * u).abs();
                assert!((got as f64 - want).abs() <= tol, "x = {x}: {got} vs {want}");
            }
        }
    }
}

#[test]
fn add_rms_norm_matches_its_definition() {
    let (rows, n) = (3, 21);
    let x0: Vec<f32> = (0..rows * n).map(|i| ((i * 37 % 29) as f32 - 14.0) * 0.3).collect();
    let d: Vec<f32> = (0..rows * n).map(|i| ((i * 11 % 7) as f32 - 3.0) * 0.5).collect();
    let w: Vec<f32> = (0..n).map(|i| 0.5 + i as f32 * 0.1).collect();
    let mut x = x0.clone();
    let h = add_rms_norm(&mut x, &d, &w, 1e-5);
    // The same f32 steps one value at a time (8 lanes of sums, the rest after): vectorized
    // as LLVM likes, the kernel gives their bits.
    for r in 0..rows {
        let xs: Vec<f32> = (0..n).map(|i| x0[r * n + i] + d[r * n + i]).collect();
        let mut sums = [0f32; LANES];
        (0..n / LANES * LANES).for_each(|i| sums[i % LANES] += xs[i] * xs[i]);
        let sum = (n / LANES * LANES..n).fold(sums.iter().sum::<f32>(), |s, i| s + xs[i] * xs[i]);
        let m = (sum / n as f32 + 1e-5).sqrt();
        for i in 0..n {
            assert_eq!(h[r * n + i].to_bits(), (xs[i] / m * w[i]).to_bits(), "row {r} col {i}: the scalar steps' bits");
        }
    }
    for r in 0..rows {
        let sum: f64 = (0..n).map(|i| ((x0[r * n + i] + d[r * n + i]) as f64).powi(2)).sum();
        let m = (sum / n as f64 + 1e-5).sqrt();
        for i in 0..n {
            let xi = (x0[r * n + i] + d[r * n + i]) as f64;
            assert_eq!(x[r * n + i], x0[r * n + i] + d[r * n + i]);
            assert!((h[r * n + i] as f64 - xi / m * w[i] as f64).abs() < 1e-5, "row {r} col {i}");
        }
    }
}

#[test]
fn shadow_row_adds_the_outliers_times_their_columns() {
    // Whole 64-output blocks (the AVX2 path), a remainder (the plain loop), the INT8 corners,
    // and a row without outliers.
    for (n, n_terms) in [(7, 3), (64, 1), (64 * 3 + 37, 16), (100, 0)] {
        let q = |i: usize, j: usize| match (i + j) % 11 {
            0 => i8::MIN,
            1 => i8::MAX,
            _ => ((i * 29 + j * 71) % 255) as i8,
        };
        let cols: Vec<Vec<i8>> = (0..n_terms).map(|j| (0..n).map(|i| q(i, j)).collect()).collect();
        let terms: Vec<(f32, &[i8])> = cols.iter().enumerate().map(|(j, c)| (j as f32 * 1.7 - 9.0, &c[..])).collect();
        let s: Vec<f32> = (0..n).map(|i| 0.001 + i as f32 * 1e-4).collect();
        let y0: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut y = y0.clone();
        shadow_row(&mut y, &terms, &s);
        for i in 0..n {
            let want = y0[i] as f64 + terms.iter().map(|&(a, q)| a as f64 * q[i] as f64 * s[i] as f64).sum::<f64>();
            assert!((y[i] as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "n {n}, output {i}: {} vs {want}", y[i]);
        }
    }
}

#[test]
fn blocks_over_the_pool_give_the_one_block_result() {
    // Sizes of many tasks, with a last block shorter than the others.
    let (rows, n) = (301, 97);
    let a: Vec<f32> = (0..rows * n).map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 0.01).collect();
    let b: Vec<f32> = (0..rows * n).map(|i| ((i * 104_729 % 997) as f32 - 498.0) * 0.003).collect();
    let w: Vec<f32> = (0..n).map(|i| 0.5 + i as f32 * 0.01).collect();
    assert!(rows_per_task(rows, n) < rows && block_len(a.len()) < a.len(), "the test must split");
    let one_block = |f: &dyn Fn(&mut [MaybeUninit<f32>]) -> usize| {
        let mut out = vec![MaybeUninit::new(f32::NAN); a.len()];
        assert_eq!(f(&mut out), a.len());
        out.iter().map(|v| unsafe { v.assume_init() }).collect::<Vec<f32>>()
    };
    assert_eq!(silu_mul(&a, &b), one_block(&|o| silu_mul_into(&a, &b, o)));
    assert_eq!(gelu_tanh_mul(&a, &b), one_block(&|o| gelu_tanh_mul_into(&a, &b, o)));
    let mut q = vec![MaybeUninit::new(0); a.len()];
    assert_eq!(quantize_into(&a, 40.0, -128.0, &mut q), a.len());
    assert_eq!(quantize_u8(&a, 40.0, -128.0), q.iter().map(|v| unsafe { v.assume_init() }).collect::<Vec<u8>>());
    let (mut x1, mut x2) = (a.clone(), a.clone());
    let h1 = add_rms_norm(&mut x1, &b, &w, 1e-5);
    let h2 = one_block(&|o| {
        add_rms_norm_rows(&mut x2.clone(), &b, &w, 1e-5, o);
        o.len()
    });
    add_rms_norm_rows(&mut x2, &b, &w, 1e-5, &mut vec![MaybeUninit::new(0.0); a.len()]);
    assert_eq!((h1, x1), (h2, x2));
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
        let sums = [exp_shifted_plain(&mut paths[0], scale, scale * row_max(&row)), softmax_numerators(&mut paths[1], scale)];
        for (got, sum) in paths.iter().zip(sums) {
            for (g, w) in got.iter().map(|g| g / sum).zip(&want) {
                assert!((g as f64 - w).abs() <= 1e-6 * w.max(1e-3), "len {len}: {g} vs {w}");
            }
        }
    }
}

/// [`exp`] with its multiply-adds fused: the scalar twin of the FMA kernels (`exp8`,
/// `neon::exp4`), the same steps in the same order, so the same bits.
fn exp_fused(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(EXP_LN2_HI, x);
    let r = (-n).mul_add(EXP_LN2_LO, r);
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p.mul_add(r, c);
    }
    let e = p.mul_add(r * r, r) + 1.0;
    e * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// The twins of the FMA kernels' gated activations.
fn silu_fused(g: f32, u: f32) -> f32 {
    g / (1.0 + exp_fused(-g)) * u
}

fn gelu_fused(x: f32, u: f32) -> f32 {
    let y = 2.0 * GELU_S * (0.044_715 * x).mul_add(x * x, x);
    (x - x / (exp_fused(y) + 1.0)) * u
}

/// `a` and `b` are the same bits (any NaN equal to any NaN).
fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || a.is_nan() && b.is_nan()
}

/// The fused twin is within 2 ulp of libm as [`exp`] is, and `neon::exp4` gives its bits
/// (`neon::exp4_neg` those of `-x`) on every value tried: the clamps, NaN, infinities, signed zeros, and a grid over the range.
#[test]
fn fused_exp_is_within_2_ulp_of_libm_and_exp4_gives_its_bits() {
    let worst = worst_against_libm(exp_fused);
    assert!(worst < 2.5e-7, "worst relative error {worst}");
    #[cfg(target_arch = "aarch64")]
    {
        use std::arch::aarch64::*;
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, -87.0, -87.01, 88.0, 88.01, -1e30, 1e30, 0.5 * std::f32::consts::LN_2];
        let xs: Vec<f32> = (-1_000_000..1_000_000).map(|i| i as f32 * 1e-4).chain(specials).collect();
        for c in xs.chunks(4) {
            let mut v = [0f32; 4];
            v[..c.len()].copy_from_slice(c);
            let mut got = [0f32; 4];
            // SAFETY: NEON is in the aarch64 baseline; both arrays are 4 values.
            unsafe { vst1q_f32(got.as_mut_ptr(), neon::exp4(vld1q_f32(v.as_ptr()))) };
            for (&x, &g) in v.iter().zip(&got) {
                assert!(same_bits(g, exp_fused(x)), "exp4({x}) = {g}, the twin's {}", exp_fused(x));
            }
            // SAFETY: as above.
            unsafe { vst1q_f32(got.as_mut_ptr(), neon::exp4_neg(vld1q_f32(v.as_ptr()))) };
            for (&x, &g) in v.iter().zip(&got) {
                assert!(same_bits(g, exp_fused(-x)), "exp4_neg({x}) = {g}, the twin's {}", exp_fused(-x));
            }
        }
    }
}

/// Softmax numerators on every path: each numerator has the bits of its path's scalar steps
/// (the plain loop's [`exp`], the vector kernels' fused twin), and each sum, of positive
/// terms, is within `gamma_d` of the exact sum of those numerators, `gamma_d = d u / (1 - d
/// u)` for `d` the additions a term meets at most: below `len / 8 + 32` on every path (plain:
/// `len / 8` in its lane, 8 and 7 for the lanes and the tail; AVX2: `len / 16` in its lane, 1,
/// 8, 15 and 1; NEON: `len / 16`, 2, 2, 15 and 1).
#[test]
fn softmax_numerators_are_their_scalar_steps_and_sums_within_their_bound_on_every_path() {
    type Kernel = fn(&mut [f32], f32, f32) -> f32;
    let paths: &[Option<(&str, Kernel, fn(f32, f32, f32) -> f32)>] = &[
        Some(("plain", |r, a, b| exp_shifted_plain(r, a, b), |v, scale, shift| exp(v * scale - shift))),
        #[cfg(target_arch = "x86_64")]
        avx2_fma().then_some(("avx2", |r, a, b| unsafe { exp_shifted_avx2(r, a, b) }, |v, scale, shift| exp_fused(v.mul_add(scale, -shift)))),
        #[cfg(target_arch = "aarch64")]
        Some(("neon", |r, a, b| unsafe { neon::exp_shifted(r, a, b) }, |v, scale, shift| exp_fused(v.mul_add(scale, -shift)))),
    ];
    for len in [0usize, 1, 3, 4, 15, 16, 17, 33, 1000, 4099] {
        // Large spreads: exponents far below -87 (clamped), some of exactly 0.
        let row: Vec<f32> = (0..len).map(|i| ((i * 7919 % 1009) as f32 - 800.0) * 0.37).collect();
        let (scale, shift) = (0.3, 0.3 * row_max(&row));
        for &(name, kernel, one) in paths.iter().flatten() {
            let mut got = row.clone();
            let sum = kernel(&mut got, scale, shift);
            for (i, (&g, &v)) in got.iter().zip(&row).enumerate() {
                assert!(same_bits(g, one(v, scale, shift)), "{name} len {len} value {i}: {g} vs {}", one(v, scale, shift));
            }
            let exact: f64 = got.iter().map(|&v| v as f64).sum();
            let du = (len / 8 + 32) as f64 * f32::EPSILON as f64 / 2.0;
            assert!((sum as f64 - exact).abs() <= du / (1.0 - du) * exact, "{name} len {len}: sum {sum} vs {exact}");
        }
    }
}

/// The vector kernels of the gated activations give their fused twins' bits (the AVX2
/// kernel on its 16-value steps; its tail is the plain loop's), and the plain loops their
/// scalar steps' bits (`map2` over `silu` and `gelu`).
#[test]
fn gated_activation_kernels_give_their_scalar_steps_bits() {
    let gate: Vec<f32> = (-3000..3000).map(|i| i as f32 * 0.013).chain([-100.0, 100.0, 0.0, -0.0, f32::NAN, 1e30, -1e30]).collect();
    let up: Vec<f32> = gate.iter().enumerate().map(|(i, g)| 1.5 - g * 0.1 + (i % 3) as f32).collect();
    type Kernel = fn(&[f32], &[f32], &mut [MaybeUninit<f32>]) -> usize;
    let plain: [(&str, Kernel, fn(f32, f32) -> f32); 2] = [("silu", |a, b, o| map2(a, b, o, silu), silu), ("gelu", |a, b, o| map2(a, b, o, gelu), gelu)];
    // (name, kernel, the twin of its vector steps, how many leading values they do of n)
    type Vector = (&'static str, Kernel, fn(f32, f32) -> f32, fn(usize) -> usize);
    let vector: &[Option<Vector>] = &[
        #[cfg(target_arch = "x86_64")]
        avx2_fma().then_some(("avx2 silu", silu_mul_into as Kernel, silu_fused as fn(f32, f32) -> f32, (|n| n / 16 * 16) as fn(usize) -> usize)),
        #[cfg(target_arch = "x86_64")]
        avx2_fma().then_some(("avx2 gelu", gelu_tanh_mul_into as Kernel, gelu_fused as fn(f32, f32) -> f32, (|n| n / 16 * 16) as fn(usize) -> usize)),
        #[cfg(target_arch = "aarch64")]
        Some(("neon silu", |a, b, o| unsafe { neon::silu_mul(a, b, o) }, silu_fused, |n| n)),
        #[cfg(target_arch = "aarch64")]
        Some(("neon gelu", |a, b, o| unsafe { neon::gelu_tanh_mul(a, b, o) }, gelu_fused, |n| n)),
    ];
    let paths = plain.iter().map(|&(name, k, f)| (name, k, f, (|_| usize::MAX) as fn(usize) -> usize)).chain(vector.iter().flatten().copied());
    for (name, kernel, twin, vector_part) in paths {
        // Lengths with and without a tail; the tail's twin is the plain step where the
        // kernel leaves it to the plain loop.
        for n in [gate.len(), gate.len() - 5, 3] {
            let mut out = vec![MaybeUninit::new(f32::NAN); n];
            assert_eq!(kernel(&gate[..n], &up[..n], &mut out), n);
            let tail: fn(f32, f32) -> f32 = if name.contains("silu") { silu } else { gelu };
            for (i, o) in out.iter().enumerate() {
                let want = if i < vector_part(n) { twin(gate[i], up[i]) } else { tail(gate[i], up[i]) };
                // SAFETY: the kernel wrote all n values (asserted).
                let got = unsafe { o.assume_init() };
                assert!(same_bits(got, want), "{name} n {n} value {i} (x = {}): {got} vs {want}", gate[i]);
            }
        }
    }
}

/// The shadow row's vector kernels give the bits of their fused steps (`acc = fma(a, q,
/// acc)` over the terms in order, then `fma(acc, s, y)`): NEON on every output, AVX2 on its
/// blocks of 64 (the rest is the plain loop's).
#[test]
fn shadow_row_kernels_give_their_fused_steps_bits() {
    for (n, n_terms) in [(7usize, 3usize), (16, 2), (64, 1), (64 * 3 + 37, 16), (100, 0), (1000, 5)] {
        let cols: Vec<Vec<i8>> = (0..n_terms).map(|j| (0..n).map(|i| ((i * 29 + j * 71 + i * j) % 256) as u8 as i8).collect()).collect();
        let terms: Vec<(f32, &[i8])> = cols.iter().enumerate().map(|(j, c)| (j as f32 * 1.37 - 9.1, &c[..])).collect();
        let s: Vec<f32> = (0..n).map(|i| 0.001 + i as f32 * 1.3e-4).collect();
        let y0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.77).sin() * 3.0).collect();
        let fused = |i: usize| terms.iter().fold(0f32, |acc, &(a, q)| a.mul_add(q[i] as f32, acc)).mul_add(s[i], y0[i]);
        let plain = |i: usize| y0[i] + terms.iter().map(|&(a, q)| a * q[i] as f32).sum::<f32>() * s[i];
        let mut y = y0.clone();
        shadow_row(&mut y, &terms, &s);
        #[cfg(target_arch = "aarch64")]
        let fused_part = n;
        #[cfg(target_arch = "x86_64")]
        let fused_part = if avx2_fma() { n / 64 * 64 } else { 0 };
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        let fused_part = 0;
        for (i, &got) in y.iter().enumerate() {
            let want = if i < fused_part { fused(i) } else { plain(i) };
            assert!(same_bits(got, want), "n {n} terms {n_terms} output {i}: {got} vs {want}");
        }
    }
}

#[test]
fn round_clamp_is_round_then_clamp_for_every_kind_of_value() {
    // Halves of both signs, the floats next to them, values beyond the clamp and beyond i32,
    // integers beyond 2^23, the extremes, NaN and infinities; and a dense grid.
    let mut vs: Vec<f32> =
        vec![0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, -0.49999997, 126.5, 127.49, 127.5, -127.5, -128.5, 255.5, 8388607.5, 8388609.0, 3e9];
    vs.extend([1e30, -1e30, f32::MAX, f32::MIN, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, f32::MIN_POSITIVE]);
    vs.extend((-300_000..300_000).map(|i| i as f32 * 0.00137));
    vs.extend((0..2000).map(|i| f32::from_bits(0x3eff_ff00 + i)));
    for (lo, hi) in [(-127, 127), (0, 255), (-128, 127), (-3, 252)] {
        for &v in &vs {
            let want = if v.is_nan() { 0 } else { (v.round().clamp(lo as f32, hi as f32)) as i32 };
            assert_eq!(round_clamp(v, lo, hi), want, "{v:e} in [{lo}, {hi}]");
        }
    }
    // The u8 quantizer (its wide path on this CPU) against the rounding it replaced.
    for offset in [7.0, -128.0] {
        let q = quantize_u8(&vs, 1.0 / 0.013, offset);
        for (&v, &q) in vs.iter().zip(&q) {
            // The old form, NaN to 0 through `max` (clamp would keep it).
            #[allow(clippy::manual_clamp)]
            let want = ((v * (1.0 / 0.013f32)).round() - offset).max(0.0).min(255.0) as u8;
            assert_eq!(q, want, "{v:e}, offset {offset}");
        }
    }
}
