//! Compile-time layout checks: the size and alignment of every type and every offset
//! `QNN_FACTS.md` lists (LP64: x86_64 and aarch64 agree). A mismatch is a build error, not a
//! crash inside the library.

use core::mem::{align_of, offset_of, size_of};

use crate::interface::*;
use crate::system::*;
use crate::types::*;

macro_rules! assert_layout {
    ($t:ty, $size:expr, $align:expr) => {
        const _: () = assert!(size_of::<$t>() == $size && align_of::<$t>() == $align);
    };
}
macro_rules! assert_offset {
    ($t:ty, $($field:ident).+, $off:expr) => {
        const _: () = assert!(offset_of!($t, $($field).+) == $off);
    };
}

#[cfg(not(target_pointer_width = "64"))]
compile_error!("qnn-sys declares the LP64 layouts of the QNN ABI (x86_64 / aarch64) only");

// Scalars and handles.
assert_layout!(Qnn_ErrorHandle_t, 8, 8);
assert_layout!(Qnn_BackendHandle_t, 8, 8);
assert_layout!(Qnn_ContextHandle_t, 8, 8);
assert_layout!(Qnn_DeviceHandle_t, 8, 8);
assert_layout!(Qnn_GraphHandle_t, 8, 8);
assert_layout!(Qnn_LogHandle_t, 8, 8);
assert_layout!(Qnn_MemHandle_t, 8, 8);
assert_layout!(Qnn_ProfileHandle_t, 8, 8);
assert_layout!(Qnn_SignalHandle_t, 8, 8);
assert_layout!(QnnLog_Callback_t, 8, 8);
assert_layout!(QnnFnPlaceholder, 8, 8);

// Versions.
assert_layout!(Qnn_Version_t, 12, 4);
assert_offset!(Qnn_Version_t, minor, 4);
assert_offset!(Qnn_Version_t, patch, 8);
assert_layout!(Qnn_ApiVersion_t, 24, 4);
assert_offset!(Qnn_ApiVersion_t, backendApiVersion, 12);

// Quantization.
assert_layout!(Qnn_ScaleOffset_t, 8, 4);
assert_offset!(Qnn_ScaleOffset_t, offset, 4);
assert_layout!(Qnn_AxisScaleOffset_t, 16, 8);
assert_offset!(Qnn_AxisScaleOffset_t, numScaleOffsets, 4);
assert_offset!(Qnn_AxisScaleOffset_t, scaleOffset, 8);
assert_layout!(Qnn_BlockwiseExpansion_t, 40, 8);
assert_offset!(Qnn_BlockwiseExpansion_t, scaleOffsets, 8);
assert_offset!(Qnn_BlockwiseExpansion_t, numBlocksPerAxis, 16);
assert_offset!(Qnn_BlockwiseExpansion_t, blockScaleBitwidth, 20);
assert_offset!(Qnn_BlockwiseExpansion_t, blockScaleStorageType, 24);
assert_offset!(Qnn_BlockwiseExpansion_t, blocksScale, 32);
assert_layout!(Qnn_QuantizeParamsEncoding_t, 32, 8);
assert_layout!(Qnn_QuantizeParams_t, 40, 8);
assert_offset!(Qnn_QuantizeParams_t, quantizationEncoding, 4);
assert_offset!(Qnn_QuantizeParams_t, encoding, 8);

// Tensors.
assert_layout!(Qnn_ClientBuffer_t, 16, 8);
assert_offset!(Qnn_ClientBuffer_t, dataSize, 8);
assert_layout!(Qnn_TensorMemory_t, 16, 8);
assert_layout!(Qnn_TensorV1_t, 112, 8);
assert_offset!(Qnn_TensorV1_t, id, 0);
assert_offset!(Qnn_TensorV1_t, name, 8);
assert_offset!(Qnn_TensorV1_t, type_, 16);
assert_offset!(Qnn_TensorV1_t, dataFormat, 20);
assert_offset!(Qnn_TensorV1_t, dataType, 24);
assert_offset!(Qnn_TensorV1_t, quantizeParams, 32);
assert_offset!(Qnn_TensorV1_t, rank, 72);
assert_offset!(Qnn_TensorV1_t, dimensions, 80);
assert_offset!(Qnn_TensorV1_t, memType, 88);
assert_offset!(Qnn_TensorV1_t, memory, 96);
assert_layout!(Qnn_SparseParams_t, 12, 4);
assert_layout!(Qnn_TensorV2_t, 136, 8);
assert_offset!(Qnn_TensorV2_t, id, 0);
assert_offset!(Qnn_TensorV2_t, name, 8);
assert_offset!(Qnn_TensorV2_t, type_, 16);
assert_offset!(Qnn_TensorV2_t, dataFormat, 20);
assert_offset!(Qnn_TensorV2_t, dataType, 24);
assert_offset!(Qnn_TensorV2_t, quantizeParams, 32);
assert_offset!(Qnn_TensorV2_t, rank, 72);
assert_offset!(Qnn_TensorV2_t, dimensions, 80);
assert_offset!(Qnn_TensorV2_t, memType, 88);
assert_offset!(Qnn_TensorV2_t, memory, 96);
assert_offset!(Qnn_TensorV2_t, isDynamicDimensions, 112);
assert_offset!(Qnn_TensorV2_t, sparseParams, 120);
assert_offset!(Qnn_TensorV2_t, isProduced, 132);
assert_layout!(Qnn_TensorVersions_t, 136, 8);
assert_layout!(Qnn_Tensor_t, 144, 8);
assert_offset!(Qnn_Tensor_t, u, 8);

