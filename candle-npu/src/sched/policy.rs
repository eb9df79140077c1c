//! Which ready node a free processor runs next. One `pick` serves the simulator and the runtime.

use serde::Serialize;

use super::cost::CostModel;
use super::dag::{NodeId, Processor, SubgraphDag};
use crate::error::{Error, Result};

/// The terms of the llm.npu contribution heuristic (§3.4, "Out-of-order subgraph execution",
/// eq. 6) as weights, so its sensitivity can be measured. For a candidate `g`, let `S` be the
/// nodes that become input-ready when `g` completes (`g` is their last unfinished input). Then
///
/// `C(g) = own_cost * T(g) + Σ_{s ∈ S} w(proc(g), proc(s)) * T(s)`
///
/// and the processor runs the candidate of largest `C` (ties: lowest id). The paper's `C` is
/// `+T(S)` for a CPU `g` (it feeds the NPU, which is the critical path: the more NPU work it
/// unlocks, the fewer NPU stalls) and `-T(S)` for an NPU `g` (the less CPU work it hands back,
/// the sooner the NPU's next input is ready), whatever processor `S` runs on, and ignores
/// `T(g)` itself: that is [`Default`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ContributionWeights {
    /// `w(CPU, NPU)`: paper `+1`.
    pub cpu_unlocks_npu: f64,
    /// `w(CPU, CPU)` (e.g. attention unlocks the next chunk's attention): paper `+1`.
    pub cpu_unlocks_cpu: f64,
    /// `w(NPU, NPU)`: paper `-1`.
    pub npu_unlocks_npu: f64,
    /// `w(NPU, CPU)`: paper `-1`.
    pub npu_unlocks_cpu: f64,
    /// Weight of the candidate's own time: paper `0` ("not the execution time of g").
    pub own_cost: f64,
}

impl Default for ContributionWeights {
    fn default() -> Self {
        Self { cpu_unlocks_npu: 1.0, cpu_unlocks_cpu: 1.0, npu_unlocks_npu: -1.0, npu_unlocks_cpu: -1.0, own_cost: 0.0 }
    }
}

impl ContributionWeights {
    fn weight(&self, from: Processor, to: Processor) -> f64 {
        match (from, to) {
            (Processor::Cpu, Processor::Npu) => self.cpu_unlocks_npu,
            (Processor::Cpu, Processor::Cpu) => self.cpu_unlocks_cpu,
            (Processor::Npu, Processor::Npu) => self.npu_unlocks_npu,
            (Processor::Npu, Processor::Cpu) => self.npu_unlocks_cpu,
        }
    }
}

/// How a free processor chooses among its ready nodes ([`Policy::pick`]): the same choice in the
/// simulator and at run time.
#[derive(Debug, Clone, PartialEq)]
pub enum Policy {
    /// Only the lowest-id unfinished node may run, anywhere: the sequential engine.
    InOrder,
    /// Ready nodes in the order they became ready (ties: lowest id): the review's baseline.
    Fifo,
    /// The llm.npu heuristic, see [`ContributionWeights`].
    Contribution(ContributionWeights),
    /// Largest upward rank (the node's cost plus the longest path after it; ties: lowest id).
    CriticalPath,
    /// A fixed order (e.g. [`super::Schedule::order`] of the optimum): each processor runs its
    /// nodes strictly in this order, waiting for the next one to be ready. Replaying a schedule
    /// with the costs it was made from reproduces it.
    Planned(Vec<NodeId>),
}

impl Policy {
    /// The online policies, for comparisons.
    pub fn heuristics() -> Vec<Policy> {
        vec![Policy::InOrder, Policy::Fifo, Policy::Contribution(Default::default()), Policy::CriticalPath]
    }

