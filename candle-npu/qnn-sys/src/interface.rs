//! `QnnInterface_t`: what `QnnInterface_getProviders` hands out, with the function table of core
//! API 2.32 held inline (71 entries, in the order of `QNN_FACTS.md`).
//!
//! Entries a prefill executor calls carry their real C signature. The others are typed as
//! [`QnnFnPlaceholder`] (`Option<unsafe extern "C" fn()>`): they keep the table's layout exact
//! and must be given their real signature (transmute, or a new type here) before being called.
//! Every entry is an `Option` because a backend leaves what it does not implement NULL.

use core::ffi::{c_char, c_void};

use crate::types::*;

/// A table entry this crate does not call; only its slot (8 bytes) matters.
pub type QnnFnPlaceholder = Option<unsafe extern "C" fn()>;

/// The inline function table of `QnnInterface_t` (core API 2.32, 71 entries, 568 bytes).
/// Since API 2.9 newer libraries only append entries, so this prefix stays valid for every
/// 2.x library whose minor is >= 32 (the loader checks that).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct QnnInterfaceFunctions_t {
    /// `(Qnn_Property_Key_t key)`.
    pub propertyHasCapability: Option<unsafe extern "C" fn(key: u32) -> Qnn_ErrorHandle_t>,
    /// `(log, const QnnBackend_Config_t** config /*NULL-terminated or NULL*/, out backend)`.
    pub backendCreate: Option<
        unsafe extern "C" fn(logger: Qnn_LogHandle_t, config: *const *const QnnBackend_Config_t, backend: *mut Qnn_BackendHandle_t) -> Qnn_ErrorHandle_t,
    >,
    pub backendSetConfig: Option<unsafe extern "C" fn(backend: Qnn_BackendHandle_t, config: *const *const QnnBackend_Config_t) -> Qnn_ErrorHandle_t>,
    pub backendGetApiVersion: Option<unsafe extern "C" fn(version: *mut Qnn_ApiVersion_t) -> Qnn_ErrorHandle_t>,
    /// Writes a pointer to a static, NUL-terminated string owned by the library.
    pub backendGetBuildId: Option<unsafe extern "C" fn(id: *mut *const c_char) -> Qnn_ErrorHandle_t>,
    /// `(backend, packagePath, interfaceProvider, target)`.
    pub backendRegisterOpPackage: Option<
        unsafe extern "C" fn(
            backend: Qnn_BackendHandle_t,
            package_path: *const c_char,
            interface_provider: *const c_char,
            target: *const c_char,
        ) -> Qnn_ErrorHandle_t,
    >,
    pub backendGetSupportedOperations: QnnFnPlaceholder,
    /// Checks one op config without a graph. `op` is passed BY VALUE (80 bytes).
    pub backendValidateOpConfig: Option<unsafe extern "C" fn(backend: Qnn_BackendHandle_t, op: Qnn_OpConfig_t) -> Qnn_ErrorHandle_t>,
    pub backendFree: Option<unsafe extern "C" fn(backend: Qnn_BackendHandle_t) -> Qnn_ErrorHandle_t>,
    /// `(backend, device /*may be NULL*/, config, out context)`.
    pub contextCreate: Option<
        unsafe extern "C" fn(
            backend: Qnn_BackendHandle_t,
            device: Qnn_DeviceHandle_t,
            config: *const *const QnnContext_Config_t,
            context: *mut Qnn_ContextHandle_t,
        ) -> Qnn_ErrorHandle_t,
    >,
    pub contextSetConfig: Option<unsafe extern "C" fn(context: Qnn_ContextHandle_t, config: *const *const QnnContext_Config_t) -> Qnn_ErrorHandle_t>,
    /// Upper bound of the serialized context size (valid after every graph is finalized).
    pub contextGetBinarySize: Option<unsafe extern "C" fn(context: Qnn_ContextHandle_t, size: *mut u64) -> Qnn_ErrorHandle_t>,
    pub contextGetBinary:
        Option<unsafe extern "C" fn(context: Qnn_ContextHandle_t, buffer: *mut c_void, buffer_size: u64, written: *mut u64) -> Qnn_ErrorHandle_t>,
    /// `(backend, device, config, buffer, size, out context, profile /*may be NULL*/)`.
    pub contextCreateFromBinary: Option<
        unsafe extern "C" fn(
            backend: Qnn_BackendHandle_t,
            device: Qnn_DeviceHandle_t,
            config: *const *const QnnContext_Config_t,
            buffer: *const c_void,
            buffer_size: u64,
            context: *mut Qnn_ContextHandle_t,
            profile: Qnn_ProfileHandle_t,
        ) -> Qnn_ErrorHandle_t,
    >,
    /// Frees the context and every graph in it.
    pub contextFree: Option<unsafe extern "C" fn(context: Qnn_ContextHandle_t, profile: Qnn_ProfileHandle_t) -> Qnn_ErrorHandle_t>,
    pub graphCreate: Option<
        unsafe extern "C" fn(
            context: Qnn_ContextHandle_t,
            name: *const c_char,
            config: *const *const QnnGraph_Config_t,
            graph: *mut Qnn_GraphHandle_t,
        ) -> Qnn_ErrorHandle_t,
    >,
    pub graphCreateSubgraph: QnnFnPlaceholder,
    pub graphSetConfig: Option<unsafe extern "C" fn(graph: Qnn_GraphHandle_t, config: *const *const QnnGraph_Config_t) -> Qnn_ErrorHandle_t>,
    /// `op` is passed BY VALUE (80 bytes).
    pub graphAddNode: Option<unsafe extern "C" fn(graph: Qnn_GraphHandle_t, op: Qnn_OpConfig_t) -> Qnn_ErrorHandle_t>,
    /// `(graph, profile, signal)`, both may be NULL.
    pub graphFinalize: Option<unsafe extern "C" fn(graph: Qnn_GraphHandle_t, profile: Qnn_ProfileHandle_t, signal: Qnn_SignalHandle_t) -> Qnn_ErrorHandle_t>,
    /// Looks a graph up by name in a context created from a binary.
    pub graphRetrieve: Option<unsafe extern "C" fn(context: Qnn_ContextHandle_t, name: *const c_char, graph: *mut Qnn_GraphHandle_t) -> Qnn_ErrorHandle_t>,
    /// Does NOT check `clientBuf.dataSize`: check every buffer's size before calling.
    pub graphExecute: Option<
        unsafe extern "C" fn(
            graph: Qnn_GraphHandle_t,
            inputs: *const Qnn_Tensor_t,
            num_inputs: u32,
            outputs: *mut Qnn_Tensor_t,
            num_outputs: u32,
            profile: Qnn_ProfileHandle_t,
            signal: Qnn_SignalHandle_t,
        ) -> Qnn_ErrorHandle_t,
    >,
    pub graphExecuteAsync: QnnFnPlaceholder,
    /// In/out: the library writes the new tensor's `id`.
    pub tensorCreateContextTensor: Option<unsafe extern "C" fn(context: Qnn_ContextHandle_t, tensor: *mut Qnn_Tensor_t) -> Qnn_ErrorHandle_t>,
    /// In/out: the library writes the new tensor's `id`.
    pub tensorCreateGraphTensor: Option<unsafe extern "C" fn(graph: Qnn_GraphHandle_t, tensor: *mut Qnn_Tensor_t) -> Qnn_ErrorHandle_t>,
    /// `(callback /*may be NULL*/, maxLogLevel, out log)`.
    pub logCreate: Option<unsafe extern "C" fn(callback: QnnLog_Callback_t, max_level: QnnLog_Level_t, logger: *mut Qnn_LogHandle_t) -> Qnn_ErrorHandle_t>,
    pub logSetLogLevel: Option<unsafe extern "C" fn(logger: Qnn_LogHandle_t, max_level: QnnLog_Level_t) -> Qnn_ErrorHandle_t>,
    pub logFree: Option<unsafe extern "C" fn(logger: Qnn_LogHandle_t) -> Qnn_ErrorHandle_t>,
    pub profileCreate:
        Option<unsafe extern "C" fn(backend: Qnn_BackendHandle_t, level: QnnProfile_Level_t, profile: *mut Qnn_ProfileHandle_t) -> Qnn_ErrorHandle_t>,
    pub profileSetConfig: QnnFnPlaceholder,
    /// The id array is owned by the library.
    pub profileGetEvents:
        Option<unsafe extern "C" fn(profile: Qnn_ProfileHandle_t, events: *mut *const QnnProfile_EventId_t, num_events: *mut u32) -> Qnn_ErrorHandle_t>,
    pub profileGetSubEvents:
        Option<unsafe extern "C" fn(event: QnnProfile_EventId_t, sub_events: *mut *const QnnProfile_EventId_t, num_sub_events: *mut u32) -> Qnn_ErrorHandle_t>,
    pub profileGetEventData: Option<unsafe extern "C" fn(event: QnnProfile_EventId_t, data: *mut QnnProfile_EventData_t) -> Qnn_ErrorHandle_t>,
    pub profileGetExtendedEventData: QnnFnPlaceholder,
    pub profileFree: Option<unsafe extern "C" fn(profile: Qnn_ProfileHandle_t) -> Qnn_ErrorHandle_t>,
    pub memRegister: Option<
        unsafe extern "C" fn(
            context: Qnn_ContextHandle_t,
            descriptors: *const Qnn_MemDescriptor_t,
            num_descriptors: u32,
            handles: *mut Qnn_MemHandle_t,
        ) -> Qnn_ErrorHandle_t,
    >,
    pub memDeRegister: Option<unsafe extern "C" fn(handles: *const Qnn_MemHandle_t, num_handles: u32) -> Qnn_ErrorHandle_t>,
    pub deviceGetPlatformInfo: QnnFnPlaceholder,
    pub deviceFreePlatformInfo: QnnFnPlaceholder,
    pub deviceGetInfrastructure: QnnFnPlaceholder,
    /// `(log, const QnnDevice_Config_t** config, out device)`.
    pub deviceCreate:
        Option<unsafe extern "C" fn(logger: Qnn_LogHandle_t, config: *const *const QnnDevice_Config_t, device: *mut Qnn_DeviceHandle_t) -> Qnn_ErrorHandle_t>,
    pub deviceSetConfig: Option<unsafe extern "C" fn(device: Qnn_DeviceHandle_t, config: *const *const QnnDevice_Config_t) -> Qnn_ErrorHandle_t>,
    pub deviceGetInfo: QnnFnPlaceholder,
    pub deviceFree: Option<unsafe extern "C" fn(device: Qnn_DeviceHandle_t) -> Qnn_ErrorHandle_t>,
    pub signalCreate: QnnFnPlaceholder,
    pub signalSetConfig: QnnFnPlaceholder,
    pub signalTrigger: QnnFnPlaceholder,
    pub signalFree: QnnFnPlaceholder,
    /// Writes a pointer to a static message string owned by the library.
    pub errorGetMessage: Option<unsafe extern "C" fn(error: Qnn_ErrorHandle_t, message: *mut *const c_char) -> Qnn_ErrorHandle_t>,
    /// The message must be released with `errorFreeVerboseMessage`.
    pub errorGetVerboseMessage: Option<unsafe extern "C" fn(error: Qnn_ErrorHandle_t, message: *mut *const c_char) -> Qnn_ErrorHandle_t>,
    pub errorFreeVerboseMessage: Option<unsafe extern "C" fn(message: *const c_char) -> Qnn_ErrorHandle_t>,
    pub graphPrepareExecutionEnvironment: QnnFnPlaceholder,
    pub graphReleaseExecutionEnvironment: QnnFnPlaceholder,
    pub graphGetProperty: QnnFnPlaceholder,
    pub contextValidateBinary: QnnFnPlaceholder,
    pub contextCreateFromBinaryWithSignal: QnnFnPlaceholder,
    pub contextCreateFromBinaryListAsync: QnnFnPlaceholder,
    pub tensorUpdateGraphTensors: QnnFnPlaceholder,
    pub tensorUpdateContextTensors: QnnFnPlaceholder,
    pub contextGetBinarySectionSize: QnnFnPlaceholder,
    pub contextGetBinarySection: QnnFnPlaceholder,
    pub contextApplyBinarySection: QnnFnPlaceholder,
    pub backendGetProperty: QnnFnPlaceholder,
    pub contextGetProperty: QnnFnPlaceholder,
    pub contextGetIncrementalBinary: QnnFnPlaceholder,
    pub contextReleaseIncrementalBinary: QnnFnPlaceholder,
    pub contextFinalize: QnnFnPlaceholder,
    pub globalConfigSet: QnnFnPlaceholder,
    pub contextCreateFromBinaryWithCallback: QnnFnPlaceholder,
    pub contextGetBinarySectionUpdate: QnnFnPlaceholder,
    pub contextFreeBinarySectionUpdate: QnnFnPlaceholder,
}

/// `QnnInterface_t` (608 bytes): one backend provider.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct QnnInterface_t {
    /// 6 = HTP ([`crate::QNN_BACKEND_ID_HTP`]).
    pub backendId: u32,
    /// e.g. `"HTP_QTI_AISW"`.
    pub providerName: *const c_char,
    pub apiVersion: Qnn_ApiVersion_t,
    /// The function table, inline (in C: a one-member union named after the API version).
    pub functions: QnnInterfaceFunctions_t,
}

/// Signature of `QnnInterface_getProviders`, the one symbol every QNN backend library exports.
/// Writes a pointer to the library's static array of provider pointers and its length.
pub type QnnInterfaceGetProvidersFn = unsafe extern "C" fn(provider_list: *mut *const *const QnnInterface_t, num_providers: *mut u32) -> Qnn_ErrorHandle_t;
