//! Speculative decoding by prompt lookup against plain decode, side by side in interleaved
//! rounds, on three kinds of task per real model: rewriting code (the answer copies most of the
//! prompt), quoting a ~600-token document, and free chat (little to copy: the proposer must
//! back off). Greedy, 128 tokens, the default configuration (W8A8 prefill on the host executor,
//! decode on the CPU from the model file's own blocks). With `--llama-lookup`, llama.cpp's
//! `llama-lookup` (its n-gram cache speculation) on the same file and the same rendered prompt
//! in each round, and llama.cpp's plain decode (`llama-bench`, tg at the prompt's context).
//!
//! ```text
//! cargo run --release --example bench_speculative -- [--llama-lookup PATH] [--llama-bench PATH]
//! ```
//!
//! With `--draft-layers 10,20`, draft models of each model's own first layers instead of
//! prompt lookup (see [`drafts`]). With `--phone`, no timing: each task's greedy answer with a fixed draft of 15 tokens (the
//! plain answer, token for token) is priced on the phone model, for plain decode, CPU
//! verification and NPU verification (see [`phone`]).
//!
//! Decode tokens/s is over the tokens after the first (the prefill excluded), for us and for
//! llama.cpp (its "decoded N tokens in S seconds" line). The outputs are the same for our two
//! rows, token for token (`tests/speculative.rs`); llama.cpp's arithmetic differs, so its answer
//! and what it accepts may too.
#[path = "common/llama_bench.rs"]
mod llama_bench;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use candle_npu::sched::{AnalyticCosts, CostModel, Node, Processor, Rates};
use candle_npu::{ChunkPlan, NpuDevice, Tail};
use candle_npu_models::{assets, prefill_dag, CalibrationSet, GenerateOptions, LoadOptions, Message, Pipeline, SpeculationStats, Speculative, Verify};
use candle_npu_models::{PrefillOptions, PrefillRows};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// llama.cpp's `llama-lookup` (default: `$LLAMA_LOOKUP`; none: our rows only).
    #[arg(long)]
    llama_lookup: Option<PathBuf>,
    /// `llama-bench`, for llama.cpp's plain decode (default: `$LLAMA_BENCH`).
    #[arg(long)]
    llama_bench: Option<PathBuf>,
    /// Models: smollm2, qwen, gemma.
    #[arg(long, value_delimiter = ',', default_value = "smollm2,qwen,gemma")]
    models: Vec<String>,
    /// Tasks: code, quote, chat.
    #[arg(long, value_delimiter = ',', default_value = "code,quote,chat")]
    tasks: Vec<String>,
    /// Tokens generated per run.
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    /// Interleaved rounds; each figure is the median over them.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// llama.cpp's threads (ours: the engine's pool, every core unless `RAYON_NUM_THREADS` says).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Price each task's passes on the phone model instead of timing them here (see [`phone`]).
    #[arg(long)]
    phone: bool,
    /// Instead of prompt lookup, draft models made of each model's own first N layers, for each
    /// N given (see [`drafts`]).
    #[arg(long, value_delimiter = ',')]
    draft_layers: Vec<usize>,
}

const CODE: &str = r#"Rewrite this Python function with type hints and a docstring, keeping its logic and names:

def merge_intervals(intervals):
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]
"#;

const CHAT: &str = "Write a short story about a lighthouse keeper who finds a message in a bottle.";

/// The task's user message: the code rewrite, a question that quotes a document (~600 tokens of
/// held-out Wikipedia), or free chat.
fn task_prompt(p: &Pipeline, task: &str) -> Result<String> {
    Ok(match task {
        "code" => CODE.to_string(),
        "quote" => {
            let doc = p.decode_text(&p.heldout_tokens(600)?)?;
            format!("Here is a document:\n\n{doc}\n\nQuote its first two paragraphs exactly, word for word.")
        }
        "chat" => CHAT.to_string(),
        other => bail!("unknown task '{other}' (code, quote, chat)"),
    })
}

