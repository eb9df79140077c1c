//! The accuracy suite of the NPU prefill paths on SmolLM2-135M (host executor: the same
//! numerics the QNN HTP runs, see tests/hexagon.rs).
//!
//! Rows: the F32 prefill; the old naive W8A8 (per-tensor weights, min/max activation ranges, no
//! shadow); per-channel weights without shadow (min/max ranges); shadow W8A8 unpruned and at the
//! default pruning rate; W8A16 (u16 activations over the full range, no shadow); candle's own CPU
//! prefill with Q8_0 weights. Columns: perplexity on held-out Wikipedia (never the calibration
//! articles), State of the Union and Moby Dick (fixed windows of 512 tokens, the second half of
//! each scored, as llama.cpp's perplexity does), top-1 agreement with F32 on those positions,
//! MMLU accuracy (a seeded subset, zero-shot, scored by the logits of the answer letters), and
//! prefill tokens/s on this machine. Then the pruning curve (perplexity and the shadow path's
//! share of prefill time per pruning rate, also drawn to a PNG) and the hot-channel hit rate per
//! domain (calibration is on Wikipedia).
//!
//! ```text
//! cargo run --release --example eval                      # tables on stdout, eval_pruning.png
//! cargo run --release --example eval -- --json > eval.json
//! cargo run --release --example eval -- --windows 1 --mmlu-per-subject 1   # a quick look
//! ```
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Tensor, D};
use candle_npu::{ClipMethod, NpuDevice, Numerics, PointStats, QuantProfile, Tail, WeightQuant};
use candle_npu_models::assets::{self, MmluQuestion};
use candle_npu_models::logits::mean_nll;
use candle_npu_models::pipeline::DEFAULT_PRUNE_RATE;
use candle_npu_models::{CalibrationSet, CalibrationSource, DecodeWeights, KvType, LoadOptions, Pipeline, Precision, PrefillPlan, SchedOptions};
use clap::Parser;

#[path = "common/chat_section.rs"]
mod chat_section;
#[path = "common/requantize.rs"]
mod requantize;
use candle_npu_models::{PrefillOptions, PrefillRows};
use indicatif::{ProgressBar, ProgressStyle};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde_json::json;

