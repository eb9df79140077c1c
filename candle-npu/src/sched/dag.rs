//! The (chunk, layer, stage) DAG of one prefill: nodes in in-order execution order, edges from
//! the chunk's own chain and from the KV cache a stage reads.

use serde::Serialize;

use crate::error::{Error, Result};

/// The two processors a prefill runs on. Each runs one node at a time (the paper's eq. 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Processor {
    /// The NPU, or the executor standing in for it: the stages' static graphs (the linears).
    Npu,
    /// The host CPU: the stages around the graphs (norms, attention, activation, the tail), and
    /// every stage of a margin chunk.
    Cpu,
}

impl Processor {
    /// Both processors, in [`Processor::index`] order.
    pub const ALL: [Processor; 2] = [Processor::Npu, Processor::Cpu];

    /// Index into per-processor arrays such as [`super::Schedule::busy`].
    pub fn index(self) -> usize {
        match self {
            Processor::Npu => 0,
            Processor::Cpu => 1,
        }
    }

    /// "NPU" or "CPU", for traces, reports and errors.
    pub fn name(self) -> &'static str {
        match self {
            Processor::Npu => "NPU",
            Processor::Cpu => "CPU",
        }
    }
}

/// One stage of a decoder layer as the model supplies it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageDesc {
    /// Short stage name (e.g. "qkv", "attn"): the key of per-stage costs, and the last part of its
    /// nodes' names.
    pub name: String,
    /// Where the stage runs in a full chunk (a margin chunk runs it on the CPU).
    pub processor: Processor,
    /// Reads the KV rows appended by earlier chunks at the same layer (attention): the only
    /// dependency between chunks.
    pub reads_kv: bool,
}

impl StageDesc {
    /// A stage of `name` on `processor`; `reads_kv` for a stage that reads earlier chunks' KV rows.
    pub fn new(name: impl Into<String>, processor: Processor, reads_kv: bool) -> Self {
        Self { name: name.into(), processor, reads_kv }
    }
}

/// One chunk of the prompt. A margin chunk (HeteroLLM) fills no static NPU graph, so all of its
/// nodes run on the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DagChunk {
    /// Rows the chunk's stages run on (its padded length, > 0): what costs scale with.
    pub rows: usize,
    /// A CPU margin chunk: all of its nodes run on the CPU.
    pub margin: bool,
}

/// A node's index in [`SubgraphDag::nodes`]; the order of ids is the in-order schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct NodeId(pub usize);

/// One subgraph of a prefill: one stage of one layer (or the tail) for one chunk, on one processor.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Node {
    /// Its index in [`SubgraphDag::nodes`].
    pub id: NodeId,
    /// Index of its chunk, in prompt order.
    pub chunk: usize,
    /// `n_layer` for the tail node.
    pub layer: usize,
    /// Index of its stage in the layer's stage list (0 for the tail).
    pub stage: usize,
    /// `c{chunk}.l{layer}.{stage_name}`, e.g. "c1.l3.qkv".
    pub name: String,
    /// The stage's name, the key of per-stage costs.
    pub stage_name: String,
    /// Where it runs: its stage's processor, or the CPU in a margin chunk.
    pub processor: Processor,
    /// Rows of its chunk ([`DagChunk::rows`]).
    pub rows: usize,
    /// The chunk's first prompt row (the preceding chunks' rows): attention's context grows with it.
    pub start: usize,
    /// Reads the KV cache ([`StageDesc::reads_kv`]): it waits for the same node of the previous
    /// chunk.
    pub reads_kv: bool,
}

/// The DAG of (chunk, layer, stage) nodes of one prefill.
#[derive(Debug, Clone)]
pub struct SubgraphDag {
    nodes: Vec<Node>,
    preds: Vec<Vec<NodeId>>,
    succs: Vec<Vec<NodeId>>,
    n_layer: usize,
    n_stage: usize,
    has_tail: bool,
}

impl SubgraphDag {
    /// Builds the DAG: per chunk the chain `layer 0 stages, layer 1 stages, .., tail`, plus
    /// `(c - 1, l, s) -> (c, l, s)` for every stage that reads the KV cache.
    pub fn new(layer_stages: &[StageDesc], n_layer: usize, tail: Option<StageDesc>, chunks: &[DagChunk]) -> Result<Self> {
        if layer_stages.is_empty() {
            return Err(Error::Input("sched: empty per-layer stage list (a layer needs at least one stage)".into()));
        }
        if n_layer == 0 {
            return Err(Error::Input("sched: zero decoder layers".into()));
        }
        if chunks.is_empty() {
            return Err(Error::Input("sched: no chunks (prefill needs at least one token)".into()));
        }
        if let Some(c) = chunks.iter().position(|c| c.rows == 0) {
            return Err(Error::Input(format!("sched: chunk {c} has 0 rows")));
        }
        let n_stage = layer_stages.len();
        let per_chunk = n_layer * n_stage + usize::from(tail.is_some());
        let n = per_chunk * chunks.len();
        let (mut nodes, mut preds) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let mut start = 0;
        for (c, chunk) in chunks.iter().enumerate() {
            let layers = (0..n_layer).flat_map(|l| layer_stages.iter().enumerate().map(move |(s, d)| (l, s, d)));
            for (layer, stage, desc) in layers.chain(tail.iter().map(|d| (n_layer, 0, d))) {
                let id = NodeId(nodes.len());
                let mut p = Vec::with_capacity(2);
                if desc.reads_kv && c > 0 {
                    p.push(NodeId(id.0 - per_chunk));
                }
                if !id.0.is_multiple_of(per_chunk) {
                    p.push(NodeId(id.0 - 1));
                }
                preds.push(p);
                nodes.push(Node {
                    id,
                    chunk: c,
                    layer,
                    stage,
                    name: format!("c{c}.l{layer}.{}", desc.name),
                    stage_name: desc.name.clone(),
                    processor: if chunk.margin { Processor::Cpu } else { desc.processor },
                    rows: chunk.rows,
                    start,
                    reads_kv: desc.reads_kv,
                });
            }
            start += chunk.rows;
        }
        let mut succs = vec![Vec::new(); n];
        for (i, p) in preds.iter().enumerate() {
            for &q in p {
                succs[q.0].push(NodeId(i));
            }
        }
        Ok(Self { nodes, preds, succs, n_layer, n_stage, has_tail: tail.is_some() })
    }

