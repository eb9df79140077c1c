//! Event-driven simulation of a policy on the two processors, and the exact optimum to judge it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::cost::CostModel;
use super::dag::{Node, NodeId, Processor, SubgraphDag};
use super::policy::{PickContext, Policy};
use crate::error::{Error, Result};

/// One node's run on its processor, in seconds from the start of the prefill.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slice {
    /// The node that ran.
    pub node: NodeId,
    /// Where it ran (its node's processor in a valid schedule).
    pub processor: Processor,
    /// When it started, in seconds.
    pub start: f64,
    /// When it ended, in seconds: `end - start` is its duration.
    pub end: f64,
}

/// What ran where and when, simulated ([`simulate`], [`optimal`]) or recorded by a
/// [`super::Runner`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Schedule {
    /// Sorted by start time, then processor.
    pub slices: Vec<Slice>,
    /// The last end, in seconds from 0 (an empty schedule's is 0).
    pub makespan: f64,
    /// Seconds each processor runs a node, indexed by [`Processor::index`].
    pub busy: [f64; 2],
}

impl Schedule {
    /// Sorts `slices` (start, then processor) and sums the makespan and each processor's busy time.
    pub fn from_slices(mut slices: Vec<Slice>) -> Self {
        slices.sort_by(|a, b| a.start.total_cmp(&b.start).then(a.processor.cmp(&b.processor)));
        let mut busy = [0.0; 2];
        for s in &slices {
            busy[s.processor.index()] += s.end - s.start;
        }
        let makespan = slices.iter().map(|s| s.end).fold(0.0, f64::max);
        Self { slices, makespan, busy }
    }

    /// Busy share of the makespan (0 for an empty makespan).
    pub fn utilization(&self, p: Processor) -> f64 {
        if self.makespan > 0.0 {
            self.busy[p.index()] / self.makespan
        } else {
            0.0
        }
    }

    /// Idle share of the makespan: `1 - utilization`.
    pub fn bubble_rate(&self, p: Processor) -> f64 {
        1.0 - self.utilization(p)
    }

    /// The nodes by start time: replayed as [`Policy::Planned`], it reproduces this schedule.
    pub fn order(&self) -> Vec<NodeId> {
        self.slices.iter().map(|s| s.node).collect()
    }

    /// Checks every node runs once, on its processor, after all its inputs, one at a time per
    /// processor; the error names the first violation.
    pub fn validate(&self, dag: &SubgraphDag) -> Result<()> {
        let bad = |why: String| Err(Error::Input(format!("invalid schedule: {why}")));
        let tol = 1e-12 + 1e-9 * self.makespan.abs();
        let mut at = vec![None; dag.len()];
        for s in &self.slices {
            let Some(n) = dag.nodes().get(s.node.0) else { return bad(format!("unknown node id {}", s.node.0)) };
            if at[s.node.0].replace(s).is_some() {
                return bad(format!("{} runs twice", n.name));
            }
            if s.processor != n.processor {
                return bad(format!("{} runs on {} instead of {}", n.name, s.processor.name(), n.processor.name()));
            }
            if !(s.start >= 0.0 && s.end >= s.start) {
                return bad(format!("{} has start {} and end {}", n.name, s.start, s.end));
            }
        }
        for n in dag.nodes() {
            let Some(s) = at[n.id.0] else { return bad(format!("{} never runs", n.name)) };
            for p in dag.preds(n.id) {
                let Some(ps) = at[p.0] else { continue };
                if s.start < ps.end - tol {
                    return bad(format!("{} starts at {} before its input {} ends at {}", n.name, s.start, dag.node(*p).name, ps.end));
                }
            }
        }
        for p in Processor::ALL {
            let on: Vec<&Slice> = self.slices.iter().filter(|s| s.processor == p).collect();
            for w in on.windows(2) {
                if w[1].start < w[0].end - tol {
                    let (a, b) = (&dag.node(w[0].node).name, &dag.node(w[1].node).name);
                    return bad(format!("{a} and {b} overlap on the {}", p.name()));
                }
            }
        }
        Ok(())
    }
}

