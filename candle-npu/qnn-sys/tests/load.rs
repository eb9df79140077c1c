//! Tests against the real QNN HTP library (the x86 emulator from the `onnxruntime-qnn` wheel, put
//! in place by `scripts/setup.sh`). Each test that needs the library is skipped, with the reason
//! printed, only when the library file is absent.
//!
//! The smoke tests drive the raw FFI end to end (log, backend, device, context, graph, tensors,
//! op config, finalize, execute, context binary, profiling) and check outputs numerically: a
//! wrong size or offset anywhere in the types they touch would fail here.

use std::ffi::{c_char, c_void, CStr};
use std::path::{Path, PathBuf};
use std::ptr::{null, null_mut};
use std::sync::{Mutex, OnceLock};

use qnn_sys::*;

/// The library, loaded once per test process; `None` (after printing why) when it is absent.
fn lib() -> Option<&'static QnnLibrary> {
    static LIB: OnceLock<Option<QnnLibrary>> = OnceLock::new();
    let path = default_htp_library_path();
    let lib = LIB.get_or_init(|| path.is_file().then(|| QnnLibrary::load(&path).unwrap_or_else(|e| panic!("loading {}: {e}", path.display())))).as_ref();
    if lib.is_none() {
        eprintln!("skipping: QNN library {} is absent (run scripts/setup.sh or set {ENV_QNN_LIB_DIR})", path.display());
    }
    lib
}

/// Backend lifetimes are process-wide state in QNN: run the runtime tests one at a time.
static RUNTIME_LOCK: Mutex<()> = Mutex::new(());

/// Messages the library logged through [`log_callback`] (level, text).
static LOGS: Mutex<Vec<(u32, String)>> = Mutex::new(Vec::new());

unsafe extern "C" fn log_callback(fmt: *const c_char, level: u32, _ts: u64, args: QnnVaList) {
    let msg = unsafe { format_log_message(fmt, args) };
    LOGS.lock().unwrap_or_else(|e| e.into_inner()).push((level, msg));
}

/// Asserts success; on failure shows the library's message and its recent log lines.
#[track_caller]
fn check(lib: &QnnLibrary, rc: Qnn_ErrorHandle_t, what: &str) {
    if rc != QNN_SUCCESS {
        let logs = LOGS.lock().unwrap_or_else(|e| e.into_inner());
        let recent: Vec<&String> = logs.iter().rev().take(12).map(|(_, t)| t).collect();
        panic!("{what}: {} (recent QNN log, newest first: {recent:#?})", lib.error_message(rc));
    }
}

// ---------------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------------

#[test]
fn loads_htp_provider_with_supported_api() {
    let Some(lib) = lib() else { return };
    let v = lib.api_version();
    assert_eq!(v.coreApiVersion.major, 2, "core API {}", v.coreApiVersion);
    assert!(v.coreApiVersion.minor >= QNN_API_VERSION_MINOR, "core API {}", v.coreApiVersion);
    assert_eq!(lib.backend_id(), QNN_BACKEND_ID_HTP);
    assert_eq!(lib.provider_name(), QNN_HTP_PROVIDER_NAME);
    let build = lib.backend_build_id().expect("backendGetBuildId");
    assert!(!build.is_empty());
    eprintln!(
        "loaded {}: provider {} core API {} backend API {} build {build}",
        lib.path().display(),
        lib.provider_name(),
        v.coreApiVersion,
        v.backendApiVersion
    );

    // backendGetApiVersion agrees with what the provider struct declares.
    let mut api = Qnn_ApiVersion_t::default();
    let f = lib.functions().backendGetApiVersion.expect("backendGetApiVersion");
    check(lib, unsafe { f(&mut api) }, "backendGetApiVersion");
    assert_eq!(api, v);

    // Every entry a prefill executor uses is present.
    let t = lib.functions();
    assert!(t.backendCreate.is_some() && t.backendFree.is_some());
    assert!(t.deviceCreate.is_some() && t.deviceFree.is_some());
    assert!(t.contextCreate.is_some() && t.contextFree.is_some());
    assert!(t.contextGetBinarySize.is_some() && t.contextGetBinary.is_some());
    assert!(t.contextCreateFromBinary.is_some() && t.graphRetrieve.is_some());
    assert!(t.graphCreate.is_some() && t.graphAddNode.is_some() && t.graphFinalize.is_some());
    assert!(t.graphExecute.is_some() && t.tensorCreateGraphTensor.is_some());
    assert!(t.logCreate.is_some() && t.logFree.is_some() && t.errorGetMessage.is_some());
    assert!(t.profileCreate.is_some() && t.profileGetEvents.is_some());
    assert!(t.profileGetEventData.is_some() && t.profileFree.is_some());
    assert_eq!(lib.htp_device_config_layout(), HtpDeviceConfigLayout::UnionAt8);
}

#[test]
fn missing_file_error_names_the_path() {
    let path = PathBuf::from("/nonexistent/qnn/libQnnHtp.so");
    let err = QnnLibrary::load(&path).unwrap_err();
    assert!(matches!(&err, LoadError::NotFound { path: p } if *p == path), "{err:?}");
    assert!(err.to_string().contains("/nonexistent/qnn/libQnnHtp.so"), "{err}");
}

#[test]
fn non_qnn_library_gives_symbol_missing() {
    // This process's own architecture's libm (a multiarch host has others: an x86_64 one is
    // refused before dlopen in an aarch64 process, a different error).
    let arch = std::env::consts::ARCH;
    let candidates =
        [format!("/lib/{arch}-linux-gnu/libm.so.6"), format!("/usr/lib/{arch}-linux-gnu/libm.so.6"), "/lib64/libm.so.6".into(), "/usr/lib64/libm.so.6".into()];
    let Some(libm) = candidates.iter().map(PathBuf::from).find(|p| p.is_file()) else {
        eprintln!("skipping: no libm.so.6 found in {candidates:?}");
        return;
    };
    let err = QnnLibrary::load(&libm).unwrap_err();
    match &err {
        LoadError::SymbolMissing { path, symbol, .. } => {
            assert_eq!(path, &libm);
            assert_eq!(*symbol, "QnnInterface_getProviders");
        }
        other => panic!("expected SymbolMissing, got {other:?}"),
    }
    assert!(err.to_string().contains(&*libm.to_string_lossy()), "{err}");
}

