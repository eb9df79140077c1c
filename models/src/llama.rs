//! Llama (SmolLM2 and any GGUF Llama): what differs from the shared engine is only how the GGUF
//! names its tensors and metadata, tied embeddings, and the interleaved RoPE layout that GGUF's Q/K
//! weights use (llama.cpp permutes HF's rotate-half layout; `rope_i` matches it).

use std::path::Path;

use candle_npu::{NpuDevice, Result};

use crate::gguf::{Gguf, GgufColumns};
use crate::transformer::{Config, LayerWeights, LoadOptions, Model, Weights};

pub fn config(g: &Gguf) -> Result<Config> {
    let u = |k: &str| g.u32(&format!("llama.{k}")).map(|v| v as usize);
    let hidden = u("embedding_length")?;
    let n_head = u("attention.head_count")?;
    let vocab = match g.metadata().get("llama.vocab_size").and_then(|v| v.to_u32().ok()) {
        Some(v) => v as usize,
        None => g.content.tensor_infos.get("token_embd.weight").map(|t| t.shape.dims()[0]).unwrap_or(0),
    };
    Ok(Config {
        n_layer: u("block_count")?,
        hidden,
        n_head,
        n_kv_head: u("attention.head_count_kv")?,
        head_dim: u("rope.dimension_count").unwrap_or(hidden / n_head),
        ffn: u("feed_forward_length")?,
        vocab,
        rms_eps: g.f32("llama.attention.layer_norm_rms_epsilon")? as f64,
        rope_theta: g.f32("llama.rope.freq_base").unwrap_or(10_000.0),
        context_len: u("context_length")?,
    })
}

/// Load a Llama GGUF: NPU prefill on `device`, CPU decode.
pub fn load(path: &Path, device: &NpuDevice, opts: LoadOptions) -> Result<Model> {
    let g = Gguf::open(path)?;
    let arch = g.string("general.architecture")?;
    if arch != "llama" {
        return Err(candle_npu::Error::Model { path: path.to_path_buf(), reason: format!("architecture '{arch}', expected 'llama'") });
    }
    let cfg = config(&g)?;
    let embed = g.f32_tensor("token_embd.weight")?;
    let lm_head = if g.has_tensor("output.weight") { g.f32_tensor("output.weight")? } else { embed.clone() };
    let layers = (0..cfg.n_layer)
        .map(|i| {
            let t = |n: &str| g.f32_tensor(&format!("blk.{i}.{n}.weight"));
            Ok(LayerWeights {
                attn_norm: t("attn_norm")?,
                ffn_norm: t("ffn_norm")?,
                wq: t("attn_q")?,
                wk: t("attn_k")?,
                wv: t("attn_v")?,
                wo: t("attn_output")?,
                w_gate: t("ffn_gate")?,
                w_up: t("ffn_up")?,
                w_down: t("ffn_down")?,
                bq: None,
                bk: None,
                bv: None,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let final_norm = g.f32_tensor("output_norm.weight")?;
    // Cold shadow channels read their float columns from this file (see `gguf::GgufColumns`).
    let map = GgufColumns::map(&g)?;
    let columns: crate::transformer::ColumnSources =
        std::sync::Arc::new(move |linear: &str| Ok(std::sync::Arc::new(GgufColumns::new(&g, map.clone(), &format!("{linear}.weight"))?) as _));
    let weights = Weights { final_norm, embed, lm_head, layers, columns: Some(columns) };
    let id = candle_npu::quant::model_id(path)?;
    Model::new(cfg, weights, id, device.clone(), opts)
}
