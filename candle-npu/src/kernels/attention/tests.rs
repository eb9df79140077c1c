use super::*;
use rand::{Rng, SeedableRng};

/// Softmax attention of one row over `keys`/`values` rows `span` in f64, from its definition.
fn reference(q: &[f32], keys: &[f32], values: &[f32], hd: usize, span: Range<usize>, scale: f32) -> Vec<f64> {
    let s: Vec<f64> = span.clone().map(|j| scale as f64 * (0..hd).map(|d| q[d] as f64 * keys[j * hd + d] as f64).sum::<f64>()).collect();
    let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = s.iter().map(|v| (v - max).exp()).sum();
    (0..hd).map(|d| span.clone().zip(&s).map(|(j, v)| (v - max).exp() / z * values[j * hd + d] as f64).sum()).collect()
}

fn random(rng: &mut impl Rng, n: usize, spread: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-spread..spread)).collect()
}

/// f16 keys and values give the bits of f32 ones holding the same (rounded) values: the
/// widening is exact and every sum after it is the f32 path's, in the prefill tiles and in
/// decode's one-position kernel, across key blocks.
#[test]
fn f16_rows_compute_as_f32_rows_of_their_values() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for (hd, len, rows) in [(64usize, 2 * KEY_BLOCK + 7, 9usize), (8, 300, 3), (64, 40, 3)] {
        let to16 = |v: Vec<f32>| v.into_iter().map(half::f16::from_f32).collect::<Vec<_>>();
        let (k16, v16) = (to16(random(&mut rng, len * hd, 2.0)), to16(random(&mut rng, len * hd, 2.0)));
        let (k32, v32): (Vec<f32>, Vec<f32>) = (k16.iter().map(|v| v.to_f32()).collect(), v16.iter().map(|v| v.to_f32()).collect());
        let q = random(&mut rng, rows * hd, 1.0);
        let span = |r: usize| r..len - r;
        let run = |kv: HeadKv<'_>| {
            let mut acc = Partial::default();
            acc.reset(rows, hd);
            attend(&q, kv, &span, 0.3, &mut acc, &mut Scratch::default());
            let mut one = Partial::default();
            one.reset(rows, hd);
            let mut scores = vec![];
            attend_tile_one(&q, kv, 0..len, 0.3, KEY_BLOCK, &mut one, &mut scores);
            (acc.out, acc.max, one.out, one.sum)
        };
        let wide = run(HeadKv { keys: KvRows::F32(&k32), values: KvRows::F32(&v32), first: 0, head_dim: hd });
        let half = run(HeadKv { keys: KvRows::F16(&k16), values: KvRows::F16(&v16), first: 0, head_dim: hd });
        assert_eq!(half, wide, "hd {hd}, {len} keys");
        if hd % Q8_BLOCK != 0 {
            continue;
        }
        // The same for q8 blocks against f32 rows of their dequantized values.
        let q8 = |x: &[f32]| {
            let (mut q, mut d) = (vec![0i8; x.len()], vec![half::f16::ZERO; x.len() / Q8_BLOCK]);
            quantize_q8(x, &mut q, &mut d);
            let wide: Vec<f32> = q.iter().enumerate().map(|(i, &v)| v as f32 * d[i / Q8_BLOCK].to_f32()).collect();
            (q, d, wide)
        };
        let ((kq, kd, kw), (vq, vd, vw)) = (q8(&k32), q8(&v32));
        let wide = run(HeadKv { keys: KvRows::F32(&kw), values: KvRows::F32(&vw), first: 0, head_dim: hd });
        let q8 = run(HeadKv { keys: KvRows::Q8 { q: &kq, d: &kd }, values: KvRows::Q8 { q: &vq, d: &vd }, first: 0, head_dim: hd });
        assert_eq!(q8, wide, "q8: hd {hd}, {len} keys");
    }
}

