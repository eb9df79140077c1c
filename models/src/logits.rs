//! What is read off logits: the top token, the values as one f32 vector (as samplers take
//! them), and the mean negative log-likelihood of a text (perplexity's logarithm). Generation,
//! the evals and the tests share them.

use candle_core::Tensor;

use candle_npu::{Error, Result};

/// Mean negative log-likelihood (nats/token) of `tokens` under row-aligned logits
/// (`logits[i]` predicts `tokens[i + 1]`); `exp` of it is the perplexity.
pub fn mean_nll(logits: &Tensor, tokens: &[u32]) -> Result<f64> {
    let lp = candle_nn::ops::log_softmax(logits, candle_core::D::Minus1)?;
    let lp: Vec<Vec<f32>> = lp.to_vec2()?;
    if tokens.len() < 2 || lp.len() < tokens.len() - 1 {
        return Err(Error::Input(format!("need at least 2 tokens and one logit row per token, got {} and {}", tokens.len(), lp.len())));
    }
    let mut nll = 0f64;
    for i in 0..tokens.len() - 1 {
        let t = tokens[i + 1];
        let lp = lp[i].get(t as usize).ok_or_else(|| Error::Input(format!("token {t} is beyond the {} logits of a row", lp[i].len())))?;
        nll -= *lp as f64;
    }
    Ok(nll / (tokens.len() - 1) as f64)
}

/// The logits as one flat `Vec<f32>` (any shape, any float dtype), as samplers take them.
pub fn logits_f32(logits: &Tensor) -> Result<Vec<f32>> {
    Ok(logits.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1()?)
}

/// Top-1 token.
pub fn argmax(logits: &Tensor) -> Result<u32> {
    Ok(logits.argmax(candle_core::D::Minus1)?.to_scalar::<u32>()?)
}
