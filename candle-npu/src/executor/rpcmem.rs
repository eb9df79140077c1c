//! Shared buffers for the Hexagon executor on Android: rpcmem buffers from `libcdsprpc.so`,
//! registered with QNN through `memRegister`.
//!
//! # Why
//!
//! On a phone the HTP runs on the cDSP, a separate processor reached through FastRPC. A graph
//! tensor with a client buffer (`QNN_TENSORMEMTYPE_RAW`) is ordinary process memory, so FastRPC
//! copies it to (inputs) or from (outputs) the DSP on **every** `graphExecute`. An rpcmem buffer
//! is allocated from a heap the DSP can map (ION / DMA-BUF, named by a file descriptor):
//! registered once with `memRegister`, QNN maps it into the DSP once, and a tensor that points
//! at the returned handle (`QNN_TENSORMEMTYPE_MEMHANDLE`) is then read and written in place.
//!
//! Order of use: [`RpcMem::load`] -> [`SharedBuffer::alloc`] -> [`register`] (per context) ->
//! set the tensor's `memType`/`memHandle` -> execute -> [`deregister`] -> drop the buffer
//! (`rpcmem_free`). A buffer must be deregistered before it is dropped.
//!
//! When `libcdsprpc.so` cannot be loaded (every x86 machine, the QNN emulator included) or lacks
//! a symbol, [`RpcMem::load`] returns `None` and the executor keeps using client buffers.
//!
//! # What is tested, and what is not
//!
//! This path is **not exercised on x86**: there is no `libcdsprpc.so` and the emulator's
//! `memRegister` has no DSP to share with, so no test here allocates a real rpcmem buffer or
//! calls `memRegister`/`memDeRegister` (`register` and `deregister` are untested; their
//! descriptor follows `shared/QNN_FACTS.md`, whose layouts `qnn-sys` pins at compile time).
//! The unit tests check: that [`RpcMem::load`] returns `None` where `libcdsprpc.so` cannot be
//! dlopened; that a library lacking the symbols is refused with the symbol named (libc stands in
//! for a broken `libcdsprpc.so`); and the [`SharedBuffer`] logic (size limits, null and fd < 0
//! failures, read/write, exactly one `rpcmem_free` per buffer) against mock rpcmem functions
//! written in Rust.

use std::ffi::{c_int, c_void};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use qnn_sys::*;

/// The FastRPC client library of the compute DSP, found by the dynamic linker.
pub(crate) const RPCMEM_LIBRARY: &str = "libcdsprpc.so";
/// `RPCMEM_HEAP_ID_SYSTEM`: non-contiguous memory behind the DSP's SMMU (recommended for cDSP).
const RPCMEM_HEAP_ID_SYSTEM: c_int = 25;
/// `RPCMEM_DEFAULT_FLAGS` (= `ION_FLAG_CACHED`).
const RPCMEM_DEFAULT_FLAGS: u32 = 1;

/// `void* rpcmem_alloc(int heapid, uint32 flags, int size)`: NULL on failure.
type AllocFn = unsafe extern "C" fn(heapid: c_int, flags: u32, size: c_int) -> *mut c_void;
/// `void rpcmem_free(void* po)`.
type FreeFn = unsafe extern "C" fn(po: *mut c_void);
/// `int rpcmem_to_fd(void* po)`: the buffer's file descriptor, negative on failure.
type ToFdFn = unsafe extern "C" fn(po: *mut c_void) -> c_int;
/// `void rpcmem_init(void)` / `void rpcmem_deinit(void)`.
type InitFn = unsafe extern "C" fn();

/// Why [`RpcMem::load_from`] failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LoadError {
    /// The library could not be dlopened (absent, as on x86, or unloadable).
    #[error("cannot load {path}: {reason}")]
    Open { path: PathBuf, reason: String },
    /// The library loaded but lacks a required function.
    #[error("{path} lacks the symbol {symbol}")]
    MissingSymbol { path: PathBuf, symbol: &'static str },
}

/// A loaded `libcdsprpc.so`: the rpcmem allocator whose buffers the DSP can map.
pub(crate) struct RpcMem {
    alloc: AllocFn,
    free: FreeFn,
    to_fd: ToFdFn,
    deinit: Option<InitFn>,
    /// Keeps the functions above loaded; `None` only for the test mock. Declared last: dropped
    /// after [`Drop::drop`] has called `rpcmem_deinit`.
    _lib: Option<libloading::Library>,
}

impl std::fmt::Debug for RpcMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcMem").field("mock", &self._lib.is_none()).finish_non_exhaustive()
    }
}

