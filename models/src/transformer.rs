//! The decoder engine shared by every family: chunked prefill with the linear layers and FFN on
//! an [`NpuDevice`], attention on the CPU, and token-by-token decode on candle CPU ops over the KV
//! cache that prefill filled. A family file only turns its checkpoint into [`Config`] + [`Weights`].
//!
//! One layer of prefill, per chunk, as stages. Every NPU stage is one static graph of the
//! linears that share an input (prepared once per chunk length, shared by every chunk); every
//! NPU output returns to the CPU, where its shadow outliers are added:
//!
//! ```text
//! CPU  rmsnorm; quantize + extract outliers   (point blk.L.attn_in)
//! NPU  Q, K, V                                graph blk.L.qkv
//! CPU  shadow + bias; RoPE, append KV, attention over chunks 0..=i;
//!      quantize + extract                     (point blk.L.attn_out)
//! NPU  O                                      graph blk.L.o
//! CPU  shadow; residual, rmsnorm; quantize + extract (point blk.L.ffn_in)
//! NPU  gate, up                               graph blk.L.gate_up
//! CPU  shadow; SiLU(gate) * up; quantize + extract (point blk.L.ffn_down_in)
//! NPU  down                                   graph blk.L.down
//! CPU  shadow; residual
//! ```
//!
//! Every linear is a [`ShadowLinear`]: the NPU runs it on its input clipped to the point's
//! calibrated range; the part beyond, in a few channels, is multiplied in float on the CPU and
//! added to the NPU's output. The FFN is two graphs because the shadow of gate and up must be
//! added *before* the SiLU: one FFN graph with SiLU inside would apply the nonlinearity to the
//! clipped products. (Recomputing the down input's hot channels on the CPU from the FFN input
//! would keep one graph but cannot see outliers in channels that were cold in calibration, and
//! still leaves gate/up without a shadow.) The CPU half of the FFN is one elementwise pass.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType as CDType, Device, Module, Tensor, D};
use candle_npu::{
    Calibrator, ChunkPlan, ColumnSource, DType, DecodeWeights, Error, Graph, InputPoint, NpuDevice, Outliers, PointStats, PreparedGraph,
    Quant, QuantProfile, Result, ShadowLinear, TensorData, TensorId, WeightQuant,
};

/// Shape and numerics of a decoder-only transformer.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub n_layer: usize,
    pub hidden: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub rms_eps: f64,
    pub rope_theta: f32,
    pub context_len: usize,
}

/// Arithmetic of the NPU stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    /// F32 FullyConnected, no quantization: proves chunking exact, and drives calibration.
    F32,
    /// INT8 weights, u8 activations per tensor over calibrated clip ranges, shadow outliers.
    W8A8,
    /// INT8 weights, u16 activations per tensor over the full calibrated range, no shadow: what
    /// vendor stacks run on the HTP today; the comparison row for shadow W8A8.
    W8A16,
}

/// Float weights of one decoder layer; matrices are `[out, in]`.
pub struct LayerWeights {
    pub attn_norm: Tensor,
    pub ffn_norm: Tensor,
    pub wq: Tensor,
    pub wk: Tensor,
    pub wv: Tensor,
    pub wo: Tensor,
    pub w_gate: Tensor,
    pub w_up: Tensor,
    pub w_down: Tensor,
    /// QKV biases (Qwen2); `None` for Llama.
    pub bq: Option<Tensor>,
    pub bk: Option<Tensor>,
    pub bv: Option<Tensor>,
}

/// Reads the float columns of a linear (by its name, e.g. `blk.3.ffn_down`) from the checkpoint:
/// the shadow path's source for cold channels.
pub type ColumnSources = Arc<dyn Fn(&str) -> Result<Arc<dyn ColumnSource>> + Send + Sync>;

pub struct Weights {
    pub embed: Tensor,
    pub final_norm: Tensor,
    /// `[vocab, hidden]`; the embedding itself for tied models.
    pub lm_head: Tensor,
    pub layers: Vec<LayerWeights>,
    pub columns: Option<ColumnSources>,
}