    /// Short name for reports and errors ("in-order", "fifo", "contribution", "critical-path",
    /// "planned").
    pub fn name(&self) -> &'static str {
        match self {
            Policy::InOrder => "in-order",
            Policy::Fifo => "fifo",
            Policy::Contribution(_) => "contribution",
            Policy::CriticalPath => "critical-path",
            Policy::Planned(_) => "planned",
        }
    }

    /// The node `processor` (free) starts next among its `ready` nodes, or `None` to wait.
    pub fn pick(&self, ctx: &PickContext, processor: Processor, ready: &[NodeId]) -> Option<NodeId> {
        let dag = ctx.dag;
        let mut cands = ready.iter().copied().filter(|&id| dag.node(id).processor == processor);
        // Largest key, ties to the lowest id.
        let best_by = |cands: &mut dyn Iterator<Item = NodeId>, key: &dyn Fn(NodeId) -> f64| {
            cands.map(|id| (key(id), id)).reduce(|b, c| if c.0 > b.0 || (c.0 == b.0 && c.1 < b.1) { c } else { b })
        };
        match self {
            Policy::InOrder => {
                let next = NodeId(ctx.first_undone);
                cands.find(|&id| id == next)
            }
            Policy::Fifo => best_by(&mut cands, &|id| -ctx.ready_at[id.0]).map(|b| b.1),
            Policy::CriticalPath => best_by(&mut cands, &|id| ctx.rank[id.0]).map(|b| b.1),
            Policy::Contribution(w) => best_by(&mut cands, &|g| ctx.contribution(w, g)).map(|b| b.1),
            Policy::Planned(order) => {
                let next = order.iter().copied().find(|&id| id.0 < dag.len() && dag.node(id).processor == processor && !ctx.done[id.0])?;
                cands.find(|&id| id == next)
            }
        }
    }
}

/// What a policy sees: the DAG, cost estimates, upward ranks, and the run's progress, which the
/// simulator or the runtime reports through [`Self::mark_ready`] and [`Self::mark_done`].
#[derive(Debug, Clone)]
pub struct PickContext<'a> {
    dag: &'a SubgraphDag,
    cost: Vec<f64>,
    rank: Vec<f64>,
    done: Vec<bool>,
    ready_at: Vec<f64>,
    first_undone: usize,
}

impl<'a> PickContext<'a> {
    /// Estimates every node's cost; an estimate that is not a finite number >= 0 is an error.
    pub fn new(dag: &'a SubgraphDag, costs: &dyn CostModel) -> Result<Self> {
        let mut cost = Vec::with_capacity(dag.len());
        for n in dag.nodes() {
            let c = costs.cost(n);
            if !(c.is_finite() && c >= 0.0) {
                return Err(Error::Input(format!(
                    "sched: cost of node {} (stage '{}' on {}, {} rows) is {c}: measure it or add it to the cost table",
                    n.name,
                    n.stage_name,
                    n.processor.name(),
                    n.rows
                )));
            }
            cost.push(c);
        }
        // Ids are a topological order, so one backward pass computes the upward ranks.
        let mut rank = vec![0.0; dag.len()];
        for i in (0..dag.len()).rev() {
            let after = dag.succs(NodeId(i)).iter().map(|s| rank[s.0]).fold(0.0, f64::max);
            rank[i] = cost[i] + after;
        }
        let n = dag.len();
        Ok(Self { dag, cost, rank, done: vec![false; n], ready_at: vec![f64::INFINITY; n], first_undone: 0 })
    }

    /// The DAG this context describes.
    pub fn dag(&self) -> &'a SubgraphDag {
        self.dag
    }

    /// The estimated seconds of node `id` (finite and >= 0: checked at construction).
    pub fn cost(&self, id: NodeId) -> f64 {
        self.cost[id.0]
    }

    /// Every node's estimated seconds, indexed by [`NodeId`].
    pub fn costs(&self) -> &[f64] {
        &self.cost
    }

    /// The node's cost plus the longest cost path after it.
    pub fn rank(&self, id: NodeId) -> f64 {
        self.rank[id.0]
    }

    /// Whether node `id` has finished ([`Self::mark_done`]).
    pub fn is_done(&self, id: NodeId) -> bool {
        self.done[id.0]
    }

    /// Records that node `id` finished; [`Policy::InOrder`] then moves on to the lowest unfinished
    /// id.
    pub fn mark_done(&mut self, id: NodeId) {
        self.done[id.0] = true;
        while self.first_undone < self.done.len() && self.done[self.first_undone] {
            self.first_undone += 1;
        }
    }

    /// Records that `id`'s inputs are all available since `time` (seconds, any fixed origin).
    pub fn mark_ready(&mut self, id: NodeId, time: f64) {
        self.ready_at[id.0] = time;
    }

    /// `C(g)` of [`ContributionWeights`].
    pub fn contribution(&self, w: &ContributionWeights, g: NodeId) -> f64 {
        let from = self.dag.node(g).processor;
        let unlocked = self.dag.succs(g).iter().filter(|s| self.dag.preds(**s).iter().all(|&p| p == g || self.done[p.0]));
        w.own_cost * self.cost[g.0] + unlocked.map(|s| w.weight(from, self.dag.node(*s).processor) * self.cost[s.0]).sum::<f64>()
    }
}
