//! [`NpuDevice`]: one executor, its statistics, and the fallback to the host when the executor
//! cannot run a graph.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::executor::{ExecutableGraph, Executor, GraphProfile, HostExecutor, Numerics, Origin};
use crate::graph::{check_buffer, check_input_count, DType, Graph, TensorData};

/// Counters that back the chunk-sharing claim (graphs prepared once, executed per chunk) and
/// the timing tables.
#[derive(Debug, Default)]
struct Counters {
    prepared: AtomicU64,
    loaded: AtomicU64,
    executions: AtomicU64,
    fallbacks: AtomicU64,
    prepare_ns: AtomicU64,
    load_ns: AtomicU64,
    execute_ns: AtomicU64,
}

/// A snapshot of a device's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Graphs prepared (compiled) on this device.
    pub graphs_prepared: u64,
    /// Graphs loaded from the prepared-graph cache instead of compiled.
    pub graphs_loaded: u64,
    /// Graph executions.
    pub executions: u64,
    /// Graphs prepared on the host because the executor could not run one of their ops.
    pub fallbacks: u64,
    /// Wall time spent compiling graphs.
    pub prepare_ns: u64,
    /// Wall time spent loading graphs from the cache.
    pub load_ns: u64,
    /// Wall time spent executing graphs.
    pub execute_ns: u64,
}

struct Inner {
    executor: Box<dyn Executor>,
    host: HostExecutor,
    counters: Counters,
    /// The device a CPU margin's graphs run on (see [`NpuDevice::margin_device`]).
    margin: OnceLock<NpuDevice>,
}

/// A processor that runs static graphs: the Hexagon NPU, or the host CPU's INT8 executor.
/// Cheap to clone; clones share the executor and counters.
#[derive(Clone)]
pub struct NpuDevice {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for NpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NpuDevice({})", self.inner.executor.name())
    }
}

impl NpuDevice {
    /// Graphs run on the host CPU with INT8 kernels.
    pub fn host() -> Self {
        Self::with_executor(Box::new(HostExecutor::new()))
    }

    /// The host executor following `numerics`: [`Numerics::Htp`] gives the Hexagon NPU's results
    /// at host speed (accuracy measured on the NPU's numerics; see
    /// [`crate::executor::htp_numerics`]).
    pub fn host_with(numerics: Numerics) -> Self {
        Self::with_executor(Box::new(HostExecutor::with_numerics(numerics)))
    }

    /// Whether the executor runs on the host CPU (sharing the cores with the CPU stages).
    pub fn on_host(&self) -> bool {
        self.inner.executor.on_host()
    }

    /// The arithmetic the executor's results follow.
    pub fn numerics(&self) -> Numerics {
        self.inner.executor.numerics()
    }

    /// Where a prefill's CPU margin runs its stage graphs (on any row count): this device when
    /// its executor is the host's; otherwise one host device, made once, with this executor's
    /// numerics, so that margin rows compute what the NPU would have computed for them. Its
    /// preparations and executions are counted there, not as this device's.
    pub fn margin_device(&self) -> NpuDevice {
        if self.on_host() {
            return self.clone();
        }
        self.inner.margin.get_or_init(|| NpuDevice::host_with(self.numerics())).clone()
    }

    /// Graphs run on the Hexagon NPU through QNN's HTP backend (on x86: its emulator). Fails with
    /// [`Error::QnnLibrary`] when the library is absent or unusable.
    #[cfg(feature = "qnn")]
    pub fn hexagon(config: crate::executor::htp::HtpConfig) -> Result<Self> {
        Ok(Self::with_executor(Box::new(crate::executor::htp::HtpExecutor::new(config)?)))
    }

    /// A device over `executor` (e.g. an `HtpExecutor` made with its own settings). Graphs with an
    /// op it does not support are prepared on a host executor with exact numerics.
    pub fn with_executor(executor: Box<dyn Executor>) -> Self {
        NpuDevice { inner: Arc::new(Inner { executor, host: HostExecutor::new(), counters: Counters::default(), margin: OnceLock::new() }) }
    }

