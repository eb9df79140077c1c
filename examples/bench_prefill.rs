//! Prefill throughput, side by side in one run on SmolLM2-135M:
//! this engine (host executor, W8A8) vs candle-transformers' `quantized_llama` with F32 and Q8_0
//! weights (up to 1024 tokens), and llama.cpp with Q8_0 weights (`llama-bench` given by path, or
//! the Python package `llama-cpp-python` when installed), at 64, 256, 1024 and 4096 prompt
//! tokens; with `--qwen`, Qwen2.5-Coder-0.5B against llama.cpp too; where an in-order prefill's
//! time goes, by stage; and the INT8 GEMM's GOPS on the model's shapes against the multiply
//! pipes' measured peak.
//!
//! ```text
//! cargo run --release --example bench_prefill -- [--llama-bench PATH] [--qwen] [--lens 64,256,1024,4096]
//! ```
//!
//! llama.cpp is not part of this repository: build `llama-bench` from the PyPI
//! `llama-cpp-python` sdist's vendored source (cmake) and give its path (or `$LLAMA_BENCH`).
#[path = "common/llama_bench.rs"]
mod llama_bench;
#[path = "common/requantize.rs"]
mod requantize;

use std::time::Instant;

use anyhow::Result;
use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::{Device, Tensor};
use candle_npu::kernels::{Int8Kernel, PackedI8};
use candle_npu::sched::Policy;
use candle_npu::NpuDevice;
use candle_npu_models::PrefillOptions;
use candle_npu_models::{assets, CalibrationSet, LoadOptions, Pipeline, Precision, SchedOptions};
use candle_transformers::models::quantized_llama::ModelWeights;

const REPS: usize = 3;

