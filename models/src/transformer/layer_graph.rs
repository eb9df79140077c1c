//! A decoder layer as one static graph (issue 48): the norms, the linears, RoPE, attention over a
//! KV cache of fixed capacity, the gated FFN and both residual adds, where llm.npu's plan runs
//! four graphs per layer and everything between them on the CPU ([`super::Layer::forward`], the
//! same arithmetic written for the CPU).
//!
//! The graph of layer `l` for chunks of `m` rows and a cache capacity `cap` takes
//! - `x` `[m, hidden]`: the residual stream, times [`STREAM_SCALE`] (FP16's range);
//! - `k_cache`, `v_cache` `[kv_heads, cap, head_dim]`: the layer's cache as the CPU holds it
//!   ([`KvCache`]), the tokens held first in each head, whatever after them;
//! - `mask` `[m, cap + m]`: 0 where a row sees a key (the cache's tokens, then the chunk's own
//!   rows), [`MASKED`] elsewhere: causality, the sliding window and the free cache rows are one
//!   input, so one graph serves every chunk position up to `cap`;
//! - `cos`, `sin` `[m, 1, head_dim]`: RoPE's tables over a whole head (each angle at both
//!   dimensions of its pair), broadcast over the heads;
//!
//! and returns the stream after the layer `[m, hidden]` (at the same scale), and the chunk's keys (after RoPE) and
//! values `[m, kv_heads, head_dim]`, which the CPU appends to the cache for the next chunk and
//! for decode.
//!
//! RoPE is `x cos + rotate(x) sin`, `rotate` a float FullyConnected of each head by a constant
//! ±1 matrix (the pairs of the checkpoint's layout: no weight rows are permuted, so the cache
//! holds the keys decode expects). Attention stacks each KV head's group of query heads as rows
//! of one batch of a rank-3 MatMul (Reshape and Transpose), as the CPU kernel tiles them.
//! Activations are F32 (the HTP computes them in FP16), quantized to u16 before each group of
//! linears: over the point's calibrated range ([`Precision::W8A16`]), or as shadow W8A16
//! ([`Precision::W8A16Shadow`]) with the outliers on the NPU: u16 over the clip range into the
//! INT8 weights, and the rest beyond it, `x - clamp(x)`, through the float weights (FP16 on the
//! HTP), as llm.npu's shadow path multiplies them on the CPU. No op needs the CPU.

use std::sync::Arc;

use candle_core::Tensor;
use candle_npu::{DType, Error, Graph, Op, Result, StaticData, TensorData, TensorId};

use super::stages::{DOWN, GATE_UP, O, QKV};
use super::{GraphSet, Model, Precision, Sequence};
use crate::attention::{rope_tables, KvCache};
use crate::spec::{Activation, RopeLayout};

/// Shadow W8A16 splits a point (its clip range's part into the INT8 weights, the outliers beyond
/// it through the float weights) only where its calibrated range is more than this many times
/// its clip range; elsewhere one u16 grid over the whole range serves (a step at most 8/65535 of
/// the clip range). SmolLM2's profile splits a third of its layers' MACs at 8x (the FFN's down
/// projections, mostly), every point at 1x; with both splits onto a second u16 grid (INT8
/// weights) the chat eval's first-token KL from F32 was the same (0.0161 and 0.0162, 120
/// conversations, 2026-11-28): the outliers' error is the INT8 weights', which the float
/// weights remove (0.0071 at 8x, `docs/chat.md`).
///
/// A point not split has no float path: its u16 grid spans exactly the calibrated range, and an
/// input the calibration text never produced saturates there. Gemma 3 on the chat eval's Hindi
/// conversations (calibrated on English) reached a first-token KL of 0.35-1.06 from F32 (W8A8
/// stages: 0.003-0.022), its answers still not derailed. Grids over 4x the range removed that
/// and lowered every model's KL (SmolLM2's whole set 0.0076 -> 0.0043), but moved two near ties
/// to worse answers (an emoji loop; the example through the library): not kept
/// (2026-11-29, `docs/chat.md`).
pub const SPLIT_RANGE: f32 = 8.0;

