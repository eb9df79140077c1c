//! Out-of-order prefill (llm.npu §3.4) and the CPU margin (HeteroLLM) on real SmolLM2 weights:
//! every policy gives bit-identical logits to in-order, the recorded schedule respects the DAG,
//! and a margin plan has no padding and the logits of the padded plan.

mod common;

use candle_npu::sched::{Policy, Trace};
use candle_npu::{NpuDevice, Tail};
use candle_npu_models::Pipeline;
use candle_npu_models::{CalibrationSet, DecodeWeights, Precision, SchedOptions};
use common::*;

/// All-position logits of `toks` in chunks of 64, scheduled by `policy` (NPU queue: one thread).
fn prefill(p: &mut Pipeline, toks: &[u32], tail: Tail, policy: Policy) -> Vec<f32> {
    p.model.set_sched(SchedOptions { policy, tail, npu_threads: Some(1) });
    p.model.prefill_all_logits(toks, 64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn every_policy_is_bit_identical_to_in_order() {
    let mut p = smollm2(&NpuDevice::host(), Precision::W8A8, DecodeWeights::Q8_0);
    p.ensure_profile(None, 64, CalibrationSet::default(), |_, _| {}).unwrap();
    // 4 full chunks of 64 and a padded one: cross-chunk attention edges at every layer.
    let toks = heldout_tokens(&p, 300);
    let run = |p: &mut Pipeline, policy: Policy| prefill(p, &toks, Tail::Pad, policy);
    let reference = run(&mut p, Policy::InOrder);
    for policy in Policy::heuristics() {
        let name = policy.name();
        let got = run(&mut p, policy);
        assert!(got == reference, "{name}: logits differ from in-order by {}", rel_max_err(&got, &reference));
        let (dag, schedule) = p.model.last_run().unwrap();
        schedule.validate(dag).unwrap();
        let trace = Trace::from_schedule(dag, schedule).to_json();
        assert_eq!(trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "X").count(), dag.len(), "{name}: one slice per node");
    }
}

#[test]
fn a_cpu_margin_has_no_padding_and_the_padded_logits() {
    // F32 on both sides (NPU stages in F32, margin linears with F32 decode weights): the two
    // plans differ only in summation order.
    let mut p = smollm2(&NpuDevice::host(), Precision::F32, DecodeWeights::F32);
    let toks = heldout_tokens(&p, 150);
    let mut run = |tail: Tail, policy: Policy| prefill(&mut p, &toks, tail, policy);
    let padded = run(Tail::Pad, Policy::InOrder);
    for policy in Policy::heuristics() {
        let margin = run(Tail::Margin, policy.clone());
        let err = rel_max_err(&margin, &padded);
        assert!(err < 1e-4, "{}: margin vs padded {err}", policy.name());
    }
    let (dag, _) = p.model.last_run().unwrap();
    // 2 x 64 on the NPU, 22 rows as a margin: its nodes are all on the CPU.
    let margin_nodes: Vec<_> = dag.nodes().iter().filter(|n| n.chunk == 2).collect();
    assert!(margin_nodes.iter().all(|n| n.processor == candle_npu::Processor::Cpu && n.rows == 22));
}
