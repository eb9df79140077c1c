//! A candle user's program, run by tests/consumer.rs from a folder with no assets but the model
//! copied there: only the crates' public API (an example sees nothing else), the shipped
//! calibration text, streaming, a session saved and restored, two conversations on one model,
//! and a candle-nn model of its own with its linears on the NPU.
//!
//! ```text
//! cargo run --release --example consumer -- model.gguf
//! ```
use std::io::Write;
use std::path::Path;

use candle_core::{DType, Device, Module, Tensor};
use candle_npu::NpuDevice;
use candle_npu_models::{CalibrationSet, GenerateOptions, LoadOptions, Pipeline};

/// The user's own model, written against candle-nn: generic over its linear layer.
struct Mlp<L> {
    up: L,
    down: L,
}

impl<L: Module> Module for Mlp<L> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.down.forward(&self.up.forward(x)?.silu()?)
    }
}

/// Seeded values in [-scale, scale) (an LCG: no dependency).
fn values(n: usize, scale: f32, seed: &mut u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Its linears moved to the NPU with `candle_npu::nn`: built through an `Npu` from the same
/// `VarBuilder`, observed on sample inputs, frozen; then compared with candle's CPU.
fn own_model_on_the_npu() -> anyhow::Result<f32> {
    let (d, h) = (96, 256);
    let seed = &mut 7u64;
    let mut ts = std::collections::HashMap::new();
    for (name, shape, scale) in [("up.weight", vec![h, d], 0.15f32), ("up.bias", vec![h], 0.1), ("down.weight", vec![d, h], 0.1), ("down.bias", vec![d], 0.1)] {
        ts.insert(name.to_string(), Tensor::from_vec(values(shape.iter().product(), scale, seed), shape, &Device::Cpu)?);
    }
    let vb = candle_nn::VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu);
    let cpu = Mlp { up: candle_nn::linear(d, h, vb.pp("up"))?, down: candle_nn::linear(h, d, vb.pp("down"))? };
    let npu = candle_npu::nn::Npu::new(NpuDevice::host());
    let ours = Mlp { up: npu.linear(d, h, vb.pp("up"))?, down: npu.linear(h, d, vb.pp("down"))? };
    for _ in 0..4 {
        ours.forward(&Tensor::from_vec(values(64 * d, 2.0, seed), (64, d), &Device::Cpu)?)?;
    }
    npu.freeze(candle_npu::ClipMethod::Budget { fraction: 1e-2 })?;
    let x = Tensor::from_vec(values(100 * d, 2.0, seed), (100, d), &Device::Cpu)?;
    let (got, want) = (ours.forward(&x)?.flatten_all()?.to_vec1::<f32>()?, cpu.forward(&x)?.flatten_all()?.to_vec1::<f32>()?);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    Ok(got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale)
}

fn main() -> anyhow::Result<()> {
    let model = std::env::args().nth(1).expect("the model file");
    let device = NpuDevice::host();
    let mut p = Pipeline::load(Path::new(&model), None, &device, LoadOptions { chunk_len: Some(64), ..Default::default() })?;
    // No profile yet: calibrates on the text shipped inside the crate, saves it next to the model.
    p.ensure_profile(None, CalibrationSet::default(), |_, _| {})?;
    let opts = GenerateOptions { sample_len: 16, ..Default::default() };
    let mut streamed = String::new();
    let (answer, _) = p.generate("What is the capital of France?", &opts, |t| {
        streamed += t;
        print!("{t}");
        let _ = std::io::stdout().flush();
    })?;
    println!();
    assert_eq!(streamed, answer);
    println!("ANSWER {answer}");

    // A conversation; its first turn saved, then restored and continued as the live one is.
    let mut s = p.session();
    s.send(&p, "What is the capital of France?", &opts, |_| {})?;
    s.save(&p, Path::new("turn1.kv"))?;
    let kept = s.tokens().len();
    let (live, stats) = s.send(&p, "And of Germany?", &opts, |_| {})?;
    println!("TURN2 new {} cached {}", stats.prompt_tokens, stats.cached_tokens);
    assert!(stats.cached_tokens + 2 >= kept && stats.prompt_tokens < 20);
    let mut restored = p.restore_session(Path::new("turn1.kv"))?;
    let (again, _) = restored.send(&p, "And of Germany?", &opts, |_| {})?;
    assert_eq!(again, live);
    // Two conversations on the one loaded model, each with its own cache.
    let mut other = p.session();
    let (a, _) =
        other.chat(&p, &[candle_npu_models::Message::system("Answer in one word."), candle_npu_models::Message::user("Capital of Italy?")], &opts, |_| {})?;
    let (b, _) = s.send(&p, "And of Spain?", &opts, |_| {})?;
    println!("TWO SESSIONS {a:?} / {b:?}");
    println!("RESTORED same answer");
    println!("OWN MODEL relative max error {:.4}", own_model_on_the_npu()?);
    Ok(())
}
