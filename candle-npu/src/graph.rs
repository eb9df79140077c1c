//! The static graph description every executor compiles.
//!
//! NPU graphs are static: every tensor has a fixed shape and fixed quantization parameters, and
//! weights are baked in. The op set is the small one a decoder block's NPU stages need. The
//! quantization convention is QNN's, `float = (q + offset) * scale` (so `offset` is the *negated*
//! zero point), so that the Hexagon executor is a translation of this IR, not a reinterpretation.

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};

mod data;
pub use data::{check_buffer, check_input_count, TensorData};
#[cfg(test)]
use data::{quantize_one, quantize_u16};

/// Element type of a graph tensor. Quantized types carry a [`Quant`] in their [`TensorSpec`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    /// 32-bit float, unquantized: float passthrough graphs, and the float side of Quantize /
    /// Dequantize.
    F32,
    /// Unsigned 8-bit fixed point (QNN UFIXED_POINT_8): activations.
    U8,
    /// Unsigned 16-bit fixed point (QNN UFIXED_POINT_16): W8A16 activations.
    U16,
    /// Signed 8-bit fixed point (QNN SFIXED_POINT_8): symmetric weights.
    I8,
    /// Signed 32-bit fixed point (QNN SFIXED_POINT_32): biases and accumulators.
    I32,
}

impl DType {
    /// Every type but F32: a tensor of it needs a [`Quant`] (or per-channel scales).
    pub fn is_quantized(self) -> bool {
        !matches!(self, DType::F32)
    }
    /// Bytes per element: 4 for F32 and I32, 2 for U16, 1 for U8 and I8.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::U16 => 2,
            DType::U8 | DType::I8 => 1,
        }
    }
}

/// Per-tensor affine quantization, QNN's convention: `float = (q + offset) * scale`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Quant {
    /// Float value of one quantization step; finite and > 0 in a validated graph.
    pub scale: f32,
    /// Added to the stored integer before scaling: the *negated* zero point, 0 for symmetric
    /// tensors.
    pub offset: i32,
}

impl Quant {
    /// Symmetric quantization (offset 0), as used for weights, biases and accumulators.
    pub fn symmetric(scale: f32) -> Self {
        Quant { scale, offset: 0 }
    }

    /// Asymmetric u8 quantization covering `[min, max]` (widened to include 0 so that zero, and
    /// hence padding, is exact).
    pub fn u8_range(min: f32, max: f32) -> Self {
        let (min, max) = (min.min(0.0), max.max(0.0));
        let scale = if max > min { (max - min) / 255.0 } else { 1.0 };
        let zero_point = (-min / scale).round().clamp(0.0, 255.0) as i32;
        Quant { scale, offset: -zero_point }
    }

    /// Asymmetric u16 quantization covering `[min, max]` (widened to include 0).
    pub fn u16_range(min: f32, max: f32) -> Self {
        let (min, max) = (min.min(0.0), max.max(0.0));
        let scale = if max > min { (max - min) / 65535.0 } else { 1.0 };
        let zero_point = (-min / scale).round().clamp(0.0, 65535.0) as i32;
        Quant { scale, offset: -zero_point }
    }

    /// Range of floats this quantization represents for a given storage type.
    pub fn float_range(&self, dtype: DType) -> (f32, f32) {
        let (lo, hi) = dtype_int_range(dtype);
        ((lo as f32 + self.offset as f32) * self.scale, (hi as f32 + self.offset as f32) * self.scale)
    }
}

fn dtype_int_range(dtype: DType) -> (i64, i64) {
    match dtype {
        DType::U8 => (0, 255),
        DType::U16 => (0, 65535),
        DType::I8 => (-128, 127),
        DType::I32 => (i32::MIN as i64, i32::MAX as i64),
        DType::F32 => (0, 0),
    }
}

/// How a tensor takes part in a graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorKind {
    /// Written by the caller before each execution.
    Input,
    /// Read by the caller after each execution.
    Output,
    /// Produced and consumed inside the graph.
    Intermediate,
    /// Constant data baked into the graph (weights, biases).
    Static,
}

/// Constant tensor contents.
#[derive(Debug, Clone)]
pub enum StaticData {
    /// Float weights and biases (float passthrough graphs).
    F32(Arc<Vec<f32>>),
    /// INT8 weights, quantized per tensor or per output channel ([`TensorSpec::channel_scales`]).
    I8(Arc<Vec<i8>>),
    /// INT32 biases of W8A8 FullyConnected ops (scale `s_in * s_w`, offset 0).
    I32(Arc<Vec<i32>>),
}

impl StaticData {
    /// Number of elements (not bytes).
    pub fn len(&self) -> usize {
        match self {
            StaticData::F32(v) => v.len(),
            StaticData::I8(v) => v.len(),
            StaticData::I32(v) => v.len(),
        }
    }
    /// Whether the data has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The [`DType`] a constant holding this data must have ([`Graph::validate`] checks).
    pub fn dtype(&self) -> DType {
        match self {
            StaticData::F32(_) => DType::F32,
            StaticData::I8(_) => DType::I8,
            StaticData::I32(_) => DType::I32,
        }
    }
}

