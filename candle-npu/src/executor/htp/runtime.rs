//! The loaded library: its log (into `tracing` and a ring that error paths read back), backend
//! and device.

use super::*;

pub(super) static LOG_SEQ: AtomicU64 = AtomicU64::new(0);
pub(super) static LOG_RING: Mutex<std::collections::VecDeque<(u64, String)>> = Mutex::new(std::collections::VecDeque::new());
pub(super) const LOG_RING_LEN: usize = 128;

pub(super) unsafe extern "C" fn log_callback(fmt: *const c_char, level: u32, _timestamp: u64, args: QnnVaList) {
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

pub(super) fn log_mark() -> u64 {
    LOG_SEQ.load(Ordering::Relaxed)
}

/// Error lines QNN logged after `mark`; the last few, joined.
pub(super) fn log_errors_since(mark: u64) -> Vec<String> {
    let ring = LOG_RING.lock().unwrap_or_else(|e| e.into_inner());
    let lines: Vec<String> = ring.iter().filter(|(seq, _)| *seq > mark).map(|(_, m)| m.clone()).collect();
    lines[lines.len().saturating_sub(6)..].to_vec()
}

pub(super) fn with_log(msg: String, lines: &[String]) -> String {
    if lines.is_empty() {
        msg
    } else {
        format!("{msg} (QNN log: {})", lines.join(" | "))
    }
}

// ------------------------------------------------------------------------------------------------
// Runtime: library, log, backend, device.
// ------------------------------------------------------------------------------------------------

pub(super) struct Runtime {
    pub(super) lib: QnnLibrary,
    pub(super) log: Qnn_LogHandle_t,
    pub(super) backend: Qnn_BackendHandle_t,
    pub(super) device: Qnn_DeviceHandle_t,
    pub(super) config: HtpConfig,
}

// SAFETY: the handles are opaque pointers owned by this value; QNN's log, backend and device
// handles may be used from any thread (graphs are prepared and executed from several).
unsafe impl Send for Runtime {}
unsafe impl Sync for Runtime {}

impl Runtime {
    pub(super) fn f(&self) -> &QnnInterfaceFunctions_t {
        self.lib.functions()
    }

    pub(super) fn message(&self, rc: Qnn_ErrorHandle_t) -> String {
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
