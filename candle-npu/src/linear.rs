//! [`ShadowLinear`]: the one object per linear layer. It owns what the layer is on every path:
//! its NPU weight (INT8, per output channel) and the FullyConnected it adds to a stage graph, the
//! shadow path's weight columns (contiguous for the hot input channels), its bias, and its
//! decode matmul on candle CPU. The engine builds graphs, merges shadow outliers
//! and decodes only through it.
//!
//! Memory: the float weight is never resident. It is read from its [`WeightSource`] (the
//! checkpoint file) to quantize it and to build a float graph. The INT8 weight is held once: as
//! Q8_0 blocks whose values are the NPU's (`d` = the channel's scale), which the decode kernels
//! read and from which the NPU graph's INT8 weight is copied when a graph is built; or, with
//! [`DecodeWeights::Checkpoint`], decode reads the checkpoint's own blocks (mapped) and the INT8
//! values are held as they are.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use crate::device::PreparedGraph;
use crate::error::{Error, Result};
use crate::graph::{BlockScales, DType, Graph, Op, Quant, StaticData, TensorId};
use crate::kernels::gemv::{BlockFormat, BlockMatrix};
use crate::kernels::int8::{nibble, put_nibble};
use crate::kernels::rows::{quantize_i8, rows_per_task, shadow_row};
use crate::kernels::{prefetch, PackedI8};
use crate::outlier::{Outliers, WeightSource};
use crate::quant::{lpbq_value, quantize_weight_i8, quantize_weight_i8_per_channel, quantize_weight_lpbq};

/// How the NPU weight is quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WeightQuant {
    /// One scale per output channel (QNN AXIS_SCALE_OFFSET): the default.
    #[default]
    PerChannel,
    /// One scale per tensor: the naive baseline, kept for comparison.
    PerTensor,
    /// LPBQ: 4-bit values times 4-bit scales per `block` inputs, under a scale per channel
    /// ([`crate::quant::Lpbq`]). The HTP expands it into INT8 per channel, so every executor
    /// runs it as that INT8 weight; it measures the accuracy of 4-bit NPU weights
    /// (`docs/npu_weights.md`). The INT8 values are held (they cannot be requantized from the
    /// checkpoint's blocks row by row); decode still reads the checkpoint's blocks.
    Lpbq {
        /// Inputs per block scale (a divisor of every linear's input width).
        block: usize,
    },
    /// INT8 per channel plus its rounding error as a second INT8 per-channel weight: two W8A8
    /// FullyConnected ops summed (in graphs and in the shadow path). The HTP has no blockwise
    /// INT8 (`docs/npu_weights.md`); this is about 127 times finer than INT8 per channel (the
    /// error of INT16) at twice the bytes and MACs, on ops it runs at its INT8 rate and that
    /// every executor already runs. For the linears where INT8 loses most (issue 46).
    PerChannelResidual,
}

/// The second weight of [`WeightQuant::PerChannelResidual`]: the float weight less its INT8
/// per-channel values, computed from the source when read (nothing held).
struct ResidualSource(Arc<dyn WeightSource>);

impl WeightSource for ResidualSource {
    fn dims(&self) -> (usize, usize) {
        self.0.dims()
    }
    fn matrix(&self) -> Result<Vec<f32>> {
        let (n, k) = self.0.dims();
        let w = self.0.matrix()?;
        let (q, s) = quantize_weight_i8_per_channel(&w, n, k);
        Ok(rounding_error(&w, &q, &s, k))
    }
    fn describe(&self) -> String {
        format!("the INT8 rounding error of {}", self.0.describe())
    }
}

/// `w` less its INT8 values `q` under the row scales `scales` (`[N, K]`, rows of `k`).
fn rounding_error(w: &[f32], q: &[i8], scales: &[f32], k: usize) -> Vec<f32> {
    w.iter().zip(q).enumerate().map(|(i, (&v, &q))| v - q as f32 * scales[i / k]).collect()
}

/// Weight format of the CPU decode path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeWeights {
    /// The float weights, resident: a full F32 copy, for bit-for-bit comparison with a float
    /// reference only.
    F32,
    /// The NPU's INT8 weights as Q8_0 blocks, decoded by this crate's kernels: prefill and
    /// decode use the same weight values, and the INT8 weights are held once for both (a float
    /// checkpoint's default). Needs `K` to be whole blocks of 32; otherwise the INT8 values are
    /// kept as they are and decode runs them dequantized (logged).
    Q8_0,
    /// The checkpoint's own blocks (a GGUF's Q4_1, Q5_0, Q4_K, Q6_K, ...: every
    /// [`crate::kernels::gemv::BlockFormat`]), read where they are in the mapped file through
    /// this crate's decode kernels, and the INT8 weights not held at all: they are requantized
    /// from those blocks when a graph is built or a shadow column needed (the host executor's
    /// packed copy is then the only INT8 one). The default: decode reads what the user's file
    /// has (0.56-0.82 bytes per weight for 4-6-bit files, against Q8_0's 1.06), and the process
    /// holds one copy of each weight per processor. Decode and prefill then use different
    /// weight values (the file's and their INT8 requantization), as llm.npu's CPU and NPU do.
    /// Where the source has no such blocks (HF folders, another format), Q8_0 as above.
    /// `docs/memory.md` and `docs/decode.md` measure both forms.
    #[default]
    Checkpoint,
}

