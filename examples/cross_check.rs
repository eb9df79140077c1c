//! One greedy generation recorded on one machine and checked on another: the aarch64 build
//! under qemu against the x86_64 build (`scripts/aarch64.sh`, CI).
//!
//! ```text
//! cargo run --release --example cross_check -- --record x86.json        # calibrates if needed
//! qemu-aarch64-static .../cross_check --check x86.json                  # never calibrates
//! ```
//!
//! The model (SmolLM2 by default) runs W8A8 prefill on the host executor and decode on the CPU,
//! greedy, and the record holds the prompt's tokens, the generated tokens and the logits of every
//! step (the prefill's last row, then each decode step). `--check` runs the same generation and
//! fails unless every token is the record's and every step's logits are within `--tolerance` of
//! the record's, relative to the step's largest logit (see `DEFAULT_TOLERANCE` for why that
//! bound). The profile must exist already: qemu runs at a few percent of native speed, and
//! calibrating there would only repeat the native calibration slower.
use std::path::PathBuf;

use anyhow::{bail, ensure, Context, Result};
use candle_npu::NpuDevice;
use candle_npu_models::{CalibrationSet, LoadOptions, Pipeline};
use clap::Parser;
use serde::{Deserialize, Serialize};

/// The largest difference of a step's logits from the record's, relative to its largest
/// logit, that `--check` accepts.
///
/// The integer work is exact on both sides (the INT8 GEMM is tested bit for bit on every path),
/// so the difference comes from float work done in another order: the decode kernels' sums (each
/// within `(K / 32 + 10) * 2^-23` of the sum of its absolute terms, their tests), attention's and
/// the norms' lane sums, `exp`. Those are ulp-level per op; what makes them visible is the 8-bit
/// quantizers between the stages: a value on a rounding boundary can land one step (1/255 of its
/// clip range) apart on the two machines, and that step then travels through the later layers.
/// Measured on SmolLM2 (2026-11-26, qemu `max` against x86_64, 16 steps): see docs/aarch64.md.
/// 1% keeps a margin over it and is still far below what a wrong kernel gives (a wrong block
/// or lane moves logits by tens of percent and changes the tokens).
const DEFAULT_TOLERANCE: f32 = 0.01;

#[derive(Parser)]
#[command(about = "Record a greedy generation, or check one against a record")]
struct Args {
    /// The model (GGUF or HF folder); default SmolLM2 from scripts/setup.sh.
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, default_value = "What is the capital of France?")]
    prompt: String,
    #[arg(long, default_value_t = 16)]
    sample_len: usize,
    /// Write the record here.
    #[arg(long, conflicts_with = "check")]
    record: Option<PathBuf>,
    /// Compare with this record.
    #[arg(long)]
    check: Option<PathBuf>,
    /// See `DEFAULT_TOLERANCE`.
    #[arg(long, default_value_t = DEFAULT_TOLERANCE)]
    tolerance: f32,
}

#[derive(Serialize, Deserialize)]
struct Record {
    arch: String,
    prompt: String,
    prompt_tokens: Vec<u32>,
    tokens: Vec<u32>,
    /// One row per step: the logits the step's token was chosen from.
    logits: Vec<Vec<f32>>,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into())).init();
    let args = Args::parse();
    ensure!(args.record.is_some() || args.check.is_some(), "pass --record FILE or --check FILE");
    let expected: Option<Record> = match &args.check {
        Some(p) => Some(serde_json::from_slice(&std::fs::read(p).with_context(|| format!("reading {}", p.display()))?).with_context(|| format!("parsing {}", p.display()))?),
        None => None,
    };
    let path = args.model.clone().unwrap_or_else(candle_npu_models::assets::smollm2);
    let device = NpuDevice::host();
    let mut p = Pipeline::load(&path, None, &device, LoadOptions::default()).with_context(|| format!("loading {}", path.display()))?;
    if expected.is_some() {
        let profile = candle_npu::quant::QuantProfile::default_path(&path);
        ensure!(profile.exists(), "{} is missing: run --record on a native build first (it calibrates)", profile.display());
    }
    p.ensure_profile(None, CalibrationSet::default(), |_, _| {})?;
    let (prompt, sample_len) = match &expected {
        Some(r) => (r.prompt.clone(), r.tokens.len()),
        None => (args.prompt.clone(), args.sample_len),
    };
    let prompt_tokens = p.encode(&prompt, true)?;
    if let Some(r) = &expected {
        ensure!(prompt_tokens == r.prompt_tokens, "the prompt's tokens differ from the record's: {prompt_tokens:?} against {:?}", r.prompt_tokens);
    }
    let mut logits = vec![p.model.prefill(&prompt_tokens)?.to_vec1::<f32>()?];
    let mut tokens = Vec::with_capacity(sample_len);
    while tokens.len() < sample_len && tokens.len() < logits.len() {
        let last = logits.last().expect("the prefill's row");
        let next = last.iter().enumerate().fold(0, |best, (i, &v)| if v > last[best] { i } else { best }) as u32;
        tokens.push(next);
        if let Some(r) = &expected {
            check_step(r, tokens.len() - 1, next, last, args.tolerance)?;
        }
        if tokens.len() < sample_len && !p.stop_tokens.contains(&next) {
            logits.push(p.model.decode(next)?.to_vec1::<f32>()?);
        }
    }
    let record = Record { arch: std::env::consts::ARCH.into(), prompt, prompt_tokens, tokens, logits };
    println!("{}: {:?}", record.arch, p.decode_text(&record.tokens)?);
    if let Some(r) = &expected {
        let worst = record.logits.iter().zip(&r.logits).map(|(a, b)| relative_diff(a, b)).fold(0f32, f32::max);
        println!("{} tokens equal to the {} record's; logits within {worst:.2e} of its (relative to each step's largest; tolerance {:.0e})", r.tokens.len(), r.arch, args.tolerance);
    }
    if let Some(out) = &args.record {
        let bytes = serde_json::to_vec(&record)?;
        candle_npu::cache::write_atomic(out, |w| std::io::Write::write_all(w, &bytes))?;
        println!("recorded {} steps in {}", record.tokens.len(), out.display());
    }
    Ok(())
}

/// The largest `|a - b|` over the largest `|b|`.
fn relative_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn check_step(r: &Record, step: usize, token: u32, logits: &[f32], tolerance: f32) -> Result<()> {
    let want = &r.logits[step];
    if logits.len() != want.len() {
        bail!("step {step}: {} logits against the record's {}", logits.len(), want.len());
    }
    let d = relative_diff(logits, want);
    if token != r.tokens[step] || !(d <= tolerance) {
        bail!("step {step}: token {token} (record: {}), logits {d:.2e} from the record's (tolerance {tolerance:.0e})", r.tokens[step]);
    }
    Ok(())
}