/// q8 blocks hold every value within half a step of its block's scale (the largest exactly at
/// 127 steps), zeros as zeros, and blocks of one sign or one magnitude.
#[test]
fn q8_blocks_round_to_their_scale() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let mut x = random(&mut rng, 4 * Q8_BLOCK, 3.0);
    x[Q8_BLOCK..2 * Q8_BLOCK].fill(0.0);
    x[2 * Q8_BLOCK..3 * Q8_BLOCK].fill(-1e-3);
    let (mut q, mut d) = (vec![0i8; x.len()], vec![half::f16::ZERO; 4]);
    quantize_q8(&x, &mut q, &mut d);
    for (b, (x, q)) in x.chunks_exact(Q8_BLOCK).zip(q.chunks_exact(Q8_BLOCK)).enumerate() {
        let d = d[b].to_f32();
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!((d - amax / 127.0).abs() <= amax / 127.0 * 1e-3, "block {b}: scale {d} for a largest value {amax}");
        for (&x, &q) in x.iter().zip(q) {
            // The scale rounded to f16 moves each value by at most 127 * its rounding.
            assert!((q as f32 * d - x).abs() <= d / 2.0 + amax * 1e-3, "block {b}: {x} held as {q} x {d}");
        }
        assert_eq!(q.iter().map(|v| v.unsigned_abs()).max().unwrap(), if amax > 0.0 { 127 } else { 0 }, "block {b}");
    }
}

/// Every row against the definition, for spans that start and end inside, on and across
/// key blocks (causal ends, sliding windows, a span of one key, an empty one), with scores
/// large enough that an unshifted exponent would overflow.
#[test]
fn tiled_attention_matches_the_definition() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for (hd, len, spread) in [(8usize, 300usize, 2.0f32), (64, 2 * KEY_BLOCK + 5, 1.0), (16, KEY_BLOCK, 30.0), (4, 1, 1.0)] {
        let (keys, values) = (random(&mut rng, len * hd, spread), random(&mut rng, len * hd, 2.0));
        let spans: Vec<Range<usize>> = vec![0..len, 0..1, len - 1..len, len / 2..len, 3..len.clamp(4, KEY_BLOCK + 9), 5..5, 1..len];
        let spans: Vec<Range<usize>> = spans.into_iter().map(|s| s.start.min(len)..s.end.min(len)).collect();
        let q = random(&mut rng, spans.len() * hd, spread);
        let mut acc = Partial::default();
        acc.reset(spans.len(), hd);
        attend(
            &q,
            HeadKv { keys: KvRows::F32(&keys), values: KvRows::F32(&values), first: 0, head_dim: hd },
            &|r| spans[r].clone(),
            0.3,
            &mut acc,
            &mut Scratch::default(),
        );
        let mut got = vec![f32::NAN; spans.len() * hd];
        acc.normalized_into(&mut got);
        for (r, span) in spans.iter().enumerate() {
            let want = match span.is_empty() {
                true => vec![0.0; hd],
                false => reference(&q[r * hd..][..hd], &keys, &values, hd, span.clone(), 0.3),
            };
            for (d, (&g, w)) in got[r * hd..][..hd].iter().zip(want).enumerate() {
                // f32 sums of up to 2 * KEY_BLOCK + 5 terms of magnitude <= 2: a few 1e-6.
                assert!((g as f64 - w).abs() < 2e-5, "hd {hd} len {len} row {r} span {span:?} dim {d}: {g} vs {w}");
            }
        }
    }
}

