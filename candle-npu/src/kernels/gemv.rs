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
//!   instructions with ggml's sign trick (`vpsignb` twice, `vpmaddubsw`, `vpmaddwd` by ones);
//!   Q4_1 eight blocks at a time, their nibbles unpacked and transposed into the layout the
//!   activation keeps for it ([`Q8Activation`]'s groups), then `vpmaddubsw` directly (the
//!   nibbles are the unsigned operand), so that the eight blocks' integer sums come out in eight
//!   lanes before any float work; the rows one after another so
//!   that the weights are one sequential stream, prefetched 8 KiB ahead; several input rows
//!   share each block's loads and unpacking ([`gemv_rows`]; see `x86` for why, and the
//!   measurements).
//! - [`GemvPath::Avx512`] (AVX-512 VNNI too): the same Q8_0 and Q4_1 kernels with `vpdpbusd` in
//!   place of `vpmaddubsw` + `vpmaddwd` (the same i32 lanes, so the same bits as Avx2); faster
//!   kernels for Q4_0, Q5_0 and the K-quants.
//! - [`GemvPath::Dotprod`] (aarch64 with FEAT_DotProd, every phone core since the Cortex-A55 and
//!   A76): a block of 32 i8 x 32 i8 in two `sdot` (16 multiply-adds each, into i32: nothing
//!   saturates, a -128 anywhere is fine), a Q4_1 block's nibbles unpacked with `and` and `ushr`
//!   (0..15, the same as signed bytes); the f16 scales of four blocks converted at once
//!   (`fcvtl`), four accumulators; no software prefetch (Arm's prefetchers follow a stream
//!   across pages). See `aarch64` for why, and the instruction counts.
//! - [`GemvPath::I8mm`] (aarch64 with FEAT_I8MM too, Snapdragon 8 Gen 1 on): Q8_0 and Q4_1 take
//!   two input rows by two weight rows per `smmla`, a single row paired with itself, so a
//!   speculative verifier's second row is free and each row has the bits it gets alone
//!   ([`gemv_rows`]); its own float order (one FMA chain per output), so it does not agree with
//!   Dotprod to the bit. The other formats run Dotprod's kernels.
//! - [`GemvPath::Neon`] (any aarch64 CPU: NEON is baseline): the same with the products widened
//!   to i16 (`smull`, `smlal`: two products per i16, which a Q8_0 activation of -128 could
//!   overflow, so this path refuses it as the AVX2 one does) and pairs added into i32; the same
//!   i32 lanes as `sdot`'s, so that it agrees with Dotprod to the bit.
//! - [`GemvPath::Portable`]: plain Rust, any CPU, and the SIMD paths' cross-check.

use std::ops::Range;
use std::sync::OnceLock;

mod activation;
mod batch;
mod formats;

pub use activation::Q8Activation;
pub use batch::{gemv_rows, gemv_rows_on};

/// Values per block (Q8_0 and Q4_1 alike).
pub const QK: usize = 32;
/// Bytes per Q8_0 weight block: an f16 scale, then 32 i8.
pub const BLOCK_BYTES: usize = 34;
/// Bytes per Q4_1 weight block: an f16 scale and an f16 minimum, then 32 4-bit weights.
pub const Q4_1_BLOCK_BYTES: usize = 20;

