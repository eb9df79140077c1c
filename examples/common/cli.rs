//! The command line every family example shares (`examples/<family>.rs` is one call to [`run`]):
//! candle's conventions (`--prompt`, `--sample-len`, `--temperature`, `--seed`, `--which`,
//! `--model-id`), the NPU device, calibration on first use, prefill on the NPU, decode on the
//! CPU, and a report of speed and memory.
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_npu::sched::{Policy, Processor, Trace};
use candle_npu::{Contexts, HtpConfig, NpuDevice, ProfilingLevel, Tail, WeightQuant};
use candle_npu_models::pipeline::{default_profile_path, MAX_THREADS_PER_CORE};
use candle_npu_models::{
    CalibrationSet, DecodeWeights, GenerateOptions, KvType, LoadOptions, Message, Pipeline, Precision, PrefillPlan, SchedOptions, StopReason,
};
use clap::{Parser, ValueEnum};

/// The allocator that bounds the memory a model's chat template may take while it renders
/// (`candle_npu_models::sandbox`): a template comes with a downloaded file.
#[global_allocator]
static ALLOC: candle_npu_models::sandbox::GuardedAlloc = candle_npu_models::sandbox::GuardedAlloc;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ExecutorKind {
    Host,
    Hexagon,
    /// The host executor with the HTP library's numerics: what `hexagon` computes, at host speed.
    HtpModel,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum QnnProfile {
    Basic,
    Detailed,
}

/// How the stage graphs are held in QNN contexts (see `candle_npu::Contexts`).
#[derive(Clone, Copy, Debug, ValueEnum)]
enum QnnContexts {
    #[value(name = "per-graph")]
    Graph,
    #[value(name = "per-size")]
    Size,
    #[value(name = "per-model")]
    Model,
}

/// The KV cache's type (see `KvType`).
#[derive(Clone, Copy, Debug, ValueEnum)]
enum KvArg {
    F32,
    F16,
    Q8,
}

/// Weights of the CPU decode path (see `DecodeWeights`).
#[derive(Clone, Copy, Debug, ValueEnum)]
enum DecodeFormat {
    /// The NPU's INT8 weights as Q8_0 blocks: one copy for prefill and decode.
    #[value(name = "q8_0")]
    Q8_0,
    /// The checkpoint's own blocks (a GGUF's Q4_1, Q5_0, k-quants), read mapped; the INT8
    /// weights are then held apart for the NPU graphs.
    Checkpoint,
}

/// Which ready prefill stage a free processor runs next (`Policy`; `examples/sched.rs` compares them).
#[derive(Clone, Copy, Debug, ValueEnum)]
enum PolicyArg {
    InOrder,
    Fifo,
    Contribution,
    CriticalPath,
}

/// Prompt tokens that do not fill a last chunk (`Tail`).
#[derive(Clone, Copy, Debug, ValueEnum)]
enum TailArg {
    /// Padded to a whole chunk on the NPU.
    Pad,
    /// Run on the CPU beside the NPU's chunks (HeteroLLM's margin).
    Margin,
}

/// What one NPU graph holds (`PrefillPlan`).
#[derive(Clone, Copy, Debug, ValueEnum)]
enum PlanArg {
    /// llm.npu's: four graphs of linears per layer, the CPU between them.
    Stages,
    /// One graph per layer: norms, RoPE, attention and the FFN on the NPU (shadow W8A16, its
    /// outliers through float weights in the graph; docs/npu_layers.md).
    Layers,
}

/// The real models scripts/setup.sh fetches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Which {
    /// SmolLM2-135M-Instruct (Llama).
    Smollm2_135m,
    /// Qwen2.5-Coder-0.5B-Instruct (Qwen2).
    #[value(name = "qwen2.5-coder-0.5b")]
    Qwen25Coder05b,
    /// Gemma 3 270M (base).
    Gemma3_270m,
}

impl Which {
    fn family(self) -> &'static str {
        match self {
            Which::Smollm2_135m => "llama",
            Which::Qwen25Coder05b => "qwen2",
            Which::Gemma3_270m => "gemma3",
        }
    }
    fn path(self) -> Result<PathBuf> {
        Ok(match self {
            Which::Smollm2_135m => candle_npu_models::assets::smollm2(),
            Which::Qwen25Coder05b => candle_npu_models::assets::qwen25_coder_05b()?,
            Which::Gemma3_270m => candle_npu_models::assets::gemma3_270m()?,
        })
    }
}

