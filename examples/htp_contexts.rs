//! NPU memory and start-up as a phone would see them: the W8A8 stage graphs of the default phone
//! plan (graphs of 256 and 32 rows) of each real model on the QNN HTP library, held four ways
//! (`HtpConfig::contexts`, `HtpConfig::weight_sharing`):
//!
//! - **a context per graph**: every stage graph of every size has its own context binary;
//! - **a context per graph size** (the default without weight sharing, as on x86);
//! - **one context**: every graph of the model in one context, one cache entry, one load; each
//!   size still holds its own copy of the weights;
//! - **one context with weight sharing** (the default on a phone, HTP v73+): equal weights of the
//!   two sizes held once. The x86 library prepares and runs it but refuses to load its binary
//!   back (QNN 1000): its load column says so, and its bytes are what a phone would load.
//!
//! A context the NPU cannot map is refused at load (QNN 1002) and rebuilt, with a warning on
//! stderr giving QNN's "context size estimate".
//!
//! Per way: the context binary bytes (what the NPU maps), the time to prepare (finalize) and to
//! load from the prepared-graph cache in a new executor (median of `--load-rounds`; and of that,
//! QNN's own
//! `contextCreateFromBinary` time from its profile; the rest is reading and checksumming the
//! files), and with `--first-chunk` the time from a
//! new executor to the logits of a 32-token prompt (cache load, then one 32-row chunk on the
//! emulator, whose speed is not a phone's). QNN's profile of a load reports times only (no
//! memory event). On x86 the library is an emulator: bytes carry over to a phone, times do not.
//!
//! ```text
//! cargo run --release --example htp_contexts -- --first-chunk
//! ```
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_npu::{Contexts, Graph, HtpConfig, NpuDevice, Origin, PreparedGraph, ProfilingLevel, WeightQuant};
use candle_npu_models::PrefillOptions;
use candle_npu_models::{assets, CalibrationSet, LoadOptions, Pipeline, Precision, SchedOptions};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "A model's NPU stage graphs in a context per graph, one context, and one context with weight sharing")]
struct Args {
    /// Models: smollm2, gemma, qwen.
    #[arg(long, value_delimiter = ',', default_value = "smollm2,gemma,qwen")]
    models: Vec<String>,
    /// Graph sizes (rows), the first being the chunk length.
    #[arg(long, value_delimiter = ',', default_value = "256,32")]
    sizes: Vec<usize>,
    /// Also time a new executor's first 32-token prefill (cache load + one emulated chunk).
    #[arg(long)]
    first_chunk: bool,
    /// Hexagon SoC model (57 = SM8650).
    #[arg(long, default_value_t = 57)]
    soc: u32,
    /// Loads from the cache per way, each in a new executor: the median is reported.
    #[arg(long, default_value_t = 3)]
    load_rounds: usize,
    /// `stages`: llm.npu's W8A8 stage graphs; `layers`: the HTP's default, each layer one graph
    /// (shadow W8A16, a KV capacity of twice the first size).
    #[arg(long, default_value = "stages")]
    plan: String,
    /// The NPU's weights: `int8` (per channel) or `lpbq` (4-bit, blocks of 32; `layers` only:
    /// the HTP takes them from u16 activations).
    #[arg(long, default_value = "int8")]
    npu_weights: String,
    /// Which ways to measure (numbers 1-4 of the table's order).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    ways: Vec<usize>,
}

/// One way of holding the graphs.
struct Way {
    name: &'static str,
    contexts: Contexts,
    weight_sharing: bool,
}

const WAYS: [Way; 4] = [
    Way { name: "a context per graph", contexts: Contexts::PerGraph, weight_sharing: false },
    Way { name: "a context per graph size", contexts: Contexts::PerGraphSize, weight_sharing: false },
    Way { name: "one context", contexts: Contexts::PerModel, weight_sharing: false },
    Way { name: "one context, weight sharing", contexts: Contexts::PerModel, weight_sharing: true },
];

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn mib(b: f64) -> f64 {
    b / (1 << 20) as f64
}

/// Bytes of the compiled units holding `prepared`, and how many units there are (graphs sharing
/// a unit report the same one).
fn units(prepared: &[PreparedGraph]) -> (f64, f64) {
    prepared.iter().fold((0.0, 0.0), |(bytes, n), g| {
        let share = 1.0 / g.graphs_in_unit() as f64;
        (bytes + g.serialized_size().unwrap_or(0) as f64 * share, n + share)
    })
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn,candle_npu::qnn=error".into()))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if args.sizes.is_empty() || args.sizes.contains(&0) {
        bail!("--sizes must be positive row counts");
    }
    let lib = HtpConfig::default().library_path();
    if !lib.exists() {
        bail!("{} absent: run scripts/setup.sh", lib.display());
    }
    if !matches!(args.plan.as_str(), "stages" | "layers") || !matches!(args.npu_weights.as_str(), "int8" | "lpbq") {
        bail!("--plan is stages or layers, --npu-weights int8 or lpbq");
    }
    if args.npu_weights == "lpbq" && args.plan == "stages" {
        bail!("LPBQ weights need u16 activations: --plan layers");
    }
    if let Some(w) = args.ways.iter().find(|&&w| !(1..=WAYS.len()).contains(&w)) {
        bail!("--ways {w}: ways are 1 to {}", WAYS.len());
    }
    println!(
        "{} graphs of {:?} rows, {} weights, SoC {}, QNN HTP {} (x86 emulator: bytes carry over to a phone, times do not)\n",
        if args.plan == "layers" { "Whole-layer (shadow W8A16)" } else { "W8A8 stage" },
        args.sizes,
        args.npu_weights,
        args.soc,
        lib.display()
    );
    println!("| model | way | graphs | contexts | weights in graphs MiB | context binaries MiB | prepare s | load s | of which QNN s | first chunk s |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for name in &args.models {
        let path = assets::real_model(name).with_context(|| format!("unknown model {name}: smollm2, gemma or qwen"))??;
        measure(&args, name, &path)?;
    }
    Ok(())
}