/// Rows' results do not depend on the keys they do not see: a cache holding more positions
/// (a later turn's prefix, a longer prompt) gives the same bits. (Nor on how many rows share
/// the tile: the next test.)
#[test]
fn rows_give_the_same_bits_whatever_else_the_cache_holds() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let (hd, len) = (32, 3 * KEY_BLOCK + 17);
    let (keys, values) = (random(&mut rng, len * hd, 1.5), random(&mut rng, len * hd, 1.5));
    let q = random(&mut rng, 40 * hd, 1.5);
    // Row i of 40 at position 300 + i, causal, window 200.
    let span = |i: usize| (300 + i + 1).saturating_sub(200)..300 + i + 1;
    let run = |keys_held: usize| {
        let mut acc = Partial::default();
        acc.reset(40, hd);
        let kv = HeadKv { keys: KvRows::F32(&keys[..keys_held * hd]), values: KvRows::F32(&values[..keys_held * hd]), first: 0, head_dim: hd };
        attend(&q, kv, &span, 0.2, &mut acc, &mut Scratch::default());
        let mut out = vec![0f32; 40 * hd];
        acc.normalized_into(&mut out);
        out
    };
    let all = run(len);
    for held in [340, 341, KEY_BLOCK + 300] {
        assert_eq!(run(held.min(len)), all, "{held} keys held");
    }
}

/// A key range split into parts at any position, each folded alone and merged, agrees with
/// the whole range (to rounding: the merge rescales in another order).
/// A row's bits do not depend on how many rows are multiplied with it: a padded chunk's
/// real rows, one to many, and a verification pass of a few rows all give each row what a
/// full tile does (the `gemm` crate's kernel for fewer than [`GEMM_MIN_ROWS`] rows sums in
/// another order).
#[test]
fn rows_give_the_same_bits_whatever_number_of_rows_shares_the_tile() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    for (hd, len) in [(64usize, 700usize), (32, 40)] {
        let (keys, values) = (random(&mut rng, len * hd, 1.5), random(&mut rng, len * hd, 1.5));
        let q = random(&mut rng, 64 * hd, 1.5);
        let span = |i: usize| 0..(len - 64 + i + 1).min(len);
        let run = |rows: usize| {
            let mut acc = Partial::default();
            acc.reset(rows, hd);
            let kv = HeadKv { keys: KvRows::F32(&keys), values: KvRows::F32(&values), first: 0, head_dim: hd };
            attend(&q[..rows * hd], kv, &span, 0.2, &mut acc, &mut Scratch::default());
            let mut out = vec![0f32; rows * hd];
            acc.normalized_into(&mut out);
            out
        };
        let all = run(64);
        for rows in [1, 2, 3, 6, 7, 8, 9, 21, 63] {
            assert_eq!(run(rows), all[..rows * hd], "hd {hd}: {rows} rows");
        }
    }
}

#[test]
fn split_keys_merge_to_the_whole() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let (hd, len, rows) = (64, 1000, 3);
    let (keys, values) = (random(&mut rng, len * hd, 3.0), random(&mut rng, len * hd, 1.0));
    let q = random(&mut rng, rows * hd, 3.0);
    let span = |_r: usize| 0..len;
    let fold = |range: Range<usize>| {
        let mut acc = Partial::default();
        acc.reset(rows, hd);
        let kv = HeadKv {
            keys: KvRows::F32(&keys[range.start * hd..range.end * hd]),
            values: KvRows::F32(&values[range.start * hd..range.end * hd]),
            first: range.start,
            head_dim: hd,
        };
        attend(&q, kv, &span, 0.125, &mut acc, &mut Scratch::default());
        acc
    };
    let mut whole = vec![0f32; rows * hd];
    fold(0..len).normalized_into(&mut whole);
    for cuts in [vec![0, 256, 512, 768, 1000], vec![0, 1, 999, 1000], vec![0, 333, 1000], vec![0, 0, 1000]] {
        let mut acc = fold(cuts[0]..cuts[1]);
        for w in cuts[1..].windows(2) {
            acc.merge(&fold(w[0]..w[1]));
        }
        let mut got = vec![0f32; rows * hd];
        acc.normalized_into(&mut got);
        for (i, (g, w)) in got.iter().zip(&whole).enumerate() {
            assert!((g - w).abs() <= 1e-6 * (1.0 + w.abs()), "cuts {cuts:?} value {i}: {g} vs {w}");
        }
    }
}

