//! The Hexagon executor: runs graphs on the Qualcomm HTP (Hexagon NPU) through QNN's C API, on
//! top of the hand-written `qnn-sys` bindings. On x86 the same library is an emulator.
//!
//! # Lifetimes
//!
//! One [`HtpExecutor`] owns a loaded `libQnnHtp.so`, a log, a backend and a device (with the HTP
//! SoC custom config, written in the layout the library's reported HTP API version expects).
//!
//! **Contexts.** Graphs prepared together ([`Executor::prepare_all`]: a model's stage graphs of
//! every graph size) share contexts ([`HtpConfig::contexts`]), as the vendors' toolchains
//! build a model: one context binary in the cache, one `contextCreateFromBinary`, a
//! `graphRetrieve` per graph. With [`HtpConfig::weight_sharing`] (a device's default) there is
//! **one context per model**, created with the HTP's weight sharing, which keeps equal weight
//! bytes once (by content, not by name: the same linear at two graph sizes). Measured on this
//! library (`examples/htp_contexts.rs`, `docs/memory.md`): SmolLM2's stage graphs at 256 and 32
//! rows take 486 MB of context binary in 240 contexts, 483 MB in one, 118 MB in one with
//! sharing. The x86 library prepares and runs a weight-shared context but refuses to load its
//! binary (QNN 1000, "Shared weights buffer isn't supported on this platform"), so sharing is
//! off by default there, and without it there is one context per graph size: a context of
//! every size would save nothing. A context the library estimates beyond one protection
//! domain's address space is refused at load (QNN 1002, "Failed to find available PD", with its
//! "context size estimate", 2.3-3.1x the binary without sharing): a model whose graphs would
//! need more than [`HtpConfig::context_budget`] is split into contexts by layer range, a
//! stage's graphs of every size kept together ([`super::htp_contexts`]); on a phone the library
//! puts each in the next PD when one fills, while the x86 emulator has a single PD per process.
//! A graph prepared alone ([`Executor::prepare`], or with [`Contexts::PerGraph`]) gets a
//! context of its own. Every graph
//! holds an `Arc` of its context, freed with its last graph; executions in one context run one
//! at a time. Each context holds an `Arc` of the runtime, so the device, backend and log are
//! freed (in that order, after every context) only when the executor and its last graph are
//! gone. Several executors may live in one process (each has its own backend; checked on the
//! emulator), but on the emulator they share its one PD: a second executor does not make room.
//!
//! # Prepared-graph cache, profiling, shared buffers
//!
//! With [`HtpConfig::cache_dir`], every context is first looked up in a [`GraphCache`] under a
//! key made of its graphs' fingerprints (in order) and this executor's library build, API
//! versions, SoC and graph configs (and, for a shared context, the weight-sharing flag); a hit
//! is loaded with `contextCreateFromBinary` + `graphRetrieve` (the tensor ids for execution come
//! from the cache entry); a miss is finalized and its context binary (`contextGetBinary`)
//! written. An unusable entry (corrupt, or refused by the library) is rebuilt with a warning:
//! for a shared context, the whole context. With [`HtpConfig::profiling`], every finalize, load and execute gets
//! a QNN profile whose events are summed per graph ([`Executor::profiles`]). Where
//! `libcdsprpc.so` exists (Android), graph inputs and outputs live in rpcmem buffers registered
//! with `memRegister` (`rpcmem`); elsewhere, as on x86, in client buffers.
//!
//! # Translation
//!
//! Every [`TensorSpec`] an op touches becomes one QNN graph tensor: graph inputs APP_WRITE,
//! graph outputs APP_READ (also when a later op reads them), intermediates NATIVE, constants
//! STATIC with a client buffer (QNN copies constants by `graphFinalize`, so the prepared graph
//! does not keep the weights alive). `U8` -> UFIXED_POINT_8, `I8` -> SFIXED_POINT_8,
//! `I32` -> SFIXED_POINT_32, `F32` -> FLOAT_32; quantization is SCALE_OFFSET with the IR's own
//! scale and offset (both use `float = (q + offset) * scale`), and per-channel weights
//! ([`TensorSpec::channel_scales`]) AXIS_SCALE_OFFSET along axis 0 with offsets 0. Ops map to `qti.aisw` ops:
//! FullyConnected (no `keep_dims` param), MatMul (`transpose_in0 = false`,
//! `transpose_in1 = transpose_b`), Quantize, Dequantize, ElementWiseAdd, ElementWiseMultiply,
//! Sigmoid, Softmax (`axis` the last, `beta` 1), RmsNorm (see below), ReluMinMax (the IR's
//! Clamp), Reshape, Transpose (`perm`), Concat (`axis`); U16 -> UFIXED_POINT_16.
//!
//! # What runs, and the lowering
//!
//! Measured on the QNN 2.40 / HTP API 5.51 x86 emulator (`onnxruntime-qnn` 2.7.0, SoC SM8650):
//!
//! * **FLOAT_32 compute is FP16 on HTP.** Float elementwise ops, float FullyConnected and float
//!   MatMul finalize and run, with results rounded to FP16 (relative error about 2^-11 per op;
//!   values beyond ±65504 overflow). Graphs with F32 tensors get the HTP graph config
//!   `PRECISION = FLOAT16` so that this is explicit rather than a library default.
//! * **W8A8 FullyConnected** (`U8`/`I8` input, `I8` symmetric weight, optional `I32` bias with
//!   scale `s_x * s_w`) with a `U8`/`I8` output is within one output step of the exact result;
//!   with an `F32` output it is exact up to f32 rounding — except that an F32 output with fewer
//!   than 32 columns (`N < 32`) fails at execute with QNN error 1100. **Lowering:** such an FC is
//!   built as FullyConnected -> SFIXED_POINT_32 accumulator (scale `s_x * s_w`, offset 0) ->
//!   Dequantize -> FLOAT_32, which is bit-exact against the host.
//! * **Per-channel weights** (AXIS_SCALE_OFFSET, axis 0) finalize and run with `U8`/`I8` outputs;
//!   with an `F32` output finalize fails (1002, "could not create op"). **Lowering:** the same
//!   INT8 weights under one scale `s0 = min(s_n)` -> FullyConnected with F32 output ->
//!   ElementWiseMultiply by the static `[N]` vector `s_n / s0` (FP16: 2^-11 relative; the
//!   intermediate never exceeds the result, so it cannot overflow where the result would not).
//!   Needs `N >= 32` like any F32-output FullyConnected.
//! * **FullyConnected with an `I32` (SFIXED_POINT_32) output** is exact only for `N <= 32`; for
//!   `N > 32`, `M >= 2` and `K` above ~128 the library silently returns wrong values for every
//!   output column past the 32nd. Only `N <= 32` is supported.
//! * **MatMul** of two 8-bit inputs with an `F32` output fails at execute (1100) when `N < 32`,
//!   and with an `I32` output returns wrong values; both are unsupported. Every other dtype
//!   combination ran correctly.
//! * **Quantize** F32 -> `I32` fails at finalize (1002, "could not create op"); F32 -> `U8`/`I8`
//!   works. **Dequantize** from `U8`/`I8`/`I32` works.
//! * **Add, Mul, Sigmoid**: every combination of `U8`/`I8`/`I32`/`F32` inputs and output ran
//!   within one output step (quantized outputs) or FP16 rounding (F32 outputs).
//! * **Softmax** (F32, last axis) is not one FP16 rounding of the exact weights: up to 11 FP16
//!   steps off (3.2e-3 of the largest weight). **Attention** as scores (MatMul against `K^T`,
//!   rank 3 with a batch per KV head), a mask added (finite: -30000), Softmax, and the weighted
//!   sum runs within 3.2e-3 of f64 at worst, 3.6e-4 RMS, of the largest output, a masked cache's
//!   garbage rows left out (`htp_conformance.rs::attention_with_a_masked_cache_on_the_library`).
//! * **RmsNorm** runs on FLOAT_16 only (FLOAT_32 fails at finalize, Convert FP32 <-> FP16 too).
//!   **Lowering:** Cast to FLOAT_16, RmsNorm with an FP16 weight, Cast back: within 7.2e-4 of
//!   the exact norm, also with a channel whose square overflows FP16.
//! * **Quantize** to UFIXED_POINT_16 saturates, and rounds its F32 input to FP16 first. **A
//!   Quantize reading an op's output gives that output its encoding**: every other reader of
//!   the op's output then sees it clipped to the Quantize's range (the graph optimizer's doing).
//!   A graph that needs the unclipped value beside a quantized one clamps first (ReluMinMax).
//! * Elementwise ops broadcast as numpy does (the per-channel lowering's `[N]` scales, RoPE's
//!   `[rows, 1, head_dim]` tables, a mask over every head's scores).
//! * **A refused device changes the process.** After a `deviceCreate` the library refuses (an
//!   unknown SoC), graphs finalized later in the process, on any executor, compute float ops in
//!   FP32 rather than FP16: the per-channel lowering's FP16 intermediate is gone, so the HTP
//!   numerics model (`super::htp_numerics`) no longer applies. A process that saw
//!   [`Error::QnnLibrary`] from `deviceCreate` should not go on preparing graphs.
//! * Tensors of rank 1 to 4 (rank 5 ran for Add but is not claimed), every byte size fitting
//!   QNN's `u32` `dataSize`. (QNN cannot finalize a graph without nodes, error 6022; validated
//!   IR graphs always have ops, since every output must be produced by one.)

use std::collections::BTreeMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use qnn_sys::*;

use super::htp_check;
pub use super::htp_contexts::{address_space, Contexts, DEFAULT_CONTEXT_BUDGET};
use super::htp_contexts::{plan, Member};
use super::rpcmem::{self, RpcMem, SharedBuffer};
use super::{ExecutableGraph, Executor, GraphProfile, Origin, ProfileEvent};
use crate::cache::{CacheKey, CachedGraph, GraphCache, Lookup};
use crate::error::{Error, Result};
use crate::graph::{check_buffer, check_input_count, DType, Graph, Op, StaticData, TensorData, TensorId, TensorKind, TensorSpec};

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
    /// domain of the DSP holds about 3.5 GB; see [`super::htp_contexts`]).
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

// ------------------------------------------------------------------------------------------------
// Logging. QNN's log callback carries no user pointer, so its lines go to `tracing` (target
// `candle_npu::qnn`) and into a small process-wide ring that error paths read back: finalize
// errors are explained (and the failing node named) only in the log.
// ------------------------------------------------------------------------------------------------

static LOG_SEQ: AtomicU64 = AtomicU64::new(0);
static LOG_RING: Mutex<std::collections::VecDeque<(u64, String)>> = Mutex::new(std::collections::VecDeque::new());
const LOG_RING_LEN: usize = 128;

unsafe extern "C" fn log_callback(fmt: *const c_char, level: u32, _timestamp: u64, args: QnnVaList) {
    // SAFETY: called by QNN with its own fmt/va_list, formatted exactly once.
    let msg = unsafe { format_log_message(fmt, args) };
    if level == QNN_LOG_LEVEL_ERROR {
        // Errors reach the caller as `Err` values carrying these lines; no need to shout here.
        tracing::debug!(target: "candle_npu::qnn", "QNN error: {msg}");
        let seq = LOG_SEQ.fetch_add(1, Ordering::Relaxed) + 1;
        let mut ring = LOG_RING.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() == LOG_RING_LEN {
            ring.pop_front();
        }
        ring.push_back((seq, msg));
    } else {
        // Warnings on every graphCreate are harmless noise ("unexpected GraphHtpSettings option").
        tracing::trace!(target: "candle_npu::qnn", level, "QNN: {msg}");
    }
}

fn log_mark() -> u64 {
    LOG_SEQ.load(Ordering::Relaxed)
}

