//! A model of your own on the NPU: a small transformer written against candle-nn, as any candle
//! user writes one, whose linear layers move to the NPU with `candle_npu::nn`. Against the same
//! program on candle alone, six lines change (marked `// NPU`): make an `Npu`, build the linears
//! through it, run the model on a few samples, freeze. Norms, attention and activations stay
//! candle's, on the CPU. It prints how far the NPU's outputs are from candle's CPU, and fails beyond 3%
//! (W8A8: `tests/nn.rs` says why).
//!
//! ```text
//! cargo run --release --example own_model [-- --executor host|htp-model|hexagon --rows 300]
//! ```
use std::collections::HashMap;

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{layer_norm, LayerNorm, VarBuilder};
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Where the NPU layers run: this crate's host executor, the host computing as the HTP does,
    /// or the HTP library (the x86 emulator here, the NPU on a phone).
    #[arg(long, value_enum, default_value = "host")]
    executor: Executor,
    /// Rows (tokens) of the input compared.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..=4096))]
    rows: u32,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Executor {
    Host,
    HtpModel,
    Hexagon,
}

const DIM: usize = 128;
const HEADS: usize = 4;
const FFN: usize = 384;
const LAYERS: usize = 3;

/// A pre-norm transformer block, generic over its linear layer `L`.
struct Block<L> {
    norm1: LayerNorm,
    qkv: L,
    out: L,
    norm2: LayerNorm,
    up: L,
    down: L,
}

impl<L: Module> Block<L> {
    fn new(vb: VarBuilder, linear: &impl Fn(usize, usize, VarBuilder) -> Result<L>) -> Result<Self> {
        Ok(Block {
            norm1: layer_norm(DIM, 1e-5, vb.pp("norm1"))?,
            qkv: linear(DIM, 3 * DIM, vb.pp("qkv"))?,
            out: linear(DIM, DIM, vb.pp("out"))?,
            norm2: layer_norm(DIM, 1e-5, vb.pp("norm2"))?,
            up: linear(DIM, FFN, vb.pp("up"))?,
            down: linear(FFN, DIM, vb.pp("down"))?,
        })
    }

    /// `x`: `[tokens, DIM]`; bidirectional attention (an encoder).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (t, hd) = (x.dim(0)?, DIM / HEADS);
        let qkv = self.qkv.forward(&self.norm1.forward(x)?)?;
        let heads = |i: usize| qkv.narrow(1, i * DIM, DIM)?.reshape((t, HEADS, hd))?.transpose(0, 1)?.contiguous();
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let att = candle_nn::ops::softmax_last_dim(&(q.matmul(&k.t()?)? / (hd as f64).sqrt())?)?;
        let a = att.matmul(&v)?.transpose(0, 1)?.reshape((t, DIM))?;
        let x = (x + self.out.forward(&a)?)?;
        let h = self.up.forward(&self.norm2.forward(&x)?)?.gelu()?;
        Ok((&x + self.down.forward(&h)?)?)
    }
}

struct Model<L> {
    blocks: Vec<Block<L>>,
}

impl<L: Module> Model<L> {
    fn new(vb: VarBuilder, linear: impl Fn(usize, usize, VarBuilder) -> Result<L>) -> Result<Self> {
        Ok(Model { blocks: (0..LAYERS).map(|l| Block::new(vb.pp(format!("blocks.{l}")), &linear)).collect::<Result<_>>()? })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.blocks.iter().try_fold(x.clone(), |x, b| b.forward(&x))
    }
}

/// `n` seeded values in `offset ± scale` (xorshift: the example needs no download and gives the
/// same figures every run).
fn seeded(n: usize, scale: f32, offset: f32, seed: &mut u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            offset + ((*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The model's weights, the norms' gains near 1.
fn weights() -> Result<VarBuilder<'static>> {
    let seed = &mut 0x9E37_79B9_7F4A_7C15u64;
    let mut ts = HashMap::new();
    for l in 0..LAYERS {
        let p = format!("blocks.{l}");
        for (name, out, inp) in [("qkv", 3 * DIM, DIM), ("out", DIM, DIM), ("up", FFN, DIM), ("down", DIM, FFN)] {
            let scale = 1.7 / (inp as f32).sqrt();
            ts.insert(format!("{p}.{name}.weight"), Tensor::from_vec(seeded(out * inp, scale, 0.0, seed), (out, inp), &Device::Cpu)?);
            ts.insert(format!("{p}.{name}.bias"), Tensor::from_vec(seeded(out, 0.02, 0.0, seed), out, &Device::Cpu)?);
        }
        for norm in ["norm1", "norm2"] {
            ts.insert(format!("{p}.{norm}.weight"), Tensor::from_vec(seeded(DIM, 0.1, 1.0, seed), DIM, &Device::Cpu)?);
            ts.insert(format!("{p}.{norm}.bias"), Tensor::from_vec(seeded(DIM, 0.02, 0.0, seed), DIM, &Device::Cpu)?);
        }
    }
    Ok(VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu))
}

/// Token embeddings with a few large channels, as transformers' residual streams have.
fn tokens(rows: usize, seed: u64) -> Result<Tensor> {
    let mut state = 0x2545_F491_4F6C_DD1D ^ (seed + 1).wrapping_mul(0x9E37_79B9);
    let v: Vec<f32> = seeded(rows * DIM, 1.7, 0.0, &mut state).iter().enumerate().map(|(i, v)| if i % DIM % 37 == 5 { 8.0 * v } else { *v }).collect();
    Ok(Tensor::from_vec(v, (rows, DIM), &Device::Cpu)?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let vb = weights()?;
    let cpu = Model::new(vb.clone(), |i, o, vb| Ok(candle_nn::linear(i, o, vb)?))?;

    let device = match args.executor {
        Executor::Host => candle_npu::NpuDevice::host(),
        Executor::HtpModel => candle_npu::NpuDevice::host_with(candle_npu::Numerics::Htp),
        Executor::Hexagon => candle_npu::NpuDevice::hexagon(candle_npu::HtpConfig::default())?,
    };
    let npu = candle_npu::nn::Npu::new(device); // NPU
    let ours = Model::new(vb, |i, o, vb| Ok(npu.linear(i, o, vb)?))?; // NPU: the layers
    for seed in 0..4 {
        // NPU: calibration, the model's own forward on samples
        ours.forward(&tokens(128, seed)?)?; // NPU
    } // NPU
    npu.freeze(candle_npu::ClipMethod::Budget { fraction: 1e-2 })?; // NPU: from here on

    let x = tokens(args.rows as usize, 11)?;
    let (want, got) = (cpu.forward(&x)?, ours.forward(&x)?);
    let scale = want.abs()?.max_keepdim(D::Minus1)?.max(0)?.to_vec1::<f32>()?[0];
    let err = ((&got - &want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?) / scale;
    println!("| executor | rows | layers on the NPU | relative max error vs candle CPU |");
    println!("|---|---|---|---|");
    println!("| {} | {} | {} | {:.2}% |", npu.device().executor_name(), args.rows, 4 * LAYERS, 100.0 * err);
    anyhow::ensure!(err < 3e-2, "the NPU's outputs are {:.2}% from candle's CPU, beyond 3%", 100.0 * err);
    Ok(())
}
