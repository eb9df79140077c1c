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
    /// One open file serves tensor loading and the shadow path's cold-column reads.
    reader: std::sync::Mutex<BufReader<File>>,
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
        Ok(Gguf { path: path.to_path_buf(), content, reader: std::sync::Mutex::new(reader) })
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

    pub fn qtensor(&self, name: &str) -> Result<QTensor> {
        if !self.has_tensor(name) {
            return Err(Error::MissingTensor { path: self.path.clone(), name: name.to_string() });
        }
        let mut reader = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        self.content.tensor(&mut *reader, name, &Device::Cpu).map_err(|e| Error::Model {
            path: self.path.clone(),
            reason: format!("reading tensor '{name}': {e}"),
        })
    }

    /// A tensor dequantized to F32 (weights as `[out, in]`).
    pub fn f32_tensor(&self, name: &str) -> Result<Tensor> {
        Ok(self.qtensor(name)?.dequantize(&Device::Cpu)?)
    }

    pub fn metadata(&self) -> &std::collections::HashMap<String, gguf_file::Value> {
        &self.content.metadata
    }
}

/// Reads single input-channel columns of a GGUF weight `[N, K]` from the model file: for every
/// output row, the one quantized block holding column `c`, dequantized with candle's own routines
/// (so a column read here is bit-identical to the same column of the dequantized tensor). This is
/// the shadow path's source for cold channels. The file is memory-mapped, so a read touches `N`
/// blocks through the page cache (from flash on first use) and no float copy stays resident.
pub struct GgufColumns {
    map: std::sync::Arc<memmap2::Mmap>,
    path: PathBuf,
    name: String,
    /// Byte offset of the tensor's data in the file.
    offset: usize,
    dtype: candle_core::quantized::GgmlDType,
    n: usize,
    k: usize,
}

impl GgufColumns {
    /// Map `g`'s file once; [`GgufColumns::new`] shares the map between tensors.
    pub fn map(g: &Gguf) -> Result<std::sync::Arc<memmap2::Mmap>> {
        let f = File::open(&g.path).map_err(|e| Error::Model { path: g.path.clone(), reason: format!("cannot open: {e}") })?;
        // SAFETY: the model file is opened read-only and not modified while the model is loaded
        // (as for candle's own mmaped safetensors); a truncated file was rejected by Gguf::open.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::Model { path: g.path.clone(), reason: format!("cannot map: {e}") })?;
        Ok(std::sync::Arc::new(map))
    }

    pub fn new(g: &Gguf, map: std::sync::Arc<memmap2::Mmap>, tensor: &str) -> Result<Self> {
        let info = g.content.tensor_infos.get(tensor).ok_or_else(|| Error::MissingTensor { path: g.path.clone(), name: tensor.to_string() })?;
        let dims = info.shape.dims();
        let bad = |reason: String| Error::Model { path: g.path.clone(), reason: format!("tensor '{tensor}': {reason}") };
        let &[n, k] = dims else { return Err(bad(format!("expected a matrix, shape {dims:?}"))) };
        let dtype = info.ggml_dtype;
        if k % dtype.block_size() != 0 {
            return Err(bad(format!("rows of {k} are not whole blocks of {dtype:?}")));
        }
        let offset = (g.content.tensor_data_offset + info.offset) as usize;
        if offset + n * (k / dtype.block_size()) * dtype.type_size() > map.len() {
            return Err(bad(format!("data beyond the end of the file ({} bytes)", map.len())));
        }
        Ok(GgufColumns { map, path: g.path.clone(), name: tensor.to_string(), offset, dtype, n, k })
    }
}

impl candle_npu::ColumnSource for GgufColumns {
    fn column(&self, c: usize) -> Result<Vec<f32>> {
        let (bs, ts) = (self.dtype.block_size(), self.dtype.type_size());
        if c >= self.k {
            return Err(Error::Model { path: self.path.clone(), reason: format!("tensor '{}': column {c} of {}", self.name, self.k) });
        }
        let row_bytes = self.k / bs * ts;
        let mut blocks = Vec::with_capacity(self.n * ts);
        for r in 0..self.n {
            let at = self.offset + r * row_bytes + c / bs * ts;
            blocks.extend_from_slice(&self.map[at..at + ts]); // in bounds: checked in `new`
        }
        let t = candle_core::quantized::ggml_file::qtensor_from_ggml(self.dtype, &blocks, vec![self.n, bs], &Device::Cpu)?;
        let t = t.dequantize(&Device::Cpu)?.narrow(1, c % bs, 1)?.flatten_all()?;
        Ok(t.to_vec1::<f32>()?)
    }

    fn describe(&self) -> String {
        format!("{} in {}", self.name, self.path.display())
    }
}
