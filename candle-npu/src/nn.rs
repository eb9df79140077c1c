//! NPU layers for a candle user's own model: [`Linear`] is a `candle_core::Module` made from
//! candle tensors or a `candle_nn::VarBuilder`, as `candle_nn::linear` is, so a model written
//! against candle-nn moves its linears to the NPU by changing how they are built.
//!
//! Why a workflow and not a device: candle's `Device` is a closed enum, so an NPU cannot be one
//! of its variants; and W8A8 needs each layer's activation range, which only the model's own
//! inputs show. So the layers are made through an [`Npu`] (the device and the calibration they
//! share), and:
//!
//! 1. the model's own forward runs on sample inputs while the layers **observe**: they compute in
//!    float on the CPU (as candle would) and record what comes in;
//! 2. [`Npu::freeze`] chooses each layer's clip range from what it saw ([`ClipMethod`]) and keeps
//!    the input channels that went beyond it as hot columns;
//! 3. from then on the layers run **W8A8 on the device**, the values beyond the range added back
//!    in float on the CPU (the shadow outliers of [`ShadowLinear`]), so what calibration did not
//!    foresee is still computed.
//!
//! Layers that read the same input (a transformer block's q, k and v projections; its MLP's
//! gate and up) are made together with [`Npu::linears`]: one graph computes them all from one
//! quantized input, so the input is observed, quantized and sent once, and its outliers are
//! found once for all of them.
//!
//! Any row count: rows are cut into chunks of the graph sizes (powers of two from 32 up to the
//! chunk length), the last one padded; a graph is prepared on the first chunk of its size.
//!
//! ```no_run
//! # fn main() -> candle_npu::Result<()> {
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_npu::nn::Npu;
//! let vb = candle_nn::VarBuilder::zeros(DType::F32, &Device::Cpu);
//! let npu = Npu::new(candle_npu::NpuDevice::host());
//! let fc1 = npu.linear(64, 128, vb.pp("fc1"))?; // as candle_nn::linear(64, 128, vb.pp("fc1"))
//! let sample = Tensor::randn(0f32, 1., (32, 64), &Device::Cpu)?;
//! fc1.forward(&sample)?; // observes (float)
//! npu.freeze(candle_npu::ClipMethod::Budget { fraction: 1e-2 })?;
//! let y = fc1.forward(&sample)?; // W8A8 on the NPU, outliers on the CPU
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::graph::{DType, Graph, TensorData};
use crate::linear::{DecodeWeights, ShadowLinear, WeightQuant};
use crate::outlier::{InMemoryWeight, InputPoint};
use crate::quant::{Calibrator, ClipMethod};
use crate::{NpuDevice, PreparedGraph};

/// The smallest graph size: smaller chunks are padded to it (graphs of a few rows cost the NPU
/// as much as 32).
const MIN_GRAPH_ROWS: usize = 32;

/// The device and the calibration a model's NPU layers share. Cheap to clone.
#[derive(Clone)]
pub struct Npu {
    shared: Arc<Shared>,
}

struct Shared {
    device: NpuDevice,
    chunk_len: usize,
    layers: Mutex<Vec<Weak<Inner>>>,
}

impl Npu {
    /// Layers on `device`, in chunks of at most 256 rows.
    pub fn new(device: NpuDevice) -> Self {
        Self::with_chunk_len(device, 256)
    }

    /// Layers on `device`, in chunks of at most `chunk_len` rows (1 or more).
    pub fn with_chunk_len(device: NpuDevice, chunk_len: usize) -> Self {
        Npu { shared: Arc::new(Shared { device, chunk_len: chunk_len.max(1), layers: Mutex::new(vec![]) }) }
    }

    /// The device the layers run on once frozen.
    pub fn device(&self) -> &NpuDevice {
        &self.shared.device
    }

    /// `candle_nn::linear`'s layer: `weight` `[out_dim, in_dim]` and `bias` `[out_dim]` from `vb`.
    pub fn linear(&self, in_dim: usize, out_dim: usize, vb: candle_nn::VarBuilder) -> Result<Linear> {
        let w = vb.get((out_dim, in_dim), "weight")?;
        let b = vb.get(out_dim, "bias")?;
        self.linear_from(vb.prefix(), &w, Some(&b))
    }

    /// `candle_nn::linear_no_bias`'s layer.
    pub fn linear_no_bias(&self, in_dim: usize, out_dim: usize, vb: candle_nn::VarBuilder) -> Result<Linear> {
        let w = vb.get((out_dim, in_dim), "weight")?;
        self.linear_from(vb.prefix(), &w, None)
    }

