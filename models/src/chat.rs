//! Chat templates. GGUF files carry a Jinja template; the families here use ChatML, which is
//! recognized from the template text rather than by running Jinja.

use crate::gguf::Gguf;

/// How to wrap a user prompt for an instruct model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplate {
    /// `<|im_start|>role\n...<|im_end|>` (SmolLM2, Qwen2), with the template's default system text.
    ChatMl { system: Option<String> },
    /// No template: the prompt is used as is.
    None,
}

impl ChatTemplate {
    pub fn from_gguf(g: &Gguf) -> Self {
        let Ok(t) = g.string("tokenizer.chat_template") else { return ChatTemplate::None };
        if !t.contains("<|im_start|>") {
            return ChatTemplate::None;
        }
        // SmolLM2's template inserts a default system message when none is given.
        let system = t.split("<|im_start|>system\\n").nth(1).and_then(|s| s.split("<|im_end|>").next()).map(str::to_string);
        ChatTemplate::ChatMl { system }
    }

    pub fn apply(&self, prompt: &str) -> String {
        match self {
            ChatTemplate::ChatMl { system } => {
                let sys = system.as_ref().map(|s| format!("<|im_start|>system\n{s}<|im_end|>\n")).unwrap_or_default();
                format!("{sys}<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
            }
            ChatTemplate::None => prompt.to_string(),
        }
    }

    /// Tokens that end the assistant's turn, besides the model's EOS.
    pub fn stop_strings(&self) -> &'static [&'static str] {
        match self {
            ChatTemplate::ChatMl { .. } => &["<|im_end|>"],
            ChatTemplate::None => &[],
        }
    }
}
