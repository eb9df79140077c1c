//! Chat templates. GGUF files (`tokenizer.chat_template`) and Hugging Face folders
//! (`tokenizer_config.json`'s `chat_template`) carry a Jinja template, which [`JinjaTemplate`]
//! renders over a conversation of [`Message`]s as transformers does (minijinja, in its sandbox:
//! a template can compute but not reach files or the network). Where a template does not
//! compile, the four well-known turn formats of [`ChatTemplate`], recognized from marker strings
//! in the template text, are the fallback, and a warning says so. A conversation the template
//! refuses (its `raise_exception`: roles out of order, say) is an error with its message.
//!
//! Either way a conversation is rendered in pieces ([`JinjaTemplate::segments`],
//! [`ChatTemplate::segments`]): the template's own text, whose markers become control tokens,
//! and each message's content, whose markers stay text (`crate::tokenizer::encode_segments`).
//!
//! The text [`ChatTemplate::apply`] returns never contains BOS: the tokenizer adds it when asked
//! for special tokens (`crate::tokenizer::encode(tok, text, true)`), as the file's
//! `add_bos_token` says, so it is not added twice. A pipeline tokenizes the template's text and
//! the prompt apart ([`ChatTemplate::around`]): markers such as `<|im_end|>` typed in a prompt stay
//! text, and only the template's own become control tokens.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use candle_npu::{Error, Result};

use crate::gguf::Gguf;

/// One message of a conversation: `role` is `system`, `user` or `assistant` (or another role
/// the model's template knows, e.g. `tool`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    /// Who speaks.
    pub role: String,
    /// What is said: text, whose control-token spellings stay text.
    pub content: String,
}

impl Message {
    /// A message of `role`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message { role: role.into(), content: content.into() }
    }
    /// The system prompt: goes first.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    /// A user turn.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    /// An answer of the model's.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Why a role of `messages` cannot be one, if one cannot: a role is the template's to write, so
/// it is a word, never markup (a role of `user<|im_end|>...` would forge turns in the template's
/// own, trusted text).
pub fn check_roles(messages: &[Message]) -> std::result::Result<(), String> {
    let word = |r: &str| !r.is_empty() && r.len() <= 32 && r.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    match messages.iter().find(|m| !word(&m.role)) {
        Some(m) => Err(format!("a message's role {:?}: a role is a word (system, user, assistant, tool, ...)", m.role)),
        None => Ok(()),
    }
}

/// A rendered conversation in pieces, each `(text, trusted)`: the template's text is trusted
/// (its markers are control tokens), the messages' contents are not.
pub type Segments = Vec<(String, bool)>;

/// Stands for message `i`'s content while a template renders, so that the contents can be told
/// from the template's text afterwards (Unicode private-use characters: no template writes them).
const OPEN: char = '\u{F8F0}';
const CLOSE: char = '\u{F8F1}';

/// A model's own Jinja chat template, rendered with minijinja as transformers renders it:
/// `trim_blocks` and `lstrip_blocks`, `raise_exception`, Python's string methods, and the
/// variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`.
pub struct JinjaTemplate {
    env: Arc<minijinja::Environment<'static>>,
    bos: String,
    eos: String,
    /// Where the template came from, for errors.
    origin: String,
    /// The most bytes a render may write.
    max_text: usize,
    /// Instructions a render may run.
    fuel: u64,
    /// Bytes a render may hold beyond its messages' share.
    memory: usize,
    /// Set once a render is stopped past its memory or time: its thread is asleep for good
    /// holding what it took (`crate::sandbox`), and the template is refused from then on.
    stopped: Arc<AtomicBool>,
}

/// Instructions a render may run: at least ten times what the real models' templates take for a
/// conversation of 2000 messages (`tests/chat.rs` renders one on a tenth of it); a loop
/// that never ends stops within seconds.
pub const TEMPLATE_FUEL: u64 = 20_000_000;

