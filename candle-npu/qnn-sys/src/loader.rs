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
/// Environment variable naming the project's assets folder, where `scripts/setup.sh` unpacks
/// the QNN library (under `qnn/onnxruntime_qnn`). The workspace's `.cargo/config.toml` sets it
/// to the checkout's `assets/` for every `cargo run` / `cargo test` there.
pub const ENV_ASSETS: &str = "CANDLE_NPU_ASSETS";

/// The folders searched for `libQnnHtp.so`, in order:
/// 1. `$CANDLE_NPU_QNN_LIB_DIR`;
/// 2. `$CANDLE_NPU_ASSETS/qnn/onnxruntime_qnn` (where `scripts/setup.sh` unpacks the
///    `onnxruntime-qnn` wheel; its sibling `onnxruntime_qnn.libs` must stay next to it, for RPATH),
///    or `assets/qnn/onnxruntime_qnn` in the current folder when the variable is unset (the models'
///    default too: a binary run from the checkout finds both);
/// 3. the running program's own folder (an app shipped with its QNN libraries beside it);
/// 4. each folder of `LD_LIBRARY_PATH` (as a QNN SDK's `envsetup.sh`, or an Android shell, sets it).
///
/// Nothing is fixed at build time: a program finds the library the same way wherever it was
/// built. Empty variables count as unset.
pub fn lib_dir_candidates() -> Vec<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    let mut dirs = vec![];
    dirs.extend(var(ENV_QNN_LIB_DIR).map(PathBuf::from));
    dirs.push(var(ENV_ASSETS).map_or_else(|| PathBuf::from("assets"), PathBuf::from).join("qnn").join("onnxruntime_qnn"));
    dirs.extend(std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)));
    if let Some(paths) = var("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&paths).filter(|p| !p.as_os_str().is_empty()));
    }
    dirs
}

