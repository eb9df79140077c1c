//! Conversations on a [`Pipeline`] ([`Session`]): each owns its messages and its
//! [`Sequence`] (KV cache and position), so a turn prefills only what its conversation does not
//! hold yet, and several conversations share one loaded model (its weights, device and NPU
//! graphs), which runs each turn on the conversation's own sequence.
//! A conversation's state saved to a file and restored ([`Session::save`],
//! [`Pipeline::restore_session`]), so that a long system prompt or document is prefilled once.
//!
//! A turn renders the whole conversation in the model's chat template
//! ([`Pipeline::encode_chat`]) and prefills what follows the longest prefix the cache already
//! holds (as llama.cpp's server reuses its prompt cache): the answer's end-of-turn marker, the
//! new messages, and any token of an earlier turn the template writes otherwise than it was
//! generated.
//!
//! The file: 8 magic bytes, a little-endian u32 header length and the header (JSON: format,
//! model id, what decides the rows' values, layers, KV heads, head size, the values' type (the
//! cache's own: f16 by default), tokens, messages), then each layer's keys and values
//! ([`KvCache::write_to`]), then the SHA-256 of all that. Written
//! atomically ([`candle_npu::fs::write_atomic`]); read only up to the size its header gives;
//! refused, with the reason in one line, for another model, profile or precision.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::path::Path;
use std::time::Instant;

use candle_core::Tensor;
use candle_npu::{Error, Result};
use sha2::{Digest, Sha256};

use crate::attention::{KvCache, KvType};
use crate::chat::Message;
use crate::generate::{GenerateOptions, GenerateStats, Sampler, StopReason};
use crate::pipeline::{Pipeline, TextStream};
use crate::sequence::Sequence;
use crate::speculative::{DraftState, Drafter, Proposer, SpeculationStats, Speculative, Verify};
use crate::transformer::{Model, PrefillOptions, PrefillRows};

const MAGIC: &[u8; 8] = b"CNPU-KV\0";
/// 3: the values in the cache's own type (`kv`: f16, half the file, or f32); 2 added a
/// conversation's messages (1 held tokens and a pending token only).
const FORMAT: u32 = 3;
/// The largest key or value magnitude a restored state may hold: f16's largest finite value.
const KV_LIMIT: f32 = 65504.0;
/// The largest header (JSON: the conversation's tokens and messages) saved or read: 256 MiB, far
/// beyond any context's text, bounding what a damaged length field makes a reader allocate.
const HEADER_LIMIT: usize = 256 << 20;

impl Pipeline {
    /// A new conversation (nothing is prefilled until its first turn). Any number of them can
    /// share this pipeline; each owns its KV cache.
    pub fn session(&self) -> Session {
        Session {
            messages: vec![],
            tokens: vec![],
            seq: Sequence::default(),
            draft: DraftState::default(),
            model_id: self.model.model_id().to_string(),
            arithmetic: self.model.arithmetic(),
        }
    }

    /// The conversation saved at `path` ([`Session::save`]), its KV cache restored: its next
    /// turn prefills only its own tokens. Refused, saying which setting differs, for a file of
    /// other weights, another quant profile or precision, or a damaged one.
    pub fn restore_session(&self, path: &Path) -> Result<Session> {
        let (kv, tokens, messages) = read_state(&self.model, path)?;
        let mut seq = self.model.sequence();
        seq.set_caches(kv, self.model.kv_type());
        Ok(Session { messages, tokens, seq, draft: DraftState::default(), model_id: self.model.model_id().to_string(), arithmetic: self.model.arithmetic() })
    }
}

/// A conversation: its messages, and the KV cache of the tokens it has run through the model
/// (see the module documentation). Turns take the pipeline they run on. A clone is a fork: the
/// same conversation, to go on another way (its cache copied).
#[derive(Clone)]
pub struct Session {
    messages: Vec<Message>,
    /// The tokens the cache holds.
    tokens: Vec<u32>,
    /// Its KV caches and position (no layers before the first turn).
    seq: Sequence,
    /// Its speculative draft's cache, when a draft proposes.
    draft: DraftState,
    /// The model the cache belongs to (`Model::model_id`: its weights' digest).
    model_id: String,
    /// What decided the cached rows' values (`Model::arithmetic`): a model given another
    /// profile since would compute others.
    arithmetic: String,
}

