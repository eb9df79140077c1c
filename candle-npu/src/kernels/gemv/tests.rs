use super::*;
use rand::{Rng, SeedableRng};

/// Every path this machine runs.
fn paths() -> Vec<GemvPath> {
    [GemvPath::Portable, GemvPath::Avx2, GemvPath::Avx512, GemvPath::Neon, GemvPath::Dotprod, GemvPath::I8mm].into_iter().filter(|p| p.runs_here()).collect()
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
/// the AVX2 lanes hold at most 65024, the Arm paths' 4 lanes 8 * 128 * 128 = 131072, a whole
/// block 32 * 128 * 128 = 524288), so the error is the float work, counted per term (a
/// block's `d_w * d_x * dot`) along its way to the result: `d_w * d_x` rounded once, then one
/// rounding per operation that adds it or a sum holding it (the first, an FMA into its
/// accumulator, also rounds its product with the dot). With nb = K / 32:
/// - Portable: the product with the dot, then nb additions in sequence: nb + 2;
/// - AVX2: an FMA chain per accumulator (even and odd blocks, at most nb / 2 + 1 each), their
///   sum, the 3 levels of the 8-lane sum: at most nb / 2 + 6;
/// - Dotprod and Neon: an FMA chain per accumulator (four: block i of each group of four on
///   the i-th, the nb % 4 tail blocks one each on the first ones: at most nb / 4 + 1 each), 2
///   levels summing the four, 2 of `hsum4`: at most nb / 4 + 6 (rounded down), which is at
///   most nb + 5 for every nb >= 1 (equal at nb = 1);
/// - I8mm: one FMA chain over the nb blocks: nb + 1.
///
/// Standard summation analysis bounds a sum whose terms see at most d roundings by
/// `d u * sum |terms|` (to first order) with u = 2^-24, so `(K / 32 + 5) u * sum |terms|`
/// bounds every path; `f32::EPSILON` is 2u, a factor 2 of margin (which covers the second
/// order). It is tight enough to see a single weight off by one (see
/// `the_tolerance_sees_one_weight_off_by_one`).
fn tolerance(k: usize, abs: f64) -> f64 {
    (k / QK + 5) as f64 * f32::EPSILON as f64 * abs
}

/// `n` rows of `k` random weights as Q4_1 bytes, every nibble value. Row `r`'s scales and
/// minimums are of kind `r % 6` as in [`weights`], the minimums of either sign (a real
/// block's minimum is mostly negative; zero and subnormal ones too).
fn q4_1_weights(rng: &mut impl Rng, n: usize, k: usize) -> Vec<u8> {
    let mut w = Vec::with_capacity(n * k / QK * Q4_1_BLOCK_BYTES);
    for r in 0..n {
        for _ in 0..k / QK {
            w.extend(scale_bits(rng, r % 6).to_le_bytes());
            w.extend((scale_bits(rng, r % 6) ^ if rng.random() { 0x8000 } else { 0 }).to_le_bytes());
            w.extend((0..QK / 2).map(|_| rng.random::<u8>()));
        }
    }
    w
}

/// Block `b`'s 32 weights as (d, m, nibbles): weight i is `d * q[i] + m`, `q[j]` the low
/// nibble of byte j and `q[j + 16]` its high nibble (candle's `BlockQ4_1::to_float`).
fn q4_1_block(w: &[u8], b: usize) -> (f64, f64, [u8; QK]) {
    let blk = &w[b * Q4_1_BLOCK_BYTES..][..Q4_1_BLOCK_BYTES];
    let d = half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f64();
    let m = half::f16::from_bits(u16::from_le_bytes([blk[2], blk[3]])).to_f64();
    let q = std::array::from_fn(|i| if i < QK / 2 { blk[4 + i] & 0x0F } else { blk[4 + i - QK / 2] >> 4 });
    (d, m, q)
}

/// [`reference`] for Q4_1: row `r`'s product in f64 (exact but for the final roundings) and
/// the sum of the absolute terms the kernel adds, `sum_b |d_w d_x| sum_i q_i |q_x,i| +
/// |m_w d_x sum_i q_x,i|`, that bounds its f32 error.
fn reference_q4_1(w: &[u8], k: usize, x: &Q8Activation, r: usize) -> (f64, f64) {
    let nb = k / QK;
    let (mut sum, mut abs) = (0f64, 0f64);
    for b in 0..nb {
        let (d, m, q) = q4_1_block(w, r * nb + b);
        let dx = x.scales[b] as f64;
        let qx = &x.q[b * QK..][..QK];
        let dot: i64 = q.iter().zip(qx).map(|(&q, &v)| q as i64 * v as i64).sum();
        let dot_abs: i64 = q.iter().zip(qx).map(|(&q, &v)| (q as i64 * v as i64).abs()).sum();
        let xsum: i64 = qx.iter().map(|&v| v as i64).sum();
        sum += d * dx * dot as f64 + m * dx * xsum as f64;
        abs += (d * dx).abs() * dot_abs as f64 + (m * dx * xsum as f64).abs();
    }
    (sum, abs)
}

/// [`tolerance`] for Q4_1. Each block's two integer sums are exact (the AVX2 lanes hold at
/// most 7680, the Arm paths' 4 lanes 8 * 15 * 128 = 15360, a block 61440, a block sum of the
/// activation 4096, all below 2^24), so again the error is the float work, counted per term
/// (`d_w * d_x * dot` or `m_w * d_x * sum`) along its way to the result, nb = K / 32:
/// - Portable: `d_w * d_x` or `m_w * d_x` rounded, its product with the integer sum, the two
///   terms' sum, then nb additions: nb + 3;
/// - AVX2: the scale rounded, its FMA into one of four accumulators (a chain of at most
///   nb / 4 + 3 FMAs, the tail of nb % 4 blocks on the first), 2 levels summing the four, 1
///   adding the minimum terms, the 3 levels of the 8-lane sum: at most nb / 4 + 10;
/// - Dotprod and Neon: a `d_w` term as in [`tolerance`] (the scale, a chain of at most
///   nb / 4 + 1 FMAs, 2 levels summing the four accumulators), then 1 adding the groups'
///   minimum terms, 2 of `hsum4`, 1 adding the tail's minimum terms: at most nb / 4 + 8; a
///   group's `m_w` term: the scale, its lane's chain of at most nb / 4 FMAs, 1 into the
///   accumulators' sum, 2 of `hsum4`, 1: nb / 4 + 5; a tail block's: the scale, a chain of
///   at most 3 scalar FMAs, 1: 5;
/// - I8mm: a `d_w` term's scale, its chain of nb FMAs, 1 adding the minimum terms: nb + 2; an
///   `m_w` term's `d_x * sum`, its chain of nb FMAs, 1: nb + 2.
///
/// So `(K / 32 + 10) u` bounds every path, and `f32::EPSILON` = 2u doubles it as
/// [`tolerance`] does; it sees a single nibble off by one (see
/// `the_tolerance_sees_one_nibble_off_by_one`).
fn tolerance_q4_1(k: usize, abs: f64) -> f64 {
    (k / QK + 10) as f64 * f32::EPSILON as f64 * abs
}

/// The two weight formats, for the tests they share.
#[derive(Debug, Clone, Copy)]
enum Format {
    Q8_0,
    Q4_1,
}

impl Format {
    fn weights(self, rng: &mut impl Rng, n: usize, k: usize) -> Vec<u8> {
        match self {
            Format::Q8_0 => weights(rng, n, k),
            Format::Q4_1 => q4_1_weights(rng, n, k),
        }
    }

    fn reference(self, w: &[u8], k: usize, x: &Q8Activation, r: usize) -> (f64, f64) {
        match self {
            Format::Q8_0 => reference(w, k, x, r),
            Format::Q4_1 => reference_q4_1(w, k, x, r),
        }
    }

    fn tolerance(self, k: usize, abs: f64) -> f64 {
        match self {
            Format::Q8_0 => tolerance(k, abs),
            Format::Q4_1 => tolerance_q4_1(k, abs),
        }
    }

    fn gemv_on(self, path: GemvPath, w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>, out: &mut [f32]) {
        match self {
            Format::Q8_0 => gemv_q8_0_on(path, w, k, x, rows, out),
            Format::Q4_1 => gemv_q4_1_on(path, w, k, x, rows, out),
        }
    }
}

fn check(format: Format, path: GemvPath, w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>) {
    let mut out = vec![f32::NAN; rows.len()];
    format.gemv_on(path, w, k, x, rows.clone(), &mut out);
    for (j, r) in rows.clone().enumerate() {
        let (want, abs) = format.reference(w, k, x, r);
        let err = (out[j] as f64 - want).abs();
        let tol = format.tolerance(k, abs);
        assert!(err <= tol, "{format:?} {path:?} K = {k} rows {rows:?}: row {r} is {} for {want} (error {err:e} > {tol:e})", out[j]);
    }
}

#[test]
fn every_path_matches_the_f64_reference() {
    // K of one block, two, SmolLM2's hidden and intermediate sizes, and past 2048; row counts
    // with every tail (n % 4 = 1, 2, 3, and 0 with a sub-range that leaves a tail).
    // Q4_1's AVX2 path takes blocks in fours: K / 32 = 1, 2, 7, 18, 48, 65 leave every tail
    // (0 to 3 blocks) after no group, one or many.
    let mut rng = rand::rngs::StdRng::seed_from_u64(26);
    for format in [Format::Q8_0, Format::Q4_1] {
        for k in [32, 64, 224, 576, 1536, 2048 + 32] {
            for n in [1, 2, 3, 4, 7, 13, 22] {
                let w = format.weights(&mut rng, n, k);
                for mixed in [false, true] {
                    let x = Q8Activation::quantize(&activations(&mut rng, k, mixed));
                    for path in paths() {
                        for rows in [0..n, 1..n, n / 2..n, 0..n / 2 + 1, n..n] {
                            check(format, path, &w, k, &x, rows);
                        }
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
fn the_tolerance_sees_one_nibble_off_by_one() {
    // As for Q8_0, on blocks as a quantizer makes them (d > 0, the minimum m between -15 d
    // and 0, so that the weights straddle zero): a nibble one step off against an activation
    // of +-127 changes the product by 127 d_w d_x, which must exceed the tolerance at K = 576.
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    let k = 576;
    let mut w = Vec::new();
    for _ in 0..k / QK {
        let d: f32 = rng.random_range(1e-3..0.1);
        w.extend(half::f16::from_f32(d).to_bits().to_le_bytes());
        w.extend(half::f16::from_f32(-d * rng.random_range(0.0..15.0)).to_bits().to_le_bytes());
        w.extend((0..QK / 2).map(|_| rng.random::<u8>()));
    }
    let x = Q8Activation::quantize(&activations(&mut rng, k, false));
    let (want, abs) = reference_q4_1(&w, k, &x, 0);
    // Every position of the first block whose activation is +-127, each nibble half.
    let at_127: Vec<usize> = (0..QK).filter(|&i| x.q[i].abs() == 127).collect();
    assert!(!at_127.is_empty(), "a block's maximum quantizes to +-127");
    for i in at_127 {
        let (byte, shift) = (4 + i % (QK / 2), if i < QK / 2 { 0 } else { 4 });
        let mut off = w.clone();
        let q = (w[byte] >> shift) & 0x0F;
        let q_off = if q == 15 { 14 } else { q + 1 };
        off[byte] = (w[byte] & !(0x0F << shift)) | (q_off << shift);
        let (got, _) = reference_q4_1(&off, k, &x, 0);
        let (step, tol) = ((got - want).abs(), tolerance_q4_1(k, abs));
        assert!(step > tol, "position {i}: one step is {step:e}, the tolerance {tol:e}");
    }
}

#[test]
fn every_path_is_exact_at_the_saturation_corners() {
    // The largest pair sums the AVX2 path forms: w = -128 (|w| = 128 as the unsigned operand)
    // and +127 against activations of +-127, in runs of equal signs; the Neon path's i16
    // pairs (bytes j and 16 + j of a block) reach 2 * 128 * 127 the same way. With unit
    // scales the products are integers below 2^24, exact in f32: any saturation or sign
    // wrap shows. K = 480 is fifteen blocks: three groups of four and a tail of three on the
    // Arm paths, a group of eight and a tail of seven on x86.
    let k = 480;
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
        let x = Q8Activation { scales: vec![1.0; k / QK], ..x };
        // The same with -128 for -127, for the paths that take it (Dotprod: `sdot`'s i32
        // lanes hold up to 8 * 128 * 128).
        let q = x.q.iter().map(|&q| if q == -127 { i8::MIN } else { q }).collect();
        let x_128 = Q8Activation::from_parts(x.scales.clone(), q, x.sums.clone());
        for (x, only) in [(x, false), (x_128, true)] {
            let want: Vec<f32> = (0..5).map(|r| reference(&w, k, &x, r).0 as f32).collect();
            assert!(want.iter().any(|v| v.abs() >= 32.0 * 128.0 * 127.0), "the corner must be reached: {want:?}");
            for path in paths().into_iter().filter(|p| !only || p.takes_minus_128()) {
                let mut out = vec![0.0; 5];
                gemv_q8_0_on(path, &w, k, &x, 0..5, &mut out);
                assert_eq!(out, want, "{path:?}");
            }
        }
    }
}

#[test]
fn every_path_is_exact_at_q4_1s_corners() {
    // The largest sums the Q4_1 kernel forms: nibbles of 15 (and patterns of 15 and 0)
    // against activations of +-127 and of -128, which gemv_q4_1 takes. With unit scales, the
    // minimums 0, 1 and -1 and d_x = 1, every product is an integer below 2^24, exact in
    // f32: any saturation, wrong nibble or wrong minimum term shows. K = 224 is a group of
    // four blocks and a tail of three.
    let k = 224;
    let nibble = |row: usize, b: usize, i: usize| -> u8 {
        match row {
            0 => 15,
            1 => 0,
            2 => {
                if (i / 8).is_multiple_of(2) {
                    15
                } else {
                    0
                }
            }
            3 => {
                if i < QK / 2 {
                    15
                } else {
                    0
                }
            }
            _ => ((b * 7 + i * 5) % 16) as u8,
        }
    };
    for m in [0.0f32, 1.0, -1.0] {
        let mut w = Vec::new();
        for row in 0..5 {
            for b in 0..k / QK {
                w.extend(half::f16::from_f32(1.0).to_bits().to_le_bytes());
                w.extend(half::f16::from_f32(m).to_bits().to_le_bytes());
                w.extend((0..QK / 2).map(|j| nibble(row, b, j) | nibble(row, b, j + QK / 2) << 4));
            }
        }
        let xs: [Vec<i8>; 4] = [vec![-128; k], vec![127; k], vec![-127; k], (0..k).map(|i| if i % 4 < 2 { 127 } else { -128 }).collect()];
        for q in xs {
            let sums = q.chunks_exact(QK).map(|b| b.iter().map(|&v| v as i32).sum()).collect();
            let x = Q8Activation::from_parts(vec![1.0; k / QK], q, sums);
            let want: Vec<f32> = (0..5).map(|r| reference_q4_1(&w, k, &x, r).0 as f32).collect();
            if m == 0.0 && x.q[0] == -128 {
                assert_eq!(want[0], -(k as f32) * 15.0 * 128.0, "the corner must be reached");
            }
            for path in paths() {
                let mut out = vec![0.0; 5];
                gemv_q4_1_on(path, &w, k, &x, 0..5, &mut out);
                assert_eq!(out, want, "{path:?} m = {m}");
            }
        }
    }
}

/// `out`, a kernel's product of `qt` (a candle QTensor, N x K) with `x`, against candle's
/// dequantized weights times the dequantized activation, in f64. The tolerance is the
/// kernel's (from the format's reference, which reads the blocks as the kernels do) plus the
/// rounding of the dequantized weights (none for Q8_0, one each for Q4_1's `d * q + m`:
/// f32::EPSILON is twice that); the reference itself is checked against candle's weights too.
fn check_against_candle(format: Format, qt: &candle_core::quantized::QTensor, x: &Q8Activation, out: &[f32]) {
    let (n, k) = qt.shape().dims2().unwrap();
    let wd: Vec<f32> = qt.dequantize(&candle_core::Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let bytes = qt.data().unwrap();
    for r in 0..n {
        let terms = (0..k).map(|i| wd[r * k + i] as f64 * x.q[i] as f64 * x.scales[i / QK] as f64);
        let (want, abs_w) = (terms.clone().sum::<f64>(), terms.map(f64::abs).sum::<f64>());
        let (reference, abs) = format.reference(&bytes, k, x, r);
        let tol = format.tolerance(k, abs) + f32::EPSILON as f64 * abs_w;
        assert!((reference - want).abs() <= tol, "{format:?} row {r}: the test's reference {reference} for candle's {want}");
        assert!((out[r] as f64 - want).abs() <= tol, "{format:?} row {r}: {} for {want} (tolerance {tol:e})", out[r]);
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
fn reads_candles_q4_1_storage() {
    // A Q4_1 QTensor's bytes, as candle stores them (its quantizer: d = (max - min) / 15,
    // m = min), rows of every kind: random, constant (d = 0), all negative, spanning 1e-3.
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    let mut rng = rand::rngs::StdRng::seed_from_u64(4);
    let (n, k) = (9, 224);
    let wf: Vec<f32> = (0..n * k)
        .map(|i| match i / k {
            0 => 0.5,
            1 => rng.random_range(-3.0..-1.0),
            2 => rng.random_range(0.0..1e-3),
            _ => rng.random_range(-2.0..2.0),
        })
        .collect();
    let qt = QTensor::quantize(&Tensor::from_vec(wf, (n, k), &Device::Cpu).unwrap(), GgmlDType::Q4_1).unwrap();
    let bytes = qt.data().unwrap();
    assert_eq!(bytes.len(), n * k / QK * Q4_1_BLOCK_BYTES);
    let x = Q8Activation::quantize(&activations(&mut rng, k, true));
    for path in paths() {
        let mut out = vec![0.0; n];
        gemv_q4_1_on(path, &bytes, k, &x, 0..n, &mut out);
        check_against_candle(Format::Q4_1, &qt, &x, &out);
    }
}

#[test]
fn block_matrices_multiply_every_row_and_refuse_what_they_cannot() {
    // 300 rows: past the size that brings in the helpers, and not a whole number of chunks.
    // One row, three rows (each its own product) and a 3-D input, against the kernel on the
    // same activation; two matrices at once give each one's own product.
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let (n, k) = (300, 256);
    let w = Tensor::from_vec((0..n * k).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<_>>(), (n, k), &Device::Cpu).unwrap();
    let xs: Vec<f32> = (0..3).flat_map(|_| activations(&mut rng, k, true)).collect();
    let x3 = Tensor::from_vec(xs.clone(), (3, k), &Device::Cpu).unwrap();
    for format in BlockFormat::ALL {
        let qt = QTensor::quantize(&w, format.dtype()).unwrap();
        let bm = BlockMatrix::from_qtensor(&qt).unwrap().expect("a block format");
        assert_eq!((bm.dims(), bm.data().len()), ((n, k), n * format.row_bytes(k)));
        let y = bm.forward(&x3).unwrap();
        assert_eq!(y.dims(), [3, n]);
        let y: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
        for r in 0..3 {
            let xq = Q8Activation::quantize(&xs[r * k..][..k]);
            let mut want = vec![0.0; n];
            gemv(format, bm.data(), k, &xq, 0..n, &mut want);
            assert_eq!(&y[r * n..][..n], &want[..], "{format:?} row {r}");
        }
        let y3 = bm.forward(&x3.reshape((1, 3, k)).unwrap()).unwrap();
        assert_eq!(y3.dims(), [1, 3, n]);
        let halves = [
            BlockMatrix::new(format, n / 2, k, bm.bytes.clone(), 0).unwrap(),
            BlockMatrix::new(format, n - n / 2, k, bm.bytes.clone(), n / 2 * format.row_bytes(k)).unwrap(),
        ];
        let both = BlockMatrix::forward_all(&[&halves[0], &halves[1]], &x3).unwrap();
        let joined: Vec<f32> = Tensor::cat(&both, 1).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(joined, y, "{format:?}: two halves at once");
    }
    for dtype in [GgmlDType::Q2K, GgmlDType::F16, GgmlDType::F32] {
        assert!(BlockMatrix::from_qtensor(&QTensor::quantize(&w, dtype).unwrap()).unwrap().is_none(), "{dtype:?}");
    }
    let bytes: std::sync::Arc<dyn AsRef<[u8]> + Send + Sync> = std::sync::Arc::new(vec![0u8; 2 * 34 * 2]);
    let err = BlockMatrix::new(BlockFormat::Q8_0, 3, 64, bytes.clone(), 0).unwrap_err().to_string();
    assert!(err.contains("runs past its 136 bytes"), "{err}");
    let err = BlockMatrix::new(BlockFormat::Q4K, 1, 64, bytes.clone(), 0).unwrap_err().to_string();
    assert!(err.contains("not whole blocks of 256"), "{err}");
    let ok = BlockMatrix::new(BlockFormat::Q8_0, 2, 64, bytes, 0).unwrap();
    let err = ok.forward(&Tensor::zeros((1, 32), candle_core::DType::F32, &Device::Cpu).unwrap()).unwrap_err().to_string();
    assert!(err.contains("against a weight of [2, 64]"), "{err}");
    assert!(ok.rows(&[2]).unwrap_err().to_string().contains("row 2 of a matrix of 2 rows"));
}

#[test]
fn the_quantizer_is_ggmls() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let k = 2048 + 32;
    let x = activations(&mut rng, k, true);
    assert!(x.chunks_exact(QK).any(|b| b.iter().all(|&v| v == 0.0)), "the data must have an all-zero block");
    let a = Q8Activation::quantize(&x);
    assert_eq!((a.q.len(), a.scales.len(), a.sums.len()), (k, k / QK, k / QK));
    for (((xb, qb), &d), &sum) in x.chunks_exact(QK).zip(a.q.chunks_exact(QK)).zip(&a.scales).zip(&a.sums) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(d, amax / 127.0);
        assert_eq!(sum, qb.iter().map(|&q| q as i32).sum::<i32>());
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

/// The quantizer in vectors (x86's AVX2) gives the portable loop's values, scales, sums and
/// groups bit for bit: on ordinary rows of every scale, on values at exactly half a step (where
/// rounding half away from zero and half to even differ), on NaN, infinities, signed zeros,
/// subnormals and f32's extremes, and on every K from one block to past eight (a group's end).
#[cfg(target_arch = "x86_64")]
#[test]
fn the_vector_quantizer_is_the_portable_one() {
    assert!(crate::kernels::cpu::cpu().avx2, "the x86 machines this project runs on have AVX2; this test needs it");
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    let special = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 0.0, f32::MIN_POSITIVE / 4.0, f32::MAX, f32::MIN, 127.0, -127.0];
    for k in (1..=20).map(|b| b * QK).chain([576, 1536]) {
        for case in 0..6 {
            let mut x = activations(&mut rng, k, true);
            match case {
                // Blocks whose largest magnitude is 127 (a step of 1): k + 0.5 and -(k + 0.5).
                1 => x.chunks_exact_mut(QK).for_each(|b| {
                    b[0] = 127.0;
                    b[1..].iter_mut().enumerate().for_each(|(i, v)| *v = (i as f32 % 126.0 + 0.5) * if i % 2 == 0 { 1.0 } else { -1.0 });
                }),
                2 | 3 => x.iter_mut().for_each(|v| {
                    if rng.random_range(0..8) == 0 {
                        *v = special[rng.random_range(0..special.len())];
                    }
                }),
                4 => x.iter_mut().for_each(|v| *v = f32::from_bits(rng.random())),
                5 => x.iter_mut().for_each(|v| *v *= 1e-38),
                _ => {}
            }
            let mut portable = Q8Activation { q: vec![0; k], scales: vec![0.0; k / QK], sums: vec![0; k / QK], ..Default::default() };
            portable.quantize_blocks(&x);
            let vector = Q8Activation::quantize(&x);
            let bits = |a: &Q8Activation| a.scales.iter().map(|d| d.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&vector), bits(&portable), "K = {k}, case {case}: scales");
            assert_eq!((&vector.q, &vector.sums, &vector.groups), (&portable.q, &portable.sums, &portable.groups), "K = {k}, case {case}");
        }
    }
}

#[test]
fn quantize_into_reuses_its_buffers() {
    // A token's activation into the buffers of the last: the same allocations.
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    let mut a = Q8Activation::quantize(&activations(&mut rng, 576, true));
    let (q, s, sums) = (a.q.as_ptr(), a.scales.as_ptr(), a.sums.as_ptr());
    let x = activations(&mut rng, 576, true);
    a.quantize_into(&x);
    assert_eq!((a.q.as_ptr(), a.scales.as_ptr(), a.sums.as_ptr()), (q, s, sums), "quantize_into reallocated");
    assert_eq!(a, Q8Activation::quantize(&x));
    // A shorter K shrinks the lengths (not the buffers).
    a.quantize_into(&x[..64]);
    assert_eq!(a, Q8Activation::quantize(&x[..64]));
}

/// Several input rows at once (`gemv_rows`: 1 to 5, so a group of four, a pair and one alone
/// all run) give each the bits it gets alone, Q8_0 and Q4_1, on every path (on I8mm they share
/// every instruction, a row paired with itself when alone; on x86 a block's unpacking), with an
/// odd number of weight rows (the last pairs with itself on I8mm), a row range off the first and
/// block counts below, at and past Q4_1's groups of eight (1 to 25 blocks: whole groups, short
/// last groups of at most four and of more); and `BlockMatrix::forward_all` of several rows
/// gives each the bits of a one-row call.
#[test]
fn rows_together_are_each_rows_product_to_the_bit() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for path in paths() {
        for (format, (n, k)) in
            [BlockFormat::Q8_0, BlockFormat::Q4_1].into_iter().flat_map(|f| [(7, 96), (4, 32), (9, 160), (1, 64), (5, 224), (3, 576), (2, 800)].map(|s| (f, s)))
        {
            let w = match format {
                BlockFormat::Q8_0 => weights(&mut rng, n, k),
                _ => q4_1_weights(&mut rng, n, k),
            };
            let xs: Vec<Q8Activation> = (0..5).map(|_| Q8Activation::quantize(&activations(&mut rng, k, true))).collect();
            for rows in [0..n, n / 2..n] {
                let alone: Vec<Vec<f32>> = xs
                    .iter()
                    .map(|x| {
                        let mut o = vec![0f32; rows.len()];
                        gemv_on(path, format, &w, k, x, rows.clone(), &mut o);
                        o
                    })
                    .collect();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                for m in 1..=xs.len() {
                    let mut outs = vec![vec![f32::NAN; rows.len()]; m];
                    let x: Vec<&Q8Activation> = xs[..m].iter().collect();
                    gemv_rows_on(path, format, &w, k, &x, rows.clone(), &mut outs.iter_mut().map(|o| o.as_mut_slice()).collect::<Vec<_>>());
                    for (i, (got, want)) in outs.iter().zip(&alone).enumerate() {
                        assert_eq!(bits(got), bits(want), "{path:?} {format:?}: n {n}, k {k}, rows {rows:?}, row {i} of {m}");
                    }
                }
            }
        }
    }
    // Through the decode product, on the detected path: three rows.
    let (n, k) = (70, 128);
    for (format, bytes) in [(BlockFormat::Q8_0, weights(&mut rng, n, k)), (BlockFormat::Q4_1, q4_1_weights(&mut rng, n, k))] {
        let m = BlockMatrix::new(format, n, k, std::sync::Arc::new(bytes), 0).unwrap();
        let x: Vec<f32> = (0..3).flat_map(|_| activations(&mut rng, k, false)).collect();
        let all = BlockMatrix::forward_all(&[&m], &candle_core::Tensor::from_vec(x.clone(), (3, k), &candle_core::Device::Cpu).unwrap()).unwrap();
        let all: Vec<Vec<f32>> = all[0].to_vec2().unwrap();
        for (r, row) in all.iter().enumerate() {
            let one = m.forward(&candle_core::Tensor::from_vec(x[r * k..(r + 1) * k].to_vec(), (1, k), &candle_core::Device::Cpu).unwrap()).unwrap();
            assert_eq!(one.to_vec2::<f32>().unwrap()[0], *row, "{format:?}: row {r} of three");
        }
    }
}

/// Q4_1's short last group (at most four blocks, `x86::short_q4_1`: each block's dot on its own)
/// gives the bits of the eight-block group it replaces: the same K padded with zero blocks (zero
/// weights, scales and activations) to a whole group, on both x86 paths, one to five rows at a
/// time (the kernels' one, two and four), for every tail after zero to two whole groups.
#[cfg(target_arch = "x86_64")]
#[test]
fn a_short_last_q4_1_group_is_the_padded_groups_product_to_the_bit() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    let n = 6;
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for path in [GemvPath::Avx2, GemvPath::Avx512].into_iter().filter(|p| p.runs_here()) {
        for nb in (1..24).filter(|nb| nb % 8 != 0) {
            let (k, padded) = (QK * nb, QK * nb.next_multiple_of(8));
            let w = q4_1_weights(&mut rng, n, k);
            // Each row's blocks, then as many zero blocks as make a whole group.
            let row_bytes = |bytes: usize| w.chunks_exact(bytes / QK * Q4_1_BLOCK_BYTES);
            let wp: Vec<u8> = row_bytes(k).flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(0, (padded - k) / QK * Q4_1_BLOCK_BYTES))).collect();
            let xs: Vec<Vec<f32>> = (0..5).map(|_| activations(&mut rng, k, true)).collect();
            let short: Vec<Q8Activation> = xs.iter().map(|x| Q8Activation::quantize(x)).collect();
            let whole: Vec<Q8Activation> = xs.iter().map(|x| Q8Activation::quantize(&[x.as_slice(), &vec![0.0; padded - k]].concat())).collect();
            for m in 1..=xs.len() {
                let run = |w: &[u8], k: usize, x: &[Q8Activation]| {
                    let mut outs = vec![vec![f32::NAN; n]; m];
                    let x: Vec<&Q8Activation> = x[..m].iter().collect();
                    gemv_rows_on(path, BlockFormat::Q4_1, w, k, &x, 0..n, &mut outs.iter_mut().map(|o| o.as_mut_slice()).collect::<Vec<_>>());
                    outs
                };
                for (i, (got, want)) in run(&w, k, &short).iter().zip(&run(&wp, padded, &whole)).enumerate() {
                    assert_eq!(bits(got), bits(want), "{path:?}: {nb} blocks, row {i} of {m}: {got:?} {want:?}");
                }
            }
        }
    }
}

#[test]
fn the_default_path_is_the_fastest_here() {
    #[cfg(target_arch = "aarch64")]
    let want = {
        assert!(GemvPath::Neon.runs_here() && !GemvPath::Avx2.runs_here() && !GemvPath::Avx512.runs_here());
        match (std::arch::is_aarch64_feature_detected!("dotprod"), std::arch::is_aarch64_feature_detected!("i8mm")) {
            (true, true) => GemvPath::I8mm,
            (true, false) => GemvPath::Dotprod,
            _ => GemvPath::Neon,
        }
    };
    #[cfg(not(target_arch = "aarch64"))]
    let want = {
        assert!(!GemvPath::Neon.runs_here() && !GemvPath::Dotprod.runs_here());
        [GemvPath::Avx512, GemvPath::Avx2].into_iter().find(|p| p.runs_here()).unwrap_or(GemvPath::Portable)
    };
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

#[cfg(target_arch = "aarch64")]
#[test]
fn fcvtl_converts_every_f16_as_half_does() {
    for bits in 0..=u16::MAX {
        let got = aarch64::f16_bits_to_f32(bits);
        let want = half::f16::from_bits(bits).to_f32();
        assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{bits:#06x}: {got} for {want}");
    }
}

#[test]
fn neon_and_dotprod_agree_to_the_bit() {
    // The two Arm paths do the same float work on the same i32 lanes (see `aarch64`), so
    // their results are equal bit for bit, for every K (groups of four blocks and every
    // tail), row and kind of scale. Q4_1 with -128 in the activation too (both take it).
    if !(GemvPath::Neon.runs_here() && GemvPath::Dotprod.runs_here()) {
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(27);
    q8_0_and_q4_1_agree_to_the_bit(&mut rng, GemvPath::Neon, GemvPath::Dotprod);
    // The other formats (`formats`): random bytes, -128 in the activation too.
    for format in BlockFormat::ALL {
        for k in [256usize, 768, 896, 4864].into_iter().filter(|k| k.is_multiple_of(format.block_len())) {
            let n = 5;
            let w = format_weights(&mut rng, format, n, k);
            let mut x = Q8Activation::quantize(&activations(&mut rng, k, true));
            if format != BlockFormat::Q8_0 {
                for (qb, sum) in x.q.chunks_exact_mut(QK).zip(&mut x.sums) {
                    qb[rng.random_range(0..QK)] = i8::MIN;
                    *sum = qb.iter().map(|&q| q as i32).sum();
                }
                x = Q8Activation::from_parts(x.scales, x.q, x.sums);
            }
            let (mut neon, mut dotprod) = (vec![0.0; n], vec![0.0; n]);
            gemv_on(GemvPath::Neon, format, &w, k, &x, 0..n, &mut neon);
            gemv_on(GemvPath::Dotprod, format, &w, k, &x, 0..n, &mut dotprod);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&neon), bits(&dotprod), "{format:?} K = {k}: {neon:?} {dotprod:?}");
        }
    }
}

#[test]
fn avx2_and_avx512_agree_to_the_bit_on_q8_0_and_q4_1() {
    // `vpdpbusd` fills the i32 lanes that `vpmaddubsw` + `vpmaddwd` fill (no i16 pair saturates
    // on these operands, see `x86`), and the float work is the same, so Q8_0's and Q4_1's results
    // are equal bit for bit, for every K (Q4_1's groups of eight and every tail); Q4_1 with -128 in
    // the activation too (both take it).
    if !(GemvPath::Avx2.runs_here() && GemvPath::Avx512.runs_here()) {
        return;
    }
    q8_0_and_q4_1_agree_to_the_bit(&mut rand::rngs::StdRng::seed_from_u64(28), GemvPath::Avx2, GemvPath::Avx512);
}

/// Q8_0 and Q4_1 on paths `a` and `b` give the same bits, for every K (Q4_1's groups of four
/// and eight blocks and every tail), row and kind of scale; Q4_1 with -128 in the activation too.
fn q8_0_and_q4_1_agree_to_the_bit(rng: &mut impl Rng, a: GemvPath, b: GemvPath) {
    for format in [Format::Q8_0, Format::Q4_1] {
        for k in [32, 64, 96, 128, 224, 576, 1536 + 96] {
            let n = 13;
            let w = format.weights(rng, n, k);
            for mixed in [false, true] {
                let mut x = Q8Activation::quantize(&activations(rng, k, mixed));
                if let (Format::Q4_1, true) = (format, mixed) {
                    for (qb, sum) in x.q.chunks_exact_mut(QK).zip(&mut x.sums) {
                        qb[rng.random_range(0..QK)] = i8::MIN;
                        *sum = qb.iter().map(|&q| q as i32).sum();
                    }
                    x = Q8Activation::from_parts(x.scales, x.q, x.sums);
                }
                let (mut on_a, mut on_b) = (vec![0.0; n], vec![0.0; n]);
                format.gemv_on(a, &w, k, &x, 0..n, &mut on_a);
                format.gemv_on(b, &w, k, &x, 0..n, &mut on_b);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&on_a), bits(&on_b), "{format:?} K = {k}, {a:?} and {b:?}: {on_a:?} {on_b:?}");
            }
        }
    }
}

#[test]
fn an_activation_built_from_its_parts_is_the_quantized_one_and_a_changed_one_is_refused() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(29);
    for k in [32, 256, 288, 576] {
        let x = Q8Activation::quantize(&activations(&mut rng, k, true));
        assert_eq!(Q8Activation::from_parts(x.scales.clone(), x.q.clone(), x.sums.clone()), x, "K = {k}");
        // Values changed in place, sums kept right: the Q4_1 kernels would read the old ones.
        let mut stale = x.clone();
        stale.q.swap(0, 1);
        let w = Format::Q4_1.weights(&mut rng, 2, k);
        let refused = std::panic::catch_unwind(|| gemv_q4_1(&w, k, &stale, 0..2, &mut [0.0; 2]));
        assert_eq!(refused.is_err(), cfg!(target_arch = "x86_64") && stale.q[0] != stale.q[1], "K = {k}");
    }
}

#[test]
fn an_empty_k_or_row_range_gives_zeros_or_nothing() {
    let x = Q8Activation::quantize(&[]);
    for format in [Format::Q8_0, Format::Q4_1] {
        for path in paths() {
            let mut out = vec![f32::NAN; 3];
            format.gemv_on(path, &[], 0, &x, 0..3, &mut out);
            assert_eq!(out, [0.0; 3], "{format:?} {path:?}");
            format.gemv_on(path, &format.weights(&mut rand::rngs::StdRng::seed_from_u64(1), 2, 64), 64, &Q8Activation::quantize(&[1.0; 64]), 2..2, &mut []);
        }
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
fn a_q8_0_activation_of_minus_128_is_exact_or_refused() {
    // The paths that sum two products in an i16 (Avx2, Neon) refuse a -128, which
    // (-128) * (-128) twice would overflow; the others (Dotprod, Portable) are exact on it:
    // weights of -128 against activations of -128 with unit scales, 2 * 32 * 16384 = 2^20.
    let k = 64;
    let w: Vec<u8> = (0..k / QK).flat_map(|_| half::f16::from_f32(1.0).to_bits().to_le_bytes().into_iter().chain([0x80; QK])).collect();
    let x = Q8Activation::from_parts(vec![1.0; k / QK], vec![i8::MIN; k], vec![QK as i32 * -128; k / QK]);
    for path in paths() {
        let run = || {
            let mut out = [0.0];
            gemv_q8_0_on(path, &w, k, &x, 0..1, &mut out);
            out[0]
        };
        if path.takes_minus_128() {
            assert_eq!(run(), (1 << 20) as f32, "{path:?}");
        } else {
            let err = std::panic::catch_unwind(run).expect_err("a -128 must be refused");
            let msg = err.downcast_ref::<String>().map(String::as_str).unwrap_or_default();
            assert!(msg.contains("has a -128"), "{path:?}: {msg}");
        }
    }
}

#[test]
#[should_panic(expected = "not whole rows of K = 64 (40 bytes each)")]
fn q8_0_bytes_as_q4_1_panic() {
    // Two Q8_0 rows (136 bytes) are no whole number of Q4_1 rows.
    let w = weights(&mut rand::rngs::StdRng::seed_from_u64(1), 2, 64);
    gemv_q4_1(&w, 64, &Q8Activation::quantize(&[1.0; 64]), 0..2, &mut [0.0; 2]);
}

#[test]
#[should_panic(expected = "block sums are not its values'")]
fn q4_1_with_wrong_block_sums_panics() {
    let w = q4_1_weights(&mut rand::rngs::StdRng::seed_from_u64(1), 1, 64);
    let mut x = Q8Activation::quantize(&[1.0; 64]);
    x.q[40] -= 1;
    gemv_q4_1(&w, 64, &x, 0..1, &mut [0.0]);
}

#[test]
#[should_panic(expected = "has 1 block sums for 2 blocks")]
fn q4_1_without_block_sums_panics() {
    let w = q4_1_weights(&mut rand::rngs::StdRng::seed_from_u64(1), 1, 64);
    let mut x = Q8Activation::quantize(&[1.0; 64]);
    x.sums.pop();
    gemv_q4_1(&w, 64, &x, 0..1, &mut [0.0]);
}

// --- Every format through `gemv_on`, against candle's own dequantization ---

/// Where `format`'s f16 fields are in a block: the scale `d`, and the minimum's (`dmin`, `m`)
/// for the formats that subtract one.
fn f16_fields(format: BlockFormat) -> (usize, Option<usize>) {
    match format {
        BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0 => (0, None),
        BlockFormat::Q4_1 | BlockFormat::Q4K | BlockFormat::Q5K => (0, Some(2)),
        BlockFormat::Q6K => (208, None),
    }
}

/// `n` rows of `k` weights of `format`: random bytes (every value, scale and bit pattern),
/// the f16 fields finite, of kind `r % 6` for row `r` ([`scale_bits`]), a minimum of either
/// sign.
fn format_weights(rng: &mut impl Rng, format: BlockFormat, n: usize, k: usize) -> Vec<u8> {
    let (bytes, (d, m)) = (format.block_bytes(), f16_fields(format));
    let mut w: Vec<u8> = (0..n * format.row_bytes(k)).map(|_| rng.random()).collect();
    for (i, blk) in w.chunks_exact_mut(bytes).enumerate() {
        let kind = i / (k / format.block_len()) % 6;
        blk[d..d + 2].copy_from_slice(&scale_bits(rng, kind).to_le_bytes());
        if let Some(m) = m {
            let sign = if rng.random() { 0x8000 } else { 0 };
            blk[m..m + 2].copy_from_slice(&(scale_bits(rng, kind) ^ sign).to_le_bytes());
        }
    }
    w
}

/// The rows of `w` dequantized by candle (ggml's `to_float`), `[n, k]`.
fn candle_rows(format: BlockFormat, w: &[u8], n: usize, k: usize) -> Vec<f32> {
    use candle_core::quantized::ggml_file::qtensor_from_ggml;
    let t = qtensor_from_ggml(format.dtype(), w, vec![n, k], &candle_core::Device::Cpu).unwrap();
    t.dequantize(&candle_core::Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// Row `r`'s product in f64 from candle's dequantized weights, and the sum of the absolute
/// terms the kernels add: `|d ...| |q q_x|` and, for a minimum, `|dmin m| |q_x|` per weight,
/// found by dequantizing with the minimum, then the scale, set to zero.
fn format_reference(format: BlockFormat, w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>) -> Vec<(f64, f64)> {
    let n = w.len() / format.row_bytes(k);
    let xf: Vec<f64> = x.q.iter().enumerate().map(|(i, &q)| q as f64 * x.scales[i / QK] as f64).collect();
    let zeroed = |at: usize| {
        let mut z = w.to_vec();
        z.chunks_exact_mut(format.block_bytes()).for_each(|b| b[at..at + 2].fill(0));
        candle_rows(format, &z, n, k)
    };
    let (d, m) = f16_fields(format);
    let wf = candle_rows(format, w, n, k);
    let parts = m.map(|m| (zeroed(m), zeroed(d)));
    rows.map(|r| {
        let row = |v: &[f32]| v[r * k..][..k].to_vec();
        let sum = row(&wf).iter().zip(&xf).map(|(&w, &x)| w as f64 * x).sum();
        let abs = match &parts {
            None => row(&wf).iter().zip(&xf).map(|(&w, &x)| (w as f64 * x).abs()).sum(),
            Some((scaled, mins)) => row(scaled).iter().zip(row(mins)).zip(&xf).map(|((&s, mn), &x)| (s.abs() + mn.abs()) as f64 * x.abs()).sum(),
        };
        (sum, abs)
    })
    .collect()
}

/// As [`tolerance_q4_1`], with room for the K-quants' longer way to the sum (per
/// super-block: the scale's two products, a chain of at most K / 256 + 1 FMAs per
/// accumulator, the minimum terms' own chain and the final subtraction) and for candle's
/// dequantization, which rounds each weight (`d * sc` then `* q - dmin * m`: 3 roundings).
fn format_tolerance(k: usize, abs: f64) -> f64 {
    (k / QK + 16) as f64 * f32::EPSILON as f64 * abs
}

fn check_format(format: BlockFormat, path: GemvPath, w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>) {
    let mut out = vec![f32::NAN; rows.len()];
    gemv_on(path, format, w, k, x, rows.clone(), &mut out);
    for ((r, got), (want, abs)) in rows.clone().zip(&out).zip(format_reference(format, w, k, x, rows.clone())) {
        let (err, tol) = ((*got as f64 - want).abs(), format_tolerance(k, abs));
        assert!(err <= tol, "{format:?} {path:?} K = {k} rows {rows:?}: row {r} is {got} for {want} (error {err:e} > {tol:e})");
    }
}

#[test]
fn every_format_on_every_path_matches_candles_dequantization() {
    // K of one super-block, two, three, Llama-3.2-1B's hidden 2048, Qwen2.5-0.5B's
    // intermediate 4864 (19 super-blocks); 32-blocks also at K = 32, 96, 896 (Qwen2.5-0.5B's
    // hidden size: no K-quant row); row sub-ranges as above.
    let mut rng = rand::rngs::StdRng::seed_from_u64(35);
    for format in BlockFormat::ALL {
        for k in [32usize, 96, 256, 512, 768, 896, 2048, 4864] {
            if !k.is_multiple_of(format.block_len()) {
                continue;
            }
            let n = 7;
            let w = format_weights(&mut rng, format, n, k);
            for mixed in [false, true] {
                let x = Q8Activation::quantize(&activations(&mut rng, k, mixed));
                for path in paths() {
                    for rows in [0..n, 2..n, 3..4, n..n] {
                        check_format(format, path, &w, k, &x, rows);
                    }
                }
            }
        }
    }
}

#[test]
fn every_format_is_exact_at_its_integer_corners() {
    // The largest integer sums each kernel forms: every byte of the weights 0xFF (the
    // largest values, scales and minimums, the fifth and sixth bits set; Q6_K's scales -1),
    // 0x00, or alternating, with unit f16 fields, against activations of +-127 and of -128
    // with unit scales. A saturated i16 pair or a wrapped sign would be off by thousands;
    // the tolerance is a few parts in 10^6.
    let one = half::f16::from_f32(1.0).to_bits().to_le_bytes();
    let k = 512;
    for format in BlockFormat::ALL {
        let (d, m) = f16_fields(format);
        for fill in [0xFFu8, 0x00, 0xAA, 0x55] {
            let mut w = vec![fill; 2 * format.row_bytes(k)];
            for blk in w.chunks_exact_mut(format.block_bytes()) {
                blk[d..d + 2].copy_from_slice(&one);
                if let Some(m) = m {
                    blk[m..m + 2].copy_from_slice(&one);
                }
            }
            for q in [vec![127i8; k], vec![-128; k], (0..k).map(|i| if i % 4 < 2 { 127 } else { -128 }).collect()] {
                if format == BlockFormat::Q8_0 && q.contains(&i8::MIN) {
                    continue; // Q8_0's own test covers -128 (some paths refuse it).
                }
                let sums = q.chunks_exact(QK).map(|b| b.iter().map(|&v| v as i32).sum()).collect();
                let x = Q8Activation::from_parts(vec![1.0; k / QK], q, sums);
                for path in paths() {
                    check_format(format, path, &w, k, &x, 0..2);
                }
            }
        }
    }
}

#[test]
fn the_format_tolerance_sees_one_bit_of_any_value_byte() {
    // Rows as a quantizer makes them (candle's, from normal weights), K = 512: flipping the
    // lowest bit of any byte past the f16 fields (a value, a fifth or sixth bit, a sub-block
    // scale or minimum) changes the dequantized row; against activations of 127 (unit
    // scales) that must move the product by more than the tolerance, or the tests above
    // could miss a wrong weight.
    use candle_core::quantized::QTensor;
    let mut rng = rand::rngs::StdRng::seed_from_u64(36);
    let k = 512;
    let normal: Vec<f32> = (0..k).map(|_| (0..12).map(|_| rng.random_range(-0.5f32..0.5)).sum()).collect();
    let x = Q8Activation::from_parts(vec![1.0; k / QK], vec![127; k], vec![127 * QK as i32; k / QK]);
    for format in BlockFormat::ALL {
        let t = candle_core::Tensor::from_vec(normal.clone(), (1, k), &candle_core::Device::Cpu).unwrap();
        let w = QTensor::quantize(&t, format.dtype()).unwrap().data().unwrap().to_vec();
        let (_, abs) = format_reference(format, &w, k, &x, 0..1)[0];
        let tol = format_tolerance(k, abs);
        let base = candle_rows(format, &w, 1, k);
        let (d, m) = f16_fields(format);
        let f16_bytes = |i: usize| [Some(d), m].into_iter().flatten().any(|at| (at..at + 2).contains(&(i % format.block_bytes())));
        let mut seen = 0;
        for i in (0..w.len()).filter(|&i| !f16_bytes(i)) {
            let mut off = w.clone();
            off[i] ^= 1;
            let step: f64 = candle_rows(format, &off, 1, k).iter().zip(&base).map(|(a, b)| (a - b) as f64 * 127.0).sum();
            if step != 0.0 {
                seen += 1;
                assert!(step.abs() > tol, "{format:?} byte {i}: one bit moves the row by {step:e}, the tolerance is {tol:e}");
            }
        }
        assert!(seen > w.len() / 2, "{format:?}: only {seen} of {} bytes change the row", w.len());
    }
}

#[test]
fn a_single_value_is_candles_dequantization_to_the_bit() {
    // Random bytes (every value, scale and bit; finite f16 fields) of every format: each
    // weight read alone equals the whole matrix's dequantization by candle, bit for bit.
    let mut rng = rand::rngs::StdRng::seed_from_u64(37);
    for format in BlockFormat::ALL {
        let (n, k) = (3, 512);
        let w = format_weights(&mut rng, format, n, k);
        let want = candle_rows(format, &w, n, k);
        let m = BlockMatrix::new(format, n, k, std::sync::Arc::new(w), 0).unwrap();
        for r in 0..n {
            for c in 0..k {
                assert_eq!(m.value(r, c).to_bits(), want[r * k + c].to_bits(), "{format:?} ({r}, {c})");
            }
        }
        for c in 0..k {
            let mut col = vec![0f32; n - 1];
            m.column(c, 1..n, &mut col);
            let want: Vec<u32> = (1..n).map(|r| want[r * k + c].to_bits()).collect();
            assert_eq!(col.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "{format:?} column {c}");
        }
    }
}
