//! Prefill on the NPU (or its host INT8 executor), decode on candle's CPU path.
//!
//! ```text
//! cargo run --release --example llama -- --prompt "The capital of France is"
//! ```
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_npu::NpuDevice;
use candle_npu_models::{CalibrationSet, DecodeWeights, LoadOptions, Pipeline, Precision};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ExecutorKind {
    Host,
    Hexagon,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Which {
    /// SmolLM2-135M-Instruct (fetched by scripts/setup.sh).
    Smollm2_135m,
}

#[derive(Parser, Debug)]
#[command(about = "candle-npu: NPU prefill + CPU decode for Llama-family GGUF models")]
struct Args {
    /// Local GGUF file; default: the model chosen by --which, from the assets folder.
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "smollm2-135m")]
    which: Which,
    /// tokenizer.json to use instead of the GGUF's own tokenizer.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    #[arg(long, default_value = "The capital of France is")]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, short = 'n', default_value_t = 64)]
    sample_len: usize,
    /// Sampling temperature; greedy when absent.
    #[arg(long)]
    temperature: Option<f64>,
    #[arg(long)]
    top_p: Option<f64>,
    #[arg(long, default_value_t = 299792458)]
    seed: u64,
    /// Rows of the static NPU graphs; the prompt is cut into chunks of this length.
    #[arg(long, default_value_t = 256)]
    chunk_len: usize,
    #[arg(long, value_enum, default_value = "host")]
    executor: ExecutorKind,
    /// Use the prompt as is, without the model's chat template.
    #[arg(long)]
    no_chat_template: bool,
    /// Float prefill (no quantization), e.g. to compare against W8A8.
    #[arg(long)]
    f32_prefill: bool,
    /// Quant profile file (default: next to the model; calibrated and saved when missing).
    #[arg(long)]
    profile: Option<PathBuf>,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let device = match args.executor {
        ExecutorKind::Host => NpuDevice::host(),
        ExecutorKind::Hexagon => NpuDevice::hexagon(candle_npu::HtpConfig::default())
            .context("starting the Hexagon executor (run scripts/setup.sh, or set CANDLE_NPU_QNN_LIB_DIR)")?,
    };
    let path = args.model.clone().unwrap_or_else(|| match args.which {
        Which::Smollm2_135m => candle_npu_models::assets::smollm2(),
    });
    if !path.exists() {
        bail!("model file {} not found: run scripts/setup.sh, or pass --model", path.display());
    }
    let opts = LoadOptions {
        precision: if args.f32_prefill { Precision::F32 } else { Precision::W8A8 },
        decode_weights: DecodeWeights::Q8_0,
    };
    let t = Instant::now();
    let mut p = Pipeline::load(&path, args.tokenizer.as_deref(), &device, opts).with_context(|| format!("loading {}", path.display()))?;
    eprintln!("loaded {} in {:.1}s ({} executor)", path.display(), t.elapsed().as_secs_f32(), device.executor_name());

    let bar = indicatif::ProgressBar::hidden();
    p.ensure_profile(args.profile.as_deref(), args.chunk_len, CalibrationSet::default(), |i, n| {
        if bar.is_hidden() {
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
            bar.set_length(n as u64);
            bar.set_message("calibrating activation ranges on Wikipedia text");
        }
        bar.set_position(i as u64);
    })?;
    bar.finish_and_clear();

    let tokens = p.encode(&args.prompt, !args.no_chat_template)?;
    let mut sampler = LogitsProcessor::from_sampling(
        args.seed,
        match (args.temperature, args.top_p) {
            (None, _) => Sampling::ArgMax,
            (Some(temperature), None) => Sampling::All { temperature },
            (Some(temperature), Some(p)) => Sampling::TopP { p, temperature },
        },
    );

    let t = Instant::now();
    p.model.prepare(args.chunk_len)?;
    eprintln!("prepared NPU graphs for chunk length {} in {:.2}s", args.chunk_len, t.elapsed().as_secs_f32());
    let before = device.stats();
    let t = Instant::now();
    let logits = p.model.prefill(&tokens, args.chunk_len)?;
    let prefill_s = t.elapsed().as_secs_f64();
    let prefill_stats = device.stats();
    let mut next = sampler.sample(&logits)?;
    if args.no_chat_template {
        print!("{}", args.prompt);
    } else {
        println!("> {}", args.prompt);
    }
    let mut generated = vec![next];
    let mut printed = 0;
    let t = Instant::now();
    while generated.len() < args.sample_len && !p.stop_tokens.contains(&next) {
        let text = p.decode_text(&generated)?;
        print!("{}", &text[printed..]);
        printed = text.len();
        std::io::stdout().flush()?;
        next = sampler.sample(&p.model.decode(next)?)?;
        generated.push(next);
    }
    let decode_s = t.elapsed().as_secs_f64();
    let body: Vec<u32> = generated.iter().copied().filter(|t| !p.stop_tokens.contains(t)).collect();
    let text = p.decode_text(&body)?;
    println!("{}", text.get(printed..).unwrap_or(""));
    println!(
        "\n{} prompt tokens processed: {:.2} token/s ({} chunks of {}, {} graphs prepared, {} executed)",
        tokens.len(),
        tokens.len() as f64 / prefill_s,
        tokens.len().div_ceil(args.chunk_len),
        args.chunk_len,
        prefill_stats.graphs_prepared - before.graphs_prepared,
        prefill_stats.executions - before.executions
    );
    let decoded = generated.len().saturating_sub(1);
    println!("{decoded} tokens generated: {:.2} token/s", decoded as f64 / decode_s.max(1e-9));
    Ok(())
}
