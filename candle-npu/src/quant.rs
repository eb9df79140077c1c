//! INT8 quantization: symmetric INT8 weights (per output channel, or per tensor), asymmetric u8
//! activations per tensor over a *clip range* chosen from a calibration pass over real text, and
//! the saved [`QuantProfile`] that lets later runs skip calibration.
//!
//! The clip range is chosen, not observed ([`ClipMethod`]): what lies beyond it at run time is
//! extracted by [`crate::outlier`] and computed in float on the CPU (the shadow path), so a tight
//! range costs CPU work, not accuracy. The profile also records each point's hot channels (those
//! with values beyond the range in calibration) and each layer's measured importance.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::graph::Quant;

/// Quantize floats to u8 (round to nearest, ties away from zero; saturate) under `q`.
pub fn quantize_u8(values: &[f32], q: Quant) -> Vec<u8> {
    crate::kernels::rows::quantize_u8(values, 1.0 / q.scale, q.offset as f32)
}

/// Per-tensor symmetric INT8 quantization of a weight: `w ~= q * scale`, `q` in [-127, 127].
pub fn quantize_weight_i8(w: &[f32]) -> (Vec<i8>, Quant) {
    // The tensor as one row of the per-channel kernel (an empty one keeps the scale 1).
    let (q, scale) = crate::kernels::rows::quantize_rows_i8(w, w.len());
    (q, Quant::symmetric(scale.first().copied().unwrap_or(1.0)))
}

/// Per-output-channel symmetric INT8 quantization of a weight `[N, K]`: `w[n, k] ~= q[n, k] *
/// scales[n]`. Each row keeps its own range, so a row of small weights is not crushed by the
/// tensor's largest one.
pub fn quantize_weight_i8_per_channel(w: &[f32], n: usize, k: usize) -> (Vec<i8>, Vec<f32>) {
    assert_eq!(w.len(), n * k, "weight is not [N, K]");
    crate::kernels::rows::quantize_rows_i8(w, k)
}

/// A weight `[N, K]` in QNN's LPBQ form ("low-power block quantization", BLOCKWISE_EXPANSION):
/// `w[n, k] ~= values[n, k] * block_scales[n, k / block] * channel_scales[n]`, with 4-bit
/// `values` in [-8, 7] and 4-bit block scales in 1..=15.
///
/// The HTP runs it by expanding `value * block_scale` into an 8-bit weight (at most 120 in
/// magnitude) under the channel's scale, and takes no wider form: 8-bit values or wider block
/// scales give wrong results or are refused (`fc_weight_encodings` in qnn-sys' tests,
/// `docs/npu_weights.md`). So every LPBQ weight is also an INT8 per-channel weight
/// ([`Lpbq::expand`]): LPBQ halves the bytes and never has less error than
/// [`quantize_weight_i8_per_channel`].
#[derive(Debug, Clone, PartialEq)]
pub struct Lpbq {
    /// Inputs per block (a divisor of `K`).
    pub block: usize,
    /// `[N, K]`, each in [-8, 7].
    pub values: Vec<i8>,
    /// `[N, K / block]`, each in 1..=15.
    pub block_scales: Vec<u8>,
    /// `[N]`.
    pub channel_scales: Vec<f32>,
}

impl Lpbq {
    /// The INT8 per-channel weight the HTP computes with: `values * block_scales` under
    /// `channel_scales`.
    pub fn expand(&self) -> Vec<i8> {
        let k = self.values.len() / self.channel_scales.len().max(1);
        let blocks = k / self.block;
        self.values.iter().enumerate().map(|(i, &v)| v * self.block_scales[(i / k) * blocks + (i % k) / self.block] as i8).collect()
    }

    /// The float weight it stands for.
    pub fn dequantize(&self) -> Vec<f32> {
        let k = self.values.len() / self.channel_scales.len().max(1);
        self.expand().iter().enumerate().map(|(i, &q)| q as f32 * self.channel_scales[i / k]).collect()
    }
}

/// LPBQ's INT8 value of `v` (the 4-bit value times the block scale) under block scale `s` and
/// channel scale `c`: the one formula of [`quantize_weight_lpbq`] and of every requantization
/// of an LPBQ weight from the file's blocks.
pub fn lpbq_value(v: f32, s: u8, c: f32) -> i8 {
    (v / (s as f32 * c)).round().clamp(-8.0, 7.0) as i8 * s as i8
}

