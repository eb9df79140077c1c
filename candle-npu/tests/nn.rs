//! `candle_npu::nn`: a model written against candle-nn, its linears built through an `Npu`,
//! against the same model on candle's CPU: equal while observing, within W8A8's error once frozen,
//! for any row count and input rank.

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Tensor};
use candle_npu::nn::Npu;
use candle_npu::{ClipMethod, NpuDevice, Numerics};
use rand::{Rng, SeedableRng};

const D: usize = 64;
const H: usize = 160;

/// A two-layer MLP over any linear: what a candle user's model looks like.
struct Mlp<L> {
    fc1: L,
    fc2: L,
}

impl<L: Module> Module for Mlp<L> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.gelu()?)
    }
}

fn weights(seed: u64) -> candle_nn::VarBuilder<'static> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut t = |shape: &[usize], scale: f32| {
        let v: Vec<f32> = (0..shape.iter().product()).map(|_| rng.random_range(-scale..scale)).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    };
    let ts = HashMap::from([
        ("fc1.weight".to_string(), t(&[H, D], 0.2)),
        ("fc1.bias".to_string(), t(&[H], 0.1)),
        ("fc2.weight".to_string(), t(&[D, H], 0.15)),
        ("fc2.bias".to_string(), t(&[D], 0.1)),
        ("head.weight".to_string(), t(&[10, D], 0.2)),
        ("head.bias".to_string(), t(&[10], 0.1)),
    ]);
    candle_nn::VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu)
}

