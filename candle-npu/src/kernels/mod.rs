//! INT8 and F32 GEMM kernels for the host executor.
//!
//! INT8 is exact in one pass on every CPU (the host executor is the NPU's numerical reference):
//! - x86_64 whose 8-bit multiply-add saturates (AVX2 without VNNI, this project's build machine):
//!   our own kernel on 16-bit lanes, [`int8`]; its module docs say why it loses no speed.
//! - aarch64 (the phone's CPU side, an Arm laptop's prefill): our own kernels on 8-bit lanes, i8mm
//!   (`smmla`) > dotprod (`sdot`) > NEON (`smull` + `sadalp`), whichever the CPU has first
//!   ([`Int8Kernel::detect`] says why ours and not rten's, which is exact there too).
//! - Elsewhere, rten-gemm, whose kernels there cannot saturate: AVX-512 VNNI (`vpdpbusd`) and its
//!   generic kernel; [`int8::Int8Path::Portable`] runs anywhere.
//!
//! F32 and the INT8 weights on the rten route use rten-gemm: a safe API that prepacks the weight
//! ("B") matrix once, at prepare time, as on the NPU. Measured on the 2-core build machine for
//! 1024x2048x2048 (issue 2): rten-gemm 443 GOPS, pire-gemm 592 GOPS but column-major output only and
//! an unsafe API, gemmkit 456 GOPS without Arm SDOT. `benches/prefill.rs` has the model's shapes.

#[cfg(target_arch = "aarch64")]
pub mod arm;
pub mod attention;
pub mod claim;
pub mod cpu;
pub mod gemv;
pub mod int8;
pub mod rows;

use std::sync::OnceLock;

use int8::{EachRows, Int8Input, Int8Path, Panels};
use rten_gemm::{GemmExecutor, GemmInT, GemmInputA, GemmInputB, GemmOutT, GemmUninitOptions, PackedBMatrix};
use rten_tensor::NdTensorView;

// rten's executors are not `Sync`; one per thread. Every thread picks the same kernel (the best
// the CPU supports), so weights packed on one thread are valid on all.
thread_local! {
    static INT8: GemmExecutor<u8, i8, i32> = GemmExecutor::default();
    static F32: GemmExecutor<f32, f32, f32> = GemmExecutor::default();
}

fn int8_gemm<R>(f: impl FnOnce(&GemmExecutor<u8, i8, i32>) -> R) -> R {
    INT8.with(f)
}

fn f32_gemm<R>(f: impl FnOnce(&GemmExecutor<f32, f32, f32>) -> R) -> R {
    F32.with(f)
}

/// Which INT8 GEMM a [`PackedI8`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Kernel {
    /// Ours (see [`int8`]).
    Own(Int8Path),
    /// rten-gemm's best kernel for this CPU. Exact only where it cannot saturate.
    Rten,
}

impl Int8Kernel {
    /// The kernel [`PackedI8::new`] uses. x86_64: rten's where it is exact (AVX-512 VNNI), else
    /// ours. aarch64: ours on every CPU, the best path it has ([`Int8Path::detect`]).
    ///
    /// On a CPU with dotprod or i8mm, ours does the same work per instruction as rten's (`sdot`,
    /// `smmla`) and, unlike rten, packs its activations by the task that uses them, hands finished
    /// rows to `each` while they are in cache, and lets [`PackedI8::columns`] read the weight's
    /// columns back for the shadow outliers. On a CPU with neither (Cortex-A53, A57/A72/A73),
    /// rten's kernel (`aarch64-u8i8i32-mlal`: `umlal` by element on u16 lanes, 8 x 8 tiles) and
    /// our NEON one (`smull` + `sadalp`, 4 x 16) both do 4 multiply-accumulates per vector
    /// multiply; but `umlal` issues on one pipe, where `smull` and `sadalp` split over two. Timing
    /// cannot be measured here (qemu); llvm-mca 14's models of both inner loops as compiled into
    /// this crate (128 MACs per iteration each) give, in cycles per iteration: Cortex-A72 rten 32,
    /// ours 18; Cortex-A53 rten 51, ours 56. So ours: 1.7x on the out-of-order cores, 10% behind on
    /// the A53 by the model, and the same packing, threading, `each` and column reads as the
    /// phone's paths, one code path tested under qemu on every kind of Arm core.
    pub fn detect() -> Self {
        static KERNEL: OnceLock<Int8Kernel> = OnceLock::new();
        *KERNEL.get_or_init(|| {
            if cfg!(target_arch = "aarch64") || int8_gemm(|g| g.may_saturate()) {
                Int8Kernel::Own(Int8Path::detect())
            } else {
                Int8Kernel::Rten
            }
        })
    }

