//! Several conversations on one loaded model at once: a step loop that batches every active
//! conversation's next token into one decode pass ([`Model::decode_sequences`](crate::Model::decode_sequences)) and admits a new
//! conversation's prefill between steps (continuous batching, at a phone's scale). The HTTP
//! server (`examples/server.rs`) hands it token ids and receives text.
//!
//! Decode is memory-bound: a step over four conversations reads the weights once, as one does,
//! so their aggregate tokens/s grows nearly with their number. Each conversation gets what it
//! would alone, token for token (greedy, or sampled with its own seed): a batched row is the
//! row decoded alone, bit for bit ([`Model::decode_sequences`](crate::Model::decode_sequences)), and sampling is
//! [`crate::Pipeline::generate`]'s.
//!
//! The loop runs on a thread of its own (the model's kernels use the rayon pool); requests come
//! through a queue whose places are counted ([`Engine::submit`] refuses a request when
//! [`Limits::sequences`] are answered and [`Limits::queue`] wait), and each answer goes
//! back through its request's `events` callback, which says whether anyone still listens: a
//! client gone cancels its conversation at the next token.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;

use candle_core::Tensor;
use candle_npu::{Error, Result};

use crate::generate::{GenerateOptions, Sampler, StopReason};
use crate::pipeline::{Pipeline, TextStream};
use crate::sequence::Sequence;

/// What a conversation's answer sends back, in order: text pieces (never a split character),
/// then one [`Event::Done`] or [`Event::Error`].
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The next piece of the answer's text.
    Text(String),
    /// The answer is complete.
    Done(Finish),
    /// The answer failed (what was sent stands).
    Error(String),
}

/// How an answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finish {
    /// Why it stopped.
    pub stop: StopReason,
    /// The prompt's tokens.
    pub prompt_tokens: usize,
    /// Tokens generated, the stop token excluded.
    pub generated_tokens: usize,
}

/// One conversation to answer.
pub struct Request {
    /// The prompt's token ids (a chat rendered in the model's template, or a completion's text).
    pub prompt: Vec<u32>,
    /// Sampling and length (speculation is not used here: every step is already a batch).
    pub opts: GenerateOptions,
    /// Called with each event; returns whether the client still listens (`false` cancels).
    pub events: Box<dyn FnMut(Event) -> bool + Send>,
}

/// How much the engine takes at once.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Conversations decoded together (each holds its KV cache).
    pub sequences: usize,
    /// Requests waiting for a place; beyond them [`Engine::submit`] refuses.
    pub queue: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { sequences: 4, queue: 16 }
    }
}

/// A request refused: the queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

/// The step loop's handle: requests go in with [`Engine::submit`]; dropping it lets the loop
/// finish the conversations it holds and stop.
pub struct Engine {
    tx: Option<Sender<Request>>,
    /// Requests taken and not ended (waiting or being answered): at most `places`.
    taken: Arc<AtomicUsize>,
    places: usize,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Starts the loop on its own thread over `p`'s model.
    pub fn start(p: Arc<Pipeline>, limits: Limits) -> Result<Engine> {
        if limits.sequences == 0 {
            return Err(Error::Input("an engine of 0 sequences answers nothing: give at least 1".into()));
        }
        let (tx, rx) = channel();
        let taken = Arc::new(AtomicUsize::new(0));
        let ended = taken.clone();
        let thread = std::thread::Builder::new()
            .name("candle-npu-engine".into())
            .spawn(move || run(&p, rx, limits.sequences, &ended))
            .map_err(|e| Error::Internal(format!("cannot start the engine's thread: {e}")))?;
        Ok(Engine { tx: Some(tx), taken, places: limits.sequences + limits.queue, thread: Some(thread) })
    }

