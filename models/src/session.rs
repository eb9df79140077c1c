//! A conversation on a [`Pipeline`] ([`Session`]): the KV cache keeps every earlier turn, so a
//! turn prefills only its own tokens; and a prompt's KV state saved to a file and restored
//! ([`Session::save`], [`Pipeline::restore_session`]), so that a long system prompt or document
//! is prefilled once.
//!
//! The file: 8 magic bytes, a little-endian u32 header length and the header (JSON: format,
//! model id, quant profile digest, precision, layers, KV heads, head size, tokens, pending
//! token), then each layer's keys and values ([`KvCache::write_to`]), then the SHA-256 of all
//! that. Written atomically ([`candle_npu::cache::write_atomic`]); read only up to the size its
//! header gives; refused, with the reason, for another model, profile or precision.

use std::io::{Read, Write};
use std::path::Path;
use std::time::Instant;

use candle_npu::{Error, Result};
use candle_transformers::generation::LogitsProcessor;
use sha2::{Digest, Sha256};

use crate::attention::KvCache;
use crate::generate::{penalized, GenerateOptions, GenerateStats, StopReason};
use crate::pipeline::{Pipeline, TextStream};
use crate::transformer::Model;

const MAGIC: &[u8; 8] = b"CNPU-KV\0";
const FORMAT: u32 = 1;
/// The largest key or value magnitude a restored state may hold: f16's largest finite value.
const KV_LIMIT: f32 = 65504.0;

impl Pipeline {
    /// A conversation on this pipeline, from an empty KV cache.
    pub fn session(&mut self) -> Session<'_> {
        self.model.clear();
        let epoch = self.model.kv_epoch();
        Session { p: self, tokens: vec![], pending: None, epoch }
    }

    /// The conversation saved at `path` ([`Session::save`]), its KV cache restored: the next
    /// turn prefills only its own tokens. Refused (and this pipeline's cache left as it was) for
    /// a file of other weights, another quant profile or precision, or a damaged one.
    pub fn restore_session(&mut self, path: &Path) -> Result<Session<'_>> {
        let (caches, tokens, pending) = read_state(&self.model, path)?;
        self.model.set_kv_caches(caches);
        let epoch = self.model.kv_epoch();
        Ok(Session { p: self, tokens, pending, epoch })
    }
}

/// A conversation: the KV cache keeps every earlier turn, so [`Session::send`] prefills only the
/// new turn's tokens (through the same chunked NPU plan) before answering.
pub struct Session<'p> {
    p: &'p mut Pipeline,
    /// The conversation's tokens, as the KV cache holds them.
    tokens: Vec<u32>,
    /// The last answer's last token when it was sampled but not decoded (an answer cut at
    /// `sample_len`): it goes into the cache before the next turn.
    pending: Option<u32>,
    /// The model's [`Model::kv_epoch`] after this session's last change to the cache.
    epoch: u64,
}

