//! `#[repr(C)]` data types of the QNN C API, written by hand from `QNN_FACTS.md`.
//!
//! Field names keep QNN's C spelling (`dataType`, `clientBuf`, ...) so that code reads the same
//! as QNN's documentation. Every size, alignment and listed offset is pinned by a compile-time
//! assertion in `layout.rs`; a wrong layout does not build.
//!
//! The constructors here only fill in structs; they never dereference the raw pointers they
//! store. Whoever passes the struct to QNN must keep the pointed-to memory (names, dims, data,
//! param and tensor arrays) alive and unmoved for the duration of the call.

use core::ffi::{c_char, c_void};
use core::ptr;

use crate::consts::*;

/// Result of every QNN call. The error code is its low 16 bits ([`error_code`]); 0 is success.
pub type Qnn_ErrorHandle_t = u64;

/// Opaque handle to a backend instance.
pub type Qnn_BackendHandle_t = *mut c_void;
/// Opaque handle to a context (owns graphs and their compiled form).
pub type Qnn_ContextHandle_t = *mut c_void;
/// Opaque handle to a device.
pub type Qnn_DeviceHandle_t = *mut c_void;
/// Opaque handle to a graph.
pub type Qnn_GraphHandle_t = *mut c_void;
/// Opaque handle to a logger.
pub type Qnn_LogHandle_t = *mut c_void;
/// Opaque handle to a registered memory buffer.
pub type Qnn_MemHandle_t = *mut c_void;
/// Opaque handle to a profiler.
pub type Qnn_ProfileHandle_t = *mut c_void;
/// Opaque handle to a signal (used to abort/time out finalize and execute).
pub type Qnn_SignalHandle_t = *mut c_void;

/// `Qnn_DataType_t`: one of the `QNN_DATATYPE_*` constants.
pub type Qnn_DataType_t = u32;
/// `Qnn_TensorType_t`: one of the `QNN_TENSOR_TYPE_*` constants.
pub type Qnn_TensorType_t = u32;
/// `QnnLog_Level_t`: one of the `QNN_LOG_LEVEL_*` constants.
pub type QnnLog_Level_t = u32;
/// `QnnProfile_Level_t`: one of the `QNN_PROFILE_LEVEL_*` constants.
pub type QnnProfile_Level_t = u32;
/// `QnnProfile_EventId_t`.
pub type QnnProfile_EventId_t = u64;
/// `QnnHtpGraph_ConfigOption_t`.
pub type QnnHtpGraph_ConfigOption_t = u32;
/// `QnnHtpDevice_ConfigOption_t`.
pub type QnnHtpDevice_ConfigOption_t = u32;

/// The QNN error code of a result: its low 16 bits (the upper bits may carry backend detail).
#[inline]
pub const fn error_code(handle: Qnn_ErrorHandle_t) -> u16 {
    (handle & 0xFFFF) as u16
}

/// Opaque stand-in for the C `va_list` that QNN's log callback receives.
///
/// As a function parameter, `va_list` is passed as a pointer on both LP64 targets this crate is
/// for (x86_64: the array type decays; aarch64: a 32-byte struct is passed by reference), so a
/// `*mut c_void` is ABI-compatible and can be handed on to C's `vsnprintf`
/// (see [`crate::format_log_message`]).
pub type QnnVaList = *mut c_void;

/// `QnnLog_Callback_t`: called by the library (from any of its threads) for each log line.
pub type QnnLog_Callback_t = Option<unsafe extern "C" fn(fmt: *const c_char, level: QnnLog_Level_t, timestamp: u64, args: QnnVaList)>;

/// `Qnn_Version_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Qnn_Version_t {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl core::fmt::Display for Qnn_Version_t {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// `Qnn_ApiVersion_t`: the core API version (function table and common types) and the backend
/// API version (backend-specific custom configs, e.g. HTP 5.51).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Qnn_ApiVersion_t {
    pub coreApiVersion: Qnn_Version_t,
    pub backendApiVersion: Qnn_Version_t,
}

// ---------------------------------------------------------------------------------------------
// Quantization
// ---------------------------------------------------------------------------------------------

/// `Qnn_ScaleOffset_t`: `float = (q + offset) * scale`, so `offset` is the NEGATED zero point
/// (u8 with zero point 128 has offset -128).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Qnn_ScaleOffset_t {
    pub scale: f32,
    pub offset: i32,
}

/// `Qnn_AxisScaleOffset_t`: per-channel quantization along `axis`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Qnn_AxisScaleOffset_t {
    pub axis: i32,
    pub numScaleOffsets: u32,
    pub scaleOffset: *mut Qnn_ScaleOffset_t,
}