/// Error lines QNN logged after `mark`; the last few, joined.
fn log_errors_since(mark: u64) -> Vec<String> {
    let ring = LOG_RING.lock().unwrap_or_else(|e| e.into_inner());
    let lines: Vec<String> = ring.iter().filter(|(seq, _)| *seq > mark).map(|(_, m)| m.clone()).collect();
    lines[lines.len().saturating_sub(6)..].to_vec()
}

fn with_log(msg: String, lines: &[String]) -> String {
    if lines.is_empty() {
        msg
    } else {
        format!("{msg} (QNN log: {})", lines.join(" | "))
    }
}

// ------------------------------------------------------------------------------------------------
// Runtime: library, log, backend, device.
// ------------------------------------------------------------------------------------------------

struct Runtime {
    lib: QnnLibrary,
    log: Qnn_LogHandle_t,
    backend: Qnn_BackendHandle_t,
    device: Qnn_DeviceHandle_t,
    config: HtpConfig,
}

// SAFETY: the handles are opaque pointers owned by this value; QNN's log, backend and device
// handles may be used from any thread (graphs are prepared and executed from several).
unsafe impl Send for Runtime {}
unsafe impl Sync for Runtime {}

impl Runtime {
    fn f(&self) -> &QnnInterfaceFunctions_t {
        self.lib.functions()
    }

    fn message(&self, rc: Qnn_ErrorHandle_t) -> String {
        self.lib.error_message(rc)
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let f = *self.lib.functions();
        // SAFETY: each handle was created by this runtime and is freed once, in reverse order of
        // creation; every context is already freed (prepared graphs hold an Arc of the runtime).
        unsafe {
            if let (false, Some(free)) = (self.device.is_null(), f.deviceFree) {
                free(self.device);
            }
            if let (false, Some(free)) = (self.backend.is_null(), f.backendFree) {
                free(self.backend);
            }
            if let (false, Some(free)) = (self.log.is_null(), f.logFree) {
                free(self.log);
            }
        }
    }
}

/// Runs graphs on the Hexagon NPU through QNN's HTP backend (feature `qnn`).
///
/// See the [module documentation](self) for what the backend accepts of the IR (which is what
/// [`Executor::supports`] answers) and the lowering done where an IR op does not map one to one.
pub struct HtpExecutor {
    rt: Arc<Runtime>,
    cache: Option<GraphCache>,
    /// What besides the graph determines a compiled graph (see [`crate::cache`]).
    cache_salt: String,
    /// `libQnnSystem.so` beside the backend, with a cache: it reads a cached binary's own tensor
    /// ids, which the entry's side table must match ([`check_ids`]).
    system: Option<QnnSystemLibrary>,
    profiles: Option<Profiles>,
}

/// Bump when the IR -> QNN translation changes what a graph compiles to, so that cached
/// context binaries of the old translation are not loaded.
const TRANSLATION_VERSION: u32 = 1;

impl std::fmt::Debug for HtpExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HtpExecutor").field("library", &self.rt.lib.path()).field("api", &self.rt.lib.api_version()).field("config", &self.rt.config).finish()
    }
}

impl HtpExecutor {
    /// Loads `libQnnHtp.so` from `config.lib_dir` and creates the log, backend and device.
    ///
    /// A missing library, a file that is not a QNN backend (or not an ELF library, or one of
    /// another architecture: checked from its header before dlopen), a library whose API version
    /// this crate does not support, or a backend/device the library refuses to create gives
    /// [`Error::QnnLibrary`] naming the library's path.
    pub fn new(config: HtpConfig) -> Result<Self> {
        let path = config.library_path();
        let lib_err = |reason: String| Error::QnnLibrary { path: path.clone(), reason };
        let lib = QnnLibrary::load(&path).map_err(|e| match e {
            // "is an aarch64 ELF library; this process is x86_64": the path is said once.
            LoadError::NotLoadable { reason, .. } => lib_err(reason),
            e => lib_err(e.to_string()),
        })?;
        let f = *lib.functions();
        let (Some(log_create), Some(backend_create), Some(device_create)) = (f.logCreate, f.backendCreate, f.deviceCreate) else {
            return Err(lib_err("the library lacks logCreate/backendCreate/deviceCreate".into()));
        };
        let mut rt = Runtime { lib, log: null_mut(), backend: null_mut(), device: null_mut(), config };
        // SAFETY: out-pointers are valid; config lists are NULL-terminated and their pointees live
        // across each call. On an early return `rt`'s Drop frees what was created.
        unsafe {
            // The library's verbose log (what it reserves for each context, why a graph was
            // tiled as it was) when its trace is asked for: `RUST_LOG=candle_npu::qnn=trace`.
            let level = match tracing::enabled!(target: "candle_npu::qnn", tracing::Level::TRACE) {
                true => QNN_LOG_LEVEL_VERBOSE,
                false => QNN_LOG_LEVEL_WARN,
            };
            let rc = log_create(Some(log_callback), level, &mut rt.log);
            if rc != QNN_SUCCESS {
                return Err(lib_err(format!("logCreate: {}", rt.message(rc))));
            }
            let rc = backend_create(rt.log, null(), &mut rt.backend);
            if rc != QNN_SUCCESS {
                return Err(lib_err(format!("backendCreate: {}", rt.message(rc))));
            }
            let layout = rt.lib.htp_device_config_layout();
            let mut soc = HtpDeviceCustomConfig::soc(layout, rt.config.soc_model);
            let cfg = QnnDevice_Config_t::custom(soc.as_mut_ptr());
            let list: [*const QnnDevice_Config_t; 2] = [if rt.config.soc_model == 0 { null() } else { &cfg }, null()];
            let rc = device_create(rt.log, list.as_ptr(), &mut rt.device);
            if rc != QNN_SUCCESS {
                return Err(lib_err(format!(
                    "deviceCreate with SoC model {} ({layout:?} device config layout for HTP API {}): {}",
                    rt.config.soc_model,
                    rt.lib.api_version().backendApiVersion,
                    rt.message(rc)
                )));
            }
        }
        tracing::info!(
            library = %rt.lib.path().display(),
            api = %rt.lib.api_version().coreApiVersion,
            htp_api = %rt.lib.api_version().backendApiVersion,
            build = rt.lib.backend_build_id().unwrap_or_default(),
            soc = rt.config.soc_model,
            "QNN HTP backend ready"
        );
        let api = rt.lib.api_version();
        let c = &rt.config;
        let cache_salt = format!(
            "candle-npu {} translation {TRANSLATION_VERSION} | QNN build {} core {} htp {} | soc {} opt {:?} vtcm {:?}",
            env!("CARGO_PKG_VERSION"),
            rt.lib.backend_build_id().unwrap_or_else(|| format!("unknown ({})", rt.lib.path().display())),
            api.coreApiVersion,
            api.backendApiVersion,
            c.soc_model,
            c.optimization_level,
            c.vtcm_mb,
        );
        let cache = c.cache_dir.clone().map(GraphCache::new);
        match &cache {
            Some(cache) => tracing::info!(dir = %cache.dir().display(), "prepared-graph cache"),
            None => tracing::info!("no prepared-graph cache: every graph is finalized in this process"),
        }
        let system = cache.as_ref().and_then(|_| {
            let path = c.library_path().with_file_name(QNN_SYSTEM_LIBRARY_NAME);
            QnnSystemLibrary::load(&path)
                .inspect_err(|e| tracing::warn!(error = %e, "the graph cache's tensor ids cannot be checked against its binaries without the QNN System library: trusting them"))
                .ok()
        });
        let profiles = c.profiling.map(|_| Profiles::default());
        Ok(HtpExecutor { rt: Arc::new(rt), cache, cache_salt, system, profiles })
    }

    /// The loaded library's path.
    pub fn library_path(&self) -> &Path {
        self.rt.lib.path()
    }

    /// Core and HTP backend API versions the library reports (e.g. 2.40.0 and 5.51.0).
    pub fn api_version(&self) -> Qnn_ApiVersion_t {
        self.rt.lib.api_version()
    }

    /// The library's build id (e.g. `v2.51.0.260929181845`).
    pub fn build_id(&self) -> Option<String> {
        self.rt.lib.backend_build_id()
    }

    /// The settings this executor was created with.
    pub fn config(&self) -> &HtpConfig {
        &self.rt.config
    }

    /// Like [`Executor::prepare`], but without consulting the support table: the library alone
    /// decides. For probing what a new library version accepts; a rejected graph gives
    /// [`Error::Prepare`] naming the op (when the library's log names the node) and its shapes.
    /// A graph that prepares here may still fail at execute or compute wrong values (see the
    /// module documentation).
    pub fn prepare_unchecked(&self, graph: &Graph) -> Result<Box<dyn ExecutableGraph>> {
        graph.validate()?;
        let mut built = build_all(&self.rt, &[&Described::of(graph, 0)], &|_| Ok(graph.clone()), false, self.profiles.clone())?;
        Ok(Box::new(built.remove(0)))
    }

    /// The cache key of `graph` prepared alone, in a context of its own (library build, SoC and
    /// graph configs).
    pub fn cache_key(&self, graph: &Graph) -> CacheKey {
        self.context_cache_key(&[graph.fingerprint()])
    }

    /// The contexts [`Executor::prepare_all`] would hold `graphs` in (indices): as
    /// [`HtpConfig::contexts`] says, split by layer range within [`HtpConfig::context_budget`].
    /// An [`Error::Input`] names a graph that alone needs more than the budget.
    pub fn plan_contexts(&self, graphs: &[Graph]) -> Result<Vec<Vec<usize>>> {
        let c = &self.rt.config;
        plan(&graphs.iter().map(|g| Member::of(g, c.vtcm_mb)).collect::<Vec<_>>(), c.contexts(), c.context_budget)
    }

    /// Whether a context of `graphs` graphs is created with the HTP's weight sharing: as
    /// configured, where there is another graph to share with.
    fn weight_sharing(&self, graphs: usize) -> bool {
        self.rt.config.weight_sharing && graphs > 1
    }

    /// The cache key of graphs prepared together into one context ([`Executor::prepare_all`]),
    /// given their [`fingerprints`](Graph::fingerprint) in order: those, this executor's salt and
    /// the weight-sharing flag.
    pub fn context_cache_key(&self, fingerprints: &[[u8; 32]]) -> CacheKey {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        for f in fingerprints {
            h.update(f);
        }
        let n = fingerprints.len();
        let salt = format!("{} | one context of {n} graphs, weight sharing {}", self.cache_salt, self.weight_sharing(n));
        CacheKey::new(&h.finalize().into(), &salt)
    }

    /// The graphs of one context (a graph alone, or graphs that share one, see
    /// [`Executor::prepare_all`]): loaded from the cache when there is an intact entry (one
    /// load), else built from their descriptions and stored with their tensor ids (the graph
    /// count, then each graph's). Cache trouble is logged and never fails the prepare. An entry
    /// the library refuses for this device's sake (QNN 1002, the NPU cannot map that much;
    /// 1000, a weight-shared binary on x86) is sound and would be written again byte for byte:
    /// it is kept, and the context is built in every process, with a warning each time.
    fn prepare_context(&self, graphs: &[&Described], describe: &dyn Fn(usize) -> Result<Graph>) -> Result<Vec<HtpGraph>> {
        let build = || self.build_checked(graphs, describe);
        let Some(cache) = &self.cache else { return build() };
        let name = set_name(graphs);
        let key = self.context_cache_key(&graphs.iter().map(|d| d.fingerprint).collect::<Vec<_>>());
        let mut store = true;
        let t = Instant::now();
        if let Some(entry) = lookup(cache, &name, &key) {
            let read = t.elapsed();
            match load_all(&self.rt, self.system.as_ref(), graphs, &entry, self.profiles.clone()) {
                Ok(g) => {
                    tracing::debug!(graphs = %name, bytes = entry.payload.len(), ?read, load = ?(t.elapsed() - read), "context loaded from the cache");
                    cache.mark_used(&name, &key);
                    return Ok(g);
                }
                Err(e @ Error::Prepare { code, .. }) if [QNN_COMMON_ERROR_MEM_ALLOC, QNN_COMMON_ERROR_NOT_SUPPORTED].contains(&(code as u16)) => {
                    tracing::warn!(graphs = %name, error = %e, "this device cannot load the cached context: finalizing it in this process (the entry is kept)");
                    store = false;
                }
                Err(e) => tracing::warn!(graphs = %name, error = %e, "cached context binary does not load: rebuilding it"),
            }
        }
        let built = build()?;
        if store {
            let meta = std::iter::once(graphs.len() as u32).chain(built.iter().flat_map(HtpGraph::meta)).collect();
            write_entry(cache, &name, &key, &built[0].ctx, meta);
        }
        Ok(built)
    }
}

