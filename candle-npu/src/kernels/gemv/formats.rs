//! The decode product on the rest of ggml's block formats that checkpoints carry: Q4_0 and Q5_0
//! (blocks of 32, a scale and an offset baked into the values), and the K-quants Q4_K, Q5_K and
//! Q6_K (super-blocks of 256 with sub-block scales): every format of the three real GGUF files
//! and of llama.cpp's `Q4_K_M`, `Q5_K_M` and `Q8_0` mixes. With [`super::gemv_q8_0`] and
//! [`super::gemv_q4_1`], decode reads the user's file as it is: no second copy of a weight.
//!
//! Layouts (ggml's `ggml-common.h`; candle's `k_quants.rs` has the same `to_float`), all
//! little-endian, `d`/`dmin` f16:
//! - Q4_0, 18 bytes per 32: `d`, then 16 bytes `qs`; weight j (0..16) is `d * ((qs[j] & 15) - 8)`,
//!   weight j + 16 is `d * ((qs[j] >> 4) - 8)`.
//! - Q5_0, 22 bytes per 32: `d`, a u32 `qh`, 16 bytes `qs`; weight j is
//!   `d * ((qs[j] & 15 | bit j of qh << 4) - 16)`, weight j + 16 takes `qs[j] >> 4` and bit j + 16.
//! - Q4_K, 144 bytes per 256: `d`, `dmin`, 12 bytes of 6-bit scales and minimums ([`k_scales`]),
//!   128 bytes `qs`. Chunk c (0..4) of 64 weights is `qs[32c..32c + 32]`: its low nibbles are
//!   sub-block 2c, its high nibbles sub-block 2c + 1; weight = `d * sc * q - dmin * m` with the
//!   sub-block's `sc` and `m`.
//! - Q5_K, 176 bytes per 256: `d`, `dmin`, the same 12 scale bytes, 32 bytes `qh`, 128 bytes `qs`;
//!   as Q4_K, with bit 2c (low nibbles) or 2c + 1 (high) of `qh[l]` as the fifth bit of weight l of
//!   chunk c.
//! - Q6_K, 210 bytes per 256: 128 bytes `ql`, 64 bytes `qh`, 16 i8 scales, `d`. Half h (0..2) of
//!   128 weights has `ql[64h..]`, `qh[32h..]`; its four groups of 32 are
//!   `ql[l] & 15`, `ql[l + 32] & 15`, `ql[l] >> 4`, `ql[l + 32] >> 4` (l = 0..32) with bits
//!   (0, 1), (2, 3), (4, 5), (6, 7) of `qh[l]` on top; weight i is `d * scale[i / 16] * (q - 32)`.
//!
//! The activation is the same [`Q8Activation`] as for the other formats: blocks of 32 with an
//! f32 scale and their sums (ggml quantizes it to Q8_K, blocks of 256, for its K-quant
//! products: one activation for every matrix of a stage, whatever their formats, is simpler and
//! finer). Each 32 weights meet one activation block, whose scale `d_x` the float work takes:
//! - Q4_0, Q5_0: `d_w d_x sum (q - o) q_x` with the offset o (8, 16) taken off in the integers;
//! - Q4_K, Q5_K: `d sc d_x sum q q_x - dmin m d_x sum q_x` per sub-block (the minimum term from
//!   the activation's block sums, as for Q4_1);
//! - Q6_K: `d d_x (sc_a sum_a (q - 32) q_x + sc_b sum_b (q - 32) q_x)` over the block's two
//!   sub-blocks of 16, the scales applied in the integers.
//!
//! Every integer sum is exact and below 2^24 (so exact as f32): see each path's notes.
//! Paths as in the module above: AVX2 (x86_64 with FMA and F16C), Dotprod and Neon (aarch64,
//! the same i32 lanes, so the same bits), Portable.

use super::{GemvPath, Q8Activation, QK};

/// The formats of this file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Q4_0,
    Q5_0,
    Q4K,
    Q5K,
    Q6K,
}

impl Kind {
    /// Weights per block.
    pub(super) const fn block_len(self) -> usize {
        match self {
            Kind::Q4_0 | Kind::Q5_0 => QK,
            Kind::Q4K | Kind::Q5K | Kind::Q6K => QK_K,
        }
    }
    /// Bytes per block.
    pub(super) const fn block_bytes(self) -> usize {
        match self {
            Kind::Q4_0 => 18,
            Kind::Q5_0 => 22,
            Kind::Q4K => 144,
            Kind::Q5K => 176,
            Kind::Q6K => 210,
        }
    }
}

/// Weights per K-quant super-block.
pub(super) const QK_K: usize = 256;