/// How to load a model.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub precision: Precision,
    pub decode_weights: DecodeWeights,
    pub weights: WeightQuant,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { precision: Precision::W8A8, decode_weights: DecodeWeights::Q8_0, weights: WeightQuant::PerChannel }
    }
}

/// The quantization points of a layer (each the input of one NPU stage), in stage order.
pub const POINTS: [&str; 4] = ["attn_in", "attn_out", "ffn_in", "ffn_down_in"];

/// Name of an activation quantization point.
pub fn point(layer: usize, which: &str) -> String {
    format!("blk.{layer}.{which}")
}

/// One decoder layer: norms and the seven linears, grouped by the NPU stage that runs them.
struct Layer {
    attn_norm: Tensor,
    ffn_norm: Tensor,
    /// q, k, v | o | gate, up | down: the linears of stage `s` read point `POINTS[s]`.
    stages: [Vec<ShadowLinear>; 4],
}

impl Layer {
    fn linears(&self) -> impl Iterator<Item = &ShadowLinear> {
        self.stages.iter().flatten()
    }
}

/// A loaded model: NPU prefill + CPU decode.
pub struct Model {
    cfg: Config,
    /// Identifies the weights (sha256 of the checkpoint) for quant profiles and graph caches.
    model_id: String,
    device: NpuDevice,
    precision: Precision,
    embed: Tensor,
    final_norm: Tensor,
    lm_head: QMatMul,
    layers: Vec<Layer>,
    profile: Option<QuantProfile>,
    /// Per layer, per stage: the input point (from the profile).
    points: Vec<[InputPoint; 4]>,
    /// Per layer: whether its shadow path runs (see [`Model::set_shadow_layers`]).
    shadow_on: Vec<bool>,
    /// Per layer, per stage: the u16 quantization over the observed range (W8A16).
    a16: Vec<[Quant; 4]>,
    graphs: HashMap<(usize, Precision), Arc<Vec<Vec<PreparedGraph>>>>,
    kv: Vec<Option<(Tensor, Tensor)>>,
    pos: usize,
    progress: Option<Progress>,
    /// CPU time of the shadow path (outlier extraction and the float product) since the last
    /// [`Model::take_shadow_time`].
    shadow_time: std::time::Duration,
}

/// Called after every (chunk, layer) of a prefill with (done, total).
pub type Progress = Box<dyn FnMut(usize, usize) + Send>;

const STAGE_NAMES: [&str; 4] = ["qkv", "o", "gate_up", "down"];

