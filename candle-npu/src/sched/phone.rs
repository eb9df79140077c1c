//! The phone's NPU priced from published figures (issue 48): what one graph execution on a
//! Hexagon HTP costs by its activation precision, MACs, attention scores and bytes, so that a
//! plan of whole-layer graphs, and the published engines' own plans, can be predicted on one
//! model. `docs/phone_model.md` gives each figure's source and how the parameters were fitted.
//!
//! A graph call costs `launch + max(compute, bytes / bandwidth)`, with
//! `compute = rows · linear MACs / rate(activations) + scores · (2 · head_dim / a16 rate +
//! score cost)`: the linears at the HMX rate of their activation precision, attention's two
//! products at the 16-bit rate plus a cost per score (mask, softmax, requantization) that the
//! published calls cannot be fitted without, and the call's weights and KV cache streamed from
//! DRAM. llm.npu's four-stage plan is priced on the same rates by [`HtpStageCosts`] in the DAG
//! simulation (its CPU stages by [`Rates`]).

use serde::Serialize;

use super::cost::{AnalyticCosts, CostModel, LayerShape};
use super::dag::{Node, Processor};

/// Activation precision of a graph's linears.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Activations {
    /// 8-bit (W8A8: llm.npu's, with the shadow outliers on the CPU).
    A8,
    /// 16-bit fixed point (W8A16, W4A16: 4-bit weights save bytes, not MACs).
    A16,
    /// FP16 (AI Hub's "w4").
    Fp16,
}

/// A Hexagon HTP's rates, from published figures only (`docs/phone_model.md`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct HtpRates {
    /// MACs per second of a linear with 16-bit activations.
    pub a16_macs: f64,
    /// How many times faster 8-bit activations run.
    pub a8_speedup: f64,
    /// How many times slower FP16 activations run.
    pub fp16_slowdown: f64,
    /// Seconds per attention score (row x key x head) beyond its MACs.
    pub score_secs: f64,
    /// Bytes per second a graph call streams from DRAM (weights, the KV cache it reads).
    pub bytes_per_sec: f64,
    /// Seconds per graph execution whatever it computes (launch, synchronization): a stated
    /// range, 0.1-3 ms, no direct measurement being published.
    pub launch_secs: f64,
}

impl HtpRates {
    /// Snapdragon 8 Gen 3 (Hexagon v75). `a16_macs` and `score_secs` are fitted on 14 published
    /// AI Hub w4a16 prompt-processor calls (RMS log error 0.115); `a8_speedup` is the median of
    /// AI Hub's w8a16 / w8a8 pairs on the Galaxy S24 (1.90, 4 models); `fp16_slowdown` AI Hub's
    /// Llama-3.2-1B w4 / w4a16 (81.24 / 37.07 ms); `bytes_per_sec` the rate at which the three
    /// anchors are reproduced together (mllm's decode streams at 25 GB/s; AI Hub's decode at
    /// 44-60: the figure describes a runtime as much as DRAM); `launch_secs` the nominal 0.3 ms
    /// of a Genie-class runtime (llm.npu's own figures imply about 2 ms).
    pub const SNAPDRAGON_8_GEN_3: HtpRates =
        HtpRates { a16_macs: 6.0e12, a8_speedup: 1.9, fp16_slowdown: 2.19, score_secs: 6.5e-11, bytes_per_sec: 25e9, launch_secs: 0.3e-3 };

    /// Snapdragon 8 Elite (v79) over 8 Gen 3 (v75): compute 1.25 times faster (the median of 21
    /// AI Hub w8a16 models measured on both, S25 against S24; Qualcomm's "45% faster" is
    /// marketing), bandwidth 1.10 times (LPDDR5X-5300 against 4800, an assumption that matters
    /// only when a call is memory-bound).
    pub fn snapdragon_8_elite(self) -> HtpRates {
        HtpRates { a16_macs: self.a16_macs * 1.25, score_secs: self.score_secs / 1.25, bytes_per_sec: self.bytes_per_sec * 1.10, ..self }
    }

    /// These rates with another launch cost per graph execution.
    pub fn with_launch(self, launch_secs: f64) -> HtpRates {
        HtpRates { launch_secs, ..self }
    }

    /// MACs per second of a linear with `a` activations.
    pub fn macs(&self, a: Activations) -> f64 {
        match a {
            Activations::A8 => self.a16_macs * self.a8_speedup,
            Activations::A16 => self.a16_macs,
            Activations::Fp16 => self.a16_macs / self.fp16_slowdown,
        }
    }

    /// Seconds of one execution of `call`.
    pub fn call_secs(&self, c: &GraphCall) -> f64 {
        let attention = match c.activations {
            Activations::Fp16 => c.scores * (2.0 * c.head_dim as f64 / self.macs(Activations::Fp16) + self.score_secs * self.fp16_slowdown),
            _ => c.scores * (2.0 * c.head_dim as f64 / self.a16_macs + self.score_secs),
        };
        let compute = c.macs / self.macs(c.activations) + attention;
        self.launch_secs * c.launches as f64 + compute.max(c.bytes / self.bytes_per_sec)
    }
}

