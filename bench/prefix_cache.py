"""Prefix caching: time to first token of a chat whose long system prompt is cached.

    python -m bench.prefix_cache --model-dir models/smollm2-135m [--rounds 20] \
        [--system-tokens 1000] [--out-dir bench]

One aserve serves the same folder (SmolLM2-135M-Instruct from
``scripts/convert-smollm2``) as two models: ``cached`` (``prefix_caching``
on, the default) and ``plain`` (off), each float32, ``cpu_threads`` 1, in
its own step process, 4 slots of 2048 tokens. Every round sends one chat
(a system prompt of about ``--system-tokens`` tokens, the same every round,
and a short user turn that differs every round) to each model, streamed over
raw aiohttp SSE, greedy, 4 tokens; the order of the two alternates per
round. TTFT is the time from sending to the first content chunk. The first
request of each model (the cached one's miss) is reported apart, not in the
rounds. Also checked: each round's two answers are equal, and the usage's
``prompt_tokens_details.cached_tokens``.

Writes ``RESULTS-prefix-cache.md`` and ``results-prefix-cache.json`` into
``--out-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.loadgen import percentile
from bench.report import row_facts
from bench.servers import start_aserve

REPO = Path(__file__).resolve().parent.parent
TARGET = 5.0  # uncached TTFT over cached, at least (issue 30 item 7)
SENTENCES = [
    "You are a careful assistant for a team that runs inference servers.",
    "Answer briefly, name the setting that matters, and say what it costs.",
    "A request carries a deadline; a batch is cut when an instance is free.",
    "Streams are bounded, and a reader that falls behind pauses its sequence.",
    "The KV cache is preallocated, one slot per sequence, for every layer.",
    "When a client goes away its sequence leaves and its slot is freed at once.",
    "Metrics follow Prometheus naming; every counter ends in a unit or a total.",
    "Configuration is frozen, each field documented, with units in its name.",
]


def system_prompt(model_dir: Path, tokens: int) -> str:
    """Sentences repeated (numbered, so no two are equal) up to ``tokens`` tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    parts: list[str] = []
    i = 0
    while len(tok.encode(" ".join(parts)).ids) < tokens:
        parts.append(f"({i}) {SENTENCES[i % len(SENTENCES)]}")
        i += 1
    return " ".join(parts[:-1])


def config(model_dir: Path) -> dict[str, Any]:
    def entry(name: str, caching: bool) -> dict[str, Any]:
        return {
            "name": name,
            "engine": "decoder",
            "path": str(model_dir),
            "device": "cpu",
            "cpu_threads": 1,
            "generation": {
                "max_num_seqs": 4,
                "max_model_len": 2048,
                "max_tokens_default": 16,
                "prefix_caching": caching,
            },
        }

    return {
        "http": {"host": "127.0.0.1", "port": 0},
        "logging": {"access_log": False},
        "models": [entry("cached", True), entry("plain", False)],
    }


async def one_chat(session: Any, base: str, model: str, system: str, user: str) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    ttft, text, usage = None, "", None
    async with session.post(f"{base}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{model}: {r.status} {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            doc = json.loads(payload)
            if doc.get("usage"):
                usage = doc["usage"]
            for choice in doc["choices"]:
                piece = choice["delta"].get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - sent
                    text += piece
    assert usage is not None and ttft is not None
    return {
        "ttft_ms": 1e3 * ttft,
        "text": text,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
    }


async def measure(base: str, system: str, rounds: int) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        first = {m: await one_chat(session, base, m, system, "Hello!") for m in ("cached", "plain")}
        got: dict[str, list[dict[str, Any]]] = {"cached": [], "plain": []}
        for i in range(rounds):
            order = ("cached", "plain") if i % 2 == 0 else ("plain", "cached")
            user = f"Question {i}: what does setting number {i} change?"
            for m in order:
                got[m].append(await one_chat(session, base, m, system, user))
    return {"first": first, "rounds": got}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = sorted(r["ttft_ms"] for r in runs)
    return {
        "ttft_ms_p50": round(statistics.median(ttft), 1),
        "ttft_ms_p90": round(percentile(ttft, 90), 1),
        "ttft_ms_min": round(ttft[0], 1),
        "ttft_ms_max": round(ttft[-1], 1),
        "cached_tokens": sorted({r["cached_tokens"] for r in runs}),
        "prompt_tokens": sorted({r["prompt_tokens"] for r in runs}),
    }


def render(res: dict[str, Any]) -> str:
    f, c, p = res["facts"], res["cached"], res["plain"]
    lines = [
        "# Prefix caching: TTFT with a cached system prompt",
        "",
        f"`{f['command']}` — {f['date']}, {f['cpu']}, {f['cores']} cores, "
        f"Python {f['python']}, torch {f['torch']}; load average before "
        f"{f['loadavg_before']}, after {f['loadavg_after']}.",
        "",
        f"SmolLM2-135M-Instruct, float32, one torch thread per step process; "
        f"{res['rounds']} rounds, each one chat to each model (order alternating), "
        f"a {p['prompt_tokens']} -token prompt (the system prompt the same every round, "
        "the user turn new), greedy, 4 tokens, streamed.",
        "",
        "| model | TTFT p50 ms | p90 | min | max | cached_tokens |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in (("plain (prefix_caching off)", p), ("cached", c)):
        lines.append(
            f"| {name} | {s['ttft_ms_p50']} | {s['ttft_ms_p90']} | {s['ttft_ms_min']} | "
            f"{s['ttft_ms_max']} | {s['cached_tokens']} |"
        )
    first = res["first"]
    lines += [
        "",
        f"**Uncached / cached TTFT (p50): {res['ratio_p50']}x** (target >= {TARGET}x: "
        f"{'met' if res['ratio_p50'] >= TARGET else 'NOT met'}); p90 ratio {res['ratio_p90']}x.",
        "",
        f"First request of each (the cached model's miss): cached {first['cached']['ttft_ms']:.1f} ms "
        f"(cached_tokens {first['cached']['cached_tokens']}), plain "
        f"{first['plain']['ttft_ms']:.1f} ms.",
        "",
        f"Rounds whose two answers differ: {res['mismatches']} of {res['rounds']}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--out-dir", type=Path, default=REPO / "bench")
    args = p.parse_args(argv)
    load_before = [round(x, 2) for x in os.getloadavg()]
    system = system_prompt(args.model_dir, args.system_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "config.json"
        cfg.write_text(json.dumps(config(args.model_dir.resolve())))
        with start_aserve(cfg, REPO) as srv:
            got = asyncio.run(measure(srv.base_url, system, args.rounds))
    cached, plain = got["rounds"]["cached"], got["rounds"]["plain"]
    res: dict[str, Any] = {
        "facts": row_facts("bench.prefix_cache", argv, load_before),
        "rounds": args.rounds,
        "first": {m: {k: v for k, v in r.items() if k != "text"} for m, r in got["first"].items()},
        "cached": summary(cached),
        "plain": summary(plain),
        "mismatches": sum(a["text"] != b["text"] for a, b in zip(cached, plain, strict=True)),
    }
    res["ratio_p50"] = round(res["plain"]["ttft_ms_p50"] / res["cached"]["ttft_ms_p50"], 2)
    res["ratio_p90"] = round(res["plain"]["ttft_ms_p90"] / res["cached"]["ttft_ms_p90"], 2)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results-prefix-cache.json").write_text(json.dumps(res, indent=2) + "\n")
    text = render(res)
    (args.out_dir / "RESULTS-prefix-cache.md").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