/// The scale the residual stream is carried at through the whole-layer graphs: the HTP computes
/// float tensors in FP16 (largest finite 65504), and Gemma 3 270M's stream reaches 1.04e5 (F32,
/// a Wikipedia sentence, 2026-11-29; SmolLM2's 2.2e4, Qwen2.5-Coder's 1e3): unscaled, its first
/// row turned infinite at layer 7 and the prefill's perplexity went from 1.00x F32 to 5x. The
/// CPU multiplies the embeddings by it and divides the last layer's stream by it; inside, each
/// branch's output is multiplied by it before its residual add (folded into Gemma's post-norm
/// weights), and the norms of the stream take its square into their epsilon, so every norm's
/// output is what it was. A power of two: exact wherever FP16 is normal.
pub const STREAM_SCALE: f32 = 1.0 / 64.0;

/// A masked score: finite and inside FP16's range (the HTP's scores are FP16, and -inf in its
/// Softmax is not defined), far enough below any real score that its weight is 0 in FP16.
pub const MASKED: f32 = -30000.0;

impl Model {
    /// The static graph of layer `l` for chunks of `m` rows against a cache of capacity `cap`
    /// (see the module docs): F32 throughout, W8A16 or shadow W8A16 (u16 activations into the
    /// INT8 linears, from the profile's ranges). W8A8 has none: its 8-bit grid needs the CPU's
    /// float outliers between the linears.
    pub fn layer_graph(&self, l: usize, m: usize, cap: usize, precision: Precision) -> Result<Graph> {
        if !precision.has_whole_layers() {
            return Err(Error::Input(
                "a whole-layer graph computes F32, W8A16 or shadow W8A16, not W8A8: its shadow outliers run on the CPU between the linears".into(),
            ));
        }
        if l >= self.layers.len() || m == 0 || cap == 0 {
            return Err(Error::Input(format!(
                "whole-layer graph of layer {l} (of {}), {m} rows, cache capacity {cap}: need a layer of the model and sizes >= 1",
                self.layers.len()
            )));
        }
        self.check_profile(precision)?;
        let (c, spec, layer) = (&self.cfg, &self.spec, &self.layers[l]);
        let (hidden, nh, nkv, hd) = (c.hidden, c.n_head, c.n_kv_head, c.head_dim);
        let (group, keys, eps) = (nh / nkv, cap + m, c.rms_eps as f32);
        let name = match precision {
            Precision::F32 => "f32",
            Precision::W8A16 => "w8a16",
            _ => "w8a16_shadow",
        };
        let mut g = Graph::new(format!("blk.{l}.layer.m{m}.c{cap}.{name}"));
        let f32_in = |g: &mut Graph, name: &str, shape: &[usize]| g.input(name, shape, DType::F32, None);
        let x = f32_in(&mut g, "x", &[m, hidden]);
        let k_cache = f32_in(&mut g, "k_cache", &[nkv, cap, hd]);
        let v_cache = f32_in(&mut g, "v_cache", &[nkv, cap, hd]);
        let mask = f32_in(&mut g, "mask", &[m, keys]);
        let cos = f32_in(&mut g, "cos", &[m, 1, hd]);
        let sin = f32_in(&mut g, "sin", &[m, 1, hd]);
        let b = Build { l, precision, eps };

        // Attention.
        let h = b.norm(&mut g, "attn_norm", x, &layer.attn_norm, STREAM_SCALE, 1.0)?;
        let qkv = b.linears(&mut g, self, l, QKV, h)?;
        let (q, k, v) = (qkv[0], qkv[1], qkv[2]);
        let mut q = b.reshape(&mut g, "q_heads", q, &[m, nh, hd]);
        let mut k = b.reshape(&mut g, "k_heads", k, &[m, nkv, hd]);
        if let Some(n) = &layer.qk_norm {
            q = b.norm(&mut g, "attn_q_norm", q, &n.q, 1.0, 1.0)?;
            k = b.norm(&mut g, "attn_k_norm", k, &n.k, 1.0, 1.0)?;
        }
        let rotation = g.constant(&format!("blk.{l}.rope_rotation"), &[hd, hd], StaticData::F32(Arc::new(rotation(spec.rope, spec.rope_dims, hd))), None);
        let q = b.rope(&mut g, "q", q, rotation, cos, sin, spec.attn_scale as f32);
        let k = b.rope(&mut g, "k", k, rotation, cos, sin, 1.0);
        let v = b.reshape(&mut g, "v_heads", v, &[m, nkv, hd]);
        // Each KV head's query heads stacked as rows: [m, nkv, group, hd] -> [nkv, group * m, hd].
        let q = b.reshape(&mut g, "q_groups", q, &[m, nkv, group, hd]);
        let q = b.transpose(&mut g, "q_by_kv_head", q, &[1, 2, 0, 3]);
        let q = b.reshape(&mut g, "q_stacked", q, &[nkv, group * m, hd]);
        let kt = b.transpose(&mut g, "k_by_head", k, &[1, 0, 2]);
        let vt = b.transpose(&mut g, "v_by_head", v, &[1, 0, 2]);
        let keys_all = b.concat(&mut g, "keys", k_cache, kt, 1);
        let values_all = b.concat(&mut g, "values", v_cache, vt, 1);
        let scores = g.op(&b.name("scores"), DType::F32, None, |output| Op::MatMul { a: q, b: keys_all, transpose_b: true, output }, &[nkv, group * m, keys]);
        let scores = b.reshape(&mut g, "scores_by_head", scores, &[nkv, group, m, keys]);
        let scores = g.binary(&b.name("masked"), scores, mask, DType::F32, None, |a, b, output| Op::Add { a, b, output });
        let weights = g.unary(&b.name("weights"), scores, DType::F32, None, |input, output| Op::Softmax { input, output });
        let weights = b.reshape(&mut g, "weights_stacked", weights, &[nkv, group * m, keys]);
        let att =
            g.op(&b.name("attention"), DType::F32, None, |output| Op::MatMul { a: weights, b: values_all, transpose_b: false, output }, &[nkv, group * m, hd]);
        let att = b.reshape(&mut g, "attention_groups", att, &[nkv, group, m, hd]);
        let att = b.transpose(&mut g, "attention_by_row", att, &[2, 0, 1, 3]);
        let att = b.reshape(&mut g, "attention_rows", att, &[m, nh * hd]);
        let o = b.linears(&mut g, self, l, O, att)?[0];
        let o = match &layer.post_norms {
            Some((post, _)) => b.norm(&mut g, "post_attention_norm", o, post, 1.0, STREAM_SCALE)?,
            None => b.scaled(&mut g, "attn_out_scaled", o, STREAM_SCALE),
        };
        let x = g.binary(&b.name("attn_residual"), x, o, DType::F32, None, |a, b, output| Op::Add { a, b, output });

        // FFN.
        let h = b.norm(&mut g, "ffn_norm", x, &layer.ffn_norm, STREAM_SCALE, 1.0)?;
        let gu = b.linears(&mut g, self, l, GATE_UP, h)?;
        let act = b.activation(&mut g, spec.activation, gu[0]);
        let hidden_act = g.binary(&b.name("ffn_act_up"), act, gu[1], DType::F32, None, |a, b, output| Op::Mul { a, b, output });
        let d = b.linears(&mut g, self, l, DOWN, hidden_act)?[0];
        let d = match &layer.post_norms {
            Some((_, post)) => b.norm(&mut g, "post_ffw_norm", d, post, 1.0, STREAM_SCALE)?,
            None => b.scaled(&mut g, "ffn_out_scaled", d, STREAM_SCALE),
        };
        let y = g.binary(&b.name("ffn_residual"), x, d, DType::F32, None, |a, b, output| Op::Add { a, b, output });
        g.mark_output(y);
        g.mark_output(k);
        g.mark_output(v);
        Ok(g)
    }

