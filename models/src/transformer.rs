//! The decoder engine shared by every family: chunked prefill with the linear layers and FFN on
//! an [`NpuDevice`], attention on the CPU, and token-by-token decode on candle CPU ops over the KV
//! cache that prefill filled. A family file only turns its checkpoint into [`Config`] + the
//! tensors a [`crate::checkpoint::NameMap`] names.
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
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::quantized::QMatMul;
use candle_core::{DType as CDType, Device, Module, Tensor, D};
use candle_npu::kernels::rows::{self, with_f32};
use candle_npu::sched::{simulate, AnalyticCosts, DagChunk, LayerShape, Policy, Processor, Rates, Runner, Schedule, StageDesc, SubgraphDag};
use candle_npu::{
    Calibrator, Chunk, ChunkPlan, DType, DecodeWeights, Error, Graph, InputPoint, NpuDevice, Outliers, PointStats, PreparedGraph, Quant,
    QuantProfile, Result, ShadowLinear, Tail, TensorData, TensorId, WeightQuant,
};

use crate::attention::{attend, KvCache, QkNorm, Rows};
use crate::checkpoint::{Checkpoint, NameMap};
pub use crate::spec::{Config, FamilySpec};

/// Arithmetic of the NPU stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    /// F32 FullyConnected, no quantization: proves chunking exact (the float reference).
    F32,
    /// INT8 weights, u8 activations per tensor over calibrated clip ranges, shadow outliers.
    W8A8,
    /// INT8 weights, u16 activations per tensor over the full calibrated range, no shadow: what
    /// vendor stacks run on the HTP today; the comparison row for shadow W8A8.
    W8A16,
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

/// One decoder layer: its norms and the seven linears, grouped by the NPU stage that runs them.
struct Layer {
    attn_norm: Tensor,
    ffn_norm: Tensor,
    qk_norm: Option<QkNorm>,
    /// Gemma's sandwich norms: on the attention output and the FFN output.
    post_norms: Option<(Tensor, Tensor)>,
    /// q, k, v | o | gate, up | down: the linears of stage `s` read point `POINTS[s]`.
    stages: [Vec<ShadowLinear>; 4],
}

impl Layer {
    fn linears(&self) -> impl Iterator<Item = &ShadowLinear> {
        self.stages.iter().flatten()
    }

    /// The layer, written once: the residual stream (`[m, hidden]`) through attention and FFN.
    /// `run(s, h)` computes the linears of stage `s` on `h`: the NPU stage graph with its shadow
    /// outliers in prefill, candle CPU matmuls in decode. Everything else here runs on the CPU.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        cfg: &Config,
        spec: &FamilySpec,
        l: usize,
        x: &mut Residual,
        rows: &Rows,
        kv: &Mutex<KvCache>,
        run: &mut StageFn<'_>,
    ) -> Result<()> {
        let eps = cfg.rms_eps as f32;
        let h = x.add_norm(&self.attn_norm, eps)?;
        let [q, k, v]: [Tensor; 3] = run(0, &h)?.try_into().map_err(|_| Error::Input("QKV stage must return three outputs".into()))?;
        // Uncontended: a layer's attention runs for one chunk at a time, in chunk order (the
        // schedule's cross-chunk edge).
        let mut kv = kv.lock().unwrap_or_else(|e| e.into_inner());
        let a = attend(cfg, spec, &spec.layers[l], self.qk_norm.as_ref(), &mut kv, &q, &k, &v, rows)?;
        drop(kv);
        let mut o = run(1, &a)?.remove(0);
        if let Some((post_attn, _)) = &self.post_norms {
            o = candle_nn::ops::rms_norm(&o, post_attn, eps)?;
        }
        x.push(o)?;
        let h = x.add_norm(&self.ffn_norm, eps)?;
        let [gate, up]: [Tensor; 2] = run(2, &h)?.try_into().map_err(|_| Error::Input("gate/up stage must return two outputs".into()))?;
        let hidden = spec.activation.gated(&gate, &up)?;
        let mut d = run(3, &hidden)?.remove(0);
        if let Some((_, post_ffn)) = &self.post_norms {
            d = candle_nn::ops::rms_norm(&d, post_ffn, eps)?;
        }
        x.push(d)
    }
}

/// The residual stream between blocks: `x` plus a block's output not added yet, so that the add
/// and the next RMSNorm are one pass over the rows ([`rows::add_rms_norm`]), also across layers:
/// a layer's FFN output is added by the next layer's first norm.
struct Residual {
    x: Tensor,
    /// The stream's values as f32 rows when they are newer than `x`: the fused add + norm keeps
    /// them from one layer to the next (a `Tensor` would be copied out and back each time).
    rows: Option<Vec<f32>>,
    pending: Option<Tensor>,
}

impl Residual {
    fn new(x: Tensor) -> Self {
        Residual { x, rows: None, pending: None }
    }

    /// The stream as a tensor, made from `rows` if they are newer.
    fn stream(&mut self) -> Result<&Tensor> {
        if let Some(rows) = self.rows.take() {
            self.x = Tensor::from_vec(rows, self.x.shape(), self.x.device())?;
        }
        Ok(&self.x)
    }

    /// A block's output, to be added to the stream.
    fn push(&mut self, d: Tensor) -> Result<()> {
        if let Some(p) = self.pending.replace(d) {
            self.x = (self.stream()? + p)?;
        }
        Ok(())
    }

    /// Adds what is pending and returns the stream's rows normalized by `w` (f32 rows, as
    /// prefill and decode have, in one pass; other dtypes take candle's two ops).
    fn add_norm(&mut self, w: &Tensor, eps: f32) -> Result<Tensor> {
        let Some(d) = self.pending.take() else { return Ok(candle_nn::ops::rms_norm(self.stream()?, w, eps)?) };
        let x = &self.x;
        if [x.dtype(), d.dtype(), w.dtype()] != [CDType::F32; 3] || x.shape() != d.shape() || x.dim(D::Minus1)? != w.elem_count() {
            self.x = (self.stream()? + d)?;
            return Ok(candle_nn::ops::rms_norm(&self.x, w, eps)?);
        }
        let mut sum = match self.rows.take() {
            Some(rows) => rows,
            None => x.flatten_all()?.to_vec1::<f32>()?,
        };
        let h = with_f32(&d, |d| with_f32(w, |w| rows::add_rms_norm(&mut sum, d, w, eps)))??;
        self.rows = Some(sum);
        Ok(Tensor::from_vec(h, x.shape(), x.device())?)
    }

