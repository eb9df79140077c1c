//! The x86_64 paths of the decode product (AVX2 + FMA, and AVX-512 VNNI's `vpdpbusd` where the
//! CPU has it; see the parent module for what each does).
//!
//! Each kernel takes `R` input rows (1, 2 or 4) against the same weight rows: eight weight
//! blocks are loaded, unpacked and transposed once for all of them into the activation's group
//! layout ([`Q8Activation`]'s groups; Q4_1's nibbles, Q8_0's bytes with the sign trick's `|w|`
//! or VNNI's `w + 128`, the f16 scales' conversion), and every input row then does exactly the
//! single row's arithmetic, in the same order, into accumulators of its own. So a row's output
//! has the bits it gets alone (batched decode must answer each conversation as it is answered
//! alone), and the work a row adds is its own multiply-adds only. The blocks' integer dots
//! come out exact, one a lane, on either path (`vpdpbusd`, or `vpmaddubsw` + `vpmaddwd`: no
//! pair saturates the i16 step, see the parent module), and the float work on them is the same,
//! so the same bits on either path.

use std::arch::x86_64::*;

use super::super::hsum8 as hsum;
use super::{Q8Activation, BLOCK_BYTES, Q4_1_BLOCK_BYTES, QK};

/// Bytes ahead of the current block to prefetch (see the module docs).
pub(super) const PREFETCH: usize = 8192;

/// One input row's side of a product: its quantized values (also in groups of eight blocks,
/// [`Q8Activation`]'s `groups`), block scales and block sums.
#[derive(Clone, Copy)]
struct Act {
    q: *const i8,
    g: *const i8,
    d: *const f32,
    s: *const i32,
}

impl Act {
    fn of(x: &Q8Activation) -> Self {
        Act { q: x.q.as_ptr(), g: x.groups.as_ptr(), d: x.scales.as_ptr(), s: x.sums.as_ptr() }
    }
}

/// `out[i][j]`, for each input row `x[i]`, is weight row j's Q8_0 product with it.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `w` is `out[i].len()` whole rows of `nb` blocks for every
/// `i`; each `x[i]` has `nb` blocks and no -128.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn gemv_q8_0_avx2<const R: usize>(w: &[u8], nb: usize, x: [&Q8Activation; R], out: [&mut [f32]; R]) {
    // SAFETY: the caller's contract, passed on; the CPU has the features.
    unsafe { rows::<R>(w, nb * BLOCK_BYTES, x, out, |row, x| rows_dot_q8_0::<R, false>(row, nb, x)) }
}

/// [`gemv_q8_0_avx2`] with `vpdpbusd` (and AVX-512 VL's 32 vector registers).
///
/// # Safety
/// As [`gemv_q8_0_avx2`], and the CPU has AVX-512 F, BW, VL and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemv_q8_0_vnni<const R: usize>(w: &[u8], nb: usize, x: [&Q8Activation; R], out: [&mut [f32]; R]) {
    // SAFETY: as in `gemv_q8_0_avx2`.
    unsafe { rows::<R>(w, nb * BLOCK_BYTES, x, out, |row, x| rows_dot_q8_0::<R, true>(row, nb, x)) }
}

/// `out[i][j]`, for each input row `x[i]`, is weight row j's Q4_1 product with it.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `w` is `out[i].len()` whole rows of `nb` Q4_1 blocks for
/// every `i`; each `x[i]` has `nb` blocks and `nb` sums.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn gemv_q4_1_avx2<const R: usize>(w: &[u8], nb: usize, x: [&Q8Activation; R], out: [&mut [f32]; R]) {
    // SAFETY: the caller's contract, passed on; the CPU has the features.
    unsafe { rows::<R>(w, nb * Q4_1_BLOCK_BYTES, x, out, |row, x| rows_dot_q4_1::<R, false>(row, nb, x)) }
}

/// [`gemv_q4_1_avx2`] with `vpdpbusd` (and AVX-512 VL's 32 vector registers).
///
/// # Safety
/// As [`gemv_q4_1_avx2`], and the CPU has AVX-512 F, BW, VL and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemv_q4_1_vnni<const R: usize>(w: &[u8], nb: usize, x: [&Q8Activation; R], out: [&mut [f32]; R]) {
    // SAFETY: as in `gemv_q4_1_avx2`.
    unsafe { rows::<R>(w, nb * Q4_1_BLOCK_BYTES, x, out, |row, x| rows_dot_q4_1::<R, true>(row, nb, x)) }
}

