//! What this CPU runs, asked once for every kernel: the x86_64 paths need their features, and
//! the aarch64 `sdot` / `smmla` paths stop the process with SIGILL where they are missing. Each
//! kernel's own path enum ([`super::gemv::GemvPath`], [`super::int8::Int8Path`]) says which of
//! these it has a path for; the row kernels and attention take AVX2 + FMA where [`cpu`] has it.

use std::sync::OnceLock;

/// The features the kernels choose by. Fields of the other architecture are false.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuFeatures {
    /// x86_64: AVX2.
    pub avx2: bool,
    /// x86_64: FMA.
    pub fma: bool,
    /// x86_64: F16C (f16 <-> f32 conversions).
    pub f16c: bool,
    /// x86_64: AVX-512 F, BW, VL and VNNI, all four (`vpdpbusd` on 256-bit registers).
    pub avx512_vnni: bool,
    /// aarch64: FEAT_DotProd (`sdot`).
    pub dotprod: bool,
    /// aarch64: FEAT_I8MM (`smmla`).
    pub i8mm: bool,
}

impl CpuFeatures {
    /// AVX2 with FMA: the row kernels' and attention's x86_64 paths.
    pub fn avx2_fma(&self) -> bool {
        self.avx2 && self.fma
    }
}

/// This CPU's features, detected on the first call.
pub fn cpu() -> &'static CpuFeatures {
    static FEATURES: OnceLock<CpuFeatures> = OnceLock::new();
    FEATURES.get_or_init(detect)
}

fn detect() -> CpuFeatures {
    #[allow(unused_mut)]
    let mut f = CpuFeatures::default();
    #[cfg(target_arch = "x86_64")]
    {
        f.avx2 = std::arch::is_x86_feature_detected!("avx2");
        f.fma = std::arch::is_x86_feature_detected!("fma");
        f.f16c = std::arch::is_x86_feature_detected!("f16c");
        f.avx512_vnni = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512vnni");
    }
    #[cfg(target_arch = "aarch64")]
    {
        f.dotprod = std::arch::is_aarch64_feature_detected!("dotprod");
        f.i8mm = std::arch::is_aarch64_feature_detected!("i8mm");
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_feature_is_the_one_std_detects() {
        let f = cpu();
        assert!(std::ptr::eq(f, cpu()), "detected once");
        #[cfg(target_arch = "x86_64")]
        {
            let want = [("avx2", f.avx2), ("fma", f.fma), ("f16c", f.f16c), ("avx512vnni", f.avx512_vnni)];
            for (name, got) in want {
                let has = match name {
                    "avx2" => std::arch::is_x86_feature_detected!("avx2"),
                    "fma" => std::arch::is_x86_feature_detected!("fma"),
                    "f16c" => std::arch::is_x86_feature_detected!("f16c"),
                    _ => std::arch::is_x86_feature_detected!("avx512vnni") && std::arch::is_x86_feature_detected!("avx512vl"),
                };
                assert_eq!(got, has, "{name}");
            }
            assert!(!f.dotprod && !f.i8mm, "no Arm features on x86_64");
        }
        #[cfg(target_arch = "aarch64")]
        {
            assert_eq!((f.dotprod, f.i8mm), (std::arch::is_aarch64_feature_detected!("dotprod"), std::arch::is_aarch64_feature_detected!("i8mm")));
            assert!(!f.avx2 && !f.fma && !f.f16c && !f.avx512_vnni, "no x86 features on aarch64");
        }
    }
}
