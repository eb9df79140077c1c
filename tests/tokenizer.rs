//! Tokenizers built from GGUF metadata give llama.cpp's ids on every real model `scripts/setup.sh` fetches
//! (SmolLM2: GPT-2 BPE + `smollm` split; Qwen2.5: GPT-2 BPE + `qwen2` split; Gemma 3:
//! SentencePiece BPE with BOS), round-trip text, keep control tokens whole, and refuse what they
//! cannot build with an error rather than a panic.
//!
//! The reference ids (`tests/data/tokenizer_ids.json`) are a copy of the project's
//! `shared/reference/tokenizer_ids.json`: `llama-tokenize --ids` at llama.cpp 0c1e570, special
//! tokens added as each GGUF says. `tests/data/tokenizer_edge_ids.json` adds harder texts.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_npu_models::chat::ChatTemplate;
use candle_npu_models::gguf::Gguf;
use candle_npu_models::{assets, tokenizer};
use tokenizers::Tokenizer;

struct Reference {
    text: String,
    ids: serde_json::Map<String, serde_json::Value>,
}

fn reference() -> Reference {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer_ids.json");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_slice(&bytes).expect("reference ids: not JSON");
    let text = v["text"].as_str().expect("reference ids: no 'text'").to_string();
    Reference { text, ids: v.as_object().unwrap().clone() }
}

impl Reference {
    fn ids(&self, file: &str) -> Vec<u32> {
        let arr = self.ids.get(file).and_then(|a| a.as_array()).unwrap_or_else(|| panic!("reference ids: no entry for {file}"));
        arr.iter().map(|x| x.as_u64().expect("reference ids: not an integer") as u32).collect()
    }
}

fn load(path: &Path) -> Tokenizer {
    assert!(path.exists(), "{} missing: run scripts/setup.sh first", path.display());
    let g = Gguf::open(path).unwrap();
    tokenizer::from_gguf(&g).unwrap()
}

fn gemma() -> PathBuf {
    assets::gemma3_270m().unwrap()
}

fn qwen() -> PathBuf {
    assets::qwen25_coder_05b().unwrap()
}

/// The reference ids with special tokens added as the file says, and the text back from them.
fn check_reference(path: &Path) -> Tokenizer {
    let r = reference();
    let file = path.file_name().unwrap().to_str().unwrap();
    let tok = load(path);
    let ids = tokenizer::encode(&tok, &r.text, true).unwrap();
    assert_eq!(ids, r.ids(file), "{file}: ids differ from llama.cpp's");
    assert_eq!(tok.decode(&ids, true).unwrap(), r.text, "{file}: decode(encode(text)) is not the text");
    let plain = tokenizer::encode(&tok, &r.text, false).unwrap();
    assert_eq!(tok.decode(&plain, false).unwrap(), r.text, "{file}: round trip without special tokens");
    tok
}

#[test]
fn smollm2_matches_llama_cpp() {
    let tok = check_reference(&assets::smollm2());
    // add_bos_token is false: asking for special tokens adds nothing.
    let r = reference();
    assert_eq!(tokenizer::encode(&tok, &r.text, false).unwrap(), r.ids("SmolLM2-135M-Instruct.Q4_1.gguf"));
}

#[test]
fn qwen25_matches_llama_cpp() {
    let tok = check_reference(&qwen());
    let r = reference();
    assert_eq!(tokenizer::encode(&tok, &r.text, false).unwrap(), r.ids("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"));
}

#[test]
fn gemma3_matches_llama_cpp() {
    let tok = check_reference(&gemma());
    // BOS (2) comes from add_bos_token = true, and only when special tokens are asked for.
    let r = reference();
    let with = r.ids("gemma-3-270m-q4_k_m.gguf");
    assert_eq!(with[0], 2);
    assert_eq!(tokenizer::encode(&tok, &r.text, false).unwrap(), with[1..]);
}

