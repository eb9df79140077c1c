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
//! stage's graphs of every size kept together ([`crate::executor::htp_contexts`]); on a phone the library
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

pub use super::htp_contexts::{address_space, Contexts, DEFAULT_CONTEXT_BUDGET};
use super::htp_contexts::{plan, Member};
use super::rpcmem::{self, RpcMem, SharedBuffer};
use super::{ExecutableGraph, Executor, GraphProfile, Origin, ProfileEvent};
use crate::cache::{CacheKey, CachedGraph, GraphCache, Lookup};
use crate::error::{Error, Result};
use crate::graph::{check_buffer, check_input_count, DType, Graph, Op, StaticData, TensorData, TensorId, TensorKind, TensorSpec};

mod build;
mod check;
mod config;
mod context;
mod exec;
mod ops;
mod profile;
mod runtime;

use build::*;
pub use config::{HtpConfig, ProfilingLevel};
use context::*;
use exec::*;
use ops::*;
use profile::*;
use runtime::*;

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
    /// [`build_all`], and where a graph's build is checked ([`check`]: LPBQ weights), its
    /// outputs against the HTP numerics model's: a wrong build is logged and the context built
    /// again, at most [`PREPARE_ATTEMPTS`] times.
    fn build_checked(&self, graphs: &[&Described], describe: &dyn Fn(usize) -> Result<Graph>) -> Result<Vec<HtpGraph>> {
        let mut attempt = 1;
        loop {
            let built = build_all(&self.rt, graphs, describe, self.weight_sharing(graphs.len()), self.profiles.clone())?;
            let mut wrong = None;
            for (d, g) in graphs.iter().zip(&built).filter(|(d, _)| d.checked) {
                let gap = check::max_gap(&describe(d.index)?, g)?;
                tracing::debug!(graph = %d.name, gap, attempt, "the library's build against the HTP numerics model");
                if gap > check::WRONG_BEYOND {
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
                         a known fault of its prepare with LPBQ weights, see candle_npu::executor::htp::check): load without LPBQ weights"
                    ),
                });
            }
            tracing::warn!(%graph, gap, attempt, "the library prepared this graph wrongly (its outputs are off the HTP numerics model's; a known fault with LPBQ weights): preparing it again");
            attempt += 1;
        }
    }
}

/// How many times a context whose build is checked is built before the prepare fails: a graph
/// with LPBQ weights came back wrong in about one prepare in ten (Qwen2.5-Coder's layers) while
/// the library read past our encoding arrays (`build.rs`); none has since they are padded.
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
            // graphs in one, one of them would nearly always be wrong (`check`).
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
