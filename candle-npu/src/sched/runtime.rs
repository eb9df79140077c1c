//! The run-time side of scheduling: many threads (one per chunk) each walk their chunk's nodes
//! in order, and a [`Runner`] hands each processor to one node at a time, the one the
//! [`Policy`] picks among the ready nodes waiting for it. The same `pick` drives the simulator,
//! so a real run and its simulation differ only in where the stage costs come from.
//!
//! Results do not depend on the policy: every node reads only what its predecessors in the
//! [`SubgraphDag`] wrote (the KV cache of a layer is appended in chunk order because each
//! chunk's attention waits for the previous chunk's), so any order the runner allows computes the
//! same values.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

use super::cost::CostModel;
use super::dag::{NodeId, Processor, SubgraphDag};
use super::policy::{PickContext, Policy};
use super::sim::{Schedule, Slice};
use crate::error::{Error, Result};

/// Hands the NPU and the CPU to one node each at a time (see the module docs).
pub struct Runner<'a> {
    dag: &'a SubgraphDag,
    policy: Policy,
    state: Mutex<State<'a>>,
    wake: Condvar,
    t0: Instant,
}

struct State<'a> {
    ctx: PickContext<'a>,
    /// Nodes whose thread waits for their processor.
    waiting: Vec<NodeId>,
    preds_left: Vec<usize>,
    busy: [bool; 2],
    slices: Vec<Slice>,
    aborted: bool,
}

/// A processor held by one node; dropping it marks the node done and frees the processor.
pub struct Grant<'r, 'a> {
    runner: &'r Runner<'a>,
    node: NodeId,
    start: f64,
}

impl<'a> Runner<'a> {
    /// `costs` are the estimates the policy ranks by (the real durations are recorded).
    pub fn new(dag: &'a SubgraphDag, costs: &dyn CostModel, policy: Policy) -> Result<Self> {
        let mut ctx = PickContext::new(dag, costs)?;
        let preds_left: Vec<usize> = dag.nodes().iter().map(|n| dag.preds(n.id).len()).collect();
        for (i, _) in preds_left.iter().enumerate().filter(|(_, &p)| p == 0) {
            ctx.mark_ready(NodeId(i), 0.0);
        }
        let state = State { ctx, waiting: vec![], preds_left, busy: [false; 2], slices: Vec::with_capacity(dag.len()), aborted: false };
        Ok(Runner { dag, policy, state: Mutex::new(state), wake: Condvar::new(), t0: Instant::now() })
    }

