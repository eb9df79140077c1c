//! SmolLM2 prefill on the real QNN HTP library (x86 emulator from onnxruntime-qnn) vs the host
//! executor: same weights, same calibrated profile, same greedy continuation.
//! The emulator runs ~0.3-1 GMAC/s, so this uses 48 tokens in chunks of 32 (two chunks, the
//! second padded) and costs about a minute. The prepared-graph cache test only prepares (no
//! execution) and costs seconds.

mod common;

use candle_npu::{DeviceStats, HtpConfig, NpuDevice, QuantProfile, Tail};
use candle_npu_models::transformer::argmax;
use candle_npu_models::{CalibrationSet, DecodeWeights, Precision, SchedOptions};
use common::*;

/// Whether the QNN HTP library is there; prints why the test is skipped when it is not.
fn library_present() -> bool {
    let lib = HtpConfig::default().library_path();
    if !lib.exists() {
        eprintln!("skipped: {} absent (run scripts/setup.sh)", lib.display());
    }
    lib.exists()
}

/// Top-1 token at every prompt position.
fn top1(p: &mut candle_npu_models::Pipeline, prompt: &[u32]) -> Vec<u32> {
    let logits = p.model.prefill_all_logits(prompt, 32).unwrap();
    (0..prompt.len()).map(|i| argmax(&logits.get(i).unwrap()).unwrap()).collect()
}

#[test]
fn hexagon_prefill_agrees_with_the_host_executor() {
    if !library_present() {
        return;
    }
    let host = NpuDevice::host();
    let mut h = smollm2(&host, Precision::W8A8, DecodeWeights::Q8_0);
    let profile = h.calibrate(32, CalibrationSet { sequences: 4, seq_len: 128, importance_sequences: 0, ..Default::default() }, |_, _| {}).unwrap();
    h.model.set_profile(profile.clone()).unwrap();
    let prompt = heldout_tokens(&h, 48);
    // Every row on the NPU graphs (a padded second chunk, no CPU margin): the test compares the
    // two executors, and the Hexagon's margin would run candle's CPU matmuls instead.
    let pad = SchedOptions { tail: Tail::Pad, ..Default::default() };
    h.model.set_sched(pad.clone());
    let want = top1(&mut h, &prompt);

    let htp = NpuDevice::hexagon(HtpConfig::default()).unwrap();
    let mut x = smollm2(&htp, Precision::W8A8, DecodeWeights::Q8_0);
    x.model.set_profile(profile).unwrap();
    x.model.set_sched(pad);
    let got = top1(&mut x, &prompt);
    let s = htp.stats();
    eprintln!("htp: {} graphs prepared in {:.2}s, {} executions in {:.1}s", s.graphs_prepared, s.prepare_ns as f64 / 1e9, s.executions, s.execute_ns as f64 / 1e9);
    // Every stage ran on the HTP (no host fallback), prepared once, executed per chunk.
    let graphs = (h.model.config().n_layer * candle_npu_models::Model::NPU_STAGES_PER_LAYER) as u64;
    assert_eq!(s.fallbacks, 0);
    assert_eq!(s.graphs_prepared, graphs);
    assert_eq!(s.executions, 2 * graphs, "two chunks");
    // Why not identical tokens: the HTP applies per-channel weight scales in FP16 and rounds
    // with its own fixed-point arithmetic (see candle-npu/tests/htp_conformance.rs). Through 30 layers of naive per-tensor W8A8 (which
    // already moves top-1 on 45% of positions vs F32) those small differences flip near-tied
    // tokens: measured here, an 8-token greedy continuation matched the host for 3 tokens, then
    // diverged. So: the next token after the prompt must match, and the top-1 tokens over all 48
    // prompt positions must agree. Measured here: next token equal, agreement 0.646 (host W8A8
    // vs F32 is 0.555 on Wikipedia: the same order, because one u8 step of the down-projection
    // input is large when its per-tensor range includes the outliers). Bound 0.55 leaves room for
    // another emulator build; a broken translation (wrong offset sign, layout) gives ~0.
    let agree = got.iter().zip(&want).filter(|(a, b)| a == b).count() as f64 / want.len() as f64;
    eprintln!("hexagon vs host top-1 agreement over {} prompt positions: {agree:.3}", want.len());
    assert_eq!(got.last(), want.last(), "next token after the prompt");
    assert!(agree >= 0.55, "top-1 agreement {agree}: hexagon {got:?} vs host {want:?}");
}

/// Prepares SmolLM2's 120 W8A8 stage graphs for chunk length 32 on a fresh Hexagon executor (its
/// own QNN backend, as in a new process) with the given graph cache.
fn prepare_on_fresh_executor(cache: &std::path::Path, profile: &QuantProfile) -> DeviceStats {
    let htp = NpuDevice::hexagon(HtpConfig { cache_dir: Some(cache.to_path_buf()), ..Default::default() }).unwrap();
    let mut p = smollm2(&htp, Precision::W8A8, DecodeWeights::Q8_0);
    p.model.set_profile(profile.clone()).unwrap();
    p.model.prepare(32).unwrap();
    htp.stats()
}

