//! What the aarch64 kernels share: the CPU's optional features, detected once, and the integer
//! instructions that stable Rust has no intrinsic for.
//!
//! NEON (Advanced SIMD) is in the aarch64 baseline, so every aarch64 build has it and its
//! intrinsics need no run-time check. `sdot` (FEAT_DotProd: Cortex-A55/A76 and later, every
//! Snapdragon since the 855) and `smmla` (FEAT_I8MM: Cortex-A510/A710/X2 and later, Snapdragon 8
//! Gen 1 and later) are optional: a kernel that uses them is compiled with
//! `#[target_feature(enable = ...)]` and chosen at run time, as the x86 kernels are for AVX2.
//!
//! Their intrinsics (`vdotq_s32`, `vmmlaq_s32`) are still unstable in Rust 1.96
//! (`stdarch_neon_dotprod`, `stdarch_neon_i8mm`), so [`sdot`], [`sdot_lane`] and [`smmla`] are one
//! instruction of inline assembly each. They are `#[inline(always)]` and meant to be called only from functions
//! compiled with the feature: the assembler then accepts the instruction, and the register
//! allocator places the operands as for an intrinsic.
//!
//! candle-core 0.11's own quantized CPU kernels run `sdot` on every aarch64 CPU without asking
//! (its `neon` module): on a CPU without dotprod (Cortex-A53/A72: a Raspberry Pi 3 or 4) they
//! stop the process with SIGILL. [`super::cpu::cpu`] lets the callers route around them.

#![cfg(target_arch = "aarch64")]

use std::arch::aarch64::{float32x4_t, int32x4_t, int8x16_t};
use std::arch::asm;

/// `acc[i] += sum_{j<4} a[4i + j] * b[4i + j]`, signed bytes (`sdot v.4s, v.16b, v.16b`): exact,
/// nothing saturates (4 * 128 * 128 per lane and step).
///
/// # Safety
/// The CPU has dotprod, and the caller is compiled with `target_feature(enable = "dotprod")`.
#[inline(always)]
pub unsafe fn sdot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: a register-only instruction (the caller's contract says the CPU has it).
    unsafe {
        asm!("sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b", acc = inout(vreg) acc, a = in(vreg) a, b = in(vreg) b, options(pure, nomem, nostack, preserves_flags))
    };
    acc
}

/// `acc[i] += sum_{j<4} b[4i + j] * a[4L + j]`: each 4-byte group of `b` (a column's 4 K) times
/// the 4 bytes of 32-bit lane `L` of `a` (a row's 4 K), signed (`sdot v.4s, v.16b, v.4b[L]`, the
/// by-element form: one row of activations against 4 columns with no broadcast instruction). Exact,
/// as [`sdot`].
///
/// # Safety
/// The CPU has dotprod, and the caller is compiled with `target_feature(enable = "dotprod")`.
#[inline(always)]
pub unsafe fn sdot_lane<const L: i32>(mut acc: int32x4_t, b: int8x16_t, a: int8x16_t) -> int32x4_t {
    const { assert!(L >= 0 && L < 4, "a 128-bit register has 4 lanes of 32 bits") };
    // SAFETY: a register-only instruction (the caller's contract says the CPU has it).
    unsafe {
        asm!("sdot {acc:v}.4s, {b:v}.16b, {a:v}.4b[{l}]", acc = inout(vreg) acc, b = in(vreg) b, a = in(vreg) a, l = const L, options(pure, nomem, nostack, preserves_flags))
    };
    acc
}

/// `acc += a * b^T` for `a` and `b` each two rows of 8 signed bytes (`a = [a0; a1]` in 16 bytes)
/// and `acc` the 2 x 2 i32 product `[a0.b0, a0.b1, a1.b0, a1.b1]` (`smmla v.4s, v.16b, v.16b`):
/// exact, nothing saturates.
///
/// # Safety
/// The CPU has i8mm, and the caller is compiled with `target_feature(enable = "i8mm")`.
#[inline(always)]
pub unsafe fn smmla(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: a register-only instruction (the caller's contract says the CPU has it).
    unsafe {
        asm!("smmla {acc:v}.4s, {a:v}.16b, {b:v}.16b", acc = inout(vreg) acc, a = in(vreg) a, b = in(vreg) b, options(pure, nomem, nostack, preserves_flags))
    };
    acc
}

/// The sum of a vector's 4 lanes, pairwise: `(v0 + v1) + (v2 + v3)` (`faddp` twice), the same
/// order on every call.
#[inline(always)]
pub fn hsum4(v: float32x4_t) -> f32 {
    use std::arch::aarch64::vaddvq_f32;
    // SAFETY: NEON is in the aarch64 baseline.
    unsafe { vaddvq_f32(v) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::arch::aarch64::*;

    #[test]
    fn sdot_sdot_lane_and_smmla_are_the_definitions() {
        let a: [i8; 16] = std::array::from_fn(|i| if i % 3 == 0 { -128 } else { (i as i8) * 9 - 70 });
        let b: [i8; 16] = std::array::from_fn(|i| if i % 2 == 0 { -128 } else { 127 - (i as i8) * 5 });
        let (va, vb) = unsafe { (vld1q_s8(a.as_ptr()), vld1q_s8(b.as_ptr())) };
        let start = [1, -2, 3, i32::MIN / 2];
        if super::super::cpu::cpu().dotprod {
            #[target_feature(enable = "dotprod")]
            unsafe fn run(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
                unsafe { sdot(acc, a, b) }
            }
            let mut got = [0i32; 4];
            unsafe { vst1q_s32(got.as_mut_ptr(), run(vld1q_s32(start.as_ptr()), va, vb)) };
            let want: [i32; 4] = std::array::from_fn(|i| start[i] + (0..4).map(|j| a[4 * i + j] as i32 * b[4 * i + j] as i32).sum::<i32>());
            assert_eq!(got, want);
            #[target_feature(enable = "dotprod")]
            unsafe fn lanes(acc: int32x4_t, b: int8x16_t, a: int8x16_t) -> [int32x4_t; 4] {
                unsafe { [sdot_lane::<0>(acc, b, a), sdot_lane::<1>(acc, b, a), sdot_lane::<2>(acc, b, a), sdot_lane::<3>(acc, b, a)] }
            }
            let got = unsafe { lanes(vld1q_s32(start.as_ptr()), vb, va) };
            for (l, got) in got.iter().enumerate() {
                let mut out = [0i32; 4];
                unsafe { vst1q_s32(out.as_mut_ptr(), *got) };
                let want: [i32; 4] = std::array::from_fn(|i| start[i] + (0..4).map(|j| b[4 * i + j] as i32 * a[4 * l + j] as i32).sum::<i32>());
                assert_eq!(out, want, "lane {l}");
            }
        }
        if super::super::cpu::cpu().i8mm {
            #[target_feature(enable = "i8mm")]
            unsafe fn run(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
                unsafe { smmla(acc, a, b) }
            }
            let mut got = [0i32; 4];
            unsafe { vst1q_s32(got.as_mut_ptr(), run(vld1q_s32(start.as_ptr()), va, vb)) };
            let dot = |r: usize, c: usize| (0..8).map(|j| a[8 * r + j] as i32 * b[8 * c + j] as i32).sum::<i32>();
            assert_eq!(got, [start[0] + dot(0, 0), start[1] + dot(0, 1), start[2] + dot(1, 0), start[3] + dot(1, 1)]);
        }
    }
}