impl Session<'_> {
    /// Refuses to go on when something other than this session changed the model's KV cache
    /// (through [`Session::pipeline`]): the cache no longer holds this conversation, and a turn
    /// or a save would go on as if it did.
    fn check_in_step(&self) -> Result<()> {
        let m = &self.p.model;
        if m.kv_epoch() != self.epoch {
            return Err(Error::Input(format!(
                "this session's model was changed outside it (its KV cache now holds {} tokens, the conversation {}; or its profile or shadow layers changed): start a new session or restore a saved one",
                m.position(),
                self.tokens.len()
            )));
        }
        Ok(())
    }

    /// The tokens the KV cache holds.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The pipeline the conversation runs on. What changes its model's KV cache or what its rows
    /// mean (a prefill, `clear`, `extend`, a profile) takes the cache away from the conversation:
    /// [`Session::send`] and [`Session::save`] then refuse, and a new session starts over.
    pub fn pipeline(&mut self) -> &mut Pipeline {
        self.p
    }

    /// The user's next turn: its tokens (the chat template's, closing the previous answer) are
    /// prefilled after the conversation, then the answer is generated as
    /// [`Pipeline::generate`] does. Control tokens spelled in `text` stay text unless
    /// [`GenerateOptions::parse_special`].
    pub fn send(&mut self, text: &str, opts: &GenerateOptions, mut on_text: impl FnMut(&str)) -> Result<(String, GenerateStats)> {
        opts.validate()?;
        self.check_in_step()?;
        // Every change the turn makes is this session's, failed ones too (a failed prefill or
        // decode takes the cache back to the tokens the session holds).
        let r = self.turn(text, opts, &mut on_text);
        self.epoch = self.p.model.kv_epoch();
        r
    }

    fn turn(&mut self, text: &str, opts: &GenerateOptions, on_text: &mut dyn FnMut(&str)) -> Result<(String, GenerateStats)> {
        let p = &mut *self.p;
        let mut new: Vec<u32> = self.pending.into_iter().collect();
        if self.tokens.is_empty() {
            new.extend(p.encode_with(text, true, opts.parse_special)?);
        } else {
            new.extend(p.encode_follow_up(text, opts.parse_special)?);
        }
        if new.is_empty() {
            return Err(Error::Input("an empty prompt: nothing to answer".into()));
        }
        let context = p.model.config().context_len;
        let cached = self.tokens.len();
        let t = Instant::now();
        let mut logits = p.model.extend(&new)?;
        let prefill = t.elapsed();
        self.tokens.extend(&new);
        self.pending = None;

        let mut sampler = LogitsProcessor::from_sampling(opts.seed, opts.sampling());
        let mut stream = TextStream::new();
        let (mut answer, mut ids) = (String::new(), Vec::new());
        let (mut ttft, mut stop) = (prefill, StopReason::SampleLen);
        let t = Instant::now();
        while ids.len() < opts.sample_len {
            let next = sampler.sample(&penalized(&logits, &self.tokens, &p.textless, opts)?)?;
            if ids.is_empty() {
                ttft = prefill + t.elapsed();
            }
            if p.stop_tokens.contains(&next) {
                stop = StopReason::StopToken;
                break;
            }
            ids.push(next);
            // Given out but not yet in the cache: the next turn starts with it unless decoded.
            self.pending = Some(next);
            if let Some(text) = stream.next(&p.tokenizer, next)? {
                on_text(&text);
                answer += &text;
            }
            if ids.len() == opts.sample_len {
                break;
            }
            if self.tokens.len() >= context {
                stop = StopReason::ContextFull;
                break;
            }
            logits = p.model.decode(next)?;
            self.tokens.push(next);
            self.pending = None;
        }
        if let Some(text) = stream.finish(&p.tokenizer)? {
            on_text(&text);
            answer += &text;
        }
        let decode = t.elapsed().saturating_sub(ttft.saturating_sub(prefill));
        let stats = GenerateStats { prompt_tokens: new.len(), cached_tokens: cached, prefill, ttft, generated_tokens: ids.len(), decode, stop };
        Ok((answer, stats))
    }

    /// Saves the conversation's KV state to `path` (see the module documentation).
    pub fn save(&self, path: &Path) -> Result<()> {
        self.check_in_step()?;
        let model = &self.p.model;
        let caches = model.kv_caches();
        let cfg = model.config();
        let header = Header {
            format: FORMAT,
            model_id: model.model_id().to_string(),
            arithmetic: model.arithmetic(),
            layers: caches.len(),
            kv_heads: cfg.n_kv_head,
            head_dim: cfg.head_dim,
            tokens: self.tokens.clone(),
            pending: self.pending,
        };
        let json = serde_json::to_vec(&header).map_err(|e| Error::KvState { path: path.to_path_buf(), reason: e.to_string() })?;
        candle_npu::cache::write_atomic(path, |f| {
            let mut h = HashingWriter { inner: f, hash: Sha256::new() };
            h.write_all(MAGIC)?;
            h.write_all(&(json.len() as u32).to_le_bytes())?;
            h.write_all(&json)?;
            for c in &caches {
                c.write_to(&mut h)?;
            }
            let digest = h.hash.finalize();
            h.inner.write_all(&digest)
        })
    }
}

/// What a saved state holds besides the KV values.
#[derive(serde::Serialize, serde::Deserialize)]
struct Header {
    format: u32,
    model_id: String,
    /// What decides the rows' values besides weights and tokens (`Model::arithmetic`).
    arithmetic: String,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    tokens: Vec<u32>,
    pending: Option<u32>,
}