/// `Qnn_BlockwiseExpansion_t` (LPBQ, "low-power block quantization"): a float scale per channel
/// along `axis` (offsets 0) times an unsigned `blockScaleBitwidth`-bit integer scale per block of
/// the other dimension, so a weight is `q * block_scale * channel_scale`. The HTP expands the
/// block scales into the integer weights, which is why they must be integers.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Qnn_BlockwiseExpansion_t {
    pub axis: i32,
    /// One per channel along `axis` (the count is the axis' dimension, not stored).
    pub scaleOffsets: *mut Qnn_ScaleOffset_t,
    pub numBlocksPerAxis: u32,
    pub blockScaleBitwidth: u32,
    /// `QNN_BLOCKWISE_EXPANSION_BITWIDTH_SCALE_STORAGE_*`.
    pub blockScaleStorageType: u32,
    /// `u8` (storage 8) or `u16` (storage 16) block scales at `[channel * numBlocksPerAxis +
    /// block]` (a C union of two pointers).
    pub blocksScale: *mut c_void,
}

/// The encoding union of `Qnn_QuantizeParams_t` (32 bytes). Only the encodings the project
/// uses are typed; `_reserved` gives the union the size of the largest C member
/// (bit-width per-axis encoding) so the enclosing struct has the right size.
#[repr(C)]
#[derive(Clone, Copy)]
pub union Qnn_QuantizeParamsEncoding_t {
    /// For `QNN_QUANTIZATION_ENCODING_SCALE_OFFSET`.
    pub scaleOffsetEncoding: Qnn_ScaleOffset_t,
    /// For `QNN_QUANTIZATION_ENCODING_AXIS_SCALE_OFFSET`.
    pub axisScaleOffsetEncoding: Qnn_AxisScaleOffset_t,
    /// For `QNN_QUANTIZATION_ENCODING_BLOCKWISE_EXPANSION` (a pointer, unlike the others).
    pub blockwiseExpansion: *mut Qnn_BlockwiseExpansion_t,
    pub _reserved: [u64; 4],
}

/// `Qnn_QuantizeParams_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Qnn_QuantizeParams_t {
    /// `QNN_DEFINITION_*`.
    pub encodingDefinition: u32,
    /// `QNN_QUANTIZATION_ENCODING_*`.
    pub quantizationEncoding: u32,
    pub encoding: Qnn_QuantizeParamsEncoding_t,
}

impl Qnn_QuantizeParams_t {
    /// Params of an unquantized tensor (float, int, bool).
    pub const fn undefined() -> Self {
        Self {
            encodingDefinition: QNN_DEFINITION_UNDEFINED,
            quantizationEncoding: QNN_QUANTIZATION_ENCODING_UNDEFINED,
            encoding: Qnn_QuantizeParamsEncoding_t { _reserved: [0; 4] },
        }
    }

    /// Per-tensor quantization: `float = (q + offset) * scale`.
    pub const fn scale_offset(scale: f32, offset: i32) -> Self {
        let mut p = Self::undefined();
        p.encodingDefinition = QNN_DEFINITION_DEFINED;
        p.quantizationEncoding = QNN_QUANTIZATION_ENCODING_SCALE_OFFSET;
        p.encoding = Qnn_QuantizeParamsEncoding_t {
            _reserved: [0; 4], // zero the bytes the smaller member leaves untouched
        };
        p.encoding.scaleOffsetEncoding = Qnn_ScaleOffset_t { scale, offset };
        p
    }

    /// Per-channel quantization along `axis`, one entry of `scale_offsets` per channel.
    /// The slice must stay alive while QNN reads the params (tensor creation).
    pub fn axis_scale_offset(axis: i32, scale_offsets: &mut [Qnn_ScaleOffset_t]) -> Self {
        let mut p = Self::undefined();
        p.encodingDefinition = QNN_DEFINITION_DEFINED;
        p.quantizationEncoding = QNN_QUANTIZATION_ENCODING_AXIS_SCALE_OFFSET;
        p.encoding.axisScaleOffsetEncoding =
            Qnn_AxisScaleOffset_t { axis, numScaleOffsets: scale_offsets.len() as u32, scaleOffset: scale_offsets.as_mut_ptr() };
        p
    }

    /// Blockwise expansion (LPBQ). `be`, its scale-offsets and block scales must stay alive
    /// while QNN reads the params (tensor creation).
    pub fn blockwise_expansion(be: &mut Qnn_BlockwiseExpansion_t) -> Self {
        let mut p = Self::undefined();
        p.encodingDefinition = QNN_DEFINITION_DEFINED;
        p.quantizationEncoding = QNN_QUANTIZATION_ENCODING_BLOCKWISE_EXPANSION;
        p.encoding.blockwiseExpansion = be;
        p
    }
}

impl Default for Qnn_QuantizeParams_t {
    fn default() -> Self {
        Self::undefined()
    }
}

impl core::fmt::Debug for Qnn_QuantizeParams_t {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let mut d = f.debug_struct("Qnn_QuantizeParams_t");
        d.field("encodingDefinition", &self.encodingDefinition).field("quantizationEncoding", &self.quantizationEncoding);
        // SAFETY: the union is plain old data; the active member follows the encoding tag.
        unsafe {
            match self.quantizationEncoding {
                QNN_QUANTIZATION_ENCODING_SCALE_OFFSET => d.field("scaleOffset", &self.encoding.scaleOffsetEncoding),
                QNN_QUANTIZATION_ENCODING_AXIS_SCALE_OFFSET => d.field("axisScaleOffset", &self.encoding.axisScaleOffsetEncoding),
                QNN_QUANTIZATION_ENCODING_BLOCKWISE_EXPANSION => d.field("blockwiseExpansion", &self.encoding.blockwiseExpansion),
                _ => &mut d,
            };
        }
        d.finish()
    }
}