/// The folder `libQnnHtp.so` is loaded from by default: `$CANDLE_NPU_QNN_LIB_DIR` when set
/// (taken as given), else the first of [`lib_dir_candidates`] holding the library, else the first
/// candidate (so that the error names a path: `$CANDLE_NPU_ASSETS`'s, or the program's folder).
pub fn default_lib_dir() -> PathBuf {
    let dirs = lib_dir_candidates();
    if std::env::var_os(ENV_QNN_LIB_DIR).is_some_and(|v| !v.is_empty()) {
        return dirs[0].clone();
    }
    dirs.iter().find(|d| d.join(QNN_HTP_LIBRARY_NAME).is_file()).or(dirs.first()).cloned().unwrap_or_default()
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
        "QNN library {path} does not exist (it is looked for in ${ENV_QNN_LIB_DIR}, \
         ${ENV_ASSETS}/qnn/onnxruntime_qnn, the program's folder and LD_LIBRARY_PATH: run \
         scripts/setup.sh and set {ENV_ASSETS} to its folder, or set {ENV_QNN_LIB_DIR} to the \
         folder holding {QNN_HTP_LIBRARY_NAME})"
    )]
    NotFound { path: PathBuf },
    /// Refused before dlopen, from the file's ELF header ([`check_elf`]): not a regular file,
    /// not an ELF shared library, or one of another architecture than this process's.
    #[error("QNN library {path} {reason}")]
    NotLoadable { path: PathBuf, reason: String },
    #[error("dlopen of QNN library {path} failed: {message}")]
    Open { path: PathBuf, message: String },
    #[error("{path} is not a QNN backend library: symbol {symbol} not found ({message})")]
    SymbolMissing { path: PathBuf, symbol: &'static str, message: String },
    #[error("{QNN_INTERFACE_GET_PROVIDERS_SYMBOL} in {path} failed with QNN error {code}")]
    GetProviders { path: PathBuf, code: u16 },
    #[error("{path} offers no QNN interface provider")]
    NoProviders { path: PathBuf },
    #[error(
        "{path}: provider {provider} implements QNN core API {found}, but this build needs \
         {need_major}.x with x >= {need_minor}"
    )]
    UnsupportedApi { path: PathBuf, provider: String, found: Qnn_Version_t, need_major: u32, need_minor: u32 },
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
    /// is on the loader's search path) is handed to dlopen as is; any other path must exist and
    /// pass [`check_elf`] (dlopen reports a library of another architecture as "No such file
    /// or directory").
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        let bare_name = path.parent().is_none_or(|p| p.as_os_str().is_empty());
        if !bare_name && !path.exists() {
            return Err(LoadError::NotFound { path: path.to_path_buf() });
        }
        if !bare_name {
            check_elf(path).map_err(|reason| LoadError::NotLoadable { path: path.to_path_buf(), reason })?;
        }
        let lib = {
            let _guard = LOAD_LOCK.lock().unwrap_or_else(|e| e.into_inner());
            let _quiet = StdoutSilenced::new();
            open(path)
        }
        .map_err(|e| LoadError::Open { path: path.to_path_buf(), message: e.to_string() })?;

        // SAFETY: the symbol's type is QNN's documented signature; the copy of the function
        // pointer is only used while `lib` is alive.
        let get_providers: QnnInterfaceGetProvidersFn = unsafe {
            let sym = lib.get::<QnnInterfaceGetProvidersFn>(QNN_INTERFACE_GET_PROVIDERS_SYMBOL.as_bytes()).map_err(|e| LoadError::SymbolMissing {
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
            return Err(LoadError::GetProviders { path: path.to_path_buf(), code: error_code(rc) });
        }
        if list.is_null() || count == 0 {
            return Err(LoadError::NoProviders { path: path.to_path_buf() });
        }
        // SAFETY: the library returned `count` provider pointers at `list` (its static data).
        let providers: Vec<&QnnInterface_t> = unsafe { std::slice::from_raw_parts(list, count as usize).iter().filter_map(|p| p.as_ref()).collect() };
        // HTP first, then the others in the library's order.
        let mut ordered: Vec<&QnnInterface_t> = providers.iter().copied().filter(|p| p.backendId == QNN_BACKEND_ID_HTP).collect();
        ordered.extend(providers.iter().copied().filter(|p| p.backendId != QNN_BACKEND_ID_HTP));
        let Some(preferred) = ordered.first().copied() else {
            return Err(LoadError::NoProviders { path: path.to_path_buf() });
        };
        let Some(chosen) = ordered.into_iter().find(|p| api_supported(p.apiVersion.coreApiVersion)) else {
            return Err(LoadError::UnsupportedApi {
                path: path.to_path_buf(),
                // SAFETY: providerName is NULL or a NUL-terminated static string.
                provider: unsafe { c_str_lossy(preferred.providerName) }.unwrap_or_else(|| "<unnamed>".into()),
                found: preferred.apiVersion.coreApiVersion,
                need_major: QNN_API_VERSION_MAJOR,
                need_minor: QNN_API_VERSION_MINOR,
            });
        };
        Ok(Self { path: path.to_path_buf(), interface: chosen, _lib: lib })
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

/// ELF `e_machine` values and the names `std::env::consts::ARCH` gives them (Hexagon's: the
/// DSP-side `lib*Skel.so` files QNN ships next to the host libraries).
const ELF_MACHINES: [(u16, &str); 6] = [(3, "x86"), (40, "arm"), (62, "x86_64"), (164, "hexagon"), (183, "aarch64"), (243, "riscv64")];

/// Checks, from its ELF header, that `path` is a shared library this process can dlopen:
/// `Err` says what it is instead, e.g. "is an aarch64 ELF library; this process is x86_64".
/// Only the first 20 bytes are read (magic, class, byte order, `e_type` at 16, `e_machine` at
/// 18), after the metadata says it is a regular file (opening a FIFO would block). A process
/// architecture missing from the table is not checked; off Linux and Android nothing is (other
/// systems' libraries are not ELF).
pub fn check_elf(path: &Path) -> Result<(), String> {
    if !cfg!(any(target_os = "linux", target_os = "android")) {
        return Ok(());
    }
    use std::io::Read;
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot be read: {e}"))?;
    if !meta.is_file() {
        return Err("is not a regular file".into());
    }
    let mut head = [0u8; 20];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut head)).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            format!("is not an ELF shared library ({} bytes)", meta.len())
        }
        _ => format!("cannot be read: {e}"),
    })?;
    if &head[..4] != b"\x7fELF" {
        return Err("is not an ELF shared library".into());
    }
    let half = |at: usize| match head[5] {
        2 => u16::from_be_bytes([head[at], head[at + 1]]),
        _ => u16::from_le_bytes([head[at], head[at + 1]]),
    };
    let (e_type, e_machine) = (half(16), half(18));
    const ET_DYN: u16 = 3;
    if e_type != ET_DYN {
        return Err(format!("is an ELF file but not a shared library (e_type {e_type})"));
    }
    let name_of = |m: u16| ELF_MACHINES.iter().find(|(id, _)| *id == m).map(|(_, n)| *n);
    let here = std::env::consts::ARCH;
    let Some(expected) = ELF_MACHINES.iter().find(|(_, n)| *n == here).map(|(id, _)| *id) else {
        return Ok(());
    };
    if e_machine != expected {
        let lib = match name_of(e_machine) {
            Some(n) if n.starts_with(['a', 'e', 'i', 'o', 'u', 'x']) => format!("an {n} ELF library"),
            Some(n) => format!("a {n} ELF library"),
            None => format!("an ELF library for machine {e_machine}"),
        };
        return Err(format!("is {lib}; this process is {here}"));
    }
    let class = match head[4] {
        1 => 32,
        2 => 64,
        c => return Err(format!("is an ELF file of unknown class {c}")),
    };
    let bits = usize::BITS;
    if class != bits {
        return Err(format!("is a {class}-bit ELF library; this process is {here} ({bits}-bit)"));
    }
    Ok(())
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

