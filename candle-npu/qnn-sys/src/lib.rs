//! Raw, hand-written FFI for the Qualcomm AI Engine Direct (QNN) C API, HTP backend.
//!
//! Why hand-written: QNN's SDK headers are "Confidential and Proprietary" and must not be vendored,
//! and there is no published binding. Every ABI fact here (sizes, offsets, enum values, function
//! table order, signatures) comes from `shared/QNN_FACTS.md`, which was checked against the real
//! library, and is pinned by compile-time assertions (`layout.rs`).
//!
//! Why loaded at run time: the project must build and run its CPU path on machines with no
//! Qualcomm file at all. [`QnnLibrary::load`] dlopens `libQnnHtp.so`, picks the HTP provider and
//! refuses libraries whose function table is older than the one declared here.
//!
//! This crate is deliberately raw: handles are `*mut c_void`, results are `Qnn_ErrorHandle_t`,
//! and every call is `unsafe`. The safe executor lives in `candle-npu` (`executor::htp`).
//!
//! Layout: [`types`] (`#[repr(C)]` structs and small constructors), [`consts`] (enum values, op
//! and param names), [`interface`] (`QnnInterface_t` and its 71-entry function table),
//! [`loader`] (dlopen, version guard, [`default_lib_dir`]), [`system`] (`libQnnSystem.so`: the graphs and tensor ids a context binary holds).

#![allow(non_camel_case_types, non_snake_case)]

pub mod consts;
pub mod interface;
mod layout;
pub mod loader;
pub mod system;
pub mod types;

pub use consts::*;
pub use interface::*;
pub use loader::*;
pub use system::*;
pub use types::*;

use core::ffi::{c_char, c_int};

extern "C" {
    /// C's `vsnprintf`; `ap` is the `va_list` a [`QnnLog_Callback_t`] received.
    fn vsnprintf(buf: *mut c_char, size: usize, fmt: *const c_char, ap: QnnVaList) -> c_int;
}

