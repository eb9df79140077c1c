//! Qwen2 and Gemma 3 (real GGUF weights): chunked prefill (float passthrough) and decode against
//! candle-transformers' own quantized models on the same weights dequantized to F32.
//!
//! Own test binary: `CANDLE_DEQUANTIZE_ALL=1` makes every `QMatMul` of the reference an F32
//! matmul over the dequantized weights (see tests/reference.rs for Llama).

mod common;

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_npu::NpuDevice;
use candle_npu_models::logits::argmax;
use candle_npu_models::PrefillOptions;
use candle_npu_models::{assets, DecodeWeights, LoadOptions, Model, Pipeline, Precision};
use common::*;

fn dequantize_all() {
    // SAFETY: set before any QMatMul is built; every test in this binary wants the same value.
    unsafe { std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1") };
}

/// Our pipeline on `path` (F32 prefill, F32 decode) and `n` tokens of held-out Wikipedia text
/// (after the BOS the tokenizer adds, for Gemma).
fn ours(path: &Path, n: usize) -> (Pipeline, Vec<u32>) {
    let opts = LoadOptions { precision: Some(Precision::F32), decode_weights: DecodeWeights::F32, ..Default::default() };
    let p = Pipeline::load(path, None, &NpuDevice::host(), opts).unwrap();
    let toks = p.heldout_tokens(n).unwrap();
    assert_eq!(toks.len(), n);
    (p, toks)
}

fn content(path: &Path) -> (gguf_file::Content, std::fs::File) {
    let mut f = std::fs::File::open(path).unwrap();
    (gguf_file::Content::read(&mut f).unwrap(), f)
}

/// Compare last-token logits for each prompt length and chunk length, then 16 greedy tokens.
fn check(model: &mut Model, mut reference: impl FnMut(&[u32], usize) -> Vec<f32>, toks: &[u32], lens: &[usize], chunks: &[usize], decode_prompt: usize) {
    let mut worst = 0f32;
    for &len in lens {
        let want = reference(&toks[..len], 0);
        for &chunk in chunks {
            let got: Vec<f32> = model.prefill(&toks[..len], &PrefillOptions::chunked(chunk)).unwrap().to_vec1().unwrap();
            let err = rel_max_err(&got, &want);
            worst = worst.max(err);
            // Both F32; they differ in GEMM summation order only.
            assert!(err < 1e-3, "prompt {len}, chunk {chunk}: relative max error {err}");
            assert_eq!(top1(&got), top1(&want), "prompt {len}, chunk {chunk}");
        }
    }
    eprintln!("worst relative max error vs candle-transformers: {worst:e}");

    let prompt = &toks[..decode_prompt];
    let mut want = vec![];
    let mut logits = reference(prompt, 0);
    for step in 0..16 {
        let t = top1(&logits);
        want.push(t);
        logits = reference(&[t], prompt.len() + step);
    }
    let mut got = vec![argmax(&model.prefill(prompt, &PrefillOptions::chunked(16)).unwrap()).unwrap()];
    while got.len() < 16 {
        got.push(argmax(&model.decode(*got.last().unwrap()).unwrap()).unwrap());
    }
    assert_eq!(got, want, "16 greedy tokens after a chunked prefill");
}

/// Against candle-transformers run in half precision (the user's "candle FP16 outputs"): the
/// same top-1 token, and logits no further from candle's half-precision result than candle's
/// own F32 result is (`f32_reference`): the tolerance is the half-precision rounding itself,
/// measured, not a constant chosen to pass.
fn check_half(
    model: &mut Model,
    mut half: impl FnMut(&[u32], usize) -> Vec<f32>,
    mut f32_reference: impl FnMut(&[u32], usize) -> Vec<f32>,
    toks: &[u32],
    lens: &[usize],
    chunk: usize,
) {
    for &len in lens {
        let (want, want32) = (half(&toks[..len], 0), f32_reference(&toks[..len], 0));
        let got: Vec<f32> = model.prefill(&toks[..len], &PrefillOptions::chunked(chunk)).unwrap().to_vec1().unwrap();
        let (err, tol) = (rel_max_err(&got, &want), rel_max_err(&want32, &want));
        eprintln!("prompt {len}: relative max error vs candle-transformers in half precision {err:e} (candle F32 vs half: {tol:e})");
        // 1% slack: ours and candle's F32 differ by ~1e-6 (GEMM order), not by the half rounding.
        assert!(err <= tol * 1.01 + 1e-5, "prompt {len}: relative max error {err} vs half precision, candle's own F32 is at {tol}");
        // Where half precision flips candle's own top-1 (a near tie), ours follows F32.
        match top1(&want32) == top1(&want) {
            true => assert_eq!(top1(&got), top1(&want), "prompt {len}: top-1 vs half precision"),
            false => eprintln!("prompt {len}: half precision changes candle's own top-1 ({} in F32, {} in half)", top1(&want32), top1(&want)),
        }
    }
}

fn top1(v: &[f32]) -> u32 {
    argmax(&Tensor::new(v, &Device::Cpu).unwrap()).unwrap()
}

#[test]
fn qwen2_chunked_prefill_and_decode_match_candle_transformers() {
    use candle_transformers::models::quantized_qwen2::ModelWeights;
    dequantize_all();
    let path = assets::qwen25_coder_05b().unwrap();
    let (mut p, toks) = ours(&path, 300);
    let (ct, mut f) = content(&path);
    let r = ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap();
    // candle's quantized models restart their KV cache at position 0.
    let fwd = |r: &mut ModelWeights, t: &[u32], pos: usize| -> Vec<f32> {
        let x = Tensor::new(t, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        r.forward(&x, pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    };
    let r = std::cell::RefCell::new(r);
    check(&mut p.model, |t, pos| fwd(&mut r.borrow_mut(), t, pos), &toks, &[37, 300], &[64, 256], 37);
}

/// candle-transformers' float Gemma 3 (`gemma3.rs`, HF names and HF's `1 + w` norms) on the
/// GGUF's weights dequantized to `dtype`. (Its quantized Gemma 3 applies SiLU in the FFN where
/// Gemma uses GELU-tanh, so it is no reference for the FFN.)
fn gemma3_reference(path: &Path, window: usize, dtype: candle_core::DType) -> candle_transformers::models::gemma3::Model {
    use candle_transformers::models::gemma3::{Config, Model as Gemma3};
    let g = candle_npu_models::gguf::Gguf::open(path).unwrap();
    let cfg = g.config("gemma3").unwrap();
    let mut ts = std::collections::HashMap::new();
    let mut put = |hf: String, gguf: String, norm: bool| {
        let t = g.f32_tensor(&gguf).unwrap();
        // llama.cpp's conversion stored Gemma's norm weights as 1 + w; HF stores w.
        let t = if norm { (t - 1.0).unwrap() } else { t };
        ts.insert(hf, t.to_dtype(dtype).unwrap());
    };
    put("model.embed_tokens.weight".into(), "token_embd.weight".into(), false);
    put("model.norm.weight".into(), "output_norm.weight".into(), true);
    for l in 0..cfg.n_layer {
        let (hf, gg) = (format!("model.layers.{l}"), format!("blk.{l}"));
        for (a, b) in [
            ("self_attn.q_proj", "attn_q"),
            ("self_attn.k_proj", "attn_k"),
            ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"),
            ("mlp.gate_proj", "ffn_gate"),
            ("mlp.up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down"),
        ] {
            put(format!("{hf}.{a}.weight"), format!("{gg}.{b}.weight"), false);
        }
        for (a, b) in [
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "post_attention_norm"),
            ("pre_feedforward_layernorm", "ffn_norm"),
            ("post_feedforward_layernorm", "post_ffw_norm"),
            ("self_attn.q_norm", "attn_q_norm"),
            ("self_attn.k_norm", "attn_k_norm"),
        ] {
            put(format!("{hf}.{a}.weight"), format!("{gg}.{b}.weight"), true);
        }
    }
    let md = |k: &str| g.metadata().get(&format!("gemma3.{k}")).map(|v| v.to_f32().unwrap() as f64);
    let c = Config {
        attention_bias: false,
        head_dim: cfg.head_dim,
        hidden_activation: candle_nn::Activation::GeluPytorchTanh,
        hidden_size: cfg.hidden,
        intermediate_size: cfg.ffn,
        num_attention_heads: cfg.n_head,
        num_hidden_layers: cfg.n_layer,
        num_key_value_heads: cfg.n_kv_head,
        rms_norm_eps: cfg.rms_eps,
        rope_theta: md("rope.freq_base").unwrap_or(1e6),
        rope_local_base_freq: md("rope.local_freq_base").unwrap_or(1e4),
        vocab_size: cfg.vocab,
        final_logit_softcapping: None,
        attn_logit_softcapping: None,
        query_pre_attn_scalar: cfg.head_dim,
        // candle-transformers lets a position see `window` earlier ones (j + window >= i), HF
        // and llama.cpp `window - 1` (i - j < window): give candle one less to compare alike.
        sliding_window: window - 1,
        sliding_window_pattern: 6,
        max_position_embeddings: cfg.context_len,
    };
    Gemma3::new(false, &c, candle_nn::VarBuilder::from_tensors(ts, dtype, &Device::Cpu)).unwrap()
}

#[test]
fn gemma3_chunked_prefill_beyond_the_sliding_window_and_decode_match_candle_transformers() {
    let path = assets::gemma3_270m().unwrap();
    let (mut p, toks) = ours(&path, 700);
    assert_eq!(toks[0], 2, "Gemma text starts with BOS");
    let model = &mut p.model;
    let window = model.spec().layers[0].window.expect("layer 0 slides");
    assert_eq!(window, 512);
    // Gemma 3's activations overflow F16 (candle-transformers' F16 forward gives NaN logits,
    // as HF's does): its half-precision reference is BF16.
    let forward = |r: &std::cell::RefCell<candle_transformers::models::gemma3::Model>, t: &[u32], pos: usize| -> Vec<f32> {
        let x = Tensor::new(t, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let mut r = r.borrow_mut();
        if pos == 0 {
            r.clear_kv_cache();
        }
        r.forward(&x, pos).unwrap().to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    };
    let r32 = std::cell::RefCell::new(gemma3_reference(&path, window, candle_core::DType::F32));
    // 700 > 512: the sliding layers must drop the oldest positions.
    check(model, |t, p| forward(&r32, t, p), &toks, &[37, 700], &[256], 37);
    let r16 = std::cell::RefCell::new(gemma3_reference(&path, window, candle_core::DType::BF16));
    check_half(model, |t, p| forward(&r16, t, p), |t, p| forward(&r32, t, p), &toks, &[37, 700], 256);
}