/// Hard cases (whitespace runs, byte fallback, contractions, scripts, code) against llama.cpp's
/// ids from `tests/data/tokenizer_edge_ids.json` (see its "about"), without BOS/EOS.
#[test]
fn edge_cases_match_llama_cpp() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer_edge_ids.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let texts: Vec<&str> = v["texts"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    for path in [assets::smollm2(), qwen(), gemma()] {
        let file = path.file_name().unwrap().to_str().unwrap().to_string();
        let want = v[&file].as_array().unwrap_or_else(|| panic!("no ids for {file}"));
        assert_eq!(want.len(), texts.len(), "{file}");
        let tok = load(&path);
        for (text, want) in texts.iter().zip(want) {
            let want: Vec<u32> = want.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
            assert_eq!(tokenizer::encode(&tok, text, false).unwrap(), want, "{file}: {text:?}");
            assert_eq!(tok.decode(&want, false).unwrap(), *text, "{file}: decode {text:?}");
        }
    }
}

/// Text SentencePiece must fall back to bytes for, and whitespace runs Gemma has whole tokens for.
#[test]
fn gemma3_byte_fallback_and_whitespace_round_trip() {
    let tok = load(&gemma());
    for text in ["a  b\n\n\tc", "\u{1F9EC}\u{10FFFD} x", " leading and trailing  ", "<table> is user-defined"] {
        let ids = tokenizer::encode(&tok, text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text, "{text:?} -> {ids:?}");
    }
    // U+10FFFD (private use) is in no vocabulary: its four UTF-8 bytes become <0xNN> pieces.
    let ids = tokenizer::encode(&tok, "\u{10FFFD}", false).unwrap();
    let pieces: Vec<String> = ids.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
    assert_eq!(pieces, ["<0xF4>", "<0x8F>", "<0xBF>", "<0xBD>"]);
}

/// Chat markup must reach the model as its control tokens, not as `<`, `|`, ... pieces.
#[test]
fn control_tokens_are_single_tokens() {
    let cases: [(PathBuf, &str, &str); 3] =
        [(assets::smollm2(), "<|im_start|>", "<|im_end|>"), (qwen(), "<|im_start|>", "<|im_end|>"), (gemma(), "<start_of_turn>", "<end_of_turn>")];
    for (path, open, close) in cases {
        let tok = load(&path);
        let ids = tokenizer::encode(&tok, &format!("{open}user\nhi{close}\n"), false).unwrap();
        let (o, c) = (tok.token_to_id(open).unwrap(), tok.token_to_id(close).unwrap());
        assert_eq!(ids[0], o, "{}: {ids:?}", path.display());
        assert_eq!(ids.iter().filter(|&&i| i == o || i == c).count(), 2, "{}: {ids:?}", path.display());
        // Special tokens are dropped when asked, and kept otherwise.
        assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi\n");
        assert_eq!(tok.decode(&ids, false).unwrap(), format!("{open}user\nhi{close}\n"));
    }
}

/// The chat templates the real GGUFs carry, applied and tokenized: ChatML with each model's
/// default system text; Gemma 3 270M is a base model without one.
#[test]
fn chat_templates_of_the_real_ggufs() {
    let smol = Gguf::open(&assets::smollm2()).unwrap();
    let system = |t: ChatTemplate| match t {
        ChatTemplate::ChatMl { system } => system.unwrap_or_default(),
        other => panic!("not ChatML: {other:?}"),
    };
    assert_eq!(system(ChatTemplate::from_gguf(&smol)), "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
    let qwen_g = Gguf::open(&qwen()).unwrap();
    let template = ChatTemplate::from_gguf(&qwen_g);
    assert_eq!(system(template.clone()), "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
    assert_eq!(ChatTemplate::from_gguf(&Gguf::open(&gemma()).unwrap()), ChatTemplate::None);

    let tok = tokenizer::from_gguf(&qwen_g).unwrap();
    let ids = tokenizer::encode(&tok, &template.apply("hi"), true).unwrap();
    let start = tok.token_to_id("<|im_start|>").unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == start).count(), 3, "system, user, assistant turns: {ids:?}");
    assert_eq!(ids[0], start);
    let stops: Vec<u32> = template.stop_strings().iter().map(|s| tok.token_to_id(s).unwrap()).collect();
    assert_eq!(stops, [151645], "<|im_end|>");
}