/// The NPU form of a weight `[N, K]`: INT8 values and their scales.
struct NpuWeight {
    int8: Int8,
    scales: Scales,
    /// `WeightQuant::Lpbq`'s graph form: the INT8 values are 4-bit values times its block scales.
    lpbq: Option<LpbqLayout>,
}

/// An LPBQ weight in graphs: its block scales, and the output rows of each FullyConnected it is
/// cut into ([`lpbq_parts`]) with that part's data identity ([`Graph::set_data_id`]).
struct LpbqLayout {
    blocks: Arc<BlockScales>,
    parts: Vec<(std::ops::Range<usize>, u64)>,
}

/// The output rows of the FullyConnected ops an LPBQ weight `[n, k]` is cut into: 256 each, the
/// last the rest. Measured on the library (QNN 2.40's x86 HTP, SoC 57, u16 into u16,
/// 2026-11-29; `htp_conformance`'s random weights): wider 4-bit FullyConnected ops are refused on
/// some shapes (QNN 1002 at finalize, "could not create op": [576 -> 776], [640 -> 864], [896 ->
/// 1152], [1536 -> 2048]) and run with wrong values on others, up to the whole output range off,
/// with no pattern of size found ([896 -> 384], [896 -> 448], [1024 -> 448], [1152 -> 288],
/// [1536 -> 288 .. 512], [2048 -> 640] wrong; [896 -> 512], [896 -> 896], [768 -> 448], [1120
/// -> 1024] right). 256 outputs ran right for every input width tried (576 to 4864), and every
/// real model's parts are proven on the library (`htp_conformance::lpbq_weights_on_the_library`).
/// Measured again once the encoding's arrays were padded (the library's read past them,
/// `executor::htp::build`): the same shapes refused and wrong (2026-12-04, `docs/npu_weights.md`).
const LPBQ_PART_ROWS: usize = 256;

fn lpbq_parts(n: usize) -> Vec<std::ops::Range<usize>> {
    (0..n).step_by(LPBQ_PART_ROWS).map(|r| r..(r + LPBQ_PART_ROWS).min(n)).collect()
}

/// Where the INT8 values are held.
enum Int8 {
    /// In the decode matmul's Q8_0 blocks (see [`DecodeWeights::Q8_0`]).
    Q8_0(BlockMatrix),
    /// As they are (decode has its own weight).
    Raw(Arc<Vec<i8>>),
    /// An LPBQ weight's 4-bit values, row-major, two a byte (the even one low): the INT8 values
    /// are each times its block's scale ([`NpuWeight::lpbq`]), as the HTP expands them. Half
    /// the bytes of [`Int8::Raw`]. With the weight's `K`.
    Nibbles(Arc<Vec<u8>>, usize),
    /// Not held: requantized when needed from the decode weight's blocks, which are the
    /// checkpoint's own (mapped) and dequantize to exactly the float weight they were quantized
    /// from (checked at load). A graph build takes them all (`values`); the shadow path's cold
    /// columns come from the host executor's packed copy while one lives, else one value at a
    /// time from the blocks.
    Blocks(BlockMatrix),
}

/// The INT8 value of `v`, the float weight at `[r, c]` of a `[N, k]` weight whose row `r` has
/// scale `row_scale`: per channel, or with `blocks` LPBQ's 4-bit value times its block scale.
/// How the INT8 weight is taken back from the file's blocks, and how load checks it.
fn requantize(v: f32, r: usize, c: usize, k: usize, row_scale: f32, blocks: Option<&BlockScales>) -> i8 {
    match blocks {
        Some(b) => lpbq_value(v, b.of(r * k + c, k), row_scale),
        None => quantize_i8(v, row_scale),
    }
}

impl Int8 {
    /// An LPBQ weight's raw INT8 values (`blocks` given) held as their 4-bit values, half the
    /// bytes; any other as it is. The values are LPBQ's by construction (`quantize_weight_lpbq`).
    fn lpbq(self, blocks: Option<&BlockScales>, k: usize) -> Self {
        match (self, blocks) {
            (Int8::Raw(q), Some(b)) => {
                let mut v = vec![0u8; q.len().div_ceil(2)];
                for (i, &x) in q.iter().enumerate() {
                    put_nibble(&mut v, i, x / b.of(i, k) as i8);
                }
                Int8::Nibbles(Arc::new(v), k)
            }
            (int8, _) => int8,
        }
    }
}

enum Scales {
    PerTensor(Quant),
    PerChannel(Arc<Vec<f32>>),
}

impl Scales {
    /// The scale of output row `row`.
    fn row(&self, row: usize) -> f32 {
        match self {
            Scales::PerTensor(q) => q.scale,
            Scales::PerChannel(s) => s[row],
        }
    }
}

/// Bytes of one Q8_0 block: an f16 scale and 32 INT8 values.
const Q8_0_BLOCK: usize = 34;