    /// The DAG whose nodes this runner schedules.
    pub fn dag(&self) -> &'a SubgraphDag {
        self.dag
    }

    fn lock(&self) -> MutexGuard<'_, State<'a>> {
        // A thread that panicked while holding the lock left the state consistent (every
        // update below is a few field writes), so its poison is ignored.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wait until the policy gives `node` its processor. Err if the run was aborted (another
    /// chunk failed) or the node is not in the DAG.
    pub fn acquire(&self, node: NodeId) -> Result<Grant<'_, 'a>> {
        if node.0 >= self.dag.len() {
            return Err(Error::Internal(format!("sched: node {} is not in the DAG of {} nodes", node.0, self.dag.len())));
        }
        let p = self.dag.node(node).processor;
        let mut s = self.lock();
        s.waiting.push(node);
        // The policy may prefer this node to one whose thread already waits, or the reverse:
        // every waiter looks again.
        self.wake.notify_all();
        loop {
            if s.aborted {
                s.waiting.retain(|&w| w != node);
                return Err(Error::Aborted { stage: self.dag.node(node).name.to_string() });
            }
            if !s.busy[p.index()] && s.preds_left[node.0] == 0 {
                let ready: Vec<NodeId> = s.waiting.iter().copied().filter(|&w| s.preds_left[w.0] == 0 && self.dag.node(w).processor == p).collect();
                if self.policy.pick(&s.ctx, p, &ready) == Some(node) {
                    s.busy[p.index()] = true;
                    s.waiting.retain(|&w| w != node);
                    return Ok(Grant { runner: self, node, start: self.t0.elapsed().as_secs_f64() });
                }
            }
            s = self.wake.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Wake every waiting thread with an error (call when a chunk fails, so none waits forever).
    pub fn abort(&self) {
        self.lock().aborted = true;
        self.wake.notify_all();
    }

    /// What ran where and when (seconds from the runner's creation).
    pub fn schedule(&self) -> Schedule {
        Schedule::from_slices(self.lock().slices.clone())
    }

    fn complete(&self, node: NodeId, start: f64) {
        let end = self.t0.elapsed().as_secs_f64();
        let processor: Processor = self.dag.node(node).processor;
        let mut s = self.lock();
        s.busy[processor.index()] = false;
        s.ctx.mark_done(node);
        for &next in self.dag.succs(node) {
            s.preds_left[next.0] -= 1;
            if s.preds_left[next.0] == 0 {
                s.ctx.mark_ready(next, end);
            }
        }
        s.slices.push(Slice { node, processor, start, end });
        drop(s);
        self.wake.notify_all();
    }
}

impl Grant<'_, '_> {
    /// The node that holds the processor.
    pub fn node(&self) -> NodeId {
        self.node
    }
}

impl Drop for Grant<'_, '_> {
    fn drop(&mut self) {
        self.runner.complete(self.node, self.start);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::sched::tests::{chunks, llm_dag};

    /// Every chunk's thread walks its nodes; each records the order nodes started in and checks
    /// that at most one node per processor runs at a time and every predecessor ended first.
    fn run(dag: &SubgraphDag, policy: Policy) -> Vec<NodeId> {
        let runner = Runner::new(dag, &|n: &crate::sched::Node| (n.stage + 1) as f64, policy).unwrap();
        let running = [AtomicUsize::new(0), AtomicUsize::new(0)];
        let order = Mutex::new(vec![]);
        std::thread::scope(|s| {
            for c in 0..dag.n_chunk() {
                let (runner, running, order) = (&runner, &running, &order);
                s.spawn(move || {
                    for n in dag.nodes().iter().filter(|n| n.chunk == c) {
                        let g = runner.acquire(n.id).unwrap();
                        assert_eq!(running[n.processor.index()].fetch_add(1, Ordering::SeqCst), 0, "{} overlaps", n.name);
                        order.lock().unwrap().push(n.id);
                        std::thread::sleep(std::time::Duration::from_micros(50));
                        running[n.processor.index()].fetch_sub(1, Ordering::SeqCst);
                        drop(g);
                    }
                });
            }
        });
        runner.schedule().validate(dag).unwrap();
        order.into_inner().unwrap()
    }

    #[test]
    fn every_policy_runs_every_node_once_respecting_the_dag() {
        let dag = llm_dag(&chunks(&[4, 4, 3]), 2);
        for policy in Policy::heuristics() {
            let order = run(&dag, policy.clone());
            let mut sorted = order.clone();
            sorted.sort();
            assert_eq!(sorted, (0..dag.len()).map(NodeId).collect::<Vec<_>>(), "{}", policy.name());
            if policy == Policy::InOrder {
                assert_eq!(order, sorted, "in-order runs nodes in id order");
            }
        }
    }

    #[test]
    fn abort_wakes_waiters_with_an_error() {
        let dag = llm_dag(&chunks(&[4, 4]), 1);
        let runner = Runner::new(&dag, &|_: &crate::sched::Node| 1.0, Policy::InOrder).unwrap();
        std::thread::scope(|s| {
            // Chunk 1's first node can never run before chunk 0's nodes under in-order.
            let waiter = s.spawn(|| runner.acquire(dag.node_at(1, 0, 0).unwrap()).map(|_| ()));
            std::thread::sleep(std::time::Duration::from_millis(20));
            runner.abort();
            let e = waiter.join().unwrap().unwrap_err();
            assert!(matches!(&e, Error::Aborted { .. }), "{e}");
            assert!(e.to_string().contains("another stage"), "{e}");
        });
    }
}
