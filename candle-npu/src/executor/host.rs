//! Runs graphs on the host CPU with INT8 kernels: the numerical reference for the NPU executors,
//! and the fast path on machines without an NPU.

use std::borrow::Cow;
use std::sync::{Arc, Mutex, Weak};

use super::htp_numerics::{self, ChannelScales, Numerics};
use super::{ExecutableGraph, Executor};
use crate::error::Result;
use crate::graph::{BlockScales, DType, Graph, Op, Quant, StaticData, TensorData, TensorId, TensorKind};
use crate::kernels::rows::dequantize_row;
use crate::kernels::{matmul_f32, PackedF32, PackedI8};

/// The host executor. It runs every op of the IR, with exact arithmetic (the reference, and the
/// fast path without an NPU) or with the HTP library's ([`Numerics::Htp`], see
/// [`super::htp_numerics`]): the arithmetic of a Hexagon prefill's CPU margin, and of accuracy
/// measured on the NPU's numerics at host speed.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostExecutor {
    numerics: Numerics,
}

impl HostExecutor {
    /// Exact arithmetic.
    pub fn new() -> Self {
        Self::default()
    }

    /// Following `numerics`.
    pub fn with_numerics(numerics: Numerics) -> Self {
        HostExecutor { numerics }
    }

    /// The arithmetic this executor's results follow.
    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    /// Bytes of the INT8 (and LPBQ) weights packed for the graphs alive in this process: the
    /// host's copy of what an NPU would hold in its contexts (each weight once, whatever graphs
    /// share it).
    pub fn packed_bytes() -> usize {
        PACKED.lock().unwrap_or_else(|e| e.into_inner()).iter().filter_map(|(_, p)| p.upgrade()).map(|p| p.bytes()).sum()
    }
}

/// The weights packed so far in this process, by (data identity, n, k, rounded to FP16), held
/// weakly: graphs of several chunk lengths and cache capacities (and every host executor) share
/// one packed copy of a weight whose constant has a [`crate::graph::TensorSpec::data_id`];
/// packing does not depend on the rows, and a copy per graph size would multiply the resident
/// weights (the whole-layer plan prepares a set per capacity). Identities are never reused, so
/// an entry cannot alias other data; dead entries are dropped on the next insertion.
static PACKED: Mutex<Vec<(PackKey, Weak<PackedI8>)>> = Mutex::new(Vec::new());
static PACKED_F32: Mutex<Vec<(PackKey, Weak<PackedF32>)>> = Mutex::new(Vec::new());

/// (data identity, n, k, FP16-rounded) of a packed weight.
type PackKey = (u64, usize, usize, bool);

/// The packed copy of the weight `key` names from `cache`, else `pack()`'s, kept there.
fn shared<T>(cache: &Mutex<Vec<(PackKey, Weak<T>)>>, key: Option<PackKey>, pack: impl FnOnce() -> T) -> Arc<T> {
    let Some(key) = key else { return Arc::new(pack()) };
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = cache.iter().find(|(k, _)| *k == key).and_then(|e| e.1.upgrade()) {
        return p;
    }
    cache.retain(|(_, p)| p.strong_count() > 0);
    let p = Arc::new(pack());
    cache.push((key, Arc::downgrade(&p)));
    p
}

fn pack_i8(d: &[i8], n: usize, k: usize, id: Option<u64>) -> Arc<PackedI8> {
    shared(&PACKED, id.map(|id| (id, n, k, false)), || PackedI8::new(d, n, k))
}

/// An LPBQ weight (its INT8 form `d` and its block scales) packed at half the bytes
/// ([`PackedI8::with_lpbq`]): the same products, as the HTP expands it.
fn pack_lpbq(d: &[i8], n: usize, k: usize, blocks: &BlockScales, id: Option<u64>) -> Arc<PackedI8> {
    shared(&PACKED, id.map(|id| (id, n, k, false)), || PackedI8::with_lpbq(d, n, k, blocks.block, &blocks.scales))
}

