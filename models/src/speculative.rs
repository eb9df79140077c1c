//! Speculative decoding: tokens proposed cheaply are verified several at a time, in one pass over
//! the weights ([`crate::Model::decode_rows`]); decode is memory-bound, so a pass of a few rows
//! costs little more than one.
//!
//! # Why the output is the plain decode's, token for token
//!
//! A verifier's row `i` holds the logits [`crate::Model::decode`] would give after the same
//! tokens, bit for bit (the same kernels per row). The generation loop samples every token from
//! such a row, exactly as without speculation (the same sampler, the same random numbers, the
//! same repeat penalty over the same history), and only then looks whether the proposal guessed
//! it: a guessed token's next row is already computed; at the first miss the rows after it are
//! dropped ([`crate::Model::rewind`]). So greedy and sampled output are the plain decode's.
//!
//! For a proposer that proposes one token per position (a point mass, as prompt lookup and a
//! greedy draft are), sampling then matching *is* the standard acceptance rule of speculative
//! sampling (Leviathan et al., 2023): the proposal `d` is kept with probability `p(d)`, and on a
//! miss the token comes from `p` without `d`, renormalized, which is `(p - q)+` for `q` a point
//! mass on `d`.
//!
//! # Proposers
//!
//! [`Speculative::Lookup`]: prompt lookup. The conversation's last n tokens (n from the largest
//! to the smallest n-gram size) are looked for earlier in the conversation, latest match first,
//! and the tokens that followed are proposed: free, and right where an answer copies its input
//! (quoting a document, rewriting code). The number proposed adapts to how many were accepted.
//!
//! [`Speculative::Draft`]: a draft model ([`crate::Pipeline::set_draft`]), a smaller model of
//! the same tokenizer or the model's own first layers ([`crate::LoadOptions::layers`]), decodes
//! greedily on the CPU from the conversation so far and proposes its tokens. It has a KV cache of
//! its own, kept to the conversation's longest common prefix with what it holds. Its proposals
//! cost its steps, so they are not made for nothing: while the draft is not worth a pass, a probe
//! of a few tokens now and then keeps its acceptance measured: after [`PROBE_EVERY`] tokens, and
//! twice as long after each probe that leaves it not worth a pass (up to [`PROBE_MAX`]).
//!
//! # Verifiers
//!
//! [`Verify::Cpu`] (the default) runs a pass as decode steps ([`crate::Model::decode_rows`]): the
//! output is plain decoding's, as above. [`Verify::Npu`] runs it through the NPU's stage graphs
//! as one padded chunk ([`PrefillRows::NpuOnly`]): a chunk costs the same whatever rows it
//! holds, so on a phone a pass of 16 rows costs what a pass of one does. Its rows are the
//! NPU's W8A8 arithmetic, not the CPU decode's, so the tokens sampled from them are what the
//! NPU's own prefill of the conversation would give (within W8A8's 1% of the float model), not
//! plain decoding's token for token. `docs/speculative.md` predicts what it earns on a phone.

use candle_npu::{Error, Result};

use crate::logits::argmax;
use crate::sequence::Sequence;
use crate::transformer::{Model, PrefillOptions, PrefillRows};

/// How [`crate::GenerateOptions`] proposes tokens to verify.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Speculative {
    /// No speculation: one decode step per token.
    #[default]
    Off,
    /// Prompt lookup (see the [module](self)): the tokens that followed the latest earlier
    /// occurrence of the conversation's last `ngram_max` down to `ngram_min` tokens, at most
    /// `max_draft` of them per pass.
    Lookup {
        /// Largest n-gram looked for (3 by default).
        ngram_max: usize,
        /// Smallest n-gram looked for (2 by default: single tokens recur everywhere, and a
        /// match of one says little about what follows).
        ngram_min: usize,
        /// Most tokens verified in one pass besides the sampled one (8 by default).
        max_draft: usize,
        /// Propose as many tokens as pay, from the measured acceptance and cost of rows (the
        /// default); off, `max_draft` at every match (to measure, or to test without timing).
        adaptive: bool,
        /// Where a pass runs (the CPU's decode kernels by default; see [`Verify`]).
        verify: Verify,
    },
    /// The draft model set on the pipeline ([`crate::Pipeline::set_draft`]) proposes its greedy
    /// tokens, at most `max_draft` per pass.
    Draft {
        /// Most tokens proposed per pass (4 by default).
        max_draft: usize,
        /// Propose as many as pay, from the measured acceptance and the measured costs of the
        /// draft's steps and of the pass's rows; off, `max_draft` every step.
        adaptive: bool,
        /// Where a pass runs.
        verify: Verify,
    },
}

