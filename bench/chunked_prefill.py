"""Long prompts against running streams: inter-token latency of 8 streams while
2,000-token prompts arrive, against the same streams alone.

    python -m bench.chunked_prefill --model-dir models/smollm2-135m \
        [--streams 8] [--long-prompts 2] [--long-tokens 2000] [--quiet-seconds 30] \
        [--generation '{"max_prefill_tokens": 2048}'] [--out-dir bench] [--tag before]

One aserve serves SmolLM2-135M-Instruct (``scripts/convert-smollm2``), float32,
``cpu_threads`` 1, in its step process, ``max_num_seqs`` 10, ``max_model_len``
2304, prefix caching off (every long prompt is new anyway); ``--generation``
adds or overrides settings. ``--streams`` streams (greedy, ``ignore_eos``,
long enough never to finish meanwhile) are started and left to run a few
steps. Then two windows, each measuring the gaps between successive chunks
of every stream:

- quiet: ``--quiet-seconds`` with nothing else, half of it before the
  loaded window and half after (the machine's other load drifts; both
  halves are pooled);
- loaded: ``--long-prompts`` prompts of ``--long-tokens`` token ids (distinct)
  sent one after another, each waiting for its answer (``max_tokens`` 1); the
  window runs from the first one sent to the last one answered.

The ratio reported is the loaded window's inter-token p99 over the quiet
window's. Writes ``RESULTS-chunked-prefill-<tag>.json`` into ``--out-dir``
and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.loadgen import percentile
from bench.report import row_facts
from bench.servers import start_aserve

REPO = Path(__file__).resolve().parent.parent
MODEL = "lm"


def config(model_dir: Path, generation: dict[str, Any]) -> dict[str, Any]:
    return {
        "http": {"host": "127.0.0.1", "port": 0},
        "logging": {"access_log": False},
        "models": [
            {
                "name": MODEL,
                "engine": "decoder",
                "path": str(model_dir),
                "device": "cpu",
                "cpu_threads": 1,
                "generation": {
                    "max_num_seqs": 10,
                    "max_model_len": 2304,
                    "max_tokens_cap": 2300,
                    "prefix_caching": False,
                    **generation,
                },
            }
        ],
    }


class Gaps:
    """Chunk arrival times of every stream, cut into windows afterwards."""

    def __init__(self, streams: int) -> None:
        self.arrivals: list[list[float]] = []
        self.started = [asyncio.Event() for _ in range(streams)]  # set at a stream's 5th chunk


async def stream(session: Any, base: str, i: int, gaps: Gaps, stop: asyncio.Event) -> None:
    times: list[float] = []
    gaps.arrivals.append(times)
    body = {
        "model": MODEL,
        "prompt": f"Stream {i} tells a long story about rivers and stones.",
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with session.post(f"{base}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            if line[6:].strip() == b"[DONE]":
                break
            times.append(time.perf_counter())
            if len(times) == 5:
                gaps.started[i].set()
            if stop.is_set():
                break


def window(gaps: Gaps, t0: float, t1: float) -> list[float]:
    """Gaps (ms) between successive chunks of each stream, the later one in [t0, t1]."""
    out = []
    for times in gaps.arrivals:
        out += [1e3 * (b - a) for a, b in itertools.pairwise(times) if t0 <= b <= t1]
    return sorted(out)


def stats(ms: list[float]) -> dict[str, Any]:
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 1),
        "p99_ms": round(percentile(ms, 99), 1),
        "max_ms": round(ms[-1], 1) if ms else None,
    }


async def measure(base: str, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    gaps, stop = Gaps(args.streams), asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [
            asyncio.create_task(stream(session, base, i, gaps, stop)) for i in range(args.streams)
        ]
        await asyncio.gather(*(e.wait() for e in gaps.started))  # each stream is running
        q0 = time.perf_counter()
        await asyncio.sleep(args.quiet_seconds / 2)
        q1 = l0 = time.perf_counter()
        ttft = []
        for k in range(args.long_prompts):
            ids = [(100 + 7 * k + j) % 40000 + 50 for j in range(args.long_tokens)]
            sent = time.perf_counter()
            body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0}
            async with session.post(f"{base}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
            ttft.append(round(1e3 * (time.perf_counter() - sent), 1))
        l1 = q2 = time.perf_counter()
        await asyncio.sleep(args.quiet_seconds / 2)
        q3 = time.perf_counter()
        stop.set()
        await asyncio.gather(*tasks)
    quiet = stats(sorted(window(gaps, q0, q1) + window(gaps, q2, q3)))
    loaded = stats(window(gaps, l0, l1))
    return {
        "quiet": quiet,
        "loaded": loaded,
        "loaded_seconds": round(l1 - l0, 1),
        "long_prompt_latency_ms": ttft,
        "p99_ratio": round(loaded["p99_ms"] / quiet["p99_ms"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--long-prompts", type=int, default=2)
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--quiet-seconds", type=float, default=40.0)
    p.add_argument("--generation", type=json.loads, default={})
    p.add_argument("--out-dir", type=Path, default=REPO / "bench")
    p.add_argument("--tag", default="run")
    args = p.parse_args(argv)
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "config.json"
        cfg.write_text(json.dumps(config(args.model_dir.resolve(), args.generation)))
        with start_aserve(cfg, REPO) as srv:
            res = asyncio.run(measure(srv.base_url, args))
    res = {
        "facts": row_facts("bench.chunked_prefill", argv, load_before),
        "generation": args.generation,
        **res,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"results-chunked-prefill-{args.tag}.json").write_text(
        json.dumps(res, indent=2) + "\n"
    )
    sys.stdout.write(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