impl Model {
    pub fn new(cfg: Config, w: Weights, model_id: String, device: NpuDevice, opts: LoadOptions) -> Result<Self> {
        let columns = w.columns.clone();
        let lin = |l: usize, name: &str, t: &Tensor, b: Option<&Tensor>| -> Result<ShadowLinear> {
            let name = format!("blk.{l}.{name}");
            let cold = columns.as_ref().map(|f| f(&name)).transpose()?;
            ShadowLinear::new(name, t.clone(), b, opts.weights, opts.decode_weights, cold)
        };
        let layers = w
            .layers
            .iter()
            .enumerate()
            .map(|(l, lw)| {
                Ok(Layer {
                    attn_norm: lw.attn_norm.clone(),
                    ffn_norm: lw.ffn_norm.clone(),
                    stages: [
                        vec![
                            lin(l, "attn_q", &lw.wq, lw.bq.as_ref())?,
                            lin(l, "attn_k", &lw.wk, lw.bk.as_ref())?,
                            lin(l, "attn_v", &lw.wv, lw.bv.as_ref())?,
                        ],
                        vec![lin(l, "attn_output", &lw.wo, None)?],
                        vec![lin(l, "ffn_gate", &lw.w_gate, None)?, lin(l, "ffn_up", &lw.w_up, None)?],
                        vec![lin(l, "ffn_down", &lw.w_down, None)?],
                    ],
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let lm_head = match opts.decode_weights {
            DecodeWeights::F32 => QMatMul::Tensor(w.lm_head.clone()),
            DecodeWeights::Q8_0 => QMatMul::from_qtensor(QTensor::quantize(&w.lm_head, GgmlDType::Q8_0)?)?,
        };
        let n = cfg.n_layer;
        Ok(Model {
            cfg,
            model_id,
            device,
            precision: opts.precision,
            embed: w.embed,
            final_norm: w.final_norm,
            lm_head,
            layers,
            profile: None,
            points: vec![],
            a16: vec![],
            shadow_on: vec![],
            shadow_time: std::time::Duration::ZERO,
            graphs: HashMap::new(),
            kv: vec![None; n],
            pos: 0,
            progress: None,
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }
    pub fn model_id(&self) -> &str {
        &self.model_id
    }
    pub fn device(&self) -> &NpuDevice {
        &self.device
    }
    pub fn precision(&self) -> Precision {
        self.precision
    }
    /// Tokens in the KV cache.
    pub fn position(&self) -> usize {
        self.pos
    }
    pub fn profile(&self) -> Option<&QuantProfile> {
        self.profile.as_ref()
    }
    /// Every linear layer, in layer and stage order.
    pub fn linears(&self) -> impl Iterator<Item = &ShadowLinear> {
        self.layers.iter().flat_map(Layer::linears)
    }

    /// Use a calibrated profile for W8A8 prefill (it must belong to this model's weights): its
    /// clip ranges become the NPU inputs' quantization, its hot channels the float columns each
    /// linear keeps. Every shadow path is on; see [`Model::prune_shadow`].
    pub fn set_profile(&mut self, profile: QuantProfile) -> Result<()> {
        if profile.model_id != self.model_id {
            return Err(Error::Input(format!(
                "quant profile was calibrated for model {}, this model is {}",
                profile.model_id, self.model_id
            )));
        }
        let mut a16 = Vec::with_capacity(self.layers.len());
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let mut row16 = [Quant::symmetric(1.0); 4];
            for (s, lins) in layer.stages.iter_mut().enumerate() {
                let name = point(l, POINTS[s]);
                let p = profile.point(&name)?;
                let k = lins[0].dims().1;
                if p.channels != k {
                    return Err(Error::Input(format!("quant profile point {name} has {} channels, the model {k}", p.channels)));
                }
                for lin in lins.iter_mut() {
                    lin.set_hot(&p.hot)?;
                }
                row16[s] = Quant::u16_range(p.min, p.max);
            }
            a16.push(row16);
        }
        self.graphs.retain(|k, _| k.1 == Precision::F32);
        self.a16 = a16;
        self.profile = Some(profile);
        self.points.clear();
        self.shadow_on.clear();
        self.set_shadow_layers(&vec![true; self.layers.len()])
    }

    /// Run the shadow path of the layers where `on[l]` and prune it elsewhere. A pruned layer's
    /// NPU inputs go back to their full calibrated range (min/max): with no shadow path to add
    /// the remainder back, the tight clip range would drop it (measured on SmolLM2: keeping the
    /// tight ranges and pruning half the layers raised perplexity 57x).
    pub fn set_shadow_layers(&mut self, on: &[bool]) -> Result<()> {
        if on.len() != self.layers.len() {
            return Err(Error::Input(format!("shadow mask of {} layers for a model of {}", on.len(), self.layers.len())));
        }
        for (layer, &on) in self.layers.iter_mut().zip(on) {
            layer.stages.iter_mut().flatten().for_each(|lin| lin.set_shadow(on));
        }
        let Some(profile) = &self.profile else {
            self.shadow_on = on.to_vec();
            return Ok(());
        };
        let mut changed = false;
        for (l, &on) in on.iter().enumerate() {
            if self.shadow_on.get(l) == Some(&on) && self.points.len() > l {
                continue;
            }
            let row = (0..4)
                .map(|s| {
                    let name = point(l, POINTS[s]);
                    let p = profile.point(&name)?;
                    Ok(match on {
                        true => InputPoint::new(name, p.lo, p.hi, p.channels, &p.hot),
                        false => InputPoint::new(name, p.min, p.max, p.channels, &[]),
                    })
                })
                .collect::<Result<Vec<_>>>()?
                .try_into()
                .expect("four points");
            match self.points.get_mut(l) {
                Some(r) => *r = row,
                None => self.points.push(row),
            }
            changed = true;
        }
        self.shadow_on = on.to_vec();
        if changed {
            // The NPU inputs' quantization is part of the stage graphs.
            self.graphs.retain(|k, _| k.1 != Precision::W8A8);
        }
        Ok(())
    }

    /// Prune the shadow path of the `rate` share (0..=1) of layers with the lowest measured
    /// importance (from the profile); returns the layers kept.
    pub fn prune_shadow(&mut self, rate: f64) -> Result<Vec<bool>> {
        if !(0.0..=1.0).contains(&rate) {
            return Err(Error::Input(format!("pruning rate {rate} is not within 0..=1")));
        }
        let n = self.layers.len();
        let imp = match &self.profile {
            Some(p) if p.importance.len() == n => p.importance.clone(),
            _ if rate == 0.0 => vec![0.0; n],
            _ => return Err(Error::Input("pruning needs layer importance in the quant profile: measure it (Pipeline::ensure_profile does)".into())),
        };
        let pruned = (rate * n as f64).round() as usize;
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| imp[a].total_cmp(&imp[b]));
        let mut on = vec![true; n];
        order.iter().take(pruned).for_each(|&l| on[l] = false);
        self.set_shadow_layers(&on)?;
        Ok(on)
    }

    /// Outlier statistics of every quantization point since the profile was set (or reset).
    pub fn point_stats(&self) -> Vec<(String, PointStats)> {
        self.points.iter().flatten().map(|p| (p.name.clone(), p.stats())).collect()
    }
    /// The CPU time the shadow path took since the last call (its share of prefill time).
    pub fn take_shadow_time(&mut self) -> std::time::Duration {
        std::mem::take(&mut self.shadow_time)
    }

    pub fn reset_point_stats(&self) {
        self.points.iter().flatten().for_each(InputPoint::reset_stats);
    }

    /// Forget the KV cache.
    pub fn clear(&mut self) {
        self.kv.iter_mut().for_each(|kv| *kv = None);
        self.pos = 0;
    }

    /// Run `f` with the host executor as this model's device and fresh graphs, then restore both.
    /// Offline passes (calibration, importance) always run here: an HTP computes float graphs
    /// in FP16, and its x86 emulator would take hours for them.
    fn on_host<R>(&mut self, f: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        let device = std::mem::replace(&mut self.device, NpuDevice::host());
        let graphs = std::mem::take(&mut self.graphs);
        let r = f(self);
        self.device = device;
        self.graphs = graphs;
        self.clear();
        r
    }

    /// Collect activation statistics by running float prefill over `sequences` (on the host
    /// executor, whatever the model's device). `progress` is called after each sequence.
    pub fn calibrate(&mut self, sequences: &[Vec<u32>], chunk_len: usize, mut progress: impl FnMut(usize)) -> Result<Calibrator> {
        self.on_host(|m| {
            let mut cal = Calibrator::default();
            for (i, seq) in sequences.iter().enumerate() {
                m.run_prefill(seq, chunk_len, Precision::F32, false, Some(&mut cal))?;
                cal.tokens_seen += seq.len();
                progress(i + 1);
            }
            Ok(cal)
        })
    }

    /// Per layer, the increase of the mean negative log-likelihood (nats/token) over `sequences`
    /// when that layer's shadow path is pruned (its inputs back to min/max), all others on: what
    /// pruning it costs. Runs W8A8 prefill on the host executor (1 + layers passes); needs a
    /// profile, and stores the result in it (where [`Model::prune_shadow`] reads it).
    pub fn measure_importance(&mut self, sequences: &[Vec<u32>], chunk_len: usize, mut progress: impl FnMut(usize, usize)) -> Result<Vec<f32>> {
        let n = self.layers.len();
        let kept = self.shadow_on.clone();
        let r = self.on_host(|m| {
            let loss = |m: &mut Model, on: &[bool]| -> Result<f64> {
                m.set_shadow_layers(on)?;
                let mut total = 0.0;
                for seq in sequences {
                    let logits = m.run_prefill(seq, chunk_len, Precision::W8A8, true, None)?;
                    total += mean_nll(&logits, seq)?;
                }
                Ok(total / sequences.len() as f64)
            };
            let base = loss(m, &vec![true; n])?;
            progress(1, n + 1);
            let mut imp = Vec::with_capacity(n);
            for l in 0..n {
                let mut on = vec![true; n];
                on[l] = false;
                imp.push((loss(m, &on)? - base) as f32);
                progress(l + 2, n + 1);
            }
            Ok(imp)
        });
        self.set_shadow_layers(&kept)?;
        let imp = r?;
        if let Some(p) = self.profile.as_mut() {
            p.importance = imp.clone();
        }
        Ok(imp)
    }

    /// Outliers per input channel of every point over `sequences` (W8A8 on the host, every
    /// shadow path on): what [`QuantProfile::select_hot`] chooses the hot set from.
    pub fn count_channel_outliers(&mut self, sequences: &[Vec<u32>], chunk_len: usize, mut progress: impl FnMut(usize)) -> Result<Vec<(String, Vec<u64>)>> {
        let kept = self.shadow_on.clone();
        self.set_shadow_layers(&vec![true; self.layers.len()])?;
        self.reset_point_stats();
        let r = self.on_host(|m| {
            for (i, seq) in sequences.iter().enumerate() {
                m.run_prefill(seq, chunk_len, Precision::W8A8, false, None)?;
                progress(i + 1);
            }
            Ok(m.points.iter().flatten().map(|p| (p.name.clone(), p.channel_outliers())).collect())
        });
        self.reset_point_stats();
        self.set_shadow_layers(&kept)?;
        r
    }

    /// Report prefill progress (e.g. to a progress bar: an emulated NPU takes minutes).
    pub fn set_prefill_progress(&mut self, progress: Option<Progress>) {
        self.progress = progress;
    }

    /// Prepare the NPU stage graphs for `chunk_len` now (otherwise the first prefill does it).
    pub fn prepare(&mut self, chunk_len: usize) -> Result<()> {
        if chunk_len == 0 {
            return Err(Error::Input("chunk length 0: use a positive --chunk-len (e.g. 256)".into()));
        }
        self.check_profile(self.precision)?;
        self.graphs_for(chunk_len, self.precision).map(|_| ())
    }

    fn check_profile(&self, precision: Precision) -> Result<()> {
        if precision != Precision::F32 && self.profile.is_none() {
            return Err(Error::Input(format!("{precision:?} prefill needs a quant profile: calibrate or load one first")));
        }
        Ok(())
    }

    /// Prefill `tokens` (resetting the KV cache) and return the logits of the last token, `[vocab]`.
    pub fn prefill(&mut self, tokens: &[u32], chunk_len: usize) -> Result<Tensor> {
        let logits = self.run_prefill(tokens, chunk_len, self.precision, false, None)?;
        Ok(logits.squeeze(0)?)
    }

    /// Prefill and return the logits of every prompt position, `[len, vocab]` (for perplexity).
    pub fn prefill_all_logits(&mut self, tokens: &[u32], chunk_len: usize) -> Result<Tensor> {
        self.run_prefill(tokens, chunk_len, self.precision, true, None)
    }

    /// Decode one token at the current position; returns its logits, `[vocab]`.
    pub fn decode(&mut self, token: u32) -> Result<Tensor> {
        Ok(self.forward_cpu(&[token])?.squeeze(0)?)
    }

    /// Run `tokens` from the current position on the CPU (candle matmuls with the decode
    /// weights, no NPU graphs) and return the logits of every row, `[n, vocab]`. Decode is this
    /// with one token; a whole prompt this way is candle's own CPU prefill, the baseline the NPU
    /// path is measured against.
    pub fn forward_cpu(&mut self, tokens: &[u32]) -> Result<Tensor> {
        self.check_tokens(tokens)?;
        let n = tokens.len();
        if n == 0 || self.pos + n > self.cfg.context_len {
            return Err(Error::Input(format!("{n} tokens at position {} do not fit the context of {}", self.pos, self.cfg.context_len)));
        }
        let cfg = &self.cfg;
        let mut x = self.embed.index_select(&Tensor::new(tokens, &Device::Cpu)?, 0)?;
        let (cos, sin) = rope_tables(cfg, self.pos, n)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let [qkv, o, gate_up, down] = &layer.stages;
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, cfg.rms_eps as f32)?;
            let (q, k, v) = (qkv[0].forward(&h)?, qkv[1].forward(&h)?, qkv[2].forward(&h)?);
            let attn = attend(cfg, &mut self.kv[l], &q, &k, &v, n, n, self.pos, &cos, &sin)?;
            x = (x + o[0].forward(&attn)?)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, cfg.rms_eps as f32)?;
            let ff = (candle_nn::ops::silu(&gate_up[0].forward(&h)?)? * gate_up[1].forward(&h)?)?;
            x = (x + down[0].forward(&ff)?)?;
        }
        self.pos += n;
        self.logits(&x)
    }

    fn logits(&self, rows: &Tensor) -> Result<Tensor> {
        let h = candle_nn::ops::rms_norm(rows, &self.final_norm, self.cfg.rms_eps as f32)?;
        Ok(self.lm_head.forward(&h)?)
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        match tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            Some(t) => Err(Error::Input(format!("token id {t} is outside the vocabulary of {}", self.cfg.vocab))),
            None => Ok(()),
        }
    }