impl Executor for HostExecutor {
    fn name(&self) -> &'static str {
        match self.numerics {
            Numerics::Exact => "host",
            Numerics::Htp => "host (HTP numerics)",
        }
    }

    fn supports(&self, _graph: &Graph, _op: &Op) -> bool {
        true
    }

    fn numerics(&self) -> Numerics {
        self.numerics
    }

    fn on_host(&self) -> bool {
        true
    }

    fn prepare(&self, graph: &Graph) -> Result<Box<dyn ExecutableGraph>> {
        graph.validate()?;
        let steps: Vec<Step> = graph
            .ops
            .iter()
            .map(|op| match *op {
                Op::FullyConnected { input, weight, bias, output } => {
                    let (x, w) = (graph.tensor(input), graph.tensor(weight));
                    let (n, k) = (w.shape[0], w.shape[1]);
                    let bias = bias.map(|b| graph.tensor(b).data.clone().expect("validated constant"));
                    let fc = match w.data.as_ref().expect("validated constant") {
                        StaticData::F32(d) => match self.numerics {
                            Numerics::Exact => {
                                Fc::F32 { w: shared(&PACKED_F32, w.data_id.map(|id| (id, n, k, false)), || PackedF32::new(d, n, k)), bias, fp16: false }
                            }
                            // FP16 weights and bias, as the HTP holds them.
                            Numerics::Htp => Fc::F32 {
                                w: shared(&PACKED_F32, w.data_id.map(|id| (id, n, k, true)), || PackedF32::new(&htp_numerics::round_all(d.to_vec()), n, k)),
                                bias: bias.map(|b| match b {
                                    StaticData::F32(b) => StaticData::F32(Arc::new(htp_numerics::round_all(b.to_vec()))),
                                    other => other,
                                }),
                                fp16: true,
                            },
                        },
                        StaticData::I8(d) => Fc::W8A8 {
                            data_id: w.data_id,
                            w: match &w.block_scales {
                                Some(b) => pack_lpbq(d, n, k, b, w.data_id),
                                None => pack_i8(d, n, k, w.data_id),
                            },
                            x_quant: x.quant.expect("validated"),
                            w_scale: match (&w.channel_scales, w.quant) {
                                // The HTP lowering's FP16 channel multiply: F32 outputs of 32 columns
                                // or more (narrower ones the HTP refuses; the device runs those
                                // graphs on the exact host).
                                (Some(s), _) if self.numerics == Numerics::Htp && graph.tensor(output).dtype == DType::F32 && n >= 32 => {
                                    WScale::Htp(ChannelScales::new(x.quant.expect("validated").scale, s))
                                }
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
        let mut last_read = vec![0usize; graph.tensors.len()];
        for (i, step) in steps.iter().enumerate() {
            step.inputs().iter().for_each(|t| last_read[t.0] = i);
        }
        graph.outputs.iter().for_each(|o| last_read[o.0] = usize::MAX);
        Ok(Box::new(HostGraph { graph, steps, htp: self.numerics == Numerics::Htp, last_read }))
    }
}

enum Fc {
    /// `fp16`: inputs and outputs rounded to FP16 (the HTP's float compute).
    F32 { w: Arc<PackedF32>, bias: Option<StaticData>, fp16: bool },
    /// W8A8 (U8/I8 activations) and W8A16 (U16 activations): I8 weights.
    W8A8 { data_id: Option<u64>, w: Arc<PackedI8>, x_quant: Quant, w_scale: WScale, signed_input: bool, bias: Option<StaticData> },
}

enum WScale {
    PerTensor(f32),
    /// One scale per output column.
    PerChannel(Vec<f32>),
    /// Per-column scales applied as the HTP's lowering does ([`Numerics::Htp`], F32 outputs).
    Htp(ChannelScales),
}

enum Step {
    Fc { fc: Fc, input: usize, output: usize, m: usize },
    Op(Op),
}

impl Step {
    /// The tensors the step reads (a FullyConnected's weight and bias are in its `Fc`).
    fn inputs(&self) -> Vec<TensorId> {
        match self {
            Step::Fc { input, .. } => vec![TensorId(*input)],
            Step::Op(op) => op.inputs(),
        }
    }
}

struct HostGraph {
    graph: Graph,
    steps: Vec<Step>,
    htp: bool,
    /// Per tensor, the step after which no step reads it (graph outputs: `usize::MAX`, kept).
    last_read: Vec<usize>,
}

impl HostGraph {
    /// `x_rounded`: `x` already holds FP16 values (an FP16 float FC need not round it again).
    fn run_fc(&self, fc: &Fc, x: &TensorData, x_rounded: bool, m: usize, out: usize) -> TensorData {
        let spec = &self.graph.tensors[out];
        match fc {
            Fc::F32 { w, bias, fp16 } => {
                let TensorData::F32(x) = x else { unreachable!("validated") };
                let mut y = match fp16 & !x_rounded {
                    true => w.matmul(&htp_numerics::round_all(x.clone()), m),
                    false => w.matmul(x, m),
                };
                if let Some(StaticData::F32(b)) = bias {
                    y.chunks_exact_mut(w.n).for_each(|row| row.iter_mut().zip(b.iter()).for_each(|(v, b)| *v += b));
                }
                TensorData::F32(if *fp16 { htp_numerics::round_all(y) } else { y })
            }
            Fc::W8A8 { w, x_quant, w_scale, signed_input, bias, .. } => {
                if let TensorData::U16(x) = x {
                    // W8A16 (validated: no bias; an F32 output, or U16 for LPBQ weights): exact i64
                    // accumulator, scaled once.
                    let acc = w.matmul_u16(x, m, x_quant.offset);
                    let col: Vec<f64> = match w_scale {
                        WScale::PerTensor(s) => vec![x_quant.scale as f64 * *s as f64; w.n],
                        WScale::PerChannel(s) => s.iter().map(|&s| x_quant.scale as f64 * s as f64).collect(),
                        WScale::Htp(scales) => {
                            let mut y = Vec::with_capacity(acc.len());
                            acc.chunks_exact(w.n).for_each(|row| scales.apply_row_i64(row, &mut y));
                            return TensorData::F32(y);
                        }
                    };
                    let y: Vec<f32> = acc.chunks_exact(w.n).flat_map(|row| row.iter().zip(&col).map(|(&a, &c)| (a as f64 * c) as f32)).collect();
                    return match spec.dtype {
                        DType::F32 => TensorData::F32(y),
                        dtype => TensorData::from_f32(&y, dtype, spec.quant),
                    };
                }
                // What each finished accumulator row becomes.
                enum Finish<'a> {
                    /// The accumulator itself (QNN SFIXED_POINT_32 with scale s_x * s_w).
                    Acc,
                    /// f32 values: the accumulator times a scale per column.
                    Scale(Vec<f32>),
                    /// f32 values as the HTP's per-channel lowering computes them.
                    Htp(&'a ChannelScales),
                }
                let finish = match w_scale {
                    WScale::PerTensor(s) if spec.dtype == DType::I32 && spec.quant == Some(Quant { scale: x_quant.scale * s, offset: 0 }) => Finish::Acc,
                    WScale::PerTensor(s) => Finish::Scale(vec![x_quant.scale * s; w.n]),
                    WScale::PerChannel(s) => Finish::Scale(s.iter().map(|&s| x_quant.scale * s).collect()),
                    WScale::Htp(scales) => Finish::Htp(scales),
                };
                // Bias and dequantization on each block of rows as the GEMM finishes it (in cache).
                let bias = match bias {
                    Some(StaticData::I32(b)) => Some(b),
                    _ => None,
                };
                let each = |rows: &mut [i32]| {
                    for row in rows.chunks_exact_mut(w.n) {
                        if let Some(b) = bias {
                            row.iter_mut().zip(b.iter()).for_each(|(v, b)| *v += b);
                        }
                        match &finish {
                            Finish::Acc => {}
                            Finish::Scale(col) => dequantize_row(row, col),
                            Finish::Htp(scales) => scales.apply_row(row),
                        }
                    }
                };
                let acc = match x {
                    TensorData::U8(v) => w.matmul_u8_then(v, m, x_quant.offset, &each),
                    TensorData::I8(v) if *signed_input => w.matmul_i8_then(v, m, x_quant.offset, &each),
                    _ => unreachable!("validated"),
                };
                if matches!(finish, Finish::Acc) {
                    return TensorData::I32(acc);
                }
                let f = dequantized(acc);
                match spec.dtype {
                    DType::F32 => TensorData::F32(f),
                    dtype => TensorData::from_f32(&f, dtype, spec.quant),
                }
            }
        }
    }
}

impl ExecutableGraph for HostGraph {
    fn execute(&self, inputs: &[&TensorData]) -> Result<Vec<TensorData>> {
        self.run(inputs, None)
    }

    /// Graphs of FullyConnected ops only (the model's stage graphs): each output row depends on
    /// its input row alone, and the kernels take the row count per call.
    fn any_rows(&self) -> bool {
        // FullyConnected ops, and Adds of two of their outputs (a residual weight's sum): every
        // tensor then has the row count of the input.
        let fc_outputs: Vec<usize> = self
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Fc { output, .. } => Some(*output),
                _ => None,
            })
            .collect();
        self.steps.iter().all(|s| match s {
            Step::Fc { .. } => true,
            Step::Op(Op::Add { a, b, .. }) => fc_outputs.contains(&a.0) && fc_outputs.contains(&b.0),
            Step::Op(_) => false,
        })
    }

    fn packed_weight(&self, data_id: u64) -> Option<Arc<PackedI8>> {
        self.steps.iter().find_map(|s| match s {
            Step::Fc { fc: Fc::W8A8 { data_id: Some(id), w, .. }, .. } if *id == data_id => Some(w.clone()),
            _ => None,
        })
    }

    fn execute_rows(&self, inputs: &[&TensorData], rows: usize) -> Result<Vec<TensorData>> {
        if !self.any_rows() {
            return Err(crate::Error::Input(format!("graph {}: only FullyConnected graphs (and sums of their outputs) run on any row count", self.graph.name)));
        }
        self.run(inputs, Some(rows))
    }
}

/// A tensor's value while a graph runs: an input borrowed from the caller, or a result (shared:
/// a Reshape's result is its input's value).
#[derive(Clone)]
enum Val<'a> {
    Input(&'a TensorData),
    Result(Arc<TensorData>),
}

impl Val<'_> {
    fn data(&self) -> &TensorData {
        match self {
            Val::Input(d) => d,
            Val::Result(d) => d,
        }
    }
}

impl HostGraph {
    /// Runs the steps; `rows` replaces every FullyConnected's row count (see `execute_rows`).
    /// A value is dropped after its last reader, F32 operands are read in place, and under the
    /// HTP's numerics a value already rounded to FP16 is not rounded again (rounding is
    /// idempotent: the same bits as rounding every operand).
    fn run(&self, inputs: &[&TensorData], rows: Option<usize>) -> Result<Vec<TensorData>> {
        let g = &self.graph;
        let mut vals: Vec<Option<Val>> = vec![None; g.tensors.len()];
        for (&id, &data) in g.inputs.iter().zip(inputs) {
            vals[id.0] = Some(Val::Input(data));
        }
        // Tensors holding FP16 values (an FP16 float op's result under the HTP's numerics): their
        // readers need not round them, and as graph outputs the library converts them.
        let mut fp16_values = vec![false; g.tensors.len()];
        for (i, step) in self.steps.iter().enumerate() {
            let (out, y) = match step {
                Step::Fc { fc, input, output, m } => {
                    let x = vals[*input].as_ref().expect("validated order").data();
                    let y = self.run_fc(fc, x, fp16_values[*input], rows.unwrap_or(*m), *output);
                    // (FP16 values too, but not marked: as a graph output the library's FP16 -> F32
                    // step was never modelled for them, and the stage graphs' proofs stand on that.)
                    fp16_values[*output] = false;
                    (*output, Val::Result(Arc::new(y)))
                }
                Step::Op(op) => {
                    let out = op.output().0;
                    // The HTP's float ops run in FP16: their F32 operands rounded to it, their
                    // F32 result too (see `htp_numerics` for which ops this models).
                    let fp16 = self.htp
                        && op.inputs().iter().chain([&op.output()]).all(|t| g.tensors[t.0].dtype == DType::F32)
                        && htp_numerics::fp16_rounded(op, |t| &g.tensors[t.0].shape);
                    let spec = &g.tensors[out];
                    match *op {
                        // The input's value itself, when it needs no rounding.
                        Op::Reshape { input, .. } if !fp16 || fp16_values[input.0] => {
                            fp16_values[out] = fp16_values[input.0];
                            (out, vals[input.0].clone().expect("validated order"))
                        }
                        _ => {
                            let operand = |id: usize| operand(g, &vals, id, fp16 && !fp16_values[id]);
                            let mut y = op_f32(g, op, operand);
                            if fp16 && spec.dtype == DType::F32 {
                                fp16_values[out] = true;
                                htp_numerics::round_slice(&mut y);
                            }
                            let y = match spec.dtype {
                                DType::F32 => TensorData::F32(y),
                                dtype => TensorData::from_f32(&y, dtype, spec.quant),
                            };
                            (out, Val::Result(Arc::new(y)))
                        }
                    }
                }
            };
            vals[out] = Some(y);
            for t in step.inputs() {
                if self.last_read[t.0] == i {
                    vals[t.0] = None;
                }
            }
        }
        Ok(g.outputs
            .iter()
            .map(|o| {
                let v = match vals[o.0].take().expect("validated: outputs are produced") {
                    Val::Input(d) => d.clone(),
                    Val::Result(d) => Arc::try_unwrap(d).unwrap_or_else(|d| (*d).clone()),
                };
                match (fp16_values[o.0], v) {
                    // The library's FP16 -> F32 output conversion.
                    (true, TensorData::F32(v)) => TensorData::F32(htp_numerics::fp16_output(v)),
                    (_, v) => v,
                }
            })
            .collect())
    }
}

/// Tensor `id`'s values as f32: an F32 value or constant in place, a quantized one dequantized;
/// `round`: rounded to FP16 (a copy).
fn operand<'v>(g: &'v Graph, vals: &'v [Option<Val>], id: usize, round: bool) -> Cow<'v, [f32]> {
    let t = &g.tensors[id];
    let v: Cow<[f32]> = if t.kind == TensorKind::Static {
        match t.data.as_ref().expect("constant") {
            StaticData::F32(d) => Cow::Borrowed(&d[..]),
            StaticData::I8(d) => Cow::Owned(TensorData::I8(d.to_vec()).to_f32(t.quant)),
            StaticData::I32(d) => Cow::Owned(TensorData::I32(d.to_vec()).to_f32(t.quant)),
        }
    } else {
        match vals[id].as_ref().expect("validated order").data() {
            TensorData::F32(d) => Cow::Borrowed(&d[..]),
            other => Cow::Owned(other.to_f32(t.quant)),
        }
    };
    match round {
        true => {
            let mut v = v.into_owned();
            htp_numerics::round_slice(&mut v);
            Cow::Owned(v)
        }
        false => v,
    }
}

/// The f32 result of a non-FullyConnected op on its operands' values (`x(id)`).
fn op_f32<'v>(g: &Graph, op: &Op, x: impl Fn(usize) -> Cow<'v, [f32]>) -> Vec<f32> {
    let out = op.output().0;
    match *op {
        Op::Quantize { input, .. } | Op::Dequantize { input, .. } | Op::Reshape { input, .. } => x(input.0).into_owned(),
        Op::Sigmoid { input, .. } => x(input.0).iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect(),
        Op::Softmax { input, .. } => {
            let mut y = x(input.0).into_owned();
            let n = *g.tensors[input.0].shape.last().expect("validated: rank >= 1");
            // Attention's own softmax kernel, then the division it defers.
            y.chunks_mut(n.max(1)).for_each(|row| {
                let sum = crate::kernels::rows::softmax_numerators(row, 1.0);
                row.iter_mut().for_each(|v| *v /= sum);
            });
            y
        }
        Op::Add { a, b, .. } | Op::Mul { a, b, .. } => {
            // (Under the HTP's numerics an equal-shape F32 sum is `fp16`: its operands and
            // result rounded around an exact sum.)
            let (sa, sb) = (&g.tensors[a.0].shape, &g.tensors[b.0].shape);
            match op {
                Op::Mul { .. } => broadcast_with(&x(a.0), sa, &x(b.0), sb, &g.tensors[out].shape, |x, y| x * y),
                _ => broadcast_with(&x(a.0), sa, &x(b.0), sb, &g.tensors[out].shape, |x, y| x + y),
            }
        }
        Op::RmsNorm { input, gamma, epsilon, .. } => {
            let (mut y, w) = (x(input.0).into_owned(), x(gamma.0));
            // (An empty last axis has nothing to normalize.)
            y.chunks_mut(w.len().max(1)).for_each(|row| {
                let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32 + epsilon).sqrt();
                row.iter_mut().zip(w.iter()).for_each(|(v, g)| *v *= inv * g);
            });
            y
        }
        Op::Clamp { input, lo, hi, .. } => x(input.0).iter().map(|v| v.clamp(lo, hi)).collect(),
        Op::Transpose { input, ref perm, .. } => transpose(&x(input.0), &g.tensors[input.0].shape, perm),
        Op::Concat { a, b, axis, .. } => {
            // Row-major: `outer` blocks, each `a`'s then `b`'s slab of the axis.
            let outer: usize = g.tensors[out].shape[..axis].iter().product();
            let (av, bv) = (x(a.0), x(b.0));
            let (ka, kb) = (av.len() / outer.max(1), bv.len() / outer.max(1));
            let mut y = Vec::with_capacity(av.len() + bv.len());
            for i in 0..outer {
                y.extend_from_slice(&av[i * ka..][..ka]);
                y.extend_from_slice(&bv[i * kb..][..kb]);
            }
            y
        }
        Op::MatMul { a, b, transpose_b, .. } => {
            // Batch by batch (validated: one batch dimension at most, equal on both).
            let (sa, so) = (&g.tensors[a.0].shape, &g.tensors[out].shape);
            let r = sa.len();
            let (m, k, n) = (sa[r - 2], sa[r - 1], so[r - 1]);
            let (av, bv) = (x(a.0), x(b.0));
            let batches: usize = so[..r - 2].iter().product();
            let mut y = Vec::with_capacity(batches * m * n);
            for i in 0..batches {
                y.extend(matmul_f32(&av[i * m * k..][..m * k], &bv[i * k * n..][..k * n], m, k, n, transpose_b));
            }
            y
        }
        Op::FullyConnected { .. } => unreachable!("compiled into Step::Fc"),
    }
}