/// Activations as after a norm: most channels small, two channels large (the outliers that a
/// clip range leaves to the CPU).
fn input(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let v: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|i| if i % D == 3 || i % D == 41 { rng.random_range(-30.0..30.0) } else { rng.random_range(-1.5..1.5) })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn rel_max_err(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (a.flatten_all().unwrap().to_vec1::<f32>().unwrap(), b.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn check_on(device: NpuDevice) {
    let vb = weights(1);
    let cpu = Mlp { fc1: candle_nn::linear(D, H, vb.pp("fc1")).unwrap(), fc2: candle_nn::linear(H, D, vb.pp("fc2")).unwrap() };
    let npu = Npu::new(device);
    let ours = Mlp { fc1: npu.linear(D, H, vb.pp("fc1")).unwrap(), fc2: npu.linear(H, D, vb.pp("fc2")).unwrap() };
    // Observing: float on the CPU, candle's values (another summation order: 1e-5).
    for seed in 0..4 {
        let x = input(&[3, 40, D], 10 + seed);
        let err = rel_max_err(&ours.forward(&x).unwrap(), &cpu.forward(&x).unwrap());
        assert!(err < 1e-5, "observing: {err}");
    }
    assert!(!ours.fc1.is_frozen());
    npu.freeze(ClipMethod::Budget { fraction: 1e-2 }).unwrap();
    assert!(ours.fc1.is_frozen() && ours.fc2.is_frozen());
    // On the NPU: any row count (one row, a partial chunk, more than a chunk of 256) and rank.
    for shape in [vec![1, D], vec![45, D], vec![2, 150, D]] {
        let x = input(&shape, 99);
        let (got, want) = (ours.forward(&x).unwrap(), cpu.forward(&x).unwrap());
        assert_eq!(got.dims(), want.dims());
        let err = rel_max_err(&got, &want);
        eprintln!("{} {shape:?}: relative max error {err:.2e}", npu.device().executor_name());
        // Two W8A8 layers: u8 activations over the clip range (1/255 of it) and per-channel
        // INT8 weights (1/254 of each row's range), the outliers exact on the CPU. Measured
        // 1.1-1.4% of the largest output on both numerics (the second layer's input, after
        // GELU, is rounded to steps of its whole clip range); 3% leaves room for other seeds.
        assert!(err < 3e-2, "{shape:?}: {err}");
    }
    let stats = ours.fc1.stats().unwrap();
    assert!(stats.outliers > 0 && stats.outliers < stats.elements / 10, "the large channels went to the CPU: {stats:?}");
}

#[test]
fn a_candle_nn_model_on_the_npu_matches_candle_on_the_cpu() {
    check_on(NpuDevice::host());
}

/// The same on the HTP's numerics (the host executor computing as the HTP library does).
#[test]
fn and_on_the_htp_numerics() {
    check_on(NpuDevice::host_with(Numerics::Htp));
}

#[test]
fn misuse_is_an_error_naming_the_layer() {
    let vb = weights(2);
    let npu = Npu::new(NpuDevice::host());
    let fc1 = npu.linear(D, H, vb.pp("fc1")).unwrap();
    let fc2 = npu.linear(H, D, vb.pp("fc2")).unwrap();
    fc1.forward(&input(&[4, D], 1)).unwrap();
    // fc2 has seen nothing: no range to choose, nothing frozen.
    let e = npu.freeze(ClipMethod::Budget { fraction: 1e-2 }).unwrap_err().to_string();
    assert!(e.contains("fc2") && e.contains("observed no input"), "{e}");
    assert!(!fc1.is_frozen());
    let e = fc1.forward(&input(&[4, D + 1], 1)).unwrap_err().to_string();
    assert!(e.contains("fc1") && e.contains("last dimension of 64"), "{e}");
    let e = npu.linear(D, H, vb.pp("absent")).unwrap_err().to_string();
    assert!(e.contains("absent"), "{e}");
    // (An infinite input observed is left out of the range: `non_finite_inputs_...`.)
    // A dropped layer is not waited for.
    drop(fc2);
    npu.freeze(ClipMethod::Budget { fraction: 1e-2 }).unwrap();
    assert!(fc1.is_frozen());
}

/// The Hexagon NPU's library (the x86 emulator `scripts/setup.sh` fetches), or `None`, saying
/// the test is skipped, without it.
fn hexagon() -> Option<NpuDevice> {
    let lib = candle_npu::HtpConfig::default().library_path();
    if !lib.is_file() {
        eprintln!("skipped: no QNN HTP library at {}", lib.display());
        return None;
    }
    Some(NpuDevice::hexagon(candle_npu::HtpConfig::default()).unwrap())
}

/// The same on the Hexagon NPU's library; skipped, saying so, without it.
#[test]
fn and_on_the_hexagon_library() {
    if let Some(device) = hexagon() {
        check_on(device);
    }
}

/// A block's q, k and v projections made together (`Npu::linears`): one graph per size, whose
/// outputs are each projection's as if made alone (the same observed input, the same range and
/// outliers), and within one W8A8 layer's error of candle's CPU.
#[test]
fn linears_of_one_input_run_as_one_graph_and_compute_as_alone() {
    for numerics in [Numerics::Exact, Numerics::Htp] {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut t = |shape: &[usize]| {
            let v: Vec<f32> = (0..shape.iter().product()).map(|_| rng.random_range(-0.2..0.2)).collect();
            Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
        };
        let outs = [("q_proj", H), ("k_proj", 32), ("v_proj", 32)];
        let ts: HashMap<String, Tensor> = outs.iter().map(|&(name, n)| (format!("attn.{name}.weight"), t(&[n, D]))).collect();
        let vb = candle_nn::VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu).pp("attn");
        let cpu: Vec<candle_nn::Linear> = outs.iter().map(|&(name, n)| candle_nn::linear_no_bias(D, n, vb.pp(name)).unwrap()).collect();
        let (together, apart) = (Npu::new(NpuDevice::host_with(numerics)), Npu::new(NpuDevice::host_with(numerics)));
        let qkv = together.linears(D, &outs, false, vb.clone()).unwrap();
        let alone: Vec<_> = outs.iter().map(|&(name, n)| apart.linear_no_bias(D, n, vb.pp(name)).unwrap()).collect();
        for seed in 0..3 {
            let x = input(&[40, D], 20 + seed);
            for ((got, lin), want) in qkv.forward(&x).unwrap().iter().zip(&alone).zip(&cpu) {
                lin.forward(&x).unwrap();
                assert!(rel_max_err(got, &want.forward(&x).unwrap()) < 1e-5, "observing");
            }
        }
        together.freeze(ClipMethod::Budget { fraction: 1e-2 }).unwrap();
        apart.freeze(ClipMethod::Budget { fraction: 1e-2 }).unwrap();
        assert!(qkv.is_frozen());
        let x = input(&[2, 45, D], 77);
        let got = qkv.forward(&x).unwrap();
        assert_eq!(together.device().stats().graphs_prepared, 1, "one graph for the three projections");
        for ((got, lin), want) in got.iter().zip(&alone).zip(&cpu) {
            assert_eq!(got.to_vec3::<f32>().unwrap(), lin.forward(&x).unwrap().to_vec3::<f32>().unwrap(), "{lin:?}: as alone");
            // One W8A8 layer: the 1.1-1.4% of two layers in check_on is the bound's origin.
            let err = rel_max_err(got, &want.forward(&x).unwrap());
            assert!(err < 3e-2, "{lin:?}: {err}");
        }
        assert!(qkv.stats().unwrap().outliers > 0, "the large channels went to the CPU");
        let e = together.linears(D, &[("q_proj", H), ("absent", 8)], false, vb.clone()).unwrap_err().to_string();
        assert!(e.contains("absent"), "{e}");
    }
}

/// A row with a NaN or an infinity: its outputs are NaN (the NPU's u8 grid would make finite
/// garbage of it), the other rows as they were, observing leaves it out of the calibration
/// (MinMax stays finite), and the layer's report counts it.
#[test]
fn non_finite_inputs_come_out_nan_and_are_reported() {
    let vb = weights(3);
    let npu = Npu::new(NpuDevice::host());
    let fc = npu.linear(D, H, vb.pp("fc1")).unwrap();
    let with_bad_row = |seed: u64, bad: f32| {
        let mut v = input(&[6, D], seed).flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v[2 * D + 5] = bad;
        Tensor::from_vec(v, (6, D), &Device::Cpu).unwrap()
    };
    fc.forward(&with_bad_row(1, f32::INFINITY)).unwrap();
    fc.forward(&input(&[6, D], 2)).unwrap();
    assert_eq!(fc.report().non_finite_rows, 1);
    npu.freeze(ClipMethod::MinMax).unwrap();
    let clean = fc.forward(&input(&[6, D], 3)).unwrap().to_vec2::<f32>().unwrap();
    let y = fc.forward(&with_bad_row(3, f32::NAN)).unwrap().to_vec2::<f32>().unwrap();
    for (r, (got, want)) in y.iter().zip(&clean).enumerate() {
        match r {
            2 => assert!(got.iter().all(|v| v.is_nan()), "the NaN row's outputs"),
            _ => assert_eq!(got, want, "row {r}: as without the NaN row"),
        }
    }
    assert_eq!(fc.report(), candle_npu::nn::LayerReport { on_cpu: None, non_finite_rows: 2 });
}

/// A layer the HTP cannot take (a 10-wide head: per-channel W8A8 needs 32 output columns) runs on
/// the host CPU, and its report says why, for a program with no `tracing` subscriber.
#[test]
fn a_layer_the_htp_cannot_take_says_so_in_its_report() {
    let Some(device) = hexagon() else { return };
    let npu = Npu::new(device);
    let vb = weights(4);
    let (head, fc) = (npu.linear(D, 10, vb.pp("head")).unwrap(), npu.linear(D, H, vb.pp("fc1")).unwrap());
    head.forward(&input(&[8, D], 1)).unwrap();
    fc.forward(&input(&[8, D], 1)).unwrap();
    npu.freeze(ClipMethod::Budget { fraction: 1e-2 }).unwrap();
    head.forward(&input(&[8, D], 2)).unwrap();
    fc.forward(&input(&[8, D], 2)).unwrap();
    let why = head.report().on_cpu.expect("the head runs on the CPU");
    assert!(why.contains("head") && why.contains("FullyConnected"), "{why}");
    assert_eq!(fc.report().on_cpu, None);
}
