//! Runs graphs on the host CPU with INT8 kernels: the numerical reference for the NPU executors,
//! and the fast path on machines without an NPU.

use super::{ExecutableGraph, Executor};
use crate::error::Result;
use crate::graph::{DType, Graph, Op, Quant, StaticData, TensorData, TensorKind};
use crate::kernels::{matmul_f32, PackedF32, PackedI8};

/// The host executor. It runs every op of the IR.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostExecutor;

impl Executor for HostExecutor {
    fn name(&self) -> &'static str {
        "host"
    }

    fn supports(&self, _graph: &Graph, _op: &Op) -> bool {
        true
    }

    fn prepare(&self, graph: &Graph) -> Result<Box<dyn ExecutableGraph>> {
        graph.validate()?;
        let steps = graph
            .ops
            .iter()
            .map(|op| match *op {
                Op::FullyConnected { input, weight, bias, output } => {
                    let (x, w) = (graph.tensor(input), graph.tensor(weight));
                    let (n, k) = (w.shape[0], w.shape[1]);
                    let bias = bias.map(|b| graph.tensor(b).data.clone().expect("validated constant"));
                    let fc = match w.data.as_ref().expect("validated constant") {
                        StaticData::F32(d) => Fc::F32 { w: PackedF32::new(d, n, k), bias },
                        StaticData::I8(d) => Fc::W8A8 {
                            w: PackedI8::new(d, n, k),
                            x_quant: x.quant.expect("validated"),
                            w_scale: match (&w.channel_scales, w.quant) {
                                (Some(s), _) => WScale::PerChannel(s.to_vec()),
                                (None, q) => WScale::PerTensor(q.expect("validated").scale),
                            },
                            signed_input: x.dtype == DType::I8,
                            bias,
                        },
                        StaticData::I32(_) => unreachable!("validated: weights are F32 or I8"),
                    };
                    Step::Fc { fc, input: input.0, output: output.0, m: x.shape[0] }
                }
                _ => Step::Op(op.clone()),
            })
            .collect();
        // The packed FC weights are the only copy kept: the graph's own weight data is dropped
        // (it would double the resident weights of every prepared graph).
        let mut graph = graph.clone();
        for op in &graph.ops.clone() {
            if let Op::FullyConnected { weight, .. } = op {
                graph.tensors[weight.0].data = None;
            }
        }
        Ok(Box::new(HostGraph { graph, steps }))
    }
}

enum Fc {
    F32 { w: PackedF32, bias: Option<StaticData> },
        /// W8A8 (U8/I8 activations) and W8A16 (U16 activations): I8 weights.
    W8A8 { w: PackedI8, x_quant: Quant, w_scale: WScale, signed_input: bool, bias: Option<StaticData> },
}

enum WScale {
    PerTensor(f32),
    /// One scale per output column.
    PerChannel(Vec<f32>),
}

enum Step {
    Fc { fc: Fc, input: usize, output: usize, m: usize },
    Op(Op),
}

struct HostGraph {
    graph: Graph,
    steps: Vec<Step>,
}

