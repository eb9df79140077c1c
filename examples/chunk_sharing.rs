//! The chunk-sharing ablation (llm.npu §3.2), on the real QNN HTP library: what it costs to
//! prepare the static NPU graphs that a W8A8 prefill of SmolLM2 needs, under three strategies.
//!
//! - **per-length**: one graph set per prompt length (the "online prepare" the paper rejects:
//!   every new prompt length pays a full finalize before its first token).
//! - **per-chunk**: fixed-length chunks, but each chunk position has its own graphs (no sharing):
//!   a prompt of n chunks prepares n graph sets, each holding a full copy of the weights.
//! - **chunk-sharing** (this engine): one graph set for the chunk length, shared by every chunk of
//!   every prompt; with the prepared-graph cache, later processes load it instead.
//!
//! Only the graphs are prepared, nothing is executed, so the numbers are the library's real
//! finalize cost and context binary sizes. On x86 the library is the HTP emulator: its finalize
//! time is the host's, not a phone's (the ratios between strategies are what carries over).
//!
//! ```text
//! cargo run --release --example chunk_sharing -- --lengths 64,256,1024 --chunk-len 256
//! ```
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_npu::{Graph, HtpConfig, NpuDevice};
use candle_npu_models::{CalibrationSet, DecodeWeights, LoadOptions, Pipeline, Precision};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Chunk-sharing ablation: graph preparation cost per strategy on the QNN HTP library")]
struct Args {
    /// Local GGUF file; default: SmolLM2-135M-Instruct from the assets folder.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt lengths, in tokens.
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
    lengths: Vec<usize>,
    #[arg(long, default_value_t = 256)]
    chunk_len: usize,
    /// Hexagon SoC model (57 = SM8650).
    #[arg(long, default_value_t = 57)]
    soc: u32,
    /// Quant profile file (default: next to the model; calibrated and saved when missing).
    #[arg(long)]
    profile: Option<PathBuf>,
}

/// What preparing one set of graphs cost.
#[derive(Clone, Copy, Default)]
struct Cost {
    graphs: u64,
    finalize_s: f64,
    /// Sum of the prepared graphs' context binary sizes.
    binary_bytes: u64,
    /// Sum of the weights (static tensors) the graphs were built from.
    weight_bytes: u64,
}