    /// A layer of `weight` (`[out, in]`, as `candle_nn::Linear::new` takes it) and `bias`;
    /// `name` is said in its errors and logs.
    pub fn linear_from(&self, name: impl Into<String>, weight: &Tensor, bias: Option<&Tensor>) -> Result<Linear> {
        let name = name.into();
        let lin = shadow_linear(&name, weight, bias)?;
        Ok(Linear { inner: self.group(name, vec![lin])? })
    }

    /// Linears that read the same input, computed by one graph (see the [module](self)): for
    /// each `(name, out_dim)`, `candle_nn::linear`'s layer at `vb.pp(name)` (with a bias when
    /// `bias`), as `[q, k, v] = ["q_proj", "k_proj", "v_proj"]` of a block.
    pub fn linears(&self, in_dim: usize, outs: &[(&str, usize)], bias: bool, vb: candle_nn::VarBuilder) -> Result<Linears> {
        let lins = outs
            .iter()
            .map(|&(name, out_dim)| {
                let vb = vb.pp(name);
                let w = vb.get((out_dim, in_dim), "weight")?;
                let b = bias.then(|| vb.get(out_dim, "bias")).transpose()?;
                shadow_linear(&vb.prefix(), &w, b.as_ref())
            })
            .collect::<Result<Vec<_>>>()?;
        let name = format!("{}.[{}]", vb.prefix(), outs.iter().map(|o| o.0).collect::<Vec<_>>().join(","));
        Ok(Linears { inner: self.group(name, lins)? })
    }

    /// Several linears of one input as one layer of this `Npu`.
    fn group(&self, name: String, lins: Vec<ShadowLinear>) -> Result<Arc<Inner>> {
        let k = lins.first().map(|l| l.dims().1).ok_or_else(|| Error::Input(format!("NPU layers {name}: none given")))?;
        if let Some(l) = lins.iter().find(|l| l.dims().1 != k) {
            return Err(Error::Input(format!("NPU layers {name}: {} takes {} inputs, the first {k}: one input feeds them all", l.name(), l.dims().1)));
        }
        let n = lins.iter().map(|l| l.dims().0).collect();
        let inner = Arc::new(Inner {
            name,
            n,
            k,
            shared: self.shared.clone(),
            state: Mutex::new(State { report: LayerReport::default(), lins, seen: Calibrator::default(), frozen: None }),
        });
        self.shared.layers.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::downgrade(&inner));
        Ok(inner)
    }

    /// Ends calibration: each layer made through this `Npu` (and still alive) takes the clip
    /// range `clip` chooses from what it observed, and its hot channels; from now on the layers
    /// run on the device. A layer that observed nothing is an error naming it, and no layer is
    /// changed then. Freezing again recalibrates from everything observed so far.
    pub fn freeze(&self, clip: ClipMethod) -> Result<()> {
        clip.check()?;
        let layers: Vec<Arc<Inner>> = self.shared.layers.lock().unwrap_or_else(|e| e.into_inner()).iter().filter_map(Weak::upgrade).collect();
        let mut states: Vec<_> = layers.iter().map(|l| l.state.lock().unwrap_or_else(|e| e.into_inner())).collect();
        if let Some(l) = layers.iter().zip(&states).find(|(_, s)| s.seen.tokens_seen == 0).map(|(l, _)| l) {
            return Err(Error::Input(format!("NPU layer {}: observed no input before freeze: run the model on sample inputs first", l.name)));
        }
        // Every layer's ranges checked before any layer changes (an infinite sample value under
        // MinMax would give an infinite range: every output NaN).
        let profiles: Vec<_> = layers.iter().zip(&states).map(|(l, s)| s.seen.finish(l.name.clone(), clip)).collect();
        for (l, p) in layers.iter().zip(&profiles) {
            p.validate().map_err(|why| Error::Input(format!("NPU layer {}: what it observed gives no usable range: {why}", l.name)))?;
        }
        for ((l, s), profile) in layers.iter().zip(states.iter_mut()).zip(&profiles) {
            let p = profile.point(&l.name)?;
            for lin in &mut s.lins {
                lin.set_hot(&p.hot)?;
            }
            tracing::debug!(layer = %l.name, lo = p.lo, hi = p.hi, hot = p.hot.len(), rows = s.seen.tokens_seen, "NPU layer frozen");
            s.frozen = Some(Frozen { point: InputPoint::new(l.name.clone(), p.lo, p.hi, l.k, &p.hot), graphs: HashMap::new() });
        }
        tracing::info!(layers = layers.len(), "NPU layers frozen: they run on the {} from now on", self.shared.device.executor_name());
        Ok(())
    }
}