/// The accumulators' allocation as the f32 values `each` wrote into it ([`dequantize_row`]
/// rewrites every i32 as an f32's bits): the stage outputs are the largest buffers of a
/// prefill, and a second one per GEMM would be written once and freed.
fn dequantized(acc: Vec<i32>) -> Vec<f32> {
    let mut acc = std::mem::ManuallyDrop::new(acc);
    // SAFETY: same allocation, length and capacity, reinterpreted between two 4-byte plain types
    // of equal alignment; every element was rewritten as an f32's bits (the GEMM runs `each` on
    // every row).
    unsafe { Vec::from_raw_parts(acc.as_mut_ptr().cast::<f32>(), acc.len(), acc.capacity()) }
}

/// `f(a, b)` elementwise over the broadcast shape `out` (validated: `a` and `b` broadcast to it),
/// a contiguous run of the output at a time.
fn broadcast_with(a: &[f32], sa: &[usize], b: &[f32], sb: &[usize], out: &[usize], f: impl Fn(f32, f32) -> f32) -> Vec<f32> {
    if sa == sb {
        return a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect();
    }
    // Each operand's stride per output axis, 0 where it is broadcast (missing or 1).
    let strides = |s: &[usize]| -> Vec<usize> {
        let mut st = vec![0; out.len()];
        let mut step = 1;
        for i in (0..s.len()).rev() {
            let j = i + out.len() - s.len();
            st[j] = if s[i] == 1 { 0 } else { step };
            step *= s[i];
        }
        st
    };
    let (dims, [st_a, st_b]) = merged(out, [strides(sa), strides(sb)]);
    let (inner, (ia, ib)) = (*dims.last().unwrap_or(&1), (*st_a.last().unwrap_or(&0), *st_b.last().unwrap_or(&0)));
    let mut y = Vec::with_capacity(out.iter().product());
    walk(&dims[..dims.len().saturating_sub(1)], [&st_a, &st_b], |oa, ob| match (ia, ib) {
        (1, 1) => y.extend(a[oa..][..inner].iter().zip(&b[ob..][..inner]).map(|(&x, &v)| f(x, v))),
        (1, 0) => y.extend(a[oa..][..inner].iter().map(|&x| f(x, b[ob]))),
        (0, 1) => y.extend(b[ob..][..inner].iter().map(|&v| f(a[oa], v))),
        _ => y.extend((0..inner).map(|j| f(a[oa + j * ia], b[ob + j * ib]))),
    });
    y
}