/// One execution of a graph (or of a model split into `launches` graphs run back to back).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GraphCall {
    /// Graph executions it takes.
    pub launches: usize,
    /// Linear MACs (all rows; the output table's too when the graph computes logits).
    pub macs: f64,
    /// Activation precision of the linears.
    pub activations: Activations,
    /// Attention scores: rows x keys (the capacity the graph is built for) x query heads x layers.
    pub scores: f64,
    /// Head width (attention's MACs per score are twice it).
    pub head_dim: usize,
    /// Bytes streamed: weights and the KV cache read.
    pub bytes: f64,
}

/// A model's shape, for pricing whole plans.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ModelShape {
    /// One decoder layer (every layer alike).
    pub layer: LayerShape,
    /// Decoder layers.
    pub n_layer: usize,
    /// Rows of the output table.
    pub vocab: usize,
}

impl ModelShape {
    /// Linear MACs (= weights) of one layer per row.
    pub fn layer_macs(&self) -> f64 {
        ["qkv", "o", "gate_up", "down"].iter().map(|s| self.layer.linear_macs(s).unwrap_or(0) as f64).sum()
    }
}

/// A plan of graphs that hold whole layers (or the whole model): chunks of `rows`, each through
/// `graphs_per_chunk` graphs holding all layers between them, attention over `capacity` keys.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct WholePlan {
    /// Rows per chunk (the last padded).
    pub rows: usize,
    /// Keys each row attends over: a fixed capacity (the graph's), or `None` for the smallest
    /// power of two holding the tokens before the chunk, at least its rows (this project's).
    pub capacity: Option<usize>,
    /// Graph executions per chunk.
    pub graphs_per_chunk: usize,
    /// Activation precision of the linears.
    pub activations: Activations,
    /// Bytes per weight of the layers (INT8 1, LPBQ 4-bit about 0.53).
    pub weight_bytes: f64,
    /// Bytes per KV value.
    pub kv_bytes: f64,
    /// The output table inside the graphs (every row's logits: AI Hub's and mllm's), with this
    /// many bytes per weight; `None`: the last row's logits on the CPU (this project's).
    pub lm_head_bytes: Option<f64>,
    /// Linear MACs per layer run again with FP16 activations and FP16 weights, as a share of
    /// the layer's: shadow W8A16's outliers through the float weights at its split points.
    pub fp16_share: f64,
}

/// A predicted prefill.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Prediction {
    /// Seconds.
    pub secs: f64,
    /// Prompt tokens per second.
    pub tokens_per_sec: f64,
    /// The NPU's busy share of the prefill.
    pub npu_busy: f64,
    /// The CPU's busy share of the prefill.
    pub cpu_busy: f64,
    /// Graph executions per chunk.
    pub graphs_per_chunk: usize,
}

/// `tokens` prompt tokens through `plan` on `rates`; `cpu_macs` prices the last row's logits when
/// the plan leaves them to the CPU (a matrix-vector product, memory-bound: the phone model's
/// CPU MAC rate is a bound from above).
pub fn predict_whole(shape: &ModelShape, plan: &WholePlan, tokens: usize, rates: &HtpRates, cpu_macs: f64) -> Prediction {
    let s = &shape.layer;
    let (mut npu, mut start) = (0.0, 0);
    let lm_macs = (shape.vocab * s.hidden) as f64;
    while start < tokens {
        let cap = plan.capacity.unwrap_or_else(|| start.max(plan.rows).next_power_of_two());
        let layers = shape.n_layer as f64;
        let kv = 2.0 * (s.n_kv_head * s.head_dim * cap) as f64 * plan.kv_bytes * layers;
        let lm_rows = if plan.lm_head_bytes.is_some() { plan.rows as f64 } else { 0.0 };
        // The FP16 part is priced as A16 MACs slowed by the FP16 factor.
        let fp16_macs = plan.rows as f64 * shape.layer_macs() * layers * plan.fp16_share * rates.fp16_slowdown;
        let call = GraphCall {
            launches: plan.graphs_per_chunk,
            macs: plan.rows as f64 * shape.layer_macs() * layers + fp16_macs + lm_rows * lm_macs,
            activations: plan.activations,
            scores: (plan.rows * (cap + if plan.capacity.is_none() { plan.rows } else { 0 }) * s.n_head) as f64 * layers,
            head_dim: s.head_dim,
            bytes: shape.layer_macs() * layers * (plan.weight_bytes + 2.0 * plan.fp16_share) + kv + plan.lm_head_bytes.map_or(0.0, |b| lm_macs * b),
        };
        npu += rates.call_secs(&call);
        start += plan.rows;
    }
    let cpu = if plan.lm_head_bytes.is_some() { 0.0 } else { lm_macs / cpu_macs };
    let secs = npu + cpu;
    Prediction { secs, tokens_per_sec: tokens as f64 / secs, npu_busy: npu / secs, cpu_busy: cpu / secs, graphs_per_chunk: plan.graphs_per_chunk }
}