impl NpuWeight {
    fn quantize(w: &[f32], n: usize, k: usize, weights: WeightQuant) -> Result<(Vec<i8>, Scales, Option<Arc<BlockScales>>)> {
        Ok(match weights {
            WeightQuant::PerChannel | WeightQuant::PerChannelResidual => {
                let (q, s) = quantize_weight_i8_per_channel(w, n, k);
                (q, Scales::PerChannel(Arc::new(s)), None)
            }
            WeightQuant::PerTensor => {
                let (q, s) = quantize_weight_i8(w);
                (q, Scales::PerTensor(s), None)
            }
            WeightQuant::Lpbq { block } => {
                let l = quantize_weight_lpbq(w, n, k, block)?;
                let q = l.expand();
                (q, Scales::PerChannel(Arc::new(l.channel_scales)), Some(Arc::new(BlockScales { block, scales: l.block_scales })))
            }
        })
    }

    /// Columns `cs` of the INT8 weight, one after another (`cs.len()` x `N` values). The weight
    /// is read in blocks of rows, each row once for all the columns (a column read alone touches
    /// a cache line per row), the blocks split over the rayon pool.
    fn columns(&self, cs: &[usize], n: usize, k: usize) -> Result<Vec<i8>> {
        const ROWS: usize = 64;
        /// `cs.len()` columns of `n` values, one after another, filled by `fill(r0, c, part)`
        /// (rows `r0..r0 + part.len()` of column `c`) in blocks of `ROWS` rows over the pool.
        /// Each value is a cache line of its own (a column of a row-major weight): the gather
        /// waits on memory, not on arithmetic, and is split by rows even for a few columns
        /// (split by columns, a call's usual ten or so cold ones were one task while the other
        /// core waited). A block's rows stay in cache while every column is taken from them,
        /// each column's values written contiguously.
        fn by_row_blocks(cs: &[usize], n: usize, fill: impl Fn(usize, usize, &mut [i8]) + Sync) -> Vec<i8> {
            let mut out = vec![0i8; cs.len() * n];
            let mut blocks: Vec<Vec<(usize, &mut [i8])>> = (0..n.div_ceil(ROWS)).map(|_| Vec::with_capacity(cs.len())).collect();
            for (column, &c) in out.chunks_mut(n.max(1)).zip(cs) {
                for (b, part) in column.chunks_mut(ROWS).enumerate() {
                    blocks[b].push((c, part));
                }
            }
            blocks.into_par_iter().enumerate().for_each(|(b, parts)| parts.into_iter().for_each(|(c, part)| fill(b * ROWS, c, part)));
            out
        }
        /// `value(r, c)` reads a value; `ahead(r, c)` is where it lies, to prefetch: the next
        /// block's lines (likely this thread's next task) are asked for meanwhile.
        fn gather(cs: &[usize], n: usize, value: impl Fn(usize, usize) -> i8 + Sync, ahead: impl Fn(usize, usize) -> *const u8 + Sync) -> Vec<i8> {
            by_row_blocks(cs, n, |r0, c, part| {
                for (i, v) in part.iter_mut().enumerate() {
                    if r0 + i + ROWS < n {
                        prefetch(ahead(r0 + i + ROWS, c));
                    }
                    *v = value(r0 + i, c);
                }
            })
        }
        Ok(match &self.int8 {
            Int8::Raw(q) => gather(cs, n, |r, c| q[r * k + c], |r, c| q.as_ptr().wrapping_add(r * k + c).cast()),
            Int8::Nibbles(v, _) => {
                let b = &self.lpbq.as_ref().expect("nibbles are an LPBQ weight's").blocks;
                gather(cs, n, |r, c| nibble(v, r * k + c) * b.of(r * k + c, k) as i8, |r, c| v.as_ptr().wrapping_add((r * k + c) / 2))
            }
            Int8::Q8_0(t) => {
                let (data, at) = (t.data(), |r: usize, c: usize| (r * k + c) / 32 * Q8_0_BLOCK + 2 + c % 32);
                gather(cs, n, |r, c| data[at(r, c)] as i8, |r, c| data.as_ptr().wrapping_add(at(r, c)))
            }
            // A column of a block of rows at a time, its decoding chosen once.
            Int8::Blocks(b) => by_row_blocks(cs, n, |r0, c, part| {
                let mut w = [0f32; ROWS];
                let w = &mut w[..part.len()];
                b.column(c, r0..r0 + part.len(), w);
                part.iter_mut().zip(w.iter()).enumerate().for_each(|(i, (q, &v))| *q = self.requantize(v, r0 + i, c, k));
            }),
        })
    }

    /// The INT8 value of `v`, the float weight at `[r, c]` of `K` = `k`, quantized as this
    /// weight is: per channel, or LPBQ's 4-bit value times its block scale.
    fn requantize(&self, v: f32, r: usize, c: usize, k: usize) -> i8 {
        requantize(v, r, c, k, self.scales.row(r), self.lpbq.as_ref().map(|l| &*l.blocks))
    }