impl RpcMem {
    /// The process-wide `libcdsprpc.so`, loaded (and `rpcmem_init` called) on first use, or
    /// `None` when it is absent (client buffers are used; logged at debug) or lacks a symbol
    /// (logged as a warning). The result is cached: later calls return the same value.
    pub(crate) fn load() -> Option<Arc<RpcMem>> {
        static MEM: OnceLock<Option<Arc<RpcMem>>> = OnceLock::new();
        MEM.get_or_init(|| match RpcMem::load_from(Path::new(RPCMEM_LIBRARY)) {
            Ok(mem) => {
                tracing::debug!("{RPCMEM_LIBRARY} loaded: graph inputs/outputs use shared rpcmem buffers");
                Some(Arc::new(mem))
            }
            Err(LoadError::Open { reason, .. }) => {
                tracing::debug!("{RPCMEM_LIBRARY} not available ({reason}): using client buffers");
                None
            }
            Err(e @ LoadError::MissingSymbol { .. }) => {
                tracing::warn!("{e}: using client buffers");
                None
            }
        })
        .clone()
    }

    /// Loads the rpcmem functions from `path` (a bare name is searched by the dynamic linker)
    /// and calls `rpcmem_init` when the library has it (some phones need it, others lack it).
    /// The open-source `rpcmem.h` says libcdsprpc initializes itself and init/deinit need not be
    /// called; other QNN/FastRPC clients call them when present, as here. [`RpcMem::load`] does
    /// this once per process.
    pub(crate) fn load_from(path: &Path) -> Result<RpcMem, LoadError> {
        let lib = qnn_sys::loader::open(path).map_err(|e| LoadError::Open { path: path.to_path_buf(), reason: e.to_string() })?;
        let missing = |symbol| LoadError::MissingSymbol { path: path.to_path_buf(), symbol };
        // SAFETY: each type is the C declaration of that symbol in rpcmem.h; the pointers are
        // copied out but stay valid because `lib` is stored next to them (and dropped last).
        let mem = unsafe {
            let alloc = *lib.get::<AllocFn>(b"rpcmem_alloc\0").map_err(|_| missing("rpcmem_alloc"))?;
            let free = *lib.get::<FreeFn>(b"rpcmem_free\0").map_err(|_| missing("rpcmem_free"))?;
            let to_fd = *lib.get::<ToFdFn>(b"rpcmem_to_fd\0").map_err(|_| missing("rpcmem_to_fd"))?;
            let init = lib.get::<InitFn>(b"rpcmem_init\0").ok().map(|s| *s);
            let deinit = lib.get::<InitFn>(b"rpcmem_deinit\0").ok().map(|s| *s);
            if let Some(init) = init {
                init();
            }
            RpcMem { alloc, free, to_fd, deinit, _lib: Some(lib) }
        };
        Ok(mem)
    }

    /// A mock allocator for unit tests: no library, no init/deinit.
    #[cfg(test)]
    fn from_fns(alloc: AllocFn, free: FreeFn, to_fd: ToFdFn) -> RpcMem {
        RpcMem { alloc, free, to_fd, deinit: None, _lib: None }
    }
}

impl Drop for RpcMem {
    fn drop(&mut self) {
        if let Some(deinit) = self.deinit {
            // SAFETY: paired with the `rpcmem_init` of `load_from`; no buffer is left, since
            // every `SharedBuffer` holds an `Arc` of this value.
            unsafe { deinit() };
        }
    }
}

/// One rpcmem buffer of `len` bytes, freed (`rpcmem_free`) on drop. Deregister it from QNN
/// ([`deregister`]) before dropping it.
pub(crate) struct SharedBuffer {
    mem: Arc<RpcMem>,
    ptr: NonNull<u8>,
    len: usize,
    fd: i32,
}

// SAFETY: the buffer is memory this value owns exclusively (like a `Box<[u8]>`): `&self` only
// reads it and writing needs `&mut self`; rpcmem_free may be called from any thread.
unsafe impl Send for SharedBuffer {}
unsafe impl Sync for SharedBuffer {}

impl std::fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuffer").field("len", &self.len).field("fd", &self.fd).finish()
    }
}

impl SharedBuffer {
    /// Allocates `len` bytes (1 to `i32::MAX`: rpcmem sizes are C `int`) from the system heap.
    pub(crate) fn alloc(mem: Arc<RpcMem>, len: usize) -> Result<SharedBuffer, String> {
        let size = match c_int::try_from(len) {
            Ok(size) if size > 0 => size,
            _ => return Err(format!("rpcmem buffer of {len} bytes: size must be 1 to {} bytes", c_int::MAX)),
        };
        // SAFETY: plain C call with valid arguments; a NULL result is handled below.
        let raw = unsafe { (mem.alloc)(RPCMEM_HEAP_ID_SYSTEM, RPCMEM_DEFAULT_FLAGS, size) };
        let Some(ptr) = NonNull::new(raw.cast::<u8>()) else {
            return Err(format!("rpcmem_alloc of {len} bytes failed (out of shared memory?)"));
        };
        // From here on `Drop` frees the buffer, also when the fd check below fails.
        let mut buf = SharedBuffer { mem, ptr, len, fd: -1 };
        // SAFETY: `raw` is a live buffer returned by this library's rpcmem_alloc.
        buf.fd = unsafe { (buf.mem.to_fd)(raw) };
        if buf.fd < 0 {
            return Err(format!("rpcmem_to_fd of a {len}-byte rpcmem buffer returned {}", buf.fd));
        }
        Ok(buf)
    }

