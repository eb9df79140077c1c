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
//! CPU  shadow; act(gate) * up; quantize + extract (point blk.L.ffn_down_in)
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
//!
//! The stage list above is one value, [`STAGES`] (`transformer/stages.rs`): loading, the prefill
//! DAG, graph names, quantization points and calibration read it. This file holds loading, the
//! layer forward (written once: prefill's stages and decode both run it) and decode;
//! `transformer/prefill.rs` the plan, schedule and run loop over a prompt's chunks;
//! `transformer/calibrate.rs` the quantization state and the offline passes that measure it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{DType as CDType, Device, Tensor, D};
use candle_npu::kernels::rows::{self, with_f32};
use candle_npu::linear::DecodeMatrix;
use candle_npu::sched::{simulate, AnalyticCosts, DagChunk, LayerShape, Policy, Processor, Rates, Runner, Schedule, StageDesc, SubgraphDag};
use candle_npu::{
    Calibrator, Chunk, ChunkPlan, DType, DecodeWeights, Error, Graph, InputPoint, NpuDevice, Outliers, PointStats, PreparedGraph, Quant, QuantProfile, Result,
    ShadowLinear, Tail, TensorData, TensorId, WeightQuant,
};

use crate::attention::{attend, KvCache, KvType, QkNorm, Rows};
use crate::checkpoint::{Checkpoint, NameMap};
pub use crate::sequence::Sequence;
pub use crate::spec::{Config, FamilySpec};

mod calibrate;
mod layer_graph;
mod prefill;
mod stages;

use prefill::GraphSet;
pub use prefill::{prefill_dag, Logits, PrefillOptions, PrefillPlan, PrefillRows, SchedOptions};
pub use stages::{linear_names, point, Dim, LinearDef, StageDef, N_STAGES, STAGES};
use stages::{DOWN, GATE_UP, O, QKV};

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
    /// INT8 weights, u16 activations over W8A8's clip ranges, shadow outliers: W8A8's split of
    /// each activation with a grid 256 times finer inside the range.
    W8A16Shadow,
}

impl Precision {
    /// The precision a model takes on `device` when none is given: shadow W8A16 on the HTP and
    /// on the host executor with its numerics (each layer one graph, the outliers through float
    /// weights inside it: [`PrefillPlan::Layers`]), shadow W8A8 on the host executor (llm.npu's
    /// four stages per layer, the host's fastest: the reference). Why, measured: `docs/chat.md`
    /// and `docs/accuracy.md` (accuracy), `docs/phone_model.md` (speed on a phone).
    pub fn for_device(device: &NpuDevice) -> Precision {
        match device.numerics() {
            candle_npu::Numerics::Htp => Precision::W8A16Shadow,
            candle_npu::Numerics::Exact => Precision::W8A8,
        }
    }

    /// Whether a layer can be one graph at this precision ([`PrefillPlan::Layers`]): all but
    /// W8A8, whose 8-bit grid needs the CPU's float outliers between the linears.
    pub fn has_whole_layers(self) -> bool {
        self != Precision::W8A8
    }
}

/// The chunk length a model takes on `device` when none is given (the library's and the
/// command line's): 256, the paper's; 32 on the HTP library's x86 emulator, whose 0.3-1 GMAC/s
/// takes minutes over a 256-row chunk of even SmolLM2 (30-70 s over 32 rows, 2026-11-29).
pub fn default_chunk_len(device: &NpuDevice) -> usize {
    match !device.on_host() && cfg!(target_arch = "x86_64") {
        true => 32,
        false => 256,
    }
}

