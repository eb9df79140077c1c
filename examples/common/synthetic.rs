//! Models of real shapes above 0.5B parameters, whose weights are not reachable here: seeded
//! random weights in llama.cpp's Q4_K_M mix, written once to `assets/.bench/{name}.gguf`
//! (atomically) and reused. Never committed. Their answers mean nothing; their memory and speed
//! are those of the real shapes, except that random weights give activations without the real
//! models' outlier channels (few hot columns, little shadow work).
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use candle_npu_models::assets;

/// A real model's shapes.
pub struct Shape {
    pub name: &'static str,
    /// `general.architecture`: `llama` or `qwen2` (Q/K/V biases).
    arch: &'static str,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    ffn: usize,
    vocab: usize,
    rope_base: f32,
    eps: f32,
}

/// Llama-3.2-1B (1.24B parameters, tied embeddings) and Qwen2.5-3B (3.09B, tied, Q/K/V biases),
/// from their `config.json`.
pub const SHAPES: [Shape; 2] = [
    Shape { name: "llama-3.2-1b", arch: "llama", hidden: 2048, layers: 16, heads: 32, kv_heads: 8, ffn: 8192, vocab: 128_256, rope_base: 500_000.0, eps: 1e-5 },
    Shape {
        name: "qwen2.5-3b",
        arch: "qwen2",
        hidden: 2048,
        layers: 36,
        heads: 16,
        kv_heads: 2,
        ffn: 11_008,
        vocab: 151_936,
        rope_base: 1_000_000.0,
        eps: 1e-6,
    },
];

impl Shape {
    pub fn by_name(name: &str) -> Option<&'static Shape> {
        SHAPES.iter().find(|s| s.name == name)
    }

    /// Parameters (the tied embedding counted once).
    pub fn params(&self) -> usize {
        let kv = self.kv_heads * self.hidden / self.heads;
        let layer = self.hidden * (2 * self.hidden + 2 * kv) + 3 * self.hidden * self.ffn;
        self.layers * layer + self.vocab * self.hidden
    }
}

/// llama.cpp's Q4_K_M choice for `attn_v` and `ffn_down` of layer `l` of `n`: Q6_K in the first
/// and last eighth and every third layer between, else Q4_K.
fn more_bits(l: usize, n: usize) -> bool {
    l < n / 8 || l >= 7 * n / 8 || (l - n / 8) % 3 == 2
}