    /// The stream with everything added.
    fn finish(mut self) -> Result<Tensor> {
        self.stream()?;
        if let Some(d) = self.pending.take() {
            self.x = (&self.x + d)?;
        }
        Ok(self.x)
    }
}

/// Computes the linears of one stage on its input rows (see [`Layer::forward`]).
type StageFn<'a> = dyn FnMut(usize, &Tensor) -> Result<Vec<Tensor>> + 'a;

/// A loaded model: NPU prefill + CPU decode.
pub struct Model {
    cfg: Config,
    spec: FamilySpec,
    /// Identifies the weights (sha256 of the checkpoint) for quant profiles and graph caches.
    model_id: String,
    device: NpuDevice,
    precision: Precision,
    /// `[vocab, hidden]` in the checkpoint's quantization: rows are dequantized on lookup.
    embed: QMatMul,
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
    graphs: HashMap<(GraphSet, Precision), Arc<Vec<Vec<PreparedGraph>>>>,
    kv: Vec<Mutex<KvCache>>,
    pos: usize,
    sched: SchedOptions,
    /// One-thread pool the NPU stages run in when [`SchedOptions::npu_threads`] is set.
    npu_pool: Option<(usize, Arc<rayon::ThreadPool>)>,
    /// The last prefill's DAG and what ran when.
    last_run: Option<(SubgraphDag, Schedule)>,
    progress: Option<Progress>,
    /// CPU time of the shadow path (outlier extraction and the float product) since the last
    /// [`Model::take_shadow_time`].
    shadow_time: std::time::Duration,
}

/// Which stage graphs: the NPU's for chunks of one row count, or a CPU margin's (any row count;
/// see `Model::margin_graphs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum GraphSet {
    Npu(usize),
    Margin,
}

/// How prefill is scheduled (llm.npu §3.4 and HeteroLLM's margin). The defaults were chosen by
/// measurement (README, "Out-of-order prefill and margins"): FIFO, 4 chunks in flight, graphs of
/// the chunk length and of 32 rows, the rest a CPU margin with the host executor
/// ([`SchedOptions::default`]) or padded beside a real NPU ([`SchedOptions::for_device`]).
#[derive(Debug, Clone)]
pub struct SchedOptions {
    /// Which ready stage a free processor runs next.
    pub policy: Policy,
    /// Tokens that do not fill a last chunk (of the smallest size): padded on the NPU or run on
    /// the CPU as a margin.
    pub tail: Tail,
    /// Threads of the pool the NPU stages run in (`None`: the caller's, i.e. rayon's global
    /// pool). With the host executor as the NPU, `Some(1)` gives it one core and leaves the
    /// other to the CPU stages (run with `RAYON_NUM_THREADS=1` so candle's CPU kernels take one).
    pub npu_threads: Option<usize>,
    /// Graph sizes smaller than the chunk length the plan may also use (HeteroLLM's multi-size
    /// graphs, each prepared once and cached): where the cost model predicts it is faster, the
    /// rows after the last full chunk run in chunks of these sizes before a margin is left.
    pub small_chunks: Vec<usize>,
    /// Chunks an out-of-order prefill works on at once: its worker threads, each walking one
    /// chunk's stages. Fewer limit how far the NPU can run ahead of attention (FIFO at 2048
    /// tokens, a core each: 2 give 117 tok/s, 4 give 167, all 8 give 174); each is a thread with
    /// its own heap arena unless the program shares them ([`crate::memory::limit_malloc_arenas`]).
    pub chunks_in_flight: usize,
}

impl Default for SchedOptions {
    fn default() -> Self {
        SchedOptions { policy: Policy::Fifo, tail: Tail::Margin, npu_threads: None, small_chunks: vec![32], chunks_in_flight: 4 }
    }
}

impl SchedOptions {
    /// The defaults for prefills on `device`. With the host executor as the NPU, the rows after
    /// the last chunk are a CPU margin: the same arithmetic on the same cores, without padding.
    /// Beside a real NPU they are padded onto it (`Tail::Pad`), for two measured reasons:
    /// - **One arithmetic per prompt.** A margin computes its rows on the HTP numerics model,
    ///   which matches the library on 99.6% of stage outputs; the rest move logits by up to a
    ///   logit through 30 layers, enough to flip a near tie: the README's own question ("What is
    ///   the capital of France?", a 0.15-logit tie between "The" and "L'" at its first answer
    ///   token) answered "L'Étoile" with an HTP chunk and a margin, "Paris" with every row on the
    ///   HTP (`docs/accuracy.md`).
    /// - **Speed on a phone.** The phone cost model ([`Rates::SNAPDRAGON_8_GEN_3`], FIFO) puts the
    ///   CPU stages on the critical path and the NPU mostly idle, so rows padded onto the NPU cost
    ///   less than margin rows on the CPU: padded makespans are 0.13x (a 20-token prompt, all margin
    ///   otherwise) to 0.98x the margin's at 20-1500 tokens for SmolLM2, Gemma 3 and
    ///   Qwen2.5-Coder, one case excepted (Qwen at 100 tokens: 1.09x); `examples/sched.rs
    ///   --sections tail` prints the table.
    pub fn for_device(device: &NpuDevice) -> Self {
        let tail = if device.on_host() { Tail::Margin } else { Tail::Pad };
        SchedOptions { tail, ..Default::default() }
    }
}

/// A prefill chunk's rows for the logits and its shadow-path CPU time.
type ChunkOutput = Result<(Tensor, Duration)>;

/// Called after every (chunk, layer) of a prefill with (done, total).
pub type Progress = Box<dyn FnMut(usize, usize) + Send + Sync>;

const STAGE_NAMES: [&str; 4] = ["qkv", "o", "gate_up", "down"];