/// List scheduling: whenever a processor is free it asks `policy` for one of its ready nodes;
/// time then advances to the next completion. Errors on bad costs or a policy that stalls (a
/// [`Policy::Planned`] order that misses a node).
pub fn simulate(dag: &SubgraphDag, costs: &dyn CostModel, policy: &Policy) -> Result<Schedule> {
    let mut ctx = PickContext::new(dag, costs)?;
    let mut waiting: Vec<usize> = (0..dag.len()).map(|i| dag.preds(NodeId(i)).len()).collect();
    let mut ready: [Vec<NodeId>; 2] = [Vec::new(), Vec::new()];
    for n in dag.nodes().iter().filter(|n| waiting[n.id.0] == 0) {
        ctx.mark_ready(n.id, 0.0);
        ready[n.processor.index()].push(n.id);
    }
    let mut running: [Option<Slice>; 2] = [None, None];
    let (mut now, mut slices) = (0.0, Vec::with_capacity(dag.len()));
    while slices.len() < dag.len() {
        for p in Processor::ALL {
            let q = &mut ready[p.index()];
            if running[p.index()].is_some() {
                continue;
            }
            if let Some(id) = policy.pick(&ctx, p, q) {
                let Some(at) = q.iter().position(|&r| r == id) else {
                    return Err(Error::Input(format!("policy {} picked {} which is not ready", policy.name(), id.0)));
                };
                q.remove(at);
                running[p.index()] = Some(Slice { node: id, processor: p, start: now, end: now + ctx.cost(id) });
            }
        }
        let next = running.iter().flatten().map(|s| s.end).fold(f64::INFINITY, f64::min);
        if !next.is_finite() {
            let stuck = dag.nodes().iter().find(|n| !ctx.is_done(n.id)).map_or("?", |n| n.name.as_str());
            return Err(Error::Input(format!(
                "policy {} stalled at {now} s with {} of {} nodes done (first unfinished: {stuck}); \
                 a planned order must list every node",
                policy.name(),
                slices.len(),
                dag.len()
            )));
        }
        now = next;
        for slot in running.iter_mut() {
            let Some(s) = slot.take_if(|s| s.end <= now) else { continue };
            slices.push(s);
            ctx.mark_done(s.node);
            for &succ in dag.succs(s.node) {
                waiting[succ.0] -= 1;
                if waiting[succ.0] == 0 {
                    ctx.mark_ready(succ, now);
                    ready[dag.node(succ).processor.index()].push(succ);
                }
            }
        }
    }
    Ok(Schedule::from_slices(slices))
}

/// A lower bound on the makespan of any schedule: the larger of each processor's total work
/// and the longest path through the DAG. For DAGs too large for [`optimal`], a policy's distance
/// from it bounds its distance from the optimum.
pub fn lower_bound(dag: &SubgraphDag, costs: &dyn CostModel) -> Result<f64> {
    let ctx = PickContext::new(dag, costs)?;
    let mut work = [0.0; 2];
    for n in dag.nodes() {
        work[n.processor.index()] += ctx.cost(n.id);
    }
    let path = (0..dag.len()).map(|i| ctx.rank(NodeId(i))).fold(0.0, f64::max);
    Ok(work[0].max(work[1]).max(path))
}

