//! [`ShadowLinear`]: the one object per linear layer. It owns what the layer is on every path:
//! its NPU weight (INT8, per output channel) and the FullyConnected it adds to a stage graph, the
//! float columns of its hot input channels and the source of the cold ones (the shadow path), its
//! bias, and its decode matmul on candle CPU. The engine builds graphs, merges shadow outliers
//! and decodes only through it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Module, Tensor};

use crate::error::{Error, Result};
use crate::graph::{DType, Graph, Quant, StaticData, TensorId};
use crate::outlier::{ColumnSource, Outliers};
use crate::quant::{quantize_weight_i8, quantize_weight_i8_per_channel};

/// How the NPU weight is quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WeightQuant {
    /// One scale per output channel (QNN AXIS_SCALE_OFFSET): the default.
    #[default]
    PerChannel,
    /// One scale per tensor: the naive baseline, kept for comparison.
    PerTensor,
}

/// Weight format of the CPU decode path. Measured on the 2-core x86 build machine with candle's
/// CPU kernels for SmolLM2-135M (issue 2): Q4_1 24 tok/s (scalar path), F32 32 tok/s, Q8_0
/// 67 tok/s, so Q8_0 is the default; F32 exists to compare bit-for-bit with a float reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeWeights {
    F32,
    #[default]
    Q8_0,
}

/// The NPU form of a weight `[N, K]`.
struct NpuWeight {
    q: Arc<Vec<i8>>,
    scales: Scales,
}

enum Scales {
    PerTensor(Quant),
    PerChannel(Arc<Vec<f32>>),
}

/// Float columns of the hot input channels, `[n_hot, N]`, with a channel -> slot index.
#[derive(Default)]
struct HotColumns {
    slot: Vec<u32>,
    cols: Vec<f32>,
}

const COLD: u32 = u32::MAX;

pub struct ShadowLinear {
    name: String,
    n: usize,
    k: usize,
    /// The float weight `[N, K]`: float graphs (calibration, the F32 reference) and hot columns.
    weight: Tensor,
    npu: NpuWeight,
    bias: Option<Vec<f32>>,
    bias_t: Option<Tensor>,
    decode: QMatMul,
    hot: HotColumns,
    cold: Option<Arc<dyn ColumnSource>>,
    shadow: bool,
    cold_reads: AtomicU64,
}

impl std::fmt::Debug for ShadowLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShadowLinear({} [{}, {}], {} hot, shadow {})", self.name, self.n, self.k, self.n_hot(), self.shadow)
    }
}

impl ShadowLinear {
    /// `weight` is `[N, K]` (out, in) in F32, `bias` `[N]`. `cold` reads the columns of input
    /// channels that are not hot; without it a cold outlier is an error.
    pub fn new(
        name: impl Into<String>,
        weight: Tensor,
        bias: Option<&Tensor>,
        weights: WeightQuant,
        decode: DecodeWeights,
        cold: Option<Arc<dyn ColumnSource>>,
    ) -> Result<Self> {
        let name = name.into();
        let (n, k) = weight.dims2()?;
        let data = weight.flatten_all()?.to_vec1::<f32>()?;
        let npu = match weights {
            WeightQuant::PerChannel => {
                let (q, s) = quantize_weight_i8_per_channel(&data, n, k);
                NpuWeight { q: Arc::new(q), scales: Scales::PerChannel(Arc::new(s)) }
            }
            WeightQuant::PerTensor => {
                let (q, s) = quantize_weight_i8(&data);
                NpuWeight { q: Arc::new(q), scales: Scales::PerTensor(s) }
            }
        };
        let bias_t = bias.cloned();
        let bias = bias.map(|b| b.to_vec1::<f32>()).transpose()?;
        if let Some(b) = bias.as_ref().filter(|b| b.len() != n) {
            return Err(Error::Input(format!("{name}: bias has {} values, weight has {n} outputs", b.len())));
        }
        let decode = match decode {
            DecodeWeights::F32 => QMatMul::Tensor(weight.clone()),
            DecodeWeights::Q8_0 => QMatMul::from_qtensor(QTensor::quantize(&weight, GgmlDType::Q8_0)?)?,
        };
        Ok(ShadowLinear {
            name,
            n,
            k,
            weight,
            npu,
            bias,
            bias_t,
            decode,
            hot: HotColumns { slot: vec![COLD; k], cols: vec![] },
            cold,
            shadow: true,
            cold_reads: AtomicU64::new(0),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
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
                let data = self.weight.flatten_all()?.to_vec1::<f32>()?;
                g.constant(&wname, &[self.n, self.k], StaticData::F32(Arc::new(data)), None)
            }
            _ => match &self.npu.scales {
                Scales::PerChannel(s) => g.constant_per_channel(&wname, &[self.n, self.k], self.npu.q.clone(), s.clone()),
                Scales::PerTensor(q) => g.constant(&wname, &[self.n, self.k], StaticData::I8(self.npu.q.clone()), Some(*q)),
            },
        };
        Ok(g.fully_connected(&format!("{}{suffix}", self.name), x, w, None, DType::F32, None))
    }