/// A layer's nodes in the prefill DAG: each NPU stage (`STAGE_NAMES`) with the CPU stage that
/// prepares its input (which also completes the previous stage's output: shadow, bias, and
/// for `attn_in` the previous layer's residual).
const LAYER_STAGES: [(&str, Processor); 8] = [
    ("attn_in", Processor::Cpu),
    ("qkv", Processor::Npu),
    ("attn", Processor::Cpu),
    ("o", Processor::Npu),
    ("ffn_in", Processor::Cpu),
    ("gate_up", Processor::Npu),
    ("act", Processor::Cpu),
    ("down", Processor::Npu),
];

/// The prefill DAG of `plan` for `n_layer` layers: per layer the 4 NPU stages with the CPU stage
/// before each (`LAYER_STAGES`), and a CPU tail per chunk (final rows out).
pub fn prefill_dag(plan: &ChunkPlan, n_layer: usize) -> Result<SubgraphDag> {
    let stages: Vec<StageDesc> = LAYER_STAGES.iter().map(|&(name, p)| StageDesc::new(name, p, name == "attn")).collect();
    let chunks: Vec<DagChunk> = plan.chunks.iter().map(|c| DagChunk { rows: c.padded_len, margin: c.margin }).collect();
    SubgraphDag::new(&stages, n_layer, Some(StageDesc::new("tail", Processor::Cpu, false)), &chunks)
}

impl Model {
    /// Build a model from `ckpt`, whose tensors `names` maps from the engine's (GGUF) names.
    pub fn load(
        cfg: Config,
        spec: FamilySpec,
        ckpt: &dyn Checkpoint,
        names: &NameMap,
        model_id: String,
        device: NpuDevice,
        opts: LoadOptions,
    ) -> Result<Self> {
        check_spec(&cfg, &spec, ckpt)?;
        let vector = |name: String| ckpt.vector(&names(&name).name);
        // The tables and the final norm first: their shapes tell a wrong config before the layers'
        // quantization takes its seconds.
        let embed = ckpt.table(&names("token_embd.weight").name, opts.decode_weights)?;
        let lm_head = match ckpt.contains(&names("output.weight").name) {
            true => ckpt.table(&names("output.weight").name, opts.decode_weights)?,
            false => embed.clone(), // tied
        };
        let final_norm = vector("output_norm.weight".into())?;
        for (name, dims, want) in [
            ("token_embd.weight", qmatmul_dims(&embed), vec![cfg.vocab, cfg.hidden]),
            ("output.weight", qmatmul_dims(&lm_head), vec![cfg.vocab, cfg.hidden]),
            ("output_norm.weight", final_norm.dims().to_vec(), vec![cfg.hidden]),
        ] {
            if dims != want {
                return Err(Error::Model { path: ckpt.path().to_path_buf(), reason: format!("{name}: shape {dims:?}, the config implies {want:?}") });
            }
        }
        let (hd, q_rows, kv_rows) = (cfg.head_dim, cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim);
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for l in 0..cfg.n_layer {
            let lin = |name: &str, shape: (usize, usize), bias: bool| -> Result<ShadowLinear> {
                let full = format!("blk.{l}.{name}");
                let src = ckpt.mapped_matrix(&names(&format!("{full}.weight")))?;
                if src.dims() != shape {
                    return Err(Error::Model {
                        path: ckpt.path().to_path_buf(),
                        reason: format!("{}: shape {:?}, the config implies {shape:?}", src.describe(), src.dims()),
                    });
                }
                let b = match bias {
                    true => Some(vector(format!("{full}.bias"))?.to_vec1::<f32>()?),
                    false => None,
                };
                ShadowLinear::new(full, src, b, opts.weights, opts.decode_weights)
            };
            let (h, f, b) = (cfg.hidden, cfg.ffn, spec.qkv_bias);
            let stages = [
                vec![lin("attn_q", (q_rows, h), b)?, lin("attn_k", (kv_rows, h), b)?, lin("attn_v", (kv_rows, h), b)?],
                vec![lin("attn_output", (h, q_rows), false)?],
                vec![lin("ffn_gate", (f, h), false)?, lin("ffn_up", (f, h), false)?],
                vec![lin("ffn_down", (h, f), false)?],
            ];
            let norm = |name: &str, len: usize| -> Result<Tensor> {
                let t = vector(format!("blk.{l}.{name}.weight"))?;
                match t.dims() == [len] {
                    true => Ok(t),
                    false => Err(Error::Model {
                        path: ckpt.path().to_path_buf(),
                        reason: format!("blk.{l}.{name}: shape {:?}, expected [{len}]", t.dims()),
                    }),
                }
            };
            layers.push(Layer {
                attn_norm: norm("attn_norm", h)?,
                ffn_norm: norm("ffn_norm", h)?,
                qk_norm: spec.qk_norm.then(|| Ok::<_, Error>(QkNorm { q: norm("attn_q_norm", hd)?, k: norm("attn_k_norm", hd)? })).transpose()?,
                post_norms: spec.post_norms.then(|| Ok::<_, Error>((norm("post_attention_norm", h)?, norm("post_ffw_norm", h)?))).transpose()?,
                stages,
            });
        }
        let n = cfg.n_layer;
        let sched = SchedOptions::for_device(&device);
        Ok(Model {
            cfg,
            spec,
            model_id,
            device,
            precision: opts.precision,
            embed,
            final_norm,
            lm_head,
            layers,
            profile: None,
            points: vec![],
            a16: vec![],
            shadow_on: vec![],
            shadow_time: std::time::Duration::ZERO,
            graphs: HashMap::new(),
            kv: (0..n).map(|_| Mutex::default()).collect(),
            sched,
            npu_pool: None,
            last_run: None,
            pos: 0,
            progress: None,
        })
    }

