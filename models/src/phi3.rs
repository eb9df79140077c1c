//! Phi-3: Llama's layer with fused checkpoint tensors (`qkv_proj` = Q, K, V stacked by rows,
//! `gate_up_proj` = gate then up), which the name map cuts into the engine's separate linears,
//! and optionally partial RoPE. No reachable checkpoint: tested with seeded random weights
//! against candle-transformers' `phi3`.

use candle_npu::Result;

use crate::checkpoint::Mapped;
use crate::hf::{standard_name, HfConfig};
use crate::spec::{Config, FamilySpec, LayerSpec, RopeLayout};

/// An HF Phi-3 folder: NeoX RoPE at `rope_theta` (10,000 when absent) over the
/// `partial_rotary_factor` share of each head (all of it when absent), every layer within
/// `sliding_window` when set; SiLU only, no RoPE scaling. Its tensor names: [`names`].
pub fn hf_spec(hf: &HfConfig, cfg: &Config) -> Result<FamilySpec> {
    hf.check_silu()?;
    hf.check_no_rope_scaling()?;
    hf.check_no_biases()?;
    let base = hf.opt_f64("rope_theta")?.unwrap_or(10_000.0) as f32;
    let rope_dims = match hf.opt_f64("partial_rotary_factor")? {
        Some(f) if f > 0.0 && f <= 1.0 => (f * cfg.head_dim as f64) as usize,
        Some(f) => return Err(hf.bad(format!("partial_rotary_factor {f} is not within (0, 1]"))),
        None => cfg.head_dim,
    };
    // HF's Phi-3 attends within `sliding_window` when the config sets it.
    let window = hf.opt_usize("sliding_window")?;
    Ok(FamilySpec { rope_dims, layers: vec![LayerSpec { rope_base: base, window }; cfg.n_layer], ..FamilySpec::plain("phi3", cfg, RopeLayout::Neox, base) })
}

/// The engine's names in a Phi-3 checkpoint: Q, K, V and gate, up are row ranges of the fused
/// tensors; everything else has the common HF name.
pub fn names(cfg: &Config) -> impl Fn(&str) -> Mapped {
    let (q, kv, ffn) = (cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.ffn);
    move |canonical: &str| {
        let Some((l, t)) = canonical.strip_prefix("blk.").and_then(|r| r.split_once('.')) else { return standard_name(canonical) };
        let qkv = |start: usize, len: usize| Mapped { name: format!("model.layers.{l}.self_attn.qkv_proj.weight"), rows: Some((start, len, q + 2 * kv)) };
        let gate_up = |start: usize| Mapped { name: format!("model.layers.{l}.mlp.gate_up_proj.weight"), rows: Some((start, ffn, 2 * ffn)) };
        match t {
            "attn_q.weight" => qkv(0, q),
            "attn_k.weight" => qkv(q, kv),
            "attn_v.weight" => qkv(q + kv, kv),
            "ffn_gate.weight" => gate_up(0),
            "ffn_up.weight" => gate_up(ffn),
            _ => standard_name(canonical),
        }
    }
}