    fn run_prefill(
        &mut self,
        tokens: &[u32],
        chunk_len: usize,
        precision: Precision,
        all_logits: bool,
        mut calib: Option<&mut Calibrator>,
    ) -> Result<Tensor> {
        let plan = ChunkPlan::new(tokens.len(), chunk_len, self.cfg.context_len)?;
        self.check_tokens(tokens)?;
        self.check_profile(precision)?;
        self.clear();
        let graphs = self.graphs_for(chunk_len, precision)?;
        let cfg = self.cfg.clone();
        let mut out_rows = Vec::new();
        for chunk in &plan.chunks {
            let (m, n_valid) = (chunk.padded_len, chunk.len);
            let mut ids = tokens[chunk.start..chunk.start + n_valid].to_vec();
            ids.resize(m, 0);
            let mut x = self.embed.index_select(&Tensor::new(ids.as_slice(), &Device::Cpu)?, 0)?;
            let (cos, sin) = rope_tables(&cfg, chunk.start, m)?;
            for (l, g) in graphs.iter().enumerate() {
                let mut stage = Stage { model: self, l, n_valid, m, precision, calib: calib.as_deref_mut() };
                let h = candle_nn::ops::rms_norm(&x, &stage.model.layers[l].attn_norm, cfg.rms_eps as f32)?;
                let [q, k, v]: [Tensor; 3] = stage.run(0, &g[0], &h)?.try_into().expect("three linears");
                let attn = attend(&cfg, &mut stage.model.kv[l], &q, &k, &v, m, n_valid, chunk.start, &cos, &sin)?;
                x = (x + &stage.run(1, &g[1], &attn)?[0])?;
                let h = candle_nn::ops::rms_norm(&x, &stage.model.layers[l].ffn_norm, cfg.rms_eps as f32)?;
                let [gate, up]: [Tensor; 2] = stage.run(2, &g[2], &h)?.try_into().expect("two linears");
                let hidden = (candle_nn::ops::silu(&gate)? * up)?;
                x = (x + &stage.run(3, &g[3], &hidden)?[0])?;
                if let Some(report) = self.progress.as_mut() {
                    report(chunk.index * graphs.len() + l + 1, plan.chunks.len() * graphs.len());
                }
            }
            if all_logits {
                out_rows.push(x.narrow(0, 0, n_valid)?);
            } else if chunk.index + 1 == plan.chunks.len() {
                out_rows.push(x.narrow(0, n_valid - 1, 1)?);
            }
        }
        self.pos = tokens.len();
        let rows = Tensor::cat(&out_rows, 0)?;
        self.logits(&rows)
    }