impl Session {
    /// Refuses `p` unless its model is the one this conversation's cache was computed by, with
    /// the same arithmetic (a conversation with nothing cached takes the model as it is now).
    /// Returns the model's arithmetic (`Model::arithmetic`, a digest of its profile: computed once).
    fn check_model(&self, p: &Pipeline) -> Result<String> {
        let (id, now) = (p.model.model_id(), p.model.arithmetic());
        if self.tokens.is_empty() {
            return Ok(now);
        }
        if id != self.model_id {
            return Err(Error::Input(format!("this conversation belongs to model {}, not to this one ({id}): start a new session", self.model_id)));
        }
        if now != self.arithmetic {
            return Err(Error::Input(format!("this conversation's cache was computed otherwise ({}): start a new session", differs(&self.arithmetic, &now))));
        }
        Ok(now)
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Session({} messages, {} tokens cached)", self.messages.len(), self.tokens.len())
    }
}

impl Session {
    /// The tokens the KV cache holds.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The conversation so far, the model's answers included.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The conversation's KV caches and position.
    pub fn sequence(&self) -> &Sequence {
        &self.seq
    }

    /// The user's next turn: [`Session::chat`] of one user message.
    pub fn send(&mut self, p: &Pipeline, text: &str, opts: &GenerateOptions, on_text: impl FnMut(&str)) -> Result<(String, GenerateStats)> {
        self.chat(p, &[Message::user(text)], opts, on_text)
    }

    /// Adds `messages` (a system prompt first, user turns, ...) to the conversation and answers
    /// them as [`Pipeline::generate`] does: the conversation is rendered in the model's chat
    /// template and only what the KV cache does not hold yet is prefilled. The answer joins the
    /// conversation. Control tokens spelled in the messages stay text unless
    /// [`GenerateOptions::parse_special`]. On an error the conversation is as it was.
    pub fn chat(&mut self, p: &Pipeline, messages: &[Message], opts: &GenerateOptions, mut on_text: impl FnMut(&str)) -> Result<(String, GenerateStats)> {
        opts.validate()?;
        // No new message: nothing was said to answer (the model would answer its own last turn).
        if messages.is_empty() {
            return Err(Error::Input("Session::chat with no messages: nothing to answer (give the user's turn)".into()));
        }
        if matches!(opts.speculative, Speculative::Draft { .. }) && p.draft.is_none() {
            return Err(Error::Input("speculative decoding with a draft model, but the pipeline has none: Pipeline::set_draft".into()));
        }
        let arithmetic = self.check_model(p)?;
        (self.model_id, self.arithmetic) = (p.model.model_id().to_string(), arithmetic);
        let mut all = self.messages.clone();
        all.extend_from_slice(messages);
        let ids = p.encode_chat(&all, true, opts.parse_special)?;
        if ids.is_empty() {
            return Err(Error::Input("an empty prompt: nothing to answer".into()));
        }
        // What the cache holds (all of `tokens`, unless a turn unwound mid-way and lost it).
        let cached = match self.seq.position() == self.tokens.len() {
            true => self.tokens.len(),
            false => 0,
        };
        let keep = self.tokens[..cached].iter().zip(&ids).take_while(|(a, b)| a == b).count().min(ids.len() - 1);
        let new = &ids[keep..];
        if self.seq.kv.is_empty() {
            self.seq = p.model.sequence();
        }
        self.seq.truncate(keep);
        let mut drafter = match &p.draft {
            Some(d) if matches!(opts.speculative, Speculative::Draft { .. }) => Some(Drafter::new(d, &p.model, &mut self.draft)?),
            _ => None,
        };
        let (answer, stats, tokens) = match answer(p, &mut self.seq, drafter.as_mut(), &ids, keep, opts, &mut on_text) {
            Ok(done) => done,
            Err(e) => {
                // The cache holds what it held up to `keep` (a failed step takes back its rows).
                self.tokens.truncate(keep.min(self.seq.position()));
                self.seq.truncate(self.tokens.len());
                return Err(e);
            }
        };
        debug_assert!(new.len() == stats.prompt_tokens);
        self.tokens = tokens;
        self.messages = all;
        self.messages.push(Message::assistant(answer.clone()));
        Ok((answer, stats))
    }