/// What a render may allocate in all, beyond [`TEMPLATE_BYTES_PER_TEXT_BYTE`] per byte of its
/// messages: far beyond what a real template takes (a few times the text it writes), far below
/// a machine's memory. Enforced where [`crate::sandbox::GuardedAlloc`] is the allocator.
pub const TEMPLATE_MEMORY: usize = 256 << 20;
/// See [`TEMPLATE_MEMORY`].
pub const TEMPLATE_BYTES_PER_TEXT_BYTE: usize = 64;
/// How long a render may take (one takes milliseconds; the fuel stops loops well before).
pub const TEMPLATE_TIME: Duration = Duration::from_secs(10);
/// The most text a render may write unless [`JinjaTemplate::max_text`] says otherwise (a
/// pipeline bounds it by what its tokenizer takes).
pub const TEMPLATE_TEXT: usize = 64 << 20;

impl std::fmt::Debug for JinjaTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JinjaTemplate(bos {:?}, eos {:?})", self.bos, self.eos)
    }
}

impl JinjaTemplate {
    /// Compiles `source`; the error says why it does not compile.
    pub fn new(source: &str, bos: &str, eos: &str) -> std::result::Result<Self, String> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_template_owned("chat", source.to_string()).map_err(|e| e.to_string())?;
        Ok(JinjaTemplate {
            env: Arc::new(env),
            bos: bos.into(),
            eos: eos.into(),
            origin: "the chat template".into(),
            max_text: TEMPLATE_TEXT,
            fuel: TEMPLATE_FUEL,
            memory: TEMPLATE_MEMORY,
            stopped: Arc::default(),
        })
    }

    /// The template as the one of `file`, which its errors name.
    pub fn from_file(mut self, file: &Path) -> Self {
        self.origin = format!("the chat template of {}", file.display());
        self
    }

    /// Renders may run `instructions` (default [`TEMPLATE_FUEL`]).
    pub fn fuel(mut self, instructions: u64) -> Self {
        // A copy of the environment if a render still holds this one.
        Arc::make_mut(&mut self.env).set_fuel(Some(instructions));
        self.fuel = instructions;
        self
    }

    /// Renders may hold `bytes` (default [`TEMPLATE_MEMORY`]) beyond
    /// [`TEMPLATE_BYTES_PER_TEXT_BYTE`] per byte of their messages.
    pub fn memory(mut self, bytes: usize) -> Self {
        self.memory = bytes;
        self
    }

    /// Renders writing more than `bytes` are refused.
    pub fn max_text(mut self, bytes: usize) -> Self {
        self.max_text = bytes;
        self
    }

    /// `bos_token` as the template gets it.
    pub fn bos(&self) -> &str {
        &self.bos
    }

    /// The conversation as the template writes it; with `add_generation_prompt`, ending where
    /// the assistant's answer starts.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        Ok(self.segments(messages, add_generation_prompt)?.into_iter().map(|(t, _)| t).collect())
    }

    /// The template rendered over `stand_ins`, then over `messages`, within the template's
    /// bounds: [`TEMPLATE_FUEL`] each, [`JinjaTemplate::max_text`] bytes of text each, and
    /// together [`TEMPLATE_MEMORY`] (and more for longer messages) and [`TEMPLATE_TIME`] on a
    /// thread of their own (`crate::sandbox`).
    fn render_bounded(&self, stand_ins: Vec<Message>, messages: Vec<Message>, add_generation_prompt: bool) -> Result<(String, String)> {
        let origin = self.origin.clone();
        if self.stopped.load(Ordering::Relaxed) {
            return Err(Error::Input(format!("{origin}: refused, since a render of it ran out of bounds before (load the model again with another template)")));
        }
        let text_bytes: usize = messages.iter().map(|m| m.content.len() + m.role.len()).sum();
        let limits =
            crate::sandbox::Limits { memory: self.memory.saturating_add(text_bytes.saturating_mul(TEMPLATE_BYTES_PER_TEXT_BYTE)), time: TEMPLATE_TIME };
        let (env, max_text, fuel) = (self.env.clone(), self.max_text, self.fuel);
        let (bos, eos) = (self.bos.clone(), self.eos.clone());
        let run = move || -> std::result::Result<(String, String), String> {
            let render = |messages: &[Message]| {
                let ctx = minijinja::context! {
                    messages => messages,
                    add_generation_prompt => add_generation_prompt,
                    bos_token => &bos,
                    eos_token => &eos,
                };
                let mut out = Capped { text: vec![], max: max_text, full: false };
                let done = env.get_template("chat").and_then(|t| t.render_captured_to(ctx, &mut out).map(drop));
                match done {
                    Ok(_) => Ok(String::from_utf8(out.text).map_err(|_| "it wrote invalid UTF-8".to_string())?),
                    Err(_) if out.full => Err(format!("its text passes {max_text} bytes, the most a prompt may take: shorten the conversation (or use another template, if this one writes that much itself)")),
                    Err(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => {
                        Err(format!("it ran past its budget of {fuel} instructions (a loop that does not end?); use another template"))
                    }
                    Err(e) => Err(e.to_string()),
                }
            };
            Ok((render(&stand_ins)?, render(&messages)?))
        };
        match crate::sandbox::bounded(limits, run) {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(why)) => Err(Error::Input(format!("{origin}: {why}"))),
            Err(stopped) => {
                if matches!(stopped, crate::sandbox::Stopped::Memory(_) | crate::sandbox::Stopped::Time(_)) {
                    self.stopped.store(true, Ordering::Relaxed);
                }
                Err(Error::Input(format!("{origin}: {stopped} while rendering; use another template")))
            }
        }
    }

    /// [`JinjaTemplate::render`] in pieces (see [`Segments`]).
    ///
    /// The template renders twice: with each content replaced by a stand-in, which shows where
    /// the template's own text is, and as it is, which shows what it made of each content
    /// (templates trim them: `.strip()`, `| trim`). A template that changes a content otherwise
    /// is an error: its markers could not be told from the content's.
    pub fn segments(&self, messages: &[Message], add_generation_prompt: bool) -> Result<Segments> {
        let origin = &self.origin;
        let bad = |why: &str| Error::Input(format!("{origin}: {why}"));
        let stand_ins: Vec<Message> = messages.iter().enumerate().map(|(i, m)| Message::new(&m.role, format!("{OPEN}{i}{CLOSE}"))).collect();
        let (marked, text) = self.render_bounded(stand_ins, messages.to_vec(), add_generation_prompt)?;
        // `marked` as the template's pieces and the indices of the contents between them.
        let (mut pieces, mut contents) = (vec![], vec![]);
        let mut rest = marked.as_str();
        while let Some(open) = rest.find(OPEN) {
            pieces.push(&rest[..open]);
            let after = &rest[open + OPEN.len_utf8()..];
            let close = after.find(CLOSE).ok_or_else(|| bad("it cuts a message's content apart"))?;
            let i: usize = after[..close].parse().map_err(|_| bad("it changes a message's content"))?;
            contents.push(messages.get(i).ok_or_else(|| bad("it changes a message's content"))?.content.as_str());
            rest = &after[close + CLOSE.len_utf8()..];
        }
        if rest.contains(CLOSE) {
            return Err(bad("it cuts a message's content apart"));
        }
        pieces.push(rest);
        // Every message is written (by index: two messages may say the same): a template that
        // leaves one out would answer a conversation the user did not send.
        if let Some((i, m)) = messages.iter().enumerate().find(|(i, _)| !marked.contains(&format!("{OPEN}{i}{CLOSE}"))) {
            return Err(bad(&format!(
                "it leaves out message {} ({}: {:?}); the model would never see it: use another template (a tokenizer_config.json's, or --no-chat-template)",
                i + 1,
                m.role,
                preview(&m.content)
            )));
        }
        // Walk `text`: each piece, then the content as the template wrote it.
        let mut out: Segments = vec![];
        let mut at = 0;
        for (i, piece) in pieces.iter().enumerate() {
            if !text[at..].starts_with(piece) {
                return Err(bad("it renders differently around a message's content"));
            }
            out.push((piece.to_string(), true));
            at += piece.len();
            let Some(content) = contents.get(i) else { break };
            let next = pieces[i + 1];
            let written = [*content, content.trim(), content.trim_start(), content.trim_end()]
                .into_iter()
                .find(|c| text[at..].starts_with(c) && text[at + c.len()..].starts_with(next))
                .ok_or_else(|| bad("it changes a message's content (beyond trimming it)"))?;
            out.push((written.to_string(), false));
            at += written.len();
        }
        if at != text.len() {
            return Err(bad("it renders differently around a message's content"));
        }
        out.retain(|(t, _)| !t.is_empty());
        Ok(out)
    }
}