    /// The INT8 values, row-major `[N, K]`.
    fn values(&self) -> Result<Arc<Vec<i8>>> {
        match &self.int8 {
            Int8::Raw(q) => Ok(q.clone()),
            Int8::Nibbles(v, k) => {
                let b = &self.lpbq.as_ref().expect("nibbles are an LPBQ weight's").blocks;
                let n = b.scales.len() / (k / b.block).max(1);
                Ok(Arc::new((0..n * k).map(|i| nibble(v, i) * b.of(i, *k) as i8).collect()))
            }
            Int8::Blocks(b) => {
                // The float weight (candle's dequantization: `source.matrix()`'s values for a
                // checkpoint's blocks), each row by its scale.
                let (n, k) = b.dims();
                let w = b.dequantize()?.flatten_all()?.to_vec1::<f32>()?;
                let mut q = vec![0i8; n * k];
                q.par_chunks_mut(k.max(1)).zip(w.par_chunks(k.max(1))).enumerate().for_each(|(r, (q, w))| {
                    q.iter_mut().zip(w).enumerate().for_each(|(c, (q, &v))| *q = self.requantize(v, r, c, k));
                });
                Ok(Arc::new(q))
            }
            Int8::Q8_0(t) => {
                let data = t.data();
                // A block at a time (`flat_map` gives `collect` no length: it grew the vector
                // value by value; 21% of SmolLM2's load).
                let mut q = Vec::with_capacity(data.len() / Q8_0_BLOCK * 32);
                for b in data.chunks_exact(Q8_0_BLOCK) {
                    q.extend(b[2..].iter().map(|&v| v as i8));
                }
                Ok(Arc::new(q))
            }
        }
    }
}

/// `q` (`[N, K]`, K whole blocks of 32) with one scale per row, as Q8_0.
fn q8_0_blocks(q: &[i8], n: usize, k: usize, scale: impl Fn(usize) -> f32) -> Result<BlockMatrix> {
    let mut bytes = Vec::with_capacity(n * k / 32 * Q8_0_BLOCK);
    for (r, row) in q.chunks_exact(k).enumerate() {
        let d = half::f16::from_f32(scale(r)).to_le_bytes();
        for block in row.chunks_exact(32) {
            bytes.extend_from_slice(&d);
            bytes.extend(block.iter().map(|&v| v as u8));
        }
    }
    BlockMatrix::new(BlockFormat::Q8_0, n, k, Arc::new(bytes), 0)
}

/// A decode weight `[N, K]`: what a linear, the embedding table or the output table multiplies
/// with on the CPU.
#[derive(Debug, Clone)]
pub enum DecodeMatrix {
    /// ggml blocks (the checkpoint's own, mapped, or a Q8_0 form of the INT8 weights), through
    /// this crate's decode kernels ([`crate::kernels::gemv`]).
    Blocks(BlockMatrix),
    /// Floats (a float reference, or a width that is not whole blocks), through candle's matmul.
    F32(Tensor),
}

impl DecodeMatrix {
    /// `x @ w^T` for `x` of `[.., K]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            DecodeMatrix::Blocks(b) => b.forward(x),
            DecodeMatrix::F32(w) => Ok(x.broadcast_matmul(&w.t()?)?),
        }
    }

    /// Rows `ids` as F32, `[ids.len(), K]` (the embedding lookup).
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        match self {
            DecodeMatrix::Blocks(b) => b.rows(ids),
            DecodeMatrix::F32(w) => {
                if let Some(&id) = ids.iter().find(|&&id| id as usize >= w.dim(0).unwrap_or(0)) {
                    return Err(Error::Input(format!("row {id} of a matrix of {} rows", w.dim(0)?)));
                }
                Ok(w.index_select(&Tensor::new(ids, &Device::Cpu)?, 0)?)
            }
        }
    }

    /// (N, K).
    pub fn dims(&self) -> (usize, usize) {
        match self {
            DecodeMatrix::Blocks(b) => b.dims(),
            DecodeMatrix::F32(w) => w.dims2().unwrap_or((0, 0)),
        }
    }

    /// Bytes of its weights (mapped ones too: resident once read).
    pub fn bytes(&self) -> usize {
        match self {
            DecodeMatrix::Blocks(b) => b.data().len(),
            DecodeMatrix::F32(w) => w.elem_count() * 4,
        }
    }

    /// Each of `ws` times `x` (a stage's linears, sharing their input): one decode product for
    /// all when every one is in blocks (`x` quantized once per row), else one each.
    pub fn forward_all(ws: &[&DecodeMatrix], x: &Tensor) -> Result<Vec<Tensor>> {
        let blocks: Option<Vec<&BlockMatrix>> = ws
            .iter()
            .map(|w| match w {
                DecodeMatrix::Blocks(b) => Some(b),
                DecodeMatrix::F32(_) => None,
            })
            .collect();
        match blocks {
            Some(bs) => BlockMatrix::forward_all(&bs, x),
            None => ws.iter().map(|w| w.forward(x)).collect(),
        }
    }
}

/// The hot input channels' weight columns, `[n_hot, N]`, contiguous (a column of the row-major
/// weight is strided: one cache line per output), with a channel -> slot index. They hold the
/// INT8 values (times the row scales when used), not floats: on SmolLM2, multiplying every
/// outlier with its INT8 column measured the same perplexity as with float columns (`docs/memory.md`: x F32 1.0051 / 0.9997 / 1.0037 with no float column, 1.0040 / 0.9963 / 1.0094
/// with f16 columns for every hot channel), at a quarter of the f32 memory. The hot set is a
/// speed structure: cold channels' columns are read on every call, from the host executor's
/// packed weight when one lives (a cache line per 16 outputs) or from the weight.
#[derive(Default)]
struct HotColumns {
    slot: Vec<u32>,
    cols: Vec<i8>,
}

const COLD: u32 = u32::MAX;

