//! Tokenizer from a GGUF file's own metadata, so a single GGUF is all a user needs; a
//! `tokenizer.json` can be used instead ([`from_file`]).
//!
//! The reference is llama.cpp: a tokenizer built here must give the ids `llama-tokenize` gives
//! for the same file (tests/tokenizer.rs checks this on every real model `scripts/setup.sh` fetches). Two GGUF
//! tokenizer models are understood:
//!
//! - `tokenizer.ggml.model = "gpt2"`: GPT-2 byte-level BPE with the file's merge list, after the
//!   regex split that `tokenizer.ggml.pre` names (`smollm`: SmolLM2; `qwen2`: Qwen2 / Qwen2.5).
//! - `tokenizer.ggml.model = "llama"`: SentencePiece BPE (Llama 2, Gemma, Mistral v0.1). The
//!   file has no merge list, only a score per piece: SentencePiece merges, among adjacent pieces,
//!   the pair whose concatenation is the highest-scoring piece. That is the same as a BPE whose
//!   merge ranks follow those scores, which is how it is built here (`score_merges`). Spaces
//!   become `▁`, characters outside the vocabulary fall back to `<0xNN>` byte pieces.
//!
//! In both, control tokens (`<|im_start|>`, `<start_of_turn>`, ...) and user-defined tokens (Gemma's
//! runs of newlines, HTML tags) are matched as whole tokens in the raw text before anything else,
//! as llama.cpp does. In a user's text control tokens are plain text unless the caller asks
//! ([`encode_user`], llama.cpp's `parse_special`): only the chat template's markers are control
//! tokens, so a prompt cannot forge turns of the conversation. Whether BOS/EOS are added follows `tokenizer.ggml.add_bos_token` /
//! `add_eos_token` (llama.cpp's defaults when a key is absent: BOS for SentencePiece, nothing for
//! GPT-2 BPE); they are added by the tokenizer's post-processor, i.e. only when a caller asks for
//! special tokens: `tokenizer.encode(text, true)` or [`encode`]`(tok, text, true)`.

use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use candle_npu::{Error, Result};
use tokenizers::decoders::{byte_fallback::ByteFallback, fuse::Fuse, sequence::Sequence as DecoderSequence, strip::Strip};
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::{byte_level::ByteLevel, digits::Digits, sequence::Sequence as PreSequence};
use tokenizers::processors::template::{SpecialToken, TemplateProcessing};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::gguf::Gguf;

/// GGUF token types (llama.cpp's `llama_token_type`), from `tokenizer.ggml.token_type`.
const TOKEN_TYPE_NORMAL: i32 = 1;
/// `<|im_start|>`, `<bos>`, ...: matched as single special tokens.
const TOKEN_TYPE_CONTROL: i32 = 3;
/// Pieces the model's authors added (Gemma: `\n\n`, `<table>`, runs of spaces): matched as single
/// tokens in the raw text, but not special (kept when decoding skips special tokens).
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// SentencePiece's stand-in for a space.
const SPM_SPACE: &str = "\u{2581}";

/// Qwen2's pre-tokenizer split (from its `tokenizer.json`), with the case-insensitive
/// contractions spelled out as llama.cpp does, so Unicode case folding cannot widen them.
const QWEN2_SPLIT: &str =
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Which tokenizer a GGUF's `tokenizer.ggml.model` / `tokenizer.ggml.pre` describe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// SentencePiece BPE with scores and byte fallback (`llama`; the pre-tokenizer is unused).
    SentencePiece,
    /// GPT-2 byte-level BPE (`gpt2`) after the split `tokenizer.ggml.pre` names.
    ByteLevel(PreSplit),
}

/// How a GPT-2 BPE model cuts text into words before BPE (llama.cpp's pre-tokenizer types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreSplit {
    /// `smollm`: digits one by one, then GPT-2's own regex.
    SmolLm,
    /// `qwen2`: Qwen2's regex (letters with one leading non-letter, single digits, ...).
    Qwen2,
}

