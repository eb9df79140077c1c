//! Bad paths, as a careless or hostile user gives them: a device, a folder, a FIFO or an
//! oversized file where a file is read (`candle_npu::fs::read_bounded`), and a folder or a
//! symbolic link where an output goes (`candle_npu::fs::check_output_path`). Each is an error
//! naming the path and the cause; the command-line cases fail before the model loads (no
//! "loaded" line), so they need no model file.

mod common;
use common::llama_example;

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_npu::QuantProfile;
use candle_npu_models::chat::ChatTemplate;
use candle_npu_models::hf::HfConfig;

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("candle-npu-test-files-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The error `r` must be, naming `path` and `cause`.
fn error_naming<T>(r: candle_npu::Result<T>, path: &Path, cause: &str) -> String {
    let Err(e) = r else { panic!("expected an error naming '{cause}', got Ok") };
    let msg = e.to_string();
    assert!(msg.contains(cause) && msg.contains(&path.display().to_string()), "expected the path and '{cause}': {msg}");
    msg
}

#[test]
fn files_read_whole_are_regular_files_within_a_limit() {
    let dir = scratch("read");
    let zero = Path::new("/dev/zero");
    error_naming(QuantProfile::load(zero, "m"), zero, "quant profile: is a character device, not a regular file");
    error_naming(QuantProfile::load(&dir, "m"), &dir, "is a folder, not a regular file");
    error_naming(candle_npu_models::tokenizer::from_file(zero), zero, "tokenizer: is a character device, not a regular file");
    error_naming(ChatTemplate::from_tokenizer_config(zero), zero, "not a regular file");
    // An HF folder whose config.json is a folder.
    std::fs::create_dir(dir.join("config.json")).unwrap();
    error_naming(HfConfig::open(&dir), &dir.join("config.json"), "config.json: is a folder, not a regular file");
    // A profile over its limit (sparse: nothing is written, and nothing must be allocated).
    let big = dir.join("big.w8a8.json");
    std::fs::File::create(&big).unwrap().set_len((256 << 20) + 1).unwrap();
    error_naming(QuantProfile::load(&big, "m"), &big, "268435457 bytes, over the limit of 268435456 bytes (256 MiB)");
    let tok = dir.join("tokenizer.json");
    std::fs::File::create(&tok).unwrap().set_len(1 << 40).unwrap();
    error_naming(candle_npu_models::tokenizer::from_file(&tok), &tok, "over the limit of 134217728 bytes (128 MiB)");
    std::fs::remove_dir_all(dir).unwrap();
}

/// Runs the example with `args`, expecting it to fail before loading the model; its stderr.
fn refused_before_loading(args: &[&str]) -> String {
    let out = Command::new(llama_example()).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?}: succeeded:\n{err}");
    assert!(!err.contains("loaded ") && !err.contains("panicked"), "{args:?}: not refused before loading the model:\n{err}");
    err
}

#[test]
fn command_line_outputs_are_checked_before_the_model_loads() {
    let dir = scratch("cli");
    // --trace onto a folder: reported at once, not after the whole prefill.
    let d = dir.display().to_string();
    let err = refused_before_loading(&["--trace", &d, "--sample-len", "0"]);
    assert!(err.contains(&format!("--trace {d}: is a folder, not a file")), "{err}");
    assert!(dir.is_dir());
    // --trace onto a symbolic link: neither the link nor its target is replaced.
    let target = dir.join("target.txt");
    std::fs::write(&target, "keep").unwrap();
    let link = dir.join("trace.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let l = link.display().to_string();
    let err = refused_before_loading(&["--trace", &l, "--sample-len", "0"]);
    assert!(err.contains(&format!("--trace {l}: is a symbolic link (to {})", target.display())), "{err}");
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
    // --profile /dev/zero: never read (it is endless).
    let err = refused_before_loading(&["--profile", "/dev/zero", "--sample-len", "0"]);
    assert!(err.contains("--profile /dev/zero: not a regular file"), "{err}");
    // --profile in a folder that does not exist: it would be written there after calibrating.
    let missing = dir.join("no/such/p.json");
    let err = refused_before_loading(&["--profile", missing.to_str().unwrap(), "--sample-len", "0"]);
    assert!(err.contains(&format!("folder {} does not exist", dir.join("no/such").display())), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_model_id_without_a_home_folder_is_an_error_not_a_panic() {
    // hf-hub's own default panics with no home folder; ours says what to set.
    let out = Command::new(llama_example()).args(["--model-id", "org/absent", "--sample-len", "0"]).env_remove("HOME").env_remove("HF_HOME").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !err.contains("panicked"), "{err}");
    assert!(err.contains("org/absent") && err.contains("set HF_HOME (or HOME)"), "{err}");
}
