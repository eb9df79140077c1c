//! The decode matrix-vector product (M = 1) on weights in ggml's blocks, at memory speed: Q8_0
//! and Q4_1 here, Q4_0, Q5_0, Q4_K, Q5_K and Q6_K in `formats` ([`BlockFormat`] names them all,
//! [`gemv`] runs any, [`BlockMatrix`] holds a matrix where it lives and multiplies it).
//!
//! Decode reads every weight once per token and does two operations per weight byte, so its speed
//! is the memory's: the kernel only has to keep the loads coming. It reads the weights where they
//! are, in candle's block storage (`QTensor::data()`, rows = output features; a row of K weights
//! is K / 32 blocks, rows one after another), so there is no second copy of the weights:
//! - Q8_0 (`BlockQ8_0`): per 32 consecutive weights of a row, 34 bytes, an f16 scale `d`
//!   (little-endian) then 32 i8 `q`; weight i is `d * q[i]`.
//! - Q4_1 (`BlockQ4_1`; the layers of SmolLM2's GGUF, whose tied table is Q8_0): per 32 weights, 20 bytes, an
//!   f16 scale `d` and an f16 minimum `m` (little-endian) then 16 bytes `qs` of two 4-bit weights
//!   each; weight j (0..16) is `d * (qs[j] & 0x0F) + m`, weight j + 16 is `d * (qs[j] >> 4) + m`
//!   (candle's `BlockQ4_1::to_float`, ggml's `dequantize_row_q4_1`).
//!
//! The activation is quantized once per token to Q8_0 blocks ([`Q8Activation`], ggml's
//! `quantize_row_q8_0`, as candle's Q8_0 matmul does) but with an f32 scale where ggml rounds it
//! to f16: the block dot products are then exact in i32, and the only float work is per block
//! - Q8_0: one multiply-add, `d_w * d_x * sum_i q_i qx_i`;
//! - Q4_1: two, `d_w * d_x * sum_i q_i qx_i + m_w * d_x * sum_i qx_i` (with `q_i` the unsigned
//!   nibbles, 0..15: the sum of `(d_w q_i + m_w) * d_x qx_i`), the activation's block sums
//!   `sum_i qx_i` computed once per token ([`Q8Activation::sums`], as ggml's Q8_1 blocks carry
//!   theirs for its Q4_1 product).
//!
//! Paths, chosen once per process ([`GemvPath::detect`]; tests run every path this machine has):
//! - [`GemvPath::Avx2`] (x86_64 with AVX2, FMA and F16C): a Q8_0 block of 32 i8 x 32 i8 in four
//!   instructions with ggml's sign trick (`vpsignb` twice, `vpmaddubsw`, `vpmaddwd` by ones), a
//!   Q4_1 block's nibbles unpacked into 32 bytes (a broadcast load, a shift of its upper half and
//!   a mask) and then `vpmaddubsw` directly (the nibbles are the unsigned operand); the rows one
//!   after another so that the weights are one sequential stream, prefetched 8 KiB ahead (see
//!   `x86` for why, and the measurements).
//! - [`GemvPath::Dotprod`] (aarch64 with FEAT_DotProd, every phone core since the Cortex-A55 and
//!   A76): a block of 32 i8 x 32 i8 in two `sdot` (16 multiply-adds each, into i32: nothing
//!   saturates, a -128 anywhere is fine), a Q4_1 block's nibbles unpacked with `and` and `ushr`
//!   (0..15, the same as signed bytes); the f16 scales of four blocks converted at once
//!   (`fcvtl`), four accumulators; no software prefetch (Arm's prefetchers follow a stream
//!   across pages). See `aarch64` for why, and the instruction counts.
//! - [`GemvPath::I8mm`] (aarch64 with FEAT_I8MM too, Snapdragon 8 Gen 1 on): Q8_0 and Q4_1 take
//!   two input rows by two weight rows per `smmla`, a single row paired with itself, so a
//!   speculative verifier's second row is free and each row has the bits it gets alone
//!   ([`gemv_pair`]); its own float order (one FMA chain per output), so it does not agree with
//!   Dotprod to the bit. The other formats run Dotprod's kernels.
//! - [`GemvPath::Neon`] (any aarch64 CPU: NEON is baseline): the same with the products widened
//!   to i16 (`smull`, `smlal`: two products per i16, which a Q8_0 activation of -128 could
//!   overflow, so this path refuses it as the AVX2 one does) and pairs added into i32; the same
//!   i32 lanes as `sdot`'s, so that it agrees with Dotprod to the bit.
//! - [`GemvPath::Portable`]: plain Rust, any CPU, and the SIMD paths' cross-check.

use std::ops::Range;
use std::sync::OnceLock;

mod formats;

/// Values per block (Q8_0 and Q4_1 alike).
pub const QK: usize = 32;
/// Bytes per Q8_0 weight block: an f16 scale, then 32 i8.
pub const BLOCK_BYTES: usize = 34;
/// Bytes per Q4_1 weight block: an f16 scale and an f16 minimum, then 32 4-bit weights.
pub const Q4_1_BLOCK_BYTES: usize = 20;

/// The activation as Q8_0 blocks: per 32 values one f32 scale and 32 i8 (ggml's
/// `quantize_row_q8_0`: `d = max|x| / 127`, `q = round(x / d)`, so `q` is in [-127, 127]), and
/// per block the sum of its `q` (for [`gemv_q4_1`]'s minimum term).
///
/// [`gemv_q8_0`] needs `q` in [-127, 127] on its AVX2 and Neon paths (AVX2 negates `q`, and
/// -(-128) wraps; both add two byte products in an i16, which two (-128) * (-128) overflow), and
/// asserts it there; Dotprod and Portable take any i8. Build the fields by hand only with that
/// range, or the same call panics on one CPU and not on another. [`gemv_q4_1`] takes any i8 but
/// needs `sums` to be the blocks' sums, and asserts that.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Q8Activation {
    /// One per block of 32 values (`q.len() / 32`).
    pub scales: Vec<f32>,
    /// The quantized values, in [-127, 127].
    pub q: Vec<i8>,
    /// One per block: the sum of its 32 `q` (exact: at most 32 * 128 in magnitude).
    pub sums: Vec<i32>,
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
        // Compiled for AVX2 too where the CPU has it: the x86-64 baseline has no rounding
        // instruction, and `round` was a libm call per value (2% of a decode step).
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            #[target_feature(enable = "avx2")]
            fn wide(a: &mut Q8Activation, x: &[f32]) {
                a.quantize_blocks(x)
            }
            // SAFETY: the CPU has AVX2.
            return unsafe { wide(self, x) };
        }
        self.quantize_blocks(x)
    }

    #[inline(always)]
    fn quantize_blocks(&mut self, x: &[f32]) {
        self.q.resize(x.len(), 0);
        self.scales.resize(x.len() / QK, 0.0);
        self.sums.resize(x.len() / QK, 0);
        let blocks = x.chunks_exact(QK).zip(self.q.chunks_exact_mut(QK)).zip(self.scales.iter_mut().zip(&mut self.sums));
        for ((xb, qb), (d, sum)) in blocks {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            *d = amax / 127.0;
            let id = if *d != 0.0 { 1.0 / *d } else { 0.0 };
            for (q, &v) in qb.iter_mut().zip(xb) {
                *q = (v * id).round().clamp(-127.0, 127.0) as i8;
            }
            *sum = qb.iter().map(|&q| q as i32).sum();
        }
    }
}

/// Which kernel [`gemv_q8_0`] and [`gemv_q4_1`] run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvPath {
    /// x86_64 with AVX-512 F, BW, VL and VNNI besides AVX2, FMA and F16C (AMD Zen 4 on, Intel
    /// Ice Lake on): `vpdpbusd` multiplies 32 bytes and sums them into i32 in one instruction,
    /// and a block's 32 fifth bits become a byte mask in one (`formats`: Q4_0 and Q5_0, the
    /// formats whose kernels it speeds up); every other format runs the AVX2 kernels here.
    Avx512,
    /// x86_64 with AVX2, FMA and F16C (every AVX2 CPU has F16C: Intel since Ivy Bridge, AMD
    /// since Piledriver, so asking for it loses no machine and spares a path without it).
    Avx2,
    /// aarch64 with FEAT_I8MM besides FEAT_DotProd (Cortex-A510/A710 and later: Snapdragon 8
    /// Gen 1 on): Q8_0 takes two input rows and two weight rows at a time by `smmla` (a 2 x 2
    /// block of 8-byte dot products per instruction), one input row paired with itself, so a
    /// verifier's second row costs what the first does ([`gemv_pair`]); Q4_1 the same, the other
    /// formats run the Dotprod kernels.
    I8mm,
    /// aarch64 with FEAT_DotProd (`sdot`: Cortex-A55/A76 and later, every Snapdragon since the
    /// 855): 16 byte products summed into 4 i32 lanes per instruction.
    Dotprod,
    /// aarch64, any CPU (NEON is in the aarch64 baseline): the byte products widened to i16
    /// (`smull`/`smlal`), for the CPUs without `sdot` (Cortex-A53/A72/A73).
    Neon,
    /// Plain Rust: any CPU.
    Portable,
}

impl GemvPath {
    /// The fastest path this CPU runs, detected once.
    pub fn detect() -> Self {
        static PATH: OnceLock<GemvPath> = OnceLock::new();
        *PATH.get_or_init(|| {
            // Fastest first: at most one of the x86 and Arm paths runs on any CPU.
            [GemvPath::Avx512, GemvPath::Avx2, GemvPath::I8mm, GemvPath::Dotprod, GemvPath::Neon]
                .into_iter()
                .find(|p| p.runs_here())
                .unwrap_or(GemvPath::Portable)
        })
    }

    /// Whether this CPU has the features the path is compiled for.
    pub fn runs_here(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            GemvPath::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            GemvPath::Avx512 => {
                GemvPath::Avx2.runs_here()
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            GemvPath::Avx2 | GemvPath::Avx512 => false,
            #[cfg(target_arch = "aarch64")]
            GemvPath::I8mm => super::arm::has_dotprod() && super::arm::has_i8mm(),
            #[cfg(target_arch = "aarch64")]
            GemvPath::Dotprod => super::arm::has_dotprod(),
            #[cfg(target_arch = "aarch64")]
            GemvPath::Neon => true,
            #[cfg(not(target_arch = "aarch64"))]
            GemvPath::I8mm | GemvPath::Dotprod | GemvPath::Neon => false,
            GemvPath::Portable => true,
        }
    }

    /// Whether the path's Q8_0 kernel takes an activation of -128. Avx2 and Neon do not: they
    /// add two byte products in an i16, which (-128) * (-128) twice overflows (see their docs).
    /// `sdot` and the portable path form every product and sum in i32 and take any i8.
    fn takes_minus_128(self) -> bool {
        match self {
            GemvPath::Avx2 | GemvPath::Avx512 | GemvPath::Neon => false,
            GemvPath::I8mm | GemvPath::Dotprod | GemvPath::Portable => true,
        }
    }
}

/// `out[j] = sum over blocks b of d_w(r, b) * d_x(b) * sum_i w[r, b, i] * q_x[b, i]` for the rows
/// `r` in `rows` (`out[j]` is row `rows.start + j`), on [`GemvPath::detect`]'s path.
///
/// `w` is whole rows of K weights in Q8_0 blocks (see the module docs), `k` a multiple of 32.
/// A caller splits the rows over its threads by giving each a sub-range and its part of `out`.
/// Wrong sizes are the caller's bug and panic, naming them.
pub fn gemv_q8_0(w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>, out: &mut [f32]) {
    gemv_q8_0_on(GemvPath::detect(), w, k, x, rows, out)
}