impl Kind {
    /// The kind for a GGUF's tokenizer keys, or a message saying what is not supported.
    pub fn from_names(model: &str, pre: Option<&str>) -> std::result::Result<Kind, String> {
        match (model, pre) {
            ("llama", _) => Ok(Kind::SentencePiece),
            ("gpt2", Some("smollm")) => Ok(Kind::ByteLevel(PreSplit::SmolLm)),
            ("gpt2", Some("qwen2")) => Ok(Kind::ByteLevel(PreSplit::Qwen2)),
            _ => Err(format!(
                "tokenizer model '{model}' with pre-tokenizer '{}' cannot be built from GGUF metadata here \
                 (supported: 'llama' SentencePiece; 'gpt2' with pre-tokenizer 'smollm' or 'qwen2'): \
                 pass --tokenizer tokenizer.json",
                pre.unwrap_or("(none)")
            )),
        }
    }
}

/// The tokenizer a GGUF describes (see the module docs for what is supported and how).
pub fn from_gguf(g: &Gguf) -> Result<Tokenizer> {
    let md = Metadata { g };
    let model = md
        .opt_string("tokenizer.ggml.model")?
        .ok_or_else(|| md.bad("no tokenizer in the file (missing metadata key 'tokenizer.ggml.model'): pass --tokenizer tokenizer.json".into()))?;
    let pre = md.opt_string("tokenizer.ggml.pre")?;
    let kind = Kind::from_names(&model, pre.as_deref()).map_err(|r| md.bad(r))?;
    let tokens = md.strings("tokenizer.ggml.tokens")?;
    let types = md.token_types(tokens.len())?;
    let mut tok = match kind {
        Kind::SentencePiece => sentencepiece(&md, &tokens, &types)?,
        Kind::ByteLevel(split) => byte_level(&md, &tokens, split)?,
    };
    add_vocab_specials(&mut tok, &tokens, &types);
    let defaults_bos = kind == Kind::SentencePiece;
    let add_bos = md.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(defaults_bos);
    let add_eos = md.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let bos = if add_bos { Some(md.token_at("tokenizer.ggml.bos_token_id", &tokens)?) } else { None };
    let eos = if add_eos { Some(md.token_at("tokenizer.ggml.eos_token_id", &tokens)?) } else { None };
    if let Some(p) = bos_eos_processor(bos, eos).map_err(|e| md.bad(format!("BOS/EOS post-processor: {e}")))? {
        tok.with_post_processor(Some(p));
    }
    Ok(tok)
}

/// A Hugging Face `tokenizer.json`: an HF folder's tokenizer, or one given in place of a GGUF's own.
///
/// Read by `tokenizers` under `guarded` (a charsmap or a decoder it cannot take panics in it),
/// then tried once (`check_usable`): what would fail on every prompt fails here, naming the file.
pub fn from_file(path: &Path) -> Result<Tokenizer> {
    // The largest published ones (Gemma 3's 262K tokens with their merges) are ~33 MB.
    const TOKENIZER_LIMIT: u64 = 128 * candle_npu::fs::MIB;
    let bytes = candle_npu::fs::read_bounded(path, TOKENIZER_LIMIT, "tokenizer")?;
    let bad = |reason: String| Error::Model { path: path.to_path_buf(), reason: format!("tokenizer: {reason}") };
    let tok = guarded(|| Tokenizer::from_bytes(bytes)).map_err(bad)?;
    check_usable(&tok).map_err(bad)?;
    Ok(tok)
}

/// A call into `tokenizers` (and the regex engines under it), with a panic in it turned into an
/// error: some `tokenizer.json` contents make it panic rather than fail (a precompiled charsmap
/// that does not parse, a post-processor naming a token it lacks, a split regex that runs out of
/// backtracking on a long input), and a file from outside must not end the process.
///
/// The panic is not printed (it is the error returned): a process-wide panic hook, installed
/// once, stays silent on a thread inside this call and hands every other panic to the hook that
/// was there before.
pub(crate) fn guarded<T, E: std::fmt::Display>(f: impl FnOnce() -> std::result::Result<T, E>) -> std::result::Result<T, String> {
    use std::cell::Cell;
    use std::sync::Once;
    thread_local!(static GUARDED: Cell<bool> = const { Cell::new(false) });
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !GUARDED.with(Cell::get) {
                previous(info)
            }
        }));
    });
    let outer = GUARDED.with(|g| g.replace(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(outer));
    match r {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(p) => {
            let msg = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default();
            Err(format!("the tokenizers library failed (panicked: {msg})"))
        }
    }
}

