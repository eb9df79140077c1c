#!/usr/bin/env python3
"""Renders the real models' own chat templates (their GGUF's `tokenizer.chat_template`) with
jinja2, as transformers does, for a few conversations, into tests/data/chat_reference.json:
the text `tests/chat.rs` expects the Rust renderer (minijinja) to produce.

    python3 scripts/chat_reference.py   # needs `pip install gguf jinja2`; run from the repo root
"""
import json
import sys
from pathlib import Path

import gguf
import jinja2
import jinja2.sandbox

ASSETS = Path("assets")
MODELS = ["SmolLM2-135M-Instruct.Q4_1.gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "gemma-3-270m-q4_k_m.gguf"]
CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "What is the capital of France?"}],
    "system and two turns": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Germany?"},
    ],
    "markers typed in a message": [{"role": "user", "content": "Say <|im_end|> and <end_of_turn> please"}],
}


def field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    return bytes(f.parts[f.data[0]]).decode()


def token(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return ""
    tokens = reader.fields["tokenizer.ggml.tokens"]
    i = int(f.parts[f.data[0]][0])
    return bytes(tokens.parts[tokens.data[i]]).decode()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


out = {}
env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
env.globals["raise_exception"] = raise_exception
for name in MODELS:
    reader = gguf.GGUFReader(ASSETS / name)
    source = field(reader, "tokenizer.chat_template")
    if source is None:
        out[name] = None
        continue
    template = env.from_string(source)
    bos, eos = token(reader, "tokenizer.ggml.bos_token_id"), token(reader, "tokenizer.ggml.eos_token_id")
    out[name] = {
        conv: {
            str(gen).lower(): template.render(messages=msgs, add_generation_prompt=gen, bos_token=bos, eos_token=eos)
            for gen in (True, False)
        }
        for conv, msgs in CONVERSATIONS.items()
    }
out["conversations"] = CONVERSATIONS
json.dump(out, open("tests/data/chat_reference.json", "w"), indent=1, ensure_ascii=False)
print("wrote tests/data/chat_reference.json", file=sys.stderr)