    /// The kernel for logs and benchmarks, e.g. "own avx2 (vpmaddwd, i16 lanes)" or rten's kernel
    /// name.
    pub fn name(self) -> String {
        match self {
            Int8Kernel::Own(Int8Path::Avx2) => "own avx2 (vpmaddwd, i16 lanes)".into(),
            Int8Kernel::Own(Int8Path::Portable) => "own portable".into(),
            Int8Kernel::Own(Int8Path::I8mm) => "own i8mm (smmla, i8 lanes, 6x16 tiles)".into(),
            Int8Kernel::Own(Int8Path::Dotprod) => "own dotprod (sdot by element, i8 lanes, 6x16 tiles)".into(),
            Int8Kernel::Own(Int8Path::Neon) => "own neon (smull + sadalp, i8 lanes, 6x16 tiles)".into(),
            Int8Kernel::Rten => format!("rten-gemm {}", int8_gemm(|g| g.kernel_name().to_string())),
        }
    }
}

/// A static INT8 weight `[N, K]`, prepacked for `x[M, K] @ w^T`.
pub struct PackedI8 {
    packed: Packed,
    /// Output features: rows of the weight, columns of the product.
    pub n: usize,
    /// Input features: columns of the weight, the activation's row length.
    pub k: usize,
    /// Per output column `sum_k w[n, k]`, to apply an activation offset after the GEMM.
    pub col_sums: Vec<i32>,
}

enum Packed {
    Own(Panels),
    Rten(PackedBMatrix<i8>),
}

impl PackedI8 {
    /// Packs `w` (`[N, K]`, row-major) for the kernel [`Int8Kernel::detect`] chooses.
    pub fn new(w: &[i8], n: usize, k: usize) -> Self {
        Self::with_kernel(w, n, k, Int8Kernel::detect())
    }

    /// Packed for `kernel` (tests run every kernel this machine can run).
    pub fn with_kernel(w: &[i8], n: usize, k: usize, kernel: Int8Kernel) -> Self {
        assert_eq!(w.len(), n * k, "weight is not [N, K]");
        let packed = match kernel {
            Int8Kernel::Own(path) => Packed::Own(Panels::new(w, n, k, path)),
            // rten-gemm's prepacking divides by zero on an empty matrix (found on an AVX-512 VNNI
            // machine, where rten is the detected kernel); ours takes any shape.
            Int8Kernel::Rten if n == 0 || k == 0 => Packed::Own(Panels::new(w, n, k, Int8Path::detect())),
            Int8Kernel::Rten => {
                let view = NdTensorView::from_data([n, k], w);
                Packed::Rten(int8_gemm(|g| g.prepack_b(view.transposed())))
            }
        };
        let col_sums = w.chunks_exact(k.max(1)).map(|row| row.iter().map(|&v| v as i32).sum()).collect();
        PackedI8 { packed, n, k, col_sums }
    }

