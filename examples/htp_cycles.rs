//! Do the HTP emulator's per-op cycle counts scale like a device's? (issue 10, cost model (b))
//!
//! A phone cost model needs, for each NPU stage, its time on the phone's HTP. QNN's detailed
//! profile reports per-op "cycles"; if the x86 emulator's cycles tracked MACs at the rate of a
//! real Hexagon, they would be that NPU side without a phone. This example runs one-op INT8 W8A8
//! FullyConnected graphs (U8 activations, per-channel I8 weights, U8 output) over a grid of
//! shapes with detailed profiling, fits `cycles = a + b * MACs`, compares the implied MACs per
//! cycle with a Snapdragon 8 Gen 3 HTP's, and checks whether the cycles are just host time at a
//! fixed rate (`cycles / wall-us` constant).
//!
//! ```text
//! cargo run --release --example htp_cycles
//! ```
//!
//! Found (QNN 2.40 / HTP API 5.51 x86 emulator, SoC 57; 12 shapes plus a warm-up in ~6 s):
//!
//! - Detailed profiling does give per-op cycles: `Accelerator (execute) time (cycles)` has one
//!   child per node, `op0_fc:OpId_<n> (cycles)` (over 99% of the graph's cycles), beside the
//!   graph's `Input`/`Output` events. At the basic level there are no cycle events at all.
//! - Those cycles are host time: about 150 cycles per wall microsecond for every shape (135-152
//!   over four runs, R² 1.0000 against wall time), while the emulator's speed varies 2-5x across
//!   shapes (0.3-1.8 GMAC/s); the same op's cycles vary by up to 40-90% between executions while
//!   another process loads the host. The first graph of a process runs at ~95-115 cycles/wall-us
//!   (slower in wall time than the same shape later), hence the warm-up graph.
//! - Against MACs they fit only as well as the emulator's own time does (R² 0.88-0.97, slope
//!   and intercept changing from run to run): 5-11 MACs/cycle, some 3,000-7,000x below the
//!   36,500 MACs/cycle of a Snapdragon 8 Gen 3 HTP (73 TOPS INT8 at ~1 GHz), and still 450-1000x
//!   below HeteroLLM's measured FP16 rate. One regularity (in quiet runs): 32 rows cost the same as 64
//!   (probably the emulated kernel's row tile), a stage effect that may or may not match a device's.
//!
//! So the emulator's cycles are not the NPU side of a phone cost model; that needs timings from a
//! phone (or the published rate with the stage effects HeteroLLM §3.2 describes).
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_npu::{DType, Graph, HtpConfig, NpuDevice, ProfileEvent, ProfilingLevel, Quant, TensorData};
use clap::Parser;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// The device's rate: 73 TOPS INT8 for the Snapdragon 8 Gen 3 Hexagon NPU (llm.npu §2.2, Table 2;
/// HeteroLLM §2, Table 1), i.e. 36.5 T MAC/s, at an HTP clock of roughly 1 GHz.
const DEVICE_TOPS: f64 = 73.0;
const DEVICE_CLOCK_GHZ: f64 = 1.0;
/// What HeteroLLM measured the same NPU at, FP16 (§1: "its NPU can reach up to 10 TFLOPS (in actual)").
const DEVICE_FP16_TFLOPS: f64 = 10.0;
/// The parent event of the per-op cycle counts in QNN's HTP execute profile.
const CYCLES_EVENT: &str = "Accelerator (execute) time (cycles)";
const QNN_EXECUTE: &str = "QNN (execute) time";

#[derive(Parser, Debug)]
#[command(about = "Per-op HTP cycles against MACs for INT8 FullyConnected shapes, on the QNN HTP library")]
struct Args {
    /// Rows (M) of the activations.
    #[arg(long, value_delimiter = ',', default_value = "32,64,128")]
    rows: Vec<usize>,
    /// (K, N) pairs, `KxN`: input and output features.
    #[arg(long, value_delimiter = ',', default_value = "576x576,576x1536,1536x576,960x4864")]
    shapes: Vec<String>,
    /// Measured executions per shape (after one warm-up).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Hexagon SoC model (57 = SM8650, Snapdragon 8 Gen 3).
    #[arg(long, default_value_t = 57)]
    soc: u32,
}

/// One shape's measurement, per execution.
struct Row {
    m: usize,
    k: usize,
    n: usize,
    event: String,
    /// Mean over the executions, and (max - min) / mean.
    cycles: f64,
    spread: f64,
    qnn_us: f64,
    wall_us: f64,
}

impl Row {
    fn macs(&self) -> f64 {
        (self.m * self.k * self.n) as f64
    }
}

/// The graph's execute events (summed over executions so far), by name.
fn execute_events(device: &NpuDevice, graph: &str) -> Vec<ProfileEvent> {
    let profile = device.graph_profiles().into_iter().find(|p| p.graph == graph);
    profile.map(|p| p.events.into_iter().filter(|e| e.phase == "execute").collect()).unwrap_or_default()
}

