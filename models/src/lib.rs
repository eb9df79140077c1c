//! LLM families on candle-npu: prefill on an [`candle_npu::NpuDevice`], decode on candle's CPU path.
//!
//! - [`transformer`]: the engine every family shares (stages, attention, KV cache, decode).
//! - [`llama`]: Llama / SmolLM2 from GGUF.
//! - [`gguf`], [`tokenizer`]: checkpoint and tokenizer loading with clear errors.
//! - [`chat`]: chat templates and stop tokens.

pub mod assets;
pub mod chat;
pub mod gguf;
pub mod llama;
pub mod pipeline;
pub mod tokenizer;
pub mod transformer;

pub use pipeline::{CalibrationSet, Pipeline};
pub use candle_npu::{DecodeWeights, WeightQuant};
pub use transformer::{Config, LoadOptions, Model, Precision};