/// A GGUF holding only `metadata`, in the test's scratch directory.
fn fake_gguf(name: &str, metadata: &[(&str, Value)]) -> PathBuf {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("tokenizer-{name}.gguf"));
    let mut f = std::fs::File::create(&path).unwrap();
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    gguf_file::write(&mut f, &md, &[]).unwrap();
    path
}

fn strings(v: &[&str]) -> Value {
    Value::Array(v.iter().map(|s| Value::String(s.to_string())).collect())
}

fn tokenizer_error(name: &str, metadata: &[(&str, Value)]) -> String {
    let path = fake_gguf(name, metadata);
    let g = Gguf::open(&path).unwrap();
    match tokenizer::from_gguf(&g) {
        Ok(_) => panic!("{name}: a tokenizer was built"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains(&path.display().to_string()), "{name}: the error does not name the file: {msg}");
            msg
        }
    }
}

#[test]
fn unbuildable_tokenizers_are_errors_naming_the_cause() {
    let s = |x: &str| Value::String(x.to_string());
    let e = tokenizer_error("no-model", &[("general.architecture", s("llama"))]);
    assert!(e.contains("tokenizer.ggml.model") && e.contains("--tokenizer tokenizer.json"), "{e}");

    let e = tokenizer_error("t5", &[("tokenizer.ggml.model", s("t5")), ("tokenizer.ggml.tokens", strings(&["a"]))]);
    assert!(e.contains("'t5'") && e.contains("--tokenizer tokenizer.json"), "{e}");

    let e = tokenizer_error("falcon", &[("tokenizer.ggml.model", s("gpt2")), ("tokenizer.ggml.pre", s("falcon"))]);
    assert!(e.contains("'falcon'") && e.contains("--tokenizer tokenizer.json"), "{e}");

    let e =
        tokenizer_error("no-merges", &[("tokenizer.ggml.model", s("gpt2")), ("tokenizer.ggml.pre", s("qwen2")), ("tokenizer.ggml.tokens", strings(&["a"]))]);
    assert!(e.contains("tokenizer.ggml.merges"), "{e}");

    let e = tokenizer_error(
        "bad-merge",
        &[
            ("tokenizer.ggml.model", s("gpt2")),
            ("tokenizer.ggml.pre", s("qwen2")),
            ("tokenizer.ggml.tokens", strings(&["a", "b", "ab"])),
            ("tokenizer.ggml.merges", strings(&["a b", "ab"])),
        ],
    );
    assert!(e.contains("tokenizer.ggml.merges[1]"), "{e}");

    let e = tokenizer_error("no-scores", &[("tokenizer.ggml.model", s("llama")), ("tokenizer.ggml.tokens", strings(&["a", "b"]))]);
    assert!(e.contains("tokenizer.ggml.scores"), "{e}");

    let scores = Value::Array(vec![Value::F32(0.0)]);
    let e = tokenizer_error(
        "short-scores",
        &[("tokenizer.ggml.model", s("llama")), ("tokenizer.ggml.tokens", strings(&["a", "b"])), ("tokenizer.ggml.scores", scores)],
    );
    assert!(e.contains("1 entries for 2 tokens"), "{e}");

    let scores = Value::Array(vec![Value::F32(0.0), Value::F32(0.0)]);
    let e = tokenizer_error(
        "bos-out-of-range",
        &[
            ("tokenizer.ggml.model", s("llama")),
            ("tokenizer.ggml.tokens", strings(&["a", "b"])),
            ("tokenizer.ggml.scores", scores),
            ("tokenizer.ggml.bos_token_id", Value::U32(7)),
        ],
    );
    assert!(e.contains("bos_token_id = 7"), "{e}");
}
