//! Reading GGUF files with clear errors: a malformed or truncated file, or a missing tensor, is an
//! `Err` naming the path and what is wrong, never a panic.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::{Device, Tensor};
use candle_npu::{Error, Result};

use crate::spec::Config;

/// A parsed GGUF file whose every tensor lies within the file ([`Gguf::open`] checks), with typed
/// metadata reads that name the key in their errors.
pub struct Gguf {
    /// The file: errors name it, and [`crate::checkpoint::GgufCheckpoint`] reopens it for matrices.
    pub path: PathBuf,
    /// candle's parse of the header: metadata, tensor directory, data offset.
    pub content: gguf_file::Content,
    /// One open file serves `qtensor` and `f32_tensor` (matrices are read through the
    /// checkpoint's own handle).
    reader: std::sync::Mutex<BufReader<File>>,
}

impl Gguf {
    /// Parses `path`'s header and checks every tensor's shape and byte range against the file's
    /// length, so a truncated or damaged file fails here, naming its path, and not inside model
    /// loading; a panic of candle's reader on a bad header is reported as this file's error.
    pub fn open(path: &Path) -> Result<Self> {
        let bad = |reason: String| Error::Model { path: path.to_path_buf(), reason };
        let (file, meta) = candle_npu::fs::open_regular(path, "GGUF model")?;
        let file_len = meta.len();
        let mut reader = BufReader::new(file);
        // What candle's reader trusts or merges, read first: an alignment of 0 would divide by
        // zero inside it, and it keeps one of two tensors (or metadata keys) of the same name.
        let header = Header::read(&mut reader, file_len).map_err(|e| bad(format!("not a valid GGUF file: {e}")))?;
        if header.alignment == Some(0) {
            return Err(bad("not a valid GGUF file: general.alignment is 0".into()));
        }
        reader.seek(SeekFrom::Start(0)).map_err(|e| bad(e.to_string()))?;
        // Still guarded: a panic in candle's reader is this file's fault, reported as such.
        let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| gguf_file::Content::read(&mut reader)));
        let content = match read {
            Ok(r) => r.map_err(|e| bad(format!("not a valid GGUF file: {e}")))?,
            Err(_) => return Err(bad("not a valid GGUF file: its header made the GGUF reader fail (e.g. an alignment of 0)".into())),
        };
        if content.tensor_infos.len() as u64 != header.tensors {
            return Err(bad(format!("{} tensors in the header, {} distinct names: two tensors share a name", header.tensors, content.tensor_infos.len())));
        }
        if content.metadata.len() as u64 != header.keys {
            return Err(bad(format!("{} metadata entries, {} distinct keys: a key is given twice", header.keys, content.metadata.len())));
        }
        // Every tensor's shape and bytes checked now, with checked arithmetic (header values are
        // the file's word, and a product that wraps would pass the bounds check), so a truncated
        // or damaged file is reported here and not deep inside model loading.
        let mut ranges = Vec::with_capacity(content.tensor_infos.len());
        for (name, info) in &content.tensor_infos {
            let dims = info.shape.dims();
            if dims.is_empty() || dims.contains(&0) {
                return Err(bad(format!("tensor '{name}' has shape {dims:?}: every tensor needs 1 to 4 dimensions, none of them 0")));
            }
            let (block, size) = (info.ggml_dtype.block_size(), info.ggml_dtype.type_size());
            let elems = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64));
            let bytes = elems.filter(|e| e % block as u64 == 0).and_then(|e| (e / block as u64).checked_mul(size as u64));
            let end = bytes.and_then(|b| content.tensor_data_offset.checked_add(info.offset)?.checked_add(b));
            match end {
                None => return Err(bad(format!("tensor '{name}': shape {dims:?} of {:?} at offset {} is not a valid size", info.ggml_dtype, info.offset))),
                Some(end) if end > file_len => {
                    return Err(bad(format!("truncated: tensor '{name}' ends at byte {end} but the file has {file_len} bytes (re-run scripts/setup.sh)")))
                }
                Some(end) => ranges.push((end - bytes.unwrap_or(0), end, name)),
            }
        }
        // Disjoint bytes: two tensors over the same bytes are a damaged (or forged) directory.
        ranges.sort();
        if let Some(w) = ranges.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(bad(format!("tensors '{}' and '{}' overlap (bytes {}..{} and {}..{})", w[0].2, w[1].2, w[0].0, w[0].1, w[1].0, w[1].1)));
        }
        Ok(Gguf { path: path.to_path_buf(), content, reader: std::sync::Mutex::new(reader) })
    }

    fn md(&self, key: &str) -> Result<&gguf_file::Value> {
        self.content.metadata.get(key).ok_or_else(|| Error::Model { path: self.path.clone(), reason: format!("missing metadata key '{key}'") })
    }

    fn md_err(&self, key: &str, e: candle_core::Error) -> Error {
        Error::Model { path: self.path.clone(), reason: format!("metadata '{key}': {e}") }
    }

    /// Metadata `key` as a u32: an error naming the key when it is absent or of another type.
    pub fn u32(&self, key: &str) -> Result<u32> {
        self.md(key)?.to_u32().map_err(|e| self.md_err(key, e))
    }

    /// Metadata `key` as an f32, as [`Gguf::u32`].
    pub fn f32(&self, key: &str) -> Result<f32> {
        self.md(key)?.to_f32().map_err(|e| self.md_err(key, e))
    }

    /// Metadata `key` as a string, as [`Gguf::u32`].
    pub fn string(&self, key: &str) -> Result<String> {
        self.md(key)?.to_string().cloned().map_err(|e| self.md_err(key, e))
    }

    /// Whether the file has a tensor `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Tensor `name` as stored (the file's quantization), read now through the shared reader.
    pub fn qtensor(&self, name: &str) -> Result<QTensor> {
        if !self.has_tensor(name) {
            return Err(Error::MissingTensor { path: self.path.clone(), name: name.to_string() });
        }
        let mut reader = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        self.content
            .tensor(&mut *reader, name, &Device::Cpu)
            .map_err(|e| Error::Model { path: self.path.clone(), reason: format!("reading tensor '{name}': {e}") })
    }

    /// A tensor dequantized to F32 (weights as `[out, in]`).
    pub fn f32_tensor(&self, name: &str) -> Result<Tensor> {
        Ok(self.qtensor(name)?.dequantize(&Device::Cpu)?)
    }

    /// Every metadata key with its value.
    pub fn metadata(&self) -> &std::collections::HashMap<String, gguf_file::Value> {
        &self.content.metadata
    }

    /// Optional metadata: `None` when absent, an error when present with the wrong type.
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        self.metadata().get(key).map(|v| v.to_u32().map_err(|e| self.md_err(key, e))).transpose()
    }
    /// Optional f32 metadata, as [`Gguf::opt_u32`].
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.metadata().get(key).map(|v| v.to_f32().map_err(|e| self.md_err(key, e))).transpose()
    }

    /// The sizes every GGUF decoder states under `{arch}.`, read as candle-transformers' quantized
    /// models read them.
    pub fn config(&self, arch: &str) -> Result<Config> {
        let u = |k: &str| self.u32(&format!("{arch}.{k}")).map(|v| v as usize);
        let hidden = u("embedding_length")?;
        let n_head = u("attention.head_count")?;
        let vocab = match self.opt_u32(&format!("{arch}.vocab_size"))? {
            Some(v) => v as usize,
            None => match self.content.tensor_infos.get("token_embd.weight") {
                Some(t) => t.shape.dims().first().copied().unwrap_or(0),
                None => return Err(Error::MissingTensor { path: self.path.clone(), name: "token_embd.weight".into() }),
            },
        };
        let head_dim = match self.opt_u32(&format!("{arch}.attention.key_length"))? {
            Some(d) => d as usize,
            None if n_head > 0 => hidden / n_head,
            None => 0,
        };
        let cfg = Config {
            n_layer: u("block_count")?,
            hidden,
            n_head,
            n_kv_head: self.opt_u32(&format!("{arch}.attention.head_count_kv"))?.map_or(n_head, |v| v as usize),
            head_dim,
            ffn: u("feed_forward_length")?,
            vocab,
            rms_eps: self.f32(&format!("{arch}.attention.layer_norm_rms_epsilon"))? as f64,
            context_len: u("context_length")?,
        };
        cfg.validate().map_err(|why| Error::Model { path: self.path.clone(), reason: format!("metadata under '{arch}.': {why}") })?;
        // A block count below the file's layers would silently drop the rest.
        if self.has_tensor(&format!("blk.{}.attn_norm.weight", cfg.n_layer)) {
            return Err(Error::Model { path: self.path.clone(), reason: format!("{arch}.block_count is {} but the file has more layers", cfg.n_layer) });
        }
        Ok(cfg)
    }
}

