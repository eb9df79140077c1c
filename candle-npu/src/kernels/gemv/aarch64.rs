//! The aarch64 paths of the decode product (NEON, dotprod, i8mm; see the parent module).

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