// Params and op configs.
assert_layout!(Qnn_ScalarValue_t, 8, 8);
assert_layout!(Qnn_Scalar_t, 16, 8);
assert_offset!(Qnn_Scalar_t, value, 8);
assert_layout!(Qnn_ParamValue_t, 144, 8);
assert_layout!(Qnn_Param_t, 160, 8);
assert_offset!(Qnn_Param_t, name, 8);
assert_offset!(Qnn_Param_t, value, 16);
assert_layout!(Qnn_OpConfigV1_t, 72, 8);
assert_offset!(Qnn_OpConfigV1_t, name, 0);
assert_offset!(Qnn_OpConfigV1_t, packageName, 8);
assert_offset!(Qnn_OpConfigV1_t, typeName, 16);
assert_offset!(Qnn_OpConfigV1_t, numOfParams, 24);
assert_offset!(Qnn_OpConfigV1_t, params, 32);
assert_offset!(Qnn_OpConfigV1_t, numOfInputs, 40);
assert_offset!(Qnn_OpConfigV1_t, inputTensors, 48);
assert_offset!(Qnn_OpConfigV1_t, numOfOutputs, 56);
assert_offset!(Qnn_OpConfigV1_t, outputTensors, 64);
assert_layout!(Qnn_OpConfigVersions_t, 72, 8);
assert_layout!(Qnn_OpConfig_t, 80, 8);
assert_offset!(Qnn_OpConfig_t, u, 8);

// Generic configs.
assert_layout!(Qnn_ConfigValue_t, 8, 8);
assert_layout!(QnnGraph_Config_t, 16, 8);
assert_offset!(QnnGraph_Config_t, value, 8);
assert_layout!(QnnContext_Config_t, 16, 8);
assert_offset!(QnnContext_Config_t, value, 8);
assert_layout!(QnnDevice_Config_t, 16, 8);
assert_offset!(QnnDevice_Config_t, value, 8);
assert_layout!(QnnBackend_Config_t, 16, 8);
assert_offset!(QnnBackend_Config_t, value, 8);

// HTP custom configs.
assert_layout!(QnnHtpGraph_OptimizationOption_t, 8, 4);
assert_offset!(QnnHtpGraph_OptimizationOption_t, floatValue, 4);
assert_layout!(QnnHtpGraph_CustomConfigValue_t, 48, 8);
assert_layout!(QnnHtpGraph_CustomConfig_t, 56, 8);
assert_offset!(QnnHtpGraph_CustomConfig_t, value, 8);
// The union holds a pointer and a u64 in every header version: it starts at 8.
assert_layout!(QnnHtpContext_CustomConfig_t, 40, 8);
assert_offset!(QnnHtpContext_CustomConfig_t, value, 8);
assert_layout!(QnnHtpDevice_Arch_t, 8, 4);
assert_offset!(QnnHtpDevice_Arch_t, arch, 4);
assert_layout!(QnnHtpDevice_CustomConfigValue_t, 8, 8);
assert_layout!(QnnHtpDevice_CustomConfig_t, 16, 8);
assert_offset!(QnnHtpDevice_CustomConfig_t, value, 8);
assert_offset!(QnnHtpDevice_CustomConfig_t, value.socModel, 8);
assert_offset!(QnnHtpDevice_CustomConfig_t, value.arch.deviceId, 8);
assert_offset!(QnnHtpDevice_CustomConfig_t, value.arch.arch, 12);
assert_layout!(QnnHtpDevice_CustomConfigValueV543_t, 8, 4);
assert_layout!(QnnHtpDevice_CustomConfigV543_t, 12, 4);
assert_offset!(QnnHtpDevice_CustomConfigV543_t, value, 4);