/// The text a loaded tokenizer is tried on: letters, punctuation, digits and a space.
const PROBE: &str = "Hello, world! 123";

/// Why a tokenizer would fail on every prompt, if it would: its model's unknown token missing
/// from its vocabulary (each character outside it then fails), an encoding of [`PROBE`] (with
/// its BOS/EOS) that fails or keeps no text at all, or a decoding of it that fails.
fn check_usable(tok: &Tokenizer) -> std::result::Result<(), String> {
    let model = serde_json::to_value(tok.get_model()).unwrap_or_default();
    if let Some(unk) = model.get("unk_token").and_then(|u| u.as_str()) {
        if tok.token_to_id(unk).is_none() {
            return Err(format!("its unknown token {unk:?} is not in its vocabulary (every text with a character outside it would fail)"));
        }
    }
    let enc = guarded(|| tok.encode(PROBE, true)).map_err(|e| format!("fails on the text {PROBE:?}: {e}"))?;
    let ids = enc.get_ids();
    if ids.iter().all(|&id| is_control(tok, id)) {
        return Err(format!("gives no token of text for {PROBE:?} (its normalizer or pre-tokenizer drops every character)"));
    }
    guarded(|| tok.decode(ids, false)).map_err(|e| format!("cannot decode what it encodes: {e}"))?;
    Ok(())
}

/// How many bytes of normalized text a byte of input can become at most, from the kinds of
/// `tok`'s normalizer (`Replace`: its replacement per byte matched; Unicode normalization: 18,
/// the longest decomposition, U+FDFA's; kinds whose growth is not known this way count as 18).
/// A prompt is bounded by this before `tokenizers` allocates its normalized copy
/// ([`crate::Pipeline`]'s prompt limit): a normalizer that expands text once made a short prompt
/// allocate gigabytes.
pub fn normalizer_growth(tok: &Tokenizer) -> f64 {
    fn growth(v: &serde_json::Value) -> f64 {
        let len = |key: &str| v.get(key).and_then(|s| s.as_str()).map_or(0, str::len) as f64;
        match v.get("type").and_then(|t| t.as_str()) {
            None => 1.0,
            Some("Sequence") => v.get("normalizers").and_then(|n| n.as_array()).map_or(1.0, |a| a.iter().map(growth).product()),
            Some("Replace") => match v.get("pattern").and_then(|p| p.get("String")).and_then(|p| p.as_str()) {
                Some(p) => (len("content") / p.len().max(1) as f64).max(1.0),
                // A regex may match one byte, or nothing (content between every two bytes).
                None => 1.0 + len("content"),
            },
            Some("Prepend") => 1.0 + len("prepend"),
            Some("Strip" | "StripAccents" | "Nmt") => 1.0,
            // Each byte becomes a character of one or two bytes.
            Some("ByteLevel") => 2.0,
            // Full case mapping: at most three bytes for one (U+0130 -> "i\u{307}").
            Some("Lowercase") => 3.0,
            Some(_) => 18.0,
        }
    }
    tok.get_normalizer().map_or(1.0, |n| growth(&serde_json::to_value(n).unwrap_or_default()))
}

/// The most bytes of text one token of `tok` stands for (its longest vocabulary entry, at
/// least 1): a prompt of more normalized bytes than `context` of these cannot fit.
pub fn max_token_bytes(tok: &Tokenizer) -> usize {
    tok.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(1)
}

/// Token ids of `text`. With `add_special`, the BOS/EOS the tokenizer's post-processor adds (for
/// a GGUF: as its `add_bos_token` / `add_eos_token` keys say, like llama.cpp; for a
/// `tokenizer.json`: its own post-processor). Control tokens in `text` always match as one token
/// (llama.cpp's `parse_special = true`): for text the program writes, such as a chat template's;
/// a user's text goes through [`encode_user`].
pub fn encode(tok: &Tokenizer, text: &str, add_special: bool) -> Result<Vec<u32>> {
    let enc = guarded(|| tok.encode(text, add_special)).map_err(|e| on_text(text, e))?;
    Ok(enc.get_ids().to_vec())
}

