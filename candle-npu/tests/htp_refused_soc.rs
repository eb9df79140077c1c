//! A device the QNN HTP library refuses is an error naming the SoC. In a process of its own: a
//! refused `deviceCreate` (SoC 9999) changes the library's process-wide state, and graphs
//! finalized afterwards, on any executor, compute float ops in FP32 instead of FP16 (measured on
//! the x86 library: a per-channel FullyConnected's F32 output then matches the exact host to
//! 4e-7 instead of the FP16 model). In the conformance tests' process it made the HTP numerics
//! checks fail whenever it ran first.

use candle_npu::{Error, HtpConfig, HtpExecutor};

#[test]
fn device_refusing_the_soc_is_a_qnn_library_error() {
    let path = HtpConfig::default().library_path();
    if !path.is_file() {
        eprintln!("skipping: QNN HTP library {} is absent (run scripts/setup.sh or set CANDLE_NPU_QNN_LIB_DIR)", path.display());
        return;
    }
    let err = HtpExecutor::new(HtpConfig { soc_model: 9999, ..Default::default() }).unwrap_err();
    assert!(matches!(&err, Error::QnnLibrary { reason, .. } if reason.contains("deviceCreate") && reason.contains("9999")), "{err}");
}