    /// The whole-layer graphs of every layer for chunks of `m` rows over a cache of `cap`,
    /// prepared on the model's device on first use and kept.
    pub(super) fn layer_graphs_for(&self, m: usize, cap: usize, precision: Precision) -> Result<Arc<Vec<Vec<candle_npu::PreparedGraph>>>> {
        let key = (GraphSet::Layers { m, cap }, precision);
        // Locked while they are prepared (see `prepare_sets`).
        let mut map = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        if let std::collections::hash_map::Entry::Vacant(slot) = map.entry(key) {
            let t = std::time::Instant::now();
            let nl = self.layers.len();
            let graphs = (0..nl).map(|l| Ok(vec![self.device.prepare(&self.layer_graph(l, m, cap, precision)?)?])).collect::<Result<Vec<_>>>()?;
            tracing::info!(
                layers = nl,
                rows = m,
                capacity = cap,
                ?precision,
                secs = t.elapsed().as_secs_f32(),
                executor = self.device.executor_name(),
                "prepared whole-layer graphs"
            );
            slot.insert(Arc::new(graphs));
        }
        Ok(map[&key].clone())
    }

    /// [`super::PrefillPlan::Layers`]' prefill of `tokens` after the tokens the caches hold, in
    /// chunks of `m` rows (the last padded), in order: per chunk and layer one graph
    /// ([`Self::layer_graph`]) over the smallest [`capacity`] holding the tokens before the
    /// chunk, its new keys and values appended to the layer's cache. The logits of every token
    /// (`all_logits`) or of the last, as [`Self::run_plan`]'s. The caller
    /// ([`Self::run_prefill`]) checks the tokens and restores the caches on an error.
    pub(super) fn run_layers(
        &self,
        seq: &mut Sequence,
        tokens: &[u32],
        plan: &candle_npu::ChunkPlan,
        precision: Precision,
        all_logits: bool,
    ) -> Result<Tensor> {
        let (nkv, hd, nl, h) = (self.cfg.n_kv_head, self.cfg.head_dim, self.layers.len(), self.cfg.hidden);
        let reserve = (seq.pos + tokens.len() + KvCache::GROW).min(self.cfg.context_len);
        let (total, mut done) = (plan.chunks.len() * nl, 0);
        let mut rows = Vec::with_capacity(if all_logits { tokens.len() * h } else { h });
        for c in &plan.chunks {
            let (chunk, m) = (&tokens[c.start..c.start + c.len], c.padded_len);
            let (start, n) = (seq.pos, chunk.len());
            let cap = capacity(start, m);
            let mut ids = chunk.to_vec();
            ids.resize(m, 0);
            let mut x = TensorData::F32(self.embed_rows(&ids)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(|v| v * STREAM_SCALE).collect());
            let graphs = self.layer_graphs_for(m, cap, precision)?;
            // The chunk's masks and RoPE tables, once per window and per base (Gemma 3's local
            // and global layers differ in both; every other model's layers share one of each).
            let (mut masks, mut tables) = (Vec::new(), Vec::new());
            for l in &self.spec.layers {
                if !masks.iter().any(|(w, _)| *w == l.window) {
                    masks.push((l.window, TensorData::F32(mask(start, m, n, cap, l.window))));
                }
                if !tables.iter().any(|(b, _, _)| *b == l.rope_base) {
                    let (cos, sin) = head_tables(self.spec.rope, self.spec.rope_dims, hd, l.rope_base, start, m);
                    tables.push((l.rope_base, TensorData::F32(cos), TensorData::F32(sin)));
                }
            }
            for (l, graph) in graphs.iter().map(|g| &g[0]).enumerate() {
                let spec = &self.spec.layers[l];
                let kv = seq.kv[l].get_mut().unwrap_or_else(|e| e.into_inner());
                let (kc, vc) = kv.padded(cap, nkv, hd);
                let mask = &masks.iter().find(|(w, _)| *w == spec.window).expect("one per window").1;
                let (_, cos, sin) = tables.iter().find(|(b, _, _)| *b == spec.rope_base).expect("one per base");
                let (kc, vc) = (TensorData::F32(kc), TensorData::F32(vc));
                let inputs = [&x, &kc, &vc, mask, cos, sin];
                let mut out = graph.execute(&inputs)?.into_iter();
                let (Some(y), Some(TensorData::F32(k)), Some(TensorData::F32(v))) = (out.next(), out.next(), out.next()) else {
                    return Err(Error::Internal(format!("layer graph {} returned other outputs than the stream, keys and values", graph.name())));
                };
                kv.append(&k, &v, n, nkv, hd, reserve)?;
                x = y;
                done += 1;
                if let Some(report) = self.progress.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
                    report(done, total);
                }
            }
            seq.pos += n;
            let TensorData::F32(mut stream) = x else { return Err(Error::Internal("a layer graph's stream is F32".into())) };
            stream.iter_mut().for_each(|v| *v /= STREAM_SCALE);
            match all_logits {
                true => rows.extend_from_slice(&stream[..n * h]),
                false => rows = stream[(n - 1) * h..n * h].to_vec(),
            }
        }
        let n = rows.len() / h;
        self.logits(&Tensor::from_vec(rows, (n, h), &candle_core::Device::Cpu)?)
    }
}