/// How to load a model, set once: everything here is checked against the model as it loads.
/// The executor is the [`NpuDevice`] the model is loaded onto.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Arithmetic of the NPU graphs in prefill. `None`: [`Precision::for_device`] of the device
    /// loaded onto (shadow W8A16 on the HTP and its numerics model, shadow W8A8 on the host).
    pub precision: Option<Precision>,
    /// How the CPU's decode copy of the weights is stored.
    pub decode_weights: DecodeWeights,
    /// How the NPU's INT8 weights are scaled (per output channel by default).
    pub weights: WeightQuant,
    /// Linears (by their names in a layer: `attn_q`, `attn_k`, `attn_v`, `attn_output`,
    /// `ffn_gate`, `ffn_up`, `ffn_down`: that linear in every layer; `blk.L.ffn_down`: layer L's)
    /// whose NPU weight is INT8 plus an INT8 residual ([`WeightQuant::PerChannelResidual`]:
    /// about INT16's error, twice the bytes and MACs), whatever `weights` says. Empty by default.
    pub residual: Vec<String>,
    /// Linears (named as in `residual`) whose NPU weight is 4-bit LPBQ in blocks of 32
    /// ([`WeightQuant::Lpbq`]: half INT8's NPU bytes; requantized from a 4-bit file it costs
    /// perplexity, `docs/npu_weights.md`), whatever `weights` says. Empty by default; with u16
    /// activations only.
    pub lpbq: Vec<String>,
    /// Rows of the NPU graphs a prompt is cut into (the chunk-sharing length), 1 up to the
    /// model's context: checked at load. `None`: [`default_chunk_len`] of the device, or the
    /// model's context where that is shorter. A smaller length pads less on short prompts, a larger one pays the NPU's
    /// per-graph cost less often.
    pub chunk_len: Option<usize>,
    /// How prefill is scheduled. `None`: [`SchedOptions::for_device`] of the device loaded onto.
    pub sched: Option<SchedOptions>,
    /// Only the first `n` layers (1 up to the model's), then the final norm and the output: the
    /// model's own draft for speculative decoding ([`crate::Pipeline::set_draft`]). `None`: all.
    pub layers: Option<usize>,
    /// How the KV cache holds keys and values (prefill attention, decode, saved sessions):
    /// f16 by default (llama.cpp's), half of f32's memory at the same perplexity and chat
    /// answers (`docs/memory.md`); f32 for comparisons with candle's own caches.
    pub kv: KvType,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            precision: None,
            decode_weights: DecodeWeights::Checkpoint,
            weights: WeightQuant::PerChannel,
            residual: vec![],
            lpbq: vec![],
            chunk_len: None,
            sched: None,
            layers: None,
            kv: KvType::F16,
        }
    }
}

/// One decoder layer: its norms and the seven linears, grouped by the NPU stage that runs them.
struct Layer {
    attn_norm: Tensor,
    ffn_norm: Tensor,
    qk_norm: Option<QkNorm>,
    /// Gemma's sandwich norms: on the attention output and the FFN output.
    post_norms: Option<(Tensor, Tensor)>,
    /// The linears of each stage of [`STAGES`], in its order.
    stages: [Vec<ShadowLinear>; N_STAGES],
}

impl Layer {
    fn linears(&self) -> impl Iterator<Item = &ShadowLinear> {
        self.stages.iter().flatten()
    }

