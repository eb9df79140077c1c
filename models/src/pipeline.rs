//! Everything a program needs around a [`Model`]: tokenizer, chat template, stop tokens, and the
//! quant profile (loaded from disk, or calibrated on real text and saved for the next run).

use std::path::{Path, PathBuf};

use candle_npu::{ClipMethod, Error, NpuDevice, QuantProfile, Result};
use tokenizers::Tokenizer;

use crate::chat::{ChatTemplate, JinjaTemplate, Message, TemplateSource};
use crate::gguf::Gguf;
use crate::speculative::Draft;
use crate::transformer::{LoadOptions, Model, Precision};

/// A loaded model with what a program needs around it: its tokenizer, chat template and stop
/// tokens, and the path its quant profile is kept next to. Generation: [`Pipeline::generate`] and
/// [`Pipeline::session`].
pub struct Pipeline {
    /// The engine: prefill on the device, decode on the CPU.
    pub model: Model,
    /// From the GGUF's metadata or the folder's `tokenizer.json` (or the file given at load).
    pub tokenizer: Tokenizer,
    /// The model's own chat template (its Jinja text), rendered over a conversation's
    /// [`Message`]s; `None` when the model has none, or one that does not compile (then
    /// [`Pipeline::template`] renders, and a warning said so).
    pub jinja: Option<JinjaTemplate>,
    /// The well-known turn format the template text has ([`ChatTemplate::None`]: prompts as they
    /// are): the fallback of [`Pipeline::jinja`], and the end-of-turn stop tokens.
    pub template: ChatTemplate,
    /// Token ids that end generation (EOS and the template's end-of-turn).
    pub stop_tokens: Vec<u32>,
    /// The model file or folder it was loaded from.
    pub model_path: PathBuf,
    /// Ids of the embedding that have no token in the tokenizer (a vocabulary padded to a round
    /// size): they have no text, so generation never samples them.
    pub(crate) textless: Vec<u32>,
    /// The longest prompt (bytes) taken ([`Pipeline::check_prompt`]).
    prompt_limit: usize,
    /// The draft model of [`crate::Speculative::Draft`] ([`Pipeline::set_draft`]).
    pub(crate) draft: Option<Draft>,
    /// Every file the pipeline read (or reads again): its model, tokenizer, profile, draft.
    reads: Vec<PathBuf>,
}

/// Which text calibration reads (user texts: [`Pipeline::calibrate_on`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CalibrationSource {
    /// The text shipped inside this crate (public-domain prose, `models/data/README.md`): needs
    /// no file at run time.
    #[default]
    Shipped,
    /// Wikipedia lead sections from the assets `scripts/setup.sh` fetches (the articles held
    /// out from evaluation): the eval's calibration, for its figures to be reproduced.
    Wikipedia,
}

/// The shipped calibration text (see [`CalibrationSource::Shipped`]).
pub const SHIPPED_CALIBRATION_TEXT: &str = include_str!("../data/calibration.txt");

/// The shipped calibration conversations (`models/data/calibration_chat.jsonl`, one JSON object
/// a line: `{"messages": [...]}`, each ending with the assistant's answer): see
/// [`CalibrationSet::chats`].
pub const SHIPPED_CALIBRATION_CHATS: &str = include_str!("../data/calibration_chat.jsonl");

/// How calibration runs: over how much text and which, how clip ranges are chosen, and on how
/// many of those sequences layer importance is measured (0: not measured, so no pruning).
#[derive(Debug, Clone, Copy)]
pub struct CalibrationSet {
    /// The text calibrated on.
    pub source: CalibrationSource,
    /// Windows of text run through the layers (4 by default: `docs/eval.md`, "Calibration
    /// size", measured 2, 4 and 8 equally accurate on the three real models).
    pub sequences: usize,
    /// Tokens per window, 1 up to the model's context (256 by default).
    pub seq_len: usize,
    /// Windows of chat, after the text's: the shipped conversations
    /// ([`SHIPPED_CALIBRATION_CHATS`]) rendered in the model's own template, each window starting
    /// with a conversation's first token, so that the template's control tokens, system prompts
    /// and turns are seen where a prompt has them (prose never holds them). 0: text only.
    pub chats: usize,
    /// How each point's clip range is chosen from the values observed (by default at most
    /// [`DEFAULT_OUTLIER_BUDGET`] of them beyond it).
    pub clip: ClipMethod,
    /// Windows, the first of `sequences`, on which each layer's shadow importance is measured
    /// for pruning (1 + layers W8A8 passes over them); 0 measures none, the default while
    /// [`DEFAULT_PRUNE_RATE`] is 0.
    pub importance_sequences: usize,
    /// The hot set: the channels that held this share of the calibration text's outliers (a
    /// second, W8A8 pass counts them); 1.0 keeps every channel that had any (no second pass).
    pub hot_coverage: f64,
}