#[test]
fn bare_names_go_to_the_dynamic_loader_search() {
    // A bare name is not checked on disk: dlopen searches for it (as on Android).
    let err = QnnLibrary::load(Path::new("libQnnDoesNotExist.so")).unwrap_err();
    assert!(matches!(&err, LoadError::Open { .. }), "{err:?}");
    assert!(err.to_string().contains("libQnnDoesNotExist.so"), "{err}");
    let err = QnnLibrary::load(Path::new("libm.so.6")).unwrap_err();
    assert!(matches!(&err, LoadError::SymbolMissing { .. }), "{err:?}");
}

#[test]
fn not_a_shared_object_is_refused_before_dlopen() {
    let path = std::env::temp_dir().join(format!("qnn-sys-not-a-library-{}.so", std::process::id()));
    std::fs::write(&path, b"this is not an ELF file").unwrap();
    let err = QnnLibrary::load(&path).unwrap_err();
    std::fs::remove_file(&path).ok();
    assert!(matches!(&err, LoadError::NotLoadable { path: p, reason } if *p == path && reason == "is not an ELF shared library"), "{err:?}");
}

/// The HTP library prints a ` # LIBNATIVE: ...` banner to stdout from its constructor; `load`
/// must keep it off fd 1. Checked in a child process (this test binary re-run on this test),
/// because only the first dlopen in a process runs the constructor.
#[test]
fn load_keeps_stdout_clean() {
    const CHILD: &str = "QNN_SYS_TEST_LOAD_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let _ = lib();
        return;
    }
    if !default_htp_library_path().is_file() {
        let _ = lib(); // prints the skip reason
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "load_keeps_stdout_clean", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("1 passed"), "child ran no test: {stdout}");
    assert!(!stdout.contains("LIBNATIVE"), "library banner reached stdout: {stdout}");
}

// ---------------------------------------------------------------------------------------------
// Runtime smoke tests
// ---------------------------------------------------------------------------------------------

/// log + backend + device + context, freed in reverse order on drop.
struct Runtime {
    lib: &'static QnnLibrary,
    log: Qnn_LogHandle_t,
    backend: Qnn_BackendHandle_t,
    device: Qnn_DeviceHandle_t,
    context: Qnn_ContextHandle_t,
}

impl Runtime {
    /// Everything up to the device; `Err` carries the failing `deviceCreate` result (the rest
    /// is freed by drop).
    fn with_device(lib: &'static QnnLibrary, device_cfg: Option<HtpDeviceCustomConfig>) -> Result<Self, (Self, Qnn_ErrorHandle_t)> {
        let f = lib.functions();
        let mut rt = Runtime { lib, log: null_mut(), backend: null_mut(), device: null_mut(), context: null_mut() };
        unsafe {
            check(lib, f.logCreate.unwrap()(Some(log_callback), QNN_LOG_LEVEL_WARN, &mut rt.log), "logCreate");
            check(lib, f.backendCreate.unwrap()(rt.log, null(), &mut rt.backend), "backendCreate");
            let mut custom = device_cfg;
            let cfg = custom.as_mut().map(|c| QnnDevice_Config_t::custom(c.as_mut_ptr()));
            let cfg_list: [*const QnnDevice_Config_t; 2] = [cfg.as_ref().map_or(null(), |c| c as *const _), null()];
            let rc = f.deviceCreate.unwrap()(rt.log, cfg_list.as_ptr(), &mut rt.device);
            if rc != QNN_SUCCESS {
                return Err((rt, rc));
            }
        }
        Ok(rt)
    }

    /// The full runtime with the SoC set to SM8650 in the layout the library expects.
    fn new(lib: &'static QnnLibrary) -> Self {
        Self::with_context_configs(lib, &[])
    }

    /// [`Runtime::new`] with `configs` given to `contextCreate`.
    fn with_context_configs(lib: &'static QnnLibrary, configs: &[*const QnnContext_Config_t]) -> Self {
        Self::on_soc(lib, QNN_SOC_MODEL_SM8650, configs)
    }

    /// The full runtime on SoC `soc` (`QNN_SOC_MODEL_*`).
    fn on_soc(lib: &'static QnnLibrary, soc: u32, configs: &[*const QnnContext_Config_t]) -> Self {
        let mut list = configs.to_vec();
        list.push(null());
        let cfg = HtpDeviceCustomConfig::soc(lib.htp_device_config_layout(), soc);
        let mut rt = match Self::with_device(lib, Some(cfg)) {
            Ok(rt) => rt,
            Err((_, rc)) => panic!("deviceCreate: {}", lib.error_message(rc)),
        };
        let f = lib.functions();
        unsafe {
            check(lib, f.contextCreate.unwrap()(rt.backend, rt.device, list.as_ptr(), &mut rt.context), "contextCreate");
        }
        rt
    }

    fn graph(&self, name: &CStr, configs: &[*const QnnGraph_Config_t]) -> Qnn_GraphHandle_t {
        let mut list: Vec<*const QnnGraph_Config_t> = configs.to_vec();
        list.push(null());
        let mut graph = null_mut();
        let rc = unsafe { self.lib.functions().graphCreate.unwrap()(self.context, name.as_ptr(), list.as_ptr(), &mut graph) };
        check(self.lib, rc, "graphCreate");
        assert!(!graph.is_null());
        graph
    }

    /// Creates a graph tensor and returns it with the id the library assigned.
    #[allow(clippy::too_many_arguments)]
    fn tensor(
        &self,
        graph: Qnn_GraphHandle_t,
        name: &CStr,
        ty: Qnn_TensorType_t,
        dt: Qnn_DataType_t,
        q: Qnn_QuantizeParams_t,
        dims: &mut [u32],
        buf: Qnn_ClientBuffer_t,
    ) -> Qnn_Tensor_t {
        let mut t = Qnn_Tensor_t::v1(name.as_ptr(), ty, dt, q, dims.len() as u32, dims.as_mut_ptr(), buf);
        let rc = unsafe { self.lib.functions().tensorCreateGraphTensor.unwrap()(graph, &mut t) };
        check(self.lib, rc, &format!("tensorCreateGraphTensor {name:?}"));
        t
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let f = self.lib.functions();
        unsafe {
            if !self.context.is_null() {
                check(self.lib, f.contextFree.unwrap()(self.context, null_mut()), "contextFree");
            }
            if !self.device.is_null() {
                check(self.lib, f.deviceFree.unwrap()(self.device), "deviceFree");
            }
            if !self.backend.is_null() {
                check(self.lib, f.backendFree.unwrap()(self.backend), "backendFree");
            }
            if !self.log.is_null() {
                check(self.lib, f.logFree.unwrap()(self.log), "logFree");
            }
        }
    }
}

