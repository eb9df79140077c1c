//! Numeric constants of the QNN C API and the HTP backend (all values from `QNN_FACTS.md`).
//!
//! QNN's enums are C enums, i.e. `u32`/`i32` on the wire; they are kept here as plain `u32`
//! constants (not Rust enums) because the library may hand back values a Rust enum would not know,
//! and reading an unknown discriminant into a Rust enum is undefined behaviour.

use crate::types::{
    QnnHtpDevice_ConfigOption_t, QnnHtpGraph_ConfigOption_t, QnnLog_Level_t, QnnProfile_Level_t, Qnn_DataType_t, Qnn_ErrorHandle_t, Qnn_TensorType_t,
};

// ---------------------------------------------------------------------------------------------
// API version this crate's function table declares.
// ---------------------------------------------------------------------------------------------

/// Core API major version whose ABI this crate declares.
pub const QNN_API_VERSION_MAJOR: u32 = 2;
/// Core API minor version whose function table layout this crate declares (71 entries). Since
/// API 2.9 the table only grows at its end, so any 2.x library with `minor >= 32` has every entry.
pub const QNN_API_VERSION_MINOR: u32 = 32;
/// Number of entries in [`crate::QnnInterfaceFunctions_t`] for API 2.32.
pub const QNN_INTERFACE_FUNCTION_COUNT: usize = 71;

/// `QnnInterface_t::backendId` of the HTP (Hexagon) backend.
pub const QNN_BACKEND_ID_HTP: u32 = 6;
/// Provider name the HTP library reports.
pub const QNN_HTP_PROVIDER_NAME: &str = "HTP_QTI_AISW";
/// File name of the HTP backend library.
pub const QNN_HTP_LIBRARY_NAME: &str = "libQnnHtp.so";
/// Symbol every QNN backend library exports.
pub const QNN_INTERFACE_GET_PROVIDERS_SYMBOL: &str = "QnnInterface_getProviders";

// ---------------------------------------------------------------------------------------------
// Errors. The code is the low 16 bits of `Qnn_ErrorHandle_t`; each API area owns a range.
// ---------------------------------------------------------------------------------------------

/// Success.
pub const QNN_SUCCESS: Qnn_ErrorHandle_t = 0;
/// First code of the common error range (e.g. 1002 = memory allocation failure, which
/// `graphFinalize` also returns for some unsupported op/shape combinations).
pub const QNN_MIN_ERROR_COMMON: u16 = 1000;
/// First code of the backend error range.
pub const QNN_MIN_ERROR_BACKEND: u16 = 4000;
/// First code of the context error range.
pub const QNN_MIN_ERROR_CONTEXT: u16 = 5000;
/// First code of the graph error range (e.g. 6004 for an execute tensor given by name only).
pub const QNN_MIN_ERROR_GRAPH: u16 = 6000;
/// First code of the tensor error range.
pub const QNN_MIN_ERROR_TENSOR: u16 = 7000;
/// First code of the memory-registration error range.
pub const QNN_MIN_ERROR_MEM: u16 = 8000;
/// First code of the device error range (14001 is what `deviceCreate` returns for an HTP device
/// config written with the wrong layout; see `QnnHtpDevice_CustomConfigV543_t`).
pub const QNN_MIN_ERROR_DEVICE: u16 = 14000;
/// Common error code for a failed memory allocation.
pub const QNN_COMMON_ERROR_MEM_ALLOC: u16 = 1002;
/// Common error code for something the library does not do on this platform (e.g. loading a
/// weight-shared context binary with the x86 library).
pub const QNN_COMMON_ERROR_NOT_SUPPORTED: u16 = 1000;

// ---------------------------------------------------------------------------------------------
// Data types (`Qnn_DataType_t`): high byte = kind, low byte = bit width (in hex-looking decimal).
// ---------------------------------------------------------------------------------------------