/// Which kernel [`gemv_q8_0`] and [`gemv_q4_1`] run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvPath {
    /// x86_64 with AVX-512 F, BW, VL and VNNI besides AVX2, FMA and F16C (AMD Zen 4 on, Intel
    /// Ice Lake on): `vpdpbusd` multiplies 32 bytes and sums them into i32 in one instruction
    /// (Q8_0, Q4_1, and in `formats` Q4_0, Q5_0, Q4_K and Q5_K), a block's 32 fifth bits become a
    /// byte mask in one (Q5_0); Q6_K runs the AVX2 kernel here.
    Avx512,
    /// x86_64 with AVX2, FMA and F16C (every AVX2 CPU has F16C: Intel since Ivy Bridge, AMD
    /// since Piledriver, so asking for it loses no machine and spares a path without it).
    Avx2,
    /// aarch64 with FEAT_I8MM besides FEAT_DotProd (Cortex-A510/A710 and later: Snapdragon 8
    /// Gen 1 on): Q8_0 takes two input rows and two weight rows at a time by `smmla` (a 2 x 2
    /// block of 8-byte dot products per instruction), one input row paired with itself, so a
    /// verifier's second row costs what the first does ([`gemv_rows`]); Q4_1 the same, the other
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
            GemvPath::Avx2 => super::cpu::cpu().avx2_fma() && super::cpu::cpu().f16c,
            #[cfg(target_arch = "x86_64")]
            GemvPath::Avx512 => GemvPath::Avx2.runs_here() && super::cpu::cpu().avx512_vnni,
            #[cfg(not(target_arch = "x86_64"))]
            GemvPath::Avx2 | GemvPath::Avx512 => false,
            #[cfg(target_arch = "aarch64")]
            GemvPath::I8mm => super::cpu::cpu().dotprod && super::cpu::cpu().i8mm,
            #[cfg(target_arch = "aarch64")]
            GemvPath::Dotprod => super::cpu::cpu().dotprod,
            #[cfg(target_arch = "aarch64")]
            GemvPath::Neon => true,
            #[cfg(not(target_arch = "aarch64"))]
            GemvPath::I8mm | GemvPath::Dotprod | GemvPath::Neon => false,
            GemvPath::Portable => true,
        }
    }

    /// How many input rows [`gemv_rows`] gives one call of this path's kernel for `format`
    /// (1: a call per row). Four on x86 (a server's batch here): a Q4_1 row keeps about five
    /// vectors in flight, so four rows fill AVX2's 16 registers (and run faster than two pairs,
    /// `bench_gemv`).
    pub fn rows_at_once(self, format: BlockFormat) -> usize {
        match (self, format) {
            (GemvPath::Avx512 | GemvPath::Avx2, BlockFormat::Q8_0 | BlockFormat::Q4_1) => 4,
            (GemvPath::I8mm, BlockFormat::Q8_0 | BlockFormat::Q4_1) => 2,
            _ => 1,
        }
    }

    /// Whether the path's kernel for `format` (Q8_0 or Q4_1) reads the activation's block sums
    /// ([`Q8Activation::sums`]): Q4_1's minimum term on every path, and Avx512's Q8_0, which
    /// takes 128 times them off its products of the weights plus 128 (see `x86`).
    fn reads_sums(self, format: BlockFormat) -> bool {
        format == BlockFormat::Q4_1 || self == GemvPath::Avx512
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
    assert_in_range("gemv_q8_0", path, x);
    if path.reads_sums(BlockFormat::Q8_0) {
        assert_sums("gemv_q8_0", x);
    }
    assert_groups("gemv_q8_0", x, true);
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2, FMA and F16C (asserted above); `w` is `out.len()` whole rows
        // of `nb` blocks and the activation has `nb` blocks (`checked_rows`), with no -128
        // (asserted above).
        GemvPath::Avx2 => unsafe { x86::gemv_q8_0_avx2::<1>(w, nb, [x], [out]) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as for Avx2, and the CPU has AVX-512 VNNI (asserted above).
        GemvPath::Avx512 => unsafe { x86::gemv_q8_0_vnni::<1>(w, nb, [x], [out]) },
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
    assert_groups("gemv_q4_1", x, true);
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2, FMA and F16C (asserted above); `w` is `out.len()` whole rows
        // of `nb` blocks and the activation has `nb` blocks (`checked_rows`) and `nb` sums
        // (asserted above).
        GemvPath::Avx2 => unsafe { x86::gemv_q4_1_avx2::<1>(w, nb, [x], [out]) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as for Avx2, and the CPU has AVX-512 VNNI (asserted above).
        GemvPath::Avx512 => unsafe { x86::gemv_q4_1_vnni::<1>(w, nb, [x], [out]) },
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

/// That `path`'s Q8_0 kernel takes `x`: no -128 where it cannot ([`GemvPath::takes_minus_128`];
/// `name`: the caller's, for the message). `contains` on bytes is a memchr: K bytes, against
/// rows.len() * K of weights.
fn assert_in_range(name: &str, path: GemvPath, x: &Q8Activation) {
    assert!(
        path.takes_minus_128() || !x.q.contains(&i8::MIN),
        "{name}: the activation has a -128, which {path:?} cannot take (Q8Activation::quantize gives [-127, 127])"
    );
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

/// That `x` has the groups of its blocks (the x86 Q8_0 and Q4_1 kernels read them): their length
/// always (O(1), what the kernels' reads need), with `values` their bytes too (O(K), where the
/// block sums are checked: `q` changed in place after the activation was built).
fn assert_groups(name: &str, x: &Q8Activation, values: bool) {
    let want = (x.q.len() / QK).div_ceil(8) * 256;
    assert_eq!(
        x.groups.len(),
        want,
        "{name}: the activation has {} bytes of groups for {} values (Q8Activation::from_parts builds them)",
        x.groups.len(),
        x.q.len()
    );
    if cfg!(target_arch = "x86_64") && values {
        let same = x.q.chunks_exact(QK).enumerate().all(|(b, qb)| {
            let at = 256 * (b / 8) + 4 * (b % 8);
            (0..8).all(|t| x.groups[at + 32 * t..at + 32 * t + 4] == qb[4 * t..4 * t + 4])
        });
        assert!(same, "{name}: the activation's values were changed after it was built (build it again: Q8Activation::from_parts)");
    }
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
mod x86;

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
mod aarch64;

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
        // Each matrix's outputs in a buffer of its own, written in place by the product (the
        // tensors take them as they are: no copy of the columns out of a shared one). Zeroed
        // first (about 2% of a four-stream decode step): the kernels write `&mut [f32]`, and a
        // reference to floats not yet initialized is not sound Rust (clippy's `uninit_vec`).
        let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; m * w.n]).collect();
        // The rows quantized into this thread's buffers of the last call (a decode step quantizes
        // four products' inputs a layer: an allocation per buffer each was 1% of a step).
        thread_local!(static XQ: std::cell::Cell<Vec<Q8Activation>> = const { std::cell::Cell::new(Vec::new()) });
        let mut xq = XQ.take();
        xq.resize_with(m, Default::default);
        crate::kernels::rows::with_f32(&xs, |v| v.chunks_exact(k.max(1)).zip(xq.iter_mut()).for_each(|(row, q)| q.quantize_into(row)))?;
        for (g, group) in xq[..m].chunks(Self::ROWS_PER_READ).enumerate() {
            let mut outs: Vec<&mut [f32]> = ys.iter_mut().zip(ws).map(|(y, w)| &mut y[g * Self::ROWS_PER_READ * w.n..][..group.len() * w.n]).collect();
            Self::product(ws, group, &mut outs);
        }
        // A prompt's many rows are not kept: only a decode step's few.
        xq.truncate(Self::ROWS_PER_READ);
        XQ.set(xq);
        let mut shape = x.dims().to_vec();
        ys.into_iter()
            .zip(ws)
            .map(|(y, w)| {
                *shape.last_mut().expect("checked above") = w.n;
                Ok(Tensor::from_vec(y, shape.as_slice(), &Device::Cpu)?.to_dtype(x.dtype())?)
            })
            .collect()
    }

    /// Rows a chunk of weights is kept in cache for ([`BlockMatrix::forward_all`]): beyond
    /// that, the next group of rows reads the weights again (a prompt on the CPU path is many
    /// rows; a verifier's are a few).
    const ROWS_PER_READ: usize = 16;

    /// Quantized rows `xq` (at most [`Self::ROWS_PER_READ`]) times each of `ws`: row `r`'s
    /// outputs of matrix `j` at `ys[j][r * n_j..]`.
    fn product(ws: &[&BlockMatrix], xq: &[Q8Activation], ys: &mut [&mut [f32]]) {
        assert!(xq.len() <= Self::ROWS_PER_READ, "decode product: {} rows at once, at most {}", xq.len(), Self::ROWS_PER_READ);
        // Row offsets of each matrix in the loop's rows (the matrices' one after another).
        let starts: Vec<usize> = ws.iter().scan(0, |at, w| Some(std::mem::replace(at, *at + w.n))).collect();
        let total: usize = ws.iter().map(|w| w.n).sum();
        let Some(k) = xq.first().map(|x| x.q.len()) else { return };
        let outs: Vec<OutPtr> = ys.iter_mut().map(|y| OutPtr(y.as_mut_ptr())).collect();
        let xs: Vec<&Q8Activation> = xq.iter().collect();
        // Chunks of 64 rows (64 x 576 weights of SmolLM2 are ~38 KB in Q8_0, ~23 KB in Q4_1:
        // microseconds, enough to amortize claiming one, small enough that a late helper leaves
        // little to wait for, and in L2 for every input row of a group). Whether helpers join a
        // product of SmolLM2's sizes depends on the machine (`claim::Tuner`), so it is measured.
        static SPLIT: super::claim::Tuner = super::claim::Tuner::new();
        SPLIT.for_each_chunk(total * k * xq.len(), xq.len(), total, 64, &|rows| {
            // The chunk's rows, matrix by matrix (a chunk may cross from one matrix to the next),
            // each with every input row while its weights are in cache.
            for ((w, &s), out) in ws.iter().zip(&starts).zip(&outs) {
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
                        // outputs of this matrix, its rows `p0 - s..p1 - s`) are disjoint; `ys`
                        // outlives the loop.
                        let out_of = |r: usize| unsafe { std::slice::from_raw_parts_mut(out.get().add(r * w.n + p0 - s), p1 - p0) };
                        // Every input row in one call (`gemv_rows`: each weight block is read
                        // and unpacked once for several rows), each with the bits it gets alone;
                        // their outputs on the stack (a piece is a few microseconds, and a
                        // four-stream step has thousands: an allocation each was 1-2% of it).
                        let mut outs: [&mut [f32]; Self::ROWS_PER_READ] = std::array::from_fn(|r| if r < xq.len() { out_of(r) } else { &mut [] });
                        // The rows' values need no check: `forward_all` quantized them.
                        batch::rows_on(GemvPath::detect(), w.format, w.data(), k, &xs, p0 - s..p1 - s, &mut outs[..xq.len()], false);
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
mod tests;