#[derive(Parser, Debug)]
#[command(about = "candle-npu: NPU prefill + CPU decode")]
struct Args {
    /// Local GGUF file or HF folder (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    model: Option<PathBuf>,
    /// `org/name` in the local hf-hub cache ($HF_HOME/hub); never downloaded.
    #[arg(long)]
    model_id: Option<String>,
    /// A model fetched by scripts/setup.sh (default: this family's).
    #[arg(long, value_enum)]
    which: Option<Which>,
    /// tokenizer.json to use instead of the GGUF's own tokenizer.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The first turn (default: "What is the capital of France?", or with `--interactive` the
    /// first line typed).
    #[arg(long)]
    prompt: Option<String>,
    /// Tokens to generate (0: the prefill alone, e.g. to time it).
    #[arg(long, short = 'n', default_value_t = 64)]
    sample_len: usize,
    /// Sampling temperature, >= 0; greedy when absent or 0.
    #[arg(long, value_parser = temperature, allow_hyphen_values = true)]
    temperature: Option<f64>,
    /// Nucleus sampling: the smallest set of tokens holding this probability, in (0, 1].
    #[arg(long, value_parser = top_p, requires = "temperature")]
    top_p: Option<f64>,
    /// Sample among the k most likely tokens only.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), requires = "temperature")]
    top_k: Option<u32>,
    /// Penalty on the logits of the last `--repeat-last-n` tokens (1: none), in [0.01, 100].
    #[arg(long, default_value_t = 1.0, value_parser = repeat_penalty)]
    repeat_penalty: f32,
    /// How many of the conversation's last tokens the repeat penalty looks at.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    /// Speculative decoding by prompt lookup: tokens that followed an earlier occurrence of the
    /// last few are verified several per pass (the same output, faster where the answer copies
    /// the prompt).
    #[arg(long)]
    lookup: bool,
    /// Where `--lookup`'s verification passes run: `cpu` (the decode kernels: the same output as
    /// plain decoding) or `npu` (the NPU's stage graphs, one padded chunk per pass: the NPU's
    /// W8A8 rows, nearly free on a phone's NPU; slow on the x86 emulator).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "npu"])]
    verify: String,
    /// Speculative decoding with a draft model: a smaller model of the same tokenizer (a GGUF
    /// file or an HF folder) proposes its greedy tokens, run on the CPU (the same output).
    #[arg(long, conflicts_with = "lookup")]
    draft_model: Option<PathBuf>,
    /// The draft is the model's own first N layers (of `--draft-model`, else of the model).
    #[arg(long, conflicts_with = "lookup", value_parser = clap::value_parser!(u32).range(1..))]
    draft_layers: Option<u32>,
    /// A system prompt, before the prompt (in the model's chat template).
    #[arg(long, conflicts_with_all = ["no_chat_template", "load_session"])]
    system: Option<String>,
    /// After the answer, read further turns from stdin, one a line (an empty line or end of
    /// input ends the conversation); each prefills only its own tokens.
    #[arg(long)]
    interactive: bool,
    /// Go on from a conversation saved with `--save-session` (its KV cache restored: the
    /// prompt prefills only its own tokens).
    #[arg(long)]
    load_session: Option<PathBuf>,
    /// Save the conversation and its KV cache at the end (for `--load-session`).
    #[arg(long)]
    save_session: Option<PathBuf>,
    #[arg(long, default_value_t = 299792458)]
    seed: u64,
    /// Rows of the static NPU graphs; the prompt is cut into chunks of this length. Default:
    /// 256, except 32 for `--executor hexagon` on x86, where the HTP is an emulator (~0.3-1
    /// GMAC/s: a 32-row chunk of SmolLM2 takes 30-70 s there, a 256-row one minutes).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=MAX_CHUNK_LEN as i64))]
    chunk_len: Option<u32>,
    #[arg(long, value_enum, default_value = "host")]
    executor: ExecutorKind,
    /// Use the prompt as is, without the model's chat template.
    #[arg(long)]
    no_chat_template: bool,
    /// Control tokens spelled in the prompt (`<|im_end|>`, `<start_of_turn>`) become those
    /// tokens. Without it they are plain text: only the chat template's markers are control
    /// tokens, so a prompt cannot end its turn and write the assistant's.
    #[arg(long)]
    parse_special: bool,
    /// Float prefill (no quantization), e.g. to compare against the 8-bit prefill.
    #[arg(long, conflicts_with = "u16_activations")]
    f32_prefill: bool,
    /// u16 activations over the clip ranges, outliers still on the CPU's shadow path (W8A16
    /// with shadow: chat answers closer to F32's, twice the host's GEMM work; docs/chat.md).
    #[arg(long)]
    u16_activations: bool,
    /// Linears whose NPU weight is INT8 plus an INT8 residual (about INT16's error, twice the
    /// bytes and MACs; docs/npu_weights.md), e.g. `attn_q,attn_k,attn_v` (in every layer) or
    /// `blk.3.ffn_down` (one layer's).
    #[arg(long, value_delimiter = ',')]
    residual: Vec<String>,
    /// Linears whose NPU weight is 4-bit LPBQ (half INT8's bytes; needs `--u16-activations` or
    /// the HTP's default plan; requantized from a 4-bit file it costs perplexity:
    /// docs/npu_weights.md), named as for `--residual`, or `all`.
    #[arg(long, value_delimiter = ',')]
    lpbq: Vec<String>,
    /// Weights of the CPU decode path (docs/memory.md, "Decode weights", has the measurements).
    #[arg(long, value_enum, default_value = "checkpoint")]
    decode_weights: DecodeFormat,
    /// How the KV cache holds keys and values: f16 (llama.cpp's default, half of f32's memory),
    /// f32, or q8 (llama.cpp's q8_0 blocks, about a quarter of f32's) (docs/memory.md).
    #[arg(long, value_enum, default_value = "f16")]
    kv_cache: KvArg,
    /// Quant profile file (default: next to the model; calibrated and saved when missing).
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Hexagon SoC model (QNN_SOC_MODEL_*): 57 = SM8650 (default), 43 = SM8550, 69 = SM8750,
    /// 87 = SM8850. Must match the phone; on x86 it selects what the emulator emulates.
    #[arg(long, default_value_t = 57)]
    soc: u32,
    /// Folder of the prepared-graph cache (QNN context binaries); default: the library's,
    /// $CANDLE_NPU_CACHE_DIR or ~/.cache/candle-npu/graphs.
    #[arg(long)]
    graph_cache: Option<PathBuf>,
    /// Finalize every NPU graph, without reading or writing the prepared-graph cache.
    #[arg(long)]
    no_graph_cache: bool,
    /// QNN profiling of every graph; prints the graphs' finalize/load and execute times.
    #[arg(long, value_enum)]
    qnn_profile: Option<QnnProfile>,
    /// QNN contexts of the stage graphs (default: per-model with weight sharing, per-size
    /// without).
    #[arg(long, value_enum)]
    qnn_contexts: Option<QnnContexts>,
    /// The HTP's weight sharing across graph sizes (default: on, except on x86, whose emulator
    /// cannot load a weight-shared context back). Needs HTP v73+ (SM8550 on).
    #[arg(long)]
    weight_sharing: Option<bool>,
    /// Prefill scheduling policy (default: the model's, `SchedOptions::default`).
    #[arg(long, value_enum)]
    policy: Option<PolicyArg>,
    /// What to do with the tokens that do not fill a last chunk (default: the model's).
    #[arg(long, value_enum)]
    tail: Option<TailArg>,
    /// What one NPU graph holds (default: the device's, `SchedOptions::for_device`: layers on
    /// the HTP and its numerics model, stages on the host executor). `layers` prefills with u16
    /// activations (shadow W8A16), or in float with --f32-prefill; `stages` with W8A8.
    #[arg(long, value_enum)]
    plan: Option<PlanArg>,
    /// Threads of the NPU queue (with the host executor: its GEMMs' share of the cores).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=256))]
    npu_threads: Option<u16>,
    /// Write the prefill's schedule as a Chrome/Perfetto trace (JSON; one track per processor).
    #[arg(long)]
    trace: Option<PathBuf>,
}