/// The weight rows of `w` (`row_bytes` each) one after another, so that the weights are one
/// sequential stream, each against every input row by `dot`.
///
/// # Safety
/// `dot` is safe for each of `w`'s rows with the activations of `x` (the callers' contracts).
#[inline(always)]
unsafe fn rows<const R: usize>(w: &[u8], row_bytes: usize, x: [&Q8Activation; R], mut out: [&mut [f32]; R], dot: impl Fn(*const u8, [Act; R]) -> [f32; R]) {
    let x = x.map(Act::of);
    for (j, row) in w.chunks_exact(row_bytes).take(out[0].len()).enumerate() {
        let got = dot(row.as_ptr(), x);
        for (o, g) in out.iter_mut().zip(got) {
            o[j] = g;
        }
    }
}

/// One weight row's Q8_0 products with `R` input rows, eight blocks at a time as Q4_1's
/// ([`rows_dot_q4_1`]): per group the eight blocks' values transposed once into the
/// activation's group layout, and per row eight `vpdpbusd` (or AVX2's sign trick, below) that
/// leave the eight blocks' integer dots in eight lanes; then one `cvt` and one FMA by `d_w d_x`
/// (the eight blocks' `d_w` converted once for every row). A last group of fewer than eight
/// blocks goes block by block ([`block_q8_0`], its partial dots in the same accumulator), which
/// at SmolLM2's K of 18 blocks is cheaper than a group of two.
///
/// # Safety
/// As the callers', for the `nb` blocks at `w`; inlined only into them (their features).
#[inline(always)]
unsafe fn rows_dot_q8_0<const R: usize, const VNNI: bool>(w: *const u8, nb: usize, x: [Act; R]) -> [f32; R] {
    // SAFETY: every read is of blocks below `nb`, in the row, and of the activations' first
    // `nb` blocks, sums and groups (the caller's contract); prefetches never fault, wherever
    // they point.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); R];
        for b in (0..nb - nb % 8).step_by(8) {
            // A group is 272 bytes: five prefetches 64 bytes apart reach every cache line.
            for line in 0..5 {
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(BLOCK_BYTES * b + PREFETCH + 64 * line).cast());
            }
            group_q8_0::<R, VNNI>(w.add(BLOCK_BYTES * b), &x, b, &mut acc);
        }
        for b in nb - nb % 8..nb {
            block_q8_0::<R, VNNI>(w, &x, b, &mut acc);
        }
        acc.map(|a| hsum(a))
    }
}