/// Hashes what it writes.
struct HashingWriter<W: Write> {
    inner: W,
    hash: Sha256,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The KV caches, tokens and pending token of the state at `path`, checked against `model`.
fn read_state(model: &Model, path: &Path) -> Result<(Vec<KvCache>, Vec<u32>, Option<u32>)> {
    let bad = |reason: String| Error::KvState { path: path.to_path_buf(), reason };
    let io = |e: std::io::Error| Error::Io { path: path.to_path_buf(), source: e };
    // Before opening it too: opening a FIFO blocks until a writer comes.
    if !std::fs::metadata(path).map_err(io)?.is_file() {
        return Err(bad("not a regular file".into()));
    }
    let mut f = std::fs::File::open(path).map_err(io)?;
    let meta = f.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    let mut head = [0u8; 12];
    f.read_exact(&mut head).map_err(|_| bad("shorter than its header".into()))?;
    if &head[..8] != MAGIC {
        return Err(bad("not a saved KV state (wrong magic bytes)".into()));
    }
    let json_len = u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize;
    // Bounded before any allocation: the header of a model's context of tokens is far smaller.
    let cfg = model.config();
    if json_len > 64 + 12 * cfg.context_len + 1024 {
        return Err(bad(format!("a header of {json_len} bytes")));
    }
    let mut json = vec![0u8; json_len];
    f.read_exact(&mut json).map_err(|_| bad("shorter than its header".into()))?;
    let h: Header = serde_json::from_slice(&json).map_err(|e| bad(format!("header: {e}")))?;
    if h.format != FORMAT {
        return Err(bad(format!("format {} (this build reads {FORMAT})", h.format)));
    }
    if h.model_id != model.model_id() {
        return Err(bad(format!("saved for model {}, not this model ({})", h.model_id, model.model_id())));
    }
    let arithmetic = model.arithmetic();
    if h.arithmetic != arithmetic {
        return Err(bad(format!("saved with {}; this model runs {arithmetic}: prefill the prompt again", h.arithmetic)));
    }
    let len = h.tokens.len();
    if h.layers != cfg.n_layer || h.kv_heads != cfg.n_kv_head || h.head_dim != cfg.head_dim || len > cfg.context_len {
        return Err(bad(format!(
            "{} layers of {} KV heads of {}, {len} tokens: this model has {} of {} of {} and a context of {}",
            h.layers, h.kv_heads, h.head_dim, cfg.n_layer, cfg.n_kv_head, cfg.head_dim, cfg.context_len
        )));
    }
    let ids: Vec<u32> = h.tokens.iter().chain(&h.pending).copied().collect();
    model.check_tokens(&ids).map_err(|e| bad(e.to_string()))?;
    let layer_bytes = 2 * h.kv_heads * len * h.head_dim * 4;
    let want = 12 + json_len as u64 + (h.layers * layer_bytes) as u64 + 32;
    if meta.len() != want {
        return Err(bad(format!("{} bytes, its header says {want}", meta.len())));
    }
    let mut hash = Sha256::new();
    hash.update(head);
    hash.update(&json);
    let mut caches = Vec::with_capacity(h.layers);
    let mut buf = vec![0u8; layer_bytes];
    for layer in 0..h.layers {
        f.read_exact(&mut buf).map_err(io)?;
        hash.update(&buf);
        // The checksum proves the file is what was written, not that a model wrote it: a state
        // edited and hashed again would be restored and answered from. No model's keys or values
        // leave f16's range (llama.cpp and candle keep KV caches in f16), so anything outside it,
        // or not finite, did not come from attention.
        if let Some(x) = buf.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).find(|x| !(x.abs() <= KV_LIMIT)) {
            return Err(bad(format!("layer {layer} holds a key or value of {x:e}: not finite or beyond the ±{KV_LIMIT} any model's attention keeps")));
        }
        caches.push(KvCache::from_bytes(&buf, h.kv_heads, h.head_dim, len).ok_or_else(|| bad("a layer of the wrong size".into()))?);
    }
    let mut digest = [0u8; 32];
    f.read_exact(&mut digest).map_err(io)?;
    if hash.finalize()[..] != digest {
        return Err(bad("checksum mismatch: the file is damaged".into()));
    }
    Ok((caches, h.tokens, h.pending))
}
