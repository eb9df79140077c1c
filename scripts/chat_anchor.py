#!/usr/bin/env python3
"""The chat eval's anchor: how far llama.cpp's Q8_0 drifts from its own F16 on the same prompts.

Reads the JSON that `cargo run --release --example eval -- --sections chat --chat-dump FILE`
writes (each conversation's rendered prompt tokens, the F32 prefill's greedy answer, the stop
tokens, and the model re-encoded in F16 and Q8_0), runs both files through llama.cpp (the Python
package `llama-cpp-python`, built from source; never in CI), and prints the same measures as the
eval: first-token KL(F16 || Q8_0), first token and whole 16-token greedy answer the same, and
derailments judged as the eval does (a script the context never writes, or an answer the F16
model finds more than 2.5 nats/token more surprising than its own).

    python3 scripts/chat_anchor.py FILE [--json OUT] [--limit N]

`--limit N` takes the first N conversations, as `eval --chat-limit N` does.
"""
import argparse
import json
import sys

import numpy as np
from llama_cpp import Llama

DERAIL_NATS = 2.5  # models/src/chat_eval.rs DERAIL_NATS

# The scripts of models/src/chat_eval.rs's SCRIPTS (Kana folded into Han, as its new_script does).
SCRIPTS = [
    ("Latin", [("A", "Z"), ("a", "z"), ("\u00c0", "\u024f")]),
    ("Cyrillic", [("\u0400", "\u04ff")]),
    ("Greek", [("\u0370", "\u03ff")]),
    ("Arabic", [("\u0600", "\u06ff")]),
    ("Hebrew", [("\u0590", "\u05ff")]),
    ("Devanagari", [("\u0900", "\u097f")]),
    ("Thai", [("\u0e00", "\u0e7f")]),
    ("Hangul", [("\uac00", "\ud7af"), ("\u1100", "\u11ff"), ("\u3130", "\u318f")]),
    ("Han", [("\u3040", "\u30ff"), ("\uff66", "\uff9f"), ("\u4e00", "\u9fff"), ("\u3400", "\u4dbf")]),  # Kana counts as Han
]


def script_of(c):
    for name, ranges in SCRIPTS:
        if any(a <= c <= b for a, b in ranges):
            return name
    return None


def new_script(context, answer):
    known = {script_of(c) for c in context} - {None}
    for c in answer:
        s = script_of(c)
        if s is not None and s not in known:
            return s
    return None


def log_softmax(v):
    v = np.asarray(v, dtype=np.float64)
    m = v.max()
    return v - m - np.log(np.exp(v - m).sum())


class Engine:
    def __init__(self, path, ctx):
        self.llm = Llama(model_path=path, n_ctx=ctx, n_threads=2, n_batch=512, logits_all=True, verbose=False)

    def logits(self, tokens):
        """Logits of every row of `tokens` from an empty cache."""
        self.llm.reset()
        self.llm.eval(tokens)
        return np.array(self.llm.scores[: len(tokens)], dtype=np.float64)

    def answer(self, prompt, n, stop):
        self.llm.reset()
        self.llm.eval(prompt)
        first = np.array(self.llm.scores[len(prompt) - 1], dtype=np.float64)
        row, out = first, []
        while len(out) < n:
            t = int(np.argmax(row))
            out.append(t)
            if t in stop or len(out) == n:
                break
            self.llm.eval([t])
            row = np.array(self.llm.scores[self.llm.n_tokens - 1], dtype=np.float64)
        return first, out

    def surprise(self, prompt, answer):
        rows = self.logits(prompt + answer)
        return float(np.mean([-log_softmax(rows[len(prompt) - 1 + i])[t] for i, t in enumerate(answer)]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump")
    ap.add_argument("--json")
    ap.add_argument("--limit", type=int, default=0, help="the first N conversations (0: all)")
    args = ap.parse_args()
    d = json.load(open(args.dump))
    if args.limit > 0:
        d["conversations"] = d["conversations"][: args.limit]
    n, stop = d["answer_tokens"], set(d["stop_tokens"])
    ctx = max(len(c["prompt"]) for c in d["conversations"]) + n + 8
    f16, q8 = Engine(d["f16"], ctx), Engine(d["q8_0"], ctx)
    detok = lambda ids: f16.llm.detokenize(ids).decode("utf-8", "replace")
    rows = []
    for c in d["conversations"]:
        p = c["prompt"]
        lf, af = f16.answer(p, n, stop)
        lq, aq = q8.answer(p, n, stop)
        pf, pq = log_softmax(lf), log_softmax(lq)
        kl = float(np.sum(np.exp(pf) * (pf - pq)))
        agree = next((i for i, (x, y) in enumerate(zip(af, aq)) if x != y), min(len(af), len(aq)))
        derail, excess = None, 0.0
        if aq != af:
            excess = f16.surprise(p, aq) - f16.surprise(p, af)
            s = new_script(detok(p) + detok(af), detok(aq))
            derail = f"script {s}" if s else (f"surprise {excess:.2f}" if excess > DERAIL_NATS else None)
        rows.append(dict(id=c["id"], kl=kl, agree=agree, same=aq == af, f16_is_f32=af == c["f32_answer"], derail=derail, excess_nats=excess))
        print(f"{c['id']:40s} kl {kl:.4f} agree {agree:2d} {'' if derail is None else 'DERAIL ' + derail}", file=sys.stderr)
    kls = np.array([r["kl"] for r in rows])
    summary = dict(
        name="llama.cpp Q8_0 against its own F16",
        conversations=len(rows),
        kl_mean=float(kls.mean()), kl_median=float(np.median(kls)), kl_p95=float(np.quantile(kls, 0.95)), kl_max=float(kls.max()),
        first_token_same=float(np.mean([r["agree"] > 0 for r in rows])),
        same_answer=float(np.mean([r["same"] for r in rows])),
        f16_answer_is_candle_npu_f32=float(np.mean([r["f16_is_f32"] for r in rows])),
        derailed=[dict(id=r["id"], why=r["derail"]) for r in rows if r["derail"]],
    )
    print(json.dumps(summary, indent=1))
    if args.json:
        json.dump(dict(summary=summary, per_conversation=rows), open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
