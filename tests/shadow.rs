//! The shadow path on the real SmolLM2 file: cold columns read from the GGUF, layer importance
//! and pruning, and what an old profile gets.

mod common;

use std::sync::Arc;

use candle_npu::{ClipMethod, NpuDevice};
use candle_npu_models::checkpoint::{Checkpoint, GgufCheckpoint};
use candle_npu_models::gguf::Gguf;
use candle_npu_models::PrefillOptions;
use candle_npu_models::{assets, CalibrationSet, DecodeWeights, Precision};
use common::*;

#[test]
fn a_matrix_read_from_the_gguf_equals_the_dequantized_weight() {
    let g = Arc::new(Gguf::open(&assets::smollm2()).unwrap());
    let ckpt = GgufCheckpoint::new(g.clone()).unwrap();
    for name in ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.attn_k.weight"] {
        let w = g.f32_tensor(name).unwrap(); // [N, K]
        let src = ckpt.matrix(name).unwrap();
        assert_eq!(src.dims(), w.dims2().unwrap());
        assert_eq!(src.matrix().unwrap(), w.flatten_all().unwrap().to_vec1::<f32>().unwrap(), "{name}");
    }
    let e = ckpt.matrix("blk.0.no_such.weight").err().unwrap().to_string();
    assert!(e.contains("missing tensor 'blk.0.no_such.weight'"), "{e}");
}

#[test]
fn importance_is_measured_per_layer_and_pruning_drops_the_least_important() {
    let mut p = smollm2(&NpuDevice::host(), Precision::W8A8, DecodeWeights::Q8_0);
    // Small on purpose (2 x 64 tokens; importance on 1 of them: 31 short W8A8 passes).
    let set = CalibrationSet { sequences: 2, seq_len: 64, importance_sequences: 1, ..Default::default() };
    let prof = p.calibrate(set, |_, _| {}).unwrap();
    let n = p.model.config().n_layer;
    assert_eq!(prof.importance.len(), n);
    assert!(prof.importance.iter().all(|v| v.is_finite()));
    // Removing some layer's shadow path must cost something on the text it was measured on.
    let max = prof.importance.iter().fold(f32::MIN, |m, &v| m.max(v));
    assert!(max > 0.0, "importance {:?}", prof.importance);
    eprintln!("importance (nats/token): {:?}", prof.importance);

    let kept = p.model.prune_shadow(0.5).unwrap();
    assert_eq!(kept.iter().filter(|k| !**k).count(), n / 2);
    let least = prof.importance.iter().enumerate().filter(|(l, _)| !kept[*l]).fold(f32::MIN, |m, (_, &v)| m.max(v));
    let most = prof.importance.iter().enumerate().filter(|(l, _)| kept[*l]).fold(f32::MAX, |m, (_, &v)| m.min(v));
    assert!(least <= most, "a pruned layer ({least}) was more important than a kept one ({most})");
    let shadowed: Vec<bool> = p.model.linears().step_by(7).map(|l| l.shadow_enabled()).collect();
    assert_eq!(shadowed, kept, "every linear of a pruned layer is pruned");
    assert!(p.model.prune_shadow(1.5).is_err());
}

