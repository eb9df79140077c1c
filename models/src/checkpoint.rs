//! Where a model's tensors come from: a GGUF file or an HF safetensors folder, behind one
//! [`Checkpoint`] trait. The engine asks for tensors by their GGUF names (`blk.3.attn_q.weight`);
//! a family's [`NameMap`] says where each lives in its checkpoint (another name, or a row range
//! of a fused tensor). Matrices come back as [`WeightSource`]s that read the file when asked,
//! so loading never holds more than one float matrix at a time.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_npu::kernels::gemv::{BlockFormat, BlockMatrix};
use candle_npu::linear::DecodeMatrix;
use candle_npu::{DecodeWeights, Error, Result, WeightSource};

use crate::gguf::Gguf;

/// Where one engine tensor lives in a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapped {
    /// The tensor's name in the checkpoint (`model.layers.3.self_attn.q_proj.weight`).
    pub name: String,
    /// Rows `start..start + len` of a fused matrix of `total` rows (Phi-3's `qkv_proj`,
    /// `gate_up_proj`): `(start, len, total)`.
    pub rows: Option<(usize, usize, usize)>,
}

impl Mapped {
    /// All of tensor `name`: a rename, the common case.
    pub fn whole(name: impl Into<String>) -> Self {
        Mapped { name: name.into(), rows: None }
    }
}

/// Engine name (GGUF convention) -> checkpoint location.
pub type NameMap = dyn Fn(&str) -> Mapped;

/// A model's tensors by their checkpoint names, whatever the format: what
/// [`Model::load`](crate::Model::load) reads the weights through, each failure an error naming
/// the file and the tensor.
pub trait Checkpoint {
    /// The file or folder, for error messages.
    fn path(&self) -> &Path;
    /// Whether the tensor exists (how an optional one, e.g. an untied `output.weight`, is found).
    fn contains(&self, name: &str) -> bool;
    /// A vector (norm weight, bias) as F32.
    fn vector(&self, name: &str) -> Result<Tensor>;
    /// A matrix `[N, K]`, read on demand.
    fn matrix(&self, name: &str) -> Result<Arc<dyn WeightSource>>;
    /// The embedding table `[vocab, hidden]` (also the tied output matrix) in its decode form:
    /// the checkpoint's own blocks (mapped) where it has them.
    fn table(&self, name: &str, decode: DecodeWeights) -> Result<DecodeMatrix>;

    /// The matrix at `m`, cut to its rows if it is part of a fused tensor.
    fn mapped_matrix(&self, m: &Mapped) -> Result<Arc<dyn WeightSource>> {
        let w = self.matrix(&m.name)?;
        match m.rows {
            None => Ok(w),
            Some((start, len, total)) => {
                // Exactly the fused total: a config with fewer KV heads than the weights would
                // otherwise take V from K's rows, with every shape check passing.
                let (n, _) = w.dims();
                if start + len > n || n != total {
                    return Err(Error::Model {
                        path: self.path().to_path_buf(),
                        reason: format!(
                            "tensor '{}' has {n} rows, the config implies {total} (rows {start}..{} of them): a config that does not match the weights?",
                            m.name,
                            start + len
                        ),
                    });
                }
                Ok(Arc::new(Rows { inner: w, start, len }))
            }
        }
    }
}

/// Rows of a fused matrix.
struct Rows {
    inner: Arc<dyn WeightSource>,
    start: usize,
    len: usize,
}

impl WeightSource for Rows {
    fn dims(&self) -> (usize, usize) {
        (self.len, self.inner.dims().1)
    }
    fn matrix(&self) -> Result<Vec<f32>> {
        let k = self.inner.dims().1;
        let mut all = self.inner.matrix()?;
        all.truncate((self.start + self.len) * k);
        Ok(all.split_off(self.start * k))
    }
    fn describe(&self) -> String {
        format!("rows {}..{} of {}", self.start, self.start + self.len, self.inner.describe())
    }
}