/// How shadow W8A16 feeds a stage's linears in a whole-layer graph (`Model::feed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Feed {
    /// The calibrated range is the clip range: u16 over it.
    Clip,
    /// The calibrated range is at most [`SPLIT_RANGE`] times the clip range: u16 over all of it.
    Full,
    /// Beyond that: u16 over the clip range into the INT8 weights, the outliers beyond it through
    /// the float weights (FP16 on the HTP).
    Split,
}

impl Model {
    /// How shadow W8A16 feeds stage `s` of layer `l` (`None`: not calibrated).
    fn feed(&self, l: usize, s: usize) -> Option<Feed> {
        let (p, full) = (self.points.get(l)?.get(s)?, self.a16.get(l)?.get(s)?);
        let (min, max) = full.float_range(DType::U16);
        Some(if min >= p.lo && max <= p.hi {
            Feed::Clip
        } else if max - min <= SPLIT_RANGE * (p.hi - p.lo) {
            Feed::Full
        } else {
            Feed::Split
        })
    }

    /// The share of the layers' linear MACs that shadow W8A16's whole-layer graphs run a second
    /// time through float weights (their split points', `SPLIT_RANGE`), from the model's
    /// profile: what the phone model prices in FP16 (`sched --sections phone`). `None` without a
    /// profile.
    pub fn split_mac_share(&self) -> Option<f64> {
        let (mut split, mut all) = (0usize, 0usize);
        for (l, layer) in self.layers.iter().enumerate() {
            for (s, stage) in layer.stages.iter().enumerate() {
                let macs: usize = stage.iter().map(|lin| lin.dims().0 * lin.dims().1).sum();
                all += macs;
                if self.feed(l, s)? == Feed::Split {
                    split += macs;
                }
            }
        }
        Some(split as f64 / all.max(1) as f64)
    }
}

