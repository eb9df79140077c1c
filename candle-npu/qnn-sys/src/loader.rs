//! Run-time loading of a QNN backend library: dlopen, `QnnInterface_getProviders`, provider
//! choice and the API version guard.

use std::ffi::CStr;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use thiserror::Error;

use crate::consts::*;
use crate::interface::*;
use crate::types::*;

/// Environment variable naming the folder that holds `libQnnHtp.so` (highest priority).
pub const ENV_QNN_LIB_DIR: &str = "CANDLE_NPU_QNN_LIB_DIR";
/// Environment variable naming the project's assets folder (default `<workspace>/assets`).
pub const ENV_ASSETS: &str = "CANDLE_NPU_ASSETS";

/// The folder expected to hold `libQnnHtp.so`:
/// `$CANDLE_NPU_QNN_LIB_DIR` if set, else `$CANDLE_NPU_ASSETS/qnn/onnxruntime_qnn`, else
/// `<workspace root>/assets/qnn/onnxruntime_qnn` (where `scripts/setup.sh` unpacks the
/// `onnxruntime-qnn` wheel; its sibling `onnxruntime_qnn.libs` must stay next to it for RPATH).
///
/// The workspace root is this crate's source location at build time, which is right for the
/// project's own tests, examples and benches; deployed binaries should set one of the variables.
pub fn default_lib_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(ENV_QNN_LIB_DIR).filter(|v| !v.is_empty()) {
        return PathBuf::from(dir);
    }
    let assets = match std::env::var_os(ENV_ASSETS).filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => {
            // <workspace>/candle-npu/qnn-sys -> <workspace>
            let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
            let root = manifest.parent().and_then(Path::parent);
            root.map_or_else(|| manifest.join("../.."), Path::to_path_buf)
                .join("assets")
        }
    };
    assets.join("qnn").join("onnxruntime_qnn")
}

/// `default_lib_dir()/libQnnHtp.so`.
pub fn default_htp_library_path() -> PathBuf {
    default_lib_dir().join(QNN_HTP_LIBRARY_NAME)
}

/// Why a QNN library could not be loaded. Each variant names the path and what was found.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LoadError {
    #[error(
        "QNN library {path} does not exist (run scripts/setup.sh, or set {ENV_QNN_LIB_DIR} to the \
         folder holding {QNN_HTP_LIBRARY_NAME})"
    )]
    NotFound { path: PathBuf },
    #[error("dlopen of QNN library {path} failed: {message}")]
    Open { path: PathBuf, message: String },
    #[error("{path} is not a QNN backend library: symbol {symbol} not found ({message})")]
    SymbolMissing {
        path: PathBuf,
        symbol: &'static str,
        message: String,
    },
    #[error("{QNN_INTERFACE_GET_PROVIDERS_SYMBOL} in {path} failed with QNN error {code}")]
    GetProviders { path: PathBuf, code: u16 },
    #[error("{path} offers no QNN interface provider")]
    NoProviders { path: PathBuf },
    #[error(
        "{path}: provider {provider} implements QNN core API {found}, but this build needs \
         {need_major}.x with x >= {need_minor}"
    )]
    UnsupportedApi {
        path: PathBuf,
        provider: String,
        found: Qnn_Version_t,
        need_major: u32,
        need_minor: u32,
    },
}

/// A loaded QNN backend library and the provider chosen from it.
///
/// The library stays loaded for as long as this value lives, so every reference and function
/// pointer obtained through [`QnnLibrary::interface`] is valid for the borrow of `self`.
pub struct QnnLibrary {
    path: PathBuf,
    /// Points into the library's static data; valid while `_lib` is loaded.
    interface: *const QnnInterface_t,
    _lib: libloading::Library,
}

// SAFETY: the interface is an immutable table of function pointers and strings in the library's
// static data, valid from any thread while the library is loaded. Whether a given QNN call may
// run concurrently with another is the caller's concern (documented per call by QNN).
unsafe impl Send for QnnLibrary {}
unsafe impl Sync for QnnLibrary {}

impl std::fmt::Debug for QnnLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QnnLibrary")
            .field("path", &self.path)
            .field("backend_id", &self.backend_id())
            .field("provider", &self.provider_name())
            .field("api_version", &self.api_version())
            .finish()
    }
}

/// Serializes loads: the stdout redirection below is process-wide, and two overlapping
/// redirections would leave fd 1 pointing at /dev/null.
static LOAD_LOCK: Mutex<()> = Mutex::new(());

impl QnnLibrary {
    /// Loads the HTP library from [`default_htp_library_path`].
    pub fn load_default() -> Result<Self, LoadError> {
        Self::load(&default_htp_library_path())
    }