impl HtpExecutor {
    /// [`build_all`], and where a graph's build is checked ([`htp_check`]: LPBQ weights), its
    /// outputs against the HTP numerics model's: a wrong build is logged and the context built
    /// again, at most [`PREPARE_ATTEMPTS`] times.
    fn build_checked(&self, graphs: &[&Described], describe: &dyn Fn(usize) -> Result<Graph>) -> Result<Vec<HtpGraph>> {
        let mut attempt = 1;
        loop {
            let built = build_all(&self.rt, graphs, describe, self.weight_sharing(graphs.len()), self.profiles.clone())?;
            let mut wrong = None;
            for (d, g) in graphs.iter().zip(&built).filter(|(d, _)| d.checked) {
                let gap = htp_check::max_gap(&describe(d.index)?, g)?;
                tracing::debug!(graph = %d.name, gap, attempt, "the library's build against the HTP numerics model");
                if gap > htp_check::WRONG_BEYOND {
                    wrong = Some((d.name.clone(), gap));
                    break;
                }
            }
            let Some((graph, gap)) = wrong else { return Ok(built) };
            if attempt == PREPARE_ATTEMPTS {
                return Err(Error::Prepare {
                    graph,
                    op: "-".into(),
                    shapes: "the prepared graph's check".into(),
                    code: 0,
                    message: format!(
                        "the library prepared it wrongly {PREPARE_ATTEMPTS} times (outputs {gap:.3} of their range from the HTP numerics model's; \
                         a known fault of its prepare with LPBQ weights, see candle_npu::executor::htp_check): load without LPBQ weights"
                    ),
                });
            }
            tracing::warn!(%graph, gap, attempt, "the library prepared this graph wrongly (its outputs are off the HTP numerics model's; a known fault with LPBQ weights): preparing it again");
            attempt += 1;
        }
    }
}

/// How many times a context whose build is checked is built before the prepare fails: a graph
/// with LPBQ weights came back wrong in about one prepare in ten (Qwen2.5-Coder's layers).
const PREPARE_ATTEMPTS: usize = 4;

/// A cache entry that can be tried; misses and unusable files are logged (the caller rebuilds).
fn lookup(cache: &GraphCache, name: &str, key: &CacheKey) -> Option<CachedGraph> {
    match cache.load(name, key) {
        Lookup::Hit(entry) => return Some(entry),
        Lookup::Invalid(why) => tracing::warn!(graph = %name, %why, "prepared-graph cache file unusable: rebuilding it"),
        Lookup::Miss => tracing::debug!(graph = %name, ?key, "prepared-graph cache miss"),
    }
    None
}

/// Writes `ctx`'s binary under `key`; a failure is a warning (the cache only saves time).
fn write_entry(cache: &GraphCache, name: &str, key: &CacheKey, ctx: &Context, meta: Vec<u32>) {
    match ctx.binary(name).and_then(|bin| cache.store(name, key, &meta, &bin)) {
        Ok(path) => tracing::debug!(graph = %name, path = %path.display(), "context binary cached"),
        Err(e) => tracing::warn!(graph = %name, error = %e, "could not write the prepared-graph cache"),
    }
}

// ------------------------------------------------------------------------------------------------
// Profiling.
// ------------------------------------------------------------------------------------------------

/// Per-graph profiles, shared by the executor and its graphs, keyed by graph name.
type Profiles = Arc<Mutex<BTreeMap<String, GraphProfile>>>;

/// A QNN profile handle for one call, freed on drop.
struct Profile<'a> {
    rt: &'a Runtime,
    handle: Qnn_ProfileHandle_t,
}

impl<'a> Profile<'a> {
    /// A fresh profile at the configured level; `None` when profiling is off or the library
    /// refuses (logged: the call then runs unprofiled).
    fn new(rt: &'a Runtime) -> Option<Self> {
        let level = match rt.config.profiling? {
            ProfilingLevel::Basic => QNN_PROFILE_LEVEL_BASIC,
            ProfilingLevel::Detailed => QNN_PROFILE_LEVEL_DETAILED,
        };
        let create = rt.f().profileCreate?;
        let mut handle = null_mut();
        // SAFETY: valid backend and out-pointer.
        let rc = unsafe { create(rt.backend, level, &mut handle) };
        if rc != QNN_SUCCESS {
            tracing::warn!(error = %rt.message(rc), "profileCreate failed: running without profiling");
            return None;
        }
        Some(Profile { rt, handle })
    }

    fn handle(p: &Option<Self>) -> Qnn_ProfileHandle_t {
        p.as_ref().map_or(null_mut(), |p| p.handle)
    }

    /// Every event, sub-events included (their names prefixed with the parent's).
    fn events(&self) -> Vec<(String, u32, u64)> {
        let f = self.rt.f();
        let (Some(get_events), Some(get_sub), Some(get_data)) = (f.profileGetEvents, f.profileGetSubEvents, f.profileGetEventData) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut ids: *const QnnProfile_EventId_t = null();
        let mut n = 0u32;
        // SAFETY: valid profile handle and out-pointers; QNN owns the id array until the profile
        // is freed, which happens after this borrow ends.
        if unsafe { get_events(self.handle, &mut ids, &mut n) } != QNN_SUCCESS || ids.is_null() {
            return out;
        }
        let mut stack: Vec<(QnnProfile_EventId_t, String)> =
            unsafe { std::slice::from_raw_parts(ids, n as usize) }.iter().map(|&id| (id, String::new())).collect();
        stack.reverse();
        while let Some((id, parent)) = stack.pop() {
            let mut data = QnnProfile_EventData_t::default();
            // SAFETY: id comes from this profile; out-pointer valid.
            if unsafe { get_data(id, &mut data) } != QNN_SUCCESS {
                continue;
            }
            let name = if data.identifier.is_null() {
                format!("event type {}", data.type_)
            } else {
                // SAFETY: a NUL-terminated string owned by the profile.
                unsafe { CStr::from_ptr(data.identifier) }.to_string_lossy().into_owned()
            };
            let name = if parent.is_empty() { name } else { format!("{parent} / {name}") };
            let (mut sub, mut m) = (null(), 0u32);
            // SAFETY: as above.
            if unsafe { get_sub(id, &mut sub, &mut m) } == QNN_SUCCESS && !sub.is_null() {
                for &s in unsafe { std::slice::from_raw_parts(sub, m as usize) }.iter().rev() {
                    stack.push((s, name.clone()));
                }
            }
            out.push((name, data.unit, data.value));
        }
        out
    }
}

impl Drop for Profile<'_> {
    fn drop(&mut self) {
        if let Some(free) = self.rt.f().profileFree {
            // SAFETY: created by profileCreate, freed once, after its last use.
            unsafe { free(self.handle) };
        }
    }
}

fn unit_name(unit: u32) -> &'static str {
    match unit {
        QNN_PROFILE_EVENTUNIT_MICROSEC => "us",
        QNN_PROFILE_EVENTUNIT_BYTES => "bytes",
        QNN_PROFILE_EVENTUNIT_CYCLES => "cycles",
        QNN_PROFILE_EVENTUNIT_COUNT => "count",
        _ => "?",
    }
}

/// Adds one call's events to the graph's profile. The call's time is QNN's own top-level
/// "QNN (...) time" event when there is one, else `wall_us`.
fn record(profiles: &Profiles, graph: &str, origin: Origin, phase: &'static str, events: Vec<(String, u32, u64)>, wall_us: u64) {
    let qnn_us = events.iter().find(|(n, u, _)| *u == QNN_PROFILE_EVENTUNIT_MICROSEC && n.starts_with("QNN (") && !n.contains(" / ")).map_or(wall_us, |e| e.2);
    let mut map = profiles.lock().unwrap_or_else(|e| e.into_inner());
    let p = map.entry(graph.to_string()).or_insert_with(|| GraphProfile {
        graph: graph.to_string(),
        origin,
        prepare_us: 0,
        executions: 0,
        execute_us: 0,
        events: Vec::new(),
    });
    if phase == "prepare" {
        p.origin = origin;
        p.prepare_us += qnn_us;
    } else {
        p.executions += 1;
        p.execute_us += qnn_us;
    }
    for (name, unit, value) in events {
        match p.events.iter_mut().find(|e| e.phase == phase && e.name == name) {
            Some(e) => {
                e.value += value;
                e.calls += 1;
            }
            None => p.events.push(ProfileEvent { phase, name, unit: unit_name(unit), value, calls: 1 }),
        }
    }
}

// ------------------------------------------------------------------------------------------------
// The support table (measured; see the module documentation).
// ------------------------------------------------------------------------------------------------

fn is8(d: DType) -> bool {
    matches!(d, DType::U8 | DType::I8)
}

/// Last dimension of a tensor (columns of an FC/MatMul output).
fn cols(t: &TensorSpec) -> usize {
    t.shape.last().copied().unwrap_or(1)
}

fn op_supported(graph: &Graph, op: &Op) -> bool {
    let t = |id: TensorId| graph.tensor(id);
    let shape_ok =
        |s: &TensorSpec| (1..=4).contains(&s.shape.len()) && s.shape.iter().all(|&d| d > 0 && d <= u32::MAX as usize) && s.size_in_bytes() <= u32::MAX as usize;
    if !op.inputs().into_iter().chain([op.output()]).all(|i| shape_ok(t(i))) {
        return false;
    }
    match *op {
        Op::FullyConnected { input, weight, output, .. } => {
            let (x, w, o) = (t(input), t(weight), t(output));
            match (x.dtype, w.dtype, o.dtype) {
                // LPBQ: u8 into u8 or u16 into u16 only (u8 into u16, F32 or SFIXED_POINT_32
                // refused at finalize; qnn-sys' `fc_weight_encodings`).
                (xd, DType::I8, od) if w.block_scales.is_some() => matches!((xd, od), (DType::U8, DType::U8) | (DType::U16, DType::U16)),
                (DType::F32, DType::F32, DType::F32) => true,
                // W8A16 (validated: F32 output, no bias); per-channel weights lowered as for W8A8.
                (DType::U16, DType::I8, DType::F32) => cols(o) >= 32,
                // Per-channel weights: no single accumulator scale for the narrow-output lowering.
                (xd, DType::I8, DType::F32) if is8(xd) && w.channel_scales.is_some() => cols(o) >= 32,
                (xd, DType::I8, DType::U8 | DType::I8 | DType::F32) if is8(xd) => true,
                // SFIXED_POINT_32 output: wrong values past column 32 (see module docs).
                (xd, DType::I8, DType::I32) if is8(xd) => cols(o) <= 32,
                _ => false,
            }
        }
        Op::MatMul { a, b, output, .. } => {
            let (a, b, o) = (t(a), t(b), t(output));
            if is8(a.dtype) && is8(b.dtype) {
                match o.dtype {
                    DType::U8 | DType::I8 => true,
                    DType::F32 => cols(o) >= 32,
                    DType::I32 | DType::U16 => false,
                }
            } else {
                true
            }
        }
        Op::Quantize { output, .. } => is8(t(output).dtype) || t(output).dtype == DType::U16,
        Op::Dequantize { .. } | Op::Add { .. } | Op::Mul { .. } | Op::Sigmoid { .. } | Op::Softmax { .. } => true,
        // Cast to FP16 around it (see the translation).
        Op::RmsNorm { .. } => true,
        Op::Clamp { .. } | Op::Reshape { .. } | Op::Transpose { .. } | Op::Concat { .. } => true,
    }
}