    /// The executor's short name ("host", "htp"), for logs and reports.
    pub fn executor_name(&self) -> &'static str {
        self.inner.executor.name()
    }

    /// A snapshot of the counters, shared by every clone of this device.
    pub fn stats(&self) -> DeviceStats {
        let c = &self.inner.counters;
        DeviceStats {
            graphs_prepared: c.prepared.load(Ordering::Relaxed),
            executions: c.executions.load(Ordering::Relaxed),
            fallbacks: c.fallbacks.load(Ordering::Relaxed),
            graphs_loaded: c.loaded.load(Ordering::Relaxed),
            prepare_ns: c.prepare_ns.load(Ordering::Relaxed),
            load_ns: c.load_ns.load(Ordering::Relaxed),
            execute_ns: c.execute_ns.load(Ordering::Relaxed),
        }
    }

    /// Per-graph profiles, when the executor profiles (see `HtpConfig::profiling`).
    pub fn graph_profiles(&self) -> Vec<GraphProfile> {
        self.inner.executor.profiles()
    }

    /// Validate and compile a graph (or load it from the executor's prepared-graph cache). When
    /// the executor cannot run one of its ops, the graph is prepared on the host instead and the
    /// fallback is logged.
    pub fn prepare(&self, graph: &Graph) -> Result<PreparedGraph> {
        Ok(self.prepare_all(std::slice::from_ref(graph))?.remove(0))
    }

    /// [`Self::prepare`] for graphs used together (a model's stage graphs of every graph size),
    /// returned in the same order. The executor may hold them in compiled units (the HTP:
    /// shared QNN contexts, see [`Executor::prepare_all`]); graphs it cannot run are prepared on
    /// the host, each logged.
    pub fn prepare_all(&self, graphs: &[Graph]) -> Result<Vec<PreparedGraph>> {
        self.prepare_described(graphs.len(), |i| Ok(graphs[i].clone()))
    }

    /// [`Self::prepare_all`] for `n` graphs described on demand by `describe(i)`, which may be
    /// called more than once per graph: a description holds its weights, and only a few are
    /// alive at once (a model's stage graphs of every size, described together, would hold a
    /// copy of every weight per size).
    pub fn prepare_described(&self, n: usize, describe: impl Fn(usize) -> Result<Graph>) -> Result<Vec<PreparedGraph>> {
        let t = Instant::now();
        let ex = &self.inner.executor;
        let mut signatures = Vec::with_capacity(n);
        let mut execs: Vec<Option<Box<dyn ExecutableGraph>>> = (0..n).map(|_| None).collect();
        let mut fallbacks: Vec<Option<String>> = vec![None; n];
        let mut on_executor = Vec::new();
        for (i, exec) in execs.iter_mut().enumerate() {
            let graph = describe(i)?;
            graph.validate()?;
            match graph.ops.iter().find(|op| !ex.supports(&graph, op)) {
                Some(op) => {
                    tracing::warn!(
                        graph = %graph.name, executor = ex.name(), op = op.name(), shapes = %graph.describe_op(op),
                        "op not supported by the NPU executor: running this graph on the host CPU"
                    );
                    self.inner.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
                    fallbacks[i] = Some(format!("the {} executor does not take op {} ({})", ex.name(), op.name(), graph.describe_op(op)));
                    *exec = Some(self.inner.host.prepare(&graph)?);
                }
                None => on_executor.push(i),
            }
            signatures.push(Signature::of(&graph));
        }
        if !on_executor.is_empty() {
            let compiled = ex.prepare_all(on_executor.len(), &|j| describe(on_executor[j]))?;
            if compiled.len() != on_executor.len() {
                return Err(Error::Internal(format!("executor {} prepared {} of {} graphs", ex.name(), compiled.len(), on_executor.len())));
            }
            for (&i, exec) in on_executor.iter().zip(compiled) {
                execs[i] = Some(exec);
            }
        }
        let c = &self.inner.counters;
        let ns = t.elapsed().as_nanos() as u64;
        let loaded = execs.iter().flatten().filter(|e| e.origin() == Origin::Loaded).count() as u64;
        let compiled = n as u64 - loaded;
        c.prepared.fetch_add(compiled, Ordering::Relaxed);
        c.loaded.fetch_add(loaded, Ordering::Relaxed);
        // The batch's time, shared by its graphs in proportion.
        c.prepare_ns.fetch_add(ns * compiled / n.max(1) as u64, Ordering::Relaxed);
        c.load_ns.fetch_add(ns * loaded / n.max(1) as u64, Ordering::Relaxed);
        Ok(signatures
            .into_iter()
            .zip(execs)
            .zip(fallbacks)
            .map(|((sig, exec), fallback)| PreparedGraph {
                fallback,
                name: sig.name,
                rows: sig.rows,
                inputs: sig.inputs,
                outputs: sig.outputs,
                exec: exec.expect("every graph is prepared"),
                device: self.clone(),
            })
            .collect())
    }
}

