//! Bad input, as a careless or hostile user gives it: every case is an `Err` (or, for the
//! command line, an exit with a message) whose text names the cause. None panics, none runs on
//! with a wrong result.
//!
//! Model files are damaged copies of a tiny Llama GGUF (`props::write_gguf`: seeded weights, two layers),
//! so that each case loads in milliseconds; the command-line cases run the `llama` example on
//! SmolLM2 (`scripts/setup.sh`).

#[path = "fuzz/props.rs"]
mod props;

mod common;
use common::{llama_example, llama_with_stdin};

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use candle_core::quantized::gguf_file::Value;
use candle_core::{Device, Tensor};
use candle_npu::cache::{CacheKey, GraphCache, Lookup};
use candle_npu::{DType, Graph, NpuDevice, QuantProfile, TensorId};
use candle_npu_models::gguf::Gguf;
use candle_npu_models::PrefillOptions;
use candle_npu_models::{assets, families, DecodeWeights, LoadOptions, Model, Precision, TextStream};
use props::{scratch, set, write_gguf, Metadata, Tensors, VOCAB};

fn float_opts() -> LoadOptions {
    LoadOptions { precision: Some(Precision::F32), decode_weights: DecodeWeights::F32, ..Default::default() }
}

fn load(path: &Path) -> candle_npu::Result<Model> {
    families::load_gguf(Arc::new(Gguf::open(path)?), &NpuDevice::host(), float_opts())
}

/// The error `r` must be, naming `cause` (and, for files, the path).
fn error_naming<T>(r: candle_npu::Result<T>, cause: &str, path: Option<&Path>) -> String {
    let Err(e) = r else { panic!("expected an error naming '{cause}', got Ok") };
    let msg = e.to_string();
    assert!(msg.contains(cause), "error does not name '{cause}': {msg}");
    if let Some(p) = path {
        assert!(msg.contains(&p.display().to_string()), "error does not name the file: {msg}");
    }
    msg
}