/// [`rows_dot_q8_0`]'s group: the eight blocks at `w`, which are blocks `b..b + 8` of every row
/// in `x` (`b` a multiple of 8), onto each row's accumulator (lane i: block `b + i`).
///
/// The integer dots, exact on either path: with VNNI, `vpdpbusd` of the weights plus 128 (a
/// sign-bit flip, unsigned for its first operand, once per group) with the row's values, less
/// 128 times the row's block sums (`sum (w + 128) x - 128 sum x`; any i8 on either side, the
/// lanes' i32 far from overflow); on AVX2, ggml's sign trick (`|w|` once per group, each row's
/// values signed by the weights', `vpmaddubsw` and `vpmaddwd` by ones: `vpmaddubsw`'s pair of
/// 128 * 127 twice fits its i16, see the module docs), two groups of four columns summed in i32.
///
/// # Safety
/// Eight blocks at `w`; each `x[r]` has blocks `b..b + 8`, their sums and the group of `b`.
#[inline(always)]
unsafe fn group_q8_0<const R: usize, const VNNI: bool>(w: *const u8, x: &[Act; R], b: usize, acc: &mut [__m256; R]) {
    // SAFETY: the caller's contract; registers otherwise.
    unsafe {
        // Block j's 32 values are eight dwords, dword t its values 4t..4t + 4. The first (or
        // second) 16 bytes of blocks j and j + 4 in the halves of one vector, then a 4 x 4 dword
        // transpose per half: `tq[t]` holds dword t of block i in lane i.
        let half = |j: usize, h: usize| _mm_loadu_si128(w.add(BLOCK_BYTES * j + 2 + 16 * h).cast());
        let y = |j: usize, h: usize| _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(half(j, h)), half(j + 4, h));
        let lo = transpose4(y(0, 0), y(1, 0), y(2, 0), y(3, 0));
        let hi = transpose4(y(0, 1), y(1, 1), y(2, 1), y(3, 1));
        let tq: [__m256i; 8] = std::array::from_fn(|t| if t < 4 { lo[t] } else { hi[t - 4] });
        let d = |j: usize| w.add(BLOCK_BYTES * j).cast::<i16>().read_unaligned();
        let dw = _mm256_cvtph_ps(_mm_setr_epi16(d(0), d(1), d(2), d(3), d(4), d(5), d(6), d(7)));
        // The weights as each path multiplies them: plus 128 (unsigned) for `vpdpbusd`, whose
        // 128 times the values' sum comes off after; `|w|` for `vpmaddubsw`, the values then
        // signed by the weights'.
        let wp = tq.map(|v| if VNNI { _mm256_xor_si256(v, _mm256_set1_epi8(i8::MIN)) } else { _mm256_sign_epi8(v, v) });
        let ones = _mm256_set1_epi16(1);
        for (r, x) in x.iter().enumerate() {
            let group = x.g.add(32 * b);
            let xv = |t: usize| _mm256_loadu_si256(group.add(32 * t).cast());
            let dot = |s: __m256i, t: usize| {
                if VNNI {
                    _mm256_dpbusd_epi32(s, wp[t], xv(t))
                } else {
                    _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(wp[t], _mm256_sign_epi8(xv(t), tq[t])), ones))
                }
            };
            // Two chains, not one of eight.
            let (mut s0, mut s1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for t in (0..8).step_by(2) {
                s0 = dot(s0, t);
                s1 = dot(s1, t + 1);
            }
            let mut dots = _mm256_add_epi32(s0, s1);
            if VNNI {
                dots = _mm256_sub_epi32(dots, _mm256_slli_epi32::<7>(_mm256_loadu_si256(x.s.add(b).cast())));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(dw, _mm256_loadu_ps(x.d.add(b))), acc[r]);
        }
    }
}

/// A 4 x 4 transpose of dwords in each 128-bit half: lane i of result u is lane u of `y[i]`.
#[inline(always)]
unsafe fn transpose4(y0: __m256i, y1: __m256i, y2: __m256i, y3: __m256i) -> [__m256i; 4] {
    // SAFETY: registers only (the callers have AVX2).
    unsafe {
        let (t0, t1) = (_mm256_unpacklo_epi32(y0, y1), _mm256_unpackhi_epi32(y0, y1));
        let (t2, t3) = (_mm256_unpacklo_epi32(y2, y3), _mm256_unpackhi_epi32(y2, y3));
        [_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2), _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)]
    }
}

/// One Q8_0 block `b` of the row at `w` against every row of `x`, its eight lanes' partial
/// dots (four values each) onto each row's accumulator: per block `|w|` once (the sign trick:
/// `vpsignb` of the weights by themselves, unsigned for `vpmaddubsw`), then per row its values
/// signed by the weights', the i32 dot and one FMA (the same lanes on either path: `vpdpbusd`
/// sums what `vpmaddubsw` + `vpmaddwd` sum). A function, not a closure: a closure called in a
/// loop may stay a call, and its intrinsics with it.
///
/// # Safety
/// Block `b` is in the row at `w` and in every `x[r]`, which has no -128 there.
#[inline(always)]
unsafe fn block_q8_0<const R: usize, const VNNI: bool>(w: *const u8, x: &[Act; R], b: usize, acc: &mut [__m256; R]) {
    // SAFETY: the caller's contract; prefetches never fault.
    unsafe {
        let blk = w.add(BLOCK_BYTES * b);
        _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH).cast());
        let wv = _mm256_loadu_si256(blk.add(2).cast());
        // `d_w` in every lane (`vpbroadcastw`, `vcvtph2ps`): converted as a scalar, LLVM
        // inserts the word into whatever register is at hand (`vpinsrw`), an accumulator as
        // often as not, and each block's scale then waits on that accumulator's FMA.
        let dw = _mm256_cvtph_ps(_mm_set1_epi16(blk.cast::<i16>().read_unaligned()));
        let aw = _mm256_sign_epi8(wv, wv);
        for (a, x) in acc.iter_mut().zip(x) {
            let sx = _mm256_sign_epi8(_mm256_loadu_si256(x.q.add(QK * b).cast()), wv);
            let dot =
                if VNNI { _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx) } else { _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)) };
            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(*x.d.add(b))), *a);
        }
    }
}

