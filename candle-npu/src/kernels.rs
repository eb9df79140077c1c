//! INT8 and F32 GEMM kernels for the host executor.
//!
//! Why rten-gemm: it has a safe API, prepacks the weight ("B") matrix once (our weights are static,
//! so packing is paid at prepare time, as on the NPU), and has u8 x i8 -> i32 kernels for x86
//! (AVX-512 VNNI, AVX2) and Arm (dotprod, i8mm), so the same code is fast on a phone's CPU cores.
//! Measured on the 2-core build machine for 1024x2048x2048 (issue 2): rten-gemm 443 GOPS,
//! pire-gemm 592 GOPS but column-major output only and an unsafe API, gemmkit 456 GOPS without
//! Arm SDOT. See `benches/prefill.rs` for GOPS on the model's own shapes.
//!
//! Exactness: on x86 without VNNI, rten's int8 kernel uses `vpmaddubsw`, which adds two u8*i8
//! products into a *saturating* i16. With u8 in [0, 255] and i8 in [-127, 127] a pair can reach
//! 64770 and saturate. The host executor is the numerical reference for the NPU, so it must be
//! exact: when the kernel may saturate, activations are split as `x = 128*hi + lo` (lo in [0, 127],
//! hi in {0, 1}); each half is saturation-free (2*127*127 < 32767) and the two products are summed.
//! That costs a second GEMM on such machines only (issue 11 replaces it with one exact pass).

use rten_gemm::{GemmExecutor, GemmInputA, GemmInputB, GemmUninitOptions, PackedBMatrix};
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

/// Name of the int8 kernel in use and whether it needs the exact split (see module docs).
pub fn int8_kernel_info() -> (String, bool) {
    int8_gemm(|g| (g.kernel_name().to_string(), g.may_saturate()))
}

/// A static INT8 weight `[N, K]`, prepacked for `x[M, K] @ w^T`.
pub struct PackedI8 {
    packed: PackedBMatrix<i8>,
    pub n: usize,
    pub k: usize,
    /// Per output column `sum_k w[n, k]`, to apply the activation offset after the GEMM.
    pub col_sums: Vec<i32>,
}

impl PackedI8 {
    pub fn new(w: &[i8], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "weight is not [N, K]");
        let view = NdTensorView::from_data([n, k], w);
        let packed = int8_gemm(|g| g.prepack_b(view.transposed()));
        let col_sums = w.chunks_exact(k).map(|row| row.iter().map(|&v| v as i32).sum()).collect();
        PackedI8 { packed, n, k, col_sums }
    }

    /// `acc[m, n] = sum_k (x[m, k] + x_offset) * w[n, k]`, exactly, in i32.
    pub fn matmul_u8(&self, x: &[u8], m: usize, x_offset: i32) -> Vec<i32> {
        assert_eq!(x.len(), m * self.k, "activation is not [M, K]");
        // A kernel that may saturate gets the two exact halves only (the full product would be
        // computed and thrown away: 3 GEMMs where the split needs 2).
        let mut acc = if int8_gemm(|g| g.may_saturate()) {
            let lo: Vec<u8> = x.iter().map(|&v| v & 0x7f).collect();
            let hi: Vec<u8> = x.iter().map(|&v| v >> 7).collect();
            let mut acc = self.raw(&lo, m);
            for (a, h) in acc.iter_mut().zip(self.raw(&hi, m)) {
                *a += 128 * h;
            }
            acc
        } else {
            self.raw(x, m)
        };
        if x_offset != 0 {
            for row in acc.chunks_exact_mut(self.n) {
                for (a, &s) in row.iter_mut().zip(&self.col_sums) {
                    *a += x_offset * s;
                }
            }
        }
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

    fn raw(&self, x: &[u8], m: usize) -> Vec<i32> {
        let mut out = Vec::with_capacity(m * self.n);
        let a = NdTensorView::from_data([m, self.k], x);
        int8_gemm(|g| {
            g.gemm_uninit(
                &mut out.spare_capacity_mut()[..m * self.n],
                GemmInputA::Unpacked(a),
                GemmInputB::Packed(&self.packed),
                GemmUninitOptions::default(),
            )
            .map(|_| ())
        })
        .expect("shapes checked above");
        // SAFETY: gemm_uninit initialized all m*n outputs.
        unsafe { out.set_len(m * self.n) };
        out
    }
}