/// The 8 sub-block scales and 8 minimums (6 bits each) of a Q4_K / Q5_K super-block from its 12
/// scale bytes `b`: for j < 4, `sc_j = b[j] & 63` and `m_j = b[j + 4] & 63`; for j >= 4 the low
/// four bits are the nibbles of `b[j + 4]` (low for `sc`, high for `m`) and the top two the top
/// bits of `b[j - 4]` (`sc`) or `b[j]` (`m`). Four at a time in u32 words.
#[inline(always)]
pub(crate) fn k_scales(b: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let word = |i: usize| u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
    let (u0, u1, u2) = (word(0), word(1), word(2));
    let (low6, low4, top2) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    let sc_hi = (u2 & low4) | ((u0 >> 6) & top2) << 4;
    let m_hi = ((u2 >> 4) & low4) | ((u1 >> 6) & top2) << 4;
    let sc = (u0 & low6) as u64 | (sc_hi as u64) << 32;
    let m = (u1 & low6) as u64 | (m_hi as u64) << 32;
    (sc.to_le_bytes(), m.to_le_bytes())
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// `out` = the rows of `w` (whole rows of `nb` blocks of `kind`) times `x`, on `path`.
///
/// # Safety
/// The CPU runs `path`; `w` is `out.len()` whole rows of `nb` blocks; `x` has `nb *
/// kind.block_len() / 32` blocks and as many sums.
pub(super) unsafe fn gemv(kind: Kind, path: GemvPath, w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        GemvPath::Avx2 => unsafe { x86::gemv(kind, w, nb, x, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        GemvPath::Avx512 => unsafe { x86::gemv_vnni(kind, w, nb, x, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the caller's contract.
        GemvPath::I8mm | GemvPath::Dotprod => unsafe { aarch64::gemv_dotprod(kind, w, nb, x, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the caller's contract (NEON is in the aarch64 baseline).
        GemvPath::Neon => unsafe { aarch64::gemv_neon(kind, w, nb, x, out) },
        GemvPath::Portable => portable(kind, w, nb, x, out),
        #[allow(unreachable_patterns)]
        _ => unreachable!("gemv: {path:?} does not run on this architecture (the caller asserts runs_here)"),
    }
}

/// The portable path: each block's integer sums in i32, the float work per activation block in
/// sequence.
fn portable(kind: Kind, w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
    let bytes = kind.block_bytes();
    for (o, row) in out.iter_mut().zip(w.chunks_exact(nb * bytes)) {
        let mut acc = 0f32;
        for (i, blk) in row.chunks_exact(bytes).enumerate() {
            // The activation blocks this weight block meets.
            let a0 = i * kind.block_len() / QK;
            let qx = |a: usize| -> &[i8; QK] { x.q[(a0 + a) * QK..][..QK].try_into().expect("a block") };
            let dx = |a: usize| x.scales[a0 + a];
            let sx = |a: usize| x.sums[a0 + a] as f32;
            let dot = |q: &[i8; QK], a: usize| -> i32 { q.iter().zip(qx(a)).map(|(&q, &v)| q as i32 * v as i32).sum() };
            match kind {
                Kind::Q4_0 | Kind::Q5_0 => {
                    let (qs, qh, off) = match kind {
                        Kind::Q4_0 => (&blk[2..18], 0, 8),
                        _ => (&blk[6..22], u32::from_le_bytes(blk[2..6].try_into().expect("4 bytes")), 16),
                    };
                    let q: [i8; QK] = std::array::from_fn(|i| {
                        let nibble = if i < 16 { qs[i] & 15 } else { qs[i - 16] >> 4 };
                        (nibble | ((qh >> i) as u8 & 1) << 4) as i8 - off
                    });
                    acc += f16_at(blk, 0) * dx(0) * dot(&q, 0) as f32;
                }
                Kind::Q4K | Kind::Q5K => {
                    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                    let (sc, m) = k_scales(blk[4..16].try_into().expect("12 bytes"));
                    let (qh, qs) = match kind {
                        Kind::Q4K => (&[0u8; 32][..], &blk[16..144]),
                        _ => (&blk[16..48], &blk[48..176]),
                    };
                    for j in 0..8 {
                        let (c, shift) = (j / 2, 4 * (j % 2));
                        let q: [i8; QK] = std::array::from_fn(|l| (((qs[32 * c + l] >> shift) & 15) | ((qh[l] >> j) & 1) << 4) as i8);
                        acc += d * sc[j] as f32 * dx(j) * dot(&q, j) as f32 - dmin * m[j] as f32 * dx(j) * sx(j);
                    }
                }
                Kind::Q6K => {
                    let d = f16_at(blk, 208);
                    for a in 0..8 {
                        let (h, g) = (a / 4, a % 4);
                        let (ql, qh) = (&blk[64 * h..], &blk[128 + 32 * h..]);
                        let q: [i8; QK] = std::array::from_fn(|l| {
                            let low = (if g % 2 == 0 { ql[l] } else { ql[l + 32] } >> (4 * (g / 2))) & 15;
                            (low | (qh[l] >> (2 * g) & 3) << 4) as i8 - 32
                        });
                        let scale = |s: usize| blk[192 + 2 * a + s] as i8 as i32;
                        let (lo, hi) =
                            (dot(&std::array::from_fn(|l| if l < 16 { q[l] } else { 0 }), a), dot(&std::array::from_fn(|l| if l < 16 { 0 } else { q[l] }), a));
                        acc += d * dx(a) * (scale(0) * lo + scale(1) * hi) as f32;
                    }
                }
            }
        }
        *o = acc;
    }
}

/// The AVX2 path.
///
/// Weights are unsigned bytes as `vpmaddubsw` takes them (nibbles, 5- and 6-bit values), the
/// activation the signed operand; an offset format's `- o` is one more `vpmaddubsw` of `o` with
/// the activation, subtracted in i16 (no sign trick: any i8 activation is taken, -128 too). Why
/// nothing saturates, per i16 pair of products (|q_x| <= 128): Q4_0 `2 * 15 * 128 = 3840` and
/// `2 * 8 * 128`, their difference at most `2 * 8 * 128`; Q5_0 `2 * 31 * 128 = 7936`, difference at
/// most `2 * 16 * 128`; Q4_K 3840; Q5_K 7936; Q6_K `2 * 63 * 128 = 16128`, difference at most
/// `2 * 32 * 128 = 8192`, then times its scale (|sc| <= 128) pairwise in `vpmaddwd`: at most
/// 2^21 per i32 lane. Every lane is below 2^24, exact in f32.
///
/// Per super-block the K-quants' sub-block factors (`d sc d_x`, `d d_x`) are formed 8 at once
/// and go through a stack array to `vbroadcastss` (load ports; shuffles would take the vector
/// ALUs the products keep busy), as the Q4_1 kernel does. One row after another, prefetched
/// `PREFETCH` bytes ahead (see the module above).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::super::hsum8 as hsum;
    use super::super::x86::{f16_to_f32, PREFETCH};
    use super::{k_scales, Kind, Q8Activation, QK};

    /// # Safety
    /// The CPU has AVX2, FMA and F16C; as [`super::gemv`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv(kind: Kind, w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
        let bytes = kind.block_bytes();
        for (o, row) in out.iter_mut().zip(w.chunks_exact(nb * bytes)) {
            // SAFETY: `row` is `nb` blocks, the activation has their blocks and sums; the CPU
            // has the features. One call per format so that each loop is compiled on its own.
            *o = unsafe {
                match kind {
                    Kind::Q4_0 => row_q4_0_q5_0::<false, false>(row.as_ptr(), nb, x, &[]),
                    Kind::Q5_0 => row_q4_0_q5_0::<true, false>(row.as_ptr(), nb, x, &[]),
                    Kind::Q4K => row_k::<false, false>(row.as_ptr(), nb, x),
                    Kind::Q5K => row_k::<true, false>(row.as_ptr(), nb, x),
                    Kind::Q6K => row_q6_k(row.as_ptr(), nb, x),
                }
            };
        }
    }

    /// [`GemvPath::Avx512`](super::GemvPath::Avx512): Q4_0, Q5_0, Q4_K and Q5_K with `vpdpbusd` (32 byte
    /// products summed into 8 i32 lanes, in one instruction: no i16 step, nothing saturates)
    /// starting from the block's offset term `-o * sum q_x` (computed once per call for every
    /// activation block: 8 lanes each, the same lanes `vpdpbusd` fills), and Q5_0's fifth bits as
    /// a byte mask (`kmovd`, then a masked add of 16); the K-quants' sub-block products from zero.
    /// Q6_K: [`gemv`] (its sub-blocks of 16 take their scales in `vpmaddwd`, which `vpdpbusd`
    /// would not save).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA, F16C and AVX-512 F, BW, VL and VNNI; as [`super::gemv`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn gemv_vnni(kind: Kind, w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
        if let Kind::Q4K | Kind::Q5K = kind {
            for (o, row) in out.iter_mut().zip(w.chunks_exact(nb * kind.block_bytes())) {
                // SAFETY: `row` is `nb` super-blocks, the activation has their blocks and sums;
                // the CPU has the features.
                *o = unsafe {
                    match kind {
                        Kind::Q4K => row_k::<false, true>(row.as_ptr(), nb, x),
                        _ => row_k::<true, true>(row.as_ptr(), nb, x),
                    }
                };
            }
            return;
        }
        if kind == Kind::Q6K {
            // SAFETY: the caller's contract; the CPU has AVX2, FMA and F16C.
            return unsafe { gemv(kind, w, nb, x, out) };
        }
        let o = if kind == Kind::Q5_0 { 16 } else { 8 };
        // SAFETY: the activation has `nb` blocks.
        let offsets: Vec<__m256i> = (0..nb)
            .map(|b| unsafe {
                _mm256_sub_epi32(
                    _mm256_setzero_si256(),
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(o), _mm256_loadu_si256(x.q.as_ptr().add(QK * b).cast())),
                )
            })
            .collect();
        let bytes = kind.block_bytes();
        for (o, row) in out.iter_mut().zip(w.chunks_exact(nb * bytes)) {
            // SAFETY: `row` is `nb` blocks, the activation and `offsets` have `nb` blocks; the
            // CPU has the features.
            *o = unsafe {
                match kind {
                    Kind::Q5_0 => row_q4_0_q5_0::<true, true>(row.as_ptr(), nb, x, &offsets),
                    _ => row_q4_0_q5_0::<false, true>(row.as_ptr(), nb, x, &offsets),
                }
            };
        }
    }

    /// `sum q q_x` of 32 unsigned weights `q` with the activation `xv`, in 8 i32 lanes.
    #[inline(always)]
    unsafe fn dot(q: __m256i, xv: __m256i) -> __m256i {
        // SAFETY: registers only; the caller has AVX2.
        unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), _mm256_set1_epi16(1)) }
    }

    /// `sum (q - o) q_x`, `o_v` holding `o` in every byte.
    #[inline(always)]
    unsafe fn dot_off(q: __m256i, xv: __m256i, o_v: __m256i) -> __m256i {
        // SAFETY: registers only; the caller has AVX2.
        unsafe { _mm256_madd_epi16(_mm256_sub_epi16(_mm256_maddubs_epi16(q, xv), _mm256_maddubs_epi16(o_v, xv)), _mm256_set1_epi16(1)) }
    }

    /// `qs` (16 bytes at `p`) as 32 nibbles: the low ones then the high ones.
    #[inline(always)]
    unsafe fn nibbles16(p: *const u8) -> __m256i {
        // SAFETY: 16 bytes at `p` (the caller's); the caller has AVX2. The 32-bit shift brings
        // the next byte's low bits into each byte's top; the mask drops them.
        unsafe {
            let qs = _mm256_broadcastsi128_si256(_mm_loadu_si128(p.cast()));
            _mm256_and_si256(_mm256_srlv_epi32(qs, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F))
        }
    }

    /// The 32 bits of `qh` as bytes 0x10 (bit set) or 0: byte i takes bit i.
    #[inline(always)]
    unsafe fn bits_to_0x10(qh: u32) -> __m256i {
        // SAFETY: registers only; the caller has AVX2. Byte i gets byte i / 8 of `qh`, is
        // or-ed with every bit but bit i % 8, and is all ones exactly when that bit is set.
        unsafe {
            let spread =
                _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303));
            let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64);
            let set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
            _mm256_and_si256(set, _mm256_set1_epi8(0x10))
        }
    }

    /// A Q4_0 or Q5_0 block's products with the activation block at `xq`, as f32: with `VNNI`,
    /// by `vpdpbusd` from `offset` (the block's `-o * sum q_x` in `vpdpbusd`'s lanes) and the
    /// fifth bits as a byte mask; else by `vpmaddubsw` with the offset `off` taken off in i16.
    ///
    /// # Safety
    /// A block at `blk`, whose `qs` are at `at`; 32 activations at `xq`; inlined only into
    /// functions with AVX2 (and, with `VNNI`, AVX-512 BW, VL and VNNI).
    #[inline(always)]
    unsafe fn block_q4_0_q5_0<const FIVE: bool, const VNNI: bool>(blk: *const u8, at: usize, xq: *const i8, off: __m256i, offset: __m256i) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            let mut q = nibbles16(blk.add(at));
            let qh = if FIVE { u32::from_le(blk.add(2).cast::<u32>().read_unaligned()) } else { 0 };
            let xv = _mm256_loadu_si256(xq.cast());
            let p = if VNNI {
                if FIVE {
                    q = _mm256_mask_add_epi8(q, qh, q, _mm256_set1_epi8(16));
                }
                _mm256_dpbusd_epi32(offset, q, xv)
            } else {
                if FIVE {
                    q = _mm256_or_si256(q, bits_to_0x10(qh));
                }
                dot_off(q, xv, off)
            };
            _mm256_cvtepi32_ps(p)
        }
    }

    /// Q4_0 (`FIVE` false) or Q5_0, on the AVX2 path or (`VNNI`) the AVX-512 one with each
    /// block's offset term in `offsets` (see [`gemv_vnni`]). The blocks' scales `d_w d_x` four at a time: four 16-bit
    /// loads joined in a general register, one conversion and one multiply, then through a stack
    /// array to `vbroadcastss` (as the Q4_1 kernel does). A scale per block with scalar
    /// instructions (a conversion, a multiply, a broadcast: the vector ALUs the products need)
    /// read 14-15 GB/s on one core of the build machine; four at a time 2026-11-26: see
    /// `bench_gemv` in docs/decode.md.
    ///
    /// # Safety
    /// As [`gemv`] (or [`gemv_vnni`], with `VNNI`): `nb` Q4_0 or Q5_0 blocks at `w`, and with
    /// `VNNI` `nb` offsets; inlined only into it.
    #[inline(always)]
    unsafe fn row_q4_0_q5_0<const FIVE: bool, const VNNI: bool>(w: *const u8, nb: usize, x: &Q8Activation, offsets: &[__m256i]) -> f32 {
        let (bytes, at) = if FIVE { (22, 6) } else { (18, 2) };
        // SAFETY: reads of blocks below `nb`, of the activation's first `nb` blocks and (with `VNNI`) of `offsets[..nb]`;
        // `factors` is read back through `black_box` (broadcast loads).
        unsafe {
            let off = _mm256_set1_epi8(if FIVE { 16 } else { 8 });
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut factors = [0f32; 4];
            let f_out = factors.as_mut_ptr();
            let f_in = std::hint::black_box(f_out);
            // The VNNI path's block offset term (the AVX2 path takes the offset in its product).
            let offset = |b: usize| if VNNI { *offsets.get_unchecked(b) } else { _mm256_setzero_si256() };
            // No larger closures here: one computing a block's product was compiled out of line,
            // without AVX2.
            let full = nb - nb % 4;
            for b in (0..full).step_by(4) {
                let blk = w.add(bytes * b);
                _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH).cast());
                _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH + 64).cast());
                let mut ds = 0u64;
                for i in 0..4 {
                    ds |= (u16::from_le(blk.add(bytes * i).cast::<u16>().read_unaligned()) as u64) << (16 * i);
                }
                let ds = _mm_cvtph_ps(_mm_cvtsi64_si128(ds as i64));
                _mm_storeu_ps(f_out, _mm_mul_ps(ds, _mm_loadu_ps(x.scales.as_ptr().add(b))));
                for i in 0..4 {
                    let p = block_q4_0_q5_0::<FIVE, VNNI>(blk.add(bytes * i), at, x.q.as_ptr().add(QK * (b + i)), off, offset(b + i));
                    acc[i] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&*f_in.add(i)), acc[i]);
                }
            }
            for b in full..nb {
                let blk = w.add(bytes * b);
                let s = f16_to_f32(u16::from_le(blk.cast::<u16>().read_unaligned())) * *x.scales.get_unchecked(b);
                let p = block_q4_0_q5_0::<FIVE, VNNI>(blk, at, x.q.as_ptr().add(QK * b), off, offset(b));
                acc[b % 4] = _mm256_fmadd_ps(p, _mm256_set1_ps(s), acc[b % 4]);
            }
            hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])))
        }
    }

    /// Q4_K (`FIVE` false) or Q5_K.
    ///
    /// # Safety
    /// As [`gemv`]: `nb` super-blocks at `w`; inlined only into it.
    #[inline(always)]
    unsafe fn row_k<const FIVE: bool, const VNNI: bool>(w: *const u8, nb: usize, x: &Q8Activation) -> f32 {
        let bytes = if FIVE { 176 } else { 144 };
        // SAFETY: reads of super-blocks below `nb` and of the activation's first `8 nb` blocks;
        // `factors` is read back through `black_box` (see the Q4_1 kernel: broadcast loads).
        unsafe {
            let low = _mm256_set1_epi8(0x0F);
            let fifth = _mm256_set1_epi8(0x10);
            let zero = _mm256_setzero_si256();
            let mut acc = [_mm256_setzero_ps(); 2];
            let mut mins = _mm256_setzero_ps();
            let mut factors = [0f32; 8];
            let f_out = factors.as_mut_ptr();
            let f_in = std::hint::black_box(f_out);
            for s in 0..nb {
                let blk = w.add(bytes * s);
                for line in (0..bytes).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH + line).cast());
                }
                let (d, dmin) =
                    (f16_to_f32(u16::from_le(blk.cast::<u16>().read_unaligned())), f16_to_f32(u16::from_le(blk.add(2).cast::<u16>().read_unaligned())));
                let (sc, m) = k_scales(&*blk.add(4).cast::<[u8; 12]>());
                let a = 8 * s;
                let dx = _mm256_loadu_ps(x.scales.as_ptr().add(a));
                let to_f32 = |v: [u8; 8]| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(i64::from_le_bytes(v))));
                // d sc d_x per sub-block, and the minimum terms dmin m d_x sum q_x.
                _mm256_storeu_ps(f_out, _mm256_mul_ps(_mm256_mul_ps(to_f32(sc), _mm256_set1_ps(d)), dx));
                let sums = _mm256_cvtepi32_ps(_mm256_loadu_si256(x.sums.as_ptr().add(a).cast()));
                mins = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(to_f32(m), _mm256_set1_ps(dmin)), dx), sums, mins);
                let (qs, mut qh) = if FIVE { (blk.add(48), _mm256_loadu_si256(blk.add(16).cast())) } else { (blk.add(16), zero) };
                for c in 0..4 {
                    let q = _mm256_loadu_si256(qs.add(32 * c).cast());
                    let (mut lo, mut hi) = (_mm256_and_si256(q, low), _mm256_and_si256(_mm256_srli_epi16::<4>(q), low));
                    if FIVE {
                        // Bits 2c and 2c + 1 of each byte (the shifts below brought them to 0
                        // and 1) to bit 4; the 16-bit shifts' spill across bytes is masked off.
                        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16::<4>(qh), fifth));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16::<3>(qh), fifth));
                        qh = _mm256_srli_epi16::<2>(qh);
                    }
                    let xq = x.q.as_ptr().add(QK * (a + 2 * c));
                    let (x_lo, x_hi) = (_mm256_loadu_si256(xq.cast()), _mm256_loadu_si256(xq.add(QK).cast()));
                    let (p_lo, p_hi) = match VNNI {
                        true => (_mm256_dpbusd_epi32(zero, lo, x_lo), _mm256_dpbusd_epi32(zero, hi, x_hi)),
                        false => (dot(lo, x_lo), dot(hi, x_hi)),
                    };
                    let (p_lo, p_hi) = (_mm256_cvtepi32_ps(p_lo), _mm256_cvtepi32_ps(p_hi));
                    acc[0] = _mm256_fmadd_ps(p_lo, _mm256_broadcast_ss(&*f_in.add(2 * c)), acc[0]);
                    acc[1] = _mm256_fmadd_ps(p_hi, _mm256_broadcast_ss(&*f_in.add(2 * c + 1)), acc[1]);
                }
            }
            hsum(_mm256_add_ps(acc[0], acc[1])) - hsum(mins)
        }
    }

    /// # Safety
    /// As [`gemv`]: `nb` Q6_K super-blocks at `w`; inlined only into it.
    #[inline(always)]
    unsafe fn row_q6_k(w: *const u8, nb: usize, x: &Q8Activation) -> f32 {
        // SAFETY: reads of super-blocks below `nb` and of the activation's first `8 nb` blocks;
        // `factors` as in `row_k`.
        unsafe {
            let low = _mm256_set1_epi8(0x0F);
            let top = _mm256_set1_epi8(0x30);
            let off = _mm256_set1_epi8(32);
            let mut acc = [_mm256_setzero_ps(); 2];
            let mut factors = [0f32; 8];
            let f_out = factors.as_mut_ptr();
            let f_in = std::hint::black_box(f_out);
            for s in 0..nb {
                let blk = w.add(210 * s);
                for line in (0..210).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH + line).cast());
                }
                let a = 8 * s;
                let d = f16_to_f32(u16::from_le(blk.add(208).cast::<u16>().read_unaligned()));
                _mm256_storeu_ps(f_out, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(x.scales.as_ptr().add(a))));
                // The 16 scales as i16; `pick(g)` puts scale 2g in lanes 0..8, 2g + 1 in 8..16.
                let scales = _mm_loadu_si128(blk.add(192).cast());
                let pick = |g: i8| {
                    _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
                        scales,
                        _mm_set_epi64x(0x0101_0101_0101_0101 * (2 * g as i64 + 1), 0x0101_0101_0101_0101 * 2 * g as i64),
                    ))
                };
                for h in 0..2 {
                    let (ql, qh) = (blk.add(64 * h), _mm256_loadu_si256(blk.add(128 + 32 * h).cast()));
                    let (ql0, ql1) = (_mm256_loadu_si256(ql.cast()), _mm256_loadu_si256(ql.add(32).cast()));
                    let groups = [
                        _mm256_or_si256(_mm256_and_si256(ql0, low), _mm256_and_si256(_mm256_slli_epi16::<4>(qh), top)),
                        _mm256_or_si256(_mm256_and_si256(ql1, low), _mm256_and_si256(_mm256_slli_epi16::<2>(qh), top)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low), _mm256_and_si256(qh, top)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low), _mm256_and_si256(_mm256_srli_epi16::<2>(qh), top)),
                    ];
                    for (g, q) in groups.into_iter().enumerate() {
                        let b = 4 * h + g;
                        let xv = _mm256_loadu_si256(x.q.as_ptr().add(QK * (a + b)).cast());
                        let pairs = _mm256_sub_epi16(_mm256_maddubs_epi16(q, xv), _mm256_maddubs_epi16(off, xv));
                        let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, pick(b as i8)));
                        acc[g % 2] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&*f_in.add(b)), acc[g % 2]);
                    }
                }
            }
            hsum(_mm256_add_ps(acc[0], acc[1]))
        }
    }
}

