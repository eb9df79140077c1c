//! Values handed to executors and back: [`TensorData`], checked against the graph's tensors.

use super::{DType, Quant};
use crate::error::{Error, Result};

/// Data for one graph input or output.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// Values of an F32 tensor.
    F32(Vec<f32>),
    /// Stored values of a U8 tensor (floats under the tensor's [`Quant`]).
    U8(Vec<u8>),
    /// Stored values of a U16 tensor (floats under the tensor's [`Quant`]).
    U16(Vec<u16>),
    /// Stored values of an I8 tensor (floats under the tensor's [`Quant`]).
    I8(Vec<i8>),
    /// Stored values of an I32 tensor (floats under the tensor's [`Quant`]).
    I32(Vec<i32>),
}

impl TensorData {
    /// The [`DType`] a tensor bound to this buffer must have.
    pub fn dtype(&self) -> DType {
        match self {
            TensorData::F32(_) => DType::F32,
            TensorData::U8(_) => DType::U8,
            TensorData::U16(_) => DType::U16,
            TensorData::I8(_) => DType::I8,
            TensorData::I32(_) => DType::I32,
        }
    }
    /// Number of elements (not bytes).
    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(v) => v.len(),
            TensorData::U8(v) => v.len(),
            TensorData::U16(v) => v.len(),
            TensorData::I8(v) => v.len(),
            TensorData::I32(v) => v.len(),
        }
    }
    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `n` stored zeros of `dtype`: for a quantized type that is the float `offset * scale`, not
    /// 0.0 (e.g. an output buffer to be overwritten).
    pub fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::F32 => TensorData::F32(vec![0.0; n]),
            DType::U8 => TensorData::U8(vec![0; n]),
            DType::U16 => TensorData::U16(vec![0; n]),
            DType::I8 => TensorData::I8(vec![0; n]),
            DType::I32 => TensorData::I32(vec![0; n]),
        }
    }
    /// The float values this data stands for under `quant` (ignored for F32).
    pub fn to_f32(&self, quant: Option<Quant>) -> Vec<f32> {
        let q = quant.unwrap_or(Quant { scale: 1.0, offset: 0 });
        let deq = |v: i32| (v + q.offset) as f32 * q.scale;
        match self {
            TensorData::F32(v) => v.clone(),
            TensorData::U8(v) => v.iter().map(|&x| deq(x as i32)).collect(),
            TensorData::U16(v) => v.iter().map(|&x| deq(x as i32)).collect(),
            TensorData::I8(v) => v.iter().map(|&x| deq(x as i32)).collect(),
            TensorData::I32(v) => v.iter().map(|&x| (x as i64 + q.offset as i64) as f32 * q.scale).collect(),
        }
    }
    /// Quantize float values to `dtype` under `quant` (round to nearest, saturate).
    pub fn from_f32(values: &[f32], dtype: DType, quant: Option<Quant>) -> Self {
        match (dtype, quant) {
            (DType::F32, _) => TensorData::F32(values.to_vec()),
            (DType::U8, Some(q)) => TensorData::U8(crate::quant::quantize_u8(values, q)),
            (DType::U16, Some(q)) => TensorData::U16(quantize_u16(values, q)),
            (DType::I8, Some(q)) => TensorData::I8(values.iter().map(|&v| quantize_one(v, q, -128, 127) as i8).collect()),
            (DType::I32, Some(q)) => TensorData::I32(values.iter().map(|&v| quantize_one(v, q, i32::MIN as i64, i32::MAX as i64) as i32).collect()),
            (_, None) => panic!("from_f32: quantized dtype {dtype:?} without quant params (validated graphs never do this)"),
        }
    }
}

/// Check a buffer against the tensor it is bound to (type and element count). Every executor
/// calls this before running: QNN's graphExecute does not check sizes and would overrun.
pub fn check_buffer(graph: &str, tensor: &str, dtype: DType, len: usize, data: &TensorData) -> Result<()> {
    if data.dtype() == dtype && data.len() == len {
        return Ok(());
    }
    let bytes = |d: DType, n: usize| n * d.size_in_bytes();
    Err(Error::BufferMismatch {
        graph: graph.to_string(),
        tensor: tensor.to_string(),
        expected: format!("{dtype:?} x {len} ({} bytes)", bytes(dtype, len)),
        got: format!("{:?} x {} ({} bytes)", data.dtype(), data.len(), bytes(data.dtype(), data.len())),
    })
}

/// Check the number of buffers given for a graph's inputs.
pub fn check_input_count(graph: &str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        return Ok(());
    }
    Err(Error::BufferMismatch { graph: graph.to_string(), tensor: "<inputs>".into(), expected: format!("{expected} inputs"), got: format!("{got} inputs") })
}

#[inline]
/// [`quantize_one`] of every value onto u16 (round half away from zero, saturate) without a call
/// to `roundf` per value: the whole-layer graphs quantize every linear's input to u16, and on the
/// host executor the calls were a fifth of a prefill's time.
pub(super) fn quantize_u16(values: &[f32], q: Quant) -> Vec<u16> {
    // Clamped first to a range that rounds and shifts to the same saturated value; NaN becomes
    // 0, as `round() as i64` makes it. Then every step is exact in i32 (|y| <= 2^17) and
    // vectorizes: truncation, the exact fraction, half away from zero.
    let (lo, hi, off) = (q.offset as f32 - 1.0, 65536.0 + q.offset as f32, q.offset);
    values
        .iter()
        .map(|&v| {
            let y = v / q.scale;
            let y = if y.is_nan() { 0.0 } else { y.max(lo).min(hi) };
            let a = y.abs();
            let t = a as i32;
            let r = t + (a - t as f32 >= 0.5) as i32;
            let r = if y < 0.0 { -r } else { r };
            (r - off).clamp(0, 65535) as u16
        })
        .collect()
}

pub(super) fn quantize_one(v: f32, q: Quant, lo: i64, hi: i64) -> i64 {
    // `as i64` saturates (+inf to i64::MAX): the offset must not wrap it around.
    let x = ((v / q.scale).round() as i64).saturating_sub(q.offset as i64);
    x.clamp(lo, hi)
}