    fn graphs_for(&mut self, chunk_len: usize, precision: Precision) -> Result<Arc<Vec<Vec<PreparedGraph>>>> {
        if let Some(g) = self.graphs.get(&(chunk_len, precision)) {
            return Ok(g.clone());
        }
        let t = std::time::Instant::now();
        let graphs = (0..self.cfg.n_layer)
            .map(|l| self.layer_graphs(l, chunk_len, precision)?.iter().map(|g| self.device.prepare(g)).collect::<Result<Vec<_>>>())
            .collect::<Result<Vec<_>>>()?;
        tracing::info!(chunk_len, ?precision, layers = graphs.len(), secs = t.elapsed().as_secs_f32(), executor = self.device.executor_name(), "prepared NPU stage graphs");
        let graphs = Arc::new(graphs);
        self.graphs.insert((chunk_len, precision), graphs.clone());
        Ok(graphs)
    }

    /// Describe the static NPU graphs of one layer for chunks of `m` rows: per stage, one input
    /// (F32, or u8 over the point's clip range) and one F32 output per linear.
    pub fn layer_graphs(&self, l: usize, m: usize, precision: Precision) -> Result<Vec<Graph>> {
        self.check_profile(precision)?;
        let layer = &self.layers[l];
        (0..4)
            .map(|s| {
                let lins = &layer.stages[s];
                let k = lins[0].dims().1;
                let mut g = Graph::new(format!("blk.{l}.{}.m{m}", STAGE_NAMES[s]));
                let x: TensorId = match precision {
                    Precision::F32 => g.input("x", &[m, k], DType::F32, None),
                    Precision::W8A8 => g.input("x", &[m, k], DType::U8, Some(self.points[l][s].quant)),
                    Precision::W8A16 => g.input("x", &[m, k], DType::U16, Some(self.a16[l][s])),
                };
                for lin in lins {
                    let y = lin.add_to_graph(&mut g, "", x)?;
                    g.mark_output(y);
                }
                Ok(g)
            })
            .collect()
    }