    /// An LPBQ weight (`w`, `[N, K]`: each value a 4-bit value times its block's scale in
    /// `scales`, `[N, K / block]`; [`crate::quant::Lpbq::expand`]) held at half the bytes, in our
    /// panels ([`Panels::new_lpbq`]) whatever [`Int8Kernel::detect`] chooses: a tile's
    /// micro-panel is expanded to INT8 once per row block, so the products are exactly the INT8
    /// weight's. Without AVX-512 VNNI that is the path INT8 runs on too; with it, rten's VNNI
    /// kernel is not used for these weights (its packing is its own). A weight that is not such
    /// a weight is packed as INT8.
    pub fn with_lpbq(w: &[i8], n: usize, k: usize, block: usize, scales: &[u8]) -> Self {
        let path = match Int8Kernel::detect() {
            Int8Kernel::Own(path) => path,
            Int8Kernel::Rten => Int8Path::detect(),
        };
        match Panels::new_lpbq(w, n, k, block, scales, path) {
            Some(p) => {
                let col_sums = w.chunks_exact(k.max(1)).map(|row| row.iter().map(|&v| v as i32).sum()).collect();
                PackedI8 { packed: Packed::Own(p), n, k, col_sums }
            }
            None => {
                tracing::warn!(n, k, block, "a weight with block scales is no LPBQ weight of 4-bit values: packed as INT8");
                Self::new(w, n, k)
            }
        }
    }

    /// Bytes the packed weight takes (our panels'; rten's packing is about the INT8 weight's).
    pub fn bytes(&self) -> usize {
        match &self.packed {
            Packed::Own(p) => p.bytes(),
            Packed::Rten(_) => self.n * self.k,
        }
    }

    /// Columns `cs` of the weight (`cs.len()` x `N` values), read from our panels (one K group, a
    /// line or two, per 16 outputs); None for rten's packing, whose layout is its own.
    pub fn columns(&self, cs: &[usize]) -> Option<Vec<i8>> {
        match &self.packed {
            Packed::Own(p) => Some(p.columns(cs)),
            Packed::Rten(_) => None,
        }
    }

    /// `acc[m, n] = sum_k (x[m, k] + x_offset) * w[n, k]`, exactly, in i32.
    pub fn matmul_u8(&self, x: &[u8], m: usize, x_offset: i32) -> Vec<i32> {
        self.matmul_u8_then(x, m, x_offset, &|_| {})
    }

    /// As [`Self::matmul_u8`], for i8 activations.
    pub fn matmul_i8(&self, x: &[i8], m: usize, x_offset: i32) -> Vec<i32> {
        self.matmul_i8_then(x, m, x_offset, &|_| {})
    }

    /// [`Self::matmul_u8`], then `each` on blocks of whole output rows (every row in exactly one
    /// block), on the thread that computed them where the kernel splits rows: a caller's
    /// dequantization runs while the rows are still in cache, without a pass of its own.
    pub fn matmul_u8_then(&self, x: &[u8], m: usize, x_offset: i32, each: &EachRows<'_>) -> Vec<i32> {
        assert_eq!(x.len(), m * self.k, "activation is not [M, K]");
        match &self.packed {
            Packed::Own(p) => self.folded(p, x, m, x_offset, each),
            Packed::Rten(b) => self.then(rten_u8(b, self.n, self.k, x, m), &|rows: &mut [i32]| {
                self.add_offset(rows, x_offset);
                each(rows)
            }),
        }
    }

    /// [`Self::matmul_i8`] with [`Self::matmul_u8_then`]'s `each`.
    pub fn matmul_i8_then(&self, x: &[i8], m: usize, x_offset: i32, each: &EachRows<'_>) -> Vec<i32> {
        assert_eq!(x.len(), m * self.k, "activation is not [M, K]");
        match &self.packed {
            Packed::Own(p) => self.folded(p, x, m, x_offset, each),
            // rten takes u8: (q + off) = (q + 128) + (off - 128).
            Packed::Rten(_) => self.matmul_u8_then(&x.iter().map(|&q| (q as i16 + 128) as u8).collect::<Vec<_>>(), m, x_offset - 128, each),
        }
    }

