//! Llama (SmolLM2, Llama 2/3 and any GGUF `llama`): the plain spec. Only the RoPE layout is
//! particular: llama.cpp permutes the Q/K rows of HF's checkpoint so that RoPE rotates
//! interleaved pairs, so a Llama GGUF uses [`RopeLayout::Interleaved`] where the HF folder of
//! the same model uses NeoX.

use candle_npu::Result;

use crate::gguf::Gguf;
use crate::spec::{Config, FamilySpec, RopeLayout};

pub fn gguf_spec(g: &Gguf, cfg: &Config) -> Result<FamilySpec> {
    let base = g.opt_f32("llama.rope.freq_base")?.unwrap_or(10_000.0);
    Ok(FamilySpec::plain("llama", cfg, RopeLayout::Interleaved, base))
}