    /// Keep the float columns of these input channels in memory (the hot set).
    pub fn set_hot(&mut self, channels: &[u32]) -> Result<()> {
        let w = self.weight.t()?.contiguous()?; // [K, N]: a column of w is a row here
        let mut hot = HotColumns { slot: vec![COLD; self.k], cols: Vec::with_capacity(channels.len() * self.n) };
        for &c in channels {
            let c = c as usize;
            if c >= self.k {
                return Err(Error::Input(format!("{}: hot channel {c} beyond {} inputs", self.name, self.k)));
            }
            if hot.slot[c] == COLD {
                hot.slot[c] = (hot.cols.len() / self.n) as u32;
                hot.cols.extend(w.get(c)?.to_vec1::<f32>()?);
            }
        }
        self.hot = hot;
        Ok(())
    }

    /// Run (true) or prune (false) this layer's shadow path.
    pub fn set_shadow(&mut self, on: bool) {
        self.shadow = on;
    }
    pub fn shadow_enabled(&self) -> bool {
        self.shadow
    }

    pub fn n_hot(&self) -> usize {
        self.hot.cols.len() / self.n.max(1)
    }
    /// Bytes of float columns kept for the hot channels.
    pub fn hot_bytes(&self) -> usize {
        self.hot.cols.len() * 4
    }
    /// Bytes every float column would take.
    pub fn all_columns_bytes(&self) -> usize {
        self.n * self.k * 4
    }
    /// Columns read from the [`ColumnSource`] so far.
    pub fn cold_reads(&self) -> u64 {
        self.cold_reads.load(Ordering::Relaxed)
    }

    /// Complete the NPU output `y` (`[rows, N]`, rows >= the outliers' rows): add the bias to
    /// every row and, unless pruned, the outliers times their float weight columns.
    pub fn finish(&self, outliers: &Outliers, y: &mut [f32]) -> Result<()> {
        let n = self.n;
        if let Some(b) = &self.bias {
            y.chunks_exact_mut(n).for_each(|row| row.iter_mut().zip(b).for_each(|(v, b)| *v += b));
        }
        if !self.shadow || outliers.is_empty() {
            return Ok(());
        }
        if outliers.cols != self.k || y.len() < outliers.rows() * n {
            return Err(Error::Input(format!(
                "{}: outliers of {} x {} against output {} x {n}",
                self.name,
                outliers.rows(),
                outliers.cols,
                y.len() / n
            )));
        }
        let mut cold: HashMap<usize, Vec<f32>> = HashMap::new();
        for (_, c, _) in outliers.iter().filter(|&(_, c, _)| self.hot.slot[c] == COLD) {
            if !cold.contains_key(&c) {
                let src = self.cold.as_ref().ok_or_else(|| {
                    Error::Input(format!("{}: outlier in cold channel {c} and no column source to read it from", self.name))
                })?;
                let col = src.column(c)?;
                if col.len() != n {
                    return Err(Error::Input(format!("{}: column {c} from {} has {} values, need {n}", self.name, src.describe(), col.len())));
                }
                tracing::debug!(linear = %self.name, channel = c, source = %src.describe(), "cold outlier channel: column read");
                self.cold_reads.fetch_add(1, Ordering::Relaxed);
                cold.insert(c, col);
            }
        }
        for (r, c, v) in outliers.iter() {
            let col = match self.hot.slot[c] {
                COLD => &cold[&c][..],
                s => &self.hot.cols[s as usize * n..(s as usize + 1) * n],
            };
            y[r * n..(r + 1) * n].iter_mut().zip(col).for_each(|(y, w)| *y += v * w);
        }
        Ok(())
    }

    /// Decode (candle CPU): `x @ w^T + b` for `x` `[rows, K]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.decode.forward(x)?;
        Ok(match &self.bias_t {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}
