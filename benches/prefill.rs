//! INT8 GEMM of the host executor on SmolLM2's prefill shapes (chunk of 256 rows), the row
//! kernels that cost most beside it (softmax over a 1024-key row), and the whole SmolLM2 prefill
//! on the host executor; greedy sampling of a decode row.
//! The side-by-side prefill table is `cargo run --release --example bench_prefill`.
use candle_npu::kernels::PackedI8;
use candle_npu_models::PrefillOptions;
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

/// The softmax numerators of one attention row of a 1024-token prompt (SmolLM2 takes 4.7 million
/// of these values per layer), SiLU, and the shadow path of one output row.
fn row_kernels(c: &mut Criterion) {
    use candle_npu::kernels::rows::softmax_numerators;
    let mut g = c.benchmark_group("row_kernels");
    let row: Vec<f32> = (0..1024).map(|i| ((i * 7919) % 1000) as f32 / 100.0 - 5.0).collect();
    g.throughput(Throughput::Elements(row.len() as u64));
    let mut buf = row.clone();
    g.bench_function("softmax_1024", |b| {
        b.iter(|| {
            buf.copy_from_slice(&row);
            softmax_numerators(std::hint::black_box(&mut buf), 0.125)
        })
    });
    // SiLU(gate) * up of a 64-row chunk of SmolLM2's FFN.
    use candle_npu::kernels::rows::silu_mul;
    let gate: Vec<f32> = (0..64 * 1536).map(|i| ((i * 7919) % 2000) as f32 / 200.0 - 5.0).collect();
    g.throughput(Throughput::Elements(gate.len() as u64));
    g.bench_function("silu_mul_64x1536", |b| b.iter(|| silu_mul(std::hint::black_box(&gate), &gate)));
    // The shadow path of one gate/up output row (1536 values) with 16 outliers.
    use candle_npu::kernels::rows::shadow_row;
    let n = 1536;
    let cols: Vec<Vec<i8>> = (0..16).map(|j| (0..n).map(|i| ((i * 7919 + j * 104729) % 255) as i8).collect()).collect();
    let terms: Vec<(f32, &[i8])> = cols.iter().enumerate().map(|(j, c)| (j as f32 * 0.37 - 3.0, &c[..])).collect();
    let scales: Vec<f32> = (0..n).map(|i| 1e-3 + i as f32 * 1e-6).collect();
    let mut y = vec![0f32; n];
    g.throughput(Throughput::Elements((n * terms.len()) as u64));
    g.bench_function("shadow_row_1536x16", |b| b.iter(|| shadow_row(std::hint::black_box(&mut y), &terms, &scales)));
    g.finish();
}

/// The whole engine: SmolLM2-135M prefill on the host executor (W8A8, chunk 256, default
/// schedule), the figure `bench_prefill` compares with llama.cpp. Here for A/B runs of two
/// builds (`--save-baseline` / `--baseline`), without the other engines.
fn prefill(c: &mut Criterion) {
    use candle_npu_models::{assets, CalibrationSet, DecodeWeights, LoadOptions, Pipeline, Precision};
    let dev = candle_npu::NpuDevice::host();
    let opts = LoadOptions { precision: Some(Precision::W8A8), decode_weights: DecodeWeights::Q8_0, ..Default::default() };
    let mut p = Pipeline::load(&assets::smollm2(), None, &dev, opts).expect("SmolLM2 (run scripts/setup.sh)");
    p.ensure_profile(None, CalibrationSet::default(), |_, _| {}).expect("quant profile");
    let mut text = vec![];
    for a in assets::wiki_heldout(400).expect("held-out text") {
        text.extend(p.encode(&a, false).expect("tokenizer"));
        if text.len() > 1024 {
            break;
        }
    }
    let mut g = c.benchmark_group("prefill_smollm2_w8a8");
    g.sample_size(10);
    for n in [256, 1024] {
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(format!("{n}_tokens"), |b| b.iter(|| p.model.prefill(&text[..n], &PrefillOptions::chunked(256)).expect("prefill")));
    }
    g.finish();
}

