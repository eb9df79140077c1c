#!/usr/bin/env python3
"""The `server` example through the real `openai` Python client (tests/server.rs runs this).

    python3 tests/openai_client.py BASE_URL            # the checks; prints "ok"
    python3 tests/openai_client.py BASE_URL --bench N  # aggregate decode tokens/s of 1 and N streams
    python3 tests/openai_client.py BASE_URL --bench N --raw  # the same, read by a light client
    (either with `--rounds R`: R rounds of 1 stream then N, 3 by default)

The checks: /v1/models lists the model; chat (streamed and not) and completions (streamed and
not) answer, a stream's text is the whole answer's; four concurrent greedy streams each give
the text their conversation gives alone; a bad request is a 400 the client raises.
"""
import http.client
import json
import sys
import threading
import time
import urllib.parse

import openai

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "My name is Bob and I live in Tokyo.",
]


def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(c, question, max_tokens=24):
    r = c.chat.completions.create(model="any", messages=[{"role": "user", "content": question}], max_tokens=max_tokens)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


def chat_stream(c, question, max_tokens=24, times=None):
    text = ""
    for chunk in c.chat.completions.create(model="any", messages=[{"role": "user", "content": question}], max_tokens=max_tokens, stream=True):
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            if times is not None:
                times.append(time.monotonic())
            text += delta
    return text


def chat_stream_raw(base, question, max_tokens, times):
    """`chat_stream` without the `openai` client: the events read off the socket and each
    parsed with `json` only, so that a benchmark can tell the server's own cost from its
    client's, which shares the server's cores (`docs/server.md`)."""
    u = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = json.dumps({"model": "any", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "stream": True})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.status
    text = ""
    for line in r:
        if not line.startswith(b"data: {"):
            continue
        choices = json.loads(line[6:]).get("choices") or [{}]
        delta = choices[0].get("delta", {}).get("content")
        if delta:
            times.append(time.monotonic())
            text += delta
    conn.close()
    return text


def checks(base):
    c = client(base)
    ids = [m.id for m in c.models.list()]
    assert len(ids) == 1, ids

    whole, reason, usage = chat(c, QUESTIONS[0])
    assert whole and reason in ("stop", "length"), (whole, reason)
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 24, usage
    assert chat_stream(c, QUESTIONS[0]) == whole, "a streamed chat answer differs from the whole one"

    r = c.completions.create(model="any", prompt="The capital of France is", max_tokens=8)
    text = r.choices[0].text
    assert text and r.choices[0].finish_reason in ("stop", "length"), r
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model="any", prompt="The capital of France is", max_tokens=8, stream=True))
    assert streamed == text, (streamed, text)

    # Four conversations at once, each streamed: the same text as alone.
    alone = [chat(c, q)[0] for q in QUESTIONS]
    got = [None] * len(QUESTIONS)

    def run(i):
        got[i] = chat_stream(client(base), QUESTIONS[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(QUESTIONS))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for q, a, g in zip(QUESTIONS, alone, got):
        assert g == a, f"{q!r}: {g!r} at once, {a!r} alone"

    try:
        c.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=0)
        raise AssertionError("max_tokens 0 was accepted")
    except openai.BadRequestError as e:
        assert "max_tokens" in str(e), e
    print("ok")


def bench(base, n, raw=False, tokens=128, rounds=3):
    """Aggregate decode tokens/s of `n` concurrent streams against one, `rounds` times each
    (`raw`: read by `chat_stream_raw`, not the `openai` client)."""
    out = []
    for r in range(rounds):
        for streams in (1, n):
            times = [[] for _ in range(streams)]

            def run(i):
                # Distinct prompts; long answers (no early stop token expected at this length).
                question = f"Write a long story about a lighthouse keeper, part {i + 1}."
                if raw:
                    chat_stream_raw(base, question, tokens, times[i])
                else:
                    chat_stream(client(base), question, tokens, times[i])

            threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            # Decode: from the last stream's first token to the last token of any stream.
            start = max(t[0] for t in times)
            end = max(t[-1] for t in times)
            pieces = sum(sum(1 for x in t if x >= start) for t in times)
            out.append({"round": r + 1, "streams": streams, "pieces": pieces, "secs": end - start, "pieces_per_sec": pieces / (end - start)})
    print(json.dumps(out))


if __name__ == "__main__":
    base = sys.argv[1]
    if len(sys.argv) > 3 and sys.argv[2] == "--bench":
        rest = sys.argv[4:]
        rounds = int(rest[rest.index("--rounds") + 1]) if "--rounds" in rest else 3
        bench(base, int(sys.argv[3]), raw="--raw" in rest, rounds=rounds)
    else:
        checks(base)