/// The counts of a GGUF header and its `general.alignment`, read by walking the metadata (each
/// length bounded by the file's size) before candle's reader sees the file.
struct Header {
    tensors: u64,
    keys: u64,
    alignment: Option<u64>,
}

impl Header {
    fn read(r: &mut impl Read, file_len: u64) -> std::result::Result<Self, String> {
        let mut buf = [0u8; 8];
        let mut take = |r: &mut dyn Read, n: usize| -> std::result::Result<u64, String> {
            r.read_exact(&mut buf[..n]).map_err(|e| format!("header: {e}"))?;
            let mut b = [0u8; 8];
            b[..n].copy_from_slice(&buf[..n]);
            Ok(u64::from_le_bytes(b))
        };
        if take(r, 4)? != u64::from(u32::from_le_bytes(*b"GGUF")) {
            return Err("no GGUF magic".into());
        }
        let version = take(r, 4)?;
        // Version 1 counted with u32, later versions with u64.
        let count = if version == 1 { 4 } else { 8 };
        let (tensors, keys) = (take(r, count)?, take(r, count)?);
        let mut alignment = None;
        for _ in 0..keys {
            let len = take(r, count)?;
            if len > file_len {
                return Err(format!("a metadata key of {len} bytes in a file of {file_len}"));
            }
            let mut key = vec![0u8; len as usize];
            r.read_exact(&mut key).map_err(|e| format!("header: {e}"))?;
            let ty = take(r, 4)?;
            if key == b"general.alignment" {
                alignment = Some(match ty {
                    4 => take(r, 4)?,
                    10 => take(r, 8)?,
                    _ => return Err(format!("general.alignment has value type {ty}, expected an unsigned integer")),
                });
            } else {
                skip_value(r, ty, count, file_len, &mut take)?;
            }
        }
        Ok(Header { tensors, keys, alignment })
    }
}