/// The aarch64 paths: one algorithm per format, two 16-byte dot products (`sdot`, or NEON's
/// widening multiplies into the same i32 lanes: the same bits, as for Q8_0 and Q4_1).
///
/// Weights are signed bytes here (`sdot` and `smull` multiply signed by signed): an offset
/// format's `q - o` is one `sub` of the bytes (Q4_0: -8..7, Q5_0: -16..15, Q6_K: -32..31), a
/// K-quant's unsigned values (0..31) are the same as signed. Lane sums are exact: at most
/// `4 * 32 * 128` per `dot16`, times a Q6_K scale (<= 128) and two of them added: below 2^21.
#[cfg(target_arch = "aarch64")]
mod aarch64 {
    use std::arch::aarch64::*;

    use super::super::super::arm::{hsum4, sdot};
    use super::{k_scales, Kind, Q8Activation, QK};

    /// `acc` plus the 16 products of `a` and `b`, lane i the bytes 4i..4i + 4.
    trait Dot16 {
        /// # Safety
        /// The CPU has what the implementation needs; inlined only into functions compiled
        /// with it.
        unsafe fn dot16(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t;
    }

    struct Sdot;
    impl Dot16 for Sdot {
        #[inline(always)]
        unsafe fn dot16(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
            // SAFETY: the CPU has dotprod (the trait's contract).
            unsafe { sdot(acc, a, b) }
        }
    }