    pub fn spec(&self) -> &FamilySpec {
        &self.spec
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
            return Err(Error::Input(format!("quant profile was calibrated for model {}, this model is {}", profile.model_id, self.model_id)));
        }
        // All checked before anything changes: a bad profile leaves the model as it was.
        profile.validate().map_err(|why| Error::Input(format!("quant profile: {why}")))?;
        if !profile.importance.is_empty() && profile.importance.len() != self.layers.len() {
            return Err(Error::Input(format!("quant profile: importance of {} layers, the model has {}", profile.importance.len(), self.layers.len())));
        }
        for (l, layer) in self.layers.iter().enumerate() {
            for (s, lins) in layer.stages.iter().enumerate() {
                let name = point(l, POINTS[s]);
                let (channels, k) = (profile.point(&name)?.channels, lins[0].dims().1);
                if channels != k {
                    return Err(Error::Input(format!("quant profile point {name} has {channels} channels, the model {k}")));
                }
            }
        }
        let mut a16 = Vec::with_capacity(self.layers.len());
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let mut row16 = [Quant::symmetric(1.0); 4];
            for (s, lins) in layer.stages.iter_mut().enumerate() {
                let p = profile.point(&point(l, POINTS[s]))?;
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

    /// The KV caches, one per layer, each holding [`Model::position`] tokens.
    pub(crate) fn kv_caches(&self) -> Vec<std::sync::MutexGuard<'_, KvCache>> {
        self.kv.iter().map(|kv| kv.lock().unwrap_or_else(|e| e.into_inner())).collect()
    }

    /// Replaces the KV caches (one per layer, each of `(kv_heads, head_dim)` and one length,
    /// checked by the caller) and the position with theirs.
    pub(crate) fn set_kv_caches(&mut self, caches: Vec<KvCache>) {
        self.pos = caches.first().map_or(0, KvCache::len);
        self.kv = caches.into_iter().map(Mutex::new).collect();
    }

    /// Forget the KV cache.
    pub fn clear(&mut self) {
        self.kv.iter_mut().for_each(|kv| kv.get_mut().unwrap_or_else(|e| e.into_inner()).clear());
        self.pos = 0;
    }

    /// Run `f` with the host executor as this model's device and fresh graphs, then restore both.
    /// Offline passes over NPU graphs (importance, outlier counting) always run here: the x86
    /// HTP emulator would take hours for them.
    fn on_host<R>(&mut self, f: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        let device = std::mem::replace(&mut self.device, NpuDevice::host());
        let graphs = std::mem::take(&mut self.graphs);
        let r = f(self);
        self.device = device;
        self.graphs = graphs;
        self.clear();
        r
    }