#[derive(Parser)]
#[command(about = "Accuracy suite: perplexity on three domains, top-1 agreement, MMLU, pruning curve, domain shift")]
struct Args {
    /// How the pipelines of the rows, decode and htp sections hold their KV cache: `f32` or
    /// `f16` (`KvType`, the default) or `q8`.
    #[arg(long, default_value = "f16", value_parser = ["f32", "f16", "q8"])]
    kv_cache: String,
    /// Windows of 512 tokens per text domain.
    #[arg(long, default_value_t = 3)]
    windows: usize,
    /// MMLU questions per subject (57 subjects), a subset drawn with --seed.
    #[arg(long, default_value_t = 10)]
    mmlu_per_subject: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Rows per NPU graph for the perplexity windows (the chunk-sharing length).
    #[arg(long, default_value_t = 256)]
    chunk_len: usize,
    /// Rows per NPU graph for MMLU prompts (short: less padding, same numerics).
    #[arg(long, default_value_t = 64)]
    mmlu_chunk_len: usize,
    /// Outlier budget of the clip ranges (share of calibration values beyond a point's range).
    #[arg(long, default_value_t = candle_npu_models::pipeline::DEFAULT_OUTLIER_BUDGET)]
    budget: f64,
    /// Calibration sequences on which layer importance is measured (1 + layers passes each).
    #[arg(long, default_value_t = 2)]
    importance_sequences: usize,
    /// Pruning rates of the curve.
    #[arg(long, value_delimiter = ',', default_value = "0,0.1,0.25,0.5,0.75,0.85,0.95,1")]
    rates: Vec<f64>,
    /// Hot-set coverages to compare (share of calibration outliers the hot channels hold).
    #[arg(long, value_delimiter = ',', default_value = "0.9,0.99,0.999,1")]
    coverages: Vec<f64>,
    /// Parts to run: rows (the table), curve (pruning), hot (hot-set coverages), decode (the
    /// decode weight formats: candle CPU perplexity and decode speed), htp (the prefill plans on
    /// the HTP library's numerics: shadow W8A8 stages padded and with a CPU margin, and the
    /// default, whole layers with shadow W8A16; each beside the host's),
    /// calibration (accuracy and time of the default calibration against its size), chat (the
    /// chat eval: conversations in the model's template against the F32 prefill; alone only).
    #[arg(long, value_delimiter = ',', default_value = "rows,curve,hot")]
    sections: Vec<String>,
    /// Calibration sizes of the calibration section, in sequences of `CalibrationSet`'s default
    /// length (256 tokens).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    calibration_sizes: Vec<usize>,
    /// The chat section on the first N conversations only (a quick look; 0: all).
    #[arg(long, default_value_t = 0)]
    chat_limit: usize,
    /// The chat section on these conversations only (their ids, `models/data/chat_eval.jsonl`).
    #[arg(long, value_delimiter = ',')]
    chat_ids: Vec<String>,
    /// The chat section's calibrations, in windows of conversations beside the default text's
    /// (`CalibrationSet::chats`); the first is also run with float activations and on the HTP's
    /// numerics.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    chat_calibration: Vec<usize>,
    /// The chat section's prefills, of `chat_section::ROWS` (`w8a8`, `float`, `htp`, `w8a16`,
    /// `htp-w8a16`, `w8a16-shadow`, `htp-w8a16-shadow`, `residual`, `htp-residual`,
    /// `w8a16-shadow-residual`, `htp-w8a16-shadow-residual`, `f32`).
    #[arg(long, value_delimiter = ',', default_value = "w8a8,float,htp")]
    chat_rows: Vec<String>,
    /// The linears of the chat section's `residual` rows that hold INT8 plus an INT8 residual.
    #[arg(long, value_delimiter = ',', default_value = "attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down")]
    chat_residual: Vec<String>,
    /// The htp section's LPBQ row: the linears holding 4-bit LPBQ weights (names as for
    /// `--chat-residual`); default every linear.
    #[arg(long, value_delimiter = ',')]
    lpbq: Vec<String>,
    /// The chat section's `residual` row once per layer, with only that layer's linears of
    /// `--chat-residual` holding the residual: which layers carry the INT8 weights' drift.
    #[arg(long)]
    chat_residual_by_layer: bool,
    /// Write the chat section's rendered prompts and F32 answers here (JSON), for
    /// `scripts/chat_anchor.py`.
    #[arg(long)]
    chat_dump: Option<PathBuf>,
    /// The htp section's plans: `stages` (shadow W8A8, padded and with a CPU margin) and
    /// `layers` (the HTP's default: whole layers, shadow W8A16).
    #[arg(long, value_delimiter = ',', default_value = "stages,layers")]
    htp_plans: Vec<String>,
    /// Print everything as one JSON object on stdout instead of the tables.
    #[arg(long)]
    json: bool,
    /// Where to draw the pruning curve.
    #[arg(long, default_value = "eval_pruning.png")]
    png: PathBuf,
    /// A TrueType font for the plot's labels.
    #[arg(long, default_value = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")]
    font: PathBuf,
    /// Calibration text: Wikipedia articles kept apart from the evaluated ones (the figures in
    /// docs/) or the text shipped in the crate (the default of `Pipeline::ensure_profile`).
    #[arg(long, value_enum, default_value = "wikipedia")]
    calibration: CalibrationArg,
    /// The GGUF model (default: SmolLM2-135M-Instruct from scripts/setup.sh).
    #[arg(long)]
    model: Option<PathBuf>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum CalibrationArg {
    Wikipedia,
    Shipped,
}

impl From<CalibrationArg> for CalibrationSource {
    fn from(c: CalibrationArg) -> Self {
        match c {
            CalibrationArg::Wikipedia => CalibrationSource::Wikipedia,
            CalibrationArg::Shipped => CalibrationSource::Shipped,
        }
    }
}

const WINDOW: usize = 512;
const DOMAINS: [&str; 3] = ["Wikipedia", "State of the Union", "Moby Dick"];

/// The evaluation data, tokenized once.
struct Data {
    /// Per domain, `windows` windows of 512 tokens.
    windows: Vec<Vec<Vec<u32>>>,
    /// MMLU prompts and the index of the correct letter.
    mmlu: Vec<(Vec<u32>, usize)>,
    /// Token ids of " A", " B", " C", " D".
    letters: [u32; 4],
}

impl Data {
    fn new(p: &Pipeline, args: &Args) -> Result<Self> {
        let n = args.windows;
        // Every window starts as a prompt does (Gemma: with BOS; SmolLM2, Qwen: no prefix).
        let bos = p.encode("", false)?;
        let body = WINDOW - bos.len();
        let wiki: Vec<Vec<u32>> = p.heldout_tokens(n * body + bos.len())?[bos.len()..].chunks_exact(body).map(|c| [&bos[..], c].concat()).collect();
        // Spread the windows over each text (1790 to 2021; chapter 1 to the end).
        let speeches = assets::sotu_speeches()?;
        let sotu = (0..n)
            .map(|i| p.encode_texts(speeches[(2 * i + 1) * speeches.len() / (2 * n)..].iter().cloned(), WINDOW))
            .collect::<candle_npu::Result<Vec<_>>>()?;
        let moby = assets::moby_dick()?;
        let moby = (0..n)
            .map(|i| {
                let mut at = i * moby.len() / n;
                while !moby.is_char_boundary(at) {
                    at += 1;
                }
                // Start at a paragraph; 8000 bytes hold well over 512 tokens.
                let at = moby[at..].find("\n\n").map_or(at, |o| at + o + 2);
                let end = (at + 8000).min(moby.len());
                let end = (end..moby.len()).find(|&e| moby.is_char_boundary(e)).unwrap_or(moby.len());
                p.encode_texts([moby[at..end].to_string()], WINDOW)
            })
            .collect::<candle_npu::Result<Vec<_>>>()?;
        let mut windows = vec![wiki, sotu, moby];
        for (w, name) in windows.iter_mut().zip(DOMAINS) {
            w.retain(|w| w.len() == WINDOW);
            if w.len() != n {
                bail!("{name}: only {} windows of {WINDOW} tokens (run scripts/setup.sh)", w.len());
            }
        }
        let letters = ["A", "B", "C", "D"].map(|l| p.encode_piece(&format!(" {l}")));
        let letters: Vec<u32> = letters
            .into_iter()
            .map(|ids| match ids?.as_slice() {
                [id] => Ok(*id),
                other => Err(anyhow!("answer letter is not one token: {other:?}")),
            })
            .collect::<Result<_>>()?;
        let mmlu = mmlu_subset(assets::mmlu()?, args.mmlu_per_subject, args.seed)
            .iter()
            .map(|q| Ok((p.encode(&mmlu_prompt(q), false)?, q.answer)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Data { windows, mmlu, letters: letters.try_into().expect("four letters") })
    }
}

/// `k` questions per subject, drawn with a seeded shuffle, subjects in sorted order.
fn mmlu_subset(all: Vec<MmluQuestion>, k: usize, seed: u64) -> Vec<MmluQuestion> {
    let mut by_subject: std::collections::BTreeMap<String, Vec<MmluQuestion>> = Default::default();
    for q in all {
        by_subject.entry(q.subject.clone()).or_default().push(q);
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    by_subject
        .into_values()
        .flat_map(|mut qs| {
            qs.shuffle(&mut rng);
            qs.truncate(k);
            qs
        })
        .collect()
}

/// The zero-shot prompt of the original MMLU evaluation.
fn mmlu_prompt(q: &MmluQuestion) -> String {
    let mut s = format!("The following is a multiple choice question about {}.\n\n{}\n", q.subject, q.question.trim());
    for (l, c) in ["A", "B", "C", "D"].iter().zip(&q.choices) {
        s += &format!("{l}. {}\n", c.trim());
    }
    s + "Answer:"
}

/// How a row computes logits: the NPU prefill (through the model's executor), or candle's CPU
/// forward with the decode weights.
#[derive(Clone, Copy, PartialEq)]
enum Path {
    Npu,
    Cpu,
}

fn logits_all(p: &mut Pipeline, path: Path, tokens: &[u32], chunk_len: usize) -> Result<Tensor> {
    Ok(match path {
        Path::Npu => p.model.prefill(tokens, &PrefillOptions::chunked(chunk_len).all_logits())?,
        Path::Cpu => {
            p.model.clear();
            p.model.extend(tokens, &PrefillOptions::default().all_logits().rows(PrefillRows::Cpu))?
        }
    })
}

fn logits_last(p: &mut Pipeline, path: Path, tokens: &[u32], chunk_len: usize) -> Result<Vec<f32>> {
    let l = match path {
        Path::Npu => p.model.prefill(tokens, &PrefillOptions::chunked(chunk_len))?,
        Path::Cpu => {
            p.model.clear();
            let l = p.model.extend(tokens, &PrefillOptions::default().all_logits().rows(PrefillRows::Cpu))?;
            l.get(l.dim(0)? - 1)?
        }
    };
    Ok(l.to_vec1()?)
}

#[derive(serde::Serialize)]
struct Row {
    name: String,
    /// Per domain.
    ppl: Vec<f64>,
    /// Share of scored positions whose argmax equals F32's (all domains).
    agreement: Option<f64>,
    mmlu: f64,
    tokens_per_sec: f64,
    /// Per domain: share of outliers in hot channels, and of values beyond the clip range.
    hit_rate: Option<Vec<f64>>,
    outlier_share: Option<Vec<f64>>,
    cold_reads: Option<u64>,
}

struct Suite<'a> {
    args: &'a Args,
    data: &'a Data,
    /// F32's argmax at every scored position, per domain and window.
    reference: Option<Vec<Vec<Vec<u32>>>>,
    bar: ProgressBar,
    /// Rows per NPU graph for the perplexity windows (`--chunk-len`, or a row's own).
    chunk_len: usize,
}

impl Suite<'_> {
    fn step(&self, msg: &str, len: usize) {
        self.bar.reset();
        self.bar.set_length(len as u64);
        self.bar.set_message(msg.to_string());
    }

