//! The chat accuracy eval: how far a prefill's answers move from the F32 prefill's on chat
//! prompts in the model's own template (system prompts, several turns, languages, code), the
//! work a user's first turn is.
//!
//! Per conversation ([`CONVERSATIONS`], written for this eval, `models/data/README.md`): the
//! conversation rendered by the model's template with the generation prompt, then
//! - the KL divergence of the first answer token's distribution from the F32 prefill's;
//! - how many of the first [`ANSWER_TOKENS`] greedy tokens equal the F32 prefill's (decode runs
//!   on the CPU after either prefill, as in use);
//! - whether the answer derailed ([`Derail`]): judged against the F32 model itself, so that an
//!   answer that merely takes another good path is drift, not a derailment.
//!
//! Perplexity on plain text (the rest of the accuracy suite) cannot see this: a template's
//! control tokens and system prompt never occur in prose.

use crate::chat::Message;
use crate::generate::{GenerateOptions, Sampler};
use crate::logits::{logits_f32, mean_nll};
use crate::pipeline::Pipeline;
use crate::PrefillOptions;
use candle_npu::{Error, Result};

/// The eval's conversations, one JSON object a line: `{"id", "tags", "messages"}`; each ends
/// with a user turn, which the model answers.
pub const CONVERSATIONS: &str = include_str!("../data/chat_eval.jsonl");

/// Greedy answer tokens compared with the F32 prefill's.
pub const ANSWER_TOKENS: usize = 16;

/// An answer whose tokens average more than this many nats of surprise to the F32 model (given
/// the conversation, teacher-forced) more than the F32 model's own greedy answer does: words the
/// model itself would almost never say there (a token soup, a loop). Measured on SmolLM2's 147
/// answers that differ from F32's (2026-11-28, `docs/chat.md`): 1.06 at most, half of them at
/// or below 0. A switch of language is not caught by it (the katakana answer to "My name is
/// Bob and I live in Tokyo." is 0.51: the F32 model nearly says it too), hence [`Derail::Script`].
pub const DERAIL_NATS: f64 = 2.5;

/// One conversation of the eval.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Conversation {
    /// Unique, short.
    pub id: String,
    /// What kind it is: `system`, `multi-turn`, `long`, `code`, `non-english`, a language code, ...
    #[serde(default)]
    pub tags: Vec<String>,
    /// The turns, the last one the user's.
    pub messages: Vec<Message>,
}

/// The eval's conversations ([`CONVERSATIONS`]), checked: unique ids, each ending with a user turn.
pub fn conversations() -> Result<Vec<Conversation>> {
    let mut out: Vec<Conversation> = Vec::new();
    for (i, line) in CONVERSATIONS.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let c: Conversation = serde_json::from_str(line).map_err(|e| Error::Internal(format!("chat_eval.jsonl line {}: {e}", i + 1)))?;
        if c.messages.last().is_none_or(|m| m.role != "user") {
            return Err(Error::Internal(format!("chat_eval.jsonl line {}: conversation {} does not end with a user turn", i + 1, c.id)));
        }
        if out.iter().any(|o| o.id == c.id) {
            return Err(Error::Internal(format!("chat_eval.jsonl line {}: id {} twice", i + 1, c.id)));
        }
        out.push(c);
    }
    Ok(out)
}

/// What the F32 prefill does with a conversation: the reference of [`measure`].
#[derive(Debug, Clone)]
pub struct Reference {
    /// The rendered conversation's tokens.
    pub prompt: Vec<u32>,
    /// Log-probabilities of the first answer token.
    pub first: Vec<f64>,
    /// The greedy answer (up to [`ANSWER_TOKENS`], ending early at a stop token).
    pub answer: Vec<u32>,
    /// Its mean surprise (nats/token) to the F32 model: measured when a compared answer differs.
    answer_nats: std::cell::OnceCell<f64>,
}