/// Where a verification pass runs (see the [module](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verify {
    /// The CPU's decode kernels, one pass over the weights for every row: the output is plain
    /// decoding's, token for token.
    #[default]
    Cpu,
    /// The NPU's stage graphs, the rows in one padded chunk: what the NPU's prefill gives.
    Npu,
}

impl Speculative {
    /// Prompt lookup with the default sizes.
    pub fn lookup() -> Self {
        Speculative::Lookup { ngram_max: 3, ngram_min: 2, max_draft: 8, adaptive: true, verify: Verify::Cpu }
    }

    /// The draft model's proposals with the default sizes.
    pub fn draft() -> Self {
        Speculative::Draft { max_draft: 4, adaptive: true, verify: Verify::Cpu }
    }

    /// The same proposer with its passes run on `verify` (no change when off).
    pub fn verified_on(self, verify: Verify) -> Self {
        match self {
            Speculative::Off => Speculative::Off,
            Speculative::Lookup { ngram_max, ngram_min, max_draft, adaptive, .. } => Speculative::Lookup { ngram_max, ngram_min, max_draft, adaptive, verify },
            Speculative::Draft { max_draft, adaptive, .. } => Speculative::Draft { max_draft, adaptive, verify },
        }
    }

    /// Where its passes run (`Cpu` when off).
    pub fn verify(&self) -> Verify {
        match *self {
            Speculative::Off => Verify::Cpu,
            Speculative::Lookup { verify, .. } | Speculative::Draft { verify, .. } => verify,
        }
    }

    /// Checks the sizes, before any work.
    pub fn validate(&self) -> Result<()> {
        match *self {
            Speculative::Off => Ok(()),
            Speculative::Lookup { ngram_max, ngram_min, max_draft, .. } => {
                if ngram_min == 0 || ngram_min > ngram_max {
                    return Err(Error::Input(format!("prompt lookup n-grams {ngram_min}..={ngram_max}: expected 1 <= min <= max")));
                }
                if max_draft == 0 || max_draft > MAX_DRAFT {
                    return Err(Error::Input(format!("prompt lookup of {max_draft} tokens per pass: expected 1 to {MAX_DRAFT}")));
                }
                Ok(())
            }
            Speculative::Draft { max_draft, .. } => match max_draft == 0 || max_draft > MAX_DRAFT {
                true => Err(Error::Input(format!("a draft of {max_draft} tokens per pass: expected 1 to {MAX_DRAFT}"))),
                false => Ok(()),
            },
        }
    }
}

/// The most tokens one verification pass takes (a pass's rows share each chunk of weights while
/// it is in cache; beyond 16 rows the kernels read the weights again).
pub const MAX_DRAFT: usize = 15;

/// Proposed and accepted tokens of one generation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpeculationStats {
    /// Verification passes (each of the sampled token and at least one proposed).
    pub passes: usize,
    /// Tokens proposed.
    pub proposed: usize,
    /// Proposed tokens that were the ones sampled.
    pub accepted: usize,
}