    /// Perplexity of the scored halves of `windows`; returns (ppl, argmax per window, seconds).
    fn perplexity(&self, p: &mut Pipeline, path: Path, windows: &[Vec<u32>]) -> Result<(f64, Vec<Vec<u32>>, Duration)> {
        let (mut nll, mut tops, mut secs) = (0.0, vec![], Duration::ZERO);
        let half = WINDOW / 2;
        for w in windows {
            let t = Instant::now();
            let logits = logits_all(p, path, w, self.chunk_len)?;
            secs += t.elapsed();
            // Row i predicts token i + 1: rows half-1 .. WINDOW-2 score tokens half .. WINDOW-1.
            let scored = logits.narrow(0, half - 1, half)?;
            nll += mean_nll(&scored, &w[half - 1..])?;
            tops.push(scored.argmax(D::Minus1)?.to_vec1::<u32>()?);
            self.bar.inc(1);
        }
        Ok(((nll / windows.len() as f64).exp(), tops, secs))
    }

    /// Every domain's windows: perplexity, argmax, outlier statistics and prefill time.
    fn domains(&self, p: &mut Pipeline, path: Path) -> Result<Domains> {
        let mut d = Domains::default();
        for windows in &self.data.windows {
            p.model.reset_point_stats();
            let (x, t, s) = self.perplexity(p, path, windows)?;
            let mut st = PointStats::default();
            p.model.point_stats().into_iter().for_each(|(_, s)| st.add(s));
            d.hit.push(st.hot_hit_rate());
            d.share.push(st.outliers as f64 / st.elements.max(1) as f64);
            d.ppl.push(x);
            d.tops.push(t);
            d.secs += s;
        }
        Ok(d)
    }

    fn mmlu(&self, p: &mut Pipeline, path: Path) -> Result<f64> {
        let mut right = 0;
        for (prompt, answer) in &self.data.mmlu {
            let l = logits_last(p, path, prompt, self.args.mmlu_chunk_len)?;
            let scores = self.data.letters.map(|t| l[t as usize]);
            let pick = (0..4).max_by(|&a, &b| scores[a].total_cmp(&scores[b])).expect("four letters");
            right += (pick == *answer) as usize;
            self.bar.inc(1);
        }
        Ok(right as f64 / self.data.mmlu.len().max(1) as f64)
    }

