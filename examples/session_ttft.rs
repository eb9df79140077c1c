//! Time to first token of a conversation's second turn: with a session (the first turn's KV
//! kept: only the new turn is prefilled), restored from a saved state, and re-prefilling the whole
//! conversation. The first turn is a long document (held-out Wikipedia text, like an email
//! thread) and a question; the second a short follow-up question.
//!
//! ```text
//! cargo run --release --example session_ttft                       # SmolLM2, host executor
//! cargo run --release --example session_ttft -- --lens 300,1500 --rounds 5
//! ```
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use candle_npu::NpuDevice;
use candle_npu_models::PrefillOptions;
use candle_npu_models::{assets, CalibrationSet, GenerateOptions, LoadOptions, Pipeline};
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Tokens of document in the first turn.
    #[arg(long, value_delimiter = ',', default_value = "300,700,1500")]
    lens: Vec<usize>,
    /// Rounds per length (the median is printed).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[arg(long, default_value_t = 256)]
    chunk_len: usize,
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e3
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.rounds == 0 || args.lens.is_empty() {
        bail!("--rounds and --lens need at least one value");
    }
    let device = NpuDevice::host();
    let mut p = Pipeline::load(&assets::smollm2(), None, &device, LoadOptions { chunk_len: Some(args.chunk_len), ..Default::default() })?;
    p.ensure_profile(None, CalibrationSet::default(), |_, _| {})?;
    let text = assets::wiki_heldout(400)?.join("\n\n");
    let opts = GenerateOptions { sample_len: 1, ..Default::default() };
    let state = std::env::temp_dir().join(format!("candle-npu-session-ttft-{}.kv", std::process::id()));
    println!("SmolLM2-135M, host executor W8A8, chunk {}: turn 2's time to first token, ms (median of {} rounds)\n", args.chunk_len, args.rounds);
    println!("| document tokens | turn 2 tokens | session | restored from file (incl. reading it) | re-prefilled conversation | re-prefill / session |");
    println!("|---|---|---|---|---|---|");
    for &n in &args.lens {
        let ids = p.encode_piece(&text)?;
        if ids.len() < n {
            bail!("the held-out text has {} tokens, fewer than {n}", ids.len());
        }
        let doc = p.decode_text(&ids[..n])?;
        let turn1 = format!("{doc}\n\nSummarize the text above in one sentence.");
        let (mut kept, mut restored, mut again) = (vec![], vec![], vec![]);
        let mut new_tokens = 0;
        for _ in 0..args.rounds {
            let conversation = {
                let mut s = p.session();
                s.send(&p, &turn1, &opts, |_| {})?;
                s.save(&p, &state)?;
                let (_, st) = s.send(&p, "Who is it about?", &opts, |_| {})?;
                kept.push(st.ttft);
                new_tokens = st.prompt_tokens;
                s.tokens().to_vec()
            };
            let t = Instant::now();
            let mut s = p.restore_session(&state)?;
            s.send(&p, "Who is it about?", &opts, |_| {})?;
            restored.push(t.elapsed());
            // The whole conversation (both turns' tokens) prefilled from an empty cache.
            let t = Instant::now();
            p.model.prefill(&conversation, &PrefillOptions::default())?;
            again.push(t.elapsed());
        }
        let (k, r, a) = (median(kept), median(restored), median(again));
        println!("| {n} | {new_tokens} | {k:.0} | {r:.0} | {a:.0} | {:.1}x |", a / k);
    }
    let _ = std::fs::remove_file(&state);
    Ok(())
}