/// The longest static graph a chunk may have: beyond it a chunk's activations alone take
/// hundreds of MB, and no NPU takes it.
const MAX_CHUNK_LEN: u32 = 8192;

fn temperature(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(t) if t.is_finite() && t >= 0.0 => Ok(t),
        _ => Err(format!("'{s}' is not a temperature: a number >= 0 (0: greedy)")),
    }
}

fn repeat_penalty(s: &str) -> std::result::Result<f32, String> {
    match s.parse::<f32>() {
        Ok(r) if (0.01..=100.0).contains(&r) => Ok(r),
        _ => Err(format!("'{s}' is not a repeat penalty: a number in [0.01, 100] (1: none)")),
    }
}

fn top_p(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        // candle's sampler compares in f32: a top-p that rounds to 0 there would keep no token.
        Ok(p) if p as f32 > 0.0 && p <= 1.0 => Ok(p),
        _ => Err(format!("'{s}' is not a top-p: a probability in (0, 1], at least {:e}", f32::MIN_POSITIVE)),
    }
}

/// A family's example: `family` is the spec name the loaded model must have, `default` the
/// model used when neither --model, --model-id nor --which is given (`None`: one is required).
/// `RAYON_NUM_THREADS` as given, unless beyond [`MAX_THREADS_PER_CORE`]: then one thread per
/// core, and a note says so. Set in the environment, which both the pool and candle's kernels
/// read, first thing (no other thread runs yet).
fn cap_threads() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let asked = std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.trim().parse::<usize>().ok());
    if let Some(n) = asked.filter(|&n| n > MAX_THREADS_PER_CORE * cores) {
        std::env::set_var("RAYON_NUM_THREADS", cores.to_string());
        eprintln!("RAYON_NUM_THREADS={n} is more than {MAX_THREADS_PER_CORE} threads per core on {cores} cores: {cores} threads are taken");
    }
}