/// The outlier budget of the default clip ranges: at most this share of calibration values lies
/// beyond a point's range (see `docs/shadow.md`, "Clip budget", for the measured choice).
pub const DEFAULT_OUTLIER_BUDGET: f64 = 1e-2;

/// The share of layers whose shadow path is pruned by default, chosen from the measured
/// perplexity / shadow-time curve (`docs/eval.md`, "Pruning curve").
pub const DEFAULT_PRUNE_RATE: f64 = 0.0;

/// The share of calibration outliers the hot channels hold by default (`docs/memory.md`: the
/// measured memory / shadow-time trade-off).
pub const DEFAULT_HOT_COVERAGE: f64 = 1.0;

impl Default for CalibrationSet {
    fn default() -> Self {
        // Importance costs 1 + layers W8A8 passes (about 80 s for SmolLM2 on 2 cores at two
        // sequences); while the default prune rate is 0 the first run does not pay for it.
        let importance_sequences = if DEFAULT_PRUNE_RATE > 0.0 { 2 } else { 0 };
        CalibrationSet {
            source: CalibrationSource::Shipped,
            sequences: 4,
            seq_len: 256,
            chats: 0,
            clip: ClipMethod::Budget { fraction: DEFAULT_OUTLIER_BUDGET },
            importance_sequences,
            hot_coverage: DEFAULT_HOT_COVERAGE,
        }
    }
}

impl CalibrationSet {
    /// An [`Error::Input`] naming the first setting that cannot be calibrated with: a clip
    /// budget or hot coverage that is not a share (NaN, negative, beyond 1), no windows, or empty
    /// ones. (A NaN coverage used to skip the counting pass and be saved as `null`, which the
    /// profile's loader then refused.)
    pub fn check(&self) -> Result<()> {
        self.clip.check()?;
        if !(0.0..=1.0).contains(&self.hot_coverage) {
            return Err(Error::Input(format!("hot coverage {}: the share of outliers the hot channels hold must be within 0..=1", self.hot_coverage)));
        }
        if self.sequences == 0 || self.seq_len == 0 {
            return Err(Error::Input(format!("calibration on {} sequences of {} tokens: need at least one token", self.sequences, self.seq_len)));
        }
        Ok(())
    }
}

impl Pipeline {
    /// Load a model of a supported family, with its tokenizer: a GGUF file (tokenizer and chat
    /// template from its metadata) or an HF folder (`tokenizer.json`, `tokenizer_config.json`);
    /// `tokenizer` overrides either.
    pub fn load(path: &Path, tokenizer: Option<&Path>, device: &NpuDevice, opts: LoadOptions) -> Result<Self> {
        warn_oversubscribed();
        if path.is_dir() {
            return Self::load_hf(path, tokenizer, device, opts);
        }
        let g = std::sync::Arc::new(Gguf::open(path)?);
        crate::families::check_gguf(&g)?;
        let tok = match tokenizer {
            Some(p) => crate::tokenizer::from_file(p)?,
            None => crate::tokenizer::from_gguf(&g)?,
        };
        let template = ChatTemplate::from_gguf(&g);
        let token = |key: &str| g.u32(key).ok().and_then(|id| tok.id_to_token(id)).unwrap_or_default();
        let source = g.string("tokenizer.chat_template").ok().map(|text| TemplateSource {
            text,
            bos: token("tokenizer.ggml.bos_token_id"),
            eos: token("tokenizer.ggml.eos_token_id"),
        });
        let mut stop_tokens: Vec<u32> = g.u32("tokenizer.ggml.eos_token_id").into_iter().collect();
        let model = crate::families::load_gguf(g, device, opts)?;
        for s in template.stop_strings() {
            stop_tokens.extend(tok.token_to_id(s));
        }
        let textless = check_tokenizer(&tok, &model, &stop_tokens, path)?;
        let prompt_limit = prompt_limit(&tok, model.config().context_len);
        let jinja = compile_template(source, &template, path, prompt_limit);
        let reads = [Some(path), tokenizer].into_iter().flatten().map(Path::to_path_buf).collect();
        Ok(Pipeline { model, tokenizer: tok, jinja, template, stop_tokens, model_path: path.to_path_buf(), textless, prompt_limit, draft: None, reads })
    }

