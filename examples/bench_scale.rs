//! How each cost grows with the model: the three real models and two of real shapes above 0.5B
//! parameters (Llama-3.2-1B, Qwen2.5-3B: seeded random weights in llama.cpp's Q4_K_M mix,
//! written once under `assets/.bench`, see `common/synthetic.rs`), each against llama.cpp on the
//! same file, in one run:
//!
//! - **memory**: the file, the INT8 weights (the NPU's one copy) and hot columns the engine holds,
//!   and the peak RSS of the main job (a child process, as `tests/memory.rs`: load, the quant
//!   profile, a 700-token prompt in chunks of 256 on the host executor, 16 decode tokens) against
//!   `llama-bench -p 700 -n 16`'s (both by the kernel's high-water mark);
//! - **prefill** tokens/s at 256 and 1024 tokens (host W8A8, chunks of 256) and **decode**
//!   tokens/s after a 64-token prompt, against `llama-bench`'s pp and tg64, in interleaved rounds
//!   (the median);
//! - with `--contexts`, the NPU's contexts as a phone holds them (weight sharing, one context
//!   per model within `HtpConfig::context_budget`) for chunks of 256 and 32 rows, finalized on
//!   the x86 emulator: how many, their bytes, and the address space they are bounded by.
//!
//! The synthetic models are calibrated on a short set (2 windows of 128 tokens) and, random,
//! have almost no outlier channels: their hot columns and shadow work are a real model's floor.
//!
//! ```text
//! cargo run --release --example bench_scale -- [--llama-bench PATH] [--models smollm2,gemma,qwen,llama-3.2-1b,qwen2.5-3b] [--contexts]
//! ```
#[path = "common/llama_bench.rs"]
mod llama_bench;
#[path = "common/synthetic.rs"]
mod synthetic;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_npu::{HostExecutor, HtpConfig, NpuDevice};
use candle_npu_models::logits::argmax;
use candle_npu_models::PrefillOptions;
use candle_npu_models::{assets, memory, transformer, CalibrationSet, LoadOptions, Pipeline, Precision};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// `llama-bench` binary for the llama.cpp columns (default: `$LLAMA_BENCH`; none: ours only).
    #[arg(long)]
    llama_bench: Option<PathBuf>,
    /// Models: smollm2, gemma, qwen, llama-3.2-1b, qwen2.5-3b.
    #[arg(long, value_delimiter = ',', default_value = "smollm2,gemma,qwen,llama-3.2-1b,qwen2.5-3b")]
    models: Vec<String>,
    /// Interleaved rounds of the speed columns; each figure is their median.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Threads of both engines.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Also finalize each model's NPU contexts on the emulator (needs the QNN library).
    #[arg(long)]
    contexts: bool,
    /// Calibrate in the process with this hot-channel coverage (`CalibrationSet::hot_coverage`)
    /// instead of loading the saved profile: the memory / speed trade-off of a smaller hot set.
    #[arg(long)]
    hot_coverage: Option<f64>,
    /// Internal: finalize this model file's NPU contexts and print what they take.
    #[arg(long, hide = true)]
    contexts_of: Option<PathBuf>,
    /// Internal: run the main job on this model file and print its peak RSS.
    #[arg(long, hide = true)]
    main_job: Option<PathBuf>,
    /// The NPU's weights: `int8` (per channel, W8A8: the default) or `lpbq` (4-bit LPBQ on every
    /// linear, with the u16 activations it needs: shadow W8A16).
    #[arg(long, default_value = "int8", value_parser = ["int8", "lpbq"])]
    npu_weights: String,
}

const PROMPT: usize = 700;
const DECODE: usize = 16;

/// The quant profile: the saved one, else calibrated (a short set for the synthetic models) and
/// saved; with `hot_coverage`, calibrated with it and not saved.
fn profile(p: &mut Pipeline, synthetic: bool, hot_coverage: Option<f64>) -> Result<()> {
    let set = match synthetic {
        true => CalibrationSet { sequences: 2, seq_len: 128, ..Default::default() },
        false => CalibrationSet::default(),
    };
    let progress = |i, n| eprint!("\rcalibrating {i}/{n}   ");
    match hot_coverage {
        Some(hot_coverage) => {
            let profile = p.calibrate(CalibrationSet { hot_coverage, ..set }, progress)?;
            p.model.set_profile(profile)?;
        }
        None => p.ensure_profile(None, set, progress)?,
    }
    Ok(())
}