fn execute(
    lib: &QnnLibrary,
    graph: Qnn_GraphHandle_t,
    inputs: &[Qnn_Tensor_t],
    outputs: &mut [Qnn_Tensor_t],
    profile: Qnn_ProfileHandle_t,
) -> Qnn_ErrorHandle_t {
    unsafe {
        lib.functions().graphExecute.unwrap()(graph, inputs.as_ptr(), inputs.len() as u32, outputs.as_mut_ptr(), outputs.len() as u32, profile, null_mut())
    }
}

/// u8 with zero point 128 (QNN offset -128) and scale 1/16: a + b requantized to the same
/// params is exactly `qa + qb - 128`, clamped to 0..=255.
fn add_reference(a: &[u8], b: &[u8]) -> Vec<u8> {
    a.iter().zip(b).map(|(&x, &y)| (x as i32 + y as i32 - 128).clamp(0, 255) as u8).collect()
}

#[test]
fn element_wise_add_end_to_end_and_context_binary() {
    let Some(lib) = lib() else { return };
    let _serial = RUNTIME_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let f = lib.functions();
    let q = Qnn_QuantizeParams_t::scale_offset(1.0 / 16.0, -128);
    let a: [u8; 4] = [130, 140, 100, 250];
    let b: [u8; 4] = [126, 200, 28, 200];
    let want = add_reference(&a, &b);
    assert_eq!(want, [128, 212, 0, 255]);

    let binary = {
        let rt = Runtime::new(lib);
        // An HTP graph custom config, to exercise the 56-byte layout (2 = default optimization).
        let mut opt = QnnHtpGraph_CustomConfig_t::finalize_optimization(2.0);
        let graph_cfg = QnnGraph_Config_t::custom((&mut opt as *mut QnnHtpGraph_CustomConfig_t).cast());
        let graph = rt.graph(c"add", &[&graph_cfg]);

        let (mut d0, mut d1, mut d2) = ([1u32, 4], [1u32, 4], [1u32, 4]);
        let u8t = QNN_DATATYPE_UFIXED_POINT_8;
        let empty = Qnn_ClientBuffer_t::empty();
        let in0 = rt.tensor(graph, c"in0", QNN_TENSOR_TYPE_APP_WRITE, u8t, q, &mut d0, empty);
        let in1 = rt.tensor(graph, c"in1", QNN_TENSOR_TYPE_APP_WRITE, u8t, q, &mut d1, empty);
        let out = rt.tensor(graph, c"out", QNN_TENSOR_TYPE_APP_READ, u8t, q, &mut d2, empty);
        assert!(in0.id() != in1.id() && in1.id() != out.id(), "ids {} {} {}", in0.id(), in1.id(), out.id());

        let mut inputs = [in0, in1];
        let mut outputs = [out];
        let op =
            Qnn_OpConfig_t::v1(c"add0".as_ptr(), QNN_OP_PACKAGE_NAME_QTI_AISW.as_ptr(), QNN_OP_ELEMENT_WISE_ADD.as_ptr(), &mut [], &mut inputs, &mut outputs);
        unsafe {
            check(lib, f.backendValidateOpConfig.unwrap()(rt.backend, op), "backendValidateOpConfig");
            check(lib, f.graphAddNode.unwrap()(graph, op), "graphAddNode");
            check(lib, f.graphFinalize.unwrap()(graph, null_mut(), null_mut()), "graphFinalize");
        }

        // Execute with minimal tensors for the inputs (id + buffer) and the created tensor for
        // the output: both forms must work.
        let (mut xa, mut xb, mut y) = (a, b, [0u8; 4]);
        let exec_in = [
            Qnn_Tensor_t::for_execute(in0.id(), Qnn_ClientBuffer_t::from_slice(&mut xa)),
            Qnn_Tensor_t::for_execute(in1.id(), Qnn_ClientBuffer_t::from_slice(&mut xb)),
        ];
        let mut exec_out = [out];
        exec_out[0].set_client_buf(Qnn_ClientBuffer_t::from_slice(&mut y));
        check(lib, execute(lib, graph, &exec_in, &mut exec_out, null_mut()), "graphExecute");
        assert_eq!(y.to_vec(), want, "ElementWiseAdd output");

        // Serialize the context for the reload below.
        let mut size = 0u64;
        unsafe { check(lib, f.contextGetBinarySize.unwrap()(rt.context, &mut size), "contextGetBinarySize") };
        assert!(size > 0);
        let mut buf = vec![0u8; size as usize];
        let mut written = 0u64;
        unsafe { check(lib, f.contextGetBinary.unwrap()(rt.context, buf.as_mut_ptr().cast(), size, &mut written), "contextGetBinary") };
        assert!(written > 0 && written <= size, "written {written} of {size}");
        buf.truncate(written as usize);
        (buf, in0.id(), in1.id(), out.id())
        // rt drops here: context, device, backend, log freed in reverse order.
    };

    // The System library reads the binary's graphs back with the ids and names given them.
    let (buf, id0, id1, id_out) = binary;
    let system = default_lib_dir().join(QNN_SYSTEM_LIBRARY_NAME);
    let system = QnnSystemLibrary::load(&system).unwrap_or_else(|e| panic!("{e}"));
    let io = system.graph_io(&buf).unwrap();
    let named = |v: &[(u32, &str)]| v.iter().map(|&(i, n)| (i, n.to_string())).collect::<Vec<_>>();
    assert_eq!(io, [GraphIo { name: "add".into(), inputs: named(&[(id0, "in0"), (id1, "in1")]), outputs: named(&[(id_out, "out")]) }]);
    let mut damaged = buf.clone();
    damaged.truncate(64);
    assert!(matches!(system.graph_io(&damaged), Err(GraphIoError::Refused(_))), "a cut binary is refused");

    // A fresh runtime loads the binary, retrieves the graph by name and gives the same output.
    let mut rt = Runtime::new(lib);
    unsafe {
        check(lib, f.contextFree.unwrap()(rt.context, null_mut()), "contextFree (empty)");
        rt.context = null_mut();
        check(
            lib,
            f.contextCreateFromBinary.unwrap()(rt.backend, rt.device, null(), buf.as_ptr().cast::<c_void>(), buf.len() as u64, &mut rt.context, null_mut()),
            "contextCreateFromBinary",
        );
    }
    let mut graph = null_mut();
    unsafe { check(lib, f.graphRetrieve.unwrap()(rt.context, c"add".as_ptr(), &mut graph), "graphRetrieve") };
    let (mut xa, mut xb, mut y) = (a, b, [0u8; 4]);
    let exec_in =
        [Qnn_Tensor_t::for_execute(id0, Qnn_ClientBuffer_t::from_slice(&mut xa)), Qnn_Tensor_t::for_execute(id1, Qnn_ClientBuffer_t::from_slice(&mut xb))];
    let mut exec_out = [Qnn_Tensor_t::for_execute(id_out, Qnn_ClientBuffer_t::from_slice(&mut y))];
    check(lib, execute(lib, graph, &exec_in, &mut exec_out, null_mut()), "graphExecute (from binary)");
    assert_eq!(y.to_vec(), want, "ElementWiseAdd output from the context binary");
}