/// Decode tokens/s and the speculation stats of one greedy answer to `prompt`.
fn ours(p: &mut Pipeline, prompt: &str, tokens: usize, speculative: Speculative) -> Result<(f64, candle_npu_models::SpeculationStats, usize)> {
    let opts = GenerateOptions { sample_len: tokens, speculative, ..Default::default() };
    let (_, stats) = p.session().chat(p, &[Message::user(prompt)], &opts, |_| {})?;
    Ok((stats.decode_tokens_per_sec(), stats.speculation, stats.generated_tokens))
}

/// llama-lookup's decode tokens/s and acceptance on the rendered prompt `text`.
fn llama_lookup(bin: &Path, model: &Path, text: &str, tokens: usize, threads: usize) -> Result<(f64, usize, usize)> {
    let out = Command::new(bin)
        .args(["-m"])
        .arg(model)
        .args(["-p", text, "-n", &tokens.to_string(), "-t", &threads.to_string(), "--temp", "0", "-c", "4096"])
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    let log = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("{} failed: {}", bin.display(), log.lines().rev().take(5).collect::<Vec<_>>().join(" | "));
    }
    // Lines like "0.00.329.211 I n_drafted    = 15" (a timestamp and level first).
    let field = |key: &str| {
        log.lines().find_map(|l| l.split_once(&format!(" {key} ")).and_then(|(_, v)| v.trim_start().strip_prefix('=')).map(|v| v.trim().to_string()))
    };
    let speed = log
        .lines()
        .find_map(|l| {
            l.split("decoded").nth(1).and_then(|s| s.split("speed:").nth(1)).and_then(|s| s.split_whitespace().next()).and_then(|s| s.parse::<f64>().ok())
        })
        .context("no 'decoded ... speed' line in llama-lookup's output")?;
    let num = |key: &str| field(key).and_then(|v| v.parse::<usize>().ok()).unwrap_or(0);
    Ok((speed, num("n_drafted"), num("n_accept")))
}

/// Milliseconds of a verification pass of `k` rows (`Model::decode_rows`) after a short
/// prompt (the chat task's), median of 9, each rewound: what its extra rows cost against one step.
fn pass_ms(p: &mut Pipeline, k: usize) -> Result<f64> {
    p.model.clear();
    let prompt = p.encode_piece(CHAT)?;
    p.model.extend(&prompt, &PrefillOptions::default().all_logits().rows(PrefillRows::Cpu))?;
    let base = p.model.position();
    let rows: Vec<u32> = prompt.iter().cycle().take(k).copied().collect();
    let mut ms = vec![];
    for _ in 0..9 {
        let t = std::time::Instant::now();
        p.model.decode_rows(&rows)?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        p.model.rewind(base)?;
    }
    p.model.clear();
    Ok(median(ms))
}

/// Bytes per second one processor of a Snapdragon 8 Gen 3 reads in decode: HeteroLLM measures 40
/// to 45 GB/s for any one of CPU, GPU and NPU; docs/aarch64.md's 55-60% of LPDDR5X's 77 GB/s is
/// 42.4-46.2. The middle of the latter.
const PHONE_BYTES_PER_SEC: f64 = 44.3e9;

