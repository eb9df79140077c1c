//! Phi-3 (an HF folder: --model or --model-id; no weights are fetched by set-up): prefill on the NPU (or its host INT8 executor), decode on candle's CPU path.
//!
//! ```text
//! cargo run --release --example phi3 -- --model-id microsoft/Phi-3-mini-4k-instruct --prompt "Hello"
//! ```
#[path = "common/cli.rs"]
mod cli;

fn main() -> anyhow::Result<()> {
    cli::run("phi3", None)
}
