use super::*;
use crate::outlier::InMemoryWeight;

#[test]
fn a_decode_matrix_is_the_weights_product_in_every_form() {
    // Several rows on every block format and on floats: the product of the dequantized
    // weights with the activations quantized to 8 bits, within 1% of the sum of the absolute
    // terms (8-bit activations are off by at most 1/254 of their block's maximum each), and
    // a wrong row or format is off by far more. The embedding rows are the dequantized rows.
    use candle_core::quantized::QTensor;
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let (m, n, k) = (3, 9, 256);
    let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let wf: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let xt = Tensor::from_slice(&x, (m, k), &Device::Cpu).unwrap();
    let wt = Tensor::from_slice(&wf, (n, k), &Device::Cpu).unwrap();
    let mut forms: Vec<DecodeMatrix> = BlockFormat::ALL
        .iter()
        .map(|f| DecodeMatrix::Blocks(BlockMatrix::from_qtensor(&QTensor::quantize(&wt, f.dtype()).unwrap()).unwrap().unwrap()))
        .collect();
    forms.push(DecodeMatrix::F32(wt.clone()));
    for dm in forms {
        let w: Vec<f32> = match &dm {
            DecodeMatrix::Blocks(b) => b.dequantize().unwrap(),
            DecodeMatrix::F32(t) => t.clone(),
        }
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
        let got: Vec<f32> = dm.forward(&xt).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!((got.len(), dm.dims()), (m * n, (n, k)), "{dm:?}");
        for (i, j) in (0..m).flat_map(|i| (0..n).map(move |j| (i, j))) {
            let terms = (0..k).map(|t| x[i * k + t] * w[j * k + t]);
            let (want, abs): (f32, f32) = terms.fold((0.0, 0.0), |(s, a), v| (s + v, a + v.abs()));
            assert!((got[i * n + j] - want).abs() <= 0.01 * abs, "{dm:?} ({i}, {j}): {} for {want}", got[i * n + j]);
        }
        let rows: Vec<f32> = dm.rows(&[4, 0, 4]).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(rows, [&w[4 * k..5 * k], &w[..k], &w[4 * k..5 * k]].concat(), "{dm:?}");
        assert!(dm.rows(&[n as u32]).is_err(), "{dm:?}: a row past the table");
    }
}

fn weight(n: usize, k: usize) -> Arc<dyn WeightSource> {
    let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * (1.0 + (i / k) as f32)).collect();
    Arc::new(InMemoryWeight { name: "w".into(), w: Arc::new(w), n, k })
}

