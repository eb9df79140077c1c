//! Qwen2 / Qwen2.5: Llama's layer with biases on Q, K and V, NeoX RoPE (llama.cpp converts it
//! without the permutation), and an output matrix that may or may not be tied.

use candle_npu::Result;

use crate::gguf::Gguf;
use crate::spec::{Config, FamilySpec, RopeLayout};

pub fn gguf_spec(g: &Gguf, cfg: &Config) -> Result<FamilySpec> {
    let base = g.opt_f32("qwen2.rope.freq_base")?.unwrap_or(10_000.0);
    Ok(FamilySpec { qkv_bias: true, ..FamilySpec::plain("qwen2", cfg, RopeLayout::Neox, base) })
}