// ---------------------------------------------------------------------------------------------
// Tensors
// ---------------------------------------------------------------------------------------------

/// `Qnn_ClientBuffer_t`: application memory holding a tensor's data.
///
/// QNN does NOT check `dataSize` at execute: an undersized buffer is overrun. Check sizes
/// before every `graphExecute`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Qnn_ClientBuffer_t {
    pub data: *mut c_void,
    pub dataSize: u32,
}

impl Qnn_ClientBuffer_t {
    /// No buffer (NATIVE tensors, or APP_* tensors at creation time).
    pub const fn empty() -> Self {
        Self { data: ptr::null_mut(), dataSize: 0 }
    }

    /// A buffer over `bytes`. QNN may write through it (outputs), hence `&mut`.
    pub fn from_slice<T>(bytes: &mut [T]) -> Self {
        Self { data: bytes.as_mut_ptr().cast(), dataSize: core::mem::size_of_val(bytes) as u32 }
    }
}

impl Default for Qnn_ClientBuffer_t {
    fn default() -> Self {
        Self::empty()
    }
}

/// The memory union of a tensor: `clientBuf` when `memType` is RAW, `memHandle` when MEMHANDLE.
#[repr(C)]
#[derive(Clone, Copy)]
pub union Qnn_TensorMemory_t {
    pub clientBuf: Qnn_ClientBuffer_t,
    pub memHandle: Qnn_MemHandle_t,
}

/// `Qnn_TensorV1_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Qnn_TensorV1_t {
    /// Written by the library at tensor creation; the only identity execute needs.
    pub id: u32,
    pub name: *const c_char,
    /// `QNN_TENSOR_TYPE_*`.
    pub type_: Qnn_TensorType_t,
    /// `QNN_TENSOR_DATA_FORMAT_*`.
    pub dataFormat: u32,
    /// `QNN_DATATYPE_*`.
    pub dataType: Qnn_DataType_t,
    pub quantizeParams: Qnn_QuantizeParams_t,
    pub rank: u32,
    pub dimensions: *mut u32,
    /// `QNN_TENSORMEMTYPE_*`.
    pub memType: u32,
    pub memory: Qnn_TensorMemory_t,
}

/// `Qnn_SparseParams_t` (12 bytes): sparse layout of a V2 tensor. Dense tensors leave it zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Qnn_SparseParams_t {
    pub type_: u32,
    /// Hybrid COO: `numSpecifiedElements`, `numSparseDimensions`.
    pub hybridCoo: [u32; 2],
}

/// `Qnn_TensorV2_t`: V1 plus dynamic dimensions, sparsity and `isProduced`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Qnn_TensorV2_t {
    pub id: u32,
    pub name: *const c_char,
    pub type_: Qnn_TensorType_t,
    pub dataFormat: u32,
    pub dataType: Qnn_DataType_t,
    pub quantizeParams: Qnn_QuantizeParams_t,
    pub rank: u32,
    pub dimensions: *mut u32,
    pub memType: u32,
    pub memory: Qnn_TensorMemory_t,
    pub isDynamicDimensions: *mut u8,
    pub sparseParams: Qnn_SparseParams_t,
    pub isProduced: u8,
}

/// The version union of `Qnn_Tensor_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union Qnn_TensorVersions_t {
    pub v1: Qnn_TensorV1_t,
    pub v2: Qnn_TensorV2_t,
}

/// `Qnn_Tensor_t` (144 bytes; arrays of it are passed to execute, so the size is part of the ABI).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Qnn_Tensor_t {
    /// `QNN_TENSOR_VERSION_1` or `QNN_TENSOR_VERSION_2`.
    pub version: u32,
    pub u: Qnn_TensorVersions_t,
}

impl Qnn_Tensor_t {
    /// A version-1 dense tensor description for `tensorCreateGraphTensor` /
    /// `tensorCreateContextTensor` (`id` is 0; the library writes it back).
    ///
    /// `name` and `dims` must stay valid while QNN reads the struct; `dims` must hold `rank`
    /// entries. `client_buf` carries the data of STATIC tensors and is empty otherwise.
    #[allow(clippy::too_many_arguments)]
    pub fn v1(
        name: *const c_char,
        tensor_type: Qnn_TensorType_t,
        data_type: Qnn_DataType_t,
        quantize_params: Qnn_QuantizeParams_t,
        rank: u32,
        dims: *mut u32,
        client_buf: Qnn_ClientBuffer_t,
    ) -> Self {
        // Zero first so that the bytes the V1 member does not cover (the rest of the V2 union
        // arm) are defined: the library may copy all 144 bytes.
        let mut t = Self::zeroed();
        t.version = QNN_TENSOR_VERSION_1;
        t.u.v1 = Qnn_TensorV1_t {
            id: 0,
            name,
            type_: tensor_type,
            dataFormat: QNN_TENSOR_DATA_FORMAT_DENSE,
            dataType: data_type,
            quantizeParams: quantize_params,
            rank,
            dimensions: dims,
            memType: QNN_TENSORMEMTYPE_RAW,
            memory: Qnn_TensorMemory_t { clientBuf: client_buf },
        };
        t
    }

