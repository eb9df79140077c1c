//! Node cost estimates: a closure, or a per-(stage, processor) linear table fit from measurements.

use std::collections::BTreeMap;

use serde::Serialize;

use super::dag::{Node, Processor};
use crate::error::{Error, Result};

/// Estimated seconds a node takes on its processor.
pub trait CostModel {
    /// Seconds `node` takes on its processor; must be finite and >= 0 ([`super::PickContext::new`]
    /// checks).
    fn cost(&self, node: &Node) -> f64;
}

impl<F: Fn(&Node) -> f64> CostModel for F {
    fn cost(&self, node: &Node) -> f64 {
        self(node)
    }
}

/// `a + b * rows + c * rows * (start + rows)` seconds. The last term is attention's: each of the
/// chunk's rows attends to every row up to its own, so it grows with the chunk's position.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct LinearCost {
    /// Seconds per run whatever its size (launch and fixed overhead).
    pub a: f64,
    /// Seconds per row.
    pub b: f64,
    /// Seconds per row per key attended (`rows * (start + rows)`): the context term, 0 but for
    /// attention.
    pub c: f64,
}

impl LinearCost {
    /// Seconds for a chunk of `rows` rows whose first row is prompt position `start`.
    pub fn eval(&self, rows: usize, start: usize) -> f64 {
        let (r, s) = (rows as f64, start as f64);
        self.a + self.b * r + self.c * r * (s + r)
    }
}

/// Per (stage name, processor) a [`LinearCost`]. A node with no entry costs NaN, which
/// [`super::simulate`] reports as an error naming the node.
#[derive(Debug, Clone, Default)]
pub struct TableCosts {
    lines: BTreeMap<String, [Option<LinearCost>; 2]>,
}

impl TableCosts {
    /// An empty table: every node costs NaN until its (stage, processor) is inserted.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the line of `stage` on `processor`, replacing any earlier one.
    pub fn insert(&mut self, stage: impl Into<String>, processor: Processor, line: LinearCost) {
        self.lines.entry(stage.into()).or_default()[processor.index()] = Some(line);
    }

    /// The line of `stage` on `processor`, if one was inserted or fitted.
    pub fn get(&self, stage: &str, processor: Processor) -> Option<LinearCost> {
        self.lines.get(stage).and_then(|l| l[processor.index()])
    }

    /// Least-squares `a + b * rows` per (stage, processor) from `(stage, processor, rows, secs)`
    /// measurements; a key measured at a single row size gets `b = secs / rows`, `a = 0`.
    pub fn fit(samples: &[(String, Processor, usize, f64)]) -> Result<Self> {
        let s: Vec<_> = samples.iter().map(|(n, p, r, t)| (n.clone(), *p, *r, 0, *t)).collect();
        Self::fit_with_context(&s)
    }

    /// As [`Self::fit`] from `(stage, processor, rows, start, secs)`; a key with any sample at
    /// `start > 0` (a stage measured at a later chunk) also fits the context term `c`.
    pub fn fit_with_context(samples: &[(String, Processor, usize, usize, f64)]) -> Result<Self> {
        let mut groups: BTreeMap<(&str, Processor), Vec<(usize, usize, f64)>> = BTreeMap::new();
        for (name, p, rows, start, secs) in samples {
            if *rows == 0 || !secs.is_finite() || *secs < 0.0 {
                return Err(Error::Input(format!("cost sample for {name} on {}: rows {rows}, {secs} s (need rows > 0 and finite secs >= 0)", p.name())));
            }
            groups.entry((name.as_str(), *p)).or_default().push((*rows, *start, *secs));
        }
        let mut table = Self::new();
        for ((name, p), g) in groups {
            let context = g.iter().any(|s| s.1 > 0);
            let x = |&(r, s, _): &(usize, usize, f64)| {
                let (r, s) = (r as f64, s as f64);
                [1.0, r, r * (s + r)]
            };
            let y: Vec<f64> = g.iter().map(|s| s.2).collect();
            let xs: Vec<[f64; 3]> = g.iter().map(x).collect();
            let fit = if context { least_squares(&xs, &y, 3) } else { None };
            let line = match fit.or_else(|| least_squares(&xs, &y, 2)) {
                Some(c) => LinearCost { a: c[0], b: c[1], c: c[2] },
                None => {
                    let rows: usize = g.iter().map(|s| s.0).sum();
                    LinearCost { a: 0.0, b: y.iter().sum::<f64>() / rows as f64, c: 0.0 }
                }
            };
            table.insert(name, p, line);
        }
        Ok(table)
    }
}