/// The block scales of an LPBQ weight `[N, K]` ([`TensorSpec::block_scales`]).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockScales {
    /// Inputs per block (a divisor of `K`).
    pub block: usize,
    /// `[N, K / block]`, each in 1..=15 (4 bits: the HTP expands `value * scale` into 8 bits).
    pub scales: Vec<u8>,
}

impl BlockScales {
    /// The scale of value `i` (row-major) of a weight `[N, k]`.
    pub fn of(&self, i: usize, k: usize) -> u8 {
        self.scales[(i / k) * (k / self.block) + (i % k) / self.block]
    }
}

/// A fresh process-unique identity for constant data ([`Graph::set_data_id`]).
pub fn next_data_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// One tensor of a [`Graph`]: name, fixed shape, type, quantization, role, and a constant's data.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    /// For errors, logs and profiles; need not be unique (executors name tensors by id too).
    pub name: String,
    /// Dimensions, outermost first (data is row-major); static, as every NPU graph's are.
    pub shape: Vec<usize>,
    /// Element type; a quantized one needs `quant` or `channel_scales`.
    pub dtype: DType,
    /// Per-tensor scale and offset: required for a quantized type unless `channel_scales` is set;
    /// `None` for F32.
    pub quant: Option<Quant>,
    /// Who writes the tensor and when: the caller, an op, or nobody (a constant).
    pub kind: TensorKind,
    /// The contents of a [`TensorKind::Static`] tensor, of its `dtype` and element count; `None`
    /// for every other kind.
    pub data: Option<StaticData>,
    /// Per-channel symmetric scales along axis 0 (QNN AXIS_SCALE_OFFSET, offsets 0), one per
    /// output channel of an I8 weight `[N, K]`; `quant` is `None` then. Per-channel weights keep
    /// each output row's own range: measured on SmolLM2, per-tensor INT8 weights raise perplexity
    /// by 6.8%, per-channel by 0.35%.
    pub channel_scales: Option<Arc<Vec<f32>>>,
    /// LPBQ (QNN's BLOCKWISE_EXPANSION) of a per-channel I8 weight: `data` holds the INT8 values
    /// the HTP computes with, each a 4-bit value times its block's 4-bit scale
    /// ([`crate::quant::Lpbq::expand`]); the HTP is given the 4-bit values and these scales, half
    /// the bytes. Every executor computes the same INT8 weight; only the HTP's encoding differs.
    pub block_scales: Option<Arc<BlockScales>>,
    /// A process-unique identity of a constant's data (see [`Graph::set_data_id`]): an executor
    /// that transforms constants (the host packs INT8 weights for its GEMM) keeps one transformed
    /// copy per identity, shared by every graph that uses it, whatever the graph's row count.
    /// Not in the fingerprint (the data is).
    pub data_id: Option<u64>,
}

impl TensorSpec {
    /// Number of elements: the product of the shape (1 for the scalar shape `[]`).
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }
    /// Bytes of the tensor's buffer: elements times the element size.
    pub fn size_in_bytes(&self) -> usize {
        self.elem_count() * self.dtype.size_in_bytes()
    }
}

impl fmt::Display for TensorSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{:?}{:?}", self.name, self.dtype, self.shape)
    }
}

/// The largest tensor a graph may hold: QNN's sizes are 32-bit, and beyond it a shape is damage
/// (an executor would try to allocate it).
pub const MAX_TENSOR_BYTES: usize = u32::MAX as usize;

/// Index of a tensor in its [`Graph`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorId(pub usize);

