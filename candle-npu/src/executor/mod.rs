//! The boundary between the engine and a processor that runs static graphs.
//!
//! An [`Executor`] prepares a [`Graph`] once (shapes, quantization and weights fixed) into an
//! [`ExecutableGraph`] that is then executed many times with new inputs. Executors answer
//! [`Executor::supports`] truthfully so that the device can fall back to the host and log it.

pub mod host;
#[cfg(feature = "qnn")]
pub mod htp;

use crate::error::Result;
use crate::graph::{Graph, Op, TensorData};

pub use host::HostExecutor;

pub trait Executor: Send + Sync {
    /// Short name for logs and errors ("host", "htp").
    fn name(&self) -> &'static str;

    /// Whether this executor can run `op` of `graph` (with its shapes and types).
    fn supports(&self, graph: &Graph, op: &Op) -> bool;

    /// Compile a validated graph. Costly on an NPU (QNN finalize); done once per graph shape.
    fn prepare(&self, graph: &Graph) -> Result<Box<dyn ExecutableGraph>>;
}

/// A prepared graph. Inputs are given in the order of `Graph::inputs`, outputs come back in the
/// order of `Graph::outputs`; the caller ([`crate::PreparedGraph`]) has checked their types and sizes.
pub trait ExecutableGraph: Send + Sync {
    fn execute(&self, inputs: &[&TensorData]) -> Result<Vec<TensorData>>;
}