    /// The minimal tensor `graphExecute` needs: version 1, the `id` the library assigned at
    /// creation and the client buffer (a tensor given by name only fails with 6004).
    pub fn for_execute(id: u32, client_buf: Qnn_ClientBuffer_t) -> Self {
        let mut t = Self::zeroed();
        t.version = QNN_TENSOR_VERSION_1;
        // Writing union fields is safe: the zeroed V1 arm is plain old data.
        t.u.v1.id = id;
        t.u.v1.quantizeParams = Qnn_QuantizeParams_t::undefined();
        t.u.v1.dataType = QNN_DATATYPE_UNDEFINED;
        t.u.v1.memType = QNN_TENSORMEMTYPE_RAW;
        t.u.v1.memory.clientBuf = client_buf;
        t
    }

    /// Like [`Self::for_execute`], for memory registered with `memRegister` (a shared rpcmem
    /// buffer on a phone): `memType = MEMHANDLE` and the handle in the memory union.
    pub fn for_execute_mem_handle(id: u32, handle: Qnn_MemHandle_t) -> Self {
        let mut t = Self::for_execute(id, Qnn_ClientBuffer_t::empty());
        t.u.v1.memType = QNN_TENSORMEMTYPE_MEMHANDLE;
        t.u.v1.memory.memHandle = handle;
        t
    }

    /// An all-zero tensor (version 0: invalid until filled in).
    pub fn zeroed() -> Self {
        // SAFETY: every field is an integer, float or raw pointer, for which all-zero is valid.
        unsafe { core::mem::zeroed() }
    }

    /// The tensor id. `id` sits at the same offset in V1 and V2, so this is valid for both.
    pub fn id(&self) -> u32 {
        // SAFETY: both union arms start with `id: u32`.
        unsafe { self.u.v1.id }
    }

    /// Sets the client buffer (RAW memory) of a V1 or V2 tensor; both keep it at the same offset.
    pub fn set_client_buf(&mut self, client_buf: Qnn_ClientBuffer_t) {
        // `memType` and `memory` are at the same offsets in both arms.
        self.u.v1.memType = QNN_TENSORMEMTYPE_RAW;
        self.u.v1.memory.clientBuf = client_buf;
    }
}

// ---------------------------------------------------------------------------------------------
// Params and op configs
// ---------------------------------------------------------------------------------------------

/// Value union of `Qnn_Scalar_t`; which member is live follows `Qnn_Scalar_t::dataType`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union Qnn_ScalarValue_t {
    pub floatValue: f32,
    pub doubleValue: f64,
    pub uint64Value: u64,
    pub int64Value: i64,
    pub uint32Value: u32,
    pub int32Value: i32,
    pub uint16Value: u16,
    pub int16Value: i16,
    pub uint8Value: u8,
    pub int8Value: i8,
    /// C `bool` (one byte, 0 or 1) for `QNN_DATATYPE_BOOL_8`.
    pub bool8Value: u8,
    pub stringValue: *const c_char,
}

/// `Qnn_Scalar_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Qnn_Scalar_t {
    pub dataType: Qnn_DataType_t,
    pub value: Qnn_ScalarValue_t,
}

impl Qnn_Scalar_t {
    fn with(data_type: Qnn_DataType_t, value: Qnn_ScalarValue_t) -> Self {
        // Start from 8 zero bytes so narrower members leave no undefined bytes behind.
        let mut s = Self { dataType: data_type, value: Qnn_ScalarValue_t { uint64Value: 0 } };
        s.value = value;
        s
    }
    /// A BOOL_8 scalar (e.g. `keep_dims`, `transpose_in1`).
    pub fn bool8(v: bool) -> Self {
        let mut s = Self::with(QNN_DATATYPE_BOOL_8, Qnn_ScalarValue_t { uint64Value: 0 });
        s.value.bool8Value = v as u8;
        s
    }
    /// A FLOAT_32 scalar (e.g. `epsilon`, `beta`).
    pub fn f32(v: f32) -> Self {
        let mut s = Self::with(QNN_DATATYPE_FLOAT_32, Qnn_ScalarValue_t { uint64Value: 0 });
        s.value.floatValue = v;
        s
    }
    /// A UINT_32 scalar (e.g. `axis`).
    pub fn u32(v: u32) -> Self {
        let mut s = Self::with(QNN_DATATYPE_UINT_32, Qnn_ScalarValue_t { uint64Value: 0 });
        s.value.uint32Value = v;
        s
    }
    /// An INT_32 scalar.
    pub fn i32(v: i32) -> Self {
        let mut s = Self::with(QNN_DATATYPE_INT_32, Qnn_ScalarValue_t { uint64Value: 0 });
        s.value.int32Value = v;
        s
    }
}