    /// Our kernel folds what it can into the activations as it packs them ([`Int8Path::fold`]:
    /// the whole offset on i16 lanes when it fits, the shift onto i8 on Arm's 8-bit lanes); the
    /// column sums apply the rest, before `each`.
    fn folded<T: Int8Input>(&self, p: &Panels, x: &[T], m: usize, x_offset: i32, each: &EachRows<'_>) -> Vec<i32> {
        let fold = p.path().fold::<T>(x_offset);
        let rest = x_offset - fold;
        p.matmul(x, m, fold, &|rows: &mut [i32]| {
            self.add_offset(rows, rest);
            each(rows)
        })
    }

    /// `x_offset` times the column sums, added to whole rows of a product.
    fn add_offset(&self, acc: &mut [i32], x_offset: i32) {
        if x_offset != 0 {
            for row in acc.chunks_exact_mut(self.n) {
                for (a, &s) in row.iter_mut().zip(&self.col_sums) {
                    *a += x_offset * s;
                }
            }
        }
    }

    /// `each` over blocks of rows of a finished product, over the pool.
    fn then(&self, mut acc: Vec<i32>, each: &EachRows<'_>) -> Vec<i32> {
        int8::each_over_pool(&mut acc, self.n, each);
        acc
    }

    /// `acc[m, n] = sum_k (x[m, k] + x_offset) * w[n, k]` for u16 activations (W8A16), exactly,
    /// in i64 (the sum can exceed i32: 1536 * 65535 * 127 > 2^31). A u16 is `256 * hi + lo` with
    /// two u8 halves, so this is two of the u8 GEMMs above.
    pub fn matmul_u16(&self, x: &[u16], m: usize, x_offset: i32) -> Vec<i64> {
        assert_eq!(x.len(), m * self.k, "activation is not [M, K]");
        let lo: Vec<u8> = x.iter().map(|&v| v as u8).collect();
        let hi: Vec<u8> = x.iter().map(|&v| (v >> 8) as u8).collect();
        let (acc_lo, acc_hi) = (self.matmul_u8(&lo, m, 0), self.matmul_u8(&hi, m, 0));
        let mut acc: Vec<i64> = acc_lo.iter().zip(&acc_hi).map(|(&l, &h)| l as i64 + 256 * h as i64).collect();
        if x_offset != 0 {
            for row in acc.chunks_exact_mut(self.n) {
                for (a, &s) in row.iter_mut().zip(&self.col_sums) {
                    *a += x_offset as i64 * s as i64;
                }
            }
        }
        acc
    }
}

fn rten_u8(b: &PackedBMatrix<i8>, n: usize, k: usize, x: &[u8], m: usize) -> Vec<i32> {
    int8_gemm(|g| rten_gemm(g, m, n, GemmInputA::Unpacked(NdTensorView::from_data([m, k], x)), GemmInputB::Packed(b)))
}

/// The `m * n` outputs of one rten GEMM, in a new vector (written once, never zeroed first).
fn rten_gemm<L: GemmInT, R: GemmInT, O: GemmOutT>(g: &GemmExecutor<L, R, O>, m: usize, n: usize, a: GemmInputA<L>, b: GemmInputB<R>) -> Vec<O> {
    let mut out = Vec::with_capacity(m * n);
    g.gemm_uninit(&mut out.spare_capacity_mut()[..m * n], a, b, GemmUninitOptions::default()).expect("shapes checked by the caller");
    // SAFETY: gemm_uninit initialized all m*n outputs.
    unsafe { out.set_len(m * n) };
    out
}

/// The sum of an AVX vector's 8 lanes (the decode kernels' horizontal reduction).
///
/// # Safety
/// The CPU has AVX (the callers' AVX2 paths).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn hsum8(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: the caller has AVX.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }
}

