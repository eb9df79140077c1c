//! The executor's settings ([`HtpConfig`]).

use super::*;

/// Settings of an [`HtpExecutor`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HtpConfig {
    /// Folder holding `libQnnHtp.so` (and, for the x86 wheel, its sibling `onnxruntime_qnn.libs`).
    /// `None`: [`qnn_sys::default_lib_dir`] (`$CANDLE_NPU_QNN_LIB_DIR`, else the project's
    /// `assets/qnn/onnxruntime_qnn`).
    pub lib_dir: Option<PathBuf>,
    /// HTP SoC model given to `deviceCreate` (`QNN_SOC_MODEL_*`): 57 = SM8650 (Snapdragon 8 Gen 3,
    /// v75, 8 MB VTCM), the default. Without one the library assumes SM8350 / 4 MB VTCM, which is
    /// much slower for large graphs; 0 means "no SoC config" (library default).
    pub soc_model: u32,
    /// HTP finalize optimization level (1 = fastest prepare, 2 = library default, 3 = best graph).
    pub optimization_level: Option<u32>,
    /// VTCM size in MB each graph may use (0 = maximum). `None`: the library's default.
    pub vtcm_mb: Option<u32>,
    /// Folder of the prepared-graph cache (context binaries, see [`crate::cache`]). Default:
    /// [`crate::cache::default_dir`] (`$CANDLE_NPU_CACHE_DIR`, else the user's cache folder,
    /// `~/.cache/candle-npu/graphs`). `None`: every graph is finalized in every process.
    pub cache_dir: Option<PathBuf>,
    /// QNN profiling of every finalize, load and execute, read back with
    /// [`Executor::profiles`]. `None`: off (profiling costs a little on every call).
    pub profiling: Option<ProfilingLevel>,
    /// How graphs prepared together ([`Executor::prepare_all`]: a model's stage graphs of every
    /// size) are held in contexts. `None`: [`Contexts::PerModel`] with
    /// [`Self::weight_sharing`], [`Contexts::PerGraphSize`] without.
    pub contexts: Option<Contexts>,
    /// Create shared contexts with the HTP's weight sharing: equal weight bytes in the graphs of
    /// one context (the same linear at two graph sizes) are held once. Needs HTP v73 or newer
    /// (SM8550 on; SM8650 is v75). Default: on, except on x86_64, where the library is an
    /// emulator that prepares and runs weight-shared graphs but refuses to load their binary
    /// back (QNN error 1000, "Shared weights buffer isn't supported on this platform"): there
    /// the prepared-graph cache holds the context without sharing.
    pub weight_sharing: bool,
    /// The most NPU address space one context may need, in bytes, as the library estimates it
    /// at load ([`address_space`] bounds it per graph): a model's graphs beyond it are split into
    /// contexts by layer range. Default [`DEFAULT_CONTEXT_BUDGET`] (3400 MiB: a protection
    /// domain of the DSP holds about 3.5 GB; see [`crate::executor::htp_contexts`]).
    pub context_budget: u64,
}

impl Default for HtpConfig {
    fn default() -> Self {
        HtpConfig {
            lib_dir: None,
            soc_model: QNN_SOC_MODEL_SM8650,
            optimization_level: None,
            vtcm_mb: None,
            cache_dir: crate::cache::default_dir(),
            profiling: None,
            contexts: None,
            weight_sharing: !cfg!(target_arch = "x86_64"),
            context_budget: DEFAULT_CONTEXT_BUDGET,
        }
    }
}

/// QNN profiling level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProfilingLevel {
    /// Per call: QNN's and the accelerator's time.
    Basic,
    /// Also per op (node) events.
    Detailed,
}

impl HtpConfig {
    /// The contexts graphs prepared together get ([`Self::contexts`], or its default).
    pub fn contexts(&self) -> Contexts {
        self.contexts.unwrap_or(if self.weight_sharing { Contexts::PerModel } else { Contexts::PerGraphSize })
    }

    /// The `libQnnHtp.so` this config loads.
    pub fn library_path(&self) -> PathBuf {
        self.lib_dir.clone().unwrap_or_else(default_lib_dir).join(QNN_HTP_LIBRARY_NAME)
    }
}