/// One weight row's Q4_1 products with `R` input rows, eight blocks at a time: per group the
/// eight blocks' nibbles unpacked and transposed once into the activation's group layout
/// (`Q8Activation::groups`: vector `t` holds each block's values `4t..4t + 4` in its lane), and
/// per row eight `vpdpbusd` (or `vpmaddubsw`, summed in i16, and one `vpmaddwd`) that leave the
/// eight blocks' integer sums in eight i32 lanes, with no horizontal sums; then one `cvt`, one
/// FMA by `d_w d_x` and one by `m_w` times `d_x sum_x` (the eight blocks' `d` and `m` converted
/// once for every row). The transpose is shared by the rows, so a row adds about 13
/// instructions per eight blocks, where summing each block's lanes took 31. A last group of
/// five to seven blocks takes zeros in the missing lanes (nibbles, `d`, `m` and, in the
/// activation's padding, values: `acc + 0 * 0`); one of at most four goes by [`short_q4_1`],
/// with the same bits for less work.
///
/// # Safety
/// As the callers', for the `nb` blocks at `w`; inlined only into them (their features).
#[inline(always)]
unsafe fn rows_dot_q4_1<const R: usize, const VNNI: bool>(w: *const u8, nb: usize, x: [Act; R]) -> [f32; R] {
    // SAFETY: every read is of blocks below `nb`, in the row, and of the activations' first
    // `nb` blocks, sums and groups (the caller's contract; a short last group's loads are masked
    // or skipped, its activation values the groups' zero padding); prefetches never fault,
    // wherever they point.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); R];
        for b in (0..nb - nb % 8).step_by(8) {
            // A group is 160 bytes: three prefetches 64 bytes apart reach every cache line.
            for line in 0..3 {
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(Q4_1_BLOCK_BYTES * b + PREFETCH + 64 * line).cast());
            }
            group_q4_1::<R, VNNI>(w.add(Q4_1_BLOCK_BYTES * b), 8, &x, b, &mut acc);
        }
        match nb % 8 {
            0 => {}
            n @ 1..=SHORT => short_q4_1::<R, VNNI>(w.add(Q4_1_BLOCK_BYTES * (nb - n)), n, &x, nb - n, &mut acc),
            n => group_q4_1::<R, VNNI>(w.add(Q4_1_BLOCK_BYTES * (nb - n)), n, &x, nb - n, &mut acc),
        }
        acc.map(|a| hsum(a))
    }
}

/// A last group of at most this many Q4_1 blocks goes by [`short_q4_1`]: its two `vphaddd`
/// levels fill four lanes (SmolLM2's K of 576, 18 blocks, leaves two; Qwen's 896 leaves four).
const SHORT: usize = 4;

