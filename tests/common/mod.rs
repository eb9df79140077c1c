//! Shared by the integration tests: the real SmolLM2 weights and Wikipedia text from
//! `scripts/setup.sh`. Tests fail (not skip) when they are missing: CI always runs the set-up.
#![allow(dead_code)]

use candle_npu::NpuDevice;
use candle_npu_models::{assets, DecodeWeights, LoadOptions, Pipeline, Precision};

pub fn smollm2(device: &NpuDevice, precision: Precision, decode_weights: DecodeWeights) -> Pipeline {
    let path = assets::smollm2();
    assert!(path.exists(), "{} missing: run scripts/setup.sh first", path.display());
    Pipeline::load(&path, None, device, LoadOptions { precision: Some(precision), decode_weights, ..Default::default() }).expect("load SmolLM2")
}

/// `n` tokens of held-out Wikipedia text (articles never used for calibration).
pub fn heldout_tokens(p: &Pipeline, n: usize) -> Vec<u32> {
    let ids = p.heldout_tokens(n).unwrap();
    assert_eq!(ids.len(), n, "not enough held-out text");
    ids
}

/// max |a - b| / max |b|
pub fn rel_max_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let num = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    let den = b.iter().fold(0f32, |m, y| m.max(y.abs()));
    num / den
}

/// llama.cpp's token ids for the reference sentence, for the model file `file`
/// (tests/data/tokenizer_ids.json, a copy of the shared reference data).
pub fn reference_ids(file: &str) -> Vec<u32> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer_ids.json");
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    j[file].as_array().unwrap_or_else(|| panic!("{file} not in {}", path.display())).iter().map(|v| v.as_u64().unwrap() as u32).collect()
}

/// The `llama` example binary cargo built beside the running test (for command-line cases).
pub fn llama_example() -> std::path::PathBuf {
    example("llama")
}

/// Runs the `llama` example with `args`, `stdin` typed into it and then closed (for
/// `--interactive` cases), and waits for it.
pub fn llama_with_stdin(args: &[&str], stdin: &[u8]) -> std::process::Output {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new(llama_example()).args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    child.wait_with_output().unwrap()
}

/// The example binary `name` cargo built beside the running test.
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(std::path::Path::parent).expect("target/<profile>/deps");
    let bin = dir.join("examples").join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(bin.exists(), "{} missing: `cargo test` builds the examples", bin.display());
    bin
}

/// Whether the QNN HTP library is there; prints why the test is skipped when it is not.
pub fn library_present() -> bool {
    let lib = candle_npu::HtpConfig::default().library_path();
    if !lib.exists() {
        eprintln!("skipped: {} absent (run scripts/setup.sh)", lib.display());
    }
    lib.exists()
}