/// A tokenizer's failure on `text`, naming it by its size and start.
fn on_text(text: &str, e: String) -> Error {
    let start: String = text.chars().take(24).collect();
    Error::Input(format!("tokenizer, on a text of {} bytes ({start:?}...): {e}", text.len()))
}

/// Token ids of a user's `text` between the chat template's text `before` and `after` (both
/// empty without a template): [`encode_segments`] of the three, `text` untrusted.
pub fn encode_user(tok: &Tokenizer, before: &str, text: &str, after: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
    encode_segments(tok, &[(before, true), (text, parse_special), (after, true)], add_special)
}

/// Token ids of text in pieces, each `(text, trusted)`: the control tokens (`<|im_start|>`,
/// `<start_of_turn>`, ...) of trusted pieces (a chat template's text) match as one token each;
/// in untrusted ones (a user's messages) they are plain text, as llama.cpp's
/// `parse_special = false` has it (user-defined tokens, Gemma's runs of newlines, still match):
/// `<|im_end|>` typed by a user becomes `<`, `|`, `im`, ..., so a prompt cannot close its turn
/// and forge the next one. `add_special`: BOS/EOS as in [`encode`], once.
///
/// The whole text is cut at the trusted pieces' control tokens only, and what lies between two
/// of them (`user\n`, a message, ...) is tokenized as one piece, as the tokenizer itself cuts a
/// text at its control tokens: text without markers in its untrusted pieces gets the same ids
/// as [`encode`] of the pieces joined.
pub fn encode_segments(tok: &Tokenizer, segments: &[(&str, bool)], add_special: bool) -> Result<Vec<u32>> {
    let whole: String = segments.iter().map(|(t, _)| *t).collect();
    // (start, end, id) of each control token of a trusted piece, in `whole`'s offsets.
    let mut cuts: Vec<(usize, usize, u32)> = vec![];
    let mut at = 0;
    for &(text, trusted) in segments {
        if trusted && !text.is_empty() {
            let enc = guarded(|| tok.encode(text, false)).map_err(|e| on_text(text, e))?;
            for (&id, &(a, b)) in enc.get_ids().iter().zip(enc.get_offsets()) {
                if is_control(tok, id) {
                    if text.get(a..b).is_none() {
                        return Err(Error::Input("tokenizer: a control token's offsets are not within the template's text".into()));
                    }
                    cuts.push((at + a, at + b, id));
                }
            }
        }
        at += text.len();
    }
    let mut ids = vec![];
    let mut from = 0;
    for (a, b, id) in cuts.into_iter().chain([(whole.len(), whole.len(), u32::MAX)]) {
        if a > from {
            ids.extend(encode_plain(tok, &whole[from..a])?);
        }
        if id != u32::MAX {
            ids.push(id);
        }
        from = b;
    }
    let enc: tokenizers::Encoding = ids.iter().map(|&id| (id, String::new(), (0, 0), None, 0)).collect();
    Ok(guarded(|| tok.post_process(enc, None, add_special)).map_err(|e| on_text(&whole, e))?.get_ids().to_vec())
}

/// Ids of `text` with no control token matched (no BOS/EOS). Text without any (nearly all) is
/// tokenized once as it is; only text that spells one pays for a copy of the tokenizer with
/// `tokenizers`' `encode_special_tokens` switch on (it skips special added tokens when
/// splitting, as llama.cpp skips control tokens when not parsing them).
fn encode_plain(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let ids = encode(tok, text, false)?;
    if !ids.iter().any(|&id| is_control(tok, id)) {
        return Ok(ids);
    }
    let mut plain = tok.clone();
    plain.set_encode_special_tokens(true);
    encode(&plain, text, false)
}

/// A special added token: a GGUF's control tokens, a `tokenizer.json`'s `special` ones.
fn is_control(tok: &Tokenizer, id: u32) -> bool {
    let added = tok.get_added_vocabulary();
    added.simple_id_to_token(id).is_some_and(|t| added.is_special_token(&t))
}

