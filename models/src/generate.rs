//! Text generation on a [`Pipeline`]: candle's `LogitsProcessor` sampling, the model's stop
//! tokens, streamed text and the run's statistics ([`Pipeline::generate`], a one-turn
//! [`crate::Session`]).

use std::time::Duration;

use candle_core::Tensor;
use candle_npu::{Error, Result};
use candle_transformers::generation::{LogitsProcessor, Sampling};

use crate::logits::{argmax, logits_f32};
use crate::pipeline::Pipeline;
use crate::speculative::{SpeculationStats, Speculative};

/// How [`Pipeline::generate`] and [`crate::Session::send`] sample, as candle's examples do.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Tokens to generate at most (the answer may stop earlier, at a stop token).
    pub sample_len: usize,
    /// Sampling temperature; greedy (argmax) when `None` or 0.
    pub temperature: Option<f64>,
    /// Nucleus sampling: the smallest set of tokens holding this probability (with a temperature).
    pub top_p: Option<f64>,
    /// Only the `k` most likely tokens (with a temperature; with `top_p` too, top-k first).
    pub top_k: Option<usize>,
    /// Seed of the sampler's random numbers (unused when greedy).
    pub seed: u64,
    /// Penalty on the logits of tokens among the last `repeat_last_n` of the conversation; 1.0
    /// (the default) is none.
    pub repeat_penalty: f32,
    /// How many of the conversation's last tokens the repeat penalty applies to.
    pub repeat_last_n: usize,
    /// Control tokens spelled in the prompt (`<|im_end|>`, `<start_of_turn>`) become those
    /// tokens, as llama.cpp's `parse_special`. Off by default: a prompt is the user's text, and
    /// with it on a prompt can close its turn and write the assistant's.
    pub parse_special: bool,
    /// Tokens proposed and verified several per pass ([`crate::speculative`]); verified on the
    /// CPU (the default), the output is the same, token for token, greedy or sampled. Off by
    /// default.
    pub speculative: Speculative,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            sample_len: 256,
            temperature: None,
            top_p: None,
            top_k: None,
            seed: 299792458,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            parse_special: false,
            speculative: Speculative::Off,
        }
    }
}

impl GenerateOptions {
    /// Checks the values (ranges as candle's examples take them), before any work.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::Input(what));
        if self.temperature.is_some_and(|t| !(t >= 0.0 && t.is_finite())) {
            return bad(format!("temperature {:?}: expected a finite value >= 0", self.temperature));
        }
        // candle's sampler compares in f32: a top-p that rounds to 0 there keeps no token.
        if self.top_p.is_some_and(|p| !(p as f32 > 0.0 && p <= 1.0)) {
            return bad(format!("top-p {:?}: expected a share in (0, 1], at least {:e}", self.top_p, f32::MIN_POSITIVE));
        }
        if self.top_k == Some(0) {
            return bad("top-k 0: expected at least 1".into());
        }
        // Logits are divided or multiplied by it: a penalty near 0 or huge sends them to
        // infinity and the sampler then fails mid-generation.
        if !(REPEAT_PENALTY.contains(&self.repeat_penalty)) {
            return bad(format!("repeat penalty {}: expected {} to {}", self.repeat_penalty, REPEAT_PENALTY.start(), REPEAT_PENALTY.end()));
        }
        self.speculative.validate()
    }

    pub(crate) fn sampling(&self) -> Sampling {
        match (self.temperature.filter(|&t| t >= 1e-7), self.top_k, self.top_p) {
            (None, _, _) => Sampling::ArgMax,
            (Some(temperature), None, None) => Sampling::All { temperature },
            (Some(temperature), Some(k), None) => Sampling::TopK { k, temperature },
            (Some(temperature), None, Some(p)) => Sampling::TopP { p, temperature },
            (Some(temperature), Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
        }
    }
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The model gave one of its stop tokens (EOS, end of turn).
    StopToken,
    /// [`GenerateOptions::sample_len`] tokens were generated.
    SampleLen,
    /// The model's context is full.
    ContextFull,
}

/// What one generation did, and how fast.
#[derive(Debug, Clone)]
pub struct GenerateStats {
    /// Tokens prefilled for this answer (a session's turn: its own new tokens only).
    pub prompt_tokens: usize,
    /// Tokens the KV cache held before (earlier turns).
    pub cached_tokens: usize,
    /// Prefill time: from the call to the logits of the last prompt token.
    pub prefill: Duration,
    /// Time to first token: the prefill and the first token's sampling.
    pub ttft: Duration,
    /// Tokens generated, the stop token excluded.
    pub generated_tokens: usize,
    /// Time of the decode steps after the first token.
    pub decode: Duration,
    /// Why generation stopped.
    pub stop: StopReason,
    /// Speculative decoding's passes, proposed and accepted tokens (zeros when off).
    pub speculation: SpeculationStats,
}