    /// An HF folder: `config.json`, `*.safetensors`, `tokenizer.json` (or `tokenizer`), and the
    /// chat template of `tokenizer_config.json` when there is one.
    fn load_hf(dir: &Path, tokenizer: Option<&Path>, device: &NpuDevice, opts: LoadOptions) -> Result<Self> {
        let model = crate::hf::load(dir, device, opts)?;
        let tok = crate::tokenizer::from_file(tokenizer.unwrap_or(&dir.join("tokenizer.json")))?;
        let tc = dir.join("tokenizer_config.json");
        let source = if candle_npu::fs::exists(&tc)? { crate::chat::template_source(&tc)? } else { None };
        let template = source.as_ref().map_or(ChatTemplate::None, |s| ChatTemplate::from_template_text(&s.text));
        let mut stop_tokens = crate::hf::HfConfig::open(dir)?.eos_token_ids()?;
        for s in template.stop_strings() {
            stop_tokens.extend(tok.token_to_id(s));
        }
        let textless = check_tokenizer(&tok, &model, &stop_tokens, dir)?;
        let prompt_limit = prompt_limit(&tok, model.config().context_len);
        let jinja = compile_template(source, &template, &tc, prompt_limit);
        let reads = [Some(dir), tokenizer].into_iter().flatten().map(Path::to_path_buf).collect();
        Ok(Pipeline { model, tokenizer: tok, jinja, template, stop_tokens, model_path: dir.to_path_buf(), textless, prompt_limit, draft: None, reads })
    }

    /// Sets the draft model that [`crate::Speculative::Draft`] proposes with: a smaller model of
    /// the same tokenizer (SmolLM2-135M for a larger SmolLM2), or this model's own first layers
    /// ([`LoadOptions::layers`]). It runs on the CPU only (its decode path: no profile, no NPU
    /// graphs), so load it with `Precision::F32` on the host. A draft whose tokenizer reads text
    /// otherwise, or whose vocabulary differs, is an error naming both files.
    pub fn set_draft(&mut self, draft: Pipeline) -> Result<()> {
        // The same vocabulary, and the same tokens for a text with words, digits, punctuation,
        // whitespace runs and non-ASCII letters.
        const PROBE: &str = "Draft check: the quick brown fox, 1234 fn main() {  }\n\tnaïve Zürich 東京 ✓";
        let (ours, theirs) = (self.encode_piece(PROBE)?, draft.encode_piece(PROBE)?);
        let (v, dv) = (self.model.config().vocab, draft.model.config().vocab);
        if v != dv || ours != theirs {
            return Err(Error::Input(format!(
                "the draft {} does not share the tokenizer of {} (vocabularies of {dv} and {v}; a probe text gives {} and {} tokens{})",
                draft.model_path.display(),
                self.model_path.display(),
                theirs.len(),
                ours.len(),
                if theirs.len() == ours.len() { ", other ids" } else { "" }
            )));
        }
        tracing::info!("draft model for speculative decoding: {} ({} layers)", draft.model_path.display(), draft.model.config().n_layer);
        self.reads.extend(draft.reads);
        self.draft = Some(Draft::Model(Box::new(draft.model)));
        Ok(())
    }

    /// Sets this model's own first `layers` (then its final norm and output) as the draft that
    /// [`crate::Speculative::Draft`] proposes with: no weights of its own, the model's decode
    /// path on the CPU ([`Model::sequence_of_layers`]). `layers` from 1 to the model's.
    pub fn set_draft_layers(&mut self, layers: usize) -> Result<()> {
        self.model.check_draft_layers(layers)?;
        tracing::info!("draft for speculative decoding: the model's first {layers} layers of {}", self.model.config().n_layer);
        self.draft = Some(Draft::FirstLayers(layers));
        Ok(())
    }

    /// An [`Error::Input`] when writing `path` would replace a file this pipeline read (its
    /// model or a file of its folder, tokenizer, profile, draft): `what` names the output.
    /// [`crate::Session::save`] checks its path so.
    pub fn check_output(&self, path: &Path, what: &str) -> Result<()> {
        let reads: Vec<&Path> = self.reads.iter().map(PathBuf::as_path).collect();
        candle_npu::fs::check_not_an_input(path, what, &reads)
    }

    /// The draft's model and how many of its layers it runs ([`Pipeline::set_draft`]: a model
    /// of its own, all its layers; [`Pipeline::set_draft_layers`]: this model, its first ones).
    pub fn draft(&self) -> Option<(&Model, usize)> {
        self.draft.as_ref().map(|d| match d {
            Draft::Model(m) => (&**m, m.config().n_layer),
            Draft::FirstLayers(n) => (&self.model, *n),
        })
    }

    /// Token ids of a prompt, with the special tokens the tokenizer adds (Gemma's BOS), wrapped
    /// in the chat template when `chat`. Control tokens spelled in `text` (`<|im_end|>`) are
    /// plain text: only the template's markers are control tokens ([`Pipeline::encode_with`]).
    pub fn encode(&self, text: &str, chat: bool) -> Result<Vec<u32>> {
        self.encode_with(text, chat, false)
    }