/// An error naming tensor `name` of `path` when one of `t`'s values is NaN or infinite: a norm
/// weight, bias or embedding row that is not a number turns every logit after it into NaN (a
/// model that loads and generates garbage), so it is refused at load like a linear weight.
fn check_finite(t: &Tensor, name: &str, path: &Path) -> Result<()> {
    let values = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    match values.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(Error::Model { path: path.to_path_buf(), reason: format!("tensor '{name}': value {i} is {}", values[i]) }),
        None => Ok(()),
    }
}

/// The first value (float types) or block (quantized types) of `q` that is not finite, if any.
/// A quantized block's values are integers times its scale (and minus its min): finite exactly
/// when those are, so only they are read (a dequantized copy of Gemma 3's embedding would be
/// 670 MB of f32).
pub fn first_non_finite(q: &QTensor) -> Result<Option<usize>> {
    Ok(first_non_finite_in(q.dtype(), &q.data()?))
}

/// [`first_non_finite`] of `data`, whole blocks (or elements) of `dtype`.
pub fn first_non_finite_in(dtype: GgmlDType, data: &[u8]) -> Option<usize> {
    #[derive(Clone, Copy)]
    enum Float {
        F16,
        Bf16,
        F32,
    }
    use Float::{Bf16, F16, F32};
    // The float fields of one block (or element): (byte offset, type). Layouts: ggml's
    // `block_q*` structs (candle's `k_quants.rs`).
    let fields: &[(usize, Float)] = match dtype {
        GgmlDType::F32 => &[(0, F32)],
        GgmlDType::F16 => &[(0, F16)],
        GgmlDType::BF16 => &[(0, Bf16)],
        GgmlDType::Q4_0 | GgmlDType::Q5_0 | GgmlDType::Q8_0 => &[(0, F16)],
        GgmlDType::Q4_1 | GgmlDType::Q5_1 | GgmlDType::Q8_1 | GgmlDType::Q4K | GgmlDType::Q5K => &[(0, F16), (2, F16)],
        GgmlDType::Q2K => &[(80, F16), (82, F16)],
        GgmlDType::Q3K => &[(108, F16)],
        GgmlDType::Q6K => &[(208, F16)],
        GgmlDType::Q8K => &[(0, F32)],
    };
    let finite = |b: &[u8], (at, ty): (usize, Float)| match ty {
        // An f16 or bf16 is NaN or infinite exactly when its exponent bits are all set.
        F16 => u16::from_le_bytes([b[at], b[at + 1]]) & 0x7c00 != 0x7c00,
        Bf16 => u16::from_le_bytes([b[at], b[at + 1]]) & 0x7f80 != 0x7f80,
        F32 => f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]).is_finite(),
    };
    data.chunks_exact(dtype.type_size()).position(|block| !fields.iter().all(|&f| finite(block, f)))
}

// --- GGUF ---

/// A GGUF file: tensors keep their quantized form until a float is asked for.
pub struct GgufCheckpoint {
    g: Arc<Gguf>,
    file: Arc<std::fs::File>,
    /// The whole file, mapped: decode reads the weights' blocks here, as they are. Pages count
    /// in this process's resident set once read (file-backed: the kernel can drop them).
    map: Arc<memmap2::Mmap>,
}

impl GgufCheckpoint {
    /// The checkpoint of an opened GGUF, with a handle on its file of its own that the matrices
    /// are read through (positioned reads: no cursor shared with `g`'s reader).
    pub fn new(g: Arc<Gguf>) -> Result<Self> {
        let (f, _) = candle_npu::fs::open_regular(&g.path, "GGUF model")?;
        // SAFETY: the file is opened read-only and must not be modified while the model is
        // loaded (candle's condition for mapped checkpoints too); `Gguf::open` checked every
        // tensor against the file's length.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::Model { path: g.path.clone(), reason: format!("cannot map: {e}") })?;
        Ok(GgufCheckpoint { g, file: Arc::new(f), map: Arc::new(map) })
    }
    /// The parsed file: metadata and tensor directory.
    pub fn gguf(&self) -> &Gguf {
        &self.g
    }
}