/// The minimum-makespan schedule, or `None` when the search hits `node_limit` search nodes or
/// `time_limit` (or the costs are invalid: [`simulate`] says why).
///
/// Branch and bound over active schedules (Giffler–Thompson): at each step take the unscheduled
/// input-ready node with the earliest possible completion `c*`, on processor `m`; branch over
/// every ready node of `m` that could start before `c*` (so `m` may wait for a node that becomes
/// ready before it could finish another). Non-delay list schedules, which every online policy
/// produces, can miss the optimum; active ones cannot. Lower bound: the larger of, for every
/// unscheduled node, its earliest start plus its upward rank, and, per processor, the earliest
/// start of its remaining nodes plus their total work plus the shortest path after them. A state
/// is also cut when one with the same scheduled nodes and no later processor-free or input-ready
/// times was searched before. The best of [`Policy::heuristics`] is the first incumbent.
///
/// Measured (release, one core, 20 seeds of random costs 0.1..1 s per node, the 8-stage layer
/// plus tail; `optimal_limits` in the tests): up to 4 chunks x 2 layers (68 nodes) and 3 x 3 (75)
/// every case finishes, in at most 0.4 s (3 x 2, 51 nodes: 12 ms); with a 10 s limit 5-6 chunks x
/// 2 layers finish 18/20, 4 x 4 (132 nodes) 14/20, 8 x 4 (264 nodes) 17/20. Some larger DAGs
/// finish fast when the critical-path bound meets the best heuristic.
pub fn optimal(dag: &SubgraphDag, costs: &dyn CostModel, node_limit: usize, time_limit: Duration) -> Option<Schedule> {
    let ctx = PickContext::new(dag, costs).ok()?;
    let incumbent =
        Policy::heuristics().iter().filter_map(|p| simulate(dag, &|n: &Node| ctx.cost(n.id), p).ok()).min_by(|a, b| a.makespan.total_cmp(&b.makespan))?;
    let n = dag.len();
    let mut remaining = [0.0; 2];
    for node in dag.nodes() {
        remaining[node.processor.index()] += ctx.cost(node.id);
    }
    let mut b = Bnb {
        dag,
        ctx: &ctx,
        proc: dag.nodes().iter().map(|n| n.processor.index()).collect(),
        end: vec![f64::NAN; n],
        waiting: (0..n).map(|i| dag.preds(NodeId(i)).len()).collect(),
        scheduled: 0,
        free: [0.0; 2],
        remaining,
        head: vec![0.0; n],
        best: incumbent.makespan,
        best_end: None,
        expanded: 0,
        node_limit,
        deadline: Instant::now() + time_limit,
        gave_up: false,
        seen: HashMap::new(),
        seen_states: 0,
    };
    b.search();
    if b.gave_up {
        return None;
    }
    let Some(end) = b.best_end else { return Some(incumbent) };
    let slices = dag.nodes().iter().map(|nd| {
        let e = end[nd.id.0];
        Slice { node: nd.id, processor: nd.processor, start: e - ctx.cost(nd.id), end: e }
    });
    Some(Schedule::from_slices(slices.collect()))
}

struct Bnb<'a> {
    dag: &'a SubgraphDag,
    ctx: &'a PickContext<'a>,
    proc: Vec<usize>,
    /// End time of each scheduled node, NaN if unscheduled.
    end: Vec<f64>,
    /// Unscheduled inputs per node.
    waiting: Vec<usize>,
    scheduled: usize,
    /// When each processor is next free (the end of its last scheduled node).
    free: [f64; 2],
    /// Unscheduled work per processor.
    remaining: [f64; 2],
    /// Scratch: earliest start of each unscheduled node.
    head: Vec<f64>,
    best: f64,
    best_end: Option<Vec<f64>>,
    expanded: usize,
    node_limit: usize,
    deadline: Instant,
    gave_up: bool,
    /// Searched states by scheduled set (see `dominated`), at most `SEEN_CAP` in all.
    seen: HashMap<Vec<u64>, Vec<Vec<f64>>>,
    seen_states: usize,
}

const SEEN_CAP: usize = 1 << 18;