/// The op set. Elementwise ops on quantized tensors are defined as: dequantize the inputs,
/// compute in float, quantize to the output's parameters (what QNN's HTP does, up to rounding).
#[derive(Debug, Clone)]
pub enum Op {
    /// `out[m, n] = sum_k in[m, k] * weight[n, k] + bias[n]`; weight is `[N, K]` (QNN layout).
    /// W8A8: input U8 (or I8), weight I8 symmetric, bias I32 with scale `s_in * s_w`.
    /// Float passthrough: all F32.
    FullyConnected {
        /// Activation `[M, K]`: F32, U8 or I8 (W8A8), or U16 (W8A16).
        input: TensorId,
        /// Constant `[N, K]`: F32, or I8 symmetric (per tensor, or per output channel).
        weight: TensorId,
        /// Constant `[N]` added to every row; not with per-channel weights or W8A16.
        bias: Option<TensorId>,
        /// Result `[M, N]`.
        output: TensorId,
    },
    /// `out = a @ b` or `a @ b^T`, both dynamic; rank 3 multiplies batch by batch (attention's
    /// KV heads, each with its group's query rows stacked).
    MatMul {
        /// Left operand `[M, K]`, or `[B, M, K]`.
        a: TensorId,
        /// Right operand: `[K, N]`, or `[N, K]` when `transpose_b`; `[B, ..]` with a batched `a`.
        b: TensorId,
        /// Multiply by `b^T`: a row-major `[N, K]` operand is used without a transposed copy.
        transpose_b: bool,
        /// Result `[M, N]`, or `[B, M, N]`.
        output: TensorId,
    },
    /// F32 -> quantized.
    Quantize {
        /// F32 values.
        input: TensorId,
        /// Quantized result: its type and [`Quant`] define the grid (round to nearest, saturate).
        output: TensorId,
    },
    /// Quantized -> F32.
    Dequantize {
        /// Quantized values, read under their own [`Quant`].
        input: TensorId,
        /// F32 result.
        output: TensorId,
    },
    /// Elementwise `a + b`, the operands broadcast as numpy does ([`broadcast_shape`]): a
    /// mask `[rows, keys]` over every head's scores, a bias `[N]` over every row.
    Add {
        /// Left operand.
        a: TensorId,
        /// Right operand, of `a`'s shape or broadcast against it.
        b: TensorId,
        /// The sum, of the broadcast shape.
        output: TensorId,
    },
    /// Elementwise `a * b`, broadcast as [`Op::Add`] (RoPE's `[rows, 1, head_dim]` tables over
    /// every head, a norm's weight over every row).
    Mul {
        /// Left operand.
        a: TensorId,
        /// Right operand, of `a`'s shape or broadcast against it.
        b: TensorId,
        /// The product, of the broadcast shape.
        output: TensorId,
    },
    /// Elementwise `1 / (1 + exp(-x))`.
    Sigmoid {
        /// Operand.
        input: TensorId,
        /// Result, of the input's shape.
        output: TensorId,
    },
    /// `exp(x - max) / sum(exp(x - max))` along the last axis: attention's weights from its
    /// masked scores (a masked score is a large negative number, not -inf: on the HTP the
    /// scores are FP16).
    Softmax {
        /// Operand, F32.
        input: TensorId,
        /// Result, F32, of the input's shape.
        output: TensorId,
    },
    /// `x / sqrt(mean(x^2) + epsilon) * gamma` along the last axis: a decoder's norms. F32 in
    /// the IR; the HTP runs it only in FP16 (FLOAT_32 fails at finalize), so its executor casts
    /// around it.
    RmsNorm {
        /// Operand `[.., H]`, F32.
        input: TensorId,
        /// Constant `[H]`, F32: the norm's weight.
        gamma: TensorId,
        /// Added to the mean square; finite and >= 0.
        epsilon: f32,
        /// Result, F32, of the input's shape.
        output: TensorId,
    },
    /// `min(max(x, lo), hi)` elementwise: the part of an activation inside its clip range
    /// (shadow W8A16 inside a graph, whose outliers are `x - clamp(x)`).
    Clamp {
        /// Operand, F32.
        input: TensorId,
        /// Lower bound; finite, at most `hi`.
        lo: f32,
        /// Upper bound; finite.
        hi: f32,
        /// Result, F32, of the input's shape.
        output: TensorId,
    },
    /// The same elements, in the same order, under the output's shape: a relabelling (the q
    /// projection's `[rows, heads x head_dim]` as `[rows, heads, head_dim]`).
    Reshape {
        /// Operand.
        input: TensorId,
        /// Result: the input's type and element count.
        output: TensorId,
    },
    /// Axes permuted: output axis `i` is input axis `perm[i]` (rows and heads swapped, so that
    /// each head's rows are contiguous for attention's batched MatMul).
    Transpose {
        /// Operand, of rank `perm.len()` (at most 4).
        input: TensorId,
        /// A permutation of `0..rank`.
        perm: Vec<usize>,
        /// Result: the input's type, its dimensions permuted.
        output: TensorId,
    },
    /// `a` then `b` along `axis` (the cache's rows, then the chunk's new keys or values).
    Concat {
        /// First part.
        a: TensorId,
        /// Second part: `a`'s rank and type, equal dimensions but along `axis`.
        b: TensorId,
        /// The axis the parts are stacked along.
        axis: usize,
        /// Result: `a`'s dimensions, with `axis` the sum of both.
        output: TensorId,
    },
}

/// The shape numpy broadcasts `a` and `b` to (dimensions aligned from the last; each pair equal,
/// or one of them 1 or missing), or `None` when they do not broadcast.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let dim = |s: &[usize], i: usize| if i + s.len() >= rank { s[i + s.len() - rank] } else { 1 };
    (0..rank)
        .map(|i| match (dim(a, i), dim(b, i)) {
            (x, y) if x == y || y == 1 => Some(x),
            (1, y) => Some(y),
            _ => None,
        })
        .collect()
}

impl Op {
    /// The op's name in errors and logs: QNN's op type (`ElementWiseAdd` for [`Op::Add`]).
    pub fn name(&self) -> &'static str {
        match self {
            Op::FullyConnected { .. } => "FullyConnected",
            Op::MatMul { .. } => "MatMul",
            Op::Quantize { .. } => "Quantize",
            Op::Dequantize { .. } => "Dequantize",
            Op::Add { .. } => "ElementWiseAdd",
            Op::Mul { .. } => "ElementWiseMultiply",
            Op::Sigmoid { .. } => "Sigmoid",
            Op::Softmax { .. } => "Softmax",
            Op::RmsNorm { .. } => "RmsNorm",
            Op::Clamp { .. } => "ReluMinMax",
            Op::Reshape { .. } => "Reshape",
            Op::Transpose { .. } => "Transpose",
            Op::Concat { .. } => "Concat",
        }
    }

    /// The tensors the op reads, in operand order (a FullyConnected's bias last, when it has one).
    pub fn inputs(&self) -> Vec<TensorId> {
        match *self {
            Op::FullyConnected { input, weight, bias, .. } => {
                let mut v = vec![input, weight];
                v.extend(bias);
                v
            }
            Op::MatMul { a, b, .. } | Op::Add { a, b, .. } | Op::Mul { a, b, .. } | Op::Concat { a, b, .. } => vec![a, b],
            Op::RmsNorm { input, gamma, .. } => vec![input, gamma],
            Op::Quantize { input, .. }
            | Op::Dequantize { input, .. }
            | Op::Sigmoid { input, .. }
            | Op::Softmax { input, .. }
            | Op::Clamp { input, .. }
            | Op::Reshape { input, .. }
            | Op::Transpose { input, .. } => vec![input],
        }
    }

    /// The one tensor the op writes.
    pub fn output(&self) -> TensorId {
        match *self {
            Op::FullyConnected { output, .. }
            | Op::MatMul { output, .. }
            | Op::Quantize { output, .. }
            | Op::Dequantize { output, .. }
            | Op::Add { output, .. }
            | Op::Mul { output, .. }
            | Op::Sigmoid { output, .. }
            | Op::Softmax { output, .. }
            | Op::RmsNorm { output, .. }
            | Op::Clamp { output, .. }
            | Op::Reshape { output, .. }
            | Op::Transpose { output, .. }
            | Op::Concat { output, .. } => output,
        }
    }
}