impl Checkpoint for GgufCheckpoint {
    fn path(&self) -> &Path {
        &self.g.path
    }
    fn contains(&self, name: &str) -> bool {
        self.g.has_tensor(name)
    }
    fn vector(&self, name: &str) -> Result<Tensor> {
        let t = self.g.f32_tensor(name)?;
        check_finite(&t, name, self.path())?;
        Ok(t)
    }
    fn matrix(&self, name: &str) -> Result<Arc<dyn WeightSource>> {
        Ok(Arc::new(GgufWeight::new(&self.g, self.file.clone(), self.map.clone(), name)?))
    }
    fn table(&self, name: &str, decode: DecodeWeights) -> Result<DecodeMatrix> {
        let w = GgufWeight::new(&self.g, self.file.clone(), self.map.clone(), name)?;
        // Checked through positioned reads a block-aligned piece at a time: through the map,
        // the whole table would stay resident (262k rows of Gemma's, where a prompt reads a few
        // hundred), and read at once it would be a second copy at the peak.
        w.check_finite()?;
        if decode != DecodeWeights::F32 {
            if let Some(b) = w.blocks()? {
                return Ok(DecodeMatrix::Blocks(b));
            }
        }
        let t = w.read()?.dequantize(&Device::Cpu)?;
        Ok(match decode {
            DecodeWeights::F32 => DecodeMatrix::F32(t),
            _ if w.k % 32 == 0 => {
                tracing::info!(tensor = name, dtype = ?w.dtype, "no decode kernel reads this format: the table is requantized to Q8_0");
                DecodeMatrix::Blocks(BlockMatrix::from_qtensor(&QTensor::quantize(&t, GgmlDType::Q8_0)?)?.expect("Q8_0 of a matrix"))
            }
            _ => {
                tracing::warn!(tensor = name, dtype = ?w.dtype, "no decode kernel reads this format and rows are not whole blocks of 32: kept in F32");
                DecodeMatrix::F32(t)
            }
        })
    }
}

/// A GGUF weight `[N, K]`, read from the model file and dequantized with candle's own routines
/// when asked for. Read, not mapped: a matrix read through a map would leave its pages in this
/// process's resident set (file-backed, but counted) for every weight of the model.
pub struct GgufWeight {
    file: Arc<std::fs::File>,
    map: Arc<memmap2::Mmap>,
    path: PathBuf,
    name: String,
    /// Byte offset of the tensor's data in the file.
    offset: usize,
    dtype: GgmlDType,
    n: usize,
    k: usize,
}

impl GgufWeight {
    /// Tensor `tensor` of `g`, to be read through `file` (a handle on `g`'s file): checked to be
    /// a matrix of whole quantization blocks per row; nothing is read yet.
    pub fn new(g: &Gguf, file: Arc<std::fs::File>, map: Arc<memmap2::Mmap>, tensor: &str) -> Result<Self> {
        let info = g.content.tensor_infos.get(tensor).ok_or_else(|| Error::MissingTensor { path: g.path.clone(), name: tensor.to_string() })?;
        let dims = info.shape.dims();
        let bad = |reason: String| Error::Model { path: g.path.clone(), reason: format!("tensor '{tensor}': {reason}") };
        let &[n, k] = dims else {
            return Err(bad(format!("expected a matrix, shape {dims:?}")));
        };
        let dtype = info.ggml_dtype;
        if k % dtype.block_size() != 0 {
            return Err(bad(format!("rows of {k} are not whole blocks of {dtype:?}")));
        }
        // In bounds: Gguf::open checked every tensor against the file's length.
        let offset = (g.content.tensor_data_offset + info.offset) as usize;
        Ok(GgufWeight { file, map, path: g.path.clone(), name: tensor.to_string(), offset, dtype, n, k })
    }