    /// [`Pipeline::encode`], and with `parse_special` the control tokens spelled in `text` become
    /// those tokens (llama.cpp's `parse_special`): for text the caller trusts as much as the
    /// template, since it can close the user's turn and write the assistant's.
    pub fn encode_with(&self, text: &str, chat: bool, parse_special: bool) -> Result<Vec<u32>> {
        if chat {
            return self.encode_chat(&[Message::user(text)], true, parse_special);
        }
        self.check_prompt(text)?;
        crate::tokenizer::encode_user(&self.tokenizer, "", text, "", true, parse_special)
    }

    /// Token ids of a conversation in the model's chat template (its own Jinja template, else
    /// the well-known format its text has): with `add_generation_prompt`, ending where the
    /// assistant's answer starts. The template's markers are control tokens; those spelled in
    /// the messages are text unless `parse_special`. BOS as the tokenizer adds it, unless the
    /// template writes it itself.
    pub fn encode_chat(&self, messages: &[Message], add_generation_prompt: bool, parse_special: bool) -> Result<Vec<u32>> {
        crate::chat::check_roles(messages).map_err(Error::Input)?;
        // Bounded as a whole: without markers between them (no template) the messages are one text.
        let text: String = messages.iter().map(|m| m.content.as_str()).collect();
        self.check_prompt(&text)?;
        let (segments, bos) = match &self.jinja {
            Some(j) => (j.segments(messages, add_generation_prompt)?, j.bos()),
            None => (self.template.segments(messages, add_generation_prompt), ""),
        };
        let writes_bos = !bos.is_empty() && segments.first().is_some_and(|(t, trusted)| *trusted && t.starts_with(bos));
        let pieces: Vec<(&str, bool)> = segments.iter().map(|(t, trusted)| (t.as_str(), *trusted || parse_special)).collect();
        crate::tokenizer::encode_segments(&self.tokenizer, &pieces, !writes_bos)
    }

    /// Token ids of `text` alone: no BOS/EOS (a piece of a longer text), control tokens spelled
    /// in it as plain text (to match them: `crate::tokenizer::encode(&p.tokenizer, text, false)`).
    pub fn encode_piece(&self, text: &str) -> Result<Vec<u32>> {
        self.check_prompt(text)?;
        crate::tokenizer::encode_user(&self.tokenizer, "", text, "", false, false)
    }

    /// The text of `ids` (special tokens included as text).
    pub fn decode_text(&self, ids: &[u32]) -> Result<String> {
        decode(&self.tokenizer, ids)
    }

    /// For W8A8 and W8A16: load the profile at `path` (default: next to the model), or calibrate on
    /// `set`'s text (by default the one shipped in this crate) and save it there; then prune the shadow path at [`DEFAULT_PRUNE_RATE`].
    /// A profile made for other weights, or by an older build, is an error that says what to do.
    pub fn ensure_profile(&mut self, path: Option<&Path>, set: CalibrationSet, progress: impl FnMut(usize, usize)) -> Result<()> {
        if self.model.precision() == Precision::F32 {
            return Ok(());
        }
        let path = path.map(Path::to_path_buf).unwrap_or_else(|| default_profile_path(&self.model_path));
        if !self.reads.contains(&path) {
            self.reads.push(path.clone());
        }
        if candle_npu::fs::exists(&path)? {
            let p = QuantProfile::load(&path, self.model.model_id())?;
            tracing::info!(path = %path.display(), tokens = p.tokens, "loaded quant profile");
            // Its refusals name the file they came from.
            self.model.set_profile(p).map_err(|e| match e {
                Error::Input(reason) => Error::Profile { path: path.clone(), reason: format!("{reason}; delete it to recalibrate") },
                Error::MissingRange(point) => Error::Profile {
                    path: path.clone(),
                    reason: format!("no range for point {point}: not a profile of this model's layers; delete it to recalibrate"),
                },
                e => e,
            })?;
        } else {
            // Before the minutes of calibration, not after.
            candle_npu::fs::check_writable(&path)?;
            let p = self.calibrate(set, progress)?;
            p.save(&path)?;
            tracing::info!(path = %path.display(), tokens = p.tokens, "saved quant profile");
        }
        if DEFAULT_PRUNE_RATE > 0.0 && !self.model.profile().is_some_and(|p| p.importance.is_empty()) {
            self.model.prune_shadow(DEFAULT_PRUNE_RATE)?;
        }
        Ok(())
    }