    /// dlopens `path`, asks it for its providers and keeps the HTP one (backendId 6), or the
    /// first one that passes the version guard: core API major
    /// [`QNN_API_VERSION_MAJOR`] and minor >= [`QNN_API_VERSION_MINOR`], so that every entry of
    /// [`QnnInterfaceFunctions_t`] exists in the library's table.
    ///
    /// A bare file name (e.g. `libQnnHtp.so`, as on Android where the app's native library folder
    /// is on the loader's search path) is handed to dlopen as is; any other path must exist.
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        let bare_name = path.parent().is_none_or(|p| p.as_os_str().is_empty());
        if !bare_name && !path.exists() {
            return Err(LoadError::NotFound {
                path: path.to_path_buf(),
            });
        }
        let lib = {
            let _guard = LOAD_LOCK.lock().unwrap_or_else(|e| e.into_inner());
            let _quiet = StdoutSilenced::new();
            open(path)
        }
        .map_err(|e| LoadError::Open {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;

        // SAFETY: the symbol's type is QNN's documented signature; the copy of the function
        // pointer is only used while `lib` is alive.
        let get_providers: QnnInterfaceGetProvidersFn = unsafe {
            let sym = lib
                .get::<QnnInterfaceGetProvidersFn>(QNN_INTERFACE_GET_PROVIDERS_SYMBOL.as_bytes())
                .map_err(|e| LoadError::SymbolMissing {
                    path: path.to_path_buf(),
                    symbol: QNN_INTERFACE_GET_PROVIDERS_SYMBOL,
                    message: e.to_string(),
                })?;
            *sym
        };

        let mut list: *const *const QnnInterface_t = std::ptr::null();
        let mut count: u32 = 0;
        // SAFETY: both out-pointers are valid for writes.
        let rc = unsafe { get_providers(&mut list, &mut count) };
        if rc != QNN_SUCCESS {
            return Err(LoadError::GetProviders {
                path: path.to_path_buf(),
                code: error_code(rc),
            });
        }
        if list.is_null() || count == 0 {
            return Err(LoadError::NoProviders {
                path: path.to_path_buf(),
            });
        }
        // SAFETY: the library returned `count` provider pointers at `list` (its static data).
        let providers: Vec<&QnnInterface_t> = unsafe {
            std::slice::from_raw_parts(list, count as usize)
                .iter()
                .filter_map(|p| p.as_ref())
                .collect()
        };
        // HTP first, then the others in the library's order.
        let mut ordered: Vec<&QnnInterface_t> = providers
            .iter()
            .copied()
            .filter(|p| p.backendId == QNN_BACKEND_ID_HTP)
            .collect();
        ordered.extend(
            providers
                .iter()
                .copied()
                .filter(|p| p.backendId != QNN_BACKEND_ID_HTP),
        );
        let Some(preferred) = ordered.first().copied() else {
            return Err(LoadError::NoProviders {
                path: path.to_path_buf(),
            });
        };
        let Some(chosen) = ordered
            .into_iter()
            .find(|p| api_supported(p.apiVersion.coreApiVersion))
        else {
            return Err(LoadError::UnsupportedApi {
                path: path.to_path_buf(),
                // SAFETY: providerName is NULL or a NUL-terminated static string.
                provider: unsafe { c_str_lossy(preferred.providerName) }
                    .unwrap_or_else(|| "<unnamed>".into()),
                found: preferred.apiVersion.coreApiVersion,
                need_major: QNN_API_VERSION_MAJOR,
                need_minor: QNN_API_VERSION_MINOR,
            });
        };
        Ok(Self {
            path: path.to_path_buf(),
            interface: chosen,
            _lib: lib,
        })
    }

    /// The path this library was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The chosen provider: its id, name, versions and function table.
    pub fn interface(&self) -> &QnnInterface_t {
        // SAFETY: points into the library's static data, loaded while `self` lives.
        unsafe { &*self.interface }
    }

    /// Shorthand for `&self.interface().functions`.
    pub fn functions(&self) -> &QnnInterfaceFunctions_t {
        &self.interface().functions
    }

    /// The provider's backend id (6 for HTP).
    pub fn backend_id(&self) -> u32 {
        self.interface().backendId
    }

    /// The provider's name (e.g. `HTP_QTI_AISW`), empty if the library gives none.
    pub fn provider_name(&self) -> String {
        // SAFETY: providerName is NULL or a NUL-terminated static string.
        unsafe { c_str_lossy(self.interface().providerName) }.unwrap_or_default()
    }

    /// Core and backend API versions the provider declares (e.g. core 2.40.0, HTP 5.51.0).
    pub fn api_version(&self) -> Qnn_ApiVersion_t {
        self.interface().apiVersion
    }

    /// Which HTP device custom config layout this library expects (by its backend API version).
    pub fn htp_device_config_layout(&self) -> HtpDeviceConfigLayout {
        HtpDeviceConfigLayout::for_backend_api(self.api_version().backendApiVersion)
    }

    /// The backend's build id (e.g. `v2.51.0.260929181845`) via `backendGetBuildId`;
    /// `None` if the entry is absent or the call fails.
    pub fn backend_build_id(&self) -> Option<String> {
        let f = self.functions().backendGetBuildId?;
        let mut id: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: the out-pointer is valid; the result is a static string of the library.
        unsafe {
            if f(&mut id) != QNN_SUCCESS {
                return None;
            }
            c_str_lossy(id)
        }
    }

    /// Text for a QNN error result; see [`error_message`].
    pub fn error_message(&self, handle: Qnn_ErrorHandle_t) -> String {
        error_message(self, handle)
    }
}

/// The library's message for `handle` (via `errorGetMessage`), prefixed with the error code,
/// e.g. `"QNN error 6004: ..."`. Falls back to the code alone when the library has no message.
pub fn error_message(lib: &QnnLibrary, handle: Qnn_ErrorHandle_t) -> String {
    let code = error_code(handle);
    let text = lib.functions().errorGetMessage.and_then(|f| {
        let mut msg: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: the out-pointer is valid; the message is a string owned by the library.
        unsafe {
            if f(handle, &mut msg) != QNN_SUCCESS {
                return None;
            }
            c_str_lossy(msg)
        }
    });
    match text {
        Some(t) if !t.is_empty() => format!("QNN error {code}: {t}"),
        _ => format!("QNN error {code}"),
    }
}

fn api_supported(core: Qnn_Version_t) -> bool {
    core.major == QNN_API_VERSION_MAJOR && core.minor >= QNN_API_VERSION_MINOR
}

/// Reads a NUL-terminated C string lossily; `None` for NULL.
///
/// # Safety
/// `p` must be NULL or point to a NUL-terminated string that stays valid during the call.
unsafe fn c_str_lossy(p: *const std::ffi::c_char) -> Option<String> {
    if p.is_null() {
        None
    } else {
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
}

/// dlopen with `RTLD_NOW | RTLD_LOCAL`, as QNN's own tools do: missing dependencies show up
/// here rather than as a crash at the first call, and QNN's symbols do not leak into the
/// global namespace (two backends could otherwise clash).
/// Also what candle-npu uses for `libcdsprpc.so`, for the same reasons.
#[cfg(unix)]
pub fn open(path: &Path) -> Result<libloading::Library, libloading::Error> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    // SAFETY: running the library's initializers is the point of loading it.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }.map(Into::into)
}

#[cfg(not(unix))]
pub fn open(path: &Path) -> Result<libloading::Library, libloading::Error> {
    // SAFETY: as above.
    unsafe { libloading::Library::new(path) }
}

/// Points fd 1 at /dev/null until dropped. The HTP library's constructor prints
/// ` # LIBNATIVE: No alternate configuration present ...` to stdout at dlopen, which would
/// corrupt the output of programs whose stdout is data. Best effort: on any failure stdout is
/// left as it is.
struct StdoutSilenced {
    #[cfg(unix)]
    saved: libc::c_int,
}

impl StdoutSilenced {
    #[cfg(unix)]
    fn new() -> Option<Self> {
        // Anything Rust buffered must reach the real stdout, not /dev/null.
        let _ = std::io::stdout().flush();
        // SAFETY: plain fd syscalls on fds this function owns (plus fd 1).
        unsafe {
            libc::fflush(std::ptr::null_mut());
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if null < 0 {
                return None;
            }
            let saved = libc::fcntl(1, libc::F_DUPFD_CLOEXEC, 3);
            if saved < 0 {
                libc::close(null);
                return None;
            }
            if libc::dup2(null, 1) < 0 {
                libc::close(null);
                libc::close(saved);
                return None;
            }
            libc::close(null);
            Some(Self { saved })
        }
    }

    #[cfg(not(unix))]
    fn new() -> Option<Self> {
        None
    }
}

#[cfg(unix)]
impl Drop for StdoutSilenced {
    fn drop(&mut self) {
        // SAFETY: `saved` is the fd this guard duplicated from fd 1.
        unsafe {
            // The library's C stdio buffer may still hold its banner (stdout is fully buffered
            // when it is not a terminal): flush it into /dev/null before restoring fd 1.
            libc::fflush(std::ptr::null_mut());
            libc::dup2(self.saved, 1);
            libc::close(self.saved);
        }
    }
}
