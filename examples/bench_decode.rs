//! Decode throughput, side by side in one run, in interleaved rounds: this engine's CPU decode
//! reading the model file's own blocks (the default), the same engine on a Q8_0 copy made from
//! the NPU's INT8 weights (the default before 2026-11-26), and llama.cpp's `llama-bench` on the
//! same file, for the three real models, at a context of 64 and 2048 tokens, on a quiet machine
//! and beside a busy process (a shell spinning on one core: on a phone, every other app). Also
//! the machine's memory bandwidth (a STREAM-like read of a buffer far larger than the caches),
//! the limit decode is measured against: the bytes one token reads (weights, the output
//! matrix, the KV rows) over the bandwidth.
//!
//! ```text
//! cargo run --release --example bench_decode -- [--llama-bench PATH] [--models smollm2,qwen,gemma]
//! ```
//!
//! llama.cpp is not part of this repository: build `llama-bench` from the PyPI
//! `llama-cpp-python` sdist's vendored source (cmake) and give its path (or `$LLAMA_BENCH`).
#[path = "common/llama_bench.rs"]
mod llama_bench;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_npu::NpuDevice;
use candle_npu_models::{assets, CalibrationSet, DecodeWeights, LoadOptions, Pipeline, Precision, PrefillOptions, Sequence};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// `llama-bench` binary for the llama.cpp rows (default: `$LLAMA_BENCH`; none: our rows only).
    #[arg(long)]
    llama_bench: Option<PathBuf>,
    /// Models: smollm2, qwen, gemma.
    #[arg(long, value_delimiter = ',', default_value = "smollm2,qwen,gemma")]
    models: Vec<String>,
    /// Decoded tokens per measurement.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Interleaved rounds; each figure is the median over them.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Contexts (tokens in the KV cache before decoding).
    #[arg(long, value_delimiter = ',', default_value = "64,2048")]
    contexts: Vec<usize>,
    /// Threads of llama.cpp and of the bandwidth probe (ours runs on every core: rayon's pool,
    /// which `RAYON_NUM_THREADS` sizes).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// The chat case: prompts of these lengths, then `--chat-tokens` generated, end to end.
    #[arg(long, value_delimiter = ',', default_value = "42,600")]
    chat: Vec<usize>,
    /// Skip the chat case.
    #[arg(long)]
    no_chat: bool,
    /// Tokens generated in the chat case.
    #[arg(long, default_value_t = 128)]
    chat_tokens: usize,
    /// Batched decode instead: this many conversations on one loaded model, every step one
    /// `decode_sequences` pass over all of them (e.g. `--streams 1,2,4`); aggregate tokens/s.
    #[arg(long, value_delimiter = ',')]
    streams: Vec<usize>,
}

/// A process spinning on one core until dropped.
struct Busy(Child);

