//! Tokenizer from a GGUF file's own metadata (GPT-2 style byte-level BPE, as SmolLM2 ships), so
//! a single GGUF is all a user needs; a `tokenizer.json` can be used instead.

use std::path::Path;

use candle_npu::{Error, Result};
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::{byte_level::ByteLevel, digits::Digits, sequence::Sequence};
use tokenizers::{AddedToken, Tokenizer};

use crate::gguf::Gguf;

/// GGUF token type of control tokens (`<|im_start|>`, ...), which must match as single tokens.
const TOKEN_TYPE_CONTROL: i32 = 3;

pub fn from_gguf(g: &Gguf) -> Result<Tokenizer> {
    let bad = |reason: String| Error::Model { path: g.path.clone(), reason };
    let model = g.string("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(bad(format!(
            "tokenizer model '{model}' cannot be built from GGUF metadata here (only 'gpt2' BPE): pass --tokenizer tokenizer.json"
        )));
    }
    let strings = |key: &str| -> Result<Vec<String>> {
        let v = g.metadata().get(key).ok_or_else(|| bad(format!("missing metadata key '{key}'")))?;
        let arr = v.to_vec().map_err(|e| bad(format!("{key}: {e}")))?;
        arr.iter().map(|s| s.to_string().cloned().map_err(|e| bad(format!("{key}: {e}")))).collect()
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges: Vec<(String, String)> = strings("tokenizer.ggml.merges")?
        .into_iter()
        .filter_map(|m| m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())))
        .collect();
    let vocab: ahash::AHashMap<String, u32> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| bad(format!("BPE: {e}")))?;
    let mut tok = Tokenizer::new(bpe);
    // SmolLM2's pre-tokenizer ("smollm" in llama.cpp): split digits, then GPT-2 byte level.
    tok.with_pre_tokenizer(Some(Sequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()])));
    tok.with_decoder(Some(ByteLevel::default()));
    if let Some(types) = g.metadata().get("tokenizer.ggml.token_type").and_then(|v| v.to_vec().ok()) {
        let special: Vec<AddedToken> = types
            .iter()
            .zip(&tokens)
            .filter(|(t, _)| t.to_i32().is_ok_and(|t| t == TOKEN_TYPE_CONTROL))
            .map(|(_, s)| AddedToken::from(s.clone(), true))
            .collect();
        tok.add_special_tokens(&special);
    }
    Ok(tok)
}

pub fn from_file(path: &Path) -> Result<Tokenizer> {
    Tokenizer::from_file(path).map_err(|e| Error::Model { path: path.to_path_buf(), reason: format!("tokenizer: {e}") })
}
