//! Gemma 3 (Gemma 3 270M by default): prefill on the NPU (or its host INT8 executor), decode on candle's CPU path.
//!
//! ```text
//! cargo run --release --example gemma3 -- --prompt "The capital of France is" --no-chat-template
//! ```
#[path = "common/cli.rs"]
mod cli;

fn main() -> anyhow::Result<()> {
    cli::run("gemma3", Some(cli::Which::Gemma3_270m))
}
