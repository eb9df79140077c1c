//! Llama (SmolLM2-135M by default): prefill on the NPU (or its host INT8 executor), decode on candle's CPU path.
//!
//! ```text
//! cargo run --release --example llama -- --prompt "What is the capital of France?"
//! ```
#[path = "common/cli.rs"]
mod cli;

fn main() -> anyhow::Result<()> {
    cli::run("llama", Some(cli::Which::Smollm2_135m))
}