/// What a context needs of a graph besides its weights: its index for `describe`, its name,
/// its fingerprint (for the cache key), its buffers (the tensor ids are set when it is built
/// or retrieved) and whether its build is checked ([`htp_check`]).
struct Described {
    index: usize,
    name: String,
    fingerprint: [u8; 32],
    inputs: Vec<IoTensor>,
    outputs: Vec<IoTensor>,
    checked: bool,
}

impl Described {
    fn of(graph: &Graph, index: usize) -> Self {
        Described {
            index,
            name: graph.name.clone(),
            fingerprint: graph.fingerprint(),
            inputs: io_tensors(graph, &graph.inputs),
            outputs: io_tensors(graph, &graph.outputs),
            checked: htp_check::needs_check(graph),
        }
    }
}

/// The buffers `ids` of `graph`, without QNN tensor ids yet.
fn io_tensors(graph: &Graph, ids: &[TensorId]) -> Vec<IoTensor> {
    ids.iter()
        .map(|&id| {
            let s = graph.tensor(id);
            IoTensor { qnn_id: None, name: s.name.clone(), qnn_name: qnn_tensor_name(id, &s.name), dtype: s.dtype, shape: s.shape.clone(), len: s.elem_count() }
        })
        .collect()
}

/// A validated graph every op of which the support table accepts; otherwise
/// [`Error::Unsupported`] naming the first op that is not.
fn check_supported(graph: &Graph) -> Result<()> {
    graph.validate()?;
    match graph.ops.iter().find(|op| !op_supported(graph, op)) {
        Some(op) => Err(Error::Unsupported { graph: graph.name.clone(), executor: "htp", op: op.name().to_string(), shapes: graph.describe_op(op) }),
        None => Ok(()),
    }
}

impl Executor for HtpExecutor {
    fn name(&self) -> &'static str {
        "htp"
    }

    fn supports(&self, graph: &Graph, op: &Op) -> bool {
        op_supported(graph, op)
    }

    fn numerics(&self) -> super::Numerics {
        super::Numerics::Htp
    }

    fn prepare(&self, graph: &Graph) -> Result<Box<dyn ExecutableGraph>> {
        check_supported(graph)?;
        plan(&[Member::of(graph, self.rt.config.vtcm_mb)], Contexts::PerGraph, self.rt.config.context_budget)?;
        let mut built = self.prepare_context(&[&Described::of(graph, 0)], &|_| Ok(graph.clone()))?;
        Ok(Box::new(built.remove(0)))
    }

    /// In contexts as [`HtpConfig::contexts`] says, each within [`HtpConfig::context_budget`]
    /// (split by layer range where the whole would not be). Each graph is described once to
    /// check it and take its fingerprint, buffers and estimate, then again only to be built (on
    /// a cache miss), one at a time: QNN copies a graph's weights by its graphFinalize.
    fn prepare_all(&self, n: usize, describe: &dyn Fn(usize) -> Result<Graph>) -> Result<Vec<Box<dyn ExecutableGraph>>> {
        let contexts = self.rt.config.contexts();
        if contexts == Contexts::PerGraph {
            return (0..n).map(|i| self.prepare(&describe(i)?)).collect();
        }
        let (mut described, mut members) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for i in 0..n {
            let graph = describe(i)?;
            check_supported(&graph)?;
            described.push(Described::of(&graph, i));
            members.push(Member::of(&graph, self.rt.config.vtcm_mb));
        }
        if described.iter().any(|d| d.checked) {
            // A checked build that is wrong is built again with its whole context: with many
            // graphs in one, one of them would nearly always be wrong (htp_check).
            tracing::info!(
                graphs = n,
                ?contexts,
                "graphs with LPBQ weights each in their own QNN context: the library's prepare of them is checked and redone one graph at a time"
            );
            drop(described);
            return (0..n).map(|i| self.prepare(&describe(i)?)).collect();
        }
        let groups = plan(&members, contexts, self.rt.config.context_budget)?;
        if groups.len() > 1 {
            let mib = |g: &[usize]| g.iter().map(|&i| members[i].need).sum::<u64>() >> 20;
            tracing::info!(
                graphs = n,
                contexts = groups.len(),
                ?contexts,
                budget_mib = self.rt.config.context_budget >> 20,
                largest_mib = groups.iter().map(|g| mib(g)).max(),
                "stage graphs in several QNN contexts"
            );
        }
        let mut out: Vec<Option<Box<dyn ExecutableGraph>>> = (0..n).map(|_| None).collect();
        for group in groups {
            let built: Vec<Box<dyn ExecutableGraph>> = match group[..] {
                [i] => vec![self.prepare(&describe(i)?)?],
                _ => {
                    let members: Vec<&Described> = group.iter().map(|&i| &described[i]).collect();
                    let built = self.prepare_context(&members, describe)?;
                    tracing::debug!(graphs = %set_name(&members), origin = ?built[0].origin, "stage graphs in one QNN context");
                    built.into_iter().map(|g| Box::new(g) as Box<dyn ExecutableGraph>).collect()
                }
            };
            for (i, g) in group.into_iter().zip(built) {
                out[i] = Some(g);
            }
        }
        Ok(out.into_iter().map(|g| g.expect("every graph is in one group")).collect())
    }

    fn profiles(&self) -> Vec<GraphProfile> {
        self.profiles.as_ref().map_or_else(Vec::new, |p| p.lock().unwrap_or_else(|e| e.into_inner()).values().cloned().collect())
    }
}

// ------------------------------------------------------------------------------------------------
// Graph building.
// ------------------------------------------------------------------------------------------------

fn qnn_dtype(d: DType) -> Qnn_DataType_t {
    match d {
        DType::F32 => QNN_DATATYPE_FLOAT_32,
        DType::U8 => QNN_DATATYPE_UFIXED_POINT_8,
        DType::U16 => QNN_DATATYPE_UFIXED_POINT_16,
        DType::I8 => QNN_DATATYPE_SFIXED_POINT_8,
        DType::I32 => QNN_DATATYPE_SFIXED_POINT_32,
    }
}

/// Letters, digits and `_` only: QNN names end up in context binaries and log lines.
/// The name tensor `id` (called `name` in the IR) is created with in a QNN graph: unique within
/// the graph, and what a context binary's metadata gives back.
fn qnn_tensor_name(id: TensorId, name: &str) -> String {
    format!("t{}_{}", id.0, sanitize(name))
}

fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect()
}

/// Owns a context and frees it (with its graphs) on drop; every graph in it holds an `Arc`.
struct Context {
    rt: Arc<Runtime>,
    handle: Qnn_ContextHandle_t,
    /// Executions in this context run one at a time (QNN does not promise that concurrent
    /// graphExecute calls in one context are safe; the HTP runs one graph at a time anyway, and
    /// the scheduler gives the NPU one stage at a time), and never during `contextGetBinary`.
    exec: Mutex<()>,
    /// How many graphs the context holds.
    graphs: usize,
    /// Context binary size, computed on first request.
    binary_size: std::sync::OnceLock<Option<usize>>,
}

// SAFETY: the context handle is opaque and owned by this value; QNN's context calls may come from
// any thread; executions in it (and contextGetBinary) are serialized by `exec`, and
// contextFree runs once, in Drop, after the last graph that held an Arc is gone.
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

impl Context {
    fn new(rt: &Arc<Runtime>, handle: Qnn_ContextHandle_t, graphs: usize, binary_size: Option<usize>) -> Self {
        let size = std::sync::OnceLock::new();
        if let Some(n) = binary_size {
            let _ = size.set(Some(n));
        }
        Context { rt: rt.clone(), handle, exec: Mutex::new(()), graphs, binary_size: size }
    }

    /// The context binary (contextGetBinarySize + contextGetBinary): the compiled graphs with
    /// their weights. `what` names the graphs in errors.
    fn binary(&self, what: &str) -> Result<Vec<u8>> {
        let rt = &self.rt;
        let err = |code: u64, message: String| Error::Execute { graph: what.to_string(), code, message };
        let f = rt.f();
        let (Some(size_of), Some(get)) = (f.contextGetBinarySize, f.contextGetBinary) else {
            return Err(err(0, "library lacks contextGetBinarySize/contextGetBinary".into()));
        };
        let _serial = self.exec.lock().unwrap_or_else(|e| e.into_inner());
        let mut size = 0u64;
        // SAFETY: valid context and out-pointer.
        let rc = unsafe { size_of(self.handle, &mut size) };
        if rc != QNN_SUCCESS {
            return Err(err(error_code(rc) as u64, format!("contextGetBinarySize: {}", rt.message(rc))));
        }
        let mut buf = vec![0u8; size as usize];
        let mut written = 0u64;
        // SAFETY: `buf` has `size` writable bytes; valid out-pointer.
        let rc = unsafe { get(self.handle, buf.as_mut_ptr().cast(), size, &mut written) };
        if rc != QNN_SUCCESS {
            return Err(err(error_code(rc) as u64, format!("contextGetBinary: {}", rt.message(rc))));
        }
        buf.truncate(written as usize);
        let _ = self.binary_size.set(Some(buf.len()));
        Ok(buf)
    }

    /// Creates an empty context for `graphs` graphs, with the HTP's weight sharing if asked.
    fn create(rt: &Arc<Runtime>, graphs: usize, weight_sharing: bool) -> std::result::Result<Self, (u64, String)> {
        let create = rt.f().contextCreate.ok_or((0, "library lacks contextCreate".to_string()))?;
        let mut custom = QnnHtpContext_CustomConfig_t::weight_sharing(true);
        let cfg = QnnContext_Config_t::custom((&mut custom as *mut QnnHtpContext_CustomConfig_t).cast());
        let list: [*const QnnContext_Config_t; 2] = [if weight_sharing { &cfg } else { null() }, null()];
        let mut handle: Qnn_ContextHandle_t = null_mut();
        let mark = log_mark();
        // SAFETY: valid out-pointer; the config list is NULL-terminated and it, and the custom
        // config it points at, live across the call.
        let rc = unsafe { create(rt.backend, rt.device, list.as_ptr(), &mut handle) };
        if rc != QNN_SUCCESS {
            let msg = format!("contextCreate (weight sharing: {weight_sharing}): {}", rt.message(rc));
            return Err((error_code(rc) as u64, with_log(msg, &log_errors_since(mark))));
        }
        Ok(Context::new(rt, handle, graphs, None))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if let Some(free) = self.rt.f().contextFree {
            // SAFETY: created by contextCreate(FromBinary), freed once, after its last graph
            // (every graph holds an Arc of it).
            unsafe { free(self.handle, null_mut()) };
        }
    }
}

/// A failure while adding nodes: QNN error code (0 when not from QNN) and message.
type NodeError = (u64, String);

/// Builds one QNN graph; owns every name and dims array a created tensor points at until
/// finalize.
struct Builder<'a> {
    rt: &'a Runtime,
    graph: &'a Graph,
    handle: Qnn_GraphHandle_t,
    names: Vec<CString>,
    dims: Vec<Box<[u32]>>,
    /// Per-channel scale/offset arrays of AXIS_SCALE_OFFSET tensors.
    axis_scales: Vec<Box<[Qnn_ScaleOffset_t]>>,
    /// Constants the lowering adds (per-channel scale vectors, FP16 norm weights, axis lists),
    /// each a boxed slice whose heap data does not move.
    lowered: Vec<Box<dyn std::any::Any>>,
    /// Created tensors, by IR tensor index.
    tensors: Vec<Option<Qnn_Tensor_t>>,
    /// Per-channel weights lowered to one scale (see `op`), by IR tensor index: created once
    /// however many FullyConnected ops read the weight (a shadow W8A16 input's two parts).
    per_tensor_weights: Vec<Option<Qnn_Tensor_t>>,
    n_native: usize,
}