/// GPT-2 byte-level BPE from the file's vocabulary and merge list.
fn byte_level(md: &Metadata, tokens: &[String], split: PreSplit) -> Result<Tokenizer> {
    const MERGES: &str = "tokenizer.ggml.merges";
    let merges = md.strings(MERGES)?;
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, m)| split_merge(m).ok_or_else(|| md.bad(format!("{MERGES}[{i}] = {m:?} is not \"left right\""))))
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder().vocab_and_merges(vocab(tokens), merges).build().map_err(|e| md.bad(format!("BPE: {e}")))?;
    let mut tok = Tokenizer::new(bpe);
    // The regex split comes first; byte level then only maps bytes to its printable alphabet.
    let pre = match split {
        PreSplit::SmolLm => PreSequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()]),
        PreSplit::Qwen2 => {
            let split = Split::new(SplitPattern::Regex(QWEN2_SPLIT.into()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| md.bad(format!("Qwen2 pre-tokenizer regex: {e}")))?;
            PreSequence::new(vec![split.into(), ByteLevel::new(false, false, false).into()])
        }
    };
    tok.with_pre_tokenizer(Some(pre));
    tok.with_decoder(Some(ByteLevel::default()));
    Ok(tok)
}

/// A merge-list entry "left right". The split is at the first space after the first character, as
/// in llama.cpp, so a left part that is itself a space (never in byte-level text, but possible in
/// principle) still parses.
fn split_merge(m: &str) -> Option<(String, String)> {
    let first = m.chars().next()?.len_utf8();
    let at = first + m[first..].find(' ')?;
    Some((m[..at].to_string(), m[at + 1..].to_string()))
}

fn vocab(tokens: &[String]) -> ahash::AHashMap<String, u32> {
    tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect()
}

/// SentencePiece BPE: merges ranked by the scores, byte fallback, `▁` for spaces.
fn sentencepiece(md: &Metadata, tokens: &[String], types: &[i32]) -> Result<Tokenizer> {
    let scores = md.f32s("tokenizer.ggml.scores")?;
    if scores.len() != tokens.len() {
        return Err(md.bad(format!("tokenizer.ggml.scores has {} entries for {} tokens", scores.len(), tokens.len())));
    }
    let vocab = vocab(tokens);
    let merges = score_merges(tokens, types, &scores, &vocab);
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).fuse_unk(true);
    if let Some(unk) = md.opt_u32("tokenizer.ggml.unknown_token_id")?.and_then(|i| tokens.get(i as usize)) {
        builder = builder.unk_token(unk.clone());
    }
    let bpe = builder.build().map_err(|e| md.bad(format!("SentencePiece BPE: {e}")))?;
    let mut tok = Tokenizer::new(bpe);
    // llama.cpp's `add_space_prefix`: a space before the text (Llama 2 yes, Gemma no).
    let prefix = md.opt_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
    let replace = |from: &str, to: &str| Replace::new(from, to).map_err(|e| md.bad(format!("normalizer: {e}")));
    let mut norm = Vec::new();
    let mut dec = vec![replace(SPM_SPACE, " ")?.into(), ByteFallback::new().into(), Fuse::new().into()];
    if prefix {
        norm.push(Prepend::new(SPM_SPACE.to_string()).into());
        dec.push(Strip::new(' ', 1, 0).into());
    }
    norm.push(replace(" ", SPM_SPACE)?.into());
    tok.with_normalizer(Some(NormalizerSequence::new(norm)));
    tok.with_decoder(Some(DecoderSequence::new(dec)));
    Ok(tok)
}