/// Value union of `Qnn_Param_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union Qnn_ParamValue_t {
    pub scalarParam: Qnn_Scalar_t,
    pub tensorParam: Qnn_Tensor_t,
}

/// `Qnn_Param_t`: a named op parameter, scalar or tensor.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Qnn_Param_t {
    /// `QNN_PARAMTYPE_SCALAR` or `QNN_PARAMTYPE_TENSOR`.
    pub paramType: u32,
    pub name: *const c_char,
    pub value: Qnn_ParamValue_t,
}

impl Qnn_Param_t {
    /// A scalar param. `name` must stay valid while QNN reads the param (e.g. a `consts` name).
    pub fn scalar(name: *const c_char, scalar: Qnn_Scalar_t) -> Self {
        let mut p = Self::zeroed();
        p.paramType = QNN_PARAMTYPE_SCALAR;
        p.name = name;
        p.value.scalarParam = scalar;
        p
    }
    /// A tensor param (e.g. `perm`, `axes`): normally a STATIC tensor already created in the
    /// graph (pass the created tensor, whose `id` the library filled in).
    pub fn tensor(name: *const c_char, tensor: Qnn_Tensor_t) -> Self {
        let mut p = Self::zeroed();
        p.paramType = QNN_PARAMTYPE_TENSOR;
        p.name = name;
        p.value.tensorParam = tensor;
        p
    }
    fn zeroed() -> Self {
        // SAFETY: integers, raw pointers and unions of them: all-zero is valid.
        unsafe { core::mem::zeroed() }
    }
}

/// `Qnn_OpConfigV1_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Qnn_OpConfigV1_t {
    pub name: *const c_char,
    pub packageName: *const c_char,
    pub typeName: *const c_char,
    pub numOfParams: u32,
    pub params: *mut Qnn_Param_t,
    pub numOfInputs: u32,
    pub inputTensors: *mut Qnn_Tensor_t,
    pub numOfOutputs: u32,
    pub outputTensors: *mut Qnn_Tensor_t,
}

/// Version union of `Qnn_OpConfig_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union Qnn_OpConfigVersions_t {
    pub v1: Qnn_OpConfigV1_t,
}

/// `Qnn_OpConfig_t` (80 bytes; passed BY VALUE to `graphAddNode` and `backendValidateOpConfig`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Qnn_OpConfig_t {
    pub version: u32,
    pub u: Qnn_OpConfigVersions_t,
}

impl Qnn_OpConfig_t {
    /// A version-1 op config. Every pointer (strings, and the three slices) must stay valid and
    /// unmoved until the `graphAddNode` / `backendValidateOpConfig` call returns. Inputs and
    /// outputs are the tensors as created (their `id` filled in by the library).
    pub fn v1(
        name: *const c_char,
        package_name: *const c_char,
        type_name: *const c_char,
        params: &mut [Qnn_Param_t],
        inputs: &mut [Qnn_Tensor_t],
        outputs: &mut [Qnn_Tensor_t],
    ) -> Self {
        fn ptr_or_null<T>(s: &mut [T]) -> *mut T {
            if s.is_empty() {
                ptr::null_mut()
            } else {
                s.as_mut_ptr()
            }
        }
        Self {
            version: QNN_OPCONFIG_VERSION_1,
            u: Qnn_OpConfigVersions_t {
                v1: Qnn_OpConfigV1_t {
                    name,
                    packageName: package_name,
                    typeName: type_name,
                    numOfParams: params.len() as u32,
                    params: ptr_or_null(params),
                    numOfInputs: inputs.len() as u32,
                    inputTensors: ptr_or_null(inputs),
                    numOfOutputs: outputs.len() as u32,
                    outputTensors: ptr_or_null(outputs),
                },
            },
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Generic configs (graph / context / device / backend): {option u32, value union} = 16 bytes.
// Arrays of POINTERS to them are NULL-terminated.
// ---------------------------------------------------------------------------------------------

/// Value union shared by the four generic config structs. Only the custom-config pointer is
/// used by this project; the scalar members cover the non-custom options (priority, ...).
#[repr(C)]
#[derive(Clone, Copy)]
pub union Qnn_ConfigValue_t {
    /// For `option == QNN_CONFIG_OPTION_CUSTOM`: a pointer to a backend custom config
    /// (e.g. [`QnnHtpGraph_CustomConfig_t`], [`QnnHtpDevice_CustomConfig_t`]).
    pub customConfig: *mut c_void,
    pub uint32Value: u32,
    pub uint64Value: u64,
    pub pointerValue: *const c_void,
}

macro_rules! generic_config {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[repr(C)]
        #[derive(Clone, Copy)]
        pub struct $name {
            pub option: u32,
            pub value: Qnn_ConfigValue_t,
        }

        impl $name {
            /// `{option: CUSTOM, customConfig}`. The custom config must outlive the call that
            /// receives this struct.
            pub fn custom(custom_config: *mut c_void) -> Self {
                Self {
                    option: QNN_CONFIG_OPTION_CUSTOM,
                    value: Qnn_ConfigValue_t { customConfig: custom_config },
                }
            }
        }
    };
}

generic_config!(
    /// `QnnGraph_Config_t`, for `graphCreate` / `graphSetConfig`.
    QnnGraph_Config_t
);
generic_config!(
    /// `QnnContext_Config_t`, for `contextCreate` / `contextCreateFromBinary`.
    QnnContext_Config_t
);
generic_config!(
    /// `QnnDevice_Config_t`, for `deviceCreate` / `deviceSetConfig`.
    QnnDevice_Config_t
);
generic_config!(
    /// `QnnBackend_Config_t`, for `backendCreate` / `backendSetConfig`.
    QnnBackend_Config_t
);

// ---------------------------------------------------------------------------------------------
// HTP custom configs
// ---------------------------------------------------------------------------------------------

/// Value of `QNN_HTP_GRAPH_CONFIG_OPTION_OPTIMIZATION`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct QnnHtpGraph_OptimizationOption_t {
    /// e.g. `QNN_HTP_GRAPH_OPTIMIZATION_TYPE_FINALIZE_OPTIMIZATION_FLAG`.
    pub type_: u32,
    pub floatValue: f32,
}

/// Value union of [`QnnHtpGraph_CustomConfig_t`] (48 bytes; only the options the project sets
/// are typed, `_reserved` fixes the size).
#[repr(C)]
#[derive(Clone, Copy)]
pub union QnnHtpGraph_CustomConfigValue_t {
    pub optimizationOption: QnnHtpGraph_OptimizationOption_t,
    /// `QNN_PRECISION_*`.
    pub precision: u32,
    pub vtcmSizeInMB: u32,
    /// u64, not u32: writing a u32 here leaves garbage in the upper half.
    pub numHvxThreads: u64,
    pub numCores: u32,
    pub vtcmSizeInBytes: u32,
    pub _reserved: [u64; 6],
}

/// `QnnHtpGraph_CustomConfig_t` (56 bytes). Pass it wrapped as
/// `QnnGraph_Config_t::custom(&mut cfg as *mut _ as *mut c_void)`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct QnnHtpGraph_CustomConfig_t {
    /// `QNN_HTP_GRAPH_CONFIG_OPTION_*`.
    pub option: QnnHtpGraph_ConfigOption_t,
    pub value: QnnHtpGraph_CustomConfigValue_t,
}