/// LPBQ quantization of a weight `[N, K]` over blocks of `block` inputs. Each row's channel scale
/// is its largest block step over 15; each block's scale is the one of the integers around its
/// own step (`absmax / 7`) that gives the block the least squared error.
pub fn quantize_weight_lpbq(w: &[f32], n: usize, k: usize, block: usize) -> Result<Lpbq> {
    if w.len() != n * k || block == 0 || !k.is_multiple_of(block) {
        return Err(Error::Input(format!("LPBQ: a weight of {} values as [{n}, {k}] in blocks of {block} (K must be whole blocks)", w.len())));
    }
    let blocks = k / block;
    let mut out = Lpbq { block, values: vec![0; n * k], block_scales: vec![1; n * blocks], channel_scales: vec![1.0; n] };
    let q = |v: f32, step: f32| (v / step).round().clamp(-8.0, 7.0);
    for (r, row) in w.chunks(k).enumerate() {
        let steps: Vec<f32> = row.chunks(block).map(|b| b.iter().fold(0f32, |a, v| a.max(v.abs())) / 7.0).collect();
        let c = steps.iter().fold(0f32, |a, &v| a.max(v)) / 15.0;
        if c == 0.0 || !c.is_finite() {
            continue; // a zero row (values 0), or non-finite weights left for the caller's checks
        }
        out.channel_scales[r] = c;
        for (b, vals) in row.chunks(block).enumerate() {
            let ideal = steps[b] / c;
            let err = |s: f32| vals.iter().map(|&v| (q(v, s * c) * s * c - v).powi(2)).sum::<f32>();
            let s = [ideal.floor(), ideal.ceil(), ideal.ceil() + 1.0]
                .map(|s| s.clamp(1.0, 15.0))
                .into_iter()
                .min_by(|a, b| err(*a).total_cmp(&err(*b)))
                .unwrap_or(1.0);
            out.block_scales[r * blocks + b] = s as u8;
            for (i, &v) in vals.iter().enumerate() {
                out.values[r * k + b * block + i] = lpbq_value(v, s as u8, c) / s as i8;
            }
        }
    }
    Ok(out)
}

/// `sqrt(sum (approx - reference)^2 / sum reference^2)`: a weight conversion's error relative to
/// the weight it converts (0 for a zero reference).
pub fn relative_rms_error(reference: &[f32], approx: &[f32]) -> f64 {
    let (e, r) = reference.iter().zip(approx).fold((0f64, 0f64), |(e, r), (&w, &a)| (e + ((a - w) as f64).powi(2), r + (w as f64).powi(2)));
    if r > 0.0 {
        (e / r).sqrt()
    } else {
        0.0
    }
}

/// How a point's clip range is chosen from calibration.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum ClipMethod {
    /// The observed minimum and maximum: nothing is clipped in calibration (the naive baseline;
    /// a few huge channels stretch the range and every ordinary value loses resolution).
    MinMax,
    /// The narrowest range with at most `fraction` of the calibration values beyond it. With the
    /// shadow path, values beyond the range are computed in float, so a narrower range only
    /// costs CPU work: this is the range minimizing the in-range rounding error under an
    /// outlier budget.
    Budget {
        /// Largest share of the calibration values allowed beyond the range (a fraction, not a
        /// percentage).
        fraction: f64,
    },
}

impl ClipMethod {
    /// An [`Error::Input`] for a budget that is not a share of the values: NaN, negative, or 1
    /// and above (a NaN or negative budget would quietly act as 0).
    pub fn check(self) -> Result<()> {
        match self {
            ClipMethod::Budget { fraction } if !(0.0..1.0).contains(&fraction) => {
                Err(Error::Input(format!("clip budget {fraction}: the share of calibration values beyond the range must be at least 0 and below 1")))
            }
            _ => Ok(()),
        }
    }
}

/// Log-spaced histogram resolution: 32 bins per octave (2.2% relative width) over 2^-24..2^24.
const BINS_PER_OCTAVE: f64 = 32.0;
const MIN_EXP: f64 = -24.0;
const N_BINS: usize = 48 * 32;

fn bin_of(v: f32) -> usize {
    let a = v.abs() as f64;
    if a <= 0.0 {
        return 0;
    }
    (((a.log2() - MIN_EXP) * BINS_PER_OCTAVE).floor().max(0.0) as usize).min(N_BINS - 1)
}

/// Upper edge of a histogram bin.
fn bin_edge(b: usize) -> f32 {
    ((b + 1) as f64 / BINS_PER_OCTAVE + MIN_EXP).exp2() as f32
}