#[test]
fn an_old_profile_is_an_error_that_says_to_delete_it() {
    let mut p = smollm2(&NpuDevice::host(), Precision::W8A8, DecodeWeights::Q8_0);
    let dir = std::env::temp_dir().join(format!("candle-npu-old-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("old.w8a8.json");
    // What the previous build wrote: format 1, min/max ranges.
    let old = format!(r#"{{"format":1,"model_id":"{}","tokens":2048,"ranges":{{"blk.0.attn_in":{{"min":-3.0,"max":4.0}}}}}}"#, p.model.model_id());
    std::fs::write(&path, old).unwrap();
    let e = p.ensure_profile(Some(&path), CalibrationSet::default(), |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("old.w8a8.json") && e.contains("format 1") && e.contains("delete it to recalibrate"), "{e}");
    assert!(p.model.profile().is_none(), "nothing half-loaded");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_pruned_layer_runs_its_full_range_and_coverage_narrows_the_hot_set() {
    let mut p = smollm2(&NpuDevice::host(), Precision::W8A8, DecodeWeights::Q8_0);
    let set = CalibrationSet { sequences: 2, seq_len: 64, ..Default::default() };
    let seqs = p.calibration_sequences(set).unwrap();
    let cal = p.model.calibrate(&seqs, |_| {}).unwrap();
    let id = p.model.model_id().to_string();
    let text = heldout_tokens(&p, 64);
    let n = p.model.config().n_layer;

    // Every shadow path pruned == min/max ranges without shadow, bit for bit: a pruned layer
    // must not keep the tight clip range (it would drop every outlier).
    p.model.set_profile(cal.finish(id.clone(), ClipMethod::MinMax)).unwrap();
    p.model.set_shadow_layers(&vec![false; n]).unwrap();
    let want: Vec<f32> = p.model.prefill(&text, &PrefillOptions::chunked(64)).unwrap().to_vec1().unwrap();
    let tight = cal.finish(id, set.clip);
    p.model.set_profile(tight.clone()).unwrap();
    p.model.set_shadow_layers(&vec![false; n]).unwrap();
    let got: Vec<f32> = p.model.prefill(&text, &PrefillOptions::chunked(64)).unwrap().to_vec1().unwrap();
    assert_eq!(got, want);
    // ... and switching the shadow path back on restores the tight ranges.
    let with_shadow: Vec<f32> = {
        p.model.set_shadow_layers(&vec![true; n]).unwrap();
        p.model.prefill(&text, &PrefillOptions::chunked(64)).unwrap().to_vec1().unwrap()
    };
    assert_ne!(with_shadow, want);

    // Coverage: counted outliers pick a smaller hot set that still holds most outliers.
    let counts = p.model.count_channel_outliers(&seqs, 64, |_| {}).unwrap();
    assert_eq!(counts.len(), 4 * n);
    let all: usize = tight.points.values().map(|p| p.hot.len()).sum();
    let mut narrow = tight.clone();
    narrow.select_hot(&counts, 0.9).unwrap();
    let hot: usize = narrow.points.values().map(|p| p.hot.len()).sum();
    assert!(hot < all, "coverage 0.9 keeps {hot} of {all} hot channels");
    for (name, c) in &counts {
        let total: u64 = c.iter().sum();
        let held: u64 = narrow.points[name].hot.iter().map(|&ch| c[ch as usize]).sum();
        assert!(held as f64 >= 0.9 * total as f64, "{name}: hot channels hold {held} of {total} outliers");
    }
    eprintln!("hot channels: {all} with any calibration outlier, {hot} holding 90% of them");
}

/// Shadow W8A16 (u16 over W8A8's clip ranges, the same outliers on the CPU) is W8A8 with a finer
/// grid inside the range: its logits are closer to the F32 prefill's (a wrong u16 grid or lost
/// outliers would put them far behind).
#[test]
fn shadow_w8a16_is_closer_to_f32_than_shadow_w8a8() {
    let mut f32p = smollm2(&NpuDevice::host(), Precision::F32, DecodeWeights::Q8_0);
    let text = heldout_tokens(&f32p, 64);
    let want: Vec<f32> = f32p.model.prefill(&text, &PrefillOptions::chunked(64)).unwrap().to_vec1().unwrap();
    let mut w8 = smollm2(&NpuDevice::host(), Precision::W8A8, DecodeWeights::Q8_0);
    let set = CalibrationSet { sequences: 2, seq_len: 64, ..Default::default() };
    let profile = w8.calibrate(set, |_, _| {}).unwrap();
    let mut w16 = smollm2(&NpuDevice::host(), Precision::W8A16Shadow, DecodeWeights::Q8_0);
    w16.model.set_profile(profile).unwrap();
    let err =
        |p: &mut candle_npu_models::Pipeline| rel_max_err(&p.model.prefill(&text, &PrefillOptions::chunked(64)).unwrap().to_vec1::<f32>().unwrap(), &want);
    let (e8, e16) = (err(&mut w8), err(&mut w16));
    eprintln!("logits against F32, of the largest: shadow W8A8 {e8:.4}, shadow W8A16 {e16:.4}");
    assert!(e16 < e8, "shadow W8A16 {e16} is not closer to F32 than shadow W8A8 {e8}");
}