/// FullyConnected W8A8 with a STATIC weight, a scalar param and an SFIXED_POINT_32 output whose
/// scale is s_x * s_w: the output must equal the int32 accumulator exactly. Also profiles the
/// execute and reads the events back.
#[test]
fn fully_connected_with_param_static_weight_and_profile() {
    let Some(lib) = lib() else { return };
    let _serial = RUNTIME_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let f = lib.functions();
    let rt = Runtime::new(lib);
    let graph = rt.graph(c"fc", &[]);

    const M: usize = 2;
    const K: usize = 4;
    const N: usize = 3;
    let (sx, sw) = (0.0625f32, 0.5f32);
    let x: [u8; M * K] = [128, 130, 120, 255, 0, 128, 129, 140];
    let mut w: [i8; N * K] = [1, -2, 3, -4, 127, -127, 0, 5, -1, -1, -1, -1];
    let want: Vec<i32> = (0..M)
        .flat_map(|m| {
            let x = &x;
            let w = &w;
            (0..N).map(move |n| (0..K).map(|k| (x[m * K + k] as i32 - 128) * w[n * K + k] as i32).sum())
        })
        .collect();

    let (mut dx, mut dw, mut dy) = ([M as u32, K as u32], [N as u32, K as u32], [M as u32, N as u32]);
    let empty = Qnn_ClientBuffer_t::empty();
    let tx = rt.tensor(graph, c"x", QNN_TENSOR_TYPE_APP_WRITE, QNN_DATATYPE_UFIXED_POINT_8, Qnn_QuantizeParams_t::scale_offset(sx, -128), &mut dx, empty);
    let tw = rt.tensor(
        graph,
        c"w",
        QNN_TENSOR_TYPE_STATIC,
        QNN_DATATYPE_SFIXED_POINT_8,
        Qnn_QuantizeParams_t::scale_offset(sw, 0),
        &mut dw,
        Qnn_ClientBuffer_t::from_slice(&mut w),
    );
    let ty = rt.tensor(graph, c"y", QNN_TENSOR_TYPE_APP_READ, QNN_DATATYPE_SFIXED_POINT_32, Qnn_QuantizeParams_t::scale_offset(sx * sw, 0), &mut dy, empty);
    let mut params = [Qnn_Param_t::scalar(QNN_OP_FULLY_CONNECTED_PARAM_KEEP_DIMS.as_ptr(), Qnn_Scalar_t::bool8(false))];
    let mut inputs = [tx, tw];
    let mut outputs = [ty];
    let op =
        Qnn_OpConfig_t::v1(c"fc0".as_ptr(), QNN_OP_PACKAGE_NAME_QTI_AISW.as_ptr(), QNN_OP_FULLY_CONNECTED.as_ptr(), &mut params, &mut inputs, &mut outputs);
    unsafe {
        // Not asserted: the HTP 5.51 library's backendValidateOpConfig rejects this u8 x s8 ->
        // SFIXED_POINT_32 FullyConnected (3110 VALIDATION_FAILURE, its list of supported
        // datatype sets has no s32 output), yet graphAddNode + graphFinalize accept it and
        // execute computes the exact int32 accumulator. Validation is stricter than finalize.
        let rc = f.backendValidateOpConfig.unwrap()(rt.backend, op);
        eprintln!("backendValidateOpConfig of FC u8 x s8 -> s32: {}", lib.error_message(rc));
        check(lib, f.graphAddNode.unwrap()(graph, op), "graphAddNode");
        check(lib, f.graphFinalize.unwrap()(graph, null_mut(), null_mut()), "graphFinalize");
    }

    let mut profile = null_mut();
    unsafe { check(lib, f.profileCreate.unwrap()(rt.backend, QNN_PROFILE_LEVEL_BASIC, &mut profile), "profileCreate") };
    let mut xin = x;
    let mut y = [0i32; M * N];
    let exec_in = [Qnn_Tensor_t::for_execute(tx.id(), Qnn_ClientBuffer_t::from_slice(&mut xin))];
    let mut exec_out = [Qnn_Tensor_t::for_execute(ty.id(), Qnn_ClientBuffer_t::from_slice(&mut y))];
    check(lib, execute(lib, graph, &exec_in, &mut exec_out, profile), "graphExecute");
    assert_eq!(y.to_vec(), want, "FullyConnected int32 accumulator");

    // Profiling events: ids, then data with a known unit and a readable identifier.
    let mut ids: *const QnnProfile_EventId_t = null();
    let mut n = 0u32;
    unsafe { check(lib, f.profileGetEvents.unwrap()(profile, &mut ids, &mut n), "profileGetEvents") };
    assert!(n > 0 && !ids.is_null(), "no profile events");
    let ids = unsafe { std::slice::from_raw_parts(ids, n as usize) }.to_vec();
    let mut described = Vec::new();
    for &id in &ids {
        let mut data = QnnProfile_EventData_t::default();
        unsafe { check(lib, f.profileGetEventData.unwrap()(id, &mut data), "profileGetEventData") };
        assert!(
            (QNN_PROFILE_EVENTUNIT_MICROSEC..=QNN_PROFILE_EVENTUNIT_COUNT + 1).contains(&data.unit),
            "event unit {} out of range: layout of QnnProfile_EventData_t?",
            data.unit
        );
        let ident = if data.identifier.is_null() { String::new() } else { unsafe { CStr::from_ptr(data.identifier) }.to_string_lossy().into_owned() };
        described.push(format!("{ident} = {} (unit {})", data.value, data.unit));
    }
    assert!(described.iter().any(|d| !d.starts_with(' ')), "events without identifiers: {described:?}");
    eprintln!("profile events: {described:?}");
    unsafe { check(lib, f.profileFree.unwrap()(profile), "profileFree") };
}

