//! INT8 GEMM of the host executor on SmolLM2's prefill shapes (chunk of 256 rows).
//! The side-by-side prefill table is `cargo run --release --example bench_prefill`.
use candle_npu::kernels::PackedI8;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn gemm(c: &mut Criterion) {
    let mut g = c.benchmark_group("int8_gemm_m256");
    for (name, k, n) in [("qo_576x576", 576, 576), ("kv_576x192", 576, 192), ("gate_up_576x1536", 576, 1536), ("down_1536x576", 1536, 576)] {
        let m = 256;
        let w: Vec<i8> = (0..n * k).map(|i| ((i * 7919) % 255) as i8).collect();
        let x: Vec<u8> = (0..m * k).map(|i| ((i * 104729) % 256) as u8).collect();
        let p = PackedI8::new(&w, n, k);
        g.throughput(Throughput::Elements((2 * m * n * k) as u64));
        g.bench_function(name, |b| b.iter(|| p.matmul_u8(std::hint::black_box(&x), m, -128)));
    }
    g.finish();
}

criterion_group!(benches, gemm);
criterion_main!(benches);