pub const QNN_DATATYPE_INT_8: Qnn_DataType_t = 0x0008;
pub const QNN_DATATYPE_INT_16: Qnn_DataType_t = 0x0016;
pub const QNN_DATATYPE_INT_32: Qnn_DataType_t = 0x0032;
pub const QNN_DATATYPE_INT_64: Qnn_DataType_t = 0x0064;
pub const QNN_DATATYPE_UINT_8: Qnn_DataType_t = 0x0108;
pub const QNN_DATATYPE_UINT_16: Qnn_DataType_t = 0x0116;
pub const QNN_DATATYPE_UINT_32: Qnn_DataType_t = 0x0132;
pub const QNN_DATATYPE_FLOAT_16: Qnn_DataType_t = 0x0216;
pub const QNN_DATATYPE_BFLOAT_16: Qnn_DataType_t = 0x0226;
pub const QNN_DATATYPE_FLOAT_32: Qnn_DataType_t = 0x0232;
pub const QNN_DATATYPE_SFIXED_POINT_4: Qnn_DataType_t = 0x0304;
pub const QNN_DATATYPE_SFIXED_POINT_8: Qnn_DataType_t = 0x0308;
pub const QNN_DATATYPE_SFIXED_POINT_16: Qnn_DataType_t = 0x0316;
/// Use this (not INT_32) for int32 accumulator outputs: INT_32 returns round(float value).
pub const QNN_DATATYPE_SFIXED_POINT_32: Qnn_DataType_t = 0x0332;
pub const QNN_DATATYPE_UFIXED_POINT_4: Qnn_DataType_t = 0x0404;
pub const QNN_DATATYPE_UFIXED_POINT_8: Qnn_DataType_t = 0x0408;
pub const QNN_DATATYPE_UFIXED_POINT_16: Qnn_DataType_t = 0x0416;
pub const QNN_DATATYPE_UFIXED_POINT_32: Qnn_DataType_t = 0x0432;
pub const QNN_DATATYPE_BOOL_8: Qnn_DataType_t = 0x0508;
pub const QNN_DATATYPE_UNDEFINED: Qnn_DataType_t = 0x7FFF_FFFF;

// ---------------------------------------------------------------------------------------------
// Tensors.
// ---------------------------------------------------------------------------------------------

/// Input the application writes before every execute.
pub const QNN_TENSOR_TYPE_APP_WRITE: Qnn_TensorType_t = 0;
/// Output the application reads after every execute.
pub const QNN_TENSOR_TYPE_APP_READ: Qnn_TensorType_t = 1;
pub const QNN_TENSOR_TYPE_APP_READWRITE: Qnn_TensorType_t = 2;
/// Graph-internal tensor (between two nodes).
pub const QNN_TENSOR_TYPE_NATIVE: Qnn_TensorType_t = 3;
/// Constant data (weights) given at creation through `clientBuf`.
pub const QNN_TENSOR_TYPE_STATIC: Qnn_TensorType_t = 4;
/// Placeholder for an absent optional input.
pub const QNN_TENSOR_TYPE_NULL: Qnn_TensorType_t = 5;

/// `Qnn_Tensor_t::version` selecting `v1`.
pub const QNN_TENSOR_VERSION_1: u32 = 1;
/// `Qnn_Tensor_t::version` selecting `v2`.
pub const QNN_TENSOR_VERSION_2: u32 = 2;
/// `Qnn_TensorDataFormat_t` for ordinary (non-sparse) tensors.
pub const QNN_TENSOR_DATA_FORMAT_DENSE: u32 = 0;
/// `Qnn_TensorMemType_t`: data lives in `clientBuf`.
pub const QNN_TENSORMEMTYPE_RAW: u32 = 0;
/// `Qnn_TensorMemType_t`: data lives in a buffer registered with `memRegister`.
pub const QNN_TENSORMEMTYPE_MEMHANDLE: u32 = 1;

// ---------------------------------------------------------------------------------------------
// Quantization (`float = (q + offset) * scale`: QNN's offset is the NEGATED zero point).
// ---------------------------------------------------------------------------------------------