    /// Collect activation statistics over `sequences`: each runs through the layers on the CPU
    /// with the decode weights (float activations, the INT8 weights the NPU will hold), and
    /// every stage's input is observed. Not through float NPU graphs: those would hold an F32
    /// copy of every weight (600 MiB of the main job's peak for SmolLM2), and on an HTP they
    /// compute in FP16. `progress` is called after each sequence.
    pub fn calibrate(&mut self, sequences: &[Vec<u32>], mut progress: impl FnMut(usize)) -> Result<Calibrator> {
        let mut cal = Calibrator::default();
        for (i, seq) in sequences.iter().enumerate() {
            self.clear();
            let r = self.run_cpu(seq, Some(&mut cal));
            self.clear();
            r?;
            cal.tokens_seen += seq.len();
            progress(i + 1);
        }
        Ok(cal)
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
                    m.clear();
                    let logits = m.run_prefill(seq, &m.npu_only_plan(seq.len(), chunk_len)?, Precision::W8A8, true)?;
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
    pub fn count_channel_outliers(
        &mut self,
        sequences: &[Vec<u32>],
        chunk_len: usize,
        mut progress: impl FnMut(usize),
    ) -> Result<Vec<(String, Vec<u64>)>> {
        let kept = self.shadow_on.clone();
        self.set_shadow_layers(&vec![true; self.layers.len()])?;
        self.reset_point_stats();
        let r = self.on_host(|m| {
            for (i, seq) in sequences.iter().enumerate() {
                m.clear();
                m.run_prefill(seq, &m.npu_only_plan(seq.len(), chunk_len)?, Precision::W8A8, false)?;
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

    /// Prepare the NPU stage graphs for `chunk_len`, and for the smaller sizes of
    /// [`SchedOptions::small_chunks`], now (otherwise the first prefill that uses them does).
    pub fn prepare(&mut self, chunk_len: usize) -> Result<()> {
        if chunk_len == 0 {
            return Err(Error::Input("chunk length 0: use a positive --chunk-len (e.g. 256)".into()));
        }
        self.check_profile(self.precision)?;
        self.graphs_for(GraphSet::Npu(chunk_len), self.precision)?;
        for size in self.sched.small_chunks.clone().into_iter().filter(|&s| s > 0 && s < chunk_len) {
            self.graphs_for(GraphSet::Npu(size), self.precision)?;
        }
        Ok(())
    }

    fn check_profile(&self, precision: Precision) -> Result<()> {
        if precision != Precision::F32 && self.profile.is_none() {
            return Err(Error::Input(format!("{precision:?} prefill needs a quant profile: calibrate or load one first")));
        }
        Ok(())
    }

    /// Prefill `tokens` (resetting the KV cache) and return the logits of the last token, `[vocab]`.
    pub fn prefill(&mut self, tokens: &[u32], chunk_len: usize) -> Result<Tensor> {
        self.clear();
        self.extend(tokens, chunk_len)
    }

    /// Prefill `tokens` after the tokens the KV cache holds (a conversation's next turn, or a
    /// prompt after a restored prefix) through the same chunked NPU plan, and return the logits
    /// of the last one, `[vocab]`. Only the new tokens are computed; they attend to everything
    /// before them. On an error the cache is left as it was.
    pub fn extend(&mut self, tokens: &[u32], chunk_len: usize) -> Result<Tensor> {
        let logits = self.run_prefill(tokens, &self.plan(tokens.len(), chunk_len)?, self.precision, false)?;
        Ok(logits.squeeze(0)?)
    }

    /// Prefill and return the logits of every prompt position, `[len, vocab]` (for perplexity).
    pub fn prefill_all_logits(&mut self, tokens: &[u32], chunk_len: usize) -> Result<Tensor> {
        self.clear();
        self.run_prefill(tokens, &self.plan(tokens.len(), chunk_len)?, self.precision, true)
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
        let x = self.run_cpu(tokens, None)?;
        self.logits(&x)
    }

    /// The layers on the CPU from the current position; returns the last layer's rows. With
    /// `cal`, every stage's input is observed (calibration).
    fn run_cpu(&mut self, tokens: &[u32], mut cal: Option<&mut Calibrator>) -> Result<Tensor> {
        self.check_tokens(tokens)?;
        let n = tokens.len();
        if n == 0 || self.pos + n > self.cfg.context_len {
            return Err(Error::Input(format!("{n} tokens at position {} do not fit the context of {}", self.pos, self.cfg.context_len)));
        }
        let mut x = Residual::new(self.embed_rows(tokens)?);
        let rows = Rows::new(&self.spec, self.pos, n, n, self.pos + n)?;
        let Model { cfg, spec, layers, kv, .. } = self;
        for (l, layer) in layers.iter().enumerate() {
            let mut run = |s: usize, h: &Tensor| {
                if let Some(cal) = cal.as_deref_mut() {
                    cal.observe(&point(l, POINTS[s]), &h.flatten_all()?.to_vec1::<f32>()?, h.dim(1)?);
                }
                layer.stages[s].iter().map(|lin| lin.forward(h)).collect::<Result<Vec<_>>>()
            };
            layer.forward(cfg, spec, l, &mut x, &rows, &kv[l], &mut run)?;
        }
        self.pos += n;
        x.finish()
    }

    /// Embeddings of `tokens`, `[n, hidden]` (scaled as the family says).
    fn embed_rows(&self, tokens: &[u32]) -> Result<Tensor> {
        let x = self.embed.embedding(&Tensor::new(tokens, &Device::Cpu)?)?;
        Ok(match self.spec.embed_scale {
            Some(s) => (x * s)?,
            None => x,
        })
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

    /// The chunk plan of a prefill of `n` tokens with NPU graphs of `chunk_len` rows: as many
    /// full chunks as fit, then, where the cost model (`Model::estimate`, simulated under the
    /// current policy) predicts a shorter prefill, chunks of the [`SchedOptions::small_chunks`]
    /// sizes, and the rest as [`SchedOptions::tail`] says.
    pub fn plan(&self, n: usize, chunk_len: usize) -> Result<ChunkPlan> {
        let (ctx, tail) = (self.cfg.context_len, self.sched.tail);
        let mut sizes = vec![chunk_len];
        let mut best = ChunkPlan::with_sizes(n, &sizes, ctx, tail)?;
        let mut small: Vec<usize> = self.sched.small_chunks.iter().copied().filter(|&s| s > 0 && s < chunk_len).collect();
        small.sort_unstable_by(|a, b| b.cmp(a));
        if small.is_empty() {
            return Ok(best);
        }
        // A planned order belongs to one DAG; rank the candidates by critical path instead.
        let policy = match &self.sched.policy {
            Policy::Planned(_) => Policy::CriticalPath,
            p => p.clone(),
        };
        let costs = self.estimate();
        let makespan = |plan: &ChunkPlan| -> Result<f64> { Ok(simulate(&prefill_dag(plan, self.layers.len())?, &costs, &policy)?.makespan) };
        let mut best_time = makespan(&best)?;
        for s in small {
            sizes.push(s);
            let candidate = ChunkPlan::with_sizes(n, &sizes, ctx, tail)?;
            if candidate != best {
                let t = makespan(&candidate)?;
                if t < best_time {
                    (best, best_time) = (candidate, t);
                }
            }
        }
        Ok(best)
    }

    /// Every row on the NPU graphs of one size (a padded last chunk): for measurements of the
    /// NPU's numerics (importance, outlier counts), which a CPU margin would leave out.
    fn npu_only_plan(&self, n: usize, chunk_len: usize) -> Result<ChunkPlan> {
        ChunkPlan::new(n, chunk_len, self.cfg.context_len, Tail::Pad)
    }

    /// Runs `plan` over `tokens` from the current position (after the tokens the KV cache holds).
    fn run_prefill(&mut self, tokens: &[u32], plan: &ChunkPlan, precision: Precision, all_logits: bool) -> Result<Tensor> {
        self.check_tokens(tokens)?;
        self.check_profile(precision)?;
        let base = self.pos;
        if base + tokens.len() > self.cfg.context_len {
            return Err(Error::Input(format!(
                "{} tokens after the {base} the KV cache holds exceed the context of {}",
                tokens.len(),
                self.cfg.context_len
            )));
        }
        let r = self.run_plan(tokens, plan, precision, all_logits);
        if r.is_err() {
            // What a failed prefill appended goes: the cache holds the first `base` tokens again.
            self.kv.iter_mut().for_each(|kv| kv.get_mut().unwrap_or_else(|e| e.into_inner()).truncate(base));
        }
        r
    }

    fn run_plan(&mut self, tokens: &[u32], plan: &ChunkPlan, precision: Precision, all_logits: bool) -> Result<Tensor> {
        let mut graphs = HashMap::new();
        for size in plan.npu_sizes() {
            graphs.insert(size, self.graphs_for(GraphSet::Npu(size), precision)?);
        }
        let margin = self.margin_graphs(plan, precision)?;
        let dag = prefill_dag(plan, self.layers.len())?;
        let npu_pool = self.npu_pool()?;
        let runner = Runner::new(&dag, &self.estimate(), self.sched.policy.clone())?;
        let total = plan.chunks.len() * self.layers.len();
        let done = std::sync::atomic::AtomicUsize::new(0);
        let progress = Mutex::new(self.progress.take());
        let model = &*self;
        let run = |chunk: &Chunk| {
            let on_layer = || {
                let d = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                if let Some(report) = progress.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
                    report(d, total);
                }
            };
            let graphs = match chunk.margin {
                true => margin.as_deref(),
                false => graphs.get(&chunk.padded_len).map(|g| &**g),
            };
            let r = model.run_chunk(chunk, tokens, precision, all_logits, &runner, &dag, graphs, npu_pool.as_deref(), on_layer);
            if r.is_err() {
                runner.abort();
            }
            r
        };
        // In order, the chunks run one after another on one thread. Otherwise a few workers
        // take the chunks in order, each walking one chunk's stages, and the runner decides
        // which of them holds the NPU and which the CPU. The lowest unfinished chunk depends on
        // no unfinished one, so any number of workers makes progress (see
        // `SchedOptions::chunks_in_flight` for how many).
        // A lone chunk worker walks its stages on a thread of the rayon pool that runs their
        // GEMMs and row kernels: each parallel step is then a `join` inside the pool. From any
        // other thread every step is a job injected into the pool and waited for on a futex,
        // which put the pool's threads to sleep and woke them some 500 times per 256-token
        // chunk (measured: 6-14% of a SmolLM2 prefill on 2 cores). Several chunk workers stay
        // plain threads: they block on the runner's grants, which would idle a pool thread.
        // The host executor without an NPU queue of its own (`npu_threads: None`) runs the "NPU"
        // stages on the same pool as the CPU stages: no second processor has bubbles for another
        // chunk to fill, and one worker on the pool measured 4-6% faster than FIFO's four at
        // 1024 tokens (SmolLM2, 2 cores): the chunks run in order whatever the policy.
        let in_order = self.chunks_in_order();
        let workers = if in_order { 1 } else { plan.chunks.len().min(self.sched.chunks_in_flight.max(1)) };
        if self.policy_set_aside(plan.chunks.len()) {
            tracing::debug!(policy = self.sched.policy.name(), "host executor sharing the CPU stages' pool: chunks run in order");
        }
        let results: Vec<ChunkOutput> = if workers <= 1 {
            rayon::scope(|_| plan.chunks.iter().map(run).collect())
        } else {
            let next = std::sync::atomic::AtomicUsize::new(0);
            let slots: Vec<Mutex<Option<ChunkOutput>>> = plan.chunks.iter().map(|_| Mutex::new(None)).collect();
            let work = || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(chunk) = plan.chunks.get(i) else { break };
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(chunk))).unwrap_or_else(|_| {
                    runner.abort();
                    Err(Error::Input(format!("prefill chunk {i} panicked")))
                });
                *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            };
            // This thread is one of the workers.
            std::thread::scope(|s| {
                for _ in 1..workers {
                    s.spawn(work);
                }
                work();
            });
            slots
                .into_iter()
                .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()).unwrap_or_else(|| Err(Error::Input("a prefill chunk never ran".into()))))
                .collect()
        };
        self.progress = progress.into_inner().unwrap_or_else(|e| e.into_inner());
        let mut out_rows = Vec::with_capacity(results.len());
        let mut errors = vec![];
        for r in results {
            match r {
                Ok((rows, shadow)) => {
                    self.shadow_time += shadow;
                    out_rows.push(rows);
                }
                Err(e) => errors.push(e),
            }
        }
        // The cause, not the chunks the runner stopped because of it ("another stage failed").
        if let Some(i) = errors.iter().position(|e| !e.to_string().contains("another stage")).or((!errors.is_empty()).then_some(0)) {
            return Err(errors.swap_remove(i));
        }
        let schedule = runner.schedule();
        drop(runner);
        self.last_run = Some((dag, schedule));
        self.pos += tokens.len();
        let rows: Vec<Tensor> = out_rows.into_iter().filter(|r| r.dim(0).is_ok_and(|n| n > 0)).collect();
        self.logits(&Tensor::cat(&rows, 0)?)
    }