    /// NPU stage graphs per layer (the static, chunk-shared subgraphs).
    pub const NPU_STAGES_PER_LAYER: usize = 4;
}

/// One NPU stage of one layer of one chunk: its input goes to the NPU (quantized, outliers
/// extracted), its outputs come back with their shadow added.
struct Stage<'a, 'c> {
    model: &'a mut Model,
    l: usize,
    n_valid: usize,
    m: usize,
    precision: Precision,
    calib: Option<&'c mut Calibrator>,
}

impl Stage<'_, '_> {
    /// Run stage `s` on the CPU activation `h` (`[m, K]`); returns one `[m, N]` per linear.
    fn run(&mut self, s: usize, graph: &PreparedGraph, h: &Tensor) -> Result<Vec<Tensor>> {
        let vals = h.flatten_all()?.to_vec1::<f32>()?;
        let k = h.dim(1)?;
        if let Some(cal) = self.calib.as_deref_mut() {
            cal.observe(&point(self.l, POINTS[s]), &vals[..self.n_valid * k], k);
        }
        let (input, outliers) = match self.precision {
            Precision::F32 => (TensorData::F32(vals), Outliers::default()),
            Precision::W8A8 => {
                let point = &self.model.points[self.l][s];
                let t = Instant::now();
                // A pruned stage skips extraction (its outliers would go unused).
                let o = if self.model.shadow_on[self.l] { point.extract(&vals, self.n_valid) } else { Outliers::default() };
                self.model.shadow_time += t.elapsed();
                (TensorData::U8(point.clip_quantize(&vals)), o)
            }
            Precision::W8A16 => (TensorData::from_f32(&vals, DType::U16, Some(self.model.a16[self.l][s])), Outliers::default()),
        };
        let outs = graph.execute(&[&input])?;
        let t = Instant::now();
        let ys = self.model.layers[self.l].stages[s]
            .iter()
            .zip(outs)
            .map(|(lin, out)| {
                let TensorData::F32(mut y) = out else {
                    return Err(Error::Input(format!("NPU stage of {} returned {:?}, expected F32", lin.name(), out.dtype())));
                };
                lin.finish(&outliers, &mut y)?;
                Ok(Tensor::from_vec(y, (self.m, lin.dims().0), &Device::Cpu)?)
            })
            .collect();
        if !outliers.is_empty() {
            self.model.shadow_time += t.elapsed();
        }
        ys
    }
}