impl CostModel for TableCosts {
    /// Clamped at 0: a fitted intercept can be slightly negative.
    fn cost(&self, node: &Node) -> f64 {
        self.get(&node.stage_name, node.processor).map_or(f64::NAN, |l| l.eval(node.rows, node.start).max(0.0))
    }
}

/// Throughputs of the two processors, for [`AnalyticCosts`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Rates {
    /// Multiply-accumulates per second of a linear stage on the NPU.
    pub npu_macs: f64,
    /// The NPU takes at least this many rows' time per graph (HeteroLLM §3.2: on the Hexagon
    /// NPU "any computing tensor with dimensions smaller than 32 will exhibit the same
    /// computational latency").
    pub npu_min_rows: usize,
    /// Multiply-accumulates per second of a CPU matmul (attention; a margin's linears).
    pub cpu_macs: f64,
    /// Seconds per activation value of a CPU elementwise pass (norms, quantization, activation).
    pub cpu_elem: f64,
}

impl Rates {
    /// Rough single-core figures of this project's build machine (2-core Zen 3; host INT8 GEMM
    /// as the NPU), for the policies' ranking in a real run, where only ratios matter.
    pub const HOST: Rates = Rates { npu_macs: 25e9, npu_min_rows: 1, cpu_macs: 10e9, cpu_elem: 1e-9 };

    /// A Snapdragon 8 Gen 3 (Xiaomi 14), calibrated on the one split llm.npu publishes (§3.4,
    /// "Out-of-order subgraph execution"): "with a prompt length of 256 using the Qwen1.5-1.8B
    /// model, NPU execution takes 315ms, about twice that of the CPU". Qwen1.5-1.8B's linears
    /// are 1.214 GMAC per token, so the NPU runs 311 GMAC in 315 ms: 0.99 TMAC/s (the spec's
    /// 73 TOPS is a peak the paper's W8A8 graphs do not reach; §2.2 measures NPU INT8 matmul at
    /// 4.5-5.8x the CPU's INT8). The CPU's ~157 ms is attention (6.44 GMAC at chunk 0) plus
    /// 287 M elementwise values; no separate CPU rates are published, so they keep the host's
    /// ratio and are scaled to sum to 157 ms. The ratio was refit on 2026-11-25 from the host's
    /// stage costs with the tiled attention kernel (`cargo run --release --example sched`, its
    /// refit section: attention 52.3 GMAC/s and 0.525 ns per elementwise value on one core,
    /// 27.5 MACs per value; it had been 10): 91.0 GMAC/s and 0.302 ns per value (were 59.1 and
    /// 0.169). `phone_rates_reproduce_the_papers_split` checks the calibration.
    pub const SNAPDRAGON_8_GEN_3: Rates = Rates { npu_macs: 0.987e12, npu_min_rows: 32, cpu_macs: 91.0e9, cpu_elem: 0.302e-9 };

    /// [`Self::SNAPDRAGON_8_GEN_3`]'s NPU with CPU rates from llvm-mca estimates of this
    /// project's aarch64 kernels (model estimate, not a measurement: docs/aarch64.md, 2026-11-26,
    /// `scripts/mca.sh`, LLVM 16's `-mcpu=cortex-a715`, which is its Neoverse N2 model).
    ///
    /// - Cores: 4, the prime Cortex-X4 at 3.3 GHz and three Cortex-A720 at 3.15 GHz (12.75 G
    ///   core-cycles/s), scaling perfectly over heads and rows. The two 2.96 GHz A720s are left to
    ///   the thread driving the NPU and the system, the A520s are not used. The N2 model has the
    ///   A720's two 128-bit vector pipes; the X4 has four, so its share is pessimistic.
    /// - `cpu_macs`: attention's `dots` (0.127 cycles/MAC) and `weighted_sum` (0.125), equal
    ///   MAC counts, plus the softmax `exp_shifted` (2.763 cycles per score) spread over a
    ///   score's 128 MACs (head_dim 64): 0.1476 cycles/MAC, 86.4 GMAC/s.
    /// - `cpu_elem` (the cost of one of [`AnalyticCosts`]' "4 passes" per value): a norm stage
    ///   is add (0.128 cycles/value) + sum of squares (0.258) + scaling (2.569, an `fdiv` per
    ///   value) + u8 quantization (1.552) = 4.507 cycles per hidden value; `act` is `silu_mul`
    ///   (3.943) + quantization = 5.495 per FFN value; over SmolLM2's two norms and one `act` per
    ///   layer, a quarter of that is 1.268 cycles per pass-value: 0.0994 ns.
    ///
    /// The margin's linears are charged at `cpu_macs` too; the INT8 GEMM (`tile_i8mm`, 1.0
    /// cycle per 64 MACs) would run them about 10x faster.
    pub const SNAPDRAGON_8_GEN_3_KERNELS: Rates = {
        const CORE_HZ: f64 = 3.3e9 + 3.0 * 3.15e9;
        const ATTN_CYCLES_PER_MAC: f64 = (0.127 + 0.125) / 2.0 + 2.763 / 128.0;
        const NORM_CYCLES: f64 = 0.128 + 0.258 + 2.569 + 1.552;
        const ACT_CYCLES: f64 = 3.943 + 1.552;
        const PASS_CYCLES: f64 = (2.0 * 576.0 * NORM_CYCLES + 1536.0 * ACT_CYCLES) / (2.0 * 576.0 + 1536.0) / 4.0;
        Rates { cpu_macs: CORE_HZ / ATTN_CYCLES_PER_MAC, cpu_elem: PASS_CYCLES / CORE_HZ, ..Rates::SNAPDRAGON_8_GEN_3 }
    };
}

