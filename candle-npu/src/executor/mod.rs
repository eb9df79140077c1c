//! The boundary between the engine and a processor that runs static graphs.
//!
//! An [`Executor`] prepares a [`Graph`] once (shapes, quantization and weights fixed) into an
//! [`ExecutableGraph`] that is then executed many times with new inputs. Executors answer
//! [`Executor::supports`] truthfully so that the device can fall back to the host and log it.

pub mod host;
#[cfg(feature = "qnn")]
pub mod htp;
#[cfg(feature = "qnn")]
pub mod htp_contexts;
pub mod htp_numerics;
#[cfg(feature = "qnn")]
pub(crate) mod rpcmem;

use crate::error::Result;
use crate::graph::{Graph, Op, TensorData};

pub use host::HostExecutor;
pub use htp_numerics::Numerics;

/// A processor that runs static graphs: the host CPU ([`HostExecutor`]) or, with feature `qnn`, the
/// Hexagon NPU (`HtpExecutor`). Used through [`crate::NpuDevice`], which validates graphs, keeps
/// the counters, and falls back to the host for what the executor does not support.
pub trait Executor: Send + Sync {
    /// Short name for logs and errors ("host", "htp").
    fn name(&self) -> &'static str;

    /// Whether this executor can run `op` of `graph` (with its shapes and types).
    fn supports(&self, graph: &Graph, op: &Op) -> bool;

    /// Compile a validated graph. Costly on an NPU (QNN finalize); done once per graph shape.
    fn prepare(&self, graph: &Graph) -> Result<Box<dyn ExecutableGraph>>;

    /// Compile `n` graphs that are used together (a model's stage graphs of every graph size),
    /// in order; `describe(i)` gives graph `i`, validated and supported. A description holds
    /// its weights, so an executor keeps as few alive at once as it can (it may describe a
    /// graph more than once). An executor may hold the graphs in compiled units: the HTP puts
    /// them in shared QNN contexts, each loaded once and, where the device can load it, with
    /// one copy of the weights the graph sizes share. The default prepares each alone.
    fn prepare_all(&self, n: usize, describe: &dyn Fn(usize) -> Result<Graph>) -> Result<Vec<Box<dyn ExecutableGraph>>> {
        (0..n).map(|i| self.prepare(&describe(i)?)).collect()
    }

    /// The arithmetic this executor's results follow: a CPU margin beside it computes its rows
    /// with a [`HostExecutor`] of the same numerics (one numerics story per prompt).
    fn numerics(&self) -> Numerics {
        Numerics::Exact
    }

    /// Whether it runs on the host CPU, sharing the cores with the CPU stages (no second
    /// processor for another chunk's stages to overlap with).
    fn on_host(&self) -> bool {
        false
    }

    /// Per-graph profiles, when the executor was asked to profile (empty otherwise).
    fn profiles(&self) -> Vec<GraphProfile> {
        Vec::new()
    }
}

/// A prepared graph. Inputs are given in the order of `Graph::inputs`, outputs come back in the
/// order of `Graph::outputs`; the caller ([`crate::PreparedGraph`]) has checked their types and sizes.
pub trait ExecutableGraph: Send + Sync {
    /// Run once on new inputs (one buffer per graph input); returns one buffer per graph output.
    fn execute(&self, inputs: &[&TensorData]) -> Result<Vec<TensorData>>;

    /// Whether [`Self::execute_rows`] works: the graph's ops are row-wise, and its executor does
    /// not fix the row count at preparation (the host's FullyConnected graphs; not an NPU's).
    fn any_rows(&self) -> bool {
        false
    }

    /// As [`Self::execute`] with `rows` rows in place of the graph's first dimension (of every
    /// input and output); the caller has checked the buffers. Only when [`Self::any_rows`].
    fn execute_rows(&self, _inputs: &[&TensorData], _rows: usize) -> Result<Vec<TensorData>> {
        Err(crate::Error::Input("this graph has static shapes: it runs only on its own row count".into()))
    }

    /// The packed INT8 weight of constant `data_id` ([`crate::graph::TensorSpec::data_id`]) when
    /// this graph holds one on the host (the host executor's): the shadow path reads cold
    /// columns from it ([`crate::ShadowLinear::attach_packed`]). `None` elsewhere.
    fn packed_weight(&self, _data_id: u64) -> Option<std::sync::Arc<crate::kernels::PackedI8>> {
        None
    }

    /// Whether the graph was compiled now or loaded from a prepared-graph cache.
    fn origin(&self) -> Origin {
        Origin::Compiled
    }

    /// Size in bytes of the serialized compiled form that holds this graph (for QNN: its
    /// context binary, weights included), when the executor has one. Graphs prepared together
    /// into one unit ([`Executor::prepare_all`]) report the same unit: see
    /// [`Self::graphs_in_unit`].
    fn serialized_size(&self) -> Option<usize> {
        None
    }

    /// How many graphs share the compiled unit [`Self::serialized_size`] measures (1: the
    /// graph's own).
    fn graphs_in_unit(&self) -> usize {
        1
    }
}

/// How a prepared graph came to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Compiled from the IR in this process (for QNN: graphFinalize).
    Compiled,
    /// Loaded from the prepared-graph cache (for QNN: contextCreateFromBinary + graphRetrieve).
    Loaded,
}

/// One graph's profile, as the executor measured it (see `HtpConfig::profiling`).
#[derive(Debug, Clone, PartialEq)]
pub struct GraphProfile {
    /// Name of the profiled graph.
    pub graph: String,
    /// How the graph was last prepared: compiled, or loaded from the cache.
    pub origin: Origin,
    /// Time to compile or load the graph, microseconds: the backend's own figure when it reports
    /// one (QNN "(finalize)" / "(init)" events), else wall time around the call.
    pub prepare_us: u64,
    /// Executions profiled (those `execute_us` sums over).
    pub executions: u64,
    /// Sum over executions, microseconds: the backend's figure when it reports one (QNN
    /// "QNN (execute) time"), else wall time around the call.
    pub execute_us: u64,
    /// Every event the backend reported, summed over calls by (phase, name); detailed profiling
    /// adds per-op events.
    pub events: Vec<ProfileEvent>,
}

/// One kind of event the backend reported for a graph, summed over the calls of one phase.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileEvent {
    /// "prepare" or "execute".
    pub phase: &'static str,
    /// The backend's event name; a nested event is `parent / child`.
    pub name: String,
    /// "us", "bytes", "cycles" or "count".
    pub unit: &'static str,
    /// Sum over calls.
    pub value: u64,
    /// Number of calls that reported this event.
    pub calls: u64,
}
