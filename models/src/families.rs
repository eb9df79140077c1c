//! The supported families and how a checkpoint finds its family: a GGUF by its
//! `general.architecture`, an HF folder by `config.json`'s `model_type`.

use std::path::Path;
use std::sync::Arc;

use candle_npu::{Error, NpuDevice, Result};

use crate::checkpoint::{GgufCheckpoint, Mapped};
use crate::gguf::Gguf;
use crate::spec::FamilySpec;
use crate::transformer::{LoadOptions, Model};

/// GGUF architectures this crate loads.
pub const GGUF_ARCHS: &[&str] = &["llama", "qwen2", "gemma3"];

/// Load a GGUF model of a supported family: NPU prefill on `device`, CPU decode.
pub fn load_gguf(path: &Path, device: &NpuDevice, opts: LoadOptions) -> Result<Model> {
    let g = Arc::new(Gguf::open(path)?);
    let arch = g.string("general.architecture")?;
    let spec_of: fn(&Gguf, &crate::spec::Config) -> Result<FamilySpec> = match arch.as_str() {
        "llama" => crate::llama::gguf_spec,
        "qwen2" => crate::qwen2::gguf_spec,
        "gemma3" => crate::gemma3::gguf_spec,
        other => {
            return Err(Error::Model { path: path.to_path_buf(), reason: format!("architecture '{other}' is not supported (GGUF: {})", GGUF_ARCHS.join(", ")) })
        }
    };
    let cfg = g.config(&arch)?;
    let spec = spec_of(&g, &cfg)?;
    let id = candle_npu::quant::model_id(path)?;
    let ckpt = GgufCheckpoint::new(g)?;
    // GGUF names are the engine's names.
    Model::load(cfg, spec, &ckpt, &|n: &str| Mapped::whole(n), id, device.clone(), opts)
}
