//! Out-of-order scheduling of prefill subgraphs between the NPU and the CPU.
//!
//! Owns the [`SubgraphDag`] of (chunk, layer, stage) nodes, the node [`CostModel`]s, the
//! [`Policy`] a free processor uses to pick its next ready node, an event-driven [`simulate`]
//! of a policy, the exact [`optimal`] schedule for small DAGs, and [`Trace`] (Chrome/Perfetto
//! JSON). Pure and deterministic: no threads, no model knowledge; the runtime drives the same
//! [`Policy::pick`] through a [`PickContext`].
//!
//! Why: llm.npu (§3.4, "Out-of-order subgraph execution") lets any input-ready subgraph run,
//! one per processor at a time, and picks among them with a "contribution to NPU stalls"
//! heuristic ([`ContributionWeights`]). Its critical review asks how that heuristic compares to
//! simpler schedules (FIFO) and to the optimum; this module answers it with the same DAG and
//! costs for every policy, the optimum and the in-order baseline.
//!
//! Definitions, for a schedule of all nodes:
//! - makespan: the time from the first start (0) to the last end;
//! - utilization of a processor: the seconds it runs nodes divided by the makespan;
//! - bubble rate of a processor: `1 - utilization`, the idle share of the makespan.

mod cost;
mod dag;
mod phone;
mod policy;
mod runtime;
mod sim;
mod trace;

pub use cost::{AnalyticCosts, CostModel, LayerShape, LinearCost, Rates, TableCosts};
pub use dag::{DagChunk, Node, NodeId, Processor, StageDesc, SubgraphDag};
pub use phone::{predict_whole, Activations, GraphCall, HtpRates, HtpStageCosts, ModelShape, Prediction, WholePlan};
pub use policy::{ContributionWeights, PickContext, Policy};
pub use runtime::{Grant, Runner};
pub use sim::{lower_bound, optimal, simulate, Schedule, Slice};
pub use trace::Trace;

#[cfg(test)]
pub(crate) mod tests {
    use std::time::{Duration, Instant};

    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    pub(crate) fn chunks(rows: &[usize]) -> Vec<DagChunk> {
        rows.iter().map(|&rows| DagChunk { rows, margin: false }).collect()
    }

    /// The model's layer: attn_in, qkv, attn, o, ffn_in, gate_up, act, down, plus a CPU tail.
    pub(crate) fn llm_dag(chunks: &[DagChunk], n_layer: usize) -> SubgraphDag {
        use Processor::{Cpu, Npu};
        let stages: Vec<StageDesc> =
            [("attn_in", Cpu), ("qkv", Npu), ("attn", Cpu), ("o", Npu), ("ffn_in", Cpu), ("gate_up", Npu), ("act", Cpu), ("down", Npu)]
                .into_iter()
                .map(|(n, p)| StageDesc::new(n, p, n == "attn"))
                .collect();
        SubgraphDag::new(&stages, n_layer, Some(StageDesc::new("tail", Cpu, false)), chunks).unwrap()
    }