/// HTP weight sharing, as this library does it. A context holding a 16-row and a 4-row
/// FullyConnected over weights of equal bytes (named apart) keeps one copy of them in its binary
/// when created with `WEIGHT_SHARING_ENABLED`, and both graphs compute exactly in the process
/// that made them; the binary without sharing loads back, the shared one does not on x86 (1000,
/// NOT_SUPPORTED: the x86 library prepares shared weights but cannot load them; a v73+ device
/// does). What issue 28's one-context-per-model cache has to build around.
#[test]
fn weight_sharing_is_by_content_and_the_x86_library_cannot_load_it() {
    let Some(lib) = lib() else { return };
    let _serial = RUNTIME_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let f = lib.functions();
    const K: usize = 512;
    const N: usize = 512;
    // -127..=127 (the symmetric INT8 range).
    let w: Vec<i8> = (0..N * K).map(|i| (((i * 7919 + i / K) % 255) as i32 - 127) as i8).collect();
    let x: Vec<u8> = (0..16 * K).map(|i| ((i * 104_729) % 256) as u8).collect();
    // One context, two graphs (16 and 4 rows) over copies of `w`; returns the runtime, the
    // 4-row graph with its tensor ids, and the context binary.
    let build = |share: bool| {
        let mut custom = QnnHtpContext_CustomConfig_t::weight_sharing(true);
        let cfg = QnnContext_Config_t::custom(&mut custom as *mut _ as *mut c_void);
        let configs: Vec<*const QnnContext_Config_t> = if share { vec![&cfg as *const _] } else { vec![] };
        let rt = Runtime::with_context_configs(lib, &configs);
        let mut small = None;
        // The library reads static data at graphFinalize; each graph gets its own copy.
        let mut weights = [w.clone(), w.clone()];
        for (weight, (m, name)) in weights.iter_mut().zip([(16usize, c"fc16"), (4, c"fc4")]) {
            let graph = rt.graph(name, &[]);
            let (mut dx, mut dw, mut dy) = ([m as u32, K as u32], [N as u32, K as u32], [m as u32, N as u32]);
            let empty = Qnn_ClientBuffer_t::empty();
            let q = |scale: f32, offset: i32| Qnn_QuantizeParams_t::scale_offset(scale, offset);
            let tx = rt.tensor(graph, c"x", QNN_TENSOR_TYPE_APP_WRITE, QNN_DATATYPE_UFIXED_POINT_8, q(1.0, -128), &mut dx, empty);
            let wname = if m == 16 { c"w_a" } else { c"w_b" };
            let tw = rt.tensor(graph, wname, QNN_TENSOR_TYPE_STATIC, QNN_DATATYPE_SFIXED_POINT_8, q(1.0, 0), &mut dw, Qnn_ClientBuffer_t::from_slice(weight));
            // F32 out, as the stage graphs: with an SFIXED_POINT_32 output (exact for the 3
            // columns of the test above) columns 32-35 came out equal to columns 0-3 here.
            let ty = rt.tensor(graph, c"y", QNN_TENSOR_TYPE_APP_READ, QNN_DATATYPE_FLOAT_32, Qnn_QuantizeParams_t::undefined(), &mut dy, empty);
            let (mut inputs, mut outputs) = ([tx, tw], [ty]);
            let op =
                Qnn_OpConfig_t::v1(c"fc".as_ptr(), QNN_OP_PACKAGE_NAME_QTI_AISW.as_ptr(), QNN_OP_FULLY_CONNECTED.as_ptr(), &mut [], &mut inputs, &mut outputs);
            unsafe {
                check(lib, f.graphAddNode.unwrap()(graph, op), "graphAddNode");
                check(lib, f.graphFinalize.unwrap()(graph, null_mut(), null_mut()), "graphFinalize");
            }
            if m == 4 {
                small = Some((graph, tx.id(), ty.id()));
            }
        }
        let mut bound = 0u64;
        unsafe { check(lib, f.contextGetBinarySize.unwrap()(rt.context, &mut bound), "contextGetBinarySize") };
        let mut binary = vec![0u8; bound as usize];
        let mut written = 0u64;
        unsafe { check(lib, f.contextGetBinary.unwrap()(rt.context, binary.as_mut_ptr().cast(), bound, &mut written), "contextGetBinary") };
        binary.truncate(written as usize);
        (rt, small.expect("the 4-row graph"), binary)
    };
    let (plain_rt, _, plain) = build(false);
    drop(plain_rt);
    let (rt, (graph, x_id, y_id), shared) = build(true);
    eprintln!("context binary: {} bytes without weight sharing, {} with", plain.len(), shared.len());
    assert!(
        plain.len() - shared.len().min(plain.len()) >= N * K * 3 / 4,
        "weight sharing should keep one of the two {} KB copies: {} vs {} bytes",
        N * K / 1024,
        shared.len(),
        plain.len()
    );
    // The 4-row graph computes in the context that shares its weight, to the HTP's FP16
    // float arithmetic (a wrong weight would be off by the size of the values).
    let (xs, ws) = (&x, &w);
    let want: Vec<i32> = (0..4).flat_map(|r| (0..N).map(move |n| (0..K).map(|k| (xs[r * K + k] as i32 - 128) * ws[n * K + k] as i32).sum::<i32>())).collect();
    let mut xin = x[..4 * K].to_vec();
    let mut y = vec![0f32; 4 * N];
    let inputs = [Qnn_Tensor_t::for_execute(x_id, Qnn_ClientBuffer_t::from_slice(&mut xin))];
    let mut outputs = [Qnn_Tensor_t::for_execute(y_id, Qnn_ClientBuffer_t::from_slice(&mut y))];
    check(lib, execute(lib, graph, &inputs, &mut outputs, null_mut()), "graphExecute");
    // Two FP16 steps of the largest value.
    let tol = want.iter().map(|v| v.unsigned_abs()).max().unwrap_or(0) as f32 * 2.0 / 1024.0;
    if let Some(i) = (0..y.len()).find(|&i| (y[i] - want[i] as f32).abs() > tol) {
        panic!("the 4-row graph over the shared weight: output {i} is {}, expected {} (tolerance {tol})", y[i], want[i]);
    }
    // Loading: the plain binary loads, the shared one is refused on x86.
    for (binary, shared) in [(&plain, false), (&shared, true)] {
        let mut context = null_mut();
        let rc =
            unsafe { f.contextCreateFromBinary.unwrap()(rt.backend, rt.device, null(), binary.as_ptr().cast(), binary.len() as u64, &mut context, null_mut()) };
        if rc == QNN_SUCCESS {
            unsafe { check(lib, f.contextFree.unwrap()(context, null_mut()), "contextFree") };
        }
        match (shared, cfg!(target_arch = "x86_64")) {
            (true, true) => assert_eq!(error_code(rc), QNN_COMMON_ERROR_NOT_SUPPORTED, "loading a weight-shared binary on x86: {}", lib.error_message(rc)),
            _ => check(lib, rc, &format!("contextCreateFromBinary (weight sharing: {shared})")),
        }
    }
}

