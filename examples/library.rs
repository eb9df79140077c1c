//! The README's "Use from Rust" program, compiled with the examples: load, calibrate (or load the
//! saved profile), generate with streaming, a two-turn session, its KV saved and restored.
//!
//! ```text
//! cargo run --release --example library [-- path/to/model.gguf]
//! ```
use std::io::Write;

use candle_npu::NpuDevice;
use candle_npu_models::{CalibrationSet, GenerateOptions, LoadOptions, Pipeline};

fn main() -> anyhow::Result<()> {
    let path = std::env::args().nth(1).map_or_else(candle_npu_models::assets::smollm2, Into::into);
    // README: start
    let device = NpuDevice::host(); // or NpuDevice::hexagon(HtpConfig::default())?
    let mut p = Pipeline::load(&path, None, &device, LoadOptions::default())?;
    // The first run calibrates (a minute or so), saves the profile next to the model, and reuses it.
    p.ensure_profile(None, CalibrationSet::default(), |done, total| eprint!("\rcalibrating {done}/{total}"))?;

    let opts = GenerateOptions { sample_len: 64, ..Default::default() }; // greedy; temperature, top_p, top_k, seed
    let print = |text: &str| {
        print!("{text}");
        let _ = std::io::stdout().flush();
    };
    let (_answer, stats) = p.generate("What is the capital of France?", &opts, print)?;
    println!("\nTTFT {:.0} ms, decode {:.1} tok/s", 1e3 * stats.ttft.as_secs_f64(), stats.decode_tokens_per_sec());

    // A conversation: turn 2 prefills only its own tokens; the KV can be saved and restored.
    let mut chat = p.session();
    chat.send(&p, "What is the capital of France?", &opts, print)?;
    chat.save(&p, std::path::Path::new("turn1.kv"))?;
    let (_, stats) = chat.send(&p, "And of Germany?", &opts, print)?;
    println!("\nturn 2: {} new tokens after {} kept", stats.prompt_tokens, stats.cached_tokens);
    let mut again = p.restore_session(std::path::Path::new("turn1.kv"))?; // same KV, no prefill
    again.send(&p, "And of Spain?", &opts, print)?;
    // README: end
    std::fs::remove_file("turn1.kv")?;
    Ok(())
}