/// [`gemv_q8_0`] on `path` (tests run every path this machine runs); panics if the CPU lacks
/// the path's features.
pub fn gemv_q8_0_on(path: GemvPath, w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>, out: &mut [f32]) {
    let Some((w, nb)) = checked_rows("gemv_q8_0", BLOCK_BYTES, QK, w, k, x, &rows, out) else {
        return;
    };
    assert!(path.runs_here(), "gemv_q8_0: this CPU cannot run {path:?}");
    // `contains` on bytes is a memchr: K bytes, against rows.len() * K of weights.
    assert!(
        path.takes_minus_128() || !x.q.contains(&i8::MIN),
        "gemv_q8_0: the activation has a -128, which {path:?} cannot take (Q8Activation::quantize gives [-127, 127])"
    );
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2, FMA and F16C (asserted above); `w` is `out.len()` whole rows
        // of `nb` blocks and the activation has `nb` blocks (`checked_rows`), with no -128
        // (asserted above).
        GemvPath::Avx2 | GemvPath::Avx512 => unsafe { x86::gemv_avx2(w, nb, x, out) },
        #[cfg(not(target_arch = "x86_64"))]
        GemvPath::Avx2 | GemvPath::Avx512 => unreachable!("GemvPath::{path:?} never runs off x86_64 (asserted above)"),
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the CPU has dotprod (asserted above); `w` is `out.len()` whole rows of `nb`
        // blocks and the activation has `nb` blocks (`checked_rows`).
        GemvPath::Dotprod => unsafe { aarch64::gemv_q8_0_dotprod(w, nb, x, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the CPU has i8mm (asserted above); as for Dotprod. One input row is paired
        // with itself: its outputs are what it gets beside any other row.
        GemvPath::I8mm => unsafe { aarch64::gemv_q8_0_i8mm(w, nb, [x, x], out, None) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as for Dotprod, NEON being in the aarch64 baseline, and no -128 in the
        // activation (asserted above).
        GemvPath::Neon => unsafe { aarch64::gemv_q8_0_neon(w, nb, x, out) },
        #[cfg(not(target_arch = "aarch64"))]
        GemvPath::I8mm | GemvPath::Dotprod | GemvPath::Neon => unreachable!("GemvPath::{path:?} never runs off aarch64 (asserted above)"),
        GemvPath::Portable => gemv_portable(w, nb, x, out),
    }
}

/// [`gemv`] of two input rows at once: `out0` for `x0`, `out1` for `x1`, each with the bits
/// [`gemv`] gives that row alone. On [`GemvPath::I8mm`], Q8_0 and Q4_1 share every instruction
/// between the two (`smmla` takes two input rows by two weight rows), so a speculative
/// verifier's second row is nearly free; elsewhere, and for the other formats, it is two calls.
#[allow(clippy::too_many_arguments)]
pub fn gemv_pair(format: BlockFormat, w: &[u8], k: usize, x0: &Q8Activation, x1: &Q8Activation, rows: Range<usize>, out0: &mut [f32], out1: &mut [f32]) {
    gemv_pair_on(GemvPath::detect(), format, w, k, x0, x1, rows, out0, out1)
}

/// [`gemv_pair`] on `path`; panics if the CPU lacks the path's features.
#[allow(clippy::too_many_arguments)]
pub fn gemv_pair_on(
    path: GemvPath,
    format: BlockFormat,
    w: &[u8],
    k: usize,
    x0: &Q8Activation,
    x1: &Q8Activation,
    rows: Range<usize>,
    out0: &mut [f32],
    out1: &mut [f32],
) {
    if path != GemvPath::I8mm || !matches!(format, BlockFormat::Q8_0 | BlockFormat::Q4_1) {
        gemv_on(path, format, w, k, x0, rows.clone(), out0);
        return gemv_on(path, format, w, k, x1, rows, out1);
    }
    let name = "gemv_pair";
    assert_eq!(x1.q.len(), x0.q.len(), "{name}: rows of {} and {} values", x0.q.len(), x1.q.len());
    assert_eq!(out1.len(), out0.len(), "{name}: outputs of {} and {} values", out0.len(), out1.len());
    let block_bytes = if format == BlockFormat::Q8_0 { BLOCK_BYTES } else { Q4_1_BLOCK_BYTES };
    let Some((w, nb)) = checked_rows(name, block_bytes, QK, w, k, x0, &rows, out0) else {
        return out1.fill(0.0);
    };
    assert_eq!(x1.scales.len(), nb, "{name}: the second row has {} scales for {nb} blocks", x1.scales.len());
    assert!(path.runs_here(), "{name}: this CPU cannot run {path:?}");
    if format == BlockFormat::Q4_1 {
        assert_sums(name, x0);
        assert_sums(name, x1);
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: the CPU has i8mm (asserted); `w` is `out0.len()` whole rows of `nb` blocks, both
    // activations have `nb` blocks (and, for Q4_1, sums: asserted), and `out1` is as long as
    // `out0` (asserted).
    unsafe {
        match format {
            BlockFormat::Q8_0 => aarch64::gemv_q8_0_i8mm(w, nb, [x0, x1], out0, Some(out1)),
            _ => aarch64::gemv_q4_1_i8mm(w, nb, [x0, x1], out0, Some(out1)),
        }
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        let _ = (w, nb);
        unreachable!("GemvPath::I8mm never runs off aarch64 (asserted above)")
    }
}

/// `out[j] = sum over blocks b of d_w(r, b) * d_x(b) * sum_i q[r, b, i] * q_x[b, i] +
/// m_w(r, b) * d_x(b) * sum_i q_x[b, i]` for the rows `r` in `rows`: the product of the
/// dequantized weights `d_w * q + m_w` (`q` the nibbles, 0..15) with the quantized activation,
/// on [`GemvPath::detect`]'s path.
///
/// As [`gemv_q8_0`], for `w` in Q4_1 blocks (see the module docs). The activation's `sums` must
/// be its blocks' sums (as [`Q8Activation::quantize`] fills them); any i8 is taken, -128 too.
pub fn gemv_q4_1(w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>, out: &mut [f32]) {
    gemv_q4_1_on(GemvPath::detect(), w, k, x, rows, out)
}

/// [`gemv_q4_1`] on `path` (tests run every path this machine runs); panics if the CPU lacks
/// the path's features.
pub fn gemv_q4_1_on(path: GemvPath, w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>, out: &mut [f32]) {
    let Some((w, nb)) = checked_rows("gemv_q4_1", Q4_1_BLOCK_BYTES, QK, w, k, x, &rows, out) else {
        return;
    };
    assert!(path.runs_here(), "gemv_q4_1: this CPU cannot run {path:?}");
    assert_sums("gemv_q4_1", x);
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2, FMA and F16C (asserted above); `w` is `out.len()` whole rows
        // of `nb` blocks and the activation has `nb` blocks (`checked_rows`) and `nb` sums
        // (asserted above).
        GemvPath::Avx2 | GemvPath::Avx512 => unsafe { x86::gemv_q4_1_avx2(w, nb, x, out) },
        #[cfg(not(target_arch = "x86_64"))]
        GemvPath::Avx2 | GemvPath::Avx512 => unreachable!("GemvPath::{path:?} never runs off x86_64 (asserted above)"),
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the CPU has dotprod (asserted above); `w` is `out.len()` whole rows of `nb`
        // blocks and the activation has `nb` blocks (`checked_rows`) and `nb` sums (asserted
        // above).
        GemvPath::Dotprod => unsafe { aarch64::gemv_q4_1_dotprod(w, nb, x, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the CPU has i8mm (asserted above); as for Dotprod. One input row is paired
        // with itself, as Q8_0's.
        GemvPath::I8mm => unsafe { aarch64::gemv_q4_1_i8mm(w, nb, [x, x], out, None) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as for Dotprod, NEON being in the aarch64 baseline.
        GemvPath::Neon => unsafe { aarch64::gemv_q4_1_neon(w, nb, x, out) },
        #[cfg(not(target_arch = "aarch64"))]
        GemvPath::I8mm | GemvPath::Dotprod | GemvPath::Neon => unreachable!("GemvPath::{path:?} never runs off aarch64 (asserted above)"),
        GemvPath::Portable => gemv_q4_1_portable(w, nb, x, out),
    }
}

/// That `x`'s block sums are its values' (`name`: the caller's, for the message): K additions,
/// against rows.len() * K weights (as `gemv_q8_0`'s memchr). A format with a minimum term needs
/// them, and a wrong sum would shift every row's result by `m_w * d_x` times its error, silently.
fn assert_sums(name: &str, x: &Q8Activation) {
    assert_eq!(x.sums.len(), x.scales.len(), "{name}: the activation has {} block sums for {} blocks", x.sums.len(), x.scales.len());
    assert!(
        x.q.chunks_exact(QK).zip(&x.sums).all(|(qb, &s)| qb.iter().map(|&q| q as i32).sum::<i32>() == s),
        "{name}: the activation's block sums are not its values' (Q8Activation::quantize fills them)"
    );
}

/// ggml's block formats that the decode product reads where they are (candle's [`GgmlDType`]s
/// of the same names): Q8_0 and Q4_1 in this file, the others in `formats`.
///
/// [`GgmlDType`]: candle_core::quantized::GgmlDType
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockFormat {
    /// 32 weights in 18 bytes: a scale, 4-bit values offset by 8.
    Q4_0,
    /// 32 weights in 20 bytes: a scale and a minimum, 4-bit values.
    Q4_1,
    /// 32 weights in 22 bytes: a scale, 5-bit values offset by 16.
    Q5_0,
    /// 32 weights in 34 bytes: a scale, 8-bit values.
    Q8_0,
    /// 256 weights in 144 bytes: 8 sub-blocks with 6-bit scales and minimums, 4-bit values.
    Q4K,
    /// 256 weights in 176 bytes: as Q4K with 5-bit values.
    Q5K,
    /// 256 weights in 210 bytes: 16 sub-blocks with i8 scales, 6-bit values offset by 32.
    Q6K,
}

impl BlockFormat {
    /// Every format.
    pub const ALL: [BlockFormat; 7] =
        [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q5_0, BlockFormat::Q8_0, BlockFormat::Q4K, BlockFormat::Q5K, BlockFormat::Q6K];

    /// The format of candle's `dtype`, if the decode product reads it.
    pub fn of(dtype: candle_core::quantized::GgmlDType) -> Option<Self> {
        use candle_core::quantized::GgmlDType as G;
        Some(match dtype {
            G::Q4_0 => BlockFormat::Q4_0,
            G::Q4_1 => BlockFormat::Q4_1,
            G::Q5_0 => BlockFormat::Q5_0,
            G::Q8_0 => BlockFormat::Q8_0,
            G::Q4K => BlockFormat::Q4K,
            G::Q5K => BlockFormat::Q5K,
            G::Q6K => BlockFormat::Q6K,
            _ => return None,
        })
    }

    /// candle's name for it.
    pub fn dtype(self) -> candle_core::quantized::GgmlDType {
        use candle_core::quantized::GgmlDType as G;
        match self {
            BlockFormat::Q4_0 => G::Q4_0,
            BlockFormat::Q4_1 => G::Q4_1,
            BlockFormat::Q5_0 => G::Q5_0,
            BlockFormat::Q8_0 => G::Q8_0,
            BlockFormat::Q4K => G::Q4K,
            BlockFormat::Q5K => G::Q5K,
            BlockFormat::Q6K => G::Q6K,
        }
    }

    fn kind(self) -> Option<formats::Kind> {
        Some(match self {
            BlockFormat::Q4_0 => formats::Kind::Q4_0,
            BlockFormat::Q5_0 => formats::Kind::Q5_0,
            BlockFormat::Q4K => formats::Kind::Q4K,
            BlockFormat::Q5K => formats::Kind::Q5K,
            BlockFormat::Q6K => formats::Kind::Q6K,
            BlockFormat::Q8_0 | BlockFormat::Q4_1 => return None,
        })
    }

    /// Weights per block (a row of K weights is K / this many blocks).
    pub fn block_len(self) -> usize {
        self.kind().map_or(QK, |k| k.block_len())
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q8_0 => BLOCK_BYTES,
            BlockFormat::Q4_1 => Q4_1_BLOCK_BYTES,
            f => f.kind().expect("the other formats are in `formats`").block_bytes(),
        }
    }

    /// Bytes of a row of `k` weights (`k` a multiple of [`Self::block_len`]).
    pub fn row_bytes(self, k: usize) -> usize {
        k / self.block_len() * self.block_bytes()
    }
}

/// Weight `i` of one block of `format` (`blk`), as candle's `to_float` computes it (see
/// [`BlockMatrix::value`]).
fn block_value(format: BlockFormat, blk: &[u8], i: usize) -> f32 {
    let f16 = |at: usize| half::f16::from_bits(u16::from_le_bytes([blk[at], blk[at + 1]])).to_f32();
    // Block-of-32 formats: the nibble (or byte) of weight i.
    let nibble = |qs: usize| if i < 16 { blk[qs + i] & 0x0F } else { blk[qs + i - 16] >> 4 };
    match format {
        BlockFormat::Q8_0 => blk[2 + i] as i8 as f32 * f16(0),
        BlockFormat::Q4_0 => (nibble(2) as i16 - 8) as f32 * f16(0),
        BlockFormat::Q4_1 => nibble(4) as f32 * f16(0) + f16(2),
        BlockFormat::Q5_0 => {
            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            ((nibble(6) | ((qh >> i) as u8 & 1) << 4) as i32 - 16) as f32 * f16(0)
        }
        BlockFormat::Q4K | BlockFormat::Q5K => {
            let (sc, m) = formats::k_scales(blk[4..16].try_into().expect("12 scale bytes"));
            let (j, l) = (i / 32, i % 32);
            let qs = if format == BlockFormat::Q4K { 16 } else { 48 };
            let q = (blk[qs + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
            let d1 = f16(0) * sc[j] as f32;
            let m1 = f16(2) * m[j] as f32;
            match format {
                BlockFormat::Q4K => d1 * q as f32 - m1,
                _ => d1 * (q as f32 + if (blk[16 + l] >> j) & 1 == 1 { 16.0 } else { 0.0 }) - m1,
            }
        }
        BlockFormat::Q6K => {
            // Half h, group g (see `formats`), position l.
            let (h, g, l) = (i / 128, i % 128 / 32, i % 32);
            let low = (blk[64 * h + l + 32 * (g % 2)] >> (4 * (g / 2))) & 0x0F;
            let q = (low | ((blk[128 + 32 * h + l] >> (2 * g)) & 3) << 4) as i8 - 32;
            f16(208) * blk[192 + i / 16] as i8 as f32 * q as f32
        }
    }
}

/// The product of the rows `rows` of `w` (`format`'s blocks, rows of K weights) with `x`,
/// on [`GemvPath::detect`]'s path: [`gemv_q8_0`], [`gemv_q4_1`] or the other formats' kernels
/// (`formats`). `out[j]` is row `rows.start + j`; the same contract as [`gemv_q8_0`]; a format
/// with a minimum term (Q4_1, Q4_K, Q5_K) needs the activation's block sums.
pub fn gemv(format: BlockFormat, w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>, out: &mut [f32]) {
    gemv_on(GemvPath::detect(), format, w, k, x, rows, out)
}

/// [`gemv`] on `path`; panics if the CPU lacks the path's features.
pub fn gemv_on(path: GemvPath, format: BlockFormat, w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>, out: &mut [f32]) {
    let Some(kind) = format.kind() else {
        return match format {
            BlockFormat::Q8_0 => gemv_q8_0_on(path, w, k, x, rows, out),
            _ => gemv_q4_1_on(path, w, k, x, rows, out),
        };
    };
    let name = "gemv";
    let Some((w, nb)) = checked_rows(name, kind.block_bytes(), kind.block_len(), w, k, x, &rows, out) else {
        return;
    };
    assert!(path.runs_here(), "gemv {format:?}: this CPU cannot run {path:?}");
    if matches!(format, BlockFormat::Q4K | BlockFormat::Q5K) {
        assert_sums(name, x);
    }
    // SAFETY: the CPU runs `path` (asserted); `w` is `out.len()` whole rows of `nb` blocks and
    // the activation has their K / 32 blocks (`checked_rows`) and, where used, their sums
    // (asserted); the formats' kernels take any i8 activation.
    unsafe { formats::gemv(kind, path, w, nb, x, out) }
}

/// The sizes both formats check (`name` is the caller's, for the messages; `block_bytes` its
/// block size): the bytes of `rows` and the blocks per row, or `None` for K = 0, `out` then
/// zeroed (an empty sum).
fn checked_rows<'w>(
    name: &str,
    block_bytes: usize,
    block_len: usize,
    w: &'w [u8],
    k: usize,
    x: &Q8Activation,
    rows: &Range<usize>,
    out: &mut [f32],
) -> Option<(&'w [u8], usize)> {
    assert!(k.is_multiple_of(block_len), "{name}: K = {k} is not a multiple of {block_len}");
    let nb = k / block_len;
    let row_bytes = nb * block_bytes;
    assert_eq!(x.q.len(), k, "{name}: the activation has {} values for K = {k}", x.q.len());
    assert_eq!(x.scales.len(), k / QK, "{name}: the activation has {} scales for K = {k} ({} blocks)", x.scales.len(), k / QK);
    assert!(rows.start <= rows.end, "{name}: rows {rows:?} are reversed");
    assert_eq!(out.len(), rows.len(), "{name}: out has {} values for rows {rows:?}", out.len());
    if row_bytes == 0 {
        out.fill(0.0);
        return None;
    }
    assert!(
        w.len().is_multiple_of(row_bytes) && rows.end <= w.len() / row_bytes,
        "{name}: the weight's {} bytes are not whole rows of K = {k} ({row_bytes} bytes each) up to row {}",
        w.len(),
        rows.end
    );
    Some((&w[rows.start * row_bytes..rows.end * row_bytes], nb))
}

/// The portable path: per block an i32 dot of 32 i8 pairs (a fixed-size loop, for the
/// vectorizer), scaled and summed in f32. 12 GB/s on the build machine for SSE2, which has no
/// byte multiply-add: a third of its memory speed (on aarch64 the Dotprod and Neon paths replace
/// it).
fn gemv_portable(w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
    for (o, row) in out.iter_mut().zip(w.chunks_exact(nb * BLOCK_BYTES)) {
        let mut acc = 0f32;
        for ((blk, qx), &dx) in row.chunks_exact(BLOCK_BYTES).zip(x.q.chunks_exact(QK)).zip(&x.scales) {
            let dw = half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32();
            let qw: &[u8; QK] = blk[2..].try_into().expect("34-byte block");
            let qx: &[i8; QK] = qx.try_into().expect("32-value block");
            let dot: i32 = qw.iter().zip(qx).map(|(&w, &q)| w as i8 as i32 * q as i32).sum();
            acc += dw * dx * dot as f32;
        }
        *o = acc;
    }
}

/// The portable Q4_1 path: per block the i32 dot of the 16 low nibbles with the block's first 16
/// activations and of the 16 high nibbles with its last 16, then the two terms in f32 (see
/// [`gemv_q4_1`]). 6 GB/s on the build machine for SSE2 (candle's Q4_1 matmul, whose dot
/// product is scalar: 1.5 on one thread).
fn gemv_q4_1_portable(w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
    for (o, row) in out.iter_mut().zip(w.chunks_exact(nb * Q4_1_BLOCK_BYTES)) {
        let mut acc = 0f32;
        let blocks = row.chunks_exact(Q4_1_BLOCK_BYTES).zip(x.q.chunks_exact(QK)).zip(x.scales.iter().zip(&x.sums));
        for ((blk, qx), (&dx, &sx)) in blocks {
            let dw = half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32();
            let mw = half::f16::from_bits(u16::from_le_bytes([blk[2], blk[3]])).to_f32();
            let qs: &[u8; QK / 2] = blk[4..].try_into().expect("20-byte block");
            let (lo, hi) = qx.split_at(QK / 2);
            let dot: i32 = qs.iter().zip(lo).zip(hi).map(|((&q, &a), &b)| (q & 0x0F) as i32 * a as i32 + (q >> 4) as i32 * b as i32).sum();
            acc += dw * dx * dot as f32 + mw * dx * sx as f32;
        }
        *o = acc;
    }
}

/// The AVX2 path.
///
/// A block's dot product in four instructions (ggml's sign trick): `vpmaddubsw` multiplies
/// *unsigned* bytes by signed bytes, so the weight's sign moves onto the activation first:
/// `|w|` (`vpsignb w, w`) times `x * sign(w)` (`vpsignb x, w`) is `w * x`. `vpmaddubsw` sums each
/// pair of products into an i16, saturating; `vpmaddwd` by ones widens the pairs into 8 i32.
///
/// Why it never saturates: `|w|` is at most 128 (a weight of -128, which the NPU's quantizer may
/// give, becomes the byte 0x80 = 128 as the unsigned operand, its true magnitude), and
/// `x * sign(w)` at most 127 in magnitude because `x` is in [-127, 127] (asserted: -(-128) would
/// wrap to -128), so a pair sums to at most 2 * 128 * 127 = 32512 < 32767. The 8 i32 lanes (at
/// most 4 * 128 * 127 = 65024 each) are exact in f32 and take the block's scale in one FMA.
///
/// One row at a time, so that the weights are read as one sequential stream, each block asking
/// for the line `PREFETCH` bytes ahead; two accumulators (even and odd blocks) halve the FMA
/// chain. Measured single-threaded on the build machine (AMD EPYC, 2 cores; 2026-11-25, issue 26)
/// with the weights read from DRAM (copies of the matrix in turn, 512 MiB in all), for 576x1536 and
/// 49152x576, GB/s of weight bytes (one matrix repeated, from L2/L3, in brackets):
/// - four rows at a time, each activation block loaded once per four rows: 8-11 (50, 9-12). A
///   row is only 612-1632 bytes: four short streams that restart every four rows, which the
///   hardware prefetcher never locks on to; prefetching each 8-16 KiB ahead gave 27-33;
/// - one row at a time: 28-30 (50, 40); prefetching 4 KiB ahead 33-34, 8 KiB ahead 36-39 (50,
///   46), 16-32 KiB ahead no better for the short matrix and a larger overshoot past a
///   caller's rows. The activation block, reloaded per row, comes from L1.
///
/// A Q4_1 block needs no sign trick: its nibbles (0..15) are `vpmaddubsw`'s unsigned operand as
/// they are. Why it never saturates: a pair sums to at most 2 * 15 * 127 = 3810 in magnitude for
/// [`super::Q8Activation::quantize`]'s activations (2 * 15 * 128 = 3840 for a -128, which
/// [`super::gemv_q4_1`] takes), far below 32767; the 8 i32 lanes (at most 4 * 15 * 128 = 7680
/// each) are exact in f32. `d_w * d_x` scales the lanes in one FMA, and `m_w * d_x` takes the
/// block sum of the activation in another; a group of four blocks converts and multiplies its
/// four `(d, m)` pairs at once. The same prefetch and one row at a time; four accumulators.
/// Measured as above (2026-11-25), 49152x576 (SmolLM2's table) and 576x1536, GB/s of weight
/// bytes:
/// - per block: the scales with scalar instructions, two accumulators: 20, 21 (the same
///   repeated: the vector ALUs are the limit, not the memory); four accumulators no better;
/// - four blocks' scales at once as above: 24-26, 26-28 (repeated 25-26, 28-29). A block is
///   still six vector ALU instructions (shift, mask, `vpmaddubsw`, `vpmaddwd`, convert, FMA),
///   about what a Q8_0 block takes, for 20 bytes instead of 34: Q4_1 streams fewer bytes per
///   second. Two blocks per register (their products added as i16 before `vpmaddwd`, which
///   needs the activation permuted per block pair) gave 26 and 31: not worth a second layout of
///   the activation. Closing the gap takes `vpdpbusd` (AVX-VNNI or AVX-512 VNNI: the multiply
///   and the widening in one instruction), a path of its own.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::hsum8 as hsum;
    use super::{Q8Activation, BLOCK_BYTES, Q4_1_BLOCK_BYTES, QK};

    /// Bytes ahead of the current block to prefetch (see the module docs).
    pub(super) const PREFETCH: usize = 8192;

    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `w` is `out.len()` whole rows of `nb` blocks; `x` has `nb`
    /// blocks and no -128.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv_avx2(w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
        let (xq, xd) = (x.q.as_ptr(), x.scales.as_ptr());
        for (o, row) in out.iter_mut().zip(w.chunks_exact(nb * BLOCK_BYTES)) {
            // SAFETY: `row` is `nb` blocks, the activation `nb` blocks with no -128; the CPU
            // has the features.
            *o = unsafe { row_dot(row.as_ptr(), nb, xq, xd) };
        }
    }

    /// One row's product.
    ///
    /// # Safety
    /// As [`gemv_avx2`], for the `nb` blocks at `w`; inlined only into it (its features).
    #[inline(always)]
    unsafe fn row_dot(w: *const u8, nb: usize, xq: *const i8, xd: *const f32) -> f32 {
        // SAFETY: every read is of blocks below `nb`, in the row and the activation (the
        // caller's contract); prefetches never fault, wherever they point.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let block = |b: usize, acc: __m256| {
                let blk = w.add(BLOCK_BYTES * b);
                _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH).cast());
                let wv = _mm256_loadu_si256(blk.add(2).cast());
                let xv = _mm256_loadu_si256(xq.add(QK * b).cast());
                let dw = f16_to_f32(u16::from_le(blk.cast::<u16>().read_unaligned()));
                // |w| (unsigned) times x * sign(w): see the module docs for why no pair saturates.
                let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
                let dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * *xd.add(b)), acc)
            };
            let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for b in (0..nb - nb % 2).step_by(2) {
                even = block(b, even);
                odd = block(b + 1, odd);
            }
            if nb % 2 == 1 {
                even = block(nb - 1, even);
            }
            hsum(_mm256_add_ps(even, odd))
        }
    }

    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `w` is `out.len()` whole rows of `nb` Q4_1 blocks; `x` has
    /// `nb` blocks and `nb` sums.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv_q4_1_avx2(w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
        let (xq, xd, xs) = (x.q.as_ptr(), x.scales.as_ptr(), x.sums.as_ptr());
        for (o, row) in out.iter_mut().zip(w.chunks_exact(nb * Q4_1_BLOCK_BYTES)) {
            // SAFETY: `row` is `nb` blocks, the activation `nb` blocks and sums; the CPU has the
            // features.
            *o = unsafe { row_dot_q4_1(row.as_ptr(), nb, xq, xd, xs) };
        }
    }

    /// One row's Q4_1 product.
    ///
    /// # Safety
    /// As [`gemv_q4_1_avx2`], for the `nb` blocks at `w`; inlined only into it (its features).
    #[inline(always)]
    unsafe fn row_dot_q4_1(w: *const u8, nb: usize, xq: *const i8, xd: *const f32, xs: *const i32) -> f32 {
        // SAFETY: every read is of blocks below `nb`, in the row, and of the activation's first
        // `nb` blocks and sums (the caller's contract), or of `scales` below; prefetches never
        // fault, wherever they point.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let low = _mm256_set1_epi8(0x0F);
            let shifts = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
            let pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
            let blk = |b: usize| w.add(Q4_1_BLOCK_BYTES * b);
            // Block b's d and m as one i32 (little-endian: d in the low half).
            let dm = |b: usize| blk(b).cast::<i32>().read_unaligned();
            // Block b's 32 products (nibbles times activations) summed in 8 lanes, as f32.
            let dot = |b: usize| {
                // `qs` in both halves, the high one shifted right by 4 (`qs >> 4`): with the mask,
                // the low half is the low nibbles (weights 0..16), the high half the high nibbles
                // (16..32), in the order of the activation's 32 bytes. The 32-bit shift brings
                // the next byte's low bits into the top of each byte; the mask drops them.
                let qs = _mm256_broadcastsi128_si256(_mm_loadu_si128(blk(b).add(4).cast()));
                let nibbles = _mm256_and_si256(_mm256_srlv_epi32(qs, shifts), low);
                let xv = _mm256_loadu_si256(xq.add(QK * b).cast());
                // Nibbles (unsigned) times x: see the module docs for why no pair saturates.
                _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(nibbles, xv), ones))
            };
            let mut acc = [_mm256_setzero_ps(); 4];
            // The odd lanes collect the minimum terms (the even ones `d_w * d_x * sum`, unused).
            let mut mins = _mm256_setzero_ps();
            // A group's four block scales go through memory, one store and four broadcast loads
            // (load ports), where registers would take four shuffles on the vector ALUs that the
            // dot products keep busy: 5-8% faster. `black_box` hides that the loads read what was
            // just stored, or LLVM turns them back into shuffles.
            let mut scales = [0f32; 8];
            let scales_out = scales.as_mut_ptr();
            let scales_in = std::hint::black_box(scales_out);
            for b in (0..nb - nb % 4).step_by(4) {
                // A group is 80 bytes: two prefetches 40 bytes apart reach every cache line.
                _mm_prefetch::<_MM_HINT_T0>(blk(b).wrapping_add(PREFETCH).cast());
                _mm_prefetch::<_MM_HINT_T0>(blk(b).wrapping_add(PREFETCH + 2 * Q4_1_BLOCK_BYTES).cast());
                // Four blocks' [d0, m0, d1, m1, d2, m2, d3, m3] times [dx0, dx0, dx1, dx1, ...]:
                // per block `d_w * d_x`, then `m_w * d_x`, which takes the block sum in an FMA.
                let dms = _mm_insert_epi32::<1>(_mm_cvtsi32_si128(dm(b)), dm(b + 1));
                let dms = _mm_insert_epi32::<3>(_mm_insert_epi32::<2>(dms, dm(b + 2)), dm(b + 3));
                let dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(xd.add(b))), pairs);
                let scaled = _mm256_mul_ps(_mm256_cvtph_ps(dms), dx);
                let sums = _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(_mm_loadu_si128(xs.add(b).cast())), pairs);
                mins = _mm256_fmadd_ps(scaled, _mm256_cvtepi32_ps(sums), mins);
                _mm256_storeu_ps(scales_out, scaled);
                acc[0] = _mm256_fmadd_ps(dot(b), _mm256_broadcast_ss(&*scales_in), acc[0]);
                acc[1] = _mm256_fmadd_ps(dot(b + 1), _mm256_broadcast_ss(&*scales_in.add(2)), acc[1]);
                acc[2] = _mm256_fmadd_ps(dot(b + 2), _mm256_broadcast_ss(&*scales_in.add(4)), acc[2]);
                acc[3] = _mm256_fmadd_ps(dot(b + 3), _mm256_broadcast_ss(&*scales_in.add(6)), acc[3]);
            }
            // The last nb % 4 blocks one at a time, with the same roundings.
            for b in nb - nb % 4..nb {
                _mm_prefetch::<_MM_HINT_T0>(blk(b).wrapping_add(PREFETCH).cast());
                // [d * d_x, m * d_x, 0, 0], the upper lanes zero.
                let scaled = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(dm(b))), _mm_set1_ps(*xd.add(b)));
                let scaled = _mm256_set_m128(_mm_setzero_ps(), scaled);
                mins = _mm256_fmadd_ps(scaled, _mm256_set1_ps(*xs.add(b) as f32), mins);
                acc[0] = _mm256_fmadd_ps(dot(b), _mm256_broadcastss_ps(_mm256_castps256_ps128(scaled)), acc[0]);
            }
            let acc = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            hsum(_mm256_add_ps(acc, _mm256_blend_ps::<0b0101_0101>(mins, _mm256_setzero_ps())))
        }
    }

    /// An f16 (its bits) as f32, with F16C's `vcvtph2ps`: exact, subnormals included. The
    /// x86_64 kernels' one conversion of a block's f16 scales (`formats` uses it too).
    #[inline(always)]
    pub(super) unsafe fn f16_to_f32(bits: u16) -> f32 {
        // SAFETY: the caller has F16C.
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))) }
    }

    /// [`f16_to_f32`] for the tests (against the `half` crate on every bit pattern).
    ///
    /// # Safety
    /// The CPU has F16C.
    #[cfg(test)]
    #[target_feature(enable = "f16c")]
    pub(super) unsafe fn f16_bits_to_f32(bits: u16) -> f32 {
        // SAFETY: the CPU has F16C (this function's contract).
        unsafe { f16_to_f32(bits) }
    }
}