/// A static F32 weight `[N, K]`, prepacked for `x[M, K] @ w^T` (float passthrough mode).
pub struct PackedF32 {
    packed: PackedBMatrix<f32>,
    pub n: usize,
    pub k: usize,
}

impl PackedF32 {
    pub fn new(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "weight is not [N, K]");
        let view = NdTensorView::from_data([n, k], w);
        PackedF32 { packed: f32_gemm(|g| g.prepack_b(view.transposed())), n, k }
    }

    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        assert_eq!(x.len(), m * self.k, "activation is not [M, K]");
        let mut out = Vec::with_capacity(m * self.n);
        let a = NdTensorView::from_data([m, self.k], x);
        f32_gemm(|g| {
            g.gemm_uninit(
                &mut out.spare_capacity_mut()[..m * self.n],
                GemmInputA::Unpacked(a),
                GemmInputB::Packed(&self.packed),
                GemmUninitOptions::default(),
            )
            .map(|_| ())
        })
        .expect("shapes checked above");
        // SAFETY: gemm_uninit initialized all m*n outputs.
        unsafe { out.set_len(m * self.n) };
        out
    }
}

/// Plain f32 `a[M, K] @ b[K, N]` (or `b^T` when `b` is `[N, K]`), for dynamic MatMul.
pub fn matmul_f32(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, transpose_b: bool) -> Vec<f32> {
    let mut out = Vec::with_capacity(m * n);
    let av = NdTensorView::from_data([m, k], a);
    let bv = if transpose_b { NdTensorView::from_data([n, k], b).transposed() } else { NdTensorView::from_data([k, n], b) };
    f32_gemm(|g| {
        g.gemm_uninit(&mut out.spare_capacity_mut()[..m * n], GemmInputA::Unpacked(av), GemmInputB::Unpacked(bv), GemmUninitOptions::default())
            .map(|_| ())
    })
    .expect("shapes checked by the caller");
    // SAFETY: gemm_uninit initialized all m*n outputs.
    unsafe { out.set_len(m * n) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn int8_gemm_is_exact_at_the_saturation_corner() {
        // All-255 activations against +-127 weights: the worst case for vpmaddubsw.
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let (m, k, n) = (7, 96, 33);
        let x: Vec<u8> = (0..m * k).map(|i| if i % 3 == 0 { 255 } else { rng.random() }).collect();
        let w: Vec<i8> = (0..n * k).map(|i| if i % 2 == 0 { 127 } else { rng.random_range(-127..=127) }).collect();
        let p = PackedI8::new(&w, n, k);
        for off in [0, -128, -17] {
            let acc = p.matmul_u8(&x, m, off);
            for i in 0..m {
                for j in 0..n {
                    let want: i32 = (0..k).map(|t| (x[i * k + t] as i32 + off) * w[j * k + t] as i32).sum();
                    assert_eq!(acc[i * n + j], want, "({i}, {j}) offset {off}");
                }
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
        let p = PackedI8::new(&w, n, k);
        for off in [0, -32768, -1234] {
            let acc = p.matmul_u16(&x, m, off);
            for i in 0..m {
                for j in 0..n {
                    let want: i64 = (0..k).map(|t| (x[i * k + t] as i64 + off as i64) * w[j * k + t] as i64).sum();
                    assert_eq!(acc[i * n + j], want, "({i}, {j}) offset {off}");
                }
            }
        }
        assert!(p.matmul_u16(&vec![65535; k], 1, 0)[0] > i32::MAX as i64, "the test must exercise sums beyond i32");
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