    /// One chunk of a prefill, stage by stage, each under its processor's grant from `runner`.
    /// Returns the chunk's rows for the logits (all valid rows, or the last one of the last
    /// chunk, or none) and its shadow-path CPU time.
    #[allow(clippy::too_many_arguments)]
    fn run_chunk(
        &self,
        chunk: &Chunk,
        tokens: &[u32],
        precision: Precision,
        all_logits: bool,
        runner: &Runner,
        dag: &SubgraphDag,
        graphs: Option<&Vec<Vec<PreparedGraph>>>,
        npu_pool: Option<&rayon::ThreadPool>,
        mut on_layer: impl FnMut(),
    ) -> ChunkOutput {
        let n_layer = self.layers.len();
        let node = |l: usize, s: usize| {
            dag.node_at(chunk.index, l, s).ok_or_else(|| Error::Input(format!("sched: no node for chunk {} layer {l} stage {s}", chunk.index)))
        };
        let (m, n_valid) = (chunk.padded_len, chunk.len);
        let mut cpu = Some(runner.acquire(node(0, 0)?)?);
        let mut ids = tokens[chunk.start..chunk.start + n_valid].to_vec();
        ids.resize(m, 0);
        let mut x = Residual::new(self.embed_rows(&ids)?);
        // Positions after the tokens the cache held before this prefill (`self.pos`, updated
        // when the prefill is done). The cache is sized once for the prompt and the first
        // `KvCache::GROW` decoded tokens: growing it at the first decode step copied every layer
        // into a new buffer while the old one was still held (SmolLM2 after a 700-token prompt:
        // +58 MiB resident at the first token, 431 MiB peak; 11 MiB of headroom instead).
        let reserve = (self.pos + tokens.len() + KvCache::GROW).min(self.cfg.context_len);
        let rows = Rows::new(&self.spec, self.pos + chunk.start, m, n_valid, reserve)?;
        let mut shadow_time = Duration::ZERO;
        for l in 0..n_layer {
            let layer = &self.layers[l];
            let mut stage = Stage {
                layer,
                l,
                points: self.points.get(l),
                shadow: self.shadow_on.get(l).copied().unwrap_or(false),
                a16: self.a16.get(l),
                shadow_time: Duration::ZERO,
                rows: &rows,
                precision,
            };
            let mut run = |s: usize, h: &Tensor| -> Result<Vec<Tensor>> {
                // The CPU node after this stage: the next stage's input, or the next layer's.
                let next = if s + 1 < Model::NPU_STAGES_PER_LAYER { node(l, 2 * s + 2)? } else { node(l + 1, 0)? };
                let ys = match graphs {
                    Some(graphs) => {
                        let (input, outliers) = stage.prepare(s, h)?;
                        cpu = None;
                        let outs = {
                            // The NPU's grant, or the CPU's for a margin's host graphs.
                            let _grant = runner.acquire(node(l, 2 * s + 1)?)?;
                            let exec = || match chunk.margin {
                                true => graphs[l][s].execute_rows(&[&input], m),
                                false => graphs[l][s].execute(&[&input]),
                            };
                            match npu_pool.filter(|_| !chunk.margin) {
                                Some(pool) => pool.install(exec)?,
                                None => exec()?,
                            }
                        };
                        cpu = Some(runner.acquire(next)?);
                        stage.finish(s, outs, &outliers)?
                    }
                    // A margin without host graphs: the stage's linears on the decode weights.
                    // (Each grant is released before the next is asked for: both are the CPU's.)
                    _ => {
                        cpu = None;
                        let linears = runner.acquire(node(l, 2 * s + 1)?)?;
                        let ys = layer.stages[s].iter().map(|lin| lin.forward(h)).collect::<Result<Vec<_>>>()?;
                        drop(linears);
                        cpu = Some(runner.acquire(next)?);
                        ys
                    }
                };
                Ok(ys)
            };
            layer.forward(&self.cfg, &self.spec, l, &mut x, &rows, &self.kv[l], &mut run)?;
            shadow_time += stage.shadow_time;
            on_layer();
        }
        let x = x.finish()?;
        let last = chunk.start + chunk.len == tokens.len();
        let out = if all_logits {
            x.narrow(0, 0, n_valid)?
        } else if last {
            x.narrow(0, n_valid - 1, 1)?
        } else {
            x.narrow(0, 0, 0)?
        };
        drop(cpu);
        Ok((out, shadow_time))
    }

