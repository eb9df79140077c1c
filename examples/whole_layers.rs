//! Issue 48's plan (each decoder layer one graph: `Model::layer_graph`) beside llm.npu's (four
//! stage graphs per layer, the CPU between them), on one executor: graph launches per chunk,
//! prefill time, and the last token's logits against the F32 four-stage prefill on the host.
//!
//! ```text
//! cargo run --release --example whole_layers -- --executor hexagon --tokens 64
//! ```
//! `--prepare-only --soc 69` finalizes the device's default plan's graphs for that SoC instead.
//! On x86 `hexagon` is Qualcomm's emulator: its times are not a phone's (the phone model,
//! `examples/sched.rs --sections phone`, prices the plans); its numerics are the HTP's.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use candle_npu::{HtpConfig, NpuDevice, Numerics, Tail};
use candle_npu_models::logits::argmax;
use candle_npu_models::PrefillOptions;
use candle_npu_models::{assets, CalibrationSet, DecodeWeights, LoadOptions, Pipeline, Precision, PrefillPlan, SchedOptions};
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ExecutorKind {
    Host,
    Hexagon,
    /// The host executor with the HTP library's numerics.
    HtpModel,
}

#[derive(Parser, Debug)]
struct Args {
    /// A GGUF of a supported family (default: SmolLM2-135M-Instruct from scripts/setup.sh).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "host")]
    executor: ExecutorKind,
    /// Held-out Wikipedia tokens in the prompt.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Rows of every graph (the prompt's last chunk padded).
    #[arg(long, default_value_t = 32)]
    chunk_len: usize,
    /// The SoC the Hexagon executor finalizes for (QNN's SoC model: 57 is the Snapdragon 8
    /// Gen 3, 69 the 8 Elite).
    #[arg(long, default_value_t = 57)]
    soc: u32,
    /// Only prepare (finalize) the device's default plan's graphs for a first chunk, and say how
    /// many were prepared on the executor and how many fell back to the host; no table.
    #[arg(long)]
    prepare_only: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let path = args.model.clone().unwrap_or_else(assets::smollm2);
    let device = match args.executor {
        ExecutorKind::Host => NpuDevice::host(),
        ExecutorKind::Hexagon => NpuDevice::hexagon(HtpConfig { soc_model: args.soc, cache_dir: None, ..Default::default() })?,
        ExecutorKind::HtpModel => NpuDevice::host_with(Numerics::Htp),
    };
    let load = |dev: &NpuDevice, precision: Precision| {
        Pipeline::load(&path, None, dev, LoadOptions { precision: Some(precision), decode_weights: DecodeWeights::Q8_0, ..Default::default() })
    };
    if args.prepare_only {
        let precision = Precision::for_device(&device);
        let mut p = load(&device, precision)?;
        p.ensure_profile(None, CalibrationSet::default(), |_, _| {})?;
        p.model.set_chunk_len(args.chunk_len)?;
        let t = Instant::now();
        p.model.prepare()?;
        let s = device.stats();
        println!(
            "{}: {precision:?}, {:?} plan, chunks of {}, SoC {}: {} graphs prepared on {} in {:.1} s, {} fallbacks to the host",
            path.file_name().unwrap_or_default().to_string_lossy(),
            p.model.sched().plan,
            args.chunk_len,
            args.soc,
            s.graphs_prepared,
            device.executor_name(),
            t.elapsed().as_secs_f64(),
            s.fallbacks
        );
        return Ok(());
    }
    let mut reference = load(&NpuDevice::host(), Precision::F32)?;
    let prompt = reference.heldout_tokens(args.tokens)?;
    let want: Vec<f32> = reference.model.prefill(&prompt, &PrefillOptions::chunked(args.chunk_len))?.to_vec1()?;
    let n_layer = reference.model.config().n_layer;
    drop(reference);
    let top = |v: &[f32]| -> Result<u32> { Ok(argmax(&candle_core::Tensor::new(v, &candle_core::Device::Cpu)?)?) };
    let want_top = top(&want)?;
    println!(
        "{}, {} tokens in chunks of {} ({} chunks), executor {:?}; against the F32 four-stage prefill on the host\n",
        path.file_name().unwrap_or_default().to_string_lossy(),
        prompt.len(),
        args.chunk_len,
        prompt.len().div_ceil(args.chunk_len),
        args.executor
    );
    println!("| plan | graphs per chunk | CPU steps between graphs per chunk | prefill s | max abs logit diff / max abs logit | top token the reference's |\n|---|---|---|---|---|---|");
    let plans = [
        ("four stages, shadow W8A8 (llm.npu's; the host's default)", false, Precision::W8A8),
        ("four stages, W8A16", false, Precision::W8A16),
        ("four stages, shadow W8A16", false, Precision::W8A16Shadow),
        ("one graph per layer, F32", true, Precision::F32),
        ("one graph per layer, W8A16", true, Precision::W8A16),
        ("one graph per layer, shadow W8A16, outliers through float weights (the HTP's default)", true, Precision::W8A16Shadow),
    ];
    let mut profile = None;
    for (label, whole, precision) in plans {
        let mut p = load(&device, precision)?;
        if precision != Precision::F32 {
            match &profile {
                Some(prof) => p.model.set_profile(Clone::clone(prof))?,
                None => {
                    p.ensure_profile(None, CalibrationSet::default(), |_, _| {})?;
                    profile = p.model.profile().cloned();
                }
            }
        }
        // Every row on the NPU's graphs, as the whole-layer plan runs them.
        let plan = if whole { PrefillPlan::Layers } else { PrefillPlan::Stages };
        p.model.set_sched(SchedOptions { tail: Tail::Pad, plan, ..Default::default() })?;
        let t = Instant::now();
        let got: Vec<f32> = p.model.prefill(&prompt, &PrefillOptions::chunked(args.chunk_len))?.to_vec1()?;
        let secs = t.elapsed().as_secs_f64();
        let max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let (graphs, cpu) = if whole { (n_layer, 0) } else { (4 * n_layer, 4 * n_layer) };
        println!("| {label} | {graphs} | {cpu} | {secs:.1} | {:.2e} | {} |", diff / max, top(&got)? == want_top);
    }
    Ok(())
}