/// What a prepared graph keeps of its description: names, types and sizes of its buffers.
struct Signature {
    name: String,
    rows: usize,
    inputs: Vec<(String, DType, usize)>,
    outputs: Vec<(String, DType, usize)>,
}

impl Signature {
    fn of(graph: &Graph) -> Self {
        let sig =
            |ids: &[crate::graph::TensorId]| ids.iter().map(|&i| (graph.tensor(i).name.clone(), graph.tensor(i).dtype, graph.tensor(i).elem_count())).collect();
        Signature {
            name: graph.name.clone(),
            rows: graph.inputs.first().and_then(|&i| graph.tensor(i).shape.first().copied()).unwrap_or(1),
            inputs: sig(&graph.inputs),
            outputs: sig(&graph.outputs),
        }
    }
}

/// A compiled graph bound to its device. Execute it as often as needed with new inputs.
pub struct PreparedGraph {
    name: String,
    /// The first dimension of the first input: the row count the graph was prepared for.
    rows: usize,
    inputs: Vec<(String, DType, usize)>,
    outputs: Vec<(String, DType, usize)>,
    exec: Box<dyn ExecutableGraph>,
    device: NpuDevice,
    /// Why it runs on the host CPU, when its device's executor could not take it.
    fallback: Option<String>,
}

impl PreparedGraph {
    /// Why this graph runs on the host CPU rather than on the device's executor (an op or
    /// shape it cannot take), or `None` when it runs there. Logged as a warning when prepared.
    pub fn fallback(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// Name of the graph it was prepared from.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compiled now, or loaded from the prepared-graph cache.
    pub fn origin(&self) -> Origin {
        self.exec.origin()
    }

    /// Bytes of the compiled form (QNN context binary, weights included), when the executor can
    /// serialize graphs.
    pub fn serialized_size(&self) -> Option<usize> {
        self.exec.serialized_size()
    }

    /// How many graphs share the compiled unit [`Self::serialized_size`] measures (graphs
    /// prepared together into one QNN context share its binary).
    pub fn graphs_in_unit(&self) -> usize {
        self.exec.graphs_in_unit()
    }

    /// Run the graph. Inputs in the graph's input order; every buffer is checked against its
    /// tensor's type and size first (QNN does not check, and would overrun).
    pub fn execute(&self, inputs: &[&TensorData]) -> Result<Vec<TensorData>> {
        self.run(inputs, None)
    }

    /// The packed INT8 weight of constant `data_id` this graph holds on the host, if any (see
    /// [`ExecutableGraph::packed_weight`]).
    pub fn packed_weight(&self, data_id: u64) -> Option<Arc<crate::kernels::PackedI8>> {
        self.exec.packed_weight(data_id)
    }

    /// Whether [`Self::execute_rows`] works (see [`ExecutableGraph::any_rows`]).
    pub fn any_rows(&self) -> bool {
        self.exec.any_rows()
    }

    /// Run the graph on `rows` rows in place of its own first dimension (a CPU margin on the
    /// host's graphs); an error for graphs whose shapes are static (any NPU's).
    pub fn execute_rows(&self, inputs: &[&TensorData], rows: usize) -> Result<Vec<TensorData>> {
        if !self.exec.any_rows() {
            return Err(Error::Input(format!("graph {}: its shapes are static, it cannot run {rows} rows", self.name)));
        }
        self.run(inputs, Some(rows))
    }

    fn run(&self, inputs: &[&TensorData], rows: Option<usize>) -> Result<Vec<TensorData>> {
        check_input_count(&self.name, self.inputs.len(), inputs.len())?;
        // Buffer sizes scale with the rows: the signature's count is for `self.rows`.
        let size = |n: usize| rows.map_or(n, |r| n / self.rows.max(1) * r);
        for ((name, dtype, n), data) in self.inputs.iter().zip(inputs) {
            check_buffer(&self.name, name, *dtype, size(*n), data)?;
        }
        let t = Instant::now();
        let out = match rows {
            Some(r) => self.exec.execute_rows(inputs, r)?,
            None => self.exec.execute(inputs)?,
        };
        for ((name, dtype, n), data) in self.outputs.iter().zip(&out) {
            check_buffer(&self.name, name, *dtype, size(*n), data)?;
        }
        let c = &self.device.inner.counters;
        c.executions.fetch_add(1, Ordering::Relaxed);
        c.execute_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(out)
    }
}