/// What calibration saw at one quantization point.
#[derive(Debug, Clone)]
struct PointObs {
    count: u64,
    min: f32,
    max: f32,
    ch_min: Vec<f32>,
    ch_max: Vec<f32>,
    /// Histograms of |v| for positive and negative values.
    pos: Vec<u64>,
    neg: Vec<u64>,
}

impl PointObs {
    fn new(channels: usize) -> Self {
        PointObs {
            count: 0,
            min: f32::INFINITY,
            max: f32::NEG_INFINITY,
            ch_min: vec![f32::INFINITY; channels],
            ch_max: vec![f32::NEG_INFINITY; channels],
            pos: vec![0; N_BINS],
            neg: vec![0; N_BINS],
        }
    }

    fn observe(&mut self, values: &[f32]) {
        let k = self.ch_min.len();
        for row in values.chunks_exact(k) {
            for (c, &v) in row.iter().enumerate() {
                self.ch_min[c] = self.ch_min[c].min(v);
                self.ch_max[c] = self.ch_max[c].max(v);
                if v > 0.0 {
                    self.pos[bin_of(v)] += 1;
                } else if v < 0.0 {
                    self.neg[bin_of(v)] += 1;
                }
            }
        }
        self.count += values.len() as u64;
        self.min = self.ch_min.iter().fold(self.min, |m, &v| m.min(v));
        self.max = self.ch_max.iter().fold(self.max, |m, &v| m.max(v));
    }

    /// The clip range of `method` and the share of calibration values beyond it.
    fn clip(&self, method: ClipMethod) -> (f32, f32, f64) {
        let fraction = match method {
            ClipMethod::MinMax => return (self.min, self.max, 0.0),
            ClipMethod::Budget { fraction } => fraction,
        };
        let allowed = (fraction * self.count as f64).floor() as u64;
        // beyond[b] = values in bins above b.
        let beyond = |h: &[u64]| {
            let mut out = vec![0u64; N_BINS];
            for b in (0..N_BINS - 1).rev() {
                out[b] = out[b + 1] + h[b + 1];
            }
            out
        };
        let (pb, nb) = (beyond(&self.pos), beyond(&self.neg));
        // Narrowest hi + |lo| with pb[hi] + nb[lo] <= allowed (two pointers: as hi grows, the
        // budget left for the negative tail grows and lo can shrink).
        let mut best = (f32::INFINITY, 0usize, 0usize);
        let mut lo = N_BINS - 1;
        for hi in 0..N_BINS {
            if pb[hi] > allowed {
                continue;
            }
            while lo > 0 && nb[lo - 1] <= allowed - pb[hi] {
                lo -= 1;
            }
            if nb[lo] > allowed - pb[hi] {
                continue;
            }
            let width = bin_edge(hi) + bin_edge(lo);
            if width < best.0 {
                best = (width, hi, lo);
            }
        }
        let (hi, lo) = (bin_edge(best.1).min(self.max.max(0.0)), (-bin_edge(best.2)).max(self.min.min(0.0)));
        let out = pb[best.1] + nb[best.2];
        (lo, hi, out as f64 / self.count.max(1) as f64)
    }
}

/// Collects activation statistics during a float calibration pass: per quantization point a
/// histogram of values (for the clip range), and each channel's minimum and maximum (for the hot
/// channels: those with values beyond the range).
#[derive(Debug, Default, Clone)]
pub struct Calibrator {
    points: BTreeMap<String, PointObs>,
    /// Calibration tokens observed, counted by the caller (`observe` sees values, not tokens);
    /// [`Calibrator::finish`] records it as [`QuantProfile::tokens`].
    pub tokens_seen: usize,
}

impl Calibrator {
    /// Observe rows of `channels` values at `point`.
    pub fn observe(&mut self, point: &str, values: &[f32], channels: usize) {
        self.points.entry(point.to_string()).or_insert_with(|| PointObs::new(channels)).observe(values);
    }

    /// The profile whose clip ranges `method` chooses.
    pub fn finish(&self, model_id: String, method: ClipMethod) -> QuantProfile {
        let points = self
            .points
            .iter()
            .map(|(name, o)| {
                let (lo, hi, beyond) = o.clip(method);
                let hot = (0..o.ch_min.len()).filter(|&c| o.ch_min[c] < lo || o.ch_max[c] > hi).map(|c| c as u32).collect();
                (name.clone(), PointProfile { lo, hi, min: o.min, max: o.max, beyond, channels: o.ch_min.len(), hot })
            })
            .collect();
        QuantProfile { format: PROFILE_FORMAT, model_id, tokens: self.tokens_seen, clip: method, points, importance: vec![] }
    }
}