    fn random_costs(dag: &SubgraphDag, seed: u64) -> Vec<f64> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..dag.len()).map(|_| rng.random_range(0.1..1.0)).collect()
    }

    fn table(costs: &[f64]) -> impl Fn(&Node) -> f64 + '_ {
        move |n: &Node| costs[n.id.0]
    }

    /// Minimum makespan over the semi-active schedules of all topological orders (which include
    /// an optimal one): independent of the branch and bound, for tiny DAGs.
    fn brute_force(dag: &SubgraphDag, cost: &[f64]) -> f64 {
        fn go(dag: &SubgraphDag, cost: &[f64], end: &mut Vec<f64>, free: [f64; 2], left: usize, best: &mut f64) {
            if left == 0 {
                *best = best.min(free[0].max(free[1]));
                return;
            }
            for i in 0..dag.len() {
                if !end[i].is_nan() || dag.preds(NodeId(i)).iter().any(|p| end[p.0].is_nan()) {
                    continue;
                }
                let p = dag.node(NodeId(i)).processor.index();
                let start = dag.preds(NodeId(i)).iter().map(|q| end[q.0]).fold(free[p], f64::max);
                end[i] = start + cost[i];
                let mut f = free;
                f[p] = end[i];
                go(dag, cost, end, f, left - 1, best);
                end[i] = f64::NAN;
            }
        }
        let mut best = f64::INFINITY;
        go(dag, cost, &mut vec![f64::NAN; dag.len()], [0.0; 2], dag.len(), &mut best);
        best
    }

    #[test]
    fn every_policy_validates_on_random_costs() {
        for seed in 0..20 {
            let dag = llm_dag(&[DagChunk { rows: 8, margin: false }, DagChunk { rows: 8, margin: false }, DagChunk { rows: 3, margin: true }], 2);
            let c = random_costs(&dag, seed);
            let mut policies = Policy::heuristics();
            policies.push(Policy::Contribution(ContributionWeights { own_cost: 0.5, npu_unlocks_cpu: 2.0, ..Default::default() }));
            policies.push(Policy::Planned(simulate(&dag, &table(&c), &Policy::CriticalPath).unwrap().order()));
            for p in &policies {
                let s = simulate(&dag, &table(&c), p).unwrap();
                s.validate(&dag).unwrap_or_else(|e| panic!("{}: {e}", p.name()));
                let total: f64 = c.iter().sum();
                assert!((s.busy[0] + s.busy[1] - total).abs() < 1e-9);
                assert!(s.bubble_rate(Processor::Npu) >= 0.0 && s.utilization(Processor::Cpu) <= 1.0 + 1e-12);
            }
        }
    }

    #[test]
    fn in_order_makespan_is_sum_of_costs() {
        let dag = llm_dag(&chunks(&[4, 4, 4]), 2);
        let c = random_costs(&dag, 7);
        let s = simulate(&dag, &table(&c), &Policy::InOrder).unwrap();
        assert!((s.makespan - c.iter().sum::<f64>()).abs() < 1e-9);
        assert_eq!(s.order(), dag.nodes().iter().map(|n| n.id).collect::<Vec<_>>());
    }

    #[test]
    fn out_of_order_beats_in_order_by_hand() {
        // Per chunk: CPU "a" then NPU "b", 1 s each, no KV edge. In order: 4 s. Out of order,
        // chunk 1's "a" runs on the CPU while chunk 0's "b" runs on the NPU: 3 s, the optimum.
        let stages = [StageDesc::new("a", Processor::Cpu, false), StageDesc::new("b", Processor::Npu, false)];
        let dag = SubgraphDag::new(&stages, 1, None, &chunks(&[1, 1])).unwrap();
        let one = |_: &Node| 1.0;
        assert_eq!(simulate(&dag, &one, &Policy::InOrder).unwrap().makespan, 4.0);
        for p in [Policy::Fifo, Policy::Contribution(Default::default()), Policy::CriticalPath] {
            let s = simulate(&dag, &one, &p).unwrap();
            assert_eq!(s.makespan, 3.0, "{}", p.name());
            assert!((s.bubble_rate(Processor::Npu) - 1.0 / 3.0).abs() < 1e-12);
        }
        assert_eq!(optimal(&dag, &one, 1000, Duration::from_secs(1)).unwrap().makespan, 3.0);
    }

    #[test]
    fn contribution_picks_largest_unlocked_npu_work() {
        let stages = [StageDesc::new("a", Processor::Cpu, false), StageDesc::new("b", Processor::Npu, false)];
        let dag = SubgraphDag::new(&stages, 1, None, &chunks(&[1, 1])).unwrap();
        // c0.b = 1 s, c1.b = 9 s: starting c1.a first unlocks more NPU work.
        let cost = |n: &Node| {
            if n.stage == 1 {
                1.0 + 8.0 * n.chunk as f64
            } else {
                1.0
            }
        };
        let ctx = PickContext::new(&dag, &cost).unwrap();
        let ready = [NodeId(0), NodeId(2)];
        let paper = Policy::Contribution(Default::default());
        assert_eq!(paper.pick(&ctx, Processor::Cpu, &ready), Some(NodeId(2)));
        assert_eq!(paper.pick(&ctx, Processor::Npu, &ready), None);
        assert_eq!(Policy::Fifo.pick(&ctx, Processor::Cpu, &ready), Some(NodeId(0)));
        assert_eq!(Policy::InOrder.pick(&ctx, Processor::Cpu, &[NodeId(2)]), None);
        let flipped = Policy::Contribution(ContributionWeights { cpu_unlocks_npu: -1.0, ..Default::default() });
        assert_eq!(flipped.pick(&ctx, Processor::Cpu, &ready), Some(NodeId(0)));
    }

    #[test]
    fn optimal_never_worse_than_heuristics_and_planned_replays_it() {
        let mut rng = StdRng::seed_from_u64(42);
        for case in 0..50 {
            let (n_chunk, n_layer) = (rng.random_range(2..=3), rng.random_range(1..=2));
            let dag = llm_dag(&chunks(&vec![4; n_chunk]), n_layer);
            let c = random_costs(&dag, 1000 + case);
            let opt = optimal(&dag, &table(&c), 5_000_000, Duration::from_secs(20))
                .unwrap_or_else(|| panic!("case {case}: {n_chunk} chunks x {n_layer} layers did not finish"));
            opt.validate(&dag).unwrap();
            let lb = lower_bound(&dag, &table(&c)).unwrap();
            assert!(lb <= opt.makespan + 1e-9 && lb > 0.5 * opt.makespan, "case {case}: lower bound {lb} vs optimum {}", opt.makespan);
            for p in Policy::heuristics() {
                let h = simulate(&dag, &table(&c), &p).unwrap().makespan;
                assert!(opt.makespan <= h + 1e-9, "case {case}: optimum {} > {} {h}", opt.makespan, p.name());
            }
            let replay = simulate(&dag, &table(&c), &Policy::Planned(opt.order())).unwrap();
            assert!((replay.makespan - opt.makespan).abs() < 1e-9, "case {case}: replay {} vs {}", replay.makespan, opt.makespan);
        }
    }

    #[test]
    fn optimal_matches_brute_force() {
        let stages = [
            StageDesc::new("a", Processor::Cpu, false),
            StageDesc::new("b", Processor::Npu, false),
            StageDesc::new("k", Processor::Cpu, true),
            StageDesc::new("d", Processor::Npu, false),
        ];
        let mut strict = 0;
        for seed in 0..30 {
            let dag = SubgraphDag::new(&stages, 1, Some(StageDesc::new("t", Processor::Cpu, false)), &chunks(&[2, 2, 2])).unwrap();
            let c = random_costs(&dag, seed);
            let want = brute_force(&dag, &c);
            let got = optimal(&dag, &table(&c), 1_000_000, Duration::from_secs(10)).unwrap();
            got.validate(&dag).unwrap();
            assert!((got.makespan - want).abs() < 1e-9, "seed {seed}: b&b {} vs brute force {want}", got.makespan);
            let best_heuristic = Policy::heuristics().iter().map(|p| simulate(&dag, &table(&c), p).unwrap().makespan).fold(f64::INFINITY, f64::min);
            strict += usize::from(want < best_heuristic - 1e-9);
        }
        // The search must find better schedules than the incumbent, not just return it.
        assert!(strict > 0, "no case where the optimum beats every heuristic");
    }

    #[test]
    fn validate_catches_violations() {
        let dag = llm_dag(&chunks(&[4]), 1);
        let s = simulate(&dag, &|_: &Node| 1.0, &Policy::InOrder).unwrap();
        let mut twice = s.clone();
        twice.slices[1] = twice.slices[0];
        let mut early = s.clone();
        early.slices[1].start = 0.5;
        let mut wrong = s.clone();
        wrong.slices[0].processor = Processor::Npu;
        let mut missing = s.clone();
        missing.slices.pop();
        for (bad, what) in [(twice, "twice"), (early, "before its input"), (wrong, "instead of"), (missing, "never runs")] {
            let e = bad.validate(&dag).unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        }
        let stall = simulate(&dag, &|_: &Node| 1.0, &Policy::Planned(vec![NodeId(0)])).unwrap_err().to_string();
        assert!(stall.contains("stalled"), "{stall}");
        let nan = simulate(&dag, &TableCosts::new(), &Policy::Fifo).unwrap_err().to_string();
        assert!(nan.contains("c0.l0.attn_in"), "{nan}");
    }

    /// Where the branch and bound finishes: `cargo test --release -p candle-npu --lib
    /// optimal_limits -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn optimal_limits() {
        for (n_chunk, n_layer) in [(2, 2), (3, 2), (4, 2), (3, 3), (5, 2), (6, 2), (8, 2), (4, 4), (8, 4)] {
            let dag = llm_dag(&chunks(&vec![4; n_chunk]), n_layer);
            let (mut done, mut worst, mut gain) = (0, Duration::ZERO, 0.0f64);
            for seed in 0..20 {
                let c = random_costs(&dag, seed);
                let t = Instant::now();
                let opt = optimal(&dag, &table(&c), usize::MAX, Duration::from_secs(10));
                worst = worst.max(t.elapsed());
                if let Some(o) = opt {
                    done += 1;
                    let h = simulate(&dag, &table(&c), &Policy::Contribution(Default::default())).unwrap().makespan;
                    gain = gain.max(h / o.makespan - 1.0);
                }
            }
            let n = dag.len();
            println!("{n_chunk} chunks x {n_layer} layers ({n} nodes): {done}/20 finished, slowest {worst:?}");
            println!("  contribution up to {:.1}% over the optimum", 100.0 * gain);
        }
    }
}
