//! Chunked prefill (float passthrough) and decode against candle-transformers' own Llama forward
//! pass on the same weights (the GGUF dequantized to F32).
//!
//! Own test binary: the reference is candle's `quantized_llama` with `CANDLE_DEQUANTIZE_ALL=1`,
//! which makes every `QMatMul` in this process an F32 matmul over the dequantized weights.

mod common;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_npu::NpuDevice;
use candle_npu_models::logits::argmax;
use candle_npu_models::PrefillOptions;
use candle_npu_models::{assets, DecodeWeights, Precision};
use candle_transformers::models::quantized_llama::ModelWeights;
use common::*;

fn reference() -> ModelWeights {
    // SAFETY: set before any QMatMul is built; every test in this binary wants the same value.
    unsafe { std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1") };
    let path = assets::smollm2();
    let mut f = std::fs::File::open(&path).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap()
}

fn ref_logits(m: &mut ModelWeights, tokens: &[u32], pos: usize) -> Vec<f32> {
    let x = Tensor::new(tokens, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    m.forward(&x, pos).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn chunked_f32_prefill_matches_candle_transformers() {
    let mut reference = reference();
    let dev = NpuDevice::host();
    let mut p = smollm2(&dev, Precision::F32, DecodeWeights::F32);
    let text = heldout_tokens(&p, 700);
    let mut worst = 0f32;
    for len in [1usize, 37, 256, 300, 700] {
        reference.clear_kv_cache();
        let want = ref_logits(&mut reference, &text[..len], 0);
        for chunk in [32usize, 128, 256] {
            let got: Vec<f32> = p.model.prefill(&text[..len], &PrefillOptions::chunked(chunk)).unwrap().to_vec1().unwrap();
            let err = rel_max_err(&got, &want);
            worst = worst.max(err);
            // Both are F32; they differ only in GEMM summation order (rten vs gemm) over 30 layers.
            assert!(err < 1e-3, "prompt {len}, chunk {chunk}: relative max error {err}");
            assert_eq!(argmax(&Tensor::new(got.as_slice(), &Device::Cpu).unwrap()).unwrap(), {
                let t = Tensor::new(want.as_slice(), &Device::Cpu).unwrap();
                argmax(&t).unwrap()
            });
        }
    }
    eprintln!("worst relative max error vs candle-transformers: {worst:e}");
}

#[test]
fn decode_after_chunked_prefill_matches_candle_greedy() {
    let mut reference = reference();
    let dev = NpuDevice::host();
    let mut p = smollm2(&dev, Precision::F32, DecodeWeights::F32);
    let prompt = heldout_tokens(&p, 37);

    let mut want = vec![];
    let mut logits = ref_logits(&mut reference, &prompt, 0);
    for step in 0..16 {
        let t = argmax(&Tensor::new(logits.as_slice(), &Device::Cpu).unwrap()).unwrap();
        want.push(t);
        logits = ref_logits(&mut reference, &[t], prompt.len() + step);
    }

    // Chunk 16: three chunks, the last one padded (37 = 16 + 16 + 5).
    let mut got = vec![argmax(&p.model.prefill(&prompt, &PrefillOptions::chunked(16)).unwrap()).unwrap()];
    while got.len() < 16 {
        got.push(argmax(&p.model.decode(*got.last().unwrap()).unwrap()).unwrap());
    }
    assert_eq!(got, want);
    assert_eq!(p.model.position(), prompt.len() + 15);
}