/// Seconds, on the phone model, of a CPU decode step and of an NPU verification pass at
/// `position`, and the pass's stage graphs (for a per-graph handoff cost).
///
/// - The step reads the decode weights (the file's blocks), the output table and the KV cache
///   once: memory-bound ([`PHONE_BYTES_PER_SEC`]).
/// - The pass is one 32-row chunk through the prefill DAG, priced by [`AnalyticCosts`] with
///   [`Rates::SNAPDRAGON_8_GEN_3_KERNELS`] at `position` (its attention over the cache). One chunk
///   has nothing to overlap, so its NPU and CPU nodes add up; attention is `rows` rows' (padding
///   rows do not attend: `attention::causal`). The NPU's share is at least its
///   INT8 weights read at the same bandwidth. Then the CPU computes the rows' logits, which
///   reads the output table once.
fn phone_costs(p: &Pipeline, position: usize, rows: usize) -> Result<(f64, f64, usize)> {
    let (m, cfg) = (&p.model, p.model.config());
    let kv_bytes = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 4 * position;
    let output = m.output().bytes() as f64 / PHONE_BYTES_PER_SEC;
    let step = (m.linears().map(|l| l.decode().bytes()).sum::<usize>() + kv_bytes) as f64 / PHONE_BYTES_PER_SEC + output;
    let shape = m.layer_shape();
    let costs = AnalyticCosts { shape, rates: Rates::SNAPDRAGON_8_GEN_3_KERNELS };
    let dag = prefill_dag(&ChunkPlan::new(32, 32, usize::MAX, Tail::Pad)?, cfg.n_layer)?;
    let (mut npu, mut cpu, mut graphs) = (0.0, 0.0, 0);
    for n in dag.nodes() {
        let rows = if n.stage_name == "attn" { rows } else { n.rows };
        let c = costs.cost(&Node { start: position, rows, ..n.clone() });
        match n.processor {
            Processor::Npu => (npu, graphs) = (npu + c, graphs + 1),
            Processor::Cpu => cpu += c,
        }
    }
    let int8: usize = ["qkv", "o", "gate_up", "down"].iter().filter_map(|s| shape.linear_macs(s)).sum::<usize>() * cfg.n_layer;
    Ok((step, npu.max(int8 as f64 / PHONE_BYTES_PER_SEC) + cpu + output, graphs))
}

/// The `--phone` table: each task's answer (greedy; prompt lookup with a fixed draft of 15, a
/// pass at every match, and with the default adaptive draft as this machine's costs decide it)
/// priced on the phone model ([`phone_costs`], at the middle of the
/// answer). A token comes from the prefill, a plain step, a pass's first row or an accepted
/// proposal, so the answer took `generated - 1 - passes - accepted` plain steps besides its passes.
/// - plain: every token a step;
/// - CPU verification: a pass is a step and `c` of a step per proposed token, `c` this machine's
///   measured extra-row cost at 16 rows (the phone's own is not measured);
/// - NPU verification: a pass is [`phone_costs`]' pass, whatever its rows; without and with a
///   handoff of 100 µs per stage graph (assumed: HeteroLLM polls because `usleep`'s 80-100 µs
///   granularity is too coarse for its NPU-GPU hand-offs).
fn phone(args: &Args) -> Result<()> {
    println!("Prompt lookup priced on the phone model (model estimate): Snapdragon 8 Gen 3, {:.1} GB/s per processor, NPU and CPU rates of Rates::SNAPDRAGON_8_GEN_3_KERNELS; greedy answers of {} tokens computed here, with a fixed draft of 15 and with the adaptive default\n", PHONE_BYTES_PER_SEC / 1e9, args.tokens);
    println!("| model | task | draft | tokens | passes | accepted / proposed | step ms | NPU pass ms | plain tok/s | CPU verification tok/s (c), x plain | NPU verification tok/s, x plain | with 100 µs per graph |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for name in &args.models {
        let (_, mut p) = load_calibrated(name)?;
        let c = (pass_ms(&mut p, 16)? / pass_ms(&mut p, 1)? - 1.0) / 15.0;
        for task in &args.tasks {
            let prompt = task_prompt(&p, task)?;
            let fixed = Speculative::Lookup { ngram_max: 3, ngram_min: 2, max_draft: 15, adaptive: false, verify: Verify::Cpu };
            for (draft, speculative) in [("15", fixed), ("adaptive", Speculative::lookup())] {
                let opts = GenerateOptions { sample_len: args.tokens, speculative, ..Default::default() };
                let (_, stats) = p.session().chat(&p, &[Message::user(&prompt)], &opts, |_| {})?;
                let (n, SpeculationStats { passes, proposed, accepted }) = (stats.generated_tokens, stats.speculation);
                if n < 2 {
                    println!("| {name} | {task} | {draft} | {n} | - | - | - | - | - | - | - | - |");
                    continue;
                }
                let (step, pass, graphs) = phone_costs(&p, stats.prompt_tokens + n / 2, 1 + proposed / passes.max(1))?;
                let plain_steps = n.saturating_sub(1 + passes + accepted) as f64;
                let tps = |secs: f64| (n - 1) as f64 / secs;
                let plain = tps((n - 1) as f64 * step);
                let cpu = tps(plain_steps * step + passes as f64 * step + proposed as f64 * c * step);
                let npu = |handoff: f64| tps(plain_steps * step + passes as f64 * (pass + handoff * graphs as f64));
                println!(
                    "| {name} | {task} | {draft} | {n} | {passes} | {accepted} / {proposed} | {:.2} | {:.2} | {plain:.0} | {:.0} ({c:.2}), {:.2}x | {:.0}, {:.2}x | {:.0}, {:.2}x |",
                    step * 1e3,
                    pass * 1e3,
                    cpu,
                    cpu / plain,
                    npu(0.0),
                    npu(0.0) / plain,
                    npu(100e-6),
                    npu(100e-6) / plain,
                );
            }
        }
    }
    Ok(())
}