/// A linear layer that observes (float, CPU) until its [`Npu`] is frozen, then runs W8A8 on the
/// NPU with shadow outliers: `x @ w^T + b` over the last dimension of `x`, as
/// `candle_nn::Linear`.
#[derive(Clone)]
pub struct Linear {
    inner: Arc<Inner>,
}

/// Linears that read the same input, made by [`Npu::linears`]: one graph computes them all.
/// [`Linears::forward`] gives their outputs in the order they were given.
#[derive(Clone)]
pub struct Linears {
    inner: Arc<Inner>,
}

impl Linears {
    /// `x @ w_i^T + b_i` for each linear, over the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        self.inner.run(x)
    }

    /// Whether they run on the NPU (their `Npu` was frozen), rather than observing.
    pub fn is_frozen(&self) -> bool {
        self.inner.is_frozen()
    }

    /// What their shared input point has seen on the NPU.
    pub fn stats(&self) -> Option<crate::PointStats> {
        self.inner.stats()
    }

    /// Where they ran and what came in that a caller should know (see [`LayerReport`]).
    pub fn report(&self) -> LayerReport {
        self.inner.report()
    }
}

/// What a layer met that its outputs do not show: each is also logged as a warning the first
/// time (through `tracing`, as the rest of the library's), and kept here for a program that
/// installs no subscriber.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerReport {
    /// Why the layer's graphs run on the host CPU, not the NPU (an op or shape the device's
    /// executor does not take), once one does.
    pub on_cpu: Option<String>,
    /// Inputs with a NaN or an infinite value, in rows. Such a row's outputs are NaN (as
    /// candle's float linear gives) observing or frozen, and observing leaves it out of the
    /// calibration.
    pub non_finite_rows: u64,
}

impl std::fmt::Debug for Linears {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "nn::Linears({} {:?} x {})", self.inner.name, self.inner.n, self.inner.k)
    }
}

/// A layer's linear: its float weight (observing computes exactly what candle's float linear
/// does: F32 decode weights) and its INT8 copy for the NPU.
fn shadow_linear(name: &str, weight: &Tensor, bias: Option<&Tensor>) -> Result<ShadowLinear> {
    weight.dims2().map_err(|e| Error::Input(format!("{name}: weight: {e}")))?;
    let bias = bias.map(|b| b.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()).transpose()?;
    let w = weight.to_dtype(candle_core::DType::F32)?.to_device(&Device::Cpu)?;
    let source = Arc::new(InMemoryWeight::from_tensor(name.to_string(), &w)?);
    ShadowLinear::new(name.to_string(), source, bias, WeightQuant::PerChannel, DecodeWeights::F32)
}

/// One layer of an `Npu`: one input point, one linear or several reading it.
struct Inner {
    name: String,
    /// Each linear's outputs.
    n: Vec<usize>,
    k: usize,
    shared: Arc<Shared>,
    state: Mutex<State>,
}

struct State {
    report: LayerReport,
    lins: Vec<ShadowLinear>,
    /// What came in while observing (one point, this layer's name); `tokens_seen` counts rows.
    seen: Calibrator,
    frozen: Option<Frozen>,
}

struct Frozen {
    point: InputPoint,
    /// By row count.
    graphs: HashMap<usize, PreparedGraph>,
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "nn::Linear({} [{}, {}])", self.inner.name, self.inner.n[0], self.inner.k)
    }
}

impl Linear {
    /// Its name (the `VarBuilder` path, or the one given).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Whether it runs on the NPU (its `Npu` was frozen), rather than observing.
    pub fn is_frozen(&self) -> bool {
        self.inner.is_frozen()
    }

    /// What its input point has seen on the NPU: values, and those beyond the clip range.
    pub fn stats(&self) -> Option<crate::PointStats> {
        self.inner.stats()
    }

    /// Where it ran and what came in that a caller should know (see [`LayerReport`]).
    pub fn report(&self) -> LayerReport {
        self.inner.report()
    }
}