    /// An error naming the first block whose scale (or value) is NaN or infinite, read a few
    /// MB at a time.
    fn check_finite(&self) -> Result<()> {
        let block = self.dtype.type_size();
        let piece = (4 << 20) / block * block;
        let total = self.n * self.row_bytes();
        let mut buf = vec![0u8; piece.min(total)];
        for start in (0..total).step_by(piece.max(1)) {
            let part = &mut buf[..piece.min(total - start)];
            std::os::unix::fs::FileExt::read_exact_at(&*self.file, part, (self.offset + start) as u64)
                .map_err(|e| Error::Model { path: self.path.clone(), reason: format!("reading tensor '{}': {e}", self.name) })?;
            if let Some(i) = first_non_finite_in(self.dtype, part) {
                let unit = if self.dtype.block_size() == 1 { "value" } else { "block" };
                let reason = format!("tensor '{}': {unit} {} is NaN or infinite ({:?})", self.name, start / block + i, self.dtype);
                return Err(Error::Model { path: self.path.clone(), reason });
            }
        }
        Ok(())
    }

    fn row_bytes(&self) -> usize {
        self.k / self.dtype.block_size() * self.dtype.type_size()
    }

    /// The tensor as stored, read from the file.
    fn read(&self) -> Result<QTensor> {
        let mut bytes = vec![0u8; self.n * self.row_bytes()];
        std::os::unix::fs::FileExt::read_exact_at(&*self.file, &mut bytes, self.offset as u64)
            .map_err(|e| Error::Model { path: self.path.clone(), reason: format!("reading tensor '{}': {e}", self.name) })?;
        Ok(candle_core::quantized::ggml_file::qtensor_from_ggml(self.dtype, &bytes, vec![self.n, self.k], &Device::Cpu)?)
    }
}

impl WeightSource for GgufWeight {
    fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    fn matrix(&self) -> Result<Vec<f32>> {
        Ok(self.read()?.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?)
    }

    fn blocks(&self) -> Result<Option<BlockMatrix>> {
        let Some(format) = BlockFormat::of(self.dtype) else {
            return Ok(None);
        };
        let map: Arc<dyn AsRef<[u8]> + Send + Sync> = self.map.clone();
        BlockMatrix::new(format, self.n, self.k, map, self.offset).map(Some)
    }

    fn describe(&self) -> String {
        format!("{} in {}", self.name, self.path.display())
    }
}

// --- HF safetensors folder ---

/// An HF-layout folder's `*.safetensors`, memory-mapped through candle-nn's `VarBuilder`.
pub struct SafetensorsCheckpoint {
    dir: PathBuf,
    vb: VarBuilder<'static>,
}

impl SafetensorsCheckpoint {
    /// Map every `*.safetensors` file in `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let bad = |reason: String| Error::Model { path: dir.to_path_buf(), reason };
        let entries = std::fs::read_dir(dir).map_err(|e| bad(format!("cannot read the folder: {e}")))?;
        let mut files: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "safetensors")).collect();
        files.sort();
        if files.is_empty() {
            return Err(bad("no *.safetensors file in the folder".into()));
        }
        // What candle's loader would merge or convert silently: a tensor named in two files (it
        // keeps one) and integer tensors (it converts them to F32).
        let mut seen = std::collections::HashMap::new();
        for file in &files {
            // candle's reader opens it blindly: a FIFO would block it forever.
            candle_npu::fs::open_regular(file, "safetensors checkpoint")?;
            // SAFETY: as below: read-only, not modified while mapped.
            let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(file) }
                .map_err(|e| bad(format!("{}: {}", file.display(), inconsistent_tensor(file).unwrap_or_else(|| e.to_string()))))?;
            for (name, view) in st.tensors() {
                if let Some(first) = seen.insert(name.clone(), file.clone()) {
                    return Err(bad(format!("tensor '{name}' is in both {} and {}", first.display(), file.display())));
                }
                if !DType::try_from(view.dtype()).is_ok_and(|d| d.is_float()) {
                    return Err(bad(format!("tensor '{name}' in {} is {:?}: a model's tensors are floats", file.display(), view.dtype())));
                }
            }
        }
        // SAFETY: the checkpoint files are opened read-only and must not be modified while the
        // model is loaded (candle's documented condition for mmaped safetensors).
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu) }.map_err(|e| bad(format!("safetensors: {e}")))?;
        Ok(SafetensorsCheckpoint { dir: dir.to_path_buf(), vb })
    }

    fn get(&self, name: &str) -> Result<Tensor> {
        if !self.vb.contains_tensor(name) {
            return Err(Error::MissingTensor { path: self.dir.clone(), name: name.to_string() });
        }
        self.vb.get_unchecked_dtype(name, DType::F32).map_err(|e| Error::Model { path: self.dir.clone(), reason: format!("tensor '{name}': {e}") })
    }
}