impl GenerateStats {
    /// Prefill speed: this answer's prompt tokens over the prefill time.
    pub fn prefill_tokens_per_sec(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill.as_secs_f64().max(1e-9)
    }
    /// Decode speed over the tokens after the first.
    pub fn decode_tokens_per_sec(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode.as_secs_f64().max(1e-9)
    }
}

impl Pipeline {
    /// Answers `prompt` (in the model's chat template, when it has one) from an empty KV cache:
    /// prefill on the model's device, then decode on the CPU, sampling with candle's
    /// `LogitsProcessor`, until a stop token, `sample_len` tokens or the end of the context.
    /// `on_text` gets the text as it comes, never a split character. Returns the answer.
    pub fn generate(&self, prompt: &str, opts: &GenerateOptions, on_text: impl FnMut(&str)) -> Result<(String, GenerateStats)> {
        self.session().send(self, prompt, opts, on_text)
    }
}

/// A conversation's sampler: candle's `LogitsProcessor` with its seed, over [`penalized`]
/// logits. One for [`Pipeline::generate`] (its session loop) and the server's engine
/// (`crate::serve`), so that the two answer token for token alike.
pub(crate) struct Sampler {
    greedy: bool,
    candle: LogitsProcessor,
}

impl Sampler {
    pub(crate) fn new(opts: &GenerateOptions) -> Sampler {
        let sampling = opts.sampling();
        Sampler { greedy: matches!(sampling, Sampling::ArgMax), candle: LogitsProcessor::from_sampling(opts.seed, sampling) }
    }

    /// The next token after `tokens` (the prompt and the answer so far) from `logits`. Greedy
    /// takes [`argmax`], which is candle's argmax read in place (its sampler draws no random
    /// number there, so nothing else changes).
    pub(crate) fn next(&mut self, logits: &Tensor, tokens: &[u32], textless: &[u32], opts: &GenerateOptions) -> Result<u32> {
        let logits = penalized(logits, tokens, textless, opts)?;
        if self.greedy {
            return argmax(&logits);
        }
        Ok(self.candle.sample(&logits)?)
    }
}

/// `logits` with the repeat penalty over the conversation's last tokens, and the ids without
/// text (`textless`: padding rows of the embedding) at minus infinity, so no sampler picks one.
pub(crate) fn penalized(logits: &Tensor, tokens: &[u32], textless: &[u32], opts: &GenerateOptions) -> Result<Tensor> {
    let mut logits = logits.clone();
    if opts.repeat_penalty != 1.0 {
        let last = &tokens[tokens.len().saturating_sub(opts.repeat_last_n)..];
        logits = candle_transformers::utils::apply_repeat_penalty(&logits, opts.repeat_penalty, last)?;
    }
    if textless.is_empty() {
        return Ok(logits);
    }
    let mut v = logits_f32(&logits)?;
    for &i in textless {
        if let Some(l) = v.get_mut(i as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
    Ok(Tensor::from_vec(v, logits.shape(), logits.device())?)
}

/// The repeat penalties accepted: 1 is none, and 1.1-1.5 the usual.
const REPEAT_PENALTY: std::ops::RangeInclusive<f32> = 0.01..=100.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeat_penalty_that_would_send_logits_to_infinity_is_refused() {
        let opts = |repeat_penalty| GenerateOptions { repeat_penalty, ..Default::default() };
        for p in [1e-40, 0.0, -1.0, 1e30, f32::NAN, f32::INFINITY] {
            let e = opts(p).validate().unwrap_err().to_string();
            assert!(e.contains("repeat penalty") && e.contains("0.01 to 100"), "{p}: {e}");
        }
        for p in [0.01, 1.0, 1.3, 100.0] {
            assert!(opts(p).validate().is_ok(), "{p}");
        }
    }

    #[test]
    fn a_top_p_that_keeps_no_token_in_candle_s_f32_sampler_is_refused() {
        let opts = |p| GenerateOptions { temperature: Some(1.0), top_p: Some(p), ..Default::default() };
        let e = opts(1e-50).validate().unwrap_err().to_string();
        assert!(e.contains("top-p"), "{e}");
        assert!(opts(1e-30).validate().is_ok());
    }

    #[test]
    fn ids_without_text_are_never_picked() {
        let logits = Tensor::new(&[0.0f32, 5.0, 1.0, 9.0], &candle_core::Device::Cpu).unwrap();
        let opts = GenerateOptions::default();
        assert_eq!(argmax(&penalized(&logits, &[], &[], &opts).unwrap()).unwrap(), 3);
        let masked = penalized(&logits, &[], &[3], &opts).unwrap();
        assert_eq!(argmax(&masked).unwrap(), 1);
        assert_eq!(logits_f32(&masked).unwrap()[3], f32::NEG_INFINITY);
    }
}