impl Builder<'_> {
    fn cstr(&mut self, s: String) -> *const c_char {
        let c = CString::new(s).expect("sanitized names have no NUL");
        let p = c.as_ptr();
        self.names.push(c);
        p
    }

    fn create(
        &mut self,
        name: String,
        ty: Qnn_TensorType_t,
        dt: Qnn_DataType_t,
        q: Qnn_QuantizeParams_t,
        shape: &[usize],
        buf: Qnn_ClientBuffer_t,
    ) -> std::result::Result<Qnn_Tensor_t, NodeError> {
        let name_ptr = self.cstr(name.clone());
        let mut dims: Box<[u32]> = shape.iter().map(|&d| d as u32).collect();
        let dims_ptr = dims.as_mut_ptr();
        self.dims.push(dims);
        let mut t = Qnn_Tensor_t::v1(name_ptr, ty, dt, q, shape.len() as u32, dims_ptr, buf);
        let create = self.rt.f().tensorCreateGraphTensor.ok_or((0, "library lacks tensorCreateGraphTensor".to_string()))?;
        let mark = log_mark();
        // SAFETY: `t` and everything it points at (name, dims, static data) are alive.
        let rc = unsafe { create(self.handle, &mut t) };
        if rc != QNN_SUCCESS {
            let msg = format!("tensorCreateGraphTensor '{name}': {}", self.rt.message(rc));
            return Err((error_code(rc) as u64, with_log(msg, &log_errors_since(mark))));
        }
        Ok(t)
    }

    /// The QNN tensor of IR tensor `id`, created on first use.
    fn ir(&mut self, id: TensorId) -> std::result::Result<Qnn_Tensor_t, NodeError> {
        if let Some(t) = self.tensors[id.0] {
            return Ok(t);
        }
        let g = self.graph;
        let spec = g.tensor(id);
        let ty = if g.inputs.contains(&id) {
            QNN_TENSOR_TYPE_APP_WRITE
        } else if g.outputs.contains(&id) {
            QNN_TENSOR_TYPE_APP_READ
        } else {
            match spec.kind {
                TensorKind::Input => QNN_TENSOR_TYPE_APP_WRITE,
                TensorKind::Output => QNN_TENSOR_TYPE_APP_READ,
                TensorKind::Intermediate => QNN_TENSOR_TYPE_NATIVE,
                TensorKind::Static => QNN_TENSOR_TYPE_STATIC,
            }
        };
        let q = match (&spec.channel_scales, spec.quant) {
            // Per-channel weights `[N, K]`: one symmetric scale per output channel, axis 0; LPBQ
            // adds a 4-bit scale per block of K (BLOCKWISE_EXPANSION).
            (Some(scales), _) => {
                let mut so: Box<[Qnn_ScaleOffset_t]> = scales.iter().map(|&scale| Qnn_ScaleOffset_t { scale, offset: 0 }).collect();
                let q = match &spec.block_scales {
                    None => Qnn_QuantizeParams_t::axis_scale_offset(0, &mut so),
                    Some(b) => {
                        let mut block_scales: Box<[u8]> = b.scales.clone().into_boxed_slice();
                        let mut be = Box::new(Qnn_BlockwiseExpansion_t {
                            axis: 0,
                            scaleOffsets: so.as_mut_ptr(),
                            numBlocksPerAxis: (spec.shape[1] / b.block) as u32,
                            blockScaleBitwidth: 4,
                            blockScaleStorageType: QNN_BLOCKWISE_EXPANSION_BITWIDTH_SCALE_STORAGE_8,
                            blocksScale: block_scales.as_mut_ptr().cast(),
                        });
                        let q = Qnn_QuantizeParams_t::blockwise_expansion(&mut be);
                        self.lowered.push(Box::new(block_scales));
                        self.lowered.push(be);
                        q
                    }
                };
                // Boxes keep their heap data in place when moved: the pointers stay valid until
                // the graph is finalized.
                self.axis_scales.push(so);
                q
            }
            (None, Some(q)) if spec.dtype.is_quantized() => Qnn_QuantizeParams_t::scale_offset(q.scale, q.offset),
            _ => Qnn_QuantizeParams_t::undefined(),
        };
        // QNN only reads static data, and has copied it by the end of graphFinalize (checked:
        // overwriting the weights after finalize does not change outputs); `self.graph` is
        // borrowed until then.
        let buf = match &spec.data {
            Some(StaticData::F32(v)) => Qnn_ClientBuffer_t { data: v.as_ptr() as *mut c_void, dataSize: (v.len() * 4) as u32 },
            // LPBQ weights are given as their 4-bit values (8-bit containers): each INT8 value
            // over its block scale (exact: validated).
            Some(StaticData::I8(v)) if spec.block_scales.is_some() => {
                let (b, k) = (spec.block_scales.as_ref().expect("matched"), spec.shape[1]);
                let values: Box<[i8]> = v.iter().enumerate().map(|(i, &q)| q / b.of(i, k) as i8).collect();
                let buf = Qnn_ClientBuffer_t { data: values.as_ptr() as *mut c_void, dataSize: values.len() as u32 };
                self.lowered.push(Box::new(values));
                buf
            }
            Some(StaticData::I8(v)) => Qnn_ClientBuffer_t { data: v.as_ptr() as *mut c_void, dataSize: v.len() as u32 },
            Some(StaticData::I32(v)) => Qnn_ClientBuffer_t { data: v.as_ptr() as *mut c_void, dataSize: (v.len() * 4) as u32 },
            None => Qnn_ClientBuffer_t::empty(),
        };
        let t = self.create(qnn_tensor_name(id, &spec.name), ty, qnn_dtype(spec.dtype), q, &spec.shape, buf)?;
        self.tensors[id.0] = Some(t);
        Ok(t)
    }

    /// A STATIC tensor the lowering adds, holding `data` (kept until finalize).
    fn lowered_constant<T: Copy + 'static>(
        &mut self,
        name: String,
        dt: Qnn_DataType_t,
        shape: &[usize],
        data: Box<[T]>,
    ) -> std::result::Result<Qnn_Tensor_t, NodeError> {
        let buf = Qnn_ClientBuffer_t { data: data.as_ptr() as *mut c_void, dataSize: std::mem::size_of_val(&*data) as u32 };
        self.lowered.push(Box::new(data)); // moves the box, not its heap data: the pointer stays valid
        self.create(name, QNN_TENSOR_TYPE_STATIC, dt, Qnn_QuantizeParams_t::undefined(), shape, buf)
    }

    /// A NATIVE tensor the lowering adds.
    fn native(&mut self, base: &str, dt: Qnn_DataType_t, q: Qnn_QuantizeParams_t, shape: &[usize]) -> std::result::Result<Qnn_Tensor_t, NodeError> {
        self.n_native += 1;
        let name = format!("x{}_{}", self.n_native, base);
        self.create(name, QNN_TENSOR_TYPE_NATIVE, dt, q, shape, Qnn_ClientBuffer_t::empty())
    }

    /// Adds one node. `name` must start with `op{index}_` (see [`culprit`]).
    fn node(
        &mut self,
        name: String,
        type_name: &CStr,
        params: &mut [Qnn_Param_t],
        inputs: &mut [Qnn_Tensor_t],
        outputs: &mut [Qnn_Tensor_t],
    ) -> std::result::Result<(), NodeError> {
        let name_ptr = self.cstr(name);
        let op = Qnn_OpConfig_t::v1(name_ptr, QNN_OP_PACKAGE_NAME_QTI_AISW.as_ptr(), type_name.as_ptr(), params, inputs, outputs);
        let add = self.rt.f().graphAddNode.ok_or((0, "library lacks graphAddNode".to_string()))?;
        let mark = log_mark();
        // SAFETY: every pointer in `op` (names, params, tensors and what they point at) is alive.
        let rc = unsafe { add(self.handle, op) };
        if rc != QNN_SUCCESS {
            let msg = format!("graphAddNode: {}", self.rt.message(rc));
            return Err((error_code(rc) as u64, with_log(msg, &log_errors_since(mark))));
        }
        Ok(())
    }

    /// Adds the QNN node(s) of IR op number `i`.
    fn op(&mut self, i: usize, op: &Op) -> std::result::Result<(), NodeError> {
        let g = self.graph;
        let out_spec = g.tensor(op.output());
        let base = format!("op{i}_{}", sanitize(&out_spec.name));
        let mut out = [self.ir(op.output())?];
        match *op {
            Op::FullyConnected { input, weight, bias, .. } => {
                let (x, w) = (g.tensor(input), g.tensor(weight));
                if let (Some(scales), DType::F32) = (&w.channel_scales, out_spec.dtype) {
                    // Lowering: per-channel weights with an F32 output fail at finalize (1002).
                    // The same INT8 weights under one scale s0 = min(s_n), F32 output, then
                    // ElementWiseMultiply by the [N] vector s_n / s0 (FP16 on HTP: one rounding
                    // of 2^-11). With s0 the smallest scale the intermediate never exceeds the
                    // real output, so FP16 cannot overflow where the result would not.
                    let s0 = scales.iter().fold(f32::INFINITY, |m, &s| m.min(s));
                    let wdata = match &w.data {
                        Some(StaticData::I8(v)) => Qnn_ClientBuffer_t { data: v.as_ptr() as *mut c_void, dataSize: v.len() as u32 },
                        _ => return Err((0, "per-channel weight without I8 data (validated)".into())),
                    };
                    let wt = match self.per_tensor_weights[weight.0] {
                        Some(t) => t,
                        None => {
                            let t = self.create(
                                format!("t{}_{}_pt", weight.0, sanitize(&w.name)),
                                QNN_TENSOR_TYPE_STATIC,
                                QNN_DATATYPE_SFIXED_POINT_8,
                                Qnn_QuantizeParams_t::scale_offset(s0, 0),
                                &w.shape,
                                wdata,
                            )?;
                            *self.per_tensor_weights.get_mut(weight.0).expect("an IR id") = Some(t);
                            t
                        }
                    };
                    let mut ins = [self.ir(input)?, wt]; // validated: no bias with per-channel weights
                    let ratio: Box<[f32]> = scales.iter().map(|&s| s / s0).collect();
                    let rt = self.lowered_constant(format!("{base}_scales"), QNN_DATATYPE_FLOAT_32, &[w.shape[0]], ratio)?;
                    let mut acc = [self.native(&format!("{base}_unscaled"), QNN_DATATYPE_FLOAT_32, Qnn_QuantizeParams_t::undefined(), &out_spec.shape)?];
                    self.node(base.clone(), QNN_OP_FULLY_CONNECTED, &mut [], &mut ins, &mut acc)?;
                    return self.node(format!("{base}_channel_scales"), QNN_OP_ELEMENT_WISE_MULTIPLY, &mut [], &mut [acc[0], rt], &mut out);
                }
                let mut ins = vec![self.ir(input)?, self.ir(weight)?];
                if let Some(bias) = bias {
                    ins.push(self.ir(bias)?);
                }
                if out_spec.dtype == DType::F32 && w.dtype == DType::I8 && cols(out_spec) < 32 {
                    // Lowering: a FLOAT_32 output narrower than 32 columns fails at execute
                    // (1100); the SFIXED_POINT_32 accumulator + Dequantize is exact there.
                    let scale = x.quant.expect("validated").scale * w.quant.expect("validated").scale;
                    let acc_q = Qnn_QuantizeParams_t::scale_offset(scale, 0);
                    let mut acc = [self.native(&format!("{base}_acc"), QNN_DATATYPE_SFIXED_POINT_32, acc_q, &out_spec.shape)?];
                    self.node(base.clone(), QNN_OP_FULLY_CONNECTED, &mut [], &mut ins, &mut acc)?;
                    self.node(format!("{base}_dequantize"), QNN_OP_DEQUANTIZE, &mut [], &mut acc, &mut out)
                } else {
                    self.node(base, QNN_OP_FULLY_CONNECTED, &mut [], &mut ins, &mut out)
                }
            }
            Op::MatMul { a, b, transpose_b, .. } => {
                let mut ins = [self.ir(a)?, self.ir(b)?];
                let mut params = [
                    Qnn_Param_t::scalar(QNN_OP_MAT_MUL_PARAM_TRANSPOSE_IN0.as_ptr(), Qnn_Scalar_t::bool8(false)),
                    Qnn_Param_t::scalar(QNN_OP_MAT_MUL_PARAM_TRANSPOSE_IN1.as_ptr(), Qnn_Scalar_t::bool8(transpose_b)),
                ];
                self.node(base, QNN_OP_MAT_MUL, &mut params, &mut ins, &mut out)
            }
            Op::Quantize { input, .. } | Op::Dequantize { input, .. } | Op::Sigmoid { input, .. } => {
                let ty = match op {
                    Op::Quantize { .. } => QNN_OP_QUANTIZE,
                    Op::Dequantize { .. } => QNN_OP_DEQUANTIZE,
                    _ => QNN_OP_SIGMOID,
                };
                let mut ins = [self.ir(input)?];
                self.node(base, ty, &mut [], &mut ins, &mut out)
            }
            Op::Softmax { input, .. } => {
                let axis = out_spec.shape.len() as u32 - 1;
                let mut params = [
                    Qnn_Param_t::scalar(QNN_OP_PARAM_AXIS.as_ptr(), Qnn_Scalar_t::u32(axis)),
                    Qnn_Param_t::scalar(QNN_OP_SOFTMAX_PARAM_BETA.as_ptr(), Qnn_Scalar_t::f32(1.0)),
                ];
                let mut ins = [self.ir(input)?];
                self.node(base, QNN_OP_SOFTMAX, &mut params, &mut ins, &mut out)
            }
            Op::Add { a, b, .. } | Op::Mul { a, b, .. } => {
                // QNN's elementwise ops broadcast as numpy does, as the IR's.
                let ty = if matches!(op, Op::Add { .. }) { QNN_OP_ELEMENT_WISE_ADD } else { QNN_OP_ELEMENT_WISE_MULTIPLY };
                let mut ins = [self.ir(a)?, self.ir(b)?];
                self.node(base, ty, &mut [], &mut ins, &mut out)
            }
            Op::RmsNorm { input, gamma, epsilon, .. } => {
                // Lowering: RmsNorm runs on FLOAT_16 only (FLOAT_32 fails at finalize; Convert
                // FP32 <-> FP16 too): Cast in, the norm with an FP16 weight, Cast out.
                let shape = &out_spec.shape;
                let w: Box<[u16]> = match &g.tensor(gamma).data {
                    Some(StaticData::F32(v)) => v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect(),
                    _ => return Err((0, "RmsNorm weight without F32 data (validated)".into())),
                };
                let w = self.lowered_constant(format!("{base}_weight_fp16"), QNN_DATATYPE_FLOAT_16, &[w.len()], w)?;
                let axes = self.lowered_constant(format!("{base}_axes"), QNN_DATATYPE_UINT_32, &[1], Box::new([shape.len() as u32 - 1]) as Box<[u32]>)?;
                let mut x16 = [self.native(&format!("{base}_in_fp16"), QNN_DATATYPE_FLOAT_16, Qnn_QuantizeParams_t::undefined(), shape)?];
                let mut y16 = [self.native(&format!("{base}_fp16"), QNN_DATATYPE_FLOAT_16, Qnn_QuantizeParams_t::undefined(), shape)?];
                let mut x = [self.ir(input)?];
                self.node(format!("{base}_cast_in"), QNN_OP_CAST, &mut [], &mut x, &mut x16)?;
                let mut params = [
                    Qnn_Param_t::scalar(QNN_OP_RMS_NORM_PARAM_EPSILON.as_ptr(), Qnn_Scalar_t::f32(epsilon)),
                    Qnn_Param_t::tensor(QNN_OP_RMS_NORM_PARAM_AXES.as_ptr(), axes),
                ];
                self.node(base.clone(), QNN_OP_RMS_NORM, &mut params, &mut [x16[0], w], &mut y16)?;
                self.node(format!("{base}_cast_out"), QNN_OP_CAST, &mut [], &mut y16, &mut out)
            }
            Op::Reshape { input, .. } => {
                let mut ins = [self.ir(input)?];
                self.node(base, QNN_OP_RESHAPE, &mut [], &mut ins, &mut out)
            }
            Op::Clamp { input, lo, hi, .. } => {
                let mut params = [
                    Qnn_Param_t::scalar(QNN_OP_RELU_MIN_MAX_PARAM_MIN_VALUE.as_ptr(), Qnn_Scalar_t::f32(lo)),
                    Qnn_Param_t::scalar(QNN_OP_RELU_MIN_MAX_PARAM_MAX_VALUE.as_ptr(), Qnn_Scalar_t::f32(hi)),
                ];
                let mut ins = [self.ir(input)?];
                self.node(base, QNN_OP_RELU_MIN_MAX, &mut params, &mut ins, &mut out)
            }
            Op::Transpose { input, ref perm, .. } => {
                let p: Box<[u32]> = perm.iter().map(|&a| a as u32).collect();
                let perm = self.lowered_constant(format!("{base}_perm"), QNN_DATATYPE_UINT_32, &[p.len()], p)?;
                let mut params = [Qnn_Param_t::tensor(QNN_OP_TRANSPOSE_PARAM_PERM.as_ptr(), perm)];
                let mut ins = [self.ir(input)?];
                self.node(base, QNN_OP_TRANSPOSE, &mut params, &mut ins, &mut out)
            }
            Op::Concat { a, b, axis, .. } => {
                let mut params = [Qnn_Param_t::scalar(QNN_OP_PARAM_AXIS.as_ptr(), Qnn_Scalar_t::u32(axis as u32))];
                let mut ins = [self.ir(a)?, self.ir(b)?];
                self.node(base, QNN_OP_CONCAT, &mut params, &mut ins, &mut out)
            }
        }
    }
}