#[test]
fn second_run_loads_every_stage_graph_from_the_cache() {
    if !library_present() {
        return;
    }
    // Any profile will do: the cache does not care what the scales are, only that they are fixed.
    // Calibration is the host's job even on a Hexagon model: it must not touch the HTP.
    let htp = NpuDevice::hexagon(HtpConfig::default()).unwrap();
    let mut h = smollm2(&htp, Precision::W8A8, DecodeWeights::Q8_0);
    let profile = h.calibrate(32, CalibrationSet { sequences: 1, seq_len: 32, importance_sequences: 0, ..Default::default() }, |_, _| {}).unwrap();
    assert_eq!(htp.stats(), DeviceStats::default(), "calibration ran on the host executor");
    let dir = std::env::temp_dir().join(format!("candle-npu-model-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let files = || std::fs::read_dir(&dir).unwrap().count();

    let first = prepare_on_fresh_executor(&dir, &profile);
    let n = 120; // 30 layers x 4 NPU stages
    assert_eq!((first.graphs_prepared, first.graphs_loaded, first.fallbacks), (n, 0, 0));
    assert_eq!(files(), n as usize, "one context binary per stage graph");

    let second = prepare_on_fresh_executor(&dir, &profile);
    eprintln!(
        "{n} stage graphs: finalized in {:.2}s, loaded from the cache in {:.2}s",
        first.prepare_ns as f64 / 1e9,
        second.load_ns as f64 / 1e9
    );
    assert_eq!((second.graphs_prepared, second.graphs_loaded), (0, n), "the second run prepares nothing");

    // One damaged file: that graph alone is rebuilt (with a warning), the file rewritten.
    let victim = std::fs::read_dir(&dir).unwrap().next().unwrap().unwrap().path();
    let len = std::fs::metadata(&victim).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&victim).unwrap().set_len(len / 3).unwrap();
    let third = prepare_on_fresh_executor(&dir, &profile);
    assert_eq!((third.graphs_prepared, third.graphs_loaded), (1, n - 1));
    assert!(std::fs::metadata(&victim).unwrap().len() > len / 3, "{} rewritten", victim.display());
    assert_eq!(files(), n as usize);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Qwen2 and Gemma 3 stage graphs (their shapes: Gemma's 1024-wide Q and 256-wide heads,
/// Qwen's 4864-wide FFN) prepare and run on the HTP with no host fallback, and compute what the
/// host executor computes. One layer, chunk 32, a seeded u8 input per stage.
#[test]
fn qwen2_and_gemma3_stage_graphs_run_on_the_htp() {
    if !library_present() {
        return;
    }
    use candle_npu::{Graph, TensorData};
    use candle_npu_models::{assets, LoadOptions, Pipeline};
    for path in [assets::qwen25_coder_05b().unwrap(), assets::gemma3_270m().unwrap()] {
        let host = NpuDevice::host();
        let mut p = Pipeline::load(&path, None, &host, LoadOptions::default()).unwrap();
        let set = CalibrationSet { sequences: 1, seq_len: 32, importance_sequences: 0, ..Default::default() };
        let profile = p.calibrate(32, set, |_, _| {}).unwrap();
        p.model.set_profile(profile).unwrap();
        let htp = NpuDevice::hexagon(HtpConfig::default()).unwrap();
        let graphs: Vec<Graph> = p.model.layer_graphs(1, 32, Precision::W8A8).unwrap();
        for g in &graphs {
            let k = g.tensor(g.inputs[0]).shape[1];
            let x = TensorData::U8((0..32 * k).map(|i| ((i * 2654435761usize) >> 7) as u8).collect());
            let want = host.prepare(g).unwrap().execute(&[&x]).unwrap();
            let got = htp.prepare(g).unwrap().execute(&[&x]).unwrap();
            for (a, b) in got.iter().zip(&want) {
                let (TensorData::F32(a), TensorData::F32(b)) = (a, b) else { panic!("F32 outputs") };
                let err = rel_max_err(a, b);
                eprintln!("{}: {} outputs, relative max error vs host {err:e}", g.name, a.len());
                // The HTP applies per-channel weight scales as an FP16 multiply after a per-tensor
                // FullyConnected (see the executor): 2^-11 relative, times a few roundings; the
                // per-channel conformance test allows 2e-3. Measured here: at most 9.3e-4.
                assert!(err < 2e-3, "{}: relative max error {err}", g.name);
            }
        }
        let s = htp.stats();
        assert_eq!((s.fallbacks, s.graphs_prepared, s.executions), (0, 4, 4), "{}", path.display());
    }
}