    /// Every node, indexed by [`NodeId`]: chunk by chunk, each in layer then stage order, tail
    /// last.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The node `id` (panics if it is not in this DAG).
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.0]
    }

    /// The nodes `id` waits for: its chunk's previous node and, for a KV-reading stage, the same
    /// node of the previous chunk.
    pub fn preds(&self, id: NodeId) -> &[NodeId] {
        &self.preds[id.0]
    }

    /// The nodes that wait for `id` (the inverse of [`Self::preds`]).
    pub fn succs(&self, id: NodeId) -> &[NodeId] {
        &self.succs[id.0]
    }

    /// Every edge `(from, to)`, sorted.
    pub fn edges(&self) -> Vec<(NodeId, NodeId)> {
        let mut e: Vec<_> = (0..self.len()).flat_map(|i| self.preds[i].iter().map(move |&p| (p, NodeId(i)))).collect();
        e.sort();
        e
    }

    /// Number of nodes: chunks times (layers times stages, plus one for the tail).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the DAG has no nodes (never, for one [`SubgraphDag::new`] built).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Number of chunks.
    pub fn n_chunk(&self) -> usize {
        self.len() / self.per_chunk()
    }

    fn per_chunk(&self) -> usize {
        self.n_layer * self.n_stage + usize::from(self.has_tail)
    }

    /// The node of `(chunk, layer, stage)`; the tail is `(chunk, n_layer, 0)`.
    pub fn node_at(&self, chunk: usize, layer: usize, stage: usize) -> Option<NodeId> {
        let offset = if layer < self.n_layer && stage < self.n_stage {
            layer * self.n_stage + stage
        } else if layer == self.n_layer && stage == 0 && self.has_tail {
            self.n_layer * self.n_stage
        } else {
            return None;
        };
        (chunk < self.n_chunk()).then(|| NodeId(chunk * self.per_chunk() + offset))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{chunks, llm_dag};
    use super::*;

    #[test]
    fn edges_of_two_chunks_two_layers_by_hand() {
        let dag = llm_dag(&chunks(&[4, 4]), 2);
        // Per chunk: layer 0 = ids 0..8, layer 1 = 8..16, tail = 16; chunk 1 starts at 17.
        let mut want: Vec<(usize, usize)> = Vec::new();
        for c in [0, 17] {
            want.extend((c..c + 16).map(|i| (i, i + 1)));
        }
        want.extend([(2, 19), (10, 27)]); // attn (stage 2) of layer 0 and layer 1
        want.sort();
        let got: Vec<(usize, usize)> = dag.edges().into_iter().map(|(a, b)| (a.0, b.0)).collect();
        assert_eq!(got, want);
        assert_eq!(dag.node(NodeId(19)).name, "c1.l0.attn");
        assert_eq!(dag.node(NodeId(33)).name, "c1.l2.tail");
        assert_eq!(dag.node_at(1, 1, 2), Some(NodeId(27)));
        assert_eq!(dag.node_at(1, 2, 0), Some(NodeId(33)));
        assert_eq!(dag.node_at(2, 0, 0), None);
        assert_eq!(dag.node(NodeId(27)).start, 4);
        assert_eq!(dag.preds(NodeId(27)), &[NodeId(10), NodeId(26)]);
        assert_eq!(dag.succs(NodeId(10)), &[NodeId(11), NodeId(27)]);
    }

    #[test]
    fn margin_chunk_runs_all_on_cpu() {
        let dag = llm_dag(&[DagChunk { rows: 8, margin: false }, DagChunk { rows: 3, margin: true }], 2);
        let (full, margin): (Vec<&Node>, Vec<&Node>) = dag.nodes().iter().partition(|n| n.chunk == 0);
        assert!(margin.iter().all(|n| n.processor == Processor::Cpu));
        assert_eq!(full.iter().filter(|n| n.processor == Processor::Npu).count(), 8);
        assert!(margin.iter().all(|n| n.rows == 3 && n.start == 8));
    }

    #[test]
    fn bad_input_is_an_error() {
        let s = [StageDesc::new("x", Processor::Cpu, false)];
        let c = chunks(&[4]);
        assert!(matches!(SubgraphDag::new(&[], 1, None, &c), Err(Error::Input(_))));
        assert!(matches!(SubgraphDag::new(&s, 0, None, &c), Err(Error::Input(_))));
        assert!(matches!(SubgraphDag::new(&s, 1, None, &[]), Err(Error::Input(_))));
        assert!(matches!(SubgraphDag::new(&s, 1, None, &chunks(&[0])), Err(Error::Input(_))));
    }
}