#[test]
fn the_undamaged_tiny_model_loads_and_runs() {
    // What every case below damages: without the damage, it loads and computes finite logits.
    let dir = scratch("ok");
    let mut m = load(&write_gguf(&dir.join("m.gguf"), |_, _| {})).unwrap();
    let logits: Vec<f32> = m.prefill(&[1, 2, 3, 4, 5], &PrefillOptions::chunked(4)).unwrap().to_vec1().unwrap();
    assert_eq!(logits.len(), VOCAB);
    assert!(logits.iter().all(|v| v.is_finite()));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn residual_weights_for_an_unknown_linear_are_refused_with_the_names() {
    let dir = scratch("residual");
    let path = write_gguf(&dir.join("m.gguf"), |_, _| {});
    let with = |names: &[&str]| LoadOptions { residual: names.iter().map(|n| n.to_string()).collect(), ..float_opts() };
    let open = || Arc::new(Gguf::open(&path).unwrap());
    let msg = error_naming(families::load_gguf(open(), &NpuDevice::host(), with(&["attn_z"])), "residual weights for 'attn_z'", None);
    assert!(msg.contains("attn_q") && msg.contains("ffn_down"), "the error lists the names: {msg}");
    // One layer's linear: a layer the model has, a linear a layer has.
    let layers = families::load_gguf(open(), &NpuDevice::host(), float_opts()).unwrap().config().n_layer;
    for bad in [format!("blk.{layers}.attn_q"), "blk.0.attn_z".into(), "blk.x.attn_q".into()] {
        error_naming(families::load_gguf(open(), &NpuDevice::host(), with(&[&bad])), &format!("residual weights for '{bad}'"), None);
    }
    let mut m = families::load_gguf(open(), &NpuDevice::host(), with(&["attn_q", "blk.0.ffn_down"])).unwrap();
    assert!(m.prefill(&[1, 2, 3, 4, 5], &PrefillOptions::chunked(4)).unwrap().to_vec1::<f32>().unwrap().iter().all(|v| v.is_finite()));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn lpbq_weights_are_refused_for_unknown_linears_beside_a_residual_and_with_u8_activations() {
    let dir = scratch("lpbq");
    let path = write_gguf(&dir.join("m.gguf"), |_, _| {});
    let names = |n: &[&str]| n.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let with =
        |lpbq: &[&str], residual: &[&str], precision| LoadOptions { lpbq: names(lpbq), residual: names(residual), precision: Some(precision), ..float_opts() };
    let open = || Arc::new(Gguf::open(&path).unwrap());
    let load = |o| families::load_gguf(open(), &NpuDevice::host(), o);
    error_naming(load(with(&["ffn_upp"], &[], Precision::W8A16Shadow)), "LPBQ weights for 'ffn_upp'", None);
    error_naming(load(with(&["ffn_up"], &["ffn_up"], Precision::W8A16Shadow)), "'ffn_up' is asked for both LPBQ and residual", None);
    error_naming(load(with(&["ffn_up"], &[], Precision::W8A8)), "4-bit LPBQ weights need u16 activations", None);
    load(with(&["ffn_up", "blk.0.attn_q"], &["ffn_down"], Precision::W8A16Shadow)).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn damaged_model_metadata_is_an_error_naming_it() {
    let dir = scratch("md");
    type Edit = fn(&mut Metadata, &mut Tensors);
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("no layers", |md, _| set(md, "llama.block_count", Value::U32(0)), "layers 0 is not within"),
        ("4 billion layers", |md, _| set(md, "llama.block_count", Value::U32(u32::MAX)), "layers 4294967295 is not within"),
        ("fewer layers than the file", |md, _| set(md, "llama.block_count", Value::U32(1)), "block_count is 1 but the file has more layers"),
        ("huge hidden size", |md, _| set(md, "llama.embedding_length", Value::U32(1 << 30)), "hidden size 1073741824"),
        ("heads not in KV groups", |md, _| set(md, "llama.attention.head_count_kv", Value::U32(3)), "not a multiple of 3 KV heads"),
        ("zero KV heads", |md, _| set(md, "llama.attention.head_count_kv", Value::U32(0)), "KV heads 0"),
        ("NaN epsilon", |md, _| set(md, "llama.attention.layer_norm_rms_epsilon", Value::F32(f32::NAN)), "epsilon NaN"),
        ("negative epsilon", |md, _| set(md, "llama.attention.layer_norm_rms_epsilon", Value::F32(-1e-5)), "epsilon -0.00001 "),
        ("epsilon 0", |md, _| set(md, "llama.attention.layer_norm_rms_epsilon", Value::F32(0.0)), "epsilon 0"),
        ("RoPE base 0", |md, _| set(md, "llama.rope.freq_base", Value::F32(0.0)), "RoPE base 0"),
        ("NaN RoPE base", |md, _| set(md, "llama.rope.freq_base", Value::F32(f32::NAN)), "RoPE base NaN"),
        ("infinite RoPE base", |md, _| set(md, "llama.rope.freq_base", Value::F32(f32::INFINITY)), "RoPE base inf"),
        ("vocabulary beyond the embedding", |md, _| set(md, "llama.vocab_size", Value::U32(VOCAB as u32 + 1)), "token_embd.weight: shape [96, 64]"),
        ("wrong-typed size", |md, _| set(md, "llama.block_count", Value::String("2".into())), "llama.block_count"),
        ("missing size", |md, _| md.retain(|(k, _)| k != "llama.feed_forward_length"), "missing metadata key 'llama.feed_forward_length'"),
        ("unknown family", |md, _| set(md, "general.architecture", Value::String("bert".into())), "architecture 'bert' is not supported"),
        (
            "scaled RoPE",
            |md, _| {
                set(md, "llama.rope.scaling.type", Value::String("linear".into()));
                set(md, "llama.rope.scaling.factor", Value::F32(8.0));
            },
            "scaled RoPE is not supported",
        ),
        ("partial RoPE", |md, _| set(md, "llama.rope.dimension_count", Value::U32(8)), "RoPE over part of a head of 16"),
        (
            "RoPE frequency factors",
            |_, ts| ts.push(("rope_freqs.weight".into(), Tensor::ones(8, candle_core::DType::F32, &Device::Cpu).unwrap())),
            "rope_freqs.weight",
        ),
        ("missing tensor", |_, ts| ts.retain(|(n, _)| n != "blk.1.ffn_up.weight"), "missing tensor 'blk.1.ffn_up.weight'"),
        ("transposed tensor", |_, ts| transform(ts, "blk.0.ffn_up.weight", |t| t.t().unwrap().contiguous().unwrap()), "the config implies (128, 64)"),
        ("NaN weight", |_, ts| transform(ts, "blk.1.attn_k.weight", |t| poison(t, f32::NAN)), "has NaN at [0, 3]"),
        ("NaN norm", |_, ts| transform(ts, "blk.0.attn_norm.weight", |t| poison(t, f32::NAN)), "tensor 'blk.0.attn_norm.weight': value 3 is NaN"),
        ("infinite final norm", |_, ts| transform(ts, "output_norm.weight", |t| poison(t, f32::NEG_INFINITY)), "tensor 'output_norm.weight': value 3 is -inf"),
        ("NaN embedding", |_, ts| transform(ts, "token_embd.weight", |t| poison(t, f32::NAN)), "tensor 'token_embd.weight': value 3 is NaN"),
        (
            "duplicate tensor",
            |_, ts| {
                let t = ts.iter().find(|(n, _)| n == "blk.0.ffn_up.weight").unwrap().1.clone();
                ts.push(("blk.0.ffn_up.weight".into(), t));
            },
            "two tensors share a name",
        ),
        ("duplicate metadata key", |md, _| md.push(("llama.block_count".into(), Value::U32(2))), "a key is given twice"),
        ("infinite weight", |_, ts| transform(ts, "blk.0.ffn_down.weight", |t| poison(t, f32::INFINITY)), "has inf at [0, 3]"),
        (
            "final norm of the wrong size",
            |_, ts| transform(ts, "output_norm.weight", |t| Tensor::new(&t.to_vec1::<f32>().unwrap()[..8], &Device::Cpu).unwrap()),
            "output_norm.weight: shape [8]",
        ),
    ];
    for (i, (what, edit, cause)) in cases.into_iter().enumerate() {
        let path = write_gguf(&dir.join(format!("case{i}.gguf")), edit);
        let msg = error_naming(load(&path), cause, Some(&path));
        eprintln!("{what}: {msg}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

fn transform(ts: &mut Tensors, name: &str, f: impl Fn(&Tensor) -> Tensor) {
    let e = ts.iter_mut().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no tensor {name}"));
    e.1 = f(&e.1);
}

/// `t` with its value at `[0, 3]` replaced by `v`.
fn poison(t: &Tensor, v: f32) -> Tensor {
    let mut vals = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    vals[3] = v;
    Tensor::from_vec(vals, t.shape(), &Device::Cpu).unwrap()
}

#[test]
fn damaged_gguf_bytes_are_an_error_naming_the_file() {
    let dir = scratch("bytes");
    let good = std::fs::read(write_gguf(&dir.join("good.gguf"), |_, _| {})).unwrap();
    let path = dir.join("bad.gguf");
    let open = |bytes: &[u8]| {
        std::fs::write(&path, bytes).unwrap();
        Gguf::open(&path).map(|_| ())
    };
    error_naming(open(&good[..good.len() - 100]), "truncated: tensor", Some(&path));
    error_naming(open(&good[..64]), "not a valid GGUF file", Some(&path));
    error_naming(open(b"GGUF"), "not a valid GGUF file", Some(&path));
    error_naming(open(&[]), "not a valid GGUF file", Some(&path));
    // An alignment of 0 would make candle's reader divide by zero: found before it reads.
    let zero_align = write_gguf(&dir.join("align.gguf"), |md, _| set(md, "general.alignment", Value::U32(0)));
    error_naming(Gguf::open(&zero_align).map(|_| ()), "general.alignment is 0", Some(&zero_align));
    // Two tensors over the same bytes (hand-written header: two F32 vectors of 8 at offset 0).
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes()); // version
    b.extend(2u64.to_le_bytes()); // tensors
    b.extend(0u64.to_le_bytes()); // metadata
    for name in [b'a', b'b'] {
        b.extend(1u64.to_le_bytes());
        b.push(name);
        b.extend(1u32.to_le_bytes()); // dims
        b.extend(8u64.to_le_bytes());
        b.extend(0u32.to_le_bytes()); // F32
        b.extend(0u64.to_le_bytes()); // offset
    }
    b.resize(b.len().next_multiple_of(32) + 64, 0);
    error_naming(open(&b), "tensors 'a' and 'b' overlap", Some(&path));
    // A tensor whose header dims multiply past u64 (hand-written header: one F32 tensor).
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes()); // version
    b.extend(1u64.to_le_bytes()); // tensors
    b.extend(0u64.to_le_bytes()); // metadata
    b.extend(1u64.to_le_bytes());
    b.push(b'w');
    b.extend(2u32.to_le_bytes()); // dims
    b.extend((1u64 << 40).to_le_bytes());
    b.extend((1u64 << 40).to_le_bytes());
    b.extend(0u32.to_le_bytes()); // F32
    b.extend(0u64.to_le_bytes()); // offset
    b.resize(b.len().next_multiple_of(32) + 64, 0);
    let err = open(&b).unwrap_err().to_string();
    assert!(err.contains("not a valid") && err.contains(&path.display().to_string()), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_quant_profiles_are_errors_that_leave_the_model_as_it_was() {
    let dir = scratch("bad-profile");
    let mut m = load(&write_gguf(&dir.join("m.gguf"), |_, _| {})).unwrap();
    let seqs: Vec<Vec<u32>> = (0..2).map(|s| (0..32).map(|i| ((i * 7 + s * 13) % VOCAB) as u32).collect()).collect();
    let good = m.calibrate(&seqs, |_| {}).unwrap().finish(m.model_id().to_string(), candle_npu::ClipMethod::Budget { fraction: 1e-2 });
    // A W8A8 model of the same file, with that profile.
    let g = Arc::new(Gguf::open(&dir.join("m.gguf")).unwrap());
    let mut w8 = families::load_gguf(g, &NpuDevice::host(), LoadOptions { precision: Some(Precision::W8A8), ..float_opts() }).unwrap();
    w8.set_profile(good.clone()).unwrap();
    let before: Vec<f32> = w8.prefill(&seqs[0], &PrefillOptions::chunked(16)).unwrap().to_vec1().unwrap();
    type Edit = fn(&mut QuantProfile);
    let cases: Vec<(Edit, &str)> = vec![
        (|p| p.model_id = "another".into(), "calibrated for model another"),
        (|p| drop(p.points.remove("blk.1.ffn_down_in")), "blk.1.ffn_down_in"),
        (|p| p.points.get_mut("blk.0.attn_in").unwrap().channels = 65, "has 65 channels, the model 64"),
        (|p| p.importance = vec![0.1; 3], "importance of 3 layers, the model has 2"),
        (|p| p.importance = vec![0.1, f32::NAN], "importance of layer 1 is NaN"),
        (|p| p.points.get_mut("blk.1.ffn_in").unwrap().hi = f32::INFINITY, "point blk.1.ffn_in: range not finite"),
        (|p| p.points.get_mut("blk.0.attn_out").unwrap().hot = vec![64], "hot channel 64 of 64"),
    ];
    for (edit, cause) in cases {
        let mut p = good.clone();
        edit(&mut p);
        error_naming(w8.set_profile(p), cause, None);
        // Nothing changed: the same logits as before the failed call.
        let after: Vec<f32> = w8.prefill(&seqs[0], &PrefillOptions::chunked(16)).unwrap().to_vec1().unwrap();
        assert_eq!(after, before, "a failed set_profile ({cause}) changed the model");
    }
    // A profile file that cannot be used names itself and says what to do.
    let path = dir.join("p.json");
    good.save(&path).unwrap();
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    v["points"]["blk.0.ffn_in"]["lo"] = serde_json::json!(5.0);
    v["points"]["blk.0.ffn_in"]["hi"] = serde_json::json!(-5.0);
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let msg = error_naming(QuantProfile::load(&path, m.model_id()), "point blk.0.ffn_in: range inverted", Some(&path));
    assert!(msg.contains("delete it to recalibrate"), "{msg}");
    std::fs::write(&path, b"{\"format\": 2, \"model_id\": ").unwrap();
    error_naming(QuantProfile::load(&path, m.model_id()), "not a quant profile", Some(&path));
    // Saving into a folder that does not exist: an error naming the path, no file left behind.
    let nowhere = dir.join("no/such/folder/p.json");
    error_naming(good.save(&nowhere), "no/such/folder/p.json", None);
    error_naming(candle_npu::fs::check_writable(&nowhere), "no/such/folder/p.json", None);
    error_naming(candle_npu::fs::check_writable(&dir), "is a folder", None);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_damaged_graph_cache_entry_is_invalid_so_it_is_rebuilt() {
    let dir = scratch("bad-cache");
    let cache = GraphCache::new(&dir);
    let key = CacheKey::new(&[7; 32], "salt");
    let path = cache.store("blk.0.gate_up", &key, &[11, 12, 13], &[9u8; 1000]).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    // The side table: two output ids swapped (the same shapes: gate and up).
    bytes.swap(48, 52);
    std::fs::write(&path, &bytes).unwrap();
    match cache.load("blk.0.gate_up", &key) {
        Lookup::Invalid(why) => assert!(why.contains("checksum") && why.contains(&path.display().to_string()), "{why}"),
        other => panic!("a damaged side table must be invalid (rebuilt), got {other:?}"),
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn malformed_graphs_are_errors_naming_the_graph() {
    let mut g = Graph::new("g");
    let x = g.input("x", &[2, 4], DType::F32, None);
    g.mark_output(x);
    g.outputs.push(TensorId(7));
    error_naming(g.validate(), "graph 'g'", None);
    error_naming(g.validate(), "out of range", None);
}

#[test]
fn streamed_text_never_splits_a_character() {
    // Byte-level BPE (SmolLM2) and SentencePiece with byte fallback (Gemma 3): characters of 2, 3
    // and 4 bytes, a combining mark, and emoji whose bytes span several tokens.
    let text = "Zürich → 東京 naïve e\u{301} 🎉👍🏽 🇫🇷 𓀀 𐍈 ꙮ end";
    for path in [assets::smollm2(), assets::gemma3_270m().unwrap()] {
        let g = Gguf::open(&path).unwrap();
        let tok = candle_npu_models::tokenizer::from_gguf(&g).unwrap();
        let ids = candle_npu_models::tokenizer::encode(&tok, text, false).unwrap();
        let mut stream = TextStream::new();
        let mut pieces = vec![];
        for &id in &ids {
            pieces.extend(stream.next(&tok, id).unwrap());
        }
        pieces.extend(stream.finish(&tok).unwrap());
        let whole = tok.decode(&ids, false).unwrap();
        assert_eq!(pieces.concat(), whole, "{}", path.display());
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{}: a piece holds half a character: {pieces:?}", path.display());
        // Some token really did carry part of a character (else the test shows nothing).
        let partial = ids.iter().filter(|&&id| tok.decode(&[id], false).unwrap().contains('\u{FFFD}')).count();
        assert!(partial > 0, "{}: no token splits a character in this text", path.display());
    }
}

/// Calibration settings that are not shares (a NaN or negative clip budget quietly acted as 0; a
/// NaN hot coverage skipped the counting pass and was saved as `null`, which the profile's
/// loader refused) are refused before any work, naming the setting; the model keeps no profile.
#[test]
fn calibration_settings_that_are_not_shares_are_refused() {
    use candle_npu::ClipMethod;
    use candle_npu_models::CalibrationSet;
    let mut p = common::smollm2(&NpuDevice::host(), Precision::W8A8, DecodeWeights::default());
    let small = CalibrationSet { sequences: 1, seq_len: 8, ..Default::default() };
    let budget = |fraction| CalibrationSet { clip: ClipMethod::Budget { fraction }, ..small };
    for (set, want) in [
        (budget(f64::NAN), "clip budget NaN"),
        (budget(-0.01), "clip budget -0.01"),
        (budget(1.0), "clip budget 1:"),
        (CalibrationSet { hot_coverage: f64::NAN, ..small }, "hot coverage NaN"),
        (CalibrationSet { hot_coverage: 1.5, ..small }, "hot coverage 1.5"),
        (CalibrationSet { seq_len: 0, ..small }, "need at least one token"),
    ] {
        let err = p.calibrate(set, |_, _| {}).unwrap_err().to_string();
        assert!(err.contains(want), "{set:?}: {err}");
        let err = p.calibrate_on(&[vec![1, 2, 3]], set, |_, _| {}).map(|_| ()).unwrap_err().to_string();
        assert!(err.contains(want), "{set:?} on the caller's sequences: {err}");
        assert!(p.model.profile().is_none(), "{set:?}: no profile set");
    }
    // The edges are shares: a budget of 0 and coverages of 0 and 1 calibrate.
    for set in [budget(0.0), CalibrationSet { hot_coverage: 0.0, ..small }, small] {
        p.calibrate(set, |_, _| {}).unwrap_or_else(|e| panic!("{set:?}: {e}"));
    }
}

/// Runs the example with `args`: (success, stdout, stderr).
fn run_llama(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(llama_example()).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn command_line_options_out_of_range_are_refused_with_the_range() {
    for (args, cause) in [
        (&["--temperature", "-1"][..], "not a temperature: a number >= 0"),
        (&["--temperature=-0.5"], "not a temperature"),
        (&["--temperature", "NaN"], "not a temperature"),
        (&["--top-p", "0.9"], "--temperature"),
        (&["--temperature", "0.8", "--top-p", "1.5"], "not a top-p: a probability in (0, 1]"),
        (&["--chunk-len", "0"], "0 is not in 1..=8192"),
        (&["--chunk-len", "100000"], "100000 is not in 1..=8192"),
        (&["--npu-threads", "0"], "0 is not in 1..=256"),
        (&["--model", "/no/such/model.gguf"], "/no/such/model.gguf not found"),
        (&["--trace", "/no/such/folder/trace.json"], "folder /no/such/folder does not exist"),
    ] {
        let (ok, _, err) = run_llama(args);
        assert!(!ok && err.contains(cause), "{args:?}: expected an error naming '{cause}', got:\n{err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn command_line_input_is_checked_before_the_long_work() {
    // Each fails after loading the model and before calibration, prefill or generation.
    let dir = scratch("cli");
    let profile = dir.join("missing/p.json");
    for (args, cause) in [
        (vec!["--no-chat-template", "--prompt", ""], "empty prompt".to_string()),
        (vec!["--profile", profile.to_str().unwrap()], profile.display().to_string()),
    ] {
        let (ok, _, err) = run_llama(&args);
        assert!(!ok && err.contains(&cause), "{args:?}: expected an error naming '{cause}', got:\n{err}");
        assert!(!err.contains("panicked") && !err.contains("calibrating"), "{args:?}: {err}");
    }
    // An output naming one of the run's inputs (the model file, by another name; the profile it
    // reads): refused before anything loads, the input left as it was.
    // On a copy: were the check to fail, the run would overwrite the file.
    let model = dir.join("m.gguf");
    std::fs::copy(assets::smollm2(), &model).unwrap();
    let (size, profile) = (std::fs::metadata(&model).unwrap().len(), candle_npu::QuantProfile::default_path(&model));
    let other_name = dir.join(".").join("m.gguf");
    let (draft, session) = (dir.join("draft.gguf"), dir.join("chat.session"));
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    for (output, target, what) in [
        ("--trace", &other_name, &model),
        ("--trace", &profile, &profile),
        // The default profile is read when it is there: a session saved over it broke every later run.
        ("--save-session", &profile, &profile),
        ("--save-session", &draft, &draft),
        ("--trace", &draft, &draft),
        // The conversation a run goes on with.
        ("--trace", &session, &session),
    ] {
        let args = ["--model", &s(&model), "--draft-model", &s(&draft), "--load-session", &s(&session), output, &s(target)];
        let (ok, _, err) = run_llama(&args);
        assert!(!ok && err.contains("which this run reads") && err.contains(&what.display().to_string()), "{output} {}: {err}", target.display());
        assert!(!err.contains("panicked"), "{err}");
    }
    // Two outputs onto one file: the second would replace the first.
    let (ok, _, err) = run_llama(&["--model", &s(&model), "--save-session", &s(&session), "--trace", &s(&session)]);
    assert!(!ok && err.contains("one file for two outputs"), "{err}");
    assert_eq!(std::fs::metadata(&model).unwrap().len(), size, "the model file is untouched");
    // --sample-len 0: the prefill alone, no token generated.
    let (ok, out, err) = run_llama(&["--sample-len", "0"]);
    assert!(ok, "{err}");
    assert!(out.contains("0 tokens generated"), "{out}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A W8A8 model whose context is shorter than the default calibration windows (the tiny model:
/// 128 tokens, whose tokenizer's longest token is a few bytes): windows longer than the context
/// are refused saying what works, and windows that fit calibrate on the shipped text, its long
/// paragraphs in pieces (they were refused as "a prompt of 20478 bytes ... shorten it").
#[test]
fn a_model_of_a_short_context_calibrates_on_windows_that_fit() {
    let dir = scratch("short-context");
    let (model, tok) = props::tiny_model_files(&dir);
    let opts = LoadOptions { decode_weights: DecodeWeights::F32, ..Default::default() };
    let mut p = candle_npu_models::Pipeline::load(&model, Some(&tok), &NpuDevice::host(), opts).unwrap();
    let context = p.model.config().context_len;
    let e = p.calibrate(candle_npu_models::CalibrationSet::default(), |_, _| {}).unwrap_err().to_string();
    assert!(e.contains(&format!("the model's context holds {context}")) && e.contains("--f32-prefill"), "{e}");
    let set = candle_npu_models::CalibrationSet { sequences: 2, seq_len: context, importance_sequences: 0, ..Default::default() };
    let profile = p.calibrate(set, |_, _| {}).unwrap();
    assert_eq!(profile.tokens, 2 * context);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A thread pool far beyond the machine (`RAYON_NUM_THREADS=1000`: a 1 s load took over a
/// minute) is capped at one thread per core, and the run says so.
#[test]
fn an_oversized_thread_pool_is_capped_with_a_note() {
    // On the tiny model: a second, where SmolLM2 took 14 s of CI.
    let dir = scratch("threads");
    let (model, tok) = props::tiny_model_files(&dir);
    let args = ["--model", model.to_str().unwrap(), "--tokenizer", tok.to_str().unwrap(), "--f32-prefill", "--sample-len", "1", "--prompt", "hi"];
    let out = Command::new(llama_example()).env("RAYON_NUM_THREADS", "1000").args(args).output().unwrap();
    std::fs::remove_dir_all(dir).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("RAYON_NUM_THREADS=1000 is more than 4 threads per core"), "{err}");
}

/// An `--interactive` turn cut off by the full context says so and ends the conversation (only
/// the first turn's was said). The tiny model: a context of 128 tokens, turns of 100.
#[test]
fn an_interactive_turn_cut_by_the_full_context_says_so() {
    let dir = scratch("interactive-full");
    let (model, tok) = props::tiny_model_files(&dir);
    let args =
        ["--model", model.to_str().unwrap(), "--tokenizer", tok.to_str().unwrap(), "--f32-prefill", "--sample-len", "100", "--prompt", "hi", "--interactive"];
    let out = llama_with_stdin(&args, b"more\nand more\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("new tokens after") && err.contains("tokens is full; the conversation ends here"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// `--interactive` without `--prompt` waits for the user: the first line typed is the first turn
/// (no built-in question answered first), and no line at all is an error saying so.
#[test]
fn interactive_without_a_prompt_takes_the_first_turn_from_stdin() {
    let dir = scratch("interactive-first");
    let (model, tok) = props::tiny_model_files(&dir);
    let run = |input: &[u8]| {
        let args = ["--model", model.to_str().unwrap(), "--tokenizer", tok.to_str().unwrap(), "--f32-prefill", "--sample-len", "4", "--interactive"];
        let out = llama_with_stdin(&args, input);
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, out, err) = run(b"hello there\nand more\n");
    assert!(ok, "{err}");
    assert!(!out.contains("capital of France"), "answered the built-in question: {out}");
    // The first turn's statistics, then the second turn's (prefilling only its own tokens).
    assert!(out.contains("prompt tokens processed"), "{out}");
    assert!(err.contains("new tokens after"), "the second turn: {err}");
    let (ok, _, err) = run(b"");
    assert!(!ok && err.contains("no first turn typed"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}