fn measure(args: &Args, name: &str, path: &Path) -> Result<()> {
    let precision = if args.plan == "layers" { Precision::W8A16Shadow } else { Precision::W8A8 };
    let weights = if args.npu_weights == "lpbq" { WeightQuant::Lpbq { block: 32 } } else { WeightQuant::PerChannel };
    let opts = LoadOptions { precision: Some(precision), weights, ..Default::default() };
    let mut p = Pipeline::load(path, None, &NpuDevice::host(), opts.clone())?;
    p.ensure_profile(None, CalibrationSet::default(), |i, n| eprint!("\rcalibrating {name} {i}/{n}"))?;
    let profile = p.model.profile().context("a profile")?.clone();
    let mut graphs: Vec<Graph> = Vec::new();
    for &m in &args.sizes {
        for l in 0..p.model.config().n_layer {
            match args.plan.as_str() {
                "layers" => graphs.push(p.model.layer_graph(l, m, 2 * args.sizes[0], precision)?),
                _ => graphs.extend(p.model.layer_graphs(l, m, precision)?),
            }
        }
    }
    let weights: f64 = graphs.iter().flat_map(|g| &g.tensors).filter(|t| t.data.is_some()).map(|t| t.size_in_bytes() as f64).sum();
    let tokens: Vec<u32> = (0..32).map(|i| 1000 + 37 * i).collect();
    for (w, way) in WAYS.iter().enumerate().filter(|(w, _)| args.ways.contains(&(w + 1))) {
        let dir = std::env::temp_dir().join(format!("candle-npu-htp-contexts-{}-{name}-{w}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config = HtpConfig {
            soc_model: args.soc,
            cache_dir: Some(dir.clone()),
            contexts: Some(way.contexts),
            weight_sharing: way.weight_sharing,
            ..Default::default()
        };
        eprint!("\r{name}, {}: preparing {} graphs          ", way.name, graphs.len());
        let writer = NpuDevice::hexagon(config.clone())?;
        let t = Instant::now();
        let prepared = writer.prepare_all(&graphs)?;
        let prepare_s = t.elapsed().as_secs_f64();
        if writer.stats().fallbacks > 0 {
            bail!("{name}: {} graphs fell back to the host: not an NPU measurement", writer.stats().fallbacks);
        }
        let (bytes, contexts) = units(&prepared);
        drop(prepared);
        drop(writer);

        eprint!("\r{name}, {}: loading                    ", way.name);
        let (mut load_s, mut qnn_s, mut loaded_graphs) = (Vec::new(), Vec::new(), 0);
        // The x86 library cannot load a weight-shared binary (QNN 1000): each try finalizes every
        // graph again (whole-layer graphs of 256 rows took the 24 GiB machine's memory).
        let rounds = if way.weight_sharing && cfg!(target_arch = "x86_64") { 0 } else { args.load_rounds.max(1) };
        for _ in 0..rounds {
            // Profiled: QNN's own load time, apart from reading and checking the cache files.
            let reader = NpuDevice::hexagon(HtpConfig { profiling: Some(ProfilingLevel::Basic), ..config.clone() })?;
            let t = Instant::now();
            let loaded = reader.prepare_all(&graphs)?;
            load_s.push(t.elapsed().as_secs_f64());
            let loaded_profiles = reader.graph_profiles().into_iter().filter(|p| p.origin == Origin::Loaded);
            qnn_s.push(loaded_profiles.map(|p| p.prepare_us).sum::<u64>() as f64 / 1e6);
            loaded_graphs = reader.stats().graphs_loaded as usize;
            drop(loaded);
        }
        let load = match loaded_graphs == graphs.len() {
            true => format!("{:.2} | {:.3}", median(&mut load_s), median(&mut qnn_s)),
            // The warning on stderr gives QNN's error: 1000 for a weight-shared binary on x86,
            // 1002 ("Failed to find available PD") for contexts beyond the NPU's memory.
            false if rounds == 0 => "not loadable on x86 (QNN 1000) | -".to_string(),
            false => format!("{loaded_graphs} of {} graphs loaded, the rest finalized | -", graphs.len()),
        };

        let first = if args.first_chunk && !(way.weight_sharing && cfg!(target_arch = "x86_64")) {
            eprint!("\r{name}, {}: first chunk              ", way.name);
            let htp = NpuDevice::hexagon(config)?;
            let sched = SchedOptions { small_chunks: args.sizes[1..].to_vec(), ..SchedOptions::for_device(&htp, precision) };
            let mut x = Pipeline::load(path, None, &htp, LoadOptions { chunk_len: Some(args.sizes[0]), sched: Some(sched), ..opts.clone() })?;
            x.model.set_profile(profile.clone())?;
            let t = Instant::now();
            x.model.prepare()?;
            x.model.prefill(&tokens, &PrefillOptions::default())?;
            let s = t.elapsed().as_secs_f64();
            match htp.stats().graphs_prepared {
                0 => format!("{s:.1}"),
                n => format!("{s:.1} ({n} graphs finalized again)"),
            }
        } else {
            "-".to_string()
        };
        let _ = std::fs::remove_dir_all(&dir);
        eprint!("\r{:60}\r", "");
        println!("| {name} | {} | {} | {contexts:.0} | {:.1} | {:.1} | {prepare_s:.2} | {load} | {first} |", way.name, graphs.len(), mib(weights), mib(bytes),);
    }
    Ok(())
}
