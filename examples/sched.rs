//! Out-of-order prefill (llm.npu §3.4, HeteroLLM's margin), measured and simulated on SmolLM2.
//!
//! Sections (`--sections`, all by default):
//! - `real`: prefill tokens/s and NPU/CPU bubble rates of every policy at `--lens`, host
//!   executor as the NPU: the NPU queue on one core (`npu_threads: 1`) and the CPU stages on the
//!   other (`RAYON_NUM_THREADS=1`, set here when unset); in-order also with the GEMMs on both
//!   cores (its best case on this machine). Writes the Gantt chart of in-order vs the fastest
//!   policy to `--png`, and, with `--trace-dir`, a Perfetto trace per run.
//! - `shared` (on its own: every stage may use every core, as in the CLI): time to first token
//!   for 24-, 100- and 300-token prompts, padded vs margin, and prefill tokens/s per policy.
//! - `sim`: the simulator with (a) stage costs fit on this machine's in-order runs (checked
//!   against the real runs), and (c) a Snapdragon 8 Gen 3 model ([`Rates::SNAPDRAGON_8_GEN_3`],
//!   calibrated on llm.npu's published split) for SmolLM2 and the paper's Qwen1.5-1.8B;
//!   makespan, utilisations and the lower bound per policy at 256/1024/2048 tokens and chunk
//!   lengths 64/128/256; then the contribution heuristic's sensitivity to its terms.
//!   (b), the HTP emulator's profile, is `examples/htp_cycles.rs`.
//! - `tail` (on its own, simulated only): a prompt's last rows padded onto the NPU or run as a
//!   CPU margin, on the Snapdragon 8 Gen 3 model, for the three real models: why a real NPU's
//!   default is `Tail::Pad` (`SchedOptions::for_device`).
//! - `phone` (on its own, simulated only): projected prefill tokens/s and NPU/CPU busy shares of
//!   the three real models and of the published anchors' models on the Snapdragon 8 Gen 3 model,
//!   at 256 and 1024 tokens, and how much faster its NPU or CPU would have to be to reach each
//!   anchor; then the same with the CPU rates our aarch64 kernels' llvm-mca estimates give
//!   ([`Rates::SNAPDRAGON_8_GEN_3_KERNELS`], docs/aarch64.md).
//!
//! ```text
//! cargo run --release --example sched
//! cargo run --release --example sched -- --sections shared
//! ```
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_npu::sched::{
    lower_bound, predict_whole, simulate, Activations, AnalyticCosts, ContributionWeights, CostModel, HtpRates, HtpStageCosts, LayerShape, ModelShape, Policy,
    Prediction, Processor, Rates, Schedule, SubgraphDag, TableCosts, Trace, WholePlan,
};
use candle_npu::{ChunkPlan, NpuDevice, Tail};
use candle_npu_models::PrefillOptions;
use candle_npu_models::{assets, prefill_dag, CalibrationSet, DecodeWeights, LoadOptions, Pipeline, Precision, SchedOptions};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// Which sections to run: real, sim (which needs real), or shared alone.
    #[arg(long, value_delimiter = ',', default_value = "real,sim")]
    sections: Vec<String>,
    /// Prompt lengths of the throughput tables.
    #[arg(long, value_delimiter = ',', default_value = "256,1024,2048")]
    lens: Vec<usize>,
    /// Rows of the static NPU graphs in the real runs.
    #[arg(long, default_value_t = 256)]
    chunk_len: usize,
    /// Timed runs per configuration (best is kept), after one warm-up.
    #[arg(long, default_value_t = 2)]
    reps: usize,
    /// The Gantt chart of the real runs (in-order vs the fastest policy at the middle length).
    #[arg(long, default_value = "docs/sched_gantt.png")]
    png: PathBuf,
    /// A TrueType font for the chart's labels.
    #[arg(long, default_value = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")]
    font: PathBuf,
    /// Folder for a Chrome/Perfetto trace of every real run.
    #[arg(long)]
    trace_dir: Option<PathBuf>,
    /// With `--sections phone`: every prediction as one JSON object per line.
    #[arg(long)]
    json: bool,
}

/// A real-run configuration: a label, the policy, the NPU queue's threads, the tail.
struct Config {
    label: String,
    policy: Policy,
    npu_threads: usize,
    tail: Tail,
}

fn configs(tail: Tail) -> Vec<Config> {
    let mut v = vec![Config { label: "in-order, GEMMs on 2 cores".into(), policy: Policy::InOrder, npu_threads: 2, tail }];
    v.extend(Policy::heuristics().into_iter().map(|policy| Config { label: policy.name().into(), policy, npu_threads: 1, tail }));
    v
}

/// A finished real run: its best seconds and the DAG and schedule of that run.
struct Run {
    secs: f64,
    dag: SubgraphDag,
    schedule: Schedule,
}

