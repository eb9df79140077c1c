//! What the HTP takes of the IR, and how each IR op becomes QNN nodes: the support table and
//! the translation side by side, so that adding an op edits one file.

use super::*;

pub(super) fn is8(d: DType) -> bool {
    matches!(d, DType::U8 | DType::I8)
}

/// Last dimension of a tensor (columns of an FC/MatMul output).
pub(super) fn cols(t: &TensorSpec) -> usize {
    t.shape.last().copied().unwrap_or(1)
}

pub(super) fn op_supported(graph: &Graph, op: &Op) -> bool {
    let t = |id: TensorId| graph.tensor(id);
    let shape_ok =
        |s: &TensorSpec| (1..=4).contains(&s.shape.len()) && s.shape.iter().all(|&d| d > 0 && d <= u32::MAX as usize) && s.size_in_bytes() <= u32::MAX as usize;
    if !op.inputs().into_iter().chain([op.output()]).all(|i| shape_ok(t(i))) {
        return false;
    }
    match *op {
        Op::FullyConnected { input, weight, output, .. } => {
            let (x, w, o) = (t(input), t(weight), t(output));
            match (x.dtype, w.dtype, o.dtype) {
                // LPBQ: u8 into u8 or u16 into u16 only (u8 into u16, F32 or SFIXED_POINT_32
                // refused at finalize; qnn-sys' `fc_weight_encodings`).
                (xd, DType::I8, od) if w.block_scales.is_some() => matches!((xd, od), (DType::U8, DType::U8) | (DType::U16, DType::U16)),
                (DType::F32, DType::F32, DType::F32) => true,
                // W8A16 (validated: F32 output, no bias); per-channel weights lowered as for W8A8.
                (DType::U16, DType::I8, DType::F32) => cols(o) >= 32,
                // Per-channel weights: no single accumulator scale for the narrow-output lowering.
                (xd, DType::I8, DType::F32) if is8(xd) && w.channel_scales.is_some() => cols(o) >= 32,
                (xd, DType::I8, DType::U8 | DType::I8 | DType::F32) if is8(xd) => true,
                // SFIXED_POINT_32 output: wrong values past column 32 (see module docs).
                (xd, DType::I8, DType::I32) if is8(xd) => cols(o) <= 32,
                _ => false,
            }
        }
        Op::MatMul { a, b, output, .. } => {
            let (a, b, o) = (t(a), t(b), t(output));
            if is8(a.dtype) && is8(b.dtype) {
                match o.dtype {
                    DType::U8 | DType::I8 => true,
                    DType::F32 => cols(o) >= 32,
                    DType::I32 | DType::U16 => false,
                }
            } else {
                true
            }
        }
        Op::Quantize { output, .. } => is8(t(output).dtype) || t(output).dtype == DType::U16,
        Op::Dequantize { .. } | Op::Add { .. } | Op::Mul { .. } | Op::Sigmoid { .. } | Op::Softmax { .. } => true,
        // Cast to FP16 around it (see the translation).
        Op::RmsNorm { .. } => true,
        Op::Clamp { .. } | Op::Reshape { .. } | Op::Transpose { .. } | Op::Concat { .. } => true,
    }
}

/// A validated graph every op of which the support table accepts; otherwise
/// [`Error::Unsupported`] naming the first op that is not.
pub(super) fn check_supported(graph: &Graph) -> Result<()> {
    graph.validate()?;
    match graph.ops.iter().find(|op| !op_supported(graph, op)) {
        Some(op) => Err(Error::Unsupported { graph: graph.name.clone(), executor: "htp", op: op.name().to_string(), shapes: graph.describe_op(op) }),
        None => Ok(()),
    }
}