    /// Calibrate on `set.sequences` windows of `set.seq_len` tokens of `set.source`'s text: clip
    /// ranges and hot channels (narrowed to `set.hot_coverage` of the outliers by a counting
    /// pass when it is below 1), then (if `set.importance_sequences > 0`) each layer's shadow
    /// importance on the first `importance_sequences` of those windows. The model uses the profile afterwards.
    /// `progress(done, total)` counts sequences, counting passes, then importance passes.
    pub fn calibrate(&mut self, set: CalibrationSet, progress: impl FnMut(usize, usize)) -> Result<QuantProfile> {
        let seqs = self.calibration_sequences(set)?;
        self.calibrate_on(&seqs, set, progress)
    }

    /// Calibrates on the caller's token sequences (of the caller's own texts, say: see
    /// [`Pipeline::token_sequences`]); `set` gives the clip method, importance and hot coverage
    /// (its source and sizes are not used). Returns the profile, which the model now uses.
    pub fn calibrate_on(&mut self, seqs: &[Vec<u32>], set: CalibrationSet, mut progress: impl FnMut(usize, usize)) -> Result<QuantProfile> {
        set.check()?;
        let (ctx, chunk_len) = (self.model.config().context_len, self.model.chunk_len());
        if seqs.is_empty() || seqs.iter().any(|s| s.is_empty() || s.len() > ctx) {
            return Err(Error::Input(format!("calibration needs at least one sequence, each of 1..={ctx} tokens")));
        }
        let n_imp = set.importance_sequences.min(seqs.len());
        let passes = if n_imp > 0 { self.model.config().n_layer + 1 } else { 0 };
        let count_pass = if set.hot_coverage < 1.0 { seqs.len() } else { 0 };
        let total = seqs.len() + count_pass + passes;
        // Said through `tracing` too, every tenth of the way: a first run without a progress
        // closure (the caller's) is otherwise silent for a minute or more.
        let (started, mut said) = (std::time::Instant::now(), 0);
        tracing::info!(sequences = seqs.len(), passes = total, "calibrating the model's activation ranges (once: the profile is saved and reused)");
        let mut progress = |done: usize, total: usize| {
            progress(done, total);
            if done * 10 / total.max(1) > said {
                said = done * 10 / total.max(1);
                tracing::info!("calibration {}% ({done} of {total} passes, {:.0}s)", 10 * said, started.elapsed().as_secs_f64());
            }
        };
        let cal = self.model.calibrate(seqs, |i| progress(i, total))?;
        let mut profile = cal.finish(self.model.model_id().to_string(), set.clip);
        self.model.set_profile(profile.clone())?;
        if count_pass > 0 {
            let counts = self.model.count_channel_outliers(seqs, chunk_len, |i| progress(seqs.len() + i, total))?;
            profile.select_hot(&counts, set.hot_coverage)?;
            self.model.set_profile(profile.clone())?;
        }
        if n_imp > 0 {
            let done = seqs.len() + count_pass;
            // Stored in the model's profile too: no second set_profile (it rebuilds every hot set).
            profile.importance = self.model.measure_importance(&seqs[..n_imp], chunk_len, |i, _| progress(done + i, total))?;
        }
        Ok(profile)
    }

    /// The token sequences [`Pipeline::calibrate`] runs on: `set.sequences` of `set.seq_len`
    /// tokens of `set.source`'s text, then `set.chats` windows of conversations
    /// ([`Pipeline::chat_sequences`]).
    pub fn calibration_sequences(&self, set: CalibrationSet) -> Result<Vec<Vec<u32>>> {
        set.check()?;
        if set.seq_len > self.model.config().context_len {
            let (n, len, ctx) = (set.sequences, set.seq_len, self.model.config().context_len);
            return Err(Error::Input(format!(
                "calibration on {n} windows of {len} tokens: the model's context holds {ctx}; calibrate on windows of at most {ctx} tokens (CalibrationSet::seq_len), or use the F32 prefill (--f32-prefill)"
            )));
        }
        let texts = match set.source {
            CalibrationSource::Shipped => SHIPPED_CALIBRATION_TEXT.split("\n\n").map(str::to_string).collect(),
            CalibrationSource::Wikipedia => crate::assets::wiki_calibration(set.sequences.saturating_mul(set.seq_len) / 40 + 8)?,
        };
        let mut seqs = self.token_sequences(texts, set.sequences, set.seq_len)?;
        seqs.extend(self.chat_sequences(set.chats, set.seq_len)?);
        Ok(seqs)
    }