/// The aarch64 paths, [`GemvPath::Dotprod`] and [`GemvPath::Neon`]: one algorithm, two block
/// dot products.
///
/// A block's 32 byte products are summed exactly into 4 i32 lanes, lane i holding bytes 4i..4i+4
/// of both 16-byte halves:
/// - Dotprod: `sdot` twice (16 multiply-adds each, into a zeroed register: `movi`), 3
///   instructions. It forms every product and sum in i32, so nothing saturates, and it takes any
///   i8 on both sides: an activation of -128 too (|lane| <= 8 * 128 * 128 = 131072).
/// - Neon: `smull` and `smlal` (the low 8 bytes of each half: products widened to i16, the two
///   halves' products added), `smull2` and `smlal2` (the high 8 bytes), `saddlp` twice (pairs of
///   i16 into i32) and `addp` (pairs of i32): 7 instructions, whose `addp` puts the sums in
///   `sdot`'s lanes, so that both paths do the same float work on the same integers and agree to
///   the bit (a test asserts it). A byte multiply-add into i32 takes two widenings on NEON; the
///   pair sum in i16 saves two of the four `saddlp`, and holds for a Q8_0 activation in
///   [-127, 127]: 2 * 128 * 127 = 32512 < 32767, where two products of -128 by -128 are 32768
///   and wrap. So this path, as the AVX2 one, refuses a -128 in a Q8_0 activation (asserted);
///   a Q4_1 pair is at most 2 * 15 * 128 = 3840, any i8 is taken.
///
/// Per block then: the i32 lanes to f32 (`scvtf`; exact, a lane is at most 131072 < 2^24), and
/// one `fmla` by a lane of the scale vector. A group of four blocks converts its four f16 scales
/// at once (four 16-bit loads into lanes, `fcvtl`: f16 to f32 conversion is in the aarch64 baseline, only f16
/// arithmetic needs FEAT_FP16, and `vcvt_f32_f16` is stable) and multiplies them by the four
/// activation scales in one `fmul`; each block of the group has its accumulator (4 independent
/// FMA chains), the last K / 32 % 4 blocks go one each onto the first accumulators with a scalar
/// scale, and the four are summed pairwise, then `hsum4`. Q4_1's group loads four (d, m) pairs
/// (`[d0, m0, d1, m1, ...]`), converts them with `fcvtl` and `fcvtl2`, splits them (`uzp1`,
/// `uzp2`), and adds its four minimum terms in one vector FMA (`m_w * d_x` times the block sums,
/// converted); a tail block's minimum term goes into a scalar FMA. Its nibbles are `and` and
/// `ushr` of the 16 bytes: 0..15, as signed bytes the same values, `sdot` and `smull` take them
/// as they are.
///
/// Instructions per block of 32 weights, counted in the compiled group loops (rustc 1.96,
/// release; a loop of four blocks, divided by four), of which NEON arithmetic in brackets:
/// - Q8_0: Dotprod 11.25 (5.5), Neon 15.25 (9.5). A block: the weights' two halves (`ldur`, at
///   an offset of 2), the activation's (`ldp`), the dot, `scvtf`, `fmla`; a quarter of the
///   group's scale work (four 16-bit lane loads, `fcvtl`, the activation scales' `ldr`,
///   `fmul`); the addresses and the loop.
/// - Q4_1: Dotprod 14 (9), Neon 18 (13): as Q8_0 with one load of `qs` (for two), `and` and
///   `ushr`, and twice the scale work (`fcvtl` twice, `uzp1`, `uzp2`, `fmul` twice) plus the
///   minimum terms' (the block sums' load, `scvtf`, `fmla`).
///
/// Their speed on a phone cannot be measured here (qemu runs them, slowly and without a phone's
/// caches), only estimated: llvm-mca on `gemv_q8_0_dotprod`, `gemv_q4_1_dotprod`,
/// `gemv_q8_0_neon` and `gemv_q4_1_neon` (separate functions, so that their symbols exist).
///
/// For scale, an estimate from the counts and not a measurement: a Cortex-A76 issues two
/// 128-bit NEON operations and two loads per cycle, so Dotprod's Q8_0 block takes about 3 cycles
/// for 34 bytes, 25-30 GB/s at 2.4 GHz, above one core's share of a phone's memory bandwidth; an
/// in-order Cortex-A55 issues about one 128-bit NEON operation per cycle, 5.5 cycles or more per
/// block, ~11 GB/s at 1.8 GHz at best: its blocks are compute-bound.
///
/// One row after another, as on x86: the weights are one sequential stream. No software
/// prefetch, unlike x86, where it gained a quarter on that one stream (see `x86`): x86's L2
/// streamers work on physical addresses and stop at each 4 KiB page (Intel documents it), the
/// likely reason. The load prefetchers of Arm's phone cores follow virtual addresses (Cortex-A55: a read stream
/// "can cross page boundaries", and widens its distance as it gains confidence; Cortex-A76:
/// "uses the virtual address to prefetch to both the L1 and L2"), and their manuals keep `prfm`
/// for "short sequences or irregular pattern fetches": one long sequential stream per thread is
/// what they track. A `prfm` per cache line would be one more instruction per two blocks, on an
/// in-order core that is compute-bound here already. To revisit with a measurement on a phone.
#[cfg(target_arch = "aarch64")]
mod aarch64 {
    use std::arch::aarch64::*;

    use super::super::arm::{hsum4, sdot, smmla};
    use super::{Q8Activation, BLOCK_BYTES, Q4_1_BLOCK_BYTES, QK};

    /// A block's dot product with `sdot`: `a` and `b` are each a block's two 16-byte halves; the
    /// 32 products summed into 4 i32 lanes, lane i the bytes 4i..4i+4 of both halves.
    ///
    /// # Safety
    /// The CPU has dotprod; inlined only into functions compiled with it.
    #[inline(always)]
    unsafe fn dot_sdot(a: [int8x16_t; 2], b: [int8x16_t; 2]) -> int32x4_t {
        // SAFETY: the CPU has dotprod (this function's contract).
        unsafe { sdot(sdot(vdupq_n_s32(0), a[0], b[0]), a[1], b[1]) }
    }

