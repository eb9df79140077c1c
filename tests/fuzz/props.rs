//! The properties the fuzz tests check, shared by `tests/fuzz.rs` (bounded, in CI) and
//! `examples/fuzz.rs` (as many cases as asked for): every reader of outside data, given mutated
//! or random input, returns `Ok` or `Err` and never panics; what it accepts works. Also the tiny
//! Llama GGUF they mutate, which `tests/bad_input.rs` damages case by case and
//! `tests/concurrency.rs` runs.
//!
//! - GGUF: a tiny Llama file, bytes mutated -> `Gguf::open`, model load, and a prefill if it loads.
//! - Quant profile: a real profile's JSON, bytes or values mutated -> `QuantProfile::load`,
//!   `Model::set_profile`, and a W8A8 prefill with finite logits if it is accepted.
//! - Graph cache: an entry, bytes mutated -> `GraphCache::load` is a hit only with the original.
//! - `tokenizer.json`: a small BPE tokenizer's JSON (normalizers, a split regex, a template
//!   post-processor, a decoder sequence), bytes or values mutated -> `tokenizer::from_file`,
//!   and encoding and decoding of a few texts if it loads (`tokenizers` panics on some files:
//!   the loader must return errors).
//! - Saved sessions: a tiny model's saved conversation, bytes mutated and the checksum resealed
//!   -> `Pipeline::restore_session` refuses, or restores a conversation a turn goes on from.
//! - Chat templates: a ChatML template, bytes mutated and hostile Jinja spliced in (loops
//!   without end, strings doubled or repeated, recursion, `raise_exception`) ->
//!   `JinjaTemplate::new` and a render: `Ok`, or an error naming the template, in seconds.
//! - `Graph::validate`: random graphs (ids, shapes, types, kinds, quantization) -> a graph it
//!   accepts runs on the host executor without a panic.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use candle_npu::cache::{CacheKey, GraphCache, Lookup};
use candle_npu::graph::TensorKind;
use candle_npu::{DType, Graph, NpuDevice, Op, Quant, QuantProfile, StaticData, TensorData, TensorId};
use candle_npu_models::gguf::Gguf;
use candle_npu_models::PrefillOptions;
use candle_npu_models::{families, DecodeWeights, GenerateOptions, LoadOptions, Model, Pipeline, Precision};
use proptest::prelude::*;

/// How the cases of a property ended: accepted (loaded, hit, valid) or refused with an error.
#[derive(Debug, Default)]
pub struct Tally {
    pub accepted: std::sync::atomic::AtomicUsize,
    pub refused: std::sync::atomic::AtomicUsize,
}

