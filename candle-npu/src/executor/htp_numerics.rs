//! The arithmetic of the QNN HTP library, reproduced on the host: what [`super::HostExecutor`]
//! computes in [`Numerics::Htp`] mode, so that accuracy on the NPU can be measured at host speed
//! (the x86 emulator runs about a token a second) and a CPU margin can compute the rows an NPU
//! chunk would have.
//!
//! Measured on the QNN 2.40 / HTP API 5.51 x86 library (`onnxruntime-qnn` 2.7.0, SoC SM8650) and
//! checked against it by `candle-npu/tests/htp_conformance.rs` (per op) and `tests/hexagon.rs`
//! (every stage graph of the three real models, and whole prefills). Where the model differs from
//! the exact host arithmetic ([`Numerics::Exact`]):
//!
//! * **W8A8 / W8A16 FullyConnected, per-channel weights, F32 output** (every stage graph of a
//!   quantized prefill). The translation lowers it to a per-tensor FullyConnected under
//!   `s0 = min(s_n)` into an FP16 intermediate, then an FP16 ElementWiseMultiply by `s_n / s0`
//!   (see [`super::htp`]). The library's result is `up(h(h(acc · s_x·s0) · h(s_n / s0)))` with `h`
//!   the round-to-nearest-even FP16 rounding and `up` one f32 step away from zero (every nonzero
//!   output of the library is one f32 ulp above the FP16 value: its FP16 -> FP32 conversion).
//!   **Bit-exact on 99.6-99.7% of outputs, within one FP16 step on 99.95%.** The rest differ
//!   because the library computes `acc · s_x·s0` with its own float arithmetic: measured on
//!   per-tensor F32 outputs, errors of up to ~1.5e-6 relative even without an activation offset,
//!   and absolute ones of about an f32 ulp of the uncorrected sum with one (its offset correction
//!   in float), so up to ~1e-5 on values near 1. Near an FP16 rounding tie that lands on the
//!   other neighbour: one intermediate step, up to three steps of the output; on outputs near
//!   zero, where that absolute error spans several FP16 steps, more (measured up to 21 steps at
//!   |y| ~ 1e-4 in tensors reaching ~1). Not modelled: it is not IEEE f32 arithmetic (no single
//!   scale, no single rounding reproduces it), and whole prefills show what it costs
//!   (`docs/accuracy.md`: logits up to about one apart after 30 layers, perplexity unchanged).
//! * **Per-tensor FullyConnected with an F32 output**: the library's output is f32, not FP16,
//!   within the same ~1e-5 absolute (its offset correction in float); the model keeps the exact
//!   value (tolerance, not bit-exact). With an I32 accumulator (+ Dequantize) it is exact.
//! * **F32 FullyConnected** (a float prefill's stage graphs): HTP computes it in FP16; the model
//!   rounds the input, weights, bias and output to FP16 (the library's accumulation inside is not
//!   modelled: within the conformance test's 2e-3).
//! * **ElementWiseAdd of two F32 tensors into F32** (a residual weight's sum,
//!   [`crate::WeightQuant::PerChannelResidual`]): `up(h(h(a) + h(b)))`. Bit-exact on 99.87% of
//!   random float sums and 99.74% of a residual linear's outputs, within two FP16 steps on the
//!   rest (`htp_conformance.rs`: `elementwise_float`, `residual_int8_weights_on_the_library`).
//!   Equal shapes only: a broadcast sum (a mask over every head's scores) is not this rounding
//!   (89% bit-exact, up to 4 FP16 steps off) and is computed exactly.
//! * **Float ops of F32 operands and result** (a whole-layer graph's, `models`'
//!   `PrefillPlan::Layers`): ElementWiseMultiply, MatMul, Softmax, RmsNorm, ReluMinMax and the
//!   ops that move values (Reshape, Transpose, Concat) are modelled as the op on FP16-rounded
//!   operands, its result rounded to FP16, and an F32 graph output converted as the library does
//!   ([`fp16_rounded`] says which): Mul 99.8% bit-exact on random operands, a broadcast Mul
//!   99.77%, MatMul 98-99%, RmsNorm 99.1%, Softmax 9% (its library arithmetic is not one FP16
//!   rounding; the model is still nearer than the exact host).
//! * **Not modelled** (computed exactly, within the tolerances of the conformance test):
//!   Sigmoid (a table: 42% bit-exact against the rounding), a broadcast ElementWiseAdd, ops with
//!   a quantized operand or result, Quantize (the library rounds its F32 input to FP16 first)
//!   and Dequantize. Their quantized outputs land within one grid step of the library's.

use half::f16;

/// Which arithmetic a host graph follows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Numerics {
    /// Exact integer accumulation, f32 scaling: the reference.
    #[default]
    Exact,
    /// The QNN HTP library's results (this module).
    Htp,
}

/// Round to FP16 (nearest, ties to even) and back.
#[inline]
pub fn h(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// The FP16 step (unit in the last place) at `v`'s magnitude (subnormal magnitudes: the smallest
/// normal step): how far apart the library and the model are, in the tests.
pub fn fp16_step(v: f32) -> f32 {
    let a = v.abs().max(2f32.powi(-14));
    2f32.powi(a.log2().floor() as i32 - 10)
}

/// The library's FP16 -> F32 output conversion: one f32 step away from zero (zero, infinities
/// and NaN unchanged).
#[inline]
fn up(v: f32) -> f32 {
    if v == 0.0 || !v.is_finite() {
        v
    } else {
        f32::from_bits(v.to_bits() + 1)
    }
}

/// Whether the model computes float op `op` (F32 operands and result) as the library's FP16:
/// operands and result rounded to FP16, the op exact between. Measured per op against the
/// library (`htp_conformance.rs`): ElementWiseMultiply, equal-shape ElementWiseAdd, MatMul,
/// Softmax, RmsNorm and the ops that move values are; Sigmoid (a table, 42% bit-exact against
/// the rounding) and a broadcast ElementWiseAdd (89%) are not, and stay exact.
pub fn fp16_rounded<'g>(op: &crate::graph::Op, shape: impl Fn(crate::graph::TensorId) -> &'g Vec<usize>) -> bool {
    use crate::graph::Op;
    match *op {
        Op::Sigmoid { .. } => false,
        Op::Add { a, b, .. } => shape(a) == shape(b),
        _ => true,
    }
}

