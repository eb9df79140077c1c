//! Issue 48's plan: each decoder layer as one static graph (norms, linears, RoPE, attention
//! over a masked cache of fixed capacity, FFN, residual adds), against the engine's layer
//! forward with the CPU between four stage graphs, on the three real models.

mod common;

use candle_npu::{NpuDevice, Numerics};
use candle_npu_models::PrefillOptions;
use candle_npu_models::{assets, CalibrationSet, DecodeWeights, KvType, LoadOptions, Pipeline, Precision, PrefillPlan, SchedOptions};
use common::*;

/// The model at `path` on the host executor, its first `layers` layers (`None`: all), with f32
/// KV caches: the two plans compute the same values only then (with the default f16 caches the
/// stages round a chunk's own keys and values before attending to them, a whole-layer graph
/// attends to them as computed and rounds them into the cache after).
fn load(path: &std::path::Path, precision: Precision, decode_weights: DecodeWeights, layers: Option<usize>) -> Pipeline {
    assert!(path.exists(), "{} missing: run scripts/setup.sh first", path.display());
    let opts = LoadOptions { precision: Some(precision), decode_weights, layers, kv: KvType::F32, ..Default::default() };
    Pipeline::load(path, None, &NpuDevice::host(), opts).unwrap()
}

/// The last token's logits of `tokens` in chunks of 16, with `plan`.
fn prefill(p: &mut Pipeline, tokens: &[u32], plan: PrefillPlan) -> Vec<f32> {
    p.model.set_sched(SchedOptions { plan, ..Default::default() }).unwrap();
    logits(p.model.prefill(tokens, &PrefillOptions::chunked(16)).unwrap())
}

fn logits(t: candle_core::Tensor) -> Vec<f32> {
    t.to_vec1::<f32>().unwrap()
}

/// 40 tokens in chunks of 16: three chunks, caches of capacity 16, 16 and 32 (the second chunk
/// attends over a full cache, the third over half of one), the last chunk half padding. SmolLM2
/// (GGUF's interleaved RoPE pairs, grouped heads), Gemma 3 (NeoX pairs, q/k norms, sandwich
/// norms, GELU, sliding and global layers, one KV head) and Qwen2.5's first 4 layers (QKV
/// biases; 4 layers keep its float graphs within a CI machine's memory).
#[test]
fn f32_whole_layer_graphs_give_the_four_stage_prefill_s_logits() {
    for (path, layers) in [(assets::smollm2(), None), (assets::gemma3_270m().unwrap(), None), (assets::qwen25_coder_05b().unwrap(), Some(4))] {
        // Float decode weights: decode's 8-bit activations (Q8_0) would turn a 1e-6 difference
        // in the cache into a rounding flip somewhere, and hide whether the cache is right.
        let mut p = load(&path, Precision::F32, DecodeWeights::F32, layers);
        let tokens = heldout_tokens(&p, 40);
        let want = prefill(&mut p, &tokens, PrefillPlan::Stages);
        let want_next = logits(p.model.decode(tokens[0]).unwrap());
        let got = prefill(&mut p, &tokens, PrefillPlan::Layers);
        assert_eq!(p.model.position(), 40);
        // The caches the graphs filled are the ones decode reads.
        let got_next = logits(p.model.decode(tokens[0]).unwrap());
        let (err, next) = (rel_max_err(&got, &want), rel_max_err(&got_next, &want_next));
        eprintln!(
            "{}: whole-layer F32 graphs against the four-stage F32 prefill, max |logit diff| / max |logit|: {err:.2e}; the next token's decode: {next:.2e}",
            path.display()
        );
        // Both are F32 forwards of one model that sum in other orders (attention over a masked
        // cache as two MatMuls, RoPE as a rotation): f32 rounding, about 1e-6 measured.
        assert!(err < 1e-4 && next < 1e-4, "{}: prefill {err:e}, decode {next:e}", path.display());
    }
}