/// The HTP device config must follow the library's layout: this library (HTP API 5.51) rejects
/// the older 5.43 layout's SoC option with 14001, while the 5.51 layout (used by `Runtime::new`
/// in the tests above) works.
#[test]
fn htp_device_config_layouts() {
    let Some(lib) = lib() else { return };
    let _serial = RUNTIME_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    assert_eq!(lib.htp_device_config_layout(), HtpDeviceConfigLayout::UnionAt8);

    let new = HtpDeviceCustomConfig::soc(HtpDeviceConfigLayout::UnionAt8, QNN_SOC_MODEL_SM8650);
    let rt = Runtime::with_device(lib, Some(new)).unwrap_or_else(|(_, rc)| panic!("{}", lib.error_message(rc)));
    drop(rt);

    let arch = HtpDeviceCustomConfig::arch(HtpDeviceConfigLayout::UnionAt8, 0, QNN_HTP_DEVICE_ARCH_V75);
    let rt = Runtime::with_device(lib, Some(arch)).unwrap_or_else(|(_, rc)| panic!("{}", lib.error_message(rc)));
    drop(rt);

    let old = HtpDeviceCustomConfig::soc(HtpDeviceConfigLayout::UnionAt4, QNN_SOC_MODEL_SM8650);
    match Runtime::with_device(lib, Some(old)) {
        Ok(_) => panic!("the 5.43 layout was accepted by a library reporting HTP API {}", lib.api_version().backendApiVersion),
        Err((rt, rc)) => {
            let msg = lib.error_message(rc);
            eprintln!("old layout rejected as expected: {msg}");
            assert_eq!(error_code(rc), 14001, "{msg}");
            assert!(msg.starts_with("QNN error 14001"), "{msg}");
            drop(rt);
        }
    }
}

/// errorGetMessage gives text for a real failure, and the log callback receives formatted text.
#[test]
fn error_messages_and_log_callback() {
    let Some(lib) = lib() else { return };
    let _serial = RUNTIME_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let f = lib.functions();
    let rt = Runtime::new(lib);
    let mut graph = null_mut();
    let rc = unsafe { f.graphRetrieve.unwrap()(rt.context, c"no_such_graph".as_ptr(), &mut graph) };
    assert_ne!(rc, QNN_SUCCESS);
    let msg = lib.error_message(rc);
    eprintln!("graphRetrieve of a missing graph: {msg}");
    assert!(msg.starts_with(&format!("QNN error {}", error_code(rc))), "{msg}");
    drop(rt);
    let logs = LOGS.lock().unwrap_or_else(|e| e.into_inner());
    eprintln!("{} log lines, e.g. {:?}", logs.len(), logs.first());
    for (level, text) in logs.iter() {
        assert!((QNN_LOG_LEVEL_ERROR..=QNN_LOG_LEVEL_DEBUG).contains(level), "level {level}: {text}");
        assert!(!text.contains("%s") || text.contains("%%"), "unformatted log line: {text}");
    }
}

/// How a FullyConnected weight is encoded in [`fc_weight_encodings`].
#[derive(Clone, Copy, Debug)]
enum WeightEnc {
    /// BLOCKWISE_EXPANSION over blocks of 32 inputs: `bits`-bit values in an 8-bit container
    /// (`packed`: two per byte as `SFIXED_POINT_4`), `scale_bits`-bit block scales.
    Blockwise { bits: u32, packed: bool, scale_bits: u32 },
    /// `SFIXED_POINT_16` values, one scale per tensor, or per output channel.
    Int16 { per_channel: bool },
}