    /// One row of the table. The first row evaluated (F32) becomes the agreement reference.
    fn row(&mut self, name: &str, p: &mut Pipeline, path: Path) -> Result<Row> {
        self.step(name, self.data.windows.iter().map(Vec::len).sum::<usize>() + self.data.mmlu.len());
        let shadow = path == Path::Npu && p.model.linears().any(|l| l.shadow_enabled());
        let cold0: u64 = p.model.linears().map(|l| l.cold_reads()).sum();
        let Domains { ppl, tops, hit, share, secs } = self.domains(p, path)?;
        let agreement = self.reference.as_ref().map(|r| {
            let pairs = r.iter().flatten().flatten().zip(tops.iter().flatten().flatten());
            let (same, n) = pairs.fold((0, 0), |(s, n), (a, b)| (s + (a == b) as usize, n + 1));
            same as f64 / n as f64
        });
        if self.reference.is_none() {
            self.reference = Some(tops);
        }
        let mmlu = self.mmlu(p, path)?;
        let tokens: usize = self.data.windows.iter().map(|w| w.len() * WINDOW).sum();
        let cold: u64 = p.model.linears().map(|l| l.cold_reads()).sum::<u64>() - cold0;
        let row = Row {
            name: name.to_string(),
            ppl,
            agreement,
            mmlu,
            tokens_per_sec: tokens as f64 / secs.as_secs_f64(),
            hit_rate: shadow.then_some(hit),
            outlier_share: shadow.then_some(share),
            cold_reads: shadow.then_some(cold),
        };
        self.bar.suspend(|| eprintln!("{}", table_line(&row)));
        Ok(row)
    }
}

/// Per domain: perplexity, argmax per window, hot-channel hit rate, share of values beyond the
/// clip range; and the prefill time of all windows.
#[derive(Default)]
struct Domains {
    ppl: Vec<f64>,
    tops: Vec<Vec<Vec<u32>>>,
    hit: Vec<f64>,
    share: Vec<f64>,
    secs: Duration,
}

/// One point of the pruning curve.
#[derive(serde::Serialize)]
struct CurvePoint {
    rate: f64,
    layers_pruned: usize,
    ppl_wikipedia: f64,
    /// CPU time of the shadow path over the prefill time.
    shadow_share: f64,
    prefill_secs: f64,
}

fn table_line(r: &Row) -> String {
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
    format!("| {} | {:.2} | {:.2} | {:.2} | {} | {:.1}% | {:.0} |", r.name, r.ppl[0], r.ppl[1], r.ppl[2], opt(r.agreement), 100.0 * r.mmlu, r.tokens_per_sec)
}

fn load(path: &std::path::Path, dev: &NpuDevice, precision: Precision, weights: WeightQuant) -> Result<Pipeline> {
    load_with(path, dev, precision, weights, DecodeWeights::Q8_0)
}

/// `--kv-cache`: how every pipeline of the run holds its KV cache.
static KV: std::sync::OnceLock<KvType> = std::sync::OnceLock::new();

fn load_with(path: &std::path::Path, dev: &NpuDevice, precision: Precision, weights: WeightQuant, decode_weights: DecodeWeights) -> Result<Pipeline> {
    let kv = KV.get().copied().unwrap_or_default();
    Pipeline::load(path, None, dev, LoadOptions { precision: Some(precision), decode_weights, weights, kv, ..Default::default() })
        .with_context(|| format!("loading {}", path.display()))
}

fn print_decode(model: &std::path::Path, rows: &[DecodeRow], f32_ppl: &[f64]) {
    println!("\nDecode weights, {} (candle CPU forward over the windows; x F32 per domain: Wikipedia / SOTU / Moby Dick):\n", model.display());
    println!("| decode weights | linear weights MB | ppl x F32 | decode tok/s |");
    println!("|---|---|---|---|");
    for r in rows {
        let ratio: Vec<String> = r.ppl.iter().zip(f32_ppl).map(|(a, b)| format!("{:.3}", a / b)).collect();
        println!("| {} | {:.0} | {} | {:.1} |", r.weights, r.linear_mb, ratio.join(" / "), r.decode_tok_s);
    }
}

/// One decode weight format: candle CPU perplexity (the decode path's numerics over whole
/// windows) and decode speed.
#[derive(serde::Serialize)]
struct DecodeRow {
    weights: String,
    /// Bytes of the decode matmuls' weights (linears, embedding and output tables excluded).
    linear_mb: f64,
    ppl: Vec<f64>,
    /// Tokens per second, greedy, after a 16-token prompt; median of 3 runs of 64 tokens.
    decode_tok_s: f64,
}

fn decode_row(suite: &mut Suite, name: &str, p: &mut Pipeline) -> Result<DecodeRow> {
    let row = suite.row(&format!("candle CPU prefill, decode weights: {name}"), p, Path::Cpu)?;
    let prompt = &suite.data.windows[0][0][..16];
    let mut speeds = vec![];
    for _ in 0..3 {
        p.model.clear();
        let mut next = p.model.extend(prompt, &PrefillOptions::default().all_logits().rows(PrefillRows::Cpu))?.get(15)?.argmax(0)?.to_scalar::<u32>()?;
        let t = Instant::now();
        for _ in 0..64 {
            next = p.model.decode(next)?.argmax(0)?.to_scalar::<u32>()?;
        }
        speeds.push(64.0 / t.elapsed().as_secs_f64());
    }
    speeds.sort_by(f64::total_cmp);
    let linear_mb = p.model.linears().map(|l| l.decode_bytes()).sum::<usize>() as f64 / 1e6;
    Ok(DecodeRow { weights: name.to_string(), linear_mb, ppl: row.ppl, decode_tok_s: speeds[1] })
}

/// One hot-set coverage: float columns kept against all, and what happened on each domain.
#[derive(serde::Serialize)]
struct HotPoint {
    coverage: f64,
    hot_channels: usize,
    hot_mb: f64,
    all_columns_mb: f64,
    ppl: Vec<f64>,
    hit_rate: Vec<f64>,
    cold_reads: u64,
    shadow_share: f64,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_writer(std::io::stderr).init();
    let mut args = Args::parse();
    KV.set(match args.kv_cache.as_str() {
        "f32" => KvType::F32,
        "q8" => KvType::Q8,
        _ => KvType::F16,
    })
    .expect("set once");
    let on = |s: &str| args.sections.iter().any(|x| x == s);
    let (do_rows, do_curve, do_hot, do_decode, do_htp) = (on("rows"), on("curve"), on("hot"), on("decode"), on("htp"));
    let (do_calibration, do_chat) = (on("calibration"), on("chat"));
    if let Some(bad) = args.htp_plans.iter().find(|p| !["stages", "layers"].contains(&p.as_str())) {
        bail!("--htp-plans: unknown plan '{bad}' (stages, layers)");
    }
    if let Some(bad) = args.sections.iter().find(|s| !["rows", "curve", "hot", "decode", "htp", "calibration", "chat"].contains(&s.as_str())) {
        bail!("unknown section '{bad}' (rows, curve, hot, decode, htp, calibration, chat)");
    }
    if do_chat && args.sections.len() > 1 {
        bail!("--sections chat runs alone (it calibrates as a user's first run does, on the shipped text)");
    }
    if do_calibration && args.calibration_sizes.contains(&0) {
        bail!("--calibration-sizes are numbers of sequences, at least 1");
    }
    if args.windows == 0 || args.rates.iter().chain(&args.coverages).any(|r| !(0.0..=1.0).contains(r)) {
        bail!("--windows must be at least 1, --rates and --coverages within 0..=1");
    }
    if !(args.budget > 0.0 && args.budget < 1.0) {
        bail!("--budget {} is not a share of values in (0, 1)", args.budget);
    }
    if args.chunk_len == 0 || args.mmlu_chunk_len == 0 {
        bail!("--chunk-len and --mmlu-chunk-len must be at least 1");
    }
    // Checked before the minutes of evaluation the plot comes after.
    if do_curve {
        candle_npu::fs::check_writable(&args.png).with_context(|| format!("--png {}", args.png.display()))?;
    }
    if !do_rows {
        args.mmlu_per_subject = 0; // the F32 row still runs, for the reference perplexities
    }
    let args = args;
    let model_path = args.model.clone().unwrap_or_else(assets::smollm2);
    let dev = NpuDevice::host();
    let bar = ProgressBar::new(0).with_style(ProgressStyle::with_template("{msg:38} {bar:30} {pos}/{len} ({elapsed}, eta {eta})")?);

