//! Shadow outlier execution, the CPU half (llm.npu §3.3).
//!
//! An NPU linear's input is quantized per tensor to u8 over a *clip range* chosen at calibration
//! (tight, so that ordinary values keep their resolution). The few values beyond it are clipped
//! for the NPU, and their remainder `x - clamp(x, lo, hi)` is kept here as a sparse matrix
//! ([`Outliers`]); each linear multiplies it in float with the matching weight columns and adds
//! the product to the NPU's output ([`crate::linear::ShadowLinear::finish`]). So
//! `npu(clamp(x)) + (x - clamp(x)) W^T = x W^T` up to the rounding of the in-range values.
//!
//! Outliers live in a few channels. Each outlier is multiplied with its channel's column of the
//! INT8 weight (dequantized): measured on SmolLM2, float columns instead change nothing
//! measurable, because the error the shadow path removes is the activation's clipping, not the
//! weight's rounding. The channels that had outliers in calibration (all of them, or those
//! holding a chosen share: `QuantProfile::select_hot`) are *hot*: their columns are kept
//! contiguous, since a column of a row-major weight is one cache line per output; a *cold*
//! channel, rare by construction, reads the strided column.

use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use crate::error::Result;
use crate::graph::{DType, Quant, TensorData};
use crate::kernels::rows::{outliers_into, rows_per_task};
use crate::quant::quantize_u8;

/// Where one NPU linear input is quantized: the clip range, its u8 quantization, and which
/// channels are hot. Linears that share an input (Q, K, V) share its point.
#[derive(Debug)]
pub struct InputPoint {
    /// The quantization point's name, its key in a [`QuantProfile`](crate::QuantProfile) (e.g.
    /// `blk.3.ffn_in`).
    pub name: String,
    /// Values in `[lo, hi]` go to the NPU as they are; the rest is clipped there and its
    /// remainder runs in float on the CPU.
    pub lo: f32,
    /// Top of the clip range (>= 0, as `lo` <= 0): the ends of the u8 grid, which may lie a
    /// fraction of a step beyond the calibrated range.
    pub hi: f32,
    /// The u8 quantization over the clip range: the NPU graph's input tensor carries it.
    pub quant: Quant,
    /// `hot[c]`: channel `c` had outliers in calibration.
    pub hot: Vec<bool>,
    stats: PointCounters,
}

#[derive(Debug, Default)]
struct PointCounters {
    elements: AtomicU64,
    outliers: AtomicU64,
    in_hot: AtomicU64,
    /// Outliers per input channel: what the hot set is chosen from.
    per_channel: Vec<AtomicU64>,
}

/// What a point has seen since it was made (or last reset): for the hot-channel hit rate.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct PointStats {
    /// Activation values examined (valid rows times channels).
    pub elements: u64,
    /// Values beyond the clip range, each sent down the shadow path.
    pub outliers: u64,
    /// Outliers that fell in hot channels.
    pub in_hot: u64,
}

impl PointStats {
    /// Adds another count to this one (for totals over points or layers).
    pub fn add(&mut self, o: PointStats) {
        self.elements += o.elements;
        self.outliers += o.outliers;
        self.in_hot += o.in_hot;
    }
    /// Share of outliers in hot channels (1 when there were none).
    pub fn hot_hit_rate(&self) -> f64 {
        if self.outliers == 0 {
            1.0
        } else {
            self.in_hot as f64 / self.outliers as f64
        }
    }
}