/// One linear layer on every path (see the module docs): its INT8 NPU weight and the FullyConnected
/// it adds to stage graphs, the shadow path that adds the clipped outliers back
/// ([`ShadowLinear::finish`]), and the decode matmul.
pub struct ShadowLinear {
    name: String,
    n: usize,
    k: usize,
    /// The float weight: read to quantize and for float graphs (calibration, the F32
    /// reference); never resident.
    source: Arc<dyn WeightSource>,
    npu: NpuWeight,
    /// The NPU weight's scale of each output row (per tensor: one value repeated).
    row_scales: Vec<f32>,
    bias: Option<Vec<f32>>,
    bias_t: Option<Tensor>,
    decode: DecodeMatrix,
    hot: HotColumns,
    shadow: bool,
    cold_reads: AtomicU64,
    /// The identity of the INT8 weight in graphs ([`Graph::set_data_id`]): it never changes.
    npu_id: u64,
    /// The identity of the float weight in graphs (F32 prefill, shadow W8A16's outliers): the
    /// host executor packs it once for every graph size.
    float_id: u64,
    /// The host executor's packed copy of the INT8 weight, while a prepared graph holds it
    /// ([`ShadowLinear::attach_packed`]): cold columns are read from it.
    packed: Mutex<Weak<PackedI8>>,
    /// [`WeightQuant::PerChannelResidual`]'s second INT8 weight, as a linear of its own (no
    /// bias, decode unused) whose graph output and outliers add to this one's.
    residual: Option<Box<ShadowLinear>>,
}

impl std::fmt::Debug for ShadowLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShadowLinear({} [{}, {}], {} hot, shadow {})", self.name, self.n, self.k, self.n_hot(), self.shadow)
    }
}

impl ShadowLinear {
    /// A linear over the float weight in `source` (`[N, K]`, out x in), read once here to
    /// quantize it; `bias` has `N` values.
    pub fn new(name: impl Into<String>, source: Arc<dyn WeightSource>, bias: Option<Vec<f32>>, weights: WeightQuant, decode: DecodeWeights) -> Result<Self> {
        let data = source.matrix()?;
        Self::with_matrix(name.into(), source, data, bias, weights, decode)
    }

    /// [`Self::new`] with `source`'s matrix already read (`data`).
    fn with_matrix(
        name: String,
        source: Arc<dyn WeightSource>,
        data: Vec<f32>,
        bias: Option<Vec<f32>>,
        weights: WeightQuant,
        decode: DecodeWeights,
    ) -> Result<Self> {
        let (n, k) = source.dims();
        if data.len() != n * k || n == 0 || k == 0 {
            return Err(Error::Input(format!("{name}: weight from {} has {} values, not [{n}, {k}]", source.describe(), data.len())));
        }
        if let Some(b) = bias.as_ref().filter(|b| b.len() != n) {
            return Err(Error::Input(format!("{name}: bias has {} values, weight has {n} outputs", b.len())));
        }
        // A NaN or infinite weight would quantize to a row of zeros on the NPU and stay NaN on the
        // CPU: the two paths would disagree without a word.
        if let Some(i) = data.iter().position(|v| !v.is_finite()) {
            return Err(Error::Input(format!("{name}: weight from {} has {} at [{}, {}]", source.describe(), data[i], i / k, i % k)));
        }
        if let Some(i) = bias.iter().flatten().position(|v| !v.is_finite()) {
            return Err(Error::Input(format!("{name}: bias has a non-finite value at [{i}]")));
        }
        let (q, scales, blocks) = NpuWeight::quantize(&data, n, k, weights).map_err(|e| match e {
            Error::Input(m) => Error::Input(format!("{name}: {m}")),
            e => e,
        })?;
        let row_scales: Vec<f32> = (0..n).map(|r| scales.row(r)).collect();
        let checkpoint = match decode {
            DecodeWeights::Checkpoint => {
                let t = source.blocks()?;
                if t.is_none() {
                    tracing::debug!(linear = %name, "{} has no blocks of a decode kernel's format: decode uses Q8_0", source.describe());
                }
                t
            }
            _ => None,
        };
        // The residual's weight, from the values at hand (its source would read and quantize the
        // matrix again).
        let residual_data = (weights == WeightQuant::PerChannelResidual).then(|| rounding_error(&data, &q, &row_scales, k));
        let (int8, decode) = match (decode, checkpoint) {
            (_, Some(b)) => {
                // The INT8 values are dropped and taken from the blocks when needed: they must be
                // the blocks' values requantized (an LPBQ weight's by its block scales too, which
                // are held). Spot-checked (each row's first and last 32 values): a source whose
                // blocks are not its matrix would give the NPU one weight and the shadow path
                // another.
                let spots = (0..n).flat_map(|r| (0..k.min(32)).chain(k.saturating_sub(32)..k).map(move |c| (r, c)));
                if let Some((r, c)) = spots.into_iter().find(|&(r, c)| requantize(b.value(r, c), r, c, k, row_scales[r], blocks.as_deref()) != q[r * k + c]) {
                    return Err(Error::Internal(format!(
                        "{name}: the blocks of {} give {} at [{r}, {c}] where its matrix gives {}",
                        source.describe(),
                        b.value(r, c),
                        data[r * k + c]
                    )));
                }
                (Int8::Blocks(b.clone()), DecodeMatrix::Blocks(b))
            }
            (DecodeWeights::F32, None) => (Int8::Raw(Arc::new(q)).lpbq(blocks.as_deref(), k), DecodeMatrix::F32(Tensor::from_vec(data, (n, k), &Device::Cpu)?)),
            (_, None) if k % 32 == 0 => {
                if let Some(r) = row_scales.iter().position(|&s| s > half::f16::MAX.to_f32()) {
                    return Err(Error::Input(format!("{name}: row {r}'s weights (scale {}) are beyond Q8_0's f16 scales", row_scales[r])));
                }
                let t = q8_0_blocks(&q, n, k, |r| row_scales[r])?;
                (Int8::Q8_0(t.clone()), DecodeMatrix::Blocks(t))
            }
            (_, None) => {
                tracing::warn!(linear = %name, k, "input width is not whole Q8_0 blocks of 32: decode runs the INT8 weight dequantized to F32");
                let deq: Vec<f32> = q.iter().enumerate().map(|(i, &v)| v as f32 * row_scales[i / k]).collect();
                (Int8::Raw(Arc::new(q)), DecodeMatrix::F32(Tensor::from_vec(deq, (n, k), &Device::Cpu)?))
            }
        };
        let lpbq = blocks.map(|blocks| LpbqLayout { blocks, parts: lpbq_parts(n).into_iter().map(|r| (r, crate::graph::next_data_id())).collect() });
        let npu = NpuWeight { int8, scales, lpbq };
        let residual = match residual_data {
            Some(d) => {
                let src = Arc::new(ResidualSource(source.clone()));
                Some(Box::new(ShadowLinear::with_matrix(format!("{name}.residual"), src, d, None, WeightQuant::PerChannel, DecodeWeights::Q8_0)?))
            }
            None => None,
        };
        let bias_t = bias.as_ref().map(|b| Tensor::from_slice(b, n, &Device::Cpu)).transpose()?;
        Ok(ShadowLinear {
            name,
            n,
            k,
            source,
            npu,
            row_scales,
            bias,
            bias_t,
            decode,
            hot: HotColumns { slot: vec![COLD; k], cols: vec![] },
            shadow: true,
            cold_reads: AtomicU64::new(0),
            npu_id: crate::graph::next_data_id(),
            float_id: crate::graph::next_data_id(),
            packed: Mutex::new(Weak::new()),
            residual,
        })
    }