/// Skips one metadata value of GGUF type `ty`.
fn skip_value(
    r: &mut impl Read,
    ty: u64,
    count: usize,
    file_len: u64,
    take: &mut impl FnMut(&mut dyn Read, usize) -> std::result::Result<u64, String>,
) -> std::result::Result<(), String> {
    let skip = |r: &mut dyn Read, n: u64| -> std::result::Result<(), String> {
        if n > file_len {
            return Err(format!("a metadata value of {n} bytes in a file of {file_len}"));
        }
        let got = std::io::copy(&mut r.take(n), &mut std::io::sink()).map_err(|e| format!("header: {e}"))?;
        if got != n {
            return Err("header: truncated metadata".into());
        }
        Ok(())
    };
    match ty {
        0 | 1 | 7 => skip(r, 1),
        2 | 3 => skip(r, 2),
        4..=6 => skip(r, 4),
        10..=12 => skip(r, 8),
        8 => {
            let len = take(r, count)?;
            skip(r, len)
        }
        9 => {
            let (elem, n) = (take(r, 4)?, take(r, count)?);
            if n > file_len {
                return Err(format!("an array of {n} values in a file of {file_len} bytes"));
            }
            (0..n).try_for_each(|_| skip_value(r, elem, count, file_len, take))
        }
        _ => Err(format!("metadata value type {ty} is not a GGUF type")),
    }
}
