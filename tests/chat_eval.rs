//! The chat eval in CI (`candle_npu_models::chat_eval`; the whole set is `eval --sections chat`,
//! `docs/chat.md`): SmolLM2's default prefill on a fixed subset of the conversations, on the host
//! executor (shadow W8A8, four stages per layer) and on the HTP's numerics (each layer one graph,
//! shadow W8A16, padded chunks, as on a real NPU), against the F32 prefill: no answer derails (the subset's kinds: a greeting, a fact, a
//! JSON system prompt, code, French, Japanese, two multi-turn ones; on the HTP's numerics also the
//! issue's example). And a padded chunk's rows
//! are computed independently of the real rows beside them.

mod common;

use candle_npu::{NpuDevice, Numerics, Tail};
use candle_npu_models::chat_eval::{self, Conversation};
use candle_npu_models::PrefillOptions;
use candle_npu_models::{CalibrationSet, DecodeWeights, KvType, LoadOptions, Pipeline, Precision, PrefillPlan, SchedOptions};
use common::*;

/// The subset: one conversation of each kind the eval holds.
const SUBSET: &[&str] = &[
    "greet-hi-there",
    "fact-capital-australia",
    "json-extract-person-leo",
    "py-fizzbuzz",
    "fr-chef-pate-a-crepes",
    "ja-fuji-height",
    "itdesk-vpn-multi",
    "ha-mt-sofia-cello",
];

/// The issue's example (a system prompt, then "My name is Bob and I live in Tokyo."): SmolLM2's
/// own F32 prefill ties four first tokens within 0.11 logits there ("N", "K" and two katakana
/// bytes, about a fifth of the probability each). The HTP's default plan (whole layers, shadow
/// W8A16, outliers through float weights) answers it without derailing; the host executor's
/// default (llm.npu's W8A8 stages, kept there for the host's speed) answers katakana, as INT8
/// weights with float activations do (`docs/chat.md`), so it is asserted on the HTP's numerics
/// only. With residual weights both hold: the test after this one.
const ISSUE_EXAMPLE: &str = "intro-bob-tokyo";

fn subset() -> Vec<Conversation> {
    let all = chat_eval::conversations().unwrap();
    SUBSET.iter().map(|id| all.iter().find(|c| c.id == *id).unwrap_or_else(|| panic!("no conversation {id}")).clone()).collect()
}

/// SmolLM2 at `precision` on `device`, with the default calibration, as a user's first run (not
/// a profile another test left).
fn calibrated(device: &NpuDevice, precision: Precision) -> Pipeline {
    let mut p = smollm2(device, precision, DecodeWeights::Checkpoint);
    let profile = p.calibrate(CalibrationSet::default(), |_, _| {}).unwrap();
    p.model.set_profile(profile).unwrap();
    p
}

#[test]
fn no_chat_answer_derails_on_the_host_or_the_htp_numerics() {
    let convs = subset();
    let mut f32p = smollm2(&NpuDevice::host(), Precision::F32, DecodeWeights::Checkpoint);
    let refs: Vec<_> = convs.iter().map(|c| chat_eval::reference(&mut f32p, c).unwrap()).collect();
    // Each device's default: shadow W8A8 in llm.npu's stages on the host executor; on the HTP's
    // numerics, each layer one graph, shadow W8A16 with its outliers through float weights.
    let htp_dev = NpuDevice::host_with(Numerics::Htp);
    let htp = calibrated(&htp_dev, Precision::for_device(&htp_dev));
    assert_eq!(htp.model.sched().plan, PrefillPlan::Layers, "the HTP's default plan");
    let bob = chat_eval::conversations().unwrap().into_iter().find(|c| c.id == ISSUE_EXAMPLE).expect("the issue's example");
    let bob = (bob.clone(), chat_eval::reference(&mut f32p, &bob).unwrap());
    for (name, mut p, with_bob) in [("host executor", calibrated(&NpuDevice::host(), Precision::W8A8), false), ("HTP numerics, whole layers", htp, true)] {
        let mut same = 0;
        let bob = with_bob.then_some((&bob.0, &bob.1));
        for (c, r) in convs.iter().zip(&refs).chain(bob) {
            let o = chat_eval::measure(&mut p, &mut f32p, r).unwrap();
            let text = p.decode_text(&o.answer).unwrap();
            let want = f32p.decode_text(&r.answer).unwrap();
            eprintln!("{name} {}: kl {:.4}, {} tokens agree: {text:?} (F32 {want:?})", c.id, o.kl, o.agree);
            assert!(o.derail.is_none(), "{name}, {}: derailed ({:?}): {text:?} where F32 answers {want:?}", c.id, o.derail);
            // First-token KL of SmolLM2's W8A8 on the whole set: median 0.007, largest 0.032
            // (docs/chat.md; whole layers lower); 0.1 is a distribution moved well beyond that.
            assert!(o.kl < 0.1, "{name}, {}: first-token KL {}", c.id, o.kl);
            same += o.same as usize;
        }
        eprintln!("{name}: {same} of {} answers the F32 prefill's", convs.len() + with_bob as usize);
    }
}