impl HostGraph {
    fn run_fc(&self, fc: &Fc, x: &TensorData, m: usize, out: usize) -> TensorData {
        let spec = &self.graph.tensors[out];
        match fc {
            Fc::F32 { w, bias } => {
                let TensorData::F32(x) = x else { unreachable!("validated") };
                let mut y = w.matmul(x, m);
                if let Some(StaticData::F32(b)) = bias {
                    y.chunks_exact_mut(w.n).for_each(|row| row.iter_mut().zip(b.iter()).for_each(|(v, b)| *v += b));
                }
                TensorData::F32(y)
            }
            Fc::W8A8 { w, x_quant, w_scale, signed_input, bias } => {
                if let TensorData::U16(x) = x {
                    // W8A16 (validated: no bias, F32 output): exact i64 accumulator, scaled once.
                    let acc = w.matmul_u16(x, m, x_quant.offset);
                    let col: Vec<f64> = match w_scale {
                        WScale::PerTensor(s) => vec![x_quant.scale as f64 * *s as f64; w.n],
                        WScale::PerChannel(s) => s.iter().map(|&s| x_quant.scale as f64 * s as f64).collect(),
                    };
                    let y = acc.chunks_exact(w.n).flat_map(|row| row.iter().zip(&col).map(|(&a, &c)| (a as f64 * c) as f32));
                    return TensorData::F32(y.collect());
                }
                // An i8 activation is the u8 one shifted by 128: (q_i8 + off) = (q_i8 + 128) + (off - 128).
                let (xu, off) = match x {
                    TensorData::U8(v) => (std::borrow::Cow::Borrowed(v), x_quant.offset),
                    TensorData::I8(v) if *signed_input => {
                        (std::borrow::Cow::Owned(v.iter().map(|&q| (q as i16 + 128) as u8).collect()), x_quant.offset - 128)
                    }
                    _ => unreachable!("validated"),
                };
                let mut acc = w.matmul_u8(&xu, m, off);
                if let Some(StaticData::I32(b)) = bias {
                    acc.chunks_exact_mut(w.n).for_each(|row| row.iter_mut().zip(b.iter()).for_each(|(v, b)| *v += b));
                }
                match (w_scale, spec.dtype, spec.quant) {
                    // The accumulator itself (QNN SFIXED_POINT_32 with scale s_x * s_w).
                    (WScale::PerTensor(s), DType::I32, Some(q)) if q.offset == 0 && q.scale == x_quant.scale * s => TensorData::I32(acc),
                    (WScale::PerTensor(s), dtype, quant) => {
                        let acc_scale = x_quant.scale * s;
                        let f: Vec<f32> = acc.iter().map(|&a| a as f32 * acc_scale).collect();
                        TensorData::from_f32(&f, dtype, quant)
                    }
                    (WScale::PerChannel(s), dtype, quant) => {
                        let col: Vec<f32> = s.iter().map(|&s| x_quant.scale * s).collect();
                        let f: Vec<f32> = acc.chunks_exact(w.n).flat_map(|row| row.iter().zip(&col).map(|(&a, &c)| a as f32 * c)).collect();
                        TensorData::from_f32(&f, dtype, quant)
                    }
                }
            }
        }
    }
}

impl ExecutableGraph for HostGraph {
    fn execute(&self, inputs: &[&TensorData]) -> Result<Vec<TensorData>> {
        let g = &self.graph;
        let mut vals: Vec<Option<TensorData>> = vec![None; g.tensors.len()];
        for (&id, &data) in g.inputs.iter().zip(inputs) {
            vals[id.0] = Some(data.clone());
        }
        let f32_of = |vals: &[Option<TensorData>], id: usize| -> Vec<f32> {
            let t = &g.tensors[id];
            if t.kind == TensorKind::Static {
                match t.data.as_ref().expect("constant") {
                    StaticData::F32(d) => d.to_vec(),
                    StaticData::I8(d) => TensorData::I8(d.to_vec()).to_f32(t.quant),
                    StaticData::I32(d) => TensorData::I32(d.to_vec()).to_f32(t.quant),
                }
            } else {
                vals[id].as_ref().expect("validated order").to_f32(t.quant)
            }
        };
        for step in &self.steps {
            match step {
                Step::Fc { fc, input, output, m } => {
                    let y = self.run_fc(fc, vals[*input].as_ref().expect("validated order"), *m, *output);
                    vals[*output] = Some(y);
                }
                Step::Op(op) => {
                    let out = op.output().0;
                    let y: Vec<f32> = match *op {
                        Op::Quantize { input, .. } | Op::Dequantize { input, .. } => f32_of(&vals, input.0),
                        Op::Sigmoid { input, .. } => f32_of(&vals, input.0).into_iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect(),
                        Op::Add { a, b, .. } => zip_with(f32_of(&vals, a.0), &f32_of(&vals, b.0), |x, y| x + y),
                        Op::Mul { a, b, .. } => zip_with(f32_of(&vals, a.0), &f32_of(&vals, b.0), |x, y| x * y),
                        Op::MatMul { a, b, transpose_b, .. } => {
                            let (sa, so) = (&g.tensors[a.0].shape, &g.tensors[out].shape);
                            matmul_f32(&f32_of(&vals, a.0), &f32_of(&vals, b.0), sa[0], sa[1], so[1], transpose_b)
                        }
                        Op::FullyConnected { .. } => unreachable!("compiled into Step::Fc"),
                    };
                    let spec = &g.tensors[out];
                    vals[out] = Some(TensorData::from_f32(&y, spec.dtype, spec.quant));
                }
            }
        }
        Ok(g.outputs.iter().map(|o| vals[o.0].take().expect("validated: outputs are produced")).collect())
    }
}

fn zip_with(mut a: Vec<f32>, b: &[f32], f: impl Fn(f32, f32) -> f32) -> Vec<f32> {
    a.iter_mut().zip(b).for_each(|(x, &y)| *x = f(*x, y));
    a
}