    /// The layer's name: the prefix of its graph tensors and ops, and its name in logs and errors.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The bias added to every output row, `[N]` (Qwen2's q, k and v), if any.
    pub fn bias(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }
    /// (out, in) features.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Add this layer's FullyConnected to a stage graph: float weights for an F32 input,
    /// INT8 weights (per channel or per tensor) for a quantized one. The output is F32; the
    /// bias is added by [`ShadowLinear::finish`] on the CPU.
    pub fn add_to_graph(&self, g: &mut Graph, suffix: &str, x: TensorId) -> Result<TensorId> {
        let wname = format!("{}{suffix}.weight", self.name);
        let w = match g.tensor(x).dtype {
            DType::F32 => {
                let w = g.constant(&wname, &[self.n, self.k], StaticData::F32(Arc::new(self.source.matrix()?)), None);
                g.set_data_id(w, self.float_id);
                w
            }
            _ if self.npu.lpbq.is_some() => return self.add_lpbq(g, suffix, x),
            _ => {
                let w = match &self.npu.scales {
                    Scales::PerChannel(s) => g.constant_per_channel(&wname, &[self.n, self.k], self.npu.values()?, s.clone()),
                    Scales::PerTensor(q) => g.constant(&wname, &[self.n, self.k], StaticData::I8(self.npu.values()?), Some(*q)),
                };
                g.set_data_id(w, self.npu_id);
                w
            }
        };
        let y = g.fully_connected(&format!("{}{suffix}", self.name), x, w, None, DType::F32, None);
        Ok(match (&self.residual, g.tensor(x).dtype) {
            (Some(r), dt) if dt != DType::F32 => {
                let yr = r.add_to_graph(g, suffix, x)?;
                g.binary(&format!("{}{suffix}.sum", self.name), y, yr, DType::F32, None, |a, b, output| Op::Add { a, b, output })
            }
            _ => y,
        })
    }

    /// [`Self::add_to_graph`] for an LPBQ weight. The HTP takes a 4-bit FullyConnected only into
    /// an output of its input's type (u16: the HTP's default plan), so each part
    /// ([`lpbq_parts`]) goes into U16 over the largest output its input's grid can give
    /// ([`Self::lpbq_output_quant`]), is dequantized, and the parts are concatenated.
    fn add_lpbq(&self, g: &mut Graph, suffix: &str, x: TensorId) -> Result<TensorId> {
        let lpbq = self.npu.lpbq.as_ref().expect("an LPBQ weight");
        let Scales::PerChannel(scales) = &self.npu.scales else {
            return Err(Error::Internal(format!("{}: LPBQ without per-channel scales", self.name)));
        };
        let (name, m, k) = (format!("{}{suffix}", self.name), g.tensor(x).shape[0], self.k);
        let q = self.npu.values()?;
        let blocks = k / lpbq.blocks.block;
        let mut out: Option<TensorId> = None;
        for (i, (rows, id)) in lpbq.parts.iter().enumerate() {
            let part = |what: &str| if lpbq.parts.len() == 1 { format!("{name}{what}") } else { format!("{name}.part{i}{what}") };
            let w = g.constant_lpbq(
                &part(".weight"),
                &[rows.len(), k],
                Arc::new(q[rows.start * k..rows.end * k].to_vec()),
                Arc::new(scales[rows.clone()].to_vec()),
                Arc::new(BlockScales { block: lpbq.blocks.block, scales: lpbq.blocks.scales[rows.start * blocks..rows.end * blocks].to_vec() }),
            );
            g.set_data_id(w, *id);
            let quant = self.lpbq_output_quant(g.tensor(x), &q, rows.clone())?;
            let yq = g.fully_connected(&part(".u16"), x, w, None, DType::U16, Some(quant));
            let y = g.unary(&part(""), yq, DType::F32, None, |input, output| Op::Dequantize { input, output });
            out = Some(match out {
                None => y,
                Some(a) => {
                    let cols = g.tensor(a).shape[1] + rows.len();
                    let what = if rows.end == self.n { name.clone() } else { format!("{name}.to{}", rows.end) };
                    g.op(&what, DType::F32, None, |output| Op::Concat { a, b: y, axis: 1, output }, &[m, cols])
                }
            });
        }
        out.ok_or_else(|| Error::Internal(format!("{name}: an LPBQ weight of no rows")))
    }

