//! `eval --sections chat`: the chat accuracy eval ([`candle_npu_models::chat_eval`]) over every
//! conversation, per prefill, against the F32 prefill; `--chat-dump` writes the rendered prompts
//! and the F32 answers for `scripts/chat_anchor.py` (llama.cpp's Q8_0 against its own F16 on
//! the same prompts).

use std::path::Path;

use anyhow::Result;
use candle_npu::{NpuDevice, Numerics, QuantProfile, Tail};
use candle_npu_models::chat_eval::{self, Conversation, Outcome, Reference, ANSWER_TOKENS};
use candle_npu_models::{CalibrationSet, LoadOptions, Pipeline, Precision, PrefillPlan, SchedOptions};
use indicatif::ProgressBar;
use serde_json::json;

/// One prefill's outcomes over the conversations.
pub struct ChatRow {
    pub name: String,
    pub outcomes: Vec<Outcome>,
}

impl ChatRow {
    /// The row's summary: KL mean / median / 95th percentile / max, first-16 agreement, derails.
    pub fn summary(&self, convs: &[Conversation]) -> serde_json::Value {
        let mut kl: Vec<f64> = self.outcomes.iter().map(|o| o.kl).collect();
        kl.sort_by(f64::total_cmp);
        let n = kl.len().max(1);
        let at = |q: f64| kl.get(((n - 1) as f64 * q).round() as usize).copied().unwrap_or(f64::NAN);
        let derails: Vec<_> = self
            .outcomes
            .iter()
            .zip(convs)
            .filter_map(|(o, c)| o.derail.as_ref().map(|d| json!({ "id": c.id, "why": d, "excess_nats": o.excess_nats })))
            .collect();
        json!({
            "name": self.name,
            "conversations": self.outcomes.len(),
            "kl_mean": kl.iter().sum::<f64>() / n as f64, "kl_median": at(0.5), "kl_p95": at(0.95), "kl_max": at(1.0),
            "same_answer": self.outcomes.iter().filter(|o| o.same).count() as f64 / n as f64,
            "first_token_same": self.outcomes.iter().filter(|o| o.agree > 0).count() as f64 / n as f64,
            "mean_agreed_tokens": self.outcomes.iter().map(|o| o.agree as f64).sum::<f64>() / n as f64,
            "derailed": derails,
        })
    }
}

/// The prefills the chat section can compare with F32 (`--chat-rows`).
pub const ROWS: [&str; 17] = [
    "w8a8",
    "float",
    "htp",
    "w8a16",
    "htp-w8a16",
    "w8a16-shadow",
    "htp-w8a16-shadow",
    "residual",
    "htp-residual",
    "w8a16-shadow-residual",
    "htp-w8a16-shadow-residual",
    "f32",
    "layers-w8a16",
    "htp-layers-w8a16",
    "layers-w8a16-shadow",
    "htp-layers-w8a16-shadow",
    "layers-w8a16-shadow-residual",
];