/// Asks for the cache line at `p` ahead of a read the hardware prefetcher cannot predict (a
/// no-op off x86_64). Never faults, whatever `p` is.
#[inline(always)]
pub fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is in the x86_64 baseline, and a prefetch never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// A static F32 weight `[N, K]`, prepacked for `x[M, K] @ w^T` (float passthrough mode).
pub struct PackedF32 {
    packed: PackedBMatrix<f32>,
    /// Output features: rows of the weight, columns of the product.
    pub n: usize,
    /// Input features: columns of the weight, the activation's row length.
    pub k: usize,
}

impl PackedF32 {
    /// Packs `w` (`[N, K]`, row-major) once, for rten-gemm.
    pub fn new(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "weight is not [N, K]");
        let view = NdTensorView::from_data([n, k], w);
        PackedF32 { packed: f32_gemm(|g| g.prepack_b(view.transposed())), n, k }
    }

    /// `x[M, K] @ w^T`: the `[M, N]` product, row-major.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        assert_eq!(x.len(), m * self.k, "activation is not [M, K]");
        let a = GemmInputA::Unpacked(NdTensorView::from_data([m, self.k], x));
        f32_gemm(|g| rten_gemm(g, m, self.n, a, GemmInputB::Packed(&self.packed)))
    }
}

/// Plain f32 `a[M, K] @ b[K, N]` (or `b^T` when `b` is `[N, K]`), for dynamic MatMul.
pub fn matmul_f32(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, transpose_b: bool) -> Vec<f32> {
    let av = NdTensorView::from_data([m, k], a);
    let bv = if transpose_b { NdTensorView::from_data([n, k], b).transposed() } else { NdTensorView::from_data([k, n], b) };
    f32_gemm(|g| rten_gemm(g, m, n, GemmInputA::Unpacked(av), GemmInputB::Unpacked(bv)))
}

/// [`matmul_f32`] on the calling thread alone, for callers that already run one task per
/// thread (attention: one task per KV head and block of query rows). rten-gemm would split each
/// call over the pool again, and a task's GEMMs are too small to gain from it.
pub fn matmul_f32_serial(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, transpose_b: bool) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    matmul_f32_serial_into(&mut out, false, a, b, m, k, n, transpose_b);
    out
}