impl Checkpoint for SafetensorsCheckpoint {
    fn path(&self) -> &Path {
        &self.dir
    }
    fn contains(&self, name: &str) -> bool {
        self.vb.contains_tensor(name)
    }
    fn vector(&self, name: &str) -> Result<Tensor> {
        let t = self.get(name)?;
        if t.rank() != 1 {
            return Err(Error::Model { path: self.dir.clone(), reason: format!("tensor '{name}': expected a vector, shape {:?}", t.dims()) });
        }
        check_finite(&t, name, &self.dir)?;
        Ok(t)
    }
    fn matrix(&self, name: &str) -> Result<Arc<dyn WeightSource>> {
        let t = self.get(name)?;
        let (n, k) =
            t.dims2().map_err(|_| Error::Model { path: self.dir.clone(), reason: format!("tensor '{name}': expected a matrix, shape {:?}", t.dims()) })?;
        Ok(Arc::new(SafetensorsWeight { vb: self.vb.clone(), dir: self.dir.clone(), name: name.to_string(), n, k }))
    }
    fn table(&self, name: &str, decode: DecodeWeights) -> Result<DecodeMatrix> {
        let t = self.get(name)?;
        check_finite(&t, name, &self.dir)?;
        Ok(match decode {
            DecodeWeights::F32 => DecodeMatrix::F32(t),
            // A float checkpoint has no blocks of its own: Q8_0 as for the linears.
            DecodeWeights::Q8_0 | DecodeWeights::Checkpoint if t.dim(1)? % 32 == 0 => {
                DecodeMatrix::Blocks(BlockMatrix::from_qtensor(&QTensor::quantize(&t, GgmlDType::Q8_0)?)?.expect("Q8_0 of a matrix"))
            }
            DecodeWeights::Q8_0 | DecodeWeights::Checkpoint => {
                tracing::warn!(tensor = name, "embedding width is not whole Q8_0 blocks: kept in F32");
                DecodeMatrix::F32(t)
            }
        })
    }
}

/// A safetensors matrix, read from the mapped file when asked (converted to F32 then).
struct SafetensorsWeight {
    vb: VarBuilder<'static>,
    dir: PathBuf,
    name: String,
    n: usize,
    k: usize,
}