// Memory and profiling.
assert_layout!(Qnn_MemShape_t, 24, 8);
assert_offset!(Qnn_MemShape_t, dimSize, 8);
assert_offset!(Qnn_MemShape_t, shapeConfig, 16);
assert_layout!(Qnn_MemIonInfo_t, 4, 4);
assert_layout!(Qnn_MemDmaBufInfo_t, 16, 8);
assert_offset!(Qnn_MemDmaBufInfo_t, data, 8);
assert_layout!(Qnn_MemInfo_t, 16, 8);
assert_layout!(Qnn_MemDescriptor_t, 48, 8);
assert_offset!(Qnn_MemDescriptor_t, memShape, 0);
assert_offset!(Qnn_MemDescriptor_t, dataType, 24);
assert_offset!(Qnn_MemDescriptor_t, memType, 28);
assert_offset!(Qnn_MemDescriptor_t, info, 32);
assert_layout!(QnnProfile_EventData_t, 24, 8);
assert_offset!(QnnProfile_EventData_t, unit, 4);
assert_offset!(QnnProfile_EventData_t, value, 8);
assert_offset!(QnnProfile_EventData_t, identifier, 16);

// The interface and its function table: every entry at 8 * index.
assert_layout!(QnnInterfaceFunctions_t, 8 * crate::QNN_INTERFACE_FUNCTION_COUNT, 8);
assert_layout!(QnnInterface_t, 608, 8);
assert_offset!(QnnInterface_t, backendId, 0);
assert_offset!(QnnInterface_t, providerName, 8);
assert_offset!(QnnInterface_t, apiVersion, 16);
assert_offset!(QnnInterface_t, functions, 40);

macro_rules! assert_table {
    ($($field:ident = $off:expr),+ $(,)?) => {
        $(
            assert_offset!(QnnInterfaceFunctions_t, $field, $off);
            assert_offset!(QnnInterface_t, functions.$field, $off + 40);
        )+
    };
}

assert_table!(
    propertyHasCapability = 0,
    backendCreate = 8,
    backendSetConfig = 16,
    backendGetApiVersion = 24,
    backendGetBuildId = 32,
    backendRegisterOpPackage = 40,
    backendGetSupportedOperations = 48,
    backendValidateOpConfig = 56,
    backendFree = 64,
    contextCreate = 72,
    contextSetConfig = 80,
    contextGetBinarySize = 88,
    contextGetBinary = 96,
    contextCreateFromBinary = 104,
    contextFree = 112,
    graphCreate = 120,
    graphCreateSubgraph = 128,
    graphSetConfig = 136,
    graphAddNode = 144,
    graphFinalize = 152,
    graphRetrieve = 160,
    graphExecute = 168,
    graphExecuteAsync = 176,
    tensorCreateContextTensor = 184,
    tensorCreateGraphTensor = 192,
    logCreate = 200,
    logSetLogLevel = 208,
    logFree = 216,
    profileCreate = 224,
    profileSetConfig = 232,
    profileGetEvents = 240,
    profileGetSubEvents = 248,
    profileGetEventData = 256,
    profileGetExtendedEventData = 264,
    profileFree = 272,
    memRegister = 280,
    memDeRegister = 288,
    deviceGetPlatformInfo = 296,
    deviceFreePlatformInfo = 304,
    deviceGetInfrastructure = 312,
    deviceCreate = 320,
    deviceSetConfig = 328,
    deviceGetInfo = 336,
    deviceFree = 344,
    signalCreate = 352,
    signalSetConfig = 360,
    signalTrigger = 368,
    signalFree = 376,
    errorGetMessage = 384,
    errorGetVerboseMessage = 392,
    errorFreeVerboseMessage = 400,
    graphPrepareExecutionEnvironment = 408,
    graphReleaseExecutionEnvironment = 416,
    graphGetProperty = 424,
    contextValidateBinary = 432,
    contextCreateFromBinaryWithSignal = 440,
    contextCreateFromBinaryListAsync = 448,
    tensorUpdateGraphTensors = 456,
    tensorUpdateContextTensors = 464,
    contextGetBinarySectionSize = 472,
    contextGetBinarySection = 480,
    contextApplyBinarySection = 488,
    backendGetProperty = 496,
    contextGetProperty = 504,
    contextGetIncrementalBinary = 512,
    contextReleaseIncrementalBinary = 520,
    contextFinalize = 528,
    globalConfigSet = 536,
    contextCreateFromBinaryWithCallback = 544,
    contextGetBinarySectionUpdate = 552,
    contextFreeBinarySectionUpdate = 560,
);

// The System library's interface (system.rs): the table starts after the 12-byte version.
assert_offset!(QnnSystemInterface_t, providerName, 8);
assert_offset!(QnnSystemInterface_t, systemApiVersion, 16);
assert_offset!(QnnSystemInterface_t, functions, 32);
assert_layout!(QnnSystemFunctions_t, 32, 8);