/// Formats the printf-style message a [`QnnLog_Callback_t`] receives (`fmt` + `va_list`),
/// truncated to 4 KiB, without the surrounding whitespace QNN includes (` <W> text\n`). Lets a log callback
/// route QNN's messages into the application's logger instead of stdout.
///
/// # Safety
/// Call only inside a QNN log callback, at most once per invocation, with the `fmt` and `args`
/// that invocation received (the `va_list` is consumed).
pub unsafe fn format_log_message(fmt: *const c_char, args: QnnVaList) -> String {
    if fmt.is_null() {
        return String::new();
    }
    let mut buf = [0 as c_char; 4096];
    // SAFETY: `buf` is writable for its length; fmt/args come from the callback (caller's duty).
    let n = unsafe { vsnprintf(buf.as_mut_ptr(), buf.len(), fmt, args) };
    if n < 0 {
        // Formatting failed: fall back to the raw format string.
        // SAFETY: QNN passes a NUL-terminated format string.
        return unsafe { core::ffi::CStr::from_ptr(fmt) }.to_string_lossy().trim().to_owned();
    }
    // SAFETY: vsnprintf always NUL-terminates within `buf` when size > 0.
    let s = unsafe { core::ffi::CStr::from_ptr(buf.as_ptr()) };
    s.to_string_lossy().trim().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_code_is_low_16_bits() {
        assert_eq!(error_code(0), 0);
        assert_eq!(error_code(6004), 6004);
        assert_eq!(error_code(0xABCD_0000_0000_1B5D), 0x1B5D);
    }

    #[test]
    fn execute_tensors_select_their_memory_arm() {
        let buf = Qnn_ClientBuffer_t::empty();
        let raw = Qnn_Tensor_t::for_execute(7, buf);
        let handle = 0x1234 as Qnn_MemHandle_t;
        let shared = Qnn_Tensor_t::for_execute_mem_handle(9, handle);
        // SAFETY: both were built as V1 tensors.
        unsafe {
            assert_eq!((raw.id(), raw.u.v1.memType), (7, QNN_TENSORMEMTYPE_RAW));
            assert_eq!((shared.id(), shared.u.v1.memType), (9, QNN_TENSORMEMTYPE_MEMHANDLE));
            assert_eq!(shared.u.v1.memory.memHandle, handle);
        }
    }

    #[test]
    fn quantize_params_constructors() {
        let q = Qnn_QuantizeParams_t::scale_offset(0.5, -128);
        assert_eq!(q.encodingDefinition, QNN_DEFINITION_DEFINED);
        assert_eq!(q.quantizationEncoding, QNN_QUANTIZATION_ENCODING_SCALE_OFFSET);
        let so = unsafe { q.encoding.scaleOffsetEncoding };
        assert_eq!((so.scale, so.offset), (0.5, -128));
        let u = Qnn_QuantizeParams_t::undefined();
        assert_eq!(u.encodingDefinition, QNN_DEFINITION_UNDEFINED);
        assert_eq!(u.quantizationEncoding, QNN_QUANTIZATION_ENCODING_UNDEFINED);
        let mut per_channel = [Qnn_ScaleOffset_t { scale: 1.0, offset: 0 }; 3];
        let a = Qnn_QuantizeParams_t::axis_scale_offset(0, &mut per_channel);
        let aso = unsafe { a.encoding.axisScaleOffsetEncoding };
        assert_eq!((aso.axis, aso.numScaleOffsets), (0, 3));
        assert_eq!(aso.scaleOffset, per_channel.as_mut_ptr());
    }

    #[test]
    fn scalar_and_param_constructors() {
        let b = Qnn_Scalar_t::bool8(true);
        assert_eq!(b.dataType, QNN_DATATYPE_BOOL_8);
        // The whole 8-byte value is defined: 1 then zeros.
        assert_eq!(unsafe { b.value.uint64Value }, 1);
        let f = Qnn_Scalar_t::f32(1e-6);
        assert_eq!(unsafe { f.value.floatValue }, 1e-6);
        let p = Qnn_Param_t::scalar(QNN_OP_MAT_MUL_PARAM_TRANSPOSE_IN1.as_ptr(), b);
        assert_eq!(p.paramType, QNN_PARAMTYPE_SCALAR);
        assert_eq!(unsafe { p.value.scalarParam.dataType }, QNN_DATATYPE_BOOL_8);
    }

    #[test]
    fn tensor_constructors() {
        let mut dims = [1u32, 4];
        let t = Qnn_Tensor_t::v1(
            c"x".as_ptr(),
            QNN_TENSOR_TYPE_APP_WRITE,
            QNN_DATATYPE_UFIXED_POINT_8,
            Qnn_QuantizeParams_t::scale_offset(0.1, -128),
            2,
            dims.as_mut_ptr(),
            Qnn_ClientBuffer_t::empty(),
        );
        assert_eq!(t.version, QNN_TENSOR_VERSION_1);
        let v1 = unsafe { t.u.v1 };
        assert_eq!((v1.rank, v1.dataType, v1.type_), (2, QNN_DATATYPE_UFIXED_POINT_8, 0));
        let mut data = [0u8; 4];
        let e = Qnn_Tensor_t::for_execute(7, Qnn_ClientBuffer_t::from_slice(&mut data));
        assert_eq!(e.id(), 7);
        assert_eq!(unsafe { e.u.v1.memory.clientBuf.dataSize }, 4);
    }

    #[test]
    fn htp_device_layout_by_backend_version() {
        let v = |major, minor| Qnn_Version_t { major, minor, patch: 0 };
        assert_eq!(HtpDeviceConfigLayout::for_backend_api(v(5, 43)), HtpDeviceConfigLayout::UnionAt4);
        assert_eq!(HtpDeviceConfigLayout::for_backend_api(v(5, 51)), HtpDeviceConfigLayout::UnionAt8);
        assert_eq!(HtpDeviceConfigLayout::for_backend_api(v(6, 0)), HtpDeviceConfigLayout::UnionAt8);
        // The SoC model lands at byte 8 in the new layout and byte 4 in the old one.
        let mut new = HtpDeviceCustomConfig::soc(HtpDeviceConfigLayout::UnionAt8, QNN_SOC_MODEL_SM8650);
        let mut old = HtpDeviceCustomConfig::soc(HtpDeviceConfigLayout::UnionAt4, QNN_SOC_MODEL_SM8650);
        let bytes = |p: *mut core::ffi::c_void, n| unsafe { core::slice::from_raw_parts(p as *const u8, n).to_vec() };
        let nb = bytes(new.as_mut_ptr(), 16);
        let ob = bytes(old.as_mut_ptr(), 12);
        assert_eq!(&nb[0..4], &0u32.to_ne_bytes());
        assert_eq!(&nb[8..12], &57u32.to_ne_bytes());
        assert_eq!(&ob[4..8], &57u32.to_ne_bytes());
    }

    #[test]
    fn the_library_is_looked_for_where_the_variables_say_then_beside_the_program() {
        use std::path::PathBuf;
        // Env vars are process-global: only what holds whatever they are set to.
        let dirs = lib_dir_candidates();
        let exe = std::env::current_exe().unwrap();
        assert!(dirs.iter().any(|d| d == exe.parent().unwrap()), "{dirs:?}");
        match std::env::var_os(ENV_QNN_LIB_DIR).filter(|v| !v.is_empty()) {
            Some(dir) => assert_eq!(default_lib_dir(), PathBuf::from(dir)),
            None => assert!(dirs.contains(&default_lib_dir()), "{dirs:?}"),
        }
        // The assets folder's copy: the variable's, or `assets/` in the current folder (the
        // models' default) when it is unset.
        let assets = std::env::var_os(ENV_ASSETS).filter(|v| !v.is_empty()).map_or_else(|| PathBuf::from("assets"), PathBuf::from);
        assert!(dirs.contains(&assets.join("qnn/onnxruntime_qnn")), "{dirs:?}");
    }
}