/// `dims` with adjacent axes merged where both operands step through them as one (each stride
/// the next axis' stride times its size), so that the last axis is the longest run an inner loop
/// can take.
fn merged(dims: &[usize], strides: [Vec<usize>; 2]) -> (Vec<usize>, [Vec<usize>; 2]) {
    let (mut d, mut s): (Vec<usize>, [Vec<usize>; 2]) = (Vec::new(), [Vec::new(), Vec::new()]);
    for (i, &n) in dims.iter().enumerate() {
        if n == 1 {
            continue;
        }
        let joins = !d.is_empty() && (0..2).all(|o| s[o][s[o].len() - 1] == strides[o][i] * n);
        if joins {
            *d.last_mut().expect("not empty") *= n;
            (0..2).for_each(|o| *s[o].last_mut().expect("not empty") = strides[o][i]);
        } else {
            d.push(n);
            (0..2).for_each(|o| s[o].push(strides[o][i]));
        }
    }
    (d, s)
}

/// `x` of shape `shape` with its axes permuted: output axis `i` is input axis `perm[i]`.
fn transpose(x: &[f32], shape: &[usize], perm: &[usize]) -> Vec<f32> {
    let mut stride = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        stride[i] = stride[i + 1] * shape[i + 1];
    }
    let (dims, steps): (Vec<usize>, Vec<usize>) = perm.iter().map(|&p| (shape[p], stride[p])).unzip();
    let (dims, [steps, _]) = merged(&dims, [steps.clone(), steps]);
    let (inner, step) = (*dims.last().unwrap_or(&1), *steps.last().unwrap_or(&1));
    let mut y = Vec::with_capacity(x.len());
    walk(&dims[..dims.len().saturating_sub(1)], [&steps, &steps], |at, _| match step {
        1 => y.extend_from_slice(&x[at..][..inner]),
        _ => y.extend((0..inner).map(|j| x[at + j * step])),
    });
    y
}

