//! Qwen2 (Qwen2.5-Coder-0.5B-Instruct by default): prefill on the NPU (or its host INT8 executor), decode on candle's CPU path.
//!
//! ```text
//! cargo run --release --example qwen2 -- --prompt "Write a Rust function that reverses a string."
//! ```
#[path = "common/cli.rs"]
mod cli;

fn main() -> anyhow::Result<()> {
    cli::run("qwen2", Some(cli::Which::Qwen25Coder05b))
}
