//! The decode products' input: an activation row quantized to Q8_0 blocks, with the block sums
//! and the second layout the x86 kernels read (see [`Q8Activation`]).

#[cfg(target_arch = "x86_64")]
use super::x86;
use super::QK;

/// The activation as Q8_0 blocks: per 32 values one f32 scale and 32 i8 (ggml's
/// `quantize_row_q8_0`: `d = max|x| / 127`, `q = round(x / d)`, so `q` is in [-127, 127]), and
/// per block the sum of its `q` (for [`gemv_q4_1`](super::gemv_q4_1)'s minimum term, and Avx512's Q8_0).
///
/// [`gemv_q8_0`](super::gemv_q8_0) needs `q` in [-127, 127] on its AVX2 and Neon paths (AVX2 negates `q`, and
/// -(-128) wraps; both add two byte products in an i16, which two (-128) * (-128) overflow), and
/// asserts it there; Dotprod and Portable take any i8. Build the fields by hand only with that
/// range, or the same call panics on one CPU and not on another. [`gemv_q4_1`](super::gemv_q4_1) takes any i8 but
/// needs `sums` to be the blocks' sums, as [`gemv_q8_0`](super::gemv_q8_0) does on Avx512, and both assert that. Built by hand, it is built by
/// [`Q8Activation::from_parts`], which derives the values' second layout.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Q8Activation {
    /// One per block of 32 values (`q.len() / 32`).
    pub scales: Vec<f32>,
    /// The quantized values, in [-127, 127]. Changed in place, they no longer match their second
    /// layout (`groups`): build the activation again ([`Q8Activation::from_parts`]).
    pub q: Vec<i8>,
    /// One per block: the sum of its 32 `q` (exact: at most 32 * 128 in magnitude).
    pub sums: Vec<i32>,
    /// `q` again, for the x86 Q8_0 and Q4_1 kernels: eight blocks in 256 bytes, as eight vectors of 32
    /// whose lane i (4 bytes) is block i's values `4t..4t + 4` in vector t, zeros past the last
    /// block. One `vpdpbusd` then takes four values of each of eight blocks, and eight of them
    /// leave the blocks' sums in eight lanes: no horizontal sums per block and row (which were
    /// most of a batched row's work). Written with `q`, once per token, and read by every
    /// weight row.
    pub(super) groups: Vec<i8>,
}

impl Q8Activation {
    /// `x` (K values, K a multiple of 32) quantized.
    pub fn quantize(x: &[f32]) -> Self {
        let mut a = Self::default();
        a.quantize_into(x);
        a
    }

    /// `x` quantized into this activation's buffers: once they have the capacity of one token's
    /// K, decode quantizes every later token without allocating.
    ///
    /// As ggml (`q = round(x * (1 / d))`, half away from zero); an all-zero block has scale 0 and
    /// q 0. `|x * (1 / d)|` is at most 127 plus a rounding, so `q` is in [-127, 127]; the clamp
    /// only makes that a guarantee (a NaN passes it, and `as i8` makes it 0).
    pub fn quantize_into(&mut self, x: &[f32]) {
        assert!(x.len().is_multiple_of(QK), "Q8Activation: {} values is not a whole number of 32-value blocks", x.len());
        // Every buffer is written whole below, so growing is the only fill.
        let nb = x.len() / QK;
        self.q.resize(x.len(), 0);
        self.scales.resize(nb, 0.0);
        self.sums.resize(nb, 0);
        self.groups.resize(nb.div_ceil(8) * 256, 0);
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::cpu::cpu().avx2 {
            // SAFETY: the CPU has AVX2, and the buffers are sized for `x` just above.
            return unsafe { x86::quantize_avx2(x, self) };
        }
        self.quantize_blocks(x)
    }

    /// An activation from its parts (`q` and `scales` block for block, `sums` as [`Q8Activation`]
    /// says), with the kernels' second layout of `q` derived.
    pub fn from_parts(scales: Vec<f32>, q: Vec<i8>, sums: Vec<i32>) -> Self {
        let mut a = Q8Activation { scales, q, sums, groups: Vec::new() };
        a.group();
        a
    }

    /// Fills `groups` from `q` (see the field).
    pub(super) fn group(&mut self) {
        let nb = self.q.len() / QK;
        self.groups.clear();
        self.groups.resize(nb.div_ceil(8) * 256, 0);
        // Per group of eight blocks an 8 x 8 transpose of 4-byte pieces: block i's piece t to
        // `32 t + 4 i`.
        for (out, blocks) in self.groups.chunks_exact_mut(256).zip(self.q.chunks(8 * QK)) {
            for (i, qb) in blocks.chunks_exact(QK).enumerate() {
                for (t, four) in qb.chunks_exact(4).enumerate() {
                    out[32 * t + 4 * i..][..4].copy_from_slice(four);
                }
            }
        }
    }

    /// The portable quantizer (`x86::quantize_avx2` is the same values in vectors), into
    /// buffers sized for `x`.
    pub(super) fn quantize_blocks(&mut self, x: &[f32]) {
        let blocks = x.chunks_exact(QK).zip(self.q.chunks_exact_mut(QK)).zip(self.scales.iter_mut().zip(&mut self.sums));
        for ((xb, qb), (d, sum)) in blocks {
            // The largest |x| lane by lane, then over the lanes: the same value as a fold in
            // value order (a maximum of the same values, a NaN never taken: `a > m` is false),
            // but in vectors (`vmaxps`; `f32::max`'s NaN rule kept it scalar, and the fold was a
            // chain of dependent `max`es: 40% of the quantizer's time).
            let mut lanes = [0f32; 8];
            for eight in xb.chunks_exact(8) {
                for (m, v) in lanes.iter_mut().zip(eight) {
                    let a = v.abs();
                    *m = if a > *m { a } else { *m };
                }
            }
            let amax = lanes.iter().fold(0f32, |m, &a| if a > m { a } else { m });
            *d = amax / 127.0;
            let id = if *d != 0.0 { 1.0 / *d } else { 0.0 };
            for (q, &v) in qb.iter_mut().zip(xb) {
                *q = crate::kernels::rows::round_clamp(v * id, -127, 127) as i8;
            }
            *sum = qb.iter().map(|&q| q as i32).sum();
        }
        self.group();
    }
}