/// The prefills the chat section compares with F32, those of `which` (names of [`ROWS`]):
/// `w8a8`, the host executor with each of `profiles` (W8A8 with shadow outliers); `float`, the
/// first profile's INT8 weights with float activations, which tells the weights' share of the
/// drift from the activations'; `htp`, the HTP's numerics with the first profile (padded
/// chunks, as on a real NPU); `w8a16` and `htp-w8a16`, u16 activations over the first profile's
/// full ranges (no shadow: the vendors' precision) on the host executor and on the HTP's numerics;
/// `w8a16-shadow` and `htp-w8a16-shadow`, u16 activations over the first profile's clip ranges
/// with shadow outliers;
/// `residual` and `htp-residual`, shadow W8A8 with the linears of `residual` holding INT8 plus an
/// INT8 residual (`LoadOptions::residual`); `w8a16-shadow-residual` and its `htp-` row, both;
/// `f32`, a second F32 prefill: what the measures give with nothing changed; `layers-w8a16`,
/// `layers-w8a16-shadow` and their `htp-` rows, W8A16 and shadow W8A16 with each layer one graph
/// (`PrefillPlan::Layers`: shadow W8A16's outliers through float weights inside the graph), and
/// `layers-w8a16-shadow-residual` with the linears of `residual` holding INT8 plus a residual.
pub fn rows(
    model: &Path,
    profiles: &[(String, QuantProfile)],
    refs: &[Reference],
    f32p: &mut Pipeline,
    which: &[String],
    residual: &[String],
    bar: &ProgressBar,
) -> Result<Vec<ChatRow>> {
    if let Some(bad) = which.iter().find(|w| !ROWS.contains(&w.as_str())) {
        anyhow::bail!("unknown chat row '{bad}' (one of {})", ROWS.join(", "));
    }
    let on = |r: &str| which.iter().any(|w| w == r);
    let mut out = vec![];
    let mut run = |name: &str, p: &mut Pipeline| -> Result<()> {
        bar.reset();
        bar.set_length(refs.len() as u64);
        bar.set_message(format!("chat: {name}"));
        let outcomes = refs
            .iter()
            .map(|r| {
                bar.inc(1);
                chat_eval::measure(p, f32p, r)
            })
            .collect::<candle_npu::Result<Vec<_>>>()?;
        out.push(ChatRow { name: name.to_string(), outcomes });
        Ok(())
    };
    let (name, first) = &profiles[0];
    if on("w8a8") || on("float") {
        let mut q = Pipeline::load(model, None, &NpuDevice::host(), LoadOptions::default())?;
        if on("w8a8") {
            for (name, profile) in profiles {
                q.model.set_profile(profile.clone())?;
                run(&format!("host executor, shadow W8A8, {name}"), &mut q)?;
            }
        }
        if on("float") {
            q.model.set_profile(float_activations(first))?;
            run(&format!("INT8 weights, float activations ({name})"), &mut q)?;
        }
    }
    // Each of the other rows on a pipeline of its own, with the first profile; on the HTP's
    // numerics, in padded chunks as on a real NPU.
    let w8a16 = LoadOptions { precision: Some(Precision::W8A16), ..Default::default() };
    let w8a16_shadow = LoadOptions { precision: Some(Precision::W8A16Shadow), ..Default::default() };
    let wide = LoadOptions { residual: residual.to_vec(), ..Default::default() };
    let on_residual = residual.join(",");
    let others = [
        ("htp", Numerics::Htp, LoadOptions { precision: Some(Precision::W8A8), ..Default::default() }, "HTP numerics, shadow W8A8".to_string()),
        ("w8a16", Numerics::Exact, w8a16.clone(), "host executor, W8A16".to_string()),
        ("residual", Numerics::Exact, wide.clone(), format!("host executor, shadow W8A8, residual INT8 on {on_residual}")),
        ("htp-residual", Numerics::Htp, wide.clone(), format!("HTP numerics, shadow W8A8, residual INT8 on {on_residual}")),
        (
            "w8a16-shadow-residual",
            Numerics::Exact,
            LoadOptions { precision: Some(Precision::W8A16Shadow), ..wide.clone() },
            format!("host executor, shadow W8A16, residual INT8 on {on_residual}"),
        ),
        (
            "htp-w8a16-shadow-residual",
            Numerics::Htp,
            LoadOptions { precision: Some(Precision::W8A16Shadow), ..wide },
            format!("HTP numerics, shadow W8A16, residual INT8 on {on_residual}"),
        ),
        ("htp-w8a16", Numerics::Htp, w8a16, "HTP numerics, W8A16".to_string()),
        ("f32", Numerics::Exact, LoadOptions { precision: Some(Precision::F32), ..Default::default() }, "F32 prefill again (the measures' floor)".to_string()),
        ("w8a16-shadow", Numerics::Exact, w8a16_shadow.clone(), "host executor, shadow W8A16".to_string()),
        ("htp-w8a16-shadow", Numerics::Htp, w8a16_shadow.clone(), "HTP numerics, shadow W8A16".to_string()),
        (
            "layers-w8a16",
            Numerics::Exact,
            LoadOptions { precision: Some(Precision::W8A16), ..Default::default() },
            "host executor, W8A16, one graph per layer".to_string(),
        ),
        (
            "htp-layers-w8a16",
            Numerics::Htp,
            LoadOptions { precision: Some(Precision::W8A16), ..Default::default() },
            "HTP numerics, W8A16, one graph per layer".to_string(),
        ),
        (
            "layers-w8a16-shadow",
            Numerics::Exact,
            w8a16_shadow.clone(),
            "host executor, shadow W8A16, outliers through float weights, one graph per layer".to_string(),
        ),
        ("htp-layers-w8a16-shadow", Numerics::Htp, w8a16_shadow, "HTP numerics, shadow W8A16, outliers through float weights, one graph per layer".to_string()),
        (
            "layers-w8a16-shadow-residual",
            Numerics::Exact,
            LoadOptions { precision: Some(Precision::W8A16Shadow), residual: residual.to_vec(), ..Default::default() },
            format!("host executor, shadow W8A16, outliers through float weights, residual INT8 on {on_residual}, one graph per layer"),
        ),
    ];
    for (row, numerics, opts, label) in others.into_iter().filter(|row| on(row.0)) {
        let mut p = Pipeline::load(model, None, &NpuDevice::host_with(numerics), opts)?;
        p.model.set_profile(first.clone())?;
        let plan = if row.contains("layers") { PrefillPlan::Layers } else { PrefillPlan::Stages };
        let label = match numerics {
            Numerics::Htp => {
                p.model.set_sched(SchedOptions { tail: Tail::Pad, plan, ..Default::default() })?;
                format!("{label}, {name}, padded chunks of {}", p.model.chunk_len())
            }
            Numerics::Exact => {
                p.model.set_sched(SchedOptions { plan, ..p.model.sched().clone() })?;
                format!("{label}, {name}")
            }
        };
        run(&label, &mut p)?;
    }
    Ok(out)
}