impl InputPoint {
    /// A point clipping to `[lo, hi]` (widened to contain 0, so that zero and padding are exact)
    /// over `channels` input channels, of which `hot` are hot.
    pub fn new(name: impl Into<String>, lo: f32, hi: f32, channels: usize, hot: &[u32]) -> Self {
        let (lo, hi) = (lo.min(0.0), hi.max(0.0));
        let quant = Quant::u8_range(lo, hi);
        let mut mask = vec![false; channels];
        for &c in hot.iter().filter(|&&c| (c as usize) < channels) {
            mask[c as usize] = true;
        }
        // The NPU saturates at the ends of the u8 grid, which may lie a fraction of a step
        // beyond [lo, hi]: clip at the grid's ends so the two halves add up exactly.
        let (glo, ghi) = quant.float_range(crate::graph::DType::U8);
        let (lo, hi) = if hi > lo { (glo, ghi) } else { (0.0, 0.0) };
        let stats = PointCounters { per_channel: (0..channels).map(|_| AtomicU64::new(0)).collect(), ..Default::default() };
        InputPoint { name: name.into(), lo, hi, quant, hot: mask, stats }
    }

    /// Quantize the first `valid_rows` rows of `x` (`[rows, channels]`) for the NPU and extract
    /// their outliers; padding rows are quantized but never extracted (their outputs are
    /// discarded).
    pub fn quantize(&self, x: &[f32], valid_rows: usize) -> (Vec<u8>, Outliers) {
        (self.clip_quantize(x), self.extract(x, valid_rows))
    }

    /// The NPU's half alone: `x` clipped to the range and quantized to u8 (for a stage whose
    /// shadow path is pruned, which needs no extraction).
    pub fn clip_quantize(&self, x: &[f32]) -> Vec<u8> {
        if self.lo == 0.0 && self.hi == 0.0 {
            // Zero-width clip: everything is an outlier, the NPU sees zeros.
            quantize_u8(&vec![0.0; x.len()], self.quant)
        } else {
            quantize_u8(x, self.quant)
        }
    }

    /// The u16 grid over the clip range (shadow W8A16): 256 times finer than [`Self::quant`],
    /// the same outliers.
    pub fn quant_u16(&self) -> Quant {
        Quant::u16_range(self.lo, self.hi)
    }

    /// [`Self::clip_quantize`] onto [`Self::quant_u16`]'s grid (saturating at the range's ends:
    /// the rest is the outliers').
    pub fn clip_quantize_u16(&self, x: &[f32]) -> TensorData {
        match self.lo == 0.0 && self.hi == 0.0 {
            true => TensorData::from_f32(&vec![0.0; x.len()], DType::U16, Some(self.quant_u16())),
            false => TensorData::from_f32(x, DType::U16, Some(self.quant_u16())),
        }
    }

    /// The outliers of the first `valid_rows` rows of `x` (`[rows, channels]`): the shadow
    /// path's half alone.
    pub fn extract(&self, x: &[f32], valid_rows: usize) -> Outliers {
        // Blocks of rows over the rayon pool.
        let cols = self.hot.len();
        let block = rows_per_task(valid_rows, cols);
        let x = &x[..(valid_rows * cols).min(x.len())];
        let parts: Vec<Outliers> = x.par_chunks((block * cols).max(1)).map(|rows| self.extract_rows(rows)).collect();
        Outliers::concat(cols, parts)
    }

    /// [`Self::extract`] of every row of `x`, in one pass.
    fn extract_rows(&self, x: &[f32]) -> Outliers {
        let cols = self.hot.len();
        let mut out = Outliers { cols, row_start: vec![0], channel: vec![], value: vec![] };
        if cols == 0 {
            return out;
        }
        for row in x.chunks_exact(cols) {
            outliers_into(row, self.lo, self.hi, &mut out.channel, &mut out.value);
            out.row_start.push(out.channel.len() as u32);
        }
        // Counted here, once per channel (an atomic add per outlier made the pool's threads
        // contend for the counters' cache lines).
        let mut per_channel = vec![0u32; cols];
        out.channel.iter().for_each(|&c| per_channel[c as usize] += 1);
        let mut in_hot = 0u64;
        for (c, &count) in per_channel.iter().enumerate().filter(|(_, &count)| count > 0) {
            self.stats.per_channel[c].fetch_add(count as u64, Ordering::Relaxed);
            in_hot += self.hot[c] as u64 * count as u64;
        }
        self.stats.elements.fetch_add((x.len() / cols * cols) as u64, Ordering::Relaxed);
        self.stats.outliers.fetch_add(out.value.len() as u64, Ordering::Relaxed);
        self.stats.in_hot.fetch_add(in_hot, Ordering::Relaxed);
        out
    }

