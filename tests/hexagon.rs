//! SmolLM2 prefill on the real QNN HTP library (x86 emulator from onnxruntime-qnn) vs the host
//! executor: same weights, same calibrated profile, same greedy continuation.
//! The emulator runs ~0.3-1 GMAC/s, so this uses 48 tokens in chunks of 32 (two chunks, the
//! second padded) and costs about a minute.

mod common;

use candle_npu::{HtpConfig, NpuDevice};
use candle_npu_models::transformer::argmax;
use candle_npu_models::{CalibrationSet, DecodeWeights, Precision};
use common::*;

/// Top-1 token at every prompt position.
fn top1(p: &mut candle_npu_models::Pipeline, prompt: &[u32]) -> Vec<u32> {
    let logits = p.model.prefill_all_logits(prompt, 32).unwrap();
    (0..prompt.len()).map(|i| argmax(&logits.get(i).unwrap()).unwrap()).collect()
}

#[test]
fn hexagon_prefill_agrees_with_the_host_executor() {
    let lib = HtpConfig::default().library_path();
    if !lib.exists() {
        eprintln!("skipped: {} absent (run scripts/setup.sh)", lib.display());
        return;
    }
    let host = NpuDevice::host();
    let mut h = smollm2(&host, Precision::W8A8, DecodeWeights::Q8_0);
    let profile = h.calibrate(32, CalibrationSet { sequences: 4, seq_len: 128 }, |_, _| {}).unwrap();
    h.model.set_profile(profile.clone()).unwrap();
    let prompt = heldout_tokens(&h, 48);
    let want = top1(&mut h, &prompt);

    let htp = NpuDevice::hexagon(HtpConfig::default()).unwrap();
    let mut x = smollm2(&htp, Precision::W8A8, DecodeWeights::Q8_0);
    x.model.set_profile(profile).unwrap();
    let got = top1(&mut x, &prompt);
    let s = htp.stats();
    eprintln!("htp: {} graphs prepared in {:.2}s, {} executions in {:.1}s", s.graphs_prepared, s.prepare_ns as f64 / 1e9, s.executions, s.execute_ns as f64 / 1e9);
    // Every stage ran on the HTP (no host fallback), prepared once, executed per chunk.
    assert_eq!(s.fallbacks, 0);
    assert_eq!(s.graphs_prepared, 90);
    assert_eq!(s.executions, 180);
    // Why not identical tokens: the HTP computes the FFN's F32 elementwise ops (SiLU, *up) in
    // FP16 and rounds u8 requantization with its own fixed-point multiplier (one output step; see
    // candle-npu/tests/htp_conformance.rs). Through 30 layers of naive per-tensor W8A8 (which
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