    /// Up to `n` windows of at most `seq_len` tokens of the shipped conversations in the model's
    /// template: each window starts with a conversation and takes the following ones while they
    /// fit whole (the first one is cut if it alone is longer).
    pub fn chat_sequences(&self, n: usize, seq_len: usize) -> Result<Vec<Vec<u32>>> {
        #[derive(serde::Deserialize)]
        struct Chat {
            messages: Vec<Message>,
        }
        let mut out: Vec<Vec<u32>> = Vec::with_capacity(n);
        if n == 0 {
            return Ok(out);
        }
        for line in SHIPPED_CALIBRATION_CHATS.lines().filter(|l| !l.trim().is_empty()) {
            let chat: Chat = serde_json::from_str(line).map_err(|e| Error::Internal(format!("calibration_chat.jsonl: {e}")))?;
            // One longer than a prompt may be (a model of a small context) is left out.
            if chat.messages.iter().map(|m| m.content.len()).sum::<usize>() > self.prompt_limit {
                continue;
            }
            let mut ids = self.encode_chat(&chat.messages, false, false)?;
            let windows = out.len();
            match out.last_mut() {
                Some(last) if last.len() + ids.len() <= seq_len => last.extend(ids),
                _ if windows < n => {
                    ids.truncate(seq_len);
                    out.push(ids);
                }
                _ => break,
            }
        }
        Ok(out)
    }

    /// `texts` joined by blank lines and cut into (at most) `sequences` sequences of `seq_len`
    /// tokens each, for [`Pipeline::calibrate_on`]; an error when they hold fewer than one.
    pub fn token_sequences(&self, texts: impl IntoIterator<Item = String>, sequences: usize, seq_len: usize) -> Result<Vec<Vec<u32>>> {
        if seq_len == 0 {
            return Err(Error::Input("calibration sequences of 0 tokens".into()));
        }
        let total = sequences.checked_mul(seq_len).ok_or_else(|| Error::Input(format!("{sequences} calibration sequences of {seq_len} tokens: too many")))?;
        let ids = self.encode_texts(texts, total)?;
        let seqs: Vec<Vec<u32>> = ids.chunks_exact(seq_len).take(sequences).map(<[u32]>::to_vec).collect();
        if seqs.is_empty() {
            return Err(Error::Input(format!("not enough calibration text for one sequence of {seq_len} tokens")));
        }
        Ok(seqs)
    }

    /// The first `n` tokens of held-out Wikipedia text (articles never used for calibration),
    /// fewer if the text runs out.
    pub fn heldout_tokens(&self, n: usize) -> Result<Vec<u32>> {
        // The last 200 articles (more for long requests): the text the tests measured on.
        self.encode_texts(crate::assets::wiki_heldout((n / 40 + 8).max(200))?, n)
    }

    /// Tokens of `texts` joined by blank lines, up to `n`, after the special tokens a prompt
    /// starts with (Gemma's BOS).
    pub fn encode_texts(&self, texts: impl IntoIterator<Item = String>, n: usize) -> Result<Vec<u32>> {
        let sep = self.encode_piece("\n\n")?;
        let mut ids = self.encode("", false)?;
        for text in texts {
            // A text longer than a prompt may be (a model of a small context) in pieces, cut
            // at whitespace: it is cut into windows anyway.
            for piece in split_at_whitespace(&text, self.prompt_limit) {
                if ids.len() >= n {
                    break;
                }
                ids.extend(self.encode_piece(piece)?);
            }
            if ids.len() >= n {
                break;
            }
            ids.extend(&sep);
        }
        ids.truncate(n);
        Ok(ids)
    }
}

/// The model's Jinja template from `source`, or `None`, saying why once: the model has no
/// template (a base model: prompts go to it as they are), or it does not compile (the
/// hand-written `fallback` format renders instead). `from` names the file in the log.
fn compile_template(source: Option<TemplateSource>, fallback: &ChatTemplate, from: &Path, max_text: usize) -> Option<JinjaTemplate> {
    let Some(s) = source else {
        tracing::warn!(model = %from.display(), "the model has no chat template (a base model?): prompts go to it as they are");
        return None;
    };
    JinjaTemplate::new(&s.text, &s.bos, &s.eos)
        .map(|t| t.from_file(from).max_text(max_text))
        .inspect_err(|e| tracing::warn!(file = %from.display(), error = %e, fallback = ?fallback, "the chat template does not compile: the well-known format its text has renders instead"))
        .ok()
}

/// Where [`Pipeline::ensure_profile`] keeps a model's profile unless told otherwise: inside an
/// HF folder, next to a GGUF file ([`QuantProfile::default_path`]).
pub fn default_profile_path(model: &Path) -> PathBuf {
    match model.is_dir() {
        true => model.join("candle-npu.w8a8.json"),
        false => QuantProfile::default_path(model),
    }
}

/// Threads per core beyond which a pool is oversubscribed: every parallel loop waits on its
/// slowest thread, and `RAYON_NUM_THREADS=1000` on 2 cores turned a 1 s load into minutes.
pub const MAX_THREADS_PER_CORE: usize = 4;

