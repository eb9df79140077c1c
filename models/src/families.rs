//! The supported families and how a checkpoint finds its family: a GGUF by its
//! `general.architecture`, an HF folder by `config.json`'s `model_type`.

use std::sync::Arc;

use candle_npu::{Error, NpuDevice, Result};

use crate::checkpoint::{GgufCheckpoint, Mapped};
use crate::gguf::Gguf;
use crate::spec::FamilySpec;
use crate::transformer::{LoadOptions, Model};

/// GGUF architectures this crate loads.
pub const GGUF_ARCHS: &[&str] = &["llama", "qwen2", "gemma3"];

/// The family file of a GGUF's architecture, or an error naming the supported ones.
fn spec_of(g: &Gguf) -> Result<(String, fn(&Gguf, &crate::spec::Config) -> Result<FamilySpec>)> {
    let arch = g.string("general.architecture")?;
    let f: fn(&Gguf, &crate::spec::Config) -> Result<FamilySpec> = match arch.as_str() {
        "llama" => crate::llama::gguf_spec,
        "qwen2" => crate::qwen2::gguf_spec,
        "gemma3" => crate::gemma3::gguf_spec,
        other => {
            return Err(Error::Model { path: g.path.clone(), reason: format!("architecture '{other}' is not supported (GGUF: {})", GGUF_ARCHS.join(", ")) })
        }
    };
    Ok((arch, f))
}

/// Check that a GGUF is of a supported family (before anything else is read from it).
pub fn check_gguf(g: &Gguf) -> Result<()> {
    spec_of(g).map(|_| ())
}

/// Load a GGUF model of a supported family: NPU prefill on `device`, CPU decode.
pub fn load_gguf(g: Arc<Gguf>, device: &NpuDevice, opts: LoadOptions) -> Result<Model> {
    let (arch, spec_of) = spec_of(&g)?;
    let cfg = g.config(&arch)?;
    check_rope(&g, &arch, &cfg)?;
    let spec = spec_of(&g, &cfg)?;
    let id = candle_npu::quant::model_id(&g.path)?;
    let ckpt = GgufCheckpoint::new(g)?;
    // GGUF names are the engine's names.
    Model::load(cfg, spec, &ckpt, &|n: &str| Mapped::whole(n), id, device.clone(), opts)
}

/// RoPE variants the engine does not compute (scaled frequencies, per-dimension factors, a
/// rotation over part of a head): refused, since they would run with wrong positions and no error.
fn check_rope(g: &Gguf, arch: &str, cfg: &crate::spec::Config) -> Result<()> {
    let bad = |reason: String| Err(Error::Model { path: g.path.clone(), reason });
    let key = format!("{arch}.rope.scaling.type");
    if let Some(v) = g.metadata().get(&key) {
        let factor = g.opt_f32(&format!("{arch}.rope.scaling.factor"))?.unwrap_or(1.0);
        if v.to_string().map_or(true, |t| t != "none") && factor != 1.0 {
            return bad(format!("{key} {v:?} (factor {factor}): scaled RoPE is not supported"));
        }
    }
    if g.has_tensor("rope_freqs.weight") {
        return bad("rope_freqs.weight (per-dimension RoPE frequency factors, Llama 3.1 style) is not supported".into());
    }
    if let Some(d) = g.opt_u32(&format!("{arch}.rope.dimension_count"))? {
        if d as usize != cfg.head_dim {
            return bad(format!("{arch}.rope.dimension_count {d}: RoPE over part of a head of {} is not supported", cfg.head_dim));
        }
    }
    Ok(())
}