    /// Saves the conversation and its KV state to `path`, for `p`'s model (see the module
    /// documentation); never onto a file `p` read ([`Pipeline::check_output`]).
    pub fn save(&self, p: &Pipeline, path: &Path) -> Result<()> {
        p.check_output(path, "the session")?;
        let arithmetic = self.check_model(p)?;
        let model = &p.model;
        let cfg = model.config();
        // The conversation's own type (a sequence never prefilled is empty: the model's).
        let kv = if self.seq.kv.is_empty() { model.kv_type() } else { self.seq.kv_type() }.saved();
        let header = Header {
            format: FORMAT,
            model_id: model.model_id().to_string(),
            arithmetic,
            layers: cfg.n_layer,
            kv_heads: cfg.n_kv_head,
            head_dim: cfg.head_dim,
            kv,
            tokens: self.tokens.clone(),
            messages: self.messages.clone(),
        };
        let json = serde_json::to_vec(&header).map_err(|e| Error::KvState { path: path.to_path_buf(), reason: e.to_string() })?;
        if json.len() > HEADER_LIMIT {
            return Err(Error::KvState {
                path: path.to_path_buf(),
                reason: format!("not saved: a conversation of {} bytes, over the {HEADER_LIMIT} a saved one may hold", json.len()),
            });
        }
        let empty = std::sync::Mutex::new(KvCache::default());
        candle_npu::fs::write_atomic(path, |f| {
            let mut h = HashingWriter { inner: f, hash: Sha256::new() };
            h.write_all(MAGIC)?;
            h.write_all(&(json.len() as u32).to_le_bytes())?;
            h.write_all(&json)?;
            for l in 0..cfg.n_layer {
                self.seq.kv.get(l).unwrap_or(&empty).lock().unwrap_or_else(|e| e.into_inner()).write_to(&mut h, kv)?;
            }
            let digest = h.hash.finalize();
            h.inner.write_all(&digest)
        })
    }
}

