//! Llama (SmolLM2, Llama 2/3 and any GGUF `llama`): the plain spec. Only the RoPE layout is
//! particular: llama.cpp permutes the Q/K rows of HF's checkpoint so that RoPE rotates
//! interleaved pairs, so a Llama GGUF uses [`RopeLayout::Interleaved`] where the HF folder of
//! the same model uses NeoX.

use candle_npu::Result;

use crate::gguf::Gguf;
use crate::hf::HfConfig;
use crate::spec::{Config, FamilySpec, RopeLayout};

/// A `llama` GGUF: interleaved RoPE (llama.cpp's permuted Q/K rows) at `llama.rope.freq_base`
/// (10,000 when absent).
pub fn gguf_spec(g: &Gguf, cfg: &Config) -> Result<FamilySpec> {
    let base = g.opt_f32("llama.rope.freq_base")?.unwrap_or(10_000.0);
    Ok(FamilySpec::plain("llama", cfg, RopeLayout::Interleaved, base))
}

/// An HF Llama folder: NeoX RoPE (HF's own layout).
pub fn hf_spec(hf: &HfConfig, cfg: &Config) -> Result<FamilySpec> {
    hf.check_silu()?;
    hf.check_no_rope_scaling()?;
    hf.check_no_biases()?;
    let base = hf.opt_f64("rope_theta")?.unwrap_or(10_000.0) as f32;
    Ok(FamilySpec::plain("llama", cfg, RopeLayout::Neox, base))
}