    /// The buffer's bytes. Do not hold this borrow across a `graphExecute` that writes the buffer.
    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points at `len` bytes owned by `self` until drop; rpcmem memory is
        // ordinary mapped memory on the CPU side.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The buffer's bytes, writable.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The file descriptor that names the buffer to the DSP (`rpcmem_to_fd`), always >= 0.
    pub(crate) fn fd(&self) -> i32 {
        self.fd
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from this `RpcMem`'s rpcmem_alloc (kept alive by the `Arc`) and is
        // freed exactly once, here.
        unsafe { (self.mem.free)(self.ptr.as_ptr().cast()) };
    }
}

/// Registers `buf` with `context` as a tensor of `dtype` (`QNN_DATATYPE_*`) and `shape`
/// (`QNN_MEM_TYPE_ION`, by the buffer's fd). The handle goes into a tensor's `memHandle` (with
/// `memType = QNN_TENSORMEMTYPE_MEMHANDLE`) and must be passed to [`deregister`] before `buf` is
/// dropped or `context` is freed. Errors are `(QNN error code, message)`; code 0 when the
/// library lacks `memRegister`.
pub(crate) fn register(
    f: &QnnInterfaceFunctions_t,
    context: Qnn_ContextHandle_t,
    buf: &SharedBuffer,
    dtype: Qnn_DataType_t,
    shape: &[u32],
) -> Result<Qnn_MemHandle_t, (u64, String)> {
    let mem_register = f.memRegister.ok_or((0, "library lacks memRegister".to_string()))?;
    let mut dims = shape.to_vec();
    // SAFETY: all members of the union are plain integers and pointers, for which zero is valid.
    let mut info: Qnn_MemInfo_t = unsafe { std::mem::zeroed() };
    info.ionInfo = Qnn_MemIonInfo_t { fd: buf.fd() };
    let desc = Qnn_MemDescriptor_t {
        memShape: Qnn_MemShape_t { numDim: dims.len() as u32, dimSize: dims.as_mut_ptr(), shapeConfig: std::ptr::null() },
        dataType: dtype,
        memType: QNN_MEM_TYPE_ION,
        info,
    };
    let mut handle: Qnn_MemHandle_t = std::ptr::null_mut();
    // SAFETY: `desc` and the `dims` it points at are alive during the call; `handle` is a valid
    // out-pointer for the one descriptor passed; the fd names a live rpcmem buffer.
    let rc = unsafe { mem_register(context, &desc, 1, &mut handle) };
    if rc != QNN_SUCCESS {
        let (len, fd) = (buf.len(), buf.fd());
        let msg = format!("memRegister of a {len}-byte rpcmem buffer (fd {fd}, dtype {dtype:#x}, shape {shape:?})");
        return Err((error_code(rc) as u64, msg));
    }
    Ok(handle)
}