/// The issue's example with INT8 plus an INT8 residual on every linear (`LoadOptions::residual`,
/// about INT16's weight error on INT8 ops): it answers as the F32 prefill begins ("Nice to meet
/// you"), on the host executor and on the HTP's numerics, where the default INT8 weights answer
/// katakana (the test fails without the residual weights; `docs/chat.md`). Through Qualcomm's
/// library it still answers katakana: the tie (0.02 logits) is below what the library's
/// unmodelled float arithmetic moves logits by (`docs/chat.md`).
#[test]
fn residual_weights_keep_the_issue_s_example_from_derailing() {
    let bob = chat_eval::conversations().unwrap().into_iter().find(|c| c.id == "intro-bob-tokyo").expect("the issue's example");
    let mut f32p = smollm2(&NpuDevice::host(), Precision::F32, DecodeWeights::Checkpoint);
    let r = chat_eval::reference(&mut f32p, &bob).unwrap();
    let residual: Vec<String> = candle_npu_models::transformer::linear_names().map(String::from).collect();
    // With f16 KV (the default) the tie can fall to another of its first tokens: measured
    // 2026-12-01, the HTP numerics' answer became "Konnichiwa! I'm glad to have you in my city."
    // (not derailed; the host's stayed "Nice to meet you"). f16's rounding of the keys and
    // values (2^-11) moves logits by more than the tie's 0.02, so the first words are asserted
    // with f32 KV, the configuration the claim was measured in (`docs/chat.md`), and no
    // derailment with both.
    for (device, padded) in [(NpuDevice::host(), false), (NpuDevice::host_with(Numerics::Htp), true)] {
        for kv in [KvType::F32, KvType::F16] {
            let opts = LoadOptions { precision: Some(Precision::W8A8), residual: residual.clone(), kv, ..Default::default() };
            let mut p = Pipeline::load(&candle_npu_models::assets::smollm2(), None, &device, opts).unwrap();
            let profile = p.calibrate(CalibrationSet::default(), |_, _| {}).unwrap();
            p.model.set_profile(profile).unwrap();
            if padded {
                p.model.set_sched(SchedOptions { tail: Tail::Pad, ..Default::default() }).unwrap();
            }
            let o = chat_eval::measure(&mut p, &mut f32p, &r).unwrap();
            let text = p.decode_text(&o.answer).unwrap();
            eprintln!("{} ({kv:?} KV): kl {:.4}, {} tokens agree: {text:?}", device.executor_name(), o.kl, o.agree);
            assert!(o.derail.is_none(), "{} ({kv:?} KV): derailed ({:?}): {text:?}", device.executor_name(), o.derail);
            // The first word is one of the tie's two non-katakana first tokens, "N" and "K",
            // 24.07 each in F32 (`docs/chat.md`): which wins is a draw of float order (until
            // 2026-12-02 "Nice to meet you" here; the batched decode kernels, summing a Q4_1
            // row's blocks in another order, turned the host's to "Konnichiwa!"). A katakana
            // byte, the derailment, is neither.
            if kv == KvType::F32 {
                assert!(text.starts_with("Nice to meet you") || text.starts_with("Konnichiwa"), "{}: {text:?}", device.executor_name());
            }
        }
    }
}

/// Through a padded chunk, a row's logits are the same whatever the real rows beside it: the
/// first row of a prompt's second chunk with 1, 2, 3 and 16 real rows in that chunk (the
/// attention's GEMM once summed differently below 8 stacked rows, and W8A8 rounding took that to
/// 0.38 in logits).
#[test]
fn a_padded_chunk_s_row_does_not_depend_on_the_real_rows_beside_it() {
    let mut p = calibrated(&NpuDevice::host_with(Numerics::Htp), Precision::W8A8);
    p.model.set_sched(SchedOptions { tail: Tail::Pad, ..Default::default() }).unwrap();
    let tokens = heldout_tokens(&p, 48);
    let vocab = p.model.config().vocab;
    let row32 = |p: &mut Pipeline, n: usize| -> Vec<f32> {
        let l: Vec<f32> = p.model.prefill(&tokens[..n], &PrefillOptions::chunked(32).all_logits()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        l[32 * vocab..33 * vocab].to_vec()
    };
    let alone = row32(&mut p, 33);
    for n in [34, 35, 48] {
        assert_eq!(row32(&mut p, n), alone, "row 32 with {} real rows in its chunk", n - 32);
    }
}