/// Warns when the thread pool has more than [`MAX_THREADS_PER_CORE`].
fn warn_oversubscribed() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = rayon::current_num_threads();
    if threads > MAX_THREADS_PER_CORE * cores {
        tracing::warn!(threads, cores, "the thread pool has more than {MAX_THREADS_PER_CORE} threads per core: loading and prefill slow down many times; set RAYON_NUM_THREADS to at most the cores");
    }
}

/// `text` in pieces of at most `max` bytes (at least one character each), each cut after the
/// last whitespace within the bound where there is one.
fn split_at_whitespace(text: &str, max: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut end = rest.len().min(max.max(1));
        while !rest.is_char_boundary(end) {
            end -= 1;
        }
        if end < rest.len() {
            // Just after the whitespace character (never 0: it is at least one byte).
            end = rest[..end].rfind(char::is_whitespace).map(|i| i + rest[i..].chars().next().map_or(1, char::len_utf8)).unwrap_or(end);
        }
        // A first character longer than `max` goes whole.
        if end == 0 {
            end = rest.chars().next().map_or(rest.len(), char::len_utf8);
        }
        let (piece, after) = rest.split_at(end);
        rest = after;
        Some(piece)
    })
}

/// The most bytes of normalized text a prompt may become: far more than any context holds (a
/// million tokens of 64 bytes), far less than a machine's memory.
const NORMALIZED_LIMIT: f64 = (64u64 << 20) as f64;

/// The longest text (bytes) a pipeline encodes: what a context of the tokenizer's longest tokens
/// can hold, and what its normalizer, at its largest growth, keeps within [`NORMALIZED_LIMIT`].
/// Checked before `tokenizers` sees the text, so its split regex never runs on megabytes
/// (Qwen2's ran out of backtracking on 12 MB of spaces) and its normalized copy is bounded
/// before it is allocated (a normalizer that expands text once made a short prompt allocate
/// gigabytes). (A normalizer that deletes much of a text would fit more; none does.)
fn prompt_limit(tok: &Tokenizer, context: usize) -> usize {
    let fits = context.saturating_mul(crate::tokenizer::max_token_bytes(tok));
    fits.min((NORMALIZED_LIMIT / crate::tokenizer::normalizer_growth(tok)).floor() as usize)
}

impl Pipeline {
    /// Refuses a text longer than [`prompt_limit`], saying which bound it passes.
    fn check_prompt(&self, text: &str) -> Result<()> {
        if text.len() <= self.prompt_limit {
            return Ok(());
        }
        let (context, longest) = (self.model.config().context_len, crate::tokenizer::max_token_bytes(&self.tokenizer));
        let growth = crate::tokenizer::normalizer_growth(&self.tokenizer);
        let why = if text.len() > context.saturating_mul(longest) {
            format!("more than the model's context of {context} tokens can hold (a token of this tokenizer stands for {longest} bytes at most)")
        } else {
            format!("the tokenizer's normalizer may grow text {growth}x, beyond the {} MiB of normalized text taken", NORMALIZED_LIMIT as u64 >> 20)
        };
        Err(Error::Input(format!("a prompt of {} bytes: {why}; shorten it", text.len())))
    }
}

/// A tokenizer that can produce ids the model has no embedding for (or stop ids it can never
/// sample) belongs to another model: an error, not garbage or a generation that never stops.
/// The tokenizer against the model: every token id and stop id within the embedding. Returns
/// the embedding's ids without a token (padding), which generation must never sample.
fn check_tokenizer(tok: &Tokenizer, model: &Model, stop: &[u32], path: &Path) -> Result<Vec<u32>> {
    let vocab = model.config().vocab;
    let bad = |reason: String| Err(Error::Model { path: path.to_path_buf(), reason });
    let ids = tok.get_vocab(true).into_values().collect::<std::collections::HashSet<u32>>();
    // The largest id, not the count: added tokens may sit beyond a gap.
    if let Some(&max) = ids.iter().max().filter(|&&m| m as usize >= vocab) {
        return bad(format!("the tokenizer has token id {max}, the model's vocabulary {vocab}: a tokenizer of another model?"));
    }
    if let Some(s) = stop.iter().find(|&&s| s as usize >= vocab) {
        return bad(format!("stop token id {s} is beyond the model's vocabulary of {vocab}"));
    }
    let textless: Vec<u32> = (0..vocab as u32).filter(|i| !ids.contains(i)).collect();
    // A few padding rows are common (vocabularies rounded up for the GPU); most of the
    // embedding without text is a tokenizer of another model.
    if textless.len() * 2 > vocab {
        return bad(format!("the tokenizer has {} tokens for an embedding of {vocab} rows: a tokenizer of another model?", ids.len()));
    }
    if !textless.is_empty() {
        tracing::info!(ids = textless.len(), vocab, "embedding rows without a token (padding): never sampled");
    }
    Ok(textless)
}