/// The dimensions a decoder layer's stage costs scale with.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LayerShape {
    /// Width of the residual stream (the model's hidden size).
    pub hidden: usize,
    /// Width of the FFN's intermediate layer (of gate and of up each).
    pub ffn: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (fewer than `n_head` under grouped-query attention).
    pub n_kv_head: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl LayerShape {
    /// Multiply-accumulates per row of a linear stage (`qkv`, `o`, `gate_up`, `down`), else `None`.
    pub fn linear_macs(&self, stage: &str) -> Option<usize> {
        let (h, q, kv) = (self.hidden, self.n_head * self.head_dim, self.n_kv_head * self.head_dim);
        match stage {
            "qkv" => Some(h * (q + 2 * kv)),
            "o" => Some(q * h),
            "gate_up" => Some(2 * h * self.ffn),
            "down" => Some(self.ffn * h),
            _ => None,
        }
    }
}

/// Stage costs from a layer's shapes and a device's [`Rates`]: a linear stage is its MACs at the
/// processor's rate; `attn` is each row's scores and weighted sum over every key up to the
/// chunk's end (`2 * n_head * head_dim` MACs per key: the host computes the masked half too)
/// plus 4 passes over the row; `act` 4 passes over the FFN row; `tail` one pass; any other CPU
/// stage (a norm with quantization) 4 passes over the hidden row.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AnalyticCosts {
    /// The decoder layer's dimensions (every layer of a model has the same).
    pub shape: LayerShape,
    /// The device's throughputs: what turns MACs and elementwise passes into seconds.
    pub rates: Rates,
}

impl CostModel for AnalyticCosts {
    fn cost(&self, n: &Node) -> f64 {
        let (s, r) = (&self.shape, &self.rates);
        let rows = n.rows as f64;
        if let Some(macs) = s.linear_macs(&n.stage_name) {
            return match n.processor {
                Processor::Npu => n.rows.max(r.npu_min_rows) as f64 * macs as f64 / r.npu_macs,
                Processor::Cpu => rows * macs as f64 / r.cpu_macs,
            };
        }
        let values = match n.stage_name.as_str() {
            "attn" => {
                let keys = (n.start + n.rows) as f64;
                return rows * keys * (2 * s.n_head * s.head_dim) as f64 / r.cpu_macs + rows * (4 * s.hidden) as f64 * r.cpu_elem;
            }
            "act" => 4 * s.ffn,
            "tail" => s.hidden,
            _ => 4 * s.hidden,
        };
        rows * values as f64 * r.cpu_elem
    }
}