    /// The layer, written once: the residual stream (`[m, hidden]`) through attention and FFN.
    /// `run(s, h)` computes the linears of stage `s` on `h`: the NPU stage graph with its shadow
    /// outliers in prefill, candle CPU matmuls in decode. Everything else here runs on the CPU.
    /// `attn`: the sequences whose rows these are (one in prefill; several in a batched decode),
    /// each attending over its own cache.
    fn forward(&self, cfg: &Config, spec: &FamilySpec, l: usize, x: &mut Residual, attn: &[Attn], run: &mut StageFn<'_>) -> Result<()> {
        let eps = cfg.rms_eps as f32;
        let h = x.add_norm(&self.attn_norm, eps)?;
        let [q, k, v]: [Tensor; 3] = run(QKV, &h)?.try_into().map_err(|_| Error::Internal("QKV stage must return three outputs".into()))?;
        let one = |a: &Attn| -> Result<Tensor> {
            let rows = |t: &Tensor| -> Result<Tensor> {
                Ok(match (a.at, a.rows.m) == (0, t.dim(0)?) {
                    true => t.clone(),
                    false => t.narrow(0, a.at, a.rows.m)?,
                })
            };
            // Uncontended: a layer's attention runs for one chunk of a sequence at a time, in
            // chunk order (the schedule's cross-chunk edge), and each sequence has its own cache.
            let mut kv = a.kv.lock().unwrap_or_else(|e| e.into_inner());
            attend(cfg, spec, &spec.layers[l], self.qk_norm.as_ref(), &mut kv, &rows(&q)?, &rows(&k)?, &rows(&v)?, a.rows)
        };
        let a = match attn {
            [a] => one(a)?,
            _ => {
                // Several sequences (batched decode): their attentions are independent, a few
                // tens of microseconds each at a short context, each too small to split over the
                // cores itself (`attention::split_keys`), so the sequences are spread over them
                // instead: on one core they were a fifth of a four-stream step with the other
                // core idle. Each sequence's arithmetic is what it is alone.
                let parts: Vec<std::sync::Mutex<Option<Result<Tensor>>>> = attn.iter().map(|_| Default::default()).collect();
                let helpers = rayon::current_num_threads().saturating_sub(1);
                candle_npu::kernels::claim::for_each_chunk(attn.len(), 1, helpers, &|range| {
                    for i in range {
                        *parts[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(one(&attn[i]));
                    }
                });
                let parts = parts
                    .into_iter()
                    .map(|p| {
                        p.into_inner().unwrap_or_else(|e| e.into_inner()).unwrap_or_else(|| Err(Error::Internal("a sequence's attention did not run".into())))
                    })
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, 0)?
            }
        };
        let mut o = run(O, &a)?.remove(0);
        if let Some((post_attn, _)) = &self.post_norms {
            o = candle_nn::ops::rms_norm(&o, post_attn, eps)?;
        }
        x.push(o)?;
        let h = x.add_norm(&self.ffn_norm, eps)?;
        let [gate, up]: [Tensor; 2] = run(GATE_UP, &h)?.try_into().map_err(|_| Error::Internal("gate/up stage must return two outputs".into()))?;
        let hidden = spec.activation.gated(&gate, &up)?;
        let mut d = run(DOWN, &hidden)?.remove(0);
        if let Some((_, post_ffn)) = &self.post_norms {
            d = candle_nn::ops::rms_norm(&d, post_ffn, eps)?;
        }
        x.push(d)
    }
}

/// Where a layer's attention reads and appends for rows `at..at + rows.m` of a pass: one
/// sequence's rows and its cache of this layer.
struct Attn<'a> {
    at: usize,
    rows: &'a Rows,
    kv: &'a Mutex<KvCache>,
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
    embed: DecodeMatrix,
    final_norm: Tensor,
    lm_head: DecodeMatrix,
    /// Whether the output table is the embedding table.
    tied: bool,
    layers: Vec<Layer>,
    profile: Option<QuantProfile>,
    /// Per layer, per stage: the input point (from the profile).
    points: Vec<[InputPoint; N_STAGES]>,
    /// Per layer: whether its shadow path runs (see [`Model::set_shadow_layers`]).
    shadow_on: Vec<bool>,
    /// How the INT8 weights are scaled ([`LoadOptions::weights`]).
    weights: WeightQuant,
    /// Per layer, per stage: the u16 quantization over the observed range (W8A16).
    a16: Vec<[Quant; N_STAGES]>,
    /// The prepared graphs, by set and precision: prepared on first use by whichever
    /// conversation needs them, then shared by all.
    graphs: Mutex<HashMap<(GraphSet, Precision), Arc<Vec<Vec<PreparedGraph>>>>>,
    /// How a new conversation's KV caches hold keys and values ([`LoadOptions::kv`]).
    kv_type: KvType,
    /// The model's own conversation: the `&mut self` entry points ([`Model::prefill`],
    /// [`Model::decode`], ...) run on it; [`Model::prefill_sequence`] and
    /// [`Model::decode_sequences`] on sequences of their callers' (`&self`).
    seq: Sequence,
    sched: SchedOptions,
    /// Rows of the NPU graphs a prompt is cut into ([`LoadOptions::chunk_len`]).
    chunk_len: usize,
    /// One-thread pool the NPU stages run in when [`SchedOptions::npu_threads`] is set.
    npu_pool: Mutex<Option<(usize, Arc<rayon::ThreadPool>)>>,
    /// Told of each (chunk, layer) a prefill finishes ([`Model::set_progress`]).
    progress: Mutex<Option<Progress>>,
    /// CPU time of the shadow path (outlier extraction and the float product) since the last
    /// [`Model::take_shadow_time`].
    shadow_time: Mutex<Duration>,
}