/// A stage's linears in one kernel call give each linear's own values, bit for bit (biases
/// added), and a stage with a linear off the kernel falls back to one call each.
#[test]
fn forward_all_equals_one_forward_each() {
    let k = 96;
    let lins: Vec<ShadowLinear> = [(70, None), (40, Some(vec![0.5f32; 40])), (130, None)]
        .into_iter()
        .map(|(n, b)| ShadowLinear::new("l", weight(n, k), b, WeightQuant::PerChannel, DecodeWeights::Q8_0).unwrap())
        .collect();
    let x = Tensor::from_vec((0..k).map(|i| (i as f32 * 0.37).sin()).collect::<Vec<f32>>(), (1, k), &Device::Cpu).unwrap();
    let one_each: Vec<Vec<f32>> = lins.iter().map(|l| l.forward(&x).unwrap().flatten_all().unwrap().to_vec1().unwrap()).collect();
    let all: Vec<Vec<f32>> = ShadowLinear::forward_all(&lins, &x).unwrap().iter().map(|y| y.flatten_all().unwrap().to_vec1().unwrap()).collect();
    assert_eq!(all, one_each);
    assert_eq!(one_each[1][0] - 0.5, lins[1].decode.forward(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()[0], "the bias is added");
    // Two rows: each its own product.
    let x2 = Tensor::cat(&[&x, &x], 0).unwrap();
    let ys = ShadowLinear::forward_all(&lins, &x2).unwrap();
    assert_eq!(ys.iter().map(|y| y.dims().to_vec()).collect::<Vec<_>>(), [vec![2, 70], vec![2, 40], vec![2, 130]]);
}

#[test]
fn q8_0_decode_holds_exactly_the_npu_int8_values() {
    let (n, k) = (5, 64);
    let src = weight(n, k);
    for wq in [WeightQuant::PerChannel, WeightQuant::PerTensor] {
        let lin = ShadowLinear::new("l", src.clone(), None, wq, DecodeWeights::Q8_0).unwrap();
        let (want, scales, _) = NpuWeight::quantize(&src.matrix().unwrap(), n, k, wq).unwrap();
        assert!(matches!(lin.npu.int8, Int8::Q8_0(_)), "K = 64 is whole blocks");
        assert_eq!(*lin.npu.values().unwrap(), want);
        // Decode multiplies by those values times the f16-rounded channel scale.
        let x = Tensor::ones((1, k), candle_core::DType::F32, &Device::Cpu).unwrap();
        let got: Vec<f32> = lin.forward(&x).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        for (r, g) in got.iter().enumerate() {
            let s = half::f16::from_f32(scales.row(r)).to_f32();
            let e: f32 = want[r * k..(r + 1) * k].iter().map(|&q| q as f32 * s).sum();
            // candle's Q8_0 kernel quantizes the activations (ones: exact) and sums in f32.
            assert!((g - e).abs() <= 1e-4 * e.abs().max(1.0), "row {r}: {g} vs {e}");
        }
    }
}

/// A float weight that is a block matrix's dequantization, with the blocks (as a GGUF
/// checkpoint's matrices are): `lie` makes its matrix differ from its blocks at one value.
struct BlockSource {
    blocks: BlockMatrix,
    lie: bool,
}

impl WeightSource for BlockSource {
    fn dims(&self) -> (usize, usize) {
        self.blocks.dims()
    }
    fn matrix(&self) -> Result<Vec<f32>> {
        let mut w = self.blocks.dequantize()?.flatten_all()?.to_vec1::<f32>()?;
        if self.lie {
            w[0] += 1.0;
        }
        Ok(w)
    }
    fn describe(&self) -> String {
        "blocks".into()
    }
    fn blocks(&self) -> Result<Option<BlockMatrix>> {
        Ok(Some(self.blocks.clone()))
    }
}

fn block_source(format: BlockFormat, n: usize, k: usize, lie: bool) -> Arc<dyn WeightSource> {
    use candle_core::quantized::QTensor;
    let w =
        Tensor::from_vec((0..n * k).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * (1.0 + (i / k) as f32)).collect::<Vec<f32>>(), (n, k), &Device::Cpu)
            .unwrap();
    let blocks = BlockMatrix::from_qtensor(&QTensor::quantize(&w, format.dtype()).unwrap()).unwrap().unwrap();
    Arc::new(BlockSource { blocks, lie })
}