/// Every way to build a normal piece from two vocabulary pieces, ranked by that piece's score
/// (highest first). SentencePiece (and llama.cpp's SPM tokenizer) merge the adjacent pair whose
/// concatenation scores highest, so a BPE with these ranks merges in the same order. Only normal
/// pieces are merge results: byte, control and user-defined pieces are never built from text
/// (the latter two are matched whole before the model runs). llama.cpp would also build them
/// (a literal `<0x41>` in the text becomes byte piece 0x41 there); SentencePiece does not.
fn score_merges(tokens: &[String], types: &[i32], scores: &[f32], vocab: &ahash::AHashMap<String, u32>) -> Vec<(String, String)> {
    let mut ranked: Vec<(f32, u32, &str, &str)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if types[id] != TOKEN_TYPE_NORMAL {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if vocab.contains_key(l) && vocab.contains_key(r) {
                ranked.push((scores[id], id as u32, l, r));
            }
        }
    }
    // Equal scores (rare) fall back to the lower id, SentencePiece's own order of pieces.
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    ranked.into_iter().map(|(_, _, l, r)| (l.to_string(), r.to_string())).collect()
}

/// Control and user-defined tokens match whole in the raw text, before normalization and the
/// model: `<|im_start|>` must never be split into `<`, `|`, ... by BPE.
fn add_vocab_specials(tok: &mut Tokenizer, tokens: &[String], types: &[i32]) {
    let whole = |ty: i32, special: bool| -> Vec<AddedToken> {
        let matching = tokens.iter().zip(types).filter(|&(_, &t)| t == ty);
        matching.map(|(s, _)| AddedToken::from(s.clone(), special).normalized(false)).collect()
    };
    tok.add_special_tokens(&whole(TOKEN_TYPE_CONTROL, true));
    tok.add_tokens(&whole(TOKEN_TYPE_USER_DEFINED, false));
}

/// A post-processor adding `bos` before / `eos` after the text, or `None` when neither is added.
fn bos_eos_processor(bos: Option<(String, u32)>, eos: Option<(String, u32)>) -> std::result::Result<Option<TemplateProcessing>, String> {
    if bos.is_none() && eos.is_none() {
        return Ok(None);
    }
    // Template pieces name special tokens by label; the labels are ours, so a token text with
    // spaces or colons cannot break the template syntax.
    let mut specials = Vec::new();
    let (mut single, mut second) = (vec!["$A:0"], vec!["$B:1"]);
    if let Some((text, id)) = bos {
        specials.push(SpecialToken::new("bos".into(), vec![id], vec![text]).map_err(|e| e.to_string())?);
        single.insert(0, "bos:0");
        second.insert(0, "bos:1");
    }
    if let Some((text, id)) = eos {
        specials.push(SpecialToken::new("eos".into(), vec![id], vec![text]).map_err(|e| e.to_string())?);
        single.push("eos:0");
        second.push("eos:1");
    }
    let pair = [single.clone(), second].concat();
    let p = TemplateProcessing::builder().try_single(single)?.try_pair(pair)?.special_tokens(specials).build().map_err(|e| e.to_string())?;
    Ok(Some(p))
}

/// Typed reads of the tokenizer keys, each failure an error naming the file and the key.
struct Metadata<'a> {
    g: &'a Gguf,
}