    /// The U16 grid of LPBQ output rows `rows` ([`Self::add_lpbq`]): symmetric over
    /// `max_n s_n * sum_k |q[n, k]| * max |x|`, the largest output any input on `x`'s grid can
    /// give, so it never saturates (the shadow path adds what lies beyond the input's grid).
    /// Its step is that bound over 32767: on a random `[576 -> 96]` weight 1/14 of the largest
    /// output's own bound (the bound sums |w| where outputs sum signed terms), so about 12 bits
    /// of the largest output, FP16's precision.
    fn lpbq_output_quant(&self, x: &crate::graph::TensorSpec, q: &[i8], rows: std::ops::Range<usize>) -> Result<Quant> {
        let xq = x.quant.ok_or_else(|| Error::Internal(format!("{}: a quantized input without scale/offset", self.name)))?;
        let (lo, hi) = xq.float_range(x.dtype);
        let x_max = lo.abs().max(hi.abs()) as f64;
        let bound = q[rows.start * self.k..rows.end * self.k]
            .chunks(self.k)
            .zip(&self.row_scales[rows])
            .map(|(row, &s)| row.iter().map(|&v| (v as i64).abs()).sum::<i64>() as f64 * s as f64)
            .fold(0f64, f64::max)
            * x_max;
        let bound = if bound > 0.0 && bound.is_finite() { bound } else { 1.0 };
        Ok(Quant { scale: (bound / 32767.0) as f32, offset: -32768 })
    }

    /// Reads cold columns from `graph`'s packed copy of this linear's INT8 weight while the graph
    /// lives (a line per 16 outputs, likely in cache: its GEMM just read it), when it holds one
    /// (a host graph); otherwise they come from the weight (a line per output).
    pub fn attach_packed(&self, graph: &PreparedGraph) {
        if let Some(p) = graph.packed_weight(self.npu_id) {
            *self.packed.lock().unwrap_or_else(|e| e.into_inner()) = Arc::downgrade(&p);
        }
        if let Some(r) = &self.residual {
            r.attach_packed(graph);
        }
    }

    /// Keep these input channels' columns contiguous (the hot set; see `HotColumns`).
    pub fn set_hot(&mut self, channels: &[u32]) -> Result<()> {
        let mut slot = vec![COLD; self.k];
        let mut unique = Vec::with_capacity(channels.len());
        for &c in channels {
            let c = c as usize;
            if c >= self.k {
                return Err(Error::Input(format!("{}: hot channel {c} beyond {} inputs", self.name, self.k)));
            }
            if slot[c] == COLD {
                slot[c] = unique.len() as u32;
                unique.push(c);
            }
        }
        self.hot = HotColumns { slot, cols: self.npu.columns(&unique, self.n, self.k)? };
        if let Some(r) = &mut self.residual {
            r.set_hot(channels)?;
        }
        Ok(())
    }

    /// Run (true) or prune (false) this layer's shadow path.
    pub fn set_shadow(&mut self, on: bool) {
        self.shadow = on;
        if let Some(r) = &mut self.residual {
            r.set_shadow(on);
        }
    }
    /// Whether [`Self::finish`] adds the outliers (see [`Self::set_shadow`]).
    pub fn shadow_enabled(&self) -> bool {
        self.shadow
    }