/// Least squares on the first `k` columns of `x` (normal equations on columns scaled to at most
/// 1); `None` when they are (nearly) linearly dependent, e.g. one row size for `a + b * rows`.
fn least_squares(x: &[[f64; 3]], y: &[f64], k: usize) -> Option<[f64; 3]> {
    if x.len() < k {
        return None;
    }
    let mut scale = [0f64; 3];
    for row in x {
        for j in 0..k {
            scale[j] = scale[j].max(row[j].abs());
        }
    }
    if scale[..k].contains(&0.0) {
        return None;
    }
    // Augmented normal matrix [XᵀX | Xᵀy] in scaled columns.
    let mut m = [[0f64; 4]; 3];
    for (row, &t) in x.iter().zip(y) {
        for i in 0..k {
            for j in 0..k {
                m[i][j] += row[i] / scale[i] * row[j] / scale[j];
            }
            m[i][3] += row[i] / scale[i] * t;
        }
    }
    let tiny = 1e-9 * (0..k).map(|i| m[i][i]).fold(0.0, f64::max);
    for col in 0..k {
        let piv = (col..k).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
        if m[piv][col].abs() <= tiny {
            return None;
        }
        m.swap(col, piv);
        for r in 0..k {
            if r != col {
                let f = m[r][col] / m[col][col];
                for c in col..4 {
                    m[r][c] -= f * m[col][c];
                }
            }
        }
    }
    let mut out = [0f64; 3];
    for i in 0..k {
        out[i] = m[i][3] / m[i][i] / scale[i];
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1e-6)
    }

    #[test]
    fn phone_rates_reproduce_the_papers_split() {
        use crate::sched::{DagChunk, StageDesc, SubgraphDag};
        // Qwen1.5-1.8B: 24 layers, hidden 2048, FFN 5504, 16 heads of 128 (no GQA).
        let shape = LayerShape { hidden: 2048, ffn: 5504, n_head: 16, n_kv_head: 16, head_dim: 128 };
        let costs = AnalyticCosts { shape, rates: Rates::SNAPDRAGON_8_GEN_3 };
        let stages: Vec<StageDesc> = ["attn_in", "qkv", "attn", "o", "ffn_in", "gate_up", "act", "down"]
            .iter()
            .map(|&n| StageDesc::new(n, if shape.linear_macs(n).is_some() { Processor::Npu } else { Processor::Cpu }, n == "attn"))
            .collect();
        let dag = SubgraphDag::new(&stages, 24, Some(StageDesc::new("tail", Processor::Cpu, false)), &[DagChunk { rows: 256, margin: false }]).unwrap();
        let mut total = [0.0; 2];
        for n in dag.nodes() {
            total[n.processor.index()] += costs.cost(n);
        }
        // llm.npu §3.4: NPU 315 ms, "about twice that of the CPU".
        assert!((total[Processor::Npu.index()] - 0.315).abs() < 0.003, "NPU {}", total[Processor::Npu.index()]);
        assert!((total[Processor::Cpu.index()] - 0.1575).abs() < 0.003, "CPU {}", total[Processor::Cpu.index()]);
    }

    #[test]
    fn kernel_rates_are_their_derivation() {
        let (r, p) = (Rates::SNAPDRAGON_8_GEN_3_KERNELS, Rates::SNAPDRAGON_8_GEN_3);
        // docs/aarch64.md: 86.4 GMAC/s and 0.0994 ns per pass-value, the phone model's NPU.
        assert!((r.cpu_macs / 86.39e9 - 1.0).abs() < 1e-3, "cpu_macs {}", r.cpu_macs);
        assert!((r.cpu_elem / 0.099443e-9 - 1.0).abs() < 1e-3, "cpu_elem {}", r.cpu_elem);
        assert_eq!((r.npu_macs, r.npu_min_rows), (p.npu_macs, p.npu_min_rows));
    }

    #[test]
    fn fit_recovers_lines_and_context_term() {
        let (qkv, attn) = (LinearCost { a: 1e-3, b: 2e-5, c: 0.0 }, LinearCost { a: 5e-4, b: 1e-5, c: 3e-8 });
        let mut s = Vec::new();
        for rows in [32, 64, 128, 256] {
            s.push(("qkv".to_string(), Processor::Npu, rows, 0, qkv.eval(rows, 0)));
            for start in [0, 256, 512] {
                s.push(("attn".to_string(), Processor::Cpu, rows, start, attn.eval(rows, start)));
            }
        }
        let t = TableCosts::fit_with_context(&s).unwrap();
        for (got, want) in [(t.get("qkv", Processor::Npu).unwrap(), qkv), (t.get("attn", Processor::Cpu).unwrap(), attn)] {
            assert!(close(got.a, want.a) && close(got.b, want.b) && close(got.c, want.c), "{got:?} vs {want:?}");
        }
        assert!(t.get("qkv", Processor::Cpu).is_none());
    }

    #[test]
    fn fit_single_row_size_is_proportional_and_bad_samples_fail() {
        let s = vec![("o".to_string(), Processor::Npu, 128, 2.0), ("o".to_string(), Processor::Npu, 128, 4.0)];
        let l = TableCosts::fit(&s).unwrap().get("o", Processor::Npu).unwrap();
        assert_eq!(l, LinearCost { a: 0.0, b: 3.0 / 128.0, c: 0.0 });
        assert!(TableCosts::fit(&[("o".to_string(), Processor::Npu, 0, 1.0)]).is_err());
        assert!(TableCosts::fit(&[("o".to_string(), Processor::Npu, 1, f64::NAN)]).is_err());
    }
}