/// A proposer's state over one generation: how often proposals are right, and what a pass's
/// extra rows and the draft's steps cost, all measured as it goes; from them, how many tokens to
/// propose.
///
/// A pass of `1 + k` rows yields `1 + a + a^2 + ... + a^k` tokens on average (`a`: the chance a
/// proposed token is right when the ones before it were) and costs `1 + c k + d k` decode steps
/// (`c`: an extra row's cost, `d`: a drafted token's, 0 for prompt lookup, both relative to a
/// step's); `k` is chosen to make the ratio largest, and 0 (plain decode) when no `k` beats 1.
/// So a task with nothing to copy, a draft that guesses badly, or a CPU on which rows cost nearly
/// a step each, decodes as without speculation. On the NPU ([`Verify::Npu`]) a pass is one
/// padded chunk whatever its rows: it costs `1 + c + d k` steps for any `k`, `c` measured per
/// pass instead of per row. While not speculating, proposals are still judged against the tokens
/// sampled, so `a` stays measured: prompt lookup's at every step (free), a draft's in a probe
/// now and then (see [`PROBE_EVERY`]).
pub(crate) struct Proposer {
    /// Prompt lookup's n-gram sizes (largest, smallest); `None`: the draft model proposes.
    ngrams: Option<(usize, usize)>,
    max_draft: usize,
    adaptive: bool,
    /// A pass costs the same whatever its rows (the NPU's padded chunk): `row` is then a pass's
    /// extra cost, not a row's.
    flat: bool,
    /// Proposed tokens right, and proposed tokens judged, both decaying (recent passes count more).
    right: f64,
    judged: f64,
    /// Seconds of a decode step, of a pass per extra row beyond the step (per pass when `flat`),
    /// and of the draft per token it proposes, measured.
    step: Option<f64>,
    row: Option<f64>,
    drafted: Option<f64>,
    /// A proposal not verified (not worth a pass), checked against the tokens sampled.
    shadow: std::collections::VecDeque<u32>,
    shadow_right: usize,
    /// Tokens since the draft's last probe, and how many the next waits for.
    since_probe: usize,
    probe_every: usize,
}

/// Weight of the past in the acceptance and cost estimates, per pass or proposal judged.
const DECAY: f64 = 0.9;
/// An extra row's cost relative to a step until one is measured: what a memory-bound decode
/// would cost if the row's arithmetic were a fifth of a step's.
const ROW_COST_PRIOR: f64 = 0.2;
/// While a draft model is not worth a pass, it proposes [`PROBE_LEN`] tokens after this many, to
/// keep its acceptance measured; each probe that leaves it not worth a pass doubles the wait, up
/// to [`PROBE_MAX`]. A probe costs its draft steps and the draft's catch-up with the tokens since
/// the last one; the first prefills the conversation on the CPU. A draft that never paid cost
/// 10-20% of a 128-token answer (docs/speculative.md), less of a longer one.
pub const PROBE_EVERY: usize = 32;
/// The longest wait between a draft's probes.
pub const PROBE_MAX: usize = 512;
/// Tokens a draft's probe proposes.
pub const PROBE_LEN: usize = 4;

impl Proposer {
    pub(crate) fn new(spec: Speculative) -> Option<Self> {
        let (ngrams, max_draft, adaptive, verify) = match spec {
            Speculative::Off => return None,
            Speculative::Lookup { ngram_max, ngram_min, max_draft, adaptive, verify } => (Some((ngram_max, ngram_min)), max_draft, adaptive, verify),
            Speculative::Draft { max_draft, adaptive, verify } => (None, max_draft, adaptive, verify),
        };
        Some(Proposer {
            ngrams,
            max_draft,
            adaptive,
            flat: verify == Verify::Npu,
            // No prior: nothing is verified until proposals judged against what was sampled
            // show they are right, so a task with nothing to copy never pays for a pass.
            right: 0.0,
            judged: 1.0,
            step: None,
            row: None,
            drafted: None,
            shadow: Default::default(),
            shadow_right: 0,
            since_probe: PROBE_EVERY,
            probe_every: PROBE_EVERY,
        })
    }

    /// The chance a proposed token is right (when the ones before it were).
    fn accept(&self) -> f64 {
        self.right / self.judged.max(1e-9)
    }

    /// An extra row's cost (a pass's extra cost when `flat`) relative to a decode step.
    fn row_cost(&self) -> f64 {
        match (self.row, self.step) {
            (Some(r), Some(s)) if s > 0.0 => (r / s).max(0.0),
            _ => ROW_COST_PRIOR,
        }
    }

