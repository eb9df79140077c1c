//! The x86_64 paths of the decode product (AVX2 + FMA; see the parent module for what each does).

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
