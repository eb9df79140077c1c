//! Exactness of the shadow outlier mechanism on the host executor: `ShadowLinear` + `InputPoint`
//! against a plain W8A8 graph and against the float linear.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use candle_npu::outlier::InMemoryWeight;
use candle_npu::quant::quantize_u8;
use candle_npu::{DType, DecodeWeights, Graph, InputPoint, NpuDevice, ShadowLinear, TensorData, WeightQuant};
use rand::{Rng, SeedableRng};

const M: usize = 24;
const K: usize = 64;
// Outputs over several of the cold-column gather's 64-row blocks, the last one partial.
const N: usize = 150;

/// Activations with a few huge channels (as after an RMSNorm), and a weight.
fn data(seed: u64) -> (Vec<f32>, Tensor) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let x: Vec<f32> = (0..M * K).map(|i| if i % K == 5 || i % K == 40 { rng.random_range(-60.0..60.0) } else { rng.random_range(-1.5..1.5) }).collect();
    let w: Vec<f32> = (0..N * K).map(|_| rng.random_range(-0.2..0.2)).collect();
    (x, Tensor::from_vec(w, (N, K), &Device::Cpu).unwrap())
}

fn linear(w: &Tensor) -> ShadowLinear {
    let src = Arc::new(InMemoryWeight::from_tensor("w", w).unwrap());
    ShadowLinear::new("lin", src, None, WeightQuant::PerChannel, DecodeWeights::F32).unwrap()
}

/// NPU part (host executor) + shadow, as the engine runs a stage.
fn run(lin: &ShadowLinear, p: &InputPoint, x: &[f32]) -> Vec<f32> {
    let mut g = Graph::new("t");
    let xi = g.input("x", &[M, K], DType::U8, Some(p.quant));
    let y = lin.add_to_graph(&mut g, "", xi).unwrap();
    g.mark_output(y);
    let prepared = NpuDevice::host().prepare(&g).unwrap();
    let (q, outliers) = p.quantize(x, M);
    let TensorData::F32(mut y) = prepared.execute(&[&TensorData::U8(q)]).unwrap().remove(0) else { panic!("F32 output") };
    lin.finish(&outliers, &mut y).unwrap();
    y
}

/// The weight as the NPU holds it: per-channel INT8, dequantized.
fn int8_weight(w: &Tensor) -> Tensor {
    let wv = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (q, s) = candle_npu::quant::quantize_weight_i8_per_channel(&wv, N, K);
    let d: Vec<f32> = q.iter().enumerate().map(|(i, &q)| q as f32 * s[i / K]).collect();
    Tensor::from_vec(d, (N, K), &Device::Cpu).unwrap()
}

fn float_linear(x: &[f32], w: &Tensor) -> Vec<f32> {
    let x = Tensor::from_slice(x, (M, K), &Device::Cpu).unwrap();
    x.matmul(&w.t().unwrap()).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn a_clip_range_covering_every_value_is_bit_identical_to_the_linear_without_shadow() {
    let (x, w) = data(1);
    let (lo, hi) = x.iter().fold((0f32, 0f32), |(a, b), &v| (a.min(v), b.max(v)));
    // The u8 grid's ends may fall half a step inside the requested range: ask for a bit more.
    let p = InputPoint::new("p", lo * 1.01, hi * 1.01, K, &[]);
    let lin = linear(&w);
    let with_shadow = run(&lin, &p, &x);
    assert_eq!(p.stats().outliers, 0);
    // The same linear as a plain W8A8 graph, its input quantized directly: bit for bit.
    let mut g = Graph::new("plain");
    let xi = g.input("x", &[M, K], DType::U8, Some(p.quant));
    let y = lin.add_to_graph(&mut g, "", xi).unwrap();
    g.mark_output(y);
    let out = NpuDevice::host().prepare(&g).unwrap().execute(&[&TensorData::U8(quantize_u8(&x, p.quant))]).unwrap();
    assert_eq!(out[0], TensorData::F32(with_shadow));
}

#[test]
fn a_zero_width_clip_range_gives_float_activations_times_the_int8_weight() {
    let (x, w) = data(2);
    let p = InputPoint::new("p", 0.0, 0.0, K, &(0..K as u32).collect::<Vec<_>>());
    let mut lin = linear(&w);
    lin.set_hot(&(0..K as u32).collect::<Vec<_>>()).unwrap();
    let got = run(&lin, &p, &x);
    assert_eq!(p.stats().outliers as usize, x.iter().filter(|v| **v != 0.0).count(), "every nonzero value is an outlier");
    // The shadow path multiplies with the INT8 weight's columns (dequantized).
    let want = float_linear(&x, &int8_weight(&w));
    // Every product is computed in f32 on the CPU, summed in another order than the matmul:
    // f32 rounding of K = 64 terms of magnitude <= 12, so 1e-4 absolute.
    let err = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(err < 1e-4, "max abs error {err}");
}

#[test]
fn shadow_recovers_the_clipped_outliers_and_pruning_loses_them() {
    let (x, w) = data(3);
    // A tight range: the two huge channels are outliers, and hot.
    let p = InputPoint::new("p", -1.6, 1.6, K, &[5, 40]);
    let mut lin = linear(&w);
    lin.set_hot(&[5, 40]).unwrap();
    let want = float_linear(&x, &w);
    let err = |y: &[f32]| y.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    let shadow = err(&run(&lin, &p, &x));
    lin.set_shadow(false);
    let pruned = err(&run(&lin, &p, &x));
    // With the shadow: the error of rounding in-range values to 3.2/255 and weights to 1/127 of
    // their row's range (~0.05 here); without: the clipped outliers' products (tens).
    assert!(shadow < 0.1, "with shadow: max abs error {shadow}");
    assert!(pruned > 1.0, "without shadow: max abs error {pruned}");
}

#[test]
fn a_cold_channel_reads_the_same_column_as_a_hot_one() {
    let (x, w) = data(4);
    let p = InputPoint::new("p", -1.6, 1.6, K, &[5]);
    let mut hot = linear(&w);
    hot.set_hot(&[5, 40]).unwrap();
    let mut cold = linear(&w);
    cold.set_hot(&[5]).unwrap();
    assert_eq!(run(&cold, &p, &x), run(&hot, &p, &x));
    assert!(cold.cold_reads() > 0 && hot.cold_reads() == 0);
    assert_eq!(hot.hot_bytes(), 2 * N, "two INT8 columns");
}
