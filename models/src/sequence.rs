//! One conversation's state on a loaded [`Model`]: its KV caches and position, apart from the
//! model, so that one loaded model (shared, `&self`) serves several conversations at once.
//!
//! A [`Model`] runs tokens into a sequence ([`Model::prefill_sequence`]) and decodes the next
//! token of several sequences in one pass over the weights ([`Model::decode_sequences`]); the
//! weights, the quant profile and the prepared graphs are the model's, shared by every sequence.
//! A sequence is only meaningful with the model that made it ([`Model::sequence`]): its caches
//! have that model's layers and KV type, and its rows that model's arithmetic.

use std::sync::{Arc, Mutex};

use candle_npu::sched::{Schedule, SubgraphDag};

use candle_npu::{Error, Result};

use crate::attention::{KvCache, KvType};
use crate::Model;

/// A conversation's KV caches (one per layer) and position (the tokens they hold).
#[derive(Default)]
pub struct Sequence {
    /// Per layer; a mutex so that a prefill's chunks, run by several workers in chunk order,
    /// can each append to a layer's cache (uncontended: the schedule orders them).
    pub(crate) kv: Vec<Mutex<KvCache>>,
    pub(crate) pos: usize,
    /// This sequence's last prefill's DAG and schedule ([`Sequence::last_run`]).
    pub(crate) last_run: Option<Arc<(SubgraphDag, Schedule)>>,
}

impl Sequence {
    /// An empty sequence of `layers` caches holding keys and values as `kv`.
    pub(crate) fn new(layers: usize, kv: KvType) -> Self {
        Sequence { kv: (0..layers).map(|_| Mutex::new(KvCache::new(kv))).collect(), pos: 0, last_run: None }
    }

    /// The number of tokens the caches hold: where the next token goes.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// This sequence's last prefill's DAG and schedule (what ran where and when): for traces and
    /// bubble rates. Each sequence its own, whatever other conversations prefilled since.
    pub fn last_run(&self) -> Option<Arc<(SubgraphDag, Schedule)>> {
        self.last_run.clone()
    }

    /// How the caches hold keys and values.
    pub fn kv_type(&self) -> KvType {
        self.kv.first().map_or(KvType::default(), |kv| kv.lock().unwrap_or_else(|e| e.into_inner()).kind())
    }

    /// Bytes the caches hold (keys and values of every layer).
    pub fn kv_bytes(&self) -> usize {
        self.kv.iter().map(|kv| kv.lock().unwrap_or_else(|e| e.into_inner()).bytes()).sum()
    }

    /// Forget every token, and the caches' memory.
    pub fn clear(&mut self) {
        self.kv.iter_mut().for_each(|kv| kv.get_mut().unwrap_or_else(|e| e.into_inner()).clear());
        self.pos = 0;
    }

    /// Back to the first `position` tokens (at most the current position): the cache rows after
    /// it are dropped, exactly (a rejected speculation, or a turn taken back, leaves no trace).
    pub fn rewind(&mut self, position: usize) -> Result<()> {
        if position > self.pos {
            return Err(Error::Input(format!("rewind to position {position}: the sequence is at {}", self.pos)));
        }
        self.truncate(position);
        Ok(())
    }

    /// Back to the first `n` tokens, in every layer's cache and the position.
    pub(crate) fn truncate(&mut self, n: usize) {
        self.kv.iter_mut().for_each(|kv| kv.get_mut().unwrap_or_else(|e| e.into_inner()).truncate(n));
        self.pos = self.pos.min(n);
    }

    /// Replaces the caches (one per layer, of one length, checked by the caller) and the
    /// position with theirs, held as `t`.
    pub(crate) fn set_caches(&mut self, caches: Vec<KvCache>, t: KvType) {
        self.pos = caches.first().map_or(0, KvCache::len);
        self.kv = caches.into_iter().map(|c| Mutex::new(c.into_type(t))).collect();
    }
}

/// A copy of the conversation (a [`crate::Session`] forked), its caches copied.
impl Clone for Sequence {
    fn clone(&self) -> Self {
        Sequence {
            kv: self.kv.iter().map(|kv| Mutex::new(kv.lock().unwrap_or_else(|e| e.into_inner()).clone())).collect(),
            pos: self.pos,
            last_run: self.last_run.clone(),
        }
    }
}

impl std::fmt::Debug for Sequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sequence({} layers, position {}, {:?} KV)", self.kv.len(), self.pos, self.kv_type())
    }
}

impl Model {
    /// A new, empty conversation on this model.
    pub fn sequence(&self) -> Sequence {
        Sequence::new(self.config().n_layer, self.kv_type())
    }

    /// A conversation on the model cut to its first `layers` (then its final norm and output):
    /// on the CPU paths ([`Model::decode_sequences`], [`crate::PrefillRows::Cpu`]) a draft of
    /// itself for speculative decoding, sharing its weights. `layers` from 1 to the model's.
    pub fn sequence_of_layers(&self, layers: usize) -> Result<Sequence> {
        self.check_draft_layers(layers)?;
        Ok(Sequence::new(layers, self.kv_type()))
    }

    /// An error unless the model has a first `layers` to cut a draft to (1 to its own).
    pub(crate) fn check_draft_layers(&self, layers: usize) -> Result<()> {
        let n = self.config().n_layer;
        match (1..=n).contains(&layers) {
            true => Ok(()),
            false => Err(Error::Input(format!("a draft of the first {layers} layers of a model of {n}: expected 1 to {n}"))),
        }
    }

    /// An error unless `seq` has a cache for each of this model's layers, or (`cut`: the CPU
    /// paths) for each of its first ones (a sequence of another model would be read out of
    /// bounds, or attend to another model's keys).
    pub(crate) fn check_sequence(&self, seq: &Sequence, cut: bool) -> Result<()> {
        let (layers, have) = (self.config().n_layer, seq.kv.len());
        match have == layers || cut && (1..layers).contains(&have) {
            true => Ok(()),
            false => Err(Error::Input(format!("a sequence of {have} layers on a model of {layers}: make it with this model's Model::sequence()"))),
        }
    }
}

/// One loaded model serves conversations on several threads (`Arc<Model>`): it must stay
/// `Send + Sync` (its prepared graphs, pools and telemetry are behind locks).
const _: fn() = || {
    fn shared<T: Send + Sync>() {}
    shared::<Model>();
    shared::<Sequence>();
};