/// A writer that refuses to hold more than `max` bytes, and says it was full.
struct Capped {
    text: Vec<u8>,
    max: usize,
    full: bool,
}

impl Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > self.max {
            self.full = true;
            return Err(std::io::Error::other("the text bound"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The start of `text`, for a message: 40 characters at most.
fn preview(text: &str) -> String {
    let mut p: String = text.chars().take(40).collect();
    if p.len() < text.len() {
        p.push_str("...");
    }
    p
}

/// How to wrap a user prompt for an instruct model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplate {
    /// `<|im_start|>role\n...<|im_end|>` (SmolLM2, Qwen2), with the template's default system text.
    ChatMl {
        /// The system text the template inserts when a conversation has none (SmolLM2's,
        /// Qwen2.5's), put before the first turn only; `None`: no system turn.
        system: Option<String>,
    },
    /// `<start_of_turn>user\n...<end_of_turn>` then `<start_of_turn>model\n` (Gemma).
    Gemma,
    /// `<|user|>\n...<|end|>` then `<|assistant|>\n` (Phi-3).
    Phi3,
    /// `[INST] ... [/INST]` (Mistral, Llama 2 chat); the answer ends with EOS.
    Mistral,
    /// No template: the prompt is used as is.
    None,
}

impl ChatTemplate {
    /// The template of a GGUF's `tokenizer.chat_template`; [`ChatTemplate::None`] when it has
    /// none (base models such as Gemma 3 270M) or one of no known kind.
    pub fn from_gguf(g: &Gguf) -> Self {
        g.string("tokenizer.chat_template").map(|t| Self::from_template_text(&t)).unwrap_or(ChatTemplate::None)
    }

    /// Recognizes the kind of a Jinja chat template from its text (a GGUF's or a Hugging Face
    /// `tokenizer_config.json`'s). Unknown text gives [`ChatTemplate::None`].
    pub fn from_template_text(t: &str) -> Self {
        if t.contains("<|im_start|>") {
            ChatTemplate::ChatMl { system: chatml_default_system(t) }
        } else if t.contains("<start_of_turn>") {
            ChatTemplate::Gemma
        } else if t.contains("<|end|>") && t.contains("<|assistant|>") {
            // Phi-3 builds `<|user|>` as '<|' + role + '|>', so only these two are literal.
            ChatTemplate::Phi3
        } else if t.contains("[INST]") {
            ChatTemplate::Mistral
        } else {
            // Said, not dropped quietly: prompts then go to the model as they are.
            tracing::warn!(template_start = %t.chars().take(80).collect::<String>(), "unrecognized chat template: prompts are used without one");
            ChatTemplate::None
        }
    }

    /// The template of a Hugging Face `tokenizer_config.json`: its `chat_template`, either a string
    /// or a list of `{name, template}` of which the one named "default" is used. A file without
    /// one gives [`ChatTemplate::None`]; an unreadable file or malformed field is an error.
    pub fn from_tokenizer_config(path: &Path) -> Result<Self> {
        Ok(template_source(path)?.map_or(ChatTemplate::None, |s| Self::from_template_text(&s.text)))
    }

    /// The prompt as one user turn, ending where the model's answer starts.
    pub fn apply(&self, prompt: &str) -> String {
        let (before, after) = self.around();
        format!("{before}{prompt}{after}")
    }

    /// The template's text before and after the prompt in [`ChatTemplate::apply`] (one user turn
    /// of [`ChatTemplate::segments`]).
    pub fn around(&self) -> (String, String) {
        let segments = self.segments(&[Message::user("x")], true);
        let at = segments.iter().position(|(_, trusted)| !trusted).expect("the user's content is a piece");
        let join = |s: &[(String, bool)]| s.iter().map(|(t, _)| t.as_str()).collect::<String>();
        (join(&segments[..at]), join(&segments[at + 1..]))
    }

    /// A conversation in this format, in pieces (see [`Segments`]); with
    /// `add_generation_prompt`, ending where the assistant's answer starts. A system message
    /// goes where the format has one (ChatML: its own turn, replacing the template's default;
    /// the others: before the first user message, as their templates do).
    pub fn segments(&self, messages: &[Message], add_generation_prompt: bool) -> Segments {
        let mut out: Segments = vec![];
        let mut push = |t: &str, trusted: bool| out.push((t.to_string(), trusted));
        let (system, turns): (Option<&Message>, &[Message]) = match messages.first() {
            Some(m) if m.role == "system" => (Some(m), &messages[1..]),
            _ => (None, messages),
        };
        match self {
            ChatTemplate::ChatMl { system: default } => {
                match (system, default) {
                    (Some(m), _) => {
                        push("<|im_start|>system\n", true);
                        push(&m.content, false);
                        push("<|im_end|>\n", true);
                    }
                    (None, Some(d)) => push(&format!("<|im_start|>system\n{d}<|im_end|>\n"), true),
                    (None, None) => {}
                }
                for m in turns {
                    push(&format!("<|im_start|>{}\n", m.role), true);
                    push(&m.content, false);
                    push("<|im_end|>\n", true);
                }
                if add_generation_prompt {
                    push("<|im_start|>assistant\n", true);
                }
            }
            ChatTemplate::Gemma | ChatTemplate::Phi3 => {
                let (open, close, model) = match self {
                    ChatTemplate::Gemma => ("<start_of_turn>", "<end_of_turn>\n", "model"),
                    _ => ("<|", "<|end|>\n", "assistant"),
                };
                let head = |role: &str| match self {
                    ChatTemplate::Gemma => format!("{open}{role}\n"),
                    _ => format!("{open}{role}|>\n"),
                };
                for (i, m) in turns.iter().enumerate() {
                    let role = if m.role == "assistant" { model } else { m.role.as_str() };
                    push(&head(role), true);
                    if let (0, Some(s)) = (i, system) {
                        push(&s.content, false);
                        push("\n\n", true);
                    }
                    push(&m.content, false);
                    push(close, true);
                }
                if add_generation_prompt {
                    push(&head(model), true);
                }
            }
            ChatTemplate::Mistral => {
                for (i, m) in turns.iter().enumerate() {
                    if m.role == "assistant" {
                        push(" ", true);
                        push(&m.content, false);
                        push("</s>", true);
                        continue;
                    }
                    push("[INST] ", true);
                    if let (0, Some(s)) = (i, system) {
                        push(&s.content, false);
                        push("\n\n", true);
                    }
                    push(&m.content, false);
                    push(" [/INST]", true);
                }
            }
            ChatTemplate::None => {
                for (i, m) in messages.iter().enumerate() {
                    if i > 0 {
                        push("\n\n", true);
                    }
                    push(&m.content, false);
                }
            }
        }
        out.retain(|(t, _)| !t.is_empty());
        out
    }

    /// Tokens that end the assistant's turn, besides the model's EOS.
    pub fn stop_strings(&self) -> &'static [&'static str] {
        match self {
            ChatTemplate::ChatMl { .. } => &["<|im_end|>"],
            ChatTemplate::Gemma => &["<end_of_turn>"],
            ChatTemplate::Phi3 => &["<|end|>"],
            ChatTemplate::Mistral | ChatTemplate::None => &[],
        }
    }
}

/// A chat template's Jinja text and the BOS and EOS token strings it is rendered with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateSource {
    /// The Jinja text.
    pub text: String,
    /// `bos_token`.
    pub bos: String,
    /// `eos_token`.
    pub eos: String,
}