/// [`group_q4_1`] for a last group of `n` <= [`SHORT`] blocks, with its bits: a group costs
/// eight `vpdpbusd` a row whatever it holds, so here each block's integer dot is taken in value
/// order instead (one `vpdpbusd`, or `vpmaddubsw` + `vpmaddwd`, into eight lanes, exact) and
/// the blocks' lanes are summed into lane i (`vphaddd`, exact in i32), where the group leaves
/// block i's sum; then the group's own float work on the same lanes (zeros past `n`).
///
/// # Safety
/// As [`group_q4_1`]'s, with `n <= SHORT`.
#[inline(always)]
unsafe fn short_q4_1<const R: usize, const VNNI: bool>(w: *const u8, n: usize, x: &[Act; R], b: usize, acc: &mut [__m256; R]) {
    // SAFETY: the caller's contract; every value read is of blocks `b..b + n`.
    unsafe {
        let mask = _mm_set1_epi8(0x0F);
        // Byte i holds value i (low nibble) and value 16 + i (high).
        let wv: [__m256i; SHORT] = std::array::from_fn(|j| {
            if j < n {
                let qs = _mm_loadu_si128(w.add(Q4_1_BLOCK_BYTES * j + 4).cast());
                _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(qs), mask), _mm_and_si128(qs, mask))
            } else {
                _mm256_setzero_si256()
            }
        });
        let (dw, mw, lanes) = scales_q4_1(w, n);
        let zero = _mm256_setzero_si256();
        for (r, x) in x.iter().enumerate() {
            let dot = |j: usize| {
                if j >= n {
                    return zero;
                }
                let xq = _mm256_loadu_si256(x.q.add(QK * (b + j)).cast());
                if VNNI {
                    _mm256_dpbusd_epi32(zero, wv[j], xq)
                } else {
                    _mm256_madd_epi16(_mm256_maddubs_epi16(wv[j], xq), _mm256_set1_epi16(1))
                }
            };
            // [d0 lanes 01, 23, d1 01, 23 | 45, 67, ...], then [d0 0123, d1 0123, d2 0123, d3
            // 0123 | 4567 ...], then the halves added: block j's sum in lane j.
            let h01 = _mm256_hadd_epi32(dot(0), dot(1));
            let h = _mm256_hadd_epi32(h01, if n > 2 { _mm256_hadd_epi32(dot(2), dot(3)) } else { zero });
            let sums = _mm256_zextsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h)));
            tail_q4_1(sums, dw, mw, lanes, n, x, b, &mut acc[r]);
        }
    }
}

/// [`rows_dot_q4_1`]'s group: the `n` (at most 8) blocks at `w`, which are blocks `b..b + n` of
/// every row in `x` (`b` a multiple of 8), onto each row's accumulator. The scales and sums of a
/// short group are masked loads (`vmaskmovps`: the lanes past `n` read as zero and are never
/// touched).
///
/// # Safety
/// `n` blocks at `w`; each `x[r]` has blocks `b..b + n` and the group of `b`.
#[inline(always)]
unsafe fn group_q4_1<const R: usize, const VNNI: bool>(w: *const u8, n: usize, x: &[Act; R], b: usize, acc: &mut [__m256; R]) {
    // SAFETY: the caller's contract; registers otherwise.
    unsafe {
        let blk = |j: usize| w.add(Q4_1_BLOCK_BYTES * j);
        // Block j's 16 bytes of nibbles are four dwords: dword u the low nibbles of values
        // 4u..4u + 4 and the high ones of 16 + 4u..16 + 4u + 4. Blocks j and j + 4 in the halves
        // of one vector, then a 4 x 4 dword transpose per half: `tq[u]` holds dword u of block i
        // in lane i. A missing block is zeros.
        let qs = |j: usize| if j < n { _mm_loadu_si128(blk(j).add(4).cast()) } else { _mm_setzero_si128() };
        let y = |j: usize| _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(qs(j)), qs(j + 4));
        let tq = transpose4(y(0), y(1), y(2), y(3));
        // Values 4t..4t + 4 of every block: the low nibbles of `tq[t]` for t < 4, the high
        // nibbles of `tq[t - 4]` (values 16..32) after (the 16-bit shift brings the next byte's
        // low bits into the top of each byte; the mask drops them).
        let mask = _mm256_set1_epi8(0x0F);
        let nib: [__m256i; 8] = std::array::from_fn(|t| match t {
            0..4 => _mm256_and_si256(tq[t], mask),
            _ => _mm256_and_si256(_mm256_srli_epi16::<4>(tq[t - 4]), mask),
        });
        let (dw, mw, lanes) = scales_q4_1(w, n);
        for (r, x) in x.iter().enumerate() {
            let group = x.g.add(32 * b);
            let xv = |t: usize| _mm256_loadu_si256(group.add(32 * t).cast());
            // Block i's sum in lane i (nibbles unsigned: see the module docs for why no pair
            // saturates `vpmaddubsw`'s i16; eight pairs are at most 8 * 2 * 15 * 128 = 30720, so
            // their i16 sum does not wrap). Two chains of `vpdpbusd`, not one of eight.
            let sums = if VNNI {
                let (mut s0, mut s1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for t in (0..8).step_by(2) {
                    s0 = _mm256_dpbusd_epi32(s0, nib[t], xv(t));
                    s1 = _mm256_dpbusd_epi32(s1, nib[t + 1], xv(t + 1));
                }
                _mm256_add_epi32(s0, s1)
            } else {
                let pairs = (1..8).fold(_mm256_maddubs_epi16(nib[0], xv(0)), |s, t| _mm256_add_epi16(s, _mm256_maddubs_epi16(nib[t], xv(t))));
                _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
            };
            tail_q4_1(sums, dw, mw, lanes, n, x, b, &mut acc[r]);
        }
    }
}