impl std::ops::Add for Cost {
    type Output = Cost;
    fn add(self, o: Cost) -> Cost {
        Cost {
            graphs: self.graphs + o.graphs,
            finalize_s: self.finalize_s + o.finalize_s,
            binary_bytes: self.binary_bytes + o.binary_bytes,
            weight_bytes: self.weight_bytes + o.weight_bytes,
        }
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// The 3 NPU stage graphs of every layer for chunks of `rows` rows; `suffix` renames them (per
/// chunk position, for the no-sharing strategy).
fn graph_set(p: &Pipeline, rows: usize, suffix: &str) -> Result<Vec<Graph>> {
    let mut out = Vec::new();
    for l in 0..p.model.config().n_layer {
        for mut g in p.model.layer_graphs(l, rows, Precision::W8A8)? {
            g.name.push_str(suffix);
            out.push(g);
        }
    }
    Ok(out)
}

/// Prepares `graphs` on `device` (a fresh executor per measurement, so nothing is shared by
/// accident) and measures them. The graphs are dropped afterwards.
fn prepare(device: &NpuDevice, graphs: &[Graph], label: &str) -> Result<Cost> {
    let bar = indicatif::ProgressBar::new(graphs.len() as u64).with_message(label.to_string());
    bar.set_style(indicatif::ProgressStyle::with_template("{msg}: {bar:30} {pos}/{len} graphs").expect("template"));
    let before = device.stats();
    let mut prepared = Vec::with_capacity(graphs.len());
    for g in graphs {
        prepared.push(device.prepare(g).with_context(|| format!("preparing {}", g.name))?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let after = device.stats();
    if after.fallbacks > before.fallbacks {
        bail!("{} graphs fell back to the host: not an NPU measurement", after.fallbacks - before.fallbacks);
    }
    let weight_bytes = graphs.iter().flat_map(|g| &g.tensors).filter(|t| t.data.is_some()).map(|t| t.size_in_bytes() as u64).sum();
    Ok(Cost {
        graphs: after.graphs_prepared - before.graphs_prepared,
        finalize_s: (after.prepare_ns - before.prepare_ns) as f64 / 1e9,
        binary_bytes: prepared.iter().map(|g| g.serialized_size().unwrap_or(0) as u64).sum(),
        weight_bytes,
    })
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if args.lengths.is_empty() || args.lengths.contains(&0) || args.chunk_len == 0 {
        bail!("--lengths and --chunk-len must be positive");
    }
    let path = args.model.clone().unwrap_or_else(candle_npu_models::assets::smollm2);
    if !path.exists() {
        bail!("model file {} not found: run scripts/setup.sh, or pass --model", path.display());
    }
    // Graph descriptions come from a host pipeline (calibration included); every measurement
    // prepares them on its own fresh Hexagon executor.
    let opts = LoadOptions { precision: Some(Precision::W8A8), decode_weights: DecodeWeights::Q8_0, ..Default::default() };
    let mut p = Pipeline::load(&path, None, &NpuDevice::host(), opts)?;
    p.ensure_profile(args.profile.as_deref(), CalibrationSet::default(), |i, n| {
        eprint!("\rcalibrating {i}/{n}");
    })?;
    let config = HtpConfig { soc_model: args.soc, ..Default::default() };
    let fresh = || NpuDevice::hexagon(config.clone()).context("starting the Hexagon executor (run scripts/setup.sh)");
    let c = args.chunk_len;

    let mut per_length = Vec::new();
    let mut per_chunk = Vec::new();
    for &len in &args.lengths {
        per_length.push(prepare(&fresh()?, &graph_set(&p, len, "")?, &format!("per-length, {len} tokens"))?);
        let mut cost = Cost::default();
        for chunk in 0..len.div_ceil(c) {
            let label = format!("per-chunk, {len} tokens, chunk {chunk}");
            cost = cost + prepare(&fresh()?, &graph_set(&p, c, &format!(".c{chunk}"))?, &label)?;
        }
        per_chunk.push(cost);
    }
    let shared = prepare(&fresh()?, &graph_set(&p, c, "")?, "chunk-sharing")?;

    // With the cache: one process writes it, the next loads.
    let cache_dir = std::env::temp_dir().join(format!("candle-npu-ablation-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache_dir);
    let cached = HtpConfig { cache_dir: Some(cache_dir.clone()), ..config.clone() };
    let graphs = graph_set(&p, c, "")?;
    let writer = NpuDevice::hexagon(cached.clone())?;
    let t = Instant::now();
    prepare(&writer, &graphs, "chunk-sharing, writing the cache")?;
    let write_s = t.elapsed().as_secs_f64();
    let reader = NpuDevice::hexagon(cached)?;
    let t = Instant::now();
    let loaded: Vec<_> = graphs.iter().map(|g| reader.prepare(g)).collect::<candle_npu::Result<_>>()?;
    let load_s = t.elapsed().as_secs_f64();
    let (n_loaded, n_compiled) = (reader.stats().graphs_loaded, reader.stats().graphs_prepared);
    drop(loaded);
    let cache_bytes: u64 = std::fs::read_dir(&cache_dir)?.map(|e| e.map(|e| e.metadata().map(|m| m.len()).unwrap_or(0)).unwrap_or(0)).sum();
    std::fs::remove_dir_all(&cache_dir)?;

    let lib = HtpConfig::default().library_path();
    println!(
        "\nChunk-sharing ablation: {} ({} layers x {} NPU stages), W8A8, chunk length {c}, SoC {}; QNN HTP {} (x86 emulator: finalize times are host times)\n",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("model"),
        p.model.config().n_layer,
        candle_npu_models::transformer::N_STAGES,
        args.soc,
        lib.display()
    );
    println!("| prompt tokens | strategy | graphs prepared | finalize s | context binaries MiB | weights MiB |");
    println!("|---|---|---|---|---|---|");
    let row = |len: usize, name: &str, k: &Cost| {
        println!("| {len} | {name} | {} | {:.2} | {:.1} | {:.1} |", k.graphs, k.finalize_s, mib(k.binary_bytes), mib(k.weight_bytes))
    };
    for (i, &len) in args.lengths.iter().enumerate() {
        row(len, "per-length", &per_length[i]);
        row(len, &format!("per-chunk ({} chunks)", len.div_ceil(c)), &per_chunk[i]);
        row(len, "chunk-sharing", &shared);
    }
    // A session that serves every length once, in one process: per-length prepares each length;
    // per-chunk reuses chunk positions across prompts, so it holds the longest prompt's sets;
    // chunk-sharing holds one set.
    let longest = args.lengths.iter().enumerate().max_by_key(|(_, &l)| l).map(|(i, _)| per_chunk[i]).unwrap_or_default();
    let all_lengths = per_length.iter().fold(Cost::default(), |a, &b| a + b);
    println!("\nOne process serving all {} prompt lengths:\n", args.lengths.len());
    println!("| strategy | graphs prepared | finalize s | context binaries MiB |");
    println!("|---|---|---|---|");
    for (name, k) in [("per-length", all_lengths), ("per-chunk", longest), ("chunk-sharing", shared)] {
        println!("| {name} | {} | {:.2} | {:.1} |", k.graphs, k.finalize_s, mib(k.binary_bytes));
    }
    println!(
        "\nPrepared-graph cache (chunk-sharing): first process {:.2}s (finalize + write {:.1} MiB); next process loads {n_loaded} graphs ({n_compiled} compiled) in {load_s:.2}s",
        write_s,
        mib(cache_bytes)
    );
    Ok(())
}