pub fn run(family: &str, default: Option<Which>) -> Result<()> {
    cap_threads();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    // The prefill's chunk workers share one heap arena (see the function for why).
    candle_npu_models::memory::limit_malloc_arenas(1);
    // Output paths, checked before the model loads and the minutes of work they come after: a
    // regular file or nothing there (never a folder, link or device), in an existing folder.
    if let Some(trace) = &args.trace {
        candle_npu::fs::check_output_path(trace, "--trace")?;
    }
    if let Some(out) = &args.save_session {
        candle_npu::fs::check_output_path(out, "--save-session")?;
    }
    if let Some(dir) = &args.graph_cache {
        if candle_npu::fs::exists(dir)? && !dir.is_dir() {
            bail!("--graph-cache {}: not a folder (the prepared-graph cache is a folder of files)", dir.display());
        }
    }
    // A profile is read when it exists (a regular file, or a link to one), written when not.
    if let Some(p) = &args.profile {
        match candle_npu::fs::exists(p)? {
            true if !p.is_file() => bail!("--profile {}: not a regular file", p.display()),
            false => candle_npu::fs::check_output_path(p, "--profile")?,
            true => {}
        }
    }
    let device = match args.executor {
        ExecutorKind::Host => NpuDevice::host(),
        ExecutorKind::HtpModel => NpuDevice::host_with(candle_npu::Numerics::Htp),
        ExecutorKind::Hexagon => {
            let cache = match (args.no_graph_cache, &args.graph_cache) {
                (true, _) => None,
                (false, Some(dir)) => Some(dir.clone()),
                (false, None) => candle_npu::cache::default_dir(),
            };
            let config = HtpConfig {
                soc_model: args.soc,
                cache_dir: cache,
                profiling: args.qnn_profile.map(|p| match p {
                    QnnProfile::Basic => ProfilingLevel::Basic,
                    QnnProfile::Detailed => ProfilingLevel::Detailed,
                }),
                contexts: args.qnn_contexts.map(|c| match c {
                    QnnContexts::Graph => Contexts::PerGraph,
                    QnnContexts::Size => Contexts::PerGraphSize,
                    QnnContexts::Model => Contexts::PerModel,
                }),
                weight_sharing: args.weight_sharing.unwrap_or(HtpConfig::default().weight_sharing),
                ..Default::default()
            };
            NpuDevice::hexagon(config).context("starting the Hexagon executor (run scripts/setup.sh, or set CANDLE_NPU_QNN_LIB_DIR)")?
        }
    };
    // Unless given, the model's default for the device (`default_chunk_len`); an error about it
    // says whether the user gave it.
    let chunk_len = args.chunk_len.map(|c| c as usize);
    let chunk_said = match chunk_len {
        Some(c) => format!("--chunk-len {c}"),
        None => format!("the default chunk length {}", candle_npu_models::transformer::default_chunk_len(&device)),
    };
    let path = match (&args.model, &args.model_id, args.which.or(default)) {
        (Some(p), _, _) => p.clone(),
        (None, Some(id), _) => candle_npu_models::hf::resolve_model_id(id, None)?,
        (None, None, Some(w)) if w.family() == family => w.path()?,
        (None, None, Some(w)) => bail!(
            "--which {} is a {} model: use --example {}",
            w.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default(),
            w.family(),
            w.family()
        ),
        (None, None, None) => bail!("no {family} weights are fetched by scripts/setup.sh: pass --model <GGUF or HF folder> or --model-id org/name"),
    };
    if !candle_npu::fs::exists(&path)? {
        bail!("model {} not found: run scripts/setup.sh, or pass --model", path.display());
    }
    // An output that is one of the run's inputs would destroy it: refused before anything loads.
    // Every file the run reads, in one list: the model (a folder holds its tokenizer and
    // template), the profile it uses (given, else the one next to the model, read or written),
    // the tokenizer, the draft model and the conversation it goes on with.
    let profile = args.profile.clone().unwrap_or_else(|| default_profile_path(&path));
    let reads: Vec<&std::path::Path> =
        [Some(path.as_path()), Some(profile.as_path()), args.tokenizer.as_deref(), args.draft_model.as_deref()].into_iter().flatten().collect();
    if let Some(trace) = &args.trace {
        let also: Vec<&std::path::Path> = args.load_session.as_deref().into_iter().collect();
        candle_npu::fs::check_not_an_input(trace, "--trace", &[&reads[..], &also[..]].concat())?;
        if let Some(out) = args.save_session.as_deref().filter(|out| candle_npu::fs::same_file(trace, out)) {
            bail!("--trace {} and --save-session {}: one file for two outputs; give each its own", trace.display(), out.display());
        }
    }
    // The conversation may be saved back where it was loaded from (it goes on there).
    if let Some(out) = &args.save_session {
        candle_npu::fs::check_not_an_input(out, "--save-session", &reads)?;
    }
    // The precision: given, else the plan's (llm.npu's stages: shadow W8A8; whole layers: shadow
    // W8A16), else the device's; then the device's schedule for it.
    let precision = match (args.f32_prefill, args.u16_activations, args.plan) {
        (true, _, _) => Precision::F32,
        (_, true, _) | (_, _, Some(PlanArg::Layers)) => Precision::W8A16Shadow,
        (_, _, Some(PlanArg::Stages)) => Precision::W8A8,
        _ => Precision::for_device(&device),
    };
    let mut sched = SchedOptions::for_device(&device, precision);
    if let Some(policy) = args.policy {
        sched.policy = match policy {
            PolicyArg::InOrder => Policy::InOrder,
            PolicyArg::Fifo => Policy::Fifo,
            PolicyArg::Contribution => Policy::Contribution(Default::default()),
            PolicyArg::CriticalPath => Policy::CriticalPath,
        };
    }
    if let Some(tail) = args.tail {
        sched.tail = match tail {
            TailArg::Pad => Tail::Pad,
            TailArg::Margin => Tail::Margin,
        };
    }
    if let Some(n) = args.npu_threads {
        sched.npu_threads = Some(n as usize);
    }
    match args.plan {
        Some(PlanArg::Layers) => sched.plan = PrefillPlan::Layers,
        Some(PlanArg::Stages) => sched.plan = PrefillPlan::Stages,
        None => {}
    }
    if args.verify == "npu" && !args.lookup && args.draft_model.is_none() && args.draft_layers.is_none() {
        bail!("--verify npu verifies speculative proposals: give --lookup, --draft-model or --draft-layers with it");
    }
    let opts = LoadOptions {
        precision: Some(precision),
        decode_weights: match args.decode_weights {
            DecodeFormat::Q8_0 => DecodeWeights::Q8_0,
            DecodeFormat::Checkpoint => DecodeWeights::Checkpoint,
        },
        chunk_len,
        sched: Some(sched),
        residual: args.residual.clone(),
        weights: match args.lpbq.iter().any(|l| l == "all") {
            true => WeightQuant::Lpbq { block: 32 },
            false => WeightQuant::PerChannel,
        },
        lpbq: args.lpbq.iter().filter(|l| *l != "all").cloned().collect(),
        kv: match args.kv_cache {
            KvArg::F32 => KvType::F32,
            KvArg::F16 => KvType::F16,
            KvArg::Q8 => KvType::Q8,
        },
        ..Default::default()
    };
    let t = Instant::now();
    let mut p = Pipeline::load(&path, args.tokenizer.as_deref(), &device, opts).with_context(|| format!("loading {} ({chunk_said})", path.display()))?;
    let chunk_len = p.model.chunk_len();
    if p.model.spec().family != family {
        bail!("{} is a {} model: use --example {}", path.display(), p.model.spec().family, p.model.spec().family);
    }
    eprintln!(
        "loaded {} in {:.1}s ({} executor; {})",
        path.display(),
        t.elapsed().as_secs_f32(),
        device.executor_name(),
        candle_npu_models::memory::describe()
    );

    // The prompt and the options checked against the model before the calibration, which can
    // take minutes.
    let mut input = std::io::stdin().lock();
    let prompt = match (&args.prompt, args.interactive) {
        (Some(prompt), _) => prompt.clone(),
        (None, false) => DEFAULT_PROMPT.to_string(),
        (None, true) => {
            eprint!("> ");
            match read_turn(&mut input, 1) {
                Some(line) => line,
                None => bail!("no first turn typed (an empty line or end of input ends the conversation)"),
            }
        }
    };
    let tokens = p.encode_with(&prompt, !args.no_chat_template, args.parse_special)?;
    let context = p.model.config().context_len;
    p.model.plan(tokens.len()).context("the prompt")?;

    let bar = indicatif::ProgressBar::hidden();
    // Calibration windows within the model's context (a model of a short one takes shorter).
    let set = CalibrationSet::default();
    let set = CalibrationSet { seq_len: set.seq_len.min(context), ..set };
    p.ensure_profile(args.profile.as_deref(), set, |i, n| {
        if bar.is_hidden() {
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
            bar.set_length(n as u64);
            bar.set_message("calibrating activation ranges on the shipped calibration text");
        }
        bar.set_position(i as u64);
    })?;
    bar.finish_and_clear();
    eprintln!("profile ready ({})", candle_npu_models::memory::describe());

    // The draft runs on the CPU only: F32 "prefill" (its CPU path), no profile, no graphs. The
    // model's own first layers share its weights; another model (maybe cut) is loaded.
    let drafting = args.draft_model.is_some() || args.draft_layers.is_some();
    match (&args.draft_model, args.draft_layers) {
        (None, Some(n)) => {
            p.set_draft_layers(n as usize)?;
            eprintln!("draft: the model's own first {n} layers (its weights, no copy)");
        }
        (Some(draft_path), layers) => {
            let t = Instant::now();
            let opts = LoadOptions { precision: Some(Precision::F32), layers: layers.map(|n| n as usize), ..Default::default() };
            let draft = Pipeline::load(draft_path, None, &NpuDevice::host(), opts).with_context(|| format!("loading the draft {}", draft_path.display()))?;
            p.set_draft(draft)?;
            eprintln!(
                "draft {} ({} layers) loaded in {:.1}s ({})",
                draft_path.display(),
                p.draft().map_or(0, |(_, n)| n),
                t.elapsed().as_secs_f32(),
                candle_npu_models::memory::describe()
            );
        }
        (None, None) => {}
    }

    let t = Instant::now();
    p.model.prepare()?;
    let s = device.stats();
    eprintln!(
        "NPU graphs for chunk length {} ready in {:.2}s: {} prepared, {} loaded from the graph cache",
        chunk_len,
        t.elapsed().as_secs_f32(),
        s.graphs_prepared,
        s.graphs_loaded
    );
    eprintln!("graphs ready ({})", candle_npu_models::memory::describe());
    if !device.on_host() || tokens.len() > 2 * chunk_len {
        // On x86 the HTP is an emulator (~0.3-1 GMAC/s): a 256-row chunk takes minutes; on the
        // host a long prompt takes seconds.
        let bar = indicatif::ProgressBar::new(0).with_message(format!("prefill of {} tokens on the {}", tokens.len(), device.executor_name()));
        bar.set_style(indicatif::ProgressStyle::with_template("{msg}: {bar:30} {pos}/{len} chunk layers ({elapsed})").expect("template"));
        p.model.set_prefill_progress(Some(Box::new(move |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            if done == total {
                bar.finish_and_clear();
            }
        })));
    }
    if args.no_chat_template {
        p.jinja = None;
        p.template = candle_npu_models::chat::ChatTemplate::None;
        print!("{prompt}");
    } else if args.prompt.is_some() || !args.interactive {
        println!("> {prompt}");
    }
    let gen = GenerateOptions {
        sample_len: args.sample_len,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k.map(|k| k as usize),
        repeat_penalty: args.repeat_penalty,
        repeat_last_n: args.repeat_last_n,
        speculative: {
            let verify = if args.verify == "npu" { candle_npu_models::Verify::Npu } else { candle_npu_models::Verify::Cpu };
            match (args.lookup, drafting) {
                (true, _) => candle_npu_models::Speculative::lookup().verified_on(verify),
                (false, true) => candle_npu_models::Speculative::draft().verified_on(verify),
                (false, false) => candle_npu_models::Speculative::Off,
            }
        },
        seed: args.seed,
        parse_special: args.parse_special,
    };
    let mut session = match &args.load_session {
        Some(path) => p.restore_session(path)?,
        None => p.session(),
    };
    let first: Vec<Message> = args.system.iter().map(Message::system).chain([Message::user(&prompt)]).collect();
    let print = |text: &str| {
        print!("{text}");
        let _ = std::io::stdout().flush();
    };
    let before = device.stats();
    let (_, stats) = session.chat(&p, &first, &gen, print)?;
    println!();
    if args.interactive {
        let mut n = if args.prompt.is_some() { 0 } else { 1 };
        loop {
            eprint!("> ");
            n += 1;
            let Some(line) = read_turn(&mut input, n) else { break };
            // A turn that fails (a prompt too long for what is left of the context, say) ends
            // the conversation, which is still saved below.
            match session.send(&p, &line, &gen, print) {
                Ok((_, s)) => {
                    println!();
                    eprintln!("({} new tokens after {} kept; first token after {:.2}s)", s.prompt_tokens, s.cached_tokens, s.ttft.as_secs_f64());
                    if s.stop == StopReason::ContextFull {
                        eprintln!("(stopped: the model's context of {context} tokens is full; the conversation ends here)");
                        break;
                    }
                }
                Err(e) => {
                    eprintln!("\nerror: {e}");
                    break;
                }
            }
        }
    }
    if let Some(out) = &args.save_session {
        session.save(&p, out)?;
        eprintln!("conversation of {} tokens saved to {}", session.tokens().len(), out.display());
    }
    if stats.stop == StopReason::ContextFull {
        eprintln!("(stopped: the model's context of {context} tokens is full)");
    }
    let prefill_stats = device.stats();
    if let (Some(path), Some(run)) = (&args.trace, p.model.last_run()) {
        let (dag, schedule) = &*run;
        Trace::from_schedule(dag, schedule).write(path)?;
        eprintln!(
            "trace of {} stages written to {} (bubbles: NPU {:.0}%, CPU {:.0}%)",
            schedule.slices.len(),
            path.display(),
            100.0 * schedule.bubble_rate(Processor::Npu),
            100.0 * schedule.bubble_rate(Processor::Cpu)
        );
    }
    let plan = p.model.plan(stats.prompt_tokens)?;
    let policy = match (p.model.sched().plan, p.model.policy_set_aside(plan.chunks.len())) {
        (PrefillPlan::Layers, _) => "one graph per layer, chunks in order".to_string(),
        (_, true) => format!("{}, chunks in order: the host executor shares the cores", p.model.sched().policy.name()),
        (_, false) => p.model.sched().policy.name().to_string(),
    };
    let sizes: Vec<String> =
        plan.npu_sizes().iter().rev().map(|&s| format!("{} x {s}", plan.chunks.iter().filter(|c| !c.margin && c.padded_len == s).count())).collect();
    println!(
        "\n{} prompt tokens processed: {:.2} token/s, first token after {:.2}s (NPU chunks: {}; {} margin rows on the CPU, {} padded rows; {}; {} graphs prepared, {} executed)",
        stats.prompt_tokens,
        stats.prefill_tokens_per_sec(),
        stats.ttft.as_secs_f64(),
        if sizes.is_empty() { "none".to_string() } else { sizes.join(" + ") },
        plan.margin_tokens(),
        plan.padded_tokens(),
        policy,
        prefill_stats.graphs_prepared - before.graphs_prepared,
        prefill_stats.executions - before.executions
    );
    println!("{} tokens generated: {:.2} token/s", stats.generated_tokens, stats.decode_tokens_per_sec());
    if args.lookup || drafting {
        let s = stats.speculation;
        let by = if args.lookup { "prompt lookup" } else { "draft model" };
        println!("{by}: {} of {} proposed tokens accepted in {} verification passes", s.accepted, s.proposed, s.passes);
    }
    println!("memory: {}; {}", candle_npu_models::memory::describe(), p.model.weight_bytes());
    print_qnn_profile(&device);
    Ok(())
}