    /// [`dot_sdot`] with NEON's widening multiplies, the same lanes; exact if no i16 lane pairs
    /// two products of -128 by -128 (see the module docs).
    #[inline(always)]
    fn dot_neon(a: [int8x16_t; 2], b: [int8x16_t; 2]) -> int32x4_t {
        // SAFETY: NEON is in the aarch64 baseline; registers only.
        unsafe {
            // Lane j (0..8) of `lo` is bytes j of both halves, of `hi` bytes 8 + j.
            let lo = vmlal_s8(vmull_s8(vget_low_s8(a[0]), vget_low_s8(b[0])), vget_low_s8(a[1]), vget_low_s8(b[1]));
            let hi = vmlal_high_s8(vmull_high_s8(a[0], b[0]), a[1], b[1]);
            // [bytes 0-3, 4-7, 8-11, 12-15], as `sdot` has them.
            vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi))
        }
    }

    /// A u64's bits as a vector of 4 u16 (lane i its bits 16i..16i + 16), by one `fmov`. In asm
    /// because LLVM sees through `vcreate_u16`: given `s0 | s1 << 16 | ...` of four loaded u16
    /// it builds the vector back with a load and three lane-insert loads (`ld1 {v.h}[i]`), the
    /// serial chain this function exists to avoid.
    #[inline(always)]
    fn u64_to_u16x4(bits: u64) -> uint16x4_t {
        let v: uint16x4_t;
        // SAFETY: `fmov d, x` (FP/NEON, in the aarch64 baseline) copies a general register to a
        // vector register's low 64 bits: registers only, no memory, stack or flags.
        unsafe { core::arch::asm!("fmov {v:d}, {x}", x = in(reg) bits, v = out(vreg) v, options(pure, nomem, nostack, preserves_flags)) };
        v
    }

    /// Four f16 (their bits) as f32 (`fcvtl`): exact, subnormals included.
    #[inline(always)]
    fn f16x4_to_f32(bits: uint16x4_t) -> float32x4_t {
        // SAFETY: NEON (and with it the f16 conversions) is in the aarch64 baseline.
        unsafe { vcvt_f32_f16(vreinterpret_f16_u16(bits)) }
    }

    /// # Safety
    /// The CPU has dotprod; `w` is `out.len()` whole rows of `nb` blocks; `x` has `nb` blocks.
    #[target_feature(enable = "dotprod")]
    pub(super) unsafe fn gemv_q8_0_dotprod(w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
        for (o, row) in out.iter_mut().zip(w.chunks_exact(nb * BLOCK_BYTES)) {
            // SAFETY: `row` is `nb` blocks, the activation `nb` blocks; the CPU has dotprod.
            *o = unsafe { row_q8_0(row.as_ptr(), nb, x, |a, b| dot_sdot(a, b)) };
        }
    }

    /// Not inlined into its caller, so that its symbol exists for analysis, as the Dotprod
    /// path's (which cannot be inlined: its features).
    ///
    /// # Safety
    /// `w` is `out.len()` whole rows of `nb` blocks; `x` has `nb` blocks and no -128.
    #[inline(never)]
    pub(super) unsafe fn gemv_q8_0_neon(w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
        for (o, row) in out.iter_mut().zip(w.chunks_exact(nb * BLOCK_BYTES)) {
            // SAFETY: `row` is `nb` blocks, the activation `nb` blocks without -128 (which
            // `dot_neon` needs).
            *o = unsafe { row_q8_0(row.as_ptr(), nb, x, dot_neon) };
        }
    }

    /// # Safety
    /// The CPU has dotprod; `w` is `out.len()` whole rows of `nb` Q4_1 blocks; `x` has `nb`
    /// blocks and `nb` sums.
    #[target_feature(enable = "dotprod")]
    pub(super) unsafe fn gemv_q4_1_dotprod(w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
        for (o, row) in out.iter_mut().zip(w.chunks_exact(nb * Q4_1_BLOCK_BYTES)) {
            // SAFETY: `row` is `nb` blocks, the activation `nb` blocks and sums; the CPU has
            // dotprod.
            *o = unsafe { row_q4_1(row.as_ptr(), nb, x, |a, b| dot_sdot(a, b)) };
        }
    }

    /// Not inlined, as [`gemv_q8_0_neon`].
    ///
    /// # Safety
    /// `w` is `out.len()` whole rows of `nb` Q4_1 blocks; `x` has `nb` blocks and `nb` sums.
    #[inline(never)]
    pub(super) unsafe fn gemv_q4_1_neon(w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
        for (o, row) in out.iter_mut().zip(w.chunks_exact(nb * Q4_1_BLOCK_BYTES)) {
            // SAFETY: `row` is `nb` blocks, the activation `nb` blocks and sums (a nibble pair
            // never overflows `dot_neon`'s i16).
            *o = unsafe { row_q4_1(row.as_ptr(), nb, x, dot_neon) };
        }
    }

    /// Q8_0 rows by `smmla`, two weight rows and two input rows at a time: `out0` for `x[0]`,
    /// `out1` (when given) for `x[1]`. Per block and weight-row pair: the two rows' halves are
    /// interleaved 8 bytes at a time (`zip1`/`zip2` on 64-bit lanes: `[wa 0..8, wb 0..8]`, ...), and
    /// four `smmla` against the input rows interleaved the same way (once per call) give the
    /// block's four dot products `[x0.wa, x0.wb, x1.wa, x1.wb]`, exact in i32. Those are
    /// converted (`scvtf`, exact: below 2^24) and added in one `fmla` by `[dwa dx0, dwb dx0,
    /// dwa dx1, dwb dx1]` onto one accumulator per lane, block after block. Every lane's
    /// arithmetic is its own: an input row's outputs are the same bits whatever row it is
    /// paired with (itself, for one row). A last odd weight row pairs with itself.
    ///
    /// # Safety
    /// The CPU has i8mm and dotprod; `w` is `out0.len()` whole rows of `nb` blocks; both
    /// activations have `nb` blocks; `out1`, when given, is as long as `out0`.
    #[target_feature(enable = "i8mm,dotprod")]
    pub(super) unsafe fn gemv_q8_0_i8mm(w: &[u8], nb: usize, x: [&Q8Activation; 2], out0: &mut [f32], mut out1: Option<&mut [f32]>) {
        // SAFETY: every read is of blocks below `nb` of the rows in `w` and of the activations
        // (the caller's contract); the CPU has i8mm.
        unsafe {
            let (xs, dx) = interleave(x, nb);
            let rows = out0.len();
            let row = |r: usize| w.as_ptr().add(r * nb * BLOCK_BYTES);
            let scale = |p: *const u8| u16::from_le(p.cast::<u16>().read_unaligned()) as u64;
            for r in (0..rows).step_by(2) {
                let r2 = (r + 1).min(rows - 1);
                let (wa, wb) = (row(r), row(r2));
                let mut acc = vdupq_n_f32(0.0);
                for (b, (xb, db)) in xs.iter().zip(&dx).enumerate() {
                    let (pa, pb) = (wa.add(BLOCK_BYTES * b), wb.add(BLOCK_BYTES * b));
                    let [w0, w1] = zip(vld1q_s8(pa.add(2).cast()), vld1q_s8(pb.add(2).cast()));
                    let [w2, w3] = zip(vld1q_s8(pa.add(18).cast()), vld1q_s8(pb.add(18).cast()));
                    let dot = smmla(smmla(smmla(smmla(vdupq_n_s32(0), xb[0], w0), xb[1], w1), xb[2], w2), xb[3], w3);
                    let (sa, sb) = (scale(pa), scale(pb));
                    let dw = f16x4_to_f32(u64_to_u16x4(sa | sb << 16 | sa << 32 | sb << 48));
                    acc = vfmaq_f32(acc, vcvtq_f32_s32(dot), vmulq_f32(dw, *db));
                }
                store(acc, r, r2, out0, out1.as_deref_mut());
            }
        }
    }

    /// [`gemv_q8_0_i8mm`] for Q4_1 rows: each weight row's 16 bytes of nibbles split into
    /// weights 0..16 (`and`) and 16..32 (`ushr`), interleaved with the other row's as Q8_0's
    /// halves are; the `d_w` terms as Q8_0's, and the minimum terms `m_w * (d_x * sum_x)` onto a
    /// second accumulator per lane, added to the first at the end. Every lane's arithmetic is
    /// its own, as in [`gemv_q8_0_i8mm`].
    ///
    /// # Safety
    /// The CPU has i8mm and dotprod; `w` is `out0.len()` whole rows of `nb` Q4_1 blocks; both
    /// activations have `nb` blocks and sums; `out1`, when given, is as long as `out0`.
    #[target_feature(enable = "i8mm,dotprod")]
    pub(super) unsafe fn gemv_q4_1_i8mm(w: &[u8], nb: usize, x: [&Q8Activation; 2], out0: &mut [f32], mut out1: Option<&mut [f32]>) {
        // SAFETY: as in `gemv_q8_0_i8mm`, for Q4_1 blocks and the activations' sums.
        unsafe {
            let (xs, dx) = interleave(x, nb);
            // [dx0 s0, dx0 s0, dx1 s1, dx1 s1] per block: the minimum terms' activation side.
            let dxs: Vec<float32x4_t> = (0..nb)
                .map(|b| {
                    let (a, c) = (x[0].scales[b] * x[0].sums[b] as f32, x[1].scales[b] * x[1].sums[b] as f32);
                    vcombine_f32(vdup_n_f32(a), vdup_n_f32(c))
                })
                .collect();
            let low = vdupq_n_u8(0x0F);
            let rows = out0.len();
            let row = |r: usize| w.as_ptr().add(r * nb * Q4_1_BLOCK_BYTES);
            let dm = |p: *const u8| u32::from_le(p.cast::<u32>().read_unaligned()) as u64;
            for r in (0..rows).step_by(2) {
                let r2 = (r + 1).min(rows - 1);
                let (wa, wb) = (row(r), row(r2));
                let (mut acc, mut mins) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
                for (b, ((xb, dxb), ms)) in xs.iter().zip(&dx).zip(&dxs).enumerate() {
                    let (pa, pb) = (wa.add(Q4_1_BLOCK_BYTES * b), wb.add(Q4_1_BLOCK_BYTES * b));
                    let (qa, qb) = (vld1q_u8(pa.add(4)), vld1q_u8(pb.add(4)));
                    let nib = |q: uint8x16_t| [vreinterpretq_s8_u8(vandq_u8(q, low)), vreinterpretq_s8_u8(vshrq_n_u8::<4>(q))];
                    let ([la, ha], [lb, hb]) = (nib(qa), nib(qb));
                    let [w0, w1] = zip(la, lb);
                    let [w2, w3] = zip(ha, hb);
                    let dot = smmla(smmla(smmla(smmla(vdupq_n_s32(0), xb[0], w0), xb[1], w1), xb[2], w2), xb[3], w3);
                    let (ma, mb) = (dm(pa), dm(pb));
                    let (da, db) = (ma & 0xFFFF, mb & 0xFFFF);
                    let (ma, mb) = (ma >> 16, mb >> 16);
                    let dw = f16x4_to_f32(u64_to_u16x4(da | db << 16 | da << 32 | db << 48));
                    let mw = f16x4_to_f32(u64_to_u16x4(ma | mb << 16 | ma << 32 | mb << 48));
                    acc = vfmaq_f32(acc, vcvtq_f32_s32(dot), vmulq_f32(dw, *dxb));
                    mins = vfmaq_f32(mins, mw, *ms);
                }
                store(vaddq_f32(acc, mins), r, r2, out0, out1.as_deref_mut());
            }
        }
    }

    /// Two input rows interleaved 8 bytes at a time (`[x0 0..8, x1 0..8]`, `[x0 8..16, x1 8..16]`,
    /// ... per block: `smmla`'s left operands) and each block's scales `[dx0, dx0, dx1, dx1]`.
    ///
    /// # Safety
    /// Both activations have `nb` blocks.
    #[inline(always)]
    unsafe fn interleave(x: [&Q8Activation; 2], nb: usize) -> (Vec<[int8x16_t; 4]>, Vec<float32x4_t>) {
        let (q0, q1) = (x[0].q.as_ptr(), x[1].q.as_ptr());
        let mut xs = Vec::with_capacity(nb);
        let mut dx = Vec::with_capacity(nb);
        for b in 0..nb {
            // SAFETY: block b < nb of both activations (the caller's contract).
            unsafe {
                let (a, c) = (q0.add(QK * b), q1.add(QK * b));
                let [l0, l1] = zip(vld1q_s8(a), vld1q_s8(c));
                let [h0, h1] = zip(vld1q_s8(a.add(16)), vld1q_s8(c.add(16)));
                xs.push([l0, l1, h0, h1]);
                dx.push(vcombine_f32(vdup_n_f32(x[0].scales[b]), vdup_n_f32(x[1].scales[b])));
            }
        }
        (xs, dx)
    }

    /// `[p 0..8, q 0..8]` and `[p 8..16, q 8..16]` (`zip1`, `zip2` on 64-bit lanes).
    #[inline(always)]
    fn zip(p: int8x16_t, q: int8x16_t) -> [int8x16_t; 2] {
        // SAFETY: NEON is in the aarch64 baseline; registers only.
        unsafe {
            let (p, q) = (vreinterpretq_s64_s8(p), vreinterpretq_s64_s8(q));
            [vreinterpretq_s8_s64(vzip1q_s64(p, q)), vreinterpretq_s8_s64(vzip2q_s64(p, q))]
        }
    }

    /// A weight-row pair's results `[x0.wa, x0.wb, x1.wa, x1.wb]` into the outputs (`r2 == r`: a
    /// last odd row, paired with itself).
    #[inline(always)]
    fn store(acc: float32x4_t, r: usize, r2: usize, out0: &mut [f32], out1: Option<&mut [f32]>) {
        let mut lanes = [0f32; 4];
        // SAFETY: NEON is in the aarch64 baseline; the store writes the 4 floats of `lanes`.
        unsafe { vst1q_f32(lanes.as_mut_ptr(), acc) };
        out0[r] = lanes[0];
        out0[r2] = if r2 > r { lanes[1] } else { lanes[0] };
        if let Some(out1) = out1 {
            out1[r] = lanes[2];
            out1[r2] = if r2 > r { lanes[3] } else { lanes[2] };
        }
    }

    /// One row's Q8_0 product, with the block dot `dot`.
    ///
    /// # Safety
    /// `w` is `nb` blocks; `x` has `nb` blocks, within `dot`'s range; inlined only into the
    /// functions above (`dot_sdot` needs their features).
    #[inline(always)]
    unsafe fn row_q8_0(w: *const u8, nb: usize, x: &Q8Activation, dot: impl Fn([int8x16_t; 2], [int8x16_t; 2]) -> int32x4_t) -> f32 {
        let (xq, xd) = (x.q.as_ptr(), x.scales.as_ptr());
        // SAFETY: every read is of blocks below `nb`, in the row and the activation (the caller's
        // contract); a group's four activation scales are blocks b..b + 4 <= nb.
        unsafe {
            let blk = |b: usize| w.add(BLOCK_BYTES * b);
            let scale = |b: usize| u16::from_le(blk(b).cast::<u16>().read_unaligned());
            // Block b's 32 products in 4 lanes, as f32 (exact: below 2^24).
            let block = |b: usize| {
                let (q, xb) = (blk(b).add(2).cast::<i8>(), xq.add(QK * b));
                vcvtq_f32_s32(dot([vld1q_s8(q), vld1q_s8(q.add(16))], [vld1q_s8(xb), vld1q_s8(xb.add(16))]))
            };
            // A tail block onto `acc`: its scale converted alone, `d_w * d_x` rounded as in a group.
            let one = |acc: float32x4_t, b: usize| {
                let dw = vgetq_lane_f32::<0>(f16x4_to_f32(vdup_n_u16(scale(b))));
                vfmaq_n_f32(acc, block(b), dw * *xd.add(b))
            };
            let mut acc = [vdupq_n_f32(0.0); 4];
            let full = nb - nb % 4;
            for b in (0..full).step_by(4) {
                // The four scales gathered in a general register and moved over once (`ldrh`,
                // `orr ... lsl`, `fmov`): lane inserts (`vset_lane_u16`, which LLVM makes `ld1 {v.h}[i]`)
                // chain a load and an insert per scale, and everything below waits on them.
                let bits = scale(b) as u64 | (scale(b + 1) as u64) << 16 | (scale(b + 2) as u64) << 32 | (scale(b + 3) as u64) << 48;
                let s = vmulq_f32(f16x4_to_f32(u64_to_u16x4(bits)), vld1q_f32(xd.add(b)));
                acc[0] = vfmaq_laneq_f32::<0>(acc[0], block(b), s);
                acc[1] = vfmaq_laneq_f32::<1>(acc[1], block(b + 1), s);
                acc[2] = vfmaq_laneq_f32::<2>(acc[2], block(b + 2), s);
                acc[3] = vfmaq_laneq_f32::<3>(acc[3], block(b + 3), s);
            }
            if nb % 4 > 0 {
                acc[0] = one(acc[0], full);
            }
            if nb % 4 > 1 {
                acc[1] = one(acc[1], full + 1);
            }
            if nb % 4 > 2 {
                acc[2] = one(acc[2], full + 2);
            }
            hsum4(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])))
        }
    }

    /// One row's Q4_1 product, with the block dot `dot`.
    ///
    /// # Safety
    /// `w` is `nb` Q4_1 blocks; `x` has `nb` blocks and sums; inlined only into the functions
    /// above (`dot_sdot` needs their features).
    #[inline(always)]
    unsafe fn row_q4_1(w: *const u8, nb: usize, x: &Q8Activation, dot: impl Fn([int8x16_t; 2], [int8x16_t; 2]) -> int32x4_t) -> f32 {
        let (xq, xd, xs) = (x.q.as_ptr(), x.scales.as_ptr(), x.sums.as_ptr());
        // SAFETY: every read is of blocks below `nb`, in the row, and of the activation's first
        // `nb` blocks, scales and sums (the caller's contract).
        unsafe {
            let low = vdupq_n_u8(0x0F);
            let blk = |b: usize| w.add(Q4_1_BLOCK_BYTES * b);
            // Block b's d and m as one u32 (little-endian: d in the low half).
            let dm = |b: usize| u32::from_le(blk(b).cast::<u32>().read_unaligned());
            // Block b's 32 products (nibbles times activations) in 4 lanes, as f32.
            let block = |b: usize| {
                // The low nibbles are weights 0..16, the high ones 16..32: the activation's halves.
                let qs = vld1q_u8(blk(b).add(4));
                let nibbles = [vreinterpretq_s8_u8(vandq_u8(qs, low)), vreinterpretq_s8_u8(vshrq_n_u8::<4>(qs))];
                let xb = xq.add(QK * b);
                vcvtq_f32_s32(dot(nibbles, [vld1q_s8(xb), vld1q_s8(xb.add(16))]))
            };
            let mut acc = [vdupq_n_f32(0.0); 4];
            // Lane i: the minimum terms of the groups' blocks i.
            let mut mins = vdupq_n_f32(0.0);
            // The tail blocks' minimum terms.
            let mut tail_mins = 0f32;
            // A tail block onto `acc`, its minimum term onto `tail_mins`, with a group's roundings.
            let mut one = |acc: float32x4_t, b: usize| {
                // [d, m, d, m] * d_x.
                let s = vmulq_n_f32(f16x4_to_f32(vreinterpret_u16_u32(vdup_n_u32(dm(b)))), *xd.add(b));
                tail_mins = vgetq_lane_f32::<1>(s).mul_add(*xs.add(b) as f32, tail_mins);
                vfmaq_laneq_f32::<0>(acc, block(b), s)
            };
            let full = nb - nb % 4;
            for b in (0..full).step_by(4) {
                // [d0, m0, d1, m1, d2, m2, d3, m3] as f16, then as f32 in two halves, split.
                // Gathered in general registers, two blocks to one, as in `row_q8_0` (here LLVM
                // keeps `ldr w`, `orr ... lsl #32`, `fmov`: no lane inserts, no asm needed).
                let pair = |b: usize| vcreate_u16(dm(b) as u64 | (dm(b + 1) as u64) << 32);
                let (lo, hi) = (f16x4_to_f32(pair(b)), f16x4_to_f32(pair(b + 2)));
                let dx = vld1q_f32(xd.add(b));
                let (ds, ms) = (vmulq_f32(vuzp1q_f32(lo, hi), dx), vmulq_f32(vuzp2q_f32(lo, hi), dx));
                mins = vfmaq_f32(mins, ms, vcvtq_f32_s32(vld1q_s32(xs.add(b))));
                acc[0] = vfmaq_laneq_f32::<0>(acc[0], block(b), ds);
                acc[1] = vfmaq_laneq_f32::<1>(acc[1], block(b + 1), ds);
                acc[2] = vfmaq_laneq_f32::<2>(acc[2], block(b + 2), ds);
                acc[3] = vfmaq_laneq_f32::<3>(acc[3], block(b + 3), ds);
            }
            if nb % 4 > 0 {
                acc[0] = one(acc[0], full);
            }
            if nb % 4 > 1 {
                acc[1] = one(acc[1], full + 1);
            }
            if nb % 4 > 2 {
                acc[2] = one(acc[2], full + 2);
            }
            let acc = vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]));
            hsum4(vaddq_f32(acc, mins)) + tail_mins
        }
    }

    /// [`f16x4_to_f32`] on one f16, for the tests (against the `half` crate on every bit pattern).
    #[cfg(test)]
    pub(super) fn f16_bits_to_f32(bits: u16) -> f32 {
        // SAFETY: NEON is in the aarch64 baseline.
        unsafe { vgetq_lane_f32::<0>(f16x4_to_f32(vdup_n_u16(bits))) }
    }
}