/// A one-op graph `out[M, N] = x[M, K] @ w[N, K]^T`, run `reps` times after a warm-up; each
/// execution's cycles and QNN execute time are the growth of the graph's summed profile.
fn measure(device: &NpuDevice, rng: &mut StdRng, id: usize, (m, k, n): (usize, usize, usize), reps: usize) -> Result<Row> {
    // Profiles are summed per graph name: every graph gets its own.
    let name = format!("fc{id}.m{m}.k{k}.n{n}");
    let mut g = Graph::new(&name);
    let x = g.input("x", &[m, k], DType::U8, Some(Quant::u8_range(-1.0, 1.0)));
    let w: Vec<i8> = (0..n * k).map(|_| rng.random_range(-127..=127)).collect();
    let w = g.constant_per_channel("w", &[n, k], Arc::new(w), Arc::new(vec![0.01; n]));
    let out = g.fully_connected("fc", x, w, None, DType::U8, Some(Quant::u8_range(-8.0, 8.0)));
    g.mark_output(out);
    let graph = device.prepare(&g).with_context(|| format!("preparing {name}"))?;
    let input = TensorData::U8((0..m * k).map(|_| rng.random()).collect());
    graph.execute(&[&input])?;
    // The op's own event is a child of CYCLES_EVENT named "<node>:OpId_<n> (cycles)"; the
    // graph's Input/Output events are its siblings. Fall back to the whole graph's cycles.
    let events = execute_events(device, &name);
    let op = events.iter().find(|e| e.unit == "cycles" && e.name.starts_with(CYCLES_EVENT) && e.name.contains("_fc:OpId_"));
    let Some(op) = op.or_else(|| events.iter().find(|e| e.name == CYCLES_EVENT)).map(|e| e.name.clone()) else {
        bail!("{name}: no cycle events in the profile ({} events)", events.len());
    };
    let value = |events: &[ProfileEvent], name: &str| events.iter().find(|e| e.name == name).map_or(0, |e| e.value);
    let (mut cycles, mut qnn_us, mut wall_us) = (Vec::new(), 0.0, 0.0);
    for _ in 0..reps {
        let before = execute_events(device, &name);
        let t = Instant::now();
        graph.execute(&[&input])?;
        wall_us += t.elapsed().as_secs_f64() * 1e6 / reps as f64;
        let after = execute_events(device, &name);
        cycles.push((value(&after, &op) - value(&before, &op)) as f64);
        qnn_us += (value(&after, QNN_EXECUTE) - value(&before, QNN_EXECUTE)) as f64 / reps as f64;
    }
    let mean = cycles.iter().sum::<f64>() / reps as f64;
    let spread = (cycles.iter().copied().fold(f64::MIN, f64::max) - cycles.iter().copied().fold(f64::MAX, f64::min)) / mean;
    let event = op.rsplit(" / ").next().unwrap_or(&op).to_string();
    Ok(Row { m, k, n, event, cycles: mean, spread, qnn_us, wall_us })
}