/// The `n` (at most 8) Q4_1 blocks at `w`'s scales in block order, d in `dw` and m in `mw` (zero
/// for a missing block), and the mask of the lanes of the blocks there.
///
/// # Safety
/// `n` blocks at `w`.
#[inline(always)]
unsafe fn scales_q4_1(w: *const u8, n: usize) -> (__m256, __m256, __m256i) {
    // SAFETY: the caller's contract; registers otherwise.
    unsafe {
        // The blocks' d and m (an i32 each: d in the low half), zero for a missing block, as
        // [d0..d3, m0..m3 | d4..d7, m4..m7] (`vpackusdw` of the halves: exact, both below 2^16),
        // then in block order and converted.
        let dm = |j: usize| if j < n { w.add(Q4_1_BLOCK_BYTES * j).cast::<i32>().read_unaligned() } else { 0 };
        let dms = _mm256_setr_epi32(dm(0), dm(1), dm(2), dm(3), dm(4), dm(5), dm(6), dm(7));
        let packed = _mm256_packus_epi32(_mm256_and_si256(dms, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32::<16>(dms));
        let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
        let lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        (_mm256_cvtph_ps(_mm256_castsi256_si128(packed)), _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(packed)), lanes)
    }
}

/// A Q4_1 group's float work for one row: block i's integer sum (lane i of `sums`) by `d_w d_x`,
/// and `m_w` times `d_x sum_x`, onto `acc` (the scales and sums of a short group are masked
/// loads, `vmaskmovps`: the lanes past `n` read as zero and are never touched).
///
/// # Safety
/// `x` has blocks `b..b + n`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tail_q4_1(sums: __m256i, dw: __m256, mw: __m256, lanes: __m256i, n: usize, x: &Act, b: usize, acc: &mut __m256) {
    // SAFETY: the caller's contract.
    unsafe {
        let (dx, xs) = if n == 8 {
            (_mm256_loadu_ps(x.d.add(b)), _mm256_loadu_si256(x.s.add(b).cast()))
        } else {
            (_mm256_maskload_ps(x.d.add(b), lanes), _mm256_maskload_epi32(x.s.add(b), lanes))
        };
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dw, dx), *acc);
        *acc = _mm256_fmadd_ps(mw, _mm256_mul_ps(dx, _mm256_cvtepi32_ps(xs)), *acc);
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