/// A static graph: tensors, ops in execution order, graph inputs and outputs.
#[derive(Debug, Clone)]
pub struct Graph {
    /// Names the graph in errors, logs, profiles and the prepared-graph cache's file names.
    pub name: String,
    /// Every tensor of the graph, indexed by [`TensorId`].
    pub tensors: Vec<TensorSpec>,
    /// Ops in execution order: each reads only inputs, constants and earlier ops' outputs.
    pub ops: Vec<Op>,
    /// The graph's Input tensors, in the order their buffers are passed to an execution.
    pub inputs: Vec<TensorId>,
    /// The tensors read back after an execution, in the order they are returned.
    pub outputs: Vec<TensorId>,
}

impl Graph {
    /// An empty graph; add tensors with [`Graph::input`] and [`Graph::constant`], ops with
    /// [`Graph::op`] and its helpers, and outputs with [`Graph::mark_output`].
    pub fn new(name: impl Into<String>) -> Self {
        Graph { name: name.into(), tensors: vec![], ops: vec![], inputs: vec![], outputs: vec![] }
    }

    /// The spec of tensor `id` (panics on an id that is not this graph's).
    pub fn tensor(&self, id: TensorId) -> &TensorSpec {
        &self.tensors[id.0]
    }

    fn push(&mut self, spec: TensorSpec) -> TensorId {
        self.tensors.push(spec);
        TensorId(self.tensors.len() - 1)
    }