#[cfg(all(test, any(target_os = "linux", target_os = "android")))]
mod tests {
    use super::*;

    /// A 20-byte ELF header: 64-bit little-endian, `e_type`, `e_machine`.
    fn elf_header(e_type: u16, e_machine: u16) -> Vec<u8> {
        let mut h = b"\x7fELF\x02\x01\x01".to_vec();
        h.resize(16, 0);
        h.extend_from_slice(&e_type.to_le_bytes());
        h.extend_from_slice(&e_machine.to_le_bytes());
        h.resize(64, 0);
        h
    }

    fn file(tag: &str, bytes: &[u8]) -> PathBuf {
        let p = std::env::temp_dir().join(format!("qnn-sys-elf-{tag}-{}.so", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn a_library_of_another_architecture_is_named_before_dlopen() {
        // aarch64 (183) on any other host; x86_64 (62) on an aarch64 one.
        let (foreign, name) = if std::env::consts::ARCH == "aarch64" { (62, "x86_64") } else { (183, "aarch64") };
        let p = file("arch", &elf_header(3, foreign));
        let why = check_elf(&p).unwrap_err();
        let here = std::env::consts::ARCH;
        assert_eq!(why, format!("is an {name} ELF library; this process is {here}"));
        let err = QnnLibrary::load(&p).unwrap_err();
        assert!(matches!(&err, LoadError::NotLoadable { path, .. } if *path == p), "{err:?}");
        assert_eq!(err.to_string(), format!("QNN library {} {why}", p.display()));
        // The same header for this process's machine passes (when the table knows it).
        if let Some((native, _)) = ELF_MACHINES.iter().find(|(_, n)| *n == here) {
            std::fs::write(&p, elf_header(3, *native)).unwrap();
            assert_eq!(check_elf(&p), Ok(()));
            // An executable or object file, not a shared library.
            std::fs::write(&p, elf_header(1, *native)).unwrap();
            assert!(check_elf(&p).unwrap_err().contains("not a shared library (e_type 1)"));
        }
        std::fs::write(&p, elf_header(3, 164)).unwrap();
        assert!(check_elf(&p).unwrap_err().starts_with("is a hexagon ELF library"));
        std::fs::remove_file(p).ok();
    }

    #[test]
    fn text_short_and_special_files_are_not_elf_libraries() {
        let p = file("text", b"INPUT(libQnnHtp.so.2)\n");
        assert_eq!(check_elf(&p).unwrap_err(), "is not an ELF shared library");
        std::fs::write(&p, b"\x7fELF").unwrap();
        assert_eq!(check_elf(&p).unwrap_err(), "is not an ELF shared library (4 bytes)");
        std::fs::remove_file(p).ok();
        assert_eq!(check_elf(Path::new("/dev/zero")).unwrap_err(), "is not a regular file");
        assert!(check_elf(&std::env::temp_dir()).unwrap_err().contains("not a regular file"));
    }
}