/// The cache capacity of a chunk whose first row is position `start`: the tokens before it
/// rounded up to a power of two, at least the chunk's rows (a few graphs per layer cover a
/// context; an early chunk does not attend over the whole of it).
pub fn capacity(start: usize, m: usize) -> usize {
    start.max(m).next_power_of_two()
}

/// The mask of a chunk of `m` rows (the first `n` tokens) at positions `start..`, over `cap`
/// cache rows (the first `start` held) then the chunk's own: row `r` sees key position `p` when
/// `p <= start + r` and, with a window, `start + r - p < window`. A padding row sees itself.
pub fn mask(start: usize, m: usize, n: usize, cap: usize, window: Option<usize>) -> Vec<f32> {
    let keys = cap + m;
    let mut out = vec![MASKED; m * keys];
    for r in 0..m {
        let row = &mut out[r * keys..][..keys];
        if r >= n {
            row[cap + r] = 0.0;
            continue;
        }
        let pos = start + r;
        let sees = |p: usize| p <= pos && window.is_none_or(|w| pos - p < w);
        (0..start).filter(|&p| sees(p)).for_each(|p| row[p] = 0.0);
        (0..=r).filter(|&j| sees(start + j)).for_each(|j| row[cap + j] = 0.0);
    }
    out
}

/// `rotate` of RoPE as a matrix for a FullyConnected (`out[d] = sum_k x[k] w[d, k]`): dimension
/// `d` of a head takes its pair partner's value, negated for the first of the pair; dimensions
/// past `dims` are not rotated (their cos is 1 and sin 0 in [`head_tables`]).
fn rotation(layout: RopeLayout, dims: usize, hd: usize) -> Vec<f32> {
    let mut w = vec![0f32; hd * hd];
    let half = dims / 2;
    for d in 0..dims {
        let (partner, sign) = match layout {
            RopeLayout::Interleaved => (d ^ 1, if d % 2 == 0 { -1.0 } else { 1.0 }),
            RopeLayout::Neox => ((d + half) % dims, if d < half { -1.0 } else { 1.0 }),
        };
        w[d * hd + partner] = sign;
    }
    w
}

