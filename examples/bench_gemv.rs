//! The decode kernels' speed per block format: one thread, the weights read from memory (copies
//! of the matrix in turn, 512 MiB in all, so that no copy is in a cache when read), GB/s of
//! weight bytes against the machine's read bandwidth on one thread (a plain sum over 512 MiB).
//!
//! ```text
//! cargo run --release --example bench_gemv -- [--n 4864] [--k 896] [--rounds 5]
//! ```
//!
//! The shape defaults to Qwen2.5-0.5B's `ffn_gate` (4864 x 896); a K-quant needs K a multiple
//! of 256, so those rows use K rounded up to one (1024 for the default).
//!
//! A second table is batched decode's kernel (`gemv_rows`): 1, 2 and 4 input rows against a
//! piece of 64 weight rows in L2 (as `BlockMatrix::product` gives it, SmolLM2's K = 576), in
//! nanoseconds per input row and weight row, so that it shows the arithmetic a row adds, not
//! the memory.
use std::time::Instant;

use anyhow::Result;
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use candle_npu::kernels::gemv::{gemv_on, gemv_rows_on, BlockFormat, GemvPath, Q8Activation};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// Rows (output features); `--rows-only` takes 64.
    #[arg(long, default_value_t = 4864)]
    n: usize,
    /// Columns (input features); `--rows-only` takes 576 (the K-quants 512).
    #[arg(long, default_value_t = 896)]
    k: usize,
    /// Rounds; the best of them is shown.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Only the batched table (kernel arithmetic, weights in L2).
    #[arg(long)]
    rows_only: bool,
}

/// Uniform values in [-0.5, 0.5), the same every run.
fn random() -> impl FnMut() -> f32 {
    let mut seed = 1u64;
    move || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    }
}

/// One thread's read bandwidth, GB/s: the best of 5 sums over 512 MiB.
fn bandwidth() -> f64 {
    let buf: Vec<u64> = (0..(64u64 << 20)).collect();
    (0..5)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(buf.iter().fold(0u64, |a, &v| a.wrapping_add(v)));
            (buf.len() * 8) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let paths: Vec<GemvPath> =
        [GemvPath::Avx512, GemvPath::Avx2, GemvPath::I8mm, GemvPath::Dotprod, GemvPath::Neon].into_iter().filter(|p| p.runs_here()).collect();
    if args.rows_only {
        return rows_at_once(&paths, args.rounds, &mut random());
    }
    let bw = bandwidth();
    println!("One thread; read bandwidth of one thread (sum over 512 MiB, best of 5): {bw:.1} GB/s (the default path: {:?})", GemvPath::detect());
    println!("Weights from memory: copies of the matrix in turn, 512 MiB; best of {} rounds; GB/s of weight bytes (share of the bandwidth)\n", args.rounds);
    let names: Vec<String> = paths.iter().map(|p| format!("{p:?}")).collect();
    println!("| format | shape | bytes per weight | {} |", names.join(" | "));
    println!("|---|---|---|{}", "---|".repeat(paths.len()));
    let mut random = random();
    for format in BlockFormat::ALL {
        let k = args.k.next_multiple_of(format.block_len());
        let (n, k) = (args.n, k);
        let w = Tensor::from_vec((0..n * k).map(|_| random()).collect::<Vec<f32>>(), (n, k), &Device::Cpu)?;
        let bytes = QTensor::quantize(&w, format.dtype())?.data()?.into_owned();
        let copies = ((512usize << 20) / bytes.len()).max(2);
        let all: Vec<u8> = bytes.iter().copied().cycle().take(bytes.len() * copies).collect();
        let x = Q8Activation::quantize(&(0..k).map(|_| random()).collect::<Vec<f32>>());
        let mut out = vec![0f32; n];
        let mut cells = vec![];
        for &path in &paths {
            let mut best = 0f64;
            for _ in 0..args.rounds {
                let t = Instant::now();
                for c in all.chunks_exact(bytes.len()) {
                    gemv_on(path, format, c, k, &x, 0..n, &mut out);
                }
                best = best.max(all.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
                std::hint::black_box(&out);
            }
            cells.push(format!("{best:.1} ({:.0}%)", 100.0 * best / bw));
        }
        let per_weight = bytes.len() as f64 / (n * k) as f64;
        println!("| {format:?} | {n} x {k} | {per_weight:.3} | {} |", cells.join(" | "));
    }
    rows_at_once(&paths, args.rounds, &mut random)
}

/// Batched decode's kernel: ns per input row and weight row for 1, 2 and 4 input rows at once,
/// 64 weight rows of K = 576 (the K-quants: 512) in L2 (best of `rounds`).
fn rows_at_once(paths: &[GemvPath], rounds: usize, random: &mut impl FnMut() -> f32) -> Result<()> {
    let (n, repeats) = (64, 2000);
    println!("\nBatched rows (`gemv_rows`): {n} x 576 weights in L2 (the K-quants: {n} x 512), {repeats} products per round, best of {rounds} rounds; ns per input row and weight row\n");
    let cols: Vec<String> = paths.iter().flat_map(|p| [1, 2, 4].map(|m| format!("{p:?} x{m}"))).collect();
    println!("| format | {} |", cols.join(" | "));
    println!("|---|{}", "---|".repeat(cols.len()));
    for format in [BlockFormat::Q8_0, BlockFormat::Q4_1, BlockFormat::Q4_0, BlockFormat::Q5_0, BlockFormat::Q4K, BlockFormat::Q6K] {
        let k = if format.block_len() == 256 { 512 } else { 576 };
        let w = Tensor::from_vec((0..n * k).map(|_| random()).collect::<Vec<f32>>(), (n, k), &Device::Cpu)?;
        let bytes = QTensor::quantize(&w, format.dtype())?.data()?.into_owned();
        let xs: Vec<Q8Activation> = (0..4).map(|_| Q8Activation::quantize(&(0..k).map(|_| random()).collect::<Vec<f32>>())).collect();
        let mut cells = vec![];
        for &path in paths {
            for m in [1, 2, 4] {
                let x: Vec<&Q8Activation> = xs[..m].iter().collect();
                let mut outs = vec![vec![0f32; n]; m];
                let mut best = f64::INFINITY;
                for _ in 0..rounds {
                    let t = Instant::now();
                    for _ in 0..repeats {
                        gemv_rows_on(path, format, &bytes, k, &x, 0..n, &mut outs.iter_mut().map(|o| o.as_mut_slice()).collect::<Vec<_>>());
                    }
                    best = best.min(t.elapsed().as_secs_f64() * 1e9 / (repeats * m * n) as f64);
                    std::hint::black_box(&outs);
                }
                cells.push(format!("{best:.1}"));
            }
        }
        println!("| {format:?} | {} |", cells.join(" | "));
    }
    // What a product's input rows cost before it: each row quantized (`Q8Activation`, its block
    // sums and groups), once per product and row, on the caller's thread alone.
    let mut a = Q8Activation::quantize(&[0.0; 32]);
    println!();
    for k in [576, 1536] {
        let x: Vec<f32> = (0..k).map(|_| random()).collect();
        let mut best = f64::INFINITY;
        for _ in 0..rounds {
            let t = Instant::now();
            for _ in 0..repeats {
                a.quantize_into(std::hint::black_box(&x));
            }
            best = best.min(t.elapsed().as_secs_f64() * 1e9 / repeats as f64);
            std::hint::black_box(&a);
        }
        println!("Quantizing one input row of K = {k} (`Q8Activation::quantize_into`, best of {rounds} rounds of {repeats}): {best:.0} ns");
    }
    Ok(())
}