/// The largest activation magnitude a profile may give a point: the real models' largest is
/// 2984 (SmolLM2's down projection input), and models that run in f16 stay below 65504; a range
/// reaching 1e6 did not come from a calibration pass (it would also put most values of the
/// point on the u8 grid's zero step).
pub const ACTIVATION_LIMIT: f32 = 1e6;

/// Version 2: clip ranges, hot channels and layer importance (version 1 held min/max only).
pub const PROFILE_FORMAT: u32 = 2;

/// Calibration result for one activation quantization point.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PointProfile {
    /// The clip range: the NPU's u8 grid covers it; the rest is the shadow path's.
    pub lo: f32,
    /// Top of the clip range (`lo` is its bottom).
    pub hi: f32,
    /// Observed extremes.
    pub min: f32,
    /// Largest value seen (`min` the smallest): the range W8A16 inputs and pruned layers' points
    /// are quantized over.
    pub max: f32,
    /// Share of calibration values beyond the clip range.
    pub beyond: f64,
    /// Input channels.
    pub channels: usize,
    /// Channels with calibration values beyond the clip range (their float columns stay resident).
    pub hot: Vec<u32>,
}

/// Calibrated activation quantization for one model, keyed by quantization point (e.g.
/// `blk.3.ffn_in`). Saved as JSON next to the model.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct QuantProfile {
    /// File format version: [`PROFILE_FORMAT`] for a profile of this build; [`QuantProfile::load`]
    /// refuses others.
    pub format: u32,
    /// Identifies the weights the profile was calibrated on (see [`model_id`]).
    pub model_id: String,
    /// Calibration tokens seen.
    pub tokens: usize,
    /// How the clip ranges were chosen.
    pub clip: ClipMethod,
    /// Each quantization point's calibration, by name.
    pub points: BTreeMap<String, PointProfile>,
    /// Per layer: the loss increase on calibration text when that layer's shadow path is
    /// removed (nats/token). Empty until measured; pruning needs it.
    #[serde(default)]
    pub importance: Vec<f32>,
}