/// The chat template of a Hugging Face `tokenizer_config.json` (see
/// [`ChatTemplate::from_tokenizer_config`]), with its `bos_token` and `eos_token`; `None` when
/// the file has none.
pub fn template_source(path: &Path) -> Result<Option<TemplateSource>> {
    let bad = |reason: String| Error::Model { path: path.to_path_buf(), reason };
    // Gemma 3's, listing its 6K+ added tokens, is 1.2 MB; 64 MiB is ample for any template.
    const TOKENIZER_CONFIG_LIMIT: u64 = 64 * candle_npu::fs::MIB;
    let bytes = candle_npu::fs::read_bounded(path, TOKENIZER_CONFIG_LIMIT, "tokenizer_config.json")?;
    let v = candle_npu::fs::parse_json(&bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
    let text = match v.get("chat_template") {
        None | Some(serde_json::Value::Null) => return Ok(None),
        Some(serde_json::Value::String(s)) => s.as_str(),
        Some(serde_json::Value::Array(named)) => named
            .iter()
            .find(|n| n.get("name").and_then(|x| x.as_str()) == Some("default"))
            .and_then(|n| n.get("template").and_then(|x| x.as_str()))
            .ok_or_else(|| bad("chat_template: a list without a template named \"default\"".into()))?,
        Some(_) => return Err(bad("chat_template: expected a string or a list of {name, template}".into())),
    };
    // bos_token / eos_token: a string, or an added token's {content, ...}.
    let token = |key: &str| match v.get(key) {
        Some(serde_json::Value::String(t)) => t.clone(),
        Some(o) => o.get("content").and_then(|c| c.as_str()).unwrap_or_default().to_string(),
        None => String::new(),
    };
    Ok(Some(TemplateSource { text: text.to_string(), bos: token("bos_token"), eos: token("eos_token") }))
}

/// The system text a ChatML template inserts when the conversation has none (SmolLM2: "You are a
/// helpful AI assistant named SmolLM, ..."; Qwen2.5: "You are Qwen, created by Alibaba Cloud. ...").
/// It is the first `<|im_start|>system\n` ... `<|im_end|>` whose body is a plain literal: other
/// occurrences build the system turn from the conversation (`+ messages[0]['content'] +`) or sit in
/// a tools branch that closes the string first. Templates write the newline either as a real one
/// or as a Jinja `\n` escape; both are accepted.
fn chatml_default_system(t: &str) -> Option<String> {
    let t = t.replace("\\n", "\n");
    t.split("<|im_start|>system\n").skip(1).find_map(|after| {
        let body = after.split("<|im_end|>").next()?;
        let unescaped = body.replace("\\'", "").replace("\\\"", "");
        let plain = !unescaped.contains(['\'', '"']) && !body.contains("{{") && !body.contains("{%");
        (plain && after.contains("<|im_end|>") && !body.is_empty()).then(|| body.replace("\\'", "'").replace("\\\"", "\""))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M-Instruct's template as its GGUF carries it (newlines written literally).
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// Qwen2.5's template, shortened: a tools branch first, then the default system text
    /// (newlines as Jinja `\n` escapes, as in its GGUF).
    const QWEN25: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\n<tools>" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"#;

    /// Gemma 3 instruct's template, shortened.
    const GEMMA: &str = r#"{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- endif -%}{%- for message in loop_messages -%}{%- if (message['role'] == 'assistant') -%}{%- set role = "model" -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"#;

    /// Phi-3-mini-instruct's template: the role tag is built from the role name.
    const PHI3: &str = r#"{{ bos_token }}{% for message in messages %}{{'<|' + message['role'] + '|>' + '\n' + message['content'] + '<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"#;

    /// Mistral-7B-Instruct's template.
    const MISTRAL: &str = r#"{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}"#;

    #[test]
    fn recognizes_each_kind() {
        let smol = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";
        assert_eq!(ChatTemplate::from_template_text(SMOLLM2), ChatTemplate::ChatMl { system: Some(smol.into()) });
        let qwen = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";
        assert_eq!(ChatTemplate::from_template_text(QWEN25), ChatTemplate::ChatMl { system: Some(qwen.into()) });
        assert_eq!(ChatTemplate::from_template_text(GEMMA), ChatTemplate::Gemma);
        assert_eq!(ChatTemplate::from_template_text(PHI3), ChatTemplate::Phi3);
        assert_eq!(ChatTemplate::from_template_text(MISTRAL), ChatTemplate::Mistral);
        assert_eq!(ChatTemplate::from_template_text("{{ messages[0]['content'] }}"), ChatTemplate::None);
        assert_eq!(ChatTemplate::from_template_text(""), ChatTemplate::None);
    }

    #[test]
    fn chatml_without_a_default_system_text() {
        let t = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}";
        assert_eq!(ChatTemplate::from_template_text(t), ChatTemplate::ChatMl { system: None });
        // A system turn built from the conversation is not a default text.
        let t = "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}";
        assert_eq!(ChatTemplate::from_template_text(t), ChatTemplate::ChatMl { system: None });
    }

    #[test]
    fn chatml_default_system_text_may_hold_escaped_quotes() {
        let t = r"{{ '<|im_start|>system\nYou\'re helpful.<|im_end|>\n' }}";
        assert_eq!(ChatTemplate::from_template_text(t), ChatTemplate::ChatMl { system: Some("You're helpful.".into()) });
    }

    #[test]
    fn apply_wraps_one_user_turn() {
        let p = "Why?";
        let chatml = ChatTemplate::ChatMl { system: Some("Be brief.".into()) };
        assert_eq!(chatml.apply(p), "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n");
        assert_eq!(ChatTemplate::ChatMl { system: None }.apply(p), "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n");
        assert_eq!(ChatTemplate::Gemma.apply(p), "<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n");
        assert_eq!(ChatTemplate::Phi3.apply(p), "<|user|>\nWhy?<|end|>\n<|assistant|>\n");
        assert_eq!(ChatTemplate::Mistral.apply(p), "[INST] Why? [/INST]");
        assert_eq!(ChatTemplate::None.apply(p), "Why?");
    }

    #[test]
    fn stop_strings_end_the_assistant_turn() {
        assert_eq!(ChatTemplate::ChatMl { system: None }.stop_strings(), ["<|im_end|>"]);
        assert_eq!(ChatTemplate::Gemma.stop_strings(), ["<end_of_turn>"]);
        assert_eq!(ChatTemplate::Phi3.stop_strings(), ["<|end|>"]);
        assert!(ChatTemplate::Mistral.stop_strings().is_empty(), "Mistral answers end with EOS");
        assert!(ChatTemplate::None.stop_strings().is_empty());
    }

    fn config(name: &str, json: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("candle-npu-chat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, json).unwrap();
        path
    }

    #[test]
    fn from_hugging_face_tokenizer_config() {
        let s = serde_json::to_string(&serde_json::json!({ "chat_template": GEMMA, "bos_token": "<bos>" })).unwrap();
        assert_eq!(ChatTemplate::from_tokenizer_config(&config("gemma.json", &s)).unwrap(), ChatTemplate::Gemma);
        let named = serde_json::json!({ "chat_template": [{ "name": "tool_use", "template": GEMMA }, { "name": "default", "template": PHI3 }] });
        assert_eq!(ChatTemplate::from_tokenizer_config(&config("named.json", &named.to_string())).unwrap(), ChatTemplate::Phi3);
        assert_eq!(ChatTemplate::from_tokenizer_config(&config("none.json", "{}")).unwrap(), ChatTemplate::None);
        let e = ChatTemplate::from_tokenizer_config(&config("bad.json", "{\"chat_template\": 3}")).unwrap_err().to_string();
        assert!(e.contains("bad.json") && e.contains("chat_template"), "{e}");
        let e = ChatTemplate::from_tokenizer_config(&config("broken.json", "{")).unwrap_err().to_string();
        assert!(e.contains("broken.json") && e.contains("not JSON"), "{e}");
        assert!(ChatTemplate::from_tokenizer_config(Path::new("/nonexistent/tokenizer_config.json")).is_err());
        std::fs::remove_dir_all(config("x", "").parent().unwrap()).unwrap();
    }
}