    /// The counts since the point was made or last reset.
    pub fn stats(&self) -> PointStats {
        PointStats {
            elements: self.stats.elements.load(Ordering::Relaxed),
            outliers: self.stats.outliers.load(Ordering::Relaxed),
            in_hot: self.stats.in_hot.load(Ordering::Relaxed),
        }
    }

    /// Outliers seen per input channel since the point was made (or last reset).
    pub fn channel_outliers(&self) -> Vec<u64> {
        self.stats.per_channel.iter().map(|c| c.load(Ordering::Relaxed)).collect()
    }

    /// Zeroes every count, the per-channel ones included.
    pub fn reset_stats(&self) {
        self.stats.per_channel.iter().for_each(|c| c.store(0, Ordering::Relaxed));
        self.stats.elements.store(0, Ordering::Relaxed);
        self.stats.outliers.store(0, Ordering::Relaxed);
        self.stats.in_hot.store(0, Ordering::Relaxed);
    }
}

/// The remainder of an activation beyond its clip range, row by row (CSR): row `r`'s outliers
/// are `channel[row_start[r]..row_start[r + 1]]` with their `value`s.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outliers {
    /// Channels per row of the activation (the linear's `K`).
    pub cols: usize,
    /// `rows + 1` offsets into `channel` and `value`, from 0 to their length.
    pub row_start: Vec<u32>,
    /// Each outlier's input channel, ascending within a row.
    pub channel: Vec<u32>,
    /// Each outlier's remainder `x - clamp(x, lo, hi)`: what the NPU's clipped input misses.
    pub value: Vec<f32>,
}

impl Outliers {
    /// Rows covered: the activation's valid rows, outliers or not.
    pub fn rows(&self) -> usize {
        self.row_start.len().saturating_sub(1)
    }
    /// Number of outliers over all rows.
    pub fn len(&self) -> usize {
        self.value.len()
    }
    /// Whether no row has an outlier.
    pub fn is_empty(&self) -> bool {
        self.value.is_empty()
    }
    /// (channel, value) of row `r`'s outliers (none past the last row).
    pub fn row(&self, r: usize) -> impl Iterator<Item = (usize, f32)> + '_ {
        let (a, b) = match r < self.rows() {
            true => (self.row_start[r] as usize, self.row_start[r + 1] as usize),
            false => (0, 0),
        };
        self.channel[a..b].iter().zip(&self.value[a..b]).map(|(&c, &v)| (c as usize, v))
    }

    /// The rows of `parts`, one after another.
    pub fn concat(cols: usize, parts: Vec<Outliers>) -> Outliers {
        let mut out = Outliers { cols, row_start: vec![0], channel: vec![], value: vec![] };
        for p in parts {
            let base = out.channel.len() as u32;
            out.row_start.extend(p.row_start.iter().skip(1).map(|s| base + s));
            out.channel.extend(p.channel);
            out.value.extend(p.value);
        }
        out
    }

    /// (row, channel, value) of every outlier.
    pub fn iter(&self) -> impl Iterator<Item = (usize, usize, f32)> + '_ {
        (0..self.rows()).flat_map(move |r| {
            let (a, b) = (self.row_start[r] as usize, self.row_start[r + 1] as usize);
            (a..b).map(move |i| (r, self.channel[i] as usize, self.value[i]))
        })
    }
}