/// Calls `f` with two operands' offsets at each index of `dims`, in row-major order: an
/// odometer over the index moving each offset by its operand's stride per axis (`strides` may
/// hold more axes than `dims`: the first `dims.len()` are used).
fn walk(dims: &[usize], strides: [&[usize]; 2], mut f: impl FnMut(usize, usize)) {
    let n: usize = dims.iter().product();
    let mut idx = vec![0usize; dims.len()];
    let mut at = [0usize; 2];
    for _ in 0..n {
        f(at[0], at[1]);
        for d in (0..dims.len()).rev() {
            idx[d] += 1;
            at.iter_mut().zip(strides).for_each(|(o, s)| *o += s[d]);
            if idx[d] < dims[d] {
                break;
            }
            at.iter_mut().zip(strides).for_each(|(o, s)| *o -= s[d] * dims[d]);
            idx[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::next_data_id;

    /// `x [m, 16] (u8) -> FullyConnected(w [8, 16], per channel) -> y [m, 8] (f32)`.
    fn fc(m: usize, w: &Arc<Vec<i8>>, data_id: Option<u64>) -> Graph {
        let mut g = Graph::new(format!("fc.m{m}"));
        let x = g.input("x", &[m, 16], DType::U8, Some(Quant::u8_range(-1.0, 1.0)));
        let wt = g.constant_per_channel("w", &[8, 16], w.clone(), Arc::new(vec![0.01; 8]));
        if let Some(id) = data_id {
            g.set_data_id(wt, id);
        }
        let y = g.fully_connected("fc", x, wt, None, DType::F32, None);
        g.mark_output(y);
        g
    }

    /// Element `i` of a row-major tensor of shape `out` read from an operand of shape `s`
    /// broadcast to it: the index arithmetic written out, one element at a time.
    fn at(i: usize, out: &[usize], s: &[usize]) -> usize {
        let (mut rest, mut off, mut step) = (i, 0, 1);
        for j in (0..out.len()).rev() {
            let (n, k) = (out[j], (rest % out[j]));
            rest /= n;
            if let Some(&d) = (j + s.len()).checked_sub(out.len()).and_then(|t| s.get(t)) {
                off += if d == 1 { 0 } else { k * step };
                step *= d;
            }
        }
        off
    }

    /// The run-at-a-time broadcast and transpose against one element at a time, on the shapes
    /// the whole-layer graphs use (a mask over heads, RoPE tables over heads, a scalar) and others.
    #[test]
    fn broadcast_and_transpose_follow_the_index_arithmetic() {
        let vals = |n: usize| (0..n).map(|i| (i as f32 * 0.37).sin()).collect::<Vec<f32>>();
        for (sa, sb) in [
            (vec![3, 3, 8, 24], vec![8, 24]),
            (vec![8, 9, 64], vec![8, 1, 64]),
            (vec![5, 7], vec![1]),
            (vec![1, 7], vec![5, 1]),
            (vec![2, 1, 4, 1], vec![3, 1, 5]),
            (vec![6], vec![6]),
        ] {
            let r = sa.len().max(sb.len());
            let pad = |s: &Vec<usize>| [vec![1; r - s.len()], s.clone()].concat();
            let out: Vec<usize> = pad(&sa).iter().zip(pad(&sb)).map(|(&x, y)| x.max(y)).collect();
            let (a, b) = (vals(sa.iter().product()), vals(sb.iter().product::<usize>() + 3)[3..].to_vec());
            let want: Vec<f32> = (0..out.iter().product()).map(|i| a[at(i, &out, &sa)] * 2.0 + b[at(i, &out, &sb)]).collect();
            assert_eq!(broadcast_with(&a, &sa, &b, &sb, &out, |x, y| x * 2.0 + y), want, "{sa:?} with {sb:?}");
        }
        for (shape, perm) in [
            (vec![8, 3, 3, 16], vec![1, 2, 0, 3]),
            (vec![3, 3, 8, 16], vec![2, 0, 1, 3]),
            (vec![8, 3, 16], vec![1, 0, 2]),
            (vec![4, 5], vec![1, 0]),
            (vec![2, 3, 4], vec![2, 1, 0]),
        ] {
            let x = vals(shape.iter().product());
            let dims: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
            let want: Vec<f32> = (0..x.len())
                .map(|i| {
                    // Output index -> input index.
                    let (mut rest, mut idx) = (i, vec![0; dims.len()]);
                    for j in (0..dims.len()).rev() {
                        idx[perm[j]] = rest % dims[j];
                        rest /= dims[j];
                    }
                    x[idx.iter().zip(&shape).fold(0, |o, (&k, &n)| o * n + k)]
                })
                .collect();
            assert_eq!(transpose(&x, &shape, &perm), want, "{shape:?} by {perm:?}");
        }
    }

    fn holders(id: u64) -> usize {
        PACKED.lock().unwrap().iter().filter(|(key, _)| key.0 == id).map(|(_, p)| p.strong_count()).sum()
    }

    #[test]
    fn graphs_of_two_row_counts_share_one_packed_weight() {
        let w = Arc::new((0..8 * 16).map(|i| (i * 37 % 255) as i8).collect::<Vec<i8>>());
        let id = next_data_id();
        let small = HostExecutor::new().prepare(&fc(4, &w, Some(id))).unwrap();
        let large = HostExecutor::new().prepare(&fc(8, &w, Some(id))).unwrap();
        assert_eq!(holders(id), 2, "one packed copy held by both graphs");
        // Same rows, same results, whichever graph runs them.
        let x: Vec<u8> = (0..8 * 16).map(|i| (i * 11 % 256) as u8).collect();
        let a = small.execute(&[&TensorData::U8(x[..4 * 16].to_vec())]).unwrap();
        let b = large.execute(&[&TensorData::U8(x.clone())]).unwrap();
        let (TensorData::F32(a), TensorData::F32(b)) = (&a[0], &b[0]) else { panic!("f32 outputs") };
        assert_eq!(a[..], b[..4 * 8]);
        // The 8-row graph on 3 rows: the same rows again.
        assert!(large.any_rows());
        let c = large.execute_rows(&[&TensorData::U8(x[..3 * 16].to_vec())], 3).unwrap();
        assert_eq!(c[0], TensorData::F32(b[..3 * 8].to_vec()));
        drop((small, large));
        assert_eq!(holders(id), 0, "the packed copy goes with its last graph");
        // Without an identity nothing is cached.
        let _g = HostExecutor::new().prepare(&fc(4, &w, None)).unwrap();
        assert_eq!(holders(id), 0);
    }

    /// A residual weight's stage graph (two FullyConnected ops and the Add of their outputs)
    /// runs on any row count, as a margin needs; an Add of anything else does not.
    #[test]
    fn sums_of_fully_connected_outputs_run_on_any_row_count() {
        let w = Arc::new((0..8 * 16).map(|i| (i * 37 % 255) as i8).collect::<Vec<i8>>());
        let sum_graph = |with_constant: bool| {
            let mut g = Graph::new("sum.m8");
            let x = g.input("x", &[8, 16], DType::U8, Some(Quant::u8_range(-1.0, 1.0)));
            let w1 = g.constant_per_channel("w1", &[8, 16], w.clone(), Arc::new(vec![0.01; 8]));
            let w2 = g.constant_per_channel("w2", &[8, 16], w.clone(), Arc::new(vec![0.0001; 8]));
            let y1 = g.fully_connected("fc1", x, w1, None, DType::F32, None);
            let y2 = match with_constant {
                false => g.fully_connected("fc2", x, w2, None, DType::F32, None),
                true => g.constant("c", &[8, 8], StaticData::F32(Arc::new(vec![1.0; 64])), None),
            };
            let y = g.binary("sum", y1, y2, DType::F32, None, |a, b, output| Op::Add { a, b, output });
            g.mark_output(y);
            HostExecutor::with_numerics(Numerics::Htp).prepare(&g).unwrap()
        };
        let g = sum_graph(false);
        assert!(g.any_rows());
        let x: Vec<u8> = (0..8 * 16).map(|i| (i * 11 % 256) as u8).collect();
        let all = g.execute(&[&TensorData::U8(x.clone())]).unwrap();
        let TensorData::F32(all) = &all[0] else { panic!("f32 output") };
        assert_eq!(g.execute_rows(&[&TensorData::U8(x[..3 * 16].to_vec())], 3).unwrap()[0], TensorData::F32(all[..3 * 8].to_vec()));
        let g = sum_graph(true);
        assert!(!g.any_rows());
        assert!(g.execute_rows(&[&TensorData::U8(x[..3 * 16].to_vec())], 3).is_err());
    }
}