/// RoPE's tables for positions `start..start + m` over a whole head, `[m, 1, hd]` each: the
/// angle of a pair at both of its dimensions (as `layout` pairs them), cos 1 and sin 0 past the
/// rotated `dims`. From the CPU path's own tables ([`rope_tables`]), so both rotate alike.
fn head_tables(layout: RopeLayout, dims: usize, hd: usize, base: f32, start: usize, m: usize) -> (Vec<f32>, Vec<f32>) {
    let (c, s) = rope_tables(dims, base, start, m);
    let half = dims / 2;
    let (mut cos, mut sin) = (vec![1f32; m * hd], vec![0f32; m * hd]);
    for r in 0..m {
        for d in 0..dims {
            let i = match layout {
                RopeLayout::Interleaved => d / 2,
                RopeLayout::Neox => d % half,
            };
            (cos[r * hd + d], sin[r * hd + d]) = (c[r * half + i], s[r * half + i]);
        }
    }
    (cos, sin)
}

/// Names a layer graph's ops `blk.{l}.{what}`, and adds its recurring pieces.
struct Build {
    l: usize,
    precision: Precision,
    eps: f32,
}

impl Build {
    fn name(&self, what: &str) -> String {
        format!("blk.{}.{what}", self.l)
    }

    fn reshape(&self, g: &mut Graph, what: &str, input: TensorId, shape: &[usize]) -> TensorId {
        g.op(&self.name(what), DType::F32, None, |output| Op::Reshape { input, output }, shape)
    }

    fn transpose(&self, g: &mut Graph, what: &str, input: TensorId, perm: &[usize]) -> TensorId {
        let shape: Vec<usize> = perm.iter().map(|&p| g.tensor(input).shape[p]).collect();
        g.op(&self.name(what), DType::F32, None, |output| Op::Transpose { input, perm: perm.to_vec(), output }, &shape)
    }

    fn concat(&self, g: &mut Graph, what: &str, a: TensorId, b: TensorId, axis: usize) -> TensorId {
        let mut shape = g.tensor(a).shape.clone();
        shape[axis] += g.tensor(b).shape[axis];
        g.op(&self.name(what), DType::F32, None, |output| Op::Concat { a, b, axis, output }, &shape)
    }

    fn scalar(&self, g: &mut Graph, what: &str, v: f32) -> TensorId {
        g.constant(&self.name(what), &[1], StaticData::F32(Arc::new(vec![v])), None)
    }

    /// `x` times the constant `v`.
    fn scaled(&self, g: &mut Graph, what: &str, x: TensorId, v: f32) -> TensorId {
        let c = self.scalar(g, &format!("{what}_by"), v);
        g.binary(&self.name(what), x, c, DType::F32, None, |a, b, output| Op::Mul { a, b, output })
    }

    /// RMSNorm of `x` over its last axis by the checkpoint's weight `w` times `out_scale`, `x`
    /// carried at `in_scale` (its epsilon scaled by `in_scale²`: the same normalized values).
    fn norm(&self, g: &mut Graph, what: &str, x: TensorId, w: &candle_core::Tensor, in_scale: f32, out_scale: f32) -> Result<TensorId> {
        let w: Vec<f32> = w.to_vec1::<f32>()?.into_iter().map(|v| v * out_scale).collect();
        let gamma = g.constant(&self.name(&format!("{what}.weight")), &[w.len()], StaticData::F32(Arc::new(w)), None);
        let shape = g.tensor(x).shape.clone();
        let eps = self.eps * in_scale * in_scale;
        Ok(g.op(&self.name(what), DType::F32, None, |output| Op::RmsNorm { input: x, gamma, epsilon: eps, output }, &shape))
    }