fn measure(p: &mut Pipeline, c: &Config, tokens: &[u32], chunk: usize, reps: usize) -> Result<Run> {
    // Every chunk in flight: the DAG's schedule, unconstrained (the simulator's assumption).
    let sched = SchedOptions {
        policy: c.policy.clone(),
        tail: c.tail,
        npu_threads: Some(c.npu_threads),
        small_chunks: vec![],
        chunks_in_flight: usize::MAX,
        ..Default::default()
    };
    p.model.set_sched(sched)?;
    p.model.prefill(tokens, &PrefillOptions::chunked(chunk))?;
    let mut best: Option<Run> = None;
    for _ in 0..reps {
        let t = Instant::now();
        p.model.prefill(tokens, &PrefillOptions::chunked(chunk))?;
        let secs = t.elapsed().as_secs_f64();
        if best.as_ref().is_none_or(|b| secs < b.secs) {
            let (dag, schedule) = p.model.last_run().map(|r| (*r).clone()).ok_or_else(|| anyhow!("prefill recorded no schedule"))?;
            best = Some(Run { secs, dag, schedule });
        }
    }
    best.ok_or_else(|| anyhow!("--reps must be at least 1"))
}

/// The three real models: a name for tables and the checkpoint.
fn real_models() -> Result<[(&'static str, PathBuf); 3]> {
    Ok([("SmolLM2-135M", assets::smollm2()), ("Gemma 3 270M", assets::gemma3_270m()?), ("Qwen2.5-Coder-0.5B", assets::qwen25_coder_05b()?)])
}

/// Simulated prefill makespans on the phone model ([`Rates::SNAPDRAGON_8_GEN_3`], FIFO, graphs of
/// 256 and 32 rows): the last rows padded onto the NPU against a CPU margin.
fn tail_on_the_phone() -> Result<()> {
    let lens = [20usize, 37, 100, 300, 700, 1500];
    println!("## Simulated prefill, Snapdragon 8 Gen 3 model, FIFO, graphs of 256 and 32 rows: ms padded / ms margin (ratio)");
    println!("| model | {} |\n|---|{}", lens.map(|n| format!("{n} tokens")).join(" | "), "---|".repeat(lens.len()));
    for (_, path) in real_models()? {
        let p = Pipeline::load(&path, None, &NpuDevice::host(), LoadOptions::default())?;
        let costs = AnalyticCosts { shape: p.model.layer_shape(), rates: Rates::SNAPDRAGON_8_GEN_3 };
        let n_layer = p.model.config().n_layer;
        let makespan = |n: usize, tail: Tail| -> Result<f64> {
            let plan = ChunkPlan::with_sizes(n, &[256, 32], p.model.config().context_len, tail)?;
            Ok(simulate(&prefill_dag(&plan, n_layer)?, &costs, &Policy::Fifo)?.makespan)
        };
        let cells = lens
            .iter()
            .map(|&n| {
                let (pad, margin) = (makespan(n, Tail::Pad)?, makespan(n, Tail::Margin)?);
                Ok(format!("{:.1} / {:.1} ({:.2}x)", 1e3 * pad, 1e3 * margin, pad / margin))
            })
            .collect::<Result<Vec<_>>>()?;
        println!("| {} | {} |", path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default(), cells.join(" | "));
    }
    Ok(())
}

/// The phone model of issue 48 ([`HtpRates`], docs/phone_model.md): first the published anchors
/// under their own plans (AI Hub's Llama-3.2-1B w4a16 on the 8 Elite, mllm's Qwen3-1.7B W4A16
/// and llm.npu's Qwen1.5-1.8B W8A8 on the 8 Gen 3), then this project's plans for the three real
/// models and the 1B / 1.7B / 1.8B / 3B shapes at 1024 tokens on the 8 Gen 3, each at a launch
/// cost of 0.3 ms and of 2 ms per graph execution (the published range's nominal and llm.npu's).
/// With `json`, one JSON object per line instead of the tables.
fn phone_projections(json: bool) -> Result<()> {
    let v75 = HtpRates::SNAPDRAGON_8_GEN_3;
    let launches = [0.3e-3, 2e-3];
    let shape = |hidden, ffn, n_head, n_kv_head, head_dim, n_layer, vocab| ModelShape {
        layer: LayerShape { hidden, ffn, n_head, n_kv_head, head_dim },
        n_layer,
        vocab,
    };
    let llama_1b = shape(2048, 8192, 32, 8, 64, 16, 128256);
    let qwen3 = shape(2048, 6144, 16, 8, 128, 28, 151936);
    let qwen15 = shape(2048, 5504, 16, 16, 128, 24, 151936);
    let qwen25_3b = shape(2048, 11008, 16, 2, 128, 36, 151936);
    let cpu = Rates::SNAPDRAGON_8_GEN_3;
    // llm.npu's plan: the prefill DAG of 256-row chunks (the last padded), FIFO, NPU stages W8A8.
    let stages_on = move |m: &ModelShape, n: usize, rates: HtpRates, cpu: Rates| -> Result<Prediction> {
        let plan = ChunkPlan::with_sizes(n, &[256, 32], usize::MAX, Tail::Pad)?;
        let s = simulate(&prefill_dag(&plan, m.n_layer)?, &HtpStageCosts { cpu: AnalyticCosts { shape: m.layer, rates: cpu }, htp: rates }, &Policy::Fifo)?;
        Ok(Prediction {
            secs: s.makespan,
            tokens_per_sec: n as f64 / s.makespan,
            npu_busy: s.utilization(Processor::Npu),
            cpu_busy: s.utilization(Processor::Cpu),
            graphs_per_chunk: 4 * m.n_layer,
        })
    };
    let stages = move |m: &ModelShape, n: usize, rates: HtpRates| stages_on(m, n, rates, cpu);
    let emit = |model: &str, soc: &str, plan: &str, tokens: usize, launch: f64, p: &Prediction, measured: Option<f64>| {
        let row = serde_json::json!({
            "model": model, "soc": soc, "plan": plan, "prompt_tokens": tokens, "launch_ms": launch * 1e3,
            "tokens_per_sec": p.tokens_per_sec, "npu_busy": p.npu_busy, "cpu_busy": p.cpu_busy,
            "graphs_per_chunk": p.graphs_per_chunk, "measured_tokens_per_sec": measured,
        });
        println!("{row}");
    };

    // The anchors, each under its own plan.
    type Anchor = (&'static str, &'static str, &'static str, f64, Box<dyn Fn(HtpRates) -> Result<Prediction>>, usize);
    let anchors: Vec<Anchor> = vec![
        (
            "Llama-3.2-1B",
            "8 Elite",
            "AI Hub w4a16: 128 rows over a 4096-token cache, 3 graphs, every row's logits",
            128.0 / 37.0651e-3,
            Box::new(move |r: HtpRates| {
                let plan = WholePlan {
                    rows: 128,
                    capacity: Some(4096),
                    graphs_per_chunk: 3,
                    activations: Activations::A16,
                    weight_bytes: 0.5,
                    kv_bytes: 1.0,
                    lm_head_bytes: Some(1.0),
                    fp16_share: 0.0,
                };
                Ok(predict_whole(&llama_1b, &plan, 128, &r.snapdragon_8_elite(), cpu.cpu_macs))
            }),
            128,
        ),
        (
            "Qwen3-1.7B",
            "8 Gen 3",
            "mllm QNN AOT W4A16 (LPBQ): chunks of 32 over a 1024-token cache, one graph, every row's logits",
            758.28,
            Box::new(move |r: HtpRates| {
                let bytes = 0.5 + 0.5 / 16.0; // 4-bit weights and a 4-bit scale per block of 16
                let plan = WholePlan {
                    rows: 32,
                    capacity: Some(1024),
                    graphs_per_chunk: 1,
                    activations: Activations::A16,
                    weight_bytes: bytes,
                    kv_bytes: 1.0,
                    lm_head_bytes: Some(bytes),
                    fp16_share: 0.0,
                };
                Ok(predict_whole(&qwen3, &plan, 640, &r, cpu.cpu_macs))
            }),
            640,
        ),
        (
            "Qwen1.5-1.8B",
            "8 Gen 3",
            "llm.npu W8A8: four graphs per layer, CPU between, chunks of 256",
            1106.0,
            Box::new(move |r: HtpRates| stages(&qwen15, 1024, r)),
            1024,
        ),
    ];
    if !json {
        println!("## The phone model (docs/phone_model.md) against the published anchors, each under its own plan");
        println!("| model | SoC | plan | measured tok/s | launch 0.3 ms | launch 2 ms |\n|---|---|---|---|---|---|");
    }
    for (model, soc, plan, measured, predict, tokens) in &anchors {
        let mut cells = vec![];
        for &l in &launches {
            let p = predict(v75.with_launch(l))?;
            if json {
                emit(model, soc, plan, *tokens, l, &p, Some(*measured));
            }
            cells.push(format!("{:.0} ({:+.0}%)", p.tokens_per_sec, 100.0 * (p.tokens_per_sec / measured - 1.0)));
        }
        if !json {
            println!("| {model} | {soc} | {plan} | {measured:.0} | {} | {} |", cells[0], cells[1]);
        }
    }

    // This project's plans.
    // The real models with the share of their MACs shadow W8A16 splits (their default
    // calibration's profile, made here if missing); the shapes without weights take SmolLM2's.
    let mut models: Vec<(String, ModelShape, f64, &str)> = vec![];
    for (name, path) in real_models()? {
        let mut p = Pipeline::load(&path, None, &NpuDevice::host(), LoadOptions { precision: Some(Precision::W8A16Shadow), ..Default::default() })?;
        p.ensure_profile(None, CalibrationSet::default(), |_, _| {})?;
        let c = p.model.config();
        let share = p.model.split_mac_share().with_context(|| format!("{name}: no profile after calibration"))?;
        models.push((name.into(), ModelShape { layer: p.model.layer_shape(), n_layer: c.n_layer, vocab: c.vocab }, share, "its profile's splits"));
    }
    let smollm2_share = models[0].2;
    models.extend(
        [("Llama-3.2-1B", llama_1b), ("Qwen3-1.7B", qwen3), ("Qwen1.5-1.8B", qwen15), ("Qwen2.5-3B", qwen25_3b)]
            .map(|(n, m)| (n.into(), m, smollm2_share, "SmolLM2's share")),
    );
    // One graph per layer per chunk of 256 over the smallest power-of-two cache capacity that holds
    // the tokens before it, INT8 weights, an f32 cache (issue 49 makes it f16), the last row's
    // logits on the CPU; shadow W8A16 runs the linears of its split points again in FP16 (the
    // outliers through float weights).
    let layers = |a, fp16_share| WholePlan {
        rows: 256,
        capacity: None,
        graphs_per_chunk: 0,
        activations: a,
        weight_bytes: 1.0,
        kv_bytes: 4.0,
        lm_head_bytes: None,
        fp16_share,
    };
    let n = 1024;
    if !json {
        println!("\n## This project's plans on the phone model, Snapdragon 8 Gen 3, {n} tokens: tok/s (NPU / CPU busy share), graphs per chunk");
        println!("| model | plan | launch 0.3 ms | launch 2 ms | graphs per chunk |\n|---|---|---|---|---|");
    }
    for (name, m, share, whose) in &models {
        // `None`: llm.npu's stages with the CPU rates of `Rates::SNAPDRAGON_8_GEN_3` (calibrated
        // on llm.npu's split) or `_KERNELS` (our aarch64 kernels' llvm-mca estimates,
        // docs/aarch64.md). The HTP's default (shadow W8A16) at the model's own split share.
        let plans: [(String, Option<WholePlan>, Rates); 5] = [
            ("stages, shadow W8A8 (llm.npu's; the host's default)".into(), None, cpu),
            ("stages, shadow W8A8, CPU at our kernels' llvm-mca rates".into(), None, Rates::SNAPDRAGON_8_GEN_3_KERNELS),
            ("layers, W8A16".into(), Some(layers(Activations::A16, 0.0)), cpu),
            (
                format!("layers, shadow W8A16 (the HTP's default; {:.0}% of the MACs again in FP16: {whose})", 100.0 * share),
                Some(layers(Activations::A16, *share)),
                cpu,
            ),
            ("layers, shadow W8A16 (every linear again in FP16: the bound)".into(), Some(layers(Activations::A16, 1.0)), cpu),
        ];
        for (label, plan, cpu) in &plans {
            let mut cells = vec![];
            let mut graphs = 0;
            for &l in &launches {
                let r = v75.with_launch(l);
                let p = match plan {
                    None => stages_on(m, n, r, *cpu)?,
                    Some(plan) => predict_whole(m, &WholePlan { graphs_per_chunk: m.n_layer, ..*plan }, n, &r, cpu.cpu_macs),
                };
                graphs = p.graphs_per_chunk;
                if json {
                    emit(name, "8 Gen 3", label, n, l, &p, None);
                }
                cells.push(format!("{:.0} ({:.0}% / {:.0}%)", p.tokens_per_sec, 100.0 * p.npu_busy, 100.0 * p.cpu_busy));
            }
            if !json {
                println!("| {name} | {label} | {} | {} | {graphs} |", cells[0], cells[1]);
            }
        }
    }
    Ok(())
}

fn bubbles(s: &Schedule) -> String {
    format!("{:.0}% / {:.0}%", 100.0 * s.bubble_rate(Processor::Npu), 100.0 * s.bubble_rate(Processor::Cpu))
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(bad) = args.sections.iter().find(|s| !["real", "shared", "sim", "tail", "phone"].contains(&s.as_str())) {
        bail!("unknown section '{bad}': choose from real, shared, sim, tail, phone");
    }
    if args.sections.iter().all(|s| s == "tail") {
        return tail_on_the_phone();
    }
    if args.sections.iter().all(|s| s == "phone") {
        return phone_projections(args.json);
    }
    let shared_only = args.sections.iter().all(|s| s == "shared");
    if !shared_only && args.sections.iter().any(|s| s == "shared") {
        bail!("run --sections shared on its own: it lets every stage use every core, the others give each processor one");
    }
    // Before anything starts rayon's global pool: the CPU stages get one core, the NPU queue its own.
    if !shared_only && std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", "1");
    }
    if args.reps == 0 || args.lens.is_empty() || args.lens.contains(&0) {
        bail!("--reps and every --lens value must be at least 1");
    }
    // Before the minutes of runs the chart comes after.
    if args.sections.iter().any(|s| s == "real") {
        candle_npu::fs::check_output_path(&args.png, "--png")?;
    }
    // As the CLI does (see the function).
    candle_npu_models::memory::limit_malloc_arenas(1);
    let on = |s: &str| args.sections.iter().any(|x| x == s);
    let dev = NpuDevice::host();
    let opts = LoadOptions { precision: Some(Precision::W8A8), decode_weights: DecodeWeights::Q8_0, ..Default::default() };
    let mut p = Pipeline::load(&assets::smollm2(), None, &dev, opts)?;
    p.ensure_profile(None, CalibrationSet::default(), |_, _| {})?;
    let max_len = args.lens.iter().copied().max().unwrap_or(0).max(300);
    let mut text = vec![];
    for a in assets::wiki_heldout(400)? {
        text.extend(p.encode(&a, false)?);
        if text.len() >= max_len {
            break;
        }
    }
    if text.len() < max_len {
        bail!("the held-out Wikipedia text has {} tokens, fewer than --lens needs ({max_len})", text.len());
    }
    println!("SmolLM2-135M, host executor W8A8, RAYON_NUM_THREADS={}", std::env::var("RAYON_NUM_THREADS").unwrap_or_default());

    let mut fit_runs: Vec<Run> = vec![];
    let mut real: BTreeMap<(usize, String), f64> = BTreeMap::new();
    if on("real") {
        println!("\n## Real runs: prefill tokens/s (NPU / CPU bubble rate), chunk {}, best of {}", args.chunk_len, args.reps);
        print!("| policy |");
        args.lens.iter().for_each(|n| print!(" {n} tokens |"));
        println!("\n|---|{}", "---|".repeat(args.lens.len()));
        let mut gantt: Vec<(String, SubgraphDag, Schedule)> = vec![];
        let mid = args.lens[args.lens.len() / 2];
        let mut rows: Vec<String> = configs(Tail::Margin).iter().map(|c| format!("| {} |", c.label)).collect();
        for &n in &args.lens {
            let mut fastest: Option<(String, SubgraphDag, Schedule, f64)> = None;
            for (i, c) in configs(Tail::Margin).iter().enumerate() {
                let run = measure(&mut p, c, &text[..n], args.chunk_len, args.reps)?;
                rows[i] += &format!(" {:.0} ({}) |", n as f64 / run.secs, bubbles(&run.schedule));
                real.insert((n, c.label.clone()), run.secs);
                if let Some(dir) = &args.trace_dir {
                    std::fs::create_dir_all(dir)?;
                    Trace::from_schedule(&run.dag, &run.schedule).write(dir.join(format!("{}-{n}.json", c.label.replace([' ', ','], "_"))))?;
                }
                if n == mid && c.npu_threads == 1 {
                    if c.policy == Policy::InOrder {
                        gantt.push((format!("{} ({n} tokens): {:.2} s", c.label, run.secs), run.dag.clone(), run.schedule.clone()));
                    } else if fastest.as_ref().is_none_or(|f| run.secs < f.3) {
                        fastest = Some((format!("{} ({n} tokens): {:.2} s", c.label, run.secs), run.dag.clone(), run.schedule.clone(), run.secs));
                    }
                }
                if c.policy == Policy::InOrder && c.npu_threads == 1 {
                    fit_runs.push(run);
                }
            }
            if let Some((label, dag, s, _)) = fastest {
                gantt.push((label, dag, s));
            }
        }
        rows.iter().for_each(|r| println!("{r}"));
        // How many chunks FIFO needs in flight (`SchedOptions::chunks_in_flight`: worker threads).
        let n = *args.lens.iter().max().unwrap_or(&256);
        let mut line = format!("\nFIFO at {n} tokens by chunks in flight, tokens/s:");
        for workers in [2, 3, 4, n.div_ceil(args.chunk_len)] {
            p.model.set_sched(SchedOptions {
                policy: Policy::Fifo,
                npu_threads: Some(1),
                small_chunks: vec![],
                chunks_in_flight: workers,
                ..Default::default()
            })?;
            p.model.prefill(&text[..n], &PrefillOptions::chunked(args.chunk_len))?;
            let mut best = f64::MAX;
            for _ in 0..args.reps {
                let t = Instant::now();
                p.model.prefill(&text[..n], &PrefillOptions::chunked(args.chunk_len))?;
                best = best.min(t.elapsed().as_secs_f64());
            }
            line += &format!(" {workers}: {:.0};", n as f64 / best);
        }
        println!("{line}");
        draw_gantt(&args.png, &args.font, &gantt)?;
        println!("\nGantt chart: {}", args.png.display());
    }

    if on("shared") {
        println!("\n## Time to first token, ms: median (best) of {} runs, chunk {}", args.reps, args.chunk_len);
        let lens = [24usize, 100, 300];
        println!("| plan | {} |\n|---|{}", lens.map(|n| format!("{n} tokens")).join(" | "), "---|".repeat(lens.len()));
        let plans = [
            ("padded, in-order (before this issue)", Tail::Pad, Policy::InOrder, vec![]),
            ("margin, in-order", Tail::Margin, Policy::InOrder, vec![]),
            ("margin, critical-path", Tail::Margin, Policy::CriticalPath, vec![]),
            ("graphs of 256 and 32, margin, in-order (the default plan)", Tail::Margin, Policy::InOrder, vec![32]),
        ];
        let scheds: Vec<SchedOptions> = plans
            .iter()
            .map(|(_, tail, policy, small_chunks)| SchedOptions {
                policy: policy.clone(),
                tail: *tail,
                small_chunks: small_chunks.clone(),
                ..Default::default()
            })
            .collect();
        let secs = interleaved(&mut p, &scheds, &text, &lens, &args)?;
        for ((label, ..), times) in plans.iter().zip(&secs) {
            let cells: Vec<String> = times.iter().map(|v| format!("{:.0} ({:.0})", 1e3 * v[v.len() / 2], 1e3 * v[0])).collect();
            println!("| {label} | {} |", cells.join(" | "));
        }

        // Throughput with every stage free to use both cores (one rayon pool for the NPU's and
        // the CPU's stages); median (best) tokens/s.
        let lens: Vec<usize> = args.lens.iter().copied().filter(|&n| n > args.chunk_len).collect();
        println!("\n## Prefill tokens/s, every stage on both cores: median (best) of {} runs, chunk {}", args.reps, args.chunk_len);
        println!("| policy | {} |\n|---|{}", lens.iter().map(|n| format!("{n} tokens")).collect::<Vec<_>>().join(" | "), "---|".repeat(lens.len()));
        let policies = Policy::heuristics();
        let scheds: Vec<SchedOptions> = policies.iter().map(|policy| SchedOptions { policy: policy.clone(), ..Default::default() }).collect();
        let secs = interleaved(&mut p, &scheds, &text, &lens, &args)?;
        for (policy, times) in policies.iter().zip(&secs) {
            let cells: Vec<String> = times.iter().zip(&lens).map(|(v, &n)| format!("{:.0} ({:.0})", n as f64 / v[v.len() / 2], n as f64 / v[0])).collect();
            println!("| {} | {} |", policy.name(), cells.join(" | "));
        }
    }

    if on("sim") {
        let shape = p.model.layer_shape();
        let n_layer = p.model.config().n_layer;
        if fit_runs.is_empty() {
            println!("\n(no real runs: the host table needs --sections real)");
        } else {
            // More row sizes, so the fit separates a stage's fixed cost from its per-row cost.
            for chunk in [64, 128] {
                let c = Config { label: "in-order".into(), policy: Policy::InOrder, npu_threads: 1, tail: Tail::Margin };
                fit_runs.push(measure(&mut p, &c, &text[..args.lens[0].max(chunk)], chunk, 1)?);
            }
            let host = fit(&fit_runs)?;
            refit_phone(&host, &shape)?;
            println!("\n## Simulated, (a) stage costs fit on this machine's in-order runs");
            println!("Check against the real runs at chunk {} (simulated / measured seconds):", args.chunk_len);
            for &n in &args.lens {
                let dag = dag_for(n, args.chunk_len, n_layer)?;
                let mut line = format!("- {n} tokens:");
                for c in configs(Tail::Margin).iter().filter(|c| c.npu_threads == 1) {
                    let sim = simulate(&dag, &host, &c.policy)?.makespan;
                    line += &format!(" {} {:.2}/{:.2}", c.label, sim, real.get(&(n, c.label.clone())).copied().unwrap_or(f64::NAN));
                }
                println!("{line}");
            }
            sim_table("host (a)", &host, &args.lens, n_layer)?;
            sensitivity("host (a)", &host, *args.lens.iter().max().unwrap_or(&1024), 256, n_layer)?;
        }
        let phone = AnalyticCosts { shape, rates: Rates::SNAPDRAGON_8_GEN_3 };
        println!("\n## Simulated, (c) Snapdragon 8 Gen 3 model, SmolLM2-135M");
        sim_table("phone (c), SmolLM2", &phone, &args.lens, n_layer)?;
        let qwen15 =
            AnalyticCosts { shape: LayerShape { hidden: 2048, ffn: 5504, n_head: 16, n_kv_head: 16, head_dim: 128 }, rates: Rates::SNAPDRAGON_8_GEN_3 };
        println!("\n## Simulated, (c) Snapdragon 8 Gen 3 model, Qwen1.5-1.8B (24 layers; the paper's model)");
        sim_table("phone (c), Qwen1.5-1.8B", &qwen15, &args.lens, 24)?;
        sensitivity("phone (c), Qwen1.5-1.8B", &qwen15, 1024, 64, 24)?;
    }
    Ok(())
}

/// The phone model's CPU rates refit from this machine's stage costs, as
/// [`Rates::SNAPDRAGON_8_GEN_3`]'s are made: the ratio of the CPU's attention MAC rate to its
/// elementwise rate comes from the host (the fitted lines' per-key term of `attn` and per-row
/// terms of the norm and activation stages, one core each), and both rates are scaled so that
/// the CPU's share of the paper's Qwen1.5-1.8B split (256 tokens) is its 157.5 ms.
fn refit_phone(host: &TableCosts, s: &LayerShape) -> Result<()> {
    let line = |n: &str| host.get(n, Processor::Cpu).ok_or_else(|| anyhow!("no fitted CPU line for {n}"));
    let macs = (2 * s.n_head * s.head_dim) as f64 / line("attn")?.c;
    let per_value = [("attn_in", 4 * s.hidden), ("ffn_in", 4 * s.hidden), ("act", 4 * s.ffn)]
        .iter()
        .map(|&(n, v)| Ok(line(n)?.b / v as f64))
        .collect::<Result<Vec<f64>>>()?;
    let elem = per_value.iter().sum::<f64>() / per_value.len() as f64;
    let ratio = macs * elem;
    // The paper's model at 256 tokens in "value units" (an elementwise value costs 1, a MAC
    // 1 / ratio), then the unit that makes the CPU total 157.5 ms.
    let qwen15 = LayerShape { hidden: 2048, ffn: 5504, n_head: 16, n_kv_head: 16, head_dim: 128 };
    let units = AnalyticCosts { shape: qwen15, rates: Rates { cpu_macs: ratio, cpu_elem: 1.0, ..Rates::SNAPDRAGON_8_GEN_3 } };
    let dag = dag_for(256, 256, 24)?;
    let cpu_units: f64 = dag.nodes().iter().filter(|n| n.processor == Processor::Cpu).map(|n| units.cost(n)).sum();
    let cpu_elem = 0.1575 / cpu_units;
    println!("\n## The phone model's CPU rates, refit from this machine's stage costs");
    println!(
        "host, one core: attention {:.1} GMAC/s, elementwise {:.3} ns per value ({:.2} / {:.2} / {:.2} ns: attn_in, ffn_in, act): {ratio:.1} MACs per value (the model had 10)",
        macs / 1e9,
        elem * 1e9,
        per_value[0] * 1e9,
        per_value[1] * 1e9,
        per_value[2] * 1e9
    );
    println!(
        "Snapdragon 8 Gen 3 refit: cpu_macs {:.1} GMAC/s, cpu_elem {:.3} ns (Rates::SNAPDRAGON_8_GEN_3 has {:.1} and {:.3})",
        ratio / cpu_elem / 1e9,
        cpu_elem * 1e9,
        Rates::SNAPDRAGON_8_GEN_3.cpu_macs / 1e9,
        Rates::SNAPDRAGON_8_GEN_3.cpu_elem * 1e9
    );
    Ok(())
}

/// Prefill seconds of each schedule at each length, sorted, `args.reps` runs after a warm-up;
/// interleaved (schedule by schedule, rep by rep), so a noisy neighbour hits every one alike.
fn interleaved(p: &mut Pipeline, scheds: &[SchedOptions], text: &[u32], lens: &[usize], args: &Args) -> Result<Vec<Vec<Vec<f64>>>> {
    let mut secs = vec![vec![vec![]; lens.len()]; scheds.len()];
    for rep in 0..=args.reps {
        for (i, sched) in scheds.iter().enumerate() {
            p.model.set_sched(sched.clone())?;
            for (j, &n) in lens.iter().enumerate() {
                let t = Instant::now();
                p.model.prefill(&text[..n], &PrefillOptions::chunked(args.chunk_len))?;
                if rep > 0 {
                    secs[i][j].push(t.elapsed().as_secs_f64());
                }
            }
        }
    }
    secs.iter_mut().flatten().for_each(|v| v.sort_by(f64::total_cmp));
    Ok(secs)
}

fn dag_for(n: usize, chunk: usize, n_layer: usize) -> Result<SubgraphDag> {
    Ok(prefill_dag(&ChunkPlan::new(n, chunk, usize::MAX, Tail::Margin)?, n_layer)?)
}

/// Per-stage cost lines fit on the slices of in-order runs (one stage at a time, no contention).
fn fit(runs: &[Run]) -> Result<TableCosts> {
    let mut samples = vec![];
    for r in runs {
        for s in &r.schedule.slices {
            let n = r.dag.node(s.node);
            samples.push((n.stage_name.clone(), n.processor, n.rows, n.start, s.end - s.start));
        }
    }
    Ok(TableCosts::fit_with_context(&samples)?)
}

/// Makespan (tokens/s), utilisations and the lower bound per policy, lengths x chunk lengths.
fn sim_table(label: &str, costs: &dyn CostModel, lens: &[usize], n_layer: usize) -> Result<()> {
    println!("{label}: simulated tokens/s (NPU / CPU utilisation); `bound` is the makespan lower bound's tokens/s");
    println!("| prompt, chunk | {} | bound |\n|---|{}---|", Policy::heuristics().iter().map(|p| p.name()).collect::<Vec<_>>().join(" | "), "---|".repeat(4));
    for &n in lens {
        for chunk in [64, 128, 256] {
            let dag = dag_for(n, chunk, n_layer)?;
            let mut row = format!("| {n}, {chunk} |");
            for p in Policy::heuristics() {
                let s = simulate(&dag, costs, &p)?;
                row +=
                    &format!(" {:.0} ({:.0}% / {:.0}%) |", n as f64 / s.makespan, 100.0 * s.utilization(Processor::Npu), 100.0 * s.utilization(Processor::Cpu));
            }
            println!("{row} {:.0} |", n as f64 / lower_bound(&dag, costs)?);
        }
    }
    Ok(())
}

/// The contribution heuristic with each of its terms zeroed or flipped, against the paper's
/// weights and the other policies, as simulated makespan relative to the paper's weights.
fn sensitivity(label: &str, costs: &dyn CostModel, n: usize, chunk: usize, n_layer: usize) -> Result<()> {
    let dag = dag_for(n, chunk, n_layer)?;
    let base = simulate(&dag, costs, &Policy::Contribution(ContributionWeights::default()))?.makespan;
    println!("\n{label}, {n} tokens, chunk {chunk}: makespan relative to the paper's contribution weights ({:.3} s)", base);
    let d = ContributionWeights::default();
    let variants: Vec<(&str, ContributionWeights)> = vec![
        ("CPU unlocks NPU: 0", ContributionWeights { cpu_unlocks_npu: 0.0, ..d }),
        ("CPU unlocks CPU: 0", ContributionWeights { cpu_unlocks_cpu: 0.0, ..d }),
        ("NPU unlocks NPU: 0", ContributionWeights { npu_unlocks_npu: 0.0, ..d }),
        ("NPU unlocks CPU: 0", ContributionWeights { npu_unlocks_cpu: 0.0, ..d }),
        ("NPU terms +1", ContributionWeights { npu_unlocks_npu: 1.0, npu_unlocks_cpu: 1.0, ..d }),
        ("own cost +1", ContributionWeights { own_cost: 1.0, ..d }),
        ("own cost -1", ContributionWeights { own_cost: -1.0, ..d }),
        ("all 0 (lowest id)", ContributionWeights { cpu_unlocks_npu: 0.0, cpu_unlocks_cpu: 0.0, npu_unlocks_npu: 0.0, npu_unlocks_cpu: 0.0, own_cost: 0.0 }),
    ];
    let mut line = String::from("|");
    for (name, w) in variants {
        line += &format!(" {name}: {:.3} |", simulate(&dag, costs, &Policy::Contribution(w))?.makespan / base);
    }
    for p in [Policy::InOrder, Policy::Fifo, Policy::CriticalPath] {
        line += &format!(" {}: {:.3} |", p.name(), simulate(&dag, costs, &p)?.makespan / base);
    }
    line += &format!(" lower bound: {:.3} |", lower_bound(&dag, costs)? / base);
    println!("{line}");
    Ok(())
}

/// One panel per schedule, a row per processor, a bar per node coloured by stage (the tail last); written to a
/// temporary file and renamed, so a failed run leaves no half-written image.
fn draw_gantt(png: &Path, font: &Path, runs: &[(String, SubgraphDag, Schedule)]) -> Result<()> {
    use plotters::prelude::*;
    if runs.is_empty() {
        return Ok(());
    }
    let bytes = std::fs::read(font).with_context(|| format!("font {} (pass --font)", font.display()))?;
    plotters::style::register_font("sans", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
        .map_err(|_| anyhow!("{}: not a TrueType font", font.display()))?;
    let stem = png.file_stem().and_then(|s| s.to_str()).unwrap_or("gantt");
    let tmp = png.with_file_name(format!(".{stem}.{}.partial.png", std::process::id()));
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", png.display());
    let colors: [RGBColor; 9] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(23, 190, 207),
    ];
    let n_layer = runs[0].1.nodes().iter().map(|n| n.layer).max().unwrap_or(0);
    let t_max = runs.iter().map(|r| r.2.makespan).fold(0.0, f64::max);
    {
        let root = BitMapBackend::new(&tmp, (1400, 260 * runs.len() as u32)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        for (area, (title, dag, s)) in root.split_evenly((runs.len(), 1)).iter().zip(runs) {
            let caption = format!("{title}; bubbles NPU {:.0}%, CPU {:.0}%", 100.0 * s.bubble_rate(Processor::Npu), 100.0 * s.bubble_rate(Processor::Cpu));
            let mut chart = ChartBuilder::on(area)
                .caption(caption, ("sans", 18))
                .margin(10)
                .x_label_area_size(35)
                .y_label_area_size(60)
                .build_cartesian_2d(0f64..t_max, 0f64..2f64)
                .map_err(|e| err(&e))?;
            chart
                .configure_mesh()
                .disable_y_mesh()
                .y_labels(2)
                .y_label_formatter(&|y| if *y < 1.0 { "CPU".into() } else { "NPU".into() })
                .x_desc("seconds")
                .label_style(("sans", 14))
                .draw()
                .map_err(|e| err(&e))?;
            chart
                .draw_series(s.slices.iter().map(|sl| {
                    let y = if sl.processor == Processor::Npu { 1.1 } else { 0.1 };
                    let n = dag.node(sl.node);
                    let color = colors[if n.layer < n_layer { n.stage % 8 } else { 8 }];
                    Rectangle::new([(sl.start, y), (sl.end, y + 0.8)], color.filled())
                }))
                .map_err(|e| err(&e))?;
        }
        root.present().map_err(|e| err(&e))?;
    }
    std::fs::rename(&tmp, png).with_context(|| format!("renaming {} to {}", tmp.display(), png.display()))?;
    Ok(())
}