fn is_synthetic(path: &Path) -> bool {
    path.to_string_lossy().contains("-random.gguf")
}

fn load(path: &Path, npu_weights: &str) -> Result<Pipeline> {
    let opts = match npu_weights {
        "lpbq" => LoadOptions { precision: Some(Precision::W8A16Shadow), lpbq: transformer::linear_names().map(String::from).collect(), ..Default::default() },
        _ => LoadOptions { precision: Some(Precision::W8A8), ..Default::default() },
    };
    Ok(Pipeline::load(path, None, &NpuDevice::host(), opts)?)
}

/// `n` prompt tokens: a model's own encoding of Moby Dick (the synthetic models share their
/// family's tokenizer).
fn prompt(p: &Pipeline, n: usize) -> Result<Vec<u32>> {
    let text: String = assets::moby_dick()?.chars().skip(20_000).take(12 * n).collect();
    let ids: Vec<u32> = p.encode(&text, false)?.into_iter().take(n).collect();
    if ids.len() < n {
        bail!("{n} tokens wanted, the text gave {}", ids.len());
    }
    Ok(ids)
}

/// The child: the main job, then its peak RSS in bytes on stdout.
fn main_job(path: &Path, hot_coverage: Option<f64>, npu_weights: &str) -> Result<()> {
    memory::limit_malloc_arenas(1);
    let mut p = load(path, npu_weights)?;
    profile(&mut p, is_synthetic(path), hot_coverage)?;
    let ids = prompt(&p, PROMPT)?;
    p.model.prepare_chunked(256)?;
    let mut t = argmax(&p.model.prefill(&ids, &PrefillOptions::chunked(256))?)?;
    for _ in 0..DECODE {
        t = argmax(&p.model.decode(t)?)?;
    }
    let (_, peak) = memory::rss().context("/proc/self/status")?;
    println!("{peak} {}, host executor's packed NPU weights {:.0} MB", p.model.weight_bytes(), HostExecutor::packed_bytes() as f64 / 1e6);
    Ok(())
}

/// The main job's peak RSS (MiB) and what the engine holds, in a child process.
fn ours_rss(path: &Path, hot_coverage: Option<f64>, npu_weights: &str) -> Result<(f64, String)> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("--main-job").arg(path).arg("--npu-weights").arg(npu_weights);
    if let Some(c) = hot_coverage {
        cmd.arg("--hot-coverage").arg(c.to_string());
    }
    let out = cmd.output()?;
    if !out.status.success() {
        bail!("main job on {}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
    }
    let s = String::from_utf8(out.stdout)?;
    let (peak, holds) = s.trim().split_once(' ').context("the main job's line")?;
    Ok((peak.parse::<f64>()? / 1048576.0, holds.to_string()))
}

