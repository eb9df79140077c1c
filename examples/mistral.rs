//! Mistral (an HF folder: --model or --model-id; no weights are fetched by set-up): prefill on the NPU (or its host INT8 executor), decode on candle's CPU path.
//!
//! ```text
//! cargo run --release --example mistral -- --model-id mistralai/Mistral-7B-Instruct-v0.3 --prompt "Hello"
//! ```
#[path = "common/cli.rs"]
mod cli;

fn main() -> anyhow::Result<()> {
    cli::run("mistral", None)
}