#[test]
fn checkpoint_decode_holds_no_int8_and_gives_the_same_int8_values() {
    // Every format, both weight quantizations: the INT8 values (all of them for a graph,
    // and any columns) taken from the blocks are those of the float weight quantized at
    // load, to the bit; decode multiplies by the blocks themselves; nothing INT8 is held.
    let (n, k) = (70, 256);
    for format in BlockFormat::ALL {
        for wq in [WeightQuant::PerChannel, WeightQuant::PerTensor] {
            let src = block_source(format, n, k, false);
            let lin = ShadowLinear::new("l", src.clone(), None, wq, DecodeWeights::Checkpoint).unwrap();
            assert!(matches!(lin.npu.int8, Int8::Blocks(_)), "{format:?}");
            let (want, _, _) = NpuWeight::quantize(&src.matrix().unwrap(), n, k, wq).unwrap();
            assert_eq!(*lin.npu.values().unwrap(), want, "{format:?} {wq:?}");
            let cs = [0, 5, 31, 32, 200, 255];
            let cols = lin.npu.columns(&cs, n, k).unwrap();
            for (j, &c) in cs.iter().enumerate() {
                let col: Vec<i8> = (0..n).map(|r| want[r * k + c]).collect();
                assert_eq!(&cols[j * n..][..n], &col[..], "{format:?} {wq:?} column {c}");
            }
            assert_eq!(lin.decode_bytes(), n * format.row_bytes(k), "{format:?}: the blocks only");
            let x = Tensor::ones((1, k), candle_core::DType::F32, &Device::Cpu).unwrap();
            let DecodeMatrix::Blocks(b) = lin.decode() else { panic!("blocks") };
            assert_eq!(lin.forward(&x).unwrap().to_vec2::<f32>().unwrap(), b.forward(&x).unwrap().to_vec2::<f32>().unwrap());
        }
    }
    // Blocks that are not the matrix are refused, not run with two different weights.
    let err = ShadowLinear::new("l", block_source(BlockFormat::Q8_0, n, k, true), None, WeightQuant::PerChannel, DecodeWeights::Checkpoint).unwrap_err();
    assert!(matches!(&err, Error::Internal(m) if m.contains("at [0, 0]")), "{err}");
}

#[test]
fn lpbq_weights_come_from_the_blocks_or_are_held_in_4_bits() {
    // An LPBQ weight is requantized from the file's blocks when needed, as INT8 is (its channel
    // and block scales held): no copy; it gives the LPBQ weight expanded and its columns, and
    // decode still reads the checkpoint's blocks. Without blocks its 4-bit values are held
    // (half the INT8 bytes), with the same values.
    let (n, k) = (70, 256);
    let src = block_source(BlockFormat::Q4_1, n, k, false);
    let want = quantize_weight_lpbq(&src.matrix().unwrap(), n, k, 32).unwrap();
    let expanded = want.expand();
    let cs = [0, 5, k - 1];
    let cols: Vec<i8> = cs.iter().flat_map(|&c| (0..n).map(|r| expanded[r * k + c]).collect::<Vec<_>>()).collect();
    for (decode, bytes) in [(DecodeWeights::Checkpoint, 0), (DecodeWeights::F32, n * k / 2)] {
        let lin = ShadowLinear::new("l", src.clone(), None, WeightQuant::Lpbq { block: 32 }, decode).unwrap();
        assert_eq!(lin.int8_bytes(), bytes, "{decode:?}");
        assert!(matches!((decode, &lin.npu.int8), (DecodeWeights::Checkpoint, Int8::Blocks(_)) | (DecodeWeights::F32, Int8::Nibbles(..))));
        assert_eq!(*lin.npu.values().unwrap(), expanded, "{decode:?}");
        assert_eq!(lin.npu.columns(&cs, n, k).unwrap(), cols, "{decode:?}");
    }
    let lin = ShadowLinear::new("l", src.clone(), None, WeightQuant::Lpbq { block: 32 }, DecodeWeights::Checkpoint).unwrap();
    assert_eq!(lin.row_scales, want.channel_scales);
    assert!(matches!(lin.decode(), DecodeMatrix::Blocks(_)));
    // A block that does not divide the width is an input error naming the linear.
    let err = ShadowLinear::new("l", weight(3, 40), None, WeightQuant::Lpbq { block: 32 }, DecodeWeights::Q8_0).unwrap_err();
    assert!(matches!(&err, Error::Input(m) if m.starts_with("l: LPBQ")), "{err}");
}