    /// The layer's shapes, for analytic stage costs ([`AnalyticCosts`]).
    pub fn layer_shape(&self) -> LayerShape {
        let c = &self.cfg;
        LayerShape { hidden: c.hidden, ffn: c.ffn, n_head: c.n_head, n_kv_head: c.n_kv_head, head_dim: c.head_dim }
    }

    /// Stage costs for the policies that rank by cost: analytic, with the host's rough rates
    /// (only their ratios matter to a ranking).
    fn estimate(&self) -> AnalyticCosts {
        AnalyticCosts { shape: self.layer_shape(), rates: Rates::HOST }
    }

    fn npu_pool(&mut self) -> Result<Option<Arc<rayon::ThreadPool>>> {
        let Some(threads) = self.sched.npu_threads else {
            return Ok(None);
        };
        if let Some((t, pool)) = &self.npu_pool {
            if *t == threads {
                return Ok(Some(pool.clone()));
            }
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("npu-queue-{i}"))
            .build()
            .map_err(|e| Error::Input(format!("cannot start the NPU queue's {threads} threads: {e}")))?;
        let pool = Arc::new(pool);
        self.npu_pool = Some((threads, pool.clone()));
        Ok(Some(pool))
    }

    /// Whether a prefill's chunks run one after another whatever the policy: in order, or with
    /// the host executor as the NPU and no NPU queue of its own (`npu_threads: None`), whose
    /// "NPU" and CPU stages share the cores (see `run_prefill`).
    pub fn chunks_in_order(&self) -> bool {
        self.sched.policy == Policy::InOrder || (self.sched.npu_threads.is_none() && self.device.on_host())
    }

    /// Whether a prefill of `chunks` chunks runs them in order although the policy would not
    /// ([`Self::chunks_in_order`] for another reason than the policy; one chunk has no order).
    pub fn policy_set_aside(&self, chunks: usize) -> bool {
        self.chunks_in_order() && self.sched.policy != Policy::InOrder && chunks > 1
    }

    /// How the next prefills are scheduled.
    pub fn set_sched(&mut self, sched: SchedOptions) {
        self.sched = sched;
    }
    pub fn sched(&self) -> &SchedOptions {
        &self.sched
    }
    /// The last prefill's DAG and schedule (what ran where and when): for traces and bubble rates.
    pub fn last_run(&self) -> Option<&(SubgraphDag, Schedule)> {
        self.last_run.as_ref()
    }

    /// The graphs a CPU margin runs its linears on, on any row count
    /// ([`PreparedGraph::execute_rows`]): the NPU's own stage graphs when the NPU is the host
    /// executor (no other weights, ~4x the speed of candle's Q8_0 matmul at 24-100 rows:
    /// measured 32-40 vs 9-10 GMAC/s on 2 cores); beside a real NPU, whose graphs have static
    /// shapes, the same stage graphs on a host executor with the NPU's numerics
    /// ([`NpuDevice::margin_device`]). Either way margin rows get the NPU rows' W8A8 + shadow
    /// arithmetic: exactly with the host executor, as far as the numerics model matches the
    /// library beside a real NPU (99.6% of stage outputs bit-exact), which is not far enough to
    /// keep near ties, so a real NPU pads by default ([`SchedOptions::for_device`]). `None` for
    /// a float prefill beside a real NPU: its margin runs the decode weights.
    fn margin_graphs(&mut self, plan: &ChunkPlan, precision: Precision) -> Result<Option<Arc<Vec<Vec<PreparedGraph>>>>> {
        // A float prefill beside a real NPU: no host copy of the float weights to run them on.
        if !plan.chunks.iter().any(|c| c.margin) || (precision == Precision::F32 && !self.device.on_host()) {
            return Ok(None);
        }
        let set = if self.device.on_host() { GraphSet::Npu(plan.chunk_len) } else { GraphSet::Margin };
        let graphs = self.graphs_for(set, precision)?;
        Ok(graphs.iter().flatten().all(PreparedGraph::any_rows).then_some(graphs))
    }

