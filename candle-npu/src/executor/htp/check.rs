//! A graph the QNN library has just prepared, checked against the HTP numerics model before it
//! is used or cached.
//!
//! Why: the x86 library's prepare of graphs with 4-bit LPBQ weights read past the encoding's
//! per-channel arrays (it takes `max(N, K)` channels; `build.rs` pads them since 2026-12-03),
//! and what lay beyond was the heap: about one 256-output FullyConnected part in 400 to 600 came
//! back wrong by thousands of output steps (up to the whole range), while the same graph
//! prepared again was right, and a prepared graph gave the same values on every execution
//! (`htp_conformance::lpbq_weights_on_the_library`, `docs/npu_weights.md`). Qwen2.5-Coder's
//! whole-layer graph holds 52 parts: 2 of its 24 layers came back wrong in one load, and its
//! answer was garbage with nothing saying why. A wrong part is gross, so one execution on probe
//! inputs against the numerics model (proven op by op against the library) finds it, and the
//! executor prepares the graph again. The price, on the x86 emulator: one execution of the graph
//! on the library and one on the model, about 3 s per SmolLM2 layer graph of 32 rows, 7 s per
//! Qwen2.5-Coder one (its prepare alone: about 1 s); only on a cache miss. Kept with the cause
//! fixed: a wrong build is silent garbage otherwise, and the library is a closed binary.
//!
//! Graphs without LPBQ weights are not checked: INT8 and float graphs were never seen wrong this
//! way (every conformance test prepares them once).

use crate::error::Result;
use crate::graph::{DType, Graph, TensorData};

use crate::executor::{ExecutableGraph, Executor, HostExecutor, Numerics};

/// How far a library output may be from the numerics model's, as a fraction of the model
/// output's largest magnitude, before the graph counts as wrongly prepared. Measured on whole
/// layer graphs with probe inputs: right ones 0.0006 to 0.0100 (72 graphs: SmolLM2, Qwen2.5-Coder
/// and Gemma 3), wrong ones 0.94 and 10.4.
pub(super) const WRONG_BEYOND: f32 = 0.05;

/// Whether `graph` is one the library's prepare can get wrong (it holds LPBQ weights).
pub(super) fn needs_check(graph: &Graph) -> bool {
    graph.tensors.iter().any(|t| t.block_scales.is_some())
}

/// Runs `prepared` (the library's build of `graph`) and the HTP numerics model on the same
/// probe inputs and gives the largest gap between their outputs, as a fraction of each model
/// output's largest magnitude (the worst output's).
pub(super) fn max_gap(graph: &Graph, prepared: &dyn ExecutableGraph) -> Result<f32> {
    let inputs = probe_inputs(graph);
    let refs: Vec<&TensorData> = inputs.iter().collect();
    let got = prepared.execute(&refs)?;
    let want = HostExecutor::with_numerics(Numerics::Htp).prepare(graph)?.execute(&refs)?;
    let mut worst = 0f32;
    for ((id, got), want) in graph.outputs.iter().zip(&got).zip(&want) {
        let quant = graph.tensor(*id).quant;
        let (got, want) = (got.to_f32(quant), want.to_f32(quant));
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
        let gap = got.iter().zip(&want).fold(0f32, |m, (a, b)| if a.is_nan() != b.is_nan() { f32::INFINITY } else { m.max((a - b).abs()) });
        worst = worst.max(gap / scale);
    }
    Ok(worst)
}

