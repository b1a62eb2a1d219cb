"""The in-process ceiling: a model called in a tight loop, one thread, per batch size.

Run as its own process so that its torch thread settings and memory do not
leak into the orchestrator::

    python -m bench.ceiling MODEL.pt --features 64 --sizes 1,2,4,8,16,32 --seconds 1.5

prints ``{"items_per_s": {"1": ..., ...}, "batch_ms": {...}, "other_cpu_util": ...}``
as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from typing import Any

import torch

from bench.proctree import system_busy_seconds


def measure(module: Any, features: int, size: int, seconds: float) -> tuple[float, float]:
    """``(items per second, ms per batch)`` of ``module`` at batch ``size``."""
    x = torch.randn(size, features, generator=torch.Generator().manual_seed(size))
    with torch.inference_mode():
        # TorchScript's profiling executor optimizes after the first calls: keep
        # those out, as a server's warm-up does.
        warm_end = time.perf_counter() + min(0.5, seconds / 3)
        calls = 0
        while calls < 3 or time.perf_counter() < warm_end:
            module(x)
            calls += 1
        calls = 0
        t0 = time.perf_counter()
        end = t0 + seconds
        while True:
            module(x)
            calls += 1
            now = time.perf_counter()
            if now >= end:
                break
    elapsed = now - t0
    return calls * size / elapsed, 1e3 * elapsed / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ceiling")
    p.add_argument("model", help="TorchScript .pt file")
    p.add_argument("--features", type=int, required=True, help="input floats per item")
    p.add_argument("--sizes", default="1,2,4,8,16,32")
    p.add_argument("--seconds", type=float, default=1.5, help="timed seconds per size")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation notice
        module = torch.jit.load(args.model, map_location="cpu").eval()
    items: dict[str, float] = {}
    batch_ms: dict[str, float] = {}
    busy0, own0, t0 = system_busy_seconds(), time.process_time(), time.perf_counter()
    for size in (int(s) for s in args.sizes.split(",")):
        items[str(size)], batch_ms[str(size)] = measure(module, args.features, size, args.seconds)
    busy1, own1, t1 = system_busy_seconds(), time.process_time(), time.perf_counter()
    # Cores kept busy by anything but this process: a shared machine shows here.
    other = ((busy1 - busy0) - (own1 - own0)) / (t1 - t0)
    print(json.dumps({"items_per_s": items, "batch_ms": batch_ms, "other_cpu_util": other}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