    fn graphs_for(&mut self, set: GraphSet, precision: Precision) -> Result<Arc<Vec<Vec<PreparedGraph>>>> {
        if let Some(g) = self.graphs.get(&(set, precision)) {
            return Ok(g.clone());
        }
        let t = std::time::Instant::now();
        // A margin's host graphs run on any row count: described with one.
        let (device, rows) = match set {
            GraphSet::Npu(m) => (self.device.clone(), m),
            GraphSet::Margin => (self.device.margin_device(), 1),
        };
        let graphs = (0..self.cfg.n_layer)
            .map(|l| self.layer_graphs(l, rows, precision)?.iter().map(|g| device.prepare(g)).collect::<Result<Vec<_>>>())
            .collect::<Result<Vec<_>>>()?;
        tracing::info!(
            ?set,
            ?precision,
            layers = graphs.len(),
            secs = t.elapsed().as_secs_f32(),
            executor = device.executor_name(),
            "prepared stage graphs"
        );
        let graphs = Arc::new(graphs);
        self.graphs.insert((set, precision), graphs.clone());
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

fn qmatmul_dims(m: &QMatMul) -> Vec<usize> {
    match m {
        QMatMul::QTensor(q) => q.shape().dims().to_vec(),
        QMatMul::Tensor(t) | QMatMul::TensorF16(t) => t.dims().to_vec(),
    }
}

/// A config and spec the engine can run, or an error naming the checkpoint and what is wrong.
fn check_spec(cfg: &Config, spec: &FamilySpec, ckpt: &dyn Checkpoint) -> Result<()> {
    let bad = |reason: String| Err(Error::Model { path: ckpt.path().to_path_buf(), reason });
    cfg.validate().or_else(bad)?;
    if spec.layers.len() != cfg.n_layer {
        return bad(format!("{} layer specs for {} layers", spec.layers.len(), cfg.n_layer));
    }
    if spec.rope_dims == 0 || spec.rope_dims % 2 != 0 || spec.rope_dims > cfg.head_dim {
        return bad(format!("RoPE over {} dimensions of a head of {}", spec.rope_dims, cfg.head_dim));
    }
    if spec.layers.iter().any(|l| l.window == Some(0)) {
        return bad("a sliding window of 0 positions".into());
    }
    // f32 RoPE tables: a base of 0, a negative or a non-finite one gives NaN or constant angles.
    if let Some(l) = spec.layers.iter().find(|l| !(l.rope_base.is_finite() && l.rope_base > 1.0)) {
        return bad(format!("RoPE base {} is not a finite number > 1", l.rope_base));
    }
    let scales = [("attention scale", Some(spec.attn_scale)), ("embedding scale", spec.embed_scale)];
    if let Some((what, v)) = scales.into_iter().find_map(|(w, v)| v.filter(|v| !(v.is_finite() && *v > 0.0)).map(|v| (w, v))) {
        return bad(format!("{what} {v} is not a finite number > 0"));
    }
    Ok(())
}

/// The NPU stages of one layer of one chunk: each input goes to the NPU (quantized, outliers
/// extracted), each output comes back with its shadow added.
struct Stage<'a> {
    layer: &'a Layer,
    l: usize,
    /// W8A8 input points and whether the shadow path runs (set with a profile).
    points: Option<&'a [InputPoint; 4]>,
    shadow: bool,
    a16: Option<&'a [Quant; 4]>,
    /// CPU time of the shadow path in this layer.
    shadow_time: Duration,
    rows: &'a Rows,
    precision: Precision,
}

impl Stage<'_> {
    /// The NPU input of stage `s` from the CPU activation `h` (`[m, K]`), and its outliers.
    fn prepare(&mut self, s: usize, h: &Tensor) -> Result<(TensorData, Outliers)> {
        let missing = || Error::Input(format!("{:?} prefill of layer {} without a quant profile", self.precision, self.l));
        Ok(match self.precision {
            Precision::F32 => (TensorData::F32(h.flatten_all()?.to_vec1::<f32>()?), Outliers::default()),
            Precision::W8A8 => {
                let point = &self.points.ok_or_else(missing)?[s];
                // The quantized input and the outliers straight from the activation's storage.
                let (shadow, n_valid) = (self.shadow, self.rows.n_valid);
                let (x, o, secs) = with_f32(h, |vals| {
                    let t = Instant::now();
                    // A pruned stage skips extraction (its outliers would go unused).
                    let o = if shadow { point.extract(vals, n_valid) } else { Outliers::default() };
                    let secs = t.elapsed();
                    (TensorData::U8(point.clip_quantize(vals)), o, secs)
                })?;
                self.shadow_time += secs;
                (x, o)
            }
            Precision::W8A16 => {
                let q = self.a16.ok_or_else(missing)?[s];
                (with_f32(h, |vals| TensorData::from_f32(vals, DType::U16, Some(q)))?, Outliers::default())
            }
        })
    }

    /// Stage `s`'s NPU outputs as `[m, N]` tensors, one per linear, with bias and shadow added.
    fn finish(&mut self, s: usize, outs: Vec<TensorData>, outliers: &Outliers) -> Result<Vec<Tensor>> {
        let t = Instant::now();
        let ys = self.layer.stages[s]
            .iter()
            .zip(outs)
            .map(|(lin, out)| {
                let TensorData::F32(mut y) = out else {
                    return Err(Error::Input(format!("NPU stage of {} returned {:?}, expected F32", lin.name(), out.dtype())));
                };
                lin.finish(outliers, &mut y)?;
                Ok(Tensor::from_vec(y, (self.rows.m, lin.dims().0), &Device::Cpu)?)
            })
            .collect();
        if !outliers.is_empty() {
            self.shadow_time += t.elapsed();
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
    let mut nll = 0f64;
    for i in 0..tokens.len() - 1 {
        let t = tokens[i + 1];
        let lp = lp[i].get(t as usize).ok_or_else(|| Error::Input(format!("token {t} is beyond the {} logits of a row", lp[i].len())))?;
        nll -= *lp as f64;
    }
    Ok(nll / (tokens.len() - 1) as f64)
}

/// Greedy or sampled next token from logits (candle's `LogitsProcessor` conventions).
pub fn logits_f32(logits: &Tensor) -> Result<Vec<f32>> {
    Ok(logits.to_dtype(CDType::F32)?.flatten_all()?.to_vec1()?)
}

/// Top-1 token.
pub fn argmax(logits: &Tensor) -> Result<u32> {
    Ok(logits.argmax(D::Minus1)?.to_scalar::<u32>()?)
}