impl QuantProfile {
    /// Narrow each point's hot set to the channels that held `coverage` (0..=1) of its outliers
    /// in `counts` (outliers per channel, per point, e.g. from a W8A8 pass over the calibration
    /// text): the busiest channels first. Outliers are concentrated, so a coverage just under 1
    /// keeps far fewer float columns; the rest are read from the model file when they occur.
    pub fn select_hot(&mut self, counts: &[(String, Vec<u64>)], coverage: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&coverage) {
            return Err(Error::Input(format!("hot-channel coverage {coverage} is not within 0..=1")));
        }
        for (name, count) in counts {
            let p = self.points.get_mut(name).ok_or_else(|| Error::MissingRange(name.clone()))?;
            if count.len() != p.channels {
                return Err(Error::Input(format!("point {name}: outlier counts for {} channels, the point has {}", count.len(), p.channels)));
            }
            let total: u64 = count.iter().sum();
            let mut order: Vec<usize> = (0..count.len()).filter(|&c| count[c] > 0).collect();
            order.sort_by(|&a, &b| count[b].cmp(&count[a]).then(a.cmp(&b)));
            let need = (coverage * total as f64).ceil() as u64;
            let (mut covered, mut hot) = (0u64, vec![]);
            for c in order {
                if covered >= need {
                    break;
                }
                covered += count[c];
                hot.push(c as u32);
            }
            hot.sort_unstable();
            p.hot = hot;
        }
        Ok(())
    }

    /// The calibration of `point`; [`Error::MissingRange`] when the profile has none.
    pub fn point(&self, point: &str) -> Result<&PointProfile> {
        self.points.get(point).ok_or_else(|| Error::MissingRange(point.to_string()))
    }

    /// u8 quantization parameters for an activation point (over its clip range).
    pub fn activation_quant(&self, point: &str) -> Result<Quant> {
        let p = self.point(point)?;
        Ok(Quant::u8_range(p.lo, p.hi))
    }

    /// Why the profile cannot be used, if it cannot: every range finite, ordered and of a sane
    /// magnitude ([`ACTIVATION_LIMIT`]), the clip range within the seen one, a clip range
    /// of some width wherever calibration saw more than one value (a zero-width one would send
    /// every value down the CPU's shadow path), hot channels sorted, unique and in range, and
    /// importance finite. (Whether it fits a model is `Model::set_profile`'s check.)
    pub fn validate(&self) -> std::result::Result<(), String> {
        for (name, p) in &self.points {
            let bad = |why: String| Err(format!("point {name}: {why}"));
            if ![p.lo, p.hi, p.min, p.max].iter().all(|v| v.is_finite()) || !(p.hi - p.lo).is_finite() {
                return bad(format!("range not finite (clip {}..{}, seen {}..{})", p.lo, p.hi, p.min, p.max));
            }
            if p.lo > p.hi || p.min > p.max {
                return bad(format!("range inverted (clip {}..{}, seen {}..{})", p.lo, p.hi, p.min, p.max));
            }
            if let Some(v) = [p.lo, p.hi, p.min, p.max].into_iter().find(|v| v.abs() > ACTIVATION_LIMIT) {
                return bad(format!(
                    "a range reaching {v:e} (clip {}..{}, seen {}..{}): no model's activations come near ±{ACTIVATION_LIMIT:e}",
                    p.lo, p.hi, p.min, p.max
                ));
            }
            // Every clip method chooses within what calibration saw (widened to take in 0).
            if p.lo < p.min.min(0.0) || p.hi > p.max.max(0.0) {
                return bad(format!("clip range {}..{} reaches outside the values seen, {}..{}", p.lo, p.hi, p.min, p.max));
            }
            if p.lo == p.hi && p.min < p.max {
                return bad(format!("zero-width clip range {}..{} over values seen in {}..{}", p.lo, p.hi, p.min, p.max));
            }
            // The u8 grid over the clip range and the u16 one over the seen range (W8A16 and
            // pruned layers) need a usable step: a range of 1e-44 has none, one of 6e38 an
            // infinite one.
            let steps = [(p.lo, p.hi, Quant::u8_range(p.lo, p.hi)), (p.min, p.max, Quant::u16_range(p.min, p.max))];
            if let Some((lo, hi, q)) = steps.into_iter().find(|(lo, hi, q)| lo < hi && !(q.scale.is_normal() && (hi - lo).is_finite())) {
                return bad(format!("range {lo}..{hi} has no usable quantization step ({})", q.scale));
            }
            if !(0.0..=1.0).contains(&p.beyond) {
                return bad(format!("share beyond the range {} is not within 0..=1", p.beyond));
            }
            if p.channels == 0 {
                return bad("0 channels".into());
            }
            if let Some(w) = p.hot.windows(2).find(|w| w[0] >= w[1]) {
                return bad(format!("hot channels not sorted and unique ({} then {})", w[0], w[1]));
            }
            if let Some(&c) = p.hot.iter().find(|&&c| c as usize >= p.channels) {
                return bad(format!("hot channel {c} of {} channels", p.channels));
            }
        }
        if let Some((l, v)) = self.importance.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(format!("importance of layer {l} is {v}"));
        }
        Ok(())
    }

    /// Writes atomically (a unique temporary file, synced, then renamed): a crash or a second
    /// writer never leaves half a profile. A profile that would not load again is an error here.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.validate().map_err(|reason| Error::Profile { path: path.to_path_buf(), reason: format!("not saved: {reason}") })?;
        let json = serde_json::to_vec_pretty(self).map_err(|e| Error::Profile { path: path.to_path_buf(), reason: e.to_string() })?;
        crate::fs::write_atomic(path, |f| f.write_all(&json))
    }

    /// Load a profile and check it was made for `model_id` by a build that reads its format.
    pub fn load(path: &Path, model_id: &str) -> Result<Self> {
        // Every channel hot in every point of a 126-layer model of 16384 channels and an FFN of
        // 53248 (Llama-3 405B), at <= 16 bytes a pretty-printed channel id, is ~200 MB.
        const PROFILE_LIMIT: u64 = 256 * crate::fs::MIB;
        let bytes = crate::fs::read_bounded(path, PROFILE_LIMIT, "quant profile")?;
        let bad = |reason: String| Error::Profile { path: path.to_path_buf(), reason };
        let v = crate::fs::parse_json(&bytes).map_err(|e| bad(format!("not a quant profile: {e}")))?;
        match v.get("format").and_then(|f| f.as_u64()) {
            Some(f) if f == PROFILE_FORMAT as u64 => {}
            Some(f) => return Err(bad(format!("format {f} (this build reads {PROFILE_FORMAT}); delete it to recalibrate"))),
            None => return Err(bad("not a quant profile: no format field".into())),
        }
        let p: QuantProfile = serde_json::from_value(v).map_err(|e| bad(format!("not a quant profile: {e}")))?;
        p.validate().map_err(|why| bad(format!("{why}; delete it to recalibrate")))?;
        if p.model_id != model_id {
            return Err(bad(format!(
                "calibrated for model {}, not this model ({model_id}); delete it to recalibrate, or give this model's profile",
                p.model_id
            )));
        }
        Ok(p)
    }

    /// Where the profile of a model file lives by default: next to it.
    pub fn default_path(model: &Path) -> PathBuf {
        let mut s = model.as_os_str().to_owned();
        s.push(".w8a8.json");
        PathBuf::from(s)
    }
}