    if do_chat {
        // The reference decodes as every compared prefill does (the file's blocks, the
        // pipelines' default): its answers differ from theirs by the prefill alone. (With the
        // rows' Q8_0 decode of the INT8 weights they differed by the decode too: 16-token
        // agreement near 55% whatever the prefill, up to 2026-11-28.)
        let mut f32p = load_with(&model_path, &dev, Precision::F32, WeightQuant::PerChannel, DecodeWeights::Checkpoint)?;
        return chat(&args, &model_path, &mut f32p, &bar);
    }
    let mut f32p = load(&model_path, &dev, Precision::F32, WeightQuant::PerChannel)?;
    let data = Data::new(&f32p, &args)?;
    eprintln!("{} windows of {WINDOW} tokens per domain, {} MMLU questions", args.windows, data.mmlu.len());
    let mut suite = Suite { args: &args, data: &data, reference: None, bar, chunk_len: args.chunk_len };
    let mut rows = vec![suite.row("F32 prefill", &mut f32p, Path::Npu)?];
    let mut decode = vec![];
    if do_decode {
        decode.push(decode_row(&mut suite, "Q8_0 from the INT8 weights", &mut f32p)?);
        let mut ck = load_with(&model_path, &dev, Precision::F32, WeightQuant::PerChannel, DecodeWeights::Checkpoint)?;
        decode.push(decode_row(&mut suite, "the checkpoint's own tensors", &mut ck)?);
        if !(do_rows || do_curve || do_hot) {
            suite.bar.finish_and_clear();
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({ "model": model_path.display().to_string(), "f32_ppl": rows[0].ppl, "decode_weights": decode }))?
                );
            } else {
                print_decode(&model_path, &decode, &rows[0].ppl);
            }
            return Ok(());
        }
    }

    // The default calibration (`Pipeline::calibrate_on`, the `CalibrationSet` defaults but for
    // the text and the number of sequences) against its size: accuracy and time.
    let mut calibration = vec![];
    if do_calibration {
        let mut c = load(&model_path, &dev, Precision::W8A8, WeightQuant::PerChannel)?;
        let most = args.calibration_sizes.iter().copied().max().unwrap_or(1);
        let set = CalibrationSet { source: args.calibration.into(), sequences: most, ..CalibrationSet::default() };
        let seqs = c.calibration_sequences(set)?;
        for &n in &args.calibration_sizes {
            let n = n.min(seqs.len());
            let t = Instant::now();
            c.calibrate_on(&seqs[..n], set, |_, _| {})?;
            let secs = t.elapsed().as_secs_f64();
            let row = suite.row(&format!("calibrated on {n} x {} tokens ({secs:.1} s)", set.seq_len), &mut c, Path::Npu)?;
            calibration.push(json!({ "sequences": n, "seq_len": set.seq_len, "calibration_secs": secs, "ppl": row.ppl, "agreement": row.agreement }));
        }
        if !(do_rows || do_curve || do_hot || do_htp) {
            suite.bar.finish_and_clear();
            let f32_ppl = &rows[0].ppl;
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({ "model": model_path.display().to_string(), "f32_ppl": f32_ppl, "calibration": calibration }))?
                );
            } else {
                print_calibration(&model_path, set.source, &calibration, f32_ppl);
            }
            return Ok(());
        }
    }

    // Calibrate once (Wikipedia, F32 pass); every quantized row uses these statistics.
    let mut q = load(&model_path, &dev, Precision::W8A8, WeightQuant::PerChannel)?;
    let set = CalibrationSet {
        importance_sequences: args.importance_sequences,
        source: args.calibration.into(),
        clip: ClipMethod::Budget { fraction: args.budget },
        ..CalibrationSet::default()
    };
    let seqs = q.calibration_sequences(set)?;
    suite.step("calibrating on Wikipedia", seqs.len());
    let cal = q.model.calibrate(&seqs, |i| suite.bar.set_position(i as u64))?;
    let id = q.model.model_id().to_string();
    let minmax = cal.finish(id.clone(), ClipMethod::MinMax);
    let mut shadow = cal.finish(id, set.clip);
    q.model.set_profile(shadow.clone())?;
    let n_layer = q.model.config().n_layer;
    let n_imp = set.importance_sequences.clamp(1, seqs.len());
    if do_curve || do_rows {
        suite.step("measuring layer importance", 1 + n_layer);
        shadow.importance = q.model.measure_importance(&seqs[..n_imp], args.chunk_len, |i, _| suite.bar.set_position(i as u64))?;
    }

    if do_rows {
        let mut naive = load(&model_path, &dev, Precision::W8A8, WeightQuant::PerTensor)?;
        naive.model.set_profile(minmax.clone())?;
        naive.model.set_shadow_layers(&vec![false; n_layer])?;
        rows.push(suite.row("naive W8A8 (per-tensor weights, min/max, no shadow)", &mut naive, Path::Npu)?);
        drop(naive);
        q.model.set_profile(minmax)?;
        q.model.set_shadow_layers(&vec![false; n_layer])?;
        rows.push(suite.row("W8A8 per-channel weights, min/max, no shadow", &mut q, Path::Npu)?);
        q.model.set_profile(shadow.clone())?;
        rows.push(suite.row("shadow W8A8, unpruned", &mut q, Path::Npu)?);
        // INT8 plus an INT8 residual on every linear (issue 46's weight side, docs/npu_weights.md).
        let all: Vec<String> = candle_npu_models::transformer::linear_names().map(String::from).collect();
        let mut wide = Pipeline::load(&model_path, None, &dev, LoadOptions { residual: all, ..Default::default() })?;
        wide.model.set_profile(shadow.clone())?;
        rows.push(suite.row("shadow W8A8, INT8 + residual weights on every linear", &mut wide, Path::Npu)?);
    }

    // The prefill plans on the HTP's numerics (the host executor in its HTP mode, proven against the
    // library in candle-npu/tests/htp_conformance.rs and tests/hexagon.rs), beside the host's.
    let mut htp_rows = vec![];
    let htp_plan = |p: &str| args.htp_plans.iter().any(|x| x == p);
    if do_htp && htp_plan("stages") {
        q.model.set_profile(shadow.clone())?;
        htp_rows.push(suite.row("host executor, shadow W8A8", &mut q, Path::Npu)?);
        let mut h = load(&model_path, &NpuDevice::host_with(Numerics::Htp), Precision::W8A8, WeightQuant::PerChannel)?;
        h.model.set_profile(shadow.clone())?;
        h.model.set_sched(SchedOptions { tail: Tail::Pad, ..Default::default() })?;
        htp_rows.push(suite.row(&format!("HTP numerics, shadow W8A8 stages, padded (chunks of {})", args.chunk_len), &mut h, Path::Npu)?);
        // llm.npu's plan with a margin: chunks, then 32-row chunks, then a CPU margin. A window of 512 tokens
        // in chunks of 250 leaves a 12-row margin (with chunks of 256 there would be none).
        h.model.set_sched(SchedOptions::default())?;
        let margin_len = WINDOW - WINDOW / 250 * 250;
        suite.chunk_len = 250;
        htp_rows.push(suite.row(&format!("HTP numerics, shadow W8A8 stages, chunks of 250 and a {margin_len}-row CPU margin"), &mut h, Path::Npu)?);
        suite.chunk_len = args.chunk_len;
    }
    if do_htp && htp_plan("layers") {
        // The HTP's default plan (`SchedOptions::for_device`): each layer one graph, shadow W8A16
        // with the outliers through float weights; on the host, and on the HTP's numerics.
        for (numerics, label) in [
            (Numerics::Exact, "host executor, whole layers, shadow W8A16"),
            (Numerics::Htp, "HTP numerics, the default plan: whole layers, shadow W8A16, padded"),
        ] {
            let mut w = load(&model_path, &NpuDevice::host_with(numerics), Precision::W8A16Shadow, WeightQuant::PerChannel)?;
            w.model.set_profile(shadow.clone())?;
            w.model.set_sched(SchedOptions { tail: Tail::Pad, plan: PrefillPlan::Layers, ..Default::default() })?;
            htp_rows.push(suite.row(&format!("{label} (chunks of {})", args.chunk_len), &mut w, Path::Npu)?);
        }
        // 4-bit NPU weights (issue 49): LPBQ in blocks of 32, the only blockwise form the HTP
        // takes, requantized from the file (docs/npu_weights.md), on the same plan.
        let kv = KV.get().copied().unwrap_or_default();
        let (weights, lpbq, which) = match args.lpbq.is_empty() {
            true => (WeightQuant::Lpbq { block: 32 }, vec![], "every linear".to_string()),
            false => (WeightQuant::PerChannel, args.lpbq.clone(), args.lpbq.join(", ")),
        };
        let opts = LoadOptions { precision: Some(Precision::W8A16Shadow), decode_weights: DecodeWeights::Q8_0, weights, lpbq, kv, ..Default::default() };
        let mut w4 = Pipeline::load(&model_path, None, &NpuDevice::host_with(Numerics::Htp), opts)?;
        w4.model.set_profile(shadow.clone())?;
        w4.model.set_sched(SchedOptions { tail: Tail::Pad, plan: PrefillPlan::Layers, ..Default::default() })?;
        htp_rows.push(suite.row(
            &format!("HTP numerics, the default plan with LPBQ 4-bit weights on {which} (chunks of {})", args.chunk_len),
            &mut w4,
            Path::Npu,
        )?);
    }

    // The pruning curve, on held-out Wikipedia.
    let mut curve = vec![];
    if do_curve {
        suite.step("pruning curve", args.rates.len() * args.windows);
        for &rate in &args.rates {
            let on = q.model.prune_shadow(rate)?;
            q.model.take_shadow_time();
            let (ppl, _, secs) = suite.perplexity(&mut q, Path::Npu, &data.windows[0])?;
            let shadow_secs = q.model.take_shadow_time();
            curve.push(CurvePoint {
                rate,
                layers_pruned: on.iter().filter(|&&on| !on).count(),
                ppl_wikipedia: ppl,
                shadow_share: shadow_secs.as_secs_f64() / secs.as_secs_f64(),
                prefill_secs: secs.as_secs_f64(),
            });
        }
    }
    if do_rows {
        q.model.prune_shadow(DEFAULT_PRUNE_RATE)?;
        rows.push(suite.row(&format!("shadow W8A8, default pruning ({:.0}%)", 100.0 * DEFAULT_PRUNE_RATE), &mut q, Path::Npu)?);
        let mut w16 = load(&model_path, &dev, Precision::W8A16, WeightQuant::PerChannel)?;
        w16.model.set_profile(shadow.clone())?;
        rows.push(suite.row("W8A16 (u16 activations, min/max, no shadow)", &mut w16, Path::Npu)?);
        drop(w16);
        rows.push(suite.row("candle CPU prefill, Q8_0 weights", &mut f32p, Path::Cpu)?);
    }

    // Hot sets by coverage of the calibration outliers (counted in a W8A8 pass), on all domains.
    let mut hot = vec![];
    if do_hot {
        q.model.set_profile(shadow.clone())?;
        suite.step("counting outliers per channel", seqs.len());
        let counts = q.model.count_channel_outliers(&seqs, args.chunk_len, |i| suite.bar.set_position(i as u64))?;
        suite.step("hot-set coverages", args.coverages.len() * 3 * args.windows);
        for &coverage in &args.coverages {
            let mut prof = shadow.clone();
            prof.select_hot(&counts, coverage)?;
            q.model.set_profile(prof.clone())?;
            let cold0: u64 = q.model.linears().map(|l| l.cold_reads()).sum();
            q.model.take_shadow_time();
            let d = suite.domains(&mut q, Path::Npu)?;
            let mb = |b: usize| b as f64 / 1e6;
            hot.push(HotPoint {
                coverage,
                hot_channels: prof.points.values().map(|p| p.hot.len()).sum(),
                hot_mb: mb(q.model.linears().map(|l| l.hot_bytes()).sum()),
                all_columns_mb: mb(q.model.linears().map(|l| l.all_columns_bytes()).sum()),
                ppl: d.ppl,
                hit_rate: d.hit,
                cold_reads: q.model.linears().map(|l| l.cold_reads()).sum::<u64>() - cold0,
                shadow_share: q.model.take_shadow_time().as_secs_f64() / d.secs.as_secs_f64(),
            });
        }
    }
    suite.bar.finish_and_clear();

    let png = if do_curve { draw_curve(&args, &curve, rows[0].ppl[0]) } else { Ok(()) };
    if let Err(e) = &png {
        eprintln!("pruning curve not drawn: {e:#}");
    }
    if args.json {
        let out = json!({
            "model": model_path.display().to_string(),
            "windows_per_domain": args.windows, "window": WINDOW, "mmlu_questions": data.mmlu.len(), "seed": args.seed,
            "calibration": { "sequences": set.sequences, "seq_len": set.seq_len, "clip": format!("{:?}", set.clip), "importance_sequences": n_imp },
            "domains": DOMAINS, "rows": rows, "htp_rows": htp_rows, "pruning_curve": curve, "importance": shadow.importance,
            "hot_channels_by_kind": hot_summary(&shadow), "hot_coverage": hot, "decode_weights": decode,
            "calibration_size": calibration,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let f32_ppl = rows[0].ppl.clone();
    if do_rows {
        println!(
            "\n{}, host executor; {} x {WINDOW}-token windows per domain (second halves scored); MMLU {} questions ({} per subject, seed {}).\n",
            model_path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            args.windows,
            data.mmlu.len(),
            args.mmlu_per_subject,
            args.seed
        );
        println!("| prefill | ppl Wikipedia | ppl SOTU | ppl Moby Dick | top-1 agreement | MMLU | prefill tok/s |");
        println!("|---|---|---|---|---|---|---|");
        rows.iter().for_each(|r| println!("{}", table_line(r)));
        println!("\nDomain shift (calibrated on Wikipedia; shadow W8A8 unpruned):\n");
        println!("| domain | perplexity x F32 | outliers (share of values) | hot-channel hit rate |");
        println!("|---|---|---|---|");
        let s = rows.iter().find(|r| r.name == "shadow W8A8, unpruned").expect("row");
        for (d, name) in DOMAINS.iter().enumerate() {
            let (h, o) = (s.hit_rate.as_ref().expect("shadow row"), s.outlier_share.as_ref().expect("shadow row"));
            println!("| {name} | {:.4} | {:.2e} | {:.4} |", s.ppl[d] / f32_ppl[d], o[d], h[d]);
        }
        println!("\ncold-channel column reads (shadow unpruned, all domains): {}", s.cold_reads.unwrap_or(0));
    }
    if do_htp {
        println!("\n{}, the prefill plans on the HTP's numerics; {} x {WINDOW}-token windows per domain; ppl x F32 (Wikipedia / SOTU / Moby Dick; F32 {:.2} / {:.2} / {:.2}):\n",
            model_path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(), args.windows, f32_ppl[0], f32_ppl[1], f32_ppl[2]);
        println!("| prefill | ppl x F32 | top-1 agreement with F32 |");
        println!("|---|---|---|");
        for r in &htp_rows {
            let ratio: Vec<String> = r.ppl.iter().zip(&f32_ppl).map(|(a, b)| format!("{:.3}", a / b)).collect();
            println!("| {} | {} | {:.3} |", r.name, ratio.join(" / "), r.agreement.unwrap_or(f64::NAN));
        }
    }
    if do_curve {
        println!("\nPruning curve (held-out Wikipedia; F32 {:.3}):\n", f32_ppl[0]);
        println!("| shadow paths pruned | layers | perplexity | x F32 | shadow share of prefill time | prefill s |");
        println!("|---|---|---|---|---|---|");
        for c in &curve {
            println!(
                "| {:.0}% | {} | {:.3} | {:.4} | {:.1}% | {:.2} |",
                100.0 * c.rate,
                c.layers_pruned,
                c.ppl_wikipedia,
                c.ppl_wikipedia / f32_ppl[0],
                100.0 * c.shadow_share,
                c.prefill_secs
            );
        }
        if png.is_ok() {
            println!("\npruning curve: {}", args.png.display());
        }
    }
    if do_hot {
        println!("\nHot sets by coverage of calibration outliers (float columns kept vs all; x F32 and hit rate per domain: Wikipedia / SOTU / Moby Dick):\n");
        println!("| coverage | hot channels | hot MB | all MB | ppl x F32 | hit rate | cold column reads | shadow share |");
        println!("|---|---|---|---|---|---|---|---|");
        for h in &hot {
            let ratio: Vec<String> = h.ppl.iter().zip(&f32_ppl).map(|(a, b)| format!("{:.4}", a / b)).collect();
            let hit: Vec<String> = h.hit_rate.iter().map(|x| format!("{x:.3}")).collect();
            println!(
                "| {} | {} | {:.0} | {:.0} | {} | {} | {} | {:.1}% |",
                h.coverage,
                h.hot_channels,
                h.hot_mb,
                h.all_columns_mb,
                ratio.join(" / "),
                hit.join(" / "),
                h.cold_reads,
                100.0 * h.shadow_share
            );
        }
    }
    if do_decode {
        print_decode(&model_path, &decode, &f32_ppl);
    }
    if do_calibration {
        print_calibration(&model_path, args.calibration.into(), &calibration, &f32_ppl);
    }
    println!("\nhot channels per point kind (clip budget, every channel with a calibration outlier): {}", hot_summary(&shadow));
    Ok(())
}

/// The chat section: the default profile, the F32 references, each prefill's outcomes.
fn chat(args: &Args, model_path: &std::path::Path, f32p: &mut Pipeline, bar: &ProgressBar) -> Result<()> {
    let mut convs = candle_npu_models::chat_eval::conversations()?;
    if let Some(id) = args.chat_ids.iter().find(|id| !convs.iter().any(|c| &c.id == *id)) {
        bail!("--chat-ids: no conversation {id} in the chat set");
    }
    if !args.chat_ids.is_empty() {
        convs.retain(|c| args.chat_ids.contains(&c.id));
    }
    if args.chat_limit > 0 {
        convs.truncate(args.chat_limit);
    }
    bar.set_message("calibrating");
    let profiles = args
        .chat_calibration
        .iter()
        .map(|&chats| Ok((format!("calibrated on 4 text + {chats} chat windows"), chat_section::profile(model_path, chats)?)))
        .collect::<Result<Vec<_>>>()?;
    let refs = chat_section::references(f32p, &convs, bar)?;
    if let Some(path) = &args.chat_dump {
        let text = serde_json::to_string(&chat_section::dump(model_path, f32p, &convs, &refs)?)?;
        candle_npu::fs::write_atomic(path, |f| std::io::Write::write_all(f, text.as_bytes()))?;
    }
    let mut rows = chat_section::rows(model_path, &profiles, &refs, f32p, &args.chat_rows, &args.chat_residual, bar)?;
    if args.chat_residual_by_layer {
        for l in 0..f32p.model.config().n_layer {
            let one: Vec<String> = args.chat_residual.iter().map(|r| format!("blk.{l}.{r}")).collect();
            rows.extend(chat_section::rows(model_path, &profiles, &refs, f32p, &["residual".into()], &one, bar)?);
        }
    }
    bar.finish_and_clear();
    let summaries: Vec<_> = rows.iter().map(|r| r.summary(&convs)).collect();
    if args.json {
        let per: Vec<_> = rows.iter().map(|r| json!({ "name": r.name, "outcomes": r.outcomes })).collect();
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({ "model": model_path.display().to_string(), "ids": convs.iter().map(|c| &c.id).collect::<Vec<_>>(), "rows": summaries, "per_conversation": per })
            )?
        );
    } else {
        chat_section::print(model_path, &summaries);
    }
    Ok(())
}