/// How a prefill's answer to a conversation compares with the F32 prefill's.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Outcome {
    /// KL(F32 || this) of the first answer token, nats.
    pub kl: f64,
    /// Leading answer tokens equal to the F32 prefill's.
    pub agree: usize,
    /// Whether the whole answer (all [`ANSWER_TOKENS`], or up to the F32 answer's stop token)
    /// equals the F32 prefill's.
    pub same: bool,
    /// The answer's mean surprise to the F32 model minus the F32 answer's own (nats/token).
    pub excess_nats: f64,
    /// `Some` when the answer derailed.
    pub derail: Option<Derail>,
    /// The answer's tokens.
    pub answer: Vec<u32>,
}

/// Why an answer counts as derailed.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum Derail {
    /// The F32 model finds the answer [`DERAIL_NATS`] nats a token more surprising than its own.
    Surprise {
        /// The excess, nats per token.
        excess_nats: f64,
    },
    /// The answer writes a script that neither the conversation nor the F32 answer has (e.g.
    /// katakana in an English chat).
    Script {
        /// The script's name.
        script: &'static str,
    },
}

/// The F32 prefill's first-token distribution and greedy answer for `conv` (`f32` is a pipeline
/// loaded with [`crate::Precision::F32`]).
pub fn reference(f32: &mut Pipeline, conv: &Conversation) -> Result<Reference> {
    let prompt = f32.encode_chat(&conv.messages, true, false)?;
    let (first, answer) = answer(f32, &prompt)?;
    Ok(Reference { prompt, first: log_softmax(&first), answer, answer_nats: Default::default() })
}

/// `p`'s answer to the reference's prompt against the F32 prefill's; `f32` judges a different
/// answer (its surprise).
pub fn measure(p: &mut Pipeline, f32: &mut Pipeline, r: &Reference) -> Result<Outcome> {
    let (first, answer) = self::answer(p, &r.prompt)?;
    let lq = log_softmax(&first);
    let kl = kl_of(&r.first, &lq);
    let agree = r.answer.iter().zip(&answer).take_while(|(a, b)| a == b).count();
    let same = answer == r.answer;
    let (excess_nats, derail) = match same {
        true => (0.0, None),
        false => {
            let own = match r.answer_nats.get() {
                Some(&v) => v,
                None => {
                    let v = surprise(f32, &r.prompt, &r.answer)?;
                    r.answer_nats.get_or_init(|| v);
                    v
                }
            };
            let excess = surprise(f32, &r.prompt, &answer)? - own;
            let known = |ids: &[u32]| f32.decode_text(ids);
            let context = format!("{}{}", known(&r.prompt)?, known(&r.answer)?);
            let derail = match new_script(&context, &known(&answer)?) {
                Some(script) => Some(Derail::Script { script }),
                None if excess > DERAIL_NATS => Some(Derail::Surprise { excess_nats: excess }),
                None => None,
            };
            (excess, derail)
        }
    };
    Ok(Outcome { kl, agree, same, excess_nats, derail, answer })
}

/// The first answer token's logits and the greedy answer of `p` to `prompt` (up to
/// [`ANSWER_TOKENS`], ending at a stop token): prefill on the model's device in its chunk length,
/// decode on the CPU, tokens without text never picked (as generation does).
pub fn answer(p: &mut Pipeline, prompt: &[u32]) -> Result<(Vec<f32>, Vec<u32>)> {
    p.model.clear();
    let mut logits = p.model.prefill(prompt, &PrefillOptions::default())?;
    let first = logits_f32(&logits)?;
    let greedy = GenerateOptions::default();
    let mut sampler = Sampler::new(&greedy);
    let mut out = Vec::with_capacity(ANSWER_TOKENS);
    while out.len() < ANSWER_TOKENS {
        let t = sampler.next(&logits, &[], &p.textless, &greedy)?;
        out.push(t);
        if p.stop_tokens.contains(&t) || out.len() == ANSWER_TOKENS || p.model.position() + 1 >= p.model.config().context_len {
            break;
        }
        logits = p.model.decode(t)?;
    }
    p.model.clear();
    Ok((first, out))
}