impl Metadata<'_> {
    fn bad(&self, reason: String) -> Error {
        Error::Model { path: self.g.path.clone(), reason }
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.g.metadata().get(key)
    }

    fn array(&self, key: &str) -> Result<&Vec<Value>> {
        let v = self.get(key).ok_or_else(|| self.bad(format!("missing metadata key '{key}'")))?;
        v.to_vec().map_err(|e| self.bad(format!("{key}: {e}")))
    }

    fn strings(&self, key: &str) -> Result<Vec<String>> {
        self.array(key)?.iter().map(|s| s.to_string().cloned().map_err(|e| self.bad(format!("{key}: {e}")))).collect()
    }

    fn f32s(&self, key: &str) -> Result<Vec<f32>> {
        self.array(key)?.iter().map(|s| s.to_f32().map_err(|e| self.bad(format!("{key}: {e}")))).collect()
    }

    /// `tokenizer.ggml.token_type`, one per token; absent means all normal (as in llama.cpp).
    fn token_types(&self, n_tokens: usize) -> Result<Vec<i32>> {
        const KEY: &str = "tokenizer.ggml.token_type";
        if self.get(KEY).is_none() {
            return Ok(vec![TOKEN_TYPE_NORMAL; n_tokens]);
        }
        let types: Vec<i32> = self.array(KEY)?.iter().map(|t| t.to_i32().map_err(|e| self.bad(format!("{KEY}: {e}")))).collect::<Result<_>>()?;
        if types.len() != n_tokens {
            return Err(self.bad(format!("{KEY} has {} entries for {n_tokens} tokens", types.len())));
        }
        Ok(types)
    }

    fn opt_string(&self, key: &str) -> Result<Option<String>> {
        self.get(key).map(|v| v.to_string().cloned().map_err(|e| self.bad(format!("{key}: {e}")))).transpose()
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key).map(|v| v.to_bool().map_err(|e| self.bad(format!("{key}: {e}")))).transpose()
    }

    fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        self.get(key).map(|v| v.to_u32().map_err(|e| self.bad(format!("{key}: {e}")))).transpose()
    }

    /// The token (text, id) a key such as `tokenizer.ggml.bos_token_id` names.
    fn token_at(&self, key: &str, tokens: &[String]) -> Result<(String, u32)> {
        let id = self.opt_u32(key)?.ok_or_else(|| self.bad(format!("missing metadata key '{key}' (the file asks for the token to be added)")))?;
        let text = tokens.get(id as usize).ok_or_else(|| self.bad(format!("{key} = {id} is beyond the {} tokens", tokens.len())))?;
        Ok((text.clone(), id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_from_names() {
        assert_eq!(Kind::from_names("llama", Some("default")), Ok(Kind::SentencePiece));
        assert_eq!(Kind::from_names("llama", None), Ok(Kind::SentencePiece));
        assert_eq!(Kind::from_names("gpt2", Some("smollm")), Ok(Kind::ByteLevel(PreSplit::SmolLm)));
        assert_eq!(Kind::from_names("gpt2", Some("qwen2")), Ok(Kind::ByteLevel(PreSplit::Qwen2)));
    }

    #[test]
    fn unknown_names_say_what_and_what_to_do() {
        let e = Kind::from_names("t5", None).unwrap_err();
        assert!(e.contains("'t5'") && e.contains("--tokenizer tokenizer.json"), "{e}");
        let e = Kind::from_names("gpt2", Some("falcon")).unwrap_err();
        assert!(e.contains("'falcon'") && e.contains("--tokenizer tokenizer.json"), "{e}");
        assert!(Kind::from_names("gpt2", None).is_err());
    }

    #[test]
    fn merge_entries_split_at_the_first_inner_space() {
        assert_eq!(split_merge("Ġ t"), Some(("Ġ".into(), "t".into())));
        assert_eq!(split_merge("  x"), Some((" ".into(), "x".into())));
        assert_eq!(split_merge("nospace"), None);
        assert_eq!(split_merge(""), None);
    }

    /// A toy SentencePiece vocabulary: "ab" outscores "bc", so "abc" must become "ab" + "c".
    #[test]
    fn score_merges_rank_by_the_merged_piece_score() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc", "<x>"].map(String::from).to_vec();
        let types = [1, 1, 1, 1, 1, 1, TOKEN_TYPE_CONTROL];
        let scores = [-1.0, -1.0, -1.0, -2.0, -3.0, -9.0, 0.0];
        let v = vocab(&tokens);
        let m = score_merges(&tokens, &types, &scores, &v);
        let pair = |l: &str, r: &str| (l.to_string(), r.to_string());
        assert_eq!(m, vec![pair("a", "b"), pair("b", "c"), pair("a", "bc"), pair("ab", "c")]);
    }

    #[test]
    fn bos_eos_templates() {
        assert!(bos_eos_processor(None, None).unwrap().is_none());
        let mut tok = Tokenizer::new(BPE::builder().vocab_and_merges(vocab(&["<s>".into(), "x".into(), "</s>".into()]), vec![]).build().unwrap());
        let p = bos_eos_processor(Some(("<s>".into(), 0)), Some(("</s>".into(), 2))).unwrap().unwrap();
        tok.with_post_processor(Some(p));
        assert_eq!(encode(&tok, "xx", true).unwrap(), vec![0, 1, 1, 2]);
        assert_eq!(encode(&tok, "xx", false).unwrap(), vec![1, 1]);
    }
}