/// Per-stage totals of the QNN profile (graphs named `blk.<layer>.<stage>.m<rows>`).
fn print_qnn_profile(device: &NpuDevice) {
    let profiles = device.graph_profiles();
    if profiles.is_empty() {
        return;
    }
    let mut stages: std::collections::BTreeMap<String, (usize, u64, u64, u64)> = Default::default();
    for g in &profiles {
        let stage = g.graph.split('.').nth(2).unwrap_or(&g.graph).to_string();
        let e = stages.entry(stage).or_default();
        *e = (e.0 + 1, e.1 + g.prepare_us, e.2 + g.executions, e.3 + g.execute_us);
    }
    println!(
        "
QNN profile (QNN's own times; on x86 these are emulator times):"
    );
    println!("| stage | graphs | finalize/load ms | executions | execute ms |");
    println!("|---|---|---|---|---|");
    for (stage, (n, prep, execs, exec)) in stages {
        println!("| {stage} | {n} | {:.1} | {execs} | {:.1} |", prep as f64 / 1e3, exec as f64 / 1e3);
    }
}

/// The first turn when none is given.
const DEFAULT_PROMPT: &str = "What is the capital of France?";

/// Line `n` of standard input as a turn, without its line end; `None` for an empty line or the
/// end of input (the conversation's end). Bytes, then text: a line that is not UTF-8 (or a read
/// that fails) ends the conversation too, said on stderr, as a failed turn does.
fn read_turn(input: &mut impl std::io::BufRead, n: usize) -> Option<String> {
    let mut bytes = Vec::new();
    let line = match input.read_until(b'\n', &mut bytes).map(|_| std::str::from_utf8(&bytes)) {
        Ok(Ok(line)) => line,
        Ok(Err(e)) => {
            eprintln!(
                "error: standard input, line {n}: not UTF-8 text (invalid byte 0x{:02x} at byte {}); the conversation ends here",
                bytes[e.valid_up_to()],
                e.valid_up_to() + 1
            );
            return None;
        }
        Err(e) => {
            eprintln!("error: reading standard input: {e}; the conversation ends here");
            return None;
        }
    };
    match line.trim().is_empty() {
        true => None,
        false => Some(line.trim_end_matches(['\r', '\n']).to_string()),
    }
}