impl Inner {
    fn is_frozen(&self) -> bool {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).frozen.is_some()
    }

    fn stats(&self) -> Option<crate::PointStats> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).frozen.as_ref().map(|f| f.point.stats())
    }

    fn report(&self) -> LayerReport {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).report.clone()
    }

    /// Each linear's output for `x`: observing (float, CPU) or on the NPU.
    fn run(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let Inner { name, n, k, shared, state } = self;
        let dims = x.dims().to_vec();
        if dims.last() != Some(k) {
            return Err(Error::Input(format!("NPU layer {name}: input of shape {dims:?}, expected a last dimension of {k}")));
        }
        let rows = x.elem_count() / k;
        let x2 = x.to_device(&Device::Cpu)?.to_dtype(candle_core::DType::F32)?.reshape((rows, *k))?;
        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
        let values = x2.flatten_all()?.to_vec1::<f32>()?;
        // Rows holding a NaN or an infinity: said, counted, and NaN out (the NPU's u8 grid would
        // turn them into finite garbage).
        let bad: Vec<usize> = values.chunks(*k).enumerate().filter(|(_, r)| r.iter().any(|v| !v.is_finite())).map(|(i, _)| i).collect();
        if !bad.is_empty() {
            if s.report.non_finite_rows == 0 {
                tracing::warn!(layer = %name, rows = bad.len(), "NPU layer: inputs with NaN or infinite values; their outputs are NaN");
            }
            s.report.non_finite_rows += bad.len() as u64;
        }
        let ys: Vec<Tensor> = match &mut s.frozen {
            None => {
                if bad.is_empty() {
                    s.seen.observe(name, &values, *k);
                } else {
                    let finite: Vec<f32> =
                        values.chunks(*k).enumerate().filter(|(i, _)| bad.binary_search(i).is_err()).flat_map(|(_, r)| r.iter().copied()).collect();
                    s.seen.observe(name, &finite, *k);
                }
                s.seen.tokens_seen += rows - bad.len();
                s.lins.iter().map(|l| l.forward(&x2)).collect::<Result<_>>()?
            }
            Some(_) => {
                let mut outs: Vec<Vec<f32>> = n.iter().map(|n| Vec::with_capacity(rows * n)).collect();
                for chunk in values.chunks(shared.chunk_len * k) {
                    for (out, y) in outs.iter_mut().zip(npu_chunk(&mut s, name, *k, n, shared, chunk)?) {
                        out.extend(y);
                    }
                }
                for (out, &n) in outs.iter_mut().zip(n) {
                    bad.iter().for_each(|&r| out[r * n..(r + 1) * n].fill(f32::NAN));
                }
                outs.into_iter().zip(n).map(|(o, &n)| Tensor::from_vec(o, (rows, n), &Device::Cpu)).collect::<candle_core::Result<_>>()?
            }
        };
        ys.into_iter()
            .zip(n)
            .map(|(y, &n)| {
                let mut out_dims = dims.clone();
                *out_dims.last_mut().expect("checked above") = n;
                Ok(y.reshape(out_dims)?.to_dtype(x.dtype())?.to_device(x.device())?)
            })
            .collect()
    }
}

/// One chunk (`x`: `rows x k`, rows <= the chunk length) through the layer's graph of the
/// smallest size that holds it, padded; the outliers added back. Each linear's `rows x n_i`
/// outputs.
fn npu_chunk(s: &mut State, name: &str, k: usize, n: &[usize], shared: &Shared, x: &[f32]) -> Result<Vec<Vec<f32>>> {
    let rows = x.len() / k;
    let size = rows.next_power_of_two().clamp(MIN_GRAPH_ROWS.min(shared.chunk_len), shared.chunk_len.max(rows));
    let State { lins, frozen, report, .. } = s;
    let f = frozen.as_mut().expect("frozen");
    if !f.graphs.contains_key(&size) {
        let mut g = Graph::new(format!("{name}.m{size}"));
        let xi = g.input("x", &[size, k], DType::U8, Some(f.point.quant));
        for lin in lins.iter() {
            let y = lin.add_to_graph(&mut g, "", xi)?;
            g.mark_output(y);
        }
        let prepared = shared.device.prepare(&g)?;
        if let (None, Some(why)) = (&report.on_cpu, prepared.fallback()) {
            report.on_cpu = Some(format!("graph {}: {why}", prepared.name()));
        }
        lins.iter().for_each(|l| l.attach_packed(&prepared));
        f.graphs.insert(size, prepared);
    }
    let mut padded = x.to_vec();
    padded.resize(size * k, 0.0);
    let (q, outliers) = f.point.quantize(&padded, rows);
    let outs = f.graphs[&size].execute(&[&TensorData::U8(q)])?;
    if outs.len() != lins.len() {
        return Err(Error::Internal(format!("NPU layer {name}: its graph gave {} outputs for {} linears", outs.len(), lins.len())));
    }
    outs.into_iter()
        .zip(lins.iter())
        .zip(n)
        .map(|((out, lin), &n)| {
            let TensorData::F32(mut y) = out else {
                return Err(Error::Internal(format!("NPU layer {name}: its graph gave no F32 output for {}", lin.name())));
            };
            lin.finish(&outliers, &mut y)?;
            y.truncate(rows * n);
            Ok(y)
        })
        .collect()
}

impl candle_core::Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut ys = self.inner.run(x).map_err(candle_core::Error::wrap)?;
        Ok(ys.remove(0))
    }
}
