"""Issue 19: the mean batch of ``c`` closed-loop clients on one instance.

The model is a python handler whose batch of ``k`` sleeps ``fixed + per_item
* k`` ms (the GIL released, as a device's kernels release it), so the cost
curve is the one asked for on a machine of any speed, and the server's own
CPU per request is all that varies. ``c`` keep-alive connections
(:func:`bench.loadgen.run_load`) each keep one request in flight; the
server's ``/stats`` say which batches ran in the window. With ``fixed`` large
against ``per_item`` a batch of ``c`` serves the clients sooner than turns of
smaller ones, and the batcher should find it (policy rule 4); with
``fixed = 0`` nothing pays, and it should not wait.

    python -m bench.closed_loop [--concurrency 16] [--fixed-ms 20] [--per-item-ms 2]
        [--max-delay-ms 5] [--executor thread|process] [--duration 5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from bench.loadgen import run_load
from bench.servers import start_aserve
from bench.stats import window_delta

_HANDLER = """
import time

import numpy as np


class FixedCost:
    def load(self, context):
        self.fixed = float(context.parameters["fixed_ms"]) / 1e3
        self.per_item = float(context.parameters["per_item_ms"]) / 1e3

    def warmup_request(self):
        return {"X": np.zeros((1, 2), np.float32)}

    def preprocess(self, request):
        return {"x": request.inputs["X"]}

    def infer(self, batch):
        time.sleep(self.fixed + self.per_item * len(batch["x"]))
        return {"y": batch["x"].sum(axis=1, keepdims=True)}

    def postprocess(self, outputs, request):
        return {"Y": outputs["y"]}
"""

_BODY = b'{"inputs":[{"name":"X","shape":[1,2],"datatype":"FP32","data":[1,2]}]}'


def _stats(base: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base}/v2/models/m/stats", timeout=10) as r:
        entry: dict[str, Any] = json.loads(r.read())["model_stats"][0]
    return entry


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="aserve-closed-") as tmp:
        folder = Path(tmp)
        (folder / "fixed_cost.py").write_text(_HANDLER)
        model = {
            "name": "m", "engine": "python", "handler": "fixed_cost:FixedCost",
            "parameters": {"fixed_ms": args.fixed_ms, "per_item_ms": args.per_item_ms},
            "instances": 1, "executor": args.executor,
            "inputs": [{"name": "X", "datatype": "FP32", "shape": [2]}],
            "outputs": [{"name": "Y", "datatype": "FP32", "shape": [1]}],
            "batching": {"max_batch_size": args.max_batch, "max_delay_ms": args.max_delay_ms,
                         "timeout_ms": 5000},
        }  # fmt: skip
        config = folder / "aserve.json"
        config.write_text(json.dumps({"http": {"host": "127.0.0.1"}, "models": [model]}))
        with start_aserve(config, folder) as server:
            base = server.base_url
            snaps: dict[str, dict[str, Any]] = {}
            result = asyncio.run(run_load(
                f"{base}/v2/models/m/infer", _BODY, args.concurrency, args.duration,
                args.warmup, on_window_start=lambda: snaps.__setitem__("start", _stats(base)),
                on_window_end=lambda: snaps.__setitem__("end", _stats(base)),
            ))  # fmt: skip
    stats = window_delta(snaps["start"], snaps["end"], result.duration_s)
    return {
        "settings": vars(args), "rps": result.rps, "p50_ms": result.p50_ms,
        "p99_ms": result.p99_ms, "errors": result.errors,
        "mean_batch": stats["mean_batch_size"], "batches_by_size": stats["batches_by_size"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.closed_loop", description=__doc__)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--fixed-ms", type=float, default=20.0)
    p.add_argument("--per-item-ms", type=float, default=2.0)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-delay-ms", type=float, default=5.0)
    p.add_argument("--executor", choices=("thread", "process"), default="thread")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = measure(args)
    if args.json:
        print(json.dumps(out))
    else:
        top = sorted(out["batches_by_size"].items(), key=lambda kv: -kv[1])[:4]
        print(f"c={args.concurrency} fixed {args.fixed_ms} ms + {args.per_item_ms} ms/item, "
              f"{args.executor}: {out['rps']:.1f} req/s, p50 {out['p50_ms']:.1f} ms, "
              f"mean batch {out['mean_batch']:.2f} (most: {dict(top)}), errors {out['errors']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
