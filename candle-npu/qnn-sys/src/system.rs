//! `libQnnSystem.so`: what a context binary says about itself, read without a backend.
//!
//! Why: a context binary loaded with `contextCreateFromBinary` gives back graph handles only; the
//! tensor ids execute needs are what the caller recorded when it built the graphs. The System
//! library parses the binary's own metadata, so those recorded ids can be checked against the
//! tensors the binary really holds ([`QnnSystemLibrary::graph_io`]) instead of being trusted.
//!
//! Layout facts (verified on the x86_64 `libQnnSystem.so` of `onnxruntime-qnn` 2.7.0: System
//! API 1.15, core API 2.40; checked against the tensor names this crate gave the graphs):
//! - `QnnSystemInterface_t`: `backendId` u32, `providerName`, `systemApiVersion`
//!   (`Qnn_Version_t`), then the function table; its first entries are `systemContextCreate`,
//!   `systemContextGetBinaryInfo`, `systemContextGetMetadata`, `systemContextFree`.
//! - `QnnSystemContext_BinaryInfo_t` is a version tag then a union; the library here fills
//!   version 3, which holds `numGraphs` / `graphs` at union offsets 88 / 96.
//! - `QnnSystemContext_GraphInfo_t` is a version tag then a union whose members start with
//!   `graphName`, `numGraphInputs`, `graphInputs`, `numGraphOutputs`, `graphOutputs`; the array's
//!   stride is the union's size in the library's build, 88 bytes with version 3 (the tag does not
//!   tell it: a library that knows version 3 may still fill version 1). Tensors are
//!   [`Qnn_Tensor_t`] (144 bytes), whose V1 and V2 both start with `id` and `name`.
//!
//! Anything but that verified combination is reported as [`GraphIoError::Unknown`], never
//! guessed at.

use std::ffi::{c_char, c_void, CStr};
use std::path::{Path, PathBuf};

use crate::consts::QNN_SUCCESS;
use crate::loader::{check_elf, open, LoadError};
use crate::types::*;

/// The library's file name.
pub const QNN_SYSTEM_LIBRARY_NAME: &str = "libQnnSystem.so";
/// The symbol `libQnnSystem.so` exports.
pub const QNN_SYSTEM_INTERFACE_GET_PROVIDERS_SYMBOL: &str = "QnnSystemInterface_getProviders";

/// `QnnSystemContext_Handle_t`.
pub type QnnSystemContext_Handle_t = *mut c_void;

/// The first entries of the System function table (all this crate calls).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct QnnSystemFunctions_t {
    pub systemContextCreate: Option<unsafe extern "C" fn(out: *mut QnnSystemContext_Handle_t) -> Qnn_ErrorHandle_t>,
    /// Deprecated by `systemContextGetMetadata` (which does not need a mutable buffer).
    pub systemContextGetBinaryInfo: Option<unsafe extern "C" fn()>,
    pub systemContextGetMetadata:
        Option<unsafe extern "C" fn(ctx: QnnSystemContext_Handle_t, binary: *const c_void, size: u64, info: *mut *const c_void) -> Qnn_ErrorHandle_t>,
    pub systemContextFree: Option<unsafe extern "C" fn(ctx: QnnSystemContext_Handle_t) -> Qnn_ErrorHandle_t>,
}

/// `QnnSystemInterface_t` up to the entries of [`QnnSystemFunctions_t`].
#[repr(C)]
pub struct QnnSystemInterface_t {
    pub backendId: u32,
    pub providerName: *const c_char,
    pub systemApiVersion: Qnn_Version_t,
    pub functions: QnnSystemFunctions_t,
}

/// Signature of `QnnSystemInterface_getProviders`.
pub type QnnSystemInterfaceGetProvidersFn =
    unsafe extern "C" fn(provider_list: *mut *const *const QnnSystemInterface_t, num_providers: *mut u32) -> Qnn_ErrorHandle_t;

/// One graph of a context binary: its name, and the ids and names of its inputs and outputs in
/// the binary's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphIo {
    pub name: String,
    pub inputs: Vec<(u32, String)>,
    pub outputs: Vec<(u32, String)>,
}

/// Why a binary's graphs could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GraphIoError {
    /// The library refused the binary (QNN error code and its number).
    Refused(u16),
    /// A struct version this crate has no verified layout for: the ids cannot be checked.
    Unknown(String),
}

impl std::fmt::Display for GraphIoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GraphIoError::Refused(code) => write!(f, "the QNN System library cannot read this context binary (QNN error {code})"),
            GraphIoError::Unknown(what) => {
                write!(f, "{what}, whose layout this build does not know")
            }
        }
    }
}

/// A loaded `libQnnSystem.so` and its provider.
pub struct QnnSystemLibrary {
    path: PathBuf,
    functions: QnnSystemFunctions_t,
    _lib: libloading::Library,
}

// SAFETY: the function table is copied out of the library's static data; the library stays
// loaded while `self` lives; each call creates and frees its own System context.
unsafe impl Send for QnnSystemLibrary {}
unsafe impl Sync for QnnSystemLibrary {}

impl std::fmt::Debug for QnnSystemLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QnnSystemLibrary").field("path", &self.path).finish()
    }
}