/// FP16 values as the library returns them in an F32 graph output: each one f32 step away from
/// zero (its FP16 -> FP32 conversion).
pub fn fp16_output(mut v: Vec<f32>) -> Vec<f32> {
    v.iter_mut().for_each(|x| *x = up(*x));
    v
}

/// The per-column factors of a per-channel FullyConnected with an F32 output as the HTP lowering
/// applies them: the accumulator scale `s_x · s0` (`s0` the smallest channel scale) and the FP16
/// channel ratios `h(s_n / s0)`.
pub struct ChannelScales {
    acc_scale: f32,
    ratios: Vec<f32>,
}

impl ChannelScales {
    /// `x_scale` the activation scale, `scales` the weight's per-channel scales.
    pub fn new(x_scale: f32, scales: &[f32]) -> Self {
        // The same f32 operations as the translation (`executor::htp`), so the same ratios.
        let s0 = scales.iter().fold(f32::INFINITY, |m, &s| m.min(s));
        ChannelScales { acc_scale: x_scale * s0, ratios: scales.iter().map(|&s| h(s / s0)).collect() }
    }

    /// One output row: the exact i32 accumulators in, the library's f32 values out, written over
    /// the accumulators as the f32's bits (as the host's own `dequantize_row` does).
    pub fn apply_row(&self, acc: &mut [i32]) {
        for (a, &r) in acc.iter_mut().zip(&self.ratios) {
            let y = up(h(h(*a as f32 * self.acc_scale) * r));
            *a = y.to_bits() as i32;
        }
    }

    /// As [`Self::apply_row`] on i64 accumulators (W8A16), into f32 values.
    pub fn apply_row_i64(&self, acc: &[i64], out: &mut Vec<f32>) {
        out.extend(acc.iter().zip(&self.ratios).map(|(&a, &r)| up(h(h((a as f64 * self.acc_scale as f64) as f32) * r))));
    }
}

/// Every value rounded to FP16 (a float tensor as HTP holds it).
pub fn round_all(mut v: Vec<f32>) -> Vec<f32> {
    round_slice(&mut v);
    v
}

/// [`h`] of every value in place, through `half`'s slice conversions (F16C on x86_64, FP16
/// conversions on aarch64, chosen at run time): the HTP numerics round every float op's operands
/// and result, and one value at a time this was a fifth of a whole-layer prefill.
pub fn round_slice(v: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    let mut buf = [f16::ZERO; 512];
    for chunk in v.chunks_mut(buf.len()) {
        let b = &mut buf[..chunk.len()];
        b.convert_from_f32_slice(chunk);
        b.convert_to_f32_slice(chunk);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slice conversion rounds as [`h`] does, bit for bit: ties, subnormals, overflow.
    #[test]
    fn round_slice_is_h_of_every_value() {
        let mut v: Vec<f32> = (0..=u32::MAX).step_by(4099).map(f32::from_bits).collect();
        v.extend([1.0 + 2f32.powi(-11), 65504.0, 65520.0, 65519.99, 2f32.powi(-24), 2f32.powi(-25), 3.0 * 2f32.powi(-26), -0.0, f32::INFINITY]);
        let want: Vec<f32> = v.iter().map(|&x| h(x)).collect();
        round_slice(&mut v);
        for (i, (&a, &b)) in v.iter().zip(&want).enumerate() {
            assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "value {i}: {a:e} against h's {b:e}");
        }
    }

    #[test]
    fn fp16_rounding_and_the_output_step() {
        // 1 + 2^-11 is a tie between 1 and 1 + 2^-10: to even.
        assert_eq!(h(1.0 + 2f32.powi(-11)), 1.0);
        assert_eq!(h(1.0 + 3.0 * 2f32.powi(-11)), 1.0 + 2.0 * 2f32.powi(-10));
        assert_eq!(h(70000.0), f32::INFINITY);
        assert_eq!(up(0.0), 0.0);
        assert_eq!(up(1.0), 1.0 + f32::EPSILON);
        assert_eq!(up(-2.0), -(2.0 + 2.0 * f32::EPSILON));
        assert_eq!(fp16_step(1.0), 2f32.powi(-10));
        assert_eq!(fp16_step(-3.0), 2f32.powi(-9));
        assert_eq!(fp16_step(0.0), 2f32.powi(-24));
    }

    #[test]
    fn channel_scales_follow_the_lowering() {
        let s = ChannelScales::new(0.5, &[0.01, 0.03]);
        let mut acc = [1000, -1000];
        s.apply_row(&mut acc);
        let y = acc.map(|b| f32::from_bits(b as u32));
        // 1000 · 0.5 · 0.01 = 5 (exact in FP16), ratios 1 and 3 (h(3.0000002) = 3).
        assert_eq!(y, [up(5.0), up(-15.0)]);
        let mut out = vec![];
        s.apply_row_i64(&[1000, -1000], &mut out);
        assert_eq!(out, y);
    }
}
