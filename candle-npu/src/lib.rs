//! candle-npu: LLM prefill on the Qualcomm Hexagon NPU (or an INT8 host executor), decode on
//! candle's CPU path. The modules below are the architecture; the decoder engine and the model
//! families are the `candle-npu-models` crate (`models/` in the repository).
//!
//! - [`graph`]: the static graph IR every executor compiles (QNN's quantization convention).
//! - [`executor`]: the [`executor::Executor`] boundary, the host executor and (feature `qnn`) Hexagon.
//! - [`device`]: [`NpuDevice`], one executor with its counters and the logged host fallback.
//! - [`quant`]: INT8 quantization, calibration (clip ranges, hot channels) and the saved [`QuantProfile`].
//! - [`linear`]: [`ShadowLinear`], the one object per linear layer (NPU weight, shadow path, decode).
//! - [`outlier`]: the shadow path's CPU half: clipping, outlier extraction, cold columns.
//! - [`cache`]: the prepared-graph cache (compiled graphs on disk, validated, atomic writes).
//! - [`fs`]: files from outside: reads bounded to regular files of a size limit, output paths checked.
//! - [`chunk`]: the [`ChunkPlan`] that makes graphs shareable across chunks.
//! - [`sched`]: the [`SubgraphDag`] of (chunk, stage) nodes, scheduling [`Policy`]s, simulation, the
//!   optimum, and [`Trace`] (out-of-order subgraph execution, llm.npu §3.4).
//! - [`kernels`]: the host's exact INT8 GEMM, F32 GEMM, and the CPU stages' row kernels.

#![warn(missing_docs)]

pub mod cache;
pub mod chunk;
pub mod device;
pub mod error;
pub mod executor;
pub mod fs;
pub mod graph;
pub mod kernels;
pub mod linear;
pub mod nn;
pub mod outlier;
pub mod quant;
pub mod sched;

pub use chunk::{Chunk, ChunkPlan, Tail};
pub use device::{DeviceStats, NpuDevice, PreparedGraph};
pub use error::{Error, Result};
#[cfg(feature = "qnn")]
pub use executor::htp::{Contexts, HtpConfig, HtpExecutor, ProfilingLevel};
pub use executor::{ExecutableGraph, Executor, GraphProfile, HostExecutor, Numerics, Origin, ProfileEvent};
pub use graph::{DType, Graph, Op, Quant, StaticData, TensorData, TensorId};
pub use linear::{DecodeWeights, ShadowLinear, WeightQuant};
pub use outlier::{InMemoryWeight, InputPoint, Outliers, PointStats, WeightSource};
pub use quant::{Calibrator, ClipMethod, QuantProfile};
pub use sched::{ContributionWeights, CostModel, DagChunk, PickContext, Policy, Processor, Runner, Schedule, StageDesc, SubgraphDag, TableCosts, Trace};