/// llama-bench's peak RSS (MiB) over a 700-token prompt and 16 generated tokens.
fn llama_rss(bin: &Path, path: &Path, threads: usize) -> Result<f64> {
    let report = std::env::temp_dir().join(format!("bench-scale-time-{}", std::process::id()));
    let status = Command::new("/usr/bin/time")
        .args(["-f", "%M", "-o"])
        .arg(&report)
        .arg(bin)
        .args(["-m", &path.display().to_string(), "-p", &PROMPT.to_string(), "-n", &DECODE.to_string(), "-r", "1", "-t", &threads.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .context("/usr/bin/time")?;
    let kib: f64 = std::fs::read_to_string(&report)?.trim().lines().last().unwrap_or("").parse().context("/usr/bin/time's report")?;
    let _ = std::fs::remove_file(&report);
    if !status.success() {
        bail!("llama-bench on {} failed", path.display());
    }
    Ok(kib / 1024.0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The NPU contexts of `p`'s stage graphs at 256 + 32 rows with weight sharing, finalized on the
/// emulator: (contexts, their binary bytes, the address space they are bounded by, seconds).
fn npu_contexts(p: &Pipeline) -> Result<(usize, f64, f64, f64)> {
    let htp = NpuDevice::hexagon(HtpConfig { weight_sharing: true, ..Default::default() })?;
    let n_layer = p.model.config().n_layer;
    let stages = candle_npu_models::transformer::N_STAGES;
    let per_size = n_layer * stages;
    let describe = |i: usize| p.model.stage_graph(i % per_size / stages, i % stages, [256, 32][i / per_size], Precision::W8A8);
    // Each graph's bound, taken as it is described (a description requantizes its weights).
    let bounds = std::cell::RefCell::new(vec![0u64; 2 * per_size]);
    let t = Instant::now();
    let prepared = htp.prepare_described(2 * per_size, |i| {
        let g = describe(i)?;
        bounds.borrow_mut()[i] = candle_npu::executor::htp_contexts::address_space(&g, None);
        Ok(g)
    })?;
    let secs = t.elapsed().as_secs_f64();
    if htp.stats().fallbacks > 0 {
        bail!("{} stage graphs fell back to the host", htp.stats().fallbacks);
    }
    let (mut bytes, mut contexts) = (0f64, 0f64);
    for g in &prepared {
        let share = 1.0 / g.graphs_in_unit() as f64;
        bytes += g.serialized_size().unwrap_or(0) as f64 * share;
        contexts += share;
    }
    let need = bounds.into_inner().iter().sum::<u64>() as f64;
    Ok((contexts.round() as usize, bytes, need, secs))
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn,candle_npu::qnn=error".into()))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if let Some(path) = &args.main_job {
        return main_job(path, args.hot_coverage, &args.npu_weights);
    }
    if let Some(path) = &args.contexts_of {
        // In a process of its own, without the host executor's graphs: the emulator holds what
        // it finalizes in the process's memory.
        let mut p = load(path, &args.npu_weights)?;
        profile(&mut p, is_synthetic(path), None)?;
        let (n, bytes, need, secs) = npu_contexts(&p)?;
        println!("{n} {bytes} {need} {secs}");
        return Ok(());
    }
    let llama = llama_bench::binary(args.llama_bench.as_deref());
    let mut rows = Vec::new();
    for name in &args.models {
        let path = match assets::real_model(name) {
            Some(path) => path?,
            None => {
                let other = name;
                let shape = synthetic::Shape::by_name(other).with_context(|| format!("unknown model {other}"))?;
                let t = Instant::now();
                let path = synthetic::model(shape, |i, n| eprint!("\r{other}: writing tensor {i}/{n}   "))?;
                eprintln!("\r{other}: {} ({:.1}B parameters, {:.0} s)", path.display(), shape.params() as f64 / 1e9, t.elapsed().as_secs_f64());
                path
            }
        };
        let file_mb = std::fs::metadata(&path)?.len() as f64 / 1e6;
        eprintln!("{name}: main job");
        let (rss, holds) = ours_rss(&path, args.hot_coverage, &args.npu_weights)?;
        let llama_rss = llama.as_deref().map(|b| llama_rss(b, &path, args.threads)).transpose()?;

        let mut p = load(&path, &args.npu_weights)?;
        profile(&mut p, is_synthetic(&path), args.hot_coverage)?;
        let ids = prompt(&p, 1024)?;
        p.model.prepare_chunked(256)?;
        let (mut ours, mut theirs): (Vec<[f64; 3]>, Vec<[f64; 3]>) = (Vec::new(), Vec::new());
        for r in 0..args.rounds.max(1) {
            eprint!("\r{name}: round {}/{}   ", r + 1, args.rounds);
            let mut row = [0f64; 3];
            for (j, n) in [256usize, 1024].into_iter().enumerate() {
                let t = Instant::now();
                p.model.prefill(&ids[..n], &PrefillOptions::chunked(256))?;
                row[j] = n as f64 / t.elapsed().as_secs_f64();
            }
            p.model.prefill(&ids[..64], &PrefillOptions::default())?;
            let mut next = ids[64];
            let t = Instant::now();
            for _ in 0..64 {
                next = argmax(&p.model.decode(next)?)?;
            }
            row[2] = 64.0 / t.elapsed().as_secs_f64();
            ours.push(row);
            if let Some(bin) = &llama {
                let ts = |test: &[&str]| llama_bench::avg_ts(bin, &path, test, args.threads);
                theirs.push([ts(&["-p", "256", "-n", "0"])?, ts(&["-p", "1024", "-n", "0"])?, ts(&["-p", "0", "-n", "64", "-d", "64"])?]);
            }
        }
        eprintln!();
        let med = |v: &[[f64; 3]], j: usize| median(v.iter().map(|r| r[j]).collect());
        let c = p.model.config();
        let linears = c.n_layer * c.hidden * ((c.n_head + 2 * c.n_kv_head) * c.head_dim + c.n_head * c.head_dim + 3 * c.ffn);
        let params = (linears + c.vocab * c.hidden) as f64 / 1e9;
        drop(p);
        let contexts = if args.contexts {
            eprintln!("{name}: NPU contexts");
            let out = Command::new(std::env::current_exe()?).arg("--contexts-of").arg(&path).output()?;
            let v: Vec<f64> = String::from_utf8_lossy(&out.stdout).split_whitespace().filter_map(|x| x.parse().ok()).collect();
            match (out.status.success(), &v[..]) {
                (true, &[n, bytes, need, secs]) => Some((n as usize, bytes, need, secs)),
                _ => {
                    eprintln!("{name}: NPU contexts not measured: {} {}", out.status, String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or(""));
                    None
                }
            }
        } else {
            None
        };
        let row = (
            name.clone(),
            params,
            file_mb,
            holds,
            rss,
            llama_rss,
            [0, 1, 2].map(|j| med(&ours, j)),
            (!theirs.is_empty()).then(|| [0, 1, 2].map(|j| med(&theirs, j))),
            contexts,
        );
        // As it comes, in case a later model fails.
        eprintln!("{name}: {row:?}");
        rows.push(row);
    }

    let coverage = args.hot_coverage.map_or("the saved profiles".to_string(), |c| format!("profiles calibrated with hot coverage {c}"));
    println!("\nMemory: the main job's peak RSS (a {PROMPT}-token prompt, {DECODE} tokens; {coverage}), and llama-bench's on the same file (-p {PROMPT} -n {DECODE})");
    println!("| model | parameters | file MB | peak RSS MiB | llama.cpp MiB | difference MiB | the engine holds |");
    println!("|---|---|---|---|---|---|---|");
    for (name, params, file, holds, rss, lrss, ..) in &rows {
        let l = lrss.map_or("-".into(), |v| format!("{v:.0}"));
        let d = lrss.map_or("-".into(), |v| format!("{:+.0}", rss - v));
        println!("| {name} | {params:.2}B | {file:.0} | {rss:.0} | {l} | {d} | {holds} |");
    }
    println!("\nSpeed, tokens/s, median of {} interleaved rounds, {} threads (ours / llama.cpp on the same file)", args.rounds, args.threads);
    println!("| model | prefill 256 | prefill 1024 | decode (64 in context) |");
    println!("|---|---|---|---|");
    for (name, .., ours, theirs, _) in &rows {
        let cell = |j: usize| match theirs {
            Some(t) => format!("{:.1} / {:.1} ({:.2}x)", ours[j], t[j], ours[j] / t[j]),
            None => format!("{:.1}", ours[j]),
        };
        println!("| {name} | {} | {} | {} |", cell(0), cell(1), cell(2));
    }
    if args.contexts {
        println!(
            "\nNPU contexts with weight sharing (a phone's default), stage graphs of 256 + 32 rows, budget {} MiB",
            HtpConfig::default().context_budget >> 20
        );
        println!("| model | contexts | context binaries MiB | address space bound MiB | finalize s |");
        println!("|---|---|---|---|---|");
        for (name, .., c) in &rows {
            if let Some((n, bytes, need, secs)) = c {
                println!("| {name} | {n} | {:.0} | {:.0} | {secs:.0} |", bytes / 1048576.0, need / 1048576.0);
            }
        }
    }
    Ok(())
}