/// llm.npu's four-stage plan on [`HtpRates`]: each NPU stage a W8A8 graph
/// (`launch + max(rows · MACs / A8 rate, weight bytes / bandwidth)`, at least 32 rows' time:
/// HeteroLLM §3.2), the CPU stages as [`AnalyticCosts`] prices them.
#[derive(Debug, Clone, Copy)]
pub struct HtpStageCosts {
    /// The CPU side (and the layer's shape).
    pub cpu: AnalyticCosts,
    /// The NPU side.
    pub htp: HtpRates,
}

impl CostModel for HtpStageCosts {
    fn cost(&self, n: &Node) -> f64 {
        match (n.processor, self.cpu.shape.linear_macs(&n.stage_name)) {
            (Processor::Npu, Some(macs)) => {
                let (rows, macs) = (n.rows.max(32) as f64, macs as f64);
                self.htp.launch_secs + (rows * macs / self.htp.macs(Activations::A8)).max(macs / self.htp.bytes_per_sec)
            }
            _ => self.cpu.cost(n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_1b() -> ModelShape {
        ModelShape { layer: LayerShape { hidden: 2048, ffn: 8192, n_head: 32, n_kv_head: 8, head_dim: 64 }, n_layer: 16, vocab: 128256 }
    }

    /// AI Hub's Llama-3.2-1B w4a16 prompt processor on the 8 Elite (128 rows over a 4096-token
    /// cache, 3 graphs, every row's logits, 4-bit weights, 8-bit output table and KV): 37.07 ms
    /// measured; the fit puts it 9% under (docs/phone_model.md), within the 25%.
    #[test]
    fn the_ai_hub_anchor_is_reproduced_within_a_quarter() {
        let plan = WholePlan {
            rows: 128,
            capacity: Some(4096),
            graphs_per_chunk: 3,
            activations: Activations::A16,
            weight_bytes: 0.5,
            kv_bytes: 1.0,
            lm_head_bytes: Some(1.0),
            fp16_share: 0.0,
        };
        let p = predict_whole(&llama_1b(), &plan, 128, &HtpRates::SNAPDRAGON_8_GEN_3.snapdragon_8_elite(), 91e9);
        let ms = p.secs * 1e3;
        assert!((ms / 37.0651 - 1.0).abs() < 0.25, "{ms} ms against 37.07");
        // The published script's figure for this set (BW 25 GB/s, 0.3 ms): 3158 tok/s.
        assert!((p.tokens_per_sec / 3158.0 - 1.0).abs() < 0.01, "{} tok/s", p.tokens_per_sec);
    }

    /// mllm's Qwen3-1.7B W4A16 on the 8 Gen 3: one graph per 32-row chunk over a 1024-token
    /// cache, LPBQ weights (4 bits and a 4-bit scale per 16), every row's logits: 758.28 tok/s
    /// for 640 tokens; the model gives 816 (+8%) at 0.3 ms per launch, 782 (+3%) at 2 ms.
    #[test]
    fn the_mllm_anchor_is_reproduced_within_a_quarter() {
        let qwen3 = ModelShape { layer: LayerShape { hidden: 2048, ffn: 6144, n_head: 16, n_kv_head: 8, head_dim: 128 }, n_layer: 28, vocab: 151936 };
        let bytes = 0.5 + 0.5 / 16.0;
        let plan = WholePlan {
            rows: 32,
            capacity: Some(1024),
            graphs_per_chunk: 1,
            activations: Activations::A16,
            weight_bytes: bytes,
            kv_bytes: 1.0,
            lm_head_bytes: Some(bytes),
            fp16_share: 0.0,
        };
        for launch in [0.3e-3, 2e-3] {
            let p = predict_whole(&qwen3, &plan, 640, &HtpRates::SNAPDRAGON_8_GEN_3.with_launch(launch), 91e9);
            assert!((p.tokens_per_sec / 758.28 - 1.0).abs() < 0.25, "{} tok/s at {launch} s per launch", p.tokens_per_sec);
        }
    }

    #[test]
    fn a_call_is_its_launches_plus_the_larger_of_compute_and_streaming() {
        let r = HtpRates { a16_macs: 1e12, a8_speedup: 2.0, fp16_slowdown: 2.0, score_secs: 0.0, bytes_per_sec: 1e9, launch_secs: 1e-3 };
        let call = |macs: f64, bytes: f64, a| GraphCall { launches: 2, macs, activations: a, scores: 0.0, head_dim: 64, bytes };
        // Compute-bound: 1e9 MACs at 1e12 = 1 ms, at A8 0.5 ms; bytes 1e5 = 0.1 ms.
        assert!((r.call_secs(&call(1e9, 1e5, Activations::A16)) - 3e-3).abs() < 1e-12);
        assert!((r.call_secs(&call(1e9, 1e5, Activations::A8)) - 2.5e-3).abs() < 1e-12);
        // Memory-bound: 1e7 bytes = 10 ms.
        assert!((r.call_secs(&call(1e9, 1e7, Activations::A16)) - 12e-3).abs() < 1e-12);
    }
}