/// The `--draft-layers` table: per model and task, plain decode against a draft of the model's
/// own first N layers (on the CPU, F32 prefill of the draft's catch-up), with a fixed draft of 4
/// tokens a pass and with the adaptive default, in interleaved rounds.
fn drafts(args: &Args) -> Result<()> {
    println!("A draft of the model's own first N layers vs plain decode, greedy, {} tokens, median of {} interleaved rounds\n", args.tokens, args.rounds);
    println!(
        "| model | task | draft layers | plain tok/s | fixed draft of 4: tok/s, accepted / proposed | adaptive: tok/s, x plain, accepted / proposed (passes) |"
    );
    println!("|---|---|---|---|---|---|");
    for name in &args.models {
        let (path, mut p) = load_calibrated(name)?;
        for &n in &args.draft_layers {
            let opts = LoadOptions { precision: Some(candle_npu_models::Precision::F32), layers: Some(n), ..Default::default() };
            p.set_draft(Pipeline::load(&path, None, &NpuDevice::host(), opts)?)?;
            for task in &args.tasks {
                let prompt = task_prompt(&p, task)?;
                let fixed = Speculative::Draft { max_draft: 4, adaptive: false, verify: Verify::Cpu };
                let (mut plain, mut fx, mut ad) = (vec![], vec![], vec![]);
                let (mut fs, mut ads) = (SpeculationStats::default(), SpeculationStats::default());
                for round in 0..args.rounds {
                    let order: [usize; 3] = if round % 2 == 0 { [0, 1, 2] } else { [2, 1, 0] };
                    for which in order {
                        let spec = [Speculative::Off, fixed, Speculative::draft()][which];
                        let (tps, s, _) = ours(&mut p, &prompt, args.tokens, spec)?;
                        match which {
                            0 => plain.push(tps),
                            1 => (fx, fs) = ([fx, vec![tps]].concat(), s),
                            _ => (ad, ads) = ([ad, vec![tps]].concat(), s),
                        }
                    }
                }
                let (plain, fx, ad) = (median(plain), median(fx), median(ad));
                println!(
                    "| {name} | {task} | {n} of {} | {plain:.1} | {fx:.1}, {} / {} | {ad:.1}, {:.2}x, {} / {} ({}) |",
                    p.model.config().n_layer,
                    fs.accepted,
                    fs.proposed,
                    ad / plain,
                    ads.accepted,
                    ads.proposed,
                    ads.passes
                );
            }
        }
    }
    Ok(())
}