/// Best of `REPS` runs after one warm-up (which also prepares the NPU graphs).
fn best(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut best = f64::MAX;
    for _ in 0..REPS {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// The SmolLM2 GGUF with every matrix re-encoded as `dtype` (F32 = the dequantized reference).
fn requantized(dtype: GgmlDType) -> Result<std::path::PathBuf> {
    requantize::requantized(&assets::smollm2(), "smollm2", dtype)
}

fn candle_model(dtype: GgmlDType) -> Result<ModelWeights> {
    let path = requantized(dtype)?;
    let mut f = std::fs::File::open(path)?;
    let ct = gguf_file::Content::read(&mut f)?;
    Ok(ModelWeights::from_gguf(ct, &mut f, &Device::Cpu)?)
}

/// Options (`cargo run --release --example bench_prefill -- --help`).
#[derive(clap::Parser, Debug)]
struct Args {
    /// `llama-bench` binary for the llama.cpp rows (default: `$LLAMA_BENCH`; without one, the
    /// Python package `llama-cpp-python` when installed; neither: our rows only).
    #[arg(long)]
    llama_bench: Option<std::path::PathBuf>,
    /// Prompt lengths (tokens). candle's rows are measured up to 1024 (at 4096 they take minutes).
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024,4096")]
    lens: Vec<usize>,
    /// Also Qwen2.5-Coder-0.5B against llama.cpp (ours and llama.cpp only).
    #[arg(long)]
    qwen: bool,
    /// Skip the stage breakdown and the GEMM table.
    #[arg(long)]
    table_only: bool,
}

/// Where the llama.cpp rows come from.
enum Llama {
    /// `llama-bench -p N -n 0`, one repetition per call.
    Bench(std::path::PathBuf, std::path::PathBuf),
    /// `llama-cpp-python` in one process.
    Python(LlamaCpp),
}

impl Llama {
    fn start(bin: Option<&std::path::Path>, gguf: &std::path::Path, tokens: &[u32]) -> Result<Option<Self>> {
        Ok(match bin {
            Some(b) => Some(Llama::Bench(b.to_path_buf(), gguf.to_path_buf())),
            None => LlamaCpp::start(gguf, tokens)?.map(Llama::Python),
        })
    }

    fn label(&self) -> &'static str {
        match self {
            Llama::Bench(..) => "llama.cpp (llama-bench), Q8_0 weights",
            Llama::Python(_) => "llama.cpp (llama-cpp-python), Q8_0 weights",
        }
    }

    /// Seconds of a prefill of `n` tokens (llama-bench: its own prompt of that length).
    fn prefill(&mut self, n: usize) -> Result<f64> {
        match self {
            Llama::Python(l) => {
                let t = Instant::now();
                l.prefill(n)?;
                Ok(t.elapsed().as_secs_f64())
            }
            Llama::Bench(bin, model) => Ok(n as f64 / llama_bench::avg_ts(bin, model, &["-p", &n.to_string(), "-n", "0"], cores())?),
        }
    }
}

/// Held-out Wikipedia tokens, at least `n`.
fn heldout(p: &Pipeline, n: usize) -> Result<Vec<u32>> {
    let mut text = vec![];
    for a in assets::wiki_heldout(2000)? {
        text.extend(p.encode(&a, false)?);
        if text.len() > n {
            return Ok(text);
        }
    }
    anyhow::bail!("the held-out text has fewer than {n} tokens")
}

/// Every engine at every length once per round, rounds interleaved (the machine's speed drifts
/// over minutes, and a ratio is only meaningful between runs close in time); round 0 is the
/// warm-up. `run(engine, n)` returns seconds, or `None` where that engine is not measured.
/// Returns tokens/s, best of the rounds.
fn interleaved(engines: usize, lens: &[usize], mut run: impl FnMut(usize, usize) -> Result<Option<f64>>) -> Result<Vec<Vec<Option<f64>>>> {
    let mut fastest = vec![vec![None::<f64>; lens.len()]; engines];
    for round in 0..=REPS {
        for (e, fastest) in fastest.iter_mut().enumerate() {
            for (i, &n) in lens.iter().enumerate() {
                if let Some(s) = run(e, n)? {
                    if round > 0 {
                        fastest[i] = Some(fastest[i].map_or(s, |b: f64| b.min(s)));
                    }
                }
            }
        }
    }
    Ok(fastest.into_iter().map(|f| f.into_iter().zip(lens).map(|(s, &n)| s.map(|s| n as f64 / s)).collect()).collect())
}

fn print_table(title: &str, lens: &[usize], labels: &[String], tps: &[Vec<Option<f64>>]) {
    println!("\n{title}");
    let head: Vec<String> = lens.iter().map(|n| format!("{n:>8}")).collect();
    println!("| {:<42} | {} |", "engine", head.join(" | "));
    println!("|{:-<44}|{}", "", lens.iter().map(|_| "---------:|").collect::<String>());
    for (label, row) in labels.iter().zip(tps) {
        let cells: Vec<String> = row.iter().map(|t| t.map_or(format!("{:>8}", "-"), |t| format!("{t:>8.1}"))).collect();
        println!("| {label:<42} | {} |", cells.join(" | "));
    }
    if let Some(llama) = labels.iter().position(|l| l.starts_with("llama.cpp")) {
        for (label, row) in labels.iter().zip(tps).filter(|(l, _)| l.starts_with("candle-npu")) {
            let r: Vec<String> = row.iter().zip(&tps[llama]).map(|(a, b)| a.zip(*b).map_or("-".into(), |(a, b)| format!("{:.2}x", a / b))).collect();
            println!("{label} / llama.cpp: {} at {lens:?} tokens", r.join(", "));
        }
    }
}

fn main() -> Result<()> {
    let args = <Args as clap::Parser>::parse();
    let llama_bench = llama_bench::binary(args.llama_bench.as_deref());
    let lens = args.lens.clone();
    let max = lens.iter().copied().max().unwrap_or(0);
    let dev = NpuDevice::host();
    let opts = LoadOptions { precision: Some(Precision::W8A8), ..Default::default() };
    let mut p = Pipeline::load(&assets::smollm2(), None, &dev, opts.clone())?;
    p.ensure_profile(None, CalibrationSet::default(), |_, _| {})?;
    let text = heldout(&p, max.max(2048))?;
    let mut candle = [("candle quantized_llama, F32 weights", GgmlDType::F32), ("candle quantized_llama, Q8_0 weights", GgmlDType::Q8_0)]
        .map(|(label, dtype)| candle_model(dtype).map(|m| (label, m)))
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    let mut llama = Llama::start(llama_bench.as_deref(), &requantized(GgmlDType::Q8_0)?, &text)?;
    if llama.is_none() {
        println!("llama.cpp row: not measured (give --llama-bench, or `pip install llama-cpp-python`)");
    }
    let labels: Vec<String> = [256usize, 64]
        .map(|c| format!("candle-npu host W8A8, chunk {c}"))
        .into_iter()
        .chain(candle.iter().map(|(l, _)| l.to_string()))
        .chain(llama.as_ref().map(|l| l.label().to_string()))
        .collect();
    let tps = interleaved(labels.len(), &lens, |e, n| {
        let t = Instant::now();
        match e {
            0 | 1 => drop(p.model.prefill(&text[..n], &PrefillOptions::chunked([256, 64][e]))?),
            2 | 3 if n > 1024 => return Ok(None),
            2 | 3 => {
                let m = &mut candle[e - 2].1;
                m.clear_kv_cache();
                m.forward(&Tensor::new(&text[..n], &Device::Cpu)?.unsqueeze(0)?, 0)?;
            }
            _ => return llama.as_mut().expect("a row only when running").prefill(n).map(Some),
        }
        Ok(Some(t.elapsed().as_secs_f64()))
    })?;
    drop(candle);
    let title = format!("Prefill, SmolLM2-135M, tokens/s (best of {REPS} interleaved rounds after a warm-up), {} threads", cores());
    print_table(&title, &lens, &labels, &tps);

    if args.qwen {
        let path = assets::qwen25_coder_05b()?;
        let mut q = Pipeline::load(&path, None, &dev, opts)?;
        q.ensure_profile(None, CalibrationSet::default(), |_, _| {})?;
        let text = heldout(&q, max)?;
        let mut llama = Llama::start(llama_bench.as_deref(), &requantize::requantized(&path, "qwen25-coder-05b", GgmlDType::Q8_0)?, &text)?;
        let labels: Vec<String> = std::iter::once("candle-npu host W8A8, chunk 256".to_string()).chain(llama.as_ref().map(|l| l.label().to_string())).collect();
        let tps = interleaved(labels.len(), &lens, |e, n| match e {
            0 => {
                let t = Instant::now();
                q.model.prefill(&text[..n], &PrefillOptions::chunked(256))?;
                Ok(Some(t.elapsed().as_secs_f64()))
            }
            _ => llama.as_mut().expect("a row only when running").prefill(n).map(Some),
        })?;
        print_table(
            &format!("Prefill, Qwen2.5-Coder-0.5B, tokens/s (best of {REPS} interleaved rounds after a warm-up), {} threads", cores()),
            &lens,
            &labels,
            &tps,
        );
    }
    if args.table_only {
        return Ok(());
    }

    // Where an in-order prefill's time goes (every stage alone on both cores), from the
    // schedule the model records: the NPU stages are the INT8 GEMMs; each CPU stage also
    // finishes the stage before it (dequantize, shadow outliers, residual).
    println!("\nIn-order prefill by stage, chunk 256, share of the time (best of {REPS})");
    println!("| tokens | GEMMs (qkv, o, gate_up, down) | attention (attn) | norm + quantize (attn_in, ffn_in) | SiLU (act) | tail |");
    println!("|---|---|---|---|---|---|");
    p.model.set_sched(SchedOptions { policy: Policy::InOrder, ..Default::default() })?;
    for n in [256usize, 1024, 2048] {
        let mut best: Option<(f64, std::collections::BTreeMap<String, f64>)> = None;
        for _ in 0..=REPS {
            let t = Instant::now();
            p.model.prefill(&text[..n], &PrefillOptions::chunked(256))?;
            let secs = t.elapsed().as_secs_f64();
            let run = p.model.last_run().ok_or_else(|| anyhow::anyhow!("no schedule recorded"))?;
            let (dag, schedule) = &*run;
            let mut by_stage = std::collections::BTreeMap::new();
            for sl in &schedule.slices {
                *by_stage.entry(dag.node(sl.node).stage_name.clone()).or_insert(0.0) += sl.end - sl.start;
            }
            if best.as_ref().is_none_or(|b| secs < b.0) {
                best = Some((secs, by_stage));
            }
        }
        let (secs, st) = best.expect("REPS >= 0 runs");
        let share = |names: &[&str]| 100.0 * names.iter().map(|k| st.get(*k).copied().unwrap_or(0.0)).sum::<f64>() / secs;
        println!(
            "| {n} | {:.0}% | {:.0}% | {:.0}% | {:.0}% | {:.0}% |",
            share(&candle_npu_models::transformer::STAGES.iter().map(|s| s.name).collect::<Vec<_>>()),
            share(&["attn"]),
            share(&["attn_in", "ffn_in"]),
            share(&["act"]),
            share(&["tail"])
        );
    }

    // The limit: the cores' multiply pipes. An exact 8-bit product on AVX2 without VNNI needs an
    // i32 sum per pair of products (`vpmaddwd`, or `vpmaddubsw` plus a `vpmaddwd` by ones), so the
    // exact limit is the `vpmaddwd` rate; the raw `vpmaddubsw` rate (saturating i16) is the issue's.
    let limits = peak::measure();
    if let Some((exact, raw)) = limits {
        println!("\nMultiply-pipe peak, all {} cores: vpmaddwd (exact) {exact:.0} GOPS, vpmaddubsw (saturating) {raw:.0} GOPS", cores());
    }
    println!("\nINT8 GEMM (kernel: {}), M = 256, GOPS = 2*M*N*K / s", Int8Kernel::detect().name());
    println!("| {:<22} | {:>8} | {:>14} |", "shape K x N", "GOPS", "share of exact");
    println!("|{:-<24}|{:->10}|{:->16}|", "", "", "");
    let c = p.model.config().clone();
    for (name, k, n) in [("q, o", c.hidden, c.hidden), ("k, v", c.hidden, c.n_kv_head * c.head_dim), ("gate, up", c.hidden, c.ffn), ("down", c.ffn, c.hidden)] {
        let m = 256;
        let w: Vec<i8> = (0..n * k).map(|i| ((i * 7919) % 255) as i8).collect();
        let x: Vec<u8> = (0..m * k).map(|i| ((i * 104729) % 256) as u8).collect();
        let packed = PackedI8::new(&w, n, k);
        let s = best(|| {
            std::hint::black_box(packed.matmul_u8(&x, m, -128));
            Ok(())
        })?;
        let gops = 2.0 * (m * n * k) as f64 / s / 1e9;
        let share = limits.map_or("-".to_string(), |(exact, _)| format!("{:.0}%", 100.0 * gops / exact));
        println!("| {:<22} | {:>8.1} | {:>14} |", format!("{name} {k} x {n}"), gops, share);
    }
    Ok(())
}

/// llama.cpp through the Python package `llama-cpp-python` (never in CI): one process for the
/// whole run, told the tokens once, then a prompt length per line; it answers with the seconds
/// its prefill took (same threads, batches of 512 as llama-bench).
struct LlamaCpp {
    child: std::process::Child,
    answers: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl LlamaCpp {
    const SCRIPT: &str = r#"
import json, sys, time
from llama_cpp import Llama
path, threads = sys.argv[1], int(sys.argv[2])
toks = json.loads(sys.stdin.readline())
llm = Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_batch=512, n_ubatch=512, verbose=False)
for line in sys.stdin:
    n = int(line)
    llm.reset()
    t = time.perf_counter()
    llm.eval(toks[:n])
    print(time.perf_counter() - t, flush=True)
"#;

    /// `None` when the package is not installed.
    fn start(gguf: &std::path::Path, tokens: &[u32]) -> Result<Option<Self>> {
        use std::io::{BufRead, Write};
        use std::process::{Command, Stdio};
        let installed = Command::new("python3").args(["-c", "import llama_cpp"]).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
        if !installed {
            return Ok(None);
        }
        let mut child = Command::new("python3")
            .args(["-c", Self::SCRIPT, &gguf.display().to_string(), &cores().to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        writeln!(child.stdin.as_mut().expect("piped"), "{}", serde_json::to_string(tokens)?)?;
        let answers = std::io::BufReader::new(child.stdout.take().expect("piped")).lines();
        Ok(Some(LlamaCpp { child, answers }))
    }

    fn prefill(&mut self, n: usize) -> Result<()> {
        use std::io::Write;
        writeln!(self.child.stdin.as_mut().expect("piped"), "{n}")?;
        let line = self.answers.next().ok_or_else(|| anyhow::anyhow!("llama-cpp-python exited ({:?})", self.child.try_wait()))??;
        line.trim().parse::<f64>().map_err(|e| anyhow::anyhow!("llama-cpp-python answered {line:?}: {e}"))?;
        Ok(())
    }
}

impl Drop for LlamaCpp {
    fn drop(&mut self) {
        drop(self.child.stdin.take()); // EOF: the script's loop ends
        let _ = self.child.wait();
    }
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The multiply pipes' peak, measured: 12 independent accumulators, register operands only, one
/// thread per core, as GOPS (2 per multiply-accumulate) over all cores.
mod peak {
    #[cfg(target_arch = "x86_64")]
    pub fn measure() -> Option<(f64, f64)> {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return None;
        }
        // MACs per instruction: vpmaddwd 16 (i16 pairs into i32), vpmaddubsw 32 (u8 x i8 pairs into i16).
        Some((all_cores(madd_wd, 16), all_cores(madd_ubsw, 32)))
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub fn measure() -> Option<(f64, f64)> {
        None
    }

    #[cfg(target_arch = "x86_64")]
    fn all_cores(f: fn(usize), macs: usize) -> f64 {
        const ITERS: usize = 100_000_000;
        let threads = super::cores();
        let t = std::time::Instant::now();
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| f(ITERS));
            }
        });
        (2 * 12 * macs * ITERS * threads) as f64 / t.elapsed().as_secs_f64() / 1e9
    }

    /// One loop body: 12 x (multiply into a temporary, add it to an accumulator), like a GEMM tile.
    macro_rules! peak_loop {
        ($name:ident, $mul:literal, $add:literal) => {
            #[cfg(target_arch = "x86_64")]
            fn $name(iters: usize) {
                // SAFETY: register-only AVX2 arithmetic (checked by `measure`); every register it
                // writes is declared clobbered.
                unsafe {
                    std::arch::asm!(
                        "2:",
                        concat!($mul, " ymm12, ymm13, ymm14"), concat!($add, " ymm0, ymm0, ymm12"),
                        concat!($mul, " ymm15, ymm13, ymm14"), concat!($add, " ymm1, ymm1, ymm15"),
                        concat!($mul, " ymm12, ymm13, ymm14"), concat!($add, " ymm2, ymm2, ymm12"),
                        concat!($mul, " ymm15, ymm13, ymm14"), concat!($add, " ymm3, ymm3, ymm15"),
                        concat!($mul, " ymm12, ymm13, ymm14"), concat!($add, " ymm4, ymm4, ymm12"),
                        concat!($mul, " ymm15, ymm13, ymm14"), concat!($add, " ymm5, ymm5, ymm15"),
                        concat!($mul, " ymm12, ymm13, ymm14"), concat!($add, " ymm6, ymm6, ymm12"),
                        concat!($mul, " ymm15, ymm13, ymm14"), concat!($add, " ymm7, ymm7, ymm15"),
                        concat!($mul, " ymm12, ymm13, ymm14"), concat!($add, " ymm8, ymm8, ymm12"),
                        concat!($mul, " ymm15, ymm13, ymm14"), concat!($add, " ymm9, ymm9, ymm15"),
                        concat!($mul, " ymm12, ymm13, ymm14"), concat!($add, " ymm10, ymm10, ymm12"),
                        concat!($mul, " ymm15, ymm13, ymm14"), concat!($add, " ymm11, ymm11, ymm15"),
                        "dec {n}",
                        "jnz 2b",
                        n = inout(reg) iters => _,
                        out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _, out("ymm5") _,
                        out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                        out("ymm12") _, out("ymm15") _,
                    );
                }
            }
        };
    }
    peak_loop!(madd_wd, "vpmaddwd", "vpaddd");
    peak_loop!(madd_ubsw, "vpmaddubsw", "vpaddw");
}