impl Builder<'_> {
    /// Adds the QNN node(s) of IR op number `i`.
    pub(super) fn op(&mut self, i: usize, op: &Op) -> std::result::Result<(), NodeError> {
        let g = self.graph;
        let out_spec = g.tensor(op.output());
        let base = format!("op{i}_{}", sanitize(&out_spec.name));
        let mut out = [self.ir(op.output())?];
        match *op {
            Op::FullyConnected { input, weight, bias, .. } => {
                let (x, w) = (g.tensor(input), g.tensor(weight));
                if let (Some(scales), DType::F32) = (&w.channel_scales, out_spec.dtype) {
                    // Lowering: per-channel weights with an F32 output fail at finalize (1002).
                    // The same INT8 weights under one scale s0 = min(s_n), F32 output, then
                    // ElementWiseMultiply by the [N] vector s_n / s0 (FP16 on HTP: one rounding
                    // of 2^-11). With s0 the smallest scale the intermediate never exceeds the
                    // real output, so FP16 cannot overflow where the result would not.
                    let s0 = scales.iter().fold(f32::INFINITY, |m, &s| m.min(s));
                    let wdata = match &w.data {
                        Some(StaticData::I8(v)) => Qnn_ClientBuffer_t { data: v.as_ptr() as *mut c_void, dataSize: v.len() as u32 },
                        _ => return Err((0, "per-channel weight without I8 data (validated)".into())),
                    };
                    let wt = match self.per_tensor_weights[weight.0] {
                        Some(t) => t,
                        None => {
                            let t = self.create(
                                format!("t{}_{}_pt", weight.0, sanitize(&w.name)),
                                QNN_TENSOR_TYPE_STATIC,
                                QNN_DATATYPE_SFIXED_POINT_8,
                                Qnn_QuantizeParams_t::scale_offset(s0, 0),
                                &w.shape,
                                wdata,
                            )?;
                            *self.per_tensor_weights.get_mut(weight.0).expect("an IR id") = Some(t);
                            t
                        }
                    };
                    let mut ins = [self.ir(input)?, wt]; // validated: no bias with per-channel weights
                    let ratio: Box<[f32]> = scales.iter().map(|&s| s / s0).collect();
                    let rt = self.lowered_constant(format!("{base}_scales"), QNN_DATATYPE_FLOAT_32, &[w.shape[0]], ratio)?;
                    let mut acc = [self.native(&format!("{base}_unscaled"), QNN_DATATYPE_FLOAT_32, Qnn_QuantizeParams_t::undefined(), &out_spec.shape)?];
                    self.node(base.clone(), QNN_OP_FULLY_CONNECTED, &mut [], &mut ins, &mut acc)?;
                    return self.node(format!("{base}_channel_scales"), QNN_OP_ELEMENT_WISE_MULTIPLY, &mut [], &mut [acc[0], rt], &mut out);
                }
                let mut ins = vec![self.ir(input)?, self.ir(weight)?];
                if let Some(bias) = bias {
                    ins.push(self.ir(bias)?);
                }
                if out_spec.dtype == DType::F32 && w.dtype == DType::I8 && cols(out_spec) < 32 {
                    // Lowering: a FLOAT_32 output narrower than 32 columns fails at execute
                    // (1100); the SFIXED_POINT_32 accumulator + Dequantize is exact there.
                    let scale = x.quant.expect("validated").scale * w.quant.expect("validated").scale;
                    let acc_q = Qnn_QuantizeParams_t::scale_offset(scale, 0);
                    let mut acc = [self.native(&format!("{base}_acc"), QNN_DATATYPE_SFIXED_POINT_32, acc_q, &out_spec.shape)?];
                    self.node(base.clone(), QNN_OP_FULLY_CONNECTED, &mut [], &mut ins, &mut acc)?;
                    self.node(format!("{base}_dequantize"), QNN_OP_DEQUANTIZE, &mut [], &mut acc, &mut out)
                } else {
                    self.node(base, QNN_OP_FULLY_CONNECTED, &mut [], &mut ins, &mut out)
                }
            }
            Op::MatMul { a, b, transpose_b, .. } => {
                let mut ins = [self.ir(a)?, self.ir(b)?];
                let mut params = [
                    Qnn_Param_t::scalar(QNN_OP_MAT_MUL_PARAM_TRANSPOSE_IN0.as_ptr(), Qnn_Scalar_t::bool8(false)),
                    Qnn_Param_t::scalar(QNN_OP_MAT_MUL_PARAM_TRANSPOSE_IN1.as_ptr(), Qnn_Scalar_t::bool8(transpose_b)),
                ];
                self.node(base, QNN_OP_MAT_MUL, &mut params, &mut ins, &mut out)
            }
            Op::Quantize { input, .. } | Op::Dequantize { input, .. } | Op::Sigmoid { input, .. } => {
                let ty = match op {
                    Op::Quantize { .. } => QNN_OP_QUANTIZE,
                    Op::Dequantize { .. } => QNN_OP_DEQUANTIZE,
                    _ => QNN_OP_SIGMOID,
                };
                let mut ins = [self.ir(input)?];
                self.node(base, ty, &mut [], &mut ins, &mut out)
            }
            Op::Softmax { input, .. } => {
                let axis = out_spec.shape.len() as u32 - 1;
                let mut params = [
                    Qnn_Param_t::scalar(QNN_OP_PARAM_AXIS.as_ptr(), Qnn_Scalar_t::u32(axis)),
                    Qnn_Param_t::scalar(QNN_OP_SOFTMAX_PARAM_BETA.as_ptr(), Qnn_Scalar_t::f32(1.0)),
                ];
                let mut ins = [self.ir(input)?];
                self.node(base, QNN_OP_SOFTMAX, &mut params, &mut ins, &mut out)
            }
            Op::Add { a, b, .. } | Op::Mul { a, b, .. } => {
                // QNN's elementwise ops broadcast as numpy does, as the IR's.
                let ty = if matches!(op, Op::Add { .. }) { QNN_OP_ELEMENT_WISE_ADD } else { QNN_OP_ELEMENT_WISE_MULTIPLY };
                let mut ins = [self.ir(a)?, self.ir(b)?];
                self.node(base, ty, &mut [], &mut ins, &mut out)
            }
            Op::RmsNorm { input, gamma, epsilon, .. } => {
                // Lowering: RmsNorm runs on FLOAT_16 only (FLOAT_32 fails at finalize; Convert
                // FP32 <-> FP16 too): Cast in, the norm with an FP16 weight, Cast out.
                let shape = &out_spec.shape;
                let w: Box<[u16]> = match &g.tensor(gamma).data {
                    Some(StaticData::F32(v)) => v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect(),
                    _ => return Err((0, "RmsNorm weight without F32 data (validated)".into())),
                };
                let w = self.lowered_constant(format!("{base}_weight_fp16"), QNN_DATATYPE_FLOAT_16, &[w.len()], w)?;
                let axes = self.lowered_constant(format!("{base}_axes"), QNN_DATATYPE_UINT_32, &[1], Box::new([shape.len() as u32 - 1]) as Box<[u32]>)?;
                let mut x16 = [self.native(&format!("{base}_in_fp16"), QNN_DATATYPE_FLOAT_16, Qnn_QuantizeParams_t::undefined(), shape)?];
                let mut y16 = [self.native(&format!("{base}_fp16"), QNN_DATATYPE_FLOAT_16, Qnn_QuantizeParams_t::undefined(), shape)?];
                let mut x = [self.ir(input)?];
                self.node(format!("{base}_cast_in"), QNN_OP_CAST, &mut [], &mut x, &mut x16)?;
                let mut params = [
                    Qnn_Param_t::scalar(QNN_OP_RMS_NORM_PARAM_EPSILON.as_ptr(), Qnn_Scalar_t::f32(epsilon)),
                    Qnn_Param_t::tensor(QNN_OP_RMS_NORM_PARAM_AXES.as_ptr(), axes),
                ];
                self.node(base.clone(), QNN_OP_RMS_NORM, &mut params, &mut [x16[0], w], &mut y16)?;
                self.node(format!("{base}_cast_out"), QNN_OP_CAST, &mut [], &mut y16, &mut out)
            }
            Op::Reshape { input, .. } => {
                let mut ins = [self.ir(input)?];
                self.node(base, QNN_OP_RESHAPE, &mut [], &mut ins, &mut out)
            }
            Op::Clamp { input, lo, hi, .. } => {
                let mut params = [
                    Qnn_Param_t::scalar(QNN_OP_RELU_MIN_MAX_PARAM_MIN_VALUE.as_ptr(), Qnn_Scalar_t::f32(lo)),
                    Qnn_Param_t::scalar(QNN_OP_RELU_MIN_MAX_PARAM_MAX_VALUE.as_ptr(), Qnn_Scalar_t::f32(hi)),
                ];
                let mut ins = [self.ir(input)?];
                self.node(base, QNN_OP_RELU_MIN_MAX, &mut params, &mut ins, &mut out)
            }
            Op::Transpose { input, ref perm, .. } => {
                let p: Box<[u32]> = perm.iter().map(|&a| a as u32).collect();
                let perm = self.lowered_constant(format!("{base}_perm"), QNN_DATATYPE_UINT_32, &[p.len()], p)?;
                let mut params = [Qnn_Param_t::tensor(QNN_OP_TRANSPOSE_PARAM_PERM.as_ptr(), perm)];
                let mut ins = [self.ir(input)?];
                self.node(base, QNN_OP_TRANSPOSE, &mut params, &mut ins, &mut out)
            }
            Op::Concat { a, b, axis, .. } => {
                let mut params = [Qnn_Param_t::scalar(QNN_OP_PARAM_AXIS.as_ptr(), Qnn_Scalar_t::u32(axis as u32))];
                let mut ins = [self.ir(a)?, self.ir(b)?];
                self.node(base, QNN_OP_CONCAT, &mut params, &mut ins, &mut out)
            }
        }
    }
}