/// An LPBQ linear's graph: FullyConnected ops of at most 256 outputs covering every row, each
/// into U16 over a bound no input on the grid passes; on the host it gives the LPBQ weight's
/// product within half a step of each part's grid. From u8 activations the host runs it
/// too (the HTP does not, `Model::load` refuses that plan).
#[test]
fn lpbq_graphs_cut_the_outputs_and_give_the_lpbq_product() {
    use crate::executor::Executor;
    use crate::graph::TensorData;
    let (m, n, k) = (3, 600, 64);
    let src = weight(n, k);
    let lin = ShadowLinear::new("l", src.clone(), None, WeightQuant::Lpbq { block: 32 }, DecodeWeights::Q8_0).unwrap();
    let lpbq = quantize_weight_lpbq(&src.matrix().unwrap(), n, k, 32).unwrap().dequantize();
    let xq = Quant::u16_range(-3.0, 3.0);
    let mut g = Graph::new("lpbq");
    let x = g.input("x", &[m, k], DType::U16, Some(xq));
    let y = lin.add_to_graph(&mut g, "", x).unwrap();
    g.mark_output(y);
    let fcs: Vec<&crate::graph::TensorSpec> = g.ops.iter().filter(|op| matches!(op, Op::FullyConnected { .. })).map(|op| g.tensor(op.output())).collect();
    assert_eq!(fcs.iter().map(|t| t.shape[1]).collect::<Vec<_>>(), [256, 256, 88]);
    let xs: Vec<u16> = (0..m * k).map(|i| (i * 7919 % 65536) as u16).collect();
    let xf: Vec<f32> = xs.iter().map(|&q| (q as f32 + xq.offset as f32) * xq.scale).collect();
    let got = crate::HostExecutor::new().prepare(&g).unwrap().execute(&[&TensorData::U16(xs)]).unwrap().remove(0);
    let TensorData::F32(got) = got else { panic!("an F32 output") };
    for (i, &v) in got.iter().enumerate() {
        let (r, c) = (i / n, i % n);
        let want: f32 = (0..k).map(|j| xf[r * k + j] * lpbq[c * k + j]).sum();
        let step = fcs[c / 256].quant.unwrap().scale;
        assert!((v - want).abs() <= 0.5 * step + 1e-4 * want.abs(), "[{r}, {c}]: {v} against {want} (step {step})");
        // The bound holds every output of the grid's inputs, with room.
        assert!(want.abs() < 32767.0 * step);
    }
}

#[test]
fn a_width_not_in_whole_blocks_keeps_raw_int8() {
    let lin = ShadowLinear::new("l", weight(3, 40), None, WeightQuant::PerChannel, DecodeWeights::Q8_0).unwrap();
    assert!(matches!(lin.npu.int8, Int8::Raw(_)));
    assert_eq!(lin.npu.values().unwrap().len(), 120);
    assert_eq!(lin.forward(&Tensor::zeros((2, 40), candle_core::DType::F32, &Device::Cpu).unwrap()).unwrap().dims(), &[2, 3]);
}

/// `lin`'s graph on u8 input `q` (rows of `k` under `quant`) on the host executor, its
/// packed weight attached: the prepared graph (its packed copy lives with it) and the output.
fn on_host(lin: &ShadowLinear, quant: Quant, q: Vec<u8>, k: usize) -> (PreparedGraph, Vec<f32>) {
    use crate::graph::TensorData;
    let mut g = Graph::new("t");
    let xi = g.input("x", &[q.len() / k, k], DType::U8, Some(quant));
    let y = lin.add_to_graph(&mut g, "", xi).unwrap();
    g.mark_output(y);
    let prepared = crate::NpuDevice::host().prepare(&g).unwrap();
    lin.attach_packed(&prepared);
    let TensorData::F32(y) = prepared.execute(&[&TensorData::U8(q)]).unwrap().remove(0) else { panic!("F32 output") };
    (prepared, y)
}

