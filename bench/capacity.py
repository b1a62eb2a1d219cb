"""The in-process rate of N instances of a model: the capacity a server is measured against.

    python -m bench.capacity {mlp,minilm} --instances N [--batch 32] [--seconds 2] [--path F]

Each instance is its own copy of the model in its own thread (one torch
thread each, as aserve runs them), running batches of ``batch`` back to back
for ``seconds``; all run at once. MiniLM's rate includes tokenizing, as a
server's does. Also times one batch of each of a few sizes on one instance
(``batch_ms``), so that a caller can size a burst that one batch serves.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _mlp(path: Path) -> Callable[[int], Callable[[], Any]]:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = torch.jit.load(str(path), map_location="cpu").eval()

    def batch_of(n: int) -> Callable[[], Any]:
        x = torch.randn(n, 64)

        def run() -> Any:
            with torch.inference_mode():
                return module(x)

        return run

    return batch_of


def _minilm() -> Callable[[int], Callable[[], Any]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers" / "apps"))
    import common

    model = common.MiniLM()

    def batch_of(n: int) -> Callable[[], Any]:
        texts = [common.SENTENCE] * n
        return lambda: model(texts)

    return batch_of


def _loop(run: Callable[[], Any], seconds: float, start: threading.Barrier, out: list[int]) -> None:
    run()
    run()  # warm
    start.wait()
    calls, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        run()
        calls += 1
    out.append(calls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.capacity")
    p.add_argument("model", choices=["mlp", "minilm"])
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--sizes", default="8,16,32", help="sizes timed alone, for batch_ms")
    p.add_argument("--path", type=Path, help="the MLP's TorchScript file")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    make = [(_mlp(args.path) if args.model == "mlp" else _minilm()) for _ in range(args.instances)]
    batch_ms = {}
    for size in (int(s) for s in args.sizes.split(",")):
        run = make[0](size)
        run()
        t0, n = time.perf_counter(), 0
        while n < 3 or time.perf_counter() - t0 < 0.3:
            run()
            n += 1
        batch_ms[str(size)] = 1e3 * (time.perf_counter() - t0) / n
    start = threading.Barrier(args.instances)
    counts: list[int] = []
    threads = [threading.Thread(target=_loop, args=(m(args.batch), args.seconds, start, counts))
               for m in make]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    items_per_s = sum(counts) * args.batch / args.seconds
    print(json.dumps({"model": args.model, "instances": args.instances, "batch": args.batch,
                      "items_per_s": items_per_s, "batch_ms": batch_ms}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