/// Deregisters a handle returned by [`register`]; call before the buffer is dropped.
pub(crate) fn deregister(f: &QnnInterfaceFunctions_t, handle: Qnn_MemHandle_t) -> Result<(), (u64, String)> {
    let mem_deregister = f.memDeRegister.ok_or((0, "library lacks memDeRegister".to_string()))?;
    // SAFETY: `handle` came from `memRegister` and is deregistered once (caller's duty); the
    // pointer covers the one handle passed.
    let rc = unsafe { mem_deregister(&handle, 1) };
    if rc != QNN_SUCCESS {
        return Err((error_code(rc) as u64, "memDeRegister".to_string()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::{alloc, dealloc, Layout};
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    // A mock rpcmem on `std::alloc`: each block starts with a 16-byte header holding its size.
    // Each test has its own counters (tests run in parallel).
    const HEADER: usize = 16;

    fn layout(size: usize) -> Layout {
        Layout::from_size_align(size + HEADER, HEADER).unwrap()
    }

    unsafe fn std_alloc(size: c_int) -> *mut c_void {
        let size = size as usize;
        // SAFETY: the layout is never zero-sized (header); the header is written in bounds.
        unsafe {
            let base = alloc(layout(size));
            assert!(!base.is_null());
            base.cast::<usize>().write(size);
            base.add(HEADER).cast()
        }
    }

    unsafe fn std_free(po: *mut c_void) {
        // SAFETY: `po` came from `std_alloc`, whose header holds the size.
        unsafe {
            let base = po.cast::<u8>().sub(HEADER);
            dealloc(base, layout(base.cast::<usize>().read()));
        }
    }

    static ALLOCS: AtomicUsize = AtomicUsize::new(0);
    static FREES: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn counting_alloc(heapid: c_int, flags: u32, size: c_int) -> *mut c_void {
        assert_eq!((heapid, flags), (25, 1));
        ALLOCS.fetch_add(1, SeqCst);
        // SAFETY: `SharedBuffer::alloc` passes a positive size.
        unsafe { std_alloc(size) }
    }
    unsafe extern "C" fn counting_free(po: *mut c_void) {
        FREES.fetch_add(1, SeqCst);
        // SAFETY: only buffers from `counting_alloc` are freed here.
        unsafe { std_free(po) }
    }
    unsafe extern "C" fn fd_42(_: *mut c_void) -> c_int {
        42
    }
    unsafe extern "C" fn fd_fails(_: *mut c_void) -> c_int {
        -1
    }

    #[test]
    fn shared_buffer_alloc_write_read_free() {
        let mem = Arc::new(RpcMem::from_fns(counting_alloc, counting_free, fd_42));
        let mut a = SharedBuffer::alloc(mem.clone(), 1000).unwrap();
        let mut b = SharedBuffer::alloc(mem.clone(), 3).unwrap();
        assert_eq!((a.len(), a.fd(), b.len()), (1000, 42, 3));
        for (i, x) in a.as_mut_slice().iter_mut().enumerate() {
            *x = i as u8;
        }
        b.as_mut_slice().copy_from_slice(&[7, 8, 9]);
        assert!(a.as_slice().iter().enumerate().all(|(i, &x)| x == i as u8));
        assert_eq!(b.as_slice(), &[7, 8, 9]);
        assert_eq!((ALLOCS.load(SeqCst), FREES.load(SeqCst)), (2, 0));
        drop(a);
        assert_eq!(FREES.load(SeqCst), 1);
        drop(b);
        assert_eq!(FREES.load(SeqCst), 2);

        // A negative fd is an error, and the buffer is still freed (once).
        let bad = Arc::new(RpcMem::from_fns(counting_alloc, counting_free, fd_fails));
        let err = SharedBuffer::alloc(bad, 16).unwrap_err();
        assert!(err.contains("rpcmem_to_fd") && err.contains("-1"), "{err}");
        assert_eq!((ALLOCS.load(SeqCst), FREES.load(SeqCst)), (3, 3));
    }

    static NULL_ALLOCS: AtomicUsize = AtomicUsize::new(0);
    static NULL_FREES: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn null_alloc(_: c_int, _: u32, _: c_int) -> *mut c_void {
        NULL_ALLOCS.fetch_add(1, SeqCst);
        std::ptr::null_mut()
    }
    unsafe extern "C" fn null_free(_: *mut c_void) {
        NULL_FREES.fetch_add(1, SeqCst);
    }

    #[test]
    fn shared_buffer_rejects_bad_sizes_and_null() {
        let mem = Arc::new(RpcMem::from_fns(null_alloc, null_free, fd_42));
        // Sizes rpcmem cannot take are refused before any call.
        for len in [0, i32::MAX as usize + 1, usize::MAX] {
            let err = SharedBuffer::alloc(mem.clone(), len).unwrap_err();
            assert!(err.contains(&len.to_string()), "{err}");
        }
        assert_eq!(NULL_ALLOCS.load(SeqCst), 0);
        // A NULL from rpcmem_alloc is an error, and nothing is freed.
        let err = SharedBuffer::alloc(mem, 64).unwrap_err();
        assert!(err.contains("rpcmem_alloc"), "{err}");
        assert_eq!((NULL_ALLOCS.load(SeqCst), NULL_FREES.load(SeqCst)), (1, 0));
    }

    #[test]
    fn load_is_none_without_libcdsprpc() {
        if open(Path::new(RPCMEM_LIBRARY)).is_ok() {
            eprintln!("{RPCMEM_LIBRARY} is loadable here (a phone?): not checking the fallback");
            return;
        }
        assert!(RpcMem::load().is_none());
        assert!(matches!(RpcMem::load_from(Path::new(RPCMEM_LIBRARY)), Err(LoadError::Open { .. })));
    }

    #[test]
    fn load_from_names_missing_symbol() {
        // libc loads everywhere and has no rpcmem functions: it stands in for a broken library.
        let libc = if cfg!(all(target_os = "linux", target_env = "gnu")) { "libc.so.6" } else { "libc.so" };
        let err = RpcMem::load_from(Path::new(libc)).unwrap_err();
        assert!(matches!(err, LoadError::MissingSymbol { symbol: "rpcmem_alloc", .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains(libc) && msg.contains("rpcmem_alloc"), "{msg}");
    }
}
