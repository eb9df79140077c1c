//! Qwen2 / Qwen2.5: Llama's layer with biases on Q, K and V, NeoX RoPE (llama.cpp converts it
//! without the permutation), and an output matrix that may or may not be tied.

use candle_npu::Result;

use crate::gguf::Gguf;
use crate::hf::HfConfig;
use crate::spec::{Config, FamilySpec, RopeLayout};

/// A `qwen2` GGUF: biases on Q, K and V, NeoX RoPE at `qwen2.rope.freq_base` (10,000 when
/// absent).
pub fn gguf_spec(g: &Gguf, cfg: &Config) -> Result<FamilySpec> {
    let base = g.opt_f32("qwen2.rope.freq_base")?.unwrap_or(10_000.0);
    Ok(FamilySpec { qkv_bias: true, ..FamilySpec::plain("qwen2", cfg, RopeLayout::Neox, base) })
}

/// An HF Qwen2 folder (sliding-window variants are refused: none of the released checkpoints
/// enables it).
pub fn hf_spec(hf: &HfConfig, cfg: &Config) -> Result<FamilySpec> {
    hf.check_silu()?;
    hf.check_no_rope_scaling()?;
    if hf.bool_or("use_sliding_window", false)? {
        return Err(hf.bad("use_sliding_window is not supported for qwen2".into()));
    }
    let base = hf.opt_f64("rope_theta")?.unwrap_or(10_000.0) as f32;
    Ok(FamilySpec { qkv_bias: true, ..FamilySpec::plain("qwen2", cfg, RopeLayout::Neox, base) })
}
