//! The one error type of candle-npu, sectioned by area. Each variant carries what a person needs
//! to fix the cause: the path, the op and its shapes, the QNN error code and message.

use std::path::PathBuf;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    // --- library loading (Hexagon executor) ---
    /// The QNN library at `path` is missing, not a QNN backend, of an unsupported API version,
    /// or refused to create its backend or device (`reason` says which).
    #[error("QNN library {path}: {reason}")]
    QnnLibrary { path: PathBuf, reason: String },

    // --- graph construction and preparation ---
    /// A graph whose structure is invalid (ids, shapes, constants, inputs or outputs): the op at
    /// fault and why.
    #[error("graph '{graph}': op {op} ({shapes}): {reason}")]
    InvalidGraph { graph: String, op: String, shapes: String, reason: String },
    /// The executor cannot run this op with these shapes and types (its `supports` says no).
    #[error("graph '{graph}': executor {executor} cannot run op {op} ({shapes})")]
    Unsupported { graph: String, executor: &'static str, op: String, shapes: String },
    /// The library refused to prepare (finalize) the graph: the op its log names, QNN's code and
    /// message.
    #[error("graph '{graph}': preparing op {op} ({shapes}) failed: QNN error {code}: {message}")]
    Prepare { graph: String, op: String, shapes: String, code: u64, message: String },

    // --- execution ---
    /// A buffer given for a graph input or output of the wrong type or size.
    #[error("graph '{graph}': input/output '{tensor}': expected {expected}, got {got}")]
    BufferMismatch { graph: String, tensor: String, expected: String, got: String },
    /// The library failed to execute a prepared graph.
    #[error("graph '{graph}': execute failed: QNN error {code}: {message}")]
    Execute { graph: String, code: u64, message: String },

    // --- quantization / calibration ---
    /// A quant profile file that is malformed, of another format, or for another model.
    #[error("quant profile {path}: {reason}")]
    Profile { path: PathBuf, reason: String },
    /// A quantization point the profile has no range for.
    #[error("no calibrated activation range for '{0}' (re-run calibration)")]
    MissingRange(String),

    // --- model loading ---
    /// A model file or folder that is malformed or of an unsupported kind.
    #[error("model {path}: {reason}")]
    Model { path: PathBuf, reason: String },
    /// A tensor the family needs is not in the checkpoint.
    #[error("model {path}: missing tensor '{name}'")]
    MissingTensor { path: PathBuf, name: String },

    /// A saved KV state (`candle_npu_models::session`) that is corrupt, or was saved for other
    /// weights, another quant profile or another precision.
    #[error("saved KV state {path}: {reason}")]
    KvState { path: PathBuf, reason: String },

    // --- input ---
    /// A value given by the caller that is out of range or inconsistent (tokens, lengths,
    /// options, profiles set on a model): the message says which and what was expected.
    #[error("invalid input: {0}")]
    Input(String),

    // --- scheduling and internal faults ---
    /// A prefill stage that was not run because another stage of the same prefill failed: the
    /// other error is the cause.
    #[error("sched: {stage} not run: another stage of this prefill failed")]
    Aborted { stage: String },
    /// A fault of this crate, not of its input: a bug to report, with this message.
    #[error("internal error (please report): {0}")]
    Internal(String),

    // --- wrapped ---
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// Reading or writing `path` failed.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}