/// The calibration section's table.
fn print_calibration(model: &std::path::Path, source: CalibrationSource, rows: &[serde_json::Value], f32_ppl: &[f64]) {
    println!(
        "\nCalibration size, {} ({source:?} text; ppl x F32 per domain: Wikipedia / SOTU / Moby Dick; F32 {:.2} / {:.2} / {:.2}):\n",
        model.display(),
        f32_ppl[0],
        f32_ppl[1],
        f32_ppl[2]
    );
    println!("| sequences x tokens | calibration s | ppl x F32 | top-1 agreement with F32 |");
    println!("|---|---|---|---|");
    let num = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    for c in rows {
        let ppl = c["ppl"].as_array().map(Vec::as_slice).unwrap_or_default();
        let ratio: Vec<String> = ppl.iter().zip(f32_ppl).map(|(a, b)| format!("{:.4}", num(a) / b)).collect();
        println!("| {} x {} | {:.1} | {} | {:.3} |", c["sequences"], c["seq_len"], num(&c["calibration_secs"]), ratio.join(" / "), num(&c["agreement"]));
    }
}

/// Hot channels per point kind and the float columns they keep.
fn hot_summary(p: &QuantProfile) -> serde_json::Value {
    let mut kinds = serde_json::Map::new();
    for kind in candle_npu_models::transformer::STAGES.iter().map(|s| s.point) {
        let pts: Vec<_> = p.points.iter().filter(|(n, _)| n.ends_with(&format!(".{kind}"))).map(|(_, p)| p).collect();
        let (hot, ch): (usize, usize) = pts.iter().fold((0, 0), |a, p| (a.0 + p.hot.len(), a.1 + p.channels));
        kinds.insert(kind.to_string(), json!({ "hot_channels": hot, "channels": ch, "share": hot as f64 / ch.max(1) as f64 }));
    }
    serde_json::Value::Object(kinds)
}

