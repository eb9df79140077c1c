//! A model's GGUF with every matrix re-encoded in one quantization, cached under the assets, for
//! benchmarks that compare engines on the same weights (llama.cpp on Q8_0, candle on F32).
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::Device;
use candle_npu_models::assets;

/// `path`'s tensors dequantized and re-encoded as `dtype` (matrices of whole blocks; everything
/// else F32), written once to `assets/.bench/{name}-{dtype:?}.gguf` (atomically) and reused.
pub fn requantized(path: &Path, name: &str, dtype: GgmlDType) -> Result<PathBuf> {
    let out = assets::dir().join(format!(".bench/{name}-{dtype:?}.gguf"));
    if out.exists() {
        return Ok(out);
    }
    std::fs::create_dir_all(out.parent().context("assets folder")?)?;
    let mut f = std::fs::File::open(path)?;
    let ct = gguf_file::Content::read(&mut f)?;
    let mut tensors = vec![];
    for name in ct.tensor_infos.keys() {
        let t = ct.tensor(&mut f, name, &Device::Cpu)?.dequantize(&Device::Cpu)?;
        let dtype = if t.rank() == 2 && t.dim(1)? % dtype.block_size() == 0 { dtype } else { GgmlDType::F32 };
        tensors.push((name.clone(), QTensor::quantize(&t, dtype)?));
    }
    let md: Vec<(&str, &gguf_file::Value)> = ct.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tr: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tmp = out.with_extension(format!("tmp{}", std::process::id()));
    gguf_file::write(&mut std::fs::File::create(&tmp)?, &md, &tr)?;
    std::fs::rename(&tmp, &out)?;
    Ok(out)
}