/// The float weight of one linear, `[N, K]` (out, in), read on demand from where it lives (for a
/// checkpoint, its file), so that no float copy has to stay resident: to quantize it and for a
/// float graph.
pub trait WeightSource: Send + Sync {
    /// (out, in) features.
    fn dims(&self) -> (usize, usize);
    /// The whole weight, row-major `[N, K]`.
    fn matrix(&self) -> Result<Vec<f32>>;
    /// Where the weight comes from, for logs and errors.
    fn describe(&self) -> String;
    /// The weight in its file's own blocks (a GGUF's Q4_K, Q6_K, ...), where they are (mapped):
    /// what [`crate::DecodeWeights::Checkpoint`] decodes with. `None` where the source has no
    /// blocks of a format the decode kernels read ([`crate::kernels::gemv::BlockFormat`]).
    fn blocks(&self) -> Result<Option<crate::kernels::gemv::BlockMatrix>> {
        Ok(None)
    }
}

/// A weight held in memory (`[N, K]`, row-major): for tests and synthetic models.
pub struct InMemoryWeight {
    /// What [`WeightSource::describe`] shows.
    pub name: String,
    /// The weight, `[N, K]` row-major, behind an `Arc` so the caller can keep sharing it.
    pub w: std::sync::Arc<Vec<f32>>,
    /// Output features (rows).
    pub n: usize,
    /// Input features (columns).
    pub k: usize,
}

impl InMemoryWeight {
    /// A source over a `[N, K]` F32 tensor.
    pub fn from_tensor(name: impl Into<String>, w: &candle_core::Tensor) -> Result<Self> {
        let (n, k) = w.dims2()?;
        Ok(InMemoryWeight { name: name.into(), w: std::sync::Arc::new(w.flatten_all()?.to_vec1::<f32>()?), n, k })
    }
}

impl WeightSource for InMemoryWeight {
    fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }
    fn matrix(&self) -> Result<Vec<f32>> {
        Ok(self.w.to_vec())
    }
    fn describe(&self) -> String {
        format!("{} (in memory)", self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_splits_exactly_into_clip_plus_outliers() {
        let p = InputPoint::new("t", -1.0, 2.0, 4, &[3]);
        let x = [0.5, -3.0, 1.0, 9.0, 0.0, 0.0, 0.0, 0.0, 7.0, 7.0, 7.0, 7.0];
        let (q, o) = p.quantize(&x, 2);
        assert_eq!(q.len(), 12, "padding rows are quantized too");
        assert_eq!(o.rows(), 2, "only valid rows are extracted");
        let got: Vec<_> = o.iter().collect();
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].0, got[0].1), (0, 1));
        assert!((got[0].2 - (-3.0 - p.lo)).abs() < 1e-6);
        assert_eq!((got[1].0, got[1].1), (0, 3));
        assert!((got[1].2 - (9.0 - p.hi)).abs() < 1e-6);
        let s = p.stats();
        assert_eq!((s.elements, s.outliers, s.in_hot), (8, 2, 1));
        assert_eq!(s.hot_hit_rate(), 0.5);
    }

    #[test]
    fn extraction_over_the_pool_gives_what_one_pass_does() {
        // Enough rows for several blocks; the valid rows end inside a block.
        let (rows, cols, valid) = (1000, 64, 777);
        let p = InputPoint::new("t", -1.0, 1.0, cols, &[]);
        assert!(rows_per_task(rows, cols) < valid, "the test must split");
        let x: Vec<f32> = (0..rows * cols).map(|i| if i % 37 == 0 { (i % 11) as f32 - 5.0 } else { 0.1 }).collect();
        let (q, o) = p.quantize(&x, valid);
        assert_eq!(q, p.clip_quantize(&x));
        assert_eq!(o, p.extract_rows(&x[..valid * cols]));
        assert_eq!(o.rows(), valid);
        assert!(o.len() > 1000, "outliers in every block: {}", o.len());
        let want: Vec<(usize, f32)> = x[..cols].iter().map(|&v| v - v.clamp(p.lo, p.hi)).enumerate().filter(|&(_, r)| r != 0.0).collect();
        assert_eq!(o.row(0).collect::<Vec<_>>(), want);
        assert!(!want.is_empty());
        assert_eq!(o.row(valid).count(), 0);
    }
}