/// The IR op whose node QNN's log names (`"op{index}_..."`), if any. Best effort: the log ring
/// is process-wide, so a concurrent failing prepare could contribute lines.
fn culprit<'g>(graph: &'g Graph, log: &[String]) -> Option<&'g Op> {
    log.iter().rev().find_map(|line| {
        line.match_indices("\"op").find_map(|(at, _)| {
            let digits: String = line[at + 3..].chars().take_while(|c| c.is_ascii_digit()).collect();
            let i: usize = digits.parse().ok()?;
            line[at + 3 + digits.len()..].starts_with('_').then(|| graph.ops.get(i)).flatten()
        })
    })
}

/// Translates and finalizes `graphs` in a new context (with the HTP's weight sharing if asked),
/// one after another, each described just before: QNN copies a graph's weights by its
/// graphFinalize, so one description is alive at a time.
fn build_all(
    rt: &Arc<Runtime>,
    graphs: &[&Described],
    describe: &dyn Fn(usize) -> Result<Graph>,
    weight_sharing: bool,
    profiles: Option<Profiles>,
) -> Result<Vec<HtpGraph>> {
    check_unique_names(graphs)?;
    let ctx = Context::create(rt, graphs.len(), weight_sharing).map_err(|(code, message)| Error::Prepare {
        graph: set_name(graphs),
        op: "-".into(),
        shapes: "contextCreate".into(),
        code,
        message,
    })?;
    let ctx = Arc::new(ctx);
    graphs
        .iter()
        .map(|d| {
            let graph = describe(d.index)?;
            if graph.name != d.name {
                return Err(Error::Internal(format!("graph {} described as '{}' the second time", d.name, graph.name)));
            }
            add_graph(&ctx, &graph, profiles.clone())
        })
        .collect()
}

/// The name of a set of graphs in logs and cache file names: its first graph's, and how many
/// others.
fn set_name(graphs: &[&Described]) -> String {
    match graphs {
        [] => "no graphs".into(),
        [g] => g.name.clone(),
        [g, rest @ ..] => format!("{}+{}", g.name, rest.len()),
    }
}

/// Graphs of one context are told apart by their QNN names (graphRetrieve; two equal ones in a
/// context are QNN error 6003): [`sanitize`] must keep them apart.
fn check_unique_names(graphs: &[&Described]) -> Result<()> {
    let mut seen = std::collections::HashMap::new();
    for g in graphs {
        if let Some(other) = seen.insert(sanitize(&g.name), &g.name) {
            return Err(Error::Prepare {
                graph: g.name.clone(),
                op: "-".into(),
                shapes: "context".into(),
                code: 0,
                message: format!("graphs '{other}' and '{}' have one QNN name, '{}': they cannot share a context", g.name, sanitize(&g.name)),
            });
        }
    }
    Ok(())
}

/// Translates and finalizes `graph` in `ctx`.
fn add_graph(ctx: &Arc<Context>, graph: &Graph, profiles: Option<Profiles>) -> Result<HtpGraph> {
    let rt = &ctx.rt;
    let mut inputs = io_tensors(graph, &graph.inputs);
    let mut outputs = io_tensors(graph, &graph.outputs);

    let f = *rt.f();
    let err = |op: &str, shapes: String, code: u64, message: String| Error::Prepare { graph: graph.name.clone(), op: op.to_string(), shapes, code, message };
    let (Some(graph_create), Some(finalize)) = (f.graphCreate, f.graphFinalize) else {
        return Err(err("-", String::new(), 0, "library lacks graphCreate/graphFinalize".into()));
    };

    // HTP graph custom configs.
    let mut customs: Vec<QnnHtpGraph_CustomConfig_t> = Vec::new();
    if let Some(level) = rt.config.optimization_level {
        customs.push(QnnHtpGraph_CustomConfig_t::finalize_optimization(level as f32));
    }
    if let Some(mb) = rt.config.vtcm_mb {
        customs.push(QnnHtpGraph_CustomConfig_t::vtcm_size_in_mb(mb));
    }
    if graph.tensors.iter().any(|t| t.dtype == DType::F32) {
        // Float compute on HTP is FP16; say so instead of relying on the library's default.
        customs.push(QnnHtpGraph_CustomConfig_t::precision(QNN_PRECISION_FLOAT16));
    }
    let configs: Vec<QnnGraph_Config_t> = customs.iter_mut().map(|c| QnnGraph_Config_t::custom((c as *mut QnnHtpGraph_CustomConfig_t).cast())).collect();
    let config_list: Vec<*const QnnGraph_Config_t> = configs.iter().map(|c| c as *const _).chain([null()]).collect();

    let graph_name = CString::new(sanitize(&graph.name)).expect("sanitized");
    let mut handle: Qnn_GraphHandle_t = null_mut();
    let mark = log_mark();
    // SAFETY: name, configs (and the custom configs they point at) and out-pointer are alive.
    let rc = unsafe { graph_create(ctx.handle, graph_name.as_ptr(), config_list.as_ptr(), &mut handle) };
    if rc != QNN_SUCCESS {
        let msg = with_log(format!("graphCreate: {}", rt.message(rc)), &log_errors_since(mark));
        return Err(err("-", "graphCreate".into(), error_code(rc) as u64, msg));
    }

    let mut b = Builder {
        rt,
        graph,
        handle,
        names: Vec::new(),
        dims: Vec::new(),
        axis_scales: Vec::new(),
        lowered: Vec::new(),
        tensors: vec![None; graph.tensors.len()],
        per_tensor_weights: vec![None; graph.tensors.len()],
        n_native: 0,
    };
    for (i, op) in graph.ops.iter().enumerate() {
        b.op(i, op).map_err(|(code, message)| err(op.name(), graph.describe_op(op), code, message))?;
    }

    let mark = log_mark();
    let profile = Profile::new(rt);
    let t = Instant::now();
    // SAFETY: valid graph handle and profile (or NULL); NULL signal.
    let rc = unsafe { finalize(handle, Profile::handle(&profile), null_mut()) };
    let wall_us = t.elapsed().as_micros() as u64;
    if rc != QNN_SUCCESS {
        let log = log_errors_since(mark);
        let (op, shapes) = match culprit(graph, &log) {
            Some(op) => (op.name().to_string(), graph.describe_op(op)),
            // The log did not name a node: name every op.
            None => (
                graph.ops.iter().map(Op::name).collect::<Vec<_>>().join("+"),
                graph.ops.iter().map(|o| format!("[{}]", graph.describe_op(o))).collect::<Vec<_>>().join("; "),
            ),
        };
        let message = with_log(format!("graphFinalize: {}", rt.message(rc)), &log);
        return Err(err(&op, shapes, error_code(rc) as u64, message));
    }

    for (t, id) in inputs.iter_mut().zip(&graph.inputs) {
        // None: an input no op reads; its buffer is checked but not passed.
        t.qnn_id = b.tensors[id.0].map(|t| t.id());
    }
    for (t, id) in outputs.iter_mut().zip(&graph.outputs) {
        t.qnn_id = b.tensors[id.0].map(|t| t.id());
        if t.qnn_id.is_none() {
            return Err(err("-", t.name.clone(), 0, format!("graph output '{}' is not produced by any op", t.name)));
        }
    }
    if let (Some(p), Some(profile)) = (&profiles, &profile) {
        record(p, &graph.name, Origin::Compiled, "prepare", profile.events(), wall_us);
    }
    drop(profile);
    Ok(HtpGraph::new(&graph.name, handle, ctx.clone(), inputs, outputs, Origin::Compiled, profiles))
}

