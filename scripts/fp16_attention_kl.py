#!/usr/bin/env python3
"""What FP16 attention on the NPU would cost a Llama-family prefill in accuracy, estimated.

A float forward of the GGUF's own (dequantized) weights in numpy, run twice per conversation:
attention in float32, and attention with q, k, v, the scores, the masked scores, the softmax
weights and the output each rounded to FP16 (as the HTP rounds its float ops), the weights
optionally also moved by a relative error uniform in +-NOISE (the library's Softmax is up to
0.4% off, `docs/npu_layers.md`). Prints the first-token KL(float || FP16) over the chat eval's
rendered prompts, which `cargo run --release --example eval -- --sections chat --chat-dump FILE`
writes. Needs numpy and the `gguf` package; never in CI.

    python3 scripts/fp16_attention_kl.py MODEL.gguf FILE N_CONVERSATIONS [NOISE]
"""
import json, sys
import numpy as np
import gguf
from gguf import quants
path, dump, n_conv = sys.argv[1], sys.argv[2], int(sys.argv[3])
NOISE = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
rng = np.random.default_rng(0)
r = gguf.GGUFReader(path)
def kv(name):
    f = r.fields[name]; return f.parts[f.data[0]].tolist()[0]
nl = kv('llama.block_count'); nh = kv('llama.attention.head_count'); nkv = kv('llama.attention.head_count_kv')
eps = float(kv('llama.attention.layer_norm_rms_epsilon')); theta = float(kv('llama.rope.freq_base'))
T = {t.name: t for t in r.tensors}
def W(name):
    t = T[name]; return np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
emb = W('token_embd.weight'); hid = emb.shape[1]; hd = hid // nh
L = [{n: W(f'blk.{l}.{n}.weight') for n in ['attn_norm','attn_q','attn_k','attn_v','attn_output','ffn_norm','ffn_gate','ffn_up','ffn_down']} for l in range(nl)]
onorm = W('output_norm.weight')
h16 = lambda x: x.astype(np.float16).astype(np.float32)
def rms(x, w): return x / np.sqrt((x*x).mean(-1, keepdims=True) + eps) * w
def rope(x, pos):
    inv = theta ** (-np.arange(0, hd, 2) / hd); ang = pos[:, None] * inv[None]
    c, s = np.cos(ang)[:, None].astype(np.float32), np.sin(ang)[:, None].astype(np.float32)
    x0, x1 = x[..., 0::2], x[..., 1::2]; out = np.empty_like(x)
    out[..., 0::2] = x0*c - x1*s; out[..., 1::2] = x0*s + x1*c; return out
def last_logits(tokens, fp16):
    x = emb[tokens]; t = len(tokens); pos = np.arange(t, dtype=np.float64)
    mask = np.triu(np.full((t, t), -30000.0, dtype=np.float32), 1)
    g = nh // nkv
    for w in L:
        h = rms(x, w['attn_norm'])
        q = rope((h @ w['attn_q'].T).reshape(t, nh, hd), pos) / np.float32(np.sqrt(hd))
        k = rope((h @ w['attn_k'].T).reshape(t, nkv, hd), pos); v = (h @ w['attn_v'].T).reshape(t, nkv, hd)
        if fp16: q, k, v = h16(q), h16(k), h16(v)
        o = np.empty((t, nh, hd), np.float32)
        for i in range(nh):
            s = q[:, i] @ k[:, i // g].T
            if fp16: s = h16(h16(s) + mask)
            else: s = s + mask
            p = np.exp(s - s.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
            if fp16: p = h16(p * (1 + NOISE * rng.uniform(-1, 1, p.shape).astype(np.float32)))
            oi = p @ v[:, i // g]
            o[:, i] = h16(oi) if fp16 else oi
        x = x + o.reshape(t, hid) @ w['attn_output'].T
        h = rms(x, w['ffn_norm'])
        a = h @ w['ffn_gate'].T; a = a / (1 + np.exp(-a)) * (h @ w['ffn_up'].T)
        x = x + a @ w['ffn_down'].T
    return (rms(x[-1:], onorm) @ emb.T)[0].astype(np.float64)
def logsm(z): z = z - z.max(); return z - np.log(np.exp(z).sum())
convs = json.load(open(dump))['conversations'][:n_conv]
kls, same, forward_ok = [], 0, 0
for c in convs:
    a, b = logsm(last_logits(c['prompt'], False)), logsm(last_logits(c['prompt'], True))
    kls.append(float((np.exp(a) * (a - b)).sum())); same += int(a.argmax() == b.argmax())
    # This forward against candle-npu's F32 prefill: the same greedy first token.
    forward_ok += int(a.argmax() == c['f32_answer'][0])
kls = np.array(kls)
print(f'{len(convs)} conversations: first-token KL(f32 attention || FP16 attention) mean {kls.mean():.2e} median {np.median(kls):.2e} max {kls.max():.2e}; first token same {same}/{len(convs)}; the float forward agrees with the F32 prefill on the first token in {forward_ok}/{len(convs)}')