    /// The linears of stage `s` on `x`, each with its bias: their F32 outputs, in the stage's
    /// order. Their input: `x` itself (F32); u16 over the point's whole calibrated range
    /// (W8A16); or shadow W8A16's split where the calibrated range is more than [`SPLIT_RANGE`]
    /// times the clip range: u16 over the clip range into the INT8 weights, plus the rest
    /// `x - clamp(x)` (the outliers; zero elsewhere) through the float weights.
    fn linears(&self, g: &mut Graph, model: &Model, l: usize, s: usize, x: TensorId) -> Result<Vec<TensorId>> {
        let point = super::STAGES[s].point;
        let uncalibrated = || Error::Input(format!("layer {l} has no {:?} ranges: calibrate first", self.precision));
        let shape = g.tensor(x).shape.clone();
        let quantize =
            |g: &mut Graph, what: &str, x: TensorId, q| g.op(&self.name(what), DType::U16, Some(q), |output| Op::Quantize { input: x, output }, &shape);
        let parts = match self.precision {
            Precision::F32 => vec![x],
            Precision::W8A16 => vec![quantize(g, &format!("{point}_u16"), x, model.a16.get(l).ok_or_else(uncalibrated)?[s])],
            _ => {
                let (p, full) = (&model.points.get(l).ok_or_else(uncalibrated)?[s], model.a16.get(l).ok_or_else(uncalibrated)?[s]);
                match model.feed(l, s).ok_or_else(uncalibrated)? {
                    Feed::Clip => vec![quantize(g, &format!("{point}_u16"), x, p.quant_u16())],
                    Feed::Full => vec![quantize(g, &format!("{point}_u16"), x, full)],
                    Feed::Split => {
                        // The clip range's part is clamped before it is quantized, not by the
                        // quantization's saturation: the HTP's graph optimizer gives an op's output
                        // the encoding of a Quantize reading it, so every other reader of `x` would
                        // see it clipped (and the outliers vanish). A clamped tensor loses nothing
                        // to its u16 encoding but a grid step.
                        let (lo, hi) = (p.lo, p.hi);
                        let clipped = g.op(&self.name(&format!("{point}_clipped")), DType::F32, None, |output| Op::Clamp { input: x, lo, hi, output }, &shape);
                        let inside = quantize(g, &format!("{point}_u16"), clipped, p.quant_u16());
                        let minus = self.scalar(g, &format!("{point}_minus_one"), -1.0);
                        let neg =
                            g.binary(&self.name(&format!("{point}_neg_clipped")), clipped, minus, DType::F32, None, |a, b, output| Op::Mul { a, b, output });
                        let rest = g.binary(&self.name(&format!("{point}_outliers")), x, neg, DType::F32, None, |a, b, output| Op::Add { a, b, output });
                        vec![inside, rest]
                    }
                }
            }
        };
        model.layers[l].stages[s]
            .iter()
            .map(|lin| {
                let mut y = lin.add_to_graph(g, "", parts[0])?;
                if let Some(&rest) = parts.get(1) {
                    // The outliers through the float weights (FP16 on the HTP), as llm.npu's
                    // shadow path multiplies them on the CPU.
                    let yr = lin.add_to_graph(g, ".outliers", rest)?;
                    y = g.binary(&format!("{}.with_outliers", lin.name()), y, yr, DType::F32, None, |a, b, output| Op::Add { a, b, output });
                }
                Ok(match lin.bias() {
                    Some(b) => {
                        let bias = g.constant(&format!("{}.bias", lin.name()), &[b.len()], StaticData::F32(Arc::new(b.to_vec())), None);
                        g.binary(&format!("{}.biased", lin.name()), y, bias, DType::F32, None, |a, b, output| Op::Add { a, b, output })
                    }
                    None => y,
                })
            })
            .collect()
    }

    /// RoPE of `x` (`[m, heads, hd]`) times `scale` (the query's attention scale, folded in):
    /// `x cos + rotate(x) sin`, `rotate` a FullyConnected of every head's row by `rotation`.
    #[allow(clippy::too_many_arguments)]
    fn rope(&self, g: &mut Graph, what: &str, x: TensorId, rotation: TensorId, cos: TensorId, sin: TensorId, scale: f32) -> TensorId {
        let shape = g.tensor(x).shape.clone();
        let (m, heads, hd) = (shape[0], shape[1], shape[2]);
        let flat = self.reshape(g, &format!("{what}_head_rows"), x, &[m * heads, hd]);
        let turned = g.fully_connected(&self.name(&format!("{what}_rotated")), flat, rotation, None, DType::F32, None);
        let turned = self.reshape(g, &format!("{what}_rotated_heads"), turned, &shape);
        let mul = |a, b, output| Op::Mul { a, b, output };
        let xc = g.binary(&self.name(&format!("{what}_cos")), x, cos, DType::F32, None, mul);
        let ts = g.binary(&self.name(&format!("{what}_sin")), turned, sin, DType::F32, None, mul);
        let y = g.binary(&self.name(&format!("{what}_roped")), xc, ts, DType::F32, None, |a, b, output| Op::Add { a, b, output });
        if scale == 1.0 {
            return y;
        }
        let s = self.scalar(g, &format!("{what}_scale"), scale);
        g.binary(&self.name(&format!("{what}_scaled")), y, s, DType::F32, None, mul)
    }