/// A stable identifier of a model file's content: the sha256 of its bytes.
pub fn model_id(path: &Path) -> Result<String> {
    use sha2::Digest;
    use std::io::Read;
    let (mut f, _) = crate::fs::open_regular(path, "model file")?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{DType, TensorData};

    #[test]
    fn hot_set_by_coverage_takes_the_busiest_channels() {
        let mut cal = Calibrator::default();
        cal.observe("p", &[0.0, 0.0, 0.0, 0.0], 4);
        let mut prof = cal.finish("m".into(), ClipMethod::MinMax);
        // 100 outliers: channel 2 holds 90, channel 0 holds 9, channel 3 one, channel 1 none.
        let counts = vec![("p".to_string(), vec![9, 0, 90, 1])];
        for (coverage, want) in [(0.0, vec![]), (0.9, vec![2]), (0.95, vec![0, 2]), (0.99, vec![0, 2]), (1.0, vec![0, 2, 3])] {
            prof.select_hot(&counts, coverage).unwrap();
            assert_eq!(prof.points["p"].hot, want, "coverage {coverage}");
        }
        assert!(prof.select_hot(&counts, 1.5).is_err());
        assert!(prof.select_hot(&[("p".to_string(), vec![1, 2])], 0.9).unwrap_err().to_string().contains("2 channels"));
        assert!(prof.select_hot(&[("q".to_string(), vec![1])], 0.9).is_err());
    }

    #[test]
    fn profiles_that_cannot_be_used_are_refused_on_save_and_load() {
        let mut cal = Calibrator::default();
        cal.observe("p", &[-1.0, 0.5, 2.0, 3.0], 2);
        let good = cal.finish("m".into(), ClipMethod::MinMax);
        assert_eq!(good.validate(), Ok(()));
        let dir = std::env::temp_dir().join(format!("candle-npu-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.json");
        good.save(&path).unwrap();
        assert_eq!(QuantProfile::load(&path, "m").unwrap().points, good.points);
        type Edit = fn(&mut PointProfile);
        let cases: [(Edit, &str); 11] = [
            (|p| (p.lo, p.hi, p.min, p.max) = (-1e30, 1e30, -1e30, 1e30), "no model's activations"),
            (|p| (p.lo, p.hi) = (10.0, 20.0), "outside the values seen"),
            (|p| (p.lo, p.hi) = (0.0, 1e-44), "no usable quantization step"),
            (|p| (p.min, p.max) = (-3e38, 3e38), "no model's activations"),
            (|p| p.hi = f32::INFINITY, "not finite"),
            (|p| p.lo = f32::NAN, "not finite"),
            (|p| (p.lo, p.hi) = (1.0, -1.0), "inverted"),
            (|p| (p.lo, p.hi) = (0.0, 0.0), "zero-width"),
            (|p| p.hot = vec![1, 0], "not sorted"),
            (|p| p.hot = vec![0, 7], "hot channel 7 of 2"),
            (|p| p.beyond = -0.5, "within 0..=1"),
        ];
        for (edit, why) in cases {
            let mut bad = good.clone();
            edit(bad.points.get_mut("p").unwrap());
            let err = bad.save(&path).unwrap_err().to_string();
            assert!(err.contains(why) && err.contains("point p") && err.contains("not saved"), "{err}");
            // Written by hand (JSON has no NaN or inf: those are written as null), it does not load.
            // 1e39 reads back as an f32 infinity.
            let mut v = serde_json::to_value(&bad).unwrap();
            for f in ["lo", "hi"] {
                if v["points"]["p"][f].is_null() {
                    v["points"]["p"][f] = serde_json::json!(1e39);
                }
            }
            std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
            let err = QuantProfile::load(&path, "m").unwrap_err().to_string();
            assert!(err.contains("point p") && err.contains("delete it"), "{err}");
        }
        // A point given twice (the reader would keep the second silently): refused.
        let json = String::from_utf8(serde_json::to_vec(&good).unwrap()).unwrap();
        let point = serde_json::to_string(&good.points["p"]).unwrap();
        let twice = json.replacen(&format!("\"p\":{point}"), &format!("\"p\":{point},\"p\":{point}"), 1);
        assert_ne!(twice, json);
        std::fs::write(&path, twice).unwrap();
        let err = QuantProfile::load(&path, "m").unwrap_err().to_string();
        assert!(err.contains("\"p\" appears twice"), "{err}");
        // Nothing but the profile is left in the folder: the temporary files were renamed.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn u8_round_trip_is_within_half_a_step() {
        let q = Quant::u8_range(-2.5, 7.0);
        let xs: Vec<f32> = (0..1000).map(|i| -2.5 + 9.5 * i as f32 / 999.0).collect();
        let back = TensorData::U8(quantize_u8(&xs, q)).to_f32(Some(q));
        for (x, y) in xs.iter().zip(&back) {
            assert!((x - y).abs() <= q.scale * 0.5 + 1e-6, "{x} -> {y} (scale {})", q.scale);
        }
    }

    #[test]
    fn out_of_range_activations_saturate() {
        let q = Quant::u8_range(-1.0, 1.0);
        let back = TensorData::U8(quantize_u8(&[-100.0, 100.0], q)).to_f32(Some(q));
        let (lo, hi) = q.float_range(DType::U8);
        assert_eq!(back, vec![lo, hi]);
    }

    #[test]
    fn weight_quantization_is_symmetric_and_bounded() {
        let w: Vec<f32> = (0..257).map(|i| (i as f32 - 128.0) / 17.0).collect();
        let (q, p) = quantize_weight_i8(&w);
        assert_eq!(p.offset, 0);
        assert_eq!(*q.iter().max().unwrap(), 127);
        assert_eq!(*q.iter().min().unwrap(), -127);
        for (x, &qi) in w.iter().zip(&q) {
            assert!((x - qi as f32 * p.scale).abs() <= p.scale * 0.5 + 1e-6);
        }
        let (zq, zp) = quantize_weight_i8(&[0.0; 4]);
        assert_eq!((zq, zp.scale), (vec![0; 4], 1.0));
    }

    #[test]
    fn per_channel_weights_are_each_rows_per_tensor_quantization() {
        // Many rows over the pool, values at rounding ties, a zero row and a row of one sign.
        let (n, k) = (301, 37);
        let mut w: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) * 1e-3 * (1 + i / k % 7) as f32).collect();
        w[5 * k..6 * k].fill(0.0);
        w[7 * k..8 * k].iter_mut().enumerate().for_each(|(i, v)| *v = 0.5 + i as f32 * 0.5);
        let (q, s) = quantize_weight_i8_per_channel(&w, n, k);
        for (r, row) in w.chunks_exact(k).enumerate() {
            let (qr, sr) = quantize_weight_i8(row);
            assert_eq!((&q[r * k..(r + 1) * k], s[r]), (&qr[..], sr.scale), "row {r}");
        }
    }

    #[test]
    fn lpbq_is_an_int8_per_channel_weight_with_4_bit_parts() {
        let (n, k) = (6, 128);
        // Rows whose blocks span a wide range of magnitudes (as a 4-bit file's blocks do).
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 61) as f32 - 30.0) * 1e-3 * (1 + (i % k) / 32 * 5 + i / k) as f32).collect();
        let l = quantize_weight_lpbq(&w, n, k, 32).unwrap();
        assert!(l.values.iter().all(|&v| (-8..=7).contains(&v)));
        assert!(l.block_scales.iter().all(|&s| (1..=15).contains(&s)));
        let expanded = l.expand();
        assert!(expanded.iter().all(|&q| q.unsigned_abs() <= 120), "expansion leaves 8 bits");
        // What the HTP computes: the expanded INT8 values under the channel scales.
        let via_int8: Vec<f32> = expanded.iter().enumerate().map(|(i, &q)| q as f32 * l.channel_scales[i / k]).collect();
        assert_eq!(via_int8, l.dequantize());
        // 4-bit values: far coarser than INT8 per channel, bounded by half a block step.
        let (q8, s8) = quantize_weight_i8_per_channel(&w, n, k);
        let int8: Vec<f32> = q8.iter().enumerate().map(|(i, &q)| q as f32 * s8[i / k]).collect();
        let (e4, e8) = (relative_rms_error(&w, &l.dequantize()), relative_rms_error(&w, &int8));
        assert!(e4 > 2.0 * e8 && e4 < 0.2, "LPBQ error {e4}, INT8 per channel {e8}");
        for (i, (&a, &b)) in w.iter().zip(&l.dequantize()).enumerate() {
            let step = l.block_scales[(i / k) * (k / 32) + (i % k) / 32] as f32 * l.channel_scales[i / k];
            assert!((a - b).abs() <= 0.5 * step + 1e-6 || a.abs() > 7.0 * step, "value {i}: {a} -> {b}");
        }
    }

    #[test]
    fn lpbq_refuses_partial_blocks_and_keeps_zero_rows() {
        assert!(quantize_weight_lpbq(&[0.0; 2 * 48], 2, 48, 32).is_err());
        let l = quantize_weight_lpbq(&[0.0; 64], 1, 64, 32).unwrap();
        assert!(l.values.iter().all(|&v| v == 0) && l.dequantize().iter().all(|&v| v == 0.0));
    }

    #[test]
    fn per_channel_weights_keep_each_rows_range() {
        let w = [1.0, -0.5, 0.005, 0.02, 0.0, 0.0];
        let (q, s) = quantize_weight_i8_per_channel(&w, 3, 2);
        assert_eq!(q, vec![127, -64, 32, 127, 0, 0]);
        assert_eq!(s, vec![1.0 / 127.0, 0.02 / 127.0, 1.0]);
    }

    #[test]
    fn budget_clip_is_the_narrowest_range_with_few_values_beyond() {
        // 10,000 values in [-1, 1] and 10 outliers at +-50 in channel 3.
        let mut c = Calibrator::default();
        let mut rows = vec![];
        for i in 0..2500 {
            let mut row: Vec<f32> = (0..4).map(|j| (((i * 4 + j) % 200) as f32 / 100.0) - 1.0).collect();
            if i % 250 == 0 {
                row[3] = if i % 500 == 0 { 50.0 } else { -50.0 };
            }
            rows.extend(row);
        }
        c.observe("p", &rows, 4);
        let naive = c.finish("m".into(), ClipMethod::MinMax);
        assert_eq!((naive.points["p"].lo, naive.points["p"].hi), (-50.0, 50.0));
        let p = c.finish("m".into(), ClipMethod::Budget { fraction: 0.002 });
        let pt = &p.points["p"];
        assert!(pt.hi >= 0.99 && pt.hi < 1.1 && pt.lo <= -1.0 && pt.lo > -1.1, "{pt:?}");
        assert!(pt.beyond <= 0.002 && pt.beyond > 0.0, "{pt:?}");
        assert_eq!(pt.hot, vec![3]);
    }

    #[test]
    fn profile_round_trip_and_model_mismatch() {
        let dir = std::env::temp_dir().join(format!("npu-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.json");
        let mut c = Calibrator::default();
        c.observe("blk.0.attn_in", &[-1.0, 3.0], 2);
        c.observe("blk.0.attn_in", &[-2.0, 0.5], 2);
        c.finish("abc".into(), ClipMethod::MinMax).save(&path).unwrap();
        let p = QuantProfile::load(&path, "abc").unwrap();
        let pt = p.point("blk.0.attn_in").unwrap();
        assert_eq!((pt.lo, pt.hi, pt.min, pt.max), (-2.0, 3.0, -2.0, 3.0));
        assert!(pt.hot.is_empty());
        assert!(matches!(p.activation_quant("nope"), Err(Error::MissingRange(_))));
        let err = QuantProfile::load(&path, "def").unwrap_err().to_string();
        assert!(err.contains("calibrated for model abc"), "{err}");
        std::fs::write(&path, b"{ not json").unwrap();
        assert!(QuantProfile::load(&path, "abc").unwrap_err().to_string().contains("not a quant profile"));
        // A version-1 profile (min/max ranges only) says what to do.
        std::fs::write(&path, br#"{"format":1,"model_id":"abc","tokens":8,"ranges":{"blk.0.attn_in":{"min":-1,"max":1}}}"#).unwrap();
        let e = QuantProfile::load(&path, "abc").unwrap_err().to_string();
        assert!(e.contains("format 1") && e.contains("delete it to recalibrate") && e.contains("p.json"), "{e}");
        // A foreign JSON file.
        std::fs::write(&path, br#"{"name":"something else"}"#).unwrap();
        assert!(QuantProfile::load(&path, "abc").unwrap_err().to_string().contains("no format field"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