/// `profile` with every clip range shrunk to about ±1e-3 and every channel hot: each activation
/// value goes down the shadow path, in float, against the same INT8 weights (the u8 grid over
/// ±1e-3 only carries the values too small to matter).
pub fn float_activations(profile: &QuantProfile) -> QuantProfile {
    let mut p = profile.clone();
    for pt in p.points.values_mut() {
        (pt.lo, pt.hi) = ((-1e-3f32).max(pt.min.min(0.0)), 1e-3f32.min(pt.max.max(0.0)));
        pt.hot = (0..pt.channels as u32).collect();
    }
    p
}

/// The profile of the default calibration for `model` with `chats` windows of conversations.
pub fn profile(model: &Path, chats: usize) -> Result<QuantProfile> {
    let mut q = Pipeline::load(model, None, &NpuDevice::host(), LoadOptions { precision: Some(Precision::W8A8), ..Default::default() })?;
    Ok(q.calibrate(CalibrationSet { chats, ..CalibrationSet::default() }, |_, _| {})?)
}

/// The F32 references of every conversation.
pub fn references(f32p: &mut Pipeline, convs: &[Conversation], bar: &ProgressBar) -> Result<Vec<Reference>> {
    bar.reset();
    bar.set_length(convs.len() as u64);
    bar.set_message("chat: F32 references");
    Ok(convs
        .iter()
        .map(|c| {
            bar.inc(1);
            chat_eval::reference(f32p, c)
        })
        .collect::<candle_npu::Result<Vec<_>>>()?)
}

/// The prompts and F32 answers as JSON, for `scripts/chat_anchor.py`, with the model re-encoded
/// in F16 and Q8_0 (every matrix; `requantize.rs`) for llama.cpp to run on.
pub fn dump(model: &Path, p: &Pipeline, convs: &[Conversation], refs: &[Reference]) -> Result<serde_json::Value> {
    let name = model.file_stem().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let f16 = super::requantize::requantized(model, &name, candle_core::quantized::GgmlDType::F16)?;
    let q8 = super::requantize::requantized(model, &name, candle_core::quantized::GgmlDType::Q8_0)?;
    Ok(json!({
        "f16": f16, "q8_0": q8, "stop_tokens": p.stop_tokens,
        "answer_tokens": ANSWER_TOKENS,
        "conversations": convs.iter().zip(refs).map(|(c, r)| json!({ "id": c.id, "tags": c.tags, "prompt": r.prompt, "f32_answer": r.answer })).collect::<Vec<_>>(),
    }))
}

/// The section's table.
pub fn print(model: &Path, rows: &[serde_json::Value]) {
    println!(
        "\n{}: chat eval, {} conversations in the model's template; first-token KL from the F32 prefill's, first {ANSWER_TOKENS} greedy tokens against F32's:\n",
        model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        rows.first().and_then(|r| r["conversations"].as_u64()).unwrap_or(0)
    );
    println!("| prefill | KL mean | KL median | KL p95 | KL max | first token same | {ANSWER_TOKENS} tokens same | derailed |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in rows {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        let derailed: Vec<String> = r["derailed"].as_array().into_iter().flatten().map(|d| d["id"].as_str().unwrap_or("?").to_string()).collect();
        println!(
            "| {} | {:.4} | {:.4} | {:.4} | {:.3} | {:.1}% | {:.1}% | {} {} |",
            r["name"].as_str().unwrap_or(""),
            f("kl_mean"),
            f("kl_median"),
            f("kl_p95"),
            f("kl_max"),
            100.0 * f("first_token_same"),
            100.0 * f("same_answer"),
            derailed.len(),
            if derailed.is_empty() { String::new() } else { format!("({})", derailed.join(", ")) }
        );
    }
}