    /// The FFN's gate activation: SiLU `x sigmoid(x)`, or GELU's tanh form as
    /// `x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))` (`(1 + tanh(z)) / 2 = sigmoid(2z)`).
    fn activation(&self, g: &mut Graph, act: Activation, x: TensorId) -> TensorId {
        let mul = |a, b, output| Op::Mul { a, b, output };
        let z = match act {
            Activation::Silu => x,
            Activation::GeluTanh => {
                let x2 = g.binary(&self.name("gelu_x2"), x, x, DType::F32, None, mul);
                let c = self.scalar(g, "gelu_cubic", 0.044715);
                let x2c = g.binary(&self.name("gelu_x2c"), x2, c, DType::F32, None, mul);
                let one = self.scalar(g, "gelu_one", 1.0);
                let inner = g.binary(&self.name("gelu_1_x2c"), x2c, one, DType::F32, None, |a, b, output| Op::Add { a, b, output });
                let k = self.scalar(g, "gelu_scale", 2.0 * (2.0 / std::f32::consts::PI).sqrt());
                let inner = g.binary(&self.name("gelu_k_1_x2c"), inner, k, DType::F32, None, mul);
                g.binary(&self.name("gelu_z"), inner, x, DType::F32, None, mul)
            }
        };
        let s = g.unary(&self.name("ffn_gate_sigmoid"), z, DType::F32, None, |input, output| Op::Sigmoid { input, output });
        g.binary(&self.name("ffn_gate_act"), x, s, DType::F32, None, mul)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_is_causal_windowed_and_hides_free_cache_rows() {
        // Chunk of 4 rows (3 tokens) at positions 5..9, cache capacity 8 holding 5, window 3.
        let (start, m, n, cap) = (5, 4, 3, 8);
        let mk = mask(start, m, n, cap, Some(3));
        let seen = |r: usize| -> Vec<usize> { (0..cap + m).filter(|&c| mk[r * (cap + m) + c] == 0.0).collect() };
        // Row 0 (position 5) sees positions 3, 4 (cache rows) and itself (chunk row 0 = key 8).
        assert_eq!(seen(0), [3, 4, 8]);
        // Row 2 (position 7) sees 5, 6, 7: chunk rows 0..=2, nothing of the cache.
        assert_eq!(seen(2), [8, 9, 10]);
        // The padding row sees only itself; the free cache rows 5..8 nobody.
        assert_eq!(seen(3), [11]);
        let global = mask(start, m, n, cap, None);
        assert_eq!((0..cap + m).filter(|&c| global[2 * (cap + m) + c] == 0.0).collect::<Vec<_>>(), [0, 1, 2, 3, 4, 8, 9, 10]);
    }

    #[test]
    fn capacities_hold_the_tokens_before_a_chunk() {
        for (start, m, cap) in [(0, 16, 16), (16, 16, 16), (17, 16, 32), (700, 256, 1024), (0, 24, 32)] {
            assert_eq!(capacity(start, m), cap, "start {start}, m {m}");
        }
    }

    #[test]
    fn the_rotation_turns_each_pair() {
        // x = [a, b] per pair: rotate gives [-b, a].
        for layout in [RopeLayout::Interleaved, RopeLayout::Neox] {
            let (hd, dims) = (8, 6); // the last two dimensions are not rotated
            let w = rotation(layout, dims, hd);
            let x: Vec<f32> = (1..=hd).map(|v| v as f32).collect();
            let y: Vec<f32> = (0..hd).map(|d| (0..hd).map(|k| w[d * hd + k] * x[k]).sum()).collect();
            let want = match layout {
                RopeLayout::Interleaved => [-2.0, 1.0, -4.0, 3.0, -6.0, 5.0, 0.0, 0.0],
                RopeLayout::Neox => [-4.0, -5.0, -6.0, 1.0, 2.0, 3.0, 0.0, 0.0],
            };
            assert_eq!(y, want, "{layout:?}");
        }
    }
}