/// Recreates `graphs` from the cached context binary that holds them: one
/// contextCreateFromBinary, a graphRetrieve per graph. The entry's side table is the graph
/// count, then each graph's input and output tensor ids in order; with the System library, it
/// is checked against the binary's own ids first.
fn load_all(
    rt: &Arc<Runtime>,
    system: Option<&QnnSystemLibrary>,
    graphs: &[&Described],
    entry: &CachedGraph,
    profiles: Option<Profiles>,
) -> Result<Vec<HtpGraph>> {
    let name = set_name(graphs);
    let want = 1 + graphs.iter().map(|g| g.inputs.len() + g.outputs.len()).sum::<usize>();
    if entry.meta.first() != Some(&(graphs.len() as u32)) || entry.meta.len() != want {
        return Err(load_error(&name, 0, format!("cache entry's table ({} ids) is not that of these {} graphs ({want})", entry.meta.len(), graphs.len())));
    }
    check_unique_names(graphs)?;
    if let Some(system) = system {
        check_ids(system, graphs, entry).map_err(|why| load_error(&name, 0, format!("cache entry's tensor ids: {why}")))?;
    }
    let ctx = load_context(rt, &entry.payload, graphs.len(), &name, profiles.as_ref())?;
    let mut at = 1;
    graphs
        .iter()
        .map(|g| {
            let n = g.inputs.len() + g.outputs.len();
            at += n;
            retrieve(&ctx, g, &entry.meta[at - n..at], profiles.clone())
        })
        .collect()
}

/// Whether the entry's side table binds each of `graphs`' inputs and outputs to the tensor of
/// that name in the binary (as the System library reads it). The checksum proves the table is
/// the one written, not that it is right: a table edited and re-hashed would otherwise bind,
/// say, a layer's K output to its V buffer without any error.
fn check_ids(system: &QnnSystemLibrary, graphs: &[&Described], entry: &CachedGraph) -> std::result::Result<(), String> {
    // A binary the System library cannot read (another version's layout, or one it refuses)
    // is the HTP library's to load or refuse: its ids are trusted, said once per context.
    let io = match system.graph_io(&entry.payload) {
        Ok(io) => io,
        Err(e) => {
            tracing::warn!(error = %e, "cannot check a cached context's tensor ids: trusting them");
            return Ok(());
        }
    };
    let mut at = 1;
    for g in graphs {
        let qnn_name = sanitize(&g.name);
        let found = io.iter().find(|x| x.name == qnn_name).ok_or_else(|| format!("the binary has no graph {qnn_name}"))?;
        for (tensors, held, what) in [(&g.inputs, &found.inputs, "input"), (&g.outputs, &found.outputs, "output")] {
            for t in tensors.iter() {
                let id = entry.meta[at];
                at += 1;
                if id == NO_TENSOR {
                    continue;
                }
                let name = held.iter().find(|(i, _)| *i == id).map(|(_, n)| n.as_str());
                if name != Some(t.qnn_name.as_str()) {
                    let held = name.map_or_else(|| format!("no {what} of the graph"), |n| format!("tensor {n}"));
                    return Err(format!("{what} {} of graph {} is bound to id {id}, which is {held} in the binary", t.qnn_name, g.name));
                }
            }
        }
    }
    Ok(())
}

fn load_error(graph: &str, code: u64, message: String) -> Error {
    Error::Prepare { graph: graph.to_string(), op: "-".into(), shapes: "context binary".into(), code, message }
}

/// contextCreateFromBinary of `payload`, a context of `graphs` graphs; its profile is recorded
/// under `what` (a load is of the whole context).
fn load_context(rt: &Arc<Runtime>, payload: &[u8], graphs: usize, what: &str, profiles: Option<&Profiles>) -> Result<Arc<Context>> {
    let create = rt.f().contextCreateFromBinary.ok_or_else(|| load_error(what, 0, "library lacks contextCreateFromBinary".into()))?;
    let profile = Profile::new(rt);
    let t = Instant::now();
    let mark = log_mark();
    let mut handle: Qnn_ContextHandle_t = null_mut();
    // SAFETY: the payload outlives the call (QNN copies what it keeps); valid out-pointer.
    let rc = unsafe { create(rt.backend, rt.device, null(), payload.as_ptr().cast(), payload.len() as u64, &mut handle, Profile::handle(&profile)) };
    if rc != QNN_SUCCESS {
        let msg = with_log(format!("contextCreateFromBinary: {}", rt.message(rc)), &log_errors_since(mark));
        return Err(load_error(what, error_code(rc) as u64, msg));
    }
    let ctx = Arc::new(Context::new(rt, handle, graphs, Some(payload.len())));
    if let (Some(p), Some(profile)) = (profiles, &profile) {
        record(p, what, Origin::Loaded, "prepare", profile.events(), t.elapsed().as_micros() as u64);
    }
    Ok(ctx)
}

/// graphRetrieve of `graph` from a loaded context, bound to the tensor ids `ids` (its inputs',
/// then its outputs', as the cache entry recorded them).
fn retrieve(ctx: &Arc<Context>, graph: &Described, ids: &[u32], profiles: Option<Profiles>) -> Result<HtpGraph> {
    let rt = &ctx.rt;
    let err = |code, message| load_error(&graph.name, code, message);
    let retrieve = rt.f().graphRetrieve.ok_or_else(|| err(0, "library lacks graphRetrieve".into()))?;
    let name = CString::new(sanitize(&graph.name)).expect("sanitized");
    let mut handle: Qnn_GraphHandle_t = null_mut();
    let mark = log_mark();
    // SAFETY: valid context, name and out-pointer.
    let rc = unsafe { retrieve(ctx.handle, name.as_ptr(), &mut handle) };
    if rc != QNN_SUCCESS {
        let msg = with_log(format!("graphRetrieve '{}': {}", name.to_string_lossy(), rt.message(rc)), &log_errors_since(mark));
        return Err(err(error_code(rc) as u64, msg));
    }
    let bind = |tensors: &[IoTensor], qnn: &[u32]| -> Vec<IoTensor> {
        tensors.iter().zip(qnn).map(|(t, &q)| IoTensor { qnn_id: (q != NO_TENSOR).then_some(q), ..t.clone() }).collect()
    };
    let n_in = graph.inputs.len();
    let inputs = bind(&graph.inputs, &ids[..n_in]);
    let outputs = bind(&graph.outputs, &ids[n_in..]);
    if let Some(t) = outputs.iter().find(|t| t.qnn_id.is_none()) {
        return Err(err(0, format!("cache entry has no tensor id for output '{}'", t.name)));
    }
    Ok(HtpGraph::new(&graph.name, handle, ctx.clone(), inputs, outputs, Origin::Loaded, profiles))
}

/// Cache-entry id of an input no op reads (it has no QNN tensor).
const NO_TENSOR: u32 = u32::MAX;

#[derive(Clone)]
struct IoTensor {
    /// QNN tensor id; `None` for an input no op reads.
    qnn_id: Option<u32>,
    name: String,
    /// Its name in the QNN graph ([`qnn_tensor_name`]).
    qnn_name: String,
    dtype: DType,
    shape: Vec<usize>,
    len: usize,
}

/// Graph inputs and outputs in shared rpcmem buffers registered with the graph's context (on a
/// phone with `libcdsprpc.so`; see [`super::rpcmem`]): the DSP maps them once instead of FastRPC
/// copying client buffers on every execute. Indexed like the graph's inputs, then outputs;
/// `None` for an input no op reads.
struct SharedIo {
    rt: Arc<Runtime>,
    bufs: Vec<Option<(SharedBuffer, Qnn_MemHandle_t)>>,
}

impl SharedIo {
    /// `None` (client buffers) when `libcdsprpc.so` is absent, as on x86; a failed allocation
    /// or registration is logged and also gives `None`.
    fn new(rt: &Arc<Runtime>, ctx: Qnn_ContextHandle_t, graph: &str, io: &[&IoTensor]) -> Option<Self> {
        let mem = RpcMem::load()?;
        let mut shared = SharedIo { rt: rt.clone(), bufs: Vec::with_capacity(io.len()) };
        for t in io {
            if t.qnn_id.is_none() {
                shared.bufs.push(None);
                continue;
            }
            let shape: Vec<u32> = t.shape.iter().map(|&d| d as u32).collect();
            let registered = SharedBuffer::alloc(mem.clone(), t.len * t.dtype.size_in_bytes())
                .map_err(|e| (0, e))
                .and_then(|buf| rpcmem::register(rt.f(), ctx, &buf, qnn_dtype(t.dtype), &shape).map(|h| (buf, h)));
            match registered {
                Ok(pair) => shared.bufs.push(Some(pair)),
                Err((code, msg)) => {
                    let msg = if code == 0 { msg } else { format!("{msg}: {}", rt.message(code as Qnn_ErrorHandle_t)) };
                    tracing::warn!(graph, tensor = %t.name, error = %msg, "shared rpcmem buffer unavailable: this graph uses client buffers");
                    return None; // Drop deregisters what was registered.
                }
            }
        }
        Some(shared)
    }
}

impl Drop for SharedIo {
    fn drop(&mut self) {
        for (_, handle) in self.bufs.iter().flatten() {
            if let Err((_, msg)) = rpcmem::deregister(self.rt.f(), *handle) {
                tracing::warn!(error = %msg, "memDeRegister failed");
            }
        }
        // The buffers are freed (rpcmem_free) after this, when `bufs` drops.
    }
}

/// The bytes of a tensor buffer.
fn bytes_of(d: &TensorData) -> &[u8] {
    let b = input_buffer(d);
    // SAFETY: `input_buffer` describes exactly `d`'s allocation, which is borrowed for the
    // lifetime of the returned slice; every bit pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(b.data as *const u8, b.dataSize as usize) }
}