/// One attention task of a 2048-token SmolLM2 prefill: the last 64-row block of one KV head's 3
/// query heads (192 stacked rows of 64) over 2048 keys. "materialized" is the engine before the
/// tiled kernel (the block's whole score matrix, 1.5 MB, then its softmax and one P.V GEMM);
/// "tiled" is `kernels::attention::attend` (512-key tiles, merged). And decode's one position of
/// the same head (3 stacked rows) over the 2048 keys: tiled GEMMs, the one-position kernel
/// (`attend_tile_one`), and the whole score row at once.
fn attention(c: &mut Criterion) {
    use candle_npu::kernels::attention::{attend, HeadKv, KvRows, Partial, Scratch};
    use candle_npu::kernels::{matmul_f32_serial, rows::softmax_numerators};
    let (hd, keys_n, rows) = (64usize, 2048usize, 192usize);
    let val = |i: usize| ((i * 7919) % 2000) as f32 / 1000.0 - 1.0;
    let keys: Vec<f32> = (0..keys_n * hd).map(val).collect();
    let values: Vec<f32> = (0..keys_n * hd).map(|i| val(i + 13)).collect();
    let q: Vec<f32> = (0..rows * hd).map(|i| val(i + 101)).collect();
    // Stacked row i is position keys_n - 64 + i % 64.
    let end = |i: usize| keys_n - 64 + i % 64 + 1;
    let mut g = c.benchmark_group("attention_2048");
    g.sample_size(20);
    g.throughput(Throughput::Elements((rows * keys_n) as u64));
    g.bench_function("block_materialized", |b| {
        b.iter(|| {
            let mut p = matmul_f32_serial(&q, &keys, rows, hd, keys_n, true);
            let mut sums = Vec::with_capacity(rows);
            for (i, row) in p.chunks_exact_mut(keys_n).enumerate() {
                sums.push(softmax_numerators(&mut row[..end(i)], 0.125));
                row[end(i)..].fill(0.0);
            }
            let mut o = matmul_f32_serial(&p, &values, rows, keys_n, hd, false);
            for (row, s) in o.chunks_exact_mut(hd).zip(sums) {
                row.iter_mut().for_each(|v| *v /= s);
            }
            o
        })
    });
    let kv = HeadKv { keys: KvRows::F32(&keys), values: KvRows::F32(&values), first: 0, head_dim: hd };
    let mut scratch = Scratch::default();
    let mut acc = Partial::default();
    g.bench_function("block_tiled", |b| {
        b.iter(|| {
            acc.reset(rows, hd);
            attend(&q, kv, &|i| 0..end(i), 0.125, &mut acc, &mut scratch);
            let mut o = vec![0f32; rows * hd];
            acc.normalized_into(&mut o);
            o
        })
    });
    g.throughput(Throughput::Bytes((2 * keys_n * hd * 4) as u64));
    g.bench_function("decode_row_tiled", |b| {
        b.iter(|| {
            acc.reset(3, hd);
            attend(&q[..3 * hd], kv, &|_| 0..keys_n, 0.125, &mut acc, &mut scratch);
        })
    });
    g.bench_function("decode_row_one_position", |b| {
        use candle_npu::kernels::attention::{attend_tile_one, tile_starts};
        let mut tile = Partial::default();
        let mut scores = vec![];
        b.iter(|| {
            acc.reset(3, hd);
            for t in tile_starts(std::iter::once(0..keys_n), 0..keys_n) {
                tile.reset(3, hd);
                attend_tile_one(&q[..3 * hd], kv, 0..keys_n, 0.125, t, &mut tile, &mut scores);
                acc.merge(&tile);
            }
        })
    });
    g.bench_function("decode_row_materialized", |b| {
        b.iter(|| {
            let mut p = matmul_f32_serial(&q[..3 * hd], &keys, 3, hd, keys_n, true);
            let sums: Vec<f32> = p.chunks_exact_mut(keys_n).map(|r| softmax_numerators(r, 0.125)).collect();
            let mut o = matmul_f32_serial(&p, &values, 3, keys_n, hd, false);
            for (row, s) in o.chunks_exact_mut(hd).zip(sums) {
                row.iter_mut().for_each(|v| *v /= s);
            }
            o
        })
    });
    g.finish();
}

/// Greedy sampling of one decode row: SmolLM2's 49,152 logits, candle's argmax against the one
/// the engine and `Pipeline::generate` take (`logits::argmax`, the same index).
fn sampling(c: &mut Criterion) {
    let v: Vec<f32> = (0..49152u32).map(|i| ((i.wrapping_mul(2654435761) >> 8) % 10007) as f32 / 331.0).collect();
    let t = candle_core::Tensor::new(v.as_slice(), &candle_core::Device::Cpu).unwrap();
    let mut g = c.benchmark_group("sampling");
    g.throughput(Throughput::Bytes((v.len() * 4) as u64));
    g.bench_function("argmax_candle", |b| b.iter(|| t.argmax(candle_core::D::Minus1).unwrap().to_scalar::<u32>().unwrap()));
    g.bench_function("argmax_in_place", |b| b.iter(|| candle_npu_models::logits::argmax(&t).unwrap()));
    g.finish();
}

criterion_group!(benches, gemm, row_kernels, attention, prefill, sampling);
criterion_main!(benches);