impl QnnHtpGraph_CustomConfig_t {
    fn with(option: QnnHtpGraph_ConfigOption_t) -> Self {
        Self { option, value: QnnHtpGraph_CustomConfigValue_t { _reserved: [0; 6] } }
    }
    /// `OPTIMIZATION` / `FINALIZE_OPTIMIZATION_FLAG` = `level` (1 fastest prepare, 2 default,
    /// 3 best graph).
    pub fn finalize_optimization(level: f32) -> Self {
        let mut c = Self::with(QNN_HTP_GRAPH_CONFIG_OPTION_OPTIMIZATION);
        c.value.optimizationOption = QnnHtpGraph_OptimizationOption_t { type_: QNN_HTP_GRAPH_OPTIMIZATION_TYPE_FINALIZE_OPTIMIZATION_FLAG, floatValue: level };
        c
    }
    /// `PRECISION` (`QNN_PRECISION_FLOAT32` / `QNN_PRECISION_FLOAT16`).
    pub fn precision(precision: u32) -> Self {
        let mut c = Self::with(QNN_HTP_GRAPH_CONFIG_OPTION_PRECISION);
        c.value.precision = precision;
        c
    }
    /// `VTCM_SIZE_IN_MB` (0 = maximum).
    pub fn vtcm_size_in_mb(mb: u32) -> Self {
        let mut c = Self::with(QNN_HTP_GRAPH_CONFIG_OPTION_VTCM_SIZE_IN_MB);
        c.value.vtcmSizeInMB = mb;
        c
    }
    /// `NUM_HVX_THREADS` (a u64 value).
    pub fn num_hvx_threads(n: u64) -> Self {
        let mut c = Self::with(QNN_HTP_GRAPH_CONFIG_OPTION_NUM_HVX_THREADS);
        c.value.numHvxThreads = n;
        c
    }
}

/// Value union of [`QnnHtpContext_CustomConfig_t`]: a C `bool` for
/// `QNN_HTP_CONTEXT_CONFIG_OPTION_WEIGHT_SHARING_ENABLED`; the other options (a group
/// registration of a pointer and a u64, a u64 memory budget, ...) are not typed, and
/// `_reserved` holds room for the largest (16 bytes in the HTP 5.43 header, padded to 32 since
/// later versions add options; the library reads only the member its option names).
#[repr(C)]
#[derive(Clone, Copy)]
pub union QnnHtpContext_CustomConfigValue_t {
    pub weightSharingEnabled: bool,
    pub _reserved: [u64; 4],
}