/// The bytes of a tensor buffer, writable.
fn bytes_of_mut(d: &mut TensorData) -> &mut [u8] {
    let b = output_buffer(d);
    // SAFETY: as in `bytes_of`, from an exclusive borrow; any bytes are a valid f32/i32/u8/i8.
    unsafe { std::slice::from_raw_parts_mut(b.data as *mut u8, b.dataSize as usize) }
}

/// A finalized graph, in a context of its own or shared with the graphs prepared beside it.
struct HtpGraph {
    name: String,
    handle: Qnn_GraphHandle_t,
    /// Guards the shared buffers, which every execution reuses. Declared before `ctx`:
    /// deregistered before the context can be freed.
    exec_lock: Mutex<Option<SharedIo>>,
    /// Freed, with its graphs, when its last graph goes.
    ctx: Arc<Context>,
    inputs: Vec<IoTensor>,
    outputs: Vec<IoTensor>,
    origin: Origin,
    profiles: Option<Profiles>,
}

impl HtpGraph {
    /// Binds a finalized or loaded graph; sets up shared buffers where the platform has them.
    fn new(
        name: &str,
        handle: Qnn_GraphHandle_t,
        ctx: Arc<Context>,
        inputs: Vec<IoTensor>,
        outputs: Vec<IoTensor>,
        origin: Origin,
        profiles: Option<Profiles>,
    ) -> Self {
        let shared = SharedIo::new(&ctx.rt, ctx.handle, name, &inputs.iter().chain(&outputs).collect::<Vec<_>>());
        HtpGraph { name: name.to_string(), handle, exec_lock: Mutex::new(shared), ctx, inputs, outputs, origin, profiles }
    }

    /// Its part of a cache entry's side table: QNN ids of the inputs, then outputs.
    fn meta(&self) -> impl Iterator<Item = u32> + '_ {
        self.inputs.iter().chain(&self.outputs).map(|t| t.qnn_id.unwrap_or(NO_TENSOR))
    }
}

// SAFETY: the graph handle belongs to the context owned alongside it; executions (and the
// shared buffers they use) are serialized by `exec_lock`; nothing else is mutated after build.
unsafe impl Send for HtpGraph {}
unsafe impl Sync for HtpGraph {}

/// A client buffer over input data. QNN only reads APP_WRITE buffers; the `*mut` is what the C
/// struct wants.
fn input_buffer(d: &TensorData) -> Qnn_ClientBuffer_t {
    let (data, bytes) = match d {
        TensorData::F32(v) => (v.as_ptr() as *mut c_void, v.len() * 4),
        TensorData::U8(v) => (v.as_ptr() as *mut c_void, v.len()),
        TensorData::U16(v) => (v.as_ptr() as *mut c_void, v.len() * 2),
        TensorData::I8(v) => (v.as_ptr() as *mut c_void, v.len()),
        TensorData::I32(v) => (v.as_ptr() as *mut c_void, v.len() * 4),
    };
    Qnn_ClientBuffer_t { data, dataSize: bytes as u32 }
}

/// A client buffer QNN writes an output into.
fn output_buffer(d: &mut TensorData) -> Qnn_ClientBuffer_t {
    match d {
        TensorData::F32(v) => Qnn_ClientBuffer_t::from_slice(v),
        TensorData::U8(v) => Qnn_ClientBuffer_t::from_slice(v),
        TensorData::U16(v) => Qnn_ClientBuffer_t::from_slice(v),
        TensorData::I8(v) => Qnn_ClientBuffer_t::from_slice(v),
        TensorData::I32(v) => Qnn_ClientBuffer_t::from_slice(v),
    }
}

impl ExecutableGraph for HtpGraph {
    fn execute(&self, inputs: &[&TensorData]) -> Result<Vec<TensorData>> {
        check_input_count(&self.name, self.inputs.len(), inputs.len())?;
        // graphExecute does not check client buffer sizes (it overruns): check every one here.
        let check = |t: &IoTensor, data: &TensorData| check_buffer(&self.name, &t.name, t.dtype, t.len, data);
        let rt = &self.ctx.rt;
        let execute = rt.f().graphExecute.ok_or_else(|| Error::Execute { graph: self.name.clone(), code: 0, message: "library lacks graphExecute".into() })?;
        let mut shared = self.exec_lock.lock().unwrap_or_else(|e| e.into_inner());
        let _context = self.ctx.exec.lock().unwrap_or_else(|e| e.into_inner());
        let n_in = self.inputs.len();
        let mut exec_in = Vec::with_capacity(inputs.len());
        for (i, (t, data)) in self.inputs.iter().zip(inputs).enumerate() {
            check(t, data)?;
            let Some(id) = t.qnn_id else { continue };
            match shared.as_mut().and_then(|s| s.bufs[i].as_mut()) {
                Some((buf, handle)) => {
                    buf.as_mut_slice().copy_from_slice(bytes_of(data));
                    exec_in.push(Qnn_Tensor_t::for_execute_mem_handle(id, *handle));
                }
                None => exec_in.push(Qnn_Tensor_t::for_execute(id, input_buffer(data))),
            }
        }
        let mut out: Vec<TensorData> = self.outputs.iter().map(|t| TensorData::zeros(t.dtype, t.len)).collect();
        let mut exec_out = Vec::with_capacity(out.len());
        for (i, (t, data)) in self.outputs.iter().zip(out.iter_mut()).enumerate() {
            check(t, data)?;
            let id = t.qnn_id.expect("checked in build");
            match shared.as_ref().and_then(|s| s.bufs[n_in + i].as_ref()) {
                Some((_, handle)) => exec_out.push(Qnn_Tensor_t::for_execute_mem_handle(id, *handle)),
                None => exec_out.push(Qnn_Tensor_t::for_execute(id, output_buffer(data))),
            }
        }
        let mark = log_mark();
        let profile = Profile::new(rt);
        let t = Instant::now();
        // SAFETY: every client buffer was checked against its tensor's size above (shared
        // buffers were allocated at that size) and outlives the call; QNN only reads the input buffers and writes the output buffers, whose pointers
        // come from exclusive borrows of `out`, which is not accessed until the call returns.
        let rc = unsafe {
            execute(self.handle, exec_in.as_ptr(), exec_in.len() as u32, exec_out.as_mut_ptr(), exec_out.len() as u32, Profile::handle(&profile), null_mut())
        };
        let wall_us = t.elapsed().as_micros() as u64;
        if rc != QNN_SUCCESS {
            let message = with_log(rt.message(rc), &log_errors_since(mark));
            return Err(Error::Execute { graph: self.name.clone(), code: error_code(rc) as u64, message });
        }
        if let Some(shared) = shared.as_ref() {
            for (data, (buf, _)) in out.iter_mut().zip(&shared.bufs[n_in..]).filter_map(|(d, b)| Some((d, b.as_ref()?))) {
                bytes_of_mut(data).copy_from_slice(buf.as_slice());
            }
        }
        if let (Some(p), Some(profile)) = (&self.profiles, &profile) {
            record(p, &self.name, self.origin, "execute", profile.events(), wall_us);
        }
        Ok(out)
    }

    fn origin(&self) -> Origin {
        self.origin
    }

    fn serialized_size(&self) -> Option<usize> {
        if let Some(&size) = self.ctx.binary_size.get() {
            return size;
        }
        let size =
            self.ctx.binary(&self.name).map_err(|e| tracing::warn!(graph = %self.name, error = %e, "context binary size unavailable")).ok().map(|b| b.len());
        *self.ctx.binary_size.get_or_init(|| size)
    }

    fn graphs_in_unit(&self) -> usize {
        self.ctx.graphs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn culprit_is_parsed_from_quoted_node_names() {
        let mut g = Graph::new("t");
        let x = g.input("x", &[2], DType::F32, None);
        let y = g.unary("y", x, DType::F32, None, |input, output| Op::Sigmoid { input, output });
        let _z = g.unary("z", y, DType::F32, None, |input, output| Op::Sigmoid { input, output });
        let log = vec!["noise \"opx\"".to_string(), "<E> \"op1_z\" generated: could not create op".to_string()];
        assert!(std::ptr::eq(culprit(&g, &log).unwrap(), &g.ops[1]));
        assert!(culprit(&g, &["\"op7_q\" failed".to_string()]).is_none());
        assert!(culprit(&g, &[]).is_none());
    }

    #[test]
    fn qnn_names_of_graphs_in_one_context_must_differ() {
        let graph = |name: &str, rows: usize| {
            let mut g = Graph::new(name);
            let x = g.input("x", &[rows, 4], DType::F32, None);
            let y = g.unary("y", x, DType::F32, None, |input, output| Op::Sigmoid { input, output });
            g.mark_output(y);
            g
        };
        let graphs = [graph("a.m64", 64), graph("a.m32", 32), graph("b.m64", 64), graph("b.m32", 32)];
        let described: Vec<Described> = graphs.iter().enumerate().map(|(i, g)| Described::of(g, i)).collect();
        assert_eq!(set_name(&described.iter().collect::<Vec<_>>()), "a.m64+3");
        assert!(check_unique_names(&described.iter().collect::<Vec<_>>()).is_ok());
        let clash = [Described::of(&graph("blk.0", 8), 0), Described::of(&graph("blk_0", 8), 1)];
        let err = check_unique_names(&clash.iter().collect::<Vec<_>>()).unwrap_err().to_string();
        assert!(err.contains("'blk.0' and 'blk_0' have one QNN name, 'blk_0'"), "{err}");
        // Without weight sharing (x86's default) a context per size; with it, one per model.
        let c = |weight_sharing| HtpConfig { weight_sharing, ..Default::default() }.contexts();
        assert_eq!((c(false), c(true)), (Contexts::PerGraphSize, Contexts::PerModel));
    }

    #[test]
    fn names_are_sanitized() {
        assert_eq!(sanitize("blk.0.qkv.m32"), "blk_0_qkv_m32");
        assert_eq!(sanitize("a b/c"), "a_b_c");
    }

    #[test]
    fn library_path_follows_lib_dir() {
        let c = HtpConfig { lib_dir: Some("/x/y".into()), ..Default::default() };
        assert_eq!(c.library_path(), PathBuf::from("/x/y/libQnnHtp.so"));
        assert_eq!(HtpConfig::default().soc_model, 57);
    }

    #[test]
    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn a_library_of_another_architecture_is_named_not_dlopened() {
        let dir = std::env::temp_dir().join(format!("candle-npu-htp-arch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // An ELF header: 64-bit little-endian shared library (e_type 3) for aarch64 (e_machine
        // 183), or x86_64 (62) on an aarch64 host.
        let (machine, name) = if std::env::consts::ARCH == "aarch64" { (62u16, "x86_64") } else { (183, "aarch64") };
        let mut elf = b"\x7fELF\x02\x01\x01".to_vec();
        elf.resize(16, 0);
        elf.extend_from_slice(&3u16.to_le_bytes());
        elf.extend_from_slice(&machine.to_le_bytes());
        elf.resize(64, 0);
        let config = HtpConfig { lib_dir: Some(dir.clone()), ..Default::default() };
        std::fs::write(config.library_path(), &elf).unwrap();
        let err = HtpExecutor::new(config.clone()).unwrap_err();
        let want = format!("QNN library {}: is an {name} ELF library; this process is {}", config.library_path().display(), std::env::consts::ARCH);
        assert!(matches!(&err, Error::QnnLibrary { path, .. } if *path == config.library_path()), "{err:?}");
        assert_eq!(err.to_string(), want);
        std::fs::write(config.library_path(), "a text file in place of the library").unwrap();
        let err = HtpExecutor::new(config).unwrap_err().to_string();
        assert!(err.ends_with("libQnnHtp.so: is not an ELF shared library"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
