//! Bad paths, as a careless or hostile user gives them: a device, a folder, a FIFO or an
//! oversized file where a file is read (`candle_npu::fs::read_bounded`), and a folder or a
//! symbolic link where an output goes (`candle_npu::fs::check_output_path`). Each is an error
//! naming the path and the cause; the command-line cases fail before the model loads (no
//! "loaded" line), so they need no model file.

mod common;
use common::llama_example;

#[path = "fuzz/props.rs"]
mod props;

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
    // --graph-cache naming a file: said so, not "File exists" from a write after the prefill.
    let t = target.display().to_string();
    let err = refused_before_loading(&["--executor", "hexagon", "--graph-cache", &t, "--sample-len", "0"]);
    assert!(err.contains(&format!("--graph-cache {t}: not a folder")), "{err}");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
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

/// `tokenizer.json` contents that make the `tokenizers` library (or the regex engine under it)
/// panic, fail on every prompt or grow a prompt without bound: each is an error naming the file
/// at load, or the prompt at encoding; none ends the process.
#[test]
fn hostile_tokenizer_files_are_errors_at_load_or_encoding() {
    use candle_npu_models::gguf::Gguf;
    use candle_npu_models::tokenizer;
    let dir = scratch("tokenizer");
    let model = candle_npu_models::assets::smollm2();
    let base: serde_json::Value = serde_json::from_str(&tokenizer::from_gguf(&Gguf::open(&model).unwrap()).unwrap().to_string(false).unwrap()).unwrap();
    let write = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let mut v = base.clone();
        edit(&mut v);
        let path = dir.join(name);
        std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
        path
    };
    let at_load = |name: &str, edit: &dyn Fn(&mut serde_json::Value), cause: &str| {
        let path = write(name, edit);
        error_naming(tokenizer::from_file(&path), &path, cause);
    };
    assert!(tokenizer::from_file(&write("base.json", &|_| {})).is_ok(), "the unedited file loads");
    // A precompiled charsmap that does not parse.
    at_load("charsmap.json", &|v| v["normalizer"] = serde_json::json!({"type": "Precompiled", "precompiled_charsmap": "AAECAwQF"}), "tokenizer");
    // A post-processor naming a special token the vocabulary lacks.
    at_load(
        "post.json",
        &|v| {
            v["post_processor"] = serde_json::json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<missing>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {}})
        },
        "tokenizer",
    );
    // An unknown token that is not in the vocabulary: every prompt would fail.
    at_load("unk.json", &|v| v["model"]["unk_token"] = serde_json::json!("<no such token>"), "unknown token \"<no such token>\" is not in its vocabulary");
    // A normalizer that drops every character: every prompt would be "empty".
    at_load(
        "drops.json",
        &|v| v["normalizer"] = serde_json::json!({"type": "Replace", "pattern": {"Regex": "[^\\n]"}, "content": ""}),
        "drops every character",
    );
    // A split regex that backtracks catastrophically: loads (short texts are fine), and a
    // long text is an error naming it, not a panic.
    let regex = write("regex.json", &|v| {
        v["pre_tokenizer"] = serde_json::json!({"type": "Split", "pattern": {"Regex": "(a|aa)+$"}, "behavior": "Isolated", "invert": false})
    });
    let tok = tokenizer::from_file(&regex).unwrap();
    let long = format!("{}!", "a".repeat(20_000));
    // (Oniguruma gives up at its retry limit, and `tokenizers` panics on that.)
    let e = tokenizer::encode(&tok, &long, false).unwrap_err().to_string();
    assert!(e.contains("on a text of 20001 bytes") && e.contains("retry-limit"), "{e}");

    // In a pipeline: a prompt is bounded before the tokenizer normalizes it. A normalizer that
    // turns each "a" into 1 MB would make 200 of them allocate 200 MB.
    let grows = write("grows.json", &|v| v["normalizer"] = serde_json::json!({"type": "Replace", "pattern": {"String": "a"}, "content": "b".repeat(1 << 20)}));
    let p = candle_npu_models::Pipeline::load(&model, Some(&grows), &candle_npu::NpuDevice::host(), Default::default()).unwrap();
    let e = p.encode_with(&"a".repeat(200), false, false).unwrap_err().to_string();
    assert!(e.contains("a prompt of 200 bytes") && e.contains("may grow text 1048576x") && e.contains("shorten it"), "{e}");
    // 12 MB of spaces (the split regex once ran out of backtracking on them and panicked).
    let p = candle_npu_models::Pipeline::load(&model, None, &candle_npu::NpuDevice::host(), Default::default()).unwrap();
    let e = p.encode_with(&" ".repeat(12 << 20), true, false).unwrap_err().to_string();
    assert!(e.contains("a prompt of 12582912 bytes") && e.contains("context of 8192 tokens"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// Every file-path option of the command line pointed at each file of the run and at paths that
/// are no file to write (a folder, a device, a missing folder), on the tiny model: no run panics,
/// every file a run reads keeps its bytes, and a refusal names the option or the path.
#[test]
fn every_path_option_against_every_file_of_the_run() {
    let dir = scratch("cross");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (model, tok) = props::tiny_model_files(&dir);
    let (profile, session, draft) = (QuantProfile::default_path(&model), dir.join("s.kv"), dir.join("d.gguf"));
    std::fs::copy(&model, &draft).unwrap();
    let base = ["--model".to_string(), s(&model), "--tokenizer".into(), s(&tok), "--prompt".into(), "hi".into(), "--sample-len".into(), "1".into()];
    let run = |extra: &[String]| {
        let out = Command::new(llama_example()).args(&base).args(extra).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    // The first run calibrates (writing the default profile) and saves the conversation.
    let (ok, err) = run(&["--save-session".into(), s(&session)]);
    assert!(ok && profile.is_file() && session.is_file(), "{err}");
    let files = [&model, &tok, &profile, &session, &draft];
    let bytes = |f: &Path| std::fs::read(f).unwrap();
    let kept: Vec<Vec<u8>> = files.iter().map(|f| bytes(f)).collect();
    let targets = [model.clone(), tok.clone(), profile.clone(), session.clone(), draft.clone(), dir.clone(), PathBuf::from("/dev/null"), dir.join("missing/x")];
    let mut refused = 0;
    for option in ["--trace", "--save-session", "--profile", "--load-session", "--tokenizer", "--draft-model"] {
        for target in &targets {
            let (ok, err) = run(&[option.to_string(), s(target)]);
            let case = format!("{option} {}", target.display());
            assert!(!err.contains("panicked"), "{case}: {err}");
            if !ok {
                refused += 1;
                assert!(err.contains(option) || err.contains(&s(target)) || err.contains(&s(&model)), "{case}: the refusal names neither:\n{err}");
            }
            // What this run reads: the model, tokenizer and default profile, and the target of
            // an input option. (An output onto a file the run does not read is the user's word.)
            let input = ["--profile", "--load-session", "--tokenizer", "--draft-model"].contains(&option);
            for (f, before) in files.iter().zip(&kept) {
                let read = [&model, &tok, &profile].contains(f) || (input && *f == target);
                if read {
                    assert!(bytes(f) == *before, "{case}: {} changed", f.display());
                } else {
                    std::fs::write(f, before).unwrap();
                }
            }
        }
    }
    assert!(refused > 20, "only {refused} refusals: the cases did not reach the checks");
    std::fs::remove_dir_all(dir).unwrap();
}
