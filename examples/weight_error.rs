//! How far each NPU weight form is from the model file's own weights (issue 49's conversions,
//! issue 46's weight side): every linear of the file's blocks (`blk.*`), dequantized, then
//! converted; the relative RMS error over each source format's tensors, and the bytes per weight.
//!
//! ```text
//! cargo run --release --example weight_error [-- --model FILE.gguf ...]
//! ```
//!
//! The forms: INT8 per output channel (today's NPU weight), LPBQ 4-bit in blocks of 64, 32 and
//! 16 (the only blockwise form the HTP takes, `candle_npu::quant::Lpbq`), INT8 in blocks of 32
//! (Q8_0's grid, llama.cpp's anchor; not an HTP form), INT16 per tensor (runs on the HTP).
//! Figures: `docs/npu_weights.md`.
use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::Device;
use candle_npu::quant::{quantize_weight_i8_per_channel, quantize_weight_lpbq, relative_rms_error};
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// GGUF files (default: the three real models in the assets folder).
    #[arg(long)]
    model: Vec<PathBuf>,
}

/// Symmetric rounding of each run of `group` values to `levels` steps either side of zero.
fn grid(w: &[f32], group: usize, levels: f32) -> Vec<f32> {
    w.chunks(group)
        .flat_map(|g| {
            let step = g.iter().fold(0f32, |a, v| a.max(v.abs())) / levels;
            g.iter().map(move |&v| if step > 0.0 { (v / step).round() * step } else { 0.0 })
        })
        .collect()
}

const FORMS: [(&str, f64); 7] = [
    ("INT8 per channel", 8.0),
    ("LPBQ 4-bit, blocks of 64", 4.0 + 4.0 / 64.0),
    ("LPBQ 4-bit, blocks of 32", 4.0 + 4.0 / 32.0),
    ("LPBQ 4-bit, blocks of 16", 4.0 + 4.0 / 16.0),
    ("INT8, blocks of 32 (Q8_0's grid)", 8.0 + 16.0 / 32.0),
    ("INT16 per tensor", 16.0),
    ("the file's own blocks", 0.0),
];

fn main() -> Result<()> {
    let args = Args::parse();
    let models = match args.model.is_empty() {
        true => vec![candle_npu_models::assets::smollm2(), candle_npu_models::assets::gemma3_270m()?, candle_npu_models::assets::qwen25_coder_05b()?],
        false => args.model,
    };
    for path in models {
        let mut f = std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
        let content = gguf_file::Content::read(&mut f).with_context(|| format!("reading {}", path.display()))?;
        // Per source format: squared error of each form, squared weight, values, file bytes.
        let mut by_format: std::collections::BTreeMap<String, (Vec<f64>, f64, usize, usize)> = Default::default();
        // Per role (attn_q, ffn_down, ...): the same sums, to see which linears INT8 serves worst.
        let mut by_role: std::collections::BTreeMap<String, (Vec<f64>, f64, usize, usize)> = Default::default();
        for (name, info) in &content.tensor_infos {
            if !name.starts_with("blk.") || !name.ends_with(".weight") || info.shape.dims().len() != 2 {
                continue;
            }
            let q = content.tensor(&mut f, name, &Device::Cpu)?;
            let file_bytes = q.storage_size_in_bytes();
            let w = q.dequantize(&Device::Cpu)?;
            let (n, k) = w.dims2()?;
            let w = w.flatten_all()?.to_vec1::<f32>()?;
            let (q8, s8) = quantize_weight_i8_per_channel(&w, n, k);
            let forms: Vec<Vec<f32>> = vec![
                q8.iter().enumerate().map(|(i, &q)| q as f32 * s8[i / k]).collect(),
                quantize_weight_lpbq(&w, n, k, 64)?.dequantize(),
                quantize_weight_lpbq(&w, n, k, 32)?.dequantize(),
                quantize_weight_lpbq(&w, n, k, 16)?.dequantize(),
                grid(&w, 32, 127.0),
                grid(&w, w.len(), 32767.0),
            ];
            let norm: f64 = w.iter().map(|&v| (v as f64).powi(2)).sum();
            let errs: Vec<f64> = forms.iter().map(|form| relative_rms_error(&w, form).powi(2) * norm).collect();
            let role = name.split('.').nth(2).unwrap_or(name).to_string();
            for e in [
                by_format.entry(format!("{:?}", info.ggml_dtype)).or_insert((vec![0.0; forms.len()], 0.0, 0, 0)),
                by_role.entry(role).or_insert((vec![0.0; forms.len()], 0.0, 0, 0)),
            ] {
                e.0.iter_mut().zip(&errs).for_each(|(acc, x)| *acc += x);
                e.1 += norm;
                e.2 += w.len();
                e.3 += file_bytes;
            }
        }
        println!("\n{}: relative RMS error against the file's dequantized weights, per source format", path.display());
        print!("| form | bits per weight |");
        for (fmt, (_, _, values, _)) in &by_format {
            print!(" {fmt} ({:.1} M weights) |", *values as f64 / 1e6);
        }
        println!("\n|---|---|{}", "---|".repeat(by_format.len()));
        for (i, (form, bits)) in FORMS.iter().enumerate() {
            let last = i == FORMS.len() - 1;
            print!("| {form} | ");
            if last {
                print!("{} |", by_format.values().map(|e| format!("{:.2}", e.3 as f64 * 8.0 / e.2 as f64)).collect::<Vec<_>>().join(" / "));
            } else {
                print!("{bits:.2} |");
            }
            for (errs, norm, _, _) in by_format.values() {
                match last {
                    true => print!(" 0 |"),
                    false => print!(" {:.4} |", (errs[i] / norm).sqrt()),
                }
            }
            println!();
        }
        println!("\n{}: per linear role, INT8 per channel against Q8_0's grid", path.display());
        println!("| role | M weights | INT8 per channel | INT8, blocks of 32 | ratio | INT16 per tensor |\n|---|---|---|---|---|---|");
        for (role, (errs, norm, values, _)) in &by_role {
            let e = |i: usize| (errs[i] / norm).sqrt();
            println!("| {role} | {:.1} | {:.4} | {:.4} | {:.2} | {:.4} |", *values as f64 / 1e6, e(0), e(4), e(0) / e(4), e(5));
        }
    }
    Ok(())
}