/// Mean negative log-likelihood (nats/token) of `answer` after `prompt` under `p`'s prefill.
fn surprise(p: &mut Pipeline, prompt: &[u32], answer: &[u32]) -> Result<f64> {
    let all: Vec<u32> = prompt.iter().chain(answer).copied().collect();
    let logits = p.model.prefill(&all, &PrefillOptions::default().all_logits())?;
    p.model.clear();
    // The rows that predict the answer, from the prompt's last token on.
    let at = prompt.len() - 1;
    mean_nll(&logits.narrow(0, at, answer.len())?, &all[at..])
}

/// KL(p || q), nats, of the distributions two logit rows give.
pub fn kl(p: &[f32], q: &[f32]) -> f64 {
    kl_of(&log_softmax(p), &log_softmax(q))
}

/// KL(p || q) from log-probabilities; tokens one side rules out (masked) count nothing.
fn kl_of(lp: &[f64], lq: &[f64]) -> f64 {
    lp.iter().zip(lq).map(|(a, b)| a.exp() * (a - b)).filter(|v| v.is_finite()).sum()
}

fn log_softmax(v: &[f32]) -> Vec<f64> {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let s = v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    v.iter().map(|&x| x as f64 - m - s).collect()
}

/// Writing systems a derailed answer shows up in: (name, Unicode ranges).
const SCRIPTS: &[(&str, &[(char, char)])] = &[
    ("Latin", &[('A', 'Z'), ('a', 'z'), ('\u{c0}', '\u{24f}')]),
    ("Cyrillic", &[('\u{400}', '\u{4ff}')]),
    ("Greek", &[('\u{370}', '\u{3ff}')]),
    ("Arabic", &[('\u{600}', '\u{6ff}')]),
    ("Hebrew", &[('\u{590}', '\u{5ff}')]),
    ("Devanagari", &[('\u{900}', '\u{97f}')]),
    ("Thai", &[('\u{e00}', '\u{e7f}')]),
    ("Hangul", &[('\u{ac00}', '\u{d7af}'), ('\u{1100}', '\u{11ff}'), ('\u{3130}', '\u{318f}')]),
    ("Kana", &[('\u{3040}', '\u{30ff}'), ('\u{ff66}', '\u{ff9f}')]),
    ("Han", &[('\u{4e00}', '\u{9fff}'), ('\u{3400}', '\u{4dbf}')]),
];

fn script_of(c: char) -> Option<&'static str> {
    SCRIPTS.iter().find(|(_, ranges)| ranges.iter().any(|&(a, b)| (a..=b).contains(&c))).map(|(name, _)| *name)
}

/// The first script `answer` writes that `context` never does (Kana and Han count as one: a
/// Japanese answer to a Chinese question is not another script).
fn new_script(context: &str, answer: &str) -> Option<&'static str> {
    fn same(s: &'static str) -> &'static str {
        if s == "Kana" {
            "Han"
        } else {
            s
        }
    }
    let known: std::collections::HashSet<&str> = context.chars().filter_map(script_of).map(same).collect();
    answer.chars().filter_map(script_of).find(|&s| !known.contains(same(s)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_conversations_parse_and_cover_the_kinds_the_eval_promises() {
        let c = conversations().unwrap();
        assert!(c.len() >= 200, "{} conversations", c.len());
        let with = |tag: &str| c.iter().filter(|c| c.tags.iter().any(|t| t == tag)).count();
        for tag in ["system", "multi-turn", "long", "code", "non-english"] {
            assert!(with(tag) >= 10, "only {} conversations tagged {tag}", with(tag));
        }
        assert!(c.iter().any(|c| c.messages.iter().any(|m| m.content == "My name is Bob and I live in Tokyo.")), "the issue's example");
    }

    #[test]
    fn a_new_script_is_one_the_context_never_writes() {
        assert_eq!(new_script("My name is Bob and I live in Tokyo.", "アニュゲッラ"), Some("Kana"));
        assert_eq!(new_script("Traduis en français : hello", "Bonjour à tous"), None);
        assert_eq!(new_script("日本の首都はどこですか", "東京です"), None, "Kana and Han are one");
        assert_eq!(new_script("Say hi", "Привет"), Some("Cyrillic"));
        assert_eq!(new_script("Say hi", "Hi! 123 :)"), None, "digits and punctuation are no script");
    }
}