pub const QNN_DEFINITION_IMPL_GENERATED: u32 = 0;
pub const QNN_DEFINITION_DEFINED: u32 = 1;
pub const QNN_DEFINITION_UNDEFINED: u32 = 0x7FFF_FFFF;

pub const QNN_QUANTIZATION_ENCODING_SCALE_OFFSET: u32 = 0;
pub const QNN_QUANTIZATION_ENCODING_AXIS_SCALE_OFFSET: u32 = 1;
pub const QNN_QUANTIZATION_ENCODING_BW_SCALE_OFFSET: u32 = 2;
pub const QNN_QUANTIZATION_ENCODING_BW_AXIS_SCALE_OFFSET: u32 = 3;
pub const QNN_QUANTIZATION_ENCODING_BLOCK: u32 = 4;
pub const QNN_QUANTIZATION_ENCODING_BLOCKWISE_EXPANSION: u32 = 5;
pub const QNN_QUANTIZATION_ENCODING_UNDEFINED: u32 = 0x7FFF_FFFF;
/// `Qnn_BlockwiseExpansionBlockScaleStorageType_t`: block scales stored as `u8` / `u16`.
pub const QNN_BLOCKWISE_EXPANSION_BITWIDTH_SCALE_STORAGE_8: u32 = 0;
pub const QNN_BLOCKWISE_EXPANSION_BITWIDTH_SCALE_STORAGE_16: u32 = 1;

// ---------------------------------------------------------------------------------------------
// Params, op configs, generic configs, memory.
// ---------------------------------------------------------------------------------------------

/// `Qnn_ParamType_t`: the param holds a `Qnn_Scalar_t`.
pub const QNN_PARAMTYPE_SCALAR: u32 = 0;
/// `Qnn_ParamType_t`: the param holds a `Qnn_Tensor_t`.
pub const QNN_PARAMTYPE_TENSOR: u32 = 1;
/// `Qnn_OpConfig_t::version` selecting `v1`.
pub const QNN_OPCONFIG_VERSION_1: u32 = 1;

/// `option` of `QnnGraph/Context/Device/Backend_Config_t` meaning "backend-specific custom
/// config behind the `customConfig` pointer".
pub const QNN_CONFIG_OPTION_CUSTOM: u32 = 0;

/// `Qnn_MemType_t` for `Qnn_MemDescriptor_t::memType`.
pub const QNN_MEM_TYPE_ION: u32 = 1;
pub const QNN_MEM_TYPE_CUSTOM: u32 = 2;
pub const QNN_MEM_TYPE_DMA_BUF: u32 = 3;

// ---------------------------------------------------------------------------------------------
// Logging and profiling.
// ---------------------------------------------------------------------------------------------

pub const QNN_LOG_LEVEL_ERROR: QnnLog_Level_t = 1;
pub const QNN_LOG_LEVEL_WARN: QnnLog_Level_t = 2;
pub const QNN_LOG_LEVEL_INFO: QnnLog_Level_t = 3;
pub const QNN_LOG_LEVEL_VERBOSE: QnnLog_Level_t = 4;
pub const QNN_LOG_LEVEL_DEBUG: QnnLog_Level_t = 5;

pub const QNN_PROFILE_LEVEL_BASIC: QnnProfile_Level_t = 1;
pub const QNN_PROFILE_LEVEL_DETAILED: QnnProfile_Level_t = 2;

/// `QnnProfile_EventUnit_t` values of `QnnProfile_EventData_t::unit`.
pub const QNN_PROFILE_EVENTUNIT_MICROSEC: u32 = 1;
pub const QNN_PROFILE_EVENTUNIT_BYTES: u32 = 2;
pub const QNN_PROFILE_EVENTUNIT_CYCLES: u32 = 3;
pub const QNN_PROFILE_EVENTUNIT_COUNT: u32 = 4;

// ---------------------------------------------------------------------------------------------
// HTP graph custom config (`QnnHtpGraph_CustomConfig_t::option`).
// ---------------------------------------------------------------------------------------------

