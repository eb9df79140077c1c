//! LLM families on candle-npu: prefill on an [`candle_npu::NpuDevice`], decode on candle's CPU path.
//!
//! - [`spec`]: a family as data ([`spec::Config`] sizes, [`spec::FamilySpec`] layer structure).
//! - [`transformer`]: the engine every family shares (stages, prefill, decode, calibration);
//!   [`attention`]: RoPE, KV cache and attention on the CPU.
//! - Family files, each only its spec and checkpoint names: [`llama`], [`qwen2`], [`gemma3`],
//!   [`phi3`], [`mistral`]; [`families`] finds a GGUF's family, [`hf`] an HF folder's.
//! - [`checkpoint`] (GGUF and HF safetensors behind one trait), [`gguf`], [`hf`], [`tokenizer`]:
//!   loading with clear errors.
//! - [`chat`]: chat templates and stop tokens; [`generate`]: sampling, streaming and multi-turn
//!   [`session::Session`]s (KV kept between turns, saved and restored) on a [`Pipeline`].

#![warn(missing_docs)]

pub mod assets;
pub mod attention;
pub mod chat;
pub mod chat_eval;
pub mod checkpoint;
pub mod families;
pub mod gemma3;
pub mod generate;
pub mod gguf;
pub mod hf;
pub mod llama;
pub mod logits;
pub mod memory;
pub mod mistral;
pub mod phi3;
pub mod pipeline;
pub mod qwen2;
pub mod sandbox;
pub mod sequence;
pub mod serve;
pub mod session;
pub mod spec;
pub mod speculative;
pub mod tokenizer;
pub mod transformer;

pub use attention::KvType;
pub use candle_npu::{DecodeWeights, WeightQuant};
pub use chat::{JinjaTemplate, Message};
pub use generate::{GenerateOptions, GenerateStats, StopReason};
pub use pipeline::{CalibrationSet, CalibrationSource, Pipeline, TextStream};
pub use sequence::Sequence;
pub use session::Session;
pub use spec::{Config, FamilySpec};
pub use speculative::{SpeculationStats, Speculative, Verify};
pub use transformer::{prefill_dag, LoadOptions, Logits, Model, Precision, PrefillOptions, PrefillPlan, PrefillRows, SchedOptions};

/// The README's Rust examples, compiled as doctests (`no_run`: they need a model).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;

/// The guides' examples (`docs/guides/`), compiled as doctests too.
#[cfg(doctest)]
mod guides {
    #[doc = include_str!("../../docs/guides/chat-app.md")]
    struct ChatApp;
    #[doc = include_str!("../../docs/guides/own-model.md")]
    struct OwnModel;
    #[doc = include_str!("../../docs/guides/hexagon.md")]
    struct Hexagon;
}