/// The pruning curve as a PNG: perplexity (left axis) and the shadow share (right), written to
/// a temporary file and renamed, so a failed run leaves no half-written image.
fn draw_curve(args: &Args, curve: &[CurvePoint], f32_ppl: f64) -> Result<()> {
    use plotters::prelude::*;
    let font = std::fs::read(&args.font).with_context(|| format!("font {} (pass --font)", args.font.display()))?;
    plotters::style::register_font("sans", FontStyle::Normal, Box::leak(font.into_boxed_slice()))
        .map_err(|_| anyhow!("{}: not a TrueType font", args.font.display()))?;
    let stem = args.png.file_stem().and_then(|s| s.to_str()).unwrap_or("curve");
    // Unique per process (two runs may draw into one folder); `.png` last, for the encoder.
    let tmp = args.png.with_file_name(format!(".{stem}.{}.partial.png", std::process::id()));
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", args.png.display());
    {
        let root = BitMapBackend::new(&tmp, (900, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let ppl_max = curve.iter().map(|c| c.ppl_wikipedia).fold(f32_ppl * 1.05, f64::max) * 1.02;
        let share_max = curve.iter().map(|c| 100.0 * c.shadow_share).fold(1.0, f64::max) * 1.2;
        let mut chart = ChartBuilder::on(&root)
            .caption("SmolLM2-135M: pruning the shadow path (held-out Wikipedia)", ("sans", 20))
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(65)
            .right_y_label_area_size(65)
            .build_cartesian_2d(0f64..100f64, (f32_ppl * 0.98)..ppl_max)
            .map_err(|e| err(&e))?
            .set_secondary_coord(0f64..100f64, 0f64..share_max);
        chart.configure_mesh().x_desc("layers whose shadow path is pruned (%)").y_desc("perplexity").label_style(("sans", 14)).draw().map_err(|e| err(&e))?;
        chart.configure_secondary_axes().y_desc("shadow share of prefill time (%)").label_style(("sans", 14)).draw().map_err(|e| err(&e))?;
        let pts: Vec<(f64, f64)> = curve.iter().map(|c| (100.0 * c.rate, c.ppl_wikipedia)).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), BLUE.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label("perplexity, shadow W8A8")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, BLUE.filled()))).map_err(|e| err(&e))?;
        for (factor, label, color) in [(1.0, "F32", BLACK), (1.02, "1.02 x F32", RED)] {
            chart
                .draw_series(LineSeries::new([(0.0, f32_ppl * factor), (100.0, f32_ppl * factor)], color.mix(0.6)))
                .map_err(|e| err(&e))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.mix(0.6)));
        }
        let share: Vec<(f64, f64)> = curve.iter().map(|c| (100.0 * c.rate, 100.0 * c.shadow_share)).collect();
        chart
            .draw_secondary_series(LineSeries::new(share, GREEN.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label("shadow share of prefill time (right axis)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], GREEN));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans", 14))
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    std::fs::rename(&tmp, &args.png).with_context(|| format!("renaming {} to {}", tmp.display(), args.png.display()))?;
    Ok(())
}