/// W8A16 quantizes each stage's input to u16 over the calibrated range: a value one f32 step
/// from a grid boundary rounds either way, so two W8A16 forwards that sum in other orders drift
/// apart by more than f32 rounding. So: one layer is bit-identical to the four-stage prefill
/// (the same ops on the same values), and over 30 layers the whole-layer graphs are as close to
/// the F32 prefill as the four-stage W8A16 prefill is.
#[test]
fn w8a16_whole_layer_graphs_compute_the_four_stage_w8a16_prefill() {
    let set = CalibrationSet { sequences: 2, seq_len: 64, importance_sequences: 0, ..Default::default() };
    let mut one = load(&assets::smollm2(), Precision::W8A16, DecodeWeights::Q8_0, Some(1));
    one.calibrate(set, |_, _| {}).unwrap();
    let tokens = heldout_tokens(&one, 40);
    let want = prefill(&mut one, &tokens, PrefillPlan::Stages);
    assert_eq!(prefill(&mut one, &tokens, PrefillPlan::Layers), want, "one layer, bit for bit");

    let mut p = load(&assets::smollm2(), Precision::W8A16, DecodeWeights::Q8_0, None);
    p.ensure_profile(None, CalibrationSet::default(), |_, _| {}).unwrap();
    let four = prefill(&mut p, &tokens, PrefillPlan::Stages);
    let hot = p.model.hot_bytes();
    let whole = prefill(&mut p, &tokens, PrefillPlan::Layers);
    // Whole layers run no CPU shadow path: its hot columns go, and come back with the stages,
    // which compute the same bits with them (they are a speed structure).
    assert!(hot > 0 && p.model.hot_bytes() == 0, "hot columns: {hot} bytes with the stages, {} with whole layers", p.model.hot_bytes());
    assert_eq!(prefill(&mut p, &tokens, PrefillPlan::Stages), four, "the stages again");
    assert_eq!(p.model.hot_bytes(), hot);
    let f32 = logits(load(&assets::smollm2(), Precision::F32, DecodeWeights::Q8_0, None).model.prefill(&tokens, &PrefillOptions::chunked(16)).unwrap());
    let (e_whole, e_four, apart) = (rel_max_err(&whole, &f32), rel_max_err(&four, &f32), rel_max_err(&whole, &four));
    eprintln!("SmolLM2 W8A16 against F32, max |logit diff| / max |logit|: whole-layer graphs {e_whole:.2e}, four stages {e_four:.2e}; apart {apart:.2e}");
    assert!(e_whole <= 1.5 * e_four, "whole-layer W8A16 {e_whole:e} from F32, four-stage {e_four:e}");
    let mut w8a8 = load(&assets::smollm2(), Precision::W8A8, DecodeWeights::Q8_0, Some(1));
    w8a8.calibrate(set, |_, _| {}).unwrap();
    let e = w8a8.model.set_sched(SchedOptions { plan: PrefillPlan::Layers, ..Default::default() }).unwrap_err().to_string();
    assert!(e.contains("not W8A8") && e.contains("PrefillPlan::Stages"), "{e}");
    assert_eq!(w8a8.model.sched().plan, PrefillPlan::Stages, "a refused plan is not taken");
    let e = w8a8.model.layer_graph(0, 16, 16, Precision::W8A8).unwrap_err().to_string();
    assert!(e.contains("not W8A8"), "{e}");
}

/// Shadow W8A16 with its outliers through float weights inside the graph (whole layers) against
/// the same clip ranges with the outliers in float on the CPU (four stages): as close to F32.
#[test]
fn shadow_w8a16_whole_layer_graphs_keep_the_outliers_on_the_npu() {
    let mut p = load(&assets::smollm2(), Precision::W8A16Shadow, DecodeWeights::Q8_0, None);
    p.ensure_profile(None, CalibrationSet::default(), |_, _| {}).unwrap();
    let tokens = heldout_tokens(&p, 40);
    let four = prefill(&mut p, &tokens, PrefillPlan::Stages);
    let hot = p.model.hot_bytes();
    let whole = prefill(&mut p, &tokens, PrefillPlan::Layers);
    // Whole layers run no CPU shadow path: its hot columns go, and come back with the stages,
    // which compute the same bits with them (they are a speed structure).
    assert!(hot > 0 && p.model.hot_bytes() == 0, "hot columns: {hot} bytes with the stages, {} with whole layers", p.model.hot_bytes());
    assert_eq!(prefill(&mut p, &tokens, PrefillPlan::Stages), four, "the stages again");
    assert_eq!(p.model.hot_bytes(), hot);
    let f32 = logits(load(&assets::smollm2(), Precision::F32, DecodeWeights::Q8_0, None).model.prefill(&tokens, &PrefillOptions::chunked(16)).unwrap());
    let (e_whole, e_four) = (rel_max_err(&whole, &f32), rel_max_err(&four, &f32));
    eprintln!("SmolLM2 shadow W8A16 against F32, max |logit diff| / max |logit|: outliers through float weights in the graph {e_whole:.2e}, in float on the CPU {e_four:.2e}");
    assert!(e_whole <= 1.5 * e_four, "outliers on the NPU {e_whole:e} from F32, on the CPU {e_four:e}");
}

/// The HTP computes float tensors in FP16 (largest finite 65504) and Gemma 3's residual stream
/// reaches 1e5: carried at `STREAM_SCALE` through the whole-layer graphs, Gemma's F32 prefill on
/// the HTP's numerics (the HTP's default plan) is the exact one's within FP16 rounding at every
/// position. Unscaled, its first row became infinite at layer 7 and the logits NaN.
#[test]
fn gemma_s_stream_stays_within_fp16_on_the_htp_numerics() {
    let path = assets::gemma3_270m().unwrap();
    let opts = LoadOptions { precision: Some(Precision::F32), decode_weights: DecodeWeights::F32, ..Default::default() };
    let mut htp = Pipeline::load(&path, None, &NpuDevice::host_with(Numerics::Htp), opts.clone()).unwrap();
    assert_eq!(htp.model.sched().plan, PrefillPlan::Layers, "the HTP's default plan");
    let tokens = heldout_tokens(&htp, 40);
    let all = |p: &mut Pipeline| -> Vec<f32> {
        p.model.prefill(&tokens, &PrefillOptions::chunked(16).all_logits()).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    };
    let got = all(&mut htp);
    let want = all(&mut Pipeline::load(&path, None, &NpuDevice::host(), opts).unwrap());
    assert!(got.iter().all(|v| v.is_finite()), "non-finite logits on the HTP's numerics");
    let err = rel_max_err(&got, &want);
    eprintln!("Gemma 3, F32 whole layers, HTP numerics against exact, every position: {err:.2e}");
    // FP16 arithmetic through 18 layers: SmolLM2's 30 F32 layers through the library are 6.8e-3
    // from the exact host (docs/npu_layers.md).
    assert!(err < 2e-2, "{err:e}");
}