/// A matrix `[N, K]` (rows = output features) of ggml blocks where it lives: a checkpoint's
/// mapped bytes (decode then reads the user's file as it is) or bytes of its own (a Q8_0 form of
/// the NPU's INT8 weights). Clones share the bytes.
#[derive(Clone)]
pub struct BlockMatrix {
    format: BlockFormat,
    n: usize,
    k: usize,
    bytes: std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>,
    offset: usize,
}

impl std::fmt::Debug for BlockMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockMatrix({:?} [{}, {}])", self.format, self.n, self.k)
    }
}

impl BlockMatrix {
    /// The `[n, k]` matrix of `format` blocks at `offset` in `bytes` (whole rows, one after
    /// another); an error if `k` is not whole blocks or the rows run past the bytes.
    pub fn new(format: BlockFormat, n: usize, k: usize, bytes: std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>, offset: usize) -> crate::Result<Self> {
        if !k.is_multiple_of(format.block_len()) {
            return Err(crate::Error::Input(format!("a {format:?} matrix of [{n}, {k}]: rows are not whole blocks of {}", format.block_len())));
        }
        let len = (*bytes).as_ref().len();
        match n.checked_mul(format.row_bytes(k)).and_then(|b| b.checked_add(offset)) {
            Some(end) if end <= len => Ok(BlockMatrix { format, n, k, bytes, offset }),
            _ => Err(crate::Error::Input(format!("a {format:?} matrix of [{n}, {k}] at byte {offset} runs past its {len} bytes"))),
        }
    }

    /// A copy of `t`'s blocks (`[N, K]`, a format of [`BlockFormat`]); `None` for another dtype or
    /// shape.
    pub fn from_qtensor(t: &candle_core::quantized::QTensor) -> crate::Result<Option<Self>> {
        let (Some(format), &[n, k]) = (BlockFormat::of(t.dtype()), t.shape().dims()) else {
            return Ok(None);
        };
        Self::new(format, n, k, std::sync::Arc::new(t.data()?.into_owned()), 0).map(Some)
    }

    /// Its blocks' format.
    pub fn format(&self) -> BlockFormat {
        self.format
    }
    /// (N, K).
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }
    /// Its bytes: N rows of [`BlockFormat::row_bytes`].
    pub fn data(&self) -> &[u8] {
        &(*self.bytes).as_ref()[self.offset..][..self.n * self.format.row_bytes(self.k)]
    }

    /// Rows `ids` dequantized to F32 (candle's `to_float`, ggml's), `[ids.len(), K]`: the
    /// embedding lookup. An id past the rows is an error.
    pub fn rows(&self, ids: &[u32]) -> crate::Result<candle_core::Tensor> {
        let row_bytes = self.format.row_bytes(self.k);
        let mut bytes = Vec::with_capacity(ids.len() * row_bytes);
        for &id in ids {
            if id as usize >= self.n {
                return Err(crate::Error::Input(format!("row {id} of a matrix of {} rows", self.n)));
            }
            bytes.extend_from_slice(&self.data()[id as usize * row_bytes..][..row_bytes]);
        }
        let t = candle_core::quantized::ggml_file::qtensor_from_ggml(self.format.dtype(), &bytes, vec![ids.len(), self.k], &candle_core::Device::Cpu)?;
        Ok(t.dequantize(&candle_core::Device::Cpu)?)
    }

    /// Weight (r, c) as candle's `to_float` (ggml's dequantization) computes it, to the bit: the
    /// same f32 operations in the same order. How a column is read without dequantizing its rows
    /// (the shadow path's cold columns). Panics past the matrix.
    pub fn value(&self, r: usize, c: usize) -> f32 {
        assert!(r < self.n && c < self.k, "value ({r}, {c}) of a [{}, {}] matrix", self.n, self.k);
        let (len, bytes) = (self.format.block_len(), self.format.block_bytes());
        let at = (r * self.k + c) / len * bytes;
        block_value(self.format, &self.data()[at..at + bytes], c % len)
    }

    /// Column `c` of rows `rows` into `out` (one value per row), each as [`Self::value`] gives
    /// it, to the bit: the format's decoding chosen once for the column, the rows' blocks read
    /// one after another (the shadow path's cold columns, where no INT8 copy is held).
    pub fn column(&self, c: usize, rows: Range<usize>, out: &mut [f32]) {
        assert!(
            c < self.k && rows.end <= self.n && out.len() == rows.len(),
            "column {c} of rows {rows:?} of a [{}, {}] matrix into {}",
            self.n,
            self.k,
            out.len()
        );
        let (len, bytes, row_bytes) = (self.format.block_len(), self.format.block_bytes(), self.format.row_bytes(self.k));
        let (data, first, i) = (self.data(), c / len * bytes, c % len);
        fn fill(data: &[u8], row_bytes: usize, first: usize, bytes: usize, rows: Range<usize>, out: &mut [f32], f: impl Fn(&[u8]) -> f32) {
            for (o, r) in out.iter_mut().zip(rows) {
                *o = f(&data[r * row_bytes + first..][..bytes]);
            }
        }
        let f16 = |b: &[u8], at: usize| half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32();
        // Block-of-32 formats: where weight i's nibble is, and its shift.
        let (nib_at, nib_shift) = (i % 16, if i < 16 { 0 } else { 4 });
        let go = |f: &dyn Fn(&[u8]) -> f32, out: &mut [f32]| fill(data, row_bytes, first, bytes, rows.clone(), out, f);
        match self.format {
            BlockFormat::Q8_0 => go(&|b| b[2 + i] as i8 as f32 * f16(b, 0), out),
            BlockFormat::Q4_0 => go(&|b| (((b[2 + nib_at] >> nib_shift) & 0x0F) as i16 - 8) as f32 * f16(b, 0), out),
            BlockFormat::Q4_1 => go(&|b| ((b[4 + nib_at] >> nib_shift) & 0x0F) as f32 * f16(b, 0) + f16(b, 2), out),
            BlockFormat::Q5_0 => go(
                &|b| {
                    let high = (b[2 + i / 8] >> (i % 8)) & 1;
                    ((((b[6 + nib_at] >> nib_shift) & 0x0F) | high << 4) as i32 - 16) as f32 * f16(b, 0)
                },
                out,
            ),
            BlockFormat::Q4K | BlockFormat::Q5K | BlockFormat::Q6K => {
                // The K-quants' decoding has more steps; `block_value` is it, written once.
                let format = self.format;
                go(&|b| block_value(format, b, i), out)
            }
        }
    }

    /// The whole matrix dequantized, `[N, K]`.
    pub fn dequantize(&self) -> crate::Result<candle_core::Tensor> {
        let t = candle_core::quantized::ggml_file::qtensor_from_ggml(self.format.dtype(), self.data(), vec![self.n, self.k], &candle_core::Device::Cpu)?;
        Ok(t.dequantize(&candle_core::Device::Cpu)?)
    }

    /// `x @ self^T` for `x` of `[.., K]` (F32, any dtype is converted): each row of `x` one
    /// decode product ([`Self::forward_all`]).
    pub fn forward(&self, x: &candle_core::Tensor) -> crate::Result<candle_core::Tensor> {
        Ok(Self::forward_all(&[self], x)?.remove(0))
    }

    /// [`Self::forward`] of `x` with each of `ws` (a stage's linears that share their input: Q, K
    /// and V, or gate and up): each row of `x` is quantized once and the matrices' rows are one
    /// parallel loop, where a call per matrix quantized it three times and woke the helpers three
    /// times per layer.
    ///
    /// Several rows (a speculative verifier's few, a calibration window's) share the loop: each
    /// chunk of weight rows is read from memory once and multiplied with every input row while
    /// it is in cache, by the same kernel as one row's (so each output row has the bits a call
    /// with that row alone gives). Decode is memory-bound: rows beyond the first cost the
    /// kernel's arithmetic, not the weights' bytes again.
    pub fn forward_all(ws: &[&BlockMatrix], x: &candle_core::Tensor) -> crate::Result<Vec<candle_core::Tensor>> {
        use candle_core::{DType, Device, Tensor};
        let Some(&k) = x.dims().last() else {
            return Err(crate::Error::Input("decode product: a scalar input".into()));
        };
        if let Some(w) = ws.iter().find(|w| w.k != k) {
            return Err(crate::Error::Input(format!("decode product: input {:?} against a weight of [{}, {}]", x.dims(), w.n, w.k)));
        }
        let m = x.elem_count() / k.max(1);
        let xs = x.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.reshape((m, k))?;
        let total: usize = ws.iter().map(|w| w.n).sum();
        let mut y = vec![0f32; m * total];
        let xq: Vec<Q8Activation> = crate::kernels::rows::with_f32(&xs, |v| v.chunks_exact(k.max(1)).take(m).map(Q8Activation::quantize).collect())?;
        // Rows a chunk of weights is kept in cache for: beyond that, the next group of rows reads
        // the weights again (a prompt on the CPU path is many rows; a verifier's are a few).
        const ROWS_PER_READ: usize = 16;
        for (group, out) in xq.chunks(ROWS_PER_READ).zip(y.chunks_mut(ROWS_PER_READ * total.max(1))) {
            Self::product(ws, group, out);
        }
        // Matrix j's columns of each row.
        let mut at = 0;
        let mut shape = x.dims().to_vec();
        ws.iter()
            .map(|w| {
                let cols: Vec<f32> = y.chunks_exact(total.max(1)).take(m).flat_map(|row| &row[at..at + w.n]).copied().collect();
                at += w.n;
                *shape.last_mut().expect("checked above") = w.n;
                Ok(Tensor::from_vec(cols, shape.as_slice(), &Device::Cpu)?.to_dtype(x.dtype())?)
            })
            .collect()
    }

    /// Quantized rows `xq` times each of `ws`: row `r`'s outputs, the matrices' one after
    /// another, at `y[r * total..]` (`total` the matrices' rows together).
    fn product(ws: &[&BlockMatrix], xq: &[Q8Activation], y: &mut [f32]) {
        // Row offsets of each matrix in one row's output.
        let starts: Vec<usize> = ws.iter().scan(0, |at, w| Some(std::mem::replace(at, *at + w.n))).collect();
        let total = y.len() / xq.len().max(1);
        let Some(k) = xq.first().map(|x| x.q.len()) else { return };
        let out = OutPtr(y.as_mut_ptr());
        // Chunks of 64 rows (64 x 576 weights of SmolLM2 are ~38 KB in Q8_0, ~23 KB in Q4_1:
        // microseconds, enough to amortize claiming one, small enough that a late helper leaves
        // little to wait for, and in L2 for every input row of a group). Products under 2M
        // weights (2 MB, ~50 us on one core) stay on the
        // caller: one core reads most of the machine's bandwidth (38 of 46 GB/s here), and a
        // helper joins a few microseconds late. SmolLM2's decode, whose products are all smaller
        // but the output matrix, against llama.cpp in the same runs (`bench_decode`, 2 runs of 3
        // rounds each, context 64): 1.18-1.21x with this limit, 1.10-1.15x with helpers for
        // every product of 64K weights or more (and 0.84-0.91x of that beside a busy process,
        // against 0.93-1.02x), 1.00-1.12x from 1M.
        let helpers = if total * k * xq.len() >= 1 << 21 { rayon::current_num_threads().saturating_sub(1) } else { 0 };
        super::claim::for_each_chunk(total, 64, helpers, &|rows| {
            // The chunk's rows, matrix by matrix (a chunk may cross from one matrix to the next),
            // each with every input row while its weights are in cache.
            for (w, &s) in ws.iter().zip(&starts) {
                let (a, b) = (rows.start.max(s), rows.end.min(s + w.n));
                if a < b {
                    // Several input rows take the weights 64 rows at a time, so that each piece is
                    // still in cache for the next input row (without helpers `rows` is the whole
                    // product); one input row takes them in one call.
                    let piece = if xq.len() > 1 { 64 } else { b - a };
                    for p0 in (a..b).step_by(piece) {
                        let p1 = (p0 + piece).min(b);
                        // SAFETY: `p0..p1` is within `rows`, which is within 0..total and goes to
                        // exactly one call (`for_each_chunk`), so the slices (of input row r's
                        // outputs) are disjoint; `y` outlives the loop.
                        let out_of = |r: usize| unsafe { std::slice::from_raw_parts_mut(out.get().add(r * total + p0), p1 - p0) };
                        // Input rows two at a time (`gemv_pair`: on i8mm they share the
                        // instructions), each with the bits it gets alone.
                        let pairs = xq.len() / 2;
                        for i in 0..pairs {
                            gemv_pair(w.format, w.data(), k, &xq[2 * i], &xq[2 * i + 1], p0 - s..p1 - s, out_of(2 * i), out_of(2 * i + 1));
                        }
                        for (r, x) in xq.iter().enumerate().skip(2 * pairs) {
                            gemv(w.format, w.data(), k, x, p0 - s..p1 - s, out_of(r));
                        }
                    }
                }
            }
        });
    }
}