/// Value `{type, floatValue}`; see [`QNN_HTP_GRAPH_OPTIMIZATION_TYPE_FINALIZE_OPTIMIZATION_FLAG`].
pub const QNN_HTP_GRAPH_CONFIG_OPTION_OPTIMIZATION: QnnHtpGraph_ConfigOption_t = 1;
/// Value u32: [`QNN_PRECISION_FLOAT32`] or [`QNN_PRECISION_FLOAT16`].
pub const QNN_HTP_GRAPH_CONFIG_OPTION_PRECISION: QnnHtpGraph_ConfigOption_t = 2;
/// Value u32 (0 = maximum).
pub const QNN_HTP_GRAPH_CONFIG_OPTION_VTCM_SIZE_IN_MB: QnnHtpGraph_ConfigOption_t = 3;
/// Value u64 (not u32!).
pub const QNN_HTP_GRAPH_CONFIG_OPTION_NUM_HVX_THREADS: QnnHtpGraph_ConfigOption_t = 6;
pub const QNN_HTP_GRAPH_CONFIG_OPTION_NUM_CORES: QnnHtpGraph_ConfigOption_t = 8;
pub const QNN_HTP_GRAPH_CONFIG_OPTION_VTCM_SIZE_IN_BYTES: QnnHtpGraph_ConfigOption_t = 10;

/// Optimization type whose `floatValue` trades prepare time for graph quality:
/// 1 = fastest prepare, 2 = default, 3 = slowest prepare / best graph.
pub const QNN_HTP_GRAPH_OPTIMIZATION_TYPE_FINALIZE_OPTIMIZATION_FLAG: u32 = 3;

pub const QNN_PRECISION_FLOAT32: u32 = 0;
pub const QNN_PRECISION_FLOAT16: u32 = 1;

// ---------------------------------------------------------------------------------------------
// HTP context custom config (`QnnHtpContext_CustomConfig_t::option`; the same values in the HTP
// 5.25 and 5.43 headers).
// ---------------------------------------------------------------------------------------------

/// A C `bool`: graphs of the context share static tensors of equal bytes in its binary.
pub const QNN_HTP_CONTEXT_CONFIG_OPTION_WEIGHT_SHARING_ENABLED: u32 = 1;

// ---------------------------------------------------------------------------------------------
// HTP device custom config (`QnnHtpDevice_CustomConfig_t::option`), SoC models, arches.
// ---------------------------------------------------------------------------------------------

pub const QNN_HTP_DEVICE_CONFIG_OPTION_SOC: QnnHtpDevice_ConfigOption_t = 0;
pub const QNN_HTP_DEVICE_CONFIG_OPTION_ARCH: QnnHtpDevice_ConfigOption_t = 1;
pub const QNN_HTP_DEVICE_CONFIG_OPTION_SIGNEDPD: QnnHtpDevice_ConfigOption_t = 2;

/// Snapdragon 8 Gen 2 (Hexagon v73).
pub const QNN_SOC_MODEL_SM8550: u32 = 43;
/// Snapdragon 8 Gen 3 (Hexagon v75, 8 MB VTCM). What tests should emulate: without a device
/// config the x86 library assumes SM8350 / v68 / 4 MB VTCM and hits large speed cliffs.
pub const QNN_SOC_MODEL_SM8650: u32 = 57;
/// Snapdragon 8 Elite (Hexagon v79).
pub const QNN_SOC_MODEL_SM8750: u32 = 69;
/// Hexagon v81 SoC.
pub const QNN_SOC_MODEL_SM8850: u32 = 87;

pub const QNN_HTP_DEVICE_ARCH_V68: u32 = 68;
pub const QNN_HTP_DEVICE_ARCH_V69: u32 = 69;
pub const QNN_HTP_DEVICE_ARCH_V73: u32 = 73;
pub const QNN_HTP_DEVICE_ARCH_V75: u32 = 75;
pub const QNN_HTP_DEVICE_ARCH_V79: u32 = 79;
pub const QNN_HTP_DEVICE_ARCH_V81: u32 = 81;