    /// Number of hot input channels, whose columns are kept contiguous.
    pub fn n_hot(&self) -> usize {
        self.hot.cols.len() / self.n.max(1)
    }
    /// Bytes of the decode matmul's weight, and of the INT8 copy when decode has its own (with a
    /// residual weight's INT8 blocks).
    pub fn decode_bytes(&self) -> usize {
        self.residual.as_ref().map_or(0, |r| r.decode_bytes())
            + self.decode.bytes()
            + match &self.npu.int8 {
                Int8::Q8_0(_) => 0,
                Int8::Raw(q) => q.len(),
                Int8::Nibbles(v, _) => v.len(),
                Int8::Blocks(_) => 0,
            }
    }
    /// Bytes of INT8 values this linear holds apart from its decode weight (0 when they are
    /// the decode weight's Q8_0 blocks or are requantized from the checkpoint's blocks), a
    /// residual weight's included.
    pub fn int8_bytes(&self) -> usize {
        self.residual.as_ref().map_or(0, |r| r.decode_bytes())
            + match &self.npu.int8 {
                Int8::Raw(q) => q.len(),
                Int8::Nibbles(v, _) => v.len(),
                Int8::Q8_0(_) | Int8::Blocks(_) => 0,
            }
    }
    /// The decode weight.
    pub fn decode(&self) -> &DecodeMatrix {
        &self.decode
    }
    /// Bytes of the hot channels' contiguous columns.
    pub fn hot_bytes(&self) -> usize {
        self.residual.as_ref().map_or(0, |r| r.hot_bytes()) + self.hot.cols.len()
    }
    /// Bytes every column would take (the INT8 weight once more).
    pub fn all_columns_bytes(&self) -> usize {
        self.n * self.k
    }
    /// Cold columns used so far (each taken from the INT8 weight).
    pub fn cold_reads(&self) -> u64 {
        self.cold_reads.load(Ordering::Relaxed)
    }

    /// Complete the NPU output `y` (`[rows, N]`, rows >= the outliers' rows): add the bias to
    /// every row and, unless pruned, the outliers times their float weight columns.
    pub fn finish(&self, outliers: &Outliers, y: &mut [f32]) -> Result<()> {
        self.finish_own(outliers, y)?;
        match &self.residual {
            Some(r) => r.finish_own(outliers, y),
            None => Ok(()),
        }
    }

    /// [`Self::finish`] by this weight alone (not its residual).
    fn finish_own(&self, outliers: &Outliers, y: &mut [f32]) -> Result<()> {
        let n = self.n;
        if let Some(b) = &self.bias {
            y.chunks_exact_mut(n).for_each(|row| row.iter_mut().zip(b).for_each(|(v, b)| *v += b));
        }
        if !self.shadow || outliers.is_empty() {
            return Ok(());
        }
        if outliers.cols != self.k || y.len() < outliers.rows() * n {
            return Err(Error::Input(format!("{}: outliers of {} x {} against output {} x {n}", self.name, outliers.rows(), outliers.cols, y.len() / n)));
        }
        // Each outlier times its channel's INT8 column and the row scales, added to its row: hot
        // columns are contiguous copies, the cold ones are read from the weight together once per
        // call (`at[c]`: its place in `cold`, a dense index, no hashing). No f32 column is built:
        // a busy projection has outliers in most channels, and dequantizing each column once
        // wrote (and zeroed) megabytes per call that the shadow path then read back.
        const ABSENT: u32 = u32::MAX;
        let mut at = vec![ABSENT; self.k];
        let mut cold_channels = vec![];
        for &c in &outliers.channel {
            let c = c as usize;
            if self.hot.slot[c] == COLD && at[c] == ABSENT {
                at[c] = cold_channels.len() as u32;
                cold_channels.push(c);
            }
        }
        if !cold_channels.is_empty() {
            tracing::trace!(linear = %self.name, channels = ?cold_channels, "cold outlier channels: columns read from the packed or the stored weight");
            self.cold_reads.fetch_add(cold_channels.len() as u64, Ordering::Relaxed);
        }
        // From the host executor's packed copy when one is attached and alive, else from the
        // weight.
        let packed = (!cold_channels.is_empty()).then(|| self.packed.lock().unwrap_or_else(|e| e.into_inner()).upgrade()).flatten();
        let cold = match packed.and_then(|p| p.columns(&cold_channels)) {
            Some(cold) => cold,
            None => self.npu.columns(&cold_channels, n, self.k)?,
        };
        let column = |c: usize| match self.hot.slot[c] {
            COLD => &cold[at[c] as usize * n..][..n],
            s => &self.hot.cols[s as usize * n..][..n],
        };
        // Blocks of rows over the rayon pool; a row's outliers go in together (`shadow_row`).
        let block = rows_per_task(outliers.rows(), n);
        y[..outliers.rows() * n].par_chunks_mut(block * n).enumerate().for_each(|(b, rows)| {
            let mut terms = vec![];
            for (i, row) in rows.chunks_exact_mut(n).enumerate() {
                terms.clear();
                terms.extend(outliers.row(b * block + i).map(|(c, v)| (v, column(c))));
                shadow_row(row, &terms, &self.row_scales);
            }
        });
        Ok(())
    }

    /// Decode (CPU): `x @ w^T + b` for `x` `[rows, K]`, by the decode weight ([`DecodeMatrix`]:
    /// this crate's kernels on blocks).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.with_bias(self.decode.forward(x)?)
    }

    /// [`ShadowLinear::forward`] of each of `linears` (a stage's, sharing the input `x`): one
    /// decode product for all ([`DecodeMatrix::forward_all`]), the same values as one call each.
    pub fn forward_all(linears: &[ShadowLinear], x: &Tensor) -> Result<Vec<Tensor>> {
        let ws: Vec<&DecodeMatrix> = linears.iter().map(|l| &l.decode).collect();
        let ys = DecodeMatrix::forward_all(&ws, x)?;
        linears.iter().zip(ys).map(|(l, y)| l.with_bias(y)).collect()
    }

    fn with_bias(&self, y: Tensor) -> Result<Tensor> {
        Ok(match &self.bias_t {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

#[cfg(test)]
mod tests;
