//! Per-tensor W8A8 quantization: symmetric INT8 weights, asymmetric u8 activations whose ranges
//! come from a calibration pass over real text, and the saved [`QuantProfile`] that lets later
//! runs skip calibration.
//!
//! Activations are clipped to their calibrated per-tensor range (the naive baseline). The shadow
//! outlier path attaches at [`QuantProfile::activation_quant`]: whatever lies beyond the range
//! returned there is what `outlier` will extract and run in float on the CPU.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::graph::Quant;

/// Quantize floats to u8 (round to nearest, saturate) under `q`.
pub fn quantize_u8(values: &[f32], q: Quant) -> Vec<u8> {
    let inv = 1.0 / q.scale;
    let off = q.offset as f32;
    values.iter().map(|&v| ((v * inv).round() - off).clamp(0.0, 255.0) as u8).collect()
}

/// Per-tensor symmetric INT8 quantization of a weight: `w ~= q * scale`, `q` in [-127, 127].
pub fn quantize_weight_i8(w: &[f32]) -> (Vec<i8>, Quant) {
    let max_abs = w.iter().fold(0f32, |m, &v| m.max(v.abs()));
    let scale = if max_abs > 0.0 { max_abs / 127.0 } else { 1.0 };
    let q = w.iter().map(|&v| (v / scale).round().clamp(-127.0, 127.0) as i8).collect();
    (q, Quant::symmetric(scale))
}

/// Observed range of one activation tensor.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ActRange {
    pub min: f32,
    pub max: f32,
}

impl ActRange {
    pub fn observe(&mut self, values: &[f32]) {
        for &v in values {
            self.min = self.min.min(v);
            self.max = self.max.max(v);
        }
    }
}

impl Default for ActRange {
    fn default() -> Self {
        ActRange { min: f32::INFINITY, max: f32::NEG_INFINITY }
    }
}

/// Collects activation ranges during a float calibration pass.
#[derive(Debug, Default)]
pub struct Calibrator {
    ranges: BTreeMap<String, ActRange>,
    pub tokens_seen: usize,
}

impl Calibrator {
    pub fn observe(&mut self, point: &str, values: &[f32]) {
        self.ranges.entry(point.to_string()).or_default().observe(values);
    }

    pub fn finish(self, model_id: String) -> QuantProfile {
        QuantProfile { format: PROFILE_FORMAT, model_id, tokens: self.tokens_seen, ranges: self.ranges }
    }
}

const PROFILE_FORMAT: u32 = 1;

/// Calibrated activation ranges for one model, keyed by quantization point
/// (e.g. `blk.3.ffn_in`). Saved as JSON next to the model.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct QuantProfile {
    pub format: u32,
    /// Identifies the weights the profile was calibrated on (see [`model_id`]).
    pub model_id: String,
    /// Calibration tokens seen.
    pub tokens: usize,
    pub ranges: BTreeMap<String, ActRange>,
}

impl QuantProfile {
    /// u8 quantization parameters for an activation point.
    pub fn activation_quant(&self, point: &str) -> Result<Quant> {
        let r = self.ranges.get(point).ok_or_else(|| Error::MissingRange(point.to_string()))?;
        Ok(Quant::u8_range(r.min, r.max))
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let json = serde_json::to_vec_pretty(self).expect("profile serializes");
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, json).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
    }

    /// Load a profile and check it was made for `model_id`.
    pub fn load(path: &Path, model_id: &str) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let bad = |reason: String| Error::Profile { path: path.to_path_buf(), reason };
        let p: QuantProfile = serde_json::from_slice(&bytes).map_err(|e| bad(format!("not a quant profile: {e}")))?;
        if p.format != PROFILE_FORMAT {
            return Err(bad(format!("format {} (this build reads {PROFILE_FORMAT}); delete it to recalibrate", p.format)));
        }
        if p.model_id != model_id {
            return Err(bad(format!(
                "calibrated for model {}, not this model ({model_id}); delete it or pass the right --profile",
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
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
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
    fn profile_round_trip_and_model_mismatch() {
        let dir = std::env::temp_dir().join(format!("npu-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.json");
        let mut c = Calibrator::default();
        c.observe("blk.0.attn_in", &[-1.0, 3.0]);
        c.observe("blk.0.attn_in", &[-2.0, 0.5]);
        c.finish("abc".into()).save(&path).unwrap();
        let p = QuantProfile::load(&path, "abc").unwrap();
        assert_eq!(p.ranges["blk.0.attn_in"], ActRange { min: -2.0, max: 3.0 });
        assert!(matches!(p.activation_quant("nope"), Err(Error::MissingRange(_))));
        let err = QuantProfile::load(&path, "def").unwrap_err().to_string();
        assert!(err.contains("calibrated for model abc"), "{err}");
        std::fs::write(&path, b"{ not json").unwrap();
        assert!(QuantProfile::load(&path, "abc").unwrap_err().to_string().contains("not a quant profile"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