/// Where [`run_fc`] stopped: the call that failed and its QNN error.
#[derive(Debug)]
struct Refused(&'static str, String);

/// Builds, finalizes and runs `y[M, N] = x[M, K] @ w[N, K]^T` with `x` of `act` (u8 or u16,
/// zero point at mid-range), `w` encoded as `enc` and `y` of `out` (u8/u16 over `±y_range`, or
/// F32). Returns the output and the exact float result.
fn run_fc(lib: &'static QnnLibrary, soc: u32, enc: WeightEnc, act: Qnn_DataType_t, out: Qnn_DataType_t) -> Result<(Vec<f32>, Vec<f32>, f32), Refused> {
    const M: usize = 8;
    const K: usize = 128;
    const N: usize = 64;
    const BLOCK: usize = 32;
    let f = lib.functions();
    let rt = Runtime::on_soc(lib, soc, &[]);
    let graph = rt.graph(c"fc_weights", &[]);
    let levels = |dt| if dt == QNN_DATATYPE_UFIXED_POINT_16 { 65536i64 } else { 256 };
    let (a_levels, a_zero) = (levels(act), levels(act) / 2);
    let sx = 4.0 / a_levels as f32;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let xq: Vec<i64> = (0..M * K).map(|_| next(a_levels as u64) as i64).collect();
    let (qmax, scale_max) = match enc {
        WeightEnc::Blockwise { bits, scale_bits, .. } => ((1i64 << (bits - 1)) - 1, (1u64 << scale_bits) - 1),
        WeightEnc::Int16 { .. } => (32767, 1),
    };
    let wq: Vec<i64> = (0..N * K).map(|_| next(2 * qmax as u64 + 1) as i64 - qmax).collect();
    let nb = K / BLOCK;
    let block_scales: Vec<u64> = (0..N * nb).map(|_| 1 + next(scale_max)).collect();
    let per_channel = !matches!(enc, WeightEnc::Int16 { per_channel: false });
    let cs: Vec<f32> = (0..N).map(|n| if per_channel { 1e-3 * (1.0 + n as f32 / N as f32) } else { 1e-3 }).collect();
    let want: Vec<f32> = (0..M * N)
        .map(|i| {
            let (m, n) = (i / N, i % N);
            (0..K).map(|k| (xq[m * K + k] - a_zero) as f32 * sx * (wq[n * K + k] * block_scales[n * nb + k / BLOCK] as i64) as f32 * cs[n]).sum()
        })
        .collect();
    let y_range = want.iter().fold(0f32, |a, v| a.max(v.abs())) * 1.05;
    let (o_levels, o_zero) = (levels(out), levels(out) / 2);
    let sy = 2.0 * y_range / o_levels as f32;

    let mut so: Vec<Qnn_ScaleOffset_t> = cs.iter().map(|&scale| Qnn_ScaleOffset_t { scale, offset: 0 }).collect();
    // The library reads a blockwise encoding's two arrays for max(N, K) channels (K here; its
    // products use the first N): padded, the real ones repeated (candle-npu's executor/htp/build.rs).
    let channels = N.max(K);
    let mut so_padded: Vec<Qnn_ScaleOffset_t> = (0..channels).map(|c| so[c % N]).collect();
    let mut scales8: Vec<u8> = (0..channels * nb).map(|i| block_scales[i % (N * nb)] as u8).collect();
    let mut scales16: Vec<u16> = (0..channels * nb).map(|i| block_scales[i % (N * nb)] as u16).collect();
    let (wdt, mut wbytes, mut be) = match enc {
        WeightEnc::Blockwise { packed, scale_bits, .. } => {
            let bytes: Vec<u8> = match packed {
                true => wq.chunks(2).map(|p| (p[0] as u8 & 15) | ((p[1] as u8 & 15) << 4)).collect(),
                false => wq.iter().map(|&v| v as i8 as u8).collect(),
            };
            let wide = scale_bits > 8;
            let be = Qnn_BlockwiseExpansion_t {
                axis: 0,
                scaleOffsets: so_padded.as_mut_ptr(),
                numBlocksPerAxis: nb as u32,
                blockScaleBitwidth: scale_bits,
                blockScaleStorageType: if wide { QNN_BLOCKWISE_EXPANSION_BITWIDTH_SCALE_STORAGE_16 } else { QNN_BLOCKWISE_EXPANSION_BITWIDTH_SCALE_STORAGE_8 },
                blocksScale: if wide { scales16.as_mut_ptr().cast() } else { scales8.as_mut_ptr().cast() },
            };
            (if packed { QNN_DATATYPE_SFIXED_POINT_4 } else { QNN_DATATYPE_SFIXED_POINT_8 }, bytes, Some(be))
        }
        WeightEnc::Int16 { .. } => (QNN_DATATYPE_SFIXED_POINT_16, wq.iter().flat_map(|&v| (v as i16).to_le_bytes()).collect(), None),
    };
    let wparams = match (&mut be, enc) {
        (Some(be), _) => Qnn_QuantizeParams_t::blockwise_expansion(be),
        (None, WeightEnc::Int16 { per_channel: true }) => Qnn_QuantizeParams_t::axis_scale_offset(0, &mut so),
        (None, _) => Qnn_QuantizeParams_t::scale_offset(cs[0], 0),
    };
    let (mut dx, mut dw, mut dy) = ([M as u32, K as u32], [N as u32, K as u32], [M as u32, N as u32]);
    let empty = Qnn_ClientBuffer_t::empty();
    let tx = rt.tensor(graph, c"x", QNN_TENSOR_TYPE_APP_WRITE, act, Qnn_QuantizeParams_t::scale_offset(sx, -a_zero as i32), &mut dx, empty);
    let mut t = Qnn_Tensor_t::v1(c"w".as_ptr(), QNN_TENSOR_TYPE_STATIC, wdt, wparams, 2, dw.as_mut_ptr(), Qnn_ClientBuffer_t::from_slice(&mut wbytes));
    let rc = unsafe { f.tensorCreateGraphTensor.unwrap()(graph, &mut t) };
    if rc != QNN_SUCCESS {
        return Err(Refused("tensorCreateGraphTensor", lib.error_message(rc)));
    }
    let oq = match out {
        QNN_DATATYPE_FLOAT_32 => Qnn_QuantizeParams_t::undefined(),
        _ => Qnn_QuantizeParams_t::scale_offset(sy, -o_zero as i32),
    };
    let ty = rt.tensor(graph, c"y", QNN_TENSOR_TYPE_APP_READ, out, oq, &mut dy, empty);
    let (mut inputs, mut outputs) = ([tx, t], [ty]);
    let op = Qnn_OpConfig_t::v1(c"fc".as_ptr(), QNN_OP_PACKAGE_NAME_QTI_AISW.as_ptr(), QNN_OP_FULLY_CONNECTED.as_ptr(), &mut [], &mut inputs, &mut outputs);
    unsafe {
        check(lib, f.graphAddNode.unwrap()(graph, op), "graphAddNode");
        let rc = f.graphFinalize.unwrap()(graph, null_mut(), null_mut());
        if rc != QNN_SUCCESS {
            return Err(Refused("graphFinalize", lib.error_message(rc)));
        }
    }
    // Inputs and outputs as bytes of their element size.
    let mut xin: Vec<u8> = match act {
        QNN_DATATYPE_UFIXED_POINT_16 => xq.iter().flat_map(|&v| (v as u16).to_le_bytes()).collect(),
        _ => xq.iter().map(|&v| v as u8).collect(),
    };
    let out_bytes = match out {
        QNN_DATATYPE_FLOAT_32 => 4,
        QNN_DATATYPE_UFIXED_POINT_16 => 2,
        _ => 1,
    };
    let mut y = vec![0u8; M * N * out_bytes];
    let exec_in = [Qnn_Tensor_t::for_execute(tx.id(), Qnn_ClientBuffer_t::from_slice(&mut xin))];
    let mut exec_out = [Qnn_Tensor_t::for_execute(ty.id(), Qnn_ClientBuffer_t::from_slice(&mut y))];
    let rc = execute(lib, graph, &exec_in, &mut exec_out, null_mut());
    if rc != QNN_SUCCESS {
        return Err(Refused("graphExecute", lib.error_message(rc)));
    }
    let got = match out_bytes {
        4 => y.chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
        2 => y.chunks(2).map(|b| (u16::from_le_bytes([b[0], b[1]]) as i64 - o_zero) as f32 * sy).collect(),
        _ => y.iter().map(|&q| (q as i64 - o_zero) as f32 * sy).collect(),
    };
    Ok((got, want, if out == QNN_DATATYPE_FLOAT_32 { 0.0 } else { sy }))
}

/// Largest |got - want| in output steps (`step` 0: relative to the largest |want|).
fn steps_off((got, want, step): &(Vec<f32>, Vec<f32>, f32)) -> f32 {
    let unit = if *step > 0.0 { *step } else { want.iter().fold(0f32, |a, v| a.max(v.abs())) };
    let off = got.iter().zip(want).fold(0f32, |a, (g, w)| a.max((g - w).abs())) / unit;
    eprintln!("fc_weight_encodings: {off} steps off (step {step})");
    off
}

/// What FullyConnected weights finer than INT8 per channel the HTP takes (measured on this
/// library, SoC SM8650; `docs/npu_weights.md`). LPBQ (BLOCKWISE_EXPANSION) is 4-bit values in an
/// 8-bit container times 4-bit block scales: the HTP expands them into 8-bit weights (4 + 4
/// bits), so every LPBQ weight is an INT8 per-channel weight too; it saves bytes, never error.
/// 8-bit values, or wider block scales, do not fit the expansion: wrong values, or refused. 16-bit
/// weights run, one scale per tensor (per channel only into a quantized output). The same on
/// SM8650 (v75) and SM8750 (v79).
#[test]
fn fc_weight_encodings() {
    let Some(lib) = lib() else { return };
    let _serial = RUNTIME_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    for soc in [QNN_SOC_MODEL_SM8650, QNN_SOC_MODEL_SM8750] {
        eprintln!("fc_weight_encodings on SoC {soc}");
        fc_weight_encodings_on(lib, soc);
    }
}

fn fc_weight_encodings_on(lib: &'static QnnLibrary, soc: u32) {
    let (u8_, u16_, f32_) = (QNN_DATATYPE_UFIXED_POINT_8, QNN_DATATYPE_UFIXED_POINT_16, QNN_DATATYPE_FLOAT_32);
    let lpbq = |bits, packed, scale_bits| WeightEnc::Blockwise { bits, packed, scale_bits };
    let ok = |enc, act, out| run_fc(lib, soc, enc, act, out).unwrap_or_else(|e| panic!("{enc:?} {act:#x} -> {out:#x}: {e:?}"));
    let refused = |enc, act, out, at: &str| match run_fc(lib, soc, enc, act, out) {
        Err(Refused(stage, msg)) => assert_eq!(stage, at, "{enc:?} {act:#x} -> {out:#x}: {msg}"),
        Ok(r) => panic!("{enc:?} {act:#x} -> {out:#x} ran ({} steps off): the library changed", steps_off(&r)),
    };

    // Until 2026-12-03 the library's prepare of LPBQ graphs read past the encoding's arrays (above;
    // docs/npu_weights.md): the same W4A16 graph came out 0.71, 0.84 or 2.3 steps off from
    // prepare to prepare, and about one run of this binary in 30 (2026-12-01, two busy cores) had
    // W4A8 some 128 steps off, once in CI. A case that must be within one step is still prepared
    // again from a fresh runtime, up to three times, each miss printed, as the executor checks.
    let within_one_step = |enc, act, out| {
        let mut offs = Vec::new();
        while offs.len() < 3 && offs.last().is_none_or(|&off| off > 1.0) {
            offs.push(steps_off(&ok(enc, act, out)));
        }
        if offs.len() > 1 {
            eprintln!("fc_weight_encodings: {enc:?} {act:#x} -> {out:#x}: {offs:?} steps off (the emulator's rare wrong run, then again)");
        }
        assert!(offs.last().is_some_and(|&off| off <= 1.0), "{enc:?} {act:#x} -> {out:#x}: {offs:?} steps off in three runs");
    };
    // LPBQ, 4-bit values and 4-bit block scales: W4A8 and W4A16 within one output step.
    for (act, out) in [(u8_, u8_), (u16_, u16_)] {
        within_one_step(lpbq(4, false, 4), act, out);
    }
    // ... not into an F32 output from u8 or u16 (as per-channel weights: "could not create
    // op"; 2026-11-29: a whole-layer graph's u16 -> F32 linears cannot take LPBQ as they are),
    // not packed.
    refused(lpbq(4, false, 4), u8_, f32_, "graphFinalize");
    refused(lpbq(4, false, 4), u16_, f32_, "graphFinalize");
    // ... nor from u8 into u16 (2026-11-29): a 4-bit linear's output takes its input's width.
    refused(lpbq(4, false, 4), u8_, u16_, "graphFinalize");
    refused(lpbq(4, true, 4), u16_, u16_, "tensorCreateGraphTensor");
    // 8-bit values, or 8-bit block scales, overflow the 8-bit expansion: they run, wrongly.
    for enc in [lpbq(8, false, 4), lpbq(4, false, 8)] {
        let off = steps_off(&ok(enc, u8_, u8_));
        assert!(off > 10.0, "{enc:?} now within {off} steps: the HTP expands wider than 8 bits");
    }
    refused(lpbq(4, false, 12), u16_, u16_, "graphFinalize");

    // 16-bit weights: per tensor into F32 (exact up to f32 rounding) or u16 from u8 inputs
    // (within one step); u16 x u16 into u16 is off by about 11 steps of 2^-16 (2^-12.5 of the
    // range, as if accumulated in lower precision), bounded here at 32.
    let int16 = |per_channel| WeightEnc::Int16 { per_channel };
    assert!(steps_off(&ok(int16(false), u16_, f32_)) < 1e-5);
    within_one_step(int16(false), u8_, u16_);
    let off = steps_off(&ok(int16(true), u16_, u16_));
    assert!(off <= 32.0, "W16A16 per channel: {off} steps of 2^-16 off");
    refused(int16(true), u16_, f32_, "graphFinalize");
}