impl WeightSource for SafetensorsWeight {
    fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }
    fn matrix(&self) -> Result<Vec<f32>> {
        Ok(self.vb.get_unchecked_dtype(&self.name, DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    }
    fn describe(&self) -> String {
        format!("{} in {}", self.name, self.dir.display())
    }
}

/// Which tensor of the safetensors file `path` its header gets wrong, when the `safetensors`
/// crate refused the file without naming one: bytes that are not its dtype times its shape, or
/// that lie beyond the data. `None` when the header cannot be read or names no such tensor.
fn inconsistent_tensor(path: &Path) -> Option<String> {
    use std::io::Read;
    let (mut f, meta) = candle_npu::fs::open_regular(path, "safetensors checkpoint").ok()?;
    let mut n = [0u8; 8];
    f.read_exact(&mut n).ok()?;
    let n = u64::from_le_bytes(n);
    // The format's own limit on the header (100 MB), and the file's size.
    if n > 100_000_000 || 8 + n > meta.len() {
        return None;
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).ok()?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header).ok()?;
    let data = meta.len() - 8 - n;
    header.iter().filter(|(name, _)| *name != "__metadata__").find_map(|(name, t)| {
        let dtype = t.get("dtype")?.as_str()?;
        let shape: Option<Vec<u64>> = t.get("shape")?.as_array()?.iter().map(|d| d.as_u64()).collect();
        let offsets: Option<Vec<u64>> = t.get("data_offsets")?.as_array()?.iter().map(|d| d.as_u64()).collect();
        let (shape, offsets) = (shape?, offsets?);
        let [begin, end] = offsets[..] else { return Some(format!("tensor '{name}': data_offsets {offsets:?} are not two numbers")) };
        let bits: u64 = match dtype {
            "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 8,
            "F16" | "BF16" | "I16" | "U16" => 16,
            "F32" | "I32" | "U32" => 32,
            "F64" | "I64" | "U64" => 64,
            _ => return Some(format!("tensor '{name}': dtype {dtype} is not one safetensors knows")),
        };
        let want = shape.iter().try_fold(bits / 8, |a, &d| a.checked_mul(d));
        if end < begin || end > data {
            return Some(format!("tensor '{name}': bytes {begin}..{end} are not within the file's {data} bytes of data"));
        }
        (want != Some(end - begin)).then(|| {
            format!("tensor '{name}': {dtype} {shape:?} is {} bytes, its data_offsets give {}", want.map_or("too many".into(), |w| w.to_string()), end - begin)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::ggml_file::qtensor_from_ggml;

    /// `t` quantized to `dtype` with the 2-byte field at `at` of block `block` set to `bits`.
    fn damaged(dtype: GgmlDType, block: usize, at: usize, bits: u16) -> QTensor {
        let t = Tensor::arange(0f32, 4.0 * 256.0, &Device::Cpu).unwrap().affine(1e-3, -0.5).unwrap().reshape((4, 256)).unwrap();
        let q = QTensor::quantize(&t, dtype).unwrap();
        let mut bytes = q.data().unwrap().to_vec();
        let off = block * dtype.type_size() + at;
        bytes[off..off + 2].copy_from_slice(&bits.to_le_bytes());
        qtensor_from_ggml(dtype, &bytes, vec![4, 256], &Device::Cpu).unwrap()
    }

    #[test]
    fn a_non_finite_block_scale_is_found_where_each_format_keeps_it() {
        const F16_NAN: u16 = 0x7e00;
        const F16_INF: u16 = 0x7c00;
        // (format, byte offset of a scale or min within its block)
        for (dtype, at) in [(GgmlDType::Q8_0, 0), (GgmlDType::Q4_1, 2), (GgmlDType::Q4K, 2), (GgmlDType::Q6K, 208), (GgmlDType::Q3K, 108), (GgmlDType::Q2K, 82)]
        {
            assert_eq!(first_non_finite(&damaged(dtype, 0, 0, 0x3c00)).unwrap(), None, "{dtype:?} with a finite scale");
            for bits in [F16_NAN, F16_INF] {
                let blocks = 4 * 256 / dtype.block_size();
                let block = blocks - 1;
                assert_eq!(first_non_finite(&damaged(dtype, block, at, bits)).unwrap(), Some(block), "{dtype:?} {bits:#x}");
            }
        }
        // Half floats, element by element.
        let t = Tensor::new(&[1f32, 2.0, f32::NAN, 4.0], &Device::Cpu).unwrap();
        for dtype in [GgmlDType::F16, GgmlDType::BF16, GgmlDType::F32] {
            assert_eq!(first_non_finite(&QTensor::quantize(&t, dtype).unwrap()).unwrap(), Some(2), "{dtype:?}");
        }
    }
}