    /// Tokens worth proposing now: the `k` in `0..=max_draft` with the most tokens per step.
    pub(crate) fn draft_len(&self) -> usize {
        if !self.adaptive {
            return self.max_draft;
        }
        if self.step.is_none() {
            return 0; // a plain step first, to measure what rows cost against
        }
        let (a, c) = (self.accept(), self.row_cost());
        let d = match (self.drafted, self.step) {
            (Some(t), Some(s)) if s > 0.0 => t / s,
            _ => 0.0,
        };
        let (mut best, mut best_k, mut expected, mut power) = (1.0, 0, 1.0, 1.0);
        for k in 1..=self.max_draft {
            power *= a;
            expected += power;
            let rate = expected / (1.0 + c * if self.flat { 1.0 } else { k as f64 } + d * k as f64);
            if rate > best * 1.01 {
                (best, best_k) = (rate, k);
            }
        }
        best_k
    }

    /// Up to `want` tokens to follow `tokens`: prompt lookup's (those that followed the latest
    /// earlier occurrence of `tokens`' last n-gram, largest n first; none without a match), or
    /// the draft model's (then `draft` is needed; its time per token is measured).
    pub(crate) fn propose(&mut self, tokens: &[u32], want: usize, draft: Option<&mut Drafter>) -> Result<Vec<u32>> {
        if want == 0 {
            return Ok(vec![]);
        }
        let Some((ngram_max, ngram_min)) = self.ngrams else {
            let draft = draft.ok_or_else(|| Error::Input("speculative decoding with a draft model, but the pipeline has none: Pipeline::set_draft".into()))?;
            let t = std::time::Instant::now();
            let (proposal, fed) = draft.propose(tokens, want)?;
            // A catch-up with a new prompt is a prefill, paid once a turn: not a proposal's cost.
            if fed <= MAX_DRAFT + 1 && !proposal.is_empty() {
                let per = t.elapsed().as_secs_f64() / proposal.len() as f64;
                self.drafted = Some(self.drafted.map_or(per, |d| d * DECAY + per * (1.0 - DECAY)));
            }
            return Ok(proposal);
        };
        for n in (ngram_min..=ngram_max).rev() {
            if let Some(follow) = find_latest(tokens, n) {
                return Ok(tokens[follow..(follow + want).min(tokens.len())].to_vec());
            }
        }
        Ok(vec![])
    }

    /// How many tokens to propose for judging only, now that no pass is worth it: prompt
    /// lookup's are free, a draft's cost its steps (a probe now and then). None while one is
    /// being judged.
    pub(crate) fn shadow_len(&self) -> usize {
        match (self.shadow.is_empty(), self.ngrams) {
            (false, _) => 0,
            (true, Some(_)) => MAX_DRAFT,
            (true, None) => match self.since_probe >= self.probe_every {
                true => PROBE_LEN,
                false => 0,
            },
        }
    }

    /// A verification pass proposed `proposed` tokens, of which the first `accepted` were right.
    pub(crate) fn judged(&mut self, proposed: usize, accepted: usize) {
        let missed = (accepted < proposed) as usize;
        self.right = self.right * DECAY + accepted as f64;
        self.judged = self.judged * DECAY + (accepted + missed) as f64;
        if self.ngrams.is_none() {
            self.probe_every = match self.draft_len() {
                0 => (self.probe_every * 2).min(PROBE_MAX),
                _ => PROBE_EVERY,
            };
        }
    }

    /// A decode step of one row took `secs`.
    pub(crate) fn timed_step(&mut self, secs: f64) {
        self.step = Some(self.step.map_or(secs, |s| s * DECAY + secs * (1.0 - DECAY)));
    }

    /// A pass of `rows` rows took `secs`.
    pub(crate) fn timed_pass(&mut self, rows: usize, secs: f64) {
        if let (Some(step), true) = (self.step, rows > 1) {
            let per_row = (secs - step).max(0.0) / if self.flat { 1.0 } else { (rows - 1) as f64 };
            self.row = Some(self.row.map_or(per_row, |r| r * DECAY + per_row * (1.0 - DECAY)));
        }
    }

    /// Keeps `proposal` (not verified) to check against the tokens sampled next, unless one is
    /// still being checked (each proposal is judged whole, as a pass would have been).
    pub(crate) fn shadow(&mut self, proposal: Vec<u32>) {
        if self.shadow.is_empty() && !proposal.is_empty() {
            self.shadow = proposal.into();
            self.shadow_right = 0;
            self.since_probe = 0;
        }
    }