    struct Widen;
    impl Dot16 for Widen {
        #[inline(always)]
        unsafe fn dot16(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
            // SAFETY: NEON is in the aarch64 baseline; registers only. The products fit i16
            // (at most 128 * 128 = 16384... for -128 * -128: 16384 < 32767).
            unsafe {
                let lo = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));
                let hi = vpaddlq_s16(vmull_high_s8(a, b));
                vaddq_s32(acc, vpaddq_s32(lo, hi))
            }
        }
    }

    /// # Safety
    /// The CPU has dotprod; as [`super::gemv`].
    #[target_feature(enable = "dotprod")]
    pub(super) unsafe fn gemv_dotprod(kind: Kind, w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
        // SAFETY: the caller's contract; the CPU has dotprod.
        unsafe { rows::<Sdot>(kind, w, nb, x, out) }
    }

    /// # Safety
    /// As [`super::gemv`].
    #[inline(never)]
    pub(super) unsafe fn gemv_neon(kind: Kind, w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
        // SAFETY: the caller's contract.
        unsafe { rows::<Widen>(kind, w, nb, x, out) }
    }

    #[inline(always)]
    unsafe fn rows<D: Dot16>(kind: Kind, w: &[u8], nb: usize, x: &Q8Activation, out: &mut [f32]) {
        let bytes = kind.block_bytes();
        for (o, row) in out.iter_mut().zip(w.chunks_exact(nb * bytes)) {
            // SAFETY: `row` is `nb` blocks, the activation has their blocks and sums.
            *o = unsafe {
                match kind {
                    Kind::Q4_0 => row_q4_0_q5_0::<D, false>(row.as_ptr(), nb, x),
                    Kind::Q5_0 => row_q4_0_q5_0::<D, true>(row.as_ptr(), nb, x),
                    Kind::Q4K => row_k::<D, false>(row.as_ptr(), nb, x),
                    Kind::Q5K => row_k::<D, true>(row.as_ptr(), nb, x),
                    Kind::Q6K => row_q6_k::<D>(row.as_ptr(), nb, x),
                }
            };
        }
    }

    #[inline(always)]
    fn f16_to_f32(bits: u16) -> f32 {
        // SAFETY: NEON (and its f16 conversions) is in the aarch64 baseline.
        unsafe { vgetq_lane_f32::<0>(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(bits)))) }
    }

    /// The 16 bits of `bits` as bytes 0x10 (bit i set, byte i) or 0.
    #[inline(always)]
    fn bits_to_0x10(bits: u16) -> uint8x16_t {
        // SAFETY: NEON is in the aarch64 baseline; registers only. Bytes 0..8 take the low byte
        // of `bits`, 8..16 the high one; `vtst` against each byte's own bit.
        unsafe {
            let spread = vcombine_u8(vdup_n_u8(bits as u8), vdup_n_u8((bits >> 8) as u8));
            let own = vreinterpretq_u8_u64(vdupq_n_u64(0x8040_2010_0804_0201));
            vandq_u8(vtstq_u8(spread, own), vdupq_n_u8(0x10))
        }
    }

    /// # Safety
    /// `nb` Q4_0 (`FIVE` false) or Q5_0 blocks at `w`, the activation's first `nb` blocks; `D`'s
    /// contract.
    #[inline(always)]
    unsafe fn row_q4_0_q5_0<D: Dot16, const FIVE: bool>(w: *const u8, nb: usize, x: &Q8Activation) -> f32 {
        let (bytes, at, off) = if FIVE { (22, 6, 16) } else { (18, 2, 8) };
        // SAFETY: reads of blocks below `nb` and of the activation's first `nb` blocks.
        unsafe {
            let (low, off) = (vdupq_n_u8(0x0F), vdupq_n_s8(off));
            let mut acc = [vdupq_n_f32(0.0); 2];
            for b in 0..nb {
                let blk = w.add(bytes * b);
                let qs = vld1q_u8(blk.add(at));
                let (mut lo, mut hi) = (vandq_u8(qs, low), vshrq_n_u8::<4>(qs));
                if FIVE {
                    let qh = u32::from_le(blk.add(2).cast::<u32>().read_unaligned());
                    lo = vorrq_u8(lo, bits_to_0x10(qh as u16));
                    hi = vorrq_u8(hi, bits_to_0x10((qh >> 16) as u16));
                }
                let xb = x.q.as_ptr().add(QK * b);
                let dot = D::dot16(vdupq_n_s32(0), vsubq_s8(vreinterpretq_s8_u8(lo), off), vld1q_s8(xb));
                let dot = D::dot16(dot, vsubq_s8(vreinterpretq_s8_u8(hi), off), vld1q_s8(xb.add(16)));
                let s = f16_to_f32(u16::from_le(blk.cast::<u16>().read_unaligned())) * *x.scales.get_unchecked(b);
                acc[b % 2] = vfmaq_n_f32(acc[b % 2], vcvtq_f32_s32(dot), s);
            }
            hsum4(vaddq_f32(acc[0], acc[1]))
        }
    }

    /// Q4_K (`FIVE` false) or Q5_K.
    ///
    /// # Safety
    /// `nb` super-blocks at `w`, the activation's first `8 nb` blocks and sums; `D`'s contract.
    #[inline(always)]
    unsafe fn row_k<D: Dot16, const FIVE: bool>(w: *const u8, nb: usize, x: &Q8Activation) -> f32 {
        let bytes = if FIVE { 176 } else { 144 };
        // SAFETY: reads of super-blocks below `nb` and of the activation's first `8 nb` blocks.
        unsafe {
            let low = vdupq_n_u8(0x0F);
            let fifth = vdupq_n_u8(0x10);
            let mut acc = [vdupq_n_f32(0.0); 2];
            let mut mins = vdupq_n_f32(0.0);
            for s in 0..nb {
                let blk = w.add(bytes * s);
                let (d, dmin) =
                    (f16_to_f32(u16::from_le(blk.cast::<u16>().read_unaligned())), f16_to_f32(u16::from_le(blk.add(2).cast::<u16>().read_unaligned())));
                let (sc, m) = k_scales(&*blk.add(4).cast::<[u8; 12]>());
                let a = 8 * s;
                // Bytes to f32, [0..4] and [4..8].
                let to_f32 = |v: [u8; 8]| {
                    let w16 = vmovl_u8(vcreate_u8(u64::from_le_bytes(v)));
                    [vcvtq_f32_u32(vmovl_u16(vget_low_u16(w16))), vcvtq_f32_u32(vmovl_high_u16(w16))]
                };
                let dx = [vld1q_f32(x.scales.as_ptr().add(a)), vld1q_f32(x.scales.as_ptr().add(a + 4))];
                let sums = [vcvtq_f32_s32(vld1q_s32(x.sums.as_ptr().add(a))), vcvtq_f32_s32(vld1q_s32(x.sums.as_ptr().add(a + 4)))];
                let (scf, mf) = (to_f32(sc), to_f32(m));
                let f = [vmulq_f32(vmulq_n_f32(scf[0], d), dx[0]), vmulq_f32(vmulq_n_f32(scf[1], d), dx[1])];
                mins = vfmaq_f32(mins, vmulq_f32(vmulq_n_f32(mf[0], dmin), dx[0]), sums[0]);
                mins = vfmaq_f32(mins, vmulq_f32(vmulq_n_f32(mf[1], dmin), dx[1]), sums[1]);
                let (qs, qh) = if FIVE { (blk.add(48), [vld1q_u8(blk.add(16)), vld1q_u8(blk.add(32))]) } else { (blk.add(16), [vdupq_n_u8(0); 2]) };
                // Sub-block j's 32 products in 4 lanes, as f32.
                let sub = |c: usize, high: bool| {
                    let j = 2 * c + high as usize;
                    let xb = x.q.as_ptr().add(QK * (a + j));
                    let mut dot = vdupq_n_s32(0);
                    for half in 0..2 {
                        let q = vld1q_u8(qs.add(32 * c + 16 * half));
                        let mut v = if high { vshrq_n_u8::<4>(q) } else { vandq_u8(q, low) };
                        if FIVE {
                            // Bit j of each qh byte to bit 4.
                            let bit = vandq_u8(qh[half], vdupq_n_u8(1 << j));
                            v = vorrq_u8(v, vandq_u8(vtstq_u8(bit, bit), fifth));
                        }
                        dot = D::dot16(dot, vreinterpretq_s8_u8(v), vld1q_s8(xb.add(16 * half)));
                    }
                    vcvtq_f32_s32(dot)
                };
                acc[0] = vfmaq_laneq_f32::<0>(acc[0], sub(0, false), f[0]);
                acc[1] = vfmaq_laneq_f32::<1>(acc[1], sub(0, true), f[0]);
                acc[0] = vfmaq_laneq_f32::<2>(acc[0], sub(1, false), f[0]);
                acc[1] = vfmaq_laneq_f32::<3>(acc[1], sub(1, true), f[0]);
                acc[0] = vfmaq_laneq_f32::<0>(acc[0], sub(2, false), f[1]);
                acc[1] = vfmaq_laneq_f32::<1>(acc[1], sub(2, true), f[1]);
                acc[0] = vfmaq_laneq_f32::<2>(acc[0], sub(3, false), f[1]);
                acc[1] = vfmaq_laneq_f32::<3>(acc[1], sub(3, true), f[1]);
            }
            hsum4(vaddq_f32(acc[0], acc[1])) - hsum4(mins)
        }
    }

    /// # Safety
    /// `nb` Q6_K super-blocks at `w`, the activation's first `8 nb` blocks; `D`'s contract.
    #[inline(always)]
    unsafe fn row_q6_k<D: Dot16>(w: *const u8, nb: usize, x: &Q8Activation) -> f32 {
        // SAFETY: reads of super-blocks below `nb` and of the activation's first `8 nb` blocks.
        unsafe {
            let (low, top, off) = (vdupq_n_u8(0x0F), vdupq_n_u8(0x30), vdupq_n_s8(32));
            let mut acc = [vdupq_n_f32(0.0); 2];
            for s in 0..nb {
                let blk = w.add(210 * s);
                let a = 8 * s;
                let d = f16_to_f32(u16::from_le(blk.add(208).cast::<u16>().read_unaligned()));
                let scale = |i: usize| *blk.add(192 + i).cast::<i8>() as i32;
                for h in 0..2 {
                    let (ql, qh) = (blk.add(64 * h), blk.add(128 + 32 * h));
                    for g in 0..4 {
                        let b = 4 * h + g;
                        let xb = x.q.as_ptr().add(QK * (a + b));
                        // Sub-blocks 2b and 2b + 1: 16 weights each.
                        let part = |i: usize| {
                            let l = vld1q_u8(ql.add(32 * (g % 2) + 16 * i));
                            let l = if g < 2 { vandq_u8(l, low) } else { vshrq_n_u8::<4>(l) };
                            let hb = vld1q_u8(qh.add(16 * i));
                            // Bits 2g, 2g + 1 of qh to bits 4, 5.
                            let hb = match g {
                                0 => vshlq_n_u8::<4>(hb),
                                1 => vshlq_n_u8::<2>(hb),
                                2 => hb,
                                _ => vshrq_n_u8::<2>(hb),
                            };
                            let q = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(l, vandq_u8(hb, top))), off);
                            D::dot16(vdupq_n_s32(0), q, vld1q_s8(xb.add(16 * i)))
                        };
                        let dot = vmlaq_n_s32(vmulq_n_s32(part(0), scale(2 * b)), part(1), scale(2 * b + 1));
                        acc[g % 2] = vfmaq_n_f32(acc[g % 2], vcvtq_f32_s32(dot), d * *x.scales.get_unchecked(a + b));
                    }
                }
            }
            hsum4(vaddq_f32(acc[0], acc[1]))
        }
    }
}