/// [`Q8Activation::quantize_into`]'s blocks on AVX2: `x` into `a`'s `q`, `scales`, `sums` and
/// `groups` in one pass, the same values as the portable loop bit for bit (the same f32
/// operations lane by lane: the maximum of `|x|` never taking a NaN, `amax / 127`, `1 / d`, and
/// `rows::round_clamp`'s rounding, half away from zero, NaN to 0), where that loop, compiled,
/// took 506 ns for a row of 576 on an AMD EPYC, a twentieth of a four-stream decode step
/// (`bench_gemv`'s last lines). The groups come from an in-register 8 x 8 transpose of each
/// eight blocks' 4-byte pieces, zeros for blocks past the last.
///
/// # Safety
/// The CPU has AVX2; `x.len()` is a multiple of [`QK`], and `a`'s buffers are sized for it:
/// `q` of `x.len()`, `scales` and `sums` of `x.len() / QK`, `groups` of `x.len() / QK`
/// rounded up to eight blocks, 256 bytes each.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_avx2(x: &[f32], a: &mut Q8Activation) {
    let nb = x.len() / QK;
    debug_assert!(a.q.len() == x.len() && a.scales.len() == nb && a.sums.len() == nb && a.groups.len() == nb.div_ceil(8) * 256);
    // SAFETY: the CPU has AVX2; every read is within `x` (block b < nb), every write within the
    // buffers sized as the contract says.
    unsafe {
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
        let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(128.0));
        let (qlo, qhi) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
        let (half, neg_half) = (_mm256_set1_ps(0.5), _mm256_set1_ps(-0.5));
        // `packs` leaves the dwords of four vectors a, b, c, d as a0 b0 c0 d0 a1 b1 c1 d1.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for g in 0..nb.div_ceil(8) {
            let n = (nb - 8 * g).min(8);
            let block = |i: usize| -> [__m256; 4] {
                let xs = x.as_ptr().add((8 * g + i) * QK);
                [_mm256_loadu_ps(xs), _mm256_loadu_ps(xs.add(8)), _mm256_loadu_ps(xs.add(16)), _mm256_loadu_ps(xs.add(24))]
            };
            // The eight blocks' largest magnitudes first, so that their scales are two vector
            // divisions (each a block's own, correctly rounded: the scalar division's bits), not
            // two dependent scalar ones per block.
            let mut amax = [0f32; 8];
            for (i, amax) in amax.iter_mut().enumerate().take(n) {
                // `vmaxps(a, m)` is `a > m ? a : m`: the portable loop's step, a NaN never taken.
                let mut m = _mm256_setzero_ps();
                for v in block(i) {
                    m = _mm256_max_ps(_mm256_and_ps(v, abs_mask), m);
                }
                // Over the lanes in any order: they hold no NaN and no -0, so the maximum is one
                // value whichever way it is taken.
                let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
                let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
                *amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
            }
            let d = _mm256_div_ps(_mm256_loadu_ps(amax.as_ptr()), _mm256_set1_ps(127.0));
            // 1 / d, and 0 where d is 0.
            let id = _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(d, _mm256_setzero_ps()), _mm256_div_ps(_mm256_set1_ps(1.0), d));
            let (mut scales, mut ids) = ([0f32; 8], [0f32; 8]);
            _mm256_storeu_ps(scales.as_mut_ptr(), d);
            _mm256_storeu_ps(ids.as_mut_ptr(), id);
            let mut pieces = [_mm256_setzero_si256(); 8];
            for (i, p) in pieces.iter_mut().enumerate().take(n) {
                let b = 8 * g + i;
                let (v, id) = (block(i), _mm256_set1_ps(ids[i]));
                // A loop, not `map`: the closure stayed a call per vector, its constants reloaded.
                let mut q = [_mm256_setzero_si256(); 4];
                for (q, v) in q.iter_mut().zip(v) {
                    let y = _mm256_mul_ps(v, id);
                    // NaN to 0, then within [-128, 128] (`round_clamp`'s order).
                    let y = _mm256_and_ps(y, _mm256_cmp_ps::<_CMP_ORD_Q>(y, y));
                    let y = _mm256_min_ps(_mm256_max_ps(y, lo), hi);
                    let t = _mm256_cvttps_epi32(y);
                    let f = _mm256_sub_ps(y, _mm256_cvtepi32_ps(t));
                    // A true compare is -1: subtracting it adds one.
                    let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(f, half));
                    let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(f, neg_half));
                    let t = _mm256_add_epi32(_mm256_sub_epi32(t, up), down);
                    *q = _mm256_min_epi32(_mm256_max_epi32(t, qlo), qhi);
                }
                let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
                let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
                let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
                *p = _mm256_permutevar8x32_epi32(bytes, order);
                _mm256_storeu_si256(a.q.as_mut_ptr().add(b * QK) as *mut __m256i, *p);
                *a.scales.get_unchecked_mut(b) = scales[i];
                *a.sums.get_unchecked_mut(b) = _mm_cvtsi128_si32(s);
            }
            // Piece t of block i to `32 t + 4 i`: per half of eight blocks a 4 x 4 transpose in
            // each 128-bit lane (pieces t and t + 4), then the halves' lanes joined.
            let [a0, a1, a2, a3] = transpose4(pieces[0], pieces[1], pieces[2], pieces[3]);
            let [b0, b1, b2, b3] = transpose4(pieces[4], pieces[5], pieces[6], pieces[7]);
            let out = a.groups.as_mut_ptr().add(256 * g) as *mut __m256i;
            for (t, (l, h)) in [(a0, b0), (a1, b1), (a2, b2), (a3, b3)].into_iter().enumerate() {
                _mm256_storeu_si256(out.add(t), _mm256_permute2x128_si256::<0x20>(l, h));
                _mm256_storeu_si256(out.add(t + 4), _mm256_permute2x128_si256::<0x31>(l, h));
            }
        }
    }
}