/// The real model `name` (smollm2, qwen, gemma), its path, in the default configuration with its
/// quant profile (calibrated on first use).
fn load_calibrated(name: &str) -> Result<(PathBuf, Pipeline)> {
    let path = assets::real_model(name).with_context(|| format!("unknown model '{name}' (smollm2, qwen, gemma)"))??;
    let mut p = Pipeline::load(&path, None, &NpuDevice::host(), LoadOptions::default())?;
    p.ensure_profile(None, CalibrationSet::default(), |_, _| {})?;
    Ok((path, p))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.rounds == 0 || args.tokens < 2 {
        bail!("--rounds must be at least 1 and --tokens at least 2");
    }
    if args.phone {
        return phone(&args);
    }
    if !args.draft_layers.is_empty() {
        return drafts(&args);
    }
    let lookup_bin = args.llama_lookup.clone().or_else(|| std::env::var_os("LLAMA_LOOKUP").map(PathBuf::from));
    let bench_bin = llama_bench::binary(args.llama_bench.as_deref());
    println!(
        "Prompt lookup vs plain decode, greedy, {} tokens, {} threads, median of {} interleaved rounds{}\n",
        args.tokens,
        args.threads,
        args.rounds,
        if lookup_bin.is_some() { "; llama.cpp: llama-lookup and llama-bench on the same file" } else { " (no --llama-lookup: our rows only)" }
    );
    println!("| model | task | tokens | plain tok/s | lookup tok/s | x plain | accepted / proposed (passes) | llama.cpp plain tok/s | llama-lookup tok/s (accepted / drafted) | x llama-lookup |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut costs = vec![];
    for name in &args.models {
        let (path, mut p) = load_calibrated(name)?;
        let one = pass_ms(&mut p, 1)?;
        let mut row = format!("| {name} | {one:.2}");
        for k in [2, 4, 8, 16] {
            row += &format!(" | {:.2}", (pass_ms(&mut p, k)? / one - 1.0) / (k - 1) as f64);
        }
        costs.push(row + " |");
        for task in &args.tasks {
            let prompt = task_prompt(&p, task)?;
            let rendered = p.decode_text(&p.encode_chat(&[Message::user(&prompt)], true, false)?)?;
            let (mut plain, mut spec, mut ll, mut lp) = (vec![], vec![], vec![], vec![]);
            let (mut stats, mut ll_acc, mut generated) = (Default::default(), (0, 0), 0);
            for round in 0..args.rounds {
                // Which of the two runs first alternates, so that an order effect cancels (a
                // lookup run without a pass, the plain run's work, measured 4% slower when always
                // second).
                for first in [round % 2 == 0, round % 2 == 1] {
                    if first {
                        let (tps, _, n) = ours(&mut p, &prompt, args.tokens, Speculative::Off)?;
                        plain.push(tps);
                        generated = n;
                    } else {
                        let (tps, s, _) = ours(&mut p, &prompt, args.tokens, Speculative::lookup())?;
                        spec.push(tps);
                        stats = s;
                    }
                }
                if let Some(bin) = &lookup_bin {
                    let (tps, drafted, accepted) = llama_lookup(bin, &path, &rendered, args.tokens, args.threads)?;
                    ll.push(tps);
                    ll_acc = (accepted, drafted);
                }
                if let Some(bin) = &bench_bin {
                    let context = p.encode_chat(&[Message::user(&prompt)], true, false)?.len();
                    lp.push(llama_bench::avg_ts(bin, &path, &["-p", "0", "-n", &args.tokens.to_string(), "-d", &context.to_string()], args.threads)?);
                }
            }
            let (plain, spec) = (median(plain), median(spec));
            let opt = |v: Vec<f64>| if v.is_empty() { None } else { Some(median(v)) };
            let (ll, lp) = (opt(ll), opt(lp));
            let f = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
            println!(
                "| {name} | {task} | {generated} | {plain:.1} | {spec:.1} | {:.2} | {} / {} ({}) | {} | {} | {} |",
                spec / plain,
                stats.accepted,
                stats.proposed,
                stats.passes,
                f(lp),
                ll.map_or("-".into(), |v| format!("{v:.1} ({} / {})", ll_acc.0, ll_acc.1)),
                ll.map_or("-".into(), |v| format!("{:.2}", spec / v)),
            );
        }
    }
    println!("\nA verification pass's extra rows: ms of one decode step after the chat prompt, and each extra row's cost as a share of it, for passes of k rows (median of 9)\n");
    println!("| model | step ms | k = 2 | k = 4 | k = 8 | k = 16 |");
    println!("|---|---|---|---|---|---|");
    costs.iter().for_each(|r| println!("{r}"));
    Ok(())
}
