//! The decoder engine shared by every family: chunked prefill with the linear layers and FFN on
//! an [`NpuDevice`], attention on the CPU, and token-by-token decode on candle CPU ops over the KV
//! cache that prefill filled. A family file only turns its checkpoint into [`Config`] + [`Weights`].
//!
//! One layer of prefill, per chunk, as stages (NPU stages are static graphs, prepared once per
//! chunk length and shared by every chunk):
//!
//! ```text
//! CPU  rmsnorm + quantize          (point blk.L.attn_in)
//! NPU  Q, K, V FullyConnected       graph blk.L.qkv
//! CPU  RoPE, append KV, attention over chunks 0..=i, quantize (point blk.L.attn_out)
//! NPU  O FullyConnected             graph blk.L.o
//! CPU  residual, rmsnorm, quantize (point blk.L.ffn_in)
//! NPU  gate, up, SiLU = Sigmoid*Mul, *up, quantize (point blk.L.ffn_down_in), down   graph blk.L.ffn
//! CPU  residual
//! ```

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType as CDType, Device, Module, Tensor, D};
use candle_npu::graph::TensorKind;
use candle_npu::quant::{quantize_u8, quantize_weight_i8};
use candle_npu::{Calibrator, ChunkPlan, DType, Error, Graph, NpuDevice, Op, PreparedGraph, Quant, QuantProfile, Result, StaticData, TensorData, TensorId};

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
    /// Per-tensor INT8 weights and u8 activations (calibrated ranges).
    W8A8,
}

/// Weight format of the CPU decode path. Measured on the 2-core x86 build machine with candle's
/// CPU kernels for SmolLM2-135M (issue 2): Q4_1 24 tok/s (scalar path), F32 32 tok/s, Q8_0
/// 67 tok/s, so Q8_0 is the default; F32 exists to compare bit-for-bit with a float reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeWeights {
    F32,
    Q8_0,
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

pub struct Weights {
    pub embed: Tensor,
    pub final_norm: Tensor,
    /// `[vocab, hidden]`; the embedding itself for tied models.
    pub lm_head: Tensor,
    pub layers: Vec<LayerWeights>,
}

/// How to load a model.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub precision: Precision,
    pub decode_weights: DecodeWeights,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { precision: Precision::W8A8, decode_weights: DecodeWeights::Q8_0 }
    }
}

struct LayerGraphs {
    qkv: PreparedGraph,
    o: PreparedGraph,
    ffn: PreparedGraph,
}

struct DecodeLayer {
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    wo: QMatMul,
    w_gate: QMatMul,
    w_up: QMatMul,
    w_down: QMatMul,
}

/// A loaded model: NPU prefill + CPU decode.
pub struct Model {
    cfg: Config,
    /// Identifies the weights (sha256 of the checkpoint) for quant profiles and graph caches.
    model_id: String,
    device: NpuDevice,
    precision: Precision,
    w: Weights,
    decode: Vec<DecodeLayer>,
    lm_head: QMatMul,
    profile: Option<QuantProfile>,
    graphs: HashMap<(usize, Precision), Arc<Vec<LayerGraphs>>>,
    kv: Vec<Option<(Tensor, Tensor)>>,
    pos: usize,
    progress: Option<Progress>,
}

/// Called after every (chunk, layer) of a prefill with (done, total).
pub type Progress = Box<dyn FnMut(usize, usize) + Send>;

/// Name of an activation quantization point.
pub fn point(layer: usize, which: &str) -> String {
    format!("blk.{layer}.{which}")
}

fn qmatmul(w: &Tensor, format: DecodeWeights) -> Result<QMatMul> {
    Ok(match format {
        DecodeWeights::F32 => QMatMul::Tensor(w.clone()),
        DecodeWeights::Q8_0 => QMatMul::from_qtensor(QTensor::quantize(w, GgmlDType::Q8_0)?)?,
    })
}