/// [`matmul_f32_serial`] into `out` (`[M, N]`, row-major): `out = a @ b`, or with `accumulate`
/// `out += a @ b`. No allocation: attention's tiles reuse one buffer per task.
#[allow(clippy::too_many_arguments)]
pub fn matmul_f32_serial_into(out: &mut [f32], accumulate: bool, a: &[f32], b: &[f32], m: usize, k: usize, n: usize, transpose_b: bool) {
    assert!(
        a.len() >= m * k && b.len() >= k * n && out.len() >= m * n,
        "matmul_f32_serial: a {} < {m}x{k}, b {} < {k}x{n} or out {} < {m}x{n}",
        a.len(),
        b.len(),
        out.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    // Strides in elements: column then row. B^T is `b` read with its strides swapped.
    let (rhs_cs, rhs_rs) = if transpose_b { (k as isize, 1) } else { (1, n as isize) };
    // SAFETY: the assert above bounds every read and write; gemm reads `out` only with
    // `accumulate` (`read_dst`), when the caller's values in it are initialized f32.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            rhs_cs,
            rhs_rs,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Every INT8 kernel this machine runs exactly: each of our paths it has (AVX2, or i8mm,
    /// dotprod and NEON; portable always), and rten's where it cannot saturate.
    fn exact_kernels() -> Vec<Int8Kernel> {
        let mut ks: Vec<Int8Kernel> = Int8Path::available().into_iter().map(Int8Kernel::Own).collect();
        if !int8_gemm(|g| g.may_saturate()) {
            ks.push(Int8Kernel::Rten);
        }
        ks
    }

    fn reference<T: Copy + Into<i32>>(x: &[T], w: &[i8], m: usize, k: usize, n: usize, off: i32) -> Vec<i32> {
        let mut want = vec![0i32; m * n];
        for i in 0..m {
            for j in 0..n {
                want[i * n + j] = (0..k).map(|t| (x[i * k + t].into() + off) * w[j * k + t] as i32).sum();
            }
        }
        want
    }

    #[test]
    fn the_default_int8_kernel_is_exact_here() {
        // This machine's kind (AVX2 without VNNI) must get our kernel, not rten's saturating one.
        let k = Int8Kernel::detect();
        assert!(exact_kernels().contains(&k), "{k:?} is not exact on this CPU");
        // aarch64: ours, the best path the CPU has.
        #[cfg(target_arch = "aarch64")]
        {
            let want = if cpu::cpu().i8mm {
                Int8Path::I8mm
            } else if cpu::cpu().dotprod {
                Int8Path::Dotprod
            } else {
                Int8Path::Neon
            };
            assert_eq!(k, Int8Kernel::Own(want));
        }
    }

    #[test]
    fn int8_gemm_is_exact_at_the_saturation_corners() {
        // 255 (u8) and -128 (i8) activations against +-127 weights: the worst cases for
        // vpmaddubsw, in runs of equal signs, so that pairs saturate if anything does.
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let (m, k, n) = (7, 96, 33);
        let w: Vec<i8> = (0..n * k)
            .map(|i| match i % 4 {
                0 | 1 => 127,
                2 => -127,
                _ => rng.random_range(-127..=127),
            })
            .collect();
        let xu: Vec<u8> = (0..m * k).map(|i| if i % 3 != 2 { 255 } else { rng.random() }).collect();
        let xi: Vec<i8> = (0..m * k).map(|i| if i % 3 != 2 { -128 } else { rng.random() }).collect();
        for kernel in exact_kernels() {
            let p = PackedI8::with_kernel(&w, n, k, kernel);
            for off in [0, -128, -255, -17, 40_000] {
                assert_eq!(p.matmul_u8(&xu, m, off), reference(&xu, &w, m, k, n, off), "{kernel:?} u8 offset {off}");
                assert_eq!(p.matmul_i8(&xi, m, off), reference(&xi, &w, m, k, n, off), "{kernel:?} i8 offset {off}");
            }
        }
    }

    #[test]
    fn int8_gemm_is_exact_on_every_blocking_edge() {
        // Odd K, K over several K blocks (640 K on x86, 1024 on Arm), rows past one row block (264,
        // 252), partial tiles of every row count (M % MR: 1 to 5) and N % NR, one row, one column;
        // K of every remainder of the Arm groups (K % 4: 1-3, K % 8: 1-7), K a multiple of 4 and
        // not of 8, a whole number of panels.
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        for (m, k, n) in [
            (1, 1, 1),
            (5, 7, 17),
            (13, 1201, 40),
            (300, 64, 31),
            (6, 2 * 512 + 2, 16),
            (8, 70, 33),
            (9, 30, 16),
            (10, 3, 5),
            (3, 0, 5),
            (0, 4, 5),
            (7, 5, 20),
            (11, 11, 47),
            (4, 12, 15),
            (2, 2053, 3),
            (14, 9, 64),
            (17, 13, 18),
            (12, 6, 32),
            (1, 2048, 16),
        ] {
            let w: Vec<i8> = (0..n * k).map(|_| rng.random_range(-128..=127)).collect();
            let x: Vec<u8> = (0..m * k).map(|_| rng.random()).collect();
            let xi: Vec<i8> = (0..m * k).map(|_| rng.random()).collect();
            let (want, want_i) = (reference(&x, &w, m, k, n, -99), reference(&xi, &w, m, k, n, 5));
            for kernel in exact_kernels() {
                let p = PackedI8::with_kernel(&w, n, k, kernel);
                assert_eq!(p.matmul_u8(&x, m, -99), want, "{kernel:?} {m}x{k}x{n}");
                assert_eq!(p.matmul_i8(&xi, m, 5), want_i, "{kernel:?} {m}x{k}x{n} i8");
            }
        }
    }

    #[test]
    fn int8_gemm_splits_over_a_pool_and_finishes_every_row_once() {
        // Several threads: few rows split the panels, many rows split the rows (each task widens
        // its own). Both give the one-thread result, and `each` sees every row exactly once
        // (twice or never would change the mapped values).
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (k, n) = (64, 16 * 7 + 3);
        let w: Vec<i8> = (0..n * k).map(|_| rng.random_range(-127..=127)).collect();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let each = |rows: &mut [i32]| rows.iter_mut().for_each(|v| *v = *v * 3 + 1);
        for m in [20, 3 * int8::ROWS_PER_TASK_MIN + 5] {
            let x: Vec<u8> = (0..m * k).map(|_| rng.random()).collect();
            let want = reference(&x, &w, m, k, n, -3);
            for kernel in exact_kernels() {
                let p = PackedI8::with_kernel(&w, n, k, kernel);
                assert_eq!(pool.install(|| p.matmul_u8(&x, m, -3)), want, "{kernel:?} {m} rows");
                let mapped: Vec<i32> = want.iter().map(|v| v * 3 + 1).collect();
                assert_eq!(pool.install(|| p.matmul_u8_then(&x, m, -3, &each)), mapped, "{kernel:?} {m} rows, then each");
                // An offset beyond the fold (i16): the column sums apply the rest before `each`.
                let mapped: Vec<i32> = reference(&x, &w, m, k, n, 40_000).iter().map(|v| v * 3 + 1).collect();
                assert_eq!(pool.install(|| p.matmul_u8_then(&x, m, 40_000, &each)), mapped, "{kernel:?} {m} rows, offset 40000");
            }
        }
    }

    /// An LPBQ weight packed at half the bytes multiplies exactly as its INT8 form on every path
    /// this machine has, over blocking edges (K of several blocks and K blocks, N not a
    /// multiple of 16, rows split over tasks), and reads its columns back; a weight whose values
    /// are not 4-bit values times the scales is packed as INT8, with the same results.
    #[test]
    fn lpbq_panels_multiply_as_their_int8_weight() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for (m, k, n, block) in [(7, 64, 33, 32), (300, 1536, 40, 32), (13, 2048, 16, 64), (1, 96, 5, 32)] {
            let scales: Vec<u8> = (0..n * (k / block)).map(|_| rng.random_range(1..=15)).collect();
            let w: Vec<i8> = (0..n * k).map(|i| rng.random_range(-8i8..=7) * scales[(i / k) * (k / block) + (i % k) / block] as i8).collect();
            let x: Vec<u8> = (0..m * k).map(|_| rng.random()).collect();
            let xi: Vec<i8> = (0..m * k).map(|_| rng.random()).collect();
            for path in Int8Path::available() {
                let panels = Panels::new_lpbq(&w, n, k, block, &scales, path).expect("an LPBQ weight");
                assert!(panels.bytes() * 2 <= n.next_multiple_of(int8::NR) * k * 17 / 16 + 64, "{path:?}: {} bytes for {n} x {k}", panels.bytes());
                let p = PackedI8 { packed: Packed::Own(panels), n, k, col_sums: w.chunks_exact(k).map(|r| r.iter().map(|&v| v as i32).sum()).collect() };
                for off in [0, -128, 17] {
                    assert_eq!(p.matmul_u8(&x, m, off), reference(&x, &w, m, k, n, off), "{path:?} {m}x{k}x{n} u8 offset {off}");
                    assert_eq!(p.matmul_i8(&xi, m, off), reference(&xi, &w, m, k, n, off), "{path:?} {m}x{k}x{n} i8 offset {off}");
                }
                let cs = [0, k - 1, k / 2, 3];
                let want: Vec<i8> = cs.iter().flat_map(|&c| (0..n).map(|r| w[r * k + c]).collect::<Vec<_>>()).collect();
                assert_eq!(p.columns(&cs).unwrap(), want, "{path:?} columns");
            }
            let lp = PackedI8::with_lpbq(&w, n, k, block, &scales);
            assert_eq!(lp.matmul_u8(&x, m, -3), reference(&x, &w, m, k, n, -3), "with_lpbq");
            assert!(lp.bytes() < n.next_multiple_of(16) * k * 6 / 10, "with_lpbq: {} bytes for {n} x {k}", lp.bytes());
        }
        // 9 is no 4-bit value times a scale of 1; 3 x 3 is, but not under a scale of 2.
        let (w, scales) = (vec![9i8; 64], vec![1u8, 1]);
        assert!(Panels::new_lpbq(&w, 1, 64, 32, &scales, Int8Path::Portable).is_none());
        let mut w = vec![6i8; 64];
        w[40] = 9;
        assert!(Panels::new_lpbq(&w, 1, 64, 32, &[3, 2], Int8Path::Portable).is_none());
        let fallback = PackedI8::with_lpbq(&w, 1, 64, 32, &[3, 2]);
        let x: Vec<u8> = (0..64).map(|i| i as u8).collect();
        assert_eq!(fallback.matmul_u8(&x, 1, 0), reference(&x, &w, 1, 64, 1, 0));
        assert_eq!(fallback.bytes(), PackedI8::new(&w, 1, 64).bytes(), "packed as INT8");
    }

    #[test]
    fn columns_read_from_the_panels_are_the_weights_columns() {
        // A partial last panel (N % 16), K of no group's multiple (the last group of 2, 4 or 8 K
        // partly padding), columns in the first, a middle and the last group.
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        let (n, k) = (37, 11);
        let w: Vec<i8> = (0..n * k).map(|_| rng.random_range(-127..=127)).collect();
        let cs = [6, 0, 3, 3, 10, 8, 5];
        let want: Vec<i8> = cs.iter().flat_map(|&c| (0..n).map(move |r| (r, c))).map(|(r, c)| w[r * k + c]).collect();
        for kernel in exact_kernels() {
            let p = PackedI8::with_kernel(&w, n, k, kernel);
            match kernel {
                Int8Kernel::Own(_) => assert_eq!(p.columns(&cs), Some(want.clone()), "{kernel:?}"),
                Int8Kernel::Rten => assert_eq!(p.columns(&cs), None),
            }
        }
    }

    #[test]
    fn u16_gemm_is_exact_beyond_i32() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        // K large and values at the extremes: the exact sum needs more than 32 bits.
        let (m, k, n) = (3, 1536, 5);
        let x: Vec<u16> = (0..m * k).map(|i| if i % 3 == 0 { 65535 } else { rng.random_range(0..=65535) }).collect();
        let w: Vec<i8> = (0..n * k).map(|i| if i % 2 == 0 { 127 } else { rng.random_range(-127..=127) }).collect();
        for kernel in exact_kernels() {
            let p = PackedI8::with_kernel(&w, n, k, kernel);
            for off in [0, -32768, -1234] {
                let acc = p.matmul_u16(&x, m, off);
                for i in 0..m {
                    for j in 0..n {
                        let want: i64 = (0..k).map(|t| (x[i * k + t] as i64 + off as i64) * w[j * k + t] as i64).sum();
                        assert_eq!(acc[i * n + j], want, "{kernel:?} ({i}, {j}) offset {off}");
                    }
                }
            }
            assert!(p.matmul_u16(&vec![65535; k], 1, 0)[0] > i32::MAX as i64, "the test must exercise sums beyond i32");
        }
    }

    #[test]
    fn f32_gemm_matches_naive() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let (m, k, n) = (5, 64, 9);
        let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let y = PackedF32::new(&w, n, k).matmul(&x, m);
        let y2 = matmul_f32(&x, &w, m, k, n, true);
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|t| x[i * k + t] * w[j * k + t]).sum();
                assert!((y[i * n + j] - want).abs() < 1e-4 && (y2[i * n + j] - want).abs() < 1e-4);
            }
        }
    }
}
