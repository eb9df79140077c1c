//! The one error type of candle-npu, sectioned by area. Each variant carries what a person needs
//! to fix the cause: the path, the op and its shapes, the QNN error code and message.

use std::path::PathBuf;

/// The result of every fallible operation of candle-npu.
pub type Result<T> = std::result::Result<T, Error>;

/// Every failure of candle-npu (and of `candle_npu_models`, which shares it), grouped by area
/// below; each variant carries what a person needs to fix its cause.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // --- library loading (Hexagon executor) ---
    /// The QNN library at `path` is missing, not a QNN backend, of an unsupported API version,
    /// or refused to create its backend or device (`reason` says which).
    #[error("QNN library {path}: {reason}")]
    QnnLibrary {
        /// The library file loaded, or looked for.
        path: PathBuf,
        /// Which step failed, with QNN's message when the library gave one.
        reason: String,
    },

    // --- graph construction and preparation ---
    /// A graph whose structure is invalid (ids, shapes, constants, inputs or outputs): the op at
    /// fault and why.
    #[error("graph '{graph}': op {op} ({shapes}): {reason}")]
    InvalidGraph {
        /// Name of the graph at fault.
        graph: String,
        /// The op at fault, or `-` when the fault is a tensor's or the graph's own.
        op: String,
        /// The op's operands and output as `name:Type[shape]` (`Graph::describe_op`), or the
        /// tensor, graph input or output at fault.
        shapes: String,
        /// The rule the graph breaks.
        reason: String,
    },
    /// The executor cannot run this op with these shapes and types (its `supports` says no).
    #[error("graph '{graph}': executor {executor} cannot run op {op} ({shapes})")]
    Unsupported {
        /// Name of the graph.
        graph: String,
        /// The executor's short name (`Executor::name`, e.g. "htp").
        executor: &'static str,
        /// The first op of the graph the executor cannot run.
        op: String,
        /// That op's operands and output as `name:Type[shape]`.
        shapes: String,
    },
    /// The library refused to prepare (finalize) the graph: the op its log names, QNN's code and
    /// message.
    #[error("graph '{graph}': preparing op {op} ({shapes}) failed: QNN error {code}: {message}")]
    Prepare {
        /// Name of the graph.
        graph: String,
        /// The op being added, or the one QNN's log names at finalize (every op, joined by `+`,
        /// when the log names none); `-` when the failure is not an op's.
        op: String,
        /// That op's operands and output as `name:Type[shape]`, or the step or tensor that
        /// failed (`contextCreate`, `graphCreate`, `context binary`, an output's name).
        shapes: String,
        /// QNN's error code; 0 when a check of this crate failed (a function the library lacks,
        /// a cache entry that does not fit the graph).
        code: u64,
        /// QNN's message for the code with the error lines the library logged, or what this
        /// crate found wrong.
        message: String,
    },

    // --- execution ---
    /// A buffer given for a graph input or output of the wrong type or size.
    #[error("graph '{graph}': input/output '{tensor}': expected {expected}, got {got}")]
    BufferMismatch {
        /// Name of the graph.
        graph: String,
        /// The tensor the buffer is bound to, or `<inputs>` when the number of input buffers
        /// is wrong.
        tensor: String,
        /// What the tensor needs: type, element count and bytes (or a number of inputs).
        expected: String,
        /// What was given, in the same form.
        got: String,
    },
    /// The library failed to execute a prepared graph.
    #[error("graph '{graph}': execute failed: QNN error {code}: {message}")]
    Execute {
        /// Name of the graph.
        graph: String,
        /// QNN's error code; 0 when the library lacks a function this crate needs.
        code: u64,
        /// QNN's message for the code with the error lines the library logged.
        message: String,
    },

    // --- quantization / calibration ---
    /// A quant profile file that is malformed, of another format, or for another model.
    #[error("quant profile {path}: {reason}")]
    Profile {
        /// The profile file.
        path: PathBuf,
        /// What is wrong with it, and on loading what to do (e.g. delete it to recalibrate).
        reason: String,
    },
    /// A quantization point the profile has no range for.
    #[error("no calibrated activation range for '{0}' (re-run calibration)")]
    MissingRange(String),

    // --- model loading ---
    /// A model file or folder that is malformed or of an unsupported kind.
    #[error("model {path}: {reason}")]
    Model {
        /// The model file or folder (or the file in it) at fault.
        path: PathBuf,
        /// What is malformed or unsupported.
        reason: String,
    },
    /// A tensor the family needs is not in the checkpoint.
    #[error("model {path}: missing tensor '{name}'")]
    MissingTensor {
        /// The checkpoint file or folder.
        path: PathBuf,
        /// The tensor's name as the checkpoint would spell it.
        name: String,
    },

    /// A saved KV state (`candle_npu_models::session`) that is corrupt, or was saved for other
    /// weights, another quant profile or another precision.
    #[error("saved KV state {path}: {reason}")]
    KvState {
        /// The saved state's file.
        path: PathBuf,
        /// What is damaged or differs from this model and its settings (or why the state
        /// could not be written).
        reason: String,
    },

    // --- input ---
    /// A value given by the caller that is out of range or inconsistent (tokens, lengths,
    /// options, profiles set on a model): the message says which and what was expected.
    #[error("invalid input: {0}")]
    Input(String),

    // --- scheduling and internal faults ---
    /// A prefill stage that was not run because another stage of the same prefill failed: the
    /// other error is the cause.
    #[error("sched: {stage} not run: another stage of this prefill failed")]
    Aborted {
        /// The node that was not run, named `c{chunk}.l{layer}.{stage}` (e.g. "c1.l3.qkv").
        stage: String,
    },
    /// An allocation the work needs could not be made: what it was for and its size, where
    /// Rust's own handler would abort with a bare "memory allocation failed".
    #[error("out of memory: {what} needs {bytes} bytes ({} MiB), which could not be allocated", bytes >> 20)]
    OutOfMemory {
        /// What the memory was for, e.g. "the KV cache of 4096 tokens".
        what: String,
        /// The size asked for.
        bytes: u64,
    },
    /// A fault of this crate, not of its input: a bug to report, with this message.
    #[error("internal error (please report): {0}")]
    Internal(String),

    // --- wrapped ---
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// Reading or writing `path` failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder being read or written.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
}

/// So that `?` on a `candle_npu` call works in a function returning `candle_core::Result`, as a
/// candle model's constructors and forwards do (`candle_npu::nn` layers in a candle model): a
/// candle error comes back as itself, every other one wrapped (its message kept).
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(e) => e,
            other => candle_core::Error::wrap(other),
        }
    }
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}

#[cfg(test)]
mod tests {
    use super::Error;

    /// A candle function can `?` this crate's errors: candle's own come back unchanged, the
    /// others keep their message.
    #[test]
    fn errors_convert_into_candle_errors() {
        fn candle_side(e: Error) -> candle_core::Result<()> {
            Err(e)?;
            Ok(())
        }
        let msg = candle_side(Error::Input("a prompt of 0 tokens".into())).unwrap_err().to_string();
        assert!(msg.contains("a prompt of 0 tokens"), "{msg}");
        let shape = candle_core::Tensor::zeros((2, 3), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap().reshape((4, 2)).unwrap_err();
        let want = shape.to_string();
        let back = candle_side(Error::Candle(shape)).unwrap_err();
        assert_eq!(back.to_string(), want);
    }
}