/// Called after every (chunk, layer) of a prefill with (done, total).
pub type Progress = Box<dyn FnMut(usize, usize) + Send + Sync>;

impl Model {
    /// Build a model from `ckpt`, whose tensors `names` maps from the engine's (GGUF) names.
    pub fn load(
        mut cfg: Config,
        mut spec: FamilySpec,
        ckpt: &dyn Checkpoint,
        names: &NameMap,
        mut model_id: String,
        device: NpuDevice,
        opts: LoadOptions,
    ) -> Result<Self> {
        check_spec(&cfg, &spec, ckpt)?;
        opts.kv.check_head_dim(cfg.head_dim)?;
        let all_layers = cfg.n_layer;
        if let Some(n) = opts.layers {
            if n == 0 || n > all_layers {
                return Err(Error::Input(format!("the first {n} layers of {}: expected 1 to {all_layers}", ckpt.path().display())));
            }
            // Another model: its own id, so that no profile or graph of the whole one is taken.
            (cfg.n_layer, model_id) = (n, format!("{model_id}-first-{n}-layers"));
            spec.layers.truncate(n);
        }
        let roles: Vec<&str> = linear_names().collect();
        // A role names that linear in every layer, `blk.L.role` the one of layer L.
        let known = |r: &str| match r.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
            Some((l, role)) => l.parse::<usize>().is_ok_and(|l| l < cfg.n_layer) && roles.contains(&role),
            None => roles.contains(&r),
        };
        for (what, list) in [("residual", &opts.residual), ("LPBQ", &opts.lpbq)] {
            if let Some(bad) = list.iter().find(|r| !known(r)) {
                return Err(Error::Input(format!(
                    "{what} weights for '{bad}': a layer's linears are {}, in every layer, or one layer's as blk.L.<linear> with L below {}",
                    roles.join(", "),
                    cfg.n_layer
                )));
            }
        }
        if let Some(both) = opts.lpbq.iter().find(|r| opts.residual.contains(r)) {
            return Err(Error::Input(format!("'{both}' is asked for both LPBQ and residual weights: one form per linear")));
        }
        // Before the weights are read and quantized, not after.
        let chunk_len = prefill::check_chunk_len(opts.chunk_len.unwrap_or_else(|| default_chunk_len(&device).min(cfg.context_len)), cfg.context_len)?;
        let precision = opts.precision.unwrap_or_else(|| Precision::for_device(&device));
        let any_lpbq = matches!(opts.weights, WeightQuant::Lpbq { .. }) || !opts.lpbq.is_empty();
        if any_lpbq && precision == Precision::W8A8 {
            // Not offered on the host either: the host executor computes what the NPU would.
            return Err(Error::Input(
                "4-bit LPBQ weights need u16 activations (W8A16 or shadow W8A16, `--u16-activations`): the HTP takes a 4-bit weight from u8 activations only into an 8-bit output (docs/npu_weights.md)".into(),
            ));
        }
        if any_lpbq && !device.on_host() {
            tracing::info!(
                "4-bit LPBQ weights through the QNN library: each graph it prepares is checked against the HTP numerics model and prepared again when wrong (its prepare of LPBQ graphs sometimes is; docs/npu_weights.md)"
            );
        }
        let sched = opts.sched.clone().unwrap_or_else(|| SchedOptions::for_device(&device, precision));
        sched.validate(cfg.context_len)?;
        sched.check_precision(precision)?;
        let vector = |name: String| ckpt.vector(&names(&name).name);
        // The tables and the final norm first: their shapes tell a wrong config before the layers'
        // quantization takes its seconds.
        let embed = ckpt.table(&names("token_embd.weight").name, opts.decode_weights)?;
        let tied = spec.tied_output || !ckpt.contains(&names("output.weight").name);
        let lm_head = match !tied {
            true => ckpt.table(&names("output.weight").name, opts.decode_weights)?,
            false => embed.clone(), // tied
        };
        let final_norm = vector("output_norm.weight".into())?;
        for (name, dims, want) in [
            ("token_embd.weight", dims_of(&embed), vec![cfg.vocab, cfg.hidden]),
            ("output.weight", dims_of(&lm_head), vec![cfg.vocab, cfg.hidden]),
            ("output_norm.weight", final_norm.dims().to_vec(), vec![cfg.hidden]),
        ] {
            if dims != want {
                return Err(Error::Model { path: ckpt.path().to_path_buf(), reason: format!("{name}: shape {dims:?}, the config implies {want:?}") });
            }
        }
        let hd = cfg.head_dim;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for l in 0..cfg.n_layer {
            let lin = |def: &LinearDef| -> Result<ShadowLinear> {
                let full = format!("blk.{l}.{}", def.name);
                let shape = (def.out.of(&cfg), def.input.of(&cfg));
                let src = ckpt.mapped_matrix(&names(&format!("{full}.weight")))?;
                if src.dims() != shape {
                    return Err(Error::Model {
                        path: ckpt.path().to_path_buf(),
                        reason: format!("{}: shape {:?}, the config implies {shape:?}", src.describe(), src.dims()),
                    });
                }
                let b = match def.qkv_bias && spec.qkv_bias {
                    true => Some(vector(format!("{full}.bias"))?.to_vec1::<f32>()?),
                    false => None,
                };
                let named = |list: &[String]| list.iter().any(|r| r == def.name || *r == full);
                let weights = match (named(&opts.residual), named(&opts.lpbq)) {
                    (true, _) => WeightQuant::PerChannelResidual,
                    (_, true) => WeightQuant::Lpbq { block: 32 },
                    _ => opts.weights,
                };
                ShadowLinear::new(full, src, b, weights, opts.decode_weights)
            };
            let stages = STAGES.iter().map(|s| s.linears.iter().map(lin).collect::<Result<Vec<_>>>()).collect::<Result<Vec<_>>>()?;
            let stages: [Vec<ShadowLinear>; N_STAGES] = stages.try_into().map_err(|_| Error::Internal("a stage list of another length".into()))?;
            let h = cfg.hidden;
            let norm = |name: &str, len: usize| -> Result<Tensor> {
                let t = vector(format!("blk.{l}.{name}.weight"))?;
                match t.dims() == [len] {
                    true => Ok(t),
                    false => Err(Error::Model { path: ckpt.path().to_path_buf(), reason: format!("blk.{l}.{name}: shape {:?}, expected [{len}]", t.dims()) }),
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
        // The config against the checkpoint the other way: a layer past the last one the config
        // names (a config that drops layers would run a truncated model without a word).
        let next = names(&format!("blk.{}.attn_norm.weight", cfg.n_layer)).name;
        if cfg.n_layer == all_layers && ckpt.contains(&next) {
            return Err(Error::Model {
                path: ckpt.path().to_path_buf(),
                reason: format!("the checkpoint has more layers than the config's {} ('{next}' exists)", cfg.n_layer),
            });
        }
        let n = cfg.n_layer;
        Ok(Model {
            chunk_len,
            cfg,
            spec,
            model_id,
            device,
            precision,
            embed,
            final_norm,
            lm_head,
            tied,
            layers,
            profile: None,
            points: vec![],
            a16: vec![],
            shadow_on: vec![],
            weights: opts.weights,
            shadow_time: Mutex::new(Duration::ZERO),
            graphs: Mutex::new(HashMap::new()),
            kv_type: opts.kv,
            seq: Sequence::new(n, opts.kv),
            sched,
            npu_pool: Mutex::new(None),
            progress: Mutex::new(None),
        })
    }

    /// How the family's layer computes.
    pub fn spec(&self) -> &FamilySpec {
        &self.spec
    }

    /// Bytes of the linears' hot columns (the CPU shadow path's contiguous INT8 columns): held
    /// while the plan has that path ([`SchedOptions`]' `plan`: llm.npu's stages), none for
    /// whole layers.
    pub fn hot_bytes(&self) -> usize {
        self.linears().map(|l| l.hot_bytes()).sum()
    }

    /// What the model's weights take, in bytes, by part: a line for logs and the examples.
    pub fn weight_bytes(&self) -> String {
        let mb = |b: usize| b as f64 / 1e6;
        let decode: usize = self.linears().map(|l| l.decode().bytes()).sum();
        let int8: usize = self.linears().map(|l| l.int8_bytes()).sum();
        let hot = self.hot_bytes();
        let embed = self.embed.bytes();
        let output = if self.tied { 0 } else { self.lm_head.bytes() };
        format!(
            "linears' decode weights {:.0} MB, embedding {:.0} MB{}, INT8 held apart {:.0} MB, hot columns {:.0} MB (plus the executor's graph weights)",
            mb(decode),
            mb(embed),
            if self.tied { " (tied output)".to_string() } else { format!(", output {:.0} MB", mb(output)) },
            mb(int8),
            mb(hot)
        )
    }

    /// The output table in its decode form (the embedding table when tied).
    pub fn output(&self) -> &DecodeMatrix {
        &self.lm_head
    }

    /// The model's sizes.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Identifies the weights (sha256 of the checkpoint's files): quant profiles and saved KV
    /// states are checked against it.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// The device the NPU stages are prepared and run on.
    pub fn device(&self) -> &NpuDevice {
        &self.device
    }

    /// Arithmetic of the NPU stages in prefill ([`LoadOptions::precision`]).
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Tokens in the KV cache of the model's own conversation.
    pub fn position(&self) -> usize {
        self.seq.pos
    }

    /// The quant profile in use, once one is set ([`Model::set_profile`]): clip ranges, hot
    /// channels, layer importance.
    pub fn profile(&self) -> Option<&QuantProfile> {
        self.profile.as_ref()
    }

    /// Every linear layer, in layer and stage order.
    pub fn linears(&self) -> impl Iterator<Item = &ShadowLinear> {
        self.layers.iter().flat_map(Layer::linears)
    }

    /// How the KV cache holds keys and values ([`LoadOptions::kv`]).
    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// Forget the KV cache.
    pub fn clear(&mut self) {
        self.seq.clear();
    }

    /// The prepared graphs, to change (no conversation runs while the model is borrowed so).
    fn graphs_mut(&mut self) -> &mut HashMap<(GraphSet, Precision), Arc<Vec<Vec<PreparedGraph>>>> {
        self.graphs.get_mut().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the model's own conversation (taken out for the call: `f` has the model
    /// shared, as every conversation does).
    fn on_own<R>(&mut self, f: impl FnOnce(&Self, &mut Sequence) -> Result<R>) -> Result<R> {
        let mut seq = std::mem::take(&mut self.seq);
        let r = f(self, &mut seq);
        self.seq = seq;
        r
    }

    /// Decode one token at the current position; returns its logits, `[vocab]`.
    pub fn decode(&mut self, token: u32) -> Result<Tensor> {
        self.on_own(|m, s| Ok(m.decode_sequences(&mut [(s, &[token])])?.squeeze(0)?))
    }

    /// Decodes the next tokens of several conversations in one pass over the weights: `batch`
    /// holds each sequence with its tokens, each a decode step of its own (one token, or a
    /// speculative verifier's several: the logits that many steps would give). Returns the
    /// logits of every row, the sequences' one after another, `[rows, vocab]`; row for row bit
    /// for bit what decoding that token alone in its sequence gives (the decode kernels compute
    /// each row on its own; each sequence's attention reads its own cache), with decode weights
    /// in blocks, every model's default: float reference weights ([`DecodeWeights::F32`]) go
    /// through candle's matmul, whose sums follow the row count. Decode is memory-bound where
    /// the weights are large: they are read once for every row. On an error every sequence is
    /// left as it was; afterwards [`Sequence::rewind`] drops rows not accepted.
    pub fn decode_sequences(&self, batch: &mut [(&mut Sequence, &[u32])]) -> Result<Tensor> {
        let x = self.run_cpu(batch, None, true)?;
        self.logits(&x)
    }

    /// Several decode steps in one pass over the weights ([`Model::decode_sequences`] of the
    /// model's own conversation): the logits of `tokens`, `[n, vocab]`. A speculative
    /// verifier's pass: after it, [`Model::rewind`] drops the rows not accepted.
    pub fn decode_rows(&mut self, tokens: &[u32]) -> Result<Tensor> {
        self.on_own(|m, s| m.decode_sequences(&mut [(s, tokens)]))
    }

    /// Back to the first `position` tokens (at most the current position): the KV cache rows
    /// after it are dropped, exactly (a rejected speculation leaves no trace).
    pub fn rewind(&mut self, position: usize) -> Result<()> {
        self.seq.rewind(position)
    }

    /// The layers on the CPU for each `(sequence, its new tokens)` of `batch` from its
    /// position, the rows of all of them together through the linears (one pass over the
    /// weights), each sequence's attention over its own cache; returns the last layer's rows,
    /// the sequences' one after another. With `cal`, every stage's input is observed
    /// (calibration); `decode_rows`: each row's attention as its own decode step's. Sequences of
    /// the model's first layers ([`Model::sequence_of_layers`]) run only those. On an error
    /// every sequence holds what it held before.
    fn run_cpu(&self, batch: &mut [(&mut Sequence, &[u32])], cal: Option<&mut Calibrator>, decode_rows: bool) -> Result<Tensor> {
        let depth = batch.first().map_or(0, |(s, _)| s.kv.len());
        for (seq, tokens) in batch.iter() {
            self.check_sequence(seq, true)?;
            if seq.kv.len() != depth {
                return Err(Error::Input(format!("one pass over sequences of {depth} and {} layers: a batch runs the same layers", seq.kv.len())));
            }
            self.check_tokens(tokens)?;
            let n = tokens.len();
            if n == 0 || seq.pos + n > self.cfg.context_len {
                return Err(Error::Input(format!("{n} tokens at position {} do not fit the context of {}", seq.pos, self.cfg.context_len)));
            }
        }
        let bases: Vec<usize> = batch.iter().map(|(s, _)| s.pos).collect();
        let r = self.run_layers_cpu(batch, cal, decode_rows);
        if r.is_err() {
            // Layers before the failing one appended: each cache holds its first tokens again.
            batch.iter_mut().zip(bases).for_each(|((seq, _), base)| seq.truncate(base));
        }
        r
    }

    fn run_layers_cpu(&self, batch: &mut [(&mut Sequence, &[u32])], mut cal: Option<&mut Calibrator>, decode_rows: bool) -> Result<Tensor> {
        let ids: Vec<u32> = batch.iter().flat_map(|(_, t)| t.iter().copied()).collect();
        let mut x = Residual::new(self.embed_rows(&ids)?);
        let mut parts = Vec::with_capacity(batch.len());
        let mut at = 0;
        for (seq, tokens) in batch.iter() {
            let n = tokens.len();
            let rows = Rows::new(&self.spec, seq.pos, n, n, seq.pos + n)?;
            parts.push((at, if decode_rows { rows.decode_rows() } else { rows.decode_step() }));
            at += n;
        }
        let depth = batch.first().map_or(0, |(s, _)| s.kv.len());
        for (l, layer) in self.layers.iter().enumerate().take(depth) {
            let attn: Vec<Attn> = batch.iter().zip(&parts).map(|((seq, _), (at, rows))| Attn { at: *at, rows, kv: &seq.kv[l] }).collect();
            let mut run = |s: usize, h: &Tensor| {
                if let Some(cal) = cal.as_deref_mut() {
                    cal.observe(&point(l, STAGES[s].point), &h.flatten_all()?.to_vec1::<f32>()?, h.dim(1)?);
                }
                ShadowLinear::forward_all(&layer.stages[s], h)
            };
            layer.forward(&self.cfg, &self.spec, l, &mut x, &attn, &mut run)?;
        }
        let x = x.finish()?;
        batch.iter_mut().for_each(|(seq, tokens)| seq.pos += tokens.len());
        Ok(x)
    }

    /// What decides the values of every prefilled row besides the weights and the tokens: the
    /// precision, the weights' scaling, the quant profile (its SHA-256), the layers whose shadow
    /// path runs, and the device's numerics. Two models with the same id and this agree on every
    /// KV row; a saved KV state records it (`crate::session`).
    pub(crate) fn arithmetic(&self) -> String {
        let profile = match (self.precision, &self.profile) {
            (Precision::F32, _) | (_, None) => "none".to_string(),
            (_, Some(p)) => {
                let json = serde_json::to_vec(p).unwrap_or_default();
                <sha2::Sha256 as sha2::Digest>::digest(&json).iter().map(|b| format!("{b:02x}")).collect()
            }
        };
        let shadow: String = self.shadow_on.iter().map(|&on| if on { '1' } else { '0' }).collect();
        format!("{:?} prefill, {:?} weights, profile {profile}, shadow layers {shadow}, {:?} numerics", self.precision, self.weights, self.device.numerics())
    }

    /// Embeddings of `tokens`, `[n, hidden]` (scaled as the family says).
    fn embed_rows(&self, tokens: &[u32]) -> Result<Tensor> {
        let x = self.embed.rows(tokens)?;
        Ok(match self.spec.embed_scale {
            Some(s) => (x * s)?,
            None => x,
        })
    }

    fn logits(&self, rows: &Tensor) -> Result<Tensor> {
        let h = candle_nn::ops::rms_norm(rows, &self.final_norm, self.cfg.rms_eps as f32)?;
        // The output table in its decode form (SmolLM2's tied Q8_0 one, Gemma's tied embeddings,
        // Qwen's own output matrix): the engine's decode kernels, as for the linears.
        self.lm_head.forward(&h)
    }

    pub(crate) fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        match tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            Some(t) => Err(Error::Input(format!("token id {t} is outside the vocabulary of {}", self.cfg.vocab))),
            None => Ok(()),
        }
    }
}

fn dims_of(m: &DecodeMatrix) -> Vec<usize> {
    let (n, k) = m.dims();
    vec![n, k]
}

/// A config and spec the engine can run, or an error naming the checkpoint and what is wrong.
fn check_spec(cfg: &Config, spec: &FamilySpec, ckpt: &dyn Checkpoint) -> Result<()> {
    let bad = |reason: String| Err(Error::Model { path: ckpt.path().to_path_buf(), reason });
    cfg.validate().or_else(bad)?;
    if spec.layers.len() != cfg.n_layer {
        return bad(format!("{} layer specs for {} layers", spec.layers.len(), cfg.n_layer));
    }
    if spec.rope_dims == 0 || !spec.rope_dims.is_multiple_of(2) || spec.rope_dims > cfg.head_dim {
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