impl Model {
    pub fn new(cfg: Config, w: Weights, model_id: String, device: NpuDevice, opts: LoadOptions) -> Result<Self> {
        let decode = w
            .layers
            .iter()
            .map(|l| {
                let f = |t: &Tensor| qmatmul(t, opts.decode_weights);
                Ok(DecodeLayer {
                    wq: f(&l.wq)?,
                    wk: f(&l.wk)?,
                    wv: f(&l.wv)?,
                    wo: f(&l.wo)?,
                    w_gate: f(&l.w_gate)?,
                    w_up: f(&l.w_up)?,
                    w_down: f(&l.w_down)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let lm_head = qmatmul(&w.lm_head, opts.decode_weights)?;
        let n = cfg.n_layer;
        Ok(Model {
            cfg,
            model_id,
            device,
            precision: opts.precision,
            w,
            decode,
            lm_head,
            profile: None,
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

    /// Use a calibrated profile for W8A8 prefill (it must belong to this model's weights).
    pub fn set_profile(&mut self, profile: QuantProfile) -> Result<()> {
        if profile.model_id != self.model_id {
            return Err(Error::Input(format!(
                "quant profile was calibrated for model {}, this model is {}",
                profile.model_id, self.model_id
            )));
        }
        self.graphs.retain(|k, _| k.1 != Precision::W8A8);
        self.profile = Some(profile);
        Ok(())
    }

    /// Forget the KV cache.
    pub fn clear(&mut self) {
        self.kv.iter_mut().for_each(|kv| *kv = None);
        self.pos = 0;
    }

    /// Calibrate activation ranges by running float prefill over `sequences`.
    /// `progress` is called after each sequence.
    ///
    /// Calibration always runs on the host executor, whatever the model's device: it is the
    /// offline float reference pass (an HTP computes float graphs in FP16, and its x86 emulator
    /// would take hours for it). Its host graphs are dropped afterwards.
    pub fn calibrate(&mut self, sequences: &[Vec<u32>], chunk_len: usize, mut progress: impl FnMut(usize)) -> Result<QuantProfile> {
        let mut cal = Calibrator::default();
        // Host device and host graphs for the pass; the model's own device and graphs (which
        // may include float graphs prepared on the NPU) are put back afterwards.
        let device = std::mem::replace(&mut self.device, NpuDevice::host());
        let graphs = std::mem::take(&mut self.graphs);
        let run = sequences.iter().enumerate().try_for_each(|(i, seq)| {
            self.run_prefill(seq, chunk_len, Precision::F32, false, Some(&mut cal))?;
            cal.tokens_seen += seq.len();
            progress(i + 1);
            Ok::<_, Error>(())
        });
        self.device = device;
        self.graphs = graphs;
        self.clear();
        run?;
        Ok(cal.finish(self.model_id.clone()))
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
        if self.precision == Precision::W8A8 && self.profile.is_none() {
            return Err(Error::Input("W8A8 prefill needs a quant profile: calibrate or load one first".into()));
        }
        self.graphs_for(chunk_len, self.precision).map(|_| ())
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
        self.check_tokens(&[token])?;
        if self.pos >= self.cfg.context_len {
            return Err(Error::Input(format!("context of {} tokens is full", self.cfg.context_len)));
        }
        let cfg = &self.cfg;
        let mut x = self.w.embed.index_select(&Tensor::new(&[token], &Device::Cpu)?, 0)?;
        let (cos, sin) = rope_tables(cfg, self.pos, 1)?;
        for l in 0..cfg.n_layer {
            let (lw, d) = (&self.w.layers[l], &self.decode[l]);
            let h = candle_nn::ops::rms_norm(&x, &lw.attn_norm, cfg.rms_eps as f32)?;
            let q = add_bias(d.wq.forward(&h)?, &lw.bq)?;
            let k = add_bias(d.wk.forward(&h)?, &lw.bk)?;
            let v = add_bias(d.wv.forward(&h)?, &lw.bv)?;
            let attn = attend(cfg, &mut self.kv[l], &q, &k, &v, 1, 1, self.pos, &cos, &sin)?;
            x = (x + d.wo.forward(&attn)?)?;
            let h = candle_nn::ops::rms_norm(&x, &lw.ffn_norm, cfg.rms_eps as f32)?;
            let ff = (candle_nn::ops::silu(&d.w_gate.forward(&h)?)? * d.w_up.forward(&h)?)?;
            x = (x + d.w_down.forward(&ff)?)?;
        }
        self.pos += 1;
        Ok(self.logits(&x)?.squeeze(0)?)
    }

    fn logits(&self, rows: &Tensor) -> Result<Tensor> {
        let h = candle_nn::ops::rms_norm(rows, &self.w.final_norm, self.cfg.rms_eps as f32)?;
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
        if precision == Precision::W8A8 && self.profile.is_none() {
            return Err(Error::Input("W8A8 prefill needs a quant profile: calibrate or load one first".into()));
        }
        self.clear();
        let graphs = self.graphs_for(chunk_len, precision)?;
        let cfg = self.cfg.clone();
        let mut out_rows = Vec::new();
        for chunk in &plan.chunks {
            let (m, n_valid) = (chunk.padded_len, chunk.len);
            let mut ids = tokens[chunk.start..chunk.start + n_valid].to_vec();
            ids.resize(m, 0);
            let mut x = self.w.embed.index_select(&Tensor::new(ids.as_slice(), &Device::Cpu)?, 0)?;
            let (cos, sin) = rope_tables(&cfg, chunk.start, m)?;
            for (l, g) in graphs.iter().enumerate() {
                let lw = &self.w.layers[l];
                // CPU: rmsnorm + quantize; NPU: Q, K, V.
                let h = candle_nn::ops::rms_norm(&x, &lw.attn_norm, cfg.rms_eps as f32)?;
                let input = self.stage_input(&h, &point(l, "attn_in"), n_valid, precision, calib.as_deref_mut())?;
                let qkv = g.qkv.execute(&[&input])?;
                let q = to_tensor(&qkv[0], m)?;
                let k = to_tensor(&qkv[1], m)?;
                let v = to_tensor(&qkv[2], m)?;
                // CPU: RoPE, KV append, attention over every chunk so far.
                let attn = attend(&cfg, &mut self.kv[l], &q, &k, &v, m, n_valid, chunk.start, &cos, &sin)?;
                let input = self.stage_input(&attn, &point(l, "attn_out"), n_valid, precision, calib.as_deref_mut())?;
                // NPU: O.
                let o = to_tensor(&g.o.execute(&[&input])?[0], m)?;
                x = (x + o)?;
                // CPU: rmsnorm + quantize; NPU: FFN; CPU: residual.
                let h = candle_nn::ops::rms_norm(&x, &lw.ffn_norm, cfg.rms_eps as f32)?;
                let input = self.stage_input(&h, &point(l, "ffn_in"), n_valid, precision, calib.as_deref_mut())?;
                let ffn = g.ffn.execute(&[&input])?;
                if let (Some(cal), Some(TensorData::F32(hidden))) = (calib.as_deref_mut(), ffn.get(1)) {
                    cal.observe(&point(l, "ffn_down_in"), &hidden[..n_valid * cfg.ffn]);
                }
                x = (x + to_tensor(&ffn[0], m)?)?;
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

    /// Turn a CPU activation into the input of an NPU graph: F32 as is, or quantized to u8 with
    /// the calibrated range of `point`. In calibration, the valid rows' range is recorded.
    /// (The shadow-outlier path attaches here: what the range clips is what it would extract.)
    fn stage_input(&self, h: &Tensor, point: &str, n_valid: usize, precision: Precision, calib: Option<&mut Calibrator>) -> Result<TensorData> {
        let vals = h.flatten_all()?.to_vec1::<f32>()?;
        if let Some(cal) = calib {
            let cols = h.dim(1)?;
            cal.observe(point, &vals[..n_valid * cols]);
        }
        Ok(match precision {
            Precision::F32 => TensorData::F32(vals),
            Precision::W8A8 => {
                let q = self.profile.as_ref().expect("checked in run_prefill").activation_quant(point)?;
                TensorData::U8(quantize_u8(&vals, q))
            }
        })
    }

    fn graphs_for(&mut self, chunk_len: usize, precision: Precision) -> Result<Arc<Vec<LayerGraphs>>> {
        if let Some(g) = self.graphs.get(&(chunk_len, precision)) {
            return Ok(g.clone());
        }
        let t = std::time::Instant::now();
        let graphs = (0..self.cfg.n_layer).map(|l| self.build_layer(l, chunk_len, precision)).collect::<Result<Vec<_>>>()?;
        tracing::info!(chunk_len, ?precision, layers = graphs.len(), secs = t.elapsed().as_secs_f32(), executor = self.device.executor_name(), "prepared NPU stage graphs");
        let graphs = Arc::new(graphs);
        self.graphs.insert((chunk_len, precision), graphs.clone());
        Ok(graphs)
    }

    /// Describe the three static NPU graphs of one layer for chunks of `m` rows.
    pub fn layer_graphs(&self, l: usize, m: usize, precision: Precision) -> Result<[Graph; 3]> {
        let (c, lw) = (&self.cfg, &self.w.layers[l]);
        let b = GraphBuilder { precision, profile: self.profile.as_ref() };
        let mut qkv = Graph::new(format!("blk.{l}.qkv.m{m}"));
        let x = b.input(&mut qkv, m, c.hidden, &point(l, "attn_in"))?;
        for (name, w, bias) in [("q", &lw.wq, &lw.bq), ("k", &lw.wk, &lw.bk), ("v", &lw.wv, &lw.bv)] {
            let y = b.linear(&mut qkv, name, x, w, bias.as_ref())?;
            qkv.mark_output(y);
        }
        let mut o = Graph::new(format!("blk.{l}.o.m{m}"));
        let x = b.input(&mut o, m, c.n_head * c.head_dim, &point(l, "attn_out"))?;
        let y = b.linear(&mut o, "o", x, &lw.wo, None)?;
        o.mark_output(y);

        let mut ffn = Graph::new(format!("blk.{l}.ffn.m{m}"));
        let x = b.input(&mut ffn, m, c.hidden, &point(l, "ffn_in"))?;
        let gate = b.linear(&mut ffn, "gate", x, &lw.w_gate, None)?;
        let up = b.linear(&mut ffn, "up", x, &lw.w_up, None)?;
        let sig = ffn.unary("gate_sigmoid", gate, DType::F32, None, |input, output| Op::Sigmoid { input, output });
        let silu = ffn.binary("gate_silu", gate, sig, DType::F32, None, |a, b, output| Op::Mul { a, b, output });
        let hidden = ffn.binary("hidden", silu, up, DType::F32, None, |a, b, output| Op::Mul { a, b, output });
        let down_in = match precision {
            Precision::F32 => hidden,
            Precision::W8A8 => {
                let q = b.profile.expect("W8A8 needs a profile").activation_quant(&point(l, "ffn_down_in"))?;
                ffn.unary("hidden_q", hidden, DType::U8, Some(q), |input, output| Op::Quantize { input, output })
            }
        };
        let down = b.linear(&mut ffn, "down", down_in, &lw.w_down, None)?;
        ffn.mark_output(down);
        if precision == Precision::F32 {
            // Exposed so that calibration sees the input of the down projection.
            ffn.mark_output(hidden);
        }
        Ok([qkv, o, ffn])
    }

    fn build_layer(&self, l: usize, m: usize, precision: Precision) -> Result<LayerGraphs> {
        let [qkv, o, ffn] = self.layer_graphs(l, m, precision)?;
        Ok(LayerGraphs { qkv: self.device.prepare(&qkv)?, o: self.device.prepare(&o)?, ffn: self.device.prepare(&ffn)? })
    }

    /// NPU stage graphs per layer (the static, chunk-shared subgraphs).
    pub const NPU_STAGES_PER_LAYER: usize = 3;
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

struct GraphBuilder<'a> {
    precision: Precision,
    profile: Option<&'a QuantProfile>,
}

impl GraphBuilder<'_> {
    fn input(&self, g: &mut Graph, m: usize, k: usize, point: &str) -> Result<TensorId> {
        Ok(match self.precision {
            Precision::F32 => g.input("x", &[m, k], DType::F32, None),
            Precision::W8A8 => {
                let q = self.profile.expect("W8A8 needs a profile").activation_quant(point)?;
                g.input("x", &[m, k], DType::U8, Some(q))
            }
        })
    }

    /// A FullyConnected with F32 output; weights (and bias) quantized per-tensor in W8A8.
    fn linear(&self, g: &mut Graph, name: &str, x: TensorId, w: &Tensor, bias: Option<&Tensor>) -> Result<TensorId> {
        let (n, k) = w.dims2()?;
        let data = w.flatten_all()?.to_vec1::<f32>()?;
        let bias_f = bias.map(|b| b.to_vec1::<f32>()).transpose()?;
        let (wt, bt) = match self.precision {
            Precision::F32 => {
                let wt = g.constant(&format!("{name}.weight"), &[n, k], StaticData::F32(Arc::new(data)), None);
                let bt = bias_f.map(|b| g.constant(&format!("{name}.bias"), &[n], StaticData::F32(Arc::new(b)), None));
                (wt, bt)
            }
            Precision::W8A8 => {
                let (q, wq) = quantize_weight_i8(&data);
                let wt = g.constant(&format!("{name}.weight"), &[n, k], StaticData::I8(Arc::new(q)), Some(wq));
                let x_scale = g.tensor(x).quant.expect("quantized input").scale;
                let bq = Quant::symmetric(x_scale * wq.scale);
                let bt = bias_f.map(|b| {
                    let data = b.iter().map(|&v| (v / bq.scale).round() as i32).collect();
                    g.constant(&format!("{name}.bias"), &[n], StaticData::I32(Arc::new(data)), Some(bq))
                });
                (wt, bt)
            }
        };
        debug_assert_eq!(g.tensor(wt).kind, TensorKind::Static);
        Ok(g.fully_connected(name, x, wt, bt, DType::F32, None))
    }
}

fn add_bias(x: Tensor, b: &Option<Tensor>) -> Result<Tensor> {
    Ok(match b {
        Some(b) => x.broadcast_add(b)?,
        None => x,
    })
}

fn to_tensor(d: &TensorData, rows: usize) -> Result<Tensor> {
    match d {
        TensorData::F32(v) => Ok(Tensor::from_slice(v, (rows, v.len() / rows), &Device::Cpu)?),
        other => Err(Error::Input(format!("NPU stage returned {:?}, expected F32", other.dtype()))),
    }
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
