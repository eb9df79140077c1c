//! Gemma 3: GELU (tanh), embeddings scaled by `sqrt(hidden)`, RMSNorm on each head's Q and K,
//! sandwich norms around attention and FFN, and sliding-window attention on five layers of
//! every six, with their own RoPE base. llama.cpp's conversion already adds Gemma's `+1` to the
//! norm weights, so a GGUF's norms are plain RMSNorm weights.

use candle_npu::Result;

use crate::gguf::Gguf;
use crate::spec::{Activation, Config, FamilySpec, LayerSpec, RopeLayout};

/// Defaults for metadata a Gemma 3 GGUF may omit (candle-transformers' `quantized_gemma3` uses
/// the same): every sixth layer is global, with RoPE base 1e6; the others slide with base 1e4.
const SLIDING_PATTERN: usize = 6;
const GLOBAL_BASE: f32 = 1_000_000.0;
const LOCAL_BASE: f32 = 10_000.0;

/// A `gemma3` GGUF: the window `gemma3.attention.sliding_window` (required); the layer pattern
/// and both RoPE bases from the metadata, else candle-transformers' defaults (every sixth layer
/// global at base 1e6, the others sliding at 1e4).
pub fn gguf_spec(g: &Gguf, cfg: &Config) -> Result<FamilySpec> {
    let window = g.u32("gemma3.attention.sliding_window")? as usize;
    let pattern = g.opt_u32("gemma3.attention.sliding_window_type")?.map_or(SLIDING_PATTERN, |v| v as usize).max(1);
    let global = g.opt_f32("gemma3.rope.freq_base")?.unwrap_or(GLOBAL_BASE);
    let local = g.opt_f32("gemma3.rope.local_freq_base")?.unwrap_or(LOCAL_BASE);
    let layers = (0..cfg.n_layer)
        .map(|l| match (l + 1) % pattern > 0 {
            true => LayerSpec { rope_base: local, window: Some(window) },
            false => LayerSpec { rope_base: global, window: None },
        })
        .collect();
    Ok(FamilySpec {
        activation: Activation::GeluTanh,
        layers,
        qk_norm: true,
        post_norms: true,
        embed_scale: Some((cfg.hidden as f64).sqrt()),
        ..FamilySpec::plain("gemma3", cfg, RopeLayout::Neox, global)
    })
}