/// Least squares `y = a + b x`: (a, b, R²).
fn fit(points: &[(f64, f64)]) -> (f64, f64, f64) {
    let n = points.len() as f64;
    let (mx, my) = (points.iter().map(|p| p.0).sum::<f64>() / n, points.iter().map(|p| p.1).sum::<f64>() / n);
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let syy: f64 = points.iter().map(|p| (p.1 - my).powi(2)).sum();
    let b = sxy / sxx;
    (my - b * mx, b, if syy > 0.0 { sxy * sxy / (sxx * syy) } else { 1.0 })
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let pairs = args
        .shapes
        .iter()
        .map(|s| s.split_once('x').and_then(|(k, n)| Some((k.parse().ok()?, n.parse().ok()?))))
        .collect::<Option<Vec<(usize, usize)>>>()
        .context("--shapes: expected KxN pairs, e.g. 576x1536")?;
    if args.reps == 0 || args.rows.contains(&0) || pairs.iter().any(|&(k, n)| k == 0 || n == 0) || args.rows.len() * pairs.len() < 2 {
        bail!("--reps, --rows and --shapes must be positive, with at least two shapes to fit");
    }
    let config = HtpConfig { soc_model: args.soc, profiling: Some(ProfilingLevel::Detailed), cache_dir: None, ..Default::default() };
    if !config.library_path().exists() {
        bail!("QNN HTP library {} not found: run scripts/setup.sh (or set CANDLE_NPU_QNN_LIB_DIR)", config.library_path().display());
    }
    let device = NpuDevice::hexagon(config).context("starting the Hexagon executor (run scripts/setup.sh, or set CANDLE_NPU_QNN_LIB_DIR)")?;

    let t = Instant::now();
    let mut rng = StdRng::seed_from_u64(10);
    // The first graph of a process runs slower, and with fewer cycles per wall-us, than the same
    // shape later: it is measured once to warm up, and kept out of the table and the fit.
    let shapes: Vec<_> = pairs.iter().flat_map(|&(k, n)| args.rows.iter().map(move |&m| (m, k, n))).collect();
    let warm_up = measure(&device, &mut rng, 0, shapes[0], args.reps)?;
    let mut rows = Vec::new();
    for (i, &(m, k, n)) in shapes.iter().enumerate() {
        eprint!("\rFullyConnected {m}x{k}x{n}      ");
        rows.push(measure(&device, &mut rng, i + 1, (m, k, n), args.reps)?);
    }
    eprintln!("\r{} shapes measured in {:.1}s", rows.len(), t.elapsed().as_secs_f64());
    if device.stats().fallbacks > 0 {
        bail!("some graphs fell back to the host: not an HTP measurement");
    }

    println!("\nINT8 W8A8 FullyConnected on the QNN HTP library (SoC {}), detailed profile, {} executions per shape\n", args.soc, args.reps);
    println!("| M | K | N | MACs | op cycles/exec | spread | event | cycles/MAC | MACs/cycle | QNN execute us | wall ms | emulator GMAC/s | cycles/wall-us |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.0}% | `{}` | {:.3} | {:.2} | {:.0} | {:.2} | {:.2} | {:.1} |",
            r.m,
            r.k,
            r.n,
            r.macs(),
            r.cycles,
            r.spread * 100.0,
            r.event,
            r.cycles / r.macs(),
            r.macs() / r.cycles,
            r.qnn_us,
            r.wall_us / 1e3,
            r.macs() / r.wall_us / 1e3,
            r.cycles / r.wall_us
        );
    }

    let (a, b, r2) = fit(&rows.iter().map(|r| (r.macs(), r.cycles)).collect::<Vec<_>>());
    let per_cycle = |tops: f64| tops * 1e12 / 2.0 / (DEVICE_CLOCK_GHZ * 1e9);
    let (emu, device_rate) = (1.0 / b, per_cycle(DEVICE_TOPS));
    println!("\nFit: cycles = {a:.0} + {b:.4} * MACs, R² = {r2:.4}: {emu:.2} MACs/cycle at the margin");
    println!(
        "Device: {DEVICE_TOPS} TOPS INT8 (Snapdragon 8 Gen 3 Hexagon; llm.npu §2.2 Table 2, HeteroLLM §2 Table 1) at ~{DEVICE_CLOCK_GHZ} GHz = {device_rate:.0} MACs/cycle"
    );
    println!("  (at HeteroLLM's measured {DEVICE_FP16_TFLOPS} TFLOPS FP16, §1, it would still be {:.0} MACs/cycle)", per_cycle(DEVICE_FP16_TFLOPS));
    let mut per_us: Vec<f64> = rows.iter().map(|r| r.cycles / r.wall_us).collect();
    per_us.sort_by(f64::total_cmp);
    let median = per_us[per_us.len() / 2];
    let deviation = per_us.iter().map(|v| (v / median - 1.0).abs()).fold(0.0, f64::max);
    println!(
        "Warm-up graph ({}x{}x{}, the process's first, not in the table or the fit): {:.1} cycles/wall-us, {:.2} emulator GMAC/s",
        warm_up.m,
        warm_up.k,
        warm_up.n,
        warm_up.cycles / warm_up.wall_us,
        warm_up.macs() / warm_up.wall_us / 1e3
    );
    let (_, _, r2_wall) = fit(&rows.iter().map(|r| (r.wall_us, r.cycles)).collect::<Vec<_>>());
    println!(
        "cycles per wall-us: median {median:.1}, {:.1}..{:.1} (max deviation {:.0}%); cycles against wall-us: R² = {r2_wall:.4}",
        per_us[0],
        per_us[per_us.len() - 1],
        deviation * 100.0
    );

    let off = if emu > 0.0 { (emu / device_rate).max(device_rate / emu) } else { f64::INFINITY };
    let like_device = off <= 4.0;
    let host_time = deviation <= 0.2;
    println!(
        "\nVerdict: MACs/cycle is {emu:.2} vs the device's {device_rate:.0} ({off:.0}x off: {} 4x); cycles/wall-us {} within 20% ({:.0}%) => {}",
        if like_device { "within" } else { "not within" },
        if host_time { "is constant" } else { "is not constant" },
        deviation * 100.0,
        match (like_device, host_time) {
            (true, _) => "the emulator's cycles scale like a device's: usable as the NPU side of a phone cost model",
            (false, true) => "the emulator's cycles are host time at a fixed rate, not HTP cycles: no phone cost model from them",
            (false, false) => "the emulator's cycles track neither a device's rate nor host time: no phone cost model from them",
        }
    );
    Ok(())
}