/// Mean negative log-likelihood (nats/token) of `tokens` under row-aligned logits
/// (`logits[i]` predicts `tokens[i + 1]`); `exp` of it is the perplexity.
pub fn mean_nll(logits: &Tensor, tokens: &[u32]) -> Result<f64> {
    let lp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let lp: Vec<Vec<f32>> = lp.to_vec2()?;
    if tokens.len() < 2 || lp.len() < tokens.len() - 1 {
        return Err(Error::Input(format!("need at least 2 tokens and one logit row per token, got {} and {}", tokens.len(), lp.len())));
    }
    let nll: f64 = (0..tokens.len() - 1).map(|i| -lp[i][tokens[i + 1] as usize] as f64).sum();
    Ok(nll / (tokens.len() - 1) as f64)
}

/// RoPE on `q`/`k` (`[m, heads*head_dim]`), append the first `n_valid` rows of k, v to the
/// `cache`, and attend causally from positions `start..start+m`. Returns `[m, hidden]`.
#[allow(clippy::too_many_arguments)]
fn attend(c: &Config, cache: &mut Option<(Tensor, Tensor)>, q: &Tensor, k: &Tensor, v: &Tensor, m: usize, n_valid: usize, start: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (nh, nkv, hd) = (c.n_head, c.n_kv_head, c.head_dim);
    let heads = |t: &Tensor, n: usize| -> Result<Tensor> { Ok(t.reshape((m, n, hd))?.transpose(0, 1)?.contiguous()?.unsqueeze(0)?) };
    let q = candle_nn::rotary_emb::rope_i(&heads(q, nh)?, cos, sin)?.squeeze(0)?;
    let k = candle_nn::rotary_emb::rope_i(&heads(k, nkv)?, cos, sin)?.squeeze(0)?;
    let v = heads(v, nkv)?.squeeze(0)?;
    let (k, v) = (k.narrow(1, 0, n_valid)?, v.narrow(1, 0, n_valid)?);
    let (k, v) = match cache.take() {
        Some((kc, vc)) => (Tensor::cat(&[&kc, &k], 1)?, Tensor::cat(&[&vc, &v], 1)?),
        None => (k, v),
    };
    *cache = Some((k.clone(), v.clone()));
    let t = k.dim(1)?;
    // Grouped-query attention without copying K/V: fold each KV head's query heads into rows.
    let groups = nh / nkv;
    let qg = q.reshape((nkv, groups * m, hd))?;
    let scores = (qg.matmul(&k.t()?)? / (hd as f64).sqrt())?;
    let mask: Vec<f32> = (0..groups * m)
        .flat_map(|r| {
            let pos = start + r % m;
            (0..t).map(move |j| if j <= pos { 0.0 } else { f32::NEG_INFINITY })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (groups * m, t), &Device::Cpu)?;
    let p = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    let y = p.matmul(&v)?; // [nkv, groups*m, hd]
    Ok(y.reshape((nh, m, hd))?.transpose(0, 1)?.reshape((m, nh * hd))?)
}

/// cos/sin of RoPE for positions `start..start+n`, `[n, head_dim/2]`, computed as candle's
/// llama does (f32 inverse frequencies, f32 products).
fn rope_tables(c: &Config, start: usize, n: usize) -> Result<(Tensor, Tensor)> {
    let half = c.head_dim / 2;
    let inv: Vec<f32> = (0..c.head_dim).step_by(2).map(|i| 1f32 / c.rope_theta.powf(i as f32 / c.head_dim as f32)).collect();
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for p in start..start + n {
        for &f in &inv {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    let dev = &Device::Cpu;
    Ok((Tensor::from_vec(cos, (n, half), dev)?, Tensor::from_vec(sin, (n, half), dev)?))
}

/// Greedy or sampled next token from logits (candle's `LogitsProcessor` conventions).
pub fn logits_f32(logits: &Tensor) -> Result<Vec<f32>> {
    Ok(logits.to_dtype(CDType::F32)?.flatten_all()?.to_vec1()?)
}

/// Top-1 token.
pub fn argmax(logits: &Tensor) -> Result<u32> {
    Ok(logits.argmax(D::Minus1)?.to_scalar::<u32>()?)
}
