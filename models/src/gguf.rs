//! Reading GGUF files with clear errors: a malformed or truncated file, or a missing tensor, is an
//! `Err` naming the path and what is wrong, never a panic.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::{Device, Tensor};
use candle_npu::{Error, Result};

pub struct Gguf {
    pub path: PathBuf,
    pub content: gguf_file::Content,
    reader: BufReader<File>,
}

impl Gguf {
    pub fn open(path: &Path) -> Result<Self> {
        let bad = |reason: String| Error::Model { path: path.to_path_buf(), reason };
        let file = File::open(path).map_err(|e| bad(format!("cannot open: {e}")))?;
        let file_len = file.metadata().map_err(|e| bad(e.to_string()))?.len();
        let mut reader = BufReader::new(file);
        let content = gguf_file::Content::read(&mut reader).map_err(|e| bad(format!("not a valid GGUF file: {e}")))?;
        // Check every tensor's bytes lie inside the file now, so a truncated download is reported
        // here and not as a read error deep inside model loading.
        for (name, info) in &content.tensor_infos {
            let elems = info.shape.elem_count();
            let bytes = elems / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
            let end = content.tensor_data_offset + info.offset + bytes as u64;
            if end > file_len {
                return Err(bad(format!(
                    "truncated: tensor '{name}' ends at byte {end} but the file has {file_len} bytes (re-run scripts/setup.sh)"
                )));
            }
        }
        Ok(Gguf { path: path.to_path_buf(), content, reader })
    }

    fn md(&self, key: &str) -> Result<&gguf_file::Value> {
        self.content.metadata.get(key).ok_or_else(|| Error::Model {
            path: self.path.clone(),
            reason: format!("missing metadata key '{key}'"),
        })
    }

    fn md_err(&self, key: &str, e: candle_core::Error) -> Error {
        Error::Model { path: self.path.clone(), reason: format!("metadata '{key}': {e}") }
    }

    pub fn u32(&self, key: &str) -> Result<u32> {
        self.md(key)?.to_u32().map_err(|e| self.md_err(key, e))
    }

    pub fn f32(&self, key: &str) -> Result<f32> {
        self.md(key)?.to_f32().map_err(|e| self.md_err(key, e))
    }

    pub fn string(&self, key: &str) -> Result<String> {
        self.md(key)?.to_string().cloned().map_err(|e| self.md_err(key, e))
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    pub fn qtensor(&mut self, name: &str) -> Result<QTensor> {
        if !self.has_tensor(name) {
            return Err(Error::MissingTensor { path: self.path.clone(), name: name.to_string() });
        }
        self.content.tensor(&mut self.reader, name, &Device::Cpu).map_err(|e| Error::Model {
            path: self.path.clone(),
            reason: format!("reading tensor '{name}': {e}"),
        })
    }

    /// A tensor dequantized to F32 (weights as `[out, in]`).
    pub fn f32_tensor(&mut self, name: &str) -> Result<Tensor> {
        Ok(self.qtensor(name)?.dequantize(&Device::Cpu)?)
    }

    pub fn metadata(&self) -> &std::collections::HashMap<String, gguf_file::Value> {
        &self.content.metadata
    }
}