/// Tiles computed apart (on other threads, in any order) and merged in position order give
/// the bits of [`attend`]: decode's split over the cores changes nothing.
#[test]
fn tiles_merged_in_order_give_the_bits_of_attend() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let (hd, len, rows) = (64, 5 * KEY_BLOCK + 3, 4);
    let (keys, values) = (random(&mut rng, len * hd, 2.0), random(&mut rng, len * hd, 1.0));
    let q = random(&mut rng, rows * hd, 2.0);
    let kv = HeadKv { keys: KvRows::F32(&keys), values: KvRows::F32(&values), first: 0, head_dim: hd };
    let span = |r: usize| (r * 100)..len - r;
    let mut whole = Partial::default();
    whole.reset(rows, hd);
    attend(&q, kv, &span, 0.125, &mut whole, &mut Scratch::default());
    let starts: Vec<usize> = tile_starts((0..rows).map(span), 0..len).collect();
    assert_eq!(starts, (0..len).step_by(KEY_BLOCK).collect::<Vec<_>>());
    // Computed last to first, merged first to last.
    let tiles: Vec<Partial> = starts
        .iter()
        .rev()
        .map(|&t| {
            let mut p = Partial::default();
            p.reset(rows, hd);
            attend_tile(&q, kv, &span, 0.125, t, &mut p, &mut vec![]);
            p
        })
        .collect();
    let mut merged = Partial::default();
    merged.reset(rows, hd);
    tiles.iter().rev().for_each(|t| merged.merge(t));
    assert_eq!((merged.max, merged.sum, merged.out), (whole.max, whole.sum, whole.out));
}

/// Decode's kernel against the definition and against [`attend_tile`], for heads of 64 and
/// 8 (its AVX2 path where the CPU has it) and of 12 (the plain path), 1 to 9 rows (past one
/// block of 8 in registers), odd key counts and spans that start and end inside a tile.
#[test]
fn one_position_kernel_matches_the_definition() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    for (hd, rows, len, span) in [(64usize, 3usize, 700usize, 0..700), (8, 9, 37, 3..30), (12, 7, 520, 100..513), (64, 1, 1, 0..1), (256, 4, 600, 88..600)] {
        let (keys, values) = (random(&mut rng, len * hd, 2.0), random(&mut rng, len * hd, 1.0));
        let q = random(&mut rng, rows * hd, 2.0);
        let kv = HeadKv { keys: KvRows::F32(&keys), values: KvRows::F32(&values), first: 0, head_dim: hd };
        let (mut one, mut gemm) = (Partial::default(), Partial::default());
        one.reset(rows, hd);
        gemm.reset(rows, hd);
        for t in tile_starts(std::iter::once(span.clone()), 0..len) {
            let mut p = Partial::default();
            p.reset(rows, hd);
            attend_tile_one(&q, kv, span.clone(), 0.2, t, &mut p, &mut vec![]);
            one.merge(&p);
            p.reset(rows, hd);
            attend_tile(&q, kv, &|_| span.clone(), 0.2, t, &mut p, &mut vec![]);
            gemm.merge(&p);
        }
        let (mut a, mut b) = (vec![0f32; rows * hd], vec![0f32; rows * hd]);
        one.normalized_into(&mut a);
        gemm.normalized_into(&mut b);
        for r in 0..rows {
            let want = reference(&q[r * hd..][..hd], &keys, &values, hd, span.clone(), 0.2);
            for d in 0..hd {
                let (x, y) = (a[r * hd + d], b[r * hd + d]);
                assert!((x as f64 - want[d]).abs() < 2e-5, "hd {hd} rows {rows} row {r} dim {d}: {x} vs {}", want[d]);
                assert!((x - y).abs() < 2e-5, "hd {hd} row {r} dim {d}: {x} vs the GEMM tile's {y}");
            }
        }
    }
}

/// `gamma_d = d u / (1 - d u)`: the relative bound of `d` roundings (`u = 2^-24`).
fn gamma(d: usize) -> f64 {
    let du = d as f64 * f32::EPSILON as f64 / 2.0;
    du / (1.0 - du)
}