    /// `token` was sampled: judges the shadow proposal's next token, if one is pending.
    pub(crate) fn sampled(&mut self, token: u32) {
        self.since_probe += 1;
        let Some(guess) = self.shadow.pop_front() else { return };
        if guess == token {
            self.shadow_right += 1;
            if self.shadow.is_empty() {
                self.judged(self.shadow_right, self.shadow_right);
            }
        } else {
            self.judged(self.shadow_right + 1, self.shadow_right);
            self.shadow.clear();
        }
    }
}

/// A draft's weights ([`crate::Pipeline::set_draft`], [`crate::Pipeline::set_draft_layers`]).
pub(crate) enum Draft {
    /// A model of its own (a smaller one of the same tokenizer).
    Model(Box<Model>),
    /// The pipeline's model cut to its first layers: no weights of its own.
    FirstLayers(usize),
}

/// A conversation's draft: its KV cache and the tokens it holds (kept to the conversation's
/// longest common prefix with them), and which draft made them.
#[derive(Clone, Default)]
pub(crate) struct DraftState {
    seq: Sequence,
    held: Vec<u32>,
    /// The draft's model id and layers: a state another draft made is started again.
    of: Option<(String, usize)>,
}

/// A draft at work for one conversation: its model, how many of its layers run, its state.
pub(crate) struct Drafter<'a> {
    model: &'a Model,
    layers: usize,
    state: &'a mut DraftState,
}

impl<'a> Drafter<'a> {
    /// `draft` (of the pipeline whose model is `main`) on `state`.
    pub(crate) fn new(draft: &'a Draft, main: &'a Model, state: &'a mut DraftState) -> Result<Self> {
        let (model, layers) = match draft {
            Draft::Model(m) => (&**m, m.config().n_layer),
            Draft::FirstLayers(n) => (main, *n),
        };
        let of = Some((model.model_id().to_string(), layers));
        if state.of != of {
            *state = DraftState { seq: model.sequence_of_layers(layers)?, held: vec![], of };
        }
        Ok(Drafter { model, layers, state })
    }

    /// The draft's greedy continuation of `tokens`, `want` tokens (none where its context would
    /// end), and how many tokens it fed first to catch up with `tokens`. On an error its cache
    /// is emptied (the next proposal catches up from the start).
    fn propose(&mut self, tokens: &[u32], want: usize) -> Result<(Vec<u32>, usize)> {
        if tokens.is_empty() || tokens.len() + want > self.model.config().context_len {
            return Ok((vec![], 0));
        }
        let r = self.continue_greedily(tokens, want);
        if r.is_err() {
            self.state.seq.clear();
            self.state.held.clear();
        }
        r
    }

    fn continue_greedily(&mut self, tokens: &[u32], want: usize) -> Result<(Vec<u32>, usize)> {
        debug_assert_eq!(self.state.seq.kv.len(), self.layers);
        let (model, state) = (self.model, &mut *self.state);
        // The longest prefix it holds stays; at least the last token is fed again, for its logits.
        let common = state.held.iter().zip(tokens).take_while(|(a, b)| a == b).count().min(tokens.len() - 1);
        state.seq.rewind(common)?;
        state.held.truncate(common);
        let fed = &tokens[common..];
        // Its CPU path: decode steps, or candle's CPU prefill to catch up.
        let mut logits = match fed {
            [_] => model.decode_sequences(&mut [(&mut state.seq, fed)])?.squeeze(0)?,
            _ => model.prefill_sequence(&mut state.seq, fed, &PrefillOptions::default().rows(PrefillRows::Cpu))?,
        };
        state.held.extend_from_slice(fed);
        let mut out = Vec::with_capacity(want);
        loop {
            let d = argmax(&logits)?;
            out.push(d);
            if out.len() == want {
                return Ok((out, fed.len()));
            }
            logits = model.decode_sequences(&mut [(&mut state.seq, &[d])])?.squeeze(0)?;
            state.held.push(d);
        }
    }
}