/// The output of a parallel loop whose ranges write disjoint parts (see its use).
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every use writes a range no other use writes, and the buffer outlives the loop.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Every path this machine runs.
    fn paths() -> Vec<GemvPath> {
        [GemvPath::Portable, GemvPath::Avx2, GemvPath::Avx512, GemvPath::Neon, GemvPath::Dotprod, GemvPath::I8mm]
            .into_iter()
            .filter(|p| p.runs_here())
            .collect()
    }

    /// f16 scale bits of kind `kind` (0-4): subnormal (below 2^-14, down to 2^-24), large (up to
    /// 65504, the largest finite f16), zero, negative, ordinary; any kind for 5 and above.
    fn scale_bits(rng: &mut impl Rng, kind: usize) -> u16 {
        match if kind < 5 { kind } else { rng.random_range(0..5) } {
            0 => rng.random_range(0x0001..=0x03ff),
            1 => half::f16::from_f32(rng.random_range(1000.0..65504.0)).to_bits(),
            2 => 0,
            3 => 0x8000 | half::f16::from_f32(rng.random_range(1e-3..1.0)).to_bits(),
            _ => half::f16::from_f32(rng.random_range(1e-4..1.0)).to_bits(),
        }
    }

    /// `n` rows of `k` random weights as Q8_0 bytes, i8 values over the whole range (-128 too).
    /// Row `r`'s scales are of kind `r % 6` ([`scale_bits`]): one kind per row keeps the
    /// tolerance tight (a block 10^8 times larger than the rest would hide their errors), and
    /// every sixth row mixes them all.
    fn weights(rng: &mut impl Rng, n: usize, k: usize) -> Vec<u8> {
        let mut w = Vec::with_capacity(n * k / QK * BLOCK_BYTES);
        for r in 0..n {
            for _ in 0..k / QK {
                w.extend(scale_bits(rng, r % 6).to_le_bytes());
                w.extend((0..QK).map(|_| rng.random::<i8>() as u8));
            }
        }
        w
    }

    /// `k` activations in [-1, 1], or with `mixed` each block at its own magnitude (0 for an
    /// all-zero block, up to 1e4: a decode activation's outliers).
    fn activations(rng: &mut impl Rng, k: usize, mixed: bool) -> Vec<f32> {
        let mut x = Vec::with_capacity(k);
        for _ in 0..k / QK {
            let m = if mixed { [0.0, 1e-3, 1.0, 30.0, 1e4][rng.random_range(0..5)] } else { 1.0 };
            x.extend((0..QK).map(|_| if m == 0.0 { 0.0 } else { rng.random_range(-m..m) }));
        }
        x
    }

    /// Row `r`'s product in f64 (exact but for the final roundings) and the sum of the absolute
    /// block products, `sum_b |d_w d_x| sum_i |w_i q_i|`, that bounds the f32 error.
    fn reference(w: &[u8], k: usize, x: &Q8Activation, r: usize) -> (f64, f64) {
        let nb = k / QK;
        let (mut sum, mut abs) = (0f64, 0f64);
        for b in 0..nb {
            let blk = &w[(r * nb + b) * BLOCK_BYTES..][..BLOCK_BYTES];
            let s = half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f64() * x.scales[b] as f64;
            let prods = (0..QK).map(|i| blk[2 + i] as i8 as i64 * x.q[b * QK + i] as i64);
            sum += s * prods.clone().sum::<i64>() as f64;
            abs += s.abs() * prods.map(i64::abs).sum::<i64>() as f64;
        }
        (sum, abs)
    }

    /// The f32 error bound for K = `k`. Each block's dot is exact (i32, and below 2^24 in f32:
    /// the AVX2 lanes hold at most 65024, the Arm paths' 4 lanes 8 * 128 * 128 = 131072, a whole
    /// block 32 * 128 * 128 = 524288), so the error is the float work, counted per term (a
    /// block's `d_w * d_x * dot`) along its way to the result: `d_w * d_x` rounded once, then one
    /// rounding per operation that adds it or a sum holding it (the first, an FMA into its
    /// accumulator, also rounds its product with the dot). With nb = K / 32:
    /// - Portable: the product with the dot, then nb additions in sequence: nb + 2;
    /// - AVX2: an FMA chain per accumulator (even and odd blocks, at most nb / 2 + 1 each), their
    ///   sum, the 3 levels of the 8-lane sum: at most nb / 2 + 6;
    /// - Dotprod and Neon: an FMA chain per accumulator (four: block i of each group of four on
    ///   the i-th, the nb % 4 tail blocks one each on the first ones: at most nb / 4 + 1 each), 2
    ///   levels summing the four, 2 of `hsum4`: at most nb / 4 + 6 (rounded down), which is at
    ///   most nb + 5 for every nb >= 1 (equal at nb = 1);
    /// - I8mm: one FMA chain over the nb blocks: nb + 1.
    ///
    /// Standard summation analysis bounds a sum whose terms see at most d roundings by
    /// `d u * sum |terms|` (to first order) with u = 2^-24, so `(K / 32 + 5) u * sum |terms|`
    /// bounds every path; `f32::EPSILON` is 2u, a factor 2 of margin (which covers the second
    /// order). It is tight enough to see a single weight off by one (see
    /// `the_tolerance_sees_one_weight_off_by_one`).
    fn tolerance(k: usize, abs: f64) -> f64 {
        (k / QK + 5) as f64 * f32::EPSILON as f64 * abs
    }

    /// `n` rows of `k` random weights as Q4_1 bytes, every nibble value. Row `r`'s scales and
    /// minimums are of kind `r % 6` as in [`weights`], the minimums of either sign (a real
    /// block's minimum is mostly negative; zero and subnormal ones too).
    fn q4_1_weights(rng: &mut impl Rng, n: usize, k: usize) -> Vec<u8> {
        let mut w = Vec::with_capacity(n * k / QK * Q4_1_BLOCK_BYTES);
        for r in 0..n {
            for _ in 0..k / QK {
                w.extend(scale_bits(rng, r % 6).to_le_bytes());
                w.extend((scale_bits(rng, r % 6) ^ if rng.random() { 0x8000 } else { 0 }).to_le_bytes());
                w.extend((0..QK / 2).map(|_| rng.random::<u8>()));
            }
        }
        w
    }

    /// Block `b`'s 32 weights as (d, m, nibbles): weight i is `d * q[i] + m`, `q[j]` the low
    /// nibble of byte j and `q[j + 16]` its high nibble (candle's `BlockQ4_1::to_float`).
    fn q4_1_block(w: &[u8], b: usize) -> (f64, f64, [u8; QK]) {
        let blk = &w[b * Q4_1_BLOCK_BYTES..][..Q4_1_BLOCK_BYTES];
        let d = half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f64();
        let m = half::f16::from_bits(u16::from_le_bytes([blk[2], blk[3]])).to_f64();
        let q = std::array::from_fn(|i| if i < QK / 2 { blk[4 + i] & 0x0F } else { blk[4 + i - QK / 2] >> 4 });
        (d, m, q)
    }

    /// [`reference`] for Q4_1: row `r`'s product in f64 (exact but for the final roundings) and
    /// the sum of the absolute terms the kernel adds, `sum_b |d_w d_x| sum_i q_i |q_x,i| +
    /// |m_w d_x sum_i q_x,i|`, that bounds its f32 error.
    fn reference_q4_1(w: &[u8], k: usize, x: &Q8Activation, r: usize) -> (f64, f64) {
        let nb = k / QK;
        let (mut sum, mut abs) = (0f64, 0f64);
        for b in 0..nb {
            let (d, m, q) = q4_1_block(w, r * nb + b);
            let dx = x.scales[b] as f64;
            let qx = &x.q[b * QK..][..QK];
            let dot: i64 = q.iter().zip(qx).map(|(&q, &v)| q as i64 * v as i64).sum();
            let dot_abs: i64 = q.iter().zip(qx).map(|(&q, &v)| (q as i64 * v as i64).abs()).sum();
            let xsum: i64 = qx.iter().map(|&v| v as i64).sum();
            sum += d * dx * dot as f64 + m * dx * xsum as f64;
            abs += (d * dx).abs() * dot_abs as f64 + (m * dx * xsum as f64).abs();
        }
        (sum, abs)
    }

    /// [`tolerance`] for Q4_1. Each block's two integer sums are exact (the AVX2 lanes hold at
    /// most 7680, the Arm paths' 4 lanes 8 * 15 * 128 = 15360, a block 61440, a block sum of the
    /// activation 4096, all below 2^24), so again the error is the float work, counted per term
    /// (`d_w * d_x * dot` or `m_w * d_x * sum`) along its way to the result, nb = K / 32:
    /// - Portable: `d_w * d_x` or `m_w * d_x` rounded, its product with the integer sum, the two
    ///   terms' sum, then nb additions: nb + 3;
    /// - AVX2: the scale rounded, its FMA into one of four accumulators (a chain of at most
    ///   nb / 4 + 3 FMAs, the tail of nb % 4 blocks on the first), 2 levels summing the four, 1
    ///   adding the minimum terms, the 3 levels of the 8-lane sum: at most nb / 4 + 10;
    /// - Dotprod and Neon: a `d_w` term as in [`tolerance`] (the scale, a chain of at most
    ///   nb / 4 + 1 FMAs, 2 levels summing the four accumulators), then 1 adding the groups'
    ///   minimum terms, 2 of `hsum4`, 1 adding the tail's minimum terms: at most nb / 4 + 8; a
    ///   group's `m_w` term: the scale, its lane's chain of at most nb / 4 FMAs, 1 into the
    ///   accumulators' sum, 2 of `hsum4`, 1: nb / 4 + 5; a tail block's: the scale, a chain of
    ///   at most 3 scalar FMAs, 1: 5;
    /// - I8mm: a `d_w` term's scale, its chain of nb FMAs, 1 adding the minimum terms: nb + 2; an
    ///   `m_w` term's `d_x * sum`, its chain of nb FMAs, 1: nb + 2.
    ///
    /// So `(K / 32 + 10) u` bounds every path, and `f32::EPSILON` = 2u doubles it as
    /// [`tolerance`] does; it sees a single nibble off by one (see
    /// `the_tolerance_sees_one_nibble_off_by_one`).
    fn tolerance_q4_1(k: usize, abs: f64) -> f64 {
        (k / QK + 10) as f64 * f32::EPSILON as f64 * abs
    }

    /// The two weight formats, for the tests they share.
    #[derive(Debug, Clone, Copy)]
    enum Format {
        Q8_0,
        Q4_1,
    }

    impl Format {
        fn weights(self, rng: &mut impl Rng, n: usize, k: usize) -> Vec<u8> {
            match self {
                Format::Q8_0 => weights(rng, n, k),
                Format::Q4_1 => q4_1_weights(rng, n, k),
            }
        }

        fn reference(self, w: &[u8], k: usize, x: &Q8Activation, r: usize) -> (f64, f64) {
            match self {
                Format::Q8_0 => reference(w, k, x, r),
                Format::Q4_1 => reference_q4_1(w, k, x, r),
            }
        }

        fn tolerance(self, k: usize, abs: f64) -> f64 {
            match self {
                Format::Q8_0 => tolerance(k, abs),
                Format::Q4_1 => tolerance_q4_1(k, abs),
            }
        }

        fn gemv_on(self, path: GemvPath, w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>, out: &mut [f32]) {
            match self {
                Format::Q8_0 => gemv_q8_0_on(path, w, k, x, rows, out),
                Format::Q4_1 => gemv_q4_1_on(path, w, k, x, rows, out),
            }
        }
    }

    fn check(format: Format, path: GemvPath, w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>) {
        let mut out = vec![f32::NAN; rows.len()];
        format.gemv_on(path, w, k, x, rows.clone(), &mut out);
        for (j, r) in rows.clone().enumerate() {
            let (want, abs) = format.reference(w, k, x, r);
            let err = (out[j] as f64 - want).abs();
            let tol = format.tolerance(k, abs);
            assert!(err <= tol, "{format:?} {path:?} K = {k} rows {rows:?}: row {r} is {} for {want} (error {err:e} > {tol:e})", out[j]);
        }
    }

    #[test]
    fn every_path_matches_the_f64_reference() {
        // K of one block, two, SmolLM2's hidden and intermediate sizes, and past 2048; row counts
        // with every tail (n % 4 = 1, 2, 3, and 0 with a sub-range that leaves a tail).
        // Q4_1's AVX2 path takes blocks in fours: K / 32 = 1, 2, 7, 18, 48, 65 leave every tail
        // (0 to 3 blocks) after no group, one or many.
        let mut rng = rand::rngs::StdRng::seed_from_u64(26);
        for format in [Format::Q8_0, Format::Q4_1] {
            for k in [32, 64, 224, 576, 1536, 2048 + 32] {
                for n in [1, 2, 3, 4, 7, 13, 22] {
                    let w = format.weights(&mut rng, n, k);
                    for mixed in [false, true] {
                        let x = Q8Activation::quantize(&activations(&mut rng, k, mixed));
                        for path in paths() {
                            for rows in [0..n, 1..n, n / 2..n, 0..n / 2 + 1, n..n] {
                                check(format, path, &w, k, &x, rows);
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_tolerance_sees_one_weight_off_by_one() {
        // A weight one step off against an activation at its block's maximum (127) changes the
        // product by 127 d_w d_x: the tolerance at K = 576 must be below that, or the tests above
        // could miss a wrong weight.
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let k = 576;
        // Ordinary scales (row kind 4), the activation's blocks all of one magnitude.
        let mut w = weights(&mut rng, 5, k).split_off(4 * k / QK * BLOCK_BYTES);
        let x = Q8Activation::quantize(&activations(&mut rng, k, false));
        let i = x.q[..QK].iter().position(|q| q.abs() == 127).expect("a block's maximum quantizes to +-127");
        let (want, abs) = reference(&w, k, &x, 0);
        let v = w[2 + i] as i8;
        w[2 + i] = if v == 127 { 126 } else { (v + 1) as u8 };
        let (off, _) = reference(&w, k, &x, 0);
        assert!((off - want).abs() > tolerance(k, abs), "one step is {:e}, the tolerance {:e}", (off - want).abs(), tolerance(k, abs));
    }

    #[test]
    fn the_tolerance_sees_one_nibble_off_by_one() {
        // As for Q8_0, on blocks as a quantizer makes them (d > 0, the minimum m between -15 d
        // and 0, so that the weights straddle zero): a nibble one step off against an activation
        // of +-127 changes the product by 127 d_w d_x, which must exceed the tolerance at K = 576.
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        let k = 576;
        let mut w = Vec::new();
        for _ in 0..k / QK {
            let d: f32 = rng.random_range(1e-3..0.1);
            w.extend(half::f16::from_f32(d).to_bits().to_le_bytes());
            w.extend(half::f16::from_f32(-d * rng.random_range(0.0..15.0)).to_bits().to_le_bytes());
            w.extend((0..QK / 2).map(|_| rng.random::<u8>()));
        }
        let x = Q8Activation::quantize(&activations(&mut rng, k, false));
        let (want, abs) = reference_q4_1(&w, k, &x, 0);
        // Every position of the first block whose activation is +-127, each nibble half.
        let at_127: Vec<usize> = (0..QK).filter(|&i| x.q[i].abs() == 127).collect();
        assert!(!at_127.is_empty(), "a block's maximum quantizes to +-127");
        for i in at_127 {
            let (byte, shift) = (4 + i % (QK / 2), if i < QK / 2 { 0 } else { 4 });
            let mut off = w.clone();
            let q = (w[byte] >> shift) & 0x0F;
            let q_off = if q == 15 { 14 } else { q + 1 };
            off[byte] = (w[byte] & !(0x0F << shift)) | (q_off << shift);
            let (got, _) = reference_q4_1(&off, k, &x, 0);
            let (step, tol) = ((got - want).abs(), tolerance_q4_1(k, abs));
            assert!(step > tol, "position {i}: one step is {step:e}, the tolerance {tol:e}");
        }
    }

    #[test]
    fn every_path_is_exact_at_the_saturation_corners() {
        // The largest pair sums the AVX2 path forms: w = -128 (|w| = 128 as the unsigned operand)
        // and +127 against activations of +-127, in runs of equal signs; the Neon path's i16
        // pairs (bytes j and 16 + j of a block) reach 2 * 128 * 127 the same way. With unit
        // scales the products are integers below 2^24, exact in f32: any saturation or sign
        // wrap shows. K = 224 is one group of four blocks (the Arm paths) and a tail of three.
        let k = 224;
        let minus_128 = |row: usize, b: usize, i: usize| match row {
            0 => true,
            1 => false,
            2 => (i / 8).is_multiple_of(2),
            3 => (i / 2).is_multiple_of(2),
            _ => (b + i).is_multiple_of(3),
        };
        let mut w = Vec::new();
        for row in 0..5 {
            for b in 0..k / QK {
                w.extend(half::f16::from_f32(1.0).to_bits().to_le_bytes());
                w.extend((0..QK).map(|i| if minus_128(row, b, i) { -128i8 } else { 127 } as u8));
            }
        }
        let xs: [Vec<f32>; 3] = [vec![-1.0; k], vec![1.0; k], (0..k).map(|i| if i % 4 < 2 { 1.0 } else { -1.0 }).collect()];
        for x in xs {
            let x = Q8Activation::quantize(&x);
            assert!(x.scales.iter().all(|&d| d == 1.0 / 127.0) && x.q.iter().all(|q| q.abs() == 127));
            let x = Q8Activation { scales: vec![1.0; k / QK], ..x };
            // The same with -128 for -127, for the paths that take it (Dotprod: `sdot`'s i32
            // lanes hold up to 8 * 128 * 128).
            let q = x.q.iter().map(|&q| if q == -127 { i8::MIN } else { q }).collect();
            let x_128 = Q8Activation { q, ..x.clone() };
            for (x, only) in [(x, false), (x_128, true)] {
                let want: Vec<f32> = (0..5).map(|r| reference(&w, k, &x, r).0 as f32).collect();
                assert!(want.iter().any(|v| v.abs() >= 32.0 * 128.0 * 127.0), "the corner must be reached: {want:?}");
                for path in paths().into_iter().filter(|p| !only || p.takes_minus_128()) {
                    let mut out = vec![0.0; 5];
                    gemv_q8_0_on(path, &w, k, &x, 0..5, &mut out);
                    assert_eq!(out, want, "{path:?}");
                }
            }
        }
    }

    #[test]
    fn every_path_is_exact_at_q4_1s_corners() {
        // The largest sums the Q4_1 kernel forms: nibbles of 15 (and patterns of 15 and 0)
        // against activations of +-127 and of -128, which gemv_q4_1 takes. With unit scales, the
        // minimums 0, 1 and -1 and d_x = 1, every product is an integer below 2^24, exact in
        // f32: any saturation, wrong nibble or wrong minimum term shows. K = 224 is a group of
        // four blocks and a tail of three.
        let k = 224;
        let nibble = |row: usize, b: usize, i: usize| -> u8 {
            match row {
                0 => 15,
                1 => 0,
                2 => {
                    if (i / 8).is_multiple_of(2) {
                        15
                    } else {
                        0
                    }
                }
                3 => {
                    if i < QK / 2 {
                        15
                    } else {
                        0
                    }
                }
                _ => ((b * 7 + i * 5) % 16) as u8,
            }
        };
        for m in [0.0f32, 1.0, -1.0] {
            let mut w = Vec::new();
            for row in 0..5 {
                for b in 0..k / QK {
                    w.extend(half::f16::from_f32(1.0).to_bits().to_le_bytes());
                    w.extend(half::f16::from_f32(m).to_bits().to_le_bytes());
                    w.extend((0..QK / 2).map(|j| nibble(row, b, j) | nibble(row, b, j + QK / 2) << 4));
                }
            }
            let xs: [Vec<i8>; 4] = [vec![-128; k], vec![127; k], vec![-127; k], (0..k).map(|i| if i % 4 < 2 { 127 } else { -128 }).collect()];
            for q in xs {
                let sums = q.chunks_exact(QK).map(|b| b.iter().map(|&v| v as i32).sum()).collect();
                let x = Q8Activation { scales: vec![1.0; k / QK], q, sums };
                let want: Vec<f32> = (0..5).map(|r| reference_q4_1(&w, k, &x, r).0 as f32).collect();
                if m == 0.0 && x.q[0] == -128 {
                    assert_eq!(want[0], -(k as f32) * 15.0 * 128.0, "the corner must be reached");
                }
                for path in paths() {
                    let mut out = vec![0.0; 5];
                    gemv_q4_1_on(path, &w, k, &x, 0..5, &mut out);
                    assert_eq!(out, want, "{path:?} m = {m}");
                }
            }
        }
    }

    /// `out`, a kernel's product of `qt` (a candle QTensor, N x K) with `x`, against candle's
    /// dequantized weights times the dequantized activation, in f64. The tolerance is the
    /// kernel's (from the format's reference, which reads the blocks as the kernels do) plus the
    /// rounding of the dequantized weights (none for Q8_0, one each for Q4_1's `d * q + m`:
    /// f32::EPSILON is twice that); the reference itself is checked against candle's weights too.
    fn check_against_candle(format: Format, qt: &candle_core::quantized::QTensor, x: &Q8Activation, out: &[f32]) {
        let (n, k) = qt.shape().dims2().unwrap();
        let wd: Vec<f32> = qt.dequantize(&candle_core::Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let bytes = qt.data().unwrap();
        for r in 0..n {
            let terms = (0..k).map(|i| wd[r * k + i] as f64 * x.q[i] as f64 * x.scales[i / QK] as f64);
            let (want, abs_w) = (terms.clone().sum::<f64>(), terms.map(f64::abs).sum::<f64>());
            let (reference, abs) = format.reference(&bytes, k, x, r);
            let tol = format.tolerance(k, abs) + f32::EPSILON as f64 * abs_w;
            assert!((reference - want).abs() <= tol, "{format:?} row {r}: the test's reference {reference} for candle's {want}");
            assert!((out[r] as f64 - want).abs() <= tol, "{format:?} row {r}: {} for {want} (tolerance {tol:e})", out[r]);
        }
    }

    #[test]
    fn reads_candles_q8_0_storage() {
        // A Q8_0 QTensor's bytes, as candle stores them: the product is the dequantized weights'
        // (exact in f32: an i8 times an f16 scale) with the dequantized activation.
        use candle_core::quantized::{GgmlDType, QTensor};
        use candle_core::{Device, Tensor};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (n, k) = (9, 96);
        let wf: Vec<f32> = (0..n * k).map(|_| rng.random_range(-2.0..2.0)).collect();
        let qt = QTensor::quantize(&Tensor::from_vec(wf, (n, k), &Device::Cpu).unwrap(), GgmlDType::Q8_0).unwrap();
        let wd: Vec<f32> = qt.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let bytes = qt.data().unwrap();
        let x = Q8Activation::quantize(&activations(&mut rng, k, true));
        for path in paths() {
            let mut out = vec![0.0; n];
            gemv_q8_0_on(path, &bytes, k, &x, 0..n, &mut out);
            for r in 0..n {
                let want: f64 = (0..k).map(|i| wd[r * k + i] as f64 * x.q[i] as f64 * x.scales[i / QK] as f64).sum();
                let abs: f64 = (0..k).map(|i| (wd[r * k + i] as f64 * x.q[i] as f64 * x.scales[i / QK] as f64).abs()).sum();
                assert!((out[r] as f64 - want).abs() <= tolerance(k, abs), "{path:?} row {r}: {} for {want}", out[r]);
            }
        }
    }

    #[test]
    fn reads_candles_q4_1_storage() {
        // A Q4_1 QTensor's bytes, as candle stores them (its quantizer: d = (max - min) / 15,
        // m = min), rows of every kind: random, constant (d = 0), all negative, spanning 1e-3.
        use candle_core::quantized::{GgmlDType, QTensor};
        use candle_core::{Device, Tensor};
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let (n, k) = (9, 224);
        let wf: Vec<f32> = (0..n * k)
            .map(|i| match i / k {
                0 => 0.5,
                1 => rng.random_range(-3.0..-1.0),
                2 => rng.random_range(0.0..1e-3),
                _ => rng.random_range(-2.0..2.0),
            })
            .collect();
        let qt = QTensor::quantize(&Tensor::from_vec(wf, (n, k), &Device::Cpu).unwrap(), GgmlDType::Q4_1).unwrap();
        let bytes = qt.data().unwrap();
        assert_eq!(bytes.len(), n * k / QK * Q4_1_BLOCK_BYTES);
        let x = Q8Activation::quantize(&activations(&mut rng, k, true));
        for path in paths() {
            let mut out = vec![0.0; n];
            gemv_q4_1_on(path, &bytes, k, &x, 0..n, &mut out);
            check_against_candle(Format::Q4_1, &qt, &x, &out);
        }
    }

    #[test]
    fn block_matrices_multiply_every_row_and_refuse_what_they_cannot() {
        // 300 rows: past the size that brings in the helpers, and not a whole number of chunks.
        // One row, three rows (each its own product) and a 3-D input, against the kernel on the
        // same activation; two matrices at once give each one's own product.
        use candle_core::quantized::{GgmlDType, QTensor};
        use candle_core::{Device, Tensor};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (n, k) = (300, 256);
        let w = Tensor::from_vec((0..n * k).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<_>>(), (n, k), &Device::Cpu).unwrap();
        let xs: Vec<f32> = (0..3).flat_map(|_| activations(&mut rng, k, true)).collect();
        let x3 = Tensor::from_vec(xs.clone(), (3, k), &Device::Cpu).unwrap();
        for format in BlockFormat::ALL {
            let qt = QTensor::quantize(&w, format.dtype()).unwrap();
            let bm = BlockMatrix::from_qtensor(&qt).unwrap().expect("a block format");
            assert_eq!((bm.dims(), bm.data().len()), ((n, k), n * format.row_bytes(k)));
            let y = bm.forward(&x3).unwrap();
            assert_eq!(y.dims(), [3, n]);
            let y: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
            for r in 0..3 {
                let xq = Q8Activation::quantize(&xs[r * k..][..k]);
                let mut want = vec![0.0; n];
                gemv(format, bm.data(), k, &xq, 0..n, &mut want);
                assert_eq!(&y[r * n..][..n], &want[..], "{format:?} row {r}");
            }
            let y3 = bm.forward(&x3.reshape((1, 3, k)).unwrap()).unwrap();
            assert_eq!(y3.dims(), [1, 3, n]);
            let halves = [
                BlockMatrix::new(format, n / 2, k, bm.bytes.clone(), 0).unwrap(),
                BlockMatrix::new(format, n - n / 2, k, bm.bytes.clone(), n / 2 * format.row_bytes(k)).unwrap(),
            ];
            let both = BlockMatrix::forward_all(&[&halves[0], &halves[1]], &x3).unwrap();
            let joined: Vec<f32> = Tensor::cat(&both, 1).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(joined, y, "{format:?}: two halves at once");
        }
        for dtype in [GgmlDType::Q2K, GgmlDType::F16, GgmlDType::F32] {
            assert!(BlockMatrix::from_qtensor(&QTensor::quantize(&w, dtype).unwrap()).unwrap().is_none(), "{dtype:?}");
        }
        let bytes: std::sync::Arc<dyn AsRef<[u8]> + Send + Sync> = std::sync::Arc::new(vec![0u8; 2 * 34 * 2]);
        let err = BlockMatrix::new(BlockFormat::Q8_0, 3, 64, bytes.clone(), 0).unwrap_err().to_string();
        assert!(err.contains("runs past its 136 bytes"), "{err}");
        let err = BlockMatrix::new(BlockFormat::Q4K, 1, 64, bytes.clone(), 0).unwrap_err().to_string();
        assert!(err.contains("not whole blocks of 256"), "{err}");
        let ok = BlockMatrix::new(BlockFormat::Q8_0, 2, 64, bytes, 0).unwrap();
        let err = ok.forward(&Tensor::zeros((1, 32), candle_core::DType::F32, &Device::Cpu).unwrap()).unwrap_err().to_string();
        assert!(err.contains("against a weight of [2, 64]"), "{err}");
        assert!(ok.rows(&[2]).unwrap_err().to_string().contains("row 2 of a matrix of 2 rows"));
    }

    #[test]
    fn the_quantizer_is_ggmls() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let k = 2048 + 32;
        let x = activations(&mut rng, k, true);
        assert!(x.chunks_exact(QK).any(|b| b.iter().all(|&v| v == 0.0)), "the data must have an all-zero block");
        let a = Q8Activation::quantize(&x);
        assert_eq!((a.q.len(), a.scales.len(), a.sums.len()), (k, k / QK, k / QK));
        for (((xb, qb), &d), &sum) in x.chunks_exact(QK).zip(a.q.chunks_exact(QK)).zip(&a.scales).zip(&a.sums) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(d, amax / 127.0);
            assert_eq!(sum, qb.iter().map(|&q| q as i32).sum::<i32>());
            if amax == 0.0 {
                assert!(qb.iter().all(|&q| q == 0), "an all-zero block quantizes to 0");
                continue;
            }
            // The maximum maps to +-127, and nothing beyond it.
            assert!(qb.iter().all(|q| (-127..=127).contains(q)) && qb.iter().any(|q| q.abs() == 127), "{qb:?}");
            for (&v, &q) in xb.iter().zip(qb) {
                // Round to nearest: within d/2, but for the f32 roundings of 1/d and x * (1/d)
                // (relative 2^-24 each, on a value up to 127): 128 ulps of d cover them.
                let err = (v as f64 - q as f64 * d as f64).abs();
                assert!(err <= d as f64 * (0.5 + 128.0 * f32::EPSILON as f64), "{v} -> {q} * {d}: error {err}");
            }
        }
    }

    #[test]
    fn quantize_into_reuses_its_buffers() {
        // A token's activation into the buffers of the last: the same allocations.
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let mut a = Q8Activation::quantize(&activations(&mut rng, 576, true));
        let (q, s, sums) = (a.q.as_ptr(), a.scales.as_ptr(), a.sums.as_ptr());
        let x = activations(&mut rng, 576, true);
        a.quantize_into(&x);
        assert_eq!((a.q.as_ptr(), a.scales.as_ptr(), a.sums.as_ptr()), (q, s, sums), "quantize_into reallocated");
        assert_eq!(a, Q8Activation::quantize(&x));
        // A shorter K shrinks the lengths (not the buffers).
        a.quantize_into(&x[..64]);
        assert_eq!(a, Q8Activation::quantize(&x[..64]));
    }

    /// Two input rows at once give each the bits it gets alone, Q8_0 and Q4_1, on every path (on I8mm they
    /// share every instruction, a row paired with itself when alone), with an odd number of
    /// weight rows (the last pairs with itself) and a row range off the first; and
    /// `BlockMatrix::forward_all` of several rows gives each the bits of a one-row call.
    #[test]
    fn rows_in_pairs_are_each_rows_product_to_the_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for path in paths() {
            for (format, (n, k)) in [BlockFormat::Q8_0, BlockFormat::Q4_1].into_iter().flat_map(|f| [(7, 96), (4, 32), (9, 160), (1, 64)].map(|s| (f, s))) {
                let w = match format {
                    BlockFormat::Q8_0 => weights(&mut rng, n, k),
                    _ => q4_1_weights(&mut rng, n, k),
                };
                let xs: Vec<Q8Activation> = (0..2).map(|_| Q8Activation::quantize(&activations(&mut rng, k, true))).collect();
                for rows in [0..n, n / 2..n] {
                    let alone: Vec<Vec<f32>> = xs
                        .iter()
                        .map(|x| {
                            let mut o = vec![0f32; rows.len()];
                            gemv_on(path, format, &w, k, x, rows.clone(), &mut o);
                            o
                        })
                        .collect();
                    let (mut o0, mut o1) = (vec![f32::NAN; rows.len()], vec![f32::NAN; rows.len()]);
                    gemv_pair_on(path, format, &w, k, &xs[0], &xs[1], rows.clone(), &mut o0, &mut o1);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!((bits(&o0), bits(&o1)), (bits(&alone[0]), bits(&alone[1])), "{path:?} {format:?}: n {n}, k {k}, rows {rows:?}");
                }
            }
        }
        // Through the decode product, on the detected path: three rows (a pair and one alone).
        let (n, k) = (70, 128);
        for (format, bytes) in [(BlockFormat::Q8_0, weights(&mut rng, n, k)), (BlockFormat::Q4_1, q4_1_weights(&mut rng, n, k))] {
            let m = BlockMatrix::new(format, n, k, std::sync::Arc::new(bytes), 0).unwrap();
            let x: Vec<f32> = (0..3).flat_map(|_| activations(&mut rng, k, false)).collect();
            let all = BlockMatrix::forward_all(&[&m], &candle_core::Tensor::from_vec(x.clone(), (3, k), &candle_core::Device::Cpu).unwrap()).unwrap();
            let all: Vec<Vec<f32>> = all[0].to_vec2().unwrap();
            for (r, row) in all.iter().enumerate() {
                let one = m.forward(&candle_core::Tensor::from_vec(x[r * k..(r + 1) * k].to_vec(), (1, k), &candle_core::Device::Cpu).unwrap()).unwrap();
                assert_eq!(one.to_vec2::<f32>().unwrap()[0], *row, "{format:?}: row {r} of three");
            }
        }
    }

    #[test]
    fn the_default_path_is_the_fastest_here() {
        #[cfg(target_arch = "aarch64")]
        let want = {
            assert!(GemvPath::Neon.runs_here() && !GemvPath::Avx2.runs_here() && !GemvPath::Avx512.runs_here());
            match (std::arch::is_aarch64_feature_detected!("dotprod"), std::arch::is_aarch64_feature_detected!("i8mm")) {
                (true, true) => GemvPath::I8mm,
                (true, false) => GemvPath::Dotprod,
                _ => GemvPath::Neon,
            }
        };
        #[cfg(not(target_arch = "aarch64"))]
        let want = {
            assert!(!GemvPath::Neon.runs_here() && !GemvPath::Dotprod.runs_here());
            [GemvPath::Avx512, GemvPath::Avx2].into_iter().find(|p| p.runs_here()).unwrap_or(GemvPath::Portable)
        };
        assert_eq!(GemvPath::detect(), want);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            assert!(std::arch::is_x86_feature_detected!("f16c"), "an AVX2 CPU without F16C: the AVX2 path assumed none exists");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16c_converts_every_f16_as_half_does() {
        if !std::arch::is_x86_feature_detected!("f16c") {
            return;
        }
        for bits in 0..=u16::MAX {
            // SAFETY: the CPU has F16C (checked above).
            let got = unsafe { x86::f16_bits_to_f32(bits) };
            let want = half::f16::from_bits(bits).to_f32();
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{bits:#06x}: {got} for {want}");
        }
    }

    #[cfg(target_arch = "aarch64")]
    #[test]
    fn fcvtl_converts_every_f16_as_half_does() {
        for bits in 0..=u16::MAX {
            let got = aarch64::f16_bits_to_f32(bits);
            let want = half::f16::from_bits(bits).to_f32();
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{bits:#06x}: {got} for {want}");
        }
    }

    #[test]
    fn neon_and_dotprod_agree_to_the_bit() {
        // The two Arm paths do the same float work on the same i32 lanes (see `aarch64`), so
        // their results are equal bit for bit, for every K (groups of four blocks and every
        // tail), row and kind of scale. Q4_1 with -128 in the activation too (both take it).
        if !(GemvPath::Neon.runs_here() && GemvPath::Dotprod.runs_here()) {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(27);
        for format in [Format::Q8_0, Format::Q4_1] {
            for k in [32, 64, 96, 128, 224, 576, 1536 + 96] {
                let n = 13;
                let w = format.weights(&mut rng, n, k);
                for mixed in [false, true] {
                    let mut x = Q8Activation::quantize(&activations(&mut rng, k, mixed));
                    if let (Format::Q4_1, true) = (format, mixed) {
                        for (qb, sum) in x.q.chunks_exact_mut(QK).zip(&mut x.sums) {
                            qb[rng.random_range(0..QK)] = i8::MIN;
                            *sum = qb.iter().map(|&q| q as i32).sum();
                        }
                    }
                    let (mut neon, mut dotprod) = (vec![0.0; n], vec![0.0; n]);
                    format.gemv_on(GemvPath::Neon, &w, k, &x, 0..n, &mut neon);
                    format.gemv_on(GemvPath::Dotprod, &w, k, &x, 0..n, &mut dotprod);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&neon), bits(&dotprod), "{format:?} K = {k}: {neon:?} {dotprod:?}");
                }
            }
        }
        // The other formats (`formats`): random bytes, -128 in the activation too.
        for format in BlockFormat::ALL {
            for k in [256usize, 768, 896, 4864].into_iter().filter(|k| k.is_multiple_of(format.block_len())) {
                let n = 5;
                let w = format_weights(&mut rng, format, n, k);
                let mut x = Q8Activation::quantize(&activations(&mut rng, k, true));
                if format != BlockFormat::Q8_0 {
                    for (qb, sum) in x.q.chunks_exact_mut(QK).zip(&mut x.sums) {
                        qb[rng.random_range(0..QK)] = i8::MIN;
                        *sum = qb.iter().map(|&q| q as i32).sum();
                    }
                }
                let (mut neon, mut dotprod) = (vec![0.0; n], vec![0.0; n]);
                gemv_on(GemvPath::Neon, format, &w, k, &x, 0..n, &mut neon);
                gemv_on(GemvPath::Dotprod, format, &w, k, &x, 0..n, &mut dotprod);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&neon), bits(&dotprod), "{format:?} K = {k}: {neon:?} {dotprod:?}");
            }
        }
    }

    #[test]
    fn an_empty_k_or_row_range_gives_zeros_or_nothing() {
        let x = Q8Activation::quantize(&[]);
        for format in [Format::Q8_0, Format::Q4_1] {
            for path in paths() {
                let mut out = vec![f32::NAN; 3];
                format.gemv_on(path, &[], 0, &x, 0..3, &mut out);
                assert_eq!(out, [0.0; 3], "{format:?} {path:?}");
                format.gemv_on(path, &format.weights(&mut rand::rngs::StdRng::seed_from_u64(1), 2, 64), 64, &Q8Activation::quantize(&[1.0; 64]), 2..2, &mut []);
            }
        }
    }

    #[test]
    #[should_panic(expected = "not a multiple of 32")]
    fn a_k_off_the_blocks_panics() {
        gemv_q8_0(&[0; 34], 48, &Q8Activation::default(), 0..1, &mut [0.0]);
    }

    #[test]
    #[should_panic(expected = "up to row 3")]
    fn rows_past_the_weight_panic() {
        let w = weights(&mut rand::rngs::StdRng::seed_from_u64(1), 2, 64);
        gemv_q8_0(&w, 64, &Q8Activation::quantize(&[1.0; 64]), 1..3, &mut [0.0; 2]);
    }

    #[test]
    #[should_panic(expected = "out has 1 values for rows 0..2")]
    fn a_short_out_panics() {
        let w = weights(&mut rand::rngs::StdRng::seed_from_u64(1), 2, 64);
        gemv_q8_0(&w, 64, &Q8Activation::quantize(&[1.0; 64]), 0..2, &mut [0.0; 1]);
    }

    #[test]
    fn a_q8_0_activation_of_minus_128_is_exact_or_refused() {
        // The paths that sum two products in an i16 (Avx2, Neon) refuse a -128, which
        // (-128) * (-128) twice would overflow; the others (Dotprod, Portable) are exact on it:
        // weights of -128 against activations of -128 with unit scales, 2 * 32 * 16384 = 2^20.
        let k = 64;
        let w: Vec<u8> = (0..k / QK).flat_map(|_| half::f16::from_f32(1.0).to_bits().to_le_bytes().into_iter().chain([0x80; QK])).collect();
        let x = Q8Activation { scales: vec![1.0; k / QK], q: vec![i8::MIN; k], sums: vec![QK as i32 * -128; k / QK] };
        for path in paths() {
            let run = || {
                let mut out = [0.0];
                gemv_q8_0_on(path, &w, k, &x, 0..1, &mut out);
                out[0]
            };
            if path.takes_minus_128() {
                assert_eq!(run(), (1 << 20) as f32, "{path:?}");
            } else {
                let err = std::panic::catch_unwind(run).expect_err("a -128 must be refused");
                let msg = err.downcast_ref::<String>().map(String::as_str).unwrap_or_default();
                assert!(msg.contains("has a -128"), "{path:?}: {msg}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "not whole rows of K = 64 (40 bytes each)")]
    fn q8_0_bytes_as_q4_1_panic() {
        // Two Q8_0 rows (136 bytes) are no whole number of Q4_1 rows.
        let w = weights(&mut rand::rngs::StdRng::seed_from_u64(1), 2, 64);
        gemv_q4_1(&w, 64, &Q8Activation::quantize(&[1.0; 64]), 0..2, &mut [0.0; 2]);
    }

    #[test]
    #[should_panic(expected = "block sums are not its values'")]
    fn q4_1_with_wrong_block_sums_panics() {
        let w = q4_1_weights(&mut rand::rngs::StdRng::seed_from_u64(1), 1, 64);
        let mut x = Q8Activation::quantize(&[1.0; 64]);
        x.q[40] -= 1;
        gemv_q4_1(&w, 64, &x, 0..1, &mut [0.0]);
    }

    #[test]
    #[should_panic(expected = "has 1 block sums for 2 blocks")]
    fn q4_1_without_block_sums_panics() {
        let w = q4_1_weights(&mut rand::rngs::StdRng::seed_from_u64(1), 1, 64);
        let mut x = Q8Activation::quantize(&[1.0; 64]);
        x.sums.pop();
        gemv_q4_1(&w, 64, &x, 0..1, &mut [0.0]);
    }

    // --- Every format through `gemv_on`, against candle's own dequantization ---

    /// Where `format`'s f16 fields are in a block: the scale `d`, and the minimum's (`dmin`, `m`)
    /// for the formats that subtract one.
    fn f16_fields(format: BlockFormat) -> (usize, Option<usize>) {
        match format {
            BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0 => (0, None),
            BlockFormat::Q4_1 | BlockFormat::Q4K | BlockFormat::Q5K => (0, Some(2)),
            BlockFormat::Q6K => (208, None),
        }
    }

    /// `n` rows of `k` weights of `format`: random bytes (every value, scale and bit pattern),
    /// the f16 fields finite, of kind `r % 6` for row `r` ([`scale_bits`]), a minimum of either
    /// sign.
    fn format_weights(rng: &mut impl Rng, format: BlockFormat, n: usize, k: usize) -> Vec<u8> {
        let (bytes, (d, m)) = (format.block_bytes(), f16_fields(format));
        let mut w: Vec<u8> = (0..n * format.row_bytes(k)).map(|_| rng.random()).collect();
        for (i, blk) in w.chunks_exact_mut(bytes).enumerate() {
            let kind = i / (k / format.block_len()) % 6;
            blk[d..d + 2].copy_from_slice(&scale_bits(rng, kind).to_le_bytes());
            if let Some(m) = m {
                let sign = if rng.random() { 0x8000 } else { 0 };
                blk[m..m + 2].copy_from_slice(&(scale_bits(rng, kind) ^ sign).to_le_bytes());
            }
        }
        w
    }

    /// The rows of `w` dequantized by candle (ggml's `to_float`), `[n, k]`.
    fn candle_rows(format: BlockFormat, w: &[u8], n: usize, k: usize) -> Vec<f32> {
        use candle_core::quantized::ggml_file::qtensor_from_ggml;
        let t = qtensor_from_ggml(format.dtype(), w, vec![n, k], &candle_core::Device::Cpu).unwrap();
        t.dequantize(&candle_core::Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Row `r`'s product in f64 from candle's dequantized weights, and the sum of the absolute
    /// terms the kernels add: `|d ...| |q q_x|` and, for a minimum, `|dmin m| |q_x|` per weight,
    /// found by dequantizing with the minimum, then the scale, set to zero.
    fn format_reference(format: BlockFormat, w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>) -> Vec<(f64, f64)> {
        let n = w.len() / format.row_bytes(k);
        let xf: Vec<f64> = x.q.iter().enumerate().map(|(i, &q)| q as f64 * x.scales[i / QK] as f64).collect();
        let zeroed = |at: usize| {
            let mut z = w.to_vec();
            z.chunks_exact_mut(format.block_bytes()).for_each(|b| b[at..at + 2].fill(0));
            candle_rows(format, &z, n, k)
        };
        let (d, m) = f16_fields(format);
        let wf = candle_rows(format, w, n, k);
        let parts = m.map(|m| (zeroed(m), zeroed(d)));
        rows.map(|r| {
            let row = |v: &[f32]| v[r * k..][..k].to_vec();
            let sum = row(&wf).iter().zip(&xf).map(|(&w, &x)| w as f64 * x).sum();
            let abs = match &parts {
                None => row(&wf).iter().zip(&xf).map(|(&w, &x)| (w as f64 * x).abs()).sum(),
                Some((scaled, mins)) => row(scaled).iter().zip(row(mins)).zip(&xf).map(|((&s, mn), &x)| (s.abs() + mn.abs()) as f64 * x.abs()).sum(),
            };
            (sum, abs)
        })
        .collect()
    }

    /// As [`tolerance_q4_1`], with room for the K-quants' longer way to the sum (per
    /// super-block: the scale's two products, a chain of at most K / 256 + 1 FMAs per
    /// accumulator, the minimum terms' own chain and the final subtraction) and for candle's
    /// dequantization, which rounds each weight (`d * sc` then `* q - dmin * m`: 3 roundings).
    fn format_tolerance(k: usize, abs: f64) -> f64 {
        (k / QK + 16) as f64 * f32::EPSILON as f64 * abs
    }

    fn check_format(format: BlockFormat, path: GemvPath, w: &[u8], k: usize, x: &Q8Activation, rows: Range<usize>) {
        let mut out = vec![f32::NAN; rows.len()];
        gemv_on(path, format, w, k, x, rows.clone(), &mut out);
        for ((r, got), (want, abs)) in rows.clone().zip(&out).zip(format_reference(format, w, k, x, rows.clone())) {
            let (err, tol) = ((*got as f64 - want).abs(), format_tolerance(k, abs));
            assert!(err <= tol, "{format:?} {path:?} K = {k} rows {rows:?}: row {r} is {got} for {want} (error {err:e} > {tol:e})");
        }
    }

    #[test]
    fn every_format_on_every_path_matches_candles_dequantization() {
        // K of one super-block, two, three, Llama-3.2-1B's hidden 2048, Qwen2.5-0.5B's
        // intermediate 4864 (19 super-blocks); 32-blocks also at K = 32, 96, 896 (Qwen2.5-0.5B's
        // hidden size: no K-quant row); row sub-ranges as above.
        let mut rng = rand::rngs::StdRng::seed_from_u64(35);
        for format in BlockFormat::ALL {
            for k in [32usize, 96, 256, 512, 768, 896, 2048, 4864] {
                if !k.is_multiple_of(format.block_len()) {
                    continue;
                }
                let n = 7;
                let w = format_weights(&mut rng, format, n, k);
                for mixed in [false, true] {
                    let x = Q8Activation::quantize(&activations(&mut rng, k, mixed));
                    for path in paths() {
                        for rows in [0..n, 2..n, 3..4, n..n] {
                            check_format(format, path, &w, k, &x, rows);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_format_is_exact_at_its_integer_corners() {
        // The largest integer sums each kernel forms: every byte of the weights 0xFF (the
        // largest values, scales and minimums, the fifth and sixth bits set; Q6_K's scales -1),
        // 0x00, or alternating, with unit f16 fields, against activations of +-127 and of -128
        // with unit scales. A saturated i16 pair or a wrapped sign would be off by thousands;
        // the tolerance is a few parts in 10^6.
        let one = half::f16::from_f32(1.0).to_bits().to_le_bytes();
        let k = 512;
        for format in BlockFormat::ALL {
            let (d, m) = f16_fields(format);
            for fill in [0xFFu8, 0x00, 0xAA, 0x55] {
                let mut w = vec![fill; 2 * format.row_bytes(k)];
                for blk in w.chunks_exact_mut(format.block_bytes()) {
                    blk[d..d + 2].copy_from_slice(&one);
                    if let Some(m) = m {
                        blk[m..m + 2].copy_from_slice(&one);
                    }
                }
                for q in [vec![127i8; k], vec![-128; k], (0..k).map(|i| if i % 4 < 2 { 127 } else { -128 }).collect()] {
                    if format == BlockFormat::Q8_0 && q.contains(&i8::MIN) {
                        continue; // Q8_0's own test covers -128 (some paths refuse it).
                    }
                    let sums = q.chunks_exact(QK).map(|b| b.iter().map(|&v| v as i32).sum()).collect();
                    let x = Q8Activation { scales: vec![1.0; k / QK], q, sums };
                    for path in paths() {
                        check_format(format, path, &w, k, &x, 0..2);
                    }
                }
            }
        }
    }

    #[test]
    fn the_format_tolerance_sees_one_bit_of_any_value_byte() {
        // Rows as a quantizer makes them (candle's, from normal weights), K = 512: flipping the
        // lowest bit of any byte past the f16 fields (a value, a fifth or sixth bit, a sub-block
        // scale or minimum) changes the dequantized row; against activations of 127 (unit
        // scales) that must move the product by more than the tolerance, or the tests above
        // could miss a wrong weight.
        use candle_core::quantized::QTensor;
        let mut rng = rand::rngs::StdRng::seed_from_u64(36);
        let k = 512;
        let normal: Vec<f32> = (0..k).map(|_| (0..12).map(|_| rng.random_range(-0.5f32..0.5)).sum()).collect();
        let x = Q8Activation { scales: vec![1.0; k / QK], q: vec![127; k], sums: vec![127 * QK as i32; k / QK] };
        for format in BlockFormat::ALL {
            let t = candle_core::Tensor::from_vec(normal.clone(), (1, k), &candle_core::Device::Cpu).unwrap();
            let w = QTensor::quantize(&t, format.dtype()).unwrap().data().unwrap().to_vec();
            let (_, abs) = format_reference(format, &w, k, &x, 0..1)[0];
            let tol = format_tolerance(k, abs);
            let base = candle_rows(format, &w, 1, k);
            let (d, m) = f16_fields(format);
            let f16_bytes = |i: usize| [Some(d), m].into_iter().flatten().any(|at| (at..at + 2).contains(&(i % format.block_bytes())));
            let mut seen = 0;
            for i in (0..w.len()).filter(|&i| !f16_bytes(i)) {
                let mut off = w.clone();
                off[i] ^= 1;
                let step: f64 = candle_rows(format, &off, 1, k).iter().zip(&base).map(|(a, b)| (a - b) as f64 * 127.0).sum();
                if step != 0.0 {
                    seen += 1;
                    assert!(step.abs() > tol, "{format:?} byte {i}: one bit moves the row by {step:e}, the tolerance is {tol:e}");
                }
            }
            assert!(seen > w.len() / 2, "{format:?}: only {seen} of {} bytes change the row", w.len());
        }
    }

    #[test]
    fn a_single_value_is_candles_dequantization_to_the_bit() {
        // Random bytes (every value, scale and bit; finite f16 fields) of every format: each
        // weight read alone equals the whole matrix's dequantization by candle, bit for bit.
        let mut rng = rand::rngs::StdRng::seed_from_u64(37);
        for format in BlockFormat::ALL {
            let (n, k) = (3, 512);
            let w = format_weights(&mut rng, format, n, k);
            let want = candle_rows(format, &w, n, k);
            let m = BlockMatrix::new(format, n, k, std::sync::Arc::new(w), 0).unwrap();
            for r in 0..n {
                for c in 0..k {
                    assert_eq!(m.value(r, c).to_bits(), want[r * k + c].to_bits(), "{format:?} ({r}, {c})");
                }
            }
            for c in 0..k {
                let mut col = vec![0f32; n - 1];
                m.column(c, 1..n, &mut col);
                let want: Vec<u32> = (1..n).map(|r| want[r * k + c].to_bits()).collect();
                assert_eq!(col.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "{format:?} column {c}");
            }
        }
    }
}
