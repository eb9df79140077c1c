//! Mistral: Llama's layer with sliding-window attention on every layer (when the config sets
//! `sliding_window`). No reachable checkpoint: tested with seeded random weights against
//! candle-transformers' `mistral`.

use candle_npu::Result;

use crate::hf::HfConfig;
use crate::spec::{Config, FamilySpec, LayerSpec, RopeLayout};

/// An HF Mistral folder: NeoX RoPE at `rope_theta` (10,000 when absent), every layer within
/// `sliding_window` when the config sets it; SiLU only, no RoPE scaling or projection biases.
pub fn hf_spec(hf: &HfConfig, cfg: &Config) -> Result<FamilySpec> {
    hf.check_silu()?;
    hf.check_no_rope_scaling()?;
    hf.check_no_biases()?;
    let base = hf.opt_f64("rope_theta")?.unwrap_or(10_000.0) as f32;
    let window = hf.opt_usize("sliding_window")?;
    Ok(FamilySpec { layers: vec![LayerSpec { rope_base: base, window }; cfg.n_layer], ..FamilySpec::plain("mistral", cfg, RopeLayout::Neox, base) })
}