impl Busy {
    fn start() -> Result<Self> {
        Ok(Busy(Command::new("sh").args(["-c", "while :; do :; done"]).stdout(Stdio::null()).spawn().context("starting the busy process")?))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Read bandwidth, GB/s: the best of 5 sums over a 512 MiB buffer, `threads` threads.
fn bandwidth(threads: usize) -> f64 {
    let words: usize = 64 << 20; // 512 MiB of u64
    let buf: Vec<u64> = (0..words as u64).collect();
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let sum: u64 = std::thread::scope(|s| {
            let chunk = words.div_ceil(threads);
            let hs: Vec<_> = buf.chunks(chunk).map(|c| s.spawn(move || c.iter().fold(0u64, |a, &v| a.wrapping_add(v)))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).fold(0, u64::wrapping_add)
        });
        std::hint::black_box(sum);
        best = best.max((words * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// Our decode tokens/s after `context` tokens in the cache (filled by the engine's prefill).
fn ours(p: &mut Pipeline, context: usize, tokens: usize) -> Result<f64> {
    let prompt: Vec<u32> = (0..context as u32).map(|i| 100 + i % 1000).collect();
    p.model.prefill(&prompt, &PrefillOptions::default())?;
    let mut next = 1u32;
    let t = Instant::now();
    for _ in 0..tokens {
        next = candle_npu_models::logits::argmax(&p.model.decode(next)?)?;
    }
    Ok(tokens as f64 / t.elapsed().as_secs_f64())
}

/// Aggregate decode tokens/s of `streams` conversations on one model, each with `context`
/// tokens in its cache (different prompts), every step one pass over the weights for all of them.
fn ours_batched(p: &Pipeline, context: usize, tokens: usize, streams: usize) -> Result<f64> {
    let m = &p.model;
    let mut seqs: Vec<Sequence> = (0..streams).map(|_| m.sequence()).collect();
    let mut next = vec![];
    for (i, s) in seqs.iter_mut().enumerate() {
        let prompt: Vec<u32> = (0..context as u32).map(|j| 100 + (j + 7 * i as u32) % 1000).collect();
        next.push(candle_npu_models::logits::argmax(&m.prefill_sequence(s, &prompt, &PrefillOptions::default())?)?);
    }
    let t = Instant::now();
    for _ in 0..tokens {
        let mut batch: Vec<(&mut Sequence, &[u32])> = seqs.iter_mut().zip(&next).map(|(s, t)| (s, std::slice::from_ref(t))).collect();
        let rows = m.decode_sequences(&mut batch)?;
        next = (0..streams).map(|i| Ok(candle_npu_models::logits::argmax(&rows.get(i)?)?)).collect::<Result<_>>()?;
    }
    Ok((tokens * streams) as f64 / t.elapsed().as_secs_f64())
}

/// Batched decode: per model and context, aggregate tokens/s for each count of `streams`,
/// interleaved rounds, and the ratio to one stream.
fn batched(args: &Args) -> Result<()> {
    if args.streams.contains(&0) {
        bail!("--streams: every count must be at least 1");
    }
    println!("Batched decode, aggregate tokens/s, median of {} interleaved rounds of {} steps", args.rounds, args.tokens);
    println!("\n| model | context | streams | aggregate tok/s | per stream | against 1 stream |");
    println!("|---|---|---|---|---|---|");
    for m in &args.models {
        let (path, name) = model(m)?;
        let p = load(&path, DecodeWeights::Checkpoint)?;
        for &context in &args.contexts {
            let mut runs = vec![vec![]; args.streams.len()];
            for _ in 0..args.rounds {
                for (r, &n) in runs.iter_mut().zip(&args.streams) {
                    r.push(ours_batched(&p, context, args.tokens, n)?);
                }
            }
            let medians: Vec<f64> = runs.into_iter().map(median).collect();
            let one = match args.streams.iter().position(|&n| n == 1) {
                Some(i) => medians[i],
                None => ours_batched(&p, context, args.tokens, 1)?,
            };
            for (&agg, &n) in medians.iter().zip(&args.streams) {
                println!("| {name} | {context} | {n} | {agg:.1} | {:.1} | {:.2}x |", agg / n as f64, agg / one);
            }
        }
    }
    Ok(())
}

/// The model at `path` on the host executor, W8A8 with its profile, decoding `decode_weights`.
fn load(path: &Path, decode_weights: DecodeWeights) -> Result<Pipeline> {
    let opts = LoadOptions { precision: Some(Precision::W8A8), decode_weights, ..Default::default() };
    let mut p = Pipeline::load(path, None, &NpuDevice::host(), opts)?;
    p.ensure_profile(None, CalibrationSet::default(), |_, _| {})?;
    Ok(p)
}

/// A model's file and short name from its `--models` name.
fn model(m: &str) -> Result<(PathBuf, &'static str)> {
    Ok(match m {
        "smollm2" => (assets::smollm2(), "smollm2"),
        "qwen" => (assets::qwen25_coder_05b()?, "qwen25-coder-05b"),
        "gemma" => (assets::gemma3_270m()?, "gemma3-270m"),
        other => bail!("unknown model {other}: smollm2, qwen or gemma"),
    })
}

/// Seconds of a chat turn on our engine: the prompt's prefill (chunked, on the host executor's
/// W8A8 graphs) and `tokens` greedy decode steps, from an empty cache.
fn ours_chat(p: &mut Pipeline, prompt: usize, tokens: usize) -> Result<f64> {
    let prompt: Vec<u32> = (0..prompt as u32).map(|i| 100 + i % 1000).collect();
    let t = Instant::now();
    let mut next = candle_npu_models::logits::argmax(&p.model.prefill(&prompt, &PrefillOptions::default())?)?;
    for _ in 0..tokens {
        next = candle_npu_models::logits::argmax(&p.model.decode(next)?)?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Seconds of llama-bench's prompt + generation test (`-pg prompt,tokens`), one repetition: its
/// `avg_ts` counts the prompt and the generated tokens over the whole time.
fn llama_chat(bin: &Path, model: &Path, prompt: usize, tokens: usize, threads: usize) -> Result<f64> {
    let tps = llama_bench::avg_ts(bin, model, &["-p", "0", "-n", "0", "-pg", &format!("{prompt},{tokens}")], threads)?;
    Ok((prompt + tokens) as f64 / tps)
}

/// llama-bench's decode tokens/s (`tg`) after `context` tokens (`-d`), one repetition.
fn llama(bin: &Path, model: &Path, context: usize, tokens: usize, threads: usize) -> Result<f64> {
    llama_bench::avg_ts(bin, model, &["-p", "0", "-n", &tokens.to_string(), "-d", &context.to_string()], threads)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args = Args::parse();
    let llama_bench = llama_bench::binary(args.llama_bench.as_deref());
    if args.rounds == 0 || args.tokens == 0 {
        bail!("--rounds and --tokens must be at least 1");
    }
    if !args.streams.is_empty() {
        return batched(&args);
    }
    let bw = bandwidth(args.threads);
    println!("Memory read bandwidth ({} threads, 512 MiB, best of 5): {bw:.1} GB/s", args.threads);
    println!(
        "Decode tokens/s, median of {} interleaved rounds of {} tokens, ours on every core, llama.cpp on {} threads{}",
        args.rounds,
        args.tokens,
        args.threads,
        if llama_bench.is_some() { "; llama.cpp: llama-bench on the same file" } else { " (no --llama-bench: our rows only)" }
    );
    println!("\n| model | context | load | ours, the file's blocks | ours, Q8_0 copy | llama.cpp | file's / llama.cpp | file's / Q8_0 copy | file's: GB/s read (share of {bw:.0}) |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut chat = vec![];
    for m in &args.models {
        let (path, name) = model(m)?;
        let (mut file, mut q8) = (load(&path, DecodeWeights::Checkpoint)?, load(&path, DecodeWeights::Q8_0)?);
        // Bytes one decode step reads: every decode weight as stored and, per context token, a K
        // and a V row per layer in f32.
        let cfg = file.model.config().clone();
        let weights: usize = file.model.linears().map(|l| l.decode().bytes()).sum::<usize>() + file.model.output().bytes();
        let kv_row = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 4;
        for &context in &args.contexts {
            for busy in [false, true] {
                let (mut a, mut b, mut c) = (vec![], vec![], vec![]);
                for _ in 0..args.rounds {
                    let _load = if busy { Some(Busy::start()?) } else { None };
                    a.push(ours(&mut file, context, args.tokens)?);
                    c.push(ours(&mut q8, context, args.tokens)?);
                    if let Some(bin) = &llama_bench {
                        b.push(llama(bin, &path, context, args.tokens, args.threads)?);
                    }
                }
                let (ours, q8_copy) = (median(a), median(c));
                let bytes = weights as f64 + (context as f64) * kv_row as f64;
                let gbs = ours * bytes / 1e9;
                let (theirs, ratio) = match b.is_empty() {
                    true => ("-".to_string(), "-".to_string()),
                    false => {
                        let t = median(b);
                        (format!("{t:.1}"), format!("{:.2}x", ours / t))
                    }
                };
                let load = if busy { "busy process" } else { "quiet" };
                println!(
                    "| {name} | {context} | {load} | {ours:.1} | {q8_copy:.1} | {theirs} | {ratio} | {:.2}x | {gbs:.1} ({:.0}%) |",
                    ours / q8_copy,
                    100.0 * gbs / bw
                );
            }
        }
        drop(q8);
        for &prompt in args.chat.iter().filter(|_| !args.no_chat) {
            let (mut a, mut b) = (vec![], vec![]);
            for _ in 0..args.rounds {
                a.push(ours_chat(&mut file, prompt, args.chat_tokens)?);
                if let Some(bin) = &llama_bench {
                    b.push(llama_chat(bin, &path, prompt, args.chat_tokens, args.threads)?);
                }
            }
            let ours = median(a);
            let (theirs, ratio) = match b.is_empty() {
                true => ("-".to_string(), "-".to_string()),
                false => {
                    let t = median(b);
                    (format!("{t:.2} s"), format!("{:.2}x", t / ours))
                }
            };
            chat.push(format!("| {name} | {prompt} + {} | {ours:.2} s | {theirs} | {ratio} |", args.chat_tokens));
        }
    }
    if !chat.is_empty() {
        println!(
            "\nChat end to end: a prompt's prefill and {} generated tokens, from an empty cache, quiet; median of {} rounds",
            args.chat_tokens, args.rounds
        );
        println!("\n| model | prompt + generated | ours | llama.cpp | llama.cpp time / ours |");
        println!("|---|---|---|---|---|");
        chat.iter().for_each(|r| println!("{r}"));
    }
    Ok(())
}