/// `QnnHtpContext_CustomConfig_t` (40 bytes here: the option at 0, the union at 8). Pass it
/// wrapped as `QnnContext_Config_t::custom(&mut cfg as *mut _ as *mut c_void)` to
/// `contextCreate`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct QnnHtpContext_CustomConfig_t {
    /// `QNN_HTP_CONTEXT_CONFIG_OPTION_*`.
    pub option: u32,
    pub value: QnnHtpContext_CustomConfigValue_t,
}

impl QnnHtpContext_CustomConfig_t {
    /// `WEIGHT_SHARING_ENABLED`: graphs of one context whose static tensors hold the same bytes
    /// keep one copy of them in the context binary (by content, whatever their names). The x86
    /// library prepares such a binary but refuses to load it back (1000, "Shared weights buffer
    /// isn't supported on this platform"); on a device it needs HTP v73 or later.
    pub fn weight_sharing(enabled: bool) -> Self {
        let mut value = QnnHtpContext_CustomConfigValue_t { _reserved: [0; 4] };
        value.weightSharingEnabled = enabled;
        Self { option: crate::consts::QNN_HTP_CONTEXT_CONFIG_OPTION_WEIGHT_SHARING_ENABLED, value }
    }
}

/// Value of `QNN_HTP_DEVICE_CONFIG_OPTION_ARCH`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QnnHtpDevice_Arch_t {
    pub deviceId: u32,
    /// `QNN_HTP_DEVICE_ARCH_*`.
    pub arch: u32,
}

/// Value union of the HTP device custom config, HTP API 5.51 layout (aligned to 8, so it starts
/// at offset 8). `_align` stands for the 8-byte member that moved the union in newer headers.
#[repr(C)]
#[derive(Clone, Copy)]
pub union QnnHtpDevice_CustomConfigValue_t {
    pub socModel: u32,
    pub arch: QnnHtpDevice_Arch_t,
    /// C `bool` for `QNN_HTP_DEVICE_CONFIG_OPTION_SIGNEDPD`.
    pub useSignedProcessDomain: u8,
    pub _align: u64,
}

/// `QnnHtpDevice_CustomConfig_t` as the library shipped here expects it (HTP API 5.51):
/// option u32 @0, value union @8, 16 bytes. Use [`HtpDeviceConfigLayout::for_backend_api`] to
/// pick between this and [`QnnHtpDevice_CustomConfigV543_t`].
#[repr(C)]
#[derive(Clone, Copy)]
pub struct QnnHtpDevice_CustomConfig_t {
    /// `QNN_HTP_DEVICE_CONFIG_OPTION_*`.
    pub option: QnnHtpDevice_ConfigOption_t,
    pub value: QnnHtpDevice_CustomConfigValue_t,
}

impl QnnHtpDevice_CustomConfig_t {
    /// `SOC` = `soc_model` (`QNN_SOC_MODEL_*`).
    pub fn soc(soc_model: u32) -> Self {
        let mut c = Self { option: QNN_HTP_DEVICE_CONFIG_OPTION_SOC, value: QnnHtpDevice_CustomConfigValue_t { _align: 0 } };
        c.value.socModel = soc_model;
        c
    }
    /// `ARCH` = `{device_id, arch}` (`QNN_HTP_DEVICE_ARCH_*`).
    pub fn arch(device_id: u32, arch: u32) -> Self {
        Self { option: QNN_HTP_DEVICE_CONFIG_OPTION_ARCH, value: QnnHtpDevice_CustomConfigValue_t { arch: QnnHtpDevice_Arch_t { deviceId: device_id, arch } } }
    }
}

/// Value union of the HTP device custom config, older HTP API 5.43 layout (4-byte members only).
#[repr(C)]
#[derive(Clone, Copy)]
pub union QnnHtpDevice_CustomConfigValueV543_t {
    pub socModel: u32,
    pub arch: QnnHtpDevice_Arch_t,
    pub useSignedProcessDomain: u8,
}

/// `QnnHtpDevice_CustomConfig_t` as older libraries (HTP API 5.43) expect it: option u32 @0,
/// value union @4, 12 bytes. The 5.51 library rejects SOC given this way (error 14001) and
/// silently ignores ARCH, which is why the layout must follow the reported backend API version.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct QnnHtpDevice_CustomConfigV543_t {
    pub option: QnnHtpDevice_ConfigOption_t,
    pub value: QnnHtpDevice_CustomConfigValueV543_t,
}

impl QnnHtpDevice_CustomConfigV543_t {
    /// `SOC` = `soc_model`.
    pub fn soc(soc_model: u32) -> Self {
        Self { option: QNN_HTP_DEVICE_CONFIG_OPTION_SOC, value: QnnHtpDevice_CustomConfigValueV543_t { socModel: soc_model } }
    }
    /// `ARCH` = `{device_id, arch}`.
    pub fn arch(device_id: u32, arch: u32) -> Self {
        Self {
            option: QNN_HTP_DEVICE_CONFIG_OPTION_ARCH,
            value: QnnHtpDevice_CustomConfigValueV543_t { arch: QnnHtpDevice_Arch_t { deviceId: device_id, arch } },
        }
    }
}