#[test]
fn cold_columns_read_from_the_host_packed_copy_equal_the_weights() {
    use crate::outlier::InputPoint;
    let (m, n, k) = (9, 70, 64);
    let lin = ShadowLinear::new("l", weight(n, k), None, WeightQuant::PerChannel, DecodeWeights::Q8_0).unwrap();
    // No hot channel: every outlier's column is cold.
    let x: Vec<f32> = (0..m * k).map(|i| if i % 5 == 0 { 40.0 - (i % 80) as f32 } else { 0.01 * (i % 13) as f32 }).collect();
    let p = InputPoint::new("p", -1.0, 1.0, k, &[]);
    let (q, outliers) = p.quantize(&x, m);
    let (prepared, y) = on_host(&lin, p.quant, q, k);
    // While the graph lives, its packed weight is where the columns come from; after, the
    // weight's own Q8_0 blocks.
    let with_packed = prepared.packed_weight(lin.npu_id).and_then(|w| w.columns(&[0])).is_some();
    // Our kernel's panels (this machine's); rten's packing has no column reader.
    assert_eq!(with_packed, matches!(crate::kernels::Int8Kernel::detect(), crate::kernels::Int8Kernel::Own(_)));
    let mut from_packed = y.clone();
    lin.finish(&outliers, &mut from_packed).unwrap();
    drop(prepared);
    assert!(lin.packed.lock().unwrap().upgrade().is_none(), "the packed copy lives with its graphs");
    let mut from_weight = y.clone();
    lin.finish(&outliers, &mut from_weight).unwrap();
    assert!(lin.cold_reads() > 0 && from_packed != y, "the test must add cold outliers");
    assert_eq!(from_packed, from_weight);
}

#[test]
fn a_residual_weight_makes_graphs_and_outliers_about_int16_exact() {
    use crate::outlier::InputPoint;
    let (m, n, k) = (9, 70, 64);
    // One large weight per row: its channel's INT8 step is coarse for the others.
    let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * if i % k == 3 { 40.0 } else { 1.0 }).collect();
    let src: Arc<dyn WeightSource> = Arc::new(InMemoryWeight { name: "w".into(), w: Arc::new(w.clone()), n, k });
    let x: Vec<f32> = (0..m * k).map(|i| if i % 5 == 0 { 40.0 - (i % 80) as f32 } else { 0.01 * (i % 13) as f32 }).collect();
    let p = InputPoint::new("p", -1.0, 1.0, k, &[1, 2]);
    let (q, outliers) = p.quantize(&x, m);
    // The input the NPU and the shadow path stand for: the u8 values, plus the outliers.
    let mut xh: Vec<f32> = q.iter().map(|&v| (v as f32 + p.quant.offset as f32) * p.quant.scale).collect();
    for r in 0..m {
        outliers.row(r).for_each(|(c, v)| xh[r * k + c] += v);
    }
    let want: Vec<f32> = (0..m * n).map(|i| (0..k).map(|c| xh[i / n * k + c] * w[i % n * k + c]).sum()).collect();
    let run = |wq| {
        let mut lin = ShadowLinear::new("l", src.clone(), None, wq, DecodeWeights::Q8_0).unwrap();
        lin.set_hot(&[1, 2]).unwrap();
        let (_graph, mut y) = on_host(&lin, p.quant, q.clone(), k);
        lin.finish(&outliers, &mut y).unwrap();
        y.iter().zip(&want).fold(0f32, |a, (y, w)| a.max((y - w).abs()))
    };
    let (e8, e16) = (run(WeightQuant::PerChannel), run(WeightQuant::PerChannelResidual));
    assert!(!outliers.is_empty() && e8 > 1e-2, "the test must show INT8's error: {e8}");
    assert!(e16 < e8 / 50.0, "residual {e16} against INT8 per channel {e8}");
    // A float graph takes the float weight alone.
    let lin = ShadowLinear::new("l", src.clone(), None, WeightQuant::PerChannelResidual, DecodeWeights::Q8_0).unwrap();
    let mut g = Graph::new("f");
    let xi = g.input("x", &[m, k], DType::F32, None);
    lin.add_to_graph(&mut g, "", xi).unwrap();
    assert_eq!(g.ops.len(), 1);
}

#[test]
fn a_bias_of_the_wrong_length_is_an_error() {
    let e = ShadowLinear::new("l", weight(3, 32), Some(vec![0.0; 4]), WeightQuant::PerChannel, DecodeWeights::Q8_0).unwrap_err();
    assert!(e.to_string().contains("bias has 4 values"), "{e}");
}
