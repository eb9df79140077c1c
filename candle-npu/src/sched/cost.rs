//! Node cost estimates: a closure, or a per-(stage, processor) linear table fit from measurements.

use std::collections::BTreeMap;

use serde::Serialize;

use super::dag::{Node, Processor};
use crate::error::{Error, Result};

/// Estimated seconds a node takes on its processor.
pub trait CostModel {
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
    pub a: f64,
    pub b: f64,
    pub c: f64,
}

impl LinearCost {
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
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, stage: impl Into<String>, processor: Processor, line: LinearCost) {
        self.lines.entry(stage.into()).or_default()[processor.index()] = Some(line);
    }

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
                return Err(Error::Input(format!(
                    "cost sample for {name} on {}: rows {rows}, {secs} s (need rows > 0 and finite secs >= 0)",
                    p.name()
                )));
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
    if scale[..k].iter().any(|&s| s == 0.0) {
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