/// Seeded values, uniform in `[-scale / 2, scale / 2)` (xorshift).
fn seeded(shape: &[usize], scale: f32, seed: &mut u64) -> Result<Tensor> {
    let v: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            ((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// `shape`'s model as a GGUF (written on first use, with `progress(done, total)` per tensor),
/// with the tokenizer of the real model of its family (SmolLM2's for `llama`, Qwen2.5-Coder's
/// for `qwen2`), its token list padded to the vocabulary with unused tokens.
pub fn model(shape: &Shape, progress: impl Fn(usize, usize)) -> Result<PathBuf> {
    let out = assets::dir().join(format!(".bench/{}-q4_k_m-random.gguf", shape.name));
    if out.exists() {
        return Ok(out);
    }
    std::fs::create_dir_all(out.parent().context("assets folder")?)?;
    let donor = match shape.arch {
        "llama" => assets::smollm2(),
        _ => assets::qwen25_coder_05b()?,
    };
    let mut md = tokenizer_metadata(&donor, shape.vocab)?;
    let a = shape.arch;
    let u = |v: usize| Value::U32(v as u32);
    md.extend([
        ("general.architecture".to_string(), Value::String(a.into())),
        ("general.name".into(), Value::String(format!("{} shapes, seeded random weights", shape.name))),
        (format!("{a}.embedding_length"), u(shape.hidden)),
        (format!("{a}.block_count"), u(shape.layers)),
        (format!("{a}.feed_forward_length"), u(shape.ffn)),
        (format!("{a}.attention.head_count"), u(shape.heads)),
        (format!("{a}.attention.head_count_kv"), u(shape.kv_heads)),
        (format!("{a}.context_length"), u(32_768)),
        (format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(shape.eps)),
        (format!("{a}.rope.freq_base"), Value::F32(shape.rope_base)),
    ]);
    let (h, kv) = (shape.hidden, shape.kv_heads * shape.hidden / shape.heads);
    // (name, shape, type): the tied embedding is also the output table (Q6_K, as llama.cpp
    // gives `output` in Q4_K_M).
    let mut plan: Vec<(String, Vec<usize>, GgmlDType)> =
        vec![("token_embd.weight".into(), vec![shape.vocab, h], GgmlDType::Q6K), ("output_norm.weight".into(), vec![h], GgmlDType::F32)];
    for l in 0..shape.layers {
        let v = if more_bits(l, shape.layers) { GgmlDType::Q6K } else { GgmlDType::Q4K };
        for (name, dims, dtype) in [
            ("attn_q", [h, h], GgmlDType::Q4K),
            ("attn_k", [kv, h], GgmlDType::Q4K),
            ("attn_v", [kv, h], v),
            ("attn_output", [h, h], GgmlDType::Q4K),
            ("ffn_gate", [shape.ffn, h], GgmlDType::Q4K),
            ("ffn_up", [shape.ffn, h], GgmlDType::Q4K),
            ("ffn_down", [h, shape.ffn], v),
        ] {
            plan.push((format!("blk.{l}.{name}.weight"), dims.to_vec(), dtype));
        }
        for name in ["attn_norm", "ffn_norm"] {
            plan.push((format!("blk.{l}.{name}.weight"), vec![h], GgmlDType::F32));
        }
        if shape.arch == "qwen2" {
            for (name, n) in [("attn_q", h), ("attn_k", kv), ("attn_v", kv)] {
                plan.push((format!("blk.{l}.{name}.bias"), vec![n], GgmlDType::F32));
            }
        }
    }
    let seed = &mut (0x9e37_79b9_7f4a_7c15u64 ^ shape.params() as u64);
    let mut tensors = Vec::with_capacity(plan.len());
    for (i, (name, dims, dtype)) in plan.iter().enumerate() {
        progress(i, plan.len());
        let t = if name.ends_with("norm.weight") {
            (seeded(dims, 0.2, seed)? + 1.0)?
        } else if name.ends_with(".bias") {
            seeded(dims, 0.2, seed)?
        } else {
            // Uniform of standard deviation 0.02, about that of trained weights of this size.
            seeded(dims, 0.07, seed)?
        };
        tensors.push((name.clone(), QTensor::quantize(&t, *dtype)?));
    }
    progress(plan.len(), plan.len());
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tr: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tmp = out.with_extension(format!("tmp{}", std::process::id()));
    gguf_file::write(&mut std::io::BufWriter::new(std::fs::File::create(&tmp)?), &md, &tr)?;
    std::fs::rename(&tmp, &out)?;
    Ok(out)
}

/// `donor`'s `tokenizer.*` metadata, its token list (and types, scores) padded to `vocab`.
fn tokenizer_metadata(donor: &Path, vocab: usize) -> Result<Vec<(String, Value)>> {
    let ct = gguf_file::Content::read(&mut std::fs::File::open(donor).with_context(|| donor.display().to_string())?)?;
    let mut md = Vec::new();
    for (k, v) in ct.metadata.into_iter().filter(|(k, _)| k.starts_with("tokenizer.")) {
        let v = match (k.as_str(), v) {
            ("tokenizer.ggml.tokens", Value::Array(mut a)) => {
                if a.len() > vocab {
                    bail!("{}: {} tokens, more than the vocabulary of {vocab}", donor.display(), a.len());
                }
                (a.len()..vocab).for_each(|i| a.push(Value::String(format!("<|unused_{i}|>"))));
                Value::Array(a)
            }
            // Unused tokens are "unused" (5) in llama.cpp's token types.
            ("tokenizer.ggml.token_type", Value::Array(mut a)) => {
                a.resize(vocab, Value::I32(5));
                Value::Array(a)
            }
            ("tokenizer.ggml.scores", Value::Array(mut a)) => {
                a.resize(vocab, Value::F32(0.0));
                Value::Array(a)
            }
            (_, v) => v,
        };
        md.push((k, v));
    }
    Ok(md)
}