/// A turn on `seq`, holding the conversation's cache of `ids[..keep]`: prefill the rest of
/// `ids`, then sample the answer. Its text, stats, and the tokens the cache then holds.
fn answer(
    p: &Pipeline,
    seq: &mut Sequence,
    mut draft: Option<&mut Drafter>,
    ids: &[u32],
    keep: usize,
    opts: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<(String, GenerateStats, Vec<u32>)> {
    let context = p.model.config().context_len;
    let new = &ids[keep..];
    let t = Instant::now();
    let mut logits = p.model.prefill_sequence(seq, new, &Default::default())?;
    let prefill = t.elapsed();
    let mut tokens = ids.to_vec();
    let mut sampler = Sampler::new(opts);
    let mut stream = TextStream::new();
    let (mut text, mut generated) = (String::new(), 0);
    let (mut ttft, mut stop) = (prefill, StopReason::SampleLen);
    // Speculation (`crate::speculative`): tokens proposed after the last sampled one, each with
    // the logits that follow it, computed in one verification pass and already in the KV cache.
    let mut proposer = Proposer::new(opts.speculative);
    let mut pending: VecDeque<(u32, Tensor)> = VecDeque::new();
    // Tokens the current pass proposed (those it still holds are `pending`).
    let (mut spec, mut in_pass) = (SpeculationStats::default(), 0);
    let t = Instant::now();
    while generated < opts.sample_len {
        let next = sampler.next(&logits, &tokens, &p.textless, opts)?;
        if generated == 0 {
            ttft = prefill + t.elapsed();
        }
        if p.stop_tokens.contains(&next) {
            stop = StopReason::StopToken;
            break;
        }
        generated += 1;
        if let Some(piece) = stream.next(&p.tokenizer, next)? {
            on_text(&piece);
            text += &piece;
        }
        // The last token is not decoded: the next turn's render holds it as text.
        if generated == opts.sample_len {
            break;
        }
        if tokens.len() >= context {
            stop = StopReason::ContextFull;
            break;
        }
        // A proposal that guessed `next`: its row is in the cache, the logits after it known.
        if let Some(l) = proposer.as_mut() {
            l.sampled(next);
        }
        match pending.pop_front() {
            Some((proposed, after)) if proposed == next => {
                tokens.push(next);
                logits = after;
                spec.accepted += 1;
                if let Some(l) = proposer.as_mut().filter(|_| pending.is_empty()) {
                    l.judged(in_pass, in_pass);
                }
                continue;
            }
            Some(_) => {
                // The miss was popped: the ones before it were right.
                if let Some(l) = proposer.as_mut() {
                    l.judged(in_pass, in_pass - pending.len() - 1);
                }
                pending.clear();
                seq.rewind(tokens.len())?;
            }
            None => {}
        }
        tokens.push(next);
        // As many proposed tokens as pay (`Proposer::draft_len`), within the context's room; a
        // proposal not worth a pass is kept to be judged against what is sampled.
        let room = context - tokens.len();
        let proposal = match proposer.as_mut() {
            Some(l) => match l.draft_len().min(room) {
                0 => {
                    let shadow = l.propose(&tokens, l.shadow_len().min(room), draft.as_deref_mut())?;
                    l.shadow(shadow);
                    vec![]
                }
                want => l.propose(&tokens, want, draft.as_deref_mut())?,
            },
            None => vec![],
        };
        let step = Instant::now();
        if proposal.is_empty() {
            logits = p.model.decode_sequences(&mut [(&mut *seq, &[next])])?.squeeze(0)?;
            if let Some(l) = proposer.as_mut() {
                l.timed_step(step.elapsed().as_secs_f64());
            }
            continue;
        }
        let pass = [&[next], proposal.as_slice()].concat();
        let rows = match opts.speculative.verify() {
            Verify::Cpu => p.model.decode_sequences(&mut [(&mut *seq, &pass[..])])?,
            Verify::Npu => p.model.prefill_sequence(seq, &pass, &PrefillOptions::default().all_logits().rows(PrefillRows::NpuOnly))?,
        };
        if let Some(l) = proposer.as_mut() {
            l.timed_pass(proposal.len() + 1, step.elapsed().as_secs_f64());
        }
        logits = rows.get(0)?;
        pending = proposal.iter().enumerate().map(|(i, &d)| Ok((d, rows.get(i + 1)?))).collect::<Result<_>>()?;
        (spec.passes, spec.proposed, in_pass) = (spec.passes + 1, spec.proposed + proposal.len(), proposal.len());
    }
    // Rows of proposals not reached (a stop, the length) leave the cache: it holds `tokens`.
    if !pending.is_empty() {
        seq.rewind(tokens.len())?;
    }
    if let Some(piece) = stream.finish(&p.tokenizer)? {
        on_text(&piece);
        text += &piece;
    }
    let decode = t.elapsed().saturating_sub(ttft.saturating_sub(prefill));
    let stats = GenerateStats { prompt_tokens: new.len(), cached_tokens: keep, prefill, ttft, generated_tokens: generated, decode, stop, speculation: spec };
    Ok((text, stats, tokens))
}

/// Which parts of two `Model::arithmetic` descriptions differ, in one line: e.g. "profile
/// 3fa2... then, 9b1c... now".
fn differs(then: &str, now: &str) -> String {
    let (a, b): (Vec<&str>, Vec<&str>) = (then.split(", ").collect(), now.split(", ").collect());
    let short = |s: &str| if s.len() > 40 { format!("{}...", &s[..s.floor_char_boundary(40)]) } else { s.to_string() };
    let diffs: Vec<String> = a.iter().zip(&b).filter(|(x, y)| x != y).map(|(x, y)| format!("{} then, {} now", short(x), short(y))).collect();
    match diffs.is_empty() || a.len() != b.len() {
        true => format!("{} then, {} now", short(then), short(now)),
        false => diffs.join("; "),
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
    /// The type of the values that follow.
    kv: KvType,
    tokens: Vec<u32>,
    messages: Vec<Message>,
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

/// The KV caches, tokens and messages of the state at `path`, checked against `model`.
fn read_state(model: &Model, path: &Path) -> Result<(Vec<KvCache>, Vec<u32>, Vec<Message>)> {
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
    if json_len > HEADER_LIMIT || json_len as u64 + 12 + 32 > meta.len() {
        return Err(bad(format!("a header of {json_len} bytes, in a file of {}", meta.len())));
    }
    let mut json = vec![0u8; json_len];
    f.read_exact(&mut json).map_err(|_| bad("shorter than its header".into()))?;
    let h: Header = serde_json::from_slice(&json).map_err(|e| bad(format!("header: {e}")))?;
    if h.format != FORMAT {
        return Err(bad(format!("format {} (this build reads {FORMAT}): prefill the conversation again", h.format)));
    }
    if h.model_id != model.model_id() {
        return Err(bad(format!("saved for model {}, not this model ({})", h.model_id, model.model_id())));
    }
    let arithmetic = model.arithmetic();
    if h.arithmetic != arithmetic {
        return Err(bad(format!("saved with another setting ({}): prefill the conversation again", differs(&h.arithmetic, &arithmetic))));
    }
    let len = h.tokens.len();
    if h.layers != cfg.n_layer || h.kv_heads != cfg.n_kv_head || h.head_dim != cfg.head_dim || len > cfg.context_len {
        return Err(bad(format!(
            "{} layers of {} KV heads of {}, {len} tokens: this model has {} of {} of {} and a context of {}",
            h.layers, h.kv_heads, h.head_dim, cfg.n_layer, cfg.n_kv_head, cfg.head_dim, cfg.context_len
        )));
    }
    model.check_tokens(&h.tokens).map_err(|e| bad(e.to_string()))?;
    crate::chat::check_roles(&h.messages).map_err(bad)?;
    if h.kv != h.kv.saved() {
        return Err(bad(format!("values of type {:?}, which no saved state holds", h.kv)));
    }
    let layer_bytes = h.kv.bytes(2 * h.kv_heads * len * h.head_dim);
    let want = 12 + json_len as u64 + (h.layers * layer_bytes) as u64 + 32;
    if meta.len() != want {
        return Err(bad(format!("{} bytes, its header says {want}", meta.len())));
    }
    let mut hash = Sha256::new();
    hash.update(head);
    hash.update(&json);
    let mut caches = Vec::with_capacity(h.layers);
    let mut buf = vec![0u8; layer_bytes];
    // The first value no attention produces, said once the checksum holds (a damaged file is
    // said to be damaged).
    let mut out_of_range = None;
    for layer in 0..h.layers {
        f.read_exact(&mut buf).map_err(io)?;
        hash.update(&buf);
        let values = KvCache::values_of(&buf, h.kv);
        if out_of_range.is_none() {
            out_of_range = values.iter().find(|x| !(x.abs() <= KV_LIMIT)).map(|&x| (layer, x));
        }
        caches.push(KvCache::from_values(&values, h.kv_heads, h.head_dim, len, model.kv_type()).ok_or_else(|| bad("a layer of the wrong size".into()))?);
    }
    let mut digest = [0u8; 32];
    f.read_exact(&mut digest).map_err(io)?;
    if hash.finalize()[..] != digest {
        return Err(bad("checksum mismatch: the file is damaged".into()));
    }
    // The checksum proves the file is what was written, not that a model wrote it: a state
    // edited and hashed again would be restored and answered from. No model's keys or values
    // leave f16's range (llama.cpp and candle keep KV caches in f16), so anything outside it, or
    // not finite, did not come from attention.
    if let Some((layer, x)) = out_of_range {
        return Err(bad(format!("layer {layer} holds a key or value of {x:e}: not finite or beyond the ±{KV_LIMIT} any model's attention keeps")));
    }
    Ok((caches, h.tokens, h.messages))
}
