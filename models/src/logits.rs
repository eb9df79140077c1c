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

/// Top-1 token of one row of logits: the index candle's `argmax` gives (the first of the
/// largest values; NaNs never win, except a NaN first value, which candle's scan never replaces).
///
/// Why not candle's own: its scan compares and branches value by value, 42 us for SmolLM2's
/// 49,152 logits where this takes 9.2 (`cargo bench --bench prefill -- sampling`, 2026-12-03):
/// a server's greedy step pays it per conversation (0.7% of a one-row decode step, 1.5% of a
/// four-row one). An f32 row is read here in place, in lanes.
pub fn argmax(logits: &Tensor) -> Result<u32> {
    let (storage, layout) = logits.storage_and_layout();
    if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), 1, Some((start, end))) = (&*storage, logits.rank(), layout.contiguous_offsets()) {
        if let Some(i) = first_max(&v[start..end]) {
            return Ok(i as u32);
        }
    }
    Ok(logits.argmax(candle_core::D::Minus1)?.to_scalar::<u32>()?)
}

/// The index of `v`'s largest value as candle's scan finds it (see [`argmax`]); `None` when `v`
/// is empty. Two passes in 16 lanes (one pass keeping each lane's index measured 2.7x slower:
/// it does not vectorize): the largest value (`x > m` keeps `m` for a NaN `x`, a select the
/// compiler makes one vector max), then the first block of 16 holding it.
fn first_max(v: &[f32]) -> Option<usize> {
    const LANES: usize = 16;
    let first = *v.first()?;
    if first.is_nan() {
        return Some(0);
    }
    let mut m = [first; LANES];
    let chunks = v.chunks_exact(LANES);
    for &x in chunks.remainder() {
        m[0] = if x > m[0] { x } else { m[0] };
    }
    for c in chunks {
        for (m, &x) in m.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    let max = m.iter().fold(first, |a, &b| if b > a { b } else { a });
    // The first equal value (0.0 and -0.0 are equal here, as under candle's `<`).
    let block = v.chunks_exact(LANES).position(|c| c.iter().fold(false, |any, &x| any | (x == max))).unwrap_or(v.len() / LANES);
    Some(block * LANES + v[block * LANES..].iter().position(|&x| x == max)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Against candle's own scan on rows built to trip it: ties (first of equals wins), NaNs
    /// (first or among the rest), infinities, signed zeros, all-equal rows, every length around
    /// the lanes, and SmolLM2's vocabulary.
    #[test]
    fn argmax_is_candle_s_on_ties_nans_infinities_and_signed_zeros() {
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1.0, -1.0];
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut rows: Vec<Vec<f32>> = vec![vec![f32::NAN; 40], vec![f32::NEG_INFINITY; 33], vec![-0.0, 0.0, 0.0], vec![0.0, -0.0]];
        for len in (1..=70).chain([49152]) {
            for _ in 0..20 {
                // Few distinct values, so that the largest is often tied.
                let distinct = 1 + next() % 4;
                rows.push((0..len).map(|_| if next() % 9 == 0 { specials[next() as usize % specials.len()] } else { (next() % distinct) as f32 }).collect());
            }
        }
        for v in rows {
            let t = Tensor::new(v.as_slice(), &Device::Cpu).unwrap();
            let candle = t.argmax(candle_core::D::Minus1).unwrap().to_scalar::<u32>().unwrap();
            assert_eq!(argmax(&t).unwrap(), candle, "{v:?}");
            // A row viewed inside a larger tensor is read at its own offset.
            let two = Tensor::stack(&[&t, &t], 0).unwrap();
            assert_eq!(argmax(&two.get(1).unwrap()).unwrap(), candle);
        }
    }
}