impl QnnSystemLibrary {
    /// dlopens `path` (checked as [`crate::QnnLibrary::load`] checks a backend) and takes its
    /// first provider of System API major 1 that has the entries [`Self::graph_io`] calls.
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        let p = path.to_path_buf();
        if !path.exists() {
            return Err(LoadError::NotFound { path: p });
        }
        check_elf(path).map_err(|reason| LoadError::NotLoadable { path: p.clone(), reason })?;
        let lib = open(path).map_err(|e| LoadError::Open { path: p.clone(), message: e.to_string() })?;
        // SAFETY: QNN's documented signature; the pointer is used only while `lib` lives.
        let get: QnnSystemInterfaceGetProvidersFn = unsafe {
            *lib.get::<QnnSystemInterfaceGetProvidersFn>(QNN_SYSTEM_INTERFACE_GET_PROVIDERS_SYMBOL.as_bytes()).map_err(|e| LoadError::SymbolMissing {
                path: p.clone(),
                symbol: QNN_SYSTEM_INTERFACE_GET_PROVIDERS_SYMBOL,
                message: e.to_string(),
            })?
        };
        let mut list: *const *const QnnSystemInterface_t = std::ptr::null();
        let mut count = 0u32;
        // SAFETY: valid out-pointers.
        let rc = unsafe { get(&mut list, &mut count) };
        if rc != QNN_SUCCESS {
            return Err(LoadError::GetProviders { path: p, code: error_code(rc) });
        }
        if list.is_null() {
            return Err(LoadError::NoProviders { path: p });
        }
        // SAFETY: the library returned `count` provider pointers at `list` (its static data).
        let providers = unsafe { std::slice::from_raw_parts(list, count as usize) };
        let chosen = providers.iter().filter_map(|&q| unsafe { q.as_ref() }).find(|q| {
            let f = &q.functions;
            q.systemApiVersion.major == 1 && f.systemContextCreate.is_some() && f.systemContextGetMetadata.is_some() && f.systemContextFree.is_some()
        });
        let Some(chosen) = chosen else {
            return Err(LoadError::NoProviders { path: p });
        };
        Ok(QnnSystemLibrary { path: p, functions: chosen.functions, _lib: lib })
    }

    /// The path this library was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The graphs of the context binary `binary`, with their inputs' and outputs' ids and names.
    pub fn graph_io(&self, binary: &[u8]) -> Result<Vec<GraphIo>, GraphIoError> {
        let f = &self.functions;
        let (create, metadata, free) = (f.systemContextCreate.unwrap(), f.systemContextGetMetadata.unwrap(), f.systemContextFree.unwrap());
        let mut ctx: QnnSystemContext_Handle_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        let rc = unsafe { create(&mut ctx) };
        if rc != QNN_SUCCESS {
            return Err(GraphIoError::Refused(error_code(rc)));
        }
        let mut info: *const c_void = std::ptr::null();
        // SAFETY: the binary outlives the call; the info it returns lives until `free(ctx)`,
        // and is read (copied out) before that.

        unsafe {
            let rc = metadata(ctx, binary.as_ptr().cast(), binary.len() as u64, &mut info);
            let out = if rc != QNN_SUCCESS { Err(GraphIoError::Refused(error_code(rc))) } else { read_binary_info(info.cast()) };
            free(ctx);
            out
        }
    }
}

/// Reads `numGraphs` / `graphs` of a `QnnSystemContext_BinaryInfo_t` (see the module docs).
///
/// # Safety
/// `info` is NULL or points to a binary info the System library filled.
unsafe fn read_binary_info(info: *const u8) -> Result<Vec<GraphIo>, GraphIoError> {
    if info.is_null() {
        return Err(GraphIoError::Refused(0));
    }
    // Only the layout verified on the library: the graph array's stride is the size of the
    // library's own `QnnSystemContext_GraphInfo_t` union, which its version tags do not give.
    let (n_at, graphs_at) = match read::<u32>(info, 0) {
        3 => (8 + 88, 8 + 96),
        v => return Err(GraphIoError::Unknown(format!("binary info version {v}"))),
    };
    let n = read::<u32>(info, n_at) as usize;
    let graphs = read::<*const u8>(info, graphs_at);
    if n > 0 && graphs.is_null() {
        return Err(GraphIoError::Refused(0));
    }
    (0..n)
        .map(|i| {
            let g = graphs.add(i * graph_info_stride(read::<u32>(graphs, 0))?);
            let version = read::<u32>(g, 0);
            graph_info_stride(version)?;
            Ok(GraphIo {
                name: c_str(read::<*const c_char>(g, 8)),
                inputs: tensors(read::<u32>(g, 16), read::<*const u8>(g, 24))?,
                outputs: tensors(read::<u32>(g, 32), read::<*const u8>(g, 40))?,
            })
        })
        .collect()
}

/// The size of one `QnnSystemContext_GraphInfo_t` (the array's stride) in the library whose
/// binary info is version 3 (verified): 88 bytes, its graph infos version 3.
fn graph_info_stride(version: u32) -> Result<usize, GraphIoError> {
    match version {
        3 => Ok(88),
        v => Err(GraphIoError::Unknown(format!("graph info version {v}"))),
    }
}

/// Ids and names of `n` `Qnn_Tensor_t` at `at`.
unsafe fn tensors(n: u32, at: *const u8) -> Result<Vec<(u32, String)>, GraphIoError> {
    if n > 0 && at.is_null() {
        return Err(GraphIoError::Refused(0));
    }
    (0..n as usize)
        .map(|i| {
            let t = at.add(i * std::mem::size_of::<Qnn_Tensor_t>());
            match read::<u32>(t, 0) {
                1 | 2 => Ok((read::<u32>(t, 8), c_str(read::<*const c_char>(t, 16)))),
                v => Err(GraphIoError::Unknown(format!("tensor version {v}"))),
            }
        })
        .collect()
}

unsafe fn read<T: Copy>(base: *const u8, offset: usize) -> T {
    base.add(offset).cast::<T>().read_unaligned()
}

unsafe fn c_str(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}