    /// A graph input, written before each execution.
    pub fn input(&mut self, name: &str, shape: &[usize], dtype: DType, quant: Option<Quant>) -> TensorId {
        let id = self.push(TensorSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            dtype,
            quant,
            kind: TensorKind::Input,
            data: None,
            channel_scales: None,
            block_scales: None,
            data_id: None,
        });
        self.inputs.push(id);
        id
    }

    /// A constant (weights, bias).
    pub fn constant(&mut self, name: &str, shape: &[usize], data: StaticData, quant: Option<Quant>) -> TensorId {
        self.push(TensorSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            dtype: data.dtype(),
            quant,
            kind: TensorKind::Static,
            data: Some(data),
            channel_scales: None,
            block_scales: None,
            data_id: None,
        })
    }

    /// An I8 weight `[N, K]` quantized per output channel: `w[n, k] = q[n, k] * scales[n]`.
    pub fn constant_per_channel(&mut self, name: &str, shape: &[usize], data: Arc<Vec<i8>>, scales: Arc<Vec<f32>>) -> TensorId {
        let id = self.constant(name, shape, StaticData::I8(data), None);
        self.tensors[id.0].channel_scales = Some(scales);
        id
    }

    /// An LPBQ weight `[N, K]`: the INT8 per-channel weight `data` (under `scales`), each value a
    /// multiple of its block's scale in `blocks` ([`TensorSpec::block_scales`]).
    pub fn constant_lpbq(&mut self, name: &str, shape: &[usize], data: Arc<Vec<i8>>, scales: Arc<Vec<f32>>, blocks: Arc<BlockScales>) -> TensorId {
        let id = self.constant_per_channel(name, shape, data, scales);
        self.tensors[id.0].block_scales = Some(blocks);
        id
    }

    /// Declare that constant `id` holds the data of identity `data_id` (unique in the process,
    /// e.g. from [`next_data_id`], and never reused for other data): see [`TensorSpec::data_id`].
    pub fn set_data_id(&mut self, id: TensorId, data_id: u64) {
        self.tensors[id.0].data_id = Some(data_id);
    }

    /// An intermediate tensor; see [`Graph::mark_output`] to make it a graph output.
    pub fn tensor_new(&mut self, name: &str, shape: &[usize], dtype: DType, quant: Option<Quant>) -> TensorId {
        self.push(TensorSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            dtype,
            quant,
            kind: TensorKind::Intermediate,
            data: None,
            channel_scales: None,
            block_scales: None,
            data_id: None,
        })
    }

    /// Make a tensor a graph output (read after each execution).
    pub fn mark_output(&mut self, id: TensorId) {
        self.tensors[id.0].kind = TensorKind::Output;
        if !self.outputs.contains(&id) {
            self.outputs.push(id);
        }
    }

    /// Add an op producing a new tensor `name` with the given type; returns that tensor.
    pub fn op(&mut self, name: &str, dtype: DType, quant: Option<Quant>, make: impl FnOnce(TensorId) -> Op, shape: &[usize]) -> TensorId {
        let out = self.tensor_new(name, shape, dtype, quant);
        self.ops.push(make(out));
        out
    }

    /// FullyConnected with output shape `[M, N]` from input `[M, K]` and weight `[N, K]`.
    pub fn fully_connected(
        &mut self,
        name: &str,
        input: TensorId,
        weight: TensorId,
        bias: Option<TensorId>,
        out_dtype: DType,
        out_quant: Option<Quant>,
    ) -> TensorId {
        let m = self.tensor(input).shape[0];
        let n = self.tensor(weight).shape[0];
        self.op(name, out_dtype, out_quant, |output| Op::FullyConnected { input, weight, bias, output }, &[m, n])
    }

    /// An elementwise op whose output has the shape of its first input.
    pub fn unary(&mut self, name: &str, input: TensorId, dtype: DType, quant: Option<Quant>, f: fn(TensorId, TensorId) -> Op) -> TensorId {
        let shape = self.tensor(input).shape.clone();
        self.op(name, dtype, quant, |output| f(input, output), &shape)
    }

    /// An elementwise op of two operands whose output has their broadcast shape (`a`'s when
    /// they do not broadcast, which [`Graph::validate`] then reports).
    pub fn binary(&mut self, name: &str, a: TensorId, b: TensorId, dtype: DType, quant: Option<Quant>, f: fn(TensorId, TensorId, TensorId) -> Op) -> TensorId {
        let (sa, sb) = (&self.tensor(a).shape, &self.tensor(b).shape);
        let shape = broadcast_shape(sa, sb).unwrap_or_else(|| sa.clone());
        self.op(name, dtype, quant, |output| f(a, b, output), &shape)
    }

    /// Shapes of an op's operands, for error messages: `in:U8[32, 576], w:I8[576, 576] -> ...`.
    pub fn describe_op(&self, op: &Op) -> String {
        let ins: Vec<String> = op.inputs().iter().map(|&t| self.tensor(t).to_string()).collect();
        format!("{} -> {}", ins.join(", "), self.tensor(op.output()))
    }

    /// SHA-256 of everything that determines the compiled graph: names, shapes, types,
    /// quantization parameters, tensor kinds, ops, inputs, outputs and the constants' bytes. So
    /// it covers the model weights, the quant profile's scales and the chunk length (the
    /// shapes) at once, and a prepared-graph cache keyed by it can never serve a stale graph.
    pub fn fingerprint(&self) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        let field = |h: &mut Sha256, bytes: &[u8]| {
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        field(&mut h, self.name.as_bytes());
        for t in &self.tensors {
            let desc = format!("{}|{:?}|{:?}|{:?}|", t.name, t.shape, t.dtype, t.kind);
            field(&mut h, desc.as_bytes());
            match t.quant {
                Some(q) => field(&mut h, &[q.scale.to_bits().to_le_bytes(), q.offset.to_le_bytes()].concat()),
                None => field(&mut h, b"-"),
            }
            match &t.channel_scales {
                Some(s) => field(&mut h, &s.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect::<Vec<u8>>()),
                None => field(&mut h, b"-"),
            }
            match &t.block_scales {
                Some(b) => field(&mut h, &[&(b.block as u64).to_le_bytes()[..], &b.scales].concat()),
                None => field(&mut h, b"-"),
            }
            // Constants are hashed in slices so that a 100 MB weight is never copied whole.
            fn words<const N: usize, T: Copy>(h: &mut Sha256, v: &[T], le: impl Fn(T) -> [u8; N]) {
                h.update(((v.len() * N) as u64).to_le_bytes());
                for part in v.chunks(1 << 14) {
                    h.update(part.iter().flat_map(|&x| le(x)).collect::<Vec<u8>>());
                }
            }
            match &t.data {
                Some(StaticData::F32(v)) => words(&mut h, v, f32::to_le_bytes),
                Some(StaticData::I8(v)) => words(&mut h, v, i8::to_le_bytes),
                Some(StaticData::I32(v)) => words(&mut h, v, i32::to_le_bytes),
                None => field(&mut h, b"-"),
            }
        }
        // `Op`'s Debug form names the variant and every operand id (and `transpose_b`).
        for op in &self.ops {
            field(&mut h, format!("{op:?}").as_bytes());
        }
        field(&mut h, format!("{:?}{:?}", self.inputs, self.outputs).as_bytes());
        h.finalize().into()
    }

    fn invalid(&self, op: &Op, reason: impl Into<String>) -> Error {
        Error::InvalidGraph { graph: self.name.clone(), op: op.name().to_string(), shapes: self.describe_op(op), reason: reason.into() }
    }

    fn invalid_tensor(&self, shapes: String, reason: impl Into<String>) -> Error {
        Error::InvalidGraph { graph: self.name.clone(), op: "-".into(), shapes, reason: reason.into() }
    }

    /// An LPBQ weight: a per-channel I8 `[N, K]` constant whose every value is a 4-bit value
    /// ([-8, 7]) times its block's scale (1..=15), over whole blocks of `K`.
    fn validate_blocks(&self, t: &TensorSpec, b: &BlockScales) -> Result<()> {
        let [n, k] = t.shape[..] else {
            return Err(self.invalid_tensor(t.to_string(), "block scales need a weight [N, K]"));
        };
        if t.channel_scales.is_none() || b.block == 0 || k % b.block != 0 || b.scales.len() != n * (k / b.block) {
            return Err(self.invalid_tensor(
                t.to_string(),
                format!("LPBQ needs per-channel scales and one block scale per {} inputs of each row ({} given)", b.block, b.scales.len()),
            ));
        }
        let Some(StaticData::I8(q)) = &t.data else {
            return Err(self.invalid_tensor(t.to_string(), "LPBQ needs I8 constant data"));
        };
        let bad = q.iter().enumerate().position(|(i, &v)| {
            let s = b.of(i, k) as i32;
            !(1..=15).contains(&s) || v as i32 % s != 0 || !(-8..=7).contains(&(v as i32 / s))
        });
        match bad {
            Some(i) => Err(self.invalid_tensor(
                t.to_string(),
                format!("value {} at [{}, {}] is not a 4-bit value times its block scale {} (1..=15)", q[i], i / k, i % k, b.of(i, k)),
            )),
            None => Ok(()),
        }
    }

    /// What must hold before anything is looked up by id (a graph's fields are public, and the
    /// executors index by these ids): every id in range, every tensor's size representable,
    /// constants with data of their type, the graph's inputs exactly its Input tensors and its
    /// outputs listed once, and every op writing a tensor of its own.
    fn validate_structure(&self) -> Result<()> {
        let n = self.tensors.len();
        for (i, op) in self.ops.iter().enumerate() {
            if let Some(id) = op.inputs().into_iter().chain([op.output()]).find(|id| id.0 >= n) {
                return Err(Error::InvalidGraph {
                    graph: self.name.clone(),
                    op: op.name().into(),
                    shapes: format!("op #{i}"),
                    reason: format!("tensor id {} out of range ({n} tensors)", id.0),
                });
            }
        }
        for (what, ids) in [("input", &self.inputs), ("output", &self.outputs)] {
            let mut seen = vec![false; n];
            for id in ids.iter() {
                if id.0 >= n {
                    return Err(self.invalid_tensor(format!("graph {what} #{}", id.0), format!("tensor id out of range ({n} tensors)")));
                }
                if std::mem::replace(&mut seen[id.0], true) {
                    return Err(self.invalid_tensor(self.tensor(*id).to_string(), format!("listed twice as a graph {what}")));
                }
                if what == "output" && self.tensor(*id).kind != TensorKind::Output {
                    return Err(self.invalid_tensor(self.tensor(*id).to_string(), "a graph output must be an Output tensor (mark_output)"));
                }
            }
        }
        for (i, t) in self.tensors.iter().enumerate() {
            let bytes = t.shape.iter().try_fold(t.dtype.size_in_bytes(), |a, &d| a.checked_mul(d));
            if bytes.is_none_or(|b| b > MAX_TENSOR_BYTES) {
                return Err(self.invalid_tensor(t.to_string(), format!("the shape's size is beyond {MAX_TENSOR_BYTES} bytes")));
            }
            // (An input marked as an output too has the Output kind.)
            let listed = self.inputs.contains(&TensorId(i));
            if (t.kind == TensorKind::Input && !listed) || (listed && !matches!(t.kind, TensorKind::Input | TensorKind::Output)) {
                return Err(self.invalid_tensor(t.to_string(), "the graph's inputs must be its Input tensors, each listed once"));
            }
            match (&t.kind, &t.data) {
                (TensorKind::Static, None) => return Err(self.invalid_tensor(t.to_string(), "constant without data")),
                (TensorKind::Static, Some(d)) if d.dtype() != t.dtype => {
                    return Err(self.invalid_tensor(t.to_string(), format!("constant data is {:?}, the tensor {:?}", d.dtype(), t.dtype)));
                }
                _ => {}
            }
        }
        let mut produced = vec![false; n];
        for op in &self.ops {
            let out = op.output();
            if !matches!(self.tensor(out).kind, TensorKind::Intermediate | TensorKind::Output) {
                return Err(self.invalid(op, "writes an input or a constant"));
            }
            if std::mem::replace(&mut produced[out.0], true) {
                return Err(self.invalid(op, "writes a tensor another op produces"));
            }
            if op.inputs().contains(&out) {
                return Err(self.invalid(op, "reads its own output"));
            }
        }
        Ok(())
    }

    /// Check shapes, types and quantization parameters of every op, and that every tensor an op
    /// reads is an input, a constant, or produced by an earlier op.
    pub fn validate(&self) -> Result<()> {
        if self.outputs.is_empty() {
            return Err(self.invalid_tensor(String::new(), "graph has no outputs"));
        }
        self.validate_structure()?;
        let mut ready: Vec<bool> = self.tensors.iter().map(|t| matches!(t.kind, TensorKind::Input | TensorKind::Static)).collect();
        for t in &self.tensors {
            if let Some(s) = &t.channel_scales {
                let ok = t.dtype == DType::I8
                    && t.kind == TensorKind::Static
                    && t.quant.is_none()
                    && t.shape.first() == Some(&s.len())
                    && s.iter().all(|v| v.is_finite() && *v > 0.0);
                if !ok {
                    return Err(self
                        .invalid_tensor(t.to_string(), "per-channel scales need a constant I8 tensor without per-tensor quant, one finite scale > 0 per row"));
                }
            }
            if let Some(b) = &t.block_scales {
                self.validate_blocks(t, b)?;
            }
            if t.dtype.is_quantized() && t.quant.is_none() && t.channel_scales.is_none() {
                return Err(self.invalid_tensor(t.to_string(), "quantized tensor without scale/offset"));
            }
            if let Some(q) = t.quant {
                if !(q.scale.is_finite() && q.scale > 0.0) {
                    return Err(self.invalid_tensor(t.to_string(), format!("scale must be finite and > 0, got {}", q.scale)));
                }
            }
            if let Some(d) = &t.data {
                if d.len() != t.elem_count() {
                    return Err(self.invalid_tensor(t.to_string(), format!("constant has {} elements, shape needs {}", d.len(), t.elem_count())));
                }
            }
        }
        for op in &self.ops {
            for i in op.inputs() {
                if !ready[i.0] {
                    return Err(self.invalid(op, format!("reads '{}' before it is produced", self.tensor(i).name)));
                }
            }
            let out = self.tensor(op.output());
            match *op {
                Op::FullyConnected { input, weight, bias, output } => {
                    let (x, w, o) = (self.tensor(input), self.tensor(weight), self.tensor(output));
                    if x.shape.len() != 2 || w.shape.len() != 2 || x.shape[1] != w.shape[1] {
                        return Err(self.invalid(op, "expects input [M, K] and weight [N, K]"));
                    }
                    if w.kind != TensorKind::Static {
                        return Err(self.invalid(op, "weight must be a constant"));
                    }
                    if o.shape != [x.shape[0], w.shape[0]] {
                        return Err(self.invalid(op, "output must be [M, N]"));
                    }
                    let float = x.dtype == DType::F32 && w.dtype == DType::F32;
                    let w8a8 = matches!(x.dtype, DType::U8 | DType::I8) && w.dtype == DType::I8;
                    let w8a16 = x.dtype == DType::U16 && w.dtype == DType::I8;
                    if !(float || w8a8 || w8a16) {
                        return Err(self.invalid(op, "supported: F32 x F32, U8/I8 x I8 (W8A8), or U16 x I8 (W8A16)"));
                    }
                    if (w8a8 || w8a16) && x.quant.is_none() {
                        return Err(self.invalid(op, "a quantized input needs one scale and offset (per tensor)"));
                    }
                    if w8a16 && (bias.is_some() || !matches!(o.dtype, DType::F32 | DType::U16)) {
                        return Err(self.invalid(op, "W8A16 takes no bias and has an F32 or U16 output (its accumulator exceeds 32 bits)"));
                    }
                    if w.block_scales.is_some() && !matches!(o.dtype, DType::U8 | DType::U16) {
                        return Err(self.invalid(op, "LPBQ weights need a U8 or U16 output (the HTP refuses an F32 or I32 one)"));
                    }
                    if (w8a8 || w8a16) && w.quant.is_some_and(|q| q.offset != 0) {
                        return Err(self.invalid(op, "weights must be symmetric (offset 0)"));
                    }
                    if let Some(b) = bias {
                        let b = self.tensor(b);
                        if b.shape != [w.shape[0]] {
                            return Err(self.invalid(op, "bias must be [N]"));
                        }
                        if float && b.dtype != DType::F32 {
                            return Err(self.invalid(op, "float FullyConnected needs an F32 bias"));
                        }
                        if w8a8 && w.channel_scales.is_some() {
                            return Err(self.invalid(op, "a bias with per-channel weights is not supported: add it to the output"));
                        }
                        if w8a8 {
                            let (Some(xq), Some(wq)) = (x.quant, w.quant) else {
                                return Err(self.invalid(op, "a W8A8 bias needs per-tensor input and weight scales"));
                            };
                            let expect = xq.scale * wq.scale;
                            let ok = b.dtype == DType::I32 && b.quant.is_some_and(|q| q.offset == 0 && ((q.scale - expect) / expect).abs() < 1e-5);
                            if !ok {
                                return Err(self.invalid(op, "W8A8 bias must be I32 with scale s_in * s_w, offset 0"));
                            }
                        }
                    }
                    if w.channel_scales.is_some() && o.dtype == DType::I32 {
                        return Err(self.invalid(op, "per-channel weights have no single accumulator scale: use an F32 or U8 output"));
                    }
                    if float && o.dtype != DType::F32 {
                        return Err(self.invalid(op, "float FullyConnected has an F32 output"));
                    }
                }
                Op::MatMul { a, b, transpose_b, output } => {
                    let (a, b, o) = (self.tensor(a), self.tensor(b), self.tensor(output));
                    let rank = a.shape.len();
                    if !(2..=3).contains(&rank) || b.shape.len() != rank {
                        return Err(self.invalid(op, "expects operands of one rank, 2 or 3"));
                    }
                    let batch = &a.shape[..rank - 2];
                    if b.shape[..rank - 2] != *batch {
                        return Err(self.invalid(op, "batch dimensions differ"));
                    }
                    let (a2, b2) = (&a.shape[rank - 2..], &b.shape[rank - 2..]);
                    let (k, n) = if transpose_b { (b2[1], b2[0]) } else { (b2[0], b2[1]) };
                    if a2[1] != k || o.shape != [batch, &[a2[0], n]].concat() {
                        return Err(self.invalid(op, "inner dimensions differ"));
                    }
                }
                Op::Quantize { input, .. } => {
                    if self.tensor(input).dtype != DType::F32 || !out.dtype.is_quantized() {
                        return Err(self.invalid(op, "Quantize maps F32 to a quantized type"));
                    }
                }
                Op::Dequantize { input, .. } => {
                    if !self.tensor(input).dtype.is_quantized() || out.dtype != DType::F32 {
                        return Err(self.invalid(op, "Dequantize maps a quantized type to F32"));
                    }
                }
                Op::Add { a, b, .. } | Op::Mul { a, b, .. } => {
                    if broadcast_shape(&self.tensor(a).shape, &self.tensor(b).shape).as_ref() != Some(&out.shape) {
                        return Err(self.invalid(op, "the output must have the operands' broadcast shape"));
                    }
                }
                Op::RmsNorm { input, gamma, epsilon, .. } => {
                    let (x, w) = (self.tensor(input), self.tensor(gamma));
                    if [x.dtype, w.dtype, out.dtype] != [DType::F32; 3] || w.kind != TensorKind::Static {
                        return Err(self.invalid(op, "RmsNorm maps F32 to F32 with a constant F32 weight"));
                    }
                    if x.shape.is_empty() || w.shape != x.shape[x.shape.len() - 1..] || out.shape != x.shape {
                        return Err(self.invalid(op, "expects input [.., H], weight [H] and an output of the input's shape"));
                    }
                    if !(epsilon.is_finite() && epsilon >= 0.0) {
                        return Err(self.invalid(op, format!("epsilon must be finite and >= 0, got {epsilon}")));
                    }
                }
                Op::Clamp { input, lo, hi, .. } => {
                    let x = self.tensor(input);
                    if x.dtype != DType::F32 || out.dtype != DType::F32 || x.shape != out.shape {
                        return Err(self.invalid(op, "Clamp maps F32 to F32 of the input's shape"));
                    }
                    if !(lo.is_finite() && hi.is_finite() && lo <= hi) {
                        return Err(self.invalid(op, format!("bounds [{lo}, {hi}] must be finite and ordered")));
                    }
                }
                Op::Reshape { input, .. } => {
                    let x = self.tensor(input);
                    if x.elem_count() != out.elem_count() || (x.dtype, x.quant) != (out.dtype, out.quant) {
                        return Err(self.invalid(op, "a reshape keeps the element count, the type and the quantization"));
                    }
                }
                Op::Transpose { input, ref perm, .. } => {
                    let x = self.tensor(input);
                    let mut sorted = perm.clone();
                    sorted.sort_unstable();
                    if perm.len() != x.shape.len() || perm.len() > 4 || sorted != (0..perm.len()).collect::<Vec<_>>() {
                        return Err(self.invalid(op, format!("perm {perm:?} is not a permutation of the input's axes (rank <= 4)")));
                    }
                    if out.shape != perm.iter().map(|&p| x.shape[p]).collect::<Vec<_>>() || (x.dtype, x.quant) != (out.dtype, out.quant) {
                        return Err(self.invalid(op, "the output must have the input's type and its dimensions permuted"));
                    }
                }
                Op::Concat { a, b, axis, .. } => {
                    let (a, b) = (self.tensor(a), self.tensor(b));
                    let same = |x: &TensorSpec| x.dtype == out.dtype && x.quant == out.quant && x.shape.len() == out.shape.len();
                    // (After `same`: the ranks are the output's.)
                    let dims_ok = || {
                        axis < out.shape.len()
                            && (0..out.shape.len()).all(|i| {
                                if i == axis {
                                    a.shape[i] + b.shape[i] == out.shape[i]
                                } else {
                                    a.shape[i] == out.shape[i] && b.shape[i] == out.shape[i]
                                }
                            })
                    };
                    if !(same(a) && same(b) && dims_ok()) {
                        return Err(self.invalid(op, format!("parts must share the output's type and dimensions but along axis {axis}, where they add up")));
                    }
                }
                Op::Sigmoid { input, .. } => {
                    if self.tensor(input).shape != out.shape {
                        return Err(self.invalid(op, "output shape must equal input shape"));
                    }
                }
                Op::Softmax { input, .. } => {
                    if self.tensor(input).shape != out.shape {
                        return Err(self.invalid(op, "output shape must equal input shape"));
                    }
                    if self.tensor(input).dtype != DType::F32 || out.dtype != DType::F32 {
                        return Err(self.invalid(op, "Softmax maps F32 to F32"));
                    }
                }
            }
            ready[op.output().0] = true;
        }
        for &o in &self.outputs {
            if !ready[o.0] {
                return Err(self.invalid_tensor(self.tensor(o).to_string(), "output is never produced"));
            }
        }
        Ok(())
    }

    /// Bytes of constant data (weights) held by this graph.
    pub fn static_bytes(&self) -> usize {
        self.tensors.iter().filter(|t| t.kind == TensorKind::Static).map(|t| t.size_in_bytes()).sum()
    }
}

#[cfg(test)]
mod tests;