impl Bnb<'_> {
    fn est(&self, i: usize) -> f64 {
        self.dag.preds(NodeId(i)).iter().map(|p| self.end[p.0]).fold(self.free[self.proc[i]], f64::max)
    }

    fn lower_bound(&mut self) -> f64 {
        let mut lb = self.free[0].max(self.free[1]);
        let (mut head_min, mut tail_min) = ([f64::INFINITY; 2], [f64::INFINITY; 2]);
        for i in 0..self.dag.len() {
            if !self.end[i].is_nan() {
                continue;
            }
            let h = self
                .dag
                .preds(NodeId(i))
                .iter()
                .fold(self.free[self.proc[i]], |h, p| h.max(if self.end[p.0].is_nan() { self.head[p.0] + self.ctx.cost(*p) } else { self.end[p.0] }));
            self.head[i] = h;
            let (rank, p) = (self.ctx.rank(NodeId(i)), self.proc[i]);
            lb = lb.max(h + rank);
            head_min[p] = head_min[p].min(h);
            tail_min[p] = tail_min[p].min(rank - self.ctx.cost(NodeId(i)));
        }
        for p in 0..2 {
            if head_min[p].is_finite() {
                lb = lb.max(head_min[p] + self.remaining[p] + tail_min[p]);
            }
        }
        lb
    }

    /// Whether a state with the same scheduled nodes and no later processor or input times was
    /// already searched: this one's completions cannot beat that one's. Records the state.
    fn dominated(&mut self) -> bool {
        let n = self.dag.len();
        let mut key = vec![0u64; n.div_ceil(64)];
        let mut times = vec![self.free[0], self.free[1]];
        for i in 0..n {
            if !self.end[i].is_nan() {
                key[i / 64] |= 1 << (i % 64);
            } else if self.dag.preds(NodeId(i)).iter().any(|p| !self.end[p.0].is_nan()) {
                // Its earliest start given what is scheduled (`f64::max` skips unscheduled NaNs).
                times.push(self.est(i));
            }
        }
        let seen = self.seen.entry(key).or_default();
        if seen.iter().any(|t| t.iter().zip(&times).all(|(a, b)| a <= b)) {
            return true;
        }
        let before = seen.len();
        seen.retain(|t| !t.iter().zip(&times).all(|(a, b)| b <= a));
        self.seen_states -= before - seen.len();
        if seen.len() < 64 && self.seen_states < SEEN_CAP {
            seen.push(times);
            self.seen_states += 1;
        }
        false
    }

    fn search(&mut self) {
        self.expanded += 1;
        if self.expanded > self.node_limit || (self.expanded.is_multiple_of(1024) && Instant::now() > self.deadline) {
            self.gave_up = true;
        }
        if self.gave_up {
            return;
        }
        if self.scheduled == self.dag.len() {
            let makespan = self.free[0].max(self.free[1]);
            if makespan < self.best {
                self.best = makespan;
                self.best_end = Some(self.end.clone());
            }
            return;
        }
        if self.lower_bound() >= self.best * (1.0 - 1e-9) || self.dominated() {
            return;
        }
        // (est, completion, node) of every input-ready unscheduled node.
        let ready: Vec<(f64, f64, usize)> = (0..self.dag.len())
            .filter(|&i| self.end[i].is_nan() && self.waiting[i] == 0)
            .map(|i| {
                let est = self.est(i);
                (est, est + self.ctx.cost(NodeId(i)), i)
            })
            .collect();
        let Some(&(_, c_star, first)) = ready.iter().min_by(|a, b| a.1.total_cmp(&b.1).then(a.2.cmp(&b.2))) else {
            return;
        };
        let m = self.proc[first];
        let mut branch: Vec<(f64, usize)> = ready.iter().filter(|r| self.proc[r.2] == m && (r.0 < c_star || r.2 == first)).map(|r| (r.0, r.2)).collect();
        // Earliest start first, then the longest path: good schedules early tighten the bound.
        branch.sort_by(|a, b| a.0.total_cmp(&b.0).then(self.ctx.rank(NodeId(b.1)).total_cmp(&self.ctx.rank(NodeId(a.1)))));
        for (est, i) in branch {
            let cost = self.ctx.cost(NodeId(i));
            let saved = (self.free[m], self.remaining[m]);
            self.end[i] = est + cost;
            self.free[m] = est + cost;
            self.remaining[m] -= cost;
            self.scheduled += 1;
            for s in self.dag.succs(NodeId(i)) {
                self.waiting[s.0] -= 1;
            }
            self.search();
            for s in self.dag.succs(NodeId(i)) {
                self.waiting[s.0] += 1;
            }
            self.scheduled -= 1;
            (self.free[m], self.remaining[m]) = saved;
            self.end[i] = f64::NAN;
            if self.gave_up {
                return;
            }
        }
    }
}