/// Generated text as it comes, never splitting a character: a token may hold part of a
/// multi-byte character (byte-level BPE, byte fallback), and a text ending in such a part
/// decodes to U+FFFD. As candle's `TokenOutputStream`, each step decodes the tokens since the
/// last text it gave out twice (without and with the new token) and gives the difference; it
/// waits while the text ends in U+FFFD (candle's waits for an alphanumeric last character), and
/// every window moves on once it has given text out, so nothing stalls.
#[derive(Debug, Default)]
pub struct TextStream {
    tokens: Vec<u32>,
    /// Tokens before `prev` are given out; `prev..current` is the context of the next step.
    prev: usize,
    current: usize,
}

impl TextStream {
    /// A stream with no tokens yet: one per answer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `token`; the text that is complete now, if any.
    pub fn next(&mut self, tok: &Tokenizer, token: u32) -> Result<Option<String>> {
        self.tokens.push(token);
        self.take(tok, false)
    }

    /// The text not given out yet (at the end of generation).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<Option<String>> {
        self.take(tok, true)
    }

    /// What the tokens after `current` add to the window `prev..current`: none while the text
    /// ends inside a character, unless `all`. Giving text out moves the window on.
    fn take(&mut self, tok: &Tokenizer, all: bool) -> Result<Option<String>> {
        let before = decode(tok, &self.tokens[self.prev..self.current])?;
        let text = decode(tok, &self.tokens[self.prev..])?;
        let new = after_common_prefix(&before, &text);
        if new.is_empty() || (!all && text.ends_with('\u{FFFD}')) {
            return Ok(None);
        }
        let new = new.to_string();
        (self.prev, self.current) = (self.current, self.tokens.len());
        Ok(Some(new))
    }
}

/// What `text` adds to `before`: the part after their common prefix (whole characters). Usually
/// `text` extends `before`; when the decoder renders the window differently with the new token
/// (a byte-fallback decoder turns a whole invalid run of bytes into U+FFFD), what differs is
/// given out rather than held back forever (the screen keeps the earlier rendering).
fn after_common_prefix<'a>(before: &str, text: &'a str) -> &'a str {
    let common = before.char_indices().zip(text.chars()).find(|((_, a), b)| a != b).map_or(before.len().min(text.len()), |((i, _), _)| i);
    // `common` is a character boundary of both (equal characters up to it).
    text.get(common..).unwrap_or("")
}

fn decode(tok: &Tokenizer, ids: &[u32]) -> Result<String> {
    crate::tokenizer::guarded(|| tok.decode(ids, false)).map_err(|e| Error::Input(format!("tokenizer, decoding {} tokens: {e}", ids.len())))
}

#[cfg(test)]
mod tests {
    use super::{after_common_prefix, split_at_whitespace};

    #[test]
    fn long_text_is_split_at_whitespace_within_the_bound() {
        let pieces: Vec<&str> = split_at_whitespace("one two three", 8).collect();
        assert_eq!(pieces, ["one two ", "three"]);
        // No whitespace: at the bound, on a character boundary; a character beyond it whole.
        assert_eq!(split_at_whitespace("abcdef", 4).collect::<Vec<_>>(), ["abcd", "ef"]);
        assert_eq!(split_at_whitespace("\u{e9}\u{e9}", 3).collect::<Vec<_>>(), ["\u{e9}", "\u{e9}"]);
        assert_eq!(split_at_whitespace("\u{20ac}", 1).collect::<Vec<_>>(), ["\u{20ac}"]);
        let text = "word ".repeat(1000);
        assert!(split_at_whitespace(&text, 64).all(|p| p.len() <= 64 && p.ends_with(' ')));
        assert_eq!(split_at_whitespace(&text, 64).collect::<String>(), text);
    }

    #[test]
    fn new_text_is_what_follows_the_common_prefix() {
        assert_eq!(after_common_prefix("ab", "abc"), "c");
        assert_eq!(after_common_prefix("a\u{e9}", "a\u{e9}\u{20ac}"), "\u{20ac}");
        // A byte-fallback decoder re-rendered the window: what differs is given out.
        assert_eq!(after_common_prefix("\u{e9}", "\u{fffd}\u{fffd}\u{fffd} the"), "\u{fffd}\u{fffd}\u{fffd} the");
        assert_eq!(after_common_prefix("x\u{e9}", "x\u{e8}y"), "\u{e8}y");
        assert_eq!(after_common_prefix("abc", "ab"), "");
        assert_eq!(after_common_prefix("", "z"), "z");
    }
}
