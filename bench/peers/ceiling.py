"""In-process reference for the peers run: the expected answers and MiniLM's ceiling.

    python -m bench.peers.ceiling [--seconds 1.5] [--sizes 1,8,16,32]

Runs in its own process (one torch thread) and prints one JSON line:
``expected`` (the model's own output for each workload's request) and
``minilm`` (sentences per second at each batch size, tokenizing included,
as the servers do: the ceiling a server's throughput is measured against).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "apps"))

import common

from bench.proctree import system_busy_seconds


def measure(model: common.MiniLM, size: int, seconds: float) -> tuple[float, float]:
    texts = [common.SENTENCE] * size
    warm_end = time.perf_counter() + min(0.5, seconds / 3)
    calls = 0
    while calls < 2 or time.perf_counter() < warm_end:
        model(texts)
        calls += 1
    calls, t0 = 0, time.perf_counter()
    while True:
        model(texts)
        calls += 1
        now = time.perf_counter()
        if now - t0 >= seconds:
            break
    return calls * size / (now - t0), 1e3 * (now - t0) / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.ceiling")
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--sizes", default="1,4,8,16,32")
    p.add_argument("--no-ceiling", action="store_true", help="only the expected answers")
    args = p.parse_args(argv)
    common.set_threads()
    tiny_in = common.tiny_input()
    expected = {"tiny": [v + 1.0 for v in tiny_in]}
    model = common.MiniLM()
    expected["minilm"] = [float(v) for v in model([common.SENTENCE])[0]]
    out: dict = {"expected": expected}
    if not args.no_ceiling:
        items, batch_ms = {}, {}
        busy0, own0, t0 = system_busy_seconds(), time.process_time(), time.perf_counter()
        for size in (int(s) for s in args.sizes.split(",")):
            items[str(size)], batch_ms[str(size)] = measure(model, size, args.seconds)
        busy1, own1, t1 = system_busy_seconds(), time.process_time(), time.perf_counter()
        best = max(items, key=lambda k: items[k])
        out["minilm"] = {
            "items_per_s": items, "batch_ms": batch_ms, "best_batch_size": int(best),
            "best_items_per_s": items[best],
            "other_cpu_util": ((busy1 - busy0) - (own1 - own0)) / (t1 - t0),
        }  # fmt: skip
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