    /// Queues `r`, or refuses it when the queue is full (an HTTP server answers 503: try later).
    pub fn submit(&self, r: Request) -> std::result::Result<(), Busy> {
        let tx = self.tx.as_ref().ok_or(Busy)?;
        // A place is taken before the request is sent, and given back when its answer ends.
        if self.taken.fetch_add(1, Ordering::AcqRel) >= self.places {
            self.taken.fetch_sub(1, Ordering::AcqRel);
            return Err(Busy);
        }
        tx.send(r).map_err(|_| {
            self.taken.fetch_sub(1, Ordering::AcqRel);
            Busy
        })
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A conversation being answered.
struct Active {
    seq: Sequence,
    /// The prompt and the answer so far (the repeat penalty's window).
    tokens: Vec<u32>,
    /// The sampled token not decoded yet: the next step's row.
    next: u32,
    prompt_tokens: usize,
    generated: usize,
    sampler: Sampler,
    stream: TextStream,
    opts: GenerateOptions,
    events: Box<dyn FnMut(Event) -> bool + Send>,
}

/// The loop: one new conversation admitted (prefilled) per step while there is room, then one
/// decode step of every active one; waits for a request when none is active.
/// `ended`: the engine's count of requests taken, decremented as each answer ends.
fn run(p: &Pipeline, rx: Receiver<Request>, sequences: usize, ended: &AtomicUsize) {
    let mut active: Vec<Active> = Vec::new();
    let mut open = true;
    loop {
        let request = match (active.is_empty(), active.len() < sequences && open) {
            (true, _) => match rx.recv() {
                Ok(r) => Some(r),
                Err(_) => return,
            },
            (false, true) => match rx.try_recv() {
                Ok(r) => Some(r),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    None
                }
            },
            (false, false) => None,
        };
        if let Some(r) = request {
            match admit(p, r) {
                Some(a) => active.push(a),
                None => {
                    ended.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
        if !active.is_empty() {
            let before = active.len();
            step(p, &mut active);
            ended.fetch_sub(before - active.len(), Ordering::AcqRel);
        }
    }
}

/// Prefills `r`'s prompt into a new sequence and samples its first token: the conversation,
/// unless it ended there (an error, a stop token, a client gone).
fn admit(p: &Pipeline, mut r: Request) -> Option<Active> {
    let context = p.model.config().context_len;
    let checked = r.opts.validate().and_then(|()| match r.prompt.len() {
        0 => Err(Error::Input("an empty prompt: nothing to answer".into())),
        n if n >= context => Err(Error::Input(format!("a prompt of {n} tokens leaves no room in the model's context of {context}"))),
        _ => Ok(()),
    });
    if let Err(e) = checked {
        (r.events)(Event::Error(e.to_string()));
        return None;
    }
    let mut seq = p.model.sequence();
    let logits = match p.model.prefill_sequence(&mut seq, &r.prompt, &Default::default()) {
        Ok(l) => l,
        Err(e) => {
            (r.events)(Event::Error(e.to_string()));
            return None;
        }
    };
    let sampler = Sampler::new(&r.opts);
    let prompt_tokens = r.prompt.len();
    let mut a = Active { seq, tokens: r.prompt, next: 0, prompt_tokens, generated: 0, sampler, stream: TextStream::new(), opts: r.opts, events: r.events };
    advance(p, &mut a, &logits).then_some(a)
}

/// One decode pass over every active conversation's pending token, then each one's next.
fn step(p: &Pipeline, active: &mut Vec<Active>) {
    let mut batch: Vec<(&mut Sequence, &[u32])> = active.iter_mut().map(|a| (&mut a.seq, std::slice::from_ref(&a.next))).collect();
    let rows = match p.model.decode_sequences(&mut batch) {
        Ok(rows) => rows,
        Err(e) => {
            // Not one conversation's fault that the others could be told apart from: all end.
            for mut a in active.drain(..) {
                (a.events)(Event::Error(e.to_string()));
            }
            return;
        }
    };
    let mut i = 0;
    active.retain_mut(|a| {
        let alive = match rows.get(i) {
            Ok(logits) => advance(p, a, &logits),
            Err(e) => {
                (a.events)(Event::Error(e.to_string()));
                false
            }
        };
        i += 1;
        alive
    });
}

/// Samples `a`'s next token from `logits` and sends its text, as [`crate::Pipeline::generate`]
/// does; whether the conversation goes on (its token then pending for the next step).
fn advance(p: &Pipeline, a: &mut Active, logits: &Tensor) -> bool {
    let next = match a.sampler.next(logits, &a.tokens, &p.textless, &a.opts) {
        Ok(t) => t,
        Err(e) => {
            (a.events)(Event::Error(e.to_string()));
            return false;
        }
    };
    if p.stop_tokens.contains(&next) {
        return finish(p, a, StopReason::StopToken);
    }
    a.generated += 1;
    let piece = a.stream.next(&p.tokenizer, next);
    if !send_text(a, piece) {
        return false;
    }
    // As `generate`: the last token is not decoded, and a full context stops.
    if a.generated == a.opts.sample_len {
        return finish(p, a, StopReason::SampleLen);
    }
    if a.tokens.len() >= p.model.config().context_len {
        return finish(p, a, StopReason::ContextFull);
    }
    a.tokens.push(next);
    a.next = next;
    true
}

/// Sends what text is left and the end; always `false` (the conversation is over).
fn finish(p: &Pipeline, a: &mut Active, stop: StopReason) -> bool {
    let piece = a.stream.finish(&p.tokenizer);
    if !send_text(a, piece) {
        return false;
    }
    (a.events)(Event::Done(Finish { stop, prompt_tokens: a.prompt_tokens, generated_tokens: a.generated }));
    false
}

/// Sends a text piece (none: nothing to send) or the error that came instead; whether the
/// conversation goes on (no error, and the client listens).
fn send_text(a: &mut Active, piece: Result<Option<String>>) -> bool {
    match piece {
        Ok(Some(piece)) => (a.events)(Event::Text(piece)),
        Ok(None) => true,
        Err(e) => {
            (a.events)(Event::Error(e.to_string()));
            false
        }
    }
}