/// Where the tokens after the latest earlier occurrence of `tokens`' last `n` tokens start:
/// `Some(i)` with `tokens[i - n..i]` equal to the suffix, `i < tokens.len()`, so that at least
/// one token follows.
fn find_latest(tokens: &[u32], n: usize) -> Option<usize> {
    let len = tokens.len();
    if n == 0 || len <= n {
        return None;
    }
    let suffix = &tokens[len - n..];
    // Candidate ends `i` from the latest (len - 1: the match ends just before the suffix's last
    // token) down to n.
    (n..len).rev().find(|&i| &tokens[i - n..i] == suffix)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(ngram_min: usize) -> Proposer {
        let Speculative::Lookup { ngram_max, max_draft, .. } = Speculative::lookup() else { unreachable!() };
        Proposer::new(Speculative::Lookup { ngram_max, ngram_min, max_draft, adaptive: true, verify: Verify::Cpu }).unwrap()
    }

    #[test]
    fn lookup_proposes_what_followed_the_latest_match_of_the_longest_ngram() {
        let mut l = lookup(1);
        // "1 2 3 9 9 | 1 2 3 7 7 7 | 5 1 2 3": the latest "1 2 3" was followed by 7 7 7 5.
        let t = [1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 7, 5, 1, 2, 3];
        assert_eq!(l.propose(&t, 4, None).unwrap(), [7, 7, 7, 5]);
        assert_eq!(l.propose(&t, 2, None).unwrap(), [7, 7], "as many as wanted");
        // No trigram match: the bigram "4 2" follows; no match at all: nothing.
        assert_eq!(l.propose(&[4, 2, 6, 8, 4, 2], 8, None).unwrap(), [6, 8, 4, 2]);
        assert!(l.propose(&[1, 2, 3, 4], 8, None).unwrap().is_empty());
        assert!(lookup(2).propose(&[5, 1, 6, 1], 8, None).unwrap().is_empty(), "a single token's match is not taken");
        // The suffix overlapping its own match (a repeated token) still proposes what follows.
        assert_eq!(l.propose(&[7, 7, 7], 8, None).unwrap(), [7]);
    }

    /// The draft length follows what proposals earn: long while they are right and rows are
    /// cheap, none when they are wrong or rows cost nearly a step; the shadow proposals keep
    /// the acceptance measured without passes.
    #[test]
    fn the_draft_is_as_long_as_it_pays() {
        let mut l = lookup(2);
        assert_eq!(l.draft_len(), 0, "a plain step first");
        let fixed = Proposer::new(Speculative::Lookup { ngram_max: 3, ngram_min: 2, max_draft: 5, adaptive: false, verify: Verify::Cpu }).unwrap();
        assert_eq!(fixed.draft_len(), 5, "not adaptive: always the most");
        l.timed_step(0.010);
        assert_eq!(l.draft_len(), 0, "no pass before a proposal was right");
        l.shadow(vec![1, 2, 3]);
        [1, 2, 3].into_iter().for_each(|t| l.sampled(t));
        assert!(l.draft_len() >= 2, "a shadow proposal that was right: {}", l.draft_len());
        for _ in 0..20 {
            l.judged(8, 8);
        }
        assert_eq!(l.draft_len(), 8, "always right, rows cheap: the most");
        l.timed_pass(9, 0.010 + 8.0 * 0.011);
        assert_eq!(l.draft_len(), 0, "rows dearer than a step: plain decode, even all right");
        for _ in 0..40 {
            l.timed_pass(9, 0.010 + 8.0 * 0.0005);
        }
        assert_eq!(l.draft_len(), 8, "cheap rows again");
        // (The past decays by 0.9 a pass: after 80 wrong ones it weighs nothing.)
        for _ in 0..80 {
            l.judged(4, 0);
        }
        assert_eq!(l.draft_len(), 0, "never right: plain decode");
        // A shadow proposal is judged whole: a second one while it is checked is not taken.
        l.shadow(vec![5, 6]);
        l.shadow(vec![9, 9]);
        l.sampled(5);
        assert_eq!(l.shadow, [6]);
        // Shadow proposals, all right, bring it back without a pass.
        for _ in 0..30 {
            l.shadow(vec![1, 2, 3]);
            [1, 2, 3].into_iter().for_each(|t| l.sampled(t));
        }
        assert!(l.draft_len() >= 4, "{}", l.draft_len());
    }

    /// On the NPU a pass costs the same for any rows: the draft is all or nothing, as the
    /// acceptance makes a whole pass pay or not.
    #[test]
    fn a_pass_of_flat_cost_takes_the_most_rows_or_none() {
        let mut l = Proposer::new(Speculative::lookup().verified_on(Verify::Npu)).unwrap();
        l.timed_step(0.010);
        for _ in 0..40 {
            l.timed_pass(9, 0.030); // a pass: three steps, whatever its rows
            l.judged(8, 7); // acceptance 0.875: 8 tokens a pass on average
        }
        assert_eq!(l.draft_len(), 8, "right often: the most rows, at no extra cost");
        // The same costs charged per row would have made long drafts dear: fewer rows.
        let mut per_row = lookup(2);
        per_row.timed_step(0.010);
        for _ in 0..40 {
            per_row.timed_pass(9, 0.030);
            per_row.judged(8, 7);
        }
        assert!(per_row.draft_len() < 8, "{}", per_row.draft_len());
        for _ in 0..80 {
            l.judged(4, 1); // one right, then a miss: 0.5, about 2 tokens a pass for 3 steps
        }
        assert_eq!(l.draft_len(), 0, "rarely right: plain decode");
    }

    /// A draft's proposals cost its steps: none are made for nothing but a probe every
    /// `PROBE_EVERY` tokens, and the draft is as long as its acceptance pays for its steps too.
    #[test]
    fn a_draft_probes_now_and_then_and_pays_for_its_steps() {
        let mut l = Proposer::new(Speculative::Draft { max_draft: 8, adaptive: true, verify: Verify::Cpu }).unwrap();
        assert_eq!(l.shadow_len(), PROBE_LEN, "a probe at once");
        l.shadow(vec![1, 2, 3, 4]);
        assert_eq!(l.shadow_len(), 0, "none while one is judged");
        [1, 2, 5].into_iter().for_each(|t| l.sampled(t)); // two right, then a miss
        assert_eq!(l.shadow_len(), 0, "the next probe waits");
        (3..PROBE_EVERY).for_each(|t| l.sampled(t as u32));
        // (No step measured yet: no pass is worth it, so the wait doubled.)
        assert_eq!(l.shadow_len(), 0, "the wait doubled after a probe that did not pay");
        (0..PROBE_EVERY).for_each(|t| l.sampled(t as u32));
        assert_eq!(l.shadow_len(), PROBE_LEN);
        l.shadow(vec![]);
        assert_eq!(l.shadow_len(), PROBE_LEN, "no proposal (the context's end) is no probe");
        // Right 7 of 8, rows cheap: the draft's cost decides the length.
        l.timed_step(0.010);
        for _ in 0..40 {
            l.timed_pass(9, 0.010 + 8.0 * 0.001);
            l.judged(8, 7);
        }
        let at = |l: &mut Proposer, drafted: f64| {
            l.drafted = Some(drafted);
            l.draft_len()
        };
        let (cheap, dear) = (at(&mut l, 0.0005), at(&mut l, 0.004));
        assert!(cheap >= 4 && dear < cheap, "a draft step of 5% of a step: {cheap}; of 40%: {dear}");
        assert_eq!(at(&mut l, 0.010), 0, "a draft step as dear as the model's: plain decode");
        assert_eq!(l.probe_every, PROBE_EVERY, "the passes that paid brought the wait back");
        (0..10).for_each(|_| l.judged(4, 0));
        assert_eq!(l.probe_every, PROBE_MAX, "probes that never pay: the longest wait");
    }

    #[test]
    fn sizes_are_checked() {
        assert!(Speculative::lookup().validate().is_ok());
        for bad in [
            Speculative::Lookup { ngram_max: 3, ngram_min: 0, max_draft: 8, adaptive: true, verify: Verify::Cpu },
            Speculative::Lookup { ngram_max: 1, ngram_min: 2, max_draft: 8, adaptive: true, verify: Verify::Cpu },
            Speculative::Lookup { ngram_max: 3, ngram_min: 1, max_draft: 0, adaptive: true, verify: Verify::Cpu },
            Speculative::Lookup { ngram_max: 3, ngram_min: 1, max_draft: MAX_DRAFT + 1, adaptive: false, verify: Verify::Cpu },
            Speculative::Draft { max_draft: 0, adaptive: true, verify: Verify::Cpu },
            Speculative::Draft { max_draft: MAX_DRAFT + 1, adaptive: true, verify: Verify::Npu },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