// ---------------------------------------------------------------------------------------------
// Op package, op type names and param names (NUL-terminated so they can be passed as C strings
// directly: use `.as_ptr()`).
// ---------------------------------------------------------------------------------------------

/// Package of QNN's built-in ops.
pub const QNN_OP_PACKAGE_NAME_QTI_AISW: &core::ffi::CStr = c"qti.aisw";

pub const QNN_OP_FULLY_CONNECTED: &core::ffi::CStr = c"FullyConnected";
pub const QNN_OP_MAT_MUL: &core::ffi::CStr = c"MatMul";
pub const QNN_OP_QUANTIZE: &core::ffi::CStr = c"Quantize";
pub const QNN_OP_DEQUANTIZE: &core::ffi::CStr = c"Dequantize";
/// Float <-> fixed point and fixed -> fixed requantize (FP32 <-> FP16 fails at finalize: use Cast).
pub const QNN_OP_CONVERT: &core::ffi::CStr = c"Convert";
pub const QNN_OP_CAST: &core::ffi::CStr = c"Cast";
pub const QNN_OP_ELEMENT_WISE_ADD: &core::ffi::CStr = c"ElementWiseAdd";
pub const QNN_OP_ELEMENT_WISE_MULTIPLY: &core::ffi::CStr = c"ElementWiseMultiply";
pub const QNN_OP_SIGMOID: &core::ffi::CStr = c"Sigmoid";
pub const QNN_OP_SOFTMAX: &core::ffi::CStr = c"Softmax";
pub const QNN_OP_RMS_NORM: &core::ffi::CStr = c"RmsNorm";
pub const QNN_OP_GELU: &core::ffi::CStr = c"Gelu";
pub const QNN_OP_RESHAPE: &core::ffi::CStr = c"Reshape";
pub const QNN_OP_TRANSPOSE: &core::ffi::CStr = c"Transpose";
pub const QNN_OP_CONCAT: &core::ffi::CStr = c"Concat";
pub const QNN_OP_STRIDED_SLICE: &core::ffi::CStr = c"StridedSlice";
/// `min(max(x, min_value), max_value)`.
pub const QNN_OP_RELU_MIN_MAX: &core::ffi::CStr = c"ReluMinMax";

/// FullyConnected: BOOL_8 scalar.
pub const QNN_OP_FULLY_CONNECTED_PARAM_KEEP_DIMS: &core::ffi::CStr = c"keep_dims";
/// MatMul: BOOL_8 scalar.
pub const QNN_OP_MAT_MUL_PARAM_TRANSPOSE_IN0: &core::ffi::CStr = c"transpose_in0";
/// MatMul: BOOL_8 scalar.
pub const QNN_OP_MAT_MUL_PARAM_TRANSPOSE_IN1: &core::ffi::CStr = c"transpose_in1";
/// Softmax (u32 scalar) and Concat (u32 scalar).
pub const QNN_OP_PARAM_AXIS: &core::ffi::CStr = c"axis";
/// Softmax: f32 scalar.
pub const QNN_OP_SOFTMAX_PARAM_BETA: &core::ffi::CStr = c"beta";
/// RmsNorm: f32 scalar.
pub const QNN_OP_RMS_NORM_PARAM_EPSILON: &core::ffi::CStr = c"epsilon";
/// RmsNorm: u32 tensor param.
pub const QNN_OP_RMS_NORM_PARAM_AXES: &core::ffi::CStr = c"axes";
/// ReluMinMax: f32 scalar.
pub const QNN_OP_RELU_MIN_MAX_PARAM_MIN_VALUE: &core::ffi::CStr = c"min_value";
/// ReluMinMax: f32 scalar.
pub const QNN_OP_RELU_MIN_MAX_PARAM_MAX_VALUE: &core::ffi::CStr = c"max_value";
/// Transpose: u32 tensor param.
pub const QNN_OP_TRANSPOSE_PARAM_PERM: &core::ffi::CStr = c"perm";