/// Inputs over each input's whole quantization grid (F32 ones in [-1, 1]), the same for every
/// call: a SplitMix64 stream, so the check needs no random-number crate.
fn probe_inputs(graph: &Graph) -> Vec<TensorData> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    };
    graph
        .inputs
        .iter()
        .map(|&id| {
            let t = graph.tensor(id);
            let (lo, hi) = match (t.dtype, t.quant) {
                (DType::F32, _) | (_, None) => (-1.0, 1.0),
                (d, Some(q)) => q.float_range(d),
            };
            let values: Vec<f32> = (0..t.shape.iter().product::<usize>()).map(|_| lo + (hi - lo) * next()).collect();
            TensorData::from_f32(&values, t.dtype, t.quant)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Quant;
    use crate::outlier::InMemoryWeight;
    use crate::{DecodeWeights, ShadowLinear, WeightQuant};
    use std::sync::Arc;

    /// The library's fault as measured: one part of 256 outputs off by thousands of steps.
    struct OnePartWrong {
        right: Box<dyn ExecutableGraph>,
        n: usize,
        offset: f32,
    }

    impl ExecutableGraph for OnePartWrong {
        fn execute(&self, inputs: &[&TensorData]) -> Result<Vec<TensorData>> {
            let mut out = self.right.execute(inputs)?;
            let TensorData::F32(v) = &mut out[0] else { panic!("an F32 output") };
            v.iter_mut().enumerate().filter(|(i, _)| (256..512).contains(&(i % self.n))).for_each(|(_, x)| *x += self.offset);
            Ok(out)
        }
    }

    fn lpbq_graph(n: usize, k: usize) -> Graph {
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.1).collect();
        let src = Arc::new(InMemoryWeight { name: "w".into(), w: Arc::new(w), n, k });
        let lin = ShadowLinear::new("l", src, None, WeightQuant::Lpbq { block: 32 }, DecodeWeights::Q8_0).unwrap();
        let mut g = Graph::new("checked");
        let x = g.input("x", &[8, k], DType::U16, Some(Quant::u16_range(-2.0, 2.0)));
        let y = lin.add_to_graph(&mut g, "", x).unwrap();
        g.mark_output(y);
        g
    }

    #[test]
    fn a_wrong_part_is_found_and_a_right_graph_passes() {
        let (n, k) = (768, 128);
        let g = lpbq_graph(n, k);
        assert!(needs_check(&g));
        let model = || HostExecutor::with_numerics(Numerics::Htp).prepare(&g).unwrap();
        assert_eq!(max_gap(&g, &*model()).unwrap(), 0.0, "the model against itself");
        // The host executor (exact integer sums, f32 rounding) is right: within a few steps.
        let host = HostExecutor::new().prepare(&g).unwrap();
        assert!(max_gap(&g, &*host).unwrap() < WRONG_BEYOND / 10.0);
        // A part off by a tenth of the largest output is found.
        let largest = match model().execute(&[&probe_inputs(&g)[0]]).unwrap().remove(0) {
            TensorData::F32(v) => v.iter().fold(0f32, |m, x| m.max(x.abs())),
            _ => panic!("an F32 output"),
        };
        let wrong = OnePartWrong { right: model(), n, offset: 0.1 * largest };
        let gap = max_gap(&g, &wrong).unwrap();
        assert!(gap > WRONG_BEYOND && (gap - 0.1).abs() < 1e-3, "{gap}");
    }

    #[test]
    fn int8_graphs_are_not_checked_and_probes_cover_the_grid() {
        let w: Vec<f32> = (0..64 * 32).map(|i| (i % 7) as f32 * 0.01).collect();
        let src = Arc::new(InMemoryWeight { name: "w".into(), w: Arc::new(w), n: 64, k: 32 });
        let lin = ShadowLinear::new("l", src, None, WeightQuant::PerChannel, DecodeWeights::Q8_0).unwrap();
        let mut g = Graph::new("int8");
        let x = g.input("x", &[4, 32], DType::U16, Some(Quant::u16_range(-2.0, 2.0)));
        let y = lin.add_to_graph(&mut g, "", x).unwrap();
        g.mark_output(y);
        assert!(!needs_check(&g));
        let TensorData::U16(p) = &probe_inputs(&g)[0] else { panic!("a U16 probe") };
        let (lo, hi) = (p.iter().min().unwrap(), p.iter().max().unwrap());
        assert!(*lo < 2000 && *hi > 63000, "[{lo}, {hi}]");
        assert_eq!(probe_inputs(&g), probe_inputs(&g), "the same probe every call");
    }
}