/// The shapes of the kernel tests: (head_dim, rows, keys), head dims around the vector
/// widths (4, 8, 16 values; 56 is x86's three strip widths, 32 + 16 + 8) and the models' (64,
/// 128, 256), rows across the blocks in registers (4 on NEON; on x86 3 for the scores, 3 or 4
/// for the weighted sums), keys across 4-key steps, and a whole tile of keys.
const SHAPES: [(usize, usize, usize); 10] =
    [(4, 1, 1), (4, 3, 5), (8, 2, 7), (12, 5, 9), (20, 9, 4), (56, 5, 10), (64, 3, 37), (128, 8, 13), (256, 2, 6), (64, 4, 512)];

/// Every path's `dots` against f64: a scalar product computed with `d` roundings at most
/// per term is within `gamma_d * sum |q_i k_i|` of the exact one, `d` per path: the plain
/// loop's `hd + 1` (a product, then `hd` additions), AVX2's `hd / 8 + 3` (its lane's FMAs,
/// `hsum8`'s three levels), NEON's `ceil(hd / 8) + 3` (its chain's FMAs, the two chains' sum,
/// `hsum4`'s two levels). The f64 reference's own error (products exact, 1e-16 relative
/// sums) is far below.
#[test]
fn dots_are_within_their_rounding_bound_on_every_path() {
    type Kernel = fn(&[f32], &[f32], usize, &mut [f32]);
    // (name, kernel, whether it takes a head_dim, its roundings per term)
    type Path = (&'static str, Kernel, fn(usize) -> bool, fn(usize) -> usize);
    let paths: &[Option<Path>] = &[
        Some(("plain", dots_plain, |_| true, |hd| hd + 1)),
        #[cfg(target_arch = "x86_64")]
        super::super::rows::avx2_fma().then_some(("avx2", |q, k, hd, s| unsafe { x86::dots(q, k, hd, s) }, |hd| hd % 8 == 0, |hd| hd / 8 + 3)),
        #[cfg(target_arch = "aarch64")]
        Some(("neon", |q, k, hd, s| unsafe { neon::dots(q, k, hd, s) }, |hd| hd % 4 == 0, |hd| hd.div_ceil(8) + 3)),
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    for (hd, rows, n) in SHAPES {
        let (q, keys) = (random(&mut rng, rows * hd, 3.0), random(&mut rng, n * hd, 3.0));
        for &(name, kernel, _, roundings) in paths.iter().flatten().filter(|p| p.2(hd)) {
            let mut s = vec![f32::NAN; rows * n];
            kernel(&q, &keys, hd, &mut s);
            for (r, j) in (0..rows).flat_map(|r| (0..n).map(move |j| (r, j))) {
                let terms = (0..hd).map(|d| q[r * hd + d] as f64 * keys[j * hd + d] as f64);
                let (exact, abs) = terms.fold((0.0, 0.0), |(e, a), t| (e + t, a + t.abs()));
                let got = s[r * n + j] as f64;
                assert!((got - exact).abs() <= (gamma(roundings(hd)) + 1e-12) * abs, "{name} hd {hd} row {r} key {j}: {got} vs {exact}");
            }
        }
    }
}

/// x86's scores are, key by key, [`crate::kernels::hsum8`] of the key's eight lane chains
/// `fma(q_c, k_c, acc)` in order, whichever block of keys and rows it is computed in: the
/// same bits as one key and one row at a time (the lanes emulated with `f32::mul_add`).
#[cfg(target_arch = "x86_64")]
#[test]
fn x86_dots_are_each_key_s_own_lane_sums() {
    if !super::super::rows::avx2_fma() {
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    for (hd, rows, n) in SHAPES.into_iter().filter(|s| s.0 % 8 == 0) {
        let (q, keys) = (random(&mut rng, rows * hd, 3.0), random(&mut rng, n * hd, 3.0));
        let mut s = vec![f32::NAN; rows * n];
        // SAFETY: AVX2 and FMA (checked), `hd` a multiple of 8, the sizes as `dots` takes them.
        unsafe { x86::dots(&q, &keys, hd, &mut s) };
        for (r, j) in (0..rows).flat_map(|r| (0..n).map(move |j| (r, j))) {
            let lane = |l: usize| (l..hd).step_by(8).fold(0f32, |a, d| q[r * hd + d].mul_add(keys[j * hd + d], a));
            let y: [f32; 4] = std::array::from_fn(|i| lane(i) + lane(i + 4));
            let want = (y[0] + y[2]) + (y[1] + y[3]);
            assert_eq!(s[r * n + j].to_bits(), want.to_bits(), "hd {hd} rows {rows} keys {n}: row {r} key {j}");
        }
    }
}

/// `weighted_sum`'s vector kernels compute every output as `fma(p_j, v_j, acc)` over the keys
/// in order from 0: the bits of `f32::mul_add` in that order. The plain loop (a product, then
/// an addition, per key) is within `gamma_(n + 1) * sum_j |p_j v_j|` of the exact sum.
#[test]
fn weighted_sums_are_fmas_in_key_order_on_the_vector_paths() {
    type Kernel = fn(&[f32], &[f32], usize, &mut [f32]);
    let vector: &[Option<(&str, Kernel, fn(usize) -> bool)>] = &[
        #[cfg(target_arch = "x86_64")]
        super::super::rows::avx2_fma().then_some(("avx2", |p, v, hd, o| unsafe { x86::weighted_sum(p, v, hd, o) }, |hd| hd % 8 == 0)),
        #[cfg(target_arch = "aarch64")]
        Some(("neon", |p, v, hd, o| unsafe { neon::weighted_sum(p, v, hd, o) }, |hd| hd % 4 == 0)),
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(19);
    for (hd, rows, n) in SHAPES {
        // Softmax numerators are in [0, 1]; negative weights too, for the bound's sake.
        let (p, values) = (random(&mut rng, rows * n, 1.0), random(&mut rng, n * hd, 2.0));
        let mut out = vec![f32::NAN; rows * hd];
        weighted_sum_plain(&p, &values, hd, &mut out);
        for (r, c) in (0..rows).flat_map(|r| (0..hd).map(move |c| (r, c))) {
            let terms = (0..n).map(|j| p[r * n + j] as f64 * values[j * hd + c] as f64);
            let (exact, abs) = terms.fold((0.0, 0.0), |(e, a), t| (e + t, a + t.abs()));
            let got = out[r * hd + c] as f64;
            assert!((got - exact).abs() <= (gamma(n + 1) + 1e-12) * abs, "plain hd {hd} row {r} value {c}: {got} vs {exact}");
        }
        for &(name, kernel, _) in vector.iter().flatten().filter(|p| p.2(hd)) {
            let mut out = vec![f32::NAN; rows * hd];
            kernel(&p, &values, hd, &mut out);
            for (r, c) in (0..rows).flat_map(|r| (0..hd).map(move |c| (r, c))) {
                let want = (0..n).fold(0f32, |acc, j| p[r * n + j].mul_add(values[j * hd + c], acc));
                let got = out[r * hd + c];
                assert_eq!(got.to_bits(), want.to_bits(), "{name} hd {hd} rows {rows} keys {n} row {r} value {c}: {got} vs {want}");
            }
        }
    }
}

#[test]
#[should_panic(expected = "attention::attend_tile")]
fn wrong_sizes_panic_naming_them() {
    let mut acc = Partial::default();
    acc.reset(2, 4);
    attend(
        &[0.0; 7],
        HeadKv { keys: KvRows::F32(&[0.0; 8]), values: KvRows::F32(&[0.0; 8]), first: 0, head_dim: 4 },
        &|_| 0..2,
        1.0,
        &mut acc,
        &mut Scratch::default(),
    );
}