impl Tally {
    pub fn count(&self, accepted: bool) {
        let c = if accepted { &self.accepted } else { &self.refused };
        c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    pub fn get(&self) -> (usize, usize) {
        (self.accepted.load(std::sync::atomic::Ordering::Relaxed), self.refused.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// A fresh folder for one test's files (tags are unique across the test binaries that share it).
pub fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("candle-npu-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub const HIDDEN: usize = 64;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const FFN: usize = 128;
pub const LAYERS: usize = 2;
pub const VOCAB: usize = 96;

pub type Metadata = Vec<(String, Value)>;
pub type Tensors = Vec<(String, Tensor)>;

/// Seeded uniform values in `[-scale / 2, scale / 2)` (xorshift).
pub fn seeded(shape: &[usize], scale: f32, seed: &mut u64) -> Tensor {
    let v: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            ((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// The tiny Llama's metadata and tensors (seeded: every file is the same model).
pub fn tiny_llama() -> (Metadata, Tensors) {
    let md = vec![
        ("general.architecture".to_string(), Value::String("llama".into())),
        ("llama.embedding_length".into(), Value::U32(HIDDEN as u32)),
        ("llama.attention.head_count".into(), Value::U32(HEADS as u32)),
        ("llama.attention.head_count_kv".into(), Value::U32(KV_HEADS as u32)),
        ("llama.block_count".into(), Value::U32(LAYERS as u32)),
        ("llama.feed_forward_length".into(), Value::U32(FFN as u32)),
        ("llama.context_length".into(), Value::U32(128)),
        ("llama.attention.layer_norm_rms_epsilon".into(), Value::F32(1e-5)),
        ("llama.rope.freq_base".into(), Value::F32(10_000.0)),
    ];
    let seed = &mut 0x2545_f491_4f6c_dd1du64;
    let norm = |seed: &mut u64| (seeded(&[HIDDEN], 0.2, seed) + 1.0).unwrap();
    let kv = KV_HEADS * HIDDEN / HEADS;
    let mut ts = vec![("token_embd.weight".to_string(), seeded(&[VOCAB, HIDDEN], 1.0, seed)), ("output_norm.weight".into(), norm(seed))];
    for l in 0..LAYERS {
        for (name, shape) in [
            ("attn_q", [HIDDEN, HIDDEN]),
            ("attn_k", [kv, HIDDEN]),
            ("attn_v", [kv, HIDDEN]),
            ("attn_output", [HIDDEN, HIDDEN]),
            ("ffn_gate", [FFN, HIDDEN]),
            ("ffn_up", [FFN, HIDDEN]),
            ("ffn_down", [HIDDEN, FFN]),
        ] {
            ts.push((format!("blk.{l}.{name}.weight"), seeded(&shape, 0.3, seed)));
        }
        for name in ["attn_norm", "ffn_norm"] {
            ts.push((format!("blk.{l}.{name}.weight"), norm(seed)));
        }
    }
    (md, ts)
}

/// The tiny Llama as a GGUF file at `path`, after `edit` changed its metadata and tensors.
pub fn write_gguf(path: &Path, edit: impl FnOnce(&mut Metadata, &mut Tensors)) -> PathBuf {
    let (mut md, mut ts) = tiny_llama();
    edit(&mut md, &mut ts);
    let qs: Vec<(String, QTensor)> = ts.iter().map(|(n, t)| (n.clone(), QTensor::quantize(t, GgmlDType::F32).unwrap())).collect();
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let qs: Vec<(&str, &QTensor)> = qs.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::fs::File::create(path).unwrap(), &md, &qs).unwrap();
    path.to_path_buf()
}

pub fn set(md: &mut Metadata, key: &str, v: Value) {
    match md.iter_mut().find(|(k, _)| k == key) {
        Some(e) => e.1 = v,
        None => md.push((key.to_string(), v)),
    }
}

/// The tiny Llama as a GGUF file at `path`; its bytes.
pub fn tiny_gguf(path: &Path) -> Vec<u8> {
    std::fs::read(write_gguf(path, |_, _| {})).unwrap()
}

pub fn load(path: &Path, precision: Precision) -> candle_npu::Result<Model> {
    let opts = LoadOptions { precision: Some(precision), decode_weights: DecodeWeights::F32, ..Default::default() };
    families::load_gguf(Arc::new(Gguf::open(path)?), &NpuDevice::host(), opts)
}

/// Byte edits: (position as a share of the length, new byte), and a truncation share.
pub fn edits() -> impl Strategy<Value = (Vec<(f64, u8)>, Option<f64>)> {
    (prop::collection::vec((0.0..1.0f64, any::<u8>()), 1..8), prop::option::weighted(0.2, 0.0..1.0f64))
}

pub fn mutate(bytes: &[u8], (edits, cut): &(Vec<(f64, u8)>, Option<f64>), head: usize) -> Vec<u8> {
    let mut b = bytes.to_vec();
    for &(at, v) in edits {
        // Most edits in the first `head` bytes (the header and metadata), where the structure is.
        let span = if v % 4 == 0 { b.len() } else { head.min(b.len()) };
        let i = ((at * span as f64) as usize).min(b.len() - 1);
        b[i] = v;
    }
    if let Some(c) = cut {
        b.truncate((c * b.len() as f64) as usize);
    }
    b
}

/// `mutate` for text: half the new bytes are characters of numbers, so that many edits keep
/// the JSON well-formed and change a value.
pub fn mutate_text(text: &[u8], (edits, cut): &(Vec<(f64, u8)>, Option<f64>)) -> Vec<u8> {
    let edits: Vec<(f64, u8)> = edits.iter().map(|&(at, v)| (at, if v % 2 == 0 { b"0123456789.-eE"[(v / 2 % 14) as usize] } else { v })).collect();
    mutate(text, &(edits, *cut), text.len())
}

/// GGUF: any mutation loads or is an error; a model that loads runs a prefill without a panic.
pub fn gguf_case(dir: &Path, good: &[u8], edit: &(Vec<(f64, u8)>, Option<f64>), tally: &Tally) -> std::result::Result<(), TestCaseError> {
    let path = dir.join("m.gguf");
    std::fs::write(&path, mutate(good, edit, 1024)).unwrap();
    let loaded = load(&path, Precision::F32);
    tally.count(loaded.is_ok());
    if let Ok(mut m) = loaded {
        let _ = m.prefill(&[1, 2, 3], &PrefillOptions::chunked(2));
    }
    Ok(())
}

/// A tiny model's calibrated profile, and a W8A8 model of the same file.
pub fn profile_setup(dir: &Path) -> (QuantProfile, Model) {
    let path = dir.join("m.gguf");
    tiny_gguf(&path);
    let mut m = load(&path, Precision::F32).unwrap();
    let seqs: Vec<Vec<u32>> = (0..2).map(|s| (0..24).map(|i| ((i * 5 + s * 11) % VOCAB) as u32).collect()).collect();
    let p = m.calibrate(&seqs, |_| {}).unwrap().finish(m.model_id().to_string(), candle_npu::ClipMethod::Budget { fraction: 1e-2 });
    (p, load(&path, Precision::W8A8).unwrap())
}

/// A JSON edit: a value somewhere in the profile replaced by a number, a string or null.
pub fn json_edits() -> impl Strategy<Value = Vec<(prop::sample::Index, prop::sample::Index, f64, u8)>> {
    prop::collection::vec((any::<prop::sample::Index>(), any::<prop::sample::Index>(), prop_oneof![any::<f64>(), -10.0..10.0f64, Just(0.0)], 0..4u8), 1..4)
}

/// The profile's JSON with `edits` applied to point fields (or the top level).
pub fn edit_json(good: &QuantProfile, edits: &[(prop::sample::Index, prop::sample::Index, f64, u8)]) -> Vec<u8> {
    let mut v = serde_json::to_value(good).unwrap();
    for (point, field, x, kind) in edits {
        let new = match kind {
            0 => serde_json::json!(x),
            1 => serde_json::json!(x.round() as i64),
            2 => serde_json::Value::Null,
            _ => serde_json::json!([x, -x]),
        };
        let names: Vec<String> = v["points"].as_object().unwrap().keys().cloned().collect();
        if field.index(8) == 7 {
            let top = ["format", "model_id", "tokens", "clip", "importance"][point.index(5)];
            v[top] = new;
        } else {
            let p = &names[point.index(names.len())];
            v["points"][p][["lo", "hi", "min", "max", "beyond", "channels", "hot"][field.index(7)]] = new;
        }
    }
    serde_json::to_vec(&v).unwrap()
}

/// Profile: any edit is refused (with the model unchanged) or gives a model with finite logits.
pub fn profile_case(dir: &Path, good: &QuantProfile, model: &mut Model, bytes: &[u8], tally: &Tally) -> std::result::Result<(), TestCaseError> {
    let path = dir.join("p.json");
    std::fs::write(&path, bytes).unwrap();
    let set = QuantProfile::load(&path, model.model_id()).and_then(|p| model.set_profile(p));
    tally.count(set.is_ok());
    if set.is_ok() {
        let logits: Vec<f32> = model.prefill(&[1, 2, 3, 4, 5], &PrefillOptions::chunked(4)).unwrap().to_vec1().unwrap();
        prop_assert!(logits.iter().all(|v| v.is_finite()), "an accepted profile gave non-finite logits");
        model.set_profile(good.clone()).unwrap();
    }
    Ok(())
}

/// Graph cache: a mutated entry is a hit only if it is the original. With `reseal`, the
/// fuzzer recomputes the checksum after the mutation (as damage never could), so that the
/// parser's own field checks see the damage: then any hit must be self-consistent.
pub fn cache_case(dir: &Path, edit: &(Vec<(f64, u8)>, Option<f64>), reseal: bool, tally: &Tally) -> std::result::Result<(), TestCaseError> {
    let cache = GraphCache::new(dir);
    let key = CacheKey::new(&[5; 32], "fuzz");
    let (meta, payload) = (vec![1u32, 2, 3], (0..300u32).map(|i| i as u8).collect::<Vec<u8>>());
    let path = cache.store("g", &key, &meta, &payload).unwrap();
    let good = std::fs::read(&path).unwrap();
    let mut bad = mutate(&good[..good.len() - 32], edit, 64);
    match reseal {
        true => {
            use sha2::Digest;
            let sum = sha2::Sha256::digest(&bad);
            bad.extend_from_slice(&sum);
        }
        false => bad.extend_from_slice(&good[good.len() - 32..]),
    }
    std::fs::write(&path, &bad).unwrap();
    let lookup = cache.load("g", &key);
    tally.count(matches!(lookup, Lookup::Hit(_)));
    match lookup {
        Lookup::Hit(e) if reseal => prop_assert!(52 + 4 * e.meta.len() + e.payload.len() + 32 == bad.len(), "a hit of inconsistent sizes"),
        Lookup::Hit(e) => prop_assert!(bad == good && e.meta == meta && e.payload == payload, "a damaged entry was a hit"),
        Lookup::Miss => prop_assert!(false, "an existing file was a miss"),
        Lookup::Invalid(_) => prop_assert!(bad != good, "the original entry was invalid"),
    }
    Ok(())
}

/// A valid graph of every op kind: F32 and W8A8 FullyConnected (with bias), MatMul, Quantize,
/// Dequantize, Add, Mul (also broadcast), Sigmoid, Softmax, RmsNorm, Clamp, Reshape, Transpose, Concat.
pub fn base_graph() -> Graph {
    let mut g = Graph::new("fuzz");
    let q = Quant::u8_range(-1.0, 1.0);
    let x = g.input("x", &[2, 4], DType::F32, None);
    let w = g.constant("w", &[3, 4], StaticData::F32(Arc::new(vec![0.5; 12])), None);
    let b = g.constant("b", &[3], StaticData::F32(Arc::new(vec![0.1; 3])), None);
    let y = g.fully_connected("y", x, w, Some(b), DType::F32, None);
    let s = g.op("s", DType::F32, None, |output| Op::Sigmoid { input: y, output }, &[2, 3]);
    let m = g.binary("m", s, y, DType::F32, None, |a, b, output| Op::Mul { a, b, output });
    let xq = g.op("xq", DType::U8, Some(q), |output| Op::Quantize { input: x, output }, &[2, 4]);
    let wq = g.constant("wq", &[3, 4], StaticData::I8(Arc::new(vec![3; 12])), Some(Quant::symmetric(0.01)));
    let yq = g.fully_connected("yq", xq, wq, None, DType::F32, None);
    let a = g.binary("a", m, yq, DType::F32, None, |a, b, output| Op::Add { a, b, output });
    let k = g.constant("k", &[5, 3], StaticData::F32(Arc::new(vec![0.2; 15])), None);
    let mm = g.op("mm", DType::F32, None, |output| Op::MatMul { a, b: k, transpose_b: true, output }, &[2, 5]);
    let d = g.op("d", DType::F32, None, |output| Op::Dequantize { input: xq, output }, &[2, 4]);
    let sm = g.op("sm", DType::F32, None, |output| Op::Softmax { input: mm, output }, &[2, 5]);
    let n = g.op("n", DType::F32, None, |output| Op::RmsNorm { input: a, gamma: b, epsilon: 1e-5, output }, &[2, 3]);
    let r = g.op("r", DType::F32, None, |output| Op::Reshape { input: n, output }, &[3, 2]);
    let t = g.op("t", DType::F32, None, |output| Op::Transpose { input: r, perm: vec![1, 0], output }, &[2, 3]);
    let c = g.op("c", DType::F32, None, |output| Op::Concat { a: t, b: a, axis: 0, output }, &[4, 3]);
    let cl = g.op("cl", DType::F32, None, |output| Op::Clamp { input: c, lo: -0.5, hi: 0.5, output }, &[4, 3]);
    let bm = g.binary("bm", cl, b, DType::F32, None, |a, b, output| Op::Mul { a, b, output });
    g.mark_output(sm);
    g.mark_output(d);
    g.mark_output(bm);
    g
}

/// A mutation of one field of a graph: which tensor or op (an index, wrapped), which field, a
/// value.
pub type GraphEdit = (usize, u8, usize, i32);

pub fn graph_edits() -> impl Strategy<Value = Vec<GraphEdit>> {
    prop::collection::vec((0..32usize, 0..10u8, prop_oneof![0..6usize, Just(usize::MAX / 3)], -300..300i32), 0..3)
}

/// `base_graph` with `edits` applied: shapes, types, kinds, quantization, data, op ids, inputs
/// and outputs changed.
pub fn edited_graph(edits: &[GraphEdit]) -> Graph {
    let mut g = base_graph();
    let dtypes = [DType::F32, DType::U8, DType::I8, DType::I32, DType::U16];
    let kinds = [TensorKind::Input, TensorKind::Output, TensorKind::Intermediate, TensorKind::Static];
    for &(i, field, v, x) in edits {
        let (nt, no) = (g.tensors.len(), g.ops.len());
        let t = &mut g.tensors[i % nt];
        match field {
            0 => t.shape = vec![v; 1 + i % 3],
            1 => {
                if let Some(d) = t.shape.get_mut(i % 2) {
                    *d = v;
                }
            }
            2 => t.dtype = dtypes[v % dtypes.len()],
            3 => t.kind = kinds[v % kinds.len()],
            4 => t.quant = (x != 0).then_some(Quant { scale: x as f32 / 100.0, offset: x }),
            5 => t.data = None,
            6 => {
                let op = &mut g.ops[i % no];
                *op = match *op {
                    Op::FullyConnected { input, bias, output, .. } => Op::FullyConnected { input, weight: TensorId(v), bias, output },
                    Op::MatMul { b, transpose_b, output, .. } => Op::MatMul { a: TensorId(v), b, transpose_b: !transpose_b, output },
                    Op::Add { a, b, .. } => Op::Add { a, b, output: TensorId(v) },
                    Op::Mul { a, output, .. } => Op::Mul { a, b: TensorId(v), output },
                    Op::Sigmoid { output, .. } | Op::Quantize { output, .. } | Op::Dequantize { output, .. } => Op::Sigmoid { input: TensorId(v), output },
                    Op::Softmax { output, .. } => Op::Softmax { input: TensorId(v), output },
                    Op::RmsNorm { input, output, .. } => Op::RmsNorm { input, gamma: TensorId(v), epsilon: x as f32, output },
                    Op::Reshape { output, .. } => Op::Reshape { input: TensorId(v), output },
                    Op::Clamp { input, output, .. } => Op::Clamp { input, lo: x as f32, hi: v as f32 - 3.0, output },
                    Op::Transpose { input, output, .. } => Op::Transpose { input, perm: vec![v % 4, (x as usize) % 4], output },
                    Op::Concat { a, b, output, .. } => Op::Concat { a, b, axis: v, output },
                };
            }
            7 => g.inputs.push(TensorId(v)),
            8 => g.outputs.push(TensorId(v)),
            _ => drop(g.ops.remove(i % no)),
        }
    }
    g
}

/// `Graph::validate`: never panics; a graph it accepts prepares and runs on the host executor
/// (zeros in) without a panic.
pub fn graph_case(g: &Graph, tally: &Tally) -> std::result::Result<(), TestCaseError> {
    let valid = g.validate().is_ok();
    tally.count(valid);
    if !valid {
        return Ok(());
    }
    let dev = NpuDevice::host();
    if let Ok(prepared) = dev.prepare(g) {
        let inputs: Vec<TensorData> = g.inputs.iter().map(|&i| TensorData::zeros(g.tensors[i.0].dtype, g.tensors[i.0].elem_count())).collect();
        let refs: Vec<&TensorData> = inputs.iter().collect();
        let _ = prepared.execute(&refs);
    }
    Ok(())
}

/// A small BPE `tokenizer.json` of the tiny model's vocabulary (ids below [`VOCAB`]): NFKC,
/// lowercase and SentencePiece's space, a split regex, BOS by a template, a decoder sequence.
pub fn tiny_tokenizer_json() -> Vec<u8> {
    let mut vocab = serde_json::Map::new();
    let merges = ["t h", "h e", "th e", "i n", "e r", "a n", "o n", "\u{2581} t", "\u{2581}t he", "o r", "e n"];
    let pieces = ["<unk>", "<s>", "</s>", "\u{2581}", ".", ",", "!", "?"]
        .into_iter()
        .map(String::from)
        .chain(('a'..='z').chain('0'..='9').map(String::from))
        .chain(merges.iter().map(|m| m.replace(' ', "")));
    for piece in pieces {
        let id = vocab.len();
        vocab.entry(piece).or_insert(serde_json::json!(id));
    }
    assert!(vocab.len() <= VOCAB && 2 * vocab.len() > VOCAB);
    let special = |id: u32, content: &str| serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\u{2581}?[a-z]+|[0-9]|[^a-z0-9\u{2581}]+|\u{2581}"}, "behavior": "Isolated", "invert": false},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges},
    });
    serde_json::to_vec(&json).unwrap()
}

/// A JSON edit anywhere in a document: (which node, in tree order; the new value's kind; a number).
pub fn any_json_edits() -> impl Strategy<Value = Vec<(prop::sample::Index, u8, f64)>> {
    prop::collection::vec((any::<prop::sample::Index>(), 0..6u8, prop_oneof![any::<f64>(), -300.0..300.0f64]), 1..4)
}

/// `json` with `edits` applied: a node (object, array or scalar, in tree order) replaced by a
/// number, an integer, a string, null, an empty object or a copy of another node.
pub fn edit_any_json(json: &[u8], edits: &[(prop::sample::Index, u8, f64)]) -> Vec<u8> {
    fn paths(v: &serde_json::Value, at: String, out: &mut Vec<String>) {
        out.push(at.clone());
        match v {
            serde_json::Value::Object(m) => m.iter().for_each(|(k, x)| paths(x, format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")), out)),
            serde_json::Value::Array(a) => a.iter().enumerate().for_each(|(i, x)| paths(x, format!("{at}/{i}"), out)),
            _ => {}
        }
    }
    let mut v: serde_json::Value = serde_json::from_slice(json).unwrap();
    for (node, kind, x) in edits {
        let mut all = vec![];
        paths(&v, String::new(), &mut all);
        let at = &all[node.index(all.len())];
        let new = match kind {
            0 => serde_json::json!(x),
            1 => serde_json::json!(x.round() as i64),
            2 => serde_json::json!(format!("{x}")),
            3 => serde_json::Value::Null,
            4 => serde_json::json!({}),
            _ => v.pointer(&all[(node.index(all.len()) * 7 + 3) % all.len()]).cloned().unwrap_or_default(),
        };
        match v.pointer_mut(at) {
            Some(slot) if !at.is_empty() => *slot = new,
            _ => {}
        }
    }
    serde_json::to_vec(&v).unwrap()
}

/// `tokenizer.json`: any mutation loads or is an error naming the file; a tokenizer that loads
/// encodes and decodes a few texts without a panic (an error is allowed).
pub fn tokenizer_case(dir: &Path, bytes: &[u8], tally: &Tally) -> std::result::Result<(), TestCaseError> {
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, bytes).unwrap();
    let loaded = candle_npu_models::tokenizer::from_file(&path);
    tally.count(loaded.is_ok());
    match loaded {
        Ok(tok) => {
            for text in ["The thin tin, 42!", "", "  ", "\u{fb01}ne \u{2163}"] {
                if let Ok(ids) = candle_npu_models::tokenizer::encode(&tok, text, true) {
                    let _ = tok.decode(&ids, false);
                }
            }
        }
        Err(e) => prop_assert!(e.to_string().contains(&path.display().to_string()), "an error without the path: {e}"),
    }
    Ok(())
}

/// The tiny model and its tokenizer written in `dir` (`m.gguf`, `tiny-tokenizer.json`): their paths.
pub fn tiny_model_files(dir: &Path) -> (PathBuf, PathBuf) {
    let model = dir.join("m.gguf");
    tiny_gguf(&model);
    let tok = dir.join("tiny-tokenizer.json");
    std::fs::write(&tok, tiny_tokenizer_json()).unwrap();
    (model, tok)
}

/// The tiny model with [`tiny_tokenizer_json`], on the host, F32.
pub fn tiny_pipeline(dir: &Path) -> Pipeline {
    let (model, tok) = tiny_model_files(dir);
    let opts = LoadOptions { precision: Some(Precision::F32), decode_weights: DecodeWeights::F32, ..Default::default() };
    Pipeline::load(&model, Some(&tok), &NpuDevice::host(), opts).unwrap()
}

/// A saved conversation of `p` (two turns); its bytes and the length of its header.
pub fn saved_session(p: &mut Pipeline, path: &Path) -> (Vec<u8>, usize) {
    let opts = GenerateOptions { sample_len: 3, ..Default::default() };
    let mut s = p.session();
    s.send(p, "the thin tin", &opts, |_| {}).unwrap();
    s.send(p, "and then?", &opts, |_| {}).unwrap();
    s.save(p, path).unwrap();
    let bytes = std::fs::read(path).unwrap();
    let header = 12 + u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
    (bytes, header)
}

/// Saved session: bytes mutated and the checksum resealed (as damage never could, so that the
/// reader's own checks see it): refused, or restored to a conversation that goes on.
pub fn session_case(
    p: &mut Pipeline,
    dir: &Path,
    good: &[u8],
    header: usize,
    edit: &(Vec<(f64, u8)>, Option<f64>),
    tally: &Tally,
) -> std::result::Result<(), TestCaseError> {
    use sha2::Digest;
    let path = dir.join("s.kv");
    let mut bad = mutate(&good[..good.len() - 32], edit, header);
    let sum = sha2::Sha256::digest(&bad);
    bad.extend_from_slice(&sum);
    std::fs::write(&path, &bad).unwrap();
    p.model.clear();
    p.model.prefill(&[1, 5, 6], &PrefillOptions::default()).unwrap();
    let restored = p.restore_session(&path);
    tally.count(restored.is_ok());
    prop_assert_eq!(p.model.position(), 3, "a restore does not touch the model");
    if let Ok(mut s) = restored {
        // What was accepted goes on: a turn on it answers (the messages re-rendered, the cache
        // kept as far as they agree).
        let opts = GenerateOptions { sample_len: 2, ..Default::default() };
        let turn = s.send(p, "go on", &opts, |_| {});
        prop_assert!(turn.is_ok(), "a turn on an accepted state failed: {:?}", turn.err());
    }
    Ok(())
}

/// A model's ChatML template, as SmolLM2's and Qwen2's GGUFs carry it (their default system
/// prompt aside): the template property's seed.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Hostile pieces of Jinja the template property splices in.
const HOSTILE: &[&str] = &[
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "{{ 'x' * 99999999 }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ raise_exception('refused') }}",
    "{% for m in messages %}{{ m.content * 1000 }}{% endfor %}",
    "{% if %}",
    "{{ messages[7].content }}",
    "{% set messages = [] %}",
    "{{ range(99999)|join(',') }}",
];

/// Edits of a template: bytes mutated, and hostile pieces spliced in at places.
pub fn template_edits() -> impl Strategy<Value = ((Vec<(f64, u8)>, Option<f64>), Vec<(f64, prop::sample::Index)>)> {
    (edits(), prop::collection::vec((0.0..1.0f64, any::<prop::sample::Index>()), 0..3))
}

/// `CHATML_TEMPLATE` with `edit` applied: hostile pieces spliced in (at character boundaries),
/// then some bytes mutated (a third of the cases: most mutated templates do not compile).
pub fn edited_template((bytes, splices): &((Vec<(f64, u8)>, Option<f64>), Vec<(f64, prop::sample::Index)>)) -> String {
    let mut t = CHATML_TEMPLATE.to_string();
    for (at, which) in splices {
        // Between tags (before a `{{` or `{%`, or at the end), where the piece is Jinja, not
        // text inside a string.
        let places: Vec<usize> = t.match_indices("{{").chain(t.match_indices("{%")).map(|(i, _)| i).chain([t.len()]).collect();
        let i = places[((at * places.len() as f64) as usize).min(places.len() - 1)];
        t.insert_str(i, HOSTILE[which.index(HOSTILE.len())]);
    }
    if bytes.0.len() % 3 != 0 {
        return t;
    }
    String::from_utf8_lossy(&mutate(t.as_bytes(), bytes, t.len())).into_owned()
}

/// A chat template: it compiles or not; one that compiles renders a conversation or refuses it
/// with an error naming the template, within seconds, under a memory budget of 16 MiB (a render
/// past it leaves its thread asleep holding the budget: kept small for a thousand cases).
pub fn template_case(source: &str, tally: &Tally) -> std::result::Result<(), TestCaseError> {
    let Ok(t) = candle_npu_models::JinjaTemplate::new(source, "<s>", "</s>") else {
        tally.count(false);
        return Ok(());
    };
    let t = t.from_file(Path::new("fuzz.gguf")).memory(16 << 20).max_text(1 << 20);
    let msgs = [
        candle_npu_models::Message::system("Be brief."),
        candle_npu_models::Message::user("Hello there"),
        candle_npu_models::Message::assistant("Hi!"),
        candle_npu_models::Message::user("What is 2+2?"),
    ];
    let start = std::time::Instant::now();
    let r = t.segments(&msgs, true);
    prop_assert!(start.elapsed() < std::time::Duration::from_secs(15), "{source:?}: {:?}", start.elapsed());
    tally.count(r.is_ok());
    match r {
        Ok(segments) => {
            // Each message written once at least, as itself (trimmed at most).
            for m in &msgs {
                prop_assert!(segments.iter().any(|(text, trusted)| !trusted && text == m.content.trim()), "{source:?}: {m:?} missing");
            }
        }
        Err(e) => prop_assert!(e.to_string().contains("fuzz.gguf"), "{source:?}: {e}"),
    }
    Ok(())
}