/// Which layout of the HTP device custom config a library expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HtpDeviceConfigLayout {
    /// Union at offset 4 ([`QnnHtpDevice_CustomConfigV543_t`]), HTP API up to 5.43.
    UnionAt4,
    /// Union at offset 8 ([`QnnHtpDevice_CustomConfig_t`]), HTP API 5.51 (the library here).
    UnionAt8,
}

impl HtpDeviceConfigLayout {
    /// First HTP backend API minor (of major 5) known to use the offset-8 layout. The change
    /// happened somewhere in 5.44..=5.51; only 5.43 (offset 4) and 5.51 (offset 8) were checked,
    /// so versions in between are treated as the older layout.
    pub const FIRST_UNION_AT_8_MINOR: u32 = 51;

    /// The layout for a library reporting `backend_api` (its `backendApiVersion`).
    pub fn for_backend_api(backend_api: Qnn_Version_t) -> Self {
        if backend_api.major > 5 || (backend_api.major == 5 && backend_api.minor >= Self::FIRST_UNION_AT_8_MINOR) {
            Self::UnionAt8
        } else {
            Self::UnionAt4
        }
    }
}

/// An HTP device custom config in whichever layout the library expects; keeps the bytes alive
/// while a [`QnnDevice_Config_t`] points at them.
#[derive(Clone, Copy)]
pub enum HtpDeviceCustomConfig {
    UnionAt4(QnnHtpDevice_CustomConfigV543_t),
    UnionAt8(QnnHtpDevice_CustomConfig_t),
}

impl HtpDeviceCustomConfig {
    /// `SOC` = `soc_model` in `layout`.
    pub fn soc(layout: HtpDeviceConfigLayout, soc_model: u32) -> Self {
        match layout {
            HtpDeviceConfigLayout::UnionAt4 => Self::UnionAt4(QnnHtpDevice_CustomConfigV543_t::soc(soc_model)),
            HtpDeviceConfigLayout::UnionAt8 => Self::UnionAt8(QnnHtpDevice_CustomConfig_t::soc(soc_model)),
        }
    }
    /// `ARCH` = `{device_id, arch}` in `layout`.
    pub fn arch(layout: HtpDeviceConfigLayout, device_id: u32, arch: u32) -> Self {
        match layout {
            HtpDeviceConfigLayout::UnionAt4 => Self::UnionAt4(QnnHtpDevice_CustomConfigV543_t::arch(device_id, arch)),
            HtpDeviceConfigLayout::UnionAt8 => Self::UnionAt8(QnnHtpDevice_CustomConfig_t::arch(device_id, arch)),
        }
    }
    /// Pointer to the raw config, for [`QnnDevice_Config_t::custom`]. Valid while `self` is
    /// neither moved nor dropped.
    pub fn as_mut_ptr(&mut self) -> *mut c_void {
        match self {
            Self::UnionAt4(c) => (c as *mut QnnHtpDevice_CustomConfigV543_t).cast(),
            Self::UnionAt8(c) => (c as *mut QnnHtpDevice_CustomConfig_t).cast(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Memory registration and profiling
// ---------------------------------------------------------------------------------------------

/// `Qnn_MemShape_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Qnn_MemShape_t {
    pub numDim: u32,
    pub dimSize: *mut u32,
    pub shapeConfig: *const c_char,
}

/// `Qnn_MemDmaBufInfo_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Qnn_MemDmaBufInfo_t {
    pub fd: i32,
    pub data: *mut c_void,
}

/// `Qnn_MemIonInfo_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Qnn_MemIonInfo_t {
    /// File descriptor of an rpcmem/ION buffer (`rpcmem_to_fd`).
    pub fd: i32,
}

/// Memory union of `Qnn_MemDescriptor_t`, selected by `memType`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union Qnn_MemInfo_t {
    /// `QNN_MEM_TYPE_ION`.
    pub ionInfo: Qnn_MemIonInfo_t,
    /// `QNN_MEM_TYPE_CUSTOM`.
    pub customInfo: *mut c_void,
    /// `QNN_MEM_TYPE_DMA_BUF`.
    pub dmaBufInfo: Qnn_MemDmaBufInfo_t,
}

/// `Qnn_MemDescriptor_t`, for `memRegister` (shared rpcmem buffers on a phone).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Qnn_MemDescriptor_t {
    pub memShape: Qnn_MemShape_t,
    pub dataType: Qnn_DataType_t,
    /// `QNN_MEM_TYPE_*`.
    pub memType: u32,
    pub info: Qnn_MemInfo_t,
}

/// `QnnProfile_EventData_t`: one profiling event.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct QnnProfile_EventData_t {
    pub type_: u32,
    /// `QNN_PROFILE_EVENTUNIT_*`.
    pub unit: u32,
    pub value: u64,
    pub identifier: *const c_char,
}

impl Default for QnnProfile_EventData_t {
    fn default() -> Self {
        Self { type_: 0, unit: 0, value: 0, identifier: ptr::null() }
    }
}
